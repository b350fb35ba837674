"""The correctness rule shared by the GPU tests and ``python -m cuflash2 check``.

flash-attn's rule: an implementation is correct when its error against the exact reference is at
most twice the error of the same reference computed in the input dtype, plus a small absolute
slack::

    max|out - ref_hi| <= 2 * max|ref_lo - ref_hi| + atol

ref_hi is ``reference.attention(..., compute_dtype=float32)`` and ref_lo the same with
``compute_dtype`` = the input dtype. The bound thus scales with the rounding error that fp16/bf16
arithmetic cannot avoid for this very problem (sequence length, head dim, masking), instead of a
fixed tolerance that is loose for easy problems and flaky for hard ones.

The sinks' gradient dsinks (float32, a sum over every row of a head) is judged by the same rule
with an absolute slack grown with those rows (``dsinks_tolerance``); the bias's gradient dbias
by the same rule too, against the float32 reference's unrounded dbias.

Works for NumPy and CuPy arrays; only the final max scalars are copied to the host.

Also here: GPU time for pytest-benchmark (``CudaEventTimer``, ``cuda_event_timer`` and
``GpuBenchmark``; the ``gpu_benchmark`` fixture of ``cuflash2.pytest_plugin`` wraps them).
"""

import dataclasses
import math

import ml_dtypes
import numpy

from cuflash2 import _validate, fp8, reference
from cuflash2.reference import _array_module

__all__ = [
    "CheckResult",
    "CudaEventTimer",
    "GpuBenchmark",
    "cuda_event_timer",
    "check_close",
    "check_forward",
    "check_backward",
    "check_varlen_backward",
    "default_atol",
    "dsinks_tolerance",
    "lse_close",
    "poison_like",
    "random_qkv",
]

_BF16 = numpy.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    name: str
    max_err: float
    bound: float
    ok: bool

    def __str__(self):
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name}: max_err {self.max_err:.3e} <= bound {self.bound:.3e}: {verdict}"


def default_atol(dtype):
    """Absolute slack of the rule for outputs of this dtype.

    One unit in the last place at 1.0 (the dtype's machine epsilon): 2**-10 ~ 9.8e-4 for fp16,
    2**-7 ~ 7.8e-3 for bf16. Attention outputs of standard-normal inputs are O(1) (convex
    combinations of V rows). The slack covers the one case the 2x term cannot: an
    implementation and ref_lo each round the output once, and on small problems (few elements,
    short rows) ref_lo can happen to land within a fraction of an ulp of ref_hi while the
    implementation lands on the neighbouring value. Real bugs (masking, indexing, a missing
    rescale) give errors of O(0.1) and are far above it.
    """
    dtype = numpy.dtype(dtype)
    if dtype == numpy.float16:
        return 2.0**-10
    if dtype == _BF16:
        return 2.0**-7
    if dtype == numpy.float32:
        return 1e-5  # fp32 inputs: ref_lo == ref_hi, so this is the whole tolerance
    if dtype == numpy.float64:
        return 1e-10
    raise ValueError(f"no default atol for dtype {dtype}")


def _max_abs(xp, x):
    """max |x| as a Python float; 0 for an empty array, nan if any entry is nan."""
    if x.size == 0:
        return 0.0
    x = xp.abs(x)
    if bool(xp.isnan(x).any()):
        return math.nan
    return float(x.max())


def _as_float64(xp, x):
    return xp.asarray(x).astype(numpy.float64)


def check_close(name, out, ref_hi, ref_lo, atol=None):
    """Apply the rule to one result. atol defaults to default_atol(out.dtype)."""
    xp = _array_module(out, ref_hi, ref_lo)
    if not (tuple(out.shape) == tuple(ref_hi.shape) == tuple(ref_lo.shape)):
        raise ValueError(
            f"{name}: shapes differ: out {out.shape}, ref_hi {ref_hi.shape}, "
            f"ref_lo {ref_lo.shape}"
        )
    if atol is None:
        atol = default_atol(out.dtype)
    ref_hi = _as_float64(xp, ref_hi)
    max_err = _max_abs(xp, _as_float64(xp, out) - ref_hi)
    bound = 2.0 * _max_abs(xp, _as_float64(xp, ref_lo) - ref_hi) + atol
    ok = math.isfinite(max_err) and max_err <= bound  # nan compares False anyway; be explicit
    return CheckResult(name, max_err, bound, ok)


