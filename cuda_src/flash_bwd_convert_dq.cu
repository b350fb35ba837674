// Backward postprocessing: dQ = softmax_scale * dq_accum (fp32, accumulated by the main kernel's
// atomics, layout in dq_accum.cuh) converted to the input dtype and written into the caller's
// (batch, seqlen_q, nheads, headdim) array with 16-byte stores.
#include "mma_primitives.cuh"
#include "dq_accum.cuh"
#include "varlen.cuh"
#include "constants.cuh"

// VARLEN: packed sequences (varlen.cuh), grid z over the sequences.
template <typename Elem, bool VARLEN>
__global__ void __launch_bounds__(CONVERT_THREADS)
flash_bwd_convert_dq_kernel(const float* __restrict__ dq_accum, u16* __restrict__ dq,
                            i64 dq_batch_stride, i64 dq_row_stride, i64 dq_head_stride,
                            int seqlen_q, int seqlen_q_padded, int nheads, int head_dim,
                            int accum_dim, float softmax_scale,
                            const int* __restrict__ cu_seqlens_q, int total_q, int batch_offset) {
    const int head = blockIdx.y;
    const int batch = blockIdx.z + batch_offset;
    const SequenceRows seq = sequence_rows<VARLEN>(cu_seqlens_q, batch, seqlen_q, total_q);
    seqlen_q = seq.length;
    const int chunks = head_dim / 8;
    const int idx = blockIdx.x * CONVERT_THREADS + threadIdx.x;
    const int row = idx / chunks;
    const int chunk = idx % chunks;
    if (row >= seqlen_q) return;
    const float* src =
        dq_accum +
        (stats_row0<VARLEN>(batch, head, nheads, seqlen_q_padded, seq.start) + row) * accum_dim;
    u32 packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        // Columns 8 chunk + 2i and + 1 are adjacent in the interleaved layout too.
        const float* pair = src + dq_accum_position(chunk * 8 + 2 * i);
        packed[i] = pack_pair<Elem>(pair[0] * softmax_scale, pair[1] * softmax_scale);
    }
    store_16B_global(dq + batch * dq_batch_stride + head * dq_head_stride +
                         (seq.start + row) * dq_row_stride + chunk * 8,
                     packed);
}
