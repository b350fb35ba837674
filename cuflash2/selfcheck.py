"""`python -m cuflash2 check`: the kernels (forward and backward) against the reference, on this
GPU, on fresh random inputs.

The correctness rule is the one the GPU test suite uses (cuflash2.testing, docs/DESIGN.md §5): the
kernel's error against the float32 reference may be at most twice the error of the same reference
computed in the input dtype, plus a small atol; lse (float32) is compared directly, and rows that
see no key must give +inf.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy

DEFAULT_HEADDIMS = (40, 64, 128, 256)


@dataclass(frozen=True)
class Case:
    dtype_name: str
    headdim: int
    causal: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    unbatched: bool = False  # call with (seqlen, nheads, headdim) arrays

    def describe(self) -> str:
        layout = "unbatched" if self.unbatched else f"b={self.batch}"
        mask = "causal" if self.causal else "full"
        return (
            f"{self.dtype_name} d={self.headdim:<3} {layout} sq={self.seqlen_q} sk={self.seqlen_k} "
            f"h={self.nheads}/{self.nheads_kv} {mask}"
        )


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, unbatched): tile-aligned MHA, a lone query
# against an odd key count (MQA, unbatched layout), fewer queries than keys (GQA, bottom-right
# causal), and more queries than keys (causal rows 0-1 see no key: out 0, lse +inf).
SHAPES = (
    (2, 128, 128, 4, 4, False),
    (1, 1, 17, 4, 1, True),
    (2, 97, 255, 6, 2, False),
    (1, 1025, 1023, 8, 2, False),
)


#: `check --dtype` names: float32 is checked at both precisions (fp32: "highest", tf32).
PRECISIONS = {"fp16": None, "bf16": None, "fp32": "highest", "tf32": "tf32"}


def dtype_from_name(name: str):
    if name == "fp16":
        return numpy.dtype(numpy.float16)
    if name == "bf16":
        import ml_dtypes

        return numpy.dtype(ml_dtypes.bfloat16)
    if name in ("fp32", "tf32"):
        return numpy.dtype(numpy.float32)
    raise ValueError(f"dtype must be one of {', '.join(map(repr, PRECISIONS))}, got {name!r}")


def grid(dtype_names=("fp16", "bf16"), headdims=DEFAULT_HEADDIMS) -> list[Case]:
    return [
        Case(dtype_name, headdim, causal, b, sq, sk, h, hkv, unbatched)
        for dtype_name, headdim, causal, (b, sq, sk, h, hkv, unbatched) in itertools.product(
            dtype_names, headdims, (False, True), SHAPES
        )
    ]


def run_case(cupy, case: Case, seed: int) -> tuple[bool, str]:
    """Run one case; return (passed, report line). Never raises: an exception is a failure."""
    import cuflash2
    from cuflash2 import testing

    batch = None if case.unbatched else case.batch
    try:
        q, k, v = testing.random_qkv(
            cupy, batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_kv,
            case.headdim, dtype_from_name(case.dtype_name), seed,
        )
        precision = PRECISIONS[case.dtype_name]
        out, lse = cuflash2.attention(q, k, v, causal=case.causal, return_lse=True,
                                      precision=precision)
        results = testing.check_forward(q, k, v, out, lse, causal=case.causal,
                                        precision=precision)
        # The backward on the same problem: dq, dk, dv against the reference gradients.
        dout = testing.random_qkv(cupy, batch, case.seqlen_q, case.seqlen_q, case.nheads,
                                  case.nheads, case.headdim, dtype_from_name(case.dtype_name),
                                  seed + 1_000_000)[0]
        dq, dk, dv = cuflash2.attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                                 precision=precision)
        results += testing.check_backward(dout, q, k, v, dq, dk, dv, causal=case.causal,
                                          precision=precision)
    except Exception as exc:  # report and go on with the other cases
        return False, f"FAIL {case.describe()}  error: {exc.__class__.__name__}: {exc}"
    passed = all(result.ok for result in results)
    details = "  ".join(
        f"{r.name} err {r.max_err:.2e} <= {r.bound:.2e}{'' if r.ok else ' (!)'}" for r in results
    )
    return passed, f"{'PASS' if passed else 'FAIL'} {case.describe():<48} {details}"


def run(cupy, dtype_names, headdims, seed: int = 0) -> int:
    """Print one line per case and a summary; return the exit status (0 all pass, 1 otherwise)."""
    cases = grid(dtype_names, headdims)
    print(f"checking {len(cases)} cases against cuflash2.reference "
          "(kernels compile on first use, then come from the disk cache)", flush=True)
    failures = 0
    for index, case in enumerate(cases):
        passed, line = run_case(cupy, case, seed + index)
        failures += not passed
        print(line, flush=True)
    print(f"{len(cases) - failures} passed, {failures} failed")
    return 1 if failures else 0
