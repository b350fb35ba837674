"""JAX arrays through cuflash2 and back, by DLPack (no copies of q, k, v on the way in).

    python examples/jax_dlpack.py              # bf16, 2 x 1024 tokens, 8 heads of 64
    python examples/jax_dlpack.py --dtype fp16 --seq-len 4096

JAX makes q, k, v and the output gradient; CuPy views the same device memory
(`cupy.from_dlpack`); cuflash2.attention and cuflash2.attention_backward run on those views; JAX
views the results (`jax.dlpack.from_dlpack`). The example checks them against attention written
in jax.numpy (the forward, and the gradients from jax.vjp, in float32) and prints the largest
differences; it exits with status 1 where one exceeds the bound for the dtype.

Two things to know when mixing the two:
- JAX and CuPy queue work on different CUDA streams. DLPack's `stream` argument makes the
  consumer's stream wait for the producer's work where both sides support it; here the example
  also waits explicitly (`block_until_ready` before CuPy reads, a stream synchronisation before
  JAX reads), which is always correct.
- JAX reserves most of the GPU's memory when it starts; XLA_PYTHON_CLIENT_PREALLOCATE=false
  (set below before JAX is imported) leaves room for CuPy's pool.

bfloat16 through DLPack needs both libraries to know the type; where one does not, the arrays
cross as uint16 and are reinterpreted on the other side (`to_cupy`, `to_jax`), still without a
copy on the CuPy side.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def to_cupy(cupy, x):
    """A CuPy view of the JAX array x (its computation finished first)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    jax.block_until_ready(x)
    try:
        return cupy.from_dlpack(x)
    except Exception:  # a DLPack without bfloat16 on one side: cross as uint16
        if x.dtype != jnp.bfloat16:
            raise
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        jax.block_until_ready(bits)
        return cupy.from_dlpack(bits).view(ml_dtypes.bfloat16)


def to_jax(cupy, x):
    """A JAX array over the CuPy array x (CuPy's work on it finished first)."""
    import jax
    import jax.numpy as jnp

    cupy.cuda.get_current_stream().synchronize()
    try:
        return jax.dlpack.from_dlpack(x)
    except Exception:  # a DLPack without bfloat16 on one side: cross as uint16
        if x.dtype.itemsize != 2 or x.dtype == cupy.float16:
            raise
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(x.view(cupy.uint16)),
                                            jnp.bfloat16)


def jax_attention(q, k, v):
    """Causal attention in jax.numpy, float32: the check's reference."""
    import jax
    import jax.numpy as jnp

    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    visible = jnp.tril(jnp.ones((seqlen_q, seqlen_k), dtype=bool), k=seqlen_k - seqlen_q)
    scores = jnp.where(visible, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)

    import cupy
    import jax
    import jax.numpy as jnp

    import cuflash2

    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[args.dtype]
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, dout = (jax.random.normal(key, shape, dtype=jnp.float32).astype(dtype)
                     for key in keys)

    # JAX -> CuPy (views), cuflash2 on the GPU, CuPy -> JAX.
    qc, kc, vc, doutc = (to_cupy(cupy, x) for x in (q, k, v, dout))
    out_c, lse_c = cuflash2.attention(qc, kc, vc, causal=True, return_lse=True)
    dq_c, dk_c, dv_c = cuflash2.attention_backward(doutc, qc, kc, vc, out_c, lse_c, causal=True)
    out, dq, dk, dv = (to_jax(cupy, x) for x in (out_c, dq_c, dk_c, dv_c))
    print(f"cuflash2 on JAX arrays: out {out.shape} {out.dtype}, dq {dq.shape} {dq.dtype}")

    # The same in jax.numpy, float32.
    ref_out, vjp = jax.vjp(jax_attention, q, k, v)
    ref_grads = vjp(dout.astype(jnp.float32))
    bound = {"bf16": 3e-2, "fp16": 5e-3}[args.dtype]  # a few units in the last place at O(1)
    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                               (ref_out, *ref_grads)):
        scale = float(jnp.abs(want).max())
        err = float(jnp.abs(got.astype(jnp.float32) - want).max())
        worst = max(worst, err / max(scale, 1.0))
        print(f"{name}: max |cuflash2 - jax.numpy| = {err:.3e} (max |jax.numpy| {scale:.2f})")
    if worst > bound:
        print(f"differences above {bound} (relative to max(1, max |reference|))",
              file=sys.stderr)
        return 1
    print("cuflash2 and jax.numpy agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
