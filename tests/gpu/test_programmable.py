"""Programmable masks and score modifiers (cuflash2.mask_mod / score_mod, issue 44's first slice:
the mma.sync forward and backward) against the reference's dense mask and NumPy-style score
function (and, backward, its derivative), with the 2x rule: a document mask, prefix-LM (a baked-in constant and a 1-element array), a relative
position score modifier, a softcap-like one, a mask that leaves rows without keys, odd lengths,
GQA, varlen (the CPU suite compiles these kernels: tests/test_programmable_compile.py)."""

import numpy
import pytest
from grids import DTYPES, needs_hopper, seed_of, switched, varlen_inputs  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api, reference, testing  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_kv
    (2, 97, 97, 2, 2), (1, 255, 300, 6, 2), (2, 300, 129, 4, 1)]


def _documents(seqlen, seed, pieces=4):
    """int32 document ids (sorted, `pieces` documents of random lengths) of a sequence."""
    rng = numpy.random.default_rng(seed)
    cuts = numpy.sort(rng.choice(numpy.arange(1, max(seqlen, 2)), size=min(pieces - 1,
                                                                          max(seqlen - 1, 0)),
                                 replace=False))
    doc = numpy.zeros(seqlen, numpy.int32)
    for c in cuts:
        doc[c:] += 1
    return doc


