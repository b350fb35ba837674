// mbarriers (sm_90): the Hopper kernels' TMA and warp-specialised rings (hopper_primitives.cuh),
// and the decode kernel's merge inside a cluster (split_merge.cuh), whose peers' stores land
// on them.
#pragma once
#include "mma_primitives.cuh"

// ---- mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier") ----
// A 64-bit shared-memory object counting arrivals and, for TMA, transaction bytes. A phase
// completes when its expected arrivals have arrived and its expected bytes have landed; phase k
// completes with parity k & 1, and a waiter names the parity it waits for.

// `count` arrivals complete a phase.
CF2_DEVICE void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the TMA unit completes them);
// issued once by the initialising thread, before the CTA-wide barrier that publishes them
// ("Memory Consistency Model: proxies"; fence.mbarrier_init).
CF2_DEVICE void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also raises the bytes the current phase waits for by `bytes`: the producer's
// announcement of a TMA load (the load's complete_tx then counts the bytes down).
CF2_DEVICE void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

CF2_DEVICE void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// An arrival on an mbarrier of a peer CTA of the cluster (`remote`: a shared::cluster address,
// mapa's), releasing this thread's earlier accesses at cluster scope.
CF2_DEVICE void mbarrier_arrive_cluster(u32 remote) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote)
                 : "memory");
}

// Whether the phase of parity `parity` has completed (try_wait may also suspend the thread for
// a while, which is why a loop over it is cheaper than one over test_wait).
CF2_DEVICE bool mbarrier_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits for the phase of parity `parity` (spin_until: C++ loops, no PTX labels, so this inlines
// any number of times). A freshly initialised barrier is in phase 0, so a wait for parity 1
// passes at once: a producer's first wait on an empty slot uses that.
CF2_DEVICE void mbarrier_wait(u32 bar, u32 parity) {
    spin_until([&] { return mbarrier_try_wait(bar, parity); });
}

// mbarrier_try_wait with acquire at cluster scope: where the phase has completed, what the
// cluster's peers stored and counted on the barrier (st.async) is visible after.
CF2_DEVICE bool mbarrier_try_wait_cluster(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

// Waits for the phase of parity `parity` of this CTA's mbarrier, with acquire at cluster scope:
// the peers' stores counted on it are visible after.
CF2_DEVICE void mbarrier_wait_cluster(u32 bar, u32 parity) {
    spin_until([&] { return mbarrier_try_wait_cluster(bar, parity); });
}
