// A KV cache of e4m3 bytes (attention_with_kvcache's kv_cache_dtype="e4m3"), read by the decode
// kernel with 16-bit queries: the cache is streamed at one byte an element, then converted to
// q's 16-bit type in shared memory, where the mma reads it as it reads a 16-bit cache.
//
// - A KV stage holds the tile's bytes as they are in the cache (E4M3Tile: rows of head-dim
//   bytes, 16-byte chunks of 16 elements, filled by cp.async).
// - Each warp converts only the rows of its own keys (the decode kernel's warps split a tile by
//   keys, each reading its rows of K and V only) into one 16-bit swizzled tile, so the
//   conversion needs no barrier beyond the warp's: K's rows before S = Q K^T, then V's into the
//   same rows before P V (one 16-bit tile, not two: 16 KiB more for stages at d=128, which on
//   sm_80 decides between one and two CTAs of three stages an SM).
// - The dequantised value is e4m3 * descale: the kernel multiplies the scores by k_descale and
//   the output by v_descale (so the conversion itself is exact and scale-free).
// - New tokens (16-bit k, v) are quantised as round_to_e4m3(x / descale), saturating to +-448
//   (fp8_convert.cuh), both where they are appended and where a tile reads them before the
//   append has landed: the attention sees the values that the cache then holds.
#pragma once
#include "mma_primitives.cuh"
#include "fp8_convert.cuh"
#include "kv_cache.cuh"

// A ROWS x COLS tile of e4m3 bytes, rows COLS bytes apart, unswizzled: cp.async fills it 16 bytes
// (8 lanes a 128-byte line) at a time and a warp's conversion reads 8-byte pieces of consecutive
// rows (256 contiguous bytes a warp), both free of bank conflicts.
template <int ROWS_, int COLS_>
struct E4M3Tile {
    static constexpr int ROWS = ROWS_;
    static constexpr int COLS = COLS_;
    static_assert(COLS % 16 == 0, "whole 16-byte chunks");
    static constexpr int CHUNK_ELEMS = 16;
    static constexpr int CHUNKS = COLS / CHUNK_ELEMS;
    static constexpr int BYTES = ROWS * COLS;

    CF2_DEVICE static u32 offset(int row, int chunk) { return row * COLS + chunk * 16; }
};

// Rows row0 .. row0 + ROWS - 1 of a staged byte tile (K or V) into the same rows of the 16-bit
// tile the mma reads, by one warp (its keys' rows). Each lane converts 8-element pieces: 8 bytes
// in, one 16-byte chunk out (8 lanes a row's 128-byte swizzled line: no bank conflicts).
template <typename Elem, class Staged, class Tile, int ROWS>
CF2_DEVICE void convert_rows_e4m3(u32 dst, u32 src, int row0, int lane) {
    static_assert(Staged::COLS == Tile::COLS, "one head dim");
    constexpr int PIECES = ROWS * Tile::CHUNKS;
    static_assert(PIECES % 32 == 0, "whole passes of the warp");
#pragma unroll 4
    for (int i = 0; i < PIECES / 32; ++i) {
        const int piece = lane + 32 * i;
        const int row = row0 + piece / Tile::CHUNKS, chunk = piece % Tile::CHUNKS;
        u32 bytes[2];
        asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                     : "=r"(bytes[0]), "=r"(bytes[1])
                     : "r"(src + row * Staged::COLS + chunk * 8));
        u32 out[4];
        e4m3x4_to_16bit<Elem>(bytes[0], out[0], out[1]);
        e4m3x4_to_16bit<Elem>(bytes[1], out[2], out[3]);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + Tile::offset(row, chunk)),
                     "r"(out[0]), "r"(out[1]), "r"(out[2]), "r"(out[3])
                     : "memory");
    }
}

