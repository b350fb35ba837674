// Attention of a few query tokens against a long KV cache (inference decoding), split over the
// keys ("flash-decoding"): grid (row block x KV split, KV head, batch).
//
// Decoding is bound by reading the cache, so the kernel is built around reading it once:
// - The query heads that share a KV head are packed into the rows (row rr = query position
//   rr / group, head kv_head * group + rr % group), so each K/V byte serves the whole group; a CTA
//   owns one m16 tile of such rows, or, where a step has at most 8, holds them on the n side of
//   the mma (ROWS_ON_N: S^T = K Q^T and O^T = V^T P^T, no mma work on padding rows).
// - Its warps (4, or 2 where shared memory is short) split every KV tile by keys (KEYS_PER_WARP
//   each) instead of splitting the rows: each warp keeps its own online softmax (m, l) and
//   unnormalised O for the CTA's rows, and the warps' partial states are merged through shared
//   memory once, after the last tile.
// - K/V tiles stream through KV_STAGES cp.async stages; rows come from a contiguous or paged
//   cache (kv_cache.cuh), positions past the sequence's cache length are never read.
// - New tokens (k, v) are appended here, not by a kernel of their own: the CTAs read positions
//   cache_len .. cache_len + seqlen_new from k_new / v_new directly, and one CTA per (sequence,
//   KV head) writes them into the cache, which no CTA reads at those positions.
// - With more than one split, the splits of a row block merge their normalised partial results
//   (split_merge.cuh), each a share of the block's output: on sm_90 for short steps inside a
//   thread-block cluster of the splits, each storing its result's pieces straight into the
//   shared memory of the splits that merge them; otherwise through a workspace in L2, the
//   splits waiting for each other at a barrier (a cooperative launch keeps them all resident).
//   With one split the CTA writes out and lse itself.
// - On sm_90 the kernel is launched programmatically (dependent_launch.cuh): it starts while
//   the previous kernel on the stream finishes and waits for that kernel's writes before it
//   touches memory (with EARLY_CACHE_READS, before it reads q and the new tokens: the lengths
//   and the first tiles of cached positions are read while that kernel finishes); it lets the
//   next kernel start LAUNCH_DEPENDENTS_TILES_BEFORE_END tiles before its last.
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"
#include "variant.cuh"
#include "warp_gemm.cuh"
#include "kv_cache.cuh"
#include "kv_cache_e4m3.cuh"
#include "lse_merge.cuh"
#include "split_merge.cuh"
#include "output_store.cuh"
#include "dependent_launch.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// What a KV stage holds and what the cache's elements are: q's 16-bit type in swizzled tiles, or
// e4m3 bytes (kv_cache_e4m3.cuh).
template <bool E4M3_CACHE, int ROWS, int COLS>
struct StagedTileOf {
    using type = SwizzledTile<ROWS, COLS>;
    using Stored = u16;
};
template <int ROWS, int COLS>
struct StagedTileOf<true, ROWS, COLS> {
    using type = E4M3Tile<ROWS, COLS>;
    using Stored = u8;
};

// BLOCK_M: the CTA's packed query rows, an m16 tile (DECODE_BLOCK_M), or at most 8 of them on
// the n side of the mma (DECODE_BLOCK_M_N8: ROWS_ON_N), where a step's rows fit there (one
// query token of a GQA group of up to 8): S^T = K Q^T and O^T = V^T P^T then spend no mma work
// on padding rows, half of it for such a step on an m16 tile.
// E4M3_CACHE: the cache holds e4m3 bytes (kv_cache_e4m3.cuh): the stages hold them as read, and
// a 16-bit tile after Q the warps' converted rows (K's, then V's), which the mma reads.
template <int HEAD_DIM, int NUM_WARPS_, int KEYS_PER_WARP, int KV_STAGES,
          int BLOCK_M_ = DECODE_BLOCK_M, bool E4M3_CACHE = false>
struct DecodeTraits {
    static constexpr int NUM_WARPS = NUM_WARPS_;
    static constexpr int THREADS = NUM_WARPS * 32;
    static constexpr int BLOCK_M = BLOCK_M_;
    static constexpr bool ROWS_ON_N = BLOCK_M == DECODE_BLOCK_M_N8;
    static constexpr int BLOCK_N = NUM_WARPS * KEYS_PER_WARP;
    static constexpr int N_TILES = KEYS_PER_WARP / 8;
    static constexpr int KEY_TILES = KEYS_PER_WARP / 16;  // m16 tiles of a warp's keys (ROWS_ON_N)
    static constexpr int D_TILES = HEAD_DIM / 8;
    static constexpr int D_TILES16 = HEAD_DIM / 16;  // m16 tiles of O^T's columns (ROWS_ON_N)
    static constexpr int D_STEPS = HEAD_DIM / 16;
    using QTile = SwizzledTile<DECODE_BLOCK_M, HEAD_DIM>;  // (ROWS_ON_N: rows 0-7 of it)
    using KVTile = SwizzledTile<BLOCK_N, HEAD_DIM>;
    using StagedTile = typename StagedTileOf<E4M3_CACHE, BLOCK_N, HEAD_DIM>::type;
    static constexpr int STAGE_BYTES = 2 * StagedTile::BYTES;
    static constexpr int CONVERTED_BYTES = E4M3_CACHE ? KVTile::BYTES : 0;
    // The merge of the warps' states reuses the stage buffers: O (fp32, rows MERGE_STRIDE floats
    // apart) and (m, l) per warp, then the CTA's inbox for a merge of the splits inside a
    // cluster (split_merge.cuh: ClusterInbox; peers may store into it while the warps merge).
    static constexpr int MERGE_STRIDE =
        HEAD_DIM + (ROWS_ON_N ? DECODE_MERGE_ROW_PAD_N8 : DECODE_MERGE_ROW_PAD);
    static constexpr int MERGE_BYTES = NUM_WARPS * (MERGE_STRIDE + 2) * BLOCK_M * 4 +
                                       ClusterInboxSize<HEAD_DIM, BLOCK_M>::BYTES;
    static constexpr int KV_BYTES = CONVERTED_BYTES + KV_STAGES * STAGE_BYTES;
    static constexpr int SMEM_BYTES = QTile::BYTES + (KV_BYTES > MERGE_BYTES ? KV_BYTES
                                                                             : MERGE_BYTES);
    static_assert(BLOCK_M == DECODE_BLOCK_M || ROWS_ON_N, "an m16 tile of rows, or an n8 one");
    static_assert(KEYS_PER_WARP % 16 == 0, "a warp's keys are whole k16 steps of P V");
    static_assert(KV_STAGES >= 2, "the KV loop is pipelined");
};

