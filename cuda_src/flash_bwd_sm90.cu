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
#include "hopper_primitives.cuh"
#include "masking.cuh"
#include "score_mods.cuh"
#include "dq_accum.cuh"
#include "varlen.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

template <typename Elem, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, int DQ_TILES>
struct BwdSm90Traits : Sm90CtaLayout {
    // dQ through shared memory (the kernel's note) in DQ_BUFFERS fp32 tiles, or (0) by vector
    // reductions from the registers.
    static constexpr int DQ_BUFFERS = DQ_TILES;
    static constexpr bool DQ_STAGED = DQ_BUFFERS > 0;
    static constexpr int KEYS_PER_WARPGROUP = 64;  // the M of wgmma
    static constexpr int CONSUMER_WARPGROUPS = BLOCK_N / KEYS_PER_WARPGROUP;
    static constexpr int CONSUMER_THREADS = CONSUMER_WARPGROUPS * WARPGROUP_THREADS;
    static constexpr int THREADS = WARPGROUP_THREADS + CONSUMER_THREADS;  // + the producer
    static constexpr int ENTRY_REGISTERS = entry_registers(THREADS);
    // Named barriers (0 is __syncthreads): both consumers' dS stored; both consumers done with
    // K and V (the epilogue reuses them); one per consumer for its staged dK / dV.
    static constexpr int DS_BARRIER = 1;
    static constexpr int EPILOGUE_BARRIER = 2;
    static constexpr int STORE_BARRIER = 3;

    // Tiles as the forward's (Sm90CtaLayout): panels of 64 columns as the TMA writes them; d=96's
    // second panel half zero-filled and never multiplied.
    static constexpr int PANELS = (HEAD_DIM + PANEL_COLS - 1) / PANEL_COLS;
    static constexpr int KV_PANEL_BYTES = BLOCK_N * ROW_BYTES;
    static constexpr int KV_TILE_BYTES = PANELS * KV_PANEL_BYTES;
    static constexpr int Q_PANEL_BYTES = BLOCK_M * ROW_BYTES;  // Q_i and dO_i
    static constexpr int Q_TILE_BYTES = PANELS * Q_PANEL_BYTES;
    static constexpr int STAGE_BYTES = 2 * Q_TILE_BYTES;  // Q_i, then dO_i
    static constexpr int STAT_BYTES = BLOCK_M * 4;       // lse_log2 or D of the stage's rows
    // dS [BLOCK_M queries x BLOCK_N keys]: panels of 64 keys, the layout of a K-major A operand.
    static constexpr int DS_PANEL_BYTES = BLOCK_M * ROW_BYTES;
    static constexpr int DS_BYTES = (BLOCK_N / PANEL_COLS) * DS_PANEL_BYTES;
    // dQ_i of a step in fp32, as its BLOCK_M rows of dq_accum (DQ_BUFFERS of them).
    static constexpr int DQ_TILE_BYTES = BLOCK_M * HEAD_DIM * 4;
    // K | V | STAGES x (Q | dO) | 2 x dS | STAGES x (lse | D) | DQ_BUFFERS x dQ, + the slack to
    // align the base.
    static constexpr int SMEM_BYTES = 2 * KV_TILE_BYTES + STAGES * STAGE_BYTES + 2 * DS_BYTES +
                                      STAGES * 2 * STAT_BYTES + DQ_BUFFERS * DQ_TILE_BYTES +
                                      SMEM_ALIGN;

