"""Argument checks, run before any kernel launch.

Pure Python on `.shape`, `.dtype`, `.strides` and `.itemsize`, so the CPU suite exercises exactly
these checks with numpy arrays; `api.py` adds the checks that need CuPy (array type, device,
pointer alignment, compute capability). Every error names the argument and what was expected.
"""

from __future__ import annotations

import math
import numbers
import operator

import ml_dtypes
import numpy
from dataclasses import dataclass

from . import _configs, fp8

# dtype -> name by hash lookup: str(dtype) costs microseconds, and this runs on every call.
_DTYPE_NAMES = {numpy.dtype(numpy.float16): "float16", numpy.dtype(ml_dtypes.bfloat16): "bfloat16",
                numpy.dtype(numpy.float32): "float32"}
#: The dtype of each name (numpy dtypes: CuPy allocates with them).
_NAMED_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
MAX_HEAD_DIM = 256
#: The FP8 formats `attention` reads e4m3 inputs as (qkv_dtype).
QKV_FORMATS = ("e4m3",)
#: Rows are copied in 16-byte chunks, so every stride but the last must be a multiple of 16
#: bytes (8 16-bit elements, 4 float32 ones), as it always is for slices of a contiguous
#: (..., headdim) array.
STRIDE_BYTES = 16
#: The `precision` of float32 calls (JAX's names, and "tf32"), as the kernels' element
#: (cuflash2._configs.FLOAT32_TAGS): "highest" (the default) float32-level error, "high" and
#: "tf32" one TF32 product (inputs and P rounded to 10 mantissa bits).
PRECISIONS = {"highest": "float32", "high": "tf32", "tf32": "tf32"}


