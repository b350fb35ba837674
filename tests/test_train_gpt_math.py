"""examples/train_gpt.py on the CPU: its hand-written backward (LayerNorm, GELU, the linear
layers, the tied embedding, cross-entropy, and the whole model with cuflash2.reference as the
attention) against central finite differences in float64, and its cublasGemmEx call's operand
order against a column-major GEMM written out in NumPy (the GPU run checks it again)."""

import importlib.util
import sys
import types
from pathlib import Path

import numpy
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _numeric_gradient(f, x, indices, eps=1e-6):
    grads = []
    for i in indices:
        saved = x.flat[i]
        x.flat[i] = saved + eps
        up = f()
        x.flat[i] = saved - eps
        down = f()
        x.flat[i] = saved
        grads.append((up - down) / (2 * eps))
    return numpy.array(grads)


def test_layers_backward_match_finite_differences(gpt):
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((5, 7))
    gain, bias = rng.standard_normal(7), rng.standard_normal(7)
    dy = rng.standard_normal((5, 7))
    every = range(x.size)

    def ln_loss():
        return float((gpt.layernorm_forward(x, gain, bias)[0] * dy).sum())

    _, cache = gpt.layernorm_forward(x, gain, bias)
    dx, dgain, dbias = gpt.layernorm_backward(dy, cache, gain)
    numpy.testing.assert_allclose(dx.ravel(), _numeric_gradient(ln_loss, x, every), rtol=1e-6,
                                  atol=1e-8)
    numpy.testing.assert_allclose(dgain, _numeric_gradient(ln_loss, gain, range(7)), rtol=1e-6)
    numpy.testing.assert_allclose(dbias, _numeric_gradient(ln_loss, bias, range(7)), rtol=1e-6)

    def gelu_loss():
        return float((gpt.gelu_forward(x) * dy).sum())

    numpy.testing.assert_allclose(gpt.gelu_backward(dy, x).ravel(),
                                  _numeric_gradient(gelu_loss, x, every), rtol=1e-6, atol=1e-9)

    targets = rng.integers(0, 7, size=5)

    def ce_loss():
        return float(gpt.cross_entropy(x.copy(), targets)[0])

    loss, dlogits = gpt.cross_entropy(x.copy(), targets)
    shifted = x - x.max(axis=1, keepdims=True)
    expected = numpy.mean(numpy.log(numpy.exp(shifted).sum(axis=1))
                          - shifted[numpy.arange(5), targets])
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    numpy.testing.assert_allclose(dlogits.ravel(), _numeric_gradient(ce_loss, x, every),
                                  rtol=1e-6, atol=1e-9)


