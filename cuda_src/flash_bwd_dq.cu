// FlashAttention-2 backward, deterministic dQ kernel.
//
// The main backward kernel adds each KV block's share of dQ with fp32 atomics, whose order (and
// so the rounding) changes from run to run. In deterministic mode it leaves dQ out and this
// kernel computes it instead, Q-block-parallel like the forward: grid (Q block, head, batch), each
// warp owns 16 query rows and walks over the KV tiles its rows can see, recomputing
//   S = Q K^T,  P = exp2(S * scale_log2 - lse_log2),  dP = dO V^T,  dS = P o (dP - D)
// and accumulating dQ += dS K in registers, always in the same order. It costs two extra
// products (S and dP are computed by both kernels) and writes dQ directly in the input dtype.
// Float32 inputs (tf32_tag, f32x3_tag: tf32_primitives.cuh) run the same loop on m16n8k8 TF32
// mma as the forward does: tiles of words twice as wide, S and dP from ldmatrix.x4 fragments,
// dS kept fp32 in the accumulator's key order and K read in that order by 32-bit loads.
// HEAD_DIM is Q's and K's head dim (S, dQ), HEAD_DIM_V V's and dO's (dP = dO V^T; d_v != d_qk,
// below HEAD_DIM, 16-bit): their tiles have its width, dP its k steps.
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "smem_swizzle.cuh"
#include "variant.cuh"
#include "varlen.cuh"
#include "dropout.cuh"
#include "kernel_params.cuh"
#include "constants.cuh"

template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int KV_STAGES>
struct BwdDqTraits {
    static constexpr int NUM_WARPS = BWD_DQ_WARPS;
    static constexpr int BLOCK_M = 16 * NUM_WARPS;  // each warp owns 16 query rows
    static constexpr int THREADS = NUM_WARPS * 32;
    static constexpr int N_TILES = BLOCK_N / 8;
    static constexpr int D_TILES = HEAD_DIM / 8;
    // k steps of S and dP (over the head dim): 16 words each, k16 of 16-bit elements, k8 of
    // float32.
    static constexpr int D_STEPS = HEAD_DIM * Elem::WORDS / 16;
    static constexpr int D_STEPS_V = HEAD_DIM_V * Elem::WORDS / 16;  // of dP = dO V^T
    static constexpr int KV_STEPS = BLOCK_N / 16;  // k16 slices of dQ += dS K (over keys)
    using QTile = SwizzledTile<BLOCK_M, HEAD_DIM * Elem::WORDS>;
    using DOTile = SwizzledTile<BLOCK_M, HEAD_DIM_V * Elem::WORDS>;
    using KVTile = SwizzledTile<BLOCK_N, HEAD_DIM * Elem::WORDS>;  // K's (and V's: one head dim)
    using VTile = SwizzledTile<BLOCK_N, HEAD_DIM_V * Elem::WORDS>;
    // Shared memory: Q, dO | KV_STAGES x (K, V)
    static constexpr int STAGE_BYTES = KVTile::BYTES + VTile::BYTES;
    static constexpr int SMEM_BYTES = QTile::BYTES + DOTile::BYTES + KV_STAGES * STAGE_BYTES;
    static_assert(BWD_ROW_PADDING % BLOCK_M == 0, "the per-row statistics cover whole Q blocks");
    static_assert(HEAD_DIM_V <= HEAD_DIM && (HEAD_DIM_V == HEAD_DIM || !Elem::IS_F32),
                  "V's head dim at most Q's; float32: one head dim");
};

