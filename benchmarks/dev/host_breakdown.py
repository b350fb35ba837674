"""Where the host time of a call goes: the parts of a plan hit timed one by one (one GPU).

    python benchmarks/dev/host_breakdown.py

Times, per call, on tiny inputs: the whole call; its signature key and plan lookup; Plan.run;
the output allocation; one kernel launch by each launch path (_launch.METHOD); the same for
the backward, with its plan's graph launch alone; and a cProfile listing of the whole call. Uses private modules (api, _plans, _launch).
"""

import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _kvcache, _launch, api  # noqa: E402
from cuflash2.bench import host  # noqa: E402
from cuflash2._options import AttentionOptions  # noqa: E402

CALLS = 2000


def per_call_us(fn, calls=CALLS):
    """Microseconds per call over `calls` back-to-back calls (bench --host's measurement)."""
    return host._per_call_us(cupy, fn, calls, cupy.cuda.runtime.deviceSynchronize,
                             repeats=3)


def main():
    spin = cupy.zeros(1 << 28, dtype=cupy.uint8)
    for _ in range(20):  # raise the GPU clocks before timing
        spin += 1
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 128, 8, 64), dtype=cupy.float32)
                     .astype(cupy.float16) for _ in range(4))
    buf = cupy.empty_like(q)
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    cuflash2.attention(q, k, v, out=buf)
    args = (q, k, v, buf, None, None)  # attention's input tuple: ..., alibi_slopes, sinks

    def key():
        return api._forward_key("attention", cupy, args, AttentionOptions())

    plan = api._forward_plans.get(key())
    stream = cupy.cuda.get_current_stream().ptr
    grads_in = (dout, q, k, v, out, lse, None, None, None, None, None, None)

    def backward_key():
        return api._backward_key("attention_backward", cupy, grads_in, AttentionOptions(),
                                 False)

    cuflash2.attention_backward(dout, q, k, v, out, lse)
    bplan = api._backward_plans.get(backward_key())
    launch = plan.launches[0]
    rows = {
        "attention(q, k, v)": lambda: cuflash2.attention(q, k, v),
        "attention(q, k, v, out=buf)": lambda: cuflash2.attention(q, k, v, out=buf),
        "attention(q, k, v, return_lse=True)": lambda: cuflash2.attention(q, k, v,
                                                                          return_lse=True),
        "attention_backward": lambda: cuflash2.attention_backward(dout, q, k, v, out, lse),
        "  signature key (forward)": key,
        "  key + plan lookup": lambda: api._forward_plans.get(key()),
        "  Plan.run (out given)": lambda: plan.run(args, cupy, None, wrap=0),
        "  Plan._allocate (lse, not wrapped)": lambda: plan._allocate(cupy, 0),
        "  Plan._allocate (lse wrapped)": lambda: plan._allocate(cupy, 1),
        "  cupy.cuda.get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "  backward signature key": backward_key,
        "  backward key + plan lookup": lambda: api._backward_plans.get(backward_key()),
        "  backward Plan.run": lambda: bplan.run(grads_in, cupy, None),
        "  backward Plan._allocate (3 gradients)": lambda: bplan._allocate(cupy, 3),
    }
    for label, some_plan in (("forward", plan), ("backward", bplan)):
        if some_plan.graphs is not None:
            rows[f"  {label} plan's graph launch alone"] = (
                lambda some_plan=some_plan: some_plan.graphs.executable(stream).launch(stream))
    default_method, default_handle = _launch.METHOD, launch.handle
    for method in ("libcuda", "bindings", "cupy"):
        if method == "bindings" and _launch._bindings is None:
            continue
        def one_launch(method=method):
            _launch._launch_once(launch, plan.block, stream, *launch.grid)
        _launch.METHOD = method
        handle = launch.function.kernel.ptr
        if method == "bindings":
            handle = _launch._bindings.CUfunction(handle)
        object.__setattr__(launch, "handle", handle)
        rows[f"  one launch, {method}"] = one_launch
        print(f"{per_call_us(one_launch):7.2f} us  one launch, {method}")
    _launch.METHOD = default_method
    object.__setattr__(launch, "handle", default_handle)
    q1 = rng.standard_normal((1, 1, 32, 128), dtype=cupy.float32).astype(cupy.float16)
    cache = rng.standard_normal((1, 512, 4, 128), dtype=cupy.float32).astype(cupy.float16)
    v_cache, new = cache.copy(), cache[:, :1].copy()
    lengths = cupy.full((1,), 500, dtype=cupy.int32)
    rows["attention_with_kvcache"] = lambda: cuflash2.attention_with_kvcache(
        q1, cache, v_cache, k=new, v=new, cache_seqlens=lengths)
    rows["attention_with_kvcache"]()
    decode = _kvcache._plans_by_key.get(_kvcache._key(
        cupy, q1, cache, v_cache, new, new, lengths, None, None, AttentionOptions(), 0, False))
    dlaunch = decode.plan.launches[0]
    print(f"decode plan: {decode.splits} splits, grid {dlaunch.grid}, cluster {dlaunch.cluster}, "
          f"programmatic {dlaunch.programmatic}, cooperative {dlaunch.cooperative}")
    if dlaunch.extended is None:  # (a launch with attributes has them in its config)
        for cooperative in (True, False):
            object.__setattr__(dlaunch, "cooperative", cooperative)
            us = per_call_us(lambda: _launch._launch_once(dlaunch, decode.plan.block, stream,
                                                           *dlaunch.grid))
            print(f"{us:7.2f} us  one decode launch, cooperative={cooperative}")
        object.__setattr__(dlaunch, "cooperative", True)
    else:
        us = per_call_us(lambda: _launch._launch_once(dlaunch, decode.plan.block, stream,
                                                       *dlaunch.grid))
        print(f"{us:7.2f} us  one decode launch through cuLaunchKernelEx")
    scalars = {"cache_len_all": 0}
    if decode.barrier:
        scalars["split_counters"] = _kvcache.split_counters(decode.groups, 0, stream, cupy)
    rows["  kvcache Plan.run"] = lambda: decode.plan.run(
        (q1, cache, v_cache, new, new, lengths, None, None, None, None), cupy, scalars, wrap=1)
    rows["  kvcache key"] = lambda: _kvcache._key(
        cupy, q1, cache, v_cache, new, new, lengths, None, None, AttentionOptions(), 0, False)
    for label, fn in rows.items():
        if "one launch" in label:
            continue
        print(f"{per_call_us(fn):7.2f} us  {label}")
    for label in ("attention(q, k, v)", "attention_backward", "attention_with_kvcache"):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(CALLS):
            rows[label]()
        profiler.disable()
        cupy.cuda.runtime.deviceSynchronize()
        print(f"\n--- cProfile of {label} ({CALLS} calls)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
