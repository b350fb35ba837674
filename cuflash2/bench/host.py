"""`python -m cuflash2 bench --host`: the fixed cost of a call, next to torch SDPA's.

Two measurements, in one run on the same arrays:
- host cost: wall time per call over many back-to-back calls on small inputs (the GPU work of
  each call takes less than its host side, so the Python side and the launches set the pace);
- call by call: each call timed alone with CUDA events around it and the GPU idle before it (no
  queue in front), as a pipeline of many small attention calls runs; the time then includes the
  host cost of the call, on the paper grid's short sequences.
"""

from __future__ import annotations

import statistics
import sys
import time

from .paper_grid import (DEFAULT_HEADDIMS, attention_flops, environment_header, paper_grid,
                   random_inputs)
from .torch_peers import TorchSdpaFlash, load_torch

#: Tiny inputs of the host-cost rows: (batch, seqlen, heads, headdim).
HOST_SHAPE = (1, 128, 8, 64)
HOST_CALLS = 2000
#: Paper-grid sequence lengths timed call by call.
CALL_BY_CALL_SEQLENS = (512, 1024)


def _per_call_us(cupy, fn, calls: int, sync, repeats: int = 3) -> float:
    """Wall microseconds per call over `calls` back-to-back calls, the best of `repeats` runs
    (after one warm-up call). The inputs are small enough that the GPU keeps up: the host sets
    the pace. (Queuing the calls behind a spinning kernel instead would fill the driver's launch
    queue, whose waits then count as host time.)"""
    best = float("inf")
    for _ in range(repeats):
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        sync()
    return best / calls * 1e6


def _raise_clocks(cupy, seconds: float = 0.5) -> None:
    """Keeps the GPU busy for a moment: from idle clocks, the first small kernels run slowly
    enough to hold the host back."""
    buffer = cupy.zeros(1 << 28, dtype=cupy.uint8)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        buffer += 1
        cupy.cuda.runtime.deviceSynchronize()


