"""First GPU run of the Hopper forward (cuda_src/flash_fwd_sm90.cu; docs/HOPPER_FWD.md).

On an H100/H200 (sm_90), from the repository root:

    python benchmarks/dev/hopper_fwd_check.py              # correctness, then timing
    python benchmarks/dev/hopper_fwd_check.py --watchdog   # debugging build: a stuck mbarrier
                                                           # wait traps after ~2 s, no hang
    python benchmarks/dev/hopper_fwd_check.py --no-time --schedule plain
    python benchmarks/dev/hopper_fwd_check.py --schedule all  # every schedule, also the overlap
    python benchmarks/dev/hopper_fwd_check.py --schedule all --persistent  # + persistent grid
    python benchmarks/dev/hopper_fwd_check.py --schedule overlap --persistent --no-check \
        --dims 64 128 --dtypes bfloat16 --seqlens 512 2048     # timing rows narrowed

Schedules (--schedule): plain (in order), pingpong, overlap (in order with the overlap inside a
warpgroup: FwdSm90Config.overlap), pingpong-overlap (both); `both` is plain + pingpong (the
default), `all` every one of them, `dispatched` plain + pingpong-overlap (the schedules of
three and two consumer warpgroups the dispatcher runs up to d=128).

1. Correctness: the kernel, in each selected schedule, through
   cuflash2._attention_plans.prepare_forward_sm90 (not the public API: it is not dispatched yet), on random inputs of a few shapes (head dims 64, 96, 128, 192, 256 on
   their own kernels, 160 on the d=192 one; fp16/bf16, causal on/off, a window, odd lengths,
   seqlen_q != seqlen_k both ways, GQA, MQA, q/k/v as strided views of a packed qkv, a one-token
   problem), outputs poisoned with NaN first, checked against cuflash2.reference with
   cuflash2.testing.check_forward (out and lse).
2. Timing: FA3's grid (16k tokens per batch, hidden 2048: heads = 2048 / d) at 1k, 4k and 16k
   tokens, fp16/bf16, d 64/96/128/192/256, causal on/off: a column per selected schedule next
   to cuflash2.attention on the mma.sync kernel (_dispatch.HOPPER_FORWARD off for it), the fastest
   schedule named and set against it.
With --persistent, each selected schedule also runs on the persistent grid
(FwdSm90Config.persistent, head dims 64, 96 and 128; others are skipped, saying so): correctness
on the same shapes plus PERSISTENT_CASES (many work tiles per CTA, tiles that see no key inside a
CTA's loop), once on the full grid (one CTA per SM) and once on PERSISTENT_SMALL_GRID CTAs (a
dozen or more work tiles each, on every shape); timing columns (`<schedule>-pers`) beside the
one-tile-per-CTA ones, 512 and 2048 tokens added to the default lengths (the short rows, where the
per-CTA fixed cost shows), and pers/best: the fastest one-tile-per-CTA schedule over the fastest
persistent one (above 1: the persistent grid is faster).
--no-check skips the correctness part; --dtypes, --dims and --seqlens narrow the timing rows.
--tiles BLOCK_NxSTAGES ... (e.g. 128x2 160x2; or BLOCK_MxBLOCK_NxSTAGES, 192x128x2: three
consumer warpgroups) runs each selected schedule with each of these K/V tiles instead of the head dim's own (_dispatch.SM90_FWD_TILES / SM90_PERSISTENT_TILES): a column
per tile, and the correctness shapes of the head dims of --dims (all when not given) once per
tile; a tile that does not fit shared memory at a head dim is skipped, saying so.
With --varlen, instead: varlen (FEATURE_VARLEN, opt-in through cuflash2._dispatch.HOPPER_FORWARD_VARLEN, which
this turns on) through the public cuflash2.attention_varlen on the ragged batches of
VARLEN_CASES (empty and one-token sequences, lengths off the tiles, GQA, causal, windows,
softcap + ALiBi), each selected schedule, against cuflash2.reference.attention_varlen, then
the time of a few ragged 16k-token batches against the mma.sync kernel (the flag off).

Internals it uses: cuflash2._hopper, cuflash2._dispatch.fwd_sm90_config.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy

# (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, dtype, causal, window, packed qkv)
CASES = [
    (2, 1024, 1024, 8, 8, 128, "bfloat16", False, (-1, -1), False),
    (2, 1024, 1024, 8, 8, 64, "float16", True, (-1, -1), False),
    (2, 1024, 1024, 8, 8, 128, "float16", True, (-1, -1), False),
    (2, 1024, 1024, 8, 8, 64, "bfloat16", False, (-1, -1), False),
    (1, 333, 517, 4, 4, 128, "float16", False, (-1, -1), False),
    (1, 517, 333, 4, 4, 64, "bfloat16", True, (-1, -1), False),  # rows that see no key
    (1, 333, 517, 4, 4, 128, "bfloat16", True, (-1, -1), False),
    (2, 1000, 1000, 8, 2, 128, "bfloat16", True, (-1, -1), False),  # GQA
    (1, 257, 257, 4, 1, 64, "float16", False, (-1, -1), False),  # MQA
    (1, 700, 900, 4, 4, 128, "bfloat16", False, (128, 64), False),  # window
    (1, 700, 900, 4, 4, 64, "float16", False, (200, -1), False),  # left edge only
    (1, 300, 300, 2, 2, 96, "float16", True, (-1, -1), False),  # the d=96 kernel
    (2, 1024, 1024, 8, 8, 96, "bfloat16", False, (-1, -1), False),
    (1, 333, 517, 4, 4, 96, "bfloat16", True, (-1, -1), False),
    (1, 517, 333, 4, 4, 96, "float16", False, (-1, -1), False),
    (2, 1024, 1024, 8, 8, 192, "float16", True, (-1, -1), False),
    (1, 333, 517, 4, 4, 192, "bfloat16", False, (-1, -1), False),
    (1, 517, 333, 4, 4, 192, "float16", True, (-1, -1), False),  # rows that see no key
    (1, 300, 300, 2, 2, 160, "bfloat16", False, (-1, -1), False),  # d=160 on the d=192 kernel
    (2, 1024, 1024, 8, 8, 256, "bfloat16", False, (-1, -1), False),
    (1, 333, 517, 4, 4, 256, "float16", True, (-1, -1), False),
    (1, 517, 333, 4, 4, 256, "bfloat16", False, (-1, -1), False),
    (2, 1000, 1000, 8, 2, 256, "float16", True, (-1, -1), False),  # GQA
    (2, 129, 129, 4, 4, 64, "bfloat16", True, (-1, -1), True),  # strided views of packed qkv
    (1, 1, 1, 1, 1, 64, "float16", False, (-1, -1), False),
]

#: --schedule name -> (pingpong, overlap) of FwdSm90Config.
SCHEDULES = {"plain": (False, False), "pingpong": (True, False), "overlap": (False, True),
             "pingpong-overlap": (True, True)}
#: The names --schedule takes for several schedules.
SCHEDULE_SETS = {"both": ("plain", "pingpong"), "all": tuple(SCHEDULES),
                 "dispatched": ("plain", "pingpong-overlap")}

#: With --persistent: shapes whose CTAs loop over many work tiles on 132 SMs (ring positions and
#: Q rounds carried from tile to tile), with tiles that see no key inside the loop.
PERSISTENT_CASES = [
    (4, 2048, 2048, 16, 16, 128, "bfloat16", True, (-1, -1), False),  # 1024 tiles, causal
    (8, 1037, 333, 8, 8, 64, "float16", True, (-1, -1), False),  # rows 0..703 see no key
    (4, 1500, 1700, 16, 4, 96, "bfloat16", False, (300, 100), False),  # GQA + window
    (3, 777, 777, 12, 12, 128, "float16", False, (-1, -1), False),  # ragged last m block
]
#: CTAs of the persistent grid's second correctness pass: few and odd, so that every CTA walks
#: many work tiles whatever the shape.
PERSISTENT_SMALL_GRID = 7

TIMING_SEQLENS = (1024, 4096, 16384)
PERSISTENT_TIMING_SEQLENS = (512, 1024, 2048, 4096, 16384)
TIMING_HEAD_DIMS = (64, 96, 128, 192, 256)
TOKENS = 16384

# --varlen: (sequence lengths q, lengths k (None: as q), heads, kv heads, head dim, dtype,
# options of attention_varlen)
VARLEN_CASES = [
    ([97, 1, 0, 300, 64, 129], None, 4, 4, 128, "bfloat16", {}),
    ([97, 1, 0, 300, 64, 129], None, 4, 4, 128, "float16", {"causal": True}),
    ([33, 250, 129, 1], [600, 17, 129, 5], 6, 2, 64, "bfloat16", {"causal": True}),
    ([513, 0, 1000], [777, 3, 1000], 8, 2, 96, "float16", {"window_size": (128, 0)}),
    ([200, 700, 5], None, 4, 1, 192, "bfloat16", {"causal": True, "softcap": 5.0}),
    ([1024, 77, 513], None, 4, 4, 256, "float16", {"alibi_slopes": True}),
    ([300, 1, 129], [1000, 1, 2], 2, 2, 80, "bfloat16", {}),  # head dim on the d=96 kernel
]
# --varlen timing: ragged lengths summing to 16k tokens, causal off / on
VARLEN_TIMING = [[4096, 1000, 3000, 512, 7776], [128] * 64 + [2048] * 4]
HIDDEN = 2048


def _dtype(name):
    import ml_dtypes

    return numpy.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else numpy.dtype(name)


def _inputs(cupy, case, seed):
    from cuflash2 import testing

    batch, sq, sk, h, hkv, d, dtype, _, _, packed = case
    if packed:
        rng = numpy.random.default_rng(seed)
        qkv = cupy.asarray(rng.standard_normal((batch, sq, 3, h, d), numpy.float32)
                           .astype(_dtype(dtype)))
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return testing.random_qkv(cupy, batch, sq, sk, h, hkv, d, _dtype(dtype), seed)


def _kernel_dim(head_dim):
    from cuflash2 import _dispatch  # (cuflash2 is imported inside the functions here)

    return _dispatch.hopper_forward_head_dim(head_dim)


def _has_persistent(head_dim):
    from cuflash2 import _dispatch

    return _kernel_dim(head_dim) in _dispatch.SM90_PERSISTENT_TILES


def _config(dtype, head_dim, schedule, watchdog=False, persistent=False, tile=None):
    """The kernel of `schedule` at `head_dim`; `tile` (block_n, stages[, block_m]) replaces the
    head dim's own. None where that tile does not fit shared memory."""
    from cuflash2 import _configs, _dispatch

    pingpong, overlap = SCHEDULES[schedule]
    config = _dispatch.fwd_sm90_config(dtype, _kernel_dim(head_dim), persistent=persistent)
    config = dataclasses.replace(config, pingpong=pingpong, overlap=overlap, watchdog=watchdog)
    if tile is None:
        return config
    try:
        config = dataclasses.replace(config, block_n=tile[0], stages=tile[1],
                                     block_m=tile[2] if len(tile) > 2 else config.block_m)
    except ValueError:
        return None  # a persistent grid whose O buffer no longer fits
    if config.pingpong and config.block_m != 128:
        return None  # ping-pong takes two consumer warpgroups
    return config if config.smem_bytes <= _configs.SM90_MAX_SMEM else None


