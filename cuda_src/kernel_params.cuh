// Kernel parameters: one struct per kernel family, passed by value as a `__grid_constant__`
// kernel parameter (it stays in the constant bank: no copy, field reads are constant loads).
//
// This file is the one definition of these layouts. cuflash2/_params.py reads it to lay out the
// same bytes on the host (a plan fills the sizes once and patches the per-call pointers), and a
// CPU test compiles `offsetof` / `sizeof` probes that check Python's offsets against the
// compiler's. Keep to what that reader understands: one field per line, `type name;`, the types
// below (pointers, i64, int, float, u32), a fixed-size `unsigned long long name[N];` array, or a
// struct defined earlier in this file (which may carry an `__align__(N)`).
//
// Strides are in elements; a tensor's (batch, row, head) strides follow its pointer's name.
#pragma once
#include "mma_primitives.cuh"

// The attention variant's own parameters (variant.cuh): softcap and ALiBi (score_mods.cuh), the
// learnable sinks; each read only by the specialisations that compile its feature in.
struct VariantParams {
    float softcap_scale;        // softmax_scale / softcap: raw score -> tanh argument
    const float* alibi_slopes;  // (nheads,) or (batch, nheads)
    i64 alibi_batch_stride;     // 0 for (nheads,) slopes
    float alibi_to_units;       // 1 / the effective softmax scale (ALiBi's bias, sinks: to raw units)
    const float* sinks;         // (nheads,): one logit a head in every row's softmax denominator
};

// Packed variable-length sequences (varlen.cuh); read only by FEATURE_VARLEN specialisations.
struct VarlenParams {
    const int* cu_seqlens_q;  // (batch + 1,)
    const int* cu_seqlens_k;
    int total_q;              // rows of the packed q / k arrays
    int total_k;
};

// Philox dropout on P (dropout.cuh); read only by FEATURE_DROPOUT specialisations.
struct DropoutParams {
    u32 seed_lo;
    u32 seed_hi;
    u32 offset;
    u32 keep_threshold;  // keep iff the 16-bit uniform is below it
    float scale;         // 1 / (1 - dropout_p)
};

// The 128 bytes of a CUtensorMap (cuTensorMapEncodeTiled's output, opaque here), 64-byte aligned
// as the driver's type is. cp.async.bulk.tensor reads it from the kernel parameter space.
struct __align__(64) TensorMap {
    unsigned long long v[16];
};

// flash_fwd.cu. q, k, v, out are addressed in 16-bit words, their strides and head_dim
// counted in words (mma_primitives.cuh: a float32 element is two).
struct FwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* out;
    float* lse;
    i64 q_batch_stride;
    i64 q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;
    i64 k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    i64 v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    int seqlen_q;
    int seqlen_k;
    int nheads;
    int heads_per_kv_head;
    int head_dim;
    int head_dim_v;       // v's and out's (head_dim but for d_v != d_qk), in words as head_dim
    float softmax_scale;  // the scale the softmax sees (softcap's, with softcap): lse units
    float scale_log2;     // softmax_scale * log2(e): scores -> exp2 arguments
    int window_left;      // -1: unbounded
    int window_right;
    VariantParams mods;
    VarlenParams varlen;
    DropoutParams dropout;
    int batch_offset;  // first sequence of this launch (grids of more than 65535 sequences)
};

// A read-only input of a programmable modifier (cuflash2.mask_mod / score_mod; user_inputs.cuh):
// its address and element strides (unused dims 0). Its element type and rank are the generated
// user_mods.cuh's, per specialisation.
struct UserInput {
    const void* data;
    i64 stride0;
    i64 stride1;
    i64 stride2;
    i64 stride3;
};

// The inputs of a specialisation's mask and score modifiers, in the order cuflash2/mods.py
// numbers them (the mask's first); those it does not have stay null.
struct UserParams {
    UserInput in0;
    UserInput in1;
    UserInput in2;
    UserInput in3;
    UserInput in4;
    UserInput in5;
    UserInput in6;
    UserInput in7;
};

