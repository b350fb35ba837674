"""Packed inputs (qkv (b, s, 3, h, d) and kv (b, s, 2, h_kv, d)): the packed functions run the
same kernels on strided views of the packed array, so they must agree bitwise with the unpacked
calls (deterministic backward), write gradients into the packed layout, and copy nothing; with
the programmable modifiers and the bias too."""

import numpy
import pytest
from grids import BF16, DTYPES  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu



def _same(a, b):
    return a.shape == b.shape and bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def _randn(shape, dtype, seed):
    rng = numpy.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_matches_unpacked(dtype, batched, causal):
    shape = (2, 97, 3, 4, 64) if batched else (97, 3, 4, 64)
    qkv = _randn(shape, dtype, 1)
    q, k, v = (cupy.ascontiguousarray(qkv[..., i, :, :]) for i in range(3))
    dout = _randn(q.shape, dtype, 2)
    out, lse = cuflash2.attention_qkvpacked(qkv, causal=causal, return_lse=True)
    ref_out, ref_lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
    assert _same(out, ref_out) and bool((lse == ref_lse).all())
    dqkv = testing.poison_like(cupy, qkv.shape, dtype)
    got = cuflash2.attention_qkvpacked_backward(dout, qkv, out, lse, causal=causal,
                                                deterministic=True, dqkv=dqkv)
    assert got is dqkv
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                        deterministic=True)
    for i, g in enumerate(grads):
        assert _same(cupy.ascontiguousarray(dqkv[..., i, :, :]), g)
    # The default (atomic) mode into a fresh array: correct by the 2x rule.
    dqkv = cuflash2.attention_qkvpacked_backward(dout, qkv, out, lse, causal=causal)
    results = testing.check_backward(dout, q, k, v, *(dqkv[..., i, :, :] for i in range(3)),
                                     causal=causal)
    assert all(r.ok for r in results), [str(r) for r in results]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked_matches_unpacked_gqa(dtype, causal):
    q = _randn((2, 77, 6, 128), dtype, 3)
    kv = _randn((2, 130, 2, 2, 128), dtype, 4)
    k, v = (cupy.ascontiguousarray(kv[:, :, i]) for i in range(2))
    dout = _randn(q.shape, dtype, 5)
    out, lse = cuflash2.attention_kvpacked(q, kv, causal=causal, return_lse=True)
    ref_out, ref_lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
    assert _same(out, ref_out) and bool((lse == ref_lse).all())
    dq, dkv = cuflash2.attention_kvpacked_backward(dout, q, kv, out, lse, causal=causal,
                                                   deterministic=True)
    ref = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    assert _same(dq, ref[0])
    assert _same(cupy.ascontiguousarray(dkv[:, :, 0]), ref[1])
    assert _same(cupy.ascontiguousarray(dkv[:, :, 1]), ref[2])


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed_with_a_mask_modifier_and_a_bias_matches_unpacked(packing):
    # The programmable modifiers and the bias on the packed entry points: the unpacked call's
    # kernels on the packed array's views, bitwise (the deterministic backward, dbias last).
    dtype = BF16
    mask = cuflash2.mask_mod("kv_idx <= q_idx + 5")
    if packing == "qkv":
        qkv = _randn((2, 97, 3, 4, 64), dtype, 9)
        q, k, v = (cupy.ascontiguousarray(qkv[:, :, i]) for i in range(3))
    else:
        q = _randn((2, 77, 4, 64), dtype, 9)
        kv = _randn((2, 130, 2, 2, 64), dtype, 10)
        k, v = (cupy.ascontiguousarray(kv[:, :, i]) for i in range(2))
    bias = _randn((2, 4, q.shape[1], k.shape[1]), dtype, 11)
    dout = _randn(q.shape, dtype, 12)
    options = {"mask_mod": mask, "bias": bias}
    ref_out, ref_lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    ref = cuflash2.attention_backward(dout, q, k, v, ref_out, ref_lse, deterministic=True,
                                      **options)
    if packing == "qkv":
        out, lse = cuflash2.attention_qkvpacked(qkv, return_lse=True, **options)
        dqkv, dbias = cuflash2.attention_qkvpacked_backward(dout, qkv, out, lse,
                                                            deterministic=True, **options)
        got = [cupy.ascontiguousarray(dqkv[:, :, i]) for i in range(3)] + [dbias]
    else:
        out, lse = cuflash2.attention_kvpacked(q, kv, return_lse=True, **options)
        dq, dkv, dbias = cuflash2.attention_kvpacked_backward(dout, q, kv, out, lse,
                                                              deterministic=True, **options)
        got = [dq] + [cupy.ascontiguousarray(dkv[:, :, i]) for i in range(2)] + [dbias]
    assert _same(out, ref_out) and bool((lse == ref_lse).all())
    assert all(_same(a, b) for a, b in zip(got, ref)) and len(ref) == 4


def test_packed_shape_errors():
    qkv = _randn((1, 16, 2, 2, 64), numpy.float16, 6)  # 2 where 3 are expected
    with pytest.raises(ValueError, match="qkv must have shape"):
        cuflash2.attention_qkvpacked(qkv)
    with pytest.raises(ValueError, match="kv must have shape"):
        cuflash2.attention_kvpacked(_randn((1, 16, 2, 64), numpy.float16, 7), qkv[:, :, :1])
    good = _randn((1, 16, 3, 2, 64), numpy.float16, 8)
    out, lse = cuflash2.attention_qkvpacked(good, return_lse=True)
    with pytest.raises(ValueError, match="dqkv must be"):
        cuflash2.attention_qkvpacked_backward(out, good, out, lse, dqkv=good[:, :8])
