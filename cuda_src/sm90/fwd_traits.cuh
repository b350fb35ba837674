// The Hopper forward's compile-time shape (flash_fwd_sm90.cu): its warpgroups and their register
// split, named barriers, shared-memory layout (Q, the K/V ring, the persistent grid's O buffer)
// and the per-warp tile counts the mainloop and the epilogue iterate over. Every part of the
// kernel (sm90/fwd_*.cuh) takes it as its `T`.
#pragma once
#include "hopper_primitives.cuh"
#include "constants.cuh"

// BIAS (FEATURE_BIAS_TILE): each stage of the ring holds the bias's BLOCK_M x BLOCK_N tile of
// its KV tile after V (sm90/bias_tile.cuh), in 64-key panels of BLOCK_M 128-byte rows.
// HEAD_DIM is Q's and K's head dim, HEAD_DIM_V V's and O's (DeepSeek's 192 / 128): V's tiles,
// P V's N and the epilogue take HEAD_DIM_V, Q K^T HEAD_DIM.
template <typename Elem, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int STAGES,
          bool PERSISTENT = false, bool BIAS = false>
struct FwdSm90Traits : Sm90CtaLayout {
    static constexpr int ROWS_PER_WARPGROUP = 64;  // the M of wgmma
    static constexpr int CONSUMER_WARPGROUPS = BLOCK_M / ROWS_PER_WARPGROUP;
    static constexpr int CONSUMER_THREADS = CONSUMER_WARPGROUPS * WARPGROUP_THREADS;
    static constexpr int THREADS = WARPGROUP_THREADS + CONSUMER_THREADS;  // + the producer
    static constexpr int ENTRY_REGISTERS = entry_registers(THREADS);
    // 240 registers a consumer thread with two consumer warpgroups, 160 with three (but for
    // WIDE_PRODUCER below).
    static constexpr int BASE_CONSUMER_REGISTERS = consumer_registers(CONSUMER_WARPGROUPS);
    // Named barriers (0 is __syncthreads): one per consumer for its epilogue, and one per
    // consumer for its turns of the ping-pong schedule.
    static constexpr int EPILOGUE_BARRIER = 1;
    static constexpr int TURN_BARRIER = EPILOGUE_BARRIER + CONSUMER_WARPGROUPS;
    // The consumers give a stage (and Q) back with one arrival a warp where the element is e4m3,
    // else one a thread (fwd_barriers.cuh). Measured on the H100 (d=128, 2026-12-07,
    // benchmarks/dev/fp8_variants_ab.py and ab_sources.py): the FP8 forward 1.03-1.12x from 4k
    // keys non-causal (its tiles are short, and 256 arrivals on a stage's barrier show), the
    // 16-bit one 0.98-0.99x on most rows.
    static constexpr bool WARP_RELEASES = Elem::IS_E4M3;
    static constexpr int RELEASE_ARRIVALS = WARP_RELEASES ? CONSUMER_THREADS / 32 : CONSUMER_THREADS;

