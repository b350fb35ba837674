"""Host side of the Hopper backward (cuda_src/flash_bwd_sm90.cu, docs/HOPPER_BWD.md).

Dispatched: `cuflash2.attention_backward` (and the packed and varlen backwards) on sm_90 run the
Hopper main kernel for every call `backward_config` covers, `deterministic=True` included (dQ
added in key-block order); for the calls it refuses (dropout), with CUFLASH2_HOPPER_BWD=0, and
for varlen calls with CUFLASH2_HOPPER_BWD_VARLEN=0, the mma.sync backward runs.

A call is three launches on the current stream (`_attention_plans.backward_plan` builds them,
for the dispatcher and for `_attention_plans.prepare_backward_sm90` alike):

1. the existing preprocess (flash_bwd_preprocess.cu): D = rowsum(dO o O), lse in log2 units,
   both padded to whole 128-row blocks (+inf / 0), and the fp32 dQ accumulator zeroed (and in
   deterministic mode the dQ semaphores, a slot per 4 rows);
2. the Hopper main kernel: dK, dV of each 128-key block, dQ added to the accumulator (above
   d=128 a key block's columns split over two CTAs, `BwdSm90Config.num_chunks`);
3. the existing conversion (flash_bwd_convert_dq.cu): dQ = softmax_scale * accumulator.

The main kernel takes `BwdSm90Params`: four tensor maps (q and dout with boxes of block_m rows,
k and v of block_n rows; `backward_maps`), then the `BwdParams` of the mma.sync path as `base`.
The preprocess and the conversion take that `base` itself (a view of the same bytes,
`_params.ParamBlock.nested`), so one set of field values serves the three launches. The maps are
encoded once per plan and their address words patched per call, as the forward's
(`_hopper.encode_map`).
"""

from __future__ import annotations

import os

from . import _configs
from ._hopper import describable, plannable

#: The dispatcher runs the Hopper backward wherever it covers a call on sm_90 (1.23-1.81x the
#: mma.sync backward on the H200 at every head dim: docs/PERF_NOTES.md); CUFLASH2_HOPPER_BWD=0
#: keeps the mma.sync backward, as CUFLASH2_HOPPER=0 for the forward (read when a call signature
#: is planned; tests flip `ENABLED` and clear the plan caches).
ENABLED = os.environ.get("CUFLASH2_HOPPER_BWD", "1") != "0"

#: Varlen calls (`attention_varlen_backward`) run on the Hopper backward too (FEATURE_VARLEN:
#: the maps cover the packed arrays with a batch extent of 1, each CTA adds its sequence's first
#: row, as the Hopper forward's varlen); CUFLASH2_HOPPER_BWD_VARLEN=0 keeps them on mma.sync.
VARLEN = os.environ.get("CUFLASH2_HOPPER_BWD_VARLEN", "1") != "0"

#: The features the Hopper backward compiles in (dropout: the mma.sync backward).
COVERED_FEATURES = _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI | _configs.FEATURE_VARLEN


def kernel_head_dim(head_dim: int) -> int:
    """The smallest Hopper backward head dim that holds `head_dim` (the TMA zero-fills the
    columns up to it)."""
    for d in _configs.SM90_BWD_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"the Hopper backward takes head dims up to "
                     f"{max(_configs.SM90_BWD_HEAD_DIMS)}, not {head_dim}")


#: The main kernel's dispatch order (flash_bwd_sm90.cu, cta_work). Under a causal mask a key
#: block's work falls with its index (key block 0 sees every query block), and the grid's own
#: order, pair by pair of (KV head, batch), starts the last pair's longest CTA last, a tail that
#: runs alone. Taking groups of pairs key-block-major (every pair's key block 0, then key block
#: 1, ...) starts the long CTAs first; a group is about DISPATCH_GROUP_CTAS CTAs (two waves of
#: the H200's 132 SMs), so that its pairs' Q / dO tiles are still in L2 for its later key blocks.
#: Measured on the H200 against the grid's order, alternating on the same arrays
#: (benchmarks/results/2026-12-03-h200-hopper-bwd-dispatch-order.txt), causal rows: d=128
#: 1.03-1.09x at 2k-8k tokens, d=64 1.01-1.03x at 4k-8k, d=256 1.04x at 4k; with groups of two
#: pairs (d=256 8k, 16k at d<=128) 0.98-1.01x, about the spread between rounds (the same code,
#: d=256 16k's group of one, measured 0.99x). At 512 tokens (4 key blocks) 2-6% slower, causal
#: or not, at 1k up to 3%, and without a mask level from 2k. So: grouped under a causal mask from
#: DISPATCH_MIN_KEY_BLOCKS key blocks on.
DISPATCH_GROUP_CTAS = 256
DISPATCH_MIN_KEY_BLOCKS = 16


def dispatch_group_pairs(key_blocks: int, chunks: int, window, deterministic: bool) -> int:
    """BwdSm90Params.dispatch_group_pairs: (KV head, batch) pairs the main kernel takes
    key-block-major together, 1 for the grid's own order. `window` is the kernels' (left,
    right): a right edge with no left one is the causal mask's shape (the low key blocks the
    long ones). Deterministic mode has an order of its own (the kernel ignores this)."""
    left, right = window
    if deterministic or not (right >= 0 > left) or key_blocks < DISPATCH_MIN_KEY_BLOCKS:
        return 1
    return max(1, DISPATCH_GROUP_CTAS // (key_blocks * chunks))


def backward_maps(config) -> dict:
    """The tensor maps of BwdSm90Params: map field -> (the array's view name, box rows)."""
    return {"q_map": ("q", config.block_m), "k_map": ("k", config.block_n),
            "v_map": ("v", config.block_n), "do_map": ("dout", config.block_m)}


def backward_config(problem, features: int, arch: int, views: dict, varlen=None,
                    deterministic: bool = False):
    """The Hopper backward's configuration for a checked call, or None where the call stays on
    the mma.sync backward: switched off (ENABLED; varlen: VARLEN), not sm_90, dropout, a head
    dim beyond the Hopper kernels', an empty problem, no driver bindings to encode the maps, or
    q, k, v, dout the TMA cannot describe. Sinks (FEATURE_SINKS) take the kernel of the call
    without them (_configs.backward_features)."""
    p = problem
    if not ENABLED or arch != 90 or (varlen is not None and not VARLEN):
        return None
    features = _configs.backward_features(features)
    if features & ~COVERED_FEATURES:
        return None
    if not plannable(p, _configs.SM90_BWD_HEAD_DIMS):
        return None
    kernel_dim = kernel_head_dim(p.head_dim)
    config = _configs.bwd_sm90_config(p.dtype, kernel_dim, deterministic, features)
    return config if describable(views, backward_maps(config)) else None
