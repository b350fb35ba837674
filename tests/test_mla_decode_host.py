"""attention_with_kvcache on MLA's latent cache (docs/MLA_DECODE.md), on the host stand-in of
test_plans_host (nothing compiled or launched): the plan of the MLA decode kernel (its struct,
tensor map, splits, output) and every refusal, each before any launch."""

import numpy
import pytest

from cuflash2 import _configs, _dispatch, _hopper, _kvcache, _launch
from test_plans_host import api_host, device_array, launches  # noqa: F401  (fixtures)

D, DV = _configs.MLA_HEAD_DIM, _configs.MLA_HEAD_DIM_V


@pytest.fixture
def mla_host(api_host, monkeypatch):  # noqa: F811
    """api_host on sm_90 with a stand-in TMA encoder (word 0 the address, word 1 the box rows)."""
    api_host.set_arch(90)
    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    # clusters launch and a pair of CTAs fits (test_row_blocks_pair_where_they_see_the_same_tiles)
    monkeypatch.setattr(_launch, "extended_available", lambda: True)
    monkeypatch.setattr(_launch, "cluster_fits", lambda *args: True)
    monkeypatch.setattr(_hopper, "tensor_map_bytes", lambda x, rows: numpy.array(
        [x.data.ptr, rows] + [0] * 14, numpy.uint64).tobytes())
    return api_host


