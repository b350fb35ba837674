"""NVRTC compilation of the kernel specialisations the dispatcher can choose (CPU, no GPU).

Drives NVRTC directly (cuda.bindings.nvrtc) for every architecture of CPU_TEST_ARCHS and reads
ptxas's resource report: the kernels must compile, fit the register file and shared memory, and
not spill. By default a representative sample is compiled (`_sampled`); `--exhaustive` (see
tests/conftest.py) compiles every case below. The compiles run in a process pool (`compiled`),
one process per CPU unless `--compile-jobs` says otherwise.
"""

import multiprocessing
import types
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuflash2 import _compile, _configs, _dispatch, _sass

# Shared memory a block may use (opt-in limit): sm_80 163 KiB, sm_86/89 99 KiB, sm_90 227 KiB.
MAX_SMEM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

# Every specialisation, plain and with the feature combinations of TESTED_FEATURES (each feature
# alone and all together; the backward's without the forward-only sinks, which its main kernels
# do not take); on sm_90, every combination at head dims 64 and 128. The decode kernel: every
# modifier set it takes (DECODE_MOD_FEATURES: the score modifiers, without and with sinks); its
# cache's own features (rotary, cache_leftpad) in ROTARY_DECODE_CASES.
BWD_TESTED_FEATURES = tuple(dict.fromkeys(_configs.backward_features(f)
                                          for f in _configs.TESTED_FEATURES))


def _all_combinations_sm90(configs, tested):
    return [(cfg, 90) for cfg in configs if cfg.head_dim in (64, 128)
            and cfg.features not in tested]


FWD_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
             for cfg in _dispatch.all_fwd_configs(arch, _configs.TESTED_FEATURES)]
FWD_CASES += _all_combinations_sm90(_dispatch.all_fwd_configs(90, _configs.ALL_FEATURES),
                                    _configs.TESTED_FEATURES)
# Float32 inputs' forward (both precisions): every head dim, plain and with every tested feature
# together (the features' code is the 16-bit kernels', compiled with each alone above; the
# exhaustive step's time in CI is what limits these matrices).
FWD_CASES += [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
              for cfg in _dispatch.all_fwd_configs(arch, (0, max(_configs.TESTED_FEATURES)),
                                                   tuple(_configs.FLOAT32_TAGS))]
BWD_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
             for cfg in dict.fromkeys(_dispatch.all_bwd_configs(arch, _configs.TESTED_FEATURES))]
BWD_CASES += _all_combinations_sm90(
    dict.fromkeys(_dispatch.all_bwd_configs(90, _configs.ALL_FEATURES)), BWD_TESTED_FEATURES)
# Float32 inputs' backward main kernel (both precisions): every head dim a tile fits, plain and
# with every tested feature together (as the float32 forward's).
BWD_CASES += [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
              for cfg in _dispatch.all_bwd_configs(arch, (0, max(_configs.TESTED_FEATURES)),
                                                   tuple(_configs.FLOAT32_TAGS))]
AUX_CASES_EXTRA = [(_configs.DropoutMaskKernel(), arch) for arch in _configs.CPU_TEST_ARCHS]
# cuflash2.merge_states' kernel: every element type and lane count (MERGE_SAMPLE by default).
MERGE_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS for cfg in _configs.merge_configs()]
DECODE_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
                for cfg in _dispatch.all_decode_configs(arch, _configs.DECODE_MOD_FEATURES)]
# The e4m3 cache's decode kernels (kv_cache_e4m3.cuh) under --exhaustive, plain and with every
# decode feature together (each alone is the 16-bit kernels' code, above).
DECODE_CASES += [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
                 for cfg in _dispatch.all_decode_configs(
                     arch, (0, max(_configs.DECODE_MOD_FEATURES)), ("e4m3",))]