@dataclass(frozen=True)
class AttentionProblem:
    """The sizes of one attention call, batched form (an unbatched call has batch 1)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    # "float16", "bfloat16" or "float32" (the kernels' element: kernel_element), or for e4m3
    # inputs "e4m3_bf16" / "e4m3_fp16" by the output's dtype (_configs.E4M3_ELEMENTS)
    dtype: str
    batched: bool  # False for (seqlen, nheads, headdim) inputs
    softmax_scale: float
    #: v's and out's head dim (d_v), where it differs from q's and k's (d_qk); 0: head_dim.
    head_dim_v: int = 0

    def __post_init__(self):
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)


def _layout_hint(batched: bool) -> str:
    return "(batch, seqlen, nheads, headdim)" if batched else "(seqlen, nheads, headdim)"


def _check_ndim(name: str, x, ndim: int | None) -> int:
    shape = tuple(x.shape)
    if len(shape) not in (3, 4):
        raise ValueError(
            f"{name} must have 4 dims (batch, seqlen, nheads, headdim) or 3 dims "
            f"(seqlen, nheads, headdim); got shape {shape}")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(
            f"{name} must have the same number of dims as q ({ndim}, {_layout_hint(ndim == 4)}); "
            f"got shape {shape}")
    return len(shape)


def _check_dtype(name: str, x, expected: str | None) -> str:
    dtype = _DTYPE_NAMES.get(x.dtype)
    if dtype is None:
        dtype = str(x.dtype)
        if numpy.dtype(x.dtype) in fp8.E4M3_DTYPES:
            # A cast would read e4m3 bits as integers: say what exists instead.
            raise TypeError(
                f"{name} is {dtype}: FP8 (e4m3) bits are read by the forward alone, "
                f"attention(q, k, v, qkv_dtype='e4m3', q_descale=, k_descale=, v_descale=) and "
                f"attention_varlen(..., qkv_dtype='e4m3', q_descale=, k_descale=, v_descale=) "
                f"(on sm_90), and by attention_with_kvcache(..., kv_cache_dtype='e4m3') for a "
                f"cache; the backward and the packed forms take float16, bfloat16 or float32, "
                f"and uint8 is read no other way. Dequantise first: "
                f"cuflash2.fp8.dequantize_e4m3({name}, descale).astype(ml_dtypes.bfloat16)")
        raise TypeError(
            f"{name} must be float16, bfloat16 (ml_dtypes.bfloat16) or float32; got {dtype}. "
            f"Cast explicitly, e.g. {name}.astype(cupy.float32)")
    if expected is not None and dtype != expected:
        raise TypeError(f"{name} must have the same dtype as q ({expected}); got {dtype}")
    return dtype


def check_strides(name: str, x) -> None:
    """Last dim contiguous, other strides whole 16-byte units (any sign, any order)."""
    itemsize = x.itemsize
    shape, strides = tuple(x.shape), tuple(x.strides)
    if 0 in shape:
        return  # nothing is read or written
    if shape[-1] > 1 and strides[-1] != itemsize:
        raise ValueError(
            f"{name} must be contiguous in its last dim (headdim stride {itemsize} bytes); got "
            f"strides {strides} for shape {shape}. Use cupy.ascontiguousarray({name})")
    for dim, (size, stride) in enumerate(zip(shape[:-1], strides[:-1])):
        if size > 1 and stride % STRIDE_BYTES != 0:
            raise ValueError(
                f"{name} stride of dim {dim} must be a multiple of {STRIDE_BYTES // itemsize} "
                f"elements ({STRIDE_BYTES} bytes); got strides {strides} for shape {shape}. "
                f"Use cupy.ascontiguousarray({name})")


def kernel_element(dtype: str, precision) -> str:
    """The kernels' element type of a call on `dtype` arrays at `precision` (None: the dtype's
    default): the dtype itself for float16 and bfloat16 (precision must be None), PRECISIONS'
    for float32."""
    if dtype != "float32":
        if precision is not None:
            raise ValueError(f"precision applies to float32 inputs only; got precision="
                             f"{precision!r} with {dtype} inputs (leave it None)")
        return dtype
    if precision is None:
        return PRECISIONS["highest"]
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))} or None; "
                         f"got {precision!r}")
    return PRECISIONS[precision]


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive float or None; got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {scale}")
    return scale


def numpy_dtype(name: str) -> numpy.dtype:
    """The numpy dtype of a dtype name ("float16", "bfloat16", "float32")."""
    return _NAMED_DTYPES[name]


def _check_e4m3_dtypes(q, k, v, qkv_dtype, out_dtype) -> tuple[str, str]:
    """(the kernels' element, out's dtype name) of an FP8 call (`qkv_dtype` given): q, k and v
    of one e4m3 dtype (uint8 bits or float8_e4m3fn), out_dtype float16 or bfloat16 (None:
    bfloat16, as FlashAttention-3)."""
    if qkv_dtype not in QKV_FORMATS:
        raise ValueError(f"qkv_dtype must be None (q, k and v hold their own dtype's values) or "
                         f"one of {list(QKV_FORMATS)} (FP8 bits in uint8 arrays); got "
                         f"{qkv_dtype!r}")
    dtypes = {name: numpy.dtype(x.dtype) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, dtype in dtypes.items():
        if dtype not in fp8.E4M3_DTYPES:
            raise TypeError(f"qkv_dtype={qkv_dtype!r} needs q, k and v of uint8 (e4m3 bits) or "
                            f"float8_e4m3fn; got {name} {dtype}")
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"q, k and v must have the same dtype; got q {dtypes['q']}, k "
                        f"{dtypes['k']}, v {dtypes['v']}")
    out_name = "bfloat16" if out_dtype is None else _DTYPE_NAMES.get(_as_dtype(out_dtype))
    if out_name not in _configs.E4M3_ELEMENTS:
        raise TypeError(f"out_dtype of FP8 (e4m3) inputs must be float16 or bfloat16 "
                        f"(ml_dtypes.bfloat16; None: bfloat16); got {out_dtype!r}")
    return _configs.E4M3_ELEMENTS[out_name], out_name


def _as_dtype(dtype):
    try:
        return numpy.dtype(dtype)
    except TypeError:
        return None


def check_attention_inputs(q, k, v, *, softmax_scale=None, out=None, qkv_dtype=None,
                           out_dtype=None, max_head_dim=MAX_HEAD_DIM) -> AttentionProblem:
    """Checks q, k, v (and `out`) of `cuflash2.attention`; returns the problem sizes.
    `qkv_dtype` ("e4m3"): q, k and v hold FP8 bits, out is `out_dtype` (None: bfloat16).
    `max_head_dim`: the largest head dim taken (attention_with_kvcache's latent q: 576)."""
    ndim = _check_ndim("q", q, None)
    _check_ndim("k", k, ndim)
    _check_ndim("v", v, ndim)
    if qkv_dtype is not None:
        dtype, out_name = _check_e4m3_dtypes(q, k, v, qkv_dtype, out_dtype)
    else:
        if out_dtype is not None:
            raise ValueError(f"out_dtype is for FP8 inputs (qkv_dtype='e4m3'); out takes q's "
                             f"dtype here (leave it None); got {out_dtype!r}")
        dtype = out_name = _check_dtype("q", q, None)
        _check_dtype("k", k, dtype)
        _check_dtype("v", v, dtype)

    batched = ndim == 4
    q_shape = tuple(q.shape) if batched else (1, *q.shape)
    k_shape = tuple(k.shape) if batched else (1, *k.shape)
    v_shape = tuple(v.shape) if batched else (1, *v.shape)
    batch, seqlen_q, nheads, head_dim = q_shape
    _, seqlen_k, nheads_kv, _ = k_shape
    layout = _layout_hint(batched)

    if batched and (k_shape[0] != batch or v_shape[0] != batch):
        raise ValueError(
            f"q, k and v must have the same batch size; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k_shape[3] != head_dim:
        raise ValueError(
            f"k must have the same headdim as q ({head_dim}); got k {tuple(k.shape)}")
    # v may have a head dim of its own (d_v; out takes it), as DeepSeek's 192 / 128.
    head_dim_v = v_shape[3]
    if v_shape[:3] != k_shape[:3]:
        raise ValueError(
            f"v must have the shape of k {tuple(k.shape)} {layout} but for its head dim; got "
            f"{tuple(v.shape)}")
    for name, dim, shape in (("q", head_dim, q.shape), ("v", head_dim_v, v.shape)):
        if dim % 8 != 0 or not 0 < dim <= max_head_dim:
            raise ValueError(
                f"headdim must be a multiple of 8 between 8 and {max_head_dim}; got {dim} "
                f"({name} shape {tuple(shape)})")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"the number of query heads ({nheads}) must be a multiple of the number of key/value "
            f"heads ({nheads_kv}); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_strides(name, x)
    scale = check_softmax_scale(softmax_scale, head_dim)

    if out is not None:
        if qkv_dtype is not None and _DTYPE_NAMES.get(out.dtype) != out_name:
            raise TypeError(f"out must be {out_name} (out_dtype of FP8 inputs; None: bfloat16); "
                            f"got {out.dtype}")
        _check_like("out", out, "q" if head_dim_v == head_dim else "q with v's head dim",
                    output_shape(q.shape, head_dim_v), out_name)

    return AttentionProblem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype,
                            batched, scale, head_dim_v)


def output_shape(q_shape, head_dim_v: int) -> tuple:
    """The shape of out (and dout): q's, with v's head dim."""
    return (*tuple(q_shape)[:-1], head_dim_v)


def _check_like(name: str, x, like_name: str, shape, dtype: str) -> None:
    """`x` of this shape (that of what `like_name` names) and dtype, with strides the kernels
    take."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have the shape of {like_name} {tuple(shape)}; got {tuple(x.shape)}")
    _check_dtype(name, x, dtype)
    check_strides(name, x)


def check_backward_inputs(problem: AttentionProblem, dout, q, k, v, out, lse, *, dq=None,
                          dk=None, dv=None) -> None:
    """Checks the backward's extra arguments against the forward problem `problem` (from
    check_attention_inputs): dout and out like q (with v's head dim), lse float32 (batch, nheads,
    seqlen_q) as the forward returned it, and the optional dq / dk / dv outputs like q / k / v."""
    like = "q" if problem.head_dim_v == problem.head_dim else "q with v's head dim"
    for name, x in (("dout", dout), ("out", out)):
        _check_like(name, x, like, output_shape(q.shape, problem.head_dim_v), problem.dtype)
    lse_shape = ((problem.batch,) if problem.batched else ()) + (problem.nheads, problem.seqlen_q)
    if tuple(lse.shape) != lse_shape:
        raise ValueError(
            f"lse must have shape {lse_shape} (batch, nheads, seqlen_q) as returned by "
            f"attention(..., return_lse=True); got {tuple(lse.shape)}")
    if str(lse.dtype) != "float32":
        raise TypeError(f"lse must be float32 as returned by attention(..., return_lse=True); "
                        f"got {lse.dtype}")
    contiguous, size = [], 4
    for dim in reversed(lse_shape):
        contiguous.insert(0, size)
        size *= dim
    if 0 not in lse_shape and any(
            s != c for s, c, n in zip(lse.strides, contiguous, lse_shape) if n > 1):
        raise ValueError(f"lse must be C-contiguous; got strides {tuple(lse.strides)}. "
                         f"Use cupy.ascontiguousarray(lse)")
    for name, x, like_name, like in (("dq", dq, "q", q), ("dk", dk, "k", k), ("dv", dv, "v", v)):
        if x is not None:
            _check_like(name, x, like_name, like.shape, problem.dtype)


def check_window(window_size, causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The (left, right) key window the kernels get: -1 is unbounded, causal is right = 0.

    Query row i sees keys j with i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q
    + right (flash-attn's bottom-right alignment). A window edge beyond both sequences is the
    same as no edge and is passed as -1, which also keeps the kernels' int32 index math in range.
    """
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(
            f"window_size must be a pair (left, right) of ints, -1 for unbounded; got "
            f"{window_size!r}") from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window_size {side} must be an int (-1 for unbounded); got {value!r}")
        if value < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 for unbounded); got {value}")
    left, right = int(left), int(right)
    if causal:
        if right > 0:
            raise ValueError(
                f"causal=True already fixes the window's right edge at the diagonal; got "
                f"window_size={tuple(window_size)}. Use window_size=({left}, 0) or ({left}, -1) "
                f"with causal=True, or causal=False with window_size=({left}, {right})")
        right = 0
    reach = seqlen_q + seqlen_k
    return (-1 if left >= reach else left, -1 if right >= reach else right)


