// Variable-length batches (flash-attn's varlen interface), compiled in with FEATURE_VARLEN.
//
// Sequence b of a packed (total_tokens, nheads, headdim) array is rows cu_seqlens[b] ..
// cu_seqlens[b + 1] - 1. The kernels are launched with a zero batch stride, one grid z index per
// sequence, and add the sequence's first row to their row offsets; CTAs past the end of their
// sequence exit at once, so no padding token is computed. Offsets are clamped to the packed
// lengths: malformed cu_seqlens cannot make a kernel read or write out of bounds (the API checks
// them before launching anyway).
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"

struct SequenceRows {
    int start;   // first row of the sequence in the packed array (0 for dense batches)
    int length;  // its length (the dense seqlen for dense batches)
};

template <bool VARLEN>
CF2_DEVICE SequenceRows sequence_rows(const int* cu_seqlens, int batch, int dense_length,
                                      int total) {
    if constexpr (VARLEN) {
        const int start = min(max(cu_seqlens[batch], 0), total);
        const int end = min(max(cu_seqlens[batch + 1], start), total);
        return {start, end - start};
    }
    return {0, dense_length};
}

// Batch entry `batch`'s query rows and key rows, for any kernel parameter struct with seqlen_q,
// seqlen_k and `varlen` (one place that pairs each side's cu_seqlens with its own lengths).
template <bool VARLEN, class Params>
CF2_DEVICE SequenceRows query_rows(const Params& p, int batch) {
    return sequence_rows<VARLEN>(p.varlen.cu_seqlens_q, batch, p.seqlen_q, p.varlen.total_q);
}

template <bool VARLEN, class Params>
CF2_DEVICE SequenceRows key_rows(const Params& p, int batch) {
    return sequence_rows<VARLEN>(p.varlen.cu_seqlens_k, batch, p.seqlen_k, p.varlen.total_k);
}

// First row of (batch, head) in the backward's per-row arrays (lse_log2, D, the fp32 dQ
// accumulator). Dense: (batch, nheads, rows_padded). Varlen: (nheads, rows_padded), sequence b
// starting at row (cu_seqlens_q[b] + VARLEN_STATS_GAP * b) rounded down to a multiple of 4 (so
// that 16-byte copies of the statistics stay aligned); VARLEN_STATS_GAP is BWD_ROW_PADDING + 4,
// so consecutive starts are at least length + BWD_ROW_PADDING + 1 rows apart, room for the
// sequence padded to whole BWD_ROW_PADDING-row blocks.
template <bool VARLEN>
CF2_DEVICE i64 stats_row0(int batch, int head, int nheads, int rows_padded, int seq_start) {
    if constexpr (VARLEN)
        return static_cast<i64>(head) * rows_padded + ((seq_start + VARLEN_STATS_GAP * batch) & ~3);
    return (static_cast<i64>(batch) * nheads + head) * rows_padded;
}

// First element of (batch, head) in the forward's lse: dense (batch, nheads, seqlen_q), varlen
// (nheads, total_q) as flash-attn.
template <bool VARLEN>
CF2_DEVICE i64 lse_row0(int batch, int head, int nheads, int seqlen_q, int total_q,
                        int seq_start) {
    if constexpr (VARLEN) return static_cast<i64>(head) * total_q + seq_start;
    return (static_cast<i64>(batch) * nheads + head) * seqlen_q;
}
