"""The public functions: validate (once per call signature), plan, compile (cached), launch.

Each function builds its call's signature key (`_plans`); the first call of a signature is
checked in full (`_prepare`, `_validate`) and planned (`_attention_plans`, `_kvcache`), later
ones reuse the plan and only read their arrays' addresses.
"""

from __future__ import annotations

import contextlib
import os

from . import (_attention_plans, _bias, _configs, _dispatch, _kvcache, _launch, _merge, _params,
               _plans, _prepare, _validate, fp8)
from ._options import AttentionOptions
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


# ---------------------------------------------------------------------------------------------
# The arrays of a call. An entry point passes Plan.run one tuple of arrays (its `inputs`); its
# layout names them in that order and says which are packed: a packed qkv feeds the q, k and v
# fields of the kernels' struct from byte offsets of one array, so the packed entry points differ
# from the others only in their layouts.

#: The struct fields of the arguments not named like their field.
_FIELDS = {"alibi_slopes": "mods.alibi_slopes", "sinks": "mods.sinks",
           "cu_seqlens_q": "varlen.cu_seqlens_q", "cu_seqlens_k": "varlen.cu_seqlens_k",
           **fp8.FORWARD_DESCALES}


class _Layout:
    """The input tuple of an entry point: its arrays' argument names in order (`names`), and
    for each packed argument the views it holds (`packed`, e.g. qkv=("q", "k", "v"))."""

    def __init__(self, *names, **packed):
        self.names = names
        self.packed = packed

    def arrays(self, inputs: tuple):
        """(views by struct field, sources: field -> (input position, array), arrays by
        argument name) of a call's `inputs`; packed arguments are checked and viewed here."""
        views, sources, names = {}, {}, {}
        for pos, (name, x) in enumerate(zip(self.names, inputs)):
            names[name] = x
            parts = self.packed.get(name)
            if parts is None:
                field = _FIELDS.get(name, name)
                views[field], sources[field] = x, (pos, x)
            else:
                for part, view in zip(parts, _unpack(name, x, len(parts))):
                    views[part], sources[part] = view, (pos, x)
        return views, sources, names


_ATTENTION = _Layout("q", "k", "v", "out", "alibi_slopes", "sinks")
#: attention with FP8 inputs: their descale factors after the others.
_FP8_ATTENTION = _Layout(*_ATTENTION.names, *fp8.FORWARD_DESCALES)
_QKVPACKED = _Layout("qkv", "out", "alibi_slopes", "sinks", qkv=("q", "k", "v"))
_KVPACKED = _Layout("q", "kv", "out", "alibi_slopes", "sinks", kv=("k", "v"))
_VARLEN = _Layout(*_ATTENTION.names, "cu_seqlens_q", "cu_seqlens_k")
#: attention_varlen with FP8 inputs: their descale factors after the others.
_FP8_VARLEN = _Layout(*_VARLEN.names, *fp8.FORWARD_DESCALES)
_BACKWARD = _Layout("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "alibi_slopes",
                    "sinks", "dsinks")
_QKVPACKED_BACKWARD = _Layout("dout", "qkv", "out", "lse", "dqkv", "alibi_slopes", "sinks",
                              "dsinks", qkv=("q", "k", "v"), dqkv=("dq", "dk", "dv"))
_KVPACKED_BACKWARD = _Layout("dout", "q", "kv", "out", "lse", "dq", "dkv", "alibi_slopes",
                             "sinks", "dsinks", kv=("k", "v"), dkv=("dk", "dv"))
_VARLEN_BACKWARD = _Layout(*_BACKWARD.names, "cu_seqlens_q", "cu_seqlens_k")


def _typed(names: dict) -> dict:
    """The arrays whose type require_cupy_arrays checks (cu_seqlens get their own message)."""
    return {n: x for n, x in names.items() if x is not None and not n.startswith("cu_seqlens")}


def _device_arrays(layout, views: dict, names: dict, tensor_names) -> tuple[dict, dict]:
    """(the arrays read in 16-byte chunks, by view name; the others, by argument name) of a
    call, for check_device."""
    tensors = {n: views[n] for n in tensor_names if views[n] is not None}
    others = {n: x for n, x in names.items() if x is not None and n not in tensors
              and n not in layout.packed}
    return tensors, others


def _kernels(plan) -> list[str]:
    return [_configs.describe(config) for config in plan.kernels]


# ---------------------------------------------------------------------------------------------
# Forward


def _forward_key(kind, cupy, arrays, options, extra=()):
    """The signature of an attention call: each array's shape, strides, dtype and device, the
    current device, and every other argument with its type (so that 1 and True differ). None
    where the call has none (a non-CuPy argument; the full check then says what is wrong)."""
    if cupy is None:
        return None
    key = [kind]
    if not _plans.add_signature(key, cupy.ndarray, arrays, options.window_size):
        return None
    # The current device only once every array is a CuPy one: a call with a NumPy array gets
    # the full check's message, also where CuPy finds no usable GPU.
    o = options  # its scalar options with their types (seed and offset: per call)
    key += (cupy.cuda.runtime.getDevice(), type(o.causal), o.causal, type(o.softmax_scale),
            o.softmax_scale, type(o.softcap), o.softcap, type(o.dropout_p), o.dropout_p,
            o.precision, o.qkv_dtype, o.out_dtype, *extra)
    return tuple(key)


def _plan_forward(layout, inputs, options, varlen_args=None):
    """Checks a forward call (its arrays `inputs`, as `layout` names them, then the programmable
    modifiers' arrays, and its `options`) in full and plans it."""
    views, sources, names = layout.arrays(inputs)
    user_inputs = tuple(enumerate(inputs[len(layout.names):], len(layout.names)))
    block_input, user_inputs = _block_input(options, user_inputs)
    q, k, v, out = views["q"], views["k"], views["v"], views["out"]
    cupy = _prepare.require_cupy_arrays(_typed(names))
    _prepare.check_flag("causal", options.causal)
    varlen = None
    if varlen_args is None:
        problem = _validate.check_attention_inputs(q, k, v, softmax_scale=options.softmax_scale,
                                                   out=out, qkv_dtype=options.qkv_dtype,
                                                   out_dtype=options.out_dtype)
        fp8.check_forward_descales({n: names.get(n) for n in fp8.FORWARD_DESCALES},
                                   options.qkv_dtype, problem.batch, problem.nheads_kv)
        lse_shape = ((problem.batch,) if problem.batched else ()) + (problem.nheads,
                                                                     problem.seqlen_q)
    else:
        packed, problem, varlen = _prepare.varlen_problem(q, k, v, *varlen_args[:4],
                                                          options.softmax_scale, out,
                                                          varlen_args[4], cupy,
                                                          options.qkv_dtype, options.out_dtype)
        # FP8 inputs: a factor per sequence and KV head (FlashAttention-3's varlen descales)
        fp8.check_forward_descales({n: names.get(n) for n in fp8.FORWARD_DESCALES},
                                   options.qkv_dtype, problem.batch, packed.nheads_kv,
                                   "num_sequences")
        lse_shape = (packed.nheads, packed.seqlen_q)
    problem = _prepare.with_kernel_element(problem, options)
    mods = _prepare.score_mods(problem, options)
    tensors, others = _device_arrays(layout, views, names, ("q", "k", "v", "out"))
    others.update(_prepare.user_mod_arrays(options.mask_mod, options.score_mod))
    device_id = _prepare.check_device(tensors, others, cupy)
    window = _validate.check_window(options.window_size, options.causal, problem.seqlen_q,
                                    problem.seqlen_k)
    return _attention_plans.forward_plan(views, sources, problem, mods, window, device_id,
                                         device_arch(device_id),
                                         _validate.output_shape(q.shape, problem.head_dim_v),
                                         lse_shape, varlen,
                                         user_inputs=user_inputs, block_input=block_input)