def _check(q, k, v, out, lse, **options):
    results = testing.check_forward(q, k, v, out, lse, **options)
    assert all(r.ok for r in results), [str(r) for r in results]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_document_mask(dtype, headdim, shape):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "doc", str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    n = max(sq, sk)
    doc_np = _documents(n, seed)
    doc = cupy.asarray(doc_np)
    mm = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc)
    out, lse = cuflash2.attention(q, k, v, mask_mod=mm, return_lse=True)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    mask = (doc_np[qi] == doc_np[ki]) & (ki <= qi)
    _check(q, k, v, out, lse, mask=cupy.asarray(mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("as_array", [False, True])
def test_prefix_lm(dtype, as_array):
    shape = (2, 300, 300, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, 64, "prefix", str(dtype), as_array)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 64, dtype, seed)
    prefix_len = 77
    if as_array:
        mm = cuflash2.mask_mod("kv_idx <= q_idx || kv_idx < prefix[0]",
                               prefix=cupy.asarray([prefix_len], numpy.int32))
    else:
        mm = cuflash2.mask_mod("kv_idx <= q_idx || kv_idx < prefix_len", prefix_len=prefix_len)
    out, lse = cuflash2.attention(q, k, v, mask_mod=mm, return_lse=True)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    mask = (ki <= qi) | (ki < prefix_len)
    _check(q, k, v, out, lse, mask=cupy.asarray(mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_relative_position_score_mod(dtype, headdim, shape, causal):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "relpos", str(dtype), causal)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    rng = numpy.random.default_rng(seed + 1)
    table = cupy.asarray(rng.standard_normal((h, 2047)).astype(numpy.float32))
    sm = cuflash2.score_mod("score + table(h, q_idx - kv_idx + 1023)", table=table)
    out, lse = cuflash2.attention(q, k, v, causal=causal, score_mod=sm, return_lse=True)

    def fn(score, b, hh, qi, ki):
        return score + table[hh, qi - ki + 1023]

    _check(q, k, v, out, lse, causal=causal, score_mod=fn)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_like_score_mod_with_alibi_and_window(dtype):
    shape = (2, 255, 300, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, 128, "softcap-like", str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 128, dtype, seed)
    slopes = cupy.asarray(numpy.random.default_rng(seed).uniform(0.01, 0.3, h).astype(
        numpy.float32))
    sm = cuflash2.score_mod("12.f * tanhf(score / 12.f)",
                            grad="1.f - tanhf(score / 12.f) * tanhf(score / 12.f)")
    kwargs = dict(window_size=(64, 16), alibi_slopes=slopes, softmax_scale=0.3)
    out, lse = cuflash2.attention(q, k, v, score_mod=sm, return_lse=True, **kwargs)
    _check(q, k, v, out, lse, score_mod=lambda s, b, hh, qi, ki: 12 * cupy.tanh(s / 12),
           **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_and_score_mod_together_with_softcap(dtype):
    shape = (1, 200, 200, 4, 4)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, 64, "both", str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 64, dtype, seed)
    bias = cupy.asarray(numpy.random.default_rng(seed).standard_normal(h).astype(numpy.float16))
    mm = cuflash2.mask_mod("(q_idx + kv_idx + h) % 3 != 0")
    sm = cuflash2.score_mod("score + bias[h]", bias=bias)
    out, lse = cuflash2.attention(q, k, v, softcap=3.0, mask_mod=mm, score_mod=sm,
                                  return_lse=True)
    hh = numpy.arange(h)[:, None, None]
    qi, ki = numpy.arange(sq)[None, :, None], numpy.arange(sk)[None, None, :]
    mask = (qi + ki + hh) % 3 != 0
    b32 = bias.astype(cupy.float32)
    _check(q, k, v, out, lse, softcap=3.0, mask=cupy.asarray(mask),
           score_mod=lambda s, b, hx, qx, kx: s + b32[hx])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_left_without_keys(dtype, sinks):
    """A mask that hides every key of some rows (every third row, and the rows of one head
    entirely): out 0, lse +inf (or the sink), the other rows exact."""
    shape = (2, 129, 131, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, 64, "keyless", str(dtype), sinks)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 64, dtype, seed)
    sink = (cupy.asarray(numpy.random.default_rng(seed).standard_normal(h).astype(numpy.float32))
            if sinks else None)
    mm = cuflash2.mask_mod("q_idx % 3 != 0 && h != 1 && kv_idx >= q_idx / 2")
    out, lse = cuflash2.attention(q, k, v, mask_mod=mm, sinks=sink, return_lse=True)
    hh = numpy.arange(h)[:, None, None]
    qi, ki = numpy.arange(sq)[None, :, None], numpy.arange(sk)[None, None, :]
    mask = (qi % 3 != 0) & (hh != 1) & (ki >= qi // 2)
    _check(q, k, v, out, lse, mask=cupy.asarray(mask), sinks=sink)
    keyless = cupy.asarray(~mask.any(-1))  # (h, sq)
    assert bool(cupy.all(out.transpose(0, 2, 1, 3)[:, keyless] == 0))
    if not sinks:
        assert bool(cupy.all(cupy.isinf(lse[:, keyless])))


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_document_mask_and_score_mod(dtype):
    lengths_q, lengths_k, h, hk, d = [97, 1, 0, 300, 64], [97, 1, 0, 250, 80], 4, 2, 64
    seed = seed_of("varlen-mods", str(dtype))
    q, k, v, _, cu_q, cu_k, max_q, max_k = varlen_inputs(cupy, lengths_q, lengths_k, h, hk, d,
                                                         dtype, seed)
    batch = len(lengths_q)
    # Per-sequence document ids, (batch, max length): b and the in-sequence positions.
    docs_np = numpy.stack([_documents(max(max_q, max_k), seed + b) for b in range(batch)])
    docs = cupy.asarray(docs_np)
    mm = cuflash2.mask_mod("docs(b, q_idx) == docs(b, kv_idx)", docs=docs)
    sm = cuflash2.score_mod("score - 0.01f * (q_idx - kv_idx)")
    out, lse = cuflash2.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                         mask_mod=mm, score_mod=sm, return_lse=True)
    qi, ki = numpy.arange(max_q)[:, None], numpy.arange(max_k)[None, :]
    mask = (docs_np[:, None, qi] == docs_np[:, None, ki])  # (batch, 1, max_q, max_k)
    options = dict(causal=True, mask=cupy.asarray(mask),
                   score_mod=lambda s, b, hh, qx, kx: s - 0.01 * (qx - kx))
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    ref_hi, ref_lse = reference.attention_varlen(*args, return_lse=True,
                                                 compute_dtype=numpy.float32, **options)
    ref_lo = reference.attention_varlen(*args, compute_dtype=q.dtype, **options)
    results = [testing.check_close("out", out, ref_hi, ref_lo),
               testing.lse_close(lse, ref_lse)]
    assert all(r.ok for r in results), [str(r) for r in results]


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 96, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_with_a_mask_modifier(dtype, headdim, causal):
    # On sm_90 a mask modifier alone runs on the Hopper forward (FwdSm90ModsConfig), on every
    # schedule and grid the dispatcher picks (2 x 1000 rows: the persistent grid where it has
    # one); against the reference, and against the mma.sync mods kernel.
    shape = (2, 1000, 1100, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "hopper-mask", str(dtype), causal)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    doc_np = _documents(max(sq, sk), seed, pieces=6)
    mm = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx] || kv_idx < 7", doc=cupy.asarray(doc_np))
    (kernel,) = cuflash2.forward_kernels(q, k, v, mask_mod=mm, causal=causal)
    assert kernel.startswith("Hopper forward") and kernel.endswith("with mask_mod"), kernel
    out, lse = cuflash2.attention(q, k, v, mask_mod=mm, causal=causal, return_lse=True)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    _check(q, k, v, out, lse, causal=causal,
           mask=cupy.asarray((doc_np[qi] == doc_np[ki]) | (ki < 7)))
    with switched(_dispatch, {"HOPPER_FORWARD_MODS": False}, api._forward_plans):
        out2, lse2 = cuflash2.attention(q, k, v, mask_mod=mm, causal=causal, return_lse=True)
    finite = cupy.isfinite(lse2)
    assert bool(cupy.all(finite == cupy.isfinite(lse)))  # the same rows without keys
    cupy.testing.assert_allclose(cupy.where(finite, lse, 0), cupy.where(finite, lse2, 0),
                                 atol=1e-3, rtol=0)


