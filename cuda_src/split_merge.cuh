// Split-KV ("flash-decoding") merge, inside the decode kernel. The CTAs of one block of query rows
// (its splits) each attend to one range of keys and leave a partial result; then they wait for
// each other and merge the partials together, each split a share of the output. A second kernel
// would cost a launch and a kernel boundary, and one CTA merging alone would read every partial
// by itself: microseconds either way, which a batch-1 decoding step cannot spare.
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"

// Adds `value` to *ptr with release semantics at GPU scope (what this thread wrote, and what it
// saw the CTA write through a barrier, is visible before the addition) and returns the old
// value. (__threadfence() and an add: a sequentially consistent fence, MEMBAR.SC.GPU in SASS,
// where a release needs MEMBAR.ALL.GPU.)
CF2_DEVICE unsigned atomic_add_release_gpu(unsigned* ptr, unsigned value) {
    unsigned old;
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;\n"
                 : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

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
        // (released: the partial results are visible device-wide before the arrival)
        const unsigned seen = atomic_add_release_gpu(reinterpret_cast<unsigned*>(counter), add);
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

// The cluster's barrier without the release: where it only keeps each CTA's shared memory alive
// until its peers have read it (their loads have returned before they arrive: the merge used
// the values). A release arrive is a GPU-scope membar (MEMBAR.ALL.GPU in SASS), which would also
// wait for this thread's stores of the output to be acknowledged, ~0.5 us at the end of a step.
CF2_DEVICE void cluster_barrier_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
                 "barrier.cluster.wait.aligned;\n" ::: "memory");
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
// lse (log2 units, -inf: no key seen) at lse_result + r. An item is merged by CLUSTER_ITEM_LANES
// lanes, lane j loading splits 2j and 2j + 1 (four loads from its peers in flight), then reduced
// by shuffles: the weighted terms are summed as a pairwise tree over the splits in order, padded
// to a power of two, which is the order of merge_split_share's lanes and shuffles, so both merges
// give the same bits. store(r, chunk, out chunk, lse) as merge_split_share's.
constexpr int CLUSTER_ITEM_LANES = MAX_CLUSTER_SPLITS / 2;

template <int HEAD_DIM, int THREADS, class Store>
CF2_DEVICE void merge_cluster_share(u32 o_result, u32 lse_result, int num_splits, int split,
                                    int rows, int head_dim, int tid, const Store& store) {
    static_assert(THREADS % 32 == 0 && 32 % CLUSTER_ITEM_LANES == 0, "items whole in warps");
    constexpr int ITEMS_PER_PASS = THREADS / CLUSTER_ITEM_LANES;
    const int chunks = head_dim / 4;
    const int items = rows * chunks;
    const int share = (items + num_splits - 1) / num_splits;
    const int item_end = min(items, (split + 1) * share);
    const int lane = tid % CLUSTER_ITEM_LANES;
    // Lanes past the splits' power of two only add zeros; the shuffles stop at that width.
    int width = 1;
    while (width < num_splits) width *= 2;
    // (The loop runs warp-uniformly: the shuffles need every lane.)
    for (int base = split * share; base < item_end; base += ITEMS_PER_PASS) {
        const int item = base + tid / CLUSTER_ITEM_LANES;
        const int r = item / chunks, chunk = item % chunks;
        float lse_s[2];
        float4 o_s[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int s = 2 * lane + i;
            lse_s[i] = neg_inf();
            o_s[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (item < item_end && s < num_splits) {
                lse_s[i] = load_cluster_f32(cluster_peer_address(lse_result + 4 * r, s));
                o_s[i] = load_cluster_f32x4(
                    cluster_peer_address(o_result + 4 * (r * HEAD_DIM + 4 * chunk), s));
            }
        }
        float m = fmaxf(lse_s[0], lse_s[1]);
        for (int step = 1; 2 * step < width; step *= 2)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, step));
        float w[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            w[i] = (m == neg_inf() || lse_s[i] == neg_inf()) ? 0.f : fast_exp2(lse_s[i] - m);
            o_s[i] = make_float4(fmaf(w[i], o_s[i].x, 0.f), fmaf(w[i], o_s[i].y, 0.f),
                                 fmaf(w[i], o_s[i].z, 0.f), fmaf(w[i], o_s[i].w, 0.f));
        }
        // Tree level 1 inside the lane (splits 2j and 2j + 1; a split past num_splits adds 0).
        float sum = w[0] + w[1];
        float4 acc = make_float4(o_s[0].x + o_s[1].x, o_s[0].y + o_s[1].y, o_s[0].z + o_s[1].z,
                                 o_s[0].w + o_s[1].w);
        for (int step = 1; 2 * step < width; step *= 2) {
            sum += __shfl_xor_sync(0xffffffffu, sum, step);
            acc.x += __shfl_xor_sync(0xffffffffu, acc.x, step);
            acc.y += __shfl_xor_sync(0xffffffffu, acc.y, step);
            acc.z += __shfl_xor_sync(0xffffffffu, acc.z, step);
            acc.w += __shfl_xor_sync(0xffffffffu, acc.w, step);
        }
        if (lane == 0 && item < item_end) {
            const bool seen = sum > 0.f;
            const float inv = seen ? 1.f / sum : 0.f;
            store(r, chunk, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
                  seen ? m + __log2f(sum) : neg_inf());
        }
    }
}
#endif
