"""attention_with_kvcache with rotary in the append and cache_leftpad (issue 47), against the
reference (2x rule) run on host copies: both rotary styles, causal / full / window, GQA, paged
and contiguous caches, forced split counts, the FP8 cache, CUDA graph replay with fresh inputs;
the append checked bit for bit against reference.apply_rotary's rows (rotated keys, nothing else
touched); cache_leftpad hiding the keys before it."""

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import reference, testing  # noqa: E402
from grids import DTYPES, paged_cache, seed_of  # noqa: E402  (tests/gpu helper)

pytestmark = pytest.mark.gpu


def _randn(rng, shape, dtype):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def _tables(seqlen_ro, rotary_dim, dtype):
    """cos and sin of a standard RoPE (base 10000), (seqlen_ro, rotary_dim / 2), on the GPU."""
    inv = 1.0 / 10000 ** (numpy.arange(0, rotary_dim, 2) / rotary_dim)
    angles = numpy.arange(seqlen_ro)[:, None] * inv[None, :]
    return (cupy.asarray(numpy.cos(angles).astype(dtype)),
            cupy.asarray(numpy.sin(angles).astype(dtype)))


def _host(kwargs):
    return {n: cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x
            for n, x in kwargs.items() if n not in ("return_lse", "early_cache_reads")}


def _reference(q, k_cache, v_cache, kwargs):
    """(hi, lo, k_cache, v_cache): the reference in float32 and in q's dtype, on host copies of
    the cache before the call, and the caches it appended into."""
    q_h, host = cupy.asnumpy(q), _host(kwargs)
    k_h, v_h = cupy.asnumpy(k_cache), cupy.asnumpy(v_cache)
    hi = reference.attention_with_kvcache(q_h, k_h, v_h, return_lse=True,
                                          compute_dtype=numpy.float32, **host)
    lo = reference.attention_with_kvcache(q_h, k_h.copy(), v_h.copy(), compute_dtype=q_h.dtype,
                                          **host)
    return hi, lo, k_h, v_h


def _check(out, lse, hi, lo):
    result = testing.check_close("out", cupy.asnumpy(out), hi[0], lo)
    assert result.ok, str(result)
    assert testing.lse_close(cupy.asnumpy(lse), hi[1]).ok


def _same_bits(got, want):
    got = cupy.asnumpy(got)
    return bool((got.view(numpy.uint8) == numpy.asarray(want).view(numpy.uint8)).all())


def _check_splits(q, k_cache, v_cache, kwargs, splits):
    """The call on copies of the cache at each split count against the reference (on host
    copies of the cache before the call): out and lse by the 2x rule, and the append wrote
    exactly the new rows, rotated as apply_rotary rotates them."""
    hi, lo, k_want, v_want = _reference(q, k_cache, v_cache, kwargs)
    for s in splits:
        k_run, v_run = k_cache.copy(), v_cache.copy()
        out, lse = cuflash2.attention_with_kvcache(q, k_run, v_run, num_splits=s,
                                                   return_lse=True, **kwargs)
        _check(out, lse, hi, lo)
        assert _same_bits(k_run, k_want) and _same_bits(v_run, v_want), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim,rotary_dim", [(64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (4, 4), (3, 17)])
