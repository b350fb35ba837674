"""Host-side cost of one cuflash2.attention call (Python validation, dispatch and launch).

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
    cuflash2.attention(q, q, q)
    cupy.cuda.runtime.deviceSynchronize()
    calls = 2000
    for label, kwargs in (("attention(q, k, v)", {}), ("attention(..., out=out)", {"out": out})):
        start = time.perf_counter()
        for _ in range(calls):
            cuflash2.attention(q, q, q, **kwargs)
        host_us = (time.perf_counter() - start) / calls * 1e6
        cupy.cuda.runtime.deviceSynchronize()
        print(f"host time per {label}: {host_us:.1f} us")
    if "--profile" in sys.argv:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            cuflash2.attention(q, q, q)
        profiler.disable()
        cupy.cuda.runtime.deviceSynchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
