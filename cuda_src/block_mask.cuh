// Block masks (cuflash2.block_mask, cuflash2/block_mask.py): a mask modifier evaluated once into
// one state a tile of the kernel's own BLOCK_M x BLOCK_N tiles (block_mask.cu), which the
// forward with FEATURE_BLOCK_MASK reads at the variant's first point (which keys a query row
// sees, variant.cuh): of the tiles the visibility gives it visits only those that are not
// BLOCK_MASK_EMPTY, runs the user's mask on BLOCK_MASK_PARTIAL ones and on BLOCK_MASK_FULL ones
// only the built-in mask (causal, window, the sequence's end) where the tile needs it.
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// One CTA's row of states: those of its (batch entry, query head, m block), by n block.
template <bool ON>
struct BlockMaskRow {
    const signed char* states;

    CF2_DEVICE BlockMaskRow(const BlockMaskStates& p, int batch, int head, int m_block)
        : states(p.states + batch * p.batch_stride + head * p.head_stride +
                 m_block * p.row_stride) {}

    // The highest tile of [lo, hi) that is not empty, its state in `state`; lo - 1 (state
    // BLOCK_MASK_EMPTY) where there is none. Each warp reads 32 states a step and votes; every
    // warp gets the same answer (the lanes of a warp must all call it).
    CF2_DEVICE int prev_visited(int lo, int hi, int& state) const {
        const int lane = threadIdx.x % 32;
        for (int top = hi; top > lo; top -= 32) {
            const int t = top - 1 - lane;
            const int s = t >= lo ? static_cast<int>(states[t]) : BLOCK_MASK_EMPTY;
            const unsigned visited = __ballot_sync(0xffffffffu, s != BLOCK_MASK_EMPTY);
            if (visited != 0u) {
                const int first = __ffs(visited) - 1;  // the lowest lane: the highest tile
                state = __shfl_sync(0xffffffffu, s, first);
                return top - 1 - first;
            }
        }
        state = BLOCK_MASK_EMPTY;
        return lo - 1;
    }
};

// Without a block mask: nothing (every tile of the range is visited, the state unused).
template <>
struct BlockMaskRow<false> {};

// The row of a kernel's parameters `p` (with a `blocks` member, BlockMaskStates, where ON).
template <bool ON, class Params>
CF2_DEVICE BlockMaskRow<ON> block_mask_row(const Params& p, int batch, int head, int m_block) {
    if constexpr (ON) {
        return BlockMaskRow<true>(p.blocks, batch, head, m_block);
    } else {
        return {};
    }
}

// The backward's view (flash_bwd_body.inc, FEATURE_BLOCK_MASK): a key block's column of states
// for one query head, walked up by query block. The states' tiles may be coarser than the
// backward's own (the forward's, which cuflash2.block_mask builds): a state covers `m_div` of
// the backward's query blocks and `n_div` of its key blocks (BwdModsParams' block_m_div /
// block_n_div), and an empty / full coarse tile is empty / full in every part of it.
struct BlockMaskColumn {
    const signed char* states;
    i64 row_stride;
    int m_div;

    CF2_DEVICE BlockMaskColumn(const BlockMaskStates& p, int batch, int head, int n_block,
                               int m_div_, int n_div)
        : states(p.states + batch * p.batch_stride + head * p.head_stride + n_block / n_div),
          row_stride(p.row_stride), m_div(m_div_) {}

    // The lowest query block of [lo, hi) whose state is not empty, its state in `state`; hi
    // (state BLOCK_MASK_EMPTY) where there is none. A warp reads 32 states a step and votes;
    // every lane gets the same answer (the lanes of a warp must all call it).
    CF2_DEVICE int next_visited(int lo, int hi, int& state) const {
        const int lane = threadIdx.x % 32;
        for (int base = lo; base < hi; base += 32) {
            const int m = base + lane;
            const int s = m < hi ? static_cast<int>(states[(m / m_div) * row_stride])
                                 : BLOCK_MASK_EMPTY;
            const unsigned visited = __ballot_sync(0xffffffffu, s != BLOCK_MASK_EMPTY);
            if (visited != 0u) {
                const int first = __ffs(visited) - 1;  // the lowest lane: the lowest block
                state = __shfl_sync(0xffffffffu, s, first);
                return base + first;
            }
        }
        state = BLOCK_MASK_EMPTY;
        return hi;
    }
};

// The kernels without FEATURE_BLOCK_MASK hold this in place of BwdModsParams' states.
struct NoBlockMask {};

