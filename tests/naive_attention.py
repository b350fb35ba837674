"""An independent per-element attention oracle for the reference's CPU tests (tests/ helper):
loops over rows in float64 with math.tanh/math.exp, applying the rules of docs/DESIGN.md §1 and
flash-attn's feature order as written: scale, softcap, ALiBi bias, mask (causal and window as
separate conditions), softmax (lse here), dropout on the normalised probabilities."""

import itertools
import math

import numpy

from cuflash2 import testing


def sees(i, j, seqlen_q, seqlen_k, causal, window_size):
    diagonal = i + seqlen_k - seqlen_q
    left, right = window_size
    if causal and j > diagonal:
        return False
    if left >= 0 and j < diagonal - left:
        return False
    if right >= 0 and j > diagonal + right:
        return False
    return True


def naive_attention(
    q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0,
    slopes=None, keep=None, dropout_p=0.0, mask=None,
):
    """(out, lse) in float64 for batched q, k, v.

    slopes: None or (batch, nheads); keep: None or a boolean (batch, nheads, seqlen_q, seqlen_k);
    mask: None or a boolean (batch, nheads, seqlen_q, seqlen_k), True = the key is visible
    (ANDed with causal and the window).
    """
    q, k, v = (numpy.asarray(x, dtype=numpy.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    out = numpy.zeros((batch, seqlen_q, nheads, v.shape[-1]))
    lse = numpy.full((batch, nheads, seqlen_q), math.inf)
    for b, h, i in itertools.product(range(batch), range(nheads), range(seqlen_q)):
        kv_head = h // (nheads // nheads_kv)
        keys = [j for j in range(seqlen_k) if sees(i, j, seqlen_q, seqlen_k, causal, window_size)
                and (mask is None or mask[b, h, i, j])]
        if not keys:
            continue  # out 0, lse +inf
        scores = []
        for j in keys:
            s = scale * float(numpy.dot(q[b, i, h], k[b, j, kv_head]))
            if softcap > 0:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                s -= float(slopes[b, h]) * abs(i + seqlen_k - seqlen_q - j)
            scores.append(s)
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        for w, j in zip(weights, keys):
            p = w / total
            if keep is not None:
                p = p * float(keep[b, h, i, j]) / (1 - dropout_p)
            out[b, i, h] += p * v[b, j, kv_head]
        lse[b, h, i] = top + math.log(total)
    return out, lse


def random_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype=numpy.float64,
                  seed=0):
    """Standard-normal q, k, v on NumPy (float64 by default)."""
    return testing.random_qkv(
        numpy, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed
    )
