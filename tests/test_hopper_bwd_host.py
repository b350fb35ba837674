"""The host side of the Hopper backward (its dispatch in cuflash2/_dispatch.py, its tensor maps in
cuflash2/_hopper.py, its plan in cuflash2/_attention_plans.py) without a GPU: host arrays stand
in for CuPy's and the driver calls are replaced. Checked: which calls `hopper_backward_config`
covers, and the plan the dispatcher
makes for a covered call (BwdSm90Params: the four tensor maps, their box rows and address
words, the BwdParams fields under `base` identical to the mma.sync plan's, the launches, their
grids and the struct each takes, the per-call patching of maps and pointers), and
`prepare_backward_sm90`, which builds the same plan."""

import dataclasses
import sys
import types

import pytest

from cuflash2 import _attention_plans, _configs, _dispatch, _hopper, _params, _plans
from cuflash2 import _prepare, _validate
from cuflash2._options import AttentionOptions
from test_hopper_host import _HostArray, hopper_api  # noqa: F401  (a fixture)
from test_plans_host import _fake_cupy, api_host, launches  # noqa: F401  (fixtures)

numpy = pytest.importorskip("numpy")
LOG2E = 1.4426950408889634


class _Array(_HostArray):
    """A host array with what Plan.run reads (size) and packed views kept as _Array."""

    def __init__(self, array):
        super().__init__(array)
        self.size = array.size

    def __getitem__(self, index):
        return _Array(self.array[index])


def _zeros(*shape, dtype=numpy.float16):
    return _Array(numpy.zeros(shape, dtype))


@pytest.fixture
def host(monkeypatch):
    """ENABLED on, bindings 'available', maps encoded by a stand-in whose word 0 is the address
    (as the driver's, checked by encode_map) and word 1 the box rows, kernels not compiled."""
    maps = []

    def fake_map(x, rows):
        maps.append((x.shape, rows))
        words = numpy.zeros(16, numpy.uint64)
        words[0], words[1], words[2] = x.data.ptr, rows, len(maps)
        return words.tobytes()

    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", True)
    monkeypatch.setattr(_hopper, "bindings_available", lambda: True)
    monkeypatch.setattr(_hopper, "tensor_map_bytes", fake_map)
    monkeypatch.setattr(_attention_plans._launch, "kernel_launch",
                        lambda config, device, grid: types.SimpleNamespace(config=config,
                                                                           grid=grid))
    return maps


# --------------------------------------------------------------------------------------------
# backward_config: who is covered


def _problem(batch=2, sq=300, sk=200, h=4, hkv=2, d=64, dtype="float16"):
    return _validate.AttentionProblem(batch, sq, sk, h, hkv, d, dtype, True, d ** -0.5)


def _views(batch=2, sq=300, sk=200, h=4, hkv=2, d=64):
    q = _zeros(batch, sq, h, d)
    k = _zeros(batch, sk, hkv, d)
    return {"q": q, "k": k, "v": k, "dout": q}


def _config(problem=None, features=0, arch=90, views=None, varlen=None, deterministic=False):
    problem = problem or _problem()
    views = views or _views(problem.batch, problem.seqlen_q, problem.seqlen_k, problem.nheads,
                            problem.nheads_kv, problem.head_dim)
    config = _dispatch.hopper_backward_config(problem, features, arch, varlen, deterministic)
    if config is None:
        return None
    # what _dispatch.backward_kernels asks of the TMA before it takes the Hopper kernel
    readable = _hopper.readable_map_fields(views, _hopper.backward_maps(config))
    return config if readable is not None else None


@pytest.mark.parametrize("head_dim", [40, 64, 96, 128, 160, 192, 256])
def test_deterministic_calls_order_their_dq_on_the_hopper_kernel(host, head_dim):
    """deterministic=True at every head dim (and under any window: the configuration does not
    depend on it): the kernel with its dQ additions in key-block order (flash_bwd_sm90.cu,
    DETERMINISTIC)."""
    config = _config(_problem(d=head_dim), deterministic=True)
    assert config.deterministic
    assert "key-block order" in _configs.describe(config)
    assert not _config(_problem(d=head_dim)).deterministic
    # staged dQ tiles (one at d=64's 128-row steps, two up to d=128) or the consumers' vector
    # reductions (above), ordered
    buffers = 1 if head_dim <= 64 else 2 if head_dim <= 128 else 0
    assert config.name_expression.endswith(f", {buffers}, true>")


