"""The FP8 e4m3 KV cache without a GPU: cuflash2.fp8's conversions against ml_dtypes, the
kernel's bit-level e4m3 -> 16-bit decoding (cuda_src/fp8_convert.cuh) replayed in NumPy, the
reference with an e4m3 cache (append quantised in place, attention on the dequantised values,
paged == contiguous, descale shapes), the argument checks and their messages, and the decode
plan of an FP8 call (kernel, descale pointers and strides) on the host stand-in of
test_plans_host."""

import re

import ml_dtypes
import numpy
import pytest

from cuflash2 import _compile, _configs, fp8, reference

from test_plans_host import api_host, device_array, launches  # noqa: F401  (fixtures)

RNG = numpy.random.default_rng(45)
E4M3FN = ml_dtypes.float8_e4m3fn


def ml_dtypes_e4m3(x):
    """ml_dtypes' e4m3 bits of float32 x, saturated (its cast maps overflow to NaN)."""
    return numpy.clip(numpy.asarray(x, numpy.float32), -448, 448).astype(E4M3FN).view(numpy.uint8)


def test_the_value_table_is_ml_dtypes():
    every = numpy.arange(256, dtype=numpy.uint8)
    numpy.testing.assert_array_equal(fp8.E4M3_VALUES, every.view(E4M3FN).astype(numpy.float32))
    assert numpy.isnan(fp8.E4M3_VALUES[[0x7F, 0xFF]]).all()
    assert numpy.isnan(fp8.E4M3_VALUES).sum() == 2
    assert fp8.E4M3_VALUES[0x7E] == fp8.E4M3_MAX == _configs.E4M3_MAX == 448
    numpy.testing.assert_array_equal(fp8.e4m3_to_float(every.view(E4M3FN)), fp8.E4M3_VALUES)


@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16])
def test_every_16_bit_value_quantises_as_ml_dtypes(dtype):
    """Every finite 16-bit value (q's types: new tokens), and every one divided by a descale,
    rounds to ml_dtypes' e4m3 (nearest, ties to even, saturated); infinities saturate, NaN
    stays NaN."""
    values = numpy.arange(2 ** 16, dtype=numpy.uint16).view(dtype).astype(numpy.float32)
    finite = values[numpy.isfinite(values)]
    for descale in (1.0, 0.0123, 3.7e-3, 17.0):
        with numpy.errstate(over="ignore"):  # (bf16's largest over 3.7e-3: infinite)
            x = finite / numpy.float32(descale)
        numpy.testing.assert_array_equal(fp8.float_to_e4m3(x), ml_dtypes_e4m3(x))
    special = fp8.float_to_e4m3(numpy.array([numpy.inf, -numpy.inf, numpy.nan, -0.0],
                                            numpy.float32))
    assert list(special[:2]) == [0x7E, 0xFE] and special[2] & 0x7F == 0x7F
    assert special[3] == 0x80


def test_float32_quantisation_ties_subnormals_and_round_trip():
    # Every e4m3 value comes back as its bits; the midpoints between neighbours round to the
    # even one; the subnormal range and float32 subnormals too.
    finite = numpy.flatnonzero(~numpy.isnan(fp8.E4M3_VALUES)).astype(numpy.uint8)
    numpy.testing.assert_array_equal(fp8.float_to_e4m3(fp8.E4M3_VALUES[finite]), finite)
    positive = numpy.sort(fp8.E4M3_VALUES[:0x7F])
    midpoints = ((positive[:-1].astype(numpy.float64) + positive[1:]) / 2).astype(numpy.float32)
    numpy.testing.assert_array_equal(fp8.float_to_e4m3(midpoints), ml_dtypes_e4m3(midpoints))
    x = numpy.concatenate([RNG.standard_normal(200_000) * 10.0 ** RNG.integers(-8, 3, 200_000),
                           numpy.array([2 ** -10, 3 * 2 ** -11, 1e-40, 464.0, 463.99, 480.0])])
    x = x.astype(numpy.float32)
    numpy.testing.assert_array_equal(fp8.float_to_e4m3(x), ml_dtypes_e4m3(x))
    numpy.testing.assert_array_equal(fp8.float_to_e4m3(-x), ml_dtypes_e4m3(-x))


