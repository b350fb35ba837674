"""GPU tests of v with a head dim of its own (d_v != d_qk: DeepSeek's 192 / 128, and 128 / 64),
which the Hopper kernels run (_dispatch.SM90_FWD_HEAD_DIM_PAIRS): against the reference by the
2x rule, forward (out, lse) and backward (dq, dk like q and k, dv like v), dense and varlen,
causal and not, GQA, odd lengths, seqlen_q != seqlen_k, the variant's features, deterministic
mode, poisoned outputs, a CUDA graph replayed with fresh inputs. The mma.sync kernels with V's
own kernel head dim (every GPU; on sm_90 with the Hopper kernels switched off, and dropout):
forward and backward the same way. What no kernel takes raises a NotImplementedError naming v's
head dim."""

import contextlib

import numpy
import pytest
from grids import BF16, FP16, is_hopper, needs_hopper, switched
from grids import seed_of as _seed

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api, reference, testing  # noqa: E402

pytestmark = pytest.mark.gpu

# 176 / 120: the (192, 128) kernels, partial panels; 128 / 112: one kernel head dim for both
# (dV's stores guarded by v's own)
PAIRS = [(192, 128), (128, 64), (176, 120), (128, 112)]


def _qkv(batch, sq, sk, h, hkv, d_qk, d_v, dtype, seed):
    rng = numpy.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    shapes = (lead + (sq, h, d_qk), lead + (sk, hkv, d_qk), lead + (sk, hkv, d_v))
    return tuple(cupy.asarray(rng.standard_normal(s, dtype=numpy.float32).astype(dtype))
                 for s in shapes)


def _varlen_qkv(lengths_q, lengths_k, d_qk, d_v, seed):
    """Packed fp16 q, k, v of these sequence lengths (4 query heads, 2 KV heads) and
    attention_varlen's arguments after them: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)."""
    q, k, v = _qkv(None, sum(lengths_q), sum(lengths_k), 4, 2, d_qk, d_v, FP16, seed)
    cu_q = cupy.asarray(numpy.cumsum([0] + lengths_q).astype(numpy.int32))
    cu_k = cupy.asarray(numpy.cumsum([0] + lengths_k).astype(numpy.int32))
    return q, k, v, (cu_q, cu_k, max(lengths_q), max(lengths_k))


def _check_varlen_backward(seed, d_qk, d_v, backward=contextlib.nullcontext, **options):
    """A causal attention_varlen on ragged sequences, then its backward (planned inside
    `backward()`, with `options`) against the reference: the gradients' shapes and the rule."""
    q, k, v, args = _varlen_qkv([1, 300, 77, 700], [5, 300, 900, 700], d_qk, d_v, seed)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    dout = _dout(q, v, seed)
    with backward():
        grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True,
                                                   **options)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    results = testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True)
    assert all(r.ok for r in results), "; ".join(map(str, results))


def _check(q, k, v, **options):
    out = testing.poison_like(cupy, q.shape[:-1] + (v.shape[-1],), q.dtype)
    out, lse = cuflash2.attention(q, k, v, return_lse=True, out=out, **options)
    results = testing.check_forward(q, k, v, out, lse, **options)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    return out, lse


def _grid(longest):
    """The grid of a forward or backward test: every pair, dtype and causal mode on shapes
    (batch, seqlen_q, seqlen_k, heads, kv heads) with odd lengths, seqlen_q != seqlen_k and GQA,
    and `longest`, a long square one."""
    def decorate(test):
        for mark in (pytest.mark.parametrize("shape", [(2, 300, 300, 4, 2), (1, 77, 1000, 4, 4),
                                                       (1, 1000, 333, 6, 2), longest],
                                             ids=lambda s: "x".join(map(str, s))),
                     pytest.mark.parametrize("causal", [False, True]),
                     pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"]),
                     pytest.mark.parametrize("d_qk,d_v", PAIRS), needs_hopper):
            test = mark(test)
        return test
    return decorate


@_grid((3, 2048, 2048, 2, 1))
def test_forward_matches_the_reference(d_qk, d_v, dtype, causal, shape):
    batch, sq, sk, h, hkv = shape
    q, k, v = _qkv(batch, sq, sk, h, hkv, d_qk, d_v, dtype, _seed(d_qk, d_v, *shape, causal))
    (kernel,) = cuflash2.forward_kernels(q, k, v, causal=causal)
    assert kernel.startswith("Hopper forward"), kernel
    out, lse = _check(q, k, v, causal=causal)
    assert out.shape == (batch, sq, h, d_v) and lse.shape == (batch, h, sq)


