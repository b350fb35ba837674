"""A/B timing of two versions of the kernel sources in one process, on the same arrays (not a
benchmark of record): `cuda_src/` as it is ("base") and `cuda_src/` with the files of an overlay
directory in place of its own ("alt"), e.g. a kernel with another grid order. The two versions
alternate round by round on each configuration of the paper grid, so drifts of the clock or the
machine fall on both; each is compiled once (its own module cache) and every plan is remade when
the version changes. With --cudnn, PyTorch SDPA's cuDNN backend is timed on the same arrays too,
for the ratios the issues' targets are stated in.

Also checks the alt's results against the base's: max |alt - base| of the outputs (the forward,
or dq, dk, dv), printed beside the times (atomic dQ additions differ in order, so dq may differ
in its last bits; everything else of the paper grid's calls should be equal).

    PYTHONPATH=. python3 benchmarks/dev/ab_sources.py --alt alt_src --direction bwd \\
        [--headdims 64 128] [--seqlens 4096] [--dtypes fp16] [--causal both] [--rounds 3] [--cudnn]

Make the overlay from a commit, for instance: mkdir -p alt_src/sm90 && git show
REF:cuda_src/sm90/FILE > alt_src/sm90/FILE (its files by their paths under cuda_src; an
untracked folder in the repository root travels to the device machine).
"""

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2 import _compile, api  # noqa: E402
from cuflash2.bench import paper_grid, timing, torch_peers  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402


class Sources:
    """Switches the kernel sources between versions: where kernel_source reads them, the module
    cache compiled from them, and the plans (which hold launches of those modules)."""

    def __init__(self, overlay: Path):
        base = _compile.cuda_src_dir()
        self._tmp = tempfile.TemporaryDirectory(prefix="cuflash2-alt-src-")
        merged = Path(self._tmp.name) / "cuda_src"
        shutil.copytree(base, merged)
        # paths relative to the overlay, sm90/ and the other subfolders included
        overridden = sorted(str(p.relative_to(overlay)) for p in overlay.rglob("*")
                            if p.is_file())
        if not overridden:
            raise SystemExit(f"{overlay}: no files to put in place of cuda_src's")
        for name in overridden:
            if not (base / name).is_file():
                raise SystemExit(f"{overlay}/{name}: cuda_src has no such file")
            shutil.copy(overlay / name, merged / name)
        print(f"alt: cuda_src with {', '.join(overridden)} from {overlay}", flush=True)
        self.roots = {"base": base, "alt": merged}
        self.modules = {"base": {}, "alt": {}}
        self._original_dir = _compile.cuda_src_dir

    def use(self, name: str):
        root = self.roots[name]
        _compile.cuda_src_dir = lambda: root
        _compile.kernel_source.cache_clear()
        _compile._modules = self.modules[name]
        api._forward_plans.plans.clear()
        api._backward_plans.plans.clear()


def _max_diff(cupy, a, b) -> float:
    return float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())


def _measure(cupy, torch, sources, config, seed, args, backlog):
    """(the table's line, alt / base time) of one configuration."""
    dtype = dtype_from_name(config.dtype)
    q, k, v = paper_grid.random_inputs(cupy, config, dtype, seed)
    dout = cupy.random.default_rng(seed + 10_000).standard_normal(
        q.shape, dtype=cupy.float32).astype(dtype)
    causal = config.causal
    out, lse = api.attention(q, k, v, causal=causal, return_lse=True)
    results = {name: [cupy.empty_like(x) for x in (q, k, v)] for name in ("base", "alt")}

    def call(name):
        if args.direction == "fwd":
            return lambda: api.attention(q, k, v, causal=causal, out=results[name][0])
        dq, dk, dv = results[name]
        return lambda: api.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                              dq=dq, dk=dk, dv=dv)

    times = {"base": [], "alt": []}
    for _ in range(args.rounds):
        for name in ("base", "alt"):
            sources.use(name)
            times[name].append(timing.time_cupy(cupy, call(name), args.warmup, args.iters,
                                                backlog))
    base_ms, alt_ms = (statistics.median(times[n]) for n in ("base", "alt"))
    outputs = 1 if args.direction == "fwd" else 3
    diffs = [_max_diff(cupy, results["alt"][i], results["base"][i]) for i in range(outputs)]
    line = f"{config.describe():<44} {base_ms:8.3f} {alt_ms:8.3f} {alt_ms / base_ms:8.3f}"
    if torch is not None:
        row = paper_grid.Row(config)
        forward_out = results["base"][0] if args.direction == "fwd" else None
        torch_peers.measure_cudnn(cupy, torch, row, q, k, v, dout, forward_out, args.warmup,
                                  args.iters, backlog)
        if row.cudnn_ms:
            line += (f" {row.cudnn_ms:8.3f} {row.cudnn_ms / base_ms:10.3f} "
                     f"{row.cudnn_ms / alt_ms:9.3f}")
        else:
            line += f" {'n/a':>8} {'':>10} {'':>9}"
    return line + "  " + " ".join(f"{d:.3g}" for d in diffs), alt_ms / base_ms


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alt", type=Path, required=True, help="folder of files to replace cuda_src's")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(paper_grid.PAPER_SEQLENS))
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    ap.add_argument("--causal", choices=("both", "on", "off"), default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cudnn", action="store_true", help="also time PyTorch SDPA's cuDNN backend")
    args = ap.parse_args()

    sources = Sources(args.alt)
    torch = torch_peers.load_torch() if args.cudnn else None
    backlog = timing.Backlog(cupy)
    configs = paper_grid.paper_grid(headdims=tuple(args.headdims), dtypes=tuple(args.dtypes),
                                    causal_modes=paper_grid.causal_modes(args.causal),
                                    directions=(args.direction,), seqlens=tuple(args.seqlens))
    print(f"{'configuration':<44} {'base ms':>8} {'alt ms':>8} {'alt/base':>8}"
          + (f" {'cuDNN ms':>8} {'base/cuDNN':>10} {'alt/cuDNN':>9}" if torch else "")
          + "  max |alt - base|", flush=True)
    ratios = []
    for seed, config in enumerate(configs):
        line, ratio = _measure(cupy, torch, sources, config, seed, args, backlog)
        ratios.append(ratio)
        print(line, flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    mean = statistics.geometric_mean(ratios)
    print(f"alt/base geometric mean {mean:.3f} over {len(ratios)} configurations "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
