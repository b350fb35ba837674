"""cuflash2.merge_states / merge_states_many on the GPU.

Keys split in two (and in four), cuflash2.attention with return_lse on each part, merged, against
the reference over all of the keys by the 2x rule of cuflash2.testing (check_forward, lse_close):
fp16, bf16 and float32, causal with seqlen_q > seqlen_k (rows that see no key at all, and rows
that see keys of one part only: the first part's call keeps the full problem's diagonal with a
window, the second's is causal), GQA, unbatched (varlen's (total_q, nheads, headdim) layout),
into poisoned outputs, in place, stacked. Then the kernel against reference.merge_states on the
same states, within a rounding of the states' dtype: head dims from 8 to 512 (every lane count,
rows looped over by their lanes), states without keys (+inf and -inf) whose outs hold nan,
strided and reversed views, many states, a side stream."""

import math

import numpy
import pytest
from grids import BF16, FP16, seed_of

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import reference, testing  # noqa: E402

pytestmark = pytest.mark.gpu

F32 = numpy.dtype(numpy.float32)
DTYPES = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16"),
          pytest.param(F32, id="fp32")]


def _parts(q, k, v, bounds, causal, outs=None):
    """attention(..., return_lse=True) of q over keys [bounds[i], bounds[i + 1]) each, with the
    full problem's mask: a part's keys j see the rows i with j <= i + seqlen_k - seqlen_q
    (causal), which is a right window of seqlen_k - end beyond the part's own diagonal (the
    last part: causal itself). `outs`: arrays to write the outs into (out=)."""
    seqlen_k = k.shape[-3]
    results = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        options = {}
        if causal:
            options = (dict(causal=True) if end == seqlen_k
                       else dict(window_size=(-1, seqlen_k - end)))
        out = None if outs is None else outs[i]
        results.append(cuflash2.attention(q, k[..., start:end, :, :], v[..., start:end, :, :],
                                          return_lse=True, out=out, **options))
    return results


def _bits(x):
    """x's bits (CuPy compares bfloat16 arrays through them)."""
    return x.view(numpy.uint32 if x.dtype == F32 else numpy.uint16)


def _check_against_one_call(q, k, v, out, lse, causal):
    results = testing.check_forward(q, k, v, out, lse, causal=causal)
    assert all(r.ok for r in results), [str(r) for r in results]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), pytest.param(True,
                                                                               id="causal")])
@pytest.mark.parametrize("shape", [
    pytest.param((2, 113, 300, 4, 2, 64), id="gqa-d64"),
    pytest.param((1, 257, 200, 2, 2, 128), id="sq>sk-d128"),  # causal: 57 rows see no key
    pytest.param((None, 64, 129, 3, 1, 96), id="unbatched-mqa-d96"),
])
def test_keys_split_in_two_merge_into_one_call(dtype, causal, shape):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, d = shape
    q, k, v = testing.random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads_kv, d, dtype,
                                 seed_of("merge2", dtype.name, causal, shape))
    split = seqlen_k * 2 // 5
    (out_a, lse_a), (out_b, lse_b) = _parts(q, k, v, (0, split, seqlen_k), causal)
    poisoned = testing.poison_like(cupy, q.shape, dtype)
    lse_poisoned = testing.poison_like(cupy, lse_a.shape, F32)
    out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b, out=poisoned,
                                     lse=lse_poisoned)
    assert out is poisoned and lse is lse_poisoned
    _check_against_one_call(q, k, v, out, lse, causal)
    if causal and seqlen_q > seqlen_k:
        empty = seqlen_q - seqlen_k
        assert bool((_bits(out[..., :empty, :, :]) == 0).all())
        assert bool(cupy.isposinf(lse[..., :empty]).all())
    # A new pair of outputs, then in place over the first state: the same values.
    fresh_out, fresh_lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b)
    assert fresh_out.dtype == dtype and fresh_lse.dtype == F32
    in_out, in_lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b, out=out_a, lse=lse_a)
    assert in_out is out_a and in_lse is lse_a
    for got in (fresh_out, out_a):
        assert bool(cupy.array_equal(_bits(got), _bits(out)))
    for got in (fresh_lse, lse_a):
        assert bool(cupy.array_equal(got, lse))


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_parts_written_into_a_stack(dtype):
    """Four parts (causal, seqlen_q > seqlen_k: early rows see keys of the first parts only),
    each call writing into its slice of one stack; one merge_states_many."""
    batch, seqlen_q, seqlen_k, nheads, d = 2, 160, 150, 4, 64
    q, k, v = testing.random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads, d, dtype,
                                 seed_of("merge-many", dtype.name))
    bounds = (0, 40, 77, 121, seqlen_k)
    outs = testing.poison_like(cupy, (4,) + q.shape, dtype)
    lses = cupy.stack([lse for _, lse in _parts(q, k, v, bounds, True, outs=outs)])
    out, lse = cuflash2.merge_states_many(outs, lses)
    _check_against_one_call(q, k, v, out, lse, True)
    # In place over a state of the stack.
    merged, merged_lse = cuflash2.merge_states_many(outs, lses, out=outs[2], lse=lses[2])
    assert bool(cupy.array_equal(_bits(outs[2]), _bits(out)))
    assert bool(cupy.array_equal(lses[2], lse))


# ---------------------------------------------------------------------------------------------
# The kernel against the reference on the same states


