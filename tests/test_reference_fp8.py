"""The reference with FP8 inputs (docs/FP8_FORWARD.md), without a GPU: e4m3 q, k, v with their
descale factors attend to the dequantised values; compute_dtype "e4m3" rounds the unnormalised
probabilities to e4m3 and the output to out_dtype; the arguments' checks and messages."""

import ml_dtypes
import numpy
import pytest

from cuflash2 import fp8, reference

RNG = numpy.random.default_rng(46)
BF16 = ml_dtypes.bfloat16


def _fp8_inputs(batch=2, seqlen_q=37, seqlen_k=53, nheads=4, nheads_kv=2, d=64):
    """e4m3 bits of random q, k, v with per-(batch, KV head) factors (q's over its KV head's
    query heads), and those factors."""
    group = nheads // nheads_kv
    q = RNG.standard_normal((batch, seqlen_q, nheads, d)).astype(numpy.float32)
    k = RNG.standard_normal((batch, seqlen_k, nheads_kv, d)).astype(numpy.float32)
    v = RNG.standard_normal((batch, seqlen_k, nheads_kv, d)).astype(numpy.float32)
    q_descale = (numpy.abs(q).reshape(batch, seqlen_q, nheads_kv, group, d)
                 .max(axis=(1, 3, 4)) / fp8.E4M3_MAX).astype(numpy.float32)
    k_descale = (numpy.abs(k).max(axis=(1, 3)) / fp8.E4M3_MAX).astype(numpy.float32)
    v_descale = numpy.float32(0.01)
    bits = (fp8.quantize_e4m3(q, numpy.repeat(q_descale, group, axis=1)[:, None, :, None]),
            fp8.quantize_e4m3(k, k_descale[:, None, :, None]), fp8.quantize_e4m3(v, v_descale))
    return bits, (q_descale, k_descale, v_descale)


def _dequantised(bits, descales, group):
    q_descale, k_descale, v_descale = descales
    return (fp8.dequantize_e4m3(bits[0], numpy.repeat(q_descale, group, axis=1)[:, None, :, None],
                                numpy.float64),
            fp8.dequantize_e4m3(bits[1], k_descale[:, None, :, None], numpy.float64),
            fp8.dequantize_e4m3(bits[2], v_descale, numpy.float64))


def _call(bits, descales, **options):
    return reference.attention(*bits, qkv_dtype="e4m3", q_descale=descales[0],
                               k_descale=descales[1], v_descale=descales[2], **options)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_inputs_attend_to_their_dequantised_values(causal):
    bits, descales = _fp8_inputs()
    out, lse = _call(bits, descales, causal=causal, compute_dtype=numpy.float64, return_lse=True)
    want, want_lse = reference.attention(*_dequantised(bits, descales, 2), causal=causal,
                                         compute_dtype=numpy.float64, return_lse=True)
    assert out.dtype == numpy.float64
    numpy.testing.assert_array_equal(out, want)
    numpy.testing.assert_array_equal(lse, want_lse)
    # float8_e4m3fn arrays are e4m3 without the argument; unbatched inputs take (1, nheads_kv)
    as_float8 = [b.view(ml_dtypes.float8_e4m3fn) for b in bits]
    numpy.testing.assert_array_equal(
        reference.attention(*as_float8, q_descale=descales[0], k_descale=descales[1],
                            v_descale=descales[2], causal=causal, compute_dtype=numpy.float64),
        want)
    first = reference.attention(*(b[0] for b in bits), qkv_dtype="e4m3",
                                q_descale=descales[0][:1], k_descale=descales[1][:1],
                                v_descale=descales[2], causal=causal,
                                compute_dtype=numpy.float64)
    numpy.testing.assert_array_equal(first, want[0])


def test_e4m3_compute_rounds_the_unnormalised_probabilities_and_the_output():
    bits, descales = _fp8_inputs(batch=1, seqlen_q=5, seqlen_k=40, nheads=2, nheads_kv=1, d=16)
    hi = _call(bits, descales, compute_dtype=numpy.float64)
    lo = _call(bits, descales, compute_dtype="e4m3")
    assert lo.dtype == BF16
    assert _call(bits, descales, compute_dtype="e4m3", out_dtype=numpy.float16).dtype == (
        numpy.float16)
    # by hand: weights 256 exp(s - max) rounded to e4m3 (E4M3_P_SCALE_LOG2), divided by the
    # unrounded sum of the same
    q, k, v = (x.astype(numpy.float32) for x in _dequantised(bits, descales, 2))
    scores = numpy.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / 4.0
    weights = 256 * numpy.exp(scores - scores.max(axis=-1, keepdims=True))
    rounded = fp8.e4m3_to_float(fp8.float_to_e4m3(weights))
    assert not numpy.array_equal(rounded, weights)
    want = numpy.einsum("bhqk,bkd->bqhd", rounded / weights.sum(axis=-1, keepdims=True),
                        v[:, :, 0])
    numpy.testing.assert_allclose(lo.astype(numpy.float32), want.astype(BF16).astype(
        numpy.float32), rtol=2 ** -7, atol=1e-6)
    # e4m3's 3 mantissa bits: an error of the order of 2^-5 of the output's scale, far above
    # the float32 reference's
    error = numpy.abs(lo.astype(numpy.float64) - hi).max()
    assert 1e-4 < error < 0.1 * numpy.abs(hi).max()


