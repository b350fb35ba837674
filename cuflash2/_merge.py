"""cuflash2.merge_states and merge_states_many on the host: the full check of a call, its plan
(`_plans.Plan` of cuda_src/merge_states.cu's MergeStatesParams), and what each call checks that
its signature cannot say (an output overlapping an input's memory).

A merge reads "states": attention results over disjoint sets of keys, each an out laid out as
the forward returns it, (batch, seqlen, nheads, headdim) or (seqlen / total_q, nheads, headdim),
and its lse, (batch, nheads, seqlen) or (nheads, seqlen / total_q) float32. merge_states takes
two states as four arrays; merge_states_many one array of outs and one of lses with the states
stacked on a leading dim. The kernel sees both as state 0 (`first`) and states 1.. (`rest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from . import _configs, _launch, _plans, _prepare
from ._validate import _DTYPE_NAMES, check_strides

_plans_by_key = _plans.PlanCache()
#: (row, head) items of a batch entry are numbered in 32 bits in the kernel.
MAX_ITEMS = 2**31 - 1


@dataclass(frozen=True)
class MergeProblem:
    """The sizes of one merge (an unbatched or varlen one has batch 1)."""

    num_states: int
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    dtype: str  # "float16", "bfloat16" or "float32"
    batched: bool  # out (batch, seqlen, nheads, headdim), not (seqlen, nheads, headdim)

    @property
    def out_shape(self) -> tuple:
        lead = (self.batch,) if self.batched else ()
        return lead + (self.seqlen, self.nheads, self.head_dim)

    @property
    def lse_shape(self) -> tuple:
        lead = (self.batch,) if self.batched else ()
        return lead + (self.nheads, self.seqlen)


def _layout(batched: bool, what: str) -> str:
    if what == "out":
        return ("(batch, seqlen, nheads, headdim)" if batched
                else "(seqlen or total_q, nheads, headdim)")
    return "(batch, nheads, seqlen)" if batched else "(nheads, seqlen or total_q)"


def _check_out_dtype(name: str, x) -> str:
    dtype = _DTYPE_NAMES.get(x.dtype)
    if dtype is None:
        raise TypeError(f"{name} must be float16, bfloat16 (ml_dtypes.bfloat16) or float32 (an "
                        f"attention output); got {x.dtype}")
    return dtype


def _check_lse(name: str, x, shape: tuple, out_name: str, out_shape: tuple) -> None:
    if x.dtype != numpy.float32:
        raise TypeError(f"{name} must be float32 (the lse of attention(..., return_lse=True)); "
                        f"got {x.dtype}. Nothing is cast")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} to go with {out_name}'s "
                         f"{tuple(out_shape)}; got {tuple(x.shape)}")
    for dim, (size, stride) in enumerate(zip(x.shape, x.strides)):
        if size > 1 and stride % 4:
            raise ValueError(f"{name} stride of dim {dim} must be a whole number of float32 "
                             f"elements; got strides {tuple(x.strides)}")


def _check_no_self_overlap(name: str, x) -> None:
    """An output's elements must be apart (no broadcast view): its dims of more than one
    element, ordered by stride, each step at least the extent of those below it."""
    extent = x.itemsize
    dims = sorted(((abs(t), s) for s, t in zip(x.shape, x.strides) if s > 1))
    for stride, size in dims:
        if stride < extent:
            raise ValueError(f"{name} must not have overlapping elements (a broadcast or "
                             f"overlapping view: strides {tuple(x.strides)} for shape "
                             f"{tuple(x.shape)}); it is written")
        extent = stride * size


def check_merge(states, out=None, lse=None, stacked: bool = False) -> MergeProblem:
    """Checks a merge's arrays (anything with shape, dtype, strides and itemsize: NumPy arrays
    too) and returns its sizes. `states`: (out name, out, lse name, lse) pairs, two for
    merge_states, one stacked pair (num_states, ...) for merge_states_many (`stacked`)."""
    first_name, first, _, _ = states[0]
    shape = tuple(first.shape)
    dims = (4, 5) if stacked else (3, 4)
    if len(shape) not in dims:
        lead = "num_states, " if stacked else ""
        raise ValueError(
            f"{first_name} must have {dims[1]} dims ({lead}batch, seqlen, nheads, headdim) or "
            f"{dims[0]} ({lead}seqlen or total_q, nheads, headdim), as attention returns out"
            f"{' (stacked)' if stacked else ''}; got shape {shape}")
    num_states = shape[0] if stacked else len(states)
    state_shape = shape[1:] if stacked else shape
    if stacked and num_states < 1:
        raise ValueError(f"{first_name} must hold at least one state (its dim 0); got shape "
                         f"{shape}")
    dtype = _check_out_dtype(first_name, first)
    head_dim = state_shape[-1]
    if (head_dim * first.itemsize) % 16:
        raise ValueError(
            f"{first_name}'s headdim must be a multiple of {16 // first.itemsize} for {dtype} "
            f"(rows are read in 16-byte pieces); got {head_dim}")
    batched = len(state_shape) == 4
    batch = state_shape[0] if batched else 1
    seqlen, nheads = state_shape[-3], state_shape[-2]
    problem = MergeProblem(num_states, batch, seqlen, nheads, head_dim, dtype, batched)
    lead = (num_states,) if stacked else ()
    for out_name, x, lse_name, x_lse in states:
        if x is not first:
            if tuple(x.shape) != shape:
                raise ValueError(f"{out_name} must have {first_name}'s shape {shape}; got "
                                 f"{tuple(x.shape)}")
            if _check_out_dtype(out_name, x) != dtype:
                raise TypeError(f"{out_name} must have {first_name}'s dtype ({dtype}); got "
                                f"{_DTYPE_NAMES[x.dtype]}. Nothing is cast")
        _check_lse(lse_name, x_lse, lead + problem.lse_shape, out_name, shape)
        check_strides(out_name, x)
    if out is not None:
        if tuple(out.shape) != problem.out_shape:
            raise ValueError(f"out must have shape {problem.out_shape} "
                             f"{_layout(batched, 'out')}; got {tuple(out.shape)}")
        if _check_out_dtype("out", out) != dtype:
            raise TypeError(f"out must have the states' dtype ({dtype}); got "
                            f"{_DTYPE_NAMES[out.dtype]}. Nothing is cast")
        check_strides("out", out)
        _check_no_self_overlap("out", out)
    if lse is not None:
        _check_lse("lse", lse, problem.lse_shape, "the merged out", problem.out_shape)
        _check_no_self_overlap("lse", lse)
    if seqlen * nheads > MAX_ITEMS:
        raise ValueError(f"seqlen x nheads must be at most {MAX_ITEMS} a batch entry; got "
                         f"{seqlen} x {nheads}")
    return problem


# ---------------------------------------------------------------------------------------------
# Outputs over inputs: in place is one of the states exactly, anything else must be apart.


def _span(x) -> tuple[int, int]:
    """The bytes of `x` from its data pointer: [lo, hi) offsets (lo <= 0 with negative
    strides)."""
    lo = hi = 0
    for size, stride in zip(x.shape, x.strides):
        if size > 1:
            if stride < 0:
                lo += (size - 1) * stride
            else:
                hi += (size - 1) * stride
    return lo, hi + x.itemsize


@dataclass(frozen=True)
class _Overlap:
    """One (output, input) pair a call checks: their positions in the call's arrays, spans,
    and where the output may be one of the input's states: the byte offsets from the input's
    pointer (none where the layouts differ)."""

    output: int
    output_name: str
    output_span: tuple
    input: int
    input_name: str
    input_span: tuple
    in_place: frozenset
    stacked: bool = False  # the input holds the states stacked

    def check(self, arrays) -> None:
        o, i = arrays[self.output].data.ptr, arrays[self.input].data.ptr
        if (o + self.output_span[0] < i + self.input_span[1]
                and i + self.input_span[0] < o + self.output_span[1]
                and o - i not in self.in_place):
            raise ValueError(
                f"{self.output_name} overlaps the memory of {self.input_name} without being "
                f"{'one of its states' if self.stacked else 'it'} exactly (the same address "
                f"and strides): merging in place writes over one state, any other output must "
                f"be apart from the inputs")


def _overlaps(names, arrays, outputs, inputs, stacked: bool) -> tuple:
    """The (output, input) pairs to check each call: `outputs` and `inputs` positions in
    `arrays` (the outputs given; out may be in place of an out state, lse of an lse state)."""
    pairs = []
    for o in outputs:
        x = arrays[o]
        if x.size == 0:
            continue
        for i in inputs:
            y = arrays[i]
            if y.size == 0:
                continue
            offsets = frozenset()
            state = tuple(y.shape[1:] if stacked else y.shape)
            strides = tuple(y.strides[1:] if stacked else y.strides)
            same_kind = names[o].startswith("out") == names[i].startswith("out")
            if same_kind and x.dtype == y.dtype and tuple(x.shape) == state and (
                    all(a == b for a, b, n in zip(x.strides, strides, state) if n > 1)):
                offsets = (frozenset(s * y.strides[0] for s in range(y.shape[0])) if stacked
                           else frozenset((0,)))
            pairs.append(_Overlap(o, names[o], _span(x), i, names[i], _span(y), offsets,
                                  stacked))
    if len(outputs) == 2 and all(arrays[o].size for o in outputs):
        out, lse = outputs
        pairs.append(_Overlap(lse, names[lse], _span(arrays[lse]), out, names[out],
                              _span(arrays[out]), frozenset()))
    return tuple(pairs)


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass
class MergePlan:
    plan: _plans.Plan
    overlaps: tuple  # _Overlap
    out_given: bool
    lse_given: bool


def _key(cupy, kind: str, arrays) -> tuple | None:
    """A call's signature: every array's shape, strides, dtype and device (None for an absent
    output), and the current device; None where an argument is not a CuPy array (the full
    check then says what is wrong)."""
    if cupy is None:
        return None
    key = [kind]
    if not _plans.add_signature(key, cupy.ndarray, arrays):
        return None
    key.append(cupy.cuda.runtime.getDevice())
    return tuple(key)


def _out_strides(x, stacked: bool, words: int) -> tuple:
    """(state, batch, row, head) strides of an out array in 16-bit words."""
    s = [stride // x.itemsize * words for stride in x.strides]
    state = s.pop(0) if stacked else 0
    return (state, 0, *s[:2]) if len(s) == 3 else (state, *s[:3])


def _lse_strides(x, stacked: bool) -> tuple:
    """(state, batch, head, row) strides of an lse array in floats."""
    s = [stride // 4 for stride in x.strides]
    state = s.pop(0) if stacked else 0
    return (state, 0, *s) if len(s) == 2 else (state, *s)


def _state_fields(prefix: str, out, lse, stacked: bool, words: int) -> dict:
    names = ("o_state_stride", "o_batch_stride", "o_row_stride", "o_head_stride")
    fields = {f"{prefix}.{n}": v for n, v in zip(names, _out_strides(out, stacked, words))}
    names = ("lse_state_stride", "lse_batch_stride", "lse_head_stride", "lse_row_stride")
    fields.update({f"{prefix}.{n}": v for n, v in zip(names, _lse_strides(lse, stacked))})
    return fields


def _merge_plan(kind: str, arrays, names, cupy) -> MergePlan:
    """Checks a call in full and plans it. `arrays`: merge_states' (out_a, lse_a, out_b,
    lse_b, out, lse) or merge_states_many's (outs, lses, out, lse), outputs None where not
    given."""
    stacked = kind == "merge_states_many"
    given = {n: x for n, x in zip(names, arrays) if x is not None}
    cupy = _prepare.require_cupy_arrays(given, reference=kind)
    n_in = 2 if stacked else 4
    states = [(names[i], arrays[i], names[i + 1], arrays[i + 1]) for i in range(0, n_in, 2)]
    out, lse = arrays[n_in], arrays[n_in + 1]
    problem = check_merge(states, out, lse, stacked)
    outs = {n: x for n, x in given.items() if n.startswith("out")}
    device_id = _prepare.check_device(outs, {n: x for n, x in given.items() if n not in outs},
                                      cupy)
    words = _configs.ELEMENT_WORDS[problem.dtype]
    fields = {"num_states": problem.num_states, "seqlen": problem.seqlen,
              "nheads": problem.nheads, "head_dim": problem.head_dim * words}
    # State 0 is `first`, the others `rest`: out_b (two states), or the stack from its second.
    fields.update(_state_fields("first", arrays[0], arrays[1], stacked, words))
    fields.update(_state_fields("rest", arrays[n_in - 2], arrays[n_in - 1], stacked, words))
    inputs = [("first.out", 0, 0), ("first.lse", 1, 0)]
    if stacked:  # (one state: `rest` is never read)
        inputs += [("rest.out", 0, arrays[0].strides[0] if problem.num_states > 1 else 0),
                   ("rest.lse", 1, arrays[1].strides[0] if problem.num_states > 1 else 0)]
    else:
        inputs += [("rest.out", 2, 0), ("rest.lse", 3, 0)]
    o_strides = (_out_strides(out, False, words) if out is not None else _out_strides(
        _Contiguous(problem.out_shape, arrays[0].itemsize), False, words))
    l_strides = _lse_strides(lse if lse is not None else _Contiguous(problem.lse_shape, 4), False)
    fields.update({"o_batch_stride": o_strides[1], "o_row_stride": o_strides[2],
                   "o_head_stride": o_strides[3], "lse_batch_stride": l_strides[1],
                   "lse_head_stride": l_strides[2], "lse_row_stride": l_strides[3]})
    outputs, output_fields = [], []
    for name, x, shape, dtype in (("out", out, problem.out_shape, arrays[0].dtype),
                                  ("lse", lse, problem.lse_shape, numpy.float32)):
        if x is None:
            output_fields.append((name, len(outputs), 0))
            outputs.append((shape, dtype))
        else:
            inputs.append((name, names.index(name), 0))
    aligned = [(i, names[i]) for i, x in enumerate(arrays)
               if x is not None and names[i].startswith("out")]
    config = _configs.MergeStatesConfig(problem.dtype, _configs.merge_lanes(
        problem.head_dim * arrays[0].itemsize))
    items = problem.nheads * problem.seqlen
    launches = []
    if items and problem.batch:
        grid = (-(-items // config.items_per_cta), 1, problem.batch)
        launches.append(_launch.kernel_launch(config, device_id, grid))
    plan = _plans.Plan(device_id, "MergeStatesParams", fields, launches, inputs, outputs,
                       output_fields, aligned=aligned)
    output_positions = [n_in + j for j, x in enumerate((out, lse)) if x is not None]
    overlaps = _overlaps(names, arrays, output_positions, range(n_in), stacked)
    return MergePlan(plan, overlaps, out is not None, lse is not None)


class _Contiguous:
    """The shape, strides and itemsize of a new C-contiguous array (an output allocated)."""

    def __init__(self, shape, itemsize: int):
        self.shape, self.itemsize = tuple(shape), itemsize
        self.strides = tuple(s * itemsize for s in _prepare.contiguous_strides(shape))


def merge(kind: str, arrays: tuple, names: tuple, cupy):
    """Runs a merge call (its plan from the cache, or checked and made): (out, lse)."""
    key = _key(cupy, kind, arrays)
    merge_plan = _plans_by_key.get(key)
    if merge_plan is None:
        merge_plan = _merge_plan(kind, arrays, names, cupy)
        _plans_by_key.put(key, merge_plan)
    for overlap in merge_plan.overlaps:
        overlap.check(arrays)
    outputs = merge_plan.plan.run(arrays, cupy)
    out = arrays[-2] if merge_plan.out_given else outputs[0]
    lse = arrays[-1] if merge_plan.lse_given else outputs[-1]
    return out, lse