def test_model_backward_matches_finite_differences(gpt):
    """Every parameter group's gradient, at a few entries each, of a 2-layer model whose
    parameters are drawn large enough (std 0.3) that no layer is close to linear."""
    config = gpt.Config(vocab=11, seq_len=5, layers=2, heads=2, dim=8, batch=2)
    flat, params, _ = gpt.init_parameters(numpy, config, numpy.float64)
    rng = numpy.random.default_rng(1)
    flat[:] = rng.normal(0.0, 0.3, size=flat.size)
    grad_flat = numpy.zeros_like(flat)
    layout = gpt.parameter_layout(config)
    grads = gpt.flat_views(grad_flat, layout)
    model = gpt.GPT(config, params, gpt.numpy_matmul, gpt.ReferenceAttention(),
                    numpy.dtype(numpy.float64))
    data = gpt.SyntheticTokens(config.vocab, period=17, symbols=11)
    tokens, targets = data.batch(config.batch, config.seq_len)
    model.forward_backward(tokens, targets, grads)
    analytic = grad_flat.copy()

    def loss():
        return float(model.forward_backward(tokens, targets, gpt.flat_views(
            numpy.zeros_like(flat), layout)))

    indices, offset = [], 0
    for _, shape, _, _ in layout:  # three entries of every parameter, spread over it
        size = int(numpy.prod(shape))
        indices += sorted({offset, offset + size // 2, offset + size - 1})
        offset += size
    numeric = _numeric_gradient(loss, flat, indices)
    # The lse of cuflash2.reference is float32 (its documented dtype), so the attention's
    # gradient carries float32's relative error, ~1e-7.
    numpy.testing.assert_allclose(analytic[indices], numeric, rtol=2e-4, atol=1e-7)


def test_adamw_and_schedule(gpt):
    params = numpy.ones(4)
    grads = numpy.array([3.0, 4.0, 0.0, 0.0])  # norm 5: clipped to 1
    m, v = numpy.zeros(4), numpy.zeros(4)
    decay = numpy.array([1.0, 0.0, 1.0, 0.0])
    norm = gpt.adamw_step(params, grads, m, v, decay, step=1, lr=0.1, weight_decay=0.5)
    assert float(norm) == pytest.approx(5.0)
    numpy.testing.assert_allclose(grads, [0.6, 0.8, 0.0, 0.0], rtol=1e-5)
    # First step: the bias-corrected update is lr * sign(g); decay lr * wd * p where masked.
    numpy.testing.assert_allclose(params, [1 - 0.05 - 0.1, 1 - 0.1, 1 - 0.05, 1.0], rtol=1e-5)
    assert gpt.learning_rate(5, 100, 1.0, 10) == pytest.approx(0.5)
    assert gpt.learning_rate(100, 100, 1.0, 10) == pytest.approx(0.1)
    config = gpt.Config()
    parameters = sum(int(numpy.prod(s)) for _, s, _, _ in gpt.parameter_layout(config))
    assert 124e6 < parameters < 125e6  # GPT-2 small with the padded vocabulary
    assert gpt.step_flops(config, parameters) == pytest.approx(
        6 * parameters * 8 * 1024 + 12 * 12 * 768 * 1024**2 * 8)


class _Memory:
    """Stand-in device memory: arrays registered under fake pointers."""

    def __init__(self):
        self.arrays = {}

    def array(self, values):
        array = types.SimpleNamespace(host=numpy.ascontiguousarray(values), ndim=values.ndim,
                                      shape=values.shape, dtype=values.dtype)
        array.flags = types.SimpleNamespace(c_contiguous=True)
        array.data = types.SimpleNamespace(ptr=1000 + len(self.arrays))
        self.arrays[array.data.ptr] = array.host
        return array


def test_cublas_operands_give_row_major_products(gpt):
    """CublasMatmul's gemmEx arguments, fed to a column-major GEMM as cuBLAS defines it: each
    transpose case must give the row-major op(a) @ op(b)."""
    memory = _Memory()

    def gemm_ex(handle, transa, transb, m, n, k, alpha, a_ptr, a_type, lda, b_ptr, b_type, ldb,
                beta, c_ptr, c_type, ldc, compute, algo):
        def column_major(ptr, rows, cols, ld):  # element (i, j) at i + j * ld
            flat = memory.arrays[ptr].reshape(-1)
            return numpy.array([[flat[i + j * ld] for j in range(cols)] for i in range(rows)],
                               dtype=numpy.float64)

        op_a = (column_major(a_ptr, m, k, lda) if transa == 0
                else column_major(a_ptr, k, m, lda).T)
        op_b = (column_major(b_ptr, k, n, ldb) if transb == 0
                else column_major(b_ptr, n, k, ldb).T)
        product = op_a @ op_b
        out = memory.arrays[c_ptr].reshape(-1)
        for i in range(m):
            for j in range(n):
                out[i + j * ldc] = product[i, j]

    matmul = object.__new__(gpt.CublasMatmul)
    matmul.cublas = types.SimpleNamespace(gemmEx=gemm_ex,
                                          setPointerMode=lambda handle, mode: None)
    matmul.cupy = types.SimpleNamespace(
        float32=numpy.float32,
        empty=lambda shape, dtype: memory.array(numpy.zeros(shape, dtype)))
    matmul.handle = 0
    matmul.one = matmul.zero = numpy.zeros(())
    rng = numpy.random.default_rng(2)
    m, k, n = 3, 4, 5
    for transpose_a in (False, True):
        for transpose_b in (False, True):
            a = rng.standard_normal((k, m) if transpose_a else (m, k)).astype(numpy.float16)
            b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(numpy.float16)
            out = matmul(memory.array(a), memory.array(b), transpose_a, transpose_b)
            a64, b64 = a.astype(numpy.float64), b.astype(numpy.float64)
            want = (a64.T if transpose_a else a64) @ (b64.T if transpose_b else b64)
            numpy.testing.assert_allclose(out.host, want, rtol=1e-6,
                                          err_msg=f"transpose_a={transpose_a}, "
                                                  f"transpose_b={transpose_b}")
