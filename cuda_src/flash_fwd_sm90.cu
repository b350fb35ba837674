// FlashAttention-2 forward (Dao, 2023, Algorithm 1) for Hopper (sm_90a): wgmma, TMA and warp
// specialisation.
//
// The algorithm is the one of flash_fwd.cu: Q is the outer loop, one CTA owns BLOCK_M query rows
// of one head and walks over the KV tiles those rows can see, from the last one down (under
// causal masking the masked diagonal tiles come first); per KV tile j
//   S = Q K_j^T -> score modifiers, mask (boundary tiles only) -> online softmax on the
//   unnormalised output (exp2 with the folded scale; online_softmax.cuh) -> O += P V_j,
// and 1 / l is applied once, after the last tile, with the lse written beside O.
//
// What Hopper changes is who does what:
//  - warpgroup 0 is the producer: it gives most of its registers away (setmaxnreg.dec) and one
//    of its threads issues TMA loads: the Q tile once, then K_j and V_j into a STAGES-deep ring
//    of shared-memory stages. Each stage has three mbarriers: k_full and v_full complete when
//    the TMA has written the tile (arrive.expect_tx + the copy's bytes), kv_empty when every
//    consumer thread has finished reading the stage.
//  - warpgroups 1 .. BLOCK_M / 64 are consumers (setmaxnreg.inc). Each owns 64 query rows, each
//    of its warps 16 of them (per-warp Q partitioning, as in the mma.sync kernel): K and V tiles
//    are shared read-only, no output is ever reduced across warps. S = Q K_j^T is a wgmma with
//    both operands from shared-memory descriptors; P goes from the S accumulator into A-operand
//    registers (the same packing as the mma.sync kernel: the accumulator and A layouts agree, see
//    hopper_primitives.cuh) and O += P V_j is a wgmma with A from registers.
// Out-of-range rows need no code in the loads: the tensor maps cover each (batch, head)'s own
// rows and head dim, and the TMA zero-fills what lies outside (query rows past seqlen_q, keys
// past seqlen_k, columns past the head dim). A zero K row scores 0 and is masked (the last tile
// is a boundary tile); a zero V row adds nothing. Stores of O and lse are guarded by row (and O
// by head-dim chunk).
//
// Head dims 64, 96, 128, 192 and 256, each its own specialisation (tiles in
// _dispatch.fwd_sm90_config); a head dim that is not a multiple of 64 ends in a partly used,
// zero-filled 64-column panel (FwdSm90Traits). V (and O) may have a head dim of its own,
// HEAD_DIM_V, no larger than Q's and K's (192 / 128, 128 / 64: _configs.SM90_FWD_HEAD_DIM_PAIRS):
// V's tiles, P V's N and the epilogue take it, Q K^T takes HEAD_DIM.
// Verified on an H200: every head dim, both dtypes and both schedules against the reference
// (benchmarks/dev/hopper_fwd_check.py, tests/gpu/test_hopper_forward.py and the forward tests
// of the GPU suite, which it runs on sm_90), compute-sanitizer memcheck, racecheck, synccheck.
//
// Scheduling: with PINGPONG the two consumers alternate on the tensor cores (named barriers),
// each issuing S_j and P_{j-1} V_{j-1} in one turn; without it each runs its tiles in order.
// _dispatch.SCHEDULES picks per head dim and causality, as measured. OVERLAP (either schedule)
// runs the softmax of tile j while P_{j-1} V_{j-1} is on the tensor cores of the same warpgroup
// (wgmma.wait_group 1), K and V of a stage given back separately.
//
// Grid: one CTA per work tile (BLOCK_M query rows of one head and batch), or with PERSISTENT
// (FlashAttention-3's persistent scheme; _dispatch.hopper_forward_config takes it where it measured
// faster) at most one CTA per SM, each looping over work tiles (PersistentTiles for the order,
// WorkTileClaims for which CTA takes which: statically, or claimed one by one from a counter
// under a key limit, where tiles differ in length), so that the per-CTA fixed cost is paid once
// and hidden: the producer's ring position continues across work tiles (it loads the next
// tile's K/V as soon as stages free up), the next Q is loaded once both consumers have completed
// their last S GEMM of the current tile (q_empty), and O is staged in a buffer of its own, so
// the epilogue of tile t runs under the loads of tile t + 1. The extra O buffer fits head dims
// 64, 96 (2 stages instead of 3) and 128 (_configs.SM90_PERSISTENT_TILES).
// The two compose: every schedule (in order or ping-pong, with or without OVERLAP) runs on
// either grid; the consumer loops address the ring through ring0-relative positions, and Q is
// given back (q_empty) once the wait that completes the work tile's last S = Q K^T returned.
//
// Next steps: docs/HOPPER_FWD.md.
//
// Float32 at precision "tf32" (Elem = tf32_tag; docs/FLOAT32.md): TF32 wgmmas (k8), rows of Q and
// K as 16-bit rows twice as long (FwdSm90Traits::WORDS), Q rounded to TF32 in shared memory by
// its consumers, K rounded and V rounded with its keys innermost by the operand pass that runs
// before this kernel (flash_fwd_tf32_operands.cu; TF32 wgmma has no transposed B), P rounded as
// it is packed. One-tile-per-CTA grid, dense calls (the pass groups keys by 8 from 0).
// At precision "highest" (Elem = f32x3_tag, FwdSm90Traits::SPLIT; 3xTF32) every operand comes in
// two TF32 parts, big and small: Q split by its consumers into two shared buffers, K and V's
// parts written by the operand pass and loaded into one stage (4 tiles), P split in registers;
// S and each k8 step of P V are three wgmmas (small products first, then big x big).
//
// Varlen (FEATURE_VARLEN; docs/HOPPER_FWD.md, "Varlen"): the maps cover the packed
// (total, heads, d) arrays as rank-4 maps with a batch extent of 1; the grid is (m blocks of the
// longest sequence, heads, sequences) and a CTA past its sequence's end exits before any barrier.
// Rows and keys count from the sequence's first packed row; a box that runs past the sequence
// reads the next sequence's rows (only the end of the packed array is zero-filled): those keys
// are masked, those query rows are not stored, and those V rows meet P = 0 (so they must be
// finite: a NaN / Inf there would reach this sequence's O through 0 * NaN; for e4m3 the NaN
// bytes 0x7f / 0xff). e4m3 reads V in place as the 16-bit elements do (its producer warpgroup
// transposes the raw box, fwd_transpose_v.cuh), its descales by (sequence, KV head); float32's
// operand pass groups keys from each batch entry's row 0 and stays dense.
//
// The parts (FlashAttention-3's hopper/ split: a kernel is a mainloop, an epilogue and a tile
// scheduler), each a header of sm90/:
//  - fwd_traits.cuh: FwdSm90Traits, the compile-time shape (warpgroups, registers, shared memory).
//  - fwd_barriers.cuh: the mbarriers (ring, Q, claim slots) and their initialisation.
//  - fwd_tile_scheduler.cuh: the work tiles, their order and who takes which (FwdTileContext,
//    PersistentTiles, WorkTileClaims; FwdTileScheduler::for_each walks a CTA's tiles).
//  - fwd_producer.cuh: produce_tile, the producer's TMA loads of one work tile.
//  - fwd_mainloop.cuh: consume_kv_tiles, the consumers' FA2 loop over the KV tiles (the three
//    schedules, the GEMMs, the score step FwdScoreStep, the online softmax).
//  - fwd_epilogue.cuh: store_tile (1 / l, O and lse stored) and store_empty_tile_rows.
// This file composes them: the kernel sets up shared memory and the barriers, then the producer
// runs produce_tile and each consumer consume_tile (mainloop, then epilogue) on every work tile.
#include "hopper_primitives.cuh"
#include "online_softmax.cuh"
#include "kernel_params.cuh"
#include "varlen.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/fwd_barriers.cuh"
#include "sm90/fwd_tile_scheduler.cuh"
#include "sm90/fwd_producer.cuh"
#include "sm90/fwd_transpose_v.cuh"
#include "sm90/fwd_mainloop.cuh"
#include "sm90/fwd_epilogue.cuh"

