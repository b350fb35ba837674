// Merges the split-KV partial results of flash_decode.cu: for each (batch, head, query row),
//   lse = log sum_s exp(lse_s),  out = sum_s exp(lse_s - lse) O_s
// in fp32 (O_s are normalised partial outputs, lse_s natural-log, -inf for a split that saw no
// key), written in the input dtype; lse is +inf, and out 0, for a row that saw no key at all.
//
// One CTA per row. The split loop is what costs time (up to MAX_SPLITS dependent loads if one
// thread walked it), so the splits' weights are computed once into shared memory and the
// columns are summed by groups of threads that each take every GROUPS-th split, 16 bytes a load,
// several loads in flight.
#include "mma_primitives.cuh"

constexpr int COMBINE_THREADS = 256;
constexpr int COMBINE_MAX_SPLITS = 128;  // api._MAX_SPLITS

template <typename Elem>
__global__ void __launch_bounds__(COMBINE_THREADS)
flash_decode_combine_kernel(const float* __restrict__ o_partial, const float* __restrict__ lse_partial,
                            u16* __restrict__ out, float* __restrict__ lse,
                            i64 o_batch_stride, i64 o_row_stride, i64 o_head_stride,
                            int num_splits, int batch_total, int nheads, int seqlen_q,
                            int head_dim, int accum_dim, int batch_offset) {
    __shared__ float weight[COMBINE_MAX_SPLITS];
    __shared__ float4 group_sum[COMBINE_THREADS];
    const int tid = threadIdx.x;
    const int position = blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + batch_offset;
    const i64 split_stride = static_cast<i64>(batch_total) * nheads * seqlen_q;
    const i64 row0 = (static_cast<i64>(batch) * nheads + head) * seqlen_q + position;

    for (int s = tid; s < num_splits; s += COMBINE_THREADS) weight[s] = lse_partial[s * split_stride + row0];
    __syncthreads();
    float m = neg_inf();
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, weight[s]);
    __syncthreads();  // every thread has read the lse values before they become weights
    for (int s = tid; s < num_splits; s += COMBINE_THREADS)
        weight[s] = m == neg_inf() ? 0.f : __expf(weight[s] - m);  // 0 for a split with no key
    __syncthreads();
    float sum = 0.f;
    for (int s = 0; s < num_splits; ++s) sum += weight[s];
    const bool seen = sum > 0.f;
    if (tid == 0) lse[row0] = seen ? m + __logf(sum) : pos_inf();

    // Columns in 4-float chunks; GROUPS groups of threads split the splits between them.
    const int chunks = head_dim / 4;
    const int groups = COMBINE_THREADS / chunks;
    const int chunk = tid % chunks, group = tid / chunks;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (group < groups) {
        // No test on the weight inside the loop, so that the loads of 8 splits are in flight at
        // once; a split that saw no key has weight 0 and wrote O = 0.
#pragma unroll 8
        for (int s = group; s < num_splits; s += groups) {
            const float w = weight[s];
            const float4 o = *reinterpret_cast<const float4*>(
                o_partial + (s * split_stride + row0) * accum_dim + 4 * chunk);
            acc.x = fmaf(w, o.x, acc.x);
            acc.y = fmaf(w, o.y, acc.y);
            acc.z = fmaf(w, o.z, acc.z);
            acc.w = fmaf(w, o.w, acc.w);
        }
    }
    group_sum[tid] = acc;
    __syncthreads();
    if (group != 0) return;
    for (int g = 1; g < groups; ++g) {
        const float4 o = group_sum[g * chunks + chunk];
        acc.x += o.x;
        acc.y += o.y;
        acc.z += o.z;
        acc.w += o.w;
    }
    const float inv = seen ? 1.f / sum : 0.f;
    u16* dst = out + batch * o_batch_stride + position * o_row_stride + head * o_head_stride + 4 * chunk;
    const uint2 packed = make_uint2(pack_pair<Elem>(acc.x * inv, acc.y * inv),
                                    pack_pair<Elem>(acc.z * inv, acc.w * inv));
    *reinterpret_cast<uint2*>(dst) = packed;
}
