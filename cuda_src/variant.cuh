// The attention variant: the one place where a feature that changes the attention itself enters
// the kernels. Every kernel family (the mma.sync forward, backward, deterministic dQ and decode
// kernels, the Hopper forward and backward) asks its specialisation's AttentionVariant<FEATURES>,
// at the same points of FlashAttention-2's loop:
//
//   1. which keys a query row sees: visibility() (causal, windows, the sequence's own lengths
//      under varlen), from which the kernels take the KV tiles a Q tile visits (tile_range), the
//      tiles that need no mask (unmasked_tile_range) and, backward, the Q tiles a KV tile sees;
//      with a block mask (FEATURE_BLOCK_MASK, block_mask.cuh: cuflash2.block_mask's per-tile
//      states of the user's mask), of those tiles only the ones not empty, the user's mask on
//      the partial ones only (the mods kernels of both families, but varlen and the
//      deterministic dQ kernel);
//   2. the scores' transform, on every tile before the mask (ScoreMods: softcap, then the ALiBi
//      bias), and for the backward its derivative (dtanh) and the bias with P;
//   3. the mask of a boundary tile: mask() (the invisible keys to -inf);
//   2'/3'. programmable modifiers (FEATURE_SCORE_MOD, FEATURE_MASK_MOD: the user's expressions in
//      the generated user_mods.cuh, cuflash2/mods.py): score_mod() after softcap and ALiBi, before
//      the mask; mask_mod() instead of mask() on every tile the visibility gives (no tile is
//      known to need no mask), or with a block mask on its partial tiles only, and
//      mask_mod_inside() (the user's mask alone) on those the visibility does not cut; the
//      backward recomputes the modified score and multiplies dS by the modifier's derivative
//      (score_mod_backward). The mma.sync forward, backward and deterministic dQ kernels (the
//      *_mods_kernel entries), the Hopper forward and backward with a mask modifier and the
//      bias as tiles (sm90/bias_tile.cuh); not the decode kernel.
//   4. what enters each row's softmax denominator besides the keys: the learnable sinks (one
//      logit a query head, no value), as the online softmax's state before the first tile
//      (start_softmax: a key already seen; the decode kernel's split 0 alone, so that the merge
//      of the splits counts it once), and their gradient (flash_bwd_sinks.cu). The backward's
//      main kernels need nothing: P comes from the lse, which counts the sink, and
//      D = rowsum(dO o O) is the same.
//
// A feature is a bit of FEATURES (constants.cuh, generated from cuflash2/_configs.py), so a plain
// kernel compiles none of it. Adding one means: a bit, its parameters in kernel_params.cuh's
// VariantParams, its code here at the points above, its host side in cuflash2/_options.py and
// its maths in cuflash2/reference.py (docs/ARCHITECTURE.md, "Where a feature enters").
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"
#include "masking.cuh"
#include "online_softmax.cuh"
#include "score_mods.cuh"
#include "user_mods.cuh"
#include "block_mask.cuh"

// f(score, its row, its key) for every score of a thread's accumulator tile (the mma.sync
// m16n8 layout: s[mt][nt][2 * half + e] is row row0 + 16 mt + 8 half, key key0 + 8 nt + e).
template <int M_TILES, int N_TILES, class F>
CF2_DEVICE void for_each_score(float (&s)[M_TILES][N_TILES][4], int row0, int key0, F&& f) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + 16 * mt + 8 * half;
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) f(s[mt][nt][2 * half + e], row, key0 + 8 * nt + e);
        }
}

template <int FEATURES>
struct AttentionVariant : ScoreMods<FEATURES> {
    static constexpr bool SINKS = (FEATURES & FEATURE_SINKS) != 0;
    static constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    // Whether the scores change before the mask (softcap, ALiBi): the kernels skip the
    // transform's pass over a tile otherwise.
    static constexpr bool MASK_MOD = (FEATURES & FEATURE_MASK_MOD) != 0;
    static constexpr bool SCORE_MOD = (FEATURES & FEATURE_SCORE_MOD) != 0;
    // A block mask's states (with MASK_MOD): skip the empty tiles, the user's mask on the
    // partial ones only.
    static constexpr bool BLOCK_MASK = (FEATURES & FEATURE_BLOCK_MASK) != 0;
    // Whether the Hopper kernels run the user's mask alone on the tiles the visibility does not
    // cut (mask_mod_inside, mask_mod_transposed_inside): for a mask that reads no arrays. With
    // a document mask's loads that second copy of the user's code spilled (Hopper backward,
    // d=128: 16 bytes; the persistent forward: 12).
    static constexpr bool USER_MASK_INSIDE = MASK_MOD && !UserMods::MASK_READS_INPUTS;
    static_assert(!BLOCK_MASK || MASK_MOD, "a block mask comes with its mask modifier");
    static constexpr bool TRANSFORMS_SCORES =
        ScoreMods<FEATURES>::SOFTCAP || ScoreMods<FEATURES>::ALIBI || SCORE_MOD;

