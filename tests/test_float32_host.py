"""Float32 inputs without a GPU: the precision argument, the kernels' element and tiles, the
word strides of their parameters, and the reference's TF32 precision (tests/gpu/test_float32.py
runs the kernels)."""

import ml_dtypes
import numpy as np
import pytest

from cuflash2 import _configs, _dispatch, _prepare, _validate, reference
from cuflash2._attention_plans import _stride_fields
from cuflash2._options import AttentionOptions


def _problem(dtype=np.float32, head_dim=128):
    q = np.zeros((2, 100, 4, head_dim), dtype)
    k = np.zeros((2, 70, 2, head_dim), dtype)
    return _validate.check_attention_inputs(q, k, k)


@pytest.mark.parametrize("precision,element", [(None, "float32"), ("highest", "float32"),
                                               ("high", "tf32"), ("tf32", "tf32")])
def test_precision_names_the_kernels_element(precision, element):
    problem = _prepare.with_kernel_element(_problem(), AttentionOptions(precision=precision))
    assert problem.dtype == element
    assert element in _configs.FLOAT32_TAGS


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_calls_take_no_precision(dtype):
    problem = _problem(dtype)
    assert _prepare.with_kernel_element(problem, AttentionOptions()) == problem
    with pytest.raises(ValueError, match=r"precision applies to float32 inputs only; got "
                                         r"precision='tf32' with .* inputs"):
        _prepare.with_kernel_element(problem, AttentionOptions(precision="tf32"))


@pytest.mark.parametrize("bad", ["default", "fp32", 1, True])
def test_unknown_precision(bad):
    with pytest.raises(ValueError, match=r"precision must be one of 'highest', 'high', 'tf32' "
                                         r"or None; got"):
        _prepare.with_kernel_element(_problem(), AttentionOptions(precision=bad))


def test_float32_refuses_the_modifiers_it_does_not_take_yet():
    options = AttentionOptions(mask_mod=object())
    with pytest.raises(NotImplementedError, match=r"mask_mod, score_mod, bias, block_mask: "
                                                  r"not with float32 inputs"):
        _prepare.with_kernel_element(_problem(), options)


def test_float32_strides_are_whole_16_byte_units():
    q = np.zeros((1, 8, 2, 76), np.float32)  # rows of 76 floats: 304 bytes, 19 units
    _validate.check_attention_inputs(q[..., :64], q[..., :64], q[..., :64])
    with pytest.raises(ValueError, match=r"q stride of dim 2 must be a multiple of 4 elements "
                                         r"\(16 bytes\)"):
        bad = np.zeros((1, 8, 2, 66), np.float32)[..., :64]
        _validate.check_attention_inputs(bad, bad, bad)


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("element", list(_configs.FLOAT32_TAGS))
@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_float32_tiles_fit_and_stay_on_mma_sync(element, head_dim, arch):
    config = _dispatch.fwd_config(element, head_dim, arch)
    assert config.dtype == element and config.head_dim >= head_dim
    assert config.block_m == 16 * config.num_warps  # 16 rows a warp
    smem = _dispatch.SMEM_PER_SM_KIB[arch] * 1024
    assert config.smem_bytes + 1024 <= smem
    # twice the 16-bit tile's bytes: 4 bytes an element
    assert config.smem_bytes == 4 * config.head_dim * (
        config.block_m + 2 * config.kv_stages * config.block_n)
    assert config in _dispatch.all_fwd_configs(arch, elements=(element,))
    problem = _prepare.with_kernel_element(_problem(head_dim=head_dim),
                                           AttentionOptions(precision="tf32" if element == "tf32"
                                                            else None))
    assert _dispatch.hopper_forward_config(problem, 0, (-1, -1), arch) is None


def test_parameters_count_16_bit_words():
    """A float32 array's strides and head dim reach the kernel in 16-bit words (twice its
    element strides), a 16-bit array's as they are."""
    assert _stride_fields("q", (800, 8, 2), _configs.ELEMENT_WORDS["float32"]) == {
        "q_batch_stride": 1600, "q_row_stride": 16, "q_head_stride": 4}
    assert _stride_fields("q", (800, 8, 2), _configs.ELEMENT_WORDS["bfloat16"]) == {
        "q_batch_stride": 800, "q_row_stride": 8, "q_head_stride": 2}
    assert _configs.FwdConfig("tf32", 64, 64, 64, 4, 2).name_expression.startswith(
        "flash_fwd_kernel<tf32_tag, 64,")


def test_reference_tf32_rounds_to_ten_mantissa_bits():
    x = np.array([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-11, 1.0 + 2.0**-12, -(1.0 + 2.0**-11),
                  3.0 + 2.0**-9 + 2.0**-10], np.float32)
    got = reference._round_tf32(x.copy())
    want = np.array([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-10, 1.0, -(1.0 + 2.0**-10),
                     3.0 + 2.0**-8], np.float32)
    np.testing.assert_array_equal(got, want)


def test_reference_tf32_precision_sits_between_float16_and_float32():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 200, 2, 64), dtype=np.float32) for _ in range(3))
    exact = reference.attention(q, k, v, causal=True, compute_dtype=np.float64)
    errors = {name: np.abs(reference.attention(q, k, v, causal=True, compute_dtype=dtype)
                           .astype(np.float64) - exact).max()
              for name, dtype in (("float32", np.float32), ("tf32", "tf32"),
                                  ("float16", np.float16))}
    assert reference.attention(q, k, v, compute_dtype="tf32").dtype == np.float32
    assert errors["float32"] < 1e-5 < errors["tf32"] < 3e-3
    assert errors["tf32"] < 2 * errors["float16"]


def test_precompile_names_the_float32_forward():
    from cuflash2 import precompile

    for name, element in (("fp32", "float32"), ("tf32", "tf32")):
        configs = precompile.plan(90, [precompile.DTYPES[name]], [64, 100], [0], ["fwd", "bwd"])
        assert configs == [_dispatch.fwd_config(element, 64, 90),
                           _dispatch.fwd_config(element, 128, 90)]
