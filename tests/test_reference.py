"""CPU tests of cuflash2.reference and cuflash2.testing (NumPy only: no CuPy, no GPU)."""

import math

import ml_dtypes
import numpy
import pytest

from cuflash2 import reference, testing
from finite_differences import finite_difference_grads  # tests/ helper
from naive_attention import naive_attention
from naive_attention import random_inputs as _inputs

FP16 = numpy.dtype(numpy.float16)
BF16 = numpy.dtype(ml_dtypes.bfloat16)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size)
FORWARD_CASES = [
    (1, 1, 1, 1, 1, 8, False, (-1, -1)),
    (2, 5, 5, 2, 2, 8, False, (-1, -1)),
    (2, 5, 5, 2, 2, 8, True, (-1, -1)),
    (1, 3, 7, 2, 2, 4, True, (-1, -1)),  # sq < sk: row 0 sees keys 0..4
    (1, 7, 3, 2, 2, 4, True, (-1, -1)),  # sq > sk: rows 0..3 see no key
    (1, 7, 3, 2, 2, 4, False, (-1, -1)),
    (2, 6, 5, 6, 2, 8, False, (-1, -1)),  # GQA
    (2, 6, 5, 6, 2, 8, True, (-1, -1)),
    (1, 5, 6, 4, 1, 8, True, (-1, -1)),  # MQA
    (1, 9, 9, 2, 1, 4, False, (2, 1)),  # sliding window
    (1, 9, 9, 2, 2, 4, False, (0, 0)),  # each row sees exactly its diagonal key
    (1, 5, 9, 2, 2, 4, False, (1, -1)),
    (1, 9, 5, 2, 2, 4, False, (-1, 1)),  # rows far above the diagonal see nothing
    (1, 9, 5, 2, 2, 4, False, (1, 0)),
    (1, 9, 9, 3, 3, 4, True, (3, 2)),  # causal cuts the window's right side to 0
    (1, 9, 9, 3, 3, 4, True, (3, -1)),
    (1, 6, 6, 2, 2, 4, False, (-1, 0)),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
@pytest.mark.parametrize("compute_dtype", [numpy.float64, numpy.float32])
def test_forward_matches_naive(case, compute_dtype):
    batch, sq, sk, nheads, nheads_kv, headdim, causal, window = case
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, headdim, seed=sum(case[:6]))
    out, lse = reference.attention(
        q, k, v, causal=causal, window_size=window, return_lse=True, compute_dtype=compute_dtype
    )
    want_out, want_lse = naive_attention(q, k, v, causal, window_size=window)
    tol = 1e-12 if compute_dtype == numpy.float64 else 1e-5
    assert out.dtype == compute_dtype and out.shape == q.shape
    assert lse.dtype == numpy.float32 and lse.shape == (batch, nheads, sq)
    numpy.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    # lse is float32 whatever the compute dtype; inf entries compare equal exactly.
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_causal_is_window_right_zero():
    q, k, v = _inputs(2, 7, 9, 4, 2, 8, seed=3)
    causal = reference.attention(q, k, v, causal=True)
    numpy.testing.assert_array_equal(causal, reference.attention(q, k, v, window_size=(-1, 0)))
    both = reference.attention(q, k, v, causal=True, window_size=(2, 5))
    numpy.testing.assert_array_equal(both, reference.attention(q, k, v, window_size=(2, 0)))


def test_keyless_rows_give_zero_and_inf():
    # sq > sk, causal: row i sees keys j <= i - 4, so rows 0..3 see none.
    q, k, v = _inputs(2, 7, 3, 2, 1, 8, seed=4)
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert numpy.all(out[:, :4] == 0)
    assert numpy.all(lse[:, :, :4] == math.inf)
    assert numpy.all(numpy.isfinite(lse[:, :, 4:]))
    assert numpy.all(numpy.abs(out[:, 4:]) > 0)


