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

CF2_DEVICE void load_16B_global_l1(u32 (&v)[4], const void* gmem_ptr) {
    asm volatile("ld.global.ca.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(gmem_ptr));
}

CF2_DEVICE void load_8B_global_l1(u32 (&v)[2], const void* gmem_ptr) {
    asm volatile("ld.global.ca.v2.b32 {%0,%1}, [%2];\n" : "=r"(v[0]), "=r"(v[1]) : "l"(gmem_ptr));
}

CF2_DEVICE void prefetch_global_l1(const void* gmem_ptr) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(gmem_ptr));
}

struct RotaryTable {
    static constexpr bool ENABLED = true;
    const u16* cos;  // (seqlen_ro, rotary_dim / 2), rows rotary_dim / 2 elements apart
    const u16* sin;
    int rotary_dim;
    int seqlen_ro;
    bool interleaved;

    // GPT-J: the chunk's 4 pairs at angles c[i / 2] >> 16 (i % 2), s likewise.
    template <typename Elem>
    CF2_DEVICE static void rotate_pairs(u32 (&x)[4], const u32 (&c)[2], const u32 (&s)[2]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 cw = c[i / 2] >> (16 * (i % 2)), sw = s[i / 2] >> (16 * (i % 2));
            const float cf = to_float<Elem>(static_cast<u16>(cw & 0xffffu));
            const float sf = to_float<Elem>(static_cast<u16>(sw & 0xffffu));
            const float x0 = to_float<Elem>(static_cast<u16>(x[i] & 0xffffu));
            const float x1 = to_float<Elem>(static_cast<u16>(x[i] >> 16));
            x[i] = pack_pair<Elem>(__fsub_rn(__fmul_rn(x0, cf), __fmul_rn(x1, sf)),
                                   __fadd_rn(__fmul_rn(x0, sf), __fmul_rn(x1, cf)));
        }
    }

    // NeoX: chunk x with its partner y (the other half's chunk of the same angles), x in the
    // first half (`first`: x c - y s) or the second (x c + y s).
    template <typename Elem>
    CF2_DEVICE static void rotate_halves(u32 (&out)[4], const u32 (&x)[4], const u32 (&y)[4],
                                         const u32 (&c)[4], const u32 (&s)[4], bool first) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float r[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int shift = 16 * e;
                const float xf = to_float<Elem>(static_cast<u16>((x[w] >> shift) & 0xffffu));
                const float yf = to_float<Elem>(static_cast<u16>((y[w] >> shift) & 0xffffu));
                const float cf = to_float<Elem>(static_cast<u16>((c[w] >> shift) & 0xffffu));
                const float sf = to_float<Elem>(static_cast<u16>((s[w] >> shift) & 0xffffu));
                r[e] = first ? __fsub_rn(__fmul_rn(xf, cf), __fmul_rn(yf, sf))
                             : __fadd_rn(__fmul_rn(xf, cf), __fmul_rn(yf, sf));
            }
            out[w] = pack_pair<Elem>(r[0], r[1]);
        }
    }

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
            rotate_pairs<Elem>(out, c, s);
        } else {  // the partner chunk rotary_dim / 2 away; angles from the first half's column
            const bool first = col < half;
            u32 other[4], c[4], s[4];
            load_16B_global_l2(other, row + (first ? col + half : col - half));
            const int angle = first ? col : col - half;
            load_16B_global_l2(c, cos + table_row + angle);
            load_16B_global_l2(s, sin + table_row + angle);
            const u32 x[4] = {out[0], out[1], out[2], out[3]};
            rotate_halves<Elem>(out, x, other, c, s, first);
        }
    }

    // Rotation in shared memory, for rows copied there as they are (cp.async) and rotated once
    // they landed, so that the copy stays asynchronous: a row's rotation is items_per_row()
    // items, each a GPT-J chunk (`item`) or a NeoX pair (chunks `item` and
    // `item + partner_chunks()`).
    CF2_DEVICE int items_per_row() const { return interleaved ? rotary_dim / 8 : rotary_dim / 16; }
    CF2_DEVICE int partner_chunks() const { return rotary_dim / 16; }

    // The angles chunk `chunk` of a row at `position` is rotated with, asked into L1 when its
    // copy is issued, for rotate_in_shared to read there once it landed. Nothing for chunks past
    // rotary_dim or positions outside the table.
    CF2_DEVICE void prefetch_angles(int chunk, int position) const {
        const int col = chunk * 8;
        if (col >= rotary_dim || position < 0 || position >= seqlen_ro) return;
        const int half = rotary_dim / 2;
        const i64 at = static_cast<i64>(position) * half +
                       (interleaved ? col / 2 : (col < half ? col : col - half));
        prefetch_global_l1(cos + at);
        prefetch_global_l1(sin + at);
    }

    // Item `item` of a row in shared memory at `position`, rotated in place: `chunk_a` the
    // address of its chunk (NeoX: the first half's), `chunk_b` its partner's (NeoX only). The
    // same bits as load_chunk's. The table is read through L1, where prefetch_angles asked it:
    // both come after the wait for the previous kernel, whose writes are visible to the loads
    // that follow that wait (griddepcontrol.wait).
    template <typename Elem>
    CF2_DEVICE void rotate_in_shared(u32 chunk_a, u32 chunk_b, int item, int position) const {
        if (position < 0 || position >= seqlen_ro) return;
        const i64 table_row = static_cast<i64>(position) * (rotary_dim / 2);
        u32 x[4];
        load_16B_shared(x, chunk_a);
        if (interleaved) {  // angles 4 item .. 4 item + 3
            u32 c[2], s[2];
            load_8B_global_l1(c, cos + table_row + 4 * item);
            load_8B_global_l1(s, sin + table_row + 4 * item);
            rotate_pairs<Elem>(x, c, s);
            store_16B_shared_words(chunk_a, x);
        } else {  // angles 8 item .. 8 item + 7, for both chunks
            u32 y[4], c[4], s[4], out[4];
            load_16B_shared(y, chunk_b);
            load_16B_global_l1(c, cos + table_row + 8 * item);
            load_16B_global_l1(s, sin + table_row + 8 * item);
            rotate_halves<Elem>(out, x, y, c, s, true);
            store_16B_shared_words(chunk_a, out);
            rotate_halves<Elem>(out, y, x, c, s, false);
            store_16B_shared_words(chunk_b, out);
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