// A bool as a type: what picks one of a generic lambda's specialisations at compile time.
template <bool VALUE>
struct CompileTimeBool {
    static constexpr bool value = VALUE;
};

// Copies the K and V rows of positions key0 .. key0 + BLOCK_N - 1 into swizzled tiles: positions
// from cache_len on are new tokens, read from k_new_rows / v_new_rows; rows at or past seqlen_k,
// rows outside the cache (bad block ids) and chunks past head_dim are zero-filled without being
// read.
//
// A decoding step runs this code once or a few times per CTA, cold: the instruction fetches, not
// the arithmetic, are what a short CTA waits on, so the code is kept small. Tiles that start
// with a cached position and lie in one block of the cache (a contiguous cache, or pages of a
// multiple of BLOCK_N positions) take the fast path: one lookup for the tile, then each thread
// keeps one 16-byte chunk and steps its K and V addresses by a constant over the cached rows;
// the last tile's other rows (new tokens, rows past seqlen_k) follow one by one. The other tiles
// (pages shorter than a tile, tiles of new tokens only, head dims above 128) locate each row once
// for K and V.
// An e4m3 cache (Stored = u8, Tile an E4M3Tile) is copied as bytes; its new tokens, 16-bit, are
// quantised by k_descale / v_descale on the way (kv_cache_e4m3.cuh). With a RotaryTable
// (rotary.cuh) the new tokens' keys are rotated at their positions: an e4m3 cache's by the
// thread itself, then quantised and stored into the tile, as the append rotates them into the
// cache; a 16-bit cache's are copied as they are and rotated in the stage once it landed (the
// kernel's rotate_landed_rows).
// LEFTPAD (cache_leftpad): keys before `key_lo`, the sequence's first, are zero-filled without
// being read, as past seqlen_k: a left-padded region may hold anything (NaN or Inf in V would
// reach O through 0 * NaN where the mask gave P = 0), and flash-attn never reads it either.
template <class Tile, int THREADS, typename Elem, typename Stored, class Rotary,
          bool LEFTPAD = false>
CF2_DEVICE void load_kv_tile_async(u32 k_smem, u32 v_smem, const KVCacheIndex& index,
                                   const KVCacheRowsOf<Stored>& k_rows,
                                   const KVCacheRowsOf<Stored>& v_rows,
                                   const u16* k_new_rows, i64 kn_row_stride,
                                   const u16* v_new_rows, i64 vn_row_stride, int cache_len,
                                   int key0, int seqlen_k, int head_chunks, int tid,
                                   float k_descale, float v_descale, const Rotary& rotary,
                                   int key_lo = 0) {
    // The cache is read once a step: its lines go first from L2 (what a step reads again, the
    // code of its end and the splits' partial results, stays; in a CUDA graph 0.7 us a layer at
    // 64k tokens and 1.2 us at batch 8, 16k, H200).
    const unsigned long long evict_first = l2_evict_first_policy();
    auto copy_row = [&](int row, int chunk) {
        const int key = key0 + row;
        const Stored* k_src = nullptr;
        const Stored* v_src = nullptr;
        int block, cache_row;
        if (key >= seqlen_k || (LEFTPAD && key < key_lo)) {
        } else if (key >= cache_len) {
            if constexpr (sizeof(Stored) == 1) {
                if (chunk < head_chunks) {  // (chunks past head_dim: zero-filled below)
                    const u32 offset = Tile::offset(row, chunk);
                    const u16* k_row = k_new_rows + (key - cache_len) * kn_row_stride;
                    const u16* v_row = v_new_rows + (key - cache_len) * vn_row_stride;
                    if constexpr (Rotary::ENABLED) {
                        u32 k8[4];
                        quantise_rotated_chunk<Elem>(k8, k_row, chunk, key, k_descale, rotary);
                        store_16B_shared_words(k_smem + offset, k8);
                    } else {
                        stage_new_chunk_e4m3<Elem>(k_smem + offset,
                                                   k_row + chunk * Tile::CHUNK_ELEMS, k_descale);
                    }
                    stage_new_chunk_e4m3<Elem>(v_smem + offset,
                                               v_row + chunk * Tile::CHUNK_ELEMS, v_descale);
                    return;
                }
            } else {
                // With rotary the key is copied as it is and rotated in the stage once it
                // landed (the kernel's rotate_landed_rows), its angles asked into L1 meanwhile:
                // the copy stays asynchronous.
                if constexpr (Rotary::ENABLED)
                    if (chunk < head_chunks) rotary.prefetch_angles(chunk, key);
                k_src = k_new_rows + (key - cache_len) * kn_row_stride;
                v_src = v_new_rows + (key - cache_len) * vn_row_stride;
            }
        } else if (index.locate(key, block, cache_row)) {
            k_src = k_rows.at(block, cache_row);
            v_src = v_rows.at(block, cache_row);
        }
        const bool valid = k_src != nullptr && chunk < head_chunks;
        const u32 offset = Tile::offset(row, chunk);
        cp_async_16_policy(k_smem + offset,
                           valid ? k_src + chunk * Tile::CHUNK_ELEMS : k_rows.head_base, valid,
                           evict_first);
        cp_async_16_policy(v_smem + offset,
                           valid ? v_src + chunk * Tile::CHUNK_ELEMS : v_rows.head_base, valid,
                           evict_first);
    };
    if constexpr (THREADS % Tile::CHUNKS == 0 && Tile::ROWS % (THREADS / Tile::CHUNKS) == 0) {
        constexpr int ROW_STEP = THREADS / Tile::CHUNKS;
        const int chunk = tid % Tile::CHUNKS;
        const int row0 = tid / Tile::CHUNKS;
        int block, cache_row;
        // The tile's rows of cached positions (all of them but in the last tile).
        const int cached_rows = min(min(seqlen_k, cache_len) - key0, Tile::ROWS);
        // (Above d=128 the accumulators leave no registers for the stepped addresses.)
        if (Tile::COLS <= 128 && cached_rows > 0 && (!LEFTPAD || key0 >= key_lo) &&
            (index.block_table == nullptr || index.page_size % Tile::ROWS == 0) &&
            index.locate(key0, block, cache_row)) {
            const bool valid = chunk < head_chunks;
            const Stored* k_src = k_rows.at(block, cache_row + row0) + chunk * Tile::CHUNK_ELEMS;
            const Stored* v_src = v_rows.at(block, cache_row + row0) + chunk * Tile::CHUNK_ELEMS;
            const i64 k_step = ROW_STEP * k_rows.row_stride, v_step = ROW_STEP * v_rows.row_stride;
            auto copy_cached_rows = [&](auto whole_tile) {
#pragma unroll
                for (int i = 0; i < Tile::ROWS / ROW_STEP; ++i) {
                    const int row = row0 + i * ROW_STEP;
                    const u32 offset = Tile::offset(row, chunk);
                    if (whole_tile.value || row < cached_rows) {
                        cp_async_16_policy(k_smem + offset, valid ? k_src : k_rows.head_base,
                                           valid, evict_first);
                        cp_async_16_policy(v_smem + offset, valid ? v_src : v_rows.head_base,
                                           valid, evict_first);
                    }
                    k_src += k_step;
                    v_src += v_step;
                }
            };
            if (cached_rows == Tile::ROWS) {
                copy_cached_rows(CompileTimeBool<true>{});  // every row cached: no test a row
            } else {
                // The last tile: its other rows (new tokens; zeros from seqlen_k on), a few at
                // most, one by one. It stays on this path, where a path of its own, run once a
                // step by one split, had made that split ~1 us later than the others (H200, in a
                // CUDA graph).
                copy_cached_rows(CompileTimeBool<false>{});
                for (int idx = cached_rows * Tile::CHUNKS + tid; idx < Tile::ROWS * Tile::CHUNKS;
                     idx += THREADS)
                    copy_row(idx / Tile::CHUNKS, idx % Tile::CHUNKS);
            }
        } else {
#pragma unroll 2
            for (int i = 0; i < Tile::ROWS / ROW_STEP; ++i) copy_row(row0 + i * ROW_STEP, chunk);
        }
    } else {
        constexpr int TOTAL = Tile::ROWS * Tile::CHUNKS;
#pragma unroll 2
        for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
            const int idx = tid + i * THREADS;
            if (TOTAL % THREADS == 0 || idx < TOTAL) copy_row(idx / Tile::CHUNKS, idx % Tile::CHUNKS);
        }
    }
}