@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_k_zero(causal):
    q, k, v = _inputs(2, 5, 0, 4, 2, 8)
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 5, 4, 8) and numpy.all(out == 0)
    assert lse.shape == (2, 4, 5) and numpy.all(lse == math.inf)


@pytest.mark.parametrize("shape", [(0, 5, 6), (2, 0, 6), (0, 0, 0)])
def test_empty_shapes(shape):
    batch, sq, sk = shape
    q, k, v = _inputs(batch, sq, sk, 4, 2, 8)
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == numpy.float32
    assert lse.shape == (batch, 4, sq)
    grads = reference.attention_backward(out, q, k, v, out, lse, causal=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_unbatched_input():
    q, k, v = _inputs(1, 6, 5, 6, 2, 8, seed=5)
    batched_out, batched_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    out, lse = reference.attention(q[0], k[0], v[0], causal=True, return_lse=True)
    assert out.shape == (6, 6, 8) and lse.shape == (6, 6)
    numpy.testing.assert_array_equal(out, batched_out[0])
    numpy.testing.assert_array_equal(lse, batched_lse[0])
    dout = _inputs(1, 6, 6, 6, 6, 8, seed=6)[0][0]
    grads = reference.attention_backward(dout, q[0], k[0], v[0], out, lse, causal=True)
    batched = reference.attention_backward(dout[None], q, k, v, None, None, causal=True)
    for grad, batched_grad in zip(grads, batched):
        numpy.testing.assert_array_equal(grad, batched_grad[0])


def test_softmax_scale():
    q, k, v = _inputs(1, 5, 6, 2, 2, 8, seed=7)
    # Default is 1/sqrt(headdim).
    numpy.testing.assert_array_equal(
        reference.attention(q, k, v), reference.attention(q, k, v, softmax_scale=8**-0.5)
    )
    for scale in (0.1, 2.5):
        out = reference.attention(q, k, v, softmax_scale=scale, compute_dtype=numpy.float64)
        want, _ = naive_attention(q, k, v, softmax_scale=scale)
        numpy.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_gqa_head_mapping():
    # Query head h must read KV head h // 3: make each KV head's values a distinct constant, so
    # with one key per row the output of head h is exactly that constant.
    q, k, _ = _inputs(1, 2, 1, 6, 2, 4)
    v = numpy.zeros((1, 1, 2, 4))
    v[:, :, 1] = 1.0
    out = reference.attention(q, k, v)
    numpy.testing.assert_array_equal(out[0, :, :, 0], [[0, 0, 0, 1, 1, 1]] * 2)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_inputs(dtype, causal):
    q, k, v = _inputs(2, 9, 11, 4, 2, 16, dtype=dtype, seed=8)
    assert q.dtype == dtype
    want, want_lse = naive_attention(q, k, v, causal)  # the inputs' exact values, in float64
    ref_hi, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert ref_hi.dtype == numpy.float32
    numpy.testing.assert_allclose(ref_hi, want, rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)

    ref_lo, lse_lo = reference.attention(
        q, k, v, causal=causal, return_lse=True, compute_dtype=dtype
    )
    assert ref_lo.dtype == dtype and ref_lo.shape == q.shape
    assert lse_lo.dtype == numpy.float32
    lo_error = numpy.abs(ref_lo.astype(numpy.float64) - want).max()
    eps = float(ml_dtypes.finfo(dtype).eps)
    # The low-precision reference rounds several times: its error is real but a few ulps.
    assert 0 < lo_error < 8 * eps


def test_low_precision_rounds_intermediates():
    # Rounding only the output would leave ref_lo == round(ref_hi); rounding the scores and P too
    # must make them differ somewhere.
    q, k, v = _inputs(1, 64, 64, 2, 2, 32, dtype=FP16, seed=9)
    ref_hi = reference.attention(q, k, v)
    ref_lo = reference.attention(q, k, v, compute_dtype=FP16)
    assert numpy.any(ref_lo != ref_hi.astype(FP16))


def test_compute_dtype_float32_matches_float64():
    q, k, v = _inputs(2, 17, 13, 4, 2, 16, dtype=BF16, seed=10)
    out32 = reference.attention(q, k, v, causal=True)
    out64 = reference.attention(q, k, v, causal=True, compute_dtype=numpy.float64)
    assert out64.dtype == numpy.float64
    numpy.testing.assert_allclose(out32, out64, rtol=1e-5, atol=1e-5)


def test_batch_chunking_matches(monkeypatch):
    q, k, v = _inputs(5, 6, 7, 4, 2, 8, seed=11)
    dout = _inputs(5, 6, 6, 4, 4, 8, seed=12)[0]
    whole = reference.attention(q, k, v, causal=True, return_lse=True)
    whole_grads = reference.attention_backward(dout, q, k, v, None, None, causal=True)
    monkeypatch.setattr(reference, "_MAX_SCORES_PER_CHUNK", 2 * 4 * 6 * 7)  # 2 batch entries
    chunked = reference.attention(q, k, v, causal=True, return_lse=True)
    chunked_grads = reference.attention_backward(dout, q, k, v, None, None, causal=True)
    for got, want in zip(chunked + chunked_grads, whole + whole_grads):
        numpy.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 4, 2, 8), (1, 4, 3, 8), (1, 4, 3, 8)),  # 2 heads not a multiple of 3
        ((1, 4, 2, 8), (1, 4, 2, 4), (1, 4, 2, 4)),  # head dims differ
        ((1, 4, 2, 8), (1, 4, 2, 8), (1, 5, 2, 8)),  # k, v differ
        ((2, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)),  # batch differs
        ((4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)),  # ndim differs
    ],
)
def test_shape_errors(shapes):
    q, k, v = (numpy.zeros(shape, numpy.float32) for shape in shapes)
    with pytest.raises(ValueError):
        reference.attention(q, k, v)


