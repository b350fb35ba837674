"""Variable-length sequences (`attention_varlen`, `attention_varlen_backward`): bitwise equal to
a loop of dense calls over the sequences (deterministic backward), within the 2x rule of the
reference (default backward), with ragged and empty sequences, seqlen_q != seqlen_k per
sequence, GQA, causal masks, windows, softcap and per-sequence ALiBi slopes, both dtypes."""

import dataclasses

import numpy
import pytest
from grids import DTYPES, seed_of, switched, varlen_inputs  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _configs, _dispatch, api, reference  # noqa: E402
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu

# (lengths_q, lengths_k, nheads, nheads_kv)
LAYOUTS = {
    "ragged": ([97, 1, 0, 300, 64], [97, 1, 0, 300, 64], 4, 4),
    "sq!=sk-gqa": ([33, 250, 129], [200, 17, 129], 6, 2),
    "one": ([513], [513], 2, 1),
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(48, 16)),
    "softcap-alibi-causal": dict(causal=True, softcap=4.0, alibi_slopes="batch"),
}


def _inputs(layout, headdim, dtype, seed):
    lengths_q, lengths_k, h, hk = LAYOUTS[layout]
    return varlen_inputs(cupy, lengths_q, lengths_k, h, hk, headdim, dtype, seed)


def _options(name, batch, nheads, seed):
    options = dict(OPTIONS[name])
    if options.get("alibi_slopes") == "batch":
        rng = numpy.random.default_rng(seed)
        options["alibi_slopes"] = cupy.asarray(
            rng.uniform(0.01, 0.5, size=(batch, nheads)).astype(numpy.float32))
    return options


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_varlen_matches_dense_loop_and_reference(dtype, headdim, layout, option):
    seed = seed_of(layout, headdim, option, str(dtype))
    q, k, v, dout, cu_q, cu_k, max_q, max_k = _inputs(layout, headdim, dtype, seed)
    batch, nheads = cu_q.shape[0] - 1, q.shape[1]
    options = _options(option, batch, nheads, seed + 1)
    args = (cu_q, cu_k, max_q, max_k)
    out = testing.poison_like(cupy, q.shape, dtype)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, return_lse=True, out=out, **options)
    assert lse.shape == (nheads, q.shape[0])

    # Against the reference (2x rule), forward and default (atomic) backward.
    ref_hi = reference.attention_varlen(q, k, v, *args, return_lse=True,
                                        compute_dtype=numpy.float32, **options)
    ref_lo = reference.attention_varlen(q, k, v, *args, compute_dtype=q.dtype, **options)
    result = testing.check_close("out", out, ref_hi[0], ref_lo)
    assert result.ok, str(result)
    assert testing.lse_close(lse, ref_hi[1]).ok
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args, **options)
    for result in testing.check_varlen_backward(dout, q, k, v, *grads, *args, **options):
        assert result.ok, str(result)

    # Against a loop of dense calls: the same tiles in the same order, so bitwise equal
    # (deterministic backward; dK and dV never use atomics). The dense calls run on the forward
    # kernel family the varlen call ran on (on an H100/H200 the Hopper kernel takes a short
    # sequence that the dispatcher would leave to mma.sync, and the other way round; dense d=64
    # calls on its two-consumer tiles, as varlen calls), and the backward on the main kernel
    # the varlen backward ran on: the Hopper one (forced to the varlen call's tile, which d=64
    # dense calls would not take by default) or the mma.sync one.
    on_hopper = "Hopper" in cuflash2.varlen_forward_kernels(q, k, v, *args, **options)[0]
    det = [testing.poison_like(cupy, x.shape, dtype) for x in (q, k, v)]
    api._backward_plans.plans.clear()
    cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args, deterministic=True,
                                       dq=det[0], dk=det[1], dv=det[2], **options)
    (plan,) = api._backward_plans.plans.values()
    main = plan.launches[1].config
    dense_main = None
    if isinstance(main, _configs.BwdSm90Config):
        dense_main = dataclasses.replace(main, features=main.features & ~_configs.FEATURE_VARLEN)
    cu_q_h, cu_k_h = cu_q.get(), cu_k.get()
    for b in range(batch):
        rq, rk = slice(int(cu_q_h[b]), int(cu_q_h[b + 1])), slice(int(cu_k_h[b]), int(cu_k_h[b + 1]))
        seq_options = dict(options)
        if "alibi_slopes" in seq_options:
            seq_options["alibi_slopes"] = cupy.ascontiguousarray(options["alibi_slopes"][b])
        with switched(_dispatch, {"HOPPER_FORWARD": on_hopper, "MMA_SYNC_MAX_KEYS": 0,
                                "THREE_CONSUMER_MIN_KEYS": {}}, api._forward_plans):
            o_b, lse_b = cuflash2.attention(q[rq], k[rk], v[rk], return_lse=True,
                                            **seq_options)
        assert bool((o_b.view(cupy.uint16) == out[rq].view(cupy.uint16)).all()), b
        assert bool((lse_b == lse[:, rq]).all()), b
        if dense_main is not None and rq.stop > rq.start and rk.stop > rk.start:
            backward = switched(_dispatch, {"FORCED": {"bwd": dense_main}},
                                api._backward_plans)
        else:
            backward = switched(_dispatch, {"HOPPER_BACKWARD": False}, api._backward_plans)
        with backward:
            g_b = cuflash2.attention_backward(dout[rq], q[rq], k[rk], v[rk], o_b, lse_b,
                                              deterministic=True, **seq_options)
        for name, got, want in zip(("dq", "dk", "dv"), (det[0][rq], det[1][rk], det[2][rk]), g_b):
            assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), (b, name)