# The decode kernel with rotary and cache_leftpad (FEATURE_ROTARY | FEATURE_LEFTPAD) under
# --exhaustive, ROTARY_DECODE_SAMPLE by default: with every modifier on every specialisation
# (16-bit and e4m3 caches), alone at the main head dims 64 and 128 of the 16-bit cache. (Each of
# the two alone is a part of that code: rotary in the append, the tiles' new rows and q's load;
# cache_leftpad in the first tile and the mask.)
_CACHE_FEATURES = _configs.FEATURE_ROTARY | _configs.FEATURE_LEFTPAD
ROTARY_DECODE_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
                       for cfg in _dispatch.all_decode_configs(arch, (_CACHE_FEATURES,))
                       if cfg.head_dim in (64, 128)]
ROTARY_DECODE_CASES += [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
                        for cfg in _dispatch.all_decode_configs(
                            arch, (_CACHE_FEATURES | max(_configs.DECODE_MOD_FEATURES),),
                            (None, "e4m3"))]
AUX_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
             for cfg in _configs.aux_kernels((*_configs.DTYPE_TAGS, *_configs.FLOAT32_TAGS))]

# The default sample, as (arch, dtype, kernel head dim) points of every kernel family (forward;
# backward main kernel with and without dQ; deterministic dQ; decode):
# - plain kernels at the main head dims 64 and 128 on every architecture, in both dtypes on
#   sm_80 and sm_90 and one each on sm_86 and sm_89 (MAIN_POINTS; --exhaustive: all);
# - plain kernels at head dim 256 on every architecture, the dtype alternating: the > 128 path,
#   whose tiles differ by architecture (8-warp forward tiles, 4-warp ones on the 100 KiB parts;
#   the backward's dK/dV/dQ in two column chunks on sm_90; 2-warp decode tiles on 100 KiB parts);
# - every other kernel head dim once, plain, the architecture and dtype rotating (192 on sm_90:
#   the largest head dim whose deterministic dQ kernel must be spill-free);
# - each feature alone and all together (TESTED_FEATURES, sinks included; the backward's
#   without sinks; for decode TESTED_DECODE_FEATURES: each score modifier, sinks alone and all
#   together) at d=64 on sm_80, and at d=128 on sm_90 all together (the decode kernel: each
#   too; ALL_TOGETHER_ARCH).
# The decode kernel's variant with its rows on the mma's n side (DECODE_BLOCK_M_N8) only at d=128
# (its points there: plain on every architecture, the features on sm_90), the other half of a
# decode point's cost; the one that reads the cache early (sm_90's programmatic launches) only at
# d=128 plain. The small kernels (preprocess, convert_dq, sinks, dropout mask) are compiled for
# every case on sm_80 and sm_90 (AUX_SAMPLE_ARCHS), the benchmark's spin kernel everywhere.
# The other sm_90 feature combinations and the remaining head dim /
# architecture / dtype points are compiled under --exhaustive.
#: The (architecture, dtype) pairs of the main head dims: both dtypes where the kernels' tiles
#: differ most (sm_80, sm_90), one each on sm_86 and sm_89 (the sm_86 family's 100 KiB tiles,
#: which differ from sm_80's by architecture, not by dtype).
MAIN_POINTS = {(80, "float16"), (80, "bfloat16"), (86, "float16"), (89, "bfloat16"),
               (90, "float16"), (90, "bfloat16")}
SAMPLE_PLAIN = {(arch, dtype, d) for arch, dtype in MAIN_POINTS for d in (64, 128)}
SAMPLE_PLAIN |= {(80, "float16", 256), (86, "bfloat16", 256), (89, "float16", 256),
                 (90, "bfloat16", 256)}
SAMPLE_PLAIN |= {(80, "float16", 32), (86, "bfloat16", 96), (89, "float16", 160),
                 (90, "bfloat16", 192), (90, "float16", 224)}