    // Elements are counted in bytes (Elem::BYTES): 2 for fp16 / bf16, 4 for float32 (tf32_tag,
    // f32x3_tag: TF32 wgmma), 1 for e4m3 (e4m3_tag: the FP8 forward). A Q or K row of HEAD_DIM
    // elements is ROW_WORDS 16-bit words, laid out as a 16-bit row of that length (panels of
    // 128 bytes: 64 16-bit elements, 32 float32, 128 e4m3). Float32 and e4m3 wgmmas take K-major
    // operands only, so the ring holds V with its keys innermost (KEYS_LAST_V), written by an
    // operand pass before the kernel (float32: flash_fwd_tf32_operands.cu) or by the producer
    // warpgroup (e4m3: TRANSPOSE_V).
    static constexpr int BYTES = Elem::BYTES;
    static constexpr int ROW_WORDS = HEAD_DIM * BYTES / 2;
    static constexpr bool KEYS_LAST_V = Elem::IS_F32 || Elem::IS_E4M3;
    // O's element: Elem's own, or for e4m3 inputs the 16-bit Elem::Out.
    static constexpr int OUT_BYTES = Elem::Out::BYTES;
    // 3xTF32 (Elem::SPLIT: f32x3_tag, precision "highest"): every operand in two TF32 parts, big
    // and small. Q's region holds two Q buffers (the TMA lands Q in the first; its consumers
    // split it, big in place, small in the second), a stage holds K big, K small, V big, V small
    // (the operand pass writes both parts: flash_fwd_tf32_operands.cu), and P is two register
    // sets (P_FRAGS: big, then small).
    static constexpr bool SPLIT = Elem::SPLIT;
    static constexpr int PARTS = SPLIT ? 2 : 1;
    // Tiles in shared memory are panels of 64 columns (Sm90CtaLayout); a tile of R rows is PANELS
    // panels of R * 128 B.
    // A head dim that is not a multiple of 64 (96) ends in a partly used panel: its box is still
    // 64 columns and the TMA zero-fills the columns past the head dim (they cost shared memory
    // and TMA writes, not global reads). A 32-column last box was the alternative, but the TMA
    // packs a box as rows of its own width: 64-byte rows, not the 128-byte rows the panel's
    // descriptors read, so that panel would need the 64-byte swizzle, with a second tensor map
    // and descriptor mode for it alone. With full panels one map, one layout and one descriptor
    // scheme serve every head dim. The GEMMs skip the padding: Q K^T takes HEAD_DIM / 16
    // k-steps and P V has N = HEAD_DIM, so the zero columns are never multiplied.
    static constexpr int PANELS = (ROW_WORDS + PANEL_COLS - 1) / PANEL_COLS;
    // V's and O's rows: V_PANELS panels (PANELS but for a V head dim of its own).
    static constexpr int V_ROW_WORDS = HEAD_DIM_V * BYTES / 2;
    static constexpr int V_PANELS = (V_ROW_WORDS + PANEL_COLS - 1) / PANEL_COLS;
    // O's rows (OUT_BYTES an element): O_PANELS panels of O_CHUNKS 16-byte chunks.
    static constexpr int O_ROW_WORDS = HEAD_DIM_V * OUT_BYTES / 2;
    static constexpr int O_PANELS = (O_ROW_WORDS + PANEL_COLS - 1) / PANEL_COLS;
    static constexpr int PANEL_ELEMENTS = ROW_BYTES / BYTES;  // a TMA box's columns
    static constexpr int Q_PANEL_BYTES = BLOCK_M * ROW_BYTES;
    static constexpr int KV_PANEL_BYTES = BLOCK_N * ROW_BYTES;
    static constexpr int Q_BYTES = PANELS * Q_PANEL_BYTES;
    static constexpr int KV_TILE_BYTES = PANELS * KV_PANEL_BYTES;  // a K tile
    // KEYS_LAST_V: a V tile is BLOCK_N keys as VT_PANELS panels of 128-byte rows (32 float32
    // keys, 128 e4m3 keys) by HEAD_DIM_V head-dim rows, the K-major B operand of P V. With the
    // in-kernel transpose (e4m3) BLOCK_N may end inside a panel (160, 192, 224 keys): the last
    // panel's rows then hold VT_TAIL_GROUPS groups of 32 keys and the rest of each row is
    // neither written nor read (P V's k32 steps stop at BLOCK_N), a panel's shared memory for
    // the layout and descriptors of whole panels. The operand pass's tiles are whole panels.
    static constexpr int VT_PANELS = (BLOCK_N * BYTES + ROW_BYTES - 1) / ROW_BYTES;
    static constexpr int VT_TAIL_GROUPS = BLOCK_N * BYTES % ROW_BYTES / 32;
    static constexpr int VT_PANEL_BYTES = HEAD_DIM_V * ROW_BYTES;
    static constexpr int V_TILE_BYTES =
        KEYS_LAST_V ? VT_PANELS * VT_PANEL_BYTES : V_PANELS * KV_PANEL_BYTES;
    // O staged in Q's buffer (one-tile-per-CTA grid): O_PANELS panels of Q's rows, more than Q's
    // own where O's element is wider than Q's (e4m3 inputs, a 16-bit O).
    static constexpr int O_STAGE_BYTES = PERSISTENT ? 0 : O_PANELS * Q_PANEL_BYTES;
    // Q (and with SPLIT its small part), or O where that is larger.
    static constexpr int Q_REGION_BYTES =
        PARTS * Q_BYTES > O_STAGE_BYTES ? PARTS * Q_BYTES : O_STAGE_BYTES;
    static constexpr int V_OFFSET = PARTS * KV_TILE_BYTES;  // V's tile(s) after K's in a stage
    static constexpr int SMALL_OFFSET = KV_TILE_BYTES;      // SPLIT: a small part after its big
    // The bias's tile after V's (and with SPLIT its small part) in a stage.
    static constexpr int BIAS_OFFSET = V_OFFSET + PARTS * V_TILE_BYTES;
    static constexpr int BIAS_PANEL_BYTES = BLOCK_M * ROW_BYTES;
    static constexpr int BIAS_PANELS = BIAS ? BLOCK_N / PANEL_COLS : 0;
    static constexpr int BIAS_TILE_BYTES = BIAS_PANELS * BIAS_PANEL_BYTES;
    // K tile, then V tile (then the bias's tile); SPLIT: K big, K small, V big, V small
    static constexpr int STAGE_BYTES = PARTS * (KV_TILE_BYTES + V_TILE_BYTES) + BIAS_TILE_BYTES;
    static constexpr int KV_STAGES = STAGES;
    // The persistent grid stages O in a buffer of its own, after the ring (Q's shape and layout),
    // because the Q buffer takes the next work tile's Q while the epilogue runs. Otherwise O is
    // staged in the Q buffer (Q_REGION_BYTES holds its O_PANELS panels).
    static constexpr int O_BYTES = PERSISTENT ? O_PANELS * Q_PANEL_BYTES : 0;
    // Q's region, the ring and the O buffer, with the alignment's slack.
    static constexpr int RING_SMEM_BYTES =
        Q_REGION_BYTES + STAGES * STAGE_BYTES + O_BYTES + SMEM_ALIGN;

