// Hopper (sm_90a) primitives, written as inline PTX: mbarriers, TMA tile loads, wgmma, named
// barriers, setmaxnreg.
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
#pragma once
#include "mma_primitives.cuh"
// TensorMap, the 128 bytes of a CUtensorMap, is a kernel parameter type.
#include "kernel_params.cuh"

typedef unsigned long long u64;

// ---- mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier") ----
// A 64-bit shared-memory object counting arrivals and, for TMA, transaction bytes. A phase
// completes when its expected arrivals have arrived and its expected bytes have landed; phase k
// completes with parity k & 1, and a waiter names the parity it waits for.

// `count` arrivals complete a phase.
CF2_DEVICE void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the TMA unit completes them);
// issued once by the initialising thread, before the CTA-wide barrier that publishes them
// ("Memory Consistency Model: proxies"; fence.mbarrier_init).
CF2_DEVICE void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also raises the bytes the current phase waits for by `bytes`: the producer's
// announcement of a TMA load (the load's complete_tx then counts the bytes down).
CF2_DEVICE void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

CF2_DEVICE void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Whether the phase of parity `parity` has completed (try_wait may also suspend the thread for
// a while, which is why a loop over it is cheaper than one over test_wait).
CF2_DEVICE bool mbarrier_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits for the phase of parity `parity`. The loop is C++ (no PTX labels), so this inlines any
// number of times. A freshly initialised barrier is in phase 0, so a wait for parity 1 passes at
// once: a producer's first wait on an empty slot uses that.
// Debugging aid: compiled with -DCF2_MBARRIER_WATCHDOG, a wait that lasts about 2^32 cycles
// (~2 s) traps, so that a wrong byte count or parity fails the launch instead of hanging the
// device. It is off by default: the trap's control flow alone makes ptxas spill the d=128
// forward's consumers (28 bytes, sm_90a, NVRTC 13.5).
CF2_DEVICE void mbarrier_wait(u32 bar, u32 parity) {
#ifdef CF2_MBARRIER_WATCHDOG
    if (mbarrier_try_wait(bar, parity)) return;
    const long long start = clock64();
    while (!mbarrier_try_wait(bar, parity))
        if (clock64() - start > (1ll << 32)) asm volatile("trap;\n");
#else
    while (!mbarrier_try_wait(bar, parity)) {
    }
#endif
}

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
// The operand lists are written out: inline asm needs one constraint per register.
#define CF2_ACC4(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define CF2_ACC_N64(d)                                                                      \
    CF2_ACC4(d, 0), CF2_ACC4(d, 1), CF2_ACC4(d, 2), CF2_ACC4(d, 3), CF2_ACC4(d, 4),        \
        CF2_ACC4(d, 5), CF2_ACC4(d, 6), CF2_ACC4(d, 7)
#define CF2_ACC_N128(d)                                                                     \
    CF2_ACC_N64(d), CF2_ACC4(d, 8), CF2_ACC4(d, 9), CF2_ACC4(d, 10), CF2_ACC4(d, 11),      \
        CF2_ACC4(d, 12), CF2_ACC4(d, 13), CF2_ACC4(d, 14), CF2_ACC4(d, 15)
#define CF2_D_N64                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CF2_D_N128                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "   \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// SS: A and B from descriptors, both K-major (imm-trans-a = imm-trans-b = 0). `accumulate` 0
// makes the old D ignored (scale-d predicate false): the first k-step needs no zeroed D.
#define CF2_WGMMA_SS(SHAPE, TYPE, DLIST, IA, IB, ISCALE, ...)                                  \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " ISCALE ", 0;\n\t"                     \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DLIST ", " IA \
                 ", " IB ", p, 1, 1, 0, 0;\n\t}\n"                                             \
                 : __VA_ARGS__                                                                  \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename Elem, int N>
CF2_DEVICE void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int accumulate) {
    static_assert(N == 64 || N == 128, "wgmma_ss: n64 or n128");
    if constexpr (N == 64) {
        if constexpr (Elem::is_bf16)
            CF2_WGMMA_SS("m64n64k16", "bf16", CF2_D_N64, "%32", "%33", "%34", CF2_ACC_N64(d));
        else
            CF2_WGMMA_SS("m64n64k16", "f16", CF2_D_N64, "%32", "%33", "%34", CF2_ACC_N64(d));
    } else {
        if constexpr (Elem::is_bf16)
            CF2_WGMMA_SS("m64n128k16", "bf16", CF2_D_N128, "%64", "%65", "%66", CF2_ACC_N128(d));
        else
            CF2_WGMMA_SS("m64n128k16", "f16", CF2_D_N128, "%64", "%65", "%66", CF2_ACC_N128(d));
    }
}

// RS: A from registers (4 x b32 = this warp's 16 x 16 slice), B from a descriptor, MN-major
// (imm-trans-b = 1: V stored [keys x head dim] is B = V with N = head dim contiguous).
#define CF2_WGMMA_RS(SHAPE, TYPE, DLIST, IA, IB, ISCALE, ...)                                  \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, " ISCALE ", 0;\n\t"                     \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DLIST ", " IA \
                 ", " IB ", p, 1, 1, 1;\n\t}\n"                                                \
                 : __VA_ARGS__                                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <typename Elem, int N>
CF2_DEVICE void wgmma_rs_trans_b(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b,
                                 int accumulate) {
    static_assert(N == 64 || N == 128, "wgmma_rs_trans_b: n64 or n128");
    if constexpr (N == 64) {
        if constexpr (Elem::is_bf16)
            CF2_WGMMA_RS("m64n64k16", "bf16", CF2_D_N64, "{%32, %33, %34, %35}", "%36", "%37",
                         CF2_ACC_N64(d));
        else
            CF2_WGMMA_RS("m64n64k16", "f16", CF2_D_N64, "{%32, %33, %34, %35}", "%36", "%37",
                         CF2_ACC_N64(d));
    } else {
        if constexpr (Elem::is_bf16)
            CF2_WGMMA_RS("m64n128k16", "bf16", CF2_D_N128, "{%64, %65, %66, %67}", "%68", "%69",
                         CF2_ACC_N128(d));
        else
            CF2_WGMMA_RS("m64n128k16", "f16", CF2_D_N128, "{%64, %65, %66, %67}", "%68", "%69",
                         CF2_ACC_N128(d));
    }
}

#undef CF2_WGMMA_SS
#undef CF2_WGMMA_RS
#undef CF2_D_N64
#undef CF2_D_N128
#undef CF2_ACC_N64
#undef CF2_ACC_N128
#undef CF2_ACC4
