"""Sliding-window attention (window_size=(left, right)), forward and backward, against the
reference with the 2x rule: windows alone and with causal, odd lengths, seqlen_q != seqlen_k
(bottom-right alignment), GQA, both dtypes, both backward modes."""

import numpy
import pytest
from grids import DTYPES, seed_of  # tests/gpu helper

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu

# (window, causal)
WINDOWS = [((16, 0), True), ((0, 0), False), ((32, 32), False), ((-1, 8), False),
           ((100, -1), False), ((7, -1), True), ((200, 3), False)]
SHAPES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_kv
    (2, 97, 97, 2, 2), (1, 255, 1023, 6, 2), (1, 1023, 255, 4, 1), (1, 300, 300, 2, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("window,causal", WINDOWS, ids=[f"{w}{'-causal' if c else ''}" for w, c in WINDOWS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[1]}x{s[2]}-h{s[3]}/{s[4]}" for s in SHAPES])
def test_window_forward_backward(dtype, headdim, window, causal, shape):
    batch, sq, sk, h, hk = shape
    seed = seed_of(shape, headdim, window, causal, str(dtype))
    q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, headdim, dtype, seed)
    dout = testing.random_qkv(cupy, batch, sq, sq, h, h, headdim, dtype, seed + 1)[0]
    out = testing.poison_like(cupy, q.shape, dtype)
    out, lse = cuflash2.attention(q, k, v, causal=causal, window_size=window, return_lse=True,
                                  out=out)
    results = testing.check_forward(q, k, v, out, lse, causal=causal, window_size=window)
    assert all(r.ok for r in results), [str(r) for r in results]
    for deterministic in (False, True):
        dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                 window_size=window,
                                                 deterministic=deterministic)
        results = testing.check_backward(dout, q, k, v, dq, dk, dv, causal=causal,
                                         window_size=window)
        assert all(r.ok for r in results), (deterministic, [str(r) for r in results])


def test_window_vjp_and_skipped_tiles():
    # A narrow window on a long sequence: correct, and cheaper than full attention (tiles
    # outside the window are skipped, not masked). Large enough (b=4, h=16) that the GPU, not
    # the ~0.07 ms host cost of a call, sets the time of the windowed calls.
    dtype = numpy.dtype(numpy.float16)
    q, k, v = testing.random_qkv(cupy, 4, 8192, 8192, 16, 16, 64, dtype, seed=5)
    out, vjp = cuflash2.attention_vjp(q, k, v, window_size=(128, 0))
    ref = cuflash2.attention(q, k, v, window_size=(128, 0))
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())
    dq, dk, dv = vjp(testing.random_qkv(cupy, 4, 8192, 8192, 16, 16, 64, dtype, seed=6)[0])
    assert not any(bool(cupy.isnan(g).any()) for g in (dq, dk, dv))

    def elapsed(fn):
        fn()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(5):
            fn()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop)

    windowed = elapsed(lambda: cuflash2.attention(q, k, v, window_size=(128, 0)))
    full = elapsed(lambda: cuflash2.attention(q, k, v))
    assert windowed < full / 8, (windowed, full)


def test_window_contradicting_causal_is_rejected():
    q, k, v = testing.random_qkv(cupy, 1, 16, 16, 2, 2, 64, numpy.float16, seed=1)
    with pytest.raises(ValueError, match="causal=True already fixes"):
        cuflash2.attention(q, k, v, causal=True, window_size=(4, 4))
