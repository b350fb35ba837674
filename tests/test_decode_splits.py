"""The split-KV count heuristic of attention_with_kvcache (CPU: pure arithmetic)."""

import dataclasses

import pytest

from cuflash2._configs import MAX_SPLITS as _MAX_SPLITS
from cuflash2._dispatch import AUTO_MAX_SPLITS as _AUTO_MAX_SPLITS, num_splits_for as _num_splits
from cuflash2._kvcache import check_num_splits as _check_num_splits

SLOTS = 132 * 3  # H200, three decode CTAs per SM


@pytest.mark.parametrize("ctas,tiles", [(4, 64), (4, 256), (4, 1024), (32, 256), (32, 1024),
                                        (100, 300), (1, 8), (7, 5000), (300, 1024)])
def test_automatic_split_count_fills_one_wave(ctas, tiles):
    splits = _num_splits(0, ctas, tiles, SLOTS)
    assert 1 <= splits <= min(tiles, _AUTO_MAX_SPLITS)
    # The splits wait for each other: the whole grid is resident at once ...
    assert splits == 1 or ctas * splits <= SLOTS
    # ... every split gets the same number of KV tiles (no trailing short splits) ...
    assert -(-tiles // -(-tiles // splits)) == splits
    # ... and no larger such count (up to the automatic maximum) would fit.
    if ctas < 0.8 * SLOTS:
        counts = {-(-tiles // -(-tiles // s)) for s in range(1, _AUTO_MAX_SPLITS + 1)}
        assert not [s for s in counts if splits < s and ctas * s <= SLOTS]


def test_a_full_grid_is_not_split():
    assert _num_splits(0, SLOTS, 1024, SLOTS) == 1
    assert _num_splits(0, -(-8 * SLOTS // 10), 1024, SLOTS) == 1  # from 80% of the slots


def test_requested_counts_are_clamped_to_the_tiles_the_maximum_and_one_wave():
    assert _num_splits(5, 4, 64, SLOTS) == 5
    assert _num_splits(500, 2, 1024, SLOTS) == _MAX_SPLITS
    assert _num_splits(50, 4, 3, SLOTS) == 3
    assert _num_splits(1, 4, 1024, SLOTS) == 1
    assert _num_splits(64, 32, 1024, SLOTS) == SLOTS // 32
    assert _num_splits(8, 2 * SLOTS, 1024, SLOTS) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_num_splits_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        _check_num_splits(bad)


class _Fits:
    """A stand-in for the driver's cluster occupancy: up to `most` clusters of any size."""

    def __init__(self, most):
        self.most = most

    def __call__(self, config, device_id, cluster, clusters=1):
        return cluster <= 16 and clusters <= self.most


@pytest.mark.parametrize("most_clusters", [64, 2])
def test_splits_merge_in_a_cluster_where_the_step_is_short(monkeypatch, most_clusters):
    """On sm_90 a short step (at most CLUSTER_MAX_TILES_PER_SPLIT tiles a split) or a requested
    count a cluster holds merges inside a cluster of its splits, with the kernel that loads a
    whole split at once where the step is short; long steps, larger requests, clusters that do
    not all fit, other architectures and CLUSTER_MERGE off use the barrier through L2."""
    from cuflash2 import _dispatch, _launch

    monkeypatch.setattr(_dispatch, "decode_slots", lambda config, device_id: 264)
    monkeypatch.setattr(_launch, "cluster_fits", _Fits(most_clusters))
    monkeypatch.setattr(_launch, "extended_available", lambda: True)
    config = _dispatch.decode_config("float16", 128, 90)
    deep = _dispatch.decode_cluster_config("float16", 128, 90)
    # The clustered kernel loads a whole short split at once, on 128-key tiles at d=128.
    assert deep.keys_per_warp == 32 and deep.block_n == 2 * config.block_n
    assert ((deep.kv_stages - 1) * deep.block_n
            == _dispatch.CLUSTER_MAX_TILES_PER_SPLIT * config.block_n)
    # Reading the cache early, all but the last tile before the previous kernel ends.
    early = _dispatch.decode_cluster_config("float16", 128, 90, early_cache_reads=True)
    assert early == dataclasses.replace(deep, kv_stages=deep.kv_stages - 1,
                                        early_cache_reads=True)

    def choose(requested, groups, tiles, arch=90):
        return _dispatch.choose_splits(config, requested, groups, tiles, 0, arch, "float16", 128,
                                      0)

    fits = most_clusters >= 4
    # Batch 1, 4 KV heads, 4k tokens (64 tiles): 16 splits of 4 tiles, in clusters.
    assert choose(0, 4, 64) == ((deep, 16, 16) if fits else (config, 32, 1))
    early_config = dataclasses.replace(config, early_cache_reads=True)
    assert _dispatch.choose_splits(early_config, 0, 4, 64, 0, 90, "float16", 128, 0) == (
        (early, 16, 16) if fits else (early_config, 32, 1))
    # 16k tokens: 16 tiles a split in a cluster is too long: 32 splits through L2.
    assert choose(0, 4, 256) == (config, 32, 1)
    # A requested count a cluster holds (the default stage count: the step is long).
    assert choose(7, 4, 256) == ((config, 7, 7) if fits else (config, 7, 1))
    assert choose(64, 4, 256) == (config, 64, 1)
    assert choose(0, 4, 64, arch=80) == (config, 32, 1)
    monkeypatch.setattr(_dispatch, "CLUSTER_MERGE", False)
    assert choose(0, 4, 64) == (config, 32, 1)


@pytest.mark.parametrize("clusters_launch", [True, False])
def test_a_step_that_forms_a_cluster_keeps_its_rows_on_an_m16_tile(monkeypatch, clusters_launch):
    """A step whose rows fit the mma's n side (one token of a GQA group) runs that kernel unless
    its splits form a cluster; such a step runs the m16 kernel whether or not clusters launch,
    so a launch path without them merges through L2 on the same kernel (the same bits)."""
    from cuflash2 import _configs, _dispatch, _launch

    monkeypatch.setattr(_dispatch, "decode_slots", lambda config, device_id: 264)
    monkeypatch.setattr(_launch, "cluster_fits", _Fits(64))
    monkeypatch.setattr(_launch, "extended_available", lambda: clusters_launch)
    n8 = _dispatch.decode_config("float16", 128, 90, _configs.DECODE_BLOCK_M_N8)
    m16 = dataclasses.replace(n8, block_m=_configs.DECODE_BLOCK_M)
    assert n8.block_m == 8 and m16 == _dispatch.decode_config("float16", 128, 90)
    deep = _dispatch.decode_cluster_config("float16", 128, 90)

    def choose(requested, groups, tiles, arch=90):
        return _dispatch.choose_splits(n8, requested, groups, tiles, 0, arch, "float16", 128, 0)

    assert choose(7, 4, 256) == ((m16, 7, 7) if clusters_launch else (m16, 7, 1))
    assert choose(0, 4, 64) == ((deep, 16, 16) if clusters_launch else (m16, 32, 1))
    assert choose(0, 4, 256) == (n8, 32, 1)
    assert choose(64, 4, 256) == (n8, 64, 1)
    assert choose(0, 4, 64, arch=80) == (n8, 32, 1)


def test_launch_attribute_structs_match_cuda_h():
    """The ctypes mirrors of cuda.h's CUlaunchAttribute and CUlaunchConfig (the libcuda launch
    path): sizes and offsets as the C compiler lays them out."""
    import ctypes

    from cuflash2 import _launch

    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    assert _launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_launch._LaunchConfig) == 56
    assert _launch._LaunchConfig.hStream.offset == 32
    assert _launch._LaunchConfig.attrs.offset == 40
    assert _launch._LaunchConfig.numAttrs.offset == 48


def test_graph_node_structs_match_cuda_h():
    """The ctypes mirror of cuda.h's CUDA_KERNEL_NODE_PARAMS (v2) that the plans' graphs are
    built from, and the launch attribute value union their nodes take."""
    import ctypes

    from cuflash2 import _launch

    assert ctypes.sizeof(_launch._KernelNodeParams) == 72
    assert _launch._KernelNodeParams.sharedMemBytes.offset == 32
    assert _launch._KernelNodeParams.kernelParams.offset == 40
    assert _launch._KernelNodeParams.extra.offset == 48
    assert _launch._KernelNodeParams.ctx.offset == 64
    assert ctypes.sizeof(_launch._AttributeValue) == 64


def test_graph_replay_is_on_unless_switched_off(monkeypatch):
    from cuflash2 import _launch

    for value, expected in ((None, True), ("1", True), ("0", False)):
        if value is None:
            monkeypatch.delenv("CUFLASH2_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("CUFLASH2_GRAPHS", value)
        assert _launch._graphs_wanted() is expected
    monkeypatch.setenv("CUFLASH2_GRAPHS", "yes")
    with pytest.raises(ValueError, match="CUFLASH2_GRAPHS must be 0 or 1"):
        _launch._graphs_wanted()
    monkeypatch.setattr(_launch, "METHOD", "cupy")
    assert not _launch.graphs_available()  # CuPy's launch path has no graphs


def test_graph_nodes_carry_the_cooperative_and_cluster_attributes():
    from cuflash2 import _launch

    def launch(cooperative=False, cluster=1, grid=(4, 2, 3)):
        return _launch.Launch(None, None, grid, 128, 0, cooperative, cluster=cluster)

    assert _launch._node_attributes(launch()) == []
    ((attribute, value),) = _launch._node_attributes(launch(cooperative=True))
    assert attribute == _launch._ATTRIBUTE_COOPERATIVE and value[0] == 1
    ((attribute, value),) = _launch._node_attributes(launch(cluster=16))
    assert attribute == _launch._ATTRIBUTE_CLUSTER_DIMENSION and list(value[:3]) == [16, 1, 1]
    # A batch launched in slices stays on single launches; so does a plan without launches.
    assert _launch.LaunchGraphs.covers([launch(), launch(cooperative=True)])
    assert not _launch.LaunchGraphs.covers([launch(grid=(1, 1, _launch.MAX_GRID_Z + 1))])
    assert not _launch.LaunchGraphs.covers([])


def test_launch_configs_carry_their_attributes(monkeypatch):
    """cuLaunchKernelEx's launch configs, as both driver paths build them: grid, block, shared
    memory, and the programmatic, cooperative and cluster attributes asked for."""
    import ctypes

    from cuflash2 import _launch

    bindings = pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setattr(_launch, "_bindings", bindings)
    monkeypatch.setattr(_launch, "METHOD", "bindings")
    config = _launch._extended_config((32, 4, 70000), 128, 99000, False, True, 16)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (32, 4, _launch.MAX_GRID_Z)
    assert (config.blockDimX, config.sharedMemBytes, config.numAttrs) == (128, 99000, 2)
    ids = [int(a.id) for a in config.attrs]
    assert ids == [_launch._ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                   _launch._ATTRIBUTE_CLUSTER_DIMENSION]
    assert config.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert (config.attrs[1].value.clusterDim.x, config.attrs[1].value.clusterDim.y) == (16, 1)
    cooperative = _launch._extended_config((8, 1, 1), 64, 0, True, True)
    assert [int(a.id) for a in cooperative.attrs] == [
        _launch._ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, _launch._ATTRIBUTE_COOPERATIVE]

    monkeypatch.setattr(_launch, "METHOD", "libcuda")
    config = _launch._extended_config((32, 4, 2), 128, 99000, True, True, 1)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ, config.numAttrs) == (32, 4, 2, 2)
    assert [config.attrs[i].id for i in range(2)] == [
        _launch._ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, _launch._ATTRIBUTE_COOPERATIVE]
    assert [config.attrs[i].value[0] for i in range(2)] == [1, 1]
    clustered = _launch._extended_config((32, 1, 1), 128, 0, False, False, 8)
    assert clustered.numAttrs == 1 and list(clustered.attrs[0].value[:3]) == [8, 1, 1]
    assert ctypes.sizeof(clustered) == 56


def test_early_cache_reads_are_specialisations_of_the_programmatic_archs():
    """attention_with_kvcache(early_cache_reads=True) runs its own specialisations where launches
    are programmatic: the compile matrix holds them from that arch on, and none before."""
    from cuflash2 import _dispatch, _launch

    assert _dispatch.CLUSTER_MIN_ARCH == _launch.PROGRAMMATIC_MIN_ARCH
    before = _dispatch.all_decode_configs(89)
    assert before and not [c for c in before if c.early_cache_reads]
    configs = _dispatch.all_decode_configs(90)
    early = [c for c in configs if c.early_cache_reads]
    assert len(early) == len(configs) // 2
    # The same kernels with the flag, but for the clustered steps' (a stage fewer: all but the
    # last tile of a split read before the previous kernel ends).
    plain = {c for c in configs if not c.early_cache_reads}
    for c in early:
        assert (dataclasses.replace(c, early_cache_reads=False) in plain
                or c == _dispatch.decode_cluster_config(c.dtype, c.head_dim, 90, True))