    static constexpr int DIM = HEAD_DIM;
    static constexpr int QUERIES = BLOCK_M;         // the N of S^T and dP^T
    static constexpr int S_TILES = BLOCK_M / 8;     // n8 column groups of S^T, dP^T (queries)
    // Head dims above 128: the key block's dK, dV and dQ columns are split over NUM_CHUNKS CTAs
    // (grid.x = key block x chunk, as flash_bwd.cu), each recomputing S^T and dP^T over the whole
    // head dim: chunk 0 has columns 0 .. 127, chunk 1 the rest (d=192: 64, d=256: 128). Both
    // start at a panel boundary, so every MN-major B descriptor of a chunk is one of d <= 128's.
    static constexpr int CHUNK_COLS = HEAD_DIM <= 128 ? HEAD_DIM : 128;
    static constexpr int NUM_CHUNKS = HEAD_DIM <= 128 ? 1 : 2;
    static constexpr int LAST_CHUNK_COLS = HEAD_DIM - CHUNK_COLS * (NUM_CHUNKS - 1);
    static constexpr bool HAS_NARROW = LAST_CHUNK_COLS < CHUNK_COLS;
    // Q_i / dO_i (B of dV, dK) and K (B of dQ) bytes from column 0 to a chunk's first column.
    static constexpr int CHUNK_Q_BYTES = (CHUNK_COLS / PANEL_COLS) * Q_PANEL_BYTES;
    static constexpr int CHUNK_KV_BYTES = (CHUNK_COLS / PANEL_COLS) * KV_PANEL_BYTES;
    static constexpr int D_TILES = CHUNK_COLS / 8;  // n8 column groups of dK, dV (widest chunk)
    static constexpr int QK_STEPS = HEAD_DIM / 16;  // k16 steps of S^T, dP^T (head dim)
    static constexpr int M_STEPS = BLOCK_M / 16;    // k16 steps of dV, dK (queries)
    static constexpr int N_STEPS = BLOCK_N / 16;    // k16 steps of dQ (keys)
    // dQ's head-dim columns of consumer 0 and 1. The start of consumer 1's columns is where the
    // MN-major B descriptor of K begins: at a panel boundary where there are two panels or more
    // (d=96: 64 + 32, d=128: 64 + 64), since N steps past the first 64 columns of a descriptor
    // go to the next panel by LBO, counted from the descriptor's start, not from the panel's;
    // d=64's single panel is split in the middle (32 + 32, a 64-byte start that never crosses
    // into the next panel).
    // Per chunk of COLS columns (the whole head dim up to d=128).
    __host__ __device__ static constexpr int dq_cols_0(int cols) {
        return cols <= PANEL_COLS ? cols / 2 : PANEL_COLS * (((cols + PANEL_COLS - 1) / PANEL_COLS) / 2);
    }
    // dQ_i = dS K has BLOCK_M query rows and a wgmma 64: a 64-row step splits dQ_i's columns
    // between the consumers (dq_cols_0 above), a 128-row step (d=64, FlashAttention-3's tile)
    // its rows, consumer c computing rows 64 c .. 64 c + 63 over every column.
    static constexpr int DQ_WGMMA_ROWS = 64;
    static constexpr bool DQ_BY_ROWS = BLOCK_M == 2 * DQ_WGMMA_ROWS;
    static constexpr int DQ_COLS_0 = DQ_BY_ROWS ? CHUNK_COLS : dq_cols_0(CHUNK_COLS);
    static constexpr int DQ_COL0_1 = DQ_BY_ROWS ? 0 : DQ_COLS_0;  // consumer 1's first column
    static constexpr int DQ_COLS_1 = DQ_BY_ROWS ? CHUNK_COLS : CHUNK_COLS - DQ_COLS_0;
    // Staged dQ tiles taken in turn by step (one buffer where two do not fit: 128-row steps).
    static constexpr int DQ_RING = DQ_BUFFERS > 0 ? DQ_BUFFERS : 1;
    // fp32 registers a consumer thread keeps live at the peak (dP^T just completed): dK and dV
    // (CHUNK_COLS / 2 each), S^T (or P^T) and dP^T (BLOCK_M / 2 each); the 16-bit P^T and dS^T
    // fragments grow as S^T and dP^T die (score_gradients). 192 at d=128 leaves 48 of the 240
    // for addresses, statistics, the score modifiers and the dQ tile (BLOCK_M x half the head
    // dim: HEAD_DIM / 4, live with dK, dV and the fragments). A peak with P^T packed beside
    // S^T and dP^T (208) made the softcap + ALiBi variant spill at d=128.
    static constexpr int PEAK_ACCUMULATORS = CHUNK_COLS + BLOCK_M;  // d=64 at 128 rows: 192 too

    static_assert(BLOCK_N == 2 * KEYS_PER_WARPGROUP, "two consumer warpgroups of 64 keys");
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 64 && HEAD_DIM <= 256, "head dim");
    static_assert(BLOCK_M % 16 == 0 && BLOCK_M >= 16 && BLOCK_M <= 256,
                  "wgmma N of S^T (= BLOCK_M): a multiple of 16 up to 256");
    static_assert(DQ_COLS_0 % 16 == 0 && DQ_COLS_1 % 16 == 0 && DQ_COLS_1 > 0 &&
                          dq_cols_0(LAST_CHUNK_COLS) % 16 == 0 &&
                          (LAST_CHUNK_COLS - dq_cols_0(LAST_CHUNK_COLS)) % 16 == 0,
                  "dQ column halves: whole 16-column groups (dq_accum.cuh's vector atomics)");
    static_assert(CHUNK_COLS % PANEL_COLS == 0 || NUM_CHUNKS == 1,
                  "every chunk starts at a panel boundary");
    static_assert(!HAS_NARROW || LAST_CHUNK_COLS == DQ_COLS_0,
                  "the narrower last chunk's dQ is consumer 0's columns");
    static_assert(Q_PANEL_BYTES % 1024 == 0 && KV_PANEL_BYTES % 1024 == 0, "whole swizzle atoms");
    static_assert(STAT_BYTES % 16 == 0, "bulk copies of whole 16-byte chunks");
    static_assert(BWD_ROW_PADDING % BLOCK_M == 0, "the per-row statistics cover whole Q blocks");
    static_assert(KEYS_PER_WARPGROUP * (LAST_CHUNK_COLS / 8) % WARPGROUP_THREADS == 0 &&
                      KEYS_PER_WARPGROUP * (CHUNK_COLS / 8) % WARPGROUP_THREADS == 0,
                  "the epilogue's 16-byte chunks split evenly over a warpgroup");
    static_assert(STAGES >= 1, "a ring of Q / dO stages (one at d=256: shared memory)");
    static_assert(PEAK_ACCUMULATORS <= 192,
                  "dK, dV, S^T, dP^T and P^T must fit the consumers' 240 registers: a chunk of "
                  "at most 128 head-dim columns at BLOCK_M = 64, 64 at BLOCK_M = 128 "
                  "(docs/HOPPER_BWD.md)");
    static_assert(BLOCK_M == DQ_WGMMA_ROWS || (DQ_BY_ROWS && NUM_CHUNKS == 1),
                  "a step of 64 query rows, or of 128 with dQ split by rows (one chunk)");
    static_assert(DQ_BUFFERS >= 0 && DQ_BUFFERS <= 2, "at most two staged dQ tiles");
    static_assert(split_fits(CONSUMER_THREADS), "the setmaxnreg split fits the register file");
    static_assert(SMEM_BYTES <= 227 * 1024, "one CTA per SM");
    static_assert(!DQ_STAGED || NUM_CHUNKS == 1, "staged dQ tiles hold whole rows of dq_accum");
    static_assert(DQ_TILE_BYTES % 16 == 0, "bulk reductions of whole 16-byte chunks");
};

