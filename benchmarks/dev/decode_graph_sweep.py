"""In-graph decoding step (cuflash2/bench/decode_graph.py) under variants of the launch and the
split merge: programmatic launches on / off, the cache read before the previous kernel ends or
after (early_cache_reads), the splits merged inside a thread-block cluster or through the
barrier in L2, forced split counts (0: the rule), and with --alt a second version of the kernel
sources (an overlay folder, as benchmarks/dev/ab_sources.py). Prints us per layer for each
(batch, cache) row.

    PYTHONPATH=. python3 benchmarks/dev/decode_graph_sweep.py [--iters 30] [--splits 0 16 32]
        [--early 1 0] [--alt alt_src] [--single]

--single (with --alt) times instead the single steps of `bench --decode`'s table (one call,
event to event, L2 flushed before it) under both versions, alternating on the same arrays.

--rotary times instead the cost of the rotary append (issue 47: at most 10% of a decode step
at batch 1, 4k tokens): the in-graph step with and without rotary (rotary_dim = head dim,
GPT-NeoX style) on the --rows (default 1x4096), alternating, the ratio of their medians.

    PYTHONPATH=. python3 benchmarks/dev/decode_graph_sweep.py --rotary [--rows 1x4096 1x16384]
"""

import argparse
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuflash2 import _dispatch, _kvcache, _launch
from cuflash2.bench import decode, decode_graph
from cuflash2.bench.decode import decode_bytes
from cuflash2.bench.timing import Backlog, copy_ceiling, l2_flush, time_cupy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--splits", type=int, nargs="+", default=[0])
    parser.add_argument("--merge", nargs="+", default=["cluster", "barrier"])
    parser.add_argument("--pdl", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--early", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--rows", nargs="+", default=None, help="BATCHxCACHE, e.g. 1x16384")
    parser.add_argument("--alt", type=Path, default=None, help="overlay folder of cuda_src files")
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--rotary", action="store_true",
                        help="the step with and without rotary (issue 47's 10%% target)")
    parser.add_argument("--cluster-tile", type=int, nargs="+", default=None,
                        metavar="WARPS STAGES [KEYS_PER_WARP]",
                        help="the clustered steps' tile instead of decode_cluster_config's")
    parser.add_argument("--tile", type=int, nargs="+", default=None,
                        metavar="WARPS STAGES [KEYS_PER_WARP]",
                        help="the decode tile instead of decode_config's")
    args = parser.parse_args()
    if args.tile:
        _override_tile("decode_config", *args.tile)
    if args.cluster_tile:
        _override_tile("decode_cluster_config", *args.cluster_tile)
    sources = None
    if args.alt is not None:
        from ab_sources import Sources
        sources = Sources(args.alt)
    if args.single:
        single_steps(sources, args)
        return
    if args.rotary:
        rotary_cost(args)
        return
    rows = decode.GRAPH_ROWS
    if args.rows:
        rows = [tuple(int(x) for x in r.split("x")) for r in args.rows]
    ceiling = copy_ceiling(cupy)
    flush = l2_flush(cupy)
    backlog = Backlog(cupy)
    nheads, nheads_kv = decode.GRAPH_HEADS
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s; us per layer ({decode_graph.LAYERS} "
          f"layers a step, L2 flushed before each step)")
    versions = ("base", "alt") if sources else ("base",)
    for batch, cache in rows:
        moved = decode_bytes(batch, cache, nheads, nheads_kv, 128)
        for splits in args.splits:
            for merge in args.merge:
                for programmatic in args.pdl:
                    for early in args.early:
                        for version in versions:
                            if sources:  # the cluster probe sets an attribute per function
                                sources.use(version)
                                _launch._cluster_fits_cache.clear()
                            _launch.PROGRAMMATIC = bool(programmatic)
                            _dispatch.CLUSTER_MERGE = merge == "cluster"
                            _kvcache._plans_by_key.plans.clear()
                            step = decode_graph.DecodeStep(
                                cupy, batch, cache, nheads, nheads_kv, num_splits=splits,
                                early_cache_reads=bool(early))
                            planned = next(iter(_kvcache._plans_by_key.plans.values()))
                            launch = planned.plan.launches[0]
                            ms = decode_graph.time_step(cupy, step, args.warmup,
                                                        args.iters, backlog, flush)
                            us = ms * 1e3 / decode_graph.LAYERS
                            print(f"b={batch} cache={cache:6d} "
                                  f"splits={splits:3d}->{planned.splits:3d} "
                                  f"cluster={launch.cluster:2d} "
                                  f"pdl={int(launch.programmatic)} early={early} {version}: "
                                  f"{us:7.2f} us/layer {moved / (us * 1e-6) / ceiling:5.0%} "
                                  f"of copy", flush=True)
                            del step
    _dispatch.CLUSTER_MERGE = True
    _launch.PROGRAMMATIC = True