def _latent(batch=2, seqlen_q=1, nheads=128, capacity=4096, new=1, dtype=numpy.float16,
            blocks=None, page=64):
    q = device_array((batch, seqlen_q, nheads, D), dtype)
    if blocks is None:
        cache = device_array((batch, capacity, 1, D), dtype)
        table = None
    else:
        cache = device_array((blocks, page, 1, D), dtype)
        table = device_array((batch, capacity // page), numpy.int32)
    k = device_array((batch, new, 1, D), dtype) if new else None
    return q, cache, k, table


def _call(q, cache, k, table=None, **kw):
    import cuflash2

    return cuflash2.attention_with_kvcache(
        q, cache, cache[..., :DV], k=k, v=None if k is None else k[..., :DV],
        block_table=table, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", [numpy.float16, "bfloat16"])
@pytest.mark.parametrize("nheads,seqlen_q", [(16, 1), (64, 2), (128, 1), (128, 2)])
def test_a_latent_call_plans_the_mla_kernel(mla_host, dtype, nheads, seqlen_q):
    """The MLA kernel of the dtype, 64 packed rows a CTA (heads x query tokens), the batch in z;
    the output has V's head dim; the cache's map is patched with k_cache's address, its box
    rows 64; the new rows' pointer and strides those of k."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    q, cache, k, _ = _latent(seqlen_q=seqlen_q, nheads=nheads, dtype=dtype)
    out, lse = _call(q, cache, k, cache_seqlens=4000, causal=seqlen_q > 1)
    launch, _, record = mla_host.launches[-1]
    assert isinstance(launch.config, _configs.MlaDecodeConfig)
    assert launch.config.dtype == numpy.dtype(dtype).name
    m_blocks = -(-nheads * seqlen_q // 64)
    assert launch.grid[1:] == (1, 2) and launch.grid[0] % m_blocks == 0
    assert out.shape == (2, seqlen_q, nheads, DV) and lse.shape == (2, nheads, seqlen_q)
    words = numpy.ravel(record["kv_map"]["v"])
    assert int(words[0]) == cache.data.ptr and int(words[1]) == 64
    assert record["box_rows"] == 64
    base = record["base"]
    assert base["k_new"] == k.data.ptr and base["k_cache"] == cache.data.ptr
    assert base["head_dim"] == D and base["heads_per_kv_head"] == nheads
    assert base["num_m_blocks"] == m_blocks and base["cache_len_all"] == 4000
    assert base["kc_row_stride"] == D and base["kn_row_stride"] == D
    # the output's strides are its own (V's head dim), not q's
    assert (base["o_batch_stride"], base["o_row_stride"], base["o_head_stride"]) == (
        seqlen_q * nheads * DV, nheads * DV, DV)
    assert base["window_right"] == (0 if seqlen_q > 1 else -1)


def test_a_latent_call_without_new_rows_or_with_ragged_lengths(mla_host):
    q, cache, _, _ = _latent(new=0)
    lengths = device_array((2,), numpy.int32)
    _call(q, cache, None, cache_seqlens=lengths)
    base = mla_host.launches[-1][2]["base"]
    assert base["k_new"] == 0 and base["seqlen_new"] == 0
    assert base["cache_seqlens"] == lengths.data.ptr


@pytest.mark.parametrize("page", [64, 128, 256, 16, 32, 8])
def test_a_paged_latent_cache_takes_a_box_a_page(mla_host, page):
    """Pages of a multiple of 64 positions: boxes of 64 rows; shorter pages (multiples of 8): a
    box of the page's rows; the block table's pointer and stride in the struct."""
    q, cache, k, table = _latent(blocks=200, page=page, capacity=4096)
    _call(q, cache, k, table, cache_seqlens=3000)
    launch, _, record = mla_host.launches[-1]
    assert record["box_rows"] == min(64, page)
    assert int(numpy.ravel(record["kv_map"]["v"])[1]) == min(64, page)
    base = record["base"]
    assert base["block_table"] == table.data.ptr and base["page_size"] == page
    assert base["num_blocks"] == 200 and base["capacity"] == 4096


def test_splits_merge_through_l2_in_a_cooperative_launch(mla_host):
    """A short batch (2 CTAs of rows) splits its keys, the splits merging at a barrier through
    L2 (a cooperative launch, a workspace of 512 fp32 columns a row); a requested count is
    kept where it fits, and a full grid is not split."""
    q, cache, k, _ = _latent(batch=1, capacity=16384)
    _call(q, cache, k, cache_seqlens=16000)
    launch, _, record = mla_host.launches[-1]
    splits = record["base"]["num_splits"]
    assert splits > 1 and launch.grid == (2 * splits, 1, 1) and launch.cooperative
    assert record["base"]["tiles_per_split"] * splits >= 16384 // 64
    assert record["base"]["split_counters"] != 0 and record["base"]["o_partial"] != 0
    _call(q, cache, k, cache_seqlens=16000, num_splits=4)
    launch, _, record = mla_host.launches[-1]
    assert record["base"]["num_splits"] == 4 and launch.grid == (8, 1, 1)
    _call(q, cache, k, cache_seqlens=16000, num_splits=1)
    launch, _, record = mla_host.launches[-1]
    assert record["base"]["num_splits"] == 1 and not launch.cooperative
    assert launch.config.paired and launch.cluster == 2  # (its two row blocks: one token)
    q, cache, k, _ = _latent(batch=132, capacity=1024)
    _call(q, cache, k, cache_seqlens=1000)
    assert mla_host.launches[-1][2]["base"]["num_splits"] == 1


@pytest.mark.parametrize("nheads,seqlen_q,paired", [(128, 1, True), (128, 2, True),
                                                    (256, 1, True), (64, 2, False),
                                                    (16, 1, False), (192, 1, False)])
def test_row_blocks_pair_where_they_see_the_same_tiles(mla_host, monkeypatch, nheads, seqlen_q,
                                                       paired):
    """With one split, row blocks 2i and 2i + 1 of one query token's rows (one token a step, or
    heads a multiple of 128) run as a cluster of two CTAs sharing each tile (MlaDecodeConfig.paired,
    launch.cluster 2, no split cluster for the kernel's merge); an odd number of row blocks, rows
    of two tokens in a pair, several splits, MLA_PAIRED off or a pair that does not fit: alone."""
    q, cache, k, _ = _latent(batch=132, seqlen_q=seqlen_q, nheads=nheads, capacity=1024)
    _call(q, cache, k, cache_seqlens=1000, causal=seqlen_q > 1)
    launch, _, record = mla_host.launches[-1]
    assert (launch.config.paired, launch.cluster) == ((True, 2) if paired else (False, 1))
    assert record["base"]["split_cluster"] == 0
    if not paired:
        return
    assert record["base"]["num_splits"] == 1 and not launch.cooperative
    q, cache, k, _ = _latent(batch=1, seqlen_q=seqlen_q, nheads=nheads, capacity=16384)
    _call(q, cache, k, cache_seqlens=16000)  # several splits: alone
    assert not mla_host.launches[-1][0].config.paired
    q, cache, k, _ = _latent(batch=132, seqlen_q=seqlen_q, nheads=nheads, capacity=1024)
    monkeypatch.setattr(_launch, "cluster_fits", lambda *args: False)
    _kvcache._plans_by_key.plans.clear()  # (a plan is made once a call signature)
    _call(q, cache, k, cache_seqlens=1000)
    assert not mla_host.launches[-1][0].config.paired
    monkeypatch.setattr(_launch, "cluster_fits", lambda *args: True)
    monkeypatch.setattr(_dispatch, "MLA_PAIRED", False)
    _kvcache._plans_by_key.plans.clear()
    _call(q, cache, k, cache_seqlens=1000)
    assert not mla_host.launches[-1][0].config.paired


def test_the_mla_split_count_fits_one_wave(monkeypatch):
    """mla_decode_kernel on a stand-in of 132 resident CTAs: splits x CTAs within them."""
    import types

    kv = types.SimpleNamespace(batch=1, seqlen_q=1, nheads=128, capacity=16384)
    monkeypatch.setattr(_dispatch, "decode_slots", lambda config, device_id: 132)
    choice = _dispatch.mla_decode_kernel(kv, "bfloat16", 0, 0)
    assert choice.m_blocks == 2 and choice.groups == 2 and choice.cluster == 1
    assert 1 < choice.splits <= 32 and 2 * choice.splits <= 132
    assert not choice.programmatic


def _refusals(q, cache, k, table):
    bad_v = device_array(cache.shape[:-1] + (DV,), q.dtype)
    return [
        (dict(v_cache=bad_v), ValueError, r"v_cache with its own head dim must be the view"),
        (dict(v=device_array(k.shape[:-1] + (DV,), q.dtype)), ValueError,
         r"v \(the new tokens' values\) must be the view"),
        (dict(softcap=30.0), NotImplementedError, r"softcap is not taken with a latent cache"),
        (dict(alibi_slopes=device_array((128,), numpy.float32)), NotImplementedError,
         r"alibi_slopes is not taken"),
        (dict(sinks=device_array((128,), numpy.float32)), NotImplementedError,
         r"sinks is not taken"),
        (dict(cache_leftpad=device_array((2,), numpy.int32)), NotImplementedError,
         r"cache_leftpad is not taken"),
        (dict(window_size=(100, -1)), NotImplementedError, r"window_size with a left edge"),
    ]


def test_other_latent_calls_are_refused_naming_the_argument_before_any_launch(mla_host):
    import cuflash2

    q, cache, k, table = _latent()
    for kwargs, error, message in _refusals(q, cache, k, table):
        arguments = dict(k=k, v=k[..., :DV], cache_seqlens=4000)
        v_cache = kwargs.pop("v_cache", cache[..., :DV])
        arguments.update(kwargs)
        count = len(mla_host.launches)
        with pytest.raises(error, match=message):
            cuflash2.attention_with_kvcache(q, cache, v_cache, **arguments)
        assert len(mla_host.launches) == count


@pytest.mark.parametrize("case,error,message", [
    ("dims", NotImplementedError, r"MLA's latent cache only \(k_cache 576"),
    ("kv_heads", NotImplementedError, r"has one KV head; k_cache has 2"),
    ("page", NotImplementedError, r"pages of 48 positions"),
    ("arch", NotImplementedError, r"runs on sm_90 \(H100 / H200\) only; this device is sm_80"),
])
def test_latent_shapes_pages_and_devices_outside_the_kernel_are_refused(mla_host, case, error,
                                                                       message):
    import cuflash2

    q, cache, k, table = _latent()
    v_dim = DV
    if case == "dims":
        q, cache = device_array((2, 1, 16, 256)), device_array((2, 4096, 1, 256))
        k, v_dim = device_array((2, 1, 1, 256)), 128
    elif case == "kv_heads":
        cache, k = device_array((2, 4096, 2, D)), device_array((2, 1, 2, D))
    elif case == "page":
        q, cache, k, table = _latent(blocks=200, page=48, capacity=48 * 80)
    elif case == "arch":
        mla_host.set_arch(80)
    count = len(mla_host.launches)
    with pytest.raises(error, match=message):
        cuflash2.attention_with_kvcache(q, cache, cache[..., :v_dim], k=k, v=k[..., :v_dim],
                                        block_table=table,
                                        cache_seqlens=None if table is not None else 4000)
    assert len(mla_host.launches) == count


def test_the_mla_config():
    config = _configs.MlaDecodeConfig("bfloat16")
    # Q and two tiles of 64 latent rows, the tile's P (64 x 64, 16-bit), two consumers' maxima
    assert config.threads == 384
    assert config.smem_bytes == 3 * 64 * D * 2 + 64 * 64 * 2 + 2 * 64 * 4 + 1024
    assert config.smem_bytes <= _configs.SM90_MAX_SMEM
    assert config.name_expression == "flash_mla_decode_sm90_kernel<bf16_tag, false>"
    paired = _configs.MlaDecodeConfig("bfloat16", paired=True)
    assert paired.name_expression == "flash_mla_decode_sm90_kernel<bf16_tag, true>"
    assert paired.smem_bytes == config.smem_bytes
    assert "MLA decode" in _configs.describe(config)
    with pytest.raises(ValueError):
        _configs.MlaDecodeConfig("float32")
