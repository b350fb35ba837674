"""Where a CUtensorMap keeps its global address, and what encoding / replacing one costs.

Encodes the same map for a few base addresses and prints which 64-bit words differ and how
they relate to the address; times cuTensorMapEncodeTiled and cuTensorMapReplaceAddress through
cuda.bindings (the per-call alternatives to patching the address into the parameter bytes).
"""
import ctypes
import time

import cupy
import numpy

from cuflash2 import _hopper


def words(x, base=None):
    from cuda.bindings import driver
    if base is not None:
        x = cupy.ndarray(x.shape, x.dtype, cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(base, x.nbytes, x), 0), strides=x.strides)
    return numpy.frombuffer(_hopper.tensor_map_bytes(x, 128), numpy.uint64)


def main():
    x = cupy.zeros((2, 1024, 8, 128), cupy.float16)
    base = x.data.ptr
    ref = words(x)
    for delta in (16, 256, 4096, 1 << 20, 1 << 30):
        w = words(x, base + delta)
        diff = numpy.nonzero(w != ref)[0]
        print(f"delta {delta:#x}: words differing {diff.tolist()}; "
              + "; ".join(f"w[{i}] {int(ref[i]):#x} -> {int(w[i]):#x} (diff {int(w[i]) - int(ref[i]):#x})"
                          for i in diff))
    print(f"address {base:#x}; words: " + " ".join(f"{int(v):#x}" for v in ref))
    from cuda.bindings import driver
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        _hopper.tensor_map_bytes(x, 128)
    print(f"tensor_map_bytes (encode + copy out): {(time.perf_counter() - t) / n * 1e6:.2f} us")
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, base,
        [driver.cuuint64_t(d) for d in (128, 1024, 8, 2)],
        [driver.cuuint64_t(s) for s in (2048, 256, 2048 * 1024)],
        [driver.cuuint32_t(b) for b in (64, 128, 1, 1)], [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    t = time.perf_counter()
    for i in range(n):
        driver.cuTensorMapReplaceAddress(tmap, base + 256 * (i & 1))
    print(f"cuTensorMapReplaceAddress: {(time.perf_counter() - t) / n * 1e6:.2f} us")
    after = numpy.frombuffer(ctypes.string_at(tmap.getPtr(), 128), numpy.uint64)
    print("replaced map equals fresh encode:", bool((after == words(x, base + 256 * ((n - 1) & 1))).all()))


if __name__ == "__main__":
    main()