def check_softcap(softcap) -> float:
    """softcap as a float: 0 disables it, > 0 caps the scaled scores to softcap * tanh(s / softcap)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0 disables it); got {softcap!r}")
    softcap = float(softcap)
    if not (0.0 <= softcap < math.inf):  # also rejects nan
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it); got {softcap}")
    return softcap


def check_dtype(x, allowed, expected: str) -> None:
    """TypeError `expected; got <x's dtype or type>` unless x is an array of dtype `allowed` (one
    dtype, or a collection of them)."""
    dtype = getattr(x, "dtype", None)
    allowed = ({numpy.dtype(allowed)} if isinstance(allowed, (type, str, numpy.dtype))
               else {numpy.dtype(d) for d in allowed})
    if dtype is None or numpy.dtype(dtype) not in allowed:
        raise TypeError(
            f"{expected}; got "
            f"{'dtype ' + str(dtype) if dtype is not None else type(x).__name__}")


def check_alibi_slopes(alibi_slopes, batch: int, nheads: int, batched: bool,
                       contiguous: bool = True) -> int | None:
    """Checks ALiBi slopes: float32, shape (nheads,) or (batch, nheads) (unbatched: (nheads,) or
    (1, nheads)), last dim contiguous (for the kernels; `contiguous=False` for the reference).
    Returns the batch stride in elements (0 for one slope per
    head), or None without slopes."""
    if alibi_slopes is None:
        return None
    check_dtype(alibi_slopes, numpy.float32, "alibi_slopes must be a float32 array (as flash-attn)")
    shape = tuple(alibi_slopes.shape)
    if shape not in ((nheads,), (batch, nheads)):
        shapes = f"({nheads},) or ({batch if batched else 1}, {nheads})"
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) or (batch, nheads) = {shapes}; got {shape}")
    if contiguous and nheads > 1 and alibi_slopes.strides[-1] != 4:
        raise ValueError(
            f"alibi_slopes must be contiguous along heads (stride 4 bytes); got strides "
            f"{alibi_slopes.strides}; use cupy.ascontiguousarray(alibi_slopes)")
    return alibi_slopes.strides[0] // 4 if len(shape) == 2 and batch > 1 else 0


def check_sinks(sinks, nheads: int, name: str = "sinks") -> None:
    """Checks learnable attention sinks (or, with `name="dsinks"`, the array that receives
    their gradient): float32, shape (nheads,), contiguous. None passes (no sinks)."""
    if sinks is None:
        return
    check_dtype(sinks, numpy.float32,
                f"{name} must be a float32 array of shape (nheads,) (one logit a query head)")
    shape = tuple(sinks.shape)
    if shape != (nheads,):
        raise ValueError(f"{name} must have shape (nheads,) = ({nheads},) (one logit a query "
                         f"head); got {shape}")
    if nheads > 1 and sinks.strides[0] != 4:
        raise ValueError(f"{name} must be contiguous (stride 4 bytes); got strides "
                         f"{tuple(sinks.strides)}; use cupy.ascontiguousarray({name})")


def check_dsinks(dsinks, sinks, nheads: int) -> None:
    """The optional output of the sinks' gradient: only with sinks, shaped and typed like them."""
    if dsinks is None:
        return
    if sinks is None:
        raise ValueError("dsinks receives the gradient of sinks: pass it only with sinks=")
    check_sinks(dsinks, nheads, "dsinks")


