"""Train a GPT-style decoder without PyTorch: CuPy arrays, cuBLAS matmuls, cuflash2 attention.

    python examples/train_gpt.py                       # GPT-2 small shapes, bf16, causal
    python examples/train_gpt.py --seconds 90          # stop after 90 s of training
    python examples/train_gpt.py --compare-sdpa        # then the same steps with torch SDPA
    python examples/train_gpt.py --layers 2 --dim 128 --heads 2 --seq-len 128 --batch 2 \\
        --vocab 256 --steps 40                         # tiny, seconds

The model is GPT-2's (pre-LayerNorm blocks: causal multi-head attention and a GELU MLP, learned
position embeddings, the token embedding tied to the output layer), by default at GPT-2 small's
shapes: 12 layers, 12 heads of 64, hidden 768, 1024 tokens, vocabulary 50304. Every matmul runs
on cuBLAS (cublasGemmEx through CuPy: bf16 inputs, fp32 accumulation and output); attention is
`cuflash2.attention` (bf16, causal, returning lse) and `cuflash2.attention_backward`; the other
layers' backward passes are written out below (LayerNorm, GELU, the linear layers, the
embeddings, softmax cross-entropy). Master weights, the residual stream, LayerNorm, GELU and the
loss are fp32; AdamW (decoupled weight decay on the matrices, gradient clipping at norm 1,
linear warm-up then cosine decay) updates all parameters at once in one flat buffer.

The data is synthetic and needs no download: a fixed random token sequence (1024 tokens over
512 symbols, so the next token depends on where in the sequence one is, which the model finds
through attention), each training sequence a window of it at a random offset. The loss falls
from ln(vocab) towards 0.

Throughput is counted as the FlashAttention-2 paper counts it (after Megatron-LM):

    FLOPs per step = 6 * N * batch * seq_len + 12 * layers * hidden * seq_len**2 * batch

where N is the number of parameters (the tied embedding once, position embeddings included):
6 N per token for the forward and backward matmuls, and 12 L d s^2 per sequence for attention's
two matmuls forward and backward, counted without the causal mask's saving as the paper does.
Model TFLOP/s is that over the measured step time (CUDA events, the steps after warm-up, whose
first call compiles the kernels). `--compare-sdpa` times the same model with torch's
scaled_dot_product_attention (its FlashAttention-2 backend, then cuDNN's) in place of cuflash2,
on the same arrays through DLPack, after the run.

The layer functions take NumPy or CuPy arrays (tests/test_train_gpt_math.py checks the whole
model's hand-written backward against finite differences in float64 on the CPU, with
`cuflash2.reference` as the attention).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy


def array_module(x):
    """numpy or cupy, whichever `x` belongs to (CuPy is imported only for its arrays)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return numpy


# ---------------------------------------------------------------------------------------------
# Layers: forward and hand-written backward, on NumPy or CuPy arrays (rows = tokens).

