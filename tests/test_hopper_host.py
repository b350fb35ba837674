"""The host side of the Hopper forward (cuflash2/_hopper.py) that runs without a GPU: the
geometry of the rank-4 TMA descriptors over (batch, seqlen, heads, headdim) arrays."""

import dataclasses
import sys
import types

import pytest

from cuflash2 import _attention_plans, _dispatch, _hopper
from test_plans_host import api_host, launches  # noqa: F401  (fixtures)


def _strides(shape, itemsize=2):
    out, size = [], itemsize
    for dim in reversed(shape):
        out.append(size)
        size *= dim
    return tuple(reversed(out))


def test_contiguous_array_maps_innermost_first():
    shape = (2, 1000, 8, 128)
    dims, strides, box = _hopper.tensor_map_geometry(shape, _strides(shape), 2, 128)
    assert dims == [128, 1000, 8, 2]
    assert strides == [8 * 128 * 2, 128 * 2, 1000 * 8 * 128 * 2]  # row, head, batch (bytes)
    assert box == [64, 128, 1, 1]


def test_strided_views_keep_their_strides():
    # k of a packed (batch, seqlen, 3, heads, dim) qkv: rows 3 * heads * dim apart.
    batch, seqlen, heads, dim = 3, 77, 4, 64
    packed = _strides((batch, seqlen, 3, heads, dim))
    strides = (packed[0], packed[1], packed[3], packed[4])
    got_dims, got_strides, _ = _hopper.tensor_map_geometry((batch, seqlen, heads, dim), strides, 2,
                                                           128)
    assert got_dims == [dim, seqlen, heads, batch]
    assert got_strides == [strides[1], strides[2], strides[0]]


def test_extent_one_dimensions_take_any_stride():
    # Unbatched input seen as batch 1: its (unused) batch stride need not be a multiple of 16.
    shape = (1, 5, 1, 64)
    strides = (8, 128, 8, 2)
    # (it gets the span of the dimensions inside it, as in a packed layout)
    _, got, _ = _hopper.tensor_map_geometry(shape, strides, 2, 128)
    assert got == [128, 640, 640]
    # x[None] of a (seqlen, heads, dim) array: CuPy (as NumPy) gives the new axis stride 0
    _, got, _ = _hopper.tensor_map_geometry((1, 5, 2, 64), (0, 256, 128, 2), 2, 128)
    assert got == [256, 128, 1280]
    _, got, _ = _hopper.tensor_map_geometry((1, 5, 1, 64), (-64, 128, -8, 2), 2, 128)
    assert got == [128, 640, 640]


@pytest.mark.parametrize("shape,strides,box_rows,message", [
    ((1, 10, 2, 64), (2560, 256, 128, 4), 128, "contiguous"),
    ((2, 10, 2, 72), (2880, 144, 72 * 2 + 8, 2), 128, "multiples of 16"),
    ((2, 10, 2, 64), (0, 256, 128, 2), 128, "multiples of 16"),
    ((1, 10, 2, 64), (2560, 256, 128, 2), 512, "box"),
])
def test_what_the_tma_cannot_read_is_refused(shape, strides, box_rows, message):
    with pytest.raises(ValueError, match=message):
        _hopper.tensor_map_geometry(shape, strides, 2, box_rows)


class _HostArray:
    """Enough of a CuPy array for prepare_forward_sm90, over host memory."""

    def __init__(self, array):
        self.array = array
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype
        self.ndim, self.itemsize, self.size = array.ndim, array.itemsize, array.size
        self.data = types.SimpleNamespace(ptr=array.ctypes.data)
        self.device = types.SimpleNamespace(id=0)

    def __getitem__(self, index):
        return _HostArray(self.array[index])


def test_prepared_forward_fills_the_parameter_struct(monkeypatch):
    """Every FwdSm90Params field a call sets, with host arrays standing in for CuPy's and the
    driver calls replaced: the maps land at their offsets, the strides are in elements."""
    numpy = pytest.importorskip("numpy")
    fake_cupy = types.SimpleNamespace(
        empty=lambda shape, dtype: _HostArray(numpy.empty(shape, dtype)), float32=numpy.float32)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    maps = []

    def fake_map(x, rows):
        maps.append((x.shape, rows))
        return bytes([len(maps)]) * 128

    monkeypatch.setattr(_hopper, "tensor_map_bytes", fake_map)
    monkeypatch.setattr(_attention_plans._launch, "kernel_launch",
                        lambda config, device, grid: (config, grid))
    packed = numpy.zeros((2, 300, 3, 4, 64), numpy.float16)  # (batch, seqlen, qkv, heads, dim)
    q = _HostArray(packed[:, :, 0])
    k = _HostArray(numpy.zeros((2, 200, 2, 64), numpy.float16))
    prepared = _attention_plans.prepare_forward_sm90(q, k, k, causal=True, softmax_scale=0.5)
    block = prepared.block
    record = block.record[0]
    base = record["base"]
    assert maps == [((2, 300, 4, 64), 128), ((2, 200, 2, 64), 128), ((2, 200, 2, 64), 128)]
    for index, name in enumerate(("q_map", "k_map", "v_map")):
        offset = block.layout.offsets[name]
        assert bytes(block.bytes[offset:offset + 128]) == bytes([index + 1]) * 128
    assert (base["seqlen_q"], base["seqlen_k"], base["nheads"], base["heads_per_kv_head"]) == (
        300, 200, 4, 2)
    assert (base["q_batch_stride"], base["q_row_stride"], base["q_head_stride"]) == (
        300 * 3 * 4 * 64, 3 * 4 * 64, 64)
    assert (base["o_batch_stride"], base["o_row_stride"], base["o_head_stride"]) == (
        300 * 4 * 64, 4 * 64, 64)
    assert (base["window_left"], base["window_right"]) == (-1, 0)
    assert base["softmax_scale"] == 0.5 and abs(base["scale_log2"] - 0.5 * 1.4426950408889634) < 1e-6
    assert base["q"] == q.data.ptr and base["out"] == prepared.out.data.ptr
    config, grid = prepared.launch
    assert grid == (3, 4, 2) and config.head_dim == 64 and config.dtype == "float16"


@pytest.mark.parametrize("head_dim,kernel_dim,block_n", [
    (64, 64, 128), (72, 96, 128), (96, 96, 128), (128, 128, 128), (136, 192, 112),
    (192, 192, 112), (200, 256, 80), (256, 256, 80)])
