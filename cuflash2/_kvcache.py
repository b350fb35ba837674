"""attention_with_kvcache: append the new tokens in place, then split-KV attention of the few
query tokens over the cache, in one kernel (cuda_src/flash_decode.cu; docs/DECODE_DESIGN.md).

A call signature is checked and planned once (`_plans`); the decode kernel and its split count
are `_dispatch.decode_kernel`'s choice (from the kernel's occupancy), and the splits of a row
block meet at a barrier in per-stream counters.
"""

from __future__ import annotations

import dataclasses
import numbers

from . import _configs, _dispatch, _hopper, _launch, _plans, _prepare, _validate, fp8
from ._prepare import LOG2E, element_strides, output_strides


_plans_by_key = _plans.PlanCache()
_cupy = None


def _is_int(x) -> bool:
    return type(x) is int or isinstance(x, numbers.Integral)


def check_num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic); got {num_splits!r}")
    return num_splits


#: The decode kernel's split barrier counters, one per row block (never reset: each barrier flips
#: its top bit, split_merge.cuh), a buffer per (device, stream).
_split_counters = _plans.StreamCounters(1024)


def split_counters(groups: int, device_id: int, stream_ptr: int, cupy) -> int:
    """The address of the stream's split barrier counters, at least `groups` of them."""
    return _split_counters.get(device_id, stream_ptr, cupy, groups)


class CacheOptions:
    """attention_with_kvcache's rotary_cos, rotary_sin, rotary_interleaved and cache_leftpad, as
    given (unchecked): one object a call, NO_CACHE_OPTIONS where none is given. The arrays'
    signatures and rotary_interleaved enter the call's signature key; the arrays' addresses go
    to the kernel per call."""

    __slots__ = ("rotary_cos", "rotary_sin", "rotary_interleaved", "cache_leftpad")

    def __init__(self, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                 cache_leftpad=None):
        self.rotary_cos = rotary_cos
        self.rotary_sin = rotary_sin
        self.rotary_interleaved = rotary_interleaved
        self.cache_leftpad = cache_leftpad


NO_CACHE_OPTIONS = CacheOptions()


@dataclasses.dataclass
class KVCachePlan:
    """A checked attention_with_kvcache signature: its Plan, and what a call adds to it."""

    plan: _plans.Plan
    splits: int
    groups: int  # row blocks x KV heads x sequences: the split barriers
    default_cache_len: int  # cache_seqlens=None: the whole capacity is cached
    barrier: bool  # the splits meet at the barrier through L2 (split counters per stream)
    unit_descale: object = None  # an FP8 cache's factor where none is given: a float32 1 on device


def _key(cupy, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
         options, num_splits, early_cache_reads, fp8_args=(None, None, None),
         cache_options=NO_CACHE_OPTIONS):
    """The signature of a call (as api._forward_key; `options`: its _options.AttentionOptions);
    None where it has none (checked in full then). An int cache_seqlens enters as "an int", its
    value going to the kernel per call."""
    ndarray = cupy.ndarray
    key = [type(cache_seqlens)]
    if type(cache_seqlens) is ndarray:
        key.append((cache_seqlens.shape, cache_seqlens.strides, cache_seqlens.dtype,
                    cache_seqlens.data.device_id))
    elif cache_seqlens is not None and not _is_int(cache_seqlens):
        return None
    kv_cache_dtype, k_descale, v_descale = fp8_args
    c = cache_options
    arrays = (q, k_cache, v_cache, k, v, cache_batch_idx, block_table, options.alibi_slopes,
              options.sinks, k_descale, v_descale, c.rotary_cos, c.rotary_sin, c.cache_leftpad)
    if not _plans.add_signature(key, ndarray, arrays, options.window_size):
        return None
    key += (type(c.rotary_interleaved), c.rotary_interleaved)
    if kv_cache_dtype is not None and type(kv_cache_dtype) is not str:
        return None
    key.append(kv_cache_dtype)
    # The current device once the arrays are CuPy ones (api._forward_key says why).
    o = options  # its scalar options with their types (seed and offset: per call)
    key += (cupy.cuda.runtime.getDevice(), type(o.causal), o.causal, type(o.softmax_scale),
            o.softmax_scale, type(o.softcap), o.softcap, type(o.dropout_p), o.dropout_p,
            type(num_splits), num_splits, type(early_cache_reads), early_cache_reads)
    return tuple(key)


