"""CPU tests of the reference's programmable attention (issue 44): an additive ``bias`` with its
gradient ``dbias``, a dense boolean ``mask``, and a Python ``score_mod`` / ``score_mod_grad``;
and of cuflash2.testing's dbias check (NumPy only: no CuPy, no GPU)."""

import math

import ml_dtypes
import numpy
import pytest

from cuflash2 import _validate, reference, testing
from finite_differences import central_difference  # tests/ helper
from naive_attention import random_inputs as _inputs

F64 = numpy.float64
BF16 = numpy.dtype(ml_dtypes.bfloat16)


def _grads(dout, q, k, v, **options):
    return reference.attention_backward(dout, q, k, v, None, None, compute_dtype=F64, **options)


def _forward(q, k, v, **options):
    return reference.attention(q, k, v, return_lse=True, compute_dtype=F64, **options)


def _assert_same(got, want, rtol=1e-12, atol=1e-12):
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, index
        numpy.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"entry {index}")


def _alibi_bias(slopes, seqlen_q, seqlen_k):
    """The ALiBi bias as a dense (batch, nheads, seqlen_q, seqlen_k) float64 array."""
    i, j = numpy.arange(seqlen_q)[:, None], numpy.arange(seqlen_k)[None, :]
    distance = numpy.abs(i + seqlen_k - seqlen_q - j).astype(F64)
    return -slopes.astype(F64)[:, :, None, None] * distance


def _random(shape, seed, scale=1.0):
    return numpy.random.default_rng(seed).standard_normal(shape) * scale


# --------------------------------------------------------------------------------------------
# Equivalences: bias = ALiBi, mask = causal / window / documents, score_mod = bias / softcap.


@pytest.mark.parametrize("softcap", [0.0, 0.8])
def test_bias_equals_alibi(softcap):
    batch, sq, sk, nheads = 2, 5, 7, 4
    q, k, v = _inputs(batch, sq, sk, nheads, 2, 8, seed=1)
    dout = _inputs(batch, sq, sq, nheads, nheads, 8, seed=2)[0]
    slopes = numpy.abs(_random((batch, nheads), 3)).astype(numpy.float32)
    common = dict(causal=True, softcap=softcap)
    bias = _alibi_bias(slopes, sq, sk)
    _assert_same(_forward(q, k, v, bias=bias, **common),
                 _forward(q, k, v, alibi_slopes=slopes, **common))
    with_bias = _grads(dout, q, k, v, bias=bias, **common)
    assert len(with_bias) == 4
    _assert_same(with_bias[:3], _grads(dout, q, k, v, alibi_slopes=slopes, **common))
    # float32 compute: the same too (a float64 bias read in float32, ALiBi computed there).
    out32 = reference.attention(q, k, v, bias=bias, **common)
    numpy.testing.assert_allclose(out32, reference.attention(q, k, v, alibi_slopes=slopes,
                                                             **common), rtol=1e-5, atol=1e-6)


def _visible(sq, sk, causal=False, window=(-1, -1)):
    from naive_attention import sees
    return numpy.array([[sees(i, j, sq, sk, causal, window) for j in range(sk)]
                        for i in range(sq)])


@pytest.mark.parametrize("sq, sk, causal, window", [
    (5, 7, True, (-1, -1)), (7, 4, True, (-1, -1)), (6, 6, False, (2, 1)), (5, 8, True, (1, -1)),
])
def test_mask_equals_causal_and_window(sq, sk, causal, window):
    q, k, v = _inputs(2, sq, sk, 4, 2, 8, seed=sq * sk)
    dout = _inputs(2, sq, sq, 4, 4, 8, seed=5)[0]
    mask = _visible(sq, sk, causal, window)
    builtin = dict(causal=causal, window_size=window)
    _assert_same(_forward(q, k, v, mask=mask), _forward(q, k, v, **builtin))
    _assert_same(_grads(dout, q, k, v, mask=mask), _grads(dout, q, k, v, **builtin))
    # ANDed with the built-ins: a mask of all True changes nothing.
    _assert_same(_forward(q, k, v, mask=numpy.ones((1, 1, sq, sk), bool), **builtin),
                 _forward(q, k, v, **builtin))


