// compat.h: the few things HIP (hiprtc, AMD RDNA wave32) and CUDA (NVRTC, NVIDIA) spell differently.
// Every kernel source includes this and nothing else from a toolkit: no <cstdint>, no fp16 headers,
// so the same text compiles with both run-time compilers and no include paths.
#pragma once

#if defined(FOMOE_SIM)
// the simulated device: the host C++ compiler builds this source, threads run as fibers on the CPU
// (fomoepy/runtime/sim/sim_device.h defines KERNEL, LAUNCH_BOUNDS, DYN_SHARED, SHARED, and both
// vendors' intrinsics); it is built once with each vendor's branches below (FOMOE_SIM_HIP: HIP's)
#include "sim_device.h"
#if defined(FOMOE_SIM_HIP)
#define FOMOE_HIP 1
#else
#define FOMOE_CUDA 1
#endif
#elif defined(__HIPCC_RTC__) || defined(__HIP__) || defined(__HIP_DEVICE_COMPILE__)
#define FOMOE_HIP 1
#else
#define FOMOE_CUDA 1
#endif

// Warp = 32 lanes everywhere. RDNA runs wave32; a wave64 target (GCN/CDNA) would break every warp
// reduction here, so refuse it at compile time rather than compute garbage.
#define WARP 32
#if defined(__AMDGCN_WAVEFRONT_SIZE) && (__AMDGCN_WAVEFRONT_SIZE != 32)
#error "fomoepy kernels need a wave32 target (RDNA); this target runs wave64"
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#ifndef FOMOE_SIM
#define KERNEL extern "C" __global__
#define LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define DYN_SHARED(T, name) extern __shared__ T name[]  // the launch's dynamic shared memory
#define SHARED(T, name, dims) __shared__ T name dims     // a static shared array: SHARED(float, s, [32])
#endif
#define DEVINL __device__ __forceinline__

#ifdef FOMOE_HIP
#define SHFL_XOR(v, m) __shfl_xor((v), (m), WARP)
#define SHFL(v, src) __shfl((v), (src), WARP)
#else
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), WARP)
#define SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src), WARP)
#endif

// An address a kernel reads from device memory (an expert's slot from its work item, a sequence's cache
// from a row table) makes a generic pointer, and AMDGPU then reads and writes through it with flat
// instructions: they also wait on the LDS and scalar counter, and take no scalar base address. Every such
// address here is in global memory; made a global pointer first, clang's address-space inference makes
// every access through it a global one. (NVIDIA resolves a generic address in hardware: there, as in the
// simulator, which has one space, global_ptr is a plain cast.)
template <class T>
__device__ __forceinline__ T* global_ptr(u64 address) {
#if defined(FOMOE_HIP) && defined(__AMDGCN__)
    return (T*)(__attribute__((address_space(1))) T*)address;
#else
    return (T*)address;
#endif
}

// IEEE binary16 and bfloat16 bits -> float32 (exact conversions; no toolkit half types needed).
// binary16 in integer arithmetic and one exact subtraction, the same text for every compiler (NVRTC
// has no _Float16, and the simulator then runs what both GPUs run); no float32 subnormal is formed on
// the way, so a flush-to-zero mode cannot change it. NaN keeps its payload, as numpy's conversion.
DEVINL float f16_to_f32(u16 h) {
    const u32 magnitude = (u32)(h & 0x7fff) << 13;  // exponent and mantissa in float32's places
    const u32 exponent = magnitude & 0x0f800000u;
    float f;
    if (exponent == 0x0f800000u) {  // inf, NaN
        f = __uint_as_float(magnitude | 0x7f800000u);
    } else if (exponent == 0) {  // zero, subnormal: m 2^-24 = (2^-14 + m 2^-24) - 2^-14, exactly
        f = __uint_as_float(magnitude + (113u << 23)) - __uint_as_float(113u << 23);
    } else {  // normal: the exponent rebiased from 15 to 127
        f = __uint_as_float(magnitude + (112u << 23));
    }
    return __uint_as_float(__float_as_uint(f) | ((u32)(h & 0x8000) << 16));
}