    // TRANSPOSE_V (e4m3): V's TMA reads the caller's V as it lies (rows of keys, as the 16-bit
    // path's v_map: V_PANELS panels of BLOCK_N 128-byte rows, 128-byte swizzle; at d=64 the
    // rows are half used and the TMA zero-fills the rest, as K's) into a ring of RAW_V_STAGES
    // buffers after the K/V ring and O's, and the producer warpgroup's warps 1 ..
    // TRANSPOSE_WARPS write it keys-last, in P's key order, into the stage's V tile
    // (sm90/fwd_transpose_v.cuh): the same bytes the operand pass and the TMA put there, so the
    // mainloop (issue_pv) and P's packing are those of the keys-last V. No operand pass, no
    // scratch array, and V read in place (varlen needs no keys-last grouping).
    // Two raw buffers where they fit 227 KiB (d=64 with 256 keys x 3 stages: 225 KiB; d=128
    // with 128 keys x 4 stages: 193 KiB), else one (d=256 with 128 keys x 2 stages: 225 KiB):
    // the transpose of tile j then waits for the load of tile j, issued once tile j - 1's was
    // transposed, under the consumers' work on the stages before.
    static constexpr bool TRANSPOSE_V = Elem::IS_E4M3;
    static constexpr int TRANSPOSE_WARPS = SM90_TRANSPOSE_V_WARPS;
    static constexpr int RAW_V_TILE_BYTES = TRANSPOSE_V ? V_PANELS * KV_PANEL_BYTES : 0;
    static constexpr int RAW_V_STAGES =
        !TRANSPOSE_V ? 0 : RING_SMEM_BYTES + 2 * RAW_V_TILE_BYTES <= 227 * 1024 ? 2 : 1;
    static constexpr int RAW_V_OFFSET = STAGES * STAGE_BYTES + O_BYTES;  // from the ring's base
    // A transposer step is 32 keys (a group of P's order) by 16 head-dim bytes (ldmatrix.x4.trans,
    // stmatrix.x4), a unit the four steps of one VT panel (128 keys) and one 16-byte head-dim
    // chunk, with constant offsets between them (a last panel of VT_TAIL_GROUPS groups: that
    // many steps); a tile's units go round the TRANSPOSE_WARPS warps (d=64 and 128: 8 units,
    // 3 + 3 + 2; d=256: 16, 6 + 5 + 5; d=128 with 160-224 keys: 16, 6 + 5 + 5).
    static constexpr int TRANSPOSE_UNITS = VT_PANELS * (HEAD_DIM_V / 16);
    // The persistent grid's transposers walk the tile scheduler's work tiles themselves, whose
    // state does not fit 24 registers beside the transpose (8 bytes spilled with the static
    // schedule): their warpgroup takes SM90_WIDE_PRODUCER_REGISTERS (32), and the consumers
    // what the CTA's registers at entry leave them (ENTRY_REGISTERS x THREADS: setmaxnreg.inc
    // waits for registers of that pool, forever where the split asks more): 232.
    static constexpr bool WIDE_PRODUCER = TRANSPOSE_V && PERSISTENT;
    static constexpr int PRODUCER_REGISTERS =
        WIDE_PRODUCER ? SM90_WIDE_PRODUCER_REGISTERS : Sm90CtaLayout::PRODUCER_REGISTERS;
    static constexpr int CONSUMER_REGISTERS =
        WIDE_PRODUCER ? (ENTRY_REGISTERS * THREADS - PRODUCER_REGISTERS * WARPGROUP_THREADS) /
                            CONSUMER_THREADS / 8 * 8
                      : BASE_CONSUMER_REGISTERS;
    static constexpr int SMEM_BYTES = RING_SMEM_BYTES + RAW_V_STAGES * RAW_V_TILE_BYTES;

