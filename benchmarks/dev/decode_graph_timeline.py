"""Development timeline of the in-graph decoding step (not a benchmark of record): where the
microseconds of a layer go when `bench --decode`'s step (cuflash2/bench_decode_graph.py) is
replayed as a CUDA graph.

The decode kernel's and the stand-in next-layer kernel's sources are patched (text
substitutions, as dev_decode_timeline.py) so that each CTA's first thread appends a record
(launch tag, CTA, point, %globaltimer) at each point below; the tag is the layer's cache
address (decode) or output address (next-layer kernel), so the layers' launches are told apart
even where they overlap. One replay after the L2 flush; per layer the points' min / median / max
over the CTAs, in microseconds from the step's first record.

    PYTHONPATH=. python3 benchmarks/dev/decode_graph_timeline.py [--rows 1x4096 1x16384]
        [--early 1 0]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy  # noqa: E402

from cuflash2 import _compile, _kvcache, bench, bench_decode_graph  # noqa: E402

_HEADER = r"""
__device__ unsigned long long cf2_records[4 * 65536];
__device__ unsigned int cf2_count;
#define CF2_STAMP(tag, point) if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    const unsigned i_ = atomicAdd(&cf2_count, 1u); \
    if (i_ < 65536u) { cf2_records[4 * i_] = (unsigned long long)(tag); \
        cf2_records[4 * i_ + 1] = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); \
        cf2_records[4 * i_ + 2] = (point); cf2_records[4 * i_ + 3] = t_; } }
"""

DECODE_POINTS = ("start", "cache length read", "early: previous kernel done (wait)",
                 "early: q and the first tiles landed",
                 "first tile computed from", "last tile computed", "partial written", "end")
# (anchor, replacement): each anchor occurs once in flash_decode.cu (checked).
_DECODE_STAMPS = (
    ("    const int tid = threadIdx.x;\n",
     "    const int tid = threadIdx.x;\n    CF2_STAMP(p.k_cache, 0)\n"),
    ("    const int seqlen_k = min(max(cache_len + p.seqlen_new, 0), p.capacity);\n",
     "    const int seqlen_k = min(max(cache_len + p.seqlen_new, 0), p.capacity);\n"
     "    if (cache_len != -123456789) { CF2_STAMP(p.k_cache, 1) }\n"),
    ("                if (!waited) wait_for_previous_grid();\n                waited = true;\n",
     "                if (!waited) wait_for_previous_grid();\n                waited = true;\n"
     "                CF2_STAMP(p.k_cache, 2)\n"),
    ("                cp_async_wait<0>();  // Q, and the tiles loaded before the wait\n",
     "                cp_async_wait<0>();  // Q, and the tiles loaded before the wait\n"
     "                CF2_STAMP(p.k_cache, 3)\n"),
    ("        const u32 k_smem = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;\n",
     "        if (i == 0) { CF2_STAMP(p.k_cache, 4) }\n"
     "        const u32 k_smem = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;\n"),
    ("    // Merge the warps' states: (m, l) in log2 units and O, through shared memory.\n",
     "    CF2_STAMP(p.k_cache, 5)\n"
     "    // Merge the warps' states: (m, l) in log2 units and O, through shared memory.\n"),
    ("    if (p.num_splits == 1) return;\n",
     "    CF2_STAMP(p.k_cache, 6)\n    if (p.num_splits == 1) return;\n"),
    ("                                                  store_chunk);\n        cluster_barrier();\n"
     "        return;\n",
     "                                                  store_chunk);\n        cluster_barrier();\n"
     "        CF2_STAMP(p.k_cache, 7)\n        return;\n"),
    ("split, rows, p.head_dim, tid, store_chunk);\n}",
     "split, rows, p.head_dim, tid, store_chunk);\n    CF2_STAMP(p.k_cache, 7)\n}"),
)
NEXT_POINTS = ("start", "previous kernel done (wait)", "end")
_NEXT_STAMPS = (
    ("    allow_dependent_launch();\n", "    CF2_STAMP(out, 0)\n    allow_dependent_launch();\n"),
    ("    wait_for_previous_grid();\n", "    wait_for_previous_grid();\n    CF2_STAMP(out, 1)\n"),
    ("        v[i] = out[(i + kv_elems) % out_elems];\n    }\n",
     "        v[i] = out[(i + kv_elems) % out_elems];\n    }\n    CF2_STAMP(out, 2)\n"),
)


def patched(filename: str, stamps) -> str:
    source = _compile.kernel_source(filename)
    for anchor, replacement in stamps:
        if source.count(anchor) != 1:
            raise SystemExit(f"anchor not found once in {filename}: {anchor.strip()!r}")
        source = source.replace(anchor, replacement)
    return _HEADER + source


class Recorder:
    """Compiles the patched kernels in place of the package's and reads their records."""

    def __init__(self):
        self.modules = []
        decode_source = patched("flash_decode.cu", _DECODE_STAMPS)
        original = _compile.get_kernel
        cache = {}

        def get_kernel(config, device_id):
            if "flash_decode_kernel" not in config.name_expression:
                return original(config, device_id)
            key = (config, device_id)
            if key not in cache:
                source = _compile.specialisation_source(config).replace(
                    _compile.kernel_source("flash_decode.cu"), decode_source)
                module = cupy.RawModule(code=source, options=_compile.NVRTC_OPTIONS
                                        + _compile.arch_options(config),
                                        name_expressions=[config.name_expression])
                fn = module.get_function(config.name_expression)
                if config.smem_bytes > 48 * 1024:
                    fn.max_dynamic_shared_size_bytes = config.smem_bytes
                cache[key] = fn
                self.modules.append(module)
            return cache[key]

        _compile.get_kernel = get_kernel
        next_module = cupy.RawModule(code=patched("next_layer_inputs.cu", _NEXT_STAMPS))
        self.modules.append(next_module)
        next_kernel = next_module.get_function("next_layer_inputs")
        bench_decode_graph.next_layer_kernel = lambda device_id: next_kernel

    def reset(self):
        for m in self.modules:
            cupy.ndarray((1,), cupy.uint32, m.get_global("cf2_count")).fill(0)

    def records(self) -> numpy.ndarray:
        out = []
        for m in self.modules:
            n = min(int(cupy.ndarray((1,), cupy.uint32, m.get_global("cf2_count")).get()[0]),
                    65536)
            out.append(cupy.ndarray((4 * 65536,), cupy.uint64,
                                    m.get_global("cf2_records")).get().reshape(-1, 4)[:n])
        return numpy.concatenate(out).astype(numpy.int64)


