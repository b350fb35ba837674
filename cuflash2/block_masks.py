"""Block masks (issue 44): a mask modifier evaluated on the GPU once into one state per tile of
the forward kernel's own tiles, so that the kernel skips the empty tiles and runs the user's
expression on the partial ones only.

    doc = cupy.asarray(document_ids, dtype=cupy.int32)                  # (seqlen,)
    mask = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc)
    bm = cuflash2.block_mask(mask, 1, 1, seqlen, seqlen, head_dim=128, dtype="bfloat16")
    out = cuflash2.attention(q, k, v, block_mask=bm)     # mask_mod=mask may be given too

- `block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, *, head_dim=None, dtype="float16",
  block_m=None, block_n=None)` -> `BlockMask`. `states`: int8 CuPy array (batch, nheads,
  num_m_blocks, num_n_blocks), per tile BLOCK_MASK_EMPTY (0: no (query, key) of the tile
  visible), BLOCK_MASK_PARTIAL (1) or BLOCK_MASK_FULL (2: every (query, key) of the tile inside
  the sequence visible). `ranges`: int32 (batch, nheads, num_m_blocks, 4), each row of states
  summed up as (first visited n block, one past the last, first and one past the last n block of
  its longest run of full tiles), zeros where none (reference.block_mask_ranges); the Hopper
  forward reads these. `columns`: int32 (batch, nheads, num_n_blocks, 8), each column of
  states summed up (first visited m block and one past the last, or 0x7fffffff and 0; first
  and one past the last full m block and how many are full; three unused)
  (reference.block_mask_columns); the Hopper backward reads these. Causal and windows are not
  part of it: `attention`'s causal / window_size still apply on top (as they do to the mask
  modifier).
- Broadcast: batch=1 (nheads=1) means the mask does not depend on `b` (`h`): the states are
  evaluated at b = 0 (h = 0) and serve calls of any batch (any number of heads), across calls
  and layers. Whether the expression depends on b or h is the caller's to know (not checked).
- The tiles must be those of the kernel that will read the states: by default the mods
  forward's tiles for `head_dim` and `dtype` on the current device
  (`_dispatch.fwd_mods_config`); `attention` refuses a BlockMask of other tiles (ValueError).
- `attention(q, k, v, block_mask=bm)` takes the mask modifier from `bm`; a `mask_mod=` given
  with it must be the same modifier (the same expression and constants, the same input arrays).
  `attention_backward(..., block_mask=bm)` and `attention_vjp` take it too; not
  attention_varlen yet.
"""

from __future__ import annotations

import numpy

from . import _configs

__all__ = ["BlockMask", "block_mask", "tiles", "check_for_call", "check_for_backward",
           "check_for_hopper", "same_mask_mod"]

EMPTY, PARTIAL, FULL = (_configs.BLOCK_MASK_EMPTY, _configs.BLOCK_MASK_PARTIAL,
                        _configs.BLOCK_MASK_FULL)
#: A column's summary before any row added its state (BlockMaskColumns, kernel_params.cuh).
COLUMNS_START = (0x7FFFFFFF, 0, 0x7FFFFFFF, 0, 0, 0, 0, 0)


