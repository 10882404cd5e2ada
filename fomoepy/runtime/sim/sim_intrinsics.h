// sim_intrinsics.h: what a kernel source sees on the simulated device: CUDA's and HIP's spellings
// (qualifiers, thread indices, barriers, shuffles, bit casts, atomics) given their simulated
// meaning. Included at the end of sim_device.h, not on its own.
#pragma once

#define __global__
#define __device__
#define __forceinline__ inline __attribute__((always_inline))
// static shared arrays are SHARED(T, name, [dims]) (sim_shared.h places them); a bare __shared__
// would be a thread_local that neither starts as NaN nor escapes the race detector
#define __shared__ fomoe_sim_error_declare_shared_arrays_with_SHARED_T_name_dims
#define __constant__ const

#ifdef FOMOE_SIM_SCAN  // tools/kernels: find each kernel's name and launch bound in the preprocessed source
#define KERNEL FOMOE_SIM_KERNEL
#define LAUNCH_BOUNDS(n) FOMOE_SIM_BOUND(n)
#else
#define KERNEL extern "C"
#define LAUNCH_BOUNDS(n)
#endif
#define DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(::fomoe_sim::dyn_shared)
#define SHARED(T, name, dims) FOMOE_SIM_SHARED(T, name, dims)

#define threadIdx (::fomoe_sim::current->tid)
#define blockIdx (::fomoe_sim::block_idx)
#define blockDim (::fomoe_sim::block_dim)
#define gridDim (::fomoe_sim::grid_dim)
#define __syncthreads() ::fomoe_sim::sync_block()

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    ::fomoe_sim::full_mask(mask);
    const int lane = ::fomoe_sim::current->lane;
    return ::fomoe_sim::exchange(v, (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1)));
}

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    ::fomoe_sim::full_mask(mask);
    const int lane = ::fomoe_sim::current->lane;
    return ::fomoe_sim::exchange(v, (lane & ~(width - 1)) | (src_lane & (width - 1)));
}

// HIP's spellings (compat.h's FOMOE_HIP branch, built with FOMOE_SIM_HIP): no mask, the whole warp
template <class T>
inline T __shfl_xor(T v, int lane_mask, int width = 32) {
    const int lane = ::fomoe_sim::current->lane;
    return ::fomoe_sim::exchange(v, (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1)));
}

template <class T>
inline T __shfl(T v, int src_lane, int width = 32) {
    const int lane = ::fomoe_sim::current->lane;
    return ::fomoe_sim::exchange(v, (lane & ~(width - 1)) | (src_lane & (width - 1)));
}

// Rounded arithmetic: with contraction off (-ffp-contract=off) a product is rounded, as __fmul_rn is.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
