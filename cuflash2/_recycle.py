"""Output arrays that nothing references any more, handed out again by the next call.

From Python, making a call's output costs about as much as launching its kernels: on an H200
an allocation from CuPy's pool and a `cupy.ndarray` over it take ~2 us of a ~12 us decoding
call, and three of them ~4 us of the backward's (docs/PERF_NOTES.md, "Host cost of a call").
A plan therefore keeps the last few outputs of its calls on each stream, and a call whose
earlier output nobody holds any more writes into that output again and returns the same array
object.

"Nobody holds it" is read from reference counts: the array, its MemoryPointer (`.data`) and the
memory under it (`.data.mem`) each have only the references this module keeps, no weak
reference exists, and the shape is still the one the plan made (`a.shape = ...` reshapes an
array in place). A view, a pointer taken from `.data`, a DLPack capsule or any container that
holds the array keeps it from being reused. What remains is what CuPy's own pool allows: memory
freed by Python while another stream still reads it, or an address kept only as an integer, is
handed out again by the pool as well. Outputs are reused only on the stream they were made on
(launches on a stream run in order, as the pool's per-stream arenas assume) and never while
the stream is being captured into a CUDA graph (a captured kernel writes its output at every
replay). Small outputs only: a large call's host cost hides behind its GPU time, and a kept
output holds its memory until it is reused or its plan is dropped.

CUFLASH2_RECYCLE=0 turns it off (every call allocates, as CuPy code does); so does a Python
without a global interpreter lock, where reference counts are not read this simply.
"""

from __future__ import annotations

import functools
import sys
import weakref

from . import _launch

#: Outputs of at most this many bytes a call are kept for reuse.
MAX_BYTES = 1 << 20
#: Outputs kept per (plan, stream, number of returned arrays): two let a loop that rebinds its
#: result (`out = attention(...)`, the old `out` alive during the call) reuse every other one.
SLOTS = 2
#: (stream, number of returned arrays) pairs a plan keeps outputs for; all are dropped beyond
#: (a program that makes a stream a step must not pile up outputs).
MAX_KEYS = 16


def _wanted() -> bool:
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return _launch.switch("CUFLASH2_RECYCLE") and gil


#: Plans made now keep outputs for reuse.
ENABLED = _wanted()


class Kept:
    """A call's outputs (arrays carved from one allocation at `address`), kept for reuse."""

    __slots__ = ("arrays", "entries", "memory", "address", "idle_counts")

    def __init__(self, arrays, address: int, idle_counts=None):
        self.arrays = tuple(arrays)
        # (array, its MemoryPointer, its shape): what idle() reads of each output.
        self.entries = tuple((a, a.data, a.shape) for a in self.arrays)
        self.memory = self.arrays[0].data.mem
        self.address = address
        self.idle_counts = (_idle_counts(len(self.arrays)) if idle_counts is None
                            else idle_counts)

    def idle(self) -> bool:
        """Whether nothing but this record references the arrays or their memory (the
        reference counts of a record nobody else holds, `idle_counts`), no weak reference
        exists, and no shape was changed in place. The loop reads the counts as
        `reference_counts` does, so that both see the same references of their own."""
        refs = sys.getrefcount
        array_refs, pointer_refs, memory_refs = self.idle_counts
        if refs(self.memory) != memory_refs:
            return False
        for a, pointer, shape in self.entries:
            if (refs(a) != array_refs or refs(pointer) != pointer_refs or a.shape != shape
                    or weakref.getweakrefcount(a)):
                return False
        return True

    def reference_counts(self) -> tuple:
        """(array, pointer, memory) reference counts as idle() reads them (of the last output
        for the first two: a record's outputs are all held alike)."""
        refs = sys.getrefcount
        array_refs = pointer_refs = None
        memory_refs = refs(self.memory)
        for a, pointer, shape in self.entries:
            array_refs, pointer_refs = refs(a), refs(pointer)
        return array_refs, pointer_refs, memory_refs


class _Object:
    """A stand-in for an array, a MemoryPointer and a memory: one reference an attribute."""


@functools.lru_cache(maxsize=None)
def _idle_counts(n: int) -> tuple:
    """The reference counts idle() reads of a record of n outputs that nothing else
    references: measured on stand-ins held as an array holds its MemoryPointer (`.data`) and a
    MemoryPointer its memory (`.mem`), so they hold whatever this interpreter counts."""
    memory = _Object()
    arrays = []
    for _ in range(n):
        pointer = _Object()
        pointer.mem = memory
        array = _Object()
        array.data = pointer
        array.shape = ()
        arrays.append(array)
    kept = Kept(arrays, 0, idle_counts=())
    del arrays[:], array, pointer, memory
    return kept.reference_counts()


class OutputCache:
    """One plan's kept outputs, by (stream, number of returned arrays)."""

    __slots__ = ("kept",)

    def __init__(self):
        self.kept: dict = {}

    def take(self, stream: int, n: int):
        """Idle outputs of n arrays made on `stream` (as a list, and their address), or None."""
        for kept in self.kept.get((stream, n), ()):
            if kept.idle():
                return list(kept.arrays), kept.address
        return None

    def keep(self, stream: int, arrays, address: int) -> None:
        """Keeps a call's new outputs for reuse, while a slot is free."""
        key = (stream, len(arrays))
        if key not in self.kept and len(self.kept) >= MAX_KEYS:
            self.kept.clear()
        slots = self.kept.setdefault(key, [])
        if len(slots) < SLOTS:
            slots.append(Kept(arrays, address))