def test_plans_reuse_and_new_expressions():
    q, k, v = testing.random_qkv(cupy, 1, 64, 64, 2, 2, 64, numpy.float16, 0)
    doc = cupy.zeros(64, numpy.int32)
    a = cuflash2.attention(q, k, v, mask_mod=cuflash2.mask_mod("doc[q_idx] == doc[kv_idx]",
                                                               doc=doc))
    # A new array of the same signature: the same plan, the new address read per call.
    doc2 = cupy.arange(64, dtype=numpy.int32)
    b = cuflash2.attention(q, k, v, mask_mod=cuflash2.mask_mod("doc[q_idx] == doc[kv_idx]",
                                                               doc=doc2))
    plain = cuflash2.attention(q, k, v)
    assert bool(cupy.all(a == plain))  # one document: no key hidden
    # Each row sees itself only: out = v of the row's own position (GQA-free heads).
    assert float(cupy.max(cupy.abs(b.astype(cupy.float32) - v.astype(cupy.float32)))) < 1e-3


def test_input_on_another_device_is_refused():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = testing.random_qkv(cupy, 1, 64, 64, 2, 2, 64, numpy.float16, 0)
    with cupy.cuda.Device(1):
        doc = cupy.zeros(64, numpy.int32)
    with pytest.raises(ValueError, match="mask_mod input doc is on device 1"):
        cuflash2.attention(q, k, v, mask_mod=cuflash2.mask_mod("doc[q_idx] == 0", doc=doc))


# ---------------------------------------------------------------------------------------------
# The backward (mma.sync flash_bwd_mods_kernel / flash_bwd_dq_mods_kernel), against the
# reference backward with the same dense mask and score function (and its derivative).


def _check_grads(dout, q, k, v, grads, **options):
    results = testing.check_backward(dout, q, k, v, *grads, **options)
    assert all(r.ok for r in results), [str(r) for r in results]


def _relpos(h, seed):
    rng = numpy.random.default_rng(seed + 1)
    table = cupy.asarray(rng.standard_normal((h, 2047)).astype(numpy.float32))
    sm = cuflash2.score_mod("score + table(h, q_idx - kv_idx + 1023)", table=table)
    return sm, (lambda s, b, hh, qi, ki: s + table[hh, qi - ki + 1023])


