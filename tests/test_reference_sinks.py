"""CPU tests of the reference's attention sinks (`sinks=`, gpt-oss style: one logit a query head in
every row's softmax denominator, no value row) and of cuflash2.testing's dsinks check (NumPy
only: no CuPy, no GPU)."""

import math

import ml_dtypes
import numpy
import pytest

from cuflash2 import reference, testing
from finite_differences import finite_difference_grads  # tests/ helper
from naive_attention import random_inputs as _inputs
from naive_attention import sees
import test_reference_features as features  # tests/: the feature combinations
from test_reference_features import _mask, _slopes

FP16 = numpy.dtype(numpy.float16)
BF16 = numpy.dtype(ml_dtypes.bfloat16)


def _sinks(nheads, seed, std=1.5, dtype=numpy.float64):
    return (numpy.random.default_rng(seed).standard_normal(nheads) * std).astype(dtype)


def sink_column_attention(q, k, v, sinks, causal=False, window_size=(-1, -1), softcap=0.0,
                          slopes=None, keep=None, dropout_p=0.0):
    """(out, lse) in float64, written directly: the sink is one more logit column of every row
    (after scaling, softcap, ALiBi and masking of the key columns, none of which touches it),
    whose value row is zero; the softmax and lse run over the extended row. Batched q, k, v;
    slopes None or (batch, nheads); keep None or (batch, nheads, seqlen_q, seqlen_k)."""
    q, k, v = (numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    k = numpy.repeat(k, group, axis=2)  # query head h reads KV head h // group
    v = numpy.repeat(v, group, axis=2)
    scores = numpy.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(headdim)
    if softcap > 0:
        scores = softcap * numpy.tanh(scores / softcap)
    i, j = numpy.arange(seqlen_q)[:, None], numpy.arange(seqlen_k)[None, :]
    if slopes is not None:
        scores = scores - slopes[:, :, None, None] * numpy.abs(i + seqlen_k - seqlen_q - j)
    visible = numpy.array([[sees(a, b, seqlen_q, seqlen_k, causal, window_size)
                            for b in range(seqlen_k)] for a in range(seqlen_q)], dtype=bool)
    scores = numpy.where(visible.reshape(1, 1, seqlen_q, seqlen_k), scores, -numpy.inf)
    column = numpy.broadcast_to(numpy.asarray(sinks, numpy.float64)[None, :, None, None],
                                (batch, nheads, seqlen_q, 1))
    extended = numpy.concatenate([scores, column], axis=-1)
    top = extended.max(axis=-1, keepdims=True)
    weights = numpy.exp(extended - top)
    lse = (top + numpy.log(weights.sum(axis=-1, keepdims=True)))[..., 0]
    probs = weights / weights.sum(axis=-1, keepdims=True)
    if keep is not None:
        factor = numpy.concatenate([keep / (1 - dropout_p), numpy.ones(column.shape)], axis=-1)
        probs = probs * factor
    v_extended = numpy.concatenate([v, numpy.zeros((batch, 1, nheads, v.shape[-1]))], axis=1)
    out = numpy.einsum("bhij,bjhd->bihd", probs, v_extended)
    return out, lse


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size)
CASES = {
    "plain": (2, 5, 6, 2, 2, 8, False, (-1, -1)),
    "causal_sq<sk": (1, 3, 7, 2, 2, 4, True, (-1, -1)),
    "causal_keyless": (1, 7, 3, 2, 2, 4, True, (-1, -1)),  # rows 0..3 see no key
    "gqa": (2, 6, 5, 6, 2, 8, False, (-1, -1)),
    "gqa_causal": (2, 5, 6, 6, 3, 8, True, (-1, -1)),
    "mqa": (1, 5, 6, 4, 1, 8, True, (-1, -1)),
    "window": (1, 9, 9, 2, 1, 4, False, (2, 1)),
    "window_keyless": (1, 9, 5, 2, 2, 4, False, (-1, 1)),
}

