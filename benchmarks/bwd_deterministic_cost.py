"""The cost of deterministic mode: the backward with dQ by fp32 atomics (default) against
deterministic=True (dQ by a Q-parallel kernel that recomputes S and dP), same inputs.

    python benchmarks/bwd_deterministic_cost.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import bench  # noqa: E402


def main():
    backlog = bench._Backlog(cupy)
    print("| d | seqlen | causal | atomic ms | deterministic ms | cost |")
    print("|---|---|---|---|---|---|")
    for d in (64, 128):
        for s in (1024, 4096, 16384):
            b, h = 16384 // s, 2048 // d
            rng = cupy.random.default_rng(s + d)
            q, k, v, dout = (rng.standard_normal((b, s, h, d), dtype=cupy.float32)
                             .astype(cupy.float16) for _ in range(4))
            for causal in (False, True):
                out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
                ms = [bench.time_cupy(cupy, lambda det=det: cuflash2.attention_backward(
                    dout, q, k, v, out, lse, causal=causal, deterministic=det), 3, 15, backlog)
                      for det in (False, True)]
                print(f"| {d} | {s} | {causal} | {ms[0]:.3f} | {ms[1]:.3f} | "
                      f"{ms[1] / ms[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
