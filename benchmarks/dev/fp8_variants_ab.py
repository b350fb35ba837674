"""The FP8 (e4m3) forward's configurations and kernel sources A/B, in one process on the same
arrays, beside cuDNN's FP8 SDPA (not a benchmark of record: benchmarks/fp8_forward_vs_cudnn.py
is). For each paper-grid row (d=128 by default) every variant is timed in rounds that alternate
with the others (median of the rounds' medians); the table gives TFLOP/s and each variant's time
against the first one's and against cuDNN's FP8 SDPA (where the frontend's wheel is carried).

Variants (--variants): `disp` the dispatcher's configuration; `one`, `pers`, `dyn` the e4m3 tile
of E4M3_SM90_FWD_TILES forced on the one-tile-per-CTA grid, the persistent grid with the static
schedule, and with tiles claimed dynamically; `w<block_n>` a wider key tile of E4M3_WIDE_TILES
(`w160`, `w224` at d=128) on the one-tile grid. With --alt DIR each variant runs a second time on
the kernel sources with DIR's files in place (ab_sources.Sources, paths under cuda_src), named
`alt:<variant>` (--alt-variants: some of them). Outputs of every variant are compared with
the first's (max |difference|).

    PYTHONPATH=. python3 benchmarks/dev/fp8_variants_ab.py [--variants disp pers dyn]
        [--alt DIR] [--headdims 128] [--seqlens 512 ... 16384] [--causal both|on|off]
        [--rounds 3] [--iters 10] [--no-cudnn]
"""

import argparse
import contextlib
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ml_dtypes  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api  # noqa: E402
from cuflash2.bench import paper_grid, timing  # noqa: E402

import fp8_forward_vs_cudnn as fp8_bench  # noqa: E402

FORCED = {
    "one": dict(persistent=False, claims=False),
    "pers": dict(persistent=True, claims=False),
    "dyn": dict(persistent=True, claims=True),
}
#: The wider key tiles (block_n, stages, overlap) by variant name, `w<block_n>`.
WIDE = {f"w{tile[0]}": tile for tiles in _dispatch.E4M3_WIDE_TILES.values() for tile in tiles}


def _variant(sources, name, head_dim):
    """A context in which attention runs variant `name`: its sources switched in, its
    configuration forced (plans made again on entry and exit)."""
    alt, _, kind = name.rpartition(":")
    stack = contextlib.ExitStack()
    if sources is not None:
        sources.use("alt" if alt else "base")
    if kind in WIDE:
        if WIDE[kind] not in _dispatch.E4M3_WIDE_TILES.get(head_dim, ()):
            raise SystemExit(f"variant {kind}: no such tile at head dim {head_dim} "
                             f"(E4M3_WIDE_TILES: {_dispatch.E4M3_WIDE_TILES})")
        config = _dispatch.e4m3_sm90_config("e4m3_bf16", head_dim, WIDE[kind])
        stack.enter_context(api._forced_config(config))
    elif kind != "disp":
        config = dataclasses.replace(_dispatch.e4m3_sm90_config("e4m3_bf16", head_dim),
                                     **FORCED[kind])
        stack.enter_context(api._forced_config(config))
    else:
        api._forward_plans.plans.clear()
    return stack


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["disp", "pers", "dyn"],
                    choices=["disp", *FORCED, *WIDE])
    ap.add_argument("--alt", type=Path, help="folder of files to replace cuda_src's")
    ap.add_argument("--alt-variants", nargs="+", choices=["disp", *FORCED, *WIDE],
                    help="the variants run on --alt's sources (default: every one)")
    ap.add_argument("--headdims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(paper_grid.PAPER_SEQLENS))
    ap.add_argument("--causal", choices=("both", "on", "off"), default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-cudnn", action="store_true")
    args = ap.parse_args()

    sources = None
    names = list(args.variants)
    if args.alt:
        from ab_sources import Sources
        sources = Sources(args.alt)
        names += [f"alt:{n}" for n in (args.alt_variants or args.variants)]
    cudnn = None
    if not args.no_cudnn:
        cudnn, why = fp8_bench.load_cudnn_frontend()
        if cudnn is None:
            print(f"# cudnn fp8: {why}", flush=True)
    backlog = timing.Backlog(cupy)
    configs = paper_grid.paper_grid(headdims=tuple(args.headdims), dtypes=("bf16",),
                                    causal_modes=paper_grid.causal_modes(args.causal),
                                    directions=("fwd",), seqlens=tuple(args.seqlens))
    print("row | " + " | ".join(names) + " | cudnn fp8 | " +
          " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " | best/cudnn | max diff",
          flush=True)
    ratios = {n: [] for n in names[1:]}
    for seed, config in enumerate(configs):
        bits, descales, _ = fp8_bench.make_inputs(cupy, config, "tensor", seed)
        outs = {n: cupy.empty(bits[0].shape, ml_dtypes.bfloat16) for n in names}
        q, k, v = bits

        def ours(n):
            return lambda: cuflash2.attention(q, k, v, qkv_dtype="e4m3", causal=config.causal,
                                              out=outs[n], **descales)
        calls = {n: ours(n) for n in names}
        cudnn_run = None
        if cudnn is not None:
            try:
                cudnn_run = fp8_bench.CudnnFp8(cudnn, cupy, *bits, descales, config.causal)
                calls["cudnn"] = cudnn_run.call
            except Exception as exc:
                print(f"# cudnn fp8 {config.describe()}: {exc}", flush=True)

        def context(n):
            if n == "cudnn":
                return contextlib.nullcontext()
            return _variant(sources, n, config.headdim)
        times = {n: [] for n in calls}
        for n in calls:  # compile and check each once before the timed rounds
            with context(n):
                calls[n]()
        for r in range(args.rounds):
            for n in (list(calls) if r % 2 == 0 else list(reversed(calls))):
                with context(n):
                    times[n].append(timing.time_cupy(cupy, calls[n], args.warmup, args.iters,
                                                     backlog))
        med = {n: statistics.median(t) for n, t in times.items()}
        flops = config.flops
        cells = [f"{med[n]:.3f} ({flops / med[n] / 1e9:.0f})" for n in names]
        cud = f"{med['cudnn']:.3f} ({flops / med['cudnn'] / 1e9:.0f})" if "cudnn" in med else "-"
        rel = []
        for n in names[1:]:
            ratios[n].append(med[names[0]] / med[n])
            rel.append(f"{med[names[0]] / med[n]:.3f}")
        best = min(med[n] for n in names)
        vs = f"{med['cudnn'] / best:.2f}" if "cudnn" in med else "-"
        diff = max(float(cupy.abs(outs[n].astype(cupy.float32)
                                  - outs[names[0]].astype(cupy.float32)).max()) for n in names)
        print(f"{config.describe()} | " + " | ".join(cells) + f" | {cud} | " + " | ".join(rel)
              + f" | {vs} | {diff:.3g}", flush=True)
        if cudnn_run is not None:
            cudnn_run.close()
        del bits, outs, calls
        cupy.get_default_memory_pool().free_all_blocks()
    for n, r in ratios.items():
        if r:
            print(f"{n} speed / {names[0]}: geometric mean {statistics.geometric_mean(r):.3f} "
                  f"(min {min(r):.3f}, max {max(r):.3f})", flush=True)


if __name__ == "__main__":
    main()