class BlockMask:
    """Per-tile states of a mask modifier (see `block_mask`): `states` (int8, (batch, nheads,
    num_m_blocks, num_n_blocks), batch / nheads 1 where shared), `mask_mod`, the tiles
    `block_m` x `block_n`, the lengths, and the device it lives on."""

    __slots__ = ("states", "ranges", "columns", "mask_mod", "block_m", "block_n", "batch",
                 "nheads", "seqlen_q", "seqlen_k", "device_id")

    def __init__(self, states, mask_mod, block_m: int, block_n: int, batch: int, nheads: int,
                 seqlen_q: int, seqlen_k: int, device_id: int):
        self.states = states
        self.ranges = None  # (batch, nheads, num_m_blocks, 4) int32, made with the states
        self.columns = None  # (batch, nheads, num_n_blocks, 8) int32, made with the states
        self.mask_mod = mask_mod
        self.block_m, self.block_n = block_m, block_n
        self.batch, self.nheads = batch, nheads
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.device_id = device_id

    @property
    def arrays(self) -> tuple:
        """The arrays a call passes on to the kernels, in this order, after the modifiers' own
        (cuflash2.api: the states, the rows' ranges, the columns' summaries)."""
        return (self.states, self.ranges, self.columns)

    @property
    def num_m_blocks(self) -> int:
        return -(-self.seqlen_q // self.block_m)

    @property
    def num_n_blocks(self) -> int:
        return -(-self.seqlen_k // self.block_n)

    @property
    def key(self) -> tuple:
        """Its share of a call's signature key (the states' array enters as an array)."""
        return ("block_mask", self.block_m, self.block_n, self.batch, self.nheads, self.seqlen_q,
                self.seqlen_k, self.mask_mod.key)

    def __repr__(self) -> str:
        return (f"BlockMask({self.mask_mod!r}, batch={self.batch}, nheads={self.nheads}, "
                f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, tiles={self.block_m}x"
                f"{self.block_n})")


def _dtype_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or str(dtype)
    name = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    if name not in _configs.DTYPE_TAGS:
        raise ValueError(f"block_mask: dtype must be one of {', '.join(_configs.DTYPE_TAGS)}; "
                         f"got {dtype!r}")
    return name


def tiles(dtype, head_dim: int, arch: int) -> tuple[int, int]:
    """(block_m, block_n) of the forward with a mask modifier for `dtype`, `head_dim` on
    sm_`arch` (_dispatch.fwd_mods_config: the tiles a block mask must be built for)."""
    from . import _dispatch

    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"block_mask: head_dim must be an int > 0; got {head_dim!r}")
    config = _dispatch.fwd_mods_config(_dtype_name(dtype), head_dim, arch)
    return config.block_m, config.block_n


def block_mask(mask_mod, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, *,
               head_dim: int | None = None, dtype="float16", block_m: int | None = None,
               block_n: int | None = None) -> BlockMask:
    """The per-tile states of `mask_mod` (a `cuflash2.mask_mod`) for calls of `batch` x `nheads`
    x `seqlen_q` x `seqlen_k` (batch or nheads 1: shared by every batch entry / head, the mask
    evaluated at b = 0 / h = 0), evaluated on the current device and stream. The tiles: the
    forward's for `head_dim` and `dtype` (tiles()), or `block_m` x `block_n` as given. Module
    docstring: cuflash2.block_mask."""
    from . import _launch, _params, _prepare, mods

    if not isinstance(mask_mod, mods.MaskMod):
        raise TypeError(f"block_mask: mask_mod must be made by cuflash2.mask_mod(expression, "
                        f"**inputs); got {type(mask_mod).__name__}")
    for name, value in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q),
                        ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"block_mask: {name} must be an int >= 1; got {value!r}")
    cupy = _prepare.cupy_module()
    device_id = cupy.cuda.Device().id
    if block_m is None or block_n is None:
        if head_dim is None:
            raise ValueError("block_mask: give head_dim (and dtype) for the forward's tiles, or "
                             "block_m and block_n")
        bm, bn = tiles(dtype, head_dim, _prepare.device_arch(device_id))
        block_m = bm if block_m is None else block_m
        block_n = bn if block_n is None else block_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"block_mask: {name} must be an int >= 1; got {value!r}")
    for name, x in _prepare.user_mod_arrays(mask_mod, None).items():
        if x.device.id != device_id:
            raise ValueError(f"block_mask: {name} is on device {x.device.id}, the current "
                             f"device is {device_id}")
    result = BlockMask(None, mask_mod, block_m, block_n, batch, nheads, seqlen_q, seqlen_k,
                       device_id)
    states = cupy.empty((batch, nheads, result.num_m_blocks, result.num_n_blocks),
                        dtype=cupy.int8)
    header, h = mods.user_mods_header(mask_mod.source, None)
    config = _configs.BlockMaskConfig(block_m, block_n, header, h)
    ranges = cupy.empty((batch, nheads, result.num_m_blocks, 4), dtype=cupy.int32)
    # The columns' summaries start as "none visited, none full"; the kernel's atomics fill them.
    columns = cupy.zeros((batch, nheads, result.num_n_blocks, 8), dtype=cupy.int32)
    columns[..., 0], columns[..., 2] = COLUMNS_START[0], COLUMNS_START[2]  # on the stream
    fields = {"states": states.data.ptr, "ranges": ranges.data.ptr,
              "columns": columns.data.ptr, "nheads": nheads, "seqlen_q": seqlen_q,
              "seqlen_k": seqlen_k, "num_m_blocks": result.num_m_blocks,
              "num_n_blocks": result.num_n_blocks}
    fields.update(mods.user_input_strides(mask_mod.arrays))
    for i, x in enumerate(mask_mod.arrays):
        fields[f"user.in{i}.data"] = x.data.ptr
    block = _params.ParamBlock("BlockMaskParams", fields)
    launch = _launch.kernel_launch(config, device_id, (result.num_m_blocks, nheads, batch))
    _launch.run(launch, block, cupy.cuda.get_current_stream().ptr, block.slot("batch_offset"))
    result.states, result.ranges, result.columns = states, ranges, columns
    return result