def _tile_name(tile):
    if tile is None:
        return ""
    return f"@{tile[2]}x{tile[0]}x{tile[1]}" if len(tile) > 2 else f"@{tile[0]}x{tile[1]}"


def _parse_tile(text):
    """BLOCK_NxSTAGES, or BLOCK_MxBLOCK_NxSTAGES (block_m 192: three consumer warpgroups)."""
    numbers = [int(x) for x in text.lower().split("x")]
    if len(numbers) == 3:
        return numbers[1], numbers[2], numbers[0]
    block_n, stages = numbers
    return block_n, stages


def _variants(schedules, persistent, tiles=(None,)):
    """(schedule, persistent grid, CTA cap, tile) of every kernel variant the check runs."""
    grids = ((False, None), (True, None), (True, PERSISTENT_SMALL_GRID)) if persistent else (
        (False, None),)
    return [(name, grid, ctas, tile) for name in schedules for grid, ctas in grids
            for tile in tiles]


def _check_cases(persistent, dims):
    """The correctness shapes: CASES (and PERSISTENT_CASES), those of the kernel head dims
    `dims` only when given."""
    cases = CASES + (PERSISTENT_CASES if persistent else [])
    return [c for c in cases if not dims or _kernel_dim(c[5]) in dims]


def check(cupy, schedules, watchdog, persistent=False, tiles=(None,), dims=None):
    from cuflash2 import _attention_plans, _dispatch, testing

    failures = 0
    cases = _check_cases(persistent, dims)
    if persistent:
        skipped = sorted({_kernel_dim(c[5]) for c in cases if not _has_persistent(c[5])})
        print(f"persistent grid: head dims {tuple(_dispatch.SM90_PERSISTENT_TILES)}; shapes on the "
              f"d={skipped} kernels run on the one-tile-per-CTA grid only (no persistent "
              f"specialisation: its O buffer does not fit shared memory)", flush=True)
    width = max(len(name) for name in schedules)
    for (schedule, grid, ctas, tile), (i, case) in (
            (variant, c) for variant in _variants(schedules, persistent, tiles)
            for c in enumerate(cases)):
        batch, sq, sk, h, hkv, d, dtype, causal, window, packed = case
        if grid and not _has_persistent(d):
            continue
        kind = "" if not grid else f" persistent{f'({ctas} CTAs)' if ctas else ''}"
        label = (f"{schedule:{width}}{_tile_name(tile)}{kind} b{batch} sq{sq} sk{sk} h{h}/{hkv} "
                 f"d{d} {dtype} causal={int(causal)} window={window}{' packed' if packed else ''}")
        config = _config(dtype, d, schedule, watchdog, grid, tile)
        if config is None:
            print(f"skip  {label}: no such specialisation (shared memory, or ping-pong "
                  f"beside three consumers)", flush=True)
            continue
        q, k, v = _inputs(cupy, case, seed=i)
        prepared = _attention_plans.prepare_forward_sm90(
            q, k, v, causal=causal, window_size=window, config=config, persistent_ctas=ctas)
        prepared.out[...] = testing.poison_like(cupy, prepared.out.shape, prepared.out.dtype)
        prepared.lse.fill(math.nan)
        try:
            out, lse = prepared.run()
            cupy.cuda.Device().synchronize()
        except Exception as error:  # a fault leaves the context unusable: stop here
            print(f"FAIL  {label}: {type(error).__name__}: {error}", flush=True)
            return failures + 1
        results = testing.check_forward(q, k, v, out, lse, causal=causal, window_size=window)
        ok = all(r.ok for r in results)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'}  {label}: " + "; ".join(str(r) for r in results),
              flush=True)
    return failures


