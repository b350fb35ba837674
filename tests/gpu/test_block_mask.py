"""Block masks (cuflash2.block_mask, issue 44): the states from the GPU kernel (block_mask.cu)
against the NumPy reference (reference.block_mask_states) for a document mask, prefix-LM, a
sliding window and odd lengths, per batch / head and shared; the forward with a block mask
against the reference's dense mask (2x rule) and against the same forward without the block mask;
the checks before a launch (the CPU suite compiles these kernels: tests/test_block_mask.py)."""

import numpy
import pytest
from grids import BF16, DTYPES, FP16, needs_hopper, seed_of, switched  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api, block_masks, reference, testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _documents(seqlen, seed, pieces=4):
    rng = numpy.random.default_rng(seed)
    cuts = numpy.sort(rng.choice(numpy.arange(1, seqlen), size=min(pieces - 1, seqlen - 1),
                                 replace=False))
    doc = numpy.zeros(seqlen, numpy.int32)
    for c in cuts:
        doc[c:] += 1
    return doc


def _positions(sq, sk):
    return numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]


def _masks(sq, sk, seed):
    """name -> (mask_mod, dense (seqlen_q, seqlen_k) bool) of the masks under test."""
    qi, ki = _positions(sq, sk)
    doc_np = _documents(max(sq, sk), seed)
    doc = cupy.asarray(doc_np)
    return {
        "document": (cuflash2.mask_mod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc),
                     (doc_np[qi] == doc_np[ki]) & (ki <= qi)),
        "prefix-lm": (cuflash2.mask_mod("kv_idx <= q_idx || kv_idx < prefix", prefix=77),
                      (ki <= qi) | (ki < 77)),
        "sliding-window": (cuflash2.mask_mod("kv_idx <= q_idx && q_idx - kv_idx < 100"),
                           (ki <= qi) & (qi - ki < 100)),
        "document-noncausal": (cuflash2.mask_mod("doc[q_idx] == doc[kv_idx]", doc=doc),
                               doc_np[qi] == doc_np[ki]),
    }


LENGTHS = [(64, 64), (300, 300), (257, 131), (97, 513)]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("name", ["document", "prefix-lm", "sliding-window",
                                  "document-noncausal"])
def test_states_equal_reference(name, lengths):
    sq, sk = lengths
    mm, dense = _masks(sq, sk, seed_of(lengths, name))[name]
    bm = cuflash2.block_mask(mm, 1, 1, sq, sk, head_dim=128)
    assert bm.states.dtype == cupy.int8
    expected = reference.block_mask_states(dense, bm.block_m, bm.block_n)
    numpy.testing.assert_array_equal(cupy.asnumpy(bm.states)[0, 0], expected)
    numpy.testing.assert_array_equal(cupy.asnumpy(bm.ranges)[0, 0],
                                     reference.block_mask_ranges(expected))


