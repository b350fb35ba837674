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
