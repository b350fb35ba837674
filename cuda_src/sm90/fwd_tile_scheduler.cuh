// The Hopper forward's tile scheduler (flash_fwd_sm90.cu): which work tiles (BLOCK_M query rows
// of one (batch, head)) a CTA runs and in what order, and what both roles derive from one
// (FwdTileContext: its rows, the KV tiles they see, where its output goes).
//  - One tile per CTA: grid_work_tile (the CTA's own tile; the kernel derives its context).
//  - Persistent: PersistentTiles (the order), taken statically (every gridDim.x-th) or claimed
//    one by one (WorkTileClaims).
// FwdTileScheduler::for_each walks a CTA's work tiles for one role: the producer runs
// produce_tile (sm90/fwd_producer.cuh) on each, the consumers the mainloop and the epilogue
// (sm90/fwd_mainloop.cuh, sm90/fwd_epilogue.cuh); both walk the same tiles in the same order, so
// their ring positions agree.
#pragma once
#include "hopper_primitives.cuh"
#include "masking.cuh"
#include "kernel_params.cuh"
#include "varlen.cuh"
#include "block_mask.cuh"

// One unit of work: BLOCK_M query rows (block m_block) of one (batch, head).
struct FwdWorkTile {
    int m_block;
    int head;
    int batch;
};

// The query rows of a work tile and the KV tiles they see: [tile_first, tile_end), visited from
// the last one down. Empty when no row sees any key.
struct FwdTileSpan {
    int row_first, row_last;  // row_last clipped to the sequence
    int tile_first, tile_end;
    CF2_DEVICE bool empty() const { return tile_end <= tile_first; }
};

// What both roles derive from a work tile: its rows and KV tiles, the K/V head, and where its
// output rows start (tile_context; the one-tile-per-CTA kernel spells it out in its prologue).
struct FwdTileContext {
    FwdWorkTile w;
    int kv_head;
    FwdTileSpan span;
    u16* o_block;      // O row row_first of (batch, head)
    float* lse_block;  // lse entry row_first of (batch, head)
    // Varlen (FEATURE_VARLEN) only: the sequence's rows in the packed q / k arrays (varlen.cuh);
    // span's rows and keys count from their starts. Unused (and left 0) by dense batches.
    SequenceRows seq_q = {0, 0};
    SequenceRows seq_k = {0, 0};
};

// The sequence lengths a work tile's rows and keys are checked against: the dense seqlen_q /
// seqlen_k, or (VARLEN) those of the tile's own sequence.
template <bool VARLEN>
CF2_DEVICE int tile_seqlen_q(const FwdParams& p, const FwdTileContext& c) {
    if constexpr (VARLEN) return c.seq_q.length;
    return p.seqlen_q;
}
template <bool VARLEN>
CF2_DEVICE int tile_seqlen_k(const FwdParams& p, const FwdTileContext& c) {
    if constexpr (VARLEN) return c.seq_k.length;
    return p.seqlen_k;
}

// Which keys a query row sees (masking.cuh).
CF2_DEVICE KeyVisibility key_visibility(const FwdParams& p) {
    return {p.seqlen_k - p.seqlen_q, p.window_left, p.window_right, p.seqlen_k};
}

// The same for one sequence of a varlen batch (VARLEN), or of a dense batch.
template <bool VARLEN>
CF2_DEVICE KeyVisibility key_visibility(const FwdParams& p, const SequenceRows& seq_q,
                                        const SequenceRows& seq_k) {
    if constexpr (VARLEN)
        return {seq_k.length - seq_q.length, p.window_left, p.window_right, seq_k.length};
    return key_visibility(p);
}