def test_the_flag_is_on_by_default():
    """The Hopper backward is on unless CUFLASH2_HOPPER_BWD=0, and so is varlen on the Hopper
    forward unless CUFLASH2_HOPPER_VARLEN=0. Read at import, so each value is tried in a fresh
    interpreter."""
    import os
    import subprocess

    variables = ("CUFLASH2_HOPPER_BWD", "CUFLASH2_HOPPER_VARLEN")
    for value, expected in ((None, "True True"), ("0", "False False"), ("1", "True True")):
        env = {k: v for k, v in os.environ.items() if k not in variables}
        if value is not None:
            env.update(dict.fromkeys(variables, value))
        probe = ("from cuflash2 import _dispatch; "
                 "print(_dispatch.HOPPER_BACKWARD, _dispatch.HOPPER_FORWARD_VARLEN)")
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                text=True, check=True)
        assert result.stdout.strip() == expected, (value, result.stdout, result.stderr)


@pytest.mark.parametrize("head_dim,kernel_dim", [(8, 64), (40, 64), (64, 64), (72, 96),
                                                 (96, 96), (104, 128), (128, 128), (136, 192),
                                                 (160, 192), (192, 192), (200, 256),
                                                 (224, 256), (256, 256)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_covered_calls_get_the_smallest_kernel_head_dim(host, head_dim, kernel_dim, dtype):
    config = _config(_problem(d=head_dim, dtype=dtype))
    assert isinstance(config, _configs.BwdSm90Config)
    assert (config.head_dim, config.dtype, config.features) == (kernel_dim, dtype, 0)
    assert config == _dispatch.bwd_sm90_config(dtype, kernel_dim)


@pytest.mark.parametrize("features", [_configs.FEATURE_SOFTCAP, _configs.FEATURE_ALIBI,
                                      _configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI])
def test_score_modifiers_are_covered(host, features):
    assert _config(features=features).features == features


def test_gqa_mqa_one_token_and_unbatched_are_covered(host):
    assert _config(_problem(h=8, hkv=1)) is not None
    assert _config(_problem(batch=1, sq=1, sk=1)) is not None
    q, k = _zeros(300, 4, 64), _zeros(200, 2, 64)  # (seqlen, heads, dim): batch 1
    problem = _validate.AttentionProblem(1, 300, 200, 4, 2, 64, "float16", False, 0.125)
    assert _config(problem, views={"q": q, "k": k, "v": k, "dout": q}) is not None


def test_packed_views_are_covered(host):
    packed = _zeros(2, 300, 3, 4, 64)  # (batch, seqlen, qkv, heads, dim)
    views = {"q": packed[:, :, 0], "k": packed[:, :, 1], "v": packed[:, :, 2],
             "dout": _zeros(2, 300, 4, 64)}
    assert _config(_problem(sk=300, hkv=4), views=views) is not None


def test_varlen_calls_are_covered_unless_switched_off(host, monkeypatch):
    varlen = _prepare.Varlen(300, 200, 2)
    features = _configs.FEATURE_VARLEN | _configs.FEATURE_SOFTCAP
    config = _config(_problem(), varlen=varlen, features=features)
    assert config is not None and config.features == features
    ordered = _config(_problem(), varlen=varlen, features=features, deterministic=True)
    assert ordered == dataclasses.replace(config, deterministic=True)
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD_VARLEN", False)
    assert _config(_problem(), varlen=varlen, features=features) is None
    assert _config(_problem(), varlen=varlen, features=features, deterministic=True) is None
    assert _config(_problem()) is not None  # dense calls: VARLEN does not apply


@pytest.mark.parametrize("case", ["disabled", "sm80", "sm100", "dropout",
                                  "deterministic_dropout", "d264", "d512", "empty_q", "empty_k",
                                  "no_batch", "no_bindings", "reversed_rows"])
def test_what_the_hopper_backward_refuses(host, monkeypatch, case):
    kwargs = {}
    problem = _problem()
    if case == "disabled":
        monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", False)
    elif case in ("sm80", "sm100"):
        kwargs["arch"] = {"sm80": 80, "sm100": 100}[case]
    elif case == "dropout":
        kwargs["features"] = _configs.FEATURE_DROPOUT
    elif case == "deterministic_dropout":
        kwargs["features"] = _configs.FEATURE_DROPOUT
        kwargs["deterministic"] = True
    elif case in ("d264", "d512"):
        problem = _problem(d=int(case[1:]))
    elif case == "empty_q":
        problem = _problem(sq=0)
    elif case == "empty_k":
        problem = _problem(sk=0)
    elif case == "no_batch":
        problem = _problem(batch=0)
    elif case == "no_bindings":
        monkeypatch.setattr(_hopper, "bindings_available", lambda: False)
    elif case == "reversed_rows":  # a negative row stride: the TMA takes positive strides only
        views = _views()
        views["dout"] = views["dout"][:, ::-1]
        kwargs["views"] = views
    assert _config(problem, **kwargs) is None


# --------------------------------------------------------------------------------------------
# The plan of a covered call


def _backward_plan(arrays, *, deterministic=False, softcap=0.0, alibi_slopes=None, causal=True,
                   config=None, arch=90, dropout_p=0.0):
    """backward_plan as api._plan_backward calls it, on host arrays: `arrays` by view name
    (dout, q, k, v, out, lse, dq, dk, dv) with the input tuple's order and packing."""
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    views = {n: arrays.get(n) for n in names}
    sources = {**arrays["sources"], "mods.alibi_slopes": (9, alibi_slopes)}
    problem = _validate.check_attention_inputs(views["q"], views["k"], views["v"])
    window = _validate.check_window((-1, -1), causal, problem.seqlen_q, problem.seqlen_k)
    mods = _prepare.score_mods(problem, AttentionOptions(
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        seed=1 if dropout_p else None))
    return _attention_plans.backward_plan(
        {**views, "mods.alibi_slopes": alibi_slopes}, sources, problem, mods, window,
        deterministic, 0, arch, {n: views[m].shape for n, m in (("dq", "q"), ("dk", "k"),
                                                                ("dv", "v"))}, config=config)


def _separate(batch=2, sq=300, sk=200, h=4, hkv=2, d=64, given=False):
    """A call with separate arrays (positions as attention_backward's input tuple)."""
    arrays = {"dout": _zeros(batch, sq, h, d), "q": _zeros(batch, sq, h, d),
              "k": _zeros(batch, sk, hkv, d), "v": _zeros(batch, sk, hkv, d),
              "out": _zeros(batch, sq, h, d), "lse": _zeros(batch, h, sq, dtype=numpy.float32)}
    if given:  # strided gradients: views of wider arrays
        arrays.update(dq=_zeros(batch, sq, h, d + 32)[..., :d],
                      dk=_zeros(batch, sk, hkv, d + 16)[..., :d],
                      dv=_zeros(batch, sk, hkv, d + 16)[..., :d])
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    arrays["sources"] = {n: (i, arrays.get(n)) for i, n in enumerate(names)}
    arrays["sources"]["mods.alibi_slopes"] = (9, None)
    arrays["inputs"] = tuple(arrays.get(n) for n in names) + (None,)
    return arrays


def test_the_plan_runs_the_hopper_main_kernel_between_preprocess_and_conversion(host):
    maps = host
    plan = _backward_plan(_separate())
    pre, main, conv = plan.launches
    assert plan.block.layout.name == "BwdSm90Params"
    assert pre.config.kernel == "flash_bwd_preprocess_kernel" and pre.grid == (384 // 64, 4, 2)
    assert main.config == _dispatch.bwd_sm90_config("float16", 64)
    assert main.grid == (2, 2, 2)  # 128-key blocks, KV heads, batch
    assert conv.config.kernel == "flash_bwd_convert_dq_kernel"
    assert conv.grid == (-(-300 * 8 // 256), 4, 2)
    # the preprocess and the conversion take `base`, the main kernel the whole struct
    base = plan.block.nested("base")
    assert [b.kernel_params_address == plan.block.kernel_params_address
            for b in plan.launch_blocks] == [False, True, False]
    assert int(plan.launch_blocks[0].kernel_params[0]) == int(base.kernel_params[0])
    assert plan.launch_blocks[0] is plan.launch_blocks[2]
    assert plan.batch_offset_slot == plan.block.slot("base.batch_offset")
    # maps: q and dout boxes of block_m rows, k and v of block_n, in order; encoded once, by the
    # dispatch's coverage check (a driver refusal leaves the call to mma.sync), for the plan
    # (d=64: 128-row steps)
    expected = [((2, 300, 4, 64), 128), ((2, 200, 2, 64), 128), ((2, 200, 2, 64), 128),
                ((2, 300, 4, 64), 128)]
    assert maps == expected
    record = plan.block.record[0]
    assert [int(record[m]["v"][1]) for m in ("q_map", "k_map", "v_map", "do_map")] == [
        128, 128, 128, 128]
    assert [int(record[m]["v"][2]) for m in ("q_map", "k_map", "v_map", "do_map")] == [
        1, 2, 3, 4]  # the coverage check's encodings are the plan's
    b = record["base"]
    assert (b["seqlen_q"], b["seqlen_q_padded"], b["seqlen_k"], b["nheads"],
            b["heads_per_kv_head"], b["head_dim"], b["accum_dim"]) == (300, 384, 200, 4, 2, 64, 64)
    assert (b["window_left"], b["window_right"]) == (-1, 0)
    assert abs(b["scale_log2"] - 64 ** -0.5 * LOG2E) < 1e-6
    assert plan.workspace_bytes >= 4 * 2 * 4 * 384 * (2 + 64)
    assert record["dispatch_group_pairs"] == 1  # 2 key blocks: the grid's own order


@pytest.mark.parametrize("causal,deterministic,seqlen,head_dim,expected", [
    (True, False, 4096, 128, 8),    # 32 key blocks: groups of 256 // 32 (KV head, batch) pairs
    (True, False, 2048, 64, 16),    # 16 key blocks, the fewest that are grouped
    (True, False, 8192, 256, 2),    # 64 key blocks of two head-dim chunks each
    (True, False, 16384, 256, 1),   # 256 CTAs a pair: a group is one pair
    (True, False, 1024, 128, 1),    # 8 key blocks: the grid's own order
    (False, False, 4096, 128, 1),   # no mask: every key block has the same work
    (True, True, 4096, 128, 1),     # deterministic mode: an order of its own
])
def test_causal_grids_take_key_blocks_in_groups_of_pairs(host, causal, deterministic, seqlen,
                                                         head_dim, expected):
    plan = _backward_plan(_separate(batch=1, sq=seqlen, sk=seqlen, h=2, hkv=2, d=head_dim),
                          causal=causal, deterministic=deterministic)
    assert plan.block.record[0]["dispatch_group_pairs"] == expected


@pytest.mark.parametrize("window,expected", [
    ((-1, 0), 8), ((-1, 64), 8),  # a right edge alone: the low key blocks are the long ones
    ((256, 0), 1), ((256, -1), 1), ((-1, -1), 1)])
def test_only_a_causal_shaped_window_groups_the_dispatch(window, expected):
    assert _dispatch.dispatch_group_pairs(32, 1, window, False) == expected


@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("mods", ["", "softcap", "alibi"])
def test_base_is_the_mma_sync_plans_bwd_params(host, monkeypatch, head_dim, mods):
    """One field computation for both main kernels: BwdSm90Params.base of the Hopper plan is the
    mma.sync plan's BwdParams byte for byte, but for accum_dim (each main kernel's head dim,
    which sizes the dQ accumulator)."""
    options = {}
    if mods == "softcap":
        options["softcap"] = 30.0
    elif mods == "alibi":
        options["alibi_slopes"] = _Array(numpy.zeros((2, 4), numpy.float32))
    arrays = _separate(d=head_dim, given=True)
    hopper = _backward_plan(arrays, **options)
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", False)
    mma = _backward_plan(arrays, **options)
    assert mma.block.layout.name == "BwdParams" and hopper.block.layout.name == "BwdSm90Params"
    assert isinstance(mma.launches[1].config, _configs.BwdConfig)
    layout = _params.layout("BwdParams")
    offset = hopper.block.layout.offsets["base"]
    base = hopper.block.bytes[offset:offset + layout.size].copy()
    theirs = mma.block.bytes.copy()
    accum = layout.offsets["accum_dim"] // 4
    assert base.view(numpy.int32)[accum] == hopper.launches[1].config.head_dim
    assert theirs.view(numpy.int32)[accum] == mma.launches[1].config.head_dim
    base.view(numpy.int32)[accum] = theirs.view(numpy.int32)[accum]
    assert base.tobytes() == theirs.tobytes()
    assert hopper.launches[1].config.features == mma.launches[1].config.features
    # inputs and workspace land on the same BwdParams fields, and each map's address word is
    # patched from its array's input
    def byte_offsets(slots, skip=0):
        return sorted((index * 8 - skip, *rest) for _, index, *rest in slots)

    assert byte_offsets(hopper.input_slots[:len(mma.input_slots)], offset) == byte_offsets(
        mma.input_slots)
    assert byte_offsets(hopper.workspace_slots, offset) == byte_offsets(mma.workspace_slots)
    maps = {hopper.block.layout.offsets[f"{m}.v"]: m for m in ("q_map", "k_map", "v_map",
                                                               "do_map")}
    patched = {maps[index * 8]: pos for _, index, pos, _ in hopper.input_slots[
        len(mma.input_slots):]}
    assert patched == {"do_map": 0, "q_map": 1, "k_map": 2, "v_map": 3}


def test_a_call_patches_map_addresses_pointers_and_workspace(host, monkeypatch):
    """Plan.run on new arrays of the same signature: each map's address word and each pointer
    of `base` is the new array's, packed views at their byte offsets."""
    recorded = []
    monkeypatch.setattr(_plans._launch, "run", lambda launch, block, stream, slot: recorded.append(
        (launch.config, numpy.frombuffer(block.bytes.copy(), block.record.dtype)[0])))
    # No driver call on the stand-in stream: launched one by one, as under a capture.
    monkeypatch.setattr(_plans._launch, "stream_not_capturing", lambda stream: False)
    monkeypatch.setattr(_plans, "_scratch", _plans._StreamScratch())
    cupy, _ = _fake_cupy()

    def packed_call():
        qkv = _zeros(2, 300, 3, 4, 64)
        arrays = {"dout": _zeros(2, 300, 4, 64), "q": qkv[:, :, 0], "k": qkv[:, :, 1],
                  "v": qkv[:, :, 2], "out": _zeros(2, 300, 4, 64),
                  "lse": _zeros(2, 4, 300, dtype=numpy.float32)}
        dqkv = _zeros(2, 300, 3, 4, 64)
        arrays.update(dq=dqkv[:, :, 0], dk=dqkv[:, :, 1], dv=dqkv[:, :, 2])
        arrays["sources"] = {"dout": (0, arrays["dout"]), "q": (1, qkv), "k": (1, qkv),
                             "v": (1, qkv), "out": (2, arrays["out"]),
                             "lse": (3, arrays["lse"]), "dq": (4, dqkv), "dk": (4, dqkv),
                             "dv": (4, dqkv), "mods.alibi_slopes": (5, None)}
        inputs = (arrays["dout"], qkv, arrays["out"], arrays["lse"], dqkv, None)
        return arrays, inputs, qkv, dqkv

    arrays, _, _, _ = packed_call()
    plan = _backward_plan(arrays)
    _, inputs, qkv, dqkv = packed_call()  # new arrays, same signature
    assert plan.run(inputs, cupy) == []  # every gradient given
    (pre, pre_record), (main, main_record), (conv, conv_record) = recorded
    assert isinstance(main, _configs.BwdSm90Config)
    head = 4 * 64 * 2  # bytes from q to k in a packed row
    q_ptr = qkv.data.ptr
    assert [int(main_record[m]["v"][0]) for m in ("q_map", "k_map", "v_map", "do_map")] == [
        q_ptr, q_ptr + head, q_ptr + 2 * head, inputs[0].data.ptr]
    base = main_record["base"]
    assert (base["q"], base["k"], base["v"], base["dout"], base["out"], base["lse"]) == (
        q_ptr, q_ptr + head, q_ptr + 2 * head, inputs[0].data.ptr, inputs[2].data.ptr,
        inputs[3].data.ptr)
    assert (base["dq"], base["dk"], base["dv"]) == (dqkv.data.ptr, dqkv.data.ptr + head,
                                                   dqkv.data.ptr + 2 * head)
    assert base["dq_accum"] and base["lse_log2"] and base["delta"]
    assert (base["q_row_stride"], base["dk_row_stride"]) == (3 * 4 * 64, 3 * 4 * 64)
    offset = plan.block.layout.offsets["base"]
    assert pre_record.tobytes() == conv_record.tobytes() == plan.block.bytes[
        offset:offset + pre_record.dtype.itemsize].tobytes()


def test_the_deterministic_hopper_plan_zeroes_and_passes_the_dq_semaphores(host):
    """deterministic=True on the Hopper kernel: the atomic path's three launches (preprocess,
    main kernel, conversion) and workspace, plus one int32 semaphore slot per
    DQ_SEMAPHORE_ROWS rows of the per-row arrays after the accumulator, which the preprocess
    zeroes; the default plan has none (null pointer)."""
    arrays = _separate()
    plan = _backward_plan(arrays, deterministic=True)
    pre, main, conv = plan.launches
    assert main.config.deterministic and main.config.dq_staged
    assert conv.config.kernel == "flash_bwd_convert_dq_kernel"
    default = _backward_plan(arrays)
    stats_rows = 2 * 4 * 384  # batch x heads x padded rows

    # byte offsets in the scratch, by the pointer fields' word index (both pointers: one view)
    offsets = {index: off for _, index, off in plan.workspace_slots}
    semaphore = offsets[plan.block.slot("base.dq_semaphore")[1]]
    accum = offsets[plan.block.slot("base.dq_accum")[1]]
    assert semaphore >= accum + 4 * stats_rows * 64  # after the d=64 accumulator
    assert _configs.DQ_SEMAPHORE_ROWS == 4  # a varlen sequence's rows start on 4-row boundaries
    assert plan.workspace_bytes >= semaphore + 4 * stats_rows // _configs.DQ_SEMAPHORE_ROWS
    assert len(default.workspace_slots) == len(plan.workspace_slots) - 1
    assert default.block.record[0]["base"]["dq_semaphore"] == 0


def test_the_mma_sync_backward_keeps_dropout_and_forced_tiles(host):
    arrays = _separate()
    assert _backward_plan(arrays, deterministic=True).launches[1].config.deterministic
    wide = _backward_plan(_separate(d=192), deterministic=True)  # ordered vector reductions
    assert wide.launches[1].config.deterministic and not wide.launches[1].config.dq_staged
    dropout = _backward_plan(arrays, dropout_p=0.1)
    assert isinstance(dropout.launches[1].config, _configs.BwdConfig)
    deterministic = _backward_plan(arrays, dropout_p=0.1, deterministic=True)
    assert deterministic.block.layout.name == "BwdParams"
    assert [type(c).__name__ for c in deterministic.kernels] == [
        "AuxKernel", "BwdConfig", "BwdDqConfig"]
    assert not isinstance(_backward_plan(arrays, arch=80).launches[1].config,
                          _configs.BwdSm90Config)
    forced = _dispatch.bwd_config("float16", 64, 90)
    _dispatch.FORCED["bwd"] = forced
    try:
        assert _backward_plan(arrays).launches[1].config == forced
    finally:
        del _dispatch.FORCED["bwd"]


def test_a_forced_hopper_config_runs_whatever_the_flag(host, monkeypatch):
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", False)
    config = _dispatch.bwd_sm90_config("float16", 128)
    plan = _backward_plan(_separate(), config=config)
    assert plan.launches[1].config == config  # d=64 on the d=128 kernel, as forced
    assert plan.block.record[0]["base"]["accum_dim"] == 128
    ordered = _backward_plan(_separate(), config=config, deterministic=True)
    assert ordered.launches[1].config.deterministic
    wide = _backward_plan(_separate(d=192), config=_dispatch.bwd_sm90_config("float16", 192),
                          deterministic=True)
    assert wide.launches[1].config.deterministic
    with pytest.raises(ValueError, match="dropout"):
        _backward_plan(_separate(), config=config, dropout_p=0.1)


# --------------------------------------------------------------------------------------------
# prepare_backward_sm90: the same plan, with its gradients allocated


@pytest.fixture
def host_cupy(host, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        empty=lambda shape, dtype: _Array(numpy.empty(shape, dtype))))
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", False)  # prepare does not ask the flag
    return host


def test_prepared_backward_is_the_dispatchers_plan(host_cupy):
    maps = host_cupy
    packed = _zeros(2, 300, 3, 4, 64)  # (batch, seqlen, qkv, heads, dim)
    q = packed[:, :, 0]
    k = _zeros(2, 200, 2, 64)
    out = _zeros(2, 300, 4, 64)
    lse = _zeros(2, 4, 300, dtype=numpy.float32)
    prepared = _attention_plans.prepare_backward_sm90(out, q, k, k, out, lse, causal=True,
                                                 softmax_scale=0.5)
    assert maps == [((2, 300, 4, 64), 128), ((2, 200, 2, 64), 128), ((2, 200, 2, 64), 128),
                    ((2, 300, 4, 64), 128)]
    assert prepared.dq.shape == q.shape and prepared.dk.shape == k.shape
    assert prepared.config == _dispatch.bwd_sm90_config("float16", 64)
    plan = prepared.plan
    assert [launch.grid for launch in plan.launches] == [(6, 4, 2), (2, 2, 2),
                                                         (-(-300 * 8 // 256), 4, 2)]
    base = plan.block.record[0]["base"]
    assert (base["q_batch_stride"], base["q_row_stride"], base["q_head_stride"]) == (
        300 * 3 * 4 * 64, 3 * 4 * 64, 64)
    assert (base["dk_batch_stride"], base["dk_row_stride"], base["dk_head_stride"]) == (
        200 * 2 * 64, 2 * 64, 64)
    assert base["softmax_scale"] == 0.5 and abs(base["scale_log2"] - 0.5 * LOG2E) < 1e-6
    assert (base["window_left"], base["window_right"]) == (-1, 0)
    # the gradients are given outputs: a run allocates nothing but scratch
    assert plan.outputs == () and prepared.inputs[6] is prepared.dq


@pytest.mark.parametrize("head_dim,kernel_dim", [(64, 64), (72, 96), (96, 96), (104, 128),
                                                 (128, 128), (160, 192), (192, 192),
                                                 (224, 256), (256, 256)])
def test_prepared_backward_picks_the_kernel_head_dim(host_cupy, head_dim, kernel_dim):
    q = _zeros(1, 100, 2, head_dim)
    lse = _zeros(1, 2, 100, dtype=numpy.float32)
    prepared = _attention_plans.prepare_backward_sm90(q, q, q, q, q, lse, softcap=30.0)
    config = prepared.config
    assert config.head_dim == kernel_dim and config.features == _configs.FEATURE_SOFTCAP
    base = prepared.plan.block.record[0]["base"]
    assert base["accum_dim"] == kernel_dim and base["head_dim"] == head_dim
    scale = head_dim ** -0.5
    assert abs(base["mods"]["softcap_scale"] - scale / 30.0) < 1e-6
    assert abs(base["scale_log2"] - 30.0 * LOG2E) < 1e-4


def test_prepared_backward_refuses_what_it_does_not_cover(host_cupy):
    # every head dim the checks pass (multiples of 8 up to 256) has a kernel; past them the
    # call is refused by the checks, and kernel_head_dim refuses it too
    with pytest.raises(ValueError, match="head dims up to 256"):
        _dispatch.hopper_backward_head_dim(264)
    q = _zeros(1, 10, 2, 264)
    lse = _zeros(1, 2, 10, dtype=numpy.float32)
    with pytest.raises(ValueError, match="between 8 and 256"):
        _attention_plans.prepare_backward_sm90(q, q, q, q, q, lse)


def test_describe_names_the_backward_kernels():
    assert _configs.describe(_dispatch.bwd_sm90_config("bfloat16", 128)) == (
        "Hopper backward (sm_90a: wgmma, TMA, warp-specialised), bf16, head dim 128, 64x128 "
        "tiles, 2 Q/dO stages")
    assert _configs.describe(_dispatch.bwd_sm90_config("bfloat16", 256)) == (
        "Hopper backward (sm_90a: wgmma, TMA, warp-specialised), bf16, head dim 256, 64x128 "
        "tiles, 1 Q/dO stage, 2 head-dim chunks")
    config = _configs.with_features(_dispatch.bwd_sm90_config("float16", 64),
                                    _configs.FEATURE_ALIBI)
    assert _configs.describe(config).endswith("with ALiBi")
    assert _configs.describe(_dispatch.bwd_config("float16", 64, 90)).startswith(
        "mma.sync backward, fp16, head dim 64")
    assert "deterministic" in _configs.describe(_dispatch.bwd_config("float16", 64, 90, True))
    assert _configs.describe(_dispatch.bwd_dq_config("float16", 64, 90)).startswith(
        "mma.sync backward dQ")
    assert _configs.describe(_configs.AuxKernel("float16", "flash_bwd_preprocess_kernel")) == (
        "backward preprocess (D, lse, dQ accumulator), fp16")
    assert _params.layout("BwdSm90Params").offsets["base"] == 512


def test_info_says_which_backward_runs(monkeypatch):
    from cuflash2 import _dispatch, _environment

    assert _environment.backward_kernel_family("8.0").startswith("mma.sync kernels")
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", False)
    assert "CUFLASH2_HOPPER_BWD=0" in _environment.backward_kernel_family("9.0")
    monkeypatch.setattr(_dispatch, "HOPPER_BACKWARD", True)
    assert _environment.backward_kernel_family("9.0").startswith("Hopper kernel")


@pytest.mark.parametrize("head_dim,kernel_dim", [(160, 192), (192, 192), (256, 256)])
def test_wide_head_dims_split_each_key_block_over_two_ctas(host, head_dim, kernel_dim):
    """Above d=128 a key block's dK / dV / dQ columns are split over two CTAs (grid.x = key
    block x chunk, as the mma.sync backward's); the maps still carry whole rows (S^T and dP^T
    span the head dim), dq_accum is the kernel head dim wide."""
    plan = _backward_plan(_separate(d=head_dim))
    main = plan.launches[1]
    assert main.config == _dispatch.bwd_sm90_config("float16", kernel_dim)
    assert main.config.num_chunks == 2
    assert main.grid == (2 * 2, 2, 2)  # 2 key blocks of 128 x 2 chunks, KV heads, batch
    b = plan.block.record[0]["base"]
    assert (b["head_dim"], b["accum_dim"]) == (head_dim, kernel_dim)


def test_a_sinks_backward_on_the_hopper_kernel(hopper_api):
    """attention_backward(..., sinks=) on sm_90: the Hopper main kernel of the call without
    sinks (backward_config strips FEATURE_SINKS), the sinks' gradient after the preprocess on
    `base` like it, dsinks and batch in base."""
    import cuflash2
    from test_plans_host import device_array

    q = device_array((2, 300, 4, 64))
    k = device_array((2, 200, 2, 64))
    lse = device_array((2, 4, 300), numpy.float32)
    cuflash2.attention_backward(q, q, k, k, q, lse, causal=True)
    plain = [launch.config for launch, _, _ in hopper_api.launches[-3:]]
    sinks = device_array((4,), numpy.float32)
    del hopper_api.launches[:]
    dq, dk, dv, dsinks = cuflash2.attention_backward(q, q, k, k, q, lse, causal=True,
                                                     sinks=sinks)
    configs = [launch.config for launch, _, _ in hopper_api.launches]
    assert configs[0] == plain[0] and configs[2:] == plain[1:]
    assert isinstance(configs[2], _configs.BwdSm90Config)
    assert configs[1] == _configs.AuxKernel("float16", "flash_bwd_sinks_kernel")
    assert _configs.describe(configs[1]) == "backward sinks gradient, fp16"
    (api_plan,) = [p for p in hopper_api_plans()]
    assert api_plan.launch_blocks[1] is api_plan.launch_blocks[0]  # `base`, as the preprocess
    record = hopper_api.launches[1][2]
    assert record["dsinks"] == dsinks.data.ptr and record["mods"]["sinks"] == sinks.data.ptr
    assert record["batch"] == 2
    assert _config(features=_configs.FEATURE_SINKS) == _config()  # covered, the same kernel


def hopper_api_plans():
    from cuflash2 import api

    return [p for p in api._backward_plans.plans.values()
            if any(getattr(c, "kernel", "") == "flash_bwd_sinks_kernel" for c in p.kernels)]
