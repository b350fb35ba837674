"""Float32 inputs without a GPU: the precision argument, the kernels' element and tiles, the
word strides of their parameters, and the reference's TF32 precision (tests/gpu/test_float32.py
runs the kernels)."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from cuflash2 import _configs, _dispatch, _hopper, _prepare, _validate, reference
from cuflash2._attention_plans import _stride_fields
from cuflash2._options import AttentionOptions


def _problem(dtype=np.float32, head_dim=128):
    q = np.zeros((2, 100, 4, head_dim), dtype)
    k = np.zeros((2, 70, 2, head_dim), dtype)
    return _validate.check_attention_inputs(q, k, k)


@pytest.mark.parametrize("precision,element", [(None, "float32"), ("highest", "float32"),
                                               ("high", "tf32"), ("tf32", "tf32")])
def test_precision_names_the_kernels_element(precision, element):
    problem = _prepare.with_kernel_element(_problem(), AttentionOptions(precision=precision))
    assert problem.dtype == element
    assert element in _configs.FLOAT32_TAGS


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_calls_take_no_precision(dtype):
    problem = _problem(dtype)
    assert _prepare.with_kernel_element(problem, AttentionOptions()) == problem
    with pytest.raises(ValueError, match=r"precision applies to float32 inputs only; got "
                                         r"precision='tf32' with .* inputs"):
        _prepare.with_kernel_element(problem, AttentionOptions(precision="tf32"))


@pytest.mark.parametrize("bad", ["default", "fp32", 1, True])
def test_unknown_precision(bad):
    with pytest.raises(ValueError, match=r"precision must be one of 'highest', 'high', 'tf32' "
                                         r"or None; got"):
        _prepare.with_kernel_element(_problem(), AttentionOptions(precision=bad))


def test_float32_refuses_the_modifiers_it_does_not_take_yet():
    options = AttentionOptions(mask_mod=object())
    with pytest.raises(NotImplementedError, match=r"mask_mod, score_mod, bias, block_mask: "
                                                  r"not with float32 inputs"):
        _prepare.with_kernel_element(_problem(), options)


def test_float32_strides_are_whole_16_byte_units():
    q = np.zeros((1, 8, 2, 76), np.float32)  # rows of 76 floats: 304 bytes, 19 units
    _validate.check_attention_inputs(q[..., :64], q[..., :64], q[..., :64])
    with pytest.raises(ValueError, match=r"q stride of dim 2 must be a multiple of 4 elements "
                                         r"\(16 bytes\)"):
        bad = np.zeros((1, 8, 2, 66), np.float32)[..., :64]
        _validate.check_attention_inputs(bad, bad, bad)


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("element", list(_configs.FLOAT32_TAGS))
@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_float32_tiles_fit_and_take_the_hopper_forward(element, head_dim, arch):
    """The mma.sync tile of every float32 call fits; on sm_90 precision "tf32" up to head dim
    128 runs the TF32 Hopper forward instead, "highest" up to head dim 128 the 3xTF32 one where
    switched on (HOPPER_FORWARD_F32X3, the default)."""
    config = _dispatch.fwd_config(element, head_dim, arch)
    assert config.dtype == element and config.head_dim >= head_dim
    assert config.block_m == 16 * config.num_warps  # 16 rows a warp
    smem = _dispatch.SMEM_PER_SM_KIB[arch] * 1024
    assert config.smem_bytes + 1024 <= smem
    # twice the 16-bit tile's bytes: 4 bytes an element
    assert config.smem_bytes == 4 * config.head_dim * (
        config.block_m + 2 * config.kv_stages * config.block_n)
    assert config in _dispatch.all_fwd_configs(arch, elements=(element,))
    problem = _prepare.with_kernel_element(_problem(head_dim=head_dim),
                                           AttentionOptions(precision="tf32" if element == "tf32"
                                                            else None))
    hopper = _dispatch.hopper_forward_config(problem, 0, (-1, -1), arch)
    if (arch == 90 and head_dim <= max(_dispatch.FLOAT32_SM90_FWD_TILES[element])
            and _hopper.bindings_available()):
        assert hopper.dtype == element and hopper.head_dim >= head_dim and not hopper.persistent
        assert hopper.smem_bytes <= 227 * 1024
    else:
        assert hopper is None


def test_parameters_count_16_bit_words():
    """A float32 array's strides and head dim reach the kernel in 16-bit words (twice its
    element strides), a 16-bit array's as they are."""
    assert _stride_fields("q", (800, 8, 2), _configs.ELEMENT_WORDS["float32"]) == {
        "q_batch_stride": 1600, "q_row_stride": 16, "q_head_stride": 4}
    assert _stride_fields("q", (800, 8, 2), _configs.ELEMENT_WORDS["bfloat16"]) == {
        "q_batch_stride": 800, "q_row_stride": 8, "q_head_stride": 2}
    assert _configs.FwdConfig("tf32", 64, 64, 64, 4, 2).name_expression.startswith(
        "flash_fwd_kernel<tf32_tag, 64,")


