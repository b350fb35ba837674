// The Hopper forward's mainloop (flash_fwd_sm90.cu, a consumer warpgroup): the FA2 loop over
// one work tile's KV tiles, as the producer (sm90/fwd_producer.cuh) lands them in the ring:
// S_j = Q K_j^T (wgmma, both operands in shared memory), the score step (FwdScoreStep: score
// modifiers, mask on boundary tiles), the online softmax, O += P_j V_j (wgmma, P from
// registers). Three schedules: in order, ping-pong between the two consumers, and the overlap
// inside a warpgroup (either of the first two with OVERLAP). It leaves the unnormalised O and the
// OnlineSoftmax state to the epilogue (sm90/fwd_epilogue.cuh).
#pragma once
#include "hopper_primitives.cuh"
#include "tf32_primitives.cuh"
#include "variant.cuh"
#include "kernel_params.cuh"
#include "sm90/fwd_barriers.cuh"
#include "sm90/fwd_tile_scheduler.cuh"
#include "sm90/bias_tile.cuh"
#include "sm90/fwd_descales.cuh"

// S = Q K^T for this warpgroup's 64 rows over the head dim (hopper_primitives.cuh's K-major
// product: Q's rows and K's tile in 128-byte-swizzled panels). Issues the wgmmas only.
// SPLIT (3xTF32): three products into S, the small ones first (as mma_m16n16k8_f32 orders
// them, tf32_primitives.cuh): Qs Kb, then Qb Ks, then Qb Kb; Q's small part is Q_BYTES after its
// big part, K's SMALL_OFFSET after its.
template <typename Elem, class T>
CF2_DEVICE void issue_qk(float (&acc_s)[T::N_TILES][4], u32 q_rows, u32 k_tile) {
    if constexpr (T::SPLIT) {
        issue_kmajor_ss<Elem, T::KEYS_PER_TILE, T::QK_STEPS, T::Q_PANEL_BYTES, T::KV_PANEL_BYTES>(
            acc_s, q_rows + T::Q_BYTES, k_tile);
        issue_kmajor_ss<Elem, T::KEYS_PER_TILE, T::QK_STEPS, T::Q_PANEL_BYTES, T::KV_PANEL_BYTES,
                        true>(acc_s, q_rows, k_tile + T::SMALL_OFFSET);
        issue_kmajor_ss<Elem, T::KEYS_PER_TILE, T::QK_STEPS, T::Q_PANEL_BYTES, T::KV_PANEL_BYTES,
                        true>(acc_s, q_rows, k_tile);
    } else {
        issue_kmajor_ss<Elem, T::KEYS_PER_TILE, T::QK_STEPS, T::Q_PANEL_BYTES, T::KV_PANEL_BYTES>(
            acc_s, q_rows, k_tile);
    }
}

// The left half of S (keys 0 .. BLOCK_N / 2 - 1 of the tile): in the accumulator layout d[nt]
// holds columns 8 nt .., so it is the first half of the registers, and this view lets the
// masking and the softmax work on it alone.
template <int N_TILES>
using ScoreTile = float[1][N_TILES][4];
template <int N_TILES>
CF2_DEVICE ScoreTile<N_TILES / 2>& left_half(ScoreTile<N_TILES>& s) {
    return reinterpret_cast<ScoreTile<N_TILES / 2>&>(s);
}

// O += P V: PV_STEPS wgmmas, P (this warp's 16 rows x 16 keys per step) from registers, V from
// its descriptor as the MN-major B operand: the k16 step ks (keys 16 ks ..) starts 16 * 128 B
// further, SBO = 1024 B between groups of 8 keys, LBO = one panel between groups of 64 columns.
// N = HEAD_DIM_V (V's head dim, the traits' DIM_V): at d=96 the last 64-column group is read half (columns 64 .. 95 of the second
// panel), which CUTLASS's layout atoms would not express (it would pick the 64-byte swizzle for
// an N of 96); the hardware walks 8 x 8 core matrices, so this is expected to work, and the first
// d=96 run checks it. Issues the wgmmas only.
// Float32 and e4m3 (T::KEYS_LAST_V): V's tile holds its keys innermost, panels of 128-byte rows
// (32 float32 keys, 128 e4m3 keys) by HEAD_DIM_V rows, the K-major B operand of TF32 and e4m3
// wgmmas (which have no transposed B); the step ks (32 bytes of keys: k8 float32, k32 e4m3)
// lies in panel ks / 4, 32 * (ks % 4) bytes into its 128-byte rows, as a K-major step of
// Q K^T does (issue_kmajor_ss).
// SPLIT (3xTF32): p[PV_STEPS + ks] holds P's small part; three products a step, the small ones
// first: Ps Vb, Pb Vs (V's small part SMALL_OFFSET after its big part), Pb Vb.
template <typename Elem, class T>
CF2_DEVICE void issue_pv(float (&acc_o)[T::D_TILES][4], u32 (&p)[T::P_FRAGS][4], u32 v_tile) {
#pragma unroll
    for (int ks = 0; ks < T::PV_STEPS; ++ks) {
        if constexpr (T::SPLIT) {
            const u64 b = smem_matrix_descriptor(
                v_tile + (ks / 4) * T::VT_PANEL_BYTES + 32 * (ks % 4), 16, 1024);
            const u64 b_small = smem_matrix_descriptor(
                v_tile + T::SMALL_OFFSET + (ks / 4) * T::VT_PANEL_BYTES + 32 * (ks % 4), 16,
                1024);
            wgmma_rs_kmajor<Elem, T::DIM_V>(acc_o, p[T::PV_STEPS + ks], b, 1);
            wgmma_rs_kmajor<Elem, T::DIM_V>(acc_o, p[ks], b_small, 1);
            wgmma_rs_kmajor<Elem, T::DIM_V>(acc_o, p[ks], b, 1);
        } else if constexpr (T::KEYS_LAST_V) {
            const u64 b = smem_matrix_descriptor(
                v_tile + (ks / 4) * T::VT_PANEL_BYTES + 32 * (ks % 4), 16, 1024);
            wgmma_rs_kmajor<Elem, T::DIM_V>(acc_o, p[ks], b, 1);
        } else {
            const u64 b = smem_matrix_descriptor(v_tile + 16 * 128 * ks, T::KV_PANEL_BYTES, 1024);
            wgmma_rs_trans_b<Elem, T::DIM_V>(acc_o, p[ks], b, 1);
        }
    }
}

