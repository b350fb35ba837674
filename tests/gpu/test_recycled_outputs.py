"""GPU tests of reused outputs (cuflash2/_recycle.py): a call may write into, and return, an
earlier output of its plan that nothing references any more; never one that something still
holds (the array, a view of it, its pointer), never one made on another stream or during a
stream capture, and never with a shape that was changed in place."""

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _recycle, api, testing  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _recycle.ENABLED,
                                                  reason="output reuse is off here")]

FP16 = numpy.dtype(numpy.float16)
SHAPE = (1, 96, 80, 4, 2, 64)


def _inputs(seed):
    return testing.random_qkv(cupy, *SHAPE, FP16, seed)


def _want(q, k, v):
    out = cupy.empty_like(q)  # given outputs are never reused
    return cuflash2.attention(q, k, v, causal=True, out=out)


def _call(q, k, v):
    return cuflash2.attention(q, k, v, causal=True)


def _same(a, b):
    return bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def test_an_output_nothing_holds_is_reused_with_the_new_call_s_results():
    inputs = [_inputs(s) for s in range(3)]
    wants = [_want(*x) for x in inputs]
    first = _call(*inputs[0])
    first_id = id(first)
    del first
    again = _call(*inputs[1])
    assert id(again) == first_id  # the same array object, written again
    assert _same(again, wants[1])
    # Rebinding in a loop: the old result is alive during the call; results stay right.
    out = None
    for i in range(6):
        out = _call(*inputs[i % 3])
        assert _same(out, wants[i % 3])


def test_held_outputs_views_and_pointers_are_never_written_again():
    inputs = [_inputs(10 + s) for s in range(4)]
    wants = [_want(*x) for x in inputs]
    held = _call(*inputs[0])
    view = _call(*inputs[1])[0, 5:]  # only a view of the output survives
    result = _call(*inputs[2])
    pointer, shape = result.data, result.shape  # only its MemoryPointer survives
    del result
    for _ in range(4):
        _call(*inputs[3])
    cupy.cuda.Device().synchronize()
    assert _same(held, wants[0])
    assert _same(view, wants[1][0, 5:])
    assert _same(cupy.ndarray(shape, FP16, pointer), wants[2])


def test_an_output_reshaped_in_place_is_not_handed_out_with_its_new_shape():
    q, k, v = _inputs(20)
    for _ in range(3):
        out = _call(q, k, v)
        assert out.shape == q.shape
        out.shape = (q.shape[1], -1)
        del out


def test_lse_and_out_are_reused_together_only():
    q, k, v = _inputs(30)
    want, want_lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    del out  # lse still held: neither is reused
    q2, k2, v2 = _inputs(31)
    out2, lse2 = cuflash2.attention(q2, k2, v2, causal=True, return_lse=True)
    cupy.cuda.Device().synchronize()
    assert bool((lse == want_lse).all())
    assert _same(out2, _want(q2, k2, v2))


def test_outputs_stay_on_their_stream():
    q, k, v = _inputs(40)
    want = _want(q, k, v)
    cupy.cuda.Device().synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    ids = {}
    for stream in streams:
        with stream:
            for _ in range(3):
                out = _call(q, k, v)
                ids.setdefault(stream.ptr, set()).add(id(out))
                del out
    assert not ids[streams[0].ptr] & ids[streams[1].ptr]
    for stream in streams:
        stream.synchronize()
    with streams[1]:
        out = _call(q, k, v)
    streams[1].synchronize()
    assert _same(out, want)


def test_outputs_made_during_a_capture_are_not_reused():
    from cuflash2.bench.decode_graph import CapturedGraph

    q, k, v = _inputs(50)
    want = _want(q, k, v)
    plan = next(reversed(api._forward_plans.plans.values()))
    stream = cupy.cuda.Stream(non_blocking=True)
    captured = {}
    cupy.cuda.Device().synchronize()
    graph = CapturedGraph(cupy, stream, lambda: captured.update(out=_call(q, k, v)))
    kept = {id(x) for slots in plan.recycled.kept.values() for r in slots for x in r.arrays}
    assert id(captured["out"]) not in kept
    with stream:
        eager = _call(*_inputs(51))
    graph.launch()
    stream.synchronize()
    assert _same(captured["out"], want)
    assert _same(eager, _want(*_inputs(51)))


def test_decode_outputs_are_reused_and_right():
    batch, cache_len = 2, 700
    _, k_cache, v_cache = testing.random_qkv(cupy, batch, 1, 1024, 8, 2, 128, FP16, 60)
    q = testing.random_qkv(cupy, batch, 1, 1, 8, 2, 128, FP16, 61)[0]
    want = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_len,
                                           causal=True).copy()
    ids = set()
    for _ in range(4):
        out = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_len,
                                              causal=True)
        assert _same(out, want)
        ids.add(id(out))
        del out
    assert len(ids) < 4
