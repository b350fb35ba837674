// K and V of a float32 call as the Hopper forward's TF32 wgmma takes them (flash_fwd_sm90.cu with
// tf32_tag), written once a call, on the same stream, right before it:
//  - K rounded to TF32 (cvt.rna, as the mma.sync kernels round every operand;
//    tf32_primitives.cuh), (batch, seqlen_k, kv heads, head dim) contiguous: the B operand of
//    S = Q K^T is K-major as K is stored, and the tensor cores would otherwise take the top 19
//    bits of each float32 (truncation, whose bias fails the precision's error bound).
//  - V rounded and with its keys innermost, (batch, kv heads, head dim, keys_padded): TF32 wgmma
//    has no transposed B operand (imm-trans-b is for 16-bit types), and P V's B operand must be
//    K-major with K = the keys. Within each group of 8 keys the order is 0 2 4 6 1 3 5 7: P
//    stays in the S accumulator's registers, which hold keys 2t and 2t + 1 where the TF32 A
//    fragment has its columns t and t + 4, so B's row j must be the key that column j holds
//    (sm90/fwd_mainloop.cuh, issue_pv). keys_padded is seqlen_k rounded up to 8 (whole groups),
//    the padding zero: those keys meet P = 0, and must be finite.
// Q is rounded in shared memory by the forward's consumers (round_q_to_tf32).
// Precision "highest" (f32x3_tag, 3xTF32): each element also as its small part, the TF32
// rounding of what the big part (the rounded value) leaves out, in the same arrays: a row of K
// holds the head dim's big parts then its small ones, (batch, seqlen_k, kv heads, 2 x head dim);
// V's keys-last block of a (batch, kv head) holds the head dim's big rows then its small rows,
// (batch, kv heads, 2 x head dim, keys_padded). The forward's k_map / v_map cover them whole and
// its producer loads the small parts from column (K) or row (V) head_dim on.
//
// Grid (keys_padded / 32, kv heads, batch), TF32_OPERANDS_THREADS threads: each CTA takes 32
// keys of one (batch, kv head) and walks the head dim 32 columns at a time through a 32 x 33
// tile: rows of V in (32 consecutive floats of a key's row a warp pass, coalesced), columns of
// V^T out (32 consecutive keys of a column a warp pass). K goes straight through, element for
// element, in the same loop. The parameters: FwdSm90Params (kernel_params.cuh): base's k, v,
// their strides and head_dim (16-bit words: two a float32), seqlen_k, nheads and
// heads_per_kv_head; writes k_tf32 and v_keys_last.
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// The key that position `pos` of a keys-last V row holds: groups of 8 in the order
// 0 2 4 6 1 3 5 7 (the TF32 A fragment's column j holds key 2j for j < 4, 2 (j - 4) + 1 after).
CF2_DEVICE int key_at_position(int pos) {
    const int j = pos % 8;
    return pos - j + (j < 4 ? 2 * j : 2 * (j - 4) + 1);
}

template <typename Elem, bool VARLEN>
__global__ void __launch_bounds__(TF32_OPERANDS_THREADS)
flash_fwd_tf32_operands_kernel(const __grid_constant__ FwdSm90Params params) {
    static_assert(Elem::IS_F32 && !VARLEN, "float32 dense calls");
    constexpr int ROWS_A_PASS = TF32_OPERANDS_THREADS / 32;
    const FwdParams& p = params.base;
    __shared__ float tile[32][33];  // [key][column], padded: the column reads miss no bank
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int key0 = blockIdx.x * 32;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int head_dim = p.head_dim / 2;  // floats
    const int kv_heads = p.nheads / p.heads_per_kv_head;
    const int keys_padded = (p.seqlen_k + 7) / 8 * 8;
    // Float strides (the params' are in 16-bit words).
    const float* k = reinterpret_cast<const float*>(p.k) + batch * (p.k_batch_stride / 2) +
                     kv_head * (p.k_head_stride / 2);
    const float* v = reinterpret_cast<const float*>(p.v) + batch * (p.v_batch_stride / 2) +
                     kv_head * (p.v_head_stride / 2);
    const i64 k_row_stride = p.k_row_stride / 2, v_row_stride = p.v_row_stride / 2;
    float* k_out = params.k_tf32 + (static_cast<i64>(batch) * p.seqlen_k * kv_heads + kv_head) *
                                       head_dim;
    float* const v_keys_last = static_cast<float*>(params.v_keys_last);
    float* vt_out = v_keys_last +
                    (static_cast<i64>(batch) * kv_heads + kv_head) * head_dim * keys_padded;
    if constexpr (Elem::SPLIT) {  // rows of both parts: twice as long (K), twice as many (V)
        k_out = params.k_tf32 +
                (static_cast<i64>(batch) * p.seqlen_k * kv_heads + kv_head) * 2 * head_dim;
        vt_out = v_keys_last +
                 (static_cast<i64>(batch) * kv_heads + kv_head) * 2 * head_dim * keys_padded;
    }
    for (int col0 = 0; col0 < head_dim; col0 += 32) {
        const int col = col0 + lane;
        for (int r = warp; r < 32; r += ROWS_A_PASS) {
            const int key = key0 + r;
            float x = 0.f;
            if constexpr (Elem::SPLIT) {  // x unrounded: split as it is written out
                if (key < p.seqlen_k && col < head_dim) {
                    x = v[key * v_row_stride + col];
                    const float kx = k[key * k_row_stride + col];
                    const float big = __uint_as_float(to_tf32(kx));
                    float* k_row = k_out + static_cast<i64>(key) * kv_heads * 2 * head_dim;
                    k_row[col] = big;
                    k_row[head_dim + col] = __uint_as_float(to_tf32(kx - big));
                }
            } else if (key < p.seqlen_k && col < head_dim) {
                x = __uint_as_float(to_tf32(v[key * v_row_stride + col]));
                k_out[static_cast<i64>(key) * kv_heads * head_dim + col] =
                    __uint_as_float(to_tf32(k[key * k_row_stride + col]));
            }
            tile[r][lane] = x;
        }
        __syncthreads();
        const int pos = key0 + lane;
        for (int c = warp; c < 32; c += ROWS_A_PASS)
            if (col0 + c < head_dim && pos < keys_padded) {
                if constexpr (Elem::SPLIT) {
                    const float x = tile[key_at_position(lane)][c];
                    const float big = __uint_as_float(to_tf32(x));
                    vt_out[static_cast<i64>(col0 + c) * keys_padded + pos] = big;
                    vt_out[static_cast<i64>(head_dim + col0 + c) * keys_padded + pos] =
                        __uint_as_float(to_tf32(x - big));
                } else {
                    vt_out[static_cast<i64>(col0 + c) * keys_padded + pos] =
                        tile[key_at_position(lane)][c];
                }
            }
        __syncthreads();
    }
}
