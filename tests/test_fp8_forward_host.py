"""attention's and attention_varlen's FP8 (e4m3) forward without a GPU (docs/FP8_FORWARD.md):
the arguments' checks and refusals, each naming what it refuses, on the host stand-in of CuPy
(test_plans_host's `api_host`, and test_hopper_host's `hopper_api` for an H100/H200); the plan
of a call on sm_90 (the e4m3 Hopper forward, the output's dtype; varlen: FEATURE_VARLEN on the
one-tile-per-CTA grid, descales per (sequence, KV head)); and the GPU tests' helper
(tests/gpu/fp8_forward_checks.py: inputs and the 2x rule, dense and varlen) on NumPy arrays.
tests/gpu/test_fp8_forward.py runs the kernel.
"""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import _configs, _dispatch, fp8, precompile
from test_hopper_host import hopper_api, scratch_maps  # noqa: F401  (fixtures)
from test_plans_host import _DeviceArray, api_host, device_array, launches  # noqa: F401
# (api_host, launches, hopper_api, scratch_maps: fixtures)

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
    """hopper_api (an H100/H200 stand-in, scratch maps encoded by a stand-in too: the FP8
    forward encodes none) with cupy.ones."""
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


def _untaken_options(bias_shape):
    """The options the FP8 forward refuses by name, each with a maker of a value for it (the
    bias of `bias_shape`: the calls' (batch, heads, seqlen_q, seqlen_k))."""
    return [
        ("softcap", lambda: 5.0),
        ("dropout_p", lambda: 0.1),
        ("alibi_slopes", lambda: device_array((8,), np.float32)),
        ("sinks", lambda: device_array((8,), np.float32)),
        ("bias", lambda: device_array(bias_shape, np.float32)),
        ("mask_mod", lambda: cuflash2.mask_mod("kv_idx <= q_idx")),
        ("score_mod", lambda: cuflash2.score_mod("score * 0.5f", grad="0.5f")),
    ]


@pytest.mark.parametrize("name,make", _untaken_options((2, 8, 100, 120)))
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
def test_an_fp8_call_plans_the_e4m3_hopper_forward(fp8_hopper, scratch_maps, headdim):
    """On sm_90: forward_kernels names the Hopper forward with the e4m3 element, alone (V is
    transposed in the kernel: no operand pass, no scratch); the call launches it once, its
    q_map, k_map and v_map over q, k and v as they lie, returns out of out_dtype (bfloat16 by
    default) shaped like q and a float32 lse (batch, nheads, seqlen_q), and a given `out` as
    is; descales absent, per tensor or per (batch, KV head)."""
    q, k, v = _arrays(d=headdim)
    kernels = cuflash2.forward_kernels(q, k, v, causal=True, qkv_dtype="e4m3", **_descales())
    assert len(kernels) == 1, kernels
    assert kernels[0].startswith("Hopper forward") and "e4m3" in kernels[0], kernels
    assert f"head dim {headdim}" in kernels[0], kernels
    for descales in ({}, _descales()):
        count = len(fp8_hopper.launches)
        out, lse = cuflash2.attention(q, k, v, causal=True, qkv_dtype="e4m3", return_lse=True,
                                      **descales)
        assert (out.shape, out.dtype) == (q.shape, BF16)
        assert (lse.shape, lse.dtype) == ((2, 8, 100), np.float32)
        assert len(fp8_hopper.launches) == count + 1
        launch, _, record = fp8_hopper.launches[-1]
        config = launch.config
        assert isinstance(config, _configs.FwdSm90Config), config
        assert config.transpose_v and "e4m3" in _configs.describe(config)
        word0 = {name: int(record[name]["v"][0][0]) for name in ("q_map", "k_map", "v_map")}
        assert word0 == {"q_map": q.data.ptr, "k_map": k.data.ptr, "v_map": v.data.ptr}
    assert not scratch_maps  # no map over a scratch array
    out = cuflash2.attention(q, k, v, qkv_dtype="e4m3", out_dtype=np.float16, **_descales())
    assert (out.shape, out.dtype) == (q.shape, np.float16)
    given = device_array(q.shape, np.float16)
    assert cuflash2.attention(q, k, v, qkv_dtype="e4m3", out_dtype=np.float16, out=given,
                              **_descales()) is given