def lse_close(lse, ref_lse, *, rtol=1e-3, atol=1e-3, name="lse"):
    """Check a log-sum-exp against the float32 reference's.

    Entries where the reference is +inf (rows that see no key) must be exactly +inf; the others
    must be finite and within atol + rtol * max|ref_lse| (one scalar bound, so the result reads
    like check_close's). The lse of fp16/bf16 inputs is computed in fp32 from the same fp32
    scores by a kernel and by the reference, so 1e-3 is loose; it only absorbs summation order.
    """
    xp = _array_module(lse, ref_lse)
    if tuple(lse.shape) != tuple(ref_lse.shape):
        raise ValueError(f"{name}: shapes differ: {lse.shape} vs {ref_lse.shape}")
    lse = _as_float64(xp, lse)
    ref_lse = _as_float64(xp, ref_lse)
    ref_keyless = ref_lse == math.inf
    got_keyless = lse == math.inf
    ref_finite = xp.where(ref_keyless, 0.0, ref_lse)
    bound = atol + rtol * _max_abs(xp, ref_finite)
    if bool((ref_keyless != got_keyless).any()):
        return CheckResult(name, math.inf, bound, False)
    diff = xp.where(ref_keyless, 0.0, lse - ref_finite)
    max_err = _max_abs(xp, diff)
    ok = math.isfinite(max_err) and max_err <= bound
    return CheckResult(name, max_err, bound, ok)


def random_qkv(xp, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed):
    """Standard-normal q, k, v of the given dtype (bf16 through ml_dtypes), C-contiguous.

    batch=None gives unbatched (seqlen, nheads, headdim) arrays. The values are drawn on the host
    with NumPy so that the same seed gives bit-identical inputs on NumPy and CuPy.
    """
    rng = numpy.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    shapes = [
        lead + (seqlen_q, nheads, headdim),
        lead + (seqlen_k, nheads_kv, headdim),
        lead + (seqlen_k, nheads_kv, headdim),
    ]
    dtype = numpy.dtype(dtype)
    return tuple(
        xp.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))
        for shape in shapes
    )


def poison_like(xp, shape, dtype):
    """An array of the given shape and dtype filled with NaN, to catch unwritten outputs."""
    # Filled in float32 and cast: a cast is the bf16 operation CuPy is known to support.
    return xp.full(shape, math.nan, dtype=numpy.float32).astype(dtype)


#: One unit in the last place at 1.0 of TF32 (10 mantissa bits).
_TF32_UNIT = 2.0**-10


def _tf32_products(dtype, precision) -> bool:
    """Whether float32 inputs at `precision` take one TF32 product ("tf32", "high":
    _validate.PRECISIONS)."""
    return numpy.dtype(dtype) == numpy.float32 and _validate.PRECISIONS.get(precision) == "tf32"


def _references(q, precision, qkv_dtype=None):
    """(ref_hi's, ref_lo's compute_dtype) of the rule for inputs like q: float32 and q's dtype
    for 16-bit inputs; for float32 inputs float64 and, at `precision`, float32 ("highest",
    None) or the TF32 roundings ("tf32", "high": reference compute_dtype "tf32"); for FP8
    inputs (`qkv_dtype` "e4m3") float64 and the e4m3 roundings of the FP8 forward
    (docs/FP8_FORWARD.md, "Accuracy"). FP8 bits without qkv_dtype are refused: a uint8 q would
    otherwise be read as integers."""
    if qkv_dtype is not None:
        return numpy.float64, qkv_dtype
    if numpy.dtype(q.dtype) in fp8.E4M3_DTYPES:
        raise TypeError(f"q is {numpy.dtype(q.dtype)}: FP8 inputs are checked with "
                        f"qkv_dtype='e4m3' (and their descale factors)")
    if numpy.dtype(q.dtype) != numpy.float32:
        return numpy.float32, q.dtype
    return numpy.float64, ("tf32" if _tf32_products(q.dtype, precision) else numpy.float32)


