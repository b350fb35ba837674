"""attention_with_kvcache: append the new tokens in place, then split-KV attention of the few
query tokens over the cache, in one kernel (cuda_src/flash_decode.cu; docs/DECODE_DESIGN.md).

A call signature is checked and planned once (`_plans`); the split count comes from the decode
kernel's occupancy, and the splits of a row block meet at a barrier in per-stream counters.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

from . import _configs, _launch, _plans, _prepare, _validate
from ._prepare import LOG2E, element_strides, output_strides

MAX_SPLITS = _configs.MAX_SPLITS
MAX_CLUSTER_SPLITS = _configs.MAX_CLUSTER_SPLITS
#: On sm_90 a row block's splits form a thread-block cluster and merge through distributed
#: shared memory (split_merge.cuh), at most MAX_CLUSTER_SPLITS of them; False: the barrier
#: through L2 everywhere (development: measuring the two).
CLUSTER_MERGE = True
#: A step whose packed query rows fit DECODE_BLOCK_M_N8 (one token of a GQA group of up to 8)
#: runs the decode kernel with its rows on the mma's n side (no mma work on padding rows), unless
#: its splits merge in a cluster (choose_splits); False: on an m16 tile everywhere
#: (development: measuring the two).
ROWS_ON_N = True
#: The automatic split count stops here: a step that merges more partial results a row block
#: ends later than it streams faster (H200, in a CUDA graph, batch 1: 32 splits beat 64 by
#: 1.1-1.2 us from 4k to 64k tokens; docs/DECODE_DESIGN.md).
AUTO_MAX_SPLITS = 32

_plans_by_key = _plans.PlanCache()
_cupy = None


def _is_int(x) -> bool:
    return type(x) is int or isinstance(x, numbers.Integral)


def check_num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic); got {num_splits!r}")
    return num_splits


@functools.lru_cache(maxsize=4096)
def num_splits_for(requested: int, ctas: int, tiles: int, slots: int,
                   most: int = MAX_SPLITS) -> int:
    """The KV split count for a grid of `ctas` CTAs (row blocks x KV heads x sequences) over
    `tiles` KV tiles, on a GPU that holds `slots` such CTAs at once (SMs x CTAs per SM).

    The splits of a row block wait for each other to merge their results, so a split grid must
    fit the GPU in one wave: at most slots // ctas splits, `requested` included. For 0 (auto):
    none if the grid already covers 80% of the slots; else the largest count that fits, among
    those that give every split the same number of tiles (others leave trailing splits short),
    at most AUTO_MAX_SPLITS.
    Decoding is bound by reading the cache, and every resident CTA keeps reads in flight.
    `most`: the largest count the merge allows (MAX_SPLITS; MAX_CLUSTER_SPLITS in a cluster)."""
    fit = max(1, min(slots // max(ctas, 1), most, tiles))
    if requested == 0:
        if ctas >= 0.8 * slots:
            return 1
        fit = min(fit, AUTO_MAX_SPLITS)
        return max(_even(s, tiles) for s in range(1, fit + 1))
    return max(1, min(requested, fit))


#: The decode kernel's split barrier counters, one per row block (never reset: each barrier flips
#: its top bit, split_merge.cuh), a buffer per (device, stream).
_split_counters = _plans.StreamCounters(1024)


def split_counters(groups: int, device_id: int, stream_ptr: int, cupy) -> int:
    """The address of the stream's split barrier counters, at least `groups` of them."""
    return _split_counters.get(device_id, stream_ptr, cupy, groups)


_slots_cache: dict = {}


