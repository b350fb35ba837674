// FlashAttention-2 backward, main kernel (Dao, 2023, Algorithm 2) on mma.sync m16n8k16.
//
// Grid: (KV block x head-dim chunk, KV head, batch). KV is the outer loop: a CTA keeps one block of
// K and V in shared memory and dK, dV of that block in registers, and walks over the Q blocks
// (of every query head that shares this KV head, so GQA's dK/dV sums stay in fp32 registers)
// whose rows can see its keys. P is recomputed from the saved logsumexp; nothing of size
// seqlen_q x seqlen_k is ever stored in global memory.
//
// Each step (one Q block of BLOCK_M rows against the BLOCK_N keys) has three phases, each with its
// own split of the (rows x columns) work over the warps, as in FA2, so that every warp's
// fragments are reused by several mma (32 x 32 warp tiles where registers allow):
//   A. warps tile (queries x keys):   S = Q K^T,  P = exp2(S * scale_log2 - lse_log2),
//                                     dP = dO V^T, dS = P o (dP - D);  P and dS -> shared memory
//   B. warps tile (keys x head dim):  dV += P^T dO,  dK += dS^T Q      (registers, whole loop)
//   C. warps tile (queries x head dim): dQ = dS K, added to an fp32 accumulator with atomics
//      (red.global.add; other KV blocks add to the same rows; layout in dq_accum.cuh), zeroed
//      by the preprocess kernel before and converted by a separate kernel after.
// With COMPUTE_DQ false (deterministic mode) phase C is left out and flash_bwd_dq.cu computes dQ
// without atomics.
//
// Head dims above 128 are split into chunks (grid.x): each CTA recomputes S and dP over the full
// head dim but accumulates dK, dV, dQ only for its D_CHUNK columns, which keeps dK and dV in
// registers.
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"
#include "variant.cuh"
#include "warp_gemm.cuh"
#include "dq_accum.cuh"
#include "varlen.cuh"
#include "dropout.cuh"
#include "kernel_params.cuh"
#include "constants.cuh"

template <int HEAD_DIM, int D_CHUNK, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int SDP_WARPS_M,
          int KV_WARPS_N, int DQ_WARPS_M, int Q_STAGES>
struct BwdTraits {
    static constexpr int THREADS = NUM_WARPS * 32;
    static constexpr int D_STEPS = HEAD_DIM / 16;  // k16 steps of S and dP (full head dim)
    // Phase A: SDP_WARPS_M x SDP_WARPS_N warps over (BLOCK_M queries x BLOCK_N keys).
    static constexpr int SDP_WARPS_N = NUM_WARPS / SDP_WARPS_M;
    static constexpr int SDP_ROWS = BLOCK_M / SDP_WARPS_M;
    static constexpr int SDP_KEYS = BLOCK_N / SDP_WARPS_N;
    static constexpr int SDP_MT = SDP_ROWS / 16;
    static constexpr int SDP_NT = SDP_KEYS / 8;
    // Phase B: KV_WARPS_N x KV_WARPS_D warps over (BLOCK_N keys x D_CHUNK columns).
    static constexpr int KV_WARPS_D = NUM_WARPS / KV_WARPS_N;
    static constexpr int KV_KEYS = BLOCK_N / KV_WARPS_N;
    static constexpr int KV_COLS = D_CHUNK / KV_WARPS_D;
    static constexpr int KV_MT = KV_KEYS / 16;
    static constexpr int KV_NT = KV_COLS / 8;
    // Phase C: DQ_WARPS_M x DQ_WARPS_D warps over (BLOCK_M queries x D_CHUNK columns).
    static constexpr int DQ_WARPS_D = NUM_WARPS / DQ_WARPS_M;
    static constexpr int DQ_ROWS = BLOCK_M / DQ_WARPS_M;
    static constexpr int DQ_COLS = D_CHUNK / DQ_WARPS_D;
    static constexpr int DQ_MT = DQ_ROWS / 16;
    static constexpr int DQ_NT = DQ_COLS / 8;

