"""NVRTC compilation of every kernel specialisation the dispatcher can choose (CPU, no GPU).

Drives NVRTC directly (cuda.bindings.nvrtc) for sm_80 and sm_90 and reads ptxas's resource report:
the kernels must compile, fit the register file, and not spill.
"""

import types

import pytest

from cuflash2 import _compile, _configs

# Shared memory a block may use (opt-in limit): sm_80 163 KiB, sm_86/89 99 KiB, sm_90 227 KiB.
MAX_SMEM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

# Every specialisation, plain and with the feature combinations of TESTED_FEATURES (each feature
# alone and all together); on sm_90, every combination at head dims 64 and 128.
def _all_combinations_sm90(configs):
    return [(cfg, 90) for cfg in configs if cfg.head_dim in (64, 128)
            and cfg.features not in _configs.TESTED_FEATURES]


FWD_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
             for cfg in _configs.all_fwd_configs(arch, _configs.TESTED_FEATURES)]
FWD_CASES += _all_combinations_sm90(_configs.all_fwd_configs(90, _configs.ALL_FEATURES))
BWD_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
             for cfg in dict.fromkeys(_configs.all_bwd_configs(arch, _configs.TESTED_FEATURES))]
BWD_CASES += _all_combinations_sm90(
    dict.fromkeys(_configs.all_bwd_configs(90, _configs.ALL_FEATURES)))
AUX_CASES_EXTRA = [(_configs.DropoutMaskKernel(), arch) for arch in _configs.CPU_TEST_ARCHS]
DECODE_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
                for cfg in _configs.all_decode_configs(arch, _configs.SCORE_MOD_FEATURES)]
AUX_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS for cfg in _configs.aux_kernels()]

#: Every plain forward and backward main kernel must be spill-free. The deterministic dQ kernel
#: (flash_bwd_dq.cu, 16 rows a warp with a whole dQ row block in registers) must be spill-free on
#: sm_90 (the GPU it is measured on) up to head dim 192. Elsewhere, and in the softcap / ALiBi
#: specialisations (a few more live values per score), a few spilled words are reported and
#: bounded here.
BWD_SPILL_FREE_ARCH = 90
BWD_SPILL_FREE_MAX_HEAD_DIM = 192
BWD_SPILL_LIMIT = 128  # bytes


def _case_id(cfg, arch):
    kind = type(cfg).__name__
    detail = getattr(cfg, "head_dim", getattr(cfg, "kernel", ""))
    extra = "" if getattr(cfg, "compute_dq", True) else "-nodq"
    extra += f"-f{cfg.features}" if getattr(cfg, "features", 0) else ""
    return f"sm{arch}-{kind}-{cfg.dtype}-{detail}{extra}"


def _report(cfg, arch):
    report = _compile.compile_report(cfg, arch)
    print(f"sm_{arch} {cfg.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, "
          f"{report.stack_bytes} bytes stack, {cfg.smem_bytes} bytes smem")
    assert report.registers <= 255
    assert report.cubin_bytes > 0
    assert cfg.smem_bytes <= MAX_SMEM[arch]
    return report


@pytest.fixture(scope="module")
def nvrtc_available():
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")


@pytest.mark.parametrize("config,arch", FWD_CASES,
                         ids=[f"sm{a}-{c.dtype}-d{c.head_dim}-f{c.features}" for c, a in FWD_CASES])
def test_forward_kernel_compiles_without_spills(config, arch, nvrtc_available):
    report = _report(config, arch)
    if config.features == 0:
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


@pytest.mark.parametrize("config,arch", BWD_CASES, ids=[_case_id(c, a) for c, a in BWD_CASES])
def test_backward_kernel_compiles(config, arch, nvrtc_available):
    report = _report(config, arch)
    if config.features == 0 and (isinstance(config, _configs.BwdConfig) or (
            arch == BWD_SPILL_FREE_ARCH and config.head_dim <= BWD_SPILL_FREE_MAX_HEAD_DIM)):
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


