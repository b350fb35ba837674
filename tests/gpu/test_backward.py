"""GPU tests of cuflash2.attention_backward and cuflash2.attention_vjp (docs/DESIGN.md §3, §5).

dq, dk and dv are judged by cuflash2.testing's rule against the reference backward:
max|grad - ref_hi| <= 2 max|ref_lo - ref_hi| + atol, with ref_hi the float32 reference gradient
and ref_lo the reference computed in the input dtype, both with CuPy on the same device. `out` and
`lse` come from cuflash2.attention (return_lse=True), the way a training loop gets them; the
reference recomputes everything from q, k, v, so a wrong out/lse shows up as a wrong gradient.
Inputs (q, k, v and dout) are fresh standard-normal draws; preallocated outputs are poisoned with
NaN so that anything left unwritten fails. Sizes are small: the file runs in well under three
minutes once the kernels are compiled.
"""

import time

import numpy
import pytest
from grids import BF16, CAUSAL, DTYPES, FP16, HEAD_DIMS, HEAD_LAYOUTS, SEQLENS  # tests/gpu helper
from grids import seed_of as _seed

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402  (after the CuPy skip: the package is only usable with CuPy)
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu

DETERMINISTIC = [pytest.param(False, id="atomic"), pytest.param(True, id="deterministic")]
GRAD_NAMES = ("dq", "dk", "dv")


# --------------------------------------------------------------------------------------------
# Helpers.


def _standard_normal(xp, shape, dtype, seed):
    """Standard-normal array drawn on the host (bit-identical on NumPy and CuPy)."""
    rng = numpy.random.default_rng(seed)
    return xp.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))


def _random_problem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, *tag, xp=None):
    """(dout, q, k, v): fresh standard-normal inputs, C-contiguous; batch=None is unbatched."""
    xp = cupy if xp is None else xp
    seed = _seed(tag, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, str(dtype))
    q, k, v = testing.random_qkv(
        xp, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed
    )
    dout = _standard_normal(xp, q.shape, dtype, seed ^ 0x5EED)
    return dout, q, k, v


def _lse_shape(q):
    """(batch, nheads, seqlen_q), or (nheads, seqlen_q) for unbatched q."""
    return q.shape[:-3] + (q.shape[-2], q.shape[-3])


def _forward(q, k, v, *, causal=False, softmax_scale=None, out=None):
    """(out, lse) from cuflash2.attention, as a training loop would keep them."""
    out, lse = cuflash2.attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, out=out
    )
    assert lse.dtype == numpy.float32 and lse.shape == _lse_shape(q)
    return out, lse


def _poisoned_grads(q, k, v):
    """NaN-filled dq, dk, dv buffers shaped like q, k, v."""
    return tuple(testing.poison_like(cupy, x.shape, x.dtype) for x in (q, k, v))


def _bits(x):
    """The raw bits of x as unsigned integers (bitwise comparison that also covers NaN)."""
    return x.view({2: cupy.uint16, 4: cupy.uint32}[x.itemsize])


def _assert_bitwise_equal(got, expected, name):
    assert got.shape == expected.shape and got.dtype == expected.dtype, name
    differ = int(cupy.count_nonzero(_bits(got) != _bits(expected)))
    assert differ == 0, f"{name}: {differ} of {got.size} elements differ bitwise"


def _as_host_float32(x):
    return cupy.asnumpy(x).astype(numpy.float32)


def _check_gradients(dout, q, k, v, grads, *, causal=False, softmax_scale=None, outputs=None):
    """Types, shapes and dtypes of (dq, dk, dv), then the correctness rule.

    `outputs`: the preallocated (dq, dk, dv) that were passed in, which must be returned as is.
    """
    assert len(grads) == 3
    for name, grad, like in zip(GRAD_NAMES, grads, (q, k, v)):
        assert isinstance(grad, cupy.ndarray), f"{name} is a {type(grad).__name__}"
        assert grad.dtype == like.dtype, f"{name} dtype {grad.dtype}, expected {like.dtype}"
        assert grad.shape == like.shape, f"{name} shape {grad.shape}, expected {like.shape}"
    if outputs is not None:
        for name, grad, given in zip(GRAD_NAMES, grads, outputs):
            assert grad is given, f"{name}= was not returned as the same object"
    results = testing.check_backward(
        dout, q, k, v, *grads, causal=causal, softmax_scale=softmax_scale
    )
    assert all(r.ok for r in results), "; ".join(map(str, results))


