"""Development timing of backward kernel variants on a GPU (not a benchmark of record).

A variant is a named text substitution applied to the kernel sources before compiling, e.g. to
measure what the dQ atomics cost by skipping them. Times the whole backward call at one shape per
(head dim, causal), next to the unmodified kernel.

    python benchmarks/dev_bwd_variants.py --variants base noatomic scalar_red --configs 128:64x128x8x2
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import numpy  # noqa: E402

from cuflash2 import _compile, _configs, _validate, api, bench, testing  # noqa: E402

# name -> list of (file, old, new)
VARIANTS = {
    "base": [],
    # dQ is computed but never added (a value-dependent early return keeps the products alive).
    "noatomic": [("mma_primitives.cuh",
                  "CF2_DEVICE void atomic_add_4(float* dst, float a, float b, float c, float d) {\n",
                  "CF2_DEVICE void atomic_add_4(float* dst, float a, float b, float c, float d) {\n"
                  "    if (a != -12345.f) return;\n")],
    "scalar_red": [("mma_primitives.cuh", "#if __CUDA_ARCH__ >= 900\n    asm volatile(\"red",
                    "#if 0\n    asm volatile(\"red")],
}

_original_source = _compile.kernel_source


def use_variant(name):
    subs = VARIANTS[name]
    root = _compile.cuda_src_dir()

    def patched(filename):
        text = _original_source(filename)
        for file, old, new in subs:
            original = (root / file).read_text()
            assert old in original, (name, file, old)
            text = text.replace(old, new)
        return text

    _compile.kernel_source = patched
    _compile._modules.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["base"])
    ap.add_argument("--configs", nargs="+", default=["64:128x128x8x2", "128:64x128x8x2"],
                    help="head_dim:block_m x block_n x warps x q_stages")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    dtype = numpy.dtype(numpy.float16)
    backlog = bench._Backlog(cupy)
    s = args.seqlen
    for spec in args.configs:
        d, shape = spec.split(":")
        d = int(d)
        bm, bn, warps, stages = map(int, shape.split("x"))
        cfg = _configs.BwdConfig("float16", d, d, bm, bn, warps, stages, not args.deterministic)
        b, h = 16384 // s, 2048 // d
        q, k, v = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s)
        dout = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s + 1)[0]
        problem = _validate.check_attention_inputs(q, k, v)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            out, lse = api.attention(q, k, v, causal=causal, return_lse=True)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            for name in args.variants:
                use_variant(name)
                ms = bench.time_cupy(cupy, lambda: api._launch_backward(
                    problem, dout, q, k, v, out, lse, *grads, window, args.deterministic, 0,
                    cupy, cfg), 3, 20, backlog)
                print(f"d={d} {shape} causal={causal} {name}: {ms:.3f} ms "
                      f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
