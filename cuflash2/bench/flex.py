"""`python -m cuflash2 bench --flex`: cuflash2 next to PyTorch's FlexAttention on the same arrays.

FlexAttention is `torch.nn.attention.flex_attention.flex_attention` compiled with
`torch.compile` (Triton kernels generated for the mask), with a causal block mask for the causal
rows (`create_block_mask`, so fully masked tiles are skipped) and none for the others. Its
inputs are (batch, heads, seqlen, headdim) contiguous copies of cuflash2's arrays, its preferred
layout; the backward runs through autograd on a retained graph, as the SDPA rows do. Rows: the
paper grid's shape (16k tokens, hidden 2048) at the --seqlens given (default 16k), --dtype,
--headdim (default 128), causal modes and directions as the main grid's.
"""

from __future__ import annotations

import sys

from .paper_grid import Config, environment_header, format_cell, random_inputs
from .timing import Backlog, time_cupy, time_torch
from .torch_peers import load_torch, torch_view

#: Default rows: the shape of the issue that names FlexAttention (bf16 d=128, 16 heads, 16k).
DEFAULT_SEQLENS = (16384,)
DEFAULT_HEADDIMS = (128,)


class Flex:
    """torch.compile'd flex_attention on (b, h, s, d) contiguous copies of our arrays."""

    def __init__(self, torch, cupy, dtype_name: str):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.torch, self.cupy = torch, cupy
        self.torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        self.compiled = torch.compile(flex_attention)
        self.create_block_mask = create_block_mask

    def as_bhsd(self, array):
        return torch_view(self.torch, self.cupy, array, self.torch_dtype).transpose(1, 2) \
            .contiguous()

    def mask(self, seqlen: int, causal: bool):
        if not causal:
            return None
        return self.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                      seqlen, seqlen, device="cuda")

    def forward(self, q, k, v, causal):
        qt, kt, vt = (self.as_bhsd(x) for x in (q, k, v))
        mask = self.mask(q.shape[1], causal)
        return lambda: self.compiled(qt, kt, vt, block_mask=mask)

    def backward(self, q, k, v, dout, causal):
        qt, kt, vt = (self.as_bhsd(x).requires_grad_() for x in (q, k, v))
        dout_t = self.as_bhsd(dout)
        out = self.compiled(qt, kt, vt, block_mask=self.mask(q.shape[1], causal))
        return lambda: self.torch.autograd.grad(out, (qt, kt, vt), dout_t, retain_graph=True)


def _timed_row(cupy, torch, config, seed: int, warmup: int, iters: int, backlog) -> dict:
    """One configuration on cuflash2 and on FlexAttention, fresh inputs shared by both."""
    import cuflash2
    from ..selfcheck import dtype_from_name

    q, k, v = random_inputs(cupy, config, dtype_from_name(config.dtype), seed)
    dout = cupy.random.default_rng(seed + 10_000).standard_normal(
        q.shape, dtype=cupy.float32).astype(q.dtype)
    causal = config.causal
    row = {"config": config.describe(), "direction": config.direction, "dtype": config.dtype,
           "headdim": config.headdim, "seqlen": config.seqlen, "causal": causal,
           "cuflash2_ms": None, "flex_ms": None, "error": None}
    options = config.options().keywords()
    try:
        if config.direction == "fwd":
            def ours():
                return cuflash2.attention(q, k, v, **options)
        else:
            out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)

            def ours():
                return cuflash2.attention_backward(dout, q, k, v, out, lse, **options)
        row["cuflash2_ms"] = time_cupy(cupy, ours, warmup, iters, backlog)
        flex = Flex(torch, cupy, config.dtype)
        theirs = (flex.forward(q, k, v, causal) if config.direction == "fwd"
                  else flex.backward(q, k, v, dout, causal))
        row["flex_ms"] = time_torch(torch, theirs, warmup, iters, backlog)
    except Exception as exc:  # keep going; the row shows what failed
        row["error"] = f"{exc.__class__.__name__}: {exc}"
    for name in ("cuflash2", "flex"):
        ms = row[f"{name}_ms"]
        row[f"{name}_tflops"] = config.flops / ms / 1e9 if ms else None
    return row


def flex_rows(cupy, torch, configs, warmup: int, iters: int, progress=sys.stderr) -> list[dict]:
    """Each configuration timed on cuflash2 and on FlexAttention, same inputs."""
    backlog = Backlog(cupy)
    rows = []
    for seed, config in enumerate(configs):
        row = _timed_row(cupy, torch, config, seed, warmup, iters, backlog)
        print(f"{row['config']:<40} cuflash2 {format_cell(row['cuflash2_tflops'], '7.1f')} "
              f"TFLOP/s  FlexAttention {format_cell(row['flex_tflops'], '7.1f')}"
              + (f"  [{row['error']}]" if row["error"] else ""), file=progress, flush=True)
        rows.append(row)
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows


def flex_table(rows: list[dict]) -> str:
    lines = ["| dir | dtype | d | causal | seqlen | cuflash2 ms | FlexAttention ms | cuflash2 "
             "TFLOP/s | FlexAttention TFLOP/s | FlexAttention ms / cuflash2 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = r["flex_ms"] / r["cuflash2_ms"] if r["flex_ms"] and r["cuflash2_ms"] else None
        lines.append(
            f"| {r['direction']} | {r['dtype']} | {r['headdim']} | "
            f"{'yes' if r['causal'] else 'no'} | {r['seqlen']} | "
            f"{format_cell(r['cuflash2_ms'], '.3f')} | {format_cell(r['flex_ms'], '.3f')} | {format_cell(r['cuflash2_tflops'], '.1f')} | "
            f"{format_cell(r['flex_tflops'], '.1f')} | {format_cell(speedup, '.3f')} |"
            + (f" {r['error']}" if r["error"] else ""))
    return "\n".join(lines)


def configs_from_args(args) -> list[Config]:
    directions = ("fwd", "bwd") if args.direction == "both" else (args.direction,)
    causal_modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    seqlens = args.seqlens or DEFAULT_SEQLENS
    return [Config(direction, dtype, d, causal, s, args.tokens // s, args.hidden // d)
            for direction in directions for dtype in args.dtype
            for d in (args.headdim or DEFAULT_HEADDIMS) for causal in causal_modes
            for s in seqlens]


def run(cupy, args) -> int:
    """`bench --flex`: the table (markdown on stdout), --json."""
    import json

    from .. import _environment

    torch = load_torch()
    if torch is None:
        print("cuflash2 bench --flex: needs PyTorch with CUDA (FlexAttention)", file=sys.stderr)
        return 2
    env = _environment.collect()
    rows = flex_rows(cupy, torch, configs_from_args(args), args.warmup, args.iters)
    print(f"\n{environment_header(env)}\n")
    print("FlexAttention: torch.compile(flex_attention), causal rows with a causal block mask; "
          "(batch, heads, seqlen, headdim) contiguous copies of the same arrays; median of "
          f"{args.iters} calls, CUDA events; backward through autograd on a retained graph.\n")
    print(flex_table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": env, "flex": rows}, handle, indent=2)
    return 0