    // The e4m3 d=128 tiles wider than 128 keys with the overlap hold S, the previous P and O (at
    // 192 keys 96 + 24 + 64 registers) beside the loop's own state: there ptxas kept Q's k-step
    // descriptors (loop-invariant, 8 registers) across the loop and spilled 36 bytes. Made again
    // each tile from an opaque copy of Q's address (a few integer instructions under the GEMMs),
    // they fit (fwd_mainloop.cuh, the overlap's loop).
    static constexpr bool FRESH_Q_DESCRIPTORS = Elem::IS_E4M3 && HEAD_DIM == 128 && BLOCK_N > 128;
    // The online softmax's lazy rescale (online_softmax.cuh), but for e4m3 elements: their P is
    // rounded to e4m3, and a row's largest probability is then exactly 1 only where the max
    // moves with every tile that raises it (docs/FP8_FORWARD.md, "Accuracy").
    static constexpr bool LAZY_RESCALE = !Elem::IS_E4M3;
    // e4m3: P taken 2^E4M3_P_SCALE_LOG2 times larger, a row's largest 256 (online_softmax.cuh).
    static constexpr int P_SCALE_LOG2 = Elem::IS_E4M3 ? E4M3_P_SCALE_LOG2 : 0;
    static constexpr int DIM = HEAD_DIM;
    static constexpr int DIM_V = HEAD_DIM_V;  // P V's N
    static constexpr int KEYS_PER_TILE = BLOCK_N;
    static constexpr int N_TILES = BLOCK_N / 8;    // n8 column groups of S (accumulator layout)
    static constexpr int D_TILES = HEAD_DIM_V / 8;  // n8 column groups of O
    // k-steps of 32 bytes a row: k16 (16-bit), k8 (TF32) or k32 (e4m3) wgmmas
    static constexpr int QK_STEPS = ROW_WORDS / 16;     // of Q K^T (over the head dim)
    static constexpr int PV_STEPS = BLOCK_N * BYTES / 32;  // of P V (over the keys)
    static constexpr int P_FRAGS = PARTS * PV_STEPS;  // P's A fragments (SPLIT: big, small)
    static constexpr int O_CHUNKS = O_ROW_WORDS / 8;    // 16-byte chunks of an O row
    // A warpgroup whose rows see only the left half of their first KV tile's keys (the diagonal
    // tile of a causal row block's upper half, a short sequence tail) runs the softmax of that
    // half alone (consume_kv_tiles in sm90/fwd_mainloop.cuh, the ping-pong + overlap schedule): whole k16 slices of P. Not
    // with score modifiers: the second copy of the first tile's softmax then makes ptxas spill
    // (d=96 and 128 on the persistent grid).
    template <int FEATURES>
    static constexpr bool HALF_TILES =
        BLOCK_N % 32 == 0 && BLOCK_N * BYTES % 64 == 0 &&  // whole P steps a half
        (FEATURES & (FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_BIAS_TILE)) == 0;

