// The Hopper forward's epilogue (flash_fwd_sm90.cu, a consumer warpgroup): after the mainloop
// (sm90/fwd_mainloop.cuh) has run over a work tile's KV tiles, store_tile finalizes the online
// softmax (1 / l and the lse of each row) and writes O, staged through shared memory, and the
// lse, with row guards. store_empty_rows writes the rows of a work tile that sees no key.
#pragma once
#include "hopper_primitives.cuh"
#include "variant.cuh"
#include "kernel_params.cuh"
#include "sm90/fwd_tile_scheduler.cuh"

// Rows row0 .. row0 + ROWS - 1 of a work tile whose rows see no key: O = 0 and lse = +inf (the
// log of an empty sum; the sink with sinks: AttentionVariant::empty_row_lse), written by THREADS
// threads, `tid` being one of them. No shared memory, no barrier. head_chunks: the 16-byte
// chunks actually present in an O row.
template <class T, int ROWS, int THREADS, int FEATURES>
CF2_DEVICE void store_empty_rows(const FwdParams& p, const FwdTileContext& c, int head_chunks,
                                 int row0, int tid) {
    u16* o_block = c.o_block;
    float* lse_block = c.lse_block;
    using Variant = AttentionVariant<FEATURES>;
    const int row_first = c.span.row_first;
    const int seqlen_q = tile_seqlen_q<Variant::VARLEN>(p, c);
    constexpr int CHUNKS = T::DIM / 8;
    const u32 zeros[4] = {0u, 0u, 0u, 0u};
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
        const int row = row0 + idx / CHUNKS, chunk = idx % CHUNKS;
        if (row_first + row < seqlen_q && chunk < head_chunks)
            store_16B_global(o_block + row * p.o_row_stride + chunk * 8, zeros);
    }
    for (int row = row0 + tid; row < row0 + ROWS; row += THREADS)
        if (row_first + row < seqlen_q) lse_block[row] = Variant::empty_row_lse(p.mods, c.w.head);
}

// The epilogue of one work tile of a consumer warpgroup (warpgroup 1 + `consumer` owns rows
// 64 consumer .. + 63 of it): acc_o and softmax as the mainloop (consume_kv_tiles) left them;
// inv_sum and row_lse take what finalize gives this thread's two rows (registers of the
// mainloop's, see there). head_chunks: the 16-byte chunks actually present in an O row.
// o_smem: the O buffer (the Q buffer, or PERSISTENT's own).
template <typename Elem, class T, bool PERSISTENT, bool VARLEN>
CF2_DEVICE void store_tile(const FwdParams& p, const FwdTileContext& c,
                           float (&acc_o)[1][T::D_TILES][4], OnlineSoftmax<1>& softmax,
                           float (&inv_sum)[2], float (&row_lse)[2], int head_chunks,
                           int consumer, u32 o_smem) {
    const int row_first = c.span.row_first;
    const int warp = (threadIdx.x / 32) % 4;  // in the warpgroup: rows 16 warp .. + 15
    const int lane = threadIdx.x % 32;
    const int wg_row0 = T::ROWS_PER_WARPGROUP * consumer;  // in the tile

    // Epilogue: divide by l once; stage the tile through this warpgroup's own rows of the O
    // buffer, in Q's swizzled layout (conflict-free), then write 16-byte row chunks to global
    // memory. Without PERSISTENT the O buffer is the Q buffer: no other warpgroup reads those
    // rows and this one's last wgmma reading them has completed. With it, O has a buffer of its
    // own (the next work tile's Q may be landing in Q's), reused tile after tile.
    u16* o_block = c.o_block;
    float* lse_block = c.lse_block;
    softmax.finalize(p.softmax_scale, inv_sum, row_lse);
    if constexpr (PERSISTENT)
        // Every warp of the warpgroup has read the previous work tile's O out of the buffer.
        named_barrier_sync(T::EPILOGUE_BARRIER + consumer, T::WARPGROUP_THREADS);
    else
        fence_proxy_async_shared();  // Q was last read by wgmma (async proxy); now plain stores
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = wg_row0 + 16 * warp + 8 * half + lane / 4;  // in the tile
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt) {
            const u32 packed = pack_pair<Elem>(acc_o[0][dt][2 * half] * inv_sum[half],
                                               acc_o[0][dt][2 * half + 1] * inv_sum[half]);
            store_4B_shared(swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, dt) + 4 * (lane % 4),
                            packed);
        }
        if (lane % 4 == 0 && row_first + row < tile_seqlen_q<VARLEN>(p, c))
            lse_block[row] = row_lse[half];
    }
    named_barrier_sync(T::EPILOGUE_BARRIER + consumer, T::WARPGROUP_THREADS);
    const int tid = threadIdx.x % T::WARPGROUP_THREADS;
    constexpr int CHUNKS = T::DIM / 8;
#pragma unroll
    for (int i = 0; i < T::ROWS_PER_WARPGROUP * CHUNKS / T::WARPGROUP_THREADS; ++i) {
        const int idx = tid + T::WARPGROUP_THREADS * i;
        const int row = wg_row0 + idx / CHUNKS;
        const int chunk = idx % CHUNKS;
        if (row_first + row < tile_seqlen_q<VARLEN>(p, c) && chunk < head_chunks) {
            u32 vals[4];
            load_16B_shared(vals, swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, chunk));
            store_16B_global(o_block + row * p.o_row_stride + chunk * 8, vals);
        }
    }
}
