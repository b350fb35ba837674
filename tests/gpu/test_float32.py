"""GPU tests of float32 inputs (cuflash2.attention and its backward at precision "highest" and
"tf32").

The rule is the 2x rule with the float64 reference as ref_hi: ref_lo is the reference computed
the plain way in float32 (precision "highest") or with the TF32 roundings of the tensor-core
products (precision "tf32": reference compute_dtype "tf32"), testing.check_forward's
`precision`. Inputs are fresh standard-normal draws; outputs are poisoned where given.
"""

import math

import numpy
import pytest
from grids import seed_of as _seed  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu

PRECISIONS = ("highest", "tf32")


@pytest.fixture(autouse=True)
def _hopper_highest_on():
    """The 3xTF32 Hopper forward switched on for every test here (the default; so that
    CUFLASH2_HOPPER_F32X3=0 in the environment does not leave it untested): on sm_90 "highest"
    up to head dim 128 runs it, the mma.sync kernel the rest (and test_forward_on_either_family
    both)."""
    from grids import switched

    from cuflash2 import _dispatch, api

    with switched(_dispatch, {"HOPPER_FORWARD_F32X3": True}, api._forward_plans):
        yield


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, seed_extra=""):
    seed = _seed(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, "float32" + seed_extra)
    return testing.random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                              numpy.float32, seed)


def _check(q, k, v, precision, out=None, **options):
    given = out
    out, lse = cuflash2.attention(q, k, v, precision=precision, return_lse=True, out=out,
                                  **options)
    assert out.dtype == numpy.float32 and out.shape == q.shape
    if given is not None:
        assert out is given
    results = testing.check_forward(q, k, v, out, lse, precision=precision, **options)
    print("; ".join(map(str, results)))
    assert all(r.ok for r in results), "; ".join(map(str, results))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_head_dims(precision, headdim, causal):
    """Every kernel head dim, with GQA and odd lengths, seqlen_q != seqlen_k."""
    q, k, v = _qkv(2, 97, 203, 4, 2, headdim)
    _check(q, k, v, precision, causal=causal)


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 300), (300, 1), (128, 128), (255, 513),
                                     (1000, 700)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_lengths(precision, seqlens):
    q, k, v = _qkv(1, *seqlens, 2, 1, 64)
    _check(q, k, v, precision, causal=True)
    _check(q, k, v, precision)


