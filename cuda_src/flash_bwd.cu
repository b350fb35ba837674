// FlashAttention-2 backward, main kernel (Dao, 2023, Algorithm 2) on mma.sync m16n8k16.
//
// Grid: (KV block x head-dim chunk, KV head, batch). KV is the outer loop: a CTA keeps one block of
// K and V in shared memory and dK, dV of that block in registers, and walks over the Q blocks
// (of every query head that shares this KV head, so GQA's dK/dV sums stay in fp32 registers)
// whose rows can see its keys. P is recomputed from the saved logsumexp; nothing of size
// seqlen_q x seqlen_k is ever stored in global memory.
//
// Each warp owns 16 key rows of the KV block and holds the transposed tiles S^T, P^T, dP^T, dS^T
// of its rows, so four of the five products keep their operands in registers or shared memory
// without any cross-warp exchange:
//   S^T  = K_w Q^T             P^T = exp2(S^T * scale_log2 - lse_log2)
//   dV_w += P^T dO             dP^T = V_w dO^T
//   dS^T = P^T o (dP^T - D)    dK_w += dS^T Q
// The fifth, dQ += dS K, needs all key rows: dS^T goes through shared memory, the warps split the
// (Q rows x head dim) tile, and the partial dQ is added to an fp32 accumulator with atomics
// (red.global.add), converted to the input dtype by a separate kernel at the end.
//
// With COMPUTE_DQ false (deterministic mode) the kernel computes dK and dV only, and
// flash_bwd_dq.cu computes dQ without atomics.
//
// Head dims above 128 are split into two chunks (grid.x): each CTA recomputes S and dP over the
// full head dim but accumulates dK, dV, dQ only for its chunk, which keeps dK and dV of 16 rows
// in registers.
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"
#include "masking.cuh"

template <typename Elem, int HEAD_DIM, int D_CHUNK, int BLOCK_M, int BLOCK_N, int Q_STAGES>
struct BwdTraits {
    static constexpr int NUM_WARPS = BLOCK_N / 16;  // each warp owns 16 key rows
    static constexpr int THREADS = NUM_WARPS * 32;
    static constexpr int Q_TILES = BLOCK_M / 8;        // n8 tiles of S^T (query columns)
    static constexpr int DC_TILES = D_CHUNK / 8;       // n8 tiles of dK, dV (head-dim chunk)
    static constexpr int D_STEPS = HEAD_DIM / 16;      // k16 steps over the full head dim
    static constexpr int Q_STEPS = BLOCK_M / 16;       // k16 steps over query rows
    static constexpr int KV_STEPS = BLOCK_N / 16;      // k16 steps over key rows
    // dQ = dS K: warps form a DQ_WARPS_M x DQ_WARPS_N grid over (BLOCK_M x D_CHUNK); each warp
    // covers 16 rows and DQ_COLS columns, DQ_PASS_COLS (<= 64) at a time.
    static constexpr int DQ_WARPS_M = BLOCK_M / 16;
    static constexpr int DQ_WARPS_N = NUM_WARPS / DQ_WARPS_M;
    static constexpr int DQ_COLS = D_CHUNK / DQ_WARPS_N;
    static constexpr int DQ_PASS_COLS = DQ_COLS > 64 && DQ_COLS % 64 == 0 ? 64 : DQ_COLS;
    static constexpr int DQ_PASSES = DQ_COLS / DQ_PASS_COLS;
    using KVTile = SwizzledTile<BLOCK_N, HEAD_DIM>;
    using QTile = SwizzledTile<BLOCK_M, HEAD_DIM>;
    using DSTile = SwizzledTile<BLOCK_N, BLOCK_M>;  // dS^T: key rows x query columns
    // Shared memory: K, V | Q_STAGES x (Q, dO, lse_log2, D) | dS^T
    static constexpr int STAT_BYTES = BLOCK_M * 4;
    static constexpr int STAGE_BYTES = 2 * QTile::BYTES + 2 * STAT_BYTES;
    static constexpr int SMEM_BYTES = 2 * KVTile::BYTES + Q_STAGES * STAGE_BYTES + DSTile::BYTES;
    static_assert(DQ_WARPS_M * DQ_WARPS_N == NUM_WARPS, "dQ warp grid must use every warp");
    static_assert(DQ_COLS % 16 == 0 && D_CHUNK % 16 == 0, "fragments are loaded in pairs");
    static_assert(Q_STAGES == 1 || Q_STAGES == 2, "single or double-buffered Q/dO");
};

