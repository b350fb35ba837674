"""Programmable masks and score modifiers (issue 44): CUDA C expressions compiled into the kernels.

    doc = cupy.asarray(document_ids, dtype=cupy.int32)          # (seqlen,)
    mask = cuflash2.mask_mod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc)
    out = cuflash2.attention(q, k, v, mask_mod=mask)

- `mask_mod(expression, **inputs)`: a boolean CUDA C expression over `b` (the batch entry; a
  varlen call's sequence), `h` (the query head), `q_idx`, `kv_idx` (positions within the
  sequence, ints) and the named inputs. ANDed with causal and the window; a row it leaves without
  keys gives out 0 and lse +inf (or the sink), as the built-in masks.
- `score_mod(expression, grad=None, **inputs)`: a float expression over `score` (the score as
  the softmax sees it: scaled, capped, with the ALiBi bias), `b`, `h`, `q_idx`, `kv_idx` and the
  inputs, giving the new score; applied before the mask. `grad` is d new / d score, for the
  backward (a float expression over the same names, evaluated at the score the modifier
  took): absent, `score + <expression without score>` has derivative 1 and any other
  expression will be refused by the backward.
- Inputs: read-only CuPy arrays of int32, int64, float32, float16 or bfloat16, of 1 to 4 dims
  (`doc[i]` or `doc(i)` for one dim, `table(i, j)` for more; fp16/bf16/fp32 elements read as
  float, integers as int / long long), or Python scalars (int, float, bool), which become
  constants of the generated code: each value is its own compiled kernel, so a value that
  changes from call to call belongs in a 1-element array (`prefix[0]`). At most 8 arrays a call
  (mask and score modifiers together). The arrays are read where the kernel runs, with no bounds
  check: the indices are the expression's to keep inside them.

Each distinct (expressions, inputs' names, dtypes and ranks, scalar values) is compiled once per
kernel configuration (FEATURE_MASK_MOD / FEATURE_SCORE_MOD specialisations of the mma.sync
forward; `_configs.FwdModsConfig`), the code in a generated header `user_mods.cuh` whose hash
names the kernel. The arrays' addresses and strides are per-call values, like alibi_slopes'.
The mma.sync forward, backward and deterministic dQ kernels take them, on every architecture
(never the Hopper kernels); the backward multiplies dS by the score modifier's derivative, so a
score modifier without `grad` that is not `score + <no score>` is refused there (ValueError).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

import numpy

__all__ = ["mask_mod", "score_mod", "MaskMod", "ScoreMod", "ModCompileError", "InputSignature",
           "ModSource", "MAX_INPUTS"]

#: Array inputs a call may have, mask and score modifiers together (UserParams' slots).
MAX_INPUTS = 8

#: The names the expressions get from the kernel.
POSITION_NAMES = ("b", "h", "q_idx", "kv_idx")
SCORE_NAME = "score"

#: C++ / CUDA keywords and the names of the generated code an input must not shadow.
_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
char32_t class compl concept const consteval constexpr constinit const_cast continue co_await
co_return co_yield decltype default delete do double dynamic_cast else enum explicit export
extern false float for friend goto if inline int long mutable namespace new noexcept not not_eq
nullptr operator or or_eq private protected public register reinterpret_cast requires return
short signed sizeof static static_assert static_cast struct switch template this thread_local
throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while
xor xor_eq restrict __global__ __device__ __host__ __shared__ __constant__ __forceinline__
threadIdx blockIdx blockDim gridDim warpSize
i64 u16 u32 u64 UserMods UserParams UserInput UserArray1 UserArray2 UserArray3 UserArray4
user_value user_half user_bfloat USER_MODS_HASH CF2_DEVICE fp16_tag bf16_tag
""".split())
RESERVED = frozenset(POSITION_NAMES + (SCORE_NAME,)) | _KEYWORDS

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Element types of the inputs: numpy dtype name -> the C type user_inputs.cuh reads.
ELEMENT_TYPES = {"int32": "int", "int64": "i64", "float32": "float", "float16": "user_half",
                 "bfloat16": "user_bfloat"}


class ModCompileError(ValueError):
    """A mask_mod / score_mod expression that NVRTC refused: the expressions and NVRTC's
    messages on them."""


@dataclass(frozen=True)
class InputSignature:
    """What the generated code knows of an array input: its name, dtype name, number of dims."""

    name: str
    dtype: str
    ndim: int


