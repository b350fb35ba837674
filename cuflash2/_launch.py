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

A kernel that waits for the previous kernel's writes itself (cuda_src/dependent_launch.cuh) is
launched with programmatic stream serialisation on sm_90 and newer, through `cuLaunchKernelEx`
with a launch config built once per plan: it may then start while the previous kernel on the
stream finishes, in a CUDA graph too (stream capture keeps the programmatic edge).
CUFLASH2_PDL=0 launches it as any other kernel; so does the "cupy" path, which has no launch
attributes. Thread-block clusters chosen at run time (the decode kernel's split merge on sm_90)
take the same path, with the cluster attribute.

A plan's launches are replayed as one CUDA graph where the driver allows it (`LaunchGraphs`):
on an H200 a three-kernel graph whose nodes get their parameters again each call costs the host
3.6-6.7 us, one kernel launch 5.3-7.9 us (two machine states;
`benchmarks/dev/multi_launch_cost.py`). A stream that is being captured gets the plain launches
instead, so a captured call records kernel nodes (and programmatic edges) as before.
CUFLASH2_GRAPHS=0 launches every kernel on its own.
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


#: cuda.h's CUlaunchAttributeID values, and the function attribute that allows clusters of
#: more than 8 CTAs.
_ATTRIBUTE_COOPERATIVE = 2
_ATTRIBUTE_CLUSTER_DIMENSION = 4
_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
#: Clusters beyond this size need that attribute.
PORTABLE_CLUSTER_SIZE = 8


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_libcuda_functions: dict = {}


def _open_libcuda():
    """The driver library (loaded anyway: CuPy runs on it), or None where it does not load."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _load_libcuda(lib):
    if lib is None:
        return None, None, None
    args = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2
    launch = lib.cuLaunchKernel
    launch.argtypes = args + [ctypes.c_void_p]  # ..., hStream, kernelParams, extra
    launch.restype = ctypes.c_int
    cooperative = lib.cuLaunchCooperativeKernel
    cooperative.argtypes = args  # ..., hStream, kernelParams
    cooperative.restype = ctypes.c_int
    extended = getattr(lib, "cuLaunchKernelEx", None)
    if extended is not None:
        extended.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p]  # config, f, kernelParams, extra
        extended.restype = ctypes.c_int
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuFuncSetAttribute.restype = ctypes.c_int
        lib.cuOccupancyMaxActiveClusters.argtypes = [
            ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
        lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
        _libcuda_functions.update(set_attribute=lib.cuFuncSetAttribute,
                                  max_clusters=lib.cuOccupancyMaxActiveClusters)
    return launch, cooperative, extended


class _KernelNodeParams(ctypes.Structure):
    """cuda.h's CUDA_KERNEL_NODE_PARAMS (its v2, which cuGraphAddKernelNode_v2 takes)."""

    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint),
                ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _GraphAPI:
    """The driver's graph functions a plan's graph is made with, through ctypes (argument
    types set once); the capture check and the graph launch of each call go through CuPy's
    runtime instead (`cuda_runtime`)."""

    def __init__(self, lib):
        p, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        signatures = {
            "create": ("cuGraphCreate", [p, u]),
            "add_kernel_node": ("cuGraphAddKernelNode_v2", [p, p, p, ctypes.c_size_t, p]),
            "set_attribute": ("cuGraphKernelNodeSetAttribute", [p, i, p]),
            "instantiate": ("cuGraphInstantiateWithFlags", [p, p, ctypes.c_ulonglong]),
            "destroy": ("cuGraphDestroy", [p]),
            "destroy_exec": ("cuGraphExecDestroy", [p]),
            "set_params": ("cuGraphExecKernelNodeSetParams_v2", [p, p, p]),
        }
        for name, (symbol, argtypes) in signatures.items():
            function = getattr(lib, symbol)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            setattr(self, name, function)


def _load_graph_api(lib):
    if lib is None:
        return None
    try:
        return _GraphAPI(lib)
    except AttributeError:  # a driver without the graph functions
        return None


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


