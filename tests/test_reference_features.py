"""CPU tests of the reference's flash-attn features: softcap, ALiBi, dropout given its mask,
variable length (NumPy only: no CuPy, no GPU)."""

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


def _slopes(shape, seed=0):
    # Geometric like ALiBi's (2^-8h/H) but distinct per batch entry when 2-D.
    rng = numpy.random.default_rng(seed)
    return (rng.uniform(0.05, 0.8, size=shape)).astype(numpy.float32)


def _mask(shape, dropout_p, seed=0):
    return numpy.random.default_rng(seed).random(shape) >= dropout_p


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size)
CASES = [
    (2, 5, 5, 2, 2, 8, False, (-1, -1)),
    (1, 3, 7, 2, 2, 4, True, (-1, -1)),  # sq < sk
    (1, 7, 3, 2, 2, 4, True, (-1, -1)),  # sq > sk: rows 0..3 see no key
    (1, 7, 3, 2, 2, 4, False, (-1, -1)),
    (2, 6, 5, 6, 2, 8, False, (-1, -1)),  # GQA
    (2, 5, 6, 6, 3, 8, True, (-1, -1)),  # GQA, causal
    (1, 5, 6, 4, 1, 8, True, (-1, -1)),  # MQA
    (1, 9, 9, 2, 1, 4, False, (2, 1)),  # sliding window
    (1, 5, 9, 2, 2, 4, False, (1, -1)),
    (1, 9, 5, 2, 2, 4, False, (-1, 1)),
    (1, 9, 9, 3, 3, 4, True, (3, 2)),  # causal + window
]

# name -> options builder (batch, nheads, sq, sk) -> (reference kwargs, naive kwargs)
FEATURES = {
    "softcap": lambda b, h, sq, sk: (dict(softcap=0.7), dict(softcap=0.7)),
    "alibi_h": lambda b, h, sq, sk: (
        dict(alibi_slopes=_slopes((h,), 1)),
        dict(slopes=numpy.broadcast_to(_slopes((h,), 1), (b, h))),
    ),
    "alibi_bh": lambda b, h, sq, sk: (
        dict(alibi_slopes=_slopes((b, h), 2)), dict(slopes=_slopes((b, h), 2))
    ),
    "softcap_alibi": lambda b, h, sq, sk: (
        dict(softcap=1.3, alibi_slopes=_slopes((b, h), 3)),
        dict(softcap=1.3, slopes=_slopes((b, h), 3)),
    ),
    "dropout": lambda b, h, sq, sk: (
        dict(dropout_p=0.3, dropout_mask=_mask((b, h, sq, sk), 0.3, 4)),
        dict(dropout_p=0.3, keep=_mask((b, h, sq, sk), 0.3, 4)),
    ),
    "all": lambda b, h, sq, sk: (
        dict(softcap=0.9, alibi_slopes=_slopes((h,), 5), dropout_p=0.25,
             dropout_mask=_mask((b, h, sq, sk), 0.25, 6)),
        dict(softcap=0.9, slopes=numpy.broadcast_to(_slopes((h,), 5), (b, h)), dropout_p=0.25,
             keep=_mask((b, h, sq, sk), 0.25, 6)),
    ),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_naive(case, feature):
    batch, sq, sk, nheads, nheads_kv, headdim, causal, window = case
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, headdim, seed=sum(case[:6]))
    options, naive_options = FEATURES[feature](batch, nheads, sq, sk)
    out, lse = reference.attention(
        q, k, v, causal=causal, window_size=window, return_lse=True,
        compute_dtype=numpy.float64, **options,
    )
    want_out, want_lse = naive_attention(q, k, v, causal, window, **naive_options)
    assert out.dtype == numpy.float64 and out.shape == q.shape
    assert lse.dtype == numpy.float32 and lse.shape == (batch, nheads, sq)
    numpy.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    # float32 agrees too.
    out32 = reference.attention(q, k, v, causal=causal, window_size=window, **options)
    assert out32.dtype == numpy.float32
    numpy.testing.assert_allclose(out32, want_out, rtol=1e-5, atol=1e-5)


