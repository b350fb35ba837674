"""GPU tests of the FP8 (e4m3) forward: cuflash2.attention(q, k, v, qkv_dtype="e4m3",
q_descale=, k_descale=, v_descale=, out_dtype=) on the Hopper kernel (docs/FP8_FORWARD.md).

q, k and v are uint8 arrays of e4m3 bits: fresh standard-normal draws per test (seeds from
grids.seed_of) times a factor per (batch, KV head) in [0.5, 2] (or per tensor, or none),
quantised with fp8.quantize_e4m3 so that the bits span e4m3's range (fp8_forward_checks.fp8_qkv).
The rule is flash-attn's 2x rule (fp8_forward_checks.check_forward_fp8): ref_hi the float64
reference on the dequantised inputs, ref_lo the reference with the unnormalised probabilities
rounded to e4m3 and the output to out_dtype; the lse against the float64 reference's
(testing.lse_close). Outputs are written into memory poisoned with NaN (the pool's freed blocks,
or a given `out=` filled with NaN).

Covered: head dims 64, 128 and 256, causal and not, seqlen_q != seqlen_k and odd lengths (1 to
2081), long flat rows (16k keys), the wider key tiles forced (E4M3_WIDE_TILES), GQA (8:2), MQA (8:1) and MHA, windows, a softmax_scale, unbatched
inputs, per-tensor and per-(batch, KV head) descales and none, out_dtype bfloat16 and float16, out=
given and returned as is, descales read at every call (new arrays and new values in the same
arrays) and shared along an axis (broadcast views), k and v as strided views, the kernel
`forward_kernels` names, and the refusals (uint8 without qkv_dtype, the features the FP8 forward
does not take, GPUs other than sm_90). The host-side checks that need no GPU are in
tests/test_fp8_forward_host.py.

Varlen (`attention_varlen(..., qkv_dtype="e4m3")`, FEATURE_VARLEN on the one-tile-per-CTA grid):
ragged batches with empty and one-token sequences, sequences without keys (out 0, lse +inf),
seqlen_q != seqlen_k per sequence, GQA and MQA, causal and not, windows, at every head dim;
descales per (sequence, KV head), per tensor and none; both output dtypes into a poisoned `out=`;
max lengths above the longest; a plan reused with new arrays; and each sequence bitwise the
dense call on it alone (fp8_forward_checks.fp8_varlen_qkv, check_varlen_forward_fp8: the same
rule against reference.attention_varlen). A box past a sequence's end reads the next sequence's
rows (keys masked, V rows meeting P = 0 after the in-kernel transpose), which the ragged layouts
check: every sequence but the last has a neighbour.
"""

import numpy
import pytest
from fp8_forward_checks import (check_forward_fp8, check_varlen_forward_fp8,  # tests/gpu
                                describe, fp8_qkv, fp8_varlen_qkv)
from grids import BF16, FP16, is_hopper, needs_hopper, seed_of

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _configs, _dispatch, api, testing  # noqa: E402

pytestmark = pytest.mark.gpu

OUT_DTYPES = [pytest.param(None, id="default"), pytest.param(BF16, id="bf16"),
              pytest.param(FP16, id="fp16")]


def _poison():
    """NaN in the memory the next allocations get (CuPy's pool hands freed blocks back)."""
    block = cupy.full((1 << 22,), numpy.nan, numpy.float32)
    del block


def _inputs(tag, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, descale="head"):
    seed = seed_of("fp8-forward", tag, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                   descale)
    return fp8_qkv(cupy, seed, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, descale)


def _check(q, k, v, descales, *, out_dtype=None, out=None, **options):
    """One call (out and lse), its outputs' dtypes and shapes, and the rule."""
    given = out
    if out is None:
        _poison()
    dtype_option = {} if out_dtype is None else {"out_dtype": out_dtype}
    got, lse = cuflash2.attention(q, k, v, qkv_dtype="e4m3", return_lse=True, out=out,
                                  **descales, **dtype_option, **options)
    _check_out(got, given, q, out_dtype)
    heads_first = (q.shape[-2], q.shape[-3])
    assert lse.dtype == numpy.float32 and lse.shape == q.shape[:-3] + heads_first
    _assert_rule(check_forward_fp8(q, k, v, got, lse, out_dtype=out_dtype, **descales,
                                   **options))
    return got, lse


