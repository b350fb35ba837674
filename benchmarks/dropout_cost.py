"""The cost of dropout: forward and backward with dropout_p = 0.1 against dropout_p = 0, same
inputs (FA2 paper grid shapes, fp16).

    python benchmarks/dropout_cost.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench import paper_grid, timing  # noqa: E402


def main():
    backlog = timing.Backlog(cupy)
    print("| d | seqlen | causal | fwd ms | fwd ms, p=0.1 | cost | bwd ms | bwd ms, p=0.1 | cost |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, s, (q, k, v, dout) in paper_grid.paper_grid_arrays(cupy):
        for causal in (False, True):
            cells = []
            for direction in ("fwd", "bwd"):
                ms = []
                for p in (0.0, 0.1):
                    drop = dict(causal=causal, dropout_p=p, seed=7)
                    if direction == "fwd":
                        def call():
                            return cuflash2.attention(q, k, v, **drop)
                    else:
                        out, lse = cuflash2.attention(q, k, v, return_lse=True, **drop)

                        def call():
                            return cuflash2.attention_backward(dout, q, k, v, out, lse, **drop)
                    ms.append(timing.time_cupy(cupy, call, 3, 15, backlog))
                cells += [f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{ms[1] / ms[0]:.2f}x"]
            print(f"| {d} | {s} | {causal} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