// Scores q . k of an e4m3 cache's keys times k_descale: the scores of its dequantised keys, before
// softcap, ALiBi and the softmax scale apply as they do to any score.
template <int TILES>
CF2_DEVICE void scale_scores(float (&acc_s)[1][TILES][4], float k_descale) {
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][t][e] *= k_descale;
}

// The same with a factor per row, the rows on the n side (element e of a tile: row 2t + e % 2):
// k_descale, over each row's power of two where F16_MMA rescaled a bf16 q.
template <int TILES>
CF2_DEVICE void scale_score_rows(float (&acc_s)[1][TILES][4], const float (&row_factor)[2]) {
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][t][e] *= row_factor[e % 2];
}

// The next kernel on the stream may start (programmatic launch, up to its own wait) once every
// CTA is this many KV tiles before its last (or at its first). In a loop of layers, the launches
// of the kernel between layers and of the next decoding step, and that step's first cache reads
// (EARLY_CACHE_READS), then come while this step still streams its cache, not in its tail (the
// merges and the kernel boundaries, chains of round trips that loads in flight slow down). In a
// graph of 8 layers on the H200 (batch 1, GQA 8:1, 64-key tiles), 8 tiles before the end against
// after the last tile: 16k tokens (8 tiles a split) 13.1 against 13.6 us a layer, 64k (32 tiles)
// 35.2 against 37.1, batch 8 at 16k 66.5 against 67.0 (docs/DECODE_DESIGN.md: 4 to 12 tiles).
// At 16k that is the first tile, once Q has landed: a sharp optimum (right after the wait, before
// Q: 14.0 against 13.1; at the second tile: 13.4).
constexpr int LAUNCH_DEPENDENTS_TILES_BEFORE_END = 8;

// Up to d=128 two or three CTAs of 4 warps share an SM (_dispatch.decode_config: the cache bytes
// in flight), so the registers must allow three (168 a thread); larger head dims and CTAs of
// more warps need the register file of one. Warps of 32 keys (the clustered short steps'
// 128-key tiles, _dispatch.decode_cluster_config) share an SM by two at most.
template <int HEAD_DIM, int NUM_WARPS, int KEYS_PER_WARP>
__host__ __device__ constexpr int decode_min_ctas() {
    return HEAD_DIM > 128 || NUM_WARPS > 4 ? 1 : KEYS_PER_WARP > 16 ? 2 : 3;
}

// FEATURES: the attention variant's (variant.cuh): softcap, ALiBi, sinks; and the cache's own:
// FEATURE_ROTARY (rotary.cuh: the new keys rotated as they are appended and read, q as it is
// loaded) and FEATURE_LEFTPAD (cache_leftpad: each sequence's keys start at its own position,
// the ones before are not attended). The parameters: DecodeParams (kernel_params.cuh).
// EARLY_CACHE_READS: the caller promised that the previous kernel on the stream writes none of
// the cache, its lengths, block table, batch index or descale factors (attention_with_kvcache's
// early_cache_reads), so they may be read before the wait.
// KV_CACHE_FORMAT: KV_CACHE_AS_Q (the cache holds q's 16-bit type) or KV_CACHE_E4M3 (e4m3
// bytes and their descale factors, kv_cache_e4m3.cuh).
template <typename Elem, int HEAD_DIM, int NUM_WARPS, int KEYS_PER_WARP, int KV_STAGES, int FEATURES,
          bool EARLY_CACHE_READS, int BLOCK_M, int KV_CACHE_FORMAT = KV_CACHE_AS_Q>
