"""In-graph decoding step (cuflash2/bench_decode_graph.py) under variants of the launch and the
split merge: programmatic launches on / off, the splits merged inside a thread-block cluster or
through the barrier in L2, forced split counts (0: the rule). Prints us per layer for each
(batch, cache) row.

    PYTHONPATH=. python3 benchmarks/dev/decode_graph_sweep.py [--iters 30] [--splits 0 16 32]
"""

import argparse

import cupy

from cuflash2 import _kvcache, _launch, bench_decode_graph
from cuflash2.bench import Backlog, copy_ceiling, decode_bytes, l2_flush


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--splits", type=int, nargs="+", default=[0])
    parser.add_argument("--merge", nargs="+", default=["cluster", "barrier"])
    parser.add_argument("--pdl", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--rows", nargs="+", default=None, help="BATCHxCACHE, e.g. 1x16384")
    args = parser.parse_args()
    rows = bench_decode_graph.GRAPH_ROWS
    if args.rows:
        rows = [tuple(int(x) for x in r.split("x")) for r in args.rows]
    ceiling = copy_ceiling(cupy)
    flush = l2_flush(cupy)
    backlog = Backlog(cupy)
    nheads, nheads_kv = bench_decode_graph.GRAPH_HEADS
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s; us per layer ({bench_decode_graph.LAYERS} "
          f"layers a step, L2 flushed before each step)")
    for batch, cache in rows:
        moved = decode_bytes(batch, cache, nheads, nheads_kv, 128)
        for splits in args.splits:
            for merge in args.merge:
                for programmatic in args.pdl:
                    _launch.PROGRAMMATIC = bool(programmatic)
                    _kvcache.CLUSTER_MERGE = merge == "cluster"
                    _kvcache._plans_by_key.plans.clear()
                    step = bench_decode_graph.DecodeStep(cupy, batch, cache, nheads, nheads_kv,
                                                         num_splits=splits)
                    planned = next(iter(_kvcache._plans_by_key.plans.values()))
                    launch = planned.plan.launches[0]
                    ms = bench_decode_graph.time_step(cupy, step, args.warmup, args.iters,
                                                      backlog, flush)
                    us = ms * 1e3 / bench_decode_graph.LAYERS
                    print(f"b={batch} cache={cache:6d} splits={splits:3d}->{planned.splits:3d} "
                          f"cluster={launch.cluster:2d} pdl={int(launch.programmatic)}: "
                          f"{us:7.2f} us/layer {moved / (us * 1e-6) / ceiling:5.0%} of copy",
                          flush=True)
                    del step
    _kvcache.CLUSTER_MERGE = True
    _launch.PROGRAMMATIC = True


if __name__ == "__main__":
    main()
