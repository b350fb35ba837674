"""GPU tests of the forward's dispatch on Hopper (sm_90): which kernel runs a call, and the
Hopper kernel (cuda_src/flash_fwd_sm90.cu) against the reference where the rest of the suite
does not reach it, plus the mma.sync forward, which the Hopper kernel replaces on sm_90 for the
calls it covers, on the same calls.

On other GPUs the dispatch tests check that the mma.sync kernel runs everything; the Hopper
kernel tests skip.
"""


import numpy
import pytest
from grids import BF16, DTYPES, FP16
from grids import is_hopper, needs_hopper, score_mod_options, switched
from grids import seed_of as _seed

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import _configs, _dispatch, api, testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _hopper_forward(enabled: bool):
    """Plans made inside use (or not) the Hopper forward."""
    return switched(_dispatch, {"HOPPER_FORWARD": enabled}, api._forward_plans)


def _qkv(batch, sq, sk, h, hkv, d, dtype):
    return testing.random_qkv(cupy, batch, sq, sk, h, hkv, d, dtype,
                              _seed(batch, sq, sk, h, hkv, d, str(dtype)))


def _check(q, k, v, **options):
    out, lse = cuflash2.attention(q, k, v, return_lse=True, **options)
    results = testing.check_forward(q, k, v, out, lse, **options)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    return out, lse


# --------------------------------------------------------------------------------------------
# Which kernel runs


def test_forward_kernels_names_the_kernel_of_the_call():
    q, k, v = _qkv(1, 64, 600, 2, 2, 64, FP16)
    (kernel,) = cuflash2.forward_kernels(q, k, v, causal=True)
    if is_hopper():
        assert kernel.startswith("Hopper forward") and "head dim 64" in kernel
    else:
        assert kernel.startswith("mma.sync forward")


@pytest.mark.parametrize("case", ["dropout", "varlen_features", "disabled", "beyond",
                                  "short_d64"])
def test_calls_the_hopper_kernel_does_not_cover_run_on_mma_sync(case):
    q, k, v = _qkv(1, 64, 600, 2, 2, 64, FP16)
    if case == "short_d64":  # faster on mma.sync (_dispatch.MMA_SYNC_MAX_KEYS)
        q, k, v = _qkv(1, 64, _dispatch.MMA_SYNC_MAX_KEYS, 2, 2, 64, FP16)
    options = {}
    if case == "dropout":
        options = {"dropout_p": 0.1, "seed": 1}
    elif case == "beyond":  # a head dim past every Hopper specialisation, if there is one
        d = max(_configs.SM90_FWD_HEAD_DIMS) + 8
        if d > 256:
            pytest.skip("the Hopper kernels cover every head dim")
        q, k, v = _qkv(1, 64, 64, 2, 2, d, FP16)
    elif case == "varlen_features":
        assert _dispatch.hopper_forward_config(
            _Problem(), _configs.FEATURE_VARLEN, (-1, -1), 90, varlen=object()) is None
        return
    with _hopper_forward(case != "disabled"):
        (kernel,) = cuflash2.forward_kernels(q, k, v, **options)
    assert kernel.startswith("mma.sync forward"), kernel


class _Problem:
    batch = seqlen_q = seqlen_k = nheads = 1
    head_dim = head_dim_v = 64
    dtype = "float16"


@needs_hopper
def test_a_plan_hit_patches_the_tensor_map_addresses():
    """Two calls of one signature on different arrays: the second reads its own q, k, v (the
    maps' address words are patched like the struct's pointers)."""
    first = _qkv(2, 200, 300, 4, 2, 128, BF16)
    second = tuple((x.astype(cupy.float32) * 0.5 + 0.25).astype(BF16)
                   for x in _qkv(2, 200, 300, 4, 2, 128, BF16))
    _check(*first, causal=True)
    assert len(api._forward_plans) >= 1
    _check(*second, causal=True)
    out_first = cuflash2.attention(*first, causal=True)
    out_again = cuflash2.attention(*first, causal=True)
    assert bool((out_first.view(numpy.uint16) == out_again.view(numpy.uint16)).all())


# --------------------------------------------------------------------------------------------
# The Hopper kernel where the rest of the suite does not reach it