def layernorm_forward(x, gain, bias, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * gain + bias over the last axis; returns (y, cache)."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    rstd = 1.0 / (array_module(x).sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps))
    xhat = centred * rstd
    return xhat * gain + bias, (xhat, rstd)


def layernorm_backward(dy, cache, gain):
    """(dx, dgain, dbias) of layernorm_forward."""
    xhat, rstd = cache
    dxhat = dy * gain
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_forward(x):
    """GPT-2's GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    xp = array_module(x)
    return 0.5 * x * (1.0 + xp.tanh(_GELU_C * (x + 0.044715 * x * x * x)))


def gelu_backward(dy, x):
    """dx of gelu_forward at x."""
    xp = array_module(x)
    t = xp.tanh(_GELU_C * (x + 0.044715 * x * x * x))
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x))


def cross_entropy(logits, targets):
    """Mean softmax cross-entropy of rows `logits` (N, V) for int `targets` (N,); returns (loss
    as a 0-d array, dlogits). `logits` is overwritten (it becomes dlogits: memory, at V=50k)."""
    xp = array_module(logits)
    rows = xp.arange(logits.shape[0])
    logits -= logits.max(axis=1, keepdims=True)
    picked = logits[rows, targets]
    xp.exp(logits, out=logits)
    total = logits.sum(axis=1, keepdims=True)
    loss = (xp.log(total[:, 0]) - picked).mean()
    logits /= total
    logits[rows, targets] -= 1.0
    logits /= logits.shape[0]
    return loss, logits


def scatter_add(target, indices, values):
    """target[indices[i]] += values[i], repeated indices adding up (the embedding's backward)."""
    xp = array_module(target)
    if xp is numpy or hasattr(xp.add, "at"):  # CuPy's ufunc.at: newer CuPy
        xp.add.at(target, indices, values)
    else:
        import cupyx

        cupyx.scatter_add(target, indices, values)


def numpy_matmul(a, b, transpose_a=False, transpose_b=False, out=None):
    """The CPU stand-in of `CublasMatmul`: op(a) @ op(b), into `out` if given."""
    result = (a.T if transpose_a else a) @ (b.T if transpose_b else b)
    if out is None:
        return result
    out[...] = result
    return out


class CublasMatmul:
    """op(a) @ op(b) for C-contiguous 2-D bf16 CuPy arrays, by cublasGemmEx: bf16 inputs, fp32
    accumulation, fp32 output (a new array, or `out`: fp32, C-contiguous, of the result's shape).
    Called directly rather than through cupy.matmul so that the bf16 case is certain to run on
    cuBLAS's tensor-core GEMM."""

    # cuBLAS / CUDA enums (cublas_api.h, library_types.h).
    OP_N, OP_T = 0, 1
    R_32F, R_16BF = 0, 14
    COMPUTE_32F = 68
    GEMM_DEFAULT = -1
    POINTER_MODE_HOST = 0

    def __init__(self, cupy):
        from cupy_backends.cuda.libs import cublas

        self.cupy, self.cublas = cupy, cublas
        self.handle = cupy.cuda.device.get_cublas_handle()
        self.one = numpy.array(1.0, dtype=numpy.float32)
        self.zero = numpy.array(0.0, dtype=numpy.float32)

    def __call__(self, a, b, transpose_a=False, transpose_b=False, out=None):
        cupy = self.cupy
        for name, x in (("a", a), ("b", b)):
            if x.ndim != 2 or not x.flags.c_contiguous or x.dtype.itemsize != 2:
                raise ValueError(f"{name}: expected a C-contiguous 2-D bf16 array, got "
                                 f"{x.dtype} {x.shape}")
        m, k = (a.shape[1], a.shape[0]) if transpose_a else a.shape
        k_b, n = (b.shape[1], b.shape[0]) if transpose_b else b.shape
        if k != k_b:
            raise ValueError(f"inner dimensions differ: op(a) {m}x{k}, op(b) {k_b}x{n}")
        if out is None:
            out = cupy.empty((m, n), dtype=cupy.float32)
        elif out.shape != (m, n) or out.dtype != cupy.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out: expected a C-contiguous float32 array of shape {(m, n)}, "
                             f"got {out.dtype} {out.shape}")
        # Row-major C = op(a) op(b) is column-major C^T = op(b)^T op(a)^T: cuBLAS gets b first.
        # A row-major (r, c) array is a column-major (c, r) one with leading dimension c.
        # alpha and beta are host scalars: the handle is CuPy's, whose routines may have left
        # it in device pointer mode.
        self.cublas.setPointerMode(self.handle, self.POINTER_MODE_HOST)
        self.cublas.gemmEx(
            self.handle, self.OP_T if transpose_b else self.OP_N,
            self.OP_T if transpose_a else self.OP_N, n, m, k,
            self.one.ctypes.data, b.data.ptr, self.R_16BF, b.shape[1],
            a.data.ptr, self.R_16BF, a.shape[1],
            self.zero.ctypes.data, out.data.ptr, self.R_32F, n,
            self.COMPUTE_32F, self.GEMM_DEFAULT)
        return out

    def self_check(self):
        """Each transpose case against cupy.matmul in fp32 on the same bf16 values; raises
        RuntimeError naming the case that differs."""
        import ml_dtypes

        cupy = self.cupy
        rng = cupy.random.default_rng(0)
        m, k, n = 48, 40, 56
        for transpose_a in (False, True):
            for transpose_b in (False, True):
                a = rng.standard_normal((k, m) if transpose_a else (m, k),
                                        dtype=cupy.float32).astype(ml_dtypes.bfloat16)
                b = rng.standard_normal((n, k) if transpose_b else (k, n),
                                        dtype=cupy.float32).astype(ml_dtypes.bfloat16)
                got = self(a, b, transpose_a, transpose_b)
                a32, b32 = a.astype(cupy.float32), b.astype(cupy.float32)
                want = (a32.T if transpose_a else a32) @ (b32.T if transpose_b else b32)
                err = float(cupy.abs(got - want).max())
                if not err < 1e-3 * float(cupy.abs(want).max()) + 1e-3:
                    raise RuntimeError(f"cublasGemmEx check failed (transpose_a={transpose_a}, "
                                       f"transpose_b={transpose_b}): max error {err}")


# ---------------------------------------------------------------------------------------------
# Attention backends: forward(q, k, v) -> (out, state), backward(dout, state) -> (dq, dk, dv);
# q, k, v (batch, seqlen, heads, head_dim) views of the qkv projection, causal.

class Cuflash2Attention:
    """cuflash2.attention / attention_backward, causal."""

    name = "cuflash2"

    def forward(self, q, k, v):
        import cuflash2

        out, lse = cuflash2.attention(q, k, v, causal=True, return_lse=True)
        return out, (q, k, v, out, lse)

    def backward(self, dout, state):
        import cuflash2

        q, k, v, out, lse = state
        return cuflash2.attention_backward(dout, q, k, v, out, lse, causal=True)


class ReferenceAttention:
    """cuflash2.reference in `dtype` (the CPU test's attention, float64)."""

    name = "reference"

    def __init__(self, dtype=numpy.float64):
        self.dtype = dtype

    def forward(self, q, k, v):
        from cuflash2 import reference

        out, lse = reference.attention(q, k, v, causal=True, return_lse=True,
                                       compute_dtype=self.dtype)
        return out, (q, k, v, out, lse)

    def backward(self, dout, state):
        from cuflash2 import reference

        q, k, v, out, lse = state
        return reference.attention_backward(dout, q, k, v, out, lse, causal=True,
                                            compute_dtype=self.dtype)


class TorchSdpaAttention:
    """torch's scaled_dot_product_attention restricted to one backend ("FLASH_ATTENTION",
    "CUDNN_ATTENTION") on the same CuPy arrays through DLPack (no copies in, one out)."""

    def __init__(self, torch, cupy, backend: str):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch, self.cupy = torch, cupy
        self.name = f"torch SDPA ({backend})"
        self.only = lambda: sdpa_kernel(getattr(SDPBackend, backend))

    def _torch(self, x):
        # (b, s, h, d) -> (b, h, s, d), through int16 so that neither side's DLPack needs bf16.
        return self.torch.from_dlpack(x.view(self.cupy.int16)).view(self.torch.bfloat16) \
            .transpose(1, 2)

    def _cupy(self, t, dtype):
        t = t.transpose(1, 2).contiguous().view(self.torch.int16)
        return self.cupy.from_dlpack(t).view(dtype)

    def forward(self, q, k, v):
        qt, kt, vt = (self._torch(x).detach().requires_grad_() for x in (q, k, v))
        with self.only():
            out = self.torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                         is_causal=True)
        return self._cupy(out.detach(), q.dtype), (qt, kt, vt, out, q.dtype)

    def backward(self, dout, state):
        qt, kt, vt, out, dtype = state
        with self.only():
            grads = self.torch.autograd.grad(out, (qt, kt, vt), self._torch(dout))
        return tuple(self._cupy(g, dtype) for g in grads)


