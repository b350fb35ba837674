"""NVRTC compilation of the Hopper forward (cuda_src/flash_fwd_sm90.cu) for sm_90a (CPU, no GPU).

Every FwdSm90Config (the persistent-grid ones included) is compiled with ptxas's resource
report. The kernel relies on two things
ptxas can silently take away: the setmaxnreg register split (ptxas ignores it, printing C7508 as
an *info* line, unless it knows the register count at entry) and spill-free consumers. So: it
compiles, uses no more registers at entry than 384 threads may have, spills nothing, and the log
has no C7508.
"""

import re

import pytest

from cuflash2 import _compile, _configs

CONFIGS = _configs.all_fwd_sm90_configs(_configs.SM90_FWD_FEATURES, persistent=True)
MAX_SMEM_SM90 = 227 * 1024


@pytest.fixture(scope="module")
def nvrtc_available():
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")


def _entry_registers(config) -> int:
    """What ptxas may give a thread at entry: the register file over the CTA's threads, in
    multiples of 8; setmaxnreg moves registers between warpgroups from there."""
    return 65536 // config.threads // 8 * 8


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: (
    f"{c.dtype}-d{c.head_dim}-f{c.features}{'-pingpong' if c.pingpong else ''}"
    f"{'-persistent' if c.persistent else ''}"))
def test_hopper_forward_compiles_without_spills(config, nvrtc_available):
    report = _compile.compile_report(config, 90)
    print(f"sm_90a {config.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, "
          f"{report.stack_bytes} bytes stack, {config.smem_bytes} bytes smem")
    assert report.cubin_bytes > 0
    assert report.registers <= _entry_registers(config), report.log
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert "C7508" not in report.log, report.log  # setmaxnreg honoured
    assert config.smem_bytes <= MAX_SMEM_SM90


