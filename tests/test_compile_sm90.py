"""NVRTC compilation of the Hopper forward (cuda_src/flash_fwd_sm90.cu) for sm_90a (CPU, no GPU).

Every FwdSm90Config is compiled with ptxas's resource report. The kernel relies on two things
ptxas can silently take away: the setmaxnreg register split (ptxas ignores it, printing C7508 as
an *info* line, unless it knows the register count at entry) and spill-free consumers. So: it
compiles, uses no more registers at entry than 384 threads may have, spills nothing, and the log
has no C7508 and no word that ptxas serialised the wgmmas (which it does where it cannot
prove that registers of an in-flight wgmma are left alone, the overlapping schedule's
wait_group 1 window: a warning; or where the wgmma pipeline lacks registers, C7511: an info
line). The cross product: both schedules, with and without the overlap inside a
warpgroup, on the one-tile-per-CTA grid (every head dim) and the persistent grid (head dims 64,
96, 128; its tiles taken statically or claimed one by one), every dtype and score-modifier set:
352 compiles under --exhaustive. The default run compiles a sample (the dispatcher's choices at
every head dim, every flag combination and every dtype and score-modifier set at
SAMPLE_HEAD_DIM), the compiles of the selected tests spread over a process pool
(--compile-jobs, as tests/test_compile.py). With sinks (FEATURE_SINKS), the dispatcher's choices
only (dense and varlen, every dtype and score-modifier set: 144 under --exhaustive, 8 by
default).
"""

import dataclasses
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuflash2 import _compile, _configs, _dispatch

CONFIGS = _dispatch.all_fwd_sm90_configs(_configs.SCORE_MOD_FEATURES, persistent=True)
MAX_SMEM_SM90 = 227 * 1024

#: The default sample: the dispatcher's choices (_dispatch.hopper_forward_configs: each head dim's
#: schedule, on both grids where it has the persistent one) at every head dim for these (dtype,
#: features) pairs, plain fp16 and bf16 with both score modifiers, and at SAMPLE_HEAD_DIM for
#: every dtype and score-modifier set; and every flag combination (schedule, overlap, grid) at
#: SAMPLE_HEAD_DIM, plain fp16. The rest runs under --exhaustive.
SAMPLE_PAIRS = {("float16", 0), ("bfloat16", _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI)}
SAMPLE_HEAD_DIM = 128
DISPATCHED = set(_dispatch.hopper_forward_configs(_configs.SCORE_MOD_FEATURES))
#: Three consumer warpgroups (block_m 192): the dispatched ones are all there are (d=64, the
#: in-order schedule, both grids, the persistent one with and without claims, every dtype and
#: score-modifier set: 24), the SAMPLE_PAIRS ones (6) by default.
THREE_CONSUMER_CONFIGS = sorted((c for c in DISPATCHED if c.block_m == 192), key=repr)


#: V's own head dim (SM90_FWD_HEAD_DIM_PAIRS): the dispatcher's specialisations (every
#: schedule and grid it takes for the pair, every dtype and feature set, dense and varlen: 64),
#: plain fp16 dense by default (4).
SPLIT_CONFIGS = sorted((c for c in _dispatch.hopper_forward_configs(
    _configs.SCORE_MOD_FEATURES + _configs.SM90_FWD_VARLEN_FEATURES)
    if c.head_dim_v != c.head_dim), key=repr)


def _sampled(config) -> bool:
    if config.head_dim_v != config.head_dim:
        return (config.dtype, config.features) == ("float16", 0)
    if config in DISPATCHED:
        return ((config.dtype, config.features) in SAMPLE_PAIRS
                or config.head_dim == SAMPLE_HEAD_DIM)
    return (config.dtype, config.features, config.head_dim) == ("float16", 0, SAMPLE_HEAD_DIM)


def _config_id(c) -> str:
    dims = f"d{c.head_dim}" + (f"v{c.head_dim_v}" if c.head_dim_v != c.head_dim else "")
    return (f"{c.dtype}-{dims}-f{c.features}{'-pingpong' if c.pingpong else ''}"
            f"{'-overlap' if c.overlap else ''}{'-persistent' if c.persistent else ''}"
            f"{'-claims' if c.claims else ''}")


#: The varlen specialisations (one-tile-per-CTA grid: both schedules, with and without the
#: overlap, every head dim, dtype and score-modifier set): 160 under --exhaustive; the default run
#: compiles the dispatcher's choice at every head dim for bf16 with both score modifiers, and for
#: fp16 plain varlen at SAMPLE_HEAD_DIM (6).
VARLEN_SCORE_MOD_FEATURES = tuple(_configs.FEATURE_VARLEN | f
                                  for f in _configs.SCORE_MOD_FEATURES)
VARLEN_CONFIGS = _dispatch.all_fwd_sm90_configs(VARLEN_SCORE_MOD_FEATURES)
VARLEN_SAMPLE_FEATURES = _configs.FEATURE_VARLEN | _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI
VARLEN_DISPATCHED = set(_dispatch.hopper_forward_configs(VARLEN_SCORE_MOD_FEATURES))

#: Sinks (FEATURE_SINKS: the Hopper forward's feature sets of SM90_FWD_FEATURES and
#: SM90_FWD_VARLEN_FEATURES beyond the score modifiers): the dispatcher's choices only (each head
#: dim's schedule on its grids, three consumers at d=64, varlen), every dtype and score-modifier
#: set under --exhaustive (144, and 48 with V's own head dim); by default those at SAMPLE_HEAD_DIM for sinks alone in fp16 and
#: with both score modifiers in bf16, dense and varlen (8).
SINKS_FEATURES = tuple(f for f in _configs.SM90_FWD_FEATURES + _configs.SM90_FWD_VARLEN_FEATURES
                       if f & _configs.FEATURE_SINKS)