def test_bad_compute_dtype():
    q, k, v = _inputs(1, 2, 2, 1, 1, 8)
    with pytest.raises(ValueError):
        reference.attention(q, k, v, compute_dtype=numpy.int32)


# --------------------------------------------------------------------------------------------
# Backward: against float64 central finite differences of sum(out * dout).

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size)
BACKWARD_CASES = [
    (1, 3, 3, 2, 2, 4, False, (-1, -1)),
    (2, 3, 4, 2, 2, 4, True, (-1, -1)),
    (1, 5, 3, 2, 2, 4, True, (-1, -1)),  # rows 0, 1 see no key: zero dq there
    (1, 3, 4, 4, 2, 4, True, (-1, -1)),  # GQA
    (1, 4, 3, 3, 1, 4, False, (-1, -1)),  # MQA
    (1, 5, 5, 2, 1, 4, False, (1, 1)),  # window
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=str)
def test_backward_matches_finite_differences(case):
    batch, sq, sk, nheads, nheads_kv, headdim, causal, window = case
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, headdim, seed=sum(case[:6]))
    dout = _inputs(batch, sq, sq, nheads, nheads, headdim, seed=99)[0]
    options = dict(causal=causal, window_size=window)
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    grads = reference.attention_backward(
        dout, q, k, v, out, lse, compute_dtype=numpy.float64, **options
    )
    want = finite_difference_grads(dout, q, k, v, **options)
    for name, got, expected, x in zip("qkv", grads, want, (q, k, v)):
        assert got.dtype == numpy.float64 and got.shape == x.shape, name
        numpy.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=f"d{name}")


