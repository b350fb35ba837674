"""Dispatch: which kernel runs a call, and how (docs/ARCHITECTURE.md, "Layers of the package").

Every choice a plan makes is here, with the measurements behind it: the kernel family (mma.sync
or the Hopper sm_90a kernels), the tile of a specialisation for a dtype, head dim, architecture
and features, the Hopper forward's consumer schedule, grid and tile order, the backward's main
kernel and the Hopper backward's dispatch order, and the decode kernel's split count and
cluster. A plan asks once (`forward_kernel`, `backward_kernels`, `decode_kernel`) and builds
its struct and launches from the answer. What one specialisation is (its tiles, threads, shared
memory, name) is `_configs`'s; the tensor maps are `_hopper`'s, which the Hopper choices ask to
describe a call's arrays. `all_*_configs` and `hopper_forward_configs` enumerate what the
dispatcher can choose (the compile tests and the prewarm build them).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

from . import _hopper, _launch
from ._configs import (MLA_BLOCK_N, MlaDecodeConfig, FEATURE_BLOCK_MASK, DECODE_BLOCK_M, DECODE_BLOCK_M_N8, DTYPE_TAGS, FEATURE_ALIBI,
                       FEATURE_DROPOUT,
                       FLOAT32_TAGS,
                       FEATURE_BIAS_GRAD, FEATURE_BIAS_TILE, SM90_MAX_SMEM,
                       FEATURE_SINKS, FEATURE_SOFTCAP, FEATURE_VARLEN, KERNEL_HEAD_DIMS,
                       MAX_CLUSTER_SPLITS, MAX_SPLITS, SM90_BWD_HEAD_DIMS, SM90_FWD_HEAD_DIMS,
                       BwdConfig, BwdDqConfig, BwdSm90Config, DecodeConfig, FwdConfig,
                       USER_MOD_FEATURES, AuxKernel, FwdSm90Config, TF32_OPERANDS_KERNEL,
                       E4M3_TAGS, backward_features,
                       with_features)

#: Configurations forced by tuning scripts (api._forced_config): "fwd" / "bwd" -> config.
FORCED: dict = {}


# ---------------------------------------------------------------------------------------------
# The plans' questions: one each, answered with everything the plan takes from the dispatch.


@dataclass
class ForwardChoice:
    """The forward kernel of a call: its configuration (FwdConfig, or FwdSm90Config on the
    Hopper kernel) and grid; on the Hopper kernel also FwdSm90Params' own fields (the persistent
    grid's batch and section size) and the tensor maps (`maps`: map field -> (view name, box
    rows), `map_fields`: their encoded words by struct path, _hopper.tensor_map_fields)."""

    config: object
    grid: tuple
    hopper: bool = False
    grid_fields: dict = field(default_factory=dict)
    maps: dict | None = None
    map_fields: dict | None = None
    #: FEATURE_BIAS_TILE: the bias's map words ("bias_map.v") and extents (FwdSm90ModsParams).
    bias_fields: dict | None = None
    #: The float32 Hopper forward: its operand pass's scratch arrays (tf32_operand_shapes), whose
    #: maps map_fields holds.
    scratch: dict | None = None


def forward_kernel(problem, features: int, window, arch: int, views: dict, varlen, device_id: int,
                   config=None, user_mods=None, bias_tile=None) -> ForwardChoice:
    """The forward kernel of a checked call (`features`: its FEATURE_* bits, varlen included;
    `window`: the kernels' (left, right)). On sm_90 the Hopper kernel runs every call it covers
    (hopper_forward_config) whose q, k and v the TMA describes, the mma.sync kernel (fwd_config)
    the others; `config`, or a tuning script's FORCED["fwd"], runs instead where given.
    `user_mods`: the programmable modifiers' sources (mask, score): on sm_90 a mask modifier
    alone runs on the Hopper kernel (a FwdSm90ModsConfig: hopper_forward_config's choice for
    the call's other features; HOPPER_FORWARD_MODS; with a block mask up to
    HOPPER_BLOCK_MASK_MAX_HEAD_DIM, scheduled as a causal call), the others on the mma.sync
    kernel (fwd_mods_config's tile; a FwdModsConfig). `bias_tile`: where the score modifier is
    the bias alone, the bias's elements as _bias.tile_array gives them: on sm_90 the Hopper
    forward takes it as tiles where it can (hopper_bias_tile_choice). V with a head dim of its
    own (d_v != d_qk): the Hopper kernel where hopper_forward_config takes it (its
    SM90_FWD_HEAD_DIM_PAIRS, 16-bit, the variant's features and varlen), else the mma.sync
    kernel where V's kernel head dim is below Q's (fwd_config; every feature but the
    programmable modifiers), else NotImplementedError naming v's head dim
    (split_head_dims_refusal)."""
    p = problem
    split = p.head_dim_v != p.head_dim
    if (split or p.dtype in E4M3_TAGS) and not (p.batch and p.seqlen_q and p.nheads):
        return ForwardChoice(None, (0, 0, 0))  # nothing to launch (forward_plan)
    if p.dtype in E4M3_TAGS and varlen is not None and varlen.total_q == 0:
        # no query row in the packed q (max_seqlen_q may still be positive): nothing to
        # compute, and no map over q's zero rows
        return ForwardChoice(None, (0, 0, 0))
    if p.dtype in E4M3_TAGS and (config is not None or "fwd" in FORCED
                                 or user_mods is not None):
        if user_mods is not None:
            raise NotImplementedError("FP8 (e4m3) inputs: not with mask_mod, score_mod, bias "
                                      "or block_mask")
        config = config or FORCED["fwd"]
        if config.dtype != p.dtype:
            raise ValueError(f"the forced configuration is for {config.dtype}, the call "
                             f"{p.dtype}")
    if split and (config is not None or "fwd" in FORCED or user_mods is not None):
        raise NotImplementedError(split_head_dims_refusal(p, "forward", arch))
    if user_mods is not None:
        from . import mods

        block_mask = bool(features & FEATURE_BLOCK_MASK)
        if (bias_tile is not None and config is None and "fwd" not in FORCED
                and HOPPER_FORWARD_BIAS_TILES):
            choice = hopper_bias_tile_choice(p, features, window, arch, views, varlen,
                                             device_id, user_mods[0], bias_tile)
            if choice is not None:
                return choice
        most = HOPPER_BLOCK_MASK_MAX_HEAD_DIM if block_mask else HOPPER_MODS_MAX_HEAD_DIM
        if (config is None and "fwd" not in FORCED and HOPPER_FORWARD_MODS
                and user_mods[1] is None and p.head_dim <= most
                and not (block_mask and varlen is not None)):
            schedule = scheduling_window(window, block_mask)
            hopper = hopper_forward_config(p, features & ~USER_MOD_FEATURES, schedule, arch,
                                           varlen)
            if hopper is not None:
                maps = _hopper.forward_maps(hopper)
                map_fields = _hopper.readable_map_fields(views, maps)
                if map_fields is not None:
                    hopper = mods.hopper_forward_config(hopper, *user_mods,
                                                        block_mask=block_mask)
                    grid, grid_fields = forward_grid(
                        hopper, p.batch, p.nheads, p.nheads_kv, p.seqlen_q, p.seqlen_k,
                        p.head_dim, views["q"].itemsize, schedule[1], device_id)
                    return ForwardChoice(hopper, grid, True, grid_fields, maps, map_fields)
        if config is None:
            config = FORCED.get("fwd") or fwd_mods_config(p.dtype, p.head_dim, arch)
        config = mods.forward_config(with_features(config, features & ~USER_MOD_FEATURES),
                                     *user_mods, block_mask=block_mask)
        return ForwardChoice(config, (-(-p.seqlen_q // config.block_m), p.nheads, p.batch))
    hopper = map_fields = scratch = None
    if config is None and "fwd" not in FORCED:
        hopper = hopper_forward_config(p, features, window, arch, varlen)
    elif p.dtype in E4M3_TAGS:  # a forced FP8 forward (tuning, tests): no other kernel runs it
        hopper_forward_config(p, features, window, arch, varlen)  # (its refusals)
        hopper = config
    if hopper is not None:
        maps = _hopper.forward_maps(hopper)
        map_fields = _hopper.readable_map_fields(views, maps)
        if map_fields is not None and hopper.operand_pass:
            scratch = tf32_operand_shapes(p, hopper)
            try:  # K and V as the operand pass writes them, in the call's scratch
                map_fields.update(_hopper.scratch_map_fields(
                    {TF32_OPERAND_MAPS[name]: (view, strides, rows)
                     for name, (_, _, view, strides, rows) in scratch.items()},
                    SCRATCH_DTYPES[hopper.dtype]))
            except (ValueError, RuntimeError):
                map_fields = None
    if map_fields is None and p.dtype in E4M3_TAGS:
        raise NotImplementedError(
            "FP8 (e4m3) inputs run on the Hopper forward, whose TMA reads q, k and v: each "
            "contiguous in its head dim with its other strides multiples of 16 bytes, 16-byte "
            "aligned (cupy.ascontiguousarray gives such arrays)")
    if map_fields is None:
        if split:
            # V's kernel head dim below Q's: the one-head-dim kernels bound V's columns by Q's
            if (p.dtype not in DTYPE_TAGS
                    or v_kernel_head_dim(p.head_dim_v, p.head_dim) >= kernel_head_dim(p.head_dim)):
                raise NotImplementedError(split_head_dims_refusal(p, "forward", arch))
            config = fwd_config(p.dtype, p.head_dim, arch, p.head_dim_v)
        elif config is None:
            config = FORCED.get("fwd") or fwd_config(p.dtype, p.head_dim, arch)
        config = with_features(config, features)
        return ForwardChoice(config, (-(-p.seqlen_q // config.block_m), p.nheads, p.batch))
    grid, grid_fields = forward_grid(hopper, p.batch, p.nheads, p.nheads_kv, p.seqlen_q,
                                     p.seqlen_k, p.head_dim, views["q"].itemsize, window[1],
                                     device_id)
    return ForwardChoice(hopper, grid, True, grid_fields, maps, map_fields, scratch=scratch)


def split_head_dims_refusal(problem, direction: str, arch: int) -> str:
    """Why a call whose v has a head dim of its own runs on no kernel (`direction`: "forward"
    or "backward"): what each family takes."""
    p = problem
    pairs = ", ".join(f"{a}/{b}" for a, b in SM90_FWD_HEAD_DIM_PAIRS)
    if direction == "forward":
        return (f"v's head dim ({p.head_dim_v}) apart from q's and k's ({p.head_dim}) takes "
                f"float16 or bfloat16 inputs and no mask_mod / score_mod / bias, and on sm_90 "
                f"without dropout the Hopper forward's pairs {pairs} or a d_v of q's kernel head "
                f"dim; elsewhere (the mma.sync forward) v's kernel head dim, of "
                f"{', '.join(map(str, KERNEL_HEAD_DIMS))} and at least 64 where q's is, below "
                f"q's; this call has another combination on sm_{arch} "
                f"(cuflash2.reference.attention takes any)")
    return (f"the backward of v's head dim ({p.head_dim_v}) apart from q's and k's "
            f"({p.head_dim}) takes float16 or bfloat16 inputs, no mask_mod / score_mod / bias "
            f"and no forced kernel configuration; on sm_90 without dropout the Hopper "
            f"backward's pairs {pairs} (arrays the TMA reads); elsewhere (the mma.sync "
            f"backward) v's kernel head dim, of {', '.join(map(str, KERNEL_HEAD_DIMS))} and at "
            f"least 64 where q's is, below q's, with a tile whose warps split its columns "
            f"(not 192 / 160, 256 / 224); this call has another combination on sm_{arch} "
            f"(cuflash2.reference.attention_backward takes any)")


def scheduling_window(window, block_mask: bool):
    """The (left, right) window a call's grid, tile order and claims are chosen for: a block
    mask's call is scheduled as a causal one, its work tiles' lengths varying as theirs do (the
    kernels still take the call's own window). The persistent grid's static schedule instead
    (H100, 16k, d=128; `benchmarks/results/2026-12-06-h100-block-mask-persistent-grid.md`):
    causal and prefix-LM masks 1.40x slower, the window 0.99x, document-causal 0.91x; the host
    does not know the block mask's tile counts, so every block mask keeps this schedule."""
    return (window[0], 0) if block_mask and window[1] < 0 else window


#: A bias alone runs on the Hopper forward as tiles (FEATURE_BIAS_TILE, sm90/bias_tile.cuh) where
#: hopper_bias_tile_choice takes it; CUFLASH2_HOPPER_BIAS_TILES=0 keeps it on the mma.sync mods
#: kernel (development: measuring the two).
HOPPER_FORWARD_BIAS_TILES = os.environ.get("CUFLASH2_HOPPER_BIAS_TILES", "1") != "0"


def hopper_bias_tile_choice(problem, features: int, window, arch: int, views: dict, varlen,
                            device_id: int, mask, bias_tile):
    """The Hopper forward with the bias as tiles (FEATURE_BIAS_TILE: each KV tile's block of the
    bias loaded by TMA into its stage after K, on barriers of its own, and added to S from
    shared memory; sm90/bias_tile.cuh), with the call's
    mask modifier `mask` (or None) and built-in features, or None where it does not take the
    call: not sm_90, varlen, a bias of another dtype than q's, a head dim whose stages do not fit
    shared memory with the bias's (above 128), or arrays the TMA cannot read (a bias whose rows
    are not 16-byte multiples: seqlen_k % 8). Two consumers with the overlap schedule, one tile a
    CTA (the persistent grid's O buffer leaves no room for the bias's tiles); scheduled as a
    causal call with a block mask, as the mask modifier's forward."""
    from . import mods

    p = problem
    if varlen is not None or bias_tile.dtype != views["q"].dtype:
        return None
    block_mask = bool(features & FEATURE_BLOCK_MASK)
    schedule = scheduling_window(window, block_mask)
    hopper = hopper_forward_config(p, features & ~USER_MOD_FEATURES, schedule, arch, varlen)
    if hopper is None or hopper.head_dim > 128:
        return None
    causal = schedule[1] == 0 and schedule[0] < 0
    pingpong, overlap = SCHEDULES[hopper.head_dim, causal]
    if not overlap:
        return None
    config = dataclasses.replace(fwd_sm90_config(p.dtype, hopper.head_dim), pingpong=pingpong,
                                 overlap=overlap, features=hopper.features)
    config = mods.hopper_forward_config(config, mask, None, block_mask=block_mask)
    config = dataclasses.replace(config, features=config.features | FEATURE_BIAS_TILE)
    while config.smem_bytes > SM90_MAX_SMEM and config.stages > 2:
        # Fewer K/V stages to make room for the bias's (d=96: three stages, fwd_sm90_config,
        # then two as d=128).
        config = dataclasses.replace(config, stages=config.stages - 1)
    if config.smem_bytes > SM90_MAX_SMEM:
        return None
    maps = _hopper.forward_maps(config)
    map_fields = _hopper.readable_map_fields(views, maps)
    bias_fields = bias_tile_fields(bias_tile, config.block_m)
    if map_fields is None or bias_fields is None:
        return None
    grid, grid_fields = forward_grid(config, p.batch, p.nheads, p.nheads_kv, p.seqlen_q,
                                     p.seqlen_k, p.head_dim, views["q"].itemsize, schedule[1],
                                     device_id)
    return ForwardChoice(config, grid, True, grid_fields, maps, map_fields, bias_fields)


def bias_tile_fields(bias_tile, block_m: int) -> dict | None:
    """The mods params' fields of the bias as tiles (FwdSm90ModsParams, BwdSm90ModsParams): its
    map's words ("bias_map.v", boxes of 64 keys x `block_m` rows) and its batch and head extents
    (1: broadcast), or None where the TMA cannot read it."""
    words = _hopper.readable_map_fields({"bias": bias_tile}, {"bias_map": ("bias", block_m)})
    if words is None:
        return None
    return {**words, "bias_batches": bias_tile.shape[0], "bias_heads": bias_tile.shape[2]}


@dataclass
class BackwardChoice:
    """The backward kernels of a call that depend on the dispatch: the main kernel's
    configuration (BwdConfig, or BwdSm90Config on the Hopper kernel), the deterministic dQ
    kernel's (the mma.sync path in deterministic mode; None elsewhere), and on the Hopper kernel
    BwdSm90Params.dispatch_group_pairs and the tensor maps (as ForwardChoice's)."""

    config: object
    hopper: bool = False
    dq_config: BwdDqConfig | None = None
    group_pairs: int = 1
    maps: dict | None = None
    map_fields: dict | None = None
    #: FEATURE_BIAS_TILE: the bias's map words ("bias_map.v") and extents (BwdSm90ModsParams).
    bias_fields: dict | None = None


def backward_kernels(problem, features: int, deterministic: bool, arch: int, views: dict,
                     varlen, window, config=None, user_mods=None,
                     bias_tile=None) -> BackwardChoice:
    """The backward kernels of a checked call (`features`: those of its main kernels,
    backward_features): `config` or a tuning script's forced one if given (a BwdSm90Config
    forces the Hopper kernel), else the Hopper kernel where hopper_backward_config covers the
    call and the TMA describes q, k, v and dout, else the mma.sync kernel's tile (bwd_config).
    `user_mods`: the programmable modifiers' sources (mask, score): on sm_90 a mask modifier
    alone, or the bias alone with or without one, runs on the Hopper kernel where
    hopper_backward_mods_choice takes it (`bias_tile`: as forward_kernel's), the others on the
    mma.sync kernels (bwd_mods_config's tile, or a forced BwdConfig's; a BwdModsConfig, and in
    deterministic mode a BwdDqModsConfig; mods.check_backward's ValueError for a score modifier
    without a derivative). V with a head dim of its own (d_v != d_qk): the Hopper kernel where
    hopper_backward_config takes it (the forward's pairs, 16-bit, softcap, ALiBi, varlen,
    deterministic mode), else the mma.sync kernels with V's own kernel head dim where
    split_bwd_configs has a tile (16-bit; every feature but the programmable modifiers: dropout,
    varlen, deterministic mode included), else NotImplementedError naming v's head dim
    (split_head_dims_refusal; so are a forced configuration and the modifiers)."""
    p = problem
    split = p.head_dim_v != p.head_dim
    if split and not (p.batch and p.nheads):  # nothing to launch (backward_plan); its sizes only
        return BackwardChoice(bwd_config(p.dtype, p.head_dim, arch, deterministic))
    forced = config if config is not None else FORCED.get("bwd")
    if split and (forced is not None or user_mods is not None):
        raise NotImplementedError(split_head_dims_refusal(p, "backward", arch))
    if user_mods is not None:
        from . import mods

        if forced is None:
            choice = hopper_backward_mods_choice(p, features, deterministic, arch, views, varlen,
                                                 window, user_mods, bias_tile)
            if choice is not None:
                return choice
        if forced is None or isinstance(forced, BwdSm90Config):
            forced = bwd_mods_config(p.dtype, p.head_dim, arch, deterministic)
        base = with_features(dataclasses.replace(forced, compute_dq=not deterministic),
                             features & ~USER_MOD_FEATURES)
        dq_config = None
        if deterministic:
            dq_config = mods.dq_config(
                with_features(bwd_dq_config(p.dtype, p.head_dim, arch),
                              features & ~USER_MOD_FEATURES & ~FEATURE_BIAS_GRAD), *user_mods)
        return BackwardChoice(mods.backward_config(
            base, *user_mods, block_mask=bool(features & FEATURE_BLOCK_MASK)),
            dq_config=dq_config)
    hopper = map_fields = None
    if isinstance(forced, BwdSm90Config):
        # BwdSm90Config refuses what the kernel does not compile in (dropout): ValueError here.
        hopper = with_features(dataclasses.replace(forced, deterministic=deterministic),
                               features)
        maps = _hopper.backward_maps(hopper)
        map_fields = _hopper.tensor_map_fields(views, maps)  # forced: the TMA's refusal raises
    elif forced is None:
        hopper = hopper_backward_config(p, features, arch, varlen, deterministic)
        if hopper is not None:
            maps = _hopper.backward_maps(hopper)
            map_fields = _hopper.readable_map_fields(views, maps)
    if map_fields is None:
        if split:
            configs = split_bwd_configs(p.dtype, p.head_dim, p.head_dim_v, arch, deterministic)
            if configs is None:
                raise NotImplementedError(split_head_dims_refusal(p, "backward", arch))
            main, dq_config = configs
            return BackwardChoice(with_features(main, features), dq_config=(
                None if dq_config is None else with_features(dq_config, features)))
        if forced is None:
            forced = bwd_config(p.dtype, p.head_dim, arch, deterministic)
        dq_config = None
        if deterministic:
            dq_config = with_features(bwd_dq_config(p.dtype, p.head_dim, arch), features)
        return BackwardChoice(with_features(forced, features), dq_config=dq_config)
    key_blocks = -(-p.seqlen_k // hopper.block_n)
    group_pairs = dispatch_group_pairs(key_blocks, hopper.num_chunks, window, deterministic)
    return BackwardChoice(hopper, True, group_pairs=group_pairs, maps=maps,
                          map_fields=map_fields)


@dataclass
class DecodeChoice:
    """The decode launch of an attention_with_kvcache call: its configuration, packed query row
    blocks a (sequence, KV head), the split barriers' groups (row blocks x KV heads x
    sequences), the split count, the cluster size (1: none) and whether it is a programmatic
    launch."""

    config: DecodeConfig
    m_blocks: int
    groups: int
    splits: int
    cluster: int
    programmatic: bool


def decode_kernel(kv, dtype: str, features: int, arch: int, device_id: int, num_splits: int,
                  early_cache_reads: bool, kv_cache_dtype: str | None = None) -> DecodeChoice:
    """The decode kernel (compiled here if need be, for its occupancy) and its split count for
    a checked call (`kv`: its _validate.KVCacheProblem; `num_splits`: as requested, 0 for
    automatic; `kv_cache_dtype`: None, or "e4m3" for an FP8 cache)."""
    group = kv.nheads // kv.nheads_kv if kv.nheads_kv else 1
    block_m = (DECODE_BLOCK_M_N8 if ROWS_ON_N and kv.seqlen_q * group
               <= DECODE_BLOCK_M_N8 else DECODE_BLOCK_M)
    config = with_features(decode_config(dtype, kv.head_dim, arch, block_m, kv_cache_dtype),
                           features)
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
        config, num_splits, groups, tiles, device_id, arch, dtype, kv.head_dim, features)
    return DecodeChoice(config, m_blocks, groups, splits, cluster, programmatic)


#: Page sizes of a paged latent cache that flash_mla_decode_sm90.cu reads (_configs.MLA_BLOCK_N
#: positions a tile): a multiple of the tile (one TMA box a panel), or a divisor of it that is a
#: multiple of 8 (a box a page, each starting on a 1024-byte swizzle atom of the tile).
def mla_page_size_ok(page_size: int) -> bool:
    return page_size % MLA_BLOCK_N == 0 or (MLA_BLOCK_N % page_size == 0 and page_size % 8 == 0)


#: Whether the MLA decode runs pairs of row blocks that see the same tiles as clusters of two
#: CTAs sharing each tile (MlaDecodeConfig.paired: TMA multicast, the cache through L2 once).
MLA_PAIRED = True


def mla_decode_kernel(kv, dtype: str, device_id: int, num_splits: int) -> DecodeChoice:
    """The MLA decode kernel (flash_mla_decode_sm90.cu; docs/MLA_DECODE.md) and its split count
    for a checked latent-cache call (`kv`: one KV head, head dims MLA_HEAD_DIM / MLA_HEAD_DIM_V).
    Its CTAs hold MLA_BLOCK_M packed rows (query tokens x heads); the splits merge through L2
    at a barrier (a cooperative launch: the split grid fits the GPU in one wave), never in a
    cluster; no programmatic launch (the kernel does not wait for the previous one itself).
    With one split, row blocks 2i and 2i + 1 whose rows are one query token's (one token a
    step, or a multiple of 2 MLA_BLOCK_M heads) see the same tiles: they run as a cluster of
    two CTAs that load each tile once for both (MLA_PAIRED, where such a cluster fits)."""
    config = MlaDecodeConfig(dtype)
    m_blocks = -(-kv.seqlen_q * kv.nheads // config.block_m)
    tiles = -(-kv.capacity // config.block_n)
    groups = m_blocks * kv.batch
    splits = 1
    if kv.batch and kv.seqlen_q and kv.nheads:
        slots = decode_slots(config, device_id)
        splits = _even(num_splits_for(num_splits, groups, tiles, slots), tiles)
    one_token = kv.seqlen_q == 1 or kv.nheads % (2 * config.block_m) == 0
    if MLA_PAIRED and splits == 1 and m_blocks % 2 == 0 and one_token and groups:
        paired = dataclasses.replace(config, paired=True)
        if _launch.extended_available() and _launch.cluster_fits(paired, device_id, 2):
            return DecodeChoice(paired, m_blocks, groups, 1, 2, False)
    return DecodeChoice(config, m_blocks, groups, splits, 1, False)


# ---------------------------------------------------------------------------------------------
# mma.sync tiles (flash_fwd.cu, flash_bwd.cu, flash_bwd_dq.cu, flash_decode.cu): by dtype, head
# dim and the architecture's shared memory.


def kernel_head_dim(head_dim: int) -> int:
    """The smallest kernel head dim that holds `head_dim`."""
    for d in KERNEL_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head dim {head_dim} is larger than {KERNEL_HEAD_DIMS[-1]}")


def v_kernel_head_dim(head_dim_v: int, head_dim: int) -> int:
    """The mma.sync forward's kernel head dim of V beside Q's `head_dim`: whole 64-column panels
    where Q's has them (a 32-column V tile, the other swizzle, spilled at 64 / 32; the loads
    zero-fill the columns past d_v)."""
    return max(kernel_head_dim(head_dim_v), min(64, kernel_head_dim(head_dim)))


#: Shared memory per SM (KiB) by compute capability; unknown newer archs get the small figure.
SMEM_PER_SM_KIB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228, 100: 228, 103: 228}
SMEM_PER_SM_KIB_DEFAULT = 100


@functools.lru_cache(maxsize=None)
def fwd_config(dtype: str, head_dim: int, arch: int, head_dim_v: int = 0) -> FwdConfig:
    """Tile shape for the forward kernel, measured on an H200 (docs/PERF_NOTES.md). With V's own
    `head_dim_v` (its kernel head dim at most Q's) the tile of Q's head dim, which its smaller V
    tiles fit as well.

    Up to d=128, 4 warps own 32 query rows each: two m16 tiles share every K/V fragment, which
    halves shared-memory reads per FLOP against 16 rows a warp (8-warp tiles measured 0.6-0.75x of
    the 4-warp ones). K/V tiles are double-buffered when two CTAs still fit on an SM, else FA2's
    single-buffered schedule is used. Above d=128 the accumulators of 32 rows no longer fit in
    registers: 8 warps own 16 rows each.
    """
    if dtype in FLOAT32_TAGS:
        return float32_fwd_config(dtype, head_dim, arch)
    d = kernel_head_dim(head_dim)
    d_v = v_kernel_head_dim(head_dim_v, head_dim) if head_dim_v else d
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    if d > 128:
        config = FwdConfig(dtype, d, block_m=128, block_n=64, num_warps=8, kv_stages=1,
                           head_dim_v=d_v)
        if config.smem_bytes + 1024 > smem_per_sm:  # 100 KiB parts: a 64-row Q tile
            config = FwdConfig(dtype, d, block_m=64, block_n=64, num_warps=4, kv_stages=1,
                               head_dim_v=d_v)
        return config
    # Preferred first; the first that fits two CTAs per SM wins (1 KiB a CTA is reserved).
    if d <= 64:
        shapes = [(128, 128, 2), (128, 64, 2), (128, 64, 1)]
    else:
        shapes = [(128, 64, 2), (128, 64, 1)]
    for block_m, block_n, stages in shapes:
        config = FwdConfig(dtype, d, block_m, block_n, num_warps=4, kv_stages=stages,
                           head_dim_v=d_v)
        if 2 * (config.smem_bytes + 1024) <= smem_per_sm:
            return config
    return config


#: The float32 forward's tiles (rows, warps, keys, K/V stages), preferred first: 16 rows a warp
#: (the TF32 parts of a fragment take twice the registers of a 16-bit one), the first of the
#: others that fits two CTAs on an SM, else one; the last, 16 keys a tile, where none fits (the
#: 100 KiB parts above d=192; 32 rows of 2 warps spilled there). Compiled without spills (ptxas report); not yet timed on a GPU.
FLOAT32_FWD_TILES = ((64, 4, 64, 2), (64, 4, 32, 2), (64, 4, 64, 1), (64, 4, 32, 1),
                     (64, 4, 16, 1))


def float32_fwd_config(element: str, head_dim: int, arch: int) -> FwdConfig:
    """The mma.sync forward's tile for float32 inputs (`element`: "float32" or "tf32",
    _configs.FLOAT32_TAGS): FLOAT32_FWD_TILES' choice for the architecture's shared memory."""
    d = kernel_head_dim(head_dim)
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    configs = [FwdConfig(element, d, block_m, block_n, num_warps, stages)
               for block_m, num_warps, block_n, stages in FLOAT32_FWD_TILES]
    for ctas in (2, 1):
        for config in configs[:-1]:
            if ctas * (config.smem_bytes + 1024) <= smem_per_sm:
                return config
    return configs[-1]


def fwd_mods_config(dtype: str, head_dim: int, arch: int) -> FwdConfig:
    """The mma.sync forward's tile with programmable modifiers (FwdModsConfig): up to d=128,
    64 x 64 tiles of 4 warps of 16 rows (the user's code runs on every score of a visited tile
    and on the 128-row tiles of fwd_config it spilled: the compile tests' expressions at d=64
    and 128, sm_80 and sm_90, ptxas report), double-buffered where two CTAs fit on an SM;
    above, fwd_config's (16 rows a warp already). Not yet timed on a GPU."""
    d = kernel_head_dim(head_dim)
    if d > 128:
        return fwd_config(dtype, head_dim, arch)
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    config = FwdConfig(dtype, d, 64, 64, num_warps=4, kv_stages=2)
    if 2 * (config.smem_bytes + 1024) > smem_per_sm:
        config = FwdConfig(dtype, d, 64, 64, num_warps=4, kv_stages=1)
    return config


#: Most fp32 accumulator registers a backward thread may keep (BwdConfig.accumulator_registers):
#: the rest of the 255 go to fragments, addresses and statistics.
BWD_MAX_ACCUMULATORS = 192


@functools.lru_cache(maxsize=None)
def bwd_config(dtype: str, head_dim: int, arch: int, deterministic: bool = False) -> BwdConfig:
    """Tile shape of the backward main kernel (docs/PERF_NOTES.md).

    FA2's shape where shared memory allows: 8 warps, a 128-key block (dQ atomics per FLOP fall
    as 1/block_n), 64-query steps with Q/dO double-buffered. The first candidate that has a warp
    grid for every phase, keeps its accumulators in registers and fits one CTA per SM wins;
    above d=128 the dK/dV/dQ columns are split in two chunks (grid.x) when that is needed.
    """
    if dtype in FLOAT32_TAGS:
        return float32_bwd_config(dtype, head_dim, arch, deterministic)
    d = kernel_head_dim(head_dim)
    # 128-query steps where the accumulators allow it (d <= 64): half the steps, same atomics.
    shapes = [(128, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 1), (64, 64, 8, 2), (64, 64, 8, 1),
              (32, 64, 4, 1), (32, 32, 4, 1)]
    config = _first_backward_tile(dtype, d, arch, deterministic, shapes)
    if config is None:
        raise AssertionError(f"no backward tile fits head dim {d} on sm_{arch}")
    return config


#: The float32 backward's tiles (query rows, keys, warps, Q stages), preferred first, the first
#: that fits (_first_backward_tile's rule) taken. Every tile, fragment and P / dS element takes
#: twice the 16-bit kernel's space (TF32 parts: twice the fragment registers at precision
#: highest), so the steps are half the 16-bit ones: 64 x 64 of 8 warps (32 x 16 / 16 x 32 warp
#: tiles) where shared memory holds it (sm_80 and sm_90 up to d=128 with one Q stage), then
#: 4-warp tiles down to 16 x 32 of 2 warps, the smallest whose P tile keeps 128-byte panels
#: (F32KeyPairCursor), which the 100 KiB parts need above d=128. d=256 fits no tile on those
#: (K, V, Q and dO alone take 96 KiB at 16 x 32). Compiled without spills (ptxas report;
#: docs/FLOAT32.md); not yet timed on a GPU.
FLOAT32_BWD_TILES = ((64, 64, 8, 2), (64, 64, 8, 1), (64, 32, 4, 1), (32, 64, 4, 1),
                     (32, 32, 4, 1), (16, 32, 2, 1))
#: BWD_MAX_ACCUMULATORS for float32: a TF32 fragment at precision highest is twice the
#: registers of a 16-bit one, so fewer are left to the accumulators (ptxas: 168-192 of them
#: spilled at d=192-256).
FLOAT32_BWD_MAX_ACCUMULATORS = 128


def split_bwd_configs(dtype: str, head_dim: int, head_dim_v: int, arch: int,
                      deterministic: bool = False):
    """The mma.sync backward's kernels for V's own head dim `head_dim_v` beside Q's `head_dim`
    (d_v != d_qk): (main kernel, deterministic dQ kernel or None), or None where they take no
    such call (float32; V's kernel head dim not below Q's; no warp grid for dV's columns).

    Q's head dim's tiles (bwd_config, bwd_dq_config: the smaller V, dO and dV take less shared
    memory and fewer registers) with V's kernel head dim: v_kernel_head_dim's (whole 64-column
    panels where Q's has them), or the next of KERNEL_HEAD_DIMS below Q's whose dV chunk phase
    B's warps split in 16-column tiles (192 / 96 on sm_80's one-chunk 8-warp tile: 24 columns
    a warp; it takes 128, the loads zero-filling V's and dO's columns past d_v). dV's chunks
    are as many as dK's, each head_dim_v / num_chunks columns (flash_bwd.cu)."""
    if dtype not in DTYPE_TAGS:
        return None
    d = kernel_head_dim(head_dim)
    main = bwd_config(dtype, head_dim, arch, deterministic)
    for d_v in KERNEL_HEAD_DIMS:
        if v_kernel_head_dim(head_dim_v, head_dim) <= d_v < d:
            config = dataclasses.replace(main, head_dim_v=d_v)
            if config.valid:
                dq = (dataclasses.replace(bwd_dq_config(dtype, head_dim, arch), head_dim_v=d_v)
                      if deterministic else None)
                return config, dq
    return None


def float32_bwd_config(element: str, head_dim: int, arch: int,
                       deterministic: bool = False) -> BwdConfig:
    """The mma.sync backward's tile for float32 inputs (`element`: "float32" or "tf32",
    _configs.FLOAT32_TAGS): FLOAT32_BWD_TILES' first that fits the architecture (the atomic dQ
    path's, without its dQ in deterministic mode); NotImplementedError where none fits (d > 192
    on the 100 KiB parts)."""
    # The smallest kernel head dim holding the call's with a tile (d=224's chunks of 112
    # columns have no 16-column warp grid in these tiles: it runs on d=256's).
    for d in KERNEL_HEAD_DIMS[KERNEL_HEAD_DIMS.index(kernel_head_dim(head_dim)):]:
        config = _first_backward_tile(element, d, arch, False, FLOAT32_BWD_TILES,
                                      FLOAT32_BWD_MAX_ACCUMULATORS)
        if config is not None:
            return dataclasses.replace(config, compute_dq=not deterministic)
    raise NotImplementedError(
        f"float32 backward at head dim {head_dim}: no tile fits the shared memory of "
        f"sm_{arch} ({SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT)} KiB an SM); "
        "float16 and bfloat16 inputs take it")


#: The float32 deterministic dQ kernel's (keys a K/V tile, K/V stages, CTAs an SM) preferred
#: first: its Q and dO tiles (64 rows) and K/V tiles are twice the 16-bit ones, so 32 keys a
#: tile where they fit (16 above: the dQ accumulator of a whole row takes the registers).
FLOAT32_BWD_DQ_TILES = ((32, 2, 2), (32, 1, 2), (32, 2, 1), (32, 1, 1), (16, 1, 1))


def float32_bwd_dq_config(element: str, head_dim: int, arch: int) -> BwdDqConfig:
    """The deterministic dQ kernel's tile for float32 inputs: the first of FLOAT32_BWD_DQ_TILES
    that fits (NotImplementedError where none does: above d=128 on the 100 KiB parts, whose
    64-row Q and dO tiles alone take 64 KiB at d=128)."""
    d = kernel_head_dim(head_dim)
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    for block_n, stages, ctas in FLOAT32_BWD_DQ_TILES:
        if block_n > 16 and d > 128:
            continue
        config = BwdDqConfig(element, d, block_n, stages)
        if ctas * (config.smem_bytes + 1024) <= smem_per_sm:
            return config
    raise NotImplementedError(
        f"deterministic=True: float32 backward at head dim {head_dim}: the deterministic dQ "
        f"kernel's tile does not fit the shared memory of sm_{arch}; pass deterministic=False")


def _first_backward_tile(dtype: str, d: int, arch: int, deterministic: bool, shapes,
                         max_accumulators: int = BWD_MAX_ACCUMULATORS):
    """The first (block_m, block_n, warps, Q stages) of `shapes` (each with the whole head dim
    d, then above d=128 with half of it a chunk) that has a warp grid for every phase, keeps its
    accumulators (at most `max_accumulators` registers) in registers and fits one CTA per SM;
    None where none does."""
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    chunks = [d] if d <= 128 else [d, d // 2]
    for block_m, block_n, warps, stages in shapes:
        for d_chunk in chunks:
            config = BwdConfig(dtype, d, d_chunk, block_m, block_n, warps, stages,
                               not deterministic)
            if (config.valid and config.accumulator_registers <= max_accumulators
                    and config.smem_bytes + 1024 <= smem_per_sm):
                return config
    return None


def bwd_mods_config(dtype: str, head_dim: int, arch: int,
                    deterministic: bool = False) -> BwdConfig:
    """The mma.sync backward's tile with programmable modifiers (BwdModsConfig): bwd_config's
    rule over its shapes of at most 64 x 64 (query x key) steps, at every head dim.
    The user's code and its derivative run on every score of phase A; ptxas (the compile tests'
    expressions, fp16 and bf16, sm_80 and sm_90; registers / spill stores, atomic dQ and
    deterministic alike):

        d    tile (m x n, warps, Q stages)   rel-pos score + doc mask   softcap-like + grad
        64   128 x 128, 8, 2 (bwd_config)    255 / 0                    255 / 0
        128  64 x 128, 8, 2 (bwd_config)     255 / 0 to 8               255 / 56 to 92
        128  64 x 128, 8, 1                  255 / 0 to 8               255 / 60 to 88
        128  64 x 64, 4, 2                   255 / 0 to 44              255 / 76 to 92
        128  64 x 64, 8, 2 (this)            178 to 189 / 0             171 to 178 / 0

    With the additive bias (`score + cf2_bias(b, h, q_idx, kv_idx)`, a 4-D input: four strides)
    bwd_config's 128 x 128 tile at d=32 and d=64 spills 12 to 36 bytes, with dbias
    (FEATURE_BIAS_GRAD) or without; 64 x 64, 8 warps: 118 to 166 registers, no spills (fp16,
    sm_80 / sm_90). Hence 64 x 64 at d <= 64 too.

    Not yet timed on a GPU."""
    d = kernel_head_dim(head_dim)
    config = _first_backward_tile(dtype, d, arch, deterministic, (
        (64, 64, 8, 2), (64, 64, 8, 1), (32, 64, 4, 1), (32, 32, 4, 1)))
    if config is not None:
        return config
    raise AssertionError(f"no backward tile with programmable modifiers fits head dim {d} on "
                         f"sm_{arch}")


@functools.lru_cache(maxsize=None)
def bwd_dq_config(dtype: str, head_dim: int, arch: int) -> BwdDqConfig:
    """Tile shape of the deterministic dQ kernel: double-buffered K/V when two CTAs fit."""
    if dtype in FLOAT32_TAGS:
        return float32_bwd_dq_config(dtype, head_dim, arch)
    d = kernel_head_dim(head_dim)
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    for block_n, stages, ctas in ((64, 2, 2), (64, 1, 2), (64, 1, 1), (32, 1, 1)):
        config = BwdDqConfig(dtype, d, block_n, stages)
        if ctas * (config.smem_bytes + 1024) <= smem_per_sm:
            return config
    return config


#: The decode kernel's cp.async stage counts tried (decode_config): with a 16-bit cache, and with
#: an e4m3 one, whose tiles hold half the bytes (so more of them are in flight for the same bytes).
DECODE_STAGES = {None: (2, 3, 4), "e4m3": (2, 3, 4, 5, 6)}


@functools.lru_cache(maxsize=None)
def decode_config(dtype: str, head_dim: int, arch: int, block_m: int = DECODE_BLOCK_M,
                  kv_cache_dtype: str | None = None) -> DecodeConfig:
    """4 warps of 16 keys (64-key tiles); of the cp.async stage counts (2 to 4) and CTAs per SM
    that fit, the one with the most KV tiles in flight per SM (CTAs x (stages - 1)), at least two
    CTAs per SM where possible, more CTAs on a tie: decoding is bound by the cache bytes in
    flight, and a single CTA per SM leaves mid-sized grids short of them (H200, d=128: two CTAs
    of three stages beat three of two and one of four, docs/DECODE_DESIGN.md). 2 warps where
    even one CTA of two stages does not fit. `block_m`: DECODE_BLOCK_M, or DECODE_BLOCK_M_N8
    for the rows on the mma's n side. `kv_cache_dtype` "e4m3": an FP8 cache, up to 6 stages of
    half the bytes each (DECODE_STAGES; not yet timed on a GPU)."""
    d = kernel_head_dim(head_dim)
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    for warps, min_ctas in ((4, 2), (4, 1), (2, 1)):
        fitting = []
        for stages in DECODE_STAGES[kv_cache_dtype]:
            config = DecodeConfig(dtype, d, warps, 16, stages, block_m=block_m,
                                  kv_cache_dtype=kv_cache_dtype)
            ctas = min(3, smem_per_sm // (config.smem_bytes + 1024))  # 3: the register budget
            if ctas >= min_ctas:
                fitting.append((ctas * (stages - 1), ctas, config))
        if fitting:
            return max(fitting, key=lambda f: f[:2])[2]
    raise AssertionError(f"no decode tile fits head dim {d} on sm_{arch}")


#: A decoding step whose splits merge inside a cluster is short: at most this many KV tiles a
#: split (beyond, more CTAs merging through L2 stream the cache faster; docs/DECODE_DESIGN.md).
CLUSTER_MAX_TILES_PER_SPLIT = 4
#: The first compute capability with thread-block clusters.
CLUSTER_MIN_ARCH = 90


def decode_cluster_config(dtype: str, head_dim: int, arch: int, early_cache_reads: bool = False,
                          kv_cache_dtype: str | None = None) -> DecodeConfig:
    """The decode kernel for splits merged inside a cluster (sm_90): such a step is short (at
    most CLUSTER_MAX_TILES_PER_SPLIT of decode_config's tiles a split) and its grid small (one
    CTA an SM), so every key of a split is loaded at once: in kv_stages - 1 stages, or, with
    `early_cache_reads`, in kv_stages, all but the last tile before the previous kernel ends
    (loading every tile then delayed that kernel's end: 8.55 against 8.25 us a layer at 4k
    tokens in a graph, H200). Of the tiles that fit one CTA so, the widest: 32 keys a warp where
    it fits (half the tile steps, each with its barrier and softmax: 9.45 against 9.71 us a
    layer at 4k in a graph), 16 otherwise; failing both, as many stages as one CTA fits."""
    config = dataclasses.replace(decode_config(dtype, head_dim, arch,
                                               kv_cache_dtype=kv_cache_dtype),
                                 early_cache_reads=early_cache_reads)
    smem_per_sm = SMEM_PER_SM_KIB.get(arch, SMEM_PER_SM_KIB_DEFAULT) * 1024
    split_keys = CLUSTER_MAX_TILES_PER_SPLIT * config.block_n
    extra_stage = 0 if early_cache_reads else 1
    candidates = [dataclasses.replace(
        config, keys_per_warp=keys,
        kv_stages=max(2, -(-split_keys // (config.num_warps * keys)) + extra_stage))
        for keys in (32, 16)]
    candidates += [dataclasses.replace(config, kv_stages=stages)
                   for stages in range(CLUSTER_MAX_TILES_PER_SPLIT, config.kv_stages, -1)]
    return next((c for c in candidates if c.smem_bytes + 1024 <= smem_per_sm), config)


# ---------------------------------------------------------------------------------------------
# Hopper forward (cuda_src/flash_fwd_sm90.cu; docs/HOPPER_FWD.md): on sm_90 wherever
# hopper_forward_config covers a call (CUFLASH2_HOPPER=0 turns it off).

#: CUFLASH2_HOPPER=0 keeps every forward on the mma.sync kernels (read when a call signature is
#: planned; tests flip `HOPPER_FORWARD` and clear the plan caches).
HOPPER_FORWARD = os.environ.get("CUFLASH2_HOPPER", "1") != "0"
#: Varlen calls (attention_varlen) on the Hopper forward (FEATURE_VARLEN; docs/HOPPER_FWD.md,
#: "Varlen"). CUFLASH2_HOPPER_VARLEN=0 keeps them on the mma.sync kernel (tests flip
#: `HOPPER_FORWARD_VARLEN` and clear the plan caches).
HOPPER_FORWARD_VARLEN = os.environ.get("CUFLASH2_HOPPER_VARLEN", "1") != "0"
#: Calls with a mask modifier (no score modifier or bias, no block mask) on the Hopper forward
#: (FwdSm90ModsConfig) where it covers their other features, up to head dim
#: HOPPER_MODS_MAX_HEAD_DIM. ptxas, bf16, every dispatched schedule and grid (consumers at 240
#: registers): a document mask spills nothing at d=64 to 192 and 168 bytes at d=256; a score
#: modifier spills 32 to 88 bytes (the bias's 4-D input at d=64 / 128, a relative-position
#: table on the persistent grid at d=128), so those stay on the mma.sync mods kernel.
#: CUFLASH2_HOPPER_MODS=0 keeps every modifier there. With a block mask, head dims up to
#: HOPPER_BLOCK_MASK_MAX_HEAD_DIM (whose KV tiles, 128 keys, are whole multiples of the states'
#: 64: BlockMaskNarrow reads a Hopper tile's states).
HOPPER_FORWARD_MODS = os.environ.get("CUFLASH2_HOPPER_MODS", "1") != "0"
HOPPER_MODS_MAX_HEAD_DIM = 192
HOPPER_BLOCK_MASK_MAX_HEAD_DIM = 128
#: Float32 calls at precision "tf32" on the Hopper forward with TF32 wgmma (tf32_tag;
#: docs/FLOAT32.md, "Hopper"), dense calls up to head dim 128 with the variant's features, and
#: at precision "highest" (f32x3_tag, 3xTF32: F32X3_SM90_FWD_TILES) too:
#: CUFLASH2_HOPPER_TF32=0 keeps both on the mma.sync kernel, CUFLASH2_HOPPER_F32X3=0 "highest"
#: alone. The 3xTF32 Hopper forward passed the GPU tests up to d=128 and runs in about half the
#: mma.sync 3xTF32 kernel's time (H100, 4k tokens: 1.41 against 2.98 ms at d=64, 3.52 against
#: 6.65 at d=128; benchmarks/results/2026-12-07-h100-float32-3xtf32-hopper-66450ef.md).
HOPPER_FORWARD_TF32 = os.environ.get("CUFLASH2_HOPPER_TF32", "1") != "0"
HOPPER_FORWARD_F32X3 = os.environ.get("CUFLASH2_HOPPER_F32X3", "1") != "0"
#: (block_n, stages) of the TF32 Hopper forward by kernel head dim, block_m 128, ping-pong with
#: the overlap inside a warpgroup. A float32 row takes the shared memory of a 16-bit row of twice
#: the head dim: d=64 as 16-bit d=128 (128 keys, 2 stages: 164,864 B), d=96 and 128 with 64 keys
#: a tile (3 stages: 197,632 B; 2 stages: 197,632 B). Registers: O 64 + S 32 + P 32 at d=128
#: (ptxas: 168 at entry, no spills). H100, 4k tokens: 244 TFLOP/s at d=64, 303 at d=128 (the
#: operand pass included).
TF32_SM90_FWD_TILES = {64: (128, 2), 96: (64, 3), 128: (64, 2)}
#: (block_n, stages) of the 3xTF32 Hopper forward (precision "highest", "float32") by kernel head
#: dim, block_m 128, ping-pong with the overlap inside a warpgroup. Q is held in two parts and a
#: stage holds K and V's big and small parts (4 tiles): d=64 with 64 keys a tile (Q 64 KiB +
#: 2 x 64 KiB), d=96 with 32 (Q 96 KiB + 2 x 48 KiB), both 197,632 B. Registers: O 48 + S 16 +
#: P 2 x 16 at d=96, O 32 + S 32 + P 2 x 32 at d=64 (ptxas: 168 at entry, no spills). Passed
#: the GPU tests (H100, 2026-12-07): 98 TFLOP/s at d=64, 4k tokens.
#: d=128 takes 64 query rows a CTA (F32X3_SM90_FWD_BLOCK_M: one consumer warpgroup, the in-order
#: schedule with the overlap): at 128 rows Q's two parts alone take 128 KiB and two 32-key
#: stages 128 KiB more; at 64, Q 64 KiB + 2 x 64 KiB = 197,632 B. Registers: O 64 + S 16 + P
#: 2 x 16 (ptxas: no spills). Passed the GPU tests (H100): 78 TFLOP/s at 4k tokens.
F32X3_SM90_FWD_TILES = {64: (64, 2), 96: (32, 2), 128: (32, 2)}
#: block_m of the 3xTF32 Hopper forward where it is not 128 (one consumer warpgroup).
F32X3_SM90_FWD_BLOCK_M = {128: 64}
#: The float32 Hopper forwards' tiles by element ("tf32", "float32").
FLOAT32_SM90_FWD_TILES = {"tf32": TF32_SM90_FWD_TILES, "float32": F32X3_SM90_FWD_TILES}

#: The FP8 forward (e4m3 q, k, v: E4M3_TAGS; docs/FP8_FORWARD.md): (block_n, stages, overlap) by
#: kernel head dim, block_m 128, ping-pong. An e4m3 row is half a 16-bit row (d=128: one
#: 128-byte panel), V is transposed keys-last into panels of 128 keys (a multiple of 32 keys a
#: tile: E4M3_WIDE_TILES), and O, 16-bit, is staged in a Q region twice Q's bytes. Registers
#: (ptxas, no spills): S block_n / 2, P block_n / 8, O head_dim / 2; at d=128 with 256 keys and
#: at d=256 with the overlap inside a warpgroup ptxas spills, so d=128 takes 128 keys and d=256
#: the plain ping-pong.
#: Shared memory: d=64 256 keys x 3 stages, d=128 128 keys x 4 stages (164,864 B each), d=256
#: 128 keys x 2 stages (197,632 B).
E4M3_SM90_FWD_TILES = {64: (256, 3, True), 128: (128, 4, True), 256: (128, 2, False)}
#: Wider key tiles of the FP8 forward, (block_n, stages, overlap) by kernel head dim, forced by
#: benchmarks/dev/fp8_variants_ab.py's `w<block_n>` variants (docs/FP8_FORWARD_NEXT.md, step 6);
#: E4M3_WIDE_TILE_KEYS dispatches those that measured faster.
#: FlashAttention-3's FP8 d=128 tile is 128 x 224 with the overlap; per key a wider tile pays
#: less of O's rescale (the row max moves with every tile at e4m3) and of each tile's waits and
#: arrivals. The transposed V's last panel then holds 32-key groups (160: one, 224: three) in
#: a whole panel's shared memory. ptxas (sm_90a, 240 consumer registers): 160, 192 and 224 keys
#: with the overlap compile without spills (192 and 224: Q's descriptors made each tile,
#: FwdSm90Traits::FRESH_Q_DESCRIPTORS; 224 also needs the boundary mask's tests against
#: immediates, masking.cuh, else ptxas kept a register a key and spilled 344 bytes); 3 stages at
#: 160 (214,016 B with one raw V buffer), 2 at 192 (197,632 B with two) and 224 (214,016 B with
#: two).
E4M3_WIDE_TILES = {128: ((160, 3, True), (192, 2, True), (224, 2, True))}
#: (block_n of E4M3_WIDE_TILES, least keys) by kernel head dim: the FP8 forward of non-causal
#: rows without a window from that many keys on. H100, 2026-12-07 (fp8_variants_ab.py, rounds
#: alternating on the same arrays): 224 keys with the overlap 1.065 / 1.063 / 1.109x at 4k / 8k
#: / 16k keys against 224 without it (the tile dispatched before, itself 1.04 / 1.08 / 1.03x
#: over 128 keys), 1.01x over 128 keys at 2k, 0.79-0.94x at 512-1k; causal 0.69-0.97x up to 8k,
#: 1.03x at 16k. 192 keys with the overlap: 1.02-1.05x from 2k non-causal, below 224 from 4k.
E4M3_WIDE_TILE_KEYS = {128: (224, 4096)}


#: (block_n, stages) of the Hopper forward per head dim, block_m 128 (two consumer warpgroups of
#: 64 rows) throughout. Two limits decide: shared memory, Q + stages x (K + V) of 64-column
#: panels + 1 KiB within 227 KiB (one CTA an SM), and the consumers' 240 registers, which hold O
#: (head_dim / 2 floats a thread), S (block_n / 2) and P (block_n / 4) at once. FlashAttention-3
#: (hopper/tile_size.h, 16-bit, 2 stages) takes the largest block_n that fits shared memory for
#: the large head dims: d=192 128 x 112 and d=256 128 x 80 (both "hit the limit of smem"), and
#: 128 x 128/176 at d=128, 192 x 144 at d=96 (three consumer warpgroups, P V from shared memory:
#: a structure this kernel does not have).
#:  - 64, 128: 128 x 128, 2 stages, as first built and run (unchanged).
#:  - 96: 128 x 128, 3 stages. Its tiles take two panels like d=128 (the second half
#:    zero-filled), so two stages cost what d=128's do (161 KiB) and a third fits (225 KiB); with
#:    a quarter less math per tile than d=128 the loads have less time to land, which the extra
#:    stage buys back. Registers: O 48 + S 64 + P 32.
#:  - 192: 128 x 112, 2 stages: 217 KiB (128 keys would need 241 KiB). O 96 + S 56 + P 28.
#:  - 256: 128 x 80, 2 stages: 225 KiB (96 keys would need 257 KiB). O 128 + S 40 + P 20.
#: Ping-pong and the overlap inside a warpgroup, alone or together, fit all of them (ptxas: no
#: spills at 240 registers, R237 at most; docs/HOPPER_FWD.md), on either grid (the persistent
#: one with SM90_PERSISTENT_TILES).
SM90_FWD_TILES = {64: (128, 2), 96: (128, 3), 128: (128, 2), 192: (112, 2), 256: (80, 2)}


#: (block_n, stages) of the Hopper forward with V's head dim apart from Q's and K's, by (d_qk,
#: d_v) of SM90_FWD_HEAD_DIM_PAIRS, block_m 128. V's smaller tiles leave room for 128 keys:
#:  - (192, 128): Q 48 KiB + 2 x (K 48 + V 32 KiB) = 209 KiB (d=192's own 128 keys: 241 KiB).
#:    FlashAttention-3 (hopper/tile_size.h) takes 128 x 128 for it under causal masking with
#:    the overlap, 112 keys otherwise. Registers: O 64 + S 64 + P 32, d=128's.
#:  - (128, 64): Q 32 KiB + 2 x (K 32 + V 16 KiB) = 129 KiB; with the persistent grid's O
#:    buffer (16 KiB) 145 KiB. Registers: O 32 + S 64 + P 32.
#: The schedule is Q's head dim's (SCHEDULES).
SM90_SPLIT_HEAD_DIM_TILES = {(192, 128): (128, 2), (128, 64): (128, 2)}
#: The (Q's and K's, V's) kernel head dims where V's differs that the Hopper kernels take:
#: DeepSeek's prefill (192 / 128) and (128, 64). V's at most Q's: the forward stages O in Q's
#: buffer (FwdSm90Traits), the backward's dV lies in the first head-dim chunk (BwdSm90Traits).
SM90_FWD_HEAD_DIM_PAIRS = tuple(SM90_SPLIT_HEAD_DIM_TILES)


#: (block_n, stages) of the persistent Hopper forward, for the head dims where its O buffer (Q's
#: size) fits beside Q and the ring: d=64 99,328 B and d=128 197,632 B with their usual tiles;
#: d=96 drops to 2 stages (197,632 B; 3 would need 263,168 B); d=192 (271,360 B) and d=256
#: (295,936 B) do not fit even with their 2 stages, and have no persistent specialisation.
SM90_PERSISTENT_TILES = {64: (128, 2), 96: (128, 2), 128: (128, 2)}

#: (block_n, stages) of the Hopper forward with three consumer warpgroups (block_m 192,
#: FlashAttention-3's d=64 tile; either grid: 91,136 / 115,712 B), for the head dims where their
#: 160 registers a thread hold O, S and P of the in-order schedule without spilling: d=64 (O 32 +
#: S 64 + P 32; the overlap inside a warpgroup spills 104 B there, d=128 would need O 64 more).
SM90_THREE_CONSUMER_TILES = {64: (128, 2)}


def fwd_sm90_config(dtype: str, head_dim: int, persistent: bool = False,
                    consumers: int = 2, head_dim_v: int = 0) -> FwdSm90Config:
    """The Hopper forward's tile for `head_dim` (one of SM90_FWD_HEAD_DIMS): SM90_FWD_TILES, or
    SM90_PERSISTENT_TILES for the persistent grid; with three `consumers` (warpgroups of 64 query
    rows) SM90_THREE_CONSUMER_TILES (either grid). With V's own `head_dim_v` (the pair one of
    SM90_FWD_HEAD_DIM_PAIRS) SM90_SPLIT_HEAD_DIM_TILES, two consumers, either grid where the O
    buffer fits. ValueError for a head dim it does not have."""
    if head_dim not in SM90_FWD_HEAD_DIMS:
        raise ValueError(f"the Hopper forward has head dims {SM90_FWD_HEAD_DIMS}, not {head_dim}")
    if head_dim_v and head_dim_v != head_dim:
        if (head_dim, head_dim_v) not in SM90_SPLIT_HEAD_DIM_TILES or consumers != 2:
            raise ValueError(f"the Hopper forward has (Q's, V's) head dims "
                             f"{SM90_FWD_HEAD_DIM_PAIRS} with two consumer warpgroups, not "
                             f"({head_dim}, {head_dim_v}) with {consumers}")
        block_n, stages = SM90_SPLIT_HEAD_DIM_TILES[head_dim, head_dim_v]
        config = FwdSm90Config(dtype, head_dim, block_n=block_n, stages=stages,
                               persistent=persistent, head_dim_v=head_dim_v)
        if config.smem_bytes > SM90_MAX_SMEM:  # (a tile of the table that does not fit)
            raise ValueError(f"the Hopper forward's ({head_dim}, {head_dim_v}) tile needs "
                             f"{config.smem_bytes} bytes of shared memory, more than "
                             f"{SM90_MAX_SMEM}")
        return config
    if persistent and head_dim not in SM90_PERSISTENT_TILES:
        raise ValueError(f"the persistent Hopper forward has head dims "
                         f"{tuple(SM90_PERSISTENT_TILES)} (its O buffer must fit shared memory), "
                         f"not {head_dim}")
    if consumers == 3:
        if head_dim not in SM90_THREE_CONSUMER_TILES:
            raise ValueError(f"three consumer warpgroups run head dims "
                             f"{tuple(SM90_THREE_CONSUMER_TILES)}, not {head_dim}")
        block_n, stages = SM90_THREE_CONSUMER_TILES[head_dim]
        return FwdSm90Config(dtype, head_dim, block_m=192, block_n=block_n, stages=stages,
                             persistent=persistent)
    if consumers != 2:
        raise ValueError(f"the Hopper forward has two or three consumer warpgroups, not "
                         f"{consumers}")
    block_n, stages = (SM90_PERSISTENT_TILES if persistent else SM90_FWD_TILES)[head_dim]
    return FwdSm90Config(dtype, head_dim, block_n=block_n, stages=stages, persistent=persistent)


def plannable(problem, head_dims) -> bool:
    """What both Hopper kernels need of a call before its tiles and maps: a head dim one of
    `head_dims` holds, no empty dimension (a tensor map has none), and the driver bindings that
    encode the maps."""
    p = problem
    return (p.head_dim <= max(head_dims) and min(p.batch, p.seqlen_q, p.seqlen_k, p.nheads) >= 1
            and _hopper.bindings_available())


#: The consumer schedule by (kernel head dim, causal): (pingpong, overlap). Ping-pong (one
#: warpgroup's softmax under the other's GEMMs) and the overlap inside a warpgroup (tile j's
#: softmax under P_{j-1} V_{j-1}) where they measured fastest on the H200; at d=192/256 the
#: overlap alone, whose 128-row tiles keep both warpgroups' GEMMs back to back
#: (benchmarks/dev/hopper_fwd_check.py --schedule all; docs/PERF_NOTES.md, "Hopper forward").
SCHEDULES = {(64, False): (True, True), (64, True): (True, True),
             (96, False): (True, True), (96, True): (True, True),
             (128, False): (True, True), (128, True): (True, True),
             (192, False): (False, True), (192, True): (False, True),
             (256, False): (False, True), (256, True): (False, True)}


#: Short d=64 problems stay on the mma.sync kernel: with at most 256 keys a CTA of the Hopper
#: kernel visits two K/V tiles or fewer, too few to hide its fixed cost (barrier set-up, the Q
#: load, a 384-thread CTA at one per SM): the mma.sync kernel measured 16% faster at 128 x 128
#: on the H200, while at 512 tokens the Hopper kernel's persistent grid is 12-16% faster than
#: mma.sync (docs/PERF_NOTES.md, "Hopper forward").
MMA_SYNC_MAX_DIM = 64
MMA_SYNC_MAX_KEYS = 256

#: A key bound that no call reaches.
NO_LIMIT = 1 << 62

#: The persistent grid (at most one CTA per SM looping over work tiles, the next tile's Q and
#: K/V loaded under the current epilogue) runs the dense calls with at most this many keys, by
#: (kernel head dim, causal), with the static schedule; causal calls also where they claim
#: their tiles dynamically (DYNAMIC_SCHEDULE_KEYS). Short rows, where each CTA's tile is short
#: and its fixed cost shows, measured 3-18% faster on the H200; at d=128 without a key limit
#: every length from 1k to 16k too (1.01-1.09x, the pair order; 2026-12-03), while the static
#: schedule of causal rows loses to the one-tile grid from 2k keys on (up to 11% at 16k: its
#: CTAs end apart). Head dims without a persistent kernel (192, 256: no room for the O buffer)
#: and varlen calls never take it.
PERSISTENT_MAX_KEYS = {(64, False): 2048, (64, True): 4096, (96, False): 512, (96, True): 1024,
                       (128, False): NO_LIMIT, (128, True): 1024}


#: Three consumer warpgroups (192 query rows a CTA, SM90_THREE_CONSUMER_TILES; the
#: in-order schedule, since ping-pong takes two and the overlap inside a warpgroup spills at
#: their 160 registers) run the calls with at least this many keys, by (kernel head dim,
#: causal), without a window (a full or causal mask) and not varlen; on the persistent grid up
#: to THREE_CONSUMER_PERSISTENT_MAX_KEYS keys (every length: 1.00-1.07x the one-tile grid
#: non-causal, causal with dynamic claims from 2k keys on; 2026-12-03). At d=64 each key tile's
#: exponentials take the multi-function unit about as long as its two GEMMs take the tensor
#: cores: with three warpgroups one's softmax runs under the others' GEMMs without a turn
#: protocol. H200, bf16
#: (docs/PERF_NOTES.md, "Hopper forward"): 1.01-1.15x the two-consumer kernel non-causal from 512
#: to 16k keys, causal 1.00-1.07x from 2k keys on (0.89-0.90x at 512-1k: 192-row tiles of a
#: short causal row are mostly masked).
THREE_CONSUMER_MIN_KEYS = {(64, False): 0, (64, True): 2048}
THREE_CONSUMER_PERSISTENT_MAX_KEYS = NO_LIMIT


def hopper_forward_config(problem, features: int, window, arch: int, varlen=None):
    """The Hopper forward's configuration for a checked call, or None where the call stays on
    the mma.sync kernel: not sm_90, switched off, float32 inputs (but for precision "tf32":
    tf32_hopper_forward_config), dropout, varlen unless HOPPER_FORWARD_VARLEN,
    a head dim beyond the Hopper kernels', or an empty problem (forward_kernel then asks the
    TMA to describe q, k and v).

    Varlen (`varlen` given; `problem` has the sequence count as batch and the max lengths as
    seqlens): the maps cover the packed (total, heads, dim) arrays as rank-4 maps with a batch
    extent of 1 (the dense maps' geometry, _hopper.as_batched), each CTA adds its sequence's
    first row to its row coordinates (flash_fwd_sm90.cu)."""
    p = problem
    if p.dtype in E4M3_TAGS:
        return e4m3_hopper_forward_config(p, features, arch, varlen, window)
    if HOPPER_FORWARD and arch == 90 and p.dtype in FLOAT32_SM90_FWD_TILES:
        return tf32_hopper_forward_config(p, features, varlen)
    if (not HOPPER_FORWARD or arch != 90 or p.dtype not in DTYPE_TAGS
            or (varlen is not None and not HOPPER_FORWARD_VARLEN)):
        return None
    covered = FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINKS
    if varlen is not None:
        covered |= FEATURE_VARLEN
    if features & ~covered:
        return None
    if not plannable(p, SM90_FWD_HEAD_DIMS):
        return None
    kernel_dim = hopper_forward_head_dim(p.head_dim)
    # V's own head dim (d_v != d_qk): its kernel dim pairs with Q's (SM90_SPLIT_HEAD_DIM_TILES),
    # and the mma.sync kernel has no such specialisation to leave short calls to.
    kernel_dim_v = hopper_forward_head_dim(p.head_dim_v)
    split = kernel_dim_v != kernel_dim
    if split and (kernel_dim, kernel_dim_v) not in SM90_SPLIT_HEAD_DIM_TILES:
        return None
    if (p.head_dim_v == p.head_dim and kernel_dim <= MMA_SYNC_MAX_DIM
            and p.seqlen_k <= MMA_SYNC_MAX_KEYS):
        return None
    causal = window[1] == 0 and window[0] < 0
    unwindowed = window[0] < 0 and (window[1] < 0 or causal)
    claims = varlen is None and dynamic_schedule(kernel_dim, p.seqlen_q, p.seqlen_k, window[1])
    if (varlen is None and unwindowed and not split
            and p.seqlen_k >= THREE_CONSUMER_MIN_KEYS.get((kernel_dim, causal), NO_LIMIT)):
        persistent = p.seqlen_k <= THREE_CONSUMER_PERSISTENT_MAX_KEYS
        config = with_features(
            fwd_sm90_config(p.dtype, kernel_dim, persistent, consumers=3), features)
    else:
        persistent = varlen is None and (
            p.seqlen_k <= PERSISTENT_MAX_KEYS.get((kernel_dim, causal), 0) or causal and claims)
        config = fwd_sm90_config(p.dtype, kernel_dim, persistent,
                                 head_dim_v=kernel_dim_v if split else 0)
        pingpong, overlap = SCHEDULES[kernel_dim, causal]
        config = dataclasses.replace(with_features(config, features),
                                     pingpong=pingpong, overlap=overlap)
    if config.persistent and claims:
        config = dataclasses.replace(config, claims=True)
    return config


def tf32_hopper_forward_config(problem, features: int, varlen=None):
    """The float32 Hopper forward's configuration for a checked float32 call at precision "tf32"
    (TF32_SM90_FWD_TILES) or "highest" (problem.dtype "float32", 3xTF32: F32X3_SM90_FWD_TILES),
    or None where it stays on the mma.sync kernel: switched off (HOPPER_FORWARD_TF32, and for
    "highest" HOPPER_FORWARD_F32X3), varlen (the keys-last V groups keys by 8 from each
    sequence's start), features beyond the variant's, a head dim past the tiles' (128), an empty
    problem."""
    p = problem
    element = "float32" if p.dtype == "float32" else "tf32"
    tiles = FLOAT32_SM90_FWD_TILES[element]
    dims = tuple(tiles)
    if (not HOPPER_FORWARD_TF32 or (element == "float32" and not HOPPER_FORWARD_F32X3)
            or varlen is not None or p.head_dim_v != p.head_dim
            or features & ~(FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINKS)
            or not plannable(p, dims)):
        return None
    return float32_sm90_config(element, hopper_forward_head_dim(p.head_dim, dims), features)


def float32_sm90_config(element: str, kernel_dim: int, features: int = 0) -> FwdSm90Config:
    """The float32 Hopper forward of `element` ("tf32", or "float32": 3xTF32) at `kernel_dim`:
    FLOAT32_SM90_FWD_TILES' tile, ping-pong with the overlap inside a warpgroup; with one
    consumer warpgroup (F32X3_SM90_FWD_BLOCK_M) the in-order schedule with the overlap."""
    block_n, stages = FLOAT32_SM90_FWD_TILES[element][kernel_dim]
    block_m = (F32X3_SM90_FWD_BLOCK_M.get(kernel_dim, 128) if element == "float32" else 128)
    return FwdSm90Config(element, kernel_dim, block_m=block_m, block_n=block_n, stages=stages,
                         pingpong=block_m == 128, overlap=True, features=features)


def e4m3_hopper_forward_config(problem, features: int, arch: int, varlen=None,
                               window=(-1, -1)):
    """The FP8 forward's configuration (E4M3_SM90_FWD_TILES) for a checked e4m3 call, or
    NotImplementedError naming what it lacks: it runs on the Hopper kernel alone (sm_90), head
    dims of E4M3_SM90_FWD_TILES (q's, k's and v's alike), causal masks and windows but no other
    feature, at least one key (forward_kernel plans no launch for a call without queries, heads
    or batch entries).

    Varlen (`varlen` given, FEATURE_VARLEN in `features`): the one-tile-per-CTA grid with
    FEATURE_VARLEN compiled in, as the 16-bit varlen forward (V is read in place and transposed
    in the kernel, so a packed sequence needs nothing of its own; the descales are read by
    sequence); HOPPER_FORWARD_VARLEN does not apply (no other kernel reads e4m3). At least one
    key in the packed k (a map has no empty extent); a sequence without keys gets out 0 and lse
    +inf as in 16-bit calls. The persistent grids stay dense-only, as the 16-bit ones."""
    p = problem
    dims = tuple(E4M3_SM90_FWD_TILES)
    if arch != 90:
        raise NotImplementedError(
            f"FP8 (e4m3) inputs run on the Hopper forward: sm_90 (H100, H200) only; this device "
            f"is sm_{arch} (cuflash2.fp8.dequantize_e4m3 gives 16-bit inputs for the others)")
    named = [name for bit, name in ((FEATURE_SOFTCAP, "softcap"), (FEATURE_ALIBI, "alibi_slopes"),
                                    (FEATURE_SINKS, "sinks"), (FEATURE_DROPOUT, "dropout_p"))
             if features & bit]
    if varlen is not None:
        features &= ~FEATURE_VARLEN
    if features:
        raise NotImplementedError(
            f"{', '.join(named) or 'these options'}: not with FP8 (e4m3) inputs yet (they take "
            f"causal masks, windows and GQA)")
    if p.head_dim_v != p.head_dim or p.head_dim not in dims:
        raise NotImplementedError(
            f"FP8 (e4m3) inputs: head dims {', '.join(map(str, dims))} (q's, k's and v's the "
            f"same); got q's {p.head_dim} and v's {p.head_dim_v}")
    if not _hopper.bindings_available():
        raise NotImplementedError("FP8 (e4m3) inputs need the CUDA driver bindings "
                                  "(cuda-bindings, which encode the Hopper forward's TMA "
                                  "descriptors): pip install cuda-bindings")
    if varlen is not None:
        if varlen.total_k == 0:
            raise NotImplementedError("FP8 (e4m3) inputs: not with varlen batches without any "
                                      "key (k of 0 rows, cu_seqlens_k all 0) yet")
        return with_features(e4m3_sm90_config(p.dtype, p.head_dim), FEATURE_VARLEN)
    if p.seqlen_k == 0:
        raise NotImplementedError("FP8 (e4m3) inputs: not with an empty key sequence "
                                  "(seqlen_k 0) yet")
    config = e4m3_sm90_config(p.dtype, p.head_dim)
    causal = window[1] == 0 and window[0] < 0
    if window[0] >= 0 or (window[1] >= 0 and not causal):
        return config  # windows: the one-tile-per-CTA grid
    wide = E4M3_WIDE_TILE_KEYS.get(p.head_dim)
    if not causal and wide is not None and p.seqlen_k >= wide[1]:
        return e4m3_sm90_config(p.dtype, p.head_dim, e4m3_wide_tile(p.head_dim, wide[0]))
    claims = causal and dynamic_schedule(p.head_dim, p.seqlen_q, p.seqlen_k, window[1],
                                         E4M3_DYNAMIC_SCHEDULE_KEYS)
    if claims or p.seqlen_k <= E4M3_PERSISTENT_MAX_KEYS.get((p.head_dim, causal), 0):
        config = dataclasses.replace(config, persistent=True, claims=claims)
    return config


#: The FP8 forward's grids (benchmarks/dev/fp8_variants_ab.py, H100, 2026-12-07, d=128 against
#: the one-tile-per-CTA grid): the persistent grid with the static schedule up to this many keys
#: by (kernel head dim, causal), 1.02-1.10x at 512-2k keys, 0.92-1.00x non-causal from 4k and
#: 0.70-0.90x causal from 4k (its CTAs end apart); claimed tiles for causal rows within
#: E4M3_DYNAMIC_SCHEDULE_KEYS, 1.02-1.04x at 2k-8k, 0.97x at 16k. d=64 (256-key tiles) and
#: d=256 spill on the persistent grid and stay on the one-tile grid.
E4M3_PERSISTENT_MAX_KEYS = {(128, False): 2048, (128, True): 1024}
E4M3_DYNAMIC_SCHEDULE_KEYS = {128: (2048, 8192)}


def e4m3_wide_tile(kernel_dim: int, block_n: int) -> tuple:
    """The (block_n, stages, overlap) of E4M3_WIDE_TILES at `kernel_dim` with `block_n` keys."""
    (tile,) = [t for t in E4M3_WIDE_TILES[kernel_dim] if t[0] == block_n]
    return tile


def e4m3_sm90_config(element: str, kernel_dim: int, tile=None) -> FwdSm90Config:
    """The FP8 forward of `element` (E4M3_TAGS) at `kernel_dim`: E4M3_SM90_FWD_TILES' tile, or
    `tile` (block_n, stages, overlap: one of E4M3_WIDE_TILES')."""
    block_n, stages, overlap = tile or E4M3_SM90_FWD_TILES[kernel_dim]
    return FwdSm90Config(element, kernel_dim, block_m=128, block_n=block_n, stages=stages,
                         pingpong=True, overlap=overlap)


#: The TF32 Hopper forward's scratch arrays by FwdSm90Params field, and the map reading each.
TF32_OPERAND_MAPS = {"k_tf32": "k_map", "v_keys_last": "v_map"}


def operand_pass(config, scratch):
    """The operand pass that writes a float32 Hopper forward's `scratch` (its
    tf32_operand_shapes) before it, and its grid: (AuxKernel, grid), a CTA for each 32 of the
    padded keys of each (KV head, batch entry). (The FP8 forward transposes V in the kernel:
    FwdSm90Config.transpose_v.)"""
    batch, nheads_kv, _, keys = scratch["v_keys_last"][0]
    return AuxKernel(config.dtype, TF32_OPERANDS_KERNEL), (-(-keys // 32), nheads_kv, batch)


#: The element type of the scratch arrays an operand pass writes, by kernel element.
SCRATCH_DTYPES = {element: "float32" for element in FLOAT32_TAGS}


def tf32_operand_shapes(problem, config) -> dict:
    """The float32 Hopper forward's scratch arrays (flash_fwd_tf32_operands.cu), by
    FwdSm90Params field: (shape, element strides, the (batch, rows, heads, columns) view its
    tensor map covers and that view's element strides, box rows).
    k_tf32: K rounded, (batch, seqlen_k, kv heads, head dim), boxes of block_n keys;
    v_keys_last: V rounded with its keys innermost, (batch, kv heads, head dim, keys padded to
    8), mapped as (batch, head dim, kv heads, keys) with boxes of 32 keys by the kernel head dim.
    At "highest" (config.dtype "float32", 3xTF32) each holds both TF32 parts: K's rows are
    2 x head dim (the big parts, then the small ones), V's blocks 2 x head dim rows (the big
    rows, then the small ones); the kernel loads the small parts from column / row head_dim on."""
    p = problem
    width = (2 if config.dtype == "float32" else 1) * p.head_dim
    keys = -(-p.seqlen_k // 8) * 8
    k_shape = (p.batch, p.seqlen_k, p.nheads_kv, width)
    k_strides = (p.seqlen_k * p.nheads_kv * width, p.nheads_kv * width, width, 1)
    v_shape = (p.batch, p.nheads_kv, width, keys)
    v_strides = (p.nheads_kv * width * keys, width * keys, keys, 1)
    return {"k_tf32": (k_shape, k_strides, k_shape, k_strides, config.block_n),
            "v_keys_last": (v_shape, v_strides,
                            (p.batch, width, p.nheads_kv, keys),
                            (v_strides[0], v_strides[2], v_strides[1], 1), config.head_dim)}


#: K/V bytes that the CTAs of the persistent grid running at one time should find in L2 where
#: the tile order goes by sections (persistent_schedule): the persistent tile order
#: (flash_fwd_sm90.cu, PersistentTiles) then walks sections of (batch, head) pairs whose K and V
#: fit this. FlashAttention-3's figure (size_l2 in its tile scheduler set-up), of the H100's
#: 50 MiB and the H200's 60 MiB of L2.
PERSISTENT_L2_BYTES = 32 << 20

#: Kernel head dims whose persistent calls go pair by pair under an upper limit on keys (causal,
#: a right window edge) too (forward_grid). H200, causal, against the L2 sections
#: (`benchmarks/results/2026-12-03-h200-hopper-fwd-tile-order.txt`): d=128 1.02-1.03x at 512
#: tokens and 1.08-1.10x at 1k; d=64 0.98-1.01x (2k 0.98x), so d=64 keeps the sections; d=96
#: follows d=128 (the same two panels a row), not measured.
CAUSAL_PAIR_ORDER_DIMS = (96, 128)


#: Persistent calls under an upper limit on keys (causal, a right window edge) with keys in
#: DYNAMIC_SCHEDULE_KEYS[kernel head dim] (first, last) claim their work tiles dynamically
#: (flash_fwd_sm90.cu, WorkTileClaims: an atomic ticket a tile from a pair of counters a stream,
#: _plans.stream_counters), in the L2 sections' order: their tiles are 1 to m_blocks KV tiles
#: long, and the static schedule (tile b, b + CTAs, ...) leaves CTAs 3-45% apart. H200, bf16,
#: causal (2026-12-03, docs/PERF_NOTES.md): d=128 1.04x the best static choice at 2k and 4k,
#: 1.01x at 8k, 0.95x the one-tile grid at 16k; d=64 (three consumers) 1.02x the static
#: sections at 4k, 1.03x the one-tile grid at 8k-16k; at 512-1k keys the claims cost 1-4%
#: (tiles of one to eight KV tiles). Only where every query row sees a key (the kernel's claim ring
#: relies on every work tile loading a Q). Without a key limit every tile is as long as the
#: next and the static schedule is kept. DYNAMIC_SCHEDULE = False turns the claims off.
DYNAMIC_SCHEDULE = True
DYNAMIC_SCHEDULE_KEYS = {64: (2048, NO_LIMIT), 128: (2048, 8192)}


def dynamic_schedule(kernel_dim: int, seqlen_q: int, seqlen_k: int, window_right: int,
                     key_ranges=None) -> bool:
    """Whether a persistent launch (kernel head dim `kernel_dim`) claims its tiles dynamically:
    FwdSm90Config.claims (its plan then sets FwdSm90Params.tile_counters to the stream's
    counters a call). `key_ranges`: DYNAMIC_SCHEDULE_KEYS, or the FP8 forward's."""
    ranges = DYNAMIC_SCHEDULE_KEYS if key_ranges is None else key_ranges
    first, last = ranges.get(kernel_dim, (1, 0))
    return (DYNAMIC_SCHEDULE and window_right >= 0 and first <= seqlen_k <= last
            and seqlen_q <= seqlen_k + window_right)  # every query row sees a key


def persistent_schedule(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, seqlen_k: int,
                        head_dim: int, itemsize: int, block_m: int, slots: int,
                        pair_order: bool):
    """(CTAs, section_pairs) of the persistent Hopper forward: one CTA per resident slot (`slots`:
    SMs x CTAs an SM), fewer if there are fewer work tiles (m blocks x heads x batch), and the
    (batch, head) pairs a section of the tile order holds. One 1-D grid covers every batch,
    however many.

    `pair_order`: one pair a section, which makes the kernel's order pair by pair, a pair's m
    blocks side by side (under an upper key limit each pair's from a rotated start): the CTAs
    running at one time then share each K/V tile's DRAM read (without a key limit 1.05-1.08x at
    512 tokens on the H200 against sections m block by m block, whose first m block read every
    pair's K/V from DRAM at once; docs/HOPPER_FWD.md). Otherwise as many K/V heads' K and V as
    fit PERSISTENT_L2_BYTES (at least one), times the query heads that share each (GQA), at most
    every pair; the kernel takes a section m block by m block, the longest tiles first."""
    m_blocks = -(-seqlen_q // block_m)
    pairs = batch * nheads
    tiles = m_blocks * pairs
    if tiles >= 1 << 31:
        raise ValueError(f"{tiles} work tiles: the persistent grid counts them in 32 bits")
    if pair_order:
        return min(tiles, slots), 1
    kv_head_bytes = 2 * seqlen_k * head_dim * itemsize  # K and V of one (batch, K/V head)
    section = max(1, PERSISTENT_L2_BYTES // max(1, kv_head_bytes)) * (nheads // nheads_kv)
    return min(tiles, slots), min(section, pairs)


def forward_grid(config, batch: int, nheads: int, nheads_kv: int, seqlen_q: int, seqlen_k: int,
                 head_dim: int, itemsize: int, window_right: int, device_id: int,
                 persistent_ctas=None):
    """(grid, FwdSm90Params' own fields) of a Hopper forward launch: (m blocks, heads, batch)
    one tile per CTA, or with `config.persistent` the 1-D persistent grid (persistent_schedule;
    at most `persistent_ctas` CTAs if given, for tests) with its batch and section size: pair by
    pair without an upper key limit (window_right < 0: the struct's, 0 when causal) and at the
    kernel head dims of CAUSAL_PAIR_ORDER_DIMS unless `config.claims`, L2 sections otherwise."""
    if not config.persistent:
        return (-(-seqlen_q // config.block_m), nheads, batch), {}
    pair_order = window_right < 0 or (config.head_dim in CAUSAL_PAIR_ORDER_DIMS
                                      and not config.claims)
    ctas, section_pairs = persistent_schedule(
        batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, itemsize, config.block_m,
        persistent_ctas or persistent_slots(config, device_id), pair_order)
    return (ctas, 1, 1), {"batch": batch, "section_pairs": section_pairs}


@functools.lru_cache(maxsize=None)
def persistent_slots(config, device_id: int) -> int:
    """CTAs of `config`'s kernel resident on the device at once (SMs x 1 for these kernels),
    queried once per kernel and device."""
    return _launch.occupancy_slots(config, device_id)


# ---------------------------------------------------------------------------------------------
# Hopper backward (cuda_src/flash_bwd_sm90.cu; docs/HOPPER_BWD.md): the main kernel on sm_90
# wherever hopper_backward_config covers a call (CUFLASH2_HOPPER_BWD=0 turns it off).

#: The dispatcher runs the Hopper backward wherever it covers a call on sm_90 (1.23-1.81x the
#: mma.sync backward on the H200 at every head dim: docs/PERF_NOTES.md); CUFLASH2_HOPPER_BWD=0
#: keeps the mma.sync backward, as CUFLASH2_HOPPER=0 for the forward (read when a call signature
#: is planned; tests flip `HOPPER_BACKWARD` and clear the plan caches).
HOPPER_BACKWARD = os.environ.get("CUFLASH2_HOPPER_BWD", "1") != "0"

#: Varlen calls (`attention_varlen_backward`) run on the Hopper backward too (FEATURE_VARLEN:
#: the maps cover the packed arrays with a batch extent of 1, each CTA adds its sequence's first
#: row, as the Hopper forward's varlen); CUFLASH2_HOPPER_BWD_VARLEN=0 keeps them on mma.sync.
HOPPER_BACKWARD_VARLEN = os.environ.get("CUFLASH2_HOPPER_BWD_VARLEN", "1") != "0"

#: The features the Hopper backward compiles in (dropout: the mma.sync backward).
HOPPER_BACKWARD_FEATURES = FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_VARLEN

#: A mask modifier alone runs on the Hopper backward (BwdSm90ModsConfig, backward_kernels);
#: CUFLASH2_HOPPER_BWD_MODS=0 keeps it on the mma.sync backward (development: measuring the two).
HOPPER_BACKWARD_MODS = os.environ.get("CUFLASH2_HOPPER_BWD_MODS", "1") != "0"


#: (block_m, block_n, stages, dq_buffers) per head dim. block_n is 128 throughout: two consumer
#: warpgroups of 64 keys (the M of wgmma). block_m 64 queries a step as FlashAttention-3's sm90
#: backward at d=96/128 (hopper/flash_bwd_launch_template.h: 64 x 128, two Q / dO stages; 80 x
#: 128 non-causal d=128, a width this kernel's 16-multiple N does not take), 128 at d=64 as its
#: d=64 tile: a consumer's peak is dK + dV (head_dim / 2 each) and S^T + dP^T (block_m / 2
#: each), 192 fp32 registers of its 240 at d=128 x 64 rows and at d=64 x 128 rows (P^T and dS^T
#: are packed as S^T and dP^T die). A 128-row step halves the steps a key block takes (each
#: step's waits, barriers and statistics) and gives each wgmma of S^T and dP^T N = 128; dQ_i's
#: 128 rows are split between the consumers by rows. dq_buffers: staged fp32 dQ tiles (0:
#: vector reductions from registers): two where they fit, one at d=64 x 128 rows (two would
#: need 232,448 B of dynamic shared memory beside the mbarriers), none at d=192 / 256 (K, V, Q
#: and dO span the whole head dim, S^T and dP^T need it; d=256 has room for one Q / dO stage
#: only: K + V 128 KiB, a stage 64.5 KiB, two dS tiles 32 KiB).
SM90_BWD_TILES = {64: (128, 128, 2, 1), 96: (64, 128, 2, 2), 128: (64, 128, 2, 2),
                  192: (64, 128, 2, 0), 256: (64, 128, 1, 0)}
#: 64-row steps of the head dims whose default step is longer, for ALiBi with softcap or with
#: deterministic mode, and for varlen (at 128 rows their consumers spill: 28, 4 and 16 bytes; the
#: last without score modifiers, the sequence's rows held across the loop).
SM90_BWD_64_ROW_TILES = {64: (64, 128, 2, 2)}


def bwd_sm90_config(dtype: str, head_dim: int, deterministic: bool = False,
                    features: int = 0, head_dim_v: int = 0) -> BwdSm90Config:
    """The Hopper backward's specialisation for `head_dim` (one of SM90_BWD_HEAD_DIMS) and
    `features` (score modifiers), in deterministic mode with `deterministic`: the tile of
    SM90_BWD_TILES, or of SM90_BWD_64_ROW_TILES for ALiBi with softcap or in deterministic mode,
    and for varlen. With V's own `head_dim_v` (a pair of SM90_FWD_HEAD_DIM_PAIRS) Q's head dim's
    tile: V's and dO's narrower tiles take less shared memory."""
    if head_dim_v and head_dim_v != head_dim and (head_dim, head_dim_v) not in \
            SM90_FWD_HEAD_DIM_PAIRS:
        raise ValueError(f"the Hopper backward has (Q's, V's) head dims {SM90_FWD_HEAD_DIM_PAIRS},"
                         f" not ({head_dim}, {head_dim_v})")
    if head_dim not in SM90_BWD_HEAD_DIMS:
        raise ValueError(f"the Hopper backward has head dims {SM90_BWD_HEAD_DIMS}, not {head_dim}")
    both_mods = FEATURE_SOFTCAP | FEATURE_ALIBI
    tiles = SM90_BWD_TILES
    if (features & both_mods == both_mods or (deterministic and features & FEATURE_ALIBI)
            or features & FEATURE_VARLEN):
        tiles = {**tiles, **SM90_BWD_64_ROW_TILES}
    block_m, block_n, stages, dq_buffers = tiles[head_dim]
    return BwdSm90Config(dtype, head_dim, block_m=block_m, block_n=block_n, stages=stages,
                         features=features, dq_buffers=dq_buffers, deterministic=deterministic,
                         head_dim_v=head_dim_v)


#: A bias alone (with or without dbias) runs on the Hopper backward as tiles (FEATURE_BIAS_TILE,
#: sm90/bias_tile.cuh) where hopper_backward_mods_choice takes it; CUFLASH2_HOPPER_BIAS_TILES=0
#: keeps it on the mma.sync mods kernel, as the forward's (development: measuring the two).
HOPPER_BACKWARD_BIAS_TILES = HOPPER_FORWARD_BIAS_TILES


def hopper_backward_mods_choice(problem, features: int, deterministic: bool, arch: int,
                                views: dict, varlen, window, user_mods, bias_tile):
    """The Hopper backward of a call with programmable modifiers (`user_mods`: mask, score), or
    None where it stays on the mma.sync kernels: switched off (HOPPER_BACKWARD_MODS), a score
    modifier other than the bias alone (`bias_tile`, _bias.tile_array's view of it; None for any
    other), a block mask in deterministic mode or varlen (its narrowed ranges break the
    ordered dQ's turns), or what hopper_backward_config leaves out. The bias alone comes as
    tiles (FEATURE_BIAS_TILE; HOPPER_BACKWARD_BIAS_TILES), with dbias (FEATURE_BIAS_GRAD, from
    each step's dS tile) or without, with q's dtype, up to d=128 (the
    stages' shared memory), not varlen (its rows are the queries' own), not with softcap (dS's
    1 - t^2 needs t without the bias), with arrays the TMA reads (seqlen_k % 8); one staged dQ
    tile at d=96 / 128 (with_bias_tiles). 64-row steps (hopper_backward_mods_config)."""
    p = problem
    mask, score = user_mods
    block_mask = bool(features & FEATURE_BLOCK_MASK)
    bias = score is not None
    if (not HOPPER_BACKWARD_MODS or (features & FEATURE_BIAS_GRAD and not bias)
            or (block_mask and (deterministic or varlen is not None))):
        return None
    if bias and (bias_tile is None or not HOPPER_BACKWARD_BIAS_TILES or varlen is not None
                 or features & FEATURE_SOFTCAP or bias_tile.dtype != views["q"].dtype):
        return None
    hopper = hopper_backward_config(p, features & ~USER_MOD_FEATURES & ~FEATURE_BIAS_GRAD, arch,
                                    varlen, deterministic)
    if hopper is None or (bias and hopper.head_dim > 128):
        return None
    hopper = hopper_backward_mods_config(hopper, mask, block_mask)
    if bias:
        hopper = with_bias_tiles(hopper, features & FEATURE_BIAS_GRAD)
    # The maps' boxes are the final tile's (hopper_backward_mods_config's 64-row steps).
    maps = _hopper.backward_maps(hopper)
    map_fields = _hopper.readable_map_fields(views, maps)
    if map_fields is None:
        return None
    bias_fields = None
    if bias:
        bias_fields = bias_tile_fields(bias_tile, hopper.block_m)
        if bias_fields is None:
            return None
    key_blocks = -(-p.seqlen_k // hopper.block_n)
    return BackwardChoice(
        hopper, True, maps=maps, map_fields=map_fields,
        group_pairs=dispatch_group_pairs(key_blocks, hopper.num_chunks,
                                         scheduling_window(window, block_mask), deterministic),
        bias_fields=bias_fields)


def with_bias_tiles(config, bias_grad: int = 0):
    """The Hopper backward `config` (64-row steps) with the bias as tiles (FEATURE_BIAS_TILE):
    a 16 KiB tile in each Q / dO stage, and at d=96 / 128 one staged dQ tile, the second's
    32 KiB going to the bias's two stages (231,424 bytes either way); `bias_grad`
    (FEATURE_BIAS_GRAD or 0): dbias copied from each step's dS tile too."""
    return dataclasses.replace(config, features=config.features | FEATURE_BIAS_TILE | bias_grad,
                               dq_buffers=min(config.dq_buffers,
                                              1 if config.head_dim > 64 else 2))


def hopper_backward_mods_config(config, mask, block_mask: bool = False):
    """The Hopper backward `config` (hopper_backward_config's) with the mask modifier `mask`
    (a ModSource) compiled in (mods.hopper_backward_config), at 64-row steps: at 128 the user's
    code spilled (d=64, prefix-LM: 16 bytes)."""
    from . import mods

    if config.block_m > 64:
        config = dataclasses.replace(config, **dict(zip(
            ("block_m", "block_n", "stages", "dq_buffers"),
            SM90_BWD_64_ROW_TILES[config.head_dim])))
    return mods.hopper_backward_config(config, mask, block_mask=block_mask)


def hopper_forward_head_dim(head_dim: int, kernel_dims=SM90_FWD_HEAD_DIMS) -> int:
    """The smallest Hopper forward head dim of `kernel_dims` (ascending) that holds `head_dim`
    (the TMA zero-fills the columns up to it): d=96 runs on the d=96 kernel, 160 on 192."""
    for d in kernel_dims:
        if head_dim <= d:
            return d
    raise ValueError(f"the Hopper forward takes head dims up to {kernel_dims[-1]}, not "
                     f"{head_dim}")


def hopper_backward_head_dim(head_dim: int) -> int:
    """The smallest Hopper backward head dim that holds `head_dim` (the TMA zero-fills the
    columns up to it)."""
    for d in SM90_BWD_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"the Hopper backward takes head dims up to "
                     f"{max(SM90_BWD_HEAD_DIMS)}, not {head_dim}")


#: The main kernel's dispatch order (flash_bwd_sm90.cu, cta_work). Under a causal mask a key
#: block's work falls with its index (key block 0 sees every query block), and the grid's own
#: order, pair by pair of (KV head, batch), starts the last pair's longest CTA last, a tail that
#: runs alone. Taking groups of pairs key-block-major (every pair's key block 0, then key block
#: 1, ...) starts the long CTAs first; a group is about DISPATCH_GROUP_CTAS CTAs (two waves of
#: the H200's 132 SMs), so that its pairs' Q / dO tiles are still in L2 for its later key blocks.
#: Measured on the H200 against the grid's order, alternating on the same arrays
#: (benchmarks/results/2026-12-03-h200-hopper-bwd-dispatch-order.txt), causal rows: d=128
#: 1.03-1.09x at 2k-8k tokens, d=64 1.01-1.03x at 4k-8k, d=256 1.04x at 4k; with groups of two
#: pairs (d=256 8k, 16k at d<=128) 0.98-1.01x, about the spread between rounds (the same code,
#: d=256 16k's group of one, measured 0.99x). At 512 tokens (4 key blocks) 2-6% slower, causal
#: or not, at 1k up to 3%, and without a mask level from 2k. So: grouped under a causal mask from
#: DISPATCH_MIN_KEY_BLOCKS key blocks on.
DISPATCH_GROUP_CTAS = 256
DISPATCH_MIN_KEY_BLOCKS = 16


def dispatch_group_pairs(key_blocks: int, chunks: int, window, deterministic: bool) -> int:
    """BwdSm90Params.dispatch_group_pairs: (KV head, batch) pairs the main kernel takes
    key-block-major together, 1 for the grid's own order. `window` is the kernels' (left,
    right): a right edge with no left one is the causal mask's shape (the low key blocks the
    long ones). Deterministic mode has an order of its own (the kernel ignores this)."""
    left, right = window
    if deterministic or not (right >= 0 > left) or key_blocks < DISPATCH_MIN_KEY_BLOCKS:
        return 1
    return max(1, DISPATCH_GROUP_CTAS // (key_blocks * chunks))


def hopper_backward_config(problem, features: int, arch: int, varlen=None,
                           deterministic: bool = False):
    """The Hopper backward's configuration for a checked call, or None where the call stays on
    the mma.sync backward: switched off (HOPPER_BACKWARD; varlen: HOPPER_BACKWARD_VARLEN), not
    sm_90, float32 inputs (a 16-bit kernel), dropout, a head dim beyond the Hopper kernels', an empty problem, or no driver
    bindings to encode the maps (backward_kernels then asks the TMA to describe q, k, v and
    dout). Sinks (FEATURE_SINKS) take the kernel of the call without them
    (backward_features)."""
    p = problem
    if (not HOPPER_BACKWARD or arch != 90 or p.dtype not in DTYPE_TAGS
            or (varlen is not None and not HOPPER_BACKWARD_VARLEN)):
        return None
    features = backward_features(features)
    if features & ~HOPPER_BACKWARD_FEATURES:
        return None
    if not plannable(p, SM90_BWD_HEAD_DIMS):
        return None
    kernel_dim = hopper_backward_head_dim(p.head_dim)
    kernel_dim_v = hopper_backward_head_dim(p.head_dim_v)  # V's own (the forward's pairs)
    if kernel_dim_v != kernel_dim and (kernel_dim, kernel_dim_v) not in SM90_FWD_HEAD_DIM_PAIRS:
        return None
    return bwd_sm90_config(p.dtype, kernel_dim, deterministic, features,
                           kernel_dim_v if kernel_dim_v != kernel_dim else 0)


# ---------------------------------------------------------------------------------------------
# Decode splits (attention_with_kvcache; docs/DECODE_DESIGN.md)

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
    if not (CLUSTER_MERGE and arch >= CLUSTER_MIN_ARCH
            and requested <= MAX_CLUSTER_SPLITS):
        return config, barrier_splits, 1
    splits = _even(num_splits_for(requested, groups, tiles, slots, MAX_CLUSTER_SPLITS), tiles)
    short = -(-tiles // max(splits, 1)) <= CLUSTER_MAX_TILES_PER_SPLIT
    if splits < 2 or (requested == 0 and not short):
        return config, barrier_splits, 1
    # A step that forms a cluster keeps its rows on an m16 tile: with them on the n side the
    # batch-1 4k step in a graph took 9.6 against 9.4 us a layer (its last split, which loads its
    # tile of new tokens after the wait, ended later), where every step merging through L2
    # gained 0.4-0.6 us (docs/DECODE_DESIGN.md). So does such a step where no cluster launches
    # or fits: it then merges through L2 on the same kernel, and a launch path without clusters
    # gives the same bits. (Such a step has at most 8 rows: one m16 block too.)
    m16 = dataclasses.replace(config, block_m=DECODE_BLOCK_M)
    if _launch.extended_available():
        deep = with_features(decode_cluster_config(
            dtype, head_dim, arch, config.early_cache_reads, config.kv_cache_dtype), features)
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


# ---------------------------------------------------------------------------------------------
# Every build the dispatcher can choose (the compile tests and the prewarm build them)


def all_fwd_configs(arch: int, features=(0,), elements=tuple(DTYPE_TAGS)) -> list[FwdConfig]:
    """Every forward specialisation the dispatcher can choose on `arch` (for each of `features`;
    ALL_FEATURES for every score-modifier combination) for the 16-bit dtypes, or `elements`
    (FLOAT32_TAGS: float32 inputs' mma.sync forward)."""
    return [with_features(fwd_config(dtype, d, arch), f) for f in features
            for dtype in elements for d in KERNEL_HEAD_DIMS]


def all_bwd_configs(arch: int, features=(0,), elements=tuple(DTYPE_TAGS)) -> list:
    """Every backward specialisation the dispatcher can choose on `arch` (main kernel with and
    without dQ, deterministic dQ kernel), for each of `features` (as backward calls with them
    run it: without the forward-only features; each once), for the 16-bit dtypes, or
    `elements` (FLOAT32_TAGS: float32 inputs' kernels, at every head dim a tile fits)."""
    features = dict.fromkeys(backward_features(f) for f in features)
    configs = []
    for f in features:
        for dtype in elements:
            for d in KERNEL_HEAD_DIMS:
                if dtype in FLOAT32_TAGS:
                    for choose in (lambda: float32_bwd_config(dtype, d, arch),
                                   lambda: float32_bwd_config(dtype, d, arch, True),
                                   lambda: float32_bwd_dq_config(dtype, d, arch)):
                        try:
                            config = with_features(choose(), f)
                        except NotImplementedError:  # no tile fits
                            continue
                        if config not in configs:
                            configs.append(config)
                    continue
                configs += [with_features(cfg, f) for cfg in (
                    bwd_config(dtype, d, arch), bwd_config(dtype, d, arch, True),
                    bwd_dq_config(dtype, d, arch))]
    return configs


def all_decode_configs(arch: int, features=(0,), kv_cache_dtypes=(None,)) -> list:
    """Every decode specialisation the dispatcher can choose on `arch` (for each of the cache
    dtypes `kv_cache_dtypes`: None, "e4m3")."""
    rows = (DECODE_BLOCK_M, DECODE_BLOCK_M_N8)
    configs = [with_features(decode_config(dtype, d, arch, m, c), f) for f in features
               for c in kv_cache_dtypes for dtype in DTYPE_TAGS for d in KERNEL_HEAD_DIMS
               for m in rows]
    if arch >= CLUSTER_MIN_ARCH:
        # Programmatic launches (from _launch.PROGRAMMATIC_MIN_ARCH, the same arch) may read
        # the cache early.
        configs += [dataclasses.replace(c, early_cache_reads=True) for c in configs]
        # (clustered steps keep their rows on an m16 tile: choose_splits)
        configs += [with_features(decode_cluster_config(dtype, d, arch, early, c), f)
                    for early in (False, True) for f in features for c in kv_cache_dtypes
                    for dtype in DTYPE_TAGS for d in KERNEL_HEAD_DIMS]
    return list(dict.fromkeys(configs))


def all_fwd_sm90_configs(features=(0,), overlap=(False, True),
                         persistent: bool = False) -> list[FwdSm90Config]:
    """Every Hopper forward specialisation (for each of `features`), in both schedules, with and
    without the overlap inside a warpgroup (`overlap`: which of the two); with `persistent`, the
    persistent ones (head dims of SM90_PERSISTENT_TILES, every schedule and overlap) too, and
    with ping-pong and the overlap (the dispatcher's two-consumer schedule) their twins whose
    tiles are claimed one by one (`claims`)."""
    grids = (False, True) if persistent else (False,)
    configs = [dataclasses.replace(with_features(fwd_sm90_config(dtype, d, grid), f),
                                   pingpong=pingpong, overlap=ov)
               for grid in grids for ov in overlap for pingpong in (False, True)
               for f in features for dtype in DTYPE_TAGS
               for d in (SM90_PERSISTENT_TILES if grid else SM90_FWD_HEAD_DIMS)]
    return configs + [dataclasses.replace(c, claims=True) for c in configs
                      if c.persistent and c.pingpong and c.overlap]


def tf32_hopper_forward_configs(features=(0,), elements=("tf32",)) -> list:
    """Every float32 Hopper forward specialisation of `elements` ("tf32", and "float32" for
    precision "highest": tf32_hopper_forward_config's, for each of `features` it takes) and the
    operand pass that runs before each element's."""
    taken = FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINKS
    out = []
    for element in elements:
        configs = [float32_sm90_config(element, d, f)
                   for f in dict.fromkeys(features) if not f & ~taken
                   for d in FLOAT32_SM90_FWD_TILES[element]]
        out += configs + [AuxKernel(element, TF32_OPERANDS_KERNEL)] if configs else []
    return out


def e4m3_hopper_forward_configs(elements=tuple(E4M3_TAGS), features=(0,)) -> list:
    """Every FP8 forward specialisation of `elements` (E4M3_TAGS: by the output's dtype) for
    each of `features` it takes (0: dense calls, FEATURE_VARLEN: attention_varlen's; others are
    skipped): one per head dim of E4M3_SM90_FWD_TILES on the one-tile-per-CTA grid (V
    transposed in the kernel: no operand pass), and for dense calls on the persistent grid
    those of E4M3_PERSISTENT_MAX_KEYS' head dims, with claimed tiles those of
    E4M3_DYNAMIC_SCHEDULE_KEYS', with a wider key tile those of E4M3_WIDE_TILE_KEYS'."""
    configs = []
    for f in dict.fromkeys(features):
        if f not in (0, FEATURE_VARLEN):
            continue
        for element in elements:
            for d in E4M3_SM90_FWD_TILES:
                config = with_features(e4m3_sm90_config(element, d), f)
                configs.append(config)
                if f:
                    continue  # varlen: the one-tile grid alone
                if any(dim == d for dim, _ in E4M3_PERSISTENT_MAX_KEYS):
                    configs.append(dataclasses.replace(config, persistent=True))
                if d in E4M3_DYNAMIC_SCHEDULE_KEYS:
                    configs.append(dataclasses.replace(config, persistent=True, claims=True))
                if d in E4M3_WIDE_TILE_KEYS:
                    configs.append(e4m3_sm90_config(
                        element, d, e4m3_wide_tile(d, E4M3_WIDE_TILE_KEYS[d][0])))
    return configs


def hopper_forward_configs(features=(0,)) -> list:
    """Every Hopper forward configuration the dispatcher can choose (for each of `features`;
    the persistent grid where PERSISTENT_MAX_KEYS has the head dim and no feature is varlen;
    three consumer warpgroups where THREE_CONSUMER_MIN_KEYS has the head dim, not varlen)."""
    configs = []
    for dim in sorted({dim for dim, _ in THREE_CONSUMER_MIN_KEYS}):
        for dtype in DTYPE_TAGS:
            for f in features:
                if f & FEATURE_VARLEN:
                    continue
                for persistent in (False, True):
                    configs.append(with_features(
                        fwd_sm90_config(dtype, dim, persistent, consumers=3), f))
    # Each head dim's schedules and grids; V's own head dims (SM90_SPLIT_HEAD_DIM_TILES, dim_v)
    # take Q's head dim's.
    dims = [(dim, 0, causal) for dim, causal in SCHEDULES] + [
        (dim, dim_v, causal) for dim, dim_v in SM90_FWD_HEAD_DIM_PAIRS for causal in (False, True)]
    for dim, dim_v, causal in dims:
        pingpong, overlap = SCHEDULES[dim, causal]
        for dtype in DTYPE_TAGS:
            for f in features:
                grids = [False]
                if (dim, causal) in PERSISTENT_MAX_KEYS and not f & FEATURE_VARLEN:
                    grids.append(True)
                for persistent in grids:
                    config = with_features(
                        fwd_sm90_config(dtype, dim, persistent, head_dim_v=dim_v), f)
                    configs.append(dataclasses.replace(config, pingpong=pingpong,
                                                       overlap=overlap))
    # Persistent calls under a key limit claim their tiles at the head dims of
    # DYNAMIC_SCHEDULE_KEYS.
    configs += [dataclasses.replace(c, claims=True) for c in configs
                if c.persistent and c.head_dim in DYNAMIC_SCHEDULE_KEYS]
    return list(dict.fromkeys(configs))


def all_bwd_sm90_configs(features=(0,), head_dim_pairs=False) -> list[BwdSm90Config]:
    """Every Hopper backward specialisation (for each of `features`); with `head_dim_pairs`
    those of V's own head dim (SM90_FWD_HEAD_DIM_PAIRS) too."""
    pairs = [(d, 0) for d in SM90_BWD_HEAD_DIMS]
    if head_dim_pairs:
        pairs += list(SM90_FWD_HEAD_DIM_PAIRS)
    return [bwd_sm90_config(dtype, d, features=f, head_dim_v=v) for f in features
            for dtype in DTYPE_TAGS for d, v in pairs]