_libcuda = _open_libcuda()
_libcuda_launch, _libcuda_cooperative, _libcuda_extended = _load_libcuda(_libcuda)
_bindings = _load_bindings()
#: The launch path in use.
METHOD = _choose()


def switch(variable: str) -> bool:
    """An on/off environment variable of cuflash2: 1 (the default) or 0."""
    wanted = os.environ.get(variable, "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 or 1; got {wanted!r}")
    return wanted == "1"


def _programmatic_wanted() -> bool:
    return switch("CUFLASH2_PDL")


#: Kernels that wait for the previous kernel themselves get programmatic launches (sm_90+).
#: Read when a plan is made: plans made before a change keep their launches.
PROGRAMMATIC = _programmatic_wanted()
#: The first compute capability with programmatic dependent launch.
PROGRAMMATIC_MIN_ARCH = 90


def _graphs_wanted() -> bool:
    return switch("CUFLASH2_GRAPHS")


_graph_api = _load_graph_api(_libcuda)
#: Plans replay their launches as a CUDA graph (LaunchGraphs); read when a plan is made.
GRAPHS = _graphs_wanted()


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
    programmatic: bool = False  # may start while the previous kernel finishes (PDL)
    cluster: int = 1  # CTAs a thread-block cluster along x
    # Launches with attributes (the two above): cuLaunchKernelEx's config (grid, block,
    # attributes) built once; a call sets its stream (plans launch under their lock).
    extended: object = None


def graphs_available() -> bool:
    """Whether plans made now replay their launches as CUDA graphs (the "cupy" launch path
    has no graphs)."""
    return GRAPHS and METHOD != "cupy" and _graph_api is not None


def kernel_launch(config, device_id: int, grid, cooperative: bool = False,
                  programmatic: bool = False, cluster: int = 1) -> Launch:
    """The Launch of `config`'s kernel on `grid` (compiled here if need be). `programmatic`:
    launched with programmatic stream serialisation, for a kernel that waits for the previous
    one itself (dependent_launch.cuh) on a device where `programmatic_available`. `cluster`:
    CTAs a thread-block cluster along x (where `extended_available`; see `cluster_fits`)."""
    function = _compile.get_kernel(config, device_id)
    handle = function.kernel.ptr
    if METHOD == "bindings":
        handle = _bindings.CUfunction(handle)
    grid = tuple(int(g) for g in grid)
    extended = None
    if programmatic or cluster > 1:
        extended = _extended_config(grid, config.threads, config.smem_bytes, cooperative,
                                    programmatic, cluster)
    return Launch(function, handle, grid, config.threads, config.smem_bytes, cooperative,
                  config, programmatic, cluster, extended)


def extended_available() -> bool:
    """Whether launches with attributes (cuLaunchKernelEx) go through here."""
    return METHOD == "bindings" or (METHOD == "libcuda" and _libcuda_extended is not None)


def programmatic_available(arch: int) -> bool:
    """Whether kernels on a device of compute capability `arch` (e.g. 90) get programmatic
    launches here."""
    return PROGRAMMATIC and arch >= PROGRAMMATIC_MIN_ARCH and extended_available()


def cluster_fits(config, device_id: int, cluster: int, clusters: int = 1) -> bool:
    """Whether `clusters` clusters of `cluster` CTAs of `config`'s kernel can be resident on the
    device at once (the driver's cluster occupancy); allows non-portable sizes on the kernel
    where needed."""
    key = (config, device_id, cluster)
    most = _cluster_fits_cache.get(key)
    if most is None:
        most = _cluster_fits_cache[key] = _max_active_clusters(config, device_id, cluster)
    return clusters <= most


_cluster_fits_cache: dict = {}


