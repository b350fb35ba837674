// Dropout on the attention probabilities, compiled in with FEATURE_DROPOUT: a counter-based
// random mask (Philox4x32-10, Salmon et al., SC'11), so the forward and the backward draw the
// same mask from (seed, offset) without storing it.
//
// Element (batch entry b, head h, query q, key k) is kept iff a 16-bit uniform u < keep_threshold
// (= round((1 - p) * 65536)). One Philox call gives eight such uniforms, laid out to match the
// eight values a thread holds of a 16 x 16 block of an mma accumulator tile (rows g, g + 8 and key
// columns 2t, 2t + 1, 8 + 2t, 8 + 2t + 1 for lane 4g + t), so every kernel makes one call per
// 16 x 16 block per thread:
//   counter = ((k / 16) * 4 + (k % 8) / 2, (q / 16) * 8 + q % 8, b * nheads + h, offset)
//   key     = (seed low 32 bits, seed high 32 bits)
//   uniform j = ((q / 8) % 2) * 4 + ((k / 8) % 2) * 2 + k % 2, the (j % 2)-th 16-bit half of
//   output word j / 2.
// cuflash2.dropout_mask evaluates the same function for every element (for tests), and
// cuflash2/dropout.py has a NumPy implementation of it.
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

struct Philox4x32 {
    u32 c0, c1, c2, c3;
};

CF2_DEVICE Philox4x32 philox4x32_10(Philox4x32 c, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c.c0), lo0 = 0xD2511F53u * c.c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.c2), lo1 = 0xCD9E8D57u * c.c2;
        c = Philox4x32{hi1 ^ c.c1 ^ k0, lo1, hi0 ^ c.c3 ^ k1, lo0};
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

struct Dropout {
    u32 seed_lo, seed_hi, offset;
    u32 keep_threshold;  // keep iff the 16-bit uniform is below it (65536: keep all)
    u32 batch_head;      // b * nheads + h

    Dropout() = default;
    CF2_DEVICE Dropout(const DropoutParams& params, u32 batch_head_)
        : seed_lo(params.seed_lo), seed_hi(params.seed_hi), offset(params.offset),
          keep_threshold(params.keep_threshold), batch_head(batch_head_) {}

    // Keep bits (bit j = uniform j above) of the 16 x 16 block whose first row is q0 and first
    // key k0 (multiples of 16), for lane `lane`.
    CF2_DEVICE u32 keep_bits(int q0, int k0, int lane) const {
        const Philox4x32 ctr{static_cast<u32>(k0 / 16 * 4 + lane % 4),
                             static_cast<u32>(q0 / 16 * 8 + lane / 4), batch_head, offset};
        const Philox4x32 r = philox4x32_10(ctr, seed_lo, seed_hi);
        const u32 words[4] = {r.c0, r.c1, r.c2, r.c3};
        u32 bits = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 u = (words[j / 2] >> (16 * (j % 2))) & 0xffffu;
            bits |= static_cast<u32>(u < keep_threshold) << j;
        }
        return bits;
    }
};

// Accumulator element [2 * half + e] of n8 tile `tile` (0 or 1) of a 16 x 16 block: its uniform.
CF2_DEVICE int dropout_index(int half, int tile, int e) { return half * 4 + tile * 2 + e; }