def test_softcap_bounds_scores_and_large_cap_is_off():
    q, k, v = _inputs(1, 6, 7, 2, 2, 8, seed=20)
    # With a huge scale the plain softmax is one-hot; a cap of 2 keeps every score in [-2, 2],
    # so lse <= 2 + log(seqlen_k).
    _, lse = reference.attention(q, k, v, softmax_scale=50.0, softcap=2.0, return_lse=True,
                                 compute_dtype=numpy.float64)
    assert numpy.all(lse <= 2 + math.log(7) + 1e-6)
    _, plain_lse = reference.attention(q, k, v, softmax_scale=50.0, return_lse=True)
    assert numpy.all(plain_lse > 2 + math.log(7))
    # softcap -> inf is the identity.
    plain = reference.attention(q, k, v, compute_dtype=numpy.float64)
    capped = reference.attention(q, k, v, softcap=1e6, compute_dtype=numpy.float64)
    numpy.testing.assert_allclose(capped, plain, rtol=1e-9, atol=1e-9)


def test_alibi_slope_shapes_and_zero_slopes():
    q, k, v = _inputs(3, 5, 8, 4, 2, 8, seed=21)
    slopes = _slopes((4,), 7)
    per_head = reference.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    tiled = reference.attention(
        q, k, v, causal=True, alibi_slopes=numpy.tile(slopes, (3, 1)), return_lse=True
    )
    for got, want in zip(tiled, per_head):
        numpy.testing.assert_array_equal(got, want)
    # (b, h) picks row b for batch entry b.
    rows = _slopes((3, 4), 8)
    both = reference.attention(q, k, v, alibi_slopes=rows)
    for b in range(3):
        single = reference.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], alibi_slopes=rows[b])
        numpy.testing.assert_array_equal(both[b:b + 1], single)
    # Zero slopes add -0: bit-identical to no ALiBi.
    zero = reference.attention(q, k, v, alibi_slopes=numpy.zeros(4, numpy.float32))
    numpy.testing.assert_array_equal(zero, reference.attention(q, k, v))


def test_alibi_unbatched():
    q, k, v = _inputs(1, 5, 7, 4, 2, 8, seed=22)
    slopes = _slopes((4,), 9)
    batched = reference.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    for shape in [(4,), (1, 4)]:
        out, lse = reference.attention(
            q[0], k[0], v[0], alibi_slopes=slopes.reshape(shape), return_lse=True
        )
        numpy.testing.assert_array_equal(out, batched[0][0])
        numpy.testing.assert_array_equal(lse, batched[1][0])


def test_alibi_is_relative_to_bottom_right_diagonal():
    # One query row, sq < sk, non-causal: keys far from the diagonal key sk - 1 get less weight.
    # With q = 0 all raw scores are 0, so P is exactly softmax(-slope * |sk - 1 - j|).
    q = numpy.zeros((1, 1, 1, 5))
    k = numpy.ones((1, 5, 1, 5))
    v = numpy.zeros((1, 5, 1, 5))
    v[0, :, 0, :] = numpy.eye(5)
    probs = reference.attention(q, k, v, alibi_slopes=numpy.array([0.5], numpy.float32),
                                compute_dtype=numpy.float64)[0, 0, 0]
    want = numpy.exp(-0.5 * numpy.array([4, 3, 2, 1, 0]))
    numpy.testing.assert_allclose(probs, want / want.sum(), rtol=1e-12)


def test_dropout_lse_unaffected_and_mask_broadcasts():
    q, k, v = _inputs(2, 5, 6, 4, 2, 8, seed=23)
    plain, plain_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    mask = _mask((2, 4, 5, 6), 0.4, 10)
    out, lse = reference.attention(
        q, k, v, causal=True, return_lse=True, dropout_p=0.4, dropout_mask=mask
    )
    numpy.testing.assert_array_equal(lse, plain_lse)
    assert numpy.abs(out - plain).max() > 1e-2
    # An all-kept mask only rescales by 1 / (1 - p); with p = 0 it is the plain attention.
    ones = numpy.ones((1, 1, 1, 1), bool)
    scaled = reference.attention(q, k, v, causal=True, dropout_p=0.5, dropout_mask=ones,
                                 compute_dtype=numpy.float64)
    numpy.testing.assert_allclose(
        scaled, 2 * reference.attention(q, k, v, causal=True, compute_dtype=numpy.float64),
        rtol=1e-12, atol=1e-12,
    )
    numpy.testing.assert_array_equal(
        reference.attention(q, k, v, causal=True, dropout_mask=ones), plain
    )
    # Broadcast shapes: one mask shared over the batch and over the heads.
    shared = _mask((5, 6), 0.4, 11)
    got = reference.attention(q, k, v, dropout_p=0.4, dropout_mask=shared)
    full = reference.attention(
        q, k, v, dropout_p=0.4, dropout_mask=numpy.broadcast_to(shared, (2, 4, 5, 6)).copy()
    )
    numpy.testing.assert_array_equal(got, full)


