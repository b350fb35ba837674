"""The FP8 (e4m3) forward's inputs and correctness rule (tests/gpu helper; no CuPy needed to
import it, and tests/test_fp8_forward_host.py runs it on NumPy arrays).

Inputs (`fp8_qkv`): standard-normal draws times a factor per (batch, KV head) (per tensor, or
none), quantised with `fp8.quantize_e4m3` by a descale that puts about 4 standard deviations at
e4m3's largest value, 448: the bits span e4m3's range, subnormals to saturation, and the
dequantised values (`e4m3 * descale`) are about N(0, factor^2), so the factors change the
softmax's sharpness too, not only the output's scale.

The rule (`check_forward_fp8`, docs/FP8_FORWARD.md "Accuracy"): flash-attn's 2x rule, as
`cuflash2.testing.check_close` applies it, with

- ref_hi: `reference.attention(..., qkv_dtype="e4m3", compute_dtype=float64)`, the float64
  attention of the dequantised inputs (its lse is the one the kernel's is checked against, by
  `testing.lse_close`);
- ref_lo: the same with `compute_dtype="e4m3"`: float32 maths with the unnormalised
  probabilities exp(s - max) rounded to e4m3 (P V's A operand, as the kernel rounds it) and the
  output rounded to `out_dtype` (bfloat16 by default, or float16);
- atol: `testing.default_atol(out.dtype)`.

`testing.check_forward` cannot serve: its references are float32 and q's dtype, which for uint8
bits would read them as integers.

Varlen (`fp8_varlen_qkv`, `check_varlen_forward_fp8`): the same draws for packed sequences, the
factors per (sequence, KV head) (FlashAttention-3's varlen descales), and the same rule against
`reference.attention_varlen(..., qkv_dtype="e4m3", ...)`.
"""

from __future__ import annotations

import numpy

from cuflash2 import fp8, reference, testing

#: The descale layouts of `fp8_qkv`: "none" (no descale arguments: the values are the e4m3
#: numbers themselves), "tensor" (one factor a tensor: q's of shape (), k's and v's (1,)),
#: "head" (float32 (batch, nheads_kv) each, FlashAttention-3's per-(sequence, KV head) factors).
DESCALE_KINDS = ("none", "tensor", "head")

#: Standard deviations of the draws that land on e4m3's largest finite value (448): a draw
#: beyond saturates there, which the reference sees as well (it reads the same bits).
SPAN_SIGMAS = 4.0


def fp8_qkv(xp, seed, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, descale="head",
            factors=(0.5, 2.0)):
    """(q, k, v, descales): uint8 e4m3 bits (batch, seqlen, heads, headdim), or without the
    batch dim for batch=None, on `xp` (numpy or cupy), and the call's descale keywords
    {"q_descale", "k_descale", "v_descale"} (float32 `xp` arrays, or None for "none").

    A tensor's values are standard normals times a factor drawn uniformly from `factors` per
    (batch, KV head) ("head"; a query head takes its KV head's, as the kernel reads q_descale) or
    per tensor ("tensor"); its descale is factor * SPAN_SIGMAS / 448. For "none" the values are
    standard normals rounded to e4m3 (descale 1)."""
    if descale not in DESCALE_KINDS:
        raise ValueError(f"descale must be one of {DESCALE_KINDS}; got {descale!r}")
    rng = numpy.random.default_rng(seed)
    rows = 1 if batch is None else batch
    group = nheads // nheads_kv
    bits, descales = [], {}
    for name, seqlen, heads in (("q", seqlen_q, nheads), ("k", seqlen_k, nheads_kv),
                                ("v", seqlen_k, nheads_kv)):
        values = rng.standard_normal((rows, seqlen, heads, headdim)).astype(numpy.float32)
        if descale == "none":
            bits.append(fp8.quantize_e4m3(values, 1.0))
            descales[f"{name}_descale"] = None
            continue
        if descale == "tensor":
            factor = numpy.float32(rng.uniform(*factors))
            per_head = numpy.full((rows, nheads_kv), factor, numpy.float32)
            # q's as a 0-d array, k's and v's as (1,): both shapes the call takes
            given = numpy.asarray(factor * SPAN_SIGMAS / fp8.E4M3_MAX, numpy.float32)
            if name != "q":
                given = given.reshape(1)
        else:
            per_head = rng.uniform(*factors, (rows, nheads_kv)).astype(numpy.float32)
            given = (per_head * numpy.float32(SPAN_SIGMAS / fp8.E4M3_MAX)).astype(numpy.float32)
        scale = numpy.repeat(per_head, group if name == "q" else 1, axis=1)[:, None, :, None]
        descale_of = numpy.repeat(numpy.broadcast_to(given, (rows, nheads_kv)),
                                  group if name == "q" else 1, axis=1)[:, None, :, None]
        bits.append(fp8.quantize_e4m3(values * scale, descale_of))
        descales[f"{name}_descale"] = xp.asarray(given)
    if batch is None:
        bits = [b[0] for b in bits]
    q, k, v = (xp.asarray(numpy.ascontiguousarray(b)) for b in bits)
    return q, k, v, descales


