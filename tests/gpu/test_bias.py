"""The additive bias (`bias=`, issue 44) and its gradient dbias on the kernels (the mma.sync
kernels with programmable modifiers, the bias as their score modifier: cuflash2._bias) against
the reference's dense bias with the 2x rule: every broadcast (full, shared by the batch, by the
heads, by both), fp16 / bf16 / fp32 biases, odd lengths, GQA / MQA, causal, with a mask and a
score modifier of the user's, unbatched, varlen, deterministic mode, bias_requires_grad=False,
an Evoformer-like pair bias, and the refusals before any launch; on sm_90 the bias as tiles on
the Hopper forward and, without dbias, on the Hopper backward."""

import numpy
import pytest
from grids import BF16, DTYPES, FP16, needs_hopper, seed_of, varlen_inputs  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_kv
    (2, 97, 97, 2, 2), (1, 255, 300, 6, 2), (2, 300, 129, 4, 1)]
#: The bias's (batch, heads) dims: full, shared by the batch, by the heads, by both.
BROADCASTS = ["full", "batch", "heads", "both"]


def _bias(shape, broadcast, dtype, seed):
    batch, sq, sk, h, _ = shape
    b = 1 if broadcast in ("batch", "both") else batch
    hh = 1 if broadcast in ("heads", "both") else h
    rng = numpy.random.default_rng(seed + 7)
    return cupy.asarray(rng.standard_normal((b, hh, sq, sk)).astype(dtype))


def _dout(q, seed):
    return cupy.asarray(numpy.random.default_rng(seed + 2).standard_normal(q.shape)
                        .astype(q.dtype))


def _ok(results):
    assert all(r.ok for r in results), [str(r) for r in results]


#: Every broadcast at bf16 d=128, one each at the other (dtype, head dim) points: each case
#: compiles its own forward and two backward kernels.
HOPPER_TILE_CASES = ([(BF16, 128, b) for b in BROADCASTS]
                     + [(FP16, 64, "heads"), (FP16, 96, "full"), (BF16, 64, "batch"),
                        (FP16, 128, "both"), (BF16, 96, "heads")])


@needs_hopper
@pytest.mark.parametrize("dtype, headdim, broadcast", HOPPER_TILE_CASES,
                         ids=[f"{'bf16' if d == BF16 else 'fp16'}-{h}-{b}"
                              for d, h, b in HOPPER_TILE_CASES])
