// cuflash2.merge_states / merge_states_many: attention results over disjoint sets of keys merged
// into the result over all of them by their log-sum-exp (lse_merge.cuh), in fp32, stored in the
// results' element type (16-bit or float32). A result's lse is the forward's: natural log, +inf
// for a row that saw no key (its out is 0); -inf reads the same (no key). Such a state weighs 0
// and its out is not read; a row that no state saw a key of gets out 0 and lse +inf, as the
// forward writes it.
#include "mma_primitives.cuh"
#include "tf32_primitives.cuh"
#include "lse_merge.cuh"
#include "constants.cuh"
#include "kernel_params.cuh"

// State s's lse (-inf for no key) and the address of its out row, at (batch, head, row).
CF2_DEVICE float state_lse(const MergeStatesParams& p, int s, int batch, int head, int row) {
    const MergeStates& in = s == 0 ? p.first : p.rest;
    const i64 index = (s == 0 ? 0 : s - 1) * in.lse_state_stride + batch * in.lse_batch_stride +
                      head * in.lse_head_stride + row * in.lse_row_stride;
    const float lse = __ldcg(in.lse + index);
    return lse == pos_inf() ? neg_inf() : lse;
}

CF2_DEVICE const u16* state_row(const MergeStatesParams& p, int s, int batch, int head,
                                int row) {
    const MergeStates& in = s == 0 ? p.first : p.rest;
    return in.out + (s == 0 ? 0 : s - 1) * in.o_state_stride + batch * in.o_batch_stride +
           row * in.o_row_stride + head * in.o_head_stride;
}

// LANES lanes of a warp merge one (row, head) item, a 16-byte chunk of the row each (8 16-bit
// or 4 float32 elements; lanes loop where a row has more chunks than LANES). Items run over the
// rows of head 0, then head 1, ... (consecutive lse entries), MERGE_THREADS / LANES a CTA; grid
// (items / that, 1, batch). The states come MERGE_GROUP at a time, their lse and chunk loads
// all in flight at once (one round trip to memory a group: a merge is a stream of loads), then
// merged into a running (m, sum, acc) that a larger m rescales. A state without keys is read
// but its chunk is selected away, never multiplied (what it holds, nan included, stays out).
// Out and lse may be one of the states (in place): a lane reads a chunk before it writes it,
// and the item's first lane writes the lse once every lane of the warp has read it
// (__syncwarp). The chunks are read through L2 (ld.global.cg): the read-only path
// (ld.global.nc) is for memory no thread of the kernel writes.
template <typename Elem, int LANES>
__global__ void __launch_bounds__(MERGE_THREADS)
merge_states_kernel(const __grid_constant__ MergeStatesParams p) {
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0,
                  "an item's lanes are a power of two inside one warp");
    constexpr float LOG2E = 1.4426950408889634f;
    constexpr int VALUES = Elem::IS_F32 ? 4 : 8;  // elements of a 16-byte chunk
    constexpr int GROUP = MERGE_GROUP;
    const int lane = threadIdx.x % LANES;
    const int item = blockIdx.x * (MERGE_THREADS / LANES) + threadIdx.x / LANES;
    const int batch = blockIdx.z + p.batch_offset;
    const bool active = item < p.nheads * p.seqlen;
    const int head = item / p.seqlen;
    const int row = item - head * p.seqlen;

    float m = neg_inf(), sum = 0.f;
    for (int chunk = lane; active && chunk * 8 < p.head_dim; chunk += LANES) {
        float acc[VALUES];
#pragma unroll
        for (int i = 0; i < VALUES; ++i) acc[i] = 0.f;
        m = neg_inf();
        sum = 0.f;
        for (int s0 = 0; s0 < p.num_states; s0 += GROUP) {
            float lse[GROUP];
            u32 v[GROUP][4];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                lse[g] = neg_inf();
                if (s0 + g < p.num_states) {
                    lse[g] = state_lse(p, s0 + g, batch, head, row);
                    load_16B_global_l2(v[g], state_row(p, s0 + g, batch, head, row) + chunk * 8);
                }
            }
            float m_new = m;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) m_new = fmaxf(m_new, lse[g]);
            const float rescale = merge_weight(m, m_new, LOG2E);  // (0 before any key)
            m = m_new;
            sum *= rescale;
#pragma unroll
            for (int i = 0; i < VALUES; ++i) acc[i] *= rescale;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float w = merge_weight(lse[g], m, LOG2E);
                const bool counts = w > 0.f;  // (no key, or a weight below fp32's range)
                sum += w;
#pragma unroll
                for (int i = 0; i < VALUES; ++i) {
                    float x;
                    if constexpr (Elem::IS_F32)
                        x = __uint_as_float(v[g][i]);
                    else
                        x = to_float<Elem>(static_cast<u16>(v[g][i / 2] >> (16 * (i % 2))));
                    acc[i] = counts ? fmaf(w, x, acc[i]) : acc[i];
                }
            }
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (Elem::IS_F32)
                o[i] = __float_as_uint(acc[i] * inv);
            else
                o[i] = pack_pair<Elem>(acc[2 * i] * inv, acc[2 * i + 1] * inv);
        }
        store_16B_global(p.out + batch * p.o_batch_stride + row * p.o_row_stride +
                             head * p.o_head_stride + chunk * 8,
                         o);
    }
    __syncwarp();  // (every lane has read the states' lse: the merged one may overwrite one)
    if (active && lane == 0)
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row * p.lse_row_stride] =
            sum > 0.f ? m + logf(sum) : pos_inf();
}