def same_mask_mod(a, b) -> bool:
    """Whether two mask modifiers are the same: the same object, or the same source (expression,
    inputs' signatures, constants) over the same arrays (address, shape, strides)."""
    if a is b:
        return True
    if a.source != b.source or len(a.arrays) != len(b.arrays):
        return False
    return all(x.data.ptr == y.data.ptr and x.shape == y.shape and x.strides == y.strides
               for x, y in zip(a.arrays, b.arrays))


def resolve(mask_mod, block_mask_):
    """The mask modifier of a call given `block_mask=` (and maybe `mask_mod=`): the block mask's
    own; a `mask_mod` given too must be the same (same_mask_mod), else ValueError."""
    if not isinstance(block_mask_, BlockMask):
        raise TypeError(f"block_mask must be made by cuflash2.block_mask(...); got "
                        f"{type(block_mask_).__name__}")
    if mask_mod is not None and not same_mask_mod(mask_mod, block_mask_.mask_mod):
        raise ValueError(
            f"block_mask was built for {block_mask_.mask_mod!r}, not for the mask_mod given "
            f"({mask_mod!r}); pass the same modifier, or block_mask alone (it carries its "
            "mask_mod)")
    return block_mask_.mask_mod


def check_for_call(bm: BlockMask, block_m: int, block_n: int, batch: int, nheads: int,
                   seqlen_q: int, seqlen_k: int, device_id: int) -> None:
    """ValueError unless `bm` fits a call of batch x nheads x seqlen_q x seqlen_k on device
    `device_id` whose kernel's tiles are block_m x block_n (batch / nheads broadcast from 1)."""
    if (bm.block_m, bm.block_n) != (block_m, block_n):
        raise ValueError(
            f"block_mask was built for {bm.block_m}x{bm.block_n} tiles, the forward kernel of "
            f"this call uses {block_m}x{block_n} tiles: build it with this call's head_dim and "
            "dtype (cuflash2.block_mask(..., head_dim=, dtype=))")
    for name, have, want in (("batch", bm.batch, batch), ("nheads", bm.nheads, nheads)):
        if have not in (1, want):
            raise ValueError(f"block_mask was built for {name}={have}, the call has "
                             f"{name}={want} (a block mask of {name}=1 is shared by all)")
    if (bm.seqlen_q, bm.seqlen_k) != (seqlen_q, seqlen_k):
        raise ValueError(f"block_mask was built for seqlen_q={bm.seqlen_q}, seqlen_k="
                         f"{bm.seqlen_k}; the call has seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")
    if bm.device_id != device_id:
        raise ValueError(f"block_mask is on device {bm.device_id}, the call's arrays on device "
                         f"{device_id}")
    shape = (bm.batch, bm.nheads, bm.num_m_blocks, bm.num_n_blocks)
    if tuple(bm.states.shape) != shape or numpy.dtype(bm.states.dtype) != numpy.int8:
        raise ValueError(f"block_mask.states must be int8 {shape}; got "
                         f"{bm.states.dtype} {tuple(bm.states.shape)}")


