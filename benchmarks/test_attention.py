"""pytest-benchmark suite: `attention` forward and backward, varlen, and the features (sliding
window, softcap, ALiBi, dropout), each round timed on the GPU with CUDA events (the
``gpu_benchmark`` fixture, cuflash2.testing.GpuBenchmark), so the statistics are GPU time.

    pytest benchmarks/ --benchmark-only --benchmark-autosave     # save a run
    pytest benchmarks/ --benchmark-only --benchmark-compare      # hold a new run against it

Shapes follow the FlashAttention-2 paper's grid (16k tokens a batch, hidden size 2048: batch =
16384 // seqlen, nheads = 2048 // headdim), whose inputs are far larger than the L2 cache.
extra_info holds TFLOP/s (FLOPs as the paper counts them: 4·batch·heads·seqlen_q·seqlen_k·d
forward, halved when causal, backward 2.5x; only the pairs computed for a window or varlen)
and, where torch is installed, torch SDPA's FlashAttention-2 and cuDNN backends on the same
arrays with cuflash2's speed-up over each. The ids (test name and parameters) are kept stable
across releases so that saved runs compare.
"""

from __future__ import annotations

import pytest

#: (dtype, headdim, seqlen, causal) of the dense forward and backward benchmarks.
DENSE_SHAPES = [
    ("bf16", 64, 2048, True),
    ("bf16", 128, 2048, False),
    ("bf16", 128, 8192, True),
    ("fp16", 128, 8192, False),
    ("bf16", 256, 4096, True),
]
#: Sequences of the varlen benchmarks: ragged, 16k tokens (cuflash2.bench.varlen's).
VARLEN_LENGTHS = (3072, 512, 1536, 4096, 1024, 2048, 768, 3328)
#: The features' benchmarks: bf16, d=128, causal, 4 x 4096 tokens, 16 heads.
FEATURE_SHAPE = ("bf16", 128, 4096, True)
FEATURES = {
    "window-1024": dict(window_size=(1024, 0)),
    "softcap-30": dict(softcap=30.0),
    "alibi": dict(alibi_slopes=True),  # slopes made on the GPU by the test
    "dropout-0.1": dict(dropout_p=0.1, seed=1234),
}

ROUNDS, WARMUP_ROUNDS = 30, 3


def _shape_id(shape) -> str:
    dtype, headdim, seqlen, causal = shape
    return f"{dtype}-d{headdim}-s{seqlen}-{'causal' if causal else 'full'}"


def _config(direction, shape):
    from cuflash2.bench.paper_grid import paper_grid

    dtype, headdim, seqlen, causal = shape
    (config,) = paper_grid(headdims=(headdim,), dtypes=(dtype,), causal_modes=(causal,),
                           seqlens=(seqlen,), directions=(direction,))
    return config


def _inputs(cupy, config, seed=0):
    """q, k, v and dout of a configuration, standard normal (never zeros)."""
    from cuflash2.bench.paper_grid import random_inputs
    from cuflash2.selfcheck import dtype_from_name

    dtype = dtype_from_name(config.dtype)
    q, k, v = random_inputs(cupy, config, dtype, seed)
    (dout,) = random_inputs(cupy, config, dtype, seed + 1)[:1]
    return q, k, v, dout


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=_shape_id)
def test_forward(gpu_benchmark, cupy, sdpa_peers, record_result, shape):
    import cuflash2

    config = _config("fwd", shape)
    q, k, v, _ = _inputs(cupy, config)
    out = cupy.empty_like(q)
    gpu_benchmark(lambda: cuflash2.attention(q, k, v, causal=config.causal, out=out),
                  rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    record_result(gpu_benchmark, flops=config.flops, batch=config.batch, nheads=config.nheads,
                  **sdpa_peers(config, q, k, v, None, out))
    assert bool(cupy.isfinite(out.astype(cupy.float32)).all())


@pytest.mark.benchmark(group="backward")
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=_shape_id)
def test_backward(gpu_benchmark, cupy, sdpa_peers, record_result, shape):
    import cuflash2

    config = _config("bwd", shape)
    q, k, v, dout = _inputs(cupy, config)
    out, lse = cuflash2.attention(q, k, v, causal=config.causal, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    dq, dk, dv = grads
    gpu_benchmark(lambda: cuflash2.attention_backward(dout, q, k, v, out, lse,
                                                      causal=config.causal, dq=dq, dk=dk, dv=dv),
                  rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    record_result(gpu_benchmark, flops=config.flops, batch=config.batch, nheads=config.nheads,
                  **sdpa_peers(config, q, k, v, dout, None))
    assert all(bool(cupy.isfinite(g.astype(cupy.float32)).all()) for g in grads)


@pytest.mark.benchmark(group="varlen")
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_varlen(gpu_benchmark, cupy, record_result, direction):
    """attention_varlen(_backward) on 8 ragged sequences (16k tokens), bf16 d=128 causal;
    TFLOP/s of the real tokens' pairs. check_cu_seqlens=False: the timed call does not
    synchronise (the lengths were checked by the first, untimed call)."""
    import numpy

    import cuflash2
    from cuflash2.bench.paper_grid import attention_flops

    headdim, nheads = 128, 16
    total, longest = sum(VARLEN_LENGTHS), max(VARLEN_LENGTHS)
    cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(VARLEN_LENGTHS)]).astype(numpy.int32))
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((total, nheads, headdim), dtype=cupy.float32)
                     .astype(_bf16()) for _ in range(4))
    args = (cu, cu, longest, longest)
    out, lse = cuflash2.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    if direction == "fwd":
        def call():
            return cuflash2.attention_varlen(q, k, v, *args, causal=True, out=out,
                                             check_cu_seqlens=False)
    else:
        def call():
            return cuflash2.attention_varlen_backward(dout, q, k, v, out, lse, *args,
                                                      causal=True, check_cu_seqlens=False)
    gpu_benchmark(call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    flops = sum(attention_flops(1, nheads, n, n, headdim, True, direction)
                for n in VARLEN_LENGTHS)
    record_result(gpu_benchmark, flops=flops, lengths=list(VARLEN_LENGTHS), nheads=nheads)


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@pytest.mark.benchmark(group="features")
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature(gpu_benchmark, cupy, record_result, feature, direction):
    """One feature at a time on the same causal bf16 d=128 problem (4 x 4096 tokens); beside
    the dense benchmarks' plain causal rows. A window counts only the pairs inside it."""
    import cuflash2
    from cuflash2.bench.windows import window_pairs

    config = _config(direction, FEATURE_SHAPE)
    q, k, v, dout = _inputs(cupy, config)
    options = dict(FEATURES[feature], causal=True)
    if options.get("alibi_slopes") is True:
        # ALiBi's geometric slopes 2^(-8 i / nheads), as in the ALiBi paper.
        exponents = -8.0 * cupy.arange(1, config.nheads + 1, dtype=cupy.float32) / config.nheads
        options["alibi_slopes"] = cupy.exp2(exponents).astype(cupy.float32)
    flops = config.flops
    if "window_size" in options:
        full_pairs = config.seqlen * (config.seqlen + 1) / 2  # causal, as the FLOP count has it
        flops *= window_pairs(config.seqlen, options["window_size"][0]) / full_pairs
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    if direction == "fwd":
        def call():
            return cuflash2.attention(q, k, v, out=out, **options)
    else:
        dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))

        def call():
            return cuflash2.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv,
                                               **options)
    gpu_benchmark(call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    record_result(gpu_benchmark, flops=flops, batch=config.batch, nheads=config.nheads,
                  seqlen=config.seqlen)