def _softcap_like():
    sm = cuflash2.score_mod("12.f * tanhf(score / 12.f)",
                            grad="1.f - tanhf(score / 12.f) * tanhf(score / 12.f)")
    return sm, (lambda s, b, hh, qi, ki: 12 * cupy.tanh(s / 12)), \
        (lambda s, b, hh, qi, ki: 1 - cupy.tanh(s / 12) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)  # odd lengths, GQA / MQA
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_document_mask_and_relpos(dtype, headdim, shape, deterministic):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "bwd-doc-relpos", str(dtype), deterministic)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    doc_np = _documents(max(sq, sk), seed)
    mm = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx",
                           doc=cupy.asarray(doc_np))
    sm, fn = _relpos(h, seed)
    out, vjp = cuflash2.attention_vjp(q, k, v, mask_mod=mm, score_mod=sm,
                                      deterministic=deterministic)
    dout = cupy.asarray(numpy.random.default_rng(seed + 2).standard_normal(q.shape)
                        .astype(dtype))
    grads = vjp(dout)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    mask = cupy.asarray((doc_np[qi] == doc_np[ki]) & (ki <= qi))
    _check_grads(dout, q, k, v, grads, mask=mask, score_mod=fn,
                 score_mod_grad=lambda s, b, hh, qx, kx: cupy.ones_like(s))
    if deterministic:
        again = vjp(dout)
        assert all(bool(cupy.all(a == b)) for a, b in zip(grads, again))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_prefix_lm_and_softcap_like(dtype, headdim, deterministic):
    shape = (2, 301, 257, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, "bwd-prefix-softcap", str(dtype), deterministic)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    mm = cuflash2.mask_mod("kv_idx <= q_idx || kv_idx < prefix[0]",
                           prefix=cupy.asarray([77], numpy.int32))
    sm, fn, grad = _softcap_like()
    out, lse = cuflash2.attention(q, k, v, mask_mod=mm, score_mod=sm, return_lse=True)
    dout = cupy.asarray(numpy.random.default_rng(seed + 2).standard_normal(q.shape)
                        .astype(dtype))
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, mask_mod=mm, score_mod=sm,
                                        deterministic=deterministic)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    mask = cupy.asarray((ki <= qi) | (ki < 77))
    _check_grads(dout, q, k, v, grads, mask=mask, score_mod=fn, score_mod_grad=grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_score_mod_with_softcap_and_alibi(dtype):
    shape = (1, 200, 200, 4, 4)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, 64, "bwd-softcap-alibi", str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 64, dtype, seed)
    slopes = cupy.asarray(numpy.linspace(0.01, 0.1, h).astype(numpy.float32))
    sm, fn, grad = _softcap_like()
    kwargs = dict(causal=True, softcap=30.0, alibi_slopes=slopes, score_mod=sm)
    out, vjp = cuflash2.attention_vjp(q, k, v, **kwargs)
    dout = cupy.asarray(numpy.random.default_rng(seed + 2).standard_normal(q.shape)
                        .astype(dtype))
    grads = vjp(dout)
    _check_grads(dout, q, k, v, grads, causal=True, softcap=30.0, alibi_slopes=slopes,
                 score_mod=fn, score_mod_grad=grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_varlen_document_mask_and_score_mod(dtype, deterministic):
    lengths_q, lengths_k, h, hk, d = [97, 1, 0, 300, 64], [97, 1, 0, 250, 80], 4, 2, 64
    seed = seed_of("varlen-mods-bwd", str(dtype), deterministic)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = varlen_inputs(cupy, lengths_q, lengths_k, h, hk, d,
                                                            dtype, seed)
    batch = len(lengths_q)
    docs_np = numpy.stack([_documents(max(max_q, max_k), seed + b) for b in range(batch)])
    mm = cuflash2.mask_mod("docs(b, q_idx) == docs(b, kv_idx)", docs=cupy.asarray(docs_np))
    sm = cuflash2.score_mod("score - 0.01f * (q_idx - kv_idx)")
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    out, lse = cuflash2.attention_varlen(*args, causal=True, mask_mod=mm, score_mod=sm,
                                         return_lse=True)
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                               causal=True, mask_mod=mm, score_mod=sm,
                                               deterministic=deterministic)
    qi, ki = numpy.arange(max_q)[:, None], numpy.arange(max_k)[None, :]
    mask = cupy.asarray(docs_np[:, None, qi] == docs_np[:, None, ki])
    results = testing.check_varlen_backward(
        dout, q, k, v, *grads, cu_q, cu_k, max_q, max_k, causal=True, mask=mask,
        score_mod=lambda s, b, hh, qx, kx: s - 0.01 * (qx - kx),
        score_mod_grad=lambda s, b, hh, qx, kx: cupy.ones_like(s))
    assert all(r.ok for r in results), [str(r) for r in results]


@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_backward_varlen_document_mask(deterministic):
    # A mask modifier alone on varlen batches runs on the Hopper backward (sm_90): sequences of
    # one and no rows, GQA, the ordered dQ of deterministic mode.
    lengths_q, lengths_k, h, hk, d = [97, 1, 0, 300, 64], [97, 1, 0, 250, 80], 4, 2, 128
    seed = seed_of("varlen-mask-hopper-bwd", deterministic)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = varlen_inputs(cupy, lengths_q, lengths_k, h, hk, d,
                                                            numpy.float16, seed)
    batch = len(lengths_q)
    docs_np = numpy.stack([_documents(max(max_q, max_k), seed + b) for b in range(batch)])
    mm = cuflash2.mask_mod("docs(b, q_idx) == docs(b, kv_idx)", docs=cupy.asarray(docs_np))
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    out, lse = cuflash2.attention_varlen(*args, causal=True, mask_mod=mm, return_lse=True)
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                               causal=True, mask_mod=mm,
                                               deterministic=deterministic)
    qi, ki = numpy.arange(max_q)[:, None], numpy.arange(max_k)[None, :]
    mask = cupy.asarray(docs_np[:, None, qi] == docs_np[:, None, ki])
    results = testing.check_varlen_backward(dout, q, k, v, *grads, cu_q, cu_k, max_q, max_k,
                                            causal=True, mask=mask)
    assert all(r.ok for r in results), [str(r) for r in results]


def test_backward_refuses_a_score_mod_without_grad():
    q, k, v = testing.random_qkv(cupy, 1, 64, 64, 2, 2, 64, numpy.float16, 0)
    with pytest.raises(ValueError, match="pass grad="):
        cuflash2.attention_vjp(q, k, v, score_mod=cuflash2.score_mod("2.f * score"))
