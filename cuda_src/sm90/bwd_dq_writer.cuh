// The Hopper backward's dQ path (flash_bwd_sm90.cu). Consumer side: a consumer's dQ_i columns to
// the fp32 accumulator dq_accum, staged in shared memory for the dQ thread's bulk reduction or
// added by vector reductions (in the key block's turn in deterministic mode). The dQ thread's
// side (thread 32 of the producer warpgroup): the bulk reductions of the staged tiles, and the
// deterministic mode's turns.
#pragma once
#include "hopper_primitives.cuh"
#include "dq_accum.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"
#include "masking.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"

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

// The dQ thread's loop over the key block's `steps` steps. Staged dQ: adds each step's staged dQ
// tile to its rows of dq_accum with one bulk reduction (element-wise atomic: other key blocks
// add to the same rows), and frees the buffer once the reduction has read it. DETERMINISTIC: in
// key-block order, the turn of the query block's adders taken from its semaphore (staged: the
// bulk reduction; vector reductions, above d=128: the consumers', between dq_empty and dq_full).
// stats_first(head): the sequence's first row of the per-row arrays and dq_accum for `head`.
template <class T, int STAGES, bool DETERMINISTIC, class StatsFirst>
CF2_DEVICE void reduce_dq_steps(const BwdParams& p, BwdSm90Barriers<STAGES>& bars,
                                const StatsFirst& stats_first, const KeyVisibility& vis,
                                u32 dq_smem, int kv_head, int kv_block, int chunk, int seqlen_q,
                                int m_first, int m_count, int steps) {
    constexpr int HEAD_DIM = T::DIM, BLOCK_M = T::QUERIES;
    constexpr int BLOCK_N = T::KEYS_PER_WARPGROUP * T::CONSUMER_WARPGROUPS;
    QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head, p.heads_per_kv_head,
                                       m_first, m_count);
    for (int j = 0; j < steps; ++j) {
        const int buf = j % T::DQ_RING;
        const u32 parity = (j / T::DQ_RING) & 1;
        // Staged: the tile's wait first; the rows' address, worked out after it, is not
        // held across it (held there, it spilled from the producer's 24 registers).
        if constexpr (T::DQ_STAGED)
            mbarrier_wait(smem_address(&bars.dq_full[buf]), parity);
        const i64 row0 = stats_first(walk.head) + walk.m_block * BLOCK_M;
        int* semaphore =
            DETERMINISTIC ? p.dq_semaphore + row0 / DQ_SEMAPHORE_ROWS + chunk : nullptr;
        int turn = 0;
        if constexpr (DETERMINISTIC) {
            // The key blocks that see the query block's rows are a contiguous range
            // ending at last_adder (a window's edges both grow with the key block);
            // they add from the last down, so this one's turn is last_adder - kv_block.
            const int m_row0 = walk.m_block * BLOCK_M;
            int first_adder, adders_end;
            vis.tile_range(m_row0, min(m_row0 + BLOCK_M, seqlen_q) - 1, BLOCK_N, first_adder,
                           adders_end);
            turn = adders_end - 1 - kv_block;
        }
        if constexpr (T::DQ_STAGED) {
            if constexpr (DETERMINISTIC) {
                wait_semaphore(semaphore, turn);
                fence_proxy_async_global();
            }
            bulk_reduce_add_f32(p.dq_accum + row0 * HEAD_DIM, dq_smem + buf * T::DQ_TILE_BYTES,
                                T::DQ_TILE_BYTES);
            bulk_commit_group();
            // The buffer is free once the reduction has read it; DETERMINISTIC: the next
            // key block's turn once its additions are done, which the consumers need
            // not wait for.
            bulk_wait_group_read<0>();
            mbarrier_arrive(smem_address(&bars.dq_empty[buf]));
            if constexpr (DETERMINISTIC) {
                bulk_wait_group<0>();
                fence_proxy_async_global();
                increment_release_gpu(semaphore);
            }
        } else {
            // The consumers' vector reductions, ordered: the turn (acquire) is handed to
            // them through dq_empty, and passed on (release) once every consumer thread
            // arrived on dq_full after its reductions: the mbarrier's release and
            // acquire at CTA scope put those before this thread's release at GPU scope.
            wait_semaphore(semaphore, turn);
            mbarrier_arrive(smem_address(&bars.dq_empty[buf]));
            mbarrier_wait(smem_address(&bars.dq_full[buf]), parity);
            increment_release_gpu(semaphore);
        }
        walk.advance();
    }
    if constexpr (T::DQ_STAGED)
        bulk_wait_group<0>();  // the reductions complete before the shared memory goes
}
