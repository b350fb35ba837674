// The Hopper backward's consumer mainloop (flash_bwd_sm90.cu): warpgroup 1 + c owns keys
// 64 c .. 64 c + 63 of the block and, per step, computes S^T = K_c Q_i^T and dP^T = V_c dO_i^T by
// wgmma, turns them into P^T and dS^T with the score pieces (sm90/bwd_scores.cuh), stores dS^T
// into the shared dS tile, issues dV += P^T dO_i and dK += dS^T Q_i, and, after both consumers met,
// dQ_i = dS K, written out by sm90/bwd_dq_writer.cuh. dK and dV stay in its registers for the
// epilogue (sm90/bwd_epilogue.cuh). The GEMM helpers issue the wgmmas of those products.
#pragma once
#include "hopper_primitives.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"
#include "sm90/bwd_scores.cuh"
#include "sm90/bwd_dq_writer.cuh"

// X^T = A_c B^T for one consumer (S^T = K_c Q_i^T or dP^T = V_c dO_i^T): M = its 64 keys, N =
// BLOCK_M queries, QK_STEPS k16 steps over the head dim; both operands K-major descriptors (the
// forward's Q and K of S = Q K^T). `a_rows`: this consumer's first key row of K or V (a whole
// number of swizzle atoms into each panel). Issues the wgmmas only.
template <typename Elem, class T>
CF2_DEVICE void issue_transposed_scores(float (&acc)[T::S_TILES][4], u32 a_rows, u32 b_tile) {
    issue_kmajor_ss<Elem, T::QUERIES, T::QK_STEPS, T::KV_PANEL_BYTES, T::Q_PANEL_BYTES>(
        acc, a_rows, b_tile);
}

// acc (64 keys x COLS head-dim columns) += frag (this warp's keys x BLOCK_M queries, A registers) times
// `b_tile` (Q_i or dO_i, [queries x head dim], the MN-major B operand as V of the forward's
// P V: 16 rows = 2048 B a k16 step, SBO 1024, LBO one panel). Issues the wgmmas only.
template <typename Elem, class T, int COLS>
CF2_DEVICE void issue_key_gradient(float (&acc)[COLS / 8][4], u32 (&frag)[T::M_STEPS][4],
                                   u32 b_tile) {
#pragma unroll
    for (int ks = 0; ks < T::M_STEPS; ++ks) {
        const u64 b = smem_matrix_descriptor(b_tile + 2048 * ks, T::Q_PANEL_BYTES, 1024);
        wgmma_rs_trans_b<Elem, COLS>(acc, frag[ks], b, 1);
    }
}

// dQ_i[rows, COL0 .. COL0 + N) = dS K[:, COL0 .. COL0 + N) for 64 query rows: N_STEPS k16
// steps over the keys; A = those rows of dS (`ds_rows`: their first row in the tile, a whole
// number of swizzle atoms into each panel; K-major: 32 B a step inside a 64-key panel), B = K
// (MN-major, 2048 B a step, LBO one K panel). Issues the wgmmas only.
template <typename Elem, class T, int COL0, int N>
CF2_DEVICE void issue_dq(float (&acc)[N / 8][4], u32 ds_rows, u32 k_tile) {
    const u32 b0 = k_tile + (COL0 / T::PANEL_COLS) * T::KV_PANEL_BYTES + 2 * (COL0 % T::PANEL_COLS);
#pragma unroll
    for (int kk = 0; kk < T::N_STEPS; ++kk) {
        const u64 a = smem_matrix_descriptor(ds_rows + (kk / 4) * T::DS_PANEL_BYTES + 32 * (kk % 4),
                                             16, 1024);
        const u64 b = smem_matrix_descriptor(b0 + 2048 * kk, T::KV_PANEL_BYTES, 1024);
        wgmma_ss_trans_b<Elem, N>(acc, a, b, kk > 0);
    }
}