def add_timing_options(parser):
    """--dtypes, --dims, --seqlens: narrow the timing rows (hopper_bwd_check.py takes them too)."""
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"],
                        choices=("float16", "bfloat16"), help="timing rows: these dtypes")
    parser.add_argument("--dims", type=int, nargs="+", help="timing rows: these head dims")
    parser.add_argument("--seqlens", type=int, nargs="+", help="timing rows: these lengths")


def _time(cupy, fn, iters):
    for _ in range(3):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iters


def timing(cupy, schedules, iters, dtypes=("float16", "bfloat16"), dims=None, seqlens=None,
           persistent=False, tiles=(None,)):
    import cuflash2
    from cuflash2 import _attention_plans, _dispatch, api, testing

    # (title, schedule, persistent grid, tile) of each Hopper column, then mma.sync.
    grids = ((False, ""), (True, "-pers")) if persistent else ((False, ""),)
    columns = [(f"{name}{_tile_name(tile)}{suffix}", name, grid, tile) for name in schedules
               for tile in tiles for grid, suffix in grids]
    titles = [f"{title} ms" for title, _, _, _ in columns] + ["mma.sync ms"]
    widths = [max(9, len(t)) for t in titles]
    best_width = max(len(title) for title, _, grid, _ in columns if not grid)
    extra = f" {'pers/best':>9}" if persistent else ""
    print(f"\n{'dtype':9} {'d':>4} {'causal':>6} {'seqlen':>6} "
          + " ".join(f"{t:>{w}} {'TFLOP/s':>8}" for t, w in zip(titles, widths))
          + f" {'best/mma':>8} {'best':>{best_width}}{extra}")
    for dtype in dtypes:
        for d in dims or TIMING_HEAD_DIMS:
            for causal in (False, True):
                for seqlen in seqlens or (PERSISTENT_TIMING_SEQLENS if persistent
                                          else TIMING_SEQLENS):
                    batch, heads = TOKENS // seqlen, HIDDEN // d
                    q, k, v = testing.random_qkv(cupy, batch, seqlen, seqlen, heads, heads, d,
                                                 _dtype(dtype), seed=seqlen)
                    times = []
                    for _, name, grid, tile in columns:
                        config = None if grid and not _has_persistent(d) else _config(
                            dtype, d, name, persistent=grid, tile=tile)
                        if config is None:
                            times.append(None)  # no such specialisation at this head dim
                            continue
                        times.append(_time(cupy, _attention_plans.prepare_forward_sm90(
                            q, k, v, causal=causal, config=config).run, iters))
                    _dispatch.HOPPER_FORWARD = False  # the mma.sync kernel, planned afresh
                    api._forward_plans.plans.clear()
                    times.append(_time(cupy, lambda: cuflash2.attention(q, k, v, causal=causal),
                                       iters))
                    _dispatch.HOPPER_FORWARD = True
                    flop = 4.0 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                    row = " ".join(f"{t:>{w}.4f} {flop / t / 1e9:>8.1f}" if t is not None
                                   else f"{'-':>{w}} {'-':>8}" for t, w in zip(times, widths))
                    # the fastest one-tile-per-CTA schedule, named and set against mma.sync
                    best = min((i for i, (_, _, grid, _) in enumerate(columns)
                                if not grid and times[i] is not None), key=lambda i: times[i])
                    line = (f"{dtype:9} {d:>4} {int(causal):>6} {seqlen:>6} {row} "
                            f"{times[-1] / times[best]:>7.3f}x {columns[best][0]:>{best_width}}")
                    if persistent:
                        pers = [t for t, (_, _, grid, _) in zip(times, columns)
                                if grid and t is not None]
                        line += f" {times[best] / min(pers):>8.3f}x" if pers else f" {'-':>9}"
                    print(line, flush=True)


