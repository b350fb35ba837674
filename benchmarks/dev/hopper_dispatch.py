"""The measurements behind the forward's dispatch on sm_90 (_dispatch.hopper_forward_config): every call
timed through cuflash2.attention twice on the same arrays, once planned onto the Hopper kernel
and once onto the mma.sync kernel (_dispatch.HOPPER_FORWARD off), kernel time by CUDA events over
back-to-back calls.

    python benchmarks/dev/hopper_dispatch.py [--iters 20]

Rows: FA3's grid (16k tokens, hidden 2048) from 512 to 16k tokens, head dims 64 and 128 (and
every larger Hopper head dim), causal on and off, plus short problems (few query rows, few
keys) where a 128-row tile is mostly empty.

Internals it uses: cuflash2._dispatch.HOPPER_FORWARD, cuflash2.api._forward_plans.
"""

import argparse

import numpy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    import cupy
    import ml_dtypes

    import cuflash2
    from cuflash2 import _configs, _dispatch, api, testing

    def time_ms(fn):
        for _ in range(3):
            fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / args.iters

    def on(enabled, q, k, v, causal):
        _dispatch.HOPPER_FORWARD = enabled
        api._forward_plans.plans.clear()
        kernel = cuflash2.forward_kernels(q, k, v, causal=causal)[0].split(",")[0]
        return time_ms(lambda: cuflash2.attention(q, k, v, causal=causal)), kernel

    rows = []
    for d in sorted({64, 128, *_configs.SM90_FWD_HEAD_DIMS}):
        for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
            rows.append((16384 // seqlen, seqlen, seqlen, 2048 // d, d))
    for d in (64, 128):
        rows += [(1, 1, 4096, 16, d), (8, 16, 2048, 16, d), (4, 64, 64, 16, d),
                 (64, 128, 128, 16, d), (2, 100, 8192, 16, d)]
    print(f"{'dtype':5} {'b':>4} {'sq':>6} {'sk':>6} {'h':>3} {'d':>4} {'causal':>6} "
          f"{'hopper ms':>10} {'mma.sync ms':>11} {'mma/hopper':>10}")
    for dtype_name in ("bf16", "fp16"):
        dtype = numpy.dtype(ml_dtypes.bfloat16) if dtype_name == "bf16" else numpy.dtype("float16")
        for batch, sq, sk, heads, d in rows:
            q, k, v = testing.random_qkv(cupy, batch, sq, sk, heads, heads, d, dtype, seed=sq)
            for causal in (False, True):
                hopper, name = on(True, q, k, v, causal)
                mma, _ = on(False, q, k, v, causal)
                flag = "" if name.startswith("Hopper") else f"  ({name} both times)"
                print(f"{dtype_name:5} {batch:>4} {sq:>6} {sk:>6} {heads:>3} {d:>4} "
                      f"{int(causal):>6} {hopper:>10.4f} {mma:>11.4f} {mma / hopper:>9.3f}x"
                      f"{flag}", flush=True)
    _dispatch.HOPPER_FORWARD = True


if __name__ == "__main__":
    main()
