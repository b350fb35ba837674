"""Rotary in the append and cache_leftpad of attention_with_kvcache (issue 47), without a GPU:
reference.apply_rotary against an independent NumPy formula (complex rotation) in both styles;
the reference's append with rotary (rotated rows, only the new ones), q's positions (causal,
window, neither), cache_leftpad (keys before the pad unseen, positions the cache's); the
argument checks and their messages; the decode plan of such a call (its features, pointers and
fields) on the host stand-in of test_plans_host."""

import ml_dtypes
import numpy
import pytest

from cuflash2 import _configs, reference

from test_plans_host import api_host, device_array, launches  # noqa: F401  (fixtures)

RNG = numpy.random.default_rng(47)
BF16 = numpy.dtype(ml_dtypes.bfloat16)


def randn(*shape, dtype=numpy.float32):
    return RNG.standard_normal(shape).astype(dtype)


def tables(seqlen_ro, rotary_dim, dtype=numpy.float32):
    """cos and sin of a standard RoPE (base 10000), (seqlen_ro, rotary_dim / 2)."""
    inv = 1.0 / 10000 ** (numpy.arange(0, rotary_dim, 2) / rotary_dim)
    angles = numpy.arange(seqlen_ro)[:, None] * inv[None, :]
    return numpy.cos(angles).astype(dtype), numpy.sin(angles).astype(dtype)


def independent_rotary(x, cos, sin, positions, interleaved):
    """RoPE as a complex rotation in float64: each pair (a, b) is a + ib, times e^(i angle)."""
    x = numpy.asarray(x, numpy.float64)
    rotary_dim = 2 * cos.shape[1]
    half = rotary_dim // 2
    turn = (numpy.asarray(cos, numpy.float64) + 1j * numpy.asarray(sin, numpy.float64))
    turn = turn[numpy.asarray(positions)][:, None, :]
    if interleaved:
        z = x[..., 0:rotary_dim:2] + 1j * x[..., 1:rotary_dim:2]
    else:
        z = x[..., :half] + 1j * x[..., half:rotary_dim]
    z = z * turn
    out = x.copy()
    if interleaved:
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    return out


# ---------------------------------------------------------------------------------------------
# reference.apply_rotary


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [16, 32, 64])
def test_apply_rotary_matches_a_complex_rotation(interleaved, rotary_dim):
    x = randn(7, 3, 64)
    cos, sin = tables(100, rotary_dim)
    positions = numpy.array([0, 1, 5, 17, 50, 98, 99])
    got = reference.apply_rotary(x, cos, sin, positions, interleaved=interleaved)
    want = independent_rotary(x, cos, sin, positions, interleaved)
    assert got.dtype == numpy.float32
    numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    numpy.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])  # kept
    # A rotation keeps each pair's norm; position 0 (angle 0) is the identity.
    numpy.testing.assert_array_equal(got[0], x[0])


