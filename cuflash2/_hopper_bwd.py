"""Host side of the Hopper backward (cuda_src/flash_bwd_sm90.cu, docs/HOPPER_BWD.md).

Not dispatched: `cuflash2.attention_backward` keeps the mma.sync backward until the kernel has run
on a GPU. `prepare_backward_sm90` runs it on its own (benchmarks/dev/hopper_bwd_check.py), as
three launches on the current stream:

1. the existing preprocess (flash_bwd_preprocess.cu): D = rowsum(dO o O), lse in log2 units,
   both padded to whole 128-row blocks (+inf / 0), and the fp32 dQ accumulator zeroed;
2. the Hopper main kernel: dK, dV of each 128-key block, dQ added to the accumulator;
3. the existing conversion (flash_bwd_convert_dq.cu): dQ = softmax_scale * accumulator.

The preprocess and the conversion take `BwdParams`; the main kernel `BwdSm90Params`, which is
the same `BwdParams` after four tensor maps (q and dout with boxes of block_m rows, k and v of
block_n rows; _hopper.tensor_map_bytes). One set of field values fills both blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from . import _configs, _launch, _params
from ._hopper import tensor_map_bytes, _as_batched
from ._prepare import LOG2E, element_strides, output_strides


def _kernel_head_dim(head_dim: int) -> int:
    for d in _configs.SM90_BWD_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"the Hopper backward takes head dims up to "
                     f"{max(_configs.SM90_BWD_HEAD_DIMS)}, not {head_dim}")


def backward_fields(shapes: dict, strides: dict, *, seqlen_q_padded: int, kernel_dim: int,
                    softmax_scale: float, window, softcap: float = 0.0,
                    alibi_batch_stride: int = 0) -> dict:
    """The scalar BwdParams fields of a call: `shapes` (q, k as (batch, seqlen, heads, dim)),
    `strides` (element strides (batch, row, head) by prefix q, k, v, o, do, dq, dk, dv)."""
    batch, seqlen_q, nheads, head_dim = shapes["q"]
    seqlen_k, nheads_kv = shapes["k"][1], shapes["k"][2]
    effective = softcap if softcap > 0 else softmax_scale  # the scale the softmax saw
    fields = {"seqlen_q": seqlen_q, "seqlen_q_padded": seqlen_q_padded, "seqlen_k": seqlen_k,
              "nheads": nheads, "heads_per_kv_head": nheads // nheads_kv,
              "head_dim": head_dim, "accum_dim": kernel_dim,
              "softmax_scale": softmax_scale, "scale_log2": effective * LOG2E,
              "window_left": window[0], "window_right": window[1],
              "mods.softcap_scale": softmax_scale / softcap if softcap > 0 else 0.0,
              "mods.alibi_batch_stride": alibi_batch_stride,
              "mods.alibi_to_units": 1.0 / effective}
    for prefix, (s_batch, s_row, s_head) in strides.items():
        fields.update({f"{prefix}_batch_stride": s_batch, f"{prefix}_row_stride": s_row,
                       f"{prefix}_head_stride": s_head})
    return fields


@dataclass
class PreparedBackward:
    """One backward call on the Hopper kernel, laid out once: its outputs, workspace and the
    three launches. `run()` launches them on the current stream (again and again, for timing)."""

    dq: object
    dk: object
    dv: object
    workspace: tuple  # lse_log2, delta, dq_accum (kept alive with the blocks that point at them)
    launches: list  # (_launch.Launch, _params.ParamBlock, batch_offset slot)
    batched: bool
    config: _configs.BwdSm90Config

    def run(self):
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
        for launch, block, batch_slot in self.launches:
            _launch.run(launch, block, stream, batch_slot)
        if self.batched:
            return self.dq, self.dk, self.dv
        return self.dq[0], self.dk[0], self.dv[0]


def prepare_backward_sm90(dout, q, k, v, out, lse, *, causal: bool = False,
                          softmax_scale: float | None = None, window_size=(-1, -1),
                          softcap: float = 0.0, alibi_slopes=None,
                          config: _configs.BwdSm90Config | None = None) -> PreparedBackward:
    """Lays out the backward of attention on the Hopper kernel (sm_90a only): CuPy arrays
    (batch, seqlen, heads, headdim) or (seqlen, heads, headdim), fp16 or bf16, head dim a
    multiple of 8 up to 128 (run on the smallest of 64, 96, 128 that holds it), `out` and `lse`
    (batch, heads, seqlen_q) fp32 from the forward; GQA/MQA through fewer k/v heads (dk, dv
    have k's heads: the group's sums); causal and windows as cuflash2.attention; softcap and
    ALiBi slopes ((heads,) or (batch, heads), fp32) as there. No dropout, varlen or
    deterministic mode, and few checks: a development entry point, not the public API."""
    import cupy

    batched = q.ndim == 4
    q4, k4, v4 = _as_batched(q), _as_batched(k), _as_batched(v)
    out4, dout4 = _as_batched(out), _as_batched(dout)
    lse3 = lse if lse.ndim == 3 else lse[None]
    batch, seqlen_q, nheads, head_dim = q4.shape
    seqlen_k, nheads_kv = k4.shape[1], k4.shape[2]
    if any(x.dtype != q.dtype for x in (k, v, out, dout)) or q.dtype.name not in _configs.DTYPE_TAGS:
        raise TypeError("dout, q, k, v, out must all be float16 or all bfloat16")
    if k4.shape != v4.shape or k4.shape[0] != batch or k4.shape[3] != head_dim:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")
    if out4.shape != q4.shape or dout4.shape != q4.shape:
        raise ValueError("out and dout must have q's shape")
    if lse3.shape != (batch, nheads, seqlen_q) or lse.dtype != numpy.float32:
        raise ValueError(f"lse must be float32 (batch, heads, seqlen_q), not {lse.shape}")
    if head_dim % 8 or nheads % nheads_kv:
        raise ValueError(f"head dim {head_dim} or heads {nheads}/{nheads_kv} not covered")
    kernel_dim = _kernel_head_dim(head_dim)
    features = ((_configs.FEATURE_SOFTCAP if softcap > 0 else 0)
                | (_configs.FEATURE_ALIBI if alibi_slopes is not None else 0))
    if config is None:
        config = _configs.bwd_sm90_config(q.dtype.name, kernel_dim)
    config = _configs.with_features(config, features)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left, right = window_size
    if causal:
        right = 0
    device_id = q.device.id

    pad = _configs.BWD_ROW_PADDING
    seqlen_q_padded = -(-seqlen_q // pad) * pad
    stats_rows = batch * nheads * seqlen_q_padded
    lse_log2 = cupy.empty(stats_rows, dtype=cupy.float32)
    delta = cupy.empty(stats_rows, dtype=cupy.float32)
    dq_accum = cupy.empty(stats_rows * kernel_dim, dtype=cupy.float32)
    dq = cupy.empty(q4.shape, dtype=q.dtype)
    dk = cupy.empty(k4.shape, dtype=q.dtype)
    dv = cupy.empty(k4.shape, dtype=q.dtype)

    strides = {"q": element_strides(q4), "k": element_strides(k4), "v": element_strides(v4),
               "o": element_strides(out4), "do": element_strides(dout4),
               "dq": output_strides(dq.shape), "dk": output_strides(dk.shape),
               "dv": output_strides(dv.shape)}
    alibi_stride = 0
    if alibi_slopes is not None and alibi_slopes.ndim == 2:
        alibi_stride = alibi_slopes.shape[1]
    fields = backward_fields({"q": q4.shape, "k": k4.shape}, strides,
                             seqlen_q_padded=seqlen_q_padded, kernel_dim=kernel_dim,
                             softmax_scale=scale, window=(left, right), softcap=softcap,
                             alibi_batch_stride=alibi_stride)
    fields.update({"q": q4.data.ptr, "k": k4.data.ptr, "v": v4.data.ptr, "out": out4.data.ptr,
                   "dout": dout4.data.ptr, "lse": lse3.data.ptr, "lse_log2": lse_log2.data.ptr,
                   "delta": delta.data.ptr, "dq_accum": dq_accum.data.ptr, "dq": dq.data.ptr,
                   "dk": dk.data.ptr, "dv": dv.data.ptr,
                   "mods.alibi_slopes": alibi_slopes.data.ptr if alibi_slopes is not None else 0})

    aux_block = _params.ParamBlock("BwdParams", fields)
    main_block = _params.ParamBlock("BwdSm90Params", {f"base.{n}": v for n, v in fields.items()})
    for name, x, rows in (("q_map", q4, config.block_m), ("k_map", k4, config.block_n),
                          ("v_map", v4, config.block_n), ("do_map", dout4, config.block_m)):
        offset = main_block.layout.offsets[name]
        main_block.bytes[offset:offset + 128] = numpy.frombuffer(tensor_map_bytes(x, rows),
                                                                 numpy.uint8)

    launches = []
    if batch and nheads and seqlen_q and seqlen_k:
        aux_slot = aux_block.slot("batch_offset")
        pre = _configs.AuxKernel(q.dtype.name, "flash_bwd_preprocess_kernel")
        rows_per_cta = _configs.PREPROCESS_THREADS // 32 * _configs.PREPROCESS_ROWS_PER_WARP
        launches.append((_launch.kernel_launch(
            pre, device_id, (-(-seqlen_q_padded // rows_per_cta), nheads, batch)),
            aux_block, aux_slot))
        launches.append((_launch.kernel_launch(
            config, device_id, (-(-seqlen_k // config.block_n), nheads_kv, batch)),
            main_block, main_block.slot("base.batch_offset")))
        convert = _configs.AuxKernel(q.dtype.name, "flash_bwd_convert_dq_kernel")
        chunks = seqlen_q * (head_dim // 8)
        launches.append((_launch.kernel_launch(
            convert, device_id, (-(-chunks // convert.threads), nheads, batch)),
            aux_block, aux_slot))
    return PreparedBackward(dq, dk, dv, (lse_log2, delta, dq_accum), launches, batched, config)


def backward_sm90(dout, q, k, v, out, lse, **options):
    """dq, dk, dv on the Hopper backward kernel (prepare_backward_sm90's arguments)."""
    return prepare_backward_sm90(dout, q, k, v, out, lse, **options).run()
