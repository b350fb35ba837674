"""cuflash2: FlashAttention-2 (forward and backward) for CuPy arrays, JIT-compiled CUDA kernels."""

__version__ = "0.1.0"

from . import reference  # noqa: E402  (numpy/cupy reference, no GPU needed)
from .api import attention, attention_backward, attention_vjp  # noqa: E402

__all__ = ["attention", "attention_backward", "attention_vjp", "reference", "__version__"]
