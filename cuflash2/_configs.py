"""Kernel configurations: what one specialisation is (its tiles, threads, shared memory, name
expression, compile options), the feature bits, and the facts the kernels and Python share
(generated into every source as "constants.cuh").

One specialisation per (kernel, dtype, head dim rounded up to the kernel's tile, tile shape, arch).
Causal masking, windows and sequence lengths are run-time arguments: masking only runs on the
boundary tiles, so making it a template flag would multiply compile time for no measurable gain.
Which specialisation serves which problem, and every build the dispatcher can choose, is
`_dispatch`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

#: Head dims the kernels are built for; a user head dim (multiple of 8, <= 256) is rounded up to
#: the next one and the padding columns are zero-filled in shared memory, never in user arrays.
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

#: Element types by the name the CUDA source uses for their tag type.
DTYPE_TAGS = {"float16": "fp16_tag", "bfloat16": "bf16_tag"}
#: Float32 inputs by their precision (cuda_src/tf32_primitives.cuh): "float32", precision
#: "highest" (each operand as two TF32 parts, three products), and "tf32" (one TF32 product).
#: The mma.sync forward and backward; on sm_90 the forwards also run the Hopper forward (its
#: TF32 wgmma specialisations, _dispatch.FLOAT32_SM90_FWD_TILES: both up to head dim 128).
FLOAT32_TAGS = {"float32": "f32x3_tag", "tf32": "tf32_tag"}
ELEMENT_TAGS = {**DTYPE_TAGS, **FLOAT32_TAGS}
#: FP8 e4m3 inputs (the FP8 forward: the Hopper forward only, docs/FP8_FORWARD.md) by the
#: output dtype they are computed into: e4m3_tag<the output's tag> (hopper_primitives.cuh).
E4M3_ELEMENTS = {"bfloat16": "e4m3_bf16", "float16": "e4m3_fp16"}
E4M3_TAGS = {element: f"e4m3_tag<{DTYPE_TAGS[out]}>" for out, element in E4M3_ELEMENTS.items()}
#: The Hopper forward's elements: every kernel element and e4m3.
HOPPER_FORWARD_TAGS = {**ELEMENT_TAGS, **E4M3_TAGS}
#: 16-bit words an element takes in memory (the tags' WORDS): the kernels address tiles,
#: strides and head dims in words.
ELEMENT_WORDS = {"float16": 1, "bfloat16": 1, "float32": 2, "tf32": 2}
#: Bytes an element takes (the tags' BYTES): the Hopper forward's traits count bytes, since an
#: e4m3 element is half a word.
ELEMENT_BYTES = {**{element: 2 * words for element, words in ELEMENT_WORDS.items()},
                 **{element: 1 for element in E4M3_TAGS}}
#: The output dtype of each element (float32 inputs: float32 at either precision; e4m3: the
#: 16-bit output it is computed into).
OUTPUT_DTYPES = {**{element: element for element in DTYPE_TAGS},
                 **{element: "float32" for element in FLOAT32_TAGS},
                 **{element: out for out, element in E4M3_ELEMENTS.items()}}

#: Optional features (template bits of the kernels: score modifiers in cuda_src/score_mods.cuh,
#: varlen in cuda_src/varlen.cuh). Specialisations are per combination, so plain attention
#: carries none of their code.
FEATURE_SOFTCAP = 1
FEATURE_ALIBI = 2
FEATURE_VARLEN = 4  # packed variable-length sequences (cuda_src/varlen.cuh)
FEATURE_DROPOUT = 8  # Philox dropout on P (cuda_src/dropout.cuh)
#: Learnable attention sinks: one logit a head in every row's softmax denominator, no value row
#: (cuda_src/variant.cuh). The backward main kernels are the same with or without them (P comes
#: from the lse, which counts the sink); their gradient is flash_bwd_sinks.cu's.
FEATURE_SINKS = 16
#: Programmable modifiers (cuflash2.mask_mod / score_mod, cuflash2/mods.py): the user's mask and
#: score expressions, compiled into a specialisation of their own with the generated header
#: user_mods.cuh (cuda_src/variant.cuh: mask_mod, score_mod): the mma.sync forward, backward and
#: deterministic dQ kernels (FwdModsConfig, BwdModsConfig, BwdDqModsConfig).
FEATURE_MASK_MOD = 32
FEATURE_SCORE_MOD = 64
#: A block mask (cuflash2.block_mask, cuflash2/block_mask.py) with the mask modifier: the mods
#: forward reads its per-tile states, skips empty tiles and runs the user's mask on partial ones
#: only (cuda_src/block_mask.cuh). Only with FEATURE_MASK_MOD, in the mods kernels.
FEATURE_BLOCK_MASK = 128
USER_MOD_FEATURES = FEATURE_MASK_MOD | FEATURE_SCORE_MOD | FEATURE_BLOCK_MASK
#: The additive bias's gradient (attention_backward with bias=, cuda_src/bias_grad.cuh): the
#: mma.sync backward main kernel with the bias as its score modifier writes dS out as dbias
#: (BwdModsParams.dbias). Backward main kernel only; never in the dQ kernel.
FEATURE_BIAS_GRAD = 256
#: The additive bias as a tile (the Hopper kernels, flash_fwd_sm90.cu and flash_bwd_sm90.cu, with
#: a bias alone as their score modifier): the producer loads each step's BLOCK_M x BLOCK_N block
#: of the bias by TMA (the forward's with V, the backward's with Q_i), the consumers add it to the
#: scores from shared memory (sm90/bias_tile.cuh), instead of reading it score by score through
#: the 4-D accessor. In FwdSm90ModsConfig and BwdSm90ModsConfig only.
FEATURE_BIAS_TILE = 512
#: The decode kernel's own (flash_decode.cu): rotary position embedding of the new keys as they
#: are appended and of q as it is loaded (attention_with_kvcache's rotary_cos / rotary_sin,
#: cuda_src/rotary.cuh), and cache_leftpad (each sequence's keys start at its own position).
FEATURE_ROTARY = 1024
FEATURE_LEFTPAD = 2048
#: A block mask's tile states (int8): no visible key in the tile, some, every (query, key) of the
#: tile inside the sequence visible.
BLOCK_MASK_EMPTY, BLOCK_MASK_PARTIAL, BLOCK_MASK_FULL = 0, 1, 2
#: Warps of block_mask.cu's CTA (one tile row of one head and batch entry; a warp a tile).
BLOCK_MASK_WARPS = 8
#: Every combination of the built-in features (the programmable modifiers' specialisations
#: are per expression: FwdModsConfig).
ALL_FEATURES = tuple(range(32))
#: The features only the forward kernels take: a backward call's main kernels are those of the
#: call without them (backward_features).
FORWARD_ONLY_FEATURES = FEATURE_SINKS
#: The score-modifier combinations (softcap, ALiBi).
SCORE_MOD_FEATURES = (0, FEATURE_SOFTCAP, FEATURE_ALIBI, FEATURE_SOFTCAP | FEATURE_ALIBI)
#: The features the decode kernel takes: each score-modifier set, without and with sinks (no
#: varlen, no dropout, no backward).
DECODE_MOD_FEATURES = SCORE_MOD_FEATURES + tuple(FEATURE_SINKS | f for f in SCORE_MOD_FEATURES)
#: The KV cache's own features of the decode kernel: rotary, cache_leftpad, both.
DECODE_CACHE_FEATURES = (FEATURE_ROTARY, FEATURE_LEFTPAD, FEATURE_ROTARY | FEATURE_LEFTPAD)
#: Every feature set the decode kernel takes: the modifiers' sets, alone and with each of the
#: cache's own.
DECODE_FEATURES = DECODE_MOD_FEATURES + tuple(c | f for c in DECODE_CACHE_FEATURES
                                              for f in DECODE_MOD_FEATURES)
#: The combinations the CPU compile tests build for every kernel, head dim and arch: none, each
#: feature alone and all together (each feature is its own `if constexpr` branch, so these
#: compile every line of every branch); sm_90 at d=64/128 builds ALL_FEATURES. The backward
#: builds them without the forward-only features (all together: 15).
TESTED_FEATURES = (0, FEATURE_SOFTCAP, FEATURE_ALIBI, FEATURE_VARLEN, FEATURE_DROPOUT,
                   FEATURE_SINKS, 31)
#: The decode kernel's share of them: each score modifier alone, sinks alone, and all together.
TESTED_DECODE_FEATURES = (0, FEATURE_SOFTCAP, FEATURE_ALIBI, FEATURE_SINKS,
                          FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINKS)


def backward_features(features: int) -> int:
    """The features of a backward call's main kernels: the call's but the forward-only ones
    (FEATURE_SINKS: P is recomputed from the lse, which counts the sink; the sinks' gradient is
    a kernel of its own, AuxKernel's flash_bwd_sinks_kernel)."""
    return features & ~FORWARD_ONLY_FEATURES

#: Architectures the CPU compile tests build for (the GPU path compiles for the device's own).
CPU_TEST_ARCHS = (80, 86, 89, 90)


# ---------------------------------------------------------------------------------------------
# Facts the kernels and Python share. This is their one definition: `cuda_constants_header`
# writes them into every kernel source as the header "constants.cuh" (cuflash2/_compile.py).

#: Padding of seqlen_q for the backward's per-row statistics and dQ accumulator: a multiple of
#: every block_m the backward uses.
BWD_ROW_PADDING = 128
#: Rows between the starts of consecutive sequences in the backward's per-row arrays (varlen),
#: beyond the sequence itself: BWD_ROW_PADDING rows of padding plus alignment of each start to 4.
VARLEN_STATS_GAP = BWD_ROW_PADDING + 4
#: Most KV splits of one decoding step (split_merge.cuh: four splits per lane in the merge).
MAX_SPLITS = 128
#: Most splits merged inside one thread-block cluster (split_merge.cuh; sm_90's largest cluster,
#: beyond the portable 8).
MAX_CLUSTER_SPLITS = 16
#: The backward preprocess (flash_bwd_preprocess.cu): threads a CTA, query rows a warp.
PREPROCESS_THREADS = 256
PREPROCESS_ROWS_PER_WARP = 8
#: The dQ conversion (flash_bwd_convert_dq.cu): threads a CTA, one 8-column chunk each.
CONVERT_THREADS = 256
#: The sinks' gradient (flash_bwd_sinks.cu): threads of its one CTA a head.
SINKS_THREADS = 256
#: The float32 Hopper forward's operand pass (flash_fwd_tf32_operands.cu: K rounded to TF32, V
#: rounded with its keys innermost): threads a CTA of 32 keys.
TF32_OPERANDS_THREADS = 256
#: The FP8 forward's P is exp2(s * scale_log2 - m * scale_log2 + E4M3_P_SCALE_LOG2): a row's
#: largest probability is 2^8 = 256 (exact in e4m3, below its 448), so probabilities down to
#: 2^-14 keep e4m3's 3 mantissa bits and down to 2^-17 are not 0 (from 1 they would lose bits
#: below 2^-6 and be 0 below 2^-9). The sums carry the same factor, which cancels in O / l; the
#: lse subtracts it (online_softmax.cuh; reference.py's e4m3 model rounds P the same way).
E4M3_P_SCALE_LOG2 = 8
#: The FP8 Hopper forward's transposers (FwdSm90Traits::TRANSPOSE_V): warps 1 .. this of the
#: producer warpgroup write V keys-last into the ring (sm90/fwd_transpose_v.cuh), warp 0's thread
#: 0 issues the TMA loads; each warp arrives once on the barriers they complete.
SM90_TRANSPOSE_V_WARPS = 3
#: Registers of the producer warpgroup where it also walks the persistent grid's work tiles to
#: transpose V (FwdSm90Traits::PRODUCER_REGISTERS); its consumers then take 232, what the CTA's
#: 168 x 384 registers at entry leave (FwdSm90Config.consumer_registers).
SM90_WIDE_PRODUCER_REGISTERS = 32
#: cuflash2.dropout_mask's kernel: warps a CTA, one 16 x 16 block each.
MASK_WARPS = 8
#: cuflash2.merge_states' kernel (merge_states.cu): threads a CTA, MergeStatesConfig.lanes of
#: them a (row, head) item.
MERGE_THREADS = 128
#: States merge_states.cu reads at once (their loads in flight together).
MERGE_GROUP = 4
#: The deterministic dQ kernel: 4 warps of 16 query rows.
BWD_DQ_WARPS = 4
#: The decode kernel's packed query rows a CTA: an m16 tile of the mma, or at most
#: DECODE_BLOCK_M_N8 on its n side, where a step's rows fit there (S^T = K Q^T: no mma work on
#: padding rows; flash_decode.cu, DecodeTraits).
DECODE_BLOCK_M = 16
DECODE_BLOCK_M_N8 = 8
#: Floats after each row of the decode kernel's warps' O in shared memory (flash_decode.cu:
#: MERGE_STRIDE): rows 8 floats apart put a warp's 8-byte stores of its accumulator fragments on
#: 32 different banks.
DECODE_MERGE_ROW_PAD = 8
#: The same with the rows on the n side: a warp's 4-byte stores of O^T fragments (8 columns x 4
#: rows) cover 32 banks with rows 4 floats (mod 32) apart.
DECODE_MERGE_ROW_PAD_N8 = 4
#: Rows of the backward's per-row arrays per dQ semaphore slot of the deterministic Hopper
#: backward (zeroed by the preprocess): a query block's head-dim chunk c orders its additions on
#: the slot of the block's first row, plus c. Varlen sequences start on 4-row boundaries there
#: (varlen.cuh), and a block of 64 rows has 16 slots, for at most two chunks.
DQ_SEMAPHORE_ROWS = 4
#: What the decode kernel's KV cache holds (its KV_CACHE_FORMAT; DecodeConfig.kv_cache_dtype):
#: q's 16-bit type, or FP8 e4m3 bytes with descale factors (cuda_src/kv_cache_e4m3.cuh).
KV_CACHE_AS_Q = 0
KV_CACHE_E4M3 = 1
#: The largest finite e4m3 ("e4m3fn") value: quantisation saturates there (cuda_src/fp8_convert.cuh,
#: cuflash2/fp8.py).
E4M3_MAX = 448
#: attention_with_kvcache's kv_cache_dtype values, by the format code the kernel takes.
KV_CACHE_FORMATS = {"e4m3": KV_CACHE_E4M3}

CUDA_CONSTANTS = {
    "FEATURE_SOFTCAP": FEATURE_SOFTCAP, "FEATURE_ALIBI": FEATURE_ALIBI,
    "FEATURE_VARLEN": FEATURE_VARLEN, "FEATURE_DROPOUT": FEATURE_DROPOUT,
    "FEATURE_SINKS": FEATURE_SINKS, "FEATURE_MASK_MOD": FEATURE_MASK_MOD,
    "FEATURE_SCORE_MOD": FEATURE_SCORE_MOD, "FEATURE_BLOCK_MASK": FEATURE_BLOCK_MASK,
    "FEATURE_BIAS_GRAD": FEATURE_BIAS_GRAD, "FEATURE_BIAS_TILE": FEATURE_BIAS_TILE,
    "FEATURE_ROTARY": FEATURE_ROTARY, "FEATURE_LEFTPAD": FEATURE_LEFTPAD,
    "BLOCK_MASK_EMPTY": BLOCK_MASK_EMPTY, "BLOCK_MASK_PARTIAL": BLOCK_MASK_PARTIAL,
    "BLOCK_MASK_FULL": BLOCK_MASK_FULL, "BLOCK_MASK_WARPS": BLOCK_MASK_WARPS,
    "BWD_ROW_PADDING": BWD_ROW_PADDING, "VARLEN_STATS_GAP": VARLEN_STATS_GAP,
    "MAX_SPLITS": MAX_SPLITS, "MAX_CLUSTER_SPLITS": MAX_CLUSTER_SPLITS,
    "PREPROCESS_THREADS": PREPROCESS_THREADS,
    "PREPROCESS_ROWS_PER_WARP": PREPROCESS_ROWS_PER_WARP, "CONVERT_THREADS": CONVERT_THREADS,
    "SINKS_THREADS": SINKS_THREADS, "TF32_OPERANDS_THREADS": TF32_OPERANDS_THREADS,
    "E4M3_P_SCALE_LOG2": E4M3_P_SCALE_LOG2,
    "SM90_TRANSPOSE_V_WARPS": SM90_TRANSPOSE_V_WARPS,
    "SM90_WIDE_PRODUCER_REGISTERS": SM90_WIDE_PRODUCER_REGISTERS,
    "MERGE_THREADS": MERGE_THREADS, "MERGE_GROUP": MERGE_GROUP,
    "MASK_WARPS": MASK_WARPS, "BWD_DQ_WARPS": BWD_DQ_WARPS, "DECODE_BLOCK_M": DECODE_BLOCK_M,
    "DECODE_BLOCK_M_N8": DECODE_BLOCK_M_N8, "DECODE_MERGE_ROW_PAD": DECODE_MERGE_ROW_PAD,
    "DECODE_MERGE_ROW_PAD_N8": DECODE_MERGE_ROW_PAD_N8, "DQ_SEMAPHORE_ROWS": DQ_SEMAPHORE_ROWS,
    "KV_CACHE_AS_Q": KV_CACHE_AS_Q, "KV_CACHE_E4M3": KV_CACHE_E4M3, "E4M3_MAX": E4M3_MAX,
}


def cuda_constants_header() -> str:
    """The kernels' "constants.cuh": CUDA_CONSTANTS as constexpr ints."""
    lines = ["// Generated from cuflash2/_configs.py (CUDA_CONSTANTS): the facts Python and the",
             "// kernels share. Edit them there.", "#pragma once"]
    lines += [f"constexpr int {name} = {value};" for name, value in CUDA_CONSTANTS.items()]
    return "\n".join(lines) + "\n"


def _settle_mma_sync_head_dim_v(config, kernel: str) -> None:
    """An mma.sync configuration's head_dim_v: 0 becomes head_dim; else V's kernel head dim
    must lie below Q's, for 16-bit elements (ValueError naming `kernel` otherwise)."""
    if not config.head_dim_v:
        object.__setattr__(config, "head_dim_v", config.head_dim)
    if config.head_dim_v > config.head_dim or (config.head_dim_v != config.head_dim
                                               and config.dtype in FLOAT32_TAGS):
        raise ValueError(f"{kernel} takes V's own head dim below Q's, 16-bit: not "
                         f"{config.head_dim_v} with {config.head_dim} ({config.dtype})")


@dataclass(frozen=True)
class FwdConfig:
    """One forward-kernel specialisation."""

    dtype: str  # "float16", "bfloat16", or float32's "float32" / "tf32" (FLOAT32_TAGS)
    head_dim: int  # kernel head dim (one of KERNEL_HEAD_DIMS)
    block_m: int  # query rows per CTA
    block_n: int  # keys per KV tile
    num_warps: int
    kv_stages: int = 2  # 2: double-buffered K/V tiles; 1: FA2's single-buffered schedule
    features: int = 0  # score modifiers compiled in (FEATURE_SOFTCAP | FEATURE_ALIBI)
    #: V's and O's kernel head dim where it differs from Q's and K's (at most head_dim: O is
    #: staged in Q's tile; 16-bit); 0: head_dim.
    head_dim_v: int = 0

    def __post_init__(self):
        _settle_mma_sync_head_dim_v(self, "the mma.sync forward")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        # Q tile + kv_stages x (K tile + V tile), 2 bytes a word (FwdTraits::SMEM_BYTES).
        return (2 * ELEMENT_WORDS[self.dtype]
                * (self.head_dim * (self.block_m + self.kv_stages * self.block_n)
                   + self.head_dim_v * self.kv_stages * self.block_n))

    @property
    def source_file(self) -> str:
        return "flash_fwd.cu"

    @property
    def name_expression(self) -> str:
        tag = ELEMENT_TAGS[self.dtype]
        return (f"flash_fwd_kernel<{tag}, {self.head_dim}, {self.head_dim_v}, {self.block_m}, "
                f"{self.block_n}, {self.num_warps}, {self.kv_stages}, {self.features}>")

    @property
    def probes(self) -> str:
        return _traits_probes(
            f"FwdTraits<{ELEMENT_TAGS[self.dtype]}, {self.head_dim}, {self.head_dim_v}, "
            f"{self.block_m}, {self.block_n}, {self.num_warps}, {self.kv_stages}>", self)


class _UserModsHeader:
    """The specialisations with programmable modifiers: their `user_mods` text is the generated
    header user_mods.cuh (cuflash2/mods.py, user_mods_header), which _compile adds to their
    source."""

    @property
    def generated_headers(self) -> tuple:
        """(name, text) of the headers generated for this specialisation alone (_compile)."""
        return (("user_mods.cuh", self.user_mods),)


@dataclass(frozen=True)
class FwdModsConfig(FwdConfig, _UserModsHeader):
    """A forward specialisation with programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD):
    FwdConfig's tile and features plus the generated header `user_mods` (cuflash2/mods.py:
    user_mods_header), whose hash names the kernel (flash_fwd_mods_kernel, FwdModsParams)."""

    user_mods: str = ""  # the text of the generated user_mods.cuh
    mods_hash: int = 0  # its USER_MODS_HASH (a hash of its code, mods.py)

    @property
    def name_expression(self) -> str:
        tag = DTYPE_TAGS[self.dtype]
        return (f"flash_fwd_mods_kernel<{tag}, {self.head_dim}, {self.head_dim_v}, "
                f"{self.block_m}, {self.block_n}, {self.num_warps}, {self.kv_stages}, "
                f"{self.features}, "
                f"{self.mods_hash:#010x}u>")


def _traits_probes(traits: str, config, block_m: bool = False) -> str:
    """static_asserts that the kernel's traits agree with `config` on what the host sizes from
    it (the launch's threads and dynamic shared memory, and the rows of a CTA where the kernel
    fixes them); appended to the specialisation's source, so a mismatch fails its compilation."""
    lines = [f"static_assert({traits}::THREADS == {config.threads}, \"threads\");",
             f"static_assert({traits}::SMEM_BYTES == {config.smem_bytes}, \"shared memory\");"]
    if block_m:
        lines.append(f"static_assert({traits}::BLOCK_M == {config.block_m}, \"rows a CTA\");")
    return "\n".join(lines) + "\n"


def with_features(config, features: int):
    """`config` with the score modifiers `features` compiled in (same tile shape)."""
    return config if config.features == features else dataclasses.replace(config, features=features)


# ---------------------------------------------------------------------------------------------
# Hopper forward (cuda_src/flash_fwd_sm90.cu; docs/HOPPER_FWD.md): compiled for sm_90a,
# dispatched on sm_90 (_dispatch.hopper_forward_config; CUFLASH2_HOPPER=0 turns it off).

#: Head dims of the Hopper forward, each its own specialisation (_dispatch.fwd_sm90_config's tiles).
SM90_FWD_HEAD_DIMS = (64, 96, 128, 192, 256)
#: The features it takes: the score modifiers, without and with sinks (dropout stays on the
#: mma.sync kernel).
SM90_FWD_FEATURES = DECODE_MOD_FEATURES
#: Its varlen specialisations: FEATURE_VARLEN with each of those sets, one-tile-per-CTA grid only
#: (dispatched unless _dispatch.HOPPER_FORWARD_VARLEN is off: CUFLASH2_HOPPER_VARLEN=0).
SM90_FWD_VARLEN_FEATURES = tuple(FEATURE_VARLEN | f for f in SM90_FWD_FEATURES)


@dataclass(frozen=True)
class FwdSm90Config:
    """One specialisation of the Hopper forward: a producer warpgroup (TMA) and block_m / 64
    consumer warpgroups (wgmma) of 128 threads; K/V tiles in a ring of `stages`."""

    dtype: str
    head_dim: int  # one of SM90_FWD_HEAD_DIMS
    block_m: int = 128  # query rows per CTA: 64 per consumer warpgroup
    block_n: int = 128  # keys per K/V tile: a multiple of 16 up to 256
    stages: int = 2
    #: The consumers take turns on the tensor cores (flash_fwd_sm90.cu: one's softmax under the
    #: other's GEMMs); the dispatcher's choice is _dispatch.SCHEDULES.
    pingpong: bool = False
    #: The overlap inside a warpgroup (flash_fwd_sm90.cu, OVERLAP: the softmax of tile j under
    #: P_{j-1} V_{j-1}; FlashAttention-3's intra-warpgroup pipelining), with either schedule.
    #: The dispatcher's choice per head dim and causal mode is _dispatch.SCHEDULES.
    overlap: bool = False
    features: int = 0  # FEATURE_SOFTCAP | FEATURE_ALIBI
    #: Debugging build: mbarrier waits trap after ~2 s instead of hanging (hopper_primitives.cuh;
    #: its trap makes ptxas spill, so never for timing).
    watchdog: bool = False
    #: A persistent grid (at most one CTA per SM looping over work tiles; the next tile's Q and
    #: K/V load under the current epilogue; O staged in a buffer of its own): head dims of
    #: _dispatch.SM90_PERSISTENT_TILES only (the O buffer must fit); the dispatcher's choice is
    #: _dispatch.hopper_forward_config's.
    persistent: bool = False
    #: With `persistent`: the CTAs claim their work tiles one by one from a pair of counters a
    #: stream (flash_fwd_sm90.cu, WorkTileClaims; FwdSm90Params.tile_counters) instead of taking
    #: every gridDim.x-th (_dispatch.DYNAMIC_SCHEDULE_KEYS).
    claims: bool = False
    #: V's and O's head dim where it differs from Q's and K's
    #: (_dispatch.SM90_FWD_HEAD_DIM_PAIRS); 0: head_dim.
    head_dim_v: int = 0

    def __post_init__(self):
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.head_dim_v > self.head_dim:
            raise ValueError(f"the Hopper forward stages O in Q's buffer: V's head dim "
                             f"({self.head_dim_v}) at most Q's ({self.head_dim})")
        if self.block_m not in (64, 128, 192) or (self.pingpong and self.block_m != 128):
            raise ValueError(f"the Hopper forward has one consumer warpgroup (block_m 64, no "
                             f"ping-pong), two (block_m 128, either schedule) or three (block_m "
                             f"192, no ping-pong), not block_m {self.block_m}"
                             f"{' with ping-pong' if self.pingpong else ''}")
        if self.claims and not self.persistent:
            raise ValueError("work tiles are claimed on the persistent grid only")
        if self.persistent and self.features & FEATURE_VARLEN:
            raise ValueError("varlen runs on the one-tile-per-CTA grid of the Hopper forward, "
                             "not the persistent one")
        if self.persistent and self.smem_bytes > SM90_MAX_SMEM:
            raise ValueError(
                f"a persistent Hopper forward needs {self.smem_bytes} bytes of shared memory at "
                f"head dim {self.head_dim} with {self.stages} stages (Q, the K/V ring and an O "
                f"buffer), more than the {SM90_MAX_SMEM} an SM has: persistent tiles are those "
                f"of _dispatch.SM90_PERSISTENT_TILES")

    #: The compile target's suffix: sm_90a (wgmma, setmaxnreg), never plain sm_90.
    arch_suffix = "a"
    #: The architecture it is built for.
    arch = 90

    @property
    def threads(self) -> int:
        return 128 * (1 + self.block_m // 64)

    @property
    def extra_options(self) -> tuple:
        return ("-DCF2_MBARRIER_WATCHDOG",) if self.watchdog else ()

    @property
    def panels(self) -> int:
        """128-byte panels (64 16-bit columns, 32 float32, 128 e4m3) of a row of a tile in
        shared memory: the head dim's bytes rounded up to 128 (d=96: two, the second half
        zero-filled by the TMA; FwdSm90Traits::PANELS)."""
        return -(-self.head_dim * ELEMENT_BYTES[self.dtype] // 128)

    @property
    def v_panels(self) -> int:
        """`panels` of a V row: of head_dim_v (FwdSm90Traits::V_PANELS)."""
        return -(-self.head_dim_v * ELEMENT_BYTES[self.dtype] // 128)

    @property
    def o_panels(self) -> int:
        """`panels` of an O row, in the output's dtype (FwdSm90Traits::O_PANELS)."""
        return -(-self.head_dim_v * ELEMENT_BYTES[OUTPUT_DTYPES[self.dtype]] // 128)

    @property
    def keys_last_v(self) -> bool:
        """Whether the ring holds V with its keys innermost (float32, e4m3:
        FwdSm90Traits::KEYS_LAST_V): written by an operand pass before the kernel, or by the
        kernel's producer warpgroup (`transpose_v`)."""
        return self.dtype not in DTYPE_TAGS

    @property
    def transpose_v(self) -> bool:
        """Whether the kernel reads the caller's V as it lies and its producer warpgroup writes
        it keys-last into the ring (e4m3: FwdSm90Traits::TRANSPOSE_V; no operand pass)."""
        return self.dtype in E4M3_TAGS

    @property
    def operand_pass(self) -> bool:
        """Whether an operand pass writes K or V into the call's scratch before the kernel (the
        float32 elements: FwdSm90Traits::KEYS_LAST_V without TRANSPOSE_V)."""
        return self.keys_last_v and not self.transpose_v

    @property
    def raw_v_stages(self) -> int:
        """With `transpose_v`, the raw V buffers after the ring (FwdSm90Traits::RAW_V_STAGES):
        two where they fit SM90_MAX_SMEM, else one; 0 otherwise."""
        if not self.transpose_v:
            return 0
        return 2 if self._ring_smem_bytes + 2 * self._raw_v_tile_bytes <= SM90_MAX_SMEM else 1

    @property
    def _raw_v_tile_bytes(self) -> int:
        """A raw V tile: v_panels panels of block_n 128-byte rows (FwdSm90Traits::
        RAW_V_TILE_BYTES)."""
        return 128 * self.v_panels * self.block_n if self.transpose_v else 0

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory (FwdSm90Traits::SMEM_BYTES): the ring's, then the raw V
        buffers (`raw_v_stages`)."""
        return self._ring_smem_bytes + self.raw_v_stages * self._raw_v_tile_bytes

    @property
    def _ring_smem_bytes(self) -> int:
        # The Q region (Q, or O staged there where larger: e4m3 inputs, a 16-bit O) + stages x
        # (K tile + V tile) (+ an O tile when persistent), rows of 128 bytes, + 1 KiB to align
        # the base to 1024 B by hand (FwdSm90Traits::SMEM_BYTES). The mbarriers are static.
        # With FEATURE_BIAS_TILE each stage holds the bias's block_m x block_n tile too.
        # Precision "highest" ("float32", 3xTF32) holds two parts of Q and of each K / V tile.
        parts = 2 if self.dtype == "float32" else 1
        q_tile = 128 * self.panels * self.block_m
        o_tile = 128 * self.o_panels * self.block_m
        q_region = max(parts * q_tile, 0 if self.persistent else o_tile)
        k_tile = 128 * self.panels * self.block_n
        # A keys-last V tile: panels of 128 bytes of keys by head_dim_v rows, the last one
        # whole where the keys end inside it (e4m3's 160-224 keys: FwdSm90Traits::VT_PANELS).
        v_tile = (128 * -(-self.block_n * ELEMENT_BYTES[self.dtype] // 128) * self.head_dim_v
                  if self.keys_last_v else 128 * self.v_panels * self.block_n)
        bias = 2 * self.block_m * self.block_n if self.bias_tile else 0
        stage = parts * (k_tile + v_tile) + bias
        return (q_region + self.stages * stage + (o_tile if self.persistent else 0) + 1024)

    @property
    def bias_tile(self) -> bool:
        """Whether the bias comes as tiles with V (FEATURE_BIAS_TILE)."""
        return bool(self.features & FEATURE_BIAS_TILE)

    @property
    def source_file(self) -> str:
        return "flash_fwd_sm90.cu"

    @property
    def name_expression(self) -> str:
        return (f"flash_fwd_sm90_kernel<{HOPPER_FORWARD_TAGS[self.dtype]}, {self.head_dim}, "
                f"{self.head_dim_v}, {self.block_m}, {self.block_n}, {self.stages}, "
                f"{'true' if self.pingpong else 'false'}, "
                f"{'true' if self.overlap else 'false'}, {self.features}, "
                f"{'true' if self.persistent else 'false'}, "
                f"{'true' if self.claims else 'false'}>")

    @property
    def probes(self) -> str:
        traits = (f"FwdSm90Traits<{HOPPER_FORWARD_TAGS[self.dtype]}, {self.head_dim}, "
                  f"{self.head_dim_v}, {self.block_m}, "
                  f"{self.block_n}, {self.stages}, {'true' if self.persistent else 'false'}"
                  f"{', true' if self.bias_tile else ''}>")
        return _traits_probes(traits, self) + (
            f"static_assert({traits}::CONSUMER_REGISTERS == "
            f"{self.consumer_registers}, \"setmaxnreg budget\");\n")

    @property
    def consumer_registers(self) -> int:
        """Registers of a consumer thread after setmaxnreg.inc (FwdSm90Traits): the share
        beside the producer's 24 (sm90_consumer_registers), or where the producer warpgroup
        transposes V on the persistent grid beside its SM90_WIDE_PRODUCER_REGISTERS, of the
        registers the CTA has at entry (65536 / threads, a multiple of 8, each thread)."""
        if not (self.transpose_v and self.persistent):
            return sm90_consumer_registers(self.block_m // 64)
        entry = 65536 // self.threads // 8 * 8
        consumers = self.threads - 128
        return (entry * self.threads - SM90_WIDE_PRODUCER_REGISTERS * 128) // consumers // 8 * 8


@dataclass(frozen=True)
class FwdSm90ModsConfig(FwdSm90Config, _UserModsHeader):
    """The Hopper forward with programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD, and
    FEATURE_BLOCK_MASK for a block mask's narrowed ranges): FwdSm90Config's schedule, tile and
    features plus the generated header `user_mods` (cuflash2/mods.py), whose hash names the
    kernel (flash_fwd_sm90_mods_kernel, FwdSm90ModsParams), as FwdModsConfig."""

    user_mods: str = ""
    mods_hash: int = 0

    @property
    def name_expression(self) -> str:
        plain = super().name_expression
        return (plain.replace("flash_fwd_sm90_kernel<", "flash_fwd_sm90_mods_kernel<", 1)[:-1]
                + f", {self.mods_hash:#010x}u>")


#: Registers of a consumer thread after setmaxnreg.inc with two consumer warpgroups
#: (Sm90CtaLayout::CONSUMER_REGISTERS).
SM90_CONSUMER_REGISTERS = 240
#: Registers of the producer warpgroup's threads after setmaxnreg.dec.
SM90_PRODUCER_REGISTERS = 24


def sm90_consumer_registers(warpgroups: int) -> int:
    """Registers of a consumer thread after setmaxnreg.inc beside `warpgroups` - 1 others and
    the producer (Sm90CtaLayout::consumer_registers): the register file's 64K less the
    producer's, shared, a multiple of 8, at most SM90_CONSUMER_REGISTERS (240 for two, 160 for
    three)."""
    share = (65536 - SM90_PRODUCER_REGISTERS * 128) // (warpgroups * 128) // 8 * 8
    return min(share, SM90_CONSUMER_REGISTERS)


#: Shared memory one CTA of the Hopper forward may use: 227 KiB (the 1 KiB alignment slack
#: included).
SM90_MAX_SMEM = 227 * 1024


# ---------------------------------------------------------------------------------------------
# Hopper backward (cuda_src/flash_bwd_sm90.cu; docs/HOPPER_BWD.md): compiled for sm_90a,
# dispatched on sm_90 (_dispatch.hopper_backward_config; CUFLASH2_HOPPER_BWD=0 turns it off).

#: Head dims of the Hopper backward. Above 128 a key block's dK / dV / dQ columns are split over
#: two CTAs (head-dim chunks of 128 + 64 at d=192, 128 + 128 at d=256), each recomputing S^T and
#: dP^T over the whole head dim: dK and dV of 64 keys x 128 columns are what a consumer thread's
#: registers hold (BwdSm90Traits::PEAK_ACCUMULATORS).
SM90_BWD_HEAD_DIMS = (64, 96, 128, 192, 256)
#: The widest head-dim chunk of one CTA (BwdSm90Traits::CHUNK_COLS).
SM90_BWD_CHUNK_COLS = 128
#: The features it takes: the score modifiers (dropout: mma.sync), and varlen with each of them
#: (SM90_BWD_VARLEN_FEATURES).
SM90_BWD_FEATURES = SCORE_MOD_FEATURES
SM90_BWD_VARLEN_FEATURES = tuple(FEATURE_VARLEN | f for f in SCORE_MOD_FEATURES)

#: Static shared memory the Hopper backward may take beside its dynamic shared memory (its
#: mbarriers and the block's first key, BwdSm90Barriers; checked by a probe): part of the 227 KiB
#: a CTA may have.
SM90_BWD_BARRIER_BYTES = 128


@dataclass(frozen=True)
class BwdSm90Config:
    """One specialisation of the Hopper backward main kernel: a producer warpgroup (TMA) and
    block_n / 64 consumer warpgroups (wgmma), each owning 64 keys; Q / dO tiles in a ring of
    `stages`."""

    dtype: str
    head_dim: int  # one of SM90_BWD_HEAD_DIMS
    block_m: int = 64  # query rows a step: 64, or 128 (dQ split by rows) up to d=64
    block_n: int = 128  # keys a CTA: 64 per consumer warpgroup
    stages: int = 2
    features: int = 0  # FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_VARLEN
    #: Debugging build: mbarrier waits trap after ~2 s instead of hanging.
    watchdog: bool = False
    #: dQ staged in shared memory (this many fp32 tiles of block_m rows, taken in turn) and
    #: added to the accumulator by one bulk reduction a step; 0: vector reductions from
    #: registers (flash_bwd_sm90.cu, DQ_BUFFERS). Staged where the tiles fit, one chunk
    #: (SM90_BWD_TILES).
    dq_buffers: int = 0
    #: deterministic=True: dQ added in key-block order (the staged tiles' bulk reductions, or
    #: the consumers' vector reductions), behind a semaphore per query block and head-dim chunk
    #: (flash_bwd_sm90.cu, DETERMINISTIC).
    deterministic: bool = False
    #: V's and dO's head dim where it differs from Q's and K's
    #: (_dispatch.SM90_FWD_HEAD_DIM_PAIRS, whose dV columns lie in the first chunk:
    #: BwdSm90Traits); 0: head_dim.
    head_dim_v: int = 0

    arch_suffix = "a"
    arch = 90

    def __post_init__(self):
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.head_dim_v != self.head_dim and not (
                self.head_dim_v < self.head_dim and self.head_dim_v <= SM90_BWD_CHUNK_COLS):
            raise ValueError(f"the Hopper backward takes V's own head dim below Q's and within "
                             f"its first chunk ({SM90_BWD_CHUNK_COLS} columns); not "
                             f"{self.head_dim_v} with {self.head_dim}")
        if self.features & FEATURE_DROPOUT:
            raise ValueError("the Hopper backward has no dropout")
        if self.block_m not in (64, 128) or (self.block_m == 128 and self.head_dim > 64):
            raise ValueError(f"the Hopper backward takes steps of 64 query rows, or 128 up to "
                             f"head dim 64; not {self.block_m} at {self.head_dim}")
        if not 0 <= self.dq_buffers <= 2:
            raise ValueError(f"dq_buffers is 0, 1 or 2; not {self.dq_buffers}")
        budget = SM90_MAX_SMEM - SM90_BWD_BARRIER_BYTES
        if self.dq_staged and (self.num_chunks > 1 or self.smem_bytes > budget):
            raise ValueError(
                f"staged dQ tiles need one head-dim chunk and room beside the rest of the Hopper "
                f"backward's shared memory: head dim {self.head_dim} has {self.num_chunks} "
                f"chunk(s) and would need {self.smem_bytes} bytes (of {budget})")
        if self.smem_bytes > budget:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory (of {budget})")

    @property
    def dq_staged(self) -> bool:
        """dQ through staged shared-memory tiles and bulk reductions (dq_buffers > 0)."""
        return self.dq_buffers > 0

    @property
    def threads(self) -> int:
        return 128 * (1 + self.block_n // 64)

    @property
    def extra_options(self) -> tuple:
        return ("-DCF2_MBARRIER_WATCHDOG",) if self.watchdog else ()

    @property
    def panels(self) -> int:
        return -(-self.head_dim // 64)

    @property
    def v_panels(self) -> int:
        """`panels` of a V and dO row: of head_dim_v (BwdSm90Traits::V_PANELS)."""
        return -(-self.head_dim_v // 64)

    @property
    def num_chunks(self) -> int:
        """Head-dim chunks a key block is split into across CTAs (BwdConfig.num_chunks; grid.x =
        key block x chunk): one up to d=128, two above (chunks of SM90_BWD_CHUNK_COLS columns,
        the last one the rest)."""
        return -(-self.head_dim // SM90_BWD_CHUNK_COLS)

    @property
    def smem_bytes(self) -> int:
        # K + V, stages x (Q + dO), two dS tiles (block_m x block_n), stages x (lse + D) rows,
        # dq_buffers fp32 dQ tiles, + 1 KiB to align the base by hand
        # (BwdSm90Traits::SMEM_BYTES). V and dO: v_panels.
        kv = 128 * (self.panels + self.v_panels) * self.block_n
        stage = 128 * (self.panels + self.v_panels) * self.block_m + 2 * 4 * self.block_m
        # With FEATURE_BIAS_TILE each stage holds the bias's block_m x block_n tile too.
        if self.features & FEATURE_BIAS_TILE:
            stage += 2 * self.block_m * self.block_n
        ds = 2 * 2 * self.block_m * self.block_n
        dq = self.dq_buffers * 4 * self.block_m * self.head_dim
        return kv + self.stages * stage + ds + dq + 1024

    @property
    def source_file(self) -> str:
        return "flash_bwd_sm90.cu"

    @property
    def name_expression(self) -> str:
        return (f"flash_bwd_sm90_kernel<{DTYPE_TAGS[self.dtype]}, {self.head_dim}, "
                f"{self.head_dim_v}, {self.block_m}, {self.block_n}, {self.stages}, "
                f"{self.features}, "
                f"{self.dq_buffers}, {'true' if self.deterministic else 'false'}>")

    @property
    def probes(self) -> str:
        bias = ", true" if self.features & FEATURE_BIAS_TILE else ""
        traits = (f"BwdSm90Traits<{DTYPE_TAGS[self.dtype]}, {self.head_dim}, "
                  f"{self.head_dim_v}, {self.block_m}, "
                  f"{self.block_n}, {self.stages}, {self.dq_buffers}{bias}>")
        return _traits_probes(traits, self) + (
            f"static_assert({traits}::CONSUMER_REGISTERS == {SM90_CONSUMER_REGISTERS}, "
            "\"setmaxnreg budget\");\n"
            f"static_assert(sizeof(BwdSm90Barriers<{self.stages}>) <= {SM90_BWD_BARRIER_BYTES}, "
            "\"static shared memory\");\n")


@dataclass(frozen=True)
class BwdSm90ModsConfig(BwdSm90Config, _UserModsHeader):
    """The Hopper backward with a mask modifier (FEATURE_MASK_MOD, and FEATURE_BLOCK_MASK for a
    block mask's narrowed query blocks; no score modifiers): BwdSm90Config's tile and features
    plus the generated header `user_mods` (cuflash2/mods.py), whose hash names the kernel
    (flash_bwd_sm90_mods_kernel, BwdSm90ModsParams), as FwdSm90ModsConfig."""

    user_mods: str = ""
    mods_hash: int = 0

    @property
    def name_expression(self) -> str:
        plain = super().name_expression
        return (plain.replace("flash_bwd_sm90_kernel<", "flash_bwd_sm90_mods_kernel<", 1)[:-1]
                + f", {self.mods_hash:#010x}u>")


# ---------------------------------------------------------------------------------------------
# Backward


def _warp_grid(rows: int, cols: int, warps: int, wanted: int = 0, tall: bool = False) -> int | None:
    """Warps along the rows of a (rows x cols) product so that every warp tile is a multiple of
    16 in both dimensions, or None. `wanted` (> 0) is the only candidate if given; otherwise the
    most nearly square warp tile wins (shared-memory reads per mma are lowest there), then, with
    `tall`, the one with more rows, else the one closest to 32 rows. Measured on the H200: S and
    dP at d=64 run ~1.5% faster on 64 x 32 warp tiles than on 32 x 64; dK and dV at d=128 ~1%
    faster on 32 x 64 than on 64 x 32."""
    options = []
    for warps_m in ([wanted] if wanted else range(1, warps + 1)):
        if warps % warps_m:
            continue
        tile_m, tile_n = rows / warps_m, cols / (warps // warps_m)
        if tile_m % 16 or tile_n % 16:
            continue
        options.append((abs(math.log2(tile_m / tile_n)), -tile_m if tall else abs(tile_m - 32),
                        warps_m))
    return min(options)[2] if options else None


@dataclass(frozen=True)
class BwdConfig:
    """One specialisation of the backward main kernel (flash_bwd.cu). Each of its three phases
    splits its product over the warps in its own grid (BwdTraits): phase A (S, dP) over
    (block_m x block_n), phase B (dK, dV) over (block_n x d_chunk), phase C (dQ) over
    (block_m x d_chunk). With V's own kernel head dim (`head_dim_v` below head_dim, 16-bit) dV's
    chunks are as many, each head_dim_v / num_chunks columns over phase B's warp grid."""

    dtype: str  # "float16", "bfloat16", or float32's "float32" / "tf32" (FLOAT32_TAGS)
    head_dim: int  # kernel head dim (one of KERNEL_HEAD_DIMS)
    d_chunk: int  # head-dim columns of dK, dV, dQ per CTA (head_dim or head_dim / 2)
    block_m: int  # query rows per step
    block_n: int  # key rows per CTA
    num_warps: int
    q_stages: int  # 2: double-buffered Q/dO tiles
    compute_dq: bool = True  # False in deterministic mode (flash_bwd_dq.cu computes dQ)
    # Warps along the rows of each phase's grid; 0 picks the most nearly square warp tiles.
    sdp_rows_warps: int = 0
    kv_rows_warps: int = 0
    dq_rows_warps: int = 0
    features: int = 0  # score modifiers compiled in (FEATURE_SOFTCAP | FEATURE_ALIBI)
    #: V's, dO's and dV's kernel head dim where it differs from Q's and K's (below head_dim,
    #: 16-bit); 0: head_dim.
    head_dim_v: int = 0

    def __post_init__(self):
        _settle_mma_sync_head_dim_v(self, "the mma.sync backward")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def num_chunks(self) -> int:
        return self.head_dim // self.d_chunk

    @property
    def d_chunk_v(self) -> int:
        """dV's columns a chunk (BwdTraits::D_CHUNK_V)."""
        return self.head_dim_v // self.num_chunks

    @property
    def sdp_warps_m(self) -> int | None:
        return _warp_grid(self.block_m, self.block_n, self.num_warps, self.sdp_rows_warps,
                          tall=True)

    @property
    def kv_warps_n(self) -> int | None:
        return _warp_grid(self.block_n, self.d_chunk, self.num_warps, self.kv_rows_warps)

    @property
    def dq_warps_m(self) -> int | None:
        return _warp_grid(self.block_m, self.d_chunk, self.num_warps, self.dq_rows_warps)

    @property
    def valid(self) -> bool:
        """Every phase has a warp grid (the static_asserts of BwdTraits), dV's chunk too."""
        if None in (self.sdp_warps_m, self.kv_warps_n, self.dq_warps_m):
            return False
        kv_warps_d = self.num_warps // self.kv_warps_n
        return (self.head_dim_v % self.num_chunks == 0
                and self.d_chunk_v % (16 * kv_warps_d) == 0)

    @property
    def accumulator_registers(self) -> int:
        """fp32 accumulator registers a thread keeps live: dK and dV for the whole loop, plus S and
        dP (phase A) or dQ (phase C)."""
        dkdv = self.block_n * (self.d_chunk + self.d_chunk_v) // self.threads
        sdp = 2 * self.block_m * self.block_n // self.threads
        dq = self.block_m * self.d_chunk // self.threads if self.compute_dq else 0
        return dkdv + max(sdp, dq)

    @property
    def smem_bytes(self) -> int:
        # 2 bytes a word, ELEMENT_WORDS words an element (BwdTraits::SMEM_BYTES); the per-row
        # statistics are float32 whatever the element.
        element = 2 * ELEMENT_WORDS[self.dtype]
        widths = self.head_dim + self.head_dim_v  # K and V; Q and dO
        kv = element * self.block_n * widths
        stage = element * self.block_m * widths + 2 * 4 * self.block_m
        p_ds = 2 * element * self.block_m * self.block_n
        return kv + self.q_stages * stage + p_ds

    @property
    def source_file(self) -> str:
        return "flash_bwd.cu"

    @property
    def name_expression(self) -> str:
        return (f"flash_bwd_kernel<{ELEMENT_TAGS[self.dtype]}, {self.head_dim}, {self.head_dim_v}, "
                f"{self.d_chunk}, {self.block_m}, {self.block_n}, {self.num_warps}, "
                f"{self.sdp_warps_m}, {self.kv_warps_n}, {self.dq_warps_m}, {self.q_stages}, "
                f"{'true' if self.compute_dq else 'false'}, {self.features}>")

    @property
    def probes(self) -> str:
        return _traits_probes(
            f"BwdTraits<{self.head_dim}, {self.head_dim_v}, {self.d_chunk}, {self.block_m}, "
            f"{self.block_n}, {self.num_warps}, {self.sdp_warps_m}, {self.kv_warps_n}, "
            f"{self.dq_warps_m}, {self.q_stages}{self._words_argument}>", self)

    @property
    def _words_argument(self) -> str:
        """BwdTraits' WORDS (16-bit words an element) where it is not its default 1."""
        words = ELEMENT_WORDS[self.dtype]
        return "" if words == 1 else f", {words}"


@dataclass(frozen=True)
class BwdModsConfig(BwdConfig, _UserModsHeader):
    """A backward main kernel with programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD):
    BwdConfig's tile and features plus the generated header `user_mods` (cuflash2/mods.py), whose
    hash names the kernel (flash_bwd_mods_kernel, BwdModsParams), as FwdModsConfig."""

    user_mods: str = ""
    mods_hash: int = 0

    @property
    def name_expression(self) -> str:
        return (f"flash_bwd_mods_kernel<{DTYPE_TAGS[self.dtype]}, {self.head_dim}, "
                f"{self.head_dim_v}, {self.d_chunk}, {self.block_m}, {self.block_n}, "
                f"{self.num_warps}, {self.sdp_warps_m}, {self.kv_warps_n}, {self.dq_warps_m}, "
                f"{self.q_stages}, "
                f"{'true' if self.compute_dq else 'false'}, {self.features}, "
                f"{self.mods_hash:#010x}u>")


@dataclass(frozen=True)
class BwdDqConfig:
    """One specialisation of the deterministic dQ kernel (flash_bwd_dq.cu): 4 warps of 16 rows."""

    dtype: str  # "float16", "bfloat16", or float32's "float32" / "tf32" (FLOAT32_TAGS)
    head_dim: int
    block_n: int
    kv_stages: int
    block_m: int = 16 * BWD_DQ_WARPS
    threads: int = 32 * BWD_DQ_WARPS
    features: int = 0  # score modifiers compiled in (FEATURE_SOFTCAP | FEATURE_ALIBI)
    #: V's and dO's kernel head dim where it differs from Q's and K's (below head_dim, 16-bit);
    #: 0: head_dim.
    head_dim_v: int = 0

    def __post_init__(self):
        _settle_mma_sync_head_dim_v(self, "the deterministic dQ kernel")

    @property
    def smem_bytes(self) -> int:
        element = 2 * ELEMENT_WORDS[self.dtype]  # bytes: 2 a 16-bit word (BwdDqTraits)
        widths = self.head_dim + self.head_dim_v  # Q and dO; K and V
        return element * widths * (self.block_m + self.kv_stages * self.block_n)

    @property
    def source_file(self) -> str:
        return "flash_bwd_dq.cu"

    @property
    def name_expression(self) -> str:
        return (f"flash_bwd_dq_kernel<{ELEMENT_TAGS[self.dtype]}, {self.head_dim}, "
                f"{self.head_dim_v}, {self.block_n}, {self.kv_stages}, {self.features}>")

    @property
    def probes(self) -> str:
        return _traits_probes(
            f"BwdDqTraits<{ELEMENT_TAGS[self.dtype]}, {self.head_dim}, {self.head_dim_v}, "
            f"{self.block_n}, {self.kv_stages}>", self, block_m=True)


@dataclass(frozen=True)
class BwdDqModsConfig(BwdDqConfig, _UserModsHeader):
    """The deterministic dQ kernel with programmable modifiers (flash_bwd_dq_mods_kernel,
    BwdModsParams): BwdDqConfig plus the generated header, as BwdModsConfig."""

    user_mods: str = ""
    mods_hash: int = 0

    @property
    def name_expression(self) -> str:
        return (f"flash_bwd_dq_mods_kernel<{DTYPE_TAGS[self.dtype]}, {self.head_dim}, "
                f"{self.head_dim_v}, {self.block_n}, {self.kv_stages}, {self.features}, "
                f"{self.mods_hash:#010x}u>")


#: The float32 Hopper forward's operand pass (AuxKernel("tf32" or "float32",
#: TF32_OPERANDS_KERNEL)).
TF32_OPERANDS_KERNEL = "flash_fwd_tf32_operands_kernel"


@dataclass(frozen=True)
class AuxKernel:
    """A small kernel specialised on the dtype only (backward pre- and post-processing, the
    float32 Hopper forward's operand pass)."""

    # "float16", "bfloat16" or "float32" (whatever a float32 call's precision); the preprocess
    # also "tf32" (its D takes dO rounded as the products do), the operand pass "tf32" and
    # "float32" (K and V's two TF32 parts, for precision "highest").
    dtype: str
    #: "flash_bwd_preprocess_kernel", "flash_bwd_convert_dq_kernel" or "flash_bwd_sinks_kernel"
    #: (the sinks' gradient, grid (nheads, 1, 1): FEATURE_SINKS calls only), or
    #: "flash_fwd_tf32_operands_kernel" (TF32_OPERANDS_KERNEL: before the Hopper forward at
    #: precision "tf32" or "highest", grid (keys_padded / 32, kv heads, batch); FwdSm90Params)
    kernel: str
    varlen: bool = False  # packed variable-length sequences
    smem_bytes: int = 0

    @property
    def threads(self) -> int:
        return {"flash_bwd_preprocess_kernel": PREPROCESS_THREADS,
                "flash_bwd_convert_dq_kernel": CONVERT_THREADS,
                "flash_bwd_sinks_kernel": SINKS_THREADS,
                TF32_OPERANDS_KERNEL: TF32_OPERANDS_THREADS}[self.kernel]

    @property
    def source_file(self) -> str:
        return {"flash_bwd_preprocess_kernel": "flash_bwd_preprocess.cu",
                "flash_bwd_convert_dq_kernel": "flash_bwd_convert_dq.cu",
                "flash_bwd_sinks_kernel": "flash_bwd_sinks.cu",
                TF32_OPERANDS_KERNEL: "flash_fwd_tf32_operands.cu"}[self.kernel]

    @property
    def name_expression(self) -> str:
        return (f"{self.kernel}<{HOPPER_FORWARD_TAGS[self.dtype]}, "
                f"{'true' if self.varlen else 'false'}>")

    probes = ""


@dataclass(frozen=True)
class BlockMaskConfig(_UserModsHeader):
    """cuflash2.block_mask's kernel (cuda_src/block_mask.cu) for tiles of block_m x block_n and a
    mask modifier's generated header `user_mods` (mods.user_mods_header; its hash names the
    kernel, as FwdModsConfig's). Grid (num_m_blocks, nheads, batch), BLOCK_MASK_WARPS warps."""

    block_m: int
    block_n: int
    user_mods: str = ""
    mods_hash: int = 0
    threads: int = 32 * BLOCK_MASK_WARPS
    smem_bytes: int = 0
    source_file: str = "block_mask.cu"
    probes: str = ""

    @property
    def name_expression(self) -> str:
        return (f"flash_block_mask_kernel<{self.block_m}, {self.block_n}, "
                f"{self.mods_hash:#010x}u>")


@dataclass(frozen=True)
class DropoutMaskKernel:
    """cuflash2.dropout_mask's kernel (cuda_src/dropout_mask.cu): 8 warps, one 16 x 16 block each."""

    threads: int = 32 * MASK_WARPS
    smem_bytes: int = 0
    source_file: str = "dropout_mask.cu"
    name_expression: str = "flash_dropout_mask_kernel"
    blocks_per_cta: int = MASK_WARPS
    probes: str = ""


@dataclass(frozen=True)
class MergeStatesConfig:
    """cuflash2.merge_states' kernel (cuda_src/merge_states.cu) for results of `dtype`
    ("float16", "bfloat16" or "float32") with `lanes` threads a (row, head) item, a 16-byte
    chunk of the row each (merge_lanes). Grid (ceil(nheads * seqlen / items_per_cta), 1,
    batch), MERGE_THREADS threads."""

    dtype: str
    lanes: int
    threads: int = MERGE_THREADS
    smem_bytes: int = 0
    source_file: str = "merge_states.cu"
    probes: str = ""

    @property
    def items_per_cta(self) -> int:
        return MERGE_THREADS // self.lanes

    @property
    def name_expression(self) -> str:
        return f"merge_states_kernel<{ELEMENT_TAGS[self.dtype]}, {self.lanes}>"


#: The lanes a merged row may take: a warp at most, a power of two.
MERGE_LANES = (1, 2, 4, 8, 16, 32)


def merge_lanes(row_bytes: int) -> int:
    """The lanes merge_states.cu gives a row of `row_bytes` (a multiple of 16): one a 16-byte
    chunk, up to a warp (which then loops over the chunks)."""
    chunks = row_bytes // 16
    return next((lanes for lanes in MERGE_LANES if lanes >= chunks), MERGE_LANES[-1])


def merge_configs() -> list[MergeStatesConfig]:
    """Every specialisation of merge_states.cu."""
    return [MergeStatesConfig(dtype, lanes) for dtype in ("float16", "bfloat16", "float32")
            for lanes in MERGE_LANES]


def aux_kernels(dtypes=tuple(DTYPE_TAGS)) -> list[AuxKernel]:
    """Every small backward kernel for `dtypes` (FLOAT32_TAGS: float32 inputs', the preprocess
    at each precision, the others' "float32" whatever the precision)."""
    return [AuxKernel(dtype, kernel, varlen) for dtype in dtypes
            for kernel in ("flash_bwd_preprocess_kernel", "flash_bwd_convert_dq_kernel",
                           "flash_bwd_sinks_kernel")
            if dtype != "tf32" or kernel == "flash_bwd_preprocess_kernel"
            for varlen in (False, True)]


# ---------------------------------------------------------------------------------------------
# Inference with a KV cache (issue 5; docs/DECODE_DESIGN.md)


@dataclass(frozen=True)
class DecodeConfig:
    """One specialisation of flash_decode.cu: `block_m` packed query rows a CTA (an m16 tile, or
    DECODE_BLOCK_M_N8 on the mma's n side), warps splitting each KV tile by keys."""

    dtype: str
    head_dim: int
    num_warps: int
    keys_per_warp: int
    kv_stages: int
    features: int = 0  # FEATURE_SOFTCAP | FEATURE_ALIBI
    # The cache read before the previous kernel ends (attention_with_kvcache's
    # early_cache_reads, with a programmatic launch).
    early_cache_reads: bool = False
    block_m: int = DECODE_BLOCK_M
    # None: the cache holds q's dtype; "e4m3": FP8 e4m3 bytes with descale factors (the
    # stages hold bytes, a 16-bit tile the warps' converted rows: kv_cache_e4m3.cuh).
    kv_cache_dtype: str | None = None

    @property
    def block_n(self) -> int:
        return self.num_warps * self.keys_per_warp

    @property
    def cache_element_bytes(self) -> int:
        return 2 if self.kv_cache_dtype is None else 1

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        q = 2 * DECODE_BLOCK_M * self.head_dim  # an m16 tile (rows on n: its first 8)
        stages = self.kv_stages * 2 * self.cache_element_bytes * self.block_n * self.head_dim
        if self.kv_cache_dtype is not None:  # the 16-bit tile of converted rows (K's, V's)
            stages += 2 * self.block_n * self.head_dim
        # After the KV loop: the warps' states (O's rows padded, then (m, l)), then the CTA's
        # inbox for a merge inside a cluster (split_merge.cuh: ClusterInboxSize, an mbarrier and
        # a 4-column chunk and an lse a slot).
        pad = DECODE_MERGE_ROW_PAD_N8 if self.block_m == DECODE_BLOCK_M_N8 else DECODE_MERGE_ROW_PAD
        inbox_slots = self.block_m * (self.head_dim // 4) + MAX_CLUSTER_SPLITS
        merge = (self.num_warps * (self.head_dim + pad + 2) * self.block_m * 4
                 + 16 + inbox_slots * (16 + 4))
        return q + max(stages, merge)

    @property
    def source_file(self) -> str:
        return "flash_decode.cu"

    @property
    def name_expression(self) -> str:
        # (a 16-bit cache's name without the format: the template's default)
        cache = ("" if self.kv_cache_dtype is None
                 else f", {KV_CACHE_FORMATS[self.kv_cache_dtype]}")
        return (f"flash_decode_kernel<{DTYPE_TAGS[self.dtype]}, {self.head_dim}, {self.num_warps}, "
                f"{self.keys_per_warp}, {self.kv_stages}, {self.features}, "
                f"{str(self.early_cache_reads).lower()}, {self.block_m}{cache}>")

    @property
    def probes(self) -> str:
        e4m3 = "" if self.kv_cache_dtype is None else ", true"
        return _traits_probes(
            f"DecodeTraits<{self.head_dim}, {self.num_warps}, {self.keys_per_warp}, "
            f"{self.kv_stages}, {self.block_m}{e4m3}>", self, block_m=True)


#: MLA's latent cache (docs/MLA_DECODE.md): K's head dim (the latent row) and V's (its first
#: columns), the only pair of flash_mla_decode_sm90.cu.
MLA_HEAD_DIM = 576
MLA_HEAD_DIM_V = 512
#: Its CTA's packed query rows and a cache tile's positions (MlaDecodeTraits::BLOCK_M, BLOCK_N).
MLA_BLOCK_M = 64
MLA_BLOCK_N = 64


@dataclass(frozen=True)
class MlaDecodeConfig:
    """flash_mla_decode_sm90.cu (sm_90a): the decode step of a latent cache whose rows are K
    (MLA_HEAD_DIM columns) and V (their first MLA_HEAD_DIM_V), one KV head. A producer
    warpgroup (TMA) and two consumers (wgmma) over MLA_BLOCK_M packed rows; Q and a 2-stage
    ring of MLA_BLOCK_N-position tiles in shared memory. One specialisation a dtype."""

    dtype: str
    features: int = 0  # none: the host refuses score modifiers and the cache's own features
    head_dim: int = MLA_HEAD_DIM
    head_dim_v: int = MLA_HEAD_DIM_V
    block_m: int = MLA_BLOCK_M
    block_n: int = MLA_BLOCK_N
    stages: int = 2
    threads: int = 384
    early_cache_reads: bool = False  # (the decode configuration's field: never here)
    # Two row blocks that see the same tiles as one cluster of 2 CTAs, each tile loaded once for
    # both (TMA multicast): _dispatch.mla_decode_kernel decides.
    paired: bool = False

    arch_suffix = "a"
    arch = 90

    def __post_init__(self):
        if self.dtype not in DTYPE_TAGS:
            raise ValueError(f"the MLA decode kernel takes fp16 or bf16, not {self.dtype}")
        if self.features:
            raise ValueError("the MLA decode kernel takes no features")

    @property
    def smem_bytes(self) -> int:
        # Q and `stages` tiles of all head_dim columns (rows of 128-byte panels), the tile's P
        # (block_m x block_n, 16-bit) and the two consumers' row maxima (block_m floats each),
        # + 1 KiB to align the base to 1024 B by hand (MlaDecodeTraits::SMEM_BYTES); barriers
        # static.
        tile = 2 * self.block_n * self.head_dim
        return (2 * self.block_m * self.head_dim + self.stages * tile
                + 2 * self.block_m * self.block_n + 2 * 4 * self.block_m + 1024)

    @property
    def source_file(self) -> str:
        return "flash_mla_decode_sm90.cu"

    @property
    def name_expression(self) -> str:
        paired = "true" if self.paired else "false"
        return f"flash_mla_decode_sm90_kernel<{DTYPE_TAGS[self.dtype]}, {paired}>"

    @property
    def probes(self) -> str:
        traits = f"MlaDecodeTraits<{DTYPE_TAGS[self.dtype]}>"
        return _traits_probes(traits, self, block_m=True) + (
            f"static_assert({traits}::CONSUMER_REGISTERS == {sm90_consumer_registers(2)}, "
            f"\"setmaxnreg budget\");\n"
            f"static_assert({traits}::BLOCK_N == {self.block_n} && {traits}::STAGES == "
            f"{self.stages} && {traits}::HEAD_DIM == {self.head_dim} && {traits}::HEAD_DIM_V == "
            f"{self.head_dim_v}, \"tile\");\n")


def describe(config) -> str:
    """A kernel configuration in words (cuflash2.forward_kernels, cuflash2.backward_kernels)."""
    dtype = {"float16": "fp16", "bfloat16": "bf16", "e4m3_bf16": "e4m3 (out bf16)",
             "e4m3_fp16": "e4m3 (out fp16)"}.get(config.dtype, config.dtype)
    mods = [name for bit, name in ((FEATURE_SOFTCAP, "softcap"), (FEATURE_ALIBI, "ALiBi"),
                                   (FEATURE_SINKS, "sinks"), (FEATURE_DROPOUT, "dropout"),
                                   (FEATURE_VARLEN, "varlen"), (FEATURE_MASK_MOD, "mask_mod"),
                                   (FEATURE_SCORE_MOD, "score_mod"),
                                   (FEATURE_BLOCK_MASK, "block mask"),
                                   (FEATURE_BIAS_GRAD, "dbias"),
                                   (FEATURE_BIAS_TILE, "bias tiles"),
                                   (FEATURE_ROTARY, "rotary"),
                                   (FEATURE_LEFTPAD, "cache_leftpad"))
            if getattr(config, "features", 0) & bit]
    extra = f", with {' + '.join(mods)}" if mods else ""
    if isinstance(config, MlaDecodeConfig):
        return (f"MLA decode (sm_90a: wgmma, TMA, warp-specialised), {dtype}, latent head dim "
                f"{config.head_dim} (v {config.head_dim_v}), {config.block_m} query rows x "
                f"{config.block_n}-token tiles, {config.stages} stages")
    if isinstance(config, FwdSm90Config):
        schedule = "ping-pong" if config.pingpong else "in-order"
        if config.overlap:
            schedule += " overlapping (softmax under P V)"
        grid = ((", persistent grid" + (" (tiles claimed one by one)" if config.claims else ""))
                if config.persistent else "")
        three = " (three warpgroups)" if config.block_m == 192 else ""
        v_dim = f" (v {config.head_dim_v})" if config.head_dim_v != config.head_dim else ""
        return (f"Hopper forward (sm_90a: wgmma, TMA, warp-specialised), {dtype}, head dim "
                f"{config.head_dim}{v_dim}, {config.block_m}x{config.block_n} tiles, {config.stages} "
                f"K/V stages, {schedule} consumers{three}{grid}{extra}")
    if isinstance(config, FwdConfig):
        v_dim = f" (v {config.head_dim_v})" if config.head_dim_v != config.head_dim else ""
        return (f"mma.sync forward, {dtype}, head dim {config.head_dim}{v_dim}, {config.block_m}x"
                f"{config.block_n} tiles, {config.num_warps} warps, {config.kv_stages} K/V "
                f"stages{extra}")
    if isinstance(config, BwdSm90Config):
        chunks = f", {config.num_chunks} head-dim chunks" if config.num_chunks > 1 else ""
        dq = ", dQ added in key-block order (deterministic)" if config.deterministic else ""
        v_dim = f" (v {config.head_dim_v})" if config.head_dim_v != config.head_dim else ""
        return (f"Hopper backward (sm_90a: wgmma, TMA, warp-specialised), {dtype}, head dim "
                f"{config.head_dim}{v_dim}, {config.block_m}x{config.block_n} tiles, "
                f"{config.stages} "
                f"Q/dO stage{'s' if config.stages > 1 else ''}{chunks}{dq}{extra}")
    if isinstance(config, BwdConfig):
        dq = "dQ by atomics" if config.compute_dq else "no dQ (deterministic)"
        chunks = f", {config.num_chunks} head-dim chunks" if config.num_chunks > 1 else ""
        v_dim = f" (v {config.head_dim_v})" if config.head_dim_v != config.head_dim else ""
        return (f"mma.sync backward, {dtype}, head dim {config.head_dim}{v_dim}, {config.block_m}x"
                f"{config.block_n} tiles, {config.num_warps} warps, {config.q_stages} Q/dO "
                f"stages{chunks}, {dq}{extra}")
    if isinstance(config, BwdDqConfig):
        v_dim = f" (v {config.head_dim_v})" if config.head_dim_v != config.head_dim else ""
        return (f"mma.sync backward dQ (deterministic), {dtype}, head dim "
                f"{config.head_dim}{v_dim}, {config.block_m}x{config.block_n} tiles{extra}")
    if isinstance(config, AuxKernel):
        what = {"flash_bwd_preprocess_kernel": "backward preprocess (D, lse, dQ accumulator)",
                "flash_bwd_convert_dq_kernel": "backward dQ conversion",
                "flash_bwd_sinks_kernel": "backward sinks gradient",
                TF32_OPERANDS_KERNEL: "forward operand pass (K and V rounded to TF32, V keys "
                                      "innermost)",
                }.get(config.kernel, config.kernel)
        return f"{what}, {dtype}{', varlen' if config.varlen else ''}"
    if isinstance(config, MergeStatesConfig):
        return f"merge of attention states by their lse, {dtype}, {config.lanes} lanes a row"
    return config.name_expression
