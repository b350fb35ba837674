// The read-only inputs of programmable modifiers (cuflash2.mask_mod / score_mod), as the user's
// expressions index them: a 1-D input `doc[i]` (or `doc(i)`), an N-D one `table(i, j)`. Each
// accessor reads its UserInput (kernel_params.cuh: address and element strides) and widens the
// element: int32 and int64 stay integers, fp32, fp16 and bf16 become float. The generated
// user_mods.cuh declares one accessor a named input (cuflash2/mods.py).
#pragma once
#include "mma_primitives.cuh"
#include "kernel_params.cuh"

// 16-bit float elements, told apart by type.
struct user_half { u16 bits; };
struct user_bfloat { u16 bits; };

CF2_DEVICE int user_value(const int* x) { return *x; }
CF2_DEVICE i64 user_value(const i64* x) { return *x; }
CF2_DEVICE float user_value(const float* x) { return *x; }
CF2_DEVICE float user_value(const user_half* x) { return to_float<fp16_tag>(x->bits); }
CF2_DEVICE float user_value(const user_bfloat* x) { return to_float<bf16_tag>(x->bits); }

template <class T>
struct UserArray1 {
    const T* data;
    i64 stride0;
    CF2_DEVICE explicit UserArray1(const UserInput& in)
        : data(static_cast<const T*>(in.data)), stride0(in.stride0) {}
    CF2_DEVICE auto operator[](i64 i) const { return user_value(data + i * stride0); }
    CF2_DEVICE auto operator()(i64 i) const { return user_value(data + i * stride0); }
};

template <class T>
struct UserArray2 {
    const T* data;
    i64 stride0, stride1;
    CF2_DEVICE explicit UserArray2(const UserInput& in)
        : data(static_cast<const T*>(in.data)), stride0(in.stride0), stride1(in.stride1) {}
    CF2_DEVICE auto operator()(i64 i, i64 j) const {
        return user_value(data + i * stride0 + j * stride1);
    }
};

template <class T>
struct UserArray3 {
    const T* data;
    i64 stride0, stride1, stride2;
    CF2_DEVICE explicit UserArray3(const UserInput& in)
        : data(static_cast<const T*>(in.data)), stride0(in.stride0), stride1(in.stride1),
          stride2(in.stride2) {}
    CF2_DEVICE auto operator()(i64 i, i64 j, i64 k) const {
        return user_value(data + i * stride0 + j * stride1 + k * stride2);
    }
};

template <class T>
struct UserArray4 {
    const T* data;
    i64 stride0, stride1, stride2, stride3;
    CF2_DEVICE explicit UserArray4(const UserInput& in)
        : data(static_cast<const T*>(in.data)), stride0(in.stride0), stride1(in.stride1),
          stride2(in.stride2), stride3(in.stride3) {}
    CF2_DEVICE auto operator()(i64 i, i64 j, i64 k, i64 l) const {
        return user_value(data + i * stride0 + j * stride1 + k * stride2 + l * stride3);
    }
};

// What a modifier's call sees beside its (query, key) position: its inputs, the CTA's batch
// entry (a varlen sequence's index) and query head, the sequence's lengths (positions at or past
// them never reach the user's code) and the effective softmax scale (the kernels hold scores in
// units of it: score_units * scale is the scaled score the user's score modifier takes).
struct UserModContext {
    const UserParams& user;
    int batch;
    int head;
    int seqlen_q;
    int seqlen_k;
    float scale;      // score units -> scaled scores
    float inv_scale;  // and back
};

// The kernels' bodies take their programmable modifiers' inputs as a template argument: a
// UserParams (the *_mods_kernel entries), or this empty struct for every other specialisation
// (never read: the variant calls UserMods only under FEATURE_MASK_MOD / FEATURE_SCORE_MOD).
struct NoUserInputs {};
