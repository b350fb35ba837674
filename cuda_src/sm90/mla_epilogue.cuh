// The MLA decode kernel's epilogue (flash_mla_decode_sm90.cu, the consumer warpgroups): after
// the mainloop (sm90/mla_mainloop.cuh), 1 / l once and each consumer's half of O's columns with
// the rows' lse; with splits, each split's normalised partial result and the decode kernel's
// merge of the splits (split_merge.cuh: the barrier through L2, then every split merging its
// share of the (row, 4-column chunk) items).
#pragma once
#include "hopper_primitives.cuh"
#include "online_softmax.cuh"
#include "split_merge.cuh"
#include "output_store.cuh"
#include "sm90/mla_traits.cuh"
#include "sm90/mla_mainloop.cuh"

template <typename Elem, class T>
CF2_DEVICE void store_latent_block(const DecodeParams& p, const MlaRowBlock& b, int m_block,
                                   int split, int consumer, int ctid,
                                   const float (&acc_o)[1][T::D_TILES][4],
                                   const OnlineSoftmax<1>& softmax) {
    constexpr float LN2 = 0.6931471805599453f;
    const int lane = ctid % 32, warp = (ctid / 32) % 4;
    // Both consumers hold the same (m, l) of a row (the same maxima; the mainloop added the
    // other consumer's sums to this thread's); the lse in log2 units, -inf
    // for a row that saw no key (its O then 0).
    float lse2[2], inv_sum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float l = quad_sum(softmax.row_sum[half]);
        const bool seen = softmax.row_max[half] != neg_inf() && l > 0.f;
        lse2[half] = seen ? softmax.row_max[half] * p.scale_log2 + __log2f(l) : neg_inf();
        inv_sum[half] = seen ? 1.f / l : 0.f;
    }
    // This thread's columns of its rows: 8 dt + 2 (lane % 4), + 1 of the consumer's half.
    const int col0 = consumer * T::DIM_V_EACH + 2 * (lane % 4);
    const bool writes_lse = consumer == 0 && lane % 4 == 0;
    if (p.num_splits == 1) {
        // (Straight from the accumulators, a quad's 16 bytes a row: O is 64 KiB a CTA, read
        // against the megabytes of cache it streams.)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = 16 * warp + 8 * half + lane / 4;
            if (row >= b.rows) continue;
            const int packed = b.row_first + row;
            const int position = packed / b.group, head = packed % b.group;
            u16* out = p.out + b.batch * p.o_batch_stride + position * p.o_row_stride +
                       head * p.o_head_stride + col0;
#pragma unroll
            for (int dt = 0; dt < T::D_TILES; ++dt)
                *reinterpret_cast<u32*>(out + 8 * dt) =
                    pack_pair<Elem>(acc_o[0][dt][2 * half] * inv_sum[half],
                                    acc_o[0][dt][2 * half + 1] * inv_sum[half]);
            if (writes_lse)
                p.lse[(static_cast<i64>(b.batch) * p.nheads + head) * p.seqlen_q + position] =
                    lse2[half] == neg_inf() ? pos_inf() : lse2[half] * LN2;
        }
        return;
    }
    // This split's normalised result in the workspace: (row block, split, row, HEAD_DIM_V) fp32
    // and its lse (log2), as the decode kernel lays them out (one KV head).
    const int group_id = b.batch * p.num_m_blocks + m_block;
    const i64 group_row0 = static_cast<i64>(group_id) * p.num_splits * T::BLOCK_M;
    const i64 split_row0 = group_row0 + static_cast<i64>(split) * T::BLOCK_M;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = 16 * warp + 8 * half + lane / 4;
        if (row >= b.rows) continue;
        float* o_row = p.o_partial + (split_row0 + row) * T::HEAD_DIM_V + col0;
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt)
            *reinterpret_cast<float2*>(o_row + 8 * dt) =
                make_float2(acc_o[0][dt][2 * half] * inv_sum[half],
                            acc_o[0][dt][2 * half + 1] * inv_sum[half]);
        if (writes_lse) p.lse_partial[split_row0 + row] = lse2[half];
    }
    // The splits of the row block meet at its counter (the launch is cooperative), then each
    // merges its share of the block's items; the producer warpgroup has left, so the consumers
    // synchronise among themselves.
    SplitBarrier barrier{p.split_counters + group_id};
    const auto consumers_sync = [] {
        named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
    };
    barrier.arrive_among(p.num_splits, split, ctid == 0, consumers_sync);
    const auto wait_for_splits = [&] { barrier.wait_among(ctid == 0, consumers_sync); };
    const auto locate_output = [&](int r, int chunk) {
        const int packed = b.row_first + r;
        const int position = packed / b.group, head = packed % b.group;
        u16* out = p.out + b.batch * p.o_batch_stride + position * p.o_row_stride +
                   head * p.o_head_stride + 4 * chunk;
        float* lse = chunk == 0
            ? p.lse + (static_cast<i64>(b.batch) * p.nheads + head) * p.seqlen_q + position
            : nullptr;
        return OutputChunk<Elem>{out, lse};
    };
    const GlobalPartials<T::HEAD_DIM_V, T::BLOCK_M> partials{
        p.o_partial + group_row0 * T::HEAD_DIM_V, p.lse_partial + group_row0};
    if (p.num_splits <= SMALL_MERGE_SPLITS)
        merge_splits<T::HEAD_DIM_V, T::CONSUMER_THREADS, SMALL_MERGE_LANES, MERGE_SLOTS>(
            partials, p.num_splits, split, b.rows, T::HEAD_DIM_V, ctid, locate_output,
            wait_for_splits);
    else
        merge_splits<T::HEAD_DIM_V, T::CONSUMER_THREADS, 32, MERGE_SLOTS>(
            partials, p.num_splits, split, b.rows, T::HEAD_DIM_V, ctid, locate_output,
            wait_for_splits);
}
