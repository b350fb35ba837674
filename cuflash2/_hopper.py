"""Host side of the Hopper kernels (cuda_src/flash_fwd_sm90.cu, flash_bwd_sm90.cu;
docs/HOPPER_FWD.md, docs/HOPPER_BWD.md): their TMA descriptors.

The kernels read q, k and v (the backward dout too) through TMA descriptors (CUtensorMap, 128
bytes each) that travel in their parameter structs (FwdSm90Params, BwdSm90Params). Each map
covers a whole (batch, seqlen, heads, headdim) array in place: rank 4, innermost first (head
dim, row, head, batch), with the array's own strides, so no copy is made; boxes are 64 columns
(128 bytes, the 128-byte swizzle span) by the kernel's tile rows (config.block_m for q,
config.block_n for k and v), one box per 64-column panel. What lies outside the array (rows
past seqlen, columns past the head dim: the second half of d=96's second panel) the TMA
zero-fills, and the kernel's expect-tx byte counts are those of the full boxes, zero-filled
bytes included.

A map depends on its array's shape, strides and dtype (the call signature) and on one address:
word 0 of the CUtensorMap is the array's global address, as it is for the maps this driver
encodes (checked for every map a plan builds, `encode_map`), so a plan encodes its maps once and
a later call patches the address like any other pointer of the struct.

Whether the Hopper kernels run a call, and how, is `_dispatch`'s question (which asks
`readable_map_fields` whether the TMA describes the call's arrays);
`_attention_plans.prepare_forward_sm90` runs the forward kernel on its own
(benchmarks/dev/hopper_fwd_check.py).

The backward (cuda_src/flash_bwd_sm90.cu, docs/HOPPER_BWD.md): `cuflash2.attention_backward`
(and the packed and varlen backwards) on sm_90 run the Hopper main kernel for every call
`_dispatch.hopper_backward_config` covers, `deterministic=True` included (dQ added in key-block
order); for the calls it refuses (dropout), with CUFLASH2_HOPPER_BWD=0, and for varlen calls
with CUFLASH2_HOPPER_BWD_VARLEN=0, the mma.sync backward runs. A call is three launches on the
current stream (`_attention_plans.backward_plan` builds them, for the dispatcher and for
`_attention_plans.prepare_backward_sm90` alike):

1. the existing preprocess (flash_bwd_preprocess.cu): D = rowsum(dO o O), lse in log2 units,
   both padded to whole 128-row blocks (+inf / 0), and the fp32 dQ accumulator zeroed (and in
   deterministic mode the dQ semaphores, a slot per 4 rows);
2. the Hopper main kernel: dK, dV of each 128-key block, dQ added to the accumulator (above
   d=128 a key block's columns split over two CTAs, `BwdSm90Config.num_chunks`);
3. the existing conversion (flash_bwd_convert_dq.cu): dQ = softmax_scale * accumulator.

The main kernel takes `BwdSm90Params`: four tensor maps (q and dout with boxes of block_m rows,
k and v of block_n rows; `backward_maps`), then the `BwdParams` of the mma.sync path as `base`.
The preprocess and the conversion take that `base` itself (a view of the same bytes,
`_params.ParamBlock.nested`), so one set of field values serves the three launches. The maps are
encoded once per plan and their address words patched per call, as the forward's.
"""

from __future__ import annotations

import ctypes

import numpy

#: Bytes of a TMA box's row: the span of CU_TENSOR_MAP_SWIZZLE_128B, 64 16-bit elements or 32
#: float32 (FwdSm90Traits::PANEL_COLS words, PANEL_ELEMENTS elements).
BOX_BYTES = 128
#: Largest row count of a TMA box.
MAX_BOX_ROWS = 256
#: The 64-bit word of a CUtensorMap that holds the global address (checked by `encode_map`).
ADDRESS_WORD = 0


