"""The full check of a call, the first time its signature is seen.

`_validate` checks shapes, dtypes, strides and values in pure Python; this module adds what
needs CuPy (array types, devices, compute capability, pointer alignment) and turns the optional
arguments into what the kernels take (score modifiers, dropout, varlen). A plan (`_plans`) is
built from its result and reused by every later call of the same signature.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy

from . import _configs, _validate, dropout

LOG2E = math.log2(math.e)


def cupy_module():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        from ._environment import CUPY_INSTALL_HINT

        raise ImportError(f"cuflash2 needs CuPy for GPU arrays: {CUPY_INSTALL_HINT}") from exc
    return cupy


def require_cupy_arrays(arrays: dict, reference: str = "attention"):
    """Checks the array arguments are CuPy arrays; returns the cupy module. `reference`: the
    cuflash2.reference function that computes the call on the CPU (the hint for NumPy arrays)."""
    for name, x in arrays.items():
        # Checked before importing CuPy, so the hint also reaches users without CuPy installed.
        if isinstance(x, numpy.ndarray):
            raise TypeError(
                f"{name} is a numpy array; cuflash2 runs on the GPU and needs CuPy arrays: use "
                f"cupy.asarray({name}), or cuflash2.reference.{reference} to compute on the CPU")
    cupy = cupy_module()
    for name, x in arrays.items():
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray; got {type(x).__name__}")
    return cupy


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


_arch_cache: dict[int, int] = {}


def device_arch(device_id: int) -> int:
    """Compute capability of a device as an int (90 for sm_90)."""
    arch = _arch_cache.get(device_id)
    if arch is None:
        arch = int(cupy_module().cuda.Device(device_id).compute_capability)
        _arch_cache[device_id] = arch
    return arch


def check_aligned(name: str, x) -> None:
    if x.size and x.data.ptr % 16:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address (got offset "
            f"{x.data.ptr % 16} bytes); use cupy.ascontiguousarray({name})")


def check_device(tensors: dict, others: dict, cupy) -> int:
    """The current device's id, after checking that every array is on it, that the `tensors`
    (read in 16-byte chunks) are 16-byte aligned, and that the GPU is sm_80 or newer."""
    device_id = cupy.cuda.Device().id
    for name, x in {**tensors, **others}.items():
        if x.device.id != device_id:
            raise ValueError(
                f"{name} is on device {x.device.id} but the current CuPy device is {device_id}; "
                f"run the call under `with cupy.cuda.Device({x.device.id}):` or move the arrays")
    for name, x in tensors.items():
        check_aligned(name, x)
    arch = device_arch(device_id)
    if arch < 80:
        raise RuntimeError(
            f"cuflash2 needs an NVIDIA GPU of compute capability 8.0 or newer (sm_80+: A100, "
            f"RTX 30xx, H100, ...); device {device_id} is sm_{arch}")
    return device_id


@dataclass(frozen=True)
class ScoreMods:
    """softcap / ALiBi / sinks / dropout of one call, as the kernels take them
    (cuda_src/score_mods.cuh, cuda_src/dropout.cuh, kernel_params.cuh's VariantParams and
    DropoutParams; the sinks' pointer is an input of the call, `mods.sinks`)."""

    features: int  # FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_DROPOUT | FEATURE_SINKS bits
    softmax_scale: float  # scale of the scores the softmax sees: softcap, or the softmax scale
    softcap_scale: float  # softmax_scale / softcap (0 without softcap)
    alibi_batch_stride: int
    alibi_to_units: float
    dropout: dict  # DropoutParams field -> value ({} without dropout)
    # The programmable modifiers' sources (mods.ModSource: mask, score; None where absent), or
    # None without them (FEATURE_MASK_MOD, FEATURE_SCORE_MOD).
    user_mods: tuple | None = None

    def fields(self) -> dict:
        """The VariantParams (`mods.*`) and DropoutParams (`dropout.*`) fields."""
        values = {"mods.softcap_scale": self.softcap_scale,
                  "mods.alibi_batch_stride": self.alibi_batch_stride,
                  "mods.alibi_to_units": self.alibi_to_units}
        values.update({f"dropout.{name}": value for name, value in self.dropout.items()})
        return values


def dropout_fields(dropout_p, seed, offset) -> dict:
    """The kernels' DropoutParams for checked dropout arguments ({} for dropout_p = 0)."""
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    if dropout_p == 0:
        return {}
    lo, hi = dropout.split_seed(seed)
    return {"seed_lo": lo, "seed_hi": hi, "offset": offset,
            "keep_threshold": dropout.keep_threshold(dropout_p),
            "scale": 1.0 / (1.0 - dropout_p)}


def score_mods(problem, options) -> ScoreMods:
    """Checks the softcap, alibi_slopes, sinks and dropout options of a call (an
    `_options.AttentionOptions`) and derives the kernel fields."""
    dropout_args = dropout_fields(options.dropout_p, options.seed, options.offset)
    softcap = _validate.check_softcap(options.softcap)
    stride = _validate.check_alibi_slopes(options.alibi_slopes, problem.batch, problem.nheads,
                                          problem.batched)
    _validate.check_sinks(options.sinks, problem.nheads)
    features = ((_configs.FEATURE_SOFTCAP if softcap > 0 else 0)
                | (_configs.FEATURE_ALIBI if options.alibi_slopes is not None else 0)
                | (_configs.FEATURE_DROPOUT if dropout_args else 0)
                | (_configs.FEATURE_SINKS if options.sinks is not None else 0))
    user_mods = check_user_mods(options.mask_mod, options.score_mod)
    if user_mods is not None:
        from . import mods

        features |= mods.features_of(*user_mods)
        if getattr(options, "block_mask", None) is not None:
            features |= _configs.FEATURE_BLOCK_MASK
    effective = softcap if softcap > 0 else problem.softmax_scale
    return ScoreMods(features, effective,
                     problem.softmax_scale / softcap if softcap > 0 else 0.0,
                     int(stride or 0), 1.0 / effective, dropout_args, user_mods)


def check_user_mods(mask_mod, score_mod):
    """(mask source, score source) of a call's programmable modifiers (cuflash2.mods), checked:
    the types and the inputs' count together; None without them."""
    if mask_mod is None and score_mod is None:
        return None
    from . import mods

    if mask_mod is not None and not isinstance(mask_mod, mods.MaskMod):
        raise TypeError(f"mask_mod must be made by cuflash2.mask_mod(expression, **inputs); got "
                        f"{type(mask_mod).__name__}")
    if score_mod is not None and not isinstance(score_mod, mods.ScoreMod):
        raise TypeError(f"score_mod must be made by cuflash2.score_mod(expression, grad=None, "
                        f"**inputs); got {type(score_mod).__name__}")
    sources = (mask_mod.source if mask_mod is not None else None,
               score_mod.source if score_mod is not None else None)
    mods.check_together(*sources)
    return sources


def user_mod_arrays(mask_mod, score_mod) -> dict:
    """The modifiers' input arrays by a name for messages ("mask_mod input doc")."""
    out = {}
    for kind, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if mod is not None:
            for sig, x in zip(mod.source.inputs, mod.arrays):
                out[f"{kind} input {sig.name}"] = x
    return out


def element_strides(x) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a (batch, seqlen, heads, dim) array, or of a
    (seqlen, heads, dim) one (batch stride 0: one sequence, or packed varlen sequences)."""
    itemsize = x.itemsize
    s = x.strides
    if len(s) == 3:
        return (0, s[0] // itemsize, s[1] // itemsize)
    return (s[0] // itemsize, s[1] // itemsize, s[2] // itemsize)


def contiguous_strides(shape) -> tuple:
    """Element strides of a C-contiguous array of `shape` (as CuPy gives cupy.empty(shape))."""
    strides, size = [], 1
    for dim in reversed(shape):
        strides.append(size)
        size *= max(dim, 1)
    return tuple(reversed(strides))


def output_strides(shape) -> tuple[int, int, int]:
    """element_strides of a new C-contiguous array of `shape`."""
    s = contiguous_strides(shape)
    return (0, s[0], s[1]) if len(shape) == 3 else (s[0], s[1], s[2])


@dataclass(frozen=True)
class Varlen:
    """Packed variable-length sequences of one call (varlen.cuh)."""

    total_q: int
    total_k: int
    batch: int  # sequences

    @property
    def stats_rows(self) -> int:
        """Rows per head of the backward's per-row arrays (varlen.cuh, stats_row0): each
        sequence's start moves VARLEN_STATS_GAP rows further, plus one padded block, rounded
        to 4."""
        rows = self.total_q + _configs.VARLEN_STATS_GAP * self.batch + _configs.BWD_ROW_PADDING
        return -(-rows // 4) * 4


def with_kernel_element(problem, options):
    """`problem` with the kernels' element as its dtype (_validate.kernel_element: float32
    inputs at options.precision), checked against the options float32 calls do not take yet."""
    element = _validate.kernel_element(problem.dtype, options.precision)
    if element in _configs.FLOAT32_TAGS and (options.mask_mod is not None
                                             or options.score_mod is not None):
        # (a bias comes as a score modifier: cuflash2._bias)
        raise NotImplementedError("mask_mod, score_mod, bias, block_mask: not with float32 "
                                  "inputs yet (float16 and bfloat16 inputs take them)")
    return dataclasses.replace(problem, dtype=element)


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, out, check_cu_seqlens, cupy, qkv_dtype=None, out_dtype=None):
    """Checks a varlen call (`qkv_dtype`, `out_dtype`: FP8 inputs' format and output dtype, as
    _validate.check_attention_inputs takes them). Returns (problem of the packed arrays as one
    unbatched call, problem the kernels see: batch = sequences and the maximum lengths,
    Varlen)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be packed (total_tokens, nheads, headdim) for varlen; "
                             f"got shape {tuple(x.shape)}")
    packed = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale, out=out,
                                              qkv_dtype=qkv_dtype, out_dtype=out_dtype)
    to_host = cupy.asnumpy if check_cu_seqlens else None  # the one host sync (see README)
    cus = []
    for name, cu, total, total_name in (("cu_seqlens_q", cu_seqlens_q, packed.seqlen_q, "q.shape[0]"),
                                        ("cu_seqlens_k", cu_seqlens_k, packed.seqlen_k, "k.shape[0]")):
        if not isinstance(cu, cupy.ndarray):
            raise TypeError(f"{name} must be an int32 cupy.ndarray; got {type(cu).__name__}")
        cus.append(_validate.check_cu_seqlens(name, cu, total, total_name, to_host))
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    lengths = [None if cu is None else numpy.diff(cu) for cu in cus]
    max_q = _validate.check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths[0], "query sequence")
    max_k = _validate.check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths[1], "key sequence")
    batch = cu_seqlens_q.shape[0] - 1
    problem = dataclasses.replace(packed, batch=batch, seqlen_q=max_q, seqlen_k=max_k,
                                  batched=True)
    return packed, problem, Varlen(packed.seqlen_q, packed.seqlen_k, batch)