SINKS_CONFIGS = _dispatch.hopper_forward_configs(SINKS_FEATURES)
SINKS_SAMPLE_PAIRS = {("float16", _configs.FEATURE_SINKS),
                      ("bfloat16", _configs.FEATURE_SINKS | _configs.FEATURE_SOFTCAP
                       | _configs.FEATURE_ALIBI)}


def _sinks_sampled(config) -> bool:
    return config.head_dim == config.head_dim_v == SAMPLE_HEAD_DIM and (
        config.dtype, config.features & ~_configs.FEATURE_VARLEN) in SINKS_SAMPLE_PAIRS


def _varlen_sampled(config) -> bool:
    return config in VARLEN_DISPATCHED and (
        (config.dtype, config.features) == ("bfloat16", VARLEN_SAMPLE_FEATURES)
        or (config.dtype, config.features, config.head_dim)
        == ("float16", _configs.FEATURE_VARLEN, SAMPLE_HEAD_DIM))


@pytest.fixture(scope="module")
def nvrtc_available():
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")


@pytest.fixture(scope="module")
def reports(nvrtc_available, compile_jobs, request):
    """reports(config) -> ptxas's report; the configs of every selected test of
    test_hopper_forward_compiles_without_spills are submitted at once."""
    if compile_jobs <= 1:
        yield lambda config: _compile.compile_report(config, 90)
        return
    selected = [item.callspec.params["config"] for item in request.session.items
                if item.originalname in ("test_hopper_forward_compiles_without_spills",
                                         "test_hopper_varlen_forward_compiles_without_spills",
                                         "test_hopper_three_consumer_forward_compiles_without_spills",
                                         "test_hopper_sinks_forward_compiles_without_spills",
                                         "test_hopper_split_forward_compiles_without_spills",
                                         "test_keys_last_v_hopper_forward_compiles_without_spills")
                and hasattr(item, "callspec")]
    pool = ProcessPoolExecutor(compile_jobs, mp_context=multiprocessing.get_context("spawn"))
    futures = {config: pool.submit(_compile.compile_report, config, 90)
               for config in dict.fromkeys(selected)}

    def report(config):
        if config not in futures:
            futures[config] = pool.submit(_compile.compile_report, config, 90)
        return futures[config].result()

    try:
        yield report
    finally:
        pool.shutdown(cancel_futures=True)


def _entry_registers(config) -> int:
    """What ptxas may give a thread at entry: the register file over the CTA's threads, in
    multiples of 8; setmaxnreg moves registers between warpgroups from there."""
    return 65536 // config.threads // 8 * 8


@pytest.mark.parametrize("config", [
    pytest.param(c, id=_config_id(c), marks=() if _sampled(c) else pytest.mark.exhaustive)
    for c in CONFIGS])
def test_hopper_forward_compiles_without_spills(config, reports):
    report = reports(config)
    print(f"sm_90a {config.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, "
          f"{report.stack_bytes} bytes stack, {config.smem_bytes} bytes smem")
    assert report.cubin_bytes > 0
    assert report.registers <= _entry_registers(config), report.log
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert "C7508" not in report.log, report.log  # setmaxnreg honoured
    assert not report.odd_descriptors, report.odd_descriptors  # (cuflash2/_sass.py)
    assert "ptxas warning" not in report.log, report.log  # e.g. wgmma serialised (C7515 ...)
    assert "are serialized" not in report.log, report.log  # C7511 etc., "ptxas info" lines
    assert config.smem_bytes <= MAX_SMEM_SM90


@pytest.mark.parametrize("config", [
    pytest.param(c, id=_config_id(c) + "-three-consumers",
                 marks=() if (c.dtype, c.features) in SAMPLE_PAIRS else pytest.mark.exhaustive)
    for c in THREE_CONSUMER_CONFIGS])
def test_hopper_three_consumer_forward_compiles_without_spills(config, reports):
    """512 threads (128 registers at entry), the consumers at 160 after setmaxnreg: the same
    checks as every other specialisation."""
    assert config.threads == 512 and _entry_registers(config) == 128
    test_hopper_forward_compiles_without_spills(config, reports)


@pytest.mark.parametrize("config", [
    pytest.param(c, id=_config_id(c), marks=() if _sampled(c) else pytest.mark.exhaustive)
    for c in SPLIT_CONFIGS])
def test_hopper_split_forward_compiles_without_spills(config, reports):
    """V's own head dim (O, P V's N and V's tiles of head_dim_v): the same checks."""
    assert config.head_dim_v < config.head_dim
    test_hopper_forward_compiles_without_spills(config, reports)


@pytest.mark.parametrize("config", [
    pytest.param(c, id=_config_id(c), marks=() if _varlen_sampled(c) else pytest.mark.exhaustive)
    for c in VARLEN_CONFIGS])
def test_hopper_varlen_forward_compiles_without_spills(config, reports):
    """FEATURE_VARLEN (packed sequences): the same checks as every other specialisation."""
    test_hopper_forward_compiles_without_spills(config, reports)


@pytest.mark.parametrize("config", [
    pytest.param(c, id=_config_id(c) + ("-three-consumers" if c.block_m == 192 else ""),
                 marks=() if _sinks_sampled(c) else pytest.mark.exhaustive)
    for c in SINKS_CONFIGS])
def test_hopper_sinks_forward_compiles_without_spills(config, reports):
    """FEATURE_SINKS (the sink's logit in every row's softmax denominator): the same checks."""
    test_hopper_forward_compiles_without_spills(config, reports)


#: The float32 Hopper forwards (precision "tf32", _dispatch.TF32_SM90_FWD_TILES; "highest",
#: 3xTF32, F32X3_SM90_FWD_TILES) and each one's operand pass: every head dim plain by default
#: (3 + 1 and 2 + 1 compiles), every feature set they take under --exhaustive.
TF32_CONFIGS = _dispatch.tf32_hopper_forward_configs(
    (0,) + tuple(f for f in _configs.SM90_FWD_FEATURES if f), ("tf32", "float32"))


