"""Decode steps with an FP8 e4m3 KV cache against a bf16 one (issue 45): attention_with_kvcache
with one query token, a token appended, causal, d=128, GQA, batch 1-64, caches of 4k-16k
tokens; the same q and the same cache values (the e4m3 one quantised from the bf16 one, one
factor a sequence and KV head), L2 flushed before each call. Each row: milliseconds of both, the
bytes each must move against the device's copy ceiling (cuflash2.bench.timing.copy_ceiling: a
large device-to-device copy, bytes read + written a second), and the e4m3 cache's speedup.

The issue's mark: at batch 8, 16k tokens the e4m3 cache at least 1.7x the bf16 one's speed and
at 85% or more of the copy ceiling of its bytes.

    python benchmarks/fp8_cache_vs_bf16.py [--batches 1 8 32 64] [--caches 4096 16384]
        [--heads 32:4 32:8] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import fp8  # noqa: E402
from cuflash2.bench import timing  # noqa: E402

HEAD_DIM = 128
BF16 = ml_dtypes.bfloat16


def step_bytes(batch, cache_len, nheads, nheads_kv, cache_itemsize) -> int:
    """Bytes a step must move: the K and V cache read once at its own width, q read and out
    written at 16 bits."""
    return (2 * batch * cache_len * nheads_kv * HEAD_DIM * cache_itemsize
            + 2 * batch * nheads * HEAD_DIM * 2)


def _heads(text):
    nheads, nheads_kv = (int(x) for x in text.split(":"))
    return nheads, nheads_kv


def _inputs(batch, cache_len, nheads, nheads_kv):
    """q, the bf16 caches, their e4m3 quantisation with its (batch, nheads_kv) factors, the
    appended token and the lengths (the capacity less that token)."""
    rng = cupy.random.default_rng(cache_len + batch)
    shape = (batch, cache_len, nheads_kv, HEAD_DIM)
    bf16 = BF16
    values = {n: rng.standard_normal(shape, dtype=cupy.float32) for n in ("k", "v")}
    caches = {n: x.astype(bf16) for n, x in values.items()}
    descale = {n: (cupy.abs(x).max(axis=(1, 3)) / fp8.E4M3_MAX).astype(cupy.float32)
               for n, x in values.items()}
    e4m3 = {n: fp8.quantize_e4m3(values[n], descale[n][:, None, :, None]) for n in values}
    del values
    q = rng.standard_normal((batch, 1, nheads, HEAD_DIM), dtype=cupy.float32).astype(bf16)
    token = rng.standard_normal((batch, 1, nheads_kv, HEAD_DIM), dtype=cupy.float32).astype(bf16)
    lengths = cupy.full((batch,), cache_len - 1, dtype=cupy.int32)
    return q, caches, e4m3, descale, token, lengths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--caches", nargs="+", type=int, default=[4096, 8192, 16384])
    ap.add_argument("--heads", nargs="+", type=_heads, default=[(32, 4), (32, 8)],
                    help="nheads:nheads_kv pairs (GQA)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    backlog = timing.Backlog(cupy)
    ceiling = timing.copy_ceiling(cupy)
    flush_l2 = timing.l2_flush(cupy)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"{name}: copy ceiling {ceiling / 1e9:.0f} GB/s")
    print("| heads | batch | cache | bf16 ms | bf16 GB/s | of ceiling | e4m3 ms | e4m3 GB/s | "
          "of ceiling | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for nheads, nheads_kv in args.heads:
        for cache_len in args.caches:
            for batch in args.batches:
                q, caches, e4m3, descale, token, lengths = _inputs(batch, cache_len, nheads,
                                                                    nheads_kv)
                common = dict(k=token, v=token, cache_seqlens=lengths, causal=True)

                def bf16_step():
                    return cuflash2.attention_with_kvcache(q, caches["k"], caches["v"], **common)

                def e4m3_step():
                    return cuflash2.attention_with_kvcache(
                        q, e4m3["k"], e4m3["v"], kv_cache_dtype="e4m3",
                        k_descale=descale["k"], v_descale=descale["v"], **common)

                row = {"nheads": nheads, "nheads_kv": nheads_kv, "batch": batch,
                       "cache": cache_len}
                for label, step, itemsize in (("bf16", bf16_step, 2), ("e4m3", e4m3_step, 1)):
                    ms = timing.time_cupy(cupy, step, 3, args.iters, backlog, flush_l2)
                    moved = step_bytes(batch, cache_len, nheads, nheads_kv, itemsize)
                    row[f"{label}_ms"] = ms
                    row[f"{label}_gbps"] = moved / ms / 1e6
                    row[f"{label}_of_ceiling"] = moved / ms * 1e3 / ceiling
                row["speedup"] = row["bf16_ms"] / row["e4m3_ms"]
                rows.append(row)
                print(f"| {nheads}/{nheads_kv} | {batch} | {cache_len} | {row['bf16_ms']:.4f} | "
                      f"{row['bf16_gbps']:.0f} | {row['bf16_of_ceiling']:.0%} | "
                      f"{row['e4m3_ms']:.4f} | {row['e4m3_gbps']:.0f} | "
                      f"{row['e4m3_of_ceiling']:.0%} | {row['speedup']:.2f}x |", flush=True)
                del q, caches, e4m3, descale, token
                cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "copy_ceiling": ceiling,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
