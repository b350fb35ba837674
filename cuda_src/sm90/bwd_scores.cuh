// The Hopper backward's score-tile pieces of a step (flash_bwd_sm90.cu), on the transposed tiles
// S^T and dP^T (keys as rows, queries as columns) in the consumers' registers: the mask of a
// boundary step, P^T from the forward's lse, dS^T, and dS^T's store into the shared dS tile.
// Every feature of the attention variant (variant.cuh: softcap, ALiBi, masks) acts at these
// points and nowhere else.
#pragma once
#include "hopper_primitives.cuh"
#include "variant.cuh"

// score_gradients' `keep` of every entry.
struct KeepAll {
    CF2_DEVICE bool operator()(int, int) const { return true; }
};

// P = exp2((score + ALiBi bias) * scale_log2 - lse_log2[query]) for one entry of S^T; `score` is
// the raw score (or softcap's t). ALiBi's distance query + diag - key comes from one float a
// thread plus a constant (`query_minus_key`): the positions themselves are not held, registers
// being scarcest here.
template <int FEATURES>
CF2_DEVICE float probability(float score, float row_lse, const AttentionVariant<FEATURES>& variant,
                             float scale_log2, float query_minus_key) {
    return fast_exp2(fmaf(variant.biased(score, query_minus_key, 0.f), scale_log2, -row_lse));
}

// S^T -> P^T in place (while dP^T is still being computed). acc[nt][2 half + e] is key
// key0 + 8 half, query query0 + 8 nt + e; `lse` points at lse_log2 of query0 in the stage, D follows QUERIES floats later.
// Without softcap only: with it, dS needs t as well as P, and P is formed in score_gradients.
template <class T, int FEATURES>
CF2_DEVICE void exponentiate(float (&acc)[T::S_TILES][4], const float* lse,
                             const AttentionVariant<FEATURES>& variant, float scale_log2, float offset0) {
#pragma unroll
    for (int nt = 0; nt < T::S_TILES; ++nt) {
        const float2 row_lse = *reinterpret_cast<const float2*>(lse + 8 * nt);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            acc[nt][i] = probability(acc[nt][i], i % 2 ? row_lse.y : row_lse.x, variant, scale_log2,
                                     offset0 + static_cast<float>(8 * nt + i % 2 - 8 * (i / 2)));
    }
}

// P^T and dS^T = P^T o (dP^T - D[query]) (times 1 - t^2 with softcap), packed as the A operands
// of dV += P^T dO and dK += dS^T Q: k16 step ks = queries 16 ks .. + 15 = n8 tiles 2 ks, 2 ks + 1,
// a[0] / a[2] rows g, a[1] / a[3] rows g + 8 (the forward's exp_pack order). `s` holds P
// (exponentiate) or, with softcap, t (P is formed here: one pass in which S^T and dP^T die as
// the fragments grow, so the consumer's peak stays at dK + dV + S^T + dP^T).
// `keep` (nt, i): whether entry acc[nt][i] stays; P = 0 (and dS) where not. KeepAll for every
// kernel but the one with a mask modifier (flash_bwd_sm90.cu), whose mask acts here.
template <typename Elem, class T, int FEATURES, class Keep = KeepAll>
CF2_DEVICE void score_gradients(u32 (&p_frag)[T::M_STEPS][4], u32 (&ds_frag)[T::M_STEPS][4],
                                const float (&s)[T::S_TILES][4], const float (&dp)[T::S_TILES][4],
                                const float* lse, const AttentionVariant<FEATURES>& variant,
                                float scale_log2, float offset0, const Keep& keep = Keep{}) {
    constexpr bool SOFTCAP = AttentionVariant<FEATURES>::SOFTCAP;
#pragma unroll
    for (int nt = 0; nt < T::S_TILES; ++nt) {
        const float2 d = *reinterpret_cast<const float2*>(lse + T::QUERIES + 8 * nt);
        float2 row_lse = make_float2(0.f, 0.f);
        if constexpr (SOFTCAP) row_lse = *reinterpret_cast<const float2*>(lse + 8 * nt);
        float prob[4], ds[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            prob[i] = s[nt][i];
            float grad = dp[nt][i] - (i % 2 ? d.y : d.x);
            if constexpr (SOFTCAP) {
                prob[i] = probability(s[nt][i], i % 2 ? row_lse.y : row_lse.x, variant, scale_log2,
                                      offset0 + static_cast<float>(8 * nt + i % 2 - 8 * (i / 2)));
                grad *= variant.dtanh(s[nt][i]);
            }
            if (!keep(nt, i)) prob[i] = 0.f;  // a select: P may be inf where the mask hides it
            ds[i] = prob[i] * grad;
        }
        p_frag[nt / 2][2 * (nt % 2)] = pack_pair<Elem>(prob[0], prob[1]);
        p_frag[nt / 2][2 * (nt % 2) + 1] = pack_pair<Elem>(prob[2], prob[3]);
        ds_frag[nt / 2][2 * (nt % 2)] = pack_pair<Elem>(ds[0], ds[1]);
        ds_frag[nt / 2][2 * (nt % 2) + 1] = pack_pair<Elem>(ds[2], ds[3]);
    }
}

// Stores this warp's dS^T (16 keys x BLOCK_M queries, as A fragments) transposed into the dS
// tile [queries x keys]: per k16 step one stmatrix .trans of four 8 x 8 matrices, a[j] = keys
// 8 (j % 2) .. + 7 x queries 16 ks + 8 (j / 2) .. + 7. Lane 8 j + c gives the address of the
// 16-byte chunk of query 16 ks + 8 (j / 2) + c holding those 8 keys; its swizzled slot differs
// for the 8 lanes of a matrix (consecutive rows), so the stores are free of bank conflicts.
// `key_chunk0`: the 8-key chunk of this warp's first key in the tile (8 c + 2 warp).
template <class T>
CF2_DEVICE void store_ds_transposed(u32 ds_tile, const u32 (&ds_frag)[T::M_STEPS][4],
                                    int key_chunk0, int lane) {
    const int j = lane / 8, c = lane % 8;
#pragma unroll
    for (int ks = 0; ks < T::M_STEPS; ++ks)
        stmatrix_x4_trans(swizzled_chunk<T::DS_PANEL_BYTES>(ds_tile, 16 * ks + 8 * (j / 2) + c,
                                                                key_chunk0 + j % 2),
                          ds_frag[ks]);
}
