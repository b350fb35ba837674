"""What a cold instruction fetch costs on this GPU (a development probe, not a benchmark of
record; docs/DECODE_DESIGN.md, "What is left": code that a decoding step runs once, such as its
merge, seemed to wait on instruction fetches).

One kernel runs a block of straight-line code (--fmas fused multiply-adds with distinct
constants over four accumulators, one 16-byte FFMA each) twice in a loop, one CTA of one
warp an SM: the first pass fetches the block's code, the second finds it in the SM's
instruction caches, so their difference over the block's 128-byte lines is what a line fetch
costs beyond the arithmetic. It is launched four times: after an L2 flush (the code comes from
device memory), again right away (whether an SM keeps the code from one launch to the next, or
only L2 does), after a small kernel of another module (whether one kernel between two launches,
as between two decoding steps, empties the SM's instruction caches), and after another flush
with --stream MB read by a kernel in between. Prints per launch the median over the CTAs of
both passes' SM cycles and the cost of a line.

    PYTHONPATH=. python3 benchmarks/dev/icache_probe.py [--fmas 2048] [--stream 64]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy  # noqa: E402

from cuflash2.bench import timing  # noqa: E402


def probe_source(fmas: int) -> str:
    body = "\n".join(
        f"        acc[{i % 4}] = fmaf(acc[{i % 4}], {1.0 + (i + 1) * 1e-7:.9f}f, "
        f"acc[{(i + 1) % 4}]);" for i in range(fmas))  # one immediate: one 16-byte FFMA each
    return r"""
extern "C" __global__ void icache_probe(long long* cycles, float* sink) {
    float acc[4] = {threadIdx.x * 1.f, 1.f, 2.f, 3.f};
    const long long start = clock64();
    long long between = 0;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
""" + body + r"""
        if (pass == 0) between = clock64();
    }
    const long long end = clock64();
    if (threadIdx.x == 0) {
        cycles[2 * blockIdx.x] = between - start;
        cycles[2 * blockIdx.x + 1] = end - between;
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc[0] + acc[1] + acc[2] + acc[3];
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmas", type=int, default=2048, help="FMAs in the block (16 bytes each)")
    ap.add_argument("--stream", type=int, default=64, help="MB read between launches 2 and 3")
    args = ap.parse_args()
    kernel = cupy.RawModule(code=probe_source(args.fmas)).get_function("icache_probe")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    cycles = cupy.zeros(2 * sms, dtype=cupy.int64)
    sink = cupy.zeros(sms * 32, dtype=cupy.float32)
    flush = timing.l2_flush(cupy)
    stream_buf = cupy.ones(args.stream * (1 << 18), dtype=cupy.float32)
    lines = args.fmas * 16 / 128

    def flush_and_read():
        flush()
        float(stream_buf.sum())

    kernel((sms,), (32,), (cycles, sink))  # loads the module; not measured
    for label, before in (("after an L2 flush", flush),
                          ("right after the previous launch", lambda: None),
                          ("after a small other kernel", lambda: sink.fill(0)),
                          (f"after a flush and {args.stream} MB read", flush_and_read)):
        before()
        cupy.cuda.Device().synchronize()
        kernel((sms,), (32,), (cycles, sink))
        c = cycles.get().reshape(sms, 2)
        cold, warm = numpy.median(c[:, 0]), numpy.median(c[:, 1])
        print(f"{label}: first pass {cold:.0f} cycles, second {warm:.0f}; "
              f"{(cold - warm) / lines:.1f} cycles a 128-byte line ({lines:.0f} lines)")


if __name__ == "__main__":
    main()