def _block_input(options, user_inputs: tuple) -> tuple:
    """(block_input, the other user inputs) of a call whose `user_inputs` ((position, array)
    after the layout's) end with its block mask's arrays (_with_user_mods): block_input is
    (position of the first, the BlockMask), None without one."""
    bm = getattr(options, "block_mask", None)
    if bm is None:
        return None, user_inputs
    count = len(bm.arrays)
    return (user_inputs[-count][0], bm), user_inputs[:-count]


def _with_user_mods(options, inputs: tuple, extra: tuple, mask_mod, score_mod, block_mask=None):
    """(inputs, signature key's extra) of a forward call with programmable modifiers: their
    arrays after the layout's (the mask's first; a block mask's, BlockMask.arrays, last), their
    sources (and the block mask's tiles and lengths) in the key. Checks their types (before any
    key is built); a block mask gives the mask modifier (cuflash2.block_masks.resolve)."""
    if block_mask is not None:
        from . import block_masks as _block_mask

        mask_mod = _block_mask.resolve(mask_mod, block_mask)
    _prepare.check_user_mods(mask_mod, score_mod)
    options.mask_mod, options.score_mod = mask_mod, score_mod
    options.block_mask = block_mask
    arrays = ((mask_mod.arrays if mask_mod is not None else ())
              + (score_mod.arrays if score_mod is not None else ()))
    keys = (mask_mod.key if mask_mod is not None else None,
            score_mod.key if score_mod is not None else None)
    if block_mask is not None:
        return inputs + arrays + block_mask.arrays, (*extra, "user_mods", keys, block_mask.key)
    return inputs + arrays, (*extra, "user_mods", keys)


def _check_backward_user_mods(function: str, mask_mod, score_mod, dropout_p) -> None:
    """What the backward of the programmable modifiers refuses, before any launch: a score
    modifier without a derivative (ValueError: pass grad=), and a score modifier with dropout
    (NotImplementedError: the main kernel's dropout bookkeeping needs dS's factor >= 0)."""
    _prepare.check_user_mods(mask_mod, score_mod)
    if score_mod is None:
        return
    from . import mods

    try:
        mods.check_backward(score_mod.source)
    except ValueError as exc:
        raise ValueError(f"{function}: {exc}") from None
    if isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise NotImplementedError(
            f"{function}: score_mod with dropout_p > 0 has no backward kernel yet (mask_mod "
            "with dropout has)")


def _with_backward_user_mods(function, options, inputs, extra, mask_mod, score_mod,
                             block_mask=None):
    """(inputs, signature key's extra) of a backward call with programmable modifiers, checked
    (_check_backward_user_mods), as _with_user_mods."""
    if block_mask is not None:
        from . import block_masks as _block_mask

        mask_mod = _block_mask.resolve(mask_mod, block_mask)
    _check_backward_user_mods(function, mask_mod, score_mod, options.dropout_p)
    return _with_user_mods(options, inputs, extra, mask_mod, score_mod, block_mask)


def _bias_view(q, k, v, bias, softmax_scale, varlen_args=None):
    """`bias` as the (batch, nheads, seqlen_q, seqlen_k) view the kernels read (cuflash2._bias),
    checked after the call's arrays (their messages come first). Varlen: batch = sequences, the
    maximum lengths (cu_seqlens' values are not read here)."""
    cupy = _prepare.require_cupy_arrays({"q": q, "k": k, "v": v})
    if varlen_args is None:
        p = _validate.check_attention_inputs(q, k, v, softmax_scale=softmax_scale)
    else:
        p = _prepare.varlen_problem(q, k, v, *varlen_args[:4], softmax_scale, None, False,
                                    cupy)[1]
    return _bias.bias_view(bias, p.batch, p.nheads, p.seqlen_q, p.seqlen_k, p.batched,
                           varlen_args is not None, cupy)


def _with_bias(function, options, inputs, extra, mask_mod, score_mod, bias, view,
               bias_requires_grad, deterministic=None, block_mask=None):
    """(inputs, signature key's extra, dbias's float32 accumulator or None) of a call with a
    bias: the bias as the score modifier (cuflash2._bias), after the user's modifiers are
    checked (with a block mask, its mask modifier), a block mask as _with_user_mods takes it; a
    backward (`deterministic` not None) that returns dbias gets its accumulator's (batch,
    nheads, seqlen_q, seqlen_k) view as its last array (after a block mask's arrays)."""
    if block_mask is not None:
        from . import block_masks as _block_mask

        mask_mod = _block_mask.resolve(mask_mod, block_mask)
    accum = None
    if deterministic is not None:  # a backward
        _bias.check_dropout(function, options.dropout_p)
        _check_backward_user_mods(function, mask_mod, score_mod, options.dropout_p)
        _prepare.check_flag("bias_requires_grad", bias_requires_grad)
        if bias_requires_grad:
            _bias.check_backward(function, bias, view, options.softcap, deterministic)
            accum, full = _bias.gradient_buffer(bias, view, _cupy or _cupy_module())
    else:
        _prepare.check_user_mods(mask_mod, score_mod)
    inputs, extra = _with_user_mods(options, inputs, extra, mask_mod,
                                    _bias.score_mod_with_bias(view, score_mod), block_mask)
    if accum is not None:
        options.bias_requires_grad = True
        inputs, extra = inputs + (full,), (*extra, "dbias")
    return inputs, extra, accum


