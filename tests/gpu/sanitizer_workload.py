"""Small launches of every kernel specialisation (forward and backward), run under
compute-sanitizer by test_sanitizer.py.

Odd sequence lengths (partial tiles), seqlen_q != seqlen_k both ways, GQA, causal, a sliding
window and neither, softcap + ALiBi, varlen, every kernel head dim and both dtypes, and the
float32 forward and backward (`_float32`): the shapes where an out-of-bounds access or a race
would show.
Pass `--quick` for a subset (racecheck is slow), `--only fp8 mla_decode decode_rotary` for
those sections alone (`SECTIONS`). On sm_90 the forwards of head dims above 64, and of d <= 64 with more than
256 keys, run on the Hopper kernel (wgmma, TMA, mbarriers): in both consumer schedules across
the head dims, on the persistent grid for the short rows and on one tile per CTA for the 600-key
ones at d=96, and with its tiles claimed one by one (`_claimed_tiles`), the FP8 forward (`_fp8`)
and the MLA decode (`_mla_decode`); the backwards run on the Hopper backward, deterministic ones
too (its ordered dQ, staged and by vector reductions, dense and varlen; the dropout calls on
mma.sync), and `_hopper_backward` switches it on for its own section whatever the environment
says.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api, testing  # noqa: E402


def _features(dtype, d) -> None:
    """softcap + ALiBi + dropout, and varlen (ragged, empty and partial-tile sequences, with and
    without dropout), forward and both backward modes; the dropout mask kernel."""
    q, k, v = testing.random_qkv(cupy, 2, 45, 77, 4, 2, d, dtype, seed=d + 7)
    dout = testing.random_qkv(cupy, 2, 45, 45, 4, 4, d, dtype, seed=d + 8)[0]
    slopes = cupy.linspace(0.05, 0.5, 8, dtype=cupy.float32).reshape(2, 4)
    options = dict(causal=True, softcap=3.0, alibi_slopes=slopes, dropout_p=0.2, seed=d)
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    for deterministic in (False, True):
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                            **options)
        assert not any(bool(cupy.isnan(g).any()) for g in grads)
    assert cuflash2.dropout_mask(2, 3, 45, 77, 0.3, d).shape == (2, 3, 45, 77)
    lengths_q, lengths_k = (45, 0, 131, 1), (77, 0, 20, 130)
    cu_q = cupy.asarray(numpy.cumsum((0,) + lengths_q).astype(numpy.int32))
    cu_k = cupy.asarray(numpy.cumsum((0,) + lengths_k).astype(numpy.int32))
    q, k, v = testing.random_qkv(cupy, None, sum(lengths_q), sum(lengths_k), 4, 2, d, dtype,
                                 seed=d + 9)
    dout = testing.random_qkv(cupy, None, sum(lengths_q), sum(lengths_q), 4, 4, d, dtype,
                              seed=d + 10)[0]
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    for causal in (False, True):
        drop = dict(dropout_p=0.1, seed=d) if causal else {}
        out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=causal, return_lse=True,
                                             **drop)
        for deterministic in (False, True):
            grads = cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args,
                                                       causal=causal, deterministic=deterministic,
                                                       **drop)
            assert not any(bool(cupy.isnan(g).any()) for g in grads)


def _hopper_backward(dtype, head_dims) -> None:
    """sm_90 only: the Hopper backward (flash_bwd_sm90.cu: TMA, mbarriers, wgmma, stmatrix, the
    dQ reductions) switched on for this section: partial query and key blocks, seqlen_q !=
    seqlen_k both ways, GQA and MQA, causal, a window, softcap + ALiBi, unbatched, packed qkv."""
    if cupy.cuda.Device().compute_capability != "90":
        return
    saved = _dispatch.HOPPER_BACKWARD
    _dispatch.HOPPER_BACKWARD = True
    api._backward_plans.plans.clear()
    try:
        slopes = cupy.linspace(0.05, 0.5, 8, dtype=cupy.float32).reshape(2, 4)
        for d in head_dims:
            for batch, sq, sk, h, hk in ((1, 77, 45, 2, 1), (2, 45, 200, 4, 2),
                                         (1, 130, 130, 3, 3)):
                q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, d, dtype, seed=d + sk)
                dout = testing.random_qkv(cupy, batch, sq, sq, h, h, d, dtype, seed=d + 2)[0]
                for options in ({}, {"causal": True}, {"window_size": (17, 3)},
                                {"causal": True, "softcap": 3.0,
                                 "alibi_slopes": slopes[:batch, :h].copy()}):
                    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
                    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, **options)
                    assert kernels[1].startswith("Hopper backward"), kernels
                    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, **options)
                    assert not any(bool(cupy.isnan(g).any()) for g in grads)
            q, k, v = testing.random_qkv(cupy, None, 99, 99, 4, 4, d, dtype, seed=d + 5)
            out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
            grads = cuflash2.attention_backward(q, q, k, v, out, lse, causal=True)
            assert not any(bool(cupy.isnan(g).any()) for g in grads)
            qkv = cupy.stack([q, k, v], axis=1)[None]  # (1, seqlen, 3, heads, dim)
            out, lse = cuflash2.attention_qkvpacked(qkv, return_lse=True)
            dqkv = cuflash2.attention_qkvpacked_backward(out, qkv, out, lse)
            assert not bool(cupy.isnan(dqkv).any())
    finally:
        _dispatch.HOPPER_BACKWARD = saved
        api._backward_plans.plans.clear()


def _decode(dtype, d) -> None:
    """attention_with_kvcache: contiguous and paged caches (page 16), append, splits, the
    cache read before the previous kernel ends (early_cache_reads); 12 query rows a KV head on
    an m16 tile and one token's 4 on the mma's n side."""
    rng = numpy.random.default_rng(d)
    q = cupy.asarray(rng.standard_normal((2, 3, 8, d)).astype(dtype))
    k_cache = cupy.asarray(rng.standard_normal((2, 96, 2, d)).astype(dtype))
    v_cache = cupy.asarray(rng.standard_normal((2, 96, 2, d)).astype(dtype))
    k_new = cupy.asarray(rng.standard_normal((2, 2, 2, d)).astype(dtype))
    lengths = cupy.asarray(numpy.array([90, 5], numpy.int32))
    for query in (q, q[:, :1].copy()):
        for splits, early in ((1, False), (3, False), (1, True), (3, True), (0, True)):
            out = cuflash2.attention_with_kvcache(query, k_cache, v_cache, k=k_new, v=k_new,
                                                  cache_seqlens=lengths, causal=True,
                                                  num_splits=splits, early_cache_reads=early)
            assert not bool(cupy.isnan(out).any())
    pages = k_cache.reshape(12, 16, 2, d)
    table = cupy.asarray(numpy.arange(12, dtype=numpy.int32).reshape(2, 6)[:, ::-1].copy())
    out = cuflash2.attention_with_kvcache(q, pages, pages.copy(), k=k_new, v=k_new,
                                          cache_seqlens=lengths, block_table=table)
    assert not bool(cupy.isnan(out).any())
    # Unchecked bad values: block ids outside the cache, lengths past the capacity.
    table[0, 2] = 999
    table[1, 0] = -5
    out = cuflash2.attention_with_kvcache(q, pages, pages.copy(), k=k_new, v=k_new,
                                          cache_seqlens=cupy.asarray(numpy.array([10**6, 40],
                                                                                 numpy.int32)),
                                          block_table=table)
    assert not bool(cupy.isnan(out).any())


def _decode_rotary(dtype, d) -> None:
    """attention_with_kvcache with rotary_cos / rotary_sin: q and the new keys copied as they
    are and rotated in shared memory once they landed (GPT-J and NeoX pairs, rotary_dim below
    and at the head dim, q rotated per row (causal) and at one position), splits, the cache
    read before the previous kernel ends, a paged cache, an e4m3 cache (its new keys rotated
    as they are quantised)."""
    rng = numpy.random.default_rng(d + 7)
    q = cupy.asarray(rng.standard_normal((2, 3, 8, d)).astype(dtype))
    k_cache = cupy.asarray(rng.standard_normal((2, 96, 2, d)).astype(dtype))
    v_cache = cupy.asarray(rng.standard_normal((2, 96, 2, d)).astype(dtype))
    k_new = cupy.asarray(rng.standard_normal((2, 3, 2, d)).astype(dtype))
    lengths = cupy.asarray(numpy.array([61, 5], numpy.int32))
    for rotary_dim in (d // 2, d):
        angles = numpy.arange(96)[:, None] * 0.01 * numpy.arange(1, rotary_dim // 2 + 1)
        cos = cupy.asarray(numpy.cos(angles).astype(dtype))
        sin = cupy.asarray(numpy.sin(angles).astype(dtype))
        for interleaved in (True, False):
            for causal, splits, early in ((True, 1, False), (False, 3, True), (True, 0, True)):
                out = cuflash2.attention_with_kvcache(
                    q, k_cache.copy(), v_cache.copy(), k=k_new, v=k_new, cache_seqlens=lengths,
                    causal=causal, num_splits=splits, early_cache_reads=early,
                    rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
                assert not bool(cupy.isnan(out).any())
        pages = k_cache.reshape(12, 16, 2, d).copy()
        table = cupy.asarray(numpy.arange(12, dtype=numpy.int32).reshape(2, 6)[:, ::-1].copy())
        out = cuflash2.attention_with_kvcache(q, pages, pages.copy(), k=k_new, v=k_new,
                                              cache_seqlens=lengths, block_table=table,
                                              rotary_cos=cos, rotary_sin=sin)
        assert not bool(cupy.isnan(out).any())
        bits = cupy.zeros(k_cache.shape, numpy.uint8)
        descale = cupy.ones((2, 2), numpy.float32)
        out = cuflash2.attention_with_kvcache(q, bits, bits.copy(), k=k_new, v=k_new,
                                              cache_seqlens=lengths, kv_cache_dtype="e4m3",
                                              k_descale=descale, v_descale=descale,
                                              rotary_cos=cos, rotary_sin=sin)
        assert not bool(cupy.isnan(out).any())


def _claimed_tiles(dtype) -> None:
    """The persistent grid's work tiles claimed one by one (causal; d=64 on three consumer
    warpgroups, d=128 on two), forced onto short rows (the dispatcher claims from 2048 keys
    on), on the full grid and on 3 CTAs (many claims each), call after call on the stream's
    counters."""
    from grids import switched  # tests/gpu helper (this script's folder)

    forced = {"DYNAMIC_SCHEDULE_KEYS": {d: (0, _dispatch.NO_LIMIT) for d in (64, 128)},
              "THREE_CONSUMER_MIN_KEYS": {(64, False): 0, (64, True): 0}}
    for ctas in (None, 3):
        slots = {} if ctas is None else {"persistent_slots": lambda config, device: ctas}
        with switched(_dispatch, {**forced, **slots}, api._forward_plans):
            for d in (64, 128):
                q, k, v = testing.random_qkv(cupy, 1, 700, 705, 2, 1, d, dtype, seed=d)
                assert "claimed" in cuflash2.forward_kernels(q, k, v, causal=True)[0]
                for _ in range(2):
                    out = cuflash2.attention(q, k, v, causal=True)
                    assert not bool(cupy.isnan(out).any())


def _fp8(head_dims) -> None:
    """The FP8 forward (sm_90; e4m3 bits with per-(batch, KV head) descales): V transposed by
    the producer warpgroup through its raw V ring, on the one-tile grid (d=64, 256, windows), on
    the persistent grid (d=128, short rows: static, and claimed tiles where forced onto short
    causal rows as in _claimed_tiles), with the 224-key tile where forced onto short non-causal
    rows (E4M3_WIDE_TILE_KEYS: the transposed V's last panel of 32-key groups), odd lengths,
    GQA."""
    from fp8_forward_checks import fp8_qkv  # tests/gpu helpers (this script's folder)
    from grids import switched

    modes = {
        "dispatched": {},
        "claims": {"E4M3_DYNAMIC_SCHEDULE_KEYS": {128: (0, _dispatch.NO_LIMIT)}},
        "wide": {"E4M3_WIDE_TILE_KEYS": {d: (block_n, 0) for d, (block_n, _)
                                         in _dispatch.E4M3_WIDE_TILE_KEYS.items()}},
    }
    for mode, forced in modes.items():
        with switched(_dispatch, forced, api._forward_plans):
            for d in head_dims:
                q, k, v, descales = fp8_qkv(cupy, d, 2, 300, 333, 4, 2, d)
                for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (40, 7))):
                    wanted = {"dispatched": True, "claims": causal,
                              "wide": not causal and window == (-1, -1)}[mode]
                    if not wanted:
                        continue
                    out = cuflash2.attention(q, k, v, qkv_dtype="e4m3", causal=causal,
                                             window_size=window, **descales)
                    assert not bool(cupy.isnan(out.astype(numpy.float32)).any())


def _mla_decode(dtype) -> None:
    """The MLA decode kernel (sm_90; latent cache of 576 columns, V its first 512, one KV
    head): contiguous and paged (pages of 64 and 16 positions), one and two query tokens with a
    new row appended in place, odd and empty lengths, one split and several (merged through
    L2 by the cooperative launch); at 128 heads with one split the two row blocks of a token
    as a cluster sharing each tile (TMA multicast)."""
    d, dv, capacity = 576, 512, 384
    rng = numpy.random.default_rng(576)
    lengths = cupy.asarray(numpy.array([301, 63, 0], numpy.int32))
    for seqlen_q, nheads in ((1, 16), (2, 16), (1, 128), (2, 128)):
        q = cupy.asarray(rng.standard_normal((3, seqlen_q, nheads, d)).astype(dtype))
        new = cupy.asarray(rng.standard_normal((3, 1, 1, d)).astype(dtype))
        cache = cupy.asarray(rng.standard_normal((3, capacity, 1, d)).astype(dtype))
        for page_size in (None, 64, 16):
            if page_size is None:
                kv, table = cache.copy(), None
            else:
                kv = cache.reshape(3 * capacity // page_size, page_size, 1, d).copy()
                table = cupy.arange(3 * capacity // page_size, dtype=cupy.int32).reshape(3, -1)
            for splits in (1, 3):
                out = cuflash2.attention_with_kvcache(
                    q, kv, kv[..., :dv], k=new, v=new[..., :dv], cache_seqlens=lengths,
                    block_table=table, causal=seqlen_q > 1, num_splits=splits)
                assert not bool(cupy.isnan(out).any())


def _float32_backward(dout, q, k, v, out, lse, precision, deterministic=(False,), varlen=(),
                      **options) -> None:
    """Float32 inputs' backward (warp_gemm_f32.cuh: 32-bit loads of P, dS, dO, Q and K, 8- and
    4-byte stores of P and dS, fp32 dK / dV staging; the deterministic dQ kernel's), skipped
    where no tile fits this GPU (NotImplementedError: above d=192, or d=128 deterministic, on
    the 100 KiB parts)."""
    backward = cuflash2.attention_varlen_backward if varlen else cuflash2.attention_backward
    for mode in deterministic:
        try:
            grads = backward(dout, q, k, v, out, lse, *varlen, precision=precision,
                             deterministic=mode, **options)
        except NotImplementedError:
            continue
        assert not any(bool(cupy.isnan(g).any()) for g in grads)


def _float32(head_dims) -> None:
    """Float32 inputs' forward (tf32_primitives.cuh: 32-bit loads of V, 8-byte output stores)
    and backward (_float32_backward) at both precisions: partial tiles, seqlen_q != seqlen_k
    both ways, GQA, causal, a window, softcap + ALiBi + sinks, varlen."""
    slopes = cupy.linspace(0.05, 0.5, 4, dtype=cupy.float32)
    sinks = cupy.linspace(-1.0, 1.0, 4, dtype=cupy.float32)
    for d in head_dims:
        for precision in ("highest", "tf32"):
            for batch, sq, sk, h, hk in ((1, 77, 45, 2, 1), (2, 45, 200, 4, 2)):
                q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, d, numpy.float32,
                                             seed=d + sq)
                dout = testing.random_qkv(cupy, batch, sq, sq, h, h, d, numpy.float32,
                                          seed=d + 1)[0]
                for options in ({}, {"causal": True}, {"window_size": (17, 3)},
                                {"causal": True, "softcap": 3.0, "alibi_slopes": slopes[:h],
                                 "sinks": sinks[:h]}):
                    out, lse = cuflash2.attention(q, k, v, precision=precision, return_lse=True,
                                                  **options)
                    assert not bool(cupy.isnan(out).any())
                    _float32_backward(dout, q, k, v, out, lse, precision,
                                      (False, True) if options == {"causal": True} else (False,),
                                      **options)
            lengths = (45, 0, 131, 1)
            cu = cupy.asarray(numpy.cumsum((0,) + lengths).astype(numpy.int32))
            q, k, v = testing.random_qkv(cupy, None, sum(lengths), sum(lengths), 4, 2, d,
                                         numpy.float32, seed=d)
            out, lse = cuflash2.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths),
                                                 causal=True, precision=precision,
                                                 return_lse=True)
            assert not bool(cupy.isnan(out).any())
            dout = testing.random_qkv(cupy, None, sum(lengths), sum(lengths), 4, 4, d,
                                      numpy.float32, seed=d + 1)[0]
            _float32_backward(dout, q, k, v, out, lse, precision, (False, True),
                              (cu, cu, max(lengths), max(lengths)), causal=True)


def main(quick: bool) -> None:
    head_dims = (64, 128) if quick else (32, 40, 64, 96, 128, 160, 192, 224, 256)
    dtypes = (numpy.float16,) if quick else (numpy.float16, ml_dtypes.bfloat16)
    # On sm_90, d <= 64 with more than 256 keys runs on the Hopper kernel, as every larger head
    # dim does (_dispatch.hopper_forward_config); the 600-key shape leaves the persistent grid at d=96
    # and runs d <= 64 without a window on three consumer warpgroups (192-row tiles).
    shapes = ((1, 77, 45, 2, 1), (2, 45, 77, 4, 2), (1, 150, 600, 2, 1)) if quick else (
        (1, 77, 45, 2, 1), (2, 45, 77, 4, 2), (1, 130, 130, 3, 3), (1, 1, 200, 2, 1),
        (1, 150, 600, 2, 1))
    for dtype in dtypes:
        for d in head_dims:
            for batch, sq, sk, h, hk in shapes:
                q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, d, dtype, seed=d + sq)
                dout = testing.random_qkv(cupy, batch, sq, sq, h, h, d, dtype, seed=d + 1)[0]
                for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (17, 3))):
                    out, lse = cuflash2.attention(q, k, v, causal=causal, window_size=window,
                                                  return_lse=True)
                    assert not bool(cupy.isnan(out).any())
                    for deterministic in (False, True):
                        grads = cuflash2.attention_backward(dout, q, k, v, out, lse,
                                                            causal=causal, window_size=window,
                                                            deterministic=deterministic)
                        assert not any(bool(cupy.isnan(g).any()) for g in grads)
            if d in (32, 64, 128, 256):
                _features(dtype, d)
                _decode(dtype, d)
                _decode_rotary(dtype, d)
        _hopper_backward(dtype, (64, 128) if quick else (40, 64, 96, 128))
        if api.device_arch(cupy.cuda.Device().id) == 90:
            _claimed_tiles(dtype)
    if api.device_arch(cupy.cuda.Device().id) == 90:
        _fp8((64, 128, 256))
        _mla_decode(numpy.float16)
    _float32((64, 128) if quick else (32, 64, 96, 128, 192, 256))
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitizer workload done")


#: Sections that `--only NAME ...` runs alone (sm_90 kernels), for a sanitizer pass over them.
SECTIONS = {"fp8": lambda: _fp8((64, 128, 256)),
            "mla_decode": lambda: _mla_decode(numpy.float16),
            "decode_rotary": lambda: [_decode_rotary(t, d) for d in (64, 128, 256)
                                      for t in (numpy.float16, ml_dtypes.bfloat16)]}


if __name__ == "__main__":
    if "--only" in sys.argv:
        for name in sys.argv[sys.argv.index("--only") + 1:]:
            SECTIONS[name]()
        cupy.cuda.runtime.deviceSynchronize()
        print("sanitizer workload done")
    else:
        main("--quick" in sys.argv)