def _header_constant(pattern):
    source = (_compile.cuda_src_dir() / "fp8_convert.cuh").read_text()
    return int(re.search(pattern, source).group(1), 16)


@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16])
def test_the_kernels_bitwise_decoding_is_exact(dtype):
    """fp8_convert.cuh's e4m3_pair_to_16bit, replayed: the byte in the high half of a 16-bit
    word, sign kept, exponent-and-mantissa shifted right by 1 (f16) or 4 (bf16), times the
    header's 2^8 / 2^120 constant, NaN patterns set to NaN: every byte gives ml_dtypes' value."""
    bf16 = dtype is ml_dtypes.bfloat16
    factor = _header_constant(r"TWO_POW_120_BF16X2 = (0x[0-9a-f]+)u" if bf16
                              else r"TWO_POW_8_F16X2 = (0x[0-9a-f]+)u")
    factor = numpy.array([factor & 0xFFFF], numpy.uint16).view(dtype).astype(numpy.float64)[0]
    assert factor == (2.0 ** 120 if bf16 else 2.0 ** 8)
    shift = 4 if bf16 else 1
    every = numpy.arange(256, dtype=numpy.uint32)
    spread = every << 8
    scaled = ((spread & 0x8000) | ((spread >> shift) & (0x7F00 >> shift))).astype(numpy.uint16)
    value = (scaled.view(dtype).astype(numpy.float64) * factor).astype(dtype)
    bits = value.view(numpy.uint16).copy()
    bits[(every & 0x7F) == 0x7F] |= 0x7FFF
    want = every.astype(numpy.uint8).view(E4M3FN).astype(dtype)
    numpy.testing.assert_array_equal(bits.view(dtype), want)  # (NaN == NaN positions here)


def test_bf16_query_rows_rescaled_into_f16_exactly():
    """kv_cache_e4m3.cuh's q_fragments_bf16_to_f16, replayed: each row times 2^(14 - E) (its
    largest magnitude in [2^E, 2^(E + 1)), E clamped from below) lands in [2^14, 2^15), within
    f16's range, and every element down to 2^-28 of the row's largest is exact in f16, the rest
    within 2^-39 of it; the factor's inverse is exact. Rows of bf16's extremes, zeros, and an
    infinity, which stays infinite."""
    source = (_compile.cuda_src_dir() / "kv_cache_e4m3.cuh").read_text()
    body = source[source.index("q_fragments_bf16_to_f16(u32"):]
    clamp = int(re.search(r"__float_as_uint\(largest\) >> 23\), (\d+)\)", body).group(1))
    bias = int(re.search(r"static_cast<u32>\((\d+) - exponent\) << 23", body).group(1))
    assert (clamp, bias) == (14, 268)
    bf16 = ml_dtypes.bfloat16
    rows = [RNG.standard_normal(128) * 10.0 ** e for e in (-35, -8, 0, 4, 30, 38)]
    rows += [numpy.zeros(128), numpy.r_[numpy.zeros(127), 3e38],
             numpy.r_[RNG.standard_normal(127), numpy.inf]]
    for row in rows:
        x = row.astype(bf16).astype(numpy.float32)
        largest = numpy.abs(x).max()
        exponent = max(int(numpy.float32(largest).view(numpy.uint32) >> 23), clamp)
        scale = numpy.uint32((bias - exponent) << 23).view(numpy.float32)
        scaled = x * scale  # a power of two: exact in float32
        f16 = scaled.astype(numpy.float16)
        finite = numpy.isfinite(x)
        if numpy.isfinite(largest) and largest > 0:
            top = abs(scaled).max()
            if exponent > clamp:
                assert 2.0 ** 14 <= top < 2.0 ** 15
            else:  # a row below 2^-113: times 2^127, still below 2^14
                assert top < 2.0 ** 14
            # f16's normals (from 2^-14, 2^-28 of the top or less) exact, its subnormals within
            # half their step, 2^-25 (2^-39 of the top or less)
            normal = numpy.abs(scaled) >= 2.0 ** -14
            assert numpy.array_equal(f16[normal].astype(numpy.float32), scaled[normal])
            assert numpy.all(numpy.abs(f16[~normal].astype(numpy.float64) - scaled[~normal])
                             <= 2.0 ** -25)
        assert numpy.all(numpy.isinf(f16[~finite]))
        assert numpy.all(numpy.isfinite(f16[finite]))
        assert numpy.float32(1) / scale * scale == 1  # the inverse is exact