def test_backward_keyless_rows_are_zero():
    q, k, v = _inputs(1, 6, 3, 2, 2, 8, seed=13)
    dout = _inputs(1, 6, 6, 2, 2, 8, seed=14)[0]
    dq, dk, dv = reference.attention_backward(dout, q, k, v, None, None, causal=True)
    # Rows 0..2 see no key. (Row 3 sees one key, so its softmax is constant and dq is 0 too.)
    assert numpy.all(dq[:, :3] == 0) and numpy.all(dq[:, 4:] != 0)
    assert numpy.all(numpy.isfinite(dk)) and numpy.all(numpy.isfinite(dv))
    # With seqlen_k = 0 there is nothing to differentiate but dq, and it is zero.
    dq, dk, dv = reference.attention_backward(dout, q, k[:, :0], v[:, :0], None, None)
    assert numpy.all(dq == 0) and dk.shape == (1, 0, 2, 8) and dv.shape == (1, 0, 2, 8)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_backward_low_precision(dtype):
    q, k, v = _inputs(2, 9, 12, 4, 2, 16, dtype=dtype, seed=15)
    dout = _inputs(2, 9, 9, 4, 4, 16, dtype=dtype, seed=16)[0]
    grads_hi = reference.attention_backward(dout, q, k, v, None, None, causal=True)
    grads_64 = reference.attention_backward(
        dout, q, k, v, None, None, causal=True, compute_dtype=numpy.float64
    )
    grads_lo = reference.attention_backward(
        dout, q, k, v, None, None, causal=True, compute_dtype=dtype
    )
    eps = float(ml_dtypes.finfo(dtype).eps)
    for hi, exact, lo in zip(grads_hi, grads_64, grads_lo):
        assert hi.dtype == numpy.float32 and lo.dtype == dtype
        numpy.testing.assert_allclose(hi, exact, rtol=1e-4, atol=1e-5)
        lo_error = numpy.abs(lo.astype(numpy.float64) - exact).max()
        assert 0 < lo_error < 16 * eps * max(1.0, numpy.abs(exact).max())


def test_backward_shape_errors():
    q, k, v = _inputs(1, 4, 5, 2, 2, 8)
    with pytest.raises(ValueError):
        reference.attention_backward(q[:, :3], q, k, v, None, None)
    with pytest.raises(ValueError):
        reference.attention_backward(q, q, k, v, None, numpy.zeros((1, 4, 2)))


# --------------------------------------------------------------------------------------------
# cuflash2.testing


def _flash_like_forward(q, k, v, causal, block_n=16, bug=None):
    """What a correct FA2 kernel computes, simulated in NumPy (MHA, batched).

    fp32 scores, online softmax over key blocks, unnormalised P rounded to the input dtype
    before P @ V, row sums kept in fp32, one rounding of the output. ``bug`` injects a mistake
    the rule must catch.
    """
    dtype = q.dtype
    qf, kf, vf = (x.astype(numpy.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    seqlen_q, seqlen_k = qf.shape[2], kf.shape[2]
    scale = numpy.float32(1 / math.sqrt(qf.shape[-1]))
    row_max = numpy.full(qf.shape[:3] + (1,), -numpy.inf, numpy.float32)
    row_sum = numpy.zeros_like(row_max)
    acc = numpy.zeros(qf.shape, numpy.float32)
    rows = numpy.arange(seqlen_q)[:, None]
    shift = seqlen_k - seqlen_q + (1 if bug == "causal_off_by_one" else 0)
    for start in range(0, seqlen_k, block_n):
        cols = numpy.arange(start, min(start + block_n, seqlen_k))[None, :]
        scores = qf @ kf[:, :, cols[0]].swapaxes(-1, -2) * scale
        if causal:
            scores = numpy.where(cols <= rows + shift, scores, -numpy.inf)
        new_max = numpy.maximum(row_max, scores.max(-1, keepdims=True))
        safe_max = numpy.where(new_max == -numpy.inf, 0, new_max)
        probs = numpy.exp(scores - safe_max)
        rescale = numpy.exp(row_max - safe_max)
        if bug == "no_rescale":
            rescale = numpy.ones_like(rescale)
        row_sum = row_sum * rescale + probs.sum(-1, keepdims=True)
        probs_lowp = probs.astype(dtype).astype(numpy.float32)
        acc = acc * rescale + probs_lowp @ vf[:, :, cols[0]]
        row_max = new_max
    out = acc / numpy.where(row_sum == 0, 1, row_sum)
    return out.transpose(0, 2, 1, 3).astype(dtype)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1, 1), (17, 17), (97, 97), (40, 130), (130, 40)], ids=str)
