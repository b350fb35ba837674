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
// visible to all. One counter, never reset: split 0 adds 2^31 - (count - 1), the others 1, so
// the counter's top bit flips when the last CTA arrives and its other bits come back to what they
// were (any count, launch after launch); each CTA waits for the flip it saw coming. The CTAs wait
// on each other, so the launch must keep them all resident: a cooperative launch.
// (The counters were reset by the last CTA to leave, a second atomic round trip on every CTA's
// way out: 0.8 us a batch-1 layer at 16k and 64k tokens in a CUDA graph, H200.)
CF2_DEVICE void split_barrier(int* counter, int count, int split) {
    __syncthreads();  // the CTA's partial results are written
    if (threadIdx.x == 0) {
        const unsigned add = split == 0 ? 0x80000000u - static_cast<unsigned>(count - 1) : 1u;
        __threadfence();  // ... and visible device-wide before the arrival
        const unsigned seen = atomicAdd(reinterpret_cast<unsigned*>(counter), add);
        while (((static_cast<unsigned>(load_acquire_gpu(counter)) ^ seen) & 0x80000000u) == 0)
            __nanosleep(32);
    }
    __syncthreads();  // every thread reads the others' partial results after the acquire
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

// ---- The merge inside a thread-block cluster (sm_90) -----------------------------------------
// Where a row block's splits are one cluster (at most MAX_CLUSTER_SPLITS CTAs, rank = split),
// each CTA leaves its normalised result in its own shared memory, the cluster's hardware barrier
// replaces the counters, and each split merges its share of the (row, 4-float column chunk)
// items reading its peers' shared memory directly (distributed shared memory): no partial result
// goes through L2, no fence, no atomics. A second barrier keeps every CTA's shared memory alive
// until its peers have read it.
#if __CUDA_ARCH__ >= 900
CF2_DEVICE void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address of this CTA's shared-memory word `local` in the shared memory of cluster rank
// `rank`.
CF2_DEVICE u32 cluster_peer_address(u32 local, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

CF2_DEVICE float load_cluster_f32(u32 address) {
    float value;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(address) : "memory");
    return value;
}

CF2_DEVICE float4 load_cluster_f32x4(u32 address) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(address) : "memory");
    return v;
}

// Merges this split's share of the items of a block of `rows` rows. Every split of the cluster
// left, in its shared memory, row r's normalised output at o_result + r * HEAD_DIM (fp32) and its
// lse (log2 units, -inf: no key seen) at lse_result + r. One thread an item, every peer's values
// loaded together; store(r, chunk, out chunk, lse) as merge_split_share's.
template <int HEAD_DIM, int THREADS, class Store>
CF2_DEVICE void merge_cluster_share(u32 o_result, u32 lse_result, int num_splits, int split,
                                    int rows, int head_dim, int tid, const Store& store) {
    const int chunks = head_dim / 4;
    const int items = rows * chunks;
    const int share = (items + num_splits - 1) / num_splits;
    const int item_end = min(items, (split + 1) * share);
    for (int item = split * share + tid; item < item_end; item += THREADS) {
        const int r = item / chunks, chunk = item % chunks;
        float lse_s[MAX_CLUSTER_SPLITS];
        float4 o_s[MAX_CLUSTER_SPLITS];
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; ++s) {
            lse_s[s] = neg_inf();
            o_s[s] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (s < num_splits) {
                lse_s[s] = load_cluster_f32(cluster_peer_address(lse_result + 4 * r, s));
                o_s[s] = load_cluster_f32x4(
                    cluster_peer_address(o_result + 4 * (r * HEAD_DIM + 4 * chunk), s));
            }
        }
        float m = neg_inf();
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; ++s) m = fmaxf(m, lse_s[s]);
        // The weighted terms, summed as a pairwise tree over the splits in order, padded to a
        // power of two: the order of merge_split_share's lanes and shuffles, so that both
        // merges give the same bits.
        float w_s[MAX_CLUSTER_SPLITS];
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; ++s) {
            w_s[s] = (m == neg_inf() || lse_s[s] == neg_inf()) ? 0.f : fast_exp2(lse_s[s] - m);
            o_s[s] = make_float4(fmaf(w_s[s], o_s[s].x, 0.f), fmaf(w_s[s], o_s[s].y, 0.f),
                                 fmaf(w_s[s], o_s[s].z, 0.f), fmaf(w_s[s], o_s[s].w, 0.f));
        }
#pragma unroll
        for (int width = 1; width < MAX_CLUSTER_SPLITS; width *= 2) {
            if (width >= num_splits) break;
#pragma unroll
            for (int s = 0; s + width < MAX_CLUSTER_SPLITS; s += 2 * width) {
                w_s[s] += w_s[s + width];
                o_s[s] = make_float4(o_s[s].x + o_s[s + width].x, o_s[s].y + o_s[s + width].y,
                                     o_s[s].z + o_s[s + width].z, o_s[s].w + o_s[s + width].w);
            }
        }
        const float sum = w_s[0];
        const float4 acc = o_s[0];
        const bool seen = sum > 0.f;
        const float inv = seen ? 1.f / sum : 0.f;
        store(r, chunk, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
              seen ? m + __log2f(sum) : neg_inf());
    }
}
#endif