_BIAS_DTYPES = {numpy.dtype(numpy.float16): "float16", numpy.dtype(ml_dtypes.bfloat16): "bfloat16",
                numpy.dtype(numpy.float32): "float32"}


def check_bias(bias, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, batched: bool,
               float64: bool = False, varlen: bool = False) -> tuple[bool, bool] | None:
    """Checks an additive attention bias (issue 44): float16, bfloat16 or float32 (`float64=True`:
    float64 too, for the float64 reference), shape (batch or 1, nheads or 1, seqlen_q, seqlen_k),
    or for unbatched inputs (nheads or 1, seqlen_q, seqlen_k) (a leading 1 allowed). Varlen calls
    (`varlen=True`) pass their batch and max_seqlen_q/k (sequence b reads ``bias[b, :,
    :seqlen_q_b, :seqlen_k_b]``). Heads index the query heads (GQA too). Strides are the caller's to check.
    Returns (batch_broadcast, heads_broadcast): whether the bias's batch / head dim is 1 (one
    bias shared by every batch entry / head: stride 0), or None without a bias."""
    if bias is None:
        return None
    allowed = "float16, bfloat16 or float32" + (" (float64 for the reference)" if float64 else "")
    check_dtype(bias, [*_BIAS_DTYPES, *([numpy.float64] if float64 else [])],
                f"bias must be a {allowed} array")
    shape = tuple(bias.shape)
    expected = ((batch, nheads, seqlen_q, seqlen_k) if batched
                else (nheads, seqlen_q, seqlen_k))
    if not batched and len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    ok = len(shape) == len(expected) and shape[-2:] == expected[-2:] and all(
        size in (1, want) for size, want in zip(shape[:-2], expected[:-2]))
    if not ok:
        lengths = "max_seqlen_q, max_seqlen_k" if varlen else "seqlen_q, seqlen_k"
        doc = (f"(batch or 1, nheads or 1, {lengths})" if batched
               else f"(nheads or 1, {lengths})")
        raise ValueError(
            f"bias must have shape {doc} = {expected} (a dim of 1 is broadcast); got "
            f"{tuple(bias.shape)}")
    if batched:
        return shape[0] == 1, shape[1] == 1
    return True, shape[0] == 1


