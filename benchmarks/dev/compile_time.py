"""Cold JIT compile time of one kernel specialisation and its warm (CuPy disk cache) load time.

Each measurement runs in a fresh process; the cold one in an empty CUPY_CACHE_DIR.
    python benchmarks/dev/compile_time.py [--dtype float16 --head-dim 128]
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import time, cupy, sys
sys.path.insert(0, {root!r})
from cuflash2 import _compile, _configs
cupy.cuda.Device(0).use()
arch = int(cupy.cuda.Device(0).compute_capability)
cfg = _dispatch.fwd_config({dtype!r}, {head_dim}, arch)
t = time.perf_counter()
_compile.get_kernel(cfg, 0)
print(f"{{cfg.name_expression}} sm_{{arch}}: {{(time.perf_counter() - t) * 1e3:.0f}} ms")
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    code = CHILD.format(root=str(ROOT), dtype=args.dtype, head_dim=args.head_dim)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CUPY_CACHE_DIR": cache}
        for label in ("cold compile", "warm load (disk cache)"):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout.strip()
            print(f"{label}: {out}")


if __name__ == "__main__":
    main()