def check_forward(q, k, v, out, lse=None, *, atol=None, precision=None, **options):
    """Check an implementation's forward result (and lse, if given) against the reference.

    options go to ``reference.attention`` as they are: causal, softmax_scale, window_size,
    softcap, alibi_slopes, sinks, dropout_p and dropout_mask (with dropout_p > 0, dropout_mask
    must be the keep-mask the implementation used), bias, mask, score_mod (bias_requires_grad
    is ignored here). With sinks the reference's lse counts the
    sink, and a row that sees no key has lse = sink (finite).
    Returns a list of CheckResult: "out", then "lse" when lse is not None. `precision`: that
    of float32 inputs (_references). FP8 inputs: qkv_dtype="e4m3" with their q_descale,
    k_descale, v_descale and out_dtype among the options (host arrays or CuPy ones).
    """
    # bias_requires_grad is a backward option: dropped, so one options dict serves both checks.
    options = {name: value for name, value in options.items() if name != "bias_requires_grad"}
    hi, lo = _references(q, precision, options.get("qkv_dtype"))
    ref_hi, ref_lse = reference.attention(q, k, v, return_lse=True, compute_dtype=hi, **options)
    ref_lo = reference.attention(q, k, v, compute_dtype=lo, **options)
    results = [check_close("out", out, ref_hi, ref_lo, atol)]
    if lse is not None:
        results.append(lse_close(lse, ref_lse))
    return results


def check_backward(dout, q, k, v, dq, dk, dv, *optional, atol=None, dsinks=None,
                   dsinks_atol=None, dbias=None, dbias_atol=None, precision=None, **options):
    """Check an implementation's gradients against the reference backward.

    options go to ``reference.attention_backward`` as they are (those of check_forward, and
    bias_requires_grad). The gradients of the optional inputs follow dv in the backward's order,
    positionally (``check_backward(dout, q, k, v, *grads, **options)``) or as keywords:
    ``dsinks`` (float32 (nheads,)) is required with ``sinks`` in options and checked by the same
    rule, with the absolute slack of ``dsinks_tolerance`` unless ``dsinks_atol`` is given;
    ``dbias`` (shaped like bias) with ``bias`` (unless bias_requires_grad=False), with the slack
    ``dbias_atol`` (default: the larger default_atol of q's and bias's dtypes); ``atol`` is dq's,
    dk's and dv's. `precision`: that of float32 inputs, as check_forward's (_references).
    Returns a list of CheckResult for "dq", "dk", "dv" (then "dsinks", "dbias").
    """
    dsinks, dbias = _optional_gradients(optional, dsinks, dbias, options)
    return _check_gradients(
        reference.attention_backward, reference.attention, (dout, q, k, v, None, None), (q, k, v),
        (dq, dk, dv), dsinks, atol, dsinks_atol, options, dbias, dbias_atol, precision,
    )


def check_varlen_backward(dout, q, k, v, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, *, atol=None, dsinks=None, dsinks_atol=None, dbias=None,
                          dbias_atol=None, precision=None, **options):
    """check_backward for the gradients of ``attention_varlen`` (packed like q, k, v), against
    the reference varlen backward with the same cu_seqlens, maxima and options. With ``sinks``
    in options, ``dsinks=``, and with ``bias``, ``dbias=`` (keywords here: the positional
    arguments after dv are the cu_seqlens) are required and checked as in check_backward, as is
    `precision`.

    Returns a list of CheckResult for "dq", "dk", "dv" (then "dsinks", "dbias").
    """
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _check_gradients(
        reference.attention_varlen_backward, reference.attention_varlen,
        (dout, q, k, v, None, None, *varlen), (q, k, v, *varlen), (dq, dk, dv), dsinks, atol,
        dsinks_atol, options, dbias, dbias_atol, precision,
    )


def _optional_gradients(optional, dsinks, dbias, options):
    """(dsinks, dbias) from the positional gradients after dv (in the backward's order: dsinks
    with sinks, then dbias with a bias that requires its gradient) and the keywords."""
    names = []
    if options.get("sinks") is not None:
        names.append("dsinks")
    if _wants_dbias(options):
        names.append("dbias")
    if len(optional) > len(names):
        raise ValueError(
            f"{len(optional)} gradient(s) given after dv, but these options give "
            f"{len(names)} ({', '.join(names) or 'none'}): dsinks comes only with sinks=, dbias "
            "only with bias= (and bias_requires_grad)"
        )
    given = dict(dsinks=dsinks, dbias=dbias)
    for name, grad in zip(names, optional):
        if given[name] is not None:
            raise ValueError(f"{name} given twice (positionally and as a keyword)")
        given[name] = grad
    return given["dsinks"], given["dbias"]


def _wants_dbias(options):
    return options.get("bias") is not None and options.get("bias_requires_grad", True)


