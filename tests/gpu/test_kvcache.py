"""attention_with_kvcache (issue 5): split-KV decoding over contiguous and paged caches, against
the reference (2x rule), in-place append verified bit for bit, paged == contiguous bitwise, GQA,
causal and windowed, ragged cache lengths, forced split counts, softcap / ALiBi."""

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _configs, reference, testing  # noqa: E402
from grids import BF16, DTYPES, paged_cache, seed_of  # noqa: E402  (tests/gpu helper)

pytestmark = pytest.mark.gpu



def _randn(rng, shape, dtype):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def _check(out, lse, q, k_cache, v_cache, kwargs):
    """out/lse against the reference run on copies of the cache (before the kernel's append)."""
    hi = reference.attention_with_kvcache(q, k_cache[0], v_cache[0], return_lse=True,
                                          compute_dtype=numpy.float32, **kwargs)
    lo = reference.attention_with_kvcache(q, k_cache[0], v_cache[0], compute_dtype=q.dtype,
                                          **kwargs)
    result = testing.check_close("out", out, hi[0], lo)
    assert result.ok, str(result)
    assert testing.lse_close(lse, hi[1]).ok


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (2, 0), (8, 8), (64, 3)])
@pytest.mark.parametrize("heads", [(8, 1), (4, 4)], ids=["gqa8", "mha"])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_kvcache_against_reference(dtype, headdim, seqlen_q, seqlen_new, heads, mask):
    h, hk = heads
    batch, capacity = 3, 700
    seed = seed_of(str(dtype), headdim, seqlen_q, seqlen_new, heads, mask)
    rng = numpy.random.default_rng(seed)
    q = _randn(rng, (batch, seqlen_q, h, headdim), dtype)
    k_cache = _randn(rng, (batch, capacity, hk, headdim), dtype)
    v_cache = _randn(rng, (batch, capacity, hk, headdim), dtype)
    new = {}
    if seqlen_new:
        new = dict(k=_randn(rng, (batch, seqlen_new, hk, headdim), dtype),
                   v=_randn(rng, (batch, seqlen_new, hk, headdim), dtype))
    cache_seqlens = cupy.asarray(numpy.array([500, 70, 0], numpy.int32))
    kwargs = dict(cache_seqlens=cache_seqlens, causal=mask == "causal",
                  window_size=(40, 0) if mask == "window" else (-1, -1), **new)
    ref_caches = ([k_cache.copy()], [v_cache.copy()])
    for splits in (0, 1, 5):
        k_run, v_run = k_cache.copy(), v_cache.copy()
        out, lse = cuflash2.attention_with_kvcache(q, k_run, v_run, num_splits=splits,
                                                   return_lse=True, **kwargs)
        _check(out, lse, q, *ref_caches, kwargs)
        # The append wrote exactly the new tokens (the reference appended the same).
        assert bool((k_run.view(cupy.uint16) == ref_caches[0][0].view(cupy.uint16)).all())
        assert bool((v_run.view(cupy.uint16) == ref_caches[1][0].view(cupy.uint16)).all())


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_paged_equals_contiguous(page_size):
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(page_size)
    batch, capacity, h, hk, d = 2, 1024, 16, 2, 128
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    k_new, v_new = _randn(rng, (batch, 1, hk, d), dtype), _randn(rng, (batch, 1, hk, d), dtype)
    lengths = cupy.asarray(numpy.array([1000, 333], numpy.int32))
    k_paged, v_paged, table = paged_cache(k_cache, v_cache, page_size, rng)
    for splits in (1, 4):
        want = cuflash2.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), k=k_new, v=v_new,
                                               cache_seqlens=lengths, num_splits=splits)
        kp, vp = k_paged.copy(), v_paged.copy()
        got = cuflash2.attention_with_kvcache(q, kp, vp, k=k_new, v=v_new, cache_seqlens=lengths,
                                              block_table=table, num_splits=splits)
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all()), splits
        # The appended tokens landed in their pages.
        for b, n in enumerate(lengths.get()):
            page, row = int(table[b, n // page_size]), int(n % page_size)
            assert bool((kp[page, row].view(cupy.uint16) == k_new[b, 0].view(cupy.uint16)).all())


def test_long_cache_64k_and_features():
    dtype = BF16
    rng = numpy.random.default_rng(7)
    batch, capacity, h, hk, d = 1, 65536, 8, 1, 128
    q = _randn(rng, (batch, 2, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    slopes = cupy.asarray(numpy.linspace(0.001, 0.01, h).astype(numpy.float32))
    kwargs = dict(cache_seqlens=65000, causal=True, softcap=20.0, alibi_slopes=slopes)
    out, lse = cuflash2.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs)
    _check(out, lse, q, [k_cache], [v_cache], kwargs)


@pytest.mark.parametrize("headdim", [d for d in _configs.KERNEL_HEAD_DIMS if d not in (64, 128)])
def test_every_head_dim(headdim):
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(headdim)
    q = _randn(rng, (2, 3, 4, headdim), dtype)
    k_cache, v_cache = _randn(rng, (2, 300, 2, headdim), dtype), _randn(rng, (2, 300, 2, headdim), dtype)
    kwargs = dict(cache_seqlens=cupy.asarray(numpy.array([299, 17], numpy.int32)), causal=True)
    out, lse = cuflash2.attention_with_kvcache(q, k_cache, v_cache, num_splits=3, return_lse=True,
                                               **kwargs)
    _check(out, lse, q, [k_cache], [v_cache], kwargs)


def test_cache_batch_idx_and_bad_values():
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(1)
    q = _randn(rng, (2, 1, 4, 64), dtype)
    k_cache, v_cache = _randn(rng, (5, 100, 4, 64), dtype), _randn(rng, (5, 100, 4, 64), dtype)
    idx = cupy.asarray(numpy.array([3, 0], numpy.int32))
    kwargs = dict(cache_seqlens=60, cache_batch_idx=idx)
    out, lse = cuflash2.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs)
    _check(out, lse, q, [k_cache], [v_cache], kwargs)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 101"):
        cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=101, cache_batch_idx=idx,
                                        check_cache=True)
    # Unchecked: lengths past the capacity are clamped, never read out of bounds.
    clamped = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=10**6,
                                              cache_batch_idx=idx)
    full = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=100,
                                           cache_batch_idx=idx)
    assert bool((clamped.view(cupy.uint16) == full.view(cupy.uint16)).all())


