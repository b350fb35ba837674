"""The FP8 (e4m3) attention forward against cuDNN (issue 45): on the same arrays, cuflash2's
FP8 forward (attention(..., qkv_dtype="e4m3") with descales), cuflash2's bf16 forward on the
dequantised values, torch SDPA's cuDNN backend on those bf16 arrays, and cuDNN's own FP8 SDPA
(the cudnn frontend's `sdpa_fp8` graph, where the Python package `cudnn` (nvidia-cudnn-frontend)
is importable; torch SDPA takes no float8 inputs, which the script checks once and reports).
Each peer is built and timed on its own: one that fails prints why and leaves "-" in its cells,
the others still run.

The grid is the paper grid of `python -m cuflash2 bench` (cuflash2/bench/paper_grid.py): 16k
tokens a batch (batch = tokens // seqlen), hidden 2048 (heads = 2048 // d), seqlens 512..16k,
causal and not; d=128 by default, 64 and 256 with --headdims. Inputs: fresh standard normals
per tensor, quantised to e4m3 with a power-of-two descale per tensor (amax / 448 rounded up to a
power of two, as cuDNN recommends; --descale head: one per (batch, KV head) for cuflash2, which
cuDNN's FP8 SDPA does not take, so it sits those rows out), so that the bf16 arrays hold the
dequantised values exactly. Timing (cuflash2.bench.timing): CUDA events around each call behind
a spinning kernel, the median of --iters calls, the median of --rounds rounds whose contenders'
order turns. TFLOP/s as the repo's bench counts them: 4 * batch * heads * seqlen^2 * d, halved
when causal.

cuDNN's FP8 SDPA on Hopper writes its output in e4m3 (a bf16 output is Blackwell's; the script
asks for bf16 first and says which it got): it writes half of cuflash2's output bytes, and its
P is scaled by 256 before its e4m3 rounding. The max errors (--check, on by default) are each
FP8 output's against the float32 reference on the dequantised values, for head 0 of batch entry
0 (a check that the kernels ran right, not a test).

Where no FP8 SDPA runs, the FP8 forward is compared with the issue's mark: 1,000 TFLOP/s at
d=128, seqlen 16k. (The device machines' Python has torch and cuDNN's libraries but not the
frontend's Python package: carry the nvidia-cudnn-frontend wheel to time cuDNN's FP8 SDPA.)

    python benchmarks/fp8_forward_vs_cudnn.py [--headdims 128 64 256] [--seqlens 512 ... 16384]
        [--causal both|on|off] [--tokens 16384] [--hidden 2048] [--descale tensor|head]
        [--out-dtype bf16|fp16] [--rounds 3] [--iters 10] [--no-check] [--no-torch]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy  # noqa: E402

from cuflash2.bench import paper_grid, timing  # noqa: E402  (neither imports CuPy)

#: The issue's mark for the FP8 forward: TFLOP/s at d=128, seqlen 16k.
MARK_TFLOPS = 1000.0
MARK_HEADDIM, MARK_SEQLEN = 128, 16384
OUT_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": numpy.float16}
#: cuDNN's FP8 SDPA scales P by this before rounding it to e4m3 (descale_s its inverse).
CUDNN_P_SCALE = 256.0
NAMES = ["cuflash2 e4m3", "cuflash2 bf16", "sdpa cudnn bf16", "cudnn fp8"]


def _reason(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _pow2_descale(cupy, amax):
    """The power of two at or above amax / 448 (float32): values * (1 / descale) fit e4m3's
    range, and e4m3 * descale is exact in bf16."""
    ratio = cupy.maximum(amax.astype(cupy.float32) / numpy.float32(448.0),
                         numpy.float32(2.0 ** -100))
    return cupy.exp2(cupy.ceil(cupy.log2(ratio))).astype(cupy.float32)


def make_inputs(cupy, config, descale_kind, seed):
    """(e4m3 bits q, k, v; their descales as the call takes them; the bf16 dequantised values)
    of one paper-grid row: fresh standard normals (never zeros: zeros flatter tensor cores)."""
    from cuflash2 import fp8

    rng = cupy.random.default_rng(seed)
    shape = (config.batch, config.seqlen, config.nheads, config.headdim)
    bits, descales, bf16 = [], {}, []
    for name in ("q", "k", "v"):
        x = rng.standard_normal(shape, dtype=cupy.float32)
        if descale_kind == "head":  # (batch, kv heads): here kv heads = heads
            d = _pow2_descale(cupy, cupy.abs(x).max(axis=(1, 3)))
            per_element = d[:, None, :, None]
        else:
            d = _pow2_descale(cupy, cupy.abs(x).max()).reshape(1)
            per_element = d
        b = fp8.quantize_e4m3(x, per_element)
        del x
        bits.append(b)
        descales[f"{name}_descale"] = d
        bf16.append(fp8.dequantize_e4m3(b, per_element).astype(ml_dtypes.bfloat16))
    return tuple(bits), descales, tuple(bf16)


# ---------------------------------------------------------------------------------------------
# The peers: each returns a zero-argument call, or raises (the caller prints why)


def cuflash2_e4m3_call(cuflash2, q, k, v, descales, causal, out_dtype):
    def call():
        return cuflash2.attention(q, k, v, qkv_dtype="e4m3", causal=causal, out_dtype=out_dtype,
                                  **descales)
    call()  # compile and check the arguments now (a failure: this peer's row cells are "-")
    return call


def cuflash2_bf16_call(cuflash2, q, k, v, causal):
    def call():
        return cuflash2.attention(q, k, v, causal=causal)
    call()
    return call


def sdpa_cudnn_bf16_call(torch, cupy, q, k, v, causal):
    """torch SDPA restricted to its cuDNN backend on (b, h, s, d) views of the bf16 arrays."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cuflash2.bench.torch_peers import torch_view

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (torch_view(torch, cupy, x, torch.bfloat16).transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, is_causal=causal)
    call()
    return call