def _max_active_clusters(config, device_id: int, cluster: int) -> int:
    if not extended_available():
        return 0
    function = _compile.get_kernel(config, device_id)
    handle = function.kernel.ptr
    probe = _extended_config((cluster, 1, 1), config.threads, config.smem_bytes, False, False,
                             cluster)
    if METHOD == "bindings":
        if cluster > PORTABLE_CLUSTER_SIZE:
            (err,) = _bindings.cuFuncSetAttribute(
                _bindings.CUfunction(handle), _bindings.CUfunction_attribute(
                    _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED), 1)
            if int(err) != _CUDA_SUCCESS:
                return 0
        err, count = _bindings.cuOccupancyMaxActiveClusters(_bindings.CUfunction(handle), probe)
        return int(count) if int(err) == _CUDA_SUCCESS else 0
    if cluster > PORTABLE_CLUSTER_SIZE and _libcuda_functions["set_attribute"](
            handle, _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1) != _CUDA_SUCCESS:
        return 0
    count = ctypes.c_int(0)
    err = _libcuda_functions["max_clusters"](ctypes.byref(count), handle, ctypes.byref(probe))
    return count.value if err == _CUDA_SUCCESS else 0


def _extended_config(grid, threads: int, smem_bytes: int, cooperative: bool,
                     programmatic: bool = True, cluster: int = 1):
    """cuLaunchKernelEx's launch config: programmatic, cooperative and clustered (`cluster`
    CTAs along x) as asked."""
    values = {}
    if programmatic:
        values[_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION] = 1
    if cooperative:
        values[_ATTRIBUTE_COOPERATIVE] = 1
    if cluster > 1:
        values[_ATTRIBUTE_CLUSTER_DIMENSION] = cluster
    if METHOD == "bindings":
        config = _bindings.CUlaunchConfig()
        attributes = []
        for attribute_id, value in values.items():
            attribute = _bindings.CUlaunchAttribute()
            attribute.id = _bindings.CUlaunchAttributeID(attribute_id)
            if attribute_id == _ATTRIBUTE_COOPERATIVE:
                attribute.value.cooperative = 1
            elif attribute_id == _ATTRIBUTE_CLUSTER_DIMENSION:
                attribute.value.clusterDim.x = value
                attribute.value.clusterDim.y = 1
                attribute.value.clusterDim.z = 1
            else:
                attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        config.attrs = attributes
    else:
        config = _LaunchConfig()
        attributes = (_LaunchAttribute * max(1, len(values)))()
        for attribute, (attribute_id, value) in zip(attributes, values.items()):
            attribute.id = attribute_id
            attribute.value[0] = value
            if attribute_id == _ATTRIBUTE_CLUSTER_DIMENSION:
                attribute.value[1] = attribute.value[2] = 1
        config.attrs = attributes
        config._keep = attributes  # the array the pointer points into lives with the config
    config.numAttrs = len(values)
    config.gridDimX, config.gridDimY, config.gridDimZ = grid[0], grid[1], min(grid[2], MAX_GRID_Z)
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem_bytes
    return config


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
    if launch.extended is not None:
        params = block.kernel_params_address
        err = _launch_extended(launch.extended, launch.handle, params, stream_ptr, gz)
        if err == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread without a current context (see below); CuPy's launch cannot set the
            # attributes, so the runtime makes the device's context current and the launch is
            # repeated.
            import cupy

            cupy.cuda.runtime.free(0)
            err = _launch_extended(launch.extended, launch.handle, params, stream_ptr, gz)
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"launching {launch.function.name} failed: CUresult {err}")
        return
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


def _launch_extended(config, handle, kernel_params_address: int, stream_ptr: int,
                     gz: int) -> int:
    """cuLaunchKernelEx with the prebuilt `config` (`handle`: the function as the launch path
    takes it); gridDim.z set per slice."""
    if config.gridDimZ != gz:
        config.gridDimZ = gz
    config.hStream = stream_ptr
    if METHOD == "bindings":
        (err,) = _bindings.cuLaunchKernelEx(config, handle, kernel_params_address, 0)
        return int(err)
    return _libcuda_extended(ctypes.byref(config), handle, kernel_params_address, None)


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


