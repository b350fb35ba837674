"""Every dispatch decision of the planners, printed, for a broad grid of problems: no GPU needed.

    python benchmarks/dev/dispatch_dump.py > dispatch.txt [--quick]

Each problem is planned the way a first call of its signature is (`api._plan_forward`,
`api._plan_backward`, `_kvcache._plan`: the full check, then `_attention_plans.forward_plan` /
`backward_plan` or the KV-cache plan) on stand-in arrays and a stand-in CuPy, with fake device
facts: the compute capability and SM count come from the device id (DEVICES), the occupancy
from each kernel's shared memory, the cluster occupancy from a fixed rule, the TMA maps from a
stand-in encoder; nothing is compiled or launched. For each problem it prints each launch's
configuration (its dataclass, with describe()), grid and launch attributes, and the parameter
struct's fields as planned (the tensor maps left out), or the error the planner raises; then the
configuration lists the dispatcher enumerates (the builds the prewarm and compile tests take).

A change that should not change any choice (moving the dispatch code between modules, say) is
checked by running this before and after it: the two outputs must be byte-identical.

Problems: fp16 / bf16; head dims 32 to 256 (odd ones too: 40, 72, 160, 200); sm_80, 86, 89 and
90 (two SM counts on sm_90); no mask, causal, windows; softcap, ALiBi, sinks, dropout, all
score modifiers; varlen; deterministic backward; sequence lengths from 1 to 32k; batch and heads
with GQA / MQA; packed qkv; decode with contiguous and paged caches, new tokens or none, split
counts requested 0 / 1 / n, with and without launches with attributes (clusters, programmatic).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import types

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

#: device id -> (compute capability, SMs).
DEVICES = {0: (80, 108), 1: (86, 84), 2: (89, 128), 3: (90, 132), 4: (90, 78)}
_current = [0]


def _contiguous(shape, itemsize):
    strides, size = [], itemsize
    for dim in reversed(shape):
        strides.insert(0, size)
        size *= max(dim, 1)
    return tuple(strides)


class FakeArray:
    """A CuPy array stand-in over no memory (numpy's as_strided over one element): shapes,
    strides, views and addresses as CuPy's, any size."""

    def __init__(self, array, device=None):
        self.array = array
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype
        self.ndim, self.itemsize, self.size = array.ndim, array.itemsize, array.size
        device = _current[0] if device is None else device
        self.data = types.SimpleNamespace(ptr=array.ctypes.data, device_id=device)
        self.device = types.SimpleNamespace(id=device)

    def __getitem__(self, index):
        return FakeArray(self.array[index], self.device.id)


_root = numpy.zeros(64, numpy.uint8)  # 64 bytes: 16-byte aligned for any dtype used


def array(shape, dtype):
    dtype = numpy.dtype(dtype)
    base = _root.view(dtype)
    return FakeArray(numpy.lib.stride_tricks.as_strided(
        base, tuple(shape), _contiguous(shape, dtype.itemsize)))


def fake_cupy():
    cuda = types.SimpleNamespace(
        Device=lambda device=None: types.SimpleNamespace(id=_current[0]),
        runtime=types.SimpleNamespace(getDevice=lambda: _current[0]),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0x77))
    return types.SimpleNamespace(ndarray=FakeArray, cuda=cuda, int32=numpy.int32,
                                 asnumpy=lambda x: x.array)


