// The MLA decode kernel's consumers (flash_mla_decode_sm90.cu, warpgroups 1 and 2): Q into
// shared memory, then the FA2 loop over the split's cache tiles as the producer
// (sm90/mla_producer.cuh) lands them: S = Q K^T over all 576 columns, each consumer for half
// of the tile's keys; the online softmax on the tile's row maxima, which the two exchange
// through shared memory; each consumer's P into one P tile in shared memory; O += P V over all
// the tile's keys with V the tile's first 512 columns, each consumer its half of them. S is
// computed once: with 128 heads the step's products, not its bytes, set its time
// (docs/MLA_DECODE.md). It leaves the unnormalised O and the softmax state (the row sums of
// both consumers' keys) to the epilogue (sm90/mla_epilogue.cuh).
#pragma once
#include "hopper_primitives.cuh"
#include "online_softmax.cuh"
#include "masking.cuh"
#include "rotary.cuh"
#include "split_merge.cuh"
#include "sm90/mla_traits.cuh"

// Where a CTA's packed rows and its sequence's keys stand (the decode kernel's packing: packed
// row rr is query token rr / group, head rr % group).
struct MlaRowBlock {
    int batch;
    int row_first;  // packed row of the block's row 0
    int rows;       // rows of this block (BLOCK_M but in the last block)
    int group;      // query heads (one KV head)
    int cache_len;  // positions already cached; the new tokens come after
    int seqlen_k;   // cached + new, within the capacity
};

// Q's rows of the block into Q's panels in the TMA's swizzled layout, by the consumers' 256
// threads (`ctid`); rows past the block's end zero-filled. Q's rows are heads of one token, or
// of a few: their addresses follow q's strides, which no one tensor map box covers in general.
template <class T>
CF2_DEVICE void load_q_rows(const DecodeParams& p, const MlaRowBlock& b, u32 q_smem, int ctid) {
    for (int idx = ctid; idx < T::BLOCK_M * T::CHUNKS; idx += T::CONSUMER_THREADS) {
        const int r = idx / T::CHUNKS, chunk = idx % T::CHUNKS;
        u32 v[4] = {0u, 0u, 0u, 0u};
        if (r < b.rows) {
            const int packed = b.row_first + r;
            load_16B_global(v, p.q + b.batch * p.q_batch_stride + (packed / b.group) * p.q_row_stride +
                                   (packed % b.group) * p.q_head_stride + chunk * 8);
        }
        store_16B_shared_words(swizzled_chunk<T::PANEL_BYTES>(q_smem, r, chunk), v);
    }
}

// The rows of a landed tile from the sequence's cache length on, written in place before the
// tile is read (by the consumers' 256 threads): a new token's row from k_new (the append of
// the same rows into the cache runs in one CTA meanwhile: no CTA reads the cache there), a
// position at or past seqlen_k zero (the cache may hold anything there, NaN included, which
// would reach O through P = 0 times V).
template <class T>
CF2_DEVICE void write_rows_past_cache(const DecodeParams& p, const MlaRowBlock& b, u32 k_tile,
                                      int key0, int ctid) {
    const u16* k_new = p.k_new + b.batch * p.kn_batch_stride;
    const int first = max(0, min(b.cache_len, b.seqlen_k) - key0);  // the tile's first such row
    for (int idx = first * T::CHUNKS + ctid; idx < T::BLOCK_N * T::CHUNKS;
         idx += T::CONSUMER_THREADS) {
        const int r = idx / T::CHUNKS, chunk = idx % T::CHUNKS;
        const int key = key0 + r;
        u32 v[4] = {0u, 0u, 0u, 0u};
        if (key < b.seqlen_k)
            load_16B_global(v, k_new + (key - b.cache_len) * p.kn_row_stride + chunk * 8);
        store_16B_shared_words(swizzled_chunk<T::PANEL_BYTES>(k_tile, r, chunk), v);
    }
}

// S = Q K^T for the block's 64 rows and this consumer's KEYS_EACH keys of the tile (rows
// KEYS_EACH * consumer .. of its panels) over the latent row's 576 columns, complete on return.
template <typename Elem, class T>
CF2_DEVICE void latent_scores(float (&acc_s)[T::N_TILES][4], u32 q_smem, u32 k_rows) {
    pin_registers(acc_s);
    wgmma_fence();
    issue_kmajor_ss<Elem, T::KEYS_EACH, T::QK_STEPS, T::PANEL_BYTES, T::PANEL_BYTES>(
        acc_s, q_smem, k_rows);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_s);
}

