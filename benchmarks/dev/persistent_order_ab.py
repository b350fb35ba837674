"""The persistent Hopper forward's tile order under a causal mask, A/B in one process on the same
arrays: `sections` (the host's L2 sections, m block by m block, the longest tiles first) against
`pairs` (sections of one pair: pair by pair, each pair's m blocks from a rotated start, the
CTAs running together sharing each K/V tile's DRAM read), each forced at every head dim
whatever _dispatch.CAUSAL_PAIR_ORDER_DIMS says. Same kernel; only
_dispatch.persistent_schedule's section size differs. The dev check's shapes of the
persistent head dims under `pairs` (full grid and 7 CTAs, outputs poisoned), after the paper
grid's causal rows, the two orders alternating round by round (median).

    PYTHONPATH=. python3 benchmarks/dev/persistent_order_ab.py [--rounds 5] [--seqlens 512 1024]
"""

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hopper_fwd_check as check_script  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api  # noqa: E402
from cuflash2.bench import paper_grid, timing  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402

ORIGINAL = _dispatch.persistent_schedule


@contextlib.contextmanager
def order(name):
    """The persistent grid in `name`'s order at every head dim, whatever forward_grid's rule
    (its last argument, pair_order, replaced)."""
    def forced(*args):
        return ORIGINAL(*args[:-1], name == "pairs")

    _dispatch.persistent_schedule = forced
    api._forward_plans.plans.clear()
    try:
        yield
    finally:
        _dispatch.persistent_schedule = ORIGINAL
        api._forward_plans.plans.clear()


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    args = ap.parse_args()
    configs = paper_grid.paper_grid(headdims=(64, 128), dtypes=("fp16", "bf16"),
                                    causal_modes=(True,), directions=("fwd",),
                                    seqlens=tuple(args.seqlens))
    backlog = timing.Backlog(cupy)
    print(f"{'configuration':<44} {'sections':>9} {'pairs':>9} {'sections/pairs':>15}  kernel")
    ratios = []
    for seed, config in enumerate(configs):
        q, k, v = paper_grid.random_inputs(cupy, config, dtype_from_name(config.dtype), seed)
        (kernel,) = cuflash2.forward_kernels(q, k, v, causal=True)
        times = {"sections": [], "pairs": []}
        for _ in range(args.rounds):
            for name in times:
                with order(name):
                    fn = lambda: cuflash2.attention(q, k, v, causal=True)  # noqa: E731
                    times[name].append(timing.time_cupy(cupy, fn, 3, 20, backlog, None))
        a, b = (statistics.median(times[n]) for n in ("sections", "pairs"))
        ratios.append(a / b)
        print(f"{config.describe():<44} {a:9.4f} {b:9.4f} {a / b:15.3f}  "
              f"{'persistent' if 'persistent' in kernel else 'one tile a CTA'}", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    mean = statistics.geometric_mean(ratios)
    print(f"sections/pairs geometric mean {mean:.3f} (min {min(ratios):.3f}, max "
          f"{max(ratios):.3f})", flush=True)
    with order("pairs"):
        failures = check_script.check(cupy, ("plain", "pingpong-overlap"), False, True,
                                      ((128, 2), (128, 2, 192)), (64, 128))
    print(f"correctness under `pairs`: {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
