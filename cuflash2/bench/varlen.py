"""`python -m cuflash2 bench --varlen`: `attention_varlen` on ragged sequences packed together
(16k tokens in all), next to the dense call a user without varlen would make, every sequence
padded to the longest. TFLOP/s count only the real tokens' pairs.
"""

from __future__ import annotations

import sys

from .paper_grid import attention_flops
from .timing import Backlog, time_cupy


#: Sequence lengths of the varlen rows: ragged, 16k tokens in all.
VARLEN_LENGTHS = (3072, 512, 1536, 4096, 1024, 2048, 768, 3328)


def measure_varlen(cupy, headdims, dtype_name, lengths, wanted, hidden, warmup, iters,
                   progress=sys.stderr) -> list[dict]:
    """Varlen rows: `attention_varlen` on ragged sequences packed together, next to the dense call
    a user without varlen would make (every sequence padded to the longest). TFLOP/s count only
    the real tokens' pairs (causal halves them)."""
    import numpy

    import cuflash2
    from ..selfcheck import dtype_from_name

    dtype = dtype_from_name(dtype_name)
    backlog = Backlog(cupy)
    rows = []
    cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32))
    total, longest, batch = int(sum(lengths)), max(lengths), len(lengths)
    for headdim in headdims:
        nheads = max(1, hidden // headdim)
        rng = cupy.random.default_rng(headdim)
        q, k, v, dout = (rng.standard_normal((total, nheads, headdim), dtype=cupy.float32)
                         .astype(dtype) for _ in range(4))
        padded = [rng.standard_normal((batch, longest, nheads, headdim), dtype=cupy.float32)
                  .astype(dtype) for _ in range(4)]
        for causal in (False, True):
            args = (cu, cu, longest, longest)
            out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=causal, return_lse=True)
            out_p, lse_p = cuflash2.attention(*padded[:3], causal=causal, return_lse=True)
            for direction in wanted:
                if direction == "fwd":
                    fn = lambda: cuflash2.attention_varlen(  # noqa: E731
                        q, k, v, *args, causal=causal, check_cu_seqlens=False)
                    fn_padded = lambda: cuflash2.attention(*padded[:3], causal=causal)  # noqa: E731
                else:
                    fn = lambda: cuflash2.attention_varlen_backward(  # noqa: E731
                        dout, q, k, v, out, lse, *args, causal=causal, check_cu_seqlens=False)
                    fn_padded = lambda: cuflash2.attention_backward(  # noqa: E731
                        padded[3], *padded[:3], out_p, lse_p, causal=causal)
                ms = time_cupy(cupy, fn, warmup, iters, backlog)
                ms_padded = time_cupy(cupy, fn_padded, warmup, iters, backlog)
                flops = sum(attention_flops(1, nheads, n, n, headdim, causal, direction)
                            for n in lengths)
                row = {"direction": direction, "dtype": dtype_name, "headdim": headdim,
                       "causal": causal, "lengths": list(lengths), "nheads": nheads, "ms": ms,
                       "tflops": flops / ms / 1e9, "padded_ms": ms_padded,
                       "speedup_vs_padded": ms_padded / ms}
                rows.append(row)
                print(f"varlen {direction} {dtype_name} d={headdim} causal={causal}: {ms:.3f} ms "
                      f"({row['tflops']:.0f} TFLOP/s), padded dense {ms_padded:.3f} ms",
                      file=progress, flush=True)
    return rows


def varlen_table(rows: list[dict]) -> str:
    lines = ["| dir | dtype | d | causal | sequences (tokens) | heads | ms | TFLOP/s (real tokens) "
             "| padded dense ms | speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['dtype']} | {r['headdim']} | "
                     f"{'yes' if r['causal'] else 'no'} | {len(r['lengths'])} ({sum(r['lengths'])}) "
                     f"| {r['nheads']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['padded_ms']:.3f} "
                     f"| {r['speedup_vs_padded']:.2f}x |")
    return "\n".join(lines)