def _check_out(got, given, q, out_dtype):
    """The output's dtype (bfloat16 unless out_dtype) and shape, and a given `out=` returned."""
    assert got.dtype == numpy.dtype(BF16 if out_dtype is None else out_dtype)
    assert got.shape == q.shape
    if given is not None:
        assert got is given


def _assert_rule(results):
    print(describe(results))
    assert all(r.ok for r in results), describe(results)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_head_dims(headdim, causal):
    """Each head dim, GQA 8:2 with a descale per (batch, KV head), odd lengths, seqlen_q <
    seqlen_k (causal: aligned bottom-right)."""
    q, k, v, descales = _inputs("d", 2, 113, 257, 8, 2, headdim)
    _check(q, k, v, descales, causal=causal)


@needs_hopper
@pytest.mark.parametrize("seqlens", [(1, 1), (1, 1000), (17, 113), (113, 17), (257, 257),
                                     (1000, 2081), (2048 + 33, 2048 + 33)])
def test_lengths(seqlens):
    """Lengths from 1 to 2081 (several K/V tiles, partial last tiles), seqlen_q > seqlen_k (the
    first rows of a causal call see no key: out 0, lse +inf), per-tensor descales."""
    q, k, v, descales = _inputs("len", 1, *seqlens, 4, 2, 128, "tensor")
    _check(q, k, v, descales, causal=True)
    _check(q, k, v, descales)


@needs_hopper
@pytest.mark.parametrize("layout", [(2, 97, 255, 8, 2), (1, 255, 97, 8, 1),
                                    (2, 113, 113, 4, 4)], ids=["gqa", "mqa", "mha"])
def test_gqa_and_mqa(layout):
    """Query heads read their KV head's K, V and descales (q's too): GQA, MQA (8:1) and MHA at
    d=64, with short key rows (the 16-bit d=64 calls of <= 256 keys run on mma.sync, the FP8
    ones on the Hopper kernel)."""
    q, k, v, descales = _inputs("heads", *layout, 64)
    _check(q, k, v, descales, causal=True)
    _check(q, k, v, descales)


WIDE_TILES = [(d, tile) for d, tiles in _dispatch.E4M3_WIDE_TILES.items() for tile in tiles]


@needs_hopper
@pytest.mark.parametrize("seqlens", [(113, 257), (1000, 2081), (480, 480), (257, 31)])
@pytest.mark.parametrize("headdim,tile", WIDE_TILES,
                         ids=[f"d{d}-n{tile[0]}" for d, tile in WIDE_TILES])
def test_wide_key_tiles(headdim, tile, seqlens):
    """The wider key tiles of E4M3_WIDE_TILES (not dispatched; forced): the transposed V's last
    panel of 32-key groups (160: one, 224: three), tiles whose keys end inside it and past the
    sequence, causal tiles that a 128-row block crosses at any key (block_n no multiple of
    block_m), GQA 8:2, descales per (batch, KV head), causal and not, and a window."""
    config = _dispatch.e4m3_sm90_config("e4m3_bf16", headdim, tile)
    q, k, v, descales = _inputs("wide", 2, *seqlens, 8, 2, headdim)
    with api._forced_config(config):
        for options in (dict(causal=True), dict(), dict(window_size=(300, 40))):
            _check(q, k, v, descales, **options)
            assert cuflash2.forward_kernels(q, k, v, qkv_dtype="e4m3", **descales,
                                            **options) == [_configs.describe(config)]


@needs_hopper
@pytest.mark.parametrize("window,causal", [((64, 0), False), ((40, 10), False),
                                           ((-1, 32), False), ((100, -1), False),
                                           ((128, -1), True)])
def test_windows(window, causal):
    """Sliding windows (left, right; -1 unbounded), alone and with causal."""
    q, k, v, descales = _inputs("window", 2, 300, 700, 4, 2, 128)
    _check(q, k, v, descales, window_size=window, causal=causal)


@needs_hopper
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("descale", ["none", "tensor", "head"])
def test_descales_and_out_dtypes(descale, out_dtype):
    """No descales (factor 1), one a tensor (q's of shape (), k's and v's (1,)), and one per
    (batch, KV head); the output in bfloat16 (the default) or float16, written into a given
    `out` (poisoned with NaN) and returned as is."""
    q, k, v, descales = _inputs("descale", 2, 200, 333, 8, 2, 128, descale)
    out = testing.poison_like(cupy, q.shape, BF16 if out_dtype is None else out_dtype)
    _check(q, k, v, descales, out_dtype=out_dtype, out=out, causal=True)


