"""The command line on a CPU machine: `info` works, `check`/`bench` refuse clearly, bench's
argument parsing and its GPU-free arithmetic (grid, FLOPs, summary, table)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

import cuflash2
from cuflash2 import reference, selfcheck
from cuflash2.bench import (decode, decode_peers, flex, paper_grid, report, timing, torch_peers,
                            varlen, windows)
from cuflash2.cli import EXIT_NO_GPU, build_parser, main

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so these tests mean the same on a GPU machine.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "cuflash2", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_info_without_gpu_exits_zero_and_says_so():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cuflash2 ")
    assert "numpy" in result.stdout
    assert "GPU            none:" in result.stdout
    assert "kernel cache" in result.stdout


def test_info_reports_cupy_cache_dir_from_environment(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUPY_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "cuflash2", "info"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert str(tmp_path) in result.stdout


@pytest.mark.parametrize("command", ["check", "bench"])
def test_gpu_commands_without_gpu_exit_nonzero_with_a_clear_message(command):
    result = run_cli(command)
    assert result.returncode == EXIT_NO_GPU
    assert f"cuflash2 {command}: needs an NVIDIA GPU" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("info", "check", "bench"):
        assert command in result.stdout


def test_help_names_the_command_as_invoked():
    # `python -m cuflash2` says so; the console script (cli.main, no prog) says `cuflash2`.
    assert run_cli("--help").stdout.startswith("usage: python -m cuflash2 ")
    assert run_cli("bench", "--help").stdout.startswith("usage: python -m cuflash2 bench ")
    assert build_parser().format_usage().startswith("usage: cuflash2 ")
    assert build_parser("python -m cuflash2").format_usage().startswith(
        "usage: python -m cuflash2 ")


def test_console_script_help_says_cuflash2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cuflash2 ")
    # The installed script itself, where this environment has one (pip install puts it next to
    # the interpreter), running this checkout's code (PYTHONPATH), not an older installed copy.
    script = Path(sys.executable).parent / "cuflash2"
    if script.exists():
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
        result = subprocess.run([str(script), "info", "--help"], env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: cuflash2 info ")


def test_bench_defaults_are_the_paper_grid():
    args = build_parser().parse_args(["bench"])
    assert args.headdim is None  # the default grid: paper_grid.grid_headdims(None)
    assert paper_grid.grid_headdims(None) == ((64, 128, 256), {256: 4096})
    assert paper_grid.grid_headdims([128]) == ((128,), {})
    assert args.dtype == ["fp16", "bf16"]
    assert args.causal == "both"
    assert args.seqlens is None  # the grid's lengths (report.run), 16k for --flex
    assert paper_grid.PAPER_SEQLENS == (512, 1024, 2048, 4096, 8192, 16384)
    assert args.direction == "both" and not args.flex
    assert args.compare is None and args.json is None
    assert args.warmup >= 1 and 10 <= args.iters <= 50


def test_bench_flex_rows():
    """--flex: bf16/fp16 d=128 at 16k tokens by default (the issue's FlexAttention rows), the
    paper grid's batch and heads, both directions and causal modes."""
    configs = flex.configs_from_args(build_parser().parse_args(
        ["bench", "--flex", "--dtype", "bf16"]))
    assert {(c.direction, c.causal) for c in configs} == {
        (d, c) for d in ("fwd", "bwd") for c in (False, True)}
    assert {(c.dtype, c.headdim, c.seqlen, c.batch, c.nheads) for c in configs} == {
        ("bf16", 128, 16384, 1, 16)}
    configs = flex.configs_from_args(build_parser().parse_args(
        ["bench", "--flex", "--seqlens", "4096", "--headdim", "64", "--direction", "bwd"]))
    assert {(c.direction, c.headdim, c.seqlen, c.batch, c.nheads) for c in configs} == {
        ("bwd", 64, 4096, 4, 32)}


def test_bench_options_parse():
    args = build_parser().parse_args([
        "bench", "--headdim", "64", "--dtype", "bf16", "--causal", "on", "--seqlens", "512", "2048",
        "--direction", "both", "--compare", "torch", "--json", "out.json", "--warmup", "1",
        "--iters", "5",
    ])
    assert (args.headdim, args.dtype, args.causal, args.seqlens) == ([64], ["bf16"], "on", [512, 2048])
    assert (args.direction, args.compare, args.json) == ("both", "torch", "out.json")
    assert (args.warmup, args.iters) == (1, 5)


@pytest.mark.parametrize("bad", [["--dtype", "fp32"], ["--causal", "maybe"],
                                 ["--compare", "jax"], ["--seqlens", "0"], ["--direction", "up"]])
def test_bench_rejects_bad_options(bad, capsys):
    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(["bench", *bad])
    assert excinfo.value.code == 2


def test_paper_grid_keeps_tokens_and_hidden_fixed():
    configs = paper_grid.paper_grid(headdims=(64, 128), dtypes=("fp16",), causal_modes=(False,))
    assert len(configs) == 2 * 6
    for config in configs:
        assert config.batch * config.seqlen == 16384
        assert config.nheads * config.headdim == 2048


def test_cost_scripts_arrays_are_paper_grid_sized():
    # NumPy stands in for CuPy: the same default_rng / standard_normal / astype calls.
    points = list(paper_grid.paper_grid_arrays(numpy, headdims=(64,), seqlens=(1024, 4096),
                                               count=2))
    assert [(d, s) for d, s, _ in points] == [(64, 1024), (64, 4096)]
    for d, s, arrays in points:
        assert len(arrays) == 2
        for x in arrays:
            assert x.shape == (16384 // s, s, 2048 // d, d) and x.dtype == numpy.float16
            assert float(numpy.abs(x).max()) > 0  # fresh random values, never zeros


def test_default_grid_adds_d256_from_4k():
    headdims, min_seqlen = paper_grid.grid_headdims(None)
    configs = paper_grid.paper_grid(headdims, ("fp16", "bf16"), paper_grid.causal_modes("both"),
                                    paper_grid.PAPER_SEQLENS, paper_grid.directions("both"),
                                    min_seqlen=min_seqlen)
    d256 = [c for c in configs if c.headdim == 256]
    assert len(configs) == 2 * 2 * 2 * 6 * 2 + len(d256)
    assert len(d256) == 2 * 2 * 2 * 3  # fwd/bwd x fp16/bf16 x causal off/on x s 4k, 8k, 16k
    assert {(c.seqlen, c.batch, c.nheads) for c in d256} == {(4096, 4, 8), (8192, 2, 8),
                                                              (16384, 1, 8)}
    assert {(c.dtype, c.causal, c.direction) for c in d256} == {
        (dtype, causal, direction) for dtype in ("fp16", "bf16") for causal in (False, True)
        for direction in ("fwd", "bwd")}
    # same nesting order as before: d=256 follows d=128 within each direction and dtype
    assert [c.headdim for c in configs[:30]] == [64] * 12 + [128] * 12 + [256] * 6
    # an explicit --headdim 256 runs at every seqlen
    headdims, min_seqlen = paper_grid.grid_headdims([256])
    assert len(paper_grid.paper_grid(headdims, ("fp16",), (False,), paper_grid.PAPER_SEQLENS,
                                     min_seqlen=min_seqlen)) == 6


def test_json_settings_name_the_grid_headdims():
    settings = report._settings(build_parser().parse_args(["bench", "--compare", "torch"]))
    assert settings["headdim"] == [64, 128, 256]
    assert settings["headdim_min_seqlen"] == {"256": 4096}
    assert "func" not in settings and settings["compare"] == "torch"
    settings = report._settings(build_parser().parse_args(["bench", "--headdim", "128"]))
    assert (settings["headdim"], settings["headdim_min_seqlen"]) == ([128], {})


def test_grid_size_follows_the_options():
    configs = paper_grid.paper_grid((64, 128), ("fp16", "bf16"), paper_grid.causal_modes("both"),
                                    paper_grid.PAPER_SEQLENS, paper_grid.directions("both"))
    assert len(configs) == 2 * 2 * 2 * 6 * 2
    assert paper_grid.causal_modes("on") == (True,) and paper_grid.directions("bwd") == ("bwd",)


def test_flops_forward_causal_and_backward():
    full = paper_grid.attention_flops(2, 16, 4096, 4096, 128, causal=False)
    assert full == 4 * 2 * 16 * 4096 * 4096 * 128
    assert paper_grid.attention_flops(2, 16, 4096, 4096, 128, causal=True) == full / 2
    assert paper_grid.attention_flops(2, 16, 4096, 4096, 128, False, "bwd") == 2.5 * full


def _row(seqlen, ours, theirs, direction="fwd", cudnn=None, cudnn_error=None):
    config = paper_grid.Config(direction, "fp16", 128, False, seqlen, 16384 // seqlen, 16)
    return paper_grid.Row(config, ms=1.0, tflops=ours, torch_ms=1.0, torch_tflops=theirs,
                          cudnn_ms=None if cudnn is None else 1.0, cudnn_tflops=cudnn,
                          cudnn_error=cudnn_error)


def test_summary_geometric_mean_and_minimum():
    rows = [_row(512, 200.0, 100.0), _row(1024, 100.0, 200.0), _row(2048, 300.0, 300.0)]
    summary = paper_grid.summarize(rows)["fwd"]
    assert math.isclose(summary["geomean_ratio"], 1.0)
    assert summary["min_ratio"] == 0.5
    assert "s=1024" in summary["min_config"]
    assert summary["configs"] == 3


def test_summary_skips_rows_without_torch():
    rows = [_row(512, 200.0, None)]
    assert paper_grid.summarize(rows) == {}


def test_markdown_table_has_one_line_per_row():
    rows = [_row(512, 200.0, 100.0), _row(1024, 150.0, None)]
    rows[1].errors.append("boom")
    table = paper_grid.markdown_table(rows, compare=True).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[0].count("|") == table[2].count("|")
    assert "| 2.000 |" in table[2]
    assert "boom" in table[3]


def test_markdown_table_names_the_cudnn_version():
    table = paper_grid.markdown_table([_row(512, 200.0, 100.0, cudnn=400.0)], compare=True,
                                      cudnn_version=91900).splitlines()
    assert "| cuDNN 91900 TFLOP/s |" in table[0]
    assert "| cuDNN TFLOP/s |" in paper_grid.markdown_table([_row(512, 200.0, 100.0)], True)


def test_repeat_rounds_interleave_the_contenders_and_keep_medians():
    """Rounds 2..n of a row: every contender again, the order turning round by round; each
    time the median of its rounds, TFLOP/s from it, every round in row.rounds."""
    row = _row(512, 200.0, 100.0, cudnn=400.0)
    first = {"cuflash2": row.ms, "SDPA-flash": row.torch_ms, "cuDNN": row.cudnn_ms}
    calls, later = [], {"cuflash2": [1.0, 9.0], "SDPA-flash": [2.0, 2.0], "cuDNN": [0.5, 8.0]}

    def timer(name):
        def time_once(warmup, iters, backlog):
            calls.append(name)
            return later[name][sum(c == name for c in calls) - 1]
        return time_once
    timers = {name: timer(name) for name in first}
    paper_grid.repeat_rounds(row, timers, 3, 1, 5, None)
    assert calls == ["SDPA-flash", "cuDNN", "cuflash2", "cuDNN", "cuflash2", "SDPA-flash"]
    assert row.rounds == {name: [first[name]] + later[name] for name in first}
    for name, (ms_field, tflops_field) in paper_grid.ROUND_FIELDS.items():
        median = sorted(row.rounds[name])[1]
        assert getattr(row, ms_field) == median
        assert getattr(row, tflops_field) == pytest.approx(row.config.flops / median / 1e9)
    assert "rounds" in row.to_json()


def test_row_json_has_config_flops_and_ratio():
    data = _row(512, 200.0, 100.0).to_json()
    assert data["seqlen"] == 512 and data["ratio"] == 2.0
    assert data["flops"] == paper_grid.attention_flops(32, 16, 512, 512, 128, False)


def test_row_json_keeps_the_old_fields_and_adds_cudnn():
    data = _row(512, 200.0, 100.0, cudnn=400.0).to_json()
    old = {"direction", "dtype", "headdim", "causal", "seqlen", "batch", "nheads", "ms", "tflops",
           "torch_ms", "torch_tflops", "max_abs_diff", "errors", "flops", "ratio"}
    assert old <= set(data)
    assert (data["ratio"], data["torch_tflops"]) == (2.0, 100.0)  # still cuflash2 / SDPA-flash
    assert (data["cudnn_ms"], data["cudnn_tflops"], data["ratio_vs_cudnn"]) == (1.0, 400.0, 0.5)
    assert data["cudnn_error"] is None and data["cudnn_max_abs_diff"] is None
    refused = _row(512, 200.0, 100.0, cudnn_error="head dim").to_json()
    assert refused["ratio_vs_cudnn"] is None and refused["cudnn_error"] == "head dim"
    json.dumps(data)


def test_summary_has_both_baselines():
    rows = [_row(512, 200.0, 100.0, cudnn=400.0), _row(1024, 100.0, 200.0, cudnn=100.0),
            _row(2048, 300.0, 300.0, cudnn_error="refused")]
    summary = paper_grid.summarize(rows)["fwd"]
    assert summary["configs"] == 3 and math.isclose(summary["geomean_ratio"], 1.0)
    assert summary["cudnn_configs"] == 2  # the refused row is left out of the cuDNN ratios
    assert math.isclose(summary["cudnn_geomean_ratio"], math.sqrt(0.5))
    assert summary["cudnn_min_ratio"] == 0.5 and "s=512" in summary["cudnn_min_config"]
    table = paper_grid.summary_table(paper_grid.summarize(rows)).splitlines()
    assert len(table) == 2 + 2
    assert "| fwd | SDPA-flash | 3 | 1.000 | 0.500 |" in table[2]
    assert "| fwd | cuDNN | 2 | 0.707 | 0.500 |" in table[3]


def test_summary_with_cudnn_alone():
    summary = paper_grid.summarize([_row(512, 200.0, None, cudnn=100.0)])
    assert summary["fwd"] == {"cudnn_configs": 1, "cudnn_geomean_ratio": 2.0,
                              "cudnn_min_ratio": 2.0,
                              "cudnn_min_config": "fwd fp16 d=128 s=512 full (b=32 h=16)"}
    assert paper_grid.summary_table(summary).count("\n") == 2


def test_markdown_table_shows_cudnn_and_na():
    rows = [_row(512, 200.0, 100.0, cudnn=400.0), _row(1024, 150.0, 100.0, cudnn_error="no")]
    table = paper_grid.markdown_table(rows, compare=True).splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[8:] == ["SDPA-flash TFLOP/s", "cuDNN TFLOP/s", "cuflash2 / SDPA-flash",
                          "cuflash2 / cuDNN", "max abs diff (SDPA-flash)", "max abs diff (cuDNN)"]
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert cells[8:12] == ["100.0", "400.0", "2.000", "0.500"]
    cells = [cell.strip() for cell in table[3].strip("|").split("|")]
    assert cells[9] == cells[11] == cells[13] == "n/a" and cells[10] == "1.500"
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert len(paper_grid.markdown_table(rows, compare=False).splitlines()[0].split("|")) == 10


def test_cudnn_notes_group_rows_by_reason():
    rows = [_row(512, 1.0, 1.0, cudnn_error="A"), _row(1024, 1.0, 1.0, cudnn=1.0),
            _row(2048, 1.0, 1.0, cudnn_error="A"), _row(4096, 1.0, 1.0, cudnn_error="B")]
    notes = paper_grid.cudnn_notes(rows)
    assert len(notes) == 2
    assert notes[0].startswith("note: cuDNN n/a for 2 row(s)") and notes[0].endswith(": A")
    assert "s=512" in notes[0] and "s=2048" in notes[0] and "s=4096" in notes[1]
    assert paper_grid.cudnn_notes([_row(512, 1.0, 1.0)]) == []


def test_refusal_reason_takes_torchs_cudnn_warnings():
    # The warnings torch 2.11 gave on an H200 for d=264 under sdpa_kernel(CUDNN_ATTENTION).
    where = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:{}.)"
    warnings = ["Memory efficient kernel not used because:" + where.format(986),
                "Memory Efficient attention has been runtime disabled." + where.format(552),
                "Flash attention kernel not used because:" + where.format(988),
                "Flash attention has been runtime disabled." + where.format(540),
                "cuDNN attention kernel not used because:" + where.format(990),
                "head_dim should be no more than 256" + where.format(522)]
    exc = RuntimeError("No available kernel. Aborting execution.")
    assert torch_peers.refusal_reason(exc, warnings) == "head_dim should be no more than 256"
    assert torch_peers.refusal_reason(exc, warnings + ["dtype"]) == (
        "head_dim should be no more than 256; dtype")
    assert torch_peers.refusal_reason(exc, warnings[:3]) == (
        "RuntimeError: No available kernel. Aborting execution.")
    assert torch_peers.refusal_reason(AttributeError("CUDNN_ATTENTION\nmore")) == (
        "AttributeError: CUDNN_ATTENTION")
    assert len(torch_peers.refusal_reason(RuntimeError("x" * 1000))) == 300


def test_measure_cudnn_fills_the_row_or_says_why_not(monkeypatch):
    import warnings

    class FakeCudnn:
        def __init__(self, torch, cupy, dtype_name):
            pass

    monkeypatch.setattr(torch_peers, "TorchSdpaCudnn", FakeCudnn)
    monkeypatch.setattr(torch_peers, "measure_torch", lambda *args: (2.0, 1e-3, None))
    row = _row(4096, 300.0, 250.0)
    torch_peers.measure_cudnn(None, None, row, None, None, None, None, None, 1, 5, None)
    assert (row.cudnn_ms, row.cudnn_max_abs_diff, row.cudnn_error) == (2.0, 1e-3, None)
    assert row.cudnn_tflops == row.config.flops / 2.0 / 1e9 and row.ratio_vs_cudnn

    def refuse(*args):
        warnings.warn("CuDNN attention kernel not used because:")
        warnings.warn("unsupported head dim")
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch_peers, "measure_torch", refuse)
    row = _row(4096, 300.0, 250.0)
    torch_peers.measure_cudnn(None, None, row, None, None, None, None, None, 1, 5, None)
    assert row.cudnn_ms is None and row.cudnn_tflops is None and row.ratio_vs_cudnn is None
    assert row.cudnn_error == "unsupported head dim" and not row.errors
    assert "cuDNN n/a" in paper_grid._progress_line(row)


def test_check_grid_covers_dtypes_headdims_causal_and_shapes():
    cases = selfcheck.grid(("fp16", "bf16"), (40, 128))
    assert len(cases) == 2 * 2 * 2 * len(selfcheck.SHAPES)
    assert any(c.nheads_kv == 1 for c in cases) and any(1 < c.nheads_kv < c.nheads for c in cases)
    assert any(c.seqlen_q > c.seqlen_k for c in cases) and any(c.seqlen_q < c.seqlen_k for c in cases)
    assert any(c.unbatched for c in cases)


def _exact(x):
    # The reference's dtype that is exact for inputs like x (float64 for float32 inputs).
    return numpy.float64 if x.dtype == numpy.float32 else numpy.float32


def _attention_from_reference(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                              out=None, precision=None):
    # Stands in for the kernel: the exact reference rounded once to the input dtype.
    result, lse = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                      return_lse=True, compute_dtype=_exact(q))
    lse = lse.astype(numpy.float32)
    result = result.astype(q.dtype)
    return (result, lse) if return_lse else result