def torch_fp8_sdpa_reason(torch, cupy, q, k, v, causal) -> str | None:
    """None if torch SDPA (any backend it picks) takes float8_e4m3fn inputs, else why not."""
    try:
        qt, kt, vt = (torch.from_dlpack(x).view(torch.float8_e4m3fn).transpose(1, 2)
                      for x in (q, k, v))
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        torch.cuda.synchronize()
    except Exception as exc:
        return _reason(exc)
    return None


class CudnnFp8:
    """cuDNN's FP8 SDPA forward through the cudnn frontend's Python graph API (`sdpa_fp8`):
    e4m3 q, k, v in (b, h, s, d) views of our (b, s, h, d) arrays, per-tensor descales, P scaled
    by CUDNN_P_SCALE, O in bf16 where cuDNN builds that (Blackwell) else in e4m3 with scale_o =
    1 / v_descale (|O| <= max |V|: within e4m3's range). Runs on CuPy's current stream; the
    variant pack holds CuPy arrays (DLPack), the e4m3 ones as uint8."""

    def __init__(self, cudnn, cupy, q, k, v, descales, causal):
        self.cudnn, self.cupy = cudnn, cupy
        batch, seqlen, heads, d = q.shape
        self.shape = (batch, heads, seqlen, d)
        strides = (seqlen * heads * d, d, heads * d, 1)  # (b, s, h, d) memory, in elements
        for name in ("q_descale", "k_descale", "v_descale"):
            if descales[name].size != 1:
                raise NotImplementedError("cuDNN's FP8 SDPA takes per-tensor descales (run with "
                                          "--descale tensor)")
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=cupy.cuda.get_current_stream().ptr)
        f32 = numpy.float32
        scalars = {
            "descale_q": descales["q_descale"].reshape(1, 1, 1, 1),
            "descale_k": descales["k_descale"].reshape(1, 1, 1, 1),
            "descale_v": descales["v_descale"].reshape(1, 1, 1, 1),
            "descale_s": cupy.full((1, 1, 1, 1), 1.0 / CUDNN_P_SCALE, f32),
            "scale_s": cupy.full((1, 1, 1, 1), CUDNN_P_SCALE, f32),
            "scale_o": (1.0 / descales["v_descale"]).astype(f32).reshape(1, 1, 1, 1),
        }
        errors = []
        for out_type in ("BFLOAT16", "FP8_E4M3"):
            try:
                self._build(out_type, strides, causal, 1.0 / math.sqrt(d))
                break
            except Exception as exc:
                errors.append(f"O {out_type}: {_reason(exc)}")
        else:
            raise RuntimeError("; ".join(errors))
        self.output_dtype = out_type
        self.notes = errors  # why a bf16 output was not built, if it was not
        if out_type == "BFLOAT16":
            self.out = cupy.empty((batch, seqlen, heads, d), ml_dtypes.bfloat16)
            self.out_scale = 1.0
        else:
            self.out = cupy.empty((batch, seqlen, heads, d), cupy.uint8)
            self.out_scale = scalars["scale_o"]
        self.amax = {n: cupy.empty((1, 1, 1, 1), f32) for n in ("amax_s", "amax_o")}
        self.workspace = cupy.empty(max(1, self.graph.get_workspace_size()), cupy.uint8)
        self.pack = {self.tensors["q"]: q, self.tensors["k"]: k, self.tensors["v"]: v,
                     self.tensors["o"]: self.out,
                     **{self.tensors[n]: x for n, x in scalars.items()},
                     **{self.tensors[n]: x for n, x in self.amax.items()}}
        self.call()
        cupy.cuda.get_current_stream().synchronize()

    def _build(self, out_type, strides, causal, attn_scale):
        cudnn = self.cudnn
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32,
                              compute_data_type=f32, handle=self.handle)
        t = {n: graph.tensor(name=n, dim=self.shape, stride=strides, data_type=e4m3)
             for n in ("q", "k", "v")}
        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[n] = graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
        args = dict(q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"],
                    descale_k=t["descale_k"], descale_v=t["descale_v"],
                    descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"],
                    attn_scale=attn_scale, use_causal_mask=causal, name="sdpa_fp8")
        try:  # the frontend's newer keyword, then its older one
            o, _, amax_s, amax_o = graph.sdpa_fp8(generate_stats=False, **args)
        except TypeError:
            o, _, amax_s, amax_o = graph.sdpa_fp8(is_inference=True, **args)
        o.set_output(True).set_dim(self.shape).set_stride(strides).set_data_type(
            getattr(cudnn.data_type, out_type))
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(
                f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.tensors = dict(t, o=o, amax_s=amax_s, amax_o=amax_o)

    def call(self):
        self.graph.execute(self.pack, self.workspace, handle=self.handle)
        return self.out

    def values(self):
        """The output's values (float32)."""
        from cuflash2 import fp8

        if self.output_dtype == "BFLOAT16":
            return self.out.astype(numpy.float32)
        return fp8.e4m3_to_float(self.out) / self.out_scale.reshape(())

    def close(self):
        self.cudnn.destroy_handle(self.handle)


def load_cudnn_frontend():
    """(the cudnn frontend module, None) or (None, why not)."""
    try:
        import cudnn
    except Exception as exc:
        return None, (f"the cudnn frontend's Python package is not importable ({_reason(exc)}): "
                      f"pip install nvidia-cudnn-frontend (on the device machines, carry its "
                      f"wheel)")
    if not hasattr(cudnn.pygraph, "sdpa_fp8"):
        return None, f"cudnn {getattr(cudnn, '__version__', '?')} has no pygraph.sdpa_fp8"
    return cudnn, None


# ---------------------------------------------------------------------------------------------


def max_error_of_one_head(cupy, cuflash2, bits, descales, values, causal):
    """Max |out - ref| of head 0 of batch entry 0 against the float32 reference on the
    dequantised values (`values`: float32 of that head's output, (seqlen, d))."""
    one = (slice(0, 1), slice(None), slice(0, 1))
    sliced = {n: (d if d.size == 1 else d[:1, :1]) for n, d in descales.items()}
    ref = cuflash2.reference.attention(*(b[one] for b in bits), qkv_dtype="e4m3", causal=causal,
                                       compute_dtype=numpy.float32, **sliced)
    return float(cupy.abs(values - ref[0, :, 0]).max())


def check_errors(cupy, cuflash2, bits, descales, causal, ours, cudnn_fp8) -> str:
    """The max-error cell: cuflash2's e4m3 output's, then cuDNN's FP8 one's and its output
    dtype in brackets where it ran."""
    def error(values):
        return max_error_of_one_head(cupy, cuflash2, bits, descales, values, causal)

    text = f"{error(ours[0, :, 0].astype(numpy.float32)):.1e}"
    if cudnn_fp8 is not None:
        text += (f" ({error(cudnn_fp8.values()[0, :, 0]):.1e}, "
                 f"O {cudnn_fp8.output_dtype.lower()})")
    return text


def _cell(ms, flops):
    if ms is None or not math.isfinite(ms):
        return "-"
    return f"{ms:.3f} ({flops / ms / 1e9:.0f})"


def _ratio(med, a, b):
    if not (math.isfinite(med.get(a, math.nan)) and math.isfinite(med.get(b, math.nan))):
        return "-"
    return f"{med[b] / med[a]:.2f}"


def measure_row(env, config, seed):
    """One row: the peers built (each failure noted and printed), timed, checked and printed;
    returns the row's record, or None where its inputs could not be made."""
    cupy, args = env.cupy, env.args
    where = f"d={config.headdim} s={config.seqlen} causal={config.causal}"
    try:
        bits, descales, bf16 = make_inputs(cupy, config, args.descale, seed)
    except Exception as exc:  # out of memory, say: the row is skipped
        print(f"# {where}: inputs: {_reason(exc)}", file=sys.stderr)
        return None
    calls, cudnn_fp8 = {}, None

    def peer(name, build):
        try:
            calls[name] = build()
        except Exception as exc:
            env.notes.setdefault(name, set()).add(_reason(exc))
            print(f"# {name} {where}: {_reason(exc)}", file=sys.stderr)

    peer("cuflash2 e4m3", lambda: cuflash2_e4m3_call(env.cuflash2, *bits, descales,
                                                     config.causal, env.out_dtype))
    peer("cuflash2 bf16", lambda: cuflash2_bf16_call(env.cuflash2, *bf16, config.causal))
    if env.torch is not None:
        peer("sdpa cudnn bf16", lambda: sdpa_cudnn_bf16_call(env.torch, cupy, *bf16,
                                                             config.causal))
        if env.torch_fp8 == "not checked":
            env.torch_fp8 = torch_fp8_sdpa_reason(env.torch, cupy, *bits, config.causal)
    if env.cudnn is not None:
        def build_cudnn():
            nonlocal cudnn_fp8
            cudnn_fp8 = CudnnFp8(env.cudnn, cupy, *bits, descales, config.causal)
            for note in cudnn_fp8.notes:
                env.notes.setdefault("cudnn fp8", set()).add(note)
            return cudnn_fp8.call
        peer("cudnn fp8", build_cudnn)
    med = {}
    if calls:
        med = timing.median_of_rounds(
            cupy, env.torch, calls, args.rounds, 2, args.iters, env.backlog,
            on_error=lambda name, exc: print(f"# {name} {where}: {_reason(exc)}",
                                             file=sys.stderr))
    flops = config.flops
    errors = "-"
    if not args.no_check and "cuflash2 e4m3" in calls:
        try:
            errors = check_errors(cupy, env.cuflash2, bits, descales, config.causal,
                                  calls["cuflash2 e4m3"](), cudnn_fp8)
        except Exception as exc:
            errors = "?"
            print(f"# max error {where}: {_reason(exc)}", file=sys.stderr)
    ours_ms = med.get("cuflash2 e4m3", math.nan)
    of_mark = (f"{flops / ours_ms / 1e9 / MARK_TFLOPS:.0%}" if math.isfinite(ours_ms)
               else "-")
    print(f"| {config.headdim} | {config.causal} | {config.seqlen} | "
          f"{config.batch}×{config.nheads} | "
          + " | ".join(_cell(med.get(n), flops) for n in NAMES)
          + f" | {_ratio(med, 'cuflash2 e4m3', 'cudnn fp8')} | "
          f"{_ratio(med, 'cuflash2 e4m3', 'sdpa cudnn bf16')} | "
          f"{_ratio(med, 'cuflash2 e4m3', 'cuflash2 bf16')} | {of_mark} | {errors} |",
          flush=True)
    output = cudnn_fp8.output_dtype if cudnn_fp8 is not None else None
    if cudnn_fp8 is not None:
        cudnn_fp8.close()
    return {"headdim": config.headdim, "causal": config.causal, "seqlen": config.seqlen,
            "batch": config.batch, "nheads": config.nheads, "flops": flops,
            "ms": {n: (v if math.isfinite(v) else None) for n, v in med.items()},
            "cudnn_fp8_output": output, "max_error": errors}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headdims", type=int, nargs="+", default=[128], choices=[64, 128, 256],
                        help="head dims (default 128; 64 and 256 optional)")
    parser.add_argument("--seqlens", type=int, nargs="+",
                        default=list(paper_grid.PAPER_SEQLENS))
    parser.add_argument("--causal", choices=["off", "on", "both"], default="both")
    parser.add_argument("--tokens", type=int, default=paper_grid.PAPER_TOKENS,
                        help="batch x seqlen")
    parser.add_argument("--hidden", type=int, default=paper_grid.PAPER_HIDDEN,
                        help="heads x head dim")
    parser.add_argument("--descale", choices=["tensor", "head"], default="tensor",
                        help="one descale a tensor (default; cuDNN's FP8 SDPA takes no other) "
                             "or one per (batch, KV head) for cuflash2")
    parser.add_argument("--out-dtype", choices=list(OUT_DTYPES), default="bf16",
                        help="cuflash2's FP8 output dtype")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-check", action="store_true",
                        help="skip the max errors against the float32 reference")
    parser.add_argument("--no-torch", action="store_true", help="leave torch SDPA out")
    parser.add_argument("--json", help="also write the rows here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import cupy

    import cuflash2
    from cuflash2.bench.torch_peers import cudnn_version, load_torch

    torch = None if args.no_torch else load_torch()
    cudnn, cudnn_missing = load_cudnn_frontend()
    backlog = timing.Backlog(cupy)
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    frontend = "no cudnn frontend"
    if cudnn is not None:
        frontend = (f"cudnn frontend {getattr(cudnn, '__version__', '?')} (backend "
                    f"{cudnn.backend_version_string()})")
    print(f"# FP8 (e4m3) attention forward, {device}, {args.tokens} tokens a batch, hidden "
          f"{args.hidden}, descales per {args.descale}, cuflash2 out {args.out_dtype}; torch "
          f"{torch.__version__ if torch else '-'} (cuDNN {cudnn_version(torch) if torch else '-'}"
          f"), {frontend}; ms (TFLOP/s)")
    print("| d | causal | seqlen | batch×heads | " + " | ".join(NAMES)
          + " | e4m3 / cuDNN fp8 | e4m3 / cuDNN bf16 | e4m3 / cuflash2 bf16 | of mark | "
          "max err e4m3 (cuDNN fp8) |")
    print("|---" * (len(NAMES) + 9) + "|")
    configs = paper_grid.paper_grid(headdims=tuple(args.headdims), dtypes=("bf16",),
                                    causal_modes=paper_grid.causal_modes(args.causal),
                                    seqlens=tuple(args.seqlens), tokens=args.tokens,
                                    hidden=args.hidden)
    env = types.SimpleNamespace(cupy=cupy, cuflash2=cuflash2, torch=torch, cudnn=cudnn,
                                backlog=backlog, args=args, out_dtype=OUT_DTYPES[args.out_dtype],
                                notes={}, torch_fp8="not checked")
    rows = []
    for i, config in enumerate(configs):
        row = measure_row(env, config, seed=i)
        if row is not None:
            rows.append(row)
        cupy.get_default_memory_pool().free_all_blocks()
    notes, torch_fp8 = env.notes, env.torch_fp8

    print()
    print(f"Ratios: the FP8 forward's throughput over the peer's (>1: cuflash2 e4m3 faster). "
          f"Mark: {MARK_TFLOPS:,.0f} TFLOP/s at d={MARK_HEADDIM}, seqlen {MARK_SEQLEN}.")
    print(f"torch SDPA with float8_e4m3fn inputs: "
          f"{torch_fp8 or 'ran (not timed: it takes no descales)'}")
    if not any(r["ms"].get("cudnn fp8") for r in rows):
        why = cudnn_missing or "; ".join(sorted(notes.get("cudnn fp8", ()))) or "no row ran it"
        print(f"cuDNN's FP8 SDPA did not run ({why}): the comparison is with the issue's mark.")
    marked = [r for r in rows if r["headdim"] == MARK_HEADDIM and r["seqlen"] == MARK_SEQLEN
              and r["ms"].get("cuflash2 e4m3")]
    for r in marked:
        tflops = r["flops"] / r["ms"]["cuflash2 e4m3"] / 1e9
        print(f"- d={MARK_HEADDIM}, {MARK_SEQLEN}, causal {r['causal']}: {tflops:.0f} TFLOP/s, "
              f"{tflops / MARK_TFLOPS:.0%} of the mark")
    if not marked:
        print(f"(no timed d={MARK_HEADDIM}, seqlen {MARK_SEQLEN} row of cuflash2 e4m3 in this run)")
    for name, reasons in notes.items():
        for reason in sorted(reasons):
            print(f"note: {name}: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "args": vars(args),
                                               "torch_fp8_sdpa": torch_fp8, "rows": rows},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
