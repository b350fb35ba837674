"""Programmable masks and score modifiers (cuflash2.mods, issue 44) on the CPU: NVRTC compiles the
mma.sync forward, backward and deterministic dQ kernels with user expressions (no spills,
ptxas report), the generated header and its hash, the dispatch (every architecture: the
mma.sync kernels), the plans' structs, and the error paths (names, inputs, compile errors
showing the user's line, the backward's refusal of a score modifier without a derivative).
"""

import types
from concurrent.futures import ProcessPoolExecutor

import numpy
import pytest

import cuflash2
from cuflash2 import _compile, _configs, _dispatch, _params, _validate, mods

DOC = mods.ModSource("mask_mod", "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx",
                     inputs=(mods.InputSignature("doc", "int32", 1),))
# Prefix-LM with the prefix length a Python int, baked in as a constant (mods docstring).
PREFIX_LM = mods.ModSource("mask_mod", "kv_idx <= q_idx || kv_idx < prefix_len",
                           constants=(("prefix_len", "int", "2048"),))
# The same with the length read per call from a 1-element array.
PREFIX_LM_ARRAY = mods.ModSource("mask_mod", "kv_idx <= q_idx || kv_idx < prefix[0]",
                                 inputs=(mods.InputSignature("prefix", "int32", 1),))
REL_POS = mods.ModSource("score_mod", "score + table(h, q_idx - kv_idx + 1023)",
                         inputs=(mods.InputSignature("table", "float32", 2),))
SOFTCAP_LIKE = mods.ModSource("score_mod", "12.f * tanhf(score / 12.f)",
                              grad="1.f - (tanhf(score / 12.f) * tanhf(score / 12.f))")

# (mask, score) pairs: each expression of the brief, mask and score modifier compiled together
# (both code paths in one kernel), and each kind alone once.
PAIRS = [(DOC, REL_POS), (PREFIX_LM, SOFTCAP_LIKE)]
CASES = [(mask, score, dtype, d, arch) for mask, score in PAIRS for dtype in ("float16", "bfloat16")
         for d in (64, 128) for arch in (80, 90)]
CASES += [(DOC, None, "float16", 128, 80), (None, SOFTCAP_LIKE, "bfloat16", 64, 90),
          (PREFIX_LM_ARRAY, None, "bfloat16", 128, 90)]


# The README's test run compiles one case of each kernel (the first pair at fp16, d=128,
# sm_90); `--exhaustive` (.ci/run's second step) compiles every case (tests/conftest.py).
SAMPLE = (DOC, REL_POS, "float16", 128, 90)


def _params_of(cases, ids):
    return [pytest.param(i, id=name, marks=() if case[-5:] == SAMPLE else pytest.mark.exhaustive)
            for i, (case, name) in enumerate(zip(cases, ids))]


def _selected(config, cases):
    """The indices of the cases this run compiles (all with --exhaustive, else the sample)."""
    every = config.getoption("--exhaustive")
    return [i for i, case in enumerate(cases) if every or case[-5:] == SAMPLE]


def _config(mask, score, dtype, d, arch):
    return mods.forward_config(_dispatch.fwd_mods_config(dtype, d, arch), mask, score)


def _bwd_config(mask, score, dtype, d, arch, deterministic=False):
    return mods.backward_config(_dispatch.bwd_mods_config(dtype, d, arch, deterministic), mask,
                                score)


def _dq_config(mask, score, dtype, d, arch):
    return mods.dq_config(_dispatch.bwd_dq_config(dtype, d, arch), mask, score)


def _report(case):
    mask, score, dtype, d, arch = case
    return _compile.compile_report(_config(mask, score, dtype, d, arch), arch)


# The backward: the main kernel (atomic dQ and deterministic) and the dQ kernel, each case of
# the forward's.
KERNELS = ("bwd", "bwd-det", "dq")
BWD_CASES = [(kernel, *case) for case in CASES for kernel in KERNELS]


def _bwd_report(case):
    kernel, mask, score, dtype, d, arch = case
    if kernel == "dq":
        config = _dq_config(mask, score, dtype, d, arch)
    else:
        config = _bwd_config(mask, score, dtype, d, arch, kernel == "bwd-det")
    return _compile.compile_report(config, arch)


@pytest.fixture(scope="module")
def reports(request):
    indices = _selected(request.config, CASES)
    with ProcessPoolExecutor(2) as pool:
        return dict(zip(indices, pool.map(_report, [CASES[i] for i in indices])))


@pytest.mark.parametrize("index", _params_of(
    CASES, [f"{m.kind if m else '-'}+{s.kind if s else '-'}-{dt}-d{d}-sm{a}"
            for m, s, dt, d, a in CASES]))