def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                           block_table, options, num_splits, return_lse, check_cache,
                           early_cache_reads, fp8_args=(None, None, None),
                           cache_options=NO_CACHE_OPTIONS):
    """api.attention_with_kvcache, its options (causal, softmax_scale, window_size, softcap,
    alibi_slopes, sinks) as one _options.AttentionOptions; `fp8_args`: (kv_cache_dtype,
    k_descale, v_descale); `cache_options`: its rotary and cache_leftpad (CacheOptions)."""
    global _cupy
    if _cupy is None:  # the first call: NumPy arrays get their hint before CuPy is imported
        _prepare.require_cupy_arrays({"q": q, "k_cache": k_cache, "v_cache": v_cache},
                                     "attention_with_kvcache")
    cupy = _cupy or _prepare.cupy_module()
    _cupy = cupy
    key = None if check_cache else _key(
        cupy, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, options,
        num_splits, early_cache_reads, fp8_args, cache_options)
    planned = _plans_by_key.get(key)
    if planned is None:
        planned = _plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                        options, num_splits, check_cache, early_cache_reads, fp8_args,
                        cache_options)
        _plans_by_key.put(key, planned)
    # An int (or no) cache_seqlens goes to the kernel as one length for every sequence (the
    # signature holds its type, and its first call was checked in full).
    length_all = 0
    if type(cache_seqlens) is not cupy.ndarray:
        length_all = planned.default_cache_len if cache_seqlens is None else int(cache_seqlens)
        if not -2**31 <= length_all < 2**31:
            raise ValueError(f"cache_seqlens must fit in int32; got {length_all}")
        cache_seqlens = None
    scalars = {"cache_len_all": length_all}
    stream = cupy.cuda.get_current_stream().ptr
    if planned.barrier:
        scalars["split_counters"] = split_counters(planned.groups, planned.plan.device_id,
                                                   stream, cupy)
    _, k_descale, v_descale = fp8_args
    unit = planned.unit_descale
    outputs = planned.plan.run((q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                block_table, options.alibi_slopes, options.sinks,
                                unit if k_descale is None else k_descale,
                                unit if v_descale is None else v_descale,
                                cache_options.rotary_cos, cache_options.rotary_sin,
                                cache_options.cache_leftpad), cupy,
                               scalars, wrap=2 if return_lse else 1, stream=stream)
    return tuple(outputs) if return_lse else outputs[0]