// A block mask's per-tile states (cuflash2.block_mask; block_mask.cuh): one byte a (batch, head,
// m block, n block) tile of the kernel's own tiles (BLOCK_MASK_EMPTY, _PARTIAL, _FULL), the
// batch and head strides 0 where the states are shared by every batch entry / head.
struct BlockMaskStates {
    const signed char* states;
    i64 batch_stride;
    i64 head_stride;
    i64 row_stride;  // the n blocks of a row
};

// A block mask's rows summed up (block_mask.cu; cuflash2.reference.block_mask_ranges): for each
// (batch, head, m block) row of states, in n blocks, .x / .y the first tile that is not empty
// and one past the last (0, 0 where all are empty), .z / .w the row's longest run of full tiles
// (its first, one past its last; 0, 0 where none is full). The Hopper forward narrows a work
// tile's KV range to [x, y) and skips the user's mask on [z, w) (BlockMaskNarrow): 16 bytes a
// row, read once a work tile. Strides in rows, 0 where the states are shared.
struct BlockMaskRanges {
    const int4* rows;
    i64 batch_stride;
    i64 head_stride;
};

// flash_fwd.cu's kernel with programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD): the
// forward's parameters, then the modifiers' inputs. A struct of its own, so that FwdParams, and
// with it every other specialisation's parameters and machine code, stays as it was.
struct FwdModsParams {
    FwdParams base;
    UserParams user;
    BlockMaskStates blocks;  // FEATURE_BLOCK_MASK only (block_mask.cuh); unused otherwise
};

// The FP8 forward's descale factors (e4m3_tag; docs/FP8_FORWARD.md): the value of an element of
// q, k or v is its e4m3 value times its factor, a float32 read at (batch, kv head) with these
// strides in elements (0 along an axis the factor is shared on; a query head takes its KV
// head's factor, as FlashAttention-3's). Null for the other elements.
struct E4m3Descales {
    const float* q;
    const float* k;
    const float* v;
    i64 q_batch_stride;
    i64 q_head_stride;
    i64 k_batch_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    i64 v_head_stride;
};

// flash_fwd_sm90.cu: the forward's parameters plus the TMA descriptors of q, k and v, each over
// the whole (batch, seqlen, heads, headdim) array as (head dim, row, head, batch) with 128-byte
// swizzle (cuflash2/_hopper.py builds them). The maps come first: at offsets 0, 128 and 256 they
// keep their 64-byte alignment whatever FwdParams holds. The persistent grid (one 1-D grid over
// every batch) reads its work from batch, section_pairs and tile_counters; the one-CTA-per-tile
// grid ignores them.
struct FwdSm90Params {
    TensorMap q_map;
    TensorMap k_map;
    TensorMap v_map;
    FwdParams base;
    int batch;          // sequences: the persistent grid's tiles cover all of them
    int section_pairs;  // (batch, head) pairs a section of the persistent tile order (L2 reuse)
    // The claimed schedule's two counters (tiles claimed, CTAs done), zero before and after
    // each launch (the last CTA resets them); read only by the CLAIMS specialisations
    // (flash_fwd_sm90.cu, WorkTileClaims), null for the others.
    int* tile_counters;
    // Float32 (tf32_tag, f32x3_tag) only, else null: K rounded to TF32 and V rounded with its
    // keys innermost, written by flash_fwd_tf32_operands.cu before the forward, whose k_map and
    // v_map read them (scratch of the call); with f32x3_tag each holds the small parts too (K's
    // rows and V's blocks twice as long: flash_fwd_tf32_operands.cu).
    // e4m3 (e4m3_tag): both null; the forward reads q, k and v in place and writes V keys-last
    // into its ring itself (sm90/fwd_transpose_v.cuh).
    float* k_tf32;
    void* v_keys_last;
    // e4m3 only: the factors of q, k and v (docs/FP8_FORWARD.md).
    E4m3Descales descales;
};

