// FlashAttention-2 backward (Dao, 2023, Algorithm 2) for Hopper (sm_90a): wgmma, TMA and warp
// specialisation (docs/HOPPER_BWD.md).
//
// The algorithm is the one of flash_bwd.cu. KV is the outer loop: one CTA owns BLOCK_N keys of
// one (batch, KV head), keeps K and V of them in shared memory and dK, dV of them in registers,
// and walks over the query blocks (of every query head sharing the KV head, so GQA's dK/dV sums
// stay in fp32 registers) whose rows can see its keys. Per query block i (BLOCK_M rows):
//   S = Q_i K^T, P = exp2(S * scale_log2 - lse_log2)     (recomputed from the forward's lse)
//   dP = dO_i V^T, dS = P o (dP - D)                      (D = rowsum(dO o O), the preprocess)
//   dV += P^T dO_i,  dK += dS^T Q_i                       (registers, the whole loop)
//   dQ_i += dS K                                          (fp32 atomics into dq_accum)
// and at the end dK *= softmax_scale (dQ gets it in flash_bwd_convert_dq.cu).
//
// Hopper's split of the work:
//  - warpgroup 0 is the producer (setmaxnreg.dec): its thread 0 loads K and V once (TMA, one
//    mbarrier), then, per query block, Q_i with its lse_log2 rows and dO_i with its D rows into a
//    STAGES-deep ring (TMA tiles + bulk copies of the statistics; q_full and do_full per stage,
//    released by stage_empty when both consumers are done with the stage).
//  - warpgroups 1 and 2 are consumers (setmaxnreg.inc), each owning 64 of the BLOCK_N = 128 keys.
//    Keys are the M of wgmma (M = 64 a warpgroup): they compute the transposed products
//      S^T = K_c Q_i^T and dP^T = V_c dO_i^T     (SS: both operands K-major descriptors),
//    so that P^T and dS^T come out of the accumulators in the A-operand register layout of
//      dV += P^T dO_i and dK += dS^T Q_i         (RS: dO_i, Q_i MN-major descriptors, as V of
//                                                 the forward's P V),
//    the same accumulator -> A repacking as the forward's P (hopper_primitives.cuh). The per-row
//    statistics are per *column* of S^T: each thread reads the 16 query rows it holds from the
//    stage's lse / D arrays in shared memory.
//  - dQ needs dS with queries as rows (M = queries): each consumer stores its dS^T transposed
//    (stmatrix .trans) into a shared dS tile [BLOCK_M queries x BLOCK_N keys], both consumers
//    meet at a named barrier, and consumer c computes its share of dQ_i = dS K (SS: dS K-major,
//    K MN-major, all 128 keys, M = 64 queries): with 64-row steps the columns of its half of the
//    head dim, dQ_i[:, cols_c]; with 128-row steps (d=64) its 64 rows, dQ_i[rows_c, :]. The dS
//    tile is double-buffered (by step parity), so the one barrier a step suffices.
//  - dQ goes to the fp32 accumulator dq_accum in dq_accum.cuh's interleaved column order (the
//    wgmma accumulator is, per warp, the mma.sync m16n8 layout that order was made for), so the
//    existing preprocess (which zeroes dq_accum) and flash_bwd_convert_dq.cu serve unchanged.
//    Up to d=128 (DQ_STAGED) the consumers store dQ_i into a shared fp32 tile laid out as its
//    rows of dq_accum (DQ_BUFFERS of them taken in turn: two, or one at 128-row steps, whose
//    shared memory has no room for a second), and one producer thread adds the whole
//    tile with one bulk reduction, cp.reduce.async.bulk .add.f32 (FlashAttention-3's dQ path):
//    vector reductions from the consumers' registers (red.global.add.v4.f32, the path of the
//    wider head dims, whose shared memory has no room for the tiles) hold those registers until
//    the memory system has taken them, and the next step's products waited on that (Nsight
//    Compute: a third of the consumers' stalls on L1TEX at d=128).
//  - Deterministic mode (DETERMINISTIC; FlashAttention-3's): the key blocks add to a query
//    block's rows of dq_accum in a fixed order, so every run adds the same numbers in the same
//    order. A semaphore per (batch, head, query block, head-dim chunk), zeroed by the preprocess,
//    counts the key blocks that have added. The dQ thread of a key block waits until it reads
//    the block's turn, then with staged dQ adds, frees the staged tile once the reduction has read
//    it (the consumers go on), waits for the reduction to complete and increments the count;
//    with vector reductions (d=192 / 256) it hands the turn to the consumers (dq_empty), which
//    add and arrive on dq_full, and increments the count after them. The key blocks that see a
//    query block are a contiguous range first .. last (a window's edges both grow with the key
//    block; last: KeyVisibility::tile_range of its rows); they add from the last down, key
//    block n's turn last - n (first does not enter). The grid runs the key blocks from the last
//    down too (grid x reversed), so a key block waits only on higher ones, which the GPU
//    dispatched before it, and its steps run query block by query block from its first up
//    (QueryBlockWalk): a higher key block's first query block is no earlier, so it reaches each
//    query block at the same step as the lower one (no causal edge) or earlier (causal or right
//    window edge), and the lower one waits about a reduction's latency at most.
//
// Masking: the query blocks a key block sees come from KeyVisibility (causal, windows, bottom-
// right aligned); blocks outside are never loaded. Masks run only on boundary steps (the key
// block's tail, or a window edge crossing the block), on the transposed tile (keys as rows).
// Rows past seqlen_q need no mask: the TMA zero-fills Q and dO there and the preprocess padded
// lse_log2 with +inf (P = 0) and D with 0. Keys past seqlen_k are zero rows of K and V (and
// masked on the tail step); their dK, dV are never stored.
// Score modifiers as flash_bwd.cu: softcap's t = tanh(s * softcap_scale) before the mask, P from
// (t + ALiBi bias) * scale_log2, and dS = P (1 - t^2) (dP - D).
//
// Head dims 64, 96, 128, 192, 256 (one specialisation each; a user head dim below runs on the
// next one, the TMA zero-filling the columns past it). dK and dV of 64 keys take as many fp32
// registers a consumer thread as they have columns, so above 128 a key block's columns are split
// over two CTAs, as flash_bwd.cu does (grid.x = key block x head-dim chunk): chunk 0 computes dK,
// dV, dQ of columns 0 .. 127, chunk 1 the rest (d=192: 64, computed 128 wide and the rest
// discarded; d=256: 128), each recomputing S^T and dP^T over the whole head dim (K, V, Q_i, dO_i
// are whole-width tiles). docs/HOPPER_BWD.md compares this with FlashAttention-3's tiles.
// Left out (static_assert): dropout.
//
// The kernel is the composition of its parts in sm90/ (as FlashAttention-3's hopper/ kernels:
// mainloop, epilogue, tile scheduler), each a header of one idea:
//   bwd_traits.cuh          BwdSm90Traits (tiles, registers, named barriers), the smem layout
//   bwd_barriers.cuh        BwdSm90Barriers (the mbarriers) and their initialisation
//   bwd_tile_scheduler.cuh  the CTA's work (cta_work), the query blocks its keys see, the steps'
//                           order (QueryBlockWalk) and the deterministic dQ turns
//   bwd_producer.cuh        the producer thread: K / V once, the Q / dO ring
//   bwd_dq_writer.cuh       dQ to dq_accum: the consumers' writes and the dQ thread's loop
//   bwd_scores.cuh          the score-tile pieces of a step (mask, P^T, dS^T, the dS tile)
//   bwd_mainloop.cuh        the consumers' loop: S^T, dP^T, the scores, dV, dK, dQ
//   bwd_epilogue.cuh        dK / dV stored (or zeros where no query sees the keys)
// The kernel below works out the CTA's work, then runs the roles.
#include "hopper_primitives.cuh"
#include "masking.cuh"
#include "varlen.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_barriers.cuh"
#include "sm90/bwd_tile_scheduler.cuh"
#include "sm90/bwd_producer.cuh"
#include "sm90/bwd_dq_writer.cuh"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_epilogue.cuh"