# ---------------------------------------------------------------------------------------------
# The model.

@dataclass(frozen=True)
class Config:
    vocab: int = 50304
    seq_len: int = 1024
    layers: int = 12
    heads: int = 12
    dim: int = 768
    batch: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


#: Per layer: (name, shape as a function of the hidden size d, decayed, init).
LAYER_PARAMS = (
    ("ln1_g", lambda d: (d,), False, "one"), ("ln1_b", lambda d: (d,), False, "zero"),
    ("attn_w", lambda d: (d, 3 * d), True, "normal"), ("attn_b", lambda d: (3 * d,), False, "zero"),
    ("proj_w", lambda d: (d, d), True, "residual"), ("proj_b", lambda d: (d,), False, "zero"),
    ("ln2_g", lambda d: (d,), False, "one"), ("ln2_b", lambda d: (d,), False, "zero"),
    ("fc_w", lambda d: (d, 4 * d), True, "normal"), ("fc_b", lambda d: (4 * d,), False, "zero"),
    ("fc2_w", lambda d: (4 * d, d), True, "residual"), ("fc2_b", lambda d: (d,), False, "zero"),
)
#: The matrices the matmuls read, cast to the low precision once a step.
MATMUL_WEIGHTS = ("attn_w", "proj_w", "fc_w", "fc2_w")


