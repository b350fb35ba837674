"""A/B timing of two versions of the whole package in one process, on the same arrays (not a
benchmark of record): the checkout's `cuflash2` ("head") and a base version extracted from a git
commit into a folder ("base"), kernels and Python together, so a change of the kernels' template
parameters or parameter structs is compared as it is (benchmarks/dev/ab_sources.py swaps kernel
sources under one Python package, which breaks there). The base folder's `cuflash2` is copied to
a temporary folder as the package `cuflash2_base`, its `cuda_src` beside it (where its
`_compile.cuda_src_dir()` finds them), and imported under that name (absolute `cuflash2` imports
inside it rewritten to the new name, so it never reaches the head's modules).

Each configuration of `python -m cuflash2 bench`'s FlashAttention-2 paper grid (the head's
`bench.paper_grid`: same Config, grid and FLOP counts) runs on both versions, round by round
(base first in even rounds, head first in odd ones), timed as bench times (`bench.timing`: CUDA events, median of
--iters calls, the spinning backlog kernel queued first), the version's time being the median
over the rounds. The base is driven through its public API only: `attention(q, k, v, causal=,
out=)` and `attention_backward(dout, q, k, v, out, lse, causal=, dq=, dk=, dv=)`, its backward
taking its own forward's out and lse. With --cudnn, torch SDPA's cuDNN backend runs on the same
arrays too (`bench.torch_peers.measure_cudnn`).

Prints a markdown table per direction: base and head ms, head/base time, both TFLOP/s, max
|head - base| of the outputs (forward: out; backward: dq, dk, dv; atomic dQ additions differ in
order, so dq may differ in its last bits), then the geometric mean of head/base and the worst
row; --json PATH saves every number.

Make the base folder from a commit (an untracked folder in the repository root travels to the
device machine with the working tree, which has no .git):

    mkdir -p ab_base && git archive REF cuflash2 cuda_src | tar -x -C ab_base
    PYTHONPATH=. python3 benchmarks/dev/ab_packages.py --base ab_base --direction both \\
        [--headdims 64 128] [--seqlens 4096] [--dtypes fp16] [--causal both] [--rounds 3] \\
        [--iters 20] [--warmup 3] [--cudnn] [--json ab.json]
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib.util
import json
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2.bench import paper_grid, timing, torch_peers  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402

PACKAGE = "cuflash2"
BASE_NAME = "cuflash2_base"
#: The outputs compared, per direction.
OUTPUTS = {"fwd": ("out",), "bwd": ("dq", "dk", "dv")}


# ---------------------------------------------------------------------------------------------
# The base package under another name
# ---------------------------------------------------------------------------------------------

def rename_absolute_imports(source: str, new: str, old: str = PACKAGE) -> str:
    """`source` with its absolute imports of package `old` made imports of `new`:
    `from old[.x] import y` -> `from new[.x] import y`, `import old` -> `import new as old`
    (so the code's `old.name` still resolves). Raises ValueError where another form of an
    absolute import of `old` remains (`import old.x`, `import a, old`)."""
    source = re.sub(rf"^(\s*)from {old}(\.[\w.]+)? import ", rf"\1from {new}\2 import ", source,
                    flags=re.MULTILINE)
    source = re.sub(rf"^(\s*)import {old}(?=[ \t]*($|#))", rf"\1import {new} as {old}", source,
                    flags=re.MULTILINE)
    left = [node.lineno for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.split(".")[0] == old)
            or (isinstance(node, ast.Import)
                and any(a.name.split(".")[0] == old for a in node.names))]
    if left:
        raise ValueError(f"absolute imports of {old} left at lines {left}")
    return source


def load_base_package(folder, name: str = BASE_NAME, workdir=None):
    """The package `folder/cuflash2` (with its kernel sources `folder/cuda_src`) imported as the
    package `name`, a module distinct from the head's `cuflash2`: copied into `workdir` (a new
    temporary folder, removed at exit, where None) as `workdir/name`, `workdir/cuda_src` beside
    it, its absolute `cuflash2` imports renamed (rename_absolute_imports)."""
    folder = Path(folder)
    package, sources = folder / PACKAGE, folder / "cuda_src"
    if not (package / "__init__.py").is_file() or not (sources / "flash_fwd.cu").is_file():
        raise FileNotFoundError(
            f"{folder} holds no {PACKAGE}/ and cuda_src/: make it with `mkdir -p {folder} && "
            f"git archive REF {PACKAGE} cuda_src | tar -x -C {folder}`")
    if name in sys.modules:
        raise ValueError(f"a module {name} is imported already")
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix=f"{name}-")
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    workdir = Path(workdir)
    target = workdir / name
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(package, target, ignore=ignore)
    shutil.copytree(sources, workdir / "cuda_src", ignore=ignore)
    for path in target.rglob("*.py"):
        path.write_text(rename_absolute_imports(path.read_text(), name))
    spec = importlib.util.spec_from_file_location(name, target / "__init__.py",
                                                  submodule_search_locations=[str(target)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        raise
    return module


# ---------------------------------------------------------------------------------------------
# Rows, summary and tables (no GPU)
# ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    config: paper_grid.Config
    base_ms: float | None = None
    head_ms: float | None = None
    max_abs_diff: dict = field(default_factory=dict)  # output name -> max |head - base|
    cudnn_ms: float | None = None
    cudnn_error: str | None = None
    errors: list = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """head / base time (below 1: the head is faster)."""
        if self.base_ms and self.head_ms:
            return self.head_ms / self.base_ms
        return None

    def tflops(self, ms: float | None) -> float | None:
        return self.config.flops / ms / 1e9 if ms else None

    def to_json(self) -> dict:
        data = asdict(self.config)
        data.update(description=self.config.describe(), flops=self.config.flops,
                    base_ms=self.base_ms, head_ms=self.head_ms, ratio=self.ratio,
                    base_tflops=self.tflops(self.base_ms), head_tflops=self.tflops(self.head_ms),
                    max_abs_diff=self.max_abs_diff, cudnn_ms=self.cudnn_ms,
                    cudnn_tflops=self.tflops(self.cudnn_ms), cudnn_error=self.cudnn_error,
                    errors=self.errors)
        return data


def summarize(rows: list[Row]) -> dict:
    """Per direction, over the rows timed on both versions: configs, geomean_ratio (head/base
    time), worst_ratio and worst_config (the row where the head is slowest against the base),
    best_ratio; with cuDNN times, cudnn_geomean_ratio (head/cuDNN time)."""
    summary = {}
    for direction in sorted({row.config.direction for row in rows}):
        timed = [row for row in rows if row.config.direction == direction and row.ratio]
        if not timed:
            continue
        worst = max(timed, key=lambda row: row.ratio)
        entry = {"configs": len(timed),
                 "geomean_ratio": statistics.geometric_mean(row.ratio for row in timed),
                 "worst_ratio": worst.ratio, "worst_config": worst.config.describe(),
                 "best_ratio": min(row.ratio for row in timed)}
        cudnn = [row.head_ms / row.cudnn_ms for row in timed if row.cudnn_ms]
        if cudnn:
            entry["cudnn_configs"] = len(cudnn)
            entry["cudnn_geomean_ratio"] = statistics.geometric_mean(cudnn)
        summary[direction] = entry
    return summary


def _cell(value, spec: str, missing: str = "–") -> str:
    return paper_grid.format_cell(value, spec, missing)


def markdown_table(rows: list[Row], direction: str, cudnn: bool) -> str:
    """One line per row of `direction`: times, head/base, TFLOP/s, with `cudnn` cuDNN's time and
    head/cuDNN ("n/a" where cuDNN refused), then max |head - base| of each output."""
    header = ["configuration", "base ms", "head ms", "head / base", "base TFLOP/s",
              "head TFLOP/s"]
    if cudnn:
        header += ["cuDNN ms", "head / cuDNN"]
    header += [f"max \\|head - base\\| {name}" for name in OUTPUTS[direction]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row.config.direction != direction:
            continue
        cells = [row.config.describe(), _cell(row.base_ms, ".3f"), _cell(row.head_ms, ".3f"),
                 _cell(row.ratio, ".3f"), _cell(row.tflops(row.base_ms), ".1f"),
                 _cell(row.tflops(row.head_ms), ".1f")]
        if cudnn:
            missing = "n/a" if row.cudnn_error else "–"
            vs_cudnn = row.head_ms / row.cudnn_ms if row.head_ms and row.cudnn_ms else None
            cells += [_cell(row.cudnn_ms, ".3f", missing), _cell(vs_cudnn, ".3f", missing)]
        cells += [_cell(row.max_abs_diff.get(name), ".3g") for name in OUTPUTS[direction]]
        if row.errors:
            cells[-1] += " (" + "; ".join(row.errors) + ")"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(direction: str, entry: dict) -> str:
    text = (f"{direction}: head/base time geometric mean {entry['geomean_ratio']:.3f} over "
            f"{entry['configs']} configurations (best {entry['best_ratio']:.3f}, worst "
            f"{entry['worst_ratio']:.3f} at {entry['worst_config']})")
    if "cudnn_geomean_ratio" in entry:
        text += (f"; head/cuDNN time geometric mean {entry['cudnn_geomean_ratio']:.3f} over "
                 f"{entry['cudnn_configs']}")
    return text


def report(rows: list[Row], cudnn: bool) -> str:
    """The tables and summary lines of every direction the rows have."""
    summary = summarize(rows)
    parts = []
    for direction in ("fwd", "bwd"):
        if any(row.config.direction == direction for row in rows):
            parts.append(markdown_table(rows, direction, cudnn))
            if direction in summary:
                parts.append(summary_line(direction, summary[direction]))
    return "\n\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=Path("ab_base"),
                    help="folder with the base version's cuflash2/ and cuda_src/ (default ab_base)")
    ap.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    ap.add_argument("--headdims", type=int, nargs="+", default=list(paper_grid.DEFAULT_HEADDIMS))
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(paper_grid.PAPER_SEQLENS))
    ap.add_argument("--dtypes", nargs="+", choices=("fp16", "bf16"), default=["fp16", "bf16"])
    ap.add_argument("--causal", choices=("both", "on", "off"), default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cudnn", action="store_true", help="also time PyTorch SDPA's cuDNN backend")
    ap.add_argument("--json", metavar="PATH", default=None, help="save every number as JSON")
    return ap


def configs_from_args(args) -> list[paper_grid.Config]:
    return paper_grid.paper_grid(headdims=tuple(args.headdims), dtypes=tuple(args.dtypes),
                                 causal_modes=paper_grid.causal_modes(args.causal),
                                 seqlens=tuple(args.seqlens),
                                 directions=paper_grid.directions(args.direction))


# ---------------------------------------------------------------------------------------------
# Timing (GPU)
# ---------------------------------------------------------------------------------------------

def _max_diff(cupy, a, b) -> float:
    return float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())


def measure(cupy, torch, packages: dict, config, seed: int, args, backlog) -> Row:
    """One configuration on both versions (`packages`: {"base": module, "head": module}), on the
    same q, k, v (and dout), alternating round by round; with `torch`, cuDNN on them too."""
    row = Row(config)
    dtype = dtype_from_name(config.dtype)
    q, k, v = paper_grid.random_inputs(cupy, config, dtype, seed)
    dout = cupy.random.default_rng(seed + 10_000).standard_normal(
        q.shape, dtype=cupy.float32).astype(dtype)
    causal = config.causal
    results, calls = {}, {}
    for name, package in packages.items():
        try:
            if config.direction == "fwd":
                out = cupy.empty_like(q)
                results[name] = (out,)
                calls[name] = (lambda p=package, o=out:
                               p.attention(q, k, v, causal=causal, out=o))
            else:
                out, lse = package.attention(q, k, v, causal=causal, return_lse=True)
                grads = tuple(cupy.empty_like(x) for x in (q, k, v))
                results[name] = grads
                calls[name] = (lambda p=package, o=out, s=lse, g=grads:
                               p.attention_backward(dout, q, k, v, o, s, causal=causal,
                                                    dq=g[0], dk=g[1], dv=g[2]))
        except Exception as exc:  # keep going; the row says which version failed
            row.errors.append(f"{name}: {exc.__class__.__name__}: {exc}")
    times = {name: [] for name in calls}
    for round_ in range(args.rounds):
        # The order alternates round by round (base first, then head first, ...), so that
        # whatever favours a round's first or second call falls on both versions.
        for name in (list(times) if round_ % 2 == 0 else list(times)[::-1]):
            try:
                times[name].append(timing.time_cupy(cupy, calls[name], args.warmup, args.iters,
                                                    backlog))
            except Exception as exc:
                row.errors.append(f"{name}: {exc.__class__.__name__}: {exc}")
                del times[name]
    if times.get("base"):
        row.base_ms = statistics.median(times["base"])
    if times.get("head"):
        row.head_ms = statistics.median(times["head"])
    if row.base_ms and row.head_ms:
        row.max_abs_diff = {label: _max_diff(cupy, h, b) for label, h, b in zip(
            OUTPUTS[config.direction], results["head"], results["base"])}
    if torch is not None:
        peer = paper_grid.Row(config)
        forward_out = results["head"][0] if config.direction == "fwd" and row.head_ms else None
        torch_peers.measure_cudnn(cupy, torch, peer, q, k, v, dout, forward_out, args.warmup,
                                  args.iters, backlog)
        row.cudnn_ms, row.cudnn_error = peer.cudnn_ms, peer.cudnn_error
    return row


def _progress(row: Row) -> str:
    text = (f"{row.config.describe():<44} base {_cell(row.base_ms, '8.3f')} ms  head "
            f"{_cell(row.head_ms, '8.3f')} ms  head/base {_cell(row.ratio, '.3f')}")
    if row.max_abs_diff:
        text += "  max|head-base| " + " ".join(f"{v:.3g}" for v in row.max_abs_diff.values())
    if row.cudnn_ms or row.cudnn_error:
        text += f"  cuDNN {_cell(row.cudnn_ms, '.3f', 'n/a')} ms"
    return text + ("  [" + "; ".join(row.errors) + "]" if row.errors else "")


def main(argv=None) -> int:
    import cupy

    import cuflash2
    from cuflash2 import _environment

    args = build_parser().parse_args(argv)
    base = load_base_package(args.base)
    print(f"base: {args.base} as {base.__name__} ({Path(base.__file__).parent}, kernel sources "
          f"{base._compile.cuda_src_dir()}); head: {Path(cuflash2.__file__).parent}",
          file=sys.stderr, flush=True)
    packages = {"base": base, "head": cuflash2}
    torch = torch_peers.load_torch() if args.cudnn else None
    backlog = timing.Backlog(cupy)
    rows = []
    for seed, config in enumerate(configs_from_args(args)):
        row = measure(cupy, torch, packages, config, seed, args, backlog)
        rows.append(row)
        print(_progress(row), file=sys.stderr, flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    env = _environment.collect()
    print(f"\n{paper_grid.environment_header(env)}\n")
    print(f"base {args.base} against the checkout (head), alternating in {args.rounds} rounds; "
          f"each the median over the rounds of the median of {args.iters} calls (CUDA events, "
          f"after {args.warmup} warm-up calls); head / base below 1: the head is faster.\n")
    print(report(rows, torch is not None))
    if args.json:
        settings = {key: str(value) if isinstance(value, Path) else value
                    for key, value in vars(args).items()}
        with open(args.json, "w") as handle:
            json.dump({"environment": env, "settings": settings,
                       "rows": [row.to_json() for row in rows], "summary": summarize(rows)},
                      handle, indent=2)
        print(f"saved {len(rows)} rows to {args.json}", file=sys.stderr)
    return 1 if any(row.errors for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
