"""The host side of the Hopper backward (cuflash2/_hopper_bwd.py) without a GPU: host arrays
stand in for CuPy's and the driver calls are replaced, so what is checked is the parameter
blocks (BwdParams for the preprocess and the dQ conversion, BwdSm90Params for the main kernel),
the tensor maps' order and box rows, and the three launches' grids."""

import sys
import types

import pytest

from cuflash2 import _configs, _hopper_bwd, _params
from test_hopper_host import _HostArray


@pytest.fixture
def host(monkeypatch):
    numpy = pytest.importorskip("numpy")

    def empty(shape, dtype):
        return _HostArray(numpy.empty(shape, dtype))

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=empty,
                                                                   float32=numpy.float32))
    maps = []

    def fake_map(x, rows):
        maps.append((x.shape, rows))
        return bytes([len(maps)]) * 128

    monkeypatch.setattr(_hopper_bwd, "tensor_map_bytes", fake_map)
    monkeypatch.setattr(_hopper_bwd._launch, "kernel_launch",
                        lambda config, device, grid: (config, grid))
    return numpy, maps


def test_prepared_backward_fills_both_parameter_blocks(host):
    numpy, maps = host
    packed = numpy.zeros((2, 300, 3, 4, 64), numpy.float16)  # (batch, seqlen, qkv, heads, dim)
    q = _HostArray(packed[:, :, 0])
    k = _HostArray(numpy.zeros((2, 200, 2, 64), numpy.float16))
    out = _HostArray(numpy.zeros((2, 300, 4, 64), numpy.float16))
    lse = _HostArray(numpy.zeros((2, 4, 300), numpy.float32))
    prepared = _hopper_bwd.prepare_backward_sm90(out, q, k, k, out, lse, causal=True,
                                                 softmax_scale=0.5)
    assert maps == [((2, 300, 4, 64), 64), ((2, 200, 2, 64), 128), ((2, 200, 2, 64), 128),
                    ((2, 300, 4, 64), 64)]
    (pre, pre_block, _), (main, main_block, _), (conv, conv_block, _) = prepared.launches
    assert pre_block is conv_block
    assert pre[0].kernel == "flash_bwd_preprocess_kernel" and pre[1] == (384 // 64, 4, 2)  # 64 rows a CTA
    assert main[0].head_dim == 64 and main[1] == (2, 2, 2)  # key blocks, KV heads, batch
    assert conv[0].kernel == "flash_bwd_convert_dq_kernel" and conv[1] == (-(-300 * 8 // 256), 4, 2)
    for index, name in enumerate(("q_map", "k_map", "v_map", "do_map")):
        offset = main_block.layout.offsets[name]
        assert bytes(main_block.bytes[offset:offset + 128]) == bytes([index + 1]) * 128
    aux = pre_block.record[0]
    base = main_block.record[0]["base"]
    # the main kernel's BwdParams are the aux kernels', byte for byte
    offset = main_block.layout.offsets["base"]
    size = _params.layout("BwdParams").size
    assert bytes(main_block.bytes[offset:offset + size]) == bytes(pre_block.bytes[:size])
    assert (aux["seqlen_q"], aux["seqlen_q_padded"], aux["seqlen_k"], aux["nheads"],
            aux["heads_per_kv_head"], aux["head_dim"], aux["accum_dim"]) == (
        300, 384, 200, 4, 2, 64, 64)
    assert (aux["q_batch_stride"], aux["q_row_stride"], aux["q_head_stride"]) == (
        300 * 3 * 4 * 64, 3 * 4 * 64, 64)
    assert (aux["dk_batch_stride"], aux["dk_row_stride"], aux["dk_head_stride"]) == (
        200 * 2 * 64, 2 * 64, 64)
    assert (aux["window_left"], aux["window_right"]) == (-1, 0)
    assert aux["softmax_scale"] == 0.5 and abs(aux["scale_log2"] - 0.5 * 1.4426950408889634) < 1e-6
    assert aux["dq_accum"] == prepared.workspace[2].data.ptr and aux["dk"] == prepared.dk.data.ptr
    assert prepared.workspace[2].array.size == 2 * 4 * 384 * 64
    assert base["q"] == q.data.ptr and prepared.config.features == 0


@pytest.mark.parametrize("head_dim,kernel_dim", [(64, 64), (72, 96), (96, 96), (104, 128),
                                                 (128, 128)])
def test_prepared_backward_picks_the_kernel_head_dim(host, head_dim, kernel_dim):
    numpy, _ = host
    q = _HostArray(numpy.zeros((1, 100, 2, head_dim), numpy.float16))
    lse = _HostArray(numpy.zeros((1, 2, 100), numpy.float32))
    prepared = _hopper_bwd.prepare_backward_sm90(q, q, q, q, q, lse, softcap=30.0)
    config = prepared.launches[1][0][0]
    assert config.head_dim == kernel_dim and config.features == _configs.FEATURE_SOFTCAP
    aux = prepared.launches[0][1].record[0]
    assert aux["accum_dim"] == kernel_dim and aux["head_dim"] == head_dim
    scale = head_dim ** -0.5
    assert abs(aux["mods"]["softcap_scale"] - scale / 30.0) < 1e-6
    assert abs(aux["scale_log2"] - 30.0 * 1.4426950408889634) < 1e-4


def test_prepared_backward_refuses_what_it_does_not_cover(host):
    numpy, _ = host
    q = _HostArray(numpy.zeros((1, 10, 2, 192), numpy.float16))
    lse = _HostArray(numpy.zeros((1, 2, 10), numpy.float32))
    with pytest.raises(ValueError, match="head dims up to 128"):
        _hopper_bwd.prepare_backward_sm90(q, q, q, q, q, lse)