@dataclass(frozen=True)
class ModSource:
    """The cache identity of a modifier (what its generated code depends on): kind ("mask_mod"
    or "score_mod"), the expression, the derivative (score_mod), the array inputs' signatures
    in order and the scalar inputs as (name, C type, C literal)."""

    kind: str
    expression: str
    grad: str | None = None
    inputs: tuple = ()
    constants: tuple = ()


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"{kind}: input name {name!r} is not a valid C identifier")
    if name in RESERVED or name.startswith("cf2_") or name.startswith("__"):
        raise ValueError(
            f"{kind}: input name {name!r} is reserved (the expression's own names are "
            f"{', '.join(POSITION_NAMES + (SCORE_NAME,))}; C++/CUDA keywords, names starting "
            "with cf2_ or __ and those of the generated code are taken)")


def _check_expression(kind: str, argument: str, text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{kind}: {argument} must be a string of CUDA C; got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{kind}: {argument} is empty")
    if ";" in text or "{" in text or "}" in text:
        raise ValueError(f"{kind}: {argument} must be one expression (no ';', '{{' or '}}'); got "
                         f"{text!r}")
    return text


def _constant(kind: str, name: str, value) -> tuple:
    """(name, C type, C literal) of a scalar input."""
    if isinstance(value, (bool, numpy.bool_)):
        return (name, "bool", "true" if value else "false")
    if isinstance(value, (int, numpy.integer)):
        v = int(value)
        if -2**31 <= v < 2**31:
            return (name, "int", str(v))
        if -2**63 <= v < 2**63:
            return (name, "i64", f"{v}LL")
        raise ValueError(f"{kind}: input {name}={v} does not fit in 64 bits")
    if isinstance(value, (float, numpy.floating)):
        f = float(numpy.float32(value))
        if not math.isfinite(f):
            raise ValueError(f"{kind}: input {name}={value!r} must be finite (as a float32)")
        return (name, "float", f"{f!r}f" if "e" in repr(f) or "." in repr(f) else f"{f!r}.f")
    return None


def _split_inputs(kind: str, inputs: dict):
    """(array signatures, arrays, constants) of a modifier's keyword inputs, checked."""
    cupy = _cupy()
    signatures, arrays, constants = [], [], []
    for name, value in inputs.items():
        _check_name(kind, name)
        const = _constant(kind, name, value)
        if const is not None:
            constants.append(const)
            continue
        if isinstance(value, numpy.ndarray):
            raise TypeError(f"{kind}: input {name} is a numpy array; the kernels read CuPy "
                            f"arrays: use cupy.asarray({name})")
        if cupy is None or not isinstance(value, cupy.ndarray):
            raise TypeError(f"{kind}: input {name} must be a cupy.ndarray or a Python int, float "
                            f"or bool; got {type(value).__name__}")
        dtype = numpy.dtype(value.dtype).name
        if dtype not in ELEMENT_TYPES:
            raise TypeError(f"{kind}: input {name} has dtype {dtype}; supported: "
                            f"{', '.join(ELEMENT_TYPES)}")
        if not 1 <= value.ndim <= 4:
            raise ValueError(f"{kind}: input {name} must have 1 to 4 dims; got shape "
                             f"{tuple(value.shape)}")
        if value.size == 0:
            raise ValueError(f"{kind}: input {name} is empty")
        signatures.append(InputSignature(name, dtype, value.ndim))
        arrays.append(value)
    if len(arrays) > MAX_INPUTS:
        raise ValueError(f"{kind}: {len(arrays)} array inputs; at most {MAX_INPUTS}")
    return tuple(signatures), tuple(arrays), tuple(constants)


def user_input_strides(arrays) -> dict:
    """UserParams' element strides of the modifiers' arrays in slot order (`user.in<i>.stride<j>`,
    padded to 4 dims with 0): the fields a plan, or the block mask's launch, sets once."""
    fields = {}
    for i, x in enumerate(arrays):
        strides = [s // x.itemsize for s in x.strides] + [0] * (4 - x.ndim)
        fields.update({f"user.in{i}.stride{j}": s for j, s in enumerate(strides)})
    return fields


def _cupy():
    try:
        import cupy
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return cupy


def _has_identifier(text: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text) is not None


class _Mod:
    __slots__ = ("source", "arrays", "key")

    def _init(self, source: ModSource, arrays: tuple) -> None:
        self.source = source
        self.arrays = arrays
        # The signature key's share (api._forward_key): the source; the arrays' shapes, strides,
        # dtypes and devices enter the key as arrays of the call.
        self.key = source

    def __repr__(self) -> str:
        names = [s.name for s in self.source.inputs] + [c[0] for c in self.source.constants]
        return f"{self.source.kind}({self.source.expression!r}, inputs={names})"


class MaskMod(_Mod):
    """A mask modifier (see `mask_mod`)."""

    __slots__ = ()

    def __init__(self, expression: str, **inputs):
        _check_expression("mask_mod", "expression", expression)
        signatures, arrays, constants = _split_inputs("mask_mod", inputs)
        self._init(ModSource("mask_mod", expression, None, signatures, constants), arrays)


class ScoreMod(_Mod):
    """A score modifier (see `score_mod`)."""

    __slots__ = ()

    def __init__(self, expression: str, grad: str | None = None, **inputs):
        _check_expression("score_mod", "expression", expression)
        if grad is not None:
            _check_expression("score_mod", "grad", grad)
        signatures, arrays, constants = _split_inputs("score_mod", inputs)
        self._init(ModSource("score_mod", expression, grad, signatures, constants), arrays)

    @property
    def derivative(self) -> str | None:
        """The expression of d new / d score: `grad`, "1.f" for `score + <no score>`, else
        None (the backward refuses it)."""
        return score_derivative(self.source.expression, self.source.grad)


def _additive_tail(text: str) -> bool:
    """`text` binds as one operand of a binary + or - : no operator of lower precedence (shifts,
    comparisons, bitwise and logical operators, ?:, assignment, comma) outside parentheses and
    brackets. Conservative: `static_cast<float>(...)` outside parentheses counts as one."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "<>=!&|^?:,":
            if ch == ">" and i > 0 and text[i - 1] == "-":  # a->b
                continue
            return False
    return depth == 0


def score_derivative(expression: str, grad: str | None) -> str | None:
    """`grad`, or "1.f" where `expression` is textually `score + <expression without score>`
    (or `score - ...`), the tail binding as one operand (not `score + a ? b : c`, which is
    `(score + a) ? b : c`)."""
    if grad is not None:
        return grad
    m = re.match(rf"\s*{SCORE_NAME}\s*[-+](?![-+=])(.*)$", expression, re.S)
    if m and not _has_identifier(m.group(1), SCORE_NAME) and _additive_tail(m.group(1)):
        return "1.f"
    return None


def mask_mod(expression: str, **inputs) -> MaskMod:
    """A mask modifier for `cuflash2.attention(..., mask_mod=...)`: `expression`, a boolean CUDA
    C expression over b, h, q_idx, kv_idx and the named `inputs` (CuPy arrays read-only, or
    Python scalars baked in as constants); a key is visible where it is true (ANDed with causal
    and the window). Module docstring: cuflash2.mods."""
    return MaskMod(expression, **inputs)


def score_mod(expression: str, grad: str | None = None, **inputs) -> ScoreMod:
    """A score modifier for `cuflash2.attention(..., score_mod=...)`: `expression`, a float CUDA
    C expression over score, b, h, q_idx, kv_idx and the named `inputs`, the new score; `grad`
    its derivative d new / d score (for the backward; not needed for `score + <no score>`).
    Module docstring: cuflash2.mods."""
    return ScoreMod(expression, grad, **inputs)


# ---------------------------------------------------------------------------------------------
# Code generation: user_mods.cuh

#: The pseudo-file names NVRTC's messages give the user's code (#line directives).
LABELS = {"mask": "mask_mod", "score": "score_mod", "grad": "score_mod_grad"}


def check_together(mask: ModSource | None, score: ModSource | None) -> None:
    """The inputs of a call's two modifiers fit the kernel's slots."""
    n = len(mask.inputs if mask else ()) + len(score.inputs if score else ())
    if n > MAX_INPUTS:
        raise ValueError(f"mask_mod and score_mod have {n} array inputs together; at most "
                         f"{MAX_INPUTS}")


def _declarations(source: ModSource, first_slot: int, text: str) -> list[str]:
    lines = []
    for i, sig in enumerate(source.inputs):
        if _has_identifier(text, sig.name):
            lines.append(f"        const UserArray{sig.ndim}<{ELEMENT_TYPES[sig.dtype]}> "
                         f"{sig.name}(cf2_user.in{first_slot + i});")
    for name, ctype, literal in source.constants:
        if _has_identifier(text, name):
            lines.append(f"        constexpr {ctype} {name} = {literal};")
    return lines


def _function(signature: str, ret: str, label: str, expression: str, declarations) -> list[str]:
    return ([f"    CF2_DEVICE static {ret} {signature} {{", *declarations,
             f"        return static_cast<{ret}>(", f'#line 1 "{label}"', expression,
             '#line 1 "user_mods.cuh"', "        );", "    }"])


def user_mods_code(mask: ModSource | None, score: ModSource | None) -> str:
    """The UserMods struct of a call's modifiers (the part of user_mods.cuh that is hashed)."""
    check_together(mask, score)
    params = "int b, int h, int q_idx, int kv_idx"
    lines = ["struct UserMods {"]
    reads = mask is not None and any(_has_identifier(mask.expression, sig.name)
                                     for sig in mask.inputs)
    lines.append(f"    static constexpr bool MASK_READS_INPUTS = {str(reads).lower()};")
    if mask is not None:
        lines += _function(f"mask(const UserParams& cf2_user, {params})", "bool",
                           LABELS["mask"], mask.expression,
                           _declarations(mask, 0, mask.expression))
    else:
        lines += ["    CF2_DEVICE static bool mask(const UserParams&, int, int, int, int) {",
                  "        return true;", "    }"]
    slot = len(mask.inputs) if mask is not None else 0
    score_params = f"(const UserParams& cf2_user, float score, {params})"
    if score is not None:
        lines += _function("score" + score_params, "float", LABELS["score"], score.expression,
                           _declarations(score, slot, score.expression))
        grad = score_derivative(score.expression, score.grad)
        if grad is not None:
            lines += _function("score_grad" + score_params, "float", LABELS["grad"], grad,
                               _declarations(score, slot, grad))
    else:
        lines += ["    CF2_DEVICE static float score(const UserParams&, float score, int, int, "
                  "int, int) {", "        return score;", "    }"]
    lines.append("};")
    return "\n".join(lines) + "\n"


def mods_hash(code: str) -> int:
    """32 bits of the SHA-256 of the generated code (the kernel's name and USER_MODS_HASH)."""
    return int(hashlib.sha256(code.encode()).hexdigest()[:8], 16)


def user_mods_header(mask: ModSource | None, score: ModSource | None) -> tuple[str, int]:
    """(the text of user_mods.cuh for these modifiers, its hash)."""
    code = user_mods_code(mask, score)
    h = mods_hash(code)
    header = ("// Generated by cuflash2/mods.py: the programmable modifiers of one specialisation.\n"
              "#pragma once\n#include \"user_inputs.cuh\"\n\n"
              f"constexpr unsigned USER_MODS_HASH = {h:#010x}u;\n\n" + code)
    return header, h


def features_of(mask: ModSource | None, score: ModSource | None) -> int:
    from . import _configs

    return ((_configs.FEATURE_MASK_MOD if mask is not None else 0)
            | (_configs.FEATURE_SCORE_MOD if score is not None else 0))


def forward_config(config, mask: ModSource | None, score: ModSource | None,
                   block_mask: bool = False):
    """The FwdModsConfig of the mma.sync forward `config` (a FwdConfig, its features without
    the modifiers' bits) with these modifiers compiled in; `block_mask`: reading a block mask's
    states too (FEATURE_BLOCK_MASK, with a mask modifier only; cuflash2.block_mask)."""
    import dataclasses

    from . import _configs

    if block_mask and mask is None:
        raise ValueError("a block mask needs its mask modifier")
    header, h = user_mods_header(mask, score)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(_configs.FwdConfig)}
    fields["features"] = ((config.features & ~_configs.USER_MOD_FEATURES)
                          | features_of(mask, score)
                          | (_configs.FEATURE_BLOCK_MASK if block_mask else 0))
    return _configs.FwdModsConfig(**fields, user_mods=header, mods_hash=h)


def hopper_forward_config(config, mask: ModSource | None, score: ModSource | None,
                          block_mask: bool = False):
    """The FwdSm90ModsConfig of the Hopper forward `config` (a FwdSm90Config, its features
    without the modifiers' bits) with these modifiers compiled in; `block_mask`: each work
    tile's KV range narrowed to its block mask's visited tiles (FEATURE_BLOCK_MASK;
    block_mask.cuh, BlockMaskNarrow)."""
    from . import _configs

    return _with_mods(config, _configs.FwdSm90ModsConfig, mask, score, block_mask)


def hopper_backward_config(config, mask: ModSource | None, block_mask: bool = False):
    """The BwdSm90ModsConfig of the Hopper backward `config` (a BwdSm90Config, its features
    without the modifiers' bits) with the mask modifier `mask` (or none: the bias's tiles alone)
    compiled in; `block_mask`: each
    key block's query blocks narrowed to its block mask's visited ones (FEATURE_BLOCK_MASK;
    block_mask.cuh, BlockMaskColumnRange)."""
    from . import _configs

    return _with_mods(config, _configs.BwdSm90ModsConfig, mask, None, block_mask)


def _with_mods(config, cls, mask: ModSource | None, score: ModSource | None,
               block_mask: bool = False):
    import dataclasses

    from . import _configs

    if block_mask and mask is None:
        raise ValueError("a block mask needs its mask modifier")
    header, h = user_mods_header(mask, score)
    base = cls.__mro__[1]  # the config class without the modifiers
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(base)}
    fields["features"] = ((config.features & ~_configs.USER_MOD_FEATURES)
                          | features_of(mask, score)
                          | (_configs.FEATURE_BLOCK_MASK if block_mask else 0))
    return cls(**fields, user_mods=header, mods_hash=h)


