"""Launching a compiled kernel with its parameter struct.

Every kernel takes one struct by value (cuda_src/kernel_params.cuh), so a launch is the function,
the grid, and the address of a kernelParams array that a plan built once. Measured from Python on
an H200 (docs/PERF_NOTES.md, "Host cost of a call"): `cuda.bindings.driver.cuLaunchKernel` with
such a prebuilt array costs about half of CuPy's launch of the same struct as an argument, so the
driver path is used wherever cuda-bindings is installed (the `cuda12` / `cuda13` extras bring it);
without it, CuPy launches the struct as a `numpy.void`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _compile

#: gridDim.z (the batch) is limited to 65535 blocks; larger batches are launched in slices.
MAX_GRID_Z = 65535

try:  # pragma: no cover - depends on the install
    from cuda.bindings import driver as _driver

    _SUCCESS = _driver.CUresult.CUDA_SUCCESS
    _INVALID_CONTEXT = _driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
except ImportError:  # pragma: no cover
    _driver = None


def driver_launches() -> bool:
    """Whether kernels are launched through cuda.bindings.driver (else through CuPy)."""
    return _driver is not None


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: the compiled function and its grid. `cooperative`: all CTAs
    resident at once (the decode kernel's splits wait for each other)."""

    function: object  # cupy RawKernel
    handle: object  # its CUfunction for the driver path (None without cuda-bindings)
    grid: tuple  # (x, y, batch)
    threads: int
    smem_bytes: int
    cooperative: bool = False


def kernel_launch(config, device_id: int, grid, cooperative: bool = False) -> Launch:
    """The Launch of `config`'s kernel on `grid` (compiled here if need be)."""
    function = _compile.get_kernel(config, device_id)
    handle = _driver.CUfunction(function.kernel.ptr) if _driver is not None else None
    return Launch(function, handle, tuple(int(g) for g in grid), config.threads,
                  config.smem_bytes, cooperative)


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
    if launch.handle is None:
        _cupy_launch(launch, block, stream_ptr, gx, gy, gz)
        return
    if launch.cooperative:
        (err,) = _driver.cuLaunchCooperativeKernel(
            launch.handle, gx, gy, gz, launch.threads, 1, 1, launch.smem_bytes, stream_ptr,
            block.kernel_params_address)
    else:
        (err,) = _driver.cuLaunchKernel(
            launch.handle, gx, gy, gz, launch.threads, 1, 1, launch.smem_bytes, stream_ptr,
            block.kernel_params_address, 0)
    if err != _SUCCESS:
        if err == _INVALID_CONTEXT:
            # A thread whose CUDA context CuPy has not made current yet: CuPy's own launch sets
            # it (once a thread), then the driver path works there too.
            _cupy_launch(launch, block, stream_ptr, gx, gy, gz)
            return
        raise RuntimeError(f"launching {launch.function.name} failed: {err!r}")


def _cupy_launch(launch: Launch, block, stream_ptr: int, gx: int, gy: int, gz: int) -> None:
    """CuPy's launch, on its current stream (the one `stream_ptr` was read from)."""
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