def test_dropout_unbatched_mask():
    q, k, v = _inputs(1, 5, 6, 4, 2, 8, seed=24)
    mask = _mask((4, 5, 6), 0.3, 12)
    batched = reference.attention(q, k, v, dropout_p=0.3, dropout_mask=mask[None])
    out = reference.attention(q[0], k[0], v[0], dropout_p=0.3, dropout_mask=mask)
    numpy.testing.assert_array_equal(out, batched[0])


def test_batch_chunking_with_features(monkeypatch):
    q, k, v = _inputs(5, 6, 7, 4, 2, 8, seed=25)
    dout = _inputs(5, 6, 6, 4, 4, 8, seed=26)[0]
    options = dict(causal=True, softcap=1.5, alibi_slopes=_slopes((5, 4), 13), dropout_p=0.2,
                   dropout_mask=_mask((5, 4, 6, 7), 0.2, 14))
    whole = reference.attention(q, k, v, return_lse=True, **options)
    whole_grads = reference.attention_backward(dout, q, k, v, None, None, **options)
    monkeypatch.setattr(reference, "_MAX_SCORES_PER_CHUNK", 2 * 4 * 6 * 7)  # 2 batch entries
    chunked = reference.attention(q, k, v, return_lse=True, **options)
    chunked_grads = reference.attention_backward(dout, q, k, v, None, None, **options)
    for got, want in zip(chunked + chunked_grads, whole + whole_grads):
        numpy.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------------
# Low precision: the same rounding points as without features.


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_low_precision_with_features(dtype, feature):
    batch, sq, sk, nheads = 2, 9, 11, 4
    q, k, v = _inputs(batch, sq, sk, nheads, 2, 16, dtype=dtype, seed=27)
    dout = _inputs(batch, sq, sq, nheads, nheads, 16, dtype=dtype, seed=28)[0]
    options, naive_options = FEATURES[feature](batch, nheads, sq, sk)
    want, _ = naive_attention(q, k, v, True, **naive_options)
    ref_lo, lse_lo = reference.attention(
        q, k, v, causal=True, return_lse=True, compute_dtype=dtype, **options
    )
    assert ref_lo.dtype == dtype and lse_lo.dtype == numpy.float32
    eps = float(ml_dtypes.finfo(dtype).eps)
    scale = max(1.0, numpy.abs(want).max())
    lo_error = numpy.abs(ref_lo.astype(numpy.float64) - want).max()
    assert 0 < lo_error < 8 * eps * scale

    exact = reference.attention_backward(
        dout, q, k, v, None, None, causal=True, compute_dtype=numpy.float64, **options
    )
    grads_lo = reference.attention_backward(
        dout, q, k, v, None, None, causal=True, compute_dtype=dtype, **options
    )
    for lo, ex in zip(grads_lo, exact):
        assert lo.dtype == dtype
        error = numpy.abs(lo.astype(numpy.float64) - ex).max()
        assert 0 < error < 16 * eps * max(1.0, numpy.abs(ex).max())


def test_low_precision_rounds_capped_biased_scores_once():
    # Rounding the capped, biased scores (one rounding) vs. an independent simulation.
    q, k, v = _inputs(1, 7, 9, 1, 1, 16, dtype=FP16, seed=29)
    slope = numpy.float32(0.3)
    got = reference.attention(q, k, v, softcap=2.0, alibi_slopes=numpy.array([slope]),
                              compute_dtype=FP16)
    qf, kf, vf = (x[0, :, 0].astype(numpy.float32) for x in (q, k, v))
    scores = (qf @ kf.T) * numpy.float32(0.25)
    scores = numpy.float32(2.0) * numpy.tanh(scores / numpy.float32(2.0))
    rows, cols = numpy.arange(7)[:, None], numpy.arange(9)[None, :]
    scores = scores - slope * numpy.abs(rows + 2 - cols).astype(numpy.float32)
    scores = scores.astype(FP16).astype(numpy.float32)
    weights = numpy.exp(scores - scores.max(-1, keepdims=True))
    probs = (weights / weights.sum(-1, keepdims=True)).astype(FP16).astype(numpy.float32)
    want = (probs @ vf).astype(FP16)
    numpy.testing.assert_array_equal(got[0, :, 0], want)


