"""The public functions: validate (once per call signature), plan, compile (cached), launch.

Each function builds its call's signature key (`_plans`); the first call of a signature is
checked in full (`_prepare`, `_validate`) and planned (`_attention_plans`, `_kvcache`), later
ones reuse the plan and only read their arrays' addresses.
"""

from __future__ import annotations

import contextlib
import os

from . import _attention_plans, _configs, _kvcache, _launch, _params, _plans, _prepare, _validate
from ._plans import value_key
from ._prepare import device_arch  # noqa: F401  (part of the module's interface for tools)

_forward_plans = _plans.PlanCache()
_backward_plans = _plans.PlanCache()

_cupy = None


def _cupy_module():
    """CuPy, or None where it is not installed (the full check then says what to do)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError:
            return None
        _cupy = cupy
    return _cupy


def _dropout_scalars(dropout_p, seed, offset):
    """The per-call DropoutParams of a call whose dropout_p was checked with its signature;
    seed and offset are checked here, on every call."""
    if dropout_p:
        fields = _prepare.dropout_fields(dropout_p, seed, offset)
        return {f"dropout.{name}": value for name, value in fields.items()}
    if seed is not None or offset != 0:
        _validate.check_dropout(dropout_p, seed, offset)
    return None


# ---------------------------------------------------------------------------------------------
# Forward


def _typed(names: dict) -> dict:
    """The arrays whose type require_cupy_arrays checks (cu_seqlens get their own message)."""
    return {n: x for n, x in names.items() if x is not None and not n.startswith("cu_seqlens")}


def _forward_key(kind, cupy, arrays, causal, softmax_scale, window_size, softcap, dropout_p,
                 extra=()):
    """The signature of an attention call: each array's shape, strides, dtype and device, the
    current device, and every other argument with its type (so that 1 and True differ). None
    where the call has none (a non-CuPy argument; the full check then says what is wrong)."""
    if cupy is None:
        return None
    key = [kind]
    if not _plans.add_signature(key, cupy.ndarray, arrays, window_size):
        return None
    # The current device only once every array is a CuPy one: a call with a NumPy array gets
    # the full check's message, also where CuPy finds no usable GPU.
    key += (cupy.cuda.runtime.getDevice(), type(causal), causal, type(softmax_scale),
            softmax_scale, type(softcap), softcap, type(dropout_p), dropout_p, *extra)
    return tuple(key)


def _plan_forward(views, sources, names, causal, softmax_scale, window_size, softcap,
                  alibi_slopes, dropout_p, seed, offset, varlen_args=None):
    """Checks a forward call in full and plans it. `views`: q, k, v, out as the kernels see
    them; `names`: the call's arrays by argument name (for the type and device checks)."""
    q, k, v, out = views["q"], views["k"], views["v"], views["out"]
    cupy = _prepare.require_cupy_arrays(_typed(names))
    _prepare.check_flag("causal", causal)
    varlen = None
    if varlen_args is None:
        problem = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale, out=out)
        lse_shape = ((problem.batch,) if problem.batched else ()) + (problem.nheads,
                                                                     problem.seqlen_q)
    else:
        packed, problem, varlen = _prepare.varlen_problem(q, k, v, *varlen_args[:4],
                                                          softmax_scale, out, varlen_args[4],
                                                          cupy)
        lse_shape = (packed.nheads, packed.seqlen_q)
    mods = _prepare.score_mods(problem, softcap, alibi_slopes, dropout_p, seed, offset)
    tensors = {n: x for n, x in (("q", q), ("k", k), ("v", v), ("out", out)) if x is not None}
    others = {n: x for n, x in names.items() if x is not None and n not in tensors
              and n not in ("qkv", "kv")}
    device_id = _prepare.check_device(tensors, others, cupy)
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    return _attention_plans.forward_plan(
        {**views, "mods.alibi_slopes": alibi_slopes}, sources, problem, mods, window, device_id,
        device_arch(device_id), q.shape, lse_shape, varlen)


