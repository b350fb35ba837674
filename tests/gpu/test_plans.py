"""GPU tests of the per-signature plans and the launch paths (cuflash2/_plans.py, _launch.py).

A call whose arrays have the shapes, strides, dtypes and devices of a checked call, with the same
other arguments, reuses that call's plan: only its addresses are read (and their 16-byte
alignment checked) and its per-call values (dropout seed and offset) patched in. These tests
check that reuse gives the same results as a fresh check, that what may change between calls is
still checked, and that both launch paths (the driver's and CuPy's) agree bit for bit.
"""

import threading

import ml_dtypes
import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _launch, api, testing  # noqa: E402

pytestmark = pytest.mark.gpu

FP16 = numpy.dtype(numpy.float16)


def _qkv(shape, seed, dtype=FP16):
    return testing.random_qkv(cupy, *shape, dtype, seed)


def _same_bits(a, b):
    return bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def test_a_repeated_signature_reuses_its_plan_and_matches_a_fresh_check():
    q, k, v = _qkv((2, 200, 150, 4, 2, 64), 1)
    first, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    plans = len(api._forward_plans)
    for _ in range(3):
        again, lse_again = cuflash2.attention(q, k, v, causal=True, return_lse=True)
        assert _same_bits(first, again)
        assert bool((lse == lse_again).all())
    assert len(api._forward_plans) == plans
    # New arrays of the same signature: the plan reads their addresses.
    q2, k2, v2 = _qkv((2, 200, 150, 4, 2, 64), 2)
    got = cuflash2.attention(q2, k2, v2, causal=True)
    assert len(api._forward_plans) == plans
    assert all(r.ok for r in testing.check_forward(q2, k2, v2, got, None, causal=True))


def test_a_plan_hit_still_checks_alignment_and_a_new_signature_is_checked_in_full():
    base = cupy.zeros((1, 64, 2, 72), dtype=cupy.float16)
    aligned, shifted = base[..., :64], base[..., 1:65]
    assert aligned.strides == shifted.strides
    cuflash2.attention(aligned, aligned, aligned)
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        cuflash2.attention(shifted, aligned, aligned)
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        cuflash2.attention(aligned, aligned.astype(ml_dtypes.bfloat16), aligned)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash2.attention(aligned, aligned, aligned, causal=1)


def test_dropout_seed_and_offset_are_per_call_values():
    q, k, v = _qkv((1, 96, 96, 2, 2, 64), 3)
    a = cuflash2.attention(q, k, v, dropout_p=0.2, seed=1)
    b = cuflash2.attention(q, k, v, dropout_p=0.2, seed=2)
    c = cuflash2.attention(q, k, v, dropout_p=0.2, seed=1, offset=5)
    again = cuflash2.attention(q, k, v, dropout_p=0.2, seed=1)
    assert _same_bits(a, again)
    assert not _same_bits(a, b) and not _same_bits(a, c)
    with pytest.raises(TypeError, match="seed must be an int"):
        cuflash2.attention(q, k, v, dropout_p=0.2, seed=1.5)
    with pytest.raises(ValueError, match="offset must be in"):
        cuflash2.attention(q, k, v, dropout_p=0.0, offset=-1)


def test_packed_plans_read_their_parts_at_offsets():
    qkv = testing.random_qkv(cupy, 2, 130, 130, 3, 3, 64, FP16, 4)[0]
    packed = cupy.stack([qkv, qkv * 0.5, -qkv], axis=2)  # (b, s, 3, h, d)
    q, k, v = (cupy.ascontiguousarray(packed[:, :, i]) for i in range(3))
    for _ in range(2):  # the second call runs on the plan
        assert _same_bits(cuflash2.attention_qkvpacked(packed, causal=True),
                          cuflash2.attention(q, k, v, causal=True))
    out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.ones_like(out)
    want = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(2):
        dqkv = cuflash2.attention_qkvpacked_backward(dout, packed, out, lse, causal=True,
                                                     deterministic=True)
        for i in range(3):
            assert _same_bits(cupy.ascontiguousarray(dqkv[:, :, i]), want[i])