    using KVTile = SwizzledTile<BLOCK_N, HEAD_DIM>;
    using QTile = SwizzledTile<BLOCK_M, HEAD_DIM>;
    using PTile = SwizzledTile<BLOCK_M, BLOCK_N>;  // P and dS: query rows x key columns
    // Shared memory: K, V | Q_STAGES x (Q, dO, lse_log2, D) | P, dS
    static constexpr int STAT_BYTES = BLOCK_M * 4;
    static constexpr int STAGE_BYTES = 2 * QTile::BYTES + 2 * STAT_BYTES;
    static constexpr int SMEM_BYTES = 2 * KVTile::BYTES + Q_STAGES * STAGE_BYTES + 2 * PTile::BYTES;

    static_assert(SDP_WARPS_M * SDP_WARPS_N == NUM_WARPS && KV_WARPS_N * KV_WARPS_D == NUM_WARPS &&
                      DQ_WARPS_M * DQ_WARPS_D == NUM_WARPS,
                  "each phase's warp grid must use every warp");
    static_assert(SDP_ROWS % 16 == 0 && SDP_KEYS % 16 == 0, "phase A warp tiles are 16k x 16k");
    static_assert(KV_KEYS % 16 == 0 && KV_COLS % 16 == 0, "phase B warp tiles are 16k x 16k");
    static_assert(DQ_ROWS % 16 == 0 && DQ_COLS % 16 == 0, "phase C warp tiles are 16k x 16k");
    static_assert(Q_STAGES == 1 || Q_STAGES == 2, "single or double-buffered Q/dO");
    static_assert(BWD_ROW_PADDING % BLOCK_M == 0, "the per-row statistics cover whole Q blocks");
    static_assert(STAGE_BYTES % 128 == 0, "stages keep the 128-byte bank alignment of the tiles");
};

