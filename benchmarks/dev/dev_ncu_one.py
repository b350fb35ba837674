"""One attention call (forward and backward, or the forward alone) for Nsight Compute:
python benchmarks/dev/dev_ncu_one.py D [SEQLEN] [causal|full] [fp16|bf16] [fwd|bwd] on the paper
grid's shape (16k tokens, hidden 2048), through the public API (whatever the dispatcher runs)."""
import sys; sys.path.insert(0, ".")  # noqa: E702
import cupy
import ml_dtypes
import numpy
from cuflash2 import api, testing

d = int(sys.argv[1])
s = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
dtype = numpy.dtype(ml_dtypes.bfloat16 if len(sys.argv) > 4 and sys.argv[4] == "bf16"
                    else numpy.float16)
forward_only = len(sys.argv) > 5 and sys.argv[5] == "fwd"
b, h = max(1, 16384 // s), 2048 // d
q, k, v = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=1)
out, lse = api.attention(q, k, v, causal=causal, return_lse=True)
if not forward_only:
    api.attention_backward(out, q, k, v, out, lse, causal=causal)
cupy.cuda.Device().synchronize()
