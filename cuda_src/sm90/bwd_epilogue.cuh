// The Hopper backward's epilogue (flash_bwd_sm90.cu): the zero store of a key block no query
// sees (dK = dV = 0, the whole CTA), and the consumers' dK / dV: dK scaled, staged into the K / V
// tiles, stored to global memory (the named barriers between those stay in the kernel).
#pragma once
#include "hopper_primitives.cuh"
#include "kernel_params.cuh"
#include "sm90/bwd_traits.cuh"

// No query sees the block's keys: dK = dV = 0 for its rows below seqlen_k and this CTA's columns
// (below the head dim's `head_chunks` 16-byte chunks, dV's `v_head_chunks`), by every thread of
// the CTA (`tid`: its index).
template <class T>
CF2_DEVICE void store_zero_dkdv(const BwdParams& p, u16* dk_block, u16* dv_block, int key_first,
                                int seqlen_k, int head_chunks, int v_head_chunks, int col0,
                                int tid) {
    constexpr int HEAD_DIM = T::DIM, BLOCK_N = T::KEYS_PER_WARPGROUP * T::CONSUMER_WARPGROUPS;
    const u32 zeros[4] = {0u, 0u, 0u, 0u};
    // dK's and dV's guards apart: V's own head dim (below a chunk's columns: the second chunk's
    // CTAs store none of dV), or the same kernel head dim as d_qk (128 / 112 say).
    if constexpr (T::NUM_CHUNKS == 1) {
        for (int idx = tid; idx < BLOCK_N * (HEAD_DIM / 8); idx += T::THREADS) {
            const int row = idx / (HEAD_DIM / 8), chunk = idx % (HEAD_DIM / 8);
            if (key_first + row < seqlen_k) {
                if (chunk < head_chunks)
                    store_16B_global(dk_block + row * p.dk_row_stride + chunk * 8, zeros);
                if (chunk < v_head_chunks)
                    store_16B_global(dv_block + row * p.dv_row_stride + chunk * 8, zeros);
            }
        }
    } else {
        // This CTA's columns (the other chunk's CTA writes the rest).
        constexpr int CHUNKS = T::CHUNK_COLS / 8;
        for (int idx = tid; idx < BLOCK_N * CHUNKS; idx += T::THREADS) {
            const int row = idx / CHUNKS, c = col0 / 8 + idx % CHUNKS;
            if (key_first + row < seqlen_k) {
                if (c < head_chunks)
                    store_16B_global(dk_block + row * p.dk_row_stride + c * 8, zeros);
                if (c < v_head_chunks)
                    store_16B_global(dv_block + row * p.dv_row_stride + c * 8, zeros);
            }
        }
    }
}

// dK *= softmax_scale; a consumer's dK into its rows of the K tile and dV into its rows of V
// (its 64 keys from `key0`; same swizzled layout: conflict-free 4-byte stores), once both
// consumers are done reading K and V. The row's sum is grouped as the compiler grouped it when
// the loop was the kernel's own (ungrouped here, its order changed and with it the SASS).
// V's own head dim: dV's DV_TILES groups (fewer than dK's) into V's tile.
template <typename Elem, class T>
CF2_DEVICE void stage_dkdv(const BwdParams& p, const float (&acc_dk)[T::D_TILES][4],
                           const float (&acc_dv)[T::DV_TILES][4], u32 k_smem, u32 v_smem,
                           int key0, int warp, int lane) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = key0 + (16 * warp + lane / 4) + 8 * half;  // in the block
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt) {
            const u32 offset = swizzled_chunk<T::KV_PANEL_BYTES>(0, row, dt) + 4 * (lane % 4);
            store_4B_shared(k_smem + offset,
                            pack_pair<Elem>(acc_dk[dt][2 * half] * p.softmax_scale,
                                            acc_dk[dt][2 * half + 1] * p.softmax_scale));
            if (dt < T::DV_TILES)
                store_4B_shared(v_smem + offset,
                                pack_pair<Elem>(acc_dv[dt][2 * half], acc_dv[dt][2 * half + 1]));
        }
    }
}

// A consumer's staged dK and dV (its 64 keys from `key0`, in the K and V tiles) to global
// memory: 16-byte row chunks of this CTA's columns (from `col0`) with row and head-dim guards.
// `tid`: the thread's index in its warpgroup. V's own head dim: dV's chunks (`v_head_chunks`)
// by the first chunk's CTAs.
template <class T>
CF2_DEVICE void store_dkdv(const BwdParams& p, u32 k_smem, u32 v_smem, u16* dk_block,
                           u16* dv_block, int key_first, int seqlen_k, int head_chunks,
                           int v_head_chunks, int col0, int key0, int tid) {
    constexpr int CHUNKS = T::CHUNK_COLS / 8;  // 16-byte chunks of this CTA's row (widest)
    // dK's and dV's guards apart: V's own head dim (a kernel's of its own, whose dV columns
    // only the first chunk's CTAs store, or the same kernel head dim as d_qk: 128 / 112 say).
#pragma unroll
    for (int i = 0; i < T::KEYS_PER_WARPGROUP * CHUNKS / T::WARPGROUP_THREADS; ++i) {
        const int idx = tid + T::WARPGROUP_THREADS * i;
        const int row = key0 + idx / CHUNKS;
        const int chunk = idx % CHUNKS;
        if (key_first + row >= seqlen_k) continue;
        u32 vals[4];
        if (chunk < head_chunks - col0 / 8) {
            load_16B_shared(vals, swizzled_chunk<T::KV_PANEL_BYTES>(k_smem, row, chunk));
            store_16B_global(dk_block + row * p.dk_row_stride + col0 + chunk * 8, vals);
        }
        if ((T::SAME_DIMS || col0 == 0) && chunk < T::DV_COLS / 8 &&
            chunk < v_head_chunks - col0 / 8) {
            load_16B_shared(vals, swizzled_chunk<T::KV_PANEL_BYTES>(v_smem, row, chunk));
            store_16B_global(dv_block + row * p.dv_row_stride + col0 + chunk * 8, vals);
        }
    }
}