def test_document_mask_equals_a_loop_over_documents():
    # Packed documents 0..2 in one sequence, causal within each document; a per-head mask too.
    doc = numpy.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    n = len(doc)
    q, k, v = _inputs(2, n, n, 2, 1, 8, seed=11)
    dout = _inputs(2, n, n, 2, 2, 8, seed=12)[0]
    positions = numpy.arange(n)
    mask = (doc[:, None] == doc[None, :]) & (positions[None, :] <= positions[:, None])
    out, lse = _forward(q, k, v, mask=mask)
    grads = _grads(dout, q, k, v, mask=mask)
    want_grads = [numpy.zeros_like(x) for x in (q, k, v)]
    for d in range(3):
        rows = slice(*numpy.flatnonzero(doc == d)[[0, -1]] + [0, 1])
        want_out, want_lse = _forward(q[:, rows], k[:, rows], v[:, rows], causal=True)
        numpy.testing.assert_allclose(out[:, rows], want_out, rtol=1e-12, atol=1e-12)
        numpy.testing.assert_allclose(lse[:, :, rows], want_lse, rtol=1e-6)
        parts = _grads(dout[:, rows], q[:, rows], k[:, rows], v[:, rows], causal=True)
        for want, part in zip(want_grads, parts):
            want[:, rows] = part
    _assert_same(grads, want_grads)


def test_keyless_rows_of_a_mask():
    q, k, v = _inputs(1, 4, 5, 2, 1, 8, seed=13)  # MQA: the mask indexes query heads
    mask = numpy.ones((2, 4, 5), bool)
    mask[0, 1] = False  # head 0, row 1 sees no key
    out, lse = _forward(q, k, v, mask=mask)
    assert numpy.all(out[0, 1, 0] == 0) and lse[0, 0, 1] == math.inf
    assert numpy.all(numpy.isfinite(lse[0, 1]))
    sinks = numpy.array([0.5, -1.0])
    out, lse = _forward(q, k, v, mask=mask, sinks=sinks)
    assert numpy.all(out[0, 1, 0] == 0) and lse[0, 0, 1] == numpy.float32(0.5)


def _table_mod(table, seqlen_k):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k - 1]
    return score_mod


def _ones(score, b, h, q_idx, kv_idx):
    return numpy.ones_like(score)


def test_relative_position_score_mod_equals_its_bias():
    batch, sq, sk, nheads = 2, 5, 6, 4
    q, k, v = _inputs(batch, sq, sk, nheads, 2, 8, seed=21)
    dout = _inputs(batch, sq, sq, nheads, nheads, 8, seed=22)[0]
    table = _random((nheads, sq + sk - 1), 23)
    i, j = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    bias = table[:, i - j + sk - 1][None]  # (1, nheads, sq, sk)
    mod = dict(score_mod=_table_mod(table, sk), score_mod_grad=_ones)
    common = dict(causal=True, softcap=0.9)
    _assert_same(_forward(q, k, v, **mod, **common), _forward(q, k, v, bias=bias, **common))
    _assert_same(_grads(dout, q, k, v, **mod, **common),
                 _grads(dout, q, k, v, bias=bias, bias_requires_grad=False, **common))


def test_softcap_score_mod_equals_softcap():
    q, k, v = _inputs(2, 5, 6, 4, 2, 8, seed=24)
    dout = _inputs(2, 5, 5, 4, 4, 8, seed=25)[0]
    cap = 0.7
    mod = dict(score_mod=lambda s, b, h, i, j: cap * numpy.tanh(s / cap),
               score_mod_grad=lambda s, b, h, i, j: 1 - numpy.tanh(s / cap) ** 2)
    common = dict(window_size=(2, 0), softmax_scale=0.8)
    _assert_same(_forward(q, k, v, **mod, **common), _forward(q, k, v, softcap=cap, **common))
    _assert_same(_grads(dout, q, k, v, **mod, **common), _grads(dout, q, k, v, softcap=cap,
                                                                **common))