# name -> (batch, nheads, seqlen_q, seqlen_k) -> (reference kwargs, direct-formula kwargs): the
# feature combinations of the feature tests, with the sinks beside them.
FEATURES = {"none": lambda b, h, sq, sk: ({}, {}),
            **{name: features.FEATURES[name] for name in ("softcap_alibi", "dropout")}}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_sink_column(name, feature):
    batch, sq, sk, nheads, nheads_kv, headdim, causal, window = CASES[name]
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, headdim, seed=sum(CASES[name][:6]))
    sinks = _sinks(nheads, seed=sq * sk)
    options, direct_options = FEATURES[feature](batch, nheads, sq, sk)
    out, lse = reference.attention(q, k, v, causal=causal, window_size=window, sinks=sinks,
                                   return_lse=True, compute_dtype=numpy.float64, **options)
    want_out, want_lse = sink_column_attention(q, k, v, sinks, causal, window, **direct_options)
    assert out.dtype == numpy.float64 and lse.dtype == numpy.float32
    numpy.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert numpy.all(numpy.isfinite(lse))  # a sink gives every row a finite lse
    # float32 compute, float32 sinks (the kernels' dtype) agree too.
    out32, lse32 = reference.attention(q, k, v, causal=causal, window_size=window,
                                       sinks=sinks.astype(numpy.float32), return_lse=True,
                                       **options)
    assert out32.dtype == numpy.float32
    numpy.testing.assert_allclose(out32, want_out, rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(lse32, want_lse, rtol=1e-5, atol=1e-5)


def test_output_is_the_plain_output_rescaled_by_the_lse():
    # out_with = out_without * exp(lse_without - lse_with), lse_with = logaddexp(lse_without,
    # sink): the sink only enlarges each row's denominator.
    q, k, v = _inputs(2, 6, 7, 4, 2, 8, seed=1)
    sinks = _sinks(4, seed=2, std=2.0)
    plain, plain_lse = reference.attention(q, k, v, causal=True, return_lse=True,
                                           compute_dtype=numpy.float64)
    out, lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                   compute_dtype=numpy.float64)
    numpy.testing.assert_allclose(lse, numpy.logaddexp(plain_lse, sinks[:, None]), rtol=1e-6)
    ratio = numpy.exp(plain_lse.astype(numpy.float64) - lse.astype(numpy.float64))
    numpy.testing.assert_allclose(out, plain * ratio.transpose(0, 2, 1)[..., None], rtol=1e-5,
                                  atol=1e-12)


# --------------------------------------------------------------------------------------------
# Backward: dq, dk, dv and dsinks against float64 central finite differences.

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size, options)
BACKWARD_CASES = [
    ("plain", (1, 3, 4, 2, 2, 4, False, (-1, -1)), {}),
    ("batch2_causal", (2, 3, 4, 2, 2, 4, True, (-1, -1)), {}),
    ("causal_keyless", (1, 5, 3, 2, 2, 4, True, (-1, -1)), {}),  # rows 0, 1 see no key
    ("gqa_causal", (1, 3, 4, 4, 2, 4, True, (-1, -1)), {}),
    ("mqa", (1, 4, 3, 3, 1, 4, False, (-1, -1)), {}),
    ("window", (1, 5, 5, 2, 1, 4, False, (1, 1)), {}),
    ("softcap_alibi", (1, 4, 4, 2, 2, 4, True, (-1, -1)),
     dict(softcap=0.7, softmax_scale=1.0, alibi_slopes=numpy.array([0.4, 0.25], numpy.float32))),
    ("dropout_gqa", (1, 3, 4, 4, 2, 4, False, (-1, -1)),
     dict(dropout_p=0.3, dropout_mask=_mask((1, 4, 3, 4), 0.3, 30))),
    ("all", (1, 4, 5, 4, 2, 4, True, (2, -1)),
     dict(softcap=0.8, alibi_slopes=numpy.array([0.1, 0.2, 0.3, 0.4], numpy.float32),
          dropout_p=0.25, dropout_mask=_mask((1, 4, 4, 5), 0.25, 33))),
]


def _assert_matches_finite_differences(grads, want, xs, label):
    assert len(grads) == len(want) == 4
    for name, got, expected, x in zip(("dq", "dk", "dv", "dsinks"), grads, want, xs):
        assert got.dtype == numpy.float64 and got.shape == x.shape, name
        numpy.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7,
                                      err_msg=f"{label}: {name}")
    assert numpy.abs(want[3]).max() > 1e-3  # dsinks is not vacuously 0


@pytest.mark.parametrize("name, case, features", BACKWARD_CASES,
                         ids=[c[0] for c in BACKWARD_CASES])
