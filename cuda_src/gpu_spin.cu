// Keeps the GPU busy for a given time (the benchmark's backlog, cuflash2/bench.py): the timed
// calls queue behind it, so the events around each call measure GPU time, not the host's cost
// of validating and launching it. One thread, reading the global nanosecond timer.
extern "C" __global__ void gpu_spin_kernel(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
