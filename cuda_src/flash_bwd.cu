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
// Float32 inputs (tf32_tag, f32x3_tag: tf32_primitives.cuh) run the same schedule on m16n8k8
// TF32 mma: tiles count 16-bit words (WORDS = 2: Q, dO, K, V twice as wide), P and dS are
// stored fp32, and the products are warp_gemm_f32.cuh's.
//
// Head dims above 128 are split into chunks (grid.x): each CTA recomputes S and dP over the full
// head dim but accumulates dK, dV, dQ only for its D_CHUNK columns, which keeps dK and dV in
// registers.
//
// HEAD_DIM is Q's and K's head dim (S = Q K^T; dK, dQ), HEAD_DIM_V V's and dO's (d_v != d_qk,
// DeepSeek's 192 / 128; dP = dO V^T; dV), below HEAD_DIM or equal to it (16-bit). The chunks
// split both in the same proportion: chunk c holds dK's and dQ's columns [c D_CHUNK, (c + 1)
// D_CHUNK) and dV's [c D_CHUNK_V, (c + 1) D_CHUNK_V), D_CHUNK_V = HEAD_DIM_V / NUM_CHUNKS, over
// the same phase-B warp grid (KV_COLS_V columns a warp). So every CTA does its share of both
// products with the warp tiles and the register budget of Q's head dim's tile (dV's
// accumulators only shrink), and the grid is that of Q's head dim.
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"
#include "variant.cuh"
#include "warp_gemm.cuh"
#include "warp_gemm_f32.cuh"
#include "dq_accum.cuh"
#include "varlen.cuh"
#include "dropout.cuh"
#include "bias_grad.cuh"
#include "block_mask.cuh"
#include "kernel_params.cuh"
#include "constants.cuh"

template <int HEAD_DIM, int HEAD_DIM_V, int D_CHUNK, int BLOCK_M, int BLOCK_N, int NUM_WARPS,
          int SDP_WARPS_M, int KV_WARPS_N, int DQ_WARPS_M, int Q_STAGES, int WORDS = 1>
struct BwdTraits {
    static constexpr int THREADS = NUM_WARPS * 32;
    // k steps of S (Q's full head dim) and dP (V's): 16 words each, k16 of 16-bit elements, k8
    // of float32.
    static constexpr int D_STEPS = HEAD_DIM * WORDS / 16;
    static constexpr int D_STEPS_V = HEAD_DIM_V * WORDS / 16;
    static constexpr int NUM_CHUNKS = HEAD_DIM / D_CHUNK;
    static constexpr int D_CHUNK_V = HEAD_DIM_V / NUM_CHUNKS;  // dV's columns a chunk
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
    static constexpr int KV_COLS_V = D_CHUNK_V / KV_WARPS_D;  // dV's, over the same warp grid
    static constexpr int KV_MT = KV_KEYS / 16;
    static constexpr int KV_NT = KV_COLS / 8;
    static constexpr int KV_NT_V = KV_COLS_V / 8;
    // Phase C: DQ_WARPS_M x DQ_WARPS_D warps over (BLOCK_M queries x D_CHUNK columns).
    static constexpr int DQ_WARPS_D = NUM_WARPS / DQ_WARPS_M;
    static constexpr int DQ_ROWS = BLOCK_M / DQ_WARPS_M;
    static constexpr int DQ_COLS = D_CHUNK / DQ_WARPS_D;
    static constexpr int DQ_MT = DQ_ROWS / 16;
    static constexpr int DQ_NT = DQ_COLS / 8;

