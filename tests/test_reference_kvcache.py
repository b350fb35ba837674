"""The KV-cache reference (`reference.attention_with_kvcache`, flash-attn's
flash_attn_with_kvcache): in-place append, contiguous and paged caches, cache_batch_idx, ragged
cache lengths, causal / window alignment, GQA, and the argument checks (CPU)."""

import numpy
import pytest

from cuflash2 import reference

RNG = numpy.random.default_rng(0)


def randn(*shape):
    return RNG.standard_normal(shape).astype(numpy.float32)


def direct(q, k_all, v_all, lengths, **options):
    """Attention of each sequence over its first lengths[b] cache positions, one dense call each."""
    outs = [reference.attention(q[b], k_all[b][:n], v_all[b][:n], return_lse=True, **options)
            for b, n in enumerate(lengths)]
    return numpy.stack([o for o, _ in outs]), numpy.stack([lse for _, lse in outs])


@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (2, 2), (8, 0), (3, 5)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 4))])
def test_contiguous_cache_with_append(seqlen_q, seqlen_new, causal, window):
    batch, capacity, h, hk, d = 3, 64, 8, 2, 32
    q = randn(batch, seqlen_q, h, d)
    k_cache, v_cache = randn(batch, capacity, hk, d), randn(batch, capacity, hk, d)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    k_new, v_new = randn(batch, seqlen_new, hk, d), randn(batch, seqlen_new, hk, d)
    cached = numpy.array([10, 0, 40], numpy.int32)
    options = dict(causal=causal, window_size=window)
    out, lse = reference.attention_with_kvcache(
        q, k_cache, v_cache, k=k_new if seqlen_new else None, v=v_new if seqlen_new else None,
        cache_seqlens=cached, return_lse=True, **options)
    for b in range(batch):  # exactly the new tokens written, nothing else touched
        new = slice(cached[b], cached[b] + seqlen_new)
        numpy.testing.assert_array_equal(k_cache[b, new], k_new[b])
        numpy.testing.assert_array_equal(v_cache[b, new], v_new[b])
        before_k[b, new], before_v[b, new] = k_new[b], v_new[b]
    numpy.testing.assert_array_equal(k_cache, before_k)
    numpy.testing.assert_array_equal(v_cache, before_v)
    want_out, want_lse = direct(q, k_cache, v_cache, cached + seqlen_new, **options)
    numpy.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_paged_cache_equals_contiguous(page_size):
    batch, capacity, h, hk, d, seqlen_q, seqlen_new = 2, 128, 4, 1, 16, 2, 3
    q = randn(batch, seqlen_q, h, d)
    k_cache, v_cache = randn(batch, capacity, hk, d), randn(batch, capacity, hk, d)
    k_new, v_new = randn(batch, seqlen_new, hk, d), randn(batch, seqlen_new, hk, d)
    cached = numpy.array([37, 100], numpy.int32)
    # The same logical cache scattered over shuffled pages (two spare pages unused).
    per_seq = capacity // page_size
    num_blocks = batch * per_seq + 2
    order = RNG.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
    k_paged, v_paged = randn(num_blocks, page_size, hk, d), randn(num_blocks, page_size, hk, d)
    for b in range(batch):
        for j in range(per_seq):
            rows = slice(j * page_size, (j + 1) * page_size)
            k_paged[order[b, j]], v_paged[order[b, j]] = k_cache[b, rows], v_cache[b, rows]
    table = order.astype(numpy.int32)
    want = reference.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                            cache_seqlens=cached, causal=True)
    got = reference.attention_with_kvcache(q, k_paged, v_paged, k=k_new, v=v_new,
                                           cache_seqlens=cached, block_table=table, causal=True)
    numpy.testing.assert_array_equal(got, want)
    for b in range(batch):  # the appended tokens landed in the right pages
        for p in range(cached[b], cached[b] + seqlen_new):
            page, row = table[b, p // page_size], p % page_size
            numpy.testing.assert_array_equal(k_paged[page, row], k_new[b, p - cached[b]])


def test_cache_batch_idx_and_defaults():
    q = randn(2, 1, 2, 16)
    k_cache, v_cache = randn(5, 20, 2, 16), randn(5, 20, 2, 16)
    idx = numpy.array([4, 1], numpy.int32)
    got = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=7,
                                           cache_batch_idx=idx)
    want, _ = direct(q, k_cache[idx], v_cache[idx], [7, 7])
    numpy.testing.assert_array_equal(got, want)
    # Without cache_seqlens the whole cache is attended to.
    full = reference.attention_with_kvcache(q, k_cache[:2], v_cache[:2])
    numpy.testing.assert_array_equal(full, direct(q, k_cache[:2], v_cache[:2], [20, 20])[0])


