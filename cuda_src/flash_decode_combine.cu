// Merges the split-KV partial results of flash_decode.cu: for each (batch, head, query row),
//   lse = log sum_s exp(lse_s),  out = sum_s exp(lse_s - lse) O_s
// in fp32 (O_s are normalised partial outputs, lse_s natural-log, -inf for a split that saw no
// key), written in the input dtype; lse is +inf, and out 0, for a row that saw no key at all.
// One CTA per row, one thread per column.
#include "mma_primitives.cuh"

template <typename Elem>
__global__ void __launch_bounds__(256)
flash_decode_combine_kernel(const float* __restrict__ o_partial, const float* __restrict__ lse_partial,
                            u16* __restrict__ out, float* __restrict__ lse,
                            i64 o_batch_stride, i64 o_row_stride, i64 o_head_stride,
                            int num_splits, int batch_total, int nheads, int seqlen_q,
                            int head_dim, int accum_dim, int batch_offset) {
    const int position = blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + batch_offset;
    const i64 split_stride = static_cast<i64>(batch_total) * nheads * seqlen_q;
    const i64 row0 = (static_cast<i64>(batch) * nheads + head) * seqlen_q + position;
    float m = neg_inf();
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, lse_partial[s * split_stride + row0]);
    float sum = 0.f;
    if (m != neg_inf())
        for (int s = 0; s < num_splits; ++s) sum += __expf(lse_partial[s * split_stride + row0] - m);
    const bool seen = sum > 0.f;
    if (threadIdx.x == 0) lse[row0] = seen ? m + __logf(sum) : pos_inf();
    u16* dst = out + batch * o_batch_stride + position * o_row_stride + head * o_head_stride;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float o = 0.f;
        if (seen)
            for (int s = 0; s < num_splits; ++s) {
                const float w = __expf(lse_partial[s * split_stride + row0] - m);
                o += w * o_partial[(s * split_stride + row0) * accum_dim + c];
            }
        dst[c] = static_cast<u16>(pack_pair<Elem>(seen ? o / sum : 0.f, 0.f) & 0xffffu);
    }
}