def _plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, options,
          num_splits, check_cache, early_cache_reads, fp8_args,
          cache_options=NO_CACHE_OPTIONS) -> KVCachePlan:
    """Checks a call in full (values too with `check_cache`) and plans its launch."""
    kv_cache_dtype, k_descale, v_descale = fp8_args
    c = cache_options
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in (("k", k), ("v", v), ("alibi_slopes", options.alibi_slopes),
                    ("sinks", options.sinks), ("cache_batch_idx", cache_batch_idx),
                    ("block_table", block_table), ("k_descale", k_descale),
                    ("v_descale", v_descale), ("rotary_cos", c.rotary_cos),
                    ("rotary_sin", c.rotary_sin), ("cache_leftpad", c.cache_leftpad)):
        if x is not None:
            arrays[name] = x
    if cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Integral):
        arrays["cache_seqlens"] = cache_seqlens
    cupy = _prepare.require_cupy_arrays(arrays, "attention_with_kvcache")
    _prepare.check_flag("causal", options.causal)
    _prepare.check_flag("early_cache_reads", early_cache_reads)
    num_splits = check_num_splits(num_splits)
    cache_format = fp8.cache_format(q, k_cache, v_cache, k, kv_cache_dtype, k_descale, v_descale)
    kv = _validate.check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens,
                                        cache_batch_idx, block_table,
                                        cupy.asnumpy if check_cache else None,
                                        kv_cache_dtype=cache_format)
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        error = descale is not None and fp8.descale_shape_error(name, descale, kv.batch,
                                                                 kv.nheads_kv)
        if error:
            raise ValueError(error)
        if check_cache and descale is not None:
            fp8.check_descale_values(name, cupy.asnumpy(descale))
    latent = kv.head_dim_v != kv.head_dim  # MLA's latent cache (docs/MLA_DECODE.md)
    if latent:
        check_latent_call(q, k_cache, v_cache, k, v, kv, options, cache_format, c)
    # q's own checks (dtype, head dim, strides, scale); the caches' shapes are kv's.
    problem = _validate.check_attention_inputs(
        q, q, q, softmax_scale=options.softmax_scale,
        max_head_dim=_configs.MLA_HEAD_DIM if latent else _validate.MAX_HEAD_DIM)
    if problem.dtype == "float32":
        raise NotImplementedError("attention_with_kvcache: float32 q has no decoding kernel yet; "
                                  "q, k_cache, v_cache must be float16 or bfloat16")
    for name in ("k_cache", "v_cache", "k", "v"):
        if name in arrays:
            _validate.check_strides(name, arrays[name])
    problem = dataclasses.replace(problem, nheads_kv=kv.nheads_kv, seqlen_k=kv.capacity)
    mods = _prepare.score_mods(problem, options)
    tensors = {n: x for n, x in arrays.items() if n in ("q", "k_cache", "v_cache", "k", "v")}
    others = {n: x for n, x in arrays.items() if n not in tensors}
    device_id = _prepare.check_device(tensors, others, cupy)
    window = _validate.check_window(options.window_size, options.causal, kv.seqlen_q,
                                    kv.capacity)
    # Rotary and cache_leftpad (flash-attn's rules; docs/ROTARY.md): the kernel's own features.
    rotary = _validate.check_rotary(c.rotary_cos, c.rotary_sin, q.dtype, kv.head_dim,
                                    kv.capacity, k is not None)
    _validate.check_cache_leftpad(c.cache_leftpad, kv.batch, kv.paged)
    per_row = _validate.rotary_positions_per_row(options.causal, options.window_size,
                                                 kv.capacity)
    features = mods.features
    if rotary is not None:
        _prepare.check_flag("rotary_interleaved", c.rotary_interleaved)
        for name in ("rotary_cos", "rotary_sin"):
            x = arrays[name]
            if x.strides[1] != x.itemsize or (x.shape[0] > 1
                                               and x.strides[0] != x.shape[1] * x.itemsize):
                raise ValueError(f"{name} must be C-contiguous (rows of rotary_dim / 2 "
                                 f"elements); got strides {x.strides}")
        features |= _configs.FEATURE_ROTARY
    if c.cache_leftpad is not None:
        if kv.batch > 1 and c.cache_leftpad.strides != (4,):
            raise ValueError(f"cache_leftpad must be contiguous; got strides "
                             f"{c.cache_leftpad.strides}")
        features |= _configs.FEATURE_LEFTPAD
    if check_cache:
        _validate.check_kvcache_extra_values(kv, cache_seqlens, c.cache_leftpad, rotary,
                                             per_row, cupy.asnumpy)
    # The decode kernel (compiled here if need be) and its split count.
    arch = _prepare.device_arch(device_id)
    if latent:
        check_latent_device(arch, window)
        choice = _dispatch.mla_decode_kernel(kv, problem.dtype, device_id, num_splits)
    else:
        choice = _dispatch.decode_kernel(kv, problem.dtype, features, arch, device_id,
                                         num_splits, early_cache_reads, cache_format)
    config, splits, cluster = choice.config, choice.splits, choice.cluster
    m_blocks, groups = choice.m_blocks, choice.groups
    group = kv.nheads // kv.nheads_kv if kv.nheads_kv else 1
    empty = kv.batch == 0 or kv.seqlen_q == 0 or kv.nheads == 0
    chosen_tiles = -(-kv.capacity // config.block_n)  # of the tile chosen
    tiles_per_split = -(-chosen_tiles // splits)
    new_tokens = k is not None and kv.seqlen_new > 0
    table_stride = block_table.strides[0] // 4 if block_table is not None else 0

    def strides(prefix, x):
        s = element_strides(x) if x is not None else (0, 0, 0)
        return {f"{prefix}_batch_stride": s[0], f"{prefix}_row_stride": s[1],
                f"{prefix}_head_stride": s[2]}

    # (the output's own shape: a latent call's rows have V's head dim, not q's)
    out_strides = output_strides(tuple(q.shape[:-1]) + (kv.head_dim_v,) if latent else q.shape)
    fields = {
        **strides("q", q), **strides("kn", k if new_tokens else None),
        **strides("vn", v if new_tokens else None), **strides("kc", k_cache),
        **strides("vc", v_cache), "o_batch_stride": out_strides[0],
        "o_row_stride": out_strides[1], "o_head_stride": out_strides[2],
        "block_table_stride": table_stride, "seqlen_new": kv.seqlen_new,
        "page_size": kv.page_size, "num_blocks": kv.num_blocks, "capacity": kv.capacity,
        "seqlen_q": kv.seqlen_q, "nheads": kv.nheads, "heads_per_kv_head": group,
        "head_dim": kv.head_dim, "num_m_blocks": m_blocks, "num_splits": splits,
        "tiles_per_split": tiles_per_split,
        "split_cluster": int(cluster > 1 and not latent),  # (the MLA kernel's pairs: its own)
        "scale_log2": mods.softmax_scale * LOG2E, "window_left": window[0],
        "window_right": window[1], **mods.fields(),
        "rotary_dim": rotary[0] if rotary else 0, "seqlen_ro": rotary[1] if rotary else 0,
        "rotary_interleaved": int(bool(c.rotary_interleaved)) if rotary else 0,
        "rotary_q_per_row": int(per_row) if rotary else 0}
    unit_descale = None
    if cache_format is not None:  # the factors' (batch, KV head) strides, 0 where shared
        unit_descale = fp8.unit_descale(cupy)
        for prefix, descale in (("kd", k_descale), ("vd", v_descale)):
            strides = fp8.descale_strides(unit_descale if descale is None else descale)
            fields[f"{prefix}_batch_stride"], fields[f"{prefix}_head_stride"] = strides
    # Pointer fields by position in the call's input tuple; an int or absent cache_seqlens leaves
    # its field null (the kernel then reads cache_len_all).
    given = {"cache_seqlens": 5 if "cache_seqlens" in arrays else None,
             "cache_batch_idx": 6 if cache_batch_idx is not None else None,
             "block_table": 7 if block_table is not None else None,
             "mods.alibi_slopes": 8 if options.alibi_slopes is not None else None,
             "mods.sinks": 9 if options.sinks is not None else None,
             "k_new": 3 if new_tokens else None, "v_new": 4 if new_tokens else None,
             "k_descale": 10 if cache_format is not None else None,
             "v_descale": 11 if cache_format is not None else None,
             "rotary_cos": 12 if rotary else None, "rotary_sin": 13 if rotary else None,
             "cache_leftpad": 14 if c.cache_leftpad is not None else None}
    inputs = [("q", 0, 0), ("k_cache", 1, 0), ("v_cache", 2, 0)]
    inputs += [(field, pos, 0) for field, pos in given.items() if pos is not None]
    workspace_bytes, workspace_fields = 0, []
    barrier = splits > 1 and cluster == 1  # the splits merge through L2, not in a cluster
    if barrier:  # fp32 workspace per (row block, split): O (padded head dim), then lse
        rows = groups * splits * config.block_m
        o_dim = kv.head_dim_v if latent else config.head_dim  # (the kernel's)
        offsets, workspace_bytes = _plans.carve([4 * rows * o_dim, 4 * rows])
        workspace_fields = [("o_partial", offsets[0]), ("lse_partial", offsets[1])]
    launches = [] if empty else [_launch.kernel_launch(
        config, device_id, (m_blocks * splits, kv.nheads_kv, kv.batch), cooperative=barrier,
        programmatic=choice.programmatic, cluster=cluster)]
    aligned = [(pos, name) for name, pos in (("q", 0), ("k_cache", 1), ("v_cache", 2), ("k", 3),
                                             ("v", 4), ("rotary_cos", 12), ("rotary_sin", 13))
               if name in arrays]
    per_call = ("cache_len_all",) + (("split_counters",) if barrier else ())
    if latent:
        plan = _latent_plan(device_id, k_cache, kv, fields, launches, inputs, workspace_bytes,
                            workspace_fields, aligned, per_call)
        return KVCachePlan(plan, splits, groups, kv.capacity - kv.seqlen_new, barrier)
    plan = _plans.Plan(device_id, "DecodeParams", fields, launches, inputs,
                       [(tuple(q.shape), q.dtype), ((kv.batch, kv.nheads, kv.seqlen_q), "float32")],
                       [("out", 0, 0), ("lse", 1, 0)], workspace_bytes, workspace_fields,
                       aligned, per_call)
    return KVCachePlan(plan, splits, groups, kv.capacity - kv.seqlen_new, barrier, unit_descale)


# ---------------------------------------------------------------------------------------------
# MLA's latent cache (docs/MLA_DECODE.md; cuda_src/flash_mla_decode_sm90.cu)


def check_latent_call(q, k_cache, v_cache, k, v, kv, options, cache_format, cache_options):
    """A call whose v_cache has a head dim of its own: MLA's latent cache, in the reference's
    form (v_cache = k_cache[..., :512], v = k[..., :512]); anything else refused, naming the
    argument, before anything launches."""
    reference = "cuflash2.reference.attention_with_kvcache takes it"
    if (kv.head_dim, kv.head_dim_v) != (_configs.MLA_HEAD_DIM, _configs.MLA_HEAD_DIM_V):
        raise NotImplementedError(
            f"attention_with_kvcache: v_cache's head dim ({kv.head_dim_v}) apart from k_cache's "
            f"({kv.head_dim}) has a decoding kernel for MLA's latent cache only (k_cache "
            f"{_configs.MLA_HEAD_DIM} columns, v_cache the view of its first "
            f"{_configs.MLA_HEAD_DIM_V}; docs/MLA_DECODE.md); {reference}")
    if kv.nheads_kv != 1:
        raise NotImplementedError(
            f"attention_with_kvcache: a latent cache (v_cache k_cache's first columns) has one "
            f"KV head; k_cache has {kv.nheads_kv}; {reference}")
    if cache_format is not None:
        raise NotImplementedError("attention_with_kvcache: kv_cache_dtype (an FP8 cache) is not "
                                  "taken with a latent cache yet")

    def same_rows(view, whole) -> bool:
        return (view.data.ptr == whole.data.ptr and tuple(view.strides) == tuple(whole.strides)
                and tuple(view.shape[:-1]) == tuple(whole.shape[:-1]))

    if not same_rows(v_cache, k_cache):
        raise ValueError(
            f"attention_with_kvcache: v_cache with its own head dim must be the view "
            f"k_cache[..., :{kv.head_dim_v}] (MLA's latent cache: the same rows, pointer and "
            f"strides), not an array of its own")
    if k is not None and not same_rows(v, k):
        raise ValueError(
            f"attention_with_kvcache: with a latent cache, v (the new tokens' values) must be "
            f"the view k[..., :{kv.head_dim_v}] (the same rows, pointer and strides): each new "
            f"row is appended once, all its columns")
    for name, given in (("softcap", options.softcap != 0.0),
                        ("alibi_slopes", options.alibi_slopes is not None),
                        ("sinks", options.sinks is not None),
                        ("rotary_cos", cache_options.rotary_cos is not None),
                        ("rotary_sin", cache_options.rotary_sin is not None),
                        ("cache_leftpad", cache_options.cache_leftpad is not None)):
        if given:
            raise NotImplementedError(
                f"attention_with_kvcache: {name} is not taken with a latent cache (MLA decode "
                f"kernel) yet; {reference}")
    if kv.paged and not _dispatch.mla_page_size_ok(kv.page_size):
        raise NotImplementedError(
            f"attention_with_kvcache: a paged latent cache's pages of {kv.page_size} positions "
            f"(k_cache's second dim, block_table's pages) are not read by the MLA decode "
            f"kernel: a multiple of {_configs.MLA_BLOCK_N}, or 8, 16 or 32")


def check_latent_device(arch: int, window) -> None:
    """What the MLA decode kernel needs of the device and the window: sm_90 (its sm_90a build),
    the driver bindings that encode its tensor map, no left window edge."""
    if window[0] >= 0:
        raise NotImplementedError(
            f"attention_with_kvcache: window_size with a left edge ({window[0]}) is not taken "
            f"with a latent cache yet (causal and right edges are)")
    if arch != 90:
        raise NotImplementedError(
            f"attention_with_kvcache: the MLA decode kernel (latent cache) runs on sm_90 "
            f"(H100 / H200) only; this device is sm_{arch}")
    if not _hopper.bindings_available():
        raise NotImplementedError(
            "attention_with_kvcache: the MLA decode kernel reads the cache through a TMA "
            "descriptor, which needs cuda-bindings (pip install cuda-bindings)")


def _latent_plan(device_id: int, k_cache, kv, fields: dict, launches, inputs,
                 workspace_bytes: int, workspace_fields, aligned, per_call) -> _plans.Plan:
    """The plan of a latent-cache call: MlaDecodeParams, the decode fields under `base.`, the
    cache's tensor map (encoded once, its address word patched per call from k_cache) and
    its box rows; the output (batch, seqlen_q, nheads, head_dim_v)."""
    box_rows = min(_configs.MLA_BLOCK_N, kv.page_size) if kv.paged else _configs.MLA_BLOCK_N
    try:
        map_fields = _hopper.tensor_map_fields({"k_cache": k_cache},
                                               {"kv_map": ("k_cache", box_rows)})
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"attention_with_kvcache: the TMA cannot read k_cache: {error}") from None
    base = "base."
    return _plans.Plan(
        device_id, "MlaDecodeParams",
        {**{base + f: v for f, v in fields.items()}, **map_fields, "box_rows": box_rows},
        launches, [(base + f, pos, off) for f, pos, off in inputs] + [("kv_map.v", 1, 0)],
        [((kv.batch, kv.seqlen_q, kv.nheads, kv.head_dim_v), k_cache.dtype),
         ((kv.batch, kv.nheads, kv.seqlen_q), "float32")],
        [(base + "out", 0, 0), (base + "lse", 1, 0)], workspace_bytes,
        [(base + f, off) for f, off in workspace_fields], aligned,
        [(f, base + f) for f in per_call], batch_offset=base + "batch_offset")