    // wgmma N (dense f16 / bf16) is a multiple of 8 up to 256; the k16 steps over the head dim
    // (Q K^T) and over the keys (P V) make both multiples of 16 here. A K/V panel of BLOCK_N rows
    // is then a whole number of 1024-byte swizzle atoms (8 rows x 128 B), which the descriptors'
    // base offset 0 and the V descriptor's LBO (one panel) need.
    static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 16 && HEAD_DIM <= 256,
                  "k16 steps of Q K^T over HEAD_DIM, a panel count within the TMA's box");
    static_assert(HEAD_DIM_V % 16 == 0 && HEAD_DIM_V >= 16 && HEAD_DIM_V <= 256,
                  "wgmma N of P V (= HEAD_DIM_V): a multiple of 16 up to 256");
    static_assert(HEAD_DIM_V <= HEAD_DIM, "V's head dim at most Q's");
    static_assert(ROW_WORDS % 16 == 0, "whole 32-byte k-steps of Q K^T (e4m3: HEAD_DIM % 32)");
    static_assert(!KEYS_LAST_V || HEAD_DIM_V == HEAD_DIM,
                  "float32, e4m3: one head dim (the keys-last V's layouts)");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256,
                  "wgmma N of Q K^T (= BLOCK_N): a multiple of 16 up to 256");
    static_assert(KV_PANEL_BYTES % 1024 == 0 && Q_PANEL_BYTES % 1024 == 0, "whole swizzle atoms");
    static_assert(ROWS_PER_WARPGROUP * O_CHUNKS % WARPGROUP_THREADS == 0,
                  "the epilogue's 16-byte chunks split evenly over a warpgroup");
    static_assert(!KEYS_LAST_V || ((TRANSPOSE_V || BLOCK_N * BYTES % ROW_BYTES == 0) &&
                                   BLOCK_N * BYTES % 32 == 0 && VT_PANEL_BYTES % 1024 == 0),
                  "keys-last V: whole panels of keys (the transposed V: whole 32-key groups), "
                  "whole swizzle atoms");
    static_assert(!KEYS_LAST_V || (!BIAS && (Elem::IS_E4M3 || !PERSISTENT)),
                  "float32, e4m3: no bias tiles; float32 on the one-tile-per-CTA grid");
    static_assert(!TRANSPOSE_V || (KEYS_LAST_V && BYTES == 1 && RAW_V_TILE_BYTES % 1024 == 0),
                  "the in-kernel transpose: e4m3 bytes (ldmatrix's 16-bit elements are byte pairs)");
    static_assert(BLOCK_M % ROWS_PER_WARPGROUP == 0 && CONSUMER_WARPGROUPS >= 1, "whole WGs");
    static_assert(BLOCK_M <= 256 && BLOCK_N <= 256, "a TMA box has at most 256 rows");
    static_assert(STAGES >= 2, "a ring of at least two K/V stages");
    static_assert(!BIAS || BLOCK_N % PANEL_COLS == 0, "the bias's tile: whole 64-key panels");
    static_assert(split_fits(CONSUMER_THREADS, BASE_CONSUMER_REGISTERS) &&
                      PRODUCER_REGISTERS * WARPGROUP_THREADS +
                              CONSUMER_REGISTERS * CONSUMER_THREADS <=
                          ENTRY_REGISTERS * THREADS,
                  "the setmaxnreg split fits the registers the CTA has at entry");
    static_assert(!PERSISTENT || SMEM_BYTES <= 227 * 1024,
                  "persistent: Q, the K/V ring and an O buffer must fit 227 KiB (head dims 64 and "
                  "128 with 2 stages, 96 with 2 stages instead of 3; 192 and 256 do not fit)");
    static_assert(SMEM_BYTES <= 227 * 1024, "one CTA per SM");
};