template <int BLOCK_M, int BLOCK_N>
CF2_DEVICE FwdTileContext tile_context(const FwdParams& p, const FwdWorkTile& w) {
    const int kv_head = w.head / p.heads_per_kv_head;
    const int row_first = w.m_block * BLOCK_M;
    const int row_last = min(row_first + BLOCK_M, p.seqlen_q) - 1;
    const KeyVisibility vis = key_visibility(p);
    int tile_first, tile_end;
    vis.tile_range(row_first, row_last, BLOCK_N, tile_first, tile_end);
    u16* o_block = p.out + w.batch * p.o_batch_stride + w.head * p.o_head_stride +
                   row_first * p.o_row_stride;
    float* lse_block =
        p.lse + (static_cast<i64>(w.batch) * p.nheads + w.head) * p.seqlen_q + row_first;
    return {w, kv_head, {row_first, row_last, tile_first, tile_end}, o_block, lse_block};
}

// The work tile of a CTA of the one-tile-per-CTA grid (m blocks, heads, batch). With an upper
// limit on keys (causal), later Q blocks see more keys: start those first so that the long CTAs
// do not form the tail of the grid.
// `late_rows_first`: the last m blocks first without a key limit too (a block mask's order,
// BlockMaskNarrow::LATE_ROWS_FIRST).
// `batch_inner`: the CTAs in the order (batch entry fastest, m block, head), the grid's
// dimensions kept: every batch entry's CTA of one (m block, head) side by side, for a bias
// broadcast over the batch (BiasTile::batch_inner).
CF2_DEVICE FwdWorkTile grid_work_tile(const FwdParams& p, bool late_rows_first = false,
                                      bool batch_inner = false) {
    if (batch_inner) {
        const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        const unsigned x = cta / gridDim.z % gridDim.x;
        const unsigned m_block = p.window_right >= 0 || late_rows_first ? gridDim.x - 1 - x : x;
        return {static_cast<int>(m_block), static_cast<int>(cta / gridDim.z / gridDim.x),
                static_cast<int>(cta % gridDim.z + p.batch_offset)};
    }
    const int m_block =
        p.window_right >= 0 || late_rows_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    return {m_block, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z + p.batch_offset)};
}

// The work tiles of the persistent grid in the order its CTAs take them: CTA b takes tiles b,
// b + gridDim.x, b + 2 gridDim.x, ... (a static schedule). The (batch, head) pairs, numbered
// batch * nheads + head (the heads of one K/V head side by side), are cut into sections of
// section_pairs; a section's tiles come m block by m block, every pair of the section inside an m
// block. Under an upper limit on keys (causal) the m blocks run from the last: the longest tiles
// first, the short ones fill the tail; the host sizes the sections to fit L2 (FlashAttention-3's
// L2 swizzle), so that the later m blocks find the section's K/V there. Without one, and with
// one at d=96/128, the host gives sections of one pair (_dispatch.persistent_schedule): the order
// is pair by pair, a pair's m blocks side by side, and the CTAs running at one time share each
// K/V tile's read from DRAM; under a key limit each pair's m blocks then start from a different
// one (rotated by the pair), else a grid of a multiple of m_blocks CTAs would give each CTA the
// same m block, long or short, every round. A 1-D index over every batch: no grid dimension
// limits the batch.
struct PersistentTiles {
    int m_blocks;
    int pairs;          // batch * nheads
    int section_pairs;  // 1 .. pairs
    int nheads;
    int batch_offset;
    bool longest_first;

    CF2_DEVICE int count() const { return m_blocks * pairs; }

    CF2_DEVICE FwdWorkTile operator[](int t) const {
        const int section_tiles = section_pairs * m_blocks;
        const int section = t / section_tiles;
        const int first_pair = section * section_pairs;
        const int width = min(section_pairs, pairs - first_pair);  // the last section: the rest
        const int in_section = t - section * section_tiles;
        int m = in_section / width;
        const int pair = first_pair + in_section - m * width;
        // Sections of one pair under a key limit: each pair's m blocks from a different one.
        if (longest_first && width == 1) m = (m + pair) % m_blocks;
        const int batch = pair / nheads;
        return {longest_first ? m_blocks - 1 - m : m, pair - batch * nheads, batch + batch_offset};
    }
};