def summary(records, tag, points, t0, label) -> str:
    mine = records[records[:, 0] == tag]
    cells = []
    for i, name in enumerate(points):
        x = (mine[mine[:, 2] == i][:, 3] - t0) / 1e3
        if len(x):
            cells.append(f"{name} {x.min():.1f}/{numpy.median(x):.1f}/{x.max():.1f}")
    return f"  {label}: " + "; ".join(cells)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["1x4096", "1x16384"])
    ap.add_argument("--early", type=int, nargs="+", default=[1, 0])
    args = ap.parse_args()
    recorder = Recorder()
    backlog, flush = bench.Backlog(cupy), bench.l2_flush(cupy)
    nheads, nheads_kv = bench_decode_graph.GRAPH_HEADS
    for row in args.rows:
        batch, cache = (int(x) for x in row.split("x"))
        for early in args.early:
            _kvcache._plans_by_key.plans.clear()
            step = bench_decode_graph.DecodeStep(cupy, batch, cache, nheads, nheads_kv,
                                                 early_cache_reads=bool(early))
            ms = bench_decode_graph.time_step(cupy, step, 5, 20, backlog, flush)
            with step.stream:
                flush()
                recorder.reset()
                step.run()
            step.stream.synchronize()
            rec = recorder.records()
            t0 = rec[:, 3].min()
            print(f"\nb={batch} cache={cache} early={early}: {ms * 1e3 / 8:.2f} us/layer "
                  f"(with stamps); times min/median/max over CTAs, us from the first record")
            decode_tags = [int(kc.data.ptr) for kc, _ in step.caches]
            next_tags = [int(o.data.ptr) for o in step.outputs]
            for layer, (dtag, ntag) in enumerate(zip(decode_tags, next_tags)):
                print(summary(rec, dtag, DECODE_POINTS, t0, f"decode {layer}"))
                print(summary(rec, ntag, NEXT_POINTS, t0, f"next   {layer}"))
            del step


if __name__ == "__main__":
    main()
