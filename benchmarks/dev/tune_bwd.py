"""Backward tuning on a GPU: candidate main-kernel tile configs, with dQ by atomics (default)
and by the separate dQ kernel (deterministic mode), each checked once against the reference and
timed on FA2-paper shapes next to torch SDPA-flash's backward.

    python benchmarks/dev/tune_bwd.py [--head-dims 64 128] [--seqlens 1024 4096 16384]
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy  # noqa: E402

from cuflash2 import _configs, _validate, api, testing  # noqa: E402
from cuflash2.bench import timing, torch_peers  # noqa: E402

# (block_m, block_n, warps, q_stages); override with --candidates 64x128x8x2 ...
CANDIDATES = [(64, 128, 8, 2), (128, 128, 8, 2), (64, 128, 8, 1)]


def run(cfg, deterministic, problem, dout, q, k, v, out, lse, dq, dk, dv, causal):
    """cuflash2.attention_backward into dq, dk, dv with the main kernel's configuration `cfg`."""
    with api._forced_config(cfg):
        api.attention_backward(dout, q, k, v, out, lse, causal=causal,
                               deterministic=deterministic, dq=dq, dk=dk, dv=dv)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--candidates", nargs="+", default=None, help="block_m x block_n x warps x stages")
    ap.add_argument("--modes", nargs="+", default=["atomic", "split"])
    args = ap.parse_args()
    candidates = ([tuple(map(int, c.split("x"))) for c in args.candidates] if args.candidates
                  else CANDIDATES)
    dtype = numpy.dtype(numpy.float16)
    backlog = timing.Backlog(cupy)
    import torch
    sdpa_ref = torch_peers.TorchSdpaFlash(torch, cupy, "fp16")
    ratios = {}
    for d in args.head_dims:
        # torch once per shape
        shapes = {}
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // d
            q, k, v = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s)
            dout = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s + 1)[0]
            for causal in (False, True):
                fn = sdpa_ref.backward(q, k, v, dout, causal)
                with sdpa_ref.flash_only():
                    t_ms = timing.time_torch(torch, fn, 3, 15, backlog)
                shapes[(s, causal)] = (q, k, v, dout, t_ms)
        for bm, bn, warps, stages in candidates:
            for deterministic in [m == "split" for m in args.modes]:
                cfg = _configs.BwdConfig("float16", d, d, bm, bn, warps, stages, not deterministic)
                if not cfg.valid:
                    print("skipped (no warp grid):", cfg)
                    continue
                name = f"d={d} {bm}x{bn}x{warps}x{stages} {'split' if deterministic else 'atomic'}"
                q, k, v = testing.random_qkv(cupy, 1, 333, 517, 4, 2, d, dtype, seed=d)
                dout = testing.random_qkv(cupy, 1, 333, 333, 4, 4, d, dtype, seed=d + 1)[0]
                out, lse = api.attention(q, k, v, causal=True, return_lse=True)
                grads = [cupy.full(x.shape, numpy.nan, dtype) for x in (q, k, v)]
                problem = _validate.check_attention_inputs(q, k, v)
                run(cfg, deterministic, problem, dout, q, k, v, out, lse, *grads, True)
                res = testing.check_backward(dout, q, k, v, *grads, causal=True)
                print(name, "check:", "ok" if all(r.ok for r in res) else
                      "FAIL " + "; ".join(map(str, res)), flush=True)
                for (s, causal), (q, k, v, dout, t_ms) in shapes.items():
                    out, lse = api.attention(q, k, v, causal=causal, return_lse=True)
                    grads = [cupy.empty_like(x) for x in (q, k, v)]
                    problem = _validate.check_attention_inputs(q, k, v)
                    ms = timing.time_cupy(cupy, lambda: run(
                        cfg, deterministic, problem, dout, q, k, v, out, lse, *grads, causal),
                        3, 15, backlog)
                    ratios.setdefault(name, []).append(t_ms / ms)
                    flops = 2.5 * 4 * q.shape[0] * q.shape[2] * s * s * d / (2 if causal else 1)
                    print(f"{name} s={s} causal={causal}: {flops / ms / 1e9:.0f} TFLOP/s, "
                          f"torch {flops / t_ms / 1e9:.0f}, ratio {t_ms / ms:.3f}", flush=True)
    print()
    for name, r in ratios.items():
        print(f"{name}: geomean {math.exp(statistics.mean(map(math.log, r))):.3f} min {min(r):.3f}")


if __name__ == "__main__":
    main()
