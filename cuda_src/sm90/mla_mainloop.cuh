// The MLA decode kernel's consumers (flash_mla_decode_sm90.cu, warpgroups 1 and 2): Q into
// shared memory, then the FA2 loop over the split's cache tiles as the producer
// (sm90/mla_producer.cuh) lands them: S = Q K^T over all 576 columns (both consumers, the same
// S), the online softmax, O += P V with V the tile's first 512 columns, each consumer its half
// of them. It leaves the unnormalised O and the softmax state to the epilogue
// (sm90/mla_epilogue.cuh).
#pragma once
#include "hopper_primitives.cuh"
#include "online_softmax.cuh"
#include "masking.cuh"
#include "rotary.cuh"
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

// S = Q K^T for the block's 64 rows over the latent row's 576 columns, complete on return.
template <typename Elem, class T>
CF2_DEVICE void latent_scores(float (&acc_s)[T::N_TILES][4], u32 q_smem, u32 k_tile) {
    pin_registers(acc_s);
    wgmma_fence();
    issue_kmajor_ss<Elem, T::BLOCK_N, T::QK_STEPS, T::PANEL_BYTES, T::PANEL_BYTES>(acc_s, q_smem,
                                                                                  k_tile);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_s);
}

// O += P V for this consumer's columns: V is the tile's panels from `v_panels` on, the MN-major
// B operand (SBO 1024 B between groups of 8 keys, LBO a panel between groups of 64 columns, the
// k16 step 16 rows of 128 B further), N = DIM_V_EACH; complete on return.
template <typename Elem, class T>
CF2_DEVICE void latent_values(float (&acc_o)[T::D_TILES][4], u32 (&p)[T::PV_STEPS][4],
                              u32 v_panels) {
    pin_registers(acc_o);
    pin_registers(p);
    wgmma_fence();  // P and the rescaled O were written by ordinary instructions
#pragma unroll
    for (int ks = 0; ks < T::PV_STEPS; ++ks) {
        const u64 b = smem_matrix_descriptor(v_panels + 16 * T::ROW_BYTES * ks, T::PANEL_BYTES,
                                             1024);
        wgmma_rs_trans_b<Elem, T::DIM_V_EACH>(acc_o, p[ks], b, 1);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_o);
    pin_registers(p);
}

// The FA2 loop of one consumer over tiles [tile_first, tile_end) (ring position j: stage
// j % STAGES, phase (j / STAGES) & 1, as the producer fills it). Only tiles past a row's last
// visible key are masked (the sequence's end; causal: each row's diagonal); only tiles reaching
// the cache length are written in place first, by both consumers, which meet at
// CONSUMERS_BARRIER before either reads it.
template <typename Elem, class T>
CF2_DEVICE void consume_latent_tiles(const DecodeParams& p, const MlaRowBlock& b,
                                     const KeyVisibility& vis, int tile_first, int tile_end,
                                     int consumer, int ctid, u32 q_smem, u32 kv_smem,
                                     MlaDecodeBarriers<T::STAGES>& bars,
                                     float (&acc_o)[1][T::D_TILES][4],
                                     OnlineSoftmax<1>& softmax) {
    const int lane = ctid % 32, warp = (ctid / 32) % 4;
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
        const int key0 = tile * T::BLOCK_N;
        mbarrier_wait(smem_address(&bars.full[stage]), phase);
        if (key0 + T::BLOCK_N > written_from) {
            write_rows_past_cache<T>(p, b, k_tile, key0, ctid);
            fence_proxy_async_shared();  // plain stores, then the wgmmas' reads
            named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
        }
        float acc_s[T::N_TILES][4];
        latent_scores<Elem, T>(acc_s, q_smem, k_tile);
        if (key0 + T::BLOCK_N > block_hi) {
            // s[nt][e]: row half e / 2, key key0 + 8 nt + 2 (lane % 4) + e % 2
#pragma unroll
            for (int nt = 0; nt < T::N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (key0 + 8 * nt + 2 * (lane % 4) + e % 2 >= row_hi[e / 2])
                        acc_s[nt][e] = neg_inf();
        }
        float(&s)[1][T::N_TILES][4] = reinterpret_cast<float(&)[1][T::N_TILES][4]>(acc_s);
        softmax.update_max(s, acc_o, p.scale_log2);
        u32 prob[T::PV_STEPS][4];
#pragma unroll
        for (int ks = 0; ks < T::PV_STEPS; ++ks)
            softmax.template exp_pack<Elem>(prob[ks], acc_s[2 * ks], acc_s[2 * ks + 1], 0,
                                            p.scale_log2);
        latent_values<Elem, T>(acc_o[0], prob,
                               k_tile + consumer * T::V_PANELS_EACH * T::PANEL_BYTES);
        mbarrier_arrive(smem_address(&bars.empty[stage]));
    }
}
