"""Argument validation (CPU): each bad input gets a clear error naming the argument."""

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import _validate
from test_plans_host import api_host, launches  # noqa: F401  (fixtures)


def arrays(b=2, sq=5, sk=7, h=4, hk=2, d=64, dtype=np.float16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    return q, k, v


def check(q, k, v, **kw):
    return _validate.check_attention_inputs(q, k, v, **kw)


def test_valid_problem_sizes():
    q, k, v = arrays()
    p = check(q, k, v)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.head_dim) == (2, 5, 7, 4, 2, 64)
    assert p.dtype == "float16" and p.batched and p.softmax_scale == pytest.approx(1 / 8)
    p = check(q[0], k[0], v[0], softmax_scale=0.5)
    assert p.batch == 1 and not p.batched and p.softmax_scale == 0.5
    p = check(*arrays(dtype=ml_dtypes.bfloat16))
    assert p.dtype == "bfloat16"


def test_numpy_input_gets_a_hint():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"q is a numpy array.*cupy\.asarray\(q\).*"
                                        r"cuflash2\.reference\.attention to compute"):
        cuflash2.attention(q, k, v)
    # Each entry point names its own reference function, before CuPy is imported.
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    with pytest.raises(TypeError, match=r"dout is a numpy array.*"
                                        r"cuflash2\.reference\.attention_backward to compute"):
        cuflash2.attention_backward(q, q, k, v, q, lse)
    with pytest.raises(TypeError, match=r"q is a numpy array.*"
                                        r"cuflash2\.reference\.attention_with_kvcache to compute"):
        cuflash2.attention_with_kvcache(q, k, v)


@pytest.mark.parametrize("bad,pattern", [
    (np.float64, r"q must be float16, bfloat16 .* or float32.*float64"),
    (np.int32, r"q must be float16, bfloat16 .* or float32.*int32"),
])
def test_unsupported_dtype(bad, pattern):
    q, k, v = arrays()
    with pytest.raises(TypeError, match=pattern):
        check(q.astype(bad), k, v)


@pytest.mark.parametrize("fp8", [np.uint8, ml_dtypes.float8_e4m3fn])
def test_fp8_inputs_say_what_exists_rather_than_suggest_a_cast(fp8):
    # A cast of e4m3 bits to float would read them as integers: the message points at the FP8
    # cache and at dequantising instead.
    q, k, v = arrays()
    for name, args in (("q", (q.astype(fp8), k, v)), ("k", (q, k.astype(fp8), v))):
        with pytest.raises(TypeError) as raised:
            check(*args)
        message = str(raised.value)
        assert message.startswith(f"{name} is {np.dtype(fp8)}: FP8 (e4m3)"), message
        assert "kv_cache_dtype='e4m3'" in message and "dequantize_e4m3" in message
        assert "Cast explicitly" not in message


def test_mixed_dtypes():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k must have the same dtype as q \(float16\); got bfloat16"):
        check(q, k.astype(ml_dtypes.bfloat16), v)
    with pytest.raises(TypeError, match=r"v must have the same dtype as q"):
        check(q, k, v.astype(ml_dtypes.bfloat16))


def test_wrong_ndim():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"q must have 4 dims .* or 3 dims .*got shape \(10, 256\)"):
        check(q.reshape(10, 256), k, v)
    with pytest.raises(ValueError, match=r"k must have the same number of dims as q \(4"):
        check(q, k[0], v)


def test_mismatched_batch_headdim_seqlen_k():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"same batch size"):
        check(q, k[:1], v[:1])
    _, k2, v2 = arrays(d=32)
    with pytest.raises(ValueError, match=r"k must have the same headdim as q \(64\)"):
        check(q, k2, v2)
    with pytest.raises(ValueError, match=r"v must have the shape of k .* but for its head dim"):
        check(q, k, v[:, :3])
    # v's own head dim (d_v != d_qk) passes the checks; out takes it
    assert check(q, k, v2).head_dim_v == 32 and check(q, k, v).head_dim_v == 64
    with pytest.raises(ValueError, match=r"headdim must be a multiple of 8 .* got 12 \(v shape"):
        check(q, k, v2[..., :12])


def test_heads_not_divisible():
    q, k, v = arrays(h=5, hk=2)
    with pytest.raises(ValueError, match=r"query heads \(5\) must be a multiple .* key/value heads \(2\)"):
        check(q, k, v)


@pytest.mark.parametrize("d", [12, 4, 264, 512])
def test_bad_head_dim(d):
    q, k, v = arrays(d=d)
    with pytest.raises(ValueError, match=rf"headdim must be a multiple of 8 between 8 and 256; got {d}"):
        check(q, k, v)