// Which work tiles a CTA of the persistent grid takes, one after the other (its k-th, k = 0,
// 1, ...): first its own, blockIdx.x, then
//  - static (the kernel without CLAIMS): every gridDim.x-th, blockIdx.x + gridDim.x, ...;
//  - dynamic (CLAIMS, this struct): the next tile nobody has claimed yet, gridDim.x + a ticket
//    of counters[0] (one atomic a tile). A CTA whose tiles were short takes more, so the order's
//    tiles (the longest first under a key limit) spread evenly however long each is;
//    statically the CTAs of a causal call, whose tiles are 1 to m_blocks KV tiles long, end
//    3-45% apart. (A specialisation of its own: the claims' code in the static kernel's loop
//    cost its short rows 1-2%.)
// The dynamic claims are made by one consumer thread (`claimer`), not by the producer: an
// atomic with a return value anywhere in the producer warpgroup's 24 registers spills (48
// bytes at d=128). The claimer claims the k-th tile at the start of its own work tile k - LEAD
// and puts it in slot (k - 1) % CLAIM_SLOTS at that tile's end, the atomic's round trip under
// the tile's work; the first LEAD - 1 are claimed before its loop. The producer needs the k-th
// tile once it has issued tile k - 1's loads, which is never before the consumers work on tile
// k - 2 (Q is loaded once a tile, after their last S GEMM of the tile before). Every role reads
// the k-th tile from its slot once it is full (claim_full). A slot is written again SLOTS tiles
// later, at the end of the claimer's tile k + SLOTS - LEAD >= k + 1: that tile's Q was loaded
// once every consumer thread (warp: WARP_RELEASES) was done with tile k's S GEMMs, after the
// producer had read tile k + 1, so every role has read tile k by then. That holds where every
// work tile loads a Q: tiles that see no key would let the consumers run ahead of a lagging
// reader without a barrier, so the host claims dynamically only where every query row sees a key
// (_dispatch.dynamic_schedule).
// counters[1] counts the CTAs that ran out of tiles; the last one resets both counters for the
// next launch (launches on one stream run one after the other, and the host gives each stream
// its own pair: FwdSm90Params.tile_counters, never null for these launches).
template <bool VALUE>
struct CompileTimeFlag {
    static constexpr bool value = VALUE;
};

template <class Bars>
struct WorkTileClaims {
    static constexpr int LEAD = 3;
    static constexpr int SLOTS = Bars::CLAIM_SLOTS;
    static_assert(SLOTS > LEAD, "a slot is written again once every role has read it");
    int* counters;
    int count;  // work tiles in all
    Bars& bars;

    // The k-th work tile (k >= 1; count or more: none left). Every role of the CTA calls it for
    // every k until it returns none.
    CF2_DEVICE int take(int k) const {
        const int slot = (k - 1) % SLOTS;
        mbarrier_wait(smem_address(&bars.claim_full[slot]), ((k - 1) / SLOTS) & 1);
        return *static_cast<volatile int*>(&bars.claimed[slot]);
    }

    // ---- the claimer (one consumer thread) ----
    CF2_DEVICE int claim() const { return atomicAdd(counters, 1) + static_cast<int>(gridDim.x); }
    // The k-th tile into its slot.
    CF2_DEVICE void put(int k, int tile) const {
        const int slot = (k - 1) % SLOTS;
        bars.claimed[slot] = tile;
        mbarrier_arrive(smem_address(&bars.claim_full[slot]));  // releases the write
    }
    // Before the loop: tiles 1 .. LEAD - 1, waited for (the producer needs tile 1 as soon as
    // tile 0's loads are issued).
    CF2_DEVICE void start() const {
        for (int k = 1; k < LEAD; ++k) put(k, claim());
    }
    // At the start of work tile k, claim() for tile k + LEAD; at its end, the tile into its
    // slot. (A claim past the last tile comes back with none, as many times as asked.)
    CF2_DEVICE void put_ahead(int k, int tile) const { put(k + LEAD, tile); }

