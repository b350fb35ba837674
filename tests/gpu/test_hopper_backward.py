"""GPU tests of the backward's dispatch on Hopper (sm_90): which main kernel runs a call with
the Hopper backward switched on (the default; `_dispatch.HOPPER_BACKWARD` set inside
`_hopper_backward` whatever CUFLASH2_HOPPER_BWD says), and the Hopper kernel (cuda_src/flash_bwd_sm90.cu) through the public
entry points against the reference: head dims 8..256 (above 128: two CTAs a key block, one
per head-dim chunk), causal and windows, GQA/MQA, odd lengths,
seqlen_q != seqlen_k, packed qkv, softcap/ALiBi, given (strided) gradients, and a plan hit on
new arrays (the tensor maps' address words patched per call).

On other GPUs the dispatch tests check that the mma.sync
backward runs everything; the Hopper kernel tests skip.
"""


import numpy
import pytest
from grids import BF16, DTYPES, FP16
from grids import is_hopper, needs_hopper, score_mod_options, switched
from grids import seed_of as _seed

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _attention_plans, _configs, _dispatch, api, testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _hopper_backward(enabled: bool = True):
    """Plans made inside use (or not) the Hopper backward."""
    return switched(_dispatch, {"HOPPER_BACKWARD": enabled}, api._backward_plans)


def _inputs(batch, sq, sk, h, hkv, d, dtype):
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hkv, d, dtype,
                                 _seed(batch, sq, sk, h, hkv, d, str(dtype)))
    dout = testing.random_qkv(cupy, batch, sq, sq, h, h, d, dtype,
                              _seed("dout", batch, sq, h, d, str(dtype)))[0]
    return q, k, v, dout


def _main_kernel(dout, q, k, v, out, lse, **options) -> str:
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, **options)
    return kernels[1]


def _check(q, k, v, dout, *, hopper=True, grads=None, **options):
    """Forward, then the backward inside _hopper_backward(): asserts the main kernel (Hopper or
    not) and the gradients against the reference. Returns (dq, dk, dv)."""
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    with _hopper_backward():
        kernel = _main_kernel(dout, q, k, v, out, lse, **options)
        assert kernel.startswith("Hopper backward" if hopper else "mma.sync"), kernel
        given = dict(zip(("dq", "dk", "dv"), grads)) if grads is not None else {}
        got = cuflash2.attention_backward(dout, q, k, v, out, lse, **options, **given)
    if grads is not None:
        assert all(g is x for g, x in zip(got, grads))
    results = testing.check_backward(dout, q, k, v, *got, **options)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    return got


# --------------------------------------------------------------------------------------------
# Which kernel runs


def test_backward_kernels_names_preprocess_main_and_conversion():
    q, k, v, dout = _inputs(1, 200, 300, 4, 2, 128, BF16)
    out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    with _hopper_backward():
        kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, causal=True)
    assert len(kernels) == 3, kernels
    assert kernels[0].startswith("backward preprocess")
    assert kernels[2].startswith("backward dQ conversion")
    if is_hopper():
        assert kernels[1].startswith("Hopper backward") and "head dim 128," in kernels[1]
    else:
        assert kernels[1].startswith("mma.sync backward")


def test_switched_off_the_mma_sync_backward_runs():
    q, k, v, dout = _inputs(1, 200, 300, 4, 2, 128, FP16)
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    with _hopper_backward(False):
        assert _main_kernel(dout, q, k, v, out, lse).startswith("mma.sync backward")