def check_backward(score: ModSource | None) -> None:
    """The backward needs the score modifier's derivative: ValueError, before any launch,
    where it has none (no `grad=` and not `score + <expression without score>`)."""
    if score is not None and score_derivative(score.expression, score.grad) is None:
        raise ValueError(
            f"score_mod {score.expression!r} has no derivative for the backward: pass grad= "
            "(cuflash2.score_mod(expression, grad=\"d new / d score\", ...), a CUDA C "
            "expression over the same names); only `score + <expression without score>` "
            "and `score - <...>` need none")


def backward_config(config, mask: ModSource | None, score: ModSource | None,
                    block_mask: bool = False):
    """The BwdModsConfig of the mma.sync backward main kernel `config` (a BwdConfig) with these
    modifiers compiled in (check_backward first: the header needs score_grad); `block_mask`:
    walking a block mask's non-empty tiles only (FEATURE_BLOCK_MASK; block_mask.cuh,
    BlockMaskColumn)."""
    from . import _configs

    check_backward(score)
    return _with_mods(config, _configs.BwdModsConfig, mask, score, block_mask)


def dq_config(config, mask: ModSource | None, score: ModSource | None):
    """The BwdDqModsConfig of the deterministic dQ kernel `config` with these modifiers."""
    from . import _configs

    check_backward(score)
    return _with_mods(config, _configs.BwdDqModsConfig, mask, score)


