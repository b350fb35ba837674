"""`python -m cuflash2 bench` (without --host or --flex): the paper grid's table and the tables
its options add (--windows, --varlen, --decode), printed as one markdown report on stdout
(progress on stderr) and saved with the environment and the settings by --json.
"""

from __future__ import annotations

import sys

from .decode import decode_graph_table, decode_table, measure_decode, measure_decode_graph
from .decode_graph import LAYERS
from .decode_peers import GRAPH_NOTE, SINGLE_STEP_NOTE, peer_notes
from .paper_grid import (BACKWARD_FLOP_FACTOR, DEFAULT_HEADDIMS, PAPER_SEQLENS, causal_modes,
                   cudnn_notes, directions, environment_header, grid_headdims, markdown_table,
                   measure, paper_grid, summarize, summary_table)
from .torch_peers import cudnn_version, load_torch
from .varlen import VARLEN_LENGTHS, measure_varlen, varlen_table
from .windows import measure_windows, windows_table


def run(cupy, args) -> int:
    """Measure, print the markdown report on stdout (progress goes to stderr), save --json."""
    import json

    import cuflash2

    from .. import _environment

    wanted = directions(args.direction)
    if "bwd" in wanted and not hasattr(cuflash2, "attention_backward"):
        print("note: backward is not available yet in cuflash2; skipping --direction bwd",
              file=sys.stderr)
        wanted = tuple(d for d in wanted if d != "bwd")
        if not wanted:
            return 0
    headdims, min_seqlen = grid_headdims(args.headdim)
    seqlens = args.seqlens or PAPER_SEQLENS
    configs = paper_grid(headdims, args.dtype, causal_modes(args.causal), seqlens,
                         wanted, args.tokens, args.hidden, min_seqlen)
    extra_headdims = args.headdim or DEFAULT_HEADDIMS  # the windows and varlen tables
    torch = load_torch() if args.compare == "torch" else None
    env = _environment.collect()
    if torch is not None:
        env["torch_cudnn"] = cudnn_version(torch)

    repeats = getattr(args, "repeats", 1)
    rows = measure(cupy, torch, configs, args.warmup, args.iters, repeats=repeats)
    summary = summarize(rows)
    windows = []
    if getattr(args, "windows", None):
        windows = measure_windows(cupy, extra_headdims, args.dtype[0], max(seqlens),
                                  args.windows, wanted, args.tokens, args.hidden, args.warmup,
                                  args.iters)
    decode, decode_graph = [], []
    if getattr(args, "decode", False):
        decode = measure_decode(cupy, args.dtype[0], args.warmup, args.iters, torch=torch)
        decode_graph = measure_decode_graph(cupy, args.warmup, args.iters, torch=torch)
    varlen = []
    if getattr(args, "varlen", False):
        varlen = measure_varlen(cupy, extra_headdims, args.dtype[0], VARLEN_LENGTHS, wanted,
                                args.hidden, args.warmup, args.iters)

    print(f"\n{environment_header(env)}\n")
    rounds = (f"; each row's contenders timed {repeats} rounds interleaved, the order turning, "
              f"the median of the rounds" if repeats > 1 else "")
    print(f"Median of {args.iters} calls after {args.warmup} warm-up calls, CUDA events{rounds}; "
          f"FLOPs 4·b·h·s²·d (causal /2, backward ×{BACKWARD_FLOP_FACTOR}).\n")
    if torch is not None:
        print(f"torch SDPA on the same arrays, restricted to its FlashAttention-2 backend "
              f"(SDPA-flash) and to its cuDNN backend (cuDNN {env['torch_cudnn'] or '?'}); "
              f"ratios are cuflash2 TFLOP/s over theirs; max abs diff: forward outputs against "
              f"cuflash2's.\n")
    print(markdown_table(rows, compare=torch is not None,
                         cudnn_version=env.get("torch_cudnn")))
    notes = cudnn_notes(rows)
    if notes:
        print()
        print("\n".join(notes))
    if summary:
        print()
        print(summary_table(summary))
    if windows:
        print("\nSliding windows (causal, window (w, 0)), next to plain causal attention:\n")
        print(windows_table(windows))
    if varlen:
        print(f"\nVariable-length sequences (attention_varlen, lengths {list(VARLEN_LENGTHS)}), "
              "next to the same sequences padded to the longest:\n")
        print(varlen_table(varlen))
    if decode:
        print(f"\nDecoding with a KV cache (attention_with_kvcache, one query token, a token "
              f"appended, causal; L2 flushed by a 256 MB read before each call; copy ceiling "
              f"{decode[0]['copy_ceiling_gb_per_s']:.0f} GB/s, bytes read + written per second "
              f"by a device copy):\n")
        print(decode_table(decode))
        print("\nGB/s counts the K and V cache read once plus q and out; decoding only reads, "
              "and a read-only stream can pass the copy figure (HBM3e peak 4.8 TB/s on the H200).")
        if torch is not None:
            print("\n" + "\n".join(peer_notes(decode, SINGLE_STEP_NOTE, "single steps")))
    if decode_graph:
        print(f"\nDecoding steps in a CUDA graph ({LAYERS} layers, each its own cache, one "
              f"token appended, causal; between layers a kernel computing the next layer's q, "
              f"k, v from the layer's output; L2 flushed before each step; a layer's time "
              f"includes that kernel). Programmatic launches let a kernel start while the one "
              f"before it finishes, and the layers' calls pass early_cache_reads=True (the "
              f"kernel between layers writes only q, k, v), so the cache is read while the "
              f"previous kernel finishes; the next columns are the same step with the cache "
              f"read after the previous kernel, and without programmatic launches:\n")
        print(decode_graph_table(decode_graph))
        if torch is not None:
            print("\n" + "\n".join(peer_notes(decode_graph, GRAPH_NOTE, "graph")))
    if args.json:
        report = {"environment": env, "settings": _settings(args), "rows": [r.to_json() for r in rows],
                  "summary": summary, "windows": windows, "varlen": varlen, "decode": decode,
                  "decode_graph": decode_graph}
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"saved {len(rows)} rows to {args.json}", file=sys.stderr)
    return 1 if any(row.errors for row in rows) else 0


def _settings(args) -> dict:
    """The options, with --headdim as the grid ran it; headdim_min_seqlen names the head dims
    the default grid keeps only from a seqlen on."""
    settings = {key: value for key, value in vars(args).items() if key not in ("func", "command")}
    headdims, min_seqlen = grid_headdims(args.headdim)
    settings["headdim"] = list(headdims)
    settings["headdim_min_seqlen"] = {str(d): s for d, s in min_seqlen.items()}
    return settings
