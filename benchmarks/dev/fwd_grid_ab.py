"""The Hopper forward's grid, tile schedule and consumer count per paper-grid row, A/B in one
process on the same arrays, beside SDPA's cuDNN backend: the data behind
_dispatch.PERSISTENT_MAX_KEYS, THREE_CONSUMER_MIN_KEYS, THREE_CONSUMER_PERSISTENT_MAX_KEYS,
CAUSAL_PAIR_ORDER_DIMS and DYNAMIC_SCHEDULE.

Variants of a row (those that apply to it; the dispatched one is marked *):
  2c / 3c      two consumer warpgroups (128-row tiles, the dispatched schedule) or three (192-row
               tiles, in order; d <= 64 only);
  one          one work tile a CTA;
  pers         the persistent grid, static schedule; under a causal mask `pers-sec` (L2
               sections, m block by m block, the longest first) and `pers-pair` (pair by pair,
               rotated starts), and `dyn-sec` / `dyn-pair`: the same orders claimed dynamically
               (WorkTileClaims);
  H:...        (with --alt DIR) the same on the kernel sources with DIR's files in place
               (benchmarks/dev/ab_sources.py), e.g. an earlier commit's kernel.
Each variant is timed in rounds alternating with the others (median of the rounds' medians);
the last column is the fastest variant against cuDNN.

    PYTHONPATH=. python3 benchmarks/dev/fwd_grid_ab.py [--dtypes bf16] [--rounds 3]
        [--headdims 64 128] [--seqlens 512 ... 16384] [--causal both|yes|no] [--alt DIR]
"""

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api  # noqa: E402
from cuflash2.bench import paper_grid, timing, torch_peers  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402

KNOBS = ("PERSISTENT_MAX_KEYS", "THREE_CONSUMER_MIN_KEYS", "THREE_CONSUMER_PERSISTENT_MAX_KEYS",
         "CAUSAL_PAIR_ORDER_DIMS", "DYNAMIC_SCHEDULE", "DYNAMIC_SCHEDULE_KEYS")
ORIGINAL = {name: getattr(_dispatch, name) for name in KNOBS}
NEVER, ALWAYS = -1, 1 << 40
SOURCES = None  # ab_sources.Sources with --alt


@contextlib.contextmanager
def variant(consumers: int, grid: str, alt: bool = False):
    """The dispatcher's knobs set so that every call runs `consumers` consumer warpgroups on
    `grid` ("one", "pers" (the order forward_grid picks), "pers-sec", "pers-pair", "dyn-sec",
    "dyn-pair"), on the --alt sources if `alt`."""
    persistent = grid != "one"
    _dispatch.PERSISTENT_MAX_KEYS = {key: ALWAYS if persistent else NEVER
                                   for key in ORIGINAL["PERSISTENT_MAX_KEYS"]}
    _dispatch.THREE_CONSUMER_PERSISTENT_MAX_KEYS = ALWAYS if persistent else NEVER
    _dispatch.THREE_CONSUMER_MIN_KEYS = ({key: 0 for key in ORIGINAL["THREE_CONSUMER_MIN_KEYS"]}
                                       if consumers == 3 else {})
    if grid.endswith("-pair"):
        _dispatch.CAUSAL_PAIR_ORDER_DIMS = (64, 96, 128)
    elif grid.endswith("-sec"):
        _dispatch.CAUSAL_PAIR_ORDER_DIMS = ()
    _dispatch.DYNAMIC_SCHEDULE = grid.startswith("dyn")
    _dispatch.DYNAMIC_SCHEDULE_KEYS = {64: (0, ALWAYS), 96: (0, ALWAYS), 128: (0, ALWAYS)}
    if SOURCES is not None:
        SOURCES.use("alt" if alt else "base")
    api._forward_plans.plans.clear()
    try:
        yield
    finally:
        for name, value in ORIGINAL.items():
            setattr(_dispatch, name, value)
        if SOURCES is not None:
            SOURCES.use("base")
        api._forward_plans.plans.clear()