@pytest.mark.parametrize("headdim", [d for d in _configs.KERNEL_HEAD_DIMS if d not in (64, 128)])
def test_varlen_every_head_dim(headdim):
    dtype = numpy.dtype(numpy.float16)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = _inputs("sq!=sk-gqa", headdim, dtype, headdim)
    args = (cu_q, cu_k, max_q, max_k)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    ref_hi = reference.attention_varlen(q, k, v, *args, causal=True, compute_dtype=numpy.float32)
    ref_lo = reference.attention_varlen(q, k, v, *args, causal=True, compute_dtype=q.dtype)
    assert testing.check_close("out", out, ref_hi, ref_lo).ok
    grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True)
    for result in testing.check_varlen_backward(dout, q, k, v, *grads, *args, causal=True):
        assert result.ok, result.name


def test_varlen_unchecked_cu_seqlens_run_without_sync_and_agree():
    dtype = numpy.dtype(numpy.float16)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = _inputs("ragged", 64, dtype, 1)
    a = cuflash2.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    b = cuflash2.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, check_cu_seqlens=False)
    assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def _bad(cu_q_values, max_q=100, dtype=numpy.int32):
    q, k, v, *_ = _inputs("ragged", 64, numpy.dtype(numpy.float16), 2)
    cu_q = cupy.asarray(numpy.asarray(cu_q_values, dtype=dtype))
    cu_k = cupy.asarray(numpy.asarray([0, 97, 98, 98, 398, 462], dtype=numpy.int32))
    return q, k, v, cu_q, cu_k, max_q, 300


@pytest.mark.parametrize("values,max_q,dtype,error,match", [
    ([0, 97, 98, 98, 398, 462], 300, numpy.int64, TypeError, "int32"),
    ([1, 97, 98, 98, 398, 462], 300, numpy.int32, ValueError, "must start with 0"),
    ([0, 97, 90, 98, 398, 462], 300, numpy.int32, ValueError, "non-decreasing"),
    ([0, 97, 98, 98, 398, 461], 300, numpy.int32, ValueError, "must equal the packed length"),
    ([0, 97, 98, 98, 398, 462], 299, numpy.int32, ValueError, "smaller than the longest"),
    ([0, 97, 98, 398, 462], 300, numpy.int32, ValueError, "same length"),
])
def test_bad_cu_seqlens_are_rejected(values, max_q, dtype, error, match):
    q, k, v, cu_q, cu_k, _, max_k = _bad(values, max_q, dtype)
    with pytest.raises(error, match=match):
        cuflash2.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)


def test_varlen_needs_packed_inputs():
    q, k, v = testing.random_qkv(cupy, 2, 16, 16, 2, 2, 64, numpy.float16, seed=1)
    cu = cupy.asarray(numpy.array([0, 16, 32], numpy.int32))
    with pytest.raises(ValueError, match="packed"):
        cuflash2.attention_varlen(q, k, v, cu, cu, 16, 16)
