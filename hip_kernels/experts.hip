// experts.hip: the routed experts of one MoE layer, every selected expert in one launch per stage,
// read in place from their device slots (quantised, as the store holds them): no expert is copied
// or dequantised to run.
//
// A step has T tokens with k choices each: pair p = t*k + j is token t's j-th choice, its choices
// sorted by ascending expert id on the host (the CPU backend adds contributions in that order too).
//
//   moe_gate_up_<gu>_t{1,8}  act[p, f] = silu(gate_f . x_t) * (up_f . x_t)
//                            grid (ceil(F / MOE_WARPS), n_work); a work item is one expert and up to
//                            8 of its pairs, so prefill decodes each expert row once per 8 tokens
//   moe_down_sum_<d>         out[t, :] = sum_j w[t, j] * (down_j . act[t*k + j])  (decode, small T)
//                            grid (ceil(D / MOE_WARPS), T): each token's k experts in one pass, the
//                            routing-weighted sum fused
//   moe_down_<d>             part[p, :] = down_e . act[p] per work item (prefill), then
//   moe_combine              out[t, :] = sum_j w[t, j] * part[t*k + j]      (same sum order as above)
#include "compat.h"
#include "dequant.h"

#define MOE_WARPS 4
#define MOE_TILE 8

// One expert's share of a step; 64 bytes, mirrored by EXPERT_WORK_DTYPE in fomoepy/runtime/gpu_experts.py.
struct ExpertWork {
    u64 gate, up, down;  // device addresses of the expert's three matrices (its slot)
    i32 n_pairs;         // 1 .. MOE_TILE
    i32 pad;
    i32 pair[MOE_TILE];
};

// Per pair: the down matrix of its expert and its routing weight; 16 bytes (PAIR_DTYPE).
struct PairInfo {
    u64 down;
    float weight;
    i32 pad;
};

template <class F, int TT>
DEVINL void gate_up_body(const ExpertWork* __restrict__ work, const float* __restrict__ X, int D, int F_, int k,
                         i64 row_bytes, float* __restrict__ act) {
    const int f = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (f >= F_) return;
    const ExpertWork w = work[blockIdx.y];
    const int n_t = min(w.n_pairs, TT);
    const float* xs[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) xs[t] = X + (i64)((t < n_t ? w.pair[t] : w.pair[0]) / k) * D;
    float g[TT], u[TT];
    const u8* gate = global_ptr<const u8>(w.gate) + (i64)f * row_bytes;
    const u8* up = global_ptr<const u8>(w.up) + (i64)f * row_bytes;
    row_dot<F, TT>(gate, xs, n_t, D, g);
    row_dot<F, TT>(up, xs, n_t, D, u);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (t < n_t) act[(i64)w.pair[t] * F_ + f] = __fmul_rn(silu_f(g[t]), u[t]);
    }
}

template <class F>
DEVINL void down_sum_body(const PairInfo* __restrict__ pairs, const float* __restrict__ act, int D, int F_, int k,
                          i64 row_bytes, float* __restrict__ out) {
    const int d = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    const int t = blockIdx.y;
    if (d >= D) return;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        const int p = t * k + j;
        const PairInfo info = pairs[p];
        const float* xs[1] = {act + (i64)p * F_};
        float dot[1];
        const u8* down = global_ptr<const u8>(info.down) + (i64)d * row_bytes;
        row_dot<F, 1>(down, xs, 1, F_, dot);
        sum = __fadd_rn(sum, __fmul_rn(dot[0], info.weight));
    }
    if (threadIdx.x % WARP == 0) out[(i64)t * D + d] = sum;
}

template <class F, int TT>
DEVINL void down_body(const ExpertWork* __restrict__ work, const float* __restrict__ act, int D, int F_,
                      i64 row_bytes, float* __restrict__ part) {
    const int d = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (d >= D) return;
    const ExpertWork w = work[blockIdx.y];
    const int n_t = min(w.n_pairs, TT);
    const float* xs[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) xs[t] = act + (i64)(t < n_t ? w.pair[t] : w.pair[0]) * F_;
    float dot[TT];
    const u8* down = global_ptr<const u8>(w.down) + (i64)d * row_bytes;
    row_dot<F, TT>(down, xs, n_t, F_, dot);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (t < n_t) part[(i64)w.pair[t] * D + d] = dot[t];
    }
}

// out[t, d] = sum_j w[t, j] * part[t*k + j, d], j ascending (the fused kernel's order)
KERNEL void LAUNCH_BOUNDS(256) moe_combine(const PairInfo* pairs, const float* part, int T, int D, int k, float* out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)T * D) return;
    const int t = (int)(i / D), d = (int)(i % D);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        const int p = t * k + j;
        sum = __fadd_rn(sum, __fmul_rn(part[(i64)p * D + d], pairs[p].weight));
    }
    out[i] = sum;
}

#define MOE_KERNELS(name, F)                                                                              \
    KERNEL void LAUNCH_BOUNDS(MOE_WARPS * WARP) moe_gate_up_##name##_t1(                                  \
        const ExpertWork* work, const float* X, int D, int F_, int k, i64 row_bytes, float* act) {        \
        gate_up_body<F, 1>(work, X, D, F_, k, row_bytes, act);                                            \
    }                                                                                                     \
    KERNEL void LAUNCH_BOUNDS(MOE_WARPS * WARP) moe_gate_up_##name##_t8(                                  \
        const ExpertWork* work, const float* X, int D, int F_, int k, i64 row_bytes, float* act) {        \
        gate_up_body<F, MOE_TILE>(work, X, D, F_, k, row_bytes, act);                                     \
    }                                                                                                     \
    KERNEL void LAUNCH_BOUNDS(MOE_WARPS * WARP) moe_down_sum_##name(                                      \
        const PairInfo* pairs, const float* act, int D, int F_, int k, i64 row_bytes, float* out) {       \
        down_sum_body<F>(pairs, act, D, F_, k, row_bytes, out);                                           \
    }                                                                                                     \
    KERNEL void LAUNCH_BOUNDS(MOE_WARPS * WARP) moe_down_##name(                                          \
        const ExpertWork* work, const float* act, int D, int F_, i64 row_bytes, float* part) {            \
        down_body<F, MOE_TILE>(work, act, D, F_, row_bytes, part);                                        \
    }

FOR_EACH_FORMAT(MOE_KERNELS)
