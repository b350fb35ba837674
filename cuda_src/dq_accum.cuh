// Layout of the backward's fp32 dQ accumulator: (batch, nheads, seqlen_q_padded, accum_dim), rows
// as the per-row statistics (varlen.cuh, stats_row0), with the columns of every group of 16
// interleaved so that each thread's share of an mma accumulator pair is contiguous. The
// preprocess kernel zeroes the rows the main kernel adds to.
//
// For two adjacent n8 tiles (columns 16g .. 16g+15), lane t of a quad holds columns 2t, 2t+1 of
// the first tile and 2t, 2t+1 of the second (8 + 2t, 9 + 2t). Stored at positions 4t .. 4t+3 of
// the group, they become one 16-byte `red.global.add.v4.f32` (sm_90) instead of two 8-byte or four
// 4-byte atomics: the atomics are a measured ~12% of the backward's time.
#pragma once
#include "mma_primitives.cuh"

// Position inside the accumulator row of dQ column `col`.
CF2_DEVICE int dq_accum_position(int col) {
    return (col & ~15) + 4 * ((col & 7) >> 1) + 2 * ((col >> 3) & 1) + (col & 1);
}