// acc (16 rows x BLOCK_N) = A (16 rows of a_frag's tile over D_STEPS k steps of the head dim)
// * B^T, B's rows the n dimension: S = Q K^T and dP = dO V^T. Float32 elements: each fragment
// split into its TF32 parts once (the ldmatrix.x4 fragments are the TF32 ones, as the forward's
// Q K^T).
template <typename Elem, class T, int D_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_dq_rows(float (&acc)[T::N_TILES][4], const LdmatrixCursor<ATile>& a_frag,
                             u32 a_offset, const LdmatrixCursor<BTile>& b_frag, u32 b_offset) {
#pragma unroll
    for (int nt = 0; nt < T::N_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
    if constexpr (Elem::IS_F32) {
#pragma unroll 2
        for (int ks = 0; ks < D_STEPS; ++ks) {
            u32 bits[4];
            ldmatrix_x4(bits, a_frag.at(0, ks) + a_offset);
            const auto a = Tf32Parts<Elem, 4>::from_bits(bits);
#pragma unroll
            for (int np = 0; np < T::N_TILES / 2; ++np) {
                ldmatrix_x4(bits, b_frag.at(2 * np, ks) + b_offset);
                mma_m16n16k8_f32<Elem>(acc[2 * np], acc[2 * np + 1], a,
                                       Tf32Parts<Elem, 4>::from_bits(bits));
            }
        }
        return;
    }
#pragma unroll 2
    for (int ks = 0; ks < D_STEPS; ++ks) {
        u32 a[4];
        ldmatrix_x4(a, a_frag.at(0, ks) + a_offset);
#pragma unroll
        for (int np = 0; np < T::N_TILES / 2; ++np) {
            u32 b[4];
            ldmatrix_x4(b, b_frag.at(2 * np, ks) + b_offset);
            mma_m16n16k16<Elem>(acc[2 * np], acc[2 * np + 1], a, b);
        }
    }
}

// The kernel's body, shared by flash_bwd_dq_kernel and flash_bwd_dq_mods_kernel (below).
// FEATURES: the attention variant's features (variant.cuh: softcap, ALiBi, the programmable
// modifiers), varlen batches (varlen.cuh) and dropout (dropout.cuh); 0 for plain attention. The
// parameters: BwdParams (kernel_params.cuh), and with the programmable modifiers their inputs
// (`user`, UserParams; an unused NoUserInputs otherwise) and the scale of the scores the softmax
// saw (`score_scale`, BwdModsParams), as flash_bwd.cu's body.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int KV_STAGES, int FEATURES,
          class UserInputs>
CF2_DEVICE void flash_bwd_dq_body(const BwdParams& p, const UserInputs& user, float score_scale) {
    using T = BwdDqTraits<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_N, KV_STAGES>;
    using QTile = typename T::QTile;
    using DOTile = typename T::DOTile;
    using KVTile = typename T::KVTile;  // K's (and V's with one head dim)
    using VTile = typename T::VTile;
    constexpr int BLOCK_M = T::BLOCK_M;
    // V's head dim its own (d_v != d_qk): dO's and V's tiles and p.head_dim_v; with one head dim
    // the kernels read p.head_dim alone and take dP's operands as ever, their machine code as it
    // was.
    constexpr bool SPLIT_DIMS = HEAD_DIM_V != HEAD_DIM;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 q_smem = smem_address(smem);
    const u32 do_smem = q_smem + QTile::BYTES;
    const u32 k_smem = do_smem + DOTile::BYTES;  // stage 0; V follows K in each stage
    const u32 v_smem = k_smem + KVTile::BYTES;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int kv_head = head / p.heads_per_kv_head;
    const int row_first = blockIdx.x * BLOCK_M;
    // This batch entry's rows (varlen: one packed sequence; its blocks past the end exit).
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    const SequenceRows seq_q = query_rows<VARLEN>(p, batch);
    const SequenceRows seq_k = key_rows<VARLEN>(p, batch);
    const int seqlen_q = seq_q.length;
    const int seqlen_k = seq_k.length;
    if (VARLEN && row_first >= seqlen_q) return;
    const int row_last = min(row_first + BLOCK_M, seqlen_q) - 1;
    const int head_chunks = p.head_dim / 8;
    const int head_chunks_v = (SPLIT_DIMS ? p.head_dim_v : p.head_dim) / 8;  // V's and dO's

    using Variant = AttentionVariant<FEATURES>;
    const KeyVisibility vis =
        Variant::visibility(seqlen_q, seqlen_k, p.window_left, p.window_right);
    int tile_first, tile_end;
    vis.tile_range(row_first, row_last, BLOCK_N, tile_first, tile_end);

    const u16* k_head = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                        seq_k.start * p.k_row_stride;
    const u16* v_head = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                        seq_k.start * p.v_row_stride;
    auto load_kv = [&](int tile, u32 stage_offset) {
        const int key0 = tile * BLOCK_N;
        load_tile_async<KVTile, T::THREADS>(k_smem + stage_offset,
                                             k_head + key0 * p.k_row_stride, p.k_row_stride,
                                             seqlen_k - key0, head_chunks, tid);
        load_tile_async<VTile, T::THREADS>(v_smem + stage_offset,
                                            v_head + key0 * p.v_row_stride, p.v_row_stride,
                                            seqlen_k - key0, head_chunks_v, tid);
    };

    if (tile_end > tile_first) {
        load_tile_async<QTile, T::THREADS>(
            q_smem,
            p.q + batch * p.q_batch_stride + head * p.q_head_stride +
                (seq_q.start + row_first) * p.q_row_stride,
            p.q_row_stride, seqlen_q - row_first, head_chunks, tid);
        load_tile_async<DOTile, T::THREADS>(
            do_smem,
            p.dout + batch * p.do_batch_stride + head * p.do_head_stride +
                (seq_q.start + row_first) * p.do_row_stride,
            p.do_row_stride, seqlen_q - row_first, head_chunks_v, tid);
        load_kv(tile_end - 1, 0);
        cp_async_commit();
    }

    // Per-row statistics of this thread's rows g and g + 8 (padded arrays: no predicate).
    const i64 stat0 =
        stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq_q.start) + row_first +
        warp * 16 + lane / 4;
    const float row_lse[2] = {p.lse_log2[stat0], p.lse_log2[stat0 + 8]};
    const float row_delta[2] = {p.delta[stat0], p.delta[stat0 + 8]};

    const LdmatrixCursor<QTile> rows_frag(q_smem, warp * 16 + lane % 16, lane / 16);  // Q, dO
    const LdmatrixCursor<KVTile> kv_rows_frag(k_smem, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    // dO and V of V's own head dim (SPLIT_DIMS; with one, dP reads them through the cursors
    // above at the tiles' offsets).
    const LdmatrixCursor<DOTile> do_rows_frag(do_smem, warp * 16 + lane % 16, lane / 16);
    const LdmatrixCursor<VTile> v_rows_frag(v_smem, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    // K as dQ += dS K's B operand, in dS's key order with float32 elements.
    const auto k_trans_frag = key_rows_b_fragments<Elem, KVTile>(k_smem, lane);
    const int thread_row0 = row_first + warp * 16 + lane / 4;
    Variant variant(p.mods, seqlen_q, seqlen_k);
    variant.select_head(p.mods, batch, head);
    constexpr bool DROPOUT = (FEATURES & FEATURE_DROPOUT) != 0;
    const Dropout dropout(p.dropout, static_cast<u32>(batch * p.nheads + head));

    float acc_dq[T::D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[dt][e] = 0.f;

    u32 stage_offset = 0;
    for (int tile = tile_end - 1; tile >= tile_first; --tile) {
        const int key0 = tile * BLOCK_N;
        cp_async_wait<0>();
        __syncthreads();  // K, V of this tile landed; every warp is done with the other stage
        if constexpr (KV_STAGES == 2) {
            if (tile > tile_first) {
                load_kv(tile - 1, stage_offset ^ T::STAGE_BYTES);
                cp_async_commit();
            }
        }

        float acc_s[T::N_TILES][4];
        gemm_dq_rows<Elem, T, T::D_STEPS>(acc_s, rows_frag, 0, kv_rows_frag, stage_offset);
        {
            float(&s)[1][T::N_TILES][4] = reinterpret_cast<float(&)[1][T::N_TILES][4]>(acc_s);
            variant.apply_softcap(s);  // t = tanh(...) with softcap; the bias comes with P
        }
        const bool needs_mask =
            key0 + BLOCK_N > seqlen_k ||
            (p.window_right >= 0 && key0 + BLOCK_N - 1 > row_first + vis.diag + p.window_right) ||
            (p.window_left >= 0 && key0 < row_last + vis.diag - p.window_left);
        if constexpr (Variant::MASK_MOD) {
            // The user's mask on every tile, as the forward (no tile is known to need none).
            float(&s)[1][T::N_TILES][4] = reinterpret_cast<float(&)[1][T::N_TILES][4]>(acc_s);
            const UserModContext ctx{user, batch, head, seqlen_q, seqlen_k, score_scale,
                                     p.mods.alibi_to_units};
            Variant::mask_mod(s, thread_row0, key0 + 2 * (lane % 4), vis, ctx);
        } else if (needs_mask) {
            float(&s)[1][T::N_TILES][4] = reinterpret_cast<float(&)[1][T::N_TILES][4]>(acc_s);
            Variant::mask(s, thread_row0, key0 + 2 * (lane % 4), vis);
        }
        float acc_dp[T::N_TILES][4];
        if constexpr (SPLIT_DIMS)
            gemm_dq_rows<Elem, T, T::D_STEPS_V>(acc_dp, do_rows_frag, 0, v_rows_frag,
                                                stage_offset);
        else
            gemm_dq_rows<Elem, T, T::D_STEPS>(acc_dp, rows_frag, QTile::BYTES, kv_rows_frag,
                                              stage_offset + KVTile::BYTES);

        // dS = P o (dP - D) (times 1 - t^2 with softcap, times the user's score modifier's
        // derivative with one: variant.cuh, score_mod_backward), packed as the A operand of
        // dQ += dS K (the scale comes at the end).
#pragma unroll
        for (int ks = 0; ks < T::KV_STEPS; ++ks) {
            // Dropout: dS = P o (dP o Z - D), Z = keep / (1 - p) of this 16 x 16 block.
            const u32 keep = DROPOUT ? dropout.keep_bits(row_first + warp * 16, key0 + 16 * ks, lane)
                                     : 0xffu;
            float ds[2][4];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float s = acc_s[2 * ks + j][e];
                    const float row = static_cast<float>(thread_row0 + 8 * (e / 2));
                    const float key =
                        static_cast<float>(key0 + 8 * (2 * ks + j) + 2 * (lane % 4) + e % 2);
                    float score = variant.biased(s, row, key);
                    float grad = 1.f;
                    if constexpr (Variant::SCORE_MOD) {
                        // The modified score, as the forward's, and its derivative.
                        const UserModContext ctx{user, batch, head, seqlen_q, seqlen_k,
                                                 score_scale, p.mods.alibi_to_units};
                        score = Variant::score_mod_backward(
                            score, thread_row0 + 8 * (e / 2),
                            key0 + 8 * (2 * ks + j) + 2 * (lane % 4) + e % 2, ctx, grad);
                    }
                    const float prob = fast_exp2(fmaf(score, p.scale_log2, -row_lse[e / 2]));
                    float dp = acc_dp[2 * ks + j][e];
                    if constexpr (DROPOUT)
                        dp = (keep >> dropout_index(e / 2, j, e % 2)) & 1u ? dp * p.dropout.scale
                                                                           : 0.f;
                    ds[j][e] = prob * (dp - row_delta[e / 2]);
                    if constexpr (Variant::SOFTCAP) ds[j][e] *= variant.dtanh(s);
                    if constexpr (Variant::SCORE_MOD) ds[j][e] *= grad;
                }
            }
            if constexpr (Elem::IS_F32) {
                // dS as the forward's P: keys 2t, 2t + 1 of each n8 tile as the TF32 A
                // fragment's columns t, t + 4 of two k8 steps (probabilities_as_a), K's rows
                // read in that order by 32-bit loads (F32KeyPairCursor).
                const float p8[8] = {ds[0][0], ds[0][1], ds[0][2], ds[0][3],
                                     ds[1][0], ds[1][1], ds[1][2], ds[1][3]};
                Tf32Parts<Elem, 4> a[2];
                probabilities_as_a<Elem>(a, p8);
#pragma unroll
                for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
#pragma unroll
                    for (int step = 0; step < 2; ++step) {
                        u32 bits[4];
#pragma unroll
                        for (int half = 0; half < 2; ++half)
#pragma unroll
                            for (int j = 0; j < 2; ++j)
                                bits[2 * half + j] = load_4B_shared(
                                    k_trans_frag.at(2 * ks + step, 2 * dp + half, j) +
                                    stage_offset);
                        mma_m16n16k8_f32<Elem>(acc_dq[2 * dp], acc_dq[2 * dp + 1], a[step],
                                               Tf32Parts<Elem, 4>::from_bits(bits));
                    }
                }
            } else {
                u32 a[4];
                a[0] = pack_pair<Elem>(ds[0][0], ds[0][1]);
                a[1] = pack_pair<Elem>(ds[0][2], ds[0][3]);
                a[2] = pack_pair<Elem>(ds[1][0], ds[1][1]);
                a[3] = pack_pair<Elem>(ds[1][2], ds[1][3]);
#pragma unroll
                for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, k_trans_frag.at(2 * ks, dp) + stage_offset);
                    mma_m16n16k16<Elem>(acc_dq[2 * dp], acc_dq[2 * dp + 1], a, b);
                }
            }
        }

        if constexpr (KV_STAGES == 2) {
            stage_offset ^= T::STAGE_BYTES;
        } else if (tile > tile_first) {
            __syncthreads();  // every warp is done with this K and V
            load_kv(tile - 1, 0);
            cp_async_commit();
        }
    }

    // Epilogue: dQ *= softmax_scale, staged through this warp's own rows of the Q tile.
    __syncwarp();
