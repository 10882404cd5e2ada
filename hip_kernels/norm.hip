// norm.hip: row-wise normalisations and softmax over the last axis; one block per row.
//
// Rows may be spaced by any stride (a per-head view such as q inside [T, H, 2hd] is rows of hd with
// stride 2hd); outputs are contiguous [n_rows, n].
#include "compat.h"

#define NORM_THREADS 256

// y = (x / sqrt(mean(x^2) + eps)) * w, w [n] (per-head q/k norm: rows = T*H, n = head_dim)
KERNEL void LAUNCH_BOUNDS(NORM_THREADS)
    rms_norm_f32(const float* x, i64 x_stride, const float* w, float* y, int n_rows, int n, float eps) {
    SHARED(float, scratch, [WARP]);
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (i64)r * x_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float denom = sqrtf(ss / (float)n + eps);
    float* yr = y + (i64)r * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = __fmul_rn(xr[i] / denom, w[i]);
}

// y = x / max(||x||, eps)  (ggml_l2_norm)
KERNEL void LAUNCH_BOUNDS(NORM_THREADS) l2_norm_f32(const float* x, i64 x_stride, float* y, int n_rows, int n, float eps) {
    SHARED(float, scratch, [WARP]);
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (i64)r * x_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float denom = fmaxf(sqrtf(ss), eps);
    float* yr = y + (i64)r * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] / denom;
}

// y = exp(x - max) / sum(exp(x - max)) per row
KERNEL void LAUNCH_BOUNDS(NORM_THREADS) softmax_f32(const float* x, i64 x_stride, float* y, int n_rows, int n) {
    SHARED(float, scratch, [WARP]);
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* xr = x + (i64)r * x_stride;
    float* yr = y + (i64)r * n;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, xr[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(xr[i] - m);
        yr[i] = e;
        s += e;
    }
    s = block_sum(s, scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = yr[i] / s;
}