@pytest.mark.parametrize("seqlen, window, headdim, grid", [
    (1024, (-1, -1), 128, "persistent"), (2048, (-1, -1), 128, "persistent"),
    (4096, (-1, -1), 128, "one tile 224"), (16384, (-1, -1), 128, "one tile 224"),
    (1024, (-1, 0), 128, "persistent"),
    (4096, (-1, 0), 128, "claims"), (8192, (-1, 0), 128, "claims"),
    (16384, (-1, 0), 128, "one tile"), (1024, (64, 0), 128, "one tile"),
    (8192, (2048, 2048), 128, "one tile"),
    (1024, (-1, -1), 64, "one tile"), (1024, (-1, 0), 256, "one tile"),
    (8192, (-1, -1), 256, "one tile")])
def test_the_fp8_forward_grid_by_length_and_mask(monkeypatch, seqlen, window, headdim, grid):
    """_dispatch.E4M3_PERSISTENT_MAX_KEYS, E4M3_DYNAMIC_SCHEDULE_KEYS and E4M3_WIDE_TILE_KEYS:
    the persistent grid for short rows at d=128 (claimed tiles for causal rows of 2k-8k keys),
    224-key tiles for non-causal rows from 4k keys, the one-tile grid with the head dim's tile
    for long causal rows, windows and the other head dims."""
    from cuflash2 import _dispatch, _hopper, _validate

    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    problem = _validate.AttentionProblem(16384 // seqlen, seqlen, seqlen, 16, 16, headdim,
                                         "e4m3_bf16", True, headdim ** -0.5)
    config = _dispatch.e4m3_hopper_forward_config(problem, 0, 90, None, window)
    named = {(False, False): "one tile", (True, False): "persistent",
             (True, True): "claims"}[config.persistent, config.claims]
    block_n, _, overlap = _dispatch.E4M3_SM90_FWD_TILES[headdim]
    if config.block_n != block_n:
        named += f" {config.block_n}"
        assert config == _dispatch.e4m3_sm90_config("e4m3_bf16", headdim, (224, 2, True))
    assert named == grid


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



# --------------------------------------------------------------------------------------------
# attention_varlen with FP8 inputs

#: Packed sequences: an empty query sequence, one without keys, odd lengths, a longest of 300
#: query rows (3 m blocks of 128) and 400 keys.
VARLEN_Q, VARLEN_K = [5, 0, 300, 17], [7, 3, 0, 400]


def _varlen_arrays(host, nheads=8, nheads_kv=2, d=128, dtype=np.uint8, lengths=None):
    """(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)) of the stand-in, with
    cupy.asnumpy (check_cu_seqlens=True reads the lengths back)."""
    host.cupy.asnumpy = lambda x: x.array
    lengths_q, lengths_k = lengths or (VARLEN_Q, VARLEN_K)
    cus = [_DeviceArray(np.cumsum([0, *n]).astype(np.int32)) for n in (lengths_q, lengths_k)]
    q = device_array((sum(lengths_q), nheads, d), dtype)
    k, v = (device_array((sum(lengths_k), nheads_kv, d), dtype) for _ in range(2))
    return q, k, v, (*cus, max(lengths_q), max(lengths_k))