def test_forward_with_user_mods_compiles_without_spills(reports, index):
    report = reports[index]
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.registers <= 255
    assert not report.odd_descriptors, report.odd_descriptors
    mask, score = CASES[index][:2]
    assert report.name_expression.startswith("flash_fwd_mods_kernel<")


@pytest.fixture(scope="module")
def bwd_reports(request):
    indices = _selected(request.config, BWD_CASES)
    with ProcessPoolExecutor(2) as pool:
        return dict(zip(indices, pool.map(_bwd_report, [BWD_CASES[i] for i in indices])))


@pytest.mark.parametrize("index", _params_of(
    BWD_CASES, [f"{k}-{m.kind if m else '-'}+{s.kind if s else '-'}-{dt}-d{d}-sm{a}"
                for k, m, s, dt, d, a in BWD_CASES]))
def test_backward_with_user_mods_compiles_without_spills(bwd_reports, index):
    report = bwd_reports[index]
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.registers <= 255
    assert not report.odd_descriptors, report.odd_descriptors
    kernel = BWD_CASES[index][0]
    expected = "flash_bwd_dq_mods_kernel<" if kernel == "dq" else "flash_bwd_mods_kernel<"
    assert report.name_expression.startswith(expected)
    if kernel == "bwd-det":
        assert ", false, " in report.name_expression  # no dQ atomics


def test_backward_configs_carry_the_header():
    config = _bwd_config(DOC, REL_POS, "float16", 128, 80)
    forward = _config(DOC, REL_POS, "float16", 128, 80)
    assert isinstance(config, _configs.BwdModsConfig)
    assert config.mods_hash == forward.mods_hash and config.user_mods == forward.user_mods
    assert config.features == _configs.FEATURE_MASK_MOD | _configs.FEATURE_SCORE_MOD
    assert f"{config.mods_hash:#010x}u>" in config.name_expression
    assert "score_grad" in config.user_mods  # the derivative, 1.f for the additive form
    dq = _dq_config(DOC, REL_POS, "bfloat16", 64, 90)
    assert isinstance(dq, _configs.BwdDqModsConfig) and dq.mods_hash == config.mods_hash
    # The tile: 64 x 64 steps, 8 warps, at every head dim (bwd_mods_config's table).
    assert (config.block_m, config.block_n, config.num_warps) == (64, 64, 8)
    small = _dispatch.bwd_mods_config("float16", 64, 80)
    assert (small.block_m, small.block_n, small.num_warps) == (64, 64, 8)


# ---------------------------------------------------------------------------------------------
# The additive bias as the kernels take it (cuflash2._bias): a score modifier.

BIAS = mods.ModSource("score_mod", "score + cf2_bias(b, h, q_idx, kv_idx)", "1.f",
                      (mods.InputSignature("cf2_bias", "float32", 4),))


def test_bias_is_a_score_modifier_composed_before_the_users():
    from cuflash2 import _bias

    view = _FakeArray("float32", (2, 4, 8, 8))
    alone = _bias.score_mod_with_bias(view, None)
    assert alone.source == BIAS and alone.arrays == (view,)
    user = cuflash2.score_mod("12.f * tanhf(score / 12.f)", grad="1.f - tanhf(score) * score_x",
                              score_x=2.0)
    both = _bias.score_mod_with_bias(view, user)
    biased = "(score + cf2_bias(b, h, q_idx, kv_idx))"
    assert both.source.expression == f"12.f * tanhf({biased} / 12.f)"
    assert both.source.grad == f"1.f - tanhf({biased}) * score_x"  # other names kept
    assert both.source.inputs[-1].name == "cf2_bias" and both.arrays[-1] is view
    # an additive user modifier keeps derivative 1 at the biased score
    additive = _bias.score_mod_with_bias(view, cuflash2.score_mod("score - 0.5f"))
    assert additive.source.grad == "1.f"


def test_bias_gradient_kernel_compiles_without_spills():
    """The backward main kernel that writes dbias (FEATURE_BIAS_GRAD) at the README's sample
    (fp16, d=128, sm_90); every head dim and architecture with --exhaustive."""
    import dataclasses

    base = _dispatch.bwd_mods_config("float16", 128, 90)
    base = dataclasses.replace(base, features=base.features | _configs.FEATURE_BIAS_GRAD)
    config = mods.backward_config(base, None, BIAS)
    assert "dbias" in _configs.describe(config)
    report = _compile.compile_report(config, 90)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


@pytest.mark.exhaustive
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("headdim", [32, 64, 96, 128])
def test_bias_kernels_compile_without_spills_every_head_dim(arch, headdim):
    import dataclasses

    fwd = mods.forward_config(_dispatch.fwd_mods_config("bfloat16", headdim, arch), None, BIAS)
    base = _dispatch.bwd_mods_config("bfloat16", headdim, arch)
    bwd = mods.backward_config(
        dataclasses.replace(base, features=base.features | _configs.FEATURE_BIAS_GRAD), None,
        BIAS)
    for config in (fwd, bwd):
        report = _compile.compile_report(config, arch)
        assert report.spill_stores == 0 and report.spill_loads == 0, report.log


