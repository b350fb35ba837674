"""Plans: a call signature checked and worked out once, then launched cheaply.

A call's signature is, for every array, its shape, strides, dtype and device, and the other
arguments with their types (`signature_key`). The first call of a signature is checked in full
(`_prepare`, `_validate`) and its launches are worked out into a `Plan`: the kernel parameter
struct with every size, stride and scale filled in, the compiled kernels and their grids, and the
outputs and workspace to allocate. A later call of the same signature only reads its arrays'
addresses, checks their 16-byte alignment, allocates, patches the pointers into the struct and
launches; the current device is part of the key and every array's device is part of its
signature, so those checks hold by construction.
"""

from __future__ import annotations

import threading

import numpy

from . import _launch, _params

#: Plans kept per entry point; the cache is emptied when it fills (a workload has few shapes).
MAX_PLANS = 256
#: Outputs and workspace carved out of one allocation start at multiples of this.
_ALLOCATION_ALIGNMENT = 256


class NoSignature(Exception):
    """The call has no cacheable signature (a non-CuPy argument, an unhashable value): it is
    checked in full, which reports what is wrong."""


def array_signature(x, ndarray) -> tuple:
    if type(x) is not ndarray:
        raise NoSignature
    return (x.shape, x.strides, x.dtype, x.data.device_id)


def optional_signature(x, ndarray):
    return None if x is None else array_signature(x, ndarray)


def window_key(window_size) -> tuple:
    if not isinstance(window_size, (tuple, list)):
        raise NoSignature
    return tuple((type(w), w) for w in window_size)


def value_key(value) -> tuple:
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


class Plan:
    """The launches of one call signature and what each call fills in.

    inputs: (struct field, position of the array in the call's input tuple, byte offset from
    that array's start): packed arrays feed several fields. outputs: (shape, dtype) of the arrays
    a call returns, allocated together; output_fields: (field, output index, byte offset).
    workspace_fields: (field, byte offset) into scratch memory of `workspace_bytes` that lives
    for the call only (kernels on one stream run in order, and CuPy's pool reuses memory in
    stream order). aligned: (input position, name) of the arrays read in 16-byte chunks."""

    def __init__(self, device_id: int, struct: str, fields: dict, launches, inputs=(),
                 outputs=(), output_fields=(), workspace_bytes: int = 0, workspace_fields=(),
                 aligned=(), per_call=()):
        self.device_id = device_id
        self.block = _params.ParamBlock(struct, fields)
        self.launches = tuple(launches)
        self.batch_offset_slot = self.block.slot("batch_offset")
        self.input_slots = tuple((*self.block.slot(f), pos, off) for f, pos, off in inputs)
        self.outputs = tuple((tuple(shape), numpy.dtype(dtype)) for shape, dtype in outputs)
        self.output_offsets, self.output_bytes = _carve(
            [numpy.dtype(dtype).itemsize * _size(shape) for shape, dtype in outputs])
        self.output_slots = tuple((*self.block.slot(f), i, off) for f, i, off in output_fields)
        self.workspace_bytes = workspace_bytes
        self.workspace_slots = tuple((*self.block.slot(f), off) for f, off in workspace_fields)
        self.aligned = tuple(aligned)
        # Per-call scalars (dropout seeds, a decode step's cache length): field -> slot.
        self.per_call = {f: self.block.slot(f) for f in per_call}
        self.lock = threading.Lock()

    def run(self, inputs: tuple, cupy, scalars: dict | None = None, wrap: int | None = None):
        """Checks the inputs' alignment, allocates the outputs, fills in the struct, launches.
        Returns the first `wrap` outputs (all by default) as arrays; the others are written in
        the same allocation, which lives as long as the returned arrays (or, with none, until
        the launches have run: CuPy's pool reuses memory in stream order)."""
        if cupy is None:
            from ._prepare import cupy_module

            cupy = cupy_module()
        ptrs = [0 if x is None else x.data.ptr for x in inputs]
        for pos, name in self.aligned:
            if ptrs[pos] & 15 and inputs[pos].size:
                from ._prepare import check_aligned

                check_aligned(name, inputs[pos])
        outputs, out_ptrs = self._allocate(cupy, len(self.outputs) if wrap is None else wrap)
        if not self.launches:
            return outputs
        workspace = cupy.cuda.alloc(self.workspace_bytes) if self.workspace_bytes else None
        stream = cupy.cuda.get_current_stream().ptr
        with self.lock:
            for view, index, pos, off in self.input_slots:
                view[index] = ptrs[pos] + off if ptrs[pos] else 0
            for view, index, i, off in self.output_slots:
                view[index] = out_ptrs[i] + off
            if workspace is not None:
                base = workspace.ptr
                for view, index, off in self.workspace_slots:
                    view[index] = base + off
            if scalars:
                for field, value in scalars.items():
                    view, index = self.per_call[field]
                    view[index] = value
            for launch in self.launches:
                _launch.run(launch, self.block, stream, self.batch_offset_slot)
        return outputs

    def _allocate(self, cupy, wrap: int):
        if not self.outputs:
            return [], []
        if not self.output_bytes:
            arrays = [cupy.empty(shape, dtype=dtype) for shape, dtype in self.outputs[:wrap]]
            return arrays, [0] * len(self.outputs)
        memory = cupy.cuda.alloc(self.output_bytes)
        base = memory.ptr
        arrays = [cupy.ndarray(shape, dtype, memory + offset if offset else memory)
                  for (shape, dtype), offset in zip(self.outputs[:wrap], self.output_offsets)]
        return arrays, [base + offset for offset in self.output_offsets]


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _carve(sizes) -> tuple[list, int]:
    """Offsets of consecutive pieces of `sizes` bytes in one allocation, and its size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALLOCATION_ALIGNMENT) * _ALLOCATION_ALIGNMENT
    return offsets, total


def carve(sizes) -> tuple[list, int]:
    return _carve(sizes)
