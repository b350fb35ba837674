// FlashAttention-2 forward kernel (Dao, 2023, Algorithm 1) on mma.sync m16n8k16.
//
// Grid: (Q block, head, batch). One CTA owns BLOCK_M query rows of one head; Q is the outer loop,
// the CTA walks over the KV tiles its rows can see. Each warp owns its own ROWS_PER_WARP rows of
// the Q tile (per-warp Q partitioning): the K and V tiles in shared memory are read by all warps
// and written by none of them, and no output is ever reduced across warps.
//
// Per KV tile j: S = Q K_j^T -> mask (boundary tiles only) -> online softmax (P = exp2(...), in
// registers) -> pack P to 16 bits -> O += P V_j, P used directly as the A operand. Loads:
//  KV_STAGES == 2 (double-buffered K/V, one barrier per tile): wait K_j,V_j, barrier, issue the
//    copy of K_{j-1},V_{j-1} into the other stage; it streams in during all of tile j's work.
//  KV_STAGES == 1 (FA2's schedule, for smaller shared memory): wait K_j, barrier, issue V_j;
//    Q K_j^T and softmax; wait V_j, barrier, issue K_{j-1}; P V_j.
// Tiles are visited from the last one down: under causal masking the diagonal (masked) tiles
// come first and the rest run without masking code.
// Float32 inputs (tf32_tag, f32x3_tag: tf32_primitives.cuh) run the same schedule on m16n8k8
// TF32 mma: their tiles are twice as many 16-bit words wide, a Q or K fragment (ldmatrix.x4)
// is one k8 step, P stays fp32 in registers and V's fragments are 32-bit shared loads.
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "smem_swizzle.cuh"
#include "variant.cuh"
#include "varlen.cuh"
#include "dropout.cuh"
#include "output_store.cuh"
#include "kernel_params.cuh"

// HEAD_DIM is Q's and K's head dim, HEAD_DIM_V V's and O's (d_v != d_qk, DeepSeek's 192 / 128):
// V's tile and O's accumulators take HEAD_DIM_V, no larger than HEAD_DIM (O is staged in Q's
// tile).
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          int KV_STAGES>
struct FwdTraits {
    static constexpr int THREADS = NUM_WARPS * 32;
    static constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;
    static constexpr int M_TILES = ROWS_PER_WARP / 16;  // m16 tiles per warp, sharing K/V frags
    static constexpr int N_TILES = BLOCK_N / 8;         // n8 tiles of the score tile S
    static constexpr int D_TILES = HEAD_DIM_V / 8;      // n8 tiles of the output O
    // k steps of Q K^T (over head dim): 16 words each, k16 of 16-bit elements, k8 of float32.
    static constexpr int QK_STEPS = HEAD_DIM * Elem::WORDS / 16;
    static constexpr int PV_STEPS = BLOCK_N / 16;       // k16 slices of P V (over keys)
    using QTile = SwizzledTile<BLOCK_M, HEAD_DIM * Elem::WORDS>;
    using KVTile = SwizzledTile<BLOCK_N, HEAD_DIM * Elem::WORDS>;  // K's (and V's: one head dim)
    using VTile = SwizzledTile<BLOCK_N, HEAD_DIM_V * Elem::WORDS>;
    // Shared memory: the Q tile, then KV_STAGES stages of (K tile, V tile).
    static constexpr int STAGE_BYTES = KVTile::BYTES + VTile::BYTES;
    static constexpr int SMEM_BYTES = QTile::BYTES + KV_STAGES * STAGE_BYTES;
    static_assert(ROWS_PER_WARP % 16 == 0, "each warp owns whole m16 tiles");
    static_assert(KV_STAGES == 1 || KV_STAGES == 2, "single or double-buffered K/V");
    static_assert(N_TILES % 2 == 0 && D_TILES % 2 == 0, "fragments are loaded in pairs");
    static_assert(HEAD_DIM_V <= HEAD_DIM && (HEAD_DIM_V == HEAD_DIM || !Elem::IS_F32),
                  "O staged in Q's tile; float32: one head dim");
};

