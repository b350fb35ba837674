// The Hopper backward's epilogue (flash_bwd_sm90.cu): the zero store of a key block no query
// sees (dK = dV = 0, the whole CTA), and the consumers' dK / dV: dK scaled, staged into the K / V
// tiles, stored to global memory.
#pragma once
#include "hopper_primitives.cuh"
#include "kernel_params.cuh"
#include "sm90/bwd_traits.cuh"

// No query sees the block's keys: dK = dV = 0 for its rows below seqlen_k and this CTA's columns
// (below the head dim's `head_chunks` 16-byte chunks), by every thread of the CTA (`tid`: its
// index).
template <class T>
CF2_DEVICE void store_zero_dkdv(const BwdParams& p, u16* dk_block, u16* dv_block, int key_first,
                                int seqlen_k, int head_chunks, int col0, int tid) {
    constexpr int HEAD_DIM = T::DIM, BLOCK_N = T::KEYS_PER_WARPGROUP * T::CONSUMER_WARPGROUPS;
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