@pytest.mark.parametrize("headdim", [40, 72, 136])
def test_odd_head_dims_pad_in_shared_memory_only(headdim):
    q, k, v = _qkv(1, 77, 91, 2, 2, headdim)
    _check(q, k, v, "highest", causal=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_features(precision):
    """Window, softcap, ALiBi and sinks, each and together; out given (poisoned)."""
    q, k, v = _qkv(2, 150, 260, 4, 2, 64)
    slopes = cupy.asarray(numpy.linspace(0.05, 0.5, 4, dtype=numpy.float32))
    sinks = cupy.asarray(numpy.linspace(-1.0, 2.0, 4, dtype=numpy.float32))
    for options in ({"window_size": (40, 10)}, {"softcap": 5.0}, {"alibi_slopes": slopes},
                    {"sinks": sinks},
                    {"causal": True, "window_size": (64, 0), "softcap": 3.0,
                     "alibi_slopes": slopes, "sinks": sinks}):
        out = testing.poison_like(cupy, q.shape, numpy.float32)
        _check(q, k, v, precision, out=out, **options)


def test_dropout_matches_its_mask():
    q, k, v = _qkv(1, 130, 190, 2, 2, 64)
    mask = cuflash2.dropout_mask(1, 2, 130, 190, 0.2, 7)
    out, lse = cuflash2.attention(q, k, v, dropout_p=0.2, seed=7, return_lse=True)
    results = testing.check_forward(q, k, v, out, lse, dropout_p=0.2, dropout_mask=mask,
                                    precision="highest")
    assert all(r.ok for r in results), "; ".join(map(str, results))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_varlen_and_packed(precision):
    lengths = [1, 70, 129, 33]
    cu = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    total = int(cu[-1])
    q, k, v = (x[0] for x in _qkv(1, total, total, 4, 2, 64, "varlen"))
    cu_d = cupy.asarray(cu)
    out = cuflash2.attention_varlen(q, k, v, cu_d, cu_d, max(lengths), max(lengths),
                                    causal=True, precision=precision)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        results = testing.check_forward(q[rows], k[rows], v[rows], out[rows], causal=True,
                                        precision=precision)
        assert all(r.ok for r in results), f"sequence {b}: " + "; ".join(map(str, results))
    qkv = cupy.stack(_qkv(2, 90, 90, 3, 3, 64, "packed"), axis=2)
    out = cuflash2.attention_qkvpacked(qkv, causal=True, precision=precision)
    results = testing.check_forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, causal=True,
                                    precision=precision)
    assert all(r.ok for r in results), "; ".join(map(str, results))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_unbatched_and_strided_views(precision):
    q, k, v = _qkv(1, 64, 96, 2, 2, 64)
    _check(q[0], k[0], v[0], precision, causal=True)
    # A view with a head stride of 4 float32 elements... of a wider array: every stride a
    # multiple of 16 bytes.
    wide = cupy.asarray(numpy.random.default_rng(3).standard_normal((1, 96, 2, 72),
                                                                    dtype=numpy.float32))
    _check(q, wide[..., :64], wide[..., 8:], precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_graph_replays_with_fresh_inputs(precision):
    """A captured call replayed as a serving loop replays it: new values in the same arrays
    (at "tf32" on sm_90 two launches, the operand pass writing the call's scratch)."""
    from cuflash2.bench.decode_graph import CapturedGraph

    q, k, v = _qkv(2, 200, 300, 4, 2, 128)
    captured = {}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # planned and compiled outside the capture
        cuflash2.attention(q, k, v, causal=True, precision=precision)
    stream.synchronize()
    graph = CapturedGraph(cupy, stream, lambda: captured.update(
        out=cuflash2.attention(q, k, v, causal=True, precision=precision)))
    rng = numpy.random.default_rng(11)
    for _ in range(3):
        for x in (q, k, v):  # (on the current stream, which `stream` does not wait for)
            x[...] = cupy.asarray(rng.standard_normal(x.shape, dtype=numpy.float32))
        cupy.cuda.Device().synchronize()
        graph.launch()
        stream.synchronize()
        results = testing.check_forward(q, k, v, captured["out"], causal=True,
                                        precision=precision)
        assert all(r.ok for r in results), "; ".join(map(str, results))


@pytest.mark.parametrize("headdim", [64, 128])
def test_highest_is_float32_accurate_and_tf32_is_not(headdim):
    """"highest" stays within float32-level error of the float64 reference (a few times the
    plain float32 reference's), where "tf32" is about a thousand times further (d=64: the
    3xTF32 Hopper forward on sm_90; d=128: the mma.sync one)."""
    q, k, v = _qkv(1, 512, 512, 2, 2, headdim)
    ref = cuflash2.reference.attention(q, k, v, compute_dtype=numpy.float64)
    plain = cuflash2.reference.attention(q, k, v, compute_dtype=numpy.float32)
    plain_err = float(cupy.abs(plain - ref).max())
    highest = float(cupy.abs(cuflash2.attention(q, k, v) - ref).max())
    tf32 = float(cupy.abs(cuflash2.attention(q, k, v, precision="tf32") - ref).max())
    print(f"max error against float64: plain float32 {plain_err:.2e}, highest {highest:.2e}, "
          f"tf32 {tf32:.2e}")
    assert highest <= 8 * plain_err + 1e-6
    assert tf32 > 30 * highest


def test_kernels_named():
    """On sm_90 "highest" runs the operand pass and the 3xTF32 Hopper forward up to d=128 and
    the mma.sync forward above; "tf32" the operand pass and the TF32 Hopper forward; elsewhere
    the mma.sync forward."""
    q, k, v = _qkv(1, 300, 300, 2, 2, 128)
    _assert_float32_forward(cuflash2.forward_kernels(q, k, v, causal=True, precision="highest"),
                            "float32", 128)
    small = [x[..., :64].copy() for x in (q, k, v)]
    _assert_float32_forward(cuflash2.forward_kernels(*small, causal=True, precision="highest"),
                            "float32", 64)
    _assert_float32_forward(cuflash2.forward_kernels(q, k, v, causal=True, precision="tf32"),
                            "tf32", 128)
    wide = _qkv(1, 300, 300, 2, 2, 160)
    kernels = cuflash2.forward_kernels(*wide, causal=True, precision="highest")
    assert kernels[0].startswith("mma.sync forward, float32"), kernels


def _assert_float32_forward(kernels, tag: str, head_dim: int):
    """On sm_90 the operand pass and the Hopper forward of `tag`, elsewhere the mma.sync one."""
    if cupy.cuda.Device().compute_capability == "90":
        assert kernels[0].startswith("forward operand pass"), kernels
        assert kernels[1].startswith("Hopper forward (sm_90a: wgmma, TMA, warp-specialised), "
                                     f"{tag}, head dim {head_dim}"), kernels
    else:
        assert kernels[0].startswith(f"mma.sync forward, {tag}, head dim {head_dim}"), kernels


@pytest.mark.parametrize("precision,headdim,flag", [
    ("tf32", 64, "HOPPER_FORWARD_TF32"), ("tf32", 96, "HOPPER_FORWARD_TF32"),
    ("tf32", 128, "HOPPER_FORWARD_TF32"), ("highest", 64, "HOPPER_FORWARD_F32X3"),
    ("highest", 80, "HOPPER_FORWARD_F32X3"), ("highest", 96, "HOPPER_FORWARD_F32X3"),
    ("highest", 128, "HOPPER_FORWARD_F32X3")])
def test_forward_on_either_family(precision, headdim, flag):
    """On sm_90 precision "tf32" runs the TF32 Hopper forward (up to head dim 128) and
    "highest" the 3xTF32 one (up to 128; d=80 on the d=96 kernel), and with their switch off
    (CUFLASH2_HOPPER_TF32=0, CUFLASH2_HOPPER_F32X3=0: `_dispatch.HOPPER_FORWARD_TF32`,
    `HOPPER_FORWARD_F32X3`) the mma.sync forward: both within the rule, on a long enough row for
    several KV tiles and a ring that wraps, GQA, seqlen_q != seqlen_k."""
    from grids import switched

    from cuflash2 import _dispatch, api

    q, k, v = _qkv(2, 700, 1100, 4, 2, headdim, "either")
    for hopper in (True, False):
        with switched(_dispatch, {flag: hopper}, api._forward_plans):
            for causal in (False, True):
                out = testing.poison_like(cupy, q.shape, numpy.float32)
                _check(q, k, v, precision, out=out, causal=causal)


def test_what_float32_does_not_take_yet():
    q, k, v = _qkv(1, 16, 16, 1, 1, 64)
    with pytest.raises(NotImplementedError, match="mask_mod, score_mod, bias"):
        cuflash2.attention(q, k, v, mask_mod=cuflash2.mask_mod("kv_idx <= q_idx"))
    with pytest.raises(NotImplementedError, match="attention_with_kvcache: float32"):
        cuflash2.attention_with_kvcache(q, k, v)
    with pytest.raises(ValueError, match="precision applies to float32 inputs only"):
        cuflash2.attention(q.astype(numpy.float16), k.astype(numpy.float16),
                           v.astype(numpy.float16), precision="tf32")
    assert math.isfinite(float(cuflash2.attention(q, k, v, precision="high").sum()))


# --------------------------------------------------------------------------------------------
# The backward (attention_backward, the packed and varlen backwards, attention_vjp): gradients
# by the 2x rule with float64 as ref_hi (testing.check_backward's `precision`). The absolute
# slack is 1e-5 of the largest gradient (at least 1e-5): ~170 float32 ulps, which a 3xTF32
# product's split (2^-22 of each operand) and the atomic dQ sums' order stay within, and two
# orders below a TF32 rounding (so "highest" is checked at float32 level). Beyond 256 rows a
# gradient's float32 sums (dK and dV over the query rows, dQ over the keys, added tile by tile
# in the kernel where the reference's matrix products sum pairwise) round about sqrt(n) times
# as often: the slack grows as sqrt(n / 256) (measured on an H100: dK of 700 query rows 1.5e-5
# against the reference's 2x bound of 1.1e-5 at "highest").


def _grad_atol(grads, rows: int = 256):
    return 1e-5 * max(1.0, math.sqrt(rows / 256)) * max(
        [1.0] + [float(cupy.abs(g).max()) for g in grads if g.size])


def _dout(q, seed_extra=""):
    rng = numpy.random.default_rng(_seed(*q.shape, "dout" + seed_extra))
    return cupy.asarray(rng.standard_normal(q.shape, dtype=numpy.float32))


def _check_backward(q, k, v, precision, poisoned=True, **options):
    """Forward, then backward into NaN-poisoned given gradients (or allocated ones), checked
    against the reference."""
    out, lse = cuflash2.attention(q, k, v, precision=precision, return_lse=True, **options)
    dout = _dout(q)
    given = {}
    if poisoned:
        given = {name: testing.poison_like(cupy, x.shape, numpy.float32)
                 for name, x in (("dq", q), ("dk", k), ("dv", v))}
        if options.get("sinks") is not None:
            given["dsinks"] = testing.poison_like(cupy, options["sinks"].shape, numpy.float32)
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, precision=precision,
                                        **given, **options)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        assert g.dtype == numpy.float32
        if name in given:
            assert g is given[name]
    rows = max(q.shape[-3], k.shape[-3])  # the longest sum of a gradient
    results = testing.check_backward(dout, q, k, v, *grads, atol=_grad_atol(grads[:3], rows),
                                     precision=precision, **options)
    print("; ".join(map(str, results)))
    assert all(r.ok for r in results), "; ".join(map(str, results))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_head_dims(precision, headdim, causal):
    """Every kernel head dim (where a tile fits the GPU: NotImplementedError above d=192 on
    the 100 KiB parts), with GQA and odd lengths, seqlen_q != seqlen_k."""
    q, k, v = _qkv(2, 97, 203, 4, 2, headdim, "bwd")
    if headdim > 192 and int(cupy.cuda.Device().compute_capability) in (86, 89):
        with pytest.raises(NotImplementedError, match="float32 backward at head dim"):
            _check_backward(q, k, v, precision, causal=causal)
        return
    _check_backward(q, k, v, precision, causal=causal)


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 300), (300, 1), (128, 128), (255, 513),
                                     (700, 400)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_lengths(precision, seqlens):
    q, k, v = _qkv(1, *seqlens, 2, 1, 64, "bwd")
    _check_backward(q, k, v, precision, causal=True)
    _check_backward(q, k, v, precision, poisoned=False)


