"""Setup of the pytest-benchmark suite (benchmarks/test_*.py).

Every test here is skipped, saying why, without CuPy and a CUDA device, and (through the
``gpu_benchmark`` fixture of cuflash2.pytest_plugin) without pytest-benchmark. The test modules
import neither CuPy nor torch at collection; this file tries CuPy once, to say why it skips.
The CPU suite (``python -m pytest -q``, testpaths = tests) does not collect this folder.

The peers, torch SDPA restricted to its FlashAttention-2 backend and to its cuDNN backend, are
timed next to cuflash2 where torch sees a GPU; ``CUFLASH2_BENCH_PEERS=0`` leaves them out.
"""

from __future__ import annotations

import os

import pytest

#: The peers' calls: timed with cuflash2.bench.timing (CUDA events, the median).
PEER_WARMUP, PEER_ITERS = 3, 20


def pytest_configure(config):
    # The gpu_benchmark fixture: from the pytest11 entry point where cuflash2 is installed, else
    # (a checkout on PYTHONPATH) registered here.
    if not config.pluginmanager.hasplugin("cuflash2.pytest_plugin"):
        config.pluginmanager.import_plugin("cuflash2.pytest_plugin")
    # pytest-benchmark registers it too; here so that a run without it reports skips, not
    # unknown-marker warnings.
    config.addinivalue_line("markers", "benchmark: pytest-benchmark's options of a test")


def _gpu_missing() -> str | None:
    """Why the suite cannot run here, or None."""
    try:
        import cupy
    except Exception as exc:  # not installed, or without a usable CUDA runtime
        return f"needs CuPy ({exc.__class__.__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver or no device
        return f"needs a CUDA device ({exc.__class__.__name__})"
    if count == 0:
        return "needs a CUDA device"
    major = int(cupy.cuda.Device().compute_capability[:-1])
    if major < 8:
        return "needs a GPU of compute capability 8.0 or newer"
    return None


_MISSING = _gpu_missing()


@pytest.fixture(scope="session", autouse=True)
def _require_gpu():
    # Session-scoped: set up before the session fixtures below, which import CuPy.
    if _MISSING is not None:
        pytest.skip(_MISSING)


@pytest.fixture(scope="session")
def cupy():
    import cupy

    return cupy


@pytest.fixture(scope="session")
def torch():
    """torch where it can run SDPA on this GPU and the peers are wanted, else None."""
    if os.environ.get("CUFLASH2_BENCH_PEERS", "1") == "0":
        return None
    import io

    from cuflash2.bench import torch_peers

    return torch_peers.load_torch(stream=io.StringIO())  # None, quietly, without torch


@pytest.fixture(scope="session")
def backlog(cupy):
    """The spinning kernel the peers' timings queue their calls behind."""
    from cuflash2.bench.timing import Backlog

    return Backlog(cupy)


@pytest.fixture(scope="session")
def flush_l2(cupy):
    """A call that evicts the L2 cache (untimed, before each decode round)."""
    from cuflash2.bench.timing import l2_flush

    return l2_flush(cupy)


@pytest.fixture(scope="session")
def sdpa_peers(cupy, torch, backlog):
    """measure(config, q, k, v, dout, ours_out) -> extra_info entries of the peers on the same
    arrays (a paper_grid.Config; dout for the backward, ours_out for the forward's max abs
    difference): `<peer>_ms`, `<peer>_tflops`, `<peer>_max_abs_diff`, or `<peer>_error` where
    the backend refused; a `peers` note where torch is not there."""
    import warnings

    from cuflash2.bench import torch_peers

    peers = (("sdpa_flash", torch_peers.TorchSdpaFlash), ("cudnn", torch_peers.TorchSdpaCudnn))

    def measure(config, q, k, v, dout, ours_out) -> dict:
        if torch is None:
            return {"peers": "none: torch not importable or without a GPU, or "
                             "CUFLASH2_BENCH_PEERS=0"}
        info = {}
        for key, backend in peers:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ms, diff, _ = torch_peers.measure_torch(
                        cupy, torch, backend(torch, cupy, config.dtype), config, q, k, v, dout,
                        ours_out, PEER_WARMUP, PEER_ITERS, backlog)
                except Exception as exc:  # a backend that refuses the shape: say why, go on
                    info[f"{key}_error"] = torch_peers.refusal_reason(
                        exc, [str(w.message) for w in caught])
                    continue
            info[f"{key}_ms"] = round(ms, 4)
            info[f"{key}_tflops"] = round(config.flops / ms / 1e9, 1)
            if diff is not None:
                info[f"{key}_max_abs_diff"] = diff
        return info

    return measure


def record(gpu_benchmark, *, flops=None, nbytes=None, **info) -> None:
    """extra_info of a timed benchmark: TFLOP/s from `flops` or GB/s from `nbytes` at the
    median GPU time, each peer's speed-up (its time over cuflash2's), and `info` as given."""
    seconds = gpu_benchmark.gpu_seconds()
    extra = gpu_benchmark.extra_info
    extra.update(info)
    if seconds is None:  # --benchmark-disable: nothing was timed
        return
    extra["gpu_ms"] = round(seconds * 1e3, 4)
    if flops is not None:
        extra["tflops"] = round(flops / seconds / 1e12, 1)
    if nbytes is not None:
        extra["gb_per_s"] = round(nbytes / seconds / 1e9, 1)
    # The peers' times in the units they come in: ms (attention), us (a decoding step), us a
    # layer (a decoding step in a graph, over LAYERS layers).
    ours = {"_ms": seconds * 1e3, "_us": seconds * 1e6}
    if info.get("layers"):
        ours["_us_per_layer"] = seconds * 1e6 / info["layers"]
    for key in ("sdpa_flash", "cudnn"):
        for unit, value in ours.items():
            if info.get(key + unit) is not None:
                extra[f"speedup_vs_{key}"] = round(info[key + unit] / value, 3)


@pytest.fixture(scope="session")
def record_result():
    """`record` (above) as a fixture, so the test modules need not import this conftest."""
    return record
