"""Development timing of backward kernel variants on a GPU (not a benchmark of record).

A variant is a named text substitution applied to the kernel sources before compiling, e.g. to
measure what the dQ atomics cost by skipping them. Times the whole backward call at one shape per
(head dim, causal), next to the unmodified kernel.

    python benchmarks/dev/dev_bwd_variants.py --variants base noatomic scalar_red --configs 128:64x128x8x2
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy  # noqa: E402

from cuflash2 import _compile, _configs  # noqa: E402

_S_GEMM = """            gemm_a_bt<Elem, T::SDP_MT, T::SDP_NT, T::D_STEPS>(
                acc_s, rows_cursor<QTile>(q_stage, a_row0, lane),
                pairs_cursor<KVTile>(k_smem, a_key0, lane));
"""
_DP_DECL = """            float acc_dp[T::SDP_MT][T::SDP_NT][4];
            zero_fill(acc_dp);
"""
_DP_GEMM = """            gemm_a_bt<Elem, T::SDP_MT, T::SDP_NT, T::D_STEPS>(
                acc_dp, rows_cursor<QTile>(do_stage, a_row0, lane),
                pairs_cursor<KVTile>(v_smem, a_key0, lane));
"""
_FUSED_CALL = """            gemm_a_bt_pair<Elem, T::SDP_MT, T::SDP_NT, T::D_STEPS>(
                acc_s, rows_cursor<QTile>(q_stage, a_row0, lane),
                pairs_cursor<KVTile>(k_smem, a_key0, lane),
                acc_dp, rows_cursor<QTile>(do_stage, a_row0, lane),
                pairs_cursor<KVTile>(v_smem, a_key0, lane));
"""
_STORE_ANCHOR = "// Stores an accumulator tile as 16-bit pairs"
_PAIR_GEMM = """template <typename Elem, int MT, int NT, int K_STEPS, class ATile, class BTile>
CF2_DEVICE void gemm_a_bt_pair(float (&acc0)[MT][NT][4], const LdmatrixCursor<ATile>& a0,
                               const LdmatrixCursor<BTile>& b0, float (&acc1)[MT][NT][4],
                               const LdmatrixCursor<ATile>& a1, const LdmatrixCursor<BTile>& b1) {
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        u32 af0[MT][4], af1[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af0[mt], a0.at(2 * mt, ks));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af1[mt], a1.at(2 * mt, ks));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bf0[4], bf1[4];
            ldmatrix_x4(bf0, b0.at(2 * np, ks));
            ldmatrix_x4(bf1, b1.at(2 * np, ks));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_m16n16k16<Elem>(acc0[mt][2 * np], acc0[mt][2 * np + 1], af0[mt], bf0);
                mma_m16n16k16<Elem>(acc1[mt][2 * np], acc1[mt][2 * np + 1], af1[mt], bf1);
            }
        }
    }
}

"""

# name -> list of (file, old, new)
VARIANTS = {
    "base": [],
    # dQ is computed but never added (a value-dependent early return keeps the products alive).
    "noatomic": [("mma_primitives.cuh",
                  "CF2_DEVICE void atomic_add_4(float* dst, float a, float b, float c, float d) {\n",
                  "CF2_DEVICE void atomic_add_4(float* dst, float a, float b, float c, float d) {\n"
                  "    if (a != -12345.f) return;\n")],
    # dP = dO V^T issued right after S = Q K^T (before masking and exp2).
    "dp_first": [("flash_bwd.cu", _DP_DECL + _DP_GEMM, ""),
                 ("flash_bwd.cu", _S_GEMM, _S_GEMM + _DP_DECL + _DP_GEMM)],
    # S and dP in one k loop (two independent mma chains per fragment step).
    "fused_sdp": [("warp_gemm.cuh", _STORE_ANCHOR, _PAIR_GEMM + _STORE_ANCHOR),
                  ("flash_bwd.cu", _DP_DECL + _DP_GEMM, ""),
                  ("flash_bwd.cu", _S_GEMM, _DP_DECL + _FUSED_CALL)],
    "scalar_red": [("mma_primitives.cuh", "#if __CUDA_ARCH__ >= 900\n    asm volatile(\"red",
                    "#if 0\n    asm volatile(\"red")],
}

_original_source = _compile.kernel_source


def use_variant(name):
    subs = VARIANTS[name]
    root = _compile.cuda_src_dir()

    def patched(filename):
        text = _original_source(filename)
        for file, old, new in subs:
            original = (root / file).read_text()
            assert old in original, (name, file, old)
            text = text.replace(old, new)
        return text

    _compile.kernel_source = patched
    _compile._modules.clear()


def main():
    import cupy

    from cuflash2 import api, testing
    from cuflash2.bench import timing

    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["base"])
    ap.add_argument("--configs", nargs="+", default=["64:128x128x8x2", "128:64x128x8x2"],
                    help="head_dim:block_m x block_n x warps x q_stages[x sdp x kv x dq row warps]")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    dtype = numpy.dtype(numpy.float16)
    backlog = timing.Backlog(cupy)
    s = args.seqlen
    for spec in args.configs:
        d, shape = spec.split(":")
        d = int(d)
        bm, bn, warps, stages, *grids = map(int, shape.split("x"))
        cfg = _configs.BwdConfig("float16", d, d, bm, bn, warps, stages, not args.deterministic,
                                 *grids)
        assert cfg.valid, cfg
        b, h = 16384 // s, 2048 // d
        q, k, v = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s)
        dout = testing.random_qkv(cupy, b, s, s, h, h, d, dtype, seed=s + 1)[0]
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        for causal in (False, True):
            out, lse = api.attention(q, k, v, causal=causal, return_lse=True)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            for name in args.variants:
                use_variant(name)
                def backward():
                    with api._forced_config(cfg):
                        api.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               deterministic=args.deterministic, dq=grads[0],
                                               dk=grads[1], dv=grads[2])

                ms = timing.time_cupy(cupy, backward, 3, 20, backlog)
                print(f"d={d} {shape} causal={causal} {name}: {ms:.3f} ms "
                      f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
