// A stand-in for a model's work between two decoding layers (`bench --decode`'s in-graph rows,
// the GPU tests): the next layer's q, k and v from this layer's output, so that the next
// layer's attention cannot read its q before this layer has written its output, as in a model.
// q[i] = out[i], k[i] = out[i], v[i] = out[i + kv_elems] (indices modulo out_elems).
//
// Launched programmatically (dependent_launch.cuh), it lets the next kernel start at once and
// waits for the previous one before reading `out`. `delay_ns` (tests) spins between the wait and
// the writes, so that a next kernel that read too early would see the old values.
#include "dependent_launch.cuh"

extern "C" __global__ void next_layer_inputs(const u16* out, int out_elems, u16* q, int q_elems,
                                             u16* k, u16* v, int kv_elems,
                                             unsigned long long delay_ns) {
    allow_dependent_launch();
    wait_for_previous_grid();
    if (delay_ns != 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        } while (now - start < delay_ns);
    }
    const int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < q_elems; i += stride)
        q[i] = out[i % out_elems];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kv_elems; i += stride) {
        k[i] = out[i % out_elems];
        v[i] = out[(i + kv_elems) % out_elems];
    }
}