def test_quantize_and_dequantize_round_trip_within_half_an_e4m3_step():
    x = RNG.standard_normal((4, 3, 2, 16)).astype(numpy.float32)
    descale = (numpy.abs(x).max(axis=(0, 1, 3)) / 448).astype(numpy.float32)[:, None]
    bits = fp8.quantize_e4m3(x, descale)
    assert bits.dtype == numpy.uint8
    back = fp8.dequantize_e4m3(bits, descale, numpy.float64)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normals.
    assert numpy.all(numpy.abs(back - x) <= numpy.abs(x) * 2 ** -4 + descale * 2 ** -10)


# ---------------------------------------------------------------------------------------------
# The reference with an e4m3 cache


def _fp8_cache(batch, capacity, hk, d, descale):
    values = RNG.standard_normal((batch, capacity, hk, d)).astype(numpy.float32)
    return fp8.quantize_e4m3(values, descale)


@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("descale_shape", ["per_head", "per_tensor", "scalar", "float", "none"])
def test_reference_appends_quantised_and_attends_to_the_dequantised_cache(dtype, descale_shape):
    batch, capacity, h, hk, d, seqlen_new = 3, 64, 8, 2, 32, 3
    per_head = (RNG.uniform(0.002, 0.02, (batch, hk))).astype(numpy.float32)
    kd, vd = {"per_head": (per_head, per_head * 2),
              "per_tensor": (numpy.full((1,), 0.01, numpy.float32),) * 2,
              "scalar": (numpy.array(0.01, numpy.float32),) * 2,
              "float": (0.01, 0.02), "none": (None, None)}[descale_shape]
    k_factors = fp8.descale_values("k_descale", kd, batch, hk, numpy)
    v_factors = fp8.descale_values("v_descale", vd, batch, hk, numpy)
    k_cache = _fp8_cache(batch, capacity, hk, d, k_factors[:, None, :, None].astype(numpy.float32))
    v_cache = _fp8_cache(batch, capacity, hk, d, v_factors[:, None, :, None].astype(numpy.float32))
    before_k, before_v = k_cache.copy(), v_cache.copy()
    q = RNG.standard_normal((batch, 2, h, d)).astype(dtype)
    k_new = (RNG.standard_normal((batch, seqlen_new, hk, d)) * 2).astype(dtype)
    v_new = RNG.standard_normal((batch, seqlen_new, hk, d)).astype(dtype)
    cached = numpy.array([10, 0, 61], numpy.int32)
    out, lse = reference.attention_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cached, causal=True,
        kv_cache_dtype="e4m3", k_descale=kd, v_descale=vd, return_lse=True)
    # The append wrote exactly the new rows, quantised by their sequence's and head's factors.
    for b in range(batch):
        new = slice(cached[b], cached[b] + seqlen_new)
        want_k = ml_dtypes_e4m3(k_new[b].astype(numpy.float32)
                                / k_factors[b][:, None].astype(numpy.float32))
        want_v = ml_dtypes_e4m3(v_new[b].astype(numpy.float32)
                                / v_factors[b][:, None].astype(numpy.float32))
        numpy.testing.assert_array_equal(k_cache[b, new], want_k)
        numpy.testing.assert_array_equal(v_cache[b, new], want_v)
        before_k[b, new], before_v[b, new] = want_k, want_v
    numpy.testing.assert_array_equal(k_cache, before_k)
    numpy.testing.assert_array_equal(v_cache, before_v)
    # The attention is that of the dequantised cache.
    k_values = fp8.dequantize_e4m3(k_cache, k_factors[:, None, :, None], numpy.float64)
    v_values = fp8.dequantize_e4m3(v_cache, v_factors[:, None, :, None], numpy.float64)
    want, want_lse = reference.attention_with_kvcache(
        q.astype(numpy.float64), k_values, v_values, cache_seqlens=cached + seqlen_new,
        causal=True, return_lse=True)
    numpy.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_reference_fp8_paged_equals_contiguous_and_takes_float8_arrays():
    batch, capacity, page, h, hk, d = 2, 128, 32, 4, 1, 16
    q = RNG.standard_normal((batch, 1, h, d)).astype(numpy.float16)
    k_cache = _fp8_cache(batch, capacity, hk, d, 0.01)
    v_cache = _fp8_cache(batch, capacity, hk, d, 0.01)
    k_new = RNG.standard_normal((batch, 1, hk, d)).astype(numpy.float16)
    per_seq = capacity // page
    order = RNG.permutation(batch * per_seq + 1)[: batch * per_seq].reshape(batch, per_seq)
    k_paged = numpy.zeros((batch * per_seq + 1, page, hk, d), numpy.uint8)
    v_paged = numpy.zeros_like(k_paged)
    for b in range(batch):
        k_paged[order[b]] = k_cache[b].reshape(per_seq, page, hk, d)
        v_paged[order[b]] = v_cache[b].reshape(per_seq, page, hk, d)
    lengths = numpy.array([37, 100], numpy.int32)
    options = dict(k=k_new, v=k_new, cache_seqlens=lengths, k_descale=0.01, v_descale=0.01)
    want = reference.attention_with_kvcache(q, k_cache, v_cache, kv_cache_dtype="e4m3",
                                            **options)
    got = reference.attention_with_kvcache(q, k_paged, v_paged, block_table=order.astype(
        numpy.int32), kv_cache_dtype="e4m3", **options)
    numpy.testing.assert_array_equal(got, want)
    # ml_dtypes' float8 arrays are e4m3 caches without the argument, appended in place as bits.
    k8, v8 = k_cache.view(E4M3FN), v_cache.view(E4M3FN)
    again = reference.attention_with_kvcache(q, k8, v8, **options)
    numpy.testing.assert_array_equal(again, want)