def test_states_per_batch_and_head():
    sq = sk = 200
    doc = numpy.stack([_documents(sq, s) for s in range(3)])  # (batch, seqlen)
    mm = cuflash2.mask_mod("doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx + h",
                           doc=cupy.asarray(doc))
    bm = cuflash2.block_mask(mm, 3, 2, sq, sk, block_m=64, block_n=64)
    qi, ki = _positions(sq, sk)
    dense = numpy.stack([numpy.stack([(doc[b][qi] == doc[b][ki]) & (ki <= qi + h)
                                      for h in range(2)]) for b in range(3)])
    numpy.testing.assert_array_equal(cupy.asnumpy(bm.states),
                                     reference.block_mask_states(dense, 64, 64))
    numpy.testing.assert_array_equal(cupy.asnumpy(bm.ranges),
                                     reference.block_mask_ranges(cupy.asnumpy(bm.states)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("name", ["document", "prefix-lm", "sliding-window",
                                  "document-noncausal"])
@pytest.mark.parametrize("shape", [(2, 300, 300, 4, 2), (1, 257, 513, 2, 2)])
def test_forward_with_block_mask(dtype, headdim, name, shape):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, name, str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    mm, dense = _masks(sq, sk, seed)[name]
    bm = cuflash2.block_mask(mm, 1, 1, sq, sk, head_dim=headdim, dtype=dtype)
    out, lse = cuflash2.attention(q, k, v, block_mask=bm, return_lse=True)
    results = testing.check_forward(q, k, v, out, lse, mask=cupy.asarray(dense))
    assert all(r.ok for r in results), [str(r) for r in results]
    # The same as the mask modifier alone (the user's mask on every tile), on the mma.sync
    # kernels both (on sm_90 the Hopper forward takes both, with other rounding).
    with switched(_dispatch, {"HOPPER_FORWARD_MODS": False}, api._forward_plans):
        out1, lse1 = cuflash2.attention(q, k, v, block_mask=bm, return_lse=True)
        out2, lse2 = cuflash2.attention(q, k, v, mask_mod=mm, return_lse=True)
    cupy.testing.assert_allclose(out1.astype(cupy.float32), out2.astype(cupy.float32),
                                 atol=2e-3, rtol=0)
    cupy.testing.assert_allclose(lse1, lse2, atol=1e-4, rtol=0)
    # mask_mod given too: the same modifier is accepted.
    out3 = cuflash2.attention(q, k, v, mask_mod=mm, block_mask=bm)
    cupy.testing.assert_array_equal(out3, out)


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("name, dtype, deterministic", [
    ("document", FP16, False), ("document", BF16, True), ("prefix-lm", BF16, False),
    ("sliding-window", FP16, False), ("document-noncausal", BF16, False)])
def test_backward_with_block_mask(dtype, headdim, name, deterministic):
    # The backward's main kernel walks each key block's non-empty tiles (FEATURE_BLOCK_MASK):
    # against the reference's dense mask, and against the mask modifier alone (once).
    shape = (2, 300, 257, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, name, str(dtype), "bwd", deterministic)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    dout = cupy.asarray(numpy.random.default_rng(seed + 3).standard_normal(q.shape)
                        .astype(dtype))
    mm, dense = _masks(sq, sk, seed)[name]
    bm = cuflash2.block_mask(mm, 1, 1, sq, sk, head_dim=headdim, dtype=dtype)
    out, vjp = cuflash2.attention_vjp(q, k, v, block_mask=bm, deterministic=deterministic)
    grads = vjp(dout)
    results = testing.check_backward(dout, q, k, v, *grads, mask=cupy.asarray(dense))
    assert all(r.ok for r in results), [str(r) for r in results]
    if (name, headdim) != ("document", 128) or deterministic:
        return
    with switched(_dispatch, {"HOPPER_FORWARD_MODS": False}, api._forward_plans):
        _, vjp2 = cuflash2.attention_vjp(q, k, v, mask_mod=mm)  # the same forward kernel
        grads2 = vjp2(dout)
    for a, b in zip(grads, grads2):
        cupy.testing.assert_allclose(a.astype(cupy.float32), b.astype(cupy.float32),
                                     atol=5e-3, rtol=0)


def test_backward_with_block_mask_per_head_and_bias():
    # States per batch entry and head (a mask that reads b and h), with a bias and its dbias.
    shape = (2, 200, 200, 2, 2)
    batch, sq, sk, h, hk = shape
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 64, FP16, 11)
    mm = cuflash2.mask_mod("kv_idx <= q_idx + 32 * (b + h) && kv_idx + 64 > q_idx")
    bm = cuflash2.block_mask(mm, batch, h, sq, sk, head_dim=64, dtype="float16")
    bias = cupy.asarray(numpy.random.default_rng(11).standard_normal((batch, h, sq, sk))
                        .astype(numpy.float32))
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    dense = numpy.stack([numpy.stack([(ki <= qi + 32 * (b + hh)) & (ki + 64 > qi)
                                      for hh in range(h)]) for b in range(batch)])
    out, vjp = cuflash2.attention_vjp(q, k, v, block_mask=bm, bias=bias)
    dout = cupy.asarray(numpy.random.default_rng(12).standard_normal(q.shape).astype(FP16))
    results = testing.check_backward(dout, q, k, v, *vjp(dout), mask=cupy.asarray(dense),
                                     bias=bias)
    assert all(r.ok for r in results), [str(r) for r in results]


@needs_hopper
@pytest.mark.parametrize("headdim", [64, 96, 128])
@pytest.mark.parametrize("name", ["document", "prefix-lm", "sliding-window"])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_with_block_mask(headdim, name, causal):
    # On sm_90 the Hopper forward takes a block mask up to d=128: each work tile's KV range
    # narrowed to its visited tiles (BlockMaskNarrow), on the schedules and grids the dispatcher
    # picks (2 x 1500 rows: the persistent grid where it has one).
    shape = (2, 1500, 1300, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, name, "hopper", causal)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, BF16, seed)
    mm, dense = _masks(sq, sk, seed)[name]
    bm = cuflash2.block_mask(mm, 1, 1, sq, sk, head_dim=headdim, dtype=BF16)
    (kernel,) = cuflash2.forward_kernels(q, k, v, block_mask=bm, causal=causal)
    assert kernel.startswith("Hopper forward") and "block mask" in kernel, kernel
    out, lse = cuflash2.attention(q, k, v, block_mask=bm, causal=causal, return_lse=True)
    results = testing.check_forward(q, k, v, out, lse, mask=cupy.asarray(dense), causal=causal)
    assert all(r.ok for r in results), [str(r) for r in results]


