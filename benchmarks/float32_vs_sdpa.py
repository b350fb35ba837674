"""Float32 attention forward (or with --backward its backward): cuflash2 at precision "highest"
and "tf32" beside cuflash2's bf16 kernels on the same values, and torch SDPA on the float32
arrays (its math backend, and its memory-efficient backend, which takes float32), in one run on
the same arrays; median of the rounds' medians, the order of the contenders turning each round.
Also prints each float32 result's max error against a float64 reference of one head (a check
that the kernels ran right, not a test): the output's, or with --backward the largest of dq's,
dk's and dv's.

The backward is timed alone: cuflash2's attention_backward from the forward's out and lse,
torch's autograd.grad through a graph built once (retain_graph). Its FLOPs are counted as 2.5x
the forward's (five products instead of two).

    python benchmarks/float32_vs_sdpa.py [--seqlens 1024 4096] [--headdims 64 128]
        [--batch 2] [--heads 16] [--causal] [--backward] [--rounds 3] [--iters 10]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench import timing  # noqa: E402
from cuflash2.bench.torch_peers import load_torch  # noqa: E402


def flops(batch, heads, seqlen, headdim, causal, backward=False):
    forward = 4 * batch * heads * seqlen * seqlen * headdim / (2 if causal else 1)
    return 2.5 * forward if backward else forward


def forward_calls(q, k, v, q16, k16, v16, causal):
    """The cuflash2 contenders of the forward."""
    return {
        "highest": lambda: cuflash2.attention(q, k, v, causal=causal),
        "tf32": lambda: cuflash2.attention(q, k, v, causal=causal, precision="tf32"),
        "bf16": lambda: cuflash2.attention(q16, k16, v16, causal=causal),
    }


def backward_calls(q, k, v, q16, k16, v16, dout, causal):
    """The cuflash2 contenders of the backward, each from its own forward's out and lse."""
    calls = {}
    for name, arrays, precision in (("highest", (q, k, v), None), ("tf32", (q, k, v), "tf32"),
                                    ("bf16", (q16, k16, v16), None)):
        d_out = dout if arrays[0] is q else dout.astype(q16.dtype)
        out, lse = cuflash2.attention(*arrays, causal=causal, precision=precision,
                                      return_lse=True)

        def call(arrays=arrays, precision=precision, d_out=d_out, out=out, lse=lse):
            return cuflash2.attention_backward(d_out, *arrays, out, lse, causal=causal,
                                               precision=precision)
        calls[name] = call
    return calls


def torch_calls(torch, q, k, v, dout, causal, backward):
    """torch SDPA's math and memory-efficient backends on the float32 arrays (views of them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {}
    for name, backend in (("sdpa math fp32", SDPBackend.MATH),
                          ("sdpa efficient fp32", SDPBackend.EFFICIENT_ATTENTION)):
        qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_(backward)
                      for x in (q, k, v))
        if not backward:
            def call(backend=backend, qt=qt, kt=kt, vt=vt):
                with sdpa_kernel(backend):
                    return sdpa(qt, kt, vt, is_causal=causal)
        else:
            try:
                with sdpa_kernel(backend):
                    out = sdpa(qt, kt, vt, is_causal=causal)
            except Exception as exc:  # a backend that refuses (memory, shape)
                print(f"# {name}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
                continue
            dt = torch.from_dlpack(dout).transpose(1, 2)

            def call(out=out, qt=qt, kt=kt, vt=vt, dt=dt):
                return torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True)
        calls[name] = call
    return calls


def max_error_of_one_head(q, k, v, dout, calls, causal, backward):
    """Max errors against float64 of head 0 of batch entry 0: "highest", "tf32", then the plain
    float32 reference's (every head has its own K and V: no GQA, so a head's gradients are its
    own)."""
    one = (slice(0, 1), slice(None), slice(0, 1))
    args = (q[one], k[one], v[one])
    if not backward:
        ref = cuflash2.reference.attention(*args, causal=causal, compute_dtype=numpy.float64)
        plain = cuflash2.reference.attention(*args, causal=causal, compute_dtype=numpy.float32)
        errs = [float(cupy.abs(calls[x]()[one] - ref).max()) for x in ("highest", "tf32")]
        return errs + [float(cupy.abs(plain - ref).max())]
    refs = cuflash2.reference.attention_backward(dout[one], *args, None, None, causal=causal,
                                                 compute_dtype=numpy.float64)
    plain = cuflash2.reference.attention_backward(dout[one], *args, None, None, causal=causal,
                                                  compute_dtype=numpy.float32)
    errs = [max(float(cupy.abs(g[one] - r).max()) for g, r in zip(calls[x](), refs))
            for x in ("highest", "tf32")]
    return errs + [max(float(cupy.abs(g - r).max()) for g, r in zip(plain, refs))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time the backward alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch = load_torch()
    backlog = timing.Backlog(cupy)
    rng = numpy.random.default_rng(0)
    direction = "backward" if args.backward else "forward"
    print(f"# float32 attention {direction}, "
          f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, batch {args.batch}, "
          f"{args.heads} heads, causal {args.causal}; ms (TFLOP/s)")
    names = ["highest", "tf32", "bf16", "sdpa math fp32", "sdpa efficient fp32"]
    print("| d | seqlen | " + " | ".join(names) + " | highest / bf16 | tf32 / bf16 | "
          "math / highest | max err highest, tf32 (plain fp32) |")
    print("|---" * (len(names) + 6) + "|")
    for d in args.headdims:
        for n in args.seqlens:
            shape = (args.batch, n, args.heads, d)
            q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32))
                       for _ in range(3))
            q16, k16, v16 = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
            dout = cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32))
            if args.backward:
                calls = backward_calls(q, k, v, q16, k16, v16, dout, args.causal)
            else:
                calls = forward_calls(q, k, v, q16, k16, v16, args.causal)
            if torch is not None:
                calls.update(torch_calls(torch, q, k, v, dout, args.causal, args.backward))
            med = timing.median_of_rounds(
                cupy, torch, calls, args.rounds, 2, args.iters, backlog,
                on_error=lambda name, exc, d=d, n=n: print(
                    f"# {name} d={d} n={n}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr))
            fl = flops(args.batch, args.heads, n, d, args.causal, args.backward)
            cells = [f"{med[x]:.3f} ({fl / med[x] / 1e9:.0f})" if x in med else "-"
                     for x in names]
            # Accuracy of one head against float64, and the plain float32 reference's.
            errs = max_error_of_one_head(q, k, v, dout, calls, args.causal, args.backward)
            math_ratio = med.get("sdpa math fp32", float("nan")) / med["highest"]
            print(f"| {d} | {n} | " + " | ".join(cells)
                  + f" | {med['highest'] / med['bf16']:.2f} | {med['tf32'] / med['bf16']:.2f} | "
                  f"{math_ratio:.2f} | {errs[0]:.1e}, {errs[1]:.1e} ({errs[2]:.1e}) |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