# ---------------------------------------------------------------------------------------------
# Compile errors

_MESSAGE = re.compile(r"^(\S+?)\((\d+)\): ")


def _user_expressions(header: str) -> dict:
    """label -> expression, read back from a generated header."""
    out = {}
    lines = header.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r'^#line 1 "(\w+)"$', line)
        if m and m.group(1) in LABELS.values():
            body = []
            for rest in lines[i + 1:]:
                if rest.startswith("#line "):
                    break
                body.append(rest)
            out[m.group(1)] = "\n".join(body)
    return out


def compile_error(header: str, log: str) -> ModCompileError:
    """The ModCompileError of a failed compile of a specialisation with `header`: the user's
    expressions and NVRTC's messages on their lines (or, where none names them, the first
    messages of the log)."""
    expressions = _user_expressions(header)
    messages, current = [], None
    for line in log.splitlines():
        m = _MESSAGE.match(line.strip())
        if m:
            current = [line.strip()] if m.group(1) in expressions else None
            if current is not None:
                messages.append(current)
        elif current is not None and line.strip() and "error" not in line.lower()[:8]:
            if len(current) < 4:
                current.append(line.rstrip())
    text = "\n".join("\n".join(m) for m in messages)
    if not text:
        errors = [line.strip() for line in log.splitlines() if "error" in line][:10]
        text = "\n".join(errors) or log[-2000:]
    shown = "\n".join(f"  {label}: {expr.strip()}" for label, expr in expressions.items())
    return ModCompileError(f"the programmable modifiers did not compile:\n{shown}\nNVRTC:\n{text}")
