"""Quick backward check on a GPU: a handful of shapes against the reference, then timings of
the d=64/128 paper shapes next to torch SDPA-flash backward. For development runs.

    python benchmarks/dev/dev_check_bwd.py [--no-bench]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402

CASES = [  # batch, sq, sk, h, hk, d, causal
    (2, 128, 128, 2, 2, 64, False), (2, 128, 128, 2, 2, 64, True),
    (1, 97, 255, 4, 2, 128, False), (1, 255, 97, 4, 2, 128, True), (2, 333, 517, 6, 2, 128, True),
    (1, 200, 130, 2, 1, 40, True), (1, 77, 300, 2, 2, 96, False), (1, 130, 130, 2, 2, 32, True),
    (1, 150, 170, 2, 1, 160, True), (1, 150, 170, 2, 2, 256, False), (1, 90, 211, 2, 2, 224, True),
    (1, 1, 17, 2, 2, 72, False), (1, 1023, 1023, 2, 2, 128, True),
]


def main():
    failures = 0
    for dtype in (numpy.float16, ml_dtypes.bfloat16):
        for b, sq, sk, h, hk, d, causal in CASES:
            q, k, v = testing.random_qkv(cupy, b, sq, sk, h, hk, d, dtype, seed=sq * 7 + sk + d)
            dout = testing.random_qkv(cupy, b, sq, sq, h, h, d, dtype, seed=d + 1)[0]
            out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
            dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal)
            results = testing.check_backward(dout, q, k, v, dq, dk, dv, causal=causal)
            ok = all(r.ok for r in results)
            failures += not ok
            print(f"{numpy.dtype(dtype).name} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal}: "
                  + "; ".join(f"{r.name} {r.max_err:.2e}/{r.bound:.2e}{'' if r.ok else ' FAIL'}"
                              for r in results), flush=True)
    print(f"{failures} failing cases")
    if "--no-bench" not in sys.argv:
        from cuflash2 import cli
        sys.argv = ["cuflash2", "bench", "--compare", "torch", "--direction", "bwd",
                    "--seqlens", "1024", "4096", "16384", "--dtype", "fp16"]
        cli.main()


if __name__ == "__main__":
    main()
