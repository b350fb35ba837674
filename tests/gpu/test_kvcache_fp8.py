"""attention_with_kvcache with an FP8 e4m3 cache (kv_cache_dtype="e4m3", issue 45): contiguous
and paged, GQA, causal and windowed, forced split counts, every head dim, the score modifiers,
against the float32 reference on the dequantised cache (flash-attn's rule: the error at most 2x
that of the same reference computed in q's dtype, plus the dtype's atol); the in-place append
checked byte for byte against the reference's quantisation (only the new rows change, and they
hold round(k / k_descale) in e4m3). Fresh random inputs, outputs on memory poisoned with NaN."""

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import fp8, reference, testing  # noqa: E402
from grids import BF16, DTYPES, paged_cache, seed_of  # noqa: E402  (tests/gpu helper)

pytestmark = pytest.mark.gpu


def _poison():
    """NaN in the memory the next allocations get (CuPy's pool hands freed blocks back)."""
    block = cupy.full((1 << 22,), numpy.nan, numpy.float32)
    del block


def _cache(rng, shape, descale):
    """e4m3 bits of standard-normal values quantised by `descale` (broadcasting against the
    cache's (..., nheads_kv, headdim)), so the cache spans e4m3's range down to subnormals."""
    values = rng.standard_normal(shape).astype(numpy.float32)
    return cupy.asarray(fp8.quantize_e4m3(values, descale))


def _descales(rng, kind, batch, hk):
    """(k_descale, v_descale) as the call takes them, and as (batch, hk) host arrays."""
    if kind == "per_head":
        kd = rng.uniform(3.0, 5.0, (batch, hk)).astype(numpy.float32) / 448
        vd = rng.uniform(3.0, 5.0, (batch, hk)).astype(numpy.float32) / 448
        return cupy.asarray(kd), cupy.asarray(vd), kd, vd
    if kind == "broadcast":  # one factor a KV head, shared by the sequences (stride 0)
        kd = rng.uniform(3.0, 5.0, (1, hk)).astype(numpy.float32) / 448
        vd = rng.uniform(3.0, 5.0, (1, hk)).astype(numpy.float32) / 448
        return (cupy.broadcast_to(cupy.asarray(kd), (batch, hk)),
                cupy.broadcast_to(cupy.asarray(vd), (batch, hk)),
                numpy.broadcast_to(kd, (batch, hk)), numpy.broadcast_to(vd, (batch, hk)))
    kd, vd = numpy.float32(4.0 / 448), numpy.float32(3.0 / 448)  # per tensor, (1,)
    return (cupy.full((1,), kd, cupy.float32), cupy.full((1,), vd, cupy.float32),
            numpy.full((batch, hk), kd), numpy.full((batch, hk), vd))