def _backward_and_check(
    dout, q, k, v, *, causal=False, softmax_scale=None, deterministic=False, poison=False
):
    """Forward for out/lse, backward (into NaN-poisoned dq=/dk=/dv= if `poison`), rule check."""
    out, lse = _forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    outputs = _poisoned_grads(q, k, v) if poison else None
    preallocated = dict(zip(GRAD_NAMES, outputs)) if poison else {}
    grads = cuflash2.attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, **preallocated,
    )
    _check_gradients(
        dout, q, k, v, grads, causal=causal, softmax_scale=softmax_scale, outputs=outputs
    )
    return grads


# --------------------------------------------------------------------------------------------
# 1. Coverage grids: the 2x rule for dq, dk, dv.

@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(dtype, headdim, causal, layout):
    """Every supported head dim, both dtypes, causal and not, with MHA, GQA and MQA."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = HEAD_LAYOUTS[layout]
    dout, q, k, v = _random_problem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype)
    _backward_and_check(dout, q, k, v, causal=causal)


@pytest.mark.parametrize("seqlen_k", SEQLENS)
@pytest.mark.parametrize("seqlen_q", SEQLENS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlen_grid(dtype, headdim, causal, seqlen_q, seqlen_k):
    """Every pair of sequence lengths (tile tails, sq != sk both ways, bottom-right causal).

    Gradients go into NaN-poisoned dq=/dk=/dv= buffers, so a tail row or column the kernels
    skip shows up as NaN.
    """
    dout, q, k, v = _random_problem(1, seqlen_q, seqlen_k, 2, 2, headdim, dtype)
    _backward_and_check(dout, q, k, v, causal=causal, poison=True)


@pytest.mark.parametrize("softmax_scale", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_scale(dtype, causal, softmax_scale):
    """A non-default scale enters dq and dk (scaled S) and P (hence all three)."""
    dout, q, k, v = _random_problem(2, 97, 128, 4, 2, 64, dtype, "scale")
    _backward_and_check(dout, q, k, v, causal=causal, softmax_scale=softmax_scale)


# --------------------------------------------------------------------------------------------
# Layouts: strided inputs and outputs, unbatched inputs.

LAYOUTS = ["every_other_head", "every_other_position", "bhsd_storage", "padded_rows"]


def _embedding(shape, dtype, layout, fill):
    """(base, view): a host buffer filled with `fill` and a function giving the strided
    (b, s, h, d) view of it (on NumPy and CuPy arrays alike) whose only contiguous dim is the
    last one. Every stride stays a multiple of 8 elements, as cuflash2 requires."""
    b, s, h, d = shape
    if layout == "every_other_head":
        return numpy.full((b, s, 2 * h, d), fill, dtype), lambda x: x[:, :, 1::2]
    if layout == "every_other_position":
        return numpy.full((b, 2 * s, h, d), fill, dtype), lambda x: x[:, 1::2]
    if layout == "bhsd_storage":  # (batch, heads, seqlen, dim) memory viewed as (b, s, h, d)
        return numpy.full((b, h, s, d), fill, dtype), lambda x: x.transpose(0, 2, 1, 3)
    if layout == "padded_rows":  # each head's row padded by 8 elements (16 bytes)
        return numpy.full((b, s, h, d + 8), fill, dtype), lambda x: x[..., :d]
    raise ValueError(layout)


def _strided_on_device(host, layout):
    """A non-contiguous CuPy view equal to the host (b, s, h, d) array (built on the host, where
    NumPy handles bf16 everywhere, and sliced on the device)."""
    base, view = _embedding(host.shape, host.dtype, layout, 0)
    view(base)[...] = host
    return view(cupy.asarray(base))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [40, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_inputs(dtype, headdim, causal, layout):
    """Sliced q, k, v, dout and out (batch > 1, GQA); none of the inputs is written."""
    host = _random_problem(3, 97, 130, 6, 2, headdim, dtype, "strided", layout, xp=numpy)
    dout, q, k, v = (_strided_on_device(x, layout) for x in host)
    out_buffer = _strided_on_device(numpy.zeros(q.shape, q.dtype), layout)
    out, lse = _forward(q, k, v, causal=causal, out=out_buffer)
    assert not any(x.flags.c_contiguous for x in (dout, q, k, v, out))
    out_host, lse_host = cupy.asnumpy(out), cupy.asnumpy(lse)

    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal)
    _check_gradients(dout, q, k, v, grads, causal=causal)
    # The user's arrays are read, never written.
    for original, device in zip(host + (out_host, lse_host), (dout, q, k, v, out, lse)):
        numpy.testing.assert_array_equal(cupy.asnumpy(device), original)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_gradient_outputs(dtype, causal, layout):
    """dq=/dk=/dv= may be strided views (like the forward's out=): the view is filled
    completely, the rest of the underlying buffer is left alone."""
    dout, q, k, v = _random_problem(2, 97, 130, 6, 2, 64, dtype, "strided-out", layout)
    out, lse = _forward(q, k, v, causal=causal)
    sentinel = 7.0
    bases, views, outputs = [], [], []
    for like in (q, k, v):
        base, view = _embedding(like.shape, like.dtype, layout, sentinel)
        view(base)[...] = numpy.nan
        base = cupy.asarray(base)
        bases.append(base)
        views.append(view)
        outputs.append(view(base))
    grads = cuflash2.attention_backward(
        dout, q, k, v, out, lse, causal=causal, **dict(zip(GRAD_NAMES, outputs))
    )
    _check_gradients(dout, q, k, v, grads, causal=causal, outputs=tuple(outputs))
    for name, base, view in zip(GRAD_NAMES, bases, views):
        host = _as_host_float32(base)
        view(host)[...] = sentinel  # what remains must be the untouched padding
        assert numpy.all(host == sentinel), f"{name}: wrote outside the strided view"


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unbatched_input(dtype, headdim, causal):
    """(seqlen, nheads, headdim) inputs; lse is then (nheads, seqlen_q)."""
    dout, q, k, v = _random_problem(None, 130, 97, 6, 2, headdim, dtype)
    assert q.ndim == 3
    out, lse = _forward(q, k, v, causal=causal)
    assert lse.shape == (6, 130)
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal)
    _check_gradients(dout, q, k, v, grads, causal=causal)
    assert [g.shape for g in grads] == [(130, 6, headdim), (97, 2, headdim), (97, 2, headdim)]


# --------------------------------------------------------------------------------------------
# 2. Deterministic mode.

# name: (batch, seqlen_q, seqlen_k, nheads, nheads_kv): several KV blocks add into each dQ row,
# and several query heads into each dK/dV head.
DETERMINISM_CASES = {
    "gqa_long_k": (2, 255, 1023, 6, 2),
    "mqa_long_q": (1, 1023, 255, 4, 1),
}


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("case", list(DETERMINISM_CASES))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic(dtype, headdim, causal, case, deterministic):
    """Both modes pass the rule; deterministic=True is bitwise identical over three runs."""
    dout, q, k, v = _random_problem(*DETERMINISM_CASES[case], headdim, dtype, "determinism")
    out, lse = _forward(q, k, v, causal=causal)
    runs = []
    for _ in range(3 if deterministic else 1):
        grads = cuflash2.attention_backward(
            dout, q, k, v, out, lse, causal=causal, deterministic=deterministic
        )
        _check_gradients(dout, q, k, v, grads, causal=causal)
        runs.append(grads)
    for later in runs[1:]:
        for name, first, again in zip(GRAD_NAMES, runs[0], later):
            _assert_bitwise_equal(again, first, name)


# --------------------------------------------------------------------------------------------
# 3, 4. NaN-poisoned outputs, rows that see no key.

# name: (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
POISON_CASES = {
    "mha_tails": (2, 97, 97, 4, 4),
    "gqa_sq_lt_sk": (1, 17, 255, 6, 2),
    "mqa_sq_gt_sk": (1, 255, 17, 4, 1),  # causal: rows 0..237 see no key
    "single_query": (2, 1, 130, 4, 2),
    "single_key": (2, 130, 1, 4, 2),  # causal: rows 0..128 see no key
}


@pytest.mark.parametrize("case", list(POISON_CASES))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [40, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_poisoned_outputs_overwritten(dtype, headdim, causal, case):
    """Every element of NaN-poisoned dq=/dk=/dv= is written.

    With causal masking alone (no window), bottom-right alignment lets the last query row see
    every key, so as long as seqlen_q > 0 no key goes unseen; keys seen by no query at all
    (seqlen_q = 0, where dk = dv = 0) are covered by test_zero_size.
    """
    dout, q, k, v = _random_problem(*POISON_CASES[case], headdim, dtype, "poison")
    grads = _backward_and_check(dout, q, k, v, causal=causal, poison=True)
    for name, grad in zip(GRAD_NAMES, grads):
        assert not numpy.isnan(_as_host_float32(grad)).any(), f"{name} still holds NaN"


@pytest.mark.parametrize(
    "sizes", [(255, 97, 4, 4), (130, 17, 6, 2), (1025, 1, 4, 1), (129, 128, 4, 2)], ids=str
)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_keyless_rows_give_zero_dq(dtype, headdim, sizes):
    """Causal with seqlen_q > seqlen_k: the top seqlen_q - seqlen_k rows see no key
    (out 0, lse +inf), so their dq is exactly 0 (written into a NaN-poisoned dq=)."""
    seqlen_q, seqlen_k, nheads, nheads_kv = sizes
    dout, q, k, v = _random_problem(2, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype)
    dq, _, _ = _backward_and_check(dout, q, k, v, causal=True, poison=True)
    keyless = seqlen_q - seqlen_k
    dq_host = _as_host_float32(dq)
    assert numpy.all(dq_host[:, :keyless] == 0), "dq of rows that see no key is not 0"
    if seqlen_k > 1:
        # Rows that see two keys or more have real gradients (a row that sees a single key has
        # P = 1 and dq = 0 whatever dout is).
        assert numpy.any(dq_host[:, keyless:] != 0)


# --------------------------------------------------------------------------------------------
# 5. attention_vjp.


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vjp_matches_forward_and_backward(dtype, causal):
    """out is cuflash2.attention's; vjp(dout) is attention_backward's, bitwise, when both are
    deterministic. The vjp can be applied to several cotangents."""
    dout, q, k, v = _random_problem(2, 97, 255, 6, 2, 64, dtype, "vjp")
    options = dict(causal=causal, softmax_scale=0.3)
    out, vjp = cuflash2.attention_vjp(q, k, v, deterministic=True, **options)
    ref_out, ref_lse = _forward(q, k, v, **options)
    _assert_bitwise_equal(out, ref_out, "out")

    grads = vjp(dout)
    _check_gradients(dout, q, k, v, grads, **options)
    expected = cuflash2.attention_backward(
        dout, q, k, v, ref_out, ref_lse, deterministic=True, **options
    )
    for name, got, want in zip(GRAD_NAMES, grads, expected):
        _assert_bitwise_equal(got, want, name)

    # A second cotangent: the saved forward state is reused, not consumed.
    dout2 = _standard_normal(cupy, q.shape, dtype, _seed("vjp-second", str(dtype), causal))
    _check_gradients(dout2, q, k, v, vjp(dout2), **options)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vjp_default_options(dtype, causal):
    """Default (non-deterministic) vjp with unbatched GQA inputs passes the rule."""
    dout, q, k, v = _random_problem(None, 130, 97, 6, 2, 128, dtype, "vjp-unbatched")
    out, vjp = cuflash2.attention_vjp(q, k, v, causal=causal)
    [result] = testing.check_forward(q, k, v, out, causal=causal)
    assert result.ok, str(result)
    _check_gradients(dout, q, k, v, vjp(dout), causal=causal)


def test_vjp_checks_dout():
    dout, q, k, v = _random_problem(2, 33, 47, 4, 2, 64, FP16, "vjp-bad")
    _, vjp = cuflash2.attention_vjp(q, k, v)
    with pytest.raises((TypeError, ValueError), match="dout"):
        vjp(dout[:, :-1])


# --------------------------------------------------------------------------------------------
# 6. Streams: results land on the current CuPy stream, with no host synchronisation.

from busy_stream import copies_after_spin  # noqa: E402  (tests/gpu helper)


def _backward_on_busy_stream(stream, inputs, spin_seconds, causal, deterministic):
    """On `stream`: spin, copy (dout, q, k, v, out, lse) into fresh buffers, then run the
    backward on the copies into NaN-poisoned dq=/dk=/dv=.

    Only work on the current stream is ordered after the copies; any kernel, memset or copy of
    the backward on another stream (e.g. the legacy default stream, which a non-blocking stream
    does not wait for) reads unfilled buffers or races with the poison and gives wrong results.
    Returns (grads, seconds the host spent in this function).
    """
    start = time.perf_counter()
    copies = copies_after_spin(stream, inputs, spin_seconds)
    with stream:
        dout, q, k, v, _, _ = copies
        outputs = _poisoned_grads(q, k, v)
        grads = cuflash2.attention_backward(
            *copies, causal=causal, deterministic=deterministic, **dict(zip(GRAD_NAMES, outputs))
        )
    return grads, time.perf_counter() - start


def _stream_problem(dtype):
    dout, q, k, v = _random_problem(2, 255, 255, 4, 2, 64, dtype, "stream")
    out, lse = _forward(q, k, v, causal=True)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("dtype", DTYPES)
def test_current_stream(dtype, deterministic):
    inputs = _stream_problem(dtype)
    cupy.cuda.Device().synchronize()  # inputs ready before the non-blocking stream starts
    stream = cupy.cuda.Stream(non_blocking=True)
    grads, _ = _backward_on_busy_stream(
        stream, inputs, spin_seconds=0.05, causal=True, deterministic=deterministic
    )
    stream.synchronize()
    dout, q, k, v, _, _ = inputs
    _check_gradients(dout, q, k, v, grads, causal=True)


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
def test_no_host_synchronisation(deterministic):
    """The call returns while the stream is still busy: nothing in it waits for the GPU."""
    inputs = _stream_problem(FP16)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    # Warm-up: compile the kernels (ours, CuPy's and the spin kernel) outside the timed run.
    _backward_on_busy_stream(stream, inputs, 0.001, causal=True, deterministic=deterministic)
    stream.synchronize()
    grads, host_seconds = _backward_on_busy_stream(
        stream, inputs, 1.0, causal=True, deterministic=deterministic
    )
    assert not stream.done, "stream finished already: the call waited for the GPU"
    stream.synchronize()
    assert host_seconds < 0.5, f"call took {host_seconds:.3f} s with a 1 s spin queued"
    dout, q, k, v, _, _ = inputs
    _check_gradients(dout, q, k, v, grads, causal=True)


# --------------------------------------------------------------------------------------------
# 7. Zero-size inputs.


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("sizes", [(0, 17, 17), (2, 0, 17), (2, 17, 0), (0, 0, 0)], ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_size(dtype, causal, sizes, deterministic):
    """Empty problems give correctly shaped gradients: seqlen_q = 0 means no query sees any key
    (dk = dv = 0), seqlen_k = 0 means every row sees no key (dq = 0). Into poisoned dq=/dk=/dv=
    too, where those zeros must be written."""
    batch, seqlen_q, seqlen_k = sizes
    dout, q, k, v = _random_problem(batch, seqlen_q, seqlen_k, 4, 2, 64, dtype, "empty")
    out, lse = _forward(q, k, v, causal=causal)

    options = dict(causal=causal, deterministic=deterministic)
    plain = cuflash2.attention_backward(dout, q, k, v, out, lse, **options)
    outputs = _poisoned_grads(q, k, v)
    into = cuflash2.attention_backward(
        dout, q, k, v, out, lse, **options, **dict(zip(GRAD_NAMES, outputs))
    )
    for grads, given in ((plain, None), (into, outputs)):
        assert len(grads) == 3
        for name, grad, like in zip(GRAD_NAMES, grads, (q, k, v)):
            assert isinstance(grad, cupy.ndarray), name
            assert grad.shape == like.shape and grad.dtype == like.dtype, name
            assert numpy.all(_as_host_float32(grad) == 0), f"{name} is not all zeros"
        if given is not None:
            for name, grad, buffer in zip(GRAD_NAMES, grads, given):
                assert grad is buffer, f"{name}= was not returned as the same object"


# --------------------------------------------------------------------------------------------
# 8. Argument validation: errors name the argument and come before any launch.

_VALID = dict(batch=2, seqlen_q=33, seqlen_k=47, nheads=4, nheads_kv=2, headdim=64)


def _device_array(shape, dtype):
    return _standard_normal(cupy, shape, dtype, _seed("bad", shape, str(numpy.dtype(dtype))))


def _bad_arguments():
    """name -> (argument named in the error, function of the valid arguments giving the bad
    replacements). Sizes are all different, so a transposed shape is detectably wrong."""
    b, sq, sk, h, hk, d = (_VALID[key] for key in _VALID)
    return {
        "dout_seqlen": ("dout", lambda a: {"dout": a["dout"][:, :-1]}),
        "dout_nheads": ("dout", lambda a: {"dout": _device_array((b, sq, hk, d), FP16)}),
        "dout_headdim": ("dout", lambda a: {"dout": _device_array((b, sq, h, d // 2), FP16)}),
        "dout_unbatched": ("dout", lambda a: {"dout": a["dout"][0]}),
        "dout_bf16": ("dout", lambda a: {"dout": _device_array((b, sq, h, d), BF16)}),
        "dout_float32": ("dout", lambda a: {"dout": a["dout"].astype(cupy.float32)}),
        "dout_numpy": ("dout", lambda a: {"dout": cupy.asnumpy(a["dout"])}),
        "out_shape": (r"\bout\b", lambda a: {"out": a["out"][:, :-1]}),
        "out_headdim": (r"\bout\b", lambda a: {"out": _device_array((b, sq, h, d // 2), FP16)}),
        "out_bf16": (r"\bout\b", lambda a: {"out": _device_array((b, sq, h, d), BF16)}),
        "lse_transposed": ("lse", lambda a: {"lse": cupy.zeros((b, sq, h), cupy.float32)}),
        "lse_seqlen": ("lse", lambda a: {"lse": cupy.zeros((b, h, sq + 1), cupy.float32)}),
        "lse_batch": ("lse", lambda a: {"lse": a["lse"][:1]}),
        "lse_unbatched": ("lse", lambda a: {"lse": a["lse"][0]}),
        "lse_float16": ("lse", lambda a: {"lse": a["lse"].astype(cupy.float16)}),
        "lse_float64": ("lse", lambda a: {"lse": a["lse"].astype(cupy.float64)}),
        "dq_shape_of_k": ("dq", lambda a: {"dq": _device_array((b, sk, hk, d), FP16)}),
        "dq_bf16": ("dq", lambda a: {"dq": _device_array((b, sq, h, d), BF16)}),
        "dq_numpy": ("dq", lambda a: {"dq": numpy.zeros((b, sq, h, d), FP16)}),
        "dk_shape_of_q": ("dk", lambda a: {"dk": _device_array((b, sq, h, d), FP16)}),
        "dk_bf16": ("dk", lambda a: {"dk": _device_array((b, sk, hk, d), BF16)}),
        "dv_nheads": ("dv", lambda a: {"dv": _device_array((b, sk, h, d), FP16)}),
        "dv_bf16": ("dv", lambda a: {"dv": _device_array((b, sk, hk, d), BF16)}),
    }


@pytest.mark.parametrize("case", list(_bad_arguments()))
def test_bad_argument_is_named(case):
    pattern, make_bad = _bad_arguments()[case]
    dout, q, k, v = _random_problem(*_VALID.values(), FP16, "validation")
    out, lse = _forward(q, k, v)
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    poisoned = dict(zip(GRAD_NAMES, _poisoned_grads(q, k, v)))
    args.update(poisoned)
    bad = make_bad(args)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=pattern):
        cuflash2.attention_backward(
            args.pop("dout"), args.pop("q"), args.pop("k"), args.pop("v"), args.pop("out"),
            args.pop("lse"), **args,
        )
    # Raised before any launch: the valid preallocated outputs are untouched.
    for name, buffer in poisoned.items():
        if name not in bad:
            assert numpy.isnan(_as_host_float32(buffer)).all(), f"{name} was written"


def test_valid_arguments_accepted():
    """The baseline of test_bad_argument_is_named is itself valid."""
    dout, q, k, v = _random_problem(*_VALID.values(), FP16, "validation")
    _backward_and_check(dout, q, k, v, poison=True)