@pytest.mark.parametrize("heads", [(8, 1), (4, 4)], ids=["gqa8", "mha"])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_rotary_against_reference(dtype, headdim, rotary_dim, interleaved, seqlen_q,
                                  seqlen_new, heads, mask):
    h, hk = heads
    batch, capacity = 3, 700
    rng = numpy.random.default_rng(seed_of("rotary", str(dtype), headdim, rotary_dim,
                                           interleaved, seqlen_q, seqlen_new, heads, mask))
    q = _randn(rng, (batch, seqlen_q, h, headdim), dtype)
    k_cache = _randn(rng, (batch, capacity, hk, headdim), dtype)
    v_cache = _randn(rng, (batch, capacity, hk, headdim), dtype)
    cos, sin = _tables(capacity, rotary_dim, dtype)
    kwargs = dict(k=_randn(rng, (batch, seqlen_new, hk, headdim), dtype),
                  v=_randn(rng, (batch, seqlen_new, hk, headdim), dtype),
                  cache_seqlens=cupy.asarray(numpy.array([500, 70, 0], numpy.int32)),
                  rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                  causal=mask == "causal", window_size=(40, 0) if mask == "window" else (-1, -1))
    _check_splits(q, k_cache, v_cache, kwargs, (0, 1, 5))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_rotary_paged_equals_contiguous(interleaved, page_size):
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("rotary-paged", interleaved, page_size))
    batch, capacity, h, hk, d = 2, 1024, 16, 2, 128
    q = _randn(rng, (batch, 2, h, d), dtype)
    k_cache, v_cache = (_randn(rng, (batch, capacity, hk, d), dtype),
                        _randn(rng, (batch, capacity, hk, d), dtype))
    cos, sin = _tables(capacity, 64, dtype)
    kwargs = dict(k=_randn(rng, (batch, 2, hk, d), dtype), v=_randn(rng, (batch, 2, hk, d), dtype),
                  cache_seqlens=cupy.asarray(numpy.array([1000, 333], numpy.int32)),
                  rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=True)
    k_paged, v_paged, table = paged_cache(k_cache, v_cache, page_size, rng)
    for splits in (1, 4):
        kc, vc = k_cache.copy(), v_cache.copy()
        want = cuflash2.attention_with_kvcache(q, kc, vc, num_splits=splits, **kwargs)
        kp, vp = k_paged.copy(), v_paged.copy()
        got = cuflash2.attention_with_kvcache(q, kp, vp, block_table=table, num_splits=splits,
                                              **kwargs)
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), splits
        # The pages hold the contiguous cache's rotated rows.
        order = cupy.asnumpy(table)
        for b in range(batch):
            for j in range(order.shape[1]):
                rows = slice(j * page_size, (j + 1) * page_size)
                assert bool((kp[int(order[b, j])] == kc[b, rows]).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_cache_leftpad_against_reference(dtype, mask, rotary):
    """Keys before cache_leftpad[b] are neither attended nor read (NaN there, as a left-padded
    region may hold anything: a masked key that is read would bring it into O through 0 * NaN);
    positions stay the cache's."""
    batch, capacity, h, hk, d = 4, 900, 8, 2, 128
    rng = numpy.random.default_rng(seed_of("leftpad", str(dtype), mask, rotary))
    q = _randn(rng, (batch, 2, h, d), dtype)
    k_cache = _randn(rng, (batch, capacity, hk, d), dtype)
    v_cache = _randn(rng, (batch, capacity, hk, d), dtype)
    lengths = numpy.array([800, 70, 5, 300], numpy.int32)
    pads = numpy.array([0, 65, 5, 130], numpy.int32)  # the third: only the new tokens remain
    for b in range(batch):
        k_cache[b, :int(pads[b])] = numpy.nan
        v_cache[b, :int(pads[b])] = numpy.nan
    kwargs = dict(k=_randn(rng, (batch, 2, hk, d), dtype), v=_randn(rng, (batch, 2, hk, d), dtype),
                  cache_seqlens=cupy.asarray(lengths), cache_leftpad=cupy.asarray(pads),
                  causal=mask == "causal", window_size=(100, 0) if mask == "window" else (-1, -1))
    if rotary:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = _tables(capacity, 128, dtype)
    _check_splits(q, k_cache, v_cache, kwargs, (0, 1, 7))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary_fp8_cache_rotates_before_quantising(interleaved):
    """An e4m3 cache: the new keys rotated, then quantised (the reference's order), the
    attention within the 2x rule of the reference on the dequantised cache; both rotary styles
    (NeoX's partner lies in another 16-element chunk of the stage)."""
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("rotary-fp8", interleaved))
    batch, capacity, h, hk, d = 2, 600, 8, 2, 128
    q = _randn(rng, (batch, 3, h, d), dtype)
    k16 = rng.standard_normal((batch, capacity, hk, d)).astype(numpy.float32)
    k_cache = cupy.asarray(cuflash2.fp8.quantize_e4m3(k16, numpy.float32(1)))
    v_cache = cupy.asarray(cuflash2.fp8.quantize_e4m3(k16[::-1].copy(), numpy.float32(1)))
    cos, sin = _tables(capacity, 64, dtype)
    kwargs = dict(k=_randn(rng, (batch, 3, hk, d), dtype), v=_randn(rng, (batch, 3, hk, d), dtype),
                  cache_seqlens=cupy.asarray(numpy.array([590, 44], numpy.int32)),
                  rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                  causal=True, kv_cache_dtype="e4m3")
    _check_splits(q, k_cache, v_cache, kwargs, (1, 3))


