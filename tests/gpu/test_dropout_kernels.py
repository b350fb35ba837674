"""Dropout (`dropout_p`, `seed`, `offset`): the kernels' mask is the documented one
(cuflash2/dropout.py), keeps 1 - p of the probabilities, is the same in the forward and the
backward, and the results match the reference given that mask (2x rule), dense and varlen, with
causal masks, GQA and the score modifiers."""

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import dropout, reference, testing  # noqa: E402
from grids import DTYPES, seed_of  # noqa: E402  (tests/gpu helper)

pytestmark = pytest.mark.gpu

SHAPES = [(2, 97, 97, 2, 2), (1, 255, 300, 6, 2), (2, 130, 65, 4, 1)]


def test_kernel_mask_is_the_documented_one():
    for shape, p, seed, offset in (((2, 3, 77, 130), 0.2, 5, 0), ((1, 2, 33, 17), 0.6, 2**40 + 3, 9)):
        got = cuflash2.dropout_mask(*shape, p, seed, offset).get()
        assert (got == dropout.keep_mask(*shape, p, seed, offset)).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    mask = cuflash2.dropout_mask(4, 16, 1024, 1024, p, seed=2024)
    assert abs(float(mask.mean()) - (1 - p)) < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[1]}x{s[2]}-h{s[3]}/{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("mods", ["plain", "softcap-alibi"])
def test_dropout_matches_reference_given_the_mask(dtype, headdim, causal, shape, mods):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, causal, mods, str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    dout = testing.random_qkv(cupy, batch, sq, sq, h, h, headdim, dtype, seed + 1)[0]
    options = dict(causal=causal)
    if mods == "softcap-alibi":
        options.update(softcap=4.0, alibi_slopes=cupy.asarray(
            numpy.linspace(0.05, 0.4, h).astype(numpy.float32)))
    drop = dict(dropout_p=0.3, seed=seed, offset=3)
    mask = cuflash2.dropout_mask(batch, h, sq, sk, 0.3, seed, 3)
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options, **drop)
    results = testing.check_forward(q, k, v, out, lse, dropout_p=0.3, dropout_mask=mask, **options)
    assert all(r.ok for r in results), [str(r) for r in results]
    for deterministic in (False, True):
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                            **options, **drop)
        results = testing.check_backward(dout, q, k, v, *grads, dropout_p=0.3, dropout_mask=mask,
                                         **options)
        assert all(r.ok for r in results), (deterministic, [str(r) for r in results])


def test_dropout_is_reproducible_and_seeded():
    q, k, v = testing.random_qkv(cupy, 2, 200, 200, 4, 4, 64, numpy.float16, seed=1)
    a = cuflash2.attention(q, k, v, dropout_p=0.2, seed=11)
    b = cuflash2.attention(q, k, v, dropout_p=0.2, seed=11)
    c = cuflash2.attention(q, k, v, dropout_p=0.2, seed=11, offset=1)
    assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    assert not bool((a == c).all())
    out, vjp = cuflash2.attention_vjp(q, k, v, dropout_p=0.2)  # draws its own seed
    dq, dk, dv = vjp(testing.random_qkv(cupy, 2, 200, 200, 4, 4, 64, numpy.float16, seed=2)[0])
    assert not any(bool(cupy.isnan(g).any()) for g in (dq, dk, dv))


def test_dropout_varlen_matches_reference():
    dtype = numpy.dtype(numpy.float16)
    lengths_q, lengths_k = [97, 0, 200, 33], [120, 5, 200, 64]
    rng = numpy.random.default_rng(3)
    q = cupy.asarray(rng.standard_normal((sum(lengths_q), 4, 64)).astype(dtype))
    k = cupy.asarray(rng.standard_normal((sum(lengths_k), 2, 64)).astype(dtype))
    v = cupy.asarray(rng.standard_normal((sum(lengths_k), 2, 64)).astype(dtype))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
    cu_q = cupy.asarray(numpy.cumsum([0] + lengths_q).astype(numpy.int32))
    cu_k = cupy.asarray(numpy.cumsum([0] + lengths_k).astype(numpy.int32))
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    mask = cuflash2.dropout_mask(4, 4, max(lengths_q), max(lengths_k), 0.25, 77)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=True, dropout_p=0.25, seed=77,
                                         return_lse=True)
    ref_hi = reference.attention_varlen(q, k, v, *args, causal=True, dropout_p=0.25,
                                        dropout_mask=mask, compute_dtype=numpy.float32)
    ref_lo = reference.attention_varlen(q, k, v, *args, causal=True, dropout_p=0.25,
                                        dropout_mask=mask, compute_dtype=dtype)
    assert testing.check_close("out", out, ref_hi, ref_lo).ok
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True,
                                               dropout_p=0.25, seed=77)
    for result in testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True,
                                                dropout_p=0.25, dropout_mask=mask):
        assert result.ok, result.name


def test_dropout_needs_a_seed():
    q, k, v = testing.random_qkv(cupy, 1, 16, 16, 2, 2, 64, numpy.float16, seed=1)
    with pytest.raises(ValueError, match="needs seed"):
        cuflash2.attention(q, k, v, dropout_p=0.1)