@pytest.mark.parametrize("headdim", [40, 72, 136])
def test_backward_odd_head_dims(headdim):
    q, k, v = _qkv(1, 77, 91, 2, 1, headdim, "bwd")
    _check_backward(q, k, v, "highest", causal=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_features(precision):
    """Window, softcap, ALiBi and sinks (dsinks), each and together."""
    q, k, v = _qkv(2, 150, 260, 4, 2, 64, "bwd")
    slopes = cupy.asarray(numpy.linspace(0.05, 0.5, 4, dtype=numpy.float32))
    sinks = cupy.asarray(numpy.linspace(-1.0, 2.0, 4, dtype=numpy.float32))
    for options in ({"window_size": (40, 10)}, {"softcap": 5.0}, {"alibi_slopes": slopes},
                    {"sinks": sinks},
                    {"causal": True, "window_size": (64, 0), "softcap": 3.0,
                     "alibi_slopes": slopes, "sinks": sinks}):
        _check_backward(q, k, v, precision, **options)


def test_backward_dropout_matches_its_mask():
    q, k, v = _qkv(1, 130, 190, 2, 2, 64, "bwd")
    mask = cuflash2.dropout_mask(1, 2, 130, 190, 0.2, 7)
    out, lse = cuflash2.attention(q, k, v, dropout_p=0.2, seed=7, return_lse=True)
    dout = _dout(q)
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, dropout_p=0.2, seed=7)
    results = testing.check_backward(dout, q, k, v, *grads, atol=_grad_atol(grads),
                                     dropout_p=0.2, dropout_mask=mask, precision="highest")
    assert all(r.ok for r in results), "; ".join(map(str, results))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_varlen_packed_and_vjp(precision):
    lengths = [1, 70, 129, 33]
    cu = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    total = int(cu[-1])
    q, k, v = (x[0] for x in _qkv(1, total, total, 4, 2, 64, "bwd-varlen"))
    cu_d = cupy.asarray(cu)
    out, lse = cuflash2.attention_varlen(q, k, v, cu_d, cu_d, max(lengths), max(lengths),
                                         causal=True, precision=precision, return_lse=True)
    dout = _dout(q, "varlen")
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, cu_d, cu_d,
                                               max(lengths), max(lengths), causal=True,
                                               precision=precision)
    results = testing.check_varlen_backward(dout, q, k, v, *grads, cu_d, cu_d, max(lengths),
                                            max(lengths), atol=_grad_atol(grads), causal=True,
                                            precision=precision)
    assert all(r.ok for r in results), "; ".join(map(str, results))

    qkv = cupy.stack(_qkv(2, 90, 90, 3, 3, 64, "bwd-packed"), axis=2)
    out, lse = cuflash2.attention_qkvpacked(qkv, causal=True, precision=precision,
                                            return_lse=True)
    dout = _dout(out, "packed")
    dqkv = cuflash2.attention_qkvpacked_backward(dout, qkv, out, lse, causal=True,
                                                 precision=precision)
    grads = [dqkv[:, :, i] for i in range(3)]
    results = testing.check_backward(dout, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *grads,
                                     atol=_grad_atol(grads), causal=True, precision=precision)
    assert all(r.ok for r in results), "; ".join(map(str, results))

    q, k, v = _qkv(1, 64, 80, 2, 1, 64, "bwd-vjp")
    out, vjp = cuflash2.attention_vjp(q, k, v, causal=True, precision=precision)
    dout = _dout(q, "vjp")
    grads = vjp(dout)
    results = testing.check_backward(dout, q, k, v, *grads, atol=_grad_atol(grads),
                                     causal=True, precision=precision)
    assert all(r.ok for r in results), "; ".join(map(str, results))