    // After the loop, every claim of this CTA having come back.
    CF2_DEVICE void finish() const {
        __threadfence();  // this CTA's claims come before its arrival
        if (atomicAdd(counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {
            atomicExch(counters, 0);  // every CTA has claimed its last tile
            atomicExch(counters + 1, 0);
        }
    }
};

// The work tiles of one CTA. for_each(may_claim, claimer, work, empty) runs
// work(tile, ring0, q_round) for each work tile of this CTA whose rows see a key and
// empty(tile) for the others (tile: its FwdTileContext). ring0 is the ring position of the
// tile's first KV tile (the KV tiles of the CTA's earlier work tiles), q_round the number of
// Qs loaded before its own; a tile that sees no key is loaded by no one and takes neither.
// Both roles walk the same tiles in the same order (with CLAIMS: WorkTileClaims), so their
// ring positions and phases agree. `claimer` (CLAIMS): this thread makes the claims; the
// producer's instance has no claiming code at all (`may_claim`, a CompileTimeFlag: an atomic
// with a return value there spills, WorkTileClaims).
// `own`: the CTA's tile on the one-tile-per-CTA grid (the kernel's prologue); `bars`: the CTA's
// mbarriers (FwdSm90ClaimBarriers, whose claim slots WorkTileClaims uses).
// `narrow`: a work tile's KV tile range narrowed to its block mask's visited tiles
// (BlockMaskNarrow, block_mask.cuh), or NoNarrow; applied to the persistent grid's tiles here
// (the kernel's prologue applies it to `own`).
template <int BLOCK_M, int BLOCK_N, bool PERSISTENT, bool CLAIMS, class Bars,
          class Narrow = NoNarrow>
struct FwdTileScheduler {
    const FwdSm90Params& params;
    const FwdTileContext& own;
    Bars& bars;
    Narrow narrow = {};

    CF2_DEVICE FwdTileContext context(const FwdParams& p, const FwdWorkTile& w) const {
        FwdTileContext tile = tile_context<BLOCK_M, BLOCK_N>(p, w);
        narrow(w.batch, w.head, w.m_block, tile.span.tile_first, tile.span.tile_end);
        return tile;
    }

    template <class MayClaim, class Work, class Empty>
    CF2_DEVICE void for_each(MayClaim may_claim, bool claimer, Work&& work, Empty&& empty) const {
        const FwdParams& p = params.base;
        if constexpr (!PERSISTENT) {
            work(own, 0, 0);
        } else {
            const PersistentTiles order{(p.seqlen_q + BLOCK_M - 1) / BLOCK_M,
                                        params.batch * p.nheads, params.section_pairs, p.nheads,
                                        p.batch_offset,
                                        p.window_right >= 0 || Narrow::LATE_ROWS_FIRST};
            int ring = 0, q_round = 0;
            if constexpr (!CLAIMS) {
                // Spelt out as before the claims: through `run` below, the same steps compile
                // to other SASS, and these specialisations keep the code that was measured.
                for (int t = blockIdx.x; t < order.count(); t += gridDim.x) {
                    const FwdTileContext tile = context(p, order[t]);
                    if (tile.span.empty()) {
                        empty(tile);
                        continue;
                    }
                    work(tile, ring, q_round);
                    ring += tile.span.tile_end - tile.span.tile_first;
                    ++q_round;
                }
            } else {
                auto run = [&](const FwdTileContext& tile, int& ring, int& q_round) {
                    if (tile.span.empty()) {
                        empty(tile);
                        return;
                    }
                    work(tile, ring, q_round);
                    ring += tile.span.tile_end - tile.span.tile_first;
                    ++q_round;
                };
                constexpr bool MAY_CLAIM = MayClaim::value;
                const WorkTileClaims<Bars> claims{params.tile_counters, order.count(), bars};
                if constexpr (MAY_CLAIM)
                    if (claimer) claims.start();
                for (int k = 0, t = blockIdx.x; t < order.count(); t = claims.take(++k)) {
                    int ahead = 0;
                    if constexpr (MAY_CLAIM)
                        if (claimer) ahead = claims.claim();
                    run(context(p, order[t]), ring, q_round);
                    if constexpr (MAY_CLAIM)
                        if (claimer) claims.put_ahead(k, ahead);
                }
                if constexpr (MAY_CLAIM)
                    if (claimer) claims.finish();
            }
        }
    }
};
