// Split-KV ("flash-decoding") merge, inside the decode kernel. The CTAs of one block of query rows
// (its splits) each attend to one range of keys and leave a partial result; then they wait for
// each other and merge the partials together, each split a share of the output. A second kernel
// would cost a launch and a kernel boundary, and one CTA merging alone would read every partial
// by itself: microseconds either way, which a batch-1 decoding step cannot spare.
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "lse_merge.cuh"
#include "mbarrier.cuh"

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

// The splits of a row block meet at one counter in global memory, never reset: split 0 adds
// 2^31 - (count - 1), the others 1, so the counter's top bit flips when the last CTA arrives and
// its other bits come back to what they were (any count, launch after launch); each CTA waits for
// the flip it saw coming. The CTAs wait on each other, so the launch must keep them all resident:
// a cooperative launch. Arrival and wait are apart so that a CTA locates its share of the merge
// while the atomic's round trip and the slowest split are under way.
// (The counters were reset by the last CTA to leave, a second atomic round trip on every CTA's
// way out: 0.8 us a batch-1 layer at 16k and 64k tokens in a CUDA graph, H200.)
struct SplitBarrier {
    int* counter;
    unsigned seen = 0;  // (thread 0) the counter before this CTA's arrival

    CF2_DEVICE void arrive(int count, int split) {
        arrive_among(count, split, threadIdx.x == 0, [] { __syncthreads(); });
    }

    // Returns once every split has arrived; what each wrote before is then visible to all.
    CF2_DEVICE void wait() const { wait_among(threadIdx.x == 0, [] { __syncthreads(); }); }

    // The same for the threads of the CTA that `sync` synchronises (every thread: arrive and
    // wait; the MLA decode kernel's consumer warpgroups, its producer having left), `leader`
    // the one of them that adds and polls.
    template <class Sync>
    CF2_DEVICE void arrive_among(int count, int split, bool leader, const Sync& sync) {
        sync();  // the partial results of these threads are written
        if (leader) {
            const unsigned add = split == 0 ? 0x80000000u - static_cast<unsigned>(count - 1) : 1u;
            // (released: the partial results are visible device-wide before the arrival)
            seen = atomic_add_release_gpu(reinterpret_cast<unsigned*>(counter), add);
        }
    }
    template <class Sync>
    CF2_DEVICE void wait_among(bool leader, const Sync& sync) const {
        if (leader)
            while (((static_cast<unsigned>(load_acquire_gpu(counter)) ^ seen) & 0x80000000u) == 0)
                __nanosleep(32);
        sync();  // every thread reads the others' partial results after the acquire
    }
};

// Keeps a value computed where it stands (an empty asm that claims to change it): work that is
// placed to run while a CTA waits for its peers is not moved after the wait.
template <class T>
CF2_DEVICE void compute_here(T*& x) {
    asm volatile("" : "+l"(x));
}
CF2_DEVICE void compute_here(u32& x) { asm volatile("" : "+r"(x)); }

// The splits' results in L2: split s left row r's normalised output at
// o_parts + (s * BLOCK_M + r) * HEAD_DIM (fp32) and its log-sum-exp in log2 units at
// lse_parts[s * BLOCK_M + r] (-inf: no key seen).
template <int HEAD_DIM, int BLOCK_M>
struct GlobalPartials {
    const float* o_parts;
    const float* lse_parts;

    struct Slot {
        const float* o;
        const float* lse;
    };
    CF2_DEVICE Slot locate(int s, int r, int chunk) const {
        Slot slot{o_parts + (s * BLOCK_M + r) * HEAD_DIM + 4 * chunk, lse_parts + s * BLOCK_M + r};
        compute_here(slot.o);
        compute_here(slot.lse);
        return slot;
    }
    CF2_DEVICE static void load(const Slot& slot, float& lse, float4& o) {
        lse = __ldcg(slot.lse);
        o = __ldcg(reinterpret_cast<const float4*>(slot.o));
    }
};

// The splits of a row block merge its (row, 4-float column chunk) items in equal shares of
// consecutive items: split s merges items [s * share, min(items, (s + 1) * share)) of
// share = ceil(items / splits). merge_splits takes its share by it, and the cluster inboxes'
// slots (ClusterInbox) are laid out by it.
CF2_DEVICE int split_share(int items, int num_splits) {
    return (items + num_splits - 1) / num_splits;
}