def dsinks_tolerance(dtype, dout, out, lse, sinks, precision=None):
    """The absolute slack of the 2x rule for dsinks, for inputs of this dtype (float32 ones at
    `precision`).

    dsinks is float32 and is not rounded to the input dtype, but it is a sum over every row i
    of a head (all batch entries, all sequences) of ``-exp(sink - lse_i) * D_i`` with
    ``D_i = rowsum(dO_i * O_i)``, and an implementation reads O from the forward's output,
    rounded to the input dtype: each product dO_ic * O_ic carries a relative error of up to
    eps / 2. Over the products of the rows such errors add like a random walk, so the sum's
    error is of the order of eps times the quadrature sum (2-norm) of those products, weighted
    by the sink's probability: ``eps * sqrt(sum_ic (P_sink_i * dO_ic * O_ic)^2)`` (about 3.5
    standard deviations of one rounding of the output). That is what ``default_atol`` is for
    the outputs (the error one rounding may leave where ref_lo happens to land close to
    ref_hi) grown with the number of rows like the sum's own error, and scaled by how much the
    sink takes of each row: a fixed slack would be loose where the sink is weak (dsinks ~ 1e-3)
    and flaky over many rows. Taken per head, the largest over the heads. On 300 random
    fp16/bf16 problems (1-2 batch entries, 1-200 rows, 1-300 keys, GQA, causal or not, sinks of
    std 0.5-3), a dsinks computed in fp32 from the low-precision reference's output (scores and
    P rounded: more error than a kernel's) stayed below 0.78 of the bound
    (2 |ref_lo - ref_hi| + this), while a dsinks of 0 or of twice the value failed every one.

    Float32 inputs at precision "tf32" ("high") take TF32's unit, 2**-10 (10 mantissa bits, as
    fp16): there D_i is read from dO rounded to TF32 (the dO that dP = dO V^T takes, so that
    dP - D cancels) and O from products of TF32 operands, so each product dO_ic * O_ic carries
    a TF32 rounding, not a float32 one.

    dout, out (the float32 reference's): (..., nheads, headdim) rows; lse (float32 reference's,
    counting the sink): their (nheads, rows) layout, i.e. ``(batch, nheads, seqlen_q)``,
    ``(nheads, seqlen_q)`` or varlen ``(nheads, total_q)``; sinks (nheads,).
    """
    xp = _array_module(dout, out, lse, sinks)
    eps = _TF32_UNIT if _tf32_products(dtype, precision) else default_atol(dtype)
    nheads = int(sinks.shape[0])
    products = _as_float64(xp, dout) * _as_float64(xp, out)
    per_row = (products * products).sum(axis=-1).swapaxes(-1, -2)  # lse's layout
    sink_probs = xp.exp(_as_float64(xp, sinks)[:, None] - _as_float64(xp, lse))  # 0 where +inf
    per_head = (sink_probs * sink_probs * per_row).sum(axis=-1).reshape(-1, nheads).sum(axis=0)
    return eps * math.sqrt(_max_abs(xp, per_head)) if nheads else eps


def _check_gradients(reference_backward, reference_forward, args, forward_args, grads, dsinks,
                     atol, dsinks_atol, options, dbias=None, dbias_atol=None, precision=None):
    """The 2x rule for dq, dk, dv (and dsinks with sinks, dbias with bias): `reference_backward(
    *args, **options)` in fp32 and in the input dtype (that of args[1], q; float32 inputs:
    float64 and float32 or TF32 at `precision`, _references); `reference_forward(
    *forward_args, **options)` gives the out and lse of dsinks' slack."""
    sinks = options.get("sinks")
    if sinks is None and dsinks is not None:
        raise ValueError("dsinks given without sinks: pass the forward's sinks=")
    if sinks is not None and dsinks is None:
        raise ValueError("sinks given: pass the implementation's dsinks as well (dsinks=)")
    bias = options.get("bias")
    wants_dbias = _wants_dbias(options)
    if not wants_dbias and dbias is not None:
        raise ValueError("dbias given without bias (or with bias_requires_grad=False): pass the "
                         "forward's bias=")
    if wants_dbias and dbias is None:
        raise ValueError("bias given: pass the implementation's dbias as well (dbias=), or "
                         "bias_requires_grad=False")
    q = args[1]
    hi_options = options
    if wants_dbias and numpy.dtype(bias.dtype).itemsize < 4:
        # The same values in float32 (exactly): the float32 reference's dbias is then not
        # rounded to the bias's 16-bit dtype; the low-precision reference's is, like an
        # implementation's.
        hi_options = dict(options, bias=bias.astype(numpy.float32))
    hi, lo = _references(q, precision)
    refs_hi = reference_backward(*args, compute_dtype=hi, **hi_options)
    refs_lo = reference_backward(*args, compute_dtype=lo, **options)
    results = [
        check_close(name, got, ref_hi, ref_lo, atol)
        for name, got, ref_hi, ref_lo in zip(("dq", "dk", "dv"), grads, refs_hi, refs_lo)
    ]
    if sinks is not None:
        if dsinks_atol is None:
            forward_options = {name: value for name, value in options.items()
                               if name != "bias_requires_grad"}
            out, lse = reference_forward(*forward_args, return_lse=True, **forward_options)
            dsinks_atol = dsinks_tolerance(q.dtype, args[0], out, lse, sinks, precision)
        results.append(check_close("dsinks", dsinks, refs_hi[3], refs_lo[3], dsinks_atol))
    if wants_dbias:
        if dbias_atol is None:
            dbias_atol = max(default_atol(q.dtype), default_atol(bias.dtype))
        results.append(check_close("dbias", dbias, refs_hi[-1], refs_lo[-1], dbias_atol))
    return results