@pytest.mark.parametrize("dtype", [numpy.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_rounds_the_float32_result_to_the_input_dtype(dtype, interleaved):
    """16-bit inputs: computed in float32 (each product and sum rounded, as the kernel does it
    without fused multiply-adds), then rounded once to the input's dtype."""
    x = randn(5, 2, 32, dtype=dtype)
    cos, sin = tables(64, 32, dtype)
    positions = numpy.array([3, 9, 20, 40, 63])
    got = reference.apply_rotary(x, cos, sin, positions, interleaved=interleaved)
    assert got.dtype == numpy.dtype(dtype)
    f = x.astype(numpy.float32)
    c = cos.astype(numpy.float32)[positions][:, None, :]
    s = sin.astype(numpy.float32)[positions][:, None, :]
    a, b = (f[..., 0::2], f[..., 1::2]) if interleaved else (f[..., :16], f[..., 16:])
    first, second = (a * c - b * s).astype(dtype), (b * c + a * s).astype(dtype)
    if interleaved:
        numpy.testing.assert_array_equal(got[..., 0::2], first)
        numpy.testing.assert_array_equal(got[..., 1::2], second)
    else:
        numpy.testing.assert_array_equal(got[..., :16], first)
        numpy.testing.assert_array_equal(got[..., 16:], second)
    want = independent_rotary(x, cos, sin, positions, interleaved)
    numpy.testing.assert_allclose(got.astype(numpy.float64), want, rtol=2e-2, atol=2e-2)


def test_apply_rotary_refuses_positions_outside_the_table():
    cos, sin = tables(8, 16)
    with pytest.raises(ValueError, match=r"positions must be within \[0, 8\)"):
        reference.apply_rotary(randn(2, 1, 16), cos, sin, numpy.array([0, 8]))


# ---------------------------------------------------------------------------------------------
# The reference's append and attention with rotary and cache_leftpad


def _case(batch=3, capacity=64, seqlen_q=3, seqlen_new=3, h=4, hk=2, d=32, rotary_dim=16):
    q = randn(batch, seqlen_q, h, d)
    k_cache, v_cache = randn(batch, capacity, hk, d), randn(batch, capacity, hk, d)
    k, v = randn(batch, seqlen_new, hk, d), randn(batch, seqlen_new, hk, d)
    cos, sin = tables(capacity, rotary_dim)
    return q, k_cache, v_cache, k, v, cos, sin


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_the_append_writes_the_new_keys_rotated_and_nothing_else(interleaved):
    q, k_cache, v_cache, k, v, cos, sin = _case()
    before_k, before_v = k_cache.copy(), v_cache.copy()
    cached = numpy.array([10, 0, 50], numpy.int32)
    reference.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cached,
                                     rotary_cos=cos, rotary_sin=sin,
                                     rotary_interleaved=interleaved)
    for b in range(3):
        new = slice(cached[b], cached[b] + 3)
        want = independent_rotary(k[b], cos, sin, numpy.arange(cached[b], cached[b] + 3),
                                  interleaved)
        numpy.testing.assert_allclose(k_cache[b, new], want, rtol=1e-5, atol=1e-5)
        numpy.testing.assert_array_equal(v_cache[b, new], v[b])  # V is never rotated
        before_k[b, new], before_v[b, new] = k_cache[b, new], v[b]
    numpy.testing.assert_array_equal(k_cache, before_k)  # every other row as it was
    numpy.testing.assert_array_equal(v_cache, before_v)


@pytest.mark.parametrize("causal,window,per_row", [
    (False, (-1, -1), False), (True, (-1, -1), True), (False, (8, 0), True),
    (False, (100, 100), False)], ids=["full", "causal", "window", "window-past-capacity"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_q_is_rotated_at_its_rows_positions_when_causal_or_windowed(causal, window, per_row,
                                                                    interleaved):
    """flash-attn's rule: q's row i at cache_seqlens[b] + i if causal or local (a window edge
    within the capacity), else every row at cache_seqlens[b]. The attention is then the plain
    one of the rotated q over the cache (which holds the rotated new keys)."""
    q, k_cache, v_cache, k, v, cos, sin = _case()
    cached = numpy.array([10, 0, 50], numpy.int32)
    options = dict(causal=causal, window_size=window)
    out, lse = reference.attention_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cached, rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=interleaved, return_lse=True, **options)
    for b in range(3):
        positions = cached[b] + (numpy.arange(3) if per_row else numpy.zeros(3, int))
        q_b = independent_rotary(q[b], cos, sin, positions, interleaved).astype(numpy.float32)
        n = cached[b] + 3
        want, want_lse = reference.attention(q_b, k_cache[b, :n], v_cache[b, :n],
                                             return_lse=True, **options)
        numpy.testing.assert_allclose(out[b], want, rtol=1e-4, atol=1e-4)
        numpy.testing.assert_allclose(lse[b], want_lse, rtol=1e-4, atol=1e-4)


def test_rotary_scores_depend_on_relative_positions_only():
    """RoPE's point: a key and a query moved by the same offset keep their score. One cached
    key and q at position p, then both shifted: the same output and lse (float64 tables)."""
    d = 32
    cos, sin = tables(256, d, numpy.float64)
    q, key, value = randn(1, 1, 1, d), randn(1, 1, 1, d), randn(1, 1, 1, d)
    results = []
    for shift in (0, 37, 120):
        k_cache = numpy.zeros((1, 256, 1, d), numpy.float64)
        v_cache = numpy.zeros((1, 256, 1, d), numpy.float64)
        out, lse = reference.attention_with_kvcache(
            q.astype(numpy.float64), k_cache, v_cache, k=key.astype(numpy.float64),
            v=value.astype(numpy.float64), cache_seqlens=numpy.array([shift], numpy.int32),
            cache_leftpad=numpy.array([shift], numpy.int32), rotary_cos=cos, rotary_sin=sin,
            causal=True, return_lse=True)
        results.append((out, lse))
    for out, lse in results[1:]:
        numpy.testing.assert_allclose(out, results[0][0], rtol=1e-5, atol=1e-6)
        numpy.testing.assert_allclose(lse, results[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))],
                         ids=["full", "causal", "window"])