def _forward_result(plan, inputs, out, return_lse, dropout_p, seed, offset, cupy):
    """Runs a forward plan, whose outputs are [out unless given, lse]."""
    given = out is not None
    outputs = plan.run(inputs, cupy, _dropout_scalars(dropout_p, seed, offset),
                       wrap=None if return_lse else 1 - given)
    if not given:
        out = outputs[0]
    return (out, outputs[-1]) if return_lse else out


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, return_lse=False, out=None):
    """Exact attention softmax(q k^T * scale) v with FlashAttention-2 kernels.

    q: (batch, seqlen_q, nheads, headdim), k and v: (batch, seqlen_k, nheads_kv, headdim), or
    the same without the batch dim; CuPy arrays of float16 or bfloat16 (ml_dtypes.bfloat16),
    headdim a multiple of 8 up to 256, nheads a multiple of nheads_kv (MQA/GQA), only the last
    dim contiguous. `causal` masks keys after the query, aligned to the bottom-right corner when
    seqlen_q != seqlen_k (row i sees keys j <= i + seqlen_k - seqlen_q). `window_size=(left,
    right)` restricts row i to keys i + seqlen_k - seqlen_q - left ... + right (sliding-window
    attention, -1 unbounded; key tiles outside the window are skipped). `softmax_scale`
    defaults to 1/sqrt(headdim). `softcap > 0` caps the scaled scores to
    softcap * tanh(scores / softcap) (0: off). `alibi_slopes`, a float32 CuPy array (nheads,) or
    (batch, nheads), adds the bias -slope * |i + seqlen_k - seqlen_q - j| to the scores of query
    i and key j (after softcap, before masking), as flash-attn. `dropout_p > 0` drops attention
    probabilities with a counter-based (Philox) mask drawn from `seed` (an int, required) and
    `offset`, the same in the backward; `cuflash2.dropout_mask` returns that mask. `out` receives
    the result if given.

    Returns `out` (shape and dtype of q), or `(out, lse)` with `return_lse=True`: lse is float32
    (batch, nheads, seqlen_q), the natural-log logsumexp of each row's scores as the softmax sees
    them (scaled, capped, biased; +inf, with out 0, for a row that sees no key). Runs on the
    current CuPy stream, without host syncs.
    """
    cupy = _cupy_module()
    plan = _attention_plan(cupy, q, k, v, out, causal, softmax_scale, window_size, softcap,
                           alibi_slopes, dropout_p, seed, offset)
    return _forward_result(plan, (q, k, v, out, alibi_slopes), out, return_lse, dropout_p, seed,
                           offset, cupy)


def _attention_plan(cupy, q, k, v, out, causal, softmax_scale, window_size, softcap,
                    alibi_slopes, dropout_p, seed, offset):
    key = _forward_key("attention", cupy, (q, k, v, out, alibi_slopes), causal, softmax_scale,
                       window_size, softcap, dropout_p)
    plan = _forward_plans.get(key)
    if plan is None:
        sources = {"q": (0, q), "k": (1, k), "v": (2, v), "out": (3, out),
                   "mods.alibi_slopes": (4, alibi_slopes)}
        plan = _plan_forward({"q": q, "k": k, "v": v, "out": out}, sources,
                             {"q": q, "k": k, "v": v, "out": out, "alibi_slopes": alibi_slopes},
                             causal, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, seed, offset)
        _forward_plans.put(key, plan)
    return plan


def forward_kernels(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                    out=None) -> list[str]:
    """The kernels `attention(q, k, v, ...)` with these arguments runs on the current device,
    in words: on an H100/H200 the Hopper forward (wgmma, TMA, warp specialisation) where it
    covers the call, the mma.sync forward otherwise. The call is checked and planned (the
    kernels compiled), nothing is launched."""
    plan = _attention_plan(_cupy_module(), q, k, v, out, causal, softmax_scale, window_size,
                           softcap, alibi_slopes, dropout_p, seed, offset)
    return [_configs.describe(config) for config in plan.kernels]