def test_backward_matches_finite_differences(name, case, features):
    batch, sq, sk, nheads, nheads_kv, headdim, causal, window = case
    q, k, v = _inputs(batch, sq, sk, nheads, nheads_kv, headdim, seed=sum(case[:6]))
    dout = _inputs(batch, sq, sq, nheads, nheads, headdim, seed=97)[0]
    sinks = _sinks(nheads, seed=len(name))
    options = dict(causal=causal, window_size=window, sinks=sinks, **features)
    grads = reference.attention_backward(dout, q, k, v, None, None,
                                         compute_dtype=numpy.float64, **options)
    want = finite_difference_grads(dout, q, k, v, **options)
    _assert_matches_finite_differences(grads, want, (q, k, v, sinks), name)
    # Unbatched inputs give the same gradients, dsinks included.
    if batch == 1:
        mask = features.get("dropout_mask")
        single = dict(options, dropout_mask=None if mask is None else mask[0])
        unbatched = reference.attention_backward(dout[0], q[0], k[0], v[0], None, None,
                                                 compute_dtype=numpy.float64, **single)
        for got, batched in zip(unbatched[:3], grads[:3]):
            numpy.testing.assert_array_equal(got, batched[0])
        numpy.testing.assert_array_equal(unbatched[3], grads[3])


def test_dsinks_formula():
    # dsinks_h = -sum over the rows of every batch entry of exp(sink_h - lse_i) * D_i,
    # D_i = rowsum(dO_i * O_i), with lse counting the sink (GQA: per query head).
    q, k, v = _inputs(3, 5, 6, 4, 2, 8, seed=5)
    dout = _inputs(3, 5, 5, 4, 4, 8, seed=6)[0]
    sinks = _sinks(4, seed=7)
    out, lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                   compute_dtype=numpy.float64)
    *_, dsinks = reference.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks,
                                              compute_dtype=numpy.float64)
    delta = (dout * out).sum(axis=-1).transpose(0, 2, 1)  # (batch, nheads, seqlen_q)
    want = -(numpy.exp(sinks[:, None] - lse.astype(numpy.float64)) * delta).sum(axis=(0, 2))
    numpy.testing.assert_allclose(dsinks, want, rtol=1e-5)


