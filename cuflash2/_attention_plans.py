"""Plans of the attention forward and backward (dense, packed and varlen calls alike).

A builder gets a fully checked call: its arrays as the kernels see them (`views`, by the name of
their struct field) and, for each, where a later call of the same signature finds it (`sources`:
the position of its array in the call's input tuple and the byte offset of the view in it; a
packed qkv feeds q, k and v from one array). It returns the `_plans.Plan` of the call.
"""

from __future__ import annotations

import dataclasses

from . import _configs, _hopper, _hopper_bwd, _launch, _plans
from ._prepare import LOG2E, element_strides, output_strides

#: Tile configurations forced by tuning scripts (api._forced_config): "fwd" / "bwd" -> config.
FORCED: dict = {}


def _input_fields(views: dict, sources: dict) -> list:
    """(field, input position, byte offset) of every array given to the call."""
    fields = []
    for name, x in views.items():
        if x is None:
            continue
        pos, base = sources[name]
        fields.append((name, pos, x.data.ptr - base.data.ptr))
    return fields


def _stride_fields(prefix: str, strides) -> dict:
    return {f"{prefix}_batch_stride": strides[0], f"{prefix}_row_stride": strides[1],
            f"{prefix}_head_stride": strides[2]}


def _varlen_fields(varlen) -> dict:
    if varlen is None:
        return {}
    return {"varlen.total_q": varlen.total_q, "varlen.total_k": varlen.total_k}


