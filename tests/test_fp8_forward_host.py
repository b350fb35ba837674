"""attention's FP8 (e4m3) forward without a GPU (docs/FP8_FORWARD.md): the arguments' checks and
refusals, each naming what it refuses, on the host stand-in of CuPy (test_plans_host's
`api_host`, and test_hopper_host's `hopper_api` for an H100/H200); the plan of a call on sm_90
(the e4m3 Hopper forward, the output's dtype); and the GPU tests' helper
(tests/gpu/fp8_forward_checks.py: inputs and the 2x rule) on NumPy arrays.
tests/gpu/test_fp8_forward.py runs the kernel.
"""

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import _configs, fp8
from test_hopper_host import hopper_api, scratch_maps  # noqa: F401  (fixtures)
from test_plans_host import api_host, device_array, launches  # noqa: F401  (fixtures)

BF16 = np.dtype(ml_dtypes.bfloat16)


#: An error of any of these types is a refusal; the tests check that its message names the
#: argument.
REFUSALS = (NotImplementedError, ValueError, TypeError)


def _unit_descales(host, monkeypatch):
    """The stand-in CuPy's cupy.ones (a device array of 1 is the factor of a descale not
    given: fp8.unit_descale), with fp8's cache of those emptied for this test."""
    host.cupy.ones = lambda shape, dtype: device_array(shape, dtype)
    host.cupy.float32 = np.float32
    monkeypatch.setattr(fp8, "_unit_descales", {})
    return host


@pytest.fixture
def fp8_host(api_host, monkeypatch):
    """api_host (compute capability 80 unless a test sets it) with cupy.ones."""
    return _unit_descales(api_host, monkeypatch)


@pytest.fixture
def fp8_hopper(hopper_api, scratch_maps, monkeypatch):
    """hopper_api (an H100/H200 stand-in, the operand pass's scratch maps encoded by a
    stand-in too) with cupy.ones."""
    return _unit_descales(hopper_api, monkeypatch)


def _arrays(batch=2, seqlen_q=100, seqlen_k=120, nheads=8, nheads_kv=2, d=128, dtype=np.uint8):
    return (device_array((batch, seqlen_q, nheads, d), dtype),
            device_array((batch, seqlen_k, nheads_kv, d), dtype),
            device_array((batch, seqlen_k, nheads_kv, d), dtype))


def _descales(batch=2, nheads_kv=2):
    return {"q_descale": device_array((batch, nheads_kv), np.float32),
            "k_descale": device_array((), np.float32),
            "v_descale": device_array((1,), np.float32)}


# --------------------------------------------------------------------------------------------
# Refusals: what uint8 needs, and what the FP8 forward does not take


def test_uint8_inputs_without_qkv_dtype_are_refused(fp8_host):
    """uint8 is read no other way than as e4m3 bits named by qkv_dtype: without it, a
    TypeError (before the API lands too: attention refuses FP8 arrays today)."""
    for arch in (80, 90):
        fp8_host.set_arch(arch)
        with pytest.raises(TypeError):
            cuflash2.attention(*_arrays())
    with pytest.raises(TypeError):  # one FP8 array among 16-bit ones
        q, k, v = _arrays(dtype=np.float16)
        cuflash2.attention(q, device_array(k.shape, np.uint8), v)
    assert not fp8_host.launches


def test_the_uint8_refusal_names_qkv_dtype(fp8_hopper):
    with pytest.raises(TypeError, match="qkv_dtype"):
        cuflash2.attention(*_arrays())
    with pytest.raises(TypeError, match="qkv_dtype"):
        cuflash2.attention(*_arrays(), **_descales())
    assert not fp8_hopper.launches


def test_qkv_dtype_is_checked(fp8_hopper):
    """qkv_dtype names e4m3 only, takes uint8 (e4m3 bits) q, k and v only, all three; the
    descales are for FP8 inputs (as the reference's checks, tests/test_reference_fp8.py)."""
    with pytest.raises(ValueError, match=r"qkv_dtype.*'e5m2'"):
        cuflash2.attention(*_arrays(), qkv_dtype="e5m2")
    for dtype in (np.float16, BF16):
        with pytest.raises((TypeError, ValueError), match="qkv_dtype"):
            cuflash2.attention(*_arrays(dtype=dtype), qkv_dtype="e4m3")
    q, k, v = _arrays()
    with pytest.raises(TypeError):
        cuflash2.attention(q, device_array(k.shape, np.float16), v, qkv_dtype="e4m3")
    with pytest.raises(ValueError, match="k_descale"):
        cuflash2.attention(*_arrays(dtype=np.float16),
                           k_descale=device_array((2, 2), np.float32))
    assert not fp8_hopper.launches


