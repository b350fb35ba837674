"""Float64 central finite differences of the reference forward, for the backward tests."""

import numpy

from cuflash2 import reference


def finite_difference_grads(dout, q, k, v, step=1e-6, forward=None, **options):
    """d sum(attention(q, k, v, **options) * dout) / d(q, k, v), one element at a time (tiny
    shapes only); q, k, v are float64 numpy arrays, perturbed in place and restored.

    With ``sinks`` in options (a float64 numpy array, perturbed in place and restored too) the
    derivative w.r.t. the sinks comes fourth, as the reference backward returns it.
    ``forward(q, k, v, compute_dtype=..., **options)`` replaces ``reference.attention`` (e.g.
    ``reference.attention_varlen`` with its cu_seqlens bound).
    """
    forward = reference.attention if forward is None else forward

    def loss():
        out = forward(q, k, v, compute_dtype=numpy.float64, **options)
        return float(numpy.sum(out * dout))

    wrt = [q, k, v]
    if options.get("sinks") is not None:
        wrt.append(options["sinks"])
    return [central_difference(loss, x, step) for x in wrt]


def central_difference(loss, x, step):
    """d loss() / d x by central differences, x (a float64 array) changed in place and restored
    element by element."""
    grad = numpy.zeros_like(x)
    for index in numpy.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + step
        up = loss()
        x[index] = saved - step
        down = loss()
        x[index] = saved
        grad[index] = (up - down) / (2 * step)
    return grad