def _backward_from_reference(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                             **kwargs):
    # Stands in for the backward kernels: the exact reference gradients rounded once.
    grads = reference.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                         softmax_scale=softmax_scale, compute_dtype=_exact(q))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


def test_check_logic_passes_a_correct_implementation(monkeypatch, capsys):
    # numpy stands in for cupy: the check's logic, minus the GPU.
    monkeypatch.setattr(cuflash2, "attention", _attention_from_reference)
    monkeypatch.setattr(cuflash2, "attention_backward", _backward_from_reference)
    assert selfcheck.run(numpy, ["fp16", "bf16"], [64]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("PASS") for line in lines) == 2 * 2 * len(selfcheck.SHAPES)
    assert "out err" in lines[1] and "lse err" in lines[1]
    assert all(f"{name} err" in lines[1] for name in ("dq", "dk", "dv"))


def test_check_logic_takes_float32_at_both_precisions(monkeypatch, capsys):
    monkeypatch.setattr(cuflash2, "attention", _attention_from_reference)
    monkeypatch.setattr(cuflash2, "attention_backward", _backward_from_reference)
    monkeypatch.setattr(selfcheck, "SHAPES", selfcheck.SHAPES[:2])
    assert selfcheck.run(numpy, ["fp32", "tf32"], [64]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("PASS fp32") for line in lines) == 2 * 2
    assert sum(line.startswith("PASS tf32") for line in lines) == 2 * 2


