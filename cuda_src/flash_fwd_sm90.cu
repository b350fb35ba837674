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
// _configs.fwd_sm90_config); a head dim that is not a multiple of 64 ends in a partly used,
// zero-filled 64-column panel (FwdSm90Traits).
// Verified on an H200: every head dim, both dtypes and both schedules against the reference
// (benchmarks/dev/hopper_fwd_check.py, tests/gpu/test_hopper_forward.py and the forward tests
// of the GPU suite, which it runs on sm_90), compute-sanitizer memcheck, racecheck, synccheck.
//
// Scheduling: with PINGPONG the two consumers alternate on the tensor cores (named barriers),
// each issuing S_j and P_{j-1} V_{j-1} in one turn; without it each runs its tiles in order.
// _hopper.SCHEDULES picks per head dim and causality, as measured. OVERLAP (either schedule)
// runs the softmax of tile j while P_{j-1} V_{j-1} is on the tensor cores of the same warpgroup
// (wgmma.wait_group 1), K and V of a stage given back separately.
//
// Grid: one CTA per work tile (BLOCK_M query rows of one head and batch), or with PERSISTENT
// (FlashAttention-3's persistent scheme; _hopper.forward_config takes it where it measured
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
#include "hopper_primitives.cuh"
#include "masking.cuh"
#include "online_softmax.cuh"
#include "score_mods.cuh"
#include "kernel_params.cuh"
#include "varlen.cuh"

template <typename Elem, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES,
          bool PERSISTENT = false>
struct FwdSm90Traits : Sm90CtaLayout {
    static constexpr int ROWS_PER_WARPGROUP = 64;  // the M of wgmma
    static constexpr int CONSUMER_WARPGROUPS = BLOCK_M / ROWS_PER_WARPGROUP;
    static constexpr int CONSUMER_THREADS = CONSUMER_WARPGROUPS * WARPGROUP_THREADS;
    static constexpr int THREADS = WARPGROUP_THREADS + CONSUMER_THREADS;  // + the producer
    static constexpr int ENTRY_REGISTERS = entry_registers(THREADS);
    // 240 registers a consumer thread with two consumer warpgroups, 160 with three.
    static constexpr int CONSUMER_REGISTERS = consumer_registers(CONSUMER_WARPGROUPS);
    // Named barriers (0 is __syncthreads): one per consumer for its epilogue, and one per
    // consumer for its turns of the ping-pong schedule.
    static constexpr int EPILOGUE_BARRIER = 1;
    static constexpr int TURN_BARRIER = EPILOGUE_BARRIER + CONSUMER_WARPGROUPS;

    // Tiles in shared memory are panels of 64 columns (Sm90CtaLayout); a tile of R rows is PANELS
    // panels of R * 128 B.
    // A head dim that is not a multiple of 64 (96) ends in a partly used panel: its box is still
    // 64 columns and the TMA zero-fills the columns past the head dim (they cost shared memory
    // and TMA writes, not global reads). A 32-column last box was the alternative, but the TMA
    // packs a box as rows of its own width: 64-byte rows, not the 128-byte rows the panel's
    // descriptors read, so that panel would need the 64-byte swizzle, with a second tensor map
    // and descriptor mode for it alone. With full panels one map, one layout and one descriptor
    // scheme serve every head dim. The GEMMs skip the padding: Q K^T takes HEAD_DIM / 16
    // k-steps and P V has N = HEAD_DIM, so the zero columns are never multiplied.
    static constexpr int PANELS = (HEAD_DIM + PANEL_COLS - 1) / PANEL_COLS;
    static constexpr int Q_PANEL_BYTES = BLOCK_M * ROW_BYTES;
    static constexpr int KV_PANEL_BYTES = BLOCK_N * ROW_BYTES;
    static constexpr int Q_BYTES = PANELS * Q_PANEL_BYTES;
    static constexpr int KV_TILE_BYTES = PANELS * KV_PANEL_BYTES;
    static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;  // K tile, then V tile
    static constexpr int KV_STAGES = STAGES;
    // The persistent grid stages O in a buffer of its own, after the ring (Q's shape and layout),
    // because the Q buffer takes the next work tile's Q while the epilogue runs. Otherwise O is
    // staged in the Q buffer.
    static constexpr int O_BYTES = PERSISTENT ? Q_BYTES : 0;
    static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES + O_BYTES + SMEM_ALIGN;

    static constexpr int DIM = HEAD_DIM;
    static constexpr int KEYS_PER_TILE = BLOCK_N;
    static constexpr int N_TILES = BLOCK_N / 8;    // n8 column groups of S (accumulator layout)
    static constexpr int D_TILES = HEAD_DIM / 8;   // n8 column groups of O
    static constexpr int QK_STEPS = HEAD_DIM / 16;  // k16 steps of Q K^T (over the head dim)
    static constexpr int PV_STEPS = BLOCK_N / 16;   // k16 steps of P V (over the keys)
    // A warpgroup whose rows see only the left half of their first KV tile's keys (the diagonal
    // tile of a causal row block's upper half, a short sequence tail) runs the softmax of that
    // half alone (consume_tile, the ping-pong + overlap schedule): whole k16 slices of P. Not
    // with score modifiers: the second copy of the first tile's softmax then makes ptxas spill
    // (d=96 and 128 on the persistent grid).
    template <int FEATURES>
    static constexpr bool HALF_TILES =
        BLOCK_N % 32 == 0 && (FEATURES & (FEATURE_SOFTCAP | FEATURE_ALIBI)) == 0;

    // wgmma N (dense f16 / bf16) is a multiple of 8 up to 256; the k16 steps over the head dim
    // (Q K^T) and over the keys (P V) make both multiples of 16 here. A K/V panel of BLOCK_N rows
    // is then a whole number of 1024-byte swizzle atoms (8 rows x 128 B), which the descriptors'
    // base offset 0 and the V descriptor's LBO (one panel) need.
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 16 && HEAD_DIM <= 256,
                  "wgmma N of P V (= HEAD_DIM): a multiple of 16 up to 256");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256,
                  "wgmma N of Q K^T (= BLOCK_N): a multiple of 16 up to 256");
    static_assert(KV_PANEL_BYTES % 1024 == 0 && Q_PANEL_BYTES % 1024 == 0, "whole swizzle atoms");
    static_assert(ROWS_PER_WARPGROUP * (HEAD_DIM / 8) % WARPGROUP_THREADS == 0,
                  "the epilogue's 16-byte chunks split evenly over a warpgroup");
    static_assert(BLOCK_M % ROWS_PER_WARPGROUP == 0 && CONSUMER_WARPGROUPS >= 1, "whole WGs");
    static_assert(BLOCK_M <= 256 && BLOCK_N <= 256, "a TMA box has at most 256 rows");
    static_assert(STAGES >= 2, "a ring of at least two K/V stages");
    static_assert(split_fits(CONSUMER_THREADS, CONSUMER_REGISTERS),
                  "the setmaxnreg split fits the register file");
    static_assert(!PERSISTENT || SMEM_BYTES <= 227 * 1024,
                  "persistent: Q, the K/V ring and an O buffer must fit 227 KiB (head dims 64 and "
                  "128 with 2 stages, 96 with 2 stages instead of 3; 192 and 256 do not fit)");
    static_assert(SMEM_BYTES <= 227 * 1024, "one CTA per SM");
};