SAMPLE_FEATURES = {(90, "bfloat16", 128), (80, "float16", 64)}
#: The architecture whose mma.sync forward and backward take only every feature together in the
#: sample (each alone on sm_80): on sm_90 the Hopper kernels run those features' calls, the
#: mma.sync ones dropout and the calls the Hopper kernels leave (the suite's time budget). Its
#: decode kernel, sm_90's own, keeps every tested set.
ALL_TOGETHER_ARCH = 90
#: Float32 inputs' forward and backward: plain at these points (the backward has no d=256 on
#: sm_86), and every feature together at d=128 on sm_90 (FLOAT32_SAMPLE_FEATURES).
SAMPLE_PLAIN |= {(80, "float32", 128), (90, "tf32", 128), (90, "float32", 64),
                 (86, "float32", 256)}
FLOAT32_SAMPLE_FEATURES = (90, "float32", 128)
#: The e4m3 cache's decode kernels in the sample, as (arch, dtype, head dim, block_m,
#: keys_per_warp, features): fp16 on sm_80 (an m16 tile), bf16 with every feature and its rows
#: on the n side on sm_90 (two compiles: the suite's budget; sm_90's clustered kernel, 32 keys a
#: warp, and the rest under --exhaustive).
E4M3_DECODE_SAMPLE = {
    (80, "float16", 128, _configs.DECODE_BLOCK_M, 16, 0),
    (90, "bfloat16", 128, _configs.DECODE_BLOCK_M_N8, 16,
     _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI | _configs.FEATURE_SINKS)}
#: The decode kernel with rotary and cache_leftpad in the sample, as E4M3_DECODE_SAMPLE's
#: points (and the cache's dtype): sm_80 fp16 d=64 on an m16 tile, sm_90 bf16 d=128 with every
#: modifier too, its rows on the n side (two compiles; the e4m3 cache's and the rest under
#: --exhaustive).
ROTARY_DECODE_SAMPLE = {
    (80, "float16", 64, _configs.DECODE_BLOCK_M, 16, _CACHE_FEATURES, None),
    (90, "bfloat16", 128, _configs.DECODE_BLOCK_M_N8, 16,
     _CACHE_FEATURES | max(_configs.DECODE_MOD_FEATURES), None)}
#: The small kernels (no head dim: their code does not depend on the tiles) on these.
AUX_SAMPLE_ARCHS = (80, 90)
#: merge_states.cu in the sample, as (arch, dtype, lanes): each element type once on sm_80 and
#: sm_90, a lane count each (d=128 16-bit rows take 16 lanes, d=64 8, float32 d=128 32); one
#: lane a row too (its lanes loop over the chunks).
MERGE_SAMPLE = {(80, "float16", 16), (80, "float32", 32), (90, "bfloat16", 8),
                (90, "float32", 1)}


def _sampled(cfg, arch) -> bool:
    """Whether (cfg, arch) is compiled without --exhaustive."""
    if isinstance(cfg, _configs.MergeStatesConfig):
        return (arch, cfg.dtype, cfg.lanes) in MERGE_SAMPLE
    if not hasattr(cfg, "head_dim"):  # preprocess, convert_dq, sinks, dropout mask: every
        return arch in AUX_SAMPLE_ARCHS  # case on the sample's ends of the architectures
    point = (arch, cfg.dtype, cfg.head_dim)
    if isinstance(cfg, _configs.DecodeConfig) and cfg.features & _CACHE_FEATURES:
        return not cfg.early_cache_reads and (*point, cfg.block_m, cfg.keys_per_warp,
                                              cfg.features, cfg.kv_cache_dtype
                                              ) in ROTARY_DECODE_SAMPLE
    if isinstance(cfg, _configs.DecodeConfig) and cfg.kv_cache_dtype is not None:
        return not cfg.early_cache_reads and (*point, cfg.block_m, cfg.keys_per_warp,
                                              cfg.features) in E4M3_DECODE_SAMPLE
    if isinstance(cfg, _configs.DecodeConfig) and (
            (cfg.block_m == _configs.DECODE_BLOCK_M_N8 and cfg.head_dim != 128)
            or (cfg.early_cache_reads and (cfg.head_dim != 128 or cfg.features))):
        return False  # the decode kernel's variants: at their d=128 points (below)
    if cfg.features == 0:
        return point in SAMPLE_PLAIN
    if cfg.dtype in _configs.FLOAT32_TAGS:
        return point == FLOAT32_SAMPLE_FEATURES and cfg.features == max(_tested_features(cfg))
    if arch == ALL_TOGETHER_ARCH and not isinstance(cfg, _configs.DecodeConfig):
        return point in SAMPLE_FEATURES and cfg.features == max(_tested_features(cfg))
    return cfg.features in _tested_features(cfg) and point in SAMPLE_FEATURES


