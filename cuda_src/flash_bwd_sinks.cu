// The learnable sinks' gradient (FEATURE_SINKS). A sink is one more logit in every row's softmax
// with no value row, so its probability in row i is P_sink = exp(sink - lse_i) (the forward's
// lse counts the sink), its dP is 0, and the softmax's derivative gives
//   dL/dsink = sum_i P_sink,i (0 - D_i) = -sum_i exp(sink - lse_i) D_i,   D_i = rowsum(dO_i o O_i),
// summed over every row of the head, in every sequence. The backward's main kernels need nothing
// else: they recompute P from the same lse, and D already holds the sink's share
// (docs/ARCHITECTURE.md, "Where a feature enters").
//
// One CTA a head, after the preprocess (which wrote lse_log2 and D): each thread walks its rows in
// a fixed order and the CTA adds the threads' sums in a fixed tree, so the result is the same bits
// on every run (no atomics; deterministic mode needs nothing more). Rows past a sequence's end
// are the preprocess's padding (lse_log2 +inf, D 0: they add 0); a varlen sequence's rows are
// read from cu_seqlens. The statistics of a call are a few MB, fresh in L2 from the preprocess. The parameters: BwdParams (kernel_params.cuh), of which this kernel reads
// lse_log2, delta, mods.sinks and writes dsinks[head].
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "varlen.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

template <typename Elem, bool VARLEN>
__global__ void __launch_bounds__(SINKS_THREADS)
flash_bwd_sinks_kernel(const __grid_constant__ BwdParams p) {
    constexpr float LOG2E = 1.4426950408889634f;
    const int head = blockIdx.x;
    const float sink_log2 = p.mods.sinks[head] * LOG2E;
    // Four rows a thread at a time: a (sequence, head)'s rows start on a 16-byte boundary of the
    // statistics (whole padded blocks dense, multiples of 4 rows varlen: varlen.cuh), and the
    // preprocess wrote its padding up to a whole BWD_ROW_PADDING block past its last row, so the
    // last group of four reads padding (adding 0), never unwritten memory.
    float sum = 0.f;
    for (int batch = 0; batch < p.batch; ++batch) {
        const SequenceRows seq = query_rows<VARLEN>(p, batch);
        const i64 row0 = stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq.start);
        const float4* lse4 = reinterpret_cast<const float4*>(p.lse_log2 + row0);
        const float4* delta4 = reinterpret_cast<const float4*>(p.delta + row0);
#pragma unroll 2
        for (int i = threadIdx.x; 4 * i < seq.length; i += SINKS_THREADS) {
            const float4 lse = lse4[i], delta = delta4[i];
            sum = fmaf(fast_exp2(sink_log2 - lse.x), delta.x, sum);
            sum = fmaf(fast_exp2(sink_log2 - lse.y), delta.y, sum);
            sum = fmaf(fast_exp2(sink_log2 - lse.z), delta.z, sum);
            sum = fmaf(fast_exp2(sink_log2 - lse.w), delta.w, sum);
        }
    }
    __shared__ float warp_sums[SINKS_THREADS / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < SINKS_THREADS / 32; ++w) total += warp_sums[w];
        p.dsinks[head] = -total;
    }
}
