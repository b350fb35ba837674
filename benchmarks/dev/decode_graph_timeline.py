"""Development timeline of the in-graph decoding step (not a benchmark of record): where the
microseconds of a layer go when `bench --decode`'s step (cuflash2/bench/decode_graph.py) is
replayed as a CUDA graph.

The decode kernel's and the stand-in next-layer kernel's sources are patched (text
substitutions, as dev_decode_timeline.py) so that each CTA's first thread reads %globaltimer at
each point below into registers and writes them once, at its end, to the slot of (layer, CTA,
point): no atomics or loads between the points (an earlier version took a slot with an atomic
at every point, which made a step ~2 us slower). The layer is the index of the launch's tag (its
cache's address for the decode, its input's for the next-layer kernel) in a table written before
the replay. One replay after the L2 flush; per layer the points' min / median / max over the
CTAs, in microseconds from the step's first record, and the SM clock over the decode CTAs'
lifetimes (clock64 against %globaltimer); then, per layer, the decode's points' median / max
from the layer's wait (the previous kernel done), in the order they are reached.

--inside merge adds points inside the merge of the warps' states (m16 and rows on n), --inside
step points inside KV step 4 (its tile landed, its copies issued, S computed, the max updated,
P V issued). --who records each decode CTA's SM and prints which CTAs compute their last tile
late: per layer the latest ones with their SMs and how many CTAs of the layer and of the next
share those SMs, and per split the mean lateness of its points over the steady layers.

    PYTHONPATH=. python3 benchmarks/dev/decode_graph_timeline.py [--rows 1x4096 1x16384]
        [--early 1 0] [--cluster-tile WARPS STAGES [KEYS_PER_WARP]] [--src overlay_dir]
        [--inside merge|step | --who]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy  # noqa: E402

from cuflash2 import _compile, _kvcache  # noqa: E402
from cuflash2.bench import decode, decode_graph, timing  # noqa: E402

#: The records' shape (layer, CTA, slot), and the slots a CTA has: its points, then CLOCK_SLOTS.
LAYERS, MAX_CTAS, POINTS = 8, 4096, 20
#: Slots past the points: SM cycles and timer ns from a CTA's start to its end (the clock).
CLOCK_SLOTS = (POINTS - 2, POINTS - 1)
#: --who: the slot of a decode CTA's SM (SMID_BASE + %smid; the slot of --inside's last point).
SMID_SLOT, SMID_BASE = 17, 1000000

_HEADER = f"""
#define CF2_POINTS {POINTS}
#define CF2_LAYERS {LAYERS}
#define CF2_MAX_CTAS {MAX_CTAS}
#define CF2_SMID_BASE {SMID_BASE}ull
""" + r"""
// Stamps are kept in the first thread's registers and written once, at the CTA's end, to the
// slot of (layer, CTA, point): no atomics or loads on the way (the layer comes from cf2_tags,
// loaded at the start and compared at the end).
__device__ unsigned long long cf2_tags[CF2_LAYERS];
__device__ unsigned long long cf2_records[CF2_LAYERS * CF2_MAX_CTAS * CF2_POINTS];
#define CF2_BEGIN(tag) \
    unsigned long long cf2_t[CF2_POINTS], cf2_tag_v[CF2_LAYERS], cf2_clock0 = 0; \
    if (threadIdx.x == 0) { \
        _Pragma("unroll") for (int i_ = 0; i_ < CF2_POINTS; ++i_) cf2_t[i_] = 0ull; \
        cf2_clock0 = clock64(); \
        _Pragma("unroll") for (int i_ = 0; i_ < CF2_LAYERS; ++i_) \
            asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(cf2_tag_v[i_]) : "l"(cf2_tags + i_)); \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(cf2_t[0])); }
#define CF2_STAMP(tag, point) if (threadIdx.x == 0) { \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(cf2_t[point])); }
// (--who) The CTA's SM, as SMID_BASE + %smid in a slot of its own.
#define CF2_SMID(tag, point) if (threadIdx.x == 0) { unsigned smid_; \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid_)); cf2_t[point] = CF2_SMID_BASE + smid_; }
// The last two slots: the SM clock cycles and the timer's ns from the start to the flush.
#define CF2_FLUSH(tag) if (threadIdx.x == 0) { int layer_ = -1; \
    cf2_t[CF2_POINTS - 2] = clock64() - cf2_clock0; \
    { unsigned long long now_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_)); \
      cf2_t[CF2_POINTS - 1] = now_ - cf2_t[0]; } \
    _Pragma("unroll") for (int i_ = 0; i_ < CF2_LAYERS; ++i_) \
        if (cf2_tag_v[i_] == (unsigned long long)(tag)) layer_ = i_; \
    const unsigned cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); \
    if (layer_ >= 0 && cta_ < CF2_MAX_CTAS) { \
        _Pragma("unroll") for (int i_ = 0; i_ < CF2_POINTS; ++i_) \
            cf2_records[((unsigned long long)layer_ * CF2_MAX_CTAS + cta_) * CF2_POINTS + i_] = \
                cf2_t[i_]; } }
