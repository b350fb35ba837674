"""The mask modifiers of benchmarks/programmable_vs_flex.py (1 x 16 heads x 16k, d=128, bf16,
each with its block mask) on several versions of the package in one process, alternating round by
round on the same arrays: the checkout's `cuflash2` and other versions, each extracted from a
commit (`mkdir -p ab_base && git archive REF cuflash2 cuda_src | tar -x -C ab_base`, as
ab_packages.py), with the built-in causal and window masks of the checkout beside them; the
kernels compiled first in parallel processes. Prints per mask and direction the median of the
rounds' medians of each version, their ratios to the first, and head/built-in.

    PYTHONPATH=. python3 benchmarks/dev/mods_ab.py [--versions ab_base ...] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # programmable_vs_flex
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from ab_packages import load_base_package  # noqa: E402
from cuflash2.bench.timing import Backlog, time_cupy  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402
from programmable_vs_flex import D, HEADS, MASKS, SEQ, doc_ids, mask_mod_of  # noqa: E402

MASK_NAMES = tuple(MASKS)


def masks(package, doc):
    """name -> (mask_mod, built-in kwargs or None) of `package`."""
    return {name: (mask_mod_of(package, name, doc), builtin)
            for name, (_, builtin) in MASKS.items()}


def inputs():
    dtype = dtype_from_name("bf16")
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, SEQ, HEADS, D), dtype=cupy.float32).astype(dtype)
                     for _ in range(4))
    return dtype, q, k, v, dout, doc_ids()


def mask_calls(package, name, arrays, builtin_too: bool):
    """(forward, backward) of mask `name` with its block mask on `package`, and with
    `builtin_too` the same of the built-in mask (else, or where there is none, None)."""
    dtype, q, k, v, dout, doc = arrays
    mm, builtin = masks(package, doc)[name]
    bm = package.block_mask(mm, 1, 1, SEQ, SEQ, head_dim=D, dtype=dtype)
    out, lse = package.attention(q, k, v, mask_mod=mm, block_mask=bm, return_lse=True)
    calls = (lambda: package.attention(q, k, v, mask_mod=mm, block_mask=bm),
             lambda: package.attention_backward(dout, q, k, v, out, lse, block_mask=bm)[0])
    built = None
    if builtin is not None and builtin_too:
        out_b, lse_b = package.attention(q, k, v, return_lse=True, **builtin)
        built = (lambda: package.attention(q, k, v, **builtin),
                 lambda: package.attention_backward(dout, q, k, v, out_b, lse_b, **builtin)[0])
    return calls, built


def load(folder, index):
    return cuflash2 if folder is None else load_base_package(folder, f"cuflash2_v{index}")


def warm(job):
    """Compiles a version's kernels of one mask (a process of the warm-up's pool)."""
    folder, index, name = job
    calls, built = mask_calls(load(folder, index), name, inputs(), folder is None)
    for fn in calls + (built or ()):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return folder, name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=["ab_base"],
                        help="folders of other versions; the first is the base")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", nargs="+", default=None, help="mask names' first words")
    parser.add_argument("--jobs", type=int, default=8, help="warm-up processes")
    args = parser.parse_args()
    names = [n for n in MASK_NAMES if not args.only or n.split()[0] in args.only]
    folders = args.versions + [None]  # the checkout's package last
    jobs = [(f, i, n) for n in names for i, f in enumerate(folders)]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for folder, name in pool.map(warm, jobs):
            print(f"# warm: {folder or 'head'} {name}", flush=True)
    packages = [load(f, i) for i, f in enumerate(folders)]
    labels = list(args.versions) + ["head"]
    arrays = inputs()
    backlog = Backlog(cupy)
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, bf16 1 x {HEADS} x "
          f"{SEQ} d={D}, {args.rounds} rounds of {args.iters}; ratios to {labels[0]}")
    print("| mask | dir | " + " | ".join(f"{l} ms" for l in labels) + " | built-in ms | "
          + " | ".join(f"{l}/{labels[0]}" for l in labels[1:]) + " | head/built-in | "
          "max abs(head - base) |")
    print("|---|---|" + "---|" * (2 * len(labels) + 2))
    for name in names:
        calls = {l: mask_calls(pk, name, arrays, l == "head") for l, pk in zip(labels, packages)}
        built = calls["head"][1]
        fns = {l: c[0] for l, c in calls.items()}
        if built is not None:
            fns["built-in"] = built
        diffs = [float(cupy.abs(fns["head"][i]().astype(cupy.float32)
                                - fns[labels[0]][i]().astype(cupy.float32)).max())
                 for i in (0, 1)]
        times = {label: ([], []) for label in fns}
        for _ in range(args.rounds):
            for label, pair in fns.items():
                for i in (0, 1):
                    times[label][i].append(time_cupy(cupy, pair[i], 2, args.iters, backlog))
        for i, direction in enumerate(("fwd", "bwd")):
            med = {label: statistics.median(t[i]) for label, t in times.items()}
            b = med.get("built-in")
            cells = [f"{med[l]:.3f}" for l in labels] + ["–" if b is None else f"{b:.3f}"]
            cells += [f"{med[l] / med[labels[0]]:.3f}" for l in labels[1:]]
            cells += ["–" if b is None else f"{med['head'] / b:.3f}", f"{diffs[i]:.3g}"]
            print(f"| {name} | {direction} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