# Every mask at d=128, the document mask at the other step shapes (d=64: 64-row steps where the
# plain kernel takes 128; d=256: two head-dim chunks): each case compiles its own kernels.
HOPPER_BWD_CASES = ([(128, name) for name in ("document", "prefix-lm", "sliding-window",
                                               "document-noncausal")]
                    + [(64, "document"), (256, "document")])


@needs_hopper
@pytest.mark.parametrize("headdim, name", HOPPER_BWD_CASES)
@pytest.mark.parametrize("blocked", [False, True])
def test_hopper_backward_with_a_mask_modifier(headdim, name, blocked):
    # On sm_90 a mask modifier alone runs on the Hopper backward (the user's mask on P^T and
    # dS^T), with a block mask each key block's query blocks narrowed to its visited ones
    # (BlockMaskColumnRange); GQA, odd lengths, rows and key blocks the mask leaves empty.
    shape = (2, 700, 450, 4, 2)
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, name, "hopper-bwd", blocked)
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, BF16, seed)
    dout = cupy.asarray(numpy.random.default_rng(seed + 3).standard_normal(q.shape)
                        .astype(BF16))
    mm, dense = _masks(sq, sk, seed)[name]
    options = {"block_mask": cuflash2.block_mask(mm, 1, 1, sq, sk, head_dim=headdim,
                                                 dtype=BF16)} if blocked else {"mask_mod": mm}
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, **options)
    assert any(k.startswith("Hopper backward") and "mask_mod" in k for k in kernels), kernels
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, **options)
    results = testing.check_backward(dout, q, k, v, *grads, mask=cupy.asarray(dense))
    assert all(r.ok for r in results), [str(r) for r in results]
    if blocked:  # the columns' summaries against the reference's
        bm = options["block_mask"]
        numpy.testing.assert_array_equal(
            cupy.asnumpy(bm.columns), reference.block_mask_columns(cupy.asnumpy(bm.states)))