def parameter_layout(config: Config):
    """[(name, shape, decayed, init)] of every parameter, in the flat buffer's order."""
    layout = [("wte", (config.vocab, config.dim), True, "normal"),
              ("wpe", (config.seq_len, config.dim), False, "normal")]
    for layer in range(config.layers):
        layout += [(f"h{layer}.{name}", shape(config.dim), decayed, init)
                   for name, shape, decayed, init in LAYER_PARAMS]
    layout += [("lnf_g", (config.dim,), False, "one"), ("lnf_b", (config.dim,), False, "zero")]
    return layout


def flat_views(flat, layout):
    """{name: view of `flat`} for the layout (writing a view writes the flat buffer)."""
    views, offset = {}, 0
    for name, shape, _, _ in layout:
        size = math.prod(shape)
        views[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    return views


def init_parameters(xp, config: Config, dtype, seed: int = 0):
    """(flat parameters, {name: view}, flat decay mask): GPT-2's initialisation, N(0, 0.02), the
    residual projections scaled by 1/sqrt(2 layers), LayerNorm gains 1, biases 0."""
    layout = parameter_layout(config)
    total = sum(math.prod(shape) for _, shape, _, _ in layout)
    rng = numpy.random.default_rng(seed)
    host = numpy.empty(total, dtype=numpy.float32)
    mask = numpy.zeros(total, dtype=numpy.float32)
    offset = 0
    for _, shape, decayed, init in layout:
        size = math.prod(shape)
        std = 0.02 / math.sqrt(2 * config.layers) if init == "residual" else 0.02
        random = init in ("normal", "residual")
        host[offset:offset + size] = rng.standard_normal(size) * std if random else float(
            init == "one")
        mask[offset:offset + size] = float(decayed)
        offset += size
    flat = xp.asarray(host.astype(dtype))
    return flat, flat_views(flat, layout), xp.asarray(mask.astype(dtype))


class GPT:
    """forward_backward(tokens, targets, grads) -> loss, writing every parameter's gradient
    into `grads` ({name: view}, shaped like the parameters). `matmul(a, b, transpose_a,
    transpose_b, out)`: op(a) @ op(b) of `low`-dtype 2-D arrays in the parameters' dtype;
    `attention`: a backend above; `low`: the dtype of the matmuls' and attention's inputs."""

    def __init__(self, config: Config, params, matmul, attention, low):
        self.config, self.params = config, params
        self.matmul, self.attention, self.low = matmul, attention, low

    def _lo(self, x):
        return x.astype(self.low)

    def forward_backward(self, tokens, targets, grads):
        c, p, matmul, lo = self.config, self.params, self.matmul, self._lo
        xp = array_module(tokens)
        batch, seq_len = tokens.shape
        n, d, heads = batch * seq_len, c.dim, c.heads
        ids = tokens.reshape(-1)
        w = {f"h{layer}.{name}": lo(p[f"h{layer}.{name}"])
             for layer in range(c.layers) for name in MATMUL_WEIGHTS}
        wte = lo(p["wte"])

        x = p["wte"][ids] + xp.tile(p["wpe"][:seq_len], (batch, 1))  # (n, d)
        saved = []
        for layer in range(c.layers):
            name = f"h{layer}."
            h1, ln1 = layernorm_forward(x, p[name + "ln1_g"], p[name + "ln1_b"])
            h1 = lo(h1)
            qkv = lo(matmul(h1, w[name + "attn_w"]) + p[name + "attn_b"])
            q, k, v = (qkv.reshape(batch, seq_len, 3, heads, c.head_dim)[:, :, i]
                       for i in range(3))
            att, att_state = self.attention.forward(q, k, v)
            att = xp.ascontiguousarray(att).reshape(n, d)
            x = x + matmul(att, w[name + "proj_w"]) + p[name + "proj_b"]
            h2, ln2 = layernorm_forward(x, p[name + "ln2_g"], p[name + "ln2_b"])
            h2 = lo(h2)
            f = matmul(h2, w[name + "fc_w"]) + p[name + "fc_b"]
            g = lo(gelu_forward(f))
            x = x + matmul(g, w[name + "fc2_w"]) + p[name + "fc2_b"]
            saved.append((ln1, h1, att_state, att, ln2, h2, f, g))
        hf, lnf = layernorm_forward(x, p["lnf_g"], p["lnf_b"])
        hf = lo(hf)
        logits = matmul(hf, wte, transpose_b=True)  # (n, vocab), the tied embedding
        loss, dlogits = cross_entropy(logits, targets.reshape(-1))
        del logits

        dlogits = lo(dlogits)
        dhf = matmul(dlogits, wte)
        matmul(dlogits, hf, transpose_a=True, out=grads["wte"])
        del dlogits
        dx, grads["lnf_g"][...], grads["lnf_b"][...] = layernorm_backward(dhf, lnf, p["lnf_g"])
        for layer in reversed(range(c.layers)):
            name = f"h{layer}."
            ln1, h1, att_state, att, ln2, h2, f, g = saved.pop()
            # MLP: x += gelu(ln2(x) W_fc + b_fc) W_fc2 + b_fc2
            dy = lo(dx)
            grads[name + "fc2_b"][...] = dx.sum(axis=0)
            matmul(g, dy, transpose_a=True, out=grads[name + "fc2_w"])
            df = gelu_backward(matmul(dy, w[name + "fc2_w"], transpose_b=True), f)
            grads[name + "fc_b"][...] = df.sum(axis=0)
            df = lo(df)
            matmul(h2, df, transpose_a=True, out=grads[name + "fc_w"])
            dh2 = matmul(df, w[name + "fc_w"], transpose_b=True)
            dln, grads[name + "ln2_g"][...], grads[name + "ln2_b"][...] = layernorm_backward(
                dh2, ln2, p[name + "ln2_g"])
            dx = dx + dln
            # Attention: x += attention(ln1(x) W_qkv + b_qkv) W_proj + b_proj
            dy = lo(dx)
            grads[name + "proj_b"][...] = dx.sum(axis=0)
            matmul(att, dy, transpose_a=True, out=grads[name + "proj_w"])
            datt = lo(matmul(dy, w[name + "proj_w"], transpose_b=True))
            dq, dk, dv = self.attention.backward(
                datt.reshape(batch, seq_len, heads, c.head_dim), att_state)
            dqkv = xp.empty((batch, seq_len, 3, heads, c.head_dim), dtype=dx.dtype)
            for i, grad in enumerate((dq, dk, dv)):
                dqkv[:, :, i] = grad.astype(dx.dtype)
            dqkv = dqkv.reshape(n, 3 * d)
            grads[name + "attn_b"][...] = dqkv.sum(axis=0)
            dqkv = lo(dqkv)
            matmul(h1, dqkv, transpose_a=True, out=grads[name + "attn_w"])
            dh1 = matmul(dqkv, w[name + "attn_w"], transpose_b=True)
            dln, grads[name + "ln1_g"][...], grads[name + "ln1_b"][...] = layernorm_backward(
                dh1, ln1, p[name + "ln1_g"])
            dx = dx + dln
        grads["wpe"][...] = 0
        grads["wpe"][:seq_len] = dx.reshape(batch, seq_len, d).sum(axis=0)
        scatter_add(grads["wte"], ids, dx)  # the input embedding's share of the tied matrix
        return loss


def adamw_step(params, grads, m, v, decay_mask, step, lr, beta1=0.9, beta2=0.95, eps=1e-8,
               weight_decay=0.1, clip=1.0):
    """One AdamW step on flat buffers (in place): gradients clipped to global norm `clip`
    (without a host synchronisation), decoupled weight decay where decay_mask is 1."""
    xp = array_module(params)
    norm = xp.sqrt((grads * grads).sum())
    grads *= xp.minimum(1.0, clip / (norm + 1e-6))
    m *= beta1
    m += (1 - beta1) * grads
    v *= beta2
    v += (1 - beta2) * grads * grads
    params -= (lr * weight_decay) * decay_mask * params
    params -= (lr / (1 - beta1 ** step)) * m / (xp.sqrt(v / (1 - beta2 ** step)) + eps)
    return norm


def learning_rate(step, total, peak, warmup):
    """Linear warm-up to `peak`, then cosine decay to a tenth of it at `total`."""
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class SyntheticTokens:
    """Windows of a fixed random sequence (`period` tokens over `symbols` of the vocabulary) at
    random offsets: (tokens, targets) int32 (batch, seq_len), targets the next tokens."""

    def __init__(self, vocab, period=1024, symbols=512, seed=1234):
        rng = numpy.random.default_rng(seed)
        self.sequence = rng.integers(0, min(symbols, vocab), size=period).astype(numpy.int32)
        self.rng = rng

    def batch(self, batch, seq_len):
        starts = self.rng.integers(0, len(self.sequence), size=batch)
        index = (starts[:, None] + numpy.arange(seq_len + 1)) % len(self.sequence)
        window = self.sequence[index]
        return window[:, :-1], window[:, 1:]


def step_flops(config: Config, parameters: int) -> float:
    """FLOPs of one training step as the FlashAttention-2 paper counts them (module doc)."""
    tokens = config.batch * config.seq_len
    return (6.0 * parameters * tokens
            + 12.0 * config.layers * config.dim * config.seq_len ** 2 * config.batch)


# ---------------------------------------------------------------------------------------------
# Training on the GPU.

class Trainer:
    def __init__(self, cupy, config: Config, attention, seed=0):
        import ml_dtypes

        self.cupy, self.config = cupy, config
        self.flat, self.params, self.decay_mask = init_parameters(cupy, config, numpy.float32,
                                                                  seed)
        self.grad_flat = cupy.zeros_like(self.flat)
        self.grads = flat_views(self.grad_flat, parameter_layout(config))
        self.m, self.v = cupy.zeros_like(self.flat), cupy.zeros_like(self.flat)
        matmul = CublasMatmul(cupy)
        matmul.self_check()
        self.model = GPT(config, self.params, matmul, attention, numpy.dtype(ml_dtypes.bfloat16))
        self.step_count = 0

    @property
    def parameters(self) -> int:
        return int(self.flat.size)

    def step(self, tokens, targets, lr):
        """One training step on host int arrays; returns the loss (a 0-d CuPy array)."""
        cupy = self.cupy
        loss = self.model.forward_backward(cupy.asarray(tokens), cupy.asarray(targets),
                                           self.grads)
        self.step_count += 1
        adamw_step(self.flat, self.grad_flat, self.m, self.v, self.decay_mask, self.step_count,
                   lr)
        return loss


def time_steps(cupy, trainer, data, steps, lr, warmup=2) -> float:
    """Mean ms of `steps` training steps after `warmup`, between two CUDA events."""
    c = trainer.config
    for _ in range(warmup):
        trainer.step(*data.batch(c.batch, c.seq_len), lr)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(steps):
        trainer.step(*data.batch(c.batch, c.seq_len), lr)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Config()
    for name in ("vocab", "seq_len", "layers", "heads", "dim", "batch"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name))
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="stop after this many seconds of training (0: no limit)")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--period", type=int, default=1024,
                        help="length of the repeating token sequence the data is cut from")
    parser.add_argument("--symbols", type=int, default=512,
                        help="distinct tokens in it (fewer: an easier task)")
    parser.add_argument("--compare-sdpa", action="store_true",
                        help="after training, time the same steps with torch SDPA's "
                             "FlashAttention-2 and cuDNN backends in place of cuflash2")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    config = Config(args.vocab, args.seq_len, args.layers, args.heads, args.dim, args.batch)
    if config.dim % config.heads:
        parser.error(f"--dim {config.dim} is not a multiple of --heads {config.heads}")

    try:
        import cupy
    except ImportError as exc:
        print(f"train_gpt.py needs CuPy and a GPU ({exc}): pip install cupy-cuda13x, or from a "
              'checkout of cuflash2 pip install ".[cuda13]"', file=sys.stderr)
        return 2

    trainer = Trainer(cupy, config, Cuflash2Attention(), args.seed)
    data = SyntheticTokens(config.vocab, args.period, args.symbols)
    flops = step_flops(config, trainer.parameters)
    tokens_per_step = config.batch * config.seq_len
    print(f"GPT: {config.layers} layers, {config.heads} heads x {config.head_dim}, hidden "
          f"{config.dim}, {config.seq_len} tokens, vocab {config.vocab}, batch {config.batch}; "
          f"{trainer.parameters / 1e6:.1f} M parameters; {flops / 1e12:.3f} TFLOP a step "
          "(6 N tokens + 12 L d s^2 batch)", flush=True)

    # The first steps compile cuflash2's kernels (or load them from the cache): not timed.
    warmup = min(3, max(0, args.steps - 1))
    timed_ms, timed_steps, started = 0.0, 0, time.monotonic()
    first_loss = None
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for step in range(1, args.steps + 1):
        lr = learning_rate(step, args.steps, args.lr, args.warmup_steps)
        if step == warmup + 1:
            cupy.cuda.get_current_stream().synchronize()
            start.record()
        loss = trainer.step(*data.batch(config.batch, config.seq_len), lr)
        if step > warmup:
            timed_steps += 1
        out_of_time = args.seconds and time.monotonic() - started > args.seconds
        if step == 1 or step % args.log_every == 0 or step == args.steps or out_of_time:
            value = float(loss)
            first_loss = value if first_loss is None else first_loss
            print(f"step {step:5d}  loss {value:.4f}  lr {lr:.2e}  "
                  f"{time.monotonic() - started:6.1f} s", flush=True)
        if out_of_time:
            break
    end.record()
    end.synchronize()
    if timed_steps:
        timed_ms = cupy.cuda.get_elapsed_time(start, end) / timed_steps
        print(f"cuflash2: {timed_ms:.1f} ms/step over {timed_steps} steps, "
              f"{tokens_per_step / timed_ms * 1e3:.0f} tokens/s, "
              f"{flops / timed_ms / 1e9:.1f} model TFLOP/s (first loss {first_loss:.4f}, "
              f"last {value:.4f})", flush=True)
    if not math.isfinite(value):
        print("the loss is not finite", file=sys.stderr)
        return 1

    if args.compare_sdpa:
        compare_sdpa(cupy, trainer, data, config, flops, args.lr)
    return 0


