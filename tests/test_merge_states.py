"""cuflash2.merge_states / merge_states_many without a GPU: the reference's maths against
attention over all of the keys (float64, tests/naive_attention.py), rows without keys, the
checks and their messages, and what a call launches (the kernel, its grid, every field of the
parameter struct: tests/test_plans_host.py's CuPy stand-in)."""

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import _configs, _merge, reference
from naive_attention import naive_attention
from test_plans_host import _DeviceArray, api_host, device_array, launches  # noqa: F401

# ---------------------------------------------------------------------------------------------
# The reference's maths


def _split_problem(seed=0, batch=2, seqlen_q=6, seqlen_k=11, nheads=3, d=8):
    """q, k, v and a visibility mask with rows that see no key at all, and a random partition
    of the keys into three disjoint sets (some rows see no key of a set)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, nheads, d))
    k = rng.standard_normal((batch, seqlen_k, nheads, d))
    v = rng.standard_normal((batch, seqlen_k, nheads, d))
    visible = rng.random((batch, nheads, seqlen_q, seqlen_k)) < 0.6
    visible[:, :, 0] = False  # rows that see no key
    visible[0, 1, 2] = False
    part = rng.integers(0, 3, (batch, nheads, seqlen_q, seqlen_k))
    part[:, :, 1, :] = 2  # rows whose keys all fall in one set
    return q, k, v, visible, part


def test_reference_merge_of_split_keys_is_attention_over_all_keys():
    q, k, v, visible, part = _split_problem()
    full_out, full_lse = naive_attention(q, k, v, mask=visible)
    halves = [naive_attention(q, k, v, mask=visible & (part == 0)),
              naive_attention(q, k, v, mask=visible & (part != 0))]
    out, lse = reference.merge_states(halves[0][0], halves[0][1], halves[1][0], halves[1][1])
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, full_out, rtol=1e-12, atol=1e-13)
    assert np.array_equal(np.isinf(lse), np.isinf(full_lse)) and (lse[np.isinf(lse)] > 0).all()
    np.testing.assert_allclose(lse[np.isfinite(lse)], full_lse[np.isfinite(full_lse)],
                               rtol=1e-13)
    assert (out[:, 0] == 0).all()  # rows without keys: 0, as attention writes them

    thirds = [naive_attention(q, k, v, mask=visible & (part == s)) for s in (2, 0, 1)]
    outs = np.stack([o for o, _ in thirds])
    lses = np.stack([lse for _, lse in thirds])
    out3, lse3 = reference.merge_states_many(outs, lses)
    np.testing.assert_allclose(out3, full_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse3, full_lse, rtol=1e-13)
    out1, lse1 = reference.merge_states_many(outs[:1], lses[:1])  # one state: itself
    np.testing.assert_array_equal(out1, outs[0])
    np.testing.assert_array_equal(lse1, lses[0])


def test_reference_merge_of_a_split_key_sequence_matches_one_attention_call():
    """The README's use: keys[:s] and keys[s:] in two reference calls, merged, against one call
    on all keys (unbatched, float32 lse as attention returns it)."""
    q, k, v = (x[0] for x in cuflash2.testing.random_qkv(np, 1, 5, 40, 2, 2, 16, np.float32, 3))
    out, lse = reference.attention(q, k, v, return_lse=True, compute_dtype=np.float64)
    a = reference.attention(q, k[:25], v[:25], return_lse=True, compute_dtype=np.float64)
    b = reference.attention(q, k[25:], v[25:], return_lse=True, compute_dtype=np.float64)
    merged, merged_lse = reference.merge_states(*a, *b)
    assert merged.dtype == np.float64 and merged_lse.dtype == np.float32
    np.testing.assert_allclose(merged, out, rtol=1e-5, atol=1e-6)  # (float32 lse)
    np.testing.assert_allclose(merged_lse, lse, rtol=1e-6)


def test_reference_rows_without_keys():
    """+inf and -inf both mean no key: weight 0, the state's out not read (nan stays out);
    no key anywhere: out 0, lse +inf; dtypes kept (fp16 out, float32 lse)."""
    out_a = np.array([[[1.0, 2.0]], [[np.nan, np.nan]], [[5.0, 6.0]]], np.float16)  # (3, 1, 2)
    out_b = np.array([[[3.0, 4.0]], [[7.0, 8.0]], [[np.nan, 1.0]]], np.float16)
    lse_a = np.array([[0.0, -math.inf, math.inf]], np.float32)  # (1, 3)
    lse_b = np.array([[0.0, 1.5, -math.inf]], np.float32)
    out, lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_array_equal(out, np.array([[[2.0, 3.0]], [[7.0, 8.0]], [[0.0, 0.0]]],
                                                np.float16))
    np.testing.assert_allclose(lse, [[math.log(2.0), 1.5, math.inf]], rtol=1e-7)
    with pytest.raises(ValueError, match=r"lse_b must have the shape of lse_a \(1, 3\)"):
        reference.merge_states(out_a, lse_a, out_b, lse_b.T)
    with pytest.raises(ValueError, match=r"lses must have shape \(2, 1, 3\)"):
        reference.merge_states_many(np.stack([out_a, out_b]), np.stack([lse_a.T, lse_b.T]))


# ---------------------------------------------------------------------------------------------
# Checks (pure Python, NumPy arrays)


def _states(b=2, s=5, h=4, d=64, dtype=np.float16):
    rng = np.random.default_rng(0)
    out_a = rng.standard_normal((b, s, h, d)).astype(dtype)
    out_b = rng.standard_normal((b, s, h, d)).astype(dtype)
    lse_a = rng.standard_normal((b, h, s)).astype(np.float32)
    lse_b = rng.standard_normal((b, h, s)).astype(np.float32)
    return out_a, lse_a, out_b, lse_b


def _check(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    return _merge.check_merge([("out_a", out_a, "lse_a", lse_a), ("out_b", out_b, "lse_b", lse_b)],
                              out, lse)


def test_check_accepts_the_forward_layouts():
    p = _check(*_states())
    assert (p.num_states, p.batch, p.seqlen, p.nheads, p.head_dim, p.dtype, p.batched) == (
        2, 2, 5, 4, 64, "float16", True)
    out_a, lse_a, out_b, lse_b = _states(dtype=ml_dtypes.bfloat16)
    p = _check(out_a[0], lse_a[0], out_b[0], lse_b[0])  # unbatched / varlen (total, h, d)
    assert (p.batch, p.seqlen, p.batched, p.dtype) == (1, 5, False, "bfloat16")
    assert _check(*_states(d=4, dtype=np.float32)).head_dim == 4
    stacked = _merge.check_merge([("outs", np.zeros((3, 7, 2, 16), np.float16), "lses",
                                   np.zeros((3, 2, 7), np.float32))], stacked=True)
    assert (stacked.num_states, stacked.seqlen, stacked.nheads) == (3, 7, 2)


@pytest.mark.parametrize("change,error,pattern", [
    (lambda a: dict(out_a=a["out_a"][..., 0, 0]), ValueError,
     r"out_a must have 4 dims \(batch, seqlen, nheads, headdim\) or 3"),
    (lambda a: dict(out_a=a["out_a"].astype(np.float64)), TypeError,
     r"out_a must be float16, bfloat16 \(ml_dtypes.bfloat16\) or float32 .*float64"),
    (lambda a: dict(out_b=a["out_b"][:, :4]), ValueError,
     r"out_b must have out_a's shape \(2, 5, 4, 64\); got \(2, 4, 4, 64\)"),
    (lambda a: dict(out_b=a["out_b"].astype(ml_dtypes.bfloat16)), TypeError,
     r"out_b must have out_a's dtype \(float16\); got bfloat16. Nothing is cast"),
    (lambda a: dict(lse_a=a["lse_a"].astype(np.float16)), TypeError,
     r"lse_a must be float32 \(the lse of attention\(..., return_lse=True\)\); got float16"),
    (lambda a: dict(lse_b=a["lse_b"].transpose(0, 2, 1)), ValueError,
     r"lse_b must have shape \(2, 4, 5\) to go with out_b's \(2, 5, 4, 64\); got \(2, 5, 4\)"),
    (lambda a: dict(out_a=a["out_a"][..., :60], out_b=a["out_b"][..., :60]), ValueError,
     r"out_a's headdim must be a multiple of 8 for float16 \(rows are read in 16-byte "
     r"pieces\); got 60"),
    (lambda a: dict(out_b=np.asfortranarray(a["out_b"])), ValueError,
     r"out_b must be contiguous in its last dim"),
    (lambda a: dict(out_b=np.zeros((2, 5, 4, 68), np.float16)[..., :64]), ValueError,
     r"out_b stride of dim 2 must be a multiple of 8 elements \(16 bytes\)"),
    (lambda a: dict(out=np.zeros((2, 5, 4, 64), np.float32)), TypeError,
     r"out must have the states' dtype \(float16\); got float32. Nothing is cast"),
    (lambda a: dict(out=np.zeros((2, 4, 5, 64), np.float16)), ValueError,
     r"out must have shape \(2, 5, 4, 64\) \(batch, seqlen, nheads, headdim\)"),
    (lambda a: dict(out=np.broadcast_to(np.zeros((1, 5, 4, 64), np.float16), (2, 5, 4, 64))),
     ValueError, r"out must not have overlapping elements \(a broadcast or overlapping view"),
    (lambda a: dict(lse=np.zeros((2, 4, 5), np.float64)), TypeError, r"lse must be float32"),
    (lambda a: dict(lse=np.zeros((2, 5, 4), np.float32)), ValueError,
     r"lse must have shape \(2, 4, 5\) to go with the merged out's \(2, 5, 4, 64\)"),
])
def test_check_names_the_argument(change, error, pattern):
    names = ("out_a", "lse_a", "out_b", "lse_b")
    arrays = dict(zip(names, _states()), out=None, lse=None)
    arrays.update(change(arrays))
    with pytest.raises(error, match=pattern):
        _check(**arrays)


def test_check_of_stacked_states():
    with pytest.raises(ValueError, match=r"outs must have 5 dims \(num_states, batch, seqlen, "
                                         r"nheads, headdim\) or 4"):
        _merge.check_merge([("outs", np.zeros((5, 2, 8), np.float16), "lses",
                             np.zeros((5, 2), np.float32))], stacked=True)
    with pytest.raises(ValueError, match=r"outs must hold at least one state"):
        _merge.check_merge([("outs", np.zeros((0, 5, 2, 8), np.float16), "lses",
                             np.zeros((0, 2, 5), np.float32))], stacked=True)
    with pytest.raises(ValueError, match=r"lses must have shape \(3, 2, 5\)"):
        _merge.check_merge([("outs", np.zeros((3, 5, 2, 8), np.float16), "lses",
                             np.zeros((2, 2, 5), np.float32))], stacked=True)


def test_numpy_states_get_the_reference_hint():
    with pytest.raises(TypeError, match=r"out_a is a numpy array.*cuflash2\.reference\."
                                        r"merge_states to compute on the CPU"):
        cuflash2.merge_states(*_states())
    with pytest.raises(TypeError, match=r"outs is a numpy array.*cuflash2\.reference\."
                                        r"merge_states_many"):
        cuflash2.merge_states_many(np.zeros((2, 5, 4, 8), np.float16),
                                   np.zeros((2, 4, 5), np.float32))


# ---------------------------------------------------------------------------------------------
# What a call launches (CuPy stand-in)


@pytest.fixture
def merge_host(api_host, monkeypatch):
    monkeypatch.setattr(_merge._plans_by_key, "plans", {})
    return api_host


def _device_states(b=2, s=5, h=4, d=64, dtype=np.float16):
    return tuple(_DeviceArray(x) for x in _states(b, s, h, d, dtype))


def test_a_merge_launches_one_kernel_with_the_states_layouts(merge_host):
    out_a, lse_a, out_b, lse_b = _device_states()
    for _ in range(2):  # planned, then the plan again
        out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b)
        launch, _, record = merge_host.launches[-1]
        assert launch.config == _configs.MergeStatesConfig("float16", 8)  # d=64: 8 chunks
        assert launch.grid == (-(-4 * 5 // (_configs.MERGE_THREADS // 8)), 1, 2)
        assert out.shape == (2, 5, 4, 64) and out.dtype == np.float16
        assert lse.shape == (2, 4, 5) and lse.dtype == np.float32
        assert record["first"]["out"] == out_a.data.ptr and record["rest"]["out"] == out_b.data.ptr
        assert record["first"]["lse"] == lse_a.data.ptr and record["rest"]["lse"] == lse_b.data.ptr
        assert record["out"] == out.data.ptr and record["lse"] == lse.data.ptr
        assert (record["num_states"], record["seqlen"], record["nheads"],
                record["head_dim"]) == (2, 5, 4, 64)
        for state in ("first", "rest"):
            s = record[state]
            assert (s["o_batch_stride"], s["o_row_stride"], s["o_head_stride"]) == (1280, 256, 64)
            assert (s["lse_batch_stride"], s["lse_head_stride"], s["lse_row_stride"]) == (20, 5, 1)
        assert (record["o_batch_stride"], record["lse_head_stride"]) == (1280, 5)
    assert len(merge_host.launches) == 2


def test_float32_and_strided_states_are_read_in_words_where_they_lie(merge_host):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((3, 6, 8, 32)).astype(np.float32)
    lse_big = rng.standard_normal((8, 6, 3)).astype(np.float32)
    out_a, out_b = _DeviceArray(big[:, ::2, :4]), _DeviceArray(big[:, 1::2, 4:])
    lse_a = _DeviceArray(lse_big[:4, ::2].transpose(2, 0, 1))  # (3, 4, 3), any strides
    lse_b = _DeviceArray(lse_big[4:, 1::2].transpose(2, 0, 1))
    out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b)
    launch, _, record = merge_host.launches[-1]
    assert launch.config == _configs.MergeStatesConfig("float32", 8)  # 128 bytes a row
    assert out.shape == (3, 3, 4, 32) and out.dtype == np.float32
    assert record["head_dim"] == 64  # 16-bit words
    first = record["first"]
    assert (first["o_batch_stride"], first["o_row_stride"], first["o_head_stride"]) == (
        2 * 6 * 8 * 32, 2 * 2 * 8 * 32, 2 * 32)
    assert (first["lse_batch_stride"], first["lse_head_stride"], first["lse_row_stride"]) == (
        1, 18, 6)
    assert record["rest"]["out"] == out_b.data.ptr
    assert (record["o_batch_stride"], record["o_row_stride"]) == (2 * 3 * 4 * 32, 2 * 4 * 32)


def test_in_place_and_given_outputs(merge_host):
    out_a, lse_a, out_b, lse_b = _device_states(b=1, s=3, h=2, d=128)
    out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b, out=out_a, lse=lse_a)
    assert out is out_a and lse is lse_a
    launch, _, record = merge_host.launches[-1]
    assert launch.config.lanes == 16 and record["out"] == out_a.data.ptr
    assert record["lse"] == lse_a.data.ptr
    out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b, out=out_b)  # lse allocated
    assert out is out_b and merge_host.launches[-1][2]["lse"] == lse.data.ptr
    with pytest.raises(ValueError, match=r"out overlaps the memory of out_a without being it "
                                         r"exactly \(the same address and strides\): merging "
                                         r"in place"):
        cuflash2.merge_states(out_a, lse_a, out_b, lse_b, out=out_a[:, ::-1])
    with pytest.raises(ValueError, match=r"lse overlaps the memory of out_b"):
        cuflash2.merge_states(out_a, lse_a, out_b, lse_b,
                              lse=_DeviceArray(out_b.array.view(np.float32)[0, :1, :, :3]))
    assert len(merge_host.launches) == 2  # the refused calls launched nothing


def test_many_states_are_one_stack(merge_host):
    rng = np.random.default_rng(2)
    outs = _DeviceArray(rng.standard_normal((5, 7, 2, 16)).astype(np.float16))  # unbatched
    lses = _DeviceArray(rng.standard_normal((5, 2, 7)).astype(np.float32))
    out, lse = cuflash2.merge_states_many(outs, lses)
    launch, _, record = merge_host.launches[-1]
    assert launch.config == _configs.MergeStatesConfig("float16", 2)
    assert launch.grid == (1, 1, 1) and out.shape == (7, 2, 16) and lse.shape == (2, 7)
    assert record["num_states"] == 5
    assert record["first"]["out"] == outs.data.ptr
    assert record["rest"]["out"] == outs.data.ptr + 7 * 2 * 16 * 2
    assert record["rest"]["lse"] == lses.data.ptr + 2 * 7 * 4
    assert record["rest"]["o_state_stride"] == 7 * 2 * 16 and record["rest"]["o_batch_stride"] == 0
    assert record["rest"]["lse_state_stride"] == 14
    out, lse = cuflash2.merge_states_many(outs, lses, out=outs[3], lse=lses[3])  # in place
    assert merge_host.launches[-1][2]["out"] == outs.data.ptr + 3 * 7 * 2 * 16 * 2
    with pytest.raises(ValueError, match=r"out overlaps the memory of outs without being one "
                                         r"of its states exactly"):
        cuflash2.merge_states_many(outs, lses, out=_DeviceArray(outs.array[3, ::-1]))
    cuflash2.merge_states_many(outs[:1], lses[:1])  # one state
    assert merge_host.launches[-1][2]["rest"]["out"] == outs.data.ptr


def test_empty_merges_launch_nothing(merge_host):
    out_a, lse_a, out_b, lse_b = _device_states(s=0)
    out, lse = cuflash2.merge_states(out_a, lse_a, out_b, lse_b)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0) and not merge_host.launches


def test_wrong_devices_and_misaligned_states_are_named(merge_host):
    out_a, lse_a, out_b, lse_b = _device_states()
    other = _DeviceArray(out_b.array, device=1)
    with pytest.raises(ValueError, match=r"out_b is on device 1 but the current CuPy device is 0"):
        cuflash2.merge_states(out_a, lse_a, other, lse_b)
    # (NumPy's allocations are 16-byte aligned or more: one element on, 2 bytes off)
    shifted = _DeviceArray(np.zeros(2 * 5 * 4 * 64 + 1, np.float16)[1:].reshape(2, 5, 4, 64))
    assert shifted.data.ptr % 16
    with pytest.raises(ValueError, match=r"out_a must start at a 16-byte aligned address"):
        cuflash2.merge_states(shifted, lse_a, out_b, lse_b)
    assert not merge_host.launches