@pytest.mark.parametrize("config,arch", AUX_CASES, ids=[_case_id(c, a) for c, a in AUX_CASES])
def test_backward_aux_kernel_compiles_without_spills(config, arch, nvrtc_available):
    report = _report(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_every_head_dim_has_a_kernel(head_dim):
    for arch in _configs.CPU_TEST_ARCHS:
        for dtype in _configs.DTYPE_TAGS:
            cfg = _configs.fwd_config(dtype, head_dim, arch)
            assert cfg.head_dim >= head_dim and cfg.head_dim % 32 == 0
            assert cfg in _configs.all_fwd_configs(arch)
            for features in _configs.TESTED_FEATURES:
                assert _configs.with_features(cfg, features) in _configs.all_fwd_configs(
                    arch, _configs.TESTED_FEATURES)
            assert cfg.block_m % (16 * cfg.num_warps) == 0


@pytest.mark.parametrize("arch", _configs.CPU_TEST_ARCHS)
def test_backward_configs_have_a_warp_grid_for_every_phase(arch):
    for cfg in _configs.all_bwd_configs(arch):
        if not isinstance(cfg, _configs.BwdConfig):
            continue
        assert cfg.valid, cfg
        assert cfg.accumulator_registers <= _configs.BWD_MAX_ACCUMULATORS, cfg
        assert _configs.BWD_ROW_PADDING % cfg.block_m == 0, cfg
        warps = cfg.num_warps
        for rows, cols, warps_rows in ((cfg.block_m, cfg.block_n, cfg.sdp_warps_m),
                                       (cfg.block_n, cfg.d_chunk, cfg.kv_warps_n),
                                       (cfg.block_m, cfg.d_chunk, cfg.dq_warps_m)):
            assert warps % warps_rows == 0
            assert (rows // warps_rows) % 16 == 0 and (cols // (warps // warps_rows)) % 16 == 0


def test_backward_main_configs_on_sm90():
    """The shapes docs/PERF_NOTES.md reports as measured best on the H200."""
    d64 = _configs.bwd_config("float16", 64, 90)
    assert (d64.block_m, d64.block_n, d64.num_warps, d64.q_stages) == (128, 128, 8, 2)
    assert (d64.sdp_warps_m, d64.kv_warps_n, d64.dq_warps_m) == (2, 4, 4)
    d128 = _configs.bwd_config("bfloat16", 128, 90)
    assert (d128.block_m, d128.block_n, d128.num_warps, d128.q_stages) == (64, 128, 8, 2)
    assert (d128.sdp_warps_m, d128.kv_warps_n, d128.dq_warps_m) == (2, 4, 2)


@pytest.mark.parametrize("config,arch", AUX_CASES_EXTRA, ids=[f"sm{a}-dropout-mask" for _, a in AUX_CASES_EXTRA])
def test_dropout_mask_kernel_compiles(config, arch, nvrtc_available):
    report = _compile.compile_report(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


@pytest.mark.parametrize("config,arch", DECODE_CASES,
                         ids=[f"sm{a}-{c.name_expression}" for c, a in DECODE_CASES])
def test_decode_kernel_compiles(config, arch, nvrtc_available):
    report = _report(config, arch) if hasattr(config, "head_dim") else _compile.compile_report(
        config, arch)
    if arch == BWD_SPILL_FREE_ARCH:
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    else:
        assert report.spill_stores <= BWD_SPILL_LIMIT, report.log


def test_sources_inline_their_headers():
    for name in ("flash_bwd.cu", "flash_bwd_dq.cu", "flash_bwd_preprocess.cu",
                 "flash_bwd_convert_dq.cu"):
        assert '#include "' not in _compile.kernel_source(name)
    source = _compile.kernel_source("flash_fwd.cu")
    assert '#include "' not in source
    for marker in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg.shared.global",
                   "ex2.approx", "struct OnlineSoftmax", "struct KeyVisibility"):
        assert marker in source


@pytest.mark.parametrize("arch", _configs.CPU_TEST_ARCHS)
def test_benchmark_spin_kernel_compiles(arch, nvrtc_available):
    """bench.py's backlog kernel (cuda_src/gpu_spin.cu)."""
    spin = types.SimpleNamespace(source_file="gpu_spin.cu", name_expression="gpu_spin_kernel")
    report = _compile.compile_report(spin, arch)
    assert report.spill_stores == 0 and report.registers <= 32, report.log
