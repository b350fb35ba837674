// The FP8 forward's transpose of V in shared memory (FwdSm90Traits::TRANSPOSE_V, e4m3;
// docs/FP8_FORWARD.md): warps 1 .. TRANSPOSE_WARPS of the producer warpgroup read each KV tile's V
// as the TMA landed it in the raw V ring (rows of keys) and write it into its stage of the K/V
// ring keys-last, in P's key order. FP8 wgmma takes K-major operands only, and P V's B has the
// keys as K: the stage holds VT_PANELS panels (128 keys) of HEAD_DIM_V head-dim rows of 128 key
// bytes, 128-byte swizzle, as issue_pv's descriptors read them (the layout an operand pass wrote
// and the TMA loaded before, but for its head-dim rows' order: transposed_row), and within each
// group of 32 keys position 4t + b of a 16-position half holds key 2t + (b & 1) + 8 (b >> 1) of
// that half, the order in which pack_probabilities_e4m3 packs P. tests/test_fp8_transpose_model.py
// replays every index below in NumPy against that layout.
//
// A step is 32 keys (one group of P's order) by 16 head-dim bytes. ldmatrix.x4.trans on 16-bit
// elements (pairs of head-dim bytes of one key) over the keys' rows: lane l (g = l / 4,
// t = l % 4) gets, of matrix m (keys 8 m .. 8 m + 7 of the group), keys 2t and 2t + 1 of
// head-dim bytes 2g and 2g + 1, four bytes. Of matrices 0 and 1 (keys 0-15) the even bytes
// (__byte_perm 0x6420) are head-dim row 2g's keys 2t, 2t + 1, 8 + 2t, 9 + 2t, the odd ones
// (0x7531) row 2g + 1's: the word of positions 4t .. 4t + 3 of the keys-last row; matrices 2 and 3 give positions 16 + 4t ... stmatrix.x4 (no .trans)
// stores those four words as four 8 x 8 matrices: rows 2g (even bytes) and 2g + 1 (odd bytes)
// of the 16 head-dim rows, 16 positions each.
// Banks: ldmatrix's 8 rows are 8 consecutive keys, one chunk each: 8 slots, conflict-free.
// stmatrix's are 8 even (or odd) head-dim rows, whose rows % 8 in place would take 4 values (2
// rows a slot, 2-way); so head-dim row h of V is stored in row h ^ ((h >> 3) & 1) of the stage
// (`transposed_row`), which makes the 8 rows of a matrix meet 8 slots. P V's column n is then
// O's column n ^ ((n >> 3) & 1), which the mainloop puts back by renaming registers
// (unpermute_o_columns in sm90/fwd_mainloop.cuh).
#pragma once
#include "hopper_primitives.cuh"
#include "sm90/fwd_barriers.cuh"
#include "sm90/fwd_tile_scheduler.cuh"

// The lane's row in the raw tile: key `lane` of a group of 32 (row lane % 8 of ldmatrix's matrix
// lane / 8), chunk 0 in its 128-byte-swizzled slot. A step XORs its chunk in: the tile is
// 1024-byte aligned and the row's own bits lie above bit 6, so the XOR moves the chunk alone.
CF2_DEVICE u32 raw_lane_offset(int lane) {
    return lane * Sm90CtaLayout::ROW_BYTES + ((lane & 7) << 4);
}

// The stage's row of V's head-dim row h: rows 8-15 of every 16 trade places in pairs, so that
// stmatrix's 8 even (or odd) rows of a matrix fall on 8 distinct rows % 8 (above).
CF2_DEVICE int transposed_row(int h) { return h ^ ((h >> 3) & 1); }

// The lane's row in the stage's V tile: row lane % 8 of stmatrix's matrix lane / 8, matrices 0
// and 2 the even head-dim rows (hr = 2 (lane % 8)), 1 and 3 the odd ones (+1), 2 and 3 the
// second 16 positions of the group (chunk lane / 16 of its two), in its swizzled slot of the
// stage's row transposed_row(hr). A step XORs its group's first chunk (even) in.
CF2_DEVICE u32 vt_lane_offset(int lane) {
    const int row = transposed_row(2 * (lane & 7) + ((lane >> 3) & 1));
    return row * Sm90CtaLayout::ROW_BYTES + ((((lane >> 4) ^ row) & 7) << 4);
}