def test_backward_plans_allocate_only_missing_gradients():
    q, k, v = _qkv((1, 80, 80, 2, 1, 64), 5)
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    dout = cupy.ones_like(out)
    want = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=True)
    dk = cupy.full_like(k, 7)
    for _ in range(2):
        got = cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=True, dk=dk)
        assert got[1] is dk
        for g, w in zip(got, want):
            assert _same_bits(g, w)


def test_many_threads_on_one_plan():
    """The parameter block of a plan is patched per call: threads sharing a plan must not see
    each other's pointers."""
    inputs = [_qkv((1, 64, 64, 2, 2, 64), 10 + i) for i in range(8)]
    want = [cuflash2.attention(*x) for x in inputs]
    cupy.cuda.Device().synchronize()
    got = [None] * len(inputs)

    def work(i):
        with cupy.cuda.Device(0):
            for _ in range(20):
                got[i] = cuflash2.attention(*inputs[i])
            cupy.cuda.get_current_stream().synchronize()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        assert _same_bits(g, w)


def test_batches_beyond_one_grid_are_launched_in_slices():
    batch = _launch.MAX_GRID_Z + 3
    q, k, v = _qkv((batch, 3, 5, 1, 1, 32), 6)
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    assert all(r.ok for r in testing.check_forward(q, k, v, out, lse))
    dout = cupy.ones_like(out)
    dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse)
    assert all(r.ok for r in testing.check_backward(dout, q, k, v, dq, dk, dv))


@pytest.mark.parametrize("method", ["libcuda", "bindings", "cupy"])
def test_every_launch_path_gives_the_same_bits(method, monkeypatch):
    if method == "libcuda" and _launch._libcuda_launch is None:
        pytest.skip("libcuda.so.1 not loadable")
    if method == "bindings" and _launch._bindings is None:
        pytest.skip("cuda-bindings not installed")
    q, k, v = _qkv((2, 150, 150, 4, 2, 64), 7)
    cache = testing.random_qkv(cupy, 2, 1, 4096, 8, 2, 128, FP16, 8)
    kwargs = dict(cache_seqlens=4000, num_splits=4, causal=True)
    fwd = cuflash2.attention(q, k, v, causal=True)
    out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    bwd = cuflash2.attention_backward(cupy.ones_like(out), q, k, v, out, lse, causal=True,
                                      deterministic=True)
    dec = cuflash2.attention_with_kvcache(cache[0], cache[1], cache[2], **kwargs)
    from cuflash2 import _kvcache

    monkeypatch.setattr(_launch, "METHOD", method)
    for cache_of_plans in (api._forward_plans, api._backward_plans, _kvcache._plans_by_key):
        monkeypatch.setattr(cache_of_plans, "plans", {})
    assert _same_bits(fwd, cuflash2.attention(q, k, v, causal=True))
    got = cuflash2.attention_backward(cupy.ones_like(out), q, k, v, out, lse, causal=True,
                                      deterministic=True)
    for g, w in zip(got, bwd):
        assert _same_bits(g, w)
    assert _same_bits(dec, cuflash2.attention_with_kvcache(cache[0], cache[1], cache[2],
                                                           **kwargs))


def _plan_of_last_forward():
    return next(reversed(api._forward_plans.plans.values()))


@pytest.mark.parametrize("graphs", [True, False])
def test_graph_replays_and_single_launches_give_the_same_bits(graphs, monkeypatch):
    """A plan replays its launches as one CUDA graph (cuflash2/_launch.py, LaunchGraphs) or
    launches them one by one: same bits, for every plan kind (the backward's three kernels, the
    decode kernel with its split merge)."""
    if graphs and not _launch.graphs_available():
        pytest.skip("no graph launches on this launch path")
    from cuflash2 import _kvcache

    q, k, v = _qkv((2, 150, 170, 4, 2, 64), 21)
    cache = testing.random_qkv(cupy, 2, 1, 4096, 8, 2, 128, FP16, 22)
    out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    dout = cupy.ones_like(out)
    bwd = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    decodes = {n: cuflash2.attention_with_kvcache(cache[0], cache[1], cache[2],
                                                  cache_seqlens=4000, num_splits=n)
               for n in (1, 4, 32)}
    monkeypatch.setattr(_launch, "GRAPHS", graphs)
    for cache_of_plans in (api._forward_plans, api._backward_plans, _kvcache._plans_by_key):
        monkeypatch.setattr(cache_of_plans, "plans", {})
    got, got_lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    assert (_plan_of_last_forward().graphs is not None) == graphs
    assert _same_bits(got, out) and bool((got_lse == lse).all())
    for _ in range(2):  # the second call replays the graph (parameters set where changed)
        got = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True,
                                          deterministic=True)
        for g, w in zip(got, bwd):
            assert _same_bits(g, w)
    for n, want in decodes.items():
        assert _same_bits(want, cuflash2.attention_with_kvcache(
            cache[0], cache[1], cache[2], cache_seqlens=4000, num_splits=n))


