// dbias, the gradient of an additive bias (attention_backward with bias=, FEATURE_BIAS_GRAD):
// the bias is added to the scores the softmax sees (cuflash2.reference: after softcap and ALiBi,
// before the score modifier and the mask), so dL/dbias[b, h, i, j] is dS_ij, the main kernel's
// gradient at the score modifier's input, which it forms once for every (row, key) of the tiles
// it visits. Those it skips see no key: their dbias stays the zero it was given. Written from
// phase A's fp32 dS fragment (m16n8k16 accumulator layout: rows lane / 4 + 8 half, keys
// 2 (lane % 4) + e), positions at or past the sequence's lengths left out.
#pragma once
#include "mma_primitives.cuh"
#include "kernel_params.cuh"

// The kernels without FEATURE_BIAS_GRAD hold this in place of a BiasGrad (never read).
struct NoBiasGrad {};

template <int MT, int NT>
CF2_DEVICE void store_bias_grad(const NoBiasGrad&, const float (&)[MT][NT][4], int, int, int,
                                int, int, int) {}

// ds: a warp's dS fragment of MT x NT m16n8 tiles; row0 / key0: its thread's first row and key
// (lane / 4 and 2 (lane % 4) included).
template <int MT, int NT>
CF2_DEVICE void store_bias_grad(const BiasGrad& g, const float (&ds)[MT][NT][4], int batch,
                                int head, int row0, int key0, int seqlen_q, int seqlen_k) {
    float* const base = g.data + batch * g.stride0 + head * g.stride1;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + 16 * mt + 8 * half;
            if (row >= seqlen_q) continue;
            float* const dst_row = base + row * g.stride2;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = key0 + 8 * nt + e;
                    if (key >= seqlen_k) continue;
                    float* const dst = dst_row + key * g.stride3;
                    const float value = ds[mt][nt][2 * half + e];
                    if (g.accumulate)
                        atomicAdd(dst, value);
                    else
                        *dst = value;
                }
        }
}