@needs_hopper
def test_softmax_scale_and_unbatched_inputs():
    """A softmax_scale other than 1/sqrt(d) (sharper: scores of up to tens), on unbatched
    (seqlen, heads, d) arrays with (1, nheads_kv) descales, at d=256."""
    q, k, v, descales = _inputs("unbatched", None, 150, 390, 4, 2, 256)
    _check(q, k, v, descales, softmax_scale=0.3, causal=True)
    _check(q, k, v, descales, softmax_scale=0.3)


@needs_hopper
@pytest.mark.parametrize("headdim", [64, 128])
def test_long_flat_rows(headdim):
    """16k keys, scores of spread 2: most of each row's mass in probabilities between 2^-9 and
    2^-6 of its largest, which keep e4m3's mantissa only as 256 P (E4M3_P_SCALE_LOG2); the
    references round P as the kernel does."""
    q, k, v, descales = _inputs("flat", 1, 100, 16384, 4, 2, headdim)
    _check(q, k, v, descales, softmax_scale=2 / headdim ** 0.5)


@needs_hopper
def test_descales_are_read_at_every_call():
    """The descales' values are read on the device at each call, not kept by the plan: new
    arrays of the same signature, and new values written into the same arrays, both change the
    result as the reference says (v_descale twice: the output twice; q_descale otherwise: another
    softmax)."""
    q, k, v, descales = _inputs("per-call", 2, 180, 260, 8, 2, 128)
    first, _ = _check(q, k, v, descales, causal=True)
    doubled = dict(descales, v_descale=descales["v_descale"] * 2)
    twice, _ = _check(q, k, v, doubled, causal=True)
    numpy.testing.assert_allclose(twice.astype(numpy.float32).get(),
                                  2 * first.astype(numpy.float32).get(), rtol=1e-2, atol=1e-2)
    rng = numpy.random.default_rng(seed_of("fp8-forward-per-call-values"))
    for name in ("q_descale", "k_descale", "v_descale"):  # in place: same pointers
        descales[name][...] = cupy.asarray(
            rng.uniform(0.5, 2.0, descales[name].shape).astype(numpy.float32)
            * descales[name].get())
    _check(q, k, v, descales, causal=True)


@needs_hopper
def test_shared_descales_and_strided_views():
    """Descales shared along an axis (cupy.broadcast_to views, stride 0: one factor a KV head
    for every sequence, one a sequence for every KV head), and k, v as views of wider arrays
    (row strides of 16-byte multiples, not their head dim)."""
    q, k, v, descales = _inputs("views", 2, 160, 300, 8, 2, 128)
    shared = {"q_descale": cupy.broadcast_to(descales["q_descale"][:1], (2, 2)),
              "k_descale": cupy.broadcast_to(descales["k_descale"][:, :1], (2, 2)),
              "v_descale": descales["v_descale"]}
    _check(q, k, v, shared, causal=True)
    wide_k = cupy.zeros(k.shape[:-1] + (160,), numpy.uint8)
    wide_v = cupy.zeros(v.shape[:-1] + (192,), numpy.uint8)
    wide_k[..., 32:] = k
    wide_v[..., :128] = v
    _check(q, wide_k[..., 32:], wide_v[..., :128], descales)


@needs_hopper
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_kernels_named(headdim):
    """forward_kernels names the Hopper forward with the e4m3 element (alone: V is transposed
    in the kernel, no operand pass runs before it)."""
    q, k, v, descales = _inputs("named", 1, 300, 300, 4, 2, headdim)
    kernels = cuflash2.forward_kernels(q, k, v, causal=True, qkv_dtype="e4m3", **descales)
    main = [name for name in kernels if name.startswith("Hopper forward")]
    assert len(main) == 1, kernels
    assert "e4m3" in main[0] and f"head dim {headdim}" in main[0], kernels
    assert not any(name.startswith("mma.sync") for name in kernels), kernels