def test_reference_tf32_rounds_to_ten_mantissa_bits():
    x = np.array([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-11, 1.0 + 2.0**-12, -(1.0 + 2.0**-11),
                  3.0 + 2.0**-9 + 2.0**-10], np.float32)
    got = reference._round_tf32(x.copy())
    want = np.array([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-10, 1.0, -(1.0 + 2.0**-10),
                     3.0 + 2.0**-8], np.float32)
    np.testing.assert_array_equal(got, want)


def test_reference_tf32_precision_sits_between_float16_and_float32():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 200, 2, 64), dtype=np.float32) for _ in range(3))
    exact = reference.attention(q, k, v, causal=True, compute_dtype=np.float64)
    errors = {name: np.abs(reference.attention(q, k, v, causal=True, compute_dtype=dtype)
                           .astype(np.float64) - exact).max()
              for name, dtype in (("float32", np.float32), ("tf32", "tf32"),
                                  ("float16", np.float16))}
    assert reference.attention(q, k, v, compute_dtype="tf32").dtype == np.float32
    assert errors["float32"] < 1e-5 < errors["tf32"] < 3e-3
    assert errors["tf32"] < 2 * errors["float16"]


def test_precompile_names_the_float32_forward_and_backward():
    """precompile's plan for float32 inputs: the forward, the backward's main kernels (with and
    without dQ) and deterministic dQ kernels of each head dim, its small kernels (the
    preprocess at the precision's element, the dQ conversion on float32); none where no tile
    fits. (The 3xTF32 Hopper forward, as the dispatcher takes it.)"""
    from cuflash2 import precompile


    for name, element in (("fp32", "float32"), ("tf32", "tf32")):
        configs = precompile.plan(90, [precompile.DTYPES[name]], [64, 100], [0], ["fwd", "bwd"])
        backward = [config for d in (64, 100) for config in (
            _dispatch.bwd_config(element, d, 90), _dispatch.bwd_config(element, d, 90, True),
            _dispatch.bwd_dq_config(element, d, 90))]
        # the float32 Hopper forward and its operand pass too: at "tf32" the d=64 and 128
        # kernels, at "highest" (3xTF32, up to d=96) the d=64 one
        hopper = [c for c in _dispatch.tf32_hopper_forward_configs((0,), (element,))
                  if getattr(c, "head_dim", 64) in (64, 128)]
        assert configs[:8 + len(hopper)] == [_dispatch.fwd_config(element, 64, 90),
                                             _dispatch.fwd_config(element, 128, 90), *hopper,
                                             *backward]
        assert set(configs[8 + len(hopper):]) == {
            _configs.AuxKernel(element, "flash_bwd_preprocess_kernel"),
            _configs.AuxKernel("float32", "flash_bwd_convert_dq_kernel")}
    configs = precompile.plan(86, ["float32"], [256], [0], ["bwd"])
    assert [c.kernel for c in configs] == ["flash_bwd_preprocess_kernel",
                                           "flash_bwd_convert_dq_kernel"]
    configs = precompile.plan(90, ["float32"], [224], [0], ["bwd"])
    assert configs[0].head_dim == 256 and configs[2].head_dim == 224  # main, dQ kernel


