"""The gpu_benchmark fixture (cuflash2.pytest_plugin) and cuflash2.testing's CUDA-event timer,
through pytest-benchmark, with a stand-in for CuPy whose GPU clock moves only when "GPU work"
runs: the statistics must be that clock's time, the spinning kernel queued before each round,
and the saved run must name the timer."""

import json
import sys
import types

import pytest

from cuflash2.bench import timing

pytest_plugins = ["pytester"]
pytest.importorskip("pytest_benchmark")

#: GPU time of the stand-in's work in a round, and of its spinning kernel.
WORK_S, ROUNDS, WARMUP = 0.002, 4, 2


class _StandInGpu:
    """CuPy's events and a clock that advances only by the work queued on the stand-in GPU."""

    def __init__(self):
        self.now = 0.0
        self.spins = 0
        gpu = self

        class Event:
            def record(self, stream=None):
                self.at = gpu.now

            def synchronize(self):
                pass

        self.module = types.ModuleType("cupy")
        self.module.uint64 = int
        self.module.cuda = types.SimpleNamespace(
            Event=Event, get_elapsed_time=lambda start, end: (end.at - start.at) * 1e3)
        self.module.stand_in = self

    def spin(self, grid, block, args):
        self.spins += 1
        self.now += args[0] * 1e-9

    def work(self):
        self.now += WORK_S


@pytest.fixture
def stand_in(monkeypatch):
    gpu = _StandInGpu()
    monkeypatch.setitem(sys.modules, "cupy", gpu.module)
    monkeypatch.setattr(timing, "spin_kernel", lambda cupy: gpu.spin)
    return gpu


TEST_FILE = f"""
import cupy
import pytest


@pytest.mark.benchmark(group="mine")
def test_timed(gpu_benchmark):
    gpu = cupy.stand_in
    gpu_benchmark(gpu.work, rounds={ROUNDS}, warmup_rounds={WARMUP})
    assert gpu_benchmark.gpu_seconds() == pytest.approx({WORK_S})
    assert gpu.spins == {ROUNDS + WARMUP}
    gpu_benchmark.extra_info["checked"] = True
"""


def test_gpu_benchmark_times_the_gpu_clock_and_names_the_timer(pytester, stand_in):
    pytester.makepyfile(test_timed=TEST_FILE)
    result = pytester.runpytest("-p", "cuflash2.pytest_plugin", "--benchmark-json",
                                       "run.json", "-q")
    result.assert_outcomes(passed=1)
    (saved,) = json.loads((pytester.path / "run.json").read_text())["benchmarks"]
    assert saved["options"]["timer"] == "cuda_event_timer"  # its __name__
    assert saved["group"] == "mine"  # the test's own marker options kept
    assert saved["stats"]["median"] == pytest.approx(WORK_S)
    assert saved["extra_info"] == {"checked": True}


def test_gpu_benchmark_counts_as_a_benchmark_for_benchmark_only(pytester, stand_in):
    pytester.makepyfile(test_timed=TEST_FILE, test_plain="def test_plain():\n    pass\n")
    result = pytester.runpytest("-p", "cuflash2.pytest_plugin", "--benchmark-only", "-q")
    result.assert_outcomes(passed=1, skipped=1)  # test_plain: not a benchmark


def test_gpu_benchmark_skips_without_pytest_benchmark(pytester, stand_in):
    pytester.makepyfile(test_timed=TEST_FILE)
    result = pytester.runpytest("-p", "cuflash2.pytest_plugin", "-p", "no:benchmark",
                                       "-rs", "-q")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*gpu_benchmark needs pytest-benchmark*"])


def test_gpu_benchmark_refuses_nonsense_rounds(stand_in):
    from cuflash2.testing import GpuBenchmark

    with pytest.raises(ValueError, match="rounds"):
        GpuBenchmark(benchmark=None)(stand_in.work, rounds=0)