def _even(splits: int, tiles: int) -> int:
    """The split count once every split but the last has ceil(tiles / splits) tiles."""
    return max(1, -(-tiles // -(-tiles // splits))) if tiles else 1


def choose_splits(config, requested: int, groups: int, tiles: int, device_id: int, arch: int,
                  dtype: str, head_dim: int, features: int):
    """The decode kernel, split count and cluster size (1: none) of a call.

    On sm_90 a row block's splits can be one thread-block cluster that merges through
    distributed shared memory (split_merge.cuh), which ends a step ~1.7 us sooner than the
    barrier through L2 at the same count but allows at most MAX_CLUSTER_SPLITS splits. So the
    splits form a cluster where the step is short (at most CLUSTER_MAX_TILES_PER_SPLIT tiles a
    split at MAX_CLUSTER_SPLITS splits; or a requested count that a cluster holds) and every
    cluster of the grid is resident at once; elsewhere more splits merging through L2 stream
    the cache faster (docs/DECODE_DESIGN.md, in-graph measurements)."""
    slots = decode_slots(config, device_id)
    barrier_splits = _even(num_splits_for(requested, groups, tiles, slots), tiles)
    if not (CLUSTER_MERGE and arch >= _configs.CLUSTER_MIN_ARCH
            and requested <= MAX_CLUSTER_SPLITS):
        return config, barrier_splits, 1
    splits = _even(num_splits_for(requested, groups, tiles, slots, MAX_CLUSTER_SPLITS), tiles)
    short = -(-tiles // max(splits, 1)) <= _configs.CLUSTER_MAX_TILES_PER_SPLIT
    if splits < 2 or (requested == 0 and not short):
        return config, barrier_splits, 1
    # A step that forms a cluster keeps its rows on an m16 tile: with them on the n side the
    # batch-1 4k step in a graph took 9.6 against 9.4 us a layer (its last split, which loads its
    # tile of new tokens after the wait, ended later), where every step merging through L2
    # gained 0.4-0.6 us (docs/DECODE_DESIGN.md). So does such a step where no cluster launches
    # or fits: it then merges through L2 on the same kernel, and a launch path without clusters
    # gives the same bits. (Such a step has at most 8 rows: one m16 block too.)
    m16 = dataclasses.replace(config, block_m=_configs.DECODE_BLOCK_M)
    if _launch.extended_available():
        deep = _configs.with_features(_configs.decode_cluster_config(
            dtype, head_dim, arch, config.early_cache_reads), features)
        for candidate in dict.fromkeys((deep, m16) if short else (m16,)):
            if _launch.cluster_fits(candidate, device_id, splits, groups):
                return candidate, splits, splits
    return m16, barrier_splits, 1


def decode_slots(config, device_id: int) -> int:
    """SMs x CTAs of `config`'s decode kernel resident per SM (what a cooperative launch of the
    kernel allows)."""
    slots = _slots_cache.get((config, device_id))
    if slots is None:
        slots = _slots_cache[(config, device_id)] = _launch.occupancy_slots(config, device_id)
    return slots


@dataclasses.dataclass
class KVCachePlan:
    """A checked attention_with_kvcache signature: its Plan, and what a call adds to it."""

    plan: _plans.Plan
    splits: int
    groups: int  # row blocks x KV heads x sequences: the split barriers
    default_cache_len: int  # cache_seqlens=None: the whole capacity is cached
    barrier: bool  # the splits meet at the barrier through L2 (split counters per stream)


def _key(cupy, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
         options, num_splits, early_cache_reads):
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
    arrays = (q, k_cache, v_cache, k, v, cache_batch_idx, block_table, options.alibi_slopes,
              options.sinks)
    if not _plans.add_signature(key, ndarray, arrays, options.window_size):
        return None
    # The current device once the arrays are CuPy ones (api._forward_key says why).
    o = options  # its scalar options with their types (seed and offset: per call)
    key += (cupy.cuda.runtime.getDevice(), type(o.causal), o.causal, type(o.softmax_scale),
            o.softmax_scale, type(o.softcap), o.softcap, type(o.dropout_p), o.dropout_p,
            type(num_splits), num_splits, type(early_cache_reads), early_cache_reads)
    return tuple(key)


def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                           block_table, options, num_splits, return_lse, check_cache,
                           early_cache_reads):
    """api.attention_with_kvcache, its options (causal, softmax_scale, window_size, softcap,
    alibi_slopes, sinks) as one _options.AttentionOptions."""
    global _cupy
    cupy = _cupy or _prepare.cupy_module()
    _cupy = cupy
    key = None if check_cache else _key(
        cupy, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, options,
        num_splits, early_cache_reads)
    planned = _plans_by_key.get(key)
    if planned is None:
        planned = _plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                        options, num_splits, check_cache, early_cache_reads)
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
    outputs = planned.plan.run((q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                block_table, options.alibi_slopes, options.sinks), cupy,
                               scalars, wrap=2 if return_lse else 1, stream=stream)
    return tuple(outputs) if return_lse else outputs[0]


def _plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, options,
          num_splits, check_cache, early_cache_reads) -> KVCachePlan:
    """Checks a call in full (values too with `check_cache`) and plans its launch."""
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in (("k", k), ("v", v), ("alibi_slopes", options.alibi_slopes),
                    ("sinks", options.sinks), ("cache_batch_idx", cache_batch_idx),
                    ("block_table", block_table)):
        if x is not None:
            arrays[name] = x
    if cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Integral):
        arrays["cache_seqlens"] = cache_seqlens
    cupy = _prepare.require_cupy_arrays(arrays)
    _prepare.check_flag("causal", options.causal)
    _prepare.check_flag("early_cache_reads", early_cache_reads)
    num_splits = check_num_splits(num_splits)
    kv = _validate.check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens,
                                        cache_batch_idx, block_table,
                                        cupy.asnumpy if check_cache else None)
    # q's own checks (dtype, head dim, strides, scale); the caches' shapes are kv's.
    problem = _validate.check_attention_inputs(q, q, q, softmax_scale=options.softmax_scale)
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
    # The decode kernel (compiled here if need be) and its split count.
    arch = _prepare.device_arch(device_id)
    group = kv.nheads // kv.nheads_kv if kv.nheads_kv else 1
    block_m = (_configs.DECODE_BLOCK_M_N8 if ROWS_ON_N and kv.seqlen_q * group
               <= _configs.DECODE_BLOCK_M_N8 else _configs.DECODE_BLOCK_M)
    config = _configs.with_features(
        _configs.decode_config(problem.dtype, kv.head_dim, arch, block_m), mods.features)
    # The kernel waits for the previous kernel's writes itself (dependent_launch.cuh), so a
    # programmatic launch lets it start while that kernel finishes; with the caller's promise
    # its specialisation reads the cache meanwhile (without the overlap there is nothing to gain).
    programmatic = _launch.programmatic_available(arch)
    if early_cache_reads and programmatic:
        config = dataclasses.replace(config, early_cache_reads=True)
    m_blocks = -(-kv.seqlen_q * group // config.block_m)
    tiles = -(-kv.capacity // config.block_n)
    groups = m_blocks * kv.nheads_kv * kv.batch
    empty = kv.batch == 0 or kv.seqlen_q == 0 or kv.nheads == 0
    config, splits, cluster = (config, 1, 1) if empty else choose_splits(
        config, num_splits, groups, tiles, device_id, arch, problem.dtype, kv.head_dim,
        mods.features)
    chosen_tiles = -(-kv.capacity // config.block_n)  # of the tile choose_splits returned
    tiles_per_split = -(-chosen_tiles // splits)
    new_tokens = k is not None and kv.seqlen_new > 0
    table_stride = block_table.strides[0] // 4 if block_table is not None else 0

    def strides(prefix, x):
        s = element_strides(x) if x is not None else (0, 0, 0)
        return {f"{prefix}_batch_stride": s[0], f"{prefix}_row_stride": s[1],
                f"{prefix}_head_stride": s[2]}

    out_strides = output_strides(q.shape)
    fields = {
        **strides("q", q), **strides("kn", k if new_tokens else None),
        **strides("vn", v if new_tokens else None), **strides("kc", k_cache),
        **strides("vc", v_cache), "o_batch_stride": out_strides[0],
        "o_row_stride": out_strides[1], "o_head_stride": out_strides[2],
        "block_table_stride": table_stride, "seqlen_new": kv.seqlen_new,
        "page_size": kv.page_size, "num_blocks": kv.num_blocks, "capacity": kv.capacity,
        "seqlen_q": kv.seqlen_q, "nheads": kv.nheads, "heads_per_kv_head": group,
        "head_dim": kv.head_dim, "num_m_blocks": m_blocks, "num_splits": splits,
        "tiles_per_split": tiles_per_split, "split_cluster": int(cluster > 1),
        "scale_log2": mods.softmax_scale * LOG2E, "window_left": window[0],
        "window_right": window[1], **mods.fields()}
    # Pointer fields by position in the call's input tuple; an int or absent cache_seqlens leaves
    # its field null (the kernel then reads cache_len_all).
    given = {"cache_seqlens": 5 if "cache_seqlens" in arrays else None,
             "cache_batch_idx": 6 if cache_batch_idx is not None else None,
             "block_table": 7 if block_table is not None else None,
             "mods.alibi_slopes": 8 if options.alibi_slopes is not None else None,
             "mods.sinks": 9 if options.sinks is not None else None,
             "k_new": 3 if new_tokens else None, "v_new": 4 if new_tokens else None}
    inputs = [("q", 0, 0), ("k_cache", 1, 0), ("v_cache", 2, 0)]
    inputs += [(field, pos, 0) for field, pos in given.items() if pos is not None]
    workspace_bytes, workspace_fields = 0, []
    barrier = splits > 1 and cluster == 1  # the splits merge through L2, not in a cluster
    if barrier:  # fp32 workspace per (row block, split): O (padded head dim), then lse
        rows = groups * splits * config.block_m
        offsets, workspace_bytes = _plans.carve([4 * rows * config.head_dim, 4 * rows])
        workspace_fields = [("o_partial", offsets[0]), ("lse_partial", offsets[1])]
    launches = [] if empty else [_launch.kernel_launch(
        config, device_id, (m_blocks * splits, kv.nheads_kv, kv.batch), cooperative=barrier,
        programmatic=programmatic, cluster=cluster)]
    aligned = [(pos, name) for name, pos in (("q", 0), ("k_cache", 1), ("v_cache", 2), ("k", 3),
                                             ("v", 4)) if name in arrays]
    per_call = ("cache_len_all",) + (("split_counters",) if barrier else ())
    plan = _plans.Plan(device_id, "DecodeParams", fields, launches, inputs,
                       [(tuple(q.shape), q.dtype), ((kv.batch, kv.nheads, kv.seqlen_q), "float32")],
                       [("out", 0, 0), ("lse", 1, 0)], workspace_bytes, workspace_fields,
                       aligned, per_call)
    return KVCachePlan(plan, splits, groups, kv.capacity - kv.seqlen_new, barrier)
