"""One attention call (forward and backward, or the forward alone) for Nsight Compute:
python benchmarks/dev/dev_ncu_one.py D [SEQLEN] [causal|full] [fp16|bf16] [fwd|bwd] on the paper
grid's shape (16k tokens, hidden 2048), through the public API (whatever the dispatcher runs).
python benchmarks/dev/dev_ncu_one.py decode CACHE [BATCH]: one decoding step of bench --decode's
table instead (fp16, d=128, 32/4 heads, a token appended; CACHE tokens, batch 1 by default), e.g.
OUT=DIR sh benchmarks/dev/dev_ncu_source.sh dec4k flash_decode decode 4096 for the stall samples
of the clustered batch-1 step."""
import sys; sys.path.insert(0, ".")  # noqa: E702
import cupy
import ml_dtypes
import numpy
from cuflash2 import api, testing

if sys.argv[1] == "decode":
    from cuflash2 import attention_with_kvcache
    from cuflash2.bench import decode, timing

    cache_len = int(sys.argv[2])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    q, kc, vc, k1, lengths = decode.decode_inputs(cupy, numpy.float16, batch, cache_len, 32, 4)
    timing.l2_flush(cupy)()  # the cache comes from memory, as in the table
    attention_with_kvcache(q, kc, vc, k=k1, v=k1, cache_seqlens=lengths, causal=True)
    cupy.cuda.Device().synchronize()
    sys.exit(0)
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