// This consumer's probabilities (its KS k16 slices, in the m16n8k16 A layout exp_pack leaves)
// into the tile's P panel, keys KEYS_EACH * consumer ..: stmatrix.x4 stores a slice's four
// 8 x 8 matrices (a[0] rows g, keys 0-7; a[1] rows g + 8; a[2], a[3] keys 8-15), lane l giving
// row l % 8 of matrix l / 8. The 8 rows of a matrix are consecutive rows of one 16-byte chunk
// column: 8 slots of the 128-byte swizzle, conflict-free.
template <class T>
CF2_DEVICE void store_probabilities(u32 p_tile, const u32 (&prob)[T::KEYS_EACH / 16][4],
                                    int consumer, int warp, int lane) {
    const int m = lane / 8;
    const int row = 16 * warp + lane % 8 + 8 * (m & 1);
#pragma unroll
    for (int ks = 0; ks < T::KEYS_EACH / 16; ++ks) {
        const int key = T::KEYS_EACH * consumer + 16 * ks + 8 * (m >> 1);
        stmatrix_x4(swizzled_chunk<T::P_BYTES>(p_tile, row, key / 8), prob[ks]);
    }
}

// O += P V for this consumer's columns over all the tile's keys: P the tile's P panel (both
// consumers' keys), the K-major A operand (the k16 step ks 32 bytes into its rows); V the
// tile's panels from `v_panels` on, the MN-major B operand (SBO 1024 B between groups of 8
// keys, LBO a panel between groups of 64 columns, the k16 step 16 rows of 128 B further),
// N = DIM_V_EACH; complete on return.
template <typename Elem, class T>
CF2_DEVICE void latent_values(float (&acc_o)[T::D_TILES][4], u32 p_tile, u32 v_panels) {
    pin_registers(acc_o);
    wgmma_fence();  // the rescaled O was written by ordinary instructions
#pragma unroll
    for (int ks = 0; ks < T::PV_STEPS; ++ks) {
        const u64 a = smem_matrix_descriptor(p_tile + 32 * ks, 16, 1024);
        const u64 b = smem_matrix_descriptor(v_panels + 16 * T::ROW_BYTES * ks, T::PANEL_BYTES,
                                             1024);
        wgmma_ss_trans_b<Elem, T::DIM_V_EACH>(acc_o, a, b, 1);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_o);
}