// FEATURES: the attention variant's features (variant.cuh: softcap, ALiBi), varlen batches
// (varlen.cuh) and dropout (dropout.cuh); 0 for plain attention. The parameters: BwdParams
// (kernel_params.cuh).
template <typename Elem, int HEAD_DIM, int D_CHUNK, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          int SDP_WARPS_M, int KV_WARPS_N, int DQ_WARPS_M, int Q_STAGES, bool COMPUTE_DQ,
          int FEATURES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_kernel(const __grid_constant__ BwdParams p) {
    using T = BwdTraits<HEAD_DIM, D_CHUNK, BLOCK_M, BLOCK_N, NUM_WARPS, SDP_WARPS_M, KV_WARPS_N,
                        DQ_WARPS_M, Q_STAGES>;
    using KVTile = typename T::KVTile;
    using QTile = typename T::QTile;
    using PTile = typename T::PTile;
    constexpr int NUM_CHUNKS = HEAD_DIM / D_CHUNK;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 k_smem = smem_address(smem);
    const u32 v_smem = k_smem + KVTile::BYTES;
    const u32 q_smem = v_smem + KVTile::BYTES;  // stage 0: Q, dO, lse_log2, D
    const u32 do_smem = q_smem + QTile::BYTES;
    const u32 p_smem = q_smem + Q_STAGES * T::STAGE_BYTES;
    const u32 ds_smem = p_smem + PTile::BYTES;
    const float* const stats = reinterpret_cast<const float*>(smem + 2 * KVTile::BYTES + 2 * QTile::BYTES);

    const int tid = threadIdx.x;
    const int kv_block = blockIdx.x / NUM_CHUNKS;
    const int col0 = (blockIdx.x % NUM_CHUNKS) * D_CHUNK;  // first column of this CTA's dK, dV, dQ
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int key_first = kv_block * BLOCK_N;
    // This batch entry's rows (varlen: one packed sequence; its blocks past the end exit).
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    const SequenceRows seq_q = query_rows<VARLEN>(p, batch);
    const SequenceRows seq_k = key_rows<VARLEN>(p, batch);
    const int seqlen_q = seq_q.length;
    const int seqlen_k = seq_k.length;
    if (VARLEN && key_first >= seqlen_k) return;
    // First row of this sequence's per-row statistics / dQ accumulator for query head `head`.
    auto stats_first = [&](int head) {
        return stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq_q.start);
    };
    const int key_last = min(key_first + BLOCK_N, seqlen_k) - 1;
    const int head_chunks = p.head_dim / 8;

    // Q blocks whose rows can see keys [key_first, key_last] (causal / window).
    using Variant = AttentionVariant<FEATURES>;
    const KeyVisibility vis =
        Variant::visibility(seqlen_q, seqlen_k, p.window_left, p.window_right);
    int row_begin = 0, row_end = seqlen_q;
    if (p.window_right >= 0) row_begin = max(0, key_first - vis.diag - p.window_right);
    if (p.window_left >= 0) row_end = min(seqlen_q, key_last - vis.diag + p.window_left + 1);
    const int m_first = row_begin / BLOCK_M;
    const int m_count = row_end > row_begin ? (row_end + BLOCK_M - 1) / BLOCK_M - m_first : 0;
    const int steps = m_count * p.heads_per_kv_head;  // (query head, Q block) pairs

    float acc_dk[T::KV_MT][T::KV_NT][4], acc_dv[T::KV_MT][T::KV_NT][4];
    zero_fill(acc_dk);
    zero_fill(acc_dv);

    // Per-thread copy addresses are rebuilt from a fresh thread index on each step rather than
    // kept across the loop (registers the dK/dV accumulators need).
    auto load_step = [&](int head, int row0, u32 stage_offset) {
        const int tid = thread_index_fresh();
        const u16* q_rows = p.q + batch * p.q_batch_stride + head * p.q_head_stride +
                            (seq_q.start + row0) * p.q_row_stride;
        const u16* do_rows = p.dout + batch * p.do_batch_stride + head * p.do_head_stride +
                             (seq_q.start + row0) * p.do_row_stride;
        load_tile_async<QTile, T::THREADS>(q_smem + stage_offset, q_rows, p.q_row_stride,
                                            seqlen_q - row0, head_chunks, tid);
        load_tile_async<QTile, T::THREADS>(do_smem + stage_offset, do_rows, p.do_row_stride,
                                            seqlen_q - row0, head_chunks, tid);
        // lse_log2 and D are padded to whole Q blocks (+inf / 0), so they need no predicate.
        const i64 stat0 = stats_first(head) + row0;
        const u32 stat_smem = q_smem + stage_offset + 2 * QTile::BYTES;
        for (int i = tid; i < 2 * BLOCK_M / 4; i += T::THREADS) {
            const float* src =
                (i < BLOCK_M / 4 ? p.lse_log2 : p.delta) + stat0 + 4 * (i % (BLOCK_M / 4));
            cp_async_16(stat_smem + 16 * i, src, true);
        }
    };

    if (steps > 0) {
        const u16* k_block = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                             (seq_k.start + key_first) * p.k_row_stride;
        const u16* v_block = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                             (seq_k.start + key_first) * p.v_row_stride;
        load_tile_async<KVTile, T::THREADS>(k_smem, k_block, p.k_row_stride,
                                             seqlen_k - key_first, head_chunks, tid);
        load_tile_async<KVTile, T::THREADS>(v_smem, v_block, p.v_row_stride,
                                             seqlen_k - key_first, head_chunks, tid);
        load_step(kv_head * p.heads_per_kv_head, m_first * BLOCK_M, 0);
        cp_async_commit();
    }

    // The step's query head and Q block, advanced incrementally (no divisions in the loop).
    int head = kv_head * p.heads_per_kv_head;
    int m_block = m_first;
    u32 stage_offset = 0;
    for (int step = 0; step < steps; ++step) {
        const int row0 = m_block * BLOCK_M;
        int next_head = head, next_m_block = m_block + 1;
        if (next_m_block == m_first + m_count) {
            next_m_block = m_first;
            ++next_head;
        }
        cp_async_wait<0>();
        __syncthreads();  // this step's Q, dO, stats landed; every warp is done with P, dS and
                          // with the other stage
        if constexpr (Q_STAGES == 2) {
            if (step + 1 < steps) {
                load_step(next_head, next_m_block * BLOCK_M, stage_offset ^ T::STAGE_BYTES);
                cp_async_commit();
            }
        }
        // Warp positions and fragment cursors are rebuilt from a fresh thread index every step
        // (a few integer ops) instead of being held across the loop.
        const int lane = thread_index_fresh() % 32;
        const int warp = thread_index_fresh() / 32;
        const u32 q_stage = q_smem + stage_offset;
        const u32 do_stage = do_smem + stage_offset;

        // ---- Phase A: this warp's SDP_ROWS queries x SDP_KEYS keys of S, P, dP, dS -------------
        {
            const int a_row0 = (warp % SDP_WARPS_M) * T::SDP_ROWS;  // within the Q block
            const int a_key0 = (warp / SDP_WARPS_M) * T::SDP_KEYS;  // within the KV block
            float acc_s[T::SDP_MT][T::SDP_NT][4];
            zero_fill(acc_s);
            gemm_a_bt<Elem, T::SDP_MT, T::SDP_NT, T::D_STEPS>(
                acc_s, rows_cursor<QTile>(q_stage, a_row0, lane),
                pairs_cursor<KVTile>(k_smem, a_key0, lane));
            Variant variant(p.mods, seqlen_q, seqlen_k);
            variant.select_head(p.mods, batch, head);
            variant.apply_softcap(acc_s);  // t = tanh(...) with softcap; the bias comes with P
            const int row_last = min(row0 + BLOCK_M, seqlen_q) - 1;
            const bool needs_mask =
                key_first + BLOCK_N > seqlen_k ||
                (p.window_right >= 0 && key_last > row0 + vis.diag + p.window_right) ||
                (p.window_left >= 0 && key_first < row_last + vis.diag - p.window_left);
            if (needs_mask)
                Variant::mask(acc_s, row0 + a_row0 + lane / 4,
                              key_first + a_key0 + 2 * (lane % 4), vis);
            // P = exp2((S + bias) * scale_log2 - lse_log2[row]): rows 16 mt + 8 half + lane / 4.
            // With softcap, P is stored right away and acc_s keeps P * (1 - t^2), the factor dS
            // needs (no extra registers for t). With dropout, the keep bits of each 16 x 16
            // block are drawn here; acc_s carries them in its sign bit (a dropped value is
            // stored negated; P >= 0, and -0.f keeps the bit) until dS is formed, and the P
            // tile gets P * Z, Z = keep / (1 - p): dV = (P o Z)^T dO.
            constexpr bool DROPOUT = (FEATURES & FEATURE_DROPOUT) != 0;
            const Dropout dropout(p.dropout, static_cast<u32>(batch * p.nheads + head));
            const float* lse_s = stats + stage_offset / 4 + a_row0 + lane / 4;
#pragma unroll
            for (int mt = 0; mt < T::SDP_MT; ++mt) {
                u32 keep[T::SDP_NT / 2];
#pragma unroll
                for (int np = 0; np < T::SDP_NT / 2; ++np)
                    keep[np] = DROPOUT ? dropout.keep_bits(row0 + a_row0 + 16 * mt,
                                                           key_first + a_key0 + 16 * np, lane)
                                       : 0xffu;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float row_lse = lse_s[16 * mt + 8 * half];
                    const int row_in_block = a_row0 + 16 * mt + 8 * half + lane / 4;
                    const float row = static_cast<float>(row0 + row_in_block);
#pragma unroll
                    for (int nt = 0; nt < T::SDP_NT; ++nt) {
                        float prob[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& s = acc_s[mt][nt][2 * half + e];
                            const float key = static_cast<float>(key_first + a_key0 + 8 * nt +
                                                                 2 * (lane % 4) + e);
                            prob[e] = fast_exp2(
                                fmaf(variant.biased(s, row, key), p.scale_log2, -row_lse));
                            s = Variant::SOFTCAP ? prob[e] * variant.dtanh(s) : prob[e];
                            if constexpr (DROPOUT) {
                                const bool kept =
                                    (keep[nt / 2] >> dropout_index(half, nt % 2, e)) & 1u;
                                if (!kept) s = -s;
                                prob[e] = kept ? prob[e] * p.dropout.scale : 0.f;
                            }
                        }
                        if constexpr (Variant::SOFTCAP)
                            store_4B_shared(p_smem + PTile::offset(row_in_block, a_key0 / 8 + nt) +
                                                4 * (lane % 4),
                                            pack_pair<Elem>(prob[0], prob[1]));
                    }
                }
            }

            float acc_dp[T::SDP_MT][T::SDP_NT][4];
            zero_fill(acc_dp);
            gemm_a_bt<Elem, T::SDP_MT, T::SDP_NT, T::D_STEPS>(
                acc_dp, rows_cursor<QTile>(do_stage, a_row0, lane),
                pairs_cursor<KVTile>(v_smem, a_key0, lane));
            // dS = P o (dP - D[row]) (the softmax scale is applied to dK and dQ at the end).
            const float* delta_s = lse_s + BLOCK_M;
#pragma unroll
            for (int mt = 0; mt < T::SDP_MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float row_delta = delta_s[16 * mt + 8 * half];
#pragma unroll
                    for (int nt = 0; nt < T::SDP_NT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& dp = acc_dp[mt][nt][2 * half + e];
                            float& s = acc_s[mt][nt][2 * half + e];
                            if constexpr (DROPOUT) {
                                // dS = P o (dP o Z - D); the P tile gets P o Z.
                                const float z = signbit(s) ? 0.f : p.dropout.scale;
                                s = fabsf(s);
                                dp = s * (dp * z - row_delta);
                                s *= z;
                            } else {
                                dp = s * (dp - row_delta);
                            }
                        }
                }
            // The stores come after both products: the compiler keeps shared-memory stores and
            // ldmatrix in program order, so storing P earlier would keep the dP product from
            // overlapping the exp2 work above.
            if constexpr (!Variant::SOFTCAP)
                store_accumulator<Elem, PTile>(p_smem, acc_s, a_row0, a_key0 / 8, lane);
            store_accumulator<Elem, PTile>(ds_smem, acc_dp, a_row0, a_key0 / 8, lane);
        }
        __syncthreads();  // P and dS complete

        // ---- Phase B: this warp's KV_KEYS keys x KV_COLS columns of dV and dK ----------------
        {
            const int b_key_pair0 = (warp % KV_WARPS_N) * T::KV_KEYS / 16;
            const int b_col_pair0 = (col0 + (warp / KV_WARPS_N) * T::KV_COLS) / 16;
            gemm_at_b<Elem, T::KV_MT, T::KV_NT, BLOCK_M / 16>(
                acc_dv, pairs_cursor<PTile>(p_smem, 0, lane), b_key_pair0,
                rows_cursor<QTile>(do_stage, 0, lane), b_col_pair0);
            gemm_at_b<Elem, T::KV_MT, T::KV_NT, BLOCK_M / 16>(
                acc_dk, pairs_cursor<PTile>(ds_smem, 0, lane), b_key_pair0,
                rows_cursor<QTile>(q_stage, 0, lane), b_col_pair0);
        }

        // ---- Phase C: this warp's DQ_ROWS queries x DQ_COLS columns of dQ = dS K -------------
        if constexpr (COMPUTE_DQ) {
            const int c_row0 = (warp % DQ_WARPS_M) * T::DQ_ROWS;
            const int c_col0 = col0 + (warp / DQ_WARPS_M) * T::DQ_COLS;
            float acc_dq[T::DQ_MT][T::DQ_NT][4];
            zero_fill(acc_dq);
            gemm_a_b<Elem, T::DQ_MT, T::DQ_NT, BLOCK_N / 16>(
                acc_dq, rows_cursor<PTile>(ds_smem, c_row0, lane),
                rows_cursor<KVTile>(k_smem, 0, lane), c_col0 / 16);
            // Columns 16 np .. 16 np + 15 of a row: this thread's four values are adjacent in
            // the accumulator's interleaved layout (dq_accum.cuh), one vector atomic.
            float* dq_rows = p.dq_accum +
                             (stats_first(head) + row0 +
                              c_row0 + lane / 4) * HEAD_DIM + c_col0 + 4 * (lane % 4);
#pragma unroll
            for (int mt = 0; mt < T::DQ_MT; ++mt)
#pragma unroll
                for (int np = 0; np < T::DQ_NT / 2; ++np)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        atomic_add_4(dq_rows + (16 * mt + 8 * half) * HEAD_DIM + 16 * np,
                                     acc_dq[mt][2 * np][2 * half], acc_dq[mt][2 * np][2 * half + 1],
                                     acc_dq[mt][2 * np + 1][2 * half],
                                     acc_dq[mt][2 * np + 1][2 * half + 1]);
        }

        if constexpr (Q_STAGES == 2) {
            stage_offset ^= T::STAGE_BYTES;
        } else if (step + 1 < steps) {
            __syncthreads();  // every warp is done with Q and dO of this step
            load_step(next_head, next_m_block * BLOCK_M, 0);
            cp_async_commit();
        }
        head = next_head;
        m_block = next_m_block;
    }

    // Epilogue: dK *= softmax_scale; stage dK and dV of this chunk through the K and V tiles
    // (16-byte rows) and store the rows that exist. A block no query sees writes zeros.
    __syncthreads();  // every warp is done reading K and V
    {
        const int lane = tid % 32;
        const int warp = tid / 32;
        const int e_key0 = (warp % KV_WARPS_N) * T::KV_KEYS;
        const int e_chunk0 = (warp / KV_WARPS_N) * T::KV_COLS / 8;  // within the chunk
        store_accumulator<Elem, KVTile>(k_smem, acc_dk, e_key0, e_chunk0, lane,
                                        p.softmax_scale);
        store_accumulator<Elem, KVTile>(v_smem, acc_dv, e_key0, e_chunk0, lane);
    }
    __syncthreads();
    // > 0: the second chunk of a kernel head dim starts below every user head dim it serves.
    const int chunk_cols = min(D_CHUNK, p.head_dim - col0);
    constexpr int CHUNK_CHUNKS = D_CHUNK / 8;
    u16* dk_block = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
                    (seq_k.start + key_first) * p.dk_row_stride + col0;
    u16* dv_block = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
                    (seq_k.start + key_first) * p.dv_row_stride + col0;
    for (int idx = tid; idx < BLOCK_N * CHUNK_CHUNKS; idx += T::THREADS) {
        const int row = idx / CHUNK_CHUNKS;
        const int c = idx % CHUNK_CHUNKS;
        if (key_first + row < seqlen_k && 8 * c < chunk_cols) {
            u32 vals[4];
            load_16B_shared(vals, k_smem + KVTile::offset(row, c));
            store_16B_global(dk_block + row * p.dk_row_stride + 8 * c, vals);
            load_16B_shared(vals, v_smem + KVTile::offset(row, c));
            store_16B_global(dv_block + row * p.dv_row_stride + 8 * c, vals);
        }
    }
}