def _tf32_id(c) -> str:
    if isinstance(c, _configs.AuxKernel):
        return f"{c.dtype}-{c.kernel}"
    return _config_id(c) + (f"-n{c.block_n}" if c in E4M3_WIDE_CONFIGS else "")


#: The FP8 forwards (e4m3 inputs, by the output's dtype: _dispatch.E4M3_SM90_FWD_TILES), V
#: transposed in the kernel (no operand pass), dense and varlen (FEATURE_VARLEN).
E4M3_CONFIGS = _dispatch.e4m3_hopper_forward_configs(features=(0, _configs.FEATURE_VARLEN))
#: The FP8 forward's wider key tiles that are not dispatched (_dispatch.E4M3_WIDE_TILES beside
#: E4M3_WIDE_TILE_KEYS' in E4M3_CONFIGS), bfloat16 output, one-tile grid: under --exhaustive.
E4M3_WIDE_CONFIGS = [c for c in (_dispatch.e4m3_sm90_config("e4m3_bf16", d, tile)
                                 for d, tiles in _dispatch.E4M3_WIDE_TILES.items()
                                 for tile in tiles) if c not in E4M3_CONFIGS]
#: The varlen FP8 forwards of the default run: d=64 (the consumers' highest register, R237 of
#: 240, one above the dense kernel's) with a bfloat16 output, d=256 with a float16 one.
E4M3_VARLEN_SAMPLE = {("e4m3_bf16", 64), ("e4m3_fp16", 256)}


def _keys_last_v_sampled(c) -> bool:
    """The default run's share of the forwards whose ring holds V keys-last: every float32 head
    dim plain with its operand pass (3 + 1 and 2 + 1 compiles), e4m3 at every head dim with a
    bfloat16 output on the one-tile grid (the in-kernel transpose's producer registers differ
    by tile) and with claimed tiles (the persistent loop's registers), and two varlen ones
    (E4M3_VARLEN_SAMPLE); the rest under --exhaustive."""
    if c.dtype in _configs.E4M3_TAGS:
        if c.features & _configs.FEATURE_VARLEN:
            return (c.dtype, c.head_dim) in E4M3_VARLEN_SAMPLE
        return c.dtype == "e4m3_bf16" and c.persistent == c.claims
    return not getattr(c, "features", 0)


@pytest.mark.parametrize("config", [
    pytest.param(c, id=_tf32_id(c),
                 marks=() if _keys_last_v_sampled(c) and c not in E4M3_WIDE_CONFIGS
                 else pytest.mark.exhaustive)
    for c in TF32_CONFIGS + E4M3_CONFIGS + E4M3_WIDE_CONFIGS])
def test_keys_last_v_hopper_forward_compiles_without_spills(config, reports):
    """The float32 forwards (V keys-last from an operand pass) and the FP8 ones (V transposed
    by the producer warpgroup, within its 24 registers): the same checks as every other
    specialisation, and the operand pass without spills."""
    if isinstance(config, _configs.AuxKernel):
        report = reports(config)
        assert report.cubin_bytes > 0 and report.spill_stores == 0, report.log
        return
    assert config.keys_last_v and (config.transpose_v or not config.persistent)
    test_hopper_forward_compiles_without_spills(config, reports)


def test_e4m3_forward_configs():
    """Every element (a bfloat16 and a float16 output) at every head dim of its tiles, V
    transposed in the kernel (no operand pass): keys-last in 128-key panels of the ring,
    two raw V buffers where they fit 227 KiB (d=64 and 128) and one at d=256, O staged in a Q
    region of O's bytes; varlen (FEATURE_VARLEN) on the one-tile grid alone."""
    assert all(isinstance(c, _configs.FwdSm90Config) for c in E4M3_CONFIGS)
    assert len(E4M3_CONFIGS) == len(set(E4M3_CONFIGS))
    assert {(c.dtype, c.head_dim) for c in E4M3_CONFIGS} == {
        (e, d) for e in _configs.E4M3_TAGS for d in _dispatch.E4M3_SM90_FWD_TILES}
    # d=128 also on the persistent grid, statically and with claimed tiles, and with 224-key
    # tiles; varlen one-tile
    assert sorted((c.head_dim, c.block_n, c.features, c.persistent, c.claims)
                  for c in E4M3_CONFIGS if c.dtype == "e4m3_bf16") == sorted(
        [(64, 256, 0, False, False), (128, 128, 0, False, False), (128, 128, 0, True, False),
         (128, 128, 0, True, True), (128, 224, 0, False, False), (256, 128, 0, False, False)]
        + [(d, 256 if d == 64 else 128, _configs.FEATURE_VARLEN, False, False)
           for d in (64, 128, 256)])
    assert {(c.dtype, c.head_dim) for c in E4M3_CONFIGS
            if c.features and _keys_last_v_sampled(c)} == E4M3_VARLEN_SAMPLE
    for c in E4M3_CONFIGS:
        assert c.transpose_v and c.keys_last_v and not c.operand_pass
        assert c.block_n % 32 == 0 and 128 * c.o_panels >= 2 * c.head_dim >= 128 * c.panels
        assert c.smem_bytes <= MAX_SMEM_SM90
    assert {(c.head_dim, c.raw_v_stages) for c in E4M3_CONFIGS} == {(64, 2), (128, 2), (256, 1)}