@pytest.mark.parametrize("early", [False, True], ids=["", "early-cache-reads"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["rotary", "rotary-leftpad"])
def test_cuda_graph_replays_with_fresh_inputs(leftpad, early):
    """A captured rotary decode step replayed as a serving loop replays it: new q, k, v, cache
    lengths (and pads) in the same arrays each step, the cache growing by the appended token;
    also with early_cache_reads (the cache read before the wait for the previous kernel, the
    rotated q after it)."""
    from cuflash2.bench.decode_graph import CapturedGraph

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("rotary-graph", leftpad))
    batch, capacity, h, hk, d = 2, 1024, 16, 2, 128
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = (_randn(rng, (batch, capacity, hk, d), dtype),
                        _randn(rng, (batch, capacity, hk, d), dtype))
    k, v = _randn(rng, (batch, 1, hk, d), dtype), _randn(rng, (batch, 1, hk, d), dtype)
    cos, sin = _tables(capacity, 128, dtype)
    lengths = cupy.asarray(numpy.array([500, 37], numpy.int32))
    kwargs = dict(k=k, v=v, cache_seqlens=lengths, rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=False, causal=True, return_lse=True,
                  early_cache_reads=early)
    pads = cupy.asarray(numpy.array([3, 30], numpy.int32))
    if leftpad:
        kwargs["cache_leftpad"] = pads
    stream = cupy.cuda.Stream(non_blocking=True)
    captured = {}
    with stream:  # planned and compiled outside the capture
        cuflash2.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), **kwargs)
    stream.synchronize()
    graph = CapturedGraph(cupy, stream, lambda: captured.update(
        result=cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)))
    for step in range(3):
        for x in (q, k, v):  # (on the current stream, which `stream` does not wait for)
            x[...] = cupy.asarray(rng.standard_normal(x.shape).astype(dtype))
        lengths[...] = cupy.asarray(numpy.array([500 + step, 37 + 5 * step], numpy.int32))
        pads[...] = cupy.asarray(numpy.array([3 + step, 30 - step], numpy.int32))
        cupy.cuda.Device().synchronize()
        hi, lo, k_want, v_want = _reference(q, k_cache, v_cache, kwargs)
        graph.launch()
        stream.synchronize()
        out, lse = captured["result"]
        _check(out, lse, hi, lo)
        assert _same_bits(k_cache, k_want) and _same_bits(v_cache, v_want)


def test_unchecked_positions_past_the_table_read_nothing_outside_it():
    """cache_seqlens past the capacity (unchecked): no position outside the table is read (q's
    rows there stay unrotated), nothing written past the cache, and the call completes."""
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(5)
    q = _randn(rng, (1, 4, 8, 64), dtype)
    k_cache, v_cache = _randn(rng, (1, 64, 2, 64), dtype), _randn(rng, (1, 64, 2, 64), dtype)
    cos, sin = _tables(64, 64, dtype)
    before = k_cache.copy()
    out = cuflash2.attention_with_kvcache(
        q, k_cache, v_cache, k=_randn(rng, (1, 4, 2, 64), dtype),
        v=_randn(rng, (1, 4, 2, 64), dtype), cache_seqlens=cupy.asarray(
            numpy.array([200], numpy.int32)), rotary_cos=cos, rotary_sin=sin, causal=True)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(out).all())
    assert bool((k_cache == before).all())
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 200"):
        cuflash2.attention_with_kvcache(
            q, k_cache, v_cache, k=_randn(rng, (1, 4, 2, 64), dtype),
            v=_randn(rng, (1, 4, 2, 64), dtype), cache_seqlens=cupy.asarray(
                numpy.array([200], numpy.int32)), rotary_cos=cos, rotary_sin=sin, causal=True,
            check_cache=True)
