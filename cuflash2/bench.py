"""`python -m cuflash2 bench`: TFLOP/s on the FlashAttention-2 paper's grid (docs/DESIGN.md §6).

The grid keeps 16k tokens per batch (batch = tokens // seqlen) and a hidden size of 2048
(nheads = hidden // headdim), so every configuration's inputs are far larger than the 60 MB L2 of
an H200; by default d = 64 and 128 at every seqlen and d = 256 from 4k. Timing: CUDA events
around each call after warm-up, median of `iters` calls. With `--compare torch` the same CuPy
arrays are handed to PyTorch through DLPack (no copy) and run through SDPA restricted to its
FlashAttention-2 backend, then to its cuDNN backend, each timed the same way with torch's events
(a configuration cuDNN refuses shows "n/a" and the reason).

The pure functions (grid, FLOP counts, summary, table) need no GPU and are unit-tested on the CPU;
the importable pieces are meant for the scripts in benchmarks/ too.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import asdict, dataclass, field

PAPER_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
PAPER_TOKENS = 16384
PAPER_HIDDEN = 2048
BACKWARD_FLOP_FACTOR = 2.5  # backward = 2 matmuls recomputed + 3 gradient matmuls, over forward's 2
#: Head dims of the default grid at every seqlen (also the default of --windows/--varlen/--host).
DEFAULT_HEADDIMS = (64, 128)
#: Head dims the default grid adds only from a seqlen on: d=256 (batch×heads = (16k/s)×8) at
#: s >= 4k, where its FLOPs per row equal d=128's and its tiles stay full.
DEFAULT_EXTRA_HEADDIMS = {256: 4096}


@dataclass(frozen=True)
class Config:
    direction: str  # "fwd" or "bwd"
    dtype: str  # "fp16" or "bf16"
    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int

    @property
    def flops(self) -> float:
        return attention_flops(
            self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, self.causal,
            self.direction,
        )

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"{self.direction} {self.dtype} d={self.headdim} s={self.seqlen} {mask} "
                f"(b={self.batch} h={self.nheads})")


@dataclass
class Row:
    config: Config
    ms: float | None = None
    tflops: float | None = None
    torch_ms: float | None = None
    torch_tflops: float | None = None
    max_abs_diff: float | None = None  # cuflash2 vs torch output, a same-data sanity check
    errors: list[str] = field(default_factory=list)
    # torch SDPA's cuDNN backend on the same arrays; cudnn_error says why it has no time (n/a).
    cudnn_ms: float | None = None
    cudnn_tflops: float | None = None
    cudnn_max_abs_diff: float | None = None  # cuflash2 vs cuDNN output (forward)
    cudnn_error: str | None = None

    @property
    def ratio(self) -> float | None:
        """cuflash2 / SDPA-flash throughput."""
        if self.tflops and self.torch_tflops:
            return self.tflops / self.torch_tflops
        return None

    @property
    def ratio_vs_cudnn(self) -> float | None:
        """cuflash2 / cuDNN throughput."""
        if self.tflops and self.cudnn_tflops:
            return self.tflops / self.cudnn_tflops
        return None

    def to_json(self) -> dict:
        data = asdict(self.config)
        data.update({k: v for k, v in asdict(self).items() if k != "config"})
        data["flops"] = self.config.flops
        data["ratio"] = self.ratio
        data["ratio_vs_cudnn"] = self.ratio_vs_cudnn
        return data


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, direction="fwd") -> float:
    """FLOPs the FA2 paper counts: 2 matmuls of 2*sq*sk*d each; causal halves it (square case)."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        flops /= 2
    if direction == "bwd":
        flops *= BACKWARD_FLOP_FACTOR
    return flops