def test_e4m3_probabilities_keep_their_mantissa_in_long_flat_rows():
    """P scaled by 2^8 before its e4m3 rounding (E4M3_P_SCALE_LOG2). In a long row of scores
    of spread 2 most of the softmax's mass lies in probabilities between 2^-9 and 2^-6 of the
    largest (the max ~4.4 spreads above the mean, the mass ~4 above it), where e4m3 without the
    factor (normal from 2^-6, nothing below 2^-9) keeps fewer than 3 mantissa bits; with it the
    e4m3 model's error is about a third (0.0031 against 0.0109 here)."""
    from cuflash2._configs import E4M3_P_SCALE_LOG2

    assert E4M3_P_SCALE_LOG2 == 8
    bits, descales = _fp8_inputs(batch=1, seqlen_q=8, seqlen_k=16384, nheads=1, nheads_kv=1,
                                 d=32)
    scale = 2 / numpy.sqrt(32)  # scores of spread 2
    hi = _call(bits, descales, softmax_scale=scale, compute_dtype=numpy.float64)
    lo = _call(bits, descales, softmax_scale=scale, compute_dtype="e4m3")
    q, k, v = _dequantised(bits, descales, 1)
    scores = numpy.einsum("bqhd,bkhd->bhqk", q, k) * scale
    weights = numpy.exp(scores - scores.max(axis=-1, keepdims=True))
    assert numpy.median(weights) < 2 ** -9  # the typical probability is below e4m3's least
    unscaled = fp8.e4m3_to_float(fp8.float_to_e4m3(weights))
    without = numpy.einsum("bhqk,bkhd->bqhd", unscaled / weights.sum(axis=-1, keepdims=True), v)
    error = numpy.abs(lo.astype(numpy.float64) - hi).max()
    assert error < 0.5 * numpy.abs(without - hi).max()


def test_fp8_argument_checks_name_the_argument():
    bits, descales = _fp8_inputs(batch=1, seqlen_q=3, seqlen_k=4, nheads=2, nheads_kv=1, d=16)
    with pytest.raises(TypeError, match=r"uint8: pass qkv_dtype='e4m3'"):
        reference.attention(*bits)
    with pytest.raises(ValueError, match=r"qkv_dtype must be None or 'e4m3'.*'e5m2'"):
        reference.attention(*bits, qkv_dtype="e5m2")
    floats = [b.astype(numpy.float32) for b in bits]
    with pytest.raises(TypeError, match=r"qkv_dtype='e4m3' needs q, k and v of uint8"):
        reference.attention(*floats, qkv_dtype="e4m3")
    with pytest.raises(ValueError, match=r"k_descale is for FP8 inputs"):
        reference.attention(*floats, k_descale=descales[1])
    with pytest.raises(ValueError, match=r"compute_dtype 'e4m3' is the FP8 inputs' reference"):
        reference.attention(*floats, compute_dtype="e4m3")
    with pytest.raises(TypeError, match=r"q, k and v must all be FP8"):
        reference.attention(bits[0], floats[1], bits[2], qkv_dtype="e4m3")
    with pytest.raises(ValueError, match=r"v_descale must hold positive finite factors"):
        _call(bits, (descales[0], descales[1], numpy.float32(-1.0)))
    with pytest.raises(ValueError, match=r"out_dtype must be bfloat16 or float16"):
        _call(bits, descales, compute_dtype="e4m3", out_dtype=numpy.float32)
    lse = numpy.zeros((1, 2, 3), numpy.float32)
    with pytest.raises(TypeError, match=r"q is uint8: FP8 inputs are taken by "
                                        r"reference.attention"):
        reference.attention_backward(bits[0], *bits, bits[0], lse)


@pytest.mark.parametrize("compute_dtype", [numpy.float64, "e4m3"])
def test_varlen_fp8_inputs_are_each_sequences_dense_call(compute_dtype):
    """attention_varlen on packed e4m3 bits with factors per (sequence, KV head): each
    sequence's rows are the dense reference's on that sequence with its row of the factors
    (an empty sequence included), the lse in flash-attn's (nheads, total_q) layout."""
    lengths_q, lengths_k = [5, 0, 9], [7, 3, 11]
    nheads, nheads_kv, d = 4, 2, 32
    seqs = []
    for sq, sk in zip(lengths_q, lengths_k):  # (an empty q: drawn with one row, then sliced)
        bits, descales = _fp8_inputs(1, max(sq, 1), sk, nheads, nheads_kv, d)
        seqs.append(((bits[0][:, :sq], bits[1], bits[2]), descales))
    packed = [numpy.concatenate([bits[i][0] for bits, _ in seqs]) for i in range(3)]
    q_descale, k_descale = (numpy.concatenate([descales[i] for _, descales in seqs])
                            for i in range(2))
    v_descale = seqs[0][1][2]  # one factor for every sequence
    cu_q = numpy.cumsum([0] + lengths_q).astype(numpy.int32)
    cu_k = numpy.cumsum([0] + lengths_k).astype(numpy.int32)
    out, lse = reference.attention_varlen(
        *packed, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, return_lse=True,
        qkv_dtype="e4m3", q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        compute_dtype=compute_dtype)
    for b, (bits, descales) in enumerate(seqs):
        want, want_lse = _call(bits, (descales[0], descales[1], v_descale), causal=True,
                               return_lse=True, compute_dtype=compute_dtype)
        rows = slice(cu_q[b], cu_q[b + 1])
        numpy.testing.assert_array_equal(numpy.asarray(out[rows], numpy.float64),
                                         numpy.asarray(want[0], numpy.float64))
        numpy.testing.assert_array_equal(lse[:, rows], want_lse[0])
    assert str(out.dtype) == ("bfloat16" if compute_dtype == "e4m3" else "float64")
    with pytest.raises(TypeError, match=r"uint8: pass qkv_dtype='e4m3'"):
        reference.attention_varlen(*packed, cu_q, cu_k, max(lengths_q), max(lengths_k))
    with pytest.raises(ValueError, match=r"q_descale must be a float32 array of shape"):
        reference.attention_varlen(*packed, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                   qkv_dtype="e4m3", q_descale=q_descale[:2])