# Variable-length batches


def check_cu_seqlens(name: str, cu_seqlens, total: int, total_name: str, to_host):
    """cu_seqlens as a host int64 array, checked: int32, 1-D, 0 first, non-decreasing, ending at
    `total`. `to_host` copies the values to the host (for CuPy arrays, a device sync); with
    `to_host=None` only the dtype and shape are checked and None is returned."""
    check_dtype(cu_seqlens, numpy.int32, f"{name} must be an int32 array of cumulative sequence "
                "lengths (batch + 1 entries)")
    if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"{name} must be 1-D with batch + 1 >= 1 entries; got shape {tuple(cu_seqlens.shape)}")
    if to_host is None:  # values not checked
        return None
    cu = numpy.asarray(to_host(cu_seqlens)).astype(numpy.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start with 0; got {name}[0] = {cu[0]}")
    steps = numpy.diff(cu)
    if numpy.any(steps < 0):
        at = int(numpy.argmax(steps < 0))
        raise ValueError(
            f"{name} must be non-decreasing; got {name}[{at}] = {cu[at]} > "
            f"{name}[{at + 1}] = {cu[at + 1]}")
    if cu[-1] != total:
        raise ValueError(
            f"{name}[-1] ({cu[-1]}) must equal the packed length {total_name} ({total})")
    return cu


def check_max_seqlen(name: str, max_seqlen, lengths, what: str) -> int:
    """max_seqlen as an int, at least the longest of `lengths` (host array; None: not checked)."""
    try:
        max_seqlen = operator.index(max_seqlen)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {max_seqlen!r}") from None
    if max_seqlen < 0:
        raise ValueError(f"{name} must be >= 0; got {max_seqlen}")
    if lengths is not None:
        longest = int(lengths.max()) if lengths.size else 0
        if max_seqlen < longest:
            raise ValueError(f"{name} ({max_seqlen}) is smaller than the longest {what} ({longest})")
    return max_seqlen


def check_dropout(dropout_p, seed, offset) -> tuple[float, int, int]:
    """dropout_p in [0, 1); with dropout_p > 0 an int seed (the Philox key, 64 bits) is required
    so that the backward can redraw the forward's mask; offset an int in [0, 2^32)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not (0.0 <= dropout_p < 1.0):  # also rejects nan
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    if dropout_p > 0:
        if seed is None:
            raise ValueError(
                f"dropout_p={dropout_p} needs seed=<int>: the backward must redraw the forward's "
                "dropout mask from the same seed (and offset)")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int; got {seed!r}")
        if not (0 <= int(seed) < 2**64):
            raise ValueError(f"seed must be in [0, 2^64); got {seed}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be an int; got {offset!r}")
    if not (0 <= int(offset) < 2**32):
        raise ValueError(f"offset must be in [0, 2^32); got {offset}")
    return dropout_p, int(seed or 0), int(offset)


# Inference with a KV cache (flash-attn's flash_attn_with_kvcache)


@dataclass(frozen=True)
class KVCacheProblem:
    """The sizes of one attention-with-KV-cache call."""

    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int  # v_cache's (MLA's latent cache: K's first columns, d_v < d)
    seqlen_new: int  # tokens appended (0 without k, v)
    paged: bool
    page_size: int  # paged: rows per block; contiguous: the cache length
    capacity: int  # positions a sequence can hold (max_blocks * page_size, or the cache length)
    num_blocks: int  # paged: blocks in the cache; contiguous: cache batch entries


def _int32_vector(name: str, x, length: int, what: str) -> None:
    check_dtype(x, numpy.int32, f"{name} must be an int32 array ({what})")
    if tuple(x.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) ({what}); got {tuple(x.shape)}")


def check_kvcache_inputs(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                         cache_batch_idx=None, block_table=None, to_host=None,
                         kv_cache_dtype=None) -> KVCacheProblem:
    """Shapes and dtypes of a KV-cache call; with `to_host` (a function copying an array to the
    host: for CuPy arrays a device sync) also the values: cache_seqlens + the new tokens within
    the capacity, cache_batch_idx and the used block_table entries in range. `kv_cache_dtype`:
    an FP8 cache's format, its dtypes checked already (fp8.cache_format)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D; got shape {tuple(x.shape)}")
    batch, seqlen_q, nheads, head_dim = q.shape
    if tuple(k_cache.shape[:-1]) != tuple(v_cache.shape[:-1]) or v_cache.shape[-1] < 1:
        raise ValueError(f"k_cache and v_cache must have the same shape but for their head dims "
                         f"(v's, d_v, may differ: MLA's latent cache); got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    rows, cache_len, nheads_kv, cache_dim = k_cache.shape
    head_dim_v = int(v_cache.shape[-1])
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if kv_cache_dtype is None and x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
    if cache_dim != head_dim:
        raise ValueError(f"k_cache's head dim ({cache_dim}) must equal q's ({head_dim})")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of the cache's nheads_kv "
                         f"({nheads_kv})")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1] if len(k.shape) == 4 else -1
        for name, x, dim in (("k", k, head_dim), ("v", v, head_dim_v)):
            if tuple(x.shape) != (batch, seqlen_new, nheads_kv, dim):
                raise ValueError(f"{name} must have shape (batch, seqlen_new, nheads_kv, headdim) "
                                 f"= ({batch}, {seqlen_new}, {nheads_kv}, {dim}); got "
                                 f"{tuple(x.shape)}")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx and block_table exclude each other (a paged cache "
                             "maps sequences to blocks through block_table)")
        dtype = getattr(block_table, "dtype", None)
        if dtype is None or numpy.dtype(dtype) != numpy.int32 or len(block_table.shape) != 2 \
                or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 (batch, max_blocks) = ({batch}, ...) "
                             f"array; got {dtype} {tuple(getattr(block_table, 'shape', ()))}")
        capacity = block_table.shape[1] * cache_len
    else:
        if cache_batch_idx is None and rows != batch:
            raise ValueError(f"k_cache has {rows} sequences but q has batch {batch}; pass "
                             f"cache_batch_idx to pick cache rows")
        if cache_batch_idx is not None:
            _int32_vector("cache_batch_idx", cache_batch_idx, batch, "a cache row per sequence")
        capacity = cache_len
    if cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Integral):
        _int32_vector("cache_seqlens", cache_seqlens, batch, "tokens already cached per sequence")
    problem = KVCacheProblem(batch, seqlen_q, nheads, nheads_kv, head_dim, head_dim_v,
                             seqlen_new, paged, cache_len, capacity, rows)
    if to_host is not None:
        _check_kvcache_values(problem, cache_seqlens, cache_batch_idx, block_table, to_host)
    return problem