def test_score_mod_sees_absolute_indices_across_batch_chunks(monkeypatch):
    # The reference chunks the batch: b is still the absolute batch index, and dbias of a bias
    # shared by the batch sums over every chunk.
    batch, sq, sk, nheads = 5, 3, 4, 2
    q, k, v = _inputs(batch, sq, sk, nheads, 1, 8, seed=26)
    dout = _inputs(batch, sq, sq, nheads, nheads, 8, seed=27)[0]
    per_batch = _random((batch, nheads, sq, sk), 28)
    bias = _random((1, nheads, sq, sk), 29)
    mod = dict(score_mod=lambda s, b, h, i, j: s + per_batch[b, h, i, j], score_mod_grad=_ones)
    whole = _grads(dout, q, k, v, bias=bias, **mod)
    monkeypatch.setattr(reference, "_MAX_SCORES_PER_CHUNK", 2 * nheads * sq * sk)
    chunked = _grads(dout, q, k, v, bias=bias, **mod)
    _assert_same(chunked, whole, rtol=1e-12, atol=1e-13)
    _assert_same(_forward(q, k, v, bias=bias, **mod), _forward(q, k, v, bias=bias + per_batch))


# --------------------------------------------------------------------------------------------
# dbias against float64 central finite differences.


def _finite_difference(loss, x, step=1e-6):
    return central_difference(loss, x, step)


# (bias shape as (batch or 1, heads or 1), nheads, nheads_kv, options)
DBIAS_CASES = {
    "full": ((2, 4), 4, 4, dict(causal=True)),
    "heads_shared": ((2, 1), 4, 2, dict(softcap=0.8)),
    "batch_shared_gqa": ((1, 4), 4, 2, dict(window_size=(1, 1))),
    "all_shared_mqa": ((1, 1), 4, 1, dict(causal=True,
                                          alibi_slopes=numpy.array([.1, .2, .3, .4],
                                                                   numpy.float32))),
    "mask_score_mod": ((2, 4), 4, 2, dict(
        mask=numpy.random.default_rng(30).random((2, 1, 4, 5)) < 0.7,
        score_mod=lambda s, b, h, i, j: s * (1 + 0.1 * h) + 0.3 * numpy.sin(s),
        score_mod_grad=lambda s, b, h, i, j: (1 + 0.1 * h) + 0.3 * numpy.cos(s))),
}


@pytest.mark.parametrize("name", list(DBIAS_CASES))
def test_dbias_matches_finite_differences(name):
    (bias_batch, bias_heads), nheads, nheads_kv, options = DBIAS_CASES[name]
    batch, sq, sk = 2, 4, 5
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, 4, seed=len(name))
    dout = _inputs(batch, sq, sq, nheads, nheads, 4, seed=31)[0]
    bias = _random((bias_batch, bias_heads, sq, sk), 32)
    grads = _grads(dout, q, k, v, bias=bias, **options)
    assert len(grads) == 4 and grads[3].shape == bias.shape and grads[3].dtype == F64

    def loss():
        return float(numpy.sum(reference.attention(q, k, v, bias=bias, compute_dtype=F64,
                                                    **options) * dout))

    for x, got in zip((bias, q, k, v), (grads[3], *grads[:3])):
        numpy.testing.assert_allclose(got, _finite_difference(loss, x), rtol=1e-6, atol=1e-7)
    assert numpy.abs(grads[3]).max() > 1e-2  # not vacuously 0
    if "mask" in options:
        mask = numpy.broadcast_to(options["mask"], (batch, nheads, sq, sk))
        assert numpy.all(grads[3][~mask] == 0)  # masked entries give 0


