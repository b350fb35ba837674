import sys; sys.path.insert(0, ".")
import cupy, numpy
from cuflash2 import api, testing
d = int(sys.argv[1]); s = 4096; b, h = 16384 // s, 2048 // d
q, k, v = testing.random_qkv(cupy, b, s, s, h, h, d, numpy.dtype(numpy.float16), seed=1)
out, lse = api.attention(q, k, v, return_lse=True)
api.attention_backward(out, q, k, v, out, lse)
cupy.cuda.Device().synchronize()