@pytest.mark.parametrize("name,make", [
    ("softcap", lambda: 5.0),
    ("dropout_p", lambda: 0.1),
    ("alibi_slopes", lambda: device_array((8,), np.float32)),
    ("sinks", lambda: device_array((8,), np.float32)),
    ("bias", lambda: device_array((2, 8, 100, 120), np.float32)),
    ("mask_mod", lambda: cuflash2.mask_mod("kv_idx <= q_idx")),
    ("score_mod", lambda: cuflash2.score_mod("score * 0.5f", grad="0.5f")),
])
def test_features_the_fp8_forward_does_not_take_are_refused_by_name(fp8_hopper, name, make):
    """softcap, dropout, ALiBi, sinks, the bias and the programmable modifiers with e4m3
    inputs: an error naming the argument, before anything launches (on sm_90, where the
    kernel would run)."""
    extra = {"seed": 1} if name == "dropout_p" else {}
    with pytest.raises(REFUSALS, match=name):
        cuflash2.attention(*_arrays(), qkv_dtype="e4m3", **{name: make()}, **extra,
                           **_descales())
    assert not fp8_hopper.launches


def test_the_backward_refuses_e4m3(fp8_hopper):
    """No FP8 backward: attention_backward with uint8 arrays is refused, naming FP8 / e4m3
    (today's refusal of FP8 arrays does, and so must the one once the forward takes them)."""
    q, k, v = _arrays()
    out, dout = device_array(q.shape, BF16), device_array(q.shape, BF16)
    lse = device_array((2, 8, 100), np.float32)
    with pytest.raises(REFUSALS, match=r"(?i)e4m3|fp8|uint8"):
        cuflash2.attention_backward(dout, q, k, v, out, lse)
    assert not fp8_hopper.launches


@pytest.mark.parametrize("arch", [80, 86, 89])
def test_gpus_other_than_sm90_are_refused_naming_it(fp8_host, arch):
    fp8_host.set_arch(arch)
    for descales in ({}, _descales()):
        with pytest.raises(NotImplementedError, match="sm_90"):
            cuflash2.attention(*_arrays(), qkv_dtype="e4m3", **descales)
    assert not fp8_host.launches


@pytest.mark.parametrize("shapes", [(96, 96), (32, 32), (128, 64)], ids=["d96", "d32", "dv64"])
def test_head_dims_other_than_64_128_256_are_refused(fp8_hopper, shapes):
    """Head dims 64, 128 and 256 only, V's the same as Q's and K's."""
    d_qk, d_v = shapes
    q, k, _ = _arrays(d=d_qk)
    v = device_array(k.shape[:-1] + (d_v,), np.uint8)
    with pytest.raises(REFUSALS, match=r"(?i)head dim"):
        cuflash2.attention(q, k, v, qkv_dtype="e4m3")
    assert not fp8_hopper.launches


def test_out_dtype_is_bfloat16_or_float16(fp8_hopper):
    for bad in (np.float32, np.uint8):
        with pytest.raises((ValueError, TypeError), match="out_dtype"):
            cuflash2.attention(*_arrays(), qkv_dtype="e4m3", out_dtype=bad)
    with pytest.raises((ValueError, TypeError), match="out_dtype"):
        cuflash2.attention(*_arrays(dtype=np.float16), out_dtype=np.float16)  # 16-bit inputs
    assert not fp8_hopper.launches


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_are_float32_device_arrays_of_their_shapes(fp8_hopper, name):
    """FlashAttention-3's shapes, (batch, nheads_kv) = (2, 2) here, or () / (1,); float32; a
    device array (a Python float is the reference's only, as for the FP8 cache)."""
    for bad in (device_array((2, 2), np.float16),   # dtype
                device_array((2, 8), np.float32),   # (batch, nheads): not per query head
                device_array((2,), np.float32),     # (batch,)
                device_array((1, 2, 1), np.float32)):
        with pytest.raises(ValueError, match=name):
            cuflash2.attention(*_arrays(), qkv_dtype="e4m3", **{name: bad})
    with pytest.raises((TypeError, ValueError), match=name):
        cuflash2.attention(*_arrays(), qkv_dtype="e4m3", **{name: 0.5})
    assert not fp8_hopper.launches


