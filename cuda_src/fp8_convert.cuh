// FP8 e4m3 ("e4m3fn": 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, NaN
// = S.1111.111, largest finite 448) to and from the kernels' 16-bit types, on every architecture
// the package runs on (sm_80 up).
//
// - Decoding (e4m3 -> f16 / bf16) is exact: every e4m3 value is a 16-bit value of either type.
//   To f16 on sm_89 and newer: the hardware's pair conversion (cvt.rn.f16x2.e4m3x2), one
//   instruction a pair, NaN to NaN (CF2_E4M3_CVT). To bf16, and on sm_80/86, which have no FP8
//   conversion instructions: the bits move into place with a byte permute, a shift and masks,
//   which makes them the value times 2^-(bias difference) (e4m3 subnormals land on subnormals
//   of the 16-bit type, which the packed multiply below handles); one packed multiply by
//   2^(bias difference) rebiases both halves. The NaN pattern would come out as 480 and is set
//   to NaN: about nine instructions a pair (tests/test_fp8_cache.py replays it for every byte).
// - Encoding (fp32 -> e4m3) rounds to nearest even and saturates to +-448 (infinities too), as
//   cvt.rn.satfinite.e4m3x2.f32 and vLLM's / FlashAttention-3's cache quantisation do; NaN stays
//   NaN. cuflash2/fp8.py holds the same rules in NumPy (the reference and its tests).
#pragma once
#include "mma_primitives.cuh"
#include "constants.cuh"

// The bits of fp32 E4M3_MAX (448): magnitudes from here on saturate.
constexpr u32 E4M3_MAX_FLOAT_BITS = 0x43e00000u;
static_assert(E4M3_MAX == 448, "E4M3_MAX_FLOAT_BITS is 448.0f");
// The bias differences' powers of two as packed pairs: 2^(15 - 7) in f16, 2^(127 - 7) in bf16
// (tests/test_fp8_cache.py reads them from here).
constexpr u32 TWO_POW_8_F16X2 = 0x5c005c00u;
constexpr u32 TWO_POW_120_BF16X2 = 0x7b807b80u;

// 1 where the hardware converts e4m3 pairs to f16 (sm_89 on).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define CF2_E4M3_CVT 1
#else
#define CF2_E4M3_CVT 0
#endif

// Two e4m3 values, each in the high byte of a 16-bit half (bits 8-15 and 24-31, zeros below),
// as two elements of Elem packed in a u32.
template <typename Elem>
CF2_DEVICE u32 e4m3_pair_to_16bit(u32 spread) {
    // f16: exponent field 5 bits (bias 15), bf16: 8 bits (bias 127); the 7 bits of e4m3's
    // exponent and mantissa go to the top of the 16-bit type's mantissa-and-exponent, one bit
    // (f16) or four (bf16) to the right of where they are.
    constexpr int SHIFT = Elem::is_bf16 ? 4 : 1;
    constexpr u32 MAGNITUDE = 0x7f007f00u >> SHIFT;
    const u32 scaled = (spread & 0x80008000u) | ((spread >> SHIFT) & MAGNITUDE);
    u32 value;
    if constexpr (Elem::is_bf16) {
        // x 2^120, + -0 so that zeros keep their sign (bf16 has no mul before sm_90).
        asm("fma.rn.bf16x2 %0, %1, %2, %3;\n"
            : "=r"(value)
            : "r"(scaled), "r"(TWO_POW_120_BF16X2), "r"(0x80008000u));
    } else {
        asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(value) : "r"(scaled), "r"(TWO_POW_8_F16X2));
    }
    // S.1111.111: NaN (all ones below the sign is a NaN of either 16-bit type).
    const u32 nan = __vcmpeq2(spread & 0x7f007f00u, 0x7f007f00u);
    return value | (nan & 0x7fff7fffu);
}

// Four e4m3 values (bytes 0-3 of `packed`, byte 0 first) as four elements of Elem: elements 0
// and 1 in `lo` (0 in its low half), 2 and 3 in `hi`.
template <typename Elem>
CF2_DEVICE void e4m3x4_to_16bit(u32 packed, u32& lo, u32& hi) {
#if CF2_E4M3_CVT
    if constexpr (!Elem::is_bf16) {
        // (the pair's low byte to the low half: element 0 first, as below)
        asm("{\n\t.reg .b16 pair_lo, pair_hi;\n\t"
            "mov.b32 {pair_lo, pair_hi}, %2;\n\t"
            "cvt.rn.f16x2.e4m3x2 %0, pair_lo;\n\t"
            "cvt.rn.f16x2.e4m3x2 %1, pair_hi;\n\t}\n"
            : "=r"(lo), "=r"(hi)
            : "r"(packed));
        return;
    }
#endif
    lo = e4m3_pair_to_16bit<Elem>(__byte_perm(packed, 0u, 0x1404));  // bytes 0, 1 -> bits 8, 24
    hi = e4m3_pair_to_16bit<Elem>(__byte_perm(packed, 0u, 0x3424));  // bytes 2, 3 -> bits 8, 24
}

// fp32 -> e4m3 bits (the low byte of the result), rounded to nearest even, saturated to +-448.
CF2_DEVICE u32 float_to_e4m3(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 24) & 0x80u;
    const u32 magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7fu;  // NaN
    if (magnitude >= E4M3_MAX_FLOAT_BITS) return sign | 0x7eu;  // 448 (what rounds above too)
    if (magnitude < 0x3c800000u)  // below 2^-6, e4m3's subnormals: multiples of 2^-9 (exact x512)
        return sign | __float2uint_rn(__uint_as_float(magnitude) * 512.f);
    // Normal: 3 mantissa bits kept, ties to even (a carry moves into the exponent, as it should),
    // exponent rebiased from 127 to 7.
    const u32 rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
    return sign | ((rounded >> 20) - (120u << 3));
}

// Four floats as four e4m3 values: bytes 0-3 of the result.
CF2_DEVICE u32 floats_to_e4m3x4(float a, float b, float c, float d) {
    return float_to_e4m3(a) | (float_to_e4m3(b) << 8) | (float_to_e4m3(c) << 16) |
           (float_to_e4m3(d) << 24);
}

// Sixteen elements of Elem (two 16-byte words) divided by `descale` (IEEE division: the same
// quotient as the reference's) as sixteen e4m3 values (one 16-byte word, element 0 in byte 0).
template <typename Elem>
CF2_DEVICE void quantise_16_to_e4m3(u32 (&out)[4], const u32 (&first)[4], const u32 (&second)[4],
                                    float descale) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const u32 a = w < 2 ? first[2 * w] : second[2 * w - 4];
        const u32 b = w < 2 ? first[2 * w + 1] : second[2 * w - 3];
        out[w] = floats_to_e4m3x4(
            __fdiv_rn(to_float<Elem>(static_cast<u16>(a & 0xffffu)), descale),
            __fdiv_rn(to_float<Elem>(static_cast<u16>(a >> 16)), descale),
            __fdiv_rn(to_float<Elem>(static_cast<u16>(b & 0xffffu)), descale),
            __fdiv_rn(to_float<Elem>(static_cast<u16>(b >> 16)), descale));
    }
}
