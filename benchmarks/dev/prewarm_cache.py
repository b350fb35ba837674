"""Compiles kernel specialisations into CuPy's disk cache in parallel processes, so that a test or
benchmark run that follows finds them compiled (CuPy compiles one kernel at a time, in-process).

    CUPY_CACHE_DIR=/tmp/cc python benchmarks/dev/prewarm_cache.py [--jobs 16] [--features 0 1 2 3 4 7]
"""

import argparse
import dataclasses
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2 import _configs, _dispatch  # noqa: E402


def _compile(configs):
    from cuflash2 import _compile as compile_module

    for cfg in configs:
        compile_module.get_kernel(cfg, 0)
    return len(configs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--features", type=int, nargs="+", default=list(_configs.ALL_FEATURES))
    ap.add_argument("--arch", type=int, default=None, help="default: device 0's")
    ap.add_argument("--kernels", nargs="+",
                    choices=("fwd", "bwd", "decode", "sm90-dev", "det-smoke"),
                    default=["fwd", "bwd", "decode"])
    args = ap.parse_args()
    if args.arch is None:
        import cupy

        args.arch = int(cupy.cuda.Device(0).compute_capability)
    configs = []
    if "fwd" in args.kernels:
        configs += _dispatch.all_fwd_configs(args.arch, args.features)
        if args.arch == 90:  # the Hopper forward's, as the dispatcher chooses them
            configs += _dispatch.hopper_forward_configs(
                [f for f in args.features if f in _configs.SM90_FWD_FEATURES])
    if "bwd" in args.kernels:
        configs += _dispatch.all_bwd_configs(args.arch, args.features) + _configs.aux_kernels()
        if args.arch == 90:  # the Hopper backward's main kernels, default and deterministic
            sm90 = _dispatch.all_bwd_sm90_configs(list(dict.fromkeys(
                _configs.backward_features(f) for f in args.features
                if _configs.backward_features(f) in _configs.SM90_BWD_FEATURES)))
            if _configs.FEATURE_VARLEN in args.features:  # varlen with each modifier set
                sm90 += _dispatch.all_bwd_sm90_configs(_configs.SM90_BWD_VARLEN_FEATURES)
            configs += sm90 + [_dispatch.bwd_sm90_config(c.dtype, c.head_dim, True, c.features)
                               for c in sm90]
    if "decode" in args.kernels:
        configs += _dispatch.all_decode_configs(
            args.arch, [f for f in args.features if f in _configs.DECODE_FEATURES])
    if "sm90-dev" in args.kernels:  # what hopper_fwd_check / hopper_bwd_check build (features 0)
        configs += _dispatch.all_fwd_sm90_configs((0,), persistent=True)
        configs += [dataclasses.replace(c, watchdog=True)  # --schedule plain --watchdog
                    for c in _dispatch.all_fwd_sm90_configs((0,), (False,), persistent=True)
                    if not c.pingpong]
        configs += _dispatch.hopper_forward_configs(_configs.SM90_FWD_VARLEN_FEATURES)  # varlen tests
        configs += [dataclasses.replace(c, watchdog=w) for c in _dispatch.all_bwd_sm90_configs((0,))
                    for w in (False, True)]
    if "det-smoke" in args.kernels:  # what hopper_det_smoke builds (bf16, under the watchdog)
        configs += [dataclasses.replace(_dispatch.bwd_sm90_config("bfloat16", d, True),
                                        watchdog=True) for d in _configs.SM90_BWD_HEAD_DIMS]
    configs = list(dict.fromkeys(configs))
    start = time.time()
    chunks = [configs[i::args.jobs] for i in range(args.jobs)]
    # spawn: the parent may hold a CUDA context, which forked children cannot use.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, chunks))
    print(f"compiled {done} specialisations for sm_{args.arch} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
