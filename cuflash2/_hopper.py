"""Host side of the Hopper forward (cuda_src/flash_fwd_sm90.cu, docs/HOPPER_FWD.md).

The kernel reads q, k and v through TMA descriptors (CUtensorMap, 128 bytes each) that travel in
its parameter struct FwdSm90Params. Each map covers a whole (batch, seqlen, heads, headdim)
array in place: rank 4, innermost first (head dim, row, head, batch), with the array's own
strides, so no copy is made; boxes are 64 columns (128 bytes, the 128-byte swizzle span) by the
kernel's tile rows (config.block_m for q, config.block_n for k and v), one box per 64-column
panel. What lies outside the array (rows past seqlen, columns past the head dim: the second half
of d=96's second panel) the TMA zero-fills, and the kernel's expect-tx byte counts are those of
the full boxes, zero-filled bytes included.

A map depends on its array's shape, strides and dtype (the call signature) and on one address:
word 0 of the CUtensorMap is the array's global address, as it is for the maps this driver
encodes (checked for every map a plan builds, `encode_map`), so a plan encodes its maps once and
a later call patches the address like any other pointer of the struct.

`forward_config` is the dispatcher's question "does the Hopper kernel run this call, and how";
`prepare_forward_sm90` runs the kernel on its own (benchmarks/dev/hopper_fwd_check.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import dataclasses
from dataclasses import dataclass

import numpy

from . import _configs, _launch, _params, _plans
from ._prepare import LOG2E, element_strides, output_strides

#: Columns of a TMA box: 64 16-bit elements = 128 bytes, the span of CU_TENSOR_MAP_SWIZZLE_128B
#: (FwdSm90Traits::PANEL_COLS).
BOX_COLS = 64
#: Largest row count of a TMA box.
MAX_BOX_ROWS = 256
#: The 64-bit word of a CUtensorMap that holds the global address (checked by `encode_map`).
ADDRESS_WORD = 0
#: CUFLASH2_HOPPER=0 keeps every forward on the mma.sync kernels (read when a call signature is
#: planned; tests flip `ENABLED` and clear the plan caches).
ENABLED = os.environ.get("CUFLASH2_HOPPER", "1") != "0"
#: Varlen calls (attention_varlen) on the Hopper forward (FEATURE_VARLEN; docs/HOPPER_FWD.md,
#: "Varlen"). CUFLASH2_HOPPER_VARLEN=0 keeps them on the mma.sync kernel (tests flip `VARLEN`
#: and clear the plan caches).
VARLEN = os.environ.get("CUFLASH2_HOPPER_VARLEN", "1") != "0"


def tensor_map_geometry(shape, strides_bytes, itemsize: int, box_rows: int):
    """(globalDim, globalStrides, boxDim) of the rank-4 map of a (batch, seqlen, heads, headdim)
    array with byte strides `strides_bytes`, in the driver's order (innermost first; strides of
    the outer three dimensions only). Raises ValueError where the TMA cannot read the array."""
    batch, seqlen, heads, dim = shape
    s_batch, s_row, s_head, s_dim = strides_bytes
    if s_dim != itemsize:
        raise ValueError("the head dim must be contiguous")
    if not 0 < box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"a TMA box has 1 to {MAX_BOX_ROWS} rows, not {box_rows}")
    extents = (seqlen, heads, batch)
    strides = []
    span = dim * itemsize  # bytes spanned by the dimensions inside the current one
    for extent, stride in zip(extents, (s_row, s_head, s_batch)):
        if extent == 1 and (stride % 16 or stride <= 0):
            # Never stepped over, so any stride describes it (an unbatched array seen as batch 1
            # through x[None] has a batch stride of 0): the span of the inner dimensions, as in
            # a packed layout, rounded up to 16 bytes.
            stride = -(-span // 16) * 16
        span = max(span, extent * abs(stride))
        if stride <= 0 or stride % 16 or stride >= 1 << 40:
            raise ValueError(f"TMA needs strides that are positive multiples of 16 bytes below "
                             f"2^40; got {strides_bytes}")
        strides.append(stride)
    dims = (dim, seqlen, heads, batch)
    if min(dims) < 1 or max(dims) > 1 << 32:
        raise ValueError(f"TMA needs every dimension in [1, 2^32]; got {shape}")
    return list(dims), strides, [BOX_COLS, box_rows, 1, 1]


def tensor_map_bytes(x, box_rows: int) -> bytes:
    """The 128 bytes of the CUtensorMap of the CuPy array `x` (batch, seqlen, heads, headdim),
    fp16 or bf16, 128-byte swizzle, boxes of BOX_COLS x `box_rows`."""
    from cuda.bindings import driver

    dtype = {"float16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             "bfloat16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}[
        x.dtype.name]
    dims, strides, box = tensor_map_geometry(x.shape, x.strides, x.itemsize, box_rows)
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        dtype, 4, x.data.ptr,
        [driver.cuuint64_t(d) for d in dims],
        [driver.cuuint64_t(s) for s in strides],
        [driver.cuuint32_t(b) for b in box],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(err) != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err!r} (shape {x.shape}, "
                           f"strides {x.strides})")
    return ctypes.string_at(tensor_map.getPtr(), 128)


def encode_map(x, box_rows: int) -> numpy.ndarray:
    """The CUtensorMap of `x` as 16 64-bit words, its address in word ADDRESS_WORD. Raises
    RuntimeError if the driver put the address elsewhere (the map could then not be patched
    per call: the caller falls back to the mma.sync kernel)."""
    words = numpy.frombuffer(tensor_map_bytes(x, box_rows), numpy.uint64).copy()
    if int(words[ADDRESS_WORD]) != x.data.ptr:
        raise RuntimeError("this driver's CUtensorMap does not keep the global address in "
                           f"word {ADDRESS_WORD}")
    return words


def _bindings_available() -> bool:
    try:
        from cuda.bindings import driver  # noqa: F401  (importable: the maps can be encoded)
    except ImportError:
        return False
    return True


def plannable(problem, head_dims) -> bool:
    """What both Hopper kernels need of a call before its tiles and maps: a head dim one of
    `head_dims` holds, no empty dimension (a tensor map has none), and the driver bindings that
    encode the maps."""
    p = problem
    return (p.head_dim <= max(head_dims) and min(p.batch, p.seqlen_q, p.seqlen_k, p.nheads) >= 1
            and _bindings_available())


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


def dispatch_configs(features=(0,)) -> list:
    """Every Hopper forward configuration the dispatcher can choose (for each of `features`;
    the persistent grid where PERSISTENT_MAX_KEYS has the head dim and no feature is varlen;
    three consumer warpgroups where THREE_CONSUMER_MIN_KEYS has the head dim, not varlen)."""
    configs = []
    for dim in sorted({dim for dim, _ in THREE_CONSUMER_MIN_KEYS}):
        for dtype in _configs.DTYPE_TAGS:
            for f in features:
                if f & _configs.FEATURE_VARLEN:
                    continue
                for persistent in (False, True):
                    configs.append(_configs.with_features(
                        _configs.fwd_sm90_config(dtype, dim, persistent, consumers=3), f))
    for (dim, causal), (pingpong, overlap) in SCHEDULES.items():
        for dtype in _configs.DTYPE_TAGS:
            for f in features:
                grids = [False]
                if (dim, causal) in PERSISTENT_MAX_KEYS and not f & _configs.FEATURE_VARLEN:
                    grids.append(True)
                for persistent in grids:
                    config = _configs.with_features(
                        _configs.fwd_sm90_config(dtype, dim, persistent), f)
                    configs.append(dataclasses.replace(config, pingpong=pingpong,
                                                       overlap=overlap))
    # Persistent calls under a key limit claim their tiles at the head dims of
    # DYNAMIC_SCHEDULE_KEYS.
    configs += [dataclasses.replace(c, claims=True) for c in configs
                if c.persistent and c.head_dim in DYNAMIC_SCHEDULE_KEYS]
    return list(dict.fromkeys(configs))


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


#: Three consumer warpgroups (192 query rows a CTA, _configs.SM90_THREE_CONSUMER_TILES; the
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


def forward_config(problem, features: int, window, arch: int, views: dict, varlen=None):
    """The Hopper forward's configuration for a checked call, or None where the call stays on
    the mma.sync kernel: not sm_90, switched off, dropout, varlen unless VARLEN, a head dim
    beyond the Hopper kernels', an empty problem, or arrays the TMA cannot describe.

    Varlen (`varlen` given; `problem` has the sequence count as batch and the max lengths as
    seqlens): the maps cover the packed (total, heads, dim) arrays as rank-4 maps with a batch
    extent of 1 (the dense maps' geometry, _as_batched), each CTA adds its sequence's first row
    to its row coordinates (flash_fwd_sm90.cu)."""
    p = problem
    if not ENABLED or arch != 90 or (varlen is not None and not VARLEN):
        return None
    covered = _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI | _configs.FEATURE_SINKS
    if varlen is not None:
        covered |= _configs.FEATURE_VARLEN
    if features & ~covered:
        return None
    if not plannable(p, _configs.SM90_FWD_HEAD_DIMS):
        return None
    kernel_dim = min(d for d in _configs.SM90_FWD_HEAD_DIMS if d >= p.head_dim)
    if kernel_dim <= MMA_SYNC_MAX_DIM and p.seqlen_k <= MMA_SYNC_MAX_KEYS:
        return None
    causal = window[1] == 0 and window[0] < 0
    unwindowed = window[0] < 0 and (window[1] < 0 or causal)
    claims = varlen is None and dynamic_schedule(kernel_dim, p.seqlen_q, p.seqlen_k, window[1])
    if (varlen is None and unwindowed
            and p.seqlen_k >= THREE_CONSUMER_MIN_KEYS.get((kernel_dim, causal), NO_LIMIT)):
        persistent = p.seqlen_k <= THREE_CONSUMER_PERSISTENT_MAX_KEYS
        config = _configs.with_features(
            _configs.fwd_sm90_config(p.dtype, kernel_dim, persistent, consumers=3), features)
    else:
        persistent = varlen is None and (
            p.seqlen_k <= PERSISTENT_MAX_KEYS.get((kernel_dim, causal), 0) or causal and claims)
        config = _configs.fwd_sm90_config(p.dtype, kernel_dim, persistent)
        pingpong, overlap = SCHEDULES[kernel_dim, causal]
        config = dataclasses.replace(_configs.with_features(config, features),
                                     pingpong=pingpong, overlap=overlap)
    if config.persistent and claims:
        config = dataclasses.replace(config, claims=True)
    return config if describable(views, forward_maps(config)) else None


def forward_maps(config) -> dict:
    """The tensor maps of FwdSm90Params: map field -> (the array's view name, box rows)."""
    return {"q_map": ("q", config.block_m), "k_map": ("k", config.block_n),
            "v_map": ("v", config.block_n)}


def describable(views: dict, maps: dict) -> bool:
    """Whether the TMA can read every array of `maps` (map field -> (view name, box rows)):
    the geometry is checked here and the driver encodes each map (a refusal, or an address
    outside word ADDRESS_WORD, leaves the call to the mma.sync kernels rather than failing it)."""
    for name, rows in maps.values():
        x = _as_batched(views[name])
        try:
            tensor_map_geometry(x.shape, x.strides, x.itemsize, rows)
            encode_map(x, rows)
        except (ValueError, RuntimeError):
            return False
    return True


def tensor_map_fields(views: dict, maps: dict) -> dict:
    """The words of each map field of `maps` (map field -> (view name, box rows)) for the arrays
    `views`, by the path a ParamBlock sets ("q_map.v")."""
    return {f"{field}.v": encode_map(_as_batched(views[name]), rows)
            for field, (name, rows) in maps.items()}


def map_inputs(inputs, maps: dict) -> list:
    """The plan inputs (field, input position, byte offset) that patch each map's address word
    per call, from those of the arrays (`inputs`, by view name)."""
    return [(f"{field}.v", pos, off) for name, pos, off in inputs
            for field, (source, _) in maps.items() if source == name]


def _as_batched(x):
    return x if x.ndim == 4 else x[None]


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


def dynamic_schedule(kernel_dim: int, seqlen_q: int, seqlen_k: int, window_right: int) -> bool:
    """Whether a persistent launch (kernel head dim `kernel_dim`) claims its tiles dynamically:
    FwdSm90Config.claims (its plan then sets FwdSm90Params.tile_counters to the stream's
    counters a call)."""
    first, last = DYNAMIC_SCHEDULE_KEYS.get(kernel_dim, (1, 0))
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


@dataclass
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
    (persistent_schedule): a 1-D grid of at most one CTA per SM, or of at most
    `persistent_ctas` CTAs (testing: many work tiles per CTA on a small problem)."""
    import cupy

    batched = q.ndim == 4
    q4, k4, v4 = _as_batched(q), _as_batched(k), _as_batched(v)
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
        kernel_dim = min(d for d in _configs.SM90_FWD_HEAD_DIMS if d >= head_dim)
        config = _configs.fwd_sm90_config(q.dtype.name, kernel_dim)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left, right = window_size
    if causal:
        right = 0
    if config.persistent and dynamic_schedule(config.head_dim, seqlen_q, seqlen_k, right):
        config = dataclasses.replace(config, claims=True)  # as the dispatcher would

    out4 = cupy.empty((batch, seqlen_q, nheads, head_dim), dtype=q.dtype)
    lse = cupy.empty((batch, nheads, seqlen_q), dtype=cupy.float32)
    block = _params.ParamBlock("FwdSm90Params")
    for name, x, rows in (("q_map", q4, config.block_m), ("k_map", k4, config.block_n),
                          ("v_map", v4, config.block_n)):
        offset = block.layout.offsets[name]
        block.bytes[offset:offset + 128] = numpy.frombuffer(tensor_map_bytes(x, rows), numpy.uint8)
    fields = {"q": q4.data.ptr, "k": k4.data.ptr, "v": v4.data.ptr, "out": out4.data.ptr,
              "lse": lse.data.ptr, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
              "nheads": nheads, "heads_per_kv_head": nheads // nheads_kv, "head_dim": head_dim,
              "softmax_scale": scale, "scale_log2": scale * LOG2E, "window_left": left,
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
        grid, grid_fields = forward_grid(config, batch, nheads, nheads_kv, seqlen_q, seqlen_k,
                                         head_dim, q.itemsize, right, device_id,
                                         persistent_ctas)
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