// X^T = A_c B^T for one consumer (S^T = K_c Q_i^T or dP^T = V_c dO_i^T): M = its 64 keys, N =
// BLOCK_M queries, QK_STEPS k16 steps over the head dim; both operands K-major descriptors (the
// forward's Q and K of S = Q K^T). `a_rows`: this consumer's first key row of K or V (a whole
// number of swizzle atoms into each panel). Issues the wgmmas only.
template <typename Elem, class T>
CF2_DEVICE void issue_transposed_scores(float (&acc)[T::S_TILES][4], u32 a_rows, u32 b_tile) {
    issue_kmajor_ss<Elem, T::QUERIES, T::QK_STEPS, T::KV_PANEL_BYTES, T::Q_PANEL_BYTES>(
        acc, a_rows, b_tile);
}

// acc (64 keys x COLS head-dim columns) += frag (this warp's keys x BLOCK_M queries, A registers) times
// `b_tile` (Q_i or dO_i, [queries x head dim], the MN-major B operand as V of the forward's
// P V: 16 rows = 2048 B a k16 step, SBO 1024, LBO one panel). Issues the wgmmas only.
template <typename Elem, class T, int COLS>
CF2_DEVICE void issue_key_gradient(float (&acc)[COLS / 8][4], u32 (&frag)[T::M_STEPS][4],
                                   u32 b_tile) {
#pragma unroll
    for (int ks = 0; ks < T::M_STEPS; ++ks) {
        const u64 b = smem_matrix_descriptor(b_tile + 2048 * ks, T::Q_PANEL_BYTES, 1024);
        wgmma_rs_trans_b<Elem, COLS>(acc, frag[ks], b, 1);
    }
}

// dQ_i[rows, COL0 .. COL0 + N) = dS K[:, COL0 .. COL0 + N) for 64 query rows: N_STEPS k16
// steps over the keys; A = those rows of dS (`ds_rows`: their first row in the tile, a whole
// number of swizzle atoms into each panel; K-major: 32 B a step inside a 64-key panel), B = K
// (MN-major, 2048 B a step, LBO one K panel). Issues the wgmmas only.
template <typename Elem, class T, int COL0, int N>
CF2_DEVICE void issue_dq(float (&acc)[N / 8][4], u32 ds_rows, u32 k_tile) {
    const u32 b0 = k_tile + (COL0 / T::PANEL_COLS) * T::KV_PANEL_BYTES + 2 * (COL0 % T::PANEL_COLS);
#pragma unroll
    for (int kk = 0; kk < T::N_STEPS; ++kk) {
        const u64 a = smem_matrix_descriptor(ds_rows + (kk / 4) * T::DS_PANEL_BYTES + 32 * (kk % 4),
                                             16, 1024);
        const u64 b = smem_matrix_descriptor(b0 + 2048 * kk, T::KV_PANEL_BYTES, 1024);
        wgmma_ss_trans_b<Elem, N>(acc, a, b, kk > 0);
    }
}

// Adds this warp's share of dQ_i[rows, COL0 .. COL0 + N) to dq_accum: rows 16 warp + lane / 4
// (+ 8) from `dq_block` (the consumer's first dQ row), 16 columns per vector reduction in
// dq_accum.cuh's interleaved order (the wgmma accumulator is the m16n8 layout per warp, as in
// flash_bwd.cu's phase C).
template <int HEAD_DIM, int COL0, int N>
CF2_DEVICE void add_dq(float* dq_block, const float (&acc)[N / 8][4], int warp, int lane) {
    float* rows = dq_block + (16 * warp + lane / 4) * HEAD_DIM + COL0 + 4 * (lane % 4);
#pragma unroll
    for (int np = 0; np < N / 16; ++np)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            atomic_add_4(rows + 8 * half * HEAD_DIM + 16 * np, acc[2 * np][2 * half],
                         acc[2 * np][2 * half + 1], acc[2 * np + 1][2 * half],
                         acc[2 * np + 1][2 * half + 1]);
}

