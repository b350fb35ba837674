// Online softmax of FlashAttention-2 for one warp's rows.
//
// Per row we keep the running max m of the raw scores and the running sum l of
// exp(scale * (s - m)); the output accumulator stays *unnormalised* and is divided by l once,
// after the last KV tile. The softmax scale is folded into the exponent: with
// scale_log2 = scale * log2(e), exp(scale * (s - m)) = exp2(s * scale_log2 - m * scale_log2), one
// FFMA and one MUFU.EX2 per score.
//
// Lazy rescaling: when a tile raises a row's max by at most RESCALE_THRESHOLD (in log2 units) the
// old max is kept, so probabilities may reach 2^RESCALE_THRESHOLD = 256 (far inside fp16/bf16 and
// fp32 range) and the O accumulator needs no rescale. Since m, l and O always refer to the same
// max, the result is the same softmax; it only saves the O *= correction multiplies on most tiles.
// LAZY = false (update_max, fold_max) moves the max whenever a tile raises it, as FlashAttention-2
// does: the FP8 forward's, whose probabilities are rounded to e4m3, so that a row's largest one
// is exactly a power of two rather than 2^x for some x in (0, 8], off by up to e4m3's 6%
// (docs/FP8_FORWARD.md).
// P_SCALE_LOG2 (fold_max, update_max, finalize; the FP8 forward's E4M3_P_SCALE_LOG2, else 0):
// every probability is taken 2^P_SCALE_LOG2 times larger, exp2(s * scale_log2 - m * scale_log2
// + P_SCALE_LOG2), so that e4m3 keeps the mantissa of the small ones. O and l carry the factor
// alike (it cancels in O / l); the lse takes it out. (A sink would have to enter the sum as
// 2^P_SCALE_LOG2: the FP8 forward takes none.)
#pragma once
#include "mma_primitives.cuh"

#define CF2_RESCALE_THRESHOLD 8.0f

template <int M_TILES>
struct OnlineSoftmax {
    // Each thread holds rows g and g + 8 of every m16 tile of its warp (g = lane / 4).
    static constexpr int ROWS = 2 * M_TILES;
    float row_max[ROWS];  // raw scores, -inf while the row has seen no key
    float row_sum[ROWS];  // this thread's partial sum; the quad's four are added at the end
    float max_scaled[ROWS];  // row_max * scale_log2 (0 while -inf), for the current tile