def host_rows(cupy, torch, calls: int = HOST_CALLS) -> list[dict]:
    """Host cost per call of each entry point, and of torch SDPA's flash and cuDNN backends."""
    import cuflash2

    rng = cupy.random.default_rng(0)
    shape = HOST_SHAPE
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                     for _ in range(4))
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    buffer = cupy.empty_like(q)
    q1 = rng.standard_normal((1, 1, 32, 128), dtype=cupy.float32).astype(cupy.float16)
    cache = rng.standard_normal((1, 512, 4, 128), dtype=cupy.float32).astype(cupy.float16)
    k_cache, v_cache = cache, cache.copy()
    new = cache[:, :1].copy()
    lengths = cupy.full((1,), 500, dtype=cupy.int32)
    sync = cupy.cuda.runtime.deviceSynchronize
    _raise_clocks(cupy)
    calls_of = {
        "cuflash2.attention(q, k, v)": lambda: cuflash2.attention(q, k, v),
        "cuflash2.attention(q, k, v, out=)": lambda: cuflash2.attention(q, k, v, out=buffer),
        "cuflash2.attention(q, k, v, return_lse=True)":
            lambda: cuflash2.attention(q, k, v, return_lse=True),
        "cuflash2.attention_backward (all its launches)":
            lambda: cuflash2.attention_backward(dout, q, k, v, out, lse),
        "cuflash2.attention_with_kvcache (k=, v=, cache_seqlens=)":
            lambda: cuflash2.attention_with_kvcache(q1, k_cache, v_cache, k=new, v=new,
                                                    cache_seqlens=lengths),
    }
    rows = [{"call": label, "us": _per_call_us(cupy, fn, calls, sync)}
            for label, fn in calls_of.items()]
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = torch.nn.functional.scaled_dot_product_attention
        wrap = TorchSdpaFlash(torch, cupy, "fp16")
        qt, kt, vt, dt = (wrap.as_bhsd(x) for x in (q, k, v, dout))
        for label, backend in (("torch SDPA, flash backend", SDPBackend.FLASH_ATTENTION),
                               ("torch SDPA, cuDNN backend", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    us = _per_call_us(cupy, lambda: sdpa(qt, kt, vt), calls, torch.cuda.synchronize)
                rows.append({"call": label, "us": us})
            except RuntimeError as exc:  # backend unavailable on this GPU or build
                rows.append({"call": label, "us": None, "error": str(exc).splitlines()[0]})
        backward = wrap.backward(q, k, v, dout, causal=False)
        rows.append({"call": "torch SDPA flash backward (autograd.grad, retained graph)",
                     "us": _per_call_us(cupy, backward, calls, torch.cuda.synchronize)})
    return rows


def _alone_ms(sync, new_event, elapsed_ms, fn, iters: int) -> float:
    """Median milliseconds of fn() timed alone: the GPU idle before it, events around it."""
    times = []
    for i in range(iters + 3):
        sync()
        start, end = new_event(), new_event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:  # warm-up
            times.append(elapsed_ms(start, end))
    return statistics.median(times)


def call_by_call_rows(cupy, torch, headdims=(64, 128), dtypes=("fp16", "bf16"),
                      seqlens=CALL_BY_CALL_SEQLENS, iters: int = 50,
                      progress=sys.stderr) -> list[dict]:
    """Paper-grid rows at short sequences, each call timed alone, cuflash2 and torch SDPA-flash
    (forward, and backward through autograd on a retained graph)."""
    import cuflash2
    from ..selfcheck import dtype_from_name

    def ours_ms(fn):
        return _alone_ms(cupy.cuda.runtime.deviceSynchronize, cupy.cuda.Event,
                         cupy.cuda.get_elapsed_time, fn, iters)

    def torch_ms(fn):
        return _alone_ms(torch.cuda.synchronize, lambda: torch.cuda.Event(enable_timing=True),
                         lambda start, end: start.elapsed_time(end), fn, iters)

    rows = []
    for config in paper_grid(headdims, dtypes, (False, True), seqlens, ("fwd", "bwd")):
        dtype = dtype_from_name(config.dtype)
        q, k, v = random_inputs(cupy, config, dtype, seed=config.seqlen)
        dout = random_inputs(cupy, config, dtype, seed=config.seqlen + 1)[0]
        wrap = TorchSdpaFlash(torch, cupy, config.dtype) if torch is not None else None
        if config.direction == "fwd":
            ours = ours_ms(lambda: cuflash2.attention(q, k, v, causal=config.causal))
            theirs = None
            if wrap is not None:
                forward = wrap.forward(q, k, v, config.causal)

                def flash_forward():
                    with wrap.flash_only():
                        forward()

                theirs = torch_ms(flash_forward)
        else:
            out, lse = cuflash2.attention(q, k, v, causal=config.causal, return_lse=True)
            ours = ours_ms(lambda: cuflash2.attention_backward(dout, q, k, v, out, lse,
                                                              causal=config.causal))
            theirs = torch_ms(wrap.backward(q, k, v, dout, config.causal)) if wrap else None
        flops = attention_flops(config.batch, config.nheads, config.seqlen, config.seqlen,
                                config.headdim, config.causal, config.direction)
        row = {"config": config.describe(), "direction": config.direction, "ms": ours,
               "tflops": flops / ours / 1e9, "torch_ms": theirs,
               "ratio": theirs / ours if theirs else None}
        rows.append(row)
        print(f"  {row['config']}: {ours:.3f} ms"
              + (f", torch {theirs:.3f} ms ({row['ratio']:.3f}x)" if theirs else ""),
              file=progress)
    return rows


def host_table(rows: list[dict]) -> str:
    lines = ["| call | host cost per call (us) |", "|---|---|"]
    for row in rows:
        us = f"{row['us']:.1f}" if row.get("us") is not None else f"– ({row.get('error', '')})"
        lines.append(f"| {row['call']} | {us} |")
    return "\n".join(lines)


def call_by_call_table(rows: list[dict]) -> str:
    lines = ["| configuration | cuflash2 ms | TFLOP/s | SDPA-flash ms | cuflash2 / SDPA-flash |",
             "|---|---|---|---|---|"]
    for row in rows:
        torch_ms = f"{row['torch_ms']:.3f}" if row["torch_ms"] else "–"
        ratio = f"{row['ratio']:.3f}x" if row["ratio"] else "–"
        lines.append(f"| {row['config']} | {row['ms']:.3f} | {row['tflops']:.0f} | {torch_ms} | "
                     f"{ratio} |")
    ratios = {}
    for row in rows:
        if row["ratio"]:
            ratios.setdefault(row["direction"], []).append(row["ratio"])
    for direction, values in ratios.items():
        lines.append(f"\n{direction}: geometric mean {statistics.geometric_mean(values):.3f}x, "
                     f"min {min(values):.3f}x SDPA-flash ({len(values)} rows)")
    return "\n".join(lines)


def run(cupy, args) -> int:
    """`bench --host`: print both tables (markdown on stdout), save --json."""
    import json

    from .. import _environment

    torch = load_torch() if args.compare == "torch" else None
    env = _environment.collect()
    host = host_rows(cupy, torch)
    calls = call_by_call_rows(cupy, torch, args.headdim or DEFAULT_HEADDIMS, args.dtype,
                              CALL_BY_CALL_SEQLENS, args.iters)
    print(f"\n{environment_header(env)}\n")
    print(f"Host cost: wall time per call over {HOST_CALLS} back-to-back calls (best of 3 runs, "
          f"after a clock warm-up) on inputs small enough that the GPU keeps up: "
          f"{HOST_SHAPE} fp16 (the decode row: 1 query token, 32/4 heads, d=128, a 512-token "
          f"cache, split over the keys); "
          f"kernels launched through {_launch_method()}.\n")
    print(host_table(host))
    print(f"\nCall by call: each call alone (GPU idle before it), CUDA events around it, median of "
          f"{args.iters}; the time includes the call's host cost. Paper grid (16k tokens, "
          f"hidden 2048).\n")
    print(call_by_call_table(calls))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": env, "host": host, "call_by_call": calls}, handle,
                      indent=2)
    return 0


def _launch_method() -> str:
    from .._launch import METHOD, graphs_available

    method = {"libcuda": "the driver's cuLaunchKernel (ctypes)",
              "bindings": "cuda.bindings.driver", "cupy": "CuPy"}[METHOD]
    if graphs_available():
        return f"a call's kernels replayed as one CUDA graph (captured streams: {method})"
    return method
