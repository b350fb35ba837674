"""GPU tests of cuflash2.attention (forward) against cuflash2.reference (docs/DESIGN.md §5).

Every result is judged by cuflash2.testing's rule: max|out - ref_hi| <= 2 max|ref_lo - ref_hi|
+ atol, with ref_hi the float32 reference and ref_lo the reference in the input dtype, both
computed with CuPy on the same device. Inputs are fresh standard-normal draws; problem sizes are
kept small so the whole file runs in well under three minutes once the kernels are compiled.
"""

import math
import time

import numpy
import pytest
from grids import CAUSAL, DTYPES, FP16, HEAD_DIMS, HEAD_LAYOUTS, SEQLENS  # tests/gpu helper
from grids import seed_of as _seed

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402  (after the CuPy skip: the package is only usable with CuPy)
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype):
    seed = _seed(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, str(dtype))
    return testing.random_qkv(
        cupy, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed
    )


def _lse_shape(q):
    """(batch, nheads, seqlen_q), or (nheads, seqlen_q) for unbatched q."""
    return q.shape[:-3] + (q.shape[-2], q.shape[-3])


def _attention_and_check(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None):
    """Run cuflash2.attention, check types and shapes, and apply the correctness rule."""
    result = cuflash2.attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out
    )
    got, lse = result if return_lse else (result, None)
    assert isinstance(got, cupy.ndarray)
    assert got.dtype == q.dtype and got.shape == q.shape
    if out is not None:
        assert got is out
    if return_lse:
        assert isinstance(lse, cupy.ndarray)
        assert lse.dtype == numpy.float32 and lse.shape == _lse_shape(q)
    results = testing.check_forward(
        q, k, v, got, lse, causal=causal, softmax_scale=softmax_scale
    )
    assert all(r.ok for r in results), "; ".join(map(str, results))
    return result


# --------------------------------------------------------------------------------------------
# Coverage grids.


