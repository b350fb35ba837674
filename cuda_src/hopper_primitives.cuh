// Hopper (sm_90a) primitives, written as inline PTX: TMA tile loads, wgmma, named barriers,
// setmaxnreg (and, from mbarrier.cuh, the mbarriers).
//
// Like mma_primitives.cuh (which explains why: cuda_fp16.h / cuda_bf16.h drift between CUDA 12
// and 13 and are not always installed next to NVRTC), no CUDA header is included, and 16-bit
// elements are plain 16-bit words with fp16 / bf16 as a tag type.
//
// Every encoding and instruction sequence here is the one ../shared/examples/wgmma_tma_probe.py
// ran and checked on an H200 (its README lists them): the wgmma matrix descriptor with 128-byte
// swizzle, the per-k16 address steps, the accumulator and A-fragment layouts, the mbarrier
// parity protocol and the fences. Sections cited are those of the PTX ISA (version 8.x).
// These instructions need the `sm_90a` target: plain sm_90 rejects wgmma and setmaxnreg.
// Added for the Hopper backward (and run since, on the H200 and the H100): bulk_load,
// stmatrix_x4_trans and wgmma_ss_trans_b (docs/HOPPER_BWD.md lists what its first run checked).
#pragma once
#include "mma_primitives.cuh"
// TensorMap, the 128 bytes of a CUtensorMap, is a kernel parameter type.
#include "kernel_params.cuh"
#include "mbarrier.cuh"

// ---- TMA: cp.async.bulk.tensor ("Data Movement and Conversion Instructions:
// cp.async.bulk.tensor") ------------------------------------------------------------------------
// A box of a tensor described by a CUtensorMap (built on the host by cuTensorMapEncodeTiled) is
// copied into shared memory by the tensor-memory accelerator, and the copy's bytes complete_tx on
// an mbarrier. Elements of the box outside the tensor are zero-filled, and still count as bytes.
// The map is passed as a `const __grid_constant__` kernel parameter and addressed generically.

CF2_DEVICE u64 tensor_map_address(const TensorMap& map) {
    return reinterpret_cast<u64>(&map);
}

// 2-D box at coordinates {c0 (innermost, in elements), c1}.
CF2_DEVICE void tma_load_2d(u32 dst, const TensorMap& map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// 4-D box at {c0, c1, c2, c3}: the attention kernels map (head dim, row, head, batch), so one map
// covers a whole strided (batch, seqlen, heads, headdim) array with no copy, and rows past a
// sequence's end are out of bounds of that sequence (zero-filled), never the next head's rows.
CF2_DEVICE void tma_load_4d(u32 dst, const TensorMap& map, u32 bar, int c0, int c1, int c2,
                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(dst), "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory by the bulk-copy engine, completing `bytes` on the mbarrier `bar`
// ("cp.async.bulk", non-tensor form): the backward's per-row statistics, which are flat fp32
// arrays, land on the same barrier as the tile they belong to.
CF2_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// Adds `bytes` contiguous fp32 values of shared memory to global memory by the bulk-copy engine
// ("cp.reduce.async.bulk", non-tensor form; a multiple of 16 bytes, both addresses 16-byte
// aligned): each element's addition is atomic, so CTAs may add to the same rows. Completes in
// the thread's bulk async-group (bulk_commit_group, bulk_wait_group_read / bulk_wait_group).
CF2_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

CF2_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most PENDING of this thread's bulk groups still read their shared memory (the
// source may then be rewritten).
template <int PENDING>
CF2_DEVICE void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(PENDING) : "memory");
}

// Waits until at most PENDING of this thread's bulk groups are incomplete (writes included).
template <int PENDING>
CF2_DEVICE void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Orders this thread's async-proxy global accesses (bulk reductions) with its generic-proxy ones
// and vice versa: between a completed bulk reduction and the release that publishes it, and
// between an acquire and the bulk reduction it allows.
CF2_DEVICE void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// A semaphore in global memory: its value read with acquire semantics at GPU scope
// (mma_primitives.cuh: load_acquire_gpu), and an increment with release semantics
// (FlashAttention-3's ordered dQ of its deterministic backward).
CF2_DEVICE void increment_release_gpu(int* sem) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}