// e4m3 (T::TRANSPOSE_V): the stage holds V's head-dim row h in row h ^ ((h >> 3) & 1)
// (transposed_row, sm90/fwd_transpose_v.cuh: conflict-free stmatrix), so P V's column n is O's
// column n ^ ((n >> 3) & 1): in an n8 tile of odd index a thread's columns 2t and 2t + 1 trade
// places, in both its rows. Renaming registers: no instructions.
template <class T>
CF2_DEVICE void unpermute_o_columns(float (&acc_o)[T::D_TILES][4]) {
#pragma unroll
    for (int dt = 1; dt < T::D_TILES; dt += 2) {
        const float row_g[2] = {acc_o[dt][0], acc_o[dt][1]};
        const float row_g8[2] = {acc_o[dt][2], acc_o[dt][3]};
        acc_o[dt][0] = row_g[1];
        acc_o[dt][1] = row_g[0];
        acc_o[dt][2] = row_g8[1];
        acc_o[dt][3] = row_g8[0];
    }
}

// The probabilities in the S registers (after exp_scores) as the A operand of P V, step by step.
// e4m3: k32 steps of four n8 tiles, rounded to e4m3 (the unnormalised probabilities lie in
// [0, 2^T::P_SCALE_LOG2]: T::LAZY_RESCALE is false), in the order the keys-last V holds its keys
// (pack_probabilities_e4m3, hopper_primitives.cuh).
// 16-bit: k16 slices packed in pairs (OnlineSoftmax::pack_p). TF32: k8 steps, one n8 tile of the
// accumulator each, rounded (cvt.rna, as every operand of the float32 kernels); the tile holds
// keys 2t and 2t + 1 of row g (and g + 8) where the TF32 A fragment has columns t and t + 4, and
// the keys-last V holds its keys in that order (flash_fwd_tf32_operands.cu), so each register
// goes where it is. SPLIT (3xTF32): each probability also as the TF32 rounding of what its
// big part leaves out, into p[PV_STEPS + ks].
template <typename Elem, class T>
CF2_DEVICE void pack_probabilities(u32 (&p)[T::P_FRAGS][4], const float (&s)[T::N_TILES][4]) {
#pragma unroll
    for (int ks = 0; ks < T::PV_STEPS; ++ks) {
        if constexpr (Elem::SPLIT) {
            // the registers in the order below (row g, g + 8 of key 2t, then of key 2t + 1)
            const float x[4] = {s[ks][0], s[ks][2], s[ks][1], s[ks][3]};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                p[ks][r] = to_tf32(x[r]);
                p[T::PV_STEPS + ks][r] = to_tf32(x[r] - __uint_as_float(p[ks][r]));
            }
        } else if constexpr (Elem::IS_F32) {
            p[ks][0] = to_tf32(s[ks][0]);  // row g,     key 2t     (column t)
            p[ks][1] = to_tf32(s[ks][2]);  // row g + 8, key 2t
            p[ks][2] = to_tf32(s[ks][1]);  // row g,     key 2t + 1 (column t + 4)
            p[ks][3] = to_tf32(s[ks][3]);  // row g + 8, key 2t + 1
        } else if constexpr (Elem::IS_E4M3) {
            // the k32 step's four n8 tiles, in the keys-last V's order of 32 keys
            pack_probabilities_e4m3(p[ks], reinterpret_cast<const float(&)[4][4]>(s[4 * ks]));
        } else {
            OnlineSoftmax<1>::template pack_p<Elem>(p[ks], s[2 * ks], s[2 * ks + 1]);
        }
    }
}

