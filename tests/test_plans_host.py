"""The host side of a plan (cuflash2/_plans.py) without a GPU: a stand-in for the few CuPy calls
Plan.run makes (allocation, arrays over an allocation, the current stream) and for the launch,
which records the parameter struct it would have passed. Checks where every pointer of the
struct comes from: inputs at byte offsets, returned outputs in one allocation, unreturned
outputs and the workspace in per-stream scratch, per-call scalars."""

import sys
import types

import numpy
import pytest

from cuflash2 import _dispatch, _launch, _plans, _recycle


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


# --------------------------------------------------------------------------------------------
# The public functions on host arrays: a CuPy stand-in whose ndarray is _DeviceArray, kernels
# neither compiled nor launched (`launches` records each launch's configuration, grid and struct).


class _DeviceArray:
    """A CuPy array stand-in: over a NumPy array (an input), or over a stand-in allocation (an
    output: cupy.ndarray(shape, dtype, memory))."""

    def __init__(self, shape, dtype=None, memory=None, device=0):
        if isinstance(shape, numpy.ndarray):
            self.array = shape
            self.shape, self.dtype, self.strides = shape.shape, shape.dtype, shape.strides
            memory = _Memory(shape.ctypes.data, shape)
        else:
            self.array = None
            self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
            self.strides = tuple(s * self.dtype.itemsize
                                 for s in _contiguous(self.shape))
        self.data = memory if memory is not None else _Memory(0x2000, None)
        self.data.device_id = device
        self.device = types.SimpleNamespace(id=device)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        self.size = int(numpy.prod(self.shape))

    def __getitem__(self, index):
        return _DeviceArray(self.array[index], device=self.device.id)

    def transpose(self, *axes):
        return _DeviceArray(self.array.transpose(*axes), device=self.device.id)

    def astype(self, dtype):
        return _DeviceArray(self.array.astype(dtype), device=self.device.id)

    def reshape(self, shape):
        return _DeviceArray(self.array.reshape(shape), device=self.device.id)


def _contiguous(shape):
    strides, size = [], 1
    for dim in reversed(shape):
        strides.insert(0, size)
        size *= max(dim, 1)
    return strides


def device_array(shape, dtype=numpy.float16, device=0):
    return _DeviceArray(numpy.zeros(shape, dtype), device=device)


@pytest.fixture
def api_host(launches, monkeypatch):
    """The public functions on _DeviceArray inputs, on a device of compute capability
    `api_host.arch` (80 unless a test sets it), with fresh plan caches."""
    from cuflash2 import _attention_plans, _dispatch, _kvcache, _prepare, api

    cupy, state = _fake_cupy()
    cupy.ndarray = _DeviceArray
    cupy.zeros = lambda shape, dtype: _DeviceArray(numpy.zeros(shape, dtype))
    cupy.int32 = numpy.int32
    cupy.empty = lambda shape, dtype: _DeviceArray(numpy.zeros(shape, dtype))
    monkeypatch.setattr(_kvcache, "_split_counters", _plans.StreamCounters(1024))
    cupy.cuda.Device = lambda device=None: types.SimpleNamespace(id=0)
    cupy.cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(api, "_cupy", cupy)
    monkeypatch.setattr(_kvcache, "_cupy", cupy)
    for cache in (api._forward_plans, api._backward_plans, _kvcache._plans_by_key):
        monkeypatch.setattr(cache, "plans", {})
    host = types.SimpleNamespace(cupy=cupy, launches=launches)

    def set_arch(arch):
        monkeypatch.setitem(_prepare._arch_cache, 0, arch)

    host.set_arch = set_arch
    set_arch(80)
    monkeypatch.setattr(_attention_plans._launch, "kernel_launch",
                        lambda config, device, grid, **kw: types.SimpleNamespace(
                            config=config, grid=grid, **kw))
    monkeypatch.setattr(_dispatch, "decode_slots", lambda config, device_id: 264)
    return host


def _forward_arrays(batch=2, sq=100, sk=120, h=4, hkv=2, d=64):
    return (device_array((batch, sq, h, d)), device_array((batch, sk, hkv, d)),
            device_array((batch, sk, hkv, d)))


