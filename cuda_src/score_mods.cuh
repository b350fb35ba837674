// flash-attn's optional score modifiers, softcap and ALiBi, compiled in only when a kernel's
// FEATURES template argument asks for them: the plain kernels carry none of this code.
//
// The kernels work on raw scores s = q.k. With these features the scores the softmax sees are
//   softcap: s' = softcap * tanh(s * scale / softcap)     ALiBi: s' += -slope * |i + diag - j|
// (diag = seqlen_k - seqlen_q). Both are kept in "score units" so that the softmax code is
// unchanged: with softcap the kernels hold t = tanh(s * scale / softcap) and the host passes the
// softmax scale `softcap` (s' = softcap * t); the ALiBi bias is divided by that effective scale
// (slope_units). Masking comes after both (-inf stays -inf).
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): absolute error ~1e-7 (tanh.approx.f32's relative
// 2^-11 would be multiplied by the softcap). Saturates to +-1 through ex2's +inf / 0.
CF2_DEVICE float tanh_accurate(float x) {
    const float e = fast_exp2(x * 2.8853900817779268f);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
    return 1.f - 2.f * r;
}

template <int FEATURES>
struct ScoreMods {
    static constexpr bool SOFTCAP = (FEATURES & FEATURE_SOFTCAP) != 0;
    static constexpr bool ALIBI = (FEATURES & FEATURE_ALIBI) != 0;

    float softcap_scale;  // softmax_scale / softcap: raw score -> tanh argument
    float slope_units;    // -slope / effective softmax scale, for the current (batch, head)
    float diag;           // seqlen_k - seqlen_q

    CF2_DEVICE ScoreMods(const VariantParams& params, int seqlen_q, int seqlen_k)
        : softcap_scale(params.softcap_scale), slope_units(0.f),
          diag(static_cast<float>(seqlen_k - seqlen_q)) {}

    // Loads the slope of (batch, head): alibi_slopes[batch * alibi_batch_stride + head], times
    // alibi_to_units = 1 / effective softmax scale, negated.
    CF2_DEVICE void select_head(const VariantParams& params, int batch, int head) {
        if constexpr (ALIBI)
            slope_units = -params.alibi_slopes[batch * params.alibi_batch_stride + head] *
                          params.alibi_to_units;
    }

    // Score `s` of query `row`, key `key` plus its ALiBi bias (score units); `s` itself without
    // ALiBi (no instruction: s + 0.f is not an identity for -0.f, so it would stay). Positions
    // are exact in fp32 below 2^24.
    CF2_DEVICE float biased(float s, float row, float key) const {
        if constexpr (ALIBI) return fmaf(slope_units, fabsf(row + diag - key), s);
        return s;
    }

    // s[mt][nt][2*half + e] is query row0 + 16 mt + 8 half, key key0 + 8 nt + e (accumulator
    // layout): t = tanh(s * softcap_scale) in place.
    template <int MT, int NT>
    CF2_DEVICE void apply_softcap(float (&s)[MT][NT][4]) const {
        if constexpr (SOFTCAP) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] = tanh_accurate(s[mt][nt][e] * softcap_scale);
        }
    }

    // Forward: softcap, then the ALiBi bias, in place, before masking.
    template <int MT, int NT>
    CF2_DEVICE void apply(float (&s)[MT][NT][4], int row0, int key0) const {
        apply_softcap(s);
        if constexpr (ALIBI) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float row = static_cast<float>(row0 + 16 * mt + 8 * half);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            s[mt][nt][2 * half + e] = biased(
                                s[mt][nt][2 * half + e], row, static_cast<float>(key0 + 8 * nt + e));
                }
        }
    }

    // d s' / d(s * scale) / softcap = 1 - t^2 for the backward's dS (1 without softcap). A masked
    // t = -inf (P = 0) gives 0 rather than -inf, so that P * dtanh stays 0.
    CF2_DEVICE static float dtanh(float t) {
        if constexpr (SOFTCAP) return fmaxf(1.f - t * t, 0.f);
        return 1.f;
    }
};
