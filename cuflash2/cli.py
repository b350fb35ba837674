"""Command line: `cuflash2 info | check | precompile | bench` (the console script), or
`python -m cuflash2 info | check | precompile | bench`.

CuPy (and torch) are imported only inside the commands that need them, so `info` and `--help`
work on a machine without CuPy or without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Exit status of `check`, `precompile` and `bench` when there is nothing to run them on.
EXIT_NO_GPU = 2
MIN_COMPUTE_CAPABILITY = (8, 0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser(prog: str = "cuflash2") -> argparse.ArgumentParser:
    """`prog`: the command as the user typed it, for usage and help lines."""
    from cuflash2 import precompile, selfcheck
    from cuflash2.bench.paper_grid import PAPER_HIDDEN, PAPER_SEQLENS, PAPER_TOKENS

    parser = argparse.ArgumentParser(
        prog=prog,
        description="FlashAttention-2 for CuPy: environment report, self-check, benchmark.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="versions, GPU, compute capability, kernel cache dir")
    info.set_defaults(func=_info)

    check = commands.add_parser(
        "check", help="compare the kernels with the reference on random inputs on this GPU",
        description="Runs cuflash2.attention on random inputs of every dtype and head dim given, "
                    "causal and not, on a few shapes (MHA, MQA unbatched, GQA with more keys "
                    "than queries, more queries than keys), and checks each result against "
                    "cuflash2.reference by the 2x rule (cuflash2.testing.check_forward); one "
                    "line a case, exit status 0 when all pass, 1 otherwise.")
    check.add_argument("--dtype", nargs="+", choices=("fp16", "bf16", "fp32", "tf32"),
                       default=["fp16", "bf16"],
                       help="input dtypes to check (default: fp16 bf16; fp32 and tf32: float32 "
                            "inputs at precision highest and tf32)")
    check.add_argument("--headdim", nargs="+", type=_positive_int,
                       default=list(selfcheck.DEFAULT_HEADDIMS),
                       help="head dims to check, multiples of 8 up to 256 (default: "
                            f"{' '.join(map(str, selfcheck.DEFAULT_HEADDIMS))})")
    check.add_argument("--seed", type=int, default=0,
                       help="seed of the random inputs (default 0); another seed, other inputs")
    check.set_defaults(func=_check)

    pre = commands.add_parser(
        "precompile", help="compile kernels ahead of time into CuPy's cache, with progress",
        description="Compiles every kernel specialisation the calls you name can use, for this "
                    "machine's GPU, in parallel processes, into CuPy's on-disk kernel cache (or "
                    "--cache-dir): a later process (or another machine with the same GPU and "
                    "that cache, CUPY_CACHE_DIR) then starts warm instead of compiling inside "
                    "its first calls.")
    pre.add_argument("--dtype", nargs="+", choices=tuple(precompile.DTYPES),
                     default=["fp16", "bf16"],
                     help="input dtypes (default: fp16 bf16; fp32 is float32 at precision "
                          "highest, tf32 float32 at precision tf32; e4m3 FP8 inputs with a "
                          "bf16 output, e4m3-fp16 with an fp16 one: the Hopper forward)")
    pre.add_argument("--headdim", nargs="+", type=_positive_int,
                     default=list(precompile.DEFAULT_HEAD_DIMS),
                     help="head dims of your calls (default: "
                          f"{' '.join(map(str, precompile.DEFAULT_HEAD_DIMS))})")
    pre.add_argument("--headdim-v", nargs="+", type=_positive_int, default=[],
                     help="v's head dims where they differ from q's (d_v != d_qk: DeepSeek's "
                          "--headdim 192 --headdim-v 128; its MLA decode: --headdim 576 "
                          "--headdim-v 512 --directions decode; default: none)")
    pre.add_argument("--features", nargs="+", default=list(precompile.DEFAULT_FEATURES),
                     metavar="NAME[+NAME]",
                     help="the features of your calls, each a set of "
                          f"{', '.join(precompile.FEATURE_NAMES)} joined by + (e.g. none "
                          "softcap+alibi; default: none)")
    pre.add_argument("--directions", nargs="+", choices=precompile.DIRECTIONS,
                     default=list(precompile.DEFAULT_DIRECTIONS),
                     help="fwd (attention), bwd (attention_backward, deterministic mode too), "
                          "decode (attention_with_kvcache) (default: fwd bwd)")
    pre.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                     help="parallel compiler processes (default: the CPU count)")
    pre.add_argument("--cache-dir", default=None,
                     help="the kernel cache directory to fill (default: CuPy's, "
                          "CUPY_CACHE_DIR or ~/.cupy/kernel_cache)")
    pre.add_argument("--list", action="store_true",
                     help="print the specialisations and exit, compiling nothing")
    pre.set_defaults(func=_precompile)

    bench_cmd = commands.add_parser(
        "bench", help="TFLOP/s on the FlashAttention-2 paper's grid, optionally next to torch SDPA")
    bench_cmd.add_argument("--headdim", nargs="+", type=_positive_int, default=None,
                           help="head dims of the grid, at every seqlen (default: 64 and 128 at "
                                "every seqlen, plus 256 at seqlens >= 4096; 64 and 128 for "
                                "--windows, --varlen and --host)")
    bench_cmd.add_argument("--dtype", nargs="+", choices=("fp16", "bf16"), default=["fp16", "bf16"])
    bench_cmd.add_argument("--causal", choices=("both", "on", "off"), default="both")
    bench_cmd.add_argument("--seqlens", nargs="+", type=_positive_int, default=None,
                           help=f"sequence lengths (default {' '.join(map(str, PAPER_SEQLENS))}"
                                "; 16384 for --flex)")
    bench_cmd.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both",
                           help="forward, backward (attention_backward) or both")
    bench_cmd.add_argument("--compare", choices=("torch",), default=None,
                           help="also time torch SDPA on the same arrays, restricted to its "
                                "FlashAttention-2 backend and to its cuDNN backend (with "
                                "--decode, their decoding too)")
    bench_cmd.add_argument("--json", metavar="PATH", default=None,
                           help="save every row and the environment as JSON")
    bench_cmd.add_argument("--windows", nargs="+", type=_positive_int, default=None,
                           metavar="W",
                           help="also time causal sliding windows (W, 0) at the longest seqlen, "
                                "next to plain causal attention (first --dtype)")
    bench_cmd.add_argument("--varlen", action="store_true",
                           help="also time attention_varlen on ragged sequences (16k tokens) next "
                                "to the same sequences padded (first --dtype)")
    bench_cmd.add_argument("--decode", action="store_true",
                           help="also time attention_with_kvcache decoding (batch 1/8/64, caches "
                                "4k-64k, d=128, GQA 8:1 and MHA) against the copy bandwidth")
    bench_cmd.add_argument("--host", action="store_true",
                           help="instead of the grid: the host cost per call of each entry point "
                                "and the short-sequence rows timed call by call (with --compare "
                                "torch, next to SDPA's flash and cuDNN backends)")
    bench_cmd.add_argument("--flex", action="store_true",
                           help="instead of the grid: next to PyTorch's FlexAttention "
                                "(torch.compile'd, causal block mask) on the same arrays; "
                                "default rows d=128 at 16k tokens")
    bench_cmd.add_argument("--warmup", type=int, default=3)
    bench_cmd.add_argument("--iters", type=_positive_int, default=25)
    bench_cmd.add_argument("--repeats", type=_positive_int, default=1,
                           help="rounds of each grid row, its contenders (cuflash2, and with "
                                "--compare torch SDPA-flash and cuDNN) interleaved, the order "
                                "turning; each keeps the median (default 1; 3 or 5 for "
                                "ratios that hold between runs)")
    bench_cmd.add_argument("--tokens", type=_positive_int, default=PAPER_TOKENS,
                           help="tokens per batch: batch = tokens // seqlen")
    bench_cmd.add_argument("--hidden", type=_positive_int, default=PAPER_HIDDEN,
                           help="hidden size: nheads = hidden // headdim")
    bench_cmd.set_defaults(func=_bench)
    return parser


def _info(args) -> int:
    from cuflash2 import _environment

    print("\n".join(_environment.format_info(_environment.collect())))
    return 0


def _require_gpu(command: str):
    """CuPy with a usable sm_80+ device, or None after telling the user why not."""
    from cuflash2 import _environment

    cupy, reason = _environment.find_gpu()
    if cupy is None:
        print(f"cuflash2 {command}: needs an NVIDIA GPU, but {reason}.", file=sys.stderr)
        return None
    capability = cupy.cuda.Device().compute_capability  # e.g. "90"
    major, minor = int(capability[:-1]), int(capability[-1])
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        print(f"cuflash2 {command}: needs compute capability 8.0 (Ampere) or newer; "
              f"this GPU is sm_{capability}.", file=sys.stderr)
        return None
    return cupy


def _check(args) -> int:
    cupy = _require_gpu("check")
    if cupy is None:
        return EXIT_NO_GPU
    from cuflash2 import selfcheck

    return selfcheck.run(cupy, args.dtype, args.headdim, args.seed)


def _precompile(args) -> int:
    from cuflash2 import _environment, precompile

    try:
        features = precompile.parse_features(args.features)
    except ValueError as exc:
        print(f"cuflash2 precompile: {exc}", file=sys.stderr)
        return 2
    cupy = _require_gpu("precompile")
    if cupy is None:
        return EXIT_NO_GPU
    arch = int(cupy.cuda.Device().compute_capability)
    configs = precompile.plan(arch, [precompile.DTYPES[d] for d in args.dtype], args.headdim,
                              features, args.directions, args.headdim_v)
    if args.list:
        print("\n".join(c.name_expression for c in configs))
        return 0
    cache_dir = args.cache_dir or _environment.cupy_cache_dir()
    print(f"cuflash2 precompile: {len(configs)} specialisations for sm_{arch} into {cache_dir}, "
          f"{args.jobs} processes", file=sys.stderr)
    start = time.monotonic()
    errors = precompile.run(configs, args.jobs, args.cache_dir)
    for error in errors:
        print(f"failed: {error}", file=sys.stderr)
    print(f"cuflash2 precompile: {len(configs) - len(errors)} of {len(configs)} compiled in "
          f"{time.monotonic() - start:.0f} s", file=sys.stderr)
    return 1 if errors else 0


def _bench(args) -> int:
    cupy = _require_gpu("bench")
    if cupy is None:
        return EXIT_NO_GPU
    from cuflash2.bench import flex, host, report

    if args.host:
        return host.run(cupy, args)
    if args.flex:
        return flex.run(cupy, args)
    return report.run(cupy, args)


def main(argv=None, prog: str = "cuflash2") -> int:
    """The console script `cuflash2`; `python -m cuflash2` passes its own `prog`."""
    args = build_parser(prog).parse_args(argv)
    return args.func(args)