def test_last_dim_not_contiguous():
    q, k, v = arrays()
    q_t = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, 1, 3)), 1, 3)  # headdim stride != 1
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dim"):
        check(q_t, k, v)


def test_strided_inputs_are_accepted():
    q, k, v = arrays(h=8, hk=4)
    p = check(q[:, ::2, 1:5], k[:, :, 1:3], v[:, :, ::2])
    assert (p.seqlen_q, p.nheads, p.nheads_kv) == (3, 4, 2)


def test_unaligned_stride():
    q = np.zeros((2, 5, 4, 72), np.float16)[..., :64]  # row stride 288 elems: fine
    check(q, *arrays(sq=5)[1:])
    big = np.zeros((2, 5, 4 * 64 + 4), np.float16)  # rows 260 elements apart
    q_odd = np.lib.stride_tricks.as_strided(
        big, shape=(2, 5, 4, 64), strides=(big.strides[0], big.strides[1], 128, 2))
    with pytest.raises(ValueError, match=r"q stride of dim 0 must be a multiple of 8 elements"):
        check(q_odd, *arrays(sq=5)[1:])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive finite float"):
        check(*arrays(), softmax_scale=scale)


def test_softmax_scale_type():
    with pytest.raises(TypeError, match=r"softmax_scale must be a positive float or None"):
        check(*arrays(), softmax_scale="0.1")
    assert check(*arrays(), softmax_scale=np.float32(0.25)).softmax_scale == 0.25