// Stores this warp's share of dQ_i[rows, COL0 .. COL0 + N) into the staged dQ tile at `dq_tile`
// (its BLOCK_M rows of HEAD_DIM floats are the block's rows of dq_accum; `dq_tile`: the
// consumer's first dQ row; add_dq's order and offsets),
// for the bulk reduction that adds the whole tile to dq_accum.
template <int HEAD_DIM, int COL0, int N>
CF2_DEVICE void stage_dq(u32 dq_tile, const float (&acc)[N / 8][4], int warp, int lane) {
    const u32 rows = dq_tile + 4 * ((16 * warp + lane / 4) * HEAD_DIM + COL0 + 4 * (lane % 4));
#pragma unroll
    for (int np = 0; np < N / 16; ++np)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            store_16B_shared(rows + 4 * (8 * half * HEAD_DIM + 16 * np), acc[2 * np][2 * half],
                             acc[2 * np][2 * half + 1], acc[2 * np + 1][2 * half],
                             acc[2 * np + 1][2 * half + 1]);
}

// This consumer's dQ_i columns to dq_accum: staged in `dq_tile` (DQ_STAGED; the bulk reduction
// is issued by the producer's dQ thread once every consumer thread arrived on `dq_full`, after
// `dq_empty` said the buffer's previous reduction had read it), or by vector reductions; with
// ORDERED vector reductions (deterministic mode above d=128) in the key block's turn: after
// `dq_empty` (the dQ thread's arrival once the turn came), then every consumer thread arrives on
// `dq_full` (release at CTA scope), after which the dQ thread passes the turn on.
template <class T, int COL0, int N, bool ORDERED>
CF2_DEVICE void write_dq(const float (&acc)[N / 8][4], float* dq_block, u32 dq_tile, u32 dq_full,
                         u32 dq_empty, u32 empty_parity, bool add, int warp, int lane) {
    if constexpr (T::DQ_STAGED) {
        mbarrier_wait(dq_empty, empty_parity);
        stage_dq<T::DIM, COL0, N>(dq_tile, acc, warp, lane);
        fence_proxy_async_shared();  // the generic stores, before the bulk reduction reads them
        mbarrier_arrive(dq_full);
    } else if constexpr (ORDERED) {
        mbarrier_wait(dq_empty, empty_parity);
        if (add) add_dq<T::DIM, COL0, N>(dq_block, acc, warp, lane);
        mbarrier_arrive(dq_full);
    } else if (add) {
        add_dq<T::DIM, COL0, N>(dq_block, acc, warp, lane);
    }
}

// Sets the invisible entries of a transposed score tile to -inf: s[nt][2 half + e] is key
// key0 + 8 half (this thread's row of S^T), query query0 + 8 nt + e (its column). masking.cuh's
// mask_scores with the roles of rows and columns swapped; one branch per launch on the window's
// edges, as there (the edges are uniform, the compiler cannot know it).
template <bool LEFT, bool RIGHT, int NT>
CF2_DEVICE void mask_transposed_edges(float (&s)[NT][4], int key0, int query0,
                                      const KeyVisibility& vis) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int query = query0 + 8 * nt + e;
            const int key_lo = LEFT ? query + vis.diag - vis.window_left : 0;
            const int key_hi = RIGHT ? min(vis.seqlen_k, query + vis.diag + vis.window_right + 1)
                                     : vis.seqlen_k;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int key = key0 + 8 * half;
                if (key < key_lo || key >= key_hi) s[nt][2 * half + e] = neg_inf();
            }
        }
}

template <int NT>
CF2_DEVICE void mask_transposed(float (&s)[NT][4], int key0, int query0, const KeyVisibility& vis) {
    if (vis.window_left < 0) {
        if (vis.window_right < 0)
            mask_transposed_edges<false, false>(s, key0, query0, vis);
        else
            mask_transposed_edges<false, true>(s, key0, query0, vis);
    } else {
        if (vis.window_right < 0)
            mask_transposed_edges<true, false>(s, key0, query0, vis);
        else
            mask_transposed_edges<true, true>(s, key0, query0, vis);
    }
}

// P = exp2((score + ALiBi bias) * scale_log2 - lse_log2[query]) for one entry of S^T; `score` is
// the raw score (or softcap's t). ALiBi's distance query + diag - key comes from one float a
// thread plus a constant (`query_minus_key`): the positions themselves are not held, registers
// being scarcest here.
template <int FEATURES>
CF2_DEVICE float probability(float score, float row_lse, const ScoreMods<FEATURES>& mods,
                             float scale_log2, float query_minus_key) {
    return fast_exp2(fmaf(mods.biased(score, query_minus_key, 0.f), scale_log2, -row_lse));
}