def test_unbatched_bias_and_its_gradient():
    q, k, v = _inputs(1, 4, 5, 2, 1, 8, seed=33)
    dout = _inputs(1, 4, 4, 2, 2, 8, seed=34)[0]
    bias = _random((1, 4, 5), 35)
    batched = _grads(dout, q, k, v, bias=bias[None], causal=True)
    for form in (bias, bias[None]):  # (nheads or 1, sq, sk), or with a leading 1
        unbatched = _grads(dout[0], q[0], k[0], v[0], bias=form, causal=True)
        _assert_same(unbatched[:3], [g[0] for g in batched[:3]])
        assert unbatched[3].shape == form.shape
        numpy.testing.assert_allclose(unbatched[3].reshape(batched[3].shape), batched[3],
                                      rtol=1e-12, atol=1e-14)


def test_bias_requires_grad_false_and_sinks_with_bias():
    q, k, v = _inputs(2, 4, 5, 2, 2, 8, seed=36)
    dout = _inputs(2, 4, 4, 2, 2, 8, seed=37)[0]
    bias = _random((2, 2, 4, 5), 38)
    sinks = numpy.array([0.3, -0.5])
    full = _grads(dout, q, k, v, bias=bias, sinks=sinks)
    assert len(full) == 5 and full[3].shape == (2,) and full[4].shape == bias.shape
    _assert_same(_grads(dout, q, k, v, bias=bias, sinks=sinks, bias_requires_grad=False),
                 full[:4])
    assert len(_grads(dout, q, k, v, bias=bias, bias_requires_grad=False)) == 3
    _assert_same(_grads(dout, q, k, v, sinks=sinks, bias=numpy.zeros((1, 1, 4, 5)))[:4],
                 _grads(dout, q, k, v, sinks=sinks))


# --------------------------------------------------------------------------------------------
# Varlen: bias and mask padded to the maxima, sequence b's block top-left.


def _cu(lengths):
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


@pytest.mark.parametrize("bias_batch", [3, 1])
def test_varlen_bias_mask_and_score_mod_equal_dense_sequences(bias_batch):
    lengths_q, lengths_k = [3, 0, 4], [4, 2, 5]
    max_q, max_k = 5, 6  # larger than the longest: padding
    nheads, nheads_kv = 4, 2
    q, k, v = testing.random_qkv(numpy, None, sum(lengths_q), sum(lengths_k), nheads, nheads_kv,
                                 8, F64, seed=40)
    dout = testing.random_qkv(numpy, None, sum(lengths_q), 1, nheads, 1, 8, F64, seed=41)[0]
    bias = _random((bias_batch, 1, max_q, max_k), 42)
    mask = numpy.random.default_rng(43).random((3, nheads, max_q, max_k)) < 0.75
    offsets = _random(3, 44)
    options = dict(bias=bias, mask=mask, causal=True, softcap=1.5,
                   score_mod=lambda s, b, h, i, j: s + offsets[b] * (i - j),
                   score_mod_grad=_ones)
    varlen = (_cu(lengths_q), _cu(lengths_k), max_q, max_k)
    out, lse = reference.attention_varlen(q, k, v, *varlen, return_lse=True, compute_dtype=F64,
                                          **options)
    grads = reference.attention_varlen_backward(dout, q, k, v, None, None, *varlen,
                                                compute_dtype=F64, **options)
    assert len(grads) == 4 and grads[3].shape == bias.shape
    dbias = numpy.zeros_like(bias)
    cu_q, cu_k = varlen[:2]
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        row = b if bias_batch > 1 else 0
        dense = dict(bias=bias[row:row + 1, :, :lq, :lk], mask=mask[b:b + 1, :, :lq, :lk],
                     causal=True, softcap=1.5,
                     score_mod=lambda s, _, h, i, j, b=b: s + offsets[b] * (i - j),
                     score_mod_grad=_ones)
        want_out, want_lse = _forward(q[None, rq], k[None, rk], v[None, rk], **dense)
        numpy.testing.assert_allclose(out[rq], want_out[0], rtol=1e-12, atol=1e-12)
        numpy.testing.assert_allclose(lse[:, rq], want_lse[0], rtol=1e-6)
        parts = _grads(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], **dense)
        for got, rows, part in zip(grads, (rq, rk, rk), parts):
            numpy.testing.assert_allclose(got[rows], part[0], rtol=1e-12, atol=1e-12)
        dbias[row:row + 1, :, :lq, :lk] += parts[3]
    numpy.testing.assert_allclose(grads[3], dbias, rtol=1e-12, atol=1e-14)
    assert numpy.all(grads[3][..., 4:, :] == 0) and numpy.all(grads[3][..., 5:] == 0)
    # The varlen check accepts the exact gradients, dbias included.
    results = testing.check_varlen_backward(dout, q, k, v, *grads[:3], *varlen, dbias=grads[3],
                                            **options)
    assert [r.name for r in results] == ["dq", "dk", "dv", "dbias"] and all(r.ok for r in results)