def launch_with_arguments(function, grid, threads: int, arguments, stream_ptr: int,
                          programmatic: bool) -> None:
    """Launches a CuPy RawKernel with ordinary arguments, `arguments` as (ctypes type, value)
    pairs, programmatically where `programmatic` (the caller checked programmatic_available):
    the stand-in model kernels of the benchmark and the tests (cuda_src/next_layer_inputs.cu)."""
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if not extended_available():
        import numpy  # CuPy's launch, on its current stream, with sized scalars

        sized = {ctypes.c_int: numpy.int32, ctypes.c_uint64: numpy.uint64,
                 ctypes.c_void_p: numpy.uint64}
        function(grid, (threads,), tuple(sized[t](v) for t, v in arguments))
        return
    values = [ctype(value) for ctype, value in arguments]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    handle = function.kernel.ptr
    if METHOD == "bindings":
        handle = _bindings.CUfunction(handle)
    err = _launch_extended(_extended_config(grid, threads, 0, False, programmatic), handle,
                           ctypes.addressof(pointers), stream_ptr, grid[2])
    if err != _CUDA_SUCCESS:
        raise RuntimeError(f"launching {function.name} failed: CUresult {err}")


#: CuPy's CUDA runtime module once a plan needed it (its Cython functions cost the host less
#: than a ctypes call: the capture check and the graph launch of every call).
_cuda_runtime = None


def cuda_runtime():
    """cupy_backends' runtime module (imported on first use: cuflash2 imports without CuPy)."""
    global _cuda_runtime
    if _cuda_runtime is None:
        from cupy_backends.cuda.api import runtime

        _cuda_runtime = runtime
    return _cuda_runtime


def stream_not_capturing(stream_ptr: int) -> bool:
    """Whether the stream is not being captured into a CUDA graph; False too where the runtime
    cannot say (the legacy stream while another stream captures in global mode) and for a
    capture an error invalidated (CuPy raises for both)."""
    try:
        return not (_cuda_runtime or cuda_runtime()).streamIsCapturing(stream_ptr)
    except RuntimeError:
        return False


#: cuda.h's CUlaunchAttributeValue: a 64-byte union.
_AttributeValue = ctypes.c_uint * 16