// Float32: this warpgroup's rows of Q, as the TMA landed them, rounded to TF32 in place (K and V
// come rounded: flash_fwd_tf32_operands.cu), once a work tile, before the first S = Q K^T; then
// handed to the async proxy (the wgmmas' reads) and the warpgroup's threads.
// SPLIT (3xTF32): the big parts in place, the small ones (the TF32 rounding of what the big part
// leaves out) into the second Q buffer, Q_BYTES further.
template <class T>
CF2_DEVICE void round_q_to_tf32(u32 q_rows, int consumer) {
    const int tid = threadIdx.x % T::WARPGROUP_THREADS;
#pragma unroll
    for (int panel = 0; panel < T::PANELS; ++panel) {
#pragma unroll
        for (int i = tid; i < T::ROWS_PER_WARPGROUP * 8; i += T::WARPGROUP_THREADS) {
            const u32 chunk = q_rows + panel * T::Q_PANEL_BYTES + 16 * i;
            u32 v[4];
            load_16B_shared(v, chunk);
            if constexpr (T::SPLIT) {
                u32 big[4];
                float small[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    big[e] = to_tf32(__uint_as_float(v[e]));
                    small[e] = __uint_as_float(
                        to_tf32(__uint_as_float(v[e]) - __uint_as_float(big[e])));
                }
                store_16B_shared(chunk, __uint_as_float(big[0]), __uint_as_float(big[1]),
                                 __uint_as_float(big[2]), __uint_as_float(big[3]));
                store_16B_shared(chunk + T::Q_BYTES, small[0], small[1], small[2], small[3]);
            } else {
                store_16B_shared(chunk, __uint_as_float(to_tf32(__uint_as_float(v[0]))),
                                 __uint_as_float(to_tf32(__uint_as_float(v[1]))),
                                 __uint_as_float(to_tf32(__uint_as_float(v[2]))),
                                 __uint_as_float(to_tf32(__uint_as_float(v[3]))));
            }
        }
    }
    fence_proxy_async_shared();
    named_barrier_sync(T::EPILOGUE_BARRIER + consumer, T::WARPGROUP_THREADS);
}

// S = Q K^T, complete on return.
template <typename Elem, class T>
CF2_DEVICE void gemm_qk(float (&acc_s)[T::N_TILES][4], u32 q_rows, u32 k_tile) {
    pin_registers(acc_s);
    wgmma_fence();
    issue_qk<Elem, T>(acc_s, q_rows, k_tile);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_s);
}

// O += P V, complete on return.
template <typename Elem, class T>
CF2_DEVICE void gemm_pv(float (&acc_o)[T::D_TILES][4], u32 (&p)[T::P_FRAGS][4], u32 v_tile) {
    pin_registers(acc_o);
    pin_registers(p);
    wgmma_fence();  // P and the rescaled O were written by ordinary instructions
    issue_pv<Elem, T>(acc_o, p, v_tile);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(acc_o);
    pin_registers(p);
}

// One turn of the ping-pong schedule: wait for this warpgroup's turn on the tensor cores (the
// other consumer has issued its GEMMs), issue S_j = Q K_j^T (QK) and / or O += P_{j-1} V_{j-1}
// (PV), hand the turn over (`hand_over`), and wait for the GEMMs. Both warpgroups take the same
// number of turns; the softmax of one then runs while the other's GEMMs run.
template <bool QK, bool PV, typename Elem, class T>
CF2_DEVICE void gemm_turn(float (&acc_s)[T::N_TILES][4], float (&acc_o)[T::D_TILES][4],
                          u32 (&p)[T::P_FRAGS][4], u32 q_rows, u32 k_tile, u32 v_tile,
                          int my_turn, int other_turn, bool hand_over) {
    named_barrier_sync(my_turn, T::CONSUMER_THREADS);
    pin_registers(acc_s);
    pin_registers(acc_o);
    pin_registers(p);
    wgmma_fence();
    if constexpr (QK) issue_qk<Elem, T>(acc_s, q_rows, k_tile);
    if constexpr (PV) issue_pv<Elem, T>(acc_o, p, v_tile);
    wgmma_commit_group();
    if (hand_over) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
    wgmma_wait_group<0>();
    pin_registers(acc_s);
    pin_registers(acc_o);
    pin_registers(p);
}

