"""What this machine has: versions, GPU, CuPy's kernel cache. Used by `info` and `bench --json`.

Everything here imports CuPy lazily and never raises, so `python -m cuflash2 info` works on a
machine without CuPy or without a GPU.
"""

from __future__ import annotations

import datetime
import os
import re
import platform
import sys
from importlib import metadata


def forward_kernel_family(compute_capability: str) -> str:
    """Which forward kernels run on a GPU of this compute capability ("9.0" or "90")."""
    from . import _configs, _dispatch

    if compute_capability.replace(".", "") != "90":
        return "mma.sync kernels (cuflash2.forward_kernels(q, k, v, ...) names a call's)"
    if not _dispatch.HOPPER_FORWARD:
        return "mma.sync kernels (CUFLASH2_HOPPER=0)"
    dims = "/".join(str(d) for d in _configs.SM90_FWD_HEAD_DIMS)
    varlen = "" if _dispatch.HOPPER_FORWARD_VARLEN else ", varlen (CUFLASH2_HOPPER_VARLEN=0)"
    e4m3 = "/".join(str(d) for d in _dispatch.E4M3_SM90_FWD_TILES)
    return (f"Hopper kernels (wgmma, TMA; head dims {dims}) except dropout{varlen} and d <= "
            f"{_dispatch.MMA_SYNC_MAX_DIM} with <= {_dispatch.MMA_SYNC_MAX_KEYS} keys, which run "
            f"mma.sync; FP8 e4m3 inputs (qkv_dtype='e4m3') at head dims {e4m3} "
            "(cuflash2.forward_kernels(q, k, v, ...) names a call's)")


def backward_kernel_family(compute_capability: str) -> str:
    """Which backward main kernels run on a GPU of this compute capability ("9.0" or "90")."""
    from . import _configs, _dispatch

    names = "cuflash2.backward_kernels(dout, q, k, v, out, lse, ...) names a call's"
    if compute_capability.replace(".", "") != "90":
        return f"mma.sync kernels ({names})"
    if not _dispatch.HOPPER_BACKWARD:
        return "mma.sync kernels (the Hopper backward is switched off: CUFLASH2_HOPPER_BWD=0)"
    dims = "/".join(str(d) for d in _configs.SM90_BWD_HEAD_DIMS)
    varlen = "" if _dispatch.HOPPER_BACKWARD_VARLEN else ", varlen (CUFLASH2_HOPPER_BWD_VARLEN=0)"
    return (f"Hopper kernel (wgmma, TMA; head dims {dims}) except dropout, float32 and score "
            f"modifiers other than a bias{varlen}, which run mma.sync ({names})")


#: How to install CuPy, for the messages that find it missing: the wheel for the CUDA version,
#: or cuflash2's extra from a checkout (cuflash2 is not on a package index yet).
CUPY_INSTALL_HINT = ('pip install cupy-cuda13x (CUDA 13; cupy-cuda12x for CUDA 12), or from a '
                     'checkout of cuflash2 pip install ".[cuda13]" (or ".[cuda12]")')


def cupy_cache_dir() -> str:
    """CuPy's on-disk kernel cache, where compiled cuflash2 kernels persist between processes."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def cached_modules(cache_dir: str, own: bool = False) -> int:
    """Compiled modules in CuPy's kernel cache `cache_dir` (its .cubin files: cuflash2's and any
    other CuPy user's, CuPy's own elementwise and reduction kernels among them); with `own`
    cuflash2's alone (OWN_KERNEL_NAME in the module's symbols); 0 where the directory does not
    exist."""
    try:
        entries = [entry for entry in os.scandir(cache_dir) if entry.name.endswith(".cubin")]
    except OSError:
        return 0
    if not own:
        return len(entries)
    count = 0
    for entry in entries:
        try:
            with open(entry.path, "rb") as handle:
                count += OWN_KERNEL_NAME.search(handle.read()) is not None
        except OSError:
            continue
    return count


#: What every cuflash2 kernel's (mangled) name holds: the families' flash_*_kernel and
#: merge_states_kernel (cuda_src/), as a compiled module's symbol table spells them.
OWN_KERNEL_NAME = re.compile(rb"flash_[a-z0-9_]*kernel|merge_states_kernel")


def find_gpu():
    """Return (cupy module, None) when a CUDA device is usable, else (None, reason for a person)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return None, (
            f"CuPy is not available ({exc.__class__.__name__}: {exc}); install it: "
            f"{CUPY_INSTALL_HINT}"
        )
    # The runtime reports driver version 0 where no NVIDIA driver is installed, and then calls
    # that "insufficient", which reads as a driver too old.
    if _try(lambda: cupy.cuda.runtime.driverGetVersion()) == 0:
        return None, "no NVIDIA driver is installed (cuflash2's kernels need one and a GPU)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no device, CUDA_VISIBLE_DEVICES=""
        return None, f"no CUDA device is visible ({exc})"
    if count == 0:
        return None, "no CUDA device is visible"
    return cupy, None


