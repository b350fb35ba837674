// The Hopper backward's dQ path (flash_bwd_sm90.cu), consumer side: a consumer's dQ_i columns to
// the fp32 accumulator dq_accum, staged in shared memory for the dQ thread's bulk reduction or
// added by vector reductions (in the key block's turn in deterministic mode).
#pragma once
#include "hopper_primitives.cuh"
#include "dq_accum.cuh"

// Adds this warp's share of dQ_i[rows, COL0 .. COL0 + N) to dq_accum: rows 16 warp + lane / 4
// (+ 8) from `dq_block` (the consumer's first dQ row), 16 columns per vector reduction in
// dq_accum.cuh's interleaved order (the wgmma accumulator is the m16n8 layout per warp, as in
// flash_bwd.cu's phase C).
template <int HEAD_DIM, int COL0, int N>
CF2_DEVICE void add_dq(float* dq_block, const float (&acc)[N / 8][4], int warp, int lane) {
    float* rows = dq_block + (16 * warp + lane / 4) * HEAD_DIM + COL0 + 4 * (lane % 4);
#pragma unroll
    for (int np = 0; np < N / 16; ++np)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            atomic_add_4(rows + 8 * half * HEAD_DIM + 16 * np, acc[2 * np][2 * half],
                         acc[2 * np][2 * half + 1], acc[2 * np + 1][2 * half],
                         acc[2 * np + 1][2 * half + 1]);
}

// Stores this warp's share of dQ_i[rows, COL0 .. COL0 + N) into the staged dQ tile at `dq_tile`
// (its BLOCK_M rows of HEAD_DIM floats are the block's rows of dq_accum; `dq_tile`: the
// consumer's first dQ row; add_dq's order and offsets),
// for the bulk reduction that adds the whole tile to dq_accum.
template <int HEAD_DIM, int COL0, int N>
CF2_DEVICE void stage_dq(u32 dq_tile, const float (&acc)[N / 8][4], int warp, int lane) {
    const u32 rows = dq_tile + 4 * ((16 * warp + lane / 4) * HEAD_DIM + COL0 + 4 * (lane % 4));
#pragma unroll
    for (int np = 0; np < N / 16; ++np)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            store_16B_shared(rows + 4 * (8 * half * HEAD_DIM + 16 * np), acc[2 * np][2 * half],
                             acc[2 * np][2 * half + 1], acc[2 * np + 1][2 * half],
                             acc[2 * np + 1][2 * half + 1]);
}

// This consumer's dQ_i columns to dq_accum: staged in `dq_tile` (DQ_STAGED; the bulk reduction
// is issued by the producer's dQ thread once every consumer thread arrived on `dq_full`, after
// `dq_empty` said the buffer's previous reduction had read it), or by vector reductions; with
// ORDERED vector reductions (deterministic mode above d=128) in the key block's turn: after
// `dq_empty` (the dQ thread's arrival once the turn came), then every consumer thread arrives on
// `dq_full` (release at CTA scope), after which the dQ thread passes the turn on.
template <class T, int COL0, int N, bool ORDERED>
CF2_DEVICE void write_dq(const float (&acc)[N / 8][4], float* dq_block, u32 dq_tile, u32 dq_full,
                         u32 dq_empty, u32 empty_parity, bool add, int warp, int lane) {
    if constexpr (T::DQ_STAGED) {
        mbarrier_wait(dq_empty, empty_parity);
        stage_dq<T::DIM, COL0, N>(dq_tile, acc, warp, lane);
        fence_proxy_async_shared();  // the generic stores, before the bulk reduction reads them
        mbarrier_arrive(dq_full);
    } else if constexpr (ORDERED) {
        mbarrier_wait(dq_empty, empty_parity);
        if (add) add_dq<T::DIM, COL0, N>(dq_block, acc, warp, lane);
        mbarrier_arrive(dq_full);
    } else if (add) {
        add_dq<T::DIM, COL0, N>(dq_block, acc, warp, lane);
    }
}