def _varlen_descales(sequences=len(VARLEN_Q), nheads_kv=2):
    return {"q_descale": device_array((sequences, nheads_kv), np.float32),
            "k_descale": device_array((sequences, nheads_kv), np.float32),
            "v_descale": device_array((1,), np.float32)}


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_an_fp8_varlen_call_plans_the_e4m3_varlen_forward(fp8_hopper, headdim):
    """On sm_90: the e4m3 Hopper forward with FEATURE_VARLEN on the one-tile-per-CTA grid (m
    blocks of the longest sequence, heads, sequences), one of the specialisations precompile
    builds, its maps over the packed q, k and v as they lie; out (total_q, nheads, d) of
    out_dtype, lse (nheads, total_q); the descales' addresses per call and their (sequence,
    KV head) strides; the lengths checked on every call (check_cu_seqlens), which reads the
    uint8 arrays as e4m3 there too."""
    q, k, v, args = _varlen_arrays(fp8_hopper, d=headdim)
    descales = _varlen_descales()
    kernels = cuflash2.varlen_forward_kernels(q, k, v, *args, causal=True, qkv_dtype="e4m3",
                                              **descales)
    assert len(kernels) == 1, kernels
    assert kernels[0].startswith("Hopper forward") and "e4m3" in kernels[0], kernels
    assert "varlen" in kernels[0] and "persistent" not in kernels[0], kernels
    for call in range(2):  # planned, then from the plan (the lengths checked again)
        count = len(fp8_hopper.launches)
        out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=True, qkv_dtype="e4m3",
                                             return_lse=True, **descales)
        assert (out.shape, out.dtype) == (q.shape, BF16)
        assert (lse.shape, lse.dtype) == ((8, q.shape[0]), np.float32)
        assert len(fp8_hopper.launches) == count + 1
    launch, _, record = fp8_hopper.launches[-1]
    config = launch.config
    assert isinstance(config, _configs.FwdSm90Config), config
    assert config.features == _configs.FEATURE_VARLEN and not config.persistent
    assert config.transpose_v and config.head_dim == headdim
    assert config in precompile.plan(90, [config.dtype], [headdim], [_configs.FEATURE_VARLEN],
                                     ("fwd",))
    assert launch.grid == (3, 8, len(VARLEN_Q))
    word0 = {name: int(record[name]["v"][0][0]) for name in ("q_map", "k_map", "v_map")}
    assert word0 == {"q_map": q.data.ptr, "k_map": k.data.ptr, "v_map": v.data.ptr}
    got = record["descales"]
    assert (got["q"], got["k"], got["v"]) == tuple(
        descales[f"{n}_descale"].data.ptr for n in "qkv")
    assert (got["q_batch_stride"], got["q_head_stride"]) == (2, 1)  # (sequence, KV head)
    assert (got["v_batch_stride"], got["v_head_stride"]) == (0, 0)  # one factor
    assert (record["base"]["varlen"]["total_q"], record["base"]["varlen"]["total_k"]) == (
        sum(VARLEN_Q), sum(VARLEN_K))
    out = cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", out_dtype=np.float16)
    assert (out.shape, out.dtype) == (q.shape, np.float16)
    given = device_array(q.shape, np.float16)
    assert cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", out_dtype=np.float16,
                                     out=given, check_cu_seqlens=False) is given


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (64, 0), (100, 30)])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_fp8_varlen_calls_take_the_one_tile_grid(monkeypatch, window, headdim):
    """_dispatch.e4m3_hopper_forward_config on varlen calls: FEATURE_VARLEN on the one-tile grid
    whatever the lengths and mask (the persistent grids are the dense calls'), including rows
    the dense call runs on the persistent grid (d=128, 1k keys); and a packed k without any key
    refused, naming it."""
    from cuflash2 import _hopper, _validate

    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    problem = _validate.AttentionProblem(5, 1024, 1024, 16, 4, headdim, "e4m3_fp16", True,
                                         headdim ** -0.5)
    varlen = SimpleNamespace(total_q=3000, total_k=2500, batch=5)
    config = _dispatch.e4m3_hopper_forward_config(problem, _configs.FEATURE_VARLEN, 90, varlen,
                                                  window)
    assert config == _configs.with_features(_dispatch.e4m3_sm90_config("e4m3_fp16", headdim),
                                            _configs.FEATURE_VARLEN)
    with pytest.raises(NotImplementedError, match="key"):
        _dispatch.e4m3_hopper_forward_config(problem, _configs.FEATURE_VARLEN, 90,
                                             SimpleNamespace(total_q=3000, total_k=0, batch=5),
                                             window)


