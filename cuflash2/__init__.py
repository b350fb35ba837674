"""cuflash2: FlashAttention-2 (forward and backward) for CuPy arrays, JIT-compiled CUDA kernels."""

__version__ = "0.1.0"

from . import block_masks, mods, reference  # noqa: E402  (numpy/cupy reference, no GPU needed)
from .api import (  # noqa: E402
    attention,
    attention_backward,
    attention_kvpacked,
    attention_kvpacked_backward,
    attention_qkvpacked,
    attention_qkvpacked_backward,
    attention_varlen,
    attention_varlen_backward,
    attention_vjp,
    attention_with_kvcache,
    backward_kernels,
    dropout_mask,
    forward_kernels,
    merge_states,
    merge_states_many,
    varlen_forward_kernels,
)
from .block_masks import BlockMask, block_mask  # noqa: E402
from .mods import mask_mod, score_mod  # noqa: E402

__all__ = [
    "attention",
    "attention_backward",
    "attention_vjp",
    "attention_qkvpacked",
    "attention_qkvpacked_backward",
    "attention_kvpacked",
    "attention_kvpacked_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "dropout_mask",
    "merge_states",
    "merge_states_many",
    "forward_kernels",
    "varlen_forward_kernels",
    "backward_kernels",
    "mask_mod",
    "block_mask",
    "BlockMask",
    "score_mod",
    "mods",
    "block_masks",
    "reference",
    "__version__",
]
