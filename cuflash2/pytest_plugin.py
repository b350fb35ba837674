"""pytest plugin: the ``gpu_benchmark`` fixture, pytest-benchmark's ``benchmark`` timing on the GPU.

Registered as a pytest11 entry point, so with cuflash2 installed any test can take it::

    def test_my_layer(gpu_benchmark):
        x = cupy.ones((4096, 4096), dtype=cupy.float16)
        gpu_benchmark(lambda: x @ x)                 # rounds=50, warmup_rounds=5 by default
        gpu_benchmark.extra_info["tflops"] = 2 * 4096**3 / gpu_benchmark.gpu_seconds() / 1e12

Each round is timed with CUDA events (cuflash2.testing.GpuBenchmark), so pytest-benchmark's
statistics, saved runs (``--benchmark-autosave``) and comparisons (``--benchmark-compare``) are
GPU time. Without pytest-benchmark the test is skipped, saying so. Importing this module
imports neither CuPy nor pytest-benchmark; a run none of whose tests takes the fixture pays for
nothing more.
"""

from __future__ import annotations

import pytest


def _has_pytest_benchmark(config) -> bool:
    plugins = config.pluginmanager
    # Its entry point's name, or its module's where it was loaded with -p.
    return plugins.hasplugin("benchmark") or plugins.hasplugin("pytest_benchmark.plugin")


class _WithoutPytestBenchmark:
    """Stands in for pytest-benchmark's fixture where it is not installed (or -p no:benchmark)."""

    @pytest.fixture
    def benchmark(self):
        pytest.skip("gpu_benchmark needs pytest-benchmark: pip install pytest-benchmark")


def pytest_configure(config):
    if not _has_pytest_benchmark(config):
        config.pluginmanager.register(_WithoutPytestBenchmark(),
                                      "cuflash2.pytest_plugin.without-pytest-benchmark")


def pytest_collection_modifyitems(config, items):
    """The tests that take gpu_benchmark get cuflash2.testing.cuda_event_timer as their timer:
    on their closest `benchmark` marker, which pytest-benchmark reads when its fixture is set up
    (their own marker's options kept)."""
    if not _has_pytest_benchmark(config):
        return
    timed = [item for item in items if "gpu_benchmark" in getattr(item, "fixturenames", ())]
    if not timed:
        return
    from cuflash2.testing import cuda_event_timer

    for item in timed:
        marker = item.get_closest_marker("benchmark")
        options = dict(marker.kwargs) if marker else {}
        if options.get("timer") is cuda_event_timer:
            continue  # this hook can run twice: from the entry point and from a conftest
        # append=False: first among the test's own markers, so the closest one.
        item.add_marker(pytest.mark.benchmark(**dict(options, timer=cuda_event_timer)),
                        append=False)


@pytest.fixture
def gpu_benchmark(benchmark):
    """pytest-benchmark's ``benchmark`` with ``cuflash2.testing.cuda_event_timer`` as its timer,
    wrapped in a ``cuflash2.testing.GpuBenchmark``: ``gpu_benchmark(fn, rounds=, warmup_rounds=,
    before=)``. Depends on ``benchmark`` by name, so ``--benchmark-only`` and
    ``--benchmark-skip`` treat the test as a benchmark."""
    from cuflash2.testing import GpuBenchmark

    return GpuBenchmark(benchmark)