// The score step of one KV tile, S_j in place: the attention variant's score transform
// (variant.cuh: softcap, ALiBi), then its mask, on boundary tiles only. S (or its left_half) is in the mma.sync accumulator layout of
// one m16 tile per warp. Every change to the scores between S = Q K^T and the softmax is made
// here, once for every schedule of consume_kv_tiles.
// Tiles in [tile_first, unmasked_lo) and [unmasked_hi, tile_end) cross a window edge or the
// sequence tail and need masking; the others run without any masking code. The range is the
// work tile's (the producer loads the same tiles for both warpgroups).
// (The thread's row is worked out in each call, as the lambda this was did: computed once in the
// constructor, it gave other SASS.)
// With the programmable modifiers (FEATURE_SCORE_MOD, FEATURE_MASK_MOD; `User` = UserParams,
// the mods kernel's inputs) the user's score modifier follows the variant's transform, and the
// user's mask runs on every tile in place of the boundary tiles' mask, as in the mma.sync
// forward (flash_fwd.cu), without the visibility's tests on a tile that needs none of them
// (Variant::mask_mod_inside: an unmasked tile, the warpgroup's rows inside the sequence; a mask
// that reads no arrays, Variant::USER_MASK_INSIDE);
// `User` = NoUserInputs (never read) for every other specialisation.
// `narrow` (FEATURE_BLOCK_MASK: BlockMaskNarrow, block_mask.cuh): on the work tile's run of
// full tiles [full_first, full_end), found once a work tile, the user's mask does not run, only
// the built-in one where the tile needs it.
// `bias` (FEATURE_BIAS_TILE: BiasTile, sm90/bias_tile.cuh): the tile's block of the bias added to
// S from shared memory after the variant's transform (`bias_tile`: its address in the stage).
// WG_ROWS: a warpgroup's rows (T::ROWS_PER_WARPGROUP).
template <int FEATURES, int BLOCK_N, int WG_ROWS, class User = NoUserInputs,
          class Narrow = NoNarrow, class Bias = NoBiasTile>
struct FwdScoreStep {
    static constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    using Variant = AttentionVariant<FEATURES>;
    Variant variant;
    const KeyVisibility& vis;
    int row_first, wg_row0, warp, lane;
    int unmasked_lo, unmasked_hi;
    int full_first, full_end;  // FEATURE_BLOCK_MASK: the tiles the user's mask skips
    bool rows_inside;          // this warpgroup's rows all inside the sequence
    const FwdParams& p;
    const FwdTileContext& c;
    const User& user;
    const Narrow& narrow;
    const Bias& bias;

    CF2_DEVICE FwdScoreStep(const FwdParams& p, const KeyVisibility& vis, const FwdTileContext& c,
                            int wg_row0, int warp, int lane, const User& user,
                            const Narrow& narrow, const Bias& bias)
        : variant(p.mods, tile_seqlen_q<VARLEN>(p, c), tile_seqlen_k<VARLEN>(p, c)),
          vis(vis), row_first(c.span.row_first), wg_row0(wg_row0), warp(warp), lane(lane), p(p),
          c(c), user(user), narrow(narrow), bias(bias) {
        variant.select_head(p.mods, c.w.batch, c.w.head);
        vis.unmasked_tile_range(c.span.row_first, c.span.row_last, BLOCK_N, unmasked_lo,
                                unmasked_hi);
        rows_inside = row_first + wg_row0 + WG_ROWS <= tile_seqlen_q<VARLEN>(p, c);
        if constexpr (Variant::BLOCK_MASK)
            narrow.full_range(c.w.batch, c.w.head, c.w.m_block, full_first, full_end);
    }

    // The programmable modifiers' context (user_inputs.cuh): inputs, batch entry (sequence),
    // head, lengths, score units. Instantiated with the modifiers only.
    CF2_DEVICE UserModContext user_context() const {
        return {user, c.w.batch, c.w.head, tile_seqlen_q<VARLEN>(p, c),
                tile_seqlen_k<VARLEN>(p, c), p.softmax_scale, p.mods.alibi_to_units};
    }

    template <class Scores>  // S or its left_half
    CF2_DEVICE void operator()(Scores& acc_s, int tile, u32 bias_tile = 0) const {
        // This thread's first accumulator row (query index) and key.
        const int thread_row0 = row_first + wg_row0 + 16 * warp + lane / 4;
        const int thread_key0 = tile * BLOCK_N + 2 * (lane % 4);
        if constexpr (Variant::TRANSFORMS_SCORES) variant.apply(acc_s, thread_row0, thread_key0);
        if constexpr (Bias::ON)
            bias.add(acc_s, bias_tile, wg_row0 + 16 * warp + lane / 4, lane,
                     p.mods.alibi_to_units);
        if constexpr (Variant::SCORE_MOD)
            Variant::score_mod(acc_s, thread_row0, thread_key0, user_context());
        if constexpr (Variant::MASK_MOD) {
            const bool unmasked = tile >= unmasked_lo && tile < unmasked_hi;
            if (Variant::BLOCK_MASK && tile >= full_first && tile < full_end) {
                if (!unmasked) Variant::mask(acc_s, thread_row0, thread_key0, vis);
            } else if (Variant::USER_MASK_INSIDE && unmasked && rows_inside) {
                Variant::mask_mod_inside(acc_s, thread_row0, thread_key0, user_context());
            } else {
                Variant::mask_mod(acc_s, thread_row0, thread_key0, vis, user_context());
            }
        } else if (tile < unmasked_lo || tile >= unmasked_hi) {
            Variant::mask(acc_s, thread_row0, thread_key0, vis);
        }
    }
};

