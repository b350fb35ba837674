"""Compiles kernel specialisations into CuPy's disk cache in parallel processes, so that a test or
benchmark run that follows finds them compiled (CuPy compiles one kernel at a time, in-process).

    CUPY_CACHE_DIR=/tmp/cc python benchmarks/dev/prewarm_cache.py [--jobs 16] [--features 0 1 2 3 4 7]
        [--kernels fwd bwd decode float32 ...]

`float32`: float32 inputs' forward and backward kernels (both precisions, every kernel head dim a
tile fits, the backward's small kernels), which tests/gpu/test_float32.py runs.
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2 import _configs, _dispatch, precompile  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--features", type=int, nargs="+", default=list(_configs.ALL_FEATURES))
    ap.add_argument("--arch", type=int, default=None, help="default: device 0's")
    ap.add_argument("--kernels", nargs="+",
                    choices=("fwd", "bwd", "decode", "decode-e4m3", "sm90-dev", "det-smoke",
                             "float32"),
                    default=["fwd", "bwd", "decode"])
    args = ap.parse_args()
    if args.arch is None:
        import cupy

        args.arch = int(cupy.cuda.Device(0).compute_capability)
    # The kernels a user's `cuflash2 precompile` plans (every dtype and kernel head dim, and
    # MLA's latent head dims: the MLA decode kernel with "decode" on sm_90).
    configs = precompile.plan(args.arch, _configs.DTYPE_TAGS,
                              _configs.KERNEL_HEAD_DIMS + (_configs.MLA_HEAD_DIM,),
                              args.features, [k for k in args.kernels if k in
                                              precompile.DIRECTIONS], [_configs.MLA_HEAD_DIM_V])
    if "decode-e4m3" in args.kernels:  # the decode kernels of an FP8 e4m3 cache
        decode_features = [f for f in args.features if f in _configs.DECODE_FEATURES]
        configs += _dispatch.all_decode_configs(args.arch, decode_features, ("e4m3",))
    if "float32" in args.kernels:  # float32 inputs' mma.sync kernels, both precisions
        elements = tuple(_configs.FLOAT32_TAGS)
        configs += _dispatch.all_fwd_configs(args.arch, args.features, elements)
        configs += _dispatch.all_bwd_configs(args.arch, args.features, elements)
        configs += _configs.aux_kernels(elements)
        if args.arch == 90:  # the float32 Hopper forwards ("tf32", "highest") and their passes
            configs += _dispatch.tf32_hopper_forward_configs(args.features, elements)
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
    errors = precompile.run(configs, args.jobs)
    for error in errors:
        print(f"failed: {error}", file=sys.stderr)
    print(f"compiled {len(configs) - len(errors)} specialisations for sm_{args.arch} in "
          f"{time.time() - start:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
