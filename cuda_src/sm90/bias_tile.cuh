// The additive bias as tiles (FEATURE_BIAS_TILE: the Hopper kernels with a bias alone as their
// score modifier, cuflash2/_bias.py). The producer loads the bias's BLOCK_M x BLOCK_N block of
// a step by TMA into the step's ring stage; the consumers add it to the scores from shared
// memory. The forward loads it after K, on barriers of its own (BiasTileRing): its consumers
// give it back once the tile's score step has read it, so that the next load into the stage
// need wait neither for that tile's P V (V's barrier, which carried it at first, kept the load
// of tile j + STAGES behind P_j V_j and every softmax waiting for a load just issued: 1.64x the
// plain forward at 4k, H100) nor stall K; the backward loads it with Q_i, on Q_i's barrier, and
// adds it to S^T (keys as rows: add_transposed). The
// generic path reads the bias score by score from global memory through the 4-D accessor
// (user_inputs.cuh), 64-bit index arithmetic a score, and with it the Hopper forward spilled.
#pragma once
#include "hopper_primitives.cuh"
#include "kernel_params.cuh"
#include "mbarrier.cuh"

// The forward's barriers of the bias tiles' ring (static shared memory), stage s's tile in the
// K/V ring's stage s: full[s] completes with the producer's expect_tx arrival and the TMA's
// bytes, empty[s] once every consumer thread has read the tile.
template <int STAGES_>
struct BiasTileRing {
    static constexpr int STAGES = STAGES_;
    u64 full[STAGES];
    u64 empty[STAGES];
};

// The backward's: none (its bias tiles come on Q_i's barrier).
struct NoBiasTileRing {};

// Without a bias tile: nothing to load or add.
struct NoBiasTile {
    static constexpr bool ON = false;
    CF2_DEVICE bool batch_inner() const { return false; }
    template <int CONSUMER_THREADS>
    CF2_DEVICE void init_ring() const {}
    template <int PANELS, int BYTES>
    CF2_DEVICE void produce(u32, int, int, int, int, int) const {}
    CF2_DEVICE void wait(int) const {}
    CF2_DEVICE void release(int) const {}
    template <int PANELS>
    CF2_DEVICE void load(u32, u32, int, int, int, int) const {}
    template <int N_TILES>
    CF2_DEVICE void add(float (&)[1][N_TILES][4], u32, int, int, float) const {}
    template <int PANEL_BYTES, int S_TILES>
    CF2_DEVICE void add_transposed(float (&)[S_TILES][4], u32, int, int, float) const {}
};

// The bias (Elem, like q) through `map`: its own (batch or 1, heads or 1, seqlen_q, seqlen_k)
// array as (key, row, head, batch), 128-byte swizzle, boxes of 64 keys x BLOCK_M rows; a head or
// batch extent of 1 is a broadcast one (coordinate 0). A tile is PANELS panels of 64 keys,
// PANEL_BYTES apart, each BLOCK_M 128-byte rows (the layout the TMA writes for Q). Rows and keys
// past the array's ends come zero-filled; the mask hides them (the backward: P = 0 on rows past
// seqlen_q, whose lse_log2 is +inf).
// `ring`: the forward's BiasTileRing (Ring; its loads on barriers of their own), none in the
// backward (NoBiasTileRing: on Q_i's).
template <typename Elem, int PANEL_BYTES, class Ring = NoBiasTileRing>
struct BiasTile {
    static constexpr bool ON = true;
    const TensorMap& map;
    int heads;
    int batches;
    Ring* ring = nullptr;

    // A bias broadcast over the batch: the grid runs the CTAs of every batch entry for one
    // (block, head) side by side (grid_work_tile, cta_work), so that they read its tiles at
    // about the same time and the L2 serves them from one read of HBM.
    CF2_DEVICE bool batch_inner() const { return batches == 1; }

    // The forward's ring: thread 0, beside the kernel's init_barriers (before the CTA's first
    // __syncthreads).
    template <int CONSUMER_THREADS>
    CF2_DEVICE void init_ring() const {
#pragma unroll
        for (int s = 0; s < Ring::STAGES; ++s) {
            mbarrier_init(smem_address(&ring->full[s]), 1);
            mbarrier_init(smem_address(&ring->empty[s]), CONSUMER_THREADS);
        }
    }
    // Producer of the forward: ring position `pos`'s tile (stage pos % STAGES, in its
    // (pos / STAGES)-th phase) into `dst` once the consumers gave the stage's last one back.
    template <int PANELS, int BYTES>
    CF2_DEVICE void produce(u32 dst, int pos, int row, int key0, int head, int batch) const {
        const int stage = pos % Ring::STAGES;
        const u32 phase = (pos / Ring::STAGES) & 1;
        mbarrier_wait(smem_address(&ring->empty[stage]), phase ^ 1);
        const u32 full = smem_address(&ring->full[stage]);
        mbarrier_arrive_expect_tx(full, BYTES);
        load<PANELS>(dst, full, row, key0, head, batch);
    }
    // Consumers of the forward: position `pos`'s tile landed; read, given back.
    CF2_DEVICE void wait(int pos) const {
        mbarrier_wait(smem_address(&ring->full[pos % Ring::STAGES]), (pos / Ring::STAGES) & 1);
    }
    CF2_DEVICE void release(int pos) const {
        mbarrier_arrive(smem_address(&ring->empty[pos % Ring::STAGES]));
    }