@needs_hopper
@pytest.mark.parametrize("headdim", [8, 40, 64, 72, 96, 104, 128, 136, 160, 192, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_head_dim(dtype, causal, headdim):
    """Each Hopper kernel dim and head dims below it (columns past the head dim zero-filled by
    the TMA, never stored), GQA, seqlen_q != seqlen_k; 600 keys keep d <= 64 on this kernel."""
    q, k, v = _qkv(1, 333, 600, 4, 2, headdim, dtype)
    (kernel,) = cuflash2.forward_kernels(q, k, v, causal=causal)
    kernel_dim = min(d for d in _configs.SM90_FWD_HEAD_DIMS if d >= headdim)
    assert kernel.startswith("Hopper") and f"head dim {kernel_dim}," in kernel, kernel
    _check(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("window", [(-1, -1), (64, 0), (100, 30), (0, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_windows(dtype, window):
    q, k, v = _qkv(2, 333, 517, 4, 2, 64, dtype)
    assert cuflash2.forward_kernels(q, k, v, window_size=window)[0].startswith("Hopper")
    _check(q, k, v, window_size=window)


@needs_hopper
@pytest.mark.parametrize("mods", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_modifiers(dtype, mods):
    q, k, v = _qkv(2, 257, 389, 4, 4, 128, dtype)
    options = score_mod_options(cupy, mods)
    assert cuflash2.forward_kernels(q, k, v, **options)[0].startswith("Hopper")
    _check(q, k, v, **options)


@needs_hopper
def test_strided_views_and_a_strided_out():
    """q, k, v as views of a packed qkv, out a view of a wider array: no copies on either
    side (the maps take the arrays' strides; the epilogue the output's)."""
    rng = numpy.random.default_rng(7)
    qkv = cupy.asarray(rng.standard_normal((2, 300, 3, 4, 128), numpy.float32).astype(FP16))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    wide = cupy.full((2, 300, 4, 160), numpy.nan, dtype=FP16)
    out = wide[..., :128]
    assert cuflash2.forward_kernels(q, k, v, out=out)[0].startswith("Hopper")
    cuflash2.attention(q, k, v, causal=True, out=out)
    results = testing.check_forward(q, k, v, out, causal=True)
    assert all(r.ok for r in results), "; ".join(map(str, results))
    assert bool(cupy.isnan(wide[..., 128:].astype(cupy.float32)).all())  # untouched
    out2 = cuflash2.attention_qkvpacked(qkv, causal=True)
    assert bool((out2.view(numpy.uint16) == out.view(numpy.uint16)).all())


@needs_hopper
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 700), (700, 1), (129, 128), (128, 129)])
def test_short_and_ragged_lengths(sq, sk):
    q, k, v = _qkv(3, sq, sk, 2, 1, 128, BF16)
    assert cuflash2.forward_kernels(q, k, v)[0].startswith("Hopper")
    _check(q, k, v, causal=True)
    _check(q, k, v)


@needs_hopper
def test_unbatched_inputs():
    q, k, v = (x[0] for x in _qkv(1, 190, 230, 4, 4, 128, FP16))
    # x[None] has batch stride 0: described with stride 16 (extent 1), so the Hopper kernel
    assert cuflash2.forward_kernels(q, k, v, causal=True)[0].startswith("Hopper"), "fallback"
    out, lse = _check(q, k, v, causal=True)
    assert out.shape == q.shape and lse.shape == (4, 190)


@needs_hopper
@pytest.mark.parametrize("shape", [(2, 333, 600, 4, 2, 64), (1, 1000, 700, 4, 1, 40),
                                   (1, 700, 4111, 2, 2, 64), (1, 4100, 4100, 2, 2, 56),
                                   (3, 193, 191, 4, 4, 64), (1, 5000, 5000, 2, 1, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_three_consumer_warpgroups(dtype, causal, shape):
    """d <= 64 with three consumer warpgroups (192-row tiles; _dispatch.THREE_CONSUMER_MIN_KEYS)
    wherever the dispatcher gives them a call, on both grids (persistent up to
    THREE_CONSUMER_PERSISTENT_MAX_KEYS keys): odd lengths, rows past a 192-row tile's end,
    seqlen_q != seqlen_k both ways, GQA/MQA; and forced where it would not (short causal rows,
    rows short enough for mma.sync),
    softcap and ALiBi together included, against the reference too."""
    q, k, v = _qkv(*shape, dtype)
    sk = shape[2]
    hopper = sk > _dispatch.MMA_SYNC_MAX_KEYS  # shorter rows: mma.sync
    three = hopper and sk >= _dispatch.THREE_CONSUMER_MIN_KEYS[64, causal]
    (kernel,) = cuflash2.forward_kernels(q, k, v, causal=causal)
    assert kernel.startswith("Hopper" if hopper else "mma.sync"), kernel
    assert ("three warpgroups" in kernel) == three, kernel
    if three:
        assert ("persistent" in kernel) == (sk <= _dispatch.THREE_CONSUMER_PERSISTENT_MAX_KEYS)
    _check(q, k, v, causal=causal)
    with switched(_dispatch, {"THREE_CONSUMER_MIN_KEYS": {(64, False): 0, (64, True): 0},
                            "MMA_SYNC_MAX_KEYS": 0}, api._forward_plans):
        assert "three warpgroups" in cuflash2.forward_kernels(q, k, v, causal=causal)[0]
        _check(q, k, v, causal=causal)
        slopes = cupy.asarray(numpy.linspace(0.05, 0.4, shape[3], dtype=numpy.float32))
        options = {"causal": causal, "softcap": 5.0, "alibi_slopes": slopes}
        assert "three warpgroups" in cuflash2.forward_kernels(q, k, v, **options)[0]
        _check(q, k, v, **options)


@needs_hopper
@pytest.mark.parametrize("sq,sk,window", [
    (512, 512, (-1, 0)),    # causal: a diagonal tile's upper 64 rows see its left half
    (256, 320, (-1, 0)),    # the diagonal 64 keys into a tile: the lower rows' half tile
    (300, 200, (-1, 0)),    # seqlen_q > seqlen_k: rows that see no key
    (333, 1000, (-1, 0)),   # seqlen_q < seqlen_k
    (400, 400, (-1, 40)),   # a right edge 40 keys past the diagonal
    (400, 400, (90, 0)),    # a window: a key limit and a lower edge
    (250, 150, (-1, -1)),   # no key limit: a sequence tail 22 keys into its last tile
])
@pytest.mark.parametrize("grid", ["one", "persistent", "claimed"])
@pytest.mark.parametrize("headdim", [64, 96, 128])
def test_half_tiles(headdim, grid, sq, sk, window):
    """A warpgroup whose rows see only the left half of its work tile's first KV tile runs the
    softmax of that half alone (consume_tile in flash_fwd_sm90.cu, two consumer warpgroups):
    against the reference, into a poisoned output, on the one-tile grid and the persistent
    one (tiles taken statically or claimed), with the row blocks' diagonals, window edges and
    sequence tails at those places in their tiles."""
    always, never = 1 << 40, -1
    limit = never if grid == "one" else always
    q, k, v = _qkv(2, sq, sk, 4, 2, headdim, BF16)
    with switched(_dispatch, {
            "MMA_SYNC_MAX_KEYS": 0, "THREE_CONSUMER_MIN_KEYS": {},
            "PERSISTENT_MAX_KEYS": {key: limit for key in _dispatch.PERSISTENT_MAX_KEYS},
            "DYNAMIC_SCHEDULE": grid == "claimed",
            "DYNAMIC_SCHEDULE_KEYS": {dim: (0, always) for dim in (64, 96, 128)}},
            api._forward_plans):
        (kernel,) = cuflash2.forward_kernels(q, k, v, window_size=window)
        assert "three warpgroups" not in kernel, kernel
        assert ("persistent" in kernel) == (grid != "one"), kernel
        out = cupy.full(q.shape, numpy.nan, dtype=q.dtype)
        _, lse = cuflash2.attention(q, k, v, window_size=window, out=out, return_lse=True)
        results = testing.check_forward(q, k, v, out, lse, window_size=window)
        assert all(r.ok for r in results), "; ".join(map(str, results))


def _persistent_everywhere(dynamic: bool, ctas=None):
    """Plans made inside run every Hopper call the persistent grid takes at all on it (at most
    `ctas` CTAs), its tiles claimed dynamically under a key limit or not (DYNAMIC_SCHEDULE)."""
    always = 1 << 40
    slots = _dispatch.persistent_slots
    return switched(_dispatch, {
        "PERSISTENT_MAX_KEYS": {key: always for key in _dispatch.PERSISTENT_MAX_KEYS},
        "THREE_CONSUMER_PERSISTENT_MAX_KEYS": always, "DYNAMIC_SCHEDULE": dynamic,
        "DYNAMIC_SCHEDULE_KEYS": {dim: (0, always) for dim in (64, 96, 128)},
        "persistent_slots": (lambda config, device: min(ctas, slots(config, device))) if ctas
        else slots}, api._forward_plans)


def _stream_counters():
    from cuflash2 import _plans

    stream = cupy.cuda.get_current_stream().ptr
    return _plans.stream_counters.buffers[(cupy.cuda.Device().id, stream)]


def _same_bits(a, b):
    return bool((a.view(numpy.uint16) == b.view(numpy.uint16)).all())


@needs_hopper
@pytest.mark.parametrize("shape,window", [
    ((2, 700, 700, 4, 2, 64), (-1, 0)),     # causal, two consumer warpgroups (< 2049 keys)
    ((1, 3000, 3000, 4, 1, 64), (-1, 0)),   # causal, three
    ((2, 900, 500, 4, 2, 128), (-1, 0)),    # seqlen_q > seqlen_k: tiles that see no key
    ((3, 333, 1000, 4, 2, 128), (-1, 0)),   # seqlen_q < seqlen_k
    ((2, 600, 800, 4, 4, 96), (100, 0)),    # a window: a key limit and a lower edge
    ((1, 1100, 1100, 2, 2, 40), (-1, 30)),  # a right edge past the diagonal
])
@pytest.mark.parametrize("ctas", [None, 7])
def test_persistent_tiles_claimed_dynamically(shape, window, ctas):
    """Under a key limit the persistent grid claims its work tiles dynamically (WorkTileClaims
    in flash_fwd_sm90.cu) where every query row sees a key (else statically: seqlen_q >
    seqlen_k under a causal mask): against the reference, bit for bit the static schedule's
    results, on the full grid and on 7 CTAs (a dozen tiles or more each), call after call, and
    the stream's counters back at zero after each call (the last CTA resets them)."""
    q, k, v = _qkv(*shape, FP16)
    options = {"window_size": window}
    with _persistent_everywhere(False, ctas):
        assert "persistent" in cuflash2.forward_kernels(q, k, v, **options)[0]
        want = cuflash2.attention(q, k, v, **options)
    with _persistent_everywhere(True, ctas):
        kernel_dim = min(d for d in (64, 96, 128) if d >= shape[5])
        dynamic = _dispatch.dynamic_schedule(kernel_dim, shape[1], shape[2], window[1])
        assert dynamic == (shape[1] <= shape[2] + window[1])
        _check(q, k, v, **options)
        for _ in range(3):
            out = cuflash2.attention(q, k, v, **options)
            assert _same_bits(out, want)
        if dynamic:
            assert _stream_counters().get().tolist() == [0, 0]


@needs_hopper
def test_persistent_tiles_claimed_dynamically_on_streams_and_in_a_graph():
    """Each stream has its own counters (calls on two streams at once claim from their own),
    and a captured call (the counters of the capture stream) replays to the same bits, the
    counters at zero after each replay."""
    from cuflash2.bench.decode_graph import CapturedGraph

    inputs = [_qkv(2, 1000, 1000, 4, 2, 128, BF16), _qkv(4, 500, 700, 4, 1, 64, BF16)]
    with _persistent_everywhere(True, 9):
        want = [cuflash2.attention(*x, causal=True) for x in inputs]
        cupy.cuda.Device().synchronize()
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in inputs]
        got = [None, None]
        for _ in range(3):
            for i, stream in enumerate(streams):
                with stream:
                    got[i] = cuflash2.attention(*inputs[i], causal=True)
        for stream in streams:
            stream.synchronize()
            with stream:
                assert _stream_counters().get().tolist() == [0, 0]
        assert all(_same_bits(g, w) for g, w in zip(got, want))
        captured = {}
        stream = cupy.cuda.Stream(non_blocking=True)
        graph = CapturedGraph(cupy, stream,
                              lambda: captured.update(out=cuflash2.attention(*inputs[0],
                                                                             causal=True)))
        for _ in range(3):
            with stream:
                captured["out"].fill(0)
            graph.launch()
            stream.synchronize()
            assert _same_bits(captured["out"], want[0])
            with stream:
                assert _stream_counters().get().tolist() == [0, 0]


# --------------------------------------------------------------------------------------------
# The mma.sync forward on sm_90 (what runs there with CUFLASH2_HOPPER=0, and for dropout/varlen)


@pytest.mark.parametrize("headdim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_sync_forward_where_hopper_would_run(dtype, causal, headdim):
    q, k, v = _qkv(2, 255, 300, 4, 2, headdim, dtype)
    with _hopper_forward(False):
        assert cuflash2.forward_kernels(q, k, v)[0].startswith("mma.sync")
        _check(q, k, v, causal=causal)