def _cu(lengths):
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(softcap=0.9, alibi_slopes=_slopes((3, 4), 8), window_size=(1, 1)),
], ids=["causal", "softcap_alibi_window"])
def test_varlen_backward_matches_finite_differences(options):
    # Sequence 1 has no keys (its rows: out 0, lse = sink), sequence 2 no queries.
    lengths_q, lengths_k = [3, 2, 0], [4, 0, 2]
    q, k, v = testing.random_qkv(numpy, None, 5, 6, 4, 2, 4, numpy.float64, seed=9)
    dout = testing.random_qkv(numpy, None, 5, 1, 4, 1, 4, numpy.float64, seed=10)[0]
    sinks = _sinks(4, seed=11)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    varlen = (cu_q, cu_k, 3, 4)
    options = dict(options, sinks=sinks)
    grads = reference.attention_varlen_backward(dout, q, k, v, None, None, *varlen,
                                                compute_dtype=numpy.float64, **options)

    def forward(q, k, v, **kwargs):
        return reference.attention_varlen(q, k, v, *varlen, **kwargs)

    want = finite_difference_grads(dout, q, k, v, forward=forward, **options)
    _assert_matches_finite_differences(grads, want, (q, k, v, sinks), "varlen")
    out, lse = reference.attention_varlen(q, k, v, *varlen, return_lse=True, **options)
    assert numpy.all(out[3:5] == 0)
    numpy.testing.assert_array_equal(lse[:, 3:5], numpy.repeat(sinks[:, None], 2, axis=1)
                                     .astype(numpy.float32))
    # dsinks sums the sequences' dsinks (each a dense call).
    per_sequence = [
        reference.attention_backward(dout[None, rq], q[None, rq], k[None, rk], v[None, rk],
                                     None, None, compute_dtype=numpy.float64,
                                     **dict(options, alibi_slopes=options["alibi_slopes"][b:b + 1])
                                     if "alibi_slopes" in options else options)[3]
        for b, (rq, rk) in enumerate([(slice(0, 3), slice(0, 4)), (slice(3, 5), slice(4, 4))])
    ]
    numpy.testing.assert_allclose(grads[3], sum(per_sequence), rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------
# Limits: -inf is no sink, rows that see no key, a very large sink.


def test_minus_inf_sinks_are_no_sinks():
    q, k, v = _inputs(2, 7, 5, 4, 2, 8, seed=12)
    dout = _inputs(2, 7, 7, 4, 4, 8, seed=13)[0]
    none = numpy.full(4, -numpy.inf, numpy.float32)
    for dtype in (numpy.float32, numpy.float64, FP16, BF16):
        options = dict(causal=True, softcap=2.0, alibi_slopes=_slopes((4,), 14),
                       compute_dtype=dtype)
        plain = reference.attention(q, k, v, return_lse=True, **options)
        with_sinks = reference.attention(q, k, v, return_lse=True, sinks=none, **options)
        for got, want in zip(with_sinks, plain):
            numpy.testing.assert_array_equal(got, want)
        grads = reference.attention_backward(dout, q, k, v, None, None, **options)
        *sink_grads, dsinks = reference.attention_backward(dout, q, k, v, None, None,
                                                           sinks=none, **options)
        for got, want in zip(sink_grads, grads):
            numpy.testing.assert_array_equal(got, want)
        assert numpy.all(dsinks == 0)
    # Varlen and decoding too (rows that see no key keep lse = +inf).
    cu = _cu([7])
    got = reference.attention_varlen(q[0], k[0, :5], v[0, :5], cu, _cu([5]), 7, 5, causal=True,
                                     return_lse=True, sinks=none)
    want = reference.attention_varlen(q[0], k[0, :5], v[0, :5], cu, _cu([5]), 7, 5, causal=True,
                                      return_lse=True)
    for a, b in zip(got, want):
        numpy.testing.assert_array_equal(a, b)
    assert numpy.all(got[1][:, :2] == math.inf)


@pytest.mark.parametrize("dtype", [numpy.float64, numpy.float32, FP16, BF16], ids=str)
def test_keyless_rows_give_zero_and_the_sink(dtype):
    q, k, v = _inputs(2, 8, 3, 4, 2, 8, seed=15)
    dout = _inputs(2, 8, 8, 4, 4, 8, seed=16)[0]
    sinks = numpy.array([-3.0, 0.0, 0.75, 20.0], numpy.float32)  # exact in fp16 and bf16
    for options in (dict(causal=True), dict(window_size=(-1, 1))):  # rows 0..4 / 0..3 keyless
        keyless = 5 if options.get("causal") else 4
        out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True,
                                       compute_dtype=dtype, **options)
        assert numpy.all(out[:, :keyless].astype(numpy.float32) == 0)
        assert numpy.all(lse[:, :, :keyless] == sinks[:, None])
        assert numpy.all(lse[:, :, keyless:] >= sinks[:, None])  # rows with keys: no smaller
        assert numpy.all(lse[:, :2, keyless:] > sinks[:2, None])
        dq, _, _, dsinks = reference.attention_backward(dout, q, k, v, out, lse, sinks=sinks,
                                                        compute_dtype=dtype, **options)
        assert numpy.all(dq[:, :keyless].astype(numpy.float32) == 0)
        assert numpy.all(numpy.isfinite(dsinks))
    # seqlen_k = 0: every row is key-less.
    out, lse = reference.attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True,
                                   compute_dtype=dtype)
    assert numpy.all(out.astype(numpy.float32) == 0)
    assert numpy.all(lse == sinks[:, None])
    grads = reference.attention_backward(dout, q, k[:, :0], v[:, :0], None, None, sinks=sinks,
                                         compute_dtype=dtype)
    assert numpy.all(grads[0].astype(numpy.float32) == 0) and numpy.all(grads[3] == 0)


def test_a_very_large_sink_drives_the_output_to_zero():
    q, k, v = _inputs(1, 6, 9, 4, 2, 8, seed=17)
    dout = _inputs(1, 6, 6, 4, 4, 8, seed=18)[0]
    sinks = numpy.array([1e4, 60.0, -1e4, 0.0], numpy.float32)
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True,
                                   compute_dtype=numpy.float64)
    plain, plain_lse = reference.attention(q, k, v, return_lse=True, compute_dtype=numpy.float64)
    assert numpy.all(out[:, :, 0] == 0) and numpy.all(lse[:, 0] == sinks[0])  # exp(-1e4) = 0
    assert numpy.abs(out[:, :, 1]).max() < 1e-20 and numpy.all(lse[:, 1] == sinks[1])
    numpy.testing.assert_array_equal(out[:, :, 2], plain[:, :, 2])  # exp(-1e4 - lse) = 0
    assert numpy.abs(out[:, :, 3] - plain[:, :, 3]).max() > 1e-3  # a sink of 0 does count
    dq, dk, dv, dsinks = reference.attention_backward(dout, q, k, v, out, lse, sinks=sinks,
                                                      compute_dtype=numpy.float64)
    assert numpy.all(dq[:, :, 0] == 0) and abs(dsinks[0]) == 0 and abs(dsinks[1]) < 1e-20
    assert numpy.all(numpy.isfinite(dk)) and numpy.all(numpy.isfinite(dv))
    assert dsinks[2] == 0 and dsinks[3] != 0