def test_rule_accepts_flash_like_implementation(dtype, causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 2, 2, 32, dtype=dtype, seed=seqlen_q + seqlen_k)
    out = _flash_like_forward(q, k, v, causal)
    [result] = testing.check_forward(q, k, v, out, causal=causal)
    assert result.ok, result


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bug", ["causal_off_by_one", "no_rescale"])
def test_rule_rejects_buggy_implementation(dtype, bug):
    q, k, v = _inputs(2, 97, 97, 2, 2, 32, dtype=dtype, seed=17)
    out = _flash_like_forward(q, k, v, causal=True, bug=bug)
    [result] = testing.check_forward(q, k, v, out, causal=True)
    assert not result.ok, result


def test_check_close_bound_and_verdict():
    ref_hi = numpy.array([1.0, -2.0, 0.5], numpy.float32)
    ref_lo = numpy.array([1.0, -2.0, 0.5 + 0.01], numpy.float32)
    bound = 2 * 0.01 + 1e-3
    ok = testing.check_close("x", ref_hi + [0.0, 0.02, 0.0], ref_hi, ref_lo, atol=1e-3)
    assert ok.ok and ok.name == "x"
    assert ok.bound == pytest.approx(bound, rel=1e-5) and ok.max_err == pytest.approx(0.02)
    bad = testing.check_close("x", ref_hi + [0.0, 0.0, 0.022], ref_hi, ref_lo, atol=1e-3)
    assert not bad.ok and "FAIL" in str(bad)
    with pytest.raises(ValueError):
        testing.check_close("x", ref_hi[:2], ref_hi, ref_lo)


def test_check_close_nan_and_empty():
    ref = numpy.ones(4, numpy.float32)
    poisoned = testing.poison_like(numpy, (4,), FP16)
    result = testing.check_close("out", poisoned, ref, ref.astype(FP16))
    assert not result.ok and math.isnan(result.max_err)
    one_nan = ref.astype(FP16)
    one_nan[2] = numpy.nan
    assert not testing.check_close("out", one_nan, ref, ref.astype(FP16)).ok
    empty = numpy.zeros((0, 3), BF16)
    result = testing.check_close("out", empty, empty.astype(numpy.float32), empty)
    assert result.ok and result.max_err == 0 and result.bound == testing.default_atol(BF16)


def test_check_close_bf16_defaults_atol():
    ref_hi = numpy.linspace(-1, 1, 7, dtype=numpy.float32)
    out = ref_hi.astype(BF16)
    result = testing.check_close("out", out, ref_hi, out)
    assert result.ok
    assert result.bound == pytest.approx(2 * result.max_err + 2**-7)


def test_default_atol():
    assert testing.default_atol(FP16) == 2**-10
    assert testing.default_atol(BF16) == 2**-7
    assert testing.default_atol(numpy.float32) < 1e-4
    with pytest.raises(ValueError):
        testing.default_atol(numpy.int8)


def test_lse_close():
    ref = numpy.array([[1.0, math.inf, 3.0]], numpy.float32)
    assert testing.lse_close(ref.copy(), ref).ok
    assert testing.lse_close(ref + numpy.float32(1e-4), ref).ok
    assert not testing.lse_close(ref + numpy.float32(0.1), ref).ok
    finite_for_inf = numpy.array([[1.0, 50.0, 3.0]], numpy.float32)
    assert not testing.lse_close(finite_for_inf, ref).ok
    inf_for_finite = numpy.array([[math.inf, math.inf, 3.0]], numpy.float32)
    assert not testing.lse_close(inf_for_finite, ref).ok
    nan = numpy.array([[math.nan, math.inf, 3.0]], numpy.float32)
    assert not testing.lse_close(nan, ref).ok
    assert testing.lse_close(numpy.zeros((2, 0)), numpy.zeros((2, 0))).ok


