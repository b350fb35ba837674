// FlashAttention-2 backward (Dao, 2023, Algorithm 2) for Hopper (sm_90a): wgmma, TMA and warp
// specialisation (docs/HOPPER_BWD.md).
//
// The algorithm is the one of flash_bwd.cu. KV is the outer loop: one CTA owns BLOCK_N keys of
// one (batch, KV head), keeps K and V of them in shared memory and dK, dV of them in registers,
// and walks over the query blocks (of every query head sharing the KV head, so GQA's dK/dV sums
// stay in fp32 registers) whose rows can see its keys. Per query block i (BLOCK_M rows):
//   S = Q_i K^T, P = exp2(S * scale_log2 - lse_log2)     (recomputed from the forward's lse)
//   dP = dO_i V^T, dS = P o (dP - D)                      (D = rowsum(dO o O), the preprocess)
//   dV += P^T dO_i,  dK += dS^T Q_i                       (registers, the whole loop)
//   dQ_i += dS K                                          (fp32 atomics into dq_accum)
// and at the end dK *= softmax_scale (dQ gets it in flash_bwd_convert_dq.cu).
//
// Hopper's split of the work:
//  - warpgroup 0 is the producer (setmaxnreg.dec): its thread 0 loads K and V once (TMA, one
//    mbarrier), then, per query block, Q_i with its lse_log2 rows and dO_i with its D rows into a
//    STAGES-deep ring (TMA tiles + bulk copies of the statistics; q_full and do_full per stage,
//    released by stage_empty when both consumers are done with the stage).
//  - warpgroups 1 and 2 are consumers (setmaxnreg.inc), each owning 64 of the BLOCK_N = 128 keys.
//    Keys are the M of wgmma (M = 64 a warpgroup): they compute the transposed products
//      S^T = K_c Q_i^T and dP^T = V_c dO_i^T     (SS: both operands K-major descriptors),
//    so that P^T and dS^T come out of the accumulators in the A-operand register layout of
//      dV += P^T dO_i and dK += dS^T Q_i         (RS: dO_i, Q_i MN-major descriptors, as V of
//                                                 the forward's P V),
//    the same accumulator -> A repacking as the forward's P (hopper_primitives.cuh). The per-row
//    statistics are per *column* of S^T: each thread reads the 16 query rows it holds from the
//    stage's lse / D arrays in shared memory.
//  - dQ needs dS with queries as rows (M = queries): each consumer stores its dS^T transposed
//    (stmatrix .trans) into a shared dS tile [BLOCK_M queries x BLOCK_N keys], both consumers
//    meet at a named barrier, and consumer c computes its share of dQ_i = dS K (SS: dS K-major,
//    K MN-major, all 128 keys, M = 64 queries): with 64-row steps the columns of its half of the
//    head dim, dQ_i[:, cols_c]; with 128-row steps (d=64) its 64 rows, dQ_i[rows_c, :]. The dS
//    tile is double-buffered (by step parity), so the one barrier a step suffices.
//  - dQ goes to the fp32 accumulator dq_accum in dq_accum.cuh's interleaved column order (the
//    wgmma accumulator is, per warp, the mma.sync m16n8 layout that order was made for), so the
//    existing preprocess (which zeroes dq_accum) and flash_bwd_convert_dq.cu serve unchanged.
//    Up to d=128 (DQ_STAGED) the consumers store dQ_i into a shared fp32 tile laid out as its
//    rows of dq_accum (DQ_BUFFERS of them taken in turn: two, or one at 128-row steps, whose
//    shared memory has no room for a second), and one producer thread adds the whole
//    tile with one bulk reduction, cp.reduce.async.bulk .add.f32 (FlashAttention-3's dQ path):
//    vector reductions from the consumers' registers (red.global.add.v4.f32, the path of the
//    wider head dims, whose shared memory has no room for the tiles) hold those registers until
//    the memory system has taken them, and the next step's products waited on that (Nsight
//    Compute: a third of the consumers' stalls on L1TEX at d=128).
//  - Deterministic mode (DETERMINISTIC; FlashAttention-3's): the key blocks add to a query
//    block's rows of dq_accum in a fixed order, so every run adds the same numbers in the same
//    order. A semaphore per (batch, head, query block, head-dim chunk), zeroed by the preprocess,
//    counts the key blocks that have added. The dQ thread of a key block waits until it reads
//    the block's turn, then with staged dQ adds, frees the staged tile once the reduction has read
//    it (the consumers go on), waits for the reduction to complete and increments the count;
//    with vector reductions (d=192 / 256) it hands the turn to the consumers (dq_empty), which
//    add and arrive on dq_full, and increments the count after them. The key blocks that see a
//    query block are a contiguous range first .. last (a window's edges both grow with the key
//    block; last: KeyVisibility::tile_range of its rows); they add from the last down, key
//    block n's turn last - n (first does not enter). The grid runs the key blocks from the last
//    down too (grid x reversed), so a key block waits only on higher ones, which the GPU
//    dispatched before it, and its steps run query block by query block from its first up
//    (QueryBlockWalk): a higher key block's first query block is no earlier, so it reaches each
//    query block at the same step as the lower one (no causal edge) or earlier (causal or right
//    window edge), and the lower one waits about a reduction's latency at most.
//
// Masking: the query blocks a key block sees come from KeyVisibility (causal, windows, bottom-
// right aligned); blocks outside are never loaded. Masks run only on boundary steps (the key
// block's tail, or a window edge crossing the block), on the transposed tile (keys as rows).
// Rows past seqlen_q need no mask: the TMA zero-fills Q and dO there and the preprocess padded
// lse_log2 with +inf (P = 0) and D with 0. Keys past seqlen_k are zero rows of K and V (and
// masked on the tail step); their dK, dV are never stored.
// Score modifiers as flash_bwd.cu: softcap's t = tanh(s * softcap_scale) before the mask, P from
// (t + ALiBi bias) * scale_log2, and dS = P (1 - t^2) (dP - D).
//
// Head dims 64, 96, 128, 192, 256 (one specialisation each; a user head dim below runs on the
// next one, the TMA zero-filling the columns past it). dK and dV of 64 keys take as many fp32
// registers a consumer thread as they have columns, so above 128 a key block's columns are split
// over two CTAs, as flash_bwd.cu does (grid.x = key block x head-dim chunk): chunk 0 computes dK,
// dV, dQ of columns 0 .. 127, chunk 1 the rest (d=192: 64, computed 128 wide and the rest
// discarded; d=256: 128), each recomputing S^T and dP^T over the whole head dim (K, V, Q_i, dO_i
// are whole-width tiles). docs/HOPPER_BWD.md compares this with FlashAttention-3's tiles.
// Left out (static_assert): dropout.
//
// The parts (sm90/): bwd_traits.cuh (the shape, shared-memory layout, registers and named
// barriers), bwd_barriers.cuh (the mbarriers), bwd_tile_scheduler.cuh (the CTA's work, the walk
// over its steps), bwd_producer.cuh (the producer thread's loads), bwd_dq_writer.cuh (dQ: the
// consumers' writes, the dQ thread's reductions and turns), bwd_scores.cuh (P^T, dS^T),
// bwd_mainloop.cuh (the products' wgmmas), bwd_epilogue.cuh (the zero store; dK / dV staged and
// stored). The consumers' loop over the steps stays here.
#include "hopper_primitives.cuh"
#include "variant.cuh"
#include "dq_accum.cuh"
#include "varlen.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"
#include "sm90/bwd_producer.cuh"
#include "sm90/bwd_dq_writer.cuh"
#include "sm90/bwd_scores.cuh"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_epilogue.cuh"