def test_e4m3_wide_tile_configs():
    """The wider FP8 key tiles: d=128, 160 keys (one 32-key group in the transposed V's second
    panel) with the overlap on 3 stages and one raw V buffer, and 192 (two groups) with it on 2
    stages and two raw buffers, not dispatched; 224 (three groups) with it on 2 stages and
    two raw buffers, dispatched (E4M3_WIDE_TILE_KEYS); each within 227 KiB, the transposed V's
    last panel whole in shared memory."""
    wide = [_dispatch.e4m3_sm90_config("e4m3_bf16", 128, t)
            for t in _dispatch.E4M3_WIDE_TILES[128]]
    assert [(c.block_n, c.stages, c.overlap, c.raw_v_stages, c.smem_bytes) for c in wide] == [
        (160, 3, True, 1, 214016), (192, 2, True, 2, 197632), (224, 2, True, 2, 214016)]
    for c in wide:
        assert c.transpose_v and c.block_n % 32 == 0 and c.block_n % 128 != 0
        assert c.smem_bytes <= MAX_SMEM_SM90
    assert E4M3_WIDE_CONFIGS == wide[:2] and wide[2] in E4M3_CONFIGS


def test_hopper_sinks_configs():
    """The dispatcher's sinks specialisations: those without sinks, the bit added (dense and
    varlen, every dtype, head dim and score-modifier set); the sample's 8 at SAMPLE_HEAD_DIM."""
    sinks = _configs.FEATURE_SINKS
    assert set(SINKS_CONFIGS) == {
        dataclasses.replace(c, features=c.features | sinks)
        for c in DISPATCHED | VARLEN_DISPATCHED}
    # 144 of one head dim, 48 with V's own (SM90_FWD_HEAD_DIM_PAIRS)
    assert len(SINKS_CONFIGS) == len(set(SINKS_CONFIGS)) == 144 + 48
    sample = [c for c in SINKS_CONFIGS if _sinks_sampled(c)]
    assert len(sample) == 8
    assert {(c.persistent, c.claims, bool(c.features & _configs.FEATURE_VARLEN))
            for c in sample} == {(False, False, False), (True, False, False), (True, True, False),
                                 (False, False, True)}
    assert "with sinks" in _configs.describe(sample[0])
    assert set(SINKS_CONFIGS) <= set(_dispatch.hopper_forward_configs(
        _configs.SM90_FWD_FEATURES + _configs.SM90_FWD_VARLEN_FEATURES))


def test_hopper_varlen_configs():
    """Varlen: every head dim, dtype, score-modifier set and schedule on the one-tile-per-CTA
    grid; never persistent; the default sample has the dispatcher's schedule at every head dim."""
    assert len(VARLEN_CONFIGS) == len(set(VARLEN_CONFIGS)) == 160
    assert {(c.head_dim, c.dtype, c.features, c.pingpong, c.overlap, c.persistent)
            for c in VARLEN_CONFIGS} == {
        (d, t, _configs.FEATURE_VARLEN | f, pp, ov, False) for d in EXPECTED_TILES
        for t in _configs.DTYPE_TAGS for f in _configs.SCORE_MOD_FEATURES
        for pp in (False, True) for ov in (False, True)}
    for config in VARLEN_CONFIGS:
        assert (config.block_n, config.stages) == EXPECTED_TILES[config.head_dim]
        assert not config.features & _configs.FEATURE_DROPOUT
    sample = [c for c in VARLEN_CONFIGS if _varlen_sampled(c)]
    assert len(sample) == 6
    assert {(c.head_dim, c.pingpong, c.overlap) for c in sample} == {
        (d, *_dispatch.SCHEDULES[d, False]) for d in EXPECTED_TILES}
    with pytest.raises(ValueError, match="persistent"):
        _configs.FwdSm90Config("float16", 128, features=_configs.FEATURE_VARLEN,
                               persistent=True)
    assert "varlen" in _configs.describe(VARLEN_CONFIGS[0])


def test_setmaxnreg_check_detects_c7508(nvrtc_available):
    """The control: without __launch_bounds__ ptxas ignores setmaxnreg and says so with C7508,
    so the assertion above can fail."""
    config = _dispatch.fwd_sm90_config("bfloat16", 64)
    source = _compile.specialisation_source(config)
    stripped, n = re.subn(r"__launch_bounds__\(\s*FwdSm90Traits<[^>]*>::THREADS, 1\)", "", source)
    assert n == 2  # the kernel and its programmable-modifiers twin (flash_fwd_sm90.cu)
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
    config = _dispatch.fwd_sm90_config("float16", 128)
    assert _compile.target_arch(config, 90) == "90a"
    assert _compile.arch_options(config) == ("-arch=sm_90a",)
    with pytest.raises(ValueError, match="sm_90a only"):
        _compile.target_arch(config, 80)
    plain = _dispatch.fwd_config("float16", 128, 90)
    assert _compile.target_arch(plain, 90) == "90" and _compile.arch_options(plain) == ()


#: The tile (block_n, stages) each head dim is expected to get (docs/HOPPER_FWD.md), and that of
#: the persistent grid (its O buffer must fit: d=96 drops to 2 stages, d=192/256 have none).
EXPECTED_TILES = {64: (128, 2), 96: (128, 3), 128: (128, 2), 192: (112, 2), 256: (80, 2)}
EXPECTED_PERSISTENT_TILES = {64: (128, 2), 96: (128, 2), 128: (128, 2)}