def _run_and_check(q, k_cache, v_cache, kwargs, host_descales, splits=(0, 1, 5), table=None):
    """Runs the call on copies of the cache for each split count and checks out, lse and the
    appended cache against the reference (on host copies of the cache before the call)."""
    kd, vd = host_descales
    host = {n: (x.get() if isinstance(x, cupy.ndarray) else x) for n, x in kwargs.items()
            if n not in ("k_descale", "v_descale")}
    if table is not None:
        host["block_table"] = table.get()
    q_host = q.get()
    ref_k, ref_v = k_cache.get(), v_cache.get()
    hi = reference.attention_with_kvcache(q_host, ref_k, ref_v, return_lse=True,
                                          compute_dtype=numpy.float32, kv_cache_dtype="e4m3",
                                          k_descale=kd, v_descale=vd, **host)
    lo = reference.attention_with_kvcache(q_host, k_cache.get(), v_cache.get(),
                                          compute_dtype=q.dtype, kv_cache_dtype="e4m3",
                                          k_descale=kd, v_descale=vd, **host)
    outs = []
    for s in splits:
        k_run, v_run = k_cache.copy(), v_cache.copy()
        _poison()
        out, lse = cuflash2.attention_with_kvcache(q, k_run, v_run, num_splits=s,
                                                   return_lse=True, kv_cache_dtype="e4m3",
                                                   block_table=table, **kwargs)
        result = testing.check_close("out", out, cupy.asarray(hi[0]), cupy.asarray(lo))
        assert result.ok, f"splits={s}: {result}"
        assert testing.lse_close(lse, cupy.asarray(hi[1])).ok, s
        # The append: exactly the new rows, holding the reference's e4m3 bytes.
        numpy.testing.assert_array_equal(k_run.get(), ref_k)
        numpy.testing.assert_array_equal(v_run.get(), ref_v)
        outs.append(out)
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (2, 0), (4, 4), (33, 3)])
@pytest.mark.parametrize("heads", [(8, 1), (16, 2), (4, 4)], ids=["gqa8", "gqa8x2", "mha"])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("descale", ["per_head", "per_tensor"])
def test_fp8_cache_against_reference(dtype, headdim, seqlen_q, seqlen_new, heads, mask,
                                     descale):
    h, hk = heads
    batch, capacity = 3, 700
    rng = numpy.random.default_rng(seed_of("fp8", str(dtype), headdim, seqlen_q, seqlen_new,
                                           heads, mask, descale))
    kd, vd, kd_host, vd_host = _descales(rng, descale, batch, hk)
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, h, headdim)).astype(dtype))
    k_cache = _cache(rng, (batch, capacity, hk, headdim), kd_host[:, None, :, None])
    v_cache = _cache(rng, (batch, capacity, hk, headdim), vd_host[:, None, :, None])
    new = {}
    if seqlen_new:
        new = {n: cupy.asarray((rng.standard_normal((batch, seqlen_new, hk, headdim)) * 2)
                               .astype(dtype)) for n in ("k", "v")}
    kwargs = dict(cache_seqlens=cupy.asarray(numpy.array([500, 70, 0], numpy.int32)),
                  causal=mask == "causal", window_size=(40, 0) if mask == "window" else (-1, -1),
                  k_descale=kd, v_descale=vd, **new)
    _run_and_check(q, k_cache, v_cache, kwargs, (kd_host, vd_host))


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_paged_equals_contiguous(page_size, dtype):
    rng = numpy.random.default_rng(seed_of("fp8-paged", page_size, str(dtype)))
    batch, capacity, h, hk, d = 2, 1024, 16, 2, 128
    kd, vd, kd_host, vd_host = _descales(rng, "broadcast", batch, hk)
    q = cupy.asarray(rng.standard_normal((batch, 1, h, d)).astype(dtype))
    k_cache = _cache(rng, (batch, capacity, hk, d), kd_host[:, None, :, None])
    v_cache = _cache(rng, (batch, capacity, hk, d), vd_host[:, None, :, None])
    new = {n: cupy.asarray(rng.standard_normal((batch, 1, hk, d)).astype(dtype))
           for n in ("k", "v")}
    lengths = cupy.asarray(numpy.array([1000, 333], numpy.int32))
    k_paged, v_paged, table = paged_cache(k_cache, v_cache, page_size, rng)
    kwargs = dict(cache_seqlens=lengths, k_descale=kd, v_descale=vd, causal=True, **new)
    for splits in (1, 4):
        want = cuflash2.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(),
                                               kv_cache_dtype="e4m3", num_splits=splits,
                                               **kwargs)
        kp, vp = k_paged.copy(), v_paged.copy()
        got = cuflash2.attention_with_kvcache(q, kp, vp, block_table=table,
                                              kv_cache_dtype="e4m3", num_splits=splits,
                                              **kwargs)
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), splits
        for b, n in enumerate(lengths.get()):  # the appended token landed in its page
            page, row = int(table[b, n // page_size]), int(n % page_size)
            want_k = fp8.quantize_e4m3(new["k"][b, 0].get(), kd_host[b][:, None])
            numpy.testing.assert_array_equal(kp[page, row].get(), want_k)
    _run_and_check(q, k_paged, v_paged, kwargs, (kd_host, vd_host), splits=(0,), table=table)


@pytest.mark.parametrize("headdim", [32, 80, 96, 160, 192, 224, 256])
def test_fp8_every_head_dim(headdim):
    """Every kernel head dim (80: a user head dim padded to the kernel's 96)."""
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("fp8-d", headdim))
    kd, vd, kd_host, vd_host = _descales(rng, "per_head", 2, 2)
    q = cupy.asarray(rng.standard_normal((2, 3, 4, headdim)).astype(dtype))
    k_cache = _cache(rng, (2, 300, 2, headdim), kd_host[:, None, :, None])
    v_cache = _cache(rng, (2, 300, 2, headdim), vd_host[:, None, :, None])
    new = {n: cupy.asarray(rng.standard_normal((2, 2, 2, headdim)).astype(dtype))
           for n in ("k", "v")}
    kwargs = dict(cache_seqlens=cupy.asarray(numpy.array([297, 17], numpy.int32)), causal=True,
                  k_descale=kd, v_descale=vd, **new)
    _run_and_check(q, k_cache, v_cache, kwargs, (kd_host, vd_host), splits=(0, 3))


def test_fp8_long_cache_with_features():
    """16k tokens, softcap, ALiBi and sinks, descales shared along the batch (stride 0)."""
    rng = numpy.random.default_rng(seed_of("fp8-long"))
    batch, capacity, h, hk, d = 2, 16384, 16, 2, 128
    kd, vd, kd_host, vd_host = _descales(rng, "broadcast", batch, hk)
    q = cupy.asarray(rng.standard_normal((batch, 1, h, d)).astype(BF16))
    k_cache = _cache(rng, (batch, capacity, hk, d), kd_host[:, None, :, None])
    v_cache = _cache(rng, (batch, capacity, hk, d), vd_host[:, None, :, None])
    new = {n: cupy.asarray(rng.standard_normal((batch, 1, hk, d)).astype(BF16))
           for n in ("k", "v")}
    slopes = cupy.asarray(numpy.linspace(0.001, 0.01, h).astype(numpy.float32))
    sinks = cupy.asarray(rng.standard_normal(h).astype(numpy.float32))
    kwargs = dict(cache_seqlens=cupy.asarray(numpy.array([16000, 9000], numpy.int32)),
                  softcap=20.0, alibi_slopes=slopes, sinks=sinks, k_descale=kd, v_descale=vd,
                  **new)
    _run_and_check(q, k_cache, v_cache, kwargs, (kd_host, vd_host), splits=(0, 1))


def test_fp8_early_cache_reads_and_plan_reuse_give_the_same_bits():
    rng = numpy.random.default_rng(seed_of("fp8-early"))
    batch, capacity, h, hk, d = 2, 4096, 8, 1, 128
    kd, vd, kd_host, vd_host = _descales(rng, "per_head", batch, hk)
    q = cupy.asarray(rng.standard_normal((batch, 1, h, d)).astype(BF16))
    k_cache = _cache(rng, (batch, capacity, hk, d), kd_host[:, None, :, None])
    v_cache = _cache(rng, (batch, capacity, hk, d), vd_host[:, None, :, None])
    kwargs = dict(cache_seqlens=4000, kv_cache_dtype="e4m3", k_descale=kd, v_descale=vd)
    want = cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)
    for early in (False, True, True):
        got = cuflash2.attention_with_kvcache(q, k_cache, v_cache, early_cache_reads=early,
                                              **kwargs)
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), early
    # Other factors, same signature: the plan's pointers follow the call's arrays.
    twice = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4000,
                                            kv_cache_dtype="e4m3", k_descale=kd,
                                            v_descale=vd * 2)
    numpy.testing.assert_allclose(twice.get().astype(numpy.float32),
                                  2 * want.get().astype(numpy.float32), rtol=1e-2, atol=1e-3)