def check_rotary(rotary_cos, rotary_sin, q_dtype, head_dim: int, capacity: int,
                 new_tokens: bool):
    """attention_with_kvcache's rotary_cos / rotary_sin (flash-attn's rules): None without them,
    else (rotary_dim, seqlen_ro). Both (seqlen_ro, rotary_dim / 2) of q's dtype, rotary_dim a
    positive multiple of 16 and at most the head dim, a row for every position of the cache
    (seqlen_ro >= its capacity), and new tokens (k, v) to rotate."""
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not new_tokens:
        raise ValueError("rotary_cos / rotary_sin rotate the new keys as they are appended: pass "
                         "k and v too (as flash-attn requires)")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if len(x.shape) != 2:
            raise ValueError(f"{name} must be 2-D, (seqlen_ro, rotary_dim / 2); got shape "
                             f"{tuple(x.shape)}")
        if x.dtype != q_dtype:
            raise TypeError(f"{name} must have q's dtype {q_dtype}; got {x.dtype}")
    if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
        raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}; "
                         f"got {tuple(rotary_sin.shape)}")
    seqlen_ro, half = (int(n) for n in rotary_cos.shape)
    rotary_dim = 2 * half
    if rotary_dim == 0 or rotary_dim % 16 or rotary_dim > head_dim:
        raise ValueError(f"rotary_cos's rotary_dim (2 x its {half} columns = {rotary_dim}) must "
                         f"be a positive multiple of 16 and at most the head dim {head_dim} "
                         f"(flash-attn's rule)")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos and rotary_sin must have a row for every position of the "
                         f"cache: their seqlen_ro ({seqlen_ro} rows) is less than its capacity "
                         f"({capacity}) (flash-attn's rule)")
    return rotary_dim, seqlen_ro