    CF2_DEVICE OnlineSoftmax() {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            row_max[r] = neg_inf();
            row_sum[r] = 0.f;
        }
    }

    // A learnable sink (variant.cuh): one more term in every row's denominator, with no value.
    // It enters as the state of a row that has already seen one key, of score `sink` (raw score
    // units, those of row_max) and value 0: the running max starts at the sink and the sum at 1,
    // which one thread of the row holds (`holds_sum`: the quad's partial sums are added at the
    // end). The online softmax then counts it like any key: rescaled when a tile raises the max,
    // in l at the end and in the lse; a row that sees no key ends with out 0 and lse = the sink.
    // Called before the first tile.
    // (A sink of -inf is no sink: its sum starts at 0.)
    CF2_DEVICE void start_with_sink(float sink, bool holds_sum) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            row_max[r] = sink;
            row_sum[r] = holds_sum && sink != neg_inf() ? 1.f : 0.f;
        }
    }

    // Step 1 of a tile: folds the tile's row maxima into the running max and rescales the output
    // accumulator and the sums where the max moved. Leaves the scaled max for step 2.
    // It is fold_max then rescale_o; the Hopper kernel's intra-warpgroup overlap runs the two
    // apart (O is the accumulator of an in-flight wgmma in between).
    template <bool LAZY = true, int P_SCALE_LOG2 = 0, int N_TILES, int D_TILES>
    CF2_DEVICE void update_max(const float (&s)[M_TILES][N_TILES][4],
                               float (&acc_o)[M_TILES][D_TILES][4], float scale_log2) {
        float correction[ROWS];
        const bool any_rescale = fold_max<LAZY, P_SCALE_LOG2>(s, scale_log2, correction);
        rescale_o(acc_o, correction, any_rescale);
    }

    // Step 1a: folds the tile's row maxima into the running max and rescales the sums where it
    // moved; `correction` gets each row's factor for O (1 where the max stayed). Returns whether
    // any row of the warp moved (warp-uniform: the O pass is skipped otherwise). Reads only the
    // scores, so it may run while a wgmma is still writing O.
    template <bool LAZY = true, int P_SCALE_LOG2 = 0, int N_TILES>
    CF2_DEVICE bool fold_max(const float (&s)[M_TILES][N_TILES][4], float scale_log2,
                             float (&correction)[ROWS]) {
        bool any_rescale = false;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = 2 * mt + half;
                float tile_max = row_max[r];
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
                    tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
                tile_max = quad_max(tile_max);
                // -inf - -inf is NaN and NaN > x is false: a row with no key yet keeps m = -inf.
                const bool rescale =
                    (tile_max - row_max[r]) * scale_log2 > (LAZY ? CF2_RESCALE_THRESHOLD : 0.f);
                correction[r] = rescale ? fast_exp2((row_max[r] - tile_max) * scale_log2) : 1.f;
                if (rescale) row_max[r] = tile_max;
                any_rescale |= rescale;
                row_sum[r] *= correction[r];
                // Rows that have seen no key yet: every score is -inf, use 0 so exp2 gives 0.
                max_scaled[r] = row_max[r] == neg_inf() ? 0.f : row_max[r] * scale_log2;
                if constexpr (P_SCALE_LOG2 != 0) max_scaled[r] -= P_SCALE_LOG2;
            }
        }
        return __any_sync(0xffffffffu, any_rescale);
    }

    // Step 1b: O *= correction, row by row; `any_rescale` is fold_max's answer (warp-uniform
    // branch: no pass at all when no row of the warp moved).
    template <int D_TILES>
    CF2_DEVICE static void rescale_o(float (&acc_o)[M_TILES][D_TILES][4],
                                     const float (&correction)[ROWS], bool any_rescale) {
        if (any_rescale) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= correction[2 * mt + e / 2];
        }
    }

    // Step 2, one k16 slice of P at a time (n8 tiles `lo` and `hi` of m-tile mt): P = exp2(s *
    // scale_log2 - max_scaled) added to the row sums and packed to 16 bits in the A-operand
    // layout of m16n8k16 (the m16n8 accumulator layout of two adjacent n8 tiles is exactly that
    // layout once pairs are packed), so P goes from the score registers straight into P V.
    // With DROPOUT, `keep` holds the dropout keep bits of this 16 x 16 block (dropout.cuh's
    // order): dropped probabilities still count in the row sums (the softmax normalisation) but
    // enter P V as 0; the 1 / (1 - p) factor is applied to the output at the end.
    template <typename Elem, bool DROPOUT = false>
    CF2_DEVICE void exp_pack(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4], int mt,
                             float scale_log2, u32 keep = 0xffu) {
        float p[8];
        exp_probabilities<DROPOUT>(p, lo, hi, mt, scale_log2, keep);
        a[0] = pack_pair<Elem>(p[0], p[1]);  // row g,     keys 2t, 2t+1
        a[1] = pack_pair<Elem>(p[2], p[3]);  // row g + 8, keys 2t, 2t+1
        a[2] = pack_pair<Elem>(p[4], p[5]);  // row g,     keys 8 + 2t, 8 + 2t + 1
        a[3] = pack_pair<Elem>(p[6], p[7]);  // row g + 8, keys 8 + 2t, 8 + 2t + 1
    }

    // exp_pack's probabilities in fp32, unpacked: p[e] is row half e / 2 of tile `lo`, key
    // 2t + e % 2, p[4 + e] the same of tile `hi` (the float32 kernels' P, tf32_primitives.cuh).
    template <bool DROPOUT = false>
    CF2_DEVICE void exp_probabilities(float (&p)[8], const float (&lo)[4], const float (&hi)[4],
                                      int mt, float scale_log2, u32 keep = 0xffu) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float m = max_scaled[2 * mt + e / 2];
            p[e] = fast_exp2(fmaf(lo[e], scale_log2, -m));
            p[4 + e] = fast_exp2(fmaf(hi[e], scale_log2, -m));
        }
        row_sum[2 * mt] += (p[0] + p[1]) + (p[4] + p[5]);
        row_sum[2 * mt + 1] += (p[2] + p[3]) + (p[6] + p[7]);
        if constexpr (DROPOUT) {
            // p[e] is row half e / 2, tile 0 (lo), key e % 2; p[4 + e] the same of tile 1 (hi).
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (!((keep >> (4 * (e / 2) + e % 2)) & 1u)) p[e] = 0.f;
                if (!((keep >> (4 * (e / 2) + 2 + e % 2)) & 1u)) p[4 + e] = 0.f;
            }
        }
    }

    // Step 2 split in two, for the Hopper kernel's intra-warpgroup overlap, where the P
    // registers are still read by the previous tile's P V wgmma while the exponentials run:
    // exp_scores turns the scores into probabilities in place (fp32, in the score registers;
    // added to the row sums as exp_pack adds them, one k16 slice at a time), and pack_p packs a
    // k16 slice of them into the A-operand layout once the P registers are free.
    template <int N_TILES>
    CF2_DEVICE void exp_scores(float (&s)[M_TILES][N_TILES][4], float scale_log2) {
        static_assert(N_TILES % 2 == 0, "whole k16 slices");
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int ks = 0; ks < N_TILES / 2; ++ks) {
                float (&lo)[4] = s[mt][2 * ks];
                float (&hi)[4] = s[mt][2 * ks + 1];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float m = max_scaled[2 * mt + e / 2];
                    lo[e] = fast_exp2(fmaf(lo[e], scale_log2, -m));
                    hi[e] = fast_exp2(fmaf(hi[e], scale_log2, -m));
                }
                row_sum[2 * mt] += (lo[0] + lo[1]) + (hi[0] + hi[1]);
                row_sum[2 * mt + 1] += (lo[2] + lo[3]) + (hi[2] + hi[3]);
            }
        }
    }

    // Probabilities of n8 tiles `lo` and `hi` (one k16 slice) packed as exp_pack packs them.
    template <typename Elem>
    CF2_DEVICE static void pack_p(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
        a[0] = pack_pair<Elem>(lo[0], lo[1]);  // row g,     keys 2t, 2t+1
        a[1] = pack_pair<Elem>(lo[2], lo[3]);  // row g + 8, keys 2t, 2t+1
        a[2] = pack_pair<Elem>(hi[0], hi[1]);  // row g,     keys 8 + 2t, 8 + 2t + 1
        a[3] = pack_pair<Elem>(hi[2], hi[3]);  // row g + 8, keys 8 + 2t, 8 + 2t + 1
    }

    // 1/l for the final normalisation (0 for a row that saw no key, whose output is 0) and the
    // natural-log logsumexp of the scaled scores (+inf for such a row), per row of this thread.
    // P_SCALE_LOG2: the sums hold 2^P_SCALE_LOG2 times the probabilities (fold_max).
    template <int P_SCALE_LOG2 = 0>
    CF2_DEVICE void finalize(float softmax_scale, float (&inv_sum)[ROWS], float (&lse)[ROWS]) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float sum = quad_sum(row_sum[r]);
            const bool seen = sum > 0.f;
            inv_sum[r] = seen ? 1.f / sum : 0.f;
            if constexpr (P_SCALE_LOG2 != 0) {
                constexpr float P_SCALE_LN = P_SCALE_LOG2 * 0.6931471805599453f;
                lse[r] = seen ? row_max[r] * softmax_scale + (logf(sum) - P_SCALE_LN) : pos_inf();
            } else {
                lse[r] = seen ? row_max[r] * softmax_scale + logf(sum) : pos_inf();
            }
        }
    }
};