    // Tiles of 16-bit words, WORDS an element (P and dS as wide as the inputs' elements).
    using KVTile = SwizzledTile<BLOCK_N, HEAD_DIM * WORDS>;  // K's (and V's: one head dim)
    using VTile = SwizzledTile<BLOCK_N, HEAD_DIM_V * WORDS>;
    using QTile = SwizzledTile<BLOCK_M, HEAD_DIM * WORDS>;
    using DOTile = SwizzledTile<BLOCK_M, HEAD_DIM_V * WORDS>;
    using PTile = SwizzledTile<BLOCK_M, BLOCK_N * WORDS>;  // P and dS: query rows x key columns
    // Shared memory: K, V | Q_STAGES x (Q, dO, lse_log2, D) | P, dS
    static constexpr int STAT_BYTES = BLOCK_M * 4;
    static constexpr int STAGE_BYTES = QTile::BYTES + DOTile::BYTES + 2 * STAT_BYTES;
    static constexpr int SMEM_BYTES =
        KVTile::BYTES + VTile::BYTES + Q_STAGES * STAGE_BYTES + 2 * PTile::BYTES;

    static_assert(SDP_WARPS_M * SDP_WARPS_N == NUM_WARPS && KV_WARPS_N * KV_WARPS_D == NUM_WARPS &&
                      DQ_WARPS_M * DQ_WARPS_D == NUM_WARPS,
                  "each phase's warp grid must use every warp");
    static_assert(SDP_ROWS % 16 == 0 && SDP_KEYS % 16 == 0, "phase A warp tiles are 16k x 16k");
    static_assert(KV_KEYS % 16 == 0 && KV_COLS % 16 == 0 && KV_COLS_V % 16 == 0,
                  "phase B warp tiles are 16k x 16k");
    static_assert(HEAD_DIM_V <= HEAD_DIM && HEAD_DIM_V % NUM_CHUNKS == 0 &&
                      (HEAD_DIM_V == HEAD_DIM || WORDS == 1),
                  "V's head dim at most Q's, split in as many chunks; float32: one head dim");
    static_assert(DQ_ROWS % 16 == 0 && DQ_COLS % 16 == 0, "phase C warp tiles are 16k x 16k");
    static_assert(Q_STAGES == 1 || Q_STAGES == 2, "single or double-buffered Q/dO");
    static_assert(BWD_ROW_PADDING % BLOCK_M == 0, "the per-row statistics cover whole Q blocks");
    static_assert(STAGE_BYTES % 128 == 0, "stages keep the 128-byte bank alignment of the tiles");
};

// FEATURES: the attention variant's features (variant.cuh: softcap, ALiBi, the programmable
// modifiers), varlen batches (varlen.cuh) and dropout (dropout.cuh); 0 for plain attention. The
// parameters: BwdParams (kernel_params.cuh); every specialisation but those with programmable
// modifiers. The body: flash_bwd_body.inc.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int D_CHUNK, int BLOCK_M, int BLOCK_N,
          int NUM_WARPS, int SDP_WARPS_M, int KV_WARPS_N, int DQ_WARPS_M, int Q_STAGES,
          bool COMPUTE_DQ, int FEATURES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_kernel(const __grid_constant__ BwdParams p) {
    const NoUserInputs user{};
    constexpr float score_scale = 0.f;
    const NoBiasGrad dbias{};
    const NoBlockMask blocks{};
#include "flash_bwd_body.inc"
}

// With programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD): BwdModsParams, the
// modifiers' code from the generated user_mods.cuh, whose hash MODS_HASH names the kernel
// (cuflash2/mods.py), as flash_fwd_mods_kernel; the same body.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int D_CHUNK, int BLOCK_M, int BLOCK_N,
          int NUM_WARPS, int SDP_WARPS_M, int KV_WARPS_N, int DQ_WARPS_M, int Q_STAGES,
          bool COMPUTE_DQ, int FEATURES, unsigned MODS_HASH>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flash_bwd_mods_kernel(const __grid_constant__ BwdModsParams mods_params) {
    static_assert(MODS_HASH == USER_MODS_HASH, "the kernel's name and its user_mods.cuh");
    const BwdParams& p = mods_params.base;
    const UserParams& user = mods_params.user;
    const float score_scale = mods_params.score_scale;
    const BiasGrad& dbias = mods_params.dbias;
    const BwdModsParams& blocks = mods_params;  // its states: FEATURE_BLOCK_MASK only
#include "flash_bwd_body.inc"
}