# --------------------------------------------------------------------------------------------
# Backward: against float64 central finite differences of sum(out * dout).

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size, feature options)
BACKWARD_CASES = [
    ("softcap", (1, 3, 4, 2, 2, 4, False, (-1, -1)), dict(softcap=0.8, softmax_scale=1.0)),
    ("softcap_causal_gqa", (1, 4, 3, 4, 2, 4, True, (-1, -1)), dict(softcap=0.6)),
    ("alibi_h", (1, 4, 5, 2, 2, 4, False, (-1, -1)),
     dict(alibi_slopes=numpy.array([0.3, 0.7], numpy.float32))),
    ("alibi_bh_causal", (2, 3, 4, 2, 1, 4, True, (-1, -1)),
     dict(alibi_slopes=numpy.array([[0.2, 0.5], [0.9, 0.1]], numpy.float32))),
    ("dropout", (1, 3, 4, 2, 2, 4, False, (-1, -1)),
     dict(dropout_p=0.3, dropout_mask=_mask((1, 2, 3, 4), 0.3, 30))),
    ("softcap_alibi", (1, 4, 4, 2, 2, 4, False, (-1, -1)),
     dict(softcap=0.7, softmax_scale=1.0, alibi_slopes=numpy.array([0.4, 0.25], numpy.float32))),
    ("softcap_alibi_window", (1, 5, 4, 2, 1, 4, False, (1, 1)),
     dict(softcap=0.9, alibi_slopes=numpy.array([0.4, 0.25], numpy.float32))),
    ("dropout_causal", (1, 5, 3, 2, 2, 4, True, (-1, -1)),  # rows 0, 1 see no key
     dict(dropout_p=0.4, dropout_mask=_mask((1, 2, 5, 3), 0.4, 31))),
    ("dropout_causal_gqa", (1, 3, 4, 4, 2, 4, True, (-1, -1)),
     dict(dropout_p=0.2, dropout_mask=_mask((1, 4, 3, 4), 0.2, 32))),
    ("all", (1, 4, 5, 4, 2, 4, True, (2, -1)),
     dict(softcap=0.8, alibi_slopes=numpy.array([0.1, 0.2, 0.3, 0.4], numpy.float32),
          dropout_p=0.25, dropout_mask=_mask((1, 4, 4, 5), 0.25, 33))),
]


@pytest.mark.parametrize("name, case, features", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_backward_matches_finite_differences(name, case, features):
    batch, sq, sk, nheads, nheads_kv, headdim, causal, window = case
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, headdim, seed=sum(case[:6]))
    dout = _inputs(batch, sq, sq, nheads, nheads, headdim, seed=98)[0]
    options = dict(causal=causal, window_size=window, **features)
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    grads = reference.attention_backward(
        dout, q, k, v, out, lse, compute_dtype=numpy.float64, **options
    )
    want = finite_difference_grads(dout, q, k, v, **options)
    for grad_name, got, expected, x in zip("qkv", grads, want, (q, k, v)):
        assert got.dtype == numpy.float64 and got.shape == x.shape, grad_name
        assert numpy.abs(expected).max() > 1e-3, grad_name  # the check is not vacuous
        numpy.testing.assert_allclose(
            got, expected, rtol=1e-6, atol=1e-7, err_msg=f"{name}: d{grad_name}"
        )


