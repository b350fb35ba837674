// warp_gemm.cuh's tile products and accumulator stores for float32 elements (tf32_tag,
// f32x3_tag: tf32_primitives.cuh) on m16n8k8 TF32 mma: the backward's three operand layouts.
//
// The tiles count 16-bit words (a float32 tile is a 16-bit tile twice as wide), so a chunk pair
// of a row is 8 floats, one k8 step. Per layout (g = lane / 4, t = lane % 4; PTX ISA m16n8k8
// .tf32 fragments: A (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4); B (k t, n g), (k t + 4, n g)):
//   A B^T (S, dP): the 16-bit kernel's ldmatrix.x4 fragments are the TF32 ones (as the forward's
//                  Q K^T): a rows_cursor gives A, a pairs_cursor the B of two n8 tiles.
//   A^T B (dV, dK): both operands are transposed against ldmatrix, which transposes 16-bit
//                  elements only: 32-bit shared loads (F32KeyPairCursor) with the k index
//                  permuted alike in A and B (k column t is tile row 8s + 2t, t + 4 is 8s + 2t + 1;
//                  the sum over k is the same), a pattern the 128-byte swizzle keeps free of bank
//                  conflicts.
//   A B (dQ):      A (dS rows) by ldmatrix.x4, B (K [key][column]) by 32-bit loads. ldmatrix
//                  gives A's columns t, t + 4 from tile columns t, t + 4, which would make B's
//                  rows t and t + 4: rows t and t ^ 1 share the swizzle's pair of chunk
//                  positions, a two-way bank conflict. So dS is stored with the keys of each 8
//                  permuted (store_permuted_keys_f32: key 2t at column t, 2t + 1 at t + 4):
//                  A's columns t, t + 4 are then keys 2t, 2t + 1, and K's rows 2t + j are read
//                  conflict-free (F32KeyPairCursor). dK's A^T operand reads dS in that order
//                  (permuted_keys_cursor).
// Each fragment is split into its TF32 parts once (Tf32Parts) and reused like the 16-bit one.
#pragma once
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"
#include "tf32_primitives.cuh"
#include "warp_gemm.cuh"

// F32KeyPairCursor for a tile whose columns hold the keys of each 8 permuted (the dS tile,
// store_permuted_keys_f32: key 2u at column u, key 2u + 1 at column u + 4): lane (g, t) reads
// (row 8 * row_block8 + 2t + j, key 8 * col_block8 + g), at column g / 2 + 4 * (g % 2) of the
// block. Each load still reads rows 2t + j and all eight columns of a block: conflict-free.
template <class Tile>
CF2_DEVICE F32KeyPairCursor<Tile> permuted_keys_cursor(u32 tile_base, int lane) {
    const int g = lane / 4;
    return F32KeyPairCursor<Tile>(tile_base, lane, g / 2 + 4 * (g % 2));
}

// acc += A B^T, A [m][k] and B [n][k] row-major (S = Q K^T, dP = dO V^T): gemm_a_bt over K_STEPS
// k8 steps. The k loop is unrolled by 2, as the forward's float32 Q K^T (a full unroll hoists
// more fragments than the registers hold).
template <typename Elem, int MT, int NT, int K_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_a_bt_f32(float (&acc)[MT][NT][4], const LdmatrixCursor<ATile>& a,
                              const LdmatrixCursor<BTile>& b) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll 2
    for (int ks = 0; ks < K_STEPS; ++ks) {
        Tf32Parts<Elem, 4> af[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 bits[4];
            ldmatrix_x4(bits, a.at(2 * mt, ks));
            af[mt] = Tf32Parts<Elem, 4>::from_bits(bits);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bits[4];
            ldmatrix_x4(bits, b.at(2 * np, ks));
            const auto bf = Tf32Parts<Elem, 4>::from_bits(bits);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_m16n16k8_f32<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], af[mt], bf);
        }
    }
}