// One work tile of a consumer warpgroup (warpgroup 1 + c owns rows 64 c .. 64 c + 63 of it):
// the FA2 loop over its KV tiles from ring position ring0 on (produce_tile), into the
// unnormalised output acc_o and the online softmax's running max and sums, which it then hands
// to `epilogue` (acc_o, softmax, inv_sum, row_lse): the kernel's store_tile
// (sm90/fwd_epilogue.cuh).
// q_round: the how-many-th Q of this CTA the tile's Q is (the parity of its q_full phase).
// `bias` (FEATURE_BIAS_TILE, the overlap schedule only): each tile's softmax waits for the
// tile's block of the bias (sm90/bias_tile.cuh, its own ring barriers), adds it in the score
// step and gives it back.
template <typename Elem, class T, bool PINGPONG, bool OVERLAP, int FEATURES, bool PERSISTENT,
          class Epilogue, class User = NoUserInputs, class Narrow = NoNarrow,
          class Bias = NoBiasTile>
CF2_DEVICE void consume_kv_tiles(const FwdParams& p, const KeyVisibility& vis,
                                 const FwdTileContext& c, const TileDescales& descales,
                                 int ring0, int q_round, int consumer,
                                 u32 q_smem, u32 kv_smem,
                                 FwdSm90Barriers<T::KV_STAGES, OVERLAP, PERSISTENT>& bars,
                                 Epilogue&& epilogue, const User& user = User{},
                                 const Narrow& narrow = Narrow{}, const Bias& bias = Bias{}) {
    static_assert(!Bias::ON || OVERLAP, "bias tiles: the overlap schedule");
    constexpr int STAGES = T::KV_STAGES;
    constexpr int BLOCK_N = T::KEYS_PER_TILE;
    const FwdTileSpan& span = c.span;
    const int row_first = span.row_first, row_last = span.row_last;
    const int tile_first = span.tile_first, tile_end = span.tile_end;
    const int warp = (threadIdx.x / 32) % 4;  // in the warpgroup: rows 16 warp .. + 15
    const int lane = threadIdx.x % 32;
    const int wg_row0 = T::ROWS_PER_WARPGROUP * consumer;  // in the tile
    // This warpgroup's rows in every panel of Q (A operand of S = Q K^T).
    const u32 q_rows = q_smem + wg_row0 * T::ROW_BYTES;
    // The scale of exp2: e4m3 scores are in units of q_descale * k_descale (fwd_descales.cuh).
    const float scale_log2 = Elem::IS_E4M3 ? p.scale_log2 * descales.qk : p.scale_log2;

    // The unnormalised output, as one m16 tile a warp (the layout online_softmax.cuh takes).
    float acc_o[1][T::D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    OnlineSoftmax<1> softmax;  // one m16 tile a warp: this thread's rows g and g + 8
    // (with sinks: the head's sink as a key already seen, its 1 in the sum of the quad's first
    // thread: variant.cuh)
    AttentionVariant<FEATURES>::start_softmax(softmax, p.mods, c.w.head, lane % 4 == 0);
    // S_j in place: score modifiers, mask (boundary tiles only).
    const FwdScoreStep<FEATURES, BLOCK_N, T::ROWS_PER_WARPGROUP, User, Narrow, Bias> score_step(
        p, vis, c, wg_row0, warp, lane, user, narrow, bias);

    // Half tiles (ping-pong + overlap, the dispatched two-consumer schedule): this warpgroup's
    // rows see no key at or past hi() of its last row (hi grows with the row; rows past the
    // sequence are computed but never stored, so the last row is clipped to row_last). If that
    // lies in the left half of the work tile's first KV tile (under a causal mask the upper 64
    // rows of a diagonal tile; a short sequence tail), the softmax of that tile covers its left
    // half alone (masking, row maxima, half the exponentials) and the right half's
    // probabilities are set to 0, as the mask would have made them. That tile is a boundary
    // tile, masked: its right half holds keys the row block does not see.
    //  - The GEMMs stay whole. With a branch between a half and a whole wgmma ptxas joined the
    //    two with a wgmma of its own and a wait, or serialised every wgmma for want of
    //    registers (C7511, d=96 and 128 on the persistent grid): 10-35% slower.
    //  - The flag is the same for the whole warpgroup, but ptxas cannot tell (it comes from
    //    the warpgroup's index), and a branch on it around wgmmas makes it serialise them
    //    (C7519, "WG.AR in divergent path"): a vote's result is warp-uniform to it.
    //  - Not in the in-order schedule (three consumers at d=64): with half tiles, and with a
    //    warpgroup skipping a first tile it does not see at all, it measured 0.96-1.02x.
    constexpr bool HALF_TILES = T::template HALF_TILES<FEATURES> && PINGPONG && OVERLAP;
    const int wg_key_end = vis.hi(min(row_first + wg_row0 + T::ROWS_PER_WARPGROUP - 1, row_last));
    const bool half_tile = HALF_TILES && __all_sync(0xffffffffu, wg_key_end <= (tile_end - 1) *
                                                                     BLOCK_N + BLOCK_N / 2);

    // Ring addresses of the j-th tile visited in this work tile (tile = tile_end - 1 - j): ring
    // position ring0 + j (positions continue across a persistent CTA's work tiles), stage
    // (ring0 + j) % STAGES, whose barriers are in their ((ring0 + j) / STAGES)-th phase.
    auto ring_of = [&](int j) { return ring0 + j; };
    auto k_tile_of = [&](int j) { return kv_smem + (ring_of(j) % STAGES) * T::STAGE_BYTES; };
    auto v_tile_of = [&](int j) { return k_tile_of(j) + T::V_OFFSET; };
    auto bias_tile_of = [&](int j) { return k_tile_of(j) + T::BIAS_OFFSET; };
    auto wait_k = [&](int j) {
        mbarrier_wait(smem_address(&bars.k_full[ring_of(j) % STAGES]), (ring_of(j) / STAGES) & 1);
    };
    auto wait_v = [&](int j) {
        mbarrier_wait(smem_address(&bars.v_full[ring_of(j) % STAGES]), (ring_of(j) / STAGES) & 1);
    };
    // Each gives back with one arrival a thread, or with T::WARP_RELEASES one a warp (lane 0's,
    // once the warp's wgmma wait returned): fwd_barriers.cuh.
    auto give_back = [&](u64& barrier) {
        if constexpr (T::WARP_RELEASES) {
            if (lane == 0) mbarrier_arrive(smem_address(&barrier));
        } else {
            mbarrier_arrive(smem_address(&barrier));
        }
    };
    auto release = [&](int j) { give_back(bars.kv_empty[ring_of(j) % STAGES]); };
    // OVERLAP gives K and V of a stage back separately (FwdSm90KvBarriers::v_empty).
    auto release_k = [&](int j) { give_back(bars.kv_empty[ring_of(j) % STAGES]); };
    auto release_v = [&](int j) {
        if constexpr (OVERLAP) give_back(bars.v_empty[ring_of(j) % STAGES]);
    };
    // After the work tile's last S GEMM has completed, Q is no longer read: the producer may load
    // the next work tile's Q (persistent grid) under this tile's last P V and epilogue.
    auto release_q = [&]() {
        if constexpr (PERSISTENT) give_back(bars.q_empty);
    };

    // S_j -> P_j: score_step, online softmax (new running max; O and l rescaled where it moved),
    // then P = exp2(S * scale_log2 - m) packed to 16 bits as the A operand of P V, one k16 slice
    // at a time.
    auto softmax_step = [&](float (&acc_s)[1][T::N_TILES][4], u32 (&p_frag)[T::P_FRAGS][4],
                            int tile) {
        score_step(acc_s, tile);
        softmax.template update_max<T::LAZY_RESCALE, T::P_SCALE_LOG2>(acc_s, acc_o, scale_log2);
        if constexpr (T::KEYS_LAST_V) {  // float32, e4m3: packed in the keys-last V's order
            softmax.exp_scores(acc_s, scale_log2);
            pack_probabilities<Elem, T>(p_frag, acc_s[0]);
        } else {
#pragma unroll
            for (int ks = 0; ks < T::PV_STEPS; ++ks)
                softmax.template exp_pack<Elem>(p_frag[ks], acc_s[0][2 * ks],
                                                acc_s[0][2 * ks + 1], 0, scale_log2);
        }
    };

    mbarrier_wait(smem_address(&bars.q_full), q_round & 1);
    if constexpr (Elem::IS_F32) round_q_to_tf32<T>(q_rows, consumer);
    if constexpr (OVERLAP) {
        // The overlap inside a warpgroup (FlashAttention-3's intra-warpgroup pipelining).
        // Iteration j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two commit groups, in that
        // order. wgmma groups complete in order, so `wait_group 1` (at most one group pending)
        // returns once S_j is complete while P_{j-1} V_{j-1} may still run, and the softmax of
        // tile j runs under that GEMM: score modifiers, mask, new running max (the sums rescaled,
        // O's factors kept for later), the exponentials in place in the S registers (fp32). The
        // next iteration opens with `wait_group 0`: O is complete and the P registers are free,
        // so P_j is packed from the S registers before S_{j+1} overwrites them. (The wait opens
        // an iteration rather than closing one because ptxas hoists a wgmma wait to the top of
        // its basic block: after the softmax, in the same block, it would move above the softmax
        // and serialise it behind the P V again. The loop's back edge keeps it below.)
        // O's rescale for tile j's max has to land between P_{j-1} V_{j-1} (which writes O) and
        // P_j V_j: it runs once S_{j+1} was issued, its multiplies under that Q K^T GEMM. Same
        // online softmax: O_j = c_j O_{j-1} + P_j V_j.
        // Registers: S_j, P_{j-1} and O live together (as in ping-pong).
        // pin_registers fences each wgmma window: before wgmma_fence (what ordinary instructions
        // wrote is in place) and after each wait (nothing reads a result, or reuses a register
        // the GEMM still reads, earlier).
        // K_j is read by S_j alone and given back once S_j completed (release_k); V_{j-1} after
        // its P V (release_v). Q is read by the S GEMMs alone: the work tile's last one,
        // S_{tiles-1}, is complete once the wait_group 1 of the last iteration returned (the
        // wait_group 0 of tile 0 for a work tile of one KV tile), and Q goes back there
        // (release_q), under the last P V GEMMs, the last softmax and the epilogue.
        // With PINGPONG the two GEMMs of an iteration are one turn of the consumers' alternation
        // (turns as in the ping-pong branch below, in step across a persistent CTA's tiles).
        const int my_turn = T::TURN_BARRIER + consumer;
        const int other_turn = T::TURN_BARRIER + (1 - consumer);
        auto take_turn = [&]() {
            if constexpr (PINGPONG) named_barrier_sync(my_turn, T::CONSUMER_THREADS);
        };
        auto hand_over = [&](bool to_other) {
            if constexpr (PINGPONG)
                if (to_other) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
        };
        if constexpr (PINGPONG)
            if (consumer == 1) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
        float acc_s[1][T::N_TILES][4];
        u32 p_frag[T::P_FRAGS][4];
        float correction[2];   // O's factors for the running max of the last softmax
        bool rescale = false;  // whether any row of the warp needs them (O = 0 at first)
        // Waits for P_{j-1} V_{j-1} (every wgmma of this warpgroup), gives V_{j-1} back and packs
        // P_j from the probabilities in the S registers.
        auto finish_pv_pack = [&](int j) {
            wgmma_wait_group<0>();
            pin_registers(acc_o[0]);
            pin_registers(p_frag);
            if (j > 0) release_v(j - 1);
            pack_probabilities<Elem, T>(p_frag, acc_s[0]);
        };
        const int tiles = tile_end - tile_first;

        // Tile 0: S_0 alone, then its softmax (of S_0's left half alone with half_tile, the
        // right half's probabilities set to 0).
        wait_k(0);
        take_turn();
        pin_registers(acc_s[0]);
        wgmma_fence();
        issue_qk<Elem, T>(acc_s[0], q_rows, k_tile_of(0));
        wgmma_commit_group();
        hand_over(true);
        wgmma_wait_group<0>();
        pin_registers(acc_s[0]);
        release_k(0);
        if (tiles == 1) release_q();  // S_0 was the last S GEMM
        bias.wait(ring_of(0));
        auto first_softmax = [&](auto& s) {
            score_step(s, tile_end - 1, bias_tile_of(0));
            bias.release(ring_of(0));
            softmax.template fold_max<T::LAZY_RESCALE, T::P_SCALE_LOG2>(s, scale_log2,
                                                                        correction);  // O is 0
            softmax.exp_scores(s, scale_log2);
        };
        if constexpr (HALF_TILES) {
            if (half_tile) {
                first_softmax(left_half(acc_s));
#pragma unroll
                for (int nt = T::N_TILES / 2; nt < T::N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
            } else {
                first_softmax(acc_s);
            }
        } else {
            first_softmax(acc_s);
        }
        for (int j = 1; j < tiles; ++j) {
            finish_pv_pack(j - 1);  // P_{j-2} V_{j-2} (none at j = 1); P_{j-1}
            wait_k(j);
            take_turn();
            pin_registers(acc_s[0]);
            pin_registers(acc_o[0]);
            pin_registers(p_frag);
            wgmma_fence();
            // (T::FRESH_Q_DESCRIPTORS: Q's descriptors made again each tile from an opaque copy
            // of its address, not held across the loop)
            u32 q_now = q_rows;
            if constexpr (T::FRESH_Q_DESCRIPTORS) asm volatile("mov.b32 %0, %0;" : "+r"(q_now));
            issue_qk<Elem, T>(acc_s[0], q_now, k_tile_of(j));
            wgmma_commit_group();  // group 1: S_j
            // O is complete (P_{j-2} V_{j-2} was waited for): tile j-1's rescale.
            softmax.rescale_o(acc_o, correction, rescale);
            pin_registers(acc_o[0]);
            wait_v(j - 1);
            wgmma_fence();  // O was written by the rescale
            issue_pv<Elem, T>(acc_o[0], p_frag, v_tile_of(j - 1));
            wgmma_commit_group();  // group 2: P_{j-1} V_{j-1}
            hand_over(true);
            wgmma_wait_group<1>();  // S_j complete; P_{j-1} V_{j-1} may still run
            pin_registers(acc_s[0]);
            release_k(j);
            if (j == tiles - 1) release_q();  // S_j was the last S GEMM
            bias.wait(ring_of(j));
            score_step(acc_s, tile_end - 1 - j, bias_tile_of(j));
            bias.release(ring_of(j));
            rescale = softmax.template fold_max<T::LAZY_RESCALE, T::P_SCALE_LOG2>(
                acc_s, scale_log2, correction);
            softmax.exp_scores(acc_s, scale_log2);
        }
        // The last P V, after the rescale for the last tile's max.
        finish_pv_pack(tiles - 1);
        softmax.rescale_o(acc_o, correction, rescale);
        wait_v(tiles - 1);
        take_turn();
        pin_registers(acc_o[0]);
        pin_registers(p_frag);
        wgmma_fence();
        issue_pv<Elem, T>(acc_o[0], p_frag, v_tile_of(tiles - 1));
        wgmma_commit_group();
        hand_over(consumer == 0);  // as in ping-pong: consumer 1's last turn is the last one
        wgmma_wait_group<0>();
        pin_registers(acc_o[0]);
        pin_registers(p_frag);
        release_v(tiles - 1);
    } else if constexpr (!PINGPONG) {
        // Per tile, in order: S_j = Q K_j^T as soon as K_j landed; P_j; O += P_j V_j as soon as
        // V_j landed; the stage goes back to the producer.
        for (int tile = tile_end - 1, j = 0; tile >= tile_first; --tile, ++j) {
            float acc_s[1][T::N_TILES][4];
            u32 p_frag[T::P_FRAGS][4];
            wait_k(j);
            gemm_qk<Elem, T>(acc_s[0], q_rows, k_tile_of(j));
            if (tile == tile_first) release_q();
            softmax_step(acc_s, p_frag, tile);
            wait_v(j);
            gemm_pv<Elem, T>(acc_o[0], p_frag, v_tile_of(j));
            release(j);
        }
    } else {
        // Ping-pong: the GEMMs of tile j are S_j and P_{j-1} V_{j-1}, issued in one turn, and the
        // turns alternate between the two consumers (named barriers TURN_BARRIER + c): while one
        // computes its softmax, the tensor cores run the other's GEMMs. O is up to date with
        // P_{j-1} V_{j-1} before the softmax of tile j rescales it, so this is the same online
        // softmax. Consumer 1 hands consumer 0 the first turn; its own last turn hands nothing
        // over (no turn of consumer 0 follows in this work tile; the next work tile starts with
        // the same hand-over, so the turns stay in step across a persistent CTA's tiles).
        const int my_turn = T::TURN_BARRIER + consumer;
        const int other_turn = T::TURN_BARRIER + (1 - consumer);
        if (consumer == 1) named_barrier_arrive(other_turn, T::CONSUMER_THREADS);
        float acc_s[1][T::N_TILES][4];
        u32 p_frag[T::P_FRAGS][4];
        const int tiles = tile_end - tile_first;
        wait_k(0);
        gemm_turn<true, false, Elem, T>(acc_s[0], acc_o[0], p_frag, q_rows, k_tile_of(0), 0,
                                        my_turn, other_turn, true);
        if (tiles == 1) release_q();
        softmax_step(acc_s, p_frag, tile_end - 1);
        for (int j = 1; j < tiles; ++j) {
            wait_k(j);
            wait_v(j - 1);
            gemm_turn<true, true, Elem, T>(acc_s[0], acc_o[0], p_frag, q_rows, k_tile_of(j),
                                           v_tile_of(j - 1), my_turn, other_turn, true);
            release(j - 1);
            if (j == tiles - 1) release_q();
            softmax_step(acc_s, p_frag, tile_end - 1 - j);
        }
        wait_v(tiles - 1);
        gemm_turn<false, true, Elem, T>(acc_s[0], acc_o[0], p_frag, q_rows, 0,
                                        v_tile_of(tiles - 1), my_turn, other_turn,
                                        consumer == 0);
        release(tiles - 1);
    }

    // The epilogue takes over O and the softmax state, with the registers for what its finalize
    // gives each of this thread's two rows (1 / l, lse). They are declared here, after the loop's
    // own, and not in the epilogue: the accumulators, the loop's locals and these are then locals
    // of one function, as in the kernel before it was split, and the compiler sees the same
    // program (with acc_o and softmax in the caller, or these in the epilogue, ptxas scheduled
    // and allocated differently: other SASS).
    if constexpr (T::TRANSPOSE_V) unpermute_o_columns<T>(acc_o[0]);
    float inv_sum[2], row_lse[2];
    epilogue(acc_o, softmax, inv_sum, row_lse);
}