def test_fp8_varlen_descales_are_per_sequence_and_kv_head(fp8_hopper):
    """(num_sequences, nheads_kv), () or (1,), float32 device arrays; (batch, ...) shapes of a
    dense call's count, per query head, or a float are refused naming the argument and the
    shape the call takes."""
    q, k, v, args = _varlen_arrays(fp8_hopper)
    for shape in ((), (1,), (len(VARLEN_Q), 2)):
        cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3",
                                  k_descale=device_array(shape, np.float32))
    count = len(fp8_hopper.launches)
    for name in ("q_descale", "k_descale", "v_descale"):
        for bad in (device_array((len(VARLEN_Q) - 1, 2), np.float32),  # not a sequence each
                    device_array((len(VARLEN_Q), 8), np.float32),      # per query head
                    device_array((len(VARLEN_Q),), np.float32),
                    device_array((len(VARLEN_Q), 2), np.float16)):
            with pytest.raises(ValueError, match=rf"{name}.*\(num_sequences, nheads_kv\) = "
                                                 rf"\({len(VARLEN_Q)}, 2\)"):
                cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", **{name: bad})
        with pytest.raises((TypeError, ValueError), match=name):
            cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", **{name: 0.5})
    with pytest.raises(ValueError, match="k_descale"):  # descales without FP8 inputs
        cuflash2.attention_varlen(*_varlen_arrays(fp8_hopper, dtype=np.float16)[:3], *args,
                                  k_descale=device_array((len(VARLEN_Q), 2), np.float32))
    assert len(fp8_hopper.launches) == count


@pytest.mark.parametrize("name,make", _untaken_options((4, 8, 300, 400)))
def test_fp8_varlen_refuses_what_the_fp8_forward_does_not_take_by_name(fp8_hopper, name, make):
    q, k, v, args = _varlen_arrays(fp8_hopper)
    extra = {"seed": 1} if name == "dropout_p" else {}
    with pytest.raises(REFUSALS, match=name):
        cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", **{name: make()}, **extra,
                                  **_varlen_descales())
    assert not fp8_hopper.launches


def test_fp8_varlen_arguments_are_checked_as_the_dense_calls(fp8_hopper):
    """uint8 without qkv_dtype (the message names qkv_dtype and attention_varlen), a format other
    than e4m3, 16-bit arrays with qkv_dtype, out_dtype, head dims other than 64 / 128 / 256, a
    GPU other than sm_90, a packed k without any key: each refused naming it, before any
    launch; the varlen backward refuses uint8 arrays."""
    q, k, v, args = _varlen_arrays(fp8_hopper)
    with pytest.raises(TypeError, match=r"qkv_dtype(?s:.*)attention_varlen"):
        cuflash2.attention_varlen(q, k, v, *args)
    with pytest.raises(ValueError, match=r"qkv_dtype.*'e5m2'"):
        cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e5m2")
    with pytest.raises((TypeError, ValueError), match="qkv_dtype"):
        cuflash2.attention_varlen(*_varlen_arrays(fp8_hopper, dtype=np.float16)[:3], *args,
                                  qkv_dtype="e4m3")
    for bad in (np.float32, np.uint8):
        with pytest.raises((ValueError, TypeError), match="out_dtype"):
            cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", out_dtype=bad)
    with pytest.raises(TypeError, match="out"):  # out of another dtype than out_dtype
        cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3",
                                  out=device_array(q.shape, np.float16))
    for d in (32, 96):
        with pytest.raises(NotImplementedError, match="head dim"):
            cuflash2.attention_varlen(*_varlen_arrays(fp8_hopper, d=d)[:3], *args,
                                      qkv_dtype="e4m3")
    *keyless, keyless_args = _varlen_arrays(fp8_hopper, lengths=([3, 4], [0, 0]))
    for max_seqlen_k in (0, 8):  # (a max_seqlen_k above the longest is taken)
        with pytest.raises(NotImplementedError, match="cu_seqlens_k all 0"):
            cuflash2.attention_varlen(*keyless, *keyless_args[:3], max_seqlen_k,
                                      qkv_dtype="e4m3")
    out, dout = device_array(q.shape, BF16), device_array(q.shape, BF16)
    with pytest.raises(REFUSALS, match=r"(?i)e4m3|fp8|uint8"):
        cuflash2.attention_varlen_backward(dout, q, k, v, out,
                                           device_array((8, q.shape[0]), np.float32), *args)
    fp8_hopper.set_arch(80)
    with pytest.raises(NotImplementedError, match="sm_90"):
        cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3")
    assert not fp8_hopper.launches