// S^T -> P^T in place (while dP^T is still being computed). acc[nt][2 half + e] is key
// key0 + 8 half, query query0 + 8 nt + e; `lse` points at lse_log2 of query0 in the stage, D follows QUERIES floats later.
// Without softcap only: with it, dS needs t as well as P, and P is formed in score_gradients.
template <class T, int FEATURES>
CF2_DEVICE void exponentiate(float (&acc)[T::S_TILES][4], const float* lse,
                             const ScoreMods<FEATURES>& mods, float scale_log2, float offset0) {
#pragma unroll
    for (int nt = 0; nt < T::S_TILES; ++nt) {
        const float2 row_lse = *reinterpret_cast<const float2*>(lse + 8 * nt);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            acc[nt][i] = probability(acc[nt][i], i % 2 ? row_lse.y : row_lse.x, mods, scale_log2,
                                     offset0 + static_cast<float>(8 * nt + i % 2 - 8 * (i / 2)));
    }
}

// P^T and dS^T = P^T o (dP^T - D[query]) (times 1 - t^2 with softcap), packed as the A operands
// of dV += P^T dO and dK += dS^T Q: k16 step ks = queries 16 ks .. + 15 = n8 tiles 2 ks, 2 ks + 1,
// a[0] / a[2] rows g, a[1] / a[3] rows g + 8 (the forward's exp_pack order). `s` holds P
// (exponentiate) or, with softcap, t (P is formed here: one pass in which S^T and dP^T die as
// the fragments grow, so the consumer's peak stays at dK + dV + S^T + dP^T).
template <typename Elem, class T, int FEATURES>
CF2_DEVICE void score_gradients(u32 (&p_frag)[T::M_STEPS][4], u32 (&ds_frag)[T::M_STEPS][4],
                                const float (&s)[T::S_TILES][4], const float (&dp)[T::S_TILES][4],
                                const float* lse, const ScoreMods<FEATURES>& mods,
                                float scale_log2, float offset0) {
    constexpr bool SOFTCAP = ScoreMods<FEATURES>::SOFTCAP;
#pragma unroll
    for (int nt = 0; nt < T::S_TILES; ++nt) {
        const float2 d = *reinterpret_cast<const float2*>(lse + T::QUERIES + 8 * nt);
        float2 row_lse = make_float2(0.f, 0.f);
        if constexpr (SOFTCAP) row_lse = *reinterpret_cast<const float2*>(lse + 8 * nt);
        float prob[4], ds[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            prob[i] = s[nt][i];
            float grad = dp[nt][i] - (i % 2 ? d.y : d.x);
            if constexpr (SOFTCAP) {
                prob[i] = probability(s[nt][i], i % 2 ? row_lse.y : row_lse.x, mods, scale_log2,
                                      offset0 + static_cast<float>(8 * nt + i % 2 - 8 * (i / 2)));
                grad *= mods.dtanh(s[nt][i]);
            }
            ds[i] = prob[i] * grad;
        }
        p_frag[nt / 2][2 * (nt % 2)] = pack_pair<Elem>(prob[0], prob[1]);
        p_frag[nt / 2][2 * (nt % 2) + 1] = pack_pair<Elem>(prob[2], prob[3]);
        ds_frag[nt / 2][2 * (nt % 2)] = pack_pair<Elem>(ds[0], ds[1]);
        ds_frag[nt / 2][2 * (nt % 2) + 1] = pack_pair<Elem>(ds[2], ds[3]);
    }
}

// Stores this warp's dS^T (16 keys x BLOCK_M queries, as A fragments) transposed into the dS
// tile [queries x keys]: per k16 step one stmatrix .trans of four 8 x 8 matrices, a[j] = keys
// 8 (j % 2) .. + 7 x queries 16 ks + 8 (j / 2) .. + 7. Lane 8 j + c gives the address of the
// 16-byte chunk of query 16 ks + 8 (j / 2) + c holding those 8 keys; its swizzled slot differs
// for the 8 lanes of a matrix (consecutive rows), so the stores are free of bank conflicts.
// `key_chunk0`: the 8-key chunk of this warp's first key in the tile (8 c + 2 warp).
template <class T>
CF2_DEVICE void store_ds_transposed(u32 ds_tile, const u32 (&ds_frag)[T::M_STEPS][4],
                                    int key_chunk0, int lane) {
    const int j = lane / 8, c = lane % 8;
#pragma unroll
    for (int ks = 0; ks < T::M_STEPS; ++ks)
        stmatrix_x4_trans(swizzled_chunk<T::DS_PANEL_BYTES>(ds_tile, 16 * ks + 8 * (j / 2) + c,
                                                                key_chunk0 + j % 2),
                          ds_frag[ks]);
}

