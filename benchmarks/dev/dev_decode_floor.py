"""What a decoding step costs when it moves almost nothing: the time, with CUDA events, of one
and two back-to-back empty launches, and of attention_with_kvcache on a 256-token cache (batch
1, 32 query heads on 4 KV heads, d=128) with one split and with four (whose CTAs meet at the
split barrier and merge); then batch-1 steps on 16k and 64k caches (L2 flushed before each, as
`bench --decode`). Each row is timed with the kernel's default shared-memory carveout and with
it preferring the largest (no L1/shared reconfiguration between launches). The floor under the
batch-1 rows of `bench --decode`.

    python benchmarks/dev/dev_decode_floor.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _compile, _dispatch  # noqa: E402
from cuflash2.bench import timing  # noqa: E402


def main():
    backlog = timing.Backlog(cupy)
    flush_l2 = timing.l2_flush(cupy)
    spin = timing.spin_kernel(cupy)
    zero = cupy.uint64(0)
    rows = [("one empty launch", lambda: spin((1,), (1,), (zero,)), None),
            ("two empty launches",
             lambda: (spin((1,), (1,), (zero,)), spin((1,), (1,), (zero,))), None)]
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((1, 1, 32, 128), dtype=cupy.float32).astype(cupy.float16)
    for cache_len, splits_list in ((256, (1, 4)), (16384, (0,)), (65536, (0,))):
        kc, vc = (rng.standard_normal((1, cache_len, 4, 128), dtype=cupy.float32)
                  .astype(cupy.float16) for _ in range(2))
        lengths = cupy.full((1,), cache_len - 1, dtype=cupy.int32)
        k1 = kc[:, :1].copy()
        for splits in splits_list:
            rows.append((f"attention_with_kvcache, cache {cache_len}, num_splits={splits}",
                         lambda kc=kc, vc=vc, lengths=lengths, k1=k1, splits=splits:
                         cuflash2.attention_with_kvcache(q, kc, vc, k=k1, v=k1,
                                                         cache_seqlens=lengths, causal=True,
                                                         num_splits=splits),
                         flush_l2 if cache_len > 256 else None))
    print("| call | us, default carveout | us, decode kernel at max shared |")
    print("|---|---|---|")
    results = {}
    for carveout in (None, 100):
        if carveout is not None:
            device = cupy.cuda.Device().id
            config = _dispatch.decode_config("float16", 128, 90)
            _compile.get_kernel(config, device).preferred_shared_memory_carveout = carveout
        for label, call, before in rows:
            results.setdefault(label, []).append(
                timing.time_cupy(cupy, call, 5, 50, backlog, before) * 1e3)
    for label, (a, b) in results.items():
        print(f"| {label} | {a:.1f} | {b:.1f} |", flush=True)


if __name__ == "__main__":
    main()