def check_for_hopper(bm: BlockMask, block_m: int, block_n: int, batch: int, nheads: int,
                     seqlen_q: int, seqlen_k: int, device_id: int) -> dict:
    """check_for_call for the Hopper forward, whose block_m x block_n tiles are coarser than the
    states' (the mma.sync forward's): each must span whole ones. Returns the FwdSm90ModsParams
    fields `block_m_div`, `block_n_div` (states a Hopper tile spans each way), the states' row
    count `num_m_blocks` and the strides of their rows' ranges (`ranges.*`, BlockMaskRanges: 0
    over a shared batch / head)."""
    if block_m % bm.block_m or block_n % bm.block_n:
        raise ValueError(
            f"block_mask was built for {bm.block_m}x{bm.block_n} tiles, which do not make up the "
            f"Hopper forward's {block_m}x{block_n} tiles of this call")
    check_for_call(bm, bm.block_m, bm.block_n, batch, nheads, seqlen_q, seqlen_k, device_id)
    return {"block_m_div": block_m // bm.block_m, "block_n_div": block_n // bm.block_n,
            "num_m_blocks": bm.num_m_blocks, **_summary_fields(bm, "ranges", bm.num_m_blocks, 4)}


def check_for_backward(bm: BlockMask, block_m: int, block_n: int, batch: int, nheads: int,
                       seqlen_q: int, seqlen_k: int, device_id: int) -> dict:
    """check_for_call for the backward's main kernel, whose block_m x block_n tiles may be
    finer than the states' (the forward's): each state's tile must span whole ones. Returns the
    BwdModsParams fields `block_m_div`, `block_n_div` (how many it spans each way)."""
    if bm.block_m % block_m or bm.block_n % block_n:
        raise ValueError(
            f"block_mask was built for {bm.block_m}x{bm.block_n} tiles, which do not split into "
            f"the backward kernel's {block_m}x{block_n} tiles of this call")
    check_for_call(bm, bm.block_m, bm.block_n, batch, nheads, seqlen_q, seqlen_k, device_id)
    return {"block_m_div": bm.block_m // block_m, "block_n_div": bm.block_n // block_n}


def check_for_hopper_backward(bm: BlockMask, batch: int, nheads: int, seqlen_q: int,
                              seqlen_k: int, device_id: int) -> dict:
    """check_for_call for the Hopper backward, which reads the columns' summaries at any tile
    of its own (BlockMaskColumnRange converts through positions). Returns the BwdSm90ModsParams
    fields: the states' tile, their column count and the columns' strides (0 over a shared
    batch / head)."""
    check_for_call(bm, bm.block_m, bm.block_n, batch, nheads, seqlen_q, seqlen_k, device_id)
    return {"state_block_m": bm.block_m, "state_block_n": bm.block_n,
            "num_n_blocks": bm.num_n_blocks,
            **_summary_fields(bm, "columns", bm.num_n_blocks, 8)}


def _summary_fields(bm: BlockMask, name: str, count: int, width: int) -> dict:
    """The strides of the block mask's summaries `name` (its ranges or columns: int32 (batch,
    nheads, count, width), checked), in summaries: `<name>.batch_stride`, `<name>.head_stride`,
    0 over a shared batch / head."""
    array = getattr(bm, name)
    shape = (bm.batch, bm.nheads, count, width)
    if tuple(array.shape) != shape or numpy.dtype(array.dtype) != numpy.int32:
        raise ValueError(f"block_mask.{name} must be int32 {shape}; got "
                         f"{array.dtype} {tuple(array.shape)}")
    return {f"{name}.batch_stride": 0 if bm.batch == 1 else bm.nheads * count,
            f"{name}.head_stride": 0 if bm.nheads == 1 else count}


def states_fields(bm: BlockMask) -> dict:
    """BlockMaskStates' strides (`blocks.*` of FwdModsParams): 0 over a shared batch / head."""
    _, h, m, n = bm.states.shape
    return {"blocks.batch_stride": 0 if bm.batch == 1 else h * m * n,
            "blocks.head_stride": 0 if bm.nheads == 1 else m * n, "blocks.row_stride": n}