// The FA2 loop of one consumer over tiles [tile_first, tile_end) (ring position j: stage
// j % STAGES, phase (j / STAGES) & 1, as the producer fills it). Only tiles past a row's last
// visible key are masked (the sequence's end; causal: each row's diagonal); only tiles reaching
// the cache length are written in place first, by both consumers, which meet at
// CONSUMERS_BARRIER before either reads it. Per tile, consumer c:
//  1. S_c = Q K_c^T over its KEYS_EACH keys (m64n32: the tile's S once between the two);
//  2. its rows' maxima over those keys into the tile's maxima, a barrier of the two, and the
//     online softmax's update on the larger of each row's two (the same in both consumers, so
//     their running maxima, rescales and exponents agree);
//  3. P_c = exp2(S_c scale - m), summed into this thread's row sums (over its keys only: after
//     the last tile the other consumer's are added, below), into the tile's P panel; a barrier
//     of the two;
//  4. O_c += P V_c over all the tile's keys (SS: P from the panel).
// One P panel and one set of maxima serve every tile: a consumer writes the next tile's maxima
// after the second barrier of this one (the other has read these by then) and its P after the
// first barrier of the next (both P V of this one have completed by then).
// PAIRED: a stage goes back to both CTAs' producers (each writes half of it: TMA multicast,
// sm90/mla_producer.cuh), an arrival on this CTA's empty barrier and one on the other's (its
// address made at each arrival from the CTA's rank, not held across the loop: 8 bytes spilled).
template <typename Elem, class T, bool PAIRED = false>
CF2_DEVICE void consume_latent_tiles(const DecodeParams& p, const MlaRowBlock& b,
                                     const KeyVisibility& vis, int tile_first, int tile_end,
                                     int consumer, int ctid, u32 q_smem, u32 kv_smem,
                                     MlaDecodeBarriers<T::STAGES>& bars,
                                     float (&acc_o)[1][T::D_TILES][4],
                                     OnlineSoftmax<1>& softmax) {
    const int lane = ctid % 32, warp = (ctid / 32) % 4;
    const u32 p_tile = q_smem + T::P_OFFSET;
    const u32 maxima = q_smem + T::MAXIMA_OFFSET;  // [consumer][row] floats
    // This thread's two rows (16 warp + lane / 4, + 8) and the key past their last visible one.
    int row_hi[2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
        row_hi[half] = vis.hi((b.row_first + 16 * warp + 8 * half + lane / 4) / b.group);
    const int block_hi = vis.hi(b.row_first / b.group);  // the least of the block's rows'
    const int written_from = min(b.cache_len, b.seqlen_k);
#pragma unroll 1
    for (int tile = tile_first, j = 0; tile < tile_end; ++tile, ++j) {
        const int stage = j % T::STAGES;
        const u32 phase = (j / T::STAGES) & 1;
        const u32 k_tile = kv_smem + stage * T::TILE_BYTES;
        const int key0 = tile * T::BLOCK_N + T::KEYS_EACH * consumer;  // this consumer's first
        mbarrier_wait(smem_address(&bars.full[stage]), phase);
        if (tile * T::BLOCK_N + T::BLOCK_N > written_from) {
            write_rows_past_cache<T>(p, b, k_tile, tile * T::BLOCK_N, ctid);
            fence_proxy_async_shared();  // plain stores, then the wgmmas' reads
            named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
        }
        float acc_s[T::N_TILES][4];
        latent_scores<Elem, T>(acc_s, q_smem, k_tile + T::KEYS_EACH * consumer * T::ROW_BYTES);
        if (key0 + T::KEYS_EACH > block_hi) {
            // s[nt][e]: row half e / 2, key key0 + 8 nt + 2 (lane % 4) + e % 2
#pragma unroll
            for (int nt = 0; nt < T::N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (key0 + 8 * nt + 2 * (lane % 4) + e % 2 >= row_hi[e / 2])
                        acc_s[nt][e] = neg_inf();
        }
        // The tile's row maxima: this consumer's keys', the other's through shared memory.
        float tile_max[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float x = neg_inf();
#pragma unroll
            for (int nt = 0; nt < T::N_TILES; ++nt)
                x = fmaxf(x, fmaxf(acc_s[nt][2 * half], acc_s[nt][2 * half + 1]));
            tile_max[half] = quad_max(x);
        }
        const int row0 = 16 * warp + lane / 4;
        if (lane % 4 == 0) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
                store_4B_shared(maxima + 4 * (T::BLOCK_M * consumer + row0 + 8 * half),
                                __float_as_uint(tile_max[half]));
        }
        named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
        // update_max on one n8 tile holding each row's maximum over both consumers' keys: it
        // folds it into the running max and rescales O and this thread's sums as for a tile.
        float both[1][1][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float other = __int_as_float(load_4B_shared_fresh(
                maxima + 4 * (T::BLOCK_M * (1 - consumer) + row0 + 8 * half)));
            both[0][0][2 * half] = both[0][0][2 * half + 1] = fmaxf(tile_max[half], other);
        }
        softmax.update_max(both, acc_o, p.scale_log2);
        u32 prob[T::KEYS_EACH / 16][4];
#pragma unroll
        for (int ks = 0; ks < T::KEYS_EACH / 16; ++ks)
            softmax.template exp_pack<Elem>(prob[ks], acc_s[2 * ks], acc_s[2 * ks + 1], 0,
                                            p.scale_log2);
        store_probabilities<T>(p_tile, prob, consumer, warp, lane);
        fence_proxy_async_shared();  // plain stores, then the wgmmas' reads
        named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
        latent_values<Elem, T>(acc_o[0], p_tile,
                               k_tile + consumer * T::V_PANELS_EACH * T::PANEL_BYTES);
        const u32 empty = smem_address(&bars.empty[stage]);
        mbarrier_arrive(empty);
        if constexpr (PAIRED)
            mbarrier_arrive_cluster(cluster_peer_address(empty, cluster_rank() ^ 1));
    }
    // The row sums over the other consumer's keys: its thread of the same warp and lane holds
    // the same rows' (and the same running max), through the P panel once both P V are done.
    named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
    // ([consumer][thread of the warpgroup][2] floats: 2 KiB of the 8 KiB panel)
    constexpr u32 SUMS_BYTES = 8 * T::WARPGROUP_THREADS;
    const u32 sums = p_tile + 8 * (ctid % T::WARPGROUP_THREADS);
#pragma unroll
    for (int half = 0; half < 2; ++half)
        store_4B_shared(sums + SUMS_BYTES * consumer + 4 * half,
                        __float_as_uint(softmax.row_sum[half]));
    named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
#pragma unroll
    for (int half = 0; half < 2; ++half)
        softmax.row_sum[half] += __int_as_float(
            load_4B_shared_fresh(sums + SUMS_BYTES * (1 - consumer) + 4 * half));
}