def _varlen_schedule(schedule, watchdog):
    """Context: varlen calls on the Hopper forward (_dispatch.HOPPER_FORWARD_VARLEN) in `schedule` (None: the
    mma.sync kernel), plan caches cleared on both sides."""
    import contextlib

    from cuflash2 import _dispatch, api

    @contextlib.contextmanager
    def scope():
        saved = _dispatch.HOPPER_FORWARD_VARLEN, _dispatch.hopper_forward_config

        def forced(*args, **kwargs):
            config = saved[1](*args, **kwargs)
            if config is None:
                return None
            pingpong, overlap = SCHEDULES[schedule]
            return dataclasses.replace(config, pingpong=pingpong, overlap=overlap,
                                       watchdog=watchdog)

        _dispatch.HOPPER_FORWARD_VARLEN = schedule is not None
        _dispatch.hopper_forward_config = forced
        api._forward_plans.plans.clear()
        try:
            yield
        finally:
            _dispatch.HOPPER_FORWARD_VARLEN, _dispatch.hopper_forward_config = saved
            api._forward_plans.plans.clear()

    return scope()


def _varlen_inputs(cupy, lengths_q, lengths_k, h, hkv, d, dtype, seed):
    rng = numpy.random.default_rng(seed)
    lengths_k = lengths_q if lengths_k is None else lengths_k
    dt = _dtype(dtype)
    q = cupy.asarray(rng.standard_normal((sum(lengths_q), h, d), numpy.float32).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((sum(lengths_k), hkv, d), numpy.float32).astype(dt))
            for _ in range(2))
    cu = [cupy.asarray(numpy.concatenate([[0], numpy.cumsum(x)]).astype(numpy.int32))
          for x in (lengths_q, lengths_k)]
    return q, k, v, (cu[0], cu[1], max(lengths_q), max(lengths_k))


