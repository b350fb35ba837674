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
// zero-filled 64-column panel (FwdSm90Traits).
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
// Varlen (FEATURE_VARLEN; docs/HOPPER_FWD.md, "Varlen"): the maps cover the packed
// (total, heads, d) arrays as rank-4 maps with a batch extent of 1; the grid is (m blocks of the
// longest sequence, heads, sequences) and a CTA past its sequence's end exits before any barrier.
// Rows and keys count from the sequence's first packed row; a box that runs past the sequence
// reads the next sequence's rows (only the end of the packed array is zero-filled): those keys
// are masked, those query rows are not stored, and those V rows meet P = 0 (so they must be
// finite: a NaN / Inf there would reach this sequence's O through 0 * NaN).
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
#include "sm90/fwd_mainloop.cuh"
#include "sm90/fwd_epilogue.cuh"

// One work tile of a consumer warpgroup (warpgroup 1 + c owns rows 64 c .. 64 c + 63 of it):
// the FA2 loop over its KV tiles from ring position ring0 on (consume_kv_tiles), then the
// epilogue (store_tile). q_round: the how-many-th Q of this CTA the tile's Q is.
template <typename Elem, class T, bool PINGPONG, bool OVERLAP, int FEATURES, bool PERSISTENT>
CF2_DEVICE void consume_tile(const FwdParams& p, const KeyVisibility& vis,
                             const FwdTileContext& c, int head_chunks, int ring0, int q_round,
                             int consumer, u32 q_smem, u32 kv_smem, u32 o_smem,
                             FwdSm90Barriers<T::KV_STAGES, OVERLAP, PERSISTENT>& bars) {
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    consume_kv_tiles<Elem, T, PINGPONG, OVERLAP, FEATURES, PERSISTENT>(
        p, vis, c, ring0, q_round, consumer, q_smem, kv_smem, bars,
        [&](float (&acc_o)[1][T::D_TILES][4], OnlineSoftmax<1>& softmax, float (&inv_sum)[2],
            float (&row_lse)[2]) {
            store_tile<Elem, T, PERSISTENT, VARLEN>(p, c, acc_o, softmax, inv_sum, row_lse,
                                                    head_chunks, consumer, o_smem);
        });
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
template <typename Elem, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool PINGPONG,
          bool OVERLAP, int FEATURES, bool PERSISTENT, bool CLAIMS>
__global__ void __launch_bounds__(
    FwdSm90Traits<Elem, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PERSISTENT>::THREADS, 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdSm90Params params) {
    using T = FwdSm90Traits<Elem, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, PERSISTENT>;
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    static_assert((FEATURES & FEATURE_DROPOUT) == 0, "dropout runs on the mma.sync kernel");
    static_assert(!(VARLEN && PERSISTENT), "varlen runs on the one-tile-per-CTA grid");
    static_assert(!PINGPONG || T::CONSUMER_WARPGROUPS == 2, "ping-pong takes two consumers");
    const FwdParams& p = params.base;

    extern __shared__ unsigned char smem[];
    static_assert(!CLAIMS || PERSISTENT, "tiles are claimed on the persistent grid");
    __shared__ FwdSm90ClaimBarriers<STAGES, OVERLAP, PERSISTENT, CLAIMS> bars;
    const u32 smem_base = (smem_address(smem) + T::SMEM_ALIGN - 1) & ~(T::SMEM_ALIGN - 1u);
    const u32 q_smem = smem_base;
    const u32 kv_smem = q_smem + T::Q_BYTES;  // stage s: K at + s * STAGE_BYTES, V after it
    // O is staged in the Q buffer, or after the ring in a buffer of its own (PERSISTENT).
    const u32 o_smem = PERSISTENT ? kv_smem + STAGES * T::STAGE_BYTES : q_smem;

    // The CTA's own work tile on the one-tile-per-CTA grid (unused by the persistent grid). This
    // is tile_context() (sm90/fwd_tile_scheduler.cuh) spelt out in the order the kernel has
    // always computed it, so that the one-tile-per-CTA specialisations keep their SASS (a
    // function of the scheduler's returning it gave the varlen ones other SASS).
    const FwdWorkTile own_tile = grid_work_tile(p);
    const int kv_head = own_tile.head / p.heads_per_kv_head;
    const int row_first = own_tile.m_block * BLOCK_M;
    // VARLEN: batch index = sequence; its rows in the packed arrays (varlen.cuh), and the m
    // blocks past its end exit here, the whole CTA, before any barrier is initialised or used
    // (the grid is sized by the longest sequence). Dense batches: {0, seqlen}.
    const SequenceRows seq_q = query_rows<VARLEN>(p, own_tile.batch);
    const SequenceRows seq_k = key_rows<VARLEN>(p, own_tile.batch);
    if (VARLEN && row_first >= seq_q.length) return;
    const int row_last = min(row_first + BLOCK_M, VARLEN ? seq_q.length : p.seqlen_q) - 1;
    const KeyVisibility vis = key_visibility<VARLEN>(p, seq_q, seq_k);
    int tile_first, tile_end;
    vis.tile_range(row_first, row_last, BLOCK_N, tile_first, tile_end);
    u16* o_block = p.out + own_tile.batch * p.o_batch_stride + own_tile.head * p.o_head_stride +
                   (seq_q.start + row_first) * p.o_row_stride;
    // lse: dense (batch, nheads, seqlen_q), varlen (nheads, total_q)
    float* lse_block = p.lse + lse_row0<VARLEN>(own_tile.batch, own_tile.head, p.nheads,
                                                p.seqlen_q, p.varlen.total_q, seq_q.start) +
                       row_first;
    const FwdTileContext own{own_tile, kv_head, {row_first, row_last, tile_first, tile_end},
                             o_block, lse_block, seq_q, seq_k};
    const int head_chunks = p.head_dim / 8;  // 16-byte chunks actually present in an O row
    if constexpr (!PERSISTENT) {
        // No row of this block sees any key: O = 0, lse = +inf, by the whole CTA before any role.
        if (own.span.empty()) {
            store_empty_tile_rows<T, BLOCK_M, T::THREADS, FEATURES>(p, own, head_chunks, 0,
                                                             threadIdx.x);
            return;
        }
    }

    if (threadIdx.x == 0) init_barriers<T::CONSUMER_THREADS>(bars);
    __syncthreads();

    const FwdTileScheduler<BLOCK_M, BLOCK_N, PERSISTENT, CLAIMS, decltype(bars)> scheduler{
        params, own, bars};
    const int warpgroup = threadIdx.x / T::WARPGROUP_THREADS;
    if (warpgroup == 0) {
        // ---- producer ----
        setmaxnreg_dec<T::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0)
            scheduler.for_each(
                CompileTimeFlag<false>{}, false,
                [&](const FwdTileContext& tile, int ring0, int q_round) {
                    produce_tile<T, OVERLAP, PERSISTENT, VARLEN>(params, tile, ring0, q_round,
                                                                 q_smem, kv_smem, bars);
                },
                [](const FwdTileContext&) {});  // nothing to load
    } else {
        // ---- consumers: warpgroup 1 + c owns rows 64 c .. 64 c + 63 of each work tile ----
        setmaxnreg_inc<T::CONSUMER_REGISTERS>();
        const int consumer = warpgroup - 1;
        scheduler.for_each(
            CompileTimeFlag<true>{},
            threadIdx.x == T::WARPGROUP_THREADS,  // the first consumer thread claims
            [&](const FwdTileContext& tile, int ring0, int q_round) {
                consume_tile<Elem, T, PINGPONG, OVERLAP, FEATURES, PERSISTENT>(
                    p, vis, tile, head_chunks, ring0, q_round, consumer, q_smem, kv_smem, o_smem,
                    bars);
            },
            [&](const FwdTileContext& tile) {
                const int wg_row0 = T::ROWS_PER_WARPGROUP * consumer;
                store_empty_tile_rows<T, T::ROWS_PER_WARPGROUP, T::WARPGROUP_THREADS, FEATURES>(
                    p, tile, head_chunks, wg_row0, threadIdx.x % T::WARPGROUP_THREADS);
            });
    }
}
