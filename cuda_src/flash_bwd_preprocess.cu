// Backward preprocessing (FA2, Algorithm 2, line 4): D_i = rowsum(dO_i * O_i) in fp32, and the
// forward's logsumexp converted to log2 units (so the main kernel recomputes P with one FFMA and
// one EX2, as the forward does). Both are written padded to whole Q blocks: padding rows get
// D = 0 and lse = +inf, so P = exp2(s - inf) = 0 there and the main kernel needs no row masking.
// With the atomic dQ path (dq_accum set) the same rows of the fp32 dQ accumulator are zeroed
// here, which the main kernel then adds to (same stream): no memset of its own before it; so are
// the deterministic Hopper backward's dQ semaphores (dq_semaphore set), a slot per
// DQ_SEMAPHORE_ROWS rows.
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "varlen.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// One warp per row (lane c reads the 16-byte chunk c of dO and O), PREPROCESS_ROWS_PER_WARP rows
// per warp; then the CTA zeroes its rows of dq_accum, 16 bytes a thread. VARLEN: packed
// sequences (varlen.cuh), grid z over the sequences. The parameters: BwdParams
// (kernel_params.cuh), of which this kernel reads dout, out, lse and writes delta, lse_log2 and
// dq_accum. dO and O are addressed in 16-bit words (head_dim_v, their head dim, and strides
// too): with float32 elements (Elem::IS_F32) a chunk is 4 floats and a row up to 64 chunks, two
// a lane. At TF32
// (tf32_tag) dO is rounded to TF32 as the main kernel's dP = dO V^T takes it, so that D is the
// row sum of P o dP of the dO that dP saw: with D from the exact dO, dP - D would keep dO's
// rounding error where it should cancel (a row that sees one key: dS = 0 exactly).
template <typename Elem, bool VARLEN>
__global__ void __launch_bounds__(PREPROCESS_THREADS)
flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
    constexpr float LOG2E = 1.4426950408889634f;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const SequenceRows seq = query_rows<VARLEN>(p, batch);
    const i64 stat_offset =
        stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq.start);
    const i64 lse_offset =
        lse_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q, p.varlen.total_q, seq.start);
    const int seqlen_q = seq.length;
    // Whole blocks of every block_m.
    const int rows_padded = (seqlen_q + BWD_ROW_PADDING - 1) / BWD_ROW_PADDING * BWD_ROW_PADDING;
    const u16* dout_head = p.dout + batch * p.do_batch_stride + head * p.do_head_stride +
                           seq.start * p.do_row_stride;
    const u16* out_head = p.out + batch * p.o_batch_stride + head * p.o_head_stride +
                          seq.start * p.o_row_stride;
    const int row0 = (blockIdx.x * (PREPROCESS_THREADS / 32) + warp) * PREPROCESS_ROWS_PER_WARP;

#pragma unroll 2
    for (int r = 0; r < PREPROCESS_ROWS_PER_WARP; ++r) {
        const int row = row0 + r;
        if (row >= rows_padded) break;
        float partial = 0.f;
        if constexpr (Elem::IS_F32) {
            if (row < seqlen_q) {
                for (int chunk = lane; chunk * 8 < p.head_dim_v; chunk += 32) {
                    u32 a[4], b[4];
                    load_16B_global(a, dout_head + row * p.do_row_stride + chunk * 8);
                    load_16B_global(b, out_head + row * p.o_row_stride + chunk * 8);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float d_out = __uint_as_float(
                            Elem::SPLIT ? a[i] : to_tf32(__uint_as_float(a[i])));
                        partial = fmaf(d_out, __uint_as_float(b[i]), partial);
                    }
                }
            }
        } else if (row < seqlen_q && lane * 8 < p.head_dim_v) {
            u32 a[4], b[4];
            load_16B_global(a, dout_head + row * p.do_row_stride + lane * 8);
            load_16B_global(b, out_head + row * p.o_row_stride + lane * 8);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                partial += to_float<Elem>(static_cast<u16>(a[i] & 0xffffu)) *
                           to_float<Elem>(static_cast<u16>(b[i] & 0xffffu));
                partial += to_float<Elem>(static_cast<u16>(a[i] >> 16)) *
                           to_float<Elem>(static_cast<u16>(b[i] >> 16));
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
            partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        if (lane == 0) {
            p.delta[stat_offset + row] = partial;
            // lse is +inf for a row that saw no key: it stays +inf (P = 0).
            p.lse_log2[stat_offset + row] =
                row < seqlen_q ? p.lse[lse_offset + row] * LOG2E : pos_inf();
        }
    }

    // The CTA's rows of the dQ accumulator, contiguous there (accum_dim floats a row). The stores
    // wait on nothing, so they come after the loads of the statistics.
    if (p.dq_accum != nullptr) {
        constexpr int CTA_ROWS = PREPROCESS_THREADS / 32 * PREPROCESS_ROWS_PER_WARP;
        const int cta_row0 = blockIdx.x * CTA_ROWS;
        const u32 zeros[4] = {0u, 0u, 0u, 0u};
        float* accum_rows = p.dq_accum + (stat_offset + cta_row0) * p.accum_dim;
        const int chunks = max(0, min(CTA_ROWS, rows_padded - cta_row0)) * (p.accum_dim / 4);
        for (int chunk = threadIdx.x; chunk < chunks; chunk += PREPROCESS_THREADS)
            store_16B_global(accum_rows + 4 * chunk, zeros);
    }
    if (p.dq_semaphore != nullptr) {
        constexpr int CTA_ROWS = PREPROCESS_THREADS / 32 * PREPROCESS_ROWS_PER_WARP;
        static_assert(CTA_ROWS % DQ_SEMAPHORE_ROWS == 0, "whole semaphore blocks a CTA");
        static_assert(BWD_ROW_PADDING % DQ_SEMAPHORE_ROWS == 0, "whole blocks a head");
        const int cta_row0 = blockIdx.x * CTA_ROWS;
        for (int row = cta_row0 + threadIdx.x * DQ_SEMAPHORE_ROWS;
             row < min(cta_row0 + CTA_ROWS, rows_padded);
             row += PREPROCESS_THREADS * DQ_SEMAPHORE_ROWS)
            p.dq_semaphore[(stat_offset + row) / DQ_SEMAPHORE_ROWS] = 0;
    }
}