@pytest.mark.parametrize("seqlen_k", SEQLENS)
@pytest.mark.parametrize("seqlen_q", SEQLENS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlen_grid(dtype, headdim, causal, seqlen_q, seqlen_k):
    """Every pair of sequence lengths (tile tails, sq != sk both ways) at two head dims."""
    q, k, v = _random_qkv(1, seqlen_q, seqlen_k, 2, 2, headdim, dtype)
    _attention_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(dtype, headdim, causal, layout):
    """Every supported head dim, both dtypes, causal and not, with MHA, GQA and MQA."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = HEAD_LAYOUTS[layout]
    q, k, v = _random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype)
    _attention_and_check(q, k, v, causal=causal, return_lse=True)


# --------------------------------------------------------------------------------------------
# Layouts: strided inputs, unbatched inputs.


def _strided_on_device(host, layout):
    """A CuPy array equal to host (b, s, h, d) whose only contiguous dim is the last one.

    Built on the host (NumPy handles bf16 everywhere) and sliced on the device (a view).
    """
    b, s, h, d = host.shape
    if layout == "every_other_head":
        wide = numpy.zeros((b, s, 2 * h, d), host.dtype)
        wide[:, :, 1::2] = host
        return cupy.asarray(wide)[:, :, 1::2]
    if layout == "every_other_position":
        long = numpy.zeros((b, 2 * s, h, d), host.dtype)
        long[:, 1::2] = host
        return cupy.asarray(long)[:, 1::2]
    if layout == "bhsd_storage":  # (batch, heads, seqlen, dim) memory viewed as (b, s, h, d)
        stored = numpy.ascontiguousarray(host.transpose(0, 2, 1, 3))
        return cupy.asarray(stored).transpose(0, 2, 1, 3)
    if layout == "padded_rows":  # each head's row padded by 8 elements (16 bytes)
        padded = numpy.zeros((b, s, h, d + 8), host.dtype)
        padded[..., :d] = host
        return cupy.asarray(padded)[..., :d]
    raise ValueError(layout)


@pytest.mark.parametrize(
    "layout", ["every_other_head", "every_other_position", "bhsd_storage", "padded_rows"]
)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [40, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_inputs(dtype, headdim, causal, layout):
    seed = _seed("strided", headdim, layout, str(dtype))
    host = testing.random_qkv(numpy, 3, 97, 130, 6, 2, headdim, dtype, seed)
    q, k, v = (_strided_on_device(x, layout) for x in host)
    assert not any(x.flags.c_contiguous for x in (q, k, v))
    _attention_and_check(q, k, v, causal=causal, return_lse=True)
    # The user's arrays are read, never written.
    for original, device in zip(host, (q, k, v)):
        numpy.testing.assert_array_equal(cupy.asnumpy(device), original)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unbatched_input(dtype, headdim, causal):
    q, k, v = _random_qkv(None, 130, 97, 6, 2, headdim, dtype)
    assert q.ndim == 3
    out, lse = _attention_and_check(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (130, 6, headdim) and lse.shape == (6, 130)


# --------------------------------------------------------------------------------------------
# lse, out=, softmax_scale.


@pytest.mark.parametrize("seqlens", [(128, 128), (255, 97), (97, 255), (1, 1025), (1025, 1)], ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lse(dtype, headdim, causal, seqlens):
    """lse against the float32 reference; with causal and sq > sk, key-less rows give +inf."""
    seqlen_q, seqlen_k = seqlens
    q, k, v = _random_qkv(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype)
    out, lse = _attention_and_check(q, k, v, causal=causal, return_lse=True)
    keyless_rows = max(0, seqlen_q - seqlen_k) if causal else 0
    lse_host = cupy.asnumpy(lse)
    assert numpy.all(lse_host[:, :, :keyless_rows] == math.inf)
    assert numpy.all(numpy.isfinite(lse_host[:, :, keyless_rows:]))
    assert numpy.all(cupy.asnumpy(out[:, :keyless_rows]).astype(numpy.float32) == 0)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("seqlens", [(97, 97), (255, 97)], ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 192])
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_argument(dtype, headdim, causal, seqlens, return_lse):
    """out= is filled completely (NaN poison gone, key-less rows zeroed) and returned as is."""
    seqlen_q, seqlen_k = seqlens
    q, k, v = _random_qkv(2, seqlen_q, seqlen_k, 4, 4, headdim, dtype)
    out = testing.poison_like(cupy, q.shape, q.dtype)
    _attention_and_check(q, k, v, causal=causal, return_lse=return_lse, out=out)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any())


@pytest.mark.parametrize("softmax_scale", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_scale(dtype, causal, softmax_scale):
    q, k, v = _random_qkv(2, 97, 128, 4, 2, 64, dtype)
    _attention_and_check(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    # The scale really is used: a different scale gives a clearly different output.
    default = cuflash2.attention(q, k, v, causal=causal).astype(cupy.float32)
    scaled = cuflash2.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert float(cupy.abs(scaled.astype(cupy.float32) - default).max()) > 0.05


# --------------------------------------------------------------------------------------------
# Zero-size inputs.


@pytest.mark.parametrize("sizes", [(0, 17, 17), (2, 0, 17), (2, 17, 0), (0, 0, 0)], ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_size(dtype, causal, sizes):
    """Empty problems return correctly shaped results; seqlen_k = 0 means every row sees no key."""
    batch, seqlen_q, seqlen_k = sizes
    q, k, v = _random_qkv(batch, seqlen_q, seqlen_k, 4, 2, 64, dtype)

    plain = cuflash2.attention(q, k, v, causal=causal)
    assert plain.shape == q.shape and plain.dtype == q.dtype

    out = testing.poison_like(cupy, q.shape, q.dtype)
    got, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True, out=out)
    assert got is out
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == numpy.float32
    if seqlen_k == 0:
        for result in (plain, got):
            assert numpy.all(cupy.asnumpy(result).astype(numpy.float32) == 0)
        assert numpy.all(cupy.asnumpy(lse) == math.inf)


# --------------------------------------------------------------------------------------------
# Streams: results land on the current CuPy stream, with no host synchronisation.

from busy_stream import copies_after_spin  # noqa: E402  (tests/gpu helper)


def _attention_on_busy_stream(stream, q, k, v, spin_seconds, causal):
    """On `stream`: spin, copy q, k, v into fresh buffers, then run attention on the copies.

    Only an attention that runs on the current stream is ordered after the copies; one on any
    other stream (e.g. the legacy default stream, which a non-blocking stream does not wait for)
    reads the fresh buffers before they are filled and gives wrong results.
    Returns (out, seconds the host spent in this function).
    """
    start = time.perf_counter()
    copies = copies_after_spin(stream, (q, k, v), spin_seconds)
    with stream:
        out = testing.poison_like(cupy, q.shape, q.dtype)
        result = cuflash2.attention(*copies, causal=causal, out=out)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("dtype", DTYPES)
def test_current_stream(dtype):
    q, k, v = _random_qkv(2, 255, 255, 4, 2, 64, dtype)
    cupy.cuda.Device().synchronize()  # inputs ready before the non-blocking stream starts
    stream = cupy.cuda.Stream(non_blocking=True)
    out, _ = _attention_on_busy_stream(stream, q, k, v, spin_seconds=0.05, causal=True)
    stream.synchronize()
    [result] = testing.check_forward(q, k, v, out, causal=True)
    assert result.ok, str(result)


def test_no_host_synchronisation():
    """The call returns while the stream is still busy: nothing in it waits for the GPU."""
    q, k, v = _random_qkv(2, 255, 255, 4, 2, 64, FP16)
    stream = cupy.cuda.Stream(non_blocking=True)
    # Warm-up: compile the kernels (ours, CuPy's and the spin kernel) outside the timed run.
    _attention_on_busy_stream(stream, q, k, v, spin_seconds=0.001, causal=False)
    stream.synchronize()
    out, host_seconds = _attention_on_busy_stream(stream, q, k, v, spin_seconds=1.0, causal=False)
    assert not stream.done, "stream finished already: the call waited for the GPU"
    stream.synchronize()
    assert host_seconds < 0.5, f"call took {host_seconds:.3f} s with a 1 s spin queued"
    [result] = testing.check_forward(q, k, v, out)
    assert result.ok, str(result)