def rotary_positions_per_row(causal: bool, window_size, capacity: int) -> bool:
    """Whether rotary puts q's row i at position cache_seqlens[b] + i (causal or a window, as
    flash-attn decides it: a window edge at or beyond the cache's capacity is no edge) rather
    than every row at cache_seqlens[b]."""
    return bool(causal) or any(0 <= int(side) < capacity for side in window_size)


def check_cache_leftpad(cache_leftpad, batch: int, paged: bool) -> None:
    """attention_with_kvcache's cache_leftpad: int32 (batch,), a contiguous cache only."""
    if cache_leftpad is None:
        return
    if paged:
        raise ValueError("cache_leftpad does not go with a paged cache (block_table); "
                         "flash-attn does not support the two together either")
    _int32_vector("cache_leftpad", cache_leftpad, batch, "the first position of each "
                  "sequence's keys in the cache")


def check_kvcache_extra_values(problem: KVCacheProblem, cache_seqlens, cache_leftpad, rotary,
                               per_row: bool, to_host) -> None:
    """The values of cache_leftpad (within [0, cache_seqlens[b]]) and, with rotary
    ((rotary_dim, seqlen_ro) or None), q's positions within the table's rows."""
    if not problem.batch:
        return
    lengths = kvcache_lengths(problem, cache_seqlens, to_host)
    if cache_leftpad is not None:
        pads = numpy.asarray(to_host(cache_leftpad)).astype(numpy.int64)
        bad = (pads < 0) | (pads > lengths)
        if bad.any():
            b = int(numpy.argmax(bad))
            raise ValueError(f"cache_leftpad[{b}] = {pads[b]} must be within [0, "
                             f"cache_seqlens[{b}] = {lengths[b]}]")
    if rotary is not None and problem.seqlen_q:
        last = lengths + (problem.seqlen_q - 1 if per_row else 0)
        if last.max() >= rotary[1]:
            b = int(numpy.argmax(last))
            raise ValueError(f"rotary: q's last row of sequence {b} is at position {last[b]}, "
                             f"past rotary_cos's {rotary[1]} rows")


