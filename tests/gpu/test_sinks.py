"""Learnable attention sinks (`sinks=`, gpt-oss style: one float32 logit a query head in every
row's softmax denominator, no value row; the returned lse counts it, a row that sees no key gives
out 0 and lse = sink), forward and backward (dsinks, the fourth gradient) on every path against
cuflash2.reference with the 2x rule of cuflash2.testing: dense at several head dims (odd ones
too), causal or not, seqlen_q != seqlen_k, odd lengths, GQA/MQA, unbatched; packed qkv / kv;
varlen; windows; softcap + ALiBi; dropout given its mask; deterministic mode (bitwise over two
runs); rows that see no key; attention_vjp; the dsinks= output; decoding (attention_with_kvcache)
over contiguous and paged caches, one split, forced splits (the merge counts the sink once) and
automatic ones, GQA packing, and a decode step replayed from a CUDA graph. On an H100/H200 the
dense and varlen cases run on both kernel families: the Hopper kernels and the mma.sync ones
(`_dispatch.HOPPER_FORWARD` / `_dispatch.HOPPER_BACKWARD` switched off), asserted through forward_kernels /
backward_kernels. Sinks are fresh normal draws (std 1.5), with very large (+25: the rows' keys
get ~e^-25 of the weight) and very negative (-30: almost no sink) ones in places."""

import contextlib

import numpy
import pytest
from grids import BF16, DTYPES, FP16, needs_hopper, paged_cache, seed_of, switched  # noqa: E402

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api, reference, testing  # noqa: E402

pytestmark = pytest.mark.gpu

CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]
FAMILIES = [pytest.param("hopper", marks=needs_hopper), pytest.param("mma.sync")]
GRAD_NAMES = ("dq", "dk", "dv", "dsinks")


# --------------------------------------------------------------------------------------------
# Helpers.


def _sinks(nheads, seed, extreme=False):
    """float32 (nheads,) on the device: normal, std 1.5; `extreme` puts +25 and -30 first."""
    values = numpy.random.default_rng(seed).standard_normal(nheads) * 1.5
    if extreme:
        values[: min(2, nheads)] = [25.0, -30.0][: min(2, nheads)]
    return cupy.asarray(values.astype(numpy.float32))


def _problem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, *tag, extreme=False):
    """(dout, q, k, v, sinks): fresh standard-normal inputs and random sinks."""
    seed = seed_of("sinks", tag, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                                 dtype, seed)
    dout = testing.random_qkv(cupy, batch, seqlen_q, 1, nheads, 1, headdim, dtype, seed + 1)[0]
    return dout, q, k, v, _sinks(nheads, seed + 2, extreme)


@contextlib.contextmanager
def _family(name):
    """Plans made inside run the Hopper kernels where they cover a call ("hopper", the default
    on sm_90) or the mma.sync ones only ("mma.sync"), forward and backward; None: as is."""
    if name is None:
        yield
        return
    on = name == "hopper"
    with switched(_dispatch, {"HOPPER_FORWARD": on}, api._forward_plans), \
            switched(_dispatch, {"HOPPER_BACKWARD": on}, api._backward_plans):
        yield


def _assert_family(kernels, family, what):
    if family is None:
        return
    prefix = "Hopper" if family == "hopper" else "mma.sync"
    assert kernels.startswith(prefix), f"{what}: {kernels}"


def _main_kernel(kernels):
    """The backward's main kernel among backward_kernels' (after the preprocess, and with sinks
    after the sinks' gradient)."""
    return next(k for k in kernels if k.startswith(("Hopper", "mma.sync")))


def _assert_ok(results):
    assert all(r.ok for r in results), "; ".join(map(str, results))


def _poisoned(*likes):
    return tuple(testing.poison_like(cupy, x.shape, x.dtype) for x in likes)


def _same_bits(a, b):
    return a.shape == b.shape and bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all())


def _forward_and_check(q, k, v, sinks, family=None, **options):
    """attention(..., sinks=) into a NaN-poisoned out=, on `family`, against the reference."""
    with _family(family):
        if family is not None:
            (kernel,) = cuflash2.forward_kernels(q, k, v, sinks=sinks, **options)
            _assert_family(kernel, family, "forward")
        out = testing.poison_like(cupy, q.shape, q.dtype)
        got, lse = cuflash2.attention(q, k, v, sinks=sinks, return_lse=True, out=out, **options)
    assert got is out and lse.dtype == numpy.float32
    _assert_ok(testing.check_forward(q, k, v, out, lse, sinks=sinks, **options))
    return out, lse


