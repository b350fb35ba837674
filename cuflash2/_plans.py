"""Plans: a call signature checked and worked out once, then launched cheaply.

A call's signature is, for every array, its shape, strides, dtype and device, the current
device, and the other arguments with their types (the entry points build it: api._forward_key,
_kvcache._key). The first call of a signature is checked in full
(`_prepare`, `_validate`) and its launches are worked out into a `Plan`: the kernel parameter
struct with every size, stride and scale filled in, the compiled kernels and their grids, and the
outputs and workspace to allocate. A later call of the same signature only reads its arrays'
addresses, checks their 16-byte alignment, allocates, patches the pointers into the struct and
launches; the current device is part of the key and every array's device is part of its
signature, so those checks hold by construction. Small outputs that nothing references any more
are reused by the plan's next call on their stream instead of allocated (`_recycle`).
"""

from __future__ import annotations

import threading

import numpy

from . import _launch, _params, _recycle

#: Plans kept per entry point; the cache is emptied when it fills (a workload has few shapes).
MAX_PLANS = 256
#: Pieces carved out of one allocation (outputs, workspace) start at multiples of this.
_ALLOCATION_ALIGNMENT = 256


def add_signature(key: list, ndarray, arrays, window_size=None) -> bool:
    """Appends to `key` each array's shape, strides, dtype and device (None for an absent one)
    and, unless `window_size` is None (a call without one: merge_states), the two ends of
    `window_size` with their types; False where the call has no signature (an array that is not
    a CuPy `ndarray`, a window that is not a pair: the full check then says what is wrong). The
    entry points add their other arguments (api._forward_key, _kvcache._key, _merge._key)."""
    for x in arrays:
        if x is None:
            key.append(None)
        elif type(x) is ndarray:
            key.append((x.shape, x.strides, x.dtype, x.data.device_id))
        else:
            return False
    if window_size is None:
        return True
    try:
        left, right = window_size
    except (TypeError, ValueError):
        return False
    key += (type(left), left, type(right), right)
    return True


def value_key(value) -> tuple:
    """A scalar argument in a signature key: with its type, so that 1 and True differ."""
    return (type(value), value)


class PlanCache:
    """Plans by signature key for one entry point."""

    def __init__(self):
        self.plans: dict = {}

    def get(self, key):
        """The plan of `key`; None for a new key, for None, and for an unhashable key (a call
        with an unhashable argument is checked in full every time)."""
        if key is None:
            return None
        try:
            return self.plans.get(key)
        except TypeError:
            return None

    def put(self, key, plan) -> None:
        if key is None:
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        try:
            self.plans[key] = plan
        except TypeError:
            pass

    def __len__(self) -> int:
        return len(self.plans)


#: Scratch of at most this many bytes (workspace, outputs a call does not return) comes from a
#: buffer kept per device and stream rather than from an allocation per call: small calls,
#: where the host cost shows, save an allocation; large ones free their scratch on return.
SCRATCH_MAX_BYTES = 8 << 20


class _StreamScratch:
    """Scratch buffers by (device, stream), grown on demand. Launches on one stream run in
    order, so calls on a stream can share one buffer. Outgrown buffers are kept, not freed:
    work queued on the stream (or captured in a graph) may still use them."""

    def __init__(self):
        self.buffers: dict = {}
        self.outgrown: list = []

    def get(self, nbytes: int, device_id: int, stream_ptr: int, cupy) -> int:
        key = (device_id, stream_ptr)
        memory = self.buffers.get(key)
        if memory is None or memory.mem.size < nbytes:
            if memory is not None:
                self.outgrown.append(memory)
            memory = self.buffers[key] = cupy.cuda.alloc(
                max(nbytes, 2 * memory.mem.size if memory is not None else 1 << 16))
        return memory.ptr


_scratch = _StreamScratch()


class StreamCounters:
    """int32 counters that kernels keep between launches, one buffer per (device, stream):
    launches on one stream run one after the other and may share them, launches on different
    streams could run at once and get their own. A buffer starts zeroed with at least `minimum`
    counters and is replaced by a larger zeroed one when a call needs more (the outgrown one is
    kept: work queued on the stream, or captured in a graph, may still use it)."""

    def __init__(self, minimum: int):
        self.minimum = minimum
        self.buffers: dict = {}
        self.outgrown: list = []

    def get(self, device_id: int, stream_ptr: int, cupy, count: int = 0) -> int:
        """The address of the stream's buffer, with at least `count` counters."""
        key = (device_id, stream_ptr)
        counters = self.buffers.get(key)
        if counters is None or counters.size < count:
            if counters is not None:
                self.outgrown.append(counters)
            counters = self.buffers[key] = cupy.zeros(max(count, self.minimum),
                                                      dtype=cupy.int32)
        return counters.data.ptr


