"""Float64 central finite differences of the reference forward, for the backward tests."""

import numpy

from cuflash2 import reference


def finite_difference_grads(dout, q, k, v, step=1e-6, **options):
    """d sum(attention(q, k, v, **options) * dout) / d(q, k, v), one element at a time (tiny
    shapes only); q, k, v are float64 numpy arrays, perturbed in place and restored."""

    def loss():
        out = reference.attention(q, k, v, compute_dtype=numpy.float64, **options)
        return float(numpy.sum(out * dout))

    grads = []
    for x in (q, k, v):
        grad = numpy.zeros_like(x)
        for index in numpy.ndindex(x.shape):
            saved = x[index]
            x[index] = saved + step
            up = loss()
            x[index] = saved - step
            down = loss()
            x[index] = saved
            grad[index] = (up - down) / (2 * step)
        grads.append(grad)
    return grads