def _backward_and_check(dout, q, k, v, out, lse, sinks, family=None, deterministic=False,
                        **options):
    """attention_backward(..., sinks=) into NaN-poisoned dq=/dk=/dv=/dsinks=, on `family`,
    against the reference (dsinks included). Returns (dq, dk, dv, dsinks)."""
    given = dict(zip(GRAD_NAMES, _poisoned(q, k, v, sinks)))
    with _family(family):
        if family is not None:
            kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, sinks=sinks,
                                                deterministic=deterministic, **options)
            _assert_family(_main_kernel(kernels), family, "backward")
            assert any("sinks" in kernel for kernel in kernels), kernels
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, sinks=sinks,
                                            deterministic=deterministic, **given, **options)
    assert len(grads) == 4
    for name, grad in zip(GRAD_NAMES, grads):
        assert grad is given[name], f"{name}= was not returned as the same object"
    assert grads[3].dtype == numpy.float32 and grads[3].shape == sinks.shape
    _assert_ok(testing.check_backward(dout, q, k, v, *grads, sinks=sinks, **options))
    return grads


# --------------------------------------------------------------------------------------------
# Dense: head dims, lengths, layouts, the two kernel families.


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("headdim", [40, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(dtype, headdim, causal):
    """GQA, odd lengths, seqlen_q != seqlen_k, on the dispatcher's kernels."""
    dout, q, k, v, sinks = _problem(2, 97, 130, 4, 2, headdim, dtype)
    out, lse = _forward_and_check(q, k, v, sinks, causal=causal)
    _backward_and_check(dout, q, k, v, out, lse, sinks, causal=causal)


# name: (batch, seqlen_q, seqlen_k, nheads, nheads_kv); None batch: unbatched
SHAPES = {
    "one_row_one_key": (2, 1, 1, 4, 4),
    "sq_gt_sk_mqa": (1, 255, 97, 4, 1),  # causal: rows 0..157 see no key
    "sq_lt_sk": (2, 17, 1025, 6, 2),
    "unbatched_gqa": (None, 130, 97, 6, 2),
}


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes(shape, causal):
    dout, q, k, v, sinks = _problem(*SHAPES[shape], 64, FP16, "shape")
    out, lse = _forward_and_check(q, k, v, sinks, causal=causal)
    assert lse.shape == q.shape[:-3] + (q.shape[-2], q.shape[-3])
    _backward_and_check(dout, q, k, v, out, lse, sinks, causal=causal)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype,headdim", [(FP16, 64), (BF16, 128), (FP16, 256)], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_families(family, dtype, headdim, causal):
    """The Hopper kernels (where they cover the call: 333 keys keep d = 64 on them) and the
    mma.sync ones, forward and backward, each asserted by its kernel names."""
    dout, q, k, v, sinks = _problem(2, 200, 333, 4, 2, headdim, dtype, "family")
    out, lse = _forward_and_check(q, k, v, sinks, family, causal=causal)
    _backward_and_check(dout, q, k, v, out, lse, sinks, family, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_keyless_rows_and_extreme_sinks(family, dtype):
    """Causal with seqlen_q > seqlen_k: the top rows see no key and give out 0, lse = sink and
    dq 0; heads with a sink of +25 (the keys' weight ~e^-25: out ~0, lse ~25) and -30 (almost
    no sink) pass the rule like the others."""
    dout, q, k, v, sinks = _problem(2, 400, 300, 4, 2, 128, dtype, "keyless", extreme=True)
    out, lse = _forward_and_check(q, k, v, sinks, family, causal=True)
    keyless = 100
    sinks_host = cupy.asnumpy(sinks)
    assert numpy.all(cupy.asnumpy(out[:, :keyless]).astype(numpy.float32) == 0)
    lse_host = cupy.asnumpy(lse)
    numpy.testing.assert_allclose(lse_host[:, :, :keyless],
                                  numpy.broadcast_to(sinks_host[:, None], (2, 4, keyless)),
                                  rtol=1e-6, atol=1e-6)
    assert numpy.all(lse_host[:, 0] >= 25.0 - 1e-4)  # the +25 head: the sink dominates
    assert float(cupy.abs(out[:, :, 0].astype(cupy.float32)).max()) < 1e-5
    dq, _, _, _ = _backward_and_check(dout, q, k, v, out, lse, sinks, family, causal=True)
    assert numpy.all(cupy.asnumpy(dq[:, :keyless]).astype(numpy.float32) == 0)


@pytest.mark.parametrize("window", [(16, 0), (48, 16), (0, 0)], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_windows(family, window):
    """Windows (bottom-right aligned): with (48, 16) and 300 x 400 the first rows see no key."""
    dout, q, k, v, sinks = _problem(1, 400, 300, 6, 2, 64, FP16, "window", window)
    out, lse = _forward_and_check(q, k, v, sinks, family, window_size=window)
    _backward_and_check(dout, q, k, v, out, lse, sinks, family, window_size=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_softcap_alibi(family, dtype):
    """softcap and per-(batch, head) ALiBi slopes with sinks: the sink is neither capped nor
    biased."""
    dout, q, k, v, sinks = _problem(2, 257, 389, 4, 4, 128, dtype, "mods")
    slopes = cupy.asarray(numpy.linspace(0.05, 0.4, 8, dtype=numpy.float32).reshape(2, 4))
    options = dict(causal=True, softcap=5.0, alibi_slopes=slopes)
    out, lse = _forward_and_check(q, k, v, sinks, family, **options)
    _backward_and_check(dout, q, k, v, out, lse, sinks, family, **options)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic(family, causal):
    """deterministic=True: dq, dk, dv and dsinks the same bits over two runs (and the rule)."""
    dout, q, k, v, sinks = _problem(2, 255, 513, 6, 2, 128, BF16, "deterministic")
    out, lse = _forward_and_check(q, k, v, sinks, family, causal=causal)
    first = _backward_and_check(dout, q, k, v, out, lse, sinks, family, deterministic=True,
                                causal=causal)
    again = _backward_and_check(dout, q, k, v, out, lse, sinks, family, deterministic=True,
                                causal=causal)
    for name, a, b in zip(GRAD_NAMES, first, again):
        assert _same_bits(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_given_the_mask(dtype, causal):
    """Dropout with sinks (the sink enters the denominator, never dropped) against the reference
    given the kernel's mask, forward and both backward modes."""
    dout, q, k, v, sinks = _problem(2, 130, 97, 4, 2, 64, dtype, "dropout", causal)
    seed = seed_of("sinks-dropout", str(dtype), causal)
    drop = dict(dropout_p=0.3, seed=seed, offset=5)
    mask = cuflash2.dropout_mask(2, 4, 130, 97, 0.3, seed, 5)
    out, lse = cuflash2.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True, **drop)
    given = dict(causal=causal, sinks=sinks, dropout_p=0.3, dropout_mask=mask)
    _assert_ok(testing.check_forward(q, k, v, out, lse, **given))
    for deterministic in (False, True):
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal, sinks=sinks,
                                            deterministic=deterministic, **drop)
        _assert_ok(testing.check_backward(dout, q, k, v, *grads, **given))


# --------------------------------------------------------------------------------------------
# Entry points: attention_vjp, packed layouts, the dsinks= output, varlen.


@pytest.mark.parametrize("causal", CAUSAL)
def test_vjp(causal):
    """vjp(dout) returns (dq, dk, dv, dsinks), attention_backward's bits when deterministic."""
    dout, q, k, v, sinks = _problem(2, 97, 255, 6, 2, 64, BF16, "vjp")
    options = dict(causal=causal, sinks=sinks)
    out, vjp = cuflash2.attention_vjp(q, k, v, deterministic=True, **options)
    ref_out, ref_lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    assert _same_bits(out, ref_out)
    grads = vjp(dout)
    assert len(grads) == 4
    _assert_ok(testing.check_backward(dout, q, k, v, *grads, **options))
    expected = cuflash2.attention_backward(dout, q, k, v, ref_out, ref_lse, deterministic=True,
                                           **options)
    for name, got, want in zip(GRAD_NAMES, grads, expected):
        assert _same_bits(got, want), name
    # Without sinks the vjp still returns three gradients.
    assert len(cuflash2.attention_vjp(q, k, v, causal=causal)[1](dout)) == 3


@pytest.mark.parametrize("causal", CAUSAL)
def test_packed_layouts(causal):
    """attention_qkvpacked / attention_kvpacked with sinks: the unpacked call's bits; their
    backwards return (dqkv, dsinks) and (dq, dkv, dsinks), into given dsinks= too."""
    dtype = FP16
    dout, q, k, v, sinks = _problem(2, 97, 97, 4, 4, 64, dtype, "qkvpacked")
    qkv = cupy.stack([q, k, v], axis=2)
    options = dict(causal=causal, sinks=sinks)
    out, lse = cuflash2.attention_qkvpacked(qkv, return_lse=True, **options)
    ref_out, ref_lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    assert _same_bits(out, ref_out) and _same_bits(lse, ref_lse)
    want = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    dsinks = testing.poison_like(cupy, sinks.shape, numpy.float32)
    dqkv, got_dsinks = cuflash2.attention_qkvpacked_backward(dout, qkv, out, lse,
                                                             deterministic=True, dsinks=dsinks,
                                                             **options)
    assert got_dsinks is dsinks and _same_bits(dsinks, want[3])
    for i in range(3):
        assert _same_bits(cupy.ascontiguousarray(dqkv[..., i, :, :]), want[i]), i
    plain_out, plain_lse = cuflash2.attention_qkvpacked(qkv, causal=causal, return_lse=True)
    plain = cuflash2.attention_qkvpacked_backward(dout, qkv, plain_out, plain_lse, causal=causal)
    assert isinstance(plain, cupy.ndarray)  # without sinks: dqkv alone, not a tuple

    dout, q, k, v, sinks = _problem(2, 77, 130, 6, 2, 128, dtype, "kvpacked")
    kv = cupy.stack([k, v], axis=2)
    options = dict(causal=causal, sinks=sinks)
    out, lse = cuflash2.attention_kvpacked(q, kv, return_lse=True, **options)
    ref_out, ref_lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    assert _same_bits(out, ref_out) and _same_bits(lse, ref_lse)
    grads = cuflash2.attention_kvpacked_backward(dout, q, kv, out, lse, deterministic=True,
                                                 **options)
    assert len(grads) == 3
    dq, dkv, dsinks = grads
    want = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for got, expected in zip((dq, dkv[:, :, 0], dkv[:, :, 1], dsinks), want):
        assert _same_bits(cupy.ascontiguousarray(got), expected)
    _assert_ok(testing.check_backward(dout, q, k, v, dq, dkv[:, :, 0], dkv[:, :, 1], dsinks,
                                      **options))


def test_dsinks_output_argument():
    """dsinks= alone (dq, dk, dv allocated) and with every gradient given: filled, returned
    as is; a dsinks= without sinks is refused."""
    dout, q, k, v, sinks = _problem(2, 97, 130, 4, 2, 64, FP16, "dsinks=")
    out, lse = cuflash2.attention(q, k, v, sinks=sinks, return_lse=True)
    dsinks = testing.poison_like(cupy, sinks.shape, numpy.float32)
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, sinks=sinks, dsinks=dsinks)
    assert grads[3] is dsinks and not bool(cupy.isnan(dsinks).any())
    _assert_ok(testing.check_backward(dout, q, k, v, *grads, sinks=sinks))
    with pytest.raises((TypeError, ValueError), match="sinks"):
        cuflash2.attention_backward(dout, q, k, v, out, lse, dsinks=dsinks)


# (lengths_q, lengths_k, nheads, nheads_kv): empty and one-token sequences, an empty key
# sequence (its rows: out 0, lse = sink), seqlen_q != seqlen_k, more than 512 keys (d = 64 on
# the Hopper kernels).
VARLEN_LAYOUTS = {
    "ragged": ([97, 1, 0, 300, 64, 129], [97, 1, 0, 700, 64, 129], 4, 4),
    "empty_k_gqa": ([40, 130, 7], [0, 530, 0], 6, 2),
}


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(48, 16)),
                                     dict(causal=True, softcap=4.0, alibi_slopes="batch")],
                         ids=["causal", "window", "softcap-alibi"])