# ---------------------------------------------------------------------------------------------
# Backward


def _backward_key(kind, cupy, arrays, causal, softmax_scale, window_size, softcap, dropout_p,
                  deterministic, extra=()):
    return _forward_key(kind, cupy, arrays, causal, softmax_scale, window_size, softcap,
                        dropout_p, (value_key(deterministic), *extra))


def _plan_backward(views, sources, names, causal, softmax_scale, window_size, softcap,
                   alibi_slopes, dropout_p, seed, offset, deterministic, varlen_args=None):
    """Checks a backward call in full and plans it (views as in _plan_forward, plus dout, out,
    lse and the given gradients)."""
    q, k, v = views["q"], views["k"], views["v"]
    cupy = _prepare.require_cupy_arrays(_typed(names))
    _prepare.check_flag("causal", causal)
    _prepare.check_flag("deterministic", deterministic)
    varlen = None
    if varlen_args is None:
        problem = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale)
        checked = problem
    else:
        checked, problem, varlen = _prepare.varlen_problem(q, k, v, *varlen_args[:4],
                                                           softmax_scale, None, varlen_args[4],
                                                           cupy)
    _validate.check_backward_inputs(checked, views["dout"], q, k, v, views["out"], views["lse"],
                                    dq=views["dq"], dk=views["dk"], dv=views["dv"])
    window = _validate.check_window(window_size, causal, problem.seqlen_q, problem.seqlen_k)
    mods = _prepare.score_mods(problem, softcap, alibi_slopes, dropout_p, seed, offset)
    tensor_names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    tensors = {n: views[n] for n in tensor_names if views[n] is not None}
    others = {n: x for n, x in names.items() if x is not None and n not in tensors
              and n not in ("qkv", "kv", "dqkv", "dkv")}
    device_id = _prepare.check_device(tensors, others, cupy)
    return _attention_plans.backward_plan(
        {**views, "mods.alibi_slopes": alibi_slopes}, sources, problem, mods, window,
        bool(deterministic), device_id, device_arch(device_id),
        {"dq": q.shape, "dk": k.shape, "dv": v.shape}, varlen)