def install():
    """The stand-ins: CuPy, the device facts, launches, the TMA encoder."""
    from cuflash2 import _hopper, _launch, _prepare

    sys.modules["cupy"] = fake_cupy()
    for device, (arch, _) in DEVICES.items():
        _prepare._arch_cache[device] = arch

    def kernel_launch(config, device_id, grid, cooperative=False, programmatic=False,
                      cluster=1):
        return types.SimpleNamespace(config=config, grid=tuple(int(g) for g in grid),
                                     cooperative=cooperative, programmatic=programmatic,
                                     cluster=cluster)

    def occupancy_slots(config, device_id):
        arch, sms = DEVICES[device_id]
        smem = {80: 164, 86: 100, 89: 100}.get(arch, 228) * 1024
        return sms * max(1, min(4, smem // (config.smem_bytes + 1024)))

    def cluster_fits(config, device_id, cluster, clusters=1):
        _, sms = DEVICES[device_id]
        most = 16 if config.smem_bytes <= 64 * 1024 else 8
        return cluster <= most and cluster * clusters <= sms

    def tensor_map_bytes(x, rows):
        words = numpy.zeros(16, numpy.uint64)
        words[0], words[1] = x.data.ptr, rows
        return words.tobytes()

    _launch.kernel_launch = kernel_launch
    _launch.occupancy_slots = occupancy_slots
    _launch.cluster_fits = cluster_fits
    # (the names before and after the dispatch moved to cuflash2/_dispatch.py, so that one
    # script compares the two)
    name = "bindings_available" if hasattr(_hopper, "bindings_available") else "_bindings_available"
    setattr(_hopper, name, lambda: True)
    _hopper.tensor_map_bytes = tensor_map_bytes


def _flat(record, prefix=""):
    """name=value of every field of a struct record but the tensor maps."""
    out = []
    for name in record.dtype.names:
        value = record[name]
        if name.endswith("_map"):
            continue
        if value.dtype.names:
            out += _flat(value, prefix + name + ".")
        else:
            out.append(f"{prefix}{name}={value.tolist()}")
    return out


def describe_plan(plan) -> list[str]:
    from cuflash2 import _configs

    lines = []
    for launch in plan.launches:
        lines.append(f"  launch {launch.config!r}")
        lines.append(f"    {_configs.describe(launch.config)}")
        lines.append(f"    grid={launch.grid} cooperative={launch.cooperative} "
                     f"programmatic={launch.programmatic} cluster={launch.cluster}")
    lines.append(f"  struct {plan.block.layout.name if hasattr(plan.block.layout, 'name') else ''}"
                 f" workspace={plan.workspace_bytes} outputs={plan.outputs} "
                 f"per_call={sorted(plan.per_call)} counters={len(plan.counter_slots)}")
    lines.append("  fields " + " ".join(_flat(plan.block.record[0])))
    return lines


def _run(title, fn):
    print(title)
    try:
        result = fn()
    except Exception as exc:  # the planner's refusal is part of its behaviour
        print(f"  error {type(exc).__name__}: {exc}")
        return
    if isinstance(result, tuple):  # KV cache: (KVCachePlan)
        result = result[0]
    if hasattr(result, "splits"):
        print(f"  splits={result.splits} groups={result.groups} "
              f"default_cache_len={result.default_cache_len} barrier={result.barrier}")
        result = result.plan
    for line in describe_plan(result):
        print(line)


# ---------------------------------------------------------------------------------------------
# The grid

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (32, 40, 64, 72, 96, 128, 160, 192, 200, 256)
#: (name, causal, window)
MASKS = (("full", False, (-1, -1)), ("causal", True, (-1, -1)), ("win256-0", False, (256, 0)),
         ("win128-128", False, (128, 128)), ("right64", False, (-1, 64)))
SEQLENS = ((1, 1), (1, 4096), (128, 128), (256, 256), (257, 300), (512, 512), (600, 600),
           (1024, 1024), (2048, 2048), (3000, 1500), (4096, 4096), (8192, 8192),
           (16384, 16384), (32768, 32768))
#: (batch, nheads, nheads_kv)
HEADS = ((1, 1, 1), (2, 16, 16), (4, 32, 8), (8, 64, 1), (16, 8, 8))
FEATURES = ("plain", "softcap", "alibi", "sinks", "dropout", "mods")


def _options(feature, causal, window, nheads, batch):
    from cuflash2._options import AttentionOptions

    softcap = 30.0 if feature in ("softcap", "mods") else 0.0
    alibi = array((nheads,), numpy.float32) if feature in ("alibi", "mods") else None
    if feature == "mods" and batch > 2:
        alibi = array((batch, nheads), numpy.float32)
    sinks = array((nheads,), numpy.float32) if feature in ("sinks", "mods") else None
    dropout = 0.1 if feature == "dropout" else 0.0
    return AttentionOptions(causal, None, window, softcap, alibi, sinks, dropout,
                            1 if dropout else None, 0)


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return numpy.float16


def forward_problem(device, dtype, d, mask, feature, seqlens, heads, layout="separate"):
    from cuflash2 import api

    _, causal, window = mask
    sq, sk = seqlens
    batch, h, hkv = heads
    dt = _dtype(dtype)
    options = _options(feature, causal, window, h, batch)
    if layout == "qkvpacked":
        qkv = array((batch, sq, 3, h, d), dt)
        inputs = (qkv, None, options.alibi_slopes, options.sinks)
        return api._plan_forward(api._QKVPACKED, inputs, options)
    q, k = array((batch, sq, h, d), dt), array((batch, sk, hkv, d), dt)
    if layout == "unbatched":
        q, k = array((sq, h, d), dt), array((sk, hkv, d), dt)
    inputs = (q, k, k, None, options.alibi_slopes, options.sinks)
    return api._plan_forward(api._ATTENTION, inputs, options)


def backward_problem(device, dtype, d, mask, feature, seqlens, heads, deterministic):
    from cuflash2 import api

    _, causal, window = mask
    sq, sk = seqlens
    batch, h, hkv = heads
    dt = _dtype(dtype)
    options = _options(feature, causal, window, h, batch)
    q, k = array((batch, sq, h, d), dt), array((batch, sk, hkv, d), dt)
    lse = array((batch, h, sq), numpy.float32)
    inputs = (q, q, k, k, q, lse, None, None, None, options.alibi_slopes, options.sinks, None)
    return api._plan_backward(api._BACKWARD, inputs, options, deterministic)


def varlen_problem(dtype, d, mask, feature, lengths, heads, backward, deterministic=False):
    from cuflash2 import api

    _, causal, window = mask
    batch, h, hkv = heads
    max_q, max_k, total_q, total_k = lengths
    dt = _dtype(dtype)
    options = _options(feature, causal, window, h, 1)
    q, k = array((total_q, h, d), dt), array((total_k, hkv, d), dt)
    cu = array((batch + 1,), numpy.int32)
    args = (cu, cu, max_q, max_k, False)
    if not backward:
        inputs = (q, k, k, None, options.alibi_slopes, options.sinks, cu, cu)
        return api._plan_forward(api._VARLEN, inputs, options, args)
    lse = array((h, total_q), numpy.float32)
    inputs = (q, q, k, k, q, lse, None, None, None, options.alibi_slopes, options.sinks, None,
              cu, cu)
    return api._plan_backward(api._VARLEN_BACKWARD, inputs, options, deterministic, args)


def decode_problem(dtype, d, seqlen_q, heads, capacity, paged, new, num_splits, feature,
                   causal, early):
    from cuflash2 import _kvcache

    batch, h, hkv = heads
    dt = _dtype(dtype)
    options = _options(feature if feature != "dropout" else "plain", causal, (-1, -1), h, batch)
    q = array((batch, seqlen_q, h, d), dt)
    block_table = None
    if paged:
        page = 256
        cache = array((batch * -(-capacity // page) + 3, page, hkv, d), dt)
        block_table = array((batch, -(-capacity // page)), numpy.int32)
    else:
        cache = array((batch, capacity, hkv, d), dt)
    k = array((batch, new, hkv, d), dt) if new else None
    lengths = array((batch,), numpy.int32)
    return _kvcache._plan(q, cache, cache, k, k, lengths, None, block_table, options,
                          num_splits, False, early, (None, None, None))  # a 16-bit cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small sample of the grid")
    args = parser.parse_args()
    install()
    from cuflash2 import _hopper, _launch

    try:
        from cuflash2 import _dispatch as choices
    except ImportError:  # before cuflash2/_dispatch.py
        from cuflash2 import _configs as choices

    count = 0

    def run(title, fn):
        nonlocal count
        count += 1
        _run(title, fn)

    step = 7 if args.quick else 1
    # The mma.sync families (sm_80/86/89): the tiles depend on the dtype, head dim, arch and
    # features; the masks and lengths only on the grids.
    for device in (0, 1, 2):
        _current[0] = device
        for dtype, d, feature, mask, seqlens in itertools.product(
                DTYPES, HEAD_DIMS, FEATURES, MASKS[:2], ((128, 128), (3000, 1500))):
            tag = f"dev{device} {dtype} d{d} {feature} {mask[0]} {seqlens}"
            run(f"fwd {tag}", lambda: forward_problem(device, dtype, d, mask, feature, seqlens,
                                                      (2, 16, 8)))
            for det in (False, True):
                run(f"bwd det={det} {tag}", lambda: backward_problem(
                    device, dtype, d, mask, feature, seqlens, (2, 16, 8), det))
    # sm_90: every axis.
    grid = list(itertools.product((3, 4), HEAD_DIMS, MASKS, FEATURES, SEQLENS, HEADS))
    for i, (device, d, mask, feature, seqlens, heads) in enumerate(grid):
        if i % step:
            continue
        _current[0] = device
        dtype = DTYPES[i % 2]
        tag = f"dev{device} {dtype} d{d} {feature} {mask[0]} {seqlens} {heads}"
        run(f"fwd {tag}", lambda: forward_problem(device, dtype, d, mask, feature, seqlens,
                                                  heads))
        det = bool(i // 2 % 2)
        run(f"bwd det={det} {tag}", lambda: backward_problem(device, dtype, d, mask, feature,
                                                             seqlens, heads, det))
    # sm_90 layouts: unbatched, packed qkv.
    for device, d, mask, seqlens, layout in itertools.product(
            (3,), HEAD_DIMS, MASKS[:2], SEQLENS[::3], ("unbatched", "qkvpacked")):
        _current[0] = device
        heads = (1, 16, 16)
        run(f"fwd {layout} dev{device} d{d} {mask[0]} {seqlens}", lambda: forward_problem(
            device, "bfloat16", d, mask, "plain", seqlens, heads, layout))
    # varlen, forward and backward, sm_80 and sm_90.
    for device, dtype, d, mask, feature, lengths, heads in itertools.product(
            (0, 3), DTYPES, HEAD_DIMS, MASKS[:3], ("plain", "mods", "dropout"),
            ((1, 1, 3, 3), (300, 200, 900, 700), (4096, 4096, 9000, 9000),
             (32768, 32768, 40000, 40000)), ((3, 8, 8), (3, 32, 4))):
        _current[0] = device
        tag = f"dev{device} {dtype} d{d} {feature} {mask[0]} {lengths} {heads}"
        run(f"varlen fwd {tag}", lambda: varlen_problem(dtype, d, mask, feature, lengths, heads,
                                                        False))
        for det in (False, True):
            run(f"varlen bwd det={det} {tag}", lambda: varlen_problem(
                dtype, d, mask, feature, lengths, heads, True, det))
    # decode: with and without launches with attributes (clusters, programmatic launches).
    extended = _launch.extended_available
    for ext in (True, False):
        _launch.extended_available = lambda ext=ext: ext
        decode = list(itertools.product(
            (0, 2, 3, 4), HEAD_DIMS, (1, 2, 8), ((1, 8, 8), (4, 32, 8), (32, 8, 1), (2, 64, 8)),
            (256, 4096, 32768, 131072), (False, True), (0, 1), (0, 1, 3, 16, 200),
            ("plain", "mods")))
        for i, (device, d, sq, heads, capacity, paged, new, splits, feature) in enumerate(
                decode):
            if i % (3 * step):
                continue
            _current[0] = device
            dtype = DTYPES[i % 2]
            causal = bool(i // 2 % 2)
            early = bool(i // 4 % 2)
            run(f"decode ext={ext} dev{device} {dtype} d{d} sq{sq} {heads} cap{capacity} "
                f"paged={paged} new={new} splits={splits} {feature} causal={causal} "
                f"early={early}", lambda: decode_problem(
                    dtype, d, sq, heads, capacity, paged, new, splits, feature, causal, early))
    _launch.extended_available = extended
    # The enumerations of every build the dispatcher can choose.
    print("enumerations")
    from cuflash2 import _configs

    for arch in _configs.CPU_TEST_ARCHS:
        for name in ("all_fwd_configs", "all_bwd_configs", "all_decode_configs"):
            for config in getattr(choices, name)(arch, _configs.ALL_FEATURES):
                print(f"  {name} {arch} {config!r}")
    for config in (choices.all_fwd_sm90_configs(_configs.SM90_FWD_FEATURES, persistent=True)
                   + choices.all_fwd_sm90_configs(_configs.SM90_FWD_VARLEN_FEATURES)):
        print(f"  all_fwd_sm90_configs {config!r}")
    for config in choices.all_bwd_sm90_configs(_configs.SM90_BWD_FEATURES
                                               + _configs.SM90_BWD_VARLEN_FEATURES):
        print(f"  all_bwd_sm90_configs {config!r}")
    hopper_configs = getattr(choices, "hopper_forward_configs", None) or _hopper.dispatch_configs
    for features in (_configs.SCORE_MOD_FEATURES, _configs.SM90_FWD_FEATURES,
                     _configs.SM90_FWD_VARLEN_FEATURES, (0,)):
        for config in hopper_configs(features):
            print(f"  dispatch_configs {features} {config!r}")
    print(f"problems {count}")


if __name__ == "__main__":
    main()