def test_hopper_config_shapes():
    assert _configs.SM90_FWD_HEAD_DIMS == tuple(EXPECTED_TILES)
    assert _dispatch.SM90_PERSISTENT_TILES == EXPECTED_PERSISTENT_TILES
    for config in CONFIGS:
        assert config.threads == 384 and config.block_m == 128
        tiles = EXPECTED_PERSISTENT_TILES if config.persistent else EXPECTED_TILES
        assert (config.block_n, config.stages) == tiles[config.head_dim]
        # whole 1024-byte swizzle atoms per K/V panel (the V descriptor's LBO is one panel)
        assert config.block_n % 16 == 0 and config.block_n * 128 % 1024 == 0
        assert config.features & (_configs.FEATURE_VARLEN | _configs.FEATURE_DROPOUT) == 0
    assert {(c.head_dim, c.dtype, c.features, c.pingpong, c.overlap, c.persistent)
            for c in CONFIGS} == {
        (d, t, f, pp, ov, grid) for grid, tiles in ((False, EXPECTED_TILES),
                                                    (True, EXPECTED_PERSISTENT_TILES))
        for d in tiles for t in _configs.DTYPE_TAGS
        for f in _configs.SCORE_MOD_FEATURES for pp in (False, True) for ov in (False, True)}
    # and the claiming twins of the persistent ping-pong + overlap ones
    assert {c for c in CONFIGS if c.claims} == {
        dataclasses.replace(c, claims=True) for c in CONFIGS
        if c.persistent and c.pingpong and c.overlap}
    assert len(CONFIGS) == len(set(CONFIGS)) == 160 + 96 + 24
    assert not _dispatch.fwd_sm90_config("float16", 64).pingpong  # off until measured
    assert not _dispatch.fwd_sm90_config("float16", 128).overlap  # off until measured
    assert not _dispatch.fwd_sm90_config("float16", 64).persistent  # opt-in
    assert all(not c.overlap for c in _dispatch.all_fwd_sm90_configs(overlap=(False,)))
    assert not any(c.persistent for c in _dispatch.all_fwd_sm90_configs())


def test_default_sample_covers_the_dispatch_table():
    """The sample compiled without --exhaustive (44 compiles): every configuration the
    dispatcher can choose at every head dim for the sample pairs and at SAMPLE_HEAD_DIM for
    every dtype and score-modifier set, and every (schedule, overlap, grid) combination at
    SAMPLE_HEAD_DIM."""
    sample = [c for c in CONFIGS if _sampled(c)]
    assert len(sample) == 44
    own_tests = set(THREE_CONSUMER_CONFIGS) | set(SPLIT_CONFIGS)  # their own tests' samples
    assert DISPATCHED - own_tests <= set(CONFIGS)
    assert len(THREE_CONSUMER_CONFIGS) == 24
    assert len(SPLIT_CONFIGS) == 64 and sum(map(_sampled, SPLIT_CONFIGS)) == 4
    for config in DISPATCHED - own_tests:
        if (config.dtype, config.features) in SAMPLE_PAIRS or config.head_dim == SAMPLE_HEAD_DIM:
            assert config in sample
    assert {c.head_dim for c in sample} == set(EXPECTED_TILES)
    assert {(c.dtype, c.features) for c in sample} == {
        (t, f) for t in _configs.DTYPE_TAGS for f in _configs.SCORE_MOD_FEATURES}
    combos = {(c.pingpong, c.overlap, c.persistent, c.claims) for c in CONFIGS}
    assert len(combos) == 9
    assert {(c.pingpong, c.overlap, c.persistent, c.claims) for c in sample
            if c.head_dim == SAMPLE_HEAD_DIM} == combos
    for bad in (80, 160, 512):
        with pytest.raises(ValueError):
            _dispatch.fwd_sm90_config("float16", bad)


def test_hopper_smem_counts_whole_panels():
    """A head dim of 96 takes two 64-column panels (the TMA zero-fills the second half), so its
    shared memory is that of 128 columns; the kernel's SMEM_BYTES probe checks the same."""
    d96 = _dispatch.fwd_sm90_config("bfloat16", 96)
    assert d96.panels == 2
    assert d96.smem_bytes == 128 * 2 * (128 + 2 * 3 * 128) + 1024
    assert _dispatch.fwd_sm90_config("bfloat16", 256).smem_bytes == 128 * 4 * (128 + 4 * 80) + 1024
    for config in CONFIGS:
        assert config.smem_bytes <= MAX_SMEM_SM90