def test_a_sinks_forward_compiles_them_in_and_patches_their_pointer(api_host):
    """attention(..., sinks=) on the mma.sync forward: FEATURE_SINKS in the kernel's features,
    mods.sinks the address of the call's sinks (patched per call, like alibi_slopes); the
    packed and varlen entry points read them from their own input positions."""
    import cuflash2
    from cuflash2 import _configs

    q, k, v = _forward_arrays()
    for _ in range(2):  # planned, then a plan hit with other arrays
        sinks = device_array((4,), numpy.float32)
        slopes = device_array((4,), numpy.float32)
        cuflash2.attention(q, k, v, sinks=sinks, alibi_slopes=slopes, causal=True)
        launch, _, record = api_host.launches[-1]
        assert isinstance(launch.config, _configs.FwdConfig)
        assert launch.config.features == _configs.FEATURE_SINKS | _configs.FEATURE_ALIBI
        assert record["mods"]["sinks"] == sinks.data.ptr
        assert record["mods"]["alibi_slopes"] == slopes.data.ptr
    cuflash2.attention(q, k, v)
    launch, _, record = api_host.launches[-1]
    assert launch.config.features == 0 and record["mods"]["sinks"] == 0
    assert "with sinks" in cuflash2.forward_kernels(q, k, v, sinks=sinks)[0]
    qkv = device_array((2, 100, 3, 4, 64))
    cuflash2.attention_qkvpacked(qkv, sinks=sinks)
    assert api_host.launches[-1][2]["mods"]["sinks"] == sinks.data.ptr
    cuflash2.attention_kvpacked(q, device_array((2, 120, 2, 2, 64)), sinks=sinks)
    assert api_host.launches[-1][2]["mods"]["sinks"] == sinks.data.ptr
    cu = device_array((3,), numpy.int32)
    packed_q, packed_k = device_array((200, 4, 64)), device_array((240, 2, 64))
    cuflash2.attention_varlen(packed_q, packed_k, packed_k, cu, cu, 100, 120, sinks=sinks,
                              check_cu_seqlens=False)
    launch, _, record = api_host.launches[-1]
    assert launch.config.features == _configs.FEATURE_SINKS | _configs.FEATURE_VARLEN
    assert record["mods"]["sinks"] == sinks.data.ptr
    assert record["varlen"]["cu_seqlens_q"] == cu.data.ptr


def _backward_call(api_host, deterministic=False, **options):
    import cuflash2

    q, k, v = _forward_arrays()
    dout, out = device_array(q.shape), device_array(q.shape)
    lse = device_array((2, 4, 100), numpy.float32)
    del api_host.launches[:]
    grads = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                        **options)
    return grads, list(api_host.launches)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_sinks_backward_adds_their_gradient_after_the_preprocess(api_host, deterministic):
    """attention_backward(..., sinks=): (dq, dk, dv, dsinks); the sinks' gradient kernel
    (grid: one CTA a head) right after the preprocess; the main kernels without FEATURE_SINKS
    (the same as without sinks); dsinks a float32 (nheads,) output (or the given array);
    BwdParams.batch the sequence count."""
    from cuflash2 import _configs

    plain, plain_launches = _backward_call(api_host, deterministic)
    assert len(plain) == 3
    sinks = device_array((4,), numpy.float32)
    grads, launched = _backward_call(api_host, deterministic, sinks=sinks)
    dq, dk, dv, dsinks = grads
    assert dsinks.shape == (4,) and dsinks.dtype == numpy.float32
    names = [getattr(launch.config, "kernel", type(launch.config).__name__)
             for launch, _, _ in launched]
    assert names == ["flash_bwd_preprocess_kernel", "flash_bwd_sinks_kernel",
                     *names[2:]] and len(names) == 4
    assert launched[1][0].grid == (4, 1, 1)
    assert [launch.config for launch, _, _ in launched[2:]] == [
        launch.config for launch, _, _ in plain_launches[1:]]
    assert not any(getattr(launch.config, "features", 0) & _configs.FEATURE_SINKS
                   for launch, _, _ in launched)
    record = launched[1][2]
    assert record["dsinks"] == dsinks.data.ptr and record["mods"]["sinks"] == sinks.data.ptr
    assert record["batch"] == 2 and plain_launches[0][2]["batch"] == 2
    assert record["lse_log2"] == launched[0][2]["lse_log2"] != 0  # the preprocess's
    given = device_array((4,), numpy.float32)
    grads, launched = _backward_call(api_host, deterministic, sinks=sinks, dsinks=given)
    assert grads[3] is given and launched[1][2]["dsinks"] == given.data.ptr


