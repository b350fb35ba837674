"""Forward-kernel tuning on a GPU: every candidate tile config of a head dim, checked against the
reference once and timed on the FA2-paper shapes next to torch SDPA-flash (when importable).

    python benchmarks/dev/tune_fwd.py --head-dims 64 128 --seqlens 1024 4096 16384

Not a test: it prints a table to pick `cuflash2/_configs.py` entries from.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy  # noqa: E402

from cuflash2 import _configs, api, reference, testing  # noqa: E402
from cuflash2.bench import timing  # noqa: E402

CANDIDATES = {  # (block_m, block_n, num_warps, kv_stages)
    32: [(128, 128, 4, 2), (128, 128, 4, 1), (128, 64, 4, 2)],
    64: [(128, 64, 4, 1), (128, 64, 4, 2), (128, 128, 4, 1), (128, 128, 4, 2)],
    96: [(128, 64, 4, 1), (128, 64, 4, 2)],
    128: [(128, 64, 4, 1), (128, 64, 4, 2)],
    256: [(128, 64, 8, 1), (64, 64, 4, 1)],
}

_backlog = None


def time_ms(fn, warmup=3, iters=30):
    """Median of back-to-back launches behind a GPU backlog (host launch cost hidden)."""
    global _backlog
    if _backlog is None:
        _backlog = timing.Backlog(cupy)
    return timing.time_cupy(cupy, fn, warmup, iters, _backlog)


def run(cfg, q, k, v, out, lse, causal):
    """cuflash2.attention into `out` with the tile configuration `cfg` (lse is not kept)."""
    with api._forced_config(cfg):
        api.attention(q, k, v, causal=causal, out=out)


def torch_flash(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return timing.time_torch(torch, lambda: sdpa(tq, tk, tv, is_causal=causal), 3, 30,
                                     _backlog)
    return timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    dtype = numpy.float16 if args.dtype == "float16" else testing._BF16
    try:
        import torch  # noqa: F401
        have_torch = not args.no_torch
    except ImportError:
        have_torch = False

    rows = []
    for d in args.head_dims:
        for bm, bn, warps, stages in CANDIDATES[d]:
            cfg = _configs.FwdConfig(str(numpy.dtype(dtype)), d, bm, bn, warps, stages)
            # correctness once per config (odd lengths, GQA, causal)
            q, k, v = testing.random_qkv(cupy, 2, 333, 517, 4, 2, d, dtype, seed=d + bm + bn)
            for causal in (False, True):
                out = cupy.full(q.shape, numpy.nan, dtype)
                lse = cupy.empty((2, 4, 333), cupy.float32)
                run(cfg, q, k, v, out, lse, causal)
                ref_hi = reference.attention(q, k, v, causal=causal)
                ref_lo = reference.attention(q, k, v, causal=causal, compute_dtype=dtype)
                res = testing.check_close(f"d{d} {bm}x{bn}x{warps}x{stages} causal={causal}", out, ref_hi,
                                          ref_lo, testing.default_atol(dtype))
                print(res, flush=True)
            for s in args.seqlens:
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s)
                out = cupy.empty_like(q)
                lse = cupy.empty((b, h, s), cupy.float32)
                for causal in (False, True):
                    flops = 4 * b * h * s * s * d / (2 if causal else 1)
                    ms = time_ms(lambda: run(cfg, q, k, v, out, lse, causal))
                    t_ms = torch_flash(q, k, v, causal)() if have_torch else float("nan")
                    rows.append((d, f"{bm}x{bn}x{warps}x{stages}", s, causal, flops / ms / 1e9,
                                 flops / t_ms / 1e9, t_ms / ms))
                    print(f"d={d} {bm}x{bn}x{warps}x{stages} s={s} causal={causal}: "
                          f"{flops / ms / 1e9:.0f} TFLOP/s, torch {flops / t_ms / 1e9:.0f}, "
                          f"ratio {t_ms / ms:.3f}", flush=True)
                del q, k, v, out, lse
    print("\n| d | config | seqlen | causal | cuflash2 TFLOP/s | torch TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.0f} | {r[5]:.0f} | {r[6]:.3f} |")
    by_cfg = {}
    for r in rows:
        by_cfg.setdefault((r[0], r[1]), []).append(r[6])
    for key, ratios in by_cfg.items():
        print(f"d={key[0]} {key[1]}: geomean ratio {math.exp(statistics.mean(map(math.log, ratios))):.3f}"
              f" min {min(ratios):.3f}")


if __name__ == "__main__":
    main()