# --------------------------------------------------------------------------------------------
# Low precision: the sink is rounded like the scores.


def test_low_precision_rounds_the_sink_like_the_scores():
    q, k, v = _inputs(1, 7, 9, 1, 1, 16, dtype=FP16, seed=19)
    sink = numpy.float32(1.2345678)  # not an fp16 value
    got, lse = reference.attention(q, k, v, sinks=numpy.array([sink]), return_lse=True,
                                   compute_dtype=FP16)
    qf, kf, vf = (x[0, :, 0].astype(numpy.float32) for x in (q, k, v))
    scores = ((qf @ kf.T) * numpy.float32(0.25)).astype(FP16).astype(numpy.float32)
    sink16 = numpy.float32(numpy.float16(sink))
    top = numpy.maximum(scores.max(-1, keepdims=True), sink16)
    total = numpy.exp(scores - top).sum(-1, keepdims=True) + numpy.exp(sink16 - top)
    probs = (numpy.exp(scores - top) / total).astype(FP16).astype(numpy.float32)
    numpy.testing.assert_array_equal(got[0, :, 0], (probs @ vf).astype(FP16))
    numpy.testing.assert_allclose(lse[0, 0], (top + numpy.log(total))[:, 0], rtol=1e-6)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_low_precision_with_sinks(dtype):
    q, k, v = _inputs(2, 9, 11, 4, 2, 16, dtype=dtype, seed=20)
    dout = _inputs(2, 9, 9, 4, 4, 16, dtype=dtype, seed=21)[0]
    sinks = _sinks(4, seed=22, dtype=numpy.float32)
    options = dict(causal=True, sinks=sinks)
    exact = reference.attention(q, k, v, compute_dtype=numpy.float64, **options)
    low = reference.attention(q, k, v, compute_dtype=dtype, **options)
    eps = float(ml_dtypes.finfo(dtype).eps)
    error = numpy.abs(low.astype(numpy.float64) - exact).max()
    assert low.dtype == dtype and 0 < error < 8 * eps * max(1.0, numpy.abs(exact).max())
    exact_grads = reference.attention_backward(dout, q, k, v, None, None,
                                               compute_dtype=numpy.float64, **options)
    low_grads = reference.attention_backward(dout, q, k, v, None, None, compute_dtype=dtype,
                                             **options)
    for lo, ex in zip(low_grads[:3], exact_grads[:3]):
        assert lo.dtype == dtype
        error = numpy.abs(lo.astype(numpy.float64) - ex).max()
        assert 0 < error < 16 * eps * max(1.0, numpy.abs(ex).max())
    # dsinks stays float32 (a sum over rows, as the kernels return it), with a low-precision
    # error; in float32 compute it is float32 too.
    assert low_grads[3].dtype == numpy.float32 and exact_grads[3].dtype == numpy.float64
    error = numpy.abs(low_grads[3] - exact_grads[3]).max()
    assert 0 < error < 16 * eps * max(1.0, numpy.abs(exact_grads[3]).max())
    high = reference.attention_backward(dout, q, k, v, None, None, **options)[3]
    assert high.dtype == numpy.float32
    numpy.testing.assert_allclose(high, exact_grads[3], rtol=1e-4, atol=1e-5)


def test_batch_chunking_with_sinks(monkeypatch):
    q, k, v = _inputs(5, 6, 7, 4, 2, 8, seed=23)
    dout = _inputs(5, 6, 6, 4, 4, 8, seed=24)[0]
    options = dict(causal=True, softcap=1.5, sinks=_sinks(4, seed=25))
    whole = reference.attention(q, k, v, return_lse=True, **options)
    whole_grads = reference.attention_backward(dout, q, k, v, None, None, **options)
    monkeypatch.setattr(reference, "_MAX_SCORES_PER_CHUNK", 2 * 4 * 6 * 7)  # 2 batch entries
    chunked = reference.attention(q, k, v, return_lse=True, **options)
    chunked_grads = reference.attention_backward(dout, q, k, v, None, None, **options)
    for got, want in zip(chunked + chunked_grads[:3], whole + whole_grads[:3]):
        numpy.testing.assert_array_equal(got, want)
    numpy.testing.assert_allclose(chunked_grads[3], whole_grads[3], rtol=1e-6)  # summed apart