// The mbarriers of the CTA, and the one word it keeps beside them (static shared memory).
template <int STAGES>
struct BwdSm90Barriers {
    u64 kv_full;               // K and V of the block landed
    u64 q_full[STAGES];        // Q_i and lse_log2 of its rows landed
    u64 do_full[STAGES];       // dO_i and D of its rows landed
    u64 stage_empty[STAGES];   // every consumer thread is done with the stage
    u64 dq_full[2];            // every consumer thread staged its dQ of the buffer (DQ_STAGED)
    u64 dq_empty[2];           // the buffer's bulk reduction has read it
    // The block's first key, which the consumers read each step (load_4B_shared_fresh) rather
    // than hold: it comes from the dispatch order's arithmetic (cta_work), which the compiler
    // cannot rematerialise as it did blockIdx.x * BLOCK_N, and held across their loop it spilled
    // (d=64 with ALiBi and dQ by vector reductions: 4 bytes).
    int key_first;
};

// The steps of a key block, one per (query head of its KV head's group, query block whose rows
// see its keys) pair, taken in the same order by the producer, the dQ thread and the consumers.
// By default head by head, each head's query blocks from the first up (the CTAs of one head then
// walk the same Q / dO blocks together and share them in L2). BLOCK_MAJOR (deterministic mode):
// query block by query block from the first up, every head of the group inside a block, so a
// key block takes the pair (head, m) at step (m - m_first) * heads + head. The ordered additions
// go from the highest key block down; a higher key block's m_first is no smaller, so it takes
// every pair at the same step or earlier and the next adder finds it done. (From the last query
// block down, where every range ends, all key blocks meet a pair at the same step, but causal key
// block n's rows start at block 2n (BLOCK_N = 2 BLOCK_M): the adders in ascending order then
// stand in a chain, key block n waiting about n reductions' latencies, a causal mask's
// short high key blocks idling on their SMs.)
template <bool BLOCK_MAJOR>
struct QueryBlockWalk {
    int head, m_block;  // the step's query head and query block
    int head_first, head_end, m_first, m_end;

    CF2_DEVICE QueryBlockWalk(int head0, int heads, int m_first_, int m_count)
        : head(head0), m_block(m_first_), head_first(head0), head_end(head0 + heads),
          m_first(m_first_), m_end(m_first_ + m_count) {}

    CF2_DEVICE void advance() {
        if constexpr (BLOCK_MAJOR) {
            if (++head == head_end) {
                head = head_first;
                ++m_block;
            }
        } else if (++m_block == m_end) {
            m_block = m_first;
            ++head;
        }
    }
};

// Which (key block x head-dim chunk, KV head, batch entry) a CTA of the grid (key blocks x
// chunks, KV heads, batch) takes, in the order the GPU dispatches the CTAs (x fastest).
// DETERMINISTIC: x reversed, each (KV head, batch) pair's last key block first, so that the ones
// a key block waits for (above) were dispatched before it. Otherwise key-block-major inside
// groups of `group_pairs` (KV head, batch) pairs: key block 0 of every pair of the group, then
// key block 1, and so on (group_pairs 1: pair by pair, the grid's own order). Under a causal
// mask the low key blocks are the long ones (they see the most query rows): grouped, each
// group's long CTAs start first and its short ones fill the tail, where pair by pair the last
// pair's key block 0 starts last and runs alone. The host chooses the groups
// (_hopper_bwd.dispatch_group_pairs).
struct CtaWork {
    int x, kv_head, batch;
};

template <bool DETERMINISTIC>
CF2_DEVICE CtaWork cta_work(int group_pairs) {
    if constexpr (DETERMINISTIC)
        return {static_cast<int>(gridDim.x - 1 - blockIdx.x), static_cast<int>(blockIdx.y),
                static_cast<int>(blockIdx.z)};
    group_pairs = max(group_pairs, 1);  // a struct filled without it (0): pair by pair
    const int xs = gridDim.x, pairs = gridDim.y * gridDim.z;
    const int cta = blockIdx.x + xs * (blockIdx.y + gridDim.y * blockIdx.z);
    const int first_pair = cta / (group_pairs * xs) * group_pairs;
    const int group_size = min(group_pairs, pairs - first_pair);  // the last group: the rest
    const int in_group = cta - first_pair * xs;
    const int pair = first_pair + in_group % group_size;
    return {in_group / group_size, pair % static_cast<int>(gridDim.y),
            pair / static_cast<int>(gridDim.y)};
}