def test_backward_highest_is_float32_accurate_and_tf32_is_not():
    q, k, v = _qkv(1, 256, 256, 2, 2, 128, "bwd-accuracy")
    dout = _dout(q)
    ref = cuflash2.reference.attention_backward(dout, q, k, v, None, None,
                                                compute_dtype=numpy.float64)
    errors = {}
    for precision in PRECISIONS:
        out, lse = cuflash2.attention(q, k, v, precision=precision, return_lse=True)
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, precision=precision)
        errors[precision] = max(float(cupy.abs(g - r).max()) for g, r in zip(grads, ref))
    print(f"max gradient error against float64: {errors}")
    assert errors["tf32"] > 30 * errors["highest"]


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_deterministic(precision, headdim):
    """deterministic=True (the dQ kernel): the same bits on a second run, GQA, causal, odd
    lengths, checked as the atomic path."""
    q, k, v = _qkv(2, 157, 211, 4, 2, headdim, "bwd-deterministic")
    out, lse = cuflash2.attention(q, k, v, causal=True, precision=precision, return_lse=True)
    dout = _dout(q)
    first = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True,
                                        precision=precision, deterministic=True)
    again = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True,
                                        precision=precision, deterministic=True,
                                        dq=testing.poison_like(cupy, q.shape, numpy.float32))
    for a, b in zip(first, again):
        assert bool((a.view(numpy.uint32) == b.view(numpy.uint32)).all())
    results = testing.check_backward(dout, q, k, v, *first, atol=_grad_atol(first),
                                     causal=True, precision=precision)
    assert all(r.ok for r in results), "; ".join(map(str, results))
