"""Reference attention, forward and backward, for NumPy and CuPy arrays alike.

Plain ``softmax(mask(Q K^T * scale)) V`` with the semantics of docs/DESIGN.md §1: bottom-right
causal alignment, sliding windows relative to the same diagonal, GQA/MQA head mapping, and rows
that see no key giving output 0 and ``lse = +inf``. It materialises the (seqlen_q, seqlen_k) score
matrix, so it is for tests and correctness checks, not for speed.

flash-attn's optional features, all off by default:

- ``softcap > 0``: the scaled scores become ``softcap * tanh(scores / softcap)``.
- ``alibi_slopes`` (float32, ``(nheads,)`` or ``(batch, nheads)``): the bias
  ``-slope[h] * |i + seqlen_k - seqlen_q - j|`` is added for query i, key j.
- ``dropout_p`` with an explicit boolean keep-mask ``dropout_mask``: the normalised
  probabilities are multiplied by ``mask / (1 - dropout_p)`` before ``P @ V``; lse is not
  affected. The reference cannot draw the kernel's (Philox) random mask itself, so
  ``dropout_p > 0`` without a mask is an error.
- ``attention_varlen`` / ``attention_varlen_backward``: packed ``(total_tokens, nheads,
  headdim)`` sequences delimited by int32 ``cu_seqlens``, computed sequence by sequence.
- ``sinks`` (``(nheads,)``, any real float dtype; gpt-oss's learnable attention sinks): one logit
  per query head added to every row's softmax denominator, with no value row::

      lse_i = log(sum_j exp(s_ij) + exp(sink_h)),   out_i = sum_j exp(s_ij - lse_i) v_j

  with s_ij the scores as the softmax sees them (scaled, capped, biased, masked keys left out);
  the sink itself is neither scaled, capped, biased nor masked. The returned lse counts the
  sink. A row that sees no key gives out 0 and ``lse = sink`` (without sinks: 0 and +inf).
  Dropout multiplies the normalised key probabilities only (the sink has no value to drop).
  ``sinks = -inf`` is exactly no sink. The backward also returns
  ``dsinks_h = -sum_i exp(sink_h - lse_i) * D_i`` (``D_i = rowsum(dO_i * O_i)``) summed over
  every row of head h (all batch entries, all sequences of a varlen batch); dq, dk and dv keep
  their formulas with P from this lse. Sink values must be finite or -inf (+inf or nan give nan).

Programmable attention (issue 44; the reference's dense forms of what the kernels will compile
from expressions):

- ``bias`` (float16, bfloat16, float32, or float64 for the float64 reference): ``(batch or 1,
  nheads or 1, seqlen_q, seqlen_k)`` (unbatched inputs: ``(nheads or 1, seqlen_q, seqlen_k)``),
  broadcast where a dim is 1; heads are query heads (GQA too). Added to the scores after the
  softcap and the ALiBi bias, before the mask. The backward returns ``dbias`` last (after
  dsinks): dS, the gradient w.r.t. the biased scores (0 at masked entries), summed over the
  broadcast dims, shaped and typed like bias; ``bias_requires_grad=False`` leaves it out.
- ``mask``: boolean, broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``, True = the key is
  visible; ANDed with causal and the window. A row left without keys: out 0, lse +inf (or the
  sink), as for the built-in masks.
- ``score_mod(score, b, h, q_idx, kv_idx) -> new score``: a Python function of xp arrays, score
  ``(b_slice, nheads, seqlen_q, seqlen_k)`` in the accumulation dtype, b the absolute batch
  index, h the query head, q_idx / kv_idx the positions (integer arrays broadcastable against
  score). Applied to the scores after scale, softcap, ALiBi and bias, before the mask (so it
  sees what FlexAttention's score_mod sees when those are off). The backward multiplies dS by
  ``score_mod_grad(score, b, h, q_idx, kv_idx)`` = d new / d score at the same arguments,
  required there; dbias is the gradient at score_mod's input.
- Varlen: bias and mask are padded to the maxima like the dropout mask, ``(batch or 1, nheads or
  1, max_seqlen_q, max_seqlen_k)``, sequence b using ``[b, :, :seqlen_q_b, :seqlen_k_b]``;
  score_mod's b is the sequence's index and q_idx / kv_idx count within the sequence.

Order of operations (flash-attn, csrc/flash_attn/src/flash_fwd_kernel.h
``compute_attn_1rowblock``: ``apply_softcap(acc_s)`` then ``mask.apply_mask(acc_s, ...)``, which
adds the ALiBi bias and then writes -inf; mask.h ``Mask::apply_mask``; the backward kernel
flash_bwd_kernel.h does the same and multiplies dS by ``calculate_dtanh``)::

    s = softmax_scale * q.k                     # scaled scores
    s = softcap * tanh(s / softcap)             # if softcap > 0
    s = s - slope * |i + seqlen_k - seqlen_q - j|   # if alibi_slopes is not None
    s = s + bias[b, h, i, j]                    # if bias is not None
    s = score_mod(s, b, h, i, j)                # if score_mod is not None
    s = -inf where masked (causal / window / not mask[b, h, i, j])
    lse = logsumexp([s, sink]); P = exp(s - lse)    # sink only if given: lse counts it
    out = (P * dropout_mask / (1 - dropout_p)) @ V

``compute_dtype`` float32/float64 computes everything in that dtype (the exact reference).
``compute_dtype`` float16/bfloat16 is the "low-precision reference" of the correctness rule:
matmuls still accumulate in float32, but the values are rounded to ``compute_dtype`` where a
low-precision implementation would round them: the inputs, the scores (once, after scaling,
softcap, ALiBi, bias and score_mod), the probabilities P before ``P @ V`` and the output (and,
in the backward, dP, dS and the gradients). The bias is read in its own dtype (exact in float32;
a float32 bias of an fp16 call is not rounded to fp16 before the scores are), and score_mod
runs in float32 like the rest of the score arithmetic. dbias is dS (the dS of score_mod's
input) in float32 before dS is rounded for the matmuls, summed in float32 over the broadcast
dims and cast once to the bias's dtype, as an implementation writes it from its float32 dS. The dropout factor ``mask / (1 - dropout_p)`` and the
softcap derivative are applied in float32 without an extra rounding. A sink is one more logit of
the same softmax and is rounded like the scores: once to ``compute_dtype`` (a float32 sink of an
fp16 call becomes an fp16 value; beyond fp16's range, +-inf) before the denominator is formed.
In the backward, dsinks = -sum_i P_sink_i * D_i takes the sink's probability exp(sink - lse)
rounded like P and D_i = rowsum(dO_i * O_i) from the output rounded to ``compute_dtype`` (as an
implementation reads the forward's stored output), and is accumulated and returned in float32
(float64 with ``compute_dtype`` float64), not rounded: the kernels return it in float32.
"""

import math
import numbers
import sys

import ml_dtypes
import numpy

from . import _validate, fp8
from ._configs import E4M3_P_SCALE_LOG2
from ._options import AttentionOptions
from ._validate import check_softcap as _check_softcap

__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_with_kvcache",
    "attention_varlen_backward",
    "block_mask_states",
    "block_mask_ranges",
    "block_mask_columns",
    "merge_states",
    "merge_states_many",
]

_LOW_PRECISION = (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
_HIGH_PRECISION = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))

# Upper bound on score elements (batch * nheads * seqlen_q * seqlen_k) computed at once. The
# batch is processed in chunks below this size so that large checks stay within memory
# (a few float32 copies of 2**26 elements is about 1 GB).
_MAX_SCORES_PER_CHUNK = 2**26


def _array_module(*arrays):
    # An array can only be a CuPy array if CuPy has already been imported, so the reference never
    # imports it: it stays cheap and usable on machines without CuPy or CUDA.
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return numpy
    return cupy.get_array_module(*(x for x in arrays if x is not None))


def _to_host(x):
    """A NumPy copy of x (a CuPy array is copied from the device: a synchronisation)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    return numpy.asarray(x)


def _round_tf32(x):
    """float32 x rounded to TF32 (10 mantissa bits, to nearest, ties away from zero: the
    tensor cores' cvt.rna), as float32; NumPy or CuPy."""
    bits = x.view(numpy.uint32)
    return ((bits + numpy.uint32(0x1000)) & numpy.uint32(0xFFFFE000)).view(numpy.float32)


class _Precision:
    """Which dtype the maths runs in (``acc``) and what values are rounded to (``round_to``).

    compute_dtype "tf32" is the low-precision reference of float32 inputs at precision "tf32":
    float32 maths with the inputs and the probabilities rounded to TF32 (the operands of the
    tensor-core products), the scores not (they are float32 accumulators). compute_dtype "e4m3"
    is the FP8 forward's, its result in `out_dtype` (bfloat16 by default, or float16; other
    compute dtypes ignore it)."""

    def __init__(self, compute_dtype, out_dtype=None):
        self.scores_rounded = True
        self.weights_to_e4m3 = False
        if _is_e4m3_compute(compute_dtype):
            # The FP8 forward's (docs/FP8_FORWARD.md): e4m3 products are exact in float32
            # accumulators, so the inputs (dequantised) and the scores are not rounded; the
            # unnormalised probabilities exp(s - max) are, to e4m3, as the A operand of P V.
            self.acc = numpy.dtype(numpy.float32)
            self.result = numpy.dtype(ml_dtypes.bfloat16 if out_dtype is None else out_dtype)
            if self.result not in (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16)):
                raise ValueError(f"out_dtype must be bfloat16 or float16; got {self.result}")
            self.round_to = None
            self.scores_rounded = False
            self.weights_to_e4m3 = True
            return
        if isinstance(compute_dtype, str) and compute_dtype == "tf32":
            self.acc = self.result = numpy.dtype(numpy.float32)
            self.round_to = "tf32"
            self.scores_rounded = False
            return
        dtype = numpy.dtype(compute_dtype)
        if dtype in _HIGH_PRECISION:
            self.acc, self.round_to = dtype, None
        elif dtype in _LOW_PRECISION:
            self.acc, self.round_to = numpy.dtype(numpy.float32), dtype
        else:
            raise ValueError(
                f"compute_dtype must be float16, bfloat16, float32, float64, 'tf32' or 'e4m3', "
                f"got {dtype}"
            )
        self.result = dtype

    def round(self, x):
        if self.round_to is None:
            return x
        if self.round_to == "tf32":
            return _round_tf32(x)
        return x.astype(self.round_to).astype(self.acc)

    def round_weights(self, x):
        """The unnormalised probabilities exp(s - max) as P V takes them (e4m3 for "e4m3": of
        2^E4M3_P_SCALE_LOG2 times each, as the kernel rounds them)."""
        if not self.weights_to_e4m3:
            return x
        scale = float(2 ** E4M3_P_SCALE_LOG2)
        return fp8.e4m3_to_float(fp8.float_to_e4m3(x * scale)) / scale

    def round_scores(self, x):
        """The scores (and sinks) as the implementation holds them."""
        return self.round(x) if self.scores_rounded else x

    def load(self, x):
        # Through acc first: every input float dtype converts to float32/float64 exactly (or
        # with a single rounding), on NumPy and CuPy alike.
        return self.round(x.astype(self.acc))