__global__ void
__launch_bounds__(NUM_WARPS * 32, decode_min_ctas<HEAD_DIM, NUM_WARPS, KEYS_PER_WARP>())
flash_decode_kernel(const __grid_constant__ DecodeParams p) {
    constexpr bool E4M3_CACHE = KV_CACHE_FORMAT == KV_CACHE_E4M3;
    constexpr bool ROTARY = (FEATURES & FEATURE_ROTARY) != 0;
    constexpr bool LEFTPAD = (FEATURES & FEATURE_LEFTPAD) != 0;
    using Rotary = typename RotaryOf<ROTARY>::type;
    static_assert(E4M3_CACHE || KV_CACHE_FORMAT == KV_CACHE_AS_Q, "a known cache format");
    using T = DecodeTraits<HEAD_DIM, NUM_WARPS, KEYS_PER_WARP, KV_STAGES, BLOCK_M, E4M3_CACHE>;
    using QTile = typename T::QTile;
    using KVTile = typename T::KVTile;
    using StagedTile = typename T::StagedTile;
    using Stored = typename StagedTileOf<E4M3_CACHE, T::BLOCK_N, HEAD_DIM>::Stored;
    // The mma's element: q's, but f16 with an e4m3 cache and the rows on the n side where the
    // hardware converts e4m3 pairs to f16 (sm_89 on, fp8_convert.cuh): one instruction a pair
    // for K and V where bf16 takes about nine, which bounded such a step (per tile, four times
    // the 16-bit cache's instructions; H100: the e4m3 cache no faster than bf16's). A bf16 q
    // joins as f16 rescaled per row (q_fragments_bf16_to_f16), P is packed as f16 (finer than
    // bf16 on [0, 256]); O accumulates in fp32 and is stored in q's type as before.
    constexpr bool F16_MMA = E4M3_CACHE && T::ROWS_ON_N && CF2_E4M3_CVT;
    using MmaElem = typename TypeIf<F16_MMA, fp16_tag, Elem>::type;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 q_smem = smem_address(smem);
    // (E4M3_CACHE: the converted K or V tile, then the stages of bytes)
    const u32 converted0 = q_smem + QTile::BYTES;
    const u32 stage0 = converted0 + T::CONVERTED_BYTES;  // stage s: K at + s * STAGE_BYTES, V after K

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    // A row block's splits side by side in x where they form a cluster (a cluster is
    // consecutive CTAs), its row blocks side by side otherwise.
    const int m_block = p.split_cluster ? blockIdx.x / p.num_splits : blockIdx.x % p.num_m_blocks;
    const int split = p.split_cluster ? blockIdx.x % p.num_splits : blockIdx.x / p.num_m_blocks;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int group = p.heads_per_kv_head;
    const int rows_total = p.seqlen_q * group;
    const int row_first = m_block * T::BLOCK_M;  // packed row
    const int row_last = min(row_first + T::BLOCK_M, rows_total) - 1;
    // Up to here only the parameters were read. With a programmatic launch the previous kernel
    // may still be running: wait for its writes (q, k_new, the lengths, ...) before reading or
    // writing any memory. With EARLY_CACHE_READS the wait comes later: before q, the new tokens
    // and the ALiBi slopes are read and before anything is written, at step 0 of the KV loop or
    // before the first tile with new tokens, whichever comes first. (Asking the first tiles into
    // L2 before the wait, without the caller's promise, did not pay: docs/DECODE_DESIGN.md.)
    if constexpr (!EARLY_CACHE_READS) wait_for_previous_grid();
    // Keys: the cached tokens (cache_seqlens, or cache_len_all for every sequence) plus the
    // appended ones, never past the cache's capacity.
    const int cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_len_all;
    const int seqlen_k = min(max(cache_len + p.seqlen_new, 0), p.capacity);
    const int head_chunks = p.head_dim / StagedTile::CHUNK_ELEMS;  // of a staged row
    // Q's rows are 16-bit whatever the cache holds: 8 elements a chunk (an e4m3 stage's chunks
    // hold 16; with those Q's last half went unread, zero-filled).
    const int q_chunks = p.head_dim / QTile::CHUNK_ELEMS;
    // An e4m3 cache's values are e4m3 * descale (the sequence's and KV head's factors).
    float k_descale = 1.f, v_descale = 1.f;
    if constexpr (E4M3_CACHE) {
        k_descale = p.k_descale[batch * p.kd_batch_stride + kv_head * p.kd_head_stride];
        v_descale = p.v_descale[batch * p.vd_batch_stride + kv_head * p.vd_head_stride];
    }

    using Variant = AttentionVariant<FEATURES>;
    const KeyVisibility vis =
        Variant::visibility(p.seqlen_q, seqlen_k, p.window_left, p.window_right);
    int tile_first, tile_end;
    vis.tile_range(row_first / group, row_last / group, T::BLOCK_N, tile_first, tile_end);
    // cache_leftpad: the sequence's keys start at leftpad (positions stay the cache's: causal
    // masks, windows, ALiBi and rotary count them from 0, as flash-attn's do).
    int leftpad = 0;
    if constexpr (LEFTPAD) {
        leftpad = p.cache_leftpad[batch];
        tile_first = max(tile_first, leftpad / T::BLOCK_N);
    }
    // The first key a row at `position` sees.
    auto first_key = [&](int position) {
        if constexpr (LEFTPAD)
            return max(vis.lo(position), leftpad);
        else
            return vis.lo(position);
    };
    Rotary rotary;
    if constexpr (ROTARY)
        rotary = RotaryTable{p.rotary_cos, p.rotary_sin, p.rotary_dim, p.seqlen_ro,
                             p.rotary_interleaved != 0};
    tile_first = max(tile_first, split * p.tiles_per_split);
    tile_end = min(tile_end, (split + 1) * p.tiles_per_split);

    int cache_row;
    const KVCacheIndex index = kv_cache_index(p.cache_batch_idx, p.block_table,
                                              p.block_table_stride, p.page_size, p.num_blocks,
                                              batch, cache_row);
    const KVCacheRowsOf<Stored> k_rows =
        kv_cache_rows(reinterpret_cast<const Stored*>(p.k_cache), p.kc_batch_stride,
                      p.kc_row_stride, p.kc_head_stride, cache_row, kv_head);
    const KVCacheRowsOf<Stored> v_rows =
        kv_cache_rows(reinterpret_cast<const Stored*>(p.v_cache), p.vc_batch_stride,
                      p.vc_row_stride, p.vc_head_stride, cache_row, kv_head);

    const u16* k_new_rows = p.k_new + batch * p.kn_batch_stride + kv_head * p.kn_head_stride;
    const u16* v_new_rows = p.v_new + batch * p.vn_batch_stride + kv_head * p.vn_head_stride;

    // The append: split 0's first row block writes the new tokens into the cache (no CTA reads
    // the cache at those positions: they read k_new / v_new instead).
    auto append_new_tokens = [&]() {
        if (p.seqlen_new > 0 && blockIdx.x == 0) {
            if constexpr (E4M3_CACHE)
                append_new_rows_e4m3<Elem>(index, k_rows, v_rows, k_new_rows, p.kn_row_stride,
                                           v_new_rows, p.vn_row_stride, p.seqlen_new, cache_len,
                                           p.capacity, p.head_dim, k_descale, v_descale, tid,
                                           T::THREADS, rotary);
            else
                append_new_rows<Elem>(index, k_rows, v_rows, k_new_rows, p.kn_row_stride,
                                      v_new_rows, p.vn_row_stride, p.seqlen_new, cache_len,
                                      p.capacity, p.head_dim, tid, T::THREADS, rotary);
        }
    };
    // Q: packed row r of this block is position p = (row_first + r) / group, head
    // kv_head * group + (row_first + r) % group; rows past the end are zero-filled. With rotary,
    // rotated at cache_len + p where rotary_q_per_row (causal or a window), at cache_len
    // otherwise (flash-attn's rule): copied as it is, its angles asked into L1, and rotated in
    // shared memory once it landed (rotate_landed_rows).
    auto q_position = [&](int packed) {
        return cache_len + (p.rotary_q_per_row ? packed / group : 0);
    };
    auto load_q = [&]() {
        for (int idx = tid; idx < T::BLOCK_M * QTile::CHUNKS; idx += T::THREADS) {
            const int r = idx / QTile::CHUNKS, chunk = idx % QTile::CHUNKS;
            const int packed = row_first + r;
            const bool valid = packed < rows_total && chunk < q_chunks;
            if constexpr (ROTARY)
                if (valid) rotary.prefetch_angles(chunk, q_position(packed));
            const u16* src = p.q + batch * p.q_batch_stride + (packed / group) * p.q_row_stride +
                             (kv_head * group + packed % group) * p.q_head_stride + chunk * 8;
            cp_async_16(q_smem + QTile::offset(r, chunk), valid ? src : p.q, valid);
        }
    };
    if constexpr (!EARLY_CACHE_READS) {
        append_new_tokens();
        load_q();
    }
    auto load_tile = [&](int tile, int stage) {
        const u32 k_smem = stage0 + stage * T::STAGE_BYTES;
        load_kv_tile_async<StagedTile, T::THREADS, Elem, Stored, Rotary, LEFTPAD>(
            k_smem, k_smem + StagedTile::BYTES, index, k_rows, v_rows, k_new_rows,
            p.kn_row_stride, v_new_rows, p.vn_row_stride, cache_len, tile * T::BLOCK_N, seqlen_k,
            head_chunks, thread_index_fresh(), k_descale, v_descale, rotary, leftpad);
    };

    // This thread's two rows (g and g + 8 of the m16 tile; on the n side 2t and 2t + 1, t =
    // lane % 4): query position and head.
    int row_position[2], row_head[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int packed = row_first + (T::ROWS_ON_N ? 2 * (lane % 4) + half : lane / 4 + 8 * half);
        row_position[half] = packed / group;
        row_head[half] = kv_head * group + packed % group;
    }
    float row_slope[2] = {0.f, 0.f};  // ALiBi slopes in score units, per row (rows span heads)
    auto read_slopes = [&]() {
        if constexpr ((FEATURES & FEATURE_ALIBI) != 0) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
                if (row_head[half] < p.nheads)
                    row_slope[half] =
                        -p.mods.alibi_slopes[batch * p.mods.alibi_batch_stride + row_head[half]] *
                        p.mods.alibi_to_units;
        }
    };
    if constexpr (!EARLY_CACHE_READS) read_slopes();
    const ScoreMods<FEATURES & FEATURE_SOFTCAP> softcap(p.mods, p.seqlen_q, seqlen_k);

    // A warp's state over its keys: on an m16 tile of rows, O and its softmax; with the rows on
    // the n side, O^T, its softmax and Q's B fragments (loaded once, at the first tile).
    float acc_o[1][T::D_TILES][4];
    zero_fill(acc_o);
    OnlineSoftmax<1> softmax;
    float acc_ot[1][T::D_TILES16][4];
    zero_fill(acc_ot);
    OnlineSoftmaxN8 softmax_n8;
    u32 q_frag[T::D_STEPS][2];
    // The factors of this lane's score rows with the rows on the n side (2t, 2t + 1) and an e4m3
    // cache: k_descale, times the inverse of the row's power of two where F16_MMA rescales a
    // bf16 q (q_fragments_bf16_to_f16, with Q's fragments).
    float row_score_factor[2] = {k_descale, k_descale};
    const int warp_key0 = warp * KEYS_PER_WARP;  // within the tile
    // Score s of this thread's row `half` at key `key`: ALiBi's bias, then the row's visible
    // keys [lo, hi) (causal, window, the sequence's end; vis.lo / vis.hi of the row, computed
    // once a row); the others are -inf.
    auto bias_and_mask = [&](float& s, int half, int key, int lo, int hi) {
        if constexpr ((FEATURES & FEATURE_ALIBI) != 0)
            s = fmaf(row_slope[half],
                     fabsf(static_cast<float>(row_position[half]) + static_cast<float>(vis.diag) -
                           static_cast<float>(key)),
                     s);
        if (key < lo || key >= hi) s = neg_inf();
    };

    // The KV loop, KV_STAGES - 1 tiles ahead: step i loads tile i + KV_STAGES - 1 and computes
    // tile i; the first KV_STAGES - 1 steps only load. One place issues the loads, so their code
    // is fetched once (see load_kv_tile_async). With EARLY_CACHE_READS step 0 waits for the
    // previous kernel first (it runs even when the split has no tile), Q is a cp.async group of
    // its own after the tiles loaded before the wait, and the step issues its tile's loads
    // before it waits for Q: the cache streams again while Q, which the previous kernel wrote,
    // comes from L2. (Where a split's last tile is loaded after the wait, a short step's
    // critical path: at 4k tokens in a CUDA graph, 7.53-7.57 against 7.91 us a layer, H200.)
    const int num_tiles = tile_end - tile_first;
    // Rotary: rows copied as they are, rotated in shared memory once they landed (the barrier
    // before: every thread's copies of step i), Q's at step 0 and, with a 16-bit cache, the new
    // tokens' keys in the tile of step i; a barrier after, before the mma reads them. Each
    // thread takes whole items (a GPT-J chunk, a NeoX pair of chunks), so none reads what
    // another writes. (Loaded, rotated and stored by each thread before it issued anything
    // else, they put one L2 round trip each on the step's path: +25% a step at batch 1, 4k
    // tokens, docs/ROTARY.md.)
    auto rotate_landed_rows = [&](int i) {
        if constexpr (ROTARY) {
            const int items = rotary.items_per_row();
            const int q_items = i == 0 ? T::BLOCK_M * items : 0;
            const int key0 = (tile_first + i) * T::BLOCK_N;
            int k_first = 0, k_rows = 0;
            if (!E4M3_CACHE && i < num_tiles) {
                k_first = max(cache_len - key0, 0);
                k_rows = max(min(seqlen_k - key0, T::BLOCK_N) - k_first, 0);
            }
            if (q_items + k_rows * items == 0) return;  // (the same for every thread)
            const u32 k_stage = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;
            const int partner = rotary.partner_chunks();
            for (int idx = tid; idx < q_items + k_rows * items; idx += T::THREADS) {
                const bool in_q = idx < q_items;
                const int r = (in_q ? idx : idx - q_items) / items;
                const int item = (in_q ? idx : idx - q_items) % items;
                if (in_q) {
                    if (row_first + r < rows_total)
                        rotary.template rotate_in_shared<Elem>(
                            q_smem + QTile::offset(r, item),
                            q_smem + QTile::offset(r, item + partner), item,
                            q_position(row_first + r));
                } else {
                    rotary.template rotate_in_shared<Elem>(
                        k_stage + KVTile::offset(k_first + r, item),
                        k_stage + KVTile::offset(k_first + r, item + partner), item,
                        key0 + k_first + r);
                }
            }
            __syncthreads();
        }
    };
    bool waited = !EARLY_CACHE_READS;
