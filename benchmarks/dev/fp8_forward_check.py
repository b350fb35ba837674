"""The FP8 forward (e4m3 q, k, v; docs/FP8_FORWARD.md) on the GPU, case by case: its output and
lse against the float64 reference on the dequantised inputs with the 2x rule (ref_lo: the
probabilities rounded to e4m3, the output to out_dtype), then its speed next to the bf16
Hopper forward on the dequantised inputs. Each case prints its result or its traceback and the
next one runs.

    python benchmarks/dev/fp8_forward_check.py [--no-timing] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import fp8, reference, testing  # noqa: E402
from cuflash2.bench import timing  # noqa: E402

BF16 = numpy.dtype(ml_dtypes.bfloat16)


def inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, d, seed, per_head=True):
    """e4m3 q, k, v (uint8 bits) quantised from standard-normal draws, with their float32
    descale factors ((batch, nheads_kv) or ())."""
    rng = cupy.random.default_rng(seed)
    arrays, descales = {}, {}
    for name, rows, heads in (("q", seqlen_q, nheads), ("k", seqlen_k, nheads_kv),
                              ("v", seqlen_k, nheads_kv)):
        x = rng.standard_normal((batch, rows, heads, d), dtype=cupy.float32)
        if per_head:
            descale = (0.5 + rng.random((batch, nheads_kv), dtype=cupy.float32)) / 64
            factor = descale[:, None, :, None]
            if name == "q":
                factor = cupy.repeat(descale, nheads // nheads_kv, axis=1)[:, None, :, None]
        else:
            descale = cupy.asarray(1 / 64, cupy.float32)
            factor = descale
        arrays[name] = fp8.quantize_e4m3(x, factor)
        descales[name] = descale.astype(cupy.float32)
    return arrays, descales


def check(batch, seqlen_q, seqlen_k, nheads, nheads_kv, d, causal=False, window=(-1, -1),
          out_dtype=None, per_head=True):
    a, s = inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, d,
                  seed=seqlen_q * 7 + seqlen_k + d, per_head=per_head)
    options = dict(causal=causal, window_size=window)
    out, lse = cuflash2.attention(a["q"], a["k"], a["v"], qkv_dtype="e4m3", q_descale=s["q"],
                                  k_descale=s["k"], v_descale=s["v"], out_dtype=out_dtype,
                                  return_lse=True, **options)
    host = {n: cupy.asnumpy(x) for n, x in a.items()}
    hd = {f"{n}_descale": cupy.asnumpy(x) for n, x in s.items()}
    ref_hi, ref_lse = reference.attention(host["q"], host["k"], host["v"], qkv_dtype="e4m3",
                                          compute_dtype=numpy.float64, return_lse=True,
                                          **hd, **options)
    ref_lo = reference.attention(host["q"], host["k"], host["v"], qkv_dtype="e4m3",
                                 compute_dtype="e4m3", out_dtype=out_dtype, **hd, **options)
    result = testing.check_close("out", cupy.asnumpy(out), ref_hi, ref_lo)
    lse_ok = testing.lse_close(cupy.asnumpy(lse), ref_lse)
    print(f"b{batch} q{seqlen_q} k{seqlen_k} h{nheads}/{nheads_kv} d{d} causal={causal} "
          f"window={window} out={out.dtype} per_head={per_head}: {result}; {lse_ok}",
          flush=True)
    return result.ok and getattr(lse_ok, "ok", True)


def tflops(batch, seqlen, nheads, d, causal, ms):
    flops = 4 * batch * nheads * seqlen * seqlen * d * (0.5 if causal else 1.0)
    return flops / ms / 1e9


def timings(tokens, iters):
    backlog = timing.Backlog(cupy)
    for d in (64, 128, 256):
        for seqlen in (1024, 4096, tokens):
            batch, nheads = max(1, tokens // seqlen), 16 if d <= 128 else 8
            for causal in (False, True):
                try:
                    a, s = inputs(batch, seqlen, seqlen, nheads, nheads, d, seed=1)
                    bf = {n: fp8.dequantize_e4m3(a[n]).astype(BF16) for n in a}
                    e4 = lambda: cuflash2.attention(a["q"], a["k"], a["v"], qkv_dtype="e4m3",  # noqa: E731
                                                    q_descale=s["q"], k_descale=s["k"],
                                                    v_descale=s["v"], causal=causal)
                    b16 = lambda: cuflash2.attention(bf["q"], bf["k"], bf["v"], causal=causal)  # noqa: E731
                    t8 = timing.time_cupy(cupy, e4, 3, iters, backlog)
                    t16 = timing.time_cupy(cupy, b16, 3, iters, backlog)
                    print(f"d{d} b{batch} s{seqlen} h{nheads} causal={causal}: e4m3 {t8:.3f} ms "
                          f"{tflops(batch, seqlen, nheads, d, causal, t8):.0f} TFLOP/s, bf16 "
                          f"{t16:.3f} ms {tflops(batch, seqlen, nheads, d, causal, t16):.0f}, "
                          f"x{t16 / t8:.2f}", flush=True)
                except Exception:
                    traceback.print_exc()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    cases = [
        dict(batch=1, seqlen_q=128, seqlen_k=128, nheads=1, nheads_kv=1, d=128),
        dict(batch=2, seqlen_q=257, seqlen_k=1000, nheads=8, nheads_kv=2, d=128),
        dict(batch=2, seqlen_q=257, seqlen_k=1000, nheads=8, nheads_kv=2, d=128, causal=True),
        dict(batch=1, seqlen_q=113, seqlen_k=113, nheads=4, nheads_kv=4, d=64),
        dict(batch=2, seqlen_q=1000, seqlen_k=777, nheads=4, nheads_kv=1, d=64, causal=True),
        dict(batch=1, seqlen_q=300, seqlen_k=517, nheads=4, nheads_kv=2, d=256),
        dict(batch=1, seqlen_q=517, seqlen_k=517, nheads=4, nheads_kv=2, d=256, causal=True),
        dict(batch=2, seqlen_q=1, seqlen_k=17, nheads=4, nheads_kv=4, d=128),
        dict(batch=1, seqlen_q=700, seqlen_k=900, nheads=2, nheads_kv=2, d=128,
             window=(100, 50)),
        dict(batch=1, seqlen_q=256, seqlen_k=256, nheads=2, nheads_kv=2, d=128,
             out_dtype=numpy.float16),
        dict(batch=2, seqlen_q=333, seqlen_k=333, nheads=2, nheads_kv=1, d=128, per_head=False),
    ]
    ok = True
    for case in cases:
        try:
            ok &= check(**case)
        except Exception:
            ok = False
            print(case, flush=True)
            traceback.print_exc()
    print("ALL OK" if ok else "FAILURES", flush=True)
    if not args.no_timing:
        timings(args.tokens, args.iters)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