// S = Q K^T for this warp's rows: per k16 step one ldmatrix.x4 per m-tile of Q and one per pair
// of n-tiles of K; each K fragment feeds all M_TILES m-tiles. The k loop is unrolled by 2 only:
// the accumulators need nothing indexed by ks, and a full unroll lets the scheduler hoist so many
// fragment loads that the d=128 kernel spills (ptxas report, sm_80 and sm_90).
// Float32 elements: each fragment is split into its TF32 parts once, then used the same way.
template <typename Elem, class T>
CF2_DEVICE void gemm_qk(float (&acc_s)[T::M_TILES][T::N_TILES][4],
                        const LdmatrixCursor<typename T::QTile>& q_frag,
                        const LdmatrixCursor<typename T::KVTile>& k_frag, u32 stage_offset) {
    if constexpr (Elem::IS_F32) {
#pragma unroll 2
        for (int ks = 0; ks < T::QK_STEPS; ++ks) {
            Tf32Parts<Elem, 4> a[T::M_TILES];
#pragma unroll
            for (int mt = 0; mt < T::M_TILES; ++mt) {
                u32 bits[4];
                ldmatrix_x4(bits, q_frag.at(2 * mt, ks));
                a[mt] = Tf32Parts<Elem, 4>::from_bits(bits);
            }
#pragma unroll
            for (int np = 0; np < T::N_TILES / 2; ++np) {
                u32 bits[4];
                ldmatrix_x4(bits, k_frag.at(2 * np, ks) + stage_offset);
                const auto b = Tf32Parts<Elem, 4>::from_bits(bits);
#pragma unroll
                for (int mt = 0; mt < T::M_TILES; ++mt)
                    mma_m16n16k8_f32<Elem>(acc_s[mt][2 * np], acc_s[mt][2 * np + 1], a[mt], b);
            }
        }
    } else {
#pragma unroll 2
        for (int ks = 0; ks < T::QK_STEPS; ++ks) {
            u32 a[T::M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < T::M_TILES; ++mt) ldmatrix_x4(a[mt], q_frag.at(2 * mt, ks));
#pragma unroll
            for (int np = 0; np < T::N_TILES / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, k_frag.at(2 * np, ks) + stage_offset);
#pragma unroll
                for (int mt = 0; mt < T::M_TILES; ++mt)
                    mma_m16n16k16<Elem>(acc_s[mt][2 * np], acc_s[mt][2 * np + 1], a[mt], b);
            }
        }
    }
}