#pragma unroll 1
    for (int i = 1 - KV_STAGES; i < (EARLY_CACHE_READS ? max(num_tiles, 1) : num_tiles); ++i) {
        const bool load_first = EARLY_CACHE_READS && i == 0;  // (see above)
        if constexpr (EARLY_CACHE_READS) {
            if (i == 0) {
                if (!waited) wait_for_previous_grid();
                waited = true;
                load_q();
                cp_async_commit();
                append_new_tokens();  // (its loads in flight beside Q's)
                read_slopes();
            }
        }
        // Tile i landed (at step 0 of EARLY_CACHE_READS Q too: every group but the one of tile
        // i + KV_STAGES - 1, issued before); every warp is done with the stage refilled. Then the
        // next kernel may start, where it is time to.
        const auto tile_landed = [&] {
            if (load_first)
                cp_async_wait<1>();
            else
                cp_async_wait<KV_STAGES - 2>();
            __syncthreads();
            rotate_landed_rows(i);
            if (i == max(num_tiles - LAUNCH_DEPENDENTS_TILES_BEFORE_END, 0))
                allow_dependent_launch();
        };
        if (i >= 0 && !load_first) tile_landed();
        const int ahead = i + KV_STAGES - 1;  // one commit group a step, empty past the end
        if (ahead < num_tiles) {
            // Before the wait only tiles of cached positions: one with new tokens reads k_new /
            // v_new, which the previous kernel writes.
            if (!waited && (tile_first + ahead + 1) * T::BLOCK_N > cache_len) {
                wait_for_previous_grid();
                waited = true;
            }
            load_tile(tile_first + ahead, ahead % KV_STAGES);
        }
        cp_async_commit();
        if (load_first) tile_landed();
        if (i < 0 || (EARLY_CACHE_READS && i >= num_tiles)) continue;
        const int tile = tile_first + i;
        const u32 k_stage = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;
        const u32 k_smem = E4M3_CACHE ? converted0 : k_stage;
        const u32 v_smem = E4M3_CACHE ? converted0 : k_stage + KVTile::BYTES;
        // An e4m3 cache: this warp's rows of K, then of V, to 16 bits in the converted tile (the
        // barrier above: every warp is done with the last tile's); its lanes then read each
        // other's rows.
        auto convert_rows = [&](u32 staged) {
            if constexpr (E4M3_CACHE) {
                __syncwarp();  // (V's: every lane's K fragments are read)
                convert_rows_e4m3<MmaElem, StagedTile, KVTile, KEYS_PER_WARP>(converted0, staged,
                                                                          warp_key0, lane);
                __syncwarp();
            }
        };
        convert_rows(k_stage);

        if constexpr (T::ROWS_ON_N) {
            if (i == 0) {  // Q's B fragments: rows 0-7, 32 columns an ldmatrix.x4
#pragma unroll
                for (int kq = 0; kq < HEAD_DIM / 32; ++kq) {
                    u32 r4[4];
                    ldmatrix_x4(r4, q_smem + QTile::offset(lane % 8, 4 * kq + lane / 8));
                    q_frag[2 * kq][0] = r4[0];
                    q_frag[2 * kq][1] = r4[1];
                    q_frag[2 * kq + 1][0] = r4[2];
                    q_frag[2 * kq + 1][1] = r4[3];
                }
                if constexpr (F16_MMA && Elem::is_bf16) {
                    q_fragments_bf16_to_f16(q_frag, row_score_factor, lane);
#pragma unroll
                    for (int j = 0; j < 2; ++j) row_score_factor[j] *= k_descale;
                }
            }
            // S^T = K_w Q^T: the warp's keys on m, the rows on n. The head dim's k16 steps
            // alternate between two accumulators (half the dependent chain), added after.
            float acc_s[1][T::KEY_TILES][4], acc_odd[1][T::KEY_TILES][4];
            zero_fill(acc_s);
            zero_fill(acc_odd);
            const LdmatrixCursor<KVTile> k_frag = rows_cursor<KVTile>(k_smem, warp_key0, lane);
#pragma unroll
            for (int ks = 0; ks < T::D_STEPS; ++ks)
#pragma unroll
                for (int kt = 0; kt < T::KEY_TILES; ++kt) {
                    u32 a[4];
                    ldmatrix_x4(a, k_frag.at(2 * kt, ks));
                    mma_m16n8k16<MmaElem>(ks % 2 == 0 ? acc_s[0][kt] : acc_odd[0][kt], a,
                                          q_frag[ks]);
                }
#pragma unroll
            for (int kt = 0; kt < T::KEY_TILES; ++kt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[0][kt][e] += acc_odd[0][kt][e];
            if constexpr (E4M3_CACHE) scale_score_rows(acc_s, row_score_factor);
            softcap.apply_softcap(acc_s);
            // Element e of key tile kt: key 16 kt + lane / 4 + 8 (e / 2), row 2 (lane % 4) + e % 2.
            const int key_base = tile * T::BLOCK_N + warp_key0 + lane / 4;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int lo = first_key(row_position[half]), hi = vis.hi(row_position[half]);
#pragma unroll
                for (int kt = 0; kt < T::KEY_TILES; ++kt)
#pragma unroll
                    for (int eh = 0; eh < 2; ++eh)
                        bias_and_mask(acc_s[0][kt][2 * eh + half], half,
                                      key_base + 16 * kt + 8 * eh, lo, hi);
            }
            softmax_n8.update_max(acc_s[0], acc_ot[0], p.scale_log2);
            convert_rows(k_stage + StagedTile::BYTES);
            // O^T_w += V_w^T P^T, one m16 tile of keys (a k16 step) at a time.
            const LdmatrixCursor<KVTile> v_frag = pairs_cursor<KVTile>(v_smem, warp_key0, lane);
#pragma unroll
            for (int kt = 0; kt < T::KEY_TILES; ++kt) {
                u32 b[2];
                softmax_n8.template exp_pack<MmaElem>(b, acc_s[0][kt], p.scale_log2);
#pragma unroll
                for (int dt = 0; dt < T::D_TILES16; ++dt) {
                    u32 a[4];
                    ldmatrix_x4_trans(a, v_frag.at(2 * kt, dt));
                    mma_m16n8k16<MmaElem>(acc_ot[0][dt], a, b);
                }
            }
        } else {
            // S = Q K_w^T for this warp's keys.
            float acc_s[1][T::N_TILES][4];
            zero_fill(acc_s);
            gemm_a_bt<Elem, 1, T::N_TILES, T::D_STEPS>(
                acc_s, rows_cursor<QTile>(q_smem, 0, lane),
                pairs_cursor<KVTile>(k_smem, warp_key0, lane));
            if constexpr (E4M3_CACHE) scale_scores(acc_s, k_descale);
            softcap.apply_softcap(acc_s);
            const int key_base = tile * T::BLOCK_N + warp_key0 + 2 * (lane % 4);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int lo = first_key(row_position[half]), hi = vis.hi(row_position[half]);
#pragma unroll
                for (int nt = 0; nt < T::N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        bias_and_mask(acc_s[0][nt][2 * half + e], half, key_base + 8 * nt + e,
                                      lo, hi);
            }
            softmax.update_max(acc_s, acc_o, p.scale_log2);
            convert_rows(k_stage + StagedTile::BYTES);
            // O_w += P V_w, one k16 slice of this warp's keys at a time.
#pragma unroll
            for (int ks = 0; ks < KEYS_PER_WARP / 16; ++ks) {
                u32 a[4];
                softmax.template exp_pack<Elem>(a, acc_s[0][2 * ks], acc_s[0][2 * ks + 1], 0,
                                                p.scale_log2);
                const LdmatrixCursor<KVTile> v_frag = rows_cursor<KVTile>(v_smem, warp_key0, lane);
#pragma unroll
                for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, v_frag.at(2 * ks, dp));
                    mma_m16n16k16<Elem>(acc_o[0][2 * dp], acc_o[0][2 * dp + 1], a, b);
                }
            }
        }
    }

    allow_dependent_launch();  // (a CTA without tiles: not yet in the loop)
    // Merge the warps' states: (m, l) in log2 units and O, through shared memory.
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages
    const int rows = row_last - row_first + 1;  // of this block
    // O's rows are T::MERGE_STRIDE floats apart: a warp's 8-byte stores of its accumulator
    // fragments (rows lane / 4, columns 2 * (lane % 4)) then fall on 32 different banks (with a
    // stride of HEAD_DIM, 8 rows on the same 4 banks: 8-way conflicts, ~0.5 us of every CTA's
    // end on the H200).
    float* merge_o = reinterpret_cast<float*>(smem + QTile::BYTES);  // [warp][row][MERGE_STRIDE]
    float* merge_ml = merge_o + T::NUM_WARPS * T::BLOCK_M * T::MERGE_STRIDE;  // [warp][row][2]
    constexpr int CHUNKS = HEAD_DIM / 4;  // 4-column chunks of a row: the merges' items
