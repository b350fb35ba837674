// dbias on the Hopper backward (FEATURE_BIAS_GRAD, with the bias as tiles; bias_grad.cuh says
// why dbias is dS): each step's dS tile [BLOCK_M queries x BLOCK_N keys], which the consumers
// store for dQ_i = dS K (bwd_scores.cuh, store_ds_transposed), is also dbias's block of the
// step's (query head, query block, key block). After dQ_i, every consumer thread copies 16-byte
// chunks of it (8 keys, rows of whole chunks: the bias's rows are 16-byte multiples) into the
// fp32 accumulator, as stores (one writer an element) or, where the bias is broadcast over
// batch or heads, vector reductions. The tile holds dS rounded to Elem, the bias's dtype: with
// one writer an element that is the value dbias gets anyway.
#pragma once
#include "hopper_primitives.cuh"
#include "bias_grad.cuh"

// `ds_tile`: the step's dS tile; rows from `row0` (query index) of query head `head`, keys from
// `key_first`; `thread`: the consumer thread's index (0 .. CONSUMER_THREADS - 1). Rows at or
// past seqlen_q and keys at or past seqlen_k are left out. Needs the accumulator's keys
// contiguous (stride3 == 1) and its rows 16-byte aligned (the dispatch's seqlen_k % 8 == 0).
template <typename Elem, class T>
CF2_DEVICE void store_bias_grad_tile(const BiasGrad& g, u32 ds_tile, int batch, int head,
                                     int row0, int key_first, int seqlen_q, int seqlen_k,
                                     int thread) {
    constexpr int ROW_CHUNKS = T::BLOCK_N_PANELS * 8;  // 16-byte chunks of 8 keys a row
    constexpr int CHUNKS = T::QUERIES * ROW_CHUNKS;
    static_assert(CHUNKS % T::CONSUMER_THREADS == 0, "whole chunks a consumer thread");
    float* const base = g.data + batch * g.stride0 + head * g.stride1;
#pragma unroll
    for (int i = 0; i < CHUNKS / T::CONSUMER_THREADS; ++i) {
        // Consecutive threads take consecutive chunks of a row: 8 of them read the 8 slots of
        // a swizzled 128-byte row (no bank conflicts) and write 256 contiguous bytes.
        const int c = thread + i * T::CONSUMER_THREADS;
        const int row = c / ROW_CHUNKS, chunk = c % ROW_CHUNKS;
        const int query = row0 + row, key = key_first + 8 * chunk;
        if (query >= seqlen_q || key >= seqlen_k) continue;
        u32 w[4];
        load_16B_shared(w, swizzled_chunk<T::DS_PANEL_BYTES>(ds_tile, row, chunk));
        float v[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[2 * e] = to_float<Elem>(static_cast<u16>(w[e] & 0xffffu));
            v[2 * e + 1] = to_float<Elem>(static_cast<u16>(w[e] >> 16));
        }
        float* const dst = base + query * g.stride2 + key;
        if (g.accumulate) {
            atomic_add_4(dst, v[0], v[1], v[2], v[3]);
            atomic_add_4(dst + 4, v[4], v[5], v[6], v[7]);
        } else {
            const u32 lo[4] = {__float_as_uint(v[0]), __float_as_uint(v[1]),
                               __float_as_uint(v[2]), __float_as_uint(v[3])};
            const u32 hi[4] = {__float_as_uint(v[4]), __float_as_uint(v[5]),
                               __float_as_uint(v[6]), __float_as_uint(v[7])};
            store_16B_global(dst, lo);
            store_16B_global(dst + 4, hi);
        }
    }
}