// S = Q K^T for this warpgroup's 64 rows over the head dim (hopper_primitives.cuh's K-major
// product: Q's rows and K's tile in 128-byte-swizzled panels). Issues the wgmmas only.
template <typename Elem, class T>
CF2_DEVICE void issue_qk(float (&acc_s)[T::N_TILES][4], u32 q_rows, u32 k_tile) {
    issue_kmajor_ss<Elem, T::KEYS_PER_TILE, T::QK_STEPS, T::Q_PANEL_BYTES, T::KV_PANEL_BYTES>(
        acc_s, q_rows, k_tile);
}

// The left half of S (keys 0 .. BLOCK_N / 2 - 1 of the tile): in the accumulator layout d[nt]
// holds columns 8 nt .., so it is the first half of the registers, and this view lets the
// masking and the softmax work on it alone.
template <int N_TILES>
using ScoreTile = float[1][N_TILES][4];
template <int N_TILES>
CF2_DEVICE ScoreTile<N_TILES / 2>& left_half(ScoreTile<N_TILES>& s) {
    return reinterpret_cast<ScoreTile<N_TILES / 2>&>(s);
}

// O += P V: PV_STEPS wgmmas, P (this warp's 16 rows x 16 keys per step) from registers, V from
// its descriptor as the MN-major B operand: the k16 step ks (keys 16 ks ..) starts 16 * 128 B
// further, SBO = 1024 B between groups of 8 keys, LBO = one panel between groups of 64 columns.
// N = HEAD_DIM: at d=96 the last 64-column group is read half (columns 64 .. 95 of the second
// panel), which CUTLASS's layout atoms would not express (it would pick the 64-byte swizzle for
// an N of 96); the hardware walks 8 x 8 core matrices, so this is expected to work, and the first
// d=96 run checks it. Issues the wgmmas only.
template <typename Elem, class T>
CF2_DEVICE void issue_pv(float (&acc_o)[T::D_TILES][4], u32 (&p)[T::PV_STEPS][4], u32 v_tile) {
#pragma unroll
    for (int ks = 0; ks < T::PV_STEPS; ++ks) {
        const u64 b = smem_matrix_descriptor(v_tile + 16 * 128 * ks, T::KV_PANEL_BYTES, 1024);
        wgmma_rs_trans_b<Elem, T::DIM>(acc_o, p[ks], b, 1);
    }
}

// S = Q K^T, complete on return.
template <typename Elem, class T>
CF2_DEVICE void gemm_qk(float (&acc_s)[T::N_TILES][4], u32 q_rows, u32 k_tile) {
    pin_registers(acc_s);
    wgmma_fence();
    issue_qk<Elem, T>(acc_s, q_rows, k_tile);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_s);
}

// O += P V, complete on return.
template <typename Elem, class T>
CF2_DEVICE void gemm_pv(float (&acc_o)[T::D_TILES][4], u32 (&p)[T::PV_STEPS][4], u32 v_tile) {
    pin_registers(acc_o);
    pin_registers(p);
    wgmma_fence();  // P and the rescaled O were written by ordinary instructions
    issue_pv<Elem, T>(acc_o, p, v_tile);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_o);
    pin_registers(p);
}

// One turn of the ping-pong schedule: wait for this warpgroup's turn on the tensor cores (the
// other consumer has issued its GEMMs), issue S_j = Q K_j^T (QK) and / or O += P_{j-1} V_{j-1}
// (PV), hand the turn over (`hand_over`), and wait for the GEMMs. Both warpgroups take the same
// number of turns; the softmax of one then runs while the other's GEMMs run.
template <bool QK, bool PV, typename Elem, class T>
CF2_DEVICE void gemm_turn(float (&acc_s)[T::N_TILES][4], float (&acc_o)[T::D_TILES][4],
                          u32 (&p)[T::PV_STEPS][4], u32 q_rows, u32 k_tile, u32 v_tile,
                          int my_turn, int other_turn, bool hand_over) {
    named_barrier_sync(my_turn, T::CONSUMER_THREADS);
    pin_registers(acc_s);
    pin_registers(acc_o);
    pin_registers(p);
    wgmma_fence();
    if constexpr (QK) issue_qk<Elem, T>(acc_s, q_rows, k_tile);
    if constexpr (PV) issue_pv<Elem, T>(acc_o, p, v_tile);
    wgmma_commit_group();
    if (hand_over) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
    wgmma_wait_group<0>();
    pin_registers(acc_s);
    pin_registers(acc_o);
    pin_registers(p);
}

// The mbarriers of the CTA (static shared memory, 8-byte aligned). Each flag adds its own
// barriers after those of the layers below it (derived structs), so that a specialisation
// without either flag keeps the layout of the first struct, one with OVERLAP alone adds v_empty
// right after kv_empty and one with PERSISTENT alone q_empty right after kv_empty.
template <int STAGES>
struct FwdSm90RingBarriers {
    u64 q_full;             // the Q tile landed
    u64 k_full[STAGES];     // K tile of the stage landed
    u64 v_full[STAGES];     // V tile of the stage landed
    u64 kv_empty[STAGES];   // every consumer thread is done with the stage's K (and V, unless
                            // V_EMPTY)
};

// V_EMPTY (with OVERLAP): K and V of a stage are given back separately. The overlapping schedule
// reads K_j at S_j and V_j one GEMM later (in the next iteration), so it gives K back as soon as
// S_j completed (kv_empty) and V after P_j V_j (v_empty): the producer's next K load into the
// stage then need not wait for the P V of the tile before it.
template <int STAGES, bool V_EMPTY>
struct FwdSm90KvBarriers : FwdSm90RingBarriers<STAGES> {};
template <int STAGES>
struct FwdSm90KvBarriers<STAGES, true> : FwdSm90RingBarriers<STAGES> {
    u64 v_empty[STAGES];    // every consumer thread is done with the stage's V
};

// Q_EMPTY (with PERSISTENT): the persistent grid reloads Q: one more barrier.
template <int STAGES, bool V_EMPTY, bool Q_EMPTY>
struct FwdSm90Barriers : FwdSm90KvBarriers<STAGES, V_EMPTY> {};
template <int STAGES, bool V_EMPTY>
struct FwdSm90Barriers<STAGES, V_EMPTY, true> : FwdSm90KvBarriers<STAGES, V_EMPTY> {
    u64 q_empty;  // every consumer thread is done reading Q (its last S GEMM of the tile)
};

