"""attention_with_kvcache on MLA's latent cache (DeepSeek-V3: K the 576 columns of a cache row,
V its first 512, one KV head; cuda_src/flash_mla_decode_sm90.cu, docs/MLA_DECODE.md) on an
sm_90 GPU: against the reference (2x rule) with 16 / 64 / 128 heads, one and two query tokens,
odd and empty cache lengths, new rows appended (and only them), contiguous and paged caches
(page sizes 64, 8, 16, 32, 128: paged == contiguous bit for bit), split counts, positions past a
sequence's length poisoned with NaN (never reaching O), and a CUDA-graph replay."""

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import reference, testing  # noqa: E402
from grids import BF16, DTYPES, needs_hopper, paged_cache, seed_of  # noqa: E402  (tests/gpu helper)

pytestmark = [pytest.mark.gpu, needs_hopper]

D, DV = 576, 512


def _randn(rng, shape, dtype):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def _poison_past(cache, lengths):
    """NaN in every cached row at or past each sequence's length (a contiguous cache)."""
    nan = 0x7E00 if cache.dtype == numpy.float16 else 0x7FC0  # fp16 / bf16 quiet NaN bits
    bits = cache.view(cupy.uint16)
    for b, n in enumerate(lengths):
        bits[b, int(n):] = nan


def _reference(q, cache, new, kwargs, compute_dtype, return_lse=False):
    """The reference on a copy of the cache (it appends too), in the reference's MLA form."""
    c = cache.copy()
    extra = {} if new is None else dict(k=new, v=new[..., :DV])
    return reference.attention_with_kvcache(q, c, c[..., :DV], return_lse=return_lse,
                                            compute_dtype=compute_dtype, **extra, **kwargs)


