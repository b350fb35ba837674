// The dropout keep-mask of the attention kernels, materialised (batch, nheads, seqlen_q, seqlen_k)
// as bytes (1 = kept), for tests and debugging: cuflash2.dropout_mask. Each warp draws one 16 x 16
// block with the kernels' own function (dropout.cuh), each lane its eight elements.
#include "mma_primitives.cuh"
#include "dropout.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// The parameters: DropoutMaskParams (kernel_params.cuh).
extern "C" __global__ void __launch_bounds__(MASK_WARPS * 32)
flash_dropout_mask_kernel(const __grid_constant__ DropoutMaskParams p) {
    const int lane = threadIdx.x % 32;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
    const int blocks_k = (seqlen_k + 15) / 16;
    const int block = blockIdx.x * MASK_WARPS + threadIdx.x / 32;
    if (block >= blocks_k * ((seqlen_q + 15) / 16)) return;
    const int q0 = block / blocks_k * 16;
    const int k0 = block % blocks_k * 16;
    const Dropout dropout(p.dropout, static_cast<u32>(batch * p.nheads + head));
    const u32 keep = dropout.keep_bits(q0, k0, lane);
    unsigned char* plane =
        p.mask + (static_cast<i64>(batch) * p.nheads + head) * seqlen_q * seqlen_k;
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
