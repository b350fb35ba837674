"""A decoding step inside a CUDA graph, as `bench --decode`'s in-graph rows (`decode`) time it.

A serving loop runs a model's decoding step as a graph: each layer's attention over its own KV
cache, then the work that turns its output into the next layer's q, k, v. `DecodeStep` captures
LAYERS such layers (one query token, one token appended, causal), each with its own cache, and
between two layers the stand-in kernel of `cuda_src/next_layer_inputs.cu`
(`launch_next_layer_inputs`), so no layer can read its q before the previous layer has written
its output. `time_step` replays it with L2 flushed before each replay; the time of a layer is the
step's over LAYERS, the stand-in kernel included. The stand-in writes only q, k and v, so the
layers' calls may pass `early_cache_reads=True` (a serving loop's case: the cache is read while
the previous kernel finishes). `CapturedGraph` is the capture itself (cuda.bindings' stream
capture), also used by the GPU tests.
"""

from __future__ import annotations

import ctypes
import functools

from .. import _compile, _launch
from .timing import time_cupy

#: Layers of a step.
LAYERS = 8


@functools.lru_cache(maxsize=None)
def next_layer_kernel(device_id: int):
    """cuda_src/next_layer_inputs.cu's kernel (compiled for the current device)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=_compile.kernel_source("next_layer_inputs.cu")).get_function(
            "next_layer_inputs")


def launch_next_layer_inputs(cupy, out, q, k, v, delay_ns: int = 0) -> None:
    """On the current stream: q, k, v of the next layer from `out` (next_layer_inputs.cu),
    launched programmatically where the device allows."""
    from .. import _prepare

    device_id = cupy.cuda.Device().id
    stream = cupy.cuda.get_current_stream().ptr
    arguments = [(ctypes.c_void_p, out.data.ptr), (ctypes.c_int, out.size),
                 (ctypes.c_void_p, q.data.ptr), (ctypes.c_int, q.size),
                 (ctypes.c_void_p, k.data.ptr), (ctypes.c_void_p, v.data.ptr),
                 (ctypes.c_int, k.size), (ctypes.c_uint64, delay_ns)]
    blocks = max(1, min(132, -(-max(q.size, k.size) // 256)))
    _launch.launch_with_arguments(next_layer_kernel(device_id), (blocks,), 256, arguments, stream,
                                  _launch.programmatic_available(_prepare.device_arch(device_id)))


class CapturedGraph:
    """What `record()` queues on `stream`, captured once (cuda.bindings' stream capture) and
    instantiated; `programmatic_edges` counts the graph's programmatic dependencies."""

    def __init__(self, cupy, stream, record):
        from cuda.bindings import driver

        self.driver, self.stream = driver, stream
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(driver.cuStreamBeginCapture(stream.ptr, mode), "cuStreamBeginCapture")
        try:
            with stream:
                record()
        finally:
            err, graph = driver.cuStreamEndCapture(stream.ptr)
        _check((err,), "cuStreamEndCapture")
        self.graph = graph
        self.programmatic_edges = _programmatic_edges(driver, graph)
        err, self.exec = driver.cuGraphInstantiate(graph, 0)
        _check((err,), "cuGraphInstantiate")

    def launch(self) -> None:
        _check(self.driver.cuGraphLaunch(self.exec, self.stream.ptr), "cuGraphLaunch")

    def __del__(self):
        try:
            self.driver.cuGraphExecDestroy(self.exec)
            self.driver.cuGraphDestroy(self.graph)
        except Exception:  # interpreter shutdown
            pass


def _check(result, what: str) -> None:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUresult {int(err)}")


def _programmatic_edges(driver, graph) -> int:
    err, _, _, _, count = driver.cuGraphGetEdges(graph, 0)
    _check((err,), "cuGraphGetEdges")
    if not count:
        return 0
    err, _, _, data, count = driver.cuGraphGetEdges(graph, count)
    _check((err,), "cuGraphGetEdges")
    programmatic = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    return sum(1 for d in data[:count] if int(d.type) == int(programmatic))


class DecodeStep:
    """LAYERS decoding layers of one model step: caches, q / k / v buffers and the step as a
    CUDA graph. `run()` replays it on its stream. `rotary_dim` > 0: each layer's call rotates
    its new key and q (rotary_cos / rotary_sin of a standard RoPE over the cache's positions,
    GPT-NeoX style; the cost of the rotary append, docs/ROTARY.md)."""

    def __init__(self, cupy, batch: int, cache_len: int, nheads: int, nheads_kv: int,
                 headdim: int = 128, dtype="float16", num_splits: int = 0,
                 early_cache_reads: bool = True, rotary_dim: int = 0):
        import cuflash2

        self.cupy = cupy
        rng = cupy.random.default_rng(cache_len + batch)
        shape = (batch, cache_len, nheads_kv, headdim)
        self.caches = [(rng.standard_normal(shape, dtype=cupy.float32).astype(dtype),
                        rng.standard_normal(shape, dtype=cupy.float32).astype(dtype))
                       for _ in range(LAYERS)]
        self.q = rng.standard_normal((batch, 1, nheads, headdim), dtype=cupy.float32).astype(dtype)
        self.k = rng.standard_normal((batch, 1, nheads_kv, headdim),
                                     dtype=cupy.float32).astype(dtype)
        self.v = rng.standard_normal(self.k.shape, dtype=cupy.float32).astype(dtype)
        self.lengths = cupy.full((batch,), cache_len - 1, dtype=cupy.int32)
        self.rotary = {}
        if rotary_dim:
            inv = 1.0 / 10000 ** (cupy.arange(0, rotary_dim, 2, dtype=cupy.float64) / rotary_dim)
            angles = cupy.arange(cache_len, dtype=cupy.float64)[:, None] * inv[None, :]
            self.rotary = dict(rotary_cos=cupy.cos(angles).astype(dtype),
                               rotary_sin=cupy.sin(angles).astype(dtype),
                               rotary_interleaved=False)
        self.num_splits = num_splits
        self.early_cache_reads = early_cache_reads
        # The arrays above are filled on the current stream, which a non-blocking stream does
        # not wait for: without this the step could read caches, q, k, v and lengths before they
        # are written (uninitialised pool memory, NaN where it held other bits).
        cupy.cuda.get_current_stream().synchronize()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.outputs = []
        self._attention = cuflash2.attention_with_kvcache
        with self.stream:
            self._record(keep=False)  # plans, scratch and pool blocks exist before the capture
        self.stream.synchronize()
        self.graph = CapturedGraph(cupy, self.stream, lambda: self._record(keep=True))

    def _record(self, keep: bool) -> list:
        """Queues the step's launches on the current stream; returns the layers' outputs."""
        outputs = []
        for k_cache, v_cache in self.caches:
            out = self._attention(self.q, k_cache, v_cache, k=self.k, v=self.v,
                                  cache_seqlens=self.lengths, causal=True,
                                  num_splits=self.num_splits,
                                  early_cache_reads=self.early_cache_reads, **self.rotary)
            launch_next_layer_inputs(self.cupy, out, self.q, self.k, self.v)
            outputs.append(out)
        if keep:
            self.outputs = outputs  # the graph writes them on every replay
        return outputs

    def run(self) -> None:
        self.graph.launch()


def time_step(cupy, step: DecodeStep, warmup: int, iters: int, backlog, flush_l2) -> float:
    """Median ms of a replayed step on its stream (timing.time_cupy), L2 flushed before each
    replay, untimed."""
    with step.stream:
        return time_cupy(cupy, step.run, warmup, iters, backlog, flush_l2)