def _run(q, cache, new, **kwargs):
    extra = {} if new is None else dict(k=new, v=new[..., :DV])
    return cuflash2.attention_with_kvcache(q, cache, cache[..., :DV], return_lse=True, **extra,
                                           **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads", [16, 64, 128])
@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("seqlen_new", [0, 1, 2])
def test_mla_decode_against_reference(dtype, nheads, seqlen_q, seqlen_new):
    batch, capacity = 3, 1100
    rng = numpy.random.default_rng(seed_of("mla", str(dtype), nheads, seqlen_q, seqlen_new))
    q = _randn(rng, (batch, seqlen_q, nheads, D), dtype)
    cache = _randn(rng, (batch, capacity, 1, D), dtype)
    new = _randn(rng, (batch, seqlen_new, 1, D), dtype) if seqlen_new else None
    lengths = numpy.array([1001, 63, 0], numpy.int32)  # odd, inside one tile, empty
    _poison_past(cache, lengths)
    kwargs = dict(cache_seqlens=cupy.asarray(lengths), causal=seqlen_q > 1)
    hi_out, hi_lse = _reference(q, cache, new, kwargs, numpy.float32, return_lse=True)
    lo_out = _reference(q, cache, new, kwargs, q.dtype)
    appended = cache.copy()
    if new is not None:
        for b, n in enumerate(lengths):
            appended[b, int(n):int(n) + seqlen_new] = new[b]
    for splits in (0, 1, 3):
        run_cache = cache.copy()
        out, lse = _run(q, run_cache, new, num_splits=splits, **kwargs)
        assert out.shape == (batch, seqlen_q, nheads, DV)
        result = testing.check_close("out", out, hi_out, lo_out)
        assert result.ok, (splits, str(result))
        assert testing.lse_close(lse, hi_lse).ok, splits
        # The append wrote the new rows, all 576 columns, and nothing else (NaN kept elsewhere).
        assert bool((run_cache.view(cupy.uint16) == appended.view(cupy.uint16)).all()), splits


@pytest.mark.parametrize("page_size", [64, 8, 16, 32, 128])
def test_mla_paged_equals_contiguous(page_size):
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(page_size)
    batch, capacity, nheads = 2, 1024, 128
    q = _randn(rng, (batch, 1, nheads, D), dtype)
    cache = _randn(rng, (batch, capacity, 1, D), dtype)
    new = _randn(rng, (batch, 1, 1, D), dtype)
    lengths = cupy.asarray(numpy.array([1000, 333], numpy.int32))
    paged, _, table = paged_cache(cache, cache, page_size, rng)
    for splits in (1, 4):
        want, want_lse = _run(q, cache.copy(), new, cache_seqlens=lengths, num_splits=splits)
        run_pages = paged.copy()
        got, got_lse = _run(q, run_pages, new, cache_seqlens=lengths, block_table=table,
                            num_splits=splits)
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), splits
        assert bool((got_lse == want_lse).all()), splits
        for b, n in enumerate(lengths.get()):
            page, row = int(table[b, n // page_size]), int(n % page_size)
            assert bool((run_pages[page, row].view(cupy.uint16)
                         == new[b, 0].view(cupy.uint16)).all())


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_mla_paired_row_blocks_equal_the_blocks_alone(paged, seqlen_q):
    """One split, 128 heads: the two row blocks of a token as a cluster sharing each tile (TMA
    multicast, MlaDecodeConfig.paired) give the bits of the same blocks run alone, and the same
    appended rows; pages of 16 (four boxes a tile) and of 64."""
    from cuflash2 import _dispatch, _kvcache

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("mla-paired", paged, seqlen_q))
    batch, capacity, nheads = 3, 1024, 128
    q = _randn(rng, (batch, seqlen_q, nheads, D), dtype)
    cache = _randn(rng, (batch, capacity, 1, D), dtype)
    new = _randn(rng, (batch, 1, 1, D), dtype)
    lengths = cupy.asarray(numpy.array([1000, 333, 64], numpy.int32))
    kwargs = dict(cache_seqlens=lengths, num_splits=1, causal=seqlen_q > 1)
    if paged:
        cache, _, table = paged_cache(cache, cache, 16, rng)
        kwargs["block_table"] = table
    results = {}
    try:
        for paired in (True, False):
            _dispatch.MLA_PAIRED = paired
            _kvcache._plans_by_key.plans.clear()
            run_cache = cache.copy()
            out, lse = _run(q, run_cache, new, **kwargs)
            results[paired] = (out, lse, run_cache)
    finally:
        _dispatch.MLA_PAIRED = True
        _kvcache._plans_by_key.plans.clear()
    (out, lse, appended), (want, want_lse, want_cache) = results[True], results[False]
    assert bool((out.view(cupy.uint16) == want.view(cupy.uint16)).all())
    assert bool((lse == want_lse).all())
    assert bool((appended.view(cupy.uint16) == want_cache.view(cupy.uint16)).all())


def test_mla_long_cache_splits_and_bf16():
    """A 16k-token bf16 step of one sequence (the automatic split count merges many splits)."""
    dtype = BF16
    rng = numpy.random.default_rng(16384)
    q = _randn(rng, (1, 1, 128, D), dtype)
    cache = _randn(rng, (1, 16384, 1, D), dtype)
    kwargs = dict(cache_seqlens=16001)
    out, lse = _run(q, cache, None, **kwargs)
    hi_out, hi_lse = _reference(q, cache, None, kwargs, numpy.float32, return_lse=True)
    result = testing.check_close("out", out, hi_out, _reference(q, cache, None, kwargs, q.dtype))
    assert result.ok, str(result)
    assert testing.lse_close(lse, hi_lse).ok


@pytest.mark.parametrize("splits", [1, 4])
def test_mla_decode_replayed_in_a_cuda_graph(splits):
    """A captured step replays to the bits of the eager one (the append re-applied to a fresh
    copy of the cache each time)."""
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(splits)
    q = _randn(rng, (2, 1, 64, D), dtype)
    start = _randn(rng, (2, 2048, 1, D), dtype)
    new = _randn(rng, (2, 1, 1, D), dtype)
    kwargs = dict(cache_seqlens=2000, num_splits=splits)
    eager_cache = start.copy()
    want, want_lse = _run(q, eager_cache, new, **kwargs)  # plans (and compiles) outside capture
    cache = start.copy()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        got, got_lse = _run(q, cache, new, **kwargs)
        graph = stream.end_capture()
    for _ in range(2):
        cache[...] = start
        graph.launch(stream)
        stream.synchronize()
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all())
        assert bool((got_lse == want_lse).all())
        assert bool((cache.view(cupy.uint16) == eager_cache.view(cupy.uint16)).all())


def test_mla_refusals_off_the_kernel():
    """A v_cache that is not k_cache's view, and score modifiers, are refused before anything
    runs (the host tests check every refusal: tests/test_mla_decode_host.py)."""
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(0)
    q = _randn(rng, (1, 1, 16, D), dtype)
    cache = _randn(rng, (1, 128, 1, D), dtype)
    with pytest.raises(ValueError, match="must be the view"):
        cuflash2.attention_with_kvcache(q, cache, cache[..., :DV].copy(), cache_seqlens=100)
    with pytest.raises(NotImplementedError, match="softcap"):
        cuflash2.attention_with_kvcache(q, cache, cache[..., :DV], cache_seqlens=100,
                                        softcap=10.0)