DEVINL float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

#define NEG_INF __int_as_float(0xff800000)

DEVINL u16 ld_u16(const u8* p) { return (u16)(p[0] | (p[1] << 8)); }
// Eight bytes, or eight floats, in as few loads as their alignment allows: ncu on an H100 found the
// expert kernels bound by the L1's instruction queue (85 % busy, DRAM 10 %) when each weight byte and
// each input float was a load of its own. The value is the same whichever branch loads it; every branch
// condition here is uniform across a warp where a row's groups are (one block per warp iteration).
struct alignas(16) Words4 {
    u32 w[4];
};
#ifdef FOMOE_SIM
DEVINL u64 ld_u64_at(const u8* p) { u64 v; memcpy(&v, p, 8); return v; }
DEVINL u16 ld_u16_at(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
DEVINL Words4 ld_words4_at(const void* p) { Words4 v; memcpy(&v, p, 16); return v; }
#else
DEVINL u64 ld_u64_at(const u8* p) { return *(const u64*)p; }  // p 8-aligned
DEVINL u16 ld_u16_at(const u8* p) { return *(const u16*)p; }  // p 2-aligned
DEVINL Words4 ld_words4_at(const void* p) { return *(const Words4*)p; }  // p 16-aligned
#endif
// bytes p[0..7] as one little-endian u64 (byte i in bits 8i..8i+7)
DEVINL u64 ld_bytes8(const u8* p) {
    const u64 a = (u64)p;
    if ((a & 7) == 0) return ld_u64_at(p);
    if ((a & 1) == 0)
        return (u64)ld_u16_at(p) | ((u64)ld_u16_at(p + 2) << 16) | ((u64)ld_u16_at(p + 4) << 32) |
               ((u64)ld_u16_at(p + 6) << 48);
    u64 v = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) v |= (u64)p[i] << (8 * i);
    return v;
}
// byte i of v
DEVINL u32 byte_of(u64 v, int i) { return (u32)(v >> (8 * i)) & 0xFF; }
// eight consecutive 16-bit values (p 2-aligned): two 16-byte loads' worth where p is 16-aligned
DEVINL void ld_u16x8(const u16* p, u16* out) {
    if (((u64)p & 15) == 0) {
        const Words4 v = ld_words4_at(p);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = (u16)(v.w[i] & 0xFFFF);
            out[2 * i + 1] = (u16)(v.w[i] >> 16);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = p[i];
}
// eight consecutive floats: two 16-byte loads where p is 16-aligned
DEVINL void ld_f32x8(const float* p, float* out) {
    if (((u64)p & 15) == 0) {
        const Words4 a = ld_words4_at(p), b = ld_words4_at(p + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[i] = __uint_as_float(a.w[i]);
            out[4 + i] = __uint_as_float(b.w[i]);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = p[i];
}

// Error flags a kernel raises instead of reading out of bounds; the host checks them at its syncs.
#define ERR_CONTEXT 1   // a KV position at or past the cache's n_ctx
#define ERR_INDEX 2     // a token id or gather index outside its table
#define ERR_SHAPE 4     // a dimension beyond what the kernel was built for (head dim, state size, ...)

DEVINL void raise_error(i32* err, i32 code) {
    if (err) atomicOr(err, code);
}

DEVINL float warp_sum(float v) {
#pragma unroll
    for (int m = WARP / 2; m > 0; m >>= 1) v += SHFL_XOR(v, m);
    return v;
}

DEVINL float warp_max(float v) {
#pragma unroll
    for (int m = WARP / 2; m > 0; m >>= 1) v = fmaxf(v, SHFL_XOR(v, m));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the block must not reuse it until all threads return.
DEVINL float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

DEVINL float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

DEVINL float silu_f(float x) { return x / (1.0f + expf(-x)); }
DEVINL float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