# --------------------------------------------------------------------------------------------
# Decoding with a KV cache.


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_with_sinks_equals_dense_on_the_visible_rows(paged):
    rng = numpy.random.default_rng(26)
    batch, capacity, h, hk, d, seqlen_q, seqlen_new, page = 3, 64, 8, 2, 16, 2, 2, 16
    q = rng.standard_normal((batch, seqlen_q, h, d)).astype(numpy.float32)
    k_cache = rng.standard_normal((batch, capacity, hk, d)).astype(numpy.float32)
    v_cache = rng.standard_normal((batch, capacity, hk, d)).astype(numpy.float32)
    k_new = rng.standard_normal((batch, seqlen_new, hk, d)).astype(numpy.float32)
    v_new = rng.standard_normal((batch, seqlen_new, hk, d)).astype(numpy.float32)
    cached = numpy.array([40, 0, 61], numpy.int32)
    sinks = _sinks(h, seed=27, dtype=numpy.float32)
    logical_k, logical_v = k_cache.copy(), v_cache.copy()
    for b in range(batch):
        logical_k[b, cached[b]:cached[b] + seqlen_new] = k_new[b]
        logical_v[b, cached[b]:cached[b] + seqlen_new] = v_new[b]
    kwargs = dict(k=k_new, v=v_new, cache_seqlens=cached, sinks=sinks, return_lse=True)
    if paged:  # pages in reverse order
        pages = batch * capacity // page
        table = numpy.arange(pages)[::-1].reshape(batch, capacity // page).astype(numpy.int32)
        k_run = numpy.zeros((pages, page, hk, d), numpy.float32)
        v_run = numpy.zeros_like(k_run)
        for b in range(batch):
            for j in range(capacity // page):
                k_run[table[b, j]] = k_cache[b, j * page:(j + 1) * page]
                v_run[table[b, j]] = v_cache[b, j * page:(j + 1) * page]
        kwargs["block_table"] = table
    else:
        k_run, v_run = k_cache.copy(), v_cache.copy()
    for mask in (dict(causal=True), dict(window_size=(8, 0)), dict()):
        out, lse = reference.attention_with_kvcache(q, k_run.copy(), v_run.copy(), **kwargs,
                                                    **mask)
        for b in range(batch):
            n = cached[b] + seqlen_new
            want, want_lse = reference.attention(q[b], logical_k[b, :n], logical_v[b, :n],
                                                 sinks=sinks, return_lse=True, **mask)
            numpy.testing.assert_array_equal(out[b], want)
            numpy.testing.assert_array_equal(lse[b], want_lse)
    # -inf sinks are the plain decode.
    plain = reference.attention_with_kvcache(q, k_run.copy(), v_run.copy(),
                                             **dict(kwargs, sinks=None))
    none = reference.attention_with_kvcache(q, k_run.copy(), v_run.copy(),
                                            **dict(kwargs, sinks=numpy.full(h, -numpy.inf)))
    for a, b in zip(plain, none):
        numpy.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# Validation: errors name `sinks`.

BAD_SINKS = {
    "nheads+1": (numpy.zeros(5, numpy.float32), ValueError),
    "nheads_kv": (numpy.zeros(2, numpy.float32), ValueError),
    "2d": (numpy.zeros((1, 4), numpy.float32), ValueError),
    "batch_heads": (numpy.zeros((2, 4), numpy.float32), ValueError),
    "scalar": (numpy.float32(0.5), ValueError),
    "int32": (numpy.zeros(4, numpy.int32), TypeError),
    "bool": (numpy.zeros(4, bool), TypeError),
    "complex": (numpy.zeros(4, numpy.complex64), TypeError),
    "list": ([0.0, 0.0, 0.0, 0.0], TypeError),
    "float": (0.5, TypeError),
}


@pytest.mark.parametrize("entry", ["attention", "backward", "varlen", "varlen_backward",
                                   "kvcache"])
@pytest.mark.parametrize("bad", list(BAD_SINKS))
def test_bad_sinks_are_named(bad, entry):
    sinks, error = BAD_SINKS[bad]
    q, k, v = _inputs(2, 4, 5, 4, 2, 8, seed=28)
    cu_q, cu_k = _cu([4, 4]), _cu([5, 5])
    calls = {
        "attention": lambda: reference.attention(q, k, v, sinks=sinks),
        "backward": lambda: reference.attention_backward(q, q, k, v, None, None, sinks=sinks),
        "varlen": lambda: reference.attention_varlen(
            q.reshape(8, 4, 8), k.reshape(10, 2, 8), v.reshape(10, 2, 8), cu_q, cu_k, 4, 5,
            sinks=sinks),
        "varlen_backward": lambda: reference.attention_varlen_backward(
            q.reshape(8, 4, 8), q.reshape(8, 4, 8), k.reshape(10, 2, 8), v.reshape(10, 2, 8),
            None, None, cu_q, cu_k, 4, 5, sinks=sinks),
        "kvcache": lambda: reference.attention_with_kvcache(q, k, v, sinks=sinks),
    }
    with pytest.raises(error, match="sinks"):
        calls[entry]()


def test_sinks_of_every_float_dtype_are_accepted():
    q, k, v = _inputs(1, 4, 5, 4, 2, 8, seed=29)
    values = numpy.array([0.5, -1.0, 2.0, 0.25])  # exact in every float dtype
    want = reference.attention(q, k, v, sinks=values.astype(numpy.float32))
    for dtype in (numpy.float64, FP16, BF16):
        numpy.testing.assert_array_equal(
            reference.attention(q, k, v, sinks=values.astype(dtype)), want)


# --------------------------------------------------------------------------------------------
# cuflash2.testing: sinks in the options, dsinks judged by the rule.


def test_check_forward_with_sinks():
    q, k, v = _inputs(2, 9, 12, 4, 2, 16, dtype=FP16, seed=30)
    sinks = _sinks(4, seed=31, dtype=numpy.float32)
    options = dict(causal=True, sinks=sinks)
    exact, lse = reference.attention(q, k, v, compute_dtype=numpy.float64, return_lse=True,
                                     **options)
    results = testing.check_forward(q, k, v, exact.astype(FP16), lse, **options)
    assert [r.name for r in results] == ["out", "lse"] and all(r.ok for r in results)
    # Without the sink (or with the sink counted twice in lse) it fails.
    plain, plain_lse = reference.attention(q, k, v, causal=True, compute_dtype=numpy.float64,
                                           return_lse=True)
    results = testing.check_forward(q, k, v, plain.astype(FP16), plain_lse, **options)
    assert not results[0].ok and not results[1].ok
    twice = numpy.logaddexp(lse, sinks[None, :, None])
    assert not testing.check_forward(q, k, v, exact.astype(FP16), twice, **options)[1].ok


def test_check_backward_judges_dsinks():
    q, k, v = _inputs(2, 9, 12, 4, 2, 16, dtype=BF16, seed=32)
    dout = _inputs(2, 9, 9, 4, 4, 16, dtype=BF16, seed=33)[0]
    sinks = _sinks(4, seed=34, dtype=numpy.float32)
    options = dict(causal=True, softcap=3.0, sinks=sinks)
    dq, dk, dv, dsinks = reference.attention_backward(dout, q, k, v, None, None,
                                                      compute_dtype=numpy.float64, **options)
    grads = [g.astype(BF16) for g in (dq, dk, dv)] + [dsinks.astype(numpy.float32)]
    results = testing.check_backward(dout, q, k, v, *grads, **options)
    assert [r.name for r in results] == ["dq", "dk", "dv", "dsinks"] and all(r.ok for r in results)
    assert results[3].bound < numpy.abs(dsinks).max() / 8  # the check is not vacuous
    for bad in (dsinks * 0, -dsinks, dsinks[::-1], dsinks * 1.25):
        results = testing.check_backward(dout, q, k, v, *grads[:3], bad.astype(numpy.float32),
                                         **options)
        assert [r.ok for r in results] == [True, True, True, False]
    # dsinks is required with sinks, and refused without.
    with pytest.raises(ValueError, match="dsinks"):
        testing.check_backward(dout, q, k, v, *grads[:3], **options)
    with pytest.raises(ValueError, match="sinks"):
        testing.check_backward(dout, q, k, v, *grads, causal=True)
    # A given dsinks_atol replaces the default slack.
    loose = testing.check_backward(dout, q, k, v, *grads[:3], dsinks * 0, dsinks_atol=1e3,
                                   **options)
    assert loose[3].ok


def test_check_varlen_backward_judges_dsinks():
    lengths_q, lengths_k = [5, 0, 9, 4], [7, 3, 12, 0]
    q = _inputs(1, sum(lengths_q), 1, 4, 2, 16, dtype=FP16, seed=35)[0][0]
    k, v = (x[0] for x in _inputs(1, 1, sum(lengths_k), 4, 2, 16, dtype=FP16, seed=36)[1:])
    dout = _inputs(1, sum(lengths_q), 1, 4, 2, 16, dtype=FP16, seed=37)[0][0]
    args = (_cu(lengths_q), _cu(lengths_k), max(lengths_q), max(lengths_k))
    sinks = _sinks(4, seed=38, dtype=numpy.float32)
    exact = reference.attention_varlen_backward(dout, q, k, v, None, None, *args, causal=True,
                                                sinks=sinks, compute_dtype=numpy.float64)
    grads = [g.astype(FP16) for g in exact[:3]]
    results = testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True,
                                            sinks=sinks, dsinks=exact[3].astype(numpy.float32))
    assert [r.name for r in results] == ["dq", "dk", "dv", "dsinks"] and all(r.ok for r in results)
    # Sequence 0's rows left out of dsinks: caught.
    first = reference.attention_backward(dout[None, :5], q[None, :5], k[None, :7], v[None, :7],
                                         None, None, causal=True, sinks=sinks,
                                         compute_dtype=numpy.float64)[3]
    results = testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True,
                                            sinks=sinks,
                                            dsinks=(exact[3] - first).astype(numpy.float32))
    assert [r.ok for r in results] == [True, True, True, False]