def test_dropout_backward_delta_is_rowsum_dout_out():
    # dS = P * (Z * dP - D) with D = rowsum(dO * O) and O the dropped output: written out for
    # one head, it must give the reference's dq (which the finite differences above check).
    q, k, v = _inputs(1, 5, 6, 1, 1, 4, seed=34)
    dout = _inputs(1, 5, 5, 1, 1, 4, seed=35)[0]
    mask = _mask((1, 1, 5, 6), 0.3, 36)
    options = dict(dropout_p=0.3, dropout_mask=mask, softcap=1.1, causal=True)
    out = reference.attention(q, k, v, compute_dtype=numpy.float64, **options)
    dq, _, _ = reference.attention_backward(
        dout, q, k, v, out, None, compute_dtype=numpy.float64, **options
    )
    qm, km, vm, om, dom = (x[0, :, 0] for x in (q, k, v, out, dout))
    raw = qm @ km.T * 0.5
    capped = 1.1 * numpy.tanh(raw / 1.1)
    visible = numpy.arange(6)[None, :] <= numpy.arange(5)[:, None] + 1
    scores = numpy.where(visible, capped, -numpy.inf)
    probs = numpy.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    z = mask[0, 0] / 0.7
    delta = (dom * om).sum(-1, keepdims=True)
    dscores = probs * (z * (dom @ vm.T) - delta) * (1 - numpy.tanh(raw / 1.1) ** 2)
    numpy.testing.assert_allclose(dq[0, :, 0], dscores @ km * 0.5, rtol=1e-12, atol=1e-12)


def test_backward_unbatched_with_features():
    q, k, v = _inputs(1, 5, 6, 4, 2, 8, seed=37)
    dout = _inputs(1, 5, 5, 4, 4, 8, seed=38)[0]
    slopes = _slopes((4,), 15)
    mask = _mask((4, 5, 6), 0.2, 16)
    options = dict(causal=True, softcap=2.0, alibi_slopes=slopes, dropout_p=0.2)
    batched = reference.attention_backward(
        dout, q, k, v, None, None, dropout_mask=mask[None], **options
    )
    grads = reference.attention_backward(
        dout[0], q[0], k[0], v[0], None, None, dropout_mask=mask, **options
    )
    for grad, want in zip(grads, batched):
        numpy.testing.assert_array_equal(grad, want[0])


# --------------------------------------------------------------------------------------------
# Variable length: a per-sequence loop of the dense reference.


def _cu(lengths):
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


# (seqlens_q, seqlens_k): odd lengths, sq != sk both ways, empty sequences of every kind.
VARLEN_LENGTHS = [
    ([5], [7]),
    ([3, 0, 6, 4], [5, 4, 2, 0]),  # empty q; empty k (row sees no key)
    ([0, 7, 1, 0], [0, 3, 9, 2]),  # empty both; empty q with keys
]

VARLEN_OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(2, 1)),
    "causal_softcap_alibi_bh": dict(causal=True, softcap=1.2, alibi=(4,)),
    "alibi_h_window": dict(window_size=(-1, 2), alibi=()),
    "dropout_causal": dict(causal=True, dropout_p=0.3),
}


def _varlen_setup(lengths_q, lengths_k, nheads, nheads_kv, headdim, options, seed, dtype=None):
    batch = len(lengths_q)
    dtype = numpy.float64 if dtype is None else dtype
    rng_qkv = testing.random_qkv(
        numpy, None, sum(lengths_q), sum(lengths_k), nheads, nheads_kv, headdim, dtype, seed
    )
    options = dict(options)
    alibi = options.pop("alibi", None)
    if alibi is not None:
        options["alibi_slopes"] = _slopes((batch, nheads) if alibi else (nheads,), seed)
    if options.get("dropout_p"):
        shape = (batch, nheads, max(lengths_q + [0]), max(lengths_k + [0]))
        options["dropout_mask"] = _mask(shape, options["dropout_p"], seed)
    return rng_qkv, options


def _dense_options(options, b, seqlen_q, seqlen_k):
    dense = dict(options)
    slopes = dense.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        dense["alibi_slopes"] = slopes[b:b + 1]
    if "dropout_mask" in dense:
        dense["dropout_mask"] = dense["dropout_mask"][b:b + 1, :, :seqlen_q, :seqlen_k]
    return dense