class _GpuReading:
    """One CUDA event recorded by CudaEventTimer. `later - earlier` waits for `later` and gives
    the GPU time between the two events in seconds, the one operation pytest-benchmark applies
    to its timer's readings (`end - start`)."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def __sub__(self, earlier):
        import cupy

        self.event.synchronize()
        return cupy.cuda.get_elapsed_time(earlier.event, self.event) / 1e3


class CudaEventTimer:
    """A pytest-benchmark timer that reads the GPU's clock: each call records a CUDA event on the
    current CuPy stream, and the difference of two readings is the GPU time between them, in
    seconds. So a round's statistics are the time the GPU took from the start event to the end
    event, not the host's. CuPy is imported at the first reading, not before.

    Give it to pytest-benchmark as ``@pytest.mark.benchmark(timer=cuflash2.testing.
    cuda_event_timer)`` or ``--benchmark-timer cuflash2.testing.cuda_event_timer``. Alone, it
    also counts the time the GPU waits for the host to launch the round's work; ``GpuBenchmark``
    (the ``gpu_benchmark`` fixture) queues a spinning kernel before each round so that the
    round's launches wait behind it and the events see only the GPU's work.
    """

    __name__ = "cuda_event_timer"  # how pytest-benchmark names the timer in saved runs

    def __call__(self) -> _GpuReading:
        import cupy

        event = cupy.cuda.Event()
        event.record()
        return _GpuReading(event)


#: The timer instance that ``--benchmark-timer`` and the benchmark marker can name.
cuda_event_timer = CudaEventTimer()


class GpuBenchmark:
    """pytest-benchmark's ``benchmark`` fixture, set up with ``cuda_event_timer``, timing one
    call of a function per round on the GPU: ``gpu_benchmark(fn)``. Before each round, untimed:
    ``before()`` if given (an L2 flush, a reset of state), then a kernel that spins for
    ``host_us`` microseconds, long enough for the host to record the start event, launch fn's
    work and record the end event while the GPU is still busy; the events then measure fn's
    GPU time alone. Work runs on the current CuPy stream (enter a stream around the call to
    time another). Attributes of the benchmark fixture (``extra_info``, ``stats``, ``group``)
    pass through.
    """

    def __init__(self, benchmark):
        self._benchmark = benchmark
        self._spin = None

    def __getattr__(self, name):
        return getattr(self._benchmark, name)

    def __call__(self, fn, *, rounds: int = 50, warmup_rounds: int = 5, before=None,
                 host_us: int = 400):
        """Times ``fn()`` for ``rounds`` rounds after ``warmup_rounds`` (whose first call pays
        for compiling); returns fn's last result. The stats are seconds of GPU time."""
        if rounds < 1 or warmup_rounds < 0 or host_us < 0:
            raise ValueError(f"rounds must be >= 1, warmup_rounds and host_us >= 0; got rounds="
                             f"{rounds}, warmup_rounds={warmup_rounds}, host_us={host_us}")
        import cupy

        if self._spin is None:
            from cuflash2.bench.timing import spin_kernel

            self._spin = spin_kernel(cupy)
        spin_ns = cupy.uint64(host_us * 1000)

        def setup():
            if before is not None:
                before()
            self._spin((1,), (1,), (spin_ns,))

        return self._benchmark.pedantic(fn, setup=setup, rounds=rounds,
                                        warmup_rounds=warmup_rounds, iterations=1)

    def gpu_seconds(self) -> float | None:
        """The median of the rounds just timed, in seconds of GPU time; None where nothing was
        timed (``--benchmark-disable``)."""
        if self._benchmark.stats is None:
            return None
        return self._benchmark.stats.stats.median