def test_packed_and_varlen_backwards_return_dsinks_after_their_gradients(api_host):
    import cuflash2

    sinks = device_array((4,), numpy.float32)
    qkv, dout = device_array((2, 100, 3, 4, 64)), device_array((2, 100, 4, 64))
    lse = device_array((2, 4, 100), numpy.float32)
    dqkv = cuflash2.attention_qkvpacked_backward(dout, qkv, dout, lse)
    assert dqkv.shape == qkv.shape
    dqkv, dsinks = cuflash2.attention_qkvpacked_backward(dout, qkv, dout, lse, sinks=sinks)
    assert dqkv.shape == qkv.shape and dsinks.shape == (4,)
    assert api_host.launches[-3][2]["dsinks"] == dsinks.data.ptr
    kv = device_array((2, 120, 2, 2, 64))
    dq, dkv = cuflash2.attention_kvpacked_backward(dout, dout, kv, dout, lse)
    dq, dkv, dsinks = cuflash2.attention_kvpacked_backward(dout, dout, kv, dout, lse,
                                                            sinks=sinks)
    assert dq.shape == dout.shape and dkv.shape == kv.shape and dsinks.shape == (4,)
    cu = device_array((4,), numpy.int32)  # three sequences
    q, k = device_array((200, 4, 64)), device_array((240, 2, 64))
    packed_lse = device_array((4, 200), numpy.float32)
    grads = cuflash2.attention_varlen_backward(q, q, k, k, q, packed_lse, cu, cu, 100, 120,
                                               sinks=sinks, check_cu_seqlens=False)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape, (4,)]
    sinks_launch = [r for launch, _, r in api_host.launches[-4:]
                    if getattr(launch.config, "kernel", "") == "flash_bwd_sinks_kernel"]
    assert sinks_launch[0]["batch"] == 3 and sinks_launch[0]["dsinks"] == grads[3].data.ptr


def test_vjp_returns_dsinks_with_sinks(api_host):
    import cuflash2

    q, k, v = _forward_arrays()
    sinks = device_array((4,), numpy.float32)
    out, vjp = cuflash2.attention_vjp(q, k, v, sinks=sinks)
    assert len(vjp(device_array(q.shape))) == 4
    assert len(cuflash2.attention_vjp(q, k, v)[1](device_array(q.shape))) == 3


@pytest.mark.parametrize("arch", [80, 90])
def test_a_sinks_decode_step_compiles_them_in(api_host, monkeypatch, arch):
    """attention_with_kvcache(..., sinks=): the decode kernel with FEATURE_SINKS, whichever
    kernel the split choice takes (sm_90: the clustered one of decode_cluster_config),
    mods.sinks patched from the call's sinks."""
    import cuflash2
    from cuflash2 import _configs, _dispatch, _launch

    api_host.set_arch(arch)
    monkeypatch.setattr(_launch, "extended_available", lambda: True)
    monkeypatch.setattr(_launch, "cluster_fits", lambda *args: True)
    q = device_array((1, 1, 8, 128))
    cache = device_array((1, 4096, 2, 128))
    sinks = device_array((8,), numpy.float32)
    cuflash2.attention_with_kvcache(q, cache, cache, cache_seqlens=4000, sinks=sinks)
    launch, _, record = api_host.launches[-1]
    assert isinstance(launch.config, _configs.DecodeConfig)
    assert launch.config.features == _configs.FEATURE_SINKS
    assert record["mods"]["sinks"] == sinks.data.ptr
    if arch == 90:  # the clustered kernel of decode_cluster_config, sinks compiled in
        assert launch.cluster > 1
        assert launch.config == _configs.with_features(_dispatch.decode_cluster_config(
            "float16", 128, 90), _configs.FEATURE_SINKS)
    cuflash2.attention_with_kvcache(q, cache, cache, cache_seqlens=4000)
    assert api_host.launches[-1][0].config.features == 0


def test_a_latent_cache_is_refused_before_any_launch(api_host):
    """attention_with_kvcache with v_cache of a head dim of its own (MLA's latent cache, V the
    first d_v columns of K's rows) off sm_90: NotImplementedError naming the device; head dims
    other than MLA's 576 / 512: naming both head dims and the reference, which takes them;
    before anything launches (the MLA decode kernel's own plan: test_mla_decode_host.py)."""
    import cuflash2

    q = device_array((1, 1, 16, 576))
    latent = device_array((1, 64, 1, 576))
    count = len(api_host.launches)
    with pytest.raises(NotImplementedError, match=r"runs on sm_90 .* this device is sm_80"):
        cuflash2.attention_with_kvcache(q, latent, latent[..., :512], cache_seqlens=10)
    with pytest.raises(NotImplementedError, match=r"v_cache's head dim \(448\) apart from "
                                                  r"k_cache's \(576\).*reference"):
        cuflash2.attention_with_kvcache(q, latent, latent[..., :448], cache_seqlens=10)
    assert len(api_host.launches) == count


