// Float32 elements on the mma.sync tensor cores: m16n8k8 with TF32 operands, fp32 accumulate.
//
// A float32 element is two 16-bit words (WORDS = 2): the kernels' swizzled tiles, cp.async
// chunks and ldmatrix addressing count words, so a float32 tile is a 16-bit tile twice as wide
// and an ldmatrix.x4 of it is one k8 step. Two precisions (the `precision` of the call):
//   tf32_tag:  each operand rounded to TF32 (10 mantissa bits, cvt.rna): one mma a product.
//   f32x3_tag: each operand split into a TF32 "big" part and the TF32 rounding of the rest,
//              x = big + small to within 2^-22 |x|; a product is big*big + big*small + small*big
//              (small*small, below 2^-22 of it, is dropped): three mma, float32-level error
//              ("3xTF32", precision "highest").
#pragma once
#include "mma_primitives.cuh"
#include "smem_swizzle.cuh"

struct tf32_tag {
    static constexpr bool is_bf16 = false;
    static constexpr bool IS_F32 = true;
    static constexpr bool IS_E4M3 = false;
    static constexpr bool SPLIT = false;
    static constexpr int WORDS = 2;
    static constexpr int BYTES = 4;
    using Out = tf32_tag;
};
struct f32x3_tag {
    static constexpr bool is_bf16 = false;
    static constexpr bool IS_F32 = true;
    static constexpr bool IS_E4M3 = false;
    static constexpr bool SPLIT = true;
    static constexpr int WORDS = 2;
    static constexpr int BYTES = 4;
    using Out = f32x3_tag;
};

// x rounded to the nearest TF32 value (ties away from zero), as a 32-bit pattern.
CF2_DEVICE u32 to_tf32(float x) {
    u32 y;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(y) : "f"(x));
    return y;
}

// N operand registers of float32 values as the tensor core takes them: `big` the TF32 rounding,
// `small` (f32x3_tag only) the TF32 rounding of what big leaves out.
template <class Elem, int N>
struct Tf32Parts {
    u32 big[N];
    u32 small[N];

    Tf32Parts() = default;

    CF2_DEVICE explicit Tf32Parts(const float (&x)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            big[i] = to_tf32(x[i]);
            if constexpr (Elem::SPLIT) small[i] = to_tf32(x[i] - __uint_as_float(big[i]));
        }
    }

    // From registers holding float32 bit patterns (an ldmatrix or shared-memory load).
    CF2_DEVICE static Tf32Parts from_bits(const u32 (&bits)[N]) {
        float x[N];
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = __uint_as_float(bits[i]);
        return Tf32Parts(x);
    }
};

// D (16x8 fp32) += A (16x8, row-major, 4 regs) * B (8x8, "col", 2 regs), TF32 operands.
// Fragments (PTX ISA, "mma.m16n8k8" .tf32): with g = lane / 4 and t = lane % 4, a[0..3] hold
// A (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4); b[0..1] hold B (t, g), (t + 4, g); the
// accumulator is m16n8k16's.
CF2_DEVICE void mma_m16n8k8_tf32(float (&acc)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                 u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One k8 step into two adjacent n8 tiles sharing A: `b` holds both tiles' B fragments as an
// ldmatrix.x4 returns them ({b0, b1} of the first tile, then of the second). With f32x3_tag
// the small products go first, so that the big one is added to what they hold.
template <class Elem>
CF2_DEVICE void mma_m16n16k8_f32(float (&acc_lo)[4], float (&acc_hi)[4],
                                 const Tf32Parts<Elem, 4>& a, const Tf32Parts<Elem, 4>& b) {
    if constexpr (Elem::SPLIT) {
        mma_m16n8k8_tf32(acc_lo, a.small[0], a.small[1], a.small[2], a.small[3], b.big[0],
                         b.big[1]);
        mma_m16n8k8_tf32(acc_hi, a.small[0], a.small[1], a.small[2], a.small[3], b.big[2],
                         b.big[3]);
        mma_m16n8k8_tf32(acc_lo, a.big[0], a.big[1], a.big[2], a.big[3], b.small[0],
                         b.small[1]);
        mma_m16n8k8_tf32(acc_hi, a.big[0], a.big[1], a.big[2], a.big[3], b.small[2],
                         b.small[3]);
    }
    mma_m16n8k8_tf32(acc_lo, a.big[0], a.big[1], a.big[2], a.big[3], b.big[0], b.big[1]);
    mma_m16n8k8_tf32(acc_hi, a.big[0], a.big[1], a.big[2], a.big[3], b.big[2], b.big[3]);
}

// P as the A operand of the k8 steps of O += P V, for the probabilities of one k16 slice of
// keys (exp_probabilities' p: row half e / 2, tile 0 (keys 0-7) or 1 (keys 8-15), key 2t + e % 2
// of the tile). The accumulator layout holds keys 2t, 2t + 1 where the TF32 A fragment wants
// columns t, t + 4; instead of moving values between lanes, column t of k8 step s is taken to
// be key 8s + 2t and column t + 4 key 8s + 2t + 1, and V's rows are read in the same order
// (F32KeyPairCursor). The sum over keys is the same.
template <class Elem>
CF2_DEVICE void probabilities_as_a(Tf32Parts<Elem, 4> (&a)[2], const float (&p)[8]) {
    const float step0[4] = {p[0], p[2], p[1], p[3]};
    const float step1[4] = {p[4], p[6], p[5], p[7]};
    a[0] = Tf32Parts<Elem, 4>(step0);
    a[1] = Tf32Parts<Elem, 4>(step1);
}

CF2_DEVICE u32 load_4B_shared(u32 smem_addr) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr));
    return v;
}

