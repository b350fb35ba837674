"""Reference attention, forward and backward, for NumPy and CuPy arrays alike.

Plain ``softmax(mask(Q K^T * scale)) V`` with the semantics of design.md §1: bottom-right causal
alignment, sliding windows relative to the same diagonal, GQA/MQA head mapping, and rows that
see no key giving output 0 and ``lse = +inf``. It materialises the (seqlen_q, seqlen_k) score
matrix, so it is for tests and correctness checks, not for speed.

``compute_dtype`` float32/float64 computes everything in that dtype (the exact reference).
``compute_dtype`` float16/bfloat16 is the "low-precision reference" of the correctness rule:
matmuls still accumulate in float32, but the values are rounded to ``compute_dtype`` where a
low-precision implementation would round them: the inputs, the scaled scores, the
probabilities P before ``P @ V`` and the output (and, in the backward, dP, dS and the
gradients).
"""

import math
import sys

import ml_dtypes
import numpy

__all__ = ["attention", "attention_backward"]

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
    return cupy.get_array_module(*arrays)


class _Precision:
    """Which dtype the maths runs in (``acc``) and what values are rounded to (``round_to``)."""

    def __init__(self, compute_dtype):
        dtype = numpy.dtype(compute_dtype)
        if dtype in _HIGH_PRECISION:
            self.acc, self.round_to = dtype, None
        elif dtype in _LOW_PRECISION:
            self.acc, self.round_to = numpy.dtype(numpy.float32), dtype
        else:
            raise ValueError(
                f"compute_dtype must be float16, bfloat16, float32 or float64, got {dtype}"
            )
        self.result = dtype

    def round(self, x):
        if self.round_to is None:
            return x
        return x.astype(self.round_to).astype(self.acc)

    def load(self, x):
        # Through acc first: every input float dtype converts to float32/float64 exactly (or
        # with a single rounding), on NumPy and CuPy alike.
        return self.round(x.astype(self.acc))


def _check_shapes(q, k, v):
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "q, k, v must all be (batch, seqlen, nheads, headdim) or all "
            f"(seqlen, nheads, headdim); got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k have different batch sizes: {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k have different head dims: {q.shape[-1]} and {k.shape[-1]}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})"
        )


def _scale(softmax_scale, headdim):
    if softmax_scale is not None:
        return float(softmax_scale)
    return 1.0 / math.sqrt(headdim)


def _visible_keys(xp, seqlen_q, seqlen_k, causal, window_size):
    """Boolean (seqlen_q, seqlen_k) mask: query i sees key j."""
    left, right = window_size
    if causal:
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