def _forward_plan(kind, layout, cupy, inputs, options, extra=(), varlen_args=None):
    """(the plan of a forward call, whether it was made now: the call checked in full), from
    the cache or checked and made."""
    key = _forward_key(kind, cupy, inputs, options, extra)
    plan = _forward_plans.get(key)
    if plan is not None:
        return plan, False
    plan = _plan_forward(layout, inputs, options, varlen_args)
    _forward_plans.put(key, plan)
    return plan, True


def _forward_result(plan, inputs, options, out, return_lse, cupy):
    """Runs a forward plan, whose outputs are [out unless given, lse]."""
    given = out is not None
    outputs = plan.run(inputs, cupy, options.dropout_scalars(),
                       wrap=None if return_lse else 1 - given)
    if not given:
        out = outputs[0]
    return (out, outputs[-1]) if return_lse else out


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, offset=0,
              return_lse=False, out=None, mask_mod=None, score_mod=None, block_mask=None,
              bias=None, precision=None, qkv_dtype=None, q_descale=None, k_descale=None,
              v_descale=None, out_dtype=None):
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
    i and key j (after softcap, before masking), as flash-attn. `sinks`, a float32 CuPy array
    (nheads,), adds one learned logit per query head to every row's softmax denominator, with no
    value (gpt-oss's attention sinks). `dropout_p > 0` drops attention
    probabilities with a counter-based (Philox) mask drawn from `seed` (an int, required) and
    `offset`, the same in the backward; `cuflash2.dropout_mask` returns that mask. `out` receives
    the result if given.

    Returns `out` (shape and dtype of q), or `(out, lse)` with `return_lse=True`: lse is float32
    (batch, nheads, seqlen_q), the natural-log logsumexp of each row's scores as the softmax sees
    them (scaled, capped, biased; with sinks, the sink's exp counted too; +inf, with out 0, for
    a row that sees no key, or the sink's logit with sinks). Runs on the current CuPy stream,
    without host syncs.

    `mask_mod` (`cuflash2.mask_mod(expression, **inputs)`) and `score_mod`
    (`cuflash2.score_mod(expression, grad=None, **inputs)`): programmable masks and score
    modifiers, CUDA C expressions compiled into the forward kernel (cuflash2.mods; on sm_90 the
    Hopper forward takes a mask modifier, the mma.sync forward a score modifier; the score
    modifier after softcap and ALiBi, the mask ANDed with causal and the window).
    Their backward: attention_backward's `mask_mod=`, `score_mod=` (a score_mod needs `grad=`
    unless it is `score + <no score>`).

    `block_mask` (`cuflash2.block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, head_dim=,
    dtype=)`): the mask modifier's per-tile states, evaluated once: the kernel skips the empty
    tiles and runs the expression on the partial ones only. It carries its mask_mod (a
    `mask_mod=` given too must be the same); built for this call's tiles, lengths, batch and
    heads (or batch / nheads 1, shared) on its device, else ValueError (cuflash2.block_masks).

    `bias`: an additive bias, a CuPy array (batch or 1, nheads or 1, seqlen_q, seqlen_k) (for
    unbatched q (nheads or 1, seqlen_q, seqlen_k)) of float16, bfloat16 or float32, a dim of 1
    broadcast; added to the scaled scores after softcap and ALiBi, before `score_mod` and the
    mask (a score modifier, cuflash2._bias; on sm_90 a bias alone of q's dtype comes to the
    Hopper forward as tiles).

    float32 q, k, v (out float32) run on TF32 tensor cores at `precision`: "highest" (None, the
    default) splits every operand into two TF32 parts and sums three products (float32-level
    error), "high" or "tf32" rounds the operands and the probabilities to TF32 (10 mantissa
    bits; faster). Float32 calls take every option above but the programmable modifiers, the
    bias and block masks; attention_backward takes the same precision. 16-bit calls take
    precision=None.

    FP8 inputs (docs/FP8_FORWARD.md; sm_90, the Hopper forward): `qkv_dtype="e4m3"` reads q, k
    and v as e4m3 bits, uint8 arrays (or ml_dtypes.float8_e4m3fn ones where CuPy holds them;
    cuflash2.fp8.quantize_e4m3 makes them). `q_descale`, `k_descale`, `v_descale` (None: 1):
    float32 CuPy arrays (batch, nheads_kv) or () / (1,), the value of an element being
    e4m3 * descale (FlashAttention-3's convention: a query head takes its KV head's factor).
    `out_dtype`: float16 or bfloat16 (None: bfloat16); lse is that of the dequantised scores.
    Head dims 64, 128 and 256 (v's the same), causal masks, windows, GQA; no backward, softcap,
    ALiBi, sinks, dropout, bias or programmable modifiers (NotImplementedError naming them).
    The probabilities are rounded to e4m3 before P V, as FlashAttention-3's: the error is that
    of cuflash2.reference.attention(..., compute_dtype="e4m3").
    """
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision,
                               qkv_dtype=qkv_dtype, out_dtype=out_dtype)
    cupy = _cupy or _cupy_module()
    plan, inputs = _attention_plan(cupy, q, k, v, out, options, mask_mod, score_mod, block_mask,
                                   bias, (q_descale, k_descale, v_descale))
    return _forward_result(plan, inputs, options, out, return_lse, cupy)


def _attention_plan(cupy, q, k, v, out, options, mask_mod, score_mod, block_mask, bias,
                    descales=(None, None, None)):
    """(plan, inputs) of an `attention` call (forward_kernels' too); `descales`: q_descale,
    k_descale, v_descale (FP8 inputs)."""
    if options.qkv_dtype is not None or any(d is not None for d in descales):
        return _fp8_attention_plan(cupy, q, k, v, out, options, mask_mod, score_mod,
                                   block_mask, bias, descales)
    return _modified_forward_plan("attention", _ATTENTION, cupy,
                                  (q, k, v, out, options.alibi_slopes, options.sinks),
                                  lambda: (q, k, v), options, mask_mod, score_mod, block_mask,
                                  bias)


def _fp8_attention_plan(cupy, q, k, v, out, options, mask_mod, score_mod, block_mask, bias,
                        descales):
    """(plan, inputs) of an `attention` call with FP8 arguments: the descale factors after the
    other arrays (_FP8_ATTENTION), a factor not given a device array of 1 (one per device,
    fp8.unit_descale) where qkv_dtype is; descales without qkv_dtype are refused by the check."""
    for name, given in (("mask_mod", mask_mod), ("score_mod", score_mod),
                        ("block_mask", block_mask), ("bias", bias)):
        if given is not None and options.qkv_dtype is not None:
            raise NotImplementedError(f"{name}: not with FP8 (e4m3) inputs (causal masks and "
                                      f"windows are)")
    if options.qkv_dtype is not None and cupy is not None:
        descales = tuple(fp8.unit_descale(cupy) if d is None else d for d in descales)
    inputs = (q, k, v, out, options.alibi_slopes, options.sinks, *descales)
    return _forward_plan("attention", _FP8_ATTENTION, cupy, inputs, options)[0], inputs


def _modified_forward_plan(kind, layout, cupy, inputs, qkv, options, mask_mod, score_mod,
                           block_mask, bias):
    """(plan, inputs) of a forward call of `layout` (`inputs`: its arrays in the layout's
    order; `qkv()`: its q, k, v, for the bias's view) with its programmable modifiers, block
    mask and bias where given."""
    if bias is not None:
        view = _bias_view(*qkv(), bias, options.softmax_scale)
        inputs, extra, _ = _with_bias(kind, options, inputs, (), mask_mod, score_mod, bias, view,
                                      False, block_mask=block_mask)
    elif mask_mod is None and score_mod is None and block_mask is None:
        return _forward_plan(kind, layout, cupy, inputs, options)[0], inputs
    else:
        inputs, extra = _with_user_mods(options, inputs, (), mask_mod, score_mod, block_mask)
    return _forward_plan(kind, layout, cupy, inputs, options, extra)[0], inputs


def forward_kernels(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None,
                    offset=0, out=None, mask_mod=None, score_mod=None, block_mask=None,
                    bias=None, precision=None, qkv_dtype=None, q_descale=None, k_descale=None,
                    v_descale=None, out_dtype=None) -> list[str]:
    """The kernels `attention(q, k, v, ...)` with these arguments runs on the current device,
    in words: on an H100/H200 the Hopper forward (wgmma, TMA, warp specialisation) where it
    covers the call, the mma.sync forward otherwise. The call is checked and planned (the
    kernels compiled), nothing is launched."""
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision,
                               qkv_dtype=qkv_dtype, out_dtype=out_dtype)
    return _kernels(_attention_plan(_cupy_module(), q, k, v, out, options, mask_mod, score_mod,
                                    block_mask, bias, (q_descale, k_descale, v_descale))[0])


# ---------------------------------------------------------------------------------------------
# Backward


def _backward_key(kind, cupy, arrays, options, deterministic, extra=()):
    return _forward_key(kind, cupy, arrays, options, (value_key(deterministic), *extra))


def _plan_backward(layout, inputs, options, deterministic, varlen_args=None):
    """Checks a backward call in full and plans it (as _plan_forward; its arrays: dout, q, k,
    v, out, lse, the gradients given, the optional ones)."""
    views, sources, names = layout.arrays(inputs)
    user_inputs = tuple(enumerate(inputs[len(layout.names):], len(layout.names)))
    bias_grad = None
    if options.bias_requires_grad:  # dbias's accumulator comes last (cuflash2._bias)
        bias_grad, user_inputs = user_inputs[-1], user_inputs[:-1]
    block_input, user_inputs = _block_input(options, user_inputs)  # before dbias's
    q, k, v = views["q"], views["k"], views["v"]
    cupy = _prepare.require_cupy_arrays(_typed(names), "attention_backward")
    _prepare.check_flag("causal", options.causal)
    _prepare.check_flag("deterministic", deterministic)
    varlen = None
    if varlen_args is None:
        problem = _validate.check_attention_inputs(q, k, v, softmax_scale=options.softmax_scale)
        checked = problem
    else:
        checked, problem, varlen = _prepare.varlen_problem(q, k, v, *varlen_args[:4],
                                                           options.softmax_scale, None,
                                                           varlen_args[4], cupy)
    _validate.check_backward_inputs(checked, views["dout"], q, k, v, views["out"], views["lse"],
                                    dq=views["dq"], dk=views["dk"], dv=views["dv"])
    problem = _prepare.with_kernel_element(problem, options)
    window = _validate.check_window(options.window_size, options.causal, problem.seqlen_q,
                                    problem.seqlen_k)
    mods = _prepare.score_mods(problem, options)
    _validate.check_dsinks(views["dsinks"], options.sinks, problem.nheads)
    tensors, others = _device_arrays(
        layout, views, names, ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"))
    others.update(_prepare.user_mod_arrays(options.mask_mod, options.score_mod))
    device_id = _prepare.check_device(tensors, others, cupy)
    return _attention_plans.backward_plan(
        views, sources, problem, mods, window, bool(deterministic), device_id,
        device_arch(device_id), {"dq": q.shape, "dk": k.shape, "dv": v.shape}, varlen,
        user_inputs=user_inputs, bias_grad=bias_grad, block_input=block_input)


def _backward_plan(kind, layout, cupy, inputs, options, deterministic, extra=(),
                   varlen_args=None):
    """(the plan of a backward call, whether it was made now), as _forward_plan."""
    key = _backward_key(kind, cupy, inputs, options, deterministic, extra)
    plan = _backward_plans.get(key)
    if plan is not None:
        return plan, False
    plan = _plan_backward(layout, inputs, options, deterministic, varlen_args)
    _backward_plans.put(key, plan)
    return plan, True


def _gradients(outputs, given):
    """The gradients of a backward call: the arrays `given` to receive them, and for each None
    among them the next of the plan's `outputs` (allocated in that order)."""
    allocated = iter(outputs)
    return tuple(next(allocated) if x is None else x for x in given)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                       dropout_p=0.0, seed=None, offset=0, deterministic=False, dq=None,
                       dk=None, dv=None, dsinks=None, mask_mod=None, score_mod=None,
                       bias=None, bias_requires_grad=True, block_mask=None, precision=None):
    """Gradients (dq, dk, dv) of `attention(q, k, v, causal=..., softmax_scale=..., ...)` for the
    output gradient `dout`, from the forward's `out` and `lse` (`return_lse=True`); pass the
    forward's causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p, seed
    and offset.

    FlashAttention-2's backward: P is recomputed from lse, extra memory is O(seqlen) (an fp32 dq
    accumulator and two fp32 values per query row), never O(seqlen_q * seqlen_k). dq, dk, dv have
    the dtype and shapes of q, k, v (for GQA/MQA, dk and dv sum over the query heads sharing each
    KV head); `dq=`, `dk=`, `dv=` receive them if given. With `sinks` the result is
    (dq, dk, dv, dsinks), dsinks float32 (nheads,) (into `dsinks=` if given): one gradient a
    differentiable array argument of the forward, in its order. `deterministic=True` gives
    bitwise reproducible results (no floating-point atomics). Runs on the current CuPy stream.
    `mask_mod` / `score_mod`: the forward's (on sm_90 a mask modifier on the Hopper backward,
    a score modifier on the mma.sync one); a score_mod needs its derivative (`grad=`, or the
    form `score + <no score>`): ValueError otherwise, before any launch.

    `bias`: the forward's; with `bias_requires_grad=True` (the default) the result ends with
    dbias, shaped and typed like bias (summed over its broadcast dims): (dq, dk, dv[, dsinks],
    dbias). Not in the kernels yet (NotImplementedError, before any launch): dbias with softcap,
    a bias with dropout, and deterministic mode with a bias broadcast over batch or heads.

    `block_mask`: the forward's (cuflash2.block_mask); the main kernel then walks only the
    non-empty tiles of each key block's column and runs the mask modifier on the partial ones
    (the states' tiles must split into the backward's: those of `cuflash2.block_mask(...,
    head_dim=, dtype=)` for this call do, up to head dim 128).

    float32 dout, q, k, v, out (lse float32 as always) give float32 gradients on the mma.sync
    backward at `precision` (attention's: "highest", the default, or "high" / "tf32";
    docs/FLOAT32.md), deterministic too (up to head dim 128 on the 100 KiB parts:
    NotImplementedError above, before any launch); not with the options float32's forward does
    not take.
    """
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    cupy = _cupy or _cupy_module()
    plan, inputs, accum = _attention_backward_plan(
        cupy, (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, sinks, dsinks), options,
        deterministic, mask_mod, score_mod, block_mask, bias, bias_requires_grad)
    outputs = plan.run(inputs, cupy, options.dropout_scalars())
    grads = _gradients(outputs, (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks))
    return _with_dbias(grads, bias, accum)


def _attention_backward_plan(cupy, inputs, options, deterministic, mask_mod, score_mod,
                             block_mask, bias, bias_requires_grad):
    """(plan, inputs, dbias's accumulator or None) of an `attention_backward` call (`inputs`:
    its arrays in _BACKWARD's order; backward_kernels' too)."""
    return _modified_backward_plan("attention_backward", _BACKWARD, cupy, inputs,
                                   lambda: inputs[1:4], options, deterministic, mask_mod,
                                   score_mod, block_mask, bias, bias_requires_grad)


def _modified_backward_plan(kind, layout, cupy, inputs, qkv, options, deterministic, mask_mod,
                            score_mod, block_mask, bias, bias_requires_grad):
    """(plan, inputs, dbias's accumulator or None) of a backward call of `layout` (`inputs`:
    its arrays in the layout's order; `qkv()`: its q, k, v, for the bias's view) with its
    programmable modifiers, block mask and bias where given."""
    extra = ()
    accum = None
    if bias is not None:
        view = _bias_view(*qkv(), bias, options.softmax_scale)
        inputs, extra, accum = _with_bias(kind, options, inputs, extra, mask_mod, score_mod,
                                          bias, view, bias_requires_grad, deterministic,
                                          block_mask)
    elif mask_mod is not None or score_mod is not None or block_mask is not None:
        inputs, extra = _with_backward_user_mods(kind, options, inputs, extra, mask_mod,
                                                 score_mod, block_mask)
    plan, _ = _backward_plan(kind, layout, cupy, inputs, options, deterministic, extra)
    return plan, inputs, accum


def _with_dbias(grads: tuple, bias, accum) -> tuple:
    """A backward's gradients with dbias last, from its accumulator `accum` (typed and shaped
    like `bias`: _bias.gradient), where the call computed one (accum not None)."""
    return grads if accum is None else (*grads, _bias.gradient(bias, accum))


def backward_kernels(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                     dropout_p=0.0, seed=None, offset=0, deterministic=False, dq=None, dk=None,
                     dv=None, dsinks=None, mask_mod=None, score_mod=None, block_mask=None,
                     bias=None, bias_requires_grad=True, precision=None) -> list[str]:
    """The kernels `attention_backward(dout, q, k, v, out, lse, ...)` with these arguments runs
    on the current device, in words, in launch order: the preprocess, the main kernel (on an
    H100/H200 the Hopper backward where it covers the call (unless CUFLASH2_HOPPER_BWD=0), the
    mma.sync backward otherwise), then the dQ conversion (the dQ kernel in deterministic mode).
    The call is checked and planned (the kernels compiled), nothing is launched."""
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    return _kernels(_attention_backward_plan(
        _cupy_module(), (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, sinks, dsinks),
        options, deterministic, mask_mod, score_mod, block_mask, bias, bias_requires_grad)[0])


def attention_vjp(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, offset=0,
                  deterministic=False, mask_mod=None, score_mod=None, bias=None,
                  bias_requires_grad=True, block_mask=None, precision=None):
    """`(out, vjp)` like `jax.vjp`: runs the forward and returns `vjp(dout) -> (dq, dk, dv)`
    (with sinks `(dq, dk, dv, dsinks)`, with a bias and bias_requires_grad dbias last), which
    keeps the forward's lse (and out) internally. `mask_mod` / `score_mod` / `bias` as in
    `attention` and `attention_backward` (a score_mod without a derivative, and what the
    backward's dbias does not cover, are refused before the forward runs). `block_mask` serves
    both (cuflash2.block_mask, for the forward's tiles)."""
    if block_mask is not None:
        from . import block_masks as _block_mask

        mask_mod = _block_mask.resolve(mask_mod, block_mask)
    if mask_mod is not None or score_mod is not None:
        _check_backward_user_mods("attention_vjp", mask_mod, score_mod, dropout_p)
    if bias is not None:
        _bias.check_dropout("attention_vjp", dropout_p)
        view = _bias_view(q, k, v, bias, softmax_scale)
        if bias_requires_grad:
            _prepare.check_flag("bias_requires_grad", bias_requires_grad)
            _prepare.check_flag("deterministic", deterministic)
            _bias.check_backward("attention_vjp", bias, view, softcap, deterministic)
    if dropout_p and seed is None:  # the mask is kept inside, so a fresh seed will do
        seed = int.from_bytes(os.urandom(8), "little")
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                  seed=seed, offset=offset, precision=precision)
    if mask_mod is not None or score_mod is not None:
        kwargs.update(mask_mod=mask_mod, score_mod=score_mod)
    if block_mask is not None:
        kwargs.update(block_mask=block_mask)
    if bias is not None:
        kwargs.update(bias=bias)
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    if bias is not None:
        kwargs.update(bias_requires_grad=bias_requires_grad)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                  **kwargs)

    return out, vjp


# ---------------------------------------------------------------------------------------------
# Packed inputs: views into one array, no copies (the kernels take any strides whose last dim is
# contiguous). A plan reads q, k, v at fixed byte offsets of the packed array (_Layout).


def _unpack(name: str, packed, parts: int):
    """(batch, seqlen, parts, nheads, headdim) -> `parts` strided views, batched or not."""
    _prepare.require_cupy_arrays({name: packed})
    if packed.ndim not in (4, 5) or packed.shape[-3] != parts:
        layout = "(batch, seqlen, {p}, nheads, headdim) or (seqlen, {p}, nheads, headdim)"
        raise ValueError(f"{name} must have shape {layout.format(p=parts)}; got "
                         f"{tuple(packed.shape)}")
    return tuple(packed[..., i, :, :] for i in range(parts))


def attention_qkvpacked(qkv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None,
                        offset=0, return_lse=False, out=None, mask_mod=None, score_mod=None,
                        block_mask=None, bias=None, precision=None):
    """`attention` on q, k, v packed as qkv (batch, seqlen, 3, nheads, headdim), without copies;
    `mask_mod`, `score_mod`, `block_mask`, `bias` and `precision` as attention's."""
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    cupy = _cupy or _cupy_module()
    plan, inputs = _modified_forward_plan(
        "attention_qkvpacked", _QKVPACKED, cupy, (qkv, out, alibi_slopes, sinks),
        lambda: _unpack("qkv", qkv, 3), options, mask_mod, score_mod, block_mask, bias)
    return _forward_result(plan, inputs, options, out, return_lse, cupy)


def attention_kvpacked(q, kv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None,
                       offset=0, return_lse=False, out=None, mask_mod=None, score_mod=None,
                       block_mask=None, bias=None, precision=None):
    """`attention` with k, v packed as kv (batch, seqlen_k, 2, nheads_kv, headdim); `mask_mod`,
    `score_mod`, `block_mask`, `bias` and `precision` as attention's."""
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    cupy = _cupy or _cupy_module()
    plan, inputs = _modified_forward_plan(
        "attention_kvpacked", _KVPACKED, cupy, (q, kv, out, alibi_slopes, sinks),
        lambda: (q, *_unpack("kv", kv, 2)), options, mask_mod, score_mod, block_mask, bias)
    return _forward_result(plan, inputs, options, out, return_lse, cupy)


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
                                 sinks=None, dropout_p=0.0, seed=None, offset=0,
                                 deterministic=False, dqkv=None, dsinks=None, mask_mod=None,
                                 score_mod=None, bias=None, bias_requires_grad=True,
                                 block_mask=None, precision=None):
    """Gradient of `attention_qkvpacked`: dqkv shaped like qkv (written into `dqkv` if given);
    with sinks `(dqkv, dsinks)`; `mask_mod`, `score_mod`, `block_mask`, `bias` and
    `bias_requires_grad` as attention_backward's (dbias last)."""
    cupy = _cupy or _cupy_module()
    _prepare.require_cupy_arrays({"qkv": qkv})
    dqkv = _packed_gradient("dqkv", dqkv, qkv)
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    plan, inputs, accum = _modified_backward_plan(
        "attention_qkvpacked_backward", _QKVPACKED_BACKWARD, cupy,
        (dout, qkv, out, lse, dqkv, alibi_slopes, sinks, dsinks), lambda: _unpack("qkv", qkv, 3),
        options, deterministic, mask_mod, score_mod, block_mask, bias, bias_requires_grad)
    outputs = plan.run(inputs, cupy, options.dropout_scalars())
    grads = _with_dbias((dqkv,) if sinks is None else (dqkv, *_gradients(outputs, (dsinks,))),
                        bias, accum)
    return grads[0] if len(grads) == 1 else grads