// Addresses of V's B fragments for O += P V with float32 elements: lane (g, t) reads elements
// (key 2t + j, column g) of each 8 x 8 block of a swizzled [key][column] tile (SwizzledTile of
// words, 128-byte panels), j = 0, 1 (the key order of probabilities_as_a). ldmatrix.trans
// transposes 16-bit elements only, so these are 32-bit shared loads: per load the 32 lanes read
// rows 2t + j (four rows) and two chunks of each, which the swizzle spreads over all 32 banks.
// Everything lane-dependent is folded into two registers a key parity, as in LdmatrixCursor.
template <class Tile>
struct F32KeyPairCursor {
    static_assert(Tile::PANEL_CHUNKS == 8, "float32 tiles are 128-byte panels");
    u32 row_base[2];   // tile base + row (2t + j) * ROW_BYTES + 4 * (column % 4)
    u32 chunk_xor[2];  // ((column / 4) ^ key(2t + j)) << 4

    CF2_DEVICE F32KeyPairCursor(u32 tile_base, int lane)
        : F32KeyPairCursor(tile_base, lane, lane / 4) {}

    // `column`: the lane's column in each block of 8, g above, or for a tile whose columns hold
    // the keys of each 8 permuted, where key g is (permuted_keys_cursor).
    CF2_DEVICE F32KeyPairCursor(u32 tile_base, int lane, int column) {
        const int t = lane % 4;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * t + j;
            row_base[j] = tile_base + row * Tile::ROW_BYTES + 4 * (column % 4);
            chunk_xor[j] = static_cast<u32>((column / 4) ^ Tile::swizzle_key(row)) << 4;
        }
    }

    // Element (8 * row_block8 + 2t + j, 8 * col_block8 + g) (of column `column`, above).
    CF2_DEVICE u32 at(int row_block8, int col_block8, int j) const {
        const int chunk0 = 2 * col_block8;  // the block's 8 floats are chunks chunk0, chunk0 + 1
        return row_base[j] + (chunk0 / Tile::PANEL_CHUNKS) * Tile::PANEL_BYTES +
               row_block8 * 8 * Tile::ROW_BYTES +
               ((static_cast<u32>(chunk0 % Tile::PANEL_CHUNKS) << 4) ^ chunk_xor[j]);
    }

    // The B fragments of the k8 step over rows 8 * row_block8 .. + 7 (in the key-pair order)
    // for the two n8 tiles of columns 8 * col_block8 .. + 15, as an ldmatrix.x4 returns them
    // ({b0, b1} of the first tile, then of the second); `offset` moves to another stage.
    CF2_DEVICE void load_b_pair(u32 (&bits)[4], int row_block8, int col_block8,
                                u32 offset = 0) const {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                bits[2 * half + j] = load_4B_shared(at(row_block8, col_block8 + half, j) + offset);
    }
};


// The B operand of a product over a [key][column] tile's keys (the forward's O += P V, the dQ
// kernel's dQ += dS K): the transposed operand by ldmatrix.trans (lanes 0-15 pick key rows, bit
// 4 the column half of 16), or with float32 elements by 32-bit loads in the key-pair order of
// the A operand's accumulator layout (F32KeyPairCursor).
template <typename Elem, class Tile>
CF2_DEVICE auto key_rows_b_fragments(u32 tile_smem, int lane) {
    if constexpr (Elem::IS_F32)
        return F32KeyPairCursor<Tile>(tile_smem, lane);
    else
        return LdmatrixCursor<Tile>(tile_smem, lane % 16, lane / 16);
}

CF2_DEVICE void store_8B_shared(u32 smem_addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(smem_addr), "f"(a), "f"(b)
                 : "memory");
}