def _probabilities(xp, q, k, scale, visible, group, prec):
    """P = softmax(mask(q k^T * scale)) and its lse.

    q: (b, nheads_kv, group * seqlen_q, d) and k: (b, nheads_kv, seqlen_k, d), both in
    prec.acc. Returns P (b, nheads_kv, group * seqlen_q, seqlen_k) and lse (b, nheads, seqlen_q)
    in prec.acc. Rows that see no key get P = 0 and lse = +inf.
    """
    b, nheads_kv = q.shape[:2]
    seqlen_q, seqlen_k = visible.shape
    scores = prec.round(xp.matmul(q, k.swapaxes(-1, -2)) * scale)
    scores = scores.reshape(b, nheads_kv, group, seqlen_q, seqlen_k)
    scores = xp.where(visible, scores, -math.inf)

    has_key = visible.any(axis=-1)[:, None]
    if seqlen_k > 0:
        row_max = scores.max(axis=-1, keepdims=True)
    else:  # max of an empty axis is an error; every row is key-less anyway
        row_max = xp.zeros(scores.shape[:-1] + (1,), dtype=scores.dtype)
    # Key-less rows have max -inf; shifting by 0 instead avoids -inf - -inf = nan.
    row_max = xp.where(has_key, row_max, 0)
    weights = xp.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    row_sum = xp.where(has_key, weights.sum(axis=-1, keepdims=True), 1)
    probs = prec.round(weights / row_sum)
    lse = xp.where(has_key, row_max + xp.log(row_sum), math.inf)
    return (
        probs.reshape(b, nheads_kv, group * seqlen_q, seqlen_k),
        lse.reshape(b, nheads_kv * group, seqlen_q),
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
):
    """Reference attention forward.

    q: (batch, seqlen_q, nheads, headdim), k and v: (batch, seqlen_k, nheads_kv, headdim), or
    the same without the batch dim. Any float dtype (float16, ml_dtypes.bfloat16, float32, ...).
    Returns out (shaped like q, dtype compute_dtype) or (out, lse) with lse float32
    (batch, nheads, seqlen_q) (or (nheads, seqlen_q) for unbatched inputs).
    """
    xp = _array_module(q, k, v)
    q, k, v = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    _check_shapes(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    prec = _Precision(compute_dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = _scale(softmax_scale, headdim)
    visible = _visible_keys(xp, seqlen_q, seqlen_k, causal, window_size)

    outs, lses = [], []
    for part in _batch_slices(batch, nheads * seqlen_q * seqlen_k):
        q_part = _group_query_heads(prec.load(q[part]), nheads_kv)
        k_part = _kv_heads_first(prec.load(k[part]))
        v_part = _kv_heads_first(prec.load(v[part]))
        probs, lse = _probabilities(xp, q_part, k_part, scale, visible, group, prec)
        out = _ungroup_query_heads(xp.matmul(probs, v_part), group, seqlen_q)
        outs.append(out.astype(prec.result))
        lses.append(lse.astype(numpy.float32))
    out = xp.ascontiguousarray(xp.concatenate(outs))
    lse = xp.ascontiguousarray(xp.concatenate(lses))
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


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
):
    """Reference attention backward: (dq, dk, dv) in compute_dtype, shaped like q, k, v.

    The exact gradient of ``attention`` (same arguments) w.r.t. q, k and v for the upstream
    gradient ``dout``; with GQA, dk and dv sum over the query heads that share a KV head.

    ``out`` and ``lse`` (the forward's results, may be None) are taken for signature parity with
    a kernel backward and are only shape-checked: the reference recomputes P from q, k, v so
    that a wrong ``out`` or ``lse`` from an implementation under test cannot leak into its
    reference.
    """
    xp = _array_module(dout, q, k, v)
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
    scale = _scale(softmax_scale, headdim)
    visible = _visible_keys(xp, seqlen_q, seqlen_k, causal, window_size)

    dqs, dks, dvs = [], [], []
    for part in _batch_slices(batch, nheads * seqlen_q * seqlen_k):
        q_part = _group_query_heads(prec.load(q[part]), nheads_kv)
        dout_part = _group_query_heads(prec.load(dout[part]), nheads_kv)
        k_part = _kv_heads_first(prec.load(k[part]))
        v_part = _kv_heads_first(prec.load(v[part]))
        probs, _ = _probabilities(xp, q_part, k_part, scale, visible, group, prec)
        # out = P V, P = softmax(S), S = scale * q k^T. Key-less rows have P = 0, so every
        # gradient term below is 0 for them.
        dv = xp.matmul(probs.swapaxes(-1, -2), dout_part)
        dprobs = prec.round(xp.matmul(dout_part, v_part.swapaxes(-1, -2)))
        # Softmax backward: dS = P * (dP - rowsum(P * dP)); rowsum(P * dP) = rowsum(dO * O).
        delta = (probs * dprobs).sum(axis=-1, keepdims=True)
        dscores = prec.round(probs * (dprobs - delta))
        dq = xp.matmul(dscores, k_part) * scale
        dk = xp.matmul(dscores.swapaxes(-1, -2), q_part) * scale
        dqs.append(_ungroup_query_heads(dq, group, seqlen_q).astype(prec.result))
        dks.append(_kv_heads_first(dk).astype(prec.result))
        dvs.append(_kv_heads_first(dv).astype(prec.result))
    grads = [xp.ascontiguousarray(xp.concatenate(parts)) for parts in (dqs, dks, dvs)]
    if unbatched:
        grads = [g[0] for g in grads]
    return tuple(grads)