// CLAIMS (persistent, tiles claimed dynamically): the claimed work tiles (WorkTileClaims), the
// CTA's k-th (k >= 1) in slot (k - 1) % CLAIM_SLOTS, full once the claimer put it there.
template <int STAGES, bool V_EMPTY, bool Q_EMPTY, bool CLAIMS>
struct FwdSm90ClaimBarriers : FwdSm90Barriers<STAGES, V_EMPTY, Q_EMPTY> {};
template <int STAGES, bool V_EMPTY>
struct FwdSm90ClaimBarriers<STAGES, V_EMPTY, true, true> : FwdSm90Barriers<STAGES, V_EMPTY, true> {
    static constexpr int CLAIM_SLOTS = 4;
    u64 claim_full[CLAIM_SLOTS];
    int claimed[CLAIM_SLOTS];
};

// One unit of work: BLOCK_M query rows (block m_block) of one (batch, head).
struct FwdWorkTile {
    int m_block;
    int head;
    int batch;
};

// The query rows of a work tile and the KV tiles they see: [tile_first, tile_end), visited from
// the last one down. Empty when no row sees any key.
struct FwdTileSpan {
    int row_first, row_last;  // row_last clipped to the sequence
    int tile_first, tile_end;
    CF2_DEVICE bool empty() const { return tile_end <= tile_first; }
};

// What both roles derive from a work tile: its rows and KV tiles, the K/V head, and where its
// output rows start (tile_context; the one-tile-per-CTA kernel spells it out in its prologue).
struct FwdTileContext {
    FwdWorkTile w;
    int kv_head;
    FwdTileSpan span;
    u16* o_block;      // O row row_first of (batch, head)
    float* lse_block;  // lse entry row_first of (batch, head)
    // Varlen (FEATURE_VARLEN) only: the sequence's rows in the packed q / k arrays (varlen.cuh);
    // span's rows and keys count from their starts. Unused (and left 0) by dense batches.
    SequenceRows seq_q = {0, 0};
    SequenceRows seq_k = {0, 0};
};

// The sequence lengths a work tile's rows and keys are checked against: the dense seqlen_q /
// seqlen_k, or (VARLEN) those of the tile's own sequence.
template <bool VARLEN>
CF2_DEVICE int tile_seqlen_q(const FwdParams& p, const FwdTileContext& c) {
    if constexpr (VARLEN) return c.seq_q.length;
    return p.seqlen_q;
}
template <bool VARLEN>
CF2_DEVICE int tile_seqlen_k(const FwdParams& p, const FwdTileContext& c) {
    if constexpr (VARLEN) return c.seq_k.length;
    return p.seqlen_k;
}

// Which keys a query row sees (masking.cuh).
CF2_DEVICE KeyVisibility key_visibility(const FwdParams& p) {
    return {p.seqlen_k - p.seqlen_q, p.window_left, p.window_right, p.seqlen_k};
}

// The same for one sequence of a varlen batch (VARLEN), or of a dense batch.
template <bool VARLEN>
CF2_DEVICE KeyVisibility key_visibility(const FwdParams& p, const SequenceRows& seq_q,
                                        const SequenceRows& seq_k) {
    if constexpr (VARLEN)
        return {seq_k.length - seq_q.length, p.window_left, p.window_right, seq_k.length};
    return key_visibility(p);
}

template <int BLOCK_M, int BLOCK_N>
CF2_DEVICE FwdTileContext tile_context(const FwdParams& p, const FwdWorkTile& w) {
    const int kv_head = w.head / p.heads_per_kv_head;
    const int row_first = w.m_block * BLOCK_M;
    const int row_last = min(row_first + BLOCK_M, p.seqlen_q) - 1;
    const KeyVisibility vis = key_visibility(p);
    int tile_first, tile_end;
    vis.tile_range(row_first, row_last, BLOCK_N, tile_first, tile_end);
    u16* o_block = p.out + w.batch * p.o_batch_stride + w.head * p.o_head_stride +
                   row_first * p.o_row_stride;
    float* lse_block =
        p.lse + (static_cast<i64>(w.batch) * p.nheads + w.head) * p.seqlen_q + row_first;
    return {w, kv_head, {row_first, row_last, tile_first, tile_end}, o_block, lse_block};
}

// The work tile of a CTA of the one-tile-per-CTA grid (m blocks, heads, batch). With an upper
// limit on keys (causal), later Q blocks see more keys: start those first so that the long CTAs
// do not form the tail of the grid.
CF2_DEVICE FwdWorkTile grid_work_tile(const FwdParams& p) {
    const int m_block = p.window_right >= 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    return {m_block, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z + p.batch_offset)};
}

// The work tiles of the persistent grid in the order its CTAs take them: CTA b takes tiles b,
// b + gridDim.x, b + 2 gridDim.x, ... (a static schedule). The (batch, head) pairs, numbered
// batch * nheads + head (the heads of one K/V head side by side), are cut into sections of
// section_pairs; a section's tiles come m block by m block, every pair of the section inside an m
// block. Under an upper limit on keys (causal) the m blocks run from the last: the longest tiles
// first, the short ones fill the tail; the host sizes the sections to fit L2 (FlashAttention-3's
// L2 swizzle), so that the later m blocks find the section's K/V there. Without one, and with
// one at d=96/128, the host gives sections of one pair (_hopper.persistent_schedule): the order
// is pair by pair, a pair's m blocks side by side, and the CTAs running at one time share each
// K/V tile's read from DRAM; under a key limit each pair's m blocks then start from a different
// one (rotated by the pair), else a grid of a multiple of m_blocks CTAs would give each CTA the
// same m block, long or short, every round. A 1-D index over every batch: no grid dimension
// limits the batch.
struct PersistentTiles {
    int m_blocks;
    int pairs;          // batch * nheads
    int section_pairs;  // 1 .. pairs
    int nheads;
    int batch_offset;
    bool longest_first;

    CF2_DEVICE int count() const { return m_blocks * pairs; }

    CF2_DEVICE FwdWorkTile operator[](int t) const {
        const int section_tiles = section_pairs * m_blocks;
        const int section = t / section_tiles;
        const int first_pair = section * section_pairs;
        const int width = min(section_pairs, pairs - first_pair);  // the last section: the rest
        const int in_section = t - section * section_tiles;
        int m = in_section / width;
        const int pair = first_pair + in_section - m * width;
        // Sections of one pair under a key limit: each pair's m blocks from a different one.
        if (longest_first && width == 1) m = (m + pair) % m_blocks;
        const int batch = pair / nheads;
        return {longest_first ? m_blocks - 1 - m : m, pair - batch * nheads, batch + batch_offset};
    }
};

