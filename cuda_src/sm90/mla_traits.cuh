// The MLA decode kernel's compile-time shape (flash_mla_decode_sm90.cu; docs/MLA_DECODE.md):
// DeepSeek-V3's latent cache, a row of HEAD_DIM = 576 columns per token that is K, its first
// HEAD_DIM_V = 512 columns V, one KV head shared by every query head.
#pragma once
#include "hopper_primitives.cuh"

template <typename Elem>
struct MlaDecodeTraits : Sm90CtaLayout {
    static_assert(!Elem::IS_F32 && !Elem::IS_E4M3, "a 16-bit latent cache (fp16 / bf16)");
    static constexpr int HEAD_DIM = 576;
    static constexpr int HEAD_DIM_V = 512;
    // A CTA's query rows: 64 packed rows (query token x head, as the decode kernel packs them;
    // the heads of one KV head), one m64 wgmma tile. Each consumer warpgroup computes S = Q K^T
    // on them for half of a tile's keys, and keeps half of O's columns (64 x 512 fp32 would be
    // 256 registers a thread in one warpgroup).
    static constexpr int BLOCK_M = 64;
    static constexpr int BLOCK_N = 64;  // keys a cache tile: the page of FlashMLA's paged cache
    static constexpr int STAGES = 2;    // Q (72 KiB) and two tiles (72 KiB each): 216 KiB
    static constexpr int CONSUMER_WARPGROUPS = 2;
    static constexpr int CONSUMER_THREADS = CONSUMER_WARPGROUPS * WARPGROUP_THREADS;
    static constexpr int THREADS = WARPGROUP_THREADS + CONSUMER_THREADS;
    static constexpr int ENTRY_REGISTERS = entry_registers(THREADS);
    static constexpr int CONSUMER_REGISTERS = consumer_registers(CONSUMER_WARPGROUPS);
    // Q and a cache tile in 128-byte-swizzled panels of 64 columns (the TMA's layout): 9 panels
    // of K's columns, V's the first 8. A consumer's half of O: V_PANELS_EACH panels, N = DIM_V_EACH.
    static constexpr int PANELS = HEAD_DIM / PANEL_COLS;
    static constexpr int V_PANELS = HEAD_DIM_V / PANEL_COLS;
    static constexpr int V_PANELS_EACH = V_PANELS / CONSUMER_WARPGROUPS;
    static constexpr int DIM_V_EACH = HEAD_DIM_V / CONSUMER_WARPGROUPS;
    static constexpr int PANEL_BYTES = BLOCK_M * ROW_BYTES;  // Q's and a tile's (BLOCK_N rows)
    static constexpr int Q_BYTES = PANELS * PANEL_BYTES;
    static constexpr int TILE_BYTES = PANELS * PANEL_BYTES;
    // Each consumer's scores and probabilities: KEYS_EACH of a tile's keys. P of the whole tile
    // (BLOCK_M rows of BLOCK_N 16-bit keys: one panel, the K-major A operand of both consumers'
    // P V) and the consumers' row maxima of the tile (MAXIMA_BYTES) after the ring.
    static constexpr int KEYS_EACH = BLOCK_N / CONSUMER_WARPGROUPS;
    static constexpr int P_OFFSET = Q_BYTES + STAGES * TILE_BYTES;  // from the aligned base
    static constexpr int P_BYTES = BLOCK_M * ROW_BYTES;
    static constexpr int MAXIMA_OFFSET = P_OFFSET + P_BYTES;
    static constexpr int MAXIMA_BYTES = CONSUMER_WARPGROUPS * BLOCK_M * 4;
    static constexpr int SMEM_BYTES = MAXIMA_OFFSET + MAXIMA_BYTES + SMEM_ALIGN;
    static constexpr int CHUNKS = HEAD_DIM / 8;       // 16-byte chunks of a latent row
    static constexpr int N_TILES = KEYS_EACH / 8;     // n8 column groups of a consumer's S
    static constexpr int D_TILES = DIM_V_EACH / 8;    // n8 column groups of a consumer's O
    static constexpr int QK_STEPS = HEAD_DIM / 16;    // k16 steps of Q K^T
    static constexpr int PV_STEPS = BLOCK_N / 16;     // k16 steps of P V
    // Named barriers (0 is __syncthreads): the consumers together (Q landed, a tile's rows
    // written in place, the split barrier's two halves).
    static constexpr int CONSUMERS_BARRIER = 1;

    static_assert(HEAD_DIM % PANEL_COLS == 0 && HEAD_DIM_V % (PANEL_COLS * CONSUMER_WARPGROUPS) == 0,
                  "whole panels, split evenly between the consumers");
    static_assert(DIM_V_EACH <= 256, "wgmma N of P V at most 256");
    static_assert(BLOCK_N * 2 == ROW_BYTES && KEYS_EACH % 16 == 0,
                  "P of a tile is one panel; a consumer's keys whole k16 slices");
    // A consumer's n32 S starts KEYS_EACH rows into the tile's panels: whole swizzle atoms.
    static_assert(KEYS_EACH * ROW_BYTES % 1024 == 0, "S's B operand on a swizzle atom");
    static_assert(PANEL_BYTES % 1024 == 0, "whole swizzle atoms");
    // setmaxnreg.inc takes registers from what the CTA holds at entry (ENTRY_REGISTERS a
    // thread), not the register file: a split asking more waits forever.
    static_assert(split_fits(CONSUMER_THREADS, CONSUMER_REGISTERS) &&
                      PRODUCER_REGISTERS * WARPGROUP_THREADS +
                              CONSUMER_REGISTERS * CONSUMER_THREADS <=
                          ENTRY_REGISTERS * THREADS,
                  "the setmaxnreg split fits the registers the CTA has at entry");
    static_assert(SMEM_BYTES <= 227 * 1024, "one CTA an SM");
};

// The mbarriers of the cache-tile ring (static shared memory): full[s] completes with the
// producer's arrive.expect_tx and the tile's bytes, empty[s] with every consumer thread's
// arrival once its wgmmas on the stage returned.
template <int STAGES>
struct MlaDecodeBarriers {
    u64 full[STAGES];
    u64 empty[STAGES];
};

// PAIRED (the two CTAs of a cluster share every tile, flash_mla_decode_sm90.cu): a CTA's
// producer writes a stage of both, so its empty[s] also counts the other CTA's consumers.
template <class T, bool PAIRED = false>
CF2_DEVICE void init_mla_barriers(MlaDecodeBarriers<T::STAGES>& bars) {
#pragma unroll
    for (int s = 0; s < T::STAGES; ++s) {
        mbarrier_init(smem_address(&bars.full[s]), 1);
        mbarrier_init(smem_address(&bars.empty[s]), (PAIRED ? 2 : 1) * T::CONSUMER_THREADS);
    }
    fence_mbarrier_init();
}