def check_varlen(cupy, schedules, watchdog):
    import cuflash2
    from cuflash2 import reference, testing

    failures = 0
    for schedule in schedules:
        for i, (lq, lk, h, hkv, d, dtype, options) in enumerate(VARLEN_CASES):
            q, k, v, args = _varlen_inputs(cupy, lq, lk, h, hkv, d, dtype, seed=100 + i)
            options = dict(options)
            if options.get("alibi_slopes"):
                options["alibi_slopes"] = cupy.asarray(
                    numpy.linspace(0.05, 0.5, (len(lq)) * h, dtype=numpy.float32)
                    .reshape(len(lq), h))
            label = f"{schedule} varlen q{lq} k{lk or lq} h{h}/{hkv} d{d} {dtype} {options}"
            with _varlen_schedule(schedule, watchdog):
                (kernel,) = cuflash2.varlen_forward_kernels(q, k, v, *args, **options)
                out = testing.poison_like(cupy, q.shape, q.dtype)
                try:
                    out, lse = cuflash2.attention_varlen(q, k, v, *args, return_lse=True,
                                                         out=out, **options)
                    cupy.cuda.Device().synchronize()
                except Exception as error:  # a fault leaves the context unusable: stop here
                    print(f"FAIL  {label}: {type(error).__name__}: {error}", flush=True)
                    return failures + 1
            hi = reference.attention_varlen(q, k, v, *args, return_lse=True,
                                            compute_dtype=numpy.float32, **options)
            lo = reference.attention_varlen(q, k, v, *args, compute_dtype=q.dtype, **options)
            results = [testing.check_close("out", out, hi[0], lo), testing.lse_close(lse, hi[1])]
            ok = all(r.ok for r in results) and kernel.startswith("Hopper forward")
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'}  {label}: {kernel.split(',')[0]}; "
                  + "; ".join(str(r) for r in results), flush=True)
    return failures


