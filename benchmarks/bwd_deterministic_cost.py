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
    backlog = bench.Backlog(cupy)
    print("| d | seqlen | causal | atomic ms | deterministic ms | cost |")
    print("|---|---|---|---|---|---|")
    for d, s, (q, k, v, dout) in bench.paper_grid_arrays(cupy):
        for causal in (False, True):
            out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
            ms = [bench.time_cupy(cupy, lambda det=det: cuflash2.attention_backward(
                dout, q, k, v, out, lse, causal=causal, deterministic=det), 3, 15, backlog)
                  for det in (False, True)]
            print(f"| {d} | {s} | {causal} | {ms[0]:.3f} | {ms[1]:.3f} | "
                  f"{ms[1] / ms[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
