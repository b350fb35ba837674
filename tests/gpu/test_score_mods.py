"""softcap and ALiBi (flash-attn's `softcap`, `alibi_slopes`), forward and backward, alone and
together, with causal masks and windows, odd lengths, seqlen_q != seqlen_k, GQA/MQA, both dtypes
and both backward modes, against the reference with the 2x rule."""

import numpy
import pytest
from grids import DTYPES, seed_of  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _configs, testing  # noqa: E402

pytestmark = pytest.mark.gpu

# name -> (softcap, slopes shape: None, "heads" or "batch")
MODS = {"softcap": (2.0, None), "alibi": (0.0, "heads"), "alibi-batch": (0.0, "batch"),
        "softcap-alibi": (5.0, "heads")}
MASKS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (32, 8))}
SHAPES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_kv
    (2, 97, 97, 2, 2), (1, 255, 1023, 6, 2), (2, 300, 129, 4, 1)]


def _slopes(kind, batch, nheads, seed):
    if kind is None:
        return None
    rng = numpy.random.default_rng(seed)
    shape = (nheads,) if kind == "heads" else (batch, nheads)
    # Slopes like ALiBi's geometric series 2^(-8 i / h), spread so that the bias matters.
    return cupy.asarray(rng.uniform(0.01, 0.5, size=shape).astype(numpy.float32))


def _run(dtype, headdim, mods, mask, shape, deterministic_modes=(False, True)):
    softcap, slopes_kind = MODS[mods]
    causal, window = MASKS[mask]
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, mods, mask, str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    dout = testing.random_qkv(cupy, batch, sq, sq, h, h, headdim, dtype, seed + 1)[0]
    slopes = _slopes(slopes_kind, batch, h, seed + 2)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    out = testing.poison_like(cupy, q.shape, dtype)
    out, lse = cuflash2.attention(q, k, v, return_lse=True, out=out, **kwargs)
    results = testing.check_forward(q, k, v, out, lse, **kwargs)
    assert all(r.ok for r in results), [str(r) for r in results]
    for deterministic in deterministic_modes:
        grads = [testing.poison_like(cupy, x.shape, dtype) for x in (q, k, v)]
        dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse, **kwargs,
                                                 deterministic=deterministic, dq=grads[0],
                                                 dk=grads[1], dv=grads[2])
        results = testing.check_backward(dout, q, k, v, dq, dk, dv, **kwargs)
        assert all(r.ok for r in results), (deterministic, [str(r) for r in results])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[1]}x{s[2]}-h{s[3]}/{s[4]}" for s in SHAPES])
def test_score_mods_forward_backward(dtype, headdim, mods, mask, shape):
    _run(dtype, headdim, mods, mask, shape)


@pytest.mark.parametrize("headdim", [d for d in _configs.KERNEL_HEAD_DIMS if d not in (64, 128)])
def test_score_mods_every_head_dim(headdim):
    _run(numpy.dtype(numpy.float16), headdim, "softcap-alibi", "causal", (1, 200, 333, 4, 2))


def test_score_mods_vjp_and_packed():
    dtype = numpy.dtype(numpy.float16)
    q, k, v = testing.random_qkv(cupy, 2, 130, 130, 4, 4, 64, dtype, seed=11)
    slopes = _slopes("heads", 2, 4, 12)
    kwargs = dict(causal=True, softcap=3.0, alibi_slopes=slopes)
    out, vjp = cuflash2.attention_vjp(q, k, v, **kwargs)
    qkv = cupy.stack([q, k, v], axis=2)
    packed = cuflash2.attention_qkvpacked(qkv, **kwargs)
    assert bool((out.view(cupy.uint16) == packed.view(cupy.uint16)).all())
    dout = testing.random_qkv(cupy, 2, 130, 130, 4, 4, 64, dtype, seed=13)[0]
    dq, dk, dv = vjp(dout)
    results = testing.check_backward(dout, q, k, v, dq, dk, dv, **kwargs)
    assert all(r.ok for r in results), [str(r) for r in results]


def test_score_mods_off_is_the_plain_kernel():
    # softcap=0 and no slopes take the plain specialisation: bitwise the default call.
    q, k, v = testing.random_qkv(cupy, 1, 100, 100, 2, 2, 64, numpy.float16, seed=3)
    a = cuflash2.attention(q, k, v, softcap=0.0, alibi_slopes=None)
    b = cuflash2.attention(q, k, v)
    assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


@pytest.mark.parametrize("bad,error,match", [
    (lambda h: numpy.ones(h, numpy.float32), TypeError, "numpy array"),
    (lambda h: cupy.ones(h, cupy.float64), TypeError, "float32"),
    (lambda h: cupy.ones(h + 1, cupy.float32), ValueError, r"shape \(nheads,\) or \(batch, nheads\)"),
    (lambda h: cupy.ones((3, h), cupy.float32), ValueError, r"shape \(nheads,\) or \(batch, nheads\)"),
    (lambda h: cupy.ones(2 * h, cupy.float32)[::2], ValueError, "contiguous"),
])
def test_bad_alibi_slopes_are_rejected(bad, error, match):
    q, k, v = testing.random_qkv(cupy, 2, 16, 16, 4, 4, 64, numpy.float16, seed=1)
    with pytest.raises(error, match=match):
        cuflash2.attention(q, k, v, alibi_slopes=bad(4))


@pytest.mark.parametrize("softcap,error", [(-1.0, ValueError), (float("nan"), ValueError),
                                           (float("inf"), ValueError), ("2", TypeError),
                                           (True, TypeError)])
def test_bad_softcap_is_rejected(softcap, error):
    q, k, v = testing.random_qkv(cupy, 1, 16, 16, 2, 2, 64, numpy.float16, seed=1)
    with pytest.raises(error, match="softcap"):
        cuflash2.attention(q, k, v, softcap=softcap)