#: The persistent Hopper forward's claimed tiles (flash_fwd_sm90.cu, WorkTileClaims): a ticket
#: and a count of finished CTAs, which the launch's last CTA puts back to zero.
stream_counters = StreamCounters(2)


class Plan:
    """The launches of one call signature and what each call fills in.

    inputs: (struct field, position of the array in the call's input tuple, byte offset from
    that array's start) for the arrays the signature has (absent ones leave their field null):
    packed arrays feed several fields. outputs: (shape, dtype) of the arrays
    a call returns, allocated together; output_fields: (field, output index, byte offset).
    workspace_fields: (field, byte offset) into scratch memory of `workspace_bytes` that lives
    for the call only (kernels on one stream run in order). aligned: (input position, name) of
    the arrays read in 16-byte chunks. per_call: fields set from each call's `scalars`.
    batch_offset: the field that tells a slice of a launch split along gridDim.z its first
    sequence (_launch.run). launch_structs: for each launch, the nested struct of `struct` its
    kernel takes ("" or None: the whole struct; "base": the BwdParams of BwdSm90Params, which
    the backward's preprocess and dQ conversion take beside the Hopper main kernel).
    counters: fields set to the call's stream's `stream_counters`."""

    def __init__(self, device_id: int, struct: str, fields: dict, launches, inputs=(),
                 outputs=(), output_fields=(), workspace_bytes: int = 0, workspace_fields=(),
                 aligned=(), per_call=(), batch_offset: str = "batch_offset",
                 launch_structs=(), counters=()):
        self.device_id = device_id
        self.block = _params.ParamBlock(struct, fields)
        self.launches = tuple(launches)
        structs = tuple(launch_structs) or (None,) * len(self.launches)
        if len(structs) != len(self.launches):
            raise ValueError("launch_structs needs one entry a launch")
        nested = {path: self.block.nested(path) for path in set(structs) if path}
        self.launch_blocks = tuple(nested[path] if path else self.block for path in structs)
        self.batch_offset_slot = self.block.slot(batch_offset)
        self.input_slots = tuple((*self.block.slot(f), pos, off) for f, pos, off in inputs)
        self.outputs = tuple((tuple(shape), numpy.dtype(dtype)) for shape, dtype in outputs)
        # Output i starts at offsets[i]; the first n outputs fill the first prefix[n] bytes.
        self.output_offsets, output_bytes = carve(
            [dtype.itemsize * _size(shape) for shape, dtype in self.outputs])
        self.output_prefix = self.output_offsets + [output_bytes]
        self.output_count = len(self.outputs)
        # (view, index, output, byte offset from the allocation's start)
        self.output_slots = tuple((*self.block.slot(f), i, self.output_offsets[i] + off)
                                  for f, i, off in output_fields)
        self.workspace_bytes = workspace_bytes
        self.workspace_slots = tuple((*self.block.slot(f), off) for f, off in workspace_fields)
        # Scratch bytes of a call returning its first n outputs: workspace, then the others.
        self.scratch_bytes = [workspace_bytes + output_bytes - self.output_prefix[n]
                              for n in range(self.output_count + 1)]
        # (input position, its name where it is read in 16-byte chunks, its struct slots)
        slots_by_position: dict = {}
        for view, index, pos, off in self.input_slots:
            slots_by_position.setdefault(pos, []).append((view, index, off))
        aligned_names = dict(aligned)
        self.input_reads = tuple(
            (pos, aligned_names.get(pos), tuple(slots_by_position.get(pos, ())))
            for pos in dict.fromkeys([*slots_by_position, *aligned_names]))
        # A per-call field by its own name, or (name in `scalars`, field) where they differ.
        self.per_call = {(f if isinstance(f, str) else f[0]):
                         self.block.slot(f if isinstance(f, str) else f[1]) for f in per_call}
        self.counter_slots = tuple(self.block.slot(f) for f in counters)
        # The launches as one CUDA graph a stream, where the driver path allows it.
        self.graphs = (_launch.LaunchGraphs(self.launches, self.launch_blocks,
                                             self.block.bytes)
                       if _launch.graphs_available() and _launch.LaunchGraphs.covers(
                           self.launches) else None)
        # Outputs of earlier calls that nothing references any more, reused (_recycle); for
        # each count of returned outputs, whether they are small enough to be kept.
        self.recycled = _recycle.OutputCache() if _recycle.ENABLED else None
        self.recyclable = [0 < nbytes <= _recycle.MAX_BYTES for nbytes in self.output_prefix]
        self.lock = threading.Lock()

    def run(self, inputs: tuple, cupy, scalars: dict | None = None, wrap: int | None = None,
            stream: int | None = None):
        """Checks the inputs' alignment, allocates, fills in the struct, launches. Returns the
        first `wrap` outputs (all by default) as arrays; the others, which the call does not
        return, are written to scratch memory with the workspace."""
        if cupy is None:
            from ._prepare import cupy_module

            cupy = cupy_module()
        n = self.output_count if wrap is None else wrap
        if not self.launches:
            self._read_inputs(inputs)
            return self._allocate(cupy, n)[0]
        if stream is None:
            stream = cupy.cuda.get_current_stream().ptr
        # Scratch: the workspace, then the outputs not returned.
        scratch_bytes = self.scratch_bytes[n]
        memory = None
        if not scratch_bytes:
            scratch = 0
        elif scratch_bytes <= SCRATCH_MAX_BYTES:
            scratch = _scratch.get(scratch_bytes, self.device_id, stream, cupy)
        else:
            memory = cupy.cuda.alloc(scratch_bytes)  # freed on return, in stream order
            scratch = memory.ptr
        with self.lock:
            self._read_inputs(inputs)
            # A stream being captured gets the kernels launched one by one (the capture
            # records them) and new outputs (a captured kernel writes them at every replay).
            not_capturing = _launch.stream_not_capturing(stream)
            graph = (self.graphs.executable(stream)
                     if not_capturing and self.graphs is not None else None)
            reused = None
            if not_capturing and self.recycled is not None and self.recyclable[n]:
                reused = self.recycled.take(stream, n)
                if reused is None:
                    reused = self._allocate(cupy, n)
                    self.recycled.keep(stream, *reused)
            outputs, chunk = reused or self._allocate(cupy, n)
            unreturned = scratch + self.workspace_bytes - self.output_prefix[n]
            for view, index, i, offset in self.output_slots:
                view[index] = (chunk if i < n else unreturned) + offset
            for view, index, off in self.workspace_slots:
                view[index] = scratch + off
            if scalars:
                for field, value in scalars.items():
                    view, index = self.per_call[field]
                    view[index] = value
            for view, index in self.counter_slots:
                view[index] = stream_counters.get(self.device_id, stream, cupy)
            if graph is not None:
                graph.launch(stream)
            else:
                for launch, block in zip(self.launches, self.launch_blocks):
                    _launch.run(launch, block, stream, self.batch_offset_slot)
        return outputs

    def _read_inputs(self, inputs: tuple) -> None:
        """Reads each input's address once: checks the 16-byte alignment of those read in
        chunks, patches it into the struct (under the lock, where there are launches)."""
        for pos, name, slots in self.input_reads:
            x = inputs[pos]
            ptr = x.data.ptr
            if ptr & 15 and name is not None and x.size:
                from ._prepare import check_aligned

                check_aligned(name, x)
            for view, index, off in slots:
                view[index] = ptr + off

    @property
    def kernels(self) -> tuple:
        """The configurations of the kernels a call launches, in order."""
        return tuple(launch.config for launch in self.launches)

    def _allocate(self, cupy, n: int):
        """The first n outputs as arrays in one allocation, and its address."""
        nbytes = self.output_prefix[n]
        if not nbytes:
            return [cupy.empty(shape, dtype=dtype) for shape, dtype in self.outputs[:n]], 0
        memory = cupy.cuda.alloc(nbytes)
        arrays = [cupy.ndarray(shape, dtype, memory + offset if offset else memory)
                  for (shape, dtype), offset in zip(self.outputs[:n], self.output_offsets)]
        return arrays, memory.ptr


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def carve(sizes) -> tuple[list, int]:
    """Offsets of consecutive pieces of `sizes` bytes in one allocation, and its size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALLOCATION_ALIGNMENT) * _ALLOCATION_ALIGNMENT
    return offsets, total