def _cuda_version(code: int) -> str:
    # CUDA encodes versions as 1000 * major + 10 * minor.
    return f"{code // 1000}.{code % 1000 // 10}"


def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _try(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


def _cuflash2_version() -> str:
    import cuflash2

    return getattr(cuflash2, "__version__", None) or _distribution_version("cuflash2") or "unknown"


def collect() -> dict:
    """All facts as a JSON-friendly dict; missing pieces are None, with a reason under 'gpu_error'."""
    import numpy

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cuflash2": _cuflash2_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "ml_dtypes": _try(lambda: __import__("ml_dtypes").__version__),
        # torch is only reported, never imported here (slow, and optional).
        "torch": _distribution_version("torch"),
        "cupy": None,
        "cuda_runtime": None,
        "cuda_driver": None,
        "nvrtc": None,
        "gpu": None,
        "gpu_error": None,
        "cupy_cache_dir": cupy_cache_dir(),
    }
    env["cupy_cache_modules"] = cached_modules(env["cupy_cache_dir"])
    env["cupy_cache_own_modules"] = cached_modules(env["cupy_cache_dir"], own=True)
    cupy, reason = find_gpu()
    if cupy is None:
        env["gpu_error"] = reason
        # CuPy may be installed on a machine without a GPU: still report what it can say.
        cupy = _try(lambda: __import__("cupy"))
    if cupy is not None:
        runtime = cupy.cuda.runtime
        env["cupy"] = cupy.__version__
        env["cuda_runtime"] = _try(lambda: _cuda_version(runtime.runtimeGetVersion()))
        driver = _try(runtime.driverGetVersion)
        env["cuda_driver"] = _cuda_version(driver) if driver else None  # 0: no driver
        env["nvrtc"] = _try(lambda: "{}.{}".format(*cupy.cuda.nvrtc.getVersion()))
    if env["gpu_error"] is None:
        env["gpu"] = _try(lambda: _describe_device(cupy))
    return env


def _describe_device(cupy) -> dict:
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"]
    return {
        "index": device.id,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": props["multiProcessorCount"],
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "l2_cache_mib": round(props.get("l2CacheSize", 0) / 2**20, 1),
    }


def format_info(env: dict) -> list[str]:
    """Human-readable lines for `python -m cuflash2 info`."""
    missing = "not installed"
    lines = [
        f"cuflash2       {env['cuflash2']}",
        f"python         {env['python']} ({env['platform']})",
        f"numpy          {env['numpy']}",
        f"ml_dtypes      {env['ml_dtypes'] or missing}",
        f"cupy           {env['cupy'] or missing}",
    ]
    if env["cupy"]:
        lines += [
            f"CUDA runtime   {env['cuda_runtime'] or 'unknown'}",
            f"CUDA driver    {env['cuda_driver'] or 'none found (no NVIDIA driver installed?)'}",
            f"NVRTC          {env['nvrtc'] or 'not found'}",
        ]
    lines.append(f"torch          {env['torch'] or missing} (only for bench --compare torch)")
    gpu = env["gpu"]
    if gpu:
        lines += [
            f"GPU            {gpu['index']}: {gpu['name']}",
            f"compute cap.   sm_{gpu['compute_capability'].replace('.', '')}"
            + ("" if float(gpu["compute_capability"]) >= 8.0 else " (cuflash2 needs sm_80 or newer)"),
            f"SMs            {gpu['sm_count']}",
            f"memory         {gpu['memory_gib']} GiB, L2 {gpu['l2_cache_mib']} MiB",
            f"forward        {forward_kernel_family(gpu['compute_capability'])}",
            f"backward       {backward_kernel_family(gpu['compute_capability'])}",
        ]
    else:
        lines.append(f"GPU            none: {env['gpu_error'] or 'device query failed'}")
    lines.append(f"kernel cache   {env['cupy_cache_dir']} ({env.get('cupy_cache_modules', 0)} "
                 f"compiled modules, {env.get('cupy_cache_own_modules', 0)} of them cuflash2's; "
                 f"CuPy's: set CUPY_CACHE_DIR to move it, fill it with `cuflash2 precompile`)")
    return lines
