"""The FP8 forward's share of exponentials on the FP32 units (sm90/fwd_traits.cuh,
EXP2_FMA_OF_8: of every 8 n8 tiles of S, how many take exp2_on_fma instead of the MUFU's ex2),
timed per head dim: each share a tuning build of the dispatcher's configuration
(FwdSm90Config.tuning_options), forced for its rows (api._forced_config), every share of a row
in turn, the median of --rounds rounds. Each build is first checked against the references on
one odd-sized case.

    python benchmarks/dev/tune_fp8_forward.py [--shares 0 2 3 4] [--headdims 64 128 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _dispatch, api  # noqa: E402
from cuflash2.bench import timing  # noqa: E402
from fp8_forward_check import check, inputs, tflops  # noqa: E402


def build(d, share):
    config = _dispatch.e4m3_sm90_config("e4m3_bf16", d)
    return dataclasses.replace(config,
                               tuning_options=(f"-DCF2_E4M3_EXP2_FMA_OF_8={share}",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shares", type=int, nargs="+", default=[0, 2, 3, 4])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    backlog = timing.Backlog(cupy)
    for d in args.headdims:
        for share in args.shares:
            with api._forced_config(build(d, share)):
                ok = check(2, 300, 517, 4, 2, d, causal=True)
            print(f"d{d} share {share}/8: {'ok' if ok else 'WRONG'}", flush=True)
        for seqlen in args.seqlens:
            batch, nheads = max(1, args.tokens // seqlen), 2048 // d
            for causal in (False, True):
                a, s = inputs(batch, seqlen, seqlen, nheads, nheads, d, seed=1)
                times = {share: [] for share in args.shares}
                for r in range(args.rounds):
                    for share in args.shares[r % len(args.shares):] + args.shares[:r % len(args.shares)]:
                        with api._forced_config(build(d, share)):
                            times[share].append(timing.time_cupy(
                                cupy, lambda: cuflash2.attention(
                                    a["q"], a["k"], a["v"], qkv_dtype="e4m3",
                                    q_descale=s["q"], k_descale=s["k"], v_descale=s["v"],
                                    causal=causal), 3, args.iters, backlog))
                cells = ", ".join(
                    f"{share}/8 {statistics.median(t):.3f} ms "
                    f"{tflops(batch, seqlen, nheads, d, causal, statistics.median(t)):.0f}"
                    for share, t in times.items())
                print(f"d{d} b{batch} s{seqlen} h{nheads} causal={causal}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