@pytest.mark.parametrize("layout", list(VARLEN_LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_varlen(family, layout, options):
    lengths_q, lengths_k, h, hk = VARLEN_LAYOUTS[layout]
    dtype, headdim = BF16, 64
    seed = seed_of("sinks-varlen", family, layout, sorted(options))
    rng = numpy.random.default_rng(seed)

    def randn(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(numpy.float32).astype(dtype))

    q, k, v = randn(sum(lengths_q), h, headdim), randn(sum(lengths_k), hk, headdim), \
        randn(sum(lengths_k), hk, headdim)
    dout = randn(*q.shape)
    cu_q = cupy.asarray(numpy.cumsum([0] + lengths_q).astype(numpy.int32))
    cu_k = cupy.asarray(numpy.cumsum([0] + lengths_k).astype(numpy.int32))
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    options = dict(options)
    if options.get("alibi_slopes") == "batch":
        options["alibi_slopes"] = cupy.asarray(
            rng.uniform(0.01, 0.5, (len(lengths_q), h)).astype(numpy.float32))
    sinks = _sinks(h, seed + 1, extreme=layout == "ragged")
    options["sinks"] = sinks
    with _family(family):
        kernel = cuflash2.varlen_forward_kernels(q, k, v, *args, **options)[0]
        _assert_family(kernel, family, "varlen forward")
        out = testing.poison_like(cupy, q.shape, dtype)
        out, lse = cuflash2.attention_varlen(q, k, v, *args, return_lse=True, out=out, **options)
        dsinks = testing.poison_like(cupy, sinks.shape, numpy.float32)
        grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args, dsinks=dsinks,
                                                   **options)
    ref_hi, ref_lse = reference.attention_varlen(q, k, v, *args, return_lse=True,
                                                 compute_dtype=numpy.float32, **options)
    ref_lo = reference.attention_varlen(q, k, v, *args, compute_dtype=dtype, **options)
    _assert_ok([testing.check_close("out", out, ref_hi, ref_lo), testing.lse_close(lse, ref_lse)])
    assert len(grads) == 4 and grads[3] is dsinks
    _assert_ok(testing.check_varlen_backward(dout, q, k, v, *grads[:3], *args, dsinks=grads[3],
                                             **options))


# --------------------------------------------------------------------------------------------
# Decoding: attention_with_kvcache.


def _randn(rng, shape, dtype):
    return cupy.asarray(rng.standard_normal(shape).astype(numpy.float32).astype(dtype))


def _check_decode(out, lse, q, k_cache, v_cache, kwargs):
    """out/lse against the reference on the caches as they were before the kernel's append
    (each reference run appends the same tokens into its own copy)."""
    hi, ref_lse = reference.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(),
                                                   return_lse=True, compute_dtype=numpy.float32,
                                                   **kwargs)
    lo = reference.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(),
                                          compute_dtype=q.dtype, **kwargs)
    _assert_ok([testing.check_close("out", out, hi, lo), testing.lse_close(lse, ref_lse)])
    return ref_lse


