// The dropout keep-mask of the attention kernels, materialised (batch, nheads, seqlen_q, seqlen_k)
// as bytes (1 = kept), for tests and debugging: cuflash2.dropout_mask. Each warp draws one 16 x 16
// block with the kernels' own function (dropout.cuh), each lane its eight elements.
#include "mma_primitives.cuh"
#include "dropout.cuh"
#include "constants.cuh"

extern "C" __global__ void __launch_bounds__(MASK_WARPS * 32)
flash_dropout_mask_kernel(unsigned char* __restrict__ mask, int nheads, int seqlen_q,
                          int seqlen_k, u32 seed_lo, u32 seed_hi, u32 offset, u32 keep_threshold,
                          int batch_offset) {
    const int lane = threadIdx.x % 32;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + batch_offset;
    const int blocks_k = (seqlen_k + 15) / 16;
    const int block = blockIdx.x * MASK_WARPS + threadIdx.x / 32;
    if (block >= blocks_k * ((seqlen_q + 15) / 16)) return;
    const int q0 = block / blocks_k * 16;
    const int k0 = block % blocks_k * 16;
    const Dropout dropout{seed_lo, seed_hi, offset, keep_threshold,
                          static_cast<u32>(batch * nheads + head)};
    const u32 keep = dropout.keep_bits(q0, k0, lane);
    unsigned char* plane = mask + (static_cast<i64>(batch) * nheads + head) * seqlen_q * seqlen_k;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int q = q0 + lane / 4 + 8 * half;
                const int k = k0 + 8 * tile + 2 * (lane % 4) + e;
                if (q < seqlen_q && k < seqlen_k)
                    plane[static_cast<i64>(q) * seqlen_k + k] =
                        (keep >> dropout_index(half, tile, e)) & 1u;
            }
}
