"""Host cost of each entry point under variants of the plan hit path, alternating in rounds.

    python benchmarks/dev/host_variants.py [--rounds 3] [--torch]

Variants: reused outputs (`_recycle`) on / off; the graph nodes' parameters set on every
call / only when the struct changed (`_launch._Executable.launch`); the capture check and the
graph launch through CuPy's runtime / through ctypes on libcuda. Each call is timed as
`bench --host` times it (back-to-back calls on tiny inputs) and queued behind a spinning kernel
(host time alone), on the same arrays every call and alternating between two sets of inputs
(so every call patches new addresses into its struct). Then the parts of a decoding call's hit
path, one by one. Uses private modules (`_plans`, `_launch`, `_recycle`, `_kvcache`, `api`).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))  # busy_stream

import cupy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _kvcache, _launch, _recycle, api  # noqa: E402
from cuflash2.bench import host  # noqa: E402
from cuflash2._options import AttentionOptions  # noqa: E402


def per_call_us(fn, calls=2000, repeats=5):
    return host._per_call_us(cupy, fn, calls, cupy.cuda.runtime.deviceSynchronize,
                             repeats=repeats)


def inputs(rng):
    q, k, v, dout = (rng.standard_normal((1, 128, 8, 64), dtype=cupy.float32)
                     .astype(cupy.float16) for _ in range(4))
    out, lse = cuflash2.attention(q, k, v, return_lse=True)
    q1 = rng.standard_normal((1, 1, 32, 128), dtype=cupy.float32).astype(cupy.float16)
    cache = rng.standard_normal((1, 512, 4, 128), dtype=cupy.float32).astype(cupy.float16)
    return dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, q1=q1, k_cache=cache,
                v_cache=cache.copy(), new=cache[:, :1].copy(),
                lengths=cupy.full((1,), 500, dtype=cupy.int32))


def calls_on(sets):
    """The entry points' calls, cycling through the input sets."""
    state = {"i": 0}

    def pick():
        state["i"] += 1
        return sets[state["i"] % len(sets)]

    def attention():
        x = pick()
        return cuflash2.attention(x["q"], x["k"], x["v"])

    def attention_lse():
        x = pick()
        return cuflash2.attention(x["q"], x["k"], x["v"], return_lse=True)

    def backward():
        x = pick()
        return cuflash2.attention_backward(x["dout"], x["q"], x["k"], x["v"], x["out"],
                                           x["lse"])

    def kvcache():
        x = pick()
        return cuflash2.attention_with_kvcache(x["q1"], x["k_cache"], x["v_cache"], k=x["new"],
                                               v=x["new"], cache_seqlens=x["lengths"])

    return {"attention": attention, "attention lse": attention_lse, "backward": backward,
            "kvcache": kvcache}


def all_plans():
    return ([p.plan for p in _kvcache._plans_by_key.plans.values()]
            + [*api._forward_plans.plans.values()] + [*api._backward_plans.plans.values()])


class _CtypesRuntime:
    """The capture check and graph launch through ctypes on libcuda (as before they went through
    CuPy's runtime), for comparison."""

    def __init__(self):
        import ctypes

        lib = _launch._libcuda
        self.is_capturing = lib.cuStreamIsCapturing
        self.is_capturing.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.launch = lib.cuGraphLaunch
        self.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.status = ctypes.c_int(0)
        self.status_address = ctypes.addressof(self.status)

    def streamIsCapturing(self, stream_ptr):  # noqa: N802 (CuPy's name)
        if self.is_capturing(stream_ptr, self.status_address) != 0:
            raise RuntimeError("cuStreamIsCapturing failed")
        return self.status.value != 0

    def graphLaunch(self, executable, stream_ptr):  # noqa: N802
        if self.launch(executable, stream_ptr) != 0:
            raise RuntimeError("cuGraphLaunch failed")