# ---------------------------------------------------------------------------------------------
# Argument checks (the reference and the kernel path share them: fp8.cache_format)


def _call(q=None, k_cache=None, v_cache=None, **kwargs):
    q = numpy.zeros((2, 1, 4, 64), numpy.float16) if q is None else q
    k_cache = numpy.zeros((2, 32, 2, 64), numpy.uint8) if k_cache is None else k_cache
    v_cache = k_cache if v_cache is None else v_cache
    return reference.attention_with_kvcache(q, k_cache, v_cache, **kwargs)


@pytest.mark.parametrize("kwargs,error,message", [
    ({}, TypeError, r"uint8: pass kv_cache_dtype='e4m3'"),
    ({"kv_cache_dtype": "e5m2"}, ValueError, r"kv_cache_dtype must be None .* \['e4m3'\]"),
    ({"kv_cache_dtype": "e4m3", "k_cache": numpy.zeros((2, 32, 2, 64), numpy.float16)},
     TypeError, r"kv_cache_dtype='e4m3' needs k_cache and v_cache of uint8"),
    ({"k_descale": numpy.ones(1, numpy.float32), "k_cache": numpy.zeros((2, 32, 2, 64),
                                                                        numpy.float16)},
     ValueError, r"k_descale is for an FP8 cache"),
    ({"kv_cache_dtype": "e4m3", "v_cache": numpy.zeros((2, 32, 2, 64), numpy.float16)},
     TypeError, r"k_cache and v_cache must have the same dtype"),
    ({"kv_cache_dtype": "e4m3", "q": numpy.zeros((2, 1, 4, 64), numpy.float32)},
     TypeError, r"an e4m3 cache takes a 16-bit q"),
    ({"kv_cache_dtype": "e4m3", "k": numpy.zeros((2, 1, 2, 64), numpy.uint8),
      "v": numpy.zeros((2, 1, 2, 64), numpy.uint8)},
     TypeError, r"k and v \(the new tokens\) must have q's dtype float16"),
    ({"kv_cache_dtype": "e4m3", "q": numpy.zeros((2, 1, 4, 72), numpy.float16),
      "k_cache": numpy.zeros((2, 32, 2, 72), numpy.uint8)},
     ValueError, r"head dim must be a multiple of 16 .* k_cache's 72"),
    ({"kv_cache_dtype": "e4m3", "k_cache": numpy.zeros((2, 32, 2, 72), numpy.uint8)[..., :64]},
     ValueError, r"k_cache stride of dim 2 must be a multiple of 16 bytes"),
    ({"kv_cache_dtype": "e4m3", "k_descale": numpy.ones((2, 3), numpy.float32)},
     ValueError, r"k_descale must be a float32 array of shape \(batch, nheads_kv\) = \(2, 2\)"),
    ({"kv_cache_dtype": "e4m3", "v_descale": numpy.ones((2, 2), numpy.float64)},
     ValueError, r"v_descale must be a float32 array .* got float64 \(2, 2\)"),
    ({"kv_cache_dtype": "e4m3", "k_descale": numpy.array([0.0], numpy.float32)},
     ValueError, r"k_descale must hold positive finite factors; got 0.0"),
])
def test_fp8_arguments_are_checked_with_messages_naming_them(kwargs, error, message):
    with pytest.raises(error, match=message):
        _call(**kwargs)


