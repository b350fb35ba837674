// Split-KV ("flash-decoding") merge, inside the decode kernel. The CTAs of one block of query rows
// (its splits) each attend to one range of keys and leave a partial result; then they wait for
// each other and merge the partials together, each split a share of the output. A second kernel
// would cost a launch and a kernel boundary, and one CTA merging alone would read every partial
// by itself: microseconds either way, which a batch-1 decoding step cannot spare.
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"

CF2_DEVICE int load_acquire_gpu(const int* ptr) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

// Returns once all `count` CTAs of a group have called it; what each wrote before is then
// visible to all. counters[0] counts arrivals, counters[1] departures, and the last CTA to leave
// resets both to 0 for the next launch on the stream. The CTAs wait on each other, so the launch
// must keep them all resident: a cooperative launch.
CF2_DEVICE void split_barrier(int* counters, int count) {
    __threadfence();  // this CTA's partial results are visible device-wide before it arrives
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(counters, 1);
        while (load_acquire_gpu(counters) < count) __nanosleep(32);
        if (atomicAdd(counters + 1, 1) == count - 1) {  // every CTA has seen them all arrive
            atomicExch(counters, 0);
            atomicExch(counters + 1, 0);
        }
    }
    __syncthreads();
    __threadfence();
}

// Merges this split's share of the (row, 4-float column chunk) items of a block of `rows` query
// rows. Split s left, for row r, its normalised output at o_parts + (s * BLOCK_M + r) * HEAD_DIM
// (fp32) and its log-sum-exp in log2 units at lse_parts[s * BLOCK_M + r] (-inf: no key seen).
// Per row:  lse = log2 sum_s 2^lse_s,  out = sum_s 2^(lse_s - lse) O_s.
// An item is merged by `lanes` lanes of a warp (the splits rounded up to a power of two, at most
// 32), each lane loading its splits' values (up to four), reduced by shuffles; a pass of the CTA
// takes 32 / lanes items a warp, two passes' loads in flight together, since what the merge waits
// on is the round trips to L2. store(r, chunk, out chunk, lse) runs in the item's first lane (the
// chunk is zero and lse -inf for a row no split saw a key of).
template <int HEAD_DIM, int THREADS, int BLOCK_M, class Store>
CF2_DEVICE void merge_split_share(const float* o_parts, const float* lse_parts, int num_splits,
                                  int split, int rows, int head_dim, int tid, const Store& store) {
    constexpr int SPLITS_PER_LANE = MAX_SPLITS / 32;
    constexpr int UNROLL = 2;
    const int warp = tid / 32, lane = tid % 32;
    int lanes = 1;
    while (lanes < min(num_splits, 32)) lanes *= 2;
    const int sub = lane / lanes, split_lane = lane % lanes;
    const int chunks = head_dim / 4;
    const int items = rows * chunks;
    const int share = (items + num_splits - 1) / num_splits;
    const int item_end = min(items, (split + 1) * share);
    const int per_pass = (THREADS / 32) * (32 / lanes);
    // (The loop runs warp-uniformly: the shuffles need every lane.)
    for (int base = split * share + warp * (32 / lanes); base < item_end; base += UNROLL * per_pass) {
        const int item0 = base + sub;
        float lse_s[UNROLL][SPLITS_PER_LANE];
        float4 o_s[UNROLL][SPLITS_PER_LANE];
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
            const int item = item0 + i * per_pass;
            const int r = item / chunks, chunk = item % chunks;
#pragma unroll
            for (int u = 0; u < SPLITS_PER_LANE; ++u) {
                const int s = split_lane + lanes * u;
                lse_s[i][u] = neg_inf();
                o_s[i][u] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (item < item_end && s < num_splits) {
                    lse_s[i][u] = __ldcg(lse_parts + s * BLOCK_M + r);
                    o_s[i][u] = __ldcg(reinterpret_cast<const float4*>(
                                           o_parts + (s * BLOCK_M + r) * HEAD_DIM) + chunk);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
            float m = neg_inf();
#pragma unroll
            for (int u = 0; u < SPLITS_PER_LANE; ++u) m = fmaxf(m, lse_s[i][u]);
            for (int step = 1; step < lanes; step *= 2)
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, step));
            float sum = 0.f;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int u = 0; u < SPLITS_PER_LANE; ++u) {
                const float w = (m == neg_inf() || lse_s[i][u] == neg_inf())
                                    ? 0.f : fast_exp2(lse_s[i][u] - m);
                sum += w;
                acc = make_float4(fmaf(w, o_s[i][u].x, acc.x), fmaf(w, o_s[i][u].y, acc.y),
                                  fmaf(w, o_s[i][u].z, acc.z), fmaf(w, o_s[i][u].w, acc.w));
            }
            for (int step = 1; step < lanes; step *= 2) {
                sum += __shfl_xor_sync(0xffffffffu, sum, step);
                acc.x += __shfl_xor_sync(0xffffffffu, acc.x, step);
                acc.y += __shfl_xor_sync(0xffffffffu, acc.y, step);
                acc.z += __shfl_xor_sync(0xffffffffu, acc.z, step);
                acc.w += __shfl_xor_sync(0xffffffffu, acc.w, step);
            }
            const int item = item0 + i * per_pass;
            if (split_lane == 0 && item < item_end) {
                const bool seen = sum > 0.f;
                const float inv = seen ? 1.f / sum : 0.f;
                store(item / chunks, item % chunks,
                      make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
                      seen ? m + __log2f(sum) : neg_inf());
            }
        }
    }
}
