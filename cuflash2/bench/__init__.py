"""`python -m cuflash2 bench`: the benchmarks of the command line, and the pieces the scripts in
benchmarks/ reuse. Not needed to run attention: the core modules never import this package.

Modules, each importing only those listed before it:

- `timing`: CUDA-event timing behind a spinning backlog kernel, the L2 flush, the copy ceiling;
- `torch_peers`: torch SDPA (flash and cuDNN backends) on the same arrays, and its refusals;
- `paper_grid`: the FlashAttention-2 paper's grid: configurations, FLOPs, inputs, rows, tables;
- `windows`, `varlen`: the `--windows` and `--varlen` tables;
- `decode_graph`: a decoding step of several layers captured as a CUDA graph;
- `decode_peers`: torch SDPA's decoding next to it (`--decode --compare torch`);
- `decode`: the `--decode` tables, single steps and steps in a graph;
- `report`: the default `bench` run, the grid and the tables its options add;
- `host`, `flex`: `bench --host` and `bench --flex`.
"""