// Which work tiles a CTA of the persistent grid takes, one after the other (its k-th, k = 0,
// 1, ...): first its own, blockIdx.x, then
//  - static (the kernel without CLAIMS): every gridDim.x-th, blockIdx.x + gridDim.x, ...;
//  - dynamic (CLAIMS, this struct): the next tile nobody has claimed yet, gridDim.x + a ticket
//    of counters[0] (one atomic a tile). A CTA whose tiles were short takes more, so the order's
//    tiles (the longest first under a key limit) spread evenly however long each is;
//    statically the CTAs of a causal call, whose tiles are 1 to m_blocks KV tiles long, end
//    3-45% apart. (A specialisation of its own: the claims' code in the static kernel's loop
//    cost its short rows 1-2%.)
// The dynamic claims are made by one consumer thread (`claimer`), not by the producer: an
// atomic with a return value anywhere in the producer warpgroup's 24 registers spills (48
// bytes at d=128). The claimer claims the k-th tile at the start of its own work tile k - LEAD
// and puts it in slot (k - 1) % CLAIM_SLOTS at that tile's end, the atomic's round trip under
// the tile's work; the first LEAD - 1 are claimed before its loop. The producer needs the k-th
// tile once it has issued tile k - 1's loads, which is never before the consumers work on tile
// k - 2 (Q is loaded once a tile, after their last S GEMM of the tile before). Every role reads
// the k-th tile from its slot once it is full (claim_full). A slot is written again SLOTS tiles
// later, at the end of the claimer's tile k + SLOTS - LEAD >= k + 1: that tile's Q was loaded
// once every consumer thread was done with tile k's S GEMMs, after the producer had read tile
// k + 1, so every role has read tile k by then. That holds where every work tile loads a Q:
// tiles that see no key would let the consumers run ahead of a lagging reader without a
// barrier, so the host claims dynamically only where every query row sees a key
// (_hopper.dynamic_schedule).
// counters[1] counts the CTAs that ran out of tiles; the last one resets both counters for the
// next launch (launches on one stream run one after the other, and the host gives each stream
// its own pair: FwdSm90Params.tile_counters, never null for these launches).
template <bool VALUE>
struct CompileTimeFlag {
    static constexpr bool value = VALUE;
};

template <class Bars>
struct WorkTileClaims {
    static constexpr int LEAD = 3;
    static constexpr int SLOTS = Bars::CLAIM_SLOTS;
    static_assert(SLOTS > LEAD, "a slot is written again once every role has read it");
    int* counters;
    int count;  // work tiles in all
    Bars& bars;

    // The k-th work tile (k >= 1; count or more: none left). Every role of the CTA calls it for
    // every k until it returns none.
    CF2_DEVICE int take(int k) const {
        const int slot = (k - 1) % SLOTS;
        mbarrier_wait(smem_address(&bars.claim_full[slot]), ((k - 1) / SLOTS) & 1);
        return *static_cast<volatile int*>(&bars.claimed[slot]);
    }

    // ---- the claimer (one consumer thread) ----
    CF2_DEVICE int claim() const { return atomicAdd(counters, 1) + static_cast<int>(gridDim.x); }
    // The k-th tile into its slot.
    CF2_DEVICE void put(int k, int tile) const {
        const int slot = (k - 1) % SLOTS;
        bars.claimed[slot] = tile;
        mbarrier_arrive(smem_address(&bars.claim_full[slot]));  // releases the write
    }
    // Before the loop: tiles 1 .. LEAD - 1, waited for (the producer needs tile 1 as soon as
    // tile 0's loads are issued).
    CF2_DEVICE void start() const {
        for (int k = 1; k < LEAD; ++k) put(k, claim());
    }
    // At the start of work tile k, claim() for tile k + LEAD; at its end, the tile into its
    // slot. (A claim past the last tile comes back with none, as many times as asked.)
    CF2_DEVICE void put_ahead(int k, int tile) const { put(k + LEAD, tile); }

