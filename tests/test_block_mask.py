"""Block masks (cuflash2.block_mask, issue 44) on the CPU: NVRTC compiles the states kernel
(block_mask.cu) and the mods forward with FEATURE_BLOCK_MASK for a document mask and a sliding
window (no spills), the NumPy reference of the states on small examples, the dispatch's config
and the checks before a launch.
"""

import numpy
import pytest

import cuflash2
from cuflash2 import _compile, _configs, _dispatch, _params, block_masks, mods, reference

DOC = mods.ModSource("mask_mod", "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx",
                     inputs=(mods.InputSignature("doc", "int32", 1),))
WINDOW = mods.ModSource("mask_mod", "kv_idx <= q_idx && q_idx - kv_idx < window",
                        constants=(("window", "int", "1024"),))
MASKS = {"document": DOC, "sliding-window": WINDOW}
SHAPES = [(dtype, d, arch) for dtype in ("float16", "bfloat16") for d in (64, 128)
          for arch in (80, 90)]


def _forward_config(mask, dtype, d, arch):
    return mods.forward_config(_dispatch.fwd_mods_config(dtype, d, arch), mask, None,
                               block_mask=True)


def _states_config(mask, dtype, d, arch):
    bm, bn = block_masks.tiles(dtype, d, arch)
    header, h = mods.user_mods_header(mask, None)
    return _configs.BlockMaskConfig(bm, bn, header, h)


# The README's test run compiles the document mask's kernels on sm_90 (the states kernel, and
# the forward at fp16, d=128); `--exhaustive` (.ci/run's second step) every case.
_EXHAUSTIVE = pytest.mark.exhaustive


