"""First GPU run of the Hopper backward (cuda_src/flash_bwd_sm90.cu; docs/HOPPER_BWD.md).

On an H100/H200 (sm_90), from the repository root:

    python benchmarks/dev/hopper_bwd_check.py --watchdog   # first: a stuck mbarrier wait traps
                                                           # after ~2 s instead of hanging
    python benchmarks/dev/hopper_bwd_check.py              # correctness, then timing
    python benchmarks/dev/hopper_bwd_check.py --no-time --only 0,1

1. Correctness: the kernel through cuflash2._attention_plans.prepare_backward_sm90 (the plan the
   dispatcher builds, whatever CUFLASH2_HOPPER_BWD says; the dispatch itself is opt-in), after the forward of cuflash2.attention (return_lse=True), on
   random inputs of ~40 shapes (head dims 64, 96, 128, 192, 256 on their kernels, 80 on the d=96
   one, 112 on d=128, 136 and 160 on d=192, 224 on d=256; cases 22-38 are d > 128; fp16/bf16, causal on/off, windows, odd lengths, seqlen_q != seqlen_k
   both ways, GQA, MQA, q/k/v and dout as strided views of packed arrays, softcap, ALiBi, a
   one-token problem), gradients poisoned with NaN first, checked against cuflash2.reference
   with cuflash2.testing.check_backward (dq, dk, dv under the 2x rule).
2. Timing: FA3's grid (16k tokens per batch, hidden 2048: heads = 2048 / d) at 512 to 16k
   tokens, fp16/bf16, d 64/96/128/192/256 (heads = 2048 // d), causal on/off: the three launches of the Hopper path next to
   cuflash2.attention_backward on the mma.sync backward (preprocess and conversion included;
   the Hopper dispatch is switched off for it whatever CUFLASH2_HOPPER_BWD says). `--tiles 64:2
   128:1` times each block_m:dq_buffers variant of a head dim's kernel that its config allows
   (the fastest in the hopper column, each listed after the row).

Internals it uses: cuflash2._attention_plans.prepare_backward_sm90,
cuflash2._dispatch.HOPPER_BACKWARD, cuflash2._dispatch.bwd_sm90_config.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy

# (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, dtype, causal, window, packed, mods)
# mods: "" / "softcap" / "alibi" / "both"
CASES = [
    (2, 1024, 1024, 8, 8, 128, "bfloat16", False, (-1, -1), False, ""),
    (2, 1024, 1024, 8, 8, 128, "float16", True, (-1, -1), False, ""),
    (2, 1024, 1024, 8, 8, 64, "float16", True, (-1, -1), False, ""),
    (2, 1024, 1024, 8, 8, 64, "bfloat16", False, (-1, -1), False, ""),
    (1, 333, 517, 4, 4, 128, "float16", False, (-1, -1), False, ""),  # odd, sq < sk
    (1, 517, 333, 4, 4, 128, "bfloat16", True, (-1, -1), False, ""),  # rows that see no key
    (1, 333, 517, 4, 4, 64, "bfloat16", True, (-1, -1), False, ""),
    (2, 1000, 1000, 8, 2, 128, "bfloat16", True, (-1, -1), False, ""),  # GQA
    (1, 257, 257, 4, 1, 64, "float16", False, (-1, -1), False, ""),  # MQA
    (1, 700, 900, 4, 4, 128, "bfloat16", False, (128, 64), False, ""),  # window
    (1, 700, 900, 4, 4, 64, "float16", False, (200, -1), False, ""),  # left edge only
    (1, 300, 300, 2, 2, 96, "float16", True, (-1, -1), False, ""),  # the d=96 kernel
    (2, 1024, 1024, 8, 8, 96, "bfloat16", False, (-1, -1), False, ""),
    (1, 517, 333, 4, 4, 96, "float16", False, (-1, -1), False, ""),
    (1, 300, 300, 2, 2, 80, "bfloat16", True, (-1, -1), False, ""),  # d=80 on the d=96 kernel
    (1, 300, 300, 2, 2, 112, "float16", False, (-1, -1), False, ""),  # d=112 on d=128
    (2, 129, 129, 4, 4, 64, "bfloat16", True, (-1, -1), True, ""),  # strided views
    (2, 200, 200, 4, 4, 128, "float16", True, (-1, -1), True, ""),
    (1, 400, 400, 4, 2, 128, "bfloat16", True, (-1, -1), False, "softcap"),
    (1, 400, 500, 4, 4, 64, "float16", False, (-1, -1), False, "alibi"),
    (1, 400, 400, 4, 2, 128, "bfloat16", False, (100, 0), False, "both"),
    (1, 1, 1, 1, 1, 64, "float16", False, (-1, -1), False, ""),
    # head dims above 128: two CTAs a key block (head-dim chunks 128 + 64 / 128 + 128)
    (2, 1024, 1024, 8, 8, 256, "bfloat16", False, (-1, -1), False, ""),  # 22
    (2, 1024, 1024, 8, 8, 256, "float16", True, (-1, -1), False, ""),
    (2, 1024, 1024, 8, 8, 192, "bfloat16", True, (-1, -1), False, ""),
    (2, 1024, 1024, 8, 8, 192, "float16", False, (-1, -1), False, ""),
    (1, 333, 517, 4, 4, 192, "float16", False, (-1, -1), False, ""),  # odd, sq < sk
    (1, 517, 333, 4, 4, 256, "bfloat16", True, (-1, -1), False, ""),  # rows that see no key
    (2, 1000, 1000, 8, 2, 256, "bfloat16", True, (-1, -1), False, ""),  # GQA
    (1, 257, 257, 4, 1, 192, "float16", False, (-1, -1), False, ""),  # MQA
    (1, 700, 900, 4, 4, 256, "float16", False, (128, 64), False, ""),  # window
    (1, 300, 300, 2, 2, 160, "bfloat16", True, (-1, -1), False, ""),  # d=160 on d=192
    (1, 300, 300, 2, 2, 224, "float16", False, (-1, -1), False, ""),  # d=224 on d=256
    (1, 300, 300, 2, 2, 136, "float16", True, (-1, -1), False, ""),  # d=136: chunk 1 = 8 cols
    (2, 200, 200, 4, 4, 192, "float16", True, (-1, -1), True, ""),  # strided views
    (1, 400, 400, 4, 2, 256, "bfloat16", True, (-1, -1), False, "softcap"),
    (1, 400, 500, 4, 4, 192, "float16", False, (-1, -1), False, "alibi"),
    (1, 400, 400, 4, 2, 192, "bfloat16", False, (100, 0), False, "both"),
    (1, 1, 1, 1, 1, 256, "float16", False, (-1, -1), False, ""),  # 38
]

TIMING_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TIMING_HEAD_DIMS = (64, 96, 128, 192, 256)
TOKENS = 16384
HIDDEN = 2048
SOFTCAP = 30.0


def _dtype(name):
    import ml_dtypes

    return numpy.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else numpy.dtype(name)


def _random(cupy, shape, dtype, seed):
    rng = numpy.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(shape, numpy.float32).astype(_dtype(dtype)))


def _inputs(cupy, case, seed):
    from cuflash2 import testing

    batch, sq, sk, h, hkv, d, dtype, _, _, packed, _ = case
    if packed:  # q, k, v of one (batch, seqlen, 3, heads, dim) array; dout a strided view too
        qkv = _random(cupy, (batch, sq, 3, h, d), dtype, seed)
        dout = _random(cupy, (batch, sq, 2, h, d), dtype, seed + 1000)[:, :, 1]
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dout
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hkv, d, _dtype(dtype), seed)
    return q, k, v, _random(cupy, (batch, sq, h, d), dtype, seed + 1000)


def _mods(cupy, case):
    batch, h, mods = case[0], case[3], case[10]
    softcap = SOFTCAP if mods in ("softcap", "both") else 0.0
    slopes = None
    if mods in ("alibi", "both"):
        slopes = cupy.asarray(numpy.linspace(0.05, 0.5, batch * h, dtype=numpy.float32)
                              .reshape(batch, h))
    return softcap, slopes


def _config(dtype, head_dim, watchdog=False):
    from cuflash2 import _configs, _dispatch

    kernel_dim = min(d for d in _configs.SM90_BWD_HEAD_DIMS if d >= head_dim)
    return dataclasses.replace(_dispatch.bwd_sm90_config(dtype, kernel_dim), watchdog=watchdog)


def check(cupy, watchdog, only=None):
    import cuflash2
    from cuflash2 import _attention_plans, testing

    failures = 0
    for i, case in enumerate(CASES):
        if only is not None and i not in only:
            continue
        batch, sq, sk, h, hkv, d, dtype, causal, window, packed, mods = case
        label = (f"#{i:<2} b{batch} sq{sq} sk{sk} h{h}/{hkv} d{d} {dtype} causal={int(causal)} "
                 f"window={window}{' packed' if packed else ''}{' ' + mods if mods else ''}")
        q, k, v, dout = _inputs(cupy, case, seed=i)
        softcap, slopes = _mods(cupy, case)
        options = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
        out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
        prepared = _attention_plans.prepare_backward_sm90(dout, q, k, v, out, lse,
                                                     config=_config(dtype, d, watchdog),
                                                     **options)
        for x in (prepared.dq, prepared.dk, prepared.dv):
            x[...] = testing.poison_like(cupy, x.shape, x.dtype)
        try:
            dq, dk, dv = prepared.run()
            cupy.cuda.Device().synchronize()
        except Exception as error:  # a fault leaves the context unusable: stop here
            print(f"FAIL  {label}: {type(error).__name__}: {error}", flush=True)
            return failures + 1
        results = testing.check_backward(dout, q, k, v, dq, dk, dv, **options)
        ok = all(r.ok for r in results)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'}  {label}: " + "; ".join(str(r) for r in results),
              flush=True)
    return failures


def _time(cupy, fn, iters):
    from hopper_fwd_check import _time as time_ms  # this folder: the forward check's timer

    return time_ms(cupy, fn, iters)


def _variants(config, tiles):
    """`config` with each (block_m, dq_buffers) of `tiles` that it allows (the dispatched config
    alone without `tiles`)."""
    if not tiles:
        return [config]
    variants = []
    for block_m, dq_buffers in tiles:
        try:
            variants.append(dataclasses.replace(config, block_m=block_m, dq_buffers=dq_buffers))
        except ValueError:
            pass
    return variants


def timing(cupy, iters, dtypes=("float16", "bfloat16"), dims=None, seqlens=None, tiles=None):
    import cuflash2
    from cuflash2 import _attention_plans, _dispatch, api

    _dispatch.HOPPER_BACKWARD = False  # the reference column is the mma.sync backward
    api._backward_plans.plans.clear()
    print(f"\n{'dtype':9} {'d':>4} {'causal':>6} {'seqlen':>6} {'hopper ms':>10} {'TFLOP/s':>8} "
          f"{'mma.sync ms':>11} {'TFLOP/s':>8} {'speedup':>8}"
          + ("  [tiles: block_m x dq_buffers, ms]" if tiles else ""))
    for dtype in dtypes:
        for d in dims or TIMING_HEAD_DIMS:
            for causal in (False, True):
                for seqlen in seqlens or TIMING_SEQLENS:
                    batch, heads = TOKENS // seqlen, HIDDEN // d
                    case = (batch, seqlen, seqlen, heads, heads, d, dtype, causal, (-1, -1),
                            False, "")
                    q, k, v, dout = _inputs(cupy, case, seed=seqlen)
                    out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
                    variants = []
                    for config in _variants(_config(dtype, d), tiles):
                        hopper = _attention_plans.prepare_backward_sm90(dout, q, k, v, out, lse,
                                                                   causal=causal, config=config)
                        variants.append((config, _time(cupy, hopper.run, iters)))
                    times = [min(t for _, t in variants),
                             _time(cupy, lambda: cuflash2.attention_backward(
                                 dout, q, k, v, out, lse, causal=causal), iters)]
                    # 5 matmuls of the forward's 2 (S, dP, dV, dK, dQ): 2.5x its FLOPs
                    flop = 2.5 * 4.0 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                    row = " ".join(f"{t:>{w}.4f} {flop / t / 1e9:>8.1f}"
                                   for t, w in zip(times, (10, 11)))
                    each = "  " + " ".join(f"{c.block_m}x{c.dq_buffers}: {t:.4f}"
                                           for c, t in variants) if tiles else ""
                    print(f"{dtype:9} {d:>4} {int(causal):>6} {seqlen:>6} {row} "
                          f"{times[1] / times[0]:>7.3f}x{each}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--watchdog", action="store_true",
                        help="debugging build: mbarrier waits trap after ~2 s (not timed)")
    parser.add_argument("--no-time", action="store_true", help="correctness only")
    parser.add_argument("--only", default=None,
                        help="comma-separated case numbers (e.g. 0,1: d=128 non-causal, causal)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="timing: these block_m:dq_buffers variants of each head dim's "
                             "kernel (e.g. 64:2 128:1 128:0), the fastest in the hopper column")
    from hopper_fwd_check import add_timing_options  # this folder

    add_timing_options(parser)
    args = parser.parse_args()
    import cupy

    cc = cupy.cuda.Device().compute_capability
    if cc != "90":
        print(f"needs an sm_90 GPU (H100/H200); this one is sm_{cc}")
        return 2
    only = None if args.only is None else {int(x) for x in args.only.split(",")}
    failures = check(cupy, args.watchdog, only)
    count = len(CASES) if only is None else len(only)
    print(f"\ncorrectness: {'all cases ok' if not failures else f'{failures} case(s) failed'} "
          f"({count} shapes)")
    if failures or args.no_time or args.watchdog:
        return 1 if failures else 0
    tiles = [tuple(int(x) for x in t.split(":")) for t in args.tiles] if args.tiles else None
    timing(cupy, args.iters, args.dtypes, args.dims, args.seqlens, tiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