// One work tile of a consumer warpgroup (warpgroup 1 + c owns rows 64 c .. 64 c + 63 of it):
// the FA2 loop over its KV tiles from ring position ring0 on (consume_kv_tiles), then the
// epilogue (store_tile). q_round: the how-many-th Q of this CTA the tile's Q is.
// `user`: the programmable modifiers' inputs (UserParams, the mods kernel's) or NoUserInputs.
// `narrow`: the block mask's view (BlockMaskNarrow) or NoNarrow, for the score step.
// `bias`: the bias's tiles (BiasTile, FEATURE_BIAS_TILE) or NoBiasTile (sm90/bias_tile.cuh).
// `descales`: e4m3 inputs' factors (FwdSm90Params::descales; unread for other elements).
template <typename Elem, class T, bool PINGPONG, bool OVERLAP, int FEATURES, bool PERSISTENT,
          class User, class Narrow, class Bias>
CF2_DEVICE void consume_tile(const FwdParams& p, const E4m3Descales& descales,
                             const KeyVisibility& vis,
                             const FwdTileContext& c, int head_chunks, int ring0, int q_round,
                             int consumer, u32 q_smem, u32 kv_smem, u32 o_smem,
                             FwdSm90Barriers<T::KV_STAGES, OVERLAP, PERSISTENT>& bars,
                             const User& user, const Narrow& narrow, const Bias& bias) {
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    const TileDescales tile_factors = tile_descales<Elem>(descales, c.w.batch, c.kv_head);
    consume_kv_tiles<Elem, T, PINGPONG, OVERLAP, FEATURES, PERSISTENT>(
        p, vis, c, tile_factors, ring0, q_round, consumer, q_smem, kv_smem, bars,
        [&](float (&acc_o)[1][T::D_TILES][4], OnlineSoftmax<1>& softmax, float (&inv_sum)[2],
            float (&row_lse)[2]) {
            store_tile<Elem, T, PERSISTENT, VARLEN>(p, c, tile_factors, acc_o, softmax, inv_sum,
                                                    row_lse, head_chunks, consumer, o_smem);
        },
        user, narrow, bias);
}

