// The FP8 forward's descale factors of one work tile (e4m3_tag; docs/FP8_FORWARD.md). The e4m3
// products are exact and a factor of a sum is the factor of each term, so the factors need no
// per-element work: q's and k's multiply the softmax's scale (S = Q K^T is in units of
// q_descale * k_descale), v's multiplies 1 / l in the epilogue (O = P V is in units of
// v_descale). The lse is then that of the dequantised scores.
#pragma once
#include "kernel_params.cuh"

struct TileDescales {
    float qk;  // q_descale * k_descale: the unit of S
    float v;   // v_descale: the unit of P V
};

// The factors of (batch, kv_head) for e4m3 inputs; 1 and 1 (never read) for the other elements.
// `batch` is the work tile's (FwdWorkTile::batch): with FEATURE_VARLEN the sequence's index, so
// varlen calls read FlashAttention-3's (num_sequences, nheads_kv) factors by sequence.
template <typename Elem>
CF2_DEVICE TileDescales tile_descales(const E4m3Descales& d, int batch, int kv_head) {
    if constexpr (Elem::IS_E4M3) {
        const float q = d.q[batch * d.q_batch_stride + kv_head * d.q_head_stride];
        const float k = d.k[batch * d.k_batch_stride + kv_head * d.k_head_stride];
        const float v = d.v[batch * d.v_batch_stride + kv_head * d.v_head_stride];
        return {q * k, v};
    } else {
        return {1.f, 1.f};
    }
}
