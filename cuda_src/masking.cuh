// Which keys a query row may see, and masking of score tiles.
//
// Query row i sees key j iff  lo(i) <= j < hi(i)  with, for diag = seqlen_k - seqlen_q
// (causal and windows are aligned to the bottom-right corner, as in flash-attn):
//   lo(i) = i + diag - window_left        (0 when window_left < 0: unbounded)
//   hi(i) = i + diag + window_right + 1   (seqlen_k when window_right < 0)
// clipped to [0, seqlen_k). Causal attention is window (-1, 0).
#pragma once
#include "mma_primitives.cuh"

struct KeyVisibility {
    int diag;          // seqlen_k - seqlen_q
    int window_left;   // < 0: unbounded
    int window_right;  // < 0: unbounded
    int seqlen_k;

    CF2_DEVICE int lo(int row) const { return window_left < 0 ? 0 : row + diag - window_left; }
    CF2_DEVICE int hi(int row) const {
        return window_right < 0 ? seqlen_k : min(seqlen_k, row + diag + window_right + 1);
    }

    // KV tiles [first, end) hold every key that rows [row_first, row_last] can see. Tiles outside
    // are skipped entirely (never loaded, never multiplied).
    CF2_DEVICE void tile_range(int row_first, int row_last, int block_n, int& first,
                               int& end) const {
        const int key_end = hi(row_last);
        const int key_first = max(0, lo(row_first));
        end = key_end <= 0 ? 0 : (key_end + block_n - 1) / block_n;
        first = key_first / block_n;
    }

    // Tiles in [lo, hi) hold no invisible (row, key) pair for rows [row_first, row_last]: they are
    // below the sequence tail and the causal diagonal / right window edge of every row, and above
    // the left window edge of every row. Only the tiles outside need masking.
    CF2_DEVICE void unmasked_tile_range(int row_first, int row_last, int block_n, int& lo,
                                        int& hi) const {
        // key_last = tile * block_n + block_n - 1 must be < key_end for every row
        int key_end = seqlen_k;
        if (window_right >= 0) key_end = min(key_end, row_first + diag + window_right + 1);
        hi = key_end <= 0 ? 0 : key_end / block_n;
        // key_first = tile * block_n must be >= lo(row) for every row
        lo = 0;
        if (window_left >= 0) {
            const int key_lo = row_last + diag - window_left;
            lo = key_lo <= 0 ? 0 : (key_lo + block_n - 1) / block_n;
        }
    }
};

// Sets the invisible scores of a warp's accumulator tile to -inf. Accumulator layout (mma
// m16n8): s[mt][nt][2*half + e] is row row0 + 16*mt + 8*half, key key0 + 8*nt + e, where row0
// and key0 are this thread's first row and first key. LEFT / RIGHT: the window has that edge.
template <bool LEFT, bool RIGHT, int M_TILES, int N_TILES>
CF2_DEVICE void mask_scores_edges(float (&s)[M_TILES][N_TILES][4], int row0, int key0,
                                  const KeyVisibility& vis) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + 16 * mt + 8 * half;
            const int key_lo = LEFT ? row + vis.diag - vis.window_left : 0;
            const int key_hi =
                RIGHT ? min(vis.seqlen_k, row + vis.diag + vis.window_right + 1) : vis.seqlen_k;
            // Rows of more than 128 keys compare each key's constant offset 8 nt + e (an
            // immediate) with the edges relative to key0: with the keys' sums ptxas kept a
            // register a key (56 in the 224-key FP8 tile, spilled). Up to 128 keys the sums, as
            // the relative form made the sm_80 d=64 forward (255 registers) spill 12 bytes.
            constexpr bool RELATIVE = N_TILES > 16;
            const int origin = RELATIVE ? 0 : key0;  // what the keys below count from
            const int lo = RELATIVE ? key_lo - key0 : key_lo;
            const int hi = RELATIVE ? key_hi - key0 : key_hi;
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = origin + 8 * nt + e;
                    if (key < lo || key >= hi) s[mt][nt][2 * half + e] = neg_inf();
                }
            }
        }
    }
}

// The copy of the loops for this launch's window edges. The edges are the same for every thread,
// but the kernels read them from their parameter struct, which the compiler does not know to be
// uniform: left to itself it evaluates vis.lo / vis.hi with selects on every row (more registers
// in the backward) instead of branching once, as it does for scalar kernel parameters.
template <int M_TILES, int N_TILES>
CF2_DEVICE void mask_scores(float (&s)[M_TILES][N_TILES][4], int row0, int key0,
                            const KeyVisibility& vis) {
    if (vis.window_left < 0) {
        if (vis.window_right < 0)
            mask_scores_edges<false, false>(s, row0, key0, vis);
        else
            mask_scores_edges<false, true>(s, row0, key0, vis);
    } else {
        if (vis.window_right < 0)
            mask_scores_edges<true, false>(s, row0, key0, vis);
        else
            mask_scores_edges<true, true>(s, row0, key0, vis);
    }
}

// Sets the invisible entries of a transposed score tile (the Hopper backward's S^T) to -inf:
// s[nt][2 half + e] is key key0 + 8 half (this thread's row of S^T), query query0 + 8 nt + e (its
// column). mask_scores with the roles of rows and columns swapped; one branch per launch on the
// window's edges, as there (the edges are uniform, the compiler cannot know it).
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
CF2_DEVICE void mask_transposed(float (&s)[NT][4], int key0, int query0,
                                const KeyVisibility& vis) {
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
