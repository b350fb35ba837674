"""FP8 e4m3 values for the KV cache of `attention_with_kvcache(..., kv_cache_dtype="e4m3")`.

How FP8 arrays come in: CuPy (14.2) has no FP8 dtype and refuses ml_dtypes' float8 dtypes, so an
e4m3 cache is a **uint8** array holding e4m3 bits ("e4m3fn": 1 sign, 4 exponent bits of bias 7,
3 mantissa bits, no infinities, NaN = 0x7f / 0xff, largest finite 448), and the call names the
format with ``kv_cache_dtype="e4m3"``: a uint8 cache without it is refused, never reinterpreted.
An array of ``ml_dtypes.float8_e4m3fn`` (NumPy today, CuPy once a version holds it) is taken as
e4m3 too, with or without the argument.

The value of a cache element is ``e4m3 * descale``; new tokens (16-bit, q's dtype) are stored as
``float_to_e4m3(k / k_descale)``: the quotient in float32 (IEEE division), rounded to the nearest
e4m3 value (ties to even), saturated to +-448 (infinities too; NaN stays NaN), as vLLM and
FlashAttention-3 quantise their caches and as the kernels do (cuda_src/fp8_convert.cuh).

`quantize_e4m3` and `dequantize_e4m3` work on NumPy and CuPy arrays alike (a cache can be filled
on the GPU); the conversions are integer and table operations, not ml_dtypes casts, and
tests/test_fp8_cache.py checks them against ml_dtypes.
"""

from __future__ import annotations

import numbers
import sys

import numpy

from ._configs import E4M3_MAX, KV_CACHE_FORMATS

try:
    import ml_dtypes

    FLOAT8_E4M3FN = numpy.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover (ml_dtypes comes with the package)
    FLOAT8_E4M3FN = None
#: The dtypes an array of e4m3 values comes as: uint8 bits, or ml_dtypes' float8_e4m3fn.
E4M3_DTYPES = (numpy.dtype(numpy.uint8),) + ((FLOAT8_E4M3FN,) if FLOAT8_E4M3FN else ())

__all__ = ["E4M3_MAX", "E4M3_VALUES", "dequantize_e4m3", "e4m3_to_float", "float_to_e4m3",
           "quantize_e4m3"]