def time_varlen(cupy, schedules, iters, dtypes, dims):
    import cuflash2

    print(f"\nvarlen timing (ms; ragged batches of {TOKENS} tokens, heads = {HIDDEN} / d)")
    print("| lengths | dtype | d | causal | mma.sync | " + " | ".join(schedules) + " |")
    print("|---|---|---|---|---|" + "---|" * len(schedules))
    for lengths in VARLEN_TIMING:
        for dtype in dtypes:
            for d in dims or (64, 128, 256):
                for causal in (False, True):
                    h = HIDDEN // d
                    q, k, v, args = _varlen_inputs(cupy, lengths, None, h, h, d, dtype, seed=7)
                    row = []
                    for schedule in (None, *schedules):
                        with _varlen_schedule(schedule, False):
                            row.append(_time(cupy, lambda: cuflash2.attention_varlen(
                                q, k, v, *args, causal=causal, check_cu_seqlens=False), iters))
                    short = f"{len(lengths)} seqs, max {max(lengths)}"
                    print(f"| {short} | {dtype} | {d} | {int(causal)} | "
                          + " | ".join(f"{t:.3f}" for t in row) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--watchdog", action="store_true",
                        help="debugging build: mbarrier waits trap after ~2 s (spills; not timed)")
    parser.add_argument("--no-time", action="store_true", help="correctness only")
    parser.add_argument("--schedule", choices=(*SCHEDULES, *SCHEDULE_SETS), default="both",
                        help="which consumer schedule(s) to check and time: one, `both` (plain "
                             "and pingpong) or `all` (also overlap and pingpong-overlap). A hang "
                             "on the ping-pong named barriers is not caught by --watchdog: try "
                             "plain alone first")
    parser.add_argument("--persistent", action="store_true",
                        help="also run each selected schedule on the persistent grid (head dims "
                             "64, 96, 128): correctness, timing columns, 512 and 2048 tokens")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-check", action="store_true", help="timing only")
    parser.add_argument("--tiles", nargs="+", type=_parse_tile,
                        help="K/V tiles BLOCK_NxSTAGES (or BLOCK_MxBLOCK_NxSTAGES) to run "
                             "instead of each head dim's own")
    add_timing_options(parser)
    parser.add_argument("--varlen", action="store_true",
                        help="varlen on the Hopper forward (turns _dispatch.HOPPER_FORWARD_VARLEN on): "
                             "VARLEN_CASES against the reference, then ragged timing rows")
    args = parser.parse_args()
    import cupy

    cc = cupy.cuda.Device().compute_capability
    if cc != "90":
        print(f"needs an sm_90 GPU (H100/H200); this one is sm_{cc}")
        return 2
    schedules = SCHEDULE_SETS.get(args.schedule, (args.schedule,))
    tiles = tuple(args.tiles) if args.tiles else (None,)
    failures = 0
    if args.varlen:
        if not args.no_check:
            failures = check_varlen(cupy, schedules, args.watchdog)
            print(f"\nvarlen correctness: "
                  f"{'all cases ok' if not failures else f'{failures} case(s) failed'} "
                  f"({len(VARLEN_CASES)} batches x {len(schedules)} schedule(s))")
        if not (failures or args.no_time or args.watchdog):
            time_varlen(cupy, schedules, args.iters, args.dtypes, args.dims)
        return 1 if failures else 0
    if not args.no_check:
        failures = check(cupy, schedules, args.watchdog, args.persistent, tiles, args.dims)
        shapes = len(_check_cases(args.persistent, args.dims))
        grids = (" x (one-tile-per-CTA, persistent, persistent on a small grid)"
                 if args.persistent else "")
        print(f"\ncorrectness: {'all cases ok' if not failures else f'{failures} case(s) failed'}"
              f" ({shapes} shapes{f' x {len(tiles)} tiles' if args.tiles else ''} x "
              f"{len(schedules)} schedule(s){grids})")
    if failures or args.no_time or args.watchdog:
        return 1 if failures else 0
    timing(cupy, schedules, args.iters, args.dtypes, args.dims, args.seqlens, args.persistent,
           tiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