    // After the loop, every claim of this CTA having come back.
    CF2_DEVICE void finish() const {
        __threadfence();  // this CTA's claims come before its arrival
        if (atomicAdd(counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {
            atomicExch(counters, 0);  // every CTA has claimed its last tile
            atomicExch(counters + 1, 0);
        }
    }
};

// Rows row0 .. row0 + ROWS - 1 of a work tile whose rows see no key: O = 0 and lse = +inf (the
// log of an empty sum), written by THREADS threads, `tid` being one of them. No shared memory,
// no barrier. head_chunks: the 16-byte chunks actually present in an O row.
template <class T, int ROWS, int THREADS, bool VARLEN = false>
CF2_DEVICE void store_empty_rows(const FwdParams& p, const FwdTileContext& c, int head_chunks,
                                 int row0, int tid) {
    u16* o_block = c.o_block;
    float* lse_block = c.lse_block;
    const int row_first = c.span.row_first;
    const int seqlen_q = tile_seqlen_q<VARLEN>(p, c);
    constexpr int CHUNKS = T::DIM / 8;
    const u32 zeros[4] = {0u, 0u, 0u, 0u};
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
        const int row = row0 + idx / CHUNKS, chunk = idx % CHUNKS;
        if (row_first + row < seqlen_q && chunk < head_chunks)
            store_16B_global(o_block + row * p.o_row_stride + chunk * 8, zeros);
    }
    for (int row = row0 + tid; row < row0 + ROWS; row += THREADS)
        if (row_first + row < seqlen_q) lse_block[row] = pos_inf();
}

// The producer's loads for one work tile (thread 0 of warpgroup 0): Q, then K_j and V_j of every
// KV tile the rows see, from the last one down, into the ring from position ring0 on: the j-th
// tile visited takes position ring0 + j, stage (ring0 + j) % STAGES, whose barriers are in their
// ((ring0 + j) / STAGES)-th phase. Positions continue across a persistent CTA's work tiles, so
// the producer runs ahead into the next work tile while the consumers finish this one.
// PERSISTENT: Q goes in after K of the first KV tile (which needs only a free stage), once every
// consumer thread is done with the previous work tile's Q (q_empty, round q_round - 1; a fresh
// barrier passes round 0 at once).
// OVERLAP: kv_empty gives back a stage's K alone; V goes in once its V is given back (v_empty).
// With both, Q comes before the wait for V: the previous work tile's last S = Q K^T completes
// before the P V whose V the wait is for.
// VARLEN: the maps cover the packed arrays (batch extent 1): rows count from the sequence's first
// row, the batch coordinate is 0. A box that runs past the sequence reads the next sequence's
// rows (the TMA zero-fills only past the packed array's end): K's are masked (the sequence's
// last KV tile is a boundary tile), V's meet P = 0, Q's rows are computed and not stored.
template <class T, bool OVERLAP, bool PERSISTENT, bool VARLEN = false>
CF2_DEVICE void produce_tile(const FwdSm90Params& params, const FwdTileContext& c, int ring0,
                             int q_round, u32 q_smem, u32 kv_smem,
                             FwdSm90Barriers<T::KV_STAGES, OVERLAP, PERSISTENT>& bars) {
    constexpr int STAGES = T::KV_STAGES;
    const FwdWorkTile& w = c.w;
    const FwdTileSpan& span = c.span;
    const int kv_head = c.kv_head;
    const int batch = VARLEN ? 0 : w.batch;        // the maps' batch coordinate
    const int q_row0 = VARLEN ? c.seq_q.start : 0;  // the maps' row of the sequence's row 0
    const int k_row0 = VARLEN ? c.seq_k.start : 0;
    auto load_q = [&]() {
        const u32 q_full = smem_address(&bars.q_full);
        mbarrier_arrive_expect_tx(q_full, T::Q_BYTES);
        tma_load_tile<T::PANELS, T::Q_PANEL_BYTES>(q_smem, params.q_map, q_full,
                                                   q_row0 + span.row_first, w.head, batch);
    };
    if constexpr (!PERSISTENT) load_q();
    for (int tile = span.tile_end - 1, j = 0; tile >= span.tile_first; --tile, ++j) {
        const int ring = ring0 + j;
        const int stage = ring % STAGES;
        const u32 phase = (ring / STAGES) & 1;
        // Wait until the consumers released the stage's previous tile (its K alone with OVERLAP;
        // the first pass over the ring waits for parity 1 of fresh barriers: it passes at once).
        mbarrier_wait(smem_address(&bars.kv_empty[stage]), phase ^ 1);
        const u32 k_tile = kv_smem + stage * T::STAGE_BYTES;
        const u32 v_tile = k_tile + T::KV_TILE_BYTES;
        const u32 k_full = smem_address(&bars.k_full[stage]);
        const u32 v_full = smem_address(&bars.v_full[stage]);
        mbarrier_arrive_expect_tx(k_full, T::KV_TILE_BYTES);
        tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(k_tile, params.k_map, k_full,
                                                    k_row0 + tile * T::KEYS_PER_TILE, kv_head,
                                                    batch);
        if constexpr (PERSISTENT) {
            if (j == 0) {
                mbarrier_wait(smem_address(&bars.q_empty), (q_round & 1) ^ 1);
                load_q();
            }
        }
        // With OVERLAP the consumers give the stage's V back separately, after its P V.
        if constexpr (OVERLAP) mbarrier_wait(smem_address(&bars.v_empty[stage]), phase ^ 1);
        mbarrier_arrive_expect_tx(v_full, T::KV_TILE_BYTES);
        tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(v_tile, params.v_map, v_full,
                                                    k_row0 + tile * T::KEYS_PER_TILE, kv_head,
                                                    batch);
    }
}

// One work tile of a consumer warpgroup (warpgroup 1 + c owns rows 64 c .. 64 c + 63 of it):
// the FA2 loop over its KV tiles from ring position ring0 on (produce_tile), then the epilogue.
// q_round: the how-many-th Q of this CTA the tile's Q is (the parity of its q_full phase).
template <typename Elem, class T, bool PINGPONG, bool OVERLAP, int FEATURES, bool PERSISTENT>
CF2_DEVICE void consume_tile(const FwdParams& p, const KeyVisibility& vis,
                             const FwdTileContext& c, int head_chunks, int ring0, int q_round,
                             int consumer, u32 q_smem, u32 kv_smem, u32 o_smem,
                             FwdSm90Barriers<T::KV_STAGES, OVERLAP, PERSISTENT>& bars) {
    constexpr int STAGES = T::KV_STAGES;
    constexpr int BLOCK_N = T::KEYS_PER_TILE;
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    const FwdWorkTile& w = c.w;
    const FwdTileSpan& span = c.span;
    const int row_first = span.row_first, row_last = span.row_last;
    const int tile_first = span.tile_first, tile_end = span.tile_end;
    const int warp = (threadIdx.x / 32) % 4;  // in the warpgroup: rows 16 warp .. + 15
    const int lane = threadIdx.x % 32;
    const int wg_row0 = T::ROWS_PER_WARPGROUP * consumer;  // in the tile
    // This warpgroup's rows in every panel of Q (A operand of S = Q K^T).
    const u32 q_rows = q_smem + wg_row0 * T::ROW_BYTES;

    // The unnormalised output, as one m16 tile a warp (the layout online_softmax.cuh takes).
    float acc_o[1][T::D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    OnlineSoftmax<1> softmax;  // one m16 tile a warp: this thread's rows g and g + 8
    ScoreMods<FEATURES> mods(p.mods, tile_seqlen_q<VARLEN>(p, c),
                             tile_seqlen_k<VARLEN>(p, c));
    mods.select_head(p.mods, w.batch, w.head);

    // Tiles in [tile_first, unmasked_lo) and [unmasked_hi, tile_end) cross a window edge or the
    // sequence tail and need masking; the others run without any masking code. The range is the
    // work tile's (the producer loads the same tiles for both warpgroups).
    int unmasked_lo, unmasked_hi;
    vis.unmasked_tile_range(row_first, row_last, BLOCK_N, unmasked_lo, unmasked_hi);

    // Half tiles (ping-pong + overlap, the dispatched two-consumer schedule): this warpgroup's
    // rows see no key at or past hi() of its last row (hi grows with the row; rows past the
    // sequence are computed but never stored, so the last row is clipped to row_last). If that
    // lies in the left half of the work tile's first KV tile (under a causal mask the upper 64
    // rows of a diagonal tile; a short sequence tail), the softmax of that tile covers its left
    // half alone (masking, row maxima, half the exponentials) and the right half's
    // probabilities are set to 0, as the mask would have made them. That tile is a boundary
    // tile, masked: its right half holds keys the row block does not see.
    //  - The GEMMs stay whole. With a branch between a half and a whole wgmma ptxas joined the
    //    two with a wgmma of its own and a wait, or serialised every wgmma for want of
    //    registers (C7511, d=96 and 128 on the persistent grid): 10-35% slower.
    //  - The flag is the same for the whole warpgroup, but ptxas cannot tell (it comes from
    //    the warpgroup's index), and a branch on it around wgmmas makes it serialise them
    //    (C7519, "WG.AR in divergent path"): a vote's result is warp-uniform to it.
    //  - Not in the in-order schedule (three consumers at d=64): with half tiles, and with a
    //    warpgroup skipping a first tile it does not see at all, it measured 0.96-1.02x.
    constexpr bool HALF_TILES = T::template HALF_TILES<FEATURES> && PINGPONG && OVERLAP;
    const int wg_key_end = vis.hi(min(row_first + wg_row0 + T::ROWS_PER_WARPGROUP - 1, row_last));
    const bool half_tile = HALF_TILES && __all_sync(0xffffffffu, wg_key_end <= (tile_end - 1) *
                                                                     BLOCK_N + BLOCK_N / 2);

    // Ring addresses of the j-th tile visited in this work tile (tile = tile_end - 1 - j): ring
    // position ring0 + j (positions continue across a persistent CTA's work tiles), stage
    // (ring0 + j) % STAGES, whose barriers are in their ((ring0 + j) / STAGES)-th phase.
    auto ring_of = [&](int j) { return ring0 + j; };
    auto k_tile_of = [&](int j) { return kv_smem + (ring_of(j) % STAGES) * T::STAGE_BYTES; };
    auto v_tile_of = [&](int j) { return k_tile_of(j) + T::KV_TILE_BYTES; };
    auto wait_k = [&](int j) {
        mbarrier_wait(smem_address(&bars.k_full[ring_of(j) % STAGES]), (ring_of(j) / STAGES) & 1);
    };
    auto wait_v = [&](int j) {
        mbarrier_wait(smem_address(&bars.v_full[ring_of(j) % STAGES]), (ring_of(j) / STAGES) & 1);
    };
    auto release = [&](int j) {
        mbarrier_arrive(smem_address(&bars.kv_empty[ring_of(j) % STAGES]));
    };
    // OVERLAP gives K and V of a stage back separately (FwdSm90KvBarriers::v_empty).
    auto release_k = [&](int j) {
        mbarrier_arrive(smem_address(&bars.kv_empty[ring_of(j) % STAGES]));
    };
    auto release_v = [&](int j) {
        if constexpr (OVERLAP) mbarrier_arrive(smem_address(&bars.v_empty[ring_of(j) % STAGES]));
    };
    // After the work tile's last S GEMM has completed, Q is no longer read: the producer may load
    // the next work tile's Q (persistent grid) under this tile's last P V and epilogue.
    auto release_q = [&]() {
        if constexpr (PERSISTENT) mbarrier_arrive(smem_address(&bars.q_empty));
    };

    // S_j in place: score modifiers, mask (boundary tiles only). S is in the mma.sync
    // accumulator layout of one m16 tile per warp.
    auto score_step = [&](auto& acc_s, int tile) {  // S or its left_half
        // This thread's first accumulator row (query index) and key.
        const int thread_row0 = row_first + wg_row0 + 16 * warp + lane / 4;
        const int thread_key0 = tile * BLOCK_N + 2 * (lane % 4);
        if constexpr (FEATURES != 0) mods.apply(acc_s, thread_row0, thread_key0);
        if (tile < unmasked_lo || tile >= unmasked_hi)
            mask_scores(acc_s, thread_row0, thread_key0, vis);
    };
    // S_j -> P_j: score_step, online softmax (new running max; O and l rescaled where it moved),
    // then P = exp2(S * scale_log2 - m) packed to 16 bits as the A operand of P V, one k16 slice
    // at a time.
    auto softmax_step = [&](float (&acc_s)[1][T::N_TILES][4], u32 (&p_frag)[T::PV_STEPS][4],
                            int tile) {
        score_step(acc_s, tile);
        softmax.update_max(acc_s, acc_o, p.scale_log2);
#pragma unroll
        for (int ks = 0; ks < T::PV_STEPS; ++ks)
            softmax.template exp_pack<Elem>(p_frag[ks], acc_s[0][2 * ks], acc_s[0][2 * ks + 1], 0,
                                            p.scale_log2);
    };

    mbarrier_wait(smem_address(&bars.q_full), q_round & 1);
    if constexpr (OVERLAP) {
        // The overlap inside a warpgroup (FlashAttention-3's intra-warpgroup pipelining).
        // Iteration j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two commit groups, in that
        // order. wgmma groups complete in order, so `wait_group 1` (at most one group pending)
        // returns once S_j is complete while P_{j-1} V_{j-1} may still run, and the softmax of
        // tile j runs under that GEMM: score modifiers, mask, new running max (the sums rescaled,
        // O's factors kept for later), the exponentials in place in the S registers (fp32). The
        // next iteration opens with `wait_group 0`: O is complete and the P registers are free,
        // so P_j is packed from the S registers before S_{j+1} overwrites them. (The wait opens
        // an iteration rather than closing one because ptxas hoists a wgmma wait to the top of
        // its basic block: after the softmax, in the same block, it would move above the softmax
        // and serialise it behind the P V again. The loop's back edge keeps it below.)
        // O's rescale for tile j's max has to land between P_{j-1} V_{j-1} (which writes O) and
        // P_j V_j: it runs once S_{j+1} was issued, its multiplies under that Q K^T GEMM. Same
        // online softmax: O_j = c_j O_{j-1} + P_j V_j.
        // Registers: S_j, P_{j-1} and O live together (as in ping-pong).
        // pin_registers fences each wgmma window: before wgmma_fence (what ordinary instructions
        // wrote is in place) and after each wait (nothing reads a result, or reuses a register
        // the GEMM still reads, earlier).
        // K_j is read by S_j alone and given back once S_j completed (release_k); V_{j-1} after
        // its P V (release_v). Q is read by the S GEMMs alone: the work tile's last one,
        // S_{tiles-1}, is complete once the wait_group 1 of the last iteration returned (the
        // wait_group 0 of tile 0 for a work tile of one KV tile), and Q goes back there
        // (release_q), under the last P V GEMMs, the last softmax and the epilogue.
        // With PINGPONG the two GEMMs of an iteration are one turn of the consumers' alternation
        // (turns as in the ping-pong branch below, in step across a persistent CTA's tiles).
        const int my_turn = T::TURN_BARRIER + consumer;
        const int other_turn = T::TURN_BARRIER + (1 - consumer);
        auto take_turn = [&]() {
            if constexpr (PINGPONG) named_barrier_sync(my_turn, T::CONSUMER_THREADS);
        };
        auto hand_over = [&](bool to_other) {
            if constexpr (PINGPONG)
                if (to_other) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
        };
        if constexpr (PINGPONG)
            if (consumer == 1) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
        float acc_s[1][T::N_TILES][4];
        u32 p_frag[T::PV_STEPS][4];
        float correction[2];   // O's factors for the running max of the last softmax
        bool rescale = false;  // whether any row of the warp needs them (O = 0 at first)
        // Waits for P_{j-1} V_{j-1} (every wgmma of this warpgroup), gives V_{j-1} back and packs
        // P_j from the probabilities in the S registers.
        auto finish_pv_pack = [&](int j) {
            wgmma_wait_group<0>();
            pin_registers(acc_o[0]);
            pin_registers(p_frag);
            if (j > 0) release_v(j - 1);
#pragma unroll
            for (int ks = 0; ks < T::PV_STEPS; ++ks)
                softmax.template pack_p<Elem>(p_frag[ks], acc_s[0][2 * ks], acc_s[0][2 * ks + 1]);
        };
        const int tiles = tile_end - tile_first;

        // Tile 0: S_0 alone, then its softmax (of S_0's left half alone with half_tile, the
        // right half's probabilities set to 0).
        wait_k(0);
        take_turn();
        pin_registers(acc_s[0]);
        wgmma_fence();
        issue_qk<Elem, T>(acc_s[0], q_rows, k_tile_of(0));
        wgmma_commit_group();
        hand_over(true);
        wgmma_wait_group<0>();
        pin_registers(acc_s[0]);
        release_k(0);
        if (tiles == 1) release_q();  // S_0 was the last S GEMM
        auto first_softmax = [&](auto& s) {
            score_step(s, tile_end - 1);
            softmax.fold_max(s, p.scale_log2, correction);  // O is 0: no rescale
            softmax.exp_scores(s, p.scale_log2);
        };
        if constexpr (HALF_TILES) {
            if (half_tile) {
                first_softmax(left_half(acc_s));
#pragma unroll
                for (int nt = T::N_TILES / 2; nt < T::N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
            } else {
                first_softmax(acc_s);
            }
        } else {
            first_softmax(acc_s);
        }
        for (int j = 1; j < tiles; ++j) {
            finish_pv_pack(j - 1);  // P_{j-2} V_{j-2} (none at j = 1); P_{j-1}
            wait_k(j);
            take_turn();
            pin_registers(acc_s[0]);
            pin_registers(acc_o[0]);
            pin_registers(p_frag);
            wgmma_fence();
            issue_qk<Elem, T>(acc_s[0], q_rows, k_tile_of(j));
            wgmma_commit_group();  // group 1: S_j
            // O is complete (P_{j-2} V_{j-2} was waited for): tile j-1's rescale.
            softmax.rescale_o(acc_o, correction, rescale);
            pin_registers(acc_o[0]);
            wait_v(j - 1);
            wgmma_fence();  // O was written by the rescale
            issue_pv<Elem, T>(acc_o[0], p_frag, v_tile_of(j - 1));
            wgmma_commit_group();  // group 2: P_{j-1} V_{j-1}
            hand_over(true);
            wgmma_wait_group<1>();  // S_j complete; P_{j-1} V_{j-1} may still run
            pin_registers(acc_s[0]);
            release_k(j);
            if (j == tiles - 1) release_q();  // S_j was the last S GEMM
            score_step(acc_s, tile_end - 1 - j);
            rescale = softmax.fold_max(acc_s, p.scale_log2, correction);
            softmax.exp_scores(acc_s, p.scale_log2);
        }
        // The last P V, after the rescale for the last tile's max.
        finish_pv_pack(tiles - 1);
        softmax.rescale_o(acc_o, correction, rescale);
        wait_v(tiles - 1);
        take_turn();
        pin_registers(acc_o[0]);
        pin_registers(p_frag);
        wgmma_fence();
        issue_pv<Elem, T>(acc_o[0], p_frag, v_tile_of(tiles - 1));
        wgmma_commit_group();
        hand_over(consumer == 0);  // as in ping-pong: consumer 1's last turn is the last one
        wgmma_wait_group<0>();
        pin_registers(acc_o[0]);
        pin_registers(p_frag);
        release_v(tiles - 1);
    } else if constexpr (!PINGPONG) {
        // Per tile, in order: S_j = Q K_j^T as soon as K_j landed; P_j; O += P_j V_j as soon as
        // V_j landed; the stage goes back to the producer.
        for (int tile = tile_end - 1, j = 0; tile >= tile_first; --tile, ++j) {
            float acc_s[1][T::N_TILES][4];
            u32 p_frag[T::PV_STEPS][4];
            wait_k(j);
            gemm_qk<Elem, T>(acc_s[0], q_rows, k_tile_of(j));
            if (tile == tile_first) release_q();
            softmax_step(acc_s, p_frag, tile);
            wait_v(j);
            gemm_pv<Elem, T>(acc_o[0], p_frag, v_tile_of(j));
            release(j);
        }
    } else {
        // Ping-pong: the GEMMs of tile j are S_j and P_{j-1} V_{j-1}, issued in one turn, and the
        // turns alternate between the two consumers (named barriers TURN_BARRIER + c): while one
        // computes its softmax, the tensor cores run the other's GEMMs. O is up to date with
        // P_{j-1} V_{j-1} before the softmax of tile j rescales it, so this is the same online
        // softmax. Consumer 1 hands consumer 0 the first turn; its own last turn hands nothing
        // over (no turn of consumer 0 follows in this work tile; the next work tile starts with
        // the same hand-over, so the turns stay in step across a persistent CTA's tiles).
        const int my_turn = T::TURN_BARRIER + consumer;
        const int other_turn = T::TURN_BARRIER + (1 - consumer);
        if (consumer == 1) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
        float acc_s[1][T::N_TILES][4];
        u32 p_frag[T::PV_STEPS][4];
        const int tiles = tile_end - tile_first;
        wait_k(0);
        gemm_turn<true, false, Elem, T>(acc_s[0], acc_o[0], p_frag, q_rows, k_tile_of(0), 0,
                                        my_turn, other_turn, true);
        if (tiles == 1) release_q();
        softmax_step(acc_s, p_frag, tile_end - 1);
        for (int j = 1; j < tiles; ++j) {
            wait_k(j);
            wait_v(j - 1);
            gemm_turn<true, true, Elem, T>(acc_s[0], acc_o[0], p_frag, q_rows, k_tile_of(j),
                                           v_tile_of(j - 1), my_turn, other_turn, true);
            release(j - 1);
            if (j == tiles - 1) release_q();
            softmax_step(acc_s, p_frag, tile_end - 1 - j);
        }
        wait_v(tiles - 1);
        gemm_turn<false, true, Elem, T>(acc_s[0], acc_o[0], p_frag, q_rows, 0,
                                        v_tile_of(tiles - 1), my_turn, other_turn,
                                        consumer == 0);
        release(tiles - 1);
    }

    // Epilogue: divide by l once; stage the tile through this warpgroup's own rows of the O
    // buffer, in Q's swizzled layout (conflict-free), then write 16-byte row chunks to global
    // memory. Without PERSISTENT the O buffer is the Q buffer: no other warpgroup reads those
    // rows and this one's last wgmma reading them has completed. With it, O has a buffer of its
    // own (the next work tile's Q may be landing in Q's), reused tile after tile.
    u16* o_block = c.o_block;
    float* lse_block = c.lse_block;
    float inv_sum[2], row_lse[2];
    softmax.finalize(p.softmax_scale, inv_sum, row_lse);
    if constexpr (PERSISTENT)
        // Every warp of the warpgroup has read the previous work tile's O out of the buffer.
        named_barrier_sync(T::EPILOGUE_BARRIER + consumer, T::WARPGROUP_THREADS);
    else
        fence_proxy_async_shared();  // Q was last read by wgmma (async proxy); now plain stores
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = wg_row0 + 16 * warp + 8 * half + lane / 4;  // in the tile
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt) {
            const u32 packed = pack_pair<Elem>(acc_o[0][dt][2 * half] * inv_sum[half],
                                               acc_o[0][dt][2 * half + 1] * inv_sum[half]);
            store_4B_shared(swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, dt) + 4 * (lane % 4),
                            packed);
        }
        if (lane % 4 == 0 && row_first + row < tile_seqlen_q<VARLEN>(p, c))
            lse_block[row] = row_lse[half];
    }
    named_barrier_sync(T::EPILOGUE_BARRIER + consumer, T::WARPGROUP_THREADS);
    const int tid = threadIdx.x % T::WARPGROUP_THREADS;
    constexpr int CHUNKS = T::DIM / 8;
#pragma unroll
    for (int i = 0; i < T::ROWS_PER_WARPGROUP * CHUNKS / T::WARPGROUP_THREADS; ++i) {
        const int idx = tid + T::WARPGROUP_THREADS * i;
        const int row = wg_row0 + idx / CHUNKS;
        const int chunk = idx % CHUNKS;
        if (row_first + row < tile_seqlen_q<VARLEN>(p, c) && chunk < head_chunks) {
            u32 vals[4];
            load_16B_shared(vals, swizzled_chunk<T::Q_PANEL_BYTES>(o_smem, row, chunk));
            store_16B_global(o_block + row * p.o_row_stride + chunk * 8, vals);
        }
    }
}

