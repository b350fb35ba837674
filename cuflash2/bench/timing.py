"""How the benchmarks time a call on the GPU: CUDA events around each call, the median of many,
with a spinning kernel queued first (`Backlog`) so that the calls queue behind it and the events
measure their GPU time, not the host's; an L2 flush to run untimed before a call, and the
device's copy bandwidth as a ceiling for memory-bound calls. Used by every table of
`python -m cuflash2 bench` and by the scripts in benchmarks/.
"""

from __future__ import annotations

import statistics

#: Bytes `l2_flush` reads: several times the size of an L2 cache.
L2_FLUSH_BYTES = 256 << 20


def spin_kernel(cupy):
    """cuda_src/gpu_spin.cu's kernel: spin((1,), (1,), (cupy.uint64(nanoseconds),))."""
    from .. import _compile

    return cupy.RawModule(code=_compile.kernel_source("gpu_spin.cu")).get_function(
        "gpu_spin_kernel")


def l2_flush(cupy):
    """A call that evicts the L2 cache by reading a buffer much larger than it (untimed, before
    each timed decode call): the smaller caches (from 32 MB) fit in the 50 MB L2, and a decode
    step after the other layers' steps reads its cache from HBM. Reading, not writing: evicting
    dirty lines would charge the timed call ~10 us of write-back that is not its own."""
    return cupy.zeros(L2_FLUSH_BYTES, dtype=cupy.uint8).max


class Backlog:
    """A spinning kernel queued before the timed calls, long enough to cover the host-side cost
    of launching all of them (up to HOST_US_PER_CALL each): the calls then queue while the GPU
    is busy, and the events around each one measure its GPU time, not the host's. Decode calls
    take only microseconds of GPU time, so without it they would time the Python layer."""

    HOST_US_PER_CALL = 400

    def __init__(self, cupy):
        self._spin = spin_kernel(cupy)
        self._cupy = cupy

    def queue(self, calls: int = 1):
        nanoseconds = self._cupy.uint64(calls * self.HOST_US_PER_CALL * 1000)
        self._spin((1,), (1,), (nanoseconds,))


def time_cupy(cupy, fn, warmup: int, iters: int, backlog: Backlog, before=None) -> float:
    """Median milliseconds of fn() on the current CuPy stream; `before()`, if given, runs
    before each call, untimed (and in the warm-up, so that its own first-call costs are paid
    there)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    backlog.queue(iters)
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events)


def time_torch(torch, fn, warmup: int, iters: int, backlog: Backlog) -> float:
    """Median milliseconds of fn() on torch's current stream, with torch's CUDA events."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    torch.cuda.synchronize()
    backlog.queue(iters)  # CuPy and torch both default to the legacy default stream
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def turning_order(names: list, r: int) -> list:
    """The contenders `names` in round r's order: from the r-th on, round the list, so that
    over the rounds each one follows each other (and meets the power state it leaves)."""
    return names[r % len(names):] + names[:r % len(names)]


def median_of_rounds(cupy, torch, calls: dict, rounds: int, warmup: int, iters: int,
                     backlog: Backlog, is_torch=lambda name: name.startswith("sdpa"),
                     on_error=None) -> dict:
    """Each of `calls` (name -> fn) timed `rounds` times (time_cupy, or time_torch for the
    names `is_torch` picks), the order turning round by round (round r starts at the r-th
    call), so that every contender meets each power state the others leave; the median of each
    one's rounds, in ms. A call that raises times nan in that round, after on_error(name, exc)."""
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in turning_order(list(calls), r):
            try:
                if is_torch(name):
                    times[name].append(time_torch(torch, calls[name], warmup, iters, backlog))
                else:
                    times[name].append(time_cupy(cupy, calls[name], warmup, iters, backlog))
            except Exception as exc:  # a backend that refuses (memory, shape)
                if on_error is not None:
                    on_error(name, exc)
                times[name].append(float("nan"))
    return {name: statistics.median(t) for name, t in times.items()}


def copy_ceiling(cupy, nbytes=1 << 30, iters=10) -> float:
    """Device copy bandwidth (bytes read + written per second) of a large buffer."""
    src = cupy.empty(nbytes // 2, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    backlog = Backlog(cupy)
    ms = time_cupy(cupy, lambda: dst.__setitem__(slice(None), src), 2, iters, backlog)
    return 2 * src.nbytes / ms * 1e3