def _check_shapes(q, k, v, fp8_ok=False):
    """q, k, v's shapes; FP8 arrays (uint8, float8_e4m3fn) only where `fp8_ok` (attention's
    FP8 inputs, before their dequantisation): elsewhere their bits would be read as numbers."""
    if not fp8_ok:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if numpy.dtype(x.dtype) in fp8.E4M3_DTYPES:
                raise TypeError(f"{name} is {x.dtype}: FP8 inputs are taken by "
                                f"reference.attention and reference.attention_varlen "
                                f"(qkv_dtype='e4m3') only, not by the backward forms")
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "q, k, v must all be (batch, seqlen, nheads, headdim) or all "
            f"(seqlen, nheads, headdim); got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape[:-1] != v.shape[:-1] or v.shape[-1] < 1:
        raise ValueError(f"k and v must have the same shape but for their head dims (v's, d_v, "
                         f"may differ from q's and k's, d_qk), got {k.shape} and {v.shape}")
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k have different batch sizes: {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k have different head dims: {q.shape[-1]} and {k.shape[-1]}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})"
        )
    # One input dtype, as the kernels take: a mix would be computed without a word, each array
    # rounded (compute_dtype's low precision) as if it were the others' type.
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}); got {x.dtype}. "
                            f"Cast explicitly, e.g. {name}.astype(q.dtype)")


def _scale(softmax_scale, headdim):
    if softmax_scale is not None:
        return float(softmax_scale)
    return 1.0 / math.sqrt(headdim)


def _visible_keys(xp, seqlen_q, seqlen_k, options):
    """Boolean (seqlen_q, seqlen_k) mask: query i sees key j (options.causal and
    options.window_size)."""
    left, right = options.window_size
    if options.causal:
        # Causal is the window's right edge at the diagonal; -1 means unbounded.
        right = 0 if right < 0 else min(right, 0)
    rows = xp.arange(seqlen_q)[:, None]
    cols = xp.arange(seqlen_k)[None, :]
    diagonal = rows + (seqlen_k - seqlen_q)  # bottom-right aligned
    visible = xp.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= cols >= diagonal - left
    if right >= 0:
        visible &= cols <= diagonal + right
    return visible


def _group_query_heads(x, nheads_kv):
    """(b, s, nheads, d) -> (b, nheads_kv, group * s, d).

    Query head h = kv * group + g reads KV head kv, so putting the group's rows after one
    another turns GQA into one plain batched matmul per KV head (and makes dK, dV sum over
    the group by themselves).
    """
    b, s, nheads, d = x.shape
    group = nheads // nheads_kv
    x = x.reshape(b, s, nheads_kv, group, d).transpose(0, 2, 3, 1, 4)
    return x.reshape(b, nheads_kv, group * s, d)


def _ungroup_query_heads(x, group, seqlen):
    """Inverse of _group_query_heads: (b, nheads_kv, group * s, d) -> (b, s, nheads, d)."""
    b, nheads_kv, _, d = x.shape
    x = x.reshape(b, nheads_kv, group, seqlen, d).transpose(0, 3, 1, 2, 4)
    return x.reshape(b, seqlen, nheads_kv * group, d)


def _kv_heads_first(x):
    """(b, s, nheads_kv, d) -> (b, nheads_kv, s, d)."""
    return x.transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------------------------
# Optional features: softcap, ALiBi, dropout with an explicit mask, attention sinks.


def _check_dropout_p(dropout_p):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not (0.0 <= dropout_p < 1.0):  # also rejects nan
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return dropout_p


def _check_alibi_slopes(xp, alibi_slopes, batch, nheads, unbatched):
    """alibi_slopes as a float32 (batch, nheads) array (a broadcast view), or None."""
    if alibi_slopes is None:
        return None
    _validate.check_alibi_slopes(alibi_slopes, batch, nheads, not unbatched, contiguous=False)
    return xp.broadcast_to(xp.asarray(alibi_slopes), (batch, nheads))


def _check_sinks(xp, sinks, nheads):
    """sinks as an xp array (nheads,) of its own dtype, or None.

    Any real float dtype (float16, bfloat16, float32, float64) is accepted: the kernels take
    float32, and a float64 array lets the float64 reference be differentiated w.r.t. the sinks.
    Values are not checked (finite or -inf, as documented).
    """
    if sinks is None:
        return None
    dtype = getattr(sinks, "dtype", None)
    if dtype is None:
        raise TypeError(
            "sinks must be a float array of one logit per query head, shape (nheads,); got "
            f"{type(sinks).__name__}"
        )
    dtype = numpy.dtype(dtype)
    if dtype.kind != "f" and dtype not in _LOW_PRECISION:
        raise TypeError(
            "sinks must be a real float array (float32 for the kernels; float16, bfloat16, "
            f"float32 or float64 for the reference); got dtype {dtype}"
        )
    shape = tuple(sinks.shape)
    if shape != (nheads,):
        raise ValueError(
            f"sinks must have shape (nheads,) = ({nheads},), one logit per query head; got "
            f"{shape}"
        )
    return xp.asarray(sinks)


def _check_dropout(xp, dropout_p, dropout_mask, shape, shape_doc):
    """The keep-mask broadcast to ``shape`` (a view), or None without dropout."""
    dropout_p = _check_dropout_p(dropout_p)
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError(
                f"dropout_p={dropout_p} needs dropout_mask: the reference cannot reproduce the "
                "kernel's random (Philox) dropout mask, so pass the boolean keep-mask the kernel "
                "used (from its testing mode that returns the mask)"
            )
        return dropout_p, None
    return dropout_p, _broadcast_boolean(xp, dropout_mask, "dropout_mask",
                                         "a boolean keep-mask (True = kept)", shape, shape_doc)


def _broadcast_boolean(xp, x, name, what, shape, shape_doc):
    """x, a boolean array, broadcast to ``shape`` (a view); TypeError / ValueError naming it."""
    _validate.check_dtype(x, numpy.bool_, f"{name} must be {what}")
    x = xp.asarray(x)
    try:
        return xp.broadcast_to(x, shape)
    except ValueError:
        raise ValueError(
            f"{name} must be broadcastable to {shape_doc} = {shape}; got {x.shape}"
        ) from None


def _check_mask(xp, mask, shape, shape_doc):
    """The boolean visibility mask broadcast to ``shape`` (a view), or None."""
    if mask is None:
        return None
    return _broadcast_boolean(xp, mask, "mask", "a boolean array (True = the key is visible)",
                              shape, shape_doc)


class _Modifiers:
    """The reference-side forms of issue 44's programmable attention for one call, beside its
    AttentionOptions (whose ``bias`` is the additive bias): the dense boolean ``mask``, the
    Python ``score_mod`` and its derivative ``score_mod_grad``, ``bias_requires_grad`` (the
    backward returns dbias only when set), and ``first_batch``, the batch index of the call's
    first batch entry as score_mod sees it (a varlen sequence's index)."""

    def __init__(self, mask=None, score_mod=None, score_mod_grad=None, bias_requires_grad=True,
                 first_batch=0):
        for name, fn in (("score_mod", score_mod), ("score_mod_grad", score_mod_grad)):
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"{name} must be a callable (score, b, h, q_idx, kv_idx) -> array; got "
                    f"{type(fn).__name__}"
                )
        if score_mod is None and score_mod_grad is not None:
            raise ValueError("score_mod_grad is the derivative of score_mod: pass it only with "
                             "score_mod=")
        self.mask, self.score_mod, self.score_mod_grad = mask, score_mod, score_mod_grad
        self.bias_requires_grad = bool(bias_requires_grad)
        self.first_batch = first_batch

    def replace(self, **changes):
        values = dict(vars(self), **changes)
        return _Modifiers(**values)


_NO_MODIFIERS = _Modifiers()


def _check_score_mod_grad(mods):
    if mods.score_mod is not None and mods.score_mod_grad is None:
        raise ValueError(
            "score_mod needs score_mod_grad in the backward: a callable (score, b, h, q_idx, "
            "kv_idx) -> d score_mod(score, ...) / d score (e.g. lambda s, b, h, q, k: "
            "numpy.ones_like(s) for score + <anything without score>)"
        )


