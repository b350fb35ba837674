// The Hopper backward's producer (flash_bwd_sm90.cu), thread 0 of warpgroup 0: K and V of the key
// block once (TMA, one mbarrier), then per step Q_i with its lse_log2 rows and dO_i with its D
// rows into the STAGES-deep ring (TMA tiles and bulk copies, q_full and do_full per stage, each
// stage reused once stage_empty says both consumers are done with it); with the bias as tiles
// (FEATURE_BIAS_TILE: BiasTile, sm90/bias_tile.cuh; else NoBiasTile) the step's block of the
// bias too, behind dO_i in the stage, on Q_i's barrier (the consumers add it to S^T, Q_i's
// product).
#pragma once
#include "hopper_primitives.cuh"
#include "kernel_params.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"
#include "sm90/bias_tile.cuh"

// The producer thread's loads: K and V of keys `key_row` .. (their row in the maps' rows) into
// `k_smem` / `v_smem`, then the `steps` steps' Q_i, dO_i (rows from `q_row0`) and statistics
// (rows from stats_first(head), the sequence's first row of the per-row arrays) into the ring
// at `q_smem` / `stats_smem`.
template <class T, int STAGES, bool DETERMINISTIC, class StatsFirst, class Bias>
CF2_DEVICE void load_kv_and_steps(const BwdSm90Params& params, const BwdParams& p,
                                  BwdSm90Barriers<STAGES>& bars, const StatsFirst& stats_first,
                                  u32 kv_full, u32 k_smem, u32 v_smem, u32 q_smem,
                                  u32 stats_smem, int key_row, int q_row0, int kv_head,
                                  int map_batch, int m_first, int m_count, int steps,
                                  const Bias& bias) {
    static_assert(Bias::ON == (T::BIAS_TILE_BYTES > 0), "the traits' stage holds the bias");
    mbarrier_arrive_expect_tx(kv_full, T::KV_TILE_BYTES + T::V_TILE_BYTES);
    tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(k_smem, params.k_map, kv_full, key_row, kv_head,
                                                map_batch);
    tma_load_tile<T::V_PANELS, T::KV_PANEL_BYTES>(v_smem, params.v_map, kv_full, key_row,
                                                  kv_head, map_batch);
    QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head, p.heads_per_kv_head,
                                       m_first, m_count);
    for (int j = 0; j < steps; ++j) {
        const int stage = j % STAGES;
        mbarrier_wait(smem_address(&bars.stage_empty[stage]), ((j / STAGES) & 1) ^ 1);
        const int row0 = walk.m_block * T::QUERIES;
        // lse_log2 and D are padded to whole Q blocks (+inf / 0): never out of bounds.
        const i64 stat0 = stats_first(walk.head) + row0;
        const u32 q_tile = q_smem + stage * T::STAGE_BYTES;
        const u32 do_tile = q_tile + T::Q_TILE_BYTES;
        const u32 lse_s = stats_smem + stage * 2 * T::STAT_BYTES;
        const u32 q_full = smem_address(&bars.q_full[stage]);
        const u32 do_full = smem_address(&bars.do_full[stage]);
        mbarrier_arrive_expect_tx(q_full, T::Q_TILE_BYTES + T::STAT_BYTES + T::BIAS_TILE_BYTES);
        tma_load_tile<T::PANELS, T::Q_PANEL_BYTES>(q_tile, params.q_map, q_full, q_row0 + row0,
                                                   walk.head, map_batch);
        bulk_load(lse_s, p.lse_log2 + stat0, T::STAT_BYTES, q_full);
        if constexpr (Bias::ON)  // not varlen: the bias's rows are the queries' own
            bias.template load<T::BLOCK_N_PANELS>(q_tile + T::BIAS_OFFSET, q_full, row0,
                                                  key_row, walk.head, map_batch);
        mbarrier_arrive_expect_tx(do_full, T::DO_TILE_BYTES + T::STAT_BYTES);
        tma_load_tile<T::V_PANELS, T::Q_PANEL_BYTES>(do_tile, params.do_map, do_full,
                                                   q_row0 + row0, walk.head, map_batch);
        bulk_load(lse_s + T::STAT_BYTES, p.delta + stat0, T::STAT_BYTES, do_full);
        walk.advance();
    }
}
