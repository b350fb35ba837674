"""The additive bias (`bias=`, issue 44) as the kernels take it: a score modifier.

`bias` (batch or 1, nheads or 1, seqlen_q, seqlen_k) is added to the scores the softmax sees,
after softcap and ALiBi and before the user's score modifier and the mask (cuflash2.reference's
order). The kernels get it as the score modifier `score + cf2_bias(b, h, q_idx, kv_idx)`, the
user's `score_mod` (if any) applied to that sum: one more array input of the mods kernels
(cuflash2.mods), read through a 4-D view whose strides are 0 along the dims the bias
broadcasts, so the expression is the same for every shape. Its derivative with respect to the
score is the user modifier's at the biased score (1 without one).

dbias: the backward main kernel writes dS (the gradient at the score modifier's input, which is
the bias's) into a zeroed float32 array of the bias's shape (FEATURE_BIAS_GRAD,
cuda_src/bias_grad.cuh), adding atomically where the bias broadcasts; the call converts it to
the bias's dtype.
"""

from __future__ import annotations

import re

import numpy

from . import _validate, mods

#: The bias's name in the generated code (users' input names may not start with cf2_).
BIAS_INPUT = "cf2_bias"
_TERM = f"{BIAS_INPUT}(b, h, q_idx, kv_idx)"
_SCORE = re.compile(rf"(?<![A-Za-z0-9_.]){mods.SCORE_NAME}(?![A-Za-z0-9_])")


def bias_view(bias, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, batched: bool,
              varlen: bool, cupy):
    """The checked bias as a (batch, nheads, seqlen_q, seqlen_k) view (strides 0 along its
    broadcast dims; an unbatched call's batch is 1); no copy."""
    if not isinstance(bias, cupy.ndarray):
        raise TypeError(f"bias must be a CuPy array; got {type(bias).__name__}"
                        + (" (use cupy.asarray(bias))" if isinstance(bias, numpy.ndarray)
                           else ""))
    _validate.check_bias(bias, batch, nheads, seqlen_q, seqlen_k, batched, varlen=varlen)
    four = bias if bias.ndim == 4 else bias[None]
    return cupy.broadcast_to(four, (batch if batched else 1, nheads, seqlen_q, seqlen_k))


def _biased(text: str) -> str:
    return _SCORE.sub(f"(score + {_TERM})", text)


def score_mod_with_bias(view, score_mod):
    """The score modifier of a call with a bias (`view`, bias_view's): `score + bias`, or the
    user's `score_mod` at the biased score (its derivative there too; None where it has none,
    which the backward refuses with the user's expression, before this)."""
    signature = mods.InputSignature(BIAS_INPUT, numpy.dtype(view.dtype).name, 4)
    if score_mod is None:
        source = mods.ModSource("score_mod", f"score + {_TERM}", "1.f", (signature,), ())
        arrays = (view,)
    else:
        user = score_mod.source
        derivative = mods.score_derivative(user.expression, user.grad)
        source = mods.ModSource(
            "score_mod", _biased(user.expression),
            None if derivative is None else _biased(derivative),
            user.inputs + (signature,), user.constants)
        arrays = score_mod.arrays + (view,)
    mod = mods.ScoreMod.__new__(mods.ScoreMod)
    mod._init(source, arrays)
    return mod


def is_bias_alone(source) -> bool:
    """Whether the score modifier `source` (a ModSource) is the bias alone, `score + bias`
    (score_mod_with_bias without a user's modifier): the Hopper kernels take it as tiles
    (_dispatch.forward_kernel, _dispatch.backward_kernels; FEATURE_BIAS_TILE)."""
    return (source is not None and source.expression == f"score + {_TERM}"
            and len(source.inputs) == 1 and source.inputs[0].name == BIAS_INPUT
            and not source.constants)


def tile_array(view):
    """The bias's own elements behind `view` (bias_view's) as the (batch or 1, seqlen_q, heads
    or 1, seqlen_k) array the Hopper kernels' TMA map describes (_hopper.tensor_map_geometry's
    (batch, seqlen, heads, headdim) order; extent 1 along each dim the view broadcasts), no
    copy."""
    own = view[tuple(slice(0, 1) if view.strides[i] == 0 else slice(None) for i in (0, 1))]
    return own.transpose(0, 2, 1, 3)


def _four_dims(bias) -> tuple:
    return tuple(bias.shape) if bias.ndim == 4 else (1, *bias.shape)


def shares_elements(bias, view) -> bool:
    """Whether the bias broadcasts over a batch or head dim of the call (`view`, bias_view's):
    then several CTAs add to one dbias element (atomics)."""
    return any(own == 1 < wide for own, wide in zip(_four_dims(bias)[:2], view.shape[:2]))


def gradient_buffer(bias, view, cupy):
    """(float32 zeros of the bias's 4-D shape, its (batch, nheads, seqlen_q, seqlen_k) view):
    where the backward writes dbias."""
    accum = cupy.zeros(_four_dims(bias), dtype=numpy.float32)
    return accum, cupy.broadcast_to(accum, view.shape)


def gradient(bias, accum):
    """dbias shaped and typed like bias from the float32 accumulator."""
    out = accum if accum.dtype == bias.dtype else accum.astype(bias.dtype)
    return out.reshape(bias.shape)


def check_backward(function: str, bias, view, softcap, deterministic) -> None:
    """What the kernels' dbias does not cover yet: NotImplementedError before any launch."""
    if isinstance(softcap, (int, float)) and softcap > 0:
        raise NotImplementedError(
            f"{function}: dbias with softcap > 0 is not implemented in the kernels yet (pass "
            "bias_requires_grad=False, or use cuflash2.reference.attention_backward)")
    if deterministic and shares_elements(bias, view):
        raise NotImplementedError(
            f"{function}: deterministic=True with a bias broadcast over batch or heads: its "
            "dbias is summed with atomics (pass a bias with full batch and heads dims, or "
            "deterministic=False)")


def check_dropout(function: str, dropout_p) -> None:
    """The backward with a bias has no dropout yet (the bias is a score modifier there)."""
    if isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise NotImplementedError(
            f"{function}: bias with dropout_p > 0 has no backward kernel yet")