def test_dsinks_tolerance_layouts_agree():
    # Dense batched, unbatched and varlen layouts give the slack of the same rows.
    q, k, v = _inputs(1, 6, 7, 4, 2, 8, seed=39)
    dout = _inputs(1, 6, 6, 4, 4, 8, seed=40)[0]
    sinks = _sinks(4, seed=41, dtype=numpy.float32)
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True)
    batched = testing.dsinks_tolerance(FP16, dout, out, lse, sinks)
    unbatched = testing.dsinks_tolerance(FP16, dout[0], out[0], lse[0], sinks)
    cu = _cu([6])
    out_v, lse_v = reference.attention_varlen(q[0], k[0], v[0], cu, _cu([7]), 6, 7, sinks=sinks,
                                              return_lse=True)
    varlen = testing.dsinks_tolerance(FP16, dout[0], out_v, lse_v, sinks)
    assert batched == pytest.approx(unbatched) == pytest.approx(varlen)
    assert 0 < batched < 1e-2
    # -inf sinks (no sink): no slack beyond 0; rows without mass (lse +inf) add nothing.
    none = numpy.full(4, -numpy.inf, numpy.float32)
    _, lse_none = reference.attention(q, k, v, causal=True, sinks=none, return_lse=True)
    assert testing.dsinks_tolerance(FP16, dout, out, lse_none, none) == 0


