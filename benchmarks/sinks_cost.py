"""The cost of learnable attention sinks: forward and backward with `sinks` against without, on
the same inputs (the FlashAttention-2 paper grid's shapes: 16k tokens, hidden 2048), in rounds
that alternate the two so that drifts of the clock fall on both; median of the rounds' medians.
Also checks that the sinks' outputs differ from the plain ones (the feature ran) and prints which
kernels each call ran. The order of the calls turns by one each round.

--control times the plain call a second time as a third contender ("plain again"): its ratio to
the plain call is the spread of the same code in this run, the yardstick for a row's cost.

    python benchmarks/sinks_cost.py [--seqlens 4096 8192 16384] [--headdims 64 128]
        [--dtypes fp16 bf16] [--rounds 3] [--iters 15] [--control]
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench import paper_grid as grid, timing  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--control", action="store_true",
                        help="time the plain call twice: the same code's spread, per row")
    args = parser.parse_args()
    backlog = timing.Backlog(cupy)
    rng = cupy.random.default_rng(0)
    control = " plain again / plain |" if args.control else ""
    print(f"| dtype | d | seqlen | causal | fwd ms | with sinks | cost |{control} bwd ms | "
          f"with sinks | cost |{control}")
    print("|---" * (10 + 2 * args.control) + "|")
    costs = {"fwd": [], "bwd": []}
    spreads = {"fwd": [], "bwd": []}
    for dtype_name in args.dtypes:
        dtype = dtype_from_name(dtype_name)
        for d in args.headdims:
            for s in args.seqlens:
                for causal in (False, True):
                    config = grid.Config("fwd", dtype_name, d, causal, s, grid.PAPER_TOKENS // s,
                                         grid.PAPER_HIDDEN // d)
                    q, k, v = grid.random_inputs(cupy, config, dtype, seed=s + d)
                    dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(dtype)
                    sinks = rng.standard_normal((q.shape[2],), dtype=cupy.float32)
                    cells = []
                    for direction in ("fwd", "bwd"):
                        calls = {}
                        without = config.options()
                        contenders = [("plain", without), ("sinks", without.replace(sinks=sinks))]
                        if args.control:
                            contenders.append(("plain again", without))
                        for name, options in contenders:
                            kw = options.keywords()
                            out, lse = cuflash2.attention(q, k, v, return_lse=True, **kw)
                            if direction == "fwd":
                                calls[name] = lambda kw=kw: cuflash2.attention(q, k, v, **kw)
                            else:
                                calls[name] = (lambda kw=kw, out=out, lse=lse:
                                               cuflash2.attention_backward(dout, q, k, v, out,
                                                                           lse, **kw))
                        times = {name: [] for name in calls}
                        names = list(calls)
                        for round_ in range(args.rounds):
                            turn = round_ % len(names)
                            for name in names[turn:] + names[:turn]:
                                times[name].append(timing.time_cupy(cupy, calls[name], 3,
                                                                    args.iters, backlog))
                        plain = statistics.median(times["plain"])
                        with_sinks = statistics.median(times["sinks"])
                        costs[direction].append((s, with_sinks / plain))
                        cells += [f"{plain:.3f}", f"{with_sinks:.3f}", f"{with_sinks / plain:.3f}x"]
                        if args.control:
                            again = statistics.median(times["plain again"]) / plain
                            spreads[direction].append(again)
                            cells.append(f"{again:.3f}x")
                    print(f"| {dtype_name} | {d} | {s} | {causal} | " + " | ".join(cells) + " |",
                          flush=True)
    for direction, pairs in costs.items():
        ratios = [r for _, r in pairs]
        print(f"{direction}: sinks cost geometric mean "
              f"{statistics.geometric_mean(ratios):.4f}x, worst {max(ratios):.4f}x")
        if spreads[direction]:
            same = spreads[direction]
            print(f"{direction}: the same code (plain again / plain) geometric mean "
                  f"{statistics.geometric_mean(same):.4f}x, from {min(same):.4f}x to "
                  f"{max(same):.4f}x")
    q, k, v = grid.random_inputs(cupy, grid.Config("fwd", "bf16", 128, True, 4096, 4, 16),
                                 dtype_from_name("bf16"), seed=1)
    sinks = rng.standard_normal((16,), dtype=cupy.float32)
    print("kernels with sinks:", cuflash2.forward_kernels(q, k, v, causal=True, sinks=sinks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
