"""Kernel parameter structs on the host.

The layouts are read from `cuda_src/kernel_params.cuh`, their one definition, with C's rules
(each field at the next multiple of its alignment, a struct as aligned as its widest field and
its size a multiple of that). `tests/test_params_layout.py` compiles `offsetof` and `sizeof`
probes with NVRTC to check these offsets against the compiler's.

A `ParamBlock` holds one struct's bytes: a plan fills every size, stride and scale once, then
each call patches only its pointers (and the few per-call scalars) before launching.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy

PARAMS_HEADER = "kernel_params.cuh"

#: Scalar field types: (numpy format, size = alignment in bytes).
_SCALARS = {"i64": ("<i8", 8), "int": ("<i4", 4), "float": ("<f4", 4), "u32": ("<u4", 4)}
#: Element types of fixed-size array fields (`unsigned long long v[16];`: a TensorMap's bytes).
_ARRAY_ELEMENTS = {"unsigned long long": ("<u8", 8)}
_POINTER = ("<u8", 8)

_STRUCT = re.compile(r"^struct\s+(?:__align__\((\d+)\)\s+)?(\w+)\s*\{(.*?)^\};",
                     re.MULTILINE | re.DOTALL)
_FIELD = re.compile(
    r"^(?:const\s+)?([A-Za-z_][\w ]*?)\s*(\*?)\s*([A-Za-z_]\w*)\s*(?:\[(\d+)\])?\s*;$")


@dataclass(frozen=True)
class StructLayout:
    """One struct: its numpy dtype (nested structs as sub-dtypes), alignment and the byte offset
    of every field, nested ones by dotted path ("mods.alibi_slopes")."""

    name: str
    dtype: numpy.dtype
    alignment: int
    offsets: dict  # dotted path -> byte offset
    pointers: frozenset  # dotted paths of the pointer fields

    @property
    def size(self) -> int:
        return self.dtype.itemsize


def parse_layouts(text: str) -> dict[str, StructLayout]:
    """Every struct of a kernel_params.cuh text, in order of definition."""
    layouts: dict[str, StructLayout] = {}
    for match in _STRUCT.finditer(text):
        declared_alignment, name, body = match.groups()
        names, formats, offsets = [], [], []
        flat, pointers = {}, set()
        offset, alignment = 0, int(declared_alignment or 1)
        for raw in body.splitlines():
            line = raw.split("//", 1)[0].strip()
            if not line:
                continue
            field = _FIELD.match(line)
            if field is None:
                raise ValueError(f"{PARAMS_HEADER}: struct {name}: cannot read the field "
                                 f"{line!r} (one `type name;` a line)")
            ctype, star, fname, length = field.groups()
            if length is not None:
                if star or ctype not in _ARRAY_ELEMENTS:
                    raise ValueError(f"{PARAMS_HEADER}: struct {name}: arrays of {ctype!r}{star} "
                                     "are not supported")
                element, field_align = _ARRAY_ELEMENTS[ctype]
                fmt = numpy.dtype((element, (int(length),)))
            elif star:
                fmt, size_align = _POINTER
                field_align = size_align
                pointers.add(fname)
            elif ctype in _SCALARS:
                fmt, field_align = _SCALARS[ctype]
            elif ctype in layouts:
                inner = layouts[ctype]
                fmt, field_align = inner.dtype, inner.alignment
                pointers.update(f"{fname}.{p}" for p in inner.pointers)
            else:
                raise ValueError(f"{PARAMS_HEADER}: struct {name}: unknown type {ctype!r}")
            offset = -(-offset // field_align) * field_align
            names.append(fname)
            formats.append(fmt)
            offsets.append(offset)
            flat[fname] = offset
            if ctype in layouts:
                for path, inner_offset in layouts[ctype].offsets.items():
                    flat[f"{fname}.{path}"] = offset + inner_offset
            offset += numpy.dtype(fmt).itemsize
            alignment = max(alignment, field_align)
        size = -(-offset // alignment) * alignment
        dtype = numpy.dtype({"names": names, "formats": formats, "offsets": offsets,
                             "itemsize": size})
        layouts[name] = StructLayout(name, dtype, alignment, flat, frozenset(pointers))
    return layouts


@lru_cache(maxsize=None)
def layouts() -> dict[str, StructLayout]:
    from ._compile import cuda_src_dir

    return parse_layouts((cuda_src_dir() / PARAMS_HEADER).read_text())


def layout(struct: str) -> StructLayout:
    return layouts()[struct]


class ParamBlock:
    """The bytes of one kernel parameter struct, and the kernelParams array that points at them
    (the driver copies the struct at launch, so a block can be patched again right after).

    `set(path, value)` writes a field by its dotted path (plan time); `slot(path)` gives a
    (word array, index) pair for the per-call writes, which are plain numpy item stores."""

    def __init__(self, struct: str, values: dict | None = None):
        self.layout = layout(struct)
        self.bytes = numpy.zeros(self.layout.size, dtype=numpy.uint8)
        self.record = self.bytes.view(self.layout.dtype)  # one element
        self.words64 = self.bytes.view(numpy.uint64)
        self.words32 = self.bytes.view(numpy.int32)
        self.words32u = self.bytes.view(numpy.uint32)
        self.words32f = self.bytes.view(numpy.float32)
        # cuLaunchKernel's kernelParams: one pointer, to the struct (the kernel's one parameter).
        self.kernel_params = numpy.array([self.bytes.ctypes.data], dtype=numpy.uint64)
        self.kernel_params_address = self.kernel_params.ctypes.data
        for path, value in (values or {}).items():
            self.set(path, value)

    def set(self, path: str, value) -> None:
        target = self.record
        *outer, last = path.split(".")
        for part in outer:
            target = target[part]
        target[last] = 0 if value is None else value

    def slot(self, path: str) -> tuple[numpy.ndarray, int]:
        """(word view, index) of field `path` (of an array field: its first element), for a
        fast `view[index] = value`."""
        offset = self.layout.offsets[path]
        base = path.rsplit(".", 1)[-1]
        fmt = self.record.dtype
        for part in path.split(".")[:-1]:
            fmt = fmt.fields[part][0]
        kind = fmt.fields[base][0]
        if kind.subdtype is not None:  # an array field: its first element
            kind = kind.subdtype[0]
        if kind.itemsize == 8:
            return self.words64, offset // 8  # pointers and i64 (non-negative values)
        view = {"i": self.words32, "u": self.words32u, "f": self.words32f}[kind.kind]
        return view, offset // 4

    def as_void(self):
        """The struct as a numpy.void (CuPy's launch path passes it by value)."""
        return self.record[0]

    def nested(self, path: str) -> "NestedBlock":
        """The struct field `path` (a nested struct) as a block of its own for launching: a
        kernel that takes that struct is launched from the same bytes, so whatever a plan
        patches into this block reaches it too (BwdSm90Params.base, a BwdParams, is what the
        backward's preprocess and dQ conversion take beside the Hopper main kernel)."""
        return NestedBlock(self, path)


class NestedBlock:
    """A nested struct of a ParamBlock, over the same bytes: what _launch.run reads of a block
    (kernel_params_address, as_void) for a kernel that takes the nested struct."""

    def __init__(self, parent: ParamBlock, path: str):
        fmt = parent.record.dtype
        for part in path.split("."):
            fmt = fmt.fields[part][0]
        if fmt.names is None:
            raise ValueError(f"{parent.layout.name}.{path} is not a struct")
        offset = parent.layout.offsets[path]
        self.parent, self.path = parent, path
        self.bytes = parent.bytes[offset:offset + fmt.itemsize]
        self.record = self.bytes.view(fmt)
        self.kernel_params = numpy.array([self.bytes.ctypes.data], dtype=numpy.uint64)
        self.kernel_params_address = self.kernel_params.ctypes.data

    def as_void(self):
        return self.record[0]