// Waits until `*sem` equals `value` (acquire).
CF2_DEVICE void wait_semaphore(const int* sem, int value) {
    spin_until([&] { return load_acquire_gpu(sem) == value; });
}

// Orders this thread's generic-proxy shared-memory accesses with later async-proxy ones (TMA,
// wgmma operand reads) and vice versa ("Memory Consistency Model: proxies"; fence.proxy.async).
CF2_DEVICE void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- named barriers ("bar, barrier") ---------------------------------------------------------
// `bar.sync id, n`: the first n threads (a multiple of 32) to arrive at barrier `id` release each
// other. Barrier 0 is __syncthreads(); a warpgroup synchronises alone on its own id.
CF2_DEVICE void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// `bar.arrive id, n`: counts this warp's threads towards barrier `id` without waiting; the
// threads that bar.sync on it wait for them (a producer / consumer hand-over).
CF2_DEVICE void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- stmatrix ("Data Movement and Conversion Instructions: stmatrix") ---------------------
// Four 8 x 8 matrices of 16-bit elements, each held by the warp in the mma accumulator / A
// fragment layout (lane l: row l / 4, columns 2 (l % 4), + 1 in one b32, matrix j in r[j]),
// stored to shared memory. With .trans each matrix is stored transposed: column c of matrix j
// (8 elements, 16 bytes) goes to the address lane 8 j + c supplies. The Hopper backward uses it
// to write dS^T, computed with keys as rows, as dS with queries as rows (the A operand of
// dQ = dS K) in one instruction per four matrices instead of 2-byte stores.
CF2_DEVICE void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// The same without .trans: row i of matrix j (16 bytes, held in r[j] by lanes 4 i .. 4 i + 3)
// goes to the address lane 8 j + i supplies. The FP8 forward's transposers store V's
// keys-last rows with it (sm90/fwd_transpose_v.cuh).
CF2_DEVICE void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ---- setmaxnreg ("Miscellaneous Instructions: setmaxnreg") -----------------------------------
// Moves registers between the warpgroups of a CTA: a warpgroup that only issues loads gives its
// registers back (dec) so that the ones doing the math can take them (inc). ptxas honours it only
// when it knows the register count at entry, i.e. the kernel has __launch_bounds__(threads, 1),
// and when each warpgroup's role is one branch of an if / else; otherwise it prints C7508 and
// ignores it. The count must be a multiple of 8 in [24, 256].
template <int REGS>
CF2_DEVICE void setmaxnreg_dec() {
    static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg range");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

template <int REGS>
CF2_DEVICE void setmaxnreg_inc() {
    static_assert(REGS % 8 == 0 && REGS >= 24 && REGS <= 256, "setmaxnreg range");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// ---- wgmma ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions") ----------
// One warpgroup (4 warps, 128 threads) computes D (64 x N, fp32, in registers) += A (64 x 16) *
// B (16 x N). B always comes from shared memory through a matrix descriptor; A from a descriptor
// (SS) or from registers (RS). The instructions are asynchronous: issue them after
// wgmma.fence, close the batch with commit_group, and read D only after wait_group.

// Shared-memory matrix descriptor ("Matrix Descriptor Format"): bits 0-13 start address >> 4,
// 16-29 leading-dimension byte offset (LBO) >> 4, 32-45 stride-dimension byte offset (SBO) >> 4,
// 49-51 base offset (0: every tile is 1024-byte aligned), 62-63 swizzle mode (1 = 128-byte).
// The tiles are those the TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: rows of 128 bytes (64
// elements), the 16-byte chunk c of row r at chunk slot c ^ (r % 8).
//  - K-major operand (Q as A, K as B of S = Q K^T): SBO = 1024 (8 rows x 128 B); LBO unused
//    (set to 16). The k16 step kk inside a 64-column panel starts 32 * kk bytes further.
//  - MN-major operand (V as B of O = P V, with imm-trans-b = 1): SBO = 1024 between groups of 8
//    keys, LBO = the distance between 64-column panels along N. The k16 step kk (16 keys) starts
//    16 * 128 = 2048 * kk bytes further.
CF2_DEVICE u64 smem_matrix_descriptor(u32 smem_addr, u32 lbo, u32 sbo) {
    return static_cast<u64>((smem_addr & 0x3FFFFu) >> 4) |
           (static_cast<u64>((lbo >> 4) & 0x3FFFu) << 16) |
           (static_cast<u64>((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Required before the first wgmma, and again whenever the accumulators or the A registers were
// written by other instructions ("wgmma.fence").
CF2_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CF2_DEVICE void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int PENDING_GROUPS>
CF2_DEVICE void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING_GROUPS) : "memory");
}

// The compiler sees each wgmma as an ordinary asm statement that writes D at once; this empty
// volatile asm on every register (placed right after wgmma_wait_group, and before wgmma_fence)
// keeps it from moving reads or writes of those registers across the asynchronous window.
template <int N>
CF2_DEVICE void pin_registers(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
template <int N>
CF2_DEVICE void pin_registers(u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// Register layouts ("Register Fragments and Shared Memory Matrix Layouts" of wgmma .m64nNk16),
// with w the warp of the warpgroup, g = lane / 4, t = lane % 4:
//  - accumulator d[N/8][4]: d[nt][e] is row 16w + g + 8 * (e / 2), column 8 nt + 2t + e % 2.
//    Per warp this is exactly the m16n8 accumulator layout of mma.sync with n-tile nt, so the
//    online softmax, masking and score modifiers of the mma.sync kernels apply unchanged.
//  - A from registers a[4] (16 x 16 per warp): a[0] row g, cols 2t, 2t+1; a[1] row g + 8, same
//    cols; a[2] row g, cols 2t + 8, 2t + 9; a[3] row g + 8, same cols; the lower column in the low
//    16 bits. The m16n8k16 A layout: P packed by OnlineSoftmax::exp_pack feeds wgmma directly.
// Inline asm needs one constraint and one %n per register, so the operand lists are generated
// by the preprocessor, in n16 column groups of 8 accumulator registers (two n8 tiles; every N
// used is a multiple of 16: P V steps over BLOCK_N keys and Q K^T over the head dim in k16
// steps). For an N of G groups the accumulators are operands 0 .. 8G - 1 and the instruction's
// other operands (descriptors, A registers, the scale predicate's source) follow, taking the
// first numbers of "group" G. N = 256 has 128 "+f" operands plus 6 inputs; NVRTC 13 takes them.
//  - CF2_OPS_g: the operand numbers 8g .. 8g + 7;
//  - CF2_TEXT8(g): their PTX text "%8g, ..., %8g+7"; CF2_OP(g, i): the text of number 8g + i;
//  - CF2_DLIST_G: the text "%0, ..., %(8G - 1)" of the first G groups (the D vector);
//  - CF2_ACCS_G(d): the "+f" constraints of the first G groups of d[N / 8][4];
//  - CF2_FOR_EACH_N16(X): X(G, N) for N = 16 G up to 256.
#define CF2_OPS_0 0, 1, 2, 3, 4, 5, 6, 7
#define CF2_OPS_1 8, 9, 10, 11, 12, 13, 14, 15
#define CF2_OPS_2 16, 17, 18, 19, 20, 21, 22, 23
#define CF2_OPS_3 24, 25, 26, 27, 28, 29, 30, 31
#define CF2_OPS_4 32, 33, 34, 35, 36, 37, 38, 39
#define CF2_OPS_5 40, 41, 42, 43, 44, 45, 46, 47
#define CF2_OPS_6 48, 49, 50, 51, 52, 53, 54, 55
#define CF2_OPS_7 56, 57, 58, 59, 60, 61, 62, 63
#define CF2_OPS_8 64, 65, 66, 67, 68, 69, 70, 71
#define CF2_OPS_9 72, 73, 74, 75, 76, 77, 78, 79
#define CF2_OPS_10 80, 81, 82, 83, 84, 85, 86, 87
#define CF2_OPS_11 88, 89, 90, 91, 92, 93, 94, 95
#define CF2_OPS_12 96, 97, 98, 99, 100, 101, 102, 103
#define CF2_OPS_13 104, 105, 106, 107, 108, 109, 110, 111
#define CF2_OPS_14 112, 113, 114, 115, 116, 117, 118, 119
#define CF2_OPS_15 120, 121, 122, 123, 124, 125, 126, 127
#define CF2_OPS_16 128, 129, 130, 131, 132, 133, 134, 135
#define CF2_APPLY(M, ...) M(__VA_ARGS__)
#define CF2_TEXT8_(a, b, c, d, e, f, g, h) \
    "%" #a ", %" #b ", %" #c ", %" #d ", %" #e ", %" #f ", %" #g ", %" #h
#define CF2_TEXT8(g) CF2_APPLY(CF2_TEXT8_, CF2_OPS_##g)
#define CF2_OP0_(a, ...) "%" #a
#define CF2_OP1_(a, b, ...) "%" #b
#define CF2_OP2_(a, b, c, ...) "%" #c
#define CF2_OP3_(a, b, c, d, ...) "%" #d
#define CF2_OP4_(a, b, c, d, e, ...) "%" #e
#define CF2_OP5_(a, b, c, d, e, f, ...) "%" #f
#define CF2_OP(g, i) CF2_APPLY(CF2_OP##i##_, CF2_OPS_##g)
#define CF2_DLIST_1 CF2_TEXT8(0)
#define CF2_DLIST_2 CF2_DLIST_1 ", " CF2_TEXT8(1)
#define CF2_DLIST_3 CF2_DLIST_2 ", " CF2_TEXT8(2)
#define CF2_DLIST_4 CF2_DLIST_3 ", " CF2_TEXT8(3)
#define CF2_DLIST_5 CF2_DLIST_4 ", " CF2_TEXT8(4)
#define CF2_DLIST_6 CF2_DLIST_5 ", " CF2_TEXT8(5)
#define CF2_DLIST_7 CF2_DLIST_6 ", " CF2_TEXT8(6)
#define CF2_DLIST_8 CF2_DLIST_7 ", " CF2_TEXT8(7)
#define CF2_DLIST_9 CF2_DLIST_8 ", " CF2_TEXT8(8)
#define CF2_DLIST_10 CF2_DLIST_9 ", " CF2_TEXT8(9)
#define CF2_DLIST_11 CF2_DLIST_10 ", " CF2_TEXT8(10)
#define CF2_DLIST_12 CF2_DLIST_11 ", " CF2_TEXT8(11)
#define CF2_DLIST_13 CF2_DLIST_12 ", " CF2_TEXT8(12)
#define CF2_DLIST_14 CF2_DLIST_13 ", " CF2_TEXT8(13)
#define CF2_DLIST_15 CF2_DLIST_14 ", " CF2_TEXT8(14)
#define CF2_DLIST_16 CF2_DLIST_15 ", " CF2_TEXT8(15)
#define CF2_ACC4(d, t) "+f"(d[t][0]), "+f"(d[t][1]), "+f"(d[t][2]), "+f"(d[t][3])
#define CF2_ACC8(d, g) CF2_ACC4(d, 2 * (g)), CF2_ACC4(d, 2 * (g) + 1)
#define CF2_ACCS_1(d) CF2_ACC8(d, 0)
#define CF2_ACCS_2(d) CF2_ACCS_1(d), CF2_ACC8(d, 1)
#define CF2_ACCS_3(d) CF2_ACCS_2(d), CF2_ACC8(d, 2)
#define CF2_ACCS_4(d) CF2_ACCS_3(d), CF2_ACC8(d, 3)
#define CF2_ACCS_5(d) CF2_ACCS_4(d), CF2_ACC8(d, 4)
#define CF2_ACCS_6(d) CF2_ACCS_5(d), CF2_ACC8(d, 5)
#define CF2_ACCS_7(d) CF2_ACCS_6(d), CF2_ACC8(d, 6)
#define CF2_ACCS_8(d) CF2_ACCS_7(d), CF2_ACC8(d, 7)
#define CF2_ACCS_9(d) CF2_ACCS_8(d), CF2_ACC8(d, 8)
#define CF2_ACCS_10(d) CF2_ACCS_9(d), CF2_ACC8(d, 9)
#define CF2_ACCS_11(d) CF2_ACCS_10(d), CF2_ACC8(d, 10)
#define CF2_ACCS_12(d) CF2_ACCS_11(d), CF2_ACC8(d, 11)
#define CF2_ACCS_13(d) CF2_ACCS_12(d), CF2_ACC8(d, 12)
#define CF2_ACCS_14(d) CF2_ACCS_13(d), CF2_ACC8(d, 13)
#define CF2_ACCS_15(d) CF2_ACCS_14(d), CF2_ACC8(d, 14)
#define CF2_ACCS_16(d) CF2_ACCS_15(d), CF2_ACC8(d, 15)
#define CF2_FOR_EACH_N16(X) \
    X(1, 16) \
    X(2, 32) \
    X(3, 48) \
    X(4, 64) \
    X(5, 80) \
    X(6, 96) \
    X(7, 112) \
    X(8, 128) \
    X(9, 144) \
    X(10, 160) \
    X(11, 176) \
    X(12, 192) \
    X(13, 208) \
    X(14, 224) \
    X(15, 240) \
    X(16, 256)

// SS: A and B from descriptors, both K-major (imm-trans-a = imm-trans-b = 0). `accumulate` 0
// makes the old D ignored (scale-d predicate false): the first k-step needs no zeroed D.
#define CF2_WGMMA_SS(G, N, TYPE)                                                               \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " CF2_OP(G, 2) ", 0;\n\t"              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE               \
                 " {" CF2_DLIST_##G "}, " CF2_OP(G, 0) ", " CF2_OP(G, 1) ", p, 1, 1, 0, 0;\n\t}\n" \
                 : CF2_ACCS_##G(d)                                                             \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

// TF32 (float32 elements, Elem::IS_F32): k8 instead of k16, and no transpose operands: both
// A and B must be K-major ("wgmma.mma_async": imm-trans-a / imm-trans-b exist for .f16 and
// .bf16 only). A k8 step of float32 is 32 bytes of a row, as a k16 step of 16-bit elements, so
// the descriptors and their per-step offsets are the same. The operands are float32 values
// already rounded to TF32 (cvt.rna): the kernel rounds what it gives the tensor cores, as the
// mma.sync kernels do (tf32_primitives.cuh), rather than leave them the low 13 bits to drop.
// The K-major forms take the instruction's shape and types after its N (SHAPE: CF2_TF32_SHAPE,
// CF2_E4M3_SHAPE): every type without transpose operands.
#define CF2_TF32_SHAPE "k8.f32.tf32.tf32"
// FP8 e4m3 operands (the FP8 forward, e4m3_tag; docs/FP8_FORWARD.md): k32, 32 one-byte
// elements, the same 32 bytes of a row as a 16-bit k16 step, so the descriptors and their
// per-step offsets are again those of issue_kmajor_ss; K-major only, fp32 accumulate.
#define CF2_E4M3_SHAPE "k32.f32.e4m3.e4m3"
#define CF2_WGMMA_SS_KMAJOR(G, N, SHAPE)                                                       \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " CF2_OP(G, 2) ", 0;\n\t"              \
                 "wgmma.mma_async.sync.aligned.m64n" #N SHAPE                                  \
                 " {" CF2_DLIST_##G "}, " CF2_OP(G, 0) ", " CF2_OP(G, 1) ", p, 1, 1;\n\t}\n"      \
                 : CF2_ACCS_##G(d)                                                             \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename Elem, int N>
CF2_DEVICE void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int accumulate) {
    static_assert(N % 16 == 0 && N >= 16 && N <= 256, "wgmma_ss: N a multiple of 16 up to 256");
#define CF2_CASE(G, NN)                                                                        \
    if constexpr (N == NN) {                                                                   \
        if constexpr (Elem::IS_F32)                                                            \
            CF2_WGMMA_SS_KMAJOR(G, NN, CF2_TF32_SHAPE);                                        \
        else if constexpr (Elem::IS_E4M3)                                                      \
            CF2_WGMMA_SS_KMAJOR(G, NN, CF2_E4M3_SHAPE);                                        \
        else if constexpr (Elem::is_bf16)                                                      \
            CF2_WGMMA_SS(G, NN, "bf16");                                                       \
        else                                                                                   \
            CF2_WGMMA_SS(G, NN, "f16");                                                        \
    }
    CF2_FOR_EACH_N16(CF2_CASE)
#undef CF2_CASE
}

// SS with B MN-major (imm-trans-b = 1), A K-major: the backward's dQ = dS K, whose B (K, stored
// [keys x head dim]) is laid out as V is for the forward's P V. Same descriptors as the RS form.
#define CF2_WGMMA_SS_TB(G, N, TYPE)                                                            \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " CF2_OP(G, 2) ", 0;\n\t"              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE               \
                 " {" CF2_DLIST_##G "}, " CF2_OP(G, 0) ", " CF2_OP(G, 1) ", p, 1, 1, 0, 1;\n\t}\n" \
                 : CF2_ACCS_##G(d)                                                             \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename Elem, int N>
CF2_DEVICE void wgmma_ss_trans_b(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int accumulate) {
    static_assert(N % 16 == 0 && N >= 16 && N <= 256,
                  "wgmma_ss_trans_b: N a multiple of 16 up to 256");
#define CF2_CASE(G, NN)                                                                        \
    if constexpr (N == NN) {                                                                   \
        if constexpr (Elem::is_bf16)                                                           \
            CF2_WGMMA_SS_TB(G, NN, "bf16");                                                    \
        else                                                                                   \
            CF2_WGMMA_SS_TB(G, NN, "f16");                                                     \
    }
    CF2_FOR_EACH_N16(CF2_CASE)
#undef CF2_CASE
}

// RS: A from registers (4 x b32 = this warp's 16 x 16 slice), B from a descriptor, MN-major
// (imm-trans-b = 1: V stored [keys x head dim] is B = V with N = head dim contiguous).
#define CF2_WGMMA_RS(G, N, TYPE)                                                               \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " CF2_OP(G, 5) ", 0;\n\t"              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE               \
                 " {" CF2_DLIST_##G "}, {" CF2_OP(G, 0) ", " CF2_OP(G, 1) ", " CF2_OP(G, 2) ", " \
                 CF2_OP(G, 3) "}, " CF2_OP(G, 4) ", p, 1, 1, 1;\n\t}\n"                          \
                 : CF2_ACCS_##G(d)                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <typename Elem, int N>
CF2_DEVICE void wgmma_rs_trans_b(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b,
                                 int accumulate) {
    static_assert(N % 16 == 0 && N >= 16 && N <= 256,
                  "wgmma_rs_trans_b: N a multiple of 16 up to 256");
#define CF2_CASE(G, NN)                                                                        \
    if constexpr (N == NN) {                                                                   \
        if constexpr (Elem::is_bf16)                                                           \
            CF2_WGMMA_RS(G, NN, "bf16");                                                       \
        else                                                                                   \
            CF2_WGMMA_RS(G, NN, "f16");                                                        \
    }
    CF2_FOR_EACH_N16(CF2_CASE)
#undef CF2_CASE
}

// RS with K-major B (TF32 or e4m3 operands, which have no transpose operands): A from
// registers, B from a K-major descriptor; the P V of the float32 and FP8 Hopper forwards, whose
// V is stored with its keys innermost (issue_pv, sm90/fwd_mainloop.cuh). A is this warp's 16 rows
// in 4 x b32, the mma.sync A layout of the k-step: TF32 (m16n8k8) a[0] row g, column t; a[1] row
// g + 8, column t; a[2] row g, column t + 4; a[3] row g + 8, column t + 4. e4m3 (m16n8k32) four
// bytes a register: a[0] row g, columns 4t .. 4t + 3; a[1] row g + 8, the same; a[2], a[3]
// columns 16 + 4t .. of rows g, g + 8 (pack_probabilities_e4m3).
#define CF2_WGMMA_RS_KMAJOR(G, N, SHAPE)                                                       \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " CF2_OP(G, 5) ", 0;\n\t"              \
                 "wgmma.mma_async.sync.aligned.m64n" #N SHAPE                                  \
                 " {" CF2_DLIST_##G "}, {" CF2_OP(G, 0) ", " CF2_OP(G, 1) ", " CF2_OP(G, 2) ", " \
                 CF2_OP(G, 3) "}, " CF2_OP(G, 4) ", p, 1, 1;\n\t}\n"                            \
                 : CF2_ACCS_##G(d)                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <typename Elem, int N>
CF2_DEVICE void wgmma_rs_kmajor(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b,
                                int accumulate) {
    static_assert(N % 16 == 0 && N >= 16 && N <= 256,
                  "wgmma_rs_kmajor: N a multiple of 16 up to 256");
    static_assert(Elem::IS_F32 || Elem::IS_E4M3, "K-major B: TF32 or e4m3 operands");
#define CF2_CASE(G, NN)                                                                        \
    if constexpr (N == NN) {                                                                   \
        if constexpr (Elem::IS_E4M3)                                                           \
            CF2_WGMMA_RS_KMAJOR(G, NN, CF2_E4M3_SHAPE);                                        \
        else                                                                                   \
            CF2_WGMMA_RS_KMAJOR(G, NN, CF2_TF32_SHAPE);                                        \
    }
    CF2_FOR_EACH_N16(CF2_CASE)
#undef CF2_CASE
}

// Four floats as e4m3 bytes (byte 0 first): nearest, saturated to +-448 (cvt's satfinite; the
// converted `a` operand of cvt goes to the upper byte of each pair).
CF2_DEVICE u32 pack_e4m3x4(float b0, float b1, float b2, float b3) {
    u32 packed;
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}\n"
        : "=r"(packed)
        : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
    return packed;
}

// P's A fragment of one k32 step of P V from the S accumulator's four n8 tiles of the step
// (s[j]: keys 8j + 2t, 8j + 2t + 1 of row g in [0], [1], of row g + 8 in [2], [3]; g = lane /
// 4 in the warp's 16 rows, t = lane % 4), as e4m3, without shuffles: the e4m3 A fragment holds
// columns 4t .. 4t + 3 of row g in register 0 (of row g + 8 in 1) and 16 + 4t .. 16 + 4t + 3
// in register 2 (3), and column 4t + b takes key 2t + (b & 1) + 8 (b >> 1) (+16 in registers
// 2, 3): the order in which the FP8 forward's keys-last V holds each group of 32 keys
// (docs/FP8_FORWARD.md; the A layout is mma.m16n8k32's, as the FP8 forward's GPU tests confirm).
CF2_DEVICE void pack_probabilities_e4m3(u32 (&a)[4], const float (&s)[4][4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // keys 0-15, 16-31 of the step
        const float (&lo)[4] = s[2 * half];
        const float (&hi)[4] = s[2 * half + 1];
        a[2 * half] = pack_e4m3x4(lo[0], lo[1], hi[0], hi[1]);      // row g
        a[2 * half + 1] = pack_e4m3x4(lo[2], lo[3], hi[2], hi[3]);  // row g + 8
    }
}

// The generator tables (CF2_OPS_*, CF2_DLIST_*, CF2_ACCS_*, ...) stay defined: CF2_-prefixed and
// used nowhere else.
#undef CF2_WGMMA_SS
#undef CF2_WGMMA_SS_KMAJOR
#undef CF2_WGMMA_RS_KMAJOR
#undef CF2_TF32_SHAPE
#undef CF2_E4M3_SHAPE
#undef CF2_WGMMA_SS_TB
#undef CF2_WGMMA_RS

// The CTA of both Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu): warpgroup 0 is the
// producer, which gives most of its registers away (setmaxnreg.dec) and issues the TMA loads;
// the consumer warpgroups take them (setmaxnreg.inc) for their wgmma accumulators. Tiles in
// shared memory are what the TMA writes with 128-byte swizzle: panels of 64 columns (128-byte
// rows), one after the other, the dynamic base aligned to 1024 B by hand (the swizzle pattern
// repeats every 8 rows = 1024 B, and the descriptors' base offset is 0): 1024 B of slack.
struct Sm90CtaLayout {
    static constexpr int WARPGROUP_THREADS = 128;
    static constexpr int PRODUCER_REGISTERS = 24;
    static constexpr int CONSUMER_REGISTERS = 240;
    static constexpr int PANEL_COLS = 64;
    static constexpr int ROW_BYTES = PANEL_COLS * 2;
    static constexpr int SMEM_ALIGN = 1024;
    // What ptxas may use a thread at entry, before setmaxnreg: the register file over the threads.
    __host__ __device__ static constexpr int entry_registers(int threads) {
        return (65536 / threads) / 8 * 8;
    }
    // The setmaxnreg split fits the register file (24 x 128 + 240 x 256 = 64512 <= 65536).
    __host__ __device__ static constexpr bool split_fits(
        int consumer_threads, int consumer_registers = CONSUMER_REGISTERS) {
        return PRODUCER_REGISTERS * WARPGROUP_THREADS + consumer_registers * consumer_threads <=
               65536;
    }
    // What a consumer thread may take after setmaxnreg.inc beside the producer's 24, with
    // `warpgroups` consumer warpgroups: 240 for two, 160 for three (a multiple of 8, at most 240).
    __host__ __device__ static constexpr int consumer_registers(int warpgroups) {
        const int share = (65536 - PRODUCER_REGISTERS * WARPGROUP_THREADS) /
                          (warpgroups * WARPGROUP_THREADS) / 8 * 8;
        return share < CONSUMER_REGISTERS ? share : CONSUMER_REGISTERS;
    }
};

// A tile of a (head dim, row, head, batch) tensor map into shared memory at `dst`: rows from
// `row` of (`head`, `batch`), one 128-byte-wide box a panel (PANEL_ELEMENTS columns: 64 16-bit
// elements, 32 float32), PANELS panels PANEL_BYTES apart, all completing on the mbarrier `bar`
// (the caller has set the bytes it expects).
template <int PANELS, int PANEL_BYTES, int PANEL_ELEMENTS = Sm90CtaLayout::PANEL_COLS>
CF2_DEVICE void tma_load_tile(u32 dst, const TensorMap& map, u32 bar, int row, int head,
                              int batch) {
#pragma unroll
    for (int panel = 0; panel < PANELS; ++panel)
        tma_load_4d(dst + panel * PANEL_BYTES, map, bar, PANEL_ELEMENTS * panel, row, head,
                    batch);
}

// 4-D box at {c0, c1, c2, c3} as tma_load_4d, written at `dst` in the shared memory of every
// CTA of the cluster in `cta_mask` (bit r: rank r), its bytes completing on the mbarrier at
// `bar`'s offset in each of them (".multicast::cluster").
CF2_DEVICE void tma_load_4d_multicast(u32 dst, const TensorMap& map, u32 bar, int c0, int c1,
                                      int c2, int c3, u16 cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
        ::"r"(dst), "l"(tensor_map_address(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar),
          "h"(cta_mask)
        : "memory");
}

// Panels [FIRST, END) of a tile as tma_load_tile, multicast to the CTAs of `cta_mask`.
template <int FIRST, int END, int PANEL_BYTES, int PANEL_ELEMENTS = Sm90CtaLayout::PANEL_COLS>
CF2_DEVICE void tma_load_panels_multicast(u32 dst, const TensorMap& map, u32 bar, int row,
                                          int head, int batch, u16 cta_mask) {
#pragma unroll
    for (int panel = FIRST; panel < END; ++panel)
        tma_load_4d_multicast(dst + panel * PANEL_BYTES, map, bar, PANEL_ELEMENTS * panel, row,
                              head, batch, cta_mask);
}

// Shared-memory address of chunk `chunk` (16 bytes, 8 columns) of row `row` of a tile in the
// 128-byte-swizzled panel layout the TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: panels of
// PANEL_BYTES (64 columns each), 128-byte rows, chunk c of row r at slot c ^ (r % 8) of its row.
template <int PANEL_BYTES>
CF2_DEVICE u32 swizzled_chunk(u32 tile, int row, int chunk) {
    return tile + (chunk / 8) * PANEL_BYTES + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// D = A B^T for one warpgroup over K = 16 * K_STEPS columns: A's 64 rows from `a_rows`, B's N
// rows from `b_tile`, both K-major in 128-byte-swizzled panels (A_PANEL_BYTES, B_PANEL_BYTES
// apart). The k16 step kk lies in panel kk / 4, 32 * (kk % 4) bytes into its 128-byte rows;
// step 0 overwrites D (adds to it with ACCUMULATE: the 3xTF32 forward's second and third
// products). Issues the wgmmas only (inside a wgmma_fence ... commit_group bracket).
template <typename Elem, int N, int K_STEPS, int A_PANEL_BYTES, int B_PANEL_BYTES,
          bool ACCUMULATE = false>
CF2_DEVICE void issue_kmajor_ss(float (&d)[N / 8][4], u32 a_rows, u32 b_tile) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        const u32 step = 32 * (kk % 4);
        const u64 a = smem_matrix_descriptor(a_rows + (kk / 4) * A_PANEL_BYTES + step, 16, 1024);
        const u64 b = smem_matrix_descriptor(b_tile + (kk / 4) * B_PANEL_BYTES + step, 16, 1024);
        wgmma_ss<Elem, N>(d, a, b, ACCUMULATE || kk > 0);
    }
}
