"""compute-sanitizer memcheck, racecheck and synccheck over small shapes of every kernel (GPU
only)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

WORKLOAD = Path(__file__).with_name("sanitizer_workload.py")


def _sanitize(tool: str, *workload_args: str) -> None:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer is not on the PATH")
    # API errors are not reported: cuda.bindings resolves the driver's entry points with
    # cuGetProcAddress, which answers "invalid value" for the ones this driver lacks. Memory
    # errors and hazards in kernels are what these tools check here; a failed launch raises in
    # the workload, which then never prints its last line.
    cmd = [exe, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
           sys.executable, str(WORKLOAD), *workload_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    report = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, report
    assert "sanitizer workload done" in proc.stdout, report
    # memcheck ends with "ERROR SUMMARY: 0 errors", racecheck with
    # "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)".
    summary = proc.stdout + proc.stderr
    assert "ERROR SUMMARY: 0 errors" in summary or "0 hazards displayed (0 errors, 0 warnings)" in summary, report


def test_memcheck_clean():
    _sanitize("memcheck")


def test_racecheck_clean():
    _sanitize("racecheck", "--quick")


def test_synccheck_clean():
    """Barriers (__syncthreads, named barriers of the Hopper kernel's warpgroups) reached by the
    threads they expect."""
    _sanitize("synccheck", "--quick")