// FEATURES: the attention variant's (variant.cuh: softcap, ALiBi; its sinks need nothing here, P
// coming from the lse), or 0; DQ_BUFFERS: dQ through
// that many shared-memory tiles and bulk reductions (0: vector reductions); DETERMINISTIC: those
// in key-block order (above). The parameters: BwdSm90Params (kernel_params.cuh); grid (key
// blocks, KV heads, batch), as flash_bwd.cu's.
template <typename Elem, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, int FEATURES,
          int DQ_BUFFERS, bool DETERMINISTIC>
__global__ void __launch_bounds__(
    BwdSm90Traits<Elem, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS>::THREADS, 1)
flash_bwd_sm90_kernel(const __grid_constant__ BwdSm90Params params) {
    using T = BwdSm90Traits<Elem, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS>;
    static_assert((FEATURES & FEATURE_DROPOUT) == 0, "dropout runs on the mma.sync backward");
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    // DETERMINISTIC: chunk c of a query block orders its additions on the semaphore of the
    // block's first row, plus c (a slot per DQ_SEMAPHORE_ROWS rows of the per-row arrays: a
    // varlen sequence's rows start on a 4-row boundary, and a block has more slots than chunks).
    static_assert(BLOCK_M % DQ_SEMAPHORE_ROWS == 0 &&
                      BLOCK_M / DQ_SEMAPHORE_ROWS >= T::NUM_CHUNKS,
                  "ordered dQ: a semaphore slot per query block and head-dim chunk");
    // The order of a step's last products. With staged dQ, dK += dS^T Q_i is issued behind
    // dQ_i and runs while the consumer stages dQ_i (FlashAttention-3's order; H200: d=128 1.04-
    // 1.05x, d=64 1.01x). With vector reductions (d=192 / 256) it is issued beside dV, before
    // the barrier (dK behind dQ_i was 0.97-0.99x there), and at d=64's 128-row steps with score
    // modifiers too (dQ_i's 64 rows live beside dK's operands spill 4-16 B there).
    constexpr bool DK_BEHIND_DQ = T::DQ_STAGED && !(T::DQ_BY_ROWS && FEATURES != 0);
    const BwdParams& p = params.base;

    extern __shared__ unsigned char smem[];
    __shared__ BwdSm90Barriers<STAGES> bars;
    const u32 smem_base = (smem_address(smem) + T::SMEM_ALIGN - 1) & ~(T::SMEM_ALIGN - 1u);
    const u32 k_smem = smem_base;
    const u32 v_smem = k_smem + T::KV_TILE_BYTES;
    const u32 q_smem = v_smem + T::KV_TILE_BYTES;  // stage s: Q at + s * STAGE_BYTES, dO after
    const u32 ds_smem = q_smem + STAGES * T::STAGE_BYTES;  // two buffers
    const u32 stats_smem = ds_smem + 2 * T::DS_BYTES;      // stage s: lse at + 2 s * STAT_BYTES
    const u32 dq_smem = stats_smem + STAGES * 2 * T::STAT_BYTES;  // DQ_BUFFERS tiles
    const float* stats = reinterpret_cast<const float*>(smem + (stats_smem - smem_address(smem)));
    const u32 kv_full = smem_address(&bars.kv_full);

    const CtaWork work = cta_work<DETERMINISTIC>(params.dispatch_group_pairs);
    const int kv_block = work.x / T::NUM_CHUNKS;
    const int chunk = work.x % T::NUM_CHUNKS;  // of the head dim (0 up to d=128)
    // This CTA's first dK / dV / dQ column, and whether its chunk is the narrower last one (d=192:
    // 64 columns, computed 128 wide, the rest discarded). Constants up to d=128.
    const int col0 = chunk * T::CHUNK_COLS;
    const bool narrow = T::HAS_NARROW && chunk == T::NUM_CHUNKS - 1;
    const int kv_head = work.kv_head;
    const int batch = work.batch + p.batch_offset;
    const int key_first = kv_block * BLOCK_N;
    // This batch entry's rows (VARLEN: one packed sequence, varlen.cuh; the grid is sized by the
    // longest, and a key block past its sequence's end exits here, the whole CTA, before any
    // barrier is initialised). The maps of VARLEN calls cover the packed arrays with a batch
    // extent of 1: rows count from the sequence's first row, the batch coordinate is 0.
    const SequenceRows seq_q = query_rows<VARLEN>(p, batch);
    const SequenceRows seq_k = key_rows<VARLEN>(p, batch);
    const int seqlen_q = seq_q.length;
    const int seqlen_k = seq_k.length;
    if (VARLEN && key_first >= seqlen_k) return;
    const int map_batch = VARLEN ? 0 : batch;
    // First row of the sequence's per-row statistics and dQ accumulator for query head `head`.
    auto stats_first = [&](int head) {
        return stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq_q.start);
    };
    const int key_last = min(key_first + BLOCK_N, seqlen_k) - 1;

    // Query blocks whose rows can see keys [key_first, key_last] (causal / window), as
    // flash_bwd.cu; a step is one (query head of the group, query block) pair.
    using Variant = AttentionVariant<FEATURES>;
    const KeyVisibility vis =
        Variant::visibility(seqlen_q, seqlen_k, p.window_left, p.window_right);
    int row_begin = 0, row_end = seqlen_q;
    if (p.window_right >= 0) row_begin = max(0, key_first - vis.diag - p.window_right);
    if (p.window_left >= 0) row_end = min(seqlen_q, key_last - vis.diag + p.window_left + 1);
    const int m_first = row_begin / BLOCK_M;
    const int m_count = row_end > row_begin ? (row_end + BLOCK_M - 1) / BLOCK_M - m_first : 0;
    const int steps = m_count * p.heads_per_kv_head;
    const int head_chunks = p.head_dim / 8;
    u16* dk_block = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
                    (seq_k.start + key_first) * p.dk_row_stride;
    u16* dv_block = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
                    (seq_k.start + key_first) * p.dv_row_stride;

    if (steps == 0) {
        // No query sees these keys: dK = dV = 0 (the whole CTA, before any role).
        store_zero_dkdv<T>(p, dk_block, dv_block, key_first, seqlen_k, head_chunks, col0,
                           threadIdx.x);
        return;
    }

    if (threadIdx.x == 0) {
        bars.key_first = key_first;
        mbarrier_init(kv_full, 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(smem_address(&bars.q_full[s]), 1);  // the producer's expect_tx arrival
            mbarrier_init(smem_address(&bars.do_full[s]), 1);
            mbarrier_init(smem_address(&bars.stage_empty[s]), T::CONSUMER_THREADS);
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            mbarrier_init(smem_address(&bars.dq_full[b]), T::CONSUMER_THREADS);
            mbarrier_init(smem_address(&bars.dq_empty[b]), 1);  // the dQ thread's arrival
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    // Step j (query head h, block m: QueryBlockWalk, advanced incrementally) uses stage
    // j % STAGES, whose barriers are in their (j / STAGES)-th phase.
    const int warpgroup = threadIdx.x / T::WARPGROUP_THREADS;
    if (warpgroup == 0) {
        // ---- producer ----
        setmaxnreg_dec<T::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            load_kv_and_steps<T, STAGES, DETERMINISTIC>(
                params, p, bars, stats_first, kv_full, k_smem, v_smem, q_smem, stats_smem,
                seq_k.start + key_first, seq_q.start, kv_head, map_batch, m_first, m_count, steps);
        } else if ((T::DQ_STAGED || DETERMINISTIC) && threadIdx.x == 32) {
            // The dQ thread: the staged tiles' bulk reductions, the deterministic turns.
            reduce_dq_steps<T, STAGES, DETERMINISTIC>(p, bars, stats_first, vis, dq_smem, kv_head,
                                                      kv_block, chunk, seqlen_q, m_first, m_count,
                                                      steps);
        }
    } else {
        // ---- consumers: warpgroup 1 + c owns keys 64 c .. 64 c + 63 of the block ----
        setmaxnreg_inc<T::CONSUMER_REGISTERS>();
        const int consumer = warpgroup - 1;
        const int warp = (threadIdx.x / 32) % 4;  // in the warpgroup: keys 16 warp .. + 15
        const int lane = threadIdx.x % 32;
        const int key0 = T::KEYS_PER_WARPGROUP * consumer;  // in the block
        const u32 k_rows = k_smem + key0 * T::ROW_BYTES;    // A operands of S^T and dP^T
        const u32 v_rows = v_smem + key0 * T::ROW_BYTES;

        float acc_dk[T::D_TILES][4], acc_dv[T::D_TILES][4];
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

        mbarrier_wait(kv_full, 0);
        QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head,
                                           p.heads_per_kv_head, m_first, m_count);
        for (int j = 0; j < steps; ++j) {
            const int stage = j % STAGES;
            const u32 phase = (j / STAGES) & 1;
            const int row0 = walk.m_block * BLOCK_M;
            const u32 q_tile = q_smem + stage * T::STAGE_BYTES;
            const u32 do_tile = q_tile + T::Q_TILE_BYTES;
            const u32 ds_tile = ds_smem + (j % 2) * T::DS_BYTES;

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
            const float* lse = stats + stage * 2 * BLOCK_M + 2 * (tid_now % 4);
            Variant variant(p.mods, seqlen_q, seqlen_k);
            variant.select_head(p.mods, batch, walk.head);
            variant.apply_softcap(acc_s);
            const int row_last = min(row0 + BLOCK_M, seqlen_q) - 1;
            const bool needs_mask =
                key_first_now + BLOCK_N > seqlen_k ||
                (p.window_right >= 0 &&
                 min(key_first_now + BLOCK_N, seqlen_k) - 1 > row0 + vis.diag + p.window_right) ||
                (p.window_left >= 0 && key_first_now < row_last + vis.diag - p.window_left);
            if (needs_mask) Variant::mask_transposed(acc_s[0], thread_key0, thread_query0, vis);
            if constexpr (!Variant::SOFTCAP)
                exponentiate<T>(acc_s[0], lse, variant, p.scale_log2, offset0);
            wgmma_wait_group<0>();
            pin_registers(acc_dp);

            // P^T and dS^T into registers (A operands of dV, dK), dS^T transposed into the dS
            // tile (A operand of dQ).
            score_gradients<Elem, T>(p_frag, ds_frag, acc_s[0], acc_dp, lse, variant, p.scale_log2,
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
            const u32 k_chunk = k_smem + chunk * T::CHUNK_KV_BYTES;
            const int dq_buf = j % T::DQ_RING;  // DQ_STAGED
            const u32 dq_tile = dq_smem + dq_buf * T::DQ_TILE_BYTES + 4 * dq_row0 * HEAD_DIM;
            const u32 dq_full = smem_address(&bars.dq_full[dq_buf]);
            const u32 dq_empty = smem_address(&bars.dq_empty[dq_buf]);
            // Staged buffers start empty; the ordered vector reductions' turn starts not given.
            const u32 dq_empty_parity = ((j / T::DQ_RING) & 1) ^ (T::DQ_STAGED ? 1u : 0u);
            if (consumer == 0) {
                float acc_dq[T::DQ_COLS_0 / 8][4];
                pin_registers(acc_dq);
                wgmma_fence();
                issue_dq<Elem, T, 0, T::DQ_COLS_0>(acc_dq, ds_rows, k_chunk);
                wgmma_commit_group();
                if constexpr (DK_BEHIND_DQ) {
                    issue_key_gradient<Elem, T, T::CHUNK_COLS>(acc_dk, ds_frag, q_tile + b_chunk);
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
                write_dq<T, 0, T::DQ_COLS_0, DETERMINISTIC>(acc_dq, dq_block, dq_tile, dq_full,
                                                            dq_empty, dq_empty_parity, true, warp,
                                                            lane);
                if constexpr (DK_BEHIND_DQ) {
                    wgmma_wait_group<0>();
                    pin_registers(acc_dk);
                    pin_registers(ds_frag);
                    mbarrier_arrive(smem_address(&bars.stage_empty[stage]));
                }
            } else {
                // The narrower last chunk (d=192: 64 columns, one panel) is consumer 0's alone:
                // there, this product reads the panel past K (V's first, not written before the
                // epilogue) and is not added.
                float acc_dq[T::DQ_COLS_1 / 8][4];
                pin_registers(acc_dq);
                wgmma_fence();
                issue_dq<Elem, T, T::DQ_COL0_1, T::DQ_COLS_1>(acc_dq, ds_rows, k_chunk);
                wgmma_commit_group();
                if constexpr (DK_BEHIND_DQ) {
                    issue_key_gradient<Elem, T, T::CHUNK_COLS>(acc_dk, ds_frag, q_tile + b_chunk);
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
                write_dq<T, T::DQ_COL0_1, T::DQ_COLS_1, DETERMINISTIC>(
                    acc_dq, dq_block, dq_tile, dq_full, dq_empty, dq_empty_parity, !narrow, warp,
                    lane);
                if constexpr (DK_BEHIND_DQ) {
                    wgmma_wait_group<0>();
                    pin_registers(acc_dk);
                    pin_registers(ds_frag);
                    mbarrier_arrive(smem_address(&bars.stage_empty[stage]));
                }
            }

            walk.advance();
        }

        // Epilogue: dK *= softmax_scale; stage dK into this consumer's rows of the K tile and dV
        // into its rows of V (same swizzled layout: conflict-free 4-byte stores) once both
        // consumers are done reading K and V (dQ reads all of K), then 16-byte row chunks to
        // global memory with row and head-dim guards.
        named_barrier_sync(T::EPILOGUE_BARRIER, T::CONSUMER_THREADS);
        fence_proxy_async_shared();  // K and V were last read by wgmma (async proxy)
        stage_dkdv<Elem, T>(p, acc_dk, acc_dv, k_smem, v_smem, key0, warp, lane);
        named_barrier_sync(T::STORE_BARRIER + consumer, T::WARPGROUP_THREADS);
        store_dkdv<T>(p, k_smem, v_smem, dk_block, dv_block, key_first, seqlen_k, head_chunks,
                      col0, key0, threadIdx.x % T::WARPGROUP_THREADS);
    }
}
