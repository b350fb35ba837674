"""Development sweep of the split-KV decode kernel (attention_with_kvcache): tile shapes
(warps x keys per warp, cp.async stages) and split counts, on the bench's decode grid, as achieved
HBM bandwidth against the copy ceiling. Also times the call without the append (k=None) and with
a single split, to separate the append and the split merge from the rest of the kernel.

    python benchmarks/dev/dev_decode_sweep.py \
        [--variants 4x16x3 4x32x3 8x16x4] [--splits 0 16 32]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _configs, _dispatch  # noqa: E402
from cuflash2.bench import decode, timing  # noqa: E402


def _variant(text):
    warps, keys, stages = (int(x) for x in text.split("x"))
    return warps, keys, stages


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", type=_variant, default=[None],
                    help="warps x keys_per_warp x stages (default: the dispatcher's)")
    ap.add_argument("--splits", nargs="+", type=int, default=[0])
    ap.add_argument("--batches", nargs="+", type=int, default=list(decode.DECODE_BATCHES))
    ap.add_argument("--caches", nargs="+", type=int, default=list(decode.DECODE_CACHES))
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    dispatcher = _dispatch.decode_config
    backlog = timing.Backlog(cupy)
    ceiling = timing.copy_ceiling(cupy)
    flush_l2 = timing.l2_flush(cupy)  # as the bench's decode rows
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s")
    print("| variant | splits | heads | batch | cache | ms | GB/s | of ceiling | no append ms | "
          "1 split ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant in args.variants:
        if variant is None:
            _dispatch.decode_config = dispatcher
        else:
            def chosen(dtype, head_dim, arch, block_m=_configs.DECODE_BLOCK_M, variant=variant):
                return _configs.DecodeConfig(dtype, _dispatch.kernel_head_dim(head_dim), *variant,
                                             block_m=block_m)
            _dispatch.decode_config = chosen
        for nheads, nheads_kv in decode.DECODE_HEADS:
            for cache_len in args.caches:
                for batch in args.batches:
                    if batch * cache_len * nheads_kv * 128 * 4 > (24 << 30):
                        continue
                    rng = cupy.random.default_rng(cache_len + batch)
                    shape = (batch, cache_len, nheads_kv, 128)
                    kc = rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                    vc = rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                    q = rng.standard_normal((batch, 1, nheads, 128), dtype=cupy.float32).astype(
                        cupy.float16)
                    k1 = kc[:, :1].copy()
                    lengths = cupy.full((batch,), cache_len - 1, dtype=cupy.int32)
                    moved = decode.decode_bytes(batch, cache_len, nheads, nheads_kv, 128)
                    for splits in args.splits:
                        def call(append=True, splits=splits):
                            extra = dict(k=k1, v=k1) if append else {}
                            return cuflash2.attention_with_kvcache(
                                q, kc, vc, cache_seqlens=lengths, causal=True, num_splits=splits,
                                **extra)
                        ms = timing.time_cupy(cupy, call, 3, args.iters, backlog, flush_l2)
                        bare = timing.time_cupy(cupy, lambda: call(False), 3, args.iters, backlog,
                                                flush_l2)
                        one = timing.time_cupy(cupy, lambda: call(False, 1), 3, args.iters, backlog,
                                               flush_l2)
                        name = "dispatcher" if variant is None else "x".join(map(str, variant))
                        print(f"| {name} | {splits} | {nheads}/{nheads_kv} | {batch} | {cache_len} "
                              f"| {ms:.4f} | {moved / ms / 1e6:.0f} | "
                              f"{moved / ms * 1e3 / ceiling:.0%} | {bare:.4f} | {one:.4f} |",
                              flush=True)
    _dispatch.decode_config = dispatcher


if __name__ == "__main__":
    main()