def _feature_options(option: str, rng) -> dict:
    """The call's options for one feature of the features tests (4 query heads), causal but
    for the window."""
    options = {"causal": option != "window"}
    if option == "softcap":
        options["softcap"] = 20.0
    elif option == "alibi":
        options["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, 4).astype(numpy.float32))
    elif option == "sinks":
        options["sinks"] = cupy.asarray(rng.standard_normal(4).astype(numpy.float32))
    elif option == "window":
        options["window_size"] = (100, 30)
    return options


@needs_hopper
@pytest.mark.parametrize("d_qk,d_v", PAIRS[:2])
@pytest.mark.parametrize("option", ["softcap", "alibi", "sinks", "window", "unbatched"])
def test_forward_features(d_qk, d_v, option):
    seed = _seed(d_qk, d_v, option)
    batch = None if option == "unbatched" else 2
    q, k, v = _qkv(batch, 500, 700, 4, 2, d_qk, d_v, BF16, seed)
    _check(q, k, v, **_feature_options(option, numpy.random.default_rng(seed)))


@needs_hopper
@pytest.mark.parametrize("d_qk,d_v", PAIRS[:2])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_matches_the_reference(d_qk, d_v, causal):
    seed = _seed("varlen", d_qk, d_v, causal)
    q, k, v, args = _varlen_qkv([1, 300, 77, 1024], [5, 300, 900, 1024], d_qk, d_v, seed)
    out = testing.poison_like(cupy, q.shape[:-1] + (d_v,), q.dtype)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=causal, out=out, return_lse=True)
    ref_hi, ref_lse = reference.attention_varlen(q, k, v, *args, causal=causal, return_lse=True,
                                                 compute_dtype=numpy.float32)
    ref_lo = reference.attention_varlen(q, k, v, *args, causal=causal, compute_dtype=q.dtype)
    result = testing.check_close("out", out, ref_hi, ref_lo)
    assert result.ok, str(result)
    assert testing.lse_close(lse, ref_lse).ok


@needs_hopper
def test_cuda_graph_replays_with_fresh_inputs():
    """A serving loop's replay: the graph captured once, new q, k, v copied in before each
    replay, each result checked."""
    shape = (2, 600, 4, 2)
    q, k, v = _qkv(shape[0], shape[1], shape[1], shape[2], shape[3], 192, 128, BF16, 5)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash2.attention(q, k, v, causal=True)  # planned and compiled outside the capture
        stream.begin_capture()
        out = cuflash2.attention(q, k, v, causal=True)
        graph = stream.end_capture()
    for round_ in range(3):
        fresh = _qkv(shape[0], shape[1], shape[1], shape[2], shape[3], 192, 128, BF16,
                     100 + round_)
        with stream:
            for dst, src in zip((q, k, v), fresh):
                dst[...] = src
            graph.launch(stream)
        stream.synchronize()
        results = testing.check_forward(*fresh, out, causal=True)
        assert all(r.ok for r in results), "; ".join(map(str, results))


def _dout(q, v, seed):
    rng = numpy.random.default_rng(seed)
    shape = q.shape[:-1] + (v.shape[-1],)
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(q.dtype))


def _check_backward(q, k, v, deterministic=False, family="Hopper backward", **options):
    """The backward's gradients (poisoned outputs) against the reference, its main kernel one of
    `family` (the start of its description)."""
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    dout = _dout(q, v, q.shape[1] + 3)
    (kernel,) = [k_ for k_ in cuflash2.backward_kernels(dout, q, k, v, out, lse,
                                                         deterministic=deterministic, **options)
                 if k_.startswith(family)]
    dq, dk, dv = (testing.poison_like(cupy, x.shape, x.dtype) for x in (q, k, v))
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv,
                                        deterministic=deterministic, **options)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    results = testing.check_backward(dout, q, k, v, *grads, **options)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    return grads