// Merges this split's share of the (row, 4-float column chunk) items of a block of `rows` query
// rows, reading every split's result from `partials` once `wait_for_splits()` returns:
//   lse = log2 sum_s 2^lse_s,   out = sum_s 2^(lse_s - lse) O_s.
// An item is merged by LANES lanes of a warp, lane j holding splits SLOTS j .. SLOTS j + SLOTS - 1
// (all of its loads in flight at once); the weighted terms are summed as a pairwise tree over the
// splits in order, padded to a power of two, first inside each lane, then by shuffles: the same
// bits for every LANES x SLOTS that holds the splits (the merge through L2 and the one inside a
// cluster agree). A pass of the CTA takes THREADS / LANES items. The first pass's addresses, and
// where its results go (locate(r, chunk): a callable store(out chunk, lse), run in the item's
// first lane; chunk zero and lse -inf for a row no split saw a key of), are computed before the
// wait: after it come only the loads and a chain of arithmetic that one warp a scheduler runs at
// its latency (a generic merge, with run-time lane counts and its index arithmetic after the
// wait, took 2.3 us of a batch-1 step at 32 splits on the H200).
template <int HEAD_DIM, int THREADS, int LANES, int SLOTS, class Partials, class Locate,
          class Wait>
CF2_DEVICE void merge_splits(const Partials& partials, int num_splits, int split, int rows,
                             int head_dim, int tid, const Locate& locate,
                             const Wait& wait_for_splits) {
    static_assert(THREADS % 32 == 0 && 32 % LANES == 0, "items whole in warps");
    constexpr int ITEMS_PER_PASS = THREADS / LANES;
    constexpr int CHUNKS = HEAD_DIM / 4;  // (chunks past head_dim are left out)
    using Slot = typename Partials::Slot;
    const int lane = tid % LANES;
    const int items = rows * CHUNKS;
    const int share = split_share(items, num_splits);
    const int item_end = min(items, (split + 1) * share);
    // The tree's leaves: the splits padded to a power of two (levels past it would add zeros).
    int width = 1;
    while (width < num_splits) width *= 2;

    int base = split * share;  // the pass's first item, the same in every thread
    auto prepare = [&](int item, Slot (&slots)[SLOTS], bool& active) {
        const int r = item / CHUNKS, chunk = item % CHUNKS;
        active = item < item_end && 4 * chunk < head_dim;
#pragma unroll
        for (int u = 0; u < SLOTS; ++u)  // (a slot past the splits is never read)
            slots[u] = partials.locate(min(SLOTS * lane + u, num_splits - 1), r, chunk);
        return locate(r, chunk);
    };
    Slot slots[SLOTS];
    bool active;
    auto store = prepare(base + tid / LANES, slots, active);
    wait_for_splits();
    // (The loop runs CTA-uniformly: the shuffles need every lane.)
    while (base < item_end) {
        float lse_s[SLOTS];
        float4 o_s[SLOTS];
#pragma unroll
        for (int u = 0; u < SLOTS; ++u) {
            lse_s[u] = neg_inf();
            o_s[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (active && SLOTS * lane + u < num_splits) Partials::load(slots[u], lse_s[u], o_s[u]);
        }
        float m = lse_s[0];
#pragma unroll
        for (int u = 1; u < SLOTS; ++u) m = fmaxf(m, lse_s[u]);
        // (Levels past the tree's width are selected away, not branched around: every lane runs
        // the same straight-line code.)
#pragma unroll
        for (int step = 1; step < LANES; step *= 2) {
            const float other = __shfl_xor_sync(0xffffffffu, m, step);
            if (SLOTS * step < width) m = fmaxf(m, other);
        }
        float w[SLOTS];
#pragma unroll
        for (int u = 0; u < SLOTS; ++u) {
            w[u] = merge_weight(lse_s[u], m);
            o_s[u] = make_float4(fmaf(w[u], o_s[u].x, 0.f), fmaf(w[u], o_s[u].y, 0.f),
                                 fmaf(w[u], o_s[u].z, 0.f), fmaf(w[u], o_s[u].w, 0.f));
        }
        // The tree's levels inside the lane, then across its lanes.
#pragma unroll
        for (int span = 1; span < SLOTS; span *= 2)
#pragma unroll
            for (int u = 0; u < SLOTS; u += 2 * span) {
                const bool level = span < width;
                w[u] = level ? w[u] + w[u + span] : w[u];
                o_s[u] = level ? make_float4(o_s[u].x + o_s[u + span].x, o_s[u].y + o_s[u + span].y,
                                             o_s[u].z + o_s[u + span].z, o_s[u].w + o_s[u + span].w)
                               : o_s[u];
            }
        float sum = w[0];
        float4 acc = o_s[0];
#pragma unroll
        for (int step = 1; step < LANES; step *= 2) {
            const bool level = SLOTS * step < width;
            const float s_other = __shfl_xor_sync(0xffffffffu, sum, step);
            const float4 o_other = make_float4(__shfl_xor_sync(0xffffffffu, acc.x, step),
                                               __shfl_xor_sync(0xffffffffu, acc.y, step),
                                               __shfl_xor_sync(0xffffffffu, acc.z, step),
                                               __shfl_xor_sync(0xffffffffu, acc.w, step));
            sum = level ? sum + s_other : sum;
            acc = level ? make_float4(acc.x + o_other.x, acc.y + o_other.y, acc.z + o_other.z,
                                      acc.w + o_other.w)
                        : acc;
        }
        if (lane == 0 && active) {
            const bool seen = sum > 0.f;
            const float inv = seen ? 1.f / sum : 0.f;
            store(make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
                  seen ? m + __log2f(sum) : neg_inf());
        }
        base += ITEMS_PER_PASS;
        if (base < item_end) store = prepare(base + tid / LANES, slots, active);
    }
}

// The merge of every automatic split count (at most 32, _kvcache.AUTO_MAX_SPLITS): 8 lanes an
// item, four splits a lane (three shuffle levels); larger requested counts take 32 lanes.
constexpr int SMALL_MERGE_SPLITS = 32;
constexpr int SMALL_MERGE_LANES = 8;
constexpr int MERGE_SLOTS = 4;
static_assert(SMALL_MERGE_LANES * MERGE_SLOTS == SMALL_MERGE_SPLITS &&
              32 * MERGE_SLOTS >= MAX_SPLITS, "the merge's lanes hold every split");

// ---- The merge inside a thread-block cluster (sm_90) -----------------------------------------
// Where a row block's splits are one thread-block cluster (at most MAX_CLUSTER_SPLITS CTAs, rank =
// split), each split sends every piece of its normalised result straight into the shared memory
// of the split that merges it (its "inbox"), with st.async: a store into a peer's shared memory
// that counts its bytes on the peer's mbarrier. A split merges its share once its mbarrier has
// counted every split's bytes, from its own shared memory. Between the splits there is one
// one-way trip of the stores: no partial result goes through L2, no atomics, no cooperative
// launch, no barrier across the cluster after the KV loops (one before the first store, that
// the peers' inboxes and mbarriers are ready, passed while a CTA merges its warps), and no fence
// (a barrier's release arrive is a GPU-scope membar in SASS, MEMBAR.ALL.GPU).
// (Before: each split left its result in its own shared memory, a cluster barrier with release
// and acquire, loads from the peers, and a second barrier to keep that memory alive until the
// peers had read it: 0.24 us longer a batch-1 layer at 4k tokens in a CUDA graph, H200.)

// The shared memory of a split's inbox (ClusterInbox, below): an mbarrier (16 bytes with its
// padding), then a 16-byte chunk and a 4-byte lse per slot.
template <int HEAD_DIM, int BLOCK_M>
struct ClusterInboxSize {
    static constexpr int SLOTS = BLOCK_M * (HEAD_DIM / 4) + MAX_CLUSTER_SPLITS;
    static constexpr int BYTES = 16 + SLOTS * (16 + 4);
};

#if __CUDA_ARCH__ >= 900
// The cluster's barrier in two halves, without release: what it orders is the inboxes'
// initialisation (fence.mbarrier_init makes that visible across the cluster). The .aligned forms
// need every lane of the warp at the instruction together: after code with data-dependent
// branches a __syncwarp() says so.
CF2_DEVICE void cluster_arrive_relaxed() {
    __syncwarp();
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
CF2_DEVICE void cluster_wait() {
    __syncwarp();
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// The cluster's barrier with release and acquire (every thread of every CTA of the cluster):
// what each thread did before it, remote arrivals on a peer's mbarriers included, is done for
// every thread after it.
CF2_DEVICE void cluster_sync() {
    __syncwarp();
    asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// This CTA's rank in its cluster.
CF2_DEVICE int cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return static_cast<int>(rank);
}

// The address of this CTA's shared-memory word `local` in the shared memory of cluster rank
// `rank`.
CF2_DEVICE u32 cluster_peer_address(u32 local, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

// Stores into a peer's shared memory (addresses from cluster_peer_address) whose bytes complete
// on the peer's mbarrier `remote_bar`.
CF2_DEVICE void store_async_cluster(u32 address, float4 v, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], "
                 "{%1, %2, %3, %4}, [%5];\n"
                 :: "r"(address), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)),
                    "r"(__float_as_uint(v.z)), "r"(__float_as_uint(v.w)), "r"(remote_bar)
                 : "memory");
}
CF2_DEVICE void store_async_cluster(u32 address, float v, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n"
                 :: "r"(address), "r"(__float_as_uint(v)), "r"(remote_bar) : "memory");
}

