"""`cuflash2.attention`: validate, pick a config, compile (cached), launch."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os

import numpy

from dataclasses import dataclass

from . import _compile, _configs, _validate, dropout

_LOG2E = math.log2(math.e)
#: gridDim.z (the batch) is limited to 65535 blocks; larger batches are launched in slices.
_MAX_GRID_Z = 65535


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "cuflash2 needs CuPy for GPU arrays: pip install 'cuflash2[cuda13]' (or [cuda12])"
        ) from exc
    return cupy


def _require_cupy_arrays(arrays: dict):
    """Checks the array arguments are CuPy arrays; returns the cupy module."""
    for name, x in arrays.items():
        # Checked before importing CuPy, so the hint also reaches users without CuPy installed.
        if isinstance(x, numpy.ndarray):
            raise TypeError(
                f"{name} is a numpy array; cuflash2.attention runs on the GPU and needs CuPy "
                f"arrays: use cupy.asarray({name}), or cuflash2.reference.attention to compute "
                f"on the CPU")
    cupy = _cupy()
    for name, x in arrays.items():
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray; got {type(x).__name__}")
    return cupy


_arch_cache: dict[int, int] = {}


def device_arch(device_id: int) -> int:
    """Compute capability of a device as an int (90 for sm_90)."""
    arch = _arch_cache.get(device_id)
    if arch is None:
        cupy = _cupy()
        arch = int(cupy.cuda.Device(device_id).compute_capability)
        _arch_cache[device_id] = arch
    return arch


def _check_aligned(name: str, x) -> None:
    if x.size and x.data.ptr % 16:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address (got offset "
            f"{x.data.ptr % 16} bytes); use cupy.ascontiguousarray({name})")


def _check_device(arrays: dict, cupy) -> int:
    device_id = cupy.cuda.Device().id
    for name, x in arrays.items():
        if x.device.id != device_id:
            raise ValueError(
                f"{name} is on device {x.device.id} but the current CuPy device is {device_id}; "
                f"run the call under `with cupy.cuda.Device({x.device.id}):` or move the arrays")
        _check_aligned(name, x)
    arch = device_arch(device_id)
    if arch < 80:
        raise RuntimeError(
            f"cuflash2 needs an NVIDIA GPU of compute capability 8.0 or newer (sm_80+: A100, "
            f"RTX 30xx, H100, ...); device {device_id} is sm_{arch}")
    return device_id


@dataclass(frozen=True)
class _ScoreMods:
    """softcap / ALiBi / dropout of one call, as the kernels take them (cuda_src/score_mods.cuh,
    cuda_src/dropout.cuh)."""

    features: int  # FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_DROPOUT template bits
    softmax_scale: float  # scale of the scores the softmax sees: softcap, or the softmax scale
    kernel_args: tuple  # softcap_scale, alibi_slopes, alibi_batch_stride, alibi_to_units
    dropout_args: tuple = ()  # seed low, seed high, offset, keep threshold, 1 / (1 - p)


#: Kernel arguments of "no dropout" (never read: the plain kernels have no dropout code).
_NO_DROPOUT = (numpy.uint32(0), numpy.uint32(0), numpy.uint32(0), numpy.uint32(65536),
               numpy.float32(1.0))


def _dropout_args(dropout_p, seed, offset) -> tuple[int, tuple]:
    """(FEATURE_DROPOUT or 0, the kernels' dropout arguments), checked."""
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    if dropout_p == 0:
        return 0, _NO_DROPOUT
    lo, hi = dropout.split_seed(seed)
    return _configs.FEATURE_DROPOUT, (
        numpy.uint32(lo), numpy.uint32(hi), numpy.uint32(offset),
        numpy.uint32(dropout.keep_threshold(dropout_p)), numpy.float32(1.0 / (1.0 - dropout_p)))


def _score_mods(problem, softcap, alibi_slopes, placeholder, dropout_p=0.0, seed=None,
                offset=0) -> _ScoreMods:
    """Checks softcap, alibi_slopes and the dropout arguments (before any launch) and builds the
    kernel arguments. `placeholder` stands in for absent slopes (never read by the kernels then)."""
    dropout_feature, dropout_args = _dropout_args(dropout_p, seed, offset)
    softcap = _validate.check_softcap(softcap)
    stride = _validate.check_alibi_slopes(alibi_slopes, problem.batch, problem.nheads,
                                          problem.batched)
    features = ((_configs.FEATURE_SOFTCAP if softcap > 0 else 0)
                | (_configs.FEATURE_ALIBI if alibi_slopes is not None else 0) | dropout_feature)
    effective = softcap if softcap > 0 else problem.softmax_scale
    args = (numpy.float32(problem.softmax_scale / softcap if softcap > 0 else 0.0),
            placeholder if alibi_slopes is None else alibi_slopes, int(stride or 0),
            numpy.float32(1.0 / effective))
    return _ScoreMods(features, effective, args, dropout_args)


@dataclass(frozen=True)
class _Varlen:
    """Packed variable-length sequences of one call, as the kernels take them (varlen.cuh)."""

    cu_seqlens_q: object  # int32 CuPy arrays (batch + 1,)
    cu_seqlens_k: object
    total_q: int
    total_k: int

    @property
    def kernel_args(self) -> tuple:
        return (self.cu_seqlens_q, self.cu_seqlens_k, numpy.int32(self.total_q),
                numpy.int32(self.total_k))

    @property
    def stats_rows(self) -> int:
        """Rows per head of the backward's per-row arrays (varlen.cuh, stats_row0): each
        sequence's start moves VARLEN_STATS_GAP rows further, plus one padded block, rounded
        to 4."""
        batch = self.cu_seqlens_q.shape[0] - 1
        return -(-(self.total_q + _VARLEN_STATS_GAP * batch + _configs.BWD_ROW_PADDING) // 4) * 4


#: varlen.cuh's VARLEN_STATS_GAP.
_VARLEN_STATS_GAP = 132
#: Kernel arguments standing for "no varlen" (never read).
_DENSE = (None, None, numpy.int32(0), numpy.int32(0))


def _varlen_args(varlen) -> tuple:
    return _DENSE if varlen is None else varlen.kernel_args


def _check_slopes_device(alibi_slopes, device_id: int):
    if alibi_slopes is not None and alibi_slopes.device.id != device_id:
        raise ValueError(f"alibi_slopes is on device {alibi_slopes.device.id} but the current "
                         f"CuPy device is {device_id}")


def _element_strides(x) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements. Python ints reach the kernel as 64-bit values."""
    itemsize = x.itemsize
    s = x.strides
    return (s[0] // itemsize, s[1] // itemsize, s[2] // itemsize)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, return_lse=False, out=None):
    """Exact attention softmax(q k^T * scale) v with FlashAttention-2 kernels.

    q: (batch, seqlen_q, nheads, headdim), k and v: (batch, seqlen_k, nheads_kv, headdim), or
    the same without the batch dim; CuPy arrays of float16 or bfloat16 (ml_dtypes.bfloat16),
    headdim a multiple of 8 up to 256, nheads a multiple of nheads_kv (MQA/GQA), only the last
    dim contiguous. `causal` masks keys after the query, aligned to the bottom-right corner when
    seqlen_q != seqlen_k (row i sees keys j <= i + seqlen_k - seqlen_q). `window_size=(left,
    right)` restricts row i to keys i + seqlen_k - seqlen_q - left ... + right (sliding-window
    attention, -1 unbounded; key tiles outside the window are skipped). `softmax_scale`
    defaults to 1/sqrt(headdim). `softcap > 0` caps the scaled scores to
    softcap * tanh(scores / softcap) (0: off). `alibi_slopes`, a float32 CuPy array (nheads,) or
    (batch, nheads), adds the bias -slope * |i + seqlen_k - seqlen_q - j| to the scores of query
    i and key j (after softcap, before masking), as flash-attn. `dropout_p > 0` drops attention
    probabilities with a counter-based (Philox) mask drawn from `seed` (an int, required) and
    `offset`, the same in the backward; `cuflash2.dropout_mask` returns that mask. `out` receives
    the result if given.

    Returns `out` (shape and dtype of q), or `(out, lse)` with `return_lse=True`: lse is float32
    (batch, nheads, seqlen_q), the natural-log logsumexp of each row's scores as the softmax sees
    them (scaled, capped, biased; +inf, with out 0, for a row that sees no key). Runs on the
    current CuPy stream, without host syncs.
    """
    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    cupy = _require_cupy_arrays(
        arrays if alibi_slopes is None else {**arrays, "alibi_slopes": alibi_slopes})
    if not isinstance(causal, (bool, numpy.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    problem = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale, out=out)
    mods = _score_mods(problem, softcap, alibi_slopes, q, dropout_p, seed, offset)
    device_id = _check_device(arrays, cupy)
    _check_slopes_device(alibi_slopes, device_id)

    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)

    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=cupy.float32)
    as_batched = (lambda x: x) if problem.batched else (lambda x: x[None])
    _launch_forward(problem, as_batched(q), as_batched(k), as_batched(v), as_batched(out), lse,
                    window, device_id, mods=mods)
    if not return_lse:
        return out
    return out, (lse if problem.batched else lse[0])


def _launch_forward(problem, q, k, v, out, lse, window, device_id, config=None, mods=None,
                    varlen=None):
    """Launches the forward kernel on batched (b, s, h, d) views. `config` overrides the tile
    configuration (for tuning); by default the dispatcher picks it. `mods`: softcap / ALiBi.
    `varlen`: packed sequences (the views then have a zero batch stride, batch = sequences,
    seqlens = the maximum lengths)."""
    if problem.batch == 0 or problem.seqlen_q == 0 or problem.nheads == 0:
        return
    if mods is None:
        mods = _score_mods(problem, 0.0, None, q)
    if config is None:
        config = _configs.fwd_config(problem.dtype, problem.head_dim, device_arch(device_id))
    features = mods.features | (0 if varlen is None else _configs.FEATURE_VARLEN)
    config = _configs.with_features(config, features)
    i32 = numpy.int32
    _launch(config, device_id,
            (-(-problem.seqlen_q // config.block_m), problem.nheads, problem.batch),
            (q, k, v, out, lse, *_element_strides(q), *_element_strides(k),
             *_element_strides(v), *_element_strides(out), i32(problem.seqlen_q),
             i32(problem.seqlen_k), i32(problem.nheads), i32(problem.nheads // problem.nheads_kv),
             i32(problem.head_dim), numpy.float32(mods.softmax_scale),
             numpy.float32(mods.softmax_scale * _LOG2E), i32(window[0]), i32(window[1]),
             *mods.kernel_args, *_varlen_args(varlen), *mods.dropout_args))


def _launch(config, device_id, grid, args, cooperative=False):
    """Launches `config`'s kernel, slicing gridDim.z (the batch) into chunks of 65535.
    `cooperative`: all CTAs resident at once (their grid fits the GPU; the decode kernel's
    splits wait for each other)."""
    kernel = _compile.get_kernel(config, device_id)
    if cooperative:
        kernel = functools.partial(kernel.kernel, enable_cooperative_groups=True)  # its Function
    batch = grid[2]
    for batch_offset in range(0, batch, _MAX_GRID_Z):
        kernel((grid[0], grid[1], min(_MAX_GRID_Z, batch - batch_offset)), (config.threads,),
               (*args, numpy.int32(batch_offset)), shared_mem=config.smem_bytes)


def _backward_arrays(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, causal, deterministic):
    """A backward call's arrays by name (the given gradient buffers included; the slopes are
    checked to be a CuPy array but kept out, as their device is checked apart), and its flags
    checked. Returns (arrays, cupy)."""
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        if x is not None:
            arrays[name] = x
    extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
    cupy = _require_cupy_arrays({**arrays, **extra})
    if not isinstance(causal, (bool, numpy.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if not isinstance(deterministic, (bool, numpy.bool_)):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")
    return arrays, cupy


def _gradient_buffers(cupy, q, k, v, dq, dk, dv):
    """dq, dk, dv: the given buffers, or new arrays shaped like q, k, v."""
    return (cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq,
            cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk,
            cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                       seed=None, offset=0, deterministic=False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of `attention(q, k, v, causal=..., softmax_scale=..., ...)` for the
    output gradient `dout`, from the forward's `out` and `lse` (`return_lse=True`); pass the
    forward's causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed and
    offset.

    FlashAttention-2's backward: P is recomputed from lse, extra memory is O(seqlen) (an fp32 dq
    accumulator and two fp32 values per query row), never O(seqlen_q * seqlen_k). dq, dk, dv have
    the dtype and shapes of q, k, v (for GQA/MQA, dk and dv sum over the query heads sharing each
    KV head); `dq=`, `dk=`, `dv=` receive them if given. `deterministic=True` gives bitwise
    reproducible results (no floating-point atomics). Runs on the current CuPy stream.
    """
    arrays, cupy = _backward_arrays(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, causal,
                                    deterministic)
    problem = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale)
    _validate.check_backward_inputs(problem, dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    mods = _score_mods(problem, softcap, alibi_slopes, q, dropout_p, seed, offset)
    device_id = _check_device(arrays, cupy)
    _check_slopes_device(alibi_slopes, device_id)

    dq, dk, dv = _gradient_buffers(cupy, q, k, v, dq, dk, dv)
    b = (lambda x: x) if problem.batched else (lambda x: x[None])
    _launch_backward(problem, b(dout), b(q), b(k), b(v), b(out), b(lse), b(dq), b(dk), b(dv),
                     window, bool(deterministic), device_id, cupy, mods=mods)
    return dq, dk, dv


def _launch_backward(problem, dout, q, k, v, out, lse, dq, dk, dv, window, deterministic,
                     device_id, cupy, config=None, mods=None, varlen=None):
    """Launches the backward kernels on batched views. `config` overrides the main kernel's
    tile configuration (for tuning; its compute_dq must be `not deterministic`). `mods`:
    softcap / ALiBi. `varlen`: packed sequences, as in `_launch_forward`."""
    p = problem
    if p.batch == 0 or p.nheads == 0:
        return
    if mods is None:
        mods = _score_mods(p, 0.0, None, q)
    arch = device_arch(device_id)
    if config is None:
        config = _configs.bwd_config(p.dtype, p.head_dim, arch, deterministic)
    features = mods.features | (0 if varlen is None else _configs.FEATURE_VARLEN)
    config = _configs.with_features(config, features)
    pad = _configs.BWD_ROW_PADDING
    max_rows_padded = -(-p.seqlen_q // pad) * pad  # of one sequence
    if varlen is None:
        seqlen_q_padded = max_rows_padded
        stats_shape = (p.batch, p.nheads, seqlen_q_padded)
    else:  # (nheads, rows) with every sequence padded in place (varlen.cuh, stats_row0)
        seqlen_q_padded = varlen.stats_rows
        stats_shape = (p.nheads, seqlen_q_padded)
    delta = cupy.empty(stats_shape, dtype=cupy.float32)
    lse_log2 = cupy.empty_like(delta)
    # The fp32 dQ accumulator of the atomic path: O(seqlen_q * headdim), like the inputs.
    dq_accum = None if deterministic else cupy.zeros(
        (*stats_shape, config.head_dim), dtype=cupy.float32)
    varlen_args = _varlen_args(varlen)
    i32 = numpy.int32
    # The final dK / dQ scaling uses the softmax scale (d(scaled scores) / d(q.k)); P is
    # recomputed with the scale the softmax saw (softcap's, with softcap).
    scales = (numpy.float32(p.softmax_scale), numpy.float32(mods.softmax_scale * _LOG2E))
    if max_rows_padded:
        pre = _configs.AuxKernel(p.dtype, "flash_bwd_preprocess_kernel", varlen is not None)
        rows_per_cta = pre.threads // 32 * 8  # 8 warps, 8 rows a warp (flash_bwd_preprocess.cu)
        _launch(pre, device_id, (-(-max_rows_padded // rows_per_cta), p.nheads, p.batch),
                (dout, out, lse, delta, lse_log2, *_element_strides(dout),
                 *_element_strides(out), i32(p.seqlen_q), i32(seqlen_q_padded), i32(p.nheads),
                 i32(p.head_dim), varlen_args[0], varlen_args[2]))
    if p.seqlen_k:
        num_kv_blocks = -(-p.seqlen_k // config.block_n)
        _launch(config, device_id, (num_kv_blocks * config.num_chunks, p.nheads_kv, p.batch),
                (q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, *_element_strides(q),
                 *_element_strides(k), *_element_strides(v), *_element_strides(dout),
                 *_element_strides(dk), *_element_strides(dv), i32(p.seqlen_q),
                 i32(seqlen_q_padded), i32(p.seqlen_k), i32(p.nheads),
                 i32(p.nheads // p.nheads_kv), i32(p.head_dim), *scales, i32(window[0]),
                 i32(window[1]), *mods.kernel_args, *varlen_args, *mods.dropout_args))
    if deterministic:
        if p.seqlen_q:
            dq_config = _configs.with_features(_configs.bwd_dq_config(p.dtype, p.head_dim, arch),
                                               features)
            _launch(dq_config, device_id,
                    (-(-p.seqlen_q // dq_config.block_m), p.nheads, p.batch),
                    (q, k, v, dout, lse_log2, delta, dq, *_element_strides(q),
                     *_element_strides(k), *_element_strides(v), *_element_strides(dout),
                     *_element_strides(dq), i32(p.seqlen_q), i32(seqlen_q_padded),
                     i32(p.seqlen_k), i32(p.nheads), i32(p.nheads // p.nheads_kv),
                     i32(p.head_dim), *scales, i32(window[0]), i32(window[1]),
                     *mods.kernel_args, *varlen_args, *mods.dropout_args))
    elif p.seqlen_q:
        convert = _configs.AuxKernel(p.dtype, "flash_bwd_convert_dq_kernel", varlen is not None)
        chunks = p.seqlen_q * (p.head_dim // 8)
        _launch(convert, device_id, (-(-chunks // convert.threads), p.nheads, p.batch),
                (dq_accum, dq, *_element_strides(dq), i32(p.seqlen_q), i32(seqlen_q_padded),
                 i32(p.nheads), i32(p.head_dim), i32(config.head_dim),
                 numpy.float32(p.softmax_scale), varlen_args[0], varlen_args[2]))


def attention_vjp(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                  deterministic=False):
    """`(out, vjp)` like `jax.vjp`: runs the forward and returns `vjp(dout) -> (dq, dk, dv)`,
    which keeps the forward's lse (and out) internally."""
    if dropout_p and seed is None:  # the mask is kept inside, so a fresh seed will do
        seed = int.from_bytes(os.urandom(8), "little")
    out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         dropout_p=dropout_p, seed=seed, offset=offset, return_lse=True)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, seed=seed, offset=offset,
                                  deterministic=deterministic)

    return out, vjp


# ---------------------------------------------------------------------------------------------
# Packed inputs: views into one array, no copies (the kernels take any strides whose last dim is
# contiguous).


def _unpack(name: str, packed, parts: int):
    """(batch, seqlen, parts, nheads, headdim) -> `parts` strided views, batched or not."""
    _require_cupy_arrays({name: packed})
    if packed.ndim not in (4, 5) or packed.shape[-3] != parts:
        layout = "(batch, seqlen, {p}, nheads, headdim) or (seqlen, {p}, nheads, headdim)"
        raise ValueError(f"{name} must have shape {layout.format(p=parts)}; got "
                         f"{tuple(packed.shape)}")
    return tuple(packed[..., i, :, :] for i in range(parts))


def attention_qkvpacked(qkv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                        return_lse=False, out=None):
    """`attention` on q, k, v packed as qkv (batch, seqlen, 3, nheads, headdim), without copies."""
    q, k, v = _unpack("qkv", qkv, 3)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     dropout_p=dropout_p, seed=seed, offset=offset, return_lse=return_lse,
                     out=out)


def attention_kvpacked(q, kv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                       return_lse=False, out=None):
    """`attention` with k, v packed as kv (batch, seqlen_k, 2, nheads_kv, headdim)."""
    k, v = _unpack("kv", kv, 2)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     dropout_p=dropout_p, seed=seed, offset=offset, return_lse=return_lse,
                     out=out)


def _packed_gradient(name: str, given, packed):
    """The packed gradient array `name` (`given`, checked, or a new one shaped like `packed`)."""
    cupy = _cupy()
    if given is None:
        return cupy.empty(packed.shape, dtype=packed.dtype)
    if (not isinstance(given, cupy.ndarray) or given.shape != packed.shape
            or given.dtype != packed.dtype):
        like = "qkv" if name == "dqkv" else "kv"
        raise ValueError(f"{name} must be a cupy array shaped and typed like {like} "
                         f"{tuple(packed.shape)} {packed.dtype}")
    return given


def attention_qkvpacked_backward(dout, qkv, out, lse, *, causal=False, softmax_scale=None,
                                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                 dropout_p=0.0, seed=None, offset=0, deterministic=False,
                                 dqkv=None):
    """Gradient of `attention_qkvpacked`: dqkv shaped like qkv (written into `dqkv` if given)."""
    q, k, v = _unpack("qkv", qkv, 3)
    dqkv = _packed_gradient("dqkv", dqkv, qkv)
    dq, dk, dv = _unpack("dqkv", dqkv, 3)
    attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       dropout_p=dropout_p, seed=seed, offset=offset,
                       deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    return dqkv


def attention_kvpacked_backward(dout, q, kv, out, lse, *, causal=False, softmax_scale=None,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                dropout_p=0.0, seed=None, offset=0, deterministic=False,
                                dq=None, dkv=None):
    """Gradient of `attention_kvpacked`: (dq, dkv), dkv shaped like kv."""
    k, v = _unpack("kv", kv, 2)
    dkv = _packed_gradient("dkv", dkv, kv)
    dk, dv = _unpack("dkv", dkv, 2)
    dq, _, _ = attention_backward(dout, q, k, v, out, lse, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, seed=seed, offset=offset,
                                  deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    return dq, dkv


# ---------------------------------------------------------------------------------------------
# Variable-length sequences packed into (total_tokens, nheads, headdim): flash-attn's varlen
# interface. The kernels get zero-batch-stride views with one batch entry per sequence and read
# each sequence's rows from cu_seqlens (cuda_src/varlen.cuh); no padding token is computed.


def _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, out, check_cu_seqlens, cupy):
    """Checks a varlen call. Returns (problem of the packed arrays as one unbatched call,
    problem the kernels see: batch = sequences and the maximum lengths, _Varlen)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be packed (total_tokens, nheads, headdim) for varlen; "
                             f"got shape {tuple(x.shape)}")
    packed = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale, out=out)
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
    return packed, problem, _Varlen(cu_seqlens_q, cu_seqlens_k, packed.seqlen_q, packed.seqlen_k)


def _per_sequence(x, batch: int, cupy):
    """A (batch, total, nheads, headdim) view of a packed array with batch stride 0."""
    return cupy.broadcast_to(x[None], (batch, *x.shape))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, return_lse=False,
                     out=None, check_cu_seqlens=True):
    """`attention` on variable-length sequences packed one after another (flash-attn's
    `flash_attn_varlen_func`).

    q: (total_q, nheads, headdim), k and v: (total_k, nheads_kv, headdim); sequence b is rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] .. of k and v.
    cu_seqlens_q/k: int32 CuPy arrays (batch + 1,), 0 first, non-decreasing, ending at
    total_q/total_k. max_seqlen_q/k: ints, at least the longest sequence (they size the grid).
    Causal masks and windows are bottom-right aligned per sequence; alibi_slopes may be
    (batch, nheads), row b for sequence b. Returns out (total_q, nheads, headdim), or
    (out, lse) with lse float32 (nheads, total_q) as flash-attn.

    `check_cu_seqlens=True` copies cu_seqlens to the host to check their values and the max
    lengths: one device synchronisation. With False nothing is synchronised and bad values give
    undefined results (never out-of-bounds accesses: the kernels clamp to the packed lengths).
    """
    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
    cupy = _require_cupy_arrays({**arrays, **extra})
    if not isinstance(causal, (bool, numpy.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    packed, problem, varlen = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, softmax_scale, out, check_cu_seqlens,
                                            cupy)
    mods = _score_mods(problem, softcap, alibi_slopes, q, dropout_p, seed, offset)
    device_id = _check_device(arrays, cupy)
    _check_slopes_device(alibi_slopes, device_id)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.device.id != device_id:
            raise ValueError(f"{name} is on device {cu.device.id}, not the current device "
                             f"{device_id}")
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((packed.nheads, packed.seqlen_q), dtype=cupy.float32)
    b = problem.batch
    _launch_forward(problem, *(_per_sequence(x, b, cupy) for x in (q, k, v, out)), lse, window,
                    device_id, mods=mods, varlen=varlen)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, softmax_scale=None,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              dropout_p=0.0, seed=None, offset=0, deterministic=False, dq=None,
                              dk=None, dv=None, check_cu_seqlens=True):
    """Gradients (dq, dk, dv), packed like q, k, v, of `attention_varlen` (same arguments) for
    the output gradient dout (total_q, nheads, headdim), from its out and lse (nheads, total_q).
    As `attention_backward` otherwise."""
    arrays, cupy = _backward_arrays(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, causal,
                                    deterministic)
    packed, problem, varlen = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, softmax_scale, None, check_cu_seqlens,
                                            cupy)
    _validate.check_backward_inputs(packed, dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    mods = _score_mods(problem, softcap, alibi_slopes, q, dropout_p, seed, offset)
    device_id = _check_device(arrays, cupy)
    _check_slopes_device(alibi_slopes, device_id)

    dq, dk, dv = _gradient_buffers(cupy, q, k, v, dq, dk, dv)
    b = problem.batch
    seq = (lambda x: _per_sequence(x, b, cupy))
    _launch_backward(problem, seq(dout), seq(q), seq(k), seq(v), seq(out), lse, seq(dq), seq(dk),
                     seq(dv), window, bool(deterministic), device_id, cupy, mods=mods,
                     varlen=varlen)
    return dq, dk, dv


def dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, offset=0):
    """The dropout keep-mask that `attention(..., dropout_p=dropout_p, seed=seed, offset=offset)`
    applies, as a bool CuPy array (batch, nheads, seqlen_q, seqlen_k) (True = kept): for tests
    (`cuflash2.reference.attention(..., dropout_p=..., dropout_mask=mask)` reproduces the call)
    and small shapes, since it materialises every (query, key) pair. For varlen calls, pass the
    number of sequences and the maximum lengths; sequence b uses [b, :, :seqlen_q_b, :seqlen_k_b].
    """
    for name, value in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q),
                        ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    feature, args = _dropout_args(dropout_p, seed, offset)
    if not feature:
        raise ValueError("dropout_mask needs dropout_p > 0 (with dropout_p = 0 every element is "
                         "kept)")
    cupy = _cupy()
    mask = cupy.empty((batch, nheads, seqlen_q, seqlen_k), dtype=cupy.bool_)
    if mask.size == 0:
        return mask
    config = _configs.DropoutMaskKernel()
    blocks = -(-seqlen_q // 16) * -(-seqlen_k // 16)
    _launch(config, cupy.cuda.Device().id, (-(-blocks // config.blocks_per_cta), nheads, batch),
            (mask, numpy.int32(nheads), numpy.int32(seqlen_q), numpy.int32(seqlen_k),
             *args[:4]))
    return mask


# ---------------------------------------------------------------------------------------------
# Inference with a KV cache (flash-attn's flash_attn_with_kvcache): append the new tokens in place,
# then split-KV attention of the few query tokens over the cache (docs/DECODE_DESIGN.md).

_MAX_SPLITS = 128


def _check_num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic); got {num_splits!r}")
    return num_splits


@functools.lru_cache(maxsize=4096)
def _num_splits(requested: int, ctas: int, tiles: int, slots: int) -> int:
    """The KV split count for a grid of `ctas` CTAs (row blocks x KV heads x sequences) over
    `tiles` KV tiles, on a GPU that holds `slots` such CTAs at once (SMs x CTAs per SM).

    The splits of a row block wait for each other to merge their results, so a split grid must
    fit the GPU in one wave: at most slots // ctas splits, `requested` included. For 0 (auto):
    none if the grid already covers 80% of the slots; else the largest count that fits, among
    those that give every split the same number of tiles (others leave trailing splits short).
    Decoding is bound by reading the cache, and every resident CTA keeps reads in flight."""
    fit = max(1, min(slots // max(ctas, 1), _MAX_SPLITS, tiles))
    if requested == 0:
        if ctas >= 0.8 * slots:
            return 1
        return max(-(-tiles // -(-tiles // s)) for s in range(1, fit + 1))
    return max(1, min(requested, fit))


_counters: dict = {}


def _split_counters(groups: int, cupy):
    """The decode kernel's split barrier counters, two per row block (zero between launches: the
    last split to leave resets them). One buffer per (device, stream), since launches on one
    stream run in order and never share a counter; grown, zeroed, when a call needs more."""
    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.Device().id, stream.ptr)
    counters = _counters.get(key)
    if counters is None or counters.size < 2 * groups:
        counters = _counters[key] = cupy.zeros(max(2 * groups, 1024), dtype=cupy.int32)
    return counters


_slots_cache: dict = {}


def _decode_slots(config, device_id: int) -> int:
    """SMs x CTAs of `config`'s decode kernel resident per SM (the driver's occupancy: what a
    cooperative launch of the kernel allows)."""
    slots = _slots_cache.get((config, device_id))
    if slots is None:
        cupy = _cupy()
        kernel = _compile.get_kernel(config, device_id)
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, config.threads, config.smem_bytes)
        slots = _slots_cache[(config, device_id)] = max(1, per_sm) * cupy.cuda.Device(
            device_id).attributes["MultiProcessorCount"]
    return slots


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           num_splits=0, return_lse=False, check_cache=False):
    """Attention of q against a KV cache, for inference (flash-attn's `flash_attn_with_kvcache`).

    q: (batch, seqlen_q, nheads, headdim). Contiguous cache: k_cache, v_cache (batch_cache,
    seqlen_cache, nheads_kv, headdim), sequence b in row `cache_batch_idx[b]` (int32, default b).
    Paged cache: (num_blocks, page_size, nheads_kv, headdim) with `block_table` int32
    (batch, max_blocks): position p of sequence b is row p % page_size of block
    block_table[b, p // page_size]. `cache_seqlens`: int or int32 (batch,), the tokens already
    cached (default: the whole capacity). `k`, `v` (batch, seqlen_new, nheads_kv, headdim): new
    tokens, written into the cache **in place** at cache_seqlens[b] .. before the attention over
    the first cache_seqlens[b] + seqlen_new positions (causal / windows bottom-right aligned).
    `num_splits`: KV splits (0: chosen to fill the GPU; 1: none); partial results are merged
    with their lse in fp32. Returns out (shaped like q), or (out, lse (batch, nheads, seqlen_q)).

    No host synchronisation: values are not checked unless `check_cache=True` (one sync), and
    unchecked bad values never cause out-of-bounds accesses: positions past the capacity are
    neither written nor read, and a block id or cache row outside the cache reads as zeros and
    is not written.
    """
    key = None if check_cache else _kvcache_key(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
        causal, window_size, softcap, alibi_slopes, num_splits)
    plan = _kvcache_plans.get(key) if key is not None else None
    if plan is None:
        plan = _kvcache_plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                             block_table, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, num_splits, check_cache)
        if key is not None:
            if len(_kvcache_plans) >= _KVCACHE_PLANS_MAX:
                _kvcache_plans.clear()
            _kvcache_plans[key] = plan
    else:  # same signature as a checked call; the addresses are this call's own
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if x is not None:
                _check_aligned(name, x)
    return _kvcache_launch(plan, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                           block_table, alibi_slopes, return_lse)


@dataclass(frozen=True)
class _KVCachePlan:
    """What attention_with_kvcache derives from the shapes, dtypes, strides and devices of its
    arrays and from its other arguments, not from the arrays' contents: checked and worked out
    once per signature (`_kvcache_key`), then reused by calls of the same signature."""

    device_id: int
    config: object  # the decode kernel's _configs.DecodeConfig (features included)
    grid: tuple
    splits: int
    groups: int  # row blocks x KV heads x sequences: the split barriers
    out_shape: tuple
    lse_shape: tuple
    new_tokens: bool  # k, v hold tokens to append (else q stands in for their pointers)
    default_cache_len: int  # cache_seqlens=None: the whole capacity is cached
    strides: tuple  # element strides of q, k_new, v_new, k_cache, v_cache, out
    seqlen_new: object  # numpy.int32
    sizes: tuple  # the kernel's arguments from block_table's stride to the window
    softcap_scale: object  # numpy.float32
    alibi_args: tuple  # the slopes' batch stride and their scale to score units
    batch: object  # numpy.int32
    empty: bool  # no query row: nothing to launch


_KVCACHE_PLANS_MAX = 256
_kvcache_plans: dict = {}


def _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits):
    """The signature of an attention_with_kvcache call: for each array its shape, strides, dtype
    and device, and the other arguments with their types, on the current device; None where the
    call has no such signature (non-CuPy arguments, unhashable values): it is then checked in
    full, which reports what is wrong. An int cache_seqlens enters as "an int", its value being
    passed to the kernel per call."""
    cupy = _cupy()
    arrays = []
    for x in (q, k_cache, v_cache, k, v, cache_batch_idx, block_table, alibi_slopes,
              None if isinstance(cache_seqlens, numbers.Integral) else cache_seqlens):
        if x is None:
            arrays.append(None)
        elif type(x) is cupy.ndarray:
            arrays.append((x.shape, x.strides, x.dtype, x.data.device_id))
        else:
            return None
    if not isinstance(window_size, (tuple, list)):
        return None
    key = (cupy.cuda.runtime.getDevice(), tuple(arrays),
           type(cache_seqlens), type(softmax_scale), softmax_scale, type(causal), causal,
           tuple((type(w), w) for w in window_size), type(softcap), softcap, type(num_splits),
           num_splits)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _kvcache_plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                  softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
                  check_cache) -> _KVCachePlan:
    """Checks an attention_with_kvcache call in full (values too with `check_cache`) and works
    out its launch."""
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in (("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
                    ("cache_batch_idx", cache_batch_idx), ("block_table", block_table)):
        if x is not None:
            arrays[name] = x
    if cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Integral):
        arrays["cache_seqlens"] = cache_seqlens
    cupy = _require_cupy_arrays(arrays)
    if not isinstance(causal, (bool, numpy.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    num_splits = _check_num_splits(num_splits)
    kv = _validate.check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens,
                                        cache_batch_idx, block_table,
                                        cupy.asnumpy if check_cache else None)
    # q's own checks (dtype, head dim, strides, scale); the caches' shapes are kv's.
    problem = _validate.check_attention_inputs(q, q, q, softmax_scale=softmax_scale)
    for name in ("k_cache", "v_cache", "k", "v"):
        if name in arrays:
            _validate.check_strides(name, arrays[name])
    problem = dataclasses.replace(problem, nheads_kv=kv.nheads_kv, seqlen_k=kv.capacity)
    mods = _score_mods(problem, softcap, alibi_slopes, q)
    tensors = ("q", "k_cache", "v_cache", "k", "v")  # device and 16-byte alignment checked
    device_id = _check_device({n: x for n, x in arrays.items() if n in tensors}, cupy)
    for name, x in arrays.items():  # the slopes and int32 indices: device only
        if name not in tensors and x.device.id != device_id:
            raise ValueError(f"{name} is on device {x.device.id}, not the current device "
                             f"{device_id}")
    window = _validate.check_window(window_size, causal, kv.seqlen_q, kv.capacity)
    # The decode kernel (compiled here if need be) and its split count.
    config = _configs.with_features(
        _configs.decode_config(problem.dtype, kv.head_dim, device_arch(device_id)), mods.features)
    group = kv.nheads // kv.nheads_kv if kv.nheads_kv else 1
    m_blocks = -(-kv.seqlen_q * group // config.block_m)
    tiles = -(-kv.capacity // config.block_n)
    groups = m_blocks * kv.nheads_kv * kv.batch
    empty = kv.batch == 0 or kv.seqlen_q == 0 or kv.nheads == 0
    splits = 1 if empty else _num_splits(num_splits, groups, tiles,
                                         _decode_slots(config, device_id))
    tiles_per_split = -(-tiles // splits)
    splits = max(1, -(-tiles // tiles_per_split)) if tiles else 1
    i32 = numpy.int32
    new_tokens = k is not None and kv.seqlen_new > 0
    k_new, v_new = (k, v) if new_tokens else (q, q)
    table_stride = block_table.strides[0] // 4 if block_table is not None else 0
    return _KVCachePlan(
        device_id=device_id, config=config, grid=(m_blocks * splits, kv.nheads_kv, kv.batch),
        splits=splits, groups=groups, out_shape=tuple(q.shape),
        lse_shape=(kv.batch, kv.nheads, kv.seqlen_q), new_tokens=new_tokens,
        default_cache_len=kv.capacity - kv.seqlen_new,
        strides=(*_element_strides(q), *_element_strides(k_new), *_element_strides(v_new),
                 *_element_strides(k_cache), *_element_strides(v_cache),
                 *_contiguous_strides(q.shape)[:3]),  # out: a new array shaped like q
        seqlen_new=i32(kv.seqlen_new),
        sizes=(int(table_stride), i32(kv.page_size), i32(kv.num_blocks), i32(kv.capacity),
               i32(kv.seqlen_q), i32(kv.nheads), i32(group), i32(kv.head_dim), i32(m_blocks),
               i32(splits), i32(tiles_per_split), numpy.float32(mods.softmax_scale * _LOG2E),
               i32(window[0]), i32(window[1])),
        softcap_scale=mods.kernel_args[0], alibi_args=tuple(mods.kernel_args[2:]),
        batch=i32(kv.batch), empty=empty)


def _contiguous_strides(shape) -> tuple:
    """Element strides of a C-contiguous array of `shape` (as CuPy gives cupy.empty(shape))."""
    strides, size = [], 1
    for dim in reversed(shape):
        strides.append(size)
        size *= max(dim, 1)
    return tuple(reversed(strides))


def _kvcache_launch(plan, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                    block_table, alibi_slopes, return_lse):
    """Allocates the outputs and launches the decode kernel of a checked call."""
    cupy = _cupy()
    out = cupy.empty(plan.out_shape, dtype=q.dtype)
    lse = cupy.empty(plan.lse_shape, dtype=cupy.float32)
    if plan.empty:
        return (out, lse) if return_lse else out
    # An int (or no) cache_seqlens goes to the kernel as one length for every sequence.
    lengths, length_all = cache_seqlens, 0
    if cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral):
        length_all = plan.default_cache_len if cache_seqlens is None else int(cache_seqlens)
        if not -2**31 <= length_all < 2**31:
            raise ValueError(f"cache_seqlens must fit in int32; got {length_all}")
        lengths = None
    k_new, v_new = (k, v) if plan.new_tokens else (q, q)
    o_partial = lse_partial = counters = None
    if plan.splits > 1:  # fp32 workspace per (row block, split): O (padded head dim), then lse
        rows = plan.groups * plan.splits * plan.config.block_m
        workspace = cupy.empty(rows * (plan.config.head_dim + 1), dtype=cupy.float32)
        o_partial = workspace[:rows * plan.config.head_dim]
        lse_partial = workspace[rows * plan.config.head_dim:]
        counters = _split_counters(plan.groups, cupy)
    _launch(plan.config, plan.device_id, plan.grid,
            (q, k_cache, v_cache, k_new, v_new, out, lse, o_partial, lse_partial, counters,
             *plan.strides, lengths, numpy.int32(length_all), plan.seqlen_new, cache_batch_idx,
             block_table, *plan.sizes, plan.softcap_scale,
             q if alibi_slopes is None else alibi_slopes, *plan.alibi_args, plan.batch),
            cooperative=plan.splits > 1)
    return (out, lse) if return_lse else out