def test_hopper_kernels_with_bias_tiles(dtype, headdim, broadcast):
    # On sm_90 a bias alone of q's dtype (rows of whole 16 bytes) runs on the Hopper forward as
    # tiles (FEATURE_BIAS_TILE: TMA loads with V, the add from shared memory), and on the Hopper
    # backward (loads with Q_i, the add to S^T), without its gradient (bias_requires_grad=False)
    # and with it (dbias copied from the dS tiles). Odd query rows and a key tail, GQA, causal with the batch-broadcast one, a mask
    # modifier with the head one, the backward's deterministic mode with the full one.
    shape = (2, 700, 456, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "bias-tiles", str(dtype), broadcast)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    bias = _bias(shape, broadcast, dtype, seed)
    causal = broadcast == "batch"
    options = {"bias": bias, "causal": causal}
    ref = {"bias": bias, "causal": causal}
    if broadcast == "heads":
        options["mask_mod"] = cuflash2.mask_mod("kv_idx + 300 > q_idx")
        qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
        ref["mask"] = cupy.asarray(ki + 300 > qi)
    (kernel,) = cuflash2.forward_kernels(q, k, v, **options)
    assert kernel.startswith("Hopper forward") and "bias tiles" in kernel, kernel
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    _ok(testing.check_forward(q, k, v, out, lse, **ref))

    deterministic = broadcast == "full"
    dout = _dout(q, seed)
    backward = {**options, "bias_requires_grad": False, "deterministic": deterministic}
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, **backward)
    assert any(k.startswith("Hopper backward") and "bias tiles" in k for k in kernels), kernels
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, **backward)
    assert len(grads) == 3
    _ok(testing.check_backward(dout, q, k, v, *grads, **ref, bias_requires_grad=False))

    # dbias from the dS tiles: stores for the full bias, vector reductions where it broadcasts.
    backward["bias_requires_grad"] = True
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, **backward)
    assert any("bias tiles" in k and "dbias" in k for k in kernels), kernels
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, **backward)
    assert len(grads) == 4 and grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    _ok(testing.check_backward(dout, q, k, v, *grads, **ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("broadcast", BROADCASTS)
def test_bias_forward_and_backward(dtype, headdim, shape, broadcast):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "bias", str(dtype), broadcast)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    # fp32 biases with the broadcast ones, the inputs' dtype with the full one
    bias_dtype = dtype if broadcast == "full" else numpy.float32
    bias = _bias(shape, broadcast, bias_dtype, seed)
    causal = broadcast in ("heads", "both")
    out, lse = cuflash2.attention(q, k, v, bias=bias, causal=causal, return_lse=True)
    _ok(testing.check_forward(q, k, v, out, lse, bias=bias, causal=causal))
    dout = _dout(q, seed)
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=causal)
    assert len(grads) == 4
    dbias = grads[3]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    _ok(testing.check_backward(dout, q, k, v, *grads, bias=bias, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_with_mask_mod_score_mod_and_alibi(dtype):
    shape = (2, 200, 233, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, "bias-mods", str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 64, dtype, seed)
    bias = _bias(shape, "batch", numpy.float32, seed)
    slopes = cupy.asarray(numpy.linspace(0.01, 0.1, h).astype(numpy.float32))
    mm = cuflash2.mask_mod("kv_idx <= q_idx + 40 || kv_idx < 16")
    # The user's score modifier takes the biased score (reference order: bias, then score_mod).
    sm = cuflash2.score_mod("12.f * tanhf(score / 12.f)",
                            grad="1.f - tanhf(score / 12.f) * tanhf(score / 12.f)")
    kwargs = dict(bias=bias, mask_mod=mm, score_mod=sm, alibi_slopes=slopes)
    out, vjp = cuflash2.attention_vjp(q, k, v, **kwargs)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    mask = cupy.asarray((ki <= qi + 40) | (ki < 16))
    ref = dict(bias=bias, mask=mask, alibi_slopes=slopes,
               score_mod=lambda s, b, hh, qx, kx: 12 * cupy.tanh(s / 12),
               score_mod_grad=lambda s, b, hh, qx, kx: 1 - cupy.tanh(s / 12) ** 2)
    lse = cuflash2.attention(q, k, v, return_lse=True, **kwargs)[1]
    _ok(testing.check_forward(q, k, v, out, lse, **ref))
    dout = _dout(q, seed)
    _ok(testing.check_backward(dout, q, k, v, *vjp(dout), **ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_unbatched_and_without_its_gradient(dtype):
    sq, sk, h, hk, d = 130, 77, 4, 4, 64
    seed = seed_of("bias-unbatched", str(dtype))
    q, k, v = testing.random_qkv(cupy, 1, sq, sk, h, hk, d, dtype, seed)
    q, k, v = q[0], k[0], v[0]
    bias = cupy.asarray(numpy.random.default_rng(seed).standard_normal((1, sq, sk))
                        .astype(numpy.float32))  # (nheads or 1, seqlen_q, seqlen_k)
    out, lse = cuflash2.attention(q, k, v, bias=bias, return_lse=True)
    _ok(testing.check_forward(q, k, v, out, lse, bias=bias))
    dout = _dout(q, seed)
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, bias=bias)
    _ok(testing.check_backward(dout, q, k, v, *grads, bias=bias))
    without = cuflash2.attention_backward(dout, q, k, v, out, lse, bias=bias,
                                          bias_requires_grad=False)
    assert len(without) == 3
    _ok(testing.check_backward(dout, q, k, v, *without, bias=bias, bias_requires_grad=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_deterministic(dtype):
    shape = (2, 190, 190, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, "bias-det", str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 128, dtype, seed)
    bias = _bias(shape, "full", dtype, seed)
    out, vjp = cuflash2.attention_vjp(q, k, v, bias=bias, causal=True, deterministic=True)
    dout = _dout(q, seed)
    grads = vjp(dout)
    _ok(testing.check_backward(dout, q, k, v, *grads, bias=bias, causal=True))
    again = vjp(dout)
    assert all(bool(cupy.all(a == b)) for a, b in zip(grads, again))
    shared = _bias(shape, "batch", dtype, seed)
    with pytest.raises(NotImplementedError, match="deterministic=True with a bias broadcast"):
        cuflash2.attention_vjp(q, k, v, bias=shared, deterministic=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_bias(dtype):
    lengths_q, lengths_k, h, hk, d = [97, 1, 0, 200, 64], [97, 1, 0, 150, 80], 4, 2, 64
    seed = seed_of("varlen-bias", str(dtype))
    q, k, v, dout, cu_q, cu_k, max_q, max_k = varlen_inputs(cupy, lengths_q, lengths_k, h, hk, d,
                                                            dtype, seed)
    bias = cupy.asarray(numpy.random.default_rng(seed + 7)
                        .standard_normal((len(lengths_q), 1, max_q, max_k)).astype(numpy.float32))
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    out, lse = cuflash2.attention_varlen(*args, causal=True, bias=bias, return_lse=True)
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                               causal=True, bias=bias)
    dq, dk, dv, dbias = grads
    _ok(testing.check_varlen_backward(dout, q, k, v, dq, dk, dv, cu_q, cu_k, max_q, max_k,
                                      causal=True, bias=bias, dbias=dbias))


def test_evoformer_pair_bias():
    # AlphaFold's pair bias: (1, heads, n, n) shared by every batch entry (the MSA rows), d=32.
    batch, n, h, d = 6, 160, 4, 32
    seed = seed_of("evoformer")
    q, k, v = testing.random_qkv(cupy, batch, n, n, h, h, d, numpy.float16, seed)
    bias = cupy.asarray(numpy.random.default_rng(seed).standard_normal((1, h, n, n))
                        .astype(numpy.float16))
    out, vjp = cuflash2.attention_vjp(q, k, v, bias=bias)
    dout = _dout(q, seed)
    _ok(testing.check_backward(dout, q, k, v, *vjp(dout), bias=bias))


def test_bias_refusals_before_any_launch():
    q, k, v = testing.random_qkv(cupy, 2, 64, 64, 2, 2, 64, numpy.float16, 0)
    good = cupy.zeros((2, 2, 64, 64), numpy.float16)
    with pytest.raises(TypeError, match="bias must be a CuPy array"):
        cuflash2.attention(q, k, v, bias=numpy.zeros((2, 2, 64, 64), numpy.float16))
    with pytest.raises(ValueError, match="bias must have shape"):
        cuflash2.attention(q, k, v, bias=cupy.zeros((2, 3, 64, 64), numpy.float16))
    with pytest.raises(TypeError, match="bias"):
        cuflash2.attention(q, k, v, bias=cupy.zeros((2, 2, 64, 64), numpy.float64))
    with pytest.raises(NotImplementedError, match="dbias with softcap"):
        cuflash2.attention_vjp(q, k, v, bias=good, softcap=30.0)
    with pytest.raises(NotImplementedError, match="bias with dropout_p"):
        cuflash2.attention_vjp(q, k, v, bias=good, dropout_p=0.1, seed=1)
    # without its gradient, softcap is fine
    out, vjp = cuflash2.attention_vjp(q, k, v, bias=good, softcap=30.0,
                                      bias_requires_grad=False)
    assert len(vjp(q)) == 3
