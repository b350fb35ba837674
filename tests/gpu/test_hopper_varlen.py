"""GPU tests of varlen on the Hopper forward (FEATURE_VARLEN of cuda_src/flash_fwd_sm90.cu;
docs/HOPPER_FWD.md, "Varlen") and backward (flash_bwd_sm90.cu; docs/HOPPER_BWD.md, "Varlen"):
`attention_varlen` with _dispatch.HOPPER_FORWARD_VARLEN on, and `attention_varlen_backward` with
_dispatch.HOPPER_BACKWARD_VARLEN on, against the reference, on ragged batches with empty and one-token
sequences, lengths that are not multiples of the tiles, seqlen_q != seqlen_k per sequence,
causal masks, windows, GQA, softcap and per-sequence ALiBi, every kernel head dim and head dims
between them, each schedule (in order, ping-pong, with and without the overlap inside a
warpgroup); and which kernel runs a varlen call with the flag off and on.

A box that runs past a sequence reads the next sequence's rows: the neighbours' keys must be
masked and their query rows left unstored, which the ragged layouts check (every sequence but
the last has a neighbour, and their outputs are compared row by row).
"""

import dataclasses

import numpy
import pytest
from grids import DTYPES, FP16, BF16
from grids import switched
from grids import is_hopper, needs_hopper
from grids import seed_of as _seed

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _configs, _dispatch, api, reference, testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _hopper_varlen(enabled: bool = True, pingpong=None, overlap=None):
    """Plans made inside run varlen calls on the Hopper forward (or not); `pingpong` / `overlap`
    force a schedule (None: the dispatcher's)."""
    dispatched = _dispatch.hopper_forward_config

    def forced(*args, **kwargs):
        config = dispatched(*args, **kwargs)
        if config is None:
            return None
        pp = config.pingpong if pingpong is None else pingpong
        ov = config.overlap if overlap is None else overlap
        return dataclasses.replace(config, pingpong=pp, overlap=ov)

    return switched(_dispatch, {"HOPPER_FORWARD_VARLEN": enabled, "hopper_forward_config": forced},
                    api._forward_plans)


# (lengths_q, lengths_k, nheads, nheads_kv): the longest key length passes 512, so that d=64
# runs on the Hopper kernel too (_dispatch.MMA_SYNC_MAX_KEYS).
LAYOUTS = {
    "ragged": ([97, 1, 0, 300, 64, 129], [97, 1, 0, 700, 64, 129], 4, 4),
    "sq!=sk-gqa": ([33, 250, 129, 1], [600, 17, 129, 5], 6, 2),
    "empty-k": ([40, 130, 7], [0, 530, 0], 2, 1),
    "one": ([513], [777], 2, 1),
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(48, 16)),
    "left-window-causal": dict(window_size=(200, 0)),
    "softcap-alibi-causal": dict(causal=True, softcap=4.0, alibi_slopes="batch"),
    "softcap": dict(softcap=8.0),
    "alibi": dict(alibi_slopes="heads"),
}


def _inputs(layout, headdim, dtype, seed):
    lengths_q, lengths_k, h, hk = LAYOUTS[layout]
    rng = numpy.random.default_rng(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = cupy.asarray(rng.standard_normal((total_q, h, headdim)).astype(dtype))
    k = cupy.asarray(rng.standard_normal((total_k, hk, headdim)).astype(dtype))
    v = cupy.asarray(rng.standard_normal((total_k, hk, headdim)).astype(dtype))
    cu_q = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths_q)]).astype(numpy.int32))
    cu_k = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths_k)]).astype(numpy.int32))
    return q, k, v, (cu_q, cu_k, max(lengths_q), max(lengths_k))


def _options(name, batch, nheads, seed):
    options = dict(OPTIONS[name])
    slopes = options.get("alibi_slopes")
    if slopes is not None:
        rng = numpy.random.default_rng(seed)
        shape = (batch, nheads) if slopes == "batch" else (nheads,)
        options["alibi_slopes"] = cupy.asarray(
            rng.uniform(0.01, 0.5, size=shape).astype(numpy.float32))
    return options


def _check(layout, headdim, dtype, option, expect_hopper=True):
    seed = _seed(layout, headdim, option, str(dtype))
    q, k, v, args = _inputs(layout, headdim, dtype, seed)
    batch, nheads = args[0].shape[0] - 1, q.shape[1]
    options = _options(option, batch, nheads, seed + 1)
    (kernel,) = cuflash2.varlen_forward_kernels(q, k, v, *args, **options)
    assert kernel.startswith("Hopper forward") == expect_hopper, kernel
    if expect_hopper:
        assert "varlen" in kernel
    out = testing.poison_like(cupy, q.shape, dtype)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, return_lse=True, out=out, **options)
    assert lse.shape == (nheads, q.shape[0])
    ref_hi = reference.attention_varlen(q, k, v, *args, return_lse=True,
                                        compute_dtype=numpy.float32, **options)
    ref_lo = reference.attention_varlen(q, k, v, *args, compute_dtype=q.dtype, **options)
    result = testing.check_close("out", out, ref_hi[0], ref_lo)
    assert result.ok, str(result)
    assert testing.lse_close(lse, ref_hi[1]).ok
    return out, lse