def test_random_qkv():
    q, k, v = testing.random_qkv(numpy, 2, 5, 7, 6, 2, 8, BF16, seed=1)
    assert q.shape == (2, 5, 6, 8) and k.shape == v.shape == (2, 7, 2, 8)
    assert q.dtype == k.dtype == v.dtype == BF16
    assert q.flags.c_contiguous and numpy.all(numpy.isfinite(q.astype(numpy.float32)))
    assert 0.5 < numpy.std(k.astype(numpy.float32)) < 1.5  # standard normal, never zeros
    again = testing.random_qkv(numpy, 2, 5, 7, 6, 2, 8, BF16, seed=1)
    other = testing.random_qkv(numpy, 2, 5, 7, 6, 2, 8, BF16, seed=2)
    assert all(numpy.array_equal(a, b) for a, b in zip((q, k, v), again))
    assert not numpy.array_equal(q, other[0])
    unbatched = testing.random_qkv(numpy, None, 5, 7, 6, 2, 8, FP16, seed=1)
    assert [x.shape for x in unbatched] == [(5, 6, 8), (7, 2, 8), (7, 2, 8)]


@pytest.mark.parametrize("dtype", [FP16, BF16, numpy.dtype(numpy.float32)], ids=str)
def test_poison_like(dtype):
    poisoned = testing.poison_like(numpy, (2, 3), dtype)
    assert poisoned.shape == (2, 3) and poisoned.dtype == dtype
    assert numpy.all(numpy.isnan(poisoned.astype(numpy.float32)))


def test_check_backward_accepts_reference_and_rejects_perturbed():
    q, k, v = _inputs(1, 9, 12, 4, 2, 16, dtype=FP16, seed=18)
    dout = _inputs(1, 9, 9, 4, 4, 16, dtype=FP16, seed=19)[0]
    exact = reference.attention_backward(
        dout, q, k, v, None, None, causal=True, compute_dtype=numpy.float64
    )
    grads = [g.astype(FP16) for g in exact]
    assert all(r.ok for r in testing.check_backward(dout, q, k, v, *grads, causal=True))
    grads[1] = grads[1] * FP16.type(1.1)
    results = testing.check_backward(dout, q, k, v, *grads, causal=True)
    assert [r.ok for r in results] == [True, False, True]


def test_check_varlen_backward_accepts_reference_and_rejects_perturbed():
    lengths_q, lengths_k = [5, 0, 9], [7, 3, 12]
    q = _inputs(1, sum(lengths_q), 1, 4, 2, 16, dtype=FP16, seed=20)[0][0]
    k, v = (x[0] for x in _inputs(1, 1, sum(lengths_k), 4, 2, 16, dtype=FP16, seed=21)[1:])
    dout = _inputs(1, sum(lengths_q), 1, 4, 2, 16, dtype=FP16, seed=22)[0][0]
    args = (numpy.cumsum([0] + lengths_q).astype(numpy.int32),
            numpy.cumsum([0] + lengths_k).astype(numpy.int32), max(lengths_q), max(lengths_k))
    exact = reference.attention_varlen_backward(
        dout, q, k, v, None, None, *args, causal=True, compute_dtype=numpy.float64
    )
    grads = [g.astype(FP16) for g in exact]
    results = testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True)
    assert [r.name for r in results] == ["dq", "dk", "dv"] and all(r.ok for r in results)
    grads[2] = grads[2] * FP16.type(1.1)
    results = testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True)
    assert [r.ok for r in results] == [True, True, False]


def test_mixed_input_dtypes_are_refused():
    """One input dtype, as the kernels take (a mix was computed without a word)."""
    rng = numpy.random.default_rng(0)
    q = rng.standard_normal((1, 4, 2, 8)).astype(numpy.float16)
    with pytest.raises(TypeError, match=r"k must have the same dtype as q \(float16\); got float32"):
        reference.attention(q, q.astype(numpy.float32), q)
    with pytest.raises(TypeError, match=r"v must have the same dtype as q"):
        reference.attention_backward(q, q, q, q.astype(numpy.float32), None, None)
