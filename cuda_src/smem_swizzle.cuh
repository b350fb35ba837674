// XOR-swizzled shared-memory tiles of 16-bit elements.
//
// A ROWS x COLS tile is stored as column panels PANEL_COLS wide (64 elements = 128 bytes when
// COLS allows it, else 32; every head dim the kernels are built for is a multiple of 32). Inside a
// panel, row r is a run of 16-byte chunks, and chunk c of row r sits at position c ^ key(r).
// ldmatrix reads one chunk column of 8 consecutive rows for each 8x8 matrix: without the XOR all
// 8 reads would hit the same four banks (8-way conflict); with it they cover all 32 banks. The
// cp.async writes (8 lanes filling one 128-byte row) stay conflict-free as well.
#pragma once
#include "mma_primitives.cuh"

template <int ROWS_, int COLS_>
struct SwizzledTile {
    static constexpr int ROWS = ROWS_;
    static constexpr int COLS = COLS_;
    static_assert(COLS % 32 == 0, "tile width must be a multiple of 32 elements");
    static_assert(ROWS % 16 == 0, "tile height must be a multiple of 16 rows");
    static constexpr int CHUNKS = COLS / 8;  // 16-byte chunks per row
    static constexpr int CHUNK_ELEMS = 8;
    static constexpr int PANEL_COLS = (COLS % 64 == 0) ? 64 : 32;
    static constexpr int PANEL_CHUNKS = PANEL_COLS / 8;
    static constexpr int ROW_BYTES = PANEL_COLS * 2;
    static constexpr int PANEL_BYTES = ROWS * ROW_BYTES;
    static constexpr int BYTES = ROWS * COLS * 2;

    // The key depends on row % 8 only, so it is the same for a lane at every row block of 8.
    CF2_DEVICE static int swizzle_key(int row) {
        return PANEL_COLS == 64 ? (row & 7) : ((row >> 1) & 3);
    }

    // Byte offset of chunk `chunk` (elements 8*chunk .. 8*chunk+7) of row `row`.
    CF2_DEVICE static u32 offset(int row, int chunk) {
        return (chunk / PANEL_CHUNKS) * PANEL_BYTES + row * ROW_BYTES +
               (((chunk % PANEL_CHUNKS) ^ swizzle_key(row)) << 4);
    }
};

// The per-lane part of ldmatrix addresses into a SwizzledTile. For an x4 load each lane names one
// row of one 8x8 matrix: its row is `lane_row` plus a multiple of 8 known at compile time, and its
// chunk is 2*chunk_pair + `lane_chunk_bit`. Everything lane-dependent is folded into two registers
// here, so the address of each fragment in the unrolled loops is one XOR and one add.
template <class Tile>
struct LdmatrixCursor {
    u32 row_base;   // tile base + lane_row * ROW_BYTES
    u32 chunk_xor;  // (lane_chunk_bit ^ key(lane_row)) << 4

    CF2_DEVICE LdmatrixCursor(u32 tile_base, int lane_row, int lane_chunk_bit)
        : row_base(tile_base + lane_row * Tile::ROW_BYTES),
          chunk_xor(static_cast<u32>(lane_chunk_bit ^ Tile::swizzle_key(lane_row)) << 4) {}

    // Matrix rows start at 8 * row_block8 (+ lane_row); chunks 2*chunk_pair and 2*chunk_pair+1.
    CF2_DEVICE u32 at(int row_block8, int chunk_pair) const {
        const int chunk0 = 2 * chunk_pair;
        return row_base + (chunk0 / Tile::PANEL_CHUNKS) * Tile::PANEL_BYTES +
               row_block8 * 8 * Tile::ROW_BYTES +
               ((static_cast<u32>(chunk0 % Tile::PANEL_CHUNKS) << 4) ^ chunk_xor);
    }
};

// Asynchronously copies rows [0, rows_valid) and chunks [0, chunks_valid) of a tile from global
// memory (16-byte cp.async, rows `row_stride` elements apart) into a swizzled shared tile; every
// other chunk is zero-filled without being read. Consecutive threads take consecutive chunks of a
// row, so each warp reads whole rows: coalesced 16-byte loads.
template <class Tile, int THREADS>
CF2_DEVICE void load_tile_async(u32 tile_smem, const u16* gmem, i64 row_stride, int rows_valid,
                                int chunks_valid, int tid) {
    constexpr int TOTAL = Tile::ROWS * Tile::CHUNKS;
    // Fast path when every pass covers whole rows, a multiple of 8 of them (so row % 8, the
    // swizzle key, is the same for a thread on every pass).
    if constexpr (THREADS % Tile::CHUNKS == 0 && TOTAL % THREADS == 0 &&
                  (THREADS / Tile::CHUNKS) % 8 == 0) {
        // Each thread keeps one chunk column and steps down the rows: one pointer bump per copy.
        constexpr int ROWS_PER_PASS = THREADS / Tile::CHUNKS;
        const int chunk = tid % Tile::CHUNKS;
        int row = tid / Tile::CHUNKS;
        const bool chunk_valid = chunk < chunks_valid;
        const u16* src = gmem + row * row_stride + chunk * 8;
        const i64 pass_stride = ROWS_PER_PASS * row_stride;
        const u32 dst = tile_smem + Tile::offset(row, chunk);
#pragma unroll
        for (int i = 0; i < TOTAL / THREADS; ++i, row += ROWS_PER_PASS, src += pass_stride) {
            const bool valid = chunk_valid && row < rows_valid;
            // row % 8 is the same on every pass, so the swizzled offset moves by whole rows.
            cp_async_16(dst + i * ROWS_PER_PASS * Tile::ROW_BYTES, valid ? src : gmem, valid);
        }
    } else {
#pragma unroll
        for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
            const int idx = tid + i * THREADS;
            if (TOTAL % THREADS == 0 || idx < TOTAL) {
                const int row = idx / Tile::CHUNKS;
                const int chunk = idx % Tile::CHUNKS;
                const bool valid = row < rows_valid && chunk < chunks_valid;
                const u16* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
                cp_async_16(tile_smem + Tile::offset(row, chunk), src, valid);
            }
        }
    }
}
