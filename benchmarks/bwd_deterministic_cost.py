"""The cost of deterministic mode: the backward with dQ by fp32 atomics in any order (default)
against deterministic=True (on sm_90 the Hopper backward with its dQ additions in key-block
order; elsewhere a Q-parallel dQ kernel that recomputes S and dP), same inputs: fp16 arrays of
the paper grid, without a mask, causal, and with a left window edge.

    python benchmarks/bwd_deterministic_cost.py [--headdims 64,128,256] [--seqlens 1024,4096]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench import paper_grid, timing  # noqa: E402

#: The masks of each (head dim, seqlen): label -> attention options.
MASKS = {"none": {}, "causal": {"causal": True}, "window (512, 0)": {"window_size": (512, 0)}}


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=_ints, default=(64, 128, 256))
    parser.add_argument("--seqlens", type=_ints, default=(1024, 4096, 16384))
    args = parser.parse_args()
    backlog = timing.Backlog(cupy)
    print("| d | seqlen | mask | default ms | deterministic ms | cost |")
    print("|---|---|---|---|---|---|")
    for d, s, (q, k, v, dout) in paper_grid.paper_grid_arrays(cupy, args.headdims, args.seqlens):
        for label, options in MASKS.items():
            out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
            ms = [timing.time_cupy(cupy, lambda det=det: cuflash2.attention_backward(
                dout, q, k, v, out, lse, deterministic=det, **options), 3, 15, backlog)
                  for det in (False, True)]
            print(f"| {d} | {s} | {label} | {ms[0]:.3f} | {ms[1]:.3f} | "
                  f"{ms[1] / ms[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
