"""One backward row of the paper grid (d=128, 4k tokens, causal; fp16 and bf16) timed with the
GPU idle and right after seconds of heavy load (the non-causal backward of the same arrays),
cuflash2 with its gradients allocated by the call and given to it, and SDPA's cuDNN backend,
with the SM clock, power draw, temperature and active clock-throttle reasons (nvidia-smi)
before, between and after: whether a row's time in a long benchmark run is the kernel's or the
power state's (not a benchmark of record).

    PYTHONPATH=. python3 benchmarks/dev/power_state.py [--rounds 3] [--load-seconds 3]
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuflash2 import api  # noqa: E402
from cuflash2.bench import paper_grid, timing, torch_peers  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402


def gpu_state() -> str:
    query = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-seconds", type=float, default=3.0)
    args = ap.parse_args()
    torch = torch_peers.load_torch()
    backlog = timing.Backlog(cupy)
    print(f"state: idle (2 s asleep) or loaded ({args.load_seconds:g} s of the non-causal "
          "backward); ms: median of 20 calls; nvidia-smi: SM clock, power, temperature, "
          "throttle reasons (0x4: software power cap)", flush=True)
    for dtype_name in ("fp16", "bf16"):
        dtype = dtype_from_name(dtype_name)
        config = paper_grid.Config("bwd", dtype_name, 128, True, 4096, batch=4, nheads=16)
        q, k, v = paper_grid.random_inputs(cupy, config, dtype, 3)
        dout = cupy.random.default_rng(10_003).standard_normal(
            q.shape, dtype=cupy.float32).astype(dtype)
        out_causal, lse_causal = api.attention(q, k, v, causal=True, return_lse=True)
        out_full, lse_full = api.attention(q, k, v, causal=False, return_lse=True)
        dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))

        def allocated():
            api.attention_backward(dout, q, k, v, out_causal, lse_causal, causal=True)

        def given():
            api.attention_backward(dout, q, k, v, out_causal, lse_causal, causal=True,
                                   dq=dq, dk=dk, dv=dv)

        def load():
            api.attention_backward(dout, q, k, v, out_full, lse_full, causal=False,
                                   dq=dq, dk=dk, dv=dv)

        def cudnn_ms():
            row = paper_grid.Row(config)
            torch_peers.measure_cudnn(cupy, torch, row, q, k, v, dout, None, 3, 20, backlog)
            return row.cudnn_ms

        for round_ in range(args.rounds):
            for state in ("idle", "loaded"):
                if state == "idle":
                    cupy.cuda.Device().synchronize()
                    time.sleep(2.0)
                else:
                    start = time.time()
                    while time.time() - start < args.load_seconds:
                        for _ in range(20):
                            load()
                        cupy.cuda.Device().synchronize()
                before = gpu_state()
                allocated_ms = timing.time_cupy(cupy, allocated, 3, 20, backlog)
                between = gpu_state()
                given_ms = timing.time_cupy(cupy, given, 3, 20, backlog)
                cudnn = cudnn_ms()
                after = gpu_state()
                print(f"{dtype_name} round {round_} {state:6s} allocated {allocated_ms:.3f} "
                      f"given {given_ms:.3f} cuDNN {cudnn:.3f} | nvidia-smi before [{before}] "
                      f"between [{between}] after [{after}]", flush=True)


if __name__ == "__main__":
    main()