@pytest.mark.parametrize("option_name", list(VARLEN_OPTIONS))
@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=str)
def test_varlen_matches_dense_loop(lengths, option_name):
    lengths_q, lengths_k = lengths
    nheads, nheads_kv, headdim = 4, 2, 8
    (q, k, v), options = _varlen_setup(
        lengths_q, lengths_k, nheads, nheads_kv, headdim, VARLEN_OPTIONS[option_name], seed=40
    )
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    dout = _inputs(None, sum(lengths_q), 0, nheads, 1, headdim, seed=41)[0]
    out, lse = reference.attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **options
    )
    grads = reference.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **options
    )
    assert out.shape == q.shape and out.dtype == numpy.float32
    assert lse.shape == (nheads, sum(lengths_q)) and lse.dtype == numpy.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    for b, (seqlen_q, seqlen_k) in enumerate(zip(lengths_q, lengths_k)):
        rows_q = slice(cu_q[b], cu_q[b + 1])
        rows_k = slice(cu_k[b], cu_k[b + 1])
        dense = _dense_options(options, b, seqlen_q, seqlen_k)
        want_out, want_lse = reference.attention(
            q[None, rows_q], k[None, rows_k], v[None, rows_k], return_lse=True, **dense
        )
        numpy.testing.assert_array_equal(out[rows_q], want_out[0])
        numpy.testing.assert_array_equal(lse[:, rows_q], want_lse[0])
        want_grads = reference.attention_backward(
            dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], None, None,
            **dense,
        )
        for grad, rows, want in zip(grads, (rows_q, rows_k, rows_k), want_grads):
            numpy.testing.assert_array_equal(grad[rows], want[0])
    # A key-less sequence (k empty) gives zeros and +inf, and gradients 0 for its rows.
    for b, (seqlen_q, seqlen_k) in enumerate(zip(lengths_q, lengths_k)):
        if seqlen_q and not seqlen_k:
            rows_q = slice(cu_q[b], cu_q[b + 1])
            assert numpy.all(out[rows_q] == 0) and numpy.all(lse[:, rows_q] == math.inf)
            assert numpy.all(grads[0][rows_q] == 0)


def test_varlen_matches_naive():
    lengths_q, lengths_k = [4, 0, 3], [6, 2, 3]
    (q, k, v), options = _varlen_setup(
        lengths_q, lengths_k, 4, 2, 8, dict(causal=True, softcap=0.9, alibi=(4,)), seed=42
    )
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    out, lse = reference.attention_varlen(
        q, k, v, cu_q, cu_k, 4, 6, return_lse=True, compute_dtype=numpy.float64, **options
    )
    for b in range(3):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want_out, want_lse = naive_attention(
            q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=True, softcap=0.9,
            slopes=options["alibi_slopes"][b:b + 1],
        )
        numpy.testing.assert_allclose(out[rows_q], want_out[0], rtol=1e-12, atol=1e-12)
        numpy.testing.assert_allclose(lse[:, rows_q], want_lse[0], rtol=1e-6, atol=1e-6)


def test_varlen_empty_batch_and_low_precision():
    q, k, v = _inputs(None, 0, 0, 4, 2, 8, dtype=BF16)
    cu = numpy.zeros(1, numpy.int32)
    out, lse = reference.attention_varlen(q, k, v, cu, cu, 0, 0, return_lse=True,
                                          compute_dtype=BF16)
    assert out.shape == (0, 4, 8) and out.dtype == BF16 and lse.shape == (4, 0)
    grads = reference.attention_varlen_backward(q, q, k, v, None, None, cu, cu, 0, 0)
    assert [g.shape for g in grads] == [(0, 4, 8), (0, 2, 8), (0, 2, 8)]
    # Low precision packs the per-sequence results unchanged.
    lengths_q, lengths_k = [3, 5], [4, 2]
    q, k, v = _inputs(None, 8, 6, 4, 2, 8, dtype=FP16, seed=43)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    out = reference.attention_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=True, compute_dtype=FP16)
    assert out.dtype == FP16
    numpy.testing.assert_array_equal(
        out[3:], reference.attention(q[3:], k[4:], v[4:], causal=True, compute_dtype=FP16)
    )


def test_varlen_max_seqlen_larger_than_needed():
    (q, k, v), _ = _varlen_setup([3, 2], [2, 4], 2, 2, 8, {}, seed=44)
    cu_q, cu_k = _cu([3, 2]), _cu([2, 4])
    mask = _mask((2, 2, 9, 9), 0.5, 45)
    tight = reference.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, dropout_p=0.5,
                                       dropout_mask=mask[:, :, :3, :4])
    loose = reference.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, dropout_p=0.5,
                                       dropout_mask=mask)
    numpy.testing.assert_array_equal(tight, loose)


# --------------------------------------------------------------------------------------------
# Validation: every error names its argument.


def _small():
    return _inputs(2, 4, 5, 4, 2, 8, seed=50)