#if __CUDA_ARCH__ >= 900
    // The splits of a cluster send their results into each other's inboxes (split_merge.cuh):
    // each opens its own once its stages are free, and none sends before every inbox is open
    // (the cluster barrier, whose wait comes before the first send). Other launches skip all of
    // it (its division too: this is every CTA's critical path).
    ClusterInbox<HEAD_DIM, T::BLOCK_M> inbox;
    if (p.split_cluster) {
        inbox = ClusterInbox<HEAD_DIM, T::BLOCK_M>(
            smem_address(merge_ml + T::NUM_WARPS * T::BLOCK_M * 2), rows * CHUNKS, p.num_splits,
            split);
        if (tid == 0) inbox.open(rows * CHUNKS, p.num_splits);
        cluster_arrive_relaxed();
    }
#endif
    // (Both rows' sums before either row's stores: their shuffle chains then run side by side,
    // where a row past the block's end would otherwise end the first row's branch between them.)
    if constexpr (T::ROWS_ON_N) {
        const float sums[2] = {softmax_n8.total_sum(0), softmax_n8.total_sum(1)};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // O^T's element e of column tile dt: row 2 (lane % 4) + e % 2, column 16 dt + lane / 4
            // + 8 (e / 2); with rows MERGE_STRIDE = 4 mod 32 floats apart a store covers 32 banks.
            const int r = 2 * (lane % 4) + half;
            const float sum = sums[half];
            if (r >= rows) continue;
            if (lane < 4) {
                const bool seen = softmax_n8.row_max[half] != neg_inf() && sum > 0.f;
                merge_ml[(warp * T::BLOCK_M + r) * 2] =
                    seen ? softmax_n8.row_max[half] * p.scale_log2 : neg_inf();
                merge_ml[(warp * T::BLOCK_M + r) * 2 + 1] = sum;
            }
#pragma unroll
            for (int dt = 0; dt < T::D_TILES16; ++dt)
#pragma unroll
                for (int eh = 0; eh < 2; ++eh)
                    merge_o[(warp * T::BLOCK_M + r) * T::MERGE_STRIDE + 16 * dt + 8 * eh +
                            lane / 4] = acc_ot[0][dt][2 * eh + half];
        }
    } else {
        const float sums[2] = {quad_sum(softmax.row_sum[0]), quad_sum(softmax.row_sum[1])};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = lane / 4 + 8 * half;
            const float sum = sums[half];
            if (r >= rows) continue;  // rows past the block's end are never merged
            if (lane % 4 == 0) {
                const bool seen = softmax.row_max[half] != neg_inf() && sum > 0.f;
                merge_ml[(warp * T::BLOCK_M + r) * 2] =
                    seen ? softmax.row_max[half] * p.scale_log2 : neg_inf();
                merge_ml[(warp * T::BLOCK_M + r) * 2 + 1] = sum;
            }
#pragma unroll
            for (int dt = 0; dt < T::D_TILES; ++dt)
                *reinterpret_cast<float2*>(merge_o + (warp * T::BLOCK_M + r) * T::MERGE_STRIDE +
                                           8 * dt + 2 * (lane % 4)) =
                    make_float2(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
        }
    }
    // Each row is merged by THREADS / BLOCK_M threads: the row's weights once per thread, then
    // 4-float column chunks interleaved across the row's threads (conflict-free shared loads,
    // coalesced stores). Index arithmetic is compile-time except the one division by the group:
    // this epilogue is on every CTA's critical path, and short CTAs (batch 1, many splits) are
    // mostly epilogue.
    constexpr int ROW_THREADS = T::THREADS / T::BLOCK_M;
    // float4 chunks per thread (the last pass partial where they do not divide: 8 rows)
    constexpr int ROW_CHUNKS = (HEAD_DIM / 4 + ROW_THREADS - 1) / ROW_THREADS;
    constexpr bool WHOLE_PASSES = (HEAD_DIM / 4) % ROW_THREADS == 0;
    static_assert(T::THREADS % T::BLOCK_M == 0, "whole rows of threads");
    const int r = tid / ROW_THREADS, t = tid % ROW_THREADS;
    const int group_id = (batch * gridDim.y + kv_head) * p.num_m_blocks + m_block;
    const i64 partial_row = (static_cast<i64>(group_id) * p.num_splits + split) * T::BLOCK_M + r;
    // Where 4-float column chunk `chunk` of row r's output goes.
    auto locate_output = [&](int r, int chunk) {
        const int packed = row_first + r;
        const int position = packed / group, head = kv_head * group + packed % group;
        u16* out = p.out + batch * p.o_batch_stride + position * p.o_row_stride +
                   head * p.o_head_stride + 4 * chunk;
        float* lse = chunk == 0
            ? p.lse + (static_cast<i64>(batch) * p.nheads + head) * p.seqlen_q + position
            : nullptr;
        return OutputChunk<Elem>{out, lse};
    };
    // Where this thread's row of the split's normalised result goes (located before the
    // barrier): the workspace in L2, or the inboxes of its chunks' owners in the cluster.
    float* result_row = p.o_partial + partial_row * HEAD_DIM;
    float* result_row_lse = p.lse_partial + partial_row;
    compute_here(result_row);
    compute_here(result_row_lse);