@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_runs_on_mma_sync(deterministic):
    # every head dim the checks take (up to 256) has a Hopper kernel, deterministic mode too:
    # dropout is what the Hopper backward leaves to the mma.sync one
    q, k, v, dout = _inputs(1, 200, 300, 4, 2, 64, FP16)
    options = {"dropout_p": 0.1, "seed": 3}
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    with _hopper_backward():
        kernel = _main_kernel(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    assert kernel.startswith("mma.sync backward"), kernel


# --------------------------------------------------------------------------------------------
# The Hopper backward through the public entry points


@needs_hopper
@pytest.mark.parametrize("headdim", [8, 40, 64, 72, 96, 104, 128, 136, 160, 192, 200, 224,
                                     256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_head_dim(dtype, causal, headdim):
    """Each Hopper kernel dim and head dims below it (columns past the head dim zero-filled by
    the TMA, never stored), GQA, seqlen_q != seqlen_k. 136..256: two head-dim chunks (d=136:
    the second chunk has 8 columns; d=192's is computed 128 wide, half of it discarded)."""
    q, k, v, dout = _inputs(1, 333, 600, 4, 2, headdim, dtype)
    kernel_dim = min(d for d in _configs.SM90_BWD_HEAD_DIMS if d >= headdim)
    out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
    with _hopper_backward():
        kernel = _main_kernel(dout, q, k, v, out, lse, causal=causal)
    assert f"head dim {kernel_dim}," in kernel, kernel
    _check(q, k, v, dout, causal=causal)


@needs_hopper
@pytest.mark.parametrize("case", ["full", "causal", "gqa_causal_long", "sq_gt_sk_causal",
                                  "right_window", "left_window", "sliding_window",
                                  "left_window_d64", "mods", "d40", "d96", "alibi_d64",
                                  "softcap_d64", "d192", "d256_causal", "d256_gqa_long",
                                  "d160_window", "mods_d256"])
def test_deterministic_on_the_hopper_kernel(case):
    """deterministic=True runs the Hopper kernel with dQ added in key-block order: the 2x rule,
    and three runs bitwise identical (each into poisoned gradients), also where many key blocks
    add to the same rows at once (4k keys, GQA); above d=128 the consumers' vector reductions
    take the turns (one semaphore slot per head-dim chunk); window edges on either side."""
    shape, options = (2, 300, 517, 4, 2, 128, BF16), {}
    if case == "causal":
        options["causal"] = True
    elif case == "gqa_causal_long":
        shape, options = (2, 1500, 4096, 8, 2, 64, FP16), {"causal": True}
    elif case == "sq_gt_sk_causal":  # rows that see no key
        shape, options = (2, 700, 300, 4, 4, 128, FP16), {"causal": True}
    elif case == "right_window":
        options["window_size"] = (-1, 40)
    elif case == "left_window":
        options["window_size"] = (100, -1)
    elif case == "sliding_window":  # query blocks whose adders start past key block 0
        shape, options = (1, 1500, 2000, 4, 2, 128, FP16), {"window_size": (256, 64)}
    elif case == "left_window_d64":  # 128-row query blocks
        shape, options = (2, 1100, 1500, 4, 1, 64, BF16), {"window_size": (300, 0)}
    elif case == "d192":
        shape = (2, 300, 517, 4, 2, 192, BF16)
    elif case == "d256_causal":
        shape, options = (2, 700, 600, 4, 2, 256, FP16), {"causal": True}
    elif case == "d256_gqa_long":
        shape = (1, 700, 2500, 8, 2, 256, BF16)
    elif case == "d160_window":
        shape, options = (1, 500, 900, 4, 4, 160, FP16), {"window_size": (200, 50)}
    elif case == "mods_d256":
        shape, options = (2, 300, 517, 4, 2, 256, BF16), score_mod_options(cupy, "both")
    elif case == "mods":
        options = score_mod_options(cupy, "both")
    elif case in ("d40", "d96"):
        shape = (1, 333, 600, 4, 2, int(case[1:]), FP16)
    elif case in ("alibi_d64", "softcap_d64"):  # d=64: 64-row steps with ALiBi, 128 with softcap
        shape, options = (2, 300, 517, 4, 2, 64, FP16), score_mod_options(cupy, case[:-4])
    q, k, v, dout = _inputs(*shape)
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    runs = []
    with _hopper_backward():
        kernel = _main_kernel(dout, q, k, v, out, lse, deterministic=True, **options)
        assert kernel.startswith("Hopper backward") and "key-block order" in kernel, kernel
        for _ in range(3):
            grads = [testing.poison_like(cupy, x.shape, x.dtype) for x in (q, k, v)]
            runs.append(cuflash2.attention_backward(dout, q, k, v, out, lse, deterministic=True,
                                                    dq=grads[0], dk=grads[1], dv=grads[2],
                                                    **options))
    results = testing.check_backward(dout, q, k, v, *runs[0], **options)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], run):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), name