// O += P V, one k16 slice of keys at a time: the slice of P is exponentiated and packed right
// before its mma (online softmax step 2), so the scores die as P is consumed and the SFU work of
// one slice overlaps the tensor-core work of the previous one. V is the transposed B operand
// (ldmatrix.trans); each V fragment feeds all m-tiles.
// With DROPOUT, each 16 x 16 block of P draws its keep bits (dropout.cuh); this warp's rows
// start at q_warp0, the tile's keys at key0.
// Float32 elements: P stays fp32 (split into TF32 parts), a k16 slice is two k8 steps, and V's
// fragments are 32-bit loads in P's key order (key_rows_b_fragments: F32KeyPairCursor).
template <typename Elem, class T, bool DROPOUT = false, class VCursor>
CF2_DEVICE void softmax_gemm_pv(float (&acc_o)[T::M_TILES][T::D_TILES][4],
                                const float (&acc_s)[T::M_TILES][T::N_TILES][4],
                                OnlineSoftmax<T::M_TILES>& softmax, float scale_log2,
                                const VCursor& v_frag, u32 stage_offset,
                                const Dropout& dropout = Dropout{}, int q_warp0 = 0,
                                int key0 = 0) {
    if constexpr (Elem::IS_F32) {
#pragma unroll
        for (int ks = 0; ks < T::PV_STEPS; ++ks) {
            Tf32Parts<Elem, 4> a[T::M_TILES][2];  // the slice's two k8 steps
#pragma unroll
            for (int mt = 0; mt < T::M_TILES; ++mt) {
                u32 keep = 0xffu;
                if constexpr (DROPOUT)
                    keep = dropout.keep_bits(q_warp0 + 16 * mt, key0 + 16 * ks,
                                             thread_index_fresh() % 32);
                float p[8];
                softmax.template exp_probabilities<DROPOUT>(p, acc_s[mt][2 * ks],
                                                            acc_s[mt][2 * ks + 1], mt,
                                                            scale_log2, keep);
                probabilities_as_a<Elem>(a[mt], p);
            }
#pragma unroll
            for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
#pragma unroll
                for (int step = 0; step < 2; ++step) {
                    // Keys 16ks + 8step + 2t + j; columns 16dp + g (lo) and 16dp + 8 + g (hi).
                    u32 bits[4];
                    v_frag.load_b_pair(bits, 2 * ks + step, 2 * dp, stage_offset);
                    const auto b = Tf32Parts<Elem, 4>::from_bits(bits);
#pragma unroll
                    for (int mt = 0; mt < T::M_TILES; ++mt)
                        mma_m16n16k8_f32<Elem>(acc_o[mt][2 * dp], acc_o[mt][2 * dp + 1],
                                               a[mt][step], b);
                }
            }
        }
    } else {
#pragma unroll
        for (int ks = 0; ks < T::PV_STEPS; ++ks) {
            u32 a[T::M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < T::M_TILES; ++mt) {
                u32 keep = 0xffu;
                if constexpr (DROPOUT)
                    keep = dropout.keep_bits(q_warp0 + 16 * mt, key0 + 16 * ks,
                                             thread_index_fresh() % 32);
                softmax.template exp_pack<Elem, DROPOUT>(a[mt], acc_s[mt][2 * ks],
                                                         acc_s[mt][2 * ks + 1], mt, scale_log2, keep);
            }
#pragma unroll
            for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_frag.at(2 * ks, dp) + stage_offset);
#pragma unroll
                for (int mt = 0; mt < T::M_TILES; ++mt)
                    mma_m16n16k16<Elem>(acc_o[mt][2 * dp], acc_o[mt][2 * dp + 1], a[mt], b);
            }
        }
    }
}

// The kernel's body, shared by flash_fwd_kernel and flash_fwd_mods_kernel (below). FEATURES: the
// attention variant's features (variant.cuh: softcap, ALiBi, sinks, the programmable modifiers),
// varlen batches (varlen.cuh) and dropout (dropout.cuh); 0 for plain attention. The parameters:
// FwdParams (kernel_params.cuh), and with the programmable modifiers `extra`, the whole
// FwdModsParams (their inputs `user`, a block mask's states `blocks`; an unused NoUserInputs
// otherwise, user_inputs.cuh).