#if __CUDA_ARCH__ >= 900
    typename ClusterInbox<HEAD_DIM, T::BLOCK_M>::Destination sent_to[ROW_CHUNKS];
    if (p.split_cluster && r < rows) {
#pragma unroll
        for (int j = 0; j < ROW_CHUNKS; ++j)
            sent_to[j] =
                inbox.destination(r * CHUNKS + min(t + ROW_THREADS * j, CHUNKS - 1), split);
    }
#endif
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    if (p.split_cluster) cluster_wait();  // every inbox of the cluster is open
#endif
    if (r < rows) {
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < T::NUM_WARPS; ++w) m = fmaxf(m, merge_ml[(w * T::BLOCK_M + r) * 2]);
        // The row's sink (variant.cuh) enters split 0's merge as one more state: its max the
        // sink, its sum 1, its O 0. The splits' merge then counts it once.
        float sink2 = neg_inf();
        if constexpr (Variant::SINKS) {
            if (split == 0)
                sink2 = Variant::sink_log2(p.mods, kv_head * group + (row_first + r) % group);
            m = fmaxf(m, sink2);
        }
        float weight[T::NUM_WARPS];
        float l = (Variant::SINKS && sink2 != neg_inf()) ? fast_exp2(sink2 - m) : 0.f;