#pragma unroll
    for (int dt = 0; dt < T::D_TILES; ++dt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp * 16 + 8 * half + lane / 4;
            if constexpr (Elem::IS_F32)  // columns 8dt + 2t, +1: 8 bytes of two chunks
                store_8B_shared(q_smem + QTile::offset(row, 2 * dt + (lane % 4) / 2) +
                                    8 * (lane % 2),
                                acc_dq[dt][2 * half] * p.softmax_scale,
                                acc_dq[dt][2 * half + 1] * p.softmax_scale);
            else
                store_4B_shared(q_smem + QTile::offset(row, dt) + 4 * (lane % 4),
                                pack_pair<Elem>(acc_dq[dt][2 * half] * p.softmax_scale,
                                                acc_dq[dt][2 * half + 1] * p.softmax_scale));
        }
    }
    __syncwarp();
    u16* dq_block = p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride +
                    (seq_q.start + row_first) * p.dq_row_stride;
#pragma unroll
    for (int i = 0; i < 16 * QTile::CHUNKS / 32; ++i) {
        const int idx = lane + 32 * i;
        const int row = warp * 16 + idx / QTile::CHUNKS;
        const int chunk = idx % QTile::CHUNKS;
        if (row_first + row < seqlen_q && chunk < head_chunks) {
            u32 vals[4];
            load_16B_shared(vals, q_smem + QTile::offset(row, chunk));
            store_16B_global(dq_block + row * p.dq_row_stride + chunk * 8, vals);
        }
    }
}

// BwdParams (kernel_params.cuh): every specialisation but those with programmable modifiers.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int KV_STAGES, int FEATURES>
__global__ void __launch_bounds__(BWD_DQ_WARPS * 32, 2)
flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
    flash_bwd_dq_body<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_N, KV_STAGES, FEATURES>(p, NoUserInputs{},
                                                                                0.f);
}

// With programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD): BwdModsParams and the
// generated user_mods.cuh, whose hash MODS_HASH names the kernel, as flash_bwd_mods_kernel.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int KV_STAGES, int FEATURES,
          unsigned MODS_HASH>
__global__ void __launch_bounds__(BWD_DQ_WARPS * 32, 2)
flash_bwd_dq_mods_kernel(const __grid_constant__ BwdModsParams p) {
    static_assert(MODS_HASH == USER_MODS_HASH, "the kernel's name and its user_mods.cuh");
    flash_bwd_dq_body<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_N, KV_STAGES, FEATURES>(p.base, p.user,
                                                                                 p.score_scale);
}