def _random_states(num_states, shape, dtype, seed, empty_fraction=0.2):
    """outs (num_states, *shape) of dtype and float32 lses: normal outs, lses spread over +-8,
    +inf or -inf (no key) at `empty_fraction` of the entries, whose out rows are nan."""
    rng = numpy.random.default_rng(seed)
    outs = rng.standard_normal((num_states,) + shape).astype(numpy.float32)
    lse_shape = (num_states,) + shape[:-3] + (shape[-2], shape[-3])
    lses = (rng.standard_normal(lse_shape) * 8).astype(numpy.float32)
    empty = rng.random(lse_shape) < empty_fraction
    lses[empty] = numpy.where(rng.random(int(empty.sum())) < 0.5, math.inf, -math.inf)
    outs[numpy.swapaxes(empty, -1, -2)] = math.nan
    return cupy.asarray(outs).astype(dtype), cupy.asarray(lses)


def _assert_matches_reference(outs, lses, out, lse):
    """The kernel's (out, lse) against reference.merge_states_many of the states `outs`, `lses`
    (sequences of CuPy arrays, compared on the host)."""
    ref_out, ref_lse = reference.merge_states_many(numpy.stack([cupy.asnumpy(x) for x in outs]),
                                                   numpy.stack([cupy.asnumpy(x) for x in lses]))
    dtype = numpy.dtype(out.dtype)
    got = cupy.asnumpy(out).astype(numpy.float64)
    assert not numpy.isnan(got).any()
    # One rounding of the dtype apart (the kernel's float32 result and the float64 one each
    # rounded once), plus a few float32 ulps of the weighted sum's terms: the kernel adds
    # w_s out_s in float32, so where the terms cancel the error is relative to them, not to the
    # (small) result.
    eps = {FP16: 2.0**-10, BF16: 2.0**-7, F32: 2.0**-20}[dtype]
    ref_out = ref_out.astype(numpy.float64)
    with numpy.errstate(invalid="ignore", over="ignore"):
        weights = [numpy.where(numpy.isfinite(l), numpy.exp(l - ref_lse), 0.0)
                   for l in (cupy.asnumpy(x).astype(numpy.float64) for x in lses)]
    terms = sum(numpy.nan_to_num(numpy.swapaxes(w, -1, -2)[..., None]
                                 * numpy.abs(cupy.asnumpy(o).astype(numpy.float64)))
                for w, o in zip(weights, outs))
    err = numpy.abs(got - ref_out)
    bound = eps * numpy.maximum(numpy.abs(ref_out), 2.0**-14) + 2.0**-20 * terms
    assert (err <= bound).all(), (err - bound).max()
    got_lse = cupy.asnumpy(lse)
    assert numpy.array_equal(numpy.isposinf(got_lse), numpy.isinf(ref_lse))
    finite = numpy.isfinite(ref_lse)
    numpy.testing.assert_allclose(got_lse[finite], ref_lse[finite], rtol=2e-6, atol=2e-6)
    keyless = numpy.isinf(numpy.swapaxes(ref_lse, -1, -2))  # rows: out 0
    assert (got[keyless] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 16, 40, 72, 128, 256, 512])
def test_kernel_matches_the_reference_at_every_lane_count(dtype, d):
    outs, lses = _random_states(2, (3, 37, 5, d), dtype, seed_of("lanes", dtype.name, d))
    out, lse = cuflash2.merge_states(outs[0], lses[0], outs[1], lses[1])
    _assert_matches_reference(outs, lses, out, lse)
    assert out.dtype == dtype and lse.dtype == F32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_states", [1, 3, 4, 5, 9])
def test_many_states_match_the_reference(dtype, num_states):
    outs, lses = _random_states(num_states, (71, 6, 64), dtype,
                                seed_of("many", dtype.name, num_states), empty_fraction=0.4)
    lses[:, 0, :3] = math.inf  # rows no state saw a key of
    out, lse = cuflash2.merge_states_many(outs, lses)
    _assert_matches_reference(outs, lses, out, lse)


def test_strided_states_and_outputs_on_a_side_stream():
    """States as head slices and reversed rows of larger arrays, lses transposed views, the
    stack's state dim a stride of a larger one, outputs into strided views; on a side stream."""
    dtype = BF16
    big, big_lse = _random_states(3, (2, 50, 8, 64), dtype, seed_of("strided"))
    out_a, out_b = big[0, :, :, :4], big[1, :, ::-1, 4:]
    lse_a = cupy.ascontiguousarray(big_lse[0, :, :4].transpose(0, 2, 1)).transpose(0, 2, 1)
    assert not lse_a.flags.c_contiguous
    lse_b = big_lse[1, :, 4:, ::-1]
    target = testing.poison_like(cupy, (2, 50, 8, 64), dtype)[:, :, 2:6]
    target_lse = testing.poison_like(cupy, (2, 50, 8), F32).transpose(0, 2, 1)[:, 1:5]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b, out=target,
                                         lse=target_lse)
        stacked_out, stacked_lse = cuflash2.merge_states_many(big[:2, :, :, ::2],
                                                              big_lse[:2, :, ::2])
    stream.synchronize()
    _assert_matches_reference([out_a, out_b], [lse_a, lse_b], out, lse)
    _assert_matches_reference(big[:2, :, :, ::2], big_lse[:2, :, ::2], stacked_out, stacked_lse)


def test_merged_lse_drives_the_backward():
    """The merge of two parts gives the out and lse of one call: attention_backward from them
    matches the backward of the reference over all keys (rows without keys: lse +inf)."""
    q, k, v = testing.random_qkv(cupy, 1, 150, 120, 2, 2, 64, FP16, seed_of("merge-bwd"))
    (out_a, lse_a), (out_b, lse_b) = _parts(q, k, v, (0, 50, 120), True)
    out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b)
    dout = cupy.asarray(numpy.random.default_rng(5).standard_normal(q.shape).astype(FP16))
    dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True)
    results = testing.check_backward(dout, q, k, v, dq, dk, dv, causal=True)
    assert all(r.ok for r in results), [str(r) for r in results]
