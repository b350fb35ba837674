// Warp-level tile products from swizzled shared memory: acc (16*MT x 8*NT, fp32, mma
// accumulator layout) += A B over K_STEPS k16 steps, for the three operand layouts the backward
// needs. Every fragment is an ldmatrix.x4 (four 8x8 matrices); each A fragment is reused by NT
// mma and each B fragment by MT mma, which is what bounds shared-memory reads per FLOP.
//
// Lane patterns of the cursors (LdmatrixCursor, smem_swizzle.cuh), with `row0` the first row of
// the warp's slice of the tile (a multiple of 16, so the swizzle key of a lane does not change):
//   rows_cursor:   lane row row0 + lane % 16, chunk bit lane / 16. Matrices {r0-7, k0-7},
//                  {r8-15, k0-7}, {r0-7, k8-15}, {r8-15, k8-15}: an A fragment (plain), or with
//                  .trans two n8 B fragments of a [k][n] tile.
//   pairs_cursor:  lane row row0 + lane % 8 + 8 * (lane / 16), chunk bit (lane / 8) % 2. Matrices
//                  {r0-7, k0-7}, {r0-7, k8-15}, {r8-15, k0-7}, {r8-15, k8-15}: two n8 B fragments
//                  of an [n][k] tile (plain), or with .trans an A fragment of a [k][m] tile.
#pragma once
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"

template <class Tile>
CF2_DEVICE LdmatrixCursor<Tile> rows_cursor(u32 tile_smem, int row0, int lane) {
    return LdmatrixCursor<Tile>(tile_smem, row0 + lane % 16, lane / 16);
}

template <class Tile>
CF2_DEVICE LdmatrixCursor<Tile> pairs_cursor(u32 tile_smem, int row0, int lane) {
    return LdmatrixCursor<Tile>(tile_smem, row0 + lane % 8 + 8 * (lane / 16), (lane / 8) % 2);
}

template <int MT, int NT>
CF2_DEVICE void zero_fill(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// acc += A B^T with A [m][k] and B [n][k] both row-major in shared memory (k along the columns):
// S = Q K^T, dP = dO V^T. `a` is a rows_cursor, `b` a pairs_cursor; k starts at chunk pair 0.
template <typename Elem, int MT, int NT, int K_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_a_bt(float (&acc)[MT][NT][4], const LdmatrixCursor<ATile>& a,
                          const LdmatrixCursor<BTile>& b) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a.at(2 * mt, ks));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bf[4];
            ldmatrix_x4(bf, b.at(2 * np, ks));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_m16n16k16<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], af[mt], bf);
        }
    }
}

// acc += A^T B with A [k][m] and B [k][n] row-major (k along the rows): dV += P^T dO,
// dK += dS^T Q. `a` is a pairs_cursor, `b` a rows_cursor, both at row 0; the warp's m and n
// slices start at chunk pairs m_pair0 and n_pair0.
template <typename Elem, int MT, int NT, int K_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_at_b(float (&acc)[MT][NT][4], const LdmatrixCursor<ATile>& a, int m_pair0,
                          const LdmatrixCursor<BTile>& b, int n_pair0) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4_trans(af[mt], a.at(2 * ks, m_pair0 + mt));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bf[4];
            ldmatrix_x4_trans(bf, b.at(2 * ks, n_pair0 + np));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_m16n16k16<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], af[mt], bf);
        }
    }
}

// acc += A B with A [m][k] and B [k][n] row-major: dQ = dS K. `a` is a rows_cursor at the warp's
// first row, `b` a rows_cursor at row 0; the warp's n slice starts at chunk pair n_pair0.
template <typename Elem, int MT, int NT, int K_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_a_b(float (&acc)[MT][NT][4], const LdmatrixCursor<ATile>& a,
                         const LdmatrixCursor<BTile>& b, int n_pair0) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a.at(2 * mt, ks));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bf[4];
            ldmatrix_x4_trans(bf, b.at(2 * ks, n_pair0 + np));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_m16n16k16<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], af[mt], bf);
        }
    }
}

// Visits this lane's pairs of an accumulator tile (the m16n8 layout): pair(row, nt, pair) for
// elements [mt][nt][2*half], [2*half+1] (`pair` points at the first), which lie in row
// row0 + 16*mt + 8*half + lane/4, columns 8*nt + 2*(lane%4), + 1. Every store of an accumulator
// tile to shared memory walks it so.
template <int MT, int NT, class Pair>
CF2_DEVICE void for_each_accumulator_pair(const float (&acc)[MT][NT][4], int row0, int lane,
                                          Pair&& pair) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                pair(row0 + 16 * mt + 8 * half + lane / 4, nt, &acc[mt][nt][2 * half]);
}

// Stores an accumulator tile as 16-bit pairs into a swizzled tile: element [mt][nt][2*half+e] goes
// to row row0 + 16*mt + 8*half + lane/4, column 8*(chunk0 + nt) + 2*(lane%4) + e. Each group of 8
// rows x 4 lanes hits 8 different swizzled 16-byte slots: no bank conflicts.
template <typename Elem, class Tile, int MT, int NT>
CF2_DEVICE void store_accumulator(u32 tile_smem, const float (&acc)[MT][NT][4], int row0,
                                  int chunk0, int lane, float scale = 1.f) {
    for_each_accumulator_pair(acc, row0, lane, [&](int row, int nt, const float* pair) {
        store_4B_shared(tile_smem + Tile::offset(row, chunk0 + nt) + 4 * (lane % 4),
                        pack_pair<Elem>(pair[0] * scale, pair[1] * scale));
    });
}