# --------------------------------------------------------------------------------------------
# Which kernel runs


def test_varlen_runs_on_the_hopper_kernel_unless_the_flag_is_off():
    q, k, v, args = _inputs("ragged", 128, FP16, 1)
    with _hopper_varlen(enabled=False):
        (kernel,) = cuflash2.varlen_forward_kernels(q, k, v, *args, causal=True)
    assert kernel.startswith("mma.sync forward")
    api._forward_plans.plans.clear()
    (kernel,) = cuflash2.varlen_forward_kernels(q, k, v, *args, causal=True)
    if is_hopper():
        assert kernel.startswith("Hopper forward") and "varlen" in kernel
        assert "persistent" not in kernel
    else:
        assert kernel.startswith("mma.sync forward")


@needs_hopper
def test_dropout_and_short_d64_varlen_stay_on_mma_sync():
    q, k, v, args = _inputs("ragged", 128, BF16, 2)
    with _hopper_varlen():
        (kernel,) = cuflash2.varlen_forward_kernels(q, k, v, *args, dropout_p=0.1, seed=1)
        assert kernel.startswith("mma.sync forward")
        longest = _dispatch.MMA_SYNC_MAX_KEYS
        lengths = [100, 0, longest]
        cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32))
        x = cupy.asarray(numpy.zeros((sum(lengths), 2, 64), numpy.float16))
        (kernel,) = cuflash2.varlen_forward_kernels(x, x, x, cu, cu, longest, longest)
        assert kernel.startswith("mma.sync forward")
        lengths[2] = longest + 1
        cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32))
        x = cupy.asarray(numpy.zeros((sum(lengths), 2, 64), numpy.float16))
        (kernel,) = cuflash2.varlen_forward_kernels(x, x, x, cu, cu, longest + 1, longest + 1)
        assert kernel.startswith("Hopper forward")


# --------------------------------------------------------------------------------------------
# The Hopper kernel on varlen calls


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", ["plain", "causal", "window", "softcap-alibi-causal"])
def test_varlen_matches_the_reference(dtype, headdim, layout, option):
    with _hopper_varlen():
        _check(layout, headdim, dtype, option)


@needs_hopper
@pytest.mark.parametrize("headdim", [40, 72, 80, 136, 200])
@pytest.mark.parametrize("option", ["causal", "left-window-causal", "softcap", "alibi"])
def test_varlen_head_dims_between_the_kernels(headdim, option):
    with _hopper_varlen():
        _check("sq!=sk-gqa", headdim, BF16, option)


@needs_hopper
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("option", ["plain", "causal", "window"])
def test_varlen_every_schedule(pingpong, overlap, headdim, option):
    with _hopper_varlen(pingpong=pingpong, overlap=overlap):
        _check("ragged", headdim, FP16, option)


@needs_hopper
@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen_equals_the_dense_hopper_call_per_sequence(headdim):
    """Each sequence of a varlen call against the dense Hopper call on that sequence alone: the
    same tiles and the same order of operations, so bitwise equal (the neighbours' rows read by
    the boxes change nothing: their keys are masked, their P is 0)."""
    q, k, v, args = _inputs("ragged", headdim, BF16, 3)
    cu_q, cu_k = (cupy.asnumpy(c) for c in args[:2])
    with _hopper_varlen():
        out, lse = cuflash2.attention_varlen(q, k, v, *args, return_lse=True, causal=True)
        for b in range(len(cu_q) - 1):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if rows.stop == rows.start or keys.stop == keys.start:
                continue
            qs, ks, vs = (cupy.ascontiguousarray(x) for x in (q[rows], k[keys], v[keys]))
            (kernel,) = cuflash2.forward_kernels(qs, ks, vs, causal=True)
            if not kernel.startswith("Hopper forward"):
                continue  # a short d=64 sequence runs on mma.sync when alone
            dense, dense_lse = cuflash2.attention(qs, ks, vs, causal=True, return_lse=True)
            assert bool(cupy.array_equal(out[rows], dense))
            assert bool(cupy.array_equal(lse[:, rows], dense_lse))