"""

DECODE_POINTS = ("start", "cache length read", "early: previous kernel done (wait)",
                 "early: q and the first tiles landed",
                 "first tile computed from", "last tile computed", "partial written",
                 "splits met", "merged", "end", "warps met", "step 0's copies landed (barrier)",
                 "second tile computed from")
#: Points 13-17 of --inside (_INSIDE_STAMPS).
INSIDE_POINTS = {
    "merge": ("rows' sums", "states written", "merge barrier", "weights", "O merged"),
    "step": ("step 4: tile landed", "step 4: copies issued", "step 4: S", "step 4: max",
             "step 4: P V issued"),
}
_WHO_STAMPS = (("    CF2_BEGIN(p.k_cache)\n",
                f"    CF2_BEGIN(p.k_cache)\n    CF2_SMID(p.k_cache, {SMID_SLOT})\n"),)
# (anchor, replacement): each anchor occurs once in flash_decode.cu (checked).
_DECODE_STAMPS = (
    ("    const int tid = threadIdx.x;\n",
     "    const int tid = threadIdx.x;\n    CF2_BEGIN(p.k_cache)\n"),
    ("    const int seqlen_k = min(max(cache_len + p.seqlen_new, 0), p.capacity);\n",
     "    const int seqlen_k = min(max(cache_len + p.seqlen_new, 0), p.capacity);\n"
     "    if (cache_len != -123456789) { CF2_STAMP(p.k_cache, 1) }\n"),
    ("                if (!waited) wait_for_previous_grid();\n                waited = true;\n",
     "                if (!waited) wait_for_previous_grid();\n                waited = true;\n"
     "                CF2_STAMP(p.k_cache, 2)\n"),
    ("        if (load_first) tile_landed();\n",
     "        if (load_first) tile_landed();\n"
     "        if (load_first) { CF2_STAMP(p.k_cache, 3) }\n"),
    ("            cp_async_wait<KV_STAGES - 2>();\n            __syncthreads();\n",
     "            cp_async_wait<KV_STAGES - 2>();\n            __syncthreads();\n"
     "            if (i == 0) { CF2_STAMP(p.k_cache, 11) }\n"),
    ("        const u32 k_smem = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;\n",
     "        if (i == 0) { CF2_STAMP(p.k_cache, 4) }\n        if (i == 1) { CF2_STAMP(p.k_cache, 12) }\n"
     "        const u32 k_smem = stage0 + (i % KV_STAGES) * T::STAGE_BYTES;\n"),
    ("    allow_dependent_launch();  // (a CTA without tiles",
     "    CF2_STAMP(p.k_cache, 5)\n    allow_dependent_launch();  // (a CTA without tiles"),
    ("    __syncthreads();  // every warp is done with the stages\n",
     "    __syncthreads();  // every warp is done with the stages\n    CF2_STAMP(p.k_cache, 10)\n"),
    ("    if (p.num_splits == 1) return;\n",
     "    CF2_STAMP(p.k_cache, 6)\n    if (p.num_splits == 1) { CF2_STAMP(p.k_cache, 9) "
     "CF2_FLUSH(p.k_cache) return; }\n"),
    ("            [&] { mbarrier_wait_cluster(inbox.bar, 0); });\n",
     "            [&] { mbarrier_wait_cluster(inbox.bar, 0); CF2_STAMP(p.k_cache, 7) });\n"),
    ("        return;  // (every peer's stores into this inbox have landed)\n",
     "        CF2_STAMP(p.k_cache, 8)\n        CF2_STAMP(p.k_cache, 9)\n        CF2_FLUSH(p.k_cache)\n"
     "        return;  // (every peer's stores into this inbox have landed)\n"),
    ("    const auto wait_for_splits = [&] { barrier.wait(); };\n",
     "    const auto wait_for_splits = [&] { barrier.wait(); CF2_STAMP(p.k_cache, 7) };\n"),
    ("tid, locate_output, wait_for_splits);\n}",
     "tid, locate_output, wait_for_splits);\n    CF2_STAMP(p.k_cache, 9)\n"
     "    CF2_FLUSH(p.k_cache)\n}"),
)
_INSIDE_STAMPS = {
    "merge": (
        ("        const float sums[2] = {softmax_n8.total_sum(0), softmax_n8.total_sum(1)};\n",
         "        const float sums[2] = {softmax_n8.total_sum(0), softmax_n8.total_sum(1)};\n"
         "        CF2_STAMP(p.k_cache, 13)\n"),
        ("    // Each row is merged by THREADS / BLOCK_M threads",
         "    CF2_STAMP(p.k_cache, 14)\n    // Each row is merged by THREADS / BLOCK_M threads"),
        ("    if (p.split_cluster) cluster_wait();  // every inbox of the cluster is open\n#endif\n",
         "    if (p.split_cluster) cluster_wait();  // every inbox of the cluster is open\n#endif\n"
         "    CF2_STAMP(p.k_cache, 15)\n"),
        ("        const bool seen = l > 0.f;\n",
         "        const bool seen = l > 0.f;\n        CF2_STAMP(p.k_cache, 16)\n"),
        ("        const float inv_l = seen ? 1.f / l : 0.f;\n",
         "        CF2_STAMP(p.k_cache, 17)\n        const float inv_l = seen ? 1.f / l : 0.f;\n"),
    ),
    "step": (
        ("        if (i >= 0 && !load_first) tile_landed();\n",
         "        if (i >= 0 && !load_first) tile_landed();\n"
         "        if (i == 4) { CF2_STAMP(p.k_cache, 13) }\n"),
        ("        cp_async_commit();\n        if (load_first) tile_landed();",
         "        cp_async_commit();\n        if (i == 4) { CF2_STAMP(p.k_cache, 14) }\n"
         "        if (load_first) tile_landed();"),
        ("            softcap.apply_softcap(acc_s);\n            // Element e of key tile kt:",
         "            softcap.apply_softcap(acc_s);\n            if (i == 4) { CF2_STAMP(p.k_cache, 15) }\n"
         "            // Element e of key tile kt:"),
        ("            softmax_n8.update_max(acc_s[0], acc_ot[0], p.scale_log2);\n",
         "            softmax_n8.update_max(acc_s[0], acc_ot[0], p.scale_log2);\n"
         "            if (i == 4) { CF2_STAMP(p.k_cache, 16) }\n"),
        ("                    mma_m16n8k16<Elem>(acc_ot[0][dt], a, b);\n                }\n            }\n",
         "                    mma_m16n8k16<Elem>(acc_ot[0][dt], a, b);\n                }\n            }\n"
         "            if (i == 4) { CF2_STAMP(p.k_cache, 17) }\n"),
    ),
}
NEXT_POINTS = ("start", "previous kernel done (wait)", "end")
_NEXT_STAMPS = (
    ("    allow_dependent_launch();\n",
     "    CF2_BEGIN(out)\n    allow_dependent_launch();\n"),
    ("    wait_for_previous_grid();\n", "    wait_for_previous_grid();\n    CF2_STAMP(out, 1)\n"),
    ("        v[i] = out[(i + kv_elems) % out_elems];\n    }\n",
     "        v[i] = out[(i + kv_elems) % out_elems];\n    }\n    CF2_STAMP(out, 2)\n"
     "    CF2_FLUSH(out)\n"),
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

    def __init__(self, inside=None, who=False):
        self.decode_modules = []
        decode_source = patched("flash_decode.cu", _INSIDE_STAMPS.get(inside, ()) + _DECODE_STAMPS
                                + (_WHO_STAMPS if who else ()))
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
                self.decode_modules.append(module)
            return cache[key]

        _compile.get_kernel = get_kernel
        self.next_module = cupy.RawModule(code=patched("next_layer_inputs.cu", _NEXT_STAMPS))
        next_kernel = self.next_module.get_function("next_layer_inputs")
        decode_graph.next_layer_kernel = lambda device_id: next_kernel

    @staticmethod
    def _array(module, name, dtype, count):
        return cupy.ndarray((count,), dtype, module.get_global(name))

    def reset(self, decode_tags, next_tags):
        """Clears the records and names the layers: the decode kernels' tags (their caches'
        addresses) and the next-layer kernels' (their inputs' addresses)."""
        for modules, tags in ((self.decode_modules, decode_tags), ([self.next_module], next_tags)):
            for m in modules:
                self._array(m, "cf2_records", cupy.uint64, LAYERS * MAX_CTAS * POINTS).fill(0)
                self._array(m, "cf2_tags", cupy.uint64, LAYERS)[...] = cupy.asarray(
                    numpy.array(tags, dtype=numpy.uint64))
        cupy.cuda.Device().synchronize()

    def records(self, modules) -> numpy.ndarray:
        """[layer, CTA, point] stamps in ns (0: not reached), summed over the modules."""
        total = numpy.zeros((LAYERS, MAX_CTAS, POINTS), dtype=numpy.int64)
        for m in modules:
            total += self._array(m, "cf2_records", cupy.uint64, LAYERS * MAX_CTAS * POINTS).get(
                ).astype(numpy.int64).reshape(LAYERS, MAX_CTAS, POINTS)
        return total



def summary(stamps, points, t0, label) -> str:
    """min / median / max over the CTAs of each point reached."""
    cells = []
    for i, name in enumerate(points):
        x = stamps[:, i]
        x = (x[x > 0] - t0) / 1e3
        if len(x):
            cells.append(f"{name} {x.min():.2f}/{numpy.median(x):.2f}/{x.max():.2f}")
    return f"  {label}: " + "; ".join(cells)


WAIT_POINT = DECODE_POINTS.index("early: previous kernel done (wait)")


def from_wait(stamps, points, label) -> str:
    """median / max over the CTAs of each point reached, us from the layer's wait (its median),
    in the order the points are reached."""
    waits = stamps[:, WAIT_POINT]
    if not (waits > 0).any():
        return f"  {label}: no wait recorded"
    # (In integer ns from the first wait: the timer's values as float64 are 256 ns apart.)
    first = waits[waits > 0].min()
    wait = numpy.median(waits[waits > 0] - first)
    cells = []
    for i, name in enumerate(points):
        x = stamps[:, i]
        x = (x[x > 0] - first - wait) / 1e3
        if len(x) and i != WAIT_POINT:
            cells.append((numpy.median(x), f"{name} {numpy.median(x):.2f}/{x.max():.2f}"))
    return f"  {label}: " + "; ".join(c for _, c in sorted(cells))


LAST_TILE = DECODE_POINTS.index("last tile computed")


def who(decode, grid, latest=8) -> str:
    """(--who) Which CTAs compute their last tile late, and whether they share their SM: per
    layer, the `latest` CTAs by their last tile (split x, KV head y, SM, us after the layer's
    median, the layer's CTAs and the next layer's on that SM), then the mean lateness by how many
    of the layer's own CTAs share the SM, and the mean lateness of each split's points. `grid`:
    the launch's (x, y, z); a CTA's record is its blockIdx.x + x (blockIdx.y + y blockIdx.z)."""
    grid_x, grid_y = grid[0], grid[1]
    lines = []
    by_share = {}
    for layer in range(LAYERS):
        rows = numpy.nonzero(decode[layer, :, 0] > 0)[0]
        last = decode[layer, rows, LAST_TILE]
        sms = decode[layer, rows, SMID_SLOT] - SMID_BASE
        if not len(rows) or (decode[layer, rows, SMID_SLOT] == 0).any():
            continue
        here = numpy.bincount(sms, minlength=1024)
        following = numpy.zeros(1024, dtype=numpy.int64)
        if layer + 1 < LAYERS:
            nxt = decode[layer + 1][decode[layer + 1, :, 0] > 0][:, SMID_SLOT] - SMID_BASE
            following = numpy.bincount(nxt, minlength=1024)
        last = last - last.min()  # (int ns: the timer's values as float64 are 256 ns apart)
        late = (last - numpy.median(last)) / 1e3
        for share in numpy.unique(here[sms]):
            by_share.setdefault(int(share), []).extend(late[here[sms] == share].tolist())
        order = numpy.argsort(-late)[:latest]
        cells = [f"x{rows[i] % grid_x} y{rows[i] // grid_x % grid_y} z{rows[i] // grid_x // grid_y} "
                 f"sm{sms[i]} +{late[i]:.2f} "
                 f"({here[sms[i]]}/{following[sms[i]]})" for i in order]
        lines.append(f"  decode {layer}: " + ", ".join(cells))
    # By split (x): the mean lateness of each point over the layers 1-6 (steady ones).
    steady = [layer for layer in range(1, LAYERS - 1) if (decode[layer, :, 0] > 0).any()]
    if steady:
        points = (DECODE_POINTS.index("early: q and the first tiles landed"),
                  DECODE_POINTS.index("first tile computed from"),
                  DECODE_POINTS.index("second tile computed from"), LAST_TILE,
                  DECODE_POINTS.index("partial written"))
        mean = {}
        for layer in steady:
            rows = numpy.nonzero(decode[layer, :, 0] > 0)[0]
            for p in points:
                x = decode[layer, rows, p]
                late = (x - x.min()) - numpy.median(x - x.min())
                for r, v in zip(rows, late):
                    mean.setdefault((p, r % grid_x), []).append(v / 1e3)
        splits = sorted({k[1] for k in mean})
        by_last = sorted(splits, key=lambda s: -numpy.mean(mean[(LAST_TILE, s)]))
        lines.append("  mean lateness (us after each layer's median, layers " +
                     f"{steady[0]}-{steady[-1]}) by split, latest last tiles first: point = " +
                     ", ".join(DECODE_POINTS[p] for p in points))
        for s in dict.fromkeys(by_last[:6] + by_last[-3:]):
            lines.append(f"    x{s}: " + " / ".join(f"{numpy.mean(mean[(p, s)]):+.2f}"
                                                   for p in points))
    lines.append("  lateness of the last tile (us after the layer's median) by the layer's CTAs "
                 "on the SM: " + "; ".join(
                     f"{k}: mean {numpy.mean(v):+.2f} over {len(v)}" for k, v in
                     sorted(by_share.items())))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["1x4096", "1x16384"])
    ap.add_argument("--early", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--cluster-tile", type=int, nargs="+", default=None,
                    metavar="WARPS STAGES [KEYS_PER_WARP]",
                    help="the clustered steps' tile instead of decode_cluster_config's")
    ap.add_argument("--src", type=Path, default=None,
                    help="an overlay folder of cuda_src files to time instead (as ab_sources)")
    ap.add_argument("--inside", choices=sorted(INSIDE_POINTS), default=None,
                    help="points inside the merge of the warps, or inside KV step 4")
    ap.add_argument("--who", action="store_true",
                    help="the CTAs whose last tile comes late, their SMs and SM sharing")
    args = ap.parse_args()
    if args.who and args.inside:
        raise SystemExit("--who uses the slot of --inside's last point")
    points = DECODE_POINTS + INSIDE_POINTS.get(args.inside, ())
    if args.cluster_tile:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from decode_graph_sweep import _override_tile
        _override_tile("decode_cluster_config", *args.cluster_tile)
    if args.src is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ab_sources import Sources
        sources = Sources(args.src)  # (kept: its folder lives as long as the object)
        sources.use("alt")
    recorder = Recorder(args.inside, args.who)
    backlog, flush = timing.Backlog(cupy), timing.l2_flush(cupy)
    nheads, nheads_kv = decode.GRAPH_HEADS
    for row in args.rows:
        batch, cache = (int(x) for x in row.split("x"))
        for early in args.early:
            _kvcache._plans_by_key.plans.clear()
            step = decode_graph.DecodeStep(cupy, batch, cache, nheads, nheads_kv,
                                           early_cache_reads=bool(early))
            decode_tags = [int(kc.data.ptr) for kc, _ in step.caches]
            next_tags = [int(o.data.ptr) for o in step.outputs]
            recorder.reset(decode_tags, next_tags)
            ms = decode_graph.time_step(cupy, step, 5, 20, backlog, flush)
            with step.stream:
                flush()
                step.run()
            step.stream.synchronize()
            decode = recorder.records(recorder.decode_modules)
            following = recorder.records([recorder.next_module])
            t0 = min(x[..., :len(names)][x[..., :len(names)] > 0].min()
                     for x, names in ((decode, DECODE_POINTS), (following, NEXT_POINTS)))
            print(f"\nb={batch} cache={cache} early={early}: {ms * 1e3 / 8:.2f} us/layer "
                  f"(with stamps); times min/median/max over CTAs, us from the first record")
            for layer in range(LAYERS):
                ctas = decode[layer][decode[layer, :, 0] > 0]
                print(summary(ctas, points, t0, f"decode {layer}"))
                cycles, ns = (ctas[:, i] for i in CLOCK_SLOTS)
                if len(ns) and (ns > 0).all():
                    print(f"  decode {layer} SM clock: median {numpy.median(cycles / ns):.2f} GHz"
                          f" over the CTAs' lifetimes")
                ctas = following[layer][following[layer, :, 0] > 0]
                print(summary(ctas, NEXT_POINTS, t0, f"next   {layer}"))
            print("median / max over the CTAs, us from the layer's wait:")
            for layer in range(LAYERS):
                ctas = decode[layer][decode[layer, :, 0] > 0]
                print(from_wait(ctas, points, f"decode {layer}"))
            if args.who:
                planned = next(iter(_kvcache._plans_by_key.plans.values()))
                print("the latest last tiles: CTA (x, y), SM, us after the median, "
                      "(the layer's CTAs / the next layer's on that SM):")
                print(who(decode, planned.plan.launches[0].grid))
            del step


if __name__ == "__main__":
    main()
