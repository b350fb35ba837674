// The Hopper backward's epilogue (flash_bwd_sm90.cu): a consumer's dK (times softmax_scale) and
// dV, which the mainloop accumulated in its registers, staged through the K and V tiles in shared
// memory (stage_key_gradients) and stored as 16-byte row chunks with row and head-dim guards
// (store_key_gradients; the kernel meets the consumer's STORE_BARRIER between the two);
// and, for a key block that no query sees, dK = dV = 0 stored by the whole CTA instead of any
// role (store_zero_key_gradients). `dk_block`, `dv_block`: the key block's first row of dK, dV;
// `col0`: this CTA's first head-dim column (its chunk's).
#pragma once
#include "hopper_primitives.cuh"
#include "sm90/bwd_traits.cuh"

// No query sees these keys: dK = dV = 0 (the whole CTA, before any role; `tid`: threadIdx.x).
template <class T>
CF2_DEVICE void store_zero_key_gradients(const BwdParams& p, u16* dk_block, u16* dv_block,
                                         int key_first, int seqlen_k, int head_chunks, int col0,
                                         int tid) {
    constexpr int HEAD_DIM = T::DIM;
    constexpr int BLOCK_N = T::KEYS;
    const u32 zeros[4] = {0u, 0u, 0u, 0u};
    if constexpr (T::NUM_CHUNKS == 1) {
        for (int idx = tid; idx < BLOCK_N * (HEAD_DIM / 8); idx += T::THREADS) {
            const int row = idx / (HEAD_DIM / 8), chunk = idx % (HEAD_DIM / 8);
            if (key_first + row < seqlen_k && chunk < head_chunks) {
                store_16B_global(dk_block + row * p.dk_row_stride + chunk * 8, zeros);
                store_16B_global(dv_block + row * p.dv_row_stride + chunk * 8, zeros);
            }
        }
    } else {
        // This CTA's columns (the other chunk's CTA writes the rest).
        constexpr int CHUNKS = T::CHUNK_COLS / 8;
        for (int idx = tid; idx < BLOCK_N * CHUNKS; idx += T::THREADS) {
            const int row = idx / CHUNKS, c = col0 / 8 + idx % CHUNKS;
            if (key_first + row < seqlen_k && c < head_chunks) {
                store_16B_global(dk_block + row * p.dk_row_stride + c * 8, zeros);
                store_16B_global(dv_block + row * p.dv_row_stride + c * 8, zeros);
            }
        }
    }
}

// dK *= softmax_scale; stage dK into this consumer's rows of the K tile and dV into its rows of
// V (same swizzled layout: conflict-free 4-byte stores) once both consumers are done reading K
// and V (dQ reads all of K). `key0`: the consumer's first key in the block.
template <typename Elem, class T>
CF2_DEVICE void stage_key_gradients(const float (&acc_dk)[T::D_TILES][4],
                                    const float (&acc_dv)[T::D_TILES][4], const BwdParams& p,
                                    const BwdSm90Smem<T>& sm, int warp, int lane, int key0) {
    named_barrier_sync(T::EPILOGUE_BARRIER, T::CONSUMER_THREADS);
    fence_proxy_async_shared();  // K and V were last read by wgmma (async proxy)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = key0 + (16 * warp + lane / 4) + 8 * half;  // in the block
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt) {
            const u32 offset = swizzled_chunk<T::KV_PANEL_BYTES>(0, row, dt) + 4 * (lane % 4);
            store_4B_shared(sm.k + offset,
                            pack_pair<Elem>(acc_dk[dt][2 * half] * p.softmax_scale,
                                            acc_dk[dt][2 * half + 1] * p.softmax_scale));
            store_4B_shared(sm.v + offset,
                            pack_pair<Elem>(acc_dv[dt][2 * half], acc_dv[dt][2 * half + 1]));
        }
    }
}

// Then (after the consumer's STORE_BARRIER) its staged rows to global memory as 16-byte row
// chunks with row and head-dim guards; `tid`: the thread's index in the warpgroup.
template <class T>
CF2_DEVICE void store_key_gradients(const BwdParams& p, const BwdSm90Smem<T>& sm, u16* dk_block,
                                    u16* dv_block, int key_first, int seqlen_k, int head_chunks,
                                    int col0, int key0, int tid) {
    constexpr int CHUNKS = T::CHUNK_COLS / 8;  // 16-byte chunks of this CTA's row (widest)
#pragma unroll
    for (int i = 0; i < T::KEYS_PER_WARPGROUP * CHUNKS / T::WARPGROUP_THREADS; ++i) {
        const int idx = tid + T::WARPGROUP_THREADS * i;
        const int row = key0 + idx / CHUNKS;
        const int chunk = idx % CHUNKS;
        if (key_first + row < seqlen_k && chunk < head_chunks - col0 / 8) {
            u32 vals[4];
            load_16B_shared(vals, swizzled_chunk<T::KV_PANEL_BYTES>(sm.k, row, chunk));
            store_16B_global(dk_block + row * p.dk_row_stride + col0 + chunk * 8, vals);
            load_16B_shared(vals, swizzled_chunk<T::KV_PANEL_BYTES>(sm.v, row, chunk));
            store_16B_global(dv_block + row * p.dv_row_stride + col0 + chunk * 8, vals);
        }
    }
}
