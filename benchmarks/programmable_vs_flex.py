"""Programmable attention (issue 44) next to PyTorch's FlexAttention on the same arrays.

Rows (bf16 unless said):
- the issue's four masks at 1 x 16 heads x 16k tokens x d=128, forward and backward: causal,
  document-causal (8 documents of 2k), causal sliding window 1024, prefix-LM (2048-token
  prefix); cuflash2 with the mask as a `mask_mod` and its `block_mask` (forward and backward
  skip the empty tiles), FlexAttention (`torch.compile`d
  flex_attention) with `create_block_mask` of the same mask; cuflash2's built-in causal and
  window beside them (a mask modifier that equals a built-in: within 1.1x of it);
- the bias forward against the plain forward at 4k tokens (4 x 16 heads, d=128, a (1, 16, 4k,
  4k) bias): within 1.3x; the backward without dbias (bias_requires_grad=False) against the
  plain backward;
- an Evoformer pair bias (batch 64, 4 heads, 768 x 768, d=32, the bias (1, 4, 768, 768) shared
  by the batch), forward and backward with dbias, next to FlexAttention with the same bias as a
  score_mod (its gradient through autograd).

    PYTHONPATH=. python3 benchmarks/programmable_vs_flex.py [--iters 10] [--only masks bias evo]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2.bench.timing import Backlog, time_cupy, time_torch  # noqa: E402
from cuflash2.bench.torch_peers import torch_view  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402

SEQ, HEADS, D = 16384, 16, 128
DOC_LEN, WINDOW, PREFIX = 2048, 1024, 2048
#: The issue's four masks: name -> (the mask modifier's expression, which reads `doc` (document
#: ids, doc_ids) where it names it; the built-in masks it equals, or None).
MASKS = {
    "causal": ("kv_idx <= q_idx", dict(causal=True)),
    "document-causal 8 x 2k": ("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", None),
    "causal window 1024": (f"kv_idx <= q_idx && q_idx - kv_idx < {WINDOW}",
                           dict(causal=True, window_size=(WINDOW - 1, 0))),
    "prefix-LM 2048": (f"kv_idx <= q_idx || kv_idx < {PREFIX}", None),
}


def doc_ids():
    """The document of each of the SEQ positions (DOC_LEN each), int32 on the GPU."""
    return cupy.asarray(numpy.arange(SEQ, dtype=numpy.int32) // DOC_LEN)


def mask_mod_of(package, name: str, doc):
    """MASKS[name]'s mask modifier of `package` (cuflash2, or another version of it)."""
    expression = MASKS[name][0]
    return package.mask_mod(expression, **({"doc": doc} if "doc[" in expression else {}))


def _masks(torch):
    """name -> (cuflash2 mask_mod, flex mask function, built-in kwargs or None)."""
    doc = doc_ids()
    doc_t = torch.arange(SEQ, device="cuda") // DOC_LEN
    flex = {
        "causal": lambda b, h, q, kv: kv <= q,
        "document-causal 8 x 2k": lambda b, h, q, kv: (doc_t[q] == doc_t[kv]) & (kv <= q),
        "causal window 1024": lambda b, h, q, kv: (kv <= q) & (q - kv < WINDOW),
        "prefix-LM 2048": lambda b, h, q, kv: (kv <= q) | (kv < PREFIX),
    }
    return {name: (mask_mod_of(cuflash2, name, doc), flex[name], builtin)
            for name, (_, builtin) in MASKS.items()}


def _bhsd(torch, x, dtype):
    return torch_view(torch, cupy, x, dtype).transpose(1, 2).contiguous()


def mask_rows(torch, flex, create_block_mask, args, backlog):
    dtype = dtype_from_name("bf16")
    tdt = torch.bfloat16
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, SEQ, HEADS, D), dtype=cupy.float32).astype(dtype)
                     for _ in range(4))
    qt, kt, vt, dt = (_bhsd(torch, x, tdt) for x in (q, k, v, dout))
    print("| mask | cuflash2 fwd ms | built-in fwd | Flex fwd | vs Flex | cuflash2 bwd ms | "
          "built-in bwd | Flex bwd | vs Flex |")
    print("|---|---|---|---|---|---|---|---|---|")
    kernels = []  # (mask, forward kernels, backward kernels): printed after the table
    for name, (mm, fn, builtin) in _masks(torch).items():
        bm = cuflash2.block_mask(mm, 1, 1, SEQ, SEQ, head_dim=D, dtype=dtype)
        out, lse = cuflash2.attention(q, k, v, mask_mod=mm, block_mask=bm, return_lse=True)
        fwd = time_cupy(cupy, lambda: cuflash2.attention(q, k, v, mask_mod=mm, block_mask=bm),
                        2, args.iters, backlog)
        bwd = time_cupy(cupy, lambda: cuflash2.attention_backward(dout, q, k, v, out, lse,
                                                                  block_mask=bm),
                        2, args.iters, backlog)
        b_fwd = b_bwd = float("nan")
        if builtin is not None:
            o2, l2 = cuflash2.attention(q, k, v, return_lse=True, **builtin)
            b_fwd = time_cupy(cupy, lambda: cuflash2.attention(q, k, v, **builtin), 2,
                              args.iters, backlog)
            b_bwd = time_cupy(cupy, lambda: cuflash2.attention_backward(dout, q, k, v, o2, l2,
                                                                        **builtin),
                              2, args.iters, backlog)
        fbm = create_block_mask(fn, None, None, SEQ, SEQ, device="cuda")
        f_fwd = time_torch(torch, lambda: flex(qt, kt, vt, block_mask=fbm), 2, args.iters,
                           backlog)
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
        fo = flex(qg, kg, vg, block_mask=fbm)
        f_bwd = time_torch(torch, lambda: torch.autograd.grad(fo, (qg, kg, vg), dt,
                                                              retain_graph=True),
                           2, args.iters, backlog)
        print(f"| {name} | {fwd:.3f} | {b_fwd:.3f} | {f_fwd:.3f} | {f_fwd / fwd:.2f}x | "
              f"{bwd:.3f} | {b_bwd:.3f} | {f_bwd:.3f} | {f_bwd / bwd:.2f}x |", flush=True)
        kernels.append((name, cuflash2.forward_kernels(q, k, v, mask_mod=mm, block_mask=bm),
                        cuflash2.backward_kernels(dout, q, k, v, out, lse, block_mask=bm)))
    print()
    for name, fwd_kernels, bwd_kernels in kernels:
        print(f"- {name}: forward {'; '.join(fwd_kernels)}; backward {'; '.join(bwd_kernels)}")