class LaunchGraphs:
    """A plan's launches as one CUDA graph (a chain of kernel nodes, each with its kernel's
    cooperative and cluster attributes), instantiated once per stream: launches of one
    executable graph run one after the other whatever their streams, so calls on different
    streams keep their own. A call sets every node's parameters again where the struct's bytes
    differ from those last set (the driver copies the struct then, as at a kernel launch;
    launches already queued keep theirs) and launches the graph on the stream. Programmatic
    launches have no counterpart in a graph launch, which starts after the previous work of
    its stream."""

    #: Executable graphs kept per plan; dropped all at once beyond (a queued launch of a
    #: destroyed graph still runs: the driver frees it after).
    MAX_STREAMS = 16

    def __init__(self, launches, blocks, struct):
        self.nodes = tuple((launch, block.kernel_params_address)
                           for launch, block in zip(launches, blocks))
        self.struct = struct  # the bytes every node's parameters point into
        self.by_stream: dict = {}

    @staticmethod
    def covers(launches) -> bool:
        """Whether `launches` can be one graph: each a single launch (no batch slices)."""
        return bool(launches) and all(launch.grid[2] <= MAX_GRID_Z for launch in launches)

    def executable(self, stream_ptr: int):
        """The executable graph of a stream that is not being captured (the caller checks;
        instantiated on first use); None where the caller launches the kernels instead: a
        thread without a current context (whose first launch through CuPy makes one current)."""
        graph = self.by_stream.get(stream_ptr)
        if graph is None:
            graph = self._instantiate()
            if graph is None:
                return None
            if len(self.by_stream) >= self.MAX_STREAMS:
                self.by_stream.clear()
            self.by_stream[stream_ptr] = graph
        return graph

    def _instantiate(self):
        api = _graph_api
        graph = ctypes.c_void_p()
        if api.create(ctypes.byref(graph), 0) != _CUDA_SUCCESS:
            return None
        try:
            calls, previous = [], None
            for launch, params_address in self.nodes:
                gx, gy, gz = launch.grid
                params = _KernelNodeParams(int(launch.function.kernel.ptr), gx, gy, gz,
                                           launch.threads, 1, 1, launch.smem_bytes,
                                           params_address, None, None, None)
                node = ctypes.c_void_p()
                dependencies = None if previous is None else (ctypes.c_void_p * 1)(previous)
                err = api.add_kernel_node(ctypes.byref(node), graph, dependencies,
                                          0 if previous is None else 1, ctypes.byref(params))
                if err == _CUDA_ERROR_INVALID_CONTEXT:
                    api.destroy(graph)
                    return None
                if err != _CUDA_SUCCESS:
                    raise RuntimeError(f"adding {launch.function.name} to a graph failed: "
                                       f"CUresult {err}")
                for attribute_id, value in _node_attributes(launch):
                    err = api.set_attribute(node, attribute_id, ctypes.byref(value))
                    if err != _CUDA_SUCCESS:
                        raise RuntimeError(f"setting attribute {attribute_id} of a graph node "
                                           f"failed: CUresult {err}")
                calls.append((node.value, params))
                previous = node.value
            executable = ctypes.c_void_p()
            err = api.instantiate(ctypes.byref(executable), graph, 0)
            if err != _CUDA_SUCCESS:
                raise RuntimeError(f"instantiating a plan's graph failed: CUresult {err}")
        except BaseException:
            api.destroy(graph)
            raise
        return _Executable(graph.value, executable.value,
                           tuple((node, ctypes.addressof(params)) for node, params in calls),
                           tuple(params for _, params in calls), self.struct)


class _Executable:
    """One instantiated graph: the graph it was made from (whose node handles setting a
    node's parameters takes, so it lives as long), its handle, (node, parameters address) a
    node, the parameter structs those addresses point into, and the kernel parameter struct
    (`struct`, numpy bytes) with the bytes it held when the nodes' parameters were last set."""

    def __init__(self, graph: int, executable: int, calls: tuple, keep: tuple, struct):
        self.graph, self.executable, self.calls, self._keep = graph, executable, calls, keep
        self.struct, self.set_from = struct, None

    def launch(self, stream_ptr: int) -> None:
        """Sets every node's parameters again where the struct changed since they were last
        set (the driver copies it then; a call on the arrays of the one before, or on memory
        the pool hands out again, changes nothing and saves 0.4-1.3 us a node) and launches
        the graph on the stream."""
        api = _graph_api
        current = self.struct.tobytes()
        if current != self.set_from:
            executable, set_params = self.executable, api.set_params
            self.set_from = None  # until every node has it
            for node, params in self.calls:
                err = set_params(executable, node, params)
                if err != _CUDA_SUCCESS:
                    raise RuntimeError(
                        f"setting a graph node's parameters failed: CUresult {err}")
            self.set_from = current
        (_cuda_runtime or cuda_runtime()).graphLaunch(self.executable, stream_ptr)

    def __del__(self):
        api = _graph_api
        if api is not None:
            try:
                api.destroy_exec(self.executable)
                api.destroy(self.graph)
            except Exception:  # interpreter shutdown
                pass


def _node_attributes(launch: Launch):
    """The graph node attributes of `launch`: cooperative, thread-block cluster."""
    attributes = []
    if launch.cooperative:
        value = _AttributeValue()
        value[0] = 1
        attributes.append((_ATTRIBUTE_COOPERATIVE, value))
    if launch.cluster > 1:
        value = _AttributeValue()
        value[0], value[1], value[2] = launch.cluster, 1, 1
        attributes.append((_ATTRIBUTE_CLUSTER_DIMENSION, value))
    return attributes