def test_fp8_nan_and_saturated_values():
    """A NaN byte (0x7f) in a visible V row makes its column NaN; new tokens beyond 448 x descale
    are stored as +-448 (0x7e / 0xfe), not NaN."""
    rng = numpy.random.default_rng(seed_of("fp8-nan"))
    q = cupy.asarray(rng.standard_normal((1, 1, 4, 64)).astype(numpy.float16))
    k_cache = cupy.zeros((1, 128, 1, 64), cupy.uint8)
    v_cache = cupy.zeros((1, 128, 1, 64), cupy.uint8)
    v_cache[0, 5, 0, 7] = 0x7F
    big = cupy.full((1, 1, 1, 64), 1000.0, cupy.float16)
    big[..., 1::2] *= -1
    one = cupy.ones((1,), cupy.float32)
    out = cuflash2.attention_with_kvcache(q, k_cache, v_cache, k=big, v=big, cache_seqlens=10,
                                          kv_cache_dtype="e4m3", k_descale=one, v_descale=one)
    got = out.get().astype(numpy.float32)
    assert numpy.isnan(got[..., 7]).all()
    assert numpy.isfinite(numpy.delete(got, 7, axis=-1)).all()
    stored = k_cache[0, 10, 0].get()
    assert list(stored[:2]) == [0x7E, 0xFE] and (v_cache[0, 10, 0].get() == stored).all()