def compare_sdpa(cupy, trainer, data, config, flops, lr, steps=10):
    """The same model's step time with cuflash2 and with torch SDPA's backends, timed alike."""
    try:
        import torch
        import torch.nn.attention  # noqa: F401  (sdpa_kernel: torch >= 2.3)
    except Exception as exc:
        print(f"--compare-sdpa: torch is not importable ({exc})", flush=True)
        return
    backends = [Cuflash2Attention()]
    backends += [TorchSdpaAttention(torch, cupy, b) for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION")]
    times = {}
    for backend in backends:
        trainer.model.attention = backend
        try:
            times[backend.name] = ms = time_steps(cupy, trainer, data, steps, lr)
        except Exception as exc:  # a backend that refuses the shape: say why, go on
            print(f"{backend.name}: failed ({exc.__class__.__name__}: {exc})", flush=True)
            continue
        ours = times.get(backends[0].name)
        ratio = "" if backend is backends[0] or ours is None else \
            f", cuflash2 {ms / ours:.2f}x faster"
        print(f"{backend.name}: {ms:.1f} ms/step over {steps} steps, "
              f"{config.batch * config.seq_len / ms * 1e3:.0f} tokens/s, "
              f"{flops / ms / 1e9:.1f} model TFLOP/s{ratio}", flush=True)
    trainer.model.attention = backends[0]


if __name__ == "__main__":
    sys.exit(main())
