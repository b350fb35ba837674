"""benchmarks/dev/ab_packages.py without a GPU: a copy of the package imports under another name
as a module of its own (its kernel sources beside it, its absolute imports renamed), and the
table, summary and options of the A/B."""

import importlib.util
import math
import shutil
import sys
from pathlib import Path

import pytest

import cuflash2
from cuflash2.bench import paper_grid

REPO = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "ab_packages", REPO / "benchmarks" / "dev" / "ab_packages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ab = _load_script()


@pytest.fixture
def base_folder(tmp_path):
    """What `git archive REF cuflash2 cuda_src | tar -x -C ab_base` makes, from the checkout."""
    folder = tmp_path / "ab_base"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "cuflash2", folder / "cuflash2", ignore=ignore)
    shutil.copytree(REPO / "cuda_src", folder / "cuda_src", ignore=ignore)
    return folder


@pytest.fixture
def forget_base():
    names = []
    yield names
    for name in names:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_base_copy_imports_as_a_distinct_package(base_folder, tmp_path, forget_base):
    name = "cuflash2_base_under_test"
    forget_base.append(name)
    workdir = tmp_path / "work"
    workdir.mkdir()
    base = ab.load_base_package(base_folder, name=name, workdir=workdir)
    assert base is sys.modules[name] and base is not cuflash2
    assert base.__name__ == name and base.api.__name__ == f"{name}.api"
    assert base.attention is not cuflash2.attention
    assert base.attention_backward is not cuflash2.attention_backward
    assert base.api._forward_plans is not cuflash2.api._forward_plans  # plan caches of its own
    assert Path(base.__file__).parent == workdir / name
    # its kernel sources: the copy beside it, not the checkout's
    assert base._compile.cuda_src_dir() == (workdir / "cuda_src").resolve()
    assert cuflash2._compile.cuda_src_dir() == (REPO / "cuda_src").resolve()
    # an absolute import inside it (testing.py: from cuflash2 import reference) stays inside it
    testing = importlib.import_module(f"{name}.testing")
    assert testing.reference is base.reference and testing.reference is not cuflash2.reference
    loaded = [m for key, m in sys.modules.items() if key.startswith(name + ".")
              and getattr(m, "__file__", None)]
    assert loaded and all(Path(m.__file__).is_relative_to(workdir) for m in loaded)


def test_base_folder_must_hold_the_package_and_its_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="git archive REF cuflash2 cuda_src"):
        ab.load_base_package(tmp_path, name="cuflash2_base_missing", workdir=tmp_path)
    assert "cuflash2_base_missing" not in sys.modules


def test_absolute_imports_are_renamed():
    source = ("import os\nimport cuflash2\nfrom cuflash2 import reference\n"
              "def f():\n    import cuflash2  # noqa\n    from cuflash2.bench import timing\n"
              "    from . import api\n    return cuflash2.attention\n")
    renamed = ab.rename_absolute_imports(source, "cuflash2_base")
    assert renamed == (
        "import os\nimport cuflash2_base as cuflash2\nfrom cuflash2_base import reference\n"
        "def f():\n    import cuflash2_base as cuflash2  # noqa\n"
        "    from cuflash2_base.bench import timing\n    from . import api\n"
        "    return cuflash2.attention\n")
    for unhandled in ("import cuflash2.api\n", "import os, cuflash2\n", "import cuflash2 as c\n"):
        with pytest.raises(ValueError, match="absolute imports of cuflash2 left"):
            ab.rename_absolute_imports(unhandled, "cuflash2_base")


