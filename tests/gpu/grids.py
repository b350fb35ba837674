"""Parameter grids and seeds shared by the GPU tests (tests/gpu helper, no CuPy needed)."""

import contextlib
import zlib

import ml_dtypes
import numpy
import pytest

FP16 = numpy.dtype(numpy.float16)
BF16 = numpy.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]
HEAD_DIMS = [32, 40, 64, 72, 96, 128, 160, 192, 224, 256]
SEQLENS = [1, 17, 97, 128, 255, 1023, 1025]

# name: (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
HEAD_LAYOUTS = {
    "mha": (2, 113, 113, 4, 4),
    "gqa": (1, 97, 255, 6, 2),  # query heads 0-2 read KV head 0, 3-5 read KV head 1
    "mqa": (1, 255, 97, 4, 1),  # causal: rows 0..157 see no key
}


def seed_of(*parts) -> int:
    """A stable seed per test case (Python's hash() of strings changes between runs)."""
    return zlib.crc32(repr(parts).encode())


def is_hopper() -> bool:
    """Whether the current device is sm_90 (H100/H200), where the Hopper kernels run."""
    try:
        import cupy

        return cupy.cuda.Device().compute_capability == "90"
    except Exception:  # no CuPy or no device: the folder's conftest skips every test
        return False


needs_hopper = pytest.mark.skipif(not is_hopper(), reason="needs an sm_90 GPU (H100/H200)")


@contextlib.contextmanager
def switched(owner, values: dict, plans):
    """`owner`'s attributes set to `values` (a module's dispatch flags, say) for the plans made
    inside; the plan cache `plans` (an api PlanCache) is emptied on entry and on exit, so no
    plan outlives the setting it was made under."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    plans.plans.clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)
        plans.plans.clear()


def score_mod_options(xp, mods: str) -> dict:
    """Causal attention with the score modifiers `mods` ("softcap", "alibi" or "both") of the
    tests of a (batch 2, 4 heads) problem: softcap 5, ALiBi slopes per (batch, head)."""
    options = {"causal": True}
    if mods in ("softcap", "both"):
        options["softcap"] = 5.0
    if mods in ("alibi", "both"):
        options["alibi_slopes"] = xp.asarray(numpy.linspace(0.05, 0.4, 8, dtype=numpy.float32)
                                             .reshape(2, 4))
    return options


def paged_cache(k_cache, v_cache, page_size, rng):
    """The same logical cache scattered over shuffled pages (+1 spare), and its block table."""
    import cupy

    batch, capacity = k_cache.shape[:2]
    per_seq = capacity // page_size
    blocks = batch * per_seq + 1
    order = rng.permutation(blocks)[: batch * per_seq].reshape(batch, per_seq)
    shape = (blocks, page_size) + k_cache.shape[2:]
    k_paged, v_paged = cupy.zeros(shape, k_cache.dtype), cupy.zeros(shape, v_cache.dtype)
    for b in range(batch):
        for j in range(per_seq):
            rows = slice(j * page_size, (j + 1) * page_size)
            k_paged[int(order[b, j])] = k_cache[b, rows]
            v_paged[int(order[b, j])] = v_cache[b, rows]
    return k_paged, v_paged, cupy.asarray(order.astype(numpy.int32))


def varlen_inputs(cupy, lengths_q, lengths_k, nheads, nheads_kv, headdim, dtype, seed):
    """Packed variable-length inputs: q, k, v and dout (standard normal, in that order from
    one generator of `seed`), cu_seqlens_q / _k (int32) and max_seqlen_q / _k."""
    rng = numpy.random.default_rng(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = cupy.asarray(rng.standard_normal((total_q, nheads, headdim)).astype(dtype))
    k = cupy.asarray(rng.standard_normal((total_k, nheads_kv, headdim)).astype(dtype))
    v = cupy.asarray(rng.standard_normal((total_k, nheads_kv, headdim)).astype(dtype))
    dout = cupy.asarray(rng.standard_normal((total_q, nheads, headdim)).astype(dtype))
    cu_q = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths_q)]).astype(numpy.int32))
    cu_k = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths_k)]).astype(numpy.int32))
    return q, k, v, dout, cu_q, cu_k, max(lengths_q), max(lengths_k)
