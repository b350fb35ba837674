// The Hopper backward's mbarriers (flash_bwd_sm90.cu): the K / V barrier, the Q / dO ring's
// full and empty barriers, the staged dQ buffers' full and empty barriers, and the word the
// consumers read instead of holding (the block's first key). Static shared memory, beside the
// dynamic tiles of BwdSm90Traits' layout.
#pragma once
#include "hopper_primitives.cuh"

// The mbarriers of the CTA, and the one word it keeps beside them (static shared memory).
template <int STAGES>
struct BwdSm90Barriers {
    u64 kv_full;               // K and V of the block landed
    u64 q_full[STAGES];        // Q_i and lse_log2 of its rows landed
    u64 do_full[STAGES];       // dO_i and D of its rows landed
    u64 stage_empty[STAGES];   // every consumer thread is done with the stage
    u64 dq_full[2];            // every consumer thread staged its dQ of the buffer (DQ_STAGED)
    u64 dq_empty[2];           // the buffer's bulk reduction has read it
    // The block's first key, which the consumers read each step (load_4B_shared_fresh) rather
    // than hold: it comes from the dispatch order's arithmetic (cta_work), which the compiler
    // cannot rematerialise as it did blockIdx.x * BLOCK_N, and held across their loop it spilled
    // (d=64 with ALiBi and dQ by vector reductions: 4 bytes).
    int key_first;
};