def rotary_cost(args) -> None:
    """The in-graph step (batch, cache of --rows; decode.GRAPH_HEADS, d=128) without and with
    rotary, three rounds alternating, each the median of --iters replays: us per layer and the
    ratio (the issue's target: at most 1.10 at batch 1, 4k tokens)."""
    rows = [tuple(int(x) for x in r.split("x")) for r in (args.rows or ["1x4096"])]
    flush, backlog = l2_flush(cupy), Backlog(cupy)
    nheads, nheads_kv = decode.GRAPH_HEADS
    for batch, cache in rows:
        steps = {name: decode_graph.DecodeStep(cupy, batch, cache, nheads, nheads_kv,
                                               rotary_dim=128 if name == "rotary" else 0)
                 for name in ("plain", "rotary")}
        times = {name: [] for name in steps}
        for _ in range(3):
            for name, step in steps.items():
                ms = decode_graph.time_step(cupy, step, args.warmup, args.iters, backlog, flush)
                times[name].append(ms * 1e3 / decode_graph.LAYERS)
        plain, rotary = (sorted(times[n])[1] for n in ("plain", "rotary"))
        print(f"b={batch} cache={cache:6d}: plain {plain:7.2f} us/layer, rotary "
              f"{rotary:7.2f} us/layer, rotary/plain {rotary / plain:.3f} (target <= 1.10)",
              flush=True)


def _override_tile(name: str, warps: int, stages: int, keys_per_warp: int = 16) -> None:
    """_configs.<name> returns its tile with `warps`, `stages` and `keys_per_warp` instead."""
    import dataclasses

    from cuflash2 import _configs

    chosen = getattr(_configs, name)
    setattr(_configs, name, lambda *a: dataclasses.replace(
        chosen(*a), num_warps=warps, kv_stages=stages, keys_per_warp=keys_per_warp))


def single_steps(sources, args) -> None:
    """bench --decode's single-step rows, base against alt, the versions alternating."""
    import cuflash2

    backlog, flush = Backlog(cupy), l2_flush(cupy)
    for nheads, nheads_kv, cache_len, batch in decode.decode_rows():
        q, kc, vc, k1, lengths = decode.decode_inputs(cupy, cupy.float16, batch, cache_len,
                                                      nheads, nheads_kv)
        times = {"base": [], "alt": []}
        for _ in range(3):
            for version in times:
                sources.use(version)
                _launch._cluster_fits_cache.clear()
                _kvcache._plans_by_key.plans.clear()
                cupy.cuda.Device().synchronize()
                _kvcache._split_counters.buffers.clear()  # versions may keep them differently
                fn = lambda: cuflash2.attention_with_kvcache(  # noqa: E731
                    q, kc, vc, k=k1, v=k1, cache_seqlens=lengths, causal=True)
                times[version].append(time_cupy(cupy, fn, args.warmup, args.iters, backlog,
                                                flush))
        base, alt = (sorted(times[v])[1] * 1e3 for v in ("base", "alt"))
        print(f"single b={batch:2d} cache={cache_len:6d} h={nheads}/{nheads_kv}: "
              f"base {base:7.2f} us, alt {alt:7.2f} us, base/alt {base / alt:.3f}", flush=True)


if __name__ == "__main__":
    main()