// PINGPONG: the consumers take turns on the tensor cores (one's softmax under the other's GEMMs;
// see consume_kv_tiles, sm90/fwd_mainloop.cuh); false: each consumer runs its tiles straight
// through. OVERLAP: the overlap inside a warpgroup (FlashAttention-3's intra-warpgroup
// pipelining): the softmax of tile j runs while the tensor cores compute P_{j-1} V_{j-1} (see
// consume_kv_tiles).
// With or without PINGPONG, on either grid.
// FEATURES: the attention variant's (variant.cuh: softcap, ALiBi, sinks) and FEATURE_VARLEN (packed
// sequences, one-tile-per-CTA grid only), or 0. Dropout stays on the mma.sync kernel for now.
// The parameters: FwdSm90Params (kernel_params.cuh).
// PERSISTENT: a grid of at most one CTA per SM, each looping over work tiles (PersistentTiles);
// the producer loads the next work tile's Q and K/V while the consumers finish the current one
// and store it (O staged in a buffer of its own). Otherwise one CTA per work tile, the grid
// (m blocks, heads, batch).
// CLAIMS (with PERSISTENT): the CTAs claim their work tiles one by one (WorkTileClaims) instead
// of taking every gridDim.x-th.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int STAGES,
          bool PINGPONG, bool OVERLAP, int FEATURES, bool PERSISTENT, bool CLAIMS>
__global__ void __launch_bounds__(
    FwdSm90Traits<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, PERSISTENT>::THREADS, 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdSm90Params params) {
    const NoUserInputs user{};
    const NoNarrow narrow{};
    const NoBiasTile bias{};
#include "flash_fwd_sm90_body.inc"
}

// The mods kernel's narrowing of a work tile's KV range: its block mask's (ON), or none.
template <bool ON>
CF2_DEVICE auto block_mask_narrow(const FwdSm90ModsParams& m) {
    if constexpr (ON) {
        return BlockMaskNarrow{m.ranges, m.block_m_div, m.block_n_div, m.num_m_blocks};
    } else {
        return NoNarrow{};
    }
}

// With programmable modifiers (FEATURE_MASK_MOD, FEATURE_SCORE_MOD; cuflash2/mods.py): the same
// kernel, its parameters FwdSm90ModsParams (FwdSm90Params as `sm90`, then the modifiers'
// inputs), the modifiers' code from the generated user_mods.cuh, whose hash MODS_HASH names the
// kernel. The user's code runs in the consumers' score step (sm90/fwd_mainloop.cuh,
// FwdScoreStep). With a block mask (FEATURE_BLOCK_MASK) each work tile's KV range is narrowed
// to its visited tiles and the user's mask skips its run of full tiles (BlockMaskNarrow,
// block_mask.cuh, from the block mask's row ranges).
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int STAGES,
          bool PINGPONG, bool OVERLAP, int FEATURES, bool PERSISTENT, bool CLAIMS,
          unsigned MODS_HASH>
__global__ void __launch_bounds__(
    FwdSm90Traits<Elem, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, PERSISTENT>::THREADS, 1)
flash_fwd_sm90_mods_kernel(const __grid_constant__ FwdSm90ModsParams mods_params) {
    static_assert(MODS_HASH == USER_MODS_HASH, "the kernel's name and its user_mods.cuh");
    static_assert(!((FEATURES & FEATURE_BLOCK_MASK) && (FEATURES & FEATURE_VARLEN)),
                  "no block masks with varlen batches");
    const FwdSm90Params& params = mods_params.sm90;
    const UserParams& user = mods_params.user;
    const auto narrow = block_mask_narrow<(FEATURES & FEATURE_BLOCK_MASK) != 0>(mods_params);
    __shared__ BiasTileRing<STAGES> bias_ring;  // FEATURE_BIAS_TILE only (else unused)
    const auto bias = mods_bias_tile<(FEATURES & FEATURE_BIAS_TILE) != 0, Elem, BLOCK_M>(
        mods_params, &bias_ring);
#include "flash_fwd_sm90_body.inc"
}