def _gradients(outputs, dq, dk, dv):
    """(dq, dk, dv): the given arrays, the allocated ones in between."""
    allocated = iter(outputs)
    return tuple(next(allocated) if x is None else x for x in (dq, dk, dv))


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                       seed=None, offset=0, deterministic=False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of `attention(q, k, v, causal=..., softmax_scale=..., ...)` for the
    output gradient `dout`, from the forward's `out` and `lse` (`return_lse=True`); pass the
    forward's causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed and
    offset.

    FlashAttention-2's backward: P is recomputed from lse, extra memory is O(seqlen) (an fp32 dq
    accumulator and two fp32 values per query row), never O(seqlen_q * seqlen_k). dq, dk, dv have
    the dtype and shapes of q, k, v (for GQA/MQA, dk and dv sum over the query heads sharing each
    KV head); `dq=`, `dk=`, `dv=` receive them if given. `deterministic=True` gives bitwise
    reproducible results (no floating-point atomics). Runs on the current CuPy stream.
    """
    cupy = _cupy_module()
    inputs = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes)
    plan = _attention_backward_plan(cupy, inputs, causal, softmax_scale, window_size, softcap,
                                    dropout_p, seed, offset, deterministic)
    outputs = plan.run(inputs, cupy, _dropout_scalars(dropout_p, seed, offset))
    return _gradients(outputs, dq, dk, dv)


def _attention_backward_plan(cupy, inputs, causal, softmax_scale, window_size, softcap,
                             dropout_p, seed, offset, deterministic):
    """The plan of attention_backward's call on `inputs` (dout, q, k, v, out, lse, dq, dk, dv,
    alibi_slopes), from the cache or checked and made."""
    key = _backward_key("attention_backward", cupy, inputs, causal, softmax_scale, window_size,
                        softcap, dropout_p, deterministic)
    plan = _backward_plans.get(key)
    if plan is None:
        names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
        views = dict(zip(names, inputs))
        sources = {n: (i, x) for i, (n, x) in enumerate(zip(names, inputs))}
        sources["mods.alibi_slopes"] = (9, inputs[9])
        plan = _plan_backward(views, sources, {**views, "alibi_slopes": inputs[9]}, causal,
                              softmax_scale, window_size, softcap, inputs[9], dropout_p, seed,
                              offset, deterministic)
        _backward_plans.put(key, plan)
    return plan


def backward_kernels(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     seed=None, offset=0, deterministic=False, dq=None, dk=None,
                     dv=None) -> list[str]:
    """The kernels `attention_backward(dout, q, k, v, out, lse, ...)` with these arguments runs
    on the current device, in words, in launch order: the preprocess, the main kernel (on an
    H100/H200 the Hopper backward where it covers the call (unless CUFLASH2_HOPPER_BWD=0), the
    mma.sync backward otherwise), then the dQ conversion (the dQ kernel in deterministic mode).
    The call is checked and planned (the kernels compiled), nothing is launched."""
    inputs = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes)
    plan = _attention_backward_plan(_cupy_module(), inputs, causal, softmax_scale, window_size,
                                    softcap, dropout_p, seed, offset, deterministic)
    return [_configs.describe(config) for config in plan.kernels]


def attention_vjp(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                  deterministic=False):
    """`(out, vjp)` like `jax.vjp`: runs the forward and returns `vjp(dout) -> (dq, dk, dv)`,
    which keeps the forward's lse (and out) internally."""
    if dropout_p and seed is None:  # the mask is kept inside, so a fresh seed will do
        seed = int.from_bytes(os.urandom(8), "little")
    out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         dropout_p=dropout_p, seed=seed, offset=offset, return_lse=True)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, seed=seed, offset=offset,
                                  deterministic=deterministic)

    return out, vjp


# ---------------------------------------------------------------------------------------------
# Packed inputs: views into one array, no copies (the kernels take any strides whose last dim is
# contiguous). A plan reads q, k, v at fixed byte offsets of the packed array.


def _unpack(name: str, packed, parts: int):
    """(batch, seqlen, parts, nheads, headdim) -> `parts` strided views, batched or not."""
    _prepare.require_cupy_arrays({name: packed})
    if packed.ndim not in (4, 5) or packed.shape[-3] != parts:
        layout = "(batch, seqlen, {p}, nheads, headdim) or (seqlen, {p}, nheads, headdim)"
        raise ValueError(f"{name} must have shape {layout.format(p=parts)}; got "
                         f"{tuple(packed.shape)}")
    return tuple(packed[..., i, :, :] for i in range(parts))


def attention_qkvpacked(qkv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                        return_lse=False, out=None):
    """`attention` on q, k, v packed as qkv (batch, seqlen, 3, nheads, headdim), without copies."""
    cupy = _cupy_module()
    key = _forward_key("attention_qkvpacked", cupy, (qkv, out, alibi_slopes), causal,
                       softmax_scale, window_size, softcap, dropout_p)
    plan = _forward_plans.get(key)
    if plan is None:
        q, k, v = _unpack("qkv", qkv, 3)
        sources = {"q": (0, qkv), "k": (0, qkv), "v": (0, qkv), "out": (1, out),
                   "mods.alibi_slopes": (2, alibi_slopes)}
        plan = _plan_forward({"q": q, "k": k, "v": v, "out": out}, sources,
                             {"qkv": qkv, "out": out, "alibi_slopes": alibi_slopes}, causal,
                             softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed,
                             offset)
        _forward_plans.put(key, plan)
    return _forward_result(plan, (qkv, out, alibi_slopes), out, return_lse, dropout_p, seed,
                           offset, cupy)