def test_prepared_forward_picks_the_kernel_and_its_box_rows(monkeypatch, head_dim, kernel_dim,
                                                            block_n):
    """Each head dim runs on the smallest kernel head dim that holds it; the k and v maps' boxes
    have that kernel's block_n rows, q's block_m."""
    numpy = pytest.importorskip("numpy")
    fake_cupy = types.SimpleNamespace(
        empty=lambda shape, dtype: _HostArray(numpy.empty(shape, dtype)), float32=numpy.float32)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    maps = []
    monkeypatch.setattr(_hopper, "tensor_map_bytes",
                        lambda x, rows: maps.append((x.shape, rows)) or bytes(128))
    monkeypatch.setattr(_attention_plans._launch, "kernel_launch",
                        lambda config, device, grid: (config, grid))
    q = _HostArray(numpy.zeros((1, 300, 2, head_dim), numpy.float16))
    k = _HostArray(numpy.zeros((1, 500, 2, head_dim), numpy.float16))
    prepared = _attention_plans.prepare_forward_sm90(q, k, k)
    config, grid = prepared.launch
    assert config.head_dim == kernel_dim and config.block_n == block_n
    assert [rows for _, rows in maps] == [128, block_n, block_n]
    assert grid == (3, 2, 1)
    assert prepared.block.record[0]["base"]["head_dim"] == head_dim
    # the map geometry: 64-column boxes whatever the head dim
    _, _, box = _hopper.tensor_map_geometry((1, 500, 2, head_dim), (500 * 2 * head_dim * 2,
                                            2 * head_dim * 2, head_dim * 2, 2), 2, block_n)
    assert box == [64, block_n, 1, 1]


def test_prepared_forward_refuses_head_dims_past_256(monkeypatch):
    numpy = pytest.importorskip("numpy")
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace())
    q = _HostArray(numpy.zeros((1, 4, 1, 264), numpy.float16))
    with pytest.raises(ValueError, match="not covered"):
        _attention_plans.prepare_forward_sm90(q, q, q)


def test_overlap_and_persistent_are_specialisations_the_dispatcher_takes():
    """FwdSm90Config.overlap (the overlap inside a warpgroup) and .persistent (the persistent
    grid) are specialisations of their own, alone or together. The dispatcher takes the overlap
    at every head dim (measured fastest, _dispatch.SCHEDULES) and the persistent grid at the head
    dims of PERSISTENT_MAX_KEYS."""
    from cuflash2 import _configs, _dispatch

    config = _dispatch.fwd_sm90_config("bfloat16", 128)
    overlapping = dataclasses.replace(config, overlap=True)
    assert not config.overlap and overlapping != config
    # <..., PINGPONG, OVERLAP, FEATURES, PERSISTENT, CLAIMS>
    assert overlapping.name_expression.endswith("false, true, 0, false, false>")
    assert config.name_expression.endswith("false, false, 0, false, false>")
    assert "overlap" in _configs.describe(overlapping)
    both = dataclasses.replace(_dispatch.fwd_sm90_config("bfloat16", 128, persistent=True),
                               overlap=True, pingpong=True)
    assert both.name_expression.endswith("true, true, 0, true, false>")
    assert "overlap" in _configs.describe(both) and "persistent" in _configs.describe(both)
    claiming = dataclasses.replace(both, claims=True)
    assert claiming.name_expression.endswith("true, true, 0, true, true>")
    assert "claimed" in _configs.describe(claiming) and "claimed" not in _configs.describe(both)
    with pytest.raises(ValueError, match="persistent grid only"):
        dataclasses.replace(config, claims=True)
    dispatched = _dispatch.hopper_forward_configs(_configs.SM90_FWD_FEATURES)
    two = [c for c in dispatched if c.block_m == 128]  # three consumers: test below
    assert all(c.overlap for c in two)
    assert {(c.head_dim, c.pingpong) for c in two} == {
        (dim, pingpong) for (dim, _), (pingpong, _) in _dispatch.SCHEDULES.items()}
    assert {c.head_dim for c in two if c.persistent} == {
        dim for dim, _ in _dispatch.PERSISTENT_MAX_KEYS} == set(_dispatch.SM90_PERSISTENT_TILES)
    assert {c.head_dim for c in dispatched if c.claims} == set(_dispatch.DYNAMIC_SCHEDULE_KEYS)
    assert all(c.persistent for c in dispatched if c.claims)


def test_three_consumer_warpgroups_are_specialisations_the_dispatcher_takes():
    """block_m 192: three consumer warpgroups of 64 rows, 512 threads, 160 registers each after
    setmaxnreg (a probe checks the kernel's figure), the in-order schedule only (ping-pong takes
    two consumers), both grids, at the head dims of SM90_THREE_CONSUMER_TILES."""
    from cuflash2 import _configs, _dispatch

    config = _dispatch.fwd_sm90_config("bfloat16", 64, consumers=3)
    assert (config.block_m, config.block_n, config.stages, config.threads) == (192, 128, 2, 512)
    assert not config.pingpong and not config.overlap
    assert config.smem_bytes == 128 * (192 + 2 * 2 * 128) + 1024
    persistent = _dispatch.fwd_sm90_config("bfloat16", 64, persistent=True, consumers=3)
    assert persistent.smem_bytes == config.smem_bytes + 128 * 192
    assert _configs.sm90_consumer_registers(2) == 240
    assert _configs.sm90_consumer_registers(3) == 160
    assert "== 160, \"setmaxnreg budget\"" in config.probes
    assert "(three warpgroups)" in _configs.describe(config)
    with pytest.raises(ValueError, match="ping-pong"):
        dataclasses.replace(config, pingpong=True)
    with pytest.raises(ValueError, match="head dims"):
        _dispatch.fwd_sm90_config("bfloat16", 128, consumers=3)
    dispatched = _dispatch.hopper_forward_configs(_configs.SM90_FWD_FEATURES)
    three = [c for c in dispatched if c.block_m == 192]
    assert {(c.head_dim, c.persistent, c.claims) for c in three} == {
        (dim, grid, claims) for dim, _ in _dispatch.THREE_CONSUMER_MIN_KEYS
        for grid, claims in ((False, False), (True, False), (True, True))}
    assert not any(c.block_m == 192 for c in _dispatch.hopper_forward_configs(
        _configs.SM90_FWD_VARLEN_FEATURES))


@pytest.mark.parametrize("causal", [False, True])
def test_d64_calls_take_three_consumers_from_their_key_bound(monkeypatch, causal):
    """Full and causal d<=64 calls: three consumer warpgroups from THREE_CONSUMER_MIN_KEYS on,
    on the persistent grid up to THREE_CONSUMER_PERSISTENT_MAX_KEYS; windows and varlen keep
    two."""
    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    window = (-1, 0) if causal else (-1, -1)
    bound = _dispatch.THREE_CONSUMER_MIN_KEYS[64, causal]
    for seqlen_k in (257, 512, 1024, 2048, 2049, 4096, 4097, 16384):
        config = _dispatch.hopper_forward_config(_dense_problem(40, seqlen_k), 0, window, 90)
        three = seqlen_k >= bound
        assert config.block_m == (192 if three else 128), seqlen_k
        if three:
            assert config.persistent == (seqlen_k <= _dispatch.THREE_CONSUMER_PERSISTENT_MAX_KEYS)
            assert config in _dispatch.hopper_forward_configs()
    windowed = _dispatch.hopper_forward_config(_dense_problem(64, 4096), 0, (256, 0), 90)
    assert windowed.block_m == 128


def _dense_problem(head_dim, seqlen_k, dtype="float16"):
    return types.SimpleNamespace(batch=2, seqlen_q=seqlen_k, seqlen_k=seqlen_k, nheads=4,
                                 nheads_kv=4, head_dim=head_dim, head_dim_v=head_dim,
                                 dtype=dtype, softmax_scale=0.125)


