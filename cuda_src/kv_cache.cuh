// Where a sequence's cached keys and values live: a contiguous cache (batch_cache, seqlen_cache,
// nheads_kv, headdim) read at row cache_batch_idx[b], or a paged one (num_blocks, page_size,
// nheads_kv, headdim) read through block_table[b, position / page_size].
//
// A position is located once for K and V (KVCacheIndex: the block, 0 when contiguous, and the row
// inside it), then each tensor turns (block, row) into an address (KVCacheRows). A block id or
// cache row outside the cache locates nothing (the kernels then neither read nor write that
// row), so unchecked bad indices never reach memory outside the cache.
#pragma once
#include "mma_primitives.cuh"
#include "rotary.cuh"

struct KVCacheIndex {
    const int* block_table;  // paged: this sequence's row of block_table; nullptr if contiguous
    int page_size;
    int page_shift;          // log2(page_size) when a power of two (shift and mask), else -1
    int num_blocks;          // paged: blocks in the cache
    bool valid;              // contiguous: the cache row exists

    // The block and the row inside it that hold `position`; false if outside the cache.
    CF2_DEVICE bool locate(int position, int& block, int& row) const {
        if (block_table == nullptr) {
            block = 0;
            row = position;
            return valid;
        }
        const int slot = page_shift >= 0 ? position >> page_shift : position / page_size;
        row = position - slot * page_size;
        block = block_table[slot];
        return block >= 0 && block < num_blocks;
    }
};

// One cache tensor (K or V) at one KV head, of elements `Stored` (u16: q's 16-bit type; an
// e4m3 cache's bytes, kv_cache_e4m3.cuh).
template <typename Stored>
struct KVCacheRowsOf {
    const Stored* head_base;  // cache + kv_head * head_stride (+ cache row * batch stride if contiguous)
    i64 block_stride;         // paged: elements between blocks
    i64 row_stride;           // elements between positions (inside a block when paged)

    CF2_DEVICE const Stored* at(int block, int row) const {
        return head_base + block * block_stride + row * row_stride;
    }
};
using KVCacheRows = KVCacheRowsOf<u16>;

// The index of batch entry `batch`; `cache_row` is the contiguous cache's row (0 when paged).
// num_blocks: blocks of a paged cache, or rows (batch entries) of a contiguous one.
CF2_DEVICE KVCacheIndex kv_cache_index(const int* cache_batch_idx, const int* block_table,
                                       i64 block_table_stride, int page_size, int num_blocks,
                                       int batch, int& cache_row) {
    KVCacheIndex index;
    index.page_size = page_size;
    index.page_shift = __popc(page_size) == 1 ? __ffs(page_size) - 1 : -1;
    index.num_blocks = num_blocks;
    if (block_table != nullptr) {
        index.block_table = block_table + batch * block_table_stride;
        index.valid = true;
        cache_row = 0;
    } else {
        index.block_table = nullptr;
        cache_row = cache_batch_idx != nullptr ? cache_batch_idx[batch] : batch;
        index.valid = cache_row >= 0 && cache_row < num_blocks;
        if (!index.valid) cache_row = 0;
    }
    return index;
}

template <typename Stored>
CF2_DEVICE KVCacheRowsOf<Stored> kv_cache_rows(const Stored* cache, i64 batch_stride,
                                               i64 row_stride, i64 head_stride, int cache_row,
                                               int kv_head) {
    return KVCacheRowsOf<Stored>{cache + cache_row * batch_stride + kv_head * head_stride,
                                 batch_stride, row_stride};
}

// The items of an append of `seqlen_new` tokens, `chunks` chunks a row, dealt round `threads`
// threads: each (token, chunk) whose position cache_len + token lies in [0, capacity) and in the
// cache (index.locate) goes to store(token, chunk, position, block, row). Positions outside and
// rows outside the cache are skipped, so unchecked bad values never write out of bounds.
template <class Store>
CF2_DEVICE void for_each_new_chunk(const KVCacheIndex& index, int seqlen_new, int cache_len,
                                   int capacity, int chunks, int tid, int threads,
                                   Store&& store) {
    for (int idx = tid; idx < seqlen_new * chunks; idx += threads) {
        const int token = idx / chunks, chunk = idx % chunks;
        const int position = cache_len + token;
        int block, row;
        if (position < 0 || position >= capacity || !index.locate(position, block, row)) continue;
        store(token, chunk, position, block, row);
    }
}

// Appends the new tokens of one (sequence, KV head) in place: token i goes to position
// cache_len + i. Positions outside [0, capacity) and rows outside the cache are skipped, so
// unchecked bad values never write out of bounds. The decode kernel calls this from one CTA per
// (sequence, KV head) and reads the new tokens from k_new / v_new itself, so no CTA reads a cache
// row that is being written. With a RotaryTable (rotary.cuh) the new keys are rotated at their
// positions on the way (Elem: q's 16-bit type); with NoRotary they are copied as they are.
template <typename Elem, class Rotary>
CF2_DEVICE void append_new_rows(const KVCacheIndex& index, const KVCacheRows& k_rows,
                                const KVCacheRows& v_rows, const u16* k_new_rows,
                                i64 kn_row_stride, const u16* v_new_rows, i64 vn_row_stride,
                                int seqlen_new, int cache_len, int capacity, int head_dim,
                                int tid, int threads, const Rotary& rotary) {
    for_each_new_chunk(index, seqlen_new, cache_len, capacity, head_dim / 8, tid, threads,
                       [&](int token, int chunk, int position, int block, int row) {
        u32 k_vals[4], v_vals[4];  // both loads in flight, then both stores
        if constexpr (Rotary::ENABLED)
            rotary.template load_chunk<Elem>(k_vals, k_new_rows + token * kn_row_stride, chunk,
                                             position);
        else
            load_16B_global_l2(k_vals, k_new_rows + token * kn_row_stride + chunk * 8);
        load_16B_global_l2(v_vals, v_new_rows + token * vn_row_stride + chunk * 8);
        store_16B_global(const_cast<u16*>(k_rows.at(block, row)) + chunk * 8, k_vals);
        store_16B_global(const_cast<u16*>(v_rows.at(block, row)) + chunk * 8, v_vals);
    });
}

// The append of a cache whose V is the first columns of K's rows (MLA's latent cache, one KV
// head): each new row written once, all head_dim columns (for_each_new_chunk's items).
CF2_DEVICE void append_latent_rows(const KVCacheIndex& index, const KVCacheRows& rows,
                                   const u16* new_rows, i64 new_row_stride, int seqlen_new,
                                   int cache_len, int capacity, int head_dim, int tid,
                                   int threads) {
    for_each_new_chunk(index, seqlen_new, cache_len, capacity, head_dim / 8, tid, threads,
                       [&](int token, int chunk, int, int block, int row) {
        u32 vals[4];
        load_16B_global_l2(vals, new_rows + token * new_row_stride + chunk * 8);
        store_16B_global(const_cast<u16*>(rows.at(block, row)) + chunk * 8, vals);
    });
}
