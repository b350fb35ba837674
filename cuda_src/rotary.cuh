// Rotary position embedding in the decode kernel (attention_with_kvcache's rotary_cos /
// rotary_sin, flash-attn's flash_attn_with_kvcache semantics; docs/ROTARY.md). The new keys are
// rotated where they are appended and where a KV tile reads them (kv_cache.cuh,
// kv_cache_e4m3.cuh, flash_decode.cu's load_kv_tile_async), q where it is loaded.
//
// The angles of position p are row p of cos / sin, (seqlen_ro, rotary_dim / 2) in q's 16-bit
// type; the first rotary_dim elements of a row are rotated, the others kept:
// - GPT-NeoX (not interleaved): element j < rotary_dim / 2 pairs with j + rotary_dim / 2,
//   x'_j = x_j c_j - x_{j+h} s_j, x'_{j+h} = x_{j+h} c_j + x_j s_j (h = rotary_dim / 2);
// - GPT-J (interleaved): elements 2i and 2i + 1 pair,
//   x'_2i = x_2i c_i - x_2i+1 s_i, x'_2i+1 = x_2i s_i + x_2i+1 c_i.
// In fp32, each product and the sum rounded on its own (no fused multiply-add: NumPy's float32
// formula, reference.apply_rotary, gives the same bits), then rounded to q's type.
// rotary_dim is a multiple of 16, so a 16-byte chunk (8 elements) is either outside the rotated
// part or inside it, and its NeoX partner is one whole chunk rotary_dim / 2 elements away.
// Positions outside [0, seqlen_ro) are left unrotated (never read past the table; the host
// checks the table's length, and the values with check_cache).
#pragma once
#include "mma_primitives.cuh"

// A kernel without rotary: a chunk of a new token's row as it is.
struct NoRotary {
    static constexpr bool ENABLED = false;
};

CF2_DEVICE void load_8B_global_l2(u32 (&v)[2], const void* gmem_ptr) {
    asm volatile("ld.global.cg.v2.b32 {%0,%1}, [%2];\n" : "=r"(v[0]), "=r"(v[1]) : "l"(gmem_ptr));
}

CF2_DEVICE void store_16B_shared_words(u32 smem_addr, const u32 (&v)[4]) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(v[0]),
                 "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
}

struct RotaryTable {
    static constexpr bool ENABLED = true;
    const u16* cos;  // (seqlen_ro, rotary_dim / 2), rows rotary_dim / 2 elements apart
    const u16* sin;
    int rotary_dim;
    int seqlen_ro;
    bool interleaved;

    // Chunk `chunk` (8 elements) of a row at `row` (global memory, read through L2: the previous
    // kernel may have written it) at position `position`, rotated.
    template <typename Elem>
    CF2_DEVICE void load_chunk(u32 (&out)[4], const u16* row, int chunk, int position) const {
        const int col = chunk * 8;
        load_16B_global_l2(out, row + col);
        if (col >= rotary_dim || position < 0 || position >= seqlen_ro) return;
        const int half = rotary_dim / 2;
        const i64 table_row = static_cast<i64>(position) * half;
        if (interleaved) {  // the chunk's 4 pairs: angles col / 2 .. col / 2 + 3
            u32 c[2], s[2];
            load_8B_global_l2(c, cos + table_row + col / 2);
            load_8B_global_l2(s, sin + table_row + col / 2);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 cw = c[i / 2] >> (16 * (i % 2)), sw = s[i / 2] >> (16 * (i % 2));
                const float cf = to_float<Elem>(static_cast<u16>(cw & 0xffffu));
                const float sf = to_float<Elem>(static_cast<u16>(sw & 0xffffu));
                const float x0 = to_float<Elem>(static_cast<u16>(out[i] & 0xffffu));
                const float x1 = to_float<Elem>(static_cast<u16>(out[i] >> 16));
                out[i] = pack_pair<Elem>(__fsub_rn(__fmul_rn(x0, cf), __fmul_rn(x1, sf)),
                                         __fadd_rn(__fmul_rn(x0, sf), __fmul_rn(x1, cf)));
            }
        } else {  // the partner chunk rotary_dim / 2 away; angles from the first half's column
            const bool first = col < half;
            u32 other[4], c[4], s[4];
            load_16B_global_l2(other, row + (first ? col + half : col - half));
            const int angle = first ? col : col - half;
            load_16B_global_l2(c, cos + table_row + angle);
            load_16B_global_l2(s, sin + table_row + angle);
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                float r[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int shift = 16 * e;
                    const float x = to_float<Elem>(static_cast<u16>((out[w] >> shift) & 0xffffu));
                    const float y = to_float<Elem>(static_cast<u16>((other[w] >> shift) & 0xffffu));
                    const float cf = to_float<Elem>(static_cast<u16>((c[w] >> shift) & 0xffffu));
                    const float sf = to_float<Elem>(static_cast<u16>((s[w] >> shift) & 0xffffu));
                    r[e] = first ? __fsub_rn(__fmul_rn(x, cf), __fmul_rn(y, sf))
                                 : __fadd_rn(__fmul_rn(x, cf), __fmul_rn(y, sf));
                }
                out[w] = pack_pair<Elem>(r[0], r[1]);
            }
        }
    }
};

// The kernel's rotary: RotaryTable with FEATURE_ROTARY, NoRotary without.
template <bool ROTARY>
struct RotaryOf {
    using type = NoRotary;
};
template <>
struct RotaryOf<true> {
    using type = RotaryTable;
};
