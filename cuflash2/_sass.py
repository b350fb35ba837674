"""What a kernel's SASS shows that ptxas's report does not (the compile tests and dev tools; the
package never needs it to run).

ptxas has been seen to give a memory instruction its 64-bit memory descriptor (the `desc[URn]`
of global loads, stores and cp.async copies: the default global descriptor or an L2 cache
policy) in a pair of uniform registers starting at an odd register, `desc[UR5]`; the GPU
refuses that instruction with an illegal-instruction fault the first time it runs (NVRTC 13.0
and 13.5, sm_90a, a decode kernel whose new-token append was moved within its first KV step:
compute-sanitizer put the fault on such a cp.async, and none of the 592 sm_90 specialisations of
the time has one). The compile tests check every kernel they build for it, so the fault is seen
on a machine without a GPU.

The disassembler is `nvdisasm`, from the `nvidia-cuda-nvdisasm` wheel of the test extra or a
CUDA toolkit on PATH.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=None)
def nvdisasm() -> str | None:
    """The path of nvdisasm, or None where there is none."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the namespace of NVIDIA's CUDA wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", ()):
        for candidate in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(candidate)
    return None


def disassemble(cubin: bytes) -> str:
    """The SASS of `cubin` (nvdisasm must be there: see nvdisasm())."""
    tool = nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: install the test extra, pip install '.[test]'")
    with tempfile.TemporaryDirectory(prefix="cuflash2-sass-") as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([tool, "-c", str(path)], check=True, capture_output=True,
                              text=True).stdout


_DESCRIPTOR = re.compile(r"desc\[UR(\d+)\]")
_COMMENT = re.compile(r"/\*[0-9a-f]+\*/")


def odd_descriptor_instructions(sass: str) -> list[str]:
    """The instructions of `sass` whose memory descriptor starts at an odd uniform register
    (see the module's docstring)."""
    return [_COMMENT.sub("", line).strip() for line in sass.splitlines()
            if any(int(register) % 2 for register in _DESCRIPTOR.findall(line))]
