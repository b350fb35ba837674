"""Development timeline of one decoding step on a GPU (not a benchmark of record): where the
microseconds of a batch-1 step go, CTA by CTA.

The decode kernel's source is patched (text substitutions, as dev_bwd_variants.py) so that each
CTA's first thread records %globaltimer at seven points: start, cache length read, first K/V
tile landed, last tile computed, output or partial result written, split barrier passed, end.
One step runs after the L2 flush of `bench --decode`; the table gives each point's min / median
/ max over the CTAs, in microseconds from the first CTA's start, after the step's CUDA-event
time.

    python benchmarks/dev/dev_decode_timeline.py [--caches 256 16384 65536] [--heads 32 4]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import _compile, _dispatch, api  # noqa: E402
from cuflash2.bench import timing  # noqa: E402

POINTS = ("start", "cache length read", "first tile landed", "last tile computed",
          "output (one split) or partial written", "split barrier passed", "end (share merged)")

_HEADER = r"""
__device__ unsigned long long cf2_timeline[8 * 16384];
#define CF2_STAMP(point) if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    cf2_timeline[8 * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) + (point)] = t_; }
"""

# (anchor, replacement): each anchor occurs once in flash_decode.cu (checked).
_STAMPS = (
    ("    const int tid = threadIdx.x;\n", "    const int tid = threadIdx.x;\n    CF2_STAMP(0)\n"),
    # Stamped in a branch on the value, so after the load has returned.
    ("    const int cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_len_all;\n",
     "    const int cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_len_all;\n"
     "    if (cache_len != -123456789) { CF2_STAMP(1) }\n"),
    ("        const u32 k_smem = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;\n",
     "        if (i == 0) { CF2_STAMP(2) }\n        const u32 k_smem = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;\n"),
    ("    // Merge the warps' states: (m, l) in log2 units and O, through shared memory.\n",
     "    CF2_STAMP(3)\n    // Merge the warps' states: (m, l) in log2 units and O, through shared memory.\n"),
    ("    if (p.num_splits == 1) return;\n", "    CF2_STAMP(4)\n    if (p.num_splits == 1) return;\n"),
    ("    const auto wait_for_splits = [&] { barrier.wait(); };\n",
     "    const auto wait_for_splits = [&] { barrier.wait(); CF2_STAMP(5) };\n"),
    ("tid, locate_output, wait_for_splits);\n}",
     "tid, locate_output, wait_for_splits);\n    CF2_STAMP(6)\n}"),
)


def timeline_source() -> str:
    source = _compile.kernel_source("flash_decode.cu")
    for anchor, replacement in _STAMPS:
        if source.count(anchor) != 1:
            raise SystemExit(f"anchor not found once in flash_decode.cu: {anchor.strip()!r}")
        source = source.replace(anchor, replacement)
    return _HEADER + source


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caches", nargs="+", type=int, default=[256, 16384, 65536])
    ap.add_argument("--heads", nargs=2, type=int, default=[32, 4], metavar=("NHEADS", "NHEADS_KV"))
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    nheads, nheads_kv = args.heads
    config = _dispatch.decode_config("float16", 128, api.device_arch(cupy.cuda.Device().id))
    module = cupy.RawModule(code=timeline_source(), options=_compile.NVRTC_OPTIONS,
                            name_expressions=[config.name_expression])
    kernel = module.get_function(config.name_expression)
    kernel.max_dynamic_shared_size_bytes = config.smem_bytes
    original = _compile.get_kernel
    _compile.get_kernel = lambda cfg, device: kernel if cfg == config else original(cfg, device)
    stamps = cupy.ndarray((8 * 16384,), cupy.uint64, module.get_global("cf2_timeline"))

    backlog, flush = timing.Backlog(cupy), timing.l2_flush(cupy)
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((args.batch, 1, nheads, 128), dtype=cupy.float32).astype(cupy.float16)
    for cache_len in args.caches:
        shape = (args.batch, cache_len, nheads_kv, 128)
        kc, vc = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
                  for _ in range(2))
        k1 = kc[:, :1].copy()
        lengths = cupy.full((args.batch,), cache_len - 1, dtype=cupy.int32)

        def step():
            return cuflash2.attention_with_kvcache(q, kc, vc, k=k1, v=k1, cache_seqlens=lengths,
                                                   causal=True)

        event_ms = timing.time_cupy(cupy, step, 3, 30, backlog, flush)
        stamps.fill(0)
        flush()
        step()
        cupy.cuda.Device().synchronize()
        t = stamps.reshape(-1, 8).get().astype(numpy.int64)
        t = t[t[:, 0] > 0]
        first = t[:, 0].min()
        print(f"\ncache {cache_len}, batch {args.batch}, heads {nheads}/{nheads_kv}: {len(t)} CTAs, "
              f"CUDA events {event_ms * 1e3:.1f} us")
        print("| point in the CTA | min us | median us | max us |")
        print("|---|---|---|---|")
        for i, name in enumerate(POINTS):
            x = t[:, i][t[:, i] > 0] - first  # points 5 and 6 exist only with splits
            if len(x):
                print(f"| {name} | {x.min() / 1e3:.1f} | {numpy.median(x) / 1e3:.1f} | "
                      f"{x.max() / 1e3:.1f} |")

if __name__ == "__main__":
    main()