@pytest.mark.parametrize(
    "slopes, error",
    [
        (numpy.ones(3, numpy.float32), ValueError),  # not nheads
        (numpy.ones((3, 4), numpy.float32), ValueError),  # not batch
        (numpy.ones((2, 4, 1), numpy.float32), ValueError),
        (numpy.ones(4, numpy.float64), TypeError),
        (numpy.ones(4, numpy.float16), TypeError),
        ([0.5, 0.5, 0.5, 0.5], TypeError),
    ],
    ids=["h3", "b3", "3d", "float64", "float16", "list"],
)
@pytest.mark.parametrize("backward", [False, True])
def test_bad_alibi_slopes(slopes, error, backward):
    q, k, v = _small()
    with pytest.raises(error, match="alibi_slopes"):
        if backward:
            reference.attention_backward(q, q, k, v, None, None, alibi_slopes=slopes)
        else:
            reference.attention(q, k, v, alibi_slopes=slopes)


def test_unbatched_slopes_must_not_have_a_batch_of_two():
    q, k, v = _small()
    with pytest.raises(ValueError, match="alibi_slopes"):
        reference.attention(q[0], k[0], v[0], alibi_slopes=numpy.ones((2, 4), numpy.float32))


@pytest.mark.parametrize("softcap, error", [(-1.0, ValueError), (math.nan, ValueError),
                                             (math.inf, ValueError), ("1", TypeError)])
@pytest.mark.parametrize("backward", [False, True])
def test_bad_softcap(softcap, error, backward):
    q, k, v = _small()
    with pytest.raises(error, match="softcap"):
        if backward:
            reference.attention_backward(q, q, k, v, None, None, softcap=softcap)
        else:
            reference.attention(q, k, v, softcap=softcap)


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5, math.nan])
def test_bad_dropout_p(dropout_p):
    q, k, v = _small()
    mask = numpy.ones((2, 4, 4, 5), bool)
    with pytest.raises(ValueError, match="dropout_p"):
        reference.attention(q, k, v, dropout_p=dropout_p, dropout_mask=mask)
    with pytest.raises(ValueError, match="dropout_p"):
        reference.attention_backward(q, q, k, v, None, None, dropout_p=dropout_p,
                                     dropout_mask=mask)