def test_packed_entry_points_take_the_programmable_modifiers(api_host):
    # qkvpacked / kvpacked forward and backward with a mask modifier run the kernels of the
    # unpacked call (the generated kernel, its configuration), reading q, k, v from the packed
    # array's own positions.
    import cuflash2

    mask = cuflash2.mask_mod("kv_idx <= q_idx + 3")
    qkv, dout = device_array((2, 100, 3, 4, 64)), device_array((2, 100, 4, 64))
    lse = device_array((2, 4, 100), numpy.float32)
    cuflash2.attention(*(qkv[:, :, i] for i in range(3)), mask_mod=mask)
    unpacked = api_host.launches[-1]
    cuflash2.attention_qkvpacked(qkv, mask_mod=mask)
    packed = api_host.launches[-1]
    assert packed[0].config == unpacked[0].config and "mods" in packed[0].config.name_expression
    assert packed[2]["base"]["q"] == qkv.data.ptr
    dqkv = cuflash2.attention_qkvpacked_backward(dout, qkv, dout, lse, mask_mod=mask)
    assert dqkv.shape == qkv.shape
    assert "mods" in api_host.launches[-2][0].config.name_expression
    kv = device_array((2, 120, 2, 2, 64))
    cuflash2.attention_kvpacked(dout, kv, mask_mod=mask)
    assert "mods" in api_host.launches[-1][0].config.name_expression
    dq, dkv = cuflash2.attention_kvpacked_backward(dout, dout, kv, dout, lse, mask_mod=mask)
    assert dq.shape == dout.shape and dkv.shape == kv.shape
    with pytest.raises(ValueError, match="score_mod .* has no derivative"):
        cuflash2.attention_qkvpacked_backward(dout, qkv, dout, lse,
                                              score_mod=cuflash2.score_mod("score * 2"))


@pytest.fixture
def hopper_api_host(api_host, monkeypatch):
    """api_host on sm_90 with the Hopper kernels on and a stand-in TMA encoder (a map's word 0
    its address, word 1 its box rows)."""
    from cuflash2 import _dispatch, _hopper

    api_host.set_arch(90)
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", True)
    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    monkeypatch.setattr(_hopper, "tensor_map_bytes", lambda x, rows: numpy.array(
        [x.data.ptr, rows] + [0] * 14, numpy.uint64).tobytes())
    return api_host


def test_a_bias_on_sm90_runs_the_hopper_kernels_with_its_tiles_and_dbias(hopper_api_host):
    # The bias alone on sm_90: the Hopper forward's and backward's mods kernels with the bias as
    # tiles, their map's address word the bias's, dbias's accumulator in BiasGrad (stand-ins for
    # the TMA encoder).
    import cuflash2

    hopper_api_host.cupy.broadcast_to = lambda x, shape: _DeviceArray(
        numpy.broadcast_to(x.array, shape))
    q, k, v = _forward_arrays(d=128)
    dout, lse = device_array(q.shape), device_array((2, 4, 100), numpy.float32)
    bias = device_array((1, 4, 100, 120))
    (kernel,) = cuflash2.forward_kernels(q, k, v, bias=bias)
    assert kernel.startswith("Hopper forward") and "bias tiles" in kernel, kernel
    cuflash2.attention(q, k, v, bias=bias)
    forward = hopper_api_host.launches[-1]
    assert int(numpy.ravel(forward[2]["bias_map"]["v"])[0]) == bias.data.ptr
    for grad in (False, True):
        kernels = cuflash2.backward_kernels(dout, q, k, v, dout, lse, bias=bias,
                                            bias_requires_grad=grad)
        assert "bias tiles" in kernels[1] and ("dbias" in kernels[1]) == grad, kernels
        cuflash2.attention_backward(dout, q, k, v, dout, lse, bias=bias,
                                    bias_requires_grad=grad)
        main = hopper_api_host.launches[-2]
        assert main[0].config.name_expression.startswith("flash_bwd_sm90_mods_kernel<")
        record = main[2]
        assert int(numpy.ravel(record["bias_map"]["v"])[0]) == bias.data.ptr
        assert (record["bias_batches"], record["bias_heads"]) == (1, 4)
        assert bool(record["dbias"]["data"]) == grad
        if grad:
            assert (record["dbias"]["stride0"], record["dbias"]["stride3"],
                    record["dbias"]["accumulate"]) == (0, 1, 1)


def test_a_mask_modifier_on_sm90_runs_the_hopper_backward_mods_kernel(hopper_api_host):
    # A mask modifier alone on sm_90: the Hopper backward's mods kernel, its inputs in
    # UserParams (stand-ins for the TMA encoder).
    import cuflash2

    q, k, v = _forward_arrays(d=128)
    dout, lse = device_array(q.shape), device_array((2, 4, 100), numpy.float32)
    doc = device_array((120,), numpy.int32)
    mask = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx]", doc=doc)
    kernels = cuflash2.backward_kernels(dout, q, k, v, dout, lse, mask_mod=mask)
    assert kernels[1].startswith("Hopper backward") and "mask_mod" in kernels[1], kernels
    cuflash2.attention_backward(dout, q, k, v, dout, lse, mask_mod=mask)
    launch, _, record = hopper_api_host.launches[-2]
    assert launch.config.name_expression.startswith("flash_bwd_sm90_mods_kernel<")
    assert launch.config.block_m == 64
    assert int(numpy.ravel(record["user"]["in0"]["data"])[0]) == doc.data.ptr