def attention_kvpacked(q, kv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                       return_lse=False, out=None):
    """`attention` with k, v packed as kv (batch, seqlen_k, 2, nheads_kv, headdim)."""
    cupy = _cupy_module()
    key = _forward_key("attention_kvpacked", cupy, (q, kv, out, alibi_slopes), causal,
                       softmax_scale, window_size, softcap, dropout_p)
    plan = _forward_plans.get(key)
    if plan is None:
        k, v = _unpack("kv", kv, 2)
        sources = {"q": (0, q), "k": (1, kv), "v": (1, kv), "out": (2, out),
                   "mods.alibi_slopes": (3, alibi_slopes)}
        plan = _plan_forward({"q": q, "k": k, "v": v, "out": out}, sources,
                             {"q": q, "kv": kv, "out": out, "alibi_slopes": alibi_slopes},
                             causal, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, seed, offset)
        _forward_plans.put(key, plan)
    return _forward_result(plan, (q, kv, out, alibi_slopes), out, return_lse, dropout_p, seed,
                           offset, cupy)


def _packed_gradient(name: str, given, packed):
    """The packed gradient array `name` (`given`, checked, or a new one shaped like `packed`)."""
    cupy = _prepare.cupy_module()
    if given is None:
        return cupy.empty(packed.shape, dtype=packed.dtype)
    if (not isinstance(given, cupy.ndarray) or given.shape != packed.shape
            or given.dtype != packed.dtype):
        like = "qkv" if name == "dqkv" else "kv"
        raise ValueError(f"{name} must be a cupy array shaped and typed like {like} "
                         f"{tuple(packed.shape)} {packed.dtype}")
    return given


def attention_qkvpacked_backward(dout, qkv, out, lse, *, causal=False, softmax_scale=None,
                                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                 dropout_p=0.0, seed=None, offset=0, deterministic=False,
                                 dqkv=None):
    """Gradient of `attention_qkvpacked`: dqkv shaped like qkv (written into `dqkv` if given)."""
    cupy = _cupy_module()
    _prepare.require_cupy_arrays({"qkv": qkv})
    dqkv = _packed_gradient("dqkv", dqkv, qkv)
    inputs = (dout, qkv, out, lse, dqkv, alibi_slopes)
    key = _backward_key("attention_qkvpacked_backward", cupy, inputs, causal, softmax_scale,
                        window_size, softcap, dropout_p, deterministic)
    plan = _backward_plans.get(key)
    if plan is None:
        q, k, v = _unpack("qkv", qkv, 3)
        dq, dk, dv = _unpack("dqkv", dqkv, 3)
        views = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq,
                 "dk": dk, "dv": dv}
        sources = {"dout": (0, dout), "q": (1, qkv), "k": (1, qkv), "v": (1, qkv),
                   "out": (2, out), "lse": (3, lse), "dq": (4, dqkv), "dk": (4, dqkv),
                   "dv": (4, dqkv), "mods.alibi_slopes": (5, alibi_slopes)}
        names = {"dout": dout, "qkv": qkv, "out": out, "lse": lse, "dqkv": dqkv,
                 "alibi_slopes": alibi_slopes}
        plan = _plan_backward(views, sources, names, causal, softmax_scale, window_size, softcap,
                              alibi_slopes, dropout_p, seed, offset, deterministic)
        _backward_plans.put(key, plan)
    plan.run(inputs, cupy, _dropout_scalars(dropout_p, seed, offset))
    return dqkv


