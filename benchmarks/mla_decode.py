"""MLA decode steps (issue 47; docs/MLA_DECODE.md): attention_with_kvcache on DeepSeek-V3's
latent cache, K the 576 columns of a cache row and V its first 512, one KV head shared by the
query heads, one query token, bf16, the cache paged (64-token pages, FlashMLA's) or contiguous,
L2 flushed before each call. Each row: milliseconds, the bytes the step must move (the cache's
576 columns of every cached token read once, q read, out written) against the device's copy
ceiling (cuflash2.bench.timing.copy_ceiling: a large device-to-device copy, bytes read +
written a second), and torch SDPA on the same step where it runs: the contiguous cache's values
as (batch, 1, tokens, 576) and its first 512 columns as V, enable_gqa, the backend torch picks
(its FlashAttention and cuDNN backends take no head dim of 576); a refusal or an error is
printed in its place.

The issue's mark: batch 64, 128 query heads, caches of 4k-16k tokens, bf16, paged, at 85% or
more of the copy ceiling of its bytes.

    python benchmarks/mla_decode.py [--batches 64] [--caches 4096 8192 16384] [--heads 128]
        [--page-size 64] [--contiguous] [--append] [--no-torch] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench import timing, torch_peers  # noqa: E402

D_QK, D_V = 576, 512  # the latent row, and V's share of it
BF16 = ml_dtypes.bfloat16


def step_bytes(batch, cache_len, nheads) -> int:
    """Bytes a step must move: each cached row read once (V is the first 512 of its 576
    columns), q read and out written, 16 bits each."""
    return 2 * (batch * cache_len * D_QK + batch * nheads * (D_QK + D_V))


def _inputs(batch, cache_len, nheads, page_size, append):
    """q, the contiguous cache, the paged one with its block table (None without pages), the
    appended row (or None) and the lengths (the capacity, less the appended row)."""
    rng = cupy.random.default_rng(cache_len + batch)
    cache = rng.standard_normal((batch, cache_len, 1, D_QK), dtype=cupy.float32).astype(BF16)
    q = rng.standard_normal((batch, 1, nheads, D_QK), dtype=cupy.float32).astype(BF16)
    new = (rng.standard_normal((batch, 1, 1, D_QK), dtype=cupy.float32).astype(BF16)
           if append else None)
    lengths = cupy.full((batch,), cache_len - (1 if append else 0), dtype=cupy.int32)
    paged = table = None
    if page_size:
        per_seq = cache_len // page_size
        order = cupy.asarray(numpy.random.default_rng(cache_len).permutation(batch * per_seq)
                             .astype(numpy.int32))
        paged = cupy.empty((batch * per_seq, page_size, 1, D_QK), BF16)
        paged[order] = cache.reshape(batch * per_seq, page_size, 1, D_QK)
        table = order.reshape(batch, per_seq)
    return q, cache, paged, table, new, lengths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[64])
    ap.add_argument("--caches", nargs="+", type=int, default=[4096, 8192, 16384])
    ap.add_argument("--heads", nargs="+", type=int, default=[128])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--contiguous", action="store_true", help="no pages: the contiguous cache")
    ap.add_argument("--append", action="store_true",
                    help="append one new latent row a step (k=, v= given)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    page_size = 0 if args.contiguous else args.page_size
    torch = None if args.no_torch else torch_peers.load_torch(sys.stdout)
    backlog = timing.Backlog(cupy)
    ceiling = timing.copy_ceiling(cupy)
    flush_l2 = timing.l2_flush(cupy)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    layout = f"pages of {page_size}" if page_size else "contiguous"
    print(f"{name}: copy ceiling {ceiling / 1e9:.0f} GB/s; cache {layout}"
          f"{', one row appended a step' if args.append else ''}")
    print("| heads | batch | cache | ms | GB/s | of ceiling | torch SDPA ms | torch / ours | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for nheads in args.heads:
        for cache_len in args.caches:
            for batch in args.batches:
                q, cache, paged, table, new, lengths = _inputs(batch, cache_len, nheads,
                                                               page_size, args.append)
                kv = paged if page_size else cache
                extra = {} if new is None else dict(k=new, v=new[..., :D_V])

                def step():
                    return cuflash2.attention_with_kvcache(
                        q, kv, kv[..., :D_V], cache_seqlens=lengths, block_table=table, **extra)

                ours = step()
                ms = timing.time_cupy(cupy, step, 3, args.iters, backlog, flush_l2)
                moved = step_bytes(batch, cache_len, nheads)
                row = {"nheads": nheads, "batch": batch, "cache": cache_len, "ms": ms,
                       "gbps": moved / ms / 1e6, "of_ceiling": moved / ms * 1e3 / ceiling,
                       "layout": layout, "append": args.append}
                torch_cells = "| not run | | "
                if torch is not None and not args.append:
                    torch_cells = _torch_cells(torch, q, cache, ours, row, args.iters, backlog)
                rows.append(row)
                print(f"| {nheads} | {batch} | {cache_len} | {ms:.4f} | {row['gbps']:.0f} | "
                      f"{row['of_ceiling']:.0%} {torch_cells}|", flush=True)
                del q, cache, paged, table, new, ours
                cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "copy_ceiling": ceiling,
                                               "rows": rows}, indent=1))
    return 0


def _torch_cells(torch, q, cache, ours, row, iters, backlog) -> str:
    """torch SDPA's cells of a row (time, its time over ours, max |ours - its|), filling
    `row`; its refusal or error in their place."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt = torch_peers.torch_view(torch, cupy, q, torch.bfloat16).transpose(1, 2)
    kt = torch_peers.torch_view(torch, cupy, cache, torch.bfloat16).transpose(1, 2)
    vt = kt[..., :D_V]
    try:
        theirs = sdpa(qt, kt, vt, enable_gqa=True)
        ms = timing.time_torch(torch, lambda: sdpa(qt, kt, vt, enable_gqa=True), 3, iters,
                               backlog)
    except Exception as exc:  # a backend that refuses the shape, or memory
        row["torch_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        torch.cuda.empty_cache()
        return f"| {row['torch_error']} | | "
    diff = torch_peers.max_abs_diff(cupy, torch, ours, theirs)
    row.update(torch_ms=ms, torch_over_ours=ms / row["ms"], max_abs_diff=diff)
    del theirs
    torch.cuda.empty_cache()
    return f"| {ms:.4f} | {ms / row['ms']:.2f}x | {diff:.3g} "


if __name__ == "__main__":
    sys.exit(main())