def test_bad_block_ids_read_as_zeros_unchecked():
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(2)
    q = _randn(rng, (1, 1, 4, 64), dtype)
    pages = _randn(rng, (4, 16, 1, 64), dtype)
    table = cupy.asarray(numpy.array([[0, 1, 7]], numpy.int32))  # block 7 is not in the cache
    out = cuflash2.attention_with_kvcache(q, pages, pages, cache_seqlens=40, block_table=table)
    # Positions 32..39 read as zero keys and values: the same as a cache holding zeros there.
    zeros = cupy.zeros_like(pages)
    zeros[:2] = pages[:2]
    table_ok = cupy.asarray(numpy.array([[0, 1, 2]], numpy.int32))
    want = cuflash2.attention_with_kvcache(q, zeros, zeros, cache_seqlens=40, block_table=table_ok)
    assert bool((out.view(cupy.uint16) == want.view(cupy.uint16)).all())
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = 7 is used"):
        cuflash2.attention_with_kvcache(q, pages, pages, cache_seqlens=40, block_table=table,
                                        check_cache=True)


def test_split_barrier_counters_and_streams_apart():
    """The splits of a row block meet at a barrier on counters kept between calls: after every
    call only their top bits (one flip a barrier) may be set, and calls on several streams at
    once (each its own counters) give the single-stream results bit for bit."""
    from cuflash2 import _kvcache

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(11)
    batch, capacity, h, hk, d = 2, 8192, 8, 2, 128
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    kwargs = dict(cache_seqlens=cupy.asarray(numpy.array([8000, 3000], numpy.int32)), causal=True)
    want = {s: cuflash2.attention_with_kvcache(q, k_cache, v_cache, num_splits=s, **kwargs)
            for s in (0, 2, 7, 64)}
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    got = []
    for _ in range(4):
        for stream in streams:
            with stream:
                got.append((stream, {s: cuflash2.attention_with_kvcache(q, k_cache, v_cache,
                                                                        num_splits=s, **kwargs)
                                     for s in (0, 2, 7, 64)}))
    cupy.cuda.Device().synchronize()
    for _, outs in got:
        for s, out in outs.items():
            assert bool((out.view(cupy.uint16) == want[s].view(cupy.uint16)).all()), s
    _check(want[0], cuflash2.attention_with_kvcache(q, k_cache, v_cache, return_lse=True,
                                                    **kwargs)[1], q, [k_cache], [v_cache], kwargs)
    used = [c for key, c in _kvcache._split_counters.buffers.items()
            if key[0] == cupy.cuda.Device().id]
    assert len(used) >= 4  # the default stream's and the three others'
    for counters in used:
        assert int(cupy.count_nonzero(counters & 0x7FFFFFFF)) == 0