// PINGPONG: the consumers take turns on the tensor cores (one's softmax under the other's GEMMs;
// see consume_tile); false: each consumer runs its tiles straight through.
// OVERLAP: the overlap inside a warpgroup (FlashAttention-3's intra-warpgroup pipelining): the
// softmax of tile j runs while the tensor cores compute P_{j-1} V_{j-1} (see consume_tile).
// With or without PINGPONG, on either grid.
// FEATURES: the score modifiers of score_mods.cuh (softcap, ALiBi) and FEATURE_VARLEN (packed
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
    // is tile_context() spelt out in the order the kernel has always computed it, so that the
    // one-tile-per-CTA specialisations keep their SASS.
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
            store_empty_rows<T, BLOCK_M, T::THREADS, VARLEN>(p, own, head_chunks, 0,
                                                             threadIdx.x);
            return;
        }
    }

    if (threadIdx.x == 0) {
        mbarrier_init(smem_address(&bars.q_full), 1);
        if constexpr (PERSISTENT) mbarrier_init(smem_address(&bars.q_empty), T::CONSUMER_THREADS);
        if constexpr (CLAIMS) {
            for (int s = 0; s < bars.CLAIM_SLOTS; ++s)
                mbarrier_init(smem_address(&bars.claim_full[s]), 1);  // the claimer's put
        }
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(smem_address(&bars.k_full[s]), 1);  // the producer's expect_tx arrival
            mbarrier_init(smem_address(&bars.v_full[s]), 1);
            mbarrier_init(smem_address(&bars.kv_empty[s]), T::CONSUMER_THREADS);
            if constexpr (OVERLAP)
                mbarrier_init(smem_address(&bars.v_empty[s]), T::CONSUMER_THREADS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    // Runs work(tile, ring0, q_round) for each work tile of this CTA whose rows see a key and
    // empty(tile) for the others (tile: its FwdTileContext). ring0 is the ring position of the
    // tile's first KV tile (the KV tiles of the CTA's earlier work tiles), q_round the number of
    // Qs loaded before its own; a tile that sees no key is loaded by no one and takes neither.
    // Both roles walk the same tiles in the same order (with CLAIMS: WorkTileClaims), so their
    // ring positions and phases agree. `claimer` (CLAIMS): this thread makes the claims; the
    // producer's instance has no claiming code at all (`may_claim`: an atomic with a return
    // value there spills, WorkTileClaims).
    auto for_each_work_tile = [&](auto may_claim, bool claimer, auto&& work, auto&& empty) {
        if constexpr (!PERSISTENT) {
            work(own, 0, 0);
        } else {
            const PersistentTiles order{(p.seqlen_q + BLOCK_M - 1) / BLOCK_M,
                                        params.batch * p.nheads, params.section_pairs, p.nheads,
                                        p.batch_offset, p.window_right >= 0};
            int ring = 0, q_round = 0;
            if constexpr (!CLAIMS) {
                // Spelt out as before the claims: through `run` below, the same steps compile
                // to other SASS, and these specialisations keep the code that was measured.
                for (int t = blockIdx.x; t < order.count(); t += gridDim.x) {
                    const FwdTileContext tile = tile_context<BLOCK_M, BLOCK_N>(p, order[t]);
                    if (tile.span.empty()) {
                        empty(tile);
                        continue;
                    }
                    work(tile, ring, q_round);
                    ring += tile.span.tile_end - tile.span.tile_first;
                    ++q_round;
                }
            } else {
                auto run = [&](const FwdTileContext& tile, int& ring, int& q_round) {
                    if (tile.span.empty()) {
                        empty(tile);
                        return;
                    }
                    work(tile, ring, q_round);
                    ring += tile.span.tile_end - tile.span.tile_first;
                    ++q_round;
                };
                constexpr bool MAY_CLAIM = decltype(may_claim)::value;
                const WorkTileClaims<decltype(bars)> claims{params.tile_counters, order.count(),
                                                            bars};
                if constexpr (MAY_CLAIM)
                    if (claimer) claims.start();
                for (int k = 0, t = blockIdx.x; t < order.count(); t = claims.take(++k)) {
                    int ahead = 0;
                    if constexpr (MAY_CLAIM)
                        if (claimer) ahead = claims.claim();
                    run(tile_context<BLOCK_M, BLOCK_N>(p, order[t]), ring, q_round);
                    if constexpr (MAY_CLAIM)
                        if (claimer) claims.put_ahead(k, ahead);
                }
                if constexpr (MAY_CLAIM)
                    if (claimer) claims.finish();
            }
        }
    };

    const int warpgroup = threadIdx.x / T::WARPGROUP_THREADS;
    if (warpgroup == 0) {
        // ---- producer ----
        setmaxnreg_dec<T::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0)
            for_each_work_tile(
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
        for_each_work_tile(
            CompileTimeFlag<true>{},
            threadIdx.x == T::WARPGROUP_THREADS,  // the first consumer thread claims
            [&](const FwdTileContext& tile, int ring0, int q_round) {
                consume_tile<Elem, T, PINGPONG, OVERLAP, FEATURES, PERSISTENT>(
                    p, vis, tile, head_chunks, ring0, q_round, consumer, q_smem, kv_smem, o_smem,
                    bars);
            },
            [&](const FwdTileContext& tile) {
                const int wg_row0 = T::ROWS_PER_WARPGROUP * consumer;
                store_empty_rows<T, T::ROWS_PER_WARPGROUP, T::WARPGROUP_THREADS>(
                    p, tile, head_chunks, wg_row0, threadIdx.x % T::WARPGROUP_THREADS);
            });
    }
}
