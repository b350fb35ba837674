"""`cuflash2 precompile`: the kernel specialisations a user names, compiled ahead of time in
parallel processes into CuPy's on-disk kernel cache (or a directory the user names), so that a
later process, or a cluster job that ships the cache, starts warm.

A first call of each new signature compiles its kernels (NVRTC, about a second each, a Hopper
backward more) one at a time, inside the call. Which specialisations a call needs follows from
its dtype, head dim, features and direction (and on an H100/H200 from its lengths: the Hopper
kernels or the mma.sync ones); `plan` takes every specialisation the dispatcher can choose for
the named ones, on this machine's GPU architecture (CuPy compiles for the current device, and
a cache serves machines with the same GPU).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from . import _configs, _dispatch

#: --features names -> feature bits (combine with "+": "softcap+alibi"; "none": plain).
FEATURE_NAMES = {"none": 0, "softcap": _configs.FEATURE_SOFTCAP,
                 "alibi": _configs.FEATURE_ALIBI, "sinks": _configs.FEATURE_SINKS,
                 "dropout": _configs.FEATURE_DROPOUT, "varlen": _configs.FEATURE_VARLEN,
                 "rotary": _configs.FEATURE_ROTARY, "cache_leftpad": _configs.FEATURE_LEFTPAD}
#: The features of attention_with_kvcache alone (the decode direction's).
DECODE_ONLY_FEATURES = _configs.FEATURE_ROTARY | _configs.FEATURE_LEFTPAD
DIRECTIONS = ("fwd", "bwd", "decode")
#: --dtype names -> the kernels' elements: fp32 is float32 inputs at precision "highest", tf32
#: at "tf32"; e4m3 FP8 inputs (the Hopper forward alone) with a bfloat16 output, e4m3-fp16 with a
#: float16 one.
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "tf32": "tf32",
          "e4m3": "e4m3_bf16", "e4m3-fp16": "e4m3_fp16"}
#: The defaults: the head dims of most models, plain attention, both training directions.
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_FEATURES = ("none",)
DEFAULT_DIRECTIONS = ("fwd", "bwd")


def parse_features(names) -> list[int]:
    """Feature bit sets from --features names ("softcap", "softcap+alibi", "none", ...);
    ValueError naming the unknown name."""
    sets = []
    for combo in names:
        bits = 0
        for name in combo.split("+"):
            if name not in FEATURE_NAMES:
                raise ValueError(f"--features: unknown feature {name!r}; the names are "
                                 f"{', '.join(FEATURE_NAMES)} (combined with +)")
            bits |= FEATURE_NAMES[name]
        sets.append(bits)
    return list(dict.fromkeys(sets))


def plan(arch: int, dtypes, head_dims, features, directions, head_dims_v=()) -> list:
    """Every specialisation the dispatcher can choose on sm_`arch` for calls of these dtypes
    (the kernels' elements: "float16", "bfloat16", "float32", "tf32"), head dims (any the API
    takes), feature bit sets and directions ("fwd", "bwd": with the deterministic dQ kernel and
    the backward's pre- and post-processing; "decode": attention_with_kvcache), each once.
    `head_dims_v`: v's head dims where they differ from q's (d_v != d_qk: the Hopper kernels'
    pairs of a head dim of `head_dims` and one of these, and the mma.sync kernels' for V's own
    kernel head dim). MLA's latent head dims (q's MLA_HEAD_DIM with v's MLA_HEAD_DIM_V) name the
    MLA decode kernel of each 16-bit dtype (sm_90, "decode", plain calls) and nothing else."""
    dtypes = set(dtypes)
    mla = (arch == 90 and "decode" in directions and 0 in features
           and _configs.MLA_HEAD_DIM in head_dims)
    head_dims = [h for h in head_dims if h != _configs.MLA_HEAD_DIM]
    head_dims_v = [h for h in head_dims_v if h != _configs.MLA_HEAD_DIM_V]
    v_dims = {_dispatch.hopper_forward_head_dim(h)
              for h in head_dims_v if h <= max(_configs.SM90_FWD_HEAD_DIMS)}
    dims = {_dispatch.kernel_head_dim(d) for d in head_dims}
    hopper = arch == 90
    fwd_dims = {_dispatch.hopper_forward_head_dim(h)
                for h in head_dims if h <= max(_configs.SM90_FWD_HEAD_DIMS)}
    bwd_dims = {_dispatch.hopper_backward_head_dim(h)
                for h in head_dims if h <= max(_configs.SM90_BWD_HEAD_DIMS)}

    def named(configs, kernel_dims):
        return [c for c in configs if c.dtype in dtypes and c.head_dim in kernel_dims
                and getattr(c, "head_dim_v", c.head_dim) in v_dims | {c.head_dim}]

    decode_features = [f for f in features if f in _configs.DECODE_FEATURES]
    features = list(dict.fromkeys(f & ~DECODE_ONLY_FEATURES for f in features))
    configs = []
    if "fwd" in directions:
        configs += named(_dispatch.all_fwd_configs(arch, features, tuple(_configs.ELEMENT_TAGS)),
                         dims)
        # V's own head dims on the mma.sync forward (its V kernel head dim at most Q's)
        configs += [_configs.with_features(_dispatch.fwd_config(t, d, arch, d_v), f)
                    for t in dtypes if t in _configs.DTYPE_TAGS for d in head_dims
                    for d_v in head_dims_v
                    if _dispatch.v_kernel_head_dim(d_v, d) < _dispatch.kernel_head_dim(d)
                    for f in features]
        if hopper:
            taken = _configs.SM90_FWD_FEATURES + _configs.SM90_FWD_VARLEN_FEATURES
            configs += named(_dispatch.hopper_forward_configs(
                [f for f in features if f in taken]), fwd_dims)
            # The float32 Hopper forwards ("tf32"; "float32": precision "highest", 3xTF32) and
            # each one's operand pass.
            for element, tiles in _dispatch.FLOAT32_SM90_FWD_TILES.items():
                if element not in dtypes or (element == "float32"
                                             and not _dispatch.HOPPER_FORWARD_F32X3):
                    continue  # (CUFLASH2_HOPPER_F32X3=0: "highest" stays on mma.sync)
                f32_dims = {_dispatch.hopper_forward_head_dim(h, tuple(tiles))
                            for h in head_dims if h <= max(tiles)}
                configs += [c for c in _dispatch.tf32_hopper_forward_configs(features,
                                                                             (element,))
                            if getattr(c, "head_dim", None) in f32_dims
                            or (f32_dims and isinstance(c, _configs.AuxKernel))]
            # The FP8 forward (e4m3 inputs: plain calls, and varlen ones with --features
            # varlen; it takes no other feature bit).
            e4m3 = tuple(t for t in _configs.E4M3_TAGS if t in dtypes)
            e4m3_dims = {h for h in head_dims if h in _dispatch.E4M3_SM90_FWD_TILES}
            if e4m3 and e4m3_dims:
                configs += [c for c in _dispatch.e4m3_hopper_forward_configs(e4m3, features)
                            if c.head_dim in e4m3_dims]
    if "bwd" in directions and head_dims:  # (none left where MLA's alone were named)
        configs += named(_dispatch.all_bwd_configs(arch, features), dims)
        backward = list(dict.fromkeys(_configs.backward_features(f) for f in features))
        configs += _float32_backward(arch, dtypes, head_dims, backward)
        # V's own head dims on the mma.sync backward (split_bwd_configs: main kernels with and
        # without dQ, the deterministic dQ kernel)
        configs += [_configs.with_features(c, f)
                    for t in sorted(dtypes) for d in head_dims for d_v in head_dims_v
                    if d_v != d for deterministic in (False, True)
                    for c in (_dispatch.split_bwd_configs(t, d, d_v, arch, deterministic)
                              or ()) if c is not None for f in backward]
        varlen = any(f & _configs.FEATURE_VARLEN for f in features)
        configs += [c for c in _configs.aux_kernels(tuple(_configs.ELEMENT_TAGS))
                    if _aux_serves(c, dtypes) and (varlen or not c.varlen)
                    and (c.kernel != "flash_bwd_sinks_kernel"
                         or any(f & _configs.FEATURE_SINKS for f in features))]
        if hopper:
            sm90 = named(_dispatch.all_bwd_sm90_configs(
                [f for f in backward
                 if f in _configs.SM90_BWD_FEATURES + _configs.SM90_BWD_VARLEN_FEATURES],
                head_dim_pairs=True), bwd_dims)
            configs += sm90 + [_dispatch.bwd_sm90_config(c.dtype, c.head_dim, True, c.features,
                                                         c.head_dim_v)
                               for c in sm90]
    if "decode" in directions:
        configs += named(_dispatch.all_decode_configs(arch, decode_features), dims)
    if mla:
        configs += [_configs.MlaDecodeConfig(t, paired=paired) for t in sorted(dtypes)
                    if t in _configs.DTYPE_TAGS for paired in (False, True)]
    return list(dict.fromkeys(configs))


def _float32_backward(arch: int, dtypes, head_dims, features) -> list:
    """The float32 backward's main kernels (with and without dQ) and deterministic dQ kernels
    for the float32 elements among `dtypes`: the tiles of each head dim (by head dim, not
    kernel head dim: d=224's main kernel is d=256's), where one fits sm_`arch`."""
    configs = []
    for element in sorted(set(dtypes) & set(_configs.FLOAT32_TAGS)):
        for d in head_dims:
            for choose in (lambda: _dispatch.float32_bwd_config(element, d, arch),
                           lambda: _dispatch.float32_bwd_config(element, d, arch, True),
                           lambda: _dispatch.float32_bwd_dq_config(element, d, arch)):
                try:
                    config = choose()
                except NotImplementedError:  # no tile on this architecture (the call refuses)
                    continue
                configs += [_configs.with_features(config, f) for f in features]
    return configs


def _aux_serves(config, dtypes) -> bool:
    """Whether a small backward kernel serves calls of `dtypes`: its own dtype's, and for
    float32 inputs at TF32 "float32"'s dQ conversion and sinks' gradient (their preprocess is
    "tf32"'s own)."""
    return config.dtype in dtypes or (
        config.dtype == "float32" and "tf32" in dtypes
        and config.kernel != "flash_bwd_preprocess_kernel")


def progress_line(done: int, total: int, elapsed: float) -> str:
    """`done` of `total` compiled after `elapsed` seconds: count, rate and time left."""
    rate = done / elapsed if elapsed > 0 else 0.0
    left = (total - done) / rate if rate > 0 else float("nan")
    bar_width = 30
    filled = bar_width * done // total if total else bar_width
    left_text = f"{left:.0f} s left" if left == left else "time left unknown"
    return (f"[{'#' * filled}{'.' * (bar_width - filled)}] {done}/{total} kernels, "
            f"{rate:.1f}/s, {left_text}")


def _compile_one(config) -> str | None:
    """A worker's compile of one specialisation into CuPy's cache; its error in words, or None."""
    from . import _compile

    try:
        _compile.get_kernel(config, 0)
    except Exception as exc:  # reported by the parent, which goes on with the others
        return f"{config.name_expression}: {exc.__class__.__name__}: {exc}"
    return None


def run(configs, jobs: int, cache_dir: str | None = None, stream=sys.stderr) -> list[str]:
    """Compiles `configs` in `jobs` processes, writing a progress line to `stream` as each
    completes; returns the errors (empty when every one compiled). `cache_dir`: CuPy's kernel
    cache directory for the workers (CUPY_CACHE_DIR), else CuPy's own."""
    if cache_dir is not None:
        os.environ["CUPY_CACHE_DIR"] = cache_dir  # the workers (spawned) inherit it
    errors, done, start = [], 0, time.monotonic()
    # spawn: the parent may hold a CUDA context, which forked children cannot use.
    with ProcessPoolExecutor(max(1, jobs),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(_compile_one, c) for c in configs]):
            error = future.result()
            if error is not None:
                errors.append(error)
            done += 1
            end = "\n" if done == len(configs) else ""
            print(f"\r{progress_line(done, len(configs), time.monotonic() - start)}", end=end,
                  file=stream, flush=True)
    return errors