@needs_hopper
def test_hopper_backward_with_a_block_mask_per_head():
    # States per batch entry and head under GQA (4 query heads, 2 KV heads): each key block's
    # query blocks are the union over its group's heads, the full ones their intersection.
    shape = (2, 600, 520, 4, 2)
    batch, sq, sk, h, hk = shape
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, 128, BF16, 13)
    mm = cuflash2.mask_mod("kv_idx <= q_idx + 96 * (b + h) && kv_idx + 200 > q_idx")
    bm = cuflash2.block_mask(mm, batch, h, sq, sk, head_dim=128, dtype=BF16)
    qi, ki = numpy.arange(sq)[:, None], numpy.arange(sk)[None, :]
    dense = numpy.stack([numpy.stack([(ki <= qi + 96 * (b + hh)) & (ki + 200 > qi)
                                      for hh in range(h)]) for b in range(batch)])
    out, lse = cuflash2.attention(q, k, v, block_mask=bm, return_lse=True)
    dout = cupy.asarray(numpy.random.default_rng(14).standard_normal(q.shape).astype(BF16))
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, block_mask=bm)
    assert any(k.startswith("Hopper backward") and "block mask" in k for k in kernels), kernels
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, block_mask=bm)
    results = testing.check_backward(dout, q, k, v, *grads, mask=cupy.asarray(dense))
    assert all(r.ok for r in results), [str(r) for r in results]


def test_forward_with_block_mask_and_causal():
    q, k, v = testing.random_qkv(cupy, 1, 300, 300, 2, 2, 64, FP16, 5)
    mm, dense = _masks(300, 300, 5)["document-noncausal"]
    bm = cuflash2.block_mask(mm, 1, 1, 300, 300, head_dim=64, dtype="float16")
    out, lse = cuflash2.attention(q, k, v, block_mask=bm, causal=True, return_lse=True)
    results = testing.check_forward(q, k, v, out, lse, mask=cupy.asarray(dense), causal=True)
    assert all(r.ok for r in results), [str(r) for r in results]


def test_forward_rows_without_keys():
    # Every tile empty for the second half of the queries: out 0, lse +inf.
    q, k, v = testing.random_qkv(cupy, 1, 256, 256, 2, 2, 64, FP16, 6)
    mm = cuflash2.mask_mod("q_idx < 128 && kv_idx <= q_idx")
    bm = cuflash2.block_mask(mm, 1, 1, 256, 256, head_dim=64, dtype="float16")
    assert (cupy.asnumpy(bm.states)[0, 0, 2:] == block_masks.EMPTY).all()
    out, lse = cuflash2.attention(q, k, v, block_mask=bm, return_lse=True)
    assert not cupy.asnumpy(out[:, 128:]).any()
    assert numpy.isposinf(cupy.asnumpy(lse[:, :, 128:])).all()


def test_checks_before_launch():
    q, k, v = testing.random_qkv(cupy, 2, 300, 300, 4, 4, 64, FP16, 7)
    mm, _ = _masks(300, 300, 7)["sliding-window"]
    with pytest.raises(ValueError, match="seqlen_q=200"):
        cuflash2.attention(q, k, v, block_mask=cuflash2.block_mask(mm, 1, 1, 200, 300,
                                                                   head_dim=64))
    # (80-row tiles neither are the mma.sync forward's nor make up the Hopper forward's)
    with pytest.raises(ValueError, match="tiles"):
        cuflash2.attention(q, k, v, block_mask=cuflash2.block_mask(mm, 1, 1, 300, 300,
                                                                   block_m=80, block_n=64))
    with pytest.raises(ValueError, match="batch=3"):
        cuflash2.attention(q, k, v, block_mask=cuflash2.block_mask(mm, 3, 1, 300, 300,
                                                                   head_dim=64))
    other, _ = _masks(300, 300, 7)["prefix-lm"]
    with pytest.raises(ValueError, match="block_mask was built for"):
        cuflash2.attention(q, k, v, mask_mod=other,
                           block_mask=cuflash2.block_mask(mm, 1, 1, 300, 300, head_dim=64))