def _tested_features(cfg) -> tuple:
    """The feature sets of `cfg`'s family that the default sample compiles."""
    if isinstance(cfg, _configs.DecodeConfig):
        return _configs.TESTED_DECODE_FEATURES
    if isinstance(cfg, _configs.FwdConfig):
        return _configs.TESTED_FEATURES
    return BWD_TESTED_FEATURES


def _cases(cases, ids):
    """pytest params: the cases outside the sample are marked `exhaustive` (deselected by
    tests/conftest.py unless --exhaustive)."""
    return [pytest.param(cfg, arch, id=case_id,
                         marks=() if _sampled(cfg, arch) else pytest.mark.exhaustive)
            for (cfg, arch), case_id in zip(cases, ids)]


#: Every plain forward and backward main kernel must be spill-free. The deterministic dQ kernel
#: (flash_bwd_dq.cu, 16 rows a warp with a whole dQ row block in registers) must be spill-free on
#: sm_90 (the GPU it is measured on) up to head dim 192. Elsewhere, and in the softcap / ALiBi
#: specialisations (a few more live values per score), a few spilled words are reported and
#: bounded here.
BWD_SPILL_FREE_ARCH = 90
BWD_SPILL_FREE_MAX_HEAD_DIM = 192
BWD_SPILL_LIMIT = 128  # bytes
#: (arch, kernel head dim) of the float32 backward's main kernels that spill a few words: d=192
#: on the 100 KiB parts (16 x 32 steps of 2 warps: 24-28 bytes at either precision).
FLOAT32_BWD_SPILLING = {(86, 192), (89, 192)}


def _case_id(cfg, arch):
    kind = type(cfg).__name__
    detail = getattr(cfg, "head_dim", getattr(cfg, "kernel", ""))
    extra = "" if getattr(cfg, "compute_dq", True) else "-nodq"
    extra += f"-f{cfg.features}" if getattr(cfg, "features", 0) else ""
    return f"sm{arch}-{kind}-{cfg.dtype}-{detail}{extra}"


def _report(compiled, cfg, arch):
    report = compiled(cfg, arch)
    print(f"sm_{arch} {cfg.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, "
          f"{report.stack_bytes} bytes stack, {cfg.smem_bytes} bytes smem")
    assert report.registers <= 255
    assert report.cubin_bytes > 0
    assert not report.odd_descriptors, report.odd_descriptors  # (cuflash2/_sass.py)
    assert cfg.smem_bytes <= MAX_SMEM[arch]
    return report


@pytest.fixture(scope="module")
def nvrtc_available():
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")


@pytest.fixture(scope="module")
def compiled(request, nvrtc_available, compile_jobs):
    """compiled(config, arch) -> ptxas's report. Every (config, arch) the selected tests of this
    module compile is submitted at once to a pool of `compile_jobs` processes, in test order, so
    each test waits for its own compile only; a compile error is raised in the test it belongs to.
    """
    cases = list(dict.fromkeys(
        (item.callspec.params["config"], item.callspec.params["arch"])
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
        and {"config", "arch"} <= item.callspec.params.keys()))
    if compile_jobs <= 1 or len(cases) <= 1:
        yield _compile.compile_report
        return
    # spawn: the workers import cuflash2 and cuda.bindings afresh, nothing of pytest's state.
    pool = ProcessPoolExecutor(min(compile_jobs, len(cases)),
                               mp_context=multiprocessing.get_context("spawn"))
    futures = {case: pool.submit(_compile.compile_report, *case) for case in cases}

    def report(config, arch):
        future = futures.get((config, arch))
        return future.result() if future else _compile.compile_report(config, arch)

    try:
        yield report
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("config,arch", _cases(
    FWD_CASES, [f"sm{a}-{c.dtype}-d{c.head_dim}-f{c.features}" for c, a in FWD_CASES]))
