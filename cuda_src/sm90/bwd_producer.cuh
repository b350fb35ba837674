// The Hopper backward's producer thread (thread 0 of warpgroup 0, flash_bwd_sm90.cu): K and V of
// the key block once (TMA, one mbarrier), then per step (QueryBlockWalk) Q_i with its lse_log2
// rows and dO_i with its D rows into the STAGES-deep ring (TMA tiles + bulk copies of the
// statistics; q_full and do_full per stage, released by stage_empty when both consumers are done
// with the stage). The kernel calls load_kv, then load_query_blocks.
#pragma once
#include "hopper_primitives.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"

// K and V of the block's keys (from `key_row` of the sequence's rows), both on `kv_full`.
template <class T>
CF2_DEVICE void load_kv(const BwdSm90Params& params, const BwdSm90Smem<T>& sm, u32 kv_full,
                        int key_row, int kv_head, int map_batch) {
    mbarrier_arrive_expect_tx(kv_full, 2 * T::KV_TILE_BYTES);
    tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(sm.k, params.k_map, kv_full, key_row, kv_head,
                                                map_batch);
    tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(sm.v, params.v_map, kv_full, key_row, kv_head,
                                                map_batch);
}

// Step j's Q_i + lse_log2 rows (q_full) and dO_i + D rows (do_full) into stage j % STAGES, once
// its previous use was released. `query_row0`: the sequence's first row in the maps;
// `stats_first(head)`: the first row of the head's per-row statistics.
template <class T, bool DETERMINISTIC, class StatsFirst>
CF2_DEVICE void load_query_blocks(const BwdSm90Params& params, const BwdSm90Smem<T>& sm,
                                  BwdSm90Barriers<T::NUM_STAGES>& bars, QueryBlocks blocks,
                                  int steps, int kv_head, int query_row0, int map_batch,
                                  const StatsFirst& stats_first) {
    constexpr int STAGES = T::NUM_STAGES;
    const BwdParams& p = params.base;
    QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head, p.heads_per_kv_head,
                                       blocks.first, blocks.count);
    for (int j = 0; j < steps; ++j) {
        const int stage = j % STAGES;
        mbarrier_wait(smem_address(&bars.stage_empty[stage]), ((j / STAGES) & 1) ^ 1);
        const int row0 = walk.m_block * T::QUERIES;
        // lse_log2 and D are padded to whole Q blocks (+inf / 0): never out of bounds.
        const i64 stat0 = stats_first(walk.head) + row0;
        const u32 q_tile = sm.q + stage * T::STAGE_BYTES;
        const u32 do_tile = q_tile + T::Q_TILE_BYTES;
        const u32 lse_s = sm.stats + stage * 2 * T::STAT_BYTES;
        const u32 q_full = smem_address(&bars.q_full[stage]);
        const u32 do_full = smem_address(&bars.do_full[stage]);
        mbarrier_arrive_expect_tx(q_full, T::Q_TILE_BYTES + T::STAT_BYTES);
        tma_load_tile<T::PANELS, T::Q_PANEL_BYTES>(q_tile, params.q_map, q_full,
                                                   query_row0 + row0, walk.head, map_batch);
        bulk_load(lse_s, p.lse_log2 + stat0, T::STAT_BYTES, q_full);
        mbarrier_arrive_expect_tx(do_full, T::Q_TILE_BYTES + T::STAT_BYTES);
        tma_load_tile<T::PANELS, T::Q_PANEL_BYTES>(do_tile, params.do_map, do_full,
                                                   query_row0 + row0, walk.head, map_batch);
        bulk_load(lse_s + T::STAT_BYTES, p.delta + stat0, T::STAT_BYTES, do_full);
        walk.advance();
    }
}