// This consumer's dQ_i[rows, COL0 .. COL0 + N) = dS K, issued once both consumers' dS^T are in
// the tile, and written out (write_dq; `add` false: computed and not added). With DK_BEHIND_DQ,
// dK += dS^T Q_i (`q_chunk`) is issued behind dQ_i, so that the tensor cores run it while dQ_i
// is written out. The stage is released once dK's product has read Q_i.
template <typename Elem, class T, int COL0, int N, bool ORDERED, bool DK_BEHIND_DQ>
CF2_DEVICE void dq_products(float (&acc_dk)[T::D_TILES][4], float (&acc_dv)[T::D_TILES][4],
                            u32 (&p_frag)[T::M_STEPS][4], u32 (&ds_frag)[T::M_STEPS][4],
                            u32 ds_rows, u32 k_chunk, u32 q_chunk, float* dq_block, u32 dq_tile,
                            u32 dq_full, u32 dq_empty, u32 dq_empty_parity, bool add,
                            BwdSm90Barriers<T::NUM_STAGES>& bars, int stage, int warp,
                            int lane) {
    float acc_dq[N / 8][4];
    pin_registers(acc_dq);
    wgmma_fence();
    issue_dq<Elem, T, COL0, N>(acc_dq, ds_rows, k_chunk);
    wgmma_commit_group();
    if constexpr (DK_BEHIND_DQ) {
        issue_key_gradient<Elem, T, T::CHUNK_COLS>(acc_dk, ds_frag, q_chunk);
        wgmma_commit_group();
        wgmma_wait_group<1>();  // dV and dQ_i completed, dK in flight
    } else {
        wgmma_wait_group<0>();
        pin_registers(acc_dk);
        pin_registers(ds_frag);
        mbarrier_arrive(smem_address(&bars.stage_empty[stage]));
    }
    pin_registers(acc_dq);
    pin_registers(acc_dv);
    pin_registers(p_frag);
    write_dq<T, COL0, N, ORDERED>(acc_dq, dq_block, dq_tile, dq_full, dq_empty, dq_empty_parity,
                                  add, warp, lane);
    if constexpr (DK_BEHIND_DQ) {
        wgmma_wait_group<0>();
        pin_registers(acc_dk);
        pin_registers(ds_frag);
        mbarrier_arrive(smem_address(&bars.stage_empty[stage]));
    }
}