# --------------------------------------------------------------------------------------------
# The backward


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("element", list(_configs.FLOAT32_TAGS))
@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_float32_backward_tiles_fit_and_stay_on_mma_sync(element, head_dim, arch):
    """FLOAT32_BWD_TILES' choice: a warp grid for every phase, the accumulators within the
    float32 budget, one CTA's shared memory (4 bytes an element of K, V, Q, dO, P and dS) on
    the SM; none on the 100 KiB parts above d=192 (NotImplementedError naming the head dim);
    the Hopper backward never (a 16-bit kernel)."""
    smem = _dispatch.SMEM_PER_SM_KIB[arch] * 1024
    if smem < 160 * 1024 and head_dim > 192:
        with pytest.raises(NotImplementedError, match=rf"float32 backward at head dim "
                                                      rf"{head_dim}: no tile fits .* sm_{arch}"):
            _dispatch.bwd_config(element, head_dim, arch)
        return
    config = _dispatch.bwd_config(element, head_dim, arch)
    assert config.dtype == element and config.head_dim >= head_dim and config.compute_dq
    assert config.valid and _configs.BWD_ROW_PADDING % config.block_m == 0
    assert config.accumulator_registers <= _dispatch.FLOAT32_BWD_MAX_ACCUMULATORS
    assert config.block_n % 32 == 0  # the P tile's rows are whole 128-byte panels
    assert config.smem_bytes + 1024 <= smem
    stage = 4 * config.block_m * config.head_dim * 2 + 8 * config.block_m
    assert config.smem_bytes == (8 * config.block_n * config.head_dim + config.q_stages * stage
                                 + 8 * config.block_m * config.block_n)
    assert config in _dispatch.all_bwd_configs(arch, elements=(element,))
    problem = _prepare.with_kernel_element(
        _problem(head_dim=head_dim),
        AttentionOptions(precision="tf32" if element == "tf32" else None))
    assert _dispatch.hopper_backward_config(problem, 0, arch) is None


def test_float32_backward_names_its_element_and_words():
    config = _dispatch.bwd_config("tf32", 64, 90)
    assert config.name_expression.startswith("flash_bwd_kernel<tf32_tag, 64, 64, ")
    assert config.probes.count(f", {config.q_stages}, 2>::") == 2  # BwdTraits' WORDS
    plain = _dispatch.bwd_config("float16", 64, 90)
    assert f", {plain.q_stages}>::" in plain.probes  # 16-bit: WORDS left at its default
    aux = _configs.AuxKernel("float32", "flash_bwd_convert_dq_kernel")
    assert aux.name_expression == "flash_bwd_convert_dq_kernel<f32x3_tag, false>"
    assert {(a.dtype, a.kernel) for a in _configs.aux_kernels(tuple(_configs.FLOAT32_TAGS))} == {
        ("float32", "flash_bwd_preprocess_kernel"), ("float32", "flash_bwd_convert_dq_kernel"),
        ("float32", "flash_bwd_sinks_kernel"), ("tf32", "flash_bwd_preprocess_kernel")}


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("element", list(_configs.FLOAT32_TAGS))
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_float32_deterministic_backward_tiles(element, head_dim, arch):
    """Deterministic mode: the main kernel's tile without its dQ, and the dQ kernel's
    (FLOAT32_BWD_DQ_TILES) within the SM's shared memory; none above d=128 on the 100 KiB
    parts (NotImplementedError naming deterministic=True)."""
    smem = _dispatch.SMEM_PER_SM_KIB[arch] * 1024
    if smem < 160 * 1024 and head_dim > 128:
        with pytest.raises(NotImplementedError, match=rf"deterministic=True: float32 backward "
                                                      rf"at head dim {head_dim}"):
            _dispatch.bwd_dq_config(element, head_dim, arch)
        return
    main = _dispatch.bwd_config(element, head_dim, arch, deterministic=True)
    assert not main.compute_dq
    assert main == dataclasses.replace(_dispatch.bwd_config(element, head_dim, arch),
                                       compute_dq=False)
    dq = _dispatch.bwd_dq_config(element, head_dim, arch)
    assert dq.dtype == element and dq.head_dim == head_dim and dq.block_n in (16, 32)
    assert dq.smem_bytes == 4 * head_dim * (2 * dq.block_m + 2 * dq.kv_stages * dq.block_n)
    assert dq.smem_bytes + 1024 <= smem
    assert {main, dq} <= set(_dispatch.all_bwd_configs(arch, elements=(element,)))
    assert dq.name_expression.startswith(f"flash_bwd_dq_kernel<{_configs.ELEMENT_TAGS[element]}")