// FEATURES: the score modifiers of score_mods.cuh (softcap, ALiBi), or 0; DQ_BUFFERS: dQ through
// that many shared-memory tiles and bulk reductions (0: vector reductions); DETERMINISTIC: those
// in key-block order (above). The parameters: BwdSm90Params (kernel_params.cuh); grid (key
// blocks, KV heads, batch), as flash_bwd.cu's.
template <typename Elem, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, int FEATURES,
          int DQ_BUFFERS, bool DETERMINISTIC>
__global__ void __launch_bounds__(
    BwdSm90Traits<Elem, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS>::THREADS, 1)
flash_bwd_sm90_kernel(const __grid_constant__ BwdSm90Params params) {
    using T = BwdSm90Traits<Elem, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS>;
    static_assert((FEATURES & FEATURE_DROPOUT) == 0, "dropout runs on the mma.sync backward");
    constexpr bool VARLEN = (FEATURES & FEATURE_VARLEN) != 0;
    // DETERMINISTIC: chunk c of a query block orders its additions on the semaphore of the
    // block's first row, plus c (a slot per DQ_SEMAPHORE_ROWS rows of the per-row arrays: a
    // varlen sequence's rows start on a 4-row boundary, and a block has more slots than chunks).
    static_assert(BLOCK_M % DQ_SEMAPHORE_ROWS == 0 &&
                      BLOCK_M / DQ_SEMAPHORE_ROWS >= T::NUM_CHUNKS,
                  "ordered dQ: a semaphore slot per query block and head-dim chunk");
    const BwdParams& p = params.base;

    extern __shared__ unsigned char smem[];
    __shared__ BwdSm90Barriers<STAGES> bars;
    const BwdSm90Smem<T> sm(smem);
    const u32 kv_full = smem_address(&bars.kv_full);

    const CtaWork work = cta_work<DETERMINISTIC>(params.dispatch_group_pairs);
    const int kv_block = work.x / T::NUM_CHUNKS;
    const int chunk = work.x % T::NUM_CHUNKS;  // of the head dim (0 up to d=128)
    // This CTA's first dK / dV / dQ column, and whether its chunk is the narrower last one (d=192:
    // 64 columns, computed 128 wide, the rest discarded). Constants up to d=128.
    const int col0 = chunk * T::CHUNK_COLS;
    const bool narrow = T::HAS_NARROW && chunk == T::NUM_CHUNKS - 1;
    const int kv_head = work.kv_head;
    const int batch = work.batch + p.batch_offset;
    const int key_first = kv_block * BLOCK_N;
    // This batch entry's rows (VARLEN: one packed sequence, varlen.cuh; the grid is sized by the
    // longest, and a key block past its sequence's end exits here, the whole CTA, before any
    // barrier is initialised). The maps of VARLEN calls cover the packed arrays with a batch
    // extent of 1: rows count from the sequence's first row, the batch coordinate is 0.
    const SequenceRows seq_q = query_rows<VARLEN>(p, batch);
    const SequenceRows seq_k = key_rows<VARLEN>(p, batch);
    const int seqlen_q = seq_q.length;
    const int seqlen_k = seq_k.length;
    if (VARLEN && key_first >= seqlen_k) return;
    const int map_batch = VARLEN ? 0 : batch;
    // First row of the sequence's per-row statistics and dQ accumulator for query head `head`.
    auto stats_first = [&](int head) {
        return stats_row0<VARLEN>(batch, head, p.nheads, p.seqlen_q_padded, seq_q.start);
    };
    const int key_last = min(key_first + BLOCK_N, seqlen_k) - 1;

    // Query blocks whose rows can see keys [key_first, key_last] (causal / window), as
    // flash_bwd.cu; a step is one (query head of the group, query block) pair.
    const KeyVisibility vis{seqlen_k - seqlen_q, p.window_left, p.window_right, seqlen_k};
    const QueryBlocks blocks = query_blocks<BLOCK_M>(p, vis, seqlen_q, key_first, key_last);
    const int steps = blocks.count * p.heads_per_kv_head;
    const int head_chunks = p.head_dim / 8;
    u16* dk_block = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
                    (seq_k.start + key_first) * p.dk_row_stride;
    u16* dv_block = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
                    (seq_k.start + key_first) * p.dv_row_stride;

    if (steps == 0) {
        store_zero_key_gradients<T>(p, dk_block, dv_block, key_first, seqlen_k, head_chunks,
                                    col0, threadIdx.x);
        return;
    }
    // (threadIdx.x is read here, in the kernel, rather than in the parts: a part that reads it
    // changed where the compiler reads it everywhere, and the machine code with it.)
    if (threadIdx.x == 0) init_barriers<T>(bars, key_first);
    __syncthreads();

    // Step j (query head h, block m: QueryBlockWalk, advanced incrementally) uses stage
    // j % STAGES, whose barriers are in their (j / STAGES)-th phase.
    const int warpgroup = threadIdx.x / T::WARPGROUP_THREADS;
    if (warpgroup == 0) {
        // ---- producer ----
        setmaxnreg_dec<T::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            load_kv<T>(params, sm, kv_full, seq_k.start + key_first, kv_head, map_batch);
            load_query_blocks<T, DETERMINISTIC>(params, sm, bars, blocks, steps, kv_head,
                                                seq_q.start, map_batch, stats_first);
        } else if ((T::DQ_STAGED || DETERMINISTIC) && threadIdx.x == 32) {
            reduce_dq_tiles<T, DETERMINISTIC>(p, sm, bars, vis, blocks, steps, kv_head, kv_block,
                                              chunk, seqlen_q, stats_first);
        }
    } else {
        // ---- consumers: warpgroup 1 + c owns keys 64 c .. 64 c + 63 of the block ----
        setmaxnreg_inc<T::CONSUMER_REGISTERS>();
        const int consumer = warpgroup - 1;
        const int warp = (threadIdx.x / 32) % 4;  // in the warpgroup: keys 16 warp .. + 15
        const int lane = threadIdx.x % 32;
        const int key0 = T::KEYS_PER_WARPGROUP * consumer;  // in the block
        const u32 k_rows = sm.k + key0 * T::ROW_BYTES;      // A operands of S^T and dP^T
        const u32 v_rows = sm.v + key0 * T::ROW_BYTES;
        float acc_dk[T::D_TILES][4], acc_dv[T::D_TILES][4];
        consumer_mainloop<Elem, T, FEATURES, DETERMINISTIC>(
            acc_dk, acc_dv, p, sm, bars, vis, blocks, steps, kv_head, batch, seqlen_q, seqlen_k,
            chunk, col0, narrow, consumer, warp, lane, k_rows, v_rows, stats_first);
        stage_key_gradients<Elem, T>(acc_dk, acc_dv, p, sm, warp, lane, key0);
        named_barrier_sync(T::STORE_BARRIER + consumer, T::WARPGROUP_THREADS);
        store_key_gradients<T>(p, sm, dk_block, dv_block, key_first, seqlen_k, head_chunks, col0,
                               key0, threadIdx.x % T::WARPGROUP_THREADS);
    }
}
