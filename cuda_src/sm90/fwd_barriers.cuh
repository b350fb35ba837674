// The Hopper forward's mbarriers (flash_fwd_sm90.cu): the K/V ring between the producer
// (sm90/fwd_producer.cuh) and the consumers (sm90/fwd_mainloop.cuh), Q's, and the slots of the
// claimed work tiles (sm90/fwd_tile_scheduler.cuh, WorkTileClaims); init_barriers sets their
// arrival counts.
#pragma once
#include "mbarrier.cuh"
#include "constants.cuh"

// The mbarriers of the CTA (static shared memory, 8-byte aligned). Each flag adds its own
// barriers after those of the layers below it (derived structs), so that a specialisation
// without either flag keeps the layout of the first struct, one with OVERLAP alone adds v_empty
// right after kv_empty and one with PERSISTENT alone q_empty right after kv_empty.
template <int STAGES>
struct FwdSm90RingBarriers {
    u64 q_full;             // the Q tile landed
    u64 k_full[STAGES];     // K tile of the stage landed
    u64 v_full[STAGES];     // V tile of the stage landed
    u64 kv_empty[STAGES];   // every consumer is done with the stage's K (and V, unless
                            // V_EMPTY)
};

// V_EMPTY (with OVERLAP): K and V of a stage are given back separately. The overlapping schedule
// reads K_j at S_j and V_j one GEMM later (in the next iteration), so it gives K back as soon as
// S_j completed (kv_empty) and V after P_j V_j (v_empty): the producer's next K load into the
// stage then need not wait for the P V of the tile before it.
template <int STAGES, bool V_EMPTY>
struct FwdSm90KvBarriers : FwdSm90RingBarriers<STAGES> {};
template <int STAGES>
struct FwdSm90KvBarriers<STAGES, true> : FwdSm90RingBarriers<STAGES> {
    u64 v_empty[STAGES];    // every consumer is done with the stage's V
};

// Q_EMPTY (with PERSISTENT): the persistent grid reloads Q: one more barrier.
template <int STAGES, bool V_EMPTY, bool Q_EMPTY>
struct FwdSm90Barriers : FwdSm90KvBarriers<STAGES, V_EMPTY> {};
template <int STAGES, bool V_EMPTY>
struct FwdSm90Barriers<STAGES, V_EMPTY, true> : FwdSm90KvBarriers<STAGES, V_EMPTY> {
    u64 q_empty;  // every consumer is done reading Q (its last S GEMM of the tile)
};

// CLAIMS (persistent, tiles claimed dynamically): the claimed work tiles (WorkTileClaims), the
// CTA's k-th (k >= 1) in slot (k - 1) % CLAIM_SLOTS, full once the claimer put it there.
template <int STAGES, bool V_EMPTY, bool Q_EMPTY, bool CLAIMS>
struct FwdSm90ClaimBarriers : FwdSm90Barriers<STAGES, V_EMPTY, Q_EMPTY> {};
template <int STAGES, bool V_EMPTY>
struct FwdSm90ClaimBarriers<STAGES, V_EMPTY, true, true> : FwdSm90Barriers<STAGES, V_EMPTY, true> {
    static constexpr int CLAIM_SLOTS = 4;
    u64 claim_full[CLAIM_SLOTS];
    int claimed[CLAIM_SLOTS];
};

// The arrivals that give a stage (or Q) back (FwdSm90Traits::RELEASE_ARRIVALS): one a consumer
// thread, or with WARP_RELEASES (the FP8 forward) one a consumer warp, from its lane 0 once the
// warp's wgmma wait returned (fwd_mainloop.cuh's release lambdas; a wgmma is one operation of
// its warpgroup, so a warp past its wait has the whole GEMM's reads behind it).

// RAW_V_STAGES (FwdSm90Traits::TRANSPOSE_V, e4m3): the raw V ring between thread 0's TMA loads
// of V as it lies and the transposers (sm90/fwd_transpose_v.cuh), after every other barrier.
// v_full[stage] then completes with the transposers' arrivals (one a warp, no bytes): they write
// the stage's V tile, the TMA does not.
template <int STAGES, bool V_EMPTY, bool Q_EMPTY, bool CLAIMS, int RAW_V_STAGES,
          bool RAW_V = (RAW_V_STAGES > 0)>
struct FwdSm90KernelBarriers : FwdSm90ClaimBarriers<STAGES, V_EMPTY, Q_EMPTY, CLAIMS> {};
template <int STAGES, bool V_EMPTY, bool Q_EMPTY, bool CLAIMS, int RAW_V_STAGES>
struct FwdSm90KernelBarriers<STAGES, V_EMPTY, Q_EMPTY, CLAIMS, RAW_V_STAGES, true>
    : FwdSm90ClaimBarriers<STAGES, V_EMPTY, Q_EMPTY, CLAIMS> {
    u64 raw_v_full[RAW_V_STAGES];   // the raw V tile of the buffer landed (thread 0's expect_tx)
    u64 raw_v_empty[RAW_V_STAGES];  // every transposer warp is done reading the buffer
};

// Arrival counts (thread 0, before the CTA's first __syncthreads): a full barrier completes with
// its one producer's arrive.expect_tx (or the claimer's put; with the raw V ring, v_full with one
// arrival of each transposer warp), an empty one with its RELEASES arrivals
// (every consumer thread's, or warp's; the raw V ring's once every transposer warp has).
template <int RELEASES, int STAGES, bool V_EMPTY, bool Q_EMPTY, bool CLAIMS, int RAW_V_STAGES>
CF2_DEVICE void init_barriers(
    FwdSm90KernelBarriers<STAGES, V_EMPTY, Q_EMPTY, CLAIMS, RAW_V_STAGES>& bars) {
    constexpr u32 V_FULL_ARRIVALS = RAW_V_STAGES > 0 ? SM90_TRANSPOSE_V_WARPS : 1;
    mbarrier_init(smem_address(&bars.q_full), 1);
    if constexpr (Q_EMPTY) mbarrier_init(smem_address(&bars.q_empty), RELEASES);
    if constexpr (CLAIMS) {
        for (int s = 0; s < bars.CLAIM_SLOTS; ++s)
            mbarrier_init(smem_address(&bars.claim_full[s]), 1);  // the claimer's put
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        mbarrier_init(smem_address(&bars.k_full[s]), 1);  // the producer's expect_tx arrival
        mbarrier_init(smem_address(&bars.v_full[s]), V_FULL_ARRIVALS);
        mbarrier_init(smem_address(&bars.kv_empty[s]), RELEASES);
        if constexpr (V_EMPTY) mbarrier_init(smem_address(&bars.v_empty[s]), RELEASES);
    }
    if constexpr (RAW_V_STAGES > 0) {
#pragma unroll
        for (int s = 0; s < RAW_V_STAGES; ++s) {
            mbarrier_init(smem_address(&bars.raw_v_full[s]), 1);
            mbarrier_init(smem_address(&bars.raw_v_empty[s]), SM90_TRANSPOSE_V_WARPS);
        }
    }
    fence_mbarrier_init();
}
