"""Float32 attention forward: cuflash2 at precision "highest" and "tf32" beside cuflash2's bf16
kernels on the same values, and torch SDPA on the float32 arrays (its math backend, and its
memory-efficient backend, which takes float32), in one run on the same arrays; median of the
rounds' medians, the order of the contenders turning each round. Also prints each float32
result's max error against a float64 reference of one head (a check that the kernels ran
right, not a test).

    python benchmarks/float32_vs_sdpa.py [--seqlens 1024 4096] [--headdims 64 128]
        [--batch 2] [--heads 16] [--causal] [--rounds 3] [--iters 10]
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench import timing  # noqa: E402
from cuflash2.bench.torch_peers import load_torch  # noqa: E402


def flops(batch, heads, seqlen, headdim, causal):
    return 4 * batch * heads * seqlen * seqlen * headdim / (2 if causal else 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch = load_torch()
    backlog = timing.Backlog(cupy)
    rng = numpy.random.default_rng(0)
    print(f"# float32 attention forward, {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
          f", batch {args.batch}, {args.heads} heads, causal {args.causal}; ms (TFLOP/s)")
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
            calls = {
                "highest": lambda: cuflash2.attention(q, k, v, causal=args.causal),
                "tf32": lambda: cuflash2.attention(q, k, v, causal=args.causal,
                                                   precision="tf32"),
                "bf16": lambda: cuflash2.attention(q16, k16, v16, causal=args.causal),
            }
            if torch is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                sdpa = torch.nn.functional.scaled_dot_product_attention
                for name, backend in (("sdpa math fp32", SDPBackend.MATH),
                                      ("sdpa efficient fp32", SDPBackend.EFFICIENT_ATTENTION)):
                    def call(backend=backend):
                        with sdpa_kernel(backend):
                            return sdpa(qt, kt, vt, is_causal=args.causal)
                    calls[name] = call
            times = {name: [] for name in calls}
            order = list(calls)
            for r in range(args.rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    fn = calls[name]
                    try:
                        if name.startswith("sdpa"):
                            times[name].append(timing.time_torch(torch, fn, 2, args.iters,
                                                                 backlog))
                        else:
                            times[name].append(timing.time_cupy(cupy, fn, 2, args.iters,
                                                                backlog))
                    except Exception as exc:  # a backend that refuses (memory, shape)
                        print(f"# {name} d={d} n={n}: {type(exc).__name__}: {exc}"[:200],
                              file=sys.stderr)
                        times[name].append(float("nan"))
            med = {name: statistics.median(t) for name, t in times.items()}
            fl = flops(args.batch, args.heads, n, d, args.causal)
            cells = [f"{med[x]:.3f} ({fl / med[x] / 1e9:.0f})" if x in med else "-"
                     for x in names]
            # Accuracy of one head against float64, and the plain float32 reference's.
            one = (slice(0, 1), slice(None), slice(0, 1))
            ref = cuflash2.reference.attention(q[one], k[one], v[one], causal=args.causal,
                                               compute_dtype=numpy.float64)
            plain = cuflash2.reference.attention(q[one], k[one], v[one], causal=args.causal,
                                                 compute_dtype=numpy.float32)
            errs = [float(cupy.abs(calls[x]()[one] - ref).max()) for x in ("highest", "tf32")]
            errs.append(float(cupy.abs(plain - ref).max()))
            math_ratio = med.get("sdpa math fp32", float("nan")) / med["highest"]
            print(f"| {d} | {n} | " + " | ".join(cells)
                  + f" | {med['highest'] / med['bf16']:.2f} | {med['tf32'] / med['bf16']:.2f} | "
                  f"{math_ratio:.2f} | {errs[0]:.1e}, {errs[1]:.1e} ({errs[2]:.1e}) |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