def test_forward_kernel_compiles_without_spills(config, arch, compiled):
    report = _report(compiled, config, arch)
    if config.features == 0:
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


#: The mma.sync forward with V's own kernel head dim (d_v != d_qk): the pairs it takes, fp16 and
#: bf16 on every tested architecture, with dropout too; 192 / 128 and 128 / 64 plain fp16 on
#: sm_80 by default.
SPLIT_FWD_CASES = [
    (_configs.with_features(_dispatch.fwd_config(t, d, arch, d_v), f), arch)
    for arch in _configs.CPU_TEST_ARCHS for t in ("float16", "bfloat16")
    for d, d_v in ((192, 128), (128, 64), (96, 64), (128, 96), (256, 128))
    for f in (0, _configs.FEATURE_DROPOUT)]


@pytest.mark.parametrize("config,arch", [
    pytest.param(c, a, id=f"sm{a}-{c.dtype}-d{c.head_dim}v{c.head_dim_v}-f{c.features}",
                 marks=() if (a, c.dtype, c.features, c.head_dim) in {
                     (80, "float16", 0, 192), (80, "float16", 0, 128)} else pytest.mark.exhaustive)
    for c, a in SPLIT_FWD_CASES])
def test_split_head_dim_forward_compiles_without_spills(config, arch, compiled):
    """V's tile and O's accumulators of V's kernel head dim, Q's and K's of Q's: the checks of
    test_forward_kernel_compiles_without_spills."""
    assert config.head_dim_v < config.head_dim
    test_forward_kernel_compiles_without_spills(config, arch, compiled)


@pytest.mark.parametrize("config,arch", _cases(BWD_CASES, [_case_id(c, a) for c, a in BWD_CASES]))
def test_backward_kernel_compiles(config, arch, compiled):
    report = _report(compiled, config, arch)
    float32_spilling = (config.dtype in _configs.FLOAT32_TAGS
                        and (arch, config.head_dim) in FLOAT32_BWD_SPILLING)
    if config.features == 0 and not float32_spilling and (
            isinstance(config, _configs.BwdConfig) or (
            arch == BWD_SPILL_FREE_ARCH and config.head_dim <= BWD_SPILL_FREE_MAX_HEAD_DIM)):
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


#: The mma.sync backward with V's own kernel head dim (d_v != d_qk; split_bwd_configs): its main
#: kernel with dQ atomics and without (deterministic), and the deterministic dQ kernel, for the
#: pairs it takes, fp16 and bf16 on every tested architecture, plain and with dropout (the
#: feature the Hopper backward leaves to it on sm_90). 192 / 96 takes V's 128 (dV's chunk of 96
#: or 48 columns has no 16-column warp tiles). By default the main kernel with dQ atomics and the
#: dQ kernel of 192 / 128 fp16 on sm_80 and of 128 / 64 bf16 on sm_90.
SPLIT_BWD_CASES = list(dict.fromkeys(
    (_configs.with_features(c, f), arch)
    for arch in _configs.CPU_TEST_ARCHS for t in ("float16", "bfloat16")
    for d, d_v in ((192, 128), (128, 64), (96, 64), (256, 128), (192, 96))
    for deterministic in (False, True)
    for c in _dispatch.split_bwd_configs(t, d, d_v, arch, deterministic) or ()
    if c is not None and (deterministic or isinstance(c, _configs.BwdConfig))
    for f in (0, _configs.FEATURE_DROPOUT)))
SPLIT_BWD_SAMPLE = {(80, "float16", 192, 128), (90, "bfloat16", 128, 64)}


def _split_bwd_sampled(cfg, arch) -> bool:
    return (cfg.features == 0 and (arch, cfg.dtype, cfg.head_dim, cfg.head_dim_v)
            in SPLIT_BWD_SAMPLE and getattr(cfg, "compute_dq", True))


