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
#include "block_mask.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"
#include "sm90/bwd_producer.cuh"
#include "sm90/bwd_dq_writer.cuh"
#include "sm90/bwd_scores.cuh"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_epilogue.cuh"
#include "sm90/bwd_bias_grad.cuh"

// FEATURES: the attention variant's (variant.cuh: softcap, ALiBi; its sinks need nothing here, P
// coming from the lse), or 0; DQ_BUFFERS: dQ through
// that many shared-memory tiles and bulk reductions (0: vector reductions); DETERMINISTIC: those
// in key-block order (above). The parameters: BwdSm90Params (kernel_params.cuh); grid (key
// blocks, KV heads, batch), as flash_bwd.cu's. HEAD_DIM_V: V's, dO's and dV's head dim where it
// differs from Q's and K's (d_v != d_qk, BwdSm90Traits): dP^T = V dO^T runs over it, dV has
// its columns, all in the first head-dim chunk (d_qk 192: the second chunk's CTAs recompute
// them and store none).
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int STAGES,
          int FEATURES, int DQ_BUFFERS, bool DETERMINISTIC>
__global__ void __launch_bounds__(
    BwdSm90Traits<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS>::THREADS, 1)
flash_bwd_sm90_kernel(const __grid_constant__ BwdSm90Params params) {
    const NoUserInputs user{};
    const NoColumnRange column_range{};
    const NoBiasTile bias{};
    const NoBiasGrad bias_grad{};
#include "flash_bwd_sm90_body.inc"
}

// The column range of the mods kernel: its block mask's (ON), or none.
template <bool ON>
CF2_DEVICE auto block_mask_column_range(const BwdSm90ModsParams& m) {
    if constexpr (ON) {
        return BlockMaskColumnRange{m.columns, m.state_block_m, m.state_block_n, m.num_n_blocks};
    } else {
        return NoColumnRange{};
    }
}

// The mods kernel's dbias accumulator (ON: FEATURE_BIAS_GRAD), or none.
template <bool ON>
CF2_DEVICE auto mods_bias_grad(const BwdSm90ModsParams& m) {
    if constexpr (ON) {
        return m.dbias;
    } else {
        return NoBiasGrad{};
    }
}

// With a mask modifier (FEATURE_MASK_MOD; cuflash2/mods.py): the same kernel, its parameters
// BwdSm90ModsParams (BwdSm90Params as `sm90`, then the modifier's inputs), the modifier's code
// from the generated user_mods.cuh, whose hash MODS_HASH names the kernel. The user's mask runs
// on the consumers' S^T of every step in place of the boundary steps' mask
// (Variant::mask_mod_transposed). With a block mask (FEATURE_BLOCK_MASK) each key block's query
// blocks are narrowed to the visited ones and the user's mask skips the full ones
// (BlockMaskColumnRange, block_mask.cuh); not with the ordered dQ of deterministic mode, whose
// turns assume every key block of a query block's range adds to it. With a bias alone as the
// score modifier (FEATURE_BIAS_TILE; up to d=128, not varlen) the step's block of
// the bias comes as a tile with Q_i and is added to S^T after softcap's t (the dispatch keeps
// softcap with a bias on the mma.sync backward: dS's 1 - t^2 needs t without the bias); with
// dbias (FEATURE_BIAS_GRAD) each step's dS tile is copied into its accumulator too
// (sm90/bwd_bias_grad.cuh).
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int STAGES,
          int FEATURES, int DQ_BUFFERS, bool DETERMINISTIC, unsigned MODS_HASH>
__global__ void __launch_bounds__(
    BwdSm90Traits<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS>::THREADS, 1)
flash_bwd_sm90_mods_kernel(const __grid_constant__ BwdSm90ModsParams mods_params) {
    static_assert(MODS_HASH == USER_MODS_HASH, "the kernel's name and its user_mods.cuh");
    static_assert((FEATURES & FEATURE_SCORE_MOD) == 0, "score modifiers: the mma.sync backward");
    static_assert(!((FEATURES & FEATURE_BLOCK_MASK) && (FEATURES & FEATURE_VARLEN)),
                  "no block masks with varlen batches");
    static_assert(!((FEATURES & FEATURE_BLOCK_MASK) && DETERMINISTIC),
                  "a block mask's narrowed ranges break the ordered dQ's turns");
    static_assert(!(FEATURES & FEATURE_BIAS_TILE) ||
                      !(FEATURES & (FEATURE_SOFTCAP | FEATURE_VARLEN)),
                  "bias tiles: not with softcap (dS's 1 - t^2), nor varlen (the bias's rows)");
    static_assert(!(FEATURES & FEATURE_BIAS_GRAD) || (FEATURES & FEATURE_BIAS_TILE),
                  "dbias with the bias as tiles (rows of whole 16-byte chunks)");
    const BwdSm90Params& params = mods_params.sm90;
    const UserParams& user = mods_params.user;
    const auto column_range =
        block_mask_column_range<(FEATURES & FEATURE_BLOCK_MASK) != 0>(mods_params);
    const auto bias =
        mods_bias_tile<(FEATURES & FEATURE_BIAS_TILE) != 0, Elem, BLOCK_M>(mods_params);
    const auto bias_grad = mods_bias_grad<(FEATURES & FEATURE_BIAS_GRAD) != 0>(mods_params);
#include "flash_bwd_sm90_body.inc"
}