def attention_kvpacked_backward(dout, q, kv, out, lse, *, causal=False, softmax_scale=None,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                dropout_p=0.0, seed=None, offset=0, deterministic=False,
                                dq=None, dkv=None):
    """Gradient of `attention_kvpacked`: (dq, dkv), dkv shaped like kv."""
    cupy = _cupy_module()
    _prepare.require_cupy_arrays({"kv": kv})
    dkv = _packed_gradient("dkv", dkv, kv)
    inputs = (dout, q, kv, out, lse, dq, dkv, alibi_slopes)
    key = _backward_key("attention_kvpacked_backward", cupy, inputs, causal, softmax_scale,
                        window_size, softcap, dropout_p, deterministic)
    plan = _backward_plans.get(key)
    if plan is None:
        k, v = _unpack("kv", kv, 2)
        dk, dv = _unpack("dkv", dkv, 2)
        views = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq,
                 "dk": dk, "dv": dv}
        sources = {"dout": (0, dout), "q": (1, q), "k": (2, kv), "v": (2, kv), "out": (3, out),
                   "lse": (4, lse), "dq": (5, dq), "dk": (6, dkv), "dv": (6, dkv),
                   "mods.alibi_slopes": (7, alibi_slopes)}
        names = {"dout": dout, "q": q, "kv": kv, "out": out, "lse": lse, "dq": dq, "dkv": dkv,
                 "alibi_slopes": alibi_slopes}
        plan = _plan_backward(views, sources, names, causal, softmax_scale, window_size, softcap,
                              alibi_slopes, dropout_p, seed, offset, deterministic)
        _backward_plans.put(key, plan)
    outputs = plan.run(inputs, cupy, _dropout_scalars(dropout_p, seed, offset))
    return (outputs[0] if dq is None else dq), dkv


# ---------------------------------------------------------------------------------------------
# Variable-length sequences packed into (total_tokens, nheads, headdim): flash-attn's varlen
# interface. The kernels see a zero batch stride, one batch entry per sequence, and read each
# sequence's rows from cu_seqlens (cuda_src/varlen.cuh); no padding token is computed.


def _check_cu_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, out, cupy):
    """check_cu_seqlens=True on a known signature: the values (one host sync) on every call."""
    _prepare.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, out, True, cupy)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, return_lse=False,
                     out=None, check_cu_seqlens=True):
    """`attention` on variable-length sequences packed one after another (flash-attn's
    `flash_attn_varlen_func`).

    q: (total_q, nheads, headdim), k and v: (total_k, nheads_kv, headdim); sequence b is rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] .. of k and v.
    cu_seqlens_q/k: int32 CuPy arrays (batch + 1,), 0 first, non-decreasing, ending at
    total_q/total_k. max_seqlen_q/k: ints, at least the longest sequence (they size the grid).
    Causal masks and windows are bottom-right aligned per sequence; alibi_slopes may be
    (batch, nheads), row b for sequence b. Returns out (total_q, nheads, headdim), or
    (out, lse) with lse float32 (nheads, total_q) as flash-attn.

    `check_cu_seqlens=True` copies cu_seqlens to the host to check their values and the max
    lengths: one device synchronisation. With False nothing is synchronised and bad values give
    undefined results (never out-of-bounds accesses: the kernels clamp to the packed lengths).
    """
    cupy = _cupy_module()
    inputs = (q, k, v, out, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
    plan, planned = _varlen_plan(cupy, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal, softmax_scale, window_size, softcap,
                                 alibi_slopes, dropout_p, seed, offset, out, check_cu_seqlens)
    if not planned and check_cu_seqlens:
        _check_cu_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, out, cupy)
    return _forward_result(plan, inputs, out, return_lse, dropout_p, seed, offset, cupy)


