// The Hopper backward's consumer mainloop (flash_bwd_sm90.cu): per step, S^T = K_c Q_i^T and
// dP^T = V_c dO_i^T by wgmma, the score pieces (sm90/bwd_scores.cuh), dV += P^T dO_i,
// dK += dS^T Q_i and dQ_i = dS K (written by sm90/bwd_dq_writer.cuh), with the GEMM helpers
// that issue those products.
#pragma once
#include "hopper_primitives.cuh"
#include "sm90/bwd_traits.cuh"

// X^T = A_c B^T for one consumer (S^T = K_c Q_i^T or dP^T = V_c dO_i^T): M = its 64 keys, N =
// BLOCK_M queries, QK_STEPS k16 steps over the head dim; both operands K-major descriptors (the
// forward's Q and K of S = Q K^T). `a_rows`: this consumer's first key row of K or V (a whole
// number of swizzle atoms into each panel). STEPS: dP^T's are V_STEPS (V's own head dim).
// Issues the wgmmas only.
template <typename Elem, class T, int STEPS = T::QK_STEPS>
CF2_DEVICE void issue_transposed_scores(float (&acc)[T::S_TILES][4], u32 a_rows, u32 b_tile) {
    issue_kmajor_ss<Elem, T::QUERIES, STEPS, T::KV_PANEL_BYTES, T::Q_PANEL_BYTES>(
        acc, a_rows, b_tile);
}

// acc (64 keys x COLS head-dim columns) += frag (this warp's keys x BLOCK_M queries, A registers) times
// `b_tile` (Q_i or dO_i, [queries x head dim], the MN-major B operand as V of the forward's
// P V: 16 rows = 2048 B a k16 step, SBO 1024, LBO one panel). Issues the wgmmas only.
template <typename Elem, class T, int COLS>
CF2_DEVICE void issue_key_gradient(float (&acc)[COLS / 8][4], u32 (&frag)[T::M_STEPS][4],
                                   u32 b_tile) {
#pragma unroll
    for (int ks = 0; ks < T::M_STEPS; ++ks) {
        const u64 b = smem_matrix_descriptor(b_tile + 2048 * ks, T::Q_PANEL_BYTES, 1024);
        wgmma_rs_trans_b<Elem, COLS>(acc, frag[ks], b, 1);
    }
}

// dQ_i[rows, COL0 .. COL0 + N) = dS K[:, COL0 .. COL0 + N) for 64 query rows: N_STEPS k16
// steps over the keys; A = those rows of dS (`ds_rows`: their first row in the tile, a whole
// number of swizzle atoms into each panel; K-major: 32 B a step inside a 64-key panel), B = K
// (MN-major, 2048 B a step, LBO one K panel). Issues the wgmmas only.
template <typename Elem, class T, int COL0, int N>
CF2_DEVICE void issue_dq(float (&acc)[N / 8][4], u32 ds_rows, u32 k_tile) {
    const u32 b0 = k_tile + (COL0 / T::PANEL_COLS) * T::KV_PANEL_BYTES + 2 * (COL0 % T::PANEL_COLS);
#pragma unroll
    for (int kk = 0; kk < T::N_STEPS; ++kk) {
        const u64 a = smem_matrix_descriptor(ds_rows + (kk / 4) * T::DS_PANEL_BYTES + 32 * (kk % 4),
                                             16, 1024);
        const u64 b = smem_matrix_descriptor(b0 + 2048 * kk, T::KV_PANEL_BYTES, 1024);
        wgmma_ss_trans_b<Elem, N>(acc, a, b, kk > 0);
    }
}