// A split's inbox in its shared memory: the mbarrier, then, for each split s and each item
// (row, 4-column chunk) of its share (slot = item - the share's first), that split's chunk at
// o[s * share + slot] and its row's lse at lse[s * share + slot]. SLOTS bounds splits x share
// (share = split_share(items, splits): at most items + splits - 1).
template <int HEAD_DIM, int BLOCK_M>
struct ClusterInbox : ClusterInboxSize<HEAD_DIM, BLOCK_M> {
    using ClusterInboxSize<HEAD_DIM, BLOCK_M>::SLOTS;
    static constexpr int PIECE_BYTES = 16 + 4;  // a split's chunk and its lse
    u32 bar = 0;  // shared-memory addresses in this CTA
    u32 o = 0;
    u32 lse = 0;
    int share = 0;
    int first = 0;  // this split's first item

    ClusterInbox() = default;
    CF2_DEVICE ClusterInbox(u32 base, int items, int num_splits, int split)
        : bar(base), o(base + 16), lse(base + 16 + 16 * SLOTS),
          share(split_share(items, num_splits)), first(split * share) {}

    // This split's items: every split sends each of them, with its lse.
    CF2_DEVICE int items_here(int items) const { return max(0, min(items, first + share) - first); }

    // (thread 0, after the KV loop) The mbarrier, expecting every split's pieces of this share.
    CF2_DEVICE void open(int items, int num_splits) const {
        mbarrier_init(bar, 1);
        mbarrier_arrive_expect_tx(bar, items_here(items) * num_splits * PIECE_BYTES);
        fence_mbarrier_init();
    }

