"""The reference with a V head dim apart from Q's and K's (d_v != d_qk: DeepSeek's 192/128,
MLA's 576/512; issue 47): out and dout are (..., d_v), dq and dk shaped like q and k, dv like v,
and the softmax scale 1/sqrt(d_qk). Against the per-element oracle (naive_attention) and float64
finite differences, on the CPU."""

import numpy
import pytest

from cuflash2 import reference
from finite_differences import finite_difference_grads  # tests/ helper
from naive_attention import naive_attention


def _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, d_qk, d_v, dtype=numpy.float64):
    q = rng.standard_normal((batch, seqlen_q, nheads, d_qk)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads_kv, d_qk)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads_kv, d_v)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 64), (64, 128), (40, 8)])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (5, 2)},
                                     {"causal": True, "softcap": 4.0}])
def test_forward_takes_its_head_dim_from_v(d_qk, d_v, options):
    rng = numpy.random.default_rng(d_qk + 7 * d_v)
    q, k, v = _qkv(rng, 2, 9, 13, 4, 2, d_qk, d_v)
    out, lse = reference.attention(q, k, v, return_lse=True, compute_dtype=numpy.float64,
                                   **options)
    want_out, want_lse = naive_attention(q, k, v, **options)
    assert out.shape == (2, 9, 4, d_v)
    numpy.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)  # (lse: float32)
    # The scale is q's and k's: 1 / sqrt(d_qk), whatever V's head dim.
    same = reference.attention(q, k, v, softmax_scale=d_qk ** -0.5,
                               compute_dtype=numpy.float64, **options)
    numpy.testing.assert_allclose(out, same, rtol=1e-12, atol=1e-12)
    other = reference.attention(q, k, v, softmax_scale=d_v ** -0.5,
                                compute_dtype=numpy.float64, **options)
    assert not numpy.allclose(out, other)


def test_backward_gradients_have_their_inputs_shapes():
    rng = numpy.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 4, 5, 2, 1, 24, 8)
    dout = rng.standard_normal((1, 4, 2, 8))
    options = {"causal": True}
    dq, dk, dv = reference.attention_backward(dout, q, k, v, None, None,
                                              compute_dtype=numpy.float64, **options)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    want = finite_difference_grads(dout, q, k, v, **options)
    for got, expected in zip((dq, dk, dv), want):
        numpy.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)


def test_backward_checks_dout_against_v_head_dim():
    rng = numpy.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 4, 5, 2, 1, 24, 8)
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 4, 2, 8\)"):
        reference.attention_backward(numpy.zeros(q.shape), q, k, v, None, None)


def test_varlen_takes_its_head_dim_from_v():
    rng = numpy.random.default_rng(5)
    lengths = [3, 6]
    cu = numpy.array([0, 3, 9], numpy.int32)
    q, k, v = (x[0] for x in _qkv(rng, 1, 9, 9, 4, 2, 32, 16))
    out = reference.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                     compute_dtype=numpy.float64)
    assert out.shape == (9, 4, 16)
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = reference.attention(q[rows], k[rows], v[rows], causal=True,
                                   compute_dtype=numpy.float64)
        numpy.testing.assert_allclose(out[rows], want, rtol=1e-12, atol=1e-12)


def test_k_and_v_still_agree_but_for_the_head_dim():
    rng = numpy.random.default_rng(6)
    q, k, v = _qkv(rng, 1, 4, 5, 2, 1, 16, 8)
    with pytest.raises(ValueError, match="k and v must have the same shape but for their head"):
        reference.attention(q, k, v[:, :4])