def test_dsinks_tolerance_takes_tf32s_unit_at_precision_tf32():
    # Float32 inputs at "tf32" read D from dO rounded to TF32: the slack of a TF32 rounding
    # (2**-10, as fp16's), not float32's; "highest" keeps float32's.
    q, k, v = _inputs(1, 6, 7, 4, 2, 8, seed=42)
    dout = _inputs(1, 6, 6, 4, 4, 8, seed=43)[0]
    sinks = _sinks(4, seed=44, dtype=numpy.float32)
    q, k, v, dout = (x.astype(numpy.float32) for x in (q, k, v, dout))
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True,
                                   compute_dtype=numpy.float64)
    fp32 = numpy.dtype(numpy.float32)
    highest = testing.dsinks_tolerance(fp32, dout, out, lse, sinks)
    assert testing.dsinks_tolerance(fp32, dout, out, lse, sinks, "highest") == highest
    for precision in ("tf32", "high"):
        assert testing.dsinks_tolerance(fp32, dout, out, lse, sinks, precision) == (
            pytest.approx(highest * 2.0**-10 / testing.default_atol(fp32)))
    assert testing.dsinks_tolerance(fp32, dout, out, lse, sinks, "tf32") == pytest.approx(
        testing.dsinks_tolerance(FP16, dout, out, lse, sinks))
