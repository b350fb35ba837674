"""One call each of a mask modifier with its block mask and of the built-in mask it equals, for
Nsight Compute (mods_ab.py's causal window 1024 or causal, 1 x 16 heads x 16k, d=128, bf16):
forward, then backward, the mask modifier's first; each twice, the first compiling. E.g. the
stall reasons of both forwards (dev_ncu_stalls.sh's metrics):

    ncu --clock-control none --kernel-name regex:flash_fwd_sm90 --metrics ... \\
        python benchmarks/dev/mods_ncu_one.py [window|causal] [fwd|bwd|both]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from mods_ab import D, SEQ, inputs, masks  # noqa: E402


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "window"
    direction = sys.argv[2] if len(sys.argv) > 2 else "both"
    name = {"window": "causal window 1024", "causal": "causal"}[which]
    dtype, q, k, v, dout, doc = arrays = inputs()
    mm, builtin = masks(cuflash2, doc)[name]
    bm = cuflash2.block_mask(mm, 1, 1, SEQ, SEQ, head_dim=D, dtype=dtype)
    for kwargs in (dict(mask_mod=mm, block_mask=bm), builtin):
        for _ in range(2):
            out, lse = cuflash2.attention(q, k, v, return_lse=True, **kwargs)
            if direction in ("bwd", "both"):
                cuflash2.attention_backward(dout, q, k, v, out, lse,
                                            **{k_: a for k_, a in kwargs.items()
                                               if k_ != "mask_mod"})
    cupy.cuda.runtime.deviceSynchronize()
    del arrays
    return 0


if __name__ == "__main__":
    sys.exit(main())
