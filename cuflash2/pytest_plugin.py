"""pytest plugin: the ``gpu_benchmark`` fixture, pytest-benchmark's ``benchmark`` timing on the GPU.

Registered as a pytest11 entry point, so with cuflash2 installed any test can take it::

    def test_my_layer(gpu_benchmark):
        x = cupy.ones((4096, 4096), dtype=cupy.float16)
        gpu_benchmark(lambda: x @ x)                 # rounds=50, warmup_rounds=5 by default
        gpu_benchmark.extra_info["tflops"] = 2 * 4096**3 / gpu_benchmark.gpu_seconds() / 1e12

Each round is timed with CUDA events (cuflash2.testing.GpuBenchmark), so pytest-benchmark's
statistics, saved runs (``--benchmark-autosave``) and comparisons (``--benchmark-compare``) are
GPU time. Without pytest-benchmark the test is skipped, saying so. Importing this module
imports neither CuPy nor pytest-benchmark: it costs a pytest run that does not use the fixture
nothing but this file.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def gpu_benchmark(request):
    """pytest-benchmark's ``benchmark`` with ``cuflash2.testing.cuda_event_timer`` as its timer
    (the test's own ``benchmark`` marker options kept), wrapped in a ``GpuBenchmark``."""
    from cuflash2.testing import GpuBenchmark, cuda_event_timer

    plugins = request.config.pluginmanager
    # Its entry point's name, or the module's where it was loaded with -p.
    if not (plugins.hasplugin("benchmark") or plugins.hasplugin("pytest_benchmark.plugin")):
        pytest.skip("gpu_benchmark needs pytest-benchmark: pip install pytest-benchmark")
    # pytest-benchmark reads the test's closest `benchmark` marker when its fixture is set up,
    # so the timer goes on a marker first and the fixture is requested after.
    marker = request.node.get_closest_marker("benchmark")
    options = dict(marker.kwargs) if marker else {}
    # append=False: first among the test's own markers, the closest one.
    request.node.add_marker(pytest.mark.benchmark(**dict(options, timer=cuda_event_timer)),
                            append=False)
    return GpuBenchmark(request.getfixturevalue("benchmark"))