def attention_kvpacked_backward(dout, q, kv, out, lse, *, causal=False, softmax_scale=None,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                sinks=None, dropout_p=0.0, seed=None, offset=0,
                                deterministic=False, dq=None, dkv=None, dsinks=None,
                                mask_mod=None, score_mod=None, bias=None,
                                bias_requires_grad=True, block_mask=None, precision=None):
    """Gradient of `attention_kvpacked`: (dq, dkv), dkv shaped like kv; with sinks
    `(dq, dkv, dsinks)`; `mask_mod`, `score_mod`, `block_mask`, `bias` and
    `bias_requires_grad` as attention_backward's (dbias last)."""
    cupy = _cupy or _cupy_module()
    _prepare.require_cupy_arrays({"kv": kv})
    dkv = _packed_gradient("dkv", dkv, kv)
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    plan, inputs, accum = _modified_backward_plan(
        "attention_kvpacked_backward", _KVPACKED_BACKWARD, cupy,
        (dout, q, kv, out, lse, dq, dkv, alibi_slopes, sinks, dsinks),
        lambda: (q, *_unpack("kv", kv, 2)), options, deterministic, mask_mod, score_mod,
        block_mask, bias, bias_requires_grad)
    outputs = plan.run(inputs, cupy, options.dropout_scalars())
    dq, *rest = _gradients(outputs, (dq,) if sinks is None else (dq, dsinks))
    return _with_dbias((dq, dkv, *rest), bias, accum)