// The backward's walk over a key block's (query head, query block) steps with a block mask:
// the first step at or after (head, m_block) whose state is not empty, query blocks up within a
// head, then the next head up to head_end (head = head_end where none is left); returns its
// state. The NoBlockMask overloads stand in for the kernels without one (never called there).
template <class Params>
CF2_DEVICE int seek_visited(const Params& b, int batch, int n_block, int& head, int& m_block,
                            int head_end, int m_first, int m_end) {
    int state = BLOCK_MASK_EMPTY;
    while (head < head_end) {
        const BlockMaskColumn column(b.blocks, batch, head, n_block, b.block_m_div, b.block_n_div);
        m_block = column.next_visited(m_block, m_end, state);
        if (m_block < m_end) return state;
        ++head;
        m_block = m_first;
    }
    return state;
}
CF2_DEVICE int seek_visited(const NoBlockMask&, int, int, int&, int&, int, int, int) {
    return BLOCK_MASK_FULL;
}

// How many of those steps are not empty (all lanes of a warp call it, as seek_visited).
template <class Params>
CF2_DEVICE int visited_steps(const Params& b, int batch, int n_block, int head0, int head_end,
                             int m_first, int m_end) {
    const int lane = threadIdx.x % 32;
    int count = 0;
    for (int head = head0; head < head_end; ++head) {
        const BlockMaskColumn column(b.blocks, batch, head, n_block, b.block_m_div, b.block_n_div);
        for (int base = m_first; base < m_end; base += 32) {
            const int m = base + lane;
            const bool visited =
                m < m_end && column.states[(m / column.m_div) * column.row_stride] !=
                                 BLOCK_MASK_EMPTY;
            count += __popc(__ballot_sync(0xffffffffu, visited));
        }
    }
    return count;
}
CF2_DEVICE int visited_steps(const NoBlockMask&, int, int, int, int, int, int) {
    return 0;
}

// The Hopper forward's use (flash_fwd_sm90.cu with FEATURE_BLOCK_MASK), from the ranges of the
// states' rows (BlockMaskRanges, made with the states by block_mask.cu): a work tile's KV tile
// range [tile_first, tile_end), which the built-in masks give, narrowed to its first and its
// last tile that is not empty, and the run of its tiles that are full, on which the user's mask
// does not run. A Hopper tile spans m_div x n_div of the states' tiles (the forward's 64 x 64
// ones): it is visited where any of them is not empty, full where all of them lie in their
// row's longest run of full tiles. Producer and consumers both walk the narrowed range, so they
// need no exchange; the empty tiles inside it (none for a document, window, causal or prefix
// mask) are computed and masked by the user's mask. m_div 16-byte loads a work tile, every
// thread that calls it reading the same ones.
struct BlockMaskNarrow {
    // The work tiles of the last m blocks first, as under a key limit: the rows of a causal,
    // prefix or document mask see more keys the later they come, and the longest tiles first
    // leave the short ones to fill the grid's tail (the host schedules these calls as causal
    // ones, _dispatch.scheduling_window).
    static constexpr bool LATE_ROWS_FIRST = true;
    const BlockMaskRanges& p;
    int m_div;
    int n_div;
    int num_m_blocks;  // the states' rows (rows past them: the sequence's end)

    // In Hopper tiles: [first, end) visited, [full_first, full_end) full (empty where
    // full_end <= full_first) for the work tile of query block m_block of (batch, head).
    CF2_DEVICE void ranges(int batch, int head, int m_block, int& first, int& end,
                           int& full_first, int& full_end) const {
        const int m0 = m_block * m_div;
        const int m_count = min(m_div, num_m_blocks - m0);
        const int4* rows = p.rows + batch * p.batch_stride + head * p.head_stride + m0;
        int lo = 0x7fffffff, hi = 0, full_lo = 0, full_hi = 0x7fffffff;
        for (int r = 0; r < m_count; ++r) {
            const int4 row = rows[r];
            if (row.x < row.y) {
                lo = min(lo, row.x);
                hi = max(hi, row.y);
            }
            full_lo = max(full_lo, row.z);
            full_hi = min(full_hi, row.w);
        }
        first = hi > 0 ? lo / n_div : 0;
        end = (hi + n_div - 1) / n_div;
        // Whole Hopper tiles inside the states' run (a partial last one stays masked).
        full_first = (full_lo + n_div - 1) / n_div;
        full_end = full_hi / n_div;
    }

