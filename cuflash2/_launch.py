"""Launching a compiled kernel with its parameter struct.

Every kernel takes one struct by value (cuda_src/kernel_params.cuh), so a launch is the function,
the grid, and the address of a kernelParams array that a plan built once. Three ways to launch,
cheapest first as measured from Python on an H200 (docs/PERF_NOTES.md, "Host cost of a call";
`benchmarks/dev/launch_paths.py`):
- "bindings": the driver's `cuLaunchKernel` through `cuda.bindings.driver` (the `cuda12` /
  `cuda13` extras install it) with the plan's prebuilt kernelParams array;
- "libcuda": the same call through ctypes (the driver library is loaded anyway: CuPy runs on
  it), whose argument conversion costs about a microsecond more;
- "cupy": CuPy's launch with the struct as a `numpy.void` argument.
The first that loads is used; CUFLASH2_LAUNCH=bindings|libcuda|cupy picks one.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from . import _compile

#: gridDim.z (the batch) is limited to 65535 blocks; larger batches are launched in slices.
MAX_GRID_Z = 65535
_CUDA_SUCCESS = 0
_CUDA_ERROR_INVALID_CONTEXT = 201


def _load_libcuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, None
    args = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2
    launch = lib.cuLaunchKernel
    launch.argtypes = args + [ctypes.c_void_p]  # ..., hStream, kernelParams, extra
    launch.restype = ctypes.c_int
    cooperative = lib.cuLaunchCooperativeKernel
    cooperative.argtypes = args  # ..., hStream, kernelParams
    cooperative.restype = ctypes.c_int
    return launch, cooperative


def _load_bindings():
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _choose() -> str:
    wanted = os.environ.get("CUFLASH2_LAUNCH", "")
    if wanted not in ("", "libcuda", "bindings", "cupy"):
        raise ValueError(f"CUFLASH2_LAUNCH must be bindings, libcuda or cupy; got {wanted!r}")
    for method in ((wanted,) if wanted else ("bindings", "libcuda", "cupy")):
        if method == "libcuda" and _libcuda_launch is not None:
            return method
        if method == "bindings" and _bindings is not None:
            return method
        if method == "cupy":
            return method
    raise RuntimeError(f"CUFLASH2_LAUNCH={wanted}: that launch path is not available here")


_libcuda_launch, _libcuda_cooperative = _load_libcuda()
_bindings = _load_bindings()
#: The launch path in use.
METHOD = _choose()


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: the compiled function and its grid. `cooperative`: all CTAs
    resident at once (the decode kernel's splits wait for each other)."""

    function: object  # cupy RawKernel
    handle: object  # its CUfunction: an int for libcuda, a CUfunction for bindings
    grid: tuple  # (x, y, batch)
    threads: int
    smem_bytes: int
    cooperative: bool = False
    config: object = None  # what was compiled (a _configs configuration)


def kernel_launch(config, device_id: int, grid, cooperative: bool = False) -> Launch:
    """The Launch of `config`'s kernel on `grid` (compiled here if need be)."""
    function = _compile.get_kernel(config, device_id)
    handle = function.kernel.ptr
    if METHOD == "bindings":
        handle = _bindings.CUfunction(handle)
    return Launch(function, handle, tuple(int(g) for g in grid), config.threads,
                  config.smem_bytes, cooperative, config)


def run(launch: Launch, block, stream_ptr: int, batch_offset_slot) -> None:
    """Launches `launch` with the parameter block `block` (a _params.ParamBlock) on the stream
    `stream_ptr`, slicing gridDim.z into chunks of 65535 (the struct's batch_offset, patched
    through `batch_offset_slot`, tells each slice its first sequence)."""
    gx, gy, batch = launch.grid
    if batch <= MAX_GRID_Z:
        _launch_once(launch, block, stream_ptr, gx, gy, batch)
        return
    view, index = batch_offset_slot
    try:
        for offset in range(0, batch, MAX_GRID_Z):
            view[index] = offset
            _launch_once(launch, block, stream_ptr, gx, gy, min(MAX_GRID_Z, batch - offset))
    finally:
        view[index] = 0


def _launch_once(launch: Launch, block, stream_ptr: int, gx: int, gy: int, gz: int) -> None:
    if METHOD == "libcuda":
        if launch.cooperative:
            err = _libcuda_cooperative(launch.handle, gx, gy, gz, launch.threads, 1, 1,
                                       launch.smem_bytes, stream_ptr, block.kernel_params_address)
        else:
            err = _libcuda_launch(launch.handle, gx, gy, gz, launch.threads, 1, 1,
                                  launch.smem_bytes, stream_ptr, block.kernel_params_address, None)
    elif METHOD == "bindings":
        launch_fn = (_bindings.cuLaunchCooperativeKernel if launch.cooperative
                     else _bindings.cuLaunchKernel)
        extra = () if launch.cooperative else (0,)
        (err,) = launch_fn(launch.handle, gx, gy, gz, launch.threads, 1, 1, launch.smem_bytes,
                           stream_ptr, block.kernel_params_address, *extra)
        err = int(err)
    else:
        _cupy_launch(launch, block, gx, gy, gz)
        return
    if err != _CUDA_SUCCESS:
        if err == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread whose CUDA context CuPy has not made current yet: CuPy's own launch sets
            # it (once a thread), then the driver path works there too.
            _cupy_launch(launch, block, gx, gy, gz)
            return
        raise RuntimeError(f"launching {launch.function.name} failed: CUresult {err}")


def _cupy_launch(launch: Launch, block, gx: int, gy: int, gz: int) -> None:
    """CuPy's launch, on its current stream (the one the plan read `stream_ptr` from)."""
    launch.function.kernel((gx, gy, gz), (launch.threads,), (block.as_void(),),
                           shared_mem=launch.smem_bytes,
                           enable_cooperative_groups=launch.cooperative)


def occupancy_slots(config, device_id: int) -> int:
    """SMs x CTAs of `config`'s kernel resident per SM (the driver's occupancy: what a
    cooperative launch of it allows)."""
    import cupy

    function = _compile.get_kernel(config, device_id)
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        function.kernel.ptr, config.threads, config.smem_bytes)
    return max(1, per_sm) * cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
