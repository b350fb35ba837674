"""Plans of the attention forward and backward (dense, packed and varlen calls alike).

A builder gets a fully checked call: its arrays as the kernels see them (`views`, by the name of
their struct field) and, for each, where a later call of the same signature finds it (`sources`:
the position of its array in the call's input tuple and the byte offset of the view in it; a
packed qkv feeds q, k and v from one array). It asks `_dispatch` once which kernels run the
call (family, tiles, grid, schedule, and on sm_90 the tensor maps) and returns the
`_plans.Plan` of the call.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy

from . import _bias, _configs, _dispatch, _hopper, _launch, _params, _plans, _validate
from ._prepare import LOG2E, element_strides, output_strides


def _input_fields(views: dict, sources: dict) -> list:
    """(field, input position, byte offset) of every array given to the call."""
    fields = []
    for name, x in views.items():
        if x is None:
            continue
        pos, base = sources[name]
        fields.append((name, pos, x.data.ptr - base.data.ptr))
    return fields


def _stride_fields(prefix: str, strides, words=1) -> dict:
    """The struct's (batch, row, head) strides of an array, from its element strides, in
    units of `words` 16-bit words an element (a Fraction for e4m3's half word; its strides are
    whole 16-byte units)."""
    return {f"{prefix}_batch_stride": int(strides[0] * words),
            f"{prefix}_row_stride": int(strides[1] * words),
            f"{prefix}_head_stride": int(strides[2] * words)}


def _varlen_fields(varlen) -> dict:
    if varlen is None:
        return {}
    return {"varlen.total_q": varlen.total_q, "varlen.total_k": varlen.total_k}


def forward_plan(views: dict, sources: dict, problem, mods, window, device_id: int, arch: int,
                 out_shape, lse_shape, varlen=None, config=None, user_inputs=(),
                 block_input=None) -> _plans.Plan:
    """views, by struct field: q, k, v, out (None: allocated), mods.alibi_slopes, mods.sinks,
    varlen.cu_seqlens_q, varlen.cu_seqlens_k (None or missing where absent). Outputs: [out if
    not given, lse]. The kernel, its grid and on sm_90 its tensor maps are
    _dispatch.forward_kernel's choice: the Hopper kernel for every call it covers, the mma.sync
    kernel the others; `config` runs instead where given. With programmable modifiers
    (`mods.user_mods`; `user_inputs`: (input position, array) of each of their arrays, the mask's
    first) the mma.sync kernel's FwdModsParams: these FwdParams as `base`, then `user`, the
    arrays' addresses (per call) and element strides; with a block mask (`block_input`: (input
    position of its states, BlockMask); its ranges in the next one) its states in `blocks`
    (the mma.sync kernel) or its ranges in `ranges` (the Hopper kernel), checked against the
    kernel's tiles and the call (cuflash2.block_masks.check_for_call)."""
    p = problem
    features = mods.features | (0 if varlen is None else _configs.FEATURE_VARLEN)
    choice = _dispatch.forward_kernel(p, features, window, arch, views, varlen, device_id, config,
                                      mods.user_mods, _bias_tile(mods, user_inputs))
    config = choice.config
    block_fields = {}
    if block_input is not None:
        from . import block_masks as block_mask

        if varlen is not None:
            raise ValueError("block_mask: not with varlen batches yet (attention only)")
        if choice.hopper:  # the states' tiles make up the Hopper kernel's (BlockMaskNarrow)
            block_fields = block_mask.check_for_hopper(
                block_input[1], config.block_m, config.block_n, p.batch, p.nheads, p.seqlen_q,
                p.seqlen_k, device_id)
        else:
            block_mask.check_for_call(block_input[1], config.block_m, config.block_n, p.batch,
                                      p.nheads, p.seqlen_q, p.seqlen_k, device_id)
    q, k, v, out = views["q"], views["k"], views["v"], views["out"]
    # The kernels address q, k, v and out in 16-bit words (a float32 element is two, an e4m3
    # element half of one: its strides are whole 16-byte units, _validate.check_strides, and
    # its head dims multiples of 32). out's words are those of its own dtype (e4m3: 16-bit),
    # and so is head_dim_v, which the kernels read for O's row.
    words = Fraction(_configs.ELEMENT_BYTES[p.dtype], 2)
    out_dtype = _configs.OUTPUT_DTYPES[p.dtype]
    out_words = Fraction(_configs.ELEMENT_BYTES[out_dtype], 2)
    fields = {
        **_stride_fields("q", element_strides(q), words),
        **_stride_fields("k", element_strides(k), words),
        **_stride_fields("v", element_strides(v), words),
        **_stride_fields("o", element_strides(out) if out is not None
                         else output_strides(out_shape), out_words),
        "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "nheads": p.nheads,
        "heads_per_kv_head": p.nheads // p.nheads_kv if p.nheads_kv else 1,
        "head_dim": int(p.head_dim * words), "head_dim_v": int(p.head_dim_v * out_words),
        "softmax_scale": mods.softmax_scale,
        "scale_log2": mods.softmax_scale * LOG2E, "window_left": window[0],
        "window_right": window[1], **mods.fields(), **_varlen_fields(varlen)}
    outputs, output_fields = [], []
    if out is None:
        outputs.append((tuple(out_shape), q.dtype if out_dtype == p.dtype
                        else _validate.numpy_dtype(out_dtype)))
        output_fields.append(("out", 0, 0))
    output_fields.append(("lse", len(outputs), 0))
    outputs.append((tuple(lse_shape), "float32"))
    launches, counters = [], ()
    scratch, scratch_bytes = [], 0
    if config is not None and p.batch and p.seqlen_q and p.nheads:
        if choice.hopper and config.claims:
            counters = ("tile_counters",)
        if choice.scratch is not None:
            # K and V as the TF32 wgmmas take them (at "highest" both TF32 parts), in the call's
            # scratch, by the operand pass (flash_fwd_tf32_operands.cu); the forward's k_map and
            # v_map read them.
            shapes = choice.scratch
            itemsize = numpy.dtype(_dispatch.SCRATCH_DTYPES[config.dtype]).itemsize
            offsets, scratch_bytes = _plans.carve(
                [itemsize * math.prod(shape) for shape, *_ in shapes.values()])
            for (name, _), off in zip(shapes.items(), offsets):
                scratch += [(name, off), (f"{_dispatch.TF32_OPERAND_MAPS[name]}.v", off)]
            operands, grid = _dispatch.operand_pass(config, shapes)
            launches.append(_launch.kernel_launch(operands, device_id, grid))
        launches.append(_launch.kernel_launch(config, device_id, choice.grid))
    descale_inputs, descale_fields = _descale_fields(views, sources)
    inputs = _input_fields({n: x for n, x in views.items() if not n.startswith("descales.")},
                           sources)
    aligned = [(sources[n][0], n) for n in ("q", "k", "v", "out") if views[n] is not None]
    if mods.user_mods is not None and choice.hopper:
        # FwdSm90ModsParams: FwdSm90Params as `sm90`, then the modifiers' inputs.
        return _sm90_plan(device_id, "FwdSm90ModsParams", fields, choice.maps, choice.map_fields,
                          launches, inputs, outputs, output_fields, aligned=aligned,
                          own_fields=choice.grid_fields, counters=counters, prefix="sm90.",
                          extra_fields={**_user_fields(user_inputs), **block_fields,
                                        **(choice.bias_fields or {})},
                          extra_inputs=[(f"user.in{i}.data", pos, 0)
                                        for i, (pos, _) in enumerate(user_inputs)]
                          + ([("ranges.rows", block_input[0] + 1, 0)] if block_input else [])
                          # the bias map's address word, per call (the bias's own address)
                          + ([("bias_map.v", user_inputs[-1][0], 0)] if choice.bias_fields
                             else []))
    if mods.user_mods is not None:
        return _mods_plan(device_id, fields, launches, inputs, outputs, output_fields, aligned,
                          mods, user_inputs, block_input)
    if not choice.hopper:
        return _plans.Plan(device_id, "FwdParams", fields, launches, inputs, outputs,
                           output_fields, aligned=aligned, per_call=_dropout_slots(mods))
    # FwdSm90Params: the tensor maps of q, k, v, then the FwdParams above as `base`, then the
    # persistent grid's fields (and for float32 the scratch's).
    return _sm90_plan(device_id, "FwdSm90Params", fields, choice.maps, choice.map_fields,
                      launches, inputs, outputs, output_fields, scratch_bytes, aligned=aligned,
                      own_fields=choice.grid_fields, counters=counters,
                      own_workspace_fields=scratch, extra_fields=descale_fields,
                      extra_inputs=descale_inputs)


