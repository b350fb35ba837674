// Tensor-core and data-movement primitives, written as inline PTX.
//
// No CUDA headers are included (cuda_fp16.h / cuda_bf16.h drift between CUDA 12 and 13 and are
// not always installed next to NVRTC): 16-bit elements are plain 16-bit words and pairs of them
// live in one 32-bit register, so the same code serves fp16 and bf16. The element type is a tag.
// Memory is addressed in 16-bit words: a tag's WORDS is the words an element takes (float32
// elements, tf32_primitives.cuh: two), so tiles, strides and 16-byte chunks count words. BYTES
// is the same in bytes, for the Hopper forward, whose e4m3 elements (hopper_primitives.cuh,
// e4m3_tag) take half a word; Out is the tag of the output a kernel on these inputs writes
// (e4m3_tag's: a 16-bit one), IS_E4M3 whether the inputs are e4m3.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

struct fp16_tag {
    static constexpr bool is_bf16 = false;
    static constexpr bool IS_F32 = false;
    static constexpr bool IS_E4M3 = false;
    static constexpr bool SPLIT = false;
    static constexpr int WORDS = 1;
    static constexpr int BYTES = 2;
    using Out = fp16_tag;
};
struct bf16_tag {
    static constexpr bool is_bf16 = true;
    static constexpr bool IS_F32 = false;
    static constexpr bool IS_E4M3 = false;
    static constexpr bool SPLIT = false;
    static constexpr int WORDS = 1;
    static constexpr int BYTES = 2;
    using Out = bf16_tag;
};

// The FP8 forward's elements (docs/FP8_FORWARD.md): e4m3 q, k and v, one byte each (e4m3fn:
// 4 exponent bits, 3 mantissa bits, no infinities, largest finite 448), and O in OUT (fp16_tag
// or bf16_tag). No WORDS: only the Hopper forward (hopper_primitives.cuh's e4m3 wgmma), which
// counts bytes (FwdSm90Traits), takes it.
template <class OUT>
struct e4m3_tag {
    static constexpr bool is_bf16 = false;  // (the operands: wgmma's e4m3 forms)
    static constexpr bool IS_F32 = false;
    static constexpr bool IS_E4M3 = true;
    static constexpr bool SPLIT = false;
    static constexpr int BYTES = 1;
    using Out = OUT;
};

// A or B by a compile-time condition (NVRTC has no <type_traits>).
template <bool CONDITION, class A, class B>
struct TypeIf {
    using type = A;
};
template <class A, class B>
struct TypeIf<false, A, B> {
    using type = B;
};

#define CF2_DEVICE __device__ __forceinline__

// Address of a shared-memory object in the .shared window, as ldmatrix / cp.async expect it.
CF2_DEVICE u32 smem_address(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---- mma.sync m16n8k16, fp32 accumulate ------------------------------------------------------
// D (16x8 fp32) += A (16x16, row-major, 4 regs) * B (16x8, "col": k pairs per reg, 2 regs).
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with g = lane / 4 and
// t = lane % 4, c[0..1] hold row g, cols 2t..2t+1 and c[2..3] hold row g+8, same cols.
template <typename Elem>
CF2_DEVICE void mma_m16n8k16(float (&acc)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    if constexpr (Elem::is_bf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// Two adjacent n8 tiles that share the A fragment: `b` holds both tiles' B fragments in the order
// ldmatrix.x4 returns them ({b0, b1} of the first tile, then of the second).
template <typename Elem>
CF2_DEVICE void mma_m16n16k16(float (&acc_lo)[4], float (&acc_hi)[4], const u32 (&a)[4],
                              const u32 (&b)[4]) {
    const u32 b_lo[2] = {b[0], b[1]};
    const u32 b_hi[2] = {b[2], b[3]};
    mma_m16n8k16<Elem>(acc_lo, a, b_lo);
    mma_m16n8k16<Elem>(acc_hi, a, b_hi);
}

// ---- ldmatrix: four 8x8 16-bit matrices from shared memory ----------------------------------
// Lanes 8i..8i+7 supply the row addresses of matrix i; register i receives matrix i, with lane l
// holding row l/4, elements 2(l%4), 2(l%4)+1 (or, .trans, that element of the transpose).
CF2_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

CF2_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The transpose of an 8x8 16-bit matrix held one register a lane in the ldmatrix / accumulator
// layout (lane l: row l/4, elements 2(l%4), 2(l%4)+1): lane l receives row l/4 of the transpose.
CF2_DEVICE u32 movmatrix_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// ---- cp.async: 16-byte global -> shared copies that bypass L1 (.cg) -------------------------
// With `valid` false nothing is read and the 16 bytes are zero-filled: that is how sequence tails
// and head-dim padding become zeros (a zero K row scores 0 and is masked; a zero V row adds 0).
CF2_DEVICE void cp_async_16(u32 smem_addr, const void* gmem_ptr, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(smem_addr), "l"(gmem_ptr), "r"(src_bytes)
                 : "memory");
}

// An L2 eviction policy that evicts the lines it brings in first: for data read once, so that
// streaming it does not push out what is read again (code, partial results, small inputs).
CF2_DEVICE unsigned long long l2_evict_first_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// cp_async_16 with an L2 eviction policy (l2_evict_first_policy).
CF2_DEVICE void cp_async_16_policy(u32 smem_addr, const void* gmem_ptr, bool valid,
                                   unsigned long long policy) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :
                 : "r"(smem_addr), "l"(gmem_ptr), "r"(src_bytes), "l"(policy)
                 : "memory");
}

