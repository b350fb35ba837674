// The Hopper forward's epilogue (flash_fwd_sm90.cu, a consumer warpgroup): after the mainloop
// (sm90/fwd_mainloop.cuh) has run over a work tile's KV tiles, store_tile finalizes the online
// softmax (1 / l and the lse of each row) and writes O, staged through shared memory, and the
// lse, with row guards. store_empty_tile_rows writes the rows of a work tile that sees no key.
// Both end in the forward kernels' shared stores (output_store.cuh).
#pragma once
#include "hopper_primitives.cuh"
#include "tf32_primitives.cuh"
#include "variant.cuh"
#include "kernel_params.cuh"
#include "output_store.cuh"
#include "sm90/fwd_tile_scheduler.cuh"
#include "sm90/fwd_descales.cuh"

// Rows row0 .. row0 + ROWS - 1 of a work tile whose rows see no key: O = 0 and lse = +inf (the
// log of an empty sum; the sink with sinks: AttentionVariant::empty_row_lse), written by THREADS
// threads, `tid` being one of them (output_store.cuh: store_empty_rows). head_chunks: the
// 16-byte chunks actually present in an O row.
template <class T, int ROWS, int THREADS, int FEATURES>
CF2_DEVICE void store_empty_tile_rows(const FwdParams& p, const FwdTileContext& c,
                                      int head_chunks, int row0, int tid) {
    using Variant = AttentionVariant<FEATURES>;
    store_empty_rows<ROWS, T::O_CHUNKS, THREADS, Variant>(
        p, c.o_block, c.lse_block, c.w.head, c.span.row_first,
        tile_seqlen_q<Variant::VARLEN>(p, c), head_chunks, row0, tid);
}

// The epilogue of one work tile of a consumer warpgroup (warpgroup 1 + `consumer` owns rows
// 64 consumer .. + 63 of it): acc_o and softmax as the mainloop (consume_kv_tiles) left them;
// inv_sum and row_lse take what finalize gives this thread's two rows (registers of the
// mainloop's, see there). head_chunks: the 16-byte chunks actually present in an O row.
// o_smem: the O buffer (the Q buffer, or PERSISTENT's own). `descales`: e4m3 inputs' factors
// (S in units of q_descale * k_descale, P V of v_descale: sm90/fwd_descales.cuh).
template <typename Elem, class T, bool PERSISTENT, bool VARLEN>
CF2_DEVICE void store_tile(const FwdParams& p, const FwdTileContext& c,
                           const TileDescales& descales,
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
    softmax.template finalize<T::P_SCALE_LOG2>(
        Elem::IS_E4M3 ? p.softmax_scale * descales.qk : p.softmax_scale, inv_sum, row_lse);
    if constexpr (Elem::IS_E4M3)
#pragma unroll
        for (int half = 0; half < 2; ++half) inv_sum[half] *= descales.v;
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
            if constexpr (Elem::IS_F32) {
                // columns 8 dt + 2t, + 1: words 16 dt + 4t .., chunk 2 dt + t / 2, byte 8 (t % 2)
                const int t = lane % 4;
                store_8B_shared(swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, 2 * dt + t / 2) +
                                    8 * (t % 2),
                                acc_o[0][dt][2 * half] * inv_sum[half],
                                acc_o[0][dt][2 * half + 1] * inv_sum[half]);
            } else {
                const u32 packed =
                    pack_pair<typename Elem::Out>(acc_o[0][dt][2 * half] * inv_sum[half],
                                                  acc_o[0][dt][2 * half + 1] * inv_sum[half]);
                store_4B_shared(
                    swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, dt) + 4 * (lane % 4), packed);
            }
        }
        if (lane % 4 == 0 && row_first + row < tile_seqlen_q<VARLEN>(p, c))
            lse_block[row] = row_lse[half];
    }
    named_barrier_sync(T::EPILOGUE_BARRIER + consumer, T::WARPGROUP_THREADS);
    store_staged_rows<T::ROWS_PER_WARPGROUP, T::O_CHUNKS, T::WARPGROUP_THREADS>(
        p, o_block,
        [&](int row, int chunk) { return swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, chunk); },
        row_first, tile_seqlen_q<VARLEN>(p, c), head_chunks, wg_row0,
        static_cast<int>(threadIdx.x % T::WARPGROUP_THREADS));
}