def test_wrong_out():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"out must have the shape of q"):
        check(q, k, v, out=np.empty((2, 5, 4, 32), np.float16))
    with pytest.raises(TypeError, match=r"out must have the same dtype as q"):
        check(q, k, v, out=np.empty(q.shape, ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match=r"out must be float16, bfloat16"):
        check(q, k, v, out=np.empty(q.shape, np.float64))
    with pytest.raises(TypeError, match=r"out must have the same dtype as q \(float16\); got float32"):
        check(q, k, v, out=np.empty(q.shape, np.float32))


def test_zero_size_shapes_are_valid():
    for b, sq, sk in [(0, 5, 7), (2, 0, 7), (2, 5, 0)]:
        p = check(*arrays(b=b, sq=sq, sk=sk))
        assert (p.batch, p.seqlen_q, p.seqlen_k) == (b, sq, sk)


@pytest.mark.parametrize("window,causal,expected", [
    ((-1, -1), False, (-1, -1)),
    ((-1, -1), True, (-1, 0)),
    ((16, 0), True, (16, 0)),
    ((8, 4), False, (8, 4)),
    ((0, 0), False, (0, 0)),
    ((1000, 5), False, (-1, 5)),  # an edge beyond both sequences is no edge
    ((np.int64(3), -1), False, (3, -1)),
])
def test_window(window, causal, expected):
    assert _validate.check_window(window, causal, 100, 200) == expected


@pytest.mark.parametrize("window,causal,exc,pattern", [
    ((8, 4), True, ValueError, r"causal=True already fixes the window's right edge"),
    ((-2, 0), False, ValueError, r"window_size left must be >= -1"),
    ((0, -5), False, ValueError, r"window_size right must be >= -1"),
    ((1.5, 0), False, TypeError, r"window_size left must be an int"),
    ((True, 0), False, TypeError, r"window_size left must be an int"),
    (8, False, TypeError, r"window_size must be a pair"),
    ((1, 2, 3), False, TypeError, r"window_size must be a pair"),
])
def test_bad_window(window, causal, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _validate.check_window(window, causal, 100, 200)


def test_packed_numpy_input_gets_a_hint():
    qkv = np.zeros((1, 8, 3, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"qkv is a numpy array.*cupy\.asarray\(qkv\)"):
        cuflash2.attention_qkvpacked(qkv)
    with pytest.raises(TypeError, match=r"kv is a numpy array"):
        cuflash2.attention_kvpacked(np.zeros((1, 8, 2, 64), np.float16),
                                    np.zeros((1, 8, 2, 2, 64), np.float16))


# softcap / ALiBi (checked before any launch; the GPU tests check the API raises them)


@pytest.mark.parametrize("softcap,expected", [(0, 0.0), (0.0, 0.0), (30, 30.0), (2.5, 2.5)])
def test_softcap(softcap, expected):
    assert _validate.check_softcap(softcap) == expected


@pytest.mark.parametrize("softcap,exc", [(-1.0, ValueError), (float("nan"), ValueError),
                                         (float("inf"), ValueError), ("2", TypeError),
                                         (True, TypeError), (None, TypeError)])
def test_bad_softcap(softcap, exc):
    with pytest.raises(exc, match="softcap"):
        _validate.check_softcap(softcap)


def test_alibi_slopes_strides():
    assert _validate.check_alibi_slopes(None, 2, 4, True) is None
    assert _validate.check_alibi_slopes(np.ones(4, np.float32), 2, 4, True) == 0
    assert _validate.check_alibi_slopes(np.ones((2, 4), np.float32), 2, 4, True) == 4
    padded = np.ones((2, 8), np.float32)[:, :4]  # rows 8 floats apart
    assert _validate.check_alibi_slopes(padded, 2, 4, True) == 8
    assert _validate.check_alibi_slopes(np.ones((1, 4), np.float32), 1, 4, False) == 0


@pytest.mark.parametrize("slopes,exc,pattern", [
    (np.ones(4, np.float64), TypeError, "float32"),
    ([0.5] * 4, TypeError, "float32 array"),
    (np.ones(5, np.float32), ValueError, r"\(nheads,\) or \(batch, nheads\) = \(4,\) or \(2, 4\)"),
    (np.ones((3, 4), np.float32), ValueError, "got \\(3, 4\\)"),
    (np.ones(8, np.float32)[::2], ValueError, "contiguous along heads"),
])
def test_bad_alibi_slopes(slopes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _validate.check_alibi_slopes(slopes, 2, 4, True)


# Learnable attention sinks: float32 (nheads,), contiguous, a CuPy array on the call's device


def test_sinks():
    _validate.check_sinks(None, 4)
    _validate.check_sinks(np.zeros(4, np.float32), 4)
    _validate.check_sinks(np.zeros(2, np.float32)[:1], 1)  # one head: any stride


@pytest.mark.parametrize("sinks,exc,pattern", [
    (np.zeros(4, np.float64), TypeError, r"sinks must be a float32 array .*got dtype float64"),
    (np.zeros(4, np.float16), TypeError, r"sinks must be a float32 array"),
    ([0.0] * 4, TypeError, r"sinks must be a float32 array .*got list"),
    (np.zeros(5, np.float32), ValueError, r"sinks must have shape \(nheads,\) = \(4,\).*got \(5,\)"),
    (np.zeros((2, 4), np.float32), ValueError, r"sinks must have shape \(nheads,\)"),
    (np.zeros(8, np.float32)[::2], ValueError, r"sinks must be contiguous"),
])
def test_bad_sinks(sinks, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _validate.check_sinks(sinks, 4)


def test_score_mods_read_the_options():
    from cuflash2 import _configs, _prepare
    from cuflash2._options import AttentionOptions

    problem = check(*arrays())
    mods = _prepare.score_mods(problem, AttentionOptions(sinks=np.zeros(4, np.float32)))
    assert mods.features == _configs.FEATURE_SINKS
    mods = _prepare.score_mods(problem, AttentionOptions(
        softcap=30.0, alibi_slopes=np.zeros(4, np.float32), sinks=np.zeros(4, np.float32)))
    assert mods.features == (_configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI
                             | _configs.FEATURE_SINKS)
    with pytest.raises(ValueError, match=r"sinks must have shape \(nheads,\) = \(4,\)"):
        _prepare.score_mods(problem, AttentionOptions(sinks=np.zeros(2, np.float32)))
    assert "sinks=None" in repr(AttentionOptions())


@pytest.mark.parametrize("entry", ["attention", "attention_with_kvcache", "forward_kernels"])
def test_wrong_sinks_are_named_before_any_launch(api_host, entry):
    """Through the public functions (on the CuPy stand-in of tests/test_plans_host.py): the
    NumPy hint, other types, dtype, shape, strides and device, each naming sinks."""
    from test_plans_host import device_array

    q = device_array((2, 5, 4, 64))
    kv = device_array((2, 7, 2, 64))

    def call(sinks):
        if entry == "attention_with_kvcache":
            return cuflash2.attention_with_kvcache(q, kv, kv, cache_seqlens=3, sinks=sinks)
        return getattr(cuflash2, entry)(q, kv, kv, sinks=sinks)

    cases = [
        (np.zeros(4, np.float32), TypeError, r"sinks is a numpy array.*cupy\.asarray\(sinks\)"),
        ([0.0] * 4, TypeError, r"sinks must be a cupy\.ndarray; got list"),
        (device_array((4,), np.float64), TypeError, r"sinks must be a float32 array"),
        (device_array((2,), np.float32), ValueError, r"sinks must have shape \(nheads,\) = \(4,\)"),
        (device_array((8,), np.float32)[::2], ValueError, r"sinks must be contiguous"),
        (device_array((4,), np.float32, device=1), ValueError,
         r"sinks is on device 1 but the current CuPy device is 0"),
    ]
    for sinks, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call(sinks)
    assert not api_host.launches
    call(device_array((4,), np.float32))  # and right ones pass
    assert len(api_host.launches) == (0 if entry == "forward_kernels" else 1)