// Q's B fragments of the decode kernel with its rows on the mma's n side (flash_decode.cu:
// lane l holds row g = l / 4, columns 2t, 2t + 1 (q[ks][0]) and 2t + 8, 2t + 9 (q[ks][1]) of
// each k16 step ks, t = l % 4; the quad of lanes 4g .. 4g + 3 holds the whole row), bf16, as f16
// for the f16 mma of an e4m3 cache (fp8_convert.cuh: CF2_E4M3_CVT). Each row is multiplied by
// the power of two that puts its largest magnitude in [2^14, 2^15): within f16's range (largest
// finite 65504), where bf16 reaches 3.4e38, and exact for every element down to 2^-28 of that
// largest (f16's normals span 2^30 from there, and a bf16 value has 8 significant bits); those
// below become f16 subnormals, off by less than 2^-39 of it. NaN elements stay NaN (fmaxf
// passes over them), infinities infinite. Returns in row_factor[j] the inverse power of two of
// row 2t + j, the row of this lane's scores of element parity j, to multiply them back with.
template <int STEPS>
CF2_DEVICE void q_fragments_bf16_to_f16(u32 (&q)[STEPS][2], float (&row_factor)[2], int lane) {
    float largest = 0.f;
#pragma unroll
    for (int ks = 0; ks < STEPS; ++ks)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            largest = fmaxf(largest, fmaxf(fabsf(__uint_as_float(q[ks][r] << 16)),
                                           fabsf(__uint_as_float(q[ks][r] & 0xffff0000u))));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
    // 2^(14 - E) for largest in [2^E, 2^(E + 1)); a row below 2^-113 (zeros: padding rows) takes
    // 2^127, which keeps it below 2^14.
    const int exponent = max(static_cast<int>(__float_as_uint(largest) >> 23), 14);  // biased
    const float scale = __uint_as_float(static_cast<u32>(268 - exponent) << 23);
#pragma unroll
    for (int ks = 0; ks < STEPS; ++ks)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            q[ks][r] = pack_pair<fp16_tag>(__uint_as_float(q[ks][r] << 16) * scale,
                                           __uint_as_float(q[ks][r] & 0xffff0000u) * scale);
    const float inverse = 1.f / scale;  // a power of two: exact
    const int t = lane % 4;
#pragma unroll
    for (int j = 0; j < 2; ++j)
        row_factor[j] = __shfl_sync(0xffffffffu, inverse, 4 * (2 * t + j));
}

// Sixteen 16-bit elements at `src` (a new token's, in global memory), quantised by `descale`.
template <typename Elem>
CF2_DEVICE void quantise_new_chunk(u32 (&out)[4], const u16* src, float descale) {
    u32 first[4], second[4];
    load_16B_global_l2(first, src);
    load_16B_global_l2(second, src + 8);
    quantise_16_to_e4m3<Elem>(out, first, second, descale);
}

// Sixteen elements of a new token quantised into a staged tile's chunk (synchronously: the
// kernel's barrier before the tile is read orders these stores as it orders the cp.async ones).
template <typename Elem>
CF2_DEVICE void stage_new_chunk_e4m3(u32 smem, const u16* src, float descale) {
    u32 bytes[4];
    quantise_new_chunk<Elem>(bytes, src, descale);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(bytes[0]),
                 "r"(bytes[1]), "r"(bytes[2]), "r"(bytes[3]) : "memory");
}

// Sixteen elements (chunk16, 16-element units) of a new key's row rotated at `position`
// (rotary.cuh), then quantised by `descale`: rotated before quantised, as the 16-bit cache
// would hold them.
template <typename Elem>
CF2_DEVICE void quantise_rotated_chunk(u32 (&out)[4], const u16* row, int chunk16, int position,
                                       float descale, const RotaryTable& rotary) {
    u32 first[4], second[4];
    rotary.template load_chunk<Elem>(first, row, 2 * chunk16, position);
    rotary.template load_chunk<Elem>(second, row, 2 * chunk16 + 1, position);
    quantise_16_to_e4m3<Elem>(out, first, second, descale);
}

// kv_cache.cuh's append_new_rows for an e4m3 cache: the new 16-bit tokens quantised by their
// descale factors, 16 elements (16 bytes stored) an item; the keys rotated first with a
// RotaryTable.
template <typename Elem, class Rotary>
CF2_DEVICE void append_new_rows_e4m3(const KVCacheIndex& index, const KVCacheRowsOf<u8>& k_rows,
                                     const KVCacheRowsOf<u8>& v_rows, const u16* k_new_rows,
                                     i64 kn_row_stride, const u16* v_new_rows,
                                     i64 vn_row_stride, int seqlen_new, int cache_len,
                                     int capacity, int head_dim, float k_descale,
                                     float v_descale, int tid, int threads,
                                     const Rotary& rotary) {
    for_each_new_chunk(index, seqlen_new, cache_len, capacity, head_dim / 16, tid, threads,
                       [&](int token, int chunk, int position, int block, int row) {
        u32 k8[4], v8[4];
        if constexpr (Rotary::ENABLED)
            quantise_rotated_chunk<Elem>(k8, k_new_rows + token * kn_row_stride, chunk, position,
                                         k_descale, rotary);
        else
            quantise_new_chunk<Elem>(k8, k_new_rows + token * kn_row_stride + chunk * 16,
                                     k_descale);
        quantise_new_chunk<Elem>(v8, v_new_rows + token * vn_row_stride + chunk * 16, v_descale);
        store_16B_global(const_cast<u8*>(k_rows.at(block, row)) + chunk * 16, k8);
        store_16B_global(const_cast<u8*>(v_rows.at(block, row)) + chunk * 16, v8);
    });
}