def _e4m3_table() -> numpy.ndarray:
    bits = numpy.arange(256)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    magnitude = numpy.where(exponent == 0, mantissa * 2.0 ** -9,
                            (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude[(bits & 0x7F) == 0x7F] = numpy.nan
    return numpy.where(bits & 0x80, -magnitude, magnitude).astype(numpy.float32)


#: The value of every e4m3 bit pattern (float32, exact), by its byte.
E4M3_VALUES = _e4m3_table()
E4M3_VALUES.setflags(write=False)


def _module(x):
    """cupy for a CuPy array (CuPy imported already, then), else numpy."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else numpy


def _bits(x, xp):
    """uint8 e4m3 bits of a uint8 or float8_e4m3fn array."""
    x = xp.asarray(x)
    if FLOAT8_E4M3FN is not None and x.dtype == FLOAT8_E4M3FN:
        return x.view(xp.uint8)
    if x.dtype != numpy.uint8:
        raise TypeError(f"e4m3 bits must be a uint8 (or float8_e4m3fn) array; got {x.dtype}")
    return x


def e4m3_to_float(bits):
    """float32 values of e4m3 bits (a uint8 or float8_e4m3fn array; NumPy or CuPy)."""
    xp = _module(bits)
    return xp.asarray(E4M3_VALUES)[_bits(bits, xp).astype(xp.int32)]


def float_to_e4m3(x):
    """uint8 e4m3 bits of float32 `x` (other float dtypes are converted to float32 first):
    nearest, ties to even, saturated to +-E4M3_MAX, NaN kept (NumPy or CuPy)."""
    xp = _module(x)
    x = xp.ascontiguousarray(xp.asarray(x, dtype=numpy.float32))
    bits = x.view(xp.uint32)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal results: 3 mantissa bits kept, ties to even (a carry moves into the exponent),
    # exponent rebiased from 127 to 7. Below 2^-6: multiples of 2^-9 (x * 512 is exact).
    rounded = (((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)) & 0xFF
    small = xp.minimum(magnitude, 0x3C800000).view(xp.float32)  # (the others: not used)
    subnormal = xp.rint(small * 512).astype(xp.uint32)
    out = xp.where(magnitude < 0x3C800000, subnormal, rounded)
    out = xp.where(magnitude >= numpy.float32(E4M3_MAX).view(numpy.uint32), 0x7E, out)
    out = xp.where(magnitude > 0x7F800000, 0x7F, out)
    return (sign | out).astype(xp.uint8)


def quantize_e4m3(x, descale):
    """e4m3 bits (uint8) of x / descale, as attention_with_kvcache stores new tokens: the
    quotient in float32, then float_to_e4m3. `descale` a float or a float32 array that
    broadcasts against x (for a cache (..., nheads_kv, headdim) per KV head: shape
    (nheads_kv, 1))."""
    xp = _module(x)
    x = xp.asarray(x).astype(numpy.float32)
    return float_to_e4m3(x / xp.asarray(descale, dtype=numpy.float32))


def dequantize_e4m3(bits, descale=1.0, dtype=numpy.float32):
    """The values e4m3 * descale of e4m3 bits (uint8 or float8_e4m3fn), in `dtype`."""
    xp = _module(bits)
    values = e4m3_to_float(bits).astype(dtype)
    return values * xp.asarray(descale, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache's FP8 arguments (its kernel path and its reference)


def cache_format(q, k_cache, v_cache, k, kv_cache_dtype, k_descale, v_descale):
    """The cache format of an attention_with_kvcache call: None (the cache holds q's dtype) or
    "e4m3", its arguments checked (messages name them) before the shapes are."""
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_dtype must be None (the cache holds q's dtype) or one of "
                         f"{sorted(KV_CACHE_FORMATS)} (FP8 bits in uint8 arrays); got "
                         f"{kv_cache_dtype!r}")
    dtypes = {name: numpy.dtype(x.dtype) for name, x in (("k_cache", k_cache),
                                                          ("v_cache", v_cache))}
    e4m3 = {name: dtype in E4M3_DTYPES for name, dtype in dtypes.items()}
    if not any(e4m3.values()):
        if kv_cache_dtype is not None:
            raise TypeError(f"kv_cache_dtype={kv_cache_dtype!r} needs k_cache and v_cache of "
                            f"uint8 (e4m3 bits) or float8_e4m3fn; got k_cache "
                            f"{dtypes['k_cache']} and v_cache {dtypes['v_cache']}")
        for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
            if descale is not None:
                raise ValueError(f"{name} is for an FP8 cache (kv_cache_dtype='e4m3'); this "
                                 f"cache holds {dtypes['k_cache']}")
        return None
    if dtypes["k_cache"] != dtypes["v_cache"]:
        raise TypeError(f"k_cache and v_cache must have the same dtype; got {dtypes['k_cache']} "
                        f"and {dtypes['v_cache']}")
    if dtypes["k_cache"] == numpy.uint8 and kv_cache_dtype is None:
        raise TypeError("k_cache and v_cache are uint8: pass kv_cache_dtype='e4m3' to read their "
                        "bytes as FP8 e4m3 values (uint8 is read no other way)")
    if numpy.dtype(q.dtype).itemsize != 2:
        raise TypeError(f"an e4m3 cache takes a 16-bit q (float16 or bfloat16); got q "
                        f"{numpy.dtype(q.dtype)}")
    if k is not None and numpy.dtype(k.dtype) != numpy.dtype(q.dtype):
        raise TypeError(f"k and v (the new tokens) must have q's dtype {numpy.dtype(q.dtype)}: "
                        f"an e4m3 cache quantises them itself (k / k_descale rounded to e4m3); "
                        f"got k {numpy.dtype(k.dtype)}")
    head_dim = k_cache.shape[-1] if len(k_cache.shape) else 0
    if head_dim % 16:
        raise ValueError(f"an e4m3 cache's head dim must be a multiple of 16 (rows of 16-byte "
                         f"chunks); got k_cache's {head_dim}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        for dim, (size, stride) in enumerate(zip(x.shape[:-1], x.strides[:-1])):
            if size > 1 and stride % 16:
                raise ValueError(f"{name} stride of dim {dim} must be a multiple of 16 bytes (an "
                                 f"e4m3 cache is read in 16-byte chunks); got strides "
                                 f"{tuple(x.strides)} for shape {tuple(x.shape)}")
    return "e4m3"


def descale_shape_error(name, descale, batch, nheads_kv, batch_name="batch"):
    """None if `descale` is a float32 array of shape (), (1,) or (batch, nheads_kv) (any
    strides: a broadcast view shares a factor along an axis), else the message, which calls the
    first dim `batch_name` (varlen calls: "num_sequences")."""
    dtype = getattr(descale, "dtype", None)
    shape = tuple(getattr(descale, "shape", ()))
    if dtype is None or numpy.dtype(dtype) != numpy.float32 or shape not in (
            (), (1,), (batch, nheads_kv)):
        what = (f"{numpy.dtype(dtype)} {shape}" if dtype is not None
                else type(descale).__name__)
        return (f"{name} must be a float32 array of shape ({batch_name}, nheads_kv) = ({batch}, "
                f"{nheads_kv}) (a factor per sequence and KV head, as FlashAttention-3's), or () "
                f"/ (1,) (one for the whole array); got {what}")
    return None


def check_descale_values(name, values) -> None:
    """A descale array's values (on the host): positive and finite (check_cache=True)."""
    values = numpy.asarray(values, numpy.float64)
    bad = ~(numpy.isfinite(values) & (values > 0))
    if bad.any():
        raise ValueError(f"{name} must hold positive finite factors; got "
                         f"{values.reshape(-1)[numpy.argmax(bad.reshape(-1))]}")


def descale_strides(descale) -> tuple[int, int]:
    """(batch, KV head) strides in elements of a checked descale array (0 where shared)."""
    if descale.ndim < 2:
        return (0, 0)
    return tuple(s // 4 if n > 1 else 0 for n, s in zip(descale.shape, descale.strides))


def descale_values(name, descale, batch, nheads_kv, xp):
    """The reference's (batch, nheads_kv) float64 factors: None -> ones; a float or an array as
    the kernel path takes it."""
    if descale is None:
        return xp.ones((batch, nheads_kv), numpy.float64)
    if isinstance(descale, numbers.Real) and not isinstance(descale, bool):
        return xp.full((batch, nheads_kv), float(descale), numpy.float64)
    error = descale_shape_error(name, descale, batch, nheads_kv)
    if error:
        raise ValueError(error)
    values = xp.asarray(descale).astype(numpy.float64)
    return xp.broadcast_to(values.reshape(-1)[0] if values.ndim < 2 else values,
                           (batch, nheads_kv))


# ---------------------------------------------------------------------------------------------
# attention's FP8 inputs (the FP8 forward, docs/FP8_FORWARD.md)

#: The descale arguments of an FP8 attention call by the view name its plan reads them under.
FORWARD_DESCALES = {"q_descale": "descales.q", "k_descale": "descales.k",
                    "v_descale": "descales.v"}


_unit_descales: dict = {}


def unit_descale(cupy):
    """A float32 1 of shape (1,) on the current device, one per device: the factor of an FP8
    array whose descale is not given (attention's FP8 forward, attention_with_kvcache's FP8
    cache), whose kernels read every factor."""
    device = cupy.cuda.runtime.getDevice()
    unit = _unit_descales.get(device)
    if unit is None:
        unit = _unit_descales[device] = cupy.ones((1,), cupy.float32)
    return unit


def check_forward_descales(descales: dict, qkv_dtype, batch: int, nheads_kv: int,
                           batch_name: str = "batch") -> None:
    """The descale arguments of an attention call (`descales`: argument name -> array or
    None): only with FP8 inputs (`qkv_dtype` given), each a float32 array of shape (), (1,) or
    (batch, nheads_kv) (descale_shape_error; attention_varlen's: (num_sequences, nheads_kv),
    `batch_name` "num_sequences")."""
    for name, descale in descales.items():
        if descale is None:
            continue
        if qkv_dtype is None:
            raise ValueError(f"{name} is for FP8 inputs (qkv_dtype='e4m3'); leave it None for "
                             f"q, k and v of 16-bit or float32 values")
        error = descale_shape_error(name, descale, batch, nheads_kv, batch_name)
        if error:
            raise ValueError(error)