@pytest.mark.parametrize("arch", (pytest.param(80, marks=_EXHAUSTIVE), 90))
@pytest.mark.parametrize("mask", ["document", pytest.param("sliding-window", marks=_EXHAUSTIVE)])
def test_states_kernel_compiles(mask, arch):
    config = _states_config(MASKS[mask], "float16", 128, arch)
    assert (config.block_m, config.block_n) == (64, 64)
    report = _compile.compile_report(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.name_expression == f"flash_block_mask_kernel<64, 64, {config.mods_hash:#010x}u>"


@pytest.mark.parametrize("dtype,d,arch", [
    pytest.param(*shape, id="{}-d{}-sm{}".format(*shape),
                 marks=() if shape == ("float16", 128, 90) else _EXHAUSTIVE) for shape in SHAPES])
@pytest.mark.parametrize("mask", ["document", pytest.param("sliding-window", marks=_EXHAUSTIVE)])
def test_forward_with_block_mask_compiles_without_spills(mask, dtype, d, arch):
    config = _forward_config(MASKS[mask], dtype, d, arch)
    assert config.features == _configs.FEATURE_MASK_MOD | _configs.FEATURE_BLOCK_MASK
    # The states' tiles are the kernel's.
    assert (config.block_m, config.block_n) == block_masks.tiles(dtype, d, arch)
    report = _compile.compile_report(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log
    assert report.registers <= 255
    assert report.name_expression.startswith("flash_fwd_mods_kernel<")


def test_block_mask_is_its_own_specialisation():
    with_states = _forward_config(DOC, "float16", 64, 80)
    without = mods.forward_config(_dispatch.fwd_mods_config("float16", 64, 80), DOC, None)
    assert with_states.name_expression != without.name_expression
    assert with_states.user_mods == without.user_mods  # the same generated header
    with pytest.raises(ValueError, match="needs its mask modifier"):
        mods.forward_config(_dispatch.fwd_mods_config("float16", 64, 80), None, None,
                            block_mask=True)
    assert "block mask" in _configs.describe(with_states)


def test_dispatch_passes_the_bit():
    problem = type("P", (), {"dtype": "bfloat16", "head_dim": 128, "head_dim_v": 128,
                             "seqlen_q": 1000, "nheads": 4, "batch": 2})()
    features = _configs.FEATURE_MASK_MOD | _configs.FEATURE_BLOCK_MASK
    # (the mma.sync forward's; on sm_90 the Hopper one takes it: test_programmable_compile.py)
    choice = _dispatch.forward_kernel(problem, features, (-1, -1), 80, {}, None, 0,
                                      user_mods=(DOC, None))
    assert choice.config.features == features
    assert choice.grid == (16, 4, 2)


def test_params_struct():
    layout = _params.layout("FwdModsParams")
    for field in ("blocks.states", "blocks.batch_stride", "blocks.head_stride",
                  "blocks.row_stride"):
        assert field in layout.offsets
    assert "blocks.states" in layout.pointers or "states" in str(layout.pointers)
    states = _params.layout("BlockMaskParams")
    assert {"states", "ranges", "nheads", "seqlen_q", "seqlen_k", "num_m_blocks",
            "num_n_blocks", "user.in0.data", "batch_offset"} <= set(states.offsets)
    assert "columns" in states.offsets
    hopper_bwd = _params.layout("BwdSm90ModsParams")
    assert {"columns.columns", "columns.batch_stride", "columns.head_stride", "state_block_m",
            "state_block_n", "num_n_blocks", "sm90.base.dq_accum", "user.in0.data"} <= set(
                hopper_bwd.offsets)
    hopper = _params.layout("FwdSm90ModsParams")
    assert {"ranges.rows", "ranges.batch_stride", "ranges.head_stride", "block_m_div",
            "block_n_div", "num_m_blocks"} <= set(hopper.offsets)
    assert "ranges.rows" in hopper.pointers


# ---------------------------------------------------------------------------------------------
# The NumPy reference of the states


def _dense(fn, seqlen_q, seqlen_k):
    q = numpy.arange(seqlen_q)[:, None]
    k = numpy.arange(seqlen_k)[None, :]
    return numpy.broadcast_to(fn(q, k), (seqlen_q, seqlen_k))


def test_states_reference_document():
    doc = numpy.array([0] * 4 + [1] * 4)
    mask = _dense(lambda q, k: doc[q] == doc[k], 8, 8)
    expected = numpy.array([[2, 0], [0, 2]], numpy.int8)
    numpy.testing.assert_array_equal(reference.block_mask_states(mask, 4, 4), expected)
    # Document boundaries inside tiles make them partial.
    numpy.testing.assert_array_equal(reference.block_mask_states(mask, 3, 3),
                                     [[2, 1, 0], [1, 1, 1], [0, 1, 2]])


def test_states_reference_causal_odd_lengths():
    mask = _dense(lambda q, k: k <= q, 5, 7)
    numpy.testing.assert_array_equal(reference.block_mask_states(mask, 2, 3),
                                     [[1, 0, 0], [2, 1, 0], [2, 1, 0]])
    # Batch and heads dims are kept.
    stacked = numpy.broadcast_to(mask, (2, 3, 5, 7))
    assert reference.block_mask_states(stacked, 2, 3).shape == (2, 3, 3, 3)


def test_states_reference_prefix_lm():
    mask = _dense(lambda q, k: (k <= q) | (k < 4), 8, 8)
    numpy.testing.assert_array_equal(reference.block_mask_states(mask, 4, 4), [[2, 0], [2, 1]])
    numpy.testing.assert_array_equal(reference.block_mask_states(mask, 2, 2),
                                     [[2, 2, 0, 0], [2, 2, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]])


def test_ranges_reference():
    # Causal over 2 x 3 tiles: visited up to the diagonal, full before it.
    causal = reference.block_mask_states(_dense(lambda q, k: k <= q, 5, 7), 2, 3)
    numpy.testing.assert_array_equal(reference.block_mask_ranges(causal),
                                     [[0, 1, 0, 0], [0, 2, 0, 1], [0, 2, 0, 1]])
    # A hole: visited from the first to the last tile, the longest full run (the first of
    # two as long), an empty row all zeros.
    states = numpy.array([[1, 2, 0, 2, 2, 1], [2, 0, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0]], numpy.int8)
    numpy.testing.assert_array_equal(reference.block_mask_ranges(states),
                                     [[0, 6, 3, 5], [0, 3, 0, 1], [0, 0, 0, 0]])
    assert reference.block_mask_ranges(numpy.zeros((2, 3, 4, 5), numpy.int8)).shape == (2, 3, 4, 4)


def test_columns_reference():
    # Causal over 2 x 3 tiles (states [[1, 0, 0], [2, 1, 0], [2, 1, 0]]): column 0 visited by
    # rows 0-2 and full in rows 1-2, column 1 visited by rows 1-2, none full, column 2 empty.
    causal = reference.block_mask_states(_dense(lambda q, k: k <= q, 5, 7), 2, 3)
    none = 0x7FFFFFFF
    numpy.testing.assert_array_equal(reference.block_mask_columns(causal), [
        [0, 3, 1, 3, 2, 0, 0, 0], [1, 3, none, 0, 0, 0, 0, 0], [none, 0, none, 0, 0, 0, 0, 0]])
    # Full rows with a hole: their count tells the kernel the run is not whole.
    states = numpy.array([[2], [1], [2]], numpy.int8)
    numpy.testing.assert_array_equal(reference.block_mask_columns(states),
                                     [[0, 3, 0, 3, 2, 0, 0, 0]])
    assert reference.block_mask_columns(numpy.zeros((2, 3, 4, 5), numpy.int8)).shape == (
        2, 3, 5, 8)
    assert tuple(block_masks.COLUMNS_START) == (none, 0, none, 0, 0, 0, 0, 0)


def test_states_reference_errors():
    with pytest.raises(ValueError, match="boolean"):
        reference.block_mask_states(numpy.zeros((4, 4)), 2, 2)
    with pytest.raises(ValueError, match="block_m"):
        reference.block_mask_states(numpy.zeros((4, 4), bool), 0, 2)


# ---------------------------------------------------------------------------------------------
# Checks before a launch (no GPU: a BlockMask with host states)


def _block_mask(mask_mod=None, batch=1, nheads=1, seqlen_q=1000, seqlen_k=1000, tiles=(64, 64),
                device_id=0):
    mask_mod = mask_mod or cuflash2.mask_mod("kv_idx <= q_idx && q_idx - kv_idx < w", w=256)
    bm = block_masks.BlockMask(None, mask_mod, *tiles, batch, nheads, seqlen_q, seqlen_k,
                               device_id)
    bm.states = numpy.zeros((batch, nheads, bm.num_m_blocks, bm.num_n_blocks), numpy.int8)
    return bm


def test_check_for_call_accepts_broadcast_and_exact():
    block_masks.check_for_call(_block_mask(), 64, 64, 8, 16, 1000, 1000, 0)
    block_masks.check_for_call(_block_mask(batch=8, nheads=16), 64, 64, 8, 16, 1000, 1000, 0)
    assert block_masks.states_fields(_block_mask()) == {
        "blocks.batch_stride": 0, "blocks.head_stride": 0, "blocks.row_stride": 16}
    assert block_masks.states_fields(_block_mask(batch=2, nheads=3)) == {
        "blocks.batch_stride": 3 * 16 * 16, "blocks.head_stride": 16 * 16,
        "blocks.row_stride": 16}


@pytest.mark.parametrize("change,call,message", [
    ({"tiles": (128, 64)}, {}, "128x64 tiles, the forward kernel of this call uses 64x64"),
    ({"batch": 2}, {}, "batch=2, the call has batch=8"),
    ({"nheads": 4}, {}, "nheads=4, the call has nheads=16"),
    ({"seqlen_q": 999}, {}, "seqlen_q=999"),
    ({"seqlen_k": 2000}, {}, "seqlen_k=2000"),
    ({"device_id": 1}, {}, "on device 1"),
])
def test_check_for_call_refuses(change, call, message):
    bm = _block_mask(**change)
    with pytest.raises(ValueError, match=message):
        block_masks.check_for_call(bm, 64, 64, 8, 16, 1000, 1000, 0)


def test_check_for_backward_takes_coarser_states():
    # The forward's 128 x 64 states over the backward's 64 x 64 tiles: two query blocks a state.
    assert block_masks.check_for_backward(_block_mask(tiles=(128, 64)), 64, 64, 8, 16, 1000,
                                          1000, 0) == {"block_m_div": 2, "block_n_div": 1}
    assert block_masks.check_for_backward(_block_mask(), 64, 64, 8, 16, 1000, 1000, 0) == {
        "block_m_div": 1, "block_n_div": 1}
    with pytest.raises(ValueError, match="do not split into the backward kernel's 128x64"):
        block_masks.check_for_backward(_block_mask(), 128, 64, 8, 16, 1000, 1000, 0)
    with pytest.raises(ValueError, match="batch=2, the call has batch=8"):
        block_masks.check_for_backward(_block_mask(batch=2), 64, 64, 8, 16, 1000, 1000, 0)


@pytest.mark.exhaustive
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_with_block_mask_compiles_without_spills(d, arch):
    base = _dispatch.bwd_mods_config("bfloat16", d, arch)
    config = mods.backward_config(base, DOC, None, block_mask=True)
    assert config.features == _configs.FEATURE_MASK_MOD | _configs.FEATURE_BLOCK_MASK
    # the forward's states split into its tiles (check_for_backward)
    fwd = block_masks.tiles("bfloat16", d, arch)
    assert fwd[0] % config.block_m == 0 and fwd[1] % config.block_n == 0
    report = _compile.compile_report(config, arch)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.log


def test_check_for_call_refuses_altered_states():
    bm = _block_mask()
    bm.states = numpy.zeros((1, 1, 16, 15), numpy.int8)
    with pytest.raises(ValueError, match="int8"):
        block_masks.check_for_call(bm, 64, 64, 1, 1, 1000, 1000, 0)


def test_resolve_mask_mod():
    bm = _block_mask()
    assert block_masks.resolve(None, bm) is bm.mask_mod
    assert block_masks.resolve(bm.mask_mod, bm) is bm.mask_mod
    # Another object with the same source is the same modifier.
    same = cuflash2.mask_mod("kv_idx <= q_idx && q_idx - kv_idx < w", w=256)
    assert block_masks.resolve(same, bm) is bm.mask_mod
    other = cuflash2.mask_mod("kv_idx <= q_idx && q_idx - kv_idx < w", w=128)
    with pytest.raises(ValueError, match="block_mask was built for"):
        block_masks.resolve(other, bm)
    with pytest.raises(TypeError, match="cuflash2.block_mask"):
        block_masks.resolve(None, object())


def test_block_mask_argument_errors():
    mask = cuflash2.mask_mod("kv_idx <= q_idx")
    with pytest.raises(TypeError, match="cuflash2.mask_mod"):
        cuflash2.block_mask("kv_idx <= q_idx", 1, 1, 128, 128, head_dim=64)
    with pytest.raises(ValueError, match="seqlen_k must be an int >= 1"):
        cuflash2.block_mask(mask, 1, 1, 128, 0, head_dim=64)
    with pytest.raises(ValueError, match="dtype"):
        block_masks.tiles("float32", 64, 80)
    with pytest.raises(ValueError, match="head_dim"):
        block_masks.tiles("float16", 0, 80)
    assert block_masks.tiles("bf16", 128, 90) == (64, 64)