    // Where split `split` sends item `item`: the owner's o and lse slots and its mbarrier.
    struct Destination {
        u32 o, lse, bar;
        CF2_DEVICE void send(float4 chunk, float lse2) const {
            store_async_cluster(o, chunk, bar);
            store_async_cluster(lse, lse2, bar);
        }
    };
    CF2_DEVICE Destination destination(int item, int split) const {
        const int owner = item / share;
        const int slot = split * share + item - owner * share;
        Destination d{cluster_peer_address(o + 16 * slot, owner),
                      cluster_peer_address(lse + 4 * slot, owner),
                      cluster_peer_address(bar, owner)};
        compute_here(d.o);
        compute_here(d.lse);
        compute_here(d.bar);
        return d;
    }

    // merge_splits' view of the inbox (read once the mbarrier's phase 0 has completed).
    struct Slot {
        const float4* o;
        const float* lse;
    };
    CF2_DEVICE Slot locate(int s, int r, int chunk) const {
        const int slot = s * share + r * (HEAD_DIM / 4) + chunk - first;
        return Slot{reinterpret_cast<const float4*>(__cvta_shared_to_generic(o)) + slot,
                    reinterpret_cast<const float*>(__cvta_shared_to_generic(lse)) + slot};
    }
    CF2_DEVICE static void load(const Slot& slot, float& lse, float4& o) {
        lse = *slot.lse;
        o = *slot.o;
    }
};

// 8 lanes an item, two splits a lane.
constexpr int CLUSTER_MERGE_LANES = MAX_CLUSTER_SPLITS / 2;
#endif