# --------------------------------------------------------------------------------------------
# Low precision, the dbias check, errors.


@pytest.mark.parametrize("bias_dtype", [BF16, numpy.float32])
def test_low_precision_reference_with_bias(bias_dtype):
    q, k, v = _inputs(2, 6, 7, 4, 2, 16, dtype=BF16, seed=50)
    dout = _inputs(2, 6, 6, 4, 4, 16, dtype=BF16, seed=51)[0]
    bias = _random((1, 4, 6, 7), 52).astype(bias_dtype)
    options = dict(bias=bias, causal=True)
    out = reference.attention(q, k, v, compute_dtype=BF16, **options)
    grads = reference.attention_backward(dout, q, k, v, None, None, compute_dtype=BF16,
                                         **options)
    assert out.dtype == BF16 and [g.dtype for g in grads] == [BF16] * 3 + [bias_dtype]
    # The bias is read in its own dtype: a float32 bias is not rounded to bf16 first.
    exact = reference.attention_backward(dout, q, k, v, None, None, compute_dtype=F64,
                                         bias=bias.astype(F64), causal=True)
    error = numpy.abs(grads[3].astype(F64) - exact[3]).max()
    assert 0 < error < 0.05 * numpy.abs(exact[3]).max()
    # An implementation as exact as float64 passes the check; a wrong dbias fails it.
    got = [g.astype(BF16) for g in exact[:3]] + [exact[3].astype(bias_dtype)]
    results = testing.check_backward(dout, q, k, v, *got, **options)
    assert [r.name for r in results] == ["dq", "dk", "dv", "dbias"] and all(r.ok for r in results)
    for bad in (exact[3] * 0, exact[3] * 1.25, exact[3][:, ::-1]):
        results = testing.check_backward(dout, q, k, v, *got[:3], dbias=bad.astype(bias_dtype),
                                         **options)
        assert [r.ok for r in results] == [True, True, True, False]
    assert testing.check_forward(q, k, v, out, **options)[0].ok
    # dbias is required with bias (unless bias_requires_grad=False) and refused without.
    with pytest.raises(ValueError, match="dbias"):
        testing.check_backward(dout, q, k, v, *got[:3], **options)
    with pytest.raises(ValueError, match="bias"):
        testing.check_backward(dout, q, k, v, *got, causal=True)
    assert len(testing.check_backward(dout, q, k, v, *got[:3], bias_requires_grad=False,
                                      **options)) == 3


def test_check_backward_with_sinks_and_bias():
    q, k, v = _inputs(1, 5, 6, 2, 2, 16, dtype=numpy.float16, seed=53)
    dout = _inputs(1, 5, 5, 2, 2, 16, dtype=numpy.float16, seed=54)[0]
    options = dict(bias=_random((1, 2, 5, 6), 55).astype(numpy.float16),
                   sinks=numpy.array([0.2, -0.4], numpy.float32), causal=True)
    exact = reference.attention_backward(dout, q, k, v, None, None, compute_dtype=F64, **options)
    assert len(exact) == 5 and exact[4].dtype == numpy.float16
    got = [g.astype(numpy.float16) for g in exact[:3]] + [exact[3].astype(numpy.float32),
                                                           exact[4]]
    results = testing.check_backward(dout, q, k, v, *got, **options)
    assert [r.name for r in results] == ["dq", "dk", "dv", "dsinks", "dbias"]
    assert all(r.ok for r in results)