def test_dispatch_sends_user_mods_to_the_mma_sync_backward_on_every_arch():
    q = numpy.zeros((2, 4096, 8, 128), numpy.float16)
    problem = _validate.check_attention_inputs(q, q, q)
    features = _configs.FEATURE_MASK_MOD | _configs.FEATURE_SCORE_MOD
    for arch in _configs.CPU_TEST_ARCHS:
        for deterministic in (False, True):
            choice = _dispatch.backward_kernels(problem, features, deterministic, arch, {}, None,
                                                (-1, 0), user_mods=(DOC, REL_POS))
            assert not choice.hopper
            assert isinstance(choice.config, _configs.BwdModsConfig)
            assert choice.config.compute_dq is not deterministic
            assert choice.config.features == features
            if deterministic:
                assert isinstance(choice.dq_config, _configs.BwdDqModsConfig)
                assert choice.dq_config.features == features
            else:
                assert choice.dq_config is None


def test_bwd_mods_params_layout():
    bwd, mods_params = _params.layout("BwdParams"), _params.layout("BwdModsParams")
    assert mods_params.offsets["base.q"] == 0
    assert mods_params.offsets["user.in0.data"] >= bwd.size
    assert mods_params.offsets["score_scale"] > mods_params.offsets["user.in7.stride3"]


def test_header_hash_names_the_kernel():
    a = _config(DOC, None, "float16", 64, 80)
    b = _config(DOC, None, "float16", 64, 80)
    c = _config(PREFIX_LM, None, "float16", 64, 80)
    d = _config(DOC, REL_POS, "float16", 64, 80)
    assert a == b and a.name_expression == b.name_expression
    assert len({a.name_expression, c.name_expression, d.name_expression}) == 3
    assert f"{a.mods_hash:#010x}u" in a.user_mods  # USER_MODS_HASH, checked by a static_assert
    assert a.features == _configs.FEATURE_MASK_MOD
    assert d.features == _configs.FEATURE_MASK_MOD | _configs.FEATURE_SCORE_MOD
    # Another dtype of the input is another specialisation.
    e = _config(mods.ModSource("mask_mod", DOC.expression,
                               inputs=(mods.InputSignature("doc", "int64", 1),)),
                None, "float16", 64, 80)
    assert e.name_expression != a.name_expression
    # The plain kernels' source has the default user_mods.cuh (never called).
    plain = _compile.specialisation_source(_dispatch.fwd_config("float16", 64, 80))
    assert "USER_MODS_HASH = 0u" in plain and "doc[q_idx]" not in plain
    assert "doc[q_idx]" in _compile.specialisation_source(a)


def test_inputs_take_slots_in_order():
    header, _ = mods.user_mods_header(DOC, REL_POS)
    assert "UserArray1<int> doc(cf2_user.in0)" in header
    assert "UserArray2<float> table(cf2_user.in1)" in header
    header, _ = mods.user_mods_header(PREFIX_LM, None)
    assert "constexpr int prefix_len = 2048;" in header


def test_header_says_whether_the_mask_reads_arrays():
    """UserMods::MASK_READS_INPUTS (the Hopper kernels run a mask that reads no arrays alone on
    the tiles the visibility does not cut: Variant::USER_MASK_INSIDE)."""
    def reads(mask, score=None):
        header, _ = mods.user_mods_header(mask, score)
        return {"static constexpr bool MASK_READS_INPUTS = true;": True,
                "static constexpr bool MASK_READS_INPUTS = false;": False}[
            next(line.strip() for line in header.splitlines() if "MASK_READS_INPUTS" in line)]

    assert reads(DOC) and reads(PREFIX_LM_ARRAY)
    assert not reads(PREFIX_LM)  # a Python int: a constant
    assert not reads(None, REL_POS)  # the score modifier's table is not the mask's
    unused = mods.ModSource("mask_mod", "kv_idx <= q_idx",
                            inputs=(mods.InputSignature("doc", "int32", 1),))
    assert not reads(unused)