def test_repeated_signature_reuses_the_checked_plan():
    """Calls whose arrays have the shapes, strides, dtypes and devices of a checked call, with the
    same other arguments, skip the checks (their plan is reused); what depends on the data itself
    is still checked or taken per call: the 16-byte alignment of the addresses, and the value of
    an int cache_seqlens (passed to the kernel as one length for every sequence)."""
    from cuflash2 import _kvcache

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(12)
    q = _randn(rng, (2, 1, 8, 128), dtype)
    k_cache, v_cache = _randn(rng, (2, 2048, 2, 128), dtype), _randn(rng, (2, 2048, 2, 128), dtype)
    for length in (2000, 37, 0):
        as_int = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length)
        as_array = cuflash2.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cupy.full((2,), length, dtype=cupy.int32))
        assert bool((as_int.view(cupy.uint16) == as_array.view(cupy.uint16)).all()), length
    default = cuflash2.attention_with_kvcache(q, k_cache, v_cache)
    full = cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=2048)
    assert bool((default.view(cupy.uint16) == full.view(cupy.uint16)).all())
    assert len(_kvcache._plans_by_key) >= 2  # int / array lengths are two signatures
    with pytest.raises(ValueError, match="int32"):
        cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=2**31)
    # Same shape and strides as q, but 2 bytes past an aligned address.
    base = _randn(rng, (2, 1, 8, 136), dtype)
    aligned, shifted = base[..., :128], base[..., 1:129]
    assert aligned.strides == shifted.strides
    cuflash2.attention_with_kvcache(aligned, k_cache, v_cache, cache_seqlens=100)
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuflash2.attention_with_kvcache(shifted, k_cache, v_cache, cache_seqlens=100)
    # A new signature is checked in full again.
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        cuflash2.attention_with_kvcache(q, k_cache.astype(BF16), v_cache, cache_seqlens=100)
    with pytest.raises(ValueError, match="num_splits"):
        cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=100, num_splits=-1)
    with pytest.raises(TypeError, match="early_cache_reads must be a bool"):
        cuflash2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=100,
                                        early_cache_reads=1)


def _programmatic_here() -> bool:
    from cuflash2 import _launch, _prepare

    return _launch.programmatic_available(_prepare.device_arch(cupy.cuda.Device().id))


def _run_recorded(stream, record, in_graph: bool):
    """What `record()` returns, its launches queued on `stream` directly or captured into a CUDA
    graph and replayed (which then keeps a programmatic edge where launches are programmatic);
    synchronised."""
    from cuflash2.bench import decode_graph

    if in_graph:
        outputs = []
        graph = decode_graph.CapturedGraph(cupy, stream, lambda: outputs.append(record()))
        if _programmatic_here():
            assert graph.programmatic_edges >= 1
        graph.launch()
        got = outputs[0]
    else:
        with stream:
            got = record()
    stream.synchronize()
    return got


