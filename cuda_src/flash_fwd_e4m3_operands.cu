// V of an FP8 (e4m3) call as the Hopper forward's e4m3 wgmma takes it (flash_fwd_sm90.cu with
// e4m3_tag; docs/FP8_FORWARD.md), written once a call, on the same stream, right before it.
// e4m3 wgmma has no transposed B operand, and P V's B operand must be K-major with K = the
// keys, so V is written with its keys innermost, (batch, kv heads, head dim, keys_padded) bytes.
// Within each group of 32 keys the order is P's: the S accumulator holds keys 2t, 2t + 1 of
// each n8 tile where the e4m3 A fragment of a k32 step has columns 4t .. 4t + 3 (and 16 + 4t
// ..), so position 4t + b of a half (16 positions) holds key 2t + (b & 1) + 8 (b >> 1) of that
// half (pack_probabilities_e4m3, hopper_primitives.cuh): P stays in the registers it was
// computed in. keys_padded is seqlen_k rounded up to 32 (whole groups; a 16-byte multiple, as
// the TMA wants its rows), the padding zero: those keys meet P = 0. Q and K are read in place.
//
// Grid (keys_padded / E4M3_OPERANDS_KEYS, kv heads, batch), E4M3_OPERANDS_THREADS threads:
// each CTA takes E4M3_OPERANDS_KEYS keys of one (batch, kv head) and walks the head dim 64
// columns at a time through a keys x 64-byte tile: rows of V in (16-byte chunks), head-dim rows
// of V^T out (4 positions a thread, a warp's 32 words one 128-byte run of a row).
// The parameters: FwdSm90Params (kernel_params.cuh): base's v, its strides and head_dim (in
// 16-bit words, as every kernel takes them: an e4m3 element is half a word), seqlen_k, nheads
// and heads_per_kv_head; writes v_keys_last.
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// The key (within its group of 32) that position `pos` (0 .. 31) of a keys-last V row holds.
CF2_DEVICE int e4m3_key_at_position(int pos) {
    const int half = pos / 16, t = (pos % 16) / 4, b = pos % 4;
    return 16 * half + 2 * t + (b & 1) + 8 * (b >> 1);
}

template <typename Elem, bool VARLEN>
__global__ void __launch_bounds__(E4M3_OPERANDS_THREADS)
flash_fwd_e4m3_operands_kernel(const __grid_constant__ FwdSm90Params params) {
    static_assert(Elem::IS_E4M3 && !VARLEN, "e4m3 dense calls");
    constexpr int KEYS = E4M3_OPERANDS_KEYS;
    constexpr int COLUMNS = 64;
    static_assert(KEYS % 32 == 0, "whole groups of 32 keys");
    // [key][column] bytes, rows padded by 4 bytes: the column reads (4 keys of one column a
    // thread, a warp over 8 groups of keys and 4 columns) spread over the banks.
    __shared__ __align__(16) u8 tile[KEYS][COLUMNS + 4];
    const FwdParams& p = params.base;
    const int key0 = blockIdx.x * KEYS;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int head_dim = 2 * p.head_dim;  // bytes
    const int kv_heads = p.nheads / p.heads_per_kv_head;
    const int keys_padded = (p.seqlen_k + 31) / 32 * 32;
    // Byte strides (the params' are in 16-bit words).
    const u8* v = reinterpret_cast<const u8*>(p.v) + 2 * (batch * p.v_batch_stride +
                                                         kv_head * p.v_head_stride);
    const i64 v_row_stride = 2 * p.v_row_stride;
    u8* vt_out = static_cast<u8*>(params.v_keys_last) +
                 (static_cast<i64>(batch) * kv_heads + kv_head) * head_dim * keys_padded;
    for (int col0 = 0; col0 < head_dim; col0 += COLUMNS) {
        // In: 16-byte chunks of the keys' rows (zero past seqlen_k and past the head dim).
        for (int i = threadIdx.x; i < KEYS * COLUMNS / 16; i += E4M3_OPERANDS_THREADS) {
            const int r = i / (COLUMNS / 16), chunk = i % (COLUMNS / 16);
            const int key = key0 + r, col = col0 + 16 * chunk;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (key < p.seqlen_k && col < head_dim)
                x = *reinterpret_cast<const uint4*>(v + key * v_row_stride + col);
            u32* dst = reinterpret_cast<u32*>(&tile[r][16 * chunk]);
            dst[0] = x.x;
            dst[1] = x.y;
            dst[2] = x.z;
            dst[3] = x.w;
        }
        __syncthreads();
        // Out: 4 positions (one 32-bit word) of a head-dim row a thread.
        for (int i = threadIdx.x; i < COLUMNS * KEYS / 4; i += E4M3_OPERANDS_THREADS) {
            const int c = i / (KEYS / 4), word = i % (KEYS / 4);
            const int pos = 4 * word;  // in the CTA's keys
            if (col0 + c < head_dim && key0 + pos < keys_padded) {
                const int group = pos / 32 * 32;
                u32 packed = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b)
                    packed |= u32(tile[group + e4m3_key_at_position(pos % 32 + b)][c]) << (8 * b);
                *reinterpret_cast<u32*>(vt_out + static_cast<i64>(col0 + c) * keys_padded +
                                        key0 + pos) = packed;
            }
        }
        __syncthreads();
    }
}
