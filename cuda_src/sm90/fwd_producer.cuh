// The Hopper forward's producer (flash_fwd_sm90.cu, warpgroup 0, thread 0): the TMA loads of
// one work tile, Q and the K/V ring that the consumers' mainloop (sm90/fwd_mainloop.cuh) reads.
// The kernel runs it on each of the CTA's work tiles (FwdTileScheduler::for_each).
#pragma once
#include "hopper_primitives.cuh"
#include "sm90/fwd_barriers.cuh"
#include "sm90/fwd_tile_scheduler.cuh"
#include "sm90/bias_tile.cuh"

// The producer's loads for one work tile (thread 0 of warpgroup 0): Q, then K_j and V_j of every
// KV tile the rows see, from the last one down, into the ring from position ring0 on: the j-th
// tile visited takes position ring0 + j, stage (ring0 + j) % STAGES, whose barriers are in their
// ((ring0 + j) / STAGES)-th phase. Positions continue across a persistent CTA's work tiles, so
// the producer runs ahead into the next work tile while the consumers finish this one.
// PERSISTENT: Q goes in after K of the first KV tile (which needs only a free stage), once every
// consumer thread is done with the previous work tile's Q (q_empty, round q_round - 1; a fresh
// barrier passes round 0 at once).
// OVERLAP: kv_empty gives back a stage's K alone; V goes in once its V is given back (v_empty).
// With both, Q comes before the wait for V: the previous work tile's last S = Q K^T completes
// before the P V whose V the wait is for.
// VARLEN: the maps cover the packed arrays (batch extent 1): rows count from the sequence's first
// row, the batch coordinate is 0. A box that runs past the sequence reads the next sequence's
// rows (the TMA zero-fills only past the packed array's end): K's are masked (the sequence's
// last KV tile is a boundary tile), V's meet P = 0, Q's rows are computed and not stored.
// TRANSPOSE_V keeps this: the raw V box starts at the same row as K's, and the transpose moves
// each key's row to that key's column of the stage (P's order within a group of 32 keys), where
// it meets that key's P, 0 past the sequence; rows past the packed array arrive as zeros.
// Bias (FEATURE_BIAS_TILE: BiasTile, sm90/bias_tile.cuh; else NoBiasTile): each KV tile's block
// of the bias goes into its stage after K, on the bias ring's barriers (BiasTileRing).
// TRANSPOSE_V (e4m3): V goes into the raw V ring instead, as it lies (rows of keys), once the
// transposers gave the buffer back (raw_v_empty); they wait for the stage's V to be free and
// write it keys-last (sm90/fwd_transpose_v.cuh). `bars`: the kernel's barriers
// (FwdSm90KernelBarriers), of which the raw V ring's.
template <class T, bool OVERLAP, bool PERSISTENT, bool VARLEN = false, class Bias = NoBiasTile,
          class Bars>