// FEATURES: the score modifiers of score_mods.cuh (softcap, ALiBi), or 0; DQ_BUFFERS: dQ through
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
    const KeyVisibility vis{seqlen_k - seqlen_q, p.window_left, p.window_right, seqlen_k};
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
        const u32 zeros[4] = {0u, 0u, 0u, 0u};
        if constexpr (T::NUM_CHUNKS == 1) {
            for (int idx = threadIdx.x; idx < BLOCK_N * (HEAD_DIM / 8); idx += T::THREADS) {
                const int row = idx / (HEAD_DIM / 8), chunk = idx % (HEAD_DIM / 8);
                if (key_first + row < seqlen_k && chunk < head_chunks) {
                    store_16B_global(dk_block + row * p.dk_row_stride + chunk * 8, zeros);
                    store_16B_global(dv_block + row * p.dv_row_stride + chunk * 8, zeros);
                }
            }
        } else {
            // This CTA's columns (the other chunk's CTA writes the rest).
            constexpr int CHUNKS = T::CHUNK_COLS / 8;
            for (int idx = threadIdx.x; idx < BLOCK_N * CHUNKS; idx += T::THREADS) {
                const int row = idx / CHUNKS, c = col0 / 8 + idx % CHUNKS;
                if (key_first + row < seqlen_k && c < head_chunks) {
                    store_16B_global(dk_block + row * p.dk_row_stride + c * 8, zeros);
                    store_16B_global(dv_block + row * p.dv_row_stride + c * 8, zeros);
                }
            }
        }
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
            mbarrier_arrive_expect_tx(kv_full, 2 * T::KV_TILE_BYTES);
            tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(k_smem, params.k_map, kv_full,
                                                        seq_k.start + key_first, kv_head,
                                                        map_batch);
            tma_load_tile<T::PANELS, T::KV_PANEL_BYTES>(v_smem, params.v_map, kv_full,
                                                        seq_k.start + key_first, kv_head,
                                                        map_batch);
            QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head,
                                               p.heads_per_kv_head, m_first, m_count);
            for (int j = 0; j < steps; ++j) {
                const int stage = j % STAGES;
                mbarrier_wait(smem_address(&bars.stage_empty[stage]), ((j / STAGES) & 1) ^ 1);
                const int row0 = walk.m_block * BLOCK_M;
                // lse_log2 and D are padded to whole Q blocks (+inf / 0): never out of bounds.
                const i64 stat0 = stats_first(walk.head) + row0;
                const u32 q_tile = q_smem + stage * T::STAGE_BYTES;
                const u32 do_tile = q_tile + T::Q_TILE_BYTES;
                const u32 lse_s = stats_smem + stage * 2 * T::STAT_BYTES;
                const u32 q_full = smem_address(&bars.q_full[stage]);
                const u32 do_full = smem_address(&bars.do_full[stage]);
                mbarrier_arrive_expect_tx(q_full, T::Q_TILE_BYTES + T::STAT_BYTES);
                tma_load_tile<T::PANELS, T::Q_PANEL_BYTES>(q_tile, params.q_map, q_full,
                                                           seq_q.start + row0, walk.head,
                                                           map_batch);
                bulk_load(lse_s, p.lse_log2 + stat0, T::STAT_BYTES, q_full);
                mbarrier_arrive_expect_tx(do_full, T::Q_TILE_BYTES + T::STAT_BYTES);
                tma_load_tile<T::PANELS, T::Q_PANEL_BYTES>(do_tile, params.do_map, do_full,
                                                           seq_q.start + row0, walk.head,
                                                           map_batch);
                bulk_load(lse_s + T::STAT_BYTES, p.delta + stat0, T::STAT_BYTES, do_full);
                walk.advance();
            }
        } else if ((T::DQ_STAGED || DETERMINISTIC) && threadIdx.x == 32) {
            // The dQ thread. Staged dQ: adds each step's staged dQ tile to its rows of dq_accum
            // with one bulk reduction (element-wise atomic: other key blocks add to the same
            // rows), and frees the buffer once the reduction has read it. DETERMINISTIC: in
            // key-block order, the turn of the query block's adders taken from its semaphore
            // (staged: the bulk reduction; vector reductions, above d=128: the consumers', between
            // dq_empty and dq_full).
            QueryBlockWalk<DETERMINISTIC> walk(kv_head * p.heads_per_kv_head,
                                               p.heads_per_kv_head, m_first, m_count);
            for (int j = 0; j < steps; ++j) {
                const int buf = j % T::DQ_RING;
                const u32 parity = (j / T::DQ_RING) & 1;
                // Staged: the tile's wait first; the rows' address, worked out after it, is not
                // held across it (held there, it spilled from the producer's 24 registers).
                if constexpr (T::DQ_STAGED)
                    mbarrier_wait(smem_address(&bars.dq_full[buf]), parity);
                const i64 row0 = stats_first(walk.head) + walk.m_block * BLOCK_M;
                int* semaphore =
                    DETERMINISTIC ? p.dq_semaphore + row0 / DQ_SEMAPHORE_ROWS + chunk : nullptr;
                int turn = 0;
                if constexpr (DETERMINISTIC) {
                    // The key blocks that see the query block's rows are a contiguous range
                    // ending at last_adder (a window's edges both grow with the key block);
                    // they add from the last down, so this one's turn is last_adder - kv_block.
                    const int m_row0 = walk.m_block * BLOCK_M;
                    int first_adder, adders_end;
                    vis.tile_range(m_row0, min(m_row0 + BLOCK_M, seqlen_q) - 1, BLOCK_N,
                                   first_adder, adders_end);
                    turn = adders_end - 1 - kv_block;
                }
                if constexpr (T::DQ_STAGED) {
                    if constexpr (DETERMINISTIC) {
                        wait_semaphore(semaphore, turn);
                        fence_proxy_async_global();
                    }
                    bulk_reduce_add_f32(p.dq_accum + row0 * HEAD_DIM,
                                        dq_smem + buf * T::DQ_TILE_BYTES, T::DQ_TILE_BYTES);
                    bulk_commit_group();
                    // The buffer is free once the reduction has read it; DETERMINISTIC: the next
                    // key block's turn once its additions are done, which the consumers need
                    // not wait for.
                    bulk_wait_group_read<0>();
                    mbarrier_arrive(smem_address(&bars.dq_empty[buf]));
                    if constexpr (DETERMINISTIC) {
                        bulk_wait_group<0>();
                        fence_proxy_async_global();
                        increment_release_gpu(semaphore);
                    }
                } else {
                    // The consumers' vector reductions, ordered: the turn (acquire) is handed to
                    // them through dq_empty, and passed on (release) once every consumer thread
                    // arrived on dq_full after its reductions: the mbarrier's release and
                    // acquire at CTA scope put those before this thread's release at GPU scope.
                    wait_semaphore(semaphore, turn);
                    mbarrier_arrive(smem_address(&bars.dq_empty[buf]));
                    mbarrier_wait(smem_address(&bars.dq_full[buf]), parity);
                    increment_release_gpu(semaphore);
                }
                walk.advance();
            }
            if constexpr (T::DQ_STAGED)
                bulk_wait_group<0>();  // the reductions complete before the shared memory goes
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
            ScoreMods<FEATURES> mods(p.mods, seqlen_q, seqlen_k);
            mods.select_head(p.mods, batch, walk.head);
            mods.apply_softcap(acc_s);
            const int row_last = min(row0 + BLOCK_M, seqlen_q) - 1;
            const bool needs_mask =
                key_first_now + BLOCK_N > seqlen_k ||
                (p.window_right >= 0 &&
                 min(key_first_now + BLOCK_N, seqlen_k) - 1 > row0 + vis.diag + p.window_right) ||
                (p.window_left >= 0 && key_first_now < row_last + vis.diag - p.window_left);
            if (needs_mask) mask_transposed(acc_s[0], thread_key0, thread_query0, vis);
            if constexpr (!ScoreMods<FEATURES>::SOFTCAP)
                exponentiate<T>(acc_s[0], lse, mods, p.scale_log2, offset0);
            wgmma_wait_group<0>();
            pin_registers(acc_dp);

            // P^T and dS^T into registers (A operands of dV, dK), dS^T transposed into the dS
            // tile (A operand of dQ).
            score_gradients<Elem, T>(p_frag, ds_frag, acc_s[0], acc_dp, lse, mods, p.scale_log2,
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
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = key0 + 16 * warp + 8 * half + lane / 4;  // in the block
#pragma unroll
            for (int dt = 0; dt < T::D_TILES; ++dt) {
                const u32 offset =
                    swizzled_chunk<T::KV_PANEL_BYTES>(0, row, dt) + 4 * (lane % 4);
                store_4B_shared(k_smem + offset,
                                pack_pair<Elem>(acc_dk[dt][2 * half] * p.softmax_scale,
                                                acc_dk[dt][2 * half + 1] * p.softmax_scale));
                store_4B_shared(v_smem + offset,
                                pack_pair<Elem>(acc_dv[dt][2 * half], acc_dv[dt][2 * half + 1]));
            }
        }
        named_barrier_sync(T::STORE_BARRIER + consumer, T::WARPGROUP_THREADS);
        const int tid = threadIdx.x % T::WARPGROUP_THREADS;
        constexpr int CHUNKS = T::CHUNK_COLS / 8;  // 16-byte chunks of this CTA's row (widest)
#pragma unroll
        for (int i = 0; i < T::KEYS_PER_WARPGROUP * CHUNKS / T::WARPGROUP_THREADS; ++i) {
            const int idx = tid + T::WARPGROUP_THREADS * i;
            const int row = key0 + idx / CHUNKS;
            const int chunk = idx % CHUNKS;
            if (key_first + row < seqlen_k && chunk < head_chunks - col0 / 8) {
                u32 vals[4];
                load_16B_shared(vals, swizzled_chunk<T::KV_PANEL_BYTES>(k_smem, row, chunk));
                store_16B_global(dk_block + row * p.dk_row_stride + col0 + chunk * 8, vals);
                load_16B_shared(vals, swizzled_chunk<T::KV_PANEL_BYTES>(v_smem, row, chunk));
                store_16B_global(dv_block + row * p.dv_row_stride + col0 + chunk * 8, vals);
            }
        }
    }
}
