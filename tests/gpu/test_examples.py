"""The examples on tiny shapes, each in a fresh process: examples/train_gpt.py trains (its loss
falls; with torch, --compare-sdpa times torch SDPA in its place) and examples/jax_dlpack.py
agrees with jax.numpy (where JAX is installed)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
TINY_GPT = ["--layers", "2", "--heads", "2", "--dim", "128", "--seq-len", "128", "--batch", "4",
            "--vocab", "512", "--period", "64", "--symbols", "16", "--steps", "80",
            "--log-every", "10", "--lr", "3e-3", "--warmup-steps", "5"]


def _run(script, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.run([sys.executable, str(REPO / "examples" / script), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_train_gpt_loss_falls():
    result = _run("train_gpt.py", *TINY_GPT, "--compare-sdpa")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.]+)", result.stdout, re.M)]
    assert len(losses) >= 8, result.stdout
    # ln(512) = 6.2 at the start; the 16 symbols alone bring it under ln(16) = 2.8.
    assert losses[0] > 5.5 and losses[-1] < losses[0] - 2.5, result.stdout
    assert re.search(r"^cuflash2: [0-9.]+ ms/step over \d+ steps, \d+ tokens/s, [0-9.]+ model "
                     r"TFLOP/s", result.stdout, re.M), result.stdout
    if importlib.util.find_spec("torch") is not None:
        # The same model with torch SDPA's FlashAttention-2 backend in cuflash2's place.
        assert re.search(r"^torch SDPA \(FLASH_ATTENTION\): [0-9.]+ ms/step", result.stdout,
                         re.M), result.stdout


def test_jax_dlpack_agrees_with_jax_numpy():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("needs JAX")
    for dtype in ("bf16", "fp16"):
        result = _run("jax_dlpack.py", "--dtype", dtype, "--seq-len", "256")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "cuflash2 and jax.numpy agree" in result.stdout, result.stdout
