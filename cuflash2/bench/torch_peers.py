"""torch SDPA on the same arrays as cuflash2, for the benchmarks' comparisons.

`TorchSdpa` runs `torch.nn.functional.scaled_dot_product_attention` restricted to one backend
(`TorchSdpaFlash`: its FlashAttention-2 backend; `TorchSdpaCudnn`: its cuDNN backend) on
(b, h, s, d) views of the CuPy arrays, shared through DLPack without a copy. `measure_torch`
times one of them as the grid times cuflash2 (`timing.time_torch`), `measure_cudnn` fills a
row's cuDNN columns or, where cuDNN refuses the configuration, the reason (`refusal_reason`).
torch is imported only by `load_torch`, so the module imports without it.
"""

from __future__ import annotations

import sys
import warnings

from .timing import time_torch


def torch_view(torch, cupy, array, torch_dtype):
    # Through int16 so the exchange does not depend on DLPack's bfloat16 support on either side.
    return torch.from_dlpack(array.view(cupy.int16)).view(torch_dtype)


class TorchSdpa:
    """torch SDPA restricted to one backend (`BACKEND`, a member of torch's SDPBackend), on
    (b, h, s, d) views of our arrays. `only()` is the context that restricts it: the timed calls
    run inside it; the backward's forward is run inside it here (autograd then calls that
    backend's backward)."""

    BACKEND = ""
    LABEL = ""

    def __init__(self, torch, cupy, dtype_name: str):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch, self.cupy = torch, cupy
        self.torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        backend = getattr(SDPBackend, self.BACKEND)
        self.only = lambda: sdpa_kernel(backend)

    def as_bhsd(self, array):
        return torch_view(self.torch, self.cupy, array, self.torch_dtype).transpose(1, 2)

    def forward(self, q, k, v, causal):
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = (self.as_bhsd(x) for x in (q, k, v))
        return lambda: sdpa(qt, kt, vt, is_causal=causal)

    def attend_all(self, q, k, v):
        """SDPA under this backend on torch tensors in (b, h, s, d), every key seen by every
        query (a decoding step's one token against its whole cache), GQA where the heads
        differ."""
        with self.only():
            return self.torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    def backward(self, q, k, v, dout, causal):
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = (self.as_bhsd(x).detach().requires_grad_() for x in (q, k, v))
        dout_t = self.as_bhsd(dout)
        with self.only():
            out = sdpa(qt, kt, vt, is_causal=causal)
        return lambda: self.torch.autograd.grad(out, (qt, kt, vt), dout_t, retain_graph=True)


class TorchSdpaFlash(TorchSdpa):
    """torch SDPA restricted to its FlashAttention-2 backend."""

    BACKEND = "FLASH_ATTENTION"
    LABEL = "SDPA-flash"

    @property
    def flash_only(self):
        return self.only


class TorchSdpaCudnn(TorchSdpa):
    """torch SDPA restricted to its cuDNN backend (cuDNN's fused attention)."""

    BACKEND = "CUDNN_ATTENTION"
    LABEL = "cuDNN"


def load_torch(stream=sys.stderr):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401  (torch >= 2.3)
    except Exception as exc:
        print(f"note: --compare torch skipped: PyTorch is not importable ({exc})", file=stream)
        return None
    if not torch.cuda.is_available():
        print("note: --compare torch skipped: torch sees no CUDA device", file=stream)
        return None
    return torch


def cudnn_version(torch):
    try:
        return torch.backends.cudnn.version()
    except Exception:
        return None


def max_abs_diff(cupy, torch, ours, torch_out_bhsd) -> float:
    theirs_bshd = torch_out_bhsd.transpose(1, 2).contiguous().view(torch.int16)
    theirs = cupy.from_dlpack(theirs_bshd).view(ours.dtype)
    return float(cupy.abs(ours.astype(cupy.float32) - theirs.astype(cupy.float32)).max())


def measure_torch(cupy, torch, reference: TorchSdpa, config, q, k, v, dout, ours_out, warmup,
                   iters, backlog):
    """(ms, max abs diff, timer) of torch SDPA under `reference`'s backend on the same arrays:
    the forward, or the backward through autograd on a retained graph (its forward run under
    the backend too). The diff compares the forward's output with `ours_out`; None for
    backward. timer(warmup, iters, backlog) -> ms times the same call again (the later rounds
    of a row: paper_grid.measure's `repeats`)."""
    if config.direction == "fwd":
        run = reference.forward(q, k, v, config.causal)
    else:
        run = reference.backward(q, k, v, dout, config.causal)

    def timer(warmup, iters, backlog):
        with reference.only():
            return time_torch(torch, run, warmup, iters, backlog)
    ms = timer(warmup, iters, backlog)
    with reference.only():
        diff = max_abs_diff(cupy, torch, ours_out, run()) if ours_out is not None else None
    return ms, diff, timer


def measure_cudnn(cupy, torch, row, q, k, v, dout, ours_out, warmup, iters, backlog):
    """SDPA's cuDNN backend into `row` (a paper_grid.Row), timed as SDPA-flash is; returns
    measure_torch's timer. A configuration it refuses (or a torch without that backend) leaves
    the time empty and the reason in row.cudnn_error, and returns None; the row is not failed
    for it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            reference = TorchSdpaCudnn(torch, cupy, row.config.dtype)
            row.cudnn_ms, row.cudnn_max_abs_diff, timer = measure_torch(
                cupy, torch, reference, row.config, q, k, v, dout, ours_out, warmup, iters,
                backlog)
            row.cudnn_tflops = row.config.flops / row.cudnn_ms / 1e9
            return timer
        except Exception as exc:
            row.cudnn_ms = row.cudnn_max_abs_diff = row.cudnn_tflops = None
            row.cudnn_error = refusal_reason(exc, [str(w.message) for w in caught])
            return None


def refusal_reason(exc: BaseException, warning_messages=()) -> str:
    """One line saying why torch's cuDNN backend refused. With every other backend disabled,
    torch warns "CuDNN attention kernel not used because:", then one warning per failed check,
    then raises "No available kernel"; those checks' warnings are the reason, else the
    exception's first line."""
    messages = [" ".join(m.split(" (Triggered internally at")[0].split())
                for m in warning_messages]
    marks = [i for i, m in enumerate(messages)
             if "cudnn attention kernel not used because" in m.lower()]
    reasons = [m for m in messages[marks[-1] + 1:] if m] if marks else []
    first = (str(exc).strip().splitlines() or [""])[0]
    text = "; ".join(dict.fromkeys(reasons)) or f"{exc.__class__.__name__}: {first}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."