@pytest.mark.parametrize("config,arch", [
    pytest.param(c, a, id=_case_id(c, a).replace(f"-{c.head_dim}", f"-{c.head_dim}v"
                                                                    f"{c.head_dim_v}", 1),
                 marks=() if _split_bwd_sampled(c, a) else pytest.mark.exhaustive)
    for c, a in SPLIT_BWD_CASES])
def test_split_head_dim_backward_compiles(config, arch, compiled):
    """dO's and V's tiles, dP's k steps and dV's accumulators of V's kernel head dim, the rest
    of Q's: the checks of test_backward_kernel_compiles (the plain main kernels spill-free)."""
    assert config.head_dim_v < config.head_dim
    test_backward_kernel_compiles(config, arch, compiled)


@pytest.mark.parametrize("config,arch", _cases(AUX_CASES, [_case_id(c, a) for c, a in AUX_CASES]))
def test_backward_aux_kernel_compiles_without_spills(config, arch, compiled):
    report = _report(compiled, config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_every_head_dim_has_a_kernel(head_dim):
    for arch in _configs.CPU_TEST_ARCHS:
        for dtype in _configs.DTYPE_TAGS:
            cfg = _dispatch.fwd_config(dtype, head_dim, arch)
            assert cfg.head_dim >= head_dim and cfg.head_dim % 32 == 0
            assert cfg in _dispatch.all_fwd_configs(arch)
            for features in _configs.TESTED_FEATURES:
                assert _configs.with_features(cfg, features) in _dispatch.all_fwd_configs(
                    arch, _configs.TESTED_FEATURES)
            assert cfg.block_m % (16 * cfg.num_warps) == 0


@pytest.mark.parametrize("arch", _configs.CPU_TEST_ARCHS)
def test_backward_configs_have_a_warp_grid_for_every_phase(arch):
    for cfg in _dispatch.all_bwd_configs(arch):
        if not isinstance(cfg, _configs.BwdConfig):
            continue
        assert cfg.valid, cfg
        assert cfg.accumulator_registers <= _dispatch.BWD_MAX_ACCUMULATORS, cfg
        assert _configs.BWD_ROW_PADDING % cfg.block_m == 0, cfg
        warps = cfg.num_warps
        for rows, cols, warps_rows in ((cfg.block_m, cfg.block_n, cfg.sdp_warps_m),
                                       (cfg.block_n, cfg.d_chunk, cfg.kv_warps_n),
                                       (cfg.block_m, cfg.d_chunk, cfg.dq_warps_m)):
            assert warps % warps_rows == 0
            assert (rows // warps_rows) % 16 == 0 and (cols // (warps // warps_rows)) % 16 == 0


def test_backward_main_configs_on_sm90():
    """The shapes docs/PERF_NOTES.md reports as measured best on the H200."""
    d64 = _dispatch.bwd_config("float16", 64, 90)
    assert (d64.block_m, d64.block_n, d64.num_warps, d64.q_stages) == (128, 128, 8, 2)
    assert (d64.sdp_warps_m, d64.kv_warps_n, d64.dq_warps_m) == (2, 4, 4)
    d128 = _dispatch.bwd_config("bfloat16", 128, 90)
    assert (d128.block_m, d128.block_n, d128.num_warps, d128.q_stages) == (64, 128, 8, 2)
    assert (d128.sdp_warps_m, d128.kv_warps_n, d128.dq_warps_m) == (2, 4, 2)


@pytest.mark.parametrize("config,arch", _cases(
    AUX_CASES_EXTRA, [f"sm{a}-dropout-mask" for _, a in AUX_CASES_EXTRA]))
def test_dropout_mask_kernel_compiles(config, arch, compiled):
    report = compiled(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert not report.odd_descriptors, report.odd_descriptors


@pytest.mark.parametrize("config,arch", _cases(
    MERGE_CASES, [f"sm{a}-merge-{c.dtype}-lanes{c.lanes}" for c, a in MERGE_CASES]))
def test_merge_states_kernel_compiles_without_spills(config, arch, compiled):
    report = compiled(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.stack_bytes == 0 and report.registers <= 64, report.log
    assert not report.odd_descriptors, report.odd_descriptors


@pytest.mark.parametrize("config,arch", _cases(
    DECODE_CASES, [f"sm{a}-{c.name_expression}" for c, a in DECODE_CASES]))
def test_decode_kernel_compiles(config, arch, compiled):
    if hasattr(config, "head_dim"):
        report = _report(compiled, config, arch)  # (its checks include the SASS's)
    else:
        report = compiled(config, arch)
        assert not report.odd_descriptors, report.odd_descriptors
    if arch == BWD_SPILL_FREE_ARCH:
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


@pytest.mark.parametrize("config,arch", _cases(
    ROTARY_DECODE_CASES, [f"sm{a}-{c.name_expression}" for c, a in ROTARY_DECODE_CASES]))
def test_rotary_leftpad_decode_kernel_compiles(config, arch, compiled):
    """Rotary and cache_leftpad spill nothing on sm_80 and sm_90 (elsewhere the plain decode
    kernels' bound)."""
    report = _report(compiled, config, arch)
    if arch in (80, 90):
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


def test_rotary_decode_cases_cover_the_cache_features():
    assert {cfg.features & _CACHE_FEATURES for cfg, _ in ROTARY_DECODE_CASES} == {
        _CACHE_FEATURES}
    assert {cfg.kv_cache_dtype for cfg, _ in ROTARY_DECODE_CASES} == {None, "e4m3"}
    sample = {(arch, cfg.block_m) for cfg, arch in ROTARY_DECODE_CASES if _sampled(cfg, arch)}
    assert sample == {(80, _configs.DECODE_BLOCK_M), (90, _configs.DECODE_BLOCK_M_N8)}
    assert set(_configs.DECODE_FEATURES) == set(_configs.DECODE_MOD_FEATURES) | {
        c | f for c in _configs.DECODE_CACHE_FEATURES for f in _configs.DECODE_MOD_FEATURES}


def test_sample_covers_every_family_feature_architecture_and_main_head_dim():
    """The default sample keeps what the brief of the CPU suite asks for (tests/conftest.py)."""
    sample = [c for c in FWD_CASES + BWD_CASES + DECODE_CASES if _sampled(*c)]
    families = {(type(cfg), getattr(cfg, "compute_dq", None)): cfg
                for cfg, _ in FWD_CASES + BWD_CASES + DECODE_CASES}
    for family, example in families.items():
        cases = [(cfg, arch) for cfg, arch in sample
                 if (type(cfg), getattr(cfg, "compute_dq", None)) == family]
        assert {cfg.features for cfg, _ in cases} == set(_tested_features(example)), family
        plain = [(cfg, arch) for cfg, arch in cases
                 if cfg.features == 0 and cfg.dtype in _configs.DTYPE_TAGS]
        assert {cfg.head_dim for cfg, _ in plain} == set(_configs.KERNEL_HEAD_DIMS), family
        for d in (64, 128):
            points = {(arch, cfg.dtype) for cfg, arch in plain if cfg.head_dim == d}
            assert points == MAIN_POINTS, family
            assert {arch for arch, _ in points} == set(_configs.CPU_TEST_ARCHS)
            assert {dtype for _, dtype in points} == set(_configs.DTYPE_TAGS)
        assert {arch for cfg, arch in plain if cfg.head_dim == 256} == set(_configs.CPU_TEST_ARCHS)
    # Float32 inputs' forward and backward: both precisions, on sm_80 and sm_90, with every
    # feature.
    for family, cases in (("forward", FWD_CASES), ("backward", BWD_CASES)):
        float32 = [(cfg, arch) for cfg, arch in cases
                   if cfg.dtype in _configs.FLOAT32_TAGS and _sampled(cfg, arch)]
        assert {cfg.dtype for cfg, _ in float32} == set(_configs.FLOAT32_TAGS), family
        assert {arch for _, arch in float32} >= {80, 90}, family
        assert max(_tested_features(float32[0][0])) in {cfg.features for cfg, _ in float32}
    for cases in (AUX_CASES, AUX_CASES_EXTRA):
        assert {(cfg, arch) for cfg, arch in cases if _sampled(cfg, arch)} == {
            (cfg, arch) for cfg, arch in cases if arch in AUX_SAMPLE_ARCHS}


def test_sinks_are_compiled_into_the_forward_kernels_only():
    """Sinks (FEATURE_SINKS) are a feature of the forward and decode kernels: alone and with
    every other feature in the default sample, every combination under --exhaustive; the
    backward's main kernels are those of the call without sinks (the sinks' gradient is an
    AuxKernel of its own, compiled for every case)."""
    sinks = _configs.FEATURE_SINKS
    assert sinks in _configs.TESTED_FEATURES and 31 in _configs.TESTED_FEATURES
    assert {sinks, 19} <= set(_configs.TESTED_DECODE_FEATURES)
    assert not any(cfg.features & sinks for cfg, _ in BWD_CASES)
    assert {cfg.features for cfg, arch in FWD_CASES if arch == 90 and cfg.head_dim == 128} == set(
        _configs.ALL_FEATURES)
    assert {cfg.features for cfg, _ in DECODE_CASES} == set(_configs.DECODE_MOD_FEATURES)
    assert len(DECODE_CASES) == 2 * len([c for c in DECODE_CASES if not c[0].features & sinks])
    assert {c.kernel for c in _configs.aux_kernels()} >= {"flash_bwd_sinks_kernel"}
    assert len(set(BWD_CASES)) == len(BWD_CASES) and len(set(FWD_CASES)) == len(FWD_CASES)


def test_sources_inline_their_headers():
    for name in ("flash_bwd.cu", "flash_bwd_dq.cu", "flash_bwd_preprocess.cu",
                 "flash_bwd_convert_dq.cu"):
        assert '#include "' not in _compile.kernel_source(name)
    source = _compile.kernel_source("flash_fwd.cu")
    assert '#include "' not in source
    for marker in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg.shared.global",
                   "ex2.approx", "struct OnlineSoftmax", "struct KeyVisibility"):
        assert marker in source


def test_sass_checks_have_nvdisasm():
    """The compile tests read each kernel's SASS for memory descriptors in odd uniform registers
    (cuflash2/_sass.py), which needs nvdisasm: the test extra installs it."""
    if _sass.nvdisasm() is None:
        pytest.skip("no nvdisasm (pip install '.[test]'): the compile tests skip their SASS checks")


def test_odd_descriptor_check_finds_the_faulting_copy():
    """The instruction compute-sanitizer faulted on (a decode kernel, NVRTC 13.0, sm_90a), between
    two that are fine, as nvdisasm -c prints them."""
    sass = """
        /*5950*/                   @!PT LDS RZ, [RZ] ;
        /*5960*/                   LDGSTS.E.BYPASS.128 [R87+UR4], desc[UR5][R72.64], !P1 ;
        /*5970*/                   LDG.E.128.STRONG.GPU R72, desc[UR12][R72.64] ;
        /*5980*/                   STG.E.128 desc[UR10][R84.64], R72 ;
    """
    assert _sass.odd_descriptor_instructions(sass) == [
        "LDGSTS.E.BYPASS.128 [R87+UR4], desc[UR5][R72.64], !P1 ;"]


@pytest.mark.parametrize("arch", _configs.CPU_TEST_ARCHS)
def test_benchmark_spin_kernel_compiles(arch, nvrtc_available):
    """The benchmarks' backlog kernel (cuda_src/gpu_spin.cu, cuflash2/bench/timing.py)."""
    spin = types.SimpleNamespace(source_file="gpu_spin.cu", name_expression="gpu_spin_kernel")
    report = _compile.compile_report(spin, arch)
    assert report.spill_stores == 0 and report.registers <= 32, report.log
    assert not report.odd_descriptors, report.odd_descriptors