// acc[nt] += A (16 rows of `a_frag`'s tile, over the full head dim) * B^T, where B's rows
// (`b_frag`'s tile, non-transposed) are the n dimension: S^T = K_w Q^T and dP^T = V_w dO^T.
template <typename Elem, class T, class ATile, class BTile>
CF2_DEVICE void gemm_rows_by_rows(float (&acc)[1][T::Q_TILES][4], const LdmatrixCursor<ATile>& a_frag,
                                  const LdmatrixCursor<BTile>& b_frag, u32 b_offset) {
#pragma unroll 1
    for (int ks = 0; ks < T::D_STEPS; ++ks) {
        u32 a[4];
        ldmatrix_x4(a, a_frag.at(0, ks));
#pragma unroll
        for (int np = 0; np < T::Q_TILES / 2; ++np) {
            u32 b[4];
            ldmatrix_x4(b, b_frag.at(2 * np, ks) + b_offset);
            mma_m16n16k16<Elem>(acc[0][2 * np], acc[0][2 * np + 1], a, b);
        }
    }
}

// acc (16 key rows x head-dim chunk) += X^T (registers, 16 x BLOCK_M, accumulator layout) * Y,
// Y = a (BLOCK_M x head dim) tile read transposed: dV += P^T dO and dK += dS^T Q.
template <typename Elem, class T, class YTile>
CF2_DEVICE void gemm_regs_by_tile(float (&acc)[T::DC_TILES][4], const float (&x)[1][T::Q_TILES][4],
                                  const LdmatrixCursor<YTile>& y_frag, u32 y_offset,
                                  int chunk_pair0) {
#pragma unroll
    for (int ks = 0; ks < T::Q_STEPS; ++ks) {
        u32 a[4];
        a[0] = pack_pair<Elem>(x[0][2 * ks][0], x[0][2 * ks][1]);
        a[1] = pack_pair<Elem>(x[0][2 * ks][2], x[0][2 * ks][3]);
        a[2] = pack_pair<Elem>(x[0][2 * ks + 1][0], x[0][2 * ks + 1][1]);
        a[3] = pack_pair<Elem>(x[0][2 * ks + 1][2], x[0][2 * ks + 1][3]);
#pragma unroll
        for (int dp = 0; dp < T::DC_TILES / 2; ++dp) {
            u32 b[4];
            ldmatrix_x4_trans(b, y_frag.at(2 * ks, chunk_pair0 + dp) + y_offset);
            mma_m16n16k16<Elem>(acc[2 * dp], acc[2 * dp + 1], a, b);
        }
    }
}

template <typename Elem, int HEAD_DIM, int D_CHUNK, int BLOCK_M, int BLOCK_N, int Q_STAGES,
          bool COMPUTE_DQ>
