"""`cuflash2 precompile` on a CPU machine: which specialisations it plans for the calls a user
names, its option parsing and progress line, its refusal without a GPU, and `info`'s count of
the cache (the compiles themselves need CuPy and a GPU: tests/gpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash2 import _configs, _dispatch, precompile

REPO = Path(__file__).resolve().parents[1]


def test_the_plan_covers_what_the_dispatcher_chooses_for_the_named_calls():
    for arch in (80, 90):
        configs = precompile.plan(arch, ["bfloat16"], [100], [0], ("fwd", "bwd"))
        assert configs == list(dict.fromkeys(configs))
        assert {c.dtype for c in configs} == {"bfloat16"}
        assert _dispatch.fwd_config("bfloat16", 100, arch) in configs  # d=100 -> kernel d=128
        assert _dispatch.bwd_config("bfloat16", 100, arch) in configs
        assert _dispatch.bwd_dq_config("bfloat16", 100, arch) in configs
        kernels = {c.kernel for c in configs if isinstance(c, _configs.AuxKernel)}
        assert kernels == {"flash_bwd_preprocess_kernel", "flash_bwd_convert_dq_kernel"}
    hopper = precompile.plan(90, ["bfloat16"], [128], [0], ("fwd", "bwd"))
    assert any(isinstance(c, _configs.FwdSm90Config) for c in hopper)
    sm90_bwd = [c for c in hopper if isinstance(c, _configs.BwdSm90Config)]
    assert {c.deterministic for c in sm90_bwd} == {False, True}
    assert not any(isinstance(c, (_configs.FwdSm90Config, _configs.BwdSm90Config))
                   for c in precompile.plan(80, ["bfloat16"], [128], [0], ("fwd", "bwd")))


def test_the_plan_takes_the_mma_sync_backward_of_v_with_its_own_head_dim():
    """--headdim-v: the mma.sync backward's kernels of the pair (split_bwd_configs) on every
    architecture, deterministic mode's too; none for a pair they do not take."""
    for arch in (80, 86, 90):
        configs = precompile.plan(arch, ["bfloat16"], [192], [0, _configs.FEATURE_DROPOUT],
                                  ("bwd",), [128])
        for deterministic in (False, True):
            for config in _dispatch.split_bwd_configs("bfloat16", 192, 128, arch, deterministic):
                if config is not None:
                    assert config in configs
                    assert _configs.with_features(config, _configs.FEATURE_DROPOUT) in configs
        assert _dispatch.bwd_config("bfloat16", 192, arch) in configs
    assert not any(c.head_dim_v != c.head_dim for c in precompile.plan(
        80, ["bfloat16"], [128], [0], ("bwd",), [112]) if hasattr(c, "head_dim_v"))


def test_the_plan_follows_features_and_directions():
    plain = precompile.plan(80, ["float16"], [64], [0], ("decode",))
    assert plain and all(isinstance(c, _configs.DecodeConfig) for c in plain)
    features = precompile.parse_features(["softcap+alibi", "sinks", "varlen"])
    assert features == [_configs.FEATURE_SOFTCAP | _configs.FEATURE_ALIBI,
                        _configs.FEATURE_SINKS, _configs.FEATURE_VARLEN]
    configs = precompile.plan(80, ["float16"], [64], features, ("fwd", "bwd"))
    assert {c.features for c in configs if isinstance(c, _configs.FwdConfig)} == set(features)
    aux = {(c.kernel, c.varlen) for c in configs if isinstance(c, _configs.AuxKernel)}
    assert ("flash_bwd_sinks_kernel", False) in aux and ("flash_bwd_preprocess_kernel", True) in aux


def test_the_fp8_forward_plan_takes_varlen_with_its_feature():
    """--dtype e4m3 / e4m3-fp16: the FP8 forward's specialisations of the named head dims
    (_dispatch.e4m3_hopper_forward_configs), its varlen ones (FEATURE_VARLEN, the one-tile grid)
    with --features varlen only; none on other GPUs or for head dims it lacks."""
    elements = [precompile.DTYPES["e4m3"], precompile.DTYPES["e4m3-fp16"]]
    plain = precompile.plan(90, elements, [128, 96], [0], ("fwd",))
    assert plain == [c for c in _dispatch.e4m3_hopper_forward_configs() if c.head_dim == 128]
    both = precompile.plan(90, elements, [64], [0, _configs.FEATURE_VARLEN], ("fwd",))
    varlen = [c for c in both if c.features == _configs.FEATURE_VARLEN]
    assert {(c.dtype, c.head_dim, c.persistent) for c in varlen} == {
        (e, 64, False) for e in elements}
    assert len(both) == 2 * len(varlen)
    assert not precompile.plan(80, elements, [128], [0, _configs.FEATURE_VARLEN], ("fwd",))