def test_bad_arguments_are_named():
    q, k, v = _inputs(2, 4, 5, 4, 2, 8, seed=60)
    dout = q.copy()
    with pytest.raises(ValueError, match=r"bias must have shape .*\(2, 4, 4, 5\)"):
        reference.attention(q, k, v, bias=numpy.zeros((2, 2, 4, 5)))
    with pytest.raises(ValueError, match="bias must have shape"):
        reference.attention(q, k, v, bias=numpy.zeros((4, 4, 5)))  # batched call: 4 dims
    with pytest.raises(TypeError, match="bias must be a float16, bfloat16 or float32"):
        reference.attention(q, k, v, bias=numpy.zeros((1, 1, 4, 5), numpy.int32))
    with pytest.raises(TypeError, match="mask must be a boolean"):
        reference.attention(q, k, v, mask=numpy.ones((4, 5), numpy.int8))
    with pytest.raises(ValueError, match=r"mask must be broadcastable to .*\(2, 4, 4, 5\)"):
        reference.attention(q, k, v, mask=numpy.ones((3, 4, 5), bool))
    mod = lambda s, b, h, i, j: s * 2  # noqa: E731
    with pytest.raises(ValueError, match="score_mod needs score_mod_grad"):
        reference.attention_backward(dout, q, k, v, None, None, score_mod=mod)
    with pytest.raises(ValueError, match="score_mod_grad is the derivative of score_mod"):
        reference.attention(q, k, v, score_mod_grad=mod)
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        reference.attention(q, k, v, score_mod=2.0)
    with pytest.raises(ValueError, match="score_mod must return an array broadcastable"):
        reference.attention(q, k, v, score_mod=lambda s, b, h, i, j: s[..., :2])
    cu = numpy.array([0, 4], numpy.int32)
    packed = (q[0], k[0], v[0], cu, numpy.array([0, 5], numpy.int32), 4, 5)
    with pytest.raises(ValueError, match=r"max_seqlen_q, max_seqlen_k\) = \(1, 4, 4, 5\)"):
        reference.attention_varlen(*packed, bias=numpy.zeros((1, 4, 3, 5)))
    with pytest.raises(ValueError, match="score_mod needs score_mod_grad"):
        reference.attention_varlen_backward(dout[0], *packed[:3], None, None, *packed[3:],
                                            score_mod=mod)


def test_check_bias():
    shape = (2, 4, 6, 7)  # batch, nheads, seqlen_q, seqlen_k
    for bias_shape, flags in [((2, 4, 6, 7), (False, False)), ((1, 4, 6, 7), (True, False)),
                              ((2, 1, 6, 7), (False, True)), ((1, 1, 6, 7), (True, True))]:
        for dtype in (numpy.float16, BF16, numpy.float32):
            bias = numpy.zeros(bias_shape, dtype)
            assert _validate.check_bias(bias, *shape, batched=True) == flags
    assert _validate.check_bias(None, *shape, batched=True) is None
    assert _validate.check_bias(numpy.zeros((1, 6, 7), numpy.float32), 1, 4, 6, 7, False) == (
        True, True)
    assert _validate.check_bias(numpy.zeros((1, 4, 6, 7), numpy.float32), 1, 4, 6, 7, False) == (
        True, False)
    for bad in ((2, 4, 7, 6), (3, 4, 6, 7), (2, 2, 6, 7), (4, 6, 7), (1, 2, 4, 6, 7)):
        with pytest.raises(ValueError, match="bias must have shape"):
            _validate.check_bias(numpy.zeros(bad, numpy.float32), *shape, batched=True)
    with pytest.raises(TypeError, match="bias must be a float16, bfloat16 or float32 array"):
        _validate.check_bias(numpy.zeros(shape), *shape, batched=True)  # float64: kernels no
    assert _validate.check_bias(numpy.zeros(shape), *shape, batched=True, float64=True) == (
        False, False)
    with pytest.raises(TypeError, match="got list"):
        _validate.check_bias([[0.0]], *shape, batched=True)