__global__ void __launch_bounds__(BLOCK_N * 2, 1)
flash_bwd_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 const u16* __restrict__ dout, const float* __restrict__ lse_log2,
                 const float* __restrict__ delta, float* __restrict__ dq_accum,
                 u16* __restrict__ dk, u16* __restrict__ dv,
                 i64 q_batch_stride, i64 q_row_stride, i64 q_head_stride,
                 i64 k_batch_stride, i64 k_row_stride, i64 k_head_stride,
                 i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride,
                 i64 do_batch_stride, i64 do_row_stride, i64 do_head_stride,
                 i64 dk_batch_stride, i64 dk_row_stride, i64 dk_head_stride,
                 i64 dv_batch_stride, i64 dv_row_stride, i64 dv_head_stride,
                 int seqlen_q, int seqlen_q_padded, int seqlen_k, int nheads,
                 int heads_per_kv_head, int head_dim, float softmax_scale, float scale_log2,
                 int window_left, int window_right, int batch_offset) {
    using T = BwdTraits<Elem, HEAD_DIM, D_CHUNK, BLOCK_M, BLOCK_N, Q_STAGES>;
    using KVTile = typename T::KVTile;
    using QTile = typename T::QTile;
    using DSTile = typename T::DSTile;
    constexpr int NUM_CHUNKS = HEAD_DIM / D_CHUNK;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 k_smem = smem_address(smem);
    const u32 v_smem = k_smem + KVTile::BYTES;
    const u32 q_smem = v_smem + KVTile::BYTES;  // stage 0: Q, dO, lse_log2, D
    const u32 do_smem = q_smem + QTile::BYTES;
    const u32 ds_smem = q_smem + Q_STAGES * T::STAGE_BYTES;
    float* const stats = reinterpret_cast<float*>(smem + 2 * KVTile::BYTES + 2 * QTile::BYTES);

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int kv_block = blockIdx.x / NUM_CHUNKS;
    const int chunk = blockIdx.x % NUM_CHUNKS;
    const int col0 = chunk * D_CHUNK;  // first head-dim column of this CTA's dK, dV, dQ
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z + batch_offset;
    const int key_first = kv_block * BLOCK_N;
    const int key_last = min(key_first + BLOCK_N, seqlen_k) - 1;
    const int head_chunks = head_dim / 8;

    // Q blocks whose rows can see keys [key_first, key_last] (causal / window).
    const KeyVisibility vis{seqlen_k - seqlen_q, window_left, window_right, seqlen_k};
    int row_begin = 0, row_end = seqlen_q;
    if (window_right >= 0) row_begin = max(0, key_first - vis.diag - window_right);
    if (window_left >= 0) row_end = min(seqlen_q, key_last - vis.diag + window_left + 1);
    const int m_first = row_begin / BLOCK_M;
    const int m_count = row_end > row_begin ? (row_end + BLOCK_M - 1) / BLOCK_M - m_first : 0;
    const int steps = m_count * heads_per_kv_head;  // (query head, Q block) pairs

    const u16* k_block = k + batch * k_batch_stride + kv_head * k_head_stride + key_first * k_row_stride;
    const u16* v_block = v + batch * v_batch_stride + kv_head * v_head_stride + key_first * v_row_stride;

    float acc_dk[T::DC_TILES][4], acc_dv[T::DC_TILES][4];
#pragma unroll
    for (int dt = 0; dt < T::DC_TILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

    // Per-thread copy addresses are rebuilt from a fresh thread index on each step rather than
    // kept across the loop (registers the dK/dV accumulators need).
    auto load_step = [&](int step, u32 stage_offset) {
        const int tid = thread_index_fresh();
        const int head = kv_head * heads_per_kv_head + step / m_count;
        const int row0 = (m_first + step % m_count) * BLOCK_M;
        const u16* q_rows = q + batch * q_batch_stride + head * q_head_stride + row0 * q_row_stride;
        const u16* do_rows = dout + batch * do_batch_stride + head * do_head_stride + row0 * do_row_stride;
        load_tile_async<QTile, T::THREADS>(q_smem + stage_offset, q_rows, q_row_stride,
                                            seqlen_q - row0, head_chunks, tid);
        load_tile_async<QTile, T::THREADS>(do_smem + stage_offset, do_rows, do_row_stride,
                                            seqlen_q - row0, head_chunks, tid);
        // lse_log2 and D are padded to whole Q blocks (+inf / 0), so they need no predicate.
        const i64 stat0 = (static_cast<i64>(batch) * nheads + head) * seqlen_q_padded + row0;
        const u32 stat_smem = q_smem + stage_offset + 2 * QTile::BYTES;
        for (int i = tid; i < 2 * BLOCK_M / 4; i += T::THREADS) {
            const float* src = (i < BLOCK_M / 4 ? lse_log2 : delta) + stat0 + 4 * (i % (BLOCK_M / 4));
            cp_async_16(stat_smem + 16 * i, src, true);
        }
    };

    if (steps > 0) {
        load_tile_async<KVTile, T::THREADS>(k_smem, k_block, k_row_stride, seqlen_k - key_first,
                                             head_chunks, tid);
        load_tile_async<KVTile, T::THREADS>(v_smem, v_block, v_row_stride, seqlen_k - key_first,
                                             head_chunks, tid);
        load_step(0, 0);
        cp_async_commit();
    }

    u32 stage_offset = 0;
    for (int step = 0; step < steps; ++step) {
        const int head = kv_head * heads_per_kv_head + step / m_count;
        const int row0 = (m_first + step % m_count) * BLOCK_M;
        cp_async_wait<0>();
        __syncthreads();  // this step's Q, dO, stats landed; every warp is done with dS^T and
                          // with the other stage
        if constexpr (Q_STAGES == 2) {
            if (step + 1 < steps) {
                load_step(step + 1, stage_offset ^ T::STAGE_BYTES);
                cp_async_commit();
            }
        }
        // Fragment addressing (LdmatrixCursor), rebuilt from a fresh thread index every step
        // (a few integer ops) instead of held across the loop: this warp's 16 key rows of K
        // and V as A operands; Q and dO as non-transposed B operands (query rows are n) and
        // transposed B operands (query rows are k).
        const int lane_now = thread_index_fresh() % 32;
        const int warp_now = thread_index_fresh() / 32;
        const LdmatrixCursor<KVTile> k_rows_frag(k_smem, warp_now * 16 + lane_now % 16, lane_now / 16);
        const LdmatrixCursor<KVTile> v_rows_frag(v_smem, warp_now * 16 + lane_now % 16, lane_now / 16);
        const LdmatrixCursor<QTile> qt_frag(q_smem, lane_now % 8 + (lane_now / 16) * 8, (lane_now / 8) % 2);
        const LdmatrixCursor<QTile> q_frag(q_smem, lane_now % 16, lane_now / 16);
        const int key0 = key_first + warp_now * 16 + lane_now / 4;  // this thread's first key
        const float* lse_s = stats + stage_offset / 4;
        const float* delta_s = lse_s + BLOCK_M;

        // S^T = K_w Q^T, then P^T = exp2(S^T * scale_log2 - lse_log2) in place.
        float acc_s[1][T::Q_TILES][4];
#pragma unroll
        for (int nt = 0; nt < T::Q_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
        gemm_rows_by_rows<Elem, T>(acc_s, k_rows_frag, qt_frag, stage_offset);
        const int row_last = min(row0 + BLOCK_M, seqlen_q) - 1;
        const bool needs_mask =
            key_first + BLOCK_N > seqlen_k ||
            (window_right >= 0 && key_last > row0 + vis.diag + window_right) ||
            (window_left >= 0 && key_first < row_last + vis.diag - window_left);
        if (needs_mask)
            mask_scores_transposed<1, T::Q_TILES>(acc_s, key0, row0 + 2 * (lane % 4), vis);
#pragma unroll
        for (int nt = 0; nt < T::Q_TILES; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float lse_q = lse_s[8 * nt + 2 * (lane % 4) + e % 2];
                acc_s[0][nt][e] = fast_exp2(fmaf(acc_s[0][nt][e], scale_log2, -lse_q));
            }
        }

        // dV_w += P^T dO (this CTA's head-dim chunk).
        const u32 do_offset = stage_offset + QTile::BYTES;
        gemm_regs_by_tile<Elem, T>(acc_dv, acc_s, q_frag, do_offset, col0 / 16);

        // dP^T = V_w dO^T, then dS^T = P^T o (dP^T - D) in place of dP^T.
        float acc_dp[1][T::Q_TILES][4];
#pragma unroll
        for (int nt = 0; nt < T::Q_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[0][nt][e] = 0.f;
        gemm_rows_by_rows<Elem, T>(acc_dp, v_rows_frag, qt_frag, do_offset);
#pragma unroll
        for (int nt = 0; nt < T::Q_TILES; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float d_q = delta_s[8 * nt + 2 * (lane % 4) + e % 2];
                acc_dp[0][nt][e] = acc_s[0][nt][e] * (acc_dp[0][nt][e] - d_q);
            }
        }

        // dK_w += dS^T Q (the softmax scale is applied once, in the epilogue).
        gemm_regs_by_tile<Elem, T>(acc_dk, acc_dp, q_frag, stage_offset, col0 / 16);

        if constexpr (COMPUTE_DQ) {
        // dS^T to shared memory for dQ = dS K, which needs every warp's key rows.
#pragma unroll
        for (int nt = 0; nt < T::Q_TILES; ++nt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = warp * 16 + 8 * half + lane / 4;
                store_4B_shared(ds_smem + DSTile::offset(row, nt) + 4 * (lane % 4),
                                pack_pair<Elem>(acc_dp[0][nt][2 * half], acc_dp[0][nt][2 * half + 1]));
            }
        }
        __syncthreads();  // dS^T complete

        // dQ (rows row0 + 16 dq_warp_m .., columns col0 + DQ_COLS dq_warp_n ..) += dS K, added
        // to the fp32 accumulator with atomics: other KV blocks add to the same rows.
        const int dq_warp_m = warp_now % T::DQ_WARPS_M;
        const int dq_warp_n = warp_now / T::DQ_WARPS_M;
        const LdmatrixCursor<DSTile> ds_frag(ds_smem, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
        const LdmatrixCursor<KVTile> k_frag(k_smem, lane % 16, lane / 16);
        float* dq_rows = dq_accum +
                         ((static_cast<i64>(batch) * nheads + head) * seqlen_q_padded + row0 +
                          dq_warp_m * 16 + lane / 4) * HEAD_DIM;
#pragma unroll
        for (int pass = 0; pass < T::DQ_PASSES; ++pass) {
            const int pass_col0 = col0 + dq_warp_n * T::DQ_COLS + pass * T::DQ_PASS_COLS;
            float acc_dq[T::DQ_PASS_COLS / 8][4];
#pragma unroll
            for (int nt = 0; nt < T::DQ_PASS_COLS / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dq[nt][e] = 0.f;
#pragma unroll 2
            for (int ks = 0; ks < T::KV_STEPS; ++ks) {
                u32 a[4];
                ldmatrix_x4_trans(a, ds_frag.at(2 * ks, dq_warp_m));
#pragma unroll
                for (int dp = 0; dp < T::DQ_PASS_COLS / 16; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, k_frag.at(2 * ks, pass_col0 / 16 + dp));
                    mma_m16n16k16<Elem>(acc_dq[2 * dp], acc_dq[2 * dp + 1], a, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < T::DQ_PASS_COLS / 8; ++nt) {
                float* dst = dq_rows + pass_col0 + 8 * nt + 2 * (lane % 4);
                atomicAdd(dst, acc_dq[nt][0]);
                atomicAdd(dst + 1, acc_dq[nt][1]);
                atomicAdd(dst + 8 * HEAD_DIM, acc_dq[nt][2]);
                atomicAdd(dst + 8 * HEAD_DIM + 1, acc_dq[nt][3]);
            }
        }
        }  // COMPUTE_DQ (in deterministic mode flash_bwd_dq.cu computes dQ instead)

        if constexpr (Q_STAGES == 2) {
            stage_offset ^= T::STAGE_BYTES;
        } else if (step + 1 < steps) {
            __syncthreads();  // every warp is done with Q and dO of this step
            load_step(step + 1, 0);
            cp_async_commit();
        }
    }

    // Epilogue: dK *= softmax_scale; stage dK and dV of this chunk through the K and V tiles
    // (16-byte rows) and store the rows that exist. A block no query sees writes zeros.
    __syncthreads();  // every warp is done reading K and V
    // > 0: the second chunk of a kernel head dim starts below every user head dim it serves.
    const int chunk_cols = min(D_CHUNK, head_dim - col0);
#pragma unroll
    for (int dt = 0; dt < T::DC_TILES; ++dt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp * 16 + 8 * half + lane / 4;
            store_4B_shared(k_smem + KVTile::offset(row, dt) + 4 * (lane % 4),
                            pack_pair<Elem>(acc_dk[dt][2 * half] * softmax_scale,
                                            acc_dk[dt][2 * half + 1] * softmax_scale));
            store_4B_shared(v_smem + KVTile::offset(row, dt) + 4 * (lane % 4),
                            pack_pair<Elem>(acc_dv[dt][2 * half], acc_dv[dt][2 * half + 1]));
        }
    }
    __syncthreads();
    u16* dk_block = dk + batch * dk_batch_stride + kv_head * dk_head_stride + key_first * dk_row_stride + col0;
    u16* dv_block = dv + batch * dv_batch_stride + kv_head * dv_head_stride + key_first * dv_row_stride + col0;
    for (int idx = tid; idx < BLOCK_N * T::DC_TILES; idx += T::THREADS) {
        const int row = idx / T::DC_TILES;
        const int c = idx % T::DC_TILES;
        if (key_first + row < seqlen_k && 8 * c < chunk_cols) {
            u32 vals[4];
            load_16B_shared(vals, k_smem + KVTile::offset(row, c));
            store_16B_global(dk_block + row * dk_row_stride + 8 * c, vals);
            load_16B_shared(vals, v_smem + KVTile::offset(row, c));
            store_16B_global(dv_block + row * dv_row_stride + 8 * c, vals);
        }
    }
}
