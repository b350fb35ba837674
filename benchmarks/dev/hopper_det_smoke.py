"""Deterministic mode of the Hopper backward under the mbarrier/semaphore watchdog (a wrong
semaphore order traps after ~2 s instead of hanging): a few shapes, three runs bitwise equal,
and the 2x rule. On an H100/H200, from the repository root:

    python benchmarks/dev/hopper_det_smoke.py
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _configs, _dispatch, api, testing  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, causal, window): many key blocks adding
# to the same rows (GQA, 4k keys), rows that see no key, each kernel head dim (staged dQ up to
# 128, the consumers' ordered vector reductions above), and the orders window edges give (query
# blocks with fewer adders than key blocks; a left edge: adders that start past key block 0).
CASES = [(2, 1500, 4096, 8, 2, 128, True, (-1, -1)), (2, 1024, 1024, 4, 4, 128, False, (-1, -1)),
         (1, 700, 300, 4, 4, 64, True, (-1, -1)), (2, 333, 517, 4, 2, 96, False, (-1, -1)),
         # d=64's 128-row query blocks
         (2, 1500, 4096, 8, 2, 64, True, (-1, -1)), (1, 1000, 1000, 4, 4, 40, False, (-1, -1)),
         (1, 1300, 700, 4, 4, 128, True, (-1, -1)), (1, 900, 1300, 4, 2, 64, False, (-1, 100)),
         (2, 600, 1500, 4, 4, 128, False, (-1, 0)), (1, 2048, 2048, 4, 1, 64, False, (-1, 300)),
         (1, 900, 1300, 4, 2, 64, False, (200, 0)), (1, 1024, 2048, 4, 4, 128, False, (300, 300)),
         (1, 2048, 2048, 4, 1, 64, False, (0, 0)),
         (2, 1500, 4096, 8, 2, 256, True, (-1, -1)), (1, 1000, 1300, 4, 2, 192, False, (-1, -1)),
         (2, 700, 1500, 4, 2, 256, False, (256, -1)), (1, 1200, 900, 4, 4, 160, True, (-1, -1))]


def check(b, sq, sk, h, hk, d, causal, window) -> bool:
    bf16 = ml_dtypes.bfloat16
    q, k, v = testing.random_qkv(cupy, b, sq, sk, h, hk, d, bf16, seed=d + sq)
    dout = testing.random_qkv(cupy, b, sq, sq, h, h, d, bf16, seed=d + 1)[0]
    out, lse = cuflash2.attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    kernel_dim = min(x for x in _configs.SM90_BWD_HEAD_DIMS if x >= d)
    _dispatch.FORCED["bwd"] = dataclasses.replace(
        _dispatch.bwd_sm90_config("bfloat16", kernel_dim, deterministic=True), watchdog=True)
    api._backward_plans.plans.clear()
    try:
        runs = [cuflash2.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                            window_size=window, deterministic=True)
                for _ in range(3)]
        cupy.cuda.Device().synchronize()
    finally:
        del _dispatch.FORCED["bwd"]
        api._backward_plans.plans.clear()
    same = all(bool((a.view(cupy.uint16) == c.view(cupy.uint16)).all())
               for run in runs[1:] for a, c in zip(runs[0], run))
    results = testing.check_backward(dout, q, k, v, *runs[0], causal=causal, window_size=window)
    ok = same and all(r.ok for r in results)
    print(f"{'ok  ' if ok else 'FAIL'} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} causal={causal} "
          f"window={window}: bitwise {'same' if same else 'DIFFERENT'}; "
          + "; ".join(map(str, results)), flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(0 if all([check(*case) for case in CASES]) else 1)
