"""The host side of a plan (cuflash2/_plans.py) without a GPU: a stand-in for the few CuPy calls
Plan.run makes (allocation, arrays over an allocation, the current stream) and for the launch,
which records the parameter struct it would have passed. Checks where every pointer of the
struct comes from: inputs at byte offsets, returned outputs in one allocation, unreturned
outputs and the workspace in per-stream scratch, per-call scalars."""

import sys
import types

import numpy
import pytest

from cuflash2 import _launch, _plans, _recycle


class _Memory:
    """A MemoryPointer: an address into an allocation (`mem`), shared by pointers into it."""

    def __init__(self, ptr, mem):
        self.ptr, self.mem = ptr, mem

    def __add__(self, offset):
        return _Memory(self.ptr + offset, self.mem)


class _Array:
    def __init__(self, shape, dtype, memory=None, ptr=0x1000):
        self.shape, self.dtype = shape, numpy.dtype(dtype)
        self.data = memory if memory is not None else types.SimpleNamespace(ptr=ptr)
        self.size = int(numpy.prod(shape))


def _fake_cupy():
    state = {"next": 0x10_0000_0000, "allocations": []}

    def alloc(nbytes):
        memory = _Memory(state["next"], types.SimpleNamespace(size=nbytes))
        state["allocations"].append(nbytes)
        state["next"] += -(-nbytes // 4096) * 4096 + 4096
        return memory

    cuda = types.SimpleNamespace(alloc=alloc, get_current_stream=lambda: types.SimpleNamespace(
        ptr=0x77))
    return types.SimpleNamespace(cuda=cuda, ndarray=_Array, empty=lambda shape, dtype: _Array(
        shape, dtype)), state


@pytest.fixture
def launches(monkeypatch):
    recorded = []

    def record(launch, block, stream, slot):
        recorded.append((launch, stream, block.record.copy()))

    monkeypatch.setattr(_launch, "run", record)
    monkeypatch.setattr(_launch, "graphs_available", lambda: False)  # each launch recorded
    # No driver call on the stand-in stream; outputs are reused only where a test says so.
    monkeypatch.setattr(_launch, "stream_not_capturing", lambda *args: False)
    monkeypatch.setattr(_plans, "_scratch", _plans._StreamScratch())
    return recorded


def _plan(**kwargs):
    return _plans.Plan(0, "FwdParams", {"seqlen_q": 5, "nheads": 2}, ["kernel"], **kwargs)


def test_pointers_come_from_inputs_outputs_and_scratch(launches):
    cupy, state = _fake_cupy()
    plan = _plan(inputs=[("q", 0, 0), ("k", 0, 256), ("v", 1, 0)],
                 outputs=[((4, 8), "float16"), ((2, 5), "float32")],
                 output_fields=[("out", 0, 0), ("lse", 1, 0)], aligned=[(0, "qkv"), (1, "v")])
    qkv, v = _Array((3, 64), "float16", ptr=0x5000), _Array((64,), "float16", ptr=0x9000)
    out, lse = plan.run((qkv, v), cupy)
    (_, stream, record), = launches
    assert stream == 0x77 and record["seqlen_q"] == 5 and record["nheads"] == 2
    assert (record["q"], record["k"], record["v"]) == (0x5000, 0x5100, 0x9000)
    assert record["out"] == out.data.ptr and record["lse"] == lse.data.ptr
    assert lse.data.ptr - out.data.ptr == 256  # one allocation, pieces 256-byte aligned
    assert state["allocations"] == [512]
    assert out.shape == (4, 8) and lse.dtype == numpy.float32


def test_unreturned_outputs_go_to_scratch_after_the_workspace(launches):
    cupy, state = _fake_cupy()
    plan = _plan(outputs=[((4, 8), "float16"), ((2, 5), "float32")],
                 output_fields=[("out", 0, 0), ("lse", 1, 0)], workspace_bytes=1024,
                 workspace_fields=[("varlen.cu_seqlens_q", 0), ("varlen.cu_seqlens_k", 512)])
    (out,) = plan.run((), cupy, wrap=1)
    (_, _, record), = launches
    scratch = record["varlen"]["cu_seqlens_q"][()]
    assert record["varlen"]["cu_seqlens_k"] == scratch + 512
    assert record["lse"] == scratch + 1024  # after the workspace
    assert record["out"] == out.data.ptr
    assert state["allocations"] == [1 << 16, 256]  # the stream's scratch buffer; then out
    plan.run((), cupy, wrap=1)
    assert launches[1][2]["varlen"]["cu_seqlens_q"] == scratch  # the scratch is kept
    assert state["allocations"] == [1 << 16, 256, 256]


def test_large_scratch_is_allocated_per_call(launches):
    cupy, state = _fake_cupy()
    plan = _plan(workspace_bytes=_plans.SCRATCH_MAX_BYTES + 1,
                 workspace_fields=[("varlen.cu_seqlens_q", 0)])
    plan.run((), cupy)
    plan.run((), cupy)
    assert state["allocations"] == [_plans.SCRATCH_MAX_BYTES + 1] * 2


def test_per_call_scalars_and_absent_inputs(launches):
    cupy, _ = _fake_cupy()
    plan = _plan(inputs=[("q", 0, 0)],  # alibi_slopes absent from the signature: no field
                 per_call=("dropout.seed_lo", "dropout.scale"))
    plan.run((_Array((8,), "float16", ptr=0x4000), None), cupy,
             {"dropout.seed_lo": 2**32 - 1, "dropout.scale": 1.25})
    (_, _, record), = launches
    assert record["q"] == 0x4000 and record["mods"]["alibi_slopes"] == 0
    assert record["dropout"]["seed_lo"] == 2**32 - 1 and record["dropout"]["scale"] == 1.25


def test_a_misaligned_input_raises_before_any_launch(launches):
    cupy, _ = _fake_cupy()
    plan = _plan(inputs=[("q", 0, 0)], aligned=[(0, "q")])
    bad = _Array((8,), "float16", ptr=0x4002)
    bad.data.ptr = 0x4002
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        plan.run((bad,), cupy)
    assert launches == []


def test_plan_cache_ignores_unhashable_keys_and_is_bounded():
    cache = _plans.PlanCache()
    cache.put(("a", [1]), "plan")  # unhashable: not kept
    assert cache.get(("a", [1])) is None and len(cache) == 0
    for i in range(_plans.MAX_PLANS + 1):
        cache.put(("k", i), i)
    assert len(cache) == 1 and cache.get(("k", _plans.MAX_PLANS)) == _plans.MAX_PLANS


def test_launches_take_the_struct_or_a_nested_one(monkeypatch):
    """launch_structs: each launch gets the whole block or a nested struct of it (the Hopper
    backward's preprocess and dQ conversion take BwdSm90Params.base), all patched per call."""
    recorded = []
    monkeypatch.setattr(_launch, "run", lambda launch, block, stream, slot: recorded.append(
        (launch, block.kernel_params_address, block.record.copy()[0])))
    monkeypatch.setattr(_launch, "graphs_available", lambda: False)
    monkeypatch.setattr(_launch, "stream_not_capturing", lambda *args: False)
    monkeypatch.setattr(_plans, "_scratch", _plans._StreamScratch())
    cupy, _ = _fake_cupy()
    plan = _plans.Plan(0, "BwdSm90Params", {"base.seqlen_q": 9}, ["pre", "main", "convert"],
                       inputs=[("base.q", 0, 0), ("q_map.v", 0, 0)], workspace_bytes=512,
                       workspace_fields=[("base.dq_accum", 0)],
                       batch_offset="base.batch_offset", launch_structs=("base", "", "base"))
    q = _Array((4, 8), "float16", ptr=0x4000)
    plan.run((q,), cupy)
    (pre, pre_address, pre_record), (main, main_address, main_record), (conv, conv_address,
                                                                         _) = recorded
    assert (pre, main, conv) == ("pre", "main", "convert")
    assert pre_address == conv_address != main_address
    assert pre_record["seqlen_q"] == 9 and pre_record["q"] == 0x4000
    assert main_record["base"]["dq_accum"] == pre_record["dq_accum"] != 0
    assert main_record["q_map"]["v"][0] == 0x4000
    with pytest.raises(ValueError, match="one entry a launch"):
        _plans.Plan(0, "FwdParams", {}, ["a", "b"], launch_structs=("",))


@pytest.mark.skipif(not _recycle.ENABLED, reason="output reuse is off here")
def test_outputs_nothing_holds_are_reused_outside_a_capture(launches, monkeypatch):
    """Plan.run hands out an earlier output again once nothing holds it (cuflash2/_recycle.py),
    on its own stream, and allocates while the stream is being captured."""
    capturing = {"now": False}
    monkeypatch.setattr(_launch, "stream_not_capturing", lambda *args: not capturing["now"])
    cupy, state = _fake_cupy()
    plan = _plan(outputs=[((4, 8), "float16"), ((2, 5), "float32")],
                 output_fields=[("out", 0, 0), ("lse", 1, 0)])
    first = plan.run((), cupy, wrap=1)[0]
    first_ptr = first.data.ptr
    held = plan.run((), cupy, wrap=1)[0]  # `first` is held: a new allocation
    assert held.data.ptr != first_ptr and len(state["allocations"]) == 3  # + scratch
    del first
    again = plan.run((), cupy, wrap=1)[0]
    assert again.data.ptr == first_ptr and len(state["allocations"]) == 3
    assert launches[-1][2]["out"] == first_ptr
    view_of_again = again.data + 16  # a pointer into its memory keeps it
    del again
    assert plan.run((), cupy, wrap=1)[0].data.ptr not in (first_ptr, held.data.ptr)
    del view_of_again
    assert plan.run((), cupy, wrap=1)[0].data.ptr == first_ptr
    out, lse = plan.run((), cupy)  # two outputs: kept apart from the one-output calls
    assert out.data.ptr != first_ptr and lse.data.ptr - out.data.ptr == 256
    out_ptr = out.data.ptr
    del out, lse
    capturing["now"] = True
    assert plan.run((), cupy)[0].data.ptr != out_ptr
    capturing["now"] = False
    assert plan.run((), cupy)[0].data.ptr == out_ptr
    reshaped = plan.run((), cupy, wrap=1)[0]
    assert reshaped.data.ptr == first_ptr
    reshaped.shape = (32,)
    del reshaped
    assert plan.run((), cupy, wrap=1)[0].shape == (4, 8)


def test_idle_reference_counts_match_this_interpreter():
    """The counts a kept record reads when nothing else holds it, measured on stand-ins, tell
    an extra reference to the array, its pointer or its memory apart."""
    memory = types.SimpleNamespace()
    arrays = [_Array((2,), "float16", _Memory(0x1000 + 256 * i, memory)) for i in range(2)]
    kept = _recycle.Kept(arrays, 0x1000)
    assert not kept.idle()  # `arrays` holds them, `memory` their memory
    del memory
    assert not kept.idle()
    pointer = arrays[1].data
    del arrays
    assert not kept.idle()  # `pointer` holds one
    del pointer
    assert kept.idle()
    shared = kept.memory
    assert not kept.idle()
    del shared
    assert kept.idle()


def test_graph_nodes_get_parameters_again_only_when_the_struct_changed(monkeypatch):
    """_launch._Executable.launch sets its nodes' parameters on the first launch and whenever
    the struct's bytes differ from those it last set them from; it launches every time."""
    calls = []
    api = types.SimpleNamespace(
        set_params=lambda executable, node, params: calls.append(("set", node)) or 0,
        destroy_exec=lambda executable: 0, destroy=lambda graph: 0)
    monkeypatch.setattr(_launch, "_graph_api", api)
    monkeypatch.setattr(_launch, "_cuda_runtime", types.SimpleNamespace(
        graphLaunch=lambda executable, stream: calls.append(("launch", stream))))
    struct = numpy.zeros(64, dtype=numpy.uint8)
    executable = _launch._Executable(1, 2, ((10, 0), (11, 0)), (), struct)
    executable.launch(7)
    assert calls == [("set", 10), ("set", 11), ("launch", 7)]
    del calls[:]
    executable.launch(7)
    assert calls == [("launch", 7)]
    struct[40] = 3  # a new address patched in
    executable.launch(8)
    struct[40] = 3
    executable.launch(8)
    assert calls == [("launch", 7), ("set", 10), ("set", 11), ("launch", 8), ("launch", 8)]
    del executable


def test_output_reuse_follows_its_switch_and_the_gil(monkeypatch):
    """CUFLASH2_RECYCLE is read by _launch.switch (tested with CUFLASH2_GRAPHS); without a
    GIL, reference counts are not read this simply and outputs are never reused."""
    for wanted in (True, False):
        monkeypatch.setattr(_launch, "switch", lambda variable: wanted and
                            variable == "CUFLASH2_RECYCLE")
        for gil in (True, False):
            monkeypatch.setattr(sys, "_is_gil_enabled", lambda: gil, raising=False)
            assert _recycle._wanted() is (wanted and gil)


def test_outputs_are_kept_for_a_bounded_number_of_streams():
    """A program that makes a new stream every step does not pile up kept outputs."""
    cache = _recycle.OutputCache()
    memory = types.SimpleNamespace()
    arrays = []
    for stream in range(_recycle.MAX_KEYS + 1):
        arrays.append(_Array((2,), "float16", _Memory(0x1000 * (stream + 1), memory)))
        cache.keep(stream, [arrays[-1]], 0x1000 * (stream + 1))
        for _ in range(_recycle.SLOTS + 1):
            cache.keep(stream, [arrays[-1]], 0x1000 * (stream + 1))
        assert len(cache.kept[(stream, 1)]) == _recycle.SLOTS
    assert len(cache.kept) == 1  # the 17th stream emptied the cache