def test_an_fp8_varlen_call_without_query_rows_launches_nothing(fp8_hopper):
    """Every query sequence empty (max_seqlen_q may still be positive): empty outputs, no
    launch, no map over q's zero rows."""
    q, k, v, args = _varlen_arrays(fp8_hopper, lengths=([0, 0], [5, 9]))
    out, lse = cuflash2.attention_varlen(q, k, v, args[0], args[1], 16, args[3],
                                         qkv_dtype="e4m3", return_lse=True)
    assert (out.shape, out.dtype, lse.shape) == ((0, 8, 128), BF16, (8, 0))
    assert not fp8_hopper.launches


@pytest.mark.parametrize("descale", ["none", "tensor", "head"])
def test_the_gpu_tests_varlen_inputs_pack_the_sequences(descale):
    """fp8_varlen_qkv: sequence b's rows of q, k, v are fp8_qkv's draws of batch entry b (the
    sequences as its batch, their longest lengths), the descales (num_sequences, nheads_kv)
    with "head"."""
    checks = _checks_module()
    lengths_q, lengths_k = [40, 0, 7], [0, 53, 9]
    q, k, v, args, descales = checks.fp8_varlen_qkv(np, 5, lengths_q, lengths_k, 8, 2, 64,
                                                     descale)
    dense = checks.fp8_qkv(np, 5, 3, 40, 53, 8, 2, 64, descale)
    assert (q.shape, k.shape, v.shape) == ((47, 8, 64), (62, 2, 64), (62, 2, 64))
    assert q.dtype == k.dtype == v.dtype == np.uint8
    cu_q, cu_k, max_q, max_k = args
    assert cu_q.tolist() == [0, 40, 40, 47] and cu_k.tolist() == [0, 0, 53, 62]
    assert (cu_q.dtype, max_q, max_k) == (np.int32, 40, 53)
    for b in range(3):
        np.testing.assert_array_equal(q[cu_q[b]:cu_q[b + 1]], dense[0][b, :lengths_q[b]])
        np.testing.assert_array_equal(v[cu_k[b]:cu_k[b + 1]], dense[2][b, :lengths_k[b]])
    for name, x in descales.items():
        want = dense[3][name]
        assert (x is None and want is None) or np.array_equal(x, want)
    if descale == "head":
        assert descales["k_descale"].shape == (3, 2)


def test_the_gpu_tests_varlen_rule_passes_the_e4m3_reference_and_fails_wrong_outputs():
    """check_varlen_forward_fp8: the e4m3 reference and the float64 one rounded pass; outputs
    with sequence 0's factors for every sequence, without v_descale or without the causal mask
    fail; the lse against the float64 reference's (+inf for the rows of a sequence without
    keys)."""
    checks = _checks_module()
    from cuflash2 import reference

    q, k, v, args, descales = checks.fp8_varlen_qkv(np, 13, [30, 0, 45, 9], [50, 6, 70, 0],
                                                     4, 2, 64)
    options = dict(descales, causal=True)
    for out_dtype in (None, np.float16):
        hi, lse, lo = checks.fp8_varlen_references(q, k, v, args, out_dtype=out_dtype, **options)
        assert lse.shape == (4, 84) and np.isinf(lse[:, 75:]).all()
        for out in (lo, hi.astype(lo.dtype)):
            results = checks.check_varlen_forward_fp8(q, k, v, args, out, lse,
                                                      out_dtype=out_dtype, **options)
            assert all(r.ok for r in results), checks.describe(results)
    wrong = {
        "no v_descale": dict(options, v_descale=None),
        "sequence 0's factors": dict(options, **{
            n: np.ascontiguousarray(np.broadcast_to(d[:1], d.shape))
            for n, d in descales.items()}),
        "no mask": dict(descales),
    }
    for what, wrong_options in wrong.items():
        out = reference.attention_varlen(q, k, v, *args, qkv_dtype="e4m3",
                                         compute_dtype="e4m3", **wrong_options)
        results = checks.check_varlen_forward_fp8(q, k, v, args, out, **options)
        assert not results[0].ok, what
    _, lse, lo = checks.fp8_varlen_references(q, k, v, args, **options)
    finite = np.where(np.isinf(lse), lse, lse + 0.1)
    results = checks.check_varlen_forward_fp8(q, k, v, args, lo, finite, **options)
    assert results[0].ok and not results[1].ok