    // The range of that work tile, in place.
    CF2_DEVICE void operator()(int batch, int head, int m_block, int& tile_first,
                               int& tile_end) const {
        int first, end, full_first, full_end;
        ranges(batch, head, m_block, first, end, full_first, full_end);
        const int lo = max(tile_first, first), hi = min(tile_end, end);
        // A work tile the built-in masks leave keys keeps one tile where the block mask leaves
        // it none (the user's mask then empties its rows): every such work tile loads its Q, as
        // the dynamic claims need (sm90/fwd_tile_scheduler.cuh, WorkTileClaims).
        if (hi > lo) {
            tile_first = lo;
            tile_end = hi;
        } else {
            tile_end = min(tile_end, tile_first + 1);
        }
    }

    // The full tiles of that work tile: [full_first, full_end).
    CF2_DEVICE void full_range(int batch, int head, int m_block, int& full_first,
                               int& full_end) const {
        int first, end;
        ranges(batch, head, m_block, first, end, full_first, full_end);
    }
};

// The Hopper backward's use (flash_bwd_sm90.cu with FEATURE_BLOCK_MASK), from the summaries of
// the states' columns (BlockMaskColumns, made with the states by block_mask.cu): a key block's
// query blocks [m_first, m_first + m_count), which the built-in masks give, narrowed to those
// whose rows a visited state of the block's columns holds (in any query head of its KV head's
// group), and the query blocks whose states are all full there (in every one of those heads),
// on which the user's mask does not run: [full_first, full_end). The states' tiles need not
// divide the kernel's: rows and keys are converted through positions. Producer, dQ thread and
// consumers all take the narrowed range from the kernel's prologue; the empty query blocks
// inside it (none for a document, window, causal or prefix mask) are computed and masked by
// the user's mask. heads x (key block's columns) 32-byte reads a CTA, once.
struct BlockMaskColumnRange {
    const BlockMaskColumns& c;
    int state_block_m;  // the states' tile
    int state_block_n;
    int num_n_blocks;   // the states' columns

    CF2_DEVICE void operator()(int batch, int head0, int heads, int key_first, int block_n,
                               int block_m, int seqlen_q, int& m_first, int& m_count,
                               int& full_first, int& full_end) const {
        const int col_first = key_first / state_block_n;
        const int col_end = min((key_first + block_n + state_block_n - 1) / state_block_n,
                                num_n_blocks);
        int lo = 0x7fffffff, hi = 0, full_lo = 0, full_hi = 0x7fffffff;  // in state rows
        for (int head = head0; head < head0 + heads; ++head)
            for (int col = col_first; col < col_end; ++col) {
                const int* column = c.columns + (batch * c.batch_stride +
                                                 head * c.head_stride + col) * 8;
                const int4 rows = *reinterpret_cast<const int4*>(column);
                const bool run = column[4] > 0 && column[4] == rows.w - rows.z;
                lo = min(lo, rows.x);
                hi = max(hi, rows.y);
                full_lo = max(full_lo, run ? rows.z : 0x7fffffff);
                full_hi = min(full_hi, run ? rows.w : 0);
            }
        const int blocks = (seqlen_q + block_m - 1) / block_m;
        int first = 0, end = 0;
        if (hi > 0) {
            first = lo * state_block_m / block_m;
            end = (min(hi * state_block_m, seqlen_q) + block_m - 1) / block_m;
        }
        const int lo_block = max(m_first, first), hi_block = min(m_first + m_count, end);
        m_first = lo_block;
        m_count = max(0, hi_block - lo_block);
        full_first = full_end = 0;
        if (full_hi > full_lo) {
            // Whole query blocks inside the full rows; the last block's rows past the sequence
            // count as full (their P is 0 whatever the mask).
            const int row_hi = min(full_hi * state_block_m, seqlen_q);
            full_first = (full_lo * state_block_m + block_m - 1) / block_m;
            full_end = row_hi == seqlen_q ? blocks : row_hi / block_m;
        }
    }
};

// Without a block mask: the query blocks as they are, none known full.
struct NoColumnRange {
    CF2_DEVICE void operator()(int, int, int, int, int, int, int, int&, int&, int& full_first,
                               int& full_end) const {
        full_first = full_end = 0;
    }
};

// Without a block mask: the range as it is.
struct NoNarrow {
    static constexpr bool LATE_ROWS_FIRST = false;
    CF2_DEVICE void operator()(int, int, int, int&, int&) const {}
    CF2_DEVICE void full_range(int, int, int, int& full_first, int& full_end) const {
        full_first = full_end = 0;
    }
};