# ---------------------------------------------------------------------------------------------
# Variable-length sequences packed into (total_tokens, nheads, headdim): flash-attn's varlen
# interface. The kernels see a zero batch stride, one batch entry per sequence, and read each
# sequence's rows from cu_seqlens (cuda_src/varlen.cuh); no padding token is computed.


def _check_cu_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, out, cupy, qkv_dtype=None, out_dtype=None):
    """check_cu_seqlens=True on a known signature: the values (one host sync) on every call."""
    _prepare.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, out, True, cupy, qkv_dtype, out_dtype)


def _varlen_key(max_seqlen_q, max_seqlen_k, check_cu_seqlens) -> tuple:
    return value_key(max_seqlen_q), value_key(max_seqlen_k), value_key(check_cu_seqlens)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, offset=0,
                     return_lse=False, out=None, check_cu_seqlens=True, mask_mod=None,
                     score_mod=None, bias=None, precision=None, qkv_dtype=None,
                     q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
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
    `mask_mod` / `score_mod` as in `attention`: b is the sequence's index, q_idx and kv_idx
    positions within the sequence. `bias`: (batch or 1, nheads or 1, max_seqlen_q,
    max_seqlen_k), sequence b reading bias[b, :, :seqlen_q_b, :seqlen_k_b]. `precision` as in
    `attention`.

    FP8 inputs as in `attention` (sm_90, the Hopper forward; docs/FP8_FORWARD.md):
    `qkv_dtype="e4m3"` with q, k, v packed uint8 (or float8_e4m3fn) arrays of e4m3 bits;
    `q_descale`, `k_descale`, `v_descale` float32 (num_sequences, nheads_kv), row b the factors
    of sequence b (FlashAttention-3's varlen descales), or () / (1,); `out_dtype` float16 or
    bfloat16 (None: bfloat16). Causal masks, windows and GQA; no softcap, ALiBi, sinks, dropout,
    bias or programmable modifiers, and at least one key in k. Its error is that of
    cuflash2.reference.attention_varlen(..., qkv_dtype="e4m3", compute_dtype="e4m3").
    """
    descales = (q_descale, k_descale, v_descale)
    plan, planned, inputs, options, cupy = _varlen_plan(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
        window_size, softcap, alibi_slopes, sinks, dropout_p, seed, offset, out,
        check_cu_seqlens, mask_mod, score_mod, bias, precision, qkv_dtype, descales, out_dtype)
    if not planned and check_cu_seqlens:
        _check_cu_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, out, cupy, qkv_dtype, out_dtype)
    return _forward_result(plan, inputs, options, out, return_lse, cupy)


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p, seed,
                 offset, out, check_cu_seqlens, mask_mod=None, score_mod=None, bias=None,
                 precision=None, qkv_dtype=None, descales=(None, None, None), out_dtype=None):
    """(plan of an attention_varlen call, whether it was planned now: the call checked in full,
    its inputs, its options, cupy) (varlen_forward_kernels names its kernels). `descales`:
    q_descale, k_descale, v_descale (FP8 inputs: after the other arrays, _FP8_VARLEN, a factor
    not given a device array of 1 where qkv_dtype is, as _fp8_attention_plan's)."""
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision,
                               qkv_dtype=qkv_dtype, out_dtype=out_dtype)
    inputs = (q, k, v, out, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k)
    cupy = _cupy or _cupy_module()
    extra = _varlen_key(max_seqlen_q, max_seqlen_k, check_cu_seqlens)
    if qkv_dtype is not None or any(d is not None for d in descales):
        for name, given in (("mask_mod", mask_mod), ("score_mod", score_mod), ("bias", bias)):
            if given is not None and qkv_dtype is not None:
                raise NotImplementedError(f"{name}: not with FP8 (e4m3) inputs (causal masks "
                                          f"and windows are)")
        if qkv_dtype is not None and cupy is not None:
            descales = tuple(fp8.unit_descale(cupy) if d is None else d for d in descales)
        plan, planned = _forward_plan(
            "attention_varlen", _FP8_VARLEN, cupy, inputs + tuple(descales), options, extra,
            (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens))
        return plan, planned, inputs + tuple(descales), options, cupy
    if bias is not None:
        view = _bias_view(q, k, v, bias, softmax_scale,
                          (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        inputs, extra, _ = _with_bias("attention_varlen", options, inputs, extra, mask_mod,
                                      score_mod, bias, view, False)
    elif mask_mod is not None or score_mod is not None:
        inputs, extra = _with_user_mods(options, inputs, extra, mask_mod, score_mod)
    plan, planned = _forward_plan(
        "attention_varlen", _VARLEN, cupy, inputs, options, extra,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens))
    return plan, planned, inputs, options, cupy


def varlen_forward_kernels(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, offset=0,
                           out=None, check_cu_seqlens=True, precision=None, qkv_dtype=None,
                           q_descale=None, k_descale=None, v_descale=None,
                           out_dtype=None) -> list[str]:
    """`forward_kernels` for `attention_varlen` with these arguments: the kernels it runs on the
    current device, in words. The call is checked and planned, nothing is launched."""
    plan = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p,
                        seed, offset, out, check_cu_seqlens, precision=precision,
                        qkv_dtype=qkv_dtype, descales=(q_descale, k_descale, v_descale),
                        out_dtype=out_dtype)[0]
    return _kernels(plan)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, softmax_scale=None,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                              dropout_p=0.0, seed=None, offset=0, deterministic=False, dq=None,
                              dk=None, dv=None, dsinks=None, check_cu_seqlens=True,
                              mask_mod=None, score_mod=None, bias=None, bias_requires_grad=True,
                              precision=None):
    """Gradients (dq, dk, dv), packed like q, k, v, of `attention_varlen` (same arguments) for
    the output gradient dout (total_q, nheads, headdim), from its out and lse (nheads, total_q).
    As `attention_backward` otherwise (with sinks: (dq, dk, dv, dsinks)); `mask_mod` /
    `score_mod` as in `attention_backward` (b the sequence's index); `bias` as in
    `attention_varlen`, dbias as in `attention_backward` (0 outside each sequence's lengths)."""
    options = AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                               dropout_p, seed, offset, precision=precision)
    inputs = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, sinks, dsinks, cu_seqlens_q,
              cu_seqlens_k)
    cupy = _cupy or _cupy_module()
    extra = _varlen_key(max_seqlen_q, max_seqlen_k, check_cu_seqlens)
    accum = None
    if bias is not None:
        view = _bias_view(q, k, v, bias, softmax_scale,
                          (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        inputs, extra, accum = _with_bias("attention_varlen_backward", options, inputs, extra,
                                          mask_mod, score_mod, bias, view, bias_requires_grad,
                                          deterministic)
    elif mask_mod is not None or score_mod is not None:
        inputs, extra = _with_backward_user_mods("attention_varlen_backward", options, inputs,
                                                 extra, mask_mod, score_mod)
    plan, planned = _backward_plan(
        "attention_varlen_backward", _VARLEN_BACKWARD, cupy, inputs, options, deterministic,
        extra,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens))
    if not planned and check_cu_seqlens:
        _check_cu_values(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, None, cupy)
    outputs = plan.run(inputs, cupy, options.dropout_scalars())
    grads = _gradients(outputs, (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks))
    return _with_dbias(grads, bias, accum)


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
# Merging attention results over disjoint keys by their lse: cuflash2/_merge.py,
# cuda_src/merge_states.cu (docs/MERGE_STATES.md).

_MERGE_NAMES = ("out_a", "lse_a", "out_b", "lse_b", "out", "lse")
_MERGE_MANY_NAMES = ("outs", "lses", "out", "lse")


def merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """The attention result over the union of two disjoint sets of keys, from the results over
    each (FlashInfer's `merge_state`): returns `(out, lse)` with

        lse = log(exp(lse_a) + exp(lse_b)),
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b,

    exactly what one call over all of the keys gives (up to rounding): shared-prefix (cascade)
    attention, a long key sequence split across calls or devices, a KV cache in pieces.

    out_a, out_b: attention outputs of the same queries, (batch, seqlen, nheads, headdim), or
    (seqlen, nheads, headdim) (unbatched, or varlen's (total_q, nheads, headdim)), of float16,
    bfloat16 or float32, the same shape and dtype. lse_a, lse_b: their float32 log-sum-exps as
    `attention(..., return_lse=True)`, attention_varlen and attention_with_kvcache return them:
    (batch, nheads, seqlen), or (nheads, seqlen) for 3-dim outs. The states must use the same
    softmax_scale (and softcap, ALiBi slopes) and keys apart from each other; give `sinks=` to
    one of the calls only (each call counts its sink in its lse).

    Computed in float32 from the stored values and rounded once to the states' dtype: the
    result is out in that dtype and lse float32, laid out as attention returns them (new
    contiguous arrays), or written into `out=` and `lse=` where given (shape and dtype as
    those, any strides as below). Merging in place: `out=out_a, lse=lse_a` (or the b ones); an
    output must be one of the states exactly (same address and strides) or memory apart from
    every input, else ValueError.

    A row that saw no key of a state (lse +inf, as attention writes it with out 0; -inf is
    read the same) weighs 0 there and that state's out row is not read; a row that saw no key
    of either gets out 0 and lse +inf, which attention_backward takes as attention's own.

    Strided arrays are read as they are: the outs' last dim contiguous and their other strides
    multiples of 16 bytes (any sign), their start 16-byte aligned; the lses any strides.
    Nothing is cast. Checked before any launch (TypeError, ValueError naming the argument);
    runs on the current CuPy stream, without host syncs.
    """
    return _merge.merge("merge_states", (out_a, lse_a, out_b, lse_b, out, lse), _MERGE_NAMES,
                        _cupy or _cupy_module())


def merge_states_many(outs, lses, *, out=None, lse=None):
    """merge_states of any number of states (FlashInfer's `merge_states`), stacked on a new
    leading dim: outs (num_states, batch, seqlen, nheads, headdim) or (num_states, seqlen,
    nheads, headdim), lses (num_states, batch, nheads, seqlen) or (num_states, nheads, seqlen),
    num_states >= 1. Returns `(out, lse)` of one state's shapes,

        lse = log sum_s exp(lses[s]),   out = sum_s exp(lses[s] - lse) * outs[s],

    with merge_states' rules (float32 arithmetic, rows without keys, `out=` / `lse=`, in place
    as `out=outs[s], lse=lses[s]`, strides, checks, stream).

    The states come first, each `outs[s]` an ordinary cuflash2 output: `attention(...,
    out=outs[s])` writes straight into the stack (no copy), and a stack of any strides is read
    as it is (a state stride is one more stride). FlashInfer's `merge_states` takes
    (seqlen, num_states, nheads, headdim) because its attention writes token-major rows without
    a batch dim; cuflash2's outputs are batched, so the state dim leads. The lses, which
    attention returns as new arrays, are stacked with `cupy.stack(lses)` (seqlen x nheads
    floats a state).
    """
    return _merge.merge("merge_states_many", (outs, lses, out, lse), _MERGE_MANY_NAMES,
                        _cupy or _cupy_module())


# ---------------------------------------------------------------------------------------------
# Inference with a KV cache (flash-attn's flash_attn_with_kvcache): cuflash2/_kvcache.py.


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           sinks=None, num_splits=0, return_lse=False, check_cache=False,
                           early_cache_reads=False, kv_cache_dtype=None, k_descale=None,
                           v_descale=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, cache_leftpad=None):
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
    with their lse in fp32. `sinks`: as `attention`'s. Returns out (shaped like q), or
    (out, lse (batch, nheads, seqlen_q)).

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
    (The promise covers k_descale and v_descale too.)

    FP8 cache (`kv_cache_dtype="e4m3"`; cuflash2.fp8, docs/FP8_KV_CACHE.md): k_cache and
    v_cache uint8 arrays of e4m3 bits (or float8_e4m3fn), head dim a multiple of 16, values
    e4m3 * k_descale / v_descale: float32 CuPy arrays (batch, nheads_kv) (a factor per sequence
    and KV head; broadcast views allowed), or () / (1,) for the whole cache (default: 1). q, k, v
    16-bit; the new tokens are stored as e4m3 bits of k / k_descale (nearest, saturated to
    +-448). The cache is read at one byte an element.

    Rotary (flash-attn's rules; docs/ROTARY.md): `rotary_cos`, `rotary_sin` (seqlen_ro,
    rotary_dim / 2) of q's dtype, C-contiguous, rotary_dim a multiple of 16 and <= headdim,
    seqlen_ro >= the cache's capacity; k and v must be given. The new keys are rotated at
    positions cache_seqlens[b] + i as they are appended (the cache holds them rotated; an FP8
    cache rotated, then quantised), q's row i at cache_seqlens[b] + i if causal or a window
    (an edge within the capacity), else every row at cache_seqlens[b]; in fp32, rounded to q's
    dtype. `rotary_interleaved` (default True, as flash-attn's): GPT-J pairs (0, 1), (2, 3), ...;
    False: GPT-NeoX halves (j with j + rotary_dim / 2). `cache_leftpad`: int32 (batch,), a
    contiguous cache only: sequence b's keys start at position cache_leftpad[b] (those before
    are not attended); cache_seqlens stays the end of its cached keys, and every position
    (appends, rotary, causal and window alignment, ALiBi) stays the cache's, as in flash-attn.
    (The promise of early_cache_reads covers cache_leftpad too.)
    """
    cache_options = (_kvcache.NO_CACHE_OPTIONS if rotary_cos is None and rotary_sin is None
                     and cache_leftpad is None and rotary_interleaved is True
                     else _kvcache.CacheOptions(rotary_cos, rotary_sin, rotary_interleaved,
                                                cache_leftpad))
    return _kvcache.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
        AttentionOptions(causal, softmax_scale, window_size, softcap, alibi_slopes, sinks),
        num_splits, return_lse, check_cache, early_cache_reads,
        (kv_cache_dtype, k_descale, v_descale), cache_options)


@contextlib.contextmanager
def _forced_config(config):
    """For tuning scripts: calls inside run `config` (a FwdConfig, FwdSm90Config or BwdConfig; a BwdConfig's
    compute_dq must match the calls' `not deterministic`) instead of the dispatcher's choice."""
    kind = ("fwd" if isinstance(config, (_configs.FwdConfig, _configs.FwdSm90Config))
            else "bwd")
    _dispatch.FORCED[kind] = config
    _forward_plans.plans.clear()
    _backward_plans.plans.clear()
    try:
        yield
    finally:
        del _dispatch.FORCED[kind]
        _forward_plans.plans.clear()
        _backward_plans.plans.clear()