# --------------------------------------------------------------------------------------------
# The plan of an FP8 call on sm_90


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_an_fp8_call_plans_the_e4m3_hopper_forward(fp8_hopper, headdim):
    """On sm_90: forward_kernels names the Hopper forward with the e4m3 element; the call
    launches it (last; an operand pass may come first), returns out of out_dtype (bfloat16 by
    default) shaped like q and a float32 lse (batch, nheads, seqlen_q), and a given `out` as
    is; descales absent, per tensor or per (batch, KV head)."""
    q, k, v = _arrays(d=headdim)
    kernels = cuflash2.forward_kernels(q, k, v, causal=True, qkv_dtype="e4m3", **_descales())
    main = [name for name in kernels if name.startswith("Hopper forward")]
    assert len(main) == 1 and "e4m3" in main[0] and f"head dim {headdim}" in main[0], kernels
    for descales in ({}, _descales()):
        out, lse = cuflash2.attention(q, k, v, causal=True, qkv_dtype="e4m3", return_lse=True,
                                      **descales)
        assert (out.shape, out.dtype) == (q.shape, BF16)
        assert (lse.shape, lse.dtype) == ((2, 8, 100), np.float32)
        config = fp8_hopper.launches[-1][0].config
        assert isinstance(config, _configs.FwdSm90Config), config
        assert "e4m3" in _configs.describe(config)
    out = cuflash2.attention(q, k, v, qkv_dtype="e4m3", out_dtype=np.float16, **_descales())
    assert (out.shape, out.dtype) == (q.shape, np.float16)
    given = device_array(q.shape, np.float16)
    assert cuflash2.attention(q, k, v, qkv_dtype="e4m3", out_dtype=np.float16, out=given,
                              **_descales()) is given


# --------------------------------------------------------------------------------------------
# The GPU tests' helper on NumPy arrays


def _checks_module():
    """tests/gpu/fp8_forward_checks.py (tests/gpu is not on sys.path for the CPU suite)."""
    path = Path(__file__).parent / "gpu" / "fp8_forward_checks.py"
    spec = importlib.util.spec_from_file_location("fp8_forward_checks_host", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("descale", ["none", "tensor", "head"])
def test_the_gpu_tests_inputs_span_e4m3_with_the_calls_descales(descale):
    checks = _checks_module()
    q, k, v, descales = checks.fp8_qkv(np, 7, 2, 37, 53, 8, 2, 64, descale)
    assert (q.shape, k.shape, v.shape) == ((2, 37, 8, 64), (2, 53, 2, 64), (2, 53, 2, 64))
    assert q.dtype == k.dtype == v.dtype == np.uint8
    shapes = {name: None if x is None else x.shape for name, x in descales.items()}
    assert shapes == {"none": dict.fromkeys(shapes),
                      "tensor": {"q_descale": (), "k_descale": (1,), "v_descale": (1,)},
                      "head": dict.fromkeys(shapes, (2, 2))}[descale]
    for name, x in descales.items():
        assert x is None or x.dtype == np.float32
        values = np.abs(fp8.e4m3_to_float({"q": q, "k": k, "v": v}[name[0]]))
        # e4m3's range: saturated at 448 with descales, standard normals (< 448) without
        assert (values.max() == fp8.E4M3_MAX) == (descale != "none")
        assert np.isfinite(values).all()
    if descale == "head":  # different factors per (batch, KV head)
        assert len(set(descales["k_descale"].ravel().tolist())) == 4
    unbatched = checks.fp8_qkv(np, 7, None, 37, 53, 8, 2, 64, descale)
    assert unbatched[0].shape == (37, 8, 64)
    if descale == "head":
        assert unbatched[3]["q_descale"].shape == (1, 2)


def test_the_gpu_tests_rule_passes_the_e4m3_reference_and_fails_wrong_outputs():
    """check_forward_fp8: the e4m3 reference (ref_lo) and the float64 one rounded to the
    output dtype pass; outputs that drop a descale, use one KV head's factors for all, or skip
    the causal mask fail; the lse against the float64 reference's."""
    checks = _checks_module()
    from cuflash2 import reference

    q, k, v, descales = checks.fp8_qkv(np, 11, 2, 45, 70, 4, 2, 64, "head")
    options = dict(descales, causal=True)
    for out_dtype in (None, np.float16):
        hi, lse, lo = checks.fp8_references(q, k, v, out_dtype=out_dtype, **options)
        assert lo.dtype == (BF16 if out_dtype is None else np.float16)
        for out in (lo, hi.astype(lo.dtype)):
            results = checks.check_forward_fp8(q, k, v, out, lse, out_dtype=out_dtype, **options)
            assert all(r.ok for r in results), checks.describe(results)
    wrong = {
        "no v_descale": dict(options, v_descale=None),
        "KV head 0's factors": dict(options, **{
            n: np.ascontiguousarray(np.broadcast_to(d[:, :1], d.shape))
            for n, d in descales.items()}),
        "no mask": dict(descales),
    }
    for what, wrong_options in wrong.items():
        out = reference.attention(q, k, v, qkv_dtype="e4m3", compute_dtype="e4m3",
                                  **wrong_options)
        results = checks.check_forward_fp8(q, k, v, out, **options)
        assert not results[0].ok, what
    _, lse, lo = checks.fp8_references(q, k, v, **options)
    results = checks.check_forward_fp8(q, k, v, lo, lse + 0.1, **options)
    assert results[0].ok and not results[1].ok
    with pytest.raises(ValueError, match="out_dtype"):
        checks.check_forward_fp8(q, k, v, lo, out_dtype=np.float16, **options)