// The same online softmax for at most 8 query rows held on the n side of the mma (the decode
// kernel's rows-on-n tiles, flash_decode.cu): scores come transposed, S^T = K Q^T, one m16 tile
// of keys by the n8 tile of rows, so no mma work goes to padding rows. Each thread holds rows
// 2(l%4) and 2(l%4)+1 (l = lane); a row's keys are spread over the 8 lanes of equal l%4 (and
// over the m16 tiles), so its max is reduced across lanes 4, 8, 16 apart, and so are its sums,
// once, at the end. O is transposed too, O^T = V^T P^T: element e of each m16 tile of head-dim
// columns belongs to row 2(l%4) + e%2.
struct OnlineSoftmaxN8 {
    float row_max[2];     // raw scores, -inf while the row has seen no key
    float row_sum[2];     // this thread's partial sum over its keys
    float max_scaled[2];  // row_max * scale_log2 (0 while -inf), for the current tile

    CF2_DEVICE OnlineSoftmaxN8() {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            row_max[c] = neg_inf();
            row_sum[c] = 0.f;
        }
    }

    CF2_DEVICE static float max_over_keys(float x) {
#pragma unroll
        for (int step = 4; step < 32; step *= 2)
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, step));
        return x;
    }

    // Step 1 of a tile (OnlineSoftmax::update_max): the tile's row maxima into the running max,
    // O^T and the sums rescaled where it moved past the threshold.
    template <int KEY_TILES, int D_TILES16>
    CF2_DEVICE void update_max(const float (&s)[KEY_TILES][4], float (&acc_o)[D_TILES16][4],
                               float scale_log2) {
        float correction[2];
        bool any_rescale = false;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float tile_max = row_max[c];
#pragma unroll
            for (int kt = 0; kt < KEY_TILES; ++kt)
                tile_max = fmaxf(tile_max, fmaxf(s[kt][c], s[kt][2 + c]));
            tile_max = max_over_keys(tile_max);
            // -inf - -inf is NaN and NaN > x is false: a row with no key yet keeps m = -inf.
            const bool rescale = (tile_max - row_max[c]) * scale_log2 > CF2_RESCALE_THRESHOLD;
            correction[c] = rescale ? fast_exp2((row_max[c] - tile_max) * scale_log2) : 1.f;
            if (rescale) row_max[c] = tile_max;
            any_rescale |= rescale;
            row_sum[c] *= correction[c];
            max_scaled[c] = row_max[c] == neg_inf() ? 0.f : row_max[c] * scale_log2;
        }
        if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
            for (int dt = 0; dt < D_TILES16; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[dt][e] *= correction[e % 2];
        }
    }

    // Step 2 for one m16 tile of keys: P^T = exp2(s * scale_log2 - max_scaled) added to the row
    // sums, packed to 16 bits and transposed in registers (movmatrix) into the B operand of
    // O^T += V^T P^T: keys 0-7 of the tile in b[0], keys 8-15 in b[1], row l/4.
    template <typename Elem>
    CF2_DEVICE void exp_pack(u32 (&b)[2], const float (&s)[4], float scale_log2) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = fast_exp2(fmaf(s[e], scale_log2, -max_scaled[e % 2]));
        row_sum[0] += p[0] + p[2];
        row_sum[1] += p[1] + p[3];
        b[0] = movmatrix_trans(pack_pair<Elem>(p[0], p[1]));  // key l/4: rows 2(l%4), +1
        b[1] = movmatrix_trans(pack_pair<Elem>(p[2], p[3]));  // key 8 + l/4
    }

    // Row c's sum over all its keys (every lane of the row's l%4 gets it).
    CF2_DEVICE float total_sum(int c) const {
        float x = row_sum[c];
#pragma unroll
        for (int step = 4; step < 32; step *= 2) x += __shfl_xor_sync(0xffffffffu, x, step);
        return x;
    }
};