def test_cache_leftpad_hides_the_keys_before_it(causal, window):
    """Keys before cache_leftpad[b] are not attended (changing them changes nothing); the
    sequence is the cache's positions [pad, end), whose attention is the plain one over that
    slice (flash-attn's shifted sequence: causal and window alignment unchanged)."""
    q, k_cache, v_cache, k, v, _, _ = _case()
    cached = numpy.array([10, 4, 50], numpy.int32)
    pads = numpy.array([3, 4, 20], numpy.int32)  # the second: only the new tokens remain
    options = dict(causal=causal, window_size=window)
    kwargs = dict(k=k, v=v, cache_seqlens=cached, cache_leftpad=pads, return_lse=True,
                  **options)
    k1, v1 = k_cache.copy(), v_cache.copy()
    out, lse = reference.attention_with_kvcache(q, k1, v1, **kwargs)
    k2, v2 = k_cache.copy(), v_cache.copy()
    for b in range(3):
        k2[b, :pads[b]], v2[b, :pads[b]] = 1e3, -1e3
    out2, lse2 = reference.attention_with_kvcache(q, k2, v2, **kwargs)
    numpy.testing.assert_array_equal(out, out2)
    numpy.testing.assert_array_equal(lse, lse2)
    for b in range(3):
        end = cached[b] + 3
        want, want_lse = reference.attention(q[b], k1[b, pads[b]:end], v1[b, pads[b]:end],
                                             return_lse=True, **options)
        numpy.testing.assert_allclose(out[b], want, rtol=1e-5, atol=1e-5)
        numpy.testing.assert_allclose(lse[b], want_lse, rtol=1e-5, atol=1e-5)
    # The appends land at cache_seqlens[b] (the pad does not move them).
    for b in range(3):
        numpy.testing.assert_array_equal(k1[b, cached[b]:cached[b] + 3], k[b])


def test_cache_leftpad_keeps_the_rotary_positions_of_the_cache():
    """With cache_leftpad the new keys are still rotated at cache_seqlens[b] + i and q at
    cache_seqlens[b] (+ i): positions count from the cache's start, as flash-attn's do."""
    q, k_cache, v_cache, k, v, cos, sin = _case()
    cached = numpy.array([10, 5, 50], numpy.int32)
    pads = numpy.array([2, 5, 30], numpy.int32)
    out = reference.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cached,
                                           cache_leftpad=pads, rotary_cos=cos, rotary_sin=sin,
                                           causal=True)
    for b in range(3):
        positions = numpy.arange(cached[b], cached[b] + 3)
        numpy.testing.assert_allclose(k_cache[b, cached[b]:cached[b] + 3],
                                      independent_rotary(k[b], cos, sin, positions, True),
                                      rtol=1e-5, atol=1e-5)
        q_b = independent_rotary(q[b], cos, sin, positions, True).astype(numpy.float32)
        want = reference.attention(q_b, k_cache[b, pads[b]:cached[b] + 3],
                                   v_cache[b, pads[b]:cached[b] + 3], causal=True)
        numpy.testing.assert_allclose(out[b], want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Argument checks (the reference and the kernel path share them: cuflash2._validate)


def _call(**kwargs):
    q, k_cache, v_cache, k, v, cos, sin = _case(batch=2, capacity=32, seqlen_q=1, seqlen_new=1,
                                                d=32, rotary_dim=16)
    args = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin)
    args.update(kwargs)
    args = {n: x for n, x in args.items() if x is not None or n in ("k", "v")}
    if args.get("k") is None:
        args.pop("k", None), args.pop("v", None)
    return reference.attention_with_kvcache(q, k_cache, v_cache, **args)


