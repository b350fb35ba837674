"""Backward argument validation (CPU): `_validate.check_backward_inputs` on NumPy arrays.

The checks are pure Python on .shape/.dtype/.strides, so NumPy arrays exercise exactly what
`cuflash2.attention_backward` runs before any launch. Every error must name the argument; the
patterns below only look for that name, not for the wording.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import _validate
from test_plans_host import api_host, launches  # noqa: F401  (fixtures)

FP16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
# Sizes all different, so that a transposed or swapped shape is detectably wrong.
B, SQ, SK, H, HK, D = 2, 33, 47, 4, 2, 64


def _normal(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _args(b=B, sq=SQ, sk=SK, h=H, hk=HK, d=D, dtype=FP16, batched=True):
    """Valid backward arguments: dout, q, k, v, out, lse (lse float32 (b, h, sq))."""
    lead = (b,) if batched else ()
    q = _normal(lead + (sq, h, d), dtype, 1)
    k = _normal(lead + (sk, hk, d), dtype, 2)
    v = _normal(lead + (sk, hk, d), dtype, 3)
    dout = _normal(q.shape, dtype, 4)
    out = _normal(q.shape, dtype, 5)
    lse = _normal(lead + (h, sq), np.float32, 6)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


def _check(args, **outputs):
    problem = _validate.check_attention_inputs(args["q"], args["k"], args["v"])
    return _validate.check_backward_inputs(
        problem, args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"],
        **outputs,
    )


def _grads_like(args, dtype=None):
    return {
        name: np.zeros(args[like].shape, dtype or args[like].dtype)
        for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v"))
    }


# --------------------------------------------------------------------------------------------
# Valid arguments.


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_valid_arguments(dtype, batched):
    args = _args(dtype=dtype, batched=batched)
    _check(args)
    _check(args, **_grads_like(args))


@pytest.mark.parametrize("sizes", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)], ids=str)
def test_zero_size_is_valid(sizes):
    b, sq, sk = sizes
    args = _args(b=b, sq=sq, sk=sk)
    _check(args, **_grads_like(args))


def test_strided_arguments_are_accepted():
    """Sliced dout, out and dq/dk/dv (strides multiples of 8 elements) are fine."""
    args = _args()
    wide = {name: _normal(x.shape[:-2] + (2 * x.shape[-2], x.shape[-1]), FP16)
            for name, x in args.items() if name != "lse"}
    args.update({name: x[:, :, ::2] for name, x in wide.items()})
    grads = {name: np.zeros(args[like].shape[:-1] + (D + 8,), FP16)[..., :D]
             for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    assert not any(x.flags.c_contiguous for x in grads.values())
    _check(args, **grads)


# --------------------------------------------------------------------------------------------
# Each bad argument is named.

BAD_ARGUMENTS = {
    # name: (argument named in the error, function of the valid arguments -> bad replacements)
    "dout_seqlen": ("dout", lambda a: {"dout": a["dout"][:, :-1]}),
    "dout_nheads": ("dout", lambda a: {"dout": _normal((B, SQ, HK, D), FP16)}),
    "dout_headdim": ("dout", lambda a: {"dout": _normal((B, SQ, H, D // 2), FP16)}),
    "dout_unbatched": ("dout", lambda a: {"dout": a["dout"][0]}),
    "dout_bf16": ("dout", lambda a: {"dout": a["dout"].astype(BF16)}),
    "dout_float32": ("dout", lambda a: {"dout": a["dout"].astype(np.float32)}),
    "out_seqlen": (r"\bout\b", lambda a: {"out": a["out"][:, :-1]}),
    "out_headdim": (r"\bout\b", lambda a: {"out": _normal((B, SQ, H, D // 2), FP16)}),
    "out_bf16": (r"\bout\b", lambda a: {"out": a["out"].astype(BF16)}),
    "lse_transposed": ("lse", lambda a: {"lse": np.zeros((B, SQ, H), np.float32)}),
    "lse_seqlen": ("lse", lambda a: {"lse": np.zeros((B, H, SQ + 1), np.float32)}),
    "lse_batch": ("lse", lambda a: {"lse": a["lse"][:1]}),
    "lse_unbatched": ("lse", lambda a: {"lse": a["lse"][0]}),
    "lse_float16": ("lse", lambda a: {"lse": a["lse"].astype(np.float16)}),
    "lse_float64": ("lse", lambda a: {"lse": a["lse"].astype(np.float64)}),
}

BAD_OUTPUTS = {
    "dq_shape_of_k": ("dq", lambda a: {"dq": np.zeros(a["k"].shape, FP16)}),
    "dq_bf16": ("dq", lambda a: {"dq": np.zeros(a["q"].shape, BF16)}),
    "dq_float32": ("dq", lambda a: {"dq": np.zeros(a["q"].shape, np.float32)}),
    "dk_shape_of_q": ("dk", lambda a: {"dk": np.zeros(a["q"].shape, FP16)}),
    "dk_bf16": ("dk", lambda a: {"dk": np.zeros(a["k"].shape, BF16)}),
    "dv_nheads": ("dv", lambda a: {"dv": np.zeros((B, SK, H, D), FP16)}),
    "dv_bf16": ("dv", lambda a: {"dv": np.zeros(a["v"].shape, BF16)}),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_input_is_named(case):
    pattern, make_bad = BAD_ARGUMENTS[case]
    args = _args()
    args.update(make_bad(args))
    with pytest.raises((TypeError, ValueError), match=pattern):
        _check(args)


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_bad_output_is_named(case):
    pattern, make_bad = BAD_OUTPUTS[case]
    args = _args()
    outputs = _grads_like(args)
    outputs.update(make_bad(args))
    with pytest.raises((TypeError, ValueError), match=pattern):
        _check(args, **outputs)


def test_unbatched_lse_shape():
    """Unbatched inputs take lse (nheads, seqlen_q); the batched (1, nheads, seqlen_q) is not it."""
    args = _args(batched=False)
    args["lse"] = args["lse"][None]
    with pytest.raises((TypeError, ValueError), match="lse"):
        _check(args)


def test_noncontiguous_lse_is_named():
    args = _args()
    args["lse"] = np.ascontiguousarray(args["lse"].transpose(0, 2, 1)).transpose(0, 2, 1)
    assert args["lse"].shape == (B, H, SQ) and not args["lse"].flags.c_contiguous
    with pytest.raises(ValueError, match="lse"):
        _check(args)


@pytest.mark.parametrize("name", ["dout", "out", "dq", "dk", "dv"])
def test_last_dim_not_contiguous_is_named(name):
    args = _args()
    outputs = _grads_like(args)
    target = outputs if name in outputs else args
    x = target[name]
    # Same shape and values, headdim stride != 1.
    target[name] = np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 3)), 1, 3)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _check(args, **outputs)


# --------------------------------------------------------------------------------------------
# NumPy arrays given to the GPU functions get a hint (raised before CuPy is imported).


def test_numpy_dout_gets_a_hint():
    args = _args()
    with pytest.raises(TypeError, match="dout"):
        cuflash2.attention_backward(
            args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"]
        )


def test_numpy_vjp_input_gets_a_hint():
    args = _args()
    with pytest.raises(TypeError, match=r"\bq\b"):
        cuflash2.attention_vjp(args["q"], args["k"], args["v"])


# The sinks' gradient (dsinks=): a float32 (nheads,) contiguous CuPy array on the device, given
# only with sinks.


@pytest.mark.parametrize("dsinks,sinks,exc,pattern", [
    (np.zeros(4, np.float32), None, ValueError, r"dsinks receives the gradient of sinks"),
    (np.zeros(4, np.float64), np.zeros(4, np.float32), TypeError,
     r"dsinks must be a float32 array"),
    (np.zeros(3, np.float32), np.zeros(4, np.float32), ValueError,
     r"dsinks must have shape \(nheads,\) = \(4,\)"),
    (np.zeros(8, np.float32)[::2], np.zeros(4, np.float32), ValueError,
     r"dsinks must be contiguous"),
])
def test_bad_dsinks_are_named(dsinks, sinks, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _validate.check_dsinks(dsinks, sinks, 4)
    _validate.check_dsinks(None, None, 4)
    _validate.check_dsinks(np.zeros(4, np.float32), np.zeros(4, np.float32), 4)


def test_wrong_dsinks_are_named_before_any_launch(api_host):
    """Through attention_backward (on the CuPy stand-in of tests/test_plans_host.py)."""
    from test_plans_host import device_array

    q, k = device_array((B, SQ, H, D)), device_array((B, SK, HK, D))
    lse = device_array((B, H, SQ), np.float32)
    sinks = device_array((H,), np.float32)
    cases = [
        (dict(dsinks=device_array((H,), np.float32)), ValueError, r"dsinks receives the gradient"),
        (dict(sinks=sinks, dsinks=np.zeros(H, np.float32)), TypeError, r"dsinks is a numpy array"),
        (dict(sinks=sinks, dsinks=device_array((H,), np.float16)), TypeError,
         r"dsinks must be a float32 array"),
        (dict(sinks=sinks, dsinks=device_array((H, 1), np.float32)), ValueError,
         r"dsinks must have shape \(nheads,\)"),
        (dict(sinks=sinks, dsinks=device_array((H,), np.float32, device=1)), ValueError,
         r"dsinks is on device 1"),
        (dict(sinks=np.zeros(H, np.float32)), TypeError, r"sinks is a numpy array"),
    ]
    for options, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            cuflash2.attention_backward(q, q, k, k, q, lse, **options)
    assert not api_host.launches
