"""Loading the CUDA sources and compiling kernel specialisations.

On a GPU, `get_kernel` compiles with `cupy.RawModule` (NVRTC), caches the module in-process
(thread-safe) and lets CuPy's disk cache (CUPY_CACHE_DIR) serve later processes. On a machine
without a GPU, `compile_report` drives NVRTC directly through `cuda.bindings.nvrtc` for a named
architecture and parses ptxas's resource report, so CI can compile every specialisation.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

#: Options shared by both compile paths. No CUDA headers are included by the sources.
NVRTC_OPTIONS = ("-std=c++17",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def cuda_src_dir() -> Path:
    """The kernel sources: `cuflash2/cuda_src` in a wheel, top-level `cuda_src` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "flash_fwd.cu").is_file():
            return candidate
    raise FileNotFoundError(f"cuflash2 CUDA sources not found next to {here}")


#: The header of shared constants, generated from cuflash2/_configs.py (no file on disk).
GENERATED_HEADER = "constants.cuh"


@lru_cache(maxsize=64)
def kernel_source(filename: str, headers: tuple = ()) -> str:
    """The source of `filename` with its local includes inlined (each header once, each ".inc"
    fragment wherever it is included); `headers`,
    (name, text) pairs, replace the files of those names (a specialisation's generated headers:
    the programmable modifiers' user_mods.cuh, FwdModsConfig).

    Inlining makes the source string the whole truth: CuPy's disk cache keys on the string, so a
    changed header can never be served from a stale cache entry.
    """
    from . import _configs

    root = cuda_src_dir()
    seen: set[str] = set()
    generated = dict(headers)

    def expand(name: str) -> str:
        # A ".inc" file is a fragment of code (a kernel body, cuda_src/flash_bwd_body.inc),
        # inlined wherever it is included; a header, once.
        if name in seen and not name.endswith(".inc"):
            return ""
        seen.add(name)
        if name == GENERATED_HEADER:
            return _configs.cuda_constants_header()
        text = generated[name] if name in generated else (root / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


def specialisation_source(config) -> str:
    """The source compiled for `config`: its file, then static_asserts that the kernel's traits
    agree with what the host derives from `config` (threads, shared memory)."""
    headers = getattr(config, "generated_headers", ())
    return kernel_source(config.source_file, headers) + getattr(config, "probes", "")


# ---------------------------------------------------------------------------------------------
# GPU path: cupy.RawModule


_modules: dict = {}
_modules_lock = threading.Lock()


def arch_options(config) -> tuple:
    """Options a config adds to NVRTC_OPTIONS on the GPU path: `-arch=sm_90a` for one with
    `arch_suffix` "a" (wgmma and setmaxnreg need the architecture-specific target; CuPy appends
    its own `-arch=sm_<cc>`, and NVRTC 13 given both keeps `.target sm_90a`, seen on the H200),
    and the config's `extra_options` (debugging defines), if any."""
    suffix = getattr(config, "arch_suffix", "")
    arch = (f"-arch=sm_{config.arch}{suffix}",) if suffix else ()
    return arch + tuple(getattr(config, "extra_options", ()))


def target_arch(config, arch: int) -> str:
    """The `-arch` value of a CPU compile of `config` for sm_`arch`: `90a` where the config asks
    for the architecture-specific target (it must then be built for its own `arch`)."""
    suffix = getattr(config, "arch_suffix", "")
    if suffix and arch != config.arch:
        raise ValueError(f"{config.name_expression} is built for sm_{config.arch}{suffix} only")
    return f"{arch}{suffix}"


def get_kernel(config, device_id: int):
    """The compiled kernel function for `config` on device `device_id` (compiled once)."""
    key = (config, device_id)
    fn = _modules.get(key)
    if fn is not None:
        return fn
    with _modules_lock:
        fn = _modules.get(key)
        if fn is None:
            import cupy

            try:
                module = cupy.RawModule(code=specialisation_source(config),
                                        options=NVRTC_OPTIONS + arch_options(config),
                                        name_expressions=[config.name_expression])
                fn = module.get_function(config.name_expression)
            except Exception as exc:
                _raise_user_error(config, exc)
                raise
            if config.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = config.smem_bytes
            _modules[key] = fn
    return fn


def _raise_user_error(config, exc) -> None:
    """For a specialisation with programmable modifiers (FwdModsConfig) whose compile failed:
    raises mods.ModCompileError with the user's expressions and NVRTC's messages on them
    (from `exc`'s text: CuPy's CompileException, or compile_report's RuntimeError)."""
    if getattr(config, "user_mods", ""):
        from . import mods

        raise mods.compile_error(config.user_mods, str(exc)) from None


# ---------------------------------------------------------------------------------------------
# CPU path: NVRTC through cuda.bindings, for compile tests and resource reports


@dataclass(frozen=True)
class CompileReport:
    name_expression: str
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    cubin_bytes: int
    log: str
    # Instructions whose memory descriptor starts at an odd uniform register, which the GPU
    # refuses (_sass.py); None where there is no nvdisasm to read the SASS with.
    odd_descriptors: tuple | None = None


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _nvrtc_check(result, what: str, prog=None, nvrtc=None):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        log = _nvrtc_log(prog, nvrtc) if prog is not None else ""
        raise RuntimeError(f"NVRTC {what} failed ({err!r}):\n{log}")
    return result[1:] if isinstance(result, tuple) else ()


def _nvrtc_log(prog, nvrtc) -> str:
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00")


def compile_report(config, arch: int) -> CompileReport:
    """Compiles `config` to a cubin for sm_`arch` (sm_90a for a config whose `arch_suffix` is
    "a") with NVRTC and returns ptxas's report, with the SASS's check where nvdisasm is there."""
    from cuda.bindings import nvrtc

    from . import _sass

    source = specialisation_source(config).encode()
    (prog,) = _nvrtc_check(
        nvrtc.nvrtcCreateProgram(source, config.source_file.encode(), 0, [], []), "create")
    try:
        _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, config.name_expression.encode()),
                     "add name expression", prog, nvrtc)
        options = [o.encode() for o in NVRTC_OPTIONS + tuple(getattr(config, "extra_options", ()))]
        options += [f"-arch=sm_{target_arch(config, arch)}".encode(), b"--ptxas-options=-v"]
        try:
            _nvrtc_check(nvrtc.nvrtcCompileProgram(prog, len(options), options), "compile",
                         prog, nvrtc)
        except RuntimeError as exc:
            _raise_user_error(config, exc)
            raise
        log = _nvrtc_log(prog, nvrtc)
        (cubin_size,) = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size", prog, nvrtc)
        odd_descriptors = None
        if _sass.nvdisasm() is not None:
            cubin = b" " * cubin_size
            _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin", prog, nvrtc)
            odd_descriptors = tuple(_sass.odd_descriptor_instructions(_sass.disassemble(cubin)))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    regs = _PTXAS_REGS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    if regs is None or spills is None:
        raise RuntimeError(f"no ptxas resource report in the NVRTC log:\n{log}")
    stack, stores, loads = (int(x) for x in spills.groups())
    return CompileReport(config.name_expression, arch, int(regs.group(1)), stores, loads, stack,
                         int(cubin_size), log, odd_descriptors)


def compile_probe(source: str, arch: int | str = 80, sass: bool = False) -> None:
    """Compiles `source` (no kernels needed: static_assert probes) to PTX for compute_`arch`,
    or with `sass` through ptxas for sm_`arch` (`arch` "90a": the architecture-specific target;
    inline PTX is then checked by the assembler too); raises RuntimeError with NVRTC's log if
    it does not compile."""
    from cuda.bindings import nvrtc

    (prog,) = _nvrtc_check(nvrtc.nvrtcCreateProgram(source.encode(), b"probe.cu", 0, [], []),
                           "create")
    try:
        target = f"sm_{arch}" if sass else f"compute_{arch}"
        options = [o.encode() for o in NVRTC_OPTIONS] + [f"-arch={target}".encode()]
        _nvrtc_check(nvrtc.nvrtcCompileProgram(prog, len(options), options), "compile", prog,
                     nvrtc)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
