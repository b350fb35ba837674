"""Small launches of every kernel specialisation (forward and backward), run under
compute-sanitizer by test_sanitizer.py.

Odd sequence lengths (partial tiles), seqlen_q != seqlen_k both ways, GQA, causal, a sliding
window and neither, every kernel head dim and both dtypes: the shapes where an out-of-bounds
access or a race would show.
Pass `--quick` for a subset (racecheck is slow).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402


def main(quick: bool) -> None:
    head_dims = (64, 128) if quick else (32, 40, 64, 96, 128, 160, 192, 224, 256)
    dtypes = (numpy.float16,) if quick else (numpy.float16, ml_dtypes.bfloat16)
    shapes = ((1, 77, 45, 2, 1), (2, 45, 77, 4, 2)) if quick else (
        (1, 77, 45, 2, 1), (2, 45, 77, 4, 2), (1, 130, 130, 3, 3), (1, 1, 200, 2, 1))
    for dtype in dtypes:
        for d in head_dims:
            for batch, sq, sk, h, hk in shapes:
                q, k, v = testing.random_qkv(cupy, batch, sq, sk, h, hk, d, dtype, seed=d + sq)
                dout = testing.random_qkv(cupy, batch, sq, sq, h, h, d, dtype, seed=d + 1)[0]
                for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (17, 3))):
                    out, lse = cuflash2.attention(q, k, v, causal=causal, window_size=window,
                                                  return_lse=True)
                    assert not bool(cupy.isnan(out).any())
                    for deterministic in (False, True):
                        grads = cuflash2.attention_backward(dout, q, k, v, out, lse,
                                                            causal=causal, window_size=window,
                                                            deterministic=deterministic)
                        assert not any(bool(cupy.isnan(g).any()) for g in grads)
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitizer workload done")


if __name__ == "__main__":
    main("--quick" in sys.argv)
