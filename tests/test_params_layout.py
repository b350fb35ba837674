"""The host layout of every kernel parameter struct agrees with the compiler's (CPU, NVRTC).

cuflash2/_params.py reads cuda_src/kernel_params.cuh and lays the structs out with C's rules;
here NVRTC compiles `offsetof` / `sizeof` static_asserts of those offsets, one per field (nested
fields too), so any disagreement fails this test.
"""

import pytest

from cuflash2 import _compile, _params

STRUCTS = sorted(_params.layouts())


def _probe(struct: str) -> str:
    layout = _params.layout(struct)
    lines = [_compile.kernel_source(_params.PARAMS_HEADER),
             "#define CF2_OFFSETOF(type, path) __builtin_offsetof(type, path)",
             f'static_assert(sizeof({struct}) == {layout.size}, "sizeof {struct}");',
             f'static_assert(alignof({struct}) == {layout.alignment}, "alignof {struct}");']
    lines += [f'static_assert(CF2_OFFSETOF({struct}, {path}) == {offset}, "{struct}.{path}");'
              for path, offset in layout.offsets.items()]
    return "\n".join(lines) + "\n"


def test_every_kernel_family_has_a_struct():
    assert {"FwdParams", "BwdParams", "DecodeParams", "DropoutMaskParams",
            "MergeStatesParams"} <= set(STRUCTS)


def test_nested_fields_are_flattened():
    fwd = _params.layout("FwdParams")
    assert fwd.offsets["mods.alibi_slopes"] == fwd.offsets["mods"] + 8
    assert "mods.alibi_slopes" in fwd.pointers and "q" in fwd.pointers
    assert "seqlen_q" not in fwd.pointers


def test_param_block_writes_fields_where_the_layout_says():
    block = _params.ParamBlock("FwdParams", {"seqlen_k": 77, "mods.alibi_batch_stride": -5,
                                             "dropout.scale": 2.0})
    fwd = block.layout
    assert block.words32[fwd.offsets["seqlen_k"] // 4] == 77
    assert int(block.bytes[fwd.offsets["mods.alibi_batch_stride"]:][:8].view("<i8")[0]) == -5
    view, index = block.slot("dropout.scale")
    assert view[index] == 2.0
    view, index = block.slot("q")
    view[index] = 0x1234_5678_9ABC
    assert int(block.bytes[fwd.offsets["q"]:][:8].view("<u8")[0]) == 0x1234_5678_9ABC


def test_parser_rejects_what_it_cannot_read():
    with pytest.raises(ValueError, match="unknown type"):
        _params.parse_layouts("struct S {\n    double x;\n};\n")
    with pytest.raises(ValueError, match="cannot read"):
        _params.parse_layouts("struct S {\n    int a, b;\n};\n")


@pytest.mark.parametrize("struct", STRUCTS)
def test_layout_matches_the_compiler(struct):
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")
    _compile.compile_probe(_probe(struct))


def test_a_wrong_offset_fails_the_probe():
    pytest.importorskip("cuda.bindings.nvrtc", reason="install the test extra: pip install '.[test]'")
    source = _probe("FwdParams").replace(
        f'CF2_OFFSETOF(FwdParams, seqlen_q) == {_params.layout("FwdParams").offsets["seqlen_q"]}',
        f'CF2_OFFSETOF(FwdParams, seqlen_q) == {_params.layout("FwdParams").offsets["seqlen_q"] + 4}')
    with pytest.raises(RuntimeError, match="FwdParams.seqlen_q"):
        _compile.compile_probe(source)


def test_parser_reads_declared_alignment_and_fixed_arrays():
    text = ("struct __align__(64) Map {\n    unsigned long long v[16];\n};\n"
            "struct P {\n    Map a;\n    int n;\n};\n")
    parsed = _params.parse_layouts(text)
    assert (parsed["Map"].size, parsed["Map"].alignment) == (128, 64)
    assert parsed["Map"].dtype.fields["v"][0].shape == (16,)
    assert parsed["P"].offsets == {"a": 0, "a.v": 0, "n": 128}
    assert (parsed["P"].size, parsed["P"].alignment) == (192, 64)
    with pytest.raises(ValueError, match="not supported"):
        _params.parse_layouts("struct S {\n    int v[4];\n};\n")


def test_hopper_params_keep_the_tensor_maps_aligned():
    sm90 = _params.layout("FwdSm90Params")
    assert sm90.alignment == 64
    assert [sm90.offsets[m] for m in ("q_map", "k_map", "v_map")] == [0, 128, 256]
    base = sm90.offsets["base"]
    assert sm90.offsets["base.seqlen_q"] == base + _params.layout("FwdParams").offsets["seqlen_q"]
    assert "base.q" in sm90.pointers and "base.out" in sm90.pointers
    # the persistent grid's work, after the base: the one-tile-per-CTA kernel never reads it
    fwd_size = _params.layout("FwdParams").size
    assert sm90.offsets["batch"] >= base + fwd_size
    assert sm90.offsets["section_pairs"] == sm90.offsets["batch"] + 4


def test_hopper_backward_params_keep_the_tensor_maps_aligned():
    sm90 = _params.layout("BwdSm90Params")
    assert sm90.alignment == 64
    assert [sm90.offsets[m] for m in ("q_map", "k_map", "v_map", "do_map")] == [0, 128, 256, 384]
    base = sm90.offsets["base"]
    assert base == 512
    for field in ("seqlen_q", "dq_accum", "mods.softcap_scale", "batch_offset"):
        assert sm90.offsets[f"base.{field}"] == base + _params.layout("BwdParams").offsets[field]
    assert "base.dq_accum" in sm90.pointers and "base.dout" in sm90.pointers


def test_a_nested_block_is_a_view_of_its_parent():
    """BwdSm90Params.base launched as a BwdParams: the same bytes, so a field patched into the
    parent reaches the kernel that takes the nested struct."""
    block = _params.ParamBlock("BwdSm90Params", {"base.seqlen_q": 300, "base.nheads": 4})
    base = block.nested("base")
    offset = block.layout.offsets["base"]
    assert base.kernel_params_address != block.kernel_params_address
    assert int(base.kernel_params[0]) == block.bytes.ctypes.data + offset
    assert base.bytes.size == _params.layout("BwdParams").size
    assert base.as_void()["seqlen_q"] == 300 and base.record[0]["nheads"] == 4
    view, index = block.slot("base.dq_accum")
    view[index] = 0xABC0
    assert base.record[0]["dq_accum"] == 0xABC0
    with pytest.raises(ValueError, match="not a struct"):
        block.nested("base.seqlen_q")
