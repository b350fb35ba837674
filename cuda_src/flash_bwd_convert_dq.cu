// Backward postprocessing: dQ = softmax_scale * dq_accum (fp32, accumulated by the main kernel's
// atomics, layout in dq_accum.cuh) converted to the input dtype and written into the caller's
// (batch, seqlen_q, nheads, headdim) array with 16-byte stores. dq is addressed in 16-bit words
// (head_dim and strides too): a chunk holds 8 16-bit or 4 float32 (Elem::IS_F32) elements.
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "dq_accum.cuh"
#include "varlen.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// VARLEN: packed sequences (varlen.cuh), grid z over the sequences. The parameters: BwdParams
// (kernel_params.cuh), of which this kernel reads dq_accum, dq and their layouts.
template <typename Elem, bool VARLEN>
__global__ void __launch_bounds__(CONVERT_THREADS)
flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
    const int head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const SequenceRows seq = query_rows<VARLEN>(p, batch);
    const int seqlen_q = seq.length;
    const int chunks = p.head_dim / 8;
    const int idx = blockIdx.x * CONVERT_THREADS + threadIdx.x;
    const int row = idx / chunks;
    const int chunk = idx % chunks;
    if (row >= seqlen_q) return;
    const float* src =
        p.dq_accum +
        (stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq.start) + row) *
            p.accum_dim;
    u32 packed[4];
    if constexpr (Elem::IS_F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            packed[i] = __float_as_uint(src[dq_accum_position(chunk * 4 + i)] * p.softmax_scale);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // Columns 8 chunk + 2i and + 1 are adjacent in the interleaved layout too.
            const float* pair = src + dq_accum_position(chunk * 8 + 2 * i);
            packed[i] = pack_pair<Elem>(pair[0] * p.softmax_scale, pair[1] * p.softmax_scale);
        }
    }
    store_16B_global(p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride +
                         (seq.start + row) * p.dq_row_stride + chunk * 8,
                     packed);
}