def queued_us(fn, calls=200, repeats=7):
    """Host microseconds per call of `calls` calls queued behind a spinning kernel (the GPU
    cannot set the pace; few enough calls that the driver's launch queue does not fill)."""
    import busy_stream

    best = float("inf")
    for _ in range(repeats):
        fn()
        cupy.cuda.runtime.deviceSynchronize()
        busy_stream.spin(calls * 40e-6)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        cupy.cuda.runtime.deviceSynchronize()
    return best / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="torch SDPA flash forward rows")
    args = parser.parse_args()
    host._raise_clocks(cupy)
    rng = cupy.random.default_rng(0)
    sets = [inputs(rng), inputs(rng)]
    same, alternating = calls_on(sets[:1]), calls_on(sets)
    for fn in [*same.values(), *alternating.values()]:
        fn()
    plans = all_plans()
    original_launch = _launch._Executable.launch
    runtime, ctypes_runtime = _launch.cuda_runtime(), _CtypesRuntime()

    def set_every_call(self, stream_ptr):
        self.set_from = None
        original_launch(self, stream_ptr)

    torch_row = None
    if args.torch:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from cuflash2.bench.torch_peers import TorchSdpaFlash

        wrap = TorchSdpaFlash(torch, cupy, "fp16")
        qt, kt, vt = (wrap.as_bhsd(sets[0][n]) for n in "qkv")
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def torch_flash(measure):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return measure(lambda: sdpa(qt, kt, vt))

        torch_row = torch_flash

    # (reused outputs, parameters set only when changed, CuPy's runtime for capture + launch)
    variants = {"before": (False, False, False), "all three": (True, True, True),
                "no reuse": (False, True, True), "set every call": (True, False, True),
                "ctypes": (True, True, False)}
    print("us per call; 'alt' rows alternate between two input sets", flush=True)
    for method, measure in (("back-to-back", per_call_us), ("queued", queued_us)):
        for r in range(args.rounds):
            for name, (recycle, skip, cython) in variants.items():
                for p in plans:
                    p.recycled = _recycle.OutputCache() if recycle else None
                _launch._Executable.launch = original_launch if skip else set_every_call
                _launch._cuda_runtime = runtime if cython else ctypes_runtime
                line = [f"{method} {r} {name:15s}"]
                for label, fn in same.items():
                    line.append(f"{label} {measure(fn):6.2f}")
                for label in ("backward", "kvcache"):
                    line.append(f"alt {label} {measure(alternating[label]):6.2f}")
                if torch_row is not None:
                    line.append(f"torch-flash {torch_row(measure):6.2f}")
                print("  ".join(line), flush=True)
    _launch._Executable.launch = original_launch
    _launch._cuda_runtime = runtime
    for p in plans:
        p.recycled = _recycle.OutputCache()

    # The parts of a decoding call's hit path.
    x = sets[0]
    key_args = (cupy, x["q1"], x["k_cache"], x["v_cache"], x["new"], x["new"], x["lengths"],
                None, None, AttentionOptions(), 0, False)
    key = _kvcache._key(*key_args)
    decode = _kvcache._plans_by_key.get(key)
    plan = decode.plan
    stream = cupy.cuda.get_current_stream().ptr
    run_inputs = (x["q1"], x["k_cache"], x["v_cache"], x["new"], x["new"], x["lengths"], None,
                  None, None, None)
    executable = plan.graphs.executable(stream) if plan.graphs is not None else None
    parts = {
        "whole call": same["kvcache"],
        "signature key": lambda: _kvcache._key(*key_args),
        "plan lookup (built key)": lambda: _kvcache._plans_by_key.get(key),
        "Plan.run": lambda: plan.run(run_inputs, cupy, {"cache_len_all": 0}, wrap=1,
                                     stream=stream),
        "Plan._read_inputs": lambda: plan._read_inputs(run_inputs),
        "Plan._allocate(1)": lambda: plan._allocate(cupy, 1),
        "OutputCache.take": lambda: plan.recycled.take(stream, 1),
        "stream_not_capturing (CuPy runtime)": lambda: _launch.stream_not_capturing(stream),
        "cuStreamIsCapturing (ctypes)": lambda: ctypes_runtime.streamIsCapturing(stream),
        "graph launch, struct unchanged": lambda: executable.launch(stream),
        "graphLaunch (CuPy runtime)": lambda: runtime.graphLaunch(executable.executable,
                                                                  stream),
        "cuGraphLaunch (ctypes)": lambda: ctypes_runtime.graphLaunch(executable.executable,
                                                                     stream),
        "struct tobytes": lambda: plan.block.bytes.tobytes(),
        "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "empty lambda": lambda: None,
    }
    for label, fn in parts.items():
        if executable is None and "raph" in label:
            continue
        print(f"{per_call_us(fn):7.2f} us back-to-back, {queued_us(fn):7.2f} queued  {label}",
              flush=True)


if __name__ == "__main__":
    main()
