// The MLA decode kernel's producer (flash_mla_decode_sm90.cu, warpgroup 0, thread 0): the TMA
// loads of a split's cache tiles into the ring the consumers (sm90/mla_mainloop.cuh) read.
#pragma once
#include "hopper_primitives.cuh"
#include "kv_cache.cuh"
#include "sm90/mla_traits.cuh"

// Tiles [tile_first, tile_end) of one sequence, the j-th into stage j % STAGES. A tile is all
// HEAD_DIM columns of BLOCK_N positions, PANELS boxes of 64 columns: one box a panel from a
// contiguous cache (its row `cache_row`, the map's last coordinate) or from pages of a multiple
// of BLOCK_N positions, BLOCK_N / box_rows boxes a panel from shorter pages (box_rows their size,
// a multiple of 8: each box starts on a 1024-byte swizzle atom). A box whose page lies outside
// the block table or the cache (a bad block id) is given a block coordinate past the cache's
// blocks, which the TMA zero-fills, still counting its bytes; so is an invalid cache row. The
// positions from the sequence's cache length on (new tokens, rows past its end) the consumers
// write in place before reading the tile.
// PAIRED: this CTA and the other of its cluster (`rank` 0 or 1) read the same tiles; each
// loads its half of a tile's panels (rank 0 the first (PANELS + 1) / 2, rank 1 the rest) into
// both CTAs' stage (TMA multicast), so every tile crosses L2 once. A stage is loaded once the
// consumers of both CTAs gave it back (empty[s] counts both, sm90/mla_traits.cuh), and each CTA's
// full[s] expects the whole tile's bytes, its half from each producer.
template <class T, bool PAIRED = false>
CF2_DEVICE void produce_latent_tiles(const MlaDecodeParams& params, const KVCacheIndex& index,
                                     int cache_row, int tile_first, int tile_end, u32 kv_smem,
                                     MlaDecodeBarriers<T::STAGES>& bars, int rank = 0) {
    const DecodeParams& p = params.base;
    const int outside = p.num_blocks;  // a block coordinate past the cache's
    constexpr int HALF = (T::PANELS + 1) / 2;
    // The box at row `row` of `block` (the map's last coordinate), at `dst`. (PAIRED: the panel
    // ranges fixed at compile time; computed, they cost the 24-register producer a spill.)
    auto load = [&](u32 dst, u32 full, int row, int block) {
        if constexpr (PAIRED) {
            if (rank == 0)
                tma_load_panels_multicast<0, HALF, T::PANEL_BYTES>(dst, params.kv_map, full,
                                                                   row, 0, block, 0b11);
            else
                tma_load_panels_multicast<HALF, T::PANELS, T::PANEL_BYTES>(
                    dst, params.kv_map, full, row, 0, block, 0b11);
        } else {
            tma_load_tile<T::PANELS, T::PANEL_BYTES>(dst, params.kv_map, full, row, 0, block);
        }
    };
    for (int tile = tile_first, j = 0; tile < tile_end; ++tile, ++j) {
        const int stage = j % T::STAGES;
        const u32 phase = (j / T::STAGES) & 1;
        // (a fresh barrier passes parity 1 at once: the first pass over the ring)
        // (PAIRED: the other CTA's consumers arrive too; acquire at cluster scope)
        if constexpr (PAIRED)
            mbarrier_wait_cluster(smem_address(&bars.empty[stage]), phase ^ 1);
        else
            mbarrier_wait(smem_address(&bars.empty[stage]), phase ^ 1);
        const u32 full = smem_address(&bars.full[stage]);
        const u32 dst = kv_smem + stage * T::TILE_BYTES;
        const int key0 = tile * T::BLOCK_N;
        mbarrier_arrive_expect_tx(full, T::TILE_BYTES);
        if (index.block_table == nullptr) {
            load(dst, full, key0, index.valid ? cache_row : outside);
        } else {
            for (int r = 0; r < T::BLOCK_N; r += params.box_rows) {
                int block = outside, row = 0;
                const int position = key0 + r;
                if (position >= p.capacity || !index.locate(position, block, row)) {
                    block = outside;
                    row = 0;
                }
                load(dst + r * T::ROW_BYTES, full, row, block);
            }
        }
    }
}