@pytest.mark.parametrize("in_graph", [False, True], ids=["stream", "graph"])
def test_programmatic_launch_waits_for_the_previous_kernel(in_graph):
    """With programmatic launches (sm_90) a decode kernel starts while the kernel before it
    runs, and prefetches its cache rows: a kernel that lets it start at once, then spins 200 us
    and only then writes q and one cached K/V row, must still be seen by the decode call, bit
    for bit as when the two run one after the other (and differently from the old values)."""
    from cuflash2 import _kvcache
    from cuflash2.bench import decode_graph

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(21)
    batch, capacity, h, hk, d, length, row = 1, 4096, 8, 2, 128, 3000, 1234
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    source = _randn(rng, (batch, 1, h, d), dtype) * 4
    kwargs = dict(cache_seqlens=cupy.full((batch,), length, dtype=cupy.int32), causal=True)
    old = cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)
    stream = cupy.cuda.Stream(non_blocking=True)
    k_row, v_row = k_cache[0, row], v_cache[0, row]  # (hk, d), contiguous

    def record():
        decode_graph.launch_next_layer_inputs(cupy, source, q, k_row, v_row,
                                              delay_ns=200_000)
        return cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)

    with stream:
        cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)  # the plan, the scratch
    stream.synchronize()
    got = _run_recorded(stream, record, in_graph)
    assert all(launch.programmatic == _programmatic_here()
               for planned in _kvcache._plans_by_key.plans.values()
               for launch in planned.plan.launches)
    want = cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)  # after the writes
    assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all())
    assert not bool((got.view(cupy.uint16) == old.view(cupy.uint16)).all())
    assert bool((q == source).all())


@pytest.mark.parametrize("num_splits", [0, 1, 5], ids=["auto", "one", "barrier"])
@pytest.mark.parametrize("in_graph", [False, True], ids=["stream", "graph"])
def test_early_cache_reads_wait_for_q_and_the_new_tokens(in_graph, num_splits):
    """early_cache_reads=True: the decode kernel reads the cache before the previous kernel
    ends, but q and the appended tokens only after it. A kernel that lets the decode start at
    once, then spins 200 us and only then writes q, k and v, is seen bit for bit as when the
    two run one after the other, and the cache holds the new k and v afterwards."""
    from cuflash2.bench import decode_graph

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("early", in_graph, num_splits))
    batch, capacity, h, hk, d, length = 2, 4096, 8, 2, 128, 3000
    q = _randn(rng, (batch, 1, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    k_new, v_new = _randn(rng, (batch, 1, hk, d), dtype), _randn(rng, (batch, 1, hk, d), dtype)
    source = _randn(rng, (batch, 1, h, d), dtype) * 4
    kwargs = dict(k=k_new, v=v_new, cache_seqlens=cupy.full((batch,), length, dtype=cupy.int32),
                  causal=True, num_splits=num_splits)
    old = cuflash2.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), **kwargs)
    stream = cupy.cuda.Stream(non_blocking=True)

    def record():
        decode_graph.launch_next_layer_inputs(cupy, source, q, k_new, v_new,
                                              delay_ns=200_000)
        return cuflash2.attention_with_kvcache(q, k_cache, v_cache, early_cache_reads=True,
                                               **kwargs)

    with stream:  # the plan, the scratch
        cuflash2.attention_with_kvcache(q, k_cache, v_cache, early_cache_reads=True, **kwargs)
    stream.synchronize()
    got = _run_recorded(stream, record, in_graph)
    from cuflash2 import _kvcache  # the early specialisation runs where launches are programmatic
    assert any(launch.config.early_cache_reads for planned in _kvcache._plans_by_key.plans.values()
               for launch in planned.plan.launches) == _programmatic_here()
    assert bool((q == source).all())
    assert bool((k_cache[:, length].view(cupy.uint16) == k_new[:, 0].view(cupy.uint16)).all())
    assert bool((v_cache[:, length].view(cupy.uint16) == v_new[:, 0].view(cupy.uint16)).all())
    want = cuflash2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)  # after the writes
    assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all())
    assert not bool((got.view(cupy.uint16) == old.view(cupy.uint16)).all())


