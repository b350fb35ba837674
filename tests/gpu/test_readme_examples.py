"""The README's examples of programmable attention and of merging attention over split keys
(the code blocks after a `<!-- README example: NAME -->` line), run as a user would paste them,
on small inputs the test defines (q, k, v, dout, document_ids, table, nheads, seqlen); then
checked against the reference where the example computes an output or gradients (the pair-bias
example: its training loop's last gradients; the split keys' merge: its out and lse against
attention over all of the keys)."""

import re
from pathlib import Path

import numpy
import pytest

cupy = pytest.importorskip("cupy")

import cuflash2  # noqa: E402
from cuflash2 import testing  # noqa: E402

pytestmark = pytest.mark.gpu

README = Path(__file__).resolve().parents[2] / "README.md"
_EXAMPLE = re.compile(r"<!-- README example: ([^>]+?) -->\n```python\n(.*?)```", re.S)


def examples() -> dict:
    return {name: code for name, code in _EXAMPLE.findall(README.read_text())}


def test_the_readme_has_its_examples():
    assert set(examples()) == {"document mask", "prefix-LM", "relative position", "pair bias",
                               "split keys", "FP8 forward"}


def _inputs(seed):
    batch, seqlen, nheads, d = 2, 200, 4, 64
    q, k, v = testing.random_qkv(cupy, batch, seqlen, seqlen, nheads, nheads, d, numpy.float16,
                                 seed)
    rng = numpy.random.default_rng(seed)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(numpy.float16))
    document_ids = numpy.repeat(numpy.arange(4), seqlen // 4).astype(numpy.int32)
    table = cupy.asarray(rng.standard_normal((nheads, 2047)).astype(numpy.float32))
    return dict(cupy=cupy, numpy=numpy, cuflash2=cuflash2, q=q, k=k, v=v, dout=dout,
                document_ids=document_ids, table=table, nheads=nheads, seqlen=seqlen)


@pytest.mark.parametrize("name", ["document mask", "prefix-LM", "relative position"])
def test_example_runs_and_matches_the_reference(name):
    scope = _inputs(len(name))
    exec(examples()[name], scope)  # noqa: S102 (the README's own code)
    q, k, v, seqlen = scope["q"], scope["k"], scope["v"], scope["seqlen"]
    qi, ki = numpy.arange(seqlen)[:, None], numpy.arange(seqlen)[None, :]
    if name == "document mask":
        doc = scope["document_ids"]
        options = dict(mask=cupy.asarray((doc[qi] == doc[ki]) & (ki <= qi)))
    elif name == "prefix-LM":
        options = dict(mask=cupy.asarray((ki <= qi) | (ki < 64)))
    else:
        table = scope["table"]
        options = dict(causal=True,
                       score_mod=lambda s, b, h, qx, kx: s + table[h, qx - kx + 1023])
    results = testing.check_forward(q, k, v, scope["out"], None, **options)
    assert all(r.ok for r in results), [str(r) for r in results]
    if "dq" in scope:
        grads = (scope["dq"], scope["dk"], scope["dv"])
        extra = {} if name != "relative position" else dict(
            score_mod_grad=lambda s, b, h, qx, kx: cupy.ones_like(s))
        results = testing.check_backward(scope["dout"], q, k, v, *grads, **options, **extra)
        assert all(r.ok for r in results), [str(r) for r in results]


def test_pair_bias_example_trains_the_bias():
    scope = _inputs(7)
    exec(examples()["pair bias"], scope)  # noqa: S102
    bias, dbias = scope["pair_bias"], scope["dbias"]
    assert bias.shape == (1, scope["nheads"], scope["seqlen"], scope["seqlen"])
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    assert bool(cupy.isfinite(bias).all()) and float(cupy.abs(bias).max()) > 0
    # the last step's dbias, at the bias before that step, against the reference
    before = bias + 0.1 * dbias
    results = testing.check_backward(scope["dout"], scope["q"], scope["k"], scope["v"],
                                     scope["dq"], scope["dk"], scope["dv"], dbias, bias=before)
    assert all(r.ok for r in results), [str(r) for r in results]


def test_split_keys_example_matches_one_call():
    scope = _inputs(11)
    exec(examples()["split keys"], scope)  # noqa: S102
    q, k, v = scope["q"], scope["k"], scope["v"]
    results = testing.check_forward(q, k, v, scope["out"], scope["lse"])
    assert all(r.ok for r in results), [str(r) for r in results]


def test_fp8_forward_example():
    """The FP8 forward's example (sm_90) as pasted: its out against the references on the
    dequantised inputs (the 2x rule with the e4m3 roundings as ref_lo)."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 forward runs on sm_90")
    scope = {}
    exec(examples()["FP8 forward"], scope)
    q, k, v, out, scale = (scope[n] for n in ("q", "k", "v", "out", "scale"))
    assert out.shape == q.shape and str(out.dtype) == "bfloat16"
    results = testing.check_forward(q, k, v, out, causal=True, qkv_dtype="e4m3",
                                    q_descale=scale, k_descale=scale, v_descale=scale)
    assert all(r.ok for r in results), results