COS16 = tables(32, 16)[0]


@pytest.mark.parametrize("kwargs,error,message", [
    ({"rotary_sin": None}, ValueError, r"rotary_cos and rotary_sin must be given together"),
    ({"k": None}, ValueError, r"rotary_cos / rotary_sin rotate the new keys .* pass k and v"),
    ({"rotary_cos": COS16[:, :4], "rotary_sin": COS16[:, :4]}, ValueError,
     r"rotary_dim \(2 x its 4 columns = 8\) must be a positive multiple of 16"),
    ({"rotary_cos": tables(32, 48)[0], "rotary_sin": tables(32, 48)[1]}, ValueError,
     r"rotary_dim \(2 x its 24 columns = 48\) .* at most the head dim 32"),
    ({"rotary_cos": COS16[:20], "rotary_sin": COS16[:20]}, ValueError,
     r"seqlen_ro \(20 rows\) is less than its capacity \(32\)"),
    ({"rotary_cos": COS16.astype(numpy.float64)}, TypeError,
     r"rotary_cos must have q's dtype float32; got float64"),
    ({"rotary_sin": COS16[:, :4]}, ValueError, r"rotary_sin must have rotary_cos's shape"),
    ({"rotary_cos": COS16[None]}, ValueError, r"rotary_cos must be 2-D"),
    ({"rotary_interleaved": 1}, TypeError, r"rotary_interleaved must be a bool; got 1"),
    ({"cache_leftpad": numpy.zeros(2, numpy.int64)}, TypeError,
     r"cache_leftpad must be an int32 array"),
    ({"cache_leftpad": numpy.zeros(3, numpy.int32)}, ValueError,
     r"cache_leftpad must have shape \(2,\)"),
    ({"cache_leftpad": numpy.array([0, 40], numpy.int32), "cache_seqlens": 20}, ValueError,
     r"cache_leftpad\[1\] = 40 must be within \[0, cache_seqlens\[1\] = 20\]"),
    ({"cache_seqlens": 31, "k": None, "rotary_cos": None, "rotary_sin": None,
      "block_table": numpy.zeros((2, 2), numpy.int32),
      "cache_leftpad": numpy.zeros(2, numpy.int32)}, ValueError,
     r"cache_leftpad does not go with a paged cache \(block_table\)"),
])
def test_rotary_and_leftpad_arguments_are_checked_with_messages_naming_them(kwargs, error,
                                                                          message):
    with pytest.raises(error, match=message):
        _call(**kwargs)


def test_q_positions_past_the_table_are_refused():
    """q's rows at cache_seqlens + i (causal) must have rows of the table: the last new token
    fills the cache, a second query row would sit past it."""
    q, k_cache, v_cache, k, v, cos, sin = _case(batch=1, capacity=32, seqlen_q=3, seqlen_new=1)
    with pytest.raises(ValueError, match=r"q's last row of sequence 0 is at position 33, past "
                                         r"rotary_cos's 32 rows"):
        reference.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=31,
                                         rotary_cos=cos, rotary_sin=sin, causal=True)


# ---------------------------------------------------------------------------------------------
# The decode plan of a rotary / cache_leftpad call (host stand-in: nothing compiled or launched)


