"""The SASS of kernel specialisations compiled from two versions of the kernel sources, compared
instruction by instruction (CPU only: NVRTC and nvdisasm of the test extra). For a change that
should not change the machine code (a header split, a function moved, an interface that the
compiler inlines away): identical SASS means identical speed, with no GPU run.

The "base" sources are a folder holding another version of `cuda_src/` (for instance a commit's:
`mkdir -p /tmp/base && git archive REF cuda_src | tar -x -C /tmp/base`); the "head" sources are
the checkout's. Both are compiled from the checkout's configurations (name expressions, probes),
so the kernels' template parameters must be the same in both.

    python benchmarks/dev/sass_diff.py --base /tmp/base/cuda_src --sets fwd90 bwd90 [--all]
        [--jobs 2] [--show 20]

--ignore-param-offsets blanks the kernel parameters' offsets (c[0x0][...]) before comparing, for
versions whose parameter structs differ in size; --skip-features leaves out the specialisations
of features the base does not have.

Sets: fwd, bwd, dq, aux, decode (sm_80 and sm_90 builds of the mma.sync families), fwd90,
bwd90 (sm_90a), fwd90f32 (the TF32 Hopper forward at precision "tf32" and its operand pass). Without --all each set is a sample (head dims 64 and 128, every feature set the
dispatcher builds for the family); --all takes every specialisation of the set. Prints one line
a specialisation that differs (registers, spills, differing instruction lines) and a summary;
exit status 1 if any differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2 import _compile, _configs, _dispatch, _sass  # noqa: E402

_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\* 0x[0-9a-f]+ \*/")


def _configs_of(name: str, all_: bool) -> list[tuple]:
    """(config, arch) pairs of a set."""
    dims = _configs.KERNEL_HEAD_DIMS if all_ else (64, 128)
    features = _configs.ALL_FEATURES if all_ else _configs.TESTED_FEATURES
    out = []
    if name in ("fwd", "bwd", "dq", "aux", "decode"):
        for arch in (80, 90):
            if name == "fwd":
                cs = [c for c in _dispatch.all_fwd_configs(arch, features) if c.head_dim in dims]
            elif name == "bwd":
                cs = [c for c in _dispatch.all_bwd_configs(arch, features)
                      if c.head_dim in dims and isinstance(c, _configs.BwdConfig)]
            elif name == "dq":
                cs = [c for c in _dispatch.all_bwd_configs(arch, features)
                      if c.head_dim in dims and isinstance(c, _configs.BwdDqConfig)]
            elif name == "aux":
                cs = _configs.aux_kernels()
            else:
                cs = [c for c in _dispatch.all_decode_configs(arch, _configs.SCORE_MOD_FEATURES)
                      if c.head_dim in dims]
            out += [(c, arch) for c in cs]
    elif name == "fwd90":
        # Varlen runs on the one-tile-per-CTA grid only (as tests/test_compile_sm90.py builds).
        cs = (_dispatch.all_fwd_sm90_configs(_configs.SM90_FWD_FEATURES, persistent=True)
              + _dispatch.all_fwd_sm90_configs(_configs.SM90_FWD_VARLEN_FEATURES))
        if not all_:
            cs = [c for c in cs if c.head_dim in dims and c.dtype == "float16"]
        out = [(c, 90) for c in cs]
    elif name == "fwd90f32":
        # The TF32 Hopper forward (precision "tf32") and its operand pass, every head dim, plain
        # (with --all every feature set it takes).
        features = (0,) + tuple(f for f in _configs.SM90_FWD_FEATURES if f) if all_ else (0,)
        out = [(c, 90) for c in _dispatch.tf32_hopper_forward_configs(features)]
    elif name == "bwd90":
        feats = _configs.SM90_BWD_FEATURES + _configs.SM90_BWD_VARLEN_FEATURES
        cs = [_dispatch.bwd_sm90_config(dtype, d, det, f) for f in feats
              for dtype in _configs.DTYPE_TAGS for d in _configs.SM90_BWD_HEAD_DIMS
              for det in (False, True)]
        if not all_:
            cs = [c for c in cs if c.head_dim in dims and c.dtype == "float16"]
        out = [(c, 90) for c in cs]
    else:
        raise SystemExit(f"unknown set {name!r}")
    return list(dict.fromkeys(out))


#: A kernel parameter in the constant bank: c[0x0][offset] (--ignore-param-offsets).
_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def _sass_of(config, arch: int, root: str) -> tuple[str, int, int]:
    """(normalised SASS, registers, spill bytes) of `config` compiled from the sources at root."""
    from cuda.bindings import nvrtc

    _compile.cuda_src_dir = lambda: Path(root)
    _compile.kernel_source.cache_clear()
    source = _compile.specialisation_source(config).encode()
    (prog,) = _compile._nvrtc_check(
        nvrtc.nvrtcCreateProgram(source, config.source_file.encode(), 0, [], []), "create")
    try:
        _compile._nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, config.name_expression.encode()),
                              "add name expression", prog, nvrtc)
        options = [o.encode() for o in _compile.NVRTC_OPTIONS
                   + tuple(getattr(config, "extra_options", ()))]
        options += [f"-arch=sm_{_compile.target_arch(config, arch)}".encode(),
                    b"--ptxas-options=-v"]
        _compile._nvrtc_check(nvrtc.nvrtcCompileProgram(prog, len(options), options), "compile",
                              prog, nvrtc)
        log = _compile._nvrtc_log(prog, nvrtc)
        (size,) = _compile._nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size", prog, nvrtc)
        cubin = b" " * size
        _compile._nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin", prog, nvrtc)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    regs = int(_compile._PTXAS_REGS.search(log).group(1))
    spills = _compile._PTXAS_SPILLS.search(log)
    lines = [_ENCODING.sub("", _ADDRESS.sub("", line)).rstrip()
             for line in _sass.disassemble(cubin).splitlines()]
    return "\n".join(line for line in lines if line.strip()), regs, int(spills.group(2))


def _compare(job) -> tuple:
    config, arch, base, head, *rest = job
    a = _sass_of(config, arch, base)
    b = _sass_of(config, arch, head)
    if rest and rest[0]:  # --ignore-param-offsets: a struct that grew moves its fields
        a = (_PARAM.sub("c[0x0][param]", a[0]),) + a[1:]
        b = (_PARAM.sub("c[0x0][param]", b[0]),) + b[1:]
    if a[0] == b[0]:
        return config, arch, None, a[1:], b[1:]
    diff = [d for d in difflib.unified_diff(a[0].splitlines(), b[0].splitlines(), lineterm="",
                                            n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    return config, arch, diff, a[1:], b[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other version's cuda_src folder")
    parser.add_argument("--sets", nargs="+", default=["fwd", "bwd", "dq", "aux", "decode",
                                                      "fwd90", "bwd90"])
    parser.add_argument("--all", action="store_true", help="every specialisation of each set")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--show", type=int, default=0, help="differing lines shown a kernel")
    parser.add_argument("--ignore-param-offsets", action="store_true",
                        help="compare with every kernel parameter's offset blanked (a parameter "
                             "struct that grew between the versions moves the fields after it)")
    parser.add_argument("--skip-features", type=int, default=0,
                        help="leave out specialisations with any of these feature bits (ones "
                             "the base's kernels do not have)")
    args = parser.parse_args()
    head = str(_compile.cuda_src_dir())
    jobs = [(c, arch, args.base, head, args.ignore_param_offsets)
            for s in args.sets for c, arch in _configs_of(s, args.all)
            if not getattr(c, "features", 0) & args.skip_features]
    print(f"{len(jobs)} specialisations, base {args.base}, head {head}", flush=True)
    differing = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for config, arch, diff, (ra, sa), (rb, sb) in pool.map(_compare, jobs):
            if diff is None:
                continue
            differing += 1
            print(f"DIFFERS sm_{arch} {config.name_expression}: registers {ra} -> {rb}, spills "
                  f"{sa} -> {sb}, {len(diff)} lines", flush=True)
            for line in diff[:args.show]:
                print("    " + line)
    print(f"{len(jobs) - differing} of {len(jobs)} specialisations have the same SASS")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
