"""Signature keys of the entry points (api._forward_key, _kvcache._key), without a GPU.

A plan is reused only for a call whose key equals that of a fully checked call, so the key must
hold everything the checks depend on: every array's shape, strides, dtype and device, the
current device, and each other argument with its type (1 is not True). Per-call values (an int
cache_seqlens, dropout seeds) must stay out of it. A stand-in provides the two CuPy names the
keys use (`ndarray`, `cuda.runtime.getDevice`).
"""

import types

import numpy

from cuflash2 import _kvcache, _plans, api
from cuflash2._options import AttentionOptions


class _Array:
    def __init__(self, shape, strides=None, dtype="float16", device=0):
        self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
        itemsize = self.dtype.itemsize
        if strides is None:
            strides, size = [], itemsize
            for dim in reversed(shape):
                strides.insert(0, size)
                size *= dim
        self.strides = tuple(strides)
        self.data = types.SimpleNamespace(device_id=device, ptr=0x1000)


def _cupy(device=0):
    runtime = types.SimpleNamespace(getDevice=lambda: device)
    return types.SimpleNamespace(ndarray=_Array, cuda=types.SimpleNamespace(runtime=runtime))


def _key(cupy=None, arrays=None, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
         dropout_p=0.0, seed=None, offset=0):
    """attention's key: `arrays` its input tuple (q, k, v, out, alibi_slopes, sinks)."""
    q = _Array((2, 64, 4, 64))
    arrays = arrays if arrays is not None else (q, q, q, None, None, None)
    options = AttentionOptions(causal, softmax_scale, window, softcap, arrays[4], arrays[5],
                               dropout_p, seed, offset)
    return api._forward_key("attention", cupy or _cupy(), arrays, options)


def test_equal_calls_have_equal_keys_and_the_key_is_hashable():
    assert _key() == _key()
    hash(_key())


def test_every_array_property_and_the_current_device_enter_the_key():
    q = _Array((2, 64, 4, 64))
    base = _key(arrays=(q, q, q, None, None, None))
    assert _key(arrays=(_Array((2, 64, 4, 64), dtype="float32"), q, q, None, None, None)) != base
    assert _key(arrays=(_Array((2, 64, 4, 64), strides=(65536, 1024, 128, 2)), q, q, None,
                        None, None)) != base
    assert _key(arrays=(_Array((2, 65, 4, 64)), q, q, None, None, None)) != base
    assert _key(arrays=(_Array((2, 64, 4, 64), device=1), q, q, None, None, None)) != base
    assert _key(arrays=(q, q, q, q, None, None)) != base  # out given
    assert _key(cupy=_cupy(device=1), arrays=(q, q, q, None, None, None)) != base


def test_sinks_enter_the_key_like_alibi_slopes():
    """Sinks (an array argument) enter with their shape, strides, dtype and device, and apart
    from ALiBi slopes of the same signature."""
    q = _Array((2, 64, 4, 64))
    sinks = _Array((4,), dtype="float32")
    base = _key(arrays=(q, q, q, None, None, None))
    with_sinks = _key(arrays=(q, q, q, None, None, sinks))
    assert with_sinks != base and with_sinks == _key(arrays=(q, q, q, None, None, sinks))
    assert with_sinks != _key(arrays=(q, q, q, None, sinks, None))  # ALiBi slopes instead
    for other in (_Array((4,), dtype="float64"), _Array((8,), dtype="float32"),
                  _Array((4,), strides=(8,), dtype="float32"),
                  _Array((4,), dtype="float32", device=1)):
        assert _key(arrays=(q, q, q, None, None, other)) != with_sinks
    hash(with_sinks)
    assert _key(arrays=(q, q, q, None, None, numpy.zeros(4, numpy.float32))) is None


def test_seed_and_offset_are_per_call_values():
    assert _key(dropout_p=0.1, seed=1, offset=5) == _key(dropout_p=0.1, seed=2)


def test_arguments_enter_the_key_with_their_types():
    assert _key(causal=True) != _key(causal=1)
    assert _key(causal=True) != _key(causal=False)
    assert _key(window=(True, -1)) != _key(window=(1, -1))
    assert _key(window=(128, 0)) != _key(window=(-1, -1))
    assert _key(window=[-1, -1]) == _key(window=(-1, -1))  # both valid, same meaning
    assert _key(softmax_scale=0.125) != _key(softmax_scale=None)
    assert _key(softcap=1) != _key(softcap=1.0)
    assert _key(dropout_p=0.1) != _key()


def test_calls_without_a_signature_are_checked_in_full():
    q = _Array((2, 64, 4, 64))
    assert _key(arrays=(numpy.zeros((2, 64, 4, 64)), q, q, None, None, None)) is None
    assert _key(window=5) is None  # not a pair: the full check raises
    assert api._forward_key("attention", None, (q,), AttentionOptions()) is None
    unhashable = _key(softmax_scale=[0.1])
    assert _plans.PlanCache().get(unhashable) is None


def _kv_key(cache_seqlens, cupy=None, **kwargs):
    q = _Array((2, 1, 8, 128))
    cache = _Array((2, 1024, 2, 128))
    arguments = dict(k=None, v=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                     causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     sinks=None, num_splits=0, early_cache_reads=False)
    arguments.update(kwargs)
    a = arguments
    options = AttentionOptions(a["causal"], a["softmax_scale"], a["window_size"], a["softcap"],
                               a["alibi_slopes"], a["sinks"])
    return _kvcache._key(cupy or _cupy(), q, cache, cache, a["k"], a["v"], cache_seqlens,
                         a["cache_batch_idx"], a["block_table"], options, a["num_splits"],
                         a["early_cache_reads"])


def test_an_int_cache_length_is_a_per_call_value_an_array_is_part_of_the_key():
    assert _kv_key(100) == _kv_key(2000)  # the value goes to the kernel per call
    lengths = _Array((2,), dtype="int32")
    assert _kv_key(lengths) != _kv_key(100)
    assert _kv_key(lengths) != _kv_key(None)
    assert _kv_key(_Array((3,), dtype="int32")) != _kv_key(lengths)
    assert _kv_key(100, num_splits=4) != _kv_key(100)
    assert _kv_key(100, causal=1) != _kv_key(100)
    assert _kv_key(100, early_cache_reads=True) != _kv_key(100)
    assert _kv_key(100, early_cache_reads=1) != _kv_key(100, early_cache_reads=True)
    assert _kv_key([100, 100]) is None  # not a CuPy array: checked in full
    sinks = _Array((8,), dtype="float32")
    assert _kv_key(100, sinks=sinks) != _kv_key(100)
    assert _kv_key(100, sinks=sinks) != _kv_key(100, alibi_slopes=sinks)
    assert _kv_key(100, sinks=_Array((8,), dtype="float32", device=1)) != _kv_key(100,
                                                                                  sinks=sinks)


def test_options_keywords_and_replace():
    """keywords() gives back what differs from the defaults (the benchmarks' calls), replace()
    a changed copy (the reference's per-sequence options); the original is left as it was."""
    assert AttentionOptions().keywords() == {}
    options = AttentionOptions(causal=True, window_size=(8, 0))
    assert options.keywords() == {"causal": True, "window_size": (8, 0)}
    slopes = numpy.ones(4, numpy.float32)
    changed = options.replace(alibi_slopes=slopes)
    assert changed.keywords() == {"causal": True, "window_size": (8, 0), "alibi_slopes": slopes}
    assert options.alibi_slopes is None