template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          int KV_STAGES, int FEATURES, class Extra>
CF2_DEVICE void flash_fwd_body(const FwdParams& p, const Extra& extra) {
    using T = FwdTraits<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, NUM_WARPS, KV_STAGES>;
    using QTile = typename T::QTile;
    using KVTile = typename T::KVTile;
    using VTile = typename T::VTile;
    using Variant = AttentionVariant<FEATURES>;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 q_smem = smem_address(smem);
    const u32 k_smem = q_smem + QTile::BYTES;  // stage 0; stage s is T::STAGE_BYTES * s further
    const u32 v_smem = k_smem + KVTile::BYTES;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    // With an upper limit on keys (causal), later Q blocks see more keys: start those first so
    // that the long CTAs do not form the tail of the grid.
    const int m_block = p.window_right >= 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int kv_head = head / p.heads_per_kv_head;
    const int row_first = m_block * BLOCK_M;
    // This batch entry's rows (varlen: one packed sequence; its blocks past the end exit).
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    const SequenceRows seq_q = query_rows<VARLEN>(p, batch);
    const SequenceRows seq_k = key_rows<VARLEN>(p, batch);
    const i64 lse_first =
        lse_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q, p.varlen.total_q, seq_q.start);
    const int seqlen_q = seq_q.length;
    const int seqlen_k = seq_k.length;
    if (VARLEN && row_first >= seqlen_q) return;
    const int row_last = min(row_first + BLOCK_M, seqlen_q) - 1;
    const int head_chunks = p.head_dim / 8;  // 16-byte chunks actually present in each row
    // Of V's and O's rows: V's own where its kernel head dim is (the dispatcher keeps a d_v of
    // Q's kernel head dim, 128 / 112 say, off this kernel: its one-head-dim specialisations keep
    // their code).
    const int v_head_chunks = HEAD_DIM_V == HEAD_DIM ? head_chunks : p.head_dim_v / 8;

    // 64-bit offsets: batch * seqlen * heads * dim can pass 2^31 elements.
    const u16* q_block = p.q + batch * p.q_batch_stride + head * p.q_head_stride +
                         (seq_q.start + row_first) * p.q_row_stride;
    const u16* k_head = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                        seq_k.start * p.k_row_stride;
    const u16* v_head = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                        seq_k.start * p.v_row_stride;
    u16* o_block = p.out + batch * p.o_batch_stride + head * p.o_head_stride +
                   (seq_q.start + row_first) * p.o_row_stride;
    float* lse_block = p.lse + lse_first + row_first;

    const KeyVisibility vis =
        Variant::visibility(seqlen_q, seqlen_k, p.window_left, p.window_right);
    int tile_first, tile_end;
    vis.tile_range(row_first, row_last, BLOCK_N, tile_first, tile_end);
    // With a block mask (FEATURE_BLOCK_MASK, block_mask.cuh) only the tiles of the range whose
    // state is not empty are visited: the range ends after the highest of them, the loop below
    // steps from each to the next one down (`next`); `state`, the current tile's state.
    constexpr bool BLOCK_MASK = Variant::BLOCK_MASK;
    const BlockMaskRow<BLOCK_MASK> block_row =
        block_mask_row<BLOCK_MASK>(extra, batch, head, m_block);
    int state = BLOCK_MASK_FULL;
    if constexpr (BLOCK_MASK)
        tile_end = block_row.prev_visited(tile_first, tile_end, state) + 1;

    if (tile_end <= tile_first) {
        // No row of this block sees any key: output 0, lse +inf (the sink with sinks).
        store_empty_rows<BLOCK_M, VTile::CHUNKS, T::THREADS, Variant>(
            p, o_block, lse_block, head, row_first, seqlen_q, v_head_chunks, 0, tid);
        return;
    }

    auto load_k = [&](int tile, u32 stage_offset) {
        const int key0 = tile * BLOCK_N;
        load_tile_async<KVTile, T::THREADS>(k_smem + stage_offset,
                                             k_head + key0 * p.k_row_stride, p.k_row_stride,
                                             seqlen_k - key0, head_chunks, thread_index_fresh());
    };
    auto load_v = [&](int tile, u32 stage_offset) {
        const int key0 = tile * BLOCK_N;
        load_tile_async<VTile, T::THREADS>(v_smem + stage_offset,
                                            v_head + key0 * p.v_row_stride, p.v_row_stride,
                                            seqlen_k - key0, v_head_chunks, thread_index_fresh());
    };

    load_tile_async<QTile, T::THREADS>(q_smem, q_block, p.q_row_stride, seqlen_q - row_first,
                                        head_chunks, tid);
    load_k(tile_end - 1, 0);
    if constexpr (KV_STAGES == 2) load_v(tile_end - 1, 0);
    cp_async_commit();

    // Fragment addressing (see LdmatrixCursor): Q as the A operand (lanes 0-15 rows, 16-31 the
    // second k8 half), K as the non-transposed B operand (lanes 0-7 / 16-23 pick n rows, bit 3 the
    // k8 half), V as the transposed B operand (key_rows_b_fragments).
    const LdmatrixCursor<QTile> q_frag(q_smem, warp * T::ROWS_PER_WARP + lane % 16, lane / 16);
    const LdmatrixCursor<KVTile> k_frag(k_smem, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const auto v_frag = key_rows_b_fragments<Elem, VTile>(v_smem, lane);

    float acc_o[T::M_TILES][T::D_TILES][4];
#pragma unroll
    for (int mt = 0; mt < T::M_TILES; ++mt)
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    OnlineSoftmax<T::M_TILES> softmax;
    Variant::start_softmax(softmax, p.mods, head, lane % 4 == 0);
    Variant variant(p.mods, seqlen_q, seqlen_k);
    variant.select_head(p.mods, batch, head);
    constexpr bool DROPOUT = (FEATURES & FEATURE_DROPOUT) != 0;
    const Dropout dropout(p.dropout, static_cast<u32>(batch * p.nheads + head));

    // Tiles in [tile_first, unmasked_lo) and [unmasked_hi, tile_end) cross a window edge or the
    // sequence tail and need masking; the others run without any masking code.
    int unmasked_lo, unmasked_hi;
    vis.unmasked_tile_range(row_first, row_last, BLOCK_N, unmasked_lo, unmasked_hi);

    u32 stage_offset = 0;
    for (int tile = tile_end - 1; tile >= tile_first; --tile) {
        const int key0 = tile * BLOCK_N;
        // With a block mask, the tile visited next: the next one down that is not empty.
        int next = 0, next_state = BLOCK_MASK_FULL;
        if constexpr (BLOCK_MASK) next = block_row.prev_visited(tile_first, tile, next_state);
        cp_async_wait<0>();
        if constexpr (KV_STAGES == 2) {
            __syncthreads();  // K, V of this tile landed; every warp is done with the other stage
            if (BLOCK_MASK ? next >= tile_first : tile > tile_first) {
                // The whole next tile streams in while this one is computed.
                load_k(BLOCK_MASK ? next : tile - 1, stage_offset ^ T::STAGE_BYTES);
                load_v(BLOCK_MASK ? next : tile - 1, stage_offset ^ T::STAGE_BYTES);
                cp_async_commit();
            }
        } else {
            __syncthreads();  // K of this tile landed; every warp is done reading the previous V
            load_v(tile, 0);  // streams in during Q K^T and the softmax
            cp_async_commit();
        }

        float acc_s[T::M_TILES][T::N_TILES][4];
#pragma unroll
        for (int mt = 0; mt < T::M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < T::N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
        gemm_qk<Elem, T>(acc_s, q_frag, k_frag, stage_offset);
        if constexpr (Variant::TRANSFORMS_SCORES) {
            const int t = thread_index_fresh();
            variant.apply(acc_s, row_first + (t / 32) * T::ROWS_PER_WARP + (t % 32) / 4,
                       key0 + 2 * (t % 4));
            if constexpr (Variant::SCORE_MOD) {
                // The programmable modifiers' context (user_inputs.cuh): inputs, batch entry,
                // head, lengths, score units.
                const UserModContext ctx{extra.user, batch, head, seqlen_q, seqlen_k,
                                         p.softmax_scale, p.mods.alibi_to_units};
                Variant::score_mod(acc_s, row_first + (t / 32) * T::ROWS_PER_WARP + (t % 32) / 4,
                                   key0 + 2 * (t % 4), ctx);
            }
        }
        if constexpr (Variant::MASK_MOD) {
            // The user's mask on every tile (no tile is known to need none), or with a block
            // mask on its partial tiles; its full tiles need only the built-in mask, where the
            // tile crosses a window edge or the sequence's tail.
            const int t = thread_index_fresh();
            const int thread_row0 = row_first + (t / 32) * T::ROWS_PER_WARP + (t % 32) / 4;
            const int thread_key0 = key0 + 2 * (t % 4);
            if (!BLOCK_MASK || state == BLOCK_MASK_PARTIAL) {
                const UserModContext ctx{extra.user, batch, head, seqlen_q, seqlen_k,
                                         p.softmax_scale, p.mods.alibi_to_units};
                Variant::mask_mod(acc_s, thread_row0, thread_key0, vis, ctx);
            } else if (tile < unmasked_lo || tile >= unmasked_hi) {
                Variant::mask(acc_s, thread_row0, thread_key0, vis);
            }
        } else if (tile < unmasked_lo || tile >= unmasked_hi) {
            // This thread's first accumulator row (query index) and key; from a fresh thread
            // index so that they take no registers across the loop.
            const int t = thread_index_fresh();
            const int thread_row0 = row_first + (t / 32) * T::ROWS_PER_WARP + (t % 32) / 4;
            const int thread_key0 = key0 + 2 * (t % 4);
            Variant::mask(acc_s, thread_row0, thread_key0, vis);
        }

        softmax.update_max(acc_s, acc_o, p.scale_log2);

        if constexpr (KV_STAGES == 1) {
            cp_async_wait<0>();
            __syncthreads();  // V of this tile landed; every warp is done reading K
            if (BLOCK_MASK ? next >= tile_first : tile > tile_first) {
                load_k(BLOCK_MASK ? next : tile - 1, 0);  // streams in during P V
                cp_async_commit();
            }
        }
        if constexpr (DROPOUT) {
            const int t = thread_index_fresh();
            softmax_gemm_pv<Elem, T, true>(acc_o, acc_s, softmax, p.scale_log2, v_frag,
                                           stage_offset, dropout,
                                           row_first + (t / 32) * T::ROWS_PER_WARP, key0);
        } else {
            softmax_gemm_pv<Elem, T>(acc_o, acc_s, softmax, p.scale_log2, v_frag, stage_offset);
        }
        if constexpr (KV_STAGES == 2) stage_offset ^= T::STAGE_BYTES;
        if constexpr (BLOCK_MASK) {
            tile = next + 1;  // --tile: next
            state = next_state;
        }
    }

    // Epilogue: divide by l once, stage the tile through this warp's own rows of the Q buffer
    // (no other warp reads them) and write 16-byte rows to global memory.
    float inv_sum[2 * T::M_TILES], row_lse[2 * T::M_TILES];
    softmax.finalize(p.softmax_scale, inv_sum, row_lse);
    __syncwarp();
    const int warp_row0 = warp * T::ROWS_PER_WARP;
#pragma unroll
    for (int mt = 0; mt < T::M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_row0 + 16 * mt + 8 * half + lane / 4;
            // 1 / l, and the dropout's 1 / (1 - p) for the kept probabilities.
            const float scale = DROPOUT ? inv_sum[2 * mt + half] * p.dropout.scale
                                        : inv_sum[2 * mt + half];
#pragma unroll
            for (int dt = 0; dt < T::D_TILES; ++dt) {
                if constexpr (Elem::IS_F32) {
                    // Columns 8dt + 2t, +1: 8 bytes of the n8 tile's two 16-byte chunks.
                    store_8B_shared(q_smem + QTile::offset(row, 2 * dt + (lane % 4) / 2) +
                                        8 * (lane % 2),
                                    acc_o[mt][dt][2 * half] * scale,
                                    acc_o[mt][dt][2 * half + 1] * scale);
                } else {
                    const u32 packed = pack_pair<Elem>(acc_o[mt][dt][2 * half] * scale,
                                                       acc_o[mt][dt][2 * half + 1] * scale);
                    store_4B_shared(q_smem + QTile::offset(row, dt) + 4 * (lane % 4), packed);
                }
            }
            if (lane % 4 == 0 && row_first + row < seqlen_q) lse_block[row] = row_lse[2 * mt + half];
        }
    }
    __syncwarp();
    store_staged_rows<T::ROWS_PER_WARP, VTile::CHUNKS, 32>(
        p, o_block, [&](int row, int chunk) { return q_smem + QTile::offset(row, chunk); },
        row_first, seqlen_q, v_head_chunks, warp_row0, lane);
}

// FwdParams (kernel_params.cuh): every specialisation but those with programmable modifiers.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          int KV_STAGES, int FEATURES>
__global__ void __launch_bounds__(NUM_WARPS * 32, NUM_WARPS <= 4 ? 2 : 1)
flash_fwd_kernel(const __grid_constant__ FwdParams p) {
    flash_fwd_body<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, NUM_WARPS, KV_STAGES, FEATURES>(
        p, NoUserInputs{});
}

// With programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD; FEATURE_BLOCK_MASK with a
// block mask's states in p.blocks): FwdModsParams, the
// modifiers' code from the generated user_mods.cuh, whose hash MODS_HASH names the kernel
// (cuflash2/mods.py: one specialisation per expressions and inputs' types).
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          int KV_STAGES, int FEATURES, unsigned MODS_HASH>
__global__ void __launch_bounds__(NUM_WARPS * 32, NUM_WARPS <= 4 ? 2 : 1)
flash_fwd_mods_kernel(const __grid_constant__ FwdModsParams p) {
    static_assert(MODS_HASH == USER_MODS_HASH, "the kernel's name and its user_mods.cuh");
    flash_fwd_body<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, NUM_WARPS, KV_STAGES, FEATURES>(
        p.base, p);
}
