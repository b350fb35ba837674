// The decode step of MLA's latent cache (DeepSeek-V3; docs/MLA_DECODE.md) for Hopper (sm_90a):
// a cache row of HEAD_DIM = 576 columns a token is K, its first HEAD_DIM_V = 512 columns V, one
// KV head shared by every query head. attention_with_kvcache runs it where k_cache is such a
// cache and v_cache the view of its first 512 columns (cuflash2/_kvcache.py).
//
// The rows are the heads: a step's query rows, its heads x query tokens packed as the decode
// kernel (flash_decode.cu) packs a GQA group, fill m64 wgmma tiles, one a CTA. The grid is (row
// block x KV split, 1, batch), as the decode kernel's without clusters.
//  - Warpgroup 0 is the producer (setmaxnreg.dec): one thread streams the split's 64-token cache
//    tiles by TMA into a 2-stage ring beside Q (sm90/mla_producer.cuh), all 576 columns of a
//    row once: a tile serves S = Q K^T and, its first 512 columns, O += P V.
//  - Warpgroups 1 and 2 are consumers (setmaxnreg.inc): each computes S over the block's 64
//    rows for half of a tile's keys (SS wgmma m64n32, 36 k16 steps), the two exchange their
//    rows' maxima for the online softmax and write their P into one panel, and each computes
//    O += P V over all the tile's keys for its half of V's columns (SS wgmma, N = 256): 64 x 512
//    fp32 of O is 128 registers a thread in each (sm90/mla_mainloop.cuh).
//  - Positions from the sequence's cache length on are written in the landed tile before it is
//    read: new tokens from k_new, positions past seqlen_k zeros (sm90/mla_mainloop.cuh). The
//    append of the new tokens into the cache runs meanwhile in the CTA of row block 0 and split
//    0 (kv_cache.cuh: append_latent_rows, each row once), as the decode kernel's does.
//  - With one split each consumer writes its columns of O and the lse; with more, the splits
//    merge as the decode kernel's do through L2 (sm90/mla_epilogue.cuh, split_merge.cuh; the
//    launch is cooperative).
//  - PAIRED (one split, two row blocks that see the same tiles: a cluster of 2 along x): the
//    two CTAs share every tile, each producer loading half its panels into both (TMA
//    multicast), so the cache crosses L2 once instead of once a row block; a stage goes back to
//    both producers, and neither CTA leaves before the other is done with its barriers.
// Not here (refused on the host): score modifiers, sinks, left windows, rotary, cache_leftpad,
// FP8 caches, programmatic launches.
#include "hopper_primitives.cuh"
#include "online_softmax.cuh"
#include "masking.cuh"
#include "variant.cuh"
#include "kv_cache.cuh"
#include "kernel_params.cuh"
#include "sm90/mla_traits.cuh"
#include "sm90/mla_producer.cuh"
#include "sm90/mla_mainloop.cuh"
#include "sm90/mla_epilogue.cuh"

template <typename Elem, bool PAIRED>
__global__ void __launch_bounds__(MlaDecodeTraits<Elem>::THREADS, 1)
flash_mla_decode_sm90_kernel(const __grid_constant__ MlaDecodeParams params) {
    using T = MlaDecodeTraits<Elem>;
    const DecodeParams& p = params.base;
    extern __shared__ unsigned char smem[];
    __shared__ MlaDecodeBarriers<T::STAGES> bars;
    const u32 smem_base = (smem_address(smem) + T::SMEM_ALIGN - 1) & ~(T::SMEM_ALIGN - 1u);
    const u32 q_smem = smem_base;
    const u32 kv_smem = q_smem + T::Q_BYTES;  // stage s at + s * TILE_BYTES

    const int m_block = blockIdx.x % p.num_m_blocks;
    const int split = blockIdx.x / p.num_m_blocks;
    MlaRowBlock b;
    b.batch = blockIdx.z + p.batch_offset;
    b.group = p.heads_per_kv_head;
    b.row_first = m_block * T::BLOCK_M;
    b.rows = min(T::BLOCK_M, p.seqlen_q * b.group - b.row_first);
    b.cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[b.batch] : p.cache_len_all;
    b.seqlen_k = min(max(b.cache_len + p.seqlen_new, 0), p.capacity);
    const KeyVisibility vis =
        AttentionVariant<0>::visibility(p.seqlen_q, b.seqlen_k, p.window_left, p.window_right);
    int tile_first, tile_end;
    vis.tile_range(b.row_first / b.group, (b.row_first + b.rows - 1) / b.group, T::BLOCK_N,
                   tile_first, tile_end);
    tile_first = max(tile_first, split * p.tiles_per_split);
    tile_end = min(tile_end, (split + 1) * p.tiles_per_split);

    if (threadIdx.x == 0) init_mla_barriers<T, PAIRED>(bars);
    int rank = 0;
    if constexpr (PAIRED) {
        rank = cluster_rank();
        cluster_sync();  // the other CTA's barriers are initialised before any arrival on them
    } else {
        __syncthreads();
    }
    int cache_row;
    const KVCacheIndex index = kv_cache_index(p.cache_batch_idx, p.block_table,
                                              p.block_table_stride, p.page_size, p.num_blocks,
                                              b.batch, cache_row);
    if (threadIdx.x < T::WARPGROUP_THREADS) {
        setmaxnreg_dec<T::PRODUCER_REGISTERS>();
        if (threadIdx.x == 0)
            produce_latent_tiles<T, PAIRED>(params, index, cache_row, tile_first, tile_end,
                                            kv_smem, bars, rank);
    } else {
        setmaxnreg_inc<T::CONSUMER_REGISTERS>();
        const int ctid = threadIdx.x - T::WARPGROUP_THREADS;
        const int consumer = ctid / T::WARPGROUP_THREADS;
        load_q_rows<T>(p, b, q_smem, ctid);
        fence_proxy_async_shared();  // plain stores, then the wgmmas' reads
        named_barrier_sync(T::CONSUMERS_BARRIER, T::CONSUMER_THREADS);
        if (p.seqlen_new > 0 && blockIdx.x == 0)
            append_latent_rows(index,
                               kv_cache_rows(p.k_cache, p.kc_batch_stride, p.kc_row_stride,
                                             p.kc_head_stride, cache_row, 0),
                               p.k_new + b.batch * p.kn_batch_stride, p.kn_row_stride,
                               p.seqlen_new, b.cache_len, p.capacity, T::HEAD_DIM, ctid,
                               T::CONSUMER_THREADS);
        float acc_o[1][T::D_TILES][4];
#pragma unroll
        for (int dt = 0; dt < T::D_TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
        OnlineSoftmax<1> softmax;
        consume_latent_tiles<Elem, T, PAIRED>(p, b, vis, tile_first, tile_end, consumer, ctid,
                                              q_smem, kv_smem, bars, acc_o, softmax);
        store_latent_block<Elem, T>(p, b, m_block, split, consumer, ctid, acc_o, softmax);
    }
    // The other CTA's consumers arrive on this CTA's empty barriers up to their last tile.
    if constexpr (PAIRED) cluster_sync();
}