@needs_hopper
def test_what_the_fp8_forward_does_not_take():
    """On CuPy arrays (tests/test_fp8_forward_host.py checks the same and more without a GPU):
    uint8 without qkv_dtype, and each feature the FP8 forward does not take, by name."""
    q, k, v, descales = _inputs("refused", 1, 64, 64, 4, 2, 128)
    with pytest.raises(TypeError, match="qkv_dtype"):
        cuflash2.attention(q, k, v)
    slopes = cupy.asarray(numpy.linspace(0.05, 0.4, 4, dtype=numpy.float32))
    sinks = cupy.zeros((4,), numpy.float32)
    for name, value in (("softcap", 5.0), ("dropout_p", 0.1), ("alibi_slopes", slopes),
                        ("sinks", sinks)):
        extra = {"seed": 1} if name == "dropout_p" else {}
        with pytest.raises((NotImplementedError, ValueError, TypeError), match=name):
            cuflash2.attention(q, k, v, qkv_dtype="e4m3", **{name: value}, **extra,
                               **descales)


@pytest.mark.skipif(is_hopper(), reason="the refusal of GPUs other than sm_90")
def test_other_gpus_refuse_fp8_naming_sm90():
    q, k, v, descales = _inputs("not-hopper", 1, 64, 64, 4, 2, 128)
    with pytest.raises(NotImplementedError, match="sm_90"):
        cuflash2.attention(q, k, v, qkv_dtype="e4m3", **descales)


@needs_hopper
def test_cuda_graph_replays_with_fresh_inputs():
    """A captured call (the forward, one launch on the call's stream, reading v in place)
    replayed as a serving loop replays it: new e4m3 values and new factors in the same arrays
    before each replay."""
    from cuflash2.bench.decode_graph import CapturedGraph

    q, k, v, descales = _inputs("graph", 2, 200, 300, 4, 2, 128, "head")
    captured = {}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # planned and compiled outside the capture
        cuflash2.attention(q, k, v, qkv_dtype="e4m3", causal=True, **descales)
    stream.synchronize()
    graph = CapturedGraph(cupy, stream, lambda: captured.update(
        out=cuflash2.attention(q, k, v, qkv_dtype="e4m3", causal=True, **descales)))
    for replay in range(3):
        fresh_q, fresh_k, fresh_v, fresh = _inputs(f"graph-{replay}", 2, 200, 300, 4, 2, 128,
                                                   "head")
        for x, y in ((q, fresh_q), (k, fresh_k), (v, fresh_v)):
            x[...] = y
        for name, factor in fresh.items():
            descales[name][...] = factor
        cupy.cuda.Device().synchronize()
        graph.launch()
        stream.synchronize()
        results = check_forward_fp8(q, k, v, captured["out"], None, causal=True, **descales)
        assert all(r.ok for r in results), describe(results)


# --------------------------------------------------------------------------------------------
# attention_varlen

#: (lengths_q, lengths_k, nheads, nheads_kv), as tests/gpu/test_hopper_varlen.py's layouts: an
#: empty and a one-token sequence among odd lengths (several K/V tiles, 700 keys), seqlen_q !=
#: seqlen_k per sequence with GQA (the first rows of a causal sequence with fewer keys than
#: queries see none), and sequences without keys (out 0, lse +inf) with MQA.
VARLEN_LAYOUTS = {
    "ragged": ([97, 1, 0, 300, 64, 129], [97, 1, 0, 700, 64, 129], 4, 4),
    "sq!=sk-gqa": ([33, 250, 129, 1], [600, 17, 129, 5], 8, 2),
    "empty-k-mqa": ([40, 130, 7], [0, 530, 0], 4, 1),
}


def _varlen_inputs(tag, layout, headdim, descale="head"):
    lengths_q, lengths_k, nheads, nheads_kv = VARLEN_LAYOUTS[layout]
    seed = seed_of("fp8-varlen", tag, layout, headdim, descale)
    return fp8_varlen_qkv(cupy, seed, lengths_q, lengths_k, nheads, nheads_kv, headdim, descale)


def _check_varlen(q, k, v, args, descales, *, out_dtype=None, out=None, **options):
    """One attention_varlen call (out and lse), the kernel it runs, its outputs' dtypes and
    shapes (lse (nheads, total_q)), and the rule."""
    dtype_option = {} if out_dtype is None else {"out_dtype": out_dtype}
    (kernel,) = cuflash2.varlen_forward_kernels(q, k, v, *args, qkv_dtype="e4m3", **descales,
                                                **dtype_option, **options)
    assert kernel.startswith("Hopper forward") and "e4m3" in kernel, kernel
    assert "varlen" in kernel and "persistent" not in kernel, kernel
    given = out
    if out is None:
        _poison()
    got, lse = cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", return_lse=True,
                                         out=out, **descales, **dtype_option, **options)
    _check_out(got, given, q, out_dtype)
    assert lse.dtype == numpy.float32 and lse.shape == (q.shape[1], q.shape[0])
    _assert_rule(check_varlen_forward_fp8(q, k, v, args, got, lse, out_dtype=out_dtype,
                                          **descales, **options))
    return got, lse


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("layout", list(VARLEN_LAYOUTS))
def test_varlen(layout, headdim, causal):
    """Each head dim and layout, causal and not, descales per (sequence, KV head)."""
    q, k, v, args, descales = _varlen_inputs("layout", layout, headdim)
    _check_varlen(q, k, v, args, descales, causal=causal)