    // Producer: rows [row, row + BLOCK_M) x keys [key0, key0 + 64 PANELS) of (head, batch) into
    // `dst`, completing on `bar` (whose expected bytes the caller has set).
    template <int PANELS>
    CF2_DEVICE void load(u32 dst, u32 bar, int row, int key0, int head, int batch) const {
        const int h = heads == 1 ? 0 : head;
        const int b = batches == 1 ? 0 : batch;
#pragma unroll
        for (int panel = 0; panel < PANELS; ++panel)
            tma_load_4d(dst + panel * PANEL_BYTES, map, bar,
                        key0 + Sm90CtaLayout::PANEL_COLS * panel, row, h, b);
    }

    // Consumer: S += bias (in the scores' units: `to_units`, 1 / the softmax's scale, as ALiBi's
    // bias) for this thread's accumulator entries: rows row0 and row0 + 8 of the tile, keys
    // 8 nt + 2 (lane % 4) + e. The key pair is one 4-byte word of chunk nt (8 keys, 16 bytes)
    // of its row; the 128-byte swizzle puts the eight rows of a warp's quad-mates in eight
    // different bank groups, so the loads are free of bank conflicts.
    template <int N_TILES>
    CF2_DEVICE void add(float (&s)[1][N_TILES][4], u32 tile, int row0, int lane,
                        float to_units) const {
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 word = static_cast<u32>(load_4B_shared_fresh(
                    swizzled_chunk<PANEL_BYTES>(tile, row0 + 8 * half, nt) + 4 * (lane % 4)));
                s[0][nt][2 * half] += to_float<Elem>(static_cast<u16>(word & 0xffffu)) * to_units;
                s[0][nt][2 * half + 1] += to_float<Elem>(static_cast<u16>(word >> 16)) * to_units;
            }
    }

    // Consumer of the backward: S^T += bias for this thread's entries of the transposed tile
    // (keys as rows: acc[nt][2 half + e] is key key_chunk0 * 8 + lane / 4 + 8 half, query
    // 8 nt + 2 (lane % 4) + e, the layout bwd_scores.cuh's store_ds_transposed writes the dS
    // tile from). The bias tile [queries x keys] has the dS tile's layout (PANEL_BYTES: a panel
    // of 64 keys), so ldmatrix .trans reads it back as store_ds_transposed's stmatrix .trans
    // writes dS: per 16 queries one x4 load, matrix j = keys 8 (j % 2) .. + 7 x queries
    // 8 (j / 2) .. + 7, lane 8 j + c naming query row 8 (j / 2) + c (conflict-free, as there).
    template <int PANEL_BYTES, int S_TILES>
    CF2_DEVICE void add_transposed(float (&acc)[S_TILES][4], u32 tile, int key_chunk0, int lane,
                                   float to_units) const {
        const int j = lane / 8, c = lane % 8;
#pragma unroll
        for (int ks = 0; ks < S_TILES / 2; ++ks) {
            u32 r[4];
            ldmatrix_x4_trans(r, swizzled_chunk<PANEL_BYTES>(tile, 16 * ks + 8 * (j / 2) + c,
                                                             key_chunk0 + j % 2));
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                float (&e)[4] = acc[2 * ks + m / 2];
                e[2 * (m % 2)] += to_float<Elem>(static_cast<u16>(r[m] & 0xffffu)) * to_units;
                e[2 * (m % 2) + 1] += to_float<Elem>(static_cast<u16>(r[m] >> 16)) * to_units;
            }
        }
    }
};

// The bias tiles of a mods kernel (ON: FEATURE_BIAS_TILE; `m`: FwdSm90ModsParams or
// BwdSm90ModsParams, their bias_map, bias_heads and bias_batches), or none. Tiles of BLOCK_M
// rows: panels of BLOCK_M 128-byte rows.
// `ring`: the forward's BiasTileRing (shared memory), none in the backward.
template <bool ON, typename Elem, int BLOCK_M, class Ring = NoBiasTileRing, class ModsParams>
CF2_DEVICE auto mods_bias_tile(const ModsParams& m, Ring* ring = nullptr) {
    if constexpr (ON) {
        return BiasTile<Elem, BLOCK_M * Sm90CtaLayout::ROW_BYTES, Ring>{m.bias_map, m.bias_heads,
                                                                        m.bias_batches, ring};
    } else {
        return NoBiasTile{};
    }
}
