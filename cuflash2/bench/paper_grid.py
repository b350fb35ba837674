"""The FlashAttention-2 paper's grid (docs/DESIGN.md §6), the main table of
`python -m cuflash2 bench`: its configurations, FLOP counts, inputs, the measurement of each row
(cuflash2, and with torch SDPA-flash and cuDNN on the same arrays), the table and its summary.

The grid keeps 16k tokens per batch (batch = tokens // seqlen) and a hidden size of 2048
(nheads = hidden // headdim), so every configuration's inputs are far larger than the 60 MB L2 of
an H200; by default d = 64 and 128 at every seqlen and d = 256 from 4k. Timing (`timing`): CUDA
events around each call after warm-up, median of `iters` calls. With `--compare torch` the same
CuPy arrays are handed to PyTorch through DLPack (no copy) and run through SDPA restricted to its
FlashAttention-2 backend, then to its cuDNN backend (`torch_peers`), each timed the same way with
torch's events (a configuration cuDNN refuses shows "n/a" and the reason).

The pure functions (grid, FLOP counts, summary, table) need no GPU and are unit-tested on the CPU;
the importable pieces are meant for the scripts in benchmarks/ too.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import asdict, dataclass, field

from .._options import AttentionOptions
from . import timing, torch_peers

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

    def options(self) -> AttentionOptions:
        """The options of this configuration's calls (the paper grid's: causal or not)."""
        return AttentionOptions(causal=self.causal)

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
    #: With repeats: each contender's time (ms) of every round ("cuflash2", "SDPA-flash",
    #: "cuDNN"); the row's times are their medians.
    rounds: dict = field(default_factory=dict)

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


def format_cell(value, spec: str, missing: str = "–") -> str:
    """`value` formatted by `spec`, or `missing` where it is None."""
    return missing if value is None else format(value, spec)


def markdown_table(rows: list[Row], compare: bool, cudnn_version=None) -> str:
    """One line per row; with `compare`, SDPA-flash's and cuDNN's TFLOP/s (`cudnn_version`, as
    torch reports it, in the column's name), cuflash2's ratio to each and the max abs difference
    of the forward outputs (cuflash2 vs each); "n/a" where cuDNN refused the configuration
    (cudnn_notes gives the reasons)."""
    header = ["dir", "dtype", "d", "causal", "seqlen", "batch×heads", "cuflash2 ms",
              "cuflash2 TFLOP/s"]
    if compare:
        cudnn = f"cuDNN {cudnn_version} TFLOP/s" if cudnn_version else "cuDNN TFLOP/s"
        header += ["SDPA-flash TFLOP/s", cudnn, "cuflash2 / SDPA-flash",
                   "cuflash2 / cuDNN", "max abs diff (SDPA-flash)", "max abs diff (cuDNN)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        c = row.config
        cells = [c.direction, c.dtype, str(c.headdim), "yes" if c.causal else "no", str(c.seqlen),
                 f"{c.batch}×{c.nheads}", format_cell(row.ms, ".3f"),
                 format_cell(row.tflops, ".1f")]
        if compare:
            cudnn_missing = "n/a" if row.cudnn_error else "–"
            cells += [format_cell(row.torch_tflops, ".1f"),
                      format_cell(row.cudnn_tflops, ".1f", cudnn_missing),
                      format_cell(row.ratio, ".3f"),
                      format_cell(row.ratio_vs_cudnn, ".3f", cudnn_missing),
                      format_cell(row.max_abs_diff, ".1e"),
                      format_cell(row.cudnn_max_abs_diff, ".1e", cudnn_missing)]
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
# Inputs, and the implementations timed on them
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


def measure(cupy, torch, configs: list[Config], warmup: int, iters: int, progress=sys.stderr,
            repeats: int = 1):
    """Time every configuration; inputs are made once per (dtype, headdim, seqlen) and shared by
    the causal modes, the directions and torch. With torch, each row also times SDPA-flash (a
    failure there is the row's error) and then cuDNN (a refusal there is only cudnn_error).
    `repeats` > 1: each row's contenders are timed that many rounds, interleaved, the order
    turning round by round, and the row keeps each one's median (Row.rounds holds them all): a
    ratio between contenders then compares times taken in the same power state, which a long
    run's rows before leave to each row differently (about 5% between runs)."""
    import cuflash2
    from ..selfcheck import dtype_from_name

    backlog = timing.Backlog(cupy)
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
            timers = {}  # contender -> timer(warmup, iters, backlog), for the later rounds
            try:
                if config.direction == "fwd":
                    ours_out, timers["cuflash2"] = _measure_forward(cupy, row, q, k, v, warmup,
                                                                    iters, backlog)
                elif has_backward:
                    timers["cuflash2"] = _measure_backward(cupy, row, q, k, v, dout, warmup,
                                                           iters, backlog)
                else:
                    row.errors.append("backward not available yet")
                if torch is not None and row.ms is not None:
                    flash = torch_peers.TorchSdpaFlash(torch, cupy, dtype_name)
                    row.torch_ms, row.max_abs_diff, timers["SDPA-flash"] = (
                        torch_peers.measure_torch(cupy, torch, flash, config, q, k, v, dout,
                                                  ours_out, warmup, iters, backlog))
                    row.torch_tflops = config.flops / row.torch_ms / 1e9
            except Exception as exc:  # keep going; the row shows what failed
                row.errors.append(f"{exc.__class__.__name__}: {exc}")
            if torch is not None and row.ms is not None:
                cudnn_timer = torch_peers.measure_cudnn(cupy, torch, row, q, k, v, dout,
                                                        ours_out, warmup, iters, backlog)
                if cudnn_timer is not None:
                    timers["cuDNN"] = cudnn_timer
            if repeats > 1 and not row.errors:
                try:
                    repeat_rounds(row, timers, repeats, warmup, iters, backlog)
                except Exception as exc:
                    row.errors.append(f"{exc.__class__.__name__}: {exc}")
            print(_progress_line(row), file=progress, flush=True)
            del ours_out
        del q, k, v, dout
        cupy.get_default_memory_pool().free_all_blocks()
    return [rows[config] for config in configs]


#: The Row fields of each contender's time.
ROUND_FIELDS = {"cuflash2": ("ms", "tflops"), "SDPA-flash": ("torch_ms", "torch_tflops"),
                "cuDNN": ("cudnn_ms", "cudnn_tflops")}


def repeat_rounds(row: Row, timers: dict, repeats: int, warmup: int, iters: int, backlog) -> None:
    """Rounds 2 .. `repeats` of a row whose first round is in it: each contender of `timers`
    (name -> timer(warmup, iters, backlog) -> ms) timed again, round r starting at the r-th
    contender; then each time the median of its rounds (all of them in row.rounds)."""
    names = list(timers)
    rounds = {name: [getattr(row, ROUND_FIELDS[name][0])] for name in names}
    for r in range(1, repeats):
        for name in timing.turning_order(names, r):
            rounds[name].append(timers[name](warmup, iters, backlog))
    row.rounds = rounds
    for name, times in rounds.items():
        ms_field, tflops_field = ROUND_FIELDS[name]
        setattr(row, ms_field, statistics.median(times))
        setattr(row, tflops_field, row.config.flops / getattr(row, ms_field) / 1e9)


def _progress_line(row: Row) -> str:
    text = f"{row.config.describe():<40} cuflash2 {format_cell(row.tflops, '7.1f')} TFLOP/s"
    if row.torch_tflops is not None:
        text += f"  SDPA-flash {row.torch_tflops:7.1f}  ratio {format_cell(row.ratio, '.3f')}"
    if row.cudnn_tflops is not None:
        text += f"  cuDNN {row.cudnn_tflops:7.1f}  ratio {format_cell(row.ratio_vs_cudnn, '.3f')}"
    elif row.cudnn_error:
        text += "  cuDNN n/a"
    if row.errors:
        text += "  [" + "; ".join(row.errors) + "]"
    return text


def _measure_forward(cupy, row, q, k, v, warmup, iters, backlog):
    """cuflash2's forward time into `row`; returns its output (for the comparison with torch)
    and its timer (timer(warmup, iters, backlog) -> ms, for repeat_rounds)."""
    import cuflash2

    options = row.config.options().keywords()
    out = cupy.empty_like(q)

    def timer(warmup, iters, backlog):
        return timing.time_cupy(cupy, lambda: cuflash2.attention(q, k, v, out=out, **options),
                                warmup, iters, backlog)
    row.ms = timer(warmup, iters, backlog)
    row.tflops = row.config.flops / row.ms / 1e9
    return out, timer


def _measure_backward(cupy, row, q, k, v, dout, warmup, iters, backlog):
    import cuflash2

    # Assumed signature, mirroring flash-attn's: attention_backward(dout, q, k, v, out, lse, ...).
    options = row.config.options().keywords()
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)

    def timer(warmup, iters, backlog):
        return timing.time_cupy(
            cupy, lambda: cuflash2.attention_backward(dout, q, k, v, out, lse, **options),
            warmup, iters, backlog)
    row.ms = timer(warmup, iters, backlog)
    row.tflops = row.config.flops / row.ms / 1e9
    return timer
