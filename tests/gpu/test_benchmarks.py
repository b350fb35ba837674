"""pytest-benchmark timings of a few headline forward shapes (FA2-paper grid: 16k tokens, hidden
2048). Each round launches one call and waits for it, so these track regressions; the numbers to
quote come from `python -m cuflash2 bench` (CUDA events, see benchmarks/README.md)."""

import pytest

cupy = pytest.importorskip("cupy")
try:
    _HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver or no device
    _HAS_GPU = False
if not _HAS_GPU:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import cuflash2  # noqa: E402
from cuflash2.bench import paper_grid  # noqa: E402
from cuflash2.selfcheck import dtype_from_name  # noqa: E402

pytestmark = pytest.mark.gpu

# (dtype, headdim, seqlen, causal)
HEADLINE_SHAPES = [
    ("fp16", 128, 4096, False),
    ("fp16", 128, 4096, True),
    ("bf16", 64, 2048, False),
]


@pytest.mark.parametrize(
    "dtype_name, headdim, seqlen, causal", HEADLINE_SHAPES,
    ids=[f"{t}-d{d}-s{s}-{'causal' if c else 'full'}" for t, d, s, c in HEADLINE_SHAPES],
)
def test_forward_speed(benchmark, dtype_name, headdim, seqlen, causal):
    (config,) = paper_grid.paper_grid(headdims=(headdim,), dtypes=(dtype_name,),
                                      causal_modes=(causal,), seqlens=(seqlen,))
    q, k, v = paper_grid.random_inputs(cupy, config, dtype_from_name(dtype_name), seed=0)
    out = cupy.empty_like(q)
    stream = cupy.cuda.get_current_stream()

    def forward():
        cuflash2.attention(q, k, v, causal=causal, out=out)
        stream.synchronize()

    forward()  # compile (or load from the disk cache) outside the timed rounds
    benchmark.pedantic(forward, rounds=20, iterations=1, warmup_rounds=3)
    seconds = benchmark.stats.stats.median
    benchmark.extra_info["tflops"] = round(config.flops / seconds / 1e12, 1)
    assert bool(cupy.isfinite(out.astype(cupy.float32)).all())