@_grid((2, 1024, 1024, 2, 1))
def test_backward_matches_the_reference(d_qk, d_v, dtype, causal, shape):
    batch, sq, sk, h, hkv = shape
    q, k, v = _qkv(batch, sq, sk, h, hkv, d_qk, d_v, dtype, _seed("bwd", d_qk, d_v, *shape,
                                                                    causal))
    _check_backward(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("d_qk,d_v", PAIRS[:2])
@pytest.mark.parametrize("option", ["deterministic", "softcap", "alibi", "sinks", "window"])
def test_backward_features(d_qk, d_v, option):
    seed = _seed("bwd", d_qk, d_v, option)
    q, k, v = _qkv(2, 500, 700, 4, 2, d_qk, d_v, BF16, seed)
    options = _feature_options(option, numpy.random.default_rng(seed))
    if option == "sinks":
        out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
        dout = _dout(q, v, seed)
        dq, dk, dv, dsinks = cuflash2.attention_backward(dout, q, k, v, out, lse, **options)
        results = testing.check_backward(dout, q, k, v, dq, dk, dv, dsinks, **options)
        assert all(r.ok for r in results), "; ".join(map(str, results))
        return
    grads = _check_backward(q, k, v, deterministic=option == "deterministic", **options)
    if option == "deterministic":  # the same bits again
        again = _check_backward(q, k, v, deterministic=True, **options)
        for a, b in zip(grads, again):
            assert bool((a.view(numpy.uint16) == b.view(numpy.uint16)).all())


@needs_hopper
@pytest.mark.parametrize("d_qk,d_v", PAIRS[:2])
def test_varlen_backward_matches_the_reference(d_qk, d_v):
    _check_varlen_backward(_seed("varlen-bwd", d_qk, d_v), d_qk, d_v)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_v_wider_than_q_within_one_kernel_head_dim(causal):
    """112 / 128: V's head dim above Q's, both on the 128 kernels (the pairs take V's at most
    Q's kernel head dim): out and dv of 128 columns, dq and dk of 112."""
    q, k, v = _qkv(2, 400, 400, 4, 2, 112, 128, FP16, _seed("wider", causal))
    _check(q, k, v, causal=causal)
    _check_backward(q, k, v, causal=causal)


@needs_hopper
def test_vjp_gives_the_backward():
    q, k, v = _qkv(2, 333, 333, 4, 2, 192, 128, BF16, 9)
    out, vjp = cuflash2.attention_vjp(q, k, v, causal=True)
    assert out.shape == (2, 333, 4, 128)
    dout = _dout(q, v, 10)
    results = testing.check_backward(dout, q, k, v, *vjp(dout), causal=True)
    assert all(r.ok for r in results), "; ".join(map(str, results))


def _mma_sync_forward():
    """Plans made inside take the mma.sync forward (on sm_90 the Hopper forward switched off)."""
    return switched(_dispatch, {"HOPPER_FORWARD": False}, api._forward_plans)


@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 64), (128, 96), (256, 128), (96, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_mma_sync_forward_matches_the_reference(d_qk, d_v, causal):
    """The mma.sync forward with V's own kernel head dim (A100s, and what the Hopper forward
    leaves out): out and lse against the reference, odd lengths, GQA."""
    q, k, v = _qkv(2, 301, 555, 4, 2, d_qk, d_v, FP16, _seed("mma", d_qk, d_v, causal))
    with _mma_sync_forward():
        (kernel,) = cuflash2.forward_kernels(q, k, v, causal=causal)
        assert kernel.startswith("mma.sync forward"), kernel
        _check(q, k, v, causal=causal)


def test_mma_sync_forward_with_dropout_matches_its_mask():
    """Dropout, which the Hopper forward leaves to the mma.sync one (on sm_90 too)."""
    q, k, v = _qkv(1, 130, 190, 2, 2, 192, 128, BF16, 11)
    out, lse = cuflash2.attention(q, k, v, dropout_p=0.2, seed=7, return_lse=True)
    mask = cuflash2.dropout_mask(1, 2, 130, 190, 0.2, 7)
    results = testing.check_forward(q, k, v, out, lse, dropout_p=0.2, dropout_mask=mask)
    assert all(r.ok for r in results), "; ".join(map(str, results))


def test_elsewhere_it_is_refused_naming_v():
    """What no kernel takes raises before any launch: a v wider than q's kernel head dim; off
    sm_90 a d_v of q's kernel head dim (the mma.sync kernels' one-head-dim specialisations),
    forward and backward."""
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, 128, FP16, 1)  # 64 / 128: v wider than q
    with pytest.raises(NotImplementedError, match=r"v's head dim \(128\)"):
        cuflash2.attention(q, k, v)
    if not is_hopper():
        q, k, v = _qkv(1, 64, 64, 2, 2, 128, 112, FP16, 1)
        with pytest.raises(NotImplementedError, match=r"v's head dim \(112\)"):
            cuflash2.attention(q, k, v)
        out = cupy.zeros((1, 64, 2, 112), q.dtype)
        lse = cupy.zeros((1, 2, 64), cupy.float32)
        with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(112\)"):
            cuflash2.attention_backward(out, q, k, v, out, lse)


def _mma_sync_backward():
    """Plans made inside take the mma.sync backward (on sm_90 the Hopper backward switched
    off)."""
    return switched(_dispatch, {"HOPPER_BACKWARD": False}, api._backward_plans)


#: The mma.sync backward's pairs (_dispatch.split_bwd_configs): 176 / 120 on the (192, 128)
#: kernels with partial chunks of both; 192 / 96 on V's 128 (no 16-column warp tiles for 96).
MMA_BWD_PAIRS = [(192, 128), (128, 64), (176, 120), (96, 64), (192, 96)]