@pytest.mark.parametrize("head_dim,kernel_dim", [(40, 64), (64, 64), (96, 96), (128, 128),
                                                 (160, 192), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_calls_take_the_persistent_grid_up_to_its_key_bound(monkeypatch, head_dim,
                                                                 kernel_dim, causal):
    """The persistent grid exactly up to PERSISTENT_MAX_KEYS[kernel dim, causal] keys (never at
    d=192/256), causal calls also over DYNAMIC_SCHEDULE_KEYS' range (tiles claimed
    dynamically), the schedule of SCHEDULES either way, and short d<=64 calls on mma.sync."""
    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    window = (-1, 0) if causal else (-1, -1)
    bound = _dispatch.PERSISTENT_MAX_KEYS.get((kernel_dim, causal))
    first, last = _dispatch.DYNAMIC_SCHEDULE_KEYS.get(kernel_dim, (1, 0)) if causal else (1, 0)
    for seqlen_k in (1, 200, 256, 257, 512, 513, 1024, 1025, 2047, 2048, 2049, 8192, 8193,
                     16384):
        config = _dispatch.hopper_forward_config(_dense_problem(head_dim, seqlen_k), 0, window, 90)
        if kernel_dim <= _dispatch.MMA_SYNC_MAX_DIM and seqlen_k <= _dispatch.MMA_SYNC_MAX_KEYS:
            assert config is None
            continue
        if seqlen_k >= _dispatch.THREE_CONSUMER_MIN_KEYS.get((kernel_dim, causal), 1 << 62):
            assert config.block_m == 192  # the next test
            continue
        assert config.head_dim == kernel_dim
        dynamic = first <= seqlen_k <= last
        assert config.persistent == (bound is not None and seqlen_k <= bound or dynamic), seqlen_k
        assert config.claims == dynamic
        assert (config.pingpong, config.overlap) == _dispatch.SCHEDULES[kernel_dim, causal]
        assert config in _dispatch.hopper_forward_configs()


def test_persistent_schedule_sizes_the_grid_and_the_l2_sections():
    """One CTA per slot, fewer when there are fewer work tiles; in the sectioned order sections
    of (batch, head) pairs whose K and V fit PERSISTENT_L2_BYTES, times the query heads that
    share a K/V head."""
    l2 = _dispatch.PERSISTENT_L2_BYTES

    def schedule(*args):
        return _dispatch.persistent_schedule(*args, pair_order=False)

    # 512 tokens, d=128, fp16: 256 KiB of K and V per (batch, head), 128 of them fit 32 MiB.
    ctas, section = schedule(32, 16, 16, 512, 512, 128, 2, 128, 132)
    assert ctas == 132 and section == l2 // (2 * 512 * 128 * 2) == 128
    # fewer tiles than slots: one CTA per tile
    assert schedule(1, 2, 2, 200, 200, 64, 2, 128, 132) == (4, 2)
    # a K/V head larger than the budget: sections of one pair (times the GQA group)
    assert schedule(1, 16, 16, 16384, 1 << 20, 128, 2, 128, 132)[1] == 1
    assert schedule(1, 16, 4, 16384, 1 << 20, 128, 2, 128, 132)[1] == 4
    # GQA: the heads of one K/V head share its K and V, so a section holds 4x the pairs
    assert schedule(64, 32, 8, 4096, 4096, 128, 2, 128, 132)[1] == l2 // (2 * 4096 * 128 * 2) * 4
    # a section never exceeds the pairs there are
    assert schedule(2, 4, 4, 128, 128, 64, 2, 128, 132) == (8, 8)


def test_persistent_schedule_goes_pair_by_pair_in_the_pair_order():
    """In the pair order every section holds one pair, so the kernel's order is pair by pair, a
    pair's m blocks side by side (the CTAs running at one time share K/V reads)."""
    for args in ((32, 16, 16, 512, 512, 128, 2, 128, 132), (1, 2, 2, 200, 200, 64, 2, 128, 132),
                 (64, 32, 8, 4096, 4096, 128, 2, 128, 132)):
        ctas, section = _dispatch.persistent_schedule(*args, pair_order=True)
        assert section == 1
        assert ctas == _dispatch.persistent_schedule(*args, pair_order=False)[0]


def test_persistent_schedule_covers_batches_past_the_grid_limit():
    """The persistent grid is 1-D and its tile index covers every batch: more than 65535
    sequences need no slicing of gridDim.z (the struct's batch_offset stays 0)."""
    ctas, section = _dispatch.persistent_schedule(100_000, 2, 2, 100, 100, 64, 2, 128, 132,
                                                pair_order=False)
    assert ctas == 132 and section == _dispatch.PERSISTENT_L2_BYTES // (2 * 100 * 64 * 2)
    with pytest.raises(ValueError, match="32 bits"):
        _dispatch.persistent_schedule(1 << 20, 64, 64, 1 << 16, 1, 64, 2, 128, 132,
                                    pair_order=True)


def test_prepared_persistent_forward_launches_one_cta_per_sm(monkeypatch):
    """A persistent config: a (min(tiles, slots), 1, 1) grid, and the struct's batch and
    section_pairs, which the one-tile-per-CTA grid leaves 0; under a key limit the current
    stream's tile counters (the dynamic schedule), null without one (the static schedule)."""
    numpy = pytest.importorskip("numpy")
    from cuflash2 import _attention_plans, _dispatch, _plans

    fake_cupy = types.SimpleNamespace(
        empty=lambda shape, dtype: _HostArray(numpy.empty(shape, dtype)), float32=numpy.float32,
        zeros=lambda shape, dtype: _HostArray(numpy.zeros(shape, dtype)), int32=numpy.int32,
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=7)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    counters = _plans.StreamCounters(2)
    monkeypatch.setattr(_plans, "stream_counters", counters)
    monkeypatch.setattr(_hopper, "tensor_map_bytes", lambda x, rows: bytes(128))
    monkeypatch.setattr(_attention_plans._launch, "kernel_launch",
                        lambda config, device, grid: (config, grid))
    monkeypatch.setattr(_attention_plans._launch, "occupancy_slots", lambda config, device: 132)
    _dispatch.persistent_slots.cache_clear()
    q = _HostArray(numpy.zeros((3, 1000, 8, 128), numpy.float16))
    k = _HostArray(numpy.zeros((3, 1000, 2, 128), numpy.float16))
    config = _dispatch.fwd_sm90_config("float16", 128, persistent=True)
    prepared = _attention_plans.prepare_forward_sm90(q, k, k, causal=True, config=config)
    record = prepared.block.record[0]
    launched, grid = prepared.launch
    assert launched is config and grid == (132, 1, 1)  # 8 m blocks x 8 heads x 3 = 192 tiles
    assert record["batch"] == 3
    assert record["section_pairs"] == 1  # causal at d=128: pair by pair (CAUSAL_PAIR_ORDER_DIMS)
    assert record["tile_counters"] == 0  # 1000 keys: the static schedule
    long_q = _HostArray(numpy.zeros((1, 2048, 8, 128), numpy.float16))
    long_k = _HostArray(numpy.zeros((1, 2048, 2, 128), numpy.float16))
    claimed = _attention_plans.prepare_forward_sm90(long_q, long_k, long_k, causal=True,
                                                    config=config)
    long_record = claimed.block.record[0]
    assert long_record["tile_counters"] == counters.get(0, 7, fake_cupy) != 0  # claimed
    assert set(counters.buffers) == {(0, 7)}
    assert long_record["section_pairs"] == 8  # in the L2 sections' order (4 MiB a K/V head)
    q64 = _HostArray(numpy.zeros((3, 1000, 8, 64), numpy.float16))
    k64 = _HostArray(numpy.zeros((3, 1000, 2, 64), numpy.float16))
    config64 = _dispatch.fwd_sm90_config("float16", 64, persistent=True)
    sectioned = _attention_plans.prepare_forward_sm90(q64, k64, k64, causal=True, config=config64)
    assert sectioned.block.record[0]["section_pairs"] == 24  # every pair's K and V fit L2
    assert record["base"]["batch_offset"] == 0
    small = _attention_plans.prepare_forward_sm90(q[:1, :100], k[:1, :100], k[:1, :100],
                                                  config=config)
    assert small.launch[1] == (8, 1, 1)  # 1 m block x 8 heads
    assert small.block.record[0]["section_pairs"] == 1  # no key limit: pair by pair
    assert small.block.record[0]["tile_counters"] == 0  # and the static schedule
    plain = _attention_plans.prepare_forward_sm90(q, k, k, causal=True)
    assert plain.launch[1] == (8, 8, 3) and plain.block.record[0]["batch"] == 0
    _dispatch.persistent_slots.cache_clear()


def test_the_dispatchers_plan_launches_the_persistent_grid_on_short_rows(monkeypatch):
    """api's forward plan (_attention_plans.forward_plan) for a dense call on sm_90: the
    persistent grid's (CTAs, 1, 1) launch and its batch and section fields up to
    PERSISTENT_MAX_KEYS, the (m blocks, heads, batch) grid beyond, each with the configuration
    forward_config chose."""
    numpy = pytest.importorskip("numpy")
    from cuflash2 import _attention_plans, _dispatch, _prepare, _validate
    from cuflash2._options import AttentionOptions

    def fake_map(x, rows):  # word 0 is the address, as the driver's
        return numpy.array([x.data.ptr] + [rows] * 15, numpy.uint64).tobytes()

    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    monkeypatch.setattr(_hopper, "tensor_map_bytes", fake_map)
    monkeypatch.setattr(_attention_plans._launch, "kernel_launch",
                        lambda config, device, grid: types.SimpleNamespace(config=config,
                                                                           grid=grid))
    monkeypatch.setattr(_attention_plans._launch, "occupancy_slots", lambda config, device: 132)
    _dispatch.persistent_slots.cache_clear()

    def plan(seqlen, causal):
        q = _HostArray(numpy.zeros((3, seqlen, 8, 128), numpy.float16))
        k = _HostArray(numpy.zeros((3, seqlen, 2, 128), numpy.float16))
        problem = _validate.check_attention_inputs(q, k, k)
        window = _validate.check_window((-1, -1), causal, seqlen, seqlen)
        views = {"q": q, "k": k, "v": k, "out": None, "mods.alibi_slopes": None}
        sources = {"q": (0, q), "k": (1, k), "v": (2, k)}
        return _attention_plans.forward_plan(views, sources, problem,
                                             _prepare.score_mods(problem, AttentionOptions()), window, 0,
                                             90, q.shape, (3, 8, seqlen))

    bound = _dispatch.PERSISTENT_MAX_KEYS[128, True]
    short, long = plan(bound, True), plan(bound + 1, True)
    (launch,), record = short.launches, short.block.record[0]
    assert launch.config.persistent and launch.grid == (132, 1, 1)  # 8 x 8 heads x 3 tiles
    assert (record["batch"], record["section_pairs"]) == (3, 1)  # causal d=128: pair by pair
    assert (record["base"]["seqlen_k"], record["base"]["window_right"]) == (bound, 0)
    (launch,), record = long.launches, long.block.record[0]
    assert not launch.config.persistent
    assert launch.grid == (-(-(bound + 1) // 128), 8, 3) and record["batch"] == 0
    unlimited = plan(64, False)
    assert unlimited.launches[0].grid == (24, 1, 1)  # 1 m block x 8 heads x 3: 24 tiles
    assert unlimited.block.record[0]["section_pairs"] == 1  # no key limit: pair by pair
    _dispatch.persistent_slots.cache_clear()


def _varlen_problem(head_dim=128, seqlen_k=700):
    # what _prepare.varlen_problem gives the planner: sequences as batch, the max lengths
    return types.SimpleNamespace(batch=3, seqlen_q=300, seqlen_k=seqlen_k, nheads=4,
                                 nheads_kv=2, head_dim=head_dim, head_dim_v=head_dim,
                                 dtype="bfloat16",
                                 softmax_scale=0.125)


def test_varlen_reaches_the_hopper_forward_with_the_flag(monkeypatch):
    """hopper_forward_config takes varlen calls with _dispatch.HOPPER_FORWARD_VARLEN (on unless
    CUFLASH2_HOPPER_VARLEN=0)
    and refuses them without: the config carries FEATURE_VARLEN with the score modifiers and is
    never persistent, even where a dense call of the same lengths would be."""
    from cuflash2 import _configs, _dispatch

    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    varlen = types.SimpleNamespace(total_q=600, total_k=1400, batch=3)
    features = _configs.FEATURE_VARLEN | _configs.FEATURE_SOFTCAP
    monkeypatch.setattr(_dispatch, "HOPPER_FORWARD_VARLEN", False)
    assert _dispatch.hopper_forward_config(_varlen_problem(), features, (-1, -1), 90,
                                           varlen) is None
    monkeypatch.setattr(_dispatch, "HOPPER_FORWARD_VARLEN", True)
    config = _dispatch.hopper_forward_config(_varlen_problem(), features, (-1, 0), 90, varlen)
    assert config.features == features and not config.persistent
    assert _varlen_problem().seqlen_k <= _dispatch.PERSISTENT_MAX_KEYS[128, True]
    assert (config.pingpong, config.overlap) == _dispatch.SCHEDULES[128, True]
    assert "varlen" in _configs.describe(config)
    # dropout, other GPUs, and a dense call carrying the varlen bit stay off
    assert _dispatch.hopper_forward_config(_varlen_problem(), features | _configs.FEATURE_DROPOUT,
                                           (-1, -1), 90, varlen) is None
    assert _dispatch.hopper_forward_config(_varlen_problem(), features, (-1, -1), 80,
                                           varlen) is None
    assert _dispatch.hopper_forward_config(_varlen_problem(), features, (-1, -1), 90, None) is None
    # short d=64 problems (by the longest sequence) stay on mma.sync as dense ones do
    assert _dispatch.hopper_forward_config(_varlen_problem(64, _dispatch.MMA_SYNC_MAX_KEYS), features,
                                           (-1, -1), 90, varlen) is None


def test_varlen_maps_cover_the_packed_arrays():
    """The varlen maps: a packed (total, heads, dim) array as the rank-4 map of batch extent 1
    (_as_batched: x[None], batch stride 0 -> a stand-in of 16), so the producer's coordinates
    are (column, sequence start + row, head, 0)."""
    numpy = pytest.importorskip("numpy")
    packed = _HostArray(numpy.zeros((1234, 2, 96), numpy.float16))
    x = _hopper.as_batched(packed)
    dims, strides, box = _hopper.tensor_map_geometry(x.shape, x.strides, 2, 128)
    assert dims == [96, 1234, 2, 1]
    assert strides == [2 * 96 * 2, 96 * 2, 1234 * 2 * 96 * 2]  # batch: the packed span
    assert box == [64, 128, 1, 1]


@pytest.fixture
def hopper_api(api_host, monkeypatch):
    """The public functions (test_plans_host.api_host) on an H100/H200: the Hopper kernels'
    maps encoded by a stand-in whose word 0 is the address, 132 persistent CTAs."""
    numpy = pytest.importorskip("numpy")
    from cuflash2 import _dispatch

    def fake_map(x, rows):
        return numpy.array([x.data.ptr] + [rows] * 15, numpy.uint64).tobytes()

    monkeypatch.setattr(_dispatch, "HOPPER_FORWARD", True)
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", True)
    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    monkeypatch.setattr(_hopper, "tensor_map_bytes", fake_map)
    monkeypatch.setattr(_attention_plans._launch, "occupancy_slots", lambda config, device: 132)
    _dispatch.persistent_slots.cache_clear()
    api_host.set_arch(90)
    yield api_host
    _dispatch.persistent_slots.cache_clear()


@pytest.mark.parametrize("seqlen", [512, 4096])
def test_a_sinks_forward_runs_the_hopper_kernel_with_them(hopper_api, seqlen):
    """attention(..., sinks=) on sm_90: the Hopper forward the call without sinks gets, with
    FEATURE_SINKS compiled in, and base.mods.sinks patched from the call's sinks (dense and
    varlen)."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from cuflash2 import _configs, _dispatch
    from test_plans_host import device_array

    q = device_array((2, seqlen, 8, 128))
    k = device_array((2, seqlen, 2, 128))
    cuflash2.attention(q, k, k, causal=True)
    plain = hopper_api.launches[-1][0].config
    assert isinstance(plain, _configs.FwdSm90Config) and plain.features == 0
    sinks = device_array((8,), numpy.float32)
    cuflash2.attention(q, k, k, causal=True, sinks=sinks, softcap=30.0)
    launch, _, record = hopper_api.launches[-1]
    assert launch.config == _configs.with_features(
        plain, _configs.FEATURE_SINKS | _configs.FEATURE_SOFTCAP)
    assert launch.config in _dispatch.hopper_forward_configs(_configs.SM90_FWD_FEATURES)
    assert record["base"]["mods"]["sinks"] == sinks.data.ptr
    cu = device_array((3,), numpy.int32)
    packed_q, packed_k = device_array((2 * seqlen, 8, 128)), device_array((2 * seqlen, 2, 128))
    cuflash2.attention_varlen(packed_q, packed_k, packed_k, cu, cu, seqlen, seqlen,
                              sinks=sinks, check_cu_seqlens=False)
    launch, _, record = hopper_api.launches[-1]
    assert isinstance(launch.config, _configs.FwdSm90Config)
    assert launch.config.features == _configs.FEATURE_SINKS | _configs.FEATURE_VARLEN
    assert launch.config in _dispatch.hopper_forward_configs(_configs.SM90_FWD_VARLEN_FEATURES)
    assert record["base"]["mods"]["sinks"] == sinks.data.ptr


def test_the_hopper_forward_covers_sinks_not_dropout(monkeypatch):
    from cuflash2 import _configs, _dispatch

    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    problem = _dense_problem(128, 1024)
    for features in (_configs.FEATURE_SINKS, _configs.FEATURE_SINKS | _configs.FEATURE_ALIBI):
        config = _dispatch.hopper_forward_config(problem, features, (-1, -1), 90)
        assert config.features == features
        assert "sinks" in _configs.describe(config)
    assert _dispatch.hopper_forward_config(problem, _configs.FEATURE_SINKS | _configs.FEATURE_DROPOUT,
                                           (-1, -1), 90) is None


@pytest.fixture
def scratch_maps(monkeypatch):
    """The float32 Hopper forward's scratch maps as encoded (shape, byte strides, dtype, box
    rows), by a stand-in whose word 0 is the address, as the driver's."""
    numpy = pytest.importorskip("numpy")
    encoded = []

    def fake_scratch_map(address, shape, strides, dtype, rows):
        encoded.append((tuple(shape), tuple(strides), dtype, rows))
        return numpy.array([address] + [rows] * 15, numpy.uint64).tobytes()

    monkeypatch.setattr(_hopper, "tensor_map_bytes_at", fake_scratch_map)
    return encoded


@pytest.mark.parametrize("head_dim,kernel_dim,block_n", [(64, 64, 128), (80, 96, 64),
                                                         (128, 128, 64)])
def test_a_tf32_forward_runs_the_operand_pass_then_the_tf32_hopper_kernel(
        hopper_api, monkeypatch, scratch_maps, head_dim, kernel_dim, block_n):
    """attention(float32, precision="tf32") on sm_90: two launches on the stream, the operand
    pass (K rounded, V with its keys innermost, into the call's scratch; a CTA a 32 keys of a
    (batch, kv head)) and the TF32 Hopper forward, whose q_map covers q and whose k_map and
    v_map cover the scratch (their address words and k_tf32 / v_keys_last set per call); the
    "highest" precision and head dims past 128 stay on the mma.sync kernel."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from cuflash2 import _configs, _dispatch
    from test_plans_host import device_array

    q = device_array((2, 1000, 8, head_dim), numpy.float32)
    k = device_array((2, 1000, 2, head_dim), numpy.float32)
    cuflash2.attention(q, k, k, causal=True, precision="tf32")
    (operands, _, first), (forward, _, record) = hopper_api.launches[-2:]
    assert first == record  # one struct, filled once, for both launches
    assert operands.config == _configs.AuxKernel("tf32", _configs.TF32_OPERANDS_KERNEL)
    assert operands.grid == (32, 2, 2)  # 1000 keys (whole groups of 8) in CTAs of 32
    config = forward.config
    assert isinstance(config, _configs.FwdSm90Config) and config.dtype == "tf32"
    assert (config.head_dim, config.block_n, config.pingpong, config.overlap) == (
        kernel_dim, block_n, True, True)
    assert not config.persistent and forward.grid == (-(-1000 // 128), 8, 2)
    assert record["base"]["head_dim"] == 2 * head_dim  # 16-bit words
    k_tf32, v_keys_last = record["k_tf32"], record["v_keys_last"]
    assert v_keys_last - k_tf32 >= 4 * 2 * 1000 * 2 * head_dim
    word0 = {name: int(record[name]["v"][0][0]) for name in ("q_map", "k_map", "v_map")}
    assert word0 == {"q_map": q.data.ptr, "k_map": k_tf32, "v_map": v_keys_last}
    assert scratch_maps[-2:] == [
        ((2, 1000, 2, head_dim), (4 * 1000 * 2 * head_dim, 4 * 2 * head_dim, 4 * head_dim, 4),
         "float32", block_n),
        ((2, head_dim, 2, 1000), (4 * 2 * head_dim * 1000, 4 * 1000, 4 * head_dim * 1000, 4),
         "float32", kernel_dim)]
    count = len(hopper_api.launches)
    monkeypatch.setattr(_dispatch, "HOPPER_FORWARD_F32X3", False)
    cuflash2.attention(q, k, k, causal=True)  # "highest", switched off: mma.sync
    assert len(hopper_api.launches) == count + 1
    assert isinstance(hopper_api.launches[-1][0].config, _configs.FwdConfig)
    wide = device_array((2, 1000, 2, 192), numpy.float32)
    cuflash2.attention(wide, wide, wide, precision="tf32")
    assert isinstance(hopper_api.launches[-1][0].config, _configs.FwdConfig)
    assert _dispatch.tf32_hopper_forward_config(
        _dense_problem(128, 1024), _configs.FEATURE_DROPOUT) is None


@pytest.mark.parametrize("head_dim,kernel_dim,block_n,block_m", [
    (64, 64, 64, 128), (80, 96, 32, 128), (128, 128, 32, 64)])
def test_a_highest_forward_runs_the_operand_pass_then_the_3xtf32_hopper_kernel(
        hopper_api, monkeypatch, scratch_maps, head_dim, kernel_dim, block_n, block_m):
    """attention(float32) at precision "highest" (the default) on sm_90: the operand pass of
    f32x3_tag (K and V's big and small TF32 parts into the call's scratch, K's rows and V's
    blocks twice as long) then the 3xTF32 Hopper forward (F32X3_SM90_FWD_TILES; d=128 with one
    consumer warpgroup of 64 rows, in order), its k_map and v_map over the scratch's arrays
    whole; head dims past 128, CUFLASH2_HOPPER_F32X3=0 and CUFLASH2_HOPPER_TF32=0 stay on the
    mma.sync kernel."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from cuflash2 import _configs, _dispatch
    from test_plans_host import device_array

    q = device_array((2, 1000, 8, head_dim), numpy.float32)
    k = device_array((2, 1000, 2, head_dim), numpy.float32)
    cuflash2.attention(q, k, k, causal=True)
    (operands, _, first), (forward, _, record) = hopper_api.launches[-2:]
    assert first == record
    assert operands.config == _configs.AuxKernel("float32", _configs.TF32_OPERANDS_KERNEL)
    assert "f32x3_tag" in operands.config.name_expression
    assert operands.grid == (32, 2, 2)
    config = forward.config
    assert isinstance(config, _configs.FwdSm90Config) and config.dtype == "float32"
    assert (config.head_dim, config.block_m, config.block_n, config.stages, config.pingpong,
            config.overlap) == (kernel_dim, block_m, block_n, 2, block_m == 128, True)
    assert config.smem_bytes == 197632 and "f32x3_tag" in config.name_expression
    assert not config.persistent and forward.grid == (-(-1000 // block_m), 8, 2)
    assert record["base"]["head_dim"] == 2 * head_dim  # 16-bit words
    k_tf32, v_keys_last = record["k_tf32"], record["v_keys_last"]
    assert v_keys_last - k_tf32 >= 4 * 2 * 1000 * 2 * 2 * head_dim  # both parts of K
    word0 = {name: int(record[name]["v"][0][0]) for name in ("q_map", "k_map", "v_map")}
    assert word0 == {"q_map": q.data.ptr, "k_map": k_tf32, "v_map": v_keys_last}
    w = 2 * head_dim  # a row of K's parts, V's rows of a (batch, kv head)
    assert scratch_maps[-2:] == [
        ((2, 1000, 2, w), (4 * 1000 * 2 * w, 4 * 2 * w, 4 * w, 4), "float32", block_n),
        ((2, w, 2, 1000), (4 * 2 * w * 1000, 4 * 1000, 4 * w * 1000, 4), "float32",
         kernel_dim)]
    count = len(hopper_api.launches)
    for flag, seqlen in (("HOPPER_FORWARD_F32X3", 900), ("HOPPER_FORWARD_TF32", 800)):
        with monkeypatch.context() as m:  # (new shapes: plans are cached by their call)
            m.setattr(_dispatch, flag, False)
            short = device_array((2, seqlen, 2, head_dim), numpy.float32)
            cuflash2.attention(short, short, short, causal=True)
        assert isinstance(hopper_api.launches[-1][0].config, _configs.FwdConfig)
    assert len(hopper_api.launches) == count + 2
    wide = device_array((2, 1000, 2, 160), numpy.float32)
    cuflash2.attention(wide, wide, wide)
    assert isinstance(hopper_api.launches[-1][0].config, _configs.FwdConfig)


def test_the_float32_hopper_forward_configs_name_both_elements():
    """tf32_hopper_forward_configs: each element's tiles and its own operand pass; "highest"
    at d=128 with one consumer warpgroup (two would not fit 227 KiB)."""
    from cuflash2 import _configs, _dispatch

    configs = _dispatch.tf32_hopper_forward_configs((0,), ("tf32", "float32"))
    assert [(c.dtype, c.head_dim) for c in configs if isinstance(c, _configs.FwdSm90Config)] == [
        ("tf32", 64), ("tf32", 96), ("tf32", 128), ("float32", 64), ("float32", 96),
        ("float32", 128)]
    assert [c.dtype for c in configs if isinstance(c, _configs.AuxKernel)] == ["tf32", "float32"]
    assert all(c.smem_bytes <= 227 * 1024 for c in configs
               if isinstance(c, _configs.FwdSm90Config))
    too_big = _configs.FwdSm90Config("float32", 128, block_n=32, stages=2, pingpong=True,
                                     overlap=True)
    assert too_big.smem_bytes > 227 * 1024


@pytest.mark.parametrize("d_qk,d_v,seqlen", [(192, 128, 4096), (128, 64, 200), (176, 120, 1000)])
def test_v_with_its_own_head_dim_runs_the_hopper_forward(hopper_api, d_qk, d_v, seqlen):
    """attention with v's head dim apart from q's and k's (d_v != d_qk): the Hopper forward of
    the pair of kernel dims (SM90_SPLIT_HEAD_DIM_TILES, even where a short call of equal dims
    would take the mma.sync kernel), out shaped (..., d_v), head_dim_v in the kernel's words;
    dense and varlen."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from cuflash2 import _configs
    from test_plans_host import device_array

    q, k = device_array((2, seqlen, 8, d_qk)), device_array((2, seqlen, 2, d_qk))
    v = device_array((2, seqlen, 2, d_v))
    out = cuflash2.attention(q, k, v, causal=True)
    launch, _, record = hopper_api.launches[-1]
    config = launch.config
    assert isinstance(config, _configs.FwdSm90Config)
    assert (config.head_dim, config.head_dim_v) in _dispatch.SM90_FWD_HEAD_DIM_PAIRS
    assert config in _dispatch.hopper_forward_configs()
    assert out.shape == (2, seqlen, 8, d_v)
    assert (record["base"]["head_dim"], record["base"]["head_dim_v"]) == (d_qk, d_v)
    cu = device_array((3,), numpy.int32)
    packed = [device_array((2 * seqlen, h, d)) for h, d in ((8, d_qk), (2, d_qk), (2, d_v))]
    out = cuflash2.attention_varlen(*packed, cu, cu, seqlen, seqlen, check_cu_seqlens=False)
    launch, _, record = hopper_api.launches[-1]
    assert launch.config.head_dim_v == config.head_dim_v and out.shape == (2 * seqlen, 8, d_v)
    assert launch.config.features == _configs.FEATURE_VARLEN


def test_v_with_its_own_head_dim_elsewhere_is_refused_before_launch(hopper_api):
    """What the kernels leave out of d_v != d_qk raises NotImplementedError naming v's head dim,
    before any launch: a v wider than q's kernel head dim, score modifiers, the backward of a d_v
    of q's kernel head dim off the Hopper kernel (sm_80, dropout). What the Hopper forward leaves
    out (dropout, pairs past its own, sm_80) runs on the mma.sync forward with V's own kernel
    head dim."""
    import cuflash2
    from cuflash2 import _configs
    from test_plans_host import device_array

    q, k = device_array((1, 300, 4, 192)), device_array((1, 300, 4, 192))
    v = device_array((1, 300, 4, 128))
    before = len(hopper_api.launches)
    problem = types.SimpleNamespace(batch=1, seqlen_q=300, seqlen_k=300, nheads=4, nheads_kv=4,
                                    head_dim=192, head_dim_v=128, dtype="float16")
    with pytest.raises(NotImplementedError, match=r"v's head dim \(128\) .* mask_mod"):
        _dispatch.forward_kernel(problem, 0, (-1, -1), 90, {}, None, 0,
                                 user_mods=("mask source", None))
    narrow = device_array((1, 300, 4, 64))
    with pytest.raises(NotImplementedError, match=r"v's head dim \(128\) .* below q's"):
        cuflash2.attention(narrow, narrow, v)
    q128, v112 = device_array((1, 300, 4, 128)), device_array((1, 300, 4, 112))
    with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(112\)"):
        cuflash2.attention_backward(device_array((1, 300, 4, 112)), q128, q128, v112,
                                    device_array((1, 300, 4, 112)),
                                    device_array((1, 4, 300), "float32"), dropout_p=0.1, seed=1)
    assert len(hopper_api.launches) == before  # nothing launched
    for call, d_v in ((dict(dropout_p=0.1, seed=1), 128), ({}, 32)):  # 192 / 32: no Hopper pair
        out = cuflash2.attention(q, k, device_array((1, 300, 4, d_v)), **call)
        config = hopper_api.launches[-1][0].config
        assert isinstance(config, _configs.FwdConfig) and out.shape == (1, 300, 4, d_v)
        assert (config.head_dim, config.head_dim_v) == (192, max(d_v, 64))
        assert hopper_api.launches[-1][2]["head_dim_v"] == d_v
    hopper_api.set_arch(80)  # (signatures of their own: plans are cached by them)
    cuflash2.attention(q[:, :299], k, v)
    assert hopper_api.launches[-1][0].config == _dispatch.fwd_config("float16", 192, 80, 128)
    before = len(hopper_api.launches)
    with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(112\) .* sm_80"):
        cuflash2.attention_backward(device_array((1, 299, 4, 112)), q128[:, :299], q128, v112,
                                    device_array((1, 299, 4, 112)),
                                    device_array((1, 4, 299), "float32"))
    assert len(hopper_api.launches) == before


@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 64)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_v_with_its_own_head_dim_runs_the_hopper_backward(hopper_api, d_qk, d_v, deterministic):
    """attention_backward with v's own head dim: the Hopper backward of the pair (Q's head dim's
    tile), dq and dk shaped like q and k, dv like v, head_dim_v in BwdParams (the preprocess's D
    runs over it); dense and varlen."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from cuflash2 import _configs
    from test_plans_host import device_array

    q, k = device_array((2, 700, 8, d_qk)), device_array((2, 700, 2, d_qk))
    v, out = device_array((2, 700, 2, d_v)), device_array((2, 700, 8, d_v))
    lse = device_array((2, 8, 700), numpy.float32)
    dq, dk, dv = cuflash2.attention_backward(out, q, k, v, out, lse, causal=True,
                                             deterministic=deterministic)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    main, _, record = [launch for launch in hopper_api.launches
                       if isinstance(getattr(launch[0], "config", None),
                                     _configs.BwdSm90Config)][-1]
    assert (main.config.head_dim, main.config.head_dim_v) == (d_qk, d_v)
    assert main.config.deterministic == deterministic
    assert main.config == _dispatch.bwd_sm90_config("float16", d_qk, deterministic,
                                                    head_dim_v=d_v)
    assert (record["base"]["head_dim"], record["base"]["head_dim_v"]) == (d_qk, d_v)
    cu = device_array((3,), numpy.int32)
    packed = [device_array((1400, h, d)) for h, d in ((8, d_qk), (2, d_qk), (2, d_v))]
    out = device_array((1400, 8, d_v))
    grads = cuflash2.attention_varlen_backward(out, *packed, out,
                                               device_array((8, 1400), numpy.float32), cu, cu,
                                               700, 700, check_cu_seqlens=False)
    assert [g.shape for g in grads] == [x.shape for x in packed]


@pytest.mark.parametrize("arch", [90, 80])
def test_precompile_plans_every_kernel_check_launches(hopper_api, arch):
    """`cuflash2 precompile --headdim <check's>` then `cuflash2 check` in a fresh process
    compiles nothing of cuflash2's: every kernel check's calls launch (its grid of shapes, both
    dtypes, causal or not, forward and backward) is one precompile plans for those head dims.
    (check's reference maths compiles CuPy's own kernels into the same cache: those it cannot.)"""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from cuflash2 import _configs, precompile, selfcheck
    from test_plans_host import device_array

    hopper_api.set_arch(arch)
    for case in selfcheck.grid(("fp16", "bf16"), selfcheck.DEFAULT_HEADDIMS):
        dtype = selfcheck.dtype_from_name(case.dtype_name)
        lead = () if case.unbatched else (case.batch,)
        q = device_array(lead + (case.seqlen_q, case.nheads, case.headdim), dtype)
        k = device_array(lead + (case.seqlen_k, case.nheads_kv, case.headdim), dtype)
        cuflash2.attention(q, k, k, causal=case.causal)
        out = device_array(q.shape, dtype)  # (the stand-in's own outputs hold no host array)
        lse = device_array(lead + (case.nheads, case.seqlen_q), numpy.float32)
        cuflash2.attention_backward(out, q, k, k, out, lse, causal=case.causal)
    launched = {launch.config for launch, _, _ in hopper_api.launches}
    assert len(launched) >= 12  # (forward, preprocess, main, conversion kernels of each dtype)
    planned = set(precompile.plan(arch, ["float16", "bfloat16"], selfcheck.DEFAULT_HEADDIMS,
                                  [0], ["fwd", "bwd"]))
    missing = sorted(_configs.describe(c) if hasattr(c, "head_dim") else repr(c)
                     for c in launched - planned)
    assert not missing, missing


def _split_backward_launches(hopper_api, d_qk, d_v, deterministic, **options):
    """attention_backward of a (2, 300 / 500, 8 / 2 heads) call with v's own head dim: its
    gradients and its launches' configurations."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from test_plans_host import device_array

    q, k = device_array((2, 300, 8, d_qk)), device_array((2, 500, 2, d_qk))
    v, out = device_array((2, 500, 2, d_v)), device_array((2, 300, 8, d_v))
    lse = device_array((2, 8, 300), numpy.float32)
    before = len(hopper_api.launches)
    grads = cuflash2.attention_backward(out, q, k, v, out, lse, deterministic=deterministic,
                                        **options)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    return [launch for launch in hopper_api.launches[before:]]


@pytest.mark.parametrize("arch", [80, 86, 90])
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 64), (176, 120), (192, 96)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_v_with_its_own_head_dim_runs_the_mma_sync_backward(hopper_api, arch, d_qk, d_v,
                                                            deterministic):
    """attention_backward with v's own head dim off the Hopper kernel (other GPUs; on sm_90
    dropout): the mma.sync main kernel of Q's head dim's tile (bwd_config's) with V's kernel
    head dim, dV's chunks as many as dK's; in deterministic mode the dQ kernel of that pair
    too; head_dim_v in BwdParams in words. 192 / 96 takes V's 128 where Q's 192 is one chunk of
    8 warps (96 / 4 warps: no 16-column tiles)."""
    from cuflash2 import _configs

    hopper_api.set_arch(arch)
    options = dict(dropout_p=0.1, seed=3) if arch == 90 else {}
    launches = _split_backward_launches(hopper_api, d_qk, d_v, deterministic, causal=True,
                                        **options)
    main = [(launch.config, record) for launch, _, record in launches
            if isinstance(getattr(launch, "config", None), _configs.BwdConfig)]
    (config, record), = main
    features = _configs.FEATURE_DROPOUT if options else 0
    d_v_kernel = {(192, 128): 128, (128, 64): 64, (176, 120): 128, (192, 96): 128}[d_qk, d_v]
    expected = dataclasses.replace(_dispatch.bwd_config("float16", d_qk, arch, deterministic),
                                   head_dim_v=d_v_kernel)
    assert config == _configs.with_features(expected, features)
    assert config.valid and config.d_chunk_v * config.num_chunks == config.head_dim_v
    assert (record["head_dim"], record["head_dim_v"]) == (d_qk, d_v)
    dq = [launch.config for launch, _, _ in launches
          if isinstance(getattr(launch, "config", None), _configs.BwdDqConfig)]
    if deterministic:
        assert dq == [_configs.with_features(dataclasses.replace(
            _dispatch.bwd_dq_config("float16", d_qk, arch), head_dim_v=d_v_kernel), features)]
        assert not config.compute_dq
    else:
        assert dq == [] and config.compute_dq
    assert "(v %d)" % d_v_kernel in _configs.describe(config)


def test_v_with_its_own_head_dim_split_backward_configs():
    """split_bwd_configs: V's kernel head dim below Q's with a warp grid for dV's chunk (the
    next one up where v_kernel_head_dim's has none), 16-bit only; None where none is."""
    from cuflash2 import _configs

    for arch in (80, 86, 89, 90, 120):
        for d_qk, d_v in ((192, 128), (128, 64), (96, 64), (256, 128), (160, 100)):
            main, dq = _dispatch.split_bwd_configs("bfloat16", d_qk, d_v, arch, True)
            assert main.valid and main.head_dim_v == _dispatch.v_kernel_head_dim(d_v, d_qk)
            equal = _dispatch.bwd_config("bfloat16", d_qk, arch, True)
            assert main.smem_bytes < equal.smem_bytes
            assert main.accumulator_registers <= _dispatch.BWD_MAX_ACCUMULATORS
            assert dq.head_dim_v == main.head_dim_v and dq.head_dim == main.head_dim
            atomic, none = _dispatch.split_bwd_configs("bfloat16", d_qk, d_v, arch)
            assert none is None and atomic.compute_dq
        for d_qk, d_v in ((128, 112), (64, 32), (256, 224), (192, 160), (64, 128)):
            assert _dispatch.split_bwd_configs("float16", d_qk, d_v, arch) is None
        assert _dispatch.split_bwd_configs("float32", 192, 128, arch) is None
    with pytest.raises(ValueError, match="below Q's"):
        _configs.BwdConfig("float16", 64, 64, 64, 64, 4, 1, head_dim_v=128)
    with pytest.raises(ValueError, match="16-bit"):
        _configs.BwdDqConfig("float32", 128, 32, 1, head_dim_v=64)
    equal = _dispatch.bwd_config("float16", 128, 80)
    assert equal.head_dim_v == 128 and equal == dataclasses.replace(equal, head_dim_v=0)


def test_v_with_its_own_head_dim_backward_refusals_name_v(hopper_api):
    """What the mma.sync backward leaves out of d_v != d_qk raises NotImplementedError naming
    v's head dim before any launch: a d_v of q's kernel head dim off the Hopper kernel, score
    modifiers, a forced configuration, float32 inputs."""
    numpy = pytest.importorskip("numpy")
    import cuflash2
    from test_plans_host import device_array

    hopper_api.set_arch(80)
    q = device_array((1, 200, 4, 112))
    v, out = device_array((1, 200, 4, 128)), device_array((1, 200, 4, 128))
    lse = device_array((1, 4, 200), numpy.float32)
    before = len(hopper_api.launches)
    with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(128\) apart "
                                                  r"from q's and k's \(112\) .* sm_80"):
        cuflash2.attention_backward(out, q, q, v, out, lse)
    problem = types.SimpleNamespace(batch=1, seqlen_q=200, seqlen_k=200, nheads=4, nheads_kv=4,
                                    head_dim=192, head_dim_v=128, dtype="float16")
    with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(128\) .* "
                                                  r"no mask_mod / score_mod / bias"):
        _dispatch.backward_kernels(problem, 0, False, 80, {}, None, (-1, -1),
                                   user_mods=("mask source", None))
    with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(128\) .* "
                                                  r"no forced kernel configuration"):
        _dispatch.backward_kernels(problem, 0, False, 80, {}, None, (-1, -1),
                                   config=_dispatch.bwd_config("float16", 192, 80))
    problem.dtype = "float32"
    with pytest.raises(NotImplementedError, match=r"backward of v's head dim \(128\) .* "
                                                  r"float16 or bfloat16"):
        _dispatch.backward_kernels(problem, 0, False, 80, {}, None, (-1, -1))
    assert len(hopper_api.launches) == before