def fp8_references(q, k, v, *, out_dtype=None, **options):
    """(ref_hi, ref_lse, ref_lo) of an FP8 forward call: the float64 reference on the
    dequantised inputs with its lse, and the e4m3 reference in `out_dtype`. `options`: the
    call's causal, softmax_scale, window_size and q_descale / k_descale / v_descale."""
    ref_hi, ref_lse = reference.attention(q, k, v, qkv_dtype="e4m3", return_lse=True,
                                          compute_dtype=numpy.float64, **options)
    ref_lo = reference.attention(q, k, v, qkv_dtype="e4m3", compute_dtype="e4m3",
                                 out_dtype=out_dtype, **options)
    return ref_hi, ref_lse, ref_lo


def check_forward_fp8(q, k, v, out, lse=None, *, out_dtype=None, atol=None, **options):
    """The 2x rule for an FP8 forward's `out` (and its `lse`, if given) against the reference
    (module docstring). `out_dtype`: the call's (None: bfloat16); `options` as
    fp8_references'. Returns a list of testing.CheckResult: "out", then "lse"."""
    if out_dtype is not None and numpy.dtype(out.dtype) != numpy.dtype(out_dtype):
        raise ValueError(f"out is {numpy.dtype(out.dtype)} but out_dtype is "
                         f"{numpy.dtype(out_dtype)}")
    ref_hi, ref_lse, ref_lo = fp8_references(q, k, v, out_dtype=out_dtype, **options)
    results = [testing.check_close("out", out, ref_hi, ref_lo, atol)]
    if lse is not None:
        results.append(testing.lse_close(lse, ref_lse))
    return results


def describe(results) -> str:
    return "; ".join(map(str, results))


def fp8_varlen_qkv(xp, seed, lengths_q, lengths_k, nheads, nheads_kv, headdim, descale="head",
                   factors=(0.5, 2.0)):
    """(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), descales) of packed
    sequences: sequence b has lengths_q[b] query rows and lengths_k[b] keys (0 allowed). The
    draws are fp8_qkv's with the sequences as its batch (their longest lengths), sequence b's
    rows its first ones, so that the factors are per (sequence, KV head) with "head" (descales
    (num_sequences, nheads_kv)), per tensor with "tensor" (() and (1,)), none with "none".
    q, k, v: uint8 (total, heads, headdim); cu_seqlens int32 on `xp`."""
    if len(lengths_q) != len(lengths_k) or not lengths_q:
        raise ValueError(f"one query and one key length a sequence; got {lengths_q} and "
                         f"{lengths_k}")
    sequences = len(lengths_q)
    q, k, v, descales = fp8_qkv(numpy, seed, sequences, max(lengths_q), max(lengths_k), nheads,
                                nheads_kv, headdim, descale, factors)
    packed = [numpy.ascontiguousarray(numpy.concatenate(
        [x[b, :n] for b, n in enumerate(lengths)]))
        for x, lengths in ((q, lengths_q), (k, lengths_k), (v, lengths_k))]
    cus = [xp.asarray(numpy.cumsum([0, *lengths]).astype(numpy.int32))
           for lengths in (lengths_q, lengths_k)]
    q, k, v = (xp.asarray(x) for x in packed)
    descales = {name: None if d is None else xp.asarray(d) for name, d in descales.items()}
    return q, k, v, (*cus, max(lengths_q), max(lengths_k)), descales


def fp8_varlen_references(q, k, v, varlen_args, *, out_dtype=None, **options):
    """fp8_references of an attention_varlen call (`varlen_args`: cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k): the lse in flash-attn's (nheads, total_q) layout."""
    ref_hi, ref_lse = reference.attention_varlen(q, k, v, *varlen_args, qkv_dtype="e4m3",
                                                 return_lse=True, compute_dtype=numpy.float64,
                                                 **options)
    ref_lo = reference.attention_varlen(q, k, v, *varlen_args, qkv_dtype="e4m3",
                                        compute_dtype="e4m3", out_dtype=out_dtype, **options)
    return ref_hi, ref_lse, ref_lo


def check_varlen_forward_fp8(q, k, v, varlen_args, out, lse=None, *, out_dtype=None, atol=None,
                             **options):
    """check_forward_fp8 for an attention_varlen call (`varlen_args` as
    fp8_varlen_references')."""
    if out_dtype is not None and numpy.dtype(out.dtype) != numpy.dtype(out_dtype):
        raise ValueError(f"out is {numpy.dtype(out.dtype)} but out_dtype is "
                         f"{numpy.dtype(out_dtype)}")
    ref_hi, ref_lse, ref_lo = fp8_varlen_references(q, k, v, varlen_args, out_dtype=out_dtype,
                                                    **options)
    results = [testing.check_close("out", out, ref_hi, ref_lo, atol)]
    if lse is not None:
        results.append(testing.lse_close(lse, ref_lse))
    return results