def _rotary_arrays(batch=2, capacity=4096, d=128, rotary_dim=64):
    q = device_array((batch, 1, 8, d))
    cache = device_array((batch, capacity, 2, d))
    k = device_array((batch, 1, 2, d))
    cos = device_array((capacity, rotary_dim // 2))
    sin = device_array((capacity, rotary_dim // 2))
    return q, cache, k, cos, sin


def test_a_rotary_call_plans_the_rotary_kernel_with_per_call_pointers(api_host):
    """FEATURE_ROTARY in the kernel's features; cos / sin addresses patched per call (a plan
    hit with other tables), their shape's rotary_dim and seqlen_ro and the style in the struct;
    q's positions per row where causal; a call without rotary keeps the plain kernel."""
    import cuflash2

    q, cache, k, _, _ = _rotary_arrays()
    for _ in range(2):  # planned, then a plan hit with other tables
        _, _, _, cos, sin = _rotary_arrays()
        cos.data.ptr, sin.data.ptr = cos.data.ptr + 0x100, sin.data.ptr + 0x200
        cuflash2.attention_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=4000,
                                        rotary_cos=cos, rotary_sin=sin, causal=True)
        launch, _, record = api_host.launches[-1]
        assert launch.config.features == _configs.FEATURE_ROTARY
        assert record["rotary_cos"] == cos.data.ptr and record["rotary_sin"] == sin.data.ptr
        assert (record["rotary_dim"], record["seqlen_ro"]) == (64, 4096)
        assert (record["rotary_interleaved"], record["rotary_q_per_row"]) == (1, 1)
        assert record["cache_leftpad"] == 0
    cuflash2.attention_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=4000,
                                    rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    record = api_host.launches[-1][2]
    assert (record["rotary_interleaved"], record["rotary_q_per_row"]) == (0, 0)
    cuflash2.attention_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=4000)
    launch, _, record = api_host.launches[-1]
    assert launch.config.features == 0 and record["rotary_cos"] == 0
    assert record["rotary_dim"] == 0


def test_a_leftpad_call_plans_the_leftpad_kernel(api_host):
    import cuflash2

    q, cache, k, cos, sin = _rotary_arrays()
    pads = device_array((2,), numpy.int32)
    cuflash2.attention_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=4000,
                                    cache_leftpad=pads, rotary_cos=cos, rotary_sin=sin)
    launch, _, record = api_host.launches[-1]
    assert launch.config.features == _configs.FEATURE_ROTARY | _configs.FEATURE_LEFTPAD
    assert record["cache_leftpad"] == pads.data.ptr
    assert launch.config.features in _configs.DECODE_FEATURES


def test_the_kernel_path_checks_before_any_launch(api_host):
    import cuflash2

    q, cache, k, cos, sin = _rotary_arrays()
    checks = [
        (dict(rotary_cos=cos), ValueError, r"rotary_cos and rotary_sin must be given together"),
        (dict(rotary_cos=cos, rotary_sin=sin, k=None, v=None), ValueError, r"pass k and v"),
        (dict(rotary_cos=device_array((4096, 32), numpy.float32), rotary_sin=sin), TypeError,
         r"rotary_cos must have q's dtype float16"),
        (dict(rotary_cos=device_array((1000, 32)), rotary_sin=device_array((1000, 32))),
         ValueError, r"seqlen_ro \(1000 rows\) is less than its capacity \(4096\)"),
        (dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved="yes"), TypeError,
         r"rotary_interleaved must be a bool"),
        (dict(rotary_cos=device_array((4096, 64))[:, :32], rotary_sin=sin), ValueError,
         r"rotary_cos must be C-contiguous"),
        (dict(cache_leftpad=device_array((4,), numpy.int32)[::2]), ValueError,
         r"cache_leftpad must be contiguous"),
        (dict(cache_leftpad=device_array((2,), numpy.int32),
              block_table=device_array((2, 16), numpy.int32)), ValueError,
         r"cache_leftpad does not go with a paged cache"),
    ]
    for kwargs, error, message in checks:
        arguments = dict(k=k, v=k, cache_seqlens=4000)
        arguments.update(kwargs)
        if "block_table" in arguments:
            arguments.update(k=None, v=None, cache_seqlens=None)
            arguments["k_cache"] = arguments["v_cache"] = device_array((64, 256, 2, 128))
        count = len(api_host.launches)
        with pytest.raises(error, match=message):
            cuflash2.attention_with_kvcache(q, arguments.pop("k_cache", cache),
                                            arguments.pop("v_cache", cache), **arguments)
        assert len(api_host.launches) == count