// flash_fwd_sm90.cu's kernel with programmable modifiers (flash_fwd_sm90_mods_kernel): the
// Hopper forward's parameters as they are (their tensor maps first, 64-byte aligned), then the
// modifiers' inputs. A struct of its own, as FwdModsParams.
struct FwdSm90ModsParams {
    FwdSm90Params sm90;
    UserParams user;
    // FEATURE_BLOCK_MASK only (block_mask.cuh, BlockMaskNarrow): the ranges of the states' rows
    // (of the forward's mma.sync tiles), how many of their rows / columns a Hopper tile spans,
    // and the count of their rows.
    BlockMaskRanges ranges;
    int block_m_div;
    int block_n_div;
    int num_m_blocks;
    // FEATURE_BIAS_TILE only (sm90/bias_tile.cuh): the bias's map, over its own (batch or 1,
    // heads or 1, seqlen_q, seqlen_k) array as (key, row, head, batch) with 128-byte swizzle,
    // boxes of 64 keys x block_m rows; its head and batch extents (1: broadcast).
    int bias_heads;
    int bias_batches;
    TensorMap bias_map;
};

// The backward family: flash_bwd_preprocess.cu, flash_bwd.cu, flash_bwd_dq.cu (deterministic dQ)
// and flash_bwd_convert_dq.cu all take one struct, filled once per call; each reads its part.
struct BwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* out;
    const u16* dout;
    const float* lse;  // the forward's, natural log
    float* lse_log2;   // per-row statistics, rows padded (varlen.cuh, stats_row0)
    float* delta;      // D = rowsum(dO * O)
    float* dq_accum;   // fp32 dQ of the atomic path, (stats rows, accum_dim), interleaved
    int* dq_semaphore; // the deterministic Hopper backward's: a slot per DQ_SEMAPHORE_ROWS rows, or null
    u16* dq;
    u16* dk;
    u16* dv;
    i64 q_batch_stride;
    i64 q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;
    i64 k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    i64 v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 do_batch_stride;
    i64 do_row_stride;
    i64 do_head_stride;
    i64 dq_batch_stride;
    i64 dq_row_stride;
    i64 dq_head_stride;
    i64 dk_batch_stride;
    i64 dk_row_stride;
    i64 dk_head_stride;
    i64 dv_batch_stride;
    i64 dv_row_stride;
    i64 dv_head_stride;
    int seqlen_q;
    int seqlen_q_padded;  // rows per head of the per-row arrays
    int seqlen_k;
    int nheads;
    int heads_per_kv_head;
    int head_dim;
    int head_dim_v;       // v's, dout's and out's (head_dim but for d_v != d_qk)
    int accum_dim;        // columns of dq_accum: the kernel head dim
    float softmax_scale;  // d(scaled scores) / d(q.k): the final dQ, dK scaling
    float scale_log2;     // the scale the softmax saw (softcap's, with softcap) times log2(e)
    int window_left;
    int window_right;
    VariantParams mods;
    VarlenParams varlen;
    DropoutParams dropout;
    int batch_offset;
    // The sinks' gradient (FEATURE_SINKS; flash_bwd_sinks.cu), last: ptxas loads neighbouring
    // fields in pairs, and these two among the others (a pointer, an int) gave every backward
    // kernel other machine code; here the fields above keep their pairs.
    float* dsinks;        // (nheads,)
    int batch;            // sequences (the sinks' gradient sums over all of them)
};

// The gradient of an additive bias (attention_backward with bias=; FEATURE_BIAS_GRAD): dS at
// every (row, key) of the tiles the main kernel visits, into a zeroed fp32 array of the bias's
// own shape, indexed (batch, query head, row, key) with element strides 0 along the dims the
// bias broadcasts. There several CTAs add to one element (accumulate = 1: atomics); otherwise
// each element has one writer.
struct BiasGrad {
    float* data;
    i64 stride0;
    i64 stride1;
    i64 stride2;
    i64 stride3;
    int accumulate;
};