    using ScoreMods<FEATURES>::ScoreMods;

    // 1. Which keys a query row sees, for a sequence of seqlen_q queries and seqlen_k keys
    // (masking.cuh: bottom-right aligned causal masks and windows; -1 an unbounded edge).
    CF2_DEVICE static KeyVisibility visibility(int seqlen_q, int seqlen_k, int window_left,
                                               int window_right) {
        return {seqlen_k - seqlen_q, window_left, window_right, seqlen_k};
    }

    // 3. The invisible scores of a boundary tile to -inf (the accumulator layout of mask_scores).
    template <int M_TILES, int N_TILES>
    CF2_DEVICE static void mask(float (&s)[M_TILES][N_TILES][4], int row0, int key0,
                                const KeyVisibility& vis) {
        mask_scores<M_TILES, N_TILES>(s, row0, key0, vis);
    }

    // 2'. The user's score modifier (SCORE_MOD), after apply(): each score of a query and key
    // inside the sequence becomes UserMods::score(the scaled score, b, h, q_idx, kv_idx), back in
    // score units; positions past the sequence's ends keep theirs (the mask hides them) and
    // never reach the user's code. Accumulator layout, as mask().
    template <int M_TILES, int N_TILES>
    CF2_DEVICE static void score_mod(float (&s)[M_TILES][N_TILES][4], int row0, int key0,
                                     const UserModContext& ctx) {
        if constexpr (SCORE_MOD) {
            for_each_score(s, row0, key0, [&](float& x, int row, int key) {
                if (row < ctx.seqlen_q && key < ctx.seqlen_k)
                    x = UserMods::score(ctx.user, x * ctx.scale, ctx.batch, ctx.head, row, key) *
                        ctx.inv_scale;
            });
        }
    }

    // 2'' (backward). The user's score modifier of one score `u` (score units, softcap and ALiBi
    // applied: the forward's input to score_mod()) of query `row`, key `key`: returns the
    // modified score in score units, as score_mod() gives it, and sets `grad` to the modifier's
    // derivative d s' / d s at the scaled score s = u * scale (UserMods::score_grad: the
    // user's `grad`, or 1 for `score + <no score>`, cuflash2/mods.py). A masked score (-inf)
    // or a position past the sequence's ends stays as it is, with grad 0 (its P is 0), and
    // never reaches the user's code. `Mods`: UserMods, as a template argument so that a
    // forward-only user_mods.cuh without score_grad still compiles.
    //
    // The chain rule (the backward's dS is w.r.t. the scores the softmax sees, in scaled units):
    // the forward has s = u * scale, s' = f(s), u' = s' / scale, P = exp(u' * scale - lse)
    // = exp(s' - lse); the kernels' P o (dP - D) is dL/ds'. Then dL/ds = dL/ds' * f'(s): the
    // derivative is dimensionless (s and s' in the same scaled units), so dS is multiplied by
    // f'(s) alone; what follows (softcap's 1 - t^2, the softmax scale on dQ and dK) is
    // unchanged, as s depends on q.k as it did without the modifier.
    template <class Mods = UserMods>
    CF2_DEVICE static float score_mod_backward(float u, int row, int key,
                                               const UserModContext& ctx, float& grad) {
        if (row < ctx.seqlen_q && key < ctx.seqlen_k && u != neg_inf()) {
            const float s = u * ctx.scale;
            grad = Mods::score_grad(ctx.user, s, ctx.batch, ctx.head, row, key);
            return Mods::score(ctx.user, s, ctx.batch, ctx.head, row, key) * ctx.inv_scale;
        }
        grad = 0.f;
        return u;
    }