def variants_of(config, alt: bool) -> list:
    if config.headdim <= 64 and not config.causal:
        names = [(3, "one"), (3, "pers")]
    elif config.headdim <= 64:
        names = [(2, "pers-sec"), (2, "dyn-sec"), (3, "one"), (3, "pers-sec"), (3, "pers-pair"),
                 (3, "dyn-sec")]
    elif not config.causal:
        names = [(2, "one"), (2, "pers")]
    else:
        names = [(2, "one"), (2, "pers-pair"), (2, "dyn-sec")]
    names = [(c, g, False) for c, g in names]
    if alt:  # the earlier kernel on its static persistent grid
        names += [(c, g, True) for c, g, _ in names if g.startswith("pers")]
    return names


def dispatched_label(config, q, k, v) -> tuple:
    """The variant the dispatcher runs `config`'s call as (consumers, grid)."""
    (kernel,) = cuflash2.forward_kernels(q, k, v, causal=config.causal)
    consumers = 3 if "three warpgroups" in kernel else 2
    if "persistent" not in kernel:
        return consumers, "one"
    if not config.causal:
        return consumers, "pers"
    kernel_dim = min(d for d in (64, 96, 128) if d >= config.headdim)
    if _dispatch.dynamic_schedule(kernel_dim, config.seqlen, config.seqlen, 0):
        return consumers, "dyn-sec"
    return consumers, "pers-pair" if kernel_dim in _dispatch.CAUSAL_PAIR_ORDER_DIMS else "pers-sec"


def label(consumers, grid, alt=False):
    return f"{'H:' if alt else ''}{consumers}c-{grid}"


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(paper_grid.PAPER_SEQLENS))
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--alt", type=Path, default=None)
    args = ap.parse_args()
    global SOURCES
    if args.alt is not None:
        from ab_sources import Sources
        SOURCES = Sources(args.alt)
    causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    configs = paper_grid.paper_grid(headdims=tuple(args.headdims), dtypes=tuple(args.dtypes),
                                    causal_modes=causal_modes, directions=("fwd",),
                                    seqlens=tuple(args.seqlens))
    torch = torch_peers.load_torch()
    backlog = timing.Backlog(cupy)
    for seed, config in enumerate(configs):
        q, k, v = paper_grid.random_inputs(cupy, config, dtype_from_name(config.dtype), seed)
        causal = config.causal
        dispatched = dispatched_label(config, q, k, v)
        names = variants_of(config, SOURCES is not None)
        times = {name: [] for name in names}
        outputs = {}
        for _ in range(args.rounds):
            for name in names:
                with variant(*name):
                    fn = lambda: cuflash2.attention(q, k, v, causal=causal)  # noqa: E731
                    times[name].append(timing.time_cupy(cupy, fn, 3, args.iters, backlog, None))
                    if name not in outputs:
                        outputs[name] = fn()
        cudnn_ms = None
        if torch is not None:
            reference = torch_peers.TorchSdpaCudnn(torch, cupy, config.dtype)
            run = reference.forward(q, k, v, causal)
            with reference.only():
                cudnn_ms = timing.time_torch(torch, run, 3, args.iters, backlog)
        ms = {name: statistics.median(t) for name, t in times.items()}
        base = outputs[names[0]]
        diffs = max(float(cupy.abs(out.astype(cupy.float32) - base.astype(cupy.float32)).max())
                    for out in outputs.values())
        best = min(ms, key=ms.get)
        cells = []
        for name in names:
            mark = "*" if name == (*dispatched, False) else " "
            cells.append(f"{label(*name)}{mark} {ms[name]:.4f}")
        tail = f" | best {label(*best)}" + (f" {cudnn_ms / ms[best]:.3f}x cuDNN ({cudnn_ms:.4f})"
                                            if cudnn_ms else "")
        print(f"{config.describe():<44} " + "  ".join(cells) + tail + f"  maxdiff {diffs:.1e}",
              flush=True)
        del q, k, v, outputs
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
