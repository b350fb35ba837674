// cuflash2.block_mask's kernel: a mask modifier (the generated user_mods.cuh, cuflash2/mods.py)
// evaluated at every (query, key) of a sequence of seqlen_q x seqlen_k, reduced to one state a
// BLOCK_M x BLOCK_N tile (block_mask.cuh: BLOCK_MASK_EMPTY, no position visible; _FULL, every
// position inside the sequence visible; _PARTIAL otherwise). One CTA a tile row of one head and
// batch entry (grid (num_m_blocks, nheads, batch): 1 and 1 where the states are shared, b and h
// then 0), each warp a tile at a time: its lanes walk the tile's rows 32 keys at a time and vote
// (__any_sync, __all_sync) after each row, stopping at the first row that shows it partial.
// Each state also goes into its column's summary (BlockMaskColumns, by atomics: the first and
// last visited row, the first and last full row and their count).
// Then the row's ranges (BlockMaskRanges, kernel_params.cuh): its first and last visited tile
// and its longest run of full tiles, by one thread over the states the CTA just wrote (visible
// to it after the barrier); once a block mask, so the kernels that read them need no scan.
#include "mma_primitives.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"
#include "user_mods.cuh"

template <int BLOCK_M, int BLOCK_N, unsigned MODS_HASH>
__global__ void __launch_bounds__(BLOCK_MASK_WARPS * 32)
flash_block_mask_kernel(const __grid_constant__ BlockMaskParams p) {
    static_assert(MODS_HASH == USER_MODS_HASH, "the kernel's name and its user_mods.cuh");
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int m_block = blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z + p.batch_offset;
    const int row0 = m_block * BLOCK_M;
    const int rows = min(BLOCK_M, p.seqlen_q - row0);
    signed char* row_states =
        p.states + ((static_cast<i64>(batch) * p.nheads + head) * p.num_m_blocks + m_block) *
                       p.num_n_blocks;
    for (int n_block = warp; n_block < p.num_n_blocks; n_block += BLOCK_MASK_WARPS) {
        const int key0 = n_block * BLOCK_N;
        const int cols = min(BLOCK_N, p.seqlen_k - key0);
        bool any = false, all = true;  // over this lane's positions (inside the sequence)
        for (int r = 0; r < rows; ++r) {
            for (int c = lane; c < cols; c += 32) {
                const bool visible = UserMods::mask(p.user, batch, head, row0 + r, key0 + c);
                any = any || visible;
                all = all && visible;
            }
            if (__any_sync(0xffffffffu, any) && !__all_sync(0xffffffffu, all)) break;
        }
        const bool some = __any_sync(0xffffffffu, any);
        const bool every = __all_sync(0xffffffffu, all);
        if (lane == 0) {
            row_states[n_block] = static_cast<signed char>(
                some ? (every ? BLOCK_MASK_FULL : BLOCK_MASK_PARTIAL) : BLOCK_MASK_EMPTY);
            // The column's summary (BlockMaskColumns), every row of it adding its state.
            int* column =
                p.columns + ((static_cast<i64>(batch) * p.nheads + head) * p.num_n_blocks +
                             n_block) * 8;
            if (some) {
                atomicMin(column, m_block);
                atomicMax(column + 1, m_block + 1);
            }
            if (some && every) {
                atomicMin(column + 2, m_block);
                atomicMax(column + 3, m_block + 1);
                atomicAdd(column + 4, 1);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int first = 0, end = 0;            // visited: [first, end)
    int full_first = 0, full_end = 0;  // the longest run of full tiles
    int run_first = 0;                 // the current run of full tiles starts here
    bool any = false;
    for (int n_block = 0; n_block < p.num_n_blocks; ++n_block) {
        const int state = row_states[n_block];
        if (state != BLOCK_MASK_EMPTY) {
            if (!any) first = n_block;
            any = true;
            end = n_block + 1;
        }
        if (state != BLOCK_MASK_FULL) {
            run_first = n_block + 1;
        } else if (n_block + 1 - run_first > full_end - full_first) {
            full_first = run_first;
            full_end = n_block + 1;
        }
    }
    p.ranges[(static_cast<i64>(batch) * p.nheads + head) * p.num_m_blocks + m_block] =
        make_int4(first, end, full_first, full_end);
}
