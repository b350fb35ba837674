"""The options of an attention call as one object.

Every public entry point takes the same options (causal, softmax_scale, window_size, softcap,
alibi_slopes, sinks, dropout_p, seed, offset; `bias`, issue 44's additive bias (the reference
functions read it here; the kernels' calls take it as a score modifier, cuflash2._bias);
`mask_mod`, `score_mod`, `block_mask`, issue 44's programmable modifiers (cuflash2.mods),
`bias_requires_grad`, whether a backward call returns dbias, and `precision`, float32's (None,
"highest", "high", "tf32": cuflash2._validate.kernel_element), and `qkv_dtype` and `out_dtype`,
the FP8 forward's (docs/FP8_FORWARD.md): the last slots, so that
positional constructions stay valid); each builds
one `AttentionOptions` from its keyword arguments per call, and the signature key
(`api._forward_key`, `_kvcache._key`: the window, the arrays' signatures, causal, softmax_scale,
softcap and dropout_p with their types; seed and offset are per-call values), the full check
(`_prepare.score_mods`, `_validate.check_window`), the plan builders and the per-call dropout
scalars read it; so do the reference functions (`reference._forward` / `_backward`, one options
object per dense call, `replace`d per varlen or KV-cache sequence) and the benchmarks (a
configuration's options, passed as `keywords()`). Built on every call, so it only stores the
values: checking them is the full check's job, once per call signature.
"""

from __future__ import annotations

from . import _prepare, _validate


class AttentionOptions:
    """causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, dropout_p, seed, offset
    and bias of one call, as given (unchecked)."""

    __slots__ = ("causal", "softmax_scale", "window_size", "softcap", "alibi_slopes", "sinks",
                 "dropout_p", "seed", "offset", "bias", "mask_mod", "score_mod", "block_mask",
                 "bias_requires_grad", "precision", "qkv_dtype", "out_dtype")

    def __init__(self, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, offset=0, bias=None,
                 mask_mod=None, score_mod=None, block_mask=None, bias_requires_grad=False,
                 precision=None, qkv_dtype=None, out_dtype=None):
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.window_size = window_size
        self.softcap = softcap
        self.alibi_slopes = alibi_slopes
        self.sinks = sinks
        self.dropout_p = dropout_p
        self.seed = seed
        self.offset = offset
        self.bias = bias
        self.mask_mod = mask_mod  # cuflash2.mods.MaskMod (the kernels: so far the forward's)
        self.score_mod = score_mod  # cuflash2.mods.ScoreMod
        self.block_mask = block_mask  # cuflash2.block_mask.BlockMask (its mask_mod is mask_mod)
        # A backward call that returns dbias (the kernels' plan: its float32 accumulator is the
        # call's last array; cuflash2._bias).
        self.bias_requires_grad = bias_requires_grad
        self.precision = precision  # float32 inputs' (None: "highest")
        # FP8 inputs (the forward): the format of q, k and v's bits ("e4m3"; None: their own
        # dtype's values) and out's dtype (None: bfloat16).
        self.qkv_dtype = qkv_dtype
        self.out_dtype = out_dtype

    def replace(self, **changes) -> "AttentionOptions":
        """A copy with the given options changed (the reference's per-sequence options: a
        varlen or KV-cache sequence's row of the ALiBi slopes)."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return AttentionOptions(**values)

    def keywords(self) -> dict:
        """The options that differ from their defaults, as keyword arguments of the public
        functions (the benchmarks pass one options object to every call of a row)."""
        return {name: getattr(self, name) for name in self.__slots__
                if not _same(getattr(self, name), getattr(_DEFAULTS, name))}

    def dropout_scalars(self) -> dict | None:
        """The per-call DropoutParams (`dropout.*` fields) of a call whose dropout_p was checked
        with its signature; seed and offset are checked here, on every call."""
        if self.dropout_p:
            fields = _prepare.dropout_fields(self.dropout_p, self.seed, self.offset)
            return {f"dropout.{name}": value for name, value in fields.items()}
        if self.seed is not None or self.offset != 0:
            _validate.check_dropout(self.dropout_p, self.seed, self.offset)
        return None

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"AttentionOptions({values})"


def _same(value, default) -> bool:
    # An array option (alibi_slopes, sinks, bias) is never equal to its default None; a scalar or a
    # tuple compares by value.
    if value is None or default is None:
        return value is default
    return type(value) is type(default) and value == default


_DEFAULTS = AttentionOptions()