CF2_DEVICE void produce_tile(const FwdSm90Params& params, const FwdTileContext& c, int ring0,
                             int q_round, u32 q_smem, u32 kv_smem, Bars& bars,
                             const Bias& bias = Bias{}) {
    static_assert(Bias::ON == (T::BIAS_TILE_BYTES > 0), "the traits' stage holds the bias");
    constexpr int STAGES = T::KV_STAGES;
    const FwdWorkTile& w = c.w;
    const FwdTileSpan& span = c.span;
    const int kv_head = c.kv_head;
    const int batch = VARLEN ? 0 : w.batch;        // the maps' batch coordinate
    const int q_row0 = VARLEN ? c.seq_q.start : 0;  // the maps' row of the sequence's row 0
    const int k_row0 = VARLEN ? c.seq_k.start : 0;
    auto load_q = [&]() {
        const u32 q_full = smem_address(&bars.q_full);
        mbarrier_arrive_expect_tx(q_full, T::Q_BYTES);
        tma_load_tile<T::PANELS, T::Q_PANEL_BYTES, T::PANEL_ELEMENTS>(
            q_smem, params.q_map, q_full, q_row0 + span.row_first, w.head, batch);
    };
    if constexpr (!PERSISTENT) load_q();
    for (int tile = span.tile_end - 1, j = 0; tile >= span.tile_first; --tile, ++j) {
        const int ring = ring0 + j;
        const int stage = ring % STAGES;
        const u32 phase = (ring / STAGES) & 1;
        // Wait until the consumers released the stage's previous tile (its K alone with OVERLAP;
        // the first pass over the ring waits for parity 1 of fresh barriers: it passes at once).
        mbarrier_wait(smem_address(&bars.kv_empty[stage]), phase ^ 1);
        const u32 k_tile = kv_smem + stage * T::STAGE_BYTES;
        const u32 v_tile = k_tile + T::V_OFFSET;
        const u32 k_full = smem_address(&bars.k_full[stage]);
        const u32 v_full = smem_address(&bars.v_full[stage]);
        mbarrier_arrive_expect_tx(k_full, T::PARTS * T::KV_TILE_BYTES);
        tma_load_tile<T::PANELS, T::KV_PANEL_BYTES, T::PANEL_ELEMENTS>(
            k_tile, params.k_map, k_full, k_row0 + tile * T::KEYS_PER_TILE, kv_head, batch);
        if constexpr (T::SPLIT) {
            // K's small parts: the same rows of the operand pass's array, from column head_dim
            // on (each row holds the head dim's big parts, then its small ones).
#pragma unroll
            for (int panel = 0; panel < T::PANELS; ++panel)
                tma_load_4d(k_tile + T::SMALL_OFFSET + panel * T::KV_PANEL_BYTES, params.k_map,
                            k_full, params.base.head_dim / 2 + T::PANEL_ELEMENTS * panel,
                            k_row0 + tile * T::KEYS_PER_TILE, kv_head, batch);
        }
        if constexpr (PERSISTENT) {
            if (j == 0) {
                mbarrier_wait(smem_address(&bars.q_empty), (q_round & 1) ^ 1);
                load_q();
            }
        }
        // The bias's block (needed at the tile's softmax, before V) once its stage is read.
        bias.template produce<T::BIAS_PANELS, T::BIAS_TILE_BYTES>(
            k_tile + T::BIAS_OFFSET, ring, span.row_first, tile * T::KEYS_PER_TILE, w.head,
            w.batch);
        if constexpr (T::TRANSPOSE_V) {
            const int raw = ring % T::RAW_V_STAGES;
            mbarrier_wait(smem_address(&bars.raw_v_empty[raw]),
                          ((ring / T::RAW_V_STAGES) & 1) ^ 1);
            const u32 raw_v_full = smem_address(&bars.raw_v_full[raw]);
            mbarrier_arrive_expect_tx(raw_v_full, T::RAW_V_TILE_BYTES);
            tma_load_tile<T::V_PANELS, T::KV_PANEL_BYTES, T::PANEL_ELEMENTS>(
                kv_smem + T::RAW_V_OFFSET + raw * T::RAW_V_TILE_BYTES, params.v_map, raw_v_full,
                k_row0 + tile * T::KEYS_PER_TILE, kv_head, batch);
            continue;
        }
        // With OVERLAP the consumers give the stage's V back separately, after its P V.
        if constexpr (OVERLAP) mbarrier_wait(smem_address(&bars.v_empty[stage]), phase ^ 1);
        mbarrier_arrive_expect_tx(v_full, T::PARTS * T::V_TILE_BYTES);
        if constexpr (T::KEYS_LAST_V) {
            // V with its keys innermost (flash_fwd_tf32_operands.cu), mapped as (key, head-dim
            // row, kv head, batch): panels of 128 bytes of keys (32 float32) of every head-dim
            // row.
#pragma unroll
            for (int panel = 0; panel < T::VT_PANELS; ++panel)
                tma_load_4d(v_tile + panel * T::VT_PANEL_BYTES, params.v_map, v_full,
                            tile * T::KEYS_PER_TILE + T::PANEL_ELEMENTS * panel, 0, kv_head,
                            batch);
            // SPLIT: V's small parts, the head-dim rows from head_dim on of the same array.
            if constexpr (T::SPLIT) {
#pragma unroll
                for (int panel = 0; panel < T::VT_PANELS; ++panel)
                    tma_load_4d(v_tile + T::SMALL_OFFSET + panel * T::VT_PANEL_BYTES,
                                params.v_map, v_full,
                                tile * T::KEYS_PER_TILE + T::PANEL_ELEMENTS * panel,
                                params.base.head_dim / 2, kv_head, batch);
            }
        } else {
            tma_load_tile<T::V_PANELS, T::KV_PANEL_BYTES>(v_tile, params.v_map, v_full,
                                                        k_row0 + tile * T::KEYS_PER_TILE,
                                                        kv_head, batch);
        }
    }
}