def paper_grid(headdims=(64, 128), dtypes=("fp16", "bf16"), causal_modes=(False, True),
               seqlens=PAPER_SEQLENS, directions=("fwd",), tokens=PAPER_TOKENS,
               hidden=PAPER_HIDDEN, min_seqlen=None) -> list[Config]:
    """`min_seqlen`: {headdim: seqlen} to keep a head dim only at seqlens from that one on."""
    min_seqlen = min_seqlen or {}
    return [
        Config(direction, dtype, headdim, causal, seqlen,
               batch=max(1, tokens // seqlen), nheads=max(1, hidden // headdim))
        for direction in directions
        for dtype in dtypes
        for headdim in headdims
        for causal in causal_modes
        for seqlen in seqlens
        if seqlen >= min_seqlen.get(headdim, 0)
    ]


def grid_headdims(headdim_option) -> tuple[tuple[int, ...], dict]:
    """The main grid's head dims and their {headdim: min seqlen}: the --headdim given, at every
    seqlen; by default DEFAULT_HEADDIMS plus DEFAULT_EXTRA_HEADDIMS from their seqlens."""
    if headdim_option:
        return tuple(headdim_option), {}
    return DEFAULT_HEADDIMS + tuple(DEFAULT_EXTRA_HEADDIMS), dict(DEFAULT_EXTRA_HEADDIMS)


def causal_modes(choice: str) -> tuple[bool, ...]:
    return {"off": (False,), "on": (True,), "both": (False, True)}[choice]


def directions(choice: str) -> tuple[str, ...]:
    return {"fwd": ("fwd",), "bwd": ("bwd",), "both": ("fwd", "bwd")}[choice]


# ---------------------------------------------------------------------------------------------
# Summary and output
# ---------------------------------------------------------------------------------------------

#: The torch baselines of the summary: (label, Row property, prefix of its summary keys).
BASELINES = (("SDPA-flash", "ratio", ""), ("cuDNN", "ratio_vs_cudnn", "cudnn_"))


def _ratio_stats(pairs) -> dict:
    worst_ratio, worst_config = min(pairs, key=lambda pair: pair[0])
    return {
        "configs": len(pairs),
        "geomean_ratio": math.exp(statistics.fmean(math.log(r) for r, _ in pairs)),
        "min_ratio": worst_ratio,
        "min_config": worst_config.describe(),
    }


def summarize(rows: list[Row]) -> dict:
    """Per direction: geometric mean and minimum of the cuflash2/SDPA-flash ratios (keys
    configs, geomean_ratio, min_ratio, min_config) and of the cuflash2/cuDNN ratios (the same
    keys prefixed cudnn_), each over the rows that have that ratio."""
    summary = {}
    for direction in sorted({row.config.direction for row in rows}):
        entry = {}
        for _, attribute, prefix in BASELINES:
            pairs = [(getattr(row, attribute), row.config) for row in rows
                     if row.config.direction == direction and getattr(row, attribute)]
            if pairs:
                entry.update({prefix + key: value for key, value in _ratio_stats(pairs).items()})
        if entry:
            summary[direction] = entry
    return summary


def _fmt(value, spec: str, missing: str = "–") -> str:
    return missing if value is None else format(value, spec)


def markdown_table(rows: list[Row], compare: bool) -> str:
    """One line per row; with `compare`, SDPA-flash's and cuDNN's TFLOP/s, cuflash2's ratio to
    each and the max abs difference of the forward outputs (cuflash2 vs each); "n/a" where
    cuDNN refused the configuration (cudnn_notes gives the reasons)."""
    header = ["dir", "dtype", "d", "causal", "seqlen", "batch×heads", "cuflash2 ms",
              "cuflash2 TFLOP/s"]
    if compare:
        header += ["SDPA-flash TFLOP/s", "cuDNN TFLOP/s", "cuflash2 / SDPA-flash",
                   "cuflash2 / cuDNN", "max abs diff (SDPA-flash)", "max abs diff (cuDNN)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        c = row.config
        cells = [c.direction, c.dtype, str(c.headdim), "yes" if c.causal else "no", str(c.seqlen),
                 f"{c.batch}×{c.nheads}", _fmt(row.ms, ".3f"), _fmt(row.tflops, ".1f")]
        if compare:
            cudnn_missing = "n/a" if row.cudnn_error else "–"
            cells += [_fmt(row.torch_tflops, ".1f"), _fmt(row.cudnn_tflops, ".1f", cudnn_missing),
                      _fmt(row.ratio, ".3f"), _fmt(row.ratio_vs_cudnn, ".3f", cudnn_missing),
                      _fmt(row.max_abs_diff, ".1e"),
                      _fmt(row.cudnn_max_abs_diff, ".1e", cudnn_missing)]
        if row.errors:
            cells[-1] += " (" + "; ".join(row.errors) + ")"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cudnn_notes(rows: list[Row]) -> list[str]:
    """One note line per distinct reason cuDNN refused, with the rows it refused for it."""
    by_reason = {}
    for row in rows:
        if row.cudnn_error:
            by_reason.setdefault(row.cudnn_error, []).append(row.config.describe())
    return [f"note: cuDNN n/a for {len(configs)} row(s) ({'; '.join(configs)}): {reason}"
            for reason, configs in by_reason.items()]


def summary_table(summary: dict) -> str:
    """Geometric mean and minimum of cuflash2's ratio to each torch baseline, per direction."""
    lines = ["| dir | vs | configs | geomean cuflash2 / vs | min ratio | at |",
             "|---|---|---|---|---|---|"]
    for direction, s in summary.items():
        for label, _, prefix in BASELINES:
            if prefix + "configs" in s:
                lines.append(f"| {direction} | {label} | {s[prefix + 'configs']} | "
                             f"{s[prefix + 'geomean_ratio']:.3f} | {s[prefix + 'min_ratio']:.3f} | "
                             f"{s[prefix + 'min_config']} |")
    return "\n".join(lines)


def environment_header(env: dict) -> str:
    gpu = env.get("gpu") or {}
    return (f"cuflash2 {env['cuflash2']} on {gpu.get('name', 'unknown GPU')} "
            f"(sm_{gpu.get('compute_capability', '?').replace('.', '')}), CuPy {env['cupy']}, "
            f"CUDA runtime {env['cuda_runtime']}, driver {env['cuda_driver']}, NVRTC {env['nvrtc']}, "
            f"torch {env['torch'] or '–'}, {env['date']}")


# ---------------------------------------------------------------------------------------------
# Timing (GPU)
# ---------------------------------------------------------------------------------------------

def spin_kernel(cupy):
    """cuda_src/gpu_spin.cu's kernel: spin((1,), (1,), (cupy.uint64(nanoseconds),))."""
    from . import _compile

    return cupy.RawModule(code=_compile.kernel_source("gpu_spin.cu")).get_function(
        "gpu_spin_kernel")


def l2_flush(cupy):
    """A call that evicts the L2 cache by reading a buffer much larger than it (untimed, before
    each timed decode call): the smaller caches (from 32 MB) fit in the 50 MB L2, and a decode
    step after the other layers' steps reads its cache from HBM. Reading, not writing: evicting
    dirty lines would charge the timed call ~10 us of write-back that is not its own."""
    return cupy.zeros(L2_FLUSH_BYTES, dtype=cupy.uint8).max


class Backlog:
    """A spinning kernel queued before the timed calls, long enough to cover the host-side cost
    of launching all of them (up to HOST_US_PER_CALL each): the calls then queue while the GPU
    is busy, and the events around each one measure its GPU time, not the host's. Decode calls
    take only microseconds of GPU time, so without it they would time the Python layer."""

    HOST_US_PER_CALL = 400

    def __init__(self, cupy):
        self._spin = spin_kernel(cupy)
        self._cupy = cupy

    def queue(self, calls: int = 1):
        nanoseconds = self._cupy.uint64(calls * self.HOST_US_PER_CALL * 1000)
        self._spin((1,), (1,), (nanoseconds,))


def time_cupy(cupy, fn, warmup: int, iters: int, backlog: Backlog, before=None) -> float:
    """Median milliseconds of fn() on the current CuPy stream; `before()`, if given, runs
    before each call, untimed (and in the warm-up, so that its own first-call costs are paid
    there)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    backlog.queue(iters)
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events)


def time_torch(torch, fn, warmup: int, iters: int, backlog: Backlog) -> float:
    """Median milliseconds of fn() on torch's current stream, with torch's CUDA events."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    torch.cuda.synchronize()
    backlog.queue(iters)  # CuPy and torch both default to the legacy default stream
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


# ---------------------------------------------------------------------------------------------
# The two implementations on the same data
# ---------------------------------------------------------------------------------------------

def paper_grid_arrays(cupy, headdims=(64, 128), seqlens=(1024, 4096, 16384), count=4):
    """For each (headdim, seqlen): `count` fresh fp16 standard-normal (batch, seqlen, nheads,
    headdim) arrays at the paper grid's size (PAPER_TOKENS tokens, hidden PAPER_HIDDEN), for the
    cost scripts in benchmarks/. Yields (headdim, seqlen, arrays)."""
    for d in headdims:
        for s in seqlens:
            shape = (PAPER_TOKENS // s, s, PAPER_HIDDEN // d, d)
            rng = cupy.random.default_rng(s + d)
            yield d, s, tuple(rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                              for _ in range(count))


def random_inputs(cupy, config: Config, dtype, seed: int):
    """Fresh standard-normal q, k, v (never zeros: zeros flatter tensor cores)."""
    rng = cupy.random.default_rng(seed)
    shape = (config.batch, config.seqlen, config.nheads, config.headdim)
    return tuple(rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for _ in range(3))


def _torch_view(torch, cupy, array, torch_dtype):
    # Through int16 so the exchange does not depend on DLPack's bfloat16 support on either side.
    return torch.from_dlpack(array.view(cupy.int16)).view(torch_dtype)


class TorchSdpa:
    """torch SDPA restricted to one backend (`BACKEND`, a member of torch's SDPBackend), on
    (b, h, s, d) views of our arrays. `only()` is the context that restricts it: the timed calls
    run inside it; the backward's forward is run inside it here (autograd then calls that
    backend's backward)."""

    BACKEND = ""
    LABEL = ""

    def __init__(self, torch, cupy, dtype_name: str):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch, self.cupy = torch, cupy
        self.torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        backend = getattr(SDPBackend, self.BACKEND)
        self.only = lambda: sdpa_kernel(backend)

    def as_bhsd(self, array):
        return _torch_view(self.torch, self.cupy, array, self.torch_dtype).transpose(1, 2)

    def forward(self, q, k, v, causal):
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = (self.as_bhsd(x) for x in (q, k, v))
        return lambda: sdpa(qt, kt, vt, is_causal=causal)

    def attend_all(self, q, k, v):
        """SDPA under this backend on torch tensors in (b, h, s, d), every key seen by every
        query (a decoding step's one token against its whole cache), GQA where the heads
        differ."""
        with self.only():
            return self.torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    def backward(self, q, k, v, dout, causal):
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = (self.as_bhsd(x).detach().requires_grad_() for x in (q, k, v))
        dout_t = self.as_bhsd(dout)
        with self.only():
            out = sdpa(qt, kt, vt, is_causal=causal)
        return lambda: self.torch.autograd.grad(out, (qt, kt, vt), dout_t, retain_graph=True)


class TorchSdpaFlash(TorchSdpa):
    """torch SDPA restricted to its FlashAttention-2 backend."""

    BACKEND = "FLASH_ATTENTION"
    LABEL = "SDPA-flash"

    @property
    def flash_only(self):
        return self.only


class TorchSdpaCudnn(TorchSdpa):
    """torch SDPA restricted to its cuDNN backend (cuDNN's fused attention)."""

    BACKEND = "CUDNN_ATTENTION"
    LABEL = "cuDNN"


def _load_torch(stream=sys.stderr):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401  (torch >= 2.3)
    except Exception as exc:
        print(f"note: --compare torch skipped: PyTorch is not importable ({exc})", file=stream)
        return None
    if not torch.cuda.is_available():
        print("note: --compare torch skipped: torch sees no CUDA device", file=stream)
        return None
    return torch


def _torch_cudnn_version(torch):
    try:
        return torch.backends.cudnn.version()
    except Exception:
        return None


def _max_abs_diff(cupy, torch, ours, torch_out_bhsd) -> float:
    theirs_bshd = torch_out_bhsd.transpose(1, 2).contiguous().view(torch.int16)
    theirs = cupy.from_dlpack(theirs_bshd).view(ours.dtype)
    return float(cupy.abs(ours.astype(cupy.float32) - theirs.astype(cupy.float32)).max())


def measure(cupy, torch, configs: list[Config], warmup: int, iters: int, progress=sys.stderr):
    """Time every configuration; inputs are made once per (dtype, headdim, seqlen) and shared by
    the causal modes, the directions and torch. With torch, each row also times SDPA-flash (a
    failure there is the row's error) and then cuDNN (a refusal there is only cudnn_error)."""
    import cuflash2
    from cuflash2.selfcheck import dtype_from_name

    backlog = Backlog(cupy)
    has_backward = hasattr(cuflash2, "attention_backward")
    rows = {config: Row(config) for config in configs}
    groups = {}
    for config in configs:
        groups.setdefault((config.dtype, config.headdim, config.seqlen), []).append(config)

    for seed, ((dtype_name, _, _), group) in enumerate(groups.items()):
        dtype = dtype_from_name(dtype_name)
        q, k, v = random_inputs(cupy, group[0], dtype, seed)
        dout = None
        if has_backward and any(config.direction == "bwd" for config in group):
            dout = cupy.random.default_rng(seed + 10_000).standard_normal(
                q.shape, dtype=cupy.float32).astype(dtype)
        for config in group:
            row = rows[config]
            ours_out = None
            try:
                if config.direction == "fwd":
                    ours_out = _measure_forward(cupy, row, q, k, v, warmup, iters, backlog)
                elif has_backward:
                    _measure_backward(cupy, row, q, k, v, dout, warmup, iters, backlog)
                else:
                    row.errors.append("backward not available yet")
                if torch is not None and row.ms is not None:
                    flash = TorchSdpaFlash(torch, cupy, dtype_name)
                    row.torch_ms, row.max_abs_diff = _measure_torch(
                        cupy, torch, flash, config, q, k, v, dout, ours_out, warmup, iters,
                        backlog)
                    row.torch_tflops = config.flops / row.torch_ms / 1e9
            except Exception as exc:  # keep going; the row shows what failed
                row.errors.append(f"{exc.__class__.__name__}: {exc}")
            if torch is not None and row.ms is not None:
                _measure_cudnn(cupy, torch, row, q, k, v, dout, ours_out, warmup, iters, backlog)
            print(_progress_line(row), file=progress, flush=True)
            del ours_out
        del q, k, v, dout
        cupy.get_default_memory_pool().free_all_blocks()
    return [rows[config] for config in configs]


def _progress_line(row: Row) -> str:
    text = f"{row.config.describe():<40} cuflash2 {_fmt(row.tflops, '7.1f')} TFLOP/s"
    if row.torch_tflops is not None:
        text += f"  SDPA-flash {row.torch_tflops:7.1f}  ratio {_fmt(row.ratio, '.3f')}"
    if row.cudnn_tflops is not None:
        text += f"  cuDNN {row.cudnn_tflops:7.1f}  ratio {_fmt(row.ratio_vs_cudnn, '.3f')}"
    elif row.cudnn_error:
        text += "  cuDNN n/a"
    if row.errors:
        text += "  [" + "; ".join(row.errors) + "]"
    return text


def _measure_forward(cupy, row, q, k, v, warmup, iters, backlog):
    """cuflash2's forward time into `row`; returns its output (for the comparison with torch)."""
    import cuflash2

    causal = row.config.causal
    out = cupy.empty_like(q)
    row.ms = time_cupy(cupy, lambda: cuflash2.attention(q, k, v, causal=causal, out=out),
                       warmup, iters, backlog)
    row.tflops = row.config.flops / row.ms / 1e9
    return out


def _measure_backward(cupy, row, q, k, v, dout, warmup, iters, backlog):
    import cuflash2

    # Assumed signature, mirroring flash-attn's: attention_backward(dout, q, k, v, out, lse, ...).
    causal = row.config.causal
    out, lse = cuflash2.attention(q, k, v, causal=causal, return_lse=True)
    row.ms = time_cupy(
        cupy, lambda: cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal),
        warmup, iters, backlog)
    row.tflops = row.config.flops / row.ms / 1e9


def _measure_torch(cupy, torch, reference: TorchSdpa, config, q, k, v, dout, ours_out, warmup,
                   iters, backlog):
    """(ms, max abs diff) of torch SDPA under `reference`'s backend on the same arrays: the
    forward, or the backward through autograd on a retained graph (its forward run under the
    backend too). The diff compares the forward's output with `ours_out`; None for backward."""
    if config.direction == "fwd":
        run = reference.forward(q, k, v, config.causal)
    else:
        run = reference.backward(q, k, v, dout, config.causal)
    with reference.only():
        ms = time_torch(torch, run, warmup, iters, backlog)
        diff = _max_abs_diff(cupy, torch, ours_out, run()) if ours_out is not None else None
    return ms, diff


def _measure_cudnn(cupy, torch, row, q, k, v, dout, ours_out, warmup, iters, backlog):
    """SDPA's cuDNN backend into `row`, timed as SDPA-flash is. A configuration it refuses (or
    a torch without that backend) leaves the time empty and the reason in row.cudnn_error;
    the row is not failed for it."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            reference = TorchSdpaCudnn(torch, cupy, row.config.dtype)
            row.cudnn_ms, row.cudnn_max_abs_diff = _measure_torch(
                cupy, torch, reference, row.config, q, k, v, dout, ours_out, warmup, iters,
                backlog)
            row.cudnn_tflops = row.config.flops / row.cudnn_ms / 1e9
        except Exception as exc:
            row.cudnn_ms = row.cudnn_max_abs_diff = row.cudnn_tflops = None
            row.cudnn_error = refusal_reason(exc, [str(w.message) for w in caught])


def refusal_reason(exc: BaseException, warning_messages=()) -> str:
    """One line saying why torch's cuDNN backend refused. With every other backend disabled,
    torch warns "CuDNN attention kernel not used because:", then one warning per failed check,
    then raises "No available kernel"; those checks' warnings are the reason, else the
    exception's first line."""
    messages = [" ".join(m.split(" (Triggered internally at")[0].split())
                for m in warning_messages]
    marks = [i for i, m in enumerate(messages)
             if "cudnn attention kernel not used because" in m.lower()]
    reasons = [m for m in messages[marks[-1] + 1:] if m] if marks else []
    first = (str(exc).strip().splitlines() or [""])[0]
    text = "; ".join(dict.fromkeys(reasons)) or f"{exc.__class__.__name__}: {first}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------------------------
# The `bench` command
# ---------------------------------------------------------------------------------------------

def window_pairs(seqlen: int, left: int) -> int:
    """(query, key) pairs a causal sliding window (left, 0) computes on a square sequence: row i
    sees keys max(0, i - left) .. i."""
    left = min(left, seqlen - 1)
    return left * (left + 1) // 2 + (left + 1) * (seqlen - left)


def measure_windows(cupy, headdims, dtype_name, seqlen, windows, wanted, tokens, hidden, warmup,
                    iters, progress=sys.stderr) -> list[dict]:
    """Sliding-window rows: causal attention restricted to window (w, 0) at one long seqlen, next to
    plain causal attention on the same arrays. TFLOP/s count only the pairs inside the window;
    `time_vs_causal` against `pairs_vs_causal` shows the time is proportional to the window."""
    import cuflash2
    from cuflash2.selfcheck import dtype_from_name

    dtype = dtype_from_name(dtype_name)
    backlog = Backlog(cupy)
    rows = []
    for headdim in headdims:
        batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
        config = Config("fwd", dtype_name, headdim, True, seqlen, batch, nheads)
        q, k, v = random_inputs(cupy, config, dtype, seed=headdim)
        dout = random_inputs(cupy, config, dtype, seed=headdim + 1)[0]
        times = {}
        for direction in wanted:
            for window in (None, *windows):
                kwargs = dict(causal=True, window_size=(-1, -1) if window is None else (window, 0))
                if direction == "fwd":
                    fn = lambda: cuflash2.attention(q, k, v, **kwargs)  # noqa: E731
                else:
                    out, lse = cuflash2.attention(q, k, v, return_lse=True, **kwargs)
                    fn = lambda: cuflash2.attention_backward(dout, q, k, v, out, lse, **kwargs)  # noqa: E731
                ms = time_cupy(cupy, fn, warmup, iters, backlog)
                times[(direction, window)] = ms
                pairs = window_pairs(seqlen, seqlen if window is None else window)
                flops = 4.0 * batch * nheads * headdim * pairs * (
                    BACKWARD_FLOP_FACTOR if direction == "bwd" else 1)
                row = {"direction": direction, "dtype": dtype_name, "headdim": headdim,
                       "seqlen": seqlen, "batch": batch, "nheads": nheads,
                       "window": "causal" if window is None else f"({window}, 0)",
                       "ms": ms, "tflops": flops / ms / 1e9,
                       "time_vs_causal": ms / times[(direction, None)],
                       "pairs_vs_causal": pairs / window_pairs(seqlen, seqlen)}
                rows.append(row)
                print(f"{direction} {dtype_name} d={headdim} s={seqlen} window {row['window']}: "
                      f"{ms:.3f} ms, {row['tflops']:.0f} TFLOP/s", file=progress, flush=True)
    return rows


def windows_table(rows: list[dict]) -> str:
    lines = ["| dir | dtype | d | seqlen | batch×heads | window | ms | TFLOP/s (pairs in window) "
             "| time / causal | pairs / causal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['dtype']} | {r['headdim']} | {r['seqlen']} | "
                     f"{r['batch']}×{r['nheads']} | {r['window']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.1f} | {r['time_vs_causal']:.3f} | {r['pairs_vs_causal']:.3f} |")
    return "\n".join(lines)


#: Sequence lengths of the varlen rows: ragged, 16k tokens in all.
VARLEN_LENGTHS = (3072, 512, 1536, 4096, 1024, 2048, 768, 3328)


def measure_varlen(cupy, headdims, dtype_name, lengths, wanted, hidden, warmup, iters,
                   progress=sys.stderr) -> list[dict]:
    """Varlen rows: `attention_varlen` on ragged sequences packed together, next to the dense call
    a user without varlen would make (every sequence padded to the longest). TFLOP/s count only
    the real tokens' pairs (causal halves them)."""
    import numpy

    import cuflash2
    from cuflash2.selfcheck import dtype_from_name

    dtype = dtype_from_name(dtype_name)
    backlog = Backlog(cupy)
    rows = []
    cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32))
    total, longest, batch = int(sum(lengths)), max(lengths), len(lengths)
    for headdim in headdims:
        nheads = max(1, hidden // headdim)
        rng = cupy.random.default_rng(headdim)
        q, k, v, dout = (rng.standard_normal((total, nheads, headdim), dtype=cupy.float32)
                         .astype(dtype) for _ in range(4))
        padded = [rng.standard_normal((batch, longest, nheads, headdim), dtype=cupy.float32)
                  .astype(dtype) for _ in range(4)]
        for causal in (False, True):
            args = (cu, cu, longest, longest)
            out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=causal, return_lse=True)
            out_p, lse_p = cuflash2.attention(*padded[:3], causal=causal, return_lse=True)
            for direction in wanted:
                if direction == "fwd":
                    fn = lambda: cuflash2.attention_varlen(  # noqa: E731
                        q, k, v, *args, causal=causal, check_cu_seqlens=False)
                    fn_padded = lambda: cuflash2.attention(*padded[:3], causal=causal)  # noqa: E731
                else:
                    fn = lambda: cuflash2.attention_varlen_backward(  # noqa: E731
                        dout, q, k, v, out, lse, *args, causal=causal, check_cu_seqlens=False)
                    fn_padded = lambda: cuflash2.attention_backward(  # noqa: E731
                        padded[3], *padded[:3], out_p, lse_p, causal=causal)
                ms = time_cupy(cupy, fn, warmup, iters, backlog)
                ms_padded = time_cupy(cupy, fn_padded, warmup, iters, backlog)
                flops = sum(attention_flops(1, nheads, n, n, headdim, causal, direction)
                            for n in lengths)
                row = {"direction": direction, "dtype": dtype_name, "headdim": headdim,
                       "causal": causal, "lengths": list(lengths), "nheads": nheads, "ms": ms,
                       "tflops": flops / ms / 1e9, "padded_ms": ms_padded,
                       "speedup_vs_padded": ms_padded / ms}
                rows.append(row)
                print(f"varlen {direction} {dtype_name} d={headdim} causal={causal}: {ms:.3f} ms "
                      f"({row['tflops']:.0f} TFLOP/s), padded dense {ms_padded:.3f} ms",
                      file=progress, flush=True)
    return rows


def varlen_table(rows: list[dict]) -> str:
    lines = ["| dir | dtype | d | causal | sequences (tokens) | heads | ms | TFLOP/s (real tokens) "
             "| padded dense ms | speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['dtype']} | {r['headdim']} | "
                     f"{'yes' if r['causal'] else 'no'} | {len(r['lengths'])} ({sum(r['lengths'])}) "
                     f"| {r['nheads']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['padded_ms']:.3f} "
                     f"| {r['speedup_vs_padded']:.2f}x |")
    return "\n".join(lines)


#: Decode rows (issue 5): batch sizes, cache lengths and (nheads, nheads_kv) at d=128.
DECODE_BATCHES = (1, 8, 64)
L2_FLUSH_BYTES = 256 << 20
DECODE_CACHES = (4096, 16384, 65536)
DECODE_HEADS = ((32, 4), (32, 32))  # GQA 8:1 and MHA


def decode_bytes(batch, cache_len, nheads, nheads_kv, headdim, seqlen_q=1, itemsize=2) -> int:
    """Bytes a decode step must move: the K and V cache read once, q read and out written."""
    kv = 2 * batch * cache_len * nheads_kv * headdim * itemsize
    return kv + 2 * batch * seqlen_q * nheads * headdim * itemsize


def copy_ceiling(cupy, nbytes=1 << 30, iters=10) -> float:
    """Device copy bandwidth (bytes read + written per second) of a large buffer."""
    src = cupy.empty(nbytes // 2, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    backlog = Backlog(cupy)
    ms = time_cupy(cupy, lambda: dst.__setitem__(slice(None), src), 2, iters, backlog)
    return 2 * src.nbytes / ms * 1e3


def decode_rows(headdim=128):
    """(nheads, nheads_kv, cache_len, batch) of the decode table's rows, in its order (rows whose
    K and V would pass 24 GiB left out)."""
    for nheads, nheads_kv in DECODE_HEADS:
        for cache_len in DECODE_CACHES:
            for batch in DECODE_BATCHES:
                if batch * cache_len * nheads_kv * headdim * 4 <= (24 << 30):
                    yield nheads, nheads_kv, cache_len, batch


def decode_inputs(cupy, dtype, batch, cache_len, nheads, nheads_kv, headdim=128):
    """A decode row's arrays: q (one token), the K and V caches, the appended token (k = v) and
    the cache lengths (the capacity less that token)."""
    rng = cupy.random.default_rng(cache_len + batch)
    kc = rng.standard_normal((batch, cache_len, nheads_kv, headdim),
                             dtype=cupy.float32).astype(dtype)
    vc = rng.standard_normal(kc.shape, dtype=cupy.float32).astype(dtype)
    q = rng.standard_normal((batch, 1, nheads, headdim), dtype=cupy.float32).astype(dtype)
    k1 = rng.standard_normal((batch, 1, nheads_kv, headdim), dtype=cupy.float32).astype(dtype)
    lengths = cupy.full((batch,), cache_len - 1, dtype=cupy.int32)
    return q, kc, vc, k1, lengths


def measure_decode(cupy, dtype_name, warmup, iters, headdim=128, progress=sys.stderr,
                   torch=None) -> list[dict]:
    """Decode rows: one query token against caches of 4k-64k tokens (a token appended), batch
    1/8/64, GQA 8:1 and MHA; achieved bandwidth next to the copy ceiling, at batch 1 the time
    of a dense `attention` call on the same q, K, V, and with `torch` SDPA's decoding on the
    same arrays (`bench_decode_peers`)."""
    import ml_dtypes
    import numpy

    import cuflash2

    dtype = numpy.dtype(numpy.float16 if dtype_name == "fp16" else ml_dtypes.bfloat16)
    backlog = Backlog(cupy)
    ceiling = copy_ceiling(cupy)
    flush_l2 = l2_flush(cupy)
    rows = []
    for nheads, nheads_kv, cache_len, batch in decode_rows(headdim):
        q, kc, vc, k1, lengths = decode_inputs(cupy, dtype, batch, cache_len, nheads,
                                               nheads_kv, headdim)
        fn = lambda: cuflash2.attention_with_kvcache(  # noqa: E731
            q, kc, vc, k=k1, v=k1, cache_seqlens=lengths, causal=True)
        ms = time_cupy(cupy, fn, warmup, iters, backlog, flush_l2)
        moved = decode_bytes(batch, cache_len, nheads, nheads_kv, headdim)
        row = {"dtype": dtype_name, "headdim": headdim, "batch": batch,
               "cache": cache_len, "nheads": nheads, "nheads_kv": nheads_kv, "ms": ms,
               "gb_per_s": moved / ms / 1e6, "fraction_of_copy": moved / ms * 1e3 / ceiling,
               "dense_ms": None}
        if batch == 1:
            dense = lambda: cuflash2.attention(q, kc, vc, causal=True)  # noqa: E731
            row["dense_ms"] = time_cupy(cupy, dense, warmup, iters, backlog, flush_l2)
        if torch is not None:
            from .bench_decode_peers import measure_single

            measure_single(cupy, torch, row, q, kc, vc, fn(), warmup, iters, backlog, flush_l2)
        rows.append(row)
        print(f"decode b={batch} cache={cache_len} h={nheads}/{nheads_kv}: {ms:.3f} ms, "
              f"{row['gb_per_s']:.0f} GB/s ({row['fraction_of_copy']:.0%} of copy)",
              file=progress, flush=True)
    for row in rows:
        row["copy_ceiling_gb_per_s"] = ceiling / 1e9
    return rows


def decode_table(rows: list[dict]) -> str:
    """The single-step decode table; with the peers' times where the rows have them."""
    from .bench_decode_peers import has_peers, peer_cells, peer_headers

    peers = has_peers(rows, "_us")
    headers = ["dtype", "d", "heads (q/kv)", "batch", "cache", "us", "GB/s", "of copy ceiling",
               "dense attention us (batch 1)"] + (peer_headers("us") if peers else [])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        dense = "–" if r["dense_ms"] is None else (
            f"{r['dense_ms'] * 1e3:.1f} ({r['dense_ms'] / r['ms']:.2f}x)")
        cells = [r["dtype"], r["headdim"], f"{r['nheads']}/{r['nheads_kv']}", r["batch"],
                 r["cache"], f"{r['ms'] * 1e3:.1f}", f"{r['gb_per_s']:.0f}",
                 f"{r['fraction_of_copy']:.0%}", dense]
        if peers:
            cells += peer_cells(r, "_us", r["ms"] * 1e3, 1)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def run(cupy, args) -> int:
    """Measure, print the markdown report on stdout (progress goes to stderr), save --json."""
    import json

    import cuflash2
    from cuflash2 import _environment

    wanted = directions(args.direction)
    if "bwd" in wanted and not hasattr(cuflash2, "attention_backward"):
        print("note: backward is not available yet in cuflash2; skipping --direction bwd",
              file=sys.stderr)
        wanted = tuple(d for d in wanted if d != "bwd")
        if not wanted:
            return 0
    headdims, min_seqlen = grid_headdims(args.headdim)
    seqlens = args.seqlens or PAPER_SEQLENS
    configs = paper_grid(headdims, args.dtype, causal_modes(args.causal), seqlens,
                         wanted, args.tokens, args.hidden, min_seqlen)
    extra_headdims = args.headdim or DEFAULT_HEADDIMS  # the windows and varlen tables
    torch = _load_torch() if args.compare == "torch" else None
    env = _environment.collect()
    if torch is not None:
        env["torch_cudnn"] = _torch_cudnn_version(torch)

    rows = measure(cupy, torch, configs, args.warmup, args.iters)
    summary = summarize(rows)
    windows = []
    if getattr(args, "windows", None):
        windows = measure_windows(cupy, extra_headdims, args.dtype[0], max(seqlens),
                                  args.windows, wanted, args.tokens, args.hidden, args.warmup,
                                  args.iters)
    decode, decode_graph = [], []
    if getattr(args, "decode", False):
        from .bench_decode_graph import measure_decode_graph

        decode = measure_decode(cupy, args.dtype[0], args.warmup, args.iters, torch=torch)
        decode_graph = measure_decode_graph(cupy, args.warmup, args.iters, torch=torch)
    varlen = []
    if getattr(args, "varlen", False):
        varlen = measure_varlen(cupy, extra_headdims, args.dtype[0], VARLEN_LENGTHS, wanted,
                                args.hidden, args.warmup, args.iters)

    print(f"\n{environment_header(env)}\n")
    print(f"Median of {args.iters} calls after {args.warmup} warm-up calls, CUDA events; "
          f"FLOPs 4·b·h·s²·d (causal /2, backward ×{BACKWARD_FLOP_FACTOR}).\n")
    if torch is not None:
        print(f"torch SDPA on the same arrays, restricted to its FlashAttention-2 backend "
              f"(SDPA-flash) and to its cuDNN backend (cuDNN {env['torch_cudnn'] or '?'}); "
              f"ratios are cuflash2 TFLOP/s over theirs; max abs diff: forward outputs against "
              f"cuflash2's.\n")
    print(markdown_table(rows, compare=torch is not None))
    notes = cudnn_notes(rows)
    if notes:
        print()
        print("\n".join(notes))
    if summary:
        print()
        print(summary_table(summary))
    if windows:
        print("\nSliding windows (causal, window (w, 0)), next to plain causal attention:\n")
        print(windows_table(windows))
    if varlen:
        print(f"\nVariable-length sequences (attention_varlen, lengths {list(VARLEN_LENGTHS)}), "
              "next to the same sequences padded to the longest:\n")
        print(varlen_table(varlen))
    if decode:
        print(f"\nDecoding with a KV cache (attention_with_kvcache, one query token, a token "
              f"appended, causal; L2 flushed by a 256 MB read before each call; copy ceiling "
              f"{decode[0]['copy_ceiling_gb_per_s']:.0f} GB/s, bytes read + written per second "
              f"by a device copy):\n")
        print(decode_table(decode))
        print("\nGB/s counts the K and V cache read once plus q and out; decoding only reads, "
              "and a read-only stream can pass the copy figure (HBM3e peak 4.8 TB/s on the H200).")
        if torch is not None:
            from .bench_decode_peers import SINGLE_STEP_NOTE, peer_notes

            print("\n" + "\n".join(peer_notes(decode, SINGLE_STEP_NOTE, "single steps")))
    if decode_graph:
        from .bench_decode_graph import LAYERS, decode_graph_table

        print(f"\nDecoding steps in a CUDA graph ({LAYERS} layers, each its own cache, one "
              f"token appended, causal; between layers a kernel computing the next layer's q, "
              f"k, v from the layer's output; L2 flushed before each step; a layer's time "
              f"includes that kernel). Programmatic launches let a kernel start while the one "
              f"before it finishes, and the layers' calls pass early_cache_reads=True (the "
              f"kernel between layers writes only q, k, v), so the cache is read while the "
              f"previous kernel finishes; the next columns are the same step with the cache "
              f"read after the previous kernel, and without programmatic launches:\n")
        print(decode_graph_table(decode_graph))
        if torch is not None:
            from .bench_decode_peers import GRAPH_NOTE, peer_notes

            print("\n" + "\n".join(peer_notes(decode_graph, GRAPH_NOTE, "graph")))
    if args.json:
        report = {"environment": env, "settings": _settings(args), "rows": [r.to_json() for r in rows],
                  "summary": summary, "windows": windows, "varlen": varlen, "decode": decode,
                  "decode_graph": decode_graph}
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"saved {len(rows)} rows to {args.json}", file=sys.stderr)
    return 1 if any(row.errors for row in rows) else 0


def _settings(args) -> dict:
    """The options, with --headdim as the grid ran it; headdim_min_seqlen names the head dims
    the default grid keeps only from a seqlen on."""
    settings = {key: value for key, value in vars(args).items() if key not in ("func", "command")}
    headdims, min_seqlen = grid_headdims(args.headdim)
    settings["headdim"] = list(headdims)
    settings["headdim_min_seqlen"] = {str(d): s for d, s in min_seqlen.items()}
    return settings