def _row(direction, seqlen, base_ms, head_ms, **extra):
    config = paper_grid.Config(direction, "fp16", 128, False, seqlen, 16384 // seqlen, 16)
    return ab.Row(config, base_ms=base_ms, head_ms=head_ms, **extra)


def test_summary_geomean_and_worst_row():
    rows = [_row("fwd", 512, 1.0, 0.5), _row("fwd", 1024, 1.0, 2.0), _row("fwd", 2048, 2.0, 2.2),
            _row("fwd", 4096, 1.0, None, errors=["head: RuntimeError: x"]),
            _row("bwd", 512, 4.0, 3.0, cudnn_ms=2.0)]
    summary = ab.summarize(rows)
    fwd = summary["fwd"]
    assert fwd["configs"] == 3
    assert math.isclose(fwd["geomean_ratio"], (0.5 * 2.0 * 1.1) ** (1 / 3))
    assert fwd["worst_ratio"] == 2.0 and "s=1024" in fwd["worst_config"]
    assert fwd["best_ratio"] == 0.5 and "cudnn_geomean_ratio" not in fwd
    assert math.isclose(summary["bwd"]["geomean_ratio"], 0.75)
    assert math.isclose(summary["bwd"]["cudnn_geomean_ratio"], 1.5)
    assert ab.summarize([_row("fwd", 512, None, 1.0)]) == {}
    line = ab.summary_line("fwd", fwd)
    assert line.startswith("fwd: head/base time geometric mean 1.032 over 3 configurations")
    assert "worst 2.000 at fwd fp16 d=128 s=1024" in line


def test_tables_per_direction():
    rows = [_row("fwd", 512, 1.0, 0.5, max_abs_diff={"out": 0.0}),
            _row("bwd", 512, 4.0, 3.0, max_abs_diff={"dq": 1e-3, "dk": 0.0, "dv": 0.0},
                 cudnn_error="no kernel"),
            _row("bwd", 1024, 1.0, None, errors=["head: RuntimeError: x"])]
    fwd = ab.markdown_table(rows, "fwd", cudnn=False).splitlines()
    assert len(fwd) == 3 and fwd[0].replace("\\|", "").count("|") == fwd[1].count("|") == 8
    flops = rows[0].config.flops
    assert fwd[2] == (f"| fwd fp16 d=128 s=512 full (b=32 h=16) | 1.000 | 0.500 | 0.500 | "
                      f"{flops / 1e9:.1f} | {flops / 0.5e9:.1f} | 0 |")
    bwd = ab.markdown_table(rows, "bwd", cudnn=True).splitlines()
    assert len(bwd) == 4 and bwd[0].endswith("| max \\|head - base\\| dv |")
    flops = rows[1].config.flops  # backward: 2.5 times the forward's
    assert bwd[2].endswith(f"| 4.000 | 3.000 | 0.750 | {flops / 4e9:.1f} | {flops / 3e9:.1f} | n/a "
                           f"| n/a | 0.001 | 0 | 0 |")
    assert bwd[3].endswith("| – | – | – | – | – (head: RuntimeError: x) |")
    text = ab.report(rows, cudnn=False)
    assert text.count("| configuration |") == 2 and "fwd: head/base" in text
    data = rows[1].to_json()
    assert data["ratio"] == 0.75 and data["max_abs_diff"]["dq"] == 1e-3
    assert data["flops"] == rows[1].config.flops and data["head_tflops"] == data["flops"] / 3e9


def test_options():
    args = ab.build_parser().parse_args([])
    assert (args.base, args.direction, args.rounds, args.causal) == (Path("ab_base"), "both", 3,
                                                                     "both")
    assert args.seqlens == list(paper_grid.PAPER_SEQLENS) and not args.cudnn and args.json is None
    args = ab.build_parser().parse_args([
        "--base", "elsewhere", "--direction", "bwd", "--headdims", "64", "--seqlens", "1024",
        "4096", "--dtypes", "bf16", "--causal", "on", "--rounds", "5", "--iters", "7",
        "--warmup", "1", "--cudnn", "--json", "ab.json"])
    configs = ab.configs_from_args(args)
    assert [(c.direction, c.dtype, c.headdim, c.causal, c.seqlen) for c in configs] == [
        ("bwd", "bf16", 64, True, 1024), ("bwd", "bf16", 64, True, 4096)]
    assert (args.rounds, args.iters, args.warmup, args.cudnn, args.json) == (5, 7, 1, True,
                                                                             "ab.json")
    assert len(ab.configs_from_args(ab.build_parser().parse_args(
        ["--headdims", "128", "--seqlens", "512"]))) == 2 * 2 * 2