def _descale_fields(views: dict, sources: dict):
    """(per-call inputs, fields set once) of the FP8 forward's descale factors (views
    "descales.q", "descales.k", "descales.v": float32 arrays of shape (), (1,) or (batch,
    nheads_kv), checked; FwdSm90Params.descales): each one's address per call, its (batch, KV
    head) strides once (0 along a shared axis: fp8.descale_strides). ([], {}) without them."""
    from . import fp8

    inputs, fields = [], {}
    for name in ("q", "k", "v"):
        x = views.get(f"descales.{name}")
        if x is None:
            continue
        inputs.append((f"descales.{name}", sources[f"descales.{name}"][0], 0))
        batch_stride, head_stride = fp8.descale_strides(x)
        fields[f"descales.{name}_batch_stride"] = batch_stride
        fields[f"descales.{name}_head_stride"] = head_stride
    return inputs, fields


def _mods_plan(device_id: int, fields: dict, launches, inputs, outputs, output_fields, aligned,
               mods, user_inputs, block_input=None) -> _plans.Plan:
    """The plan of the forward with programmable modifiers: FwdModsParams, the FwdParams
    `fields`, `inputs` and `output_fields` under `base.`, and UserParams' slots in order
    (user.in<i>: the address of input i per call, its element strides once)."""
    base = "base."
    user = _user_fields(user_inputs)
    blocks = []
    if block_input is not None:  # BlockMaskStates: the states' address per call
        from . import block_masks as block_mask

        user.update(block_mask.states_fields(block_input[1]))
        blocks = [("blocks.states", block_input[0], 0)]
    return _plans.Plan(
        device_id, "FwdModsParams", {**{base + f: v for f, v in fields.items()}, **user},
        launches, [(base + f, pos, off) for f, pos, off in inputs]
        + [(f"user.in{i}.data", pos, 0) for i, (pos, _) in enumerate(user_inputs)] + blocks,
        outputs, [(base + f, i, off) for f, i, off in output_fields], aligned=aligned,
        per_call=tuple((f, base + f) for f in _dropout_slots(mods)),
        batch_offset=base + "batch_offset")