def forward_plan(views: dict, sources: dict, problem, mods, window, device_id: int, arch: int,
                 out_shape, lse_shape, varlen=None, config=None) -> _plans.Plan:
    """views, by struct field: q, k, v, out (None: allocated), mods.alibi_slopes, mods.sinks,
    varlen.cu_seqlens_q, varlen.cu_seqlens_k (None or missing where absent). Outputs: [out if
    not given, lse]. On sm_90 the Hopper kernel runs every call it covers
    (_hopper.forward_config), the mma.sync kernel the others."""
    p = problem
    features = mods.features | (0 if varlen is None else _configs.FEATURE_VARLEN)
    hopper = None
    if config is None and "fwd" not in FORCED:
        hopper = _hopper.forward_config(p, features, window, arch, views, varlen)
    if hopper is not None:
        config = hopper
    else:
        if config is None:
            config = FORCED.get("fwd") or _configs.fwd_config(p.dtype, p.head_dim, arch)
        config = _configs.with_features(config, features)
    q, k, v, out = views["q"], views["k"], views["v"], views["out"]
    fields = {
        **_stride_fields("q", element_strides(q)), **_stride_fields("k", element_strides(k)),
        **_stride_fields("v", element_strides(v)),
        **_stride_fields("o", element_strides(out) if out is not None
                         else output_strides(out_shape)),
        "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "nheads": p.nheads,
        "heads_per_kv_head": p.nheads // p.nheads_kv if p.nheads_kv else 1,
        "head_dim": p.head_dim, "softmax_scale": mods.softmax_scale,
        "scale_log2": mods.softmax_scale * LOG2E, "window_left": window[0],
        "window_right": window[1], **mods.fields(), **_varlen_fields(varlen)}
    outputs, output_fields = [], []
    if out is None:
        outputs.append((tuple(out_shape), q.dtype))
        output_fields.append(("out", 0, 0))
    output_fields.append(("lse", len(outputs), 0))
    outputs.append((tuple(lse_shape), "float32"))
    launches, grid_fields, counters = [], {}, ()
    if p.batch and p.seqlen_q and p.nheads:
        grid = (-(-p.seqlen_q // config.block_m), p.nheads, p.batch)
        if hopper is not None:  # or the persistent grid, with fields of its own
            grid, grid_fields = _hopper.forward_grid(config, p.batch, p.nheads, p.nheads_kv,
                                                     p.seqlen_q, p.seqlen_k, p.head_dim,
                                                     q.itemsize, window[1], device_id)
            if config.claims:
                counters = ("tile_counters",)
        launches.append(_launch.kernel_launch(config, device_id, grid))
    inputs = _input_fields(views, sources)
    aligned = [(sources[n][0], n) for n in ("q", "k", "v", "out") if views[n] is not None]
    if hopper is None:
        return _plans.Plan(device_id, "FwdParams", fields, launches, inputs, outputs,
                           output_fields, aligned=aligned, per_call=_dropout_slots(mods))
    # FwdSm90Params: the tensor maps of q, k, v, then the FwdParams above as `base`.
    return _sm90_plan(device_id, "FwdSm90Params", fields, _hopper.forward_maps(config), views,
                      launches, inputs, outputs, output_fields, aligned=aligned,
                      own_fields=grid_fields, counters=counters)


def _sm90_plan(device_id: int, struct: str, fields: dict, maps: dict, views: dict, launches,
               inputs, outputs, output_fields, workspace_bytes: int = 0, workspace_fields=(),
               aligned=(), launch_structs=(), own_fields=None, counters=()) -> _plans.Plan:
    """The plan of an sm_90a kernel whose struct is tensor maps (`maps`: map field -> (view
    name, box rows)) followed by the sm_80 kernels' struct as `base`: `fields`, `inputs`,
    `output_fields` and `workspace_fields` are that struct's, moved under `base.`;
    `own_fields` are the sm_90a struct's own (the persistent forward grid's batch, the
    backward's dispatch groups). The maps are encoded here, once; a call patches each map's
    address (its word 0, _hopper.ADDRESS_WORD) with its array's pointer like any other pointer
    of the struct. `counters`: own fields set to the stream's counters a call
    (_plans.stream_counters)."""
    base = "base."
    return _plans.Plan(
        device_id, struct,
        {**{base + f: v for f, v in fields.items()}, **_hopper.tensor_map_fields(views, maps),
         **(own_fields or {})},
        launches,
        [(base + f, pos, off) for f, pos, off in inputs] + _hopper.map_inputs(inputs, maps),
        outputs, [(base + f, i, off) for f, i, off in output_fields], workspace_bytes,
        [(base + f, off) for f, off in workspace_fields], aligned,
        batch_offset=base + "batch_offset", launch_structs=launch_structs, counters=counters)


def _dropout_slots(mods) -> tuple:
    return tuple(f"dropout.{name}" for name in mods.dropout)


def _backward_main_config(problem, features: int, deterministic: bool, arch: int, views: dict,
                          varlen, config):
    """(main kernel configuration, whether it is the Hopper kernel's) of a backward call:
    `config` or a tuning script's forced one if given (a BwdSm90Config forces the Hopper
    kernel), else the Hopper kernel where _hopper_bwd.backward_config covers the call, else the
    mma.sync kernel's tile (_configs.bwd_config)."""
    p = problem
    forced = config if config is not None else FORCED.get("bwd")
    if isinstance(forced, _configs.BwdSm90Config):
        # BwdSm90Config refuses what the kernel does not compile in (dropout): ValueError here.
        forced = dataclasses.replace(forced, deterministic=deterministic)
        return _configs.with_features(forced, features), True
    hopper = None
    if forced is None:
        hopper = _hopper_bwd.backward_config(p, features, arch, views, varlen, deterministic)
    if hopper is not None:
        return hopper, True
    if forced is None:
        forced = _configs.bwd_config(p.dtype, p.head_dim, arch, deterministic)
    return _configs.with_features(forced, features), False


def backward_plan(views: dict, sources: dict, problem, mods, window, deterministic: bool,
                  device_id: int, arch: int, grad_shapes: dict, varlen=None,
                  config=None) -> _plans.Plan:
    """views, by struct field: dout, q, k, v, out, lse, dq, dk, dv (None: allocated, in that
    order, shaped `grad_shapes[name]`), mods.alibi_slopes, mods.sinks, dsinks (with sinks; None:
    allocated, after the others, float32 (nheads,)), varlen.cu_seqlens_q/_k (None or missing
    where absent). Outputs: the gradients not given.

    Three launches (two in deterministic mode): the preprocess, the main kernel, the dQ
    conversion (deterministic: the dQ kernel); with sinks (FEATURE_SINKS) the sinks' gradient
    (flash_bwd_sinks.cu, one CTA a head) right after the preprocess, whose lse_log2 and D it
    reads. The main kernels take no FEATURE_SINKS: they recompute P from the lse, which counts
    the sink already. On sm_90 (unless CUFLASH2_HOPPER_BWD=0) the main
    kernel is the Hopper one for every call it covers (_hopper_bwd.backward_config); the
    preprocess, conversion, workspace and every BwdParams field are the same, the struct is
    BwdSm90Params (tensor maps, then these BwdParams as `base`, which the preprocess and the
    conversion take). `config` forces the main kernel (a BwdSm90Config: the Hopper one)."""
    p = problem
    sinks = views.get("mods.sinks") is not None
    features = _configs.backward_features(
        mods.features | (0 if varlen is None else _configs.FEATURE_VARLEN))
    config, hopper = _backward_main_config(p, features, deterministic, arch, views, varlen,
                                           config)
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
    fields = {
        **_stride_fields("q", element_strides(views["q"])),
        **_stride_fields("k", element_strides(views["k"])),
        **_stride_fields("v", element_strides(views["v"])),
        **_stride_fields("o", element_strides(views["out"])),
        **_stride_fields("do", element_strides(views["dout"])),
        **{f: s for prefix, st in strides.items() for f, s in _stride_fields(prefix, st).items()},
        "batch": p.batch, "seqlen_q": p.seqlen_q, "seqlen_q_padded": seqlen_q_padded,
        "seqlen_k": p.seqlen_k, "nheads": p.nheads, "heads_per_kv_head": p.nheads // p.nheads_kv if p.nheads_kv else 1,
        "head_dim": p.head_dim, "accum_dim": config.head_dim,
        # The final dK / dQ scaling uses the softmax scale (d(scaled scores) / d(q.k)); P is
        # recomputed with the scale the softmax saw (softcap's, with softcap).
        "softmax_scale": p.softmax_scale, "scale_log2": mods.softmax_scale * LOG2E,
        "window_left": window[0], "window_right": window[1], **mods.fields(),
        **_varlen_fields(varlen)}

    # (launch, the struct its kernel takes: "" the plan's, "base" the BwdParams inside
    # BwdSm90Params). The main kernel's grid: (key blocks x head-dim chunks, KV heads, batch);
    # the Hopper kernel's chunk is the whole head dim.
    launches = []
    aux = "base" if hopper else ""
    num_kv_blocks = -(-p.seqlen_k // config.block_n)
    if p.batch and p.nheads:
        if max_rows_padded:
            pre = _configs.AuxKernel(p.dtype, "flash_bwd_preprocess_kernel", varlen is not None)
            rows_per_cta = _configs.PREPROCESS_THREADS // 32 * _configs.PREPROCESS_ROWS_PER_WARP
            launches.append((_launch.kernel_launch(
                pre, device_id, (-(-max_rows_padded // rows_per_cta), p.nheads, p.batch)), aux))
    if sinks and p.nheads:  # dsinks is written even where there is no row (a sum of none: 0)
        sink_grad = _configs.AuxKernel(p.dtype, "flash_bwd_sinks_kernel", varlen is not None)
        launches.append((_launch.kernel_launch(sink_grad, device_id, (p.nheads, 1, 1)), aux))
    if p.batch and p.nheads:
        if p.seqlen_k:
            launches.append((_launch.kernel_launch(
                config, device_id, (num_kv_blocks * config.num_chunks, p.nheads_kv, p.batch)),
                ""))
        if p.seqlen_q and not accumulate:
            dq_config = _configs.with_features(
                _configs.bwd_dq_config(p.dtype, p.head_dim, arch), features)
            launches.append((_launch.kernel_launch(
                dq_config, device_id, (-(-p.seqlen_q // dq_config.block_m), p.nheads, p.batch)),
                ""))
        elif p.seqlen_q:
            convert = _configs.AuxKernel(p.dtype, "flash_bwd_convert_dq_kernel",
                                         varlen is not None)
            chunks = p.seqlen_q * (p.head_dim // 8)
            launches.append((_launch.kernel_launch(
                convert, device_id, (-(-chunks // convert.threads), p.nheads, p.batch)), aux))
    inputs = _input_fields(views, sources)
    aligned = [(sources[n][0], n) for n in ("dout", "q", "k", "v", "out", "dq", "dk", "dv")
               if views[n] is not None]
    kernels = [launch for launch, _ in launches]
    if not hopper:
        return _plans.Plan(device_id, "BwdParams", fields, kernels, inputs, outputs,
                           output_fields, workspace_bytes, workspace_fields, aligned,
                           per_call=_dropout_slots(mods))
    group_pairs = _hopper_bwd.dispatch_group_pairs(num_kv_blocks, config.num_chunks, window,
                                                   deterministic)
    return _sm90_plan(device_id, "BwdSm90Params", fields, _hopper_bwd.backward_maps(config),
                      views, kernels, inputs, outputs, output_fields, workspace_bytes,
                      workspace_fields, aligned, [struct for _, struct in launches],
                      own_fields={"dispatch_group_pairs": group_pairs})


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
    `_hopper_bwd.ENABLED` says: CuPy arrays (batch, seqlen, heads, headdim) or (seqlen, heads,
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
    kernel_dim = _hopper_bwd.kernel_head_dim(problem.head_dim)
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    from ._options import AttentionOptions

    mods = _prepare.score_mods(problem, AttentionOptions(softcap=softcap,
                                                         alibi_slopes=alibi_slopes))
    if config is None:
        config = _configs.bwd_sm90_config(problem.dtype, kernel_dim)
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