class _Features:
    """softcap, ALiBi, dropout, sinks, bias, mask and score_mod of one dense (batched-form) call
    (its AttentionOptions, dropout mask and _Modifiers), checked."""

    def __init__(self, xp, prec, shape, options, dropout_mask, unbatched, mods=_NO_MODIFIERS):
        batch, nheads, seqlen_q, seqlen_k = shape
        self.xp, self.prec, self.nheads = xp, prec, nheads
        self.mods = mods
        self.user_bias = None
        if _validate.check_bias(options.bias, batch, nheads, seqlen_q, seqlen_k, not unbatched,
                                float64=True) is not None:
            bias = xp.asarray(options.bias)
            self.bias_shape = bias.shape
            # Batched form (batch or 1, nheads or 1, seqlen_q, seqlen_k), in its own dtype.
            self.user_bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        self.softcap = _check_softcap(options.softcap)
        self.slopes = _check_alibi_slopes(xp, options.alibi_slopes, batch, nheads, unbatched)
        self.sinks = _check_sinks(xp, options.sinks, nheads)
        if self.slopes is not None:
            # |i + seqlen_k - seqlen_q - j|: distance from the bottom-right aligned diagonal.
            # flash-attn's kernel adds slope * j instead in causal (non-local) mode (mask.h:
            # "Col_idx_only"), which differs from this by a per-row constant: the same P and
            # output, but its lse is larger by slope * (i + seqlen_k - seqlen_q). This reference
            # follows the formula flash-attn documents (flash_attn_func's docstring), for lse too.
            rows = xp.arange(seqlen_q)[:, None]
            cols = xp.arange(seqlen_k)[None, :]
            self.distance = xp.abs(rows + (seqlen_k - seqlen_q) - cols).astype(prec.acc)
        doc = "(nheads, seqlen_q, seqlen_k)" if unbatched else "(batch, nheads, seqlen_q, seqlen_k)"
        self.dropout_p, self.mask = _check_dropout(xp, options.dropout_p, dropout_mask, shape,
                                                   doc)
        self.visibility = _check_mask(xp, mods.mask, shape[1:] if unbatched else shape, doc)
        if self.visibility is not None and unbatched:
            self.visibility = self.visibility[None]

    def bias(self, part, nheads_kv):
        """The additive terms for a batch slice, in the order they are added: the ALiBi bias,
        then the user's bias, each broadcastable to (b, nheads_kv, group, seqlen_q, seqlen_k)
        in prec.acc (the bias in its own dtype, converted exactly: not rounded to
        compute_dtype). A tuple, empty without either."""
        terms = []
        group = self.nheads // nheads_kv
        if self.slopes is not None:
            slopes = self.slopes[part].astype(self.prec.acc)
            b = slopes.shape[0]
            slopes = slopes.reshape(b, nheads_kv, group, 1, 1)
            terms.append(-slopes * self.distance)
        if self.user_bias is not None:
            bias = self.user_bias if self.user_bias.shape[0] == 1 else self.user_bias[part]
            b, heads, seqlen_q, seqlen_k = bias.shape
            # Bias heads index query heads, h = kv * group + g.
            heads = (1, 1) if heads == 1 else (nheads_kv, group)
            terms.append(bias.astype(self.prec.acc).reshape(b, *heads, seqlen_q, seqlen_k))
        return tuple(terms)

    def visible(self, part, nheads_kv, visible):
        """The (seqlen_q, seqlen_k) causal/window mask ANDed with the user's mask for a batch
        slice: (b, nheads_kv, group, seqlen_q, seqlen_k), or ``visible`` itself without one."""
        if self.visibility is None:
            return visible
        mask = self.visibility[part]
        b, nheads, seqlen_q, seqlen_k = mask.shape
        return mask.reshape(b, nheads_kv, nheads // nheads_kv, seqlen_q, seqlen_k) & visible

    def _modify(self, fn, name, scores, part):
        """fn(score, b, h, q_idx, kv_idx) on (b, nheads_kv, group, seqlen_q, seqlen_k) scores,
        shown to fn as (b, nheads, seqlen_q, seqlen_k); the result in prec.acc, shaped like
        scores."""
        xp = self.xp
        shape5 = scores.shape
        if scores.size == 0:
            return scores
        b, nheads, seqlen_q, seqlen_k = shape5[0], self.nheads, shape5[3], shape5[4]
        start = self.mods.first_batch + (part.start or 0)
        indices = (
            xp.arange(start, start + b).reshape(b, 1, 1, 1),
            xp.arange(nheads).reshape(1, nheads, 1, 1),
            xp.arange(seqlen_q).reshape(1, 1, seqlen_q, 1),
            xp.arange(seqlen_k).reshape(1, 1, 1, seqlen_k),
        )
        # A copy: fn may write into its argument, and the backward needs the scores it saw.
        flat = scores.reshape(b, nheads, seqlen_q, seqlen_k).copy()
        result = xp.asarray(fn(flat, *indices))
        try:
            result = xp.broadcast_to(result, flat.shape)
        except ValueError:
            raise ValueError(
                f"{name} must return an array broadcastable to the scores' shape (b, nheads, "
                f"seqlen_q, seqlen_k) = {flat.shape}; got shape {result.shape}"
            ) from None
        return result.astype(self.prec.acc).reshape(shape5)

    def score_mod(self, part):
        """scores -> score_mod(scores, b, h, q_idx, kv_idx) for a batch slice, or None."""
        if self.mods.score_mod is None:
            return None
        return lambda scores: self._modify(self.mods.score_mod, "score_mod", scores, part)

    def score_mod_grad(self, scores, part):
        """d score_mod / d score at ``scores`` (score_mod's input), shaped like them."""
        return self._modify(self.mods.score_mod_grad, "score_mod_grad", scores, part)

    @property
    def wants_dbias(self):
        return self.user_bias is not None and self.mods.bias_requires_grad

    def sink_logits(self, nheads_kv):
        """The sinks as (1, nheads_kv, group, 1, 1) in prec.acc (not yet rounded), or None."""
        if self.sinks is None:
            return None
        sinks = self.sinks.astype(self.prec.acc)
        return sinks.reshape(1, nheads_kv, self.nheads // nheads_kv, 1, 1)

    def keep(self, part, nheads_kv):
        """mask / (1 - p) as (b, nheads_kv, group * seqlen_q, seqlen_k) in prec.acc, or None."""
        if self.mask is None:
            return None
        mask = self.mask[part]
        b, nheads, seqlen_q, seqlen_k = mask.shape
        # Query head h = kv * group + g, so splitting the head axis groups it like q.
        mask = mask.reshape(b, nheads_kv, (nheads // nheads_kv) * seqlen_q, seqlen_k)
        factor = self.prec.acc.type(1.0 / (1.0 - self.dropout_p))
        return mask.astype(self.prec.acc) * factor


def _probabilities(xp, q, k, scale, visible, group, prec, softcap=0.0, bias=(), sinks=None,
                   score_mod=None):
    """P = softmax(mask(score_mod(bias + cap(q k^T * scale)))), its lse and the softcap's tanh.

    q: (b, nheads_kv, group * seqlen_q, d) and k: (b, nheads_kv, seqlen_k, d), both in
    prec.acc; visible: boolean, broadcastable to (b, nheads_kv, group, seqlen_q, seqlen_k) (the
    (seqlen_q, seqlen_k) causal/window mask, or that ANDed with a user mask); bias: a tuple of
    additive terms broadcastable to the same shape, added in order (ALiBi, then the user's
    bias); sinks None or (1, nheads_kv, group, 1, 1) in prec.acc; score_mod None or a function
    of the (b, nheads_kv, group, seqlen_q, seqlen_k) scores. Returns P (b, nheads_kv,
    group * seqlen_q, seqlen_k) and lse (b, nheads, seqlen_q) in prec.acc, tanh(scaled scores /
    softcap) shaped like P (None without softcap) for the backward, the sinks' probabilities
    exp(sink - lse) (b, nheads_kv, group * seqlen_q, 1) (None without sinks), and score_mod's
    input (None without score_mod), for its derivative in the backward. The sink is one more
    term of the denominator (here, the only place where it is formed, for the forward and the
    backward alike). Rows that see no key get P = 0 and lse = +inf, or lse = sink with a sink.
    """
    b, nheads_kv = q.shape[:2]
    seqlen_q, seqlen_k = q.shape[2] // group, k.shape[2]
    scores = xp.matmul(q, k.swapaxes(-1, -2)) * scale
    tanh = None
    if softcap > 0:
        # Before the bias and the mask, as flash-attn (the masked entries stay finite here, so
        # the tanh of the backward never sees -inf).
        tanh = xp.tanh(scores / softcap)
        scores = softcap * tanh
    scores = scores.reshape(b, nheads_kv, group, seqlen_q, seqlen_k)
    for term in bias:
        scores = scores + term
    modified = None
    if score_mod is not None:
        # After the additive terms, before the mask (which it cannot undo: masked entries
        # become -inf below whatever it returns).
        modified = scores
        scores = score_mod(scores)
    # One rounding of the final scores: where the plain scaled scores are rounded without
    # features.
    scores = prec.round_scores(scores)
    scores = xp.where(visible, scores, -math.inf)

    # has_mass: the row's denominator has a term (a visible key, or a sink > -inf).
    has_mass = xp.broadcast_to(visible, scores.shape).any(axis=-1, keepdims=True)
    if seqlen_k > 0:
        row_max = scores.max(axis=-1, keepdims=True)  # -inf for key-less rows
    else:  # max of an empty axis is an error; every row is key-less anyway
        row_max = xp.full(scores.shape[:-1] + (1,), -math.inf, dtype=scores.dtype)
    if sinks is not None:
        # The sink is one more logit: rounded as the scores are, part of the max and the sum.
        sinks = prec.round_scores(sinks)
        row_max = xp.maximum(row_max, sinks)
        has_mass = row_max > -math.inf
    # Rows without mass have max -inf; shifting by 0 instead avoids -inf - -inf = nan.
    row_max = xp.where(has_mass, row_max, 0)
    weights = xp.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    row_sum = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        sink_weights = xp.exp(sinks - row_max)  # a sink of -inf adds exactly 0
        row_sum = row_sum + sink_weights
    row_sum = xp.where(has_mass, row_sum, 1)
    probs = prec.round(prec.round_weights(weights) / row_sum)
    lse = xp.where(has_mass, row_max + xp.log(row_sum), math.inf)
    sink_probs = None
    if sinks is not None:
        sink_probs = prec.round(sink_weights / row_sum)
        sink_probs = sink_probs.reshape(b, nheads_kv, group * seqlen_q, 1)
    return (
        probs.reshape(b, nheads_kv, group * seqlen_q, seqlen_k),
        lse.reshape(b, nheads_kv * group, seqlen_q),
        tanh,
        sink_probs,
        modified,
    )


def _batch_slices(batch, scores_per_batch_entry):
    step = max(1, _MAX_SCORES_PER_CHUNK // max(1, scores_per_batch_entry))
    # An empty batch still gets one (empty) slice so that results keep their shapes.
    return [slice(i, i + step) for i in range(0, batch, step)] or [slice(0, 0)]


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    return_lse=False,
    compute_dtype=numpy.float32,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    dropout_p=0.0,
    dropout_mask=None,
    bias=None,
    mask=None,
    score_mod=None,
    score_mod_grad=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    qkv_dtype=None,
    out_dtype=None,
):
    """Reference attention forward.

    q: (batch, seqlen_q, nheads, headdim), k and v: (batch, seqlen_k, nheads_kv, headdim), or
    the same without the batch dim. Any float dtype (float16, ml_dtypes.bfloat16, float32, ...).
    Returns out (shaped like q, dtype compute_dtype) or (out, lse) with lse float32
    (batch, nheads, seqlen_q) (or (nheads, seqlen_q) for unbatched inputs).

    softcap: > 0 caps the scaled scores to ``softcap * tanh(scores / softcap)``; 0 = off.
    alibi_slopes: float32 (nheads,) or (batch, nheads) (unbatched: (nheads,) or (1, nheads));
    adds ``-slope * |i + seqlen_k - seqlen_q - j|`` to the (capped) scores.
    dropout_p, dropout_mask: P is multiplied by ``dropout_mask / (1 - dropout_p)`` before
    ``P @ V`` (lse unchanged); the mask is boolean (True = kept), broadcastable to
    (batch, nheads, seqlen_q, seqlen_k) (unbatched: (nheads, seqlen_q, seqlen_k)), and required
    when dropout_p > 0. A mask given with dropout_p = 0 is applied as is (factor 1).
    sinks: (nheads,) real float array, one logit per query head added to every row's softmax
    denominator (no value row; see the module docstring): lse counts it, a row that sees no key
    gives out 0 and lse = sink.
    bias: (batch or 1, nheads or 1, seqlen_q, seqlen_k) (unbatched: (nheads or 1, seqlen_q,
    seqlen_k)), float16, bfloat16, float32 or float64, added to the (capped, ALiBi-biased)
    scores; a dim of 1 is broadcast; heads are query heads.
    mask: boolean, broadcastable to (batch, nheads, seqlen_q, seqlen_k) (unbatched: (nheads,
    seqlen_q, seqlen_k)), True = the key is visible; ANDed with causal and window_size.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> new score``, applied after the bias
    and before the mask (module docstring); score is (b_slice, nheads, seqlen_q, seqlen_k) in
    the accumulation dtype (float32, or float64 with compute_dtype float64), b (absolute batch
    index), h (query head), q_idx, kv_idx integer arrays broadcastable against it.
    score_mod_grad: its derivative (``attention_backward``), accepted and unused here so that
    one set of options serves the forward and the backward.

    FP8 inputs (docs/FP8_FORWARD.md; the kernels' form: ``cuflash2.attention(..., qkv_dtype=
    "e4m3")`` and ``cuflash2.attention_varlen``'s, on sm_90): q, k, v uint8 arrays of
    e4m3 bits with ``qkv_dtype="e4m3"``, or float8_e4m3fn arrays; an element's value is
    ``e4m3 * descale``, ``q_descale`` / ``k_descale`` / ``v_descale`` float32 ``(batch,
    nheads_kv)`` (a query head takes its KV head's; unbatched inputs ``(1, nheads_kv)``), ``()``
    / ``(1,)`` or a float, default 1. The values are dequantised in float64 and attended as
    any; compute_dtype ``"e4m3"`` is the FP8 forward's low-precision reference: float32 maths
    with the unnormalised probabilities ``exp(s - max)`` rounded to e4m3 (the e4m3 products
    themselves are exact in float32), its output in ``out_dtype`` (bfloat16 by default, or
    float16), which other compute dtypes ignore.
    """
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, bias=bias)
    mods = _Modifiers(mask, score_mod, score_mod_grad)
    q, k, v = _fp8_dequantised(q, k, v, qkv_dtype, (q_descale, k_descale, v_descale),
                               compute_dtype)
    out, lse = _forward(q, k, v, options, compute_dtype, dropout_mask, mods, out_dtype)
    return (out, lse) if return_lse else out


def _is_e4m3_compute(compute_dtype) -> bool:
    return isinstance(compute_dtype, str) and compute_dtype == "e4m3"


def _fp8_dequantised(q, k, v, qkv_dtype, descales, compute_dtype, sequences=None):
    """q, k, v as they are, or for FP8 inputs (uint8 e4m3 bits with qkv_dtype "e4m3", or
    float8_e4m3fn) their values e4m3 * descale in float64; the FP8 arguments checked.
    `sequences`: for packed varlen arrays (total, heads, headdim), (the number of sequences,
    the sequence of each row of q, of k and v): a sequence's row of the (sequences, nheads_kv)
    factors applies to its rows."""
    names = ("q_descale", "k_descale", "v_descale")
    if qkv_dtype is not None and qkv_dtype != "e4m3":
        raise ValueError(f"qkv_dtype must be None or 'e4m3' (FP8 bits in uint8 arrays); got "
                         f"{qkv_dtype!r}")
    is_e4m3 = [numpy.dtype(x.dtype) in fp8.E4M3_DTYPES for x in (q, k, v)]
    if not any(is_e4m3):
        if qkv_dtype is not None:
            raise TypeError(f"qkv_dtype={qkv_dtype!r} needs q, k and v of uint8 (e4m3 bits) or "
                            f"float8_e4m3fn; got {q.dtype}, {k.dtype} and {v.dtype}")
        for name, descale in zip(names, descales):
            if descale is not None:
                raise ValueError(f"{name} is for FP8 inputs (qkv_dtype='e4m3'); q is {q.dtype}")
        if _is_e4m3_compute(compute_dtype):
            raise ValueError(f"compute_dtype 'e4m3' is the FP8 inputs' reference; q is {q.dtype}")
        return q, k, v
    if not all(is_e4m3) or len({numpy.dtype(x.dtype) for x in (q, k, v)}) != 1:
        raise TypeError(f"q, k and v must all be FP8 (one dtype: uint8 e4m3 bits or "
                        f"float8_e4m3fn) or none; got {q.dtype}, {k.dtype} and {v.dtype}")
    if numpy.dtype(q.dtype) == numpy.uint8 and qkv_dtype is None:
        raise TypeError("q, k and v are uint8: pass qkv_dtype='e4m3' if they hold e4m3 bits "
                        "(uint8 is read no other way)")
    xp = _array_module(q, k, v)
    _check_shapes(q, k, v, fp8_ok=True)
    batch, nheads_kv = (k.shape[0], k.shape[2]) if k.ndim == 4 else (1, k.shape[1])
    if sequences is not None:
        batch = sequences[0]
    group = q.shape[-2] // nheads_kv
    values = []
    for x, name, descale in zip((q, k, v), names, descales):
        factors = fp8.descale_values(name, descale, batch, nheads_kv, xp)
        fp8.check_descale_values(name, _to_host(factors))
        if x is q:
            factors = xp.repeat(factors, group, axis=1)  # a query head takes its KV head's
        if sequences is not None:  # each packed row takes its sequence's factors
            factors = factors[xp.asarray(sequences[1 if x is q else 2])][:, :, None]
        else:
            factors = factors[:, None, :, None] if x.ndim == 4 else factors[0][None, :, None]
        values.append(fp8.dequantize_e4m3(x, factors, numpy.float64))
    return tuple(values)


def _forward(q, k, v, options, compute_dtype, dropout_mask, mods=_NO_MODIFIERS,
             out_dtype=None):
    """attention's (out, lse) for the options of one call (an AttentionOptions) and its
    _Modifiers; compute_dtype "e4m3": the output in out_dtype (_Precision)."""
    xp = _array_module(q, k, v, options.alibi_slopes, options.sinks, dropout_mask, options.bias,
                       mods.mask)
    q, k, v = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    _check_shapes(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    prec = _Precision(compute_dtype, out_dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = _scale(options.softmax_scale, headdim)
    visible = _visible_keys(xp, seqlen_q, seqlen_k, options)
    features = _Features(xp, prec, (batch, nheads, seqlen_q, seqlen_k), options, dropout_mask,
                         unbatched, mods)

    outs, lses = [], []
    for part in _batch_slices(batch, nheads * seqlen_q * seqlen_k):
        q_part = _group_query_heads(prec.load(q[part]), nheads_kv)
        k_part = _kv_heads_first(prec.load(k[part]))
        v_part = _kv_heads_first(prec.load(v[part]))
        probs, lse, _, _, _ = _probabilities(
            xp, q_part, k_part, scale, features.visible(part, nheads_kv, visible), group, prec,
            features.softcap, features.bias(part, nheads_kv), features.sink_logits(nheads_kv),
            features.score_mod(part),
        )
        keep = features.keep(part, nheads_kv)
        if keep is not None:
            probs = probs * keep  # dropout after the softmax: lse is unaffected
        out = _ungroup_query_heads(xp.matmul(probs, v_part), group, seqlen_q)
        outs.append(out.astype(prec.result))
        lses.append(lse.astype(numpy.float32))
    out = xp.ascontiguousarray(xp.concatenate(outs))
    lse = xp.ascontiguousarray(xp.concatenate(lses))
    if unbatched:
        out, lse = out[0], lse[0]
    return out, lse


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    compute_dtype=numpy.float32,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    dropout_p=0.0,
    dropout_mask=None,
    bias=None,
    mask=None,
    score_mod=None,
    score_mod_grad=None,
    bias_requires_grad=True,
):
    """Reference attention backward: (dq, dk, dv) in compute_dtype, shaped like q, k, v, then
    dsinks with ``sinks`` and dbias with ``bias``: (dq, dk, dv[, dsinks][, dbias]).

    The exact gradient of ``attention`` (same arguments) w.r.t. q, k and v for the upstream
    gradient ``dout``; with GQA, dk and dv sum over the query heads that share a KV head.
    softcap, alibi_slopes and dropout (with the forward's mask) as in ``attention``; there is
    no gradient w.r.t. the slopes. With sinks, dsinks (nheads,) is the gradient w.r.t. them,
    ``-sum_i exp(sink_h - lse_i) * rowsum(dO_i * O_i)`` over every row of head h and every
    batch entry, in float32 (float64 when compute_dtype is float64).
    bias, mask, score_mod as in ``attention``. With bias, dbias is the gradient w.r.t. it: dS,
    the gradient w.r.t. the biased scores (score_mod's input; 0 at masked entries), summed over
    the bias's broadcast dims (batch and/or query heads of size 1), shaped and typed like bias;
    ``bias_requires_grad=False`` leaves it out of the result. score_mod needs
    ``score_mod_grad(score, b, h, q_idx, kv_idx)``, d score_mod / d score at the same
    arguments (ValueError without it).

    ``out`` and ``lse`` (the forward's results, may be None) are taken for signature parity with
    a kernel backward and are only shape-checked: the reference recomputes P from q, k, v so
    that a wrong ``out`` or ``lse`` from an implementation under test cannot leak into its
    reference.
    """
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, bias=bias)
    mods = _Modifiers(mask, score_mod, score_mod_grad, bias_requires_grad)
    grads = _backward(dout, q, k, v, out, lse, options, compute_dtype, dropout_mask, mods)
    if bias is not None and mods.bias_requires_grad:
        grads = (*grads[:-1], grads[-1].astype(bias.dtype))
    return grads


def _backward(dout, q, k, v, out, lse, options, compute_dtype, dropout_mask,
              mods=_NO_MODIFIERS):
    """attention_backward's gradients for the options of one call (an AttentionOptions) and its
    _Modifiers; dbias (if any) in prec.acc, not yet cast to the bias's dtype."""
    xp = _array_module(dout, q, k, v, options.alibi_slopes, options.sinks, dropout_mask,
                       options.bias, mods.mask)
    _check_score_mod_grad(mods)
    dout, q, k, v = (xp.asarray(x) for x in (dout, q, k, v))
    _check_shapes(q, k, v)
    out_shape = q.shape[:-1] + v.shape[-1:]
    lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    if dout.shape != out_shape:
        raise ValueError(f"dout must have shape {out_shape}, got {dout.shape}")
    if out is not None and tuple(out.shape) != out_shape:
        raise ValueError(f"out must have shape {out_shape}, got {out.shape}")
    if lse is not None and tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse must have shape {lse_shape}, got {lse.shape}")
    unbatched = q.ndim == 3
    if unbatched:
        dout, q, k, v = dout[None], q[None], k[None], v[None]
    prec = _Precision(compute_dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = _scale(options.softmax_scale, headdim)
    visible = _visible_keys(xp, seqlen_q, seqlen_k, options)
    features = _Features(xp, prec, (batch, nheads, seqlen_q, seqlen_k), options, dropout_mask,
                         unbatched, mods)

    dqs, dks, dvs, dbiases = [], [], [], []
    sink_logits = features.sink_logits(nheads_kv)
    dsinks = None if sink_logits is None else xp.zeros(nheads, dtype=prec.acc)
    for part in _batch_slices(batch, nheads * seqlen_q * seqlen_k):
        q_part = _group_query_heads(prec.load(q[part]), nheads_kv)
        dout_part = _group_query_heads(prec.load(dout[part]), nheads_kv)
        k_part = _kv_heads_first(prec.load(k[part]))
        v_part = _kv_heads_first(prec.load(v[part]))
        visible_part = features.visible(part, nheads_kv, visible)
        probs, _, tanh, sink_probs, modified = _probabilities(
            xp, q_part, k_part, scale, visible_part, group, prec,
            features.softcap, features.bias(part, nheads_kv), sink_logits,
            features.score_mod(part),
        )
        keep = features.keep(part, nheads_kv)
        # out = (P * Z) V with Z = mask / (1 - p) (Z = 1 without dropout), P = softmax(S),
        # S = bias + cap(scale * q k^T). Key-less rows have P = 0, so every gradient term below
        # is 0 for them.
        dropped = probs if keep is None else probs * keep
        dv = xp.matmul(dropped.swapaxes(-1, -2), dout_part)
        # dP is an accumulator like the scores (not rounded at TF32: no product takes it).
        dprobs = prec.round_scores(xp.matmul(dout_part, v_part.swapaxes(-1, -2)))
        if keep is not None:
            dprobs = dprobs * keep  # gradient w.r.t. P (not P * Z)
        # Softmax backward: dS = P * (dP - rowsum(P * dP)); rowsum(P * dP) = rowsum(dO * O),
        # with O including the dropout, since P * dP = (P * Z) * (dO . V).
        delta = (probs * dprobs).sum(axis=-1, keepdims=True)
        if sink_probs is not None:
            # The sink is a logit with no value row: its dS is P_sink * (0 - D), summed over
            # the rows (and batch entries) of its head. dS of the keys is unchanged. Here D is
            # rowsum(dO * O) with O the forward's output as returned (rounded to compute_dtype),
            # the D an implementation reads; in float32/float64 it equals delta.
            out_part = prec.round(xp.matmul(dropped, v_part))
            row_delta = (dout_part * out_part).sum(axis=-1, keepdims=True)
            terms = (sink_probs * row_delta).reshape(len(q_part), nheads_kv, group, seqlen_q)
            dsinks = dsinks - terms.sum(axis=(0, 3)).reshape(nheads)
        dscores = probs * (dprobs - delta)
        if modified is not None:
            # Through score_mod: dS of its input. Masked entries have P = 0; the where keeps
            # them 0 even where the derivative is not finite.
            grad = features.score_mod_grad(modified, part).reshape(dscores.shape)
            mask5 = xp.broadcast_to(visible_part, modified.shape).reshape(dscores.shape)
            dscores = xp.where(mask5, dscores * grad, 0)
        if features.wants_dbias:
            # dbias = dS of the biased scores, in prec.acc (not rounded to compute_dtype: an
            # implementation writes it from its float32 dS), summed over the broadcast dims.
            dbias = dscores.reshape(len(q_part), nheads, seqlen_q, seqlen_k)
            if features.user_bias.shape[1] == 1:
                dbias = dbias.sum(axis=1, keepdims=True)
            if features.user_bias.shape[0] == 1:
                dbias = dbias.sum(axis=0, keepdims=True)
            dbiases.append(dbias)
        if tanh is not None:
            # d/dx softcap * tanh(x / softcap) = 1 - tanh(x / softcap)^2; the bias has
            # derivative 1.
            dscores = dscores * (1 - tanh * tanh)
        dscores = prec.round(dscores)
        dq = xp.matmul(dscores, k_part) * scale
        dk = xp.matmul(dscores.swapaxes(-1, -2), q_part) * scale
        dqs.append(_ungroup_query_heads(dq, group, seqlen_q).astype(prec.result))
        dks.append(_kv_heads_first(dk).astype(prec.result))
        dvs.append(_kv_heads_first(dv).astype(prec.result))
    grads = [xp.ascontiguousarray(xp.concatenate(parts)) for parts in (dqs, dks, dvs)]
    if unbatched:
        grads = [g[0] for g in grads]
    if dsinks is not None:
        grads.append(dsinks)
    if features.wants_dbias:
        if features.user_bias.shape[0] == 1:
            dbias = sum(dbiases[1:], dbiases[0])
        else:
            dbias = xp.concatenate(dbiases)
        grads.append(xp.ascontiguousarray(dbias.reshape(features.bias_shape)))
    return tuple(grads)


# --------------------------------------------------------------------------------------------
# Variable length: packed sequences, one dense call per sequence.


def _check_cu_seqlens(name, cu_seqlens, total, total_name):
    # The reference needs the lengths on the host to slice the sequences (a device sync for
    # CuPy; it is a test tool).
    return _validate.check_cu_seqlens(name, cu_seqlens, total, total_name, _to_host)


_check_max_seqlen = _validate.check_max_seqlen


class _Varlen:
    """The checked arguments of a varlen call and the per-sequence options."""

    def __init__(self, xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 options, dropout_mask, mods=_NO_MODIFIERS, fp8_ok=False):
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 3:
                raise ValueError(
                    f"{name} must be packed (total_tokens, nheads, headdim) for varlen; got "
                    f"shape {x.shape}"
                )
        _check_shapes(q, k, v, fp8_ok)
        self.cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0]")
        self.cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0]")
        if self.cu_q.shape != self.cu_k.shape:
            raise ValueError(
                "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
                f"{self.cu_q.shape[0]} and {self.cu_k.shape[0]}"
            )
        self.batch = self.cu_q.shape[0] - 1
        nheads = q.shape[1]
        self.max_seqlen_q = _check_max_seqlen(
            "max_seqlen_q", max_seqlen_q, numpy.diff(self.cu_q), "query sequence"
        )
        self.max_seqlen_k = _check_max_seqlen(
            "max_seqlen_k", max_seqlen_k, numpy.diff(self.cu_k), "key sequence"
        )
        _check_softcap(options.softcap)
        self.options = options
        self.slopes = _check_alibi_slopes(xp, options.alibi_slopes, self.batch, nheads, False)
        self.sinks = _check_sinks(xp, options.sinks, nheads)  # shared by every sequence
        shape = (self.batch, nheads, self.max_seqlen_q, self.max_seqlen_k)
        self.dropout_p, self.mask = _check_dropout(
            xp, options.dropout_p, dropout_mask, shape,
            "(batch, nheads, max_seqlen_q, max_seqlen_k)",
        )
        # bias and mask: padded to the maxima like the dropout mask, sequence b's block top-left.
        _validate.check_bias(options.bias, self.batch, nheads, self.max_seqlen_q,
                             self.max_seqlen_k, True, float64=True, varlen=True)
        self.bias = None if options.bias is None else xp.asarray(options.bias)
        self.mods = mods
        self.visibility = _check_mask(xp, mods.mask, shape,
                                      "(batch, nheads, max_seqlen_q, max_seqlen_k)")

    def bias_block(self, b, seqlen_q, seqlen_k):
        """The index of sequence b's block of the padded bias: batch row b (row 0 when the bias
        is shared by every sequence), top-left aligned."""
        return (b if self.bias.shape[0] > 1 else 0, slice(None), slice(0, seqlen_q),
                slice(0, seqlen_k))

    def sequences(self):
        """(rows of q, rows of k, the sequence's AttentionOptions, its dropout mask or None, its
        _Modifiers) for each sequence."""
        for b in range(self.batch):
            rows_q = slice(int(self.cu_q[b]), int(self.cu_q[b + 1]))
            rows_k = slice(int(self.cu_k[b]), int(self.cu_k[b + 1]))
            seqlen_q, seqlen_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
            bias = None
            if self.bias is not None:
                bias = self.bias[self.bias_block(b, seqlen_q, seqlen_k)]
            options = self.options.replace(
                alibi_slopes=None if self.slopes is None else self.slopes[b],
                sinks=self.sinks, dropout_p=self.dropout_p, bias=bias)
            mask = None
            if self.mask is not None:
                # Sequence b's block of the padded mask, top-left aligned (as flash-attn's
                # varlen returns its dropout mask: padded to the max lengths).
                mask = self.mask[b, :, :seqlen_q, :seqlen_k]
            visibility = None
            if self.visibility is not None:
                visibility = self.visibility[b, :, :seqlen_q, :seqlen_k]
            yield rows_q, rows_k, options, mask, self.mods.replace(mask=visibility,
                                                                   first_batch=b)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
    compute_dtype=numpy.float32,
    dropout_p=0.0,
    dropout_mask=None,
    bias=None,
    mask=None,
    score_mod=None,
    score_mod_grad=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    qkv_dtype=None,
    out_dtype=None,
):
    """Reference variable-length attention forward (flash-attn's ``flash_attn_varlen_func``).

    q: (total_q, nheads, headdim), k and v: (total_k, nheads_kv, headdim): the sequences packed
    one after another; sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v. cu_seqlens_q/k: int32 (batch + 1,),
    starting at 0, non-decreasing, ending at total_q/total_k (zero-length sequences allowed).
    max_seqlen_q/k: at least the longest sequence. Each sequence is one ``attention`` call
    (causal and window bottom-right aligned per sequence). alibi_slopes: float32 (nheads,) or
    (batch, nheads), row b for sequence b. dropout_mask: broadcastable to (batch, nheads,
    max_seqlen_q, max_seqlen_k); sequence b uses ``[b, :, :seqlen_q_b, :seqlen_k_b]``.
    sinks: (nheads,), the same logits for every sequence (a query row of an empty key sequence
    gets out 0 and lse = sink).
    bias: (batch or 1, nheads or 1, max_seqlen_q, max_seqlen_k) and mask: boolean,
    broadcastable to (batch, nheads, max_seqlen_q, max_seqlen_k), padded like dropout_mask:
    sequence b uses ``[b, :, :seqlen_q_b, :seqlen_k_b]`` (row 0 of a bias of batch dim 1).
    score_mod sees b = the sequence's index and q_idx, kv_idx = positions within the sequence.

    FP8 inputs as ``attention``'s (``qkv_dtype="e4m3"``, ``compute_dtype="e4m3"``, ``out_dtype``),
    their factors ``(batch, nheads_kv)`` by sequence (FlashAttention-3's varlen descales) or
    ``()`` / ``(1,)``.

    Returns out (total_q, nheads, headdim) in compute_dtype, or (out, lse) with lse float32
    (nheads, total_q) (flash-attn's varlen lse layout).
    """
    xp = _array_module(q, k, v, alibi_slopes, sinks, dropout_mask, bias, mask)
    q, k, v = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    is_fp8 = (qkv_dtype is not None
              or any(numpy.dtype(x.dtype) in fp8.E4M3_DTYPES for x in (q, k, v)))
    prec = _Precision(compute_dtype, out_dtype)
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, bias=bias)
    varlen = _Varlen(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     options, dropout_mask, _Modifiers(mask, score_mod, score_mod_grad),
                     fp8_ok=is_fp8)
    # FP8 inputs: each packed row takes its sequence's row of the factors.
    sequences = ((varlen.batch, *(numpy.repeat(numpy.arange(varlen.batch), numpy.diff(cu))
                                  for cu in (varlen.cu_q, varlen.cu_k))) if is_fp8 else None)
    q, k, v = _fp8_dequantised(q, k, v, qkv_dtype, (q_descale, k_descale, v_descale),
                               compute_dtype, sequences)
    # Filled sequence by sequence (every row belongs to exactly one), in the accumulation dtype
    # and cast at the end: a cast is the bf16 operation CuPy is known to support.
    out = xp.zeros(q.shape[:-1] + v.shape[-1:], dtype=prec.acc)
    lse = xp.zeros((q.shape[1], q.shape[0]), dtype=numpy.float32)
    for rows_q, rows_k, sequence_options, keep, mods in varlen.sequences():
        out_b, lse_b = _forward(q[rows_q], k[rows_k], v[rows_k], sequence_options, compute_dtype,
                                keep, mods, out_dtype)
        out[rows_q] = out_b.astype(prec.acc)
        lse[:, rows_q] = lse_b
    out = out.astype(prec.result)
    return (out, lse) if return_lse else out