def _bias_tile(mods, user_inputs):
    """The bias's elements as the Hopper kernels' tiles read them (_bias.tile_array) where the
    call's score modifier is the bias alone (its array the last of `user_inputs`), else None."""
    if mods.user_mods is not None and _bias.is_bias_alone(mods.user_mods[1]):
        return _bias.tile_array(user_inputs[-1][1])
    return None


def _bias_grad_fields(bias_grad) -> dict:
    """BiasGrad's element strides (0 along the bias's broadcast dims) and whether CTAs share
    elements (atomics), of dbias's accumulator view; {} without it."""
    if bias_grad is None:
        return {}
    _, x = bias_grad
    strides = [s // x.itemsize for s in x.strides]
    accumulate = any(s == 0 and n > 1 for s, n in zip(strides[:2], x.shape[:2]))
    return {**{f"dbias.stride{j}": s for j, s in enumerate(strides)},
            "dbias.accumulate": int(accumulate)}


def _user_fields(user_inputs) -> dict:
    """UserParams' element strides (`user.in<i>.stride<j>`) of the modifiers' arrays."""
    from . import mods

    return mods.user_input_strides([x for _, x in user_inputs])


def _sm90_plan(device_id: int, struct: str, fields: dict, maps: dict, map_fields: dict,
               launches, inputs, outputs, output_fields, workspace_bytes: int = 0,
               workspace_fields=(), aligned=(), launch_structs=(), own_fields=None,
               counters=(), prefix: str = "", extra_fields=None,
               extra_inputs=(), own_workspace_fields=()) -> _plans.Plan:
    """The plan of an sm_90a kernel whose struct is tensor maps (`maps`: map field -> (view
    name, box rows); `map_fields`: their words, encoded once by the dispatch) followed by the
    sm_80 kernels' struct as `base`: `fields`, `inputs`, `output_fields` and `workspace_fields`
    are that struct's, moved under `base.`; `own_fields` are the sm_90a struct's own (the
    persistent forward grid's batch, the backward's dispatch groups). A call patches each map's
    address (its word 0, _hopper.ADDRESS_WORD) with its array's pointer like any other pointer
    of the struct. `counters`: own fields set to the stream's counters a call
    (_plans.stream_counters). `prefix`: where that sm_90a struct sits in `struct` ("sm90." in
    FwdSm90ModsParams), whose other fields are `extra_fields` (set once) and `extra_inputs`
    ((field, input position, byte offset), per call: the modifiers' arrays).
    `own_workspace_fields`: (field, byte offset) of the sm_90a struct's own set to the
    workspace's address per call (the TF32 forward's scratch arrays and their maps' address
    words)."""
    base = prefix + "base."
    # The inputs that patch each map's address word per call, from those of the arrays.
    map_inputs = [(f"{prefix}{field}.v", pos, off) for name, pos, off in inputs
                  for field, (source, _) in maps.items() if source == name]
    return _plans.Plan(
        device_id, struct,
        {**{base + f: v for f, v in fields.items()},
         **{prefix + f: v for f, v in map_fields.items()},
         **{prefix + f: v for f, v in (own_fields or {}).items()}, **(extra_fields or {})},
        launches, [(base + f, pos, off) for f, pos, off in inputs] + map_inputs
        + list(extra_inputs),
        outputs, [(base + f, i, off) for f, i, off in output_fields], workspace_bytes,
        [(base + f, off) for f, off in workspace_fields]
        + [(prefix + f, off) for f, off in own_workspace_fields], aligned,
        batch_offset=base + "batch_offset", launch_structs=launch_structs,
        counters=tuple(prefix + f for f in counters))


def _dropout_slots(mods) -> tuple:
    return tuple(f"dropout.{name}" for name in mods.dropout)


def backward_plan(views: dict, sources: dict, problem, mods, window, deterministic: bool,
                  device_id: int, arch: int, grad_shapes: dict, varlen=None,
                  config=None, user_inputs=(), bias_grad=None,
                  block_input=None) -> _plans.Plan:
    """views, by struct field: dout, q, k, v, out, lse, dq, dk, dv (None: allocated, in that
    order, shaped `grad_shapes[name]`), mods.alibi_slopes, mods.sinks, dsinks (with sinks; None:
    allocated, after the others, float32 (nheads,)), varlen.cu_seqlens_q/_k (None or missing
    where absent). Outputs: the gradients not given.

    Three launches (two in deterministic mode): the preprocess, the main kernel, the dQ
    conversion (deterministic: the dQ kernel); with sinks (FEATURE_SINKS) the sinks' gradient
    (flash_bwd_sinks.cu, one CTA a head) right after the preprocess, whose lse_log2 and D it
    reads. The main kernels take no FEATURE_SINKS: they recompute P from the lse, which counts
    the sink already. On sm_90 (unless CUFLASH2_HOPPER_BWD=0) the main
    kernel is the Hopper one for every call it covers (_dispatch.backward_kernels); the
    preprocess, conversion, workspace and every BwdParams field are the same, the struct is
    BwdSm90Params (tensor maps, then these BwdParams as `base`, which the preprocess and the
    conversion take). `config` forces the main kernel (a BwdSm90Config: the Hopper one).
    With programmable modifiers (`mods.user_mods`; `user_inputs`: (input position, array) of
    each of their arrays, the mask's first) on sm_90 a mask modifier alone, or the bias alone
    (as tiles; dbias from the dS tiles), runs on the Hopper kernel where the dispatch says so
    (BwdSm90ModsParams: BwdSm90Params as `sm90`, the modifiers' inputs, a block mask's columns,
    the bias's map); else the main and dQ kernels are the mma.sync *_mods
    kernels, the struct BwdModsParams: these BwdParams as `base` (which
    the preprocess and the conversion take), `user` as the forward's, and `score_scale`.
    `bias_grad`: (input position, array) of dbias's float32 accumulator as a (batch, nheads,
    seqlen_q, seqlen_k) view (cuflash2._bias), which the main kernel fills
    (FEATURE_BIAS_GRAD, BwdModsParams.dbias). `block_input`: (input position, BlockMask) of a
    block mask whose non-empty tiles the main kernel walks (FEATURE_BLOCK_MASK; its tiles
    whole multiples of the kernel's, block_masks.check_for_backward)."""
    p = problem
    sinks = views.get("mods.sinks") is not None
    features = _configs.backward_features(
        mods.features | (0 if varlen is None else _configs.FEATURE_VARLEN)
        | (0 if bias_grad is None else _configs.FEATURE_BIAS_GRAD))
    choice = _dispatch.backward_kernels(p, features, deterministic, arch, views, varlen, window,
                                        config, mods.user_mods, _bias_tile(mods, user_inputs))
    config, hopper = choice.config, choice.hopper
    pad = _configs.BWD_ROW_PADDING
    max_rows_padded = -(-p.seqlen_q // pad) * pad  # of one sequence
    if varlen is None:
        seqlen_q_padded = max_rows_padded
        stats_rows = p.batch * p.nheads * seqlen_q_padded
    else:  # (nheads, rows) with every sequence padded in place (varlen.cuh, stats_row0)
        seqlen_q_padded = varlen.stats_rows
        stats_rows = p.nheads * seqlen_q_padded
    # Scratch: lse in log2 units, D, and the fp32 dQ accumulator of the atomic path (zeroed by
    # the preprocess): O(seqlen_q * headdim), like the inputs. The Hopper kernel's deterministic
    # mode keeps the accumulator (its additions ordered) and adds its semaphore slots, one per
    # DQ_SEMAPHORE_ROWS rows.
    ordered = hopper and deterministic
    accumulate = ordered or not deterministic
    pieces = [4 * stats_rows, 4 * stats_rows]
    if accumulate:
        pieces.append(4 * stats_rows * config.head_dim)
    if ordered:
        pieces.append(4 * (stats_rows // _configs.DQ_SEMAPHORE_ROWS))
    offsets, workspace_bytes = _plans.carve(pieces)
    workspace_fields = [("lse_log2", offsets[0]), ("delta", offsets[1])]
    if accumulate:
        workspace_fields.append(("dq_accum", offsets[2]))
    if ordered:
        workspace_fields.append(("dq_semaphore", offsets[3]))

    outputs, output_fields, strides = [], [], {}
    for name, prefix in (("dq", "dq"), ("dk", "dk"), ("dv", "dv")):
        x = views[name]
        if x is None:
            output_fields.append((name, len(outputs), 0))
            outputs.append((tuple(grad_shapes[name]), views["q"].dtype))
            strides[prefix] = output_strides(grad_shapes[name])
        else:
            strides[prefix] = element_strides(x)
    if sinks and views.get("dsinks") is None:
        output_fields.append(("dsinks", len(outputs), 0))
        outputs.append(((p.nheads,), "float32"))
    # The kernels address dout, q, k, v, out and the gradients in 16-bit words (a float32
    # element is two); the dQ accumulator (accum_dim) counts elements.
    words = _configs.ELEMENT_WORDS[p.dtype]
    fields = {
        **_stride_fields("q", element_strides(views["q"]), words),
        **_stride_fields("k", element_strides(views["k"]), words),
        **_stride_fields("v", element_strides(views["v"]), words),
        **_stride_fields("o", element_strides(views["out"]), words),
        **_stride_fields("do", element_strides(views["dout"]), words),
        **{f: s for prefix, st in strides.items()
           for f, s in _stride_fields(prefix, st, words).items()},
        "batch": p.batch, "seqlen_q": p.seqlen_q, "seqlen_q_padded": seqlen_q_padded,
        "seqlen_k": p.seqlen_k, "nheads": p.nheads, "heads_per_kv_head": p.nheads // p.nheads_kv if p.nheads_kv else 1,
        "head_dim": p.head_dim * words, "head_dim_v": p.head_dim_v * words,
        "accum_dim": config.head_dim,
        # The final dK / dQ scaling uses the softmax scale (d(scaled scores) / d(q.k)); P is
        # recomputed with the scale the softmax saw (softcap's, with softcap).
        "softmax_scale": p.softmax_scale, "scale_log2": mods.softmax_scale * LOG2E,
        "window_left": window[0], "window_right": window[1], **mods.fields(),
        **_varlen_fields(varlen)}

    # (launch, the struct its kernel takes: "" the plan's, "base" the BwdParams inside
    # BwdSm90Params). The main kernel's grid: (key blocks x head-dim chunks, KV heads, batch);
    # the Hopper kernel's chunk is the whole head dim.
    launches = []
    aux = "base" if hopper or mods.user_mods is not None else ""
    # The small kernels read and write the arrays' dtype, whatever a float32 call's precision,
    # but for the preprocess, whose D takes dO as the products do (TF32-rounded at "tf32").
    aux_dtype = "float32" if p.dtype in _configs.FLOAT32_TAGS else p.dtype
    num_kv_blocks = -(-p.seqlen_k // config.block_n)
    if p.batch and p.nheads:
        if max_rows_padded:
            pre = _configs.AuxKernel(p.dtype, "flash_bwd_preprocess_kernel", varlen is not None)
            rows_per_cta = _configs.PREPROCESS_THREADS // 32 * _configs.PREPROCESS_ROWS_PER_WARP
            launches.append((_launch.kernel_launch(
                pre, device_id, (-(-max_rows_padded // rows_per_cta), p.nheads, p.batch)), aux))
    if sinks and p.nheads:  # dsinks is written even where there is no row (a sum of none: 0)
        sink_grad = _configs.AuxKernel(aux_dtype, "flash_bwd_sinks_kernel", varlen is not None)
        launches.append((_launch.kernel_launch(sink_grad, device_id, (p.nheads, 1, 1)), aux))
    if p.batch and p.nheads:
        if p.seqlen_k:
            launches.append((_launch.kernel_launch(
                config, device_id, (num_kv_blocks * config.num_chunks, p.nheads_kv, p.batch)),
                ""))
        if p.seqlen_q and not accumulate:
            dq_config = choice.dq_config
            launches.append((_launch.kernel_launch(
                dq_config, device_id, (-(-p.seqlen_q // dq_config.block_m), p.nheads, p.batch)),
                ""))
        elif p.seqlen_q:
            convert = _configs.AuxKernel(aux_dtype, "flash_bwd_convert_dq_kernel",
                                         varlen is not None)
            chunks = p.seqlen_q * (p.head_dim * words // 8)
            launches.append((_launch.kernel_launch(
                convert, device_id, (-(-chunks // convert.threads), p.nheads, p.batch)), aux))
    inputs = _input_fields(views, sources)
    aligned = [(sources[n][0], n) for n in ("dout", "q", "k", "v", "out", "dq", "dk", "dv")
               if views[n] is not None]
    kernels = [launch for launch, _ in launches]
    if mods.user_mods is not None and hopper:
        # BwdSm90ModsParams: BwdSm90Params as `sm90` (the aux kernels take its `base`), then
        # the modifiers' inputs, the block mask's columns (per call: block_input's third array)
        # and the bias's map.
        block_fields, columns = {}, []
        if block_input is not None:
            from . import block_masks as block_mask

            block_fields = block_mask.check_for_hopper_backward(
                block_input[1], p.batch, p.nheads, p.seqlen_q, p.seqlen_k, device_id)
            columns = [("columns.columns", block_input[0] + 2, 0)]
        return _sm90_plan(
            device_id, "BwdSm90ModsParams", fields, choice.maps, choice.map_fields, kernels,
            inputs, outputs, output_fields, workspace_bytes, workspace_fields, aligned,
            ["sm90.base" if struct == "base" else struct for _, struct in launches],
            own_fields={"dispatch_group_pairs": choice.group_pairs}, prefix="sm90.",
            extra_fields={**_user_fields(user_inputs), **block_fields,
                          **(choice.bias_fields or {}), **_bias_grad_fields(bias_grad)},
            extra_inputs=[(f"user.in{i}.data", pos, 0) for i, (pos, _) in enumerate(user_inputs)]
            + columns
            # the bias map's address word, per call (the bias's own address)
            + ([("bias_map.v", user_inputs[-1][0], 0)] if choice.bias_fields else [])
            + ([("dbias.data", bias_grad[0], 0)] if bias_grad is not None else []))
    if mods.user_mods is not None:
        base = "base."
        blocks, block_fields = [], {}
        if block_input is not None:  # BlockMaskStates: the states' address per call
            from . import block_masks as block_mask

            bm = block_input[1]
            block_fields = {**block_mask.states_fields(bm), **block_mask.check_for_backward(
                bm, config.block_m, config.block_n, p.batch, p.nheads, p.seqlen_q, p.seqlen_k,
                device_id)}
            blocks = [("blocks.states", block_input[0], 0)]
        return _plans.Plan(
            device_id, "BwdModsParams",
            {**{base + f: v for f, v in fields.items()}, **_user_fields(user_inputs),
             "score_scale": mods.softmax_scale, **_bias_grad_fields(bias_grad), **block_fields},
            kernels, [(base + f, pos, off) for f, pos, off in inputs]
            + [(f"user.in{i}.data", pos, 0) for i, (pos, _) in enumerate(user_inputs)]
            + ([("dbias.data", bias_grad[0], 0)] if bias_grad is not None else []) + blocks,
            outputs, [(base + f, i, off) for f, i, off in output_fields], workspace_bytes,
            [(base + f, off) for f, off in workspace_fields], aligned,
            per_call=tuple((f, base + f) for f in _dropout_slots(mods)),
            batch_offset=base + "batch_offset",
            launch_structs=[struct for _, struct in launches])
    if not hopper:
        return _plans.Plan(device_id, "BwdParams", fields, kernels, inputs, outputs,
                           output_fields, workspace_bytes, workspace_fields, aligned,
                           per_call=_dropout_slots(mods))
    return _sm90_plan(device_id, "BwdSm90Params", fields, choice.maps, choice.map_fields,
                      kernels, inputs, outputs, output_fields, workspace_bytes,
                      workspace_fields, aligned, [struct for _, struct in launches],
                      own_fields={"dispatch_group_pairs": choice.group_pairs})


# --------------------------------------------------------------------------------------------
# The Hopper backward on its own: the development entry point of benchmarks/dev/hopper_bwd_check.py

@dataclasses.dataclass
class PreparedBackward:
    """One backward call on the Hopper kernel, planned once (the plan the dispatcher would make
    for it) with its gradients allocated: `run()` runs the plan on the current stream, again and
    again for timing (the workspace comes from the plan's per-stream scratch)."""

    dq: object
    dk: object
    dv: object
    plan: object  # _plans.Plan
    inputs: tuple  # the plan's inputs: dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes

    @property
    def config(self) -> _configs.BwdSm90Config:
        """The main kernel's configuration (the plan's second launch)."""
        return self.plan.launches[1].config

    def run(self):
        self.plan.run(self.inputs, None)
        return self.dq, self.dk, self.dv


def prepare_backward_sm90(dout, q, k, v, out, lse, *, causal: bool = False,
                          softmax_scale: float | None = None, window_size=(-1, -1),
                          softcap: float = 0.0, alibi_slopes=None,
                          config: _configs.BwdSm90Config | None = None) -> PreparedBackward:
    """Lays out the backward of attention on the Hopper kernel (sm_90a only), whatever
    `_dispatch.HOPPER_BACKWARD` says: CuPy arrays (batch, seqlen, heads, headdim) or (seqlen, heads,
    headdim), fp16 or bf16, head dim a multiple of 8 up to 256 (run on the smallest of 64, 96,
    128, 192, 256 that holds it, or on `config`; above 128 two CTAs a key block, one per
    head-dim chunk), `out` and `lse` from the forward; GQA/MQA through fewer k/v heads (dk, dv
    have k's heads: the group's sums); causal and windows as cuflash2.attention; softcap and
    ALiBi slopes ((heads,) or (batch, heads), fp32) as there. Checked as
    `cuflash2.attention_backward` checks a call, and planned by the same code (`backward_plan`),
    so what runs here is what the dispatcher runs. No dropout, varlen or deterministic mode: a
    development entry point, not the public API."""
    import cupy

    from . import _prepare, _validate

    problem = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale)
    _validate.check_backward_inputs(problem, dout, q, k, v, out, lse)
    # raises where the kernel does not cover it
    kernel_dim = _dispatch.hopper_backward_head_dim(problem.head_dim)
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    from ._options import AttentionOptions

    mods = _prepare.score_mods(problem, AttentionOptions(softcap=softcap,
                                                         alibi_slopes=alibi_slopes))
    if config is None:
        config = _dispatch.bwd_sm90_config(problem.dtype, kernel_dim)
    dq = cupy.empty(q.shape, dtype=q.dtype)
    dk = cupy.empty(k.shape, dtype=k.dtype)
    dv = cupy.empty(v.shape, dtype=v.dtype)
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    inputs = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes)
    views = dict(zip(names, inputs))
    sources = {n: (i, x) for i, (n, x) in enumerate(zip(names, inputs))}
    sources["mods.alibi_slopes"] = (9, alibi_slopes)
    plan = backward_plan(
        {**views, "mods.alibi_slopes": alibi_slopes}, sources, problem, mods, window, False,
        q.device.id, 90, {"dq": q.shape, "dk": k.shape, "dv": v.shape}, config=config)
    return PreparedBackward(dq, dk, dv, plan, inputs)


def backward_sm90(dout, q, k, v, out, lse, **options):
    """dq, dk, dv on the Hopper backward kernel (prepare_backward_sm90's arguments)."""
    return prepare_backward_sm90(dout, q, k, v, out, lse, **options).run()


# --------------------------------------------------------------------------------------------
# The Hopper forward on its own: the development entry point of benchmarks/dev/hopper_fwd_check.py

@dataclasses.dataclass
class PreparedForward:
    """One forward call on the Hopper kernel, laid out once: its outputs and parameter block.
    `run()` launches it on the current stream (again and again, for timing)."""

    out: object
    lse: object
    launch: object  # _launch.Launch, or None for an empty problem
    block: _params.ParamBlock
    batched: bool

    def run(self):
        import cupy

        if self.launch is not None:
            _launch.run(self.launch, self.block, cupy.cuda.get_current_stream().ptr,
                        self.block.slot("base.batch_offset"))
        if self.batched:
            return self.out, self.lse
        return self.out[0], self.lse[0]


def prepare_forward_sm90(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                         window_size=(-1, -1),
                         config: _configs.FwdSm90Config | None = None,
                         persistent_ctas: int | None = None) -> PreparedForward:
    """Lays out attention on the Hopper forward kernel (sm_90a only): CuPy arrays (batch,
    seqlen, heads, headdim) or (seqlen, heads, headdim), fp16 or bf16, head dim a multiple of 8
    up to 256, run on the smallest kernel head dim (64, 96, 128, 192, 256) that holds it (the
    columns up to it are zero-filled by the TMA); GQA/MQA
    through fewer k/v heads; causal and windows as cuflash2.attention (bottom-right aligned).
    No score modifiers, dropout or varlen on this path yet, and few checks: this is a development
    entry point, not the public API. A `config` with `persistent` runs the persistent grid
    (_dispatch.persistent_schedule): a 1-D grid of at most one CTA per SM, or of at most
    `persistent_ctas` CTAs (testing: many work tiles per CTA on a small problem)."""
    import cupy

    batched = q.ndim == 4
    q4, k4, v4 = _hopper.as_batched(q), _hopper.as_batched(k), _hopper.as_batched(v)
    batch, seqlen_q, nheads, head_dim = q4.shape
    seqlen_k, nheads_kv = k4.shape[1], k4.shape[2]
    if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype.name not in _configs.DTYPE_TAGS:
        raise TypeError("q, k, v must all be float16 or all bfloat16")
    if k4.shape != v4.shape or k4.shape[0] != batch or k4.shape[3] != head_dim:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")
    if head_dim % 8 or head_dim > max(_configs.SM90_FWD_HEAD_DIMS) or nheads % nheads_kv:
        raise ValueError(f"head dim {head_dim} or heads {nheads}/{nheads_kv} not covered")
    device_id = q.device.id
    if config is None:
        kernel_dim = _dispatch.hopper_forward_head_dim(head_dim)
        config = _dispatch.fwd_sm90_config(q.dtype.name, kernel_dim)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left, right = window_size
    if causal:
        right = 0
    if config.persistent and _dispatch.dynamic_schedule(config.head_dim, seqlen_q, seqlen_k,
                                                          right):
        config = dataclasses.replace(config, claims=True)  # as the dispatcher would

    out4 = cupy.empty((batch, seqlen_q, nheads, head_dim), dtype=q.dtype)
    lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
    block = _params.ParamBlock("FwdSm90Params")
    for name, x, rows in (("q_map", q4, config.block_m), ("k_map", k4, config.block_n),
                          ("v_map", v4, config.block_n)):
        offset = block.layout.offsets[name]
        block.bytes[offset:offset + 128] = numpy.frombuffer(_hopper.tensor_map_bytes(x, rows),
                                                            numpy.uint8)
    fields = {"q": q4.data.ptr, "k": k4.data.ptr, "v": v4.data.ptr, "out": out4.data.ptr,
              "lse": lse.data.ptr, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
              "nheads": nheads, "heads_per_kv_head": nheads // nheads_kv, "head_dim": head_dim,
              "head_dim_v": head_dim, "softmax_scale": scale, "scale_log2": scale * LOG2E,
              "window_left": left,
              "window_right": right}
    for prefix, x in (("q", q4), ("k", k4), ("v", v4)):
        for axis, stride in zip(("batch", "row", "head"), element_strides(x)):
            fields[f"{prefix}_{axis}_stride"] = stride
    for axis, stride in zip(("batch", "row", "head"), output_strides(out4.shape)):
        fields[f"o_{axis}_stride"] = stride
    for name, value in fields.items():
        block.set(f"base.{name}", value)

    launch = None
    if batch and seqlen_q and nheads:
        grid, grid_fields = _dispatch.forward_grid(config, batch, nheads, nheads_kv, seqlen_q,
                                                   seqlen_k, head_dim, q.itemsize, right,
                                                   device_id, persistent_ctas)
        for name, value in grid_fields.items():
            block.set(name, value)
        if config.claims:  # the counters of the stream current now
            block.set("tile_counters", _plans.stream_counters.get(
                device_id, cupy.cuda.get_current_stream().ptr, cupy))
        launch = _launch.kernel_launch(config, device_id, grid)
    return PreparedForward(out4, lse, launch, block, batched)


def forward_sm90(q, k, v, **options):
    """out, lse of attention on the Hopper forward kernel (prepare_forward_sm90's arguments)."""
    return prepare_forward_sm90(q, k, v, **options).run()
