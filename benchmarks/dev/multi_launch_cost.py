"""Host cost of a call that launches several kernels (the backward: preprocess, main, dQ
conversion), by three ways of launching them (one GPU, its own empty kernels).

    python benchmarks/dev/multi_launch_cost.py

- three cuLaunchKernel calls, each with the parameter struct by value (what cuflash2 does);
- one copy of the struct to device memory (cuMemcpyHtoDAsync from pageable memory, which stages
  the bytes before returning, so the host buffer can be patched again at once) and one launch of
  a CUDA graph of the three kernels, which read the struct through a pointer;
- the same copy and three launches that read it through a pointer (the copy's own cost).
Each row: microseconds per call over back-to-back calls, best of three runs.
"""

import sys
from pathlib import Path

import cupy
import numpy
from cuda.bindings import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2 import bench_host  # noqa: E402

SOURCE = r"""
struct Params { unsigned long long words[52]; };  // 416 bytes, as BwdParams
extern "C" __global__ void by_value(const __grid_constant__ Params p) {}
extern "C" __global__ void by_pointer(const Params* __restrict__ p) {}
"""
CALLS = 3000


def per_call_us(fn, calls=CALLS):
    """Microseconds per call over `calls` back-to-back calls (bench --host's measurement)."""
    return bench_host._per_call_us(cupy, fn, calls, cupy.cuda.runtime.deviceSynchronize,
                                   repeats=3)


def main():
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    by_value = driver.CUfunction(module.get_function("by_value").kernel.ptr)
    by_pointer_kernel = module.get_function("by_pointer")
    params = numpy.zeros(52, dtype=numpy.uint64)
    kernel_params = numpy.array([params.ctypes.data], dtype=numpy.uint64)
    address = kernel_params.ctypes.data
    device_params = cupy.zeros(52, dtype=cupy.uint64)
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(8, dtype=cupy.float32)

    def three_launches():
        params[0] = x.data.ptr
        for _ in range(3):
            driver.cuLaunchKernel(by_value, 1, 1, 1, 128, 1, 1, 0, stream.ptr, address, 0)

    with stream:
        stream.begin_capture()
        for _ in range(3):
            by_pointer_kernel((1,), (128,), (device_params,))
        graph = stream.end_capture()

    def copy_and_graph():
        params[0] = x.data.ptr
        driver.cuMemcpyHtoDAsync(device_params.data.ptr, params.ctypes.data, params.nbytes,
                                 stream.ptr)
        graph.launch(stream)

    def copy_and_three_launches():
        params[0] = x.data.ptr
        driver.cuMemcpyHtoDAsync(device_params.data.ptr, params.ctypes.data, params.nbytes,
                                 stream.ptr)
        with stream:
            for _ in range(3):
                by_pointer_kernel((1,), (128,), (device_params,))

    for label, fn in (("3 x cuLaunchKernel, struct by value", three_launches),
                      ("cuMemcpyHtoDAsync + graph of 3 kernels", copy_and_graph),
                      ("cuMemcpyHtoDAsync + 3 CuPy launches by pointer",
                       copy_and_three_launches)):
        print(f"{per_call_us(fn):7.2f} us  {label}")


if __name__ == "__main__":
    main()
