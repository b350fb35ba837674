"""Host cost of the ways to launch a kernel and to allocate outputs from Python (one GPU).

    python benchmarks/dev/launch_paths.py

Each row: wall microseconds per call over back-to-back calls of an empty kernel (so the GPU never
holds the host back). The numbers behind cuflash2/_launch.py's choice of the driver path and
_plans.py's one allocation per call (docs/PERF_NOTES.md, "Host cost of a call").
"""

import sys
from pathlib import Path

import cupy
import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2.bench import host  # noqa: E402

SOURCE = r"""
struct Params { unsigned long long words[32]; };
extern "C" __global__ void two_args(float* x, int n) {}
extern "C" __global__ void forty_args(
    float* a0, float* a1, float* a2, float* a3, float* a4, long long s0, long long s1,
    long long s2, long long s3, long long s4, long long s5, long long s6, long long s7,
    long long s8, long long s9, long long s10, long long s11, int i0, int i1, int i2, int i3,
    int i4, float f0, float f1, int i5, int i6, float f2, float* a5, long long s12, float f3,
    int* a6, int* a7, int i7, int i8, unsigned u0, unsigned u1, unsigned u2, unsigned u3,
    float f4, int i9) {}
extern "C" __global__ void one_struct(const __grid_constant__ Params p) {}
"""
CALLS = 5000


def per_call_us(fn, calls=CALLS):
    """Microseconds per call over `calls` back-to-back calls (bench --host's measurement)."""
    return host._per_call_us(cupy, fn, calls, cupy.cuda.runtime.deviceSynchronize,
                             repeats=1)


def main():
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    two, forty, struct = (module.get_function(n) for n in ("two_args", "forty_args", "one_struct"))
    x = cupy.zeros(16, dtype=cupy.float32)
    i = numpy.int32(1)
    f = numpy.float32(1)
    s = 1 << 20
    forty_args = (x,) * 5 + (s,) * 12 + (i,) * 5 + (f, f, i, i, f, x, s, f, x, x, i, i) + (
        numpy.uint32(1),) * 4 + (f, i)
    params = numpy.zeros(32, dtype=numpy.uint64)
    rows = {
        "CuPy RawKernel, 2 arguments": lambda: two((1,), (32,), (x, i)),
        "CuPy RawKernel, 40 arguments": lambda: forty((1,), (32,), forty_args),
        "CuPy RawKernel, one 256-byte struct (numpy.void)":
            lambda: struct((1,), (32,), (params.view(numpy.dtype((numpy.void, 256)))[0],)),
    }
    try:
        from cuda.bindings import driver

        handle = driver.CUfunction(struct.kernel.ptr)
        kernel_params = numpy.array([params.ctypes.data], dtype=numpy.uint64)
        address = kernel_params.ctypes.data

        def driver_launch():
            params[0] = x.data.ptr  # one pointer patched per call
            driver.cuLaunchKernel(handle, 1, 1, 1, 32, 1, 1, 0,
                                  cupy.cuda.get_current_stream().ptr, address, 0)

        rows["cuda.bindings cuLaunchKernel, prebuilt kernelParams, one pointer patched"] = \
            driver_launch
    except ImportError:
        print("cuda-bindings not installed: driver rows skipped")
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch.restype = ctypes.c_int
    struct_ptr = struct.kernel.ptr
    ctypes_params = numpy.array([params.ctypes.data], dtype=numpy.uint64)
    ctypes_address = ctypes_params.ctypes.data

    def ctypes_launch():
        params[0] = x.data.ptr
        launch(struct_ptr, 1, 1, 1, 32, 1, 1, 0, cupy.cuda.get_current_stream().ptr,
               ctypes_address, None)

    rows["libcuda cuLaunchKernel through ctypes, prebuilt kernelParams, one pointer patched"] = \
        ctypes_launch
    rows["cupy.cuda.get_current_stream().ptr"] = lambda: cupy.cuda.get_current_stream().ptr
    rows["cupy.empty((4096, 64), float16)"] = lambda: cupy.empty((4096, 64), dtype=cupy.float16)
    rows["cupy.cuda.alloc(1 MiB)"] = lambda: cupy.cuda.alloc(1 << 20)
    memory = cupy.cuda.alloc(1 << 20)
    rows["cupy.ndarray((4096, 64), float16, memptr)"] = lambda: cupy.ndarray(
        (4096, 64), cupy.float16, memory)
    rows["cupy.cuda.runtime.getDevice()"] = cupy.cuda.runtime.getDevice
    for label, fn in rows.items():
        print(f"{per_call_us(fn):7.2f} us  {label}")


if __name__ == "__main__":
    main()