def kvcache_lengths(problem: KVCacheProblem, cache_seqlens, to_host):
    """Host int64 (batch,) of the tokens cached before the call (default: full capacity)."""
    if cache_seqlens is None:
        return numpy.full(problem.batch, problem.capacity - problem.seqlen_new, numpy.int64)
    if isinstance(cache_seqlens, numbers.Integral):
        return numpy.full(problem.batch, int(cache_seqlens), numpy.int64)
    return numpy.asarray(to_host(cache_seqlens)).astype(numpy.int64)


def _check_kvcache_values(problem, cache_seqlens, cache_batch_idx, block_table, to_host):
    lengths = kvcache_lengths(problem, cache_seqlens, to_host)
    total = lengths + problem.seqlen_new
    if problem.batch and (lengths.min() < 0 or total.max() > problem.capacity):
        b = int(numpy.argmax((lengths < 0) | (total > problem.capacity)))
        raise ValueError(
            f"cache_seqlens[{b}] = {lengths[b]} plus the {problem.seqlen_new} new tokens must be "
            f"within [0, {problem.capacity}] (the cache's capacity per sequence)")
    if cache_batch_idx is not None:
        idx = numpy.asarray(to_host(cache_batch_idx))
        if idx.size and (idx.min() < 0 or idx.max() >= problem.num_blocks):
            raise ValueError(f"cache_batch_idx entries must be in [0, {problem.num_blocks}); got "
                             f"{int(idx.min())} .. {int(idx.max())}")
    if block_table is not None and problem.batch:
        table = numpy.asarray(to_host(block_table))
        used = (total[:, None] > numpy.arange(table.shape[1])[None, :] * problem.page_size)
        bad = used & ((table < 0) | (table >= problem.num_blocks))
        if bad.any():
            b, j = (int(i) for i in numpy.argwhere(bad)[0])
            raise ValueError(f"block_table[{b}, {j}] = {table[b, j]} is used (sequence {b} "
                             f"holds {total[b]} tokens) but is not a block of the cache "
                             f"[0, {problem.num_blocks})")
