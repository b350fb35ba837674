"""pytest-benchmark suite: decoding with a KV cache (`attention_with_kvcache`, one query token, a
token appended, causal, fp16, d=128), as single steps and as steps of 8 layers replayed as a
CUDA graph, each round timed on the GPU with CUDA events (``gpu_benchmark``).

The L2 cache is flushed before each round (untimed), so a cache that fits in L2 is still read
from HBM, as in a model's step after the other layers'. extra_info holds GB/s: the bytes a step
must move (the K and V caches read once, q read and out written) over its median time; where
torch is installed, torch SDPA's FlashAttention-2 and cuDNN backends on the same caches (one
query token against the whole cache; SDPA appends nothing), in microseconds.
"""

from __future__ import annotations

import pytest

#: (batch, cache length, nheads, nheads_kv) of the single steps.
SINGLE_STEPS = [
    (1, 16384, 32, 4),
    (1, 65536, 32, 4),
    (8, 16384, 32, 4),
    (64, 4096, 32, 32),
]
#: (batch, cache length) of the in-graph steps, 32 query heads over 4 KV heads.
GRAPH_STEPS = [(1, 16384), (8, 16384)]
HEADDIM = 128

ROUNDS, WARMUP_ROUNDS = 50, 5


def _step_id(step) -> str:
    batch, cache, nheads, nheads_kv = step
    return f"fp16-d{HEADDIM}-b{batch}-cache{cache}-h{nheads}-{nheads_kv}"


@pytest.mark.benchmark(group="decode")
@pytest.mark.parametrize("step", SINGLE_STEPS, ids=_step_id)
def test_decode_step(gpu_benchmark, cupy, torch, backlog, flush_l2, record_result, step):
    import numpy

    import cuflash2
    from cuflash2.bench import decode, decode_peers

    batch, cache_len, nheads, nheads_kv = step
    q, k_cache, v_cache, k_new, lengths = decode.decode_inputs(
        cupy, numpy.float16, batch, cache_len, nheads, nheads_kv, HEADDIM)

    def call():
        # The lengths stay at the capacity less one: each round appends into the same slot.
        return cuflash2.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=k_new,
                                               cache_seqlens=lengths, causal=True)

    out = gpu_benchmark(call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, before=flush_l2)
    peers = {}
    if torch is not None:
        row = {"dtype": "fp16"}
        decode_peers.measure_single(cupy, torch, row, q, k_cache, v_cache, out, 3, 20, backlog,
                                    flush_l2)
        peers = {key: value for key, value in row.items() if key != "dtype"}
    record_result(gpu_benchmark,
                  nbytes=decode.decode_bytes(batch, cache_len, nheads, nheads_kv, HEADDIM),
                  **peers)
    assert bool(cupy.isfinite(out.astype(cupy.float32)).all())


@pytest.mark.benchmark(group="decode-graph")
@pytest.mark.parametrize("step", GRAPH_STEPS, ids=lambda s: f"fp16-d{HEADDIM}-b{s[0]}-cache{s[1]}"
                                                             "-h32-4-8layers")
def test_decode_graph(gpu_benchmark, cupy, torch, backlog, flush_l2, record_result, step):
    """A model's decoding step as a CUDA graph: 8 layers, each attention over its own cache
    (early_cache_reads=True) followed by a kernel writing the next layer's q, k, v
    (cuflash2.bench.decode_graph.DecodeStep). A round replays the graph; extra_info has the
    time per layer and its GB/s."""
    from cuflash2.bench import decode, decode_peers
    from cuflash2.bench.decode_graph import LAYERS, DecodeStep

    batch, cache_len = step
    nheads, nheads_kv = 32, 4
    graph_step = DecodeStep(cupy, batch, cache_len, nheads, nheads_kv, HEADDIM,
                            early_cache_reads=True)
    with graph_step.stream:  # the events, the spinning kernel and the replay on its stream
        gpu_benchmark(graph_step.run, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS,
                      before=flush_l2)
    graph_step.stream.synchronize()
    for out in graph_step.outputs:  # cuflash2's replays' results, before the peers run
        assert bool(cupy.isfinite(out.astype(cupy.float32)).all())
    info = {"layers": LAYERS, "programmatic_edges": graph_step.graph.programmatic_edges}
    seconds = gpu_benchmark.gpu_seconds()
    if seconds is not None:
        info["us_per_layer"] = round(seconds * 1e6 / LAYERS, 2)
    if torch is not None:
        row = {"dtype": "fp16"}
        decode_peers.measure_graph(cupy, torch, row, graph_step, 3, 20, backlog, flush_l2)
        info.update({key: value for key, value in row.items() if key != "dtype"})
    record_result(gpu_benchmark,
                  nbytes=LAYERS * decode.decode_bytes(batch, cache_len, nheads, nheads_kv,
                                                      HEADDIM),
                  **info)
