"""Tile configurations: which kernel specialisation serves which problem.

One specialisation per (kernel, dtype, head dim rounded up to the kernel's tile, tile shape, arch).
Causal masking, windows and sequence lengths are run-time arguments: masking only runs on the
boundary tiles, so making it a template flag would multiply compile time for no measurable gain.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Head dims the kernels are built for; a user head dim (multiple of 8, <= 256) is rounded up to
#: the next one and the padding columns are zero-filled in shared memory, never in user arrays.
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

#: Element types by the name the CUDA source uses for their tag type.
DTYPE_TAGS = {"float16": "fp16_tag", "bfloat16": "bf16_tag"}

#: Architectures the CPU compile tests build for (the GPU path compiles for the device's own).
CPU_TEST_ARCHS = (80, 90)


@dataclass(frozen=True)
class FwdConfig:
    """One forward-kernel specialisation."""

    dtype: str  # "float16" or "bfloat16"
    head_dim: int  # kernel head dim (one of KERNEL_HEAD_DIMS)
    block_m: int  # query rows per CTA
    block_n: int  # keys per KV tile
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        # Q tile + one K tile + one V tile, 2 bytes per element (see FwdTraits::SMEM_BYTES).
        return 2 * self.head_dim * (self.block_m + 2 * self.block_n)

    @property
    def source_file(self) -> str:
        return "flash_fwd.cu"

    @property
    def name_expression(self) -> str:
        tag = DTYPE_TAGS[self.dtype]
        return (f"flash_fwd_kernel<{tag}, {self.head_dim}, {self.block_m}, "
                f"{self.block_n}, {self.num_warps}>")


def kernel_head_dim(head_dim: int) -> int:
    """The smallest kernel head dim that holds `head_dim`."""
    for d in KERNEL_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head dim {head_dim} is larger than {KERNEL_HEAD_DIMS[-1]}")


def fwd_config(dtype: str, head_dim: int, arch: int) -> FwdConfig:
    """Tile shape for the forward kernel (FA2's sm80/sm90 choices as the starting point).

    At d=64, FA2's 128 x 128 tile spills here (S alone takes 128 registers a thread), so the KV
    tile is 64 keys. Up to d=128, 4 warps own 32 query rows each (two m16 tiles share every K/V fragment, halving
    shared-memory reads per FLOP); above that the accumulators no longer fit in registers and 8
    warps own 16 rows each.
    """
    del arch  # the same tiles serve sm_80 and sm_90 for now; keep the hook for tuning
    d = kernel_head_dim(head_dim)
    if d <= 32:
        return FwdConfig(dtype, d, block_m=128, block_n=128, num_warps=4)
    if d <= 128:
        return FwdConfig(dtype, d, block_m=128, block_n=64, num_warps=4)
    return FwdConfig(dtype, d, block_m=128, block_n=64, num_warps=8)


def all_fwd_configs(arch: int) -> list[FwdConfig]:
    """Every forward specialisation the dispatcher can choose on `arch`."""
    return [fwd_config(dtype, d, arch) for dtype in DTYPE_TAGS for d in KERNEL_HEAD_DIMS]
