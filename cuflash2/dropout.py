"""The dropout mask of cuflash2's kernels, in NumPy (cuda_src/dropout.cuh has the same function).

Element (batch entry b, head h, query q, key k) is kept iff a 16-bit uniform drawn by
Philox4x32-10 (Salmon et al., SC'11) is below ``keep_threshold(dropout_p)``; the counter and the
choice of uniform follow the kernels' mma accumulator layout (dropout.cuh). Use
``cuflash2.dropout_mask`` for the mask on the GPU; this module is the host-side definition the
tests hold the kernels to.
"""

from __future__ import annotations

import numpy

_M0, _M1 = numpy.uint64(0xD2511F53), numpy.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = numpy.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counters (c0, c1, c2, c3) (uint32 arrays, broadcast) and key (k0, k1)
    (ints): the four uint32 output words."""
    c = [numpy.asarray(x, dtype=numpy.uint64) & _MASK32 for x in (c0, c1, c2, c3)]
    c0, c1, c2, c3 = numpy.broadcast_arrays(*c)
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        prod0 = _M0 * c0
        prod1 = _M1 * c2
        hi0, lo0 = prod0 >> numpy.uint64(32), prod0 & _MASK32
        hi1, lo1 = prod1 >> numpy.uint64(32), prod1 & _MASK32
        c0, c1, c2, c3 = (hi1 ^ c1 ^ numpy.uint64(k0), lo1, hi0 ^ c3 ^ numpy.uint64(k1), lo0)
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return tuple(x.astype(numpy.uint32) for x in (c0, c1, c2, c3))


def keep_threshold(dropout_p: float) -> int:
    """Elements whose 16-bit uniform is below this are kept: round((1 - p) * 65536)."""
    return min(65536, int(round((1.0 - dropout_p) * 65536)))


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as the (low, high) 32-bit Philox key."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & 0xFFFFFFFF, seed >> 32


def keep_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
              offset: int = 0):
    """The boolean keep-mask (batch, nheads, seqlen_q, seqlen_k) the kernels use (True = kept)."""
    q = numpy.arange(seqlen_q, dtype=numpy.uint64)[:, None]
    k = numpy.arange(seqlen_k, dtype=numpy.uint64)[None, :]
    bh = numpy.arange(batch * nheads, dtype=numpy.uint64)[:, None, None]
    c0 = (k // 16) * 4 + (k % 8) // 2
    c1 = (q // 16) * 8 + q % 8
    k0, k1 = split_seed(seed)
    words = philox4x32_10(c0[None], c1[None], bh, numpy.uint64(offset & 0xFFFFFFFF), k0, k1)
    j = ((q // 8) % 2) * 4 + ((k // 8) % 2) * 2 + k % 2
    word = numpy.choose((j // 2).astype(numpy.int64), words)
    uniform = (word >> (16 * (j % 2)).astype(numpy.uint32)) & numpy.uint32(0xFFFF)
    keep = uniform < keep_threshold(dropout_p)
    return keep.reshape(batch, nheads, seqlen_q, seqlen_k)
