"""A busy stream for the stream tests: work queued behind a GPU spin shows whether a call runs on
the current CuPy stream (it waits for the spin) and whether it blocks the host (it returns
before the spin ends)."""

import functools

import cupy
import numpy

_SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
"""


@functools.lru_cache(maxsize=None)
def _spin_kernel():
    return cupy.RawKernel(_SPIN_SOURCE, "spin")


def spin(seconds):
    """Keep the current stream busy for `seconds` of GPU time."""
    _spin_kernel()((1,), (1,), (numpy.uint64(seconds * 1e9),))


def copies_after_spin(stream, arrays, seconds):
    """On `stream`: spin, then copy `arrays` into fresh buffers (filled only after the spin)."""
    with stream:
        spin(seconds)
        copies = []
        for x in arrays:
            copy = cupy.empty_like(x)
            copy.data.copy_from_device_async(x.data, x.nbytes, stream)
            copies.append(copy)
    return copies
