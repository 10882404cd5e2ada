// rope.hip: NEOX rotary embedding of the first rotary_dim dims of every head; the rest pass through.
//
// Pairs are (i, i + rotary_dim/2), angle_i = pos * base^(-2i / rotary_dim). As in the numpy reference
// the angle, its cosine and sine are computed in double and rounded to float once, so a position's
// rotation does not depend on the batch it came in. One thread per (token, i) computes the angle
// and rotates that pair in every head: grid (T, ceil(max(half, hd - rotary_dim) / 64)), block 64.
#include "compat.h"

// x [T, H, hd] with token stride xt and head stride xh (last axis contiguous); out [T, H, hd] contiguous.
// positions [T] int32, or null for n_past + t.
KERNEL void LAUNCH_BOUNDS(64) rope_neox_f32(const float* x, i64 xt, i64 xh, float* out, int T, int H, int hd,
                                            int rotary_dim, const i32* positions, int n_past, double base) {
    const int t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int half = rotary_dim / 2;
    const i64 pos = positions ? positions[t] : (i64)n_past + t;
    if (i < half) {
        const double inv_freq = pow(base, (-(double)i * 2.0) / (double)rotary_dim);
        double s, c;
        sincos((double)pos * inv_freq, &s, &c);
        const float cf = (float)c, sf = (float)s;
        for (int h = 0; h < H; h++) {
            const float* xr = x + (i64)t * xt + (i64)h * xh;
            float* yr = out + ((i64)t * H + h) * hd;
            const float x1 = xr[i], x2 = xr[i + half];
            yr[i] = __fsub_rn(__fmul_rn(x1, cf), __fmul_rn(x2, sf));
            yr[i + half] = __fadd_rn(__fmul_rn(x2, cf), __fmul_rn(x1, sf));
        }
    }
    const int j = rotary_dim + i;  // pass-through dims
    if (j < hd) {
        for (int h = 0; h < H; h++) out[((i64)t * H + h) * hd + j] = x[(i64)t * xt + (i64)h * xh + j];
    }
}