def test_calls_on_two_streams_replay_their_own_graphs():
    if not _launch.graphs_available():
        pytest.skip("no graph launches on this launch path")
    inputs = [_qkv((1, 300, 300, 4, 4, 64), 30 + i) for i in range(2)]
    want = [cuflash2.attention(*x) for x in inputs]
    plan = _plan_of_last_forward()
    cupy.cuda.Device().synchronize()  # the inputs, made on the null stream
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in inputs]
    got = [None, None]
    for _ in range(3):
        for i, stream in enumerate(streams):
            with stream:
                got[i] = cuflash2.attention(*inputs[i])
    for stream in streams:
        stream.synchronize()
    assert all(s.ptr in plan.graphs.by_stream for s in streams)
    for g, w in zip(got, want):
        assert _same_bits(g, w)


def test_a_call_captured_in_a_graph_records_its_kernels():
    """A stream being captured gets plain launches (a plan's own graph is not what the
    capture records), and replaying the captured graph gives the call's results again."""
    from cuflash2.bench.decode_graph import CapturedGraph

    q, k, v = _qkv((1, 200, 200, 4, 2, 64), 40)
    dout = cupy.ones_like(q)
    want, lse = cuflash2.attention(q, k, v, return_lse=True)
    want_grads = cuflash2.attention_backward(dout, q, k, v, want, lse, deterministic=True)
    plan = _plan_of_last_forward()
    stream = cupy.cuda.Stream(non_blocking=True)
    captured = {}

    def record():
        out, lse_c = cuflash2.attention(q, k, v, return_lse=True)
        captured["out"] = out
        captured["grads"] = cuflash2.attention_backward(dout, q, k, v, out, lse_c,
                                                        deterministic=True)

    cupy.cuda.Device().synchronize()  # the inputs, made on the null stream
    graph = CapturedGraph(cupy, stream, record)
    if plan.graphs is not None:
        assert stream.ptr not in plan.graphs.by_stream
    for _ in range(2):
        with stream:
            captured["out"].fill(0)
        graph.launch()
        stream.synchronize()
        assert _same_bits(captured["out"], want)
        for g, w in zip(captured["grads"], want_grads):
            assert _same_bits(g, w)


def test_calls_queued_behind_a_busy_stream_keep_their_own_parameters():
    """Each call sets its graph's node parameters again while the earlier calls' launches of
    that graph are still queued (the stream spins first): every call must still read its own
    inputs and write its own outputs."""
    from busy_stream import spin  # tests/gpu helper

    inputs = [_qkv((1, 180, 180, 4, 2, 64), 50 + i) for i in range(6)]
    grads_in = []
    want, want_grads = [], []
    for q, k, v in inputs:
        out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
        dout = cupy.ones_like(out)
        want.append(out)
        grads_in.append((dout, out, lse))
        want_grads.append(cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                      deterministic=True))
    cupy.cuda.Device().synchronize()  # the inputs, made on the null stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash2.attention(*inputs[0], causal=True)  # the stream's graphs exist before the spin
        cuflash2.attention_backward(*grads_in[0][:1], *inputs[0], *grads_in[0][1:], causal=True,
                                    deterministic=True)
        stream.synchronize()
        spin(0.05)
        got = [cuflash2.attention(q, k, v, causal=True) for q, k, v in inputs]
        got_grads = [cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                 deterministic=True)
                     for (q, k, v), (dout, out, lse) in zip(inputs, grads_in)]
    assert not stream.done  # the calls were queued behind the spin
    stream.synchronize()
    for g, w in zip(got, want):
        assert _same_bits(g, w)
    for gs, ws in zip(got_grads, want_grads):
        for g, w in zip(gs, ws):
            assert _same_bits(g, w)