def test_an_fp8_decode_call_plans_the_e4m3_kernel_with_its_descale_pointers(api_host,
                                                                             monkeypatch):
    """attention_with_kvcache(kv_cache_dtype="e4m3"): the decode kernel's e4m3 specialisation
    (decode_config's, or on sm_90 the clustered one); the descales' pointers patched per call
    with their (batch, KV head) strides in elements (0 where shared; the device's 1,
    fp8.unit_descale, where none is given); and the same checks as the reference before
    anything launches."""
    import cuflash2

    cupy = api_host.cupy
    ones = device_array((1,), numpy.float32)
    cupy.ones = lambda shape, dtype: ones
    monkeypatch.setattr(fp8, "_unit_descales", {})
    cupy.float32 = numpy.float32
    q = device_array((2, 1, 8, 128))
    cache = device_array((2, 4096, 2, 128), numpy.uint8)
    k_descale = device_array((2, 2), numpy.float32)
    v_descale = device_array((1,), numpy.float32)
    for _ in range(2):  # planned, then a plan hit
        cuflash2.attention_with_kvcache(q, cache, cache, cache_seqlens=4000,
                                        kv_cache_dtype="e4m3", k_descale=k_descale,
                                        v_descale=v_descale)
        launch, _, record = api_host.launches[-1]
        assert launch.config.kv_cache_dtype == "e4m3"
        assert launch.config.name_expression.endswith(f", {_configs.KV_CACHE_E4M3}>")
        assert record["k_descale"] == k_descale.data.ptr
        assert record["v_descale"] == v_descale.data.ptr
        assert (record["kd_batch_stride"], record["kd_head_stride"]) == (2, 1)
        assert (record["vd_batch_stride"], record["vd_head_stride"]) == (0, 0)
    cuflash2.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, kv_cache_dtype="e4m3")
    record = api_host.launches[-1][2]
    assert record["k_descale"] == record["v_descale"] == ones.data.ptr
    with pytest.raises(TypeError, match=r"uint8: pass kv_cache_dtype='e4m3'"):
        cuflash2.attention_with_kvcache(q, cache, cache, cache_seqlens=4000)
    with pytest.raises(ValueError, match=r"k_descale must be a float32 array"):
        cuflash2.attention_with_kvcache(q, cache, cache, cache_seqlens=4000,
                                        kv_cache_dtype="e4m3",
                                        k_descale=device_array((2, 2), numpy.float16))
    # A 16-bit cache keeps its kernel (no format in its name).
    cuflash2.attention_with_kvcache(q, device_array((2, 4096, 2, 128)),
                                    device_array((2, 4096, 2, 128)), cache_seqlens=4000)
    config = api_host.launches[-1][0].config
    assert config.kv_cache_dtype is None and config.name_expression.endswith(", false, 8>")



def test_a_float_descale_is_for_an_fp8_cache_and_the_reference_only(api_host):
    """The reference takes a Python float as a descale factor, the kernel path a float32 CuPy
    array (one on the device: no host value in the plan)."""
    import cuflash2

    q = device_array((2, 1, 8, 128))
    cache = device_array((2, 4096, 2, 128), numpy.uint8)
    with pytest.raises((TypeError, ValueError), match=r"k_descale must be a cupy\.ndarray"):
        cuflash2.attention_with_kvcache(q, cache, cache, kv_cache_dtype="e4m3", k_descale=0.5)


def test_the_reference_refuses_a_float_descale_with_a_16_bit_cache():
    with pytest.raises(ValueError, match=r"k_descale is for an FP8 cache"):
        _call(k_cache=numpy.zeros((2, 32, 2, 64), numpy.float16), k_descale=0.5)