def bias_rows(args, backlog):
    dtype = dtype_from_name("bf16")
    rng = cupy.random.default_rng(1)
    b, s, h = 4, 4096, 16
    q, k, v = (rng.standard_normal((b, s, h, D), dtype=cupy.float32).astype(dtype)
               for _ in range(3))
    bias = rng.standard_normal((1, h, s, s), dtype=cupy.float32).astype(dtype)
    plain = time_cupy(cupy, lambda: cuflash2.attention(q, k, v), 2, args.iters, backlog)
    biased = time_cupy(cupy, lambda: cuflash2.attention(q, k, v, bias=bias), 2, args.iters,
                       backlog)
    print(f"\nbias forward, bf16 {b} x {h} heads x {s} tokens x d={D}, bias (1, {h}, {s}, {s}): "
          f"plain {plain:.3f} ms ({cuflash2.forward_kernels(q, k, v)[0][:40]}...), with bias "
          f"{biased:.3f} ms: {biased / plain:.2f}x", flush=True)
    # The backward without dbias (bias_requires_grad=False) against the plain backward.
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(dtype)
    plain_bwd = time_cupy(cupy, lambda: cuflash2.attention_backward(dout, q, k, v, out, lse), 2,
                          args.iters, backlog)
    out, lse = cuflash2.attention(q, k, v, bias=bias, return_lse=True)
    biased_bwd = time_cupy(cupy, lambda: cuflash2.attention_backward(
        dout, q, k, v, out, lse, bias=bias, bias_requires_grad=False), 2, args.iters, backlog)
    kernels = cuflash2.backward_kernels(dout, q, k, v, out, lse, bias=bias,
                                        bias_requires_grad=False)
    print(f"bias backward without dbias: plain {plain_bwd:.3f} ms, with bias {biased_bwd:.3f} "
          f"ms: {biased_bwd / plain_bwd:.2f}x ({kernels[1][:60]}...)", flush=True)


def evoformer_rows(torch, flex, args, backlog):
    dtype = dtype_from_name("bf16")
    tdt = torch.bfloat16
    rng = cupy.random.default_rng(2)
    b, n, h, d = 64, 768, 4, 32
    q, k, v, dout = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype)
                     for _ in range(4))
    bias = rng.standard_normal((1, h, n, n), dtype=cupy.float32).astype(dtype)
    out, lse = cuflash2.attention(q, k, v, bias=bias, return_lse=True)
    fwd = time_cupy(cupy, lambda: cuflash2.attention(q, k, v, bias=bias), 2, args.iters,
                    backlog)
    bwd = time_cupy(cupy, lambda: cuflash2.attention_backward(dout, q, k, v, out, lse,
                                                              bias=bias),
                    2, args.iters, backlog)
    qt, kt, vt, dt = (_bhsd(torch, x, tdt) for x in (q, k, v, dout))
    bias_t = torch_view(torch, cupy, bias, tdt)[0].clone()

    def score_mod(score, bb, hh, qi, ki):
        return score + bias_t[hh, qi, ki]

    f_fwd = time_torch(torch, lambda: flex(qt, kt, vt, score_mod=score_mod), 2, args.iters,
                       backlog)
    note = ""
    try:
        bias_t.requires_grad_()
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
        fo = flex(qg, kg, vg, score_mod=score_mod)
        f_bwd = time_torch(torch, lambda: torch.autograd.grad(fo, (qg, kg, vg, bias_t), dt,
                                                              retain_graph=True),
                           2, args.iters, backlog)
    except Exception as exc:  # a Flex without gradients of captured tensors
        f_bwd, note = float("nan"), f" (Flex backward with dbias failed: {exc!r:.200})"
    print(f"\nEvoformer pair bias, bf16 {b} x {h} heads x {n} x {n}, d={d}, bias (1, {h}, {n}, "
          f"{n}): cuflash2 fwd {fwd:.3f} ms, Flex {f_fwd:.3f} ms ({f_fwd / fwd:.2f}x); "
          f"bwd with dbias {bwd:.3f} ms, Flex {f_bwd:.3f} ms ({f_bwd / bwd:.2f}x){note}",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", nargs="+", default=["bias", "evo", "masks"])
    args = parser.parse_args()
    backlog = Backlog(cupy)
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, cuflash2 "
          f"{cuflash2.__version__}, median of {args.iters} calls (CUDA events)")
    if "bias" in args.only:
        bias_rows(args, backlog)
    if not {"evo", "masks"} & set(args.only):
        return 0
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    print(f"# torch {torch.__version__}")
    # One compiled flex_attention for every mask and bias here, with and without gradients:
    # past dynamo's default of 8 recompilations it would fall back to the unfused, eager
    # implementation (which materialises the scores).
    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention)
    if "evo" in args.only:
        evoformer_rows(torch, flex, args, backlog)
    if "masks" in args.only:
        print()
        mask_rows(torch, flex, create_block_mask, args, backlog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
