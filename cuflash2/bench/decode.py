"""`python -m cuflash2 bench --decode`: decoding with a KV cache (`attention_with_kvcache`, one
query token, a token appended, causal, d=128), as single steps and as steps of LAYERS layers in a
CUDA graph (`decode_graph.DecodeStep`), each against the device's copy bandwidth; with
`--compare torch`, torch SDPA's decoding on the same caches (`decode_peers`).

Single steps: batch 1/8/64, caches of 4k-64k tokens, GQA 8:1 and MHA, L2 flushed before each
call, and at batch 1 the time of a dense `attention` call on the same q, K, V. In a graph: the
step captured with programmatic launches and the cache read while the previous kernel finishes,
with the cache read after it, and with plain launches (`VARIANTS`), in the same run.
"""

from __future__ import annotations

import sys

from .. import _kvcache, _launch
from .decode_graph import LAYERS, DecodeStep, time_step
from .decode_peers import PEERS, has_peers, measure_graph, measure_single, peer_cells, peer_headers
from .timing import Backlog, copy_ceiling, l2_flush, time_cupy

#: Single-step rows (issue 5): batch sizes, cache lengths and (nheads, nheads_kv) at d=128.
DECODE_BATCHES = (1, 8, 64)
DECODE_CACHES = (4096, 16384, 65536)
DECODE_HEADS = ((32, 4), (32, 32))  # GQA 8:1 and MHA


def decode_bytes(batch, cache_len, nheads, nheads_kv, headdim, seqlen_q=1, itemsize=2) -> int:
    """Bytes a decode step must move: the K and V cache read once, q read and out written."""
    kv = 2 * batch * cache_len * nheads_kv * headdim * itemsize
    return kv + 2 * batch * seqlen_q * nheads * headdim * itemsize


def decode_rows(headdim=128):
    """(nheads, nheads_kv, cache_len, batch) of the decode table's rows, in its order (rows whose
    K and V would pass 24 GiB left out)."""
    for nheads, nheads_kv in DECODE_HEADS:
        for cache_len in DECODE_CACHES:
            for batch in DECODE_BATCHES:
                if batch * cache_len * nheads_kv * headdim * 4 <= (24 << 30):
                    yield nheads, nheads_kv, cache_len, batch


def decode_inputs(cupy, dtype, batch, cache_len, nheads, nheads_kv, headdim=128):
    """A decode row's arrays: q (one token), the K and V caches, the appended token (k = v) and
    the cache lengths (the capacity less that token)."""
    rng = cupy.random.default_rng(cache_len + batch)
    kc = rng.standard_normal((batch, cache_len, nheads_kv, headdim),
                             dtype=cupy.float32).astype(dtype)
    vc = rng.standard_normal(kc.shape, dtype=cupy.float32).astype(dtype)
    q = rng.standard_normal((batch, 1, nheads, headdim), dtype=cupy.float32).astype(dtype)
    k1 = rng.standard_normal((batch, 1, nheads_kv, headdim), dtype=cupy.float32).astype(dtype)
    lengths = cupy.full((batch,), cache_len - 1, dtype=cupy.int32)
    return q, kc, vc, k1, lengths


def measure_decode(cupy, dtype_name, warmup, iters, headdim=128, progress=sys.stderr,
                   torch=None) -> list[dict]:
    """Decode rows: one query token against caches of 4k-64k tokens (a token appended), batch
    1/8/64, GQA 8:1 and MHA; achieved bandwidth next to the copy ceiling, at batch 1 the time
    of a dense `attention` call on the same q, K, V, and with `torch` SDPA's decoding on the
    same arrays (`decode_peers`)."""
    import ml_dtypes
    import numpy

    import cuflash2

    dtype = numpy.dtype(numpy.float16 if dtype_name == "fp16" else ml_dtypes.bfloat16)
    backlog = Backlog(cupy)
    ceiling = copy_ceiling(cupy)
    flush_l2 = l2_flush(cupy)
    rows = []
    for nheads, nheads_kv, cache_len, batch in decode_rows(headdim):
        q, kc, vc, k1, lengths = decode_inputs(cupy, dtype, batch, cache_len, nheads,
                                               nheads_kv, headdim)
        fn = lambda: cuflash2.attention_with_kvcache(  # noqa: E731
            q, kc, vc, k=k1, v=k1, cache_seqlens=lengths, causal=True)
        ms = time_cupy(cupy, fn, warmup, iters, backlog, flush_l2)
        moved = decode_bytes(batch, cache_len, nheads, nheads_kv, headdim)
        row = {"dtype": dtype_name, "headdim": headdim, "batch": batch,
               "cache": cache_len, "nheads": nheads, "nheads_kv": nheads_kv, "ms": ms,
               "gb_per_s": moved / ms / 1e6, "fraction_of_copy": moved / ms * 1e3 / ceiling,
               "dense_ms": None}
        if batch == 1:
            dense = lambda: cuflash2.attention(q, kc, vc, causal=True)  # noqa: E731
            row["dense_ms"] = time_cupy(cupy, dense, warmup, iters, backlog, flush_l2)
        if torch is not None:
            measure_single(cupy, torch, row, q, kc, vc, fn(), warmup, iters, backlog, flush_l2)
        rows.append(row)
        print(f"decode b={batch} cache={cache_len} h={nheads}/{nheads_kv}: {ms:.3f} ms, "
              f"{row['gb_per_s']:.0f} GB/s ({row['fraction_of_copy']:.0%} of copy)",
              file=progress, flush=True)
    for row in rows:
        row["copy_ceiling_gb_per_s"] = ceiling / 1e9
    return rows


