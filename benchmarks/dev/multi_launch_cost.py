"""Host cost of a call that launches several kernels (the backward: preprocess, main, dQ
conversion), by three ways of launching them (one GPU, its own empty kernels).

    python benchmarks/dev/multi_launch_cost.py

- three cuLaunchKernel calls, each with the parameter struct by value (what cuflash2 does);
- one copy of the struct to device memory (cuMemcpyHtoDAsync from pageable memory, which stages
  the bytes before returning, so the host buffer can be patched again at once) and one launch of
  a CUDA graph of the three kernels, which read the struct through a pointer;
- the same copy and three launches that read it through a pointer (the copy's own cost);
- a CUDA graph of the three by-value kernels built once, each call patching the struct, setting
  every node's parameters again (cuGraphExecKernelNodeSetParams copies them) and launching the
  graph, through ctypes on libcuda and through cuda.bindings;
- two and one cuLaunchKernel calls through ctypes, and cuStreamIsCapturing (what a graph path
  would ask each call: a graph launch may not be what a capturing stream records).
Each row: microseconds per call over back-to-back calls, best of three runs.
"""

import ctypes
import sys
from pathlib import Path

import cupy
import numpy
from cuda.bindings import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2.bench import host  # noqa: E402

SOURCE = r"""
struct Params { unsigned long long words[52]; };  // 416 bytes, as BwdParams
extern "C" __global__ void by_value(const __grid_constant__ Params p) {}
extern "C" __global__ void by_pointer(const Params* __restrict__ p) {}
"""
CALLS = 3000


def per_call_us(fn, calls=CALLS):
    """Microseconds per call over `calls` back-to-back calls (bench --host's measurement)."""
    return host._per_call_us(cupy, fn, calls, cupy.cuda.runtime.deviceSynchronize,
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

    lib = ctypes.CDLL("libcuda.so.1")
    function = int(module.get_function("by_value").kernel.ptr)

    class NodeParams(ctypes.Structure):  # cuda.h's CUDA_KERNEL_NODE_PARAMS (v2)
        _fields_ = [("func", ctypes.c_void_p)] + [(n, ctypes.c_uint) for n in (
            "gx", "gy", "gz", "bx", "by", "bz", "smem")] + [
            ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
            ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]

    node_params = NodeParams(function, 1, 1, 1, 128, 1, 1, 0, address, None, None, None)
    graph_handle, nodes, previous = ctypes.c_void_p(), [], None
    assert lib.cuGraphCreate(ctypes.byref(graph_handle), 0) == 0
    for _ in range(3):
        node = ctypes.c_void_p()
        deps = (ctypes.c_void_p * 1)(previous) if previous is not None else None
        assert lib.cuGraphAddKernelNode_v2(ctypes.byref(node), graph_handle, deps,
                                           1 if previous is not None else 0,
                                           ctypes.byref(node_params)) == 0
        nodes.append(node)
        previous = node
    graph_exec = ctypes.c_void_p()
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(graph_exec), graph_handle, 0) == 0
    set_params, launch_graph = lib.cuGraphExecKernelNodeSetParams_v2, lib.cuGraphLaunch
    set_params.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch_graph.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    node_params_address = ctypes.addressof(node_params)
    exec_address, node_addresses = graph_exec.value, [n.value for n in nodes]

    def graph_set_params_ctypes():
        params[0] = x.data.ptr
        for node in node_addresses:
            set_params(exec_address, node, node_params_address)
        launch_graph(exec_address, stream.ptr)

    def graph_only_ctypes():
        launch_graph(exec_address, stream.ptr)

    b_exec = driver.CUgraphExec(exec_address)
    b_nodes = [driver.CUgraphNode(n) for n in node_addresses]
    b_params = driver.CUDA_KERNEL_NODE_PARAMS()
    b_params.func = by_value
    b_params.gridDimX = b_params.gridDimY = b_params.gridDimZ = 1
    b_params.blockDimX, b_params.blockDimY, b_params.blockDimZ = 128, 1, 1
    b_params.sharedMemBytes = 0
    b_params.kernelParams = address

    def graph_set_params_bindings():
        params[0] = x.data.ptr
        for node in b_nodes:
            driver.cuGraphExecKernelNodeSetParams(b_exec, node, b_params)
        driver.cuGraphLaunch(b_exec, stream.ptr)

    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def launches_ctypes(n):
        def fn():
            params[0] = x.data.ptr
            for _ in range(n):
                launch(function, 1, 1, 1, 128, 1, 1, 0, stream.ptr, address, None)
        return fn

    status = ctypes.c_int()
    is_capturing = lib.cuStreamIsCapturing
    is_capturing.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    status_address = ctypes.addressof(status)

    for label, fn in (("3 x cuLaunchKernel, struct by value", three_launches),
                      ("cuMemcpyHtoDAsync + graph of 3 kernels", copy_and_graph),
                      ("cuMemcpyHtoDAsync + 3 CuPy launches by pointer",
                       copy_and_three_launches),
                      ("graph of 3 by-value kernels: 3 x SetParams + cuGraphLaunch (ctypes)",
                       graph_set_params_ctypes),
                      ("graph of 3 by-value kernels: 3 x SetParams + cuGraphLaunch (bindings)",
                       graph_set_params_bindings),
                      ("graph of 3 kernels: cuGraphLaunch alone (ctypes)", graph_only_ctypes),
                      ("3 x cuLaunchKernel (ctypes)", launches_ctypes(3)),
                      ("2 x cuLaunchKernel (ctypes)", launches_ctypes(2)),
                      ("1 x cuLaunchKernel (ctypes)", launches_ctypes(1)),
                      ("cuStreamIsCapturing (ctypes)",
                       lambda: is_capturing(stream.ptr, status_address))):
        print(f"{per_call_us(fn):7.2f} us  {label}")


if __name__ == "__main__":
    main()