    // 3'. The mask of a tile with the user's mask modifier (MASK_MOD): a score stays where the
    // key is visible (vis: causal, window, the sequence's end), the row inside the sequence and
    // UserMods::mask(b, h, q_idx, kv_idx) is true; the user's code runs for those positions
    // only. Every tile the visibility gives goes through it. A row the user's mask leaves
    // without keys ends with O = 0 and lse = +inf (or the sink): its running max stays -inf
    // (OnlineSoftmax::fold_max), its sum 0.
    template <int M_TILES, int N_TILES>
    CF2_DEVICE static void mask_mod(float (&s)[M_TILES][N_TILES][4], int row0, int key0,
                                    const KeyVisibility& vis, const UserModContext& ctx) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + 16 * mt + 8 * half;
                const int key_lo = vis.lo(row);
                const int key_hi = min(vis.hi(row), ctx.seqlen_k);
                const bool row_in = row < ctx.seqlen_q;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = key0 + 8 * nt + e;
                        const bool visible = row_in && key >= key_lo && key < key_hi &&
                                             UserMods::mask(ctx.user, ctx.batch, ctx.head, row, key);
                        if (!visible) s[mt][nt][2 * half + e] = neg_inf();
                    }
            }
    }

    // 3''. The user's mask alone, on a tile the visibility does not cut (every key inside the
    // sequence, the causal diagonal and the window of each of the tile's rows: the kernels'
    // unmasked tiles) and whose rows are all inside the sequence: mask_mod()'s own tests are
    // all true there, and a partial tile of a block mask is mostly such a tile (a window's
    // edges, a document's corners). Accumulator layout, as mask().
    template <int M_TILES, int N_TILES>
    CF2_DEVICE static void mask_mod_inside(float (&s)[M_TILES][N_TILES][4], int row0, int key0,
                                           const UserModContext& ctx) {
        for_each_score(s, row0, key0, [&](float& x, int row, int key) {
            if (!UserMods::mask(ctx.user, ctx.batch, ctx.head, row, key)) x = neg_inf();
        });
    }

    // The sink of query head `head` in log2 units of the scaled scores (the units of the
    // softmax's scaled maxima), for a merge of partial softmax states (the decode kernel's);
    // -inf (no sink) without SINKS.
    CF2_DEVICE static float sink_log2(const VariantParams& params, int head) {
        if constexpr (SINKS) return params.sinks[head] * 1.4426950408889634f;
        return neg_inf();
    }

    // Whether the user's mask modifier keeps (query, key) (MASK_MOD), one position at a time:
    // the Hopper backward's, which applies it to P^T and dS^T as they are packed
    // (sm90/bwd_scores.cuh, score_gradients), where its registers are freest. The key must be
    // visible (vis: causal, window, the sequence's end) and the query inside the sequence; the
    // user's code runs for those only.
    CF2_DEVICE static bool keeps(int query, int key, const KeyVisibility& vis,
                                 const UserModContext& ctx) {
        return query < ctx.seqlen_q && key >= vis.lo(query) &&
               key < min(vis.hi(query), ctx.seqlen_k) &&
               UserMods::mask(ctx.user, ctx.batch, ctx.head, query, key);
    }

    // mask_mod_inside() for a transposed tile (keys as rows, queries as columns: the Hopper
    // backward's S^T; mask_transposed's layout), before its exponentials.
    template <int NT>
    CF2_DEVICE static void mask_mod_transposed_inside(float (&s)[NT][4], int key0, int query0,
                                                      const UserModContext& ctx) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (!UserMods::mask(ctx.user, ctx.batch, ctx.head, query0 + 8 * nt + i % 2,
                                    key0 + 8 * (i / 2)))
                    s[nt][i] = neg_inf();
    }

    // The same for a transposed tile (keys as rows, queries as columns: the Hopper backward's
    // S^T; mask_transposed's layout).
    template <int NT>
    CF2_DEVICE static void mask_transposed(float (&s)[NT][4], int key0, int query0,
                                           const KeyVisibility& vis) {
        ::mask_transposed<NT>(s, key0, query0, vis);
    }

    // The lse of a row that sees no key (natural log): +inf (the log of an empty sum), or with
    // SINKS the sink itself (the sink alone in the denominator; a sink of -inf is none). Its
    // output is 0 either way.
    CF2_DEVICE static float empty_row_lse(const VariantParams& params, int head) {
        if constexpr (SINKS) {
            const float sink = params.sinks[head];
            return sink == neg_inf() ? pos_inf() : sink;
        }
        return pos_inf();
    }

    // The online softmax of rows of query head `head` before the first tile: with SINKS it starts
    // with the head's sink as a key already seen, of score sink / softmax scale (raw score units:
    // alibi_to_units is 1 / the effective softmax scale) and value 0, its 1 in the sum of the
    // thread that `holds_sum` (OnlineSoftmax::start_with_sink); without, as constructed.
    template <class Softmax>
    CF2_DEVICE static void start_softmax(Softmax& softmax, const VariantParams& params, int head,
                                         bool holds_sum) {
        if constexpr (SINKS)
            softmax.start_with_sink(params.sinks[head] * params.alibi_to_units, holds_sum);
    }
};