def attention_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    compute_dtype=numpy.float32,
    dropout_p=0.0,
    dropout_mask=None,
    bias=None,
    mask=None,
    score_mod=None,
    score_mod_grad=None,
    bias_requires_grad=True,
):
    """Reference variable-length backward: packed (dq, dk, dv) in compute_dtype, then dsinks
    with ``sinks`` and dbias with ``bias``: (dq, dk, dv[, dsinks][, dbias]).

    The gradient of ``attention_varlen`` (same arguments) for the upstream gradient dout
    (total_q, nheads, headdim), sequence by sequence through ``attention_backward``. ``out``
    (total_q, nheads, headdim) and ``lse`` (nheads, total_q) may be None and are only
    shape-checked, as in ``attention_backward``. dsinks (nheads,) sums the sequences' dsinks
    (float32, or float64 when compute_dtype is float64). dbias is shaped and typed like bias,
    (batch or 1, nheads or 1, max_seqlen_q, max_seqlen_k): each sequence's dbias in its block
    (summed over the sequences for a bias of batch dim 1), 0 in the padding.
    """
    xp = _array_module(dout, q, k, v, alibi_slopes, sinks, dropout_mask, bias, mask)
    dout, q, k, v = (xp.asarray(x) for x in (dout, q, k, v))
    prec = _Precision(compute_dtype)
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, bias=bias)
    mods = _Modifiers(mask, score_mod, score_mod_grad, bias_requires_grad)
    _check_score_mod_grad(mods)
    varlen = _Varlen(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     options, dropout_mask, mods)
    out_shape = q.shape[:-1] + v.shape[-1:]
    lse_shape = (q.shape[1], q.shape[0])
    if dout.shape != out_shape:
        raise ValueError(f"dout must have shape {out_shape}, got {dout.shape}")
    if out is not None and tuple(out.shape) != out_shape:
        raise ValueError(f"out must have shape {out_shape}, got {out.shape}")
    if lse is not None and tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse must have shape (nheads, total_q) = {lse_shape}, got {lse.shape}")
    grads = [xp.zeros(x.shape, dtype=prec.acc) for x in (q, k, v)]
    dsinks = None if varlen.sinks is None else xp.zeros(q.shape[1], dtype=prec.acc)
    dbias = None
    if bias is not None and mods.bias_requires_grad:
        dbias = xp.zeros(varlen.bias.shape, dtype=prec.acc)
    for rows_q, rows_k, sequence_options, keep, sequence_mods in varlen.sequences():
        parts = _backward(dout[rows_q], q[rows_q], k[rows_k], v[rows_k], None, None,
                          sequence_options, compute_dtype, keep, sequence_mods)
        for grad, rows, part in zip(grads, (rows_q, rows_k, rows_k), parts):
            grad[rows] = part.astype(prec.acc)
        if dsinks is not None:
            dsinks += parts[3]
        if dbias is not None:
            # parts[-1]: the sequence's dbias in prec.acc, (nheads or 1, seqlen_q, seqlen_k).
            seqlen_q, seqlen_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
            dbias[varlen.bias_block(sequence_mods.first_batch, seqlen_q, seqlen_k)] += parts[-1]
    grads = [grad.astype(prec.result) for grad in grads]
    if dsinks is not None:
        grads.append(dsinks)
    if dbias is not None:
        grads.append(dbias.astype(bias.dtype))
    return tuple(grads)


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    k=None,
    v=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
    compute_dtype=numpy.float32,
    kv_cache_dtype=None,
    k_descale=None,
    v_descale=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=True,
    cache_leftpad=None,
):
    """Reference attention with a KV cache (flash-attn's ``flash_attn_with_kvcache``), for
    inference: a few query tokens against a long cache.

    q: (batch, seqlen_q, nheads, headdim). The cache is either contiguous, k_cache and v_cache
    (batch_cache, seqlen_cache, nheads_kv, headdim) with sequence b in cache row
    ``cache_batch_idx[b]`` (default b), or paged, (num_blocks, page_size, nheads_kv, headdim)
    with ``block_table`` int32 (batch, max_blocks): logical position p of sequence b is row
    ``p % page_size`` of block ``block_table[b, p // page_size]``. v_cache may have a head dim of
    its own, d_v (and v then (..., d_v), the output (..., d_v)): MLA's latent cache is
    ``k_cache`` with ``v_cache = k_cache[..., :d_v]``, a view, so that appending k writes V's
    columns too (pass ``v = k[..., :d_v]``). The kernels do not take d_v != headdim here yet.
    cache_seqlens: int or int32 (batch,), the tokens already cached per sequence (default: the
    whole capacity, less the new tokens). k, v: optional new tokens (batch, seqlen_new,
    nheads_kv, headdim), written **into the cache arrays in place** at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before the attention, which runs over
    the first cache_seqlens[b] + seqlen_new positions (causal and windows bottom-right aligned,
    as ``attention``; alibi_slopes (nheads,) or (batch, nheads); sinks (nheads,), counted once
    in each row's denominator).

    An FP8 cache (``kv_cache_dtype="e4m3"``, cuflash2.fp8): k_cache and v_cache uint8 e4m3 bits
    (or float8_e4m3fn), values e4m3 * k_descale / v_descale (float32 (batch, nheads_kv), () or
    (1,), or a float; default 1), new tokens stored as fp8.quantize_e4m3(k / k_descale); the
    attention runs on the dequantised values (in float64, then as compute_dtype loads them).

    Rotary (flash-attn's rules; ``apply_rotary``): rotary_cos, rotary_sin (seqlen_ro,
    rotary_dim / 2) of q's dtype, rotary_dim a multiple of 16 <= headdim, seqlen_ro >= the
    capacity, k and v given. The new keys are rotated at positions cache_seqlens[b] + i before
    they are appended (the cache holds them rotated); q's row i at cache_seqlens[b] + i if causal
    or a window (an edge within the capacity), else every row at cache_seqlens[b].
    ``rotary_interleaved`` (default True, as flash-attn's): GPT-J pairs (0, 1), (2, 3), ...;
    False: GPT-NeoX halves. cache_leftpad: int32 (batch,), contiguous caches only: sequence b's
    keys are positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1 (those before are
    not attended); positions (rotary, appends, causal / window alignment, ALiBi) stay the
    cache's, so attention over keys [leftpad, end) is flash-attn's shifted sequence.

    Returns out (batch, seqlen_q, nheads, headdim) in compute_dtype, or (out, lse) with lse
    float32 (batch, nheads, seqlen_q).
    """
    xp = _array_module(q, k_cache, v_cache, k, v, alibi_slopes, sinks)
    cache_format = fp8.cache_format(q, k_cache, v_cache, k, kv_cache_dtype, k_descale, v_descale)
    problem = _validate.check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens,
                                             cache_batch_idx, block_table, _to_host,
                                             kv_cache_dtype=cache_format)
    lengths = _validate.kvcache_lengths(problem, cache_seqlens, _to_host)
    rotary = _validate.check_rotary(rotary_cos, rotary_sin, q.dtype, problem.head_dim,
                                    problem.capacity, k is not None)
    _validate.check_cache_leftpad(cache_leftpad, problem.batch, problem.paged)
    _validate.check_window(window_size, causal, problem.seqlen_q, problem.capacity)
    per_row = _validate.rotary_positions_per_row(causal, window_size, problem.capacity)
    if rotary is not None and not isinstance(rotary_interleaved, (bool, numpy.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool; got {rotary_interleaved!r}")
    _validate.check_kvcache_extra_values(problem, cache_seqlens, cache_leftpad, rotary, per_row,
                                         _to_host)
    pads = (numpy.zeros(problem.batch, numpy.int64) if cache_leftpad is None
            else _to_host(cache_leftpad).astype(numpy.int64))
    rows = (numpy.arange(problem.batch) if cache_batch_idx is None
            else _to_host(cache_batch_idx).astype(numpy.int64))
    table = _to_host(block_table).astype(numpy.int64) if problem.paged else None
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks)
    slopes = _check_alibi_slopes(xp, alibi_slopes, problem.batch, problem.nheads, False)
    options.sinks = _check_sinks(xp, sinks, problem.nheads)

    def cache_index(b, positions):
        if problem.paged:
            return (xp.asarray(table[b, positions // problem.page_size]),
                    xp.asarray(positions % problem.page_size))
        return (int(rows[b]), xp.asarray(positions))

    # An FP8 cache: its bytes (a uint8 view of a float8_e4m3fn one), the factors of each sequence
    # and KV head, new tokens quantised on the way in and every value dequantised on the way out.
    store = {"k": k_cache, "v": v_cache}
    scales = {}
    if cache_format is not None:
        store = {n: c.view(numpy.uint8) for n, c in store.items()}
        scales = {"k": fp8.descale_values("k_descale", k_descale, problem.batch,
                                          problem.nheads_kv, xp),
                  "v": fp8.descale_values("v_descale", v_descale, problem.batch,
                                          problem.nheads_kv, xp)}
        for name in scales:
            fp8.check_descale_values(f"{name}_descale", _to_host(scales[name]))

    def to_cache(name, b, x):
        if cache_format is None:
            return x
        return fp8.quantize_e4m3(x, scales[name][b][:, None].astype(numpy.float32))

    def from_cache(name, b, x):
        if cache_format is None:
            return x
        return fp8.dequantize_e4m3(x, scales[name][b][:, None], numpy.float64)

    outs, lses = [], []
    for b in range(problem.batch):
        cached, total = int(lengths[b]), int(lengths[b]) + problem.seqlen_new
        if k is not None:
            new = cache_index(b, numpy.arange(cached, total))
            k_b = k[b]
            if rotary is not None:  # rotated at their positions, in q's dtype, then stored
                k_b = apply_rotary(k_b, rotary_cos, rotary_sin, numpy.arange(cached, total),
                                   interleaved=bool(rotary_interleaved))
            store["k"][new] = to_cache("k", b, k_b)
            store["v"][new] = to_cache("v", b, v[b])
        everything = cache_index(b, numpy.arange(int(pads[b]), total))
        sequence_options = options.replace(alibi_slopes=None if slopes is None else slopes[b])
        q_b = q[b]
        if rotary is not None:
            offsets = numpy.arange(problem.seqlen_q) if per_row else numpy.zeros(
                problem.seqlen_q, numpy.int64)
            q_b = apply_rotary(q_b, rotary_cos, rotary_sin, cached + offsets,
                               interleaved=bool(rotary_interleaved))
        # (q exactly in float64 beside the dequantised cache: _forward takes one dtype)
        q_b = q_b if cache_format is None else q_b.astype(numpy.float64)
        out, lse = _forward(q_b, from_cache("k", b, store["k"][everything]),
                            from_cache("v", b, store["v"][everything]), sequence_options,
                            compute_dtype, None)
        outs.append(out)
        lses.append(lse)
    shape = (problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim_v)
    out = xp.stack(outs) if outs else xp.zeros(shape, dtype=_Precision(compute_dtype).result)
    lse = (xp.stack(lses) if lses
           else xp.zeros((problem.batch, problem.nheads, problem.seqlen_q), numpy.float32))
    return (out, lse) if return_lse else out


def apply_rotary(x, cos, sin, positions, *, interleaved=False):
    """Rotary position embedding (RoPE) of x's rows, as attention_with_kvcache applies it (and
    flash-attn's apply_rotary_emb): x (..., seqlen, nheads, headdim), positions (..., seqlen)
    ints (row i of x at positions[..., i]), cos and sin (seqlen_ro, rotary_dim / 2). The first
    rotary_dim elements of each row are rotated by the angles of its position, the others kept:
    GPT-NeoX halves (``interleaved=False``: element j < rotary_dim / 2 with j + rotary_dim / 2)
    or GPT-J pairs (``interleaved=True``: 2i with 2i + 1),
    x'_a = x_a cos - x_b sin, x'_b = x_b cos + x_a sin. In float32, each product and sum rounded
    (the decode kernel's arithmetic, without fused multiply-adds), returned in x's dtype. NumPy
    or CuPy."""
    xp = _array_module(x, cos, sin)
    x, cos, sin = xp.asarray(x), xp.asarray(cos), xp.asarray(sin)
    positions = numpy.asarray(_to_host(positions)).astype(numpy.int64)
    if cos.ndim != 2 or tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"cos and sin must be (seqlen_ro, rotary_dim / 2) alike; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    half = int(cos.shape[1])
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} is larger than x's head dim {x.shape[-1]}")
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(f"positions must be within [0, {cos.shape[0]}) (cos's rows); got "
                         f"{int(positions.min())} .. {int(positions.max())}")
    index = xp.asarray(positions)
    c = cos[index].astype(numpy.float32)[..., None, :]  # (..., seqlen, 1, half)
    s = sin[index].astype(numpy.float32)[..., None, :]
    f = x.astype(numpy.float32)
    out = f.copy()
    if interleaved:
        a, b = f[..., 0:rotary_dim:2], f[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * c - b * s
        out[..., 1:rotary_dim:2] = b * c + a * s
    else:
        a, b = f[..., :half], f[..., half:rotary_dim]
        out[..., :half] = a * c - b * s
        out[..., half:rotary_dim] = b * c + a * s
    return out.astype(x.dtype)


def merge_states(out_a, lse_a, out_b, lse_b):
    """Reference of ``cuflash2.merge_states``: the attention result over the union of two
    disjoint sets of keys from the results over each, ``(out, lse)`` with
    ``lse = log(exp(lse_a) + exp(lse_b))`` and
    ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``.

    out_a, out_b: (batch, seqlen, nheads, headdim) or (seqlen, nheads, headdim), any float dtype
    (the same); lse_a, lse_b: (batch, nheads, seqlen) or (nheads, seqlen) (the same dtype).
    Computed in float64; out is returned in the outs' dtype, lse in the lses' (float32 as
    attention returns it, float64 for an exact check). A state's lse of +inf (a row that saw
    no key, as attention returns it) or -inf weighs 0 and its out row is not read (nan there
    stays out of the result); a row that saw no key of either gets out 0 and lse +inf.
    """
    xp = _array_module(out_a, lse_a, out_b, lse_b)
    for name, x, like in (("out_b", out_b, out_a), ("lse_b", lse_b, lse_a)):
        if tuple(x.shape) != tuple(like.shape):
            raise ValueError(f"{name} must have the shape of {name[:-1]}a {tuple(like.shape)}; "
                             f"got {tuple(x.shape)}")
    return merge_states_many(xp.stack([xp.asarray(out_a), xp.asarray(out_b)]),
                             xp.stack([xp.asarray(lse_a), xp.asarray(lse_b)]))


def merge_states_many(outs, lses):
    """Reference of ``cuflash2.merge_states_many``: merge_states of the states stacked on a
    leading dim, outs (num_states, batch, seqlen, nheads, headdim) or (num_states, seqlen,
    nheads, headdim), lses (num_states, batch, nheads, seqlen) or (num_states, nheads, seqlen),
    num_states >= 1: ``lse = log sum_s exp(lses[s])``,
    ``out = sum_s exp(lses[s] - lse) * outs[s]``, with merge_states' dtypes and rows without
    keys."""
    xp = _array_module(outs, lses)
    outs, lses = xp.asarray(outs), xp.asarray(lses)
    if outs.ndim not in (4, 5) or outs.shape[0] < 1:
        raise ValueError(f"outs must be (num_states, batch, seqlen, nheads, headdim) or "
                         f"(num_states, seqlen, nheads, headdim) with num_states >= 1; got "
                         f"{tuple(outs.shape)}")
    lse_shape = outs.shape[:-3] + (outs.shape[-2], outs.shape[-3])
    if tuple(lses.shape) != lse_shape:
        raise ValueError(f"lses must have shape {lse_shape} to go with outs' "
                         f"{tuple(outs.shape)}; got {tuple(lses.shape)}")
    lse = lses.astype(numpy.float64)
    lse = xp.where(xp.isinf(lse), -math.inf, lse)  # no key: weight 0
    top = lse.max(axis=0)
    seen = top > -math.inf  # some state saw a key of the row
    weights = xp.exp(lse - xp.where(seen, top, 0.0))  # exp(-inf) = 0
    total = weights.sum(axis=0)
    merged_lse = xp.where(seen, top + xp.log(xp.where(seen, total, 1.0)), math.inf)
    # (states, [batch,] nheads, seqlen) -> (states, [batch,] seqlen, nheads, 1), out's layout
    share = xp.swapaxes(weights / xp.where(seen, total, 1.0), -1, -2)[..., None]
    terms = xp.where(share > 0, share * outs.astype(numpy.float64), 0.0)
    return terms.sum(axis=0).astype(outs.dtype), merged_lse.astype(lses.dtype)


def block_mask_states(dense_mask, block_m: int, block_n: int):
    """The per-tile states of a dense boolean mask (..., seqlen_q, seqlen_k) (True = visible) in
    tiles of block_m x block_n, as cuflash2.block_mask computes them on the GPU: int8 (...,
    ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)), 0 where no position of the tile is
    visible, 2 where every position of the tile inside the sequence is, 1 otherwise (the last
    tiles of a row or column hold only the positions before the sequence's ends)."""
    xp = _array_module(dense_mask)
    mask = xp.asarray(dense_mask)
    if mask.dtype != xp.bool_ or mask.ndim < 2:
        raise ValueError(f"block_mask_states: dense_mask must be a boolean array (..., seqlen_q, "
                         f"seqlen_k); got {mask.dtype} {tuple(mask.shape)}")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"block_mask_states: {name} must be an int >= 1; got {value!r}")
    *lead, seqlen_q, seqlen_k = mask.shape
    mb, nb = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    pad = [(0, 0)] * len(lead) + [(0, mb * block_m - seqlen_q), (0, nb * block_n - seqlen_k)]
    tiles = (*lead, mb, block_m, nb, block_n)
    # Padding: invisible for "any", visible for "all" (positions past the ends do not count).
    some = xp.pad(mask, pad, constant_values=False).reshape(tiles).any(axis=(-3, -1))
    every = xp.pad(mask, pad, constant_values=True).reshape(tiles).all(axis=(-3, -1))
    return xp.where(every, 2, xp.where(some, 1, 0)).astype(xp.int8)


def block_mask_columns(states):
    """Each column of block-mask states (..., num_m_blocks, num_n_blocks) summed up as
    cuflash2.block_mask does on the GPU (BlockMask.columns): int32 (..., num_n_blocks, 8) of the
    first m block that is not empty and one past the last (0x7fffffff, 0 where all are), the
    first full m block and one past the last full one (0x7fffffff, 0 where none is full), how
    many are full, and three zeros."""
    rows = numpy.asarray(states.get() if hasattr(states, "get") else states)
    if rows.ndim < 2:
        raise ValueError(f"block_mask_columns: states must be (..., num_m_blocks, "
                         f"num_n_blocks); got {tuple(rows.shape)}")
    cols = numpy.swapaxes(rows, -1, -2).reshape(-1, rows.shape[-2])
    out = numpy.zeros((cols.shape[0], 8), numpy.int32)
    out[:, 0] = out[:, 2] = 0x7FFFFFFF
    for i, col in enumerate(cols):
        visited, full = numpy.flatnonzero(col != 0), numpy.flatnonzero(col == 2)
        if visited.size:
            out[i, :2] = visited[0], visited[-1] + 1
        if full.size:
            out[i, 2:5] = full[0], full[-1] + 1, full.size
    shape = (*rows.shape[:-2], rows.shape[-1], 8)
    return _array_module(states).asarray(out.reshape(shape))


def block_mask_ranges(states):
    """Each row of block-mask states (..., num_m_blocks, num_n_blocks) summed up as
    cuflash2.block_mask does on the GPU (BlockMask.ranges): int32 (..., num_m_blocks, 4) of the
    first n block that is not empty and one past the last (0, 0 where all are), then the first
    and one past the last n block of the row's longest run of full tiles (the first such run
    where two are as long; 0, 0 where no tile is full)."""
    xp = _array_module(states)
    rows = numpy.asarray(states.get() if hasattr(states, "get") else states)
    if rows.ndim < 2:
        raise ValueError(f"block_mask_ranges: states must be (..., num_m_blocks, num_n_blocks); "
                         f"got {tuple(rows.shape)}")
    flat = rows.reshape(-1, rows.shape[-1])
    out = numpy.zeros((flat.shape[0], 4), numpy.int32)
    for i, row in enumerate(flat):
        visited = numpy.flatnonzero(row != 0)
        if visited.size:
            out[i, :2] = visited[0], visited[-1] + 1
        run_first = 0
        for n, state in enumerate(row):
            if state != 2:
                run_first = n + 1
            elif n + 1 - run_first > out[i, 3] - out[i, 2]:
                out[i, 2:] = run_first, n + 1
    return xp.asarray(out.reshape(*rows.shape[:-1], 4))