// Unit u of a tile: head-dim chunk c = u / VT_PANELS (16 bytes), VT panel p = u % VT_PANELS
// (keys 128 p ..): four steps, key groups kg = 4 p + i, whose addresses differ by constants
// (the raw tile's rows by 32 keys, the stage's chunk pair by an XOR of 2 i). Raw: panel c / 8
// of 128 head-dim bytes, rows 128 p + 32 i .., chunk c % 8. Stage: VT panel p, head-dim rows
// 16 c .., chunks 2 i and 2 i + 1 of those rows. `raw_lane`, `vt_lane`: the raw tile's and
// the stage's V tile's addresses (1024-byte aligned) plus the lane's offsets, so that the
// chunks' XORs (bits 4-6) fall on the lane's offset alone. A tile whose keys end inside their
// last panel (T::VT_TAIL_GROUPS groups there) stops that panel's units after as many steps:
// the raw tile has no rows past BLOCK_N, and P V reads no keys past it.
template <class T>
CF2_DEVICE void transpose_unit(u32 raw_lane, u32 vt_lane, u32 u) {
    const u32 c = u / T::VT_PANELS, p = u % T::VT_PANELS;
    const u32 raw = ((raw_lane + (c / 8) * T::KV_PANEL_BYTES) ^ ((c % 8) << 4)) +
                    p * 128 * T::ROW_BYTES;
    const u32 vt = vt_lane + p * T::VT_PANEL_BYTES + c * 16 * T::ROW_BYTES;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (T::VT_TAIL_GROUPS != 0) {
            if (i >= T::VT_TAIL_GROUPS && p == T::VT_PANELS - 1) break;
        }
        u32 d[4];
        ldmatrix_x4_trans(d, raw + i * 32 * T::ROW_BYTES);
        const u32 w[4] = {__byte_perm(d[0], d[1], 0x6420), __byte_perm(d[0], d[1], 0x7531),
                          __byte_perm(d[2], d[3], 0x6420), __byte_perm(d[2], d[3], 0x7531)};
        stmatrix_x4(vt ^ ((2 * i) << 4), w);
    }
}

// The transposers' share of one work tile (warp `warp` of 0 .. TRANSPOSE_WARPS - 1): the j-th
// KV tile visited takes ring position ring0 + j, as the producer's and the consumers' loops
// (produce_tile, consume_kv_tiles), and raw buffer (ring0 + j) % RAW_V_STAGES. Per tile: wait
// for its raw V (raw_v_full) and for the consumers to give the stage's previous V back
// (v_empty with OVERLAP, else kv_empty: the stage's K and V together), the warp's units, then
// fence.proxy.async (the wgmmas read the stage through the async proxy; each thread orders its
// own stores), __syncwarp (the warp's stores and raw reads before its lane 0's arrivals, which
// release them) and one arrival of the warp on v_full (the consumers' wait) and raw_v_empty
// (thread 0's next load into the buffer). The producer's 24 registers hold it: per-thread
// state is the two lane addresses, the ring position and its end.
template <class T, bool OVERLAP, class Bars>
CF2_DEVICE void transpose_v_tiles(const FwdTileContext& c, int ring0, u32 kv_smem, Bars& bars,
                                  int warp, int lane) {
    constexpr int STAGES = T::KV_STAGES;
    constexpr int RAW_V_STAGES = T::RAW_V_STAGES;
    const u32 raw_lanes = kv_smem + T::RAW_V_OFFSET + raw_lane_offset(lane);
    const u32 vt_lanes = kv_smem + T::V_OFFSET + vt_lane_offset(lane);
    const int ring_end = ring0 + c.span.tile_end - c.span.tile_first;
    for (int ring = ring0; ring < ring_end; ++ring) {
        const int stage = ring % STAGES;
        const int raw = ring % RAW_V_STAGES;
        mbarrier_wait(smem_address(&bars.raw_v_full[raw]), (ring / RAW_V_STAGES) & 1);
        const u32 phase = (ring / STAGES) & 1;
        if constexpr (OVERLAP)
            mbarrier_wait(smem_address(&bars.v_empty[stage]), phase ^ 1);
        else
            mbarrier_wait(smem_address(&bars.kv_empty[stage]), phase ^ 1);
        const u32 raw_lane = raw_lanes + raw * T::RAW_V_TILE_BYTES;
        const u32 vt_lane = vt_lanes + stage * T::STAGE_BYTES;
#pragma unroll 1
        for (u32 u = warp; u < T::TRANSPOSE_UNITS; u += T::TRANSPOSE_WARPS)
            transpose_unit<T>(raw_lane, vt_lane, u);
        fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) {
            mbarrier_arrive(smem_address(&bars.v_full[stage]));
            mbarrier_arrive(smem_address(&bars.raw_v_empty[raw]));
        }
    }
}
