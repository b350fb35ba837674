"""`python -m cuflash2 bench --windows W ...`: causal sliding windows (W, 0) at the grid's longest
seqlen, next to plain causal attention on the same arrays. TFLOP/s count only the (query, key)
pairs inside the window, so a time proportional to the window shows as flat TFLOP/s.
"""

from __future__ import annotations

import sys

from .paper_grid import BACKWARD_FLOP_FACTOR, Config, random_inputs
from .timing import Backlog, time_cupy


def window_pairs(seqlen: int, left: int) -> int:
    """(query, key) pairs a causal sliding window (left, 0) computes on a square sequence: row i
    sees keys max(0, i - left) .. i."""
    left = min(left, seqlen - 1)
    return left * (left + 1) // 2 + (left + 1) * (seqlen - left)


def measure_windows(cupy, headdims, dtype_name, seqlen, windows, wanted, tokens, hidden, warmup,
                    iters, progress=sys.stderr) -> list[dict]:
    """Sliding-window rows: causal attention restricted to window (w, 0) at one long seqlen, next to
    plain causal attention on the same arrays. TFLOP/s count only the pairs inside the window;
    `time_vs_causal` against `pairs_vs_causal` shows the time is proportional to the window."""
    import cuflash2
    from ..selfcheck import dtype_from_name

    dtype = dtype_from_name(dtype_name)
    backlog = Backlog(cupy)
    rows = []
    for headdim in headdims:
        batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
        config = Config("fwd", dtype_name, headdim, True, seqlen, batch, nheads)
        q, k, v = random_inputs(cupy, config, dtype, seed=headdim)
        dout = random_inputs(cupy, config, dtype, seed=headdim + 1)[0]
        times = {}
        for direction in wanted:
            for window in (None, *windows):
                kwargs = dict(causal=True, window_size=(-1, -1) if window is None else (window, 0))
                if direction == "fwd":
                    fn = lambda: cuflash2.attention(q, k, v, **kwargs)  # noqa: E731
                else:
                    out, lse = cuflash2.attention(q, k, v, return_lse=True, **kwargs)
                    fn = lambda: cuflash2.attention_backward(dout, q, k, v, out, lse, **kwargs)  # noqa: E731
                ms = time_cupy(cupy, fn, warmup, iters, backlog)
                times[(direction, window)] = ms
                pairs = window_pairs(seqlen, seqlen if window is None else window)
                flops = 4.0 * batch * nheads * headdim * pairs * (
                    BACKWARD_FLOP_FACTOR if direction == "bwd" else 1)
                row = {"direction": direction, "dtype": dtype_name, "headdim": headdim,
                       "seqlen": seqlen, "batch": batch, "nheads": nheads,
                       "window": "causal" if window is None else f"({window}, 0)",
                       "ms": ms, "tflops": flops / ms / 1e9,
                       "time_vs_causal": ms / times[(direction, None)],
                       "pairs_vs_causal": pairs / window_pairs(seqlen, seqlen)}
                rows.append(row)
                print(f"{direction} {dtype_name} d={headdim} s={seqlen} window {row['window']}: "
                      f"{ms:.3f} ms, {row['tflops']:.0f} TFLOP/s", file=progress, flush=True)
    return rows


def windows_table(rows: list[dict]) -> str:
    lines = ["| dir | dtype | d | seqlen | batch×heads | window | ms | TFLOP/s (pairs in window) "
             "| time / causal | pairs / causal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['dtype']} | {r['headdim']} | {r['seqlen']} | "
                     f"{r['batch']}×{r['nheads']} | {r['window']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.1f} | {r['time_vs_causal']:.3f} | {r['pairs_vs_causal']:.3f} |")
    return "\n".join(lines)
