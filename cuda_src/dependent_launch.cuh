// Programmatic dependent launch (sm_90 and newer).
//
// A kernel launched with programmatic stream serialisation (_launch.py: the launch attribute)
// may start while the kernel before it on the stream is still running: once every CTA of that
// kernel has called allow_dependent_launch() or exited. Until it calls wait_for_previous_grid(),
// it must not read what earlier work on the stream writes, nor write what that work reads:
// the wait returns once the previous kernel has finished and its memory is visible. What comes
// before the wait (the launch itself, work on the parameters alone) is hidden behind the
// previous kernel's tail.
//
// Launched without the attribute (or before sm_90), the previous kernel has finished when this
// one starts: the wait returns at once and the trigger does nothing.
#pragma once
#include "mma_primitives.cuh"

// Returns once the kernels this one depends on have finished and their writes are visible.
CF2_DEVICE void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel on the stream start (its CTAs then run up to their own wait); called by
// every thread of the CTA, or by none (the CTA's exit then counts).
CF2_DEVICE void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