// The consumer's loop over the key block's steps (QueryBlockWalk): dK and dV (this CTA's chunk of
// columns) zeroed, then accumulated over every step; the kernel's epilogue stores them. Step j
// uses stage j % STAGES of the ring, whose barriers are in their (j / STAGES)-th phase, and dS
// buffer j % 2. `col0`, `narrow`: this CTA's first dK / dV / dQ column and whether its chunk is
// the narrower last one; `stats_first(head)`: the first row of the head's per-row statistics and
// dQ accumulator.
template <typename Elem, class T, int FEATURES, bool DETERMINISTIC, class StatsFirst>
CF2_DEVICE void consumer_mainloop(float (&acc_dk)[T::D_TILES][4], float (&acc_dv)[T::D_TILES][4],
                                  const BwdParams& p, const BwdSm90Smem<T>& sm,
                                  BwdSm90Barriers<T::NUM_STAGES>& bars, const KeyVisibility& vis,
                                  QueryBlocks blocks, int steps, int kv_head, int batch,
                                  int seqlen_q, int seqlen_k, int chunk, int col0, bool narrow,
                                  int consumer, int warp, int lane, u32 k_rows, u32 v_rows,
                                  const StatsFirst& stats_first) {
    constexpr int STAGES = T::NUM_STAGES;
    constexpr int BLOCK_M = T::QUERIES;
    constexpr int BLOCK_N = T::KEYS;
    constexpr int HEAD_DIM = T::DIM;
    // The order of a step's last products. With staged dQ, dK += dS^T Q_i is issued behind
    // dQ_i and runs while the consumer stages dQ_i (FlashAttention-3's order; H200: d=128 1.04-
    // 1.05x, d=64 1.01x). With vector reductions (d=192 / 256) it is issued beside dV, before
    // the barrier (dK behind dQ_i was 0.97-0.99x there), and at d=64's 128-row steps with score
    // modifiers too (dQ_i's 64 rows live beside dK's operands spill 4-16 B there).
    constexpr bool DK_BEHIND_DQ = T::DQ_STAGED && !(T::DQ_BY_ROWS && FEATURES != 0);
#pragma unroll
    for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

    mbarrier_wait(smem_address(&bars.kv_full), 0);
    QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head, p.heads_per_kv_head,
                                       blocks.first, blocks.count);
    for (int j = 0; j < steps; ++j) {
        const int stage = j % STAGES;
        const u32 phase = (j / STAGES) & 1;
        const int row0 = walk.m_block * BLOCK_M;
        const u32 q_tile = sm.q + stage * T::STAGE_BYTES;
        const u32 do_tile = q_tile + T::Q_TILE_BYTES;
        const u32 ds_tile = sm.ds + (j % 2) * T::DS_BYTES;

        // S^T = K_c Q_i^T as soon as Q_i landed, dP^T = V_c dO_i^T as soon as dO_i did; the
        // work on S^T starts while dP^T runs (wait_group 1: only the S^T group completed).
        float acc_s[1][T::S_TILES][4], acc_dp[T::S_TILES][4];
        u32 p_frag[T::M_STEPS][4], ds_frag[T::M_STEPS][4];
        mbarrier_wait(smem_address(&bars.q_full[stage]), phase);
        pin_registers(acc_s[0]);
        wgmma_fence();
        issue_transposed_scores<Elem, T>(acc_s[0], k_rows, q_tile);
        wgmma_commit_group();
        mbarrier_wait(smem_address(&bars.do_full[stage]), phase);
        pin_registers(acc_dp);
        wgmma_fence();
        issue_transposed_scores<Elem, T>(acc_dp, v_rows, do_tile);
        wgmma_commit_group();
        wgmma_wait_group<1>();
        pin_registers(acc_s[0]);

        // P^T, as far as it goes before dP^T is needed: softcap's t, the mask (boundary
        // steps only), and without softcap P itself, in place. The thread's key and query
        // positions are rebuilt from a fresh thread index and the score modifiers set up
        // here, each step, as in flash_bwd.cu (the slope is one cached load): nothing of
        // them is held across the loop, registers being scarcest here.
        const int tid_now = thread_index_fresh();
        const int key_first_now = load_4B_shared_fresh(smem_address(&bars.key_first));
        const int thread_key0 = key_first_now + (tid_now - T::WARPGROUP_THREADS) / 32 * 16 +
                                (tid_now % 32) / 4;
        const int thread_query0 = row0 + 2 * (tid_now % 4);
        const float offset0 = static_cast<float>(thread_query0 - thread_key0);
        const float* lse = sm.stats_ptr + stage * 2 * BLOCK_M + 2 * (tid_now % 4);
        ScoreMods<FEATURES> mods(p.mods, seqlen_q, seqlen_k);
        mods.select_head(p.mods, batch, walk.head);
        mods.apply_softcap(acc_s);
        const int row_last = min(row0 + BLOCK_M, seqlen_q) - 1;
        const bool needs_mask =
            key_first_now + BLOCK_N > seqlen_k ||
            (p.window_right >= 0 &&
             min(key_first_now + BLOCK_N, seqlen_k) - 1 > row0 + vis.diag + p.window_right) ||
            (p.window_left >= 0 && key_first_now < row_last + vis.diag - p.window_left);
        if (needs_mask) mask_transposed(acc_s[0], thread_key0, thread_query0, vis);
        if constexpr (!ScoreMods<FEATURES>::SOFTCAP)
            exponentiate<T>(acc_s[0], lse, mods, p.scale_log2, offset0);
        wgmma_wait_group<0>();
        pin_registers(acc_dp);

        // P^T and dS^T into registers (A operands of dV, dK), dS^T transposed into the dS
        // tile (A operand of dQ).
        score_gradients<Elem, T>(p_frag, ds_frag, acc_s[0], acc_dp, lse, mods, p.scale_log2,
                                 offset0);
        store_ds_transposed<T>(ds_tile, ds_frag, 8 * consumer + 2 * warp, lane);
        fence_proxy_async_shared();  // the generic stores, before wgmma reads them

        // dV += P^T dO_i (and dK += dS^T Q_i where it is not issued behind dQ_i), while the
        // consumers meet at the barrier below.
        pin_registers(acc_dv);
        pin_registers(acc_dk);
        pin_registers(p_frag);
        pin_registers(ds_frag);
        wgmma_fence();
        // This chunk's columns of dO_i and Q_i. The narrower last chunk (d=192: 64 columns)
        // runs the same N = 128 products: its second 64 columns read the 8 KiB past the tile
        // (dO_i's first panel, or the next stage's Q / the dS tile) and are never stored. A
        // branch to N = 64 products spilled (softcap + ALiBi), as did one around dQ's.
        const u32 b_chunk = chunk * T::CHUNK_Q_BYTES;
        issue_key_gradient<Elem, T, T::CHUNK_COLS>(acc_dv, p_frag, do_tile + b_chunk);
        if constexpr (!DK_BEHIND_DQ)
            issue_key_gradient<Elem, T, T::CHUNK_COLS>(acc_dk, ds_frag, q_tile + b_chunk);
        wgmma_commit_group();

        // dQ_i: both consumers' dS^T are in the tile after the barrier; consumer c takes its
        // head-dim columns (64-row steps) or its 64 rows (128-row steps). With DK_BEHIND_DQ,
        // dK += dS^T Q_i is issued behind dQ_i, so that the tensor cores run it while dQ_i is
        // written out. The dS buffer is rewritten two steps later, after both consumers passed
        // the next step's barrier, i.e. after their dQ_i completed.
        named_barrier_sync(T::DS_BARRIER, T::CONSUMER_THREADS);
        const int dq_row0 = T::DQ_BY_ROWS ? T::DQ_WGMMA_ROWS * consumer : 0;  // in the block
        float* dq_block =
            p.dq_accum + (stats_first(walk.head) + row0 + dq_row0) * HEAD_DIM + col0;
        const u32 ds_rows = ds_tile + dq_row0 * T::ROW_BYTES;
        const u32 k_chunk = sm.k + chunk * T::CHUNK_KV_BYTES;
        const int dq_buf = j % T::DQ_RING;  // DQ_STAGED
        const u32 dq_tile = sm.dq + dq_buf * T::DQ_TILE_BYTES + 4 * dq_row0 * HEAD_DIM;
        const u32 dq_full = smem_address(&bars.dq_full[dq_buf]);
        const u32 dq_empty = smem_address(&bars.dq_empty[dq_buf]);
        // Staged buffers start empty; the ordered vector reductions' turn starts not given.
        const u32 dq_empty_parity = ((j / T::DQ_RING) & 1) ^ (T::DQ_STAGED ? 1u : 0u);
        if (consumer == 0) {
            dq_products<Elem, T, 0, T::DQ_COLS_0, DETERMINISTIC, DK_BEHIND_DQ>(
                acc_dk, acc_dv, p_frag, ds_frag, ds_rows, k_chunk, q_tile + b_chunk, dq_block,
                dq_tile, dq_full, dq_empty, dq_empty_parity, true, bars, stage, warp, lane);
        } else {
            // The narrower last chunk (d=192: 64 columns, one panel) is consumer 0's alone:
            // there, this product reads the panel past K (V's first, not written before the
            // epilogue) and is not added.
            dq_products<Elem, T, T::DQ_COL0_1, T::DQ_COLS_1, DETERMINISTIC, DK_BEHIND_DQ>(
                acc_dk, acc_dv, p_frag, ds_frag, ds_rows, k_chunk, q_tile + b_chunk, dq_block,
                dq_tile, dq_full, dq_empty, dq_empty_parity, !narrow, bars, stage, warp, lane);
        }

        walk.advance();
    }
}