// flash_bwd.cu's and flash_bwd_dq.cu's kernels with programmable modifiers (FEATURE_MASK_MOD,
// FEATURE_SCORE_MOD; flash_bwd_mods_kernel, flash_bwd_dq_mods_kernel): the backward's
// parameters, the modifiers' inputs and the scale of the scores the softmax saw (softcap's, with
// softcap: FwdParams' softmax_scale of the forward; BwdParams keeps it only times log2(e)), with
// which the user's score modifier takes the scores as the forward gave them. A struct of its
// own, as FwdModsParams: BwdParams and every other specialisation's machine code stay as they
// were. The preprocess and the dQ conversion take `base`.
struct BwdModsParams {
    BwdParams base;
    UserParams user;
    float score_scale;
    BiasGrad dbias;  // FEATURE_BIAS_GRAD only (bias_grad.cuh); unused otherwise
    // FEATURE_BLOCK_MASK only (block_mask.cuh, BlockMaskColumn): the states, and how many of
    // the kernel's query / key blocks one state's tile spans.
    BlockMaskStates blocks;
    int block_m_div;
    int block_n_div;
};

// flash_bwd_sm90.cu: the backward's parameters plus the TMA descriptors of q, k, v and dout, each
// over the whole (batch, seqlen, heads, headdim) array as (head dim, row, head, batch) with
// 128-byte swizzle, as FwdSm90Params' (cuflash2/_hopper.py builds them: q and dout boxes of
// block_m rows, k and v of block_n). Maps first, at 0 / 128 / 256 / 384 (64-byte aligned).
struct BwdSm90Params {
    TensorMap q_map;
    TensorMap k_map;
    TensorMap v_map;
    TensorMap do_map;
    BwdParams base;
    int dispatch_group_pairs;  // (KV head, batch) pairs taken key-block-major together (1: none)
};

// A block mask's columns summed up (block_mask.cu, by atomics as the states are made;
// cuflash2.reference.block_mask_columns): for each (batch, head, n block) column of states, 8
// ints: [0] its first row (m block) that is not empty and [1] one past its last (0x7fffffff, 0
// where all are empty); [2] its first full row and [3] one past its last, [4] how many rows are
// full (the rows [2] .. [3] are all full where [4] = [3] - [2]); [5..7] unused. Strides in
// columns, 0 where the states are shared.
struct BlockMaskColumns {
    const int* columns;
    i64 batch_stride;
    i64 head_stride;
};

// flash_bwd_sm90.cu's kernel with a mask modifier (flash_bwd_sm90_mods_kernel): the Hopper
// backward's parameters as they are, then the modifier's inputs; with a block mask
// (FEATURE_BLOCK_MASK: block_mask.cuh, BlockMaskColumnRange) its columns, the states' tile
// (their rows and keys) and their count of columns. A struct of its own, as FwdSm90ModsParams.
struct BwdSm90ModsParams {
    BwdSm90Params sm90;
    UserParams user;
    BlockMaskColumns columns;
    int state_block_m;
    int state_block_n;
    int num_n_blocks;
    // FEATURE_BIAS_TILE only (sm90/bias_tile.cuh): the bias's map and extents, as
    // FwdSm90ModsParams's (boxes of 64 keys x the step's block_m rows).
    int bias_heads;
    int bias_batches;
    // FEATURE_BIAS_GRAD only (sm90/bwd_bias_grad.cuh): dbias's fp32 accumulator.
    BiasGrad dbias;
    TensorMap bias_map;
};