def _varlen_plan(cupy, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, offset, out,
                 check_cu_seqlens):
    """(plan of an attention_varlen call, whether it was planned now: the call checked in full)
    (varlen_forward_kernels names its kernels)."""
    inputs = (q, k, v, out, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
    key = _forward_key("attention_varlen", cupy, inputs, causal, softmax_scale, window_size,
                       softcap, dropout_p, (value_key(max_seqlen_q), value_key(max_seqlen_k),
                                            value_key(check_cu_seqlens)))
    plan = _forward_plans.get(key)
    if plan is None:
        names = {"q": q, "k": k, "v": v, "out": out, "alibi_slopes": alibi_slopes,
                 "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        sources = {"q": (0, q), "k": (1, k), "v": (2, v), "out": (3, out),
                   "mods.alibi_slopes": (4, alibi_slopes),
                   "varlen.cu_seqlens_q": (5, cu_seqlens_q),
                   "varlen.cu_seqlens_k": (6, cu_seqlens_k)}
        views = {"q": q, "k": k, "v": v, "out": out, "varlen.cu_seqlens_q": cu_seqlens_q,
                 "varlen.cu_seqlens_k": cu_seqlens_k}
        plan = _plan_forward(views, sources, names, causal, softmax_scale, window_size, softcap,
                             alibi_slopes, dropout_p, seed, offset,
                             (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              check_cu_seqlens))
        _forward_plans.put(key, plan)
        return plan, True
    return plan, False


def varlen_forward_kernels(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, out=None,
                           check_cu_seqlens=True) -> list[str]:
    """`forward_kernels` for `attention_varlen` with these arguments: the kernels it runs on the
    current device, in words. The call is checked and planned, nothing is launched."""
    plan, _ = _varlen_plan(_cupy_module(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, softmax_scale, window_size, softcap,
                           alibi_slopes, dropout_p, seed, offset, out, check_cu_seqlens)
    return [_configs.describe(config) for config in plan.kernels]


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, softmax_scale=None,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              dropout_p=0.0, seed=None, offset=0, deterministic=False, dq=None,
                              dk=None, dv=None, check_cu_seqlens=True):
    """Gradients (dq, dk, dv), packed like q, k, v, of `attention_varlen` (same arguments) for
    the output gradient dout (total_q, nheads, headdim), from its out and lse (nheads, total_q).
    As `attention_backward` otherwise."""
    cupy = _cupy_module()
    inputs = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
    key = _backward_key("attention_varlen_backward", cupy, inputs, causal, softmax_scale,
                        window_size, softcap, dropout_p, deterministic,
                        (value_key(max_seqlen_q), value_key(max_seqlen_k),
                         value_key(check_cu_seqlens)))
    plan = _backward_plans.get(key)
    if plan is None:
        names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
        views = dict(zip(names, inputs))
        sources = {n: (i, x) for i, (n, x) in enumerate(zip(names, inputs))}
        sources.update({"mods.alibi_slopes": (9, alibi_slopes),
                        "varlen.cu_seqlens_q": (10, cu_seqlens_q),
                        "varlen.cu_seqlens_k": (11, cu_seqlens_k)})
        arrays = {**views, "alibi_slopes": alibi_slopes, "cu_seqlens_q": cu_seqlens_q,
                  "cu_seqlens_k": cu_seqlens_k}
        views.update({"varlen.cu_seqlens_q": cu_seqlens_q, "varlen.cu_seqlens_k": cu_seqlens_k})
        plan = _plan_backward(views, sources, arrays, causal, softmax_scale, window_size, softcap,
                              alibi_slopes, dropout_p, seed, offset, deterministic,
                              (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               check_cu_seqlens))
        _backward_plans.put(key, plan)
    elif check_cu_seqlens:
        _check_cu_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, None, cupy)
    outputs = plan.run(inputs, cupy, _dropout_scalars(dropout_p, seed, offset))
    return _gradients(outputs, dq, dk, dv)


def dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, offset=0):
    """The dropout keep-mask that `attention(..., dropout_p=dropout_p, seed=seed, offset=offset)`
    applies, as a bool CuPy array (batch, nheads, seqlen_q, seqlen_k) (True = kept): for tests
    (`cuflash2.reference.attention(..., dropout_p=..., dropout_mask=mask)` reproduces the call)
    and small shapes, since it materialises every (query, key) pair. For varlen calls, pass the
    number of sequences and the maximum lengths; sequence b uses [b, :, :seqlen_q_b, :seqlen_k_b].
    """
    for name, value in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q),
                        ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    fields = _prepare.dropout_fields(dropout_p, seed, offset)
    if not fields:
        raise ValueError("dropout_mask needs dropout_p > 0 (with dropout_p = 0 every element is "
                         "kept)")
    cupy = _prepare.cupy_module()
    mask = cupy.empty((batch, nheads, seqlen_q, seqlen_k), dtype=cupy.bool_)
    if mask.size == 0:
        return mask
    config = _configs.DropoutMaskKernel()
    blocks = -(-seqlen_q // 16) * -(-seqlen_k // 16)
    device_id = cupy.cuda.Device().id
    block = _params.ParamBlock("DropoutMaskParams", {
        "mask": mask.data.ptr, "nheads": nheads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
        **{f"dropout.{name}": value for name, value in fields.items()}})
    launch = _launch.kernel_launch(config, device_id,
                                   (-(-blocks // config.blocks_per_cta), nheads, batch))
    _launch.run(launch, block, cupy.cuda.get_current_stream().ptr, block.slot("batch_offset"))
    return mask


# ---------------------------------------------------------------------------------------------
# Inference with a KV cache (flash-attn's flash_attn_with_kvcache): cuflash2/_kvcache.py.


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           num_splits=0, return_lse=False, check_cache=False,
                           early_cache_reads=False):
    """Attention of q against a KV cache, for inference (flash-attn's `flash_attn_with_kvcache`).

    q: (batch, seqlen_q, nheads, headdim). Contiguous cache: k_cache, v_cache (batch_cache,
    seqlen_cache, nheads_kv, headdim), sequence b in row `cache_batch_idx[b]` (int32, default b).
    Paged cache: (num_blocks, page_size, nheads_kv, headdim) with `block_table` int32
    (batch, max_blocks): position p of sequence b is row p % page_size of block
    block_table[b, p // page_size]. `cache_seqlens`: int or int32 (batch,), the tokens already
    cached (default: the whole capacity). `k`, `v` (batch, seqlen_new, nheads_kv, headdim): new
    tokens, written into the cache **in place** at cache_seqlens[b] .. before the attention over
    the first cache_seqlens[b] + seqlen_new positions (causal / windows bottom-right aligned).
    `num_splits`: KV splits (0: chosen to fill the GPU; 1: none); partial results are merged
    with their lse in fp32. Returns out (shaped like q), or (out, lse (batch, nheads, seqlen_q)).

    No host synchronisation: values are not checked unless `check_cache=True` (one sync), and
    unchecked bad values never cause out-of-bounds accesses: positions past the capacity are
    neither written nor read, and a block id or cache row outside the cache reads as zeros and
    is not written.

    `early_cache_reads=True` promises that the kernel queued just before this call on the
    stream writes none of k_cache, v_cache, cache_seqlens, cache_batch_idx and block_table (it
    may write q, k, v: a serving loop's step, whose previous kernel computes them, qualifies;
    two calls on the same cache back to back do not). Where that kernel lets its successor
    start before it has waited for its own predecessor (a programmatic launch that triggers
    first, as the stand-in between layers of `bench --decode` does), that predecessor may still
    run too, and the promise covers it: two calls on the same cache with only such kernels
    between them do not qualify either. On sm_90, where the kernel starts while the previous
    one finishes (a programmatic launch), it then reads the lengths and its first cache tiles
    before that kernel has ended, instead of after. If the promise is broken, the results may
    come from the cache as it was before that kernel's writes. Elsewhere it changes nothing.
    """
    return _kvcache.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
        causal, window_size, softcap, alibi_slopes, num_splits, return_lse, check_cache,
        early_cache_reads)


@contextlib.contextmanager
def _forced_config(config):
    """For tuning scripts: calls inside run `config` (a FwdConfig or BwdConfig; a BwdConfig's
    compute_dq must match the calls' `not deterministic`) instead of the dispatcher's choice."""
    kind = "fwd" if isinstance(config, _configs.FwdConfig) else "bwd"
    _attention_plans.FORCED[kind] = config
    _forward_plans.plans.clear()
    _backward_plans.plans.clear()
    try:
        yield
    finally:
        del _attention_plans.FORCED[kind]
        _forward_plans.plans.clear()
        _backward_plans.plans.clear()
