// The Hopper backward's compile-time shape (flash_bwd_sm90.cu): BwdSm90Traits, the tile sizes,
// the shared-memory layout, the register budget and the named barriers that every part of the
// kernel (sm90/bwd_*.cuh) reads from one `T`. Python builds its name expressions and probes from
// the template parameters (cuflash2/_configs.py, BwdSm90Config), which therefore stay as they are.
#pragma once
#include "hopper_primitives.cuh"
#include "constants.cuh"

// BIAS (FEATURE_BIAS_TILE): each stage of the ring holds the bias's BLOCK_M x BLOCK_N block of
// its step after dO_i (sm90/bias_tile.cuh), in the dS tile's layout.
// HEAD_DIM is Q's and K's head dim, HEAD_DIM_V V's and dO's (DeepSeek's 192 / 128): S^T, dK and
// dQ take HEAD_DIM; dP^T = V dO^T and dV HEAD_DIM_V, whose columns lie in the first chunk.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int STAGES,
          int DQ_TILES, bool BIAS = false>
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
    // V and dO_i: V_PANELS panels of HEAD_DIM_V (PANELS but for V's own head dim).
    static constexpr bool SAME_DIMS = HEAD_DIM_V == HEAD_DIM;
    static constexpr int V_PANELS = (HEAD_DIM_V + PANEL_COLS - 1) / PANEL_COLS;
    static constexpr int V_TILE_BYTES = V_PANELS * KV_PANEL_BYTES;
    static constexpr int DO_TILE_BYTES = V_PANELS * Q_PANEL_BYTES;
    static constexpr int STAT_BYTES = BLOCK_M * 4;       // lse_log2 or D of the stage's rows
    // dS [BLOCK_M queries x BLOCK_N keys]: panels of 64 keys, the layout of a K-major A operand.
    static constexpr int DS_PANEL_BYTES = BLOCK_M * ROW_BYTES;
    static constexpr int BLOCK_N_PANELS = BLOCK_N / PANEL_COLS;  // of the dS and bias tiles
    static constexpr int DS_BYTES = BLOCK_N_PANELS * DS_PANEL_BYTES;
    static constexpr int BIAS_TILE_BYTES = BIAS ? DS_BYTES : 0;
    static constexpr int BIAS_OFFSET = Q_TILE_BYTES + DO_TILE_BYTES;  // in a stage
    static constexpr int STAGE_BYTES = BIAS_OFFSET + BIAS_TILE_BYTES;  // Q_i, dO_i, bias
    // dQ_i of a step in fp32, as its BLOCK_M rows of dq_accum (DQ_BUFFERS of them).
    static constexpr int DQ_TILE_BYTES = BLOCK_M * HEAD_DIM * 4;
    // K | V | STAGES x (Q | dO | bias) | 2 x dS | STAGES x (lse | D) | DQ_BUFFERS x dQ, + the
    // slack to align the base.
    static constexpr int SMEM_BYTES = KV_TILE_BYTES + V_TILE_BYTES + STAGES * STAGE_BYTES +
                                      2 * DS_BYTES +
                                      STAGES * 2 * STAT_BYTES + DQ_BUFFERS * DQ_TILE_BYTES +
                                      SMEM_ALIGN;

    static constexpr int DIM = HEAD_DIM;
    static constexpr int DIM_V = HEAD_DIM_V;
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
    static constexpr int QK_STEPS = HEAD_DIM / 16;  // k16 steps of S^T (head dim)
    static constexpr int V_STEPS = HEAD_DIM_V / 16;  // k16 steps of dP^T (V's head dim)
    // dV's columns: V's head dim, in the first chunk (a second chunk's CTAs recompute them from
    // dO_i's first columns and store none: DV_COL0).
    static constexpr int DV_COLS = SAME_DIMS ? CHUNK_COLS : HEAD_DIM_V;
    static constexpr int DV_TILES = DV_COLS / 8;  // n8 column groups of dV
    // dO_i's bytes from column 0 to chunk `chunk`'s dV columns.
    __host__ __device__ static constexpr int dv_chunk_bytes(int chunk) {
        return SAME_DIMS ? chunk * CHUNK_Q_BYTES : 0;
    }
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
    static_assert(SAME_DIMS || (HEAD_DIM_V % 16 == 0 && HEAD_DIM_V >= 16 &&
                                HEAD_DIM_V <= CHUNK_COLS && HEAD_DIM_V < HEAD_DIM),
                  "V's own head dim: smaller than Q's, within the first chunk");
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
