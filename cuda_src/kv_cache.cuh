// Where a sequence's cached keys and values live: a contiguous cache (batch_cache, seqlen_cache,
// nheads_kv, headdim) read at row cache_batch_idx[b], or a paged one (num_blocks, page_size,
// nheads_kv, headdim) read through block_table[b, position / page_size]. Either way the kernels
// see one function from a logical key position to the address of its row. A block id or cache row
// outside the cache gives nullptr (the kernels then neither read nor write that row), so unchecked
// bad indices never reach memory outside the cache.
#pragma once
#include "mma_primitives.cuh"

struct KVCacheRows {
    const u16* head_base;     // cache + kv_head * head_stride (+ cache row * batch stride if contiguous)
    i64 block_stride;         // paged: elements between blocks
    i64 row_stride;           // elements between positions (inside a block when paged)
    const int* block_table;   // paged: this sequence's row of block_table; nullptr if contiguous
    int page_size;
    int num_blocks;           // paged: blocks in the cache
    bool valid;               // contiguous: the cache row exists

    CF2_DEVICE const u16* row(int position) const {
        if (block_table == nullptr) return valid ? head_base + position * row_stride : nullptr;
        const int block = block_table[position / page_size];
        if (block < 0 || block >= num_blocks) return nullptr;
        return head_base + block * block_stride + (position % page_size) * row_stride;
    }
};

// The cache rows of batch entry `batch`, KV head `kv_head`.
CF2_DEVICE KVCacheRows kv_cache_rows(const u16* cache, i64 batch_stride, i64 row_stride,
                                     i64 head_stride, const int* cache_batch_idx,
                                     const int* block_table, i64 block_table_stride,
                                     int page_size, int num_blocks, int batch, int kv_head) {
    // num_blocks: blocks of a paged cache, or rows (batch entries) of a contiguous one.
    KVCacheRows rows;
    rows.row_stride = row_stride;
    rows.page_size = page_size;
    rows.block_stride = batch_stride;
    rows.num_blocks = num_blocks;
    rows.valid = true;
    if (block_table != nullptr) {
        rows.block_table = block_table + batch * block_table_stride;
        rows.head_base = cache + kv_head * head_stride;
    } else {
        rows.block_table = nullptr;
        const int cache_row = cache_batch_idx != nullptr ? cache_batch_idx[batch] : batch;
        rows.valid = cache_row >= 0 && cache_row < num_blocks;
        rows.head_base = cache + (rows.valid ? cache_row : 0) * batch_stride + kv_head * head_stride;
    }
    return rows;
}