def _args(**over):
    args = dict(q=randn(2, 1, 4, 16), k_cache=randn(2, 32, 2, 16), v_cache=randn(2, 32, 2, 16))
    args.update(over)
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return (q, k_cache, v_cache), args


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(cache_seqlens=numpy.array([30, 33], numpy.int32)), ValueError, r"cache_seqlens\[1\] = 33"),
    (dict(cache_seqlens=numpy.array([31, 30], numpy.int32), k=randn(2, 2, 2, 16),
          v=randn(2, 2, 2, 16)), ValueError, r"cache_seqlens\[0\] = 31 plus the 2 new tokens"),
    (dict(cache_seqlens=numpy.array([1, 2], numpy.int64)), TypeError, "int32"),
    (dict(cache_seqlens=numpy.array([1, 2, 3], numpy.int32)), ValueError, r"shape \(2,\)"),
    (dict(k=randn(2, 1, 2, 16)), ValueError, "together"),
    (dict(k=randn(2, 1, 3, 16), v=randn(2, 1, 3, 16)), ValueError, "seqlen_new, nheads_kv"),
    (dict(v_cache=randn(2, 31, 2, 16)), ValueError, "same shape"),
    (dict(k_cache=randn(3, 32, 2, 16), v_cache=randn(3, 32, 2, 16)), ValueError, "cache_batch_idx"),
    (dict(cache_batch_idx=numpy.array([0, 2], numpy.int32)), ValueError, r"\[0, 2\)"),
    (dict(q=randn(2, 1, 3, 16)), ValueError, "multiple"),
    (dict(block_table=numpy.array([[0], [5]], numpy.int32), cache_seqlens=4), ValueError,
     r"block_table\[1, 0\] = 5 is used"),
    (dict(block_table=numpy.array([[0, 1]], numpy.int32)), ValueError, "block_table must be"),
])
def test_bad_kvcache_arguments(over, exc, pattern):
    args, kwargs = _args(**over)
    with pytest.raises(exc, match=pattern):
        reference.attention_with_kvcache(*args, **kwargs)


def test_unused_block_table_entries_are_not_checked():
    # Sequence 0 holds 4 tokens of 16-row pages: only its first entry is read.
    q = randn(1, 1, 2, 16)
    k_paged, v_paged = randn(3, 16, 2, 16), randn(3, 16, 2, 16)
    table = numpy.array([[2, -1, 99]], numpy.int32)
    got = reference.attention_with_kvcache(q, k_paged, v_paged, cache_seqlens=4, block_table=table)
    want, _ = direct(q, k_paged[2:3], v_paged[2:3], [4])
    numpy.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("paged", [False, True])
def test_a_latent_cache_with_v_its_first_columns(paged):
    """MLA's decode form (docs/MLA_DECODE.md): one KV head whose cache rows are K, V their first
    d_v columns (a view), the new rows appended once through k (and v = k[..., :d_v]); the
    output has d_v columns and equals attention over the gathered K and V."""
    batch, capacity, h, d, d_v = 2, 48, 16, 80, 64
    q = randn(batch, 1, h, d)
    k_new = randn(batch, 1, 1, d)
    cached = numpy.array([20, 35], numpy.int32)
    if paged:
        latent = randn(7, 16, 1, d)
        table = numpy.array([[3, 0, 5], [6, 1, 2]], numpy.int32)
        gather = lambda b: latent[table[b]].reshape(capacity, 1, d)  # noqa: E731
        extra = dict(block_table=table)
    else:
        latent = randn(batch, capacity, 1, d)
        gather = lambda b: latent[b]  # noqa: E731
        extra = {}
    before = latent.copy()
    out, lse = reference.attention_with_kvcache(
        q, latent, latent[..., :d_v], k=k_new, v=k_new[..., :d_v], cache_seqlens=cached,
        causal=True, return_lse=True, **extra)
    assert out.shape == (batch, 1, h, d_v)
    for b in range(batch):
        rows = gather(b)
        numpy.testing.assert_array_equal(rows[cached[b]], k_new[b, 0])  # the appended row
        want, want_lse = reference.attention(q[b], rows[:cached[b] + 1], rows[:cached[b] + 1,
                                                                               :, :d_v],
                                             causal=True, return_lse=True)
        numpy.testing.assert_allclose(out[b], want, rtol=1e-6, atol=1e-6)
        numpy.testing.assert_allclose(lse[b], want_lse, rtol=1e-6, atol=1e-6)
    changed = numpy.argwhere((latent != before).any(axis=-1))
    assert len(changed) == batch  # one row a sequence, nothing else
    with pytest.raises(ValueError, match=r"v must have shape .* = \(2, 1, 1, 64\)"):
        reference.attention_with_kvcache(q, latent, latent[..., :d_v], k=k_new, v=k_new,
                                         cache_seqlens=cached, **extra)