def test_check_logic_fails_a_wrong_implementation(monkeypatch, capsys):
    def off_by_a_bit(q, k, v, **kwargs):
        result, lse = _attention_from_reference(q, k, v, **kwargs)
        return (result * 1.01).astype(q.dtype), lse

    monkeypatch.setattr(cuflash2, "attention", off_by_a_bit)
    monkeypatch.setattr(cuflash2, "attention_backward", _backward_from_reference)
    assert selfcheck.run(numpy, ["fp16"], [64]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_reports_an_exception_as_a_failure(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(cuflash2, "attention", broken)
    passed, line = selfcheck.run_case(numpy, selfcheck.grid(("fp16",), (64,))[0], seed=0)
    assert not passed and "RuntimeError: launch failed" in line


def test_window_pairs_match_a_direct_count():
    for seqlen, left in ((10, 3), (10, 0), (10, 9), (10, 50), (1, 0), (7, 6)):
        direct = sum(min(i, left) + 1 for i in range(seqlen))
        assert windows.window_pairs(seqlen, left) == direct
    assert windows.window_pairs(16384, 16384) == 16384 * 16385 // 2


def test_bench_windows_option_parses():
    args = build_parser().parse_args(["bench", "--windows", "256", "4096"])
    assert args.windows == [256, 4096]


def test_bench_varlen_lengths_total_the_paper_tokens():
    assert sum(varlen.VARLEN_LENGTHS) == paper_grid.PAPER_TOKENS
    assert build_parser().parse_args(["bench", "--varlen"]).varlen


def test_decode_bytes():
    # batch 1, 4096 cached tokens, 4 KV heads of 128: K and V are 2 x 4 MiB, plus q and out.
    assert decode.decode_bytes(1, 4096, 32, 4, 128) == 2 * 4096 * 4 * 128 * 2 + 2 * 32 * 128 * 2
    assert build_parser().parse_args(["bench", "--decode"]).decode


def _decode_row(**extra):
    row = {"dtype": "fp16", "headdim": 128, "batch": 1, "cache": 16384, "nheads": 32,
           "nheads_kv": 4, "ms": 0.0173, "gb_per_s": 1939.0, "fraction_of_copy": 0.47,
           "dense_ms": 0.1867}
    row.update(extra)
    return row


def test_decode_table_has_the_peers_columns_only_when_measured():
    plain = decode.decode_table([_decode_row()])
    assert "SDPA-flash" not in plain and plain.splitlines()[-1].endswith("| 186.7 (10.79x) |")
    with_peers = decode.decode_table([_decode_row(
        sdpa_flash_us=32.7, sdpa_flash_error=None, cudnn_us=None,
        cudnn_error="cuDNN refused: no kernel")])
    header, rule, line = with_peers.splitlines()
    assert header.endswith("| SDPA-flash us | cuDNN us |")
    assert rule.count("---") == header.count("|") - 1
    assert line.endswith("| 32.7 (1.89x) | n/a |")


def test_decode_graph_table_peers_and_refusal_notes():
    row = {"dtype": "fp16", "headdim": 128, "batch": 1, "cache": 16384, "nheads": 32,
           "nheads_kv": 4, "programmatic_us_per_layer": 13.25, "fraction_of_copy": 0.61,
           "after_wait_us_per_layer": 14.6, "after_wait_fraction_of_copy": 0.55,
           "plain_us_per_layer": 16.3, "plain_fraction_of_copy": 0.5, "programmatic_edges": 15}
    assert "cuDNN" not in decode.decode_graph_table([row])
    row.update(sdpa_flash_us_per_layer=31.04, sdpa_flash_error=None, cudnn_us_per_layer=None,
               cudnn_error="no kernel")
    table = decode.decode_graph_table([row])
    assert table.splitlines()[0].endswith("| SDPA-flash us per layer | cuDNN us per layer |")
    assert table.splitlines()[-1].endswith("| 15 | 31.04 (2.34x) | n/a |")
    assert decode_peers.peer_notes([row], "NOTE", "graph") == [
        "NOTE", "cuDNN n/a in the graph (b=1 cache=16384 h=32/4): no kernel"]


def test_measure_decode_peers_record_a_refusal_per_backend(monkeypatch):
    # Without torch's backends every peer refuses: the row keeps its keys, times empty, and a
    # reason for each; nothing raises.
    class NoBackend:
        def __init__(self, *args):
            raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(decode_peers, "PEERS",
                        tuple((key, NoBackend) for key, _ in decode_peers.PEERS))
    row = {"dtype": "fp16"}
    decode_peers.measure_single(None, None, row, None, None, None, None, 1, 1, None, None)
    for key, _ in decode_peers.PEERS:
        assert row[f"{key}_us"] is None and row[f"{key}_max_abs_diff"] is None
        assert row[f"{key}_error"] == "RuntimeError: No available kernel. Aborting execution."


def test_measure_times_flash_and_cudnn_on_every_row(monkeypatch):
    # The flow of `measure` with the timed pieces faked: each row gets cuflash2, SDPA-flash and
    # cuDNN; a cuDNN refusal leaves the row good (no error, n/a), a flash failure does not stop
    # cuDNN. NumPy stands in for CuPy to make the inputs.
    import types

    calls = []

    class FakeTorchSdpa:
        def __init__(self, torch, cupy, dtype_name):
            pass

    class Flash(FakeTorchSdpa):
        LABEL = "SDPA-flash"

    class Cudnn(FakeTorchSdpa):
        LABEL = "cuDNN"

    def ours_forward(cupy, row, q, k, v, warmup, iters, backlog):
        row.ms, row.tflops = 1.0, row.config.flops / 1e9
        return q, None  # (its output, its timer)

    def ours_backward(cupy, row, q, k, v, dout, warmup, iters, backlog):
        assert dout is not None and dout.shape == q.shape
        row.ms, row.tflops = 1.0, row.config.flops / 1e9

    def theirs(cupy, torch, reference, config, q, k, v, dout, ours_out, warmup, iters, backlog):
        calls.append((reference.LABEL, config.direction, config.headdim))
        assert (ours_out is not None) == (config.direction == "fwd")
        if reference.LABEL == "cuDNN" and config.headdim == 256:
            raise RuntimeError("No available kernel. Aborting execution.")
        if reference.LABEL == "SDPA-flash" and config.causal:
            raise RuntimeError("flash broke")
        return 2.0, (1e-3 if ours_out is not None else None), None

    monkeypatch.setattr(timing, "Backlog", lambda cupy: None)
    monkeypatch.setattr(torch_peers, "TorchSdpaFlash", Flash)
    monkeypatch.setattr(torch_peers, "TorchSdpaCudnn", Cudnn)
    monkeypatch.setattr(paper_grid, "_measure_forward", ours_forward)
    monkeypatch.setattr(paper_grid, "_measure_backward", ours_backward)
    monkeypatch.setattr(torch_peers, "measure_torch", theirs)
    monkeypatch.setattr(cuflash2, "attention_backward", lambda *a, **k: None, raising=False)
    fake_cupy = types.SimpleNamespace(
        random=numpy.random, float32=numpy.float32,
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    configs = paper_grid.paper_grid((64, 256), ("fp16",), (False, True), (1024,),
                                    ("fwd", "bwd"), tokens=2048, hidden=512)
    rows = paper_grid.measure(fake_cupy, object(), configs, 1, 2, progress=open(os.devnull, "w"))
    assert len(calls) == 2 * len(rows)
    for row in rows:
        c = row.config
        assert row.ms == 1.0
        if c.causal:
            assert row.torch_ms is None and "flash broke" in row.errors[0]
        else:
            assert row.torch_ms == 2.0 and not row.errors and row.ratio == 2.0
        if c.headdim == 256:
            assert row.cudnn_ms is None and "No available kernel" in row.cudnn_error
        else:
            assert row.cudnn_ms == 2.0 and row.ratio_vs_cudnn == 2.0 and row.cudnn_error is None
            assert row.cudnn_max_abs_diff == (1e-3 if c.direction == "fwd" else None)


def test_info_says_when_no_driver_is_installed(monkeypatch):
    """Without an NVIDIA driver the CUDA runtime reports driver version 0 and calls it
    insufficient; info says there is none instead of "CUDA driver 0.0"."""
    import types

    from cuflash2 import _environment

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    runtime = types.SimpleNamespace(driverGetVersion=lambda: 0, runtimeGetVersion=lambda: 13000,
                                    getDeviceCount=no_driver)
    fake = types.SimpleNamespace(__version__="14.0.0", cuda=types.SimpleNamespace(
        runtime=runtime, nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0))))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cupy, reason = _environment.find_gpu()
    assert cupy is None and reason.startswith("no NVIDIA driver is installed")
    env = _environment.collect()
    assert env["cuda_driver"] is None and env["gpu_error"] == reason
    lines = "\n".join(_environment.format_info(env))
    assert "CUDA driver    none found" in lines and "CUDA driver    0.0" not in lines


def test_check_help_describes_its_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "checks each result against cuflash2.reference" in out
    for option, words in (("--dtype", "input dtypes"), ("--headdim", "head dims to check"),
                          ("--seed", "seed of the random inputs")):
        assert option in out and words in out, option