// acc += A^T B, A [k][m] and B [k][n] row-major (dV += P^T dO, dK += dS^T Q) over K_STEPS k8
// steps of 8 rows: both fragments by 32-bit loads in the permuted k order (F32KeyPairCursor: j
// picks row 2t or 2t + 1, A's k columns t and t + 4; A's cursor a permuted_keys_cursor for
// dS). The warp's m and n slices start at column blocks of 8 m_block0 and n_block0.
template <typename Elem, int MT, int NT, int K_STEPS, class ACursor, class BTile>
CF2_DEVICE void gemm_at_b_f32(float (&acc)[MT][NT][4], const ACursor& a, int m_block0,
                              const F32KeyPairCursor<BTile>& b, int n_block0) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll 2
    for (int ks = 0; ks < K_STEPS; ++ks) {
        Tf32Parts<Elem, 4> af[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // A (m g, k t) = tile (row 8ks + 2t, column g), (m g + 8, k t), (m g, k t + 4) =
            // row 8ks + 2t + 1, (m g + 8, k t + 4).
            const int block = m_block0 + 2 * mt;
            const u32 bits[4] = {load_4B_shared(a.at(ks, block, 0)),
                                 load_4B_shared(a.at(ks, block + 1, 0)),
                                 load_4B_shared(a.at(ks, block, 1)),
                                 load_4B_shared(a.at(ks, block + 1, 1))};
            af[mt] = Tf32Parts<Elem, 4>::from_bits(bits);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            // B (k t, n g), (k t + 4, n g) of the pair's two n8 tiles.
            u32 bits[4];
            b.load_b_pair(bits, ks, n_block0 + 2 * np);
            const auto bf = Tf32Parts<Elem, 4>::from_bits(bits);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_m16n16k8_f32<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], af[mt], bf);
        }
    }
}

// acc += A B, A [m][k] and B [k][n] row-major (dQ = dS K) over K_STEPS k8 steps: A a rows_cursor
// at the warp's first row over the dS tile of permuted keys (ldmatrix.x4: columns t and t + 4 of
// the step, keys 2t and 2t + 1), B by 32-bit loads of the same keys (F32KeyPairCursor at row 0);
// the warp's n slice starts at column block n_block0.
template <typename Elem, int MT, int NT, int K_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_a_b_f32(float (&acc)[MT][NT][4], const LdmatrixCursor<ATile>& a,
                             const F32KeyPairCursor<BTile>& b, int n_block0) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll 2
    for (int ks = 0; ks < K_STEPS; ++ks) {
        Tf32Parts<Elem, 4> af[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 bits[4];
            ldmatrix_x4(bits, a.at(2 * mt, ks));
            af[mt] = Tf32Parts<Elem, 4>::from_bits(bits);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bits[4];
            b.load_b_pair(bits, ks, n_block0 + 2 * np);
            const auto bf = Tf32Parts<Elem, 4>::from_bits(bits);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_m16n16k8_f32<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], af[mt], bf);
        }
    }
}

// Offset of accumulator pair (columns 8 * (chunk0 + nt) + 2t, + 1 of `row`) in a float32 tile:
// 8 bytes of the n8 tile's two 16-byte chunks (columns count elements, chunks words).
template <class Tile>
CF2_DEVICE u32 f32_pair_offset(int row, int chunk8, int lane) {
    return Tile::offset(row, 2 * chunk8 + (lane % 4) / 2) + 8 * (lane % 2);
}

// store_accumulator for float32 tiles: element [mt][nt][2*half+e] (times `scale`) goes to row
// row0 + 16*mt + 8*half + lane/4, column 8*(chunk0 + nt) + 2*(lane%4) + e, kept fp32.
template <class Tile, int MT, int NT>
CF2_DEVICE void store_accumulator_f32(u32 tile_smem, const float (&acc)[MT][NT][4], int row0,
                                      int chunk0, int lane, float scale = 1.f) {
    for_each_accumulator_pair(acc, row0, lane, [&](int row, int nt, const float* pair) {
        store_8B_shared(tile_smem + f32_pair_offset<Tile>(row, chunk0 + nt, lane),
                        pair[0] * scale, pair[1] * scale);
    });
}

// store_accumulator_f32 with the keys (columns) of each 8 permuted, for the dS tile (see the
// top): the pair of keys 8 * (chunk0 + nt) + 2t, + 1 goes to columns t and t + 4 of its block,
// two 4-byte stores (each warp's store covers 8 rows x one chunk: conflict-free).
template <class Tile, int MT, int NT>
CF2_DEVICE void store_permuted_keys_f32(u32 tile_smem, const float (&acc)[MT][NT][4], int row0,
                                        int chunk0, int lane) {
    for_each_accumulator_pair(acc, row0, lane, [&](int row, int nt, const float* pair) {
#pragma unroll
        for (int e = 0; e < 2; ++e)
            store_4B_shared(tile_smem + Tile::offset(row, 2 * (chunk0 + nt) + e) + 4 * (lane % 4),
                            __float_as_uint(pair[e]));
    });
}