// flash_decode.cu
struct DecodeParams {
    const u16* q;
    u16* k_cache;
    u16* v_cache;
    const u16* k_new;  // tokens to append (q when there are none: never read then)
    const u16* v_new;
    u16* out;
    float* lse;
    float* o_partial;     // split-KV workspace, (row block, split, row, head dim)
    float* lse_partial;
    int* split_counters;  // one per row block, never reset (split_merge.cuh: split_barrier)
    const int* cache_seqlens;  // (batch,), or null: cache_len_all for every sequence
    const int* cache_batch_idx;
    const int* block_table;
    i64 q_batch_stride;
    i64 q_row_stride;
    i64 q_head_stride;
    i64 kn_batch_stride;
    i64 kn_row_stride;
    i64 kn_head_stride;
    i64 vn_batch_stride;
    i64 vn_row_stride;
    i64 vn_head_stride;
    i64 kc_batch_stride;
    i64 kc_row_stride;
    i64 kc_head_stride;
    i64 vc_batch_stride;
    i64 vc_row_stride;
    i64 vc_head_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 block_table_stride;
    int cache_len_all;
    int seqlen_new;
    int page_size;
    int num_blocks;
    int capacity;
    int seqlen_q;
    int nheads;
    int heads_per_kv_head;
    int head_dim;
    int num_m_blocks;
    int num_splits;
    int tiles_per_split;
    int split_cluster;  // 1: a row block's splits are one thread-block cluster (split_merge.cuh)
    float scale_log2;
    int window_left;
    int window_right;
    VariantParams mods;
    int batch_offset;
    // An e4m3 cache (kv_cache_e4m3.cuh): the factors its values are multiplied by, read at
    // (batch, kv head) with these strides in elements (0 for a factor shared along that axis).
    const float* k_descale;
    const float* v_descale;
    i64 kd_batch_stride;
    i64 kd_head_stride;
    i64 vd_batch_stride;
    i64 vd_head_stride;
    // FEATURE_ROTARY (rotary.cuh): cos and sin (seqlen_ro, rotary_dim / 2) in q's type, rows
    // contiguous; rotary_interleaved: GPT-J pairs (else GPT-NeoX halves); rotary_q_per_row: q's
    // rows at cache_len + their position (causal or a window), else all at cache_len.
    const u16* rotary_cos;
    const u16* rotary_sin;
    int rotary_dim;
    int seqlen_ro;
    int rotary_interleaved;
    int rotary_q_per_row;
    // FEATURE_LEFTPAD: (batch,) the first position of each sequence's keys.
    const int* cache_leftpad;
};

// flash_mla_decode_sm90.cu (docs/MLA_DECODE.md): the decode step of a latent cache, whose rows
// are K (all head_dim columns) and V (their first head_dim_v), one KV head. The cache is read by
// the TMA through kv_map, a (head dim, row, 1, cache batch row or block) map with boxes of 64
// columns by box_rows rows (64, or the page size of shorter pages); the rest is the decode
// kernel's DecodeParams as `base` (v_cache: the same rows; v_new: unread).
struct MlaDecodeParams {
    TensorMap kv_map;
    DecodeParams base;
    int box_rows;
};

// dropout_mask.cu
struct DropoutMaskParams {
    unsigned char* mask;  // (batch, nheads, seqlen_q, seqlen_k)
    int nheads;
    int seqlen_q;
    int seqlen_k;
    DropoutParams dropout;
    int batch_offset;
};

// block_mask.cu (cuflash2.block_mask): the states (batch, nheads, num_m_blocks, num_n_blocks) of
// a mask modifier with inputs `user`; batch and nheads 1 where the states are shared.
struct BlockMaskParams {
    signed char* states;
    int4* ranges;  // BlockMaskRanges' rows, one a CTA
    int* columns;  // BlockMaskColumns' columns, filled beforehand (0x7fffffff, 0, 0x7fffffff, 0, 0)
    int nheads;
    int seqlen_q;
    int seqlen_k;
    int num_m_blocks;
    int num_n_blocks;
    UserParams user;
    int batch_offset;
};

// merge_states.cu (cuflash2.merge_states, merge_states_many): attention results to merge, each an
// out (batch, seqlen, nheads, head_dim) in 16-bit words and an lse (batch, nheads, seqlen) in
// floats; state s of a MergeStates at s state strides from the first (strides in words and
// floats; batch strides 0 for unbatched or packed varlen rows).
struct MergeStates {
    const u16* out;
    const float* lse;
    i64 o_state_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 lse_state_stride;
    i64 lse_batch_stride;
    i64 lse_head_stride;
    i64 lse_row_stride;
};

// State 0 is `first`, states 1 .. num_states - 1 are `rest`'s 0 .. num_states - 2: two arrays of
// their own (merge_states) or one stacked array (merge_states_many: `rest` starts a state
// stride after `first`). The merged out and lse have the same layouts.
struct MergeStatesParams {
    MergeStates first;
    MergeStates rest;
    u16* out;
    float* lse;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 lse_batch_stride;
    i64 lse_head_stride;
    i64 lse_row_stride;
    int num_states;
    int seqlen;
    int nheads;
    int head_dim;  // in 16-bit words
    int batch_offset;
};