def test_the_mla_decode_plan_takes_the_latent_head_dims():
    """--headdim 576 --headdim-v 512 --directions decode: the MLA decode kernel of each 16-bit
    dtype on sm_90 (plain calls: it takes no feature), alone and paired, beside the other head
    dims' kernels; nothing for MLA on other GPUs, in the other directions or for featured calls
    alone."""
    mla = precompile.plan(90, ["bfloat16", "float16"], [576], [0], ("decode",), [512])
    assert mla == [_configs.MlaDecodeConfig(t, paired=paired) for t in ("bfloat16", "float16")
                   for paired in (False, True)]
    with_128 = precompile.plan(90, ["bfloat16"], [128, 576], [0], ("fwd", "decode"), [512])
    assert with_128 == precompile.plan(90, ["bfloat16"], [128], [0], ("fwd", "decode")) + [
        _configs.MlaDecodeConfig("bfloat16"), _configs.MlaDecodeConfig("bfloat16", paired=True)]
    assert not precompile.plan(80, ["bfloat16"], [576], [0], ("decode",), [512])
    assert not precompile.plan(90, ["bfloat16"], [576], [0], ("fwd", "bwd"), [512])
    assert not precompile.plan(90, ["bfloat16"], [576], [_configs.FEATURE_SOFTCAP],
                               ("decode",), [512])


def test_unknown_feature_names_are_refused():
    with pytest.raises(ValueError, match="--features: unknown feature 'softcapp'"):
        precompile.parse_features(["softcapp"])


def test_the_progress_line_counts_rates_and_time_left():
    assert precompile.progress_line(12, 120, 4.0).endswith("12/120 kernels, 3.0/s, 36 s left")
    assert "time left unknown" in precompile.progress_line(0, 10, 0.0)
    assert precompile.progress_line(10, 10, 2.0).startswith("[" + "#" * 30 + "]")


def _cli(capsys, monkeypatch, *args, **env):
    """`cuflash2 ARGS` in this process (CUDA_VISIBLE_DEVICES="": no GPU, on any machine):
    (exit status, stdout, stderr)."""
    from cuflash2 import cli

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        status = cli.main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_precompile_without_a_gpu_says_what_it_needs(capsys, monkeypatch):
    # A process of its own: CUDA_VISIBLE_DEVICES must be set before CUDA starts (on a GPU
    # machine this process may have started it).
    result = subprocess.run([sys.executable, "-m", "cuflash2", "precompile"], cwd=REPO,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "cuflash2 precompile: needs an NVIDIA GPU" in result.stderr
    assert "Traceback" not in result.stderr
    # The options are checked first, GPU or not.
    status, _, err = _cli(capsys, monkeypatch, "precompile", "--features", "bias")
    assert status == 2 and "unknown feature 'bias'" in err


def test_info_counts_the_cached_modules(tmp_path, capsys, monkeypatch):
    """Every compiled module of the cache, and cuflash2's apart (its kernels' names in the
    module, as a cubin's symbol table holds them; CuPy's own kernels land in the same cache)."""
    (tmp_path / "a.cubin").write_bytes(b"\x7fELF..._Z21flash_fwd_sm90_kernelI8bf16_tag...")
    (tmp_path / "b.cubin").write_bytes(b"\x7fELF...cupy_multiply__float_float_float...")
    (tmp_path / "c.cubin").write_bytes(b"\x7fELF...merge_states_kernelI...")
    (tmp_path / "notes.txt").write_text("flash_fwd_kernel")
    status, out, err = _cli(capsys, monkeypatch, "info", CUPY_CACHE_DIR=str(tmp_path))
    assert status == 0, err
    assert f"{tmp_path} (3 compiled modules, 2 of them cuflash2's" in out
