"""NVRTC compilation of every kernel specialisation the dispatcher can choose (CPU, no GPU).

Drives NVRTC directly (cuda.bindings.nvrtc) for sm_80 and sm_90 and reads ptxas's resource report:
the kernels must compile, fit the register file, and not spill.
"""

import pytest

from cuflash2 import _compile, _configs

# Shared memory a block may use (opt-in limit): sm_80 163 KiB, sm_86/89 99 KiB, sm_90 227 KiB.
MAX_SMEM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

FWD_CASES = [(cfg, arch) for arch in _configs.CPU_TEST_ARCHS
             for cfg in _configs.all_fwd_configs(arch)]


@pytest.fixture(scope="module")
def nvrtc_available():
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")


@pytest.mark.parametrize("config,arch", FWD_CASES,
                         ids=[f"sm{a}-{c.dtype}-d{c.head_dim}" for c, a in FWD_CASES])
def test_forward_kernel_compiles_without_spills(config, arch, nvrtc_available):
    report = _compile.compile_report(config, arch)
    print(f"sm_{arch} {config.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, "
          f"{report.stack_bytes} bytes stack, {config.smem_bytes} bytes smem")
    assert report.registers <= 255
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.cubin_bytes > 0
    assert config.smem_bytes <= MAX_SMEM[arch]


@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_every_head_dim_has_a_kernel(head_dim):
    for arch in _configs.CPU_TEST_ARCHS:
        for dtype in _configs.DTYPE_TAGS:
            cfg = _configs.fwd_config(dtype, head_dim, arch)
            assert cfg.head_dim >= head_dim and cfg.head_dim % 32 == 0
            assert cfg in _configs.all_fwd_configs(arch)
            assert cfg.block_m % (16 * cfg.num_warps) == 0


def test_sources_inline_their_headers():
    source = _compile.kernel_source("flash_fwd.cu")
    assert '#include "' not in source
    for marker in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg.shared.global",
                   "ex2.approx", "struct OnlineSoftmax", "struct KeyVisibility"):
        assert marker in source