def test_dispatch_takes_a_bias_alone_as_tiles_on_the_hopper_forward(monkeypatch):
    """On sm_90 a bias alone (`score + bias`) runs on the Hopper forward as tiles
    (FEATURE_BIAS_TILE: two consumers, overlap, one tile a CTA, the bias's map and extents for
    FwdSm90ModsParams); another dtype than q's, head dims above 128, varlen, a user's score
    modifier and CUFLASH2_HOPPER_BIAS_TILES=0 keep the generic path (stand-ins for the TMA
    encoder)."""
    from cuflash2 import _bias, _hopper

    monkeypatch.setattr(_hopper, "readable_map_fields",
                        lambda views, maps: {f"{f}.v": b"\0" * 128 for f in maps})
    q = numpy.zeros((4, 4096, 16, 128), numpy.float16)
    views = {"q": q}
    problem = _validate.check_attention_inputs(q, q, q)
    bias = numpy.zeros((1, 16, 4096, 4096), numpy.float16)
    view = numpy.broadcast_to(bias, (4, 16, 4096, 4096))
    tile = _bias.tile_array(view)
    assert tile.shape == (1, 4096, 16, 4096) and tile.strides[3] == 2
    source = _bias.score_mod_with_bias(view, None).source
    assert _bias.is_bias_alone(source)

    def choose(user_mods=(None, source), bias_tile=tile, p=problem, features=None, vs=views):
        features = _configs.FEATURE_SCORE_MOD if features is None else features
        return _dispatch.forward_kernel(p, features, (-1, -1), 90, vs, None, 0,
                                        user_mods=user_mods, bias_tile=bias_tile)

    choice = choose()
    config = choice.config
    assert choice.hopper and isinstance(config, _configs.FwdSm90ModsConfig)
    assert config.features == _configs.FEATURE_BIAS_TILE
    assert (config.block_m, config.overlap, config.persistent) == (128, True, False)
    assert config.smem_bytes <= _configs.SM90_MAX_SMEM
    assert choice.grid == (4096 // 128, 16, 4)
    assert set(choice.bias_fields) == {"bias_map.v", "bias_batches", "bias_heads"}
    assert (choice.bias_fields["bias_batches"], choice.bias_fields["bias_heads"]) == (1, 16)
    masked = choose((DOC, source), features=_configs.FEATURE_MASK_MOD | _configs.FEATURE_SCORE_MOD)
    assert masked.config.features == _configs.FEATURE_MASK_MOD | _configs.FEATURE_BIAS_TILE
    assert not choose(bias_tile=tile.astype(numpy.float32)).hopper
    d96 = numpy.zeros((4, 4096, 16, 96), numpy.float16)
    narrow = choose(p=_validate.check_attention_inputs(d96, d96, d96), vs={"q": d96})
    # d=96's plain three K/V stages leave no room for the bias's: two, as at d=128.
    assert narrow.hopper and narrow.config.stages == 2
    assert narrow.config.smem_bytes <= _configs.SM90_MAX_SMEM
    big = numpy.zeros((4, 4096, 16, 192), numpy.float16)
    assert not choose(p=_validate.check_attention_inputs(big, big, big), vs={"q": big}).hopper
    monkeypatch.setattr(_dispatch, "HOPPER_FORWARD_BIAS_TILES", False)
    assert not choose().hopper


@pytest.mark.parametrize("d,mask", [pytest.param(128, None, marks=pytest.mark.exhaustive),
                                    (128, "doc"),
                                    pytest.param(64, None, marks=pytest.mark.exhaustive),
                                    pytest.param(96, "doc", marks=pytest.mark.exhaustive)])
def test_hopper_forward_with_bias_tiles_compiles_without_spills(d, mask):
    """The Hopper forward with the bias as tiles (FEATURE_BIAS_TILE; two consumers, ping-pong and
    overlap, one tile a CTA; d=128: 225 KiB of shared memory) with and without a mask modifier."""
    import dataclasses

    base = _configs.FwdSm90Config("bfloat16", d, 128, 128, 2, True, True)
    config = mods.hopper_forward_config(base, DOC if mask else None, None)
    config = dataclasses.replace(config, features=config.features | _configs.FEATURE_BIAS_TILE)
    assert config.smem_bytes <= _configs.SM90_MAX_SMEM
    report = _compile.compile_report(config, 90)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


def test_dispatch_takes_a_bias_alone_as_tiles_on_the_hopper_backward(monkeypatch):
    """On sm_90 a bias alone runs on the Hopper backward as tiles (BwdSm90ModsConfig with
    FEATURE_BIAS_TILE, 64-row steps, one staged dQ tile at d=128, the bias's map and extents),
    dbias from the dS tiles (FEATURE_BIAS_GRAD), with a mask modifier or a block mask too;
    softcap, another dtype than q's, head dims above 128, a user's score modifier and
    CUFLASH2_HOPPER_BIAS_TILES=0 keep the mma.sync backward (stand-ins for the TMA encoder)."""
    from cuflash2 import _bias, _hopper

    monkeypatch.setattr(_hopper, "readable_map_fields",
                        lambda views, maps: {f"{f}.v": b"\0" * 128 for f in maps})
    score = _configs.FEATURE_SCORE_MOD
    for d, dq_buffers in ((64, 2), (128, 1)):
        q = numpy.zeros((4, 4096, 16, d), numpy.float16)
        problem = _validate.check_attention_inputs(q, q, q)
        view = numpy.broadcast_to(numpy.zeros((1, 16, 4096, 4096), numpy.float16),
                                  (4, 16, 4096, 4096))
        tile = _bias.tile_array(view)
        source = _bias.score_mod_with_bias(view, None).source

        def choose(user_mods=(None, source), features=score, bias_tile=tile, p=problem,
                   views={"q": q}, deterministic=False):
            return _dispatch.backward_kernels(p, features, deterministic, 90, views, None,
                                              (-1, -1), user_mods=user_mods, bias_tile=bias_tile)

        choice = choose()
        config = choice.config
        assert choice.hopper and isinstance(config, _configs.BwdSm90ModsConfig)
        assert config.features == _configs.FEATURE_BIAS_TILE
        assert (config.block_m, config.dq_buffers) == (64, dq_buffers)
        assert config.smem_bytes <= _configs.SM90_MAX_SMEM - _configs.SM90_BWD_BARRIER_BYTES
        assert set(choice.bias_fields) == {"bias_map.v", "bias_batches", "bias_heads"}
        assert (choice.bias_fields["bias_batches"], choice.bias_fields["bias_heads"]) == (1, 16)
        blocked = _configs.FEATURE_MASK_MOD | _configs.FEATURE_BLOCK_MASK
        assert choose((DOC, source), blocked | score).config.features == (
            blocked | _configs.FEATURE_BIAS_TILE)
        assert choose(deterministic=True).config.deterministic
        with_grad = choose(features=score | _configs.FEATURE_BIAS_GRAD).config
        assert with_grad.features == _configs.FEATURE_BIAS_TILE | _configs.FEATURE_BIAS_GRAD
        assert not choose(features=score | _configs.FEATURE_SOFTCAP).hopper
        assert not choose(bias_tile=tile.astype(numpy.float32)).hopper
        assert not choose((None, REL_POS), bias_tile=None).hopper
    big = numpy.zeros((4, 4096, 16, 192), numpy.float16)
    assert not choose(p=_validate.check_attention_inputs(big, big, big), views={"q": big}).hopper
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD_BIAS_TILES", False)
    assert not choose().hopper


@pytest.mark.parametrize("d,mask,dbias", [
    (128, None, True), pytest.param(128, None, False, marks=pytest.mark.exhaustive),
    pytest.param(128, "doc", False, marks=pytest.mark.exhaustive),
    pytest.param(128, "doc", True, marks=pytest.mark.exhaustive),
    pytest.param(64, "doc", True, marks=pytest.mark.exhaustive),
    pytest.param(96, None, False, marks=pytest.mark.exhaustive)])
def test_hopper_backward_with_bias_tiles_compiles_without_spills(d, mask, dbias):
    """The Hopper backward with the bias as tiles (FEATURE_BIAS_TILE at its dispatched 64-row
    steps, one staged dQ tile above d=64), with and without dbias and a mask modifier."""
    config = _dispatch.with_bias_tiles(_dispatch.hopper_backward_mods_config(
        _dispatch.bwd_sm90_config("bfloat16", d), DOC if mask else None),
        _configs.FEATURE_BIAS_GRAD if dbias else 0)
    assert config.smem_bytes <= _configs.SM90_MAX_SMEM - _configs.SM90_BWD_BARRIER_BYTES
    report = _compile.compile_report(config, 90)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


def test_dispatch_sends_a_mask_modifier_alone_to_the_hopper_backward(monkeypatch):
    """On sm_90 a mask modifier alone runs on the Hopper backward (BwdSm90ModsConfig, 64-row
    steps, the user's code compiled in; a block mask's bit too, except in deterministic mode); a
    score modifier, dbias and CUFLASH2_HOPPER_BWD_MODS=0 keep the mma.sync backward (a stand-in
    for the TMA encoder)."""
    from cuflash2 import _hopper

    monkeypatch.setattr(_hopper, "readable_map_fields",
                        lambda views, maps: {f"{f}.v": b"\0" * 128 for f in maps})
    mask = _configs.FEATURE_MASK_MOD
    blocked = mask | _configs.FEATURE_BLOCK_MASK
    for d in (64, 128, 256):
        q = numpy.zeros((2, 4096, 8, d), numpy.float16)
        problem = _validate.check_attention_inputs(q, q, q)

        def choose(user_mods, features=mask, deterministic=False, p=problem):
            return _dispatch.backward_kernels(p, features, deterministic, 90, {}, None,
                                              (-1, -1), user_mods=user_mods)

        choice = choose((DOC, None))
        assert choice.hopper and isinstance(choice.config, _configs.BwdSm90ModsConfig)
        assert choice.config.features == mask and choice.config.block_m == 64
        # Q and dO come in boxes of the step's rows (the plain kernel's d=64 steps are 128)
        assert choice.maps["q_map"][1] == choice.maps["do_map"][1] == 64
        assert choice.config.name_expression.startswith("flash_bwd_sm90_mods_kernel<")
        assert choice.config.name_expression.endswith(f", {choice.config.mods_hash:#010x}u>")
        assert choose((DOC, None), blocked).config.features == blocked
        assert choose((DOC, None), deterministic=True).config.deterministic
        assert not choose((DOC, None), blocked, deterministic=True).hopper
        assert not choose((DOC, REL_POS), mask | _configs.FEATURE_SCORE_MOD).hopper
        assert not choose((DOC, None), mask | _configs.FEATURE_BIAS_GRAD).hopper
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD_MODS", False)
    assert not choose((DOC, None)).hopper


@pytest.mark.parametrize("d,block_mask,mask", [
    pytest.param(128, False, "doc", marks=pytest.mark.exhaustive),
    pytest.param(128, True, "doc", marks=pytest.mark.exhaustive), (128, True, "prefix"),
    pytest.param(64, True, "prefix", marks=pytest.mark.exhaustive),
    pytest.param(64, False, "doc", marks=pytest.mark.exhaustive),
    pytest.param(96, True, "doc", marks=pytest.mark.exhaustive),
    pytest.param(256, True, "doc", marks=pytest.mark.exhaustive)])
def test_hopper_backward_with_a_mask_modifier_compiles_without_spills(d, block_mask, mask):
    """The Hopper backward with a mask modifier (BwdSm90ModsConfig at its dispatched 64-row
    steps): a document mask and prefix-LM, with and without a block mask's column ranges."""
    source = {"doc": DOC, "prefix": PREFIX_LM}[mask]
    config = _dispatch.hopper_backward_mods_config(_dispatch.bwd_sm90_config("bfloat16", d),
                                                   source, block_mask)
    assert config.block_m == 64
    report = _compile.compile_report(config, 90)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


def test_dispatch_sends_user_mods_to_the_mma_sync_forward_below_sm90():
    q = numpy.zeros((2, 4096, 8, 128), numpy.float16)
    problem = _validate.check_attention_inputs(q, q, q)
    for arch in (80, 86, 89):
        for user_mods in ((DOC, None), (DOC, REL_POS), (None, REL_POS)):
            choice = _dispatch.forward_kernel(problem, _configs.FEATURE_MASK_MOD, (-1, 0), arch,
                                              {}, None, 0, user_mods=user_mods)
            assert not choice.hopper
            assert isinstance(choice.config, _configs.FwdModsConfig)
            assert choice.grid == (4096 // choice.config.block_m, 8, 2)
    # Without them, sm_90 still takes the Hopper kernel's config for this call.
    assert _dispatch.hopper_forward_config(problem, 0, (-1, 0), 90) is not None
    assert _dispatch.hopper_forward_config(problem, _configs.FEATURE_MASK_MOD, (-1, 0), 90) is None


def test_dispatch_sends_a_mask_modifier_alone_to_the_hopper_forward(monkeypatch):
    """On sm_90 a mask modifier alone runs on the Hopper forward (FwdSm90ModsConfig: the
    schedule the call would have without it, the user's code compiled in; with a block mask up to
    d=128); a score modifier, head dims past HOPPER_MODS_MAX_HEAD_DIM (with a block mask
    HOPPER_BLOCK_MASK_MAX_HEAD_DIM) and CUFLASH2_HOPPER_MODS=0 keep the mma.sync kernel
    (stand-ins for the TMA encoder and the SM count)."""
    from cuflash2 import _hopper

    monkeypatch.setattr(_hopper, "readable_map_fields",
                        lambda views, maps: {f"{f}.v": b"\0" * 128 for f in maps})
    monkeypatch.setattr(_dispatch, "persistent_slots", lambda config, device_id: 132)
    views = {"q": numpy.zeros((2, 4096, 8, 128), numpy.float16)}
    problem = _validate.check_attention_inputs(views["q"], views["q"], views["q"])

    def choose(user_mods, features=_configs.FEATURE_MASK_MOD, p=problem):
        return _dispatch.forward_kernel(p, features, (-1, 0), 90, views, None, 0,
                                        user_mods=user_mods)

    choice = choose((DOC, None))
    plain = _dispatch.hopper_forward_config(problem, 0, (-1, 0), 90)
    assert choice.hopper and isinstance(choice.config, _configs.FwdSm90ModsConfig)
    assert choice.config.features == _configs.FEATURE_MASK_MOD
    assert (choice.config.pingpong, choice.config.overlap, choice.config.persistent,
            choice.config.block_n) == (plain.pingpong, plain.overlap, plain.persistent,
                                       plain.block_n)
    assert choice.config.name_expression.startswith("flash_fwd_sm90_mods_kernel<")
    assert choice.config.name_expression.endswith(f", {choice.config.mods_hash:#010x}u>")
    assert not choose((DOC, REL_POS)).hopper
    assert not choose((None, REL_POS), _configs.FEATURE_SCORE_MOD).hopper
    with_states = _configs.FEATURE_MASK_MOD | _configs.FEATURE_BLOCK_MASK
    blocked = choose((DOC, None), with_states)
    assert blocked.hopper and blocked.config.features == with_states
    big = numpy.zeros((2, 4096, 8, 256), numpy.float16)
    assert not choose((DOC, None), p=_validate.check_attention_inputs(big, big, big)).hopper
    d192 = numpy.zeros((2, 4096, 8, 192), numpy.float16)
    p192 = _validate.check_attention_inputs(d192, d192, d192)
    assert choose((DOC, None), p=p192).hopper  # 112-key tiles: no block mask there
    assert not choose((DOC, None), with_states, p=p192).hopper
    monkeypatch.setattr(_dispatch, "HOPPER_FORWARD_MODS", False)
    assert not choose((DOC, None)).hopper


@pytest.mark.parametrize("name", [
    "mask", pytest.param("mask-persistent-d64", marks=pytest.mark.exhaustive),
    pytest.param("block-mask-persistent-d128", marks=pytest.mark.exhaustive),
    pytest.param("block-mask-d64", marks=pytest.mark.exhaustive)])
def test_hopper_forward_with_a_mask_modifier_compiles_without_spills(name):
    """The Hopper forward with a document mask (FwdSm90ModsConfig) at the dispatched
    schedule of d=128 (bf16, the one-tile-per-CTA grid); under --exhaustive the persistent
    three-consumer d=64 one, and with a block mask (BlockMaskNarrow) the persistent d=128 and
    the three-consumer d=64 ones."""
    block_mask = name.startswith("block-mask")
    if name == "mask":
        base = _configs.FwdSm90Config("bfloat16", 128, 128, 128, 2, True, True)
    elif name == "block-mask-persistent-d128":
        base = _configs.FwdSm90Config("bfloat16", 128, 128, 128, 2, True, True, persistent=True,
                                      claims=True)
    else:
        base = _configs.FwdSm90Config("bfloat16", 64, 192, 128, 2, persistent=True, claims=True)
    config = mods.hopper_forward_config(base, DOC, None, block_mask=block_mask)
    report = _compile.compile_report(config, 90)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


def test_mods_params_layout():
    fwd, mods_params = _params.layout("FwdParams"), _params.layout("FwdModsParams")
    assert mods_params.offsets["base.q"] == 0
    assert mods_params.offsets["user.in0.data"] >= fwd.size
    assert "user.in7.stride3" in mods_params.offsets


def test_score_derivative_rule():
    assert mods.score_derivative("score + table(h, q_idx)", None) == "1.f"
    assert mods.score_derivative("  score + bias[kv_idx]  ", None) == "1.f"
    assert mods.score_derivative("score + score_table[h]", None) == "1.f"  # another identifier
    assert mods.score_derivative("score + 0.5f * score", None) is None
    assert mods.score_derivative("2.f * score", None) is None
    assert mods.score_derivative("2.f * score", "2.f") == "2.f"
    # score - <...>, and tails that bind as one operand of the + or -
    assert mods.score_derivative("score - 0.01f * (q_idx - kv_idx)", None) == "1.f"
    assert mods.score_derivative("score + (q_idx > kv_idx ? 1.f : 0.f)", None) == "1.f"
    assert mods.score_derivative("score + p->x", None) == "1.f"
    # (score + a) ? b : c, (score - a) < b, score++ : not the additive form
    assert mods.score_derivative("score + a ? b : c", None) is None
    assert mods.score_derivative("score - a < b", None) is None
    assert mods.score_derivative("score++", None) is None
    assert mods.score_derivative("score + a, b", None) is None


# ---------------------------------------------------------------------------------------------
# Error paths


class _FakeArray:
    """A stand-in for a CuPy array (no CuPy on the CPU test machine)."""

    def __init__(self, dtype, shape):
        self.dtype = numpy.dtype(dtype)
        self.shape = shape
        self.ndim = len(shape)
        self.size = int(numpy.prod(shape))
        self.itemsize = self.dtype.itemsize


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setattr(mods, "_cupy", lambda: types.SimpleNamespace(ndarray=_FakeArray))


def test_valid_inputs(fake_cupy):
    m = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx]", doc=_FakeArray("int32", (10,)))
    assert m.source.inputs == (mods.InputSignature("doc", "int32", 1),)
    s = cuflash2.score_mod("score + t(h, q_idx, kv_idx)", t=_FakeArray("float16", (2, 3, 4)),
                           scale=0.5, n=3, flag=True)
    assert s.source.constants == (("scale", "float", "0.5f"), ("n", "int", "3"),
                                  ("flag", "bool", "true"))
    assert s.derivative == "1.f"


@pytest.mark.parametrize("name", ["1x", "a-b", "x y"])
def test_bad_identifier(fake_cupy, name):
    with pytest.raises(ValueError, match="not a valid C identifier"):
        cuflash2.mask_mod("q_idx < 3", **{name: 1})


@pytest.mark.parametrize("name", ["q_idx", "kv_idx", "b", "h", "score", "int", "return",
                                  "cf2_user", "UserMods", "threadIdx"])
def test_reserved_name(fake_cupy, name):
    with pytest.raises(ValueError, match=f"input name '{name}' is reserved"):
        cuflash2.mask_mod("q_idx < 3", **{name: 1})


def test_wrong_input_dtype_and_type(fake_cupy):
    with pytest.raises(TypeError, match="doc has dtype float64"):
        cuflash2.mask_mod("doc[q_idx] > 0", doc=_FakeArray("float64", (4,)))
    with pytest.raises(TypeError, match="numpy array"):
        cuflash2.mask_mod("doc[q_idx] > 0", doc=numpy.zeros(4, numpy.int32))
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash2.mask_mod("doc[q_idx] > 0", doc=[1, 2])
    with pytest.raises(ValueError, match="1 to 4 dims"):
        cuflash2.mask_mod("doc(q_idx) > 0", doc=_FakeArray("int32", (1, 1, 1, 1, 1)))
    with pytest.raises(ValueError, match="one expression"):
        cuflash2.mask_mod("true; }")
    with pytest.raises(TypeError, match="string"):
        cuflash2.score_mod(lambda s: s)


def test_too_many_inputs_together():
    inputs = tuple(mods.InputSignature(f"x{i}", "int32", 1) for i in range(5))
    a = mods.ModSource("mask_mod", "true", inputs=inputs)
    b = mods.ModSource("score_mod", "score", inputs=inputs)
    with pytest.raises(ValueError, match="10 array inputs together; at most 8"):
        mods.user_mods_header(a, b)


def test_compile_error_shows_the_users_line():
    bad = mods.ModSource("mask_mod", "doc[q_idx] == doc[kv_idx] && nope",
                         inputs=(mods.InputSignature("doc", "int32", 1),))
    config = _config(bad, REL_POS, "float16", 64, 80)
    with pytest.raises(mods.ModCompileError) as info:
        _compile.compile_report(config, 80)
    message = str(info.value)
    assert "doc[q_idx] == doc[kv_idx] && nope" in message  # the expression
    assert "mask_mod(1)" in message and '"nope" is undefined' in message  # NVRTC on its line
    assert "score + table(h, q_idx - kv_idx + 1023)" in message  # the other one, for context
    assert "flash_fwd_body" not in message and len(message) < 3000  # not the whole kernel


def test_compile_error_in_the_score_grad():
    bad = mods.ModSource("score_mod", "score * 2.f", grad="2.f * undefined_thing")
    with pytest.raises(mods.ModCompileError, match="score_mod_grad"):
        _compile.compile_report(_config(None, bad, "float16", 64, 80), 80)


def test_backward_refuses_a_score_mod_without_derivative():
    # Checked before any array is looked at (no CuPy here): nothing is launched.
    no_grad = cuflash2.score_mod("2.f * score")
    for call in (lambda kw: cuflash2.attention_backward(None, None, None, None, None, None, **kw),
                 lambda kw: cuflash2.attention_vjp(None, None, None, **kw),
                 lambda kw: cuflash2.attention_varlen_backward(None, None, None, None, None, None,
                                                               None, None, 1, 1, **kw)):
        with pytest.raises(ValueError, match=r"score_mod .*pass grad="):
            call({"score_mod": no_grad})
        with pytest.raises(TypeError, match="cuflash2.mask_mod"):
            call({"mask_mod": object()})
        with pytest.raises(NotImplementedError, match="dropout"):
            call({"score_mod": cuflash2.score_mod("score + 1.f"), "dropout_p": 0.1,
                  "seed": 1})
    with pytest.raises(ValueError, match="pass grad="):
        mods.backward_config(_dispatch.bwd_config("float16", 64, 80), None, no_grad.source)


def test_wrong_mod_type_is_refused_before_anything_else():
    with pytest.raises(TypeError, match="cuflash2.mask_mod"):
        cuflash2.attention(None, None, None, mask_mod="doc[q_idx] == 0")
    with pytest.raises(TypeError, match="cuflash2.score_mod"):
        cuflash2.attention(None, None, None, score_mod=lambda s: s)