# (seqlen_q, (nheads, nheads_kv), seqlen_new): a decode step with GQA 8:1 packing, a few rows
# of GQA 8:2 with an append, and MHA rows with no append.
DECODE_CASES = {
    "step_gqa8": (1, (8, 1), 1),
    "rows4_gqa8": (4, (16, 2), 2),
    "mha_no_append": (2, (4, 4), 0),
}


@pytest.mark.parametrize("num_splits", [1, 5, 0], ids=["one-split", "five-splits", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_kvcache(case, paged, num_splits):
    """Ragged cache lengths (3 tokens with 5 splits: most splits hold no key and the merge
    must still count the sink once; 0 tokens and no append: every row sees no key, out 0 and
    lse = sink), causal, both dtypes by case."""
    seqlen_q, (h, hk), seqlen_new = DECODE_CASES[case]
    dtype = BF16 if case == "rows4_gqa8" else FP16
    batch, capacity, d = 3, 768, 128
    rng = numpy.random.default_rng(seed_of("sinks-decode", case, paged, num_splits))
    q = _randn(rng, (batch, seqlen_q, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), \
        _randn(rng, (batch, capacity, hk, d), dtype)
    lengths = numpy.array([700, 3, 0], numpy.int32)
    kwargs = dict(cache_seqlens=cupy.asarray(lengths), causal=True,
                  sinks=_sinks(h, int(rng.integers(2**31)), extreme=case == "mha_no_append"))
    if seqlen_new:
        kwargs["k"] = _randn(rng, (batch, seqlen_new, hk, d), dtype)
        kwargs["v"] = _randn(rng, (batch, seqlen_new, hk, d), dtype)
    if paged:
        k_cache, v_cache, kwargs["block_table"] = paged_cache(k_cache, v_cache, 64, rng)
    k_run, v_run = k_cache.copy(), v_cache.copy()
    out, lse = cuflash2.attention_with_kvcache(q, k_run, v_run, num_splits=num_splits,
                                               return_lse=True, **kwargs)
    _check_decode(out, lse, q, k_cache, v_cache, kwargs)
    if not seqlen_new:  # sequence 2 holds no token: its rows see no key
        assert numpy.all(cupy.asnumpy(out[2]).astype(numpy.float32) == 0)
        numpy.testing.assert_allclose(
            cupy.asnumpy(lse[2]), numpy.broadcast_to(cupy.asnumpy(kwargs["sinks"])[:, None],
                                                     (h, seqlen_q)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_kvcache_paged_equals_contiguous_and_features(num_splits):
    """Paged and contiguous caches give the same bits with sinks; softcap + ALiBi + sinks
    pass the rule."""
    dtype = FP16
    rng = numpy.random.default_rng(seed_of("sinks-paged", num_splits))
    batch, capacity, h, hk, d = 2, 1024, 16, 2, 128
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), \
        _randn(rng, (batch, capacity, hk, d), dtype)
    k_new, v_new = _randn(rng, (batch, 1, hk, d), dtype), _randn(rng, (batch, 1, hk, d), dtype)
    slopes = cupy.asarray(rng.uniform(0.001, 0.05, (batch, h)).astype(numpy.float32))
    kwargs = dict(k=k_new, v=v_new, cache_seqlens=cupy.asarray(numpy.array([1000, 333],
                                                                            numpy.int32)),
                  causal=True, softcap=20.0, alibi_slopes=slopes, sinks=_sinks(h, num_splits))
    k_paged, v_paged, table = paged_cache(k_cache, v_cache, 32, rng)
    want, want_lse = cuflash2.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(),
                                                     num_splits=num_splits, return_lse=True,
                                                     **kwargs)
    got, got_lse = cuflash2.attention_with_kvcache(q, k_paged, v_paged, block_table=table,
                                                   num_splits=num_splits, return_lse=True,
                                                   **kwargs)
    assert _same_bits(got, want) and _same_bits(got_lse, want_lse)
    _check_decode(got, got_lse, q, k_cache, v_cache, kwargs)


def test_kvcache_step_replayed_from_a_cuda_graph():
    """A decode step with sinks captured into a CUDA graph (relaxed capture, as bench --decode
    does) and replayed gives the eager call's bits (out and lse, the appended token in place),
    within the rule."""
    driver = pytest.importorskip("cuda.bindings.driver")

    def check(result, what):
        assert int(result[0]) == 0, f"{what} failed: CUresult {int(result[0])}"

    dtype = BF16
    rng = numpy.random.default_rng(seed_of("sinks-graph"))
    batch, capacity, h, hk, d = 2, 4096, 8, 2, 128
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), \
        _randn(rng, (batch, capacity, hk, d), dtype)
    before = k_cache.copy(), v_cache.copy()
    kwargs = dict(k=_randn(rng, (batch, 1, hk, d), dtype), v=_randn(rng, (batch, 1, hk, d), dtype),
                  cache_seqlens=cupy.asarray(numpy.array([3000, 700], numpy.int32)), causal=True,
                  sinks=_sinks(h, 7), return_lse=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the plan and its scratch, outside the capture
        eager = cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)
    stream.synchronize()
    captured = []
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    check(driver.cuStreamBeginCapture(stream.ptr, mode), "cuStreamBeginCapture")
    try:
        with stream:
            captured.append(cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs))
    finally:
        err, graph = driver.cuStreamEndCapture(stream.ptr)
    check((err,), "cuStreamEndCapture")
    err, executable = driver.cuGraphInstantiate(graph, 0)
    check((err,), "cuGraphInstantiate")
    try:
        for _ in range(2):  # replays write the same token in place and read the same cache
            check(driver.cuGraphLaunch(executable, stream.ptr), "cuGraphLaunch")
        stream.synchronize()
    finally:
        driver.cuGraphExecDestroy(executable)
        driver.cuGraphDestroy(graph)
    (out, lse), = captured
    assert _same_bits(out, eager[0]) and _same_bits(lse, eager[1])
    reference_kwargs = {key: value for key, value in kwargs.items() if key != "return_lse"}
    _check_decode(out, lse, q, *before, reference_kwargs)