def test_reference_tf32_backward_sits_between_float16_and_float32():
    """compute_dtype "tf32": the inputs, P and dS rounded to TF32 (the products' operands),
    dP and the gradients not; its error against float64 between float32's and float16's."""
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 150, 2, 64), dtype=np.float32) for _ in range(4))
    exact = reference.attention_backward(dout, q, k, v, None, None, causal=True,
                                         compute_dtype=np.float64)
    for i, name in enumerate(("dq", "dk", "dv")):
        errors = {}
        for dtype in (np.float32, "tf32", np.float16):
            got = reference.attention_backward(dout, q, k, v, None, None, causal=True,
                                               compute_dtype=dtype)[i]
            errors[str(dtype)] = np.abs(got.astype(np.float64) - exact[i]).max()
            if dtype == "tf32":
                assert got.dtype == np.float32
                # not rounded to TF32 on the way out
                assert (got.view(np.uint32) & 0x1FFF).any()
        scale = np.abs(exact[i]).max()
        assert errors[str(np.float32)] < 1e-5 * scale, name
        assert 1e-5 * scale < errors["tf32"] < errors[str(np.float16)], name


def test_check_backward_takes_the_precision_of_float32_inputs():
    """testing.check_backward's rule for float32 inputs: ref_hi float64, ref_lo float32 or
    the TF32 roundings; the TF32 reference's own gradients pass at precision tf32 and fail
    at highest (its error is well above float32's)."""
    from cuflash2 import testing

    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((1, 90, 2, 32), dtype=np.float32) for _ in range(4))
    grads = reference.attention_backward(dout, q, k, v, None, None, compute_dtype="tf32")
    assert all(r.ok for r in testing.check_backward(dout, q, k, v, *grads, precision="tf32"))
    assert not all(r.ok for r in testing.check_backward(dout, q, k, v, *grads))
    cu = np.array([0, 40, 90], np.int32)  # the same rows as two sequences
    packed = [x[0] for x in (dout, q, k, v)]
    grads = reference.attention_varlen_backward(*packed, None, None, cu, cu, 50, 50,
                                                compute_dtype="tf32")
    args = (*packed, *grads, cu, cu, 50, 50)
    assert all(r.ok for r in testing.check_varlen_backward(*args, precision="high"))
    assert not all(r.ok for r in testing.check_varlen_backward(*args))


# The backward's plan on the host stand-in (test_plans_host): kernels and parameters.

from test_plans_host import api_host, device_array, launches  # noqa: E402,F401  (fixtures)


def _float32_backward(api_host, arch, precision=None, **options):
    import cuflash2

    api_host.set_arch(arch)
    q = device_array((2, 100, 4, 96), np.float32)
    k = device_array((2, 120, 2, 96), np.float32)
    dout, out = device_array(q.shape, np.float32), device_array(q.shape, np.float32)
    lse = device_array((2, 4, 100), np.float32)
    del api_host.launches[:]
    grads = cuflash2.attention_backward(dout, q, k, k, out, lse, precision=precision, **options)
    return grads, list(api_host.launches)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("precision,element", [(None, "float32"), ("tf32", "tf32")])
