"""GPU test setup: every test in this folder is skipped unless CuPy sees a CUDA device."""

import pytest


def _cuda_device_count():
    try:
        import cupy
    except Exception:  # not installed, or installed without a usable CUDA runtime
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, or no device
        return 0


HAVE_GPU = _cuda_device_count() > 0


@pytest.fixture(autouse=True)
def _require_gpu():
    if not HAVE_GPU:
        pytest.skip("needs CuPy and a CUDA device")
