"""Host-side cost of one cuflash2.attention / attention_with_kvcache call (Python validation,
dispatch and launch).

    python benchmarks/profile_host.py [--profile]
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402


def main():
    q = cupy.random.standard_normal((1, 128, 8, 64)).astype(cupy.float16)
    out = cupy.empty_like(q)
    q1 = cupy.random.standard_normal((1, 1, 32, 128)).astype(cupy.float16)
    cache = cupy.random.standard_normal((1, 4096, 4, 128)).astype(cupy.float16)
    new = cache[:, :1].copy()
    lengths = cupy.full((1,), 4000, dtype=cupy.int32)
    calls_of = {
        "attention(q, k, v)": lambda: cuflash2.attention(q, q, q),
        "attention(..., out=out)": lambda: cuflash2.attention(q, q, q, out=out),
        "attention_with_kvcache(q, k_cache, v_cache, k=, v=, cache_seqlens=)":
            lambda: cuflash2.attention_with_kvcache(q1, cache, cache, k=new, v=new,
                                                    cache_seqlens=lengths),
    }
    calls = 2000
    for label, call in calls_of.items():
        call()
        cupy.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host_us = (time.perf_counter() - start) / calls * 1e6
        cupy.cuda.runtime.deviceSynchronize()
        print(f"host time per {label}: {host_us:.1f} us")
        if "--profile" in sys.argv:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                call()
            profiler.disable()
            cupy.cuda.runtime.deviceSynchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
