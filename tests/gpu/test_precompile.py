"""`cuflash2 precompile` on a GPU: the named specialisations compiled in parallel processes into
the cache directory given, which a later process then loads instead of compiling."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def test_precompile_fills_the_cache_a_later_process_uses(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = ["--dtype", "bf16", "--headdim", "64", "--directions", "fwd", "--jobs", "2",
            "--cache-dir", str(tmp_path)]
    listed = subprocess.run([sys.executable, "-m", "cuflash2", "precompile", *args, "--list"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    planned = [line for line in listed.stdout.splitlines() if line]
    result = subprocess.run([sys.executable, "-m", "cuflash2", "precompile", *args], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert f"{len(planned)} of {len(planned)} compiled" in result.stderr
    assert f"{len(planned)}/{len(planned)} kernels" in result.stderr
    cached = {p.name for p in tmp_path.iterdir() if p.name.endswith(".cubin")}
    assert cached
    # A later process with that cache adds nothing to it: what its call needs is there. (Its
    # input is made first: CuPy's own kernels, the random draw and the cast, go into the same
    # cache; only what the attention call adds counts.)
    call = ("import os, sys, cupy, ml_dtypes, cuflash2; "
            "q = cupy.random.standard_normal((1, 256, 2, 64), dtype=cupy.float32)"
            ".astype(ml_dtypes.bfloat16); cupy.cuda.Device().synchronize(); "
            "before = set(os.listdir(sys.argv[1])); cuflash2.attention(q, q, q); "
            "cupy.cuda.Device().synchronize(); "
            "print(sorted(set(os.listdir(sys.argv[1])) - before))")
    run = subprocess.run([sys.executable, "-c", call, str(tmp_path)], cwd=REPO,
                         env=dict(env, CUPY_CACHE_DIR=str(tmp_path)), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