def decode_table(rows: list[dict]) -> str:
    """The single-step decode table; with the peers' times where the rows have them."""
    peers = has_peers(rows, "_us")
    headers = ["dtype", "d", "heads (q/kv)", "batch", "cache", "us", "GB/s", "of copy ceiling",
               "dense attention us (batch 1)"] + (peer_headers("us") if peers else [])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        dense = "–" if r["dense_ms"] is None else (
            f"{r['dense_ms'] * 1e3:.1f} ({r['dense_ms'] / r['ms']:.2f}x)")
        cells = [r["dtype"], r["headdim"], f"{r['nheads']}/{r['nheads_kv']}", r["batch"],
                 r["cache"], f"{r['ms'] * 1e3:.1f}", f"{r['gb_per_s']:.0f}",
                 f"{r['fraction_of_copy']:.0%}", dense]
        if peers:
            cells += peer_cells(r, "_us", r["ms"] * 1e3, 1)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Steps in a CUDA graph
# ---------------------------------------------------------------------------------------------

#: (label, programmatic launches, early_cache_reads) of the captured variants; the first is the
#: row's headline.
VARIANTS = (("programmatic", True, True), ("after_wait", True, False), ("plain", False, False))
#: (batch, cache length) of the rows, at 32 query heads over 4 KV heads.
GRAPH_ROWS = ((1, 4096), (1, 16384), (1, 65536), (8, 16384))
GRAPH_HEADS = (32, 4)


def measure_decode_graph(cupy, warmup: int, iters: int, rows=GRAPH_ROWS, heads=GRAPH_HEADS,
                         headdim: int = 128, progress=sys.stderr, torch=None) -> list[dict]:
    """The in-graph rows: us per layer in each of VARIANTS, the fraction of the copy ceiling a
    layer reaches, and with `torch` SDPA's layers over the same caches (`decode_peers`)."""
    ceiling = copy_ceiling(cupy)
    flush_l2 = l2_flush(cupy)
    backlog = Backlog(cupy)
    nheads, nheads_kv = heads
    results = []
    for batch, cache_len in rows:
        row = {"dtype": "fp16", "headdim": headdim, "batch": batch, "cache": cache_len,
               "nheads": nheads, "nheads_kv": nheads_kv, "layers": LAYERS,
               "copy_ceiling_gb_per_s": ceiling / 1e9}
        saved = _launch.PROGRAMMATIC
        try:
            for label, programmatic, early in VARIANTS:
                _launch.PROGRAMMATIC = programmatic
                _kvcache._plans_by_key.plans.clear()  # plans keep the launch they were made with
                step = DecodeStep(cupy, batch, cache_len, nheads, nheads_kv, headdim,
                                  early_cache_reads=early)
                ms = time_step(cupy, step, warmup, iters, backlog, flush_l2)
                row[f"{label}_us_per_layer"] = ms * 1e3 / LAYERS
                row[f"{label}_edges"] = step.graph.programmatic_edges
                if torch is not None and label == VARIANTS[0][0]:
                    measure_graph(cupy, torch, row, step, warmup, iters, backlog, flush_l2)
                del step
        finally:
            _launch.PROGRAMMATIC = saved
            _kvcache._plans_by_key.plans.clear()
        moved = decode_bytes(batch, cache_len, nheads, nheads_kv, headdim)
        row["fraction_of_copy"] = moved / (row["programmatic_us_per_layer"] * 1e-6) / ceiling
        for label in ("after_wait", "plain"):
            row[f"{label}_fraction_of_copy"] = (moved / (row[f"{label}_us_per_layer"] * 1e-6)
                                                / ceiling)
        results.append(row)
        print(f"decode graph b={batch} cache={cache_len}: {row['programmatic_us_per_layer']:.2f} "
              f"us/layer ({row['fraction_of_copy']:.0%} of copy; cache read after the wait "
              f"{row['after_wait_us_per_layer']:.2f}, plain launches "
              f"{row['plain_us_per_layer']:.2f}), {row['programmatic_edges']} programmatic edges"
              + _peers_progress(row),
              file=progress, flush=True)
    return results


def _peers_progress(row: dict) -> str:
    return "".join(f", {peer.LABEL} {row[key + '_us_per_layer']:.2f}" for key, peer in PEERS
                   if row.get(key + "_us_per_layer"))


def decode_graph_table(rows: list[dict]) -> str:
    """The in-graph table; with the peers' layers where the rows have them."""
    peers = has_peers(rows, "_us_per_layer")
    headers = ["dtype", "d", "heads (q/kv)", "batch", "cache", "us per layer",
               "of copy ceiling", "cache read after the wait: us per layer",
               "plain launches: us per layer", "programmatic edges"]
    headers += peer_headers("us per layer") if peers else []
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        ours = r["programmatic_us_per_layer"]
        cells = [r["dtype"], r["headdim"], f"{r['nheads']}/{r['nheads_kv']}", r["batch"],
                 r["cache"], f"{ours:.2f}", f"{r['fraction_of_copy']:.0%}",
                 f"{r['after_wait_us_per_layer']:.2f} ({r['after_wait_fraction_of_copy']:.0%})",
                 f"{r['plain_us_per_layer']:.2f} ({r['plain_fraction_of_copy']:.0%})",
                 r["programmatic_edges"]]
        if peers:
            cells += peer_cells(r, "_us_per_layer", ours, 2)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)