def test_persistent_configs_add_an_o_buffer_where_it_fits():
    """The persistent grid stages O in a buffer of Q's size (FwdSm90Traits::O_BYTES): head dims
    64 and 128 keep their tiles, 96 drops to 2 stages, 192 and 256 do not fit and are refused."""
    for d, (block_n, stages) in EXPECTED_PERSISTENT_TILES.items():
        config = _dispatch.fwd_sm90_config("float16", d, persistent=True)
        panels = -(-d // 64)
        assert config.smem_bytes == 128 * panels * (2 * 128 + 2 * stages * block_n) + 1024
        assert config.smem_bytes <= MAX_SMEM_SM90
        assert config.name_expression.endswith(", true, false>")
        assert "true>::SMEM_BYTES" in config.probes
    assert _dispatch.fwd_sm90_config("float16", 64, persistent=True).smem_bytes == 99_328
    assert _dispatch.fwd_sm90_config("float16", 128, persistent=True).smem_bytes == 197_632
    for d in (192, 256):
        with pytest.raises(ValueError, match="persistent"):
            _dispatch.fwd_sm90_config("bfloat16", d, persistent=True)
    with pytest.raises(ValueError, match="shared memory"):  # d=96 with its usual 3 stages
        _configs.FwdSm90Config("float16", 96, block_n=128, stages=3, persistent=True)
    assert "persistent grid" in _configs.describe(
        _dispatch.fwd_sm90_config("float16", 128, persistent=True))


def test_template_arguments_in_order():
    """<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, PINGPONG, OVERLAP, FEATURES,
    PERSISTENT, CLAIMS>: the flags of the variants, the grid's last."""
    config = _dispatch.fwd_sm90_config("bfloat16", 128)
    assert config.name_expression == (
        "flash_fwd_sm90_kernel<bf16_tag, 128, 128, 128, 128, 2, false, false, 0, false, false>")
    both = dataclasses.replace(_dispatch.fwd_sm90_config("float16", 96, persistent=True),
                               pingpong=True, overlap=True, features=3, claims=True)
    assert both.name_expression == (
        "flash_fwd_sm90_kernel<fp16_tag, 96, 96, 128, 128, 2, true, true, 3, true, true>")
    assert "FwdSm90Traits<fp16_tag, 96, 96, 128, 128, 2, true>::SMEM_BYTES" in both.probes
    split = _dispatch.fwd_sm90_config("bfloat16", 192, head_dim_v=128)
    assert split.name_expression == (
        "flash_fwd_sm90_kernel<bf16_tag, 192, 128, 128, 128, 2, false, false, 0, false, false>")


def test_split_head_dim_tiles():
    """V's own head dim: SM90_SPLIT_HEAD_DIM_TILES for each pair (V's panels in the stages and
    the persistent grid's O buffer), refused beyond the pairs and above Q's head dim."""
    split = _dispatch.fwd_sm90_config("float16", 192, head_dim_v=128)
    assert (split.block_n, split.stages, split.panels, split.v_panels) == (128, 2, 3, 2)
    assert split.smem_bytes == 128 * (3 * (128 + 2 * 128) + 2 * 2 * 128) + 1024 <= MAX_SMEM_SM90
    small = _dispatch.fwd_sm90_config("float16", 128, persistent=True, head_dim_v=64)
    assert small.smem_bytes == 128 * (2 * (128 + 2 * 128) + 1 * 2 * 128 + 128) + 1024
    with pytest.raises(ValueError, match=r"\(Q's, V's\) head dims"):
        _dispatch.fwd_sm90_config("float16", 256, head_dim_v=128)
    with pytest.raises(ValueError, match="at most Q's"):
        _configs.FwdSm90Config("float16", 64, head_dim_v=128)
    dispatched = {(c.head_dim, c.head_dim_v) for c in DISPATCHED if c.head_dim_v != c.head_dim}
    assert dispatched == set(_dispatch.SM90_FWD_HEAD_DIM_PAIRS)


def test_hopper_source_uses_the_hopper_instructions():
    source = _compile.kernel_source("flash_fwd_sm90.cu")
    assert '#include "' not in source
    for marker in ("wgmma.mma_async.sync.aligned.", "wgmma.fence.sync.aligned",
                   "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes",
                   "mbarrier.try_wait.parity.shared::cta.b64", "setmaxnreg.inc.sync.aligned.u32",
                   "struct OnlineSoftmax", "struct KeyVisibility", "struct FwdSm90Params"):
        assert marker in source


# ---- the Hopper backward (cuda_src/flash_bwd_sm90.cu; docs/HOPPER_BWD.md) --------------------

BWD_CONFIGS = _dispatch.all_bwd_sm90_configs(_configs.SM90_BWD_FEATURES)
#: The dispatched backward (staged dQ up to d=128, head-dim chunks above): by default every head
#: dim for the forward's SAMPLE_PAIRS and every dtype and score-modifier set at SAMPLE_HEAD_DIM
#: (16); every one under --exhaustive.
#: d <= 128 with dQ by vector reductions from registers (dq_staged off: the dQ path of d=192 /
#: 256, kept beside the staged one for timing): every one under --exhaustive, two by default.
BWD_UNSTAGED = [dataclasses.replace(c, dq_buffers=0) for c in BWD_CONFIGS if c.dq_staged]
#: Varlen (FEATURE_VARLEN with each score-modifier set, every head dim): every one under
#: --exhaustive, two by default.
BWD_VARLEN = _dispatch.all_bwd_sm90_configs(_configs.SM90_BWD_VARLEN_FEATURES)
#: deterministic=True (dQ added in key-block order: the staged tiles' bulk reductions up to
#: d=128, the consumers' vector reductions above; dense and varlen): every one under
#: --exhaustive, three by default.
BWD_DETERMINISTIC = [_dispatch.bwd_sm90_config(c.dtype, c.head_dim, True, c.features)
                     for c in BWD_CONFIGS + BWD_VARLEN]
_BWD_SAMPLE = {("bfloat16", 128, 3), ("float16", 64, 0),
               ("float16", 128, _configs.FEATURE_VARLEN),
               ("bfloat16", 256, _configs.FEATURE_VARLEN | 3)}
_BWD_DETERMINISTIC_SAMPLE = {("float16", 64, 0), ("bfloat16", 256, 3),
                             ("float16", 128, _configs.FEATURE_VARLEN)}


def _bwd_param(config):
    plain = ((config.dq_staged or config.num_chunks > 1) and not config.deterministic
             and not config.features & _configs.FEATURE_VARLEN)
    if plain:
        sampled = ((config.dtype, config.features) in SAMPLE_PAIRS
                   or config.head_dim == SAMPLE_HEAD_DIM)
    else:
        sampled = (config.dtype, config.head_dim, config.features) in (
            _BWD_DETERMINISTIC_SAMPLE if config.deterministic else _BWD_SAMPLE)
    path = ("-det" if config.deterministic else "" if plain or config.dq_staged
            or config.num_chunks > 1 else "-red")
    return pytest.param(config, marks=() if sampled else pytest.mark.exhaustive,
                        id=f"{config.dtype}-d{config.head_dim}-f{config.features}{path}")


@pytest.mark.parametrize("config", [_bwd_param(c) for c in
                                    BWD_CONFIGS + BWD_UNSTAGED + BWD_DETERMINISTIC
                                    + BWD_VARLEN])
def test_hopper_backward_compiles_without_spills(config, nvrtc_available):
    """Same checks as the forward's: entry registers of 384 threads, no spills, setmaxnreg
    honoured (the consumers hold dK, dV, S^T and dP^T: 192 fp32 registers at d=128, and at
    d=192 / 256, whose CTAs hold a 128-column chunk of dK and dV)."""
    report = _compile.compile_report(config, 90)
    print(f"sm_90a {config.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, "
          f"{report.stack_bytes} bytes stack, {config.smem_bytes} bytes smem")
    assert report.cubin_bytes > 0
    assert report.registers <= _entry_registers(config), report.log
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert "C7508" not in report.log, report.log
    assert not report.odd_descriptors, report.odd_descriptors
    assert "ptxas warning" not in report.log, report.log  # e.g. wgmma serialised (C7515 ...)
    assert "are serialized" not in report.log, report.log  # C7511 etc., "ptxas info" lines
    assert config.smem_bytes <= MAX_SMEM_SM90


#: V's own head dim (SM90_FWD_HEAD_DIM_PAIRS): every dtype and feature set, dense and varlen, in
#: both modes under --exhaustive (64); plain fp16 of each pair and one deterministic by default.
BWD_SPLIT = [c for c in _dispatch.all_bwd_sm90_configs(
    _configs.SM90_BWD_FEATURES + _configs.SM90_BWD_VARLEN_FEATURES, head_dim_pairs=True)
    if c.head_dim_v != c.head_dim]
BWD_SPLIT += [_dispatch.bwd_sm90_config(c.dtype, c.head_dim, True, c.features, c.head_dim_v)
              for c in BWD_SPLIT]


@pytest.mark.parametrize("config", [
    pytest.param(c, id=f"{c.dtype}-d{c.head_dim}v{c.head_dim_v}-f{c.features}"
                 + ("-det" if c.deterministic else ""),
                 marks=() if (c.dtype, c.features) == ("float16", 0)
                 and (not c.deterministic or c.head_dim == 192) else pytest.mark.exhaustive)
    for c in BWD_SPLIT])
def test_hopper_split_backward_compiles_without_spills(config, nvrtc_available):
    """dP^T over V's head dim, dV of its columns in the first chunk: the same checks."""
    assert config.head_dim_v < config.head_dim
    test_hopper_backward_compiles_without_spills(config, nvrtc_available)


def test_hopper_split_backward_configs():
    assert len(BWD_SPLIT) == len(set(BWD_SPLIT)) == 64
    split = _dispatch.bwd_sm90_config("bfloat16", 192, head_dim_v=128)
    assert split.name_expression == (
        "flash_bwd_sm90_kernel<bf16_tag, 192, 128, 64, 128, 2, 0, 0, false>")
    # K 48 + V 32 KiB, 2 x (Q 24 + dO 16 KiB + 512 B of lse / D), 2 dS tiles of 16 KiB, 1 KiB
    assert split.smem_bytes == 80 * 1024 + 2 * (40 * 1024 + 512) + 32 * 1024 + 1024
    with pytest.raises(ValueError, match=r"\(Q's, V's\) head dims"):
        _dispatch.bwd_sm90_config("bfloat16", 256, head_dim_v=128)
    with pytest.raises(ValueError, match="first chunk"):
        _configs.BwdSm90Config("bfloat16", 256, head_dim_v=192)


def test_hopper_backward_config_shapes():
    assert _configs.SM90_BWD_HEAD_DIMS == (64, 96, 128, 192, 256)
    both_mods = _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI
    for config in BWD_CONFIGS:
        # 128-row steps at d=64 (64 with softcap and ALiBi together: 128 spill there)
        wide = config.head_dim == 64 and config.features != both_mods
        assert config.threads == 384 and config.block_n == 128
        assert config.block_m == (128 if wide else 64)
        assert config.dq_buffers == (1 if wide else 2 if config.head_dim <= 128 else 0)
        assert config.stages == (1 if config.head_dim == 256 else 2)
        assert config.num_chunks == (1 if config.head_dim <= 128 else 2)
        assert config.features & (_configs.FEATURE_VARLEN | _configs.FEATURE_DROPOUT) == 0
        assert _compile.target_arch(config, 90) == "90a"
    assert {(c.head_dim, c.dtype, c.features) for c in BWD_CONFIGS} == {
        (d, t, f) for d in (64, 96, 128, 192, 256) for t in _configs.DTYPE_TAGS
        for f in _configs.SM90_BWD_FEATURES}
    # K + V, two Q / dO stages, two dS tiles, the statistics, two fp32 dQ tiles (staged up to
    # d=128), 1 KiB of alignment slack
    d128 = _dispatch.bwd_sm90_config("bfloat16", 128)
    assert d128.dq_staged and d128.smem_bytes == (
        2 * 128 * 256 + 2 * (2 * 64 * 256 + 512) + 2 * 64 * 256 + 2 * 64 * 128 * 4 + 1024)
    assert d128.smem_bytes - _dispatch.bwd_sm90_config("float16", 96).smem_bytes == (
        2 * 64 * 32 * 4)  # two panels each, dQ tiles of 128 / 96 columns
    assert [c.head_dim for c in BWD_CONFIGS if c.dq_staged] == [
        c.head_dim for c in BWD_CONFIGS if c.head_dim <= 128]
    assert dataclasses.replace(d128, dq_buffers=0).smem_bytes == d128.smem_bytes - 65536
    with pytest.raises(ValueError, match="staged dQ"):
        dataclasses.replace(_dispatch.bwd_sm90_config("float16", 192), dq_buffers=2)
    # d=64: 128-row steps, one dQ tile (two would leave no room for the mbarriers)
    d64 = _dispatch.bwd_sm90_config("float16", 64)
    assert d64.smem_bytes == (
        2 * 128 * 128 + 2 * (2 * 128 * 128 + 1024) + 2 * 128 * 256 + 128 * 64 * 4 + 1024)
    with pytest.raises(ValueError, match="staged dQ"):
        dataclasses.replace(d64, dq_buffers=2)
    # deterministic mode on the same tile (its semaphore: the 128-row block's first 64 rows), but
    # with ALiBi (64-row steps, as ALiBi with softcap: 128 spill)
    deterministic = _dispatch.bwd_sm90_config("float16", 64, deterministic=True)
    assert deterministic == dataclasses.replace(d64, deterministic=True)
    for features in (_configs.FEATURE_ALIBI, _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI):
        assert _dispatch.bwd_sm90_config("float16", 64, True, features).block_m == 64
    assert _dispatch.bwd_sm90_config("float16", 64, True, _configs.FEATURE_SOFTCAP).block_m == 128
    # above d=128 the consumers' vector reductions, ordered (the same tiles)
    for d in (192, 256):
        assert _dispatch.bwd_sm90_config("float16", d, deterministic=True) == dataclasses.replace(
            _dispatch.bwd_sm90_config("float16", d), deterministic=True)
    # d=192: three panels, two stages; d=256: four panels, one stage; both under 227 KiB
    assert _dispatch.bwd_sm90_config("float16", 192).smem_bytes == (
        2 * 128 * 384 + 2 * (2 * 64 * 384 + 512) + 2 * 64 * 256 + 1024)
    assert _dispatch.bwd_sm90_config("float16", 256).smem_bytes == (
        2 * 128 * 512 + (2 * 64 * 512 + 512) + 2 * 64 * 256 + 1024)
    for bad in (160, 224, 80, 512):
        with pytest.raises(ValueError):
            _dispatch.bwd_sm90_config("float16", bad)


def test_hopper_backward_refuses_tiles_past_its_register_budget(nvrtc_available):
    """A 128-query step at d=128 (S^T and dP^T of 64 registers each beside dK and dV) does not
    fit the consumers' registers: the traits' static_assert says so instead of ptxas spilling.
    (d=192 / 256 fit through head-dim chunks of at most 128 columns.)"""
    with pytest.raises(ValueError, match="128 up to head dim 64"):
        _configs.BwdSm90Config("bfloat16", 128, block_m=128, stages=1)
    config = _configs.BwdSm90Config("bfloat16", 64, block_m=128, stages=1)
    object.__setattr__(config, "head_dim", 128)  # past the host's check: the kernel's own
    with pytest.raises(RuntimeError, match="consumers' 240 registers"):
        _compile.compile_report(config, 90)


def test_hopper_backward_source_uses_the_hopper_instructions():
    source = _compile.kernel_source("flash_bwd_sm90.cu")
    assert '#include "' not in source
    for marker in ("wgmma.mma_async.sync.aligned.", "stmatrix.sync.aligned.m8n8.x4.trans",
                   "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                   "red.global.add.v4.f32", "setmaxnreg.dec.sync.aligned.u32",
                   "struct BwdSm90Params", "struct KeyVisibility", "dq_accum_position"):
        assert marker in source


def test_the_fp8_forwards_e4m3_primitives_assemble():
    """hopper_primitives.cuh's e4m3 wgmma (SS and RS, m64n128k32) and P's e4m3 A fragment
    (pack_probabilities_e4m3, cvt.rn.satfinite.e4m3x2.f32) through NVRTC and ptxas for sm_90a:
    the FP8 forward's instructions (docs/FP8_FORWARD.md) as the assembler takes them, before a
    kernel uses them."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")
    probe = """
#include "hopper_primitives.cuh"
extern "C" __global__ void __launch_bounds__(128) e4m3_probe(float* out, const float* s_in,
                                                              u64 desc_a, u64 desc_b) {
    float s[4][4], acc[16][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = s_in[16 * threadIdx.x + 4 * j + e];
    u32 p[4];
    pack_probabilities_e4m3(p, s);
    wgmma_fence();
    wgmma_ss<e4m3_tag<bf16_tag>, 128>(acc, desc_a, desc_b, 0);
    wgmma_rs_kmajor<e4m3_tag<bf16_tag>, 128>(acc, p, desc_b, 1);
    wgmma_commit_group();
    wgmma_wait_group<0>();
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) out[64 * threadIdx.x + 4 * n + e] = acc[n][e];
}
"""
    source = _compile.kernel_source("e4m3_probe.cu", (("e4m3_probe.cu", probe),))
    _compile.compile_probe(source, "90a", sass=True)


#: The MLA decode kernel (flash_mla_decode_sm90.cu; docs/MLA_DECODE.md): one specialisation a
#: dtype, alone and paired (two CTAs sharing each tile); the paired ones under --exhaustive
#: (.ci/run's compile step), the default suite being near its time budget.
MLA_CONFIGS = [pytest.param(_configs.MlaDecodeConfig(dtype, paired=paired),
                            id=dtype + ("-paired" if paired else ""),
                            marks=pytest.mark.exhaustive if paired else ())
               for dtype in _configs.DTYPE_TAGS for paired in (False, True)]


@pytest.mark.parametrize("config", MLA_CONFIGS)
def test_mla_decode_compiles_without_spills(nvrtc_available, config):
    """384 threads (168 registers at entry), the consumers at 240 after setmaxnreg: the same
    checks as the forward's (no spills, setmaxnreg honoured, no wgmma serialised), within one
    CTA's shared memory."""
    report = _compile.compile_report(config, 90)
    print(f"sm_90a {config.name_expression}: {report.registers} registers, "
          f"{report.spill_stores}/{report.spill_loads} bytes spilled, {config.smem_bytes} smem")
    assert report.cubin_bytes > 0
    # (all 168: the setmaxnreg split 24 x 128 + 240 x 256 takes the whole pool at entry)
    assert report.registers == _entry_registers(config) == 168, report.log
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.stack_bytes == 0, report.log
    assert "C7508" not in report.log, report.log
    assert not report.odd_descriptors, report.odd_descriptors
    assert "ptxas warning" not in report.log, report.log
    assert "are serialized" not in report.log, report.log
    assert config.smem_bytes <= MAX_SMEM_SM90