def test_float32_backward_plan_counts_words(api_host, arch, precision, element):
    """The mma.sync backward (on sm_90 too) and the preprocess at the precision's element; the
    dQ conversion on float32; strides and head dim in 16-bit words, the dQ accumulator's row in elements;
    float32 gradients shaped like q, k, v; the conversion's grid over 16-byte chunks."""
    grads, launched = _float32_backward(api_host, arch, precision, causal=True)
    assert [g.dtype for g in grads] == [np.float32] * 3
    assert [g.shape for g in grads] == [(2, 100, 4, 96), (2, 120, 2, 96), (2, 120, 2, 96)]
    pre, main, convert = (launch for launch, _, _ in launched)
    assert (pre.config.kernel, pre.config.dtype) == ("flash_bwd_preprocess_kernel", element)
    assert (convert.config.kernel, convert.config.dtype) == ("flash_bwd_convert_dq_kernel",
                                                             "float32")
    assert type(main.config) is _configs.BwdConfig and main.config.dtype == element
    assert main.config == _dispatch.bwd_config(element, 96, arch)
    record = launched[1][2]
    assert record["head_dim"] == 192 and record["accum_dim"] == main.config.head_dim
    assert (record["q_row_stride"], record["q_head_stride"], record["q_batch_stride"]) == (
        2 * 4 * 96, 2 * 96, 2 * 100 * 4 * 96)
    assert (record["k_row_stride"], record["dk_row_stride"], record["do_row_stride"],
            record["dq_row_stride"]) == (2 * 2 * 96, 2 * 2 * 96, 2 * 4 * 96, 2 * 4 * 96)
    chunks = 100 * (2 * 96 // 8)
    assert convert.grid[0] == -(-chunks // convert.config.threads)


@pytest.mark.parametrize("precision,element", [(None, "float32"), ("high", "tf32")])
def test_float32_deterministic_backward_plan(api_host, precision, element):
    """deterministic=True: the preprocess, the main kernel without dQ (no dQ accumulator), the
    deterministic dQ kernel at the precision's element over 64-row blocks."""
    grads, launched = _float32_backward(api_host, 90, precision, deterministic=True)
    assert [g.dtype for g in grads] == [np.float32] * 3
    pre, main, dq = (launch for launch, _, _ in launched)
    assert pre.config.dtype == element
    assert main.config.dtype == element and not main.config.compute_dq
    assert type(dq.config) is _configs.BwdDqConfig and dq.config.dtype == element
    assert dq.grid == (-(-100 // dq.config.block_m), 4, 2)
    assert launched[2][2]["dq_accum"] == 0 and launched[2][2]["head_dim"] == 192


def test_float32_backward_refusals_name_the_argument(api_host):
    with pytest.raises(NotImplementedError, match=r"deterministic=True: float32 backward at "
                                                  r"head dim 160"):
        import cuflash2

        api_host.set_arch(89)
        q = device_array((1, 10, 1, 160), np.float32)
        cuflash2.attention_backward(q, q, q, q, q, device_array((1, 1, 10), np.float32),
                                    deterministic=True)
    with pytest.raises(ValueError, match=r"precision must be one of"):
        _float32_backward(api_host, 80, precision="fp32")
    with pytest.raises(NotImplementedError, match=r"float32 backward at head dim 256"):
        import cuflash2

        api_host.set_arch(86)
        q = device_array((1, 10, 1, 256), np.float32)
        lse = device_array((1, 1, 10), np.float32)
        cuflash2.attention_backward(q, q, q, q, q, lse)


def test_float32_varlen_and_packed_backwards(api_host):
    import cuflash2

    cu = device_array((4,), np.int32)  # three sequences
    q, k = device_array((200, 4, 64), np.float32), device_array((240, 2, 64), np.float32)
    lse = device_array((4, 200), np.float32)
    grads = cuflash2.attention_varlen_backward(q, q, k, k, q, lse, cu, cu, 100, 120,
                                               precision="high", check_cu_seqlens=False)
    assert [g.dtype for g in grads] == [np.float32] * 3
    main = [launch.config for launch, _, _ in api_host.launches[-3:]][1]
    assert main.dtype == "tf32" and main.features & _configs.FEATURE_VARLEN
    qkv, dout = device_array((2, 50, 3, 2, 64), np.float32), device_array((2, 50, 2, 64),
                                                                          np.float32)
    dqkv = cuflash2.attention_qkvpacked_backward(dout, qkv, dout, device_array(
        (2, 2, 50), np.float32))
    assert dqkv.shape == qkv.shape and dqkv.dtype == np.float32
    record = api_host.launches[-2][2]
    assert record["q_row_stride"] == 2 * 3 * 2 * 64 and record["head_dim"] == 128


def test_check_names_float32_at_both_precisions():
    from cuflash2 import cli, selfcheck

    assert selfcheck.dtype_from_name("fp32") == selfcheck.dtype_from_name("tf32") == np.float32
    assert selfcheck.PRECISIONS["fp32"] == "highest" and selfcheck.PRECISIONS["tf32"] == "tf32"
    with pytest.raises(ValueError, match=r"dtype must be one of 'fp16', 'bf16', 'fp32', 'tf32'"):
        selfcheck.dtype_from_name("fp64")
    args = cli.build_parser().parse_args(["check", "--dtype", "fp32", "tf32"])
    assert args.dtype == ["fp32", "tf32"]