CF2_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING_GROUPS>
CF2_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING_GROUPS) : "memory");
}

// ---- conversions and special functions -------------------------------------------------------
// Packs two fp32 values into one register of two 16-bit values, `lo` in the low half: the layout
// mma expects for consecutive columns (cvt's first source goes to the upper half).
template <typename Elem>
CF2_DEVICE u32 pack_pair(float lo, float hi) {
    u32 packed;
    if constexpr (Elem::is_bf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    }
    return packed;
}

// 2^x on the SFU (one MUFU.EX2); ex2(-inf) = +0, which the masked scores rely on.
CF2_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

CF2_DEVICE float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

CF2_DEVICE float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

CF2_DEVICE void store_16B_global(void* gmem_ptr, const u32 (&v)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n"
                 :
                 : "l"(gmem_ptr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                 : "memory");
}

CF2_DEVICE void load_16B_shared(u32 (&v)[4], u32 smem_addr) {
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(smem_addr)
                 : "memory");
}

CF2_DEVICE void store_16B_shared(u32 smem_addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
}

CF2_DEVICE void store_4B_shared(u32 smem_addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr), "r"(v) : "memory");
}

// A shared-memory word read through volatile asm, where it is used: a value kept there for the
// whole kernel is read again each time instead of held in a register (as thread_index_fresh).
CF2_DEVICE int load_4B_shared_fresh(u32 smem_addr) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr));
    return v;
}

// threadIdx.x read through volatile asm: the compiler cannot hoist what is derived from it out of
// a loop. Used where keeping per-thread addresses live across the KV loop would cost registers
// the accumulators need (recomputing them is a handful of integer instructions per tile).
CF2_DEVICE int thread_index_fresh() {
    int tid;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    return tid;
}

CF2_DEVICE float neg_inf() { return __int_as_float(0xff800000u); }
CF2_DEVICE float pos_inf() { return __int_as_float(0x7f800000u); }

// 16-bit element -> fp32 (elements are raw 16-bit words, see the top of this file).
template <typename Elem>
CF2_DEVICE float to_float(u16 x) {
    if constexpr (Elem::is_bf16) {
        return __uint_as_float(static_cast<u32>(x) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
}

CF2_DEVICE void load_16B_global(u32 (&v)[4], const void* gmem_ptr) {
    asm volatile("ld.global.nc.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "l"(gmem_ptr));
}

// The same through L2 only (ld.global.cg): for what the previous kernel on the stream writes
// while this one runs (a programmatic launch, dependent_launch.cuh), which the read-only path
// above may not hold.
CF2_DEVICE void load_16B_global_l2(u32 (&v)[4], const void* gmem_ptr) {
    asm volatile("ld.global.cg.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "l"(gmem_ptr));
}

// *ptr in global memory with acquire semantics at GPU scope: what the thread that released it
// wrote before is visible after (a semaphore or a counter that other CTAs advance).
CF2_DEVICE int load_acquire_gpu(const int* ptr) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

// Spins until `done()` returns true: the waits on an mbarrier's phase (mbarrier.cuh) and on a
// semaphore in global memory (hopper_primitives.cuh: wait_semaphore).
// Debugging aid: compiled with -DCF2_MBARRIER_WATCHDOG, a wait that lasts about 2^32 cycles
// (~2 s) traps, so that a wrong byte count, parity or semaphore value fails the launch instead
// of hanging the device. It is off by default: the trap's control flow alone makes ptxas spill
// the d=128 forward's consumers (28 bytes, sm_90a, NVRTC 13.5).
template <class Done>
CF2_DEVICE void spin_until(const Done& done) {
#ifdef CF2_MBARRIER_WATCHDOG
    if (done()) return;
    const long long start = clock64();
    while (!done())
        if (clock64() - start > (1ll << 32)) asm volatile("trap;\n");
#else
    while (!done()) {
    }
#endif
}

// dst[0..3] += v[0..3] in global memory (16-byte aligned), fire-and-forget (no return value:
// `red`, not `atom`). sm_90 has a vector form: one instruction and one L2 transaction.
CF2_DEVICE void atomic_add_4(float* dst, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
    atomicAdd(dst + 2, c);
    atomicAdd(dst + 3, d);
#endif
}