@needs_hopper
@pytest.mark.parametrize("window,causal", [((64, 0), False), ((40, 10), False),
                                           ((-1, 32), False), ((128, -1), True)])
def test_varlen_windows(window, causal):
    """Sliding windows, bottom-right aligned per sequence."""
    q, k, v, args, descales = _varlen_inputs("window", "sq!=sk-gqa", 128)
    _check_varlen(q, k, v, args, descales, window_size=window, causal=causal)


@needs_hopper
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("descale", ["none", "tensor", "head"])
def test_varlen_descales_and_out_dtypes(descale, out_dtype):
    """No descales, one a tensor (() and (1,)), one per (sequence, KV head); the output in
    bfloat16 or float16 into a given `out` poisoned with NaN, returned as is."""
    q, k, v, args, descales = _varlen_inputs("descale", "ragged", 128, descale)
    out = testing.poison_like(cupy, q.shape, BF16 if out_dtype is None else out_dtype)
    _check_varlen(q, k, v, args, descales, out_dtype=out_dtype, out=out, causal=True)


@needs_hopper
def test_varlen_max_lengths_above_the_longest_and_plans_reused():
    """max_seqlen_q / max_seqlen_k above the longest sequence (more m blocks than any sequence
    has: their CTAs exit), and a second call of the same signature with new arrays, lengths
    and factors (the plan's maps patched, the descales read at the call, the lengths checked
    again)."""
    for seed in ("first", "second"):  # the same totals (413 rows, 751 keys): one signature
        lengths_q = [33, 250, 129, 1] if seed == "first" else [200, 3, 70, 140]
        lengths_k = [600, 17, 129, 5] if seed == "first" else [9, 400, 31, 311]
        q, k, v, args, descales = fp8_varlen_qkv(
            cupy, seed_of("fp8-varlen-plans", seed), lengths_q, lengths_k, 8, 2, 128)
        args = (args[0], args[1], 300, 650)
        _check_varlen(q, k, v, args, descales, causal=True)


@needs_hopper
@pytest.mark.parametrize("headdim,options", [(64, dict(causal=True)), (256, dict()),
                                             (128, dict(window_size=(100, 0)))],
                         ids=["d64-causal", "d256", "d128-window"])
def test_varlen_equals_the_dense_call_per_sequence(headdim, options):
    """Each sequence of a varlen call against the dense FP8 call on that sequence alone with its
    row of the factors, on the one-tile grid as the varlen call (forced: the dispatcher takes
    the persistent grid for a short dense row, and a window wider than both lengths is no
    window, check_window's -1, so d=128's window makes a short sequence causal): the same tiles
    and order of operations, so bitwise equal out and lse (the neighbours' rows the boxes read
    change nothing: their keys are masked, their V rows meet P = 0)."""
    q, k, v, args, descales = _varlen_inputs("dense", "ragged", headdim)
    cu_q, cu_k = (cupy.asnumpy(c) for c in args[:2])
    out, lse = cuflash2.attention_varlen(q, k, v, *args, qkv_dtype="e4m3", return_lse=True,
                                         **descales, **options)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        qs, ks, vs = (cupy.ascontiguousarray(x[None]) for x in (q[rows], k[keys], v[keys]))
        factors = {name: cupy.ascontiguousarray(d[b:b + 1]) for name, d in descales.items()}
        with api._forced_config(_dispatch.e4m3_sm90_config("e4m3_bf16", headdim)):
            dense, dense_lse = cuflash2.attention(qs, ks, vs, qkv_dtype="e4m3", return_lse=True,
                                                  **factors, **options)
        assert bool(cupy.array_equal(out[rows].view(cupy.uint16), dense[0].view(cupy.uint16)))
        assert bool(cupy.array_equal(lse[:, rows], dense_lse[0])), b