@pytest.mark.parametrize("d_qk,d_v", MMA_BWD_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_mma_sync_backward_matches_the_reference(d_qk, d_v, causal, deterministic):
    """The mma.sync backward with V's own kernel head dim (every GPU; on sm_90 the Hopper
    backward switched off): dq, dk, dv against the reference by the 2x rule, poisoned outputs,
    odd lengths, seqlen_q != seqlen_k, GQA; dQ by atomics and deterministic (the dQ kernel with
    dO and V of V's head dim)."""
    seed = _seed("mma-bwd", d_qk, d_v, causal, deterministic)
    q, k, v = _qkv(2, 301, 555, 4, 2, d_qk, d_v, FP16, seed)
    with _mma_sync_backward():
        _check_backward(q, k, v, deterministic=deterministic, family="mma.sync backward,",
                        causal=causal)


@pytest.mark.parametrize("d_qk,d_v", MMA_BWD_PAIRS[:2])
@pytest.mark.parametrize("shape", [(1, 1000, 333, 6, 2), (2, 77, 1000, 4, 4),
                                   (3, 1024, 1024, 2, 1)], ids=lambda s: "x".join(map(str, s)))
def test_mma_sync_backward_shapes_bf16(d_qk, d_v, shape):
    """bf16, causal, more shapes: seqlen_q > seqlen_k (bottom-right causal), MHA, whole
    blocks; deterministic twice to the same bits."""
    batch, sq, sk, h, hkv = shape
    q, k, v = _qkv(batch, sq, sk, h, hkv, d_qk, d_v, BF16, _seed("mma-bwd-bf16", d_qk, d_v,
                                                                   *shape))
    with _mma_sync_backward():
        _check_backward(q, k, v, family="mma.sync backward,", causal=True)
        grads = _check_backward(q, k, v, deterministic=True, family="mma.sync backward,",
                                causal=True)
        again = _check_backward(q, k, v, deterministic=True, family="mma.sync backward,",
                                causal=True)
    for a, b in zip(grads, again):
        assert bool((a.view(numpy.uint16) == b.view(numpy.uint16)).all())


@pytest.mark.parametrize("d_qk,d_v", MMA_BWD_PAIRS[:2])
@pytest.mark.parametrize("option", ["softcap", "alibi", "sinks", "window", "unbatched"])
def test_mma_sync_backward_features(d_qk, d_v, option):
    """The variant's features on the mma.sync backward with V's own head dim (each a part of
    phase A, whatever V's width)."""
    seed = _seed("mma-bwd-features", d_qk, d_v, option)
    batch = None if option == "unbatched" else 2
    q, k, v = _qkv(batch, 500, 700, 4, 2, d_qk, d_v, BF16, seed)
    options = _feature_options(option, numpy.random.default_rng(seed))
    with _mma_sync_backward():
        if option == "sinks":
            out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
            dout = _dout(q, v, seed)
            kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, **options)
            assert any(k_.startswith("mma.sync backward,") for k_ in kernels), kernels
            dq, dk, dv, dsinks = cuflash2.attention_backward(dout, q, k, v, out, lse, **options)
            results = testing.check_backward(dout, q, k, v, dq, dk, dv, dsinks, **options)
            assert all(r.ok for r in results), "; ".join(map(str, results))
            return
        _check_backward(q, k, v, family="mma.sync backward,", **options)


@pytest.mark.parametrize("d_qk,d_v", MMA_BWD_PAIRS[:2])
@pytest.mark.parametrize("deterministic", [False, True])
def test_mma_sync_varlen_backward_matches_the_reference(d_qk, d_v, deterministic):
    _check_varlen_backward(_seed("mma-varlen-bwd", d_qk, d_v, deterministic), d_qk, d_v,
                           backward=_mma_sync_backward, deterministic=deterministic)


@pytest.mark.parametrize("d_qk,d_v", MMA_BWD_PAIRS[:2])
def test_mma_sync_backward_with_dropout_matches_its_mask(d_qk, d_v):
    """Dropout, which the Hopper backward leaves to the mma.sync one (on sm_90 too, its switch
    on): both dQ paths against the reference given the mask."""
    q, k, v = _qkv(1, 130, 190, 4, 2, d_qk, d_v, BF16, _seed("mma-bwd-dropout", d_qk, d_v))
    drop = dict(dropout_p=0.2, seed=7, offset=3)
    mask = cuflash2.dropout_mask(1, 4, 130, 190, 0.2, 7, 3)
    out, lse = cuflash2.attention(q, k, v, return_lse=True, causal=True, **drop)
    dout = _dout(q, v, 8)
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, causal=True, **drop)
    assert any(k_.startswith("mma.sync backward,") for k_ in kernels), kernels
    for deterministic in (False, True):
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True,
                                            deterministic=deterministic, **drop)
        results = testing.check_backward(dout, q, k, v, *grads, causal=True, dropout_p=0.2,
                                         dropout_mask=mask)
        assert all(r.ok for r in results), (deterministic, [str(r) for r in results])