def test_setmaxnreg_check_detects_c7508(nvrtc_available):
    """The control: without __launch_bounds__ ptxas ignores setmaxnreg and says so with C7508,
    so the assertion above can fail."""
    config = _configs.fwd_sm90_config("bfloat16", 64)
    source = _compile.specialisation_source(config)
    stripped, n = re.subn(r"__launch_bounds__\(\s*FwdSm90Traits<[^>]*>::THREADS, 1\)", "", source)
    assert n == 1
    from cuda.bindings import nvrtc

    _, prog = nvrtc.nvrtcCreateProgram(stripped.encode(), b"flash_fwd_sm90.cu", 0, [], [])
    try:
        nvrtc.nvrtcAddNameExpression(prog, config.name_expression.encode())
        options = [b"-std=c++17", b"-arch=sm_90a", b"--ptxas-options=-v"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        log = _compile._nvrtc_log(prog, nvrtc)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    assert int(err) == 0, log
    assert "C7508" in log


def test_hopper_configs_target_sm90a_only():
    config = _configs.fwd_sm90_config("float16", 128)
    assert _compile.target_arch(config, 90) == "90a"
    assert _compile.arch_options(config) == ("-arch=sm_90a",)
    with pytest.raises(ValueError, match="sm_90a only"):
        _compile.target_arch(config, 80)
    plain = _configs.fwd_config("float16", 128, 90)
    assert _compile.target_arch(plain, 90) == "90" and _compile.arch_options(plain) == ()


#: The tile (block_n, stages) each head dim is expected to get (docs/HOPPER_FWD.md), and that of
#: the persistent grid (its O buffer must fit: d=96 drops to 2 stages, d=192/256 have none).
EXPECTED_TILES = {64: (128, 2), 96: (128, 3), 128: (128, 2), 192: (112, 2), 256: (80, 2)}
EXPECTED_PERSISTENT_TILES = {64: (128, 2), 96: (128, 2), 128: (128, 2)}


def test_hopper_config_shapes():
    assert _configs.SM90_FWD_HEAD_DIMS == tuple(EXPECTED_TILES)
    assert _configs.SM90_PERSISTENT_TILES == EXPECTED_PERSISTENT_TILES
    for config in CONFIGS:
        assert config.threads == 384 and config.block_m == 128
        tiles = EXPECTED_PERSISTENT_TILES if config.persistent else EXPECTED_TILES
        assert (config.block_n, config.stages) == tiles[config.head_dim]
        # whole 1024-byte swizzle atoms per K/V panel (the V descriptor's LBO is one panel)
        assert config.block_n % 16 == 0 and config.block_n * 128 % 1024 == 0
        assert config.features & (_configs.FEATURE_VARLEN | _configs.FEATURE_DROPOUT) == 0
    assert {(c.head_dim, c.dtype, c.features, c.pingpong, c.persistent) for c in CONFIGS} == {
        (d, t, f, pp, grid) for grid, tiles in ((False, EXPECTED_TILES),
                                                (True, EXPECTED_PERSISTENT_TILES))
        for d in tiles for t in _configs.DTYPE_TAGS
        for f in _configs.SM90_FWD_FEATURES for pp in (False, True)}
    assert not _configs.fwd_sm90_config("float16", 64).pingpong  # off until measured
    assert not _configs.fwd_sm90_config("float16", 64).persistent  # opt-in
    assert not any(c.persistent for c in _configs.all_fwd_sm90_configs())
    for bad in (80, 160, 512):
        with pytest.raises(ValueError):
            _configs.fwd_sm90_config("float16", bad)


def test_hopper_smem_counts_whole_panels():
    """A head dim of 96 takes two 64-column panels (the TMA zero-fills the second half), so its
    shared memory is that of 128 columns; the kernel's SMEM_BYTES probe checks the same."""
    d96 = _configs.fwd_sm90_config("bfloat16", 96)
    assert d96.panels == 2
    assert d96.smem_bytes == 128 * 2 * (128 + 2 * 3 * 128) + 1024
    assert _configs.fwd_sm90_config("bfloat16", 256).smem_bytes == 128 * 4 * (128 + 4 * 80) + 1024
    for config in CONFIGS:
        assert config.smem_bytes <= MAX_SMEM_SM90


def test_persistent_configs_add_an_o_buffer_where_it_fits():
    """The persistent grid stages O in a buffer of Q's size (FwdSm90Traits::O_BYTES): head dims
    64 and 128 keep their tiles, 96 drops to 2 stages, 192 and 256 do not fit and are refused."""
    for d, (block_n, stages) in EXPECTED_PERSISTENT_TILES.items():
        config = _configs.fwd_sm90_config("float16", d, persistent=True)
        panels = -(-d // 64)
        assert config.smem_bytes == 128 * panels * (2 * 128 + 2 * stages * block_n) + 1024
        assert config.smem_bytes <= MAX_SMEM_SM90
        assert config.name_expression.endswith(", true>")
        assert "true>::SMEM_BYTES" in config.probes
    assert _configs.fwd_sm90_config("float16", 64, persistent=True).smem_bytes == 99_328
    assert _configs.fwd_sm90_config("float16", 128, persistent=True).smem_bytes == 197_632
    for d in (192, 256):
        with pytest.raises(ValueError, match="persistent"):
            _configs.fwd_sm90_config("bfloat16", d, persistent=True)
    with pytest.raises(ValueError, match="shared memory"):  # d=96 with its usual 3 stages
        _configs.FwdSm90Config("float16", 96, block_n=128, stages=3, persistent=True)
    assert "persistent grid" in _configs.describe(
        _configs.fwd_sm90_config("float16", 128, persistent=True))


def test_persistent_is_the_last_template_argument():
    config = _configs.fwd_sm90_config("bfloat16", 128)
    assert config.name_expression == (
        "flash_fwd_sm90_kernel<bf16_tag, 128, 128, 128, 2, false, 0, false>")


def test_hopper_source_uses_the_hopper_instructions():
    source = _compile.kernel_source("flash_fwd_sm90.cu")
    assert '#include "' not in source
    for marker in ("wgmma.mma_async.sync.aligned.", "wgmma.fence.sync.aligned",
                   "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes",
                   "mbarrier.try_wait.parity.shared::cta.b64", "setmaxnreg.inc.sync.aligned.u32",
                   "struct OnlineSoftmax", "struct KeyVisibility", "struct FwdSm90Params"):
        assert marker in source
