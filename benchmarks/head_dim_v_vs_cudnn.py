"""V with a head dim of its own (DeepSeek's d_qk 192 / d_v 128): cuflash2's forward (or with
--backward its backward, timed alone from the forward's out and lse) beside torch SDPA's cuDNN
backend (where it takes d_v != d_qk) and its memory-efficient backend on the same
arrays, and cuflash2's own d=192 kernel (d_qk = d_v = 192) as the bar where cuDNN does not run,
in one run; the paper grid's lengths (16k tokens a batch, 16 heads), causal and not. Median of
the rounds' medians, the contenders' order turning each round; TFLOP/s counted as the FLOPs of
Q K^T (d_qk) and P V (d_v): 2 * batch * heads * seqlen^2 * (d_qk + d_v), halved under causal
masking (the backward's 2.5x that: five products instead of two). Also prints cuflash2's max
error against a float32 reference of one head (a check that the kernel ran right, not a test):
out's, or with --backward the largest of dq's, dk's and dv's.

    python benchmarks/head_dim_v_vs_cudnn.py [--pairs 192/128 128/64] [--seqlens 512 ... 16384]
        [--tokens 16384] [--heads 16] [--dtypes bf16 fp16] [--backward] [--rounds 3]
        [--iters 10]
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

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": numpy.float16}


def flops(batch, heads, seqlen, d_qk, d_v, causal, backward=False):
    forward = 2 * batch * heads * seqlen * seqlen * (d_qk + d_v) / (2 if causal else 1)
    return 2.5 * forward if backward else forward


def cuflash2_call(q, k, v, dout, causal, backward):
    """cuflash2's forward, or its backward from the forward's out and lse."""
    if not backward:
        return lambda: cuflash2.attention(q, k, v, causal=causal)
    out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
    return lambda: cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal)


def torch_calls(torch, q, k, v, dout, causal, backward):
    """torch SDPA's cuDNN and memory-efficient backends on views of the same arrays (the
    backward: autograd.grad through a graph built once)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_(backward)
                  for x in (q, k, v))
    calls = {}
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                out = sdpa(qt, kt, vt, is_causal=causal)
        except Exception as exc:  # a backend that refuses the shape
            print(f"# {name}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
            continue
        if not backward:
            def call(backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(qt, kt, vt, is_causal=causal)
        else:
            dt = torch.from_dlpack(dout).transpose(1, 2)

            def call(out=out, dt=dt):
                return torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True)
        calls[name] = call
    return calls


def max_error_of_one_head(q, k, v, dout, call, causal, backward):
    """cuflash2's max error against the float32 reference for head 0 of batch entry 0 (KV head
    0, which only query head 0 of the group feeds when heads == KV heads: here they are)."""
    one = (slice(0, 1), slice(None), slice(0, 1))
    args = (q[one], k[one], v[one])
    if not backward:
        ref = cuflash2.reference.attention(*args, causal=causal, compute_dtype=numpy.float32)
        return float(cupy.abs(call()[one].astype(numpy.float32) - ref).max())
    refs = cuflash2.reference.attention_backward(dout[one], *args, None, None, causal=causal,
                                                 compute_dtype=numpy.float32)
    return max(float(cupy.abs(g[one].astype(numpy.float32) - r).max())
               for g, r in zip(call(), refs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=["192/128"])
    parser.add_argument("--seqlens", type=int, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--backward", action="store_true", help="time the backward alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch = load_torch()
    backlog = timing.Backlog(cupy)
    rng = numpy.random.default_rng(0)
    cudnn = torch.backends.cudnn.version() if torch is not None else None
    direction = "backward" if args.backward else "forward"
    print(f"# d_v != d_qk attention {direction}, "
          f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {args.tokens} tokens a "
          f"batch, {args.heads} heads, torch {torch.__version__ if torch else '-'} (cuDNN "
          f"{cudnn}); ms (TFLOP/s)")
    names = ["cuflash2", "sdpa cudnn", "sdpa efficient", "cuflash2 d=192 (v 192)"]
    print("| d_qk/d_v | dtype | causal | seqlen | " + " | ".join(names)
          + " | cudnn / cuflash2 | max err (ref fp32) |")
    print("|---" * (len(names) + 6) + "|")
    for pair in args.pairs:
        d_qk, d_v = map(int, pair.split("/"))
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for causal in (False, True):
                for n in args.seqlens:
                    batch = max(1, args.tokens // n)

                    def draw(d):
                        return cupy.asarray(rng.standard_normal(
                            (batch, n, args.heads, d), dtype=numpy.float32).astype(dtype))
                    q, k, v, v_wide = draw(d_qk), draw(d_qk), draw(d_v), draw(d_qk)
                    dout, dout_wide = draw(d_v), draw(d_qk)  # dO has V's head dim
                    calls = {"cuflash2": cuflash2_call(q, k, v, dout, causal, args.backward)}
                    if d_qk == 192:
                        calls["cuflash2 d=192 (v 192)"] = cuflash2_call(
                            q, k, v_wide, dout_wide, causal, args.backward)
                    if torch is not None:
                        calls.update(torch_calls(torch, q, k, v, dout, causal, args.backward))
                    med = timing.median_of_rounds(cupy, torch, calls, args.rounds, 2,
                                                  args.iters, backlog)
                    fl = {name: flops(batch, args.heads, n, d_qk,
                                      d_qk if "v 192" in name else d_v, causal, args.backward)
                          for name in med}
                    cells = [f"{med[x]:.3f} ({fl[x] / med[x] / 1e9:.0f})" if x in med else "-"
                             for x in names]
                    ratio = (f"{med['sdpa cudnn'] / med['cuflash2']:.2f}"
                             if "sdpa cudnn" in med else "-")
                    err = max_error_of_one_head(q, k, v, dout, calls["cuflash2"], causal,
                                                args.backward)
                    print(f"| {d_qk}/{d_v} | {dtype_name} | {causal} | {n} | "
                          + " | ".join(cells) + f" | {ratio} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
