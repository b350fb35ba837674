// Appends new tokens to a KV cache in place (attention_with_kvcache's k, v): token i of sequence b
// goes to position cache_seqlens[b] + i of its cache rows (kv_cache.cuh: contiguous or paged).
// One warp per (token, KV head, sequence), lane c copying the 16-byte chunk c of the K and V rows.
// Positions outside [0, capacity) and rows outside the cache (bad block ids / cache rows) are
// skipped, so unchecked bad values never write out of bounds.
#include "mma_primitives.cuh"
#include "kv_cache.cuh"

extern "C" __global__ void __launch_bounds__(32)
kvcache_append_kernel(const u16* __restrict__ k_new, const u16* __restrict__ v_new,
                      u16* k_cache, u16* v_cache,
                      i64 kn_batch_stride, i64 kn_row_stride, i64 kn_head_stride,
                      i64 vn_batch_stride, i64 vn_row_stride, i64 vn_head_stride,
                      i64 kc_batch_stride, i64 kc_row_stride, i64 kc_head_stride,
                      i64 vc_batch_stride, i64 vc_row_stride, i64 vc_head_stride,
                      const int* __restrict__ cache_seqlens, const int* __restrict__ cache_batch_idx,
                      const int* __restrict__ block_table, i64 block_table_stride, int page_size,
                      int num_blocks, int capacity, int head_dim, int batch_offset) {
    const int token = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z + batch_offset;
    const int position = cache_seqlens[batch] + token;
    const int chunk = threadIdx.x;
    if (position < 0 || position >= capacity || chunk * 8 >= head_dim) return;
    const KVCacheRows k_rows = kv_cache_rows(k_cache, kc_batch_stride, kc_row_stride, kc_head_stride,
                                             cache_batch_idx, block_table, block_table_stride,
                                             page_size, num_blocks, batch, kv_head);
    const KVCacheRows v_rows = kv_cache_rows(v_cache, vc_batch_stride, vc_row_stride, vc_head_stride,
                                             cache_batch_idx, block_table, block_table_stride,
                                             page_size, num_blocks, batch, kv_head);
    u16* k_dst = const_cast<u16*>(k_rows.row(position));
    u16* v_dst = const_cast<u16*>(v_rows.row(position));
    if (k_dst == nullptr || v_dst == nullptr) return;  // a block id or row outside the cache
    u32 vals[4];
    load_16B_global(vals, k_new + batch * kn_batch_stride + token * kn_row_stride +
                              kv_head * kn_head_stride + chunk * 8);
    store_16B_global(k_dst + chunk * 8, vals);
    load_16B_global(vals, v_new + batch * vn_batch_stride + token * vn_row_stride +
                              kv_head * vn_head_stride + chunk * 8);
    store_16B_global(v_dst + chunk * 8, vals);
}