@pytest.mark.parametrize("case", [
    dict(lengths=(5, 0), seqlen_new=3),  # the first tiles hold new tokens: read after the wait
    dict(lengths=(1000, 333), seqlen_new=1, page_size=16),
    dict(lengths=(2047, 64), seqlen_new=1, page_size=64, num_splits=16),  # a cluster on sm_90
    dict(lengths=(1500, 900), seqlen_new=2, seqlen_q=4, window_size=(300, 0), alibi=True,
         num_splits=3),
    dict(lengths=(700, 2000), seqlen_new=0, seqlen_q=2, softcap=30.0),
], ids=["new-tokens-first", "paged16", "cluster", "window-alibi", "no-append"])
def test_early_cache_reads_same_bits(case):
    """With nothing written by the previous kernel, early_cache_reads=True gives the bits of the
    default call (out, lse, and the cache after the append), on every path of the loads."""
    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("early-bits", *sorted(case)))
    batch, capacity, h, hk, d = 2, 2048 + 64, 16, 2, 128
    seqlen_q, seqlen_new = case.get("seqlen_q", 1), case["seqlen_new"]
    q = _randn(rng, (batch, seqlen_q, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    kwargs = dict(cache_seqlens=cupy.asarray(numpy.array(case["lengths"], numpy.int32)),
                  causal=True, window_size=case.get("window_size", (-1, -1)),
                  softcap=case.get("softcap", 0.0), num_splits=case.get("num_splits", 0),
                  return_lse=True)
    if seqlen_new:
        kwargs["k"] = _randn(rng, (batch, seqlen_new, hk, d), dtype)
        kwargs["v"] = _randn(rng, (batch, seqlen_new, hk, d), dtype)
    if case.get("alibi"):
        kwargs["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, (batch, h)).astype(numpy.float32))
    if "page_size" in case:
        k_cache, v_cache, kwargs["block_table"] = paged_cache(k_cache, v_cache,
                                                              case["page_size"], rng)
    runs = []
    for early in (False, True):
        kc, vc = k_cache.copy(), v_cache.copy()
        out, lse = cuflash2.attention_with_kvcache(q, kc, vc, early_cache_reads=early, **kwargs)
        runs.append((out, lse, kc, vc))
    for want, got in zip(*runs):
        assert bool((got.view(cupy.uint8) == want.view(cupy.uint8)).all())


def test_decode_steps_replayed_in_a_cuda_graph():
    """The benchmark's in-graph step (8 layers, each its own cache, the next layer's q, k, v
    computed from the previous output): replaying the captured graph gives the outputs of the
    same launches run eagerly, bit for bit, and the graph keeps programmatic edges on sm_90."""
    from cuflash2.bench import decode_graph

    step = decode_graph.DecodeStep(cupy, batch=2, cache_len=2048, nheads=8, nheads_kv=2)
    start = [x.copy() for x in (step.q, step.k, step.v)]

    def restart():
        for x, x0 in zip((step.q, step.k, step.v), start):
            x[...] = x0

    with step.stream:
        restart()
        eager = step._record(keep=False)
        restart()
        step.run()
    step.stream.synchronize()
    for got, want in zip(step.outputs, eager):
        assert bool((got.view(cupy.uint16) == want.view(cupy.uint16)).all())
    assert len(step.outputs) == decode_graph.LAYERS
    if _programmatic_here():
        assert step.graph.programmatic_edges >= decode_graph.LAYERS
    for first, later in zip(step.outputs, step.outputs[1:]):  # layers differ: the chain is real
        assert not bool((first == later).all())


def test_decode_peers_on_the_same_caches():
    """`bench --decode --compare torch`'s peers: each SDPA backend either computes the step
    cuflash2 computed on the same arrays (single step) and replays its graph of layers with the
    stand-in kernel between them, or says why it refused."""
    torch = pytest.importorskip("torch")
    from cuflash2.bench import decode, decode_graph, decode_peers, timing

    backlog, flush = timing.Backlog(cupy), timing.l2_flush(cupy)
    q, kc, vc, k1, lengths = decode.decode_inputs(cupy, numpy.float16, 2, 2048, 8, 2)
    ours = cuflash2.attention_with_kvcache(q, kc, vc, k=k1, v=k1, cache_seqlens=lengths,
                                           causal=True)
    single, in_graph = {"dtype": "fp16"}, {"dtype": "fp16"}
    decode_peers.measure_single(cupy, torch, single, q, kc, vc, ours, 1, 2, backlog, flush)
    step = decode_graph.DecodeStep(cupy, batch=2, cache_len=2048, nheads=8, nheads_kv=2)
    q_before = step.q.copy()
    decode_peers.measure_graph(cupy, torch, in_graph, step, 1, 2, backlog, flush)
    cupy.cuda.runtime.deviceSynchronize()
    for key, _ in decode_peers.PEERS:
        if single[f"{key}_error"] is None:
            assert single[f"{key}_us"] > 0 and single[f"{key}_max_abs_diff"] < 1e-2, key
        else:
            assert single[f"{key}_us"] is None and single[f"{key}_error"].strip()
        if in_graph[f"{key}_error"] is None:
            assert in_graph[f"{key}_us_per_layer"] > 0
        else:
            assert in_graph[f"{key}_us_per_layer"] is None and in_graph[f"{key}_error"].strip()
    assert single["sdpa_flash_error"] is None and in_graph["sdpa_flash_error"] is None
    assert not bool((step.q == q_before).all())  # the peers' layers ran the chain of q's


@pytest.mark.parametrize("num_splits", [2, 7, 16])
@pytest.mark.parametrize("seqlen_q,heads", [(1, (32, 4)), (3, (8, 8)), (5, (16, 2))])
def test_cluster_and_barrier_merges(num_splits, seqlen_q, heads):
    """The two split merges, inside a thread-block cluster (sm_90) and through the barrier in
    L2, both within the 2x rule of the reference, with ragged lengths, several row blocks and
    the appended token; on sm_90 the first runs as a cluster of the splits."""
    from cuflash2 import _dispatch, _kvcache, _launch, _prepare

    dtype = numpy.dtype(numpy.float16)
    rng = numpy.random.default_rng(seed_of("cluster", num_splits, seqlen_q, *heads))
    batch, capacity, d = 3, 3000, 128
    h, hk = heads
    q = _randn(rng, (batch, seqlen_q, h, d), dtype)
    k_cache, v_cache = _randn(rng, (batch, capacity, hk, d), dtype), _randn(rng, (batch, capacity, hk, d), dtype)
    k_new, v_new = _randn(rng, (batch, 1, hk, d), dtype), _randn(rng, (batch, 1, hk, d), dtype)
    lengths = numpy.array([2999, 1500, 77], numpy.int32)
    kwargs = dict(k=k_new, v=v_new, cache_seqlens=cupy.asarray(lengths), causal=True)
    clustered = _prepare.device_arch(cupy.cuda.Device().id) >= 90
    saved, clusters_seen = _dispatch.CLUSTER_MERGE, []
    try:
        for cluster_merge in (True, False):
            _dispatch.CLUSTER_MERGE = cluster_merge
            _kvcache._plans_by_key.plans.clear()
            copies = [k_cache.copy()], [v_cache.copy()]
            out, lse = cuflash2.attention_with_kvcache(q, copies[0][0], copies[1][0],
                                                       num_splits=num_splits, return_lse=True,
                                                       **kwargs)
            _check(out, lse, q, [k_cache], [v_cache], kwargs)
            (planned,) = _kvcache._plans_by_key.plans.values()
            launch = planned.plan.launches[0]
            if launch.cluster > 1:
                assert cluster_merge and clustered and launch.cluster == planned.splits
            elif cluster_merge and clustered:  # only where the grid's clusters do not fit
                assert not _launch.cluster_fits(launch.config, cupy.cuda.Device().id,
                                                planned.splits, planned.groups)
            assert launch.cooperative == (launch.cluster == 1 and planned.splits > 1)
            clusters_seen.append(launch.cluster > 1)
    finally:
        _dispatch.CLUSTER_MERGE = saved
        _kvcache._plans_by_key.plans.clear()
    if clustered and heads == (32, 4):  # 12 clusters: they fit
        assert clusters_seen[0]