#pragma unroll
        for (int w = 0; w < T::NUM_WARPS; ++w) {
            const float mw = merge_ml[(w * T::BLOCK_M + r) * 2];
            weight[w] = merge_weight(mw, m);
            l = fmaf(weight[w], merge_ml[(w * T::BLOCK_M + r) * 2 + 1], l);
        }
        const bool seen = l > 0.f;
        float4 o[ROW_CHUNKS];
#pragma unroll
        for (int j = 0; j < ROW_CHUNKS; ++j) {
            const int c = 4 * (t + ROW_THREADS * j);
            o[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (!WHOLE_PASSES && c >= HEAD_DIM) continue;
#pragma unroll
            for (int w = 0; w < T::NUM_WARPS; ++w) {
                const float4 x = *reinterpret_cast<const float4*>(
                    merge_o + (w * T::BLOCK_M + r) * T::MERGE_STRIDE + c);
                o[j].x = fmaf(weight[w], x.x, o[j].x);
                o[j].y = fmaf(weight[w], x.y, o[j].y);
                o[j].z = fmaf(weight[w], x.z, o[j].z);
                o[j].w = fmaf(weight[w], x.w, o[j].w);
            }
        }
        // (an e4m3 cache's V: its values times v_descale, here once a row)
        const float inv_l = seen ? (E4M3_CACHE ? v_descale : 1.f) / l : 0.f;
        const float lse2 = seen ? m + __log2f(l) : neg_inf();
#pragma unroll
        for (int j = 0; j < ROW_CHUNKS; ++j) {
            const int chunk = t + ROW_THREADS * j;
            if (!WHOLE_PASSES && chunk >= CHUNKS) continue;
            const float4 scaled = make_float4(o[j].x * inv_l, o[j].y * inv_l, o[j].z * inv_l,
                                              o[j].w * inv_l);
#if __CUDA_ARCH__ >= 900
            // (every chunk of the row, those past head_dim too: its owner counts them all)
            if (p.split_cluster) {
                sent_to[j].send(scaled, lse2);
                continue;
            }
#endif
            if (4 * chunk >= p.head_dim) continue;  // head_dim is a multiple of 8
            if (p.num_splits == 1)
                locate_output(r, chunk)(scaled, lse2);
            else  // this split's normalised partial result, merged below
                *reinterpret_cast<float4*>(result_row + 4 * chunk) = scaled;
        }
        if (p.num_splits > 1 && !p.split_cluster && t == 0) *result_row_lse = lse2;
    }
    if (p.num_splits == 1) return;
#if __CUDA_ARCH__ >= 900
    if (p.split_cluster) {  // the splits are this cluster's CTAs (split_merge.cuh)
        merge_splits<HEAD_DIM, T::THREADS, CLUSTER_MERGE_LANES, 2>(
            inbox, p.num_splits, split, rows, p.head_dim, tid, locate_output,
            [&] { mbarrier_wait_cluster(inbox.bar, 0); });
        return;  // (every peer's stores into this inbox have landed)
    }
#endif
    // The splits of this row block wait for each other, then merge its rows together
    // (split_merge.cuh; the launch is cooperative).
    SplitBarrier barrier{p.split_counters + group_id};
    barrier.arrive(p.num_splits, split);
    const auto wait_for_splits = [&] { barrier.wait(); };
    const i64 group_row0 = static_cast<i64>(group_id) * p.num_splits * T::BLOCK_M;
    const GlobalPartials<HEAD_DIM, T::BLOCK_M> partials{p.o_partial + group_row0 * HEAD_DIM,
                                                        p.lse_partial + group_row0};
    if (p.num_splits <= SMALL_MERGE_SPLITS)
        merge_splits<HEAD_DIM, T::THREADS, SMALL_MERGE_LANES, MERGE_SLOTS>(
            partials, p.num_splits, split, rows, p.head_dim, tid, locate_output, wait_for_splits);
    else
        merge_splits<HEAD_DIM, T::THREADS, 32, MERGE_SLOTS>(
            partials, p.num_splits, split, rows, p.head_dim, tid, locate_output, wait_for_splits);
}
