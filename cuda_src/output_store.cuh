// The forward kernels' last step, shared by them: where a query row's normalised output O and
// its lse go. The mma.sync forward (flash_fwd.cu) and the Hopper forward (sm90/fwd_epilogue.cuh)
// stage a block's O rows through shared memory and copy them out in 16-byte row chunks
// (store_staged_rows), and write the rows of a block that sees no key directly
// (store_empty_rows); decode (flash_decode.cu) and its split merge (split_merge.cuh) hold a
// merged row as 4-float column chunks in registers and store each with OutputChunk. The
// conventions are one: O in the input dtype, lse in natural-log units, a row that sees no key
// gives O = 0 and lse = +inf (with sinks, the sink: AttentionVariant::empty_row_lse), and rows
// past the sequence's end and chunks past head_dim are never written.
#pragma once
#include "mma_primitives.cuh"
#include "kernel_params.cuh"

// Rows row0 .. row0 + ROWS - 1 of a block (its first row row_first of the sequence) whose rows
// see no key: O = 0 and lse = Variant::empty_row_lse, written by THREADS threads, `tid` being
// one of them. No shared memory, no barrier. CHUNKS: the 16-byte chunks of the kernel's head
// dim; head_chunks: those actually present in an O row. o_block, lse_block: the block's row 0.
template <int ROWS, int CHUNKS, int THREADS, class Variant>
CF2_DEVICE void store_empty_rows(const FwdParams& p, u16* o_block, float* lse_block, int head,
                                 int row_first, int seqlen_q, int head_chunks, int row0,
                                 int tid) {
    const u32 zeros[4] = {0u, 0u, 0u, 0u};
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
        const int row = row0 + idx / CHUNKS, chunk = idx % CHUNKS;
        if (row_first + row < seqlen_q && chunk < head_chunks)
            store_16B_global(o_block + row * p.o_row_stride + chunk * 8, zeros);
    }
    for (int row = row0 + tid; row < row0 + ROWS; row += THREADS)
        if (row_first + row < seqlen_q) lse_block[row] = Variant::empty_row_lse(p.mods, head);
}

// Copies rows row0 .. row0 + ROWS - 1 of O, staged in shared memory (smem_chunk(row, chunk):
// the shared address of 16-byte chunk `chunk` of row `row`, in the kernel's swizzled layout),
// to global memory in 16-byte row chunks, by THREADS threads (those that staged them, after
// their barrier), `tid` being one of them: consecutive threads take consecutive chunks of a
// row, so the stores are coalesced.
template <int ROWS, int CHUNKS, int THREADS, class SmemChunk>
CF2_DEVICE void store_staged_rows(const FwdParams& p, u16* o_block, SmemChunk smem_chunk,
                                  int row_first, int seqlen_q, int head_chunks, int row0,
                                  int tid) {
    static_assert(ROWS * CHUNKS % THREADS == 0, "whole passes of the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int idx = tid + THREADS * i;
        const int row = row0 + idx / CHUNKS;
        const int chunk = idx % CHUNKS;
        if (row_first + row < seqlen_q && chunk < head_chunks) {
            u32 vals[4];
            load_16B_shared(vals, smem_chunk(row, chunk));
            store_16B_global(o_block + row * p.o_row_stride + chunk * 8, vals);
        }
    }
}

// Where a merged 4-float column chunk of an output row goes: out, and with the row's first
// chunk its lse (log2 units in, natural log out; +inf for a row that saw no key). Decode locates
// it before the split merge's wait (split_merge.cuh: merge_splits).
template <class Elem>
struct OutputChunk {
    u16* out;
    float* lse;  // null but for the first chunk

    CF2_DEVICE void operator()(float4 o, float lse2) const {
        *reinterpret_cast<uint2*>(out) =
            make_uint2(pack_pair<Elem>(o.x, o.y), pack_pair<Elem>(o.z, o.w));
        constexpr float LN2 = 0.6931471805599453f;
        if (lse != nullptr) *lse = lse2 == neg_inf() ? pos_inf() : lse2 * LN2;
    }
};