@needs_hopper
def test_varlen_plan_hit_patches_the_maps():
    """A second call of the same signature with other arrays (and other cu_seqlens values of the
    same shape) runs on the plan's maps, patched to the new addresses."""
    with _hopper_varlen():
        for seed in (4, 5):
            q, k, v, args = _inputs("sq!=sk-gqa", 128, FP16, seed)
            out = cuflash2.attention_varlen(q, k, v, *args, causal=True)
            ref_hi = reference.attention_varlen(q, k, v, *args, compute_dtype=numpy.float32,
                                                causal=True)
            ref_lo = reference.attention_varlen(q, k, v, *args, compute_dtype=q.dtype,
                                                causal=True)
            result = testing.check_close("out", out, ref_hi, ref_lo)
            assert result.ok, str(result)


# --------------------------------------------------------------------------------------------
# The Hopper backward on varlen calls


def _hopper_bwd_varlen(enabled: bool = True):
    """Plans made inside run varlen backwards on the Hopper backward (or not)."""
    return switched(_dispatch, {"HOPPER_BACKWARD_VARLEN": enabled}, api._backward_plans)


def _main_kernel_of_last_backward():
    (plan,) = api._backward_plans.plans.values()
    return plan.kernels[1] if len(plan.kernels) > 1 else plan.kernels[0]


def _check_backward(layout, headdim, dtype, option, deterministic=False, runs=1):
    """The varlen backward (on the kernel the flags choose) against the reference's gradients,
    2x rule, `runs` times into poisoned gradients, every run bitwise the first (deterministic
    mode); returns the main kernel's configuration."""
    seed = _seed("bwd", layout, headdim, option, str(dtype))
    q, k, v, args = _inputs(layout, headdim, dtype, seed)
    batch, nheads = args[0].shape[0] - 1, q.shape[1]
    options = _options(option, batch, nheads, seed + 1)
    rng = numpy.random.default_rng(seed + 2)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
    out, lse = cuflash2.attention_varlen(q, k, v, *args, return_lse=True, **options)
    api._backward_plans.plans.clear()
    all_grads = []
    for _ in range(runs):
        poisoned = [testing.poison_like(cupy, x.shape, dtype) for x in (q, k, v)]
        all_grads.append(cuflash2.attention_varlen_backward(
            dout, q, k, v, out, lse, *args, deterministic=deterministic, dq=poisoned[0],
            dk=poisoned[1], dv=poisoned[2], **options))
    config = _main_kernel_of_last_backward()
    grads = all_grads[0]
    for result in testing.check_varlen_backward(dout, q, k, v, *grads, *args, **options):
        assert result.ok, f"{result} ({_configs.describe(config)})"
    for run in all_grads[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), grads, run):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), name
    return config


@needs_hopper
def test_varlen_backward_runs_on_the_hopper_kernel_unless_switched_off():
    with _hopper_bwd_varlen():
        config = _check_backward("ragged", 128, FP16, "causal")
        assert isinstance(config, _configs.BwdSm90Config)
        assert config.features & _configs.FEATURE_VARLEN
    with _hopper_bwd_varlen(enabled=False):
        config = _check_backward("ragged", 128, FP16, "causal")
        assert not isinstance(config, _configs.BwdSm90Config)
        config = _check_backward("ragged", 128, FP16, "causal", deterministic=True)
        assert not isinstance(config, _configs.BwdSm90Config)


@needs_hopper
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["ragged", "sq!=sk-gqa"])
@pytest.mark.parametrize("option", ["plain", "causal", "window", "softcap-alibi-causal"])
def test_deterministic_varlen_backward_on_the_hopper_kernel(headdim, layout, option):
    """deterministic=True with varlen: the semaphore slot of each sequence's query block (its
    first statistics row / DQ_SEMAPHORE_ROWS, plus the head-dim chunk); three runs bitwise equal,
    the 2x rule."""
    with _hopper_bwd_varlen():
        config = _check_backward(layout, headdim, BF16, option, deterministic=True, runs=3)
    assert isinstance(config, _configs.BwdSm90Config) and config.deterministic, config


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", ["plain", "causal", "window", "softcap-alibi-causal"])
def test_varlen_backward_matches_the_reference(dtype, headdim, layout, option):
    with _hopper_bwd_varlen():
        config = _check_backward(layout, headdim, dtype, option)
    assert isinstance(config, _configs.BwdSm90Config), config


@needs_hopper
@pytest.mark.parametrize("headdim", [40, 72, 80, 136, 200])
@pytest.mark.parametrize("option", ["causal", "left-window-causal", "softcap", "alibi"])
def test_varlen_backward_head_dims_between_the_kernels(headdim, option):
    with _hopper_bwd_varlen():
        config = _check_backward("sq!=sk-gqa", headdim, BF16, option)
    assert isinstance(config, _configs.BwdSm90Config), config