@needs_hopper
@pytest.mark.parametrize("window", [(-1, -1), (64, 0), (100, 30), (0, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_windows(dtype, window):
    q, k, v, dout = _inputs(2, 333, 517, 4, 2, 64, dtype)
    _check(q, k, v, dout, window_size=window)


@needs_hopper
@pytest.mark.parametrize("layout", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(layout, causal):
    heads = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}[layout]
    q, k, v, dout = _inputs(2, 255, 97 if layout == "mqa" else 300, *heads, 128, BF16)
    _check(q, k, v, dout, causal=causal)


@needs_hopper
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 700), (700, 1), (129, 128), (128, 129),
                                   (17, 1025), (1025, 17)])
@pytest.mark.parametrize("causal", [False, True])
def test_short_odd_and_ragged_lengths(sq, sk, causal):
    """Partial query and key blocks, seqlen_q != seqlen_k both ways (causal: rows that see no
    key have zero gradients; keys no query sees get zero dK/dV)."""
    q, k, v, dout = _inputs(3, sq, sk, 2, 1, 96, FP16)
    _check(q, k, v, dout, causal=causal)


@needs_hopper
@pytest.mark.parametrize("mods", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_modifiers(dtype, mods):
    q, k, v, dout = _inputs(2, 257, 389, 4, 4, 128, dtype)
    options = score_mod_options(cupy, mods)
    _check(q, k, v, dout, **options)


@needs_hopper
@pytest.mark.parametrize("headdim", [192, 256])
@pytest.mark.parametrize("case", ["gqa_causal", "mqa_window", "mods", "odd", "strided_grads"])
def test_wide_head_dims(case, headdim):
    """d=192 / 256 (two CTAs a key block, d=256 with one Q / dO stage) through the features the
    d <= 128 tests cover: the chunks' column offsets in dK / dV / dq_accum, the zero dK / dV of
    keys no query sees, the score modifiers, given strided gradients."""
    options, grads = {}, None
    if case == "gqa_causal":
        q, k, v, dout = _inputs(2, 300, 333, 6, 2, headdim, BF16)
        options["causal"] = True
    elif case == "mqa_window":
        q, k, v, dout = _inputs(1, 400, 517, 4, 1, headdim, FP16)
        options["window_size"] = (100, 30)
    elif case == "mods":
        q, k, v, dout = _inputs(1, 257, 389, 4, 2, headdim, BF16)
        options.update(causal=True, softcap=5.0,
                       alibi_slopes=cupy.asarray(numpy.linspace(0.05, 0.4, 4,
                                                                dtype=numpy.float32)))
    elif case == "odd":  # causal with sq > sk: rows that see no key, keys past the last block
        q, k, v, dout = _inputs(3, 1025, 17, 2, 1, headdim, FP16)
        options["causal"] = True
    else:
        q, k, v, dout = _inputs(2, 300, 260, 4, 2, headdim, FP16)
        wide = [testing.poison_like(cupy, x.shape[:-1] + (headdim + 64,), FP16)
                for x in (q, k, v)]
        grads = tuple(w[..., :headdim] for w in wide)
        options["causal"] = True
    _check(q, k, v, dout, grads=grads, **options)
    if grads is not None:
        for w in wide:
            assert bool(cupy.isnan(w[..., headdim:].astype(cupy.float32)).all())


@needs_hopper
def test_unbatched_inputs():
    q, k, v, dout = (x[0] for x in _inputs(1, 190, 230, 4, 2, 128, FP16))
    dq, dk, dv = _check(q, k, v, dout, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_packed_qkv_backward(causal):
    """q, k, v (and dq, dk, dv) as views of one packed array: the maps take the views'
    strides, the plan patches each view's byte offset."""
    rng = numpy.random.default_rng(11)
    qkv = cupy.asarray(rng.standard_normal((2, 300, 3, 4, 128), numpy.float32).astype(BF16))
    dout = cupy.asarray(rng.standard_normal((2, 300, 4, 128), numpy.float32).astype(BF16))
    out, lse = cuflash2.attention_qkvpacked(qkv, causal=causal, return_lse=True)
    q, k, v = (qkv[:, :, i] for i in range(3))
    with _hopper_backward():
        assert _main_kernel(dout, q, k, v, out, lse, causal=causal).startswith("Hopper")
        dqkv = cuflash2.attention_qkvpacked_backward(dout, qkv, out, lse, causal=causal)
        kernels = [c for p in api._backward_plans.plans.values() for c in p.kernels]
    assert sum(isinstance(c, _configs.BwdSm90Config) for c in kernels) == 2, kernels
    results = testing.check_backward(dout, q, k, v, *(dqkv[:, :, i] for i in range(3)),
                                     causal=causal)
    assert all(r.ok for r in results), "; ".join(map(str, results))


@needs_hopper
def test_given_strided_gradients():
    """dq=, dk=, dv= as views of wider NaN-filled arrays: written through their strides, the
    columns past the head dim untouched."""
    q, k, v, dout = _inputs(2, 300, 260, 4, 2, 64, FP16)
    wide = [testing.poison_like(cupy, x.shape[:-1] + (96,), FP16) for x in (q, k, v)]
    grads = tuple(w[..., :64] for w in wide)
    _check(q, k, v, dout, causal=True, grads=grads)
    for w in wide:
        assert bool(cupy.isnan(w[..., 64:].astype(cupy.float32)).all())


@needs_hopper
def test_a_plan_hit_patches_the_tensor_map_addresses():
    """Two calls of one signature on different arrays: the second reads its own q, k, v, dout
    (the maps' address words are patched like the struct's pointers); the same arrays twice
    give the same gradients up to the atomic dQ's order."""
    first = _inputs(2, 200, 300, 4, 2, 128, BF16)
    second = tuple((x.astype(cupy.float32) * 0.5 + 0.25).astype(BF16) for x in first)
    with _hopper_backward():
        for q, k, v, dout in (first, second):
            out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
            dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True)
            results = testing.check_backward(dout, q, k, v, dq, dk, dv, causal=True)
            assert all(r.ok for r in results), "; ".join(map(str, results))
        assert len(api._backward_plans) == 1
        hopper = [p for p in api._backward_plans.plans.values()][0]
        assert isinstance(hopper.kernels[1], _configs.BwdSm90Config)


# --------------------------------------------------------------------------------------------
# The development entry point builds the dispatcher's plan


@needs_hopper
def test_prepare_backward_sm90_matches_the_dispatched_backward():
    q, k, v, dout = _inputs(2, 257, 300, 4, 2, 96, FP16)
    out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
    prepared = _attention_plans.prepare_backward_sm90(dout, q, k, v, out, lse, causal=True)
    dq, dk, dv = prepared.run()
    results = testing.check_backward(dout, q, k, v, dq, dk, dv, causal=True)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    with _hopper_backward():
        grads = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True)
    # dK, dV carry no atomics: bitwise equal; dQ up to the atomics' order
    for a, b in zip((dk, dv), grads[1:]):
        assert bool((a.view(numpy.uint16) == b.view(numpy.uint16)).all())