def test_dropout_needs_mask():
    q, k, v = _small()
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.attention_backward(q, q, k, v, None, None, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_mask"):
        cu = _cu([4])
        reference.attention_varlen(q[0], k[0, :4], v[0, :4], cu, cu, 4, 4, dropout_p=0.1)


@pytest.mark.parametrize(
    "mask, error",
    [
        (numpy.ones((2, 4, 4, 6), bool), ValueError),  # seqlen_k wrong
        (numpy.ones((3, 4, 4, 5), bool), ValueError),  # batch wrong
        (numpy.ones((2, 4, 4, 5), numpy.float32), TypeError),  # not boolean
        (numpy.ones((2, 4, 4, 5), numpy.uint8), TypeError),
    ],
    ids=["shape_sk", "shape_batch", "float32", "uint8"],
)
def test_bad_dropout_mask(mask, error):
    q, k, v = _small()
    with pytest.raises(error, match="dropout_mask"):
        reference.attention(q, k, v, dropout_p=0.2, dropout_mask=mask)


def _varlen_args():
    q, k, v = _inputs(None, 7, 9, 4, 2, 8, seed=51)
    return q, k, v, _cu([3, 4]), _cu([5, 4])


@pytest.mark.parametrize(
    "which, cu, error, pattern",
    [
        ("q", numpy.array([0, 3, 7], numpy.int64), TypeError, "cu_seqlens_q.*int32"),
        ("k", numpy.array([0, 5, 9], numpy.uint32), TypeError, "cu_seqlens_k.*int32"),
        ("q", [0, 3, 7], TypeError, "cu_seqlens_q"),
        ("q", numpy.array([0, 5, 3, 7], numpy.int32), ValueError, "cu_seqlens_q.*non-decreasing"),
        ("k", numpy.array([0, 5, 4, 9], numpy.int32), ValueError, "cu_seqlens_k.*non-decreasing"),
        ("q", numpy.array([0, 3, 6], numpy.int32), ValueError, r"cu_seqlens_q\[-1\].*q.shape"),
        ("k", numpy.array([0, 5, 10], numpy.int32), ValueError, r"cu_seqlens_k\[-1\].*k.shape"),
        ("q", numpy.array([1, 3, 7], numpy.int32), ValueError, "cu_seqlens_q.*start with 0"),
        ("q", numpy.array([[0, 3, 7]], numpy.int32), ValueError, "cu_seqlens_q.*1-D"),
        ("q", numpy.zeros(0, numpy.int32), ValueError, "cu_seqlens_q.*1-D"),
        ("k", numpy.array([0, 5, 5, 9], numpy.int32), ValueError, "same length"),
    ],
)
@pytest.mark.parametrize("backward", [False, True])
def test_bad_cu_seqlens(which, cu, error, pattern, backward):
    q, k, v, cu_q, cu_k = _varlen_args()
    if which == "q":
        cu_q = cu
    else:
        cu_k = cu
    with pytest.raises(error, match=pattern):
        if backward:
            reference.attention_varlen_backward(q, q, k, v, None, None, cu_q, cu_k, 7, 9)
        else:
            reference.attention_varlen(q, k, v, cu_q, cu_k, 7, 9)


def test_bad_varlen_arguments():
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match="max_seqlen_q"):
        reference.attention_varlen(q, k, v, cu_q, cu_k, 3, 9)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        reference.attention_varlen(q, k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        reference.attention_varlen(q, k, v, cu_q, cu_k, 4.0, 5)
    with pytest.raises(ValueError, match="q must be packed"):
        reference.attention_varlen(q[None], k, v, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match="alibi_slopes"):
        reference.attention_varlen(
            q, k, v, cu_q, cu_k, 4, 5, alibi_slopes=numpy.ones((3, 4), numpy.float32)
        )
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.attention_varlen(
            q, k, v, cu_q, cu_k, 4, 5, dropout_p=0.1,
            dropout_mask=numpy.ones((2, 4, 4, 4), bool),  # max_seqlen_k is 5
        )
    with pytest.raises(ValueError, match="softcap"):
        reference.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, softcap=-1.0)
    with pytest.raises(ValueError, match="lse"):
        reference.attention_varlen_backward(
            q, q, k, v, None, numpy.zeros((7, 4), numpy.float32), cu_q, cu_k, 4, 5
        )
    with pytest.raises(ValueError, match="dout"):
        reference.attention_varlen_backward(q[:6], q, k, v, None, None, cu_q, cu_k, 4, 5)


# --------------------------------------------------------------------------------------------
# cuflash2.testing passes the features through.


def test_check_forward_and_backward_with_features():
    q, k, v = _inputs(2, 9, 12, 4, 2, 16, dtype=FP16, seed=52)
    dout = _inputs(2, 9, 9, 4, 4, 16, dtype=FP16, seed=53)[0]
    mask = _mask((2, 4, 9, 12), 0.2, 54)
    options = dict(causal=True, softcap=3.0, alibi_slopes=_slopes((2, 4), 55), dropout_p=0.2,
                   dropout_mask=mask)
    exact, lse = reference.attention(q, k, v, compute_dtype=numpy.float64, return_lse=True,
                                     **options)
    results = testing.check_forward(q, k, v, exact.astype(FP16), lse, **options)
    assert all(r.ok for r in results), results
    # The output of another mask (or of no softcap) fails.
    other = reference.attention(q, k, v, compute_dtype=numpy.float64,
                                **dict(options, dropout_mask=_mask(mask.shape, 0.2, 56)))
    assert not testing.check_forward(q, k, v, other.astype(FP16), **options)[0].ok
    uncapped = reference.attention(q, k, v, compute_dtype=numpy.float64,
                                   **dict(options, softcap=0.0))
    assert not testing.check_forward(q, k, v, uncapped.astype(FP16), **options)[0].ok

    grads = reference.attention_backward(
        dout, q, k, v, None, None, compute_dtype=numpy.float64, **options
    )
    grads = [g.astype(FP16) for g in grads]
    assert all(r.ok for r in testing.check_backward(dout, q, k, v, *grads, **options))
    without_alibi = reference.attention_backward(
        dout, q, k, v, None, None, compute_dtype=numpy.float64,
        **dict(options, alibi_slopes=None),
    )
    results = testing.check_backward(dout, q, k, v, *(g.astype(FP16) for g in without_alibi),
                                     **options)
    assert not all(r.ok for r in results)