def tensor_map_geometry(shape, strides_bytes, itemsize: int, box_rows: int):
    """(globalDim, globalStrides, boxDim) of the rank-4 map of a (batch, seqlen, heads, headdim)
    array with byte strides `strides_bytes`, in the driver's order (innermost first; strides of
    the outer three dimensions only). Raises ValueError where the TMA cannot read the array."""
    batch, seqlen, heads, dim = shape
    s_batch, s_row, s_head, s_dim = strides_bytes
    if s_dim != itemsize:
        raise ValueError("the head dim must be contiguous")
    if not 0 < box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"a TMA box has 1 to {MAX_BOX_ROWS} rows, not {box_rows}")
    extents = (seqlen, heads, batch)
    strides = []
    span = dim * itemsize  # bytes spanned by the dimensions inside the current one
    for extent, stride in zip(extents, (s_row, s_head, s_batch)):
        if extent == 1 and (stride % 16 or stride <= 0):
            # Never stepped over, so any stride describes it (an unbatched array seen as batch 1
            # through x[None] has a batch stride of 0): the span of the inner dimensions, as in
            # a packed layout, rounded up to 16 bytes.
            stride = -(-span // 16) * 16
        span = max(span, extent * abs(stride))
        if stride <= 0 or stride % 16 or stride >= 1 << 40:
            raise ValueError(f"TMA needs strides that are positive multiples of 16 bytes below "
                             f"2^40; got {strides_bytes}")
        strides.append(stride)
    dims = (dim, seqlen, heads, batch)
    if min(dims) < 1 or max(dims) > 1 << 32:
        raise ValueError(f"TMA needs every dimension in [1, 2^32]; got {shape}")
    return list(dims), strides, [BOX_BYTES // itemsize, box_rows, 1, 1]


def tensor_map_bytes(x, box_rows: int) -> bytes:
    """The 128 bytes of the CUtensorMap of the CuPy array `x` (batch, seqlen, heads, headdim),
    fp16, bf16, float32 or uint8 (e4m3 bits), 128-byte swizzle, boxes of BOX_BYTES x
    `box_rows`."""
    return tensor_map_bytes_at(x.data.ptr, x.shape, x.strides, x.dtype.name, box_rows)


def tensor_map_bytes_at(address: int, shape, strides_bytes, dtype: str, box_rows: int) -> bytes:
    """tensor_map_bytes of an array given by its address, shape, byte strides and dtype name
    (the float32 forward's scratch arrays, whose address a call patches in: the driver encodes
    the map without reading the memory)."""
    from cuda.bindings import driver

    types = driver.CUtensorMapDataType
    data_type, itemsize = {"float16": (types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
                           "bfloat16": (types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
                           "float32": (types.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
                           # e4m3 bits (the FP8 forward): bytes, the TMA copies them as they are
                           "uint8": (types.CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
                           "float8_e4m3fn": (types.CU_TENSOR_MAP_DATA_TYPE_UINT8, 1)}[dtype]
    dims, strides, box = tensor_map_geometry(shape, strides_bytes, itemsize, box_rows)
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        data_type, 4, address,
        [driver.cuuint64_t(d) for d in dims],
        [driver.cuuint64_t(s) for s in strides],
        [driver.cuuint32_t(b) for b in box],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(err) != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err!r} (shape {tuple(shape)}, "
                           f"strides {tuple(strides_bytes)})")
    return ctypes.string_at(tensor_map.getPtr(), 128)


def encode_map(x, box_rows: int) -> numpy.ndarray:
    """The CUtensorMap of `x` as 16 64-bit words, its address in word ADDRESS_WORD. Raises
    RuntimeError if the driver put the address elsewhere (the map could then not be patched
    per call: the caller falls back to the mma.sync kernel)."""
    return _checked_words(tensor_map_bytes(x, box_rows), x.data.ptr)


def _checked_words(map_bytes: bytes, address: int) -> numpy.ndarray:
    words = numpy.frombuffer(map_bytes, numpy.uint64).copy()
    if int(words[ADDRESS_WORD]) != address:
        raise RuntimeError("this driver's CUtensorMap does not keep the global address in "
                           f"word {ADDRESS_WORD}")
    return words


def bindings_available() -> bool:
    """Whether the driver bindings that encode the maps are importable."""
    try:
        from cuda.bindings import driver  # noqa: F401  (importable: the maps can be encoded)
    except ImportError:
        return False
    return True


def forward_maps(config) -> dict:
    """The tensor maps of FwdSm90Params over the call's arrays: map field -> (the array's view
    name, box rows). For float32 ("tf32", "float32") k_map and v_map cover the call's scratch
    instead (scratch_map_fields); e4m3's v_map reads v as it lies, as the 16-bit one (the
    kernel transposes it: FwdSm90Config.transpose_v)."""
    if config.operand_pass:
        return {"q_map": ("q", config.block_m)}
    return {"q_map": ("q", config.block_m), "k_map": ("k", config.block_n),
            "v_map": ("v", config.block_n)}


#: Where the maps of scratch arrays are encoded before a call patches in its address: any
#: 16-byte-aligned value (the driver encodes a map without reading the memory).
SCRATCH_MAP_ADDRESS = 1 << 20


def scratch_map_fields(maps: dict, dtype: str = "float32") -> dict:
    """The words of maps over scratch arrays of `dtype` ("float32", or "uint8": the FP8
    forward's keys-last V) (map field -> (view shape, element strides, box rows), the view
    (batch, rows, heads, columns)), by struct path ("k_map.v"), encoded at
    SCRATCH_MAP_ADDRESS: the plan sets each one's address word with the scratch's per call.
    ValueError / RuntimeError as tensor_map_fields."""
    itemsize = numpy.dtype(dtype).itemsize
    fields = {}
    for field, (shape, strides, rows) in maps.items():
        strides_bytes = tuple(itemsize * s for s in strides)
        fields[f"{field}.v"] = _checked_words(
            tensor_map_bytes_at(SCRATCH_MAP_ADDRESS, shape, strides_bytes, dtype, rows),
            SCRATCH_MAP_ADDRESS)
    return fields


def backward_maps(config) -> dict:
    """The tensor maps of BwdSm90Params: map field -> (the array's view name, box rows)."""
    return {"q_map": ("q", config.block_m), "k_map": ("k", config.block_n),
            "v_map": ("v", config.block_n), "do_map": ("dout", config.block_m)}


def tensor_map_fields(views: dict, maps: dict) -> dict:
    """The words of each map field of `maps` (map field -> (view name, box rows)) for the arrays
    `views`, by the path a ParamBlock sets ("q_map.v"). Each array's geometry is checked before
    the driver encodes its map: ValueError where the TMA cannot read it, RuntimeError where the
    driver refuses it or puts its address outside word ADDRESS_WORD."""
    fields = {}
    for field, (name, rows) in maps.items():
        x = as_batched(views[name])
        tensor_map_geometry(x.shape, x.strides, x.itemsize, rows)
        fields[f"{field}.v"] = encode_map(x, rows)
    return fields


def readable_map_fields(views: dict, maps: dict) -> dict | None:
    """tensor_map_fields, or None where the TMA cannot read an array of `maps` (a refusal, or
    an address outside word ADDRESS_WORD, leaves the call to the mma.sync kernels rather than
    failing it)."""
    try:
        return tensor_map_fields(views, maps)
    except (ValueError, RuntimeError):
        return None


def as_batched(x):
    """A (seqlen, heads, headdim) array as (1, seqlen, heads, headdim); 4-D arrays as they are."""
    return x if x.ndim == 4 else x[None]
