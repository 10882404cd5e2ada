// elementwise.hip: everything the forward pass does between the big kernels — activations,
// broadcast arithmetic, strided copies (views made contiguous, KV-cache writes), gathers.
//
// One kernel walks a 4-D output index space (fewer dims are padded with 1); each operand carries its
// own element strides, 0 on a broadcast axis, so views and broadcasts need no copies first.
#include "compat.h"

struct Dims4 {
    i64 n[4];   // output shape
    i64 so[4];  // output strides
    i64 sa[4];  // operand a strides
    i64 sb[4];  // operand b strides (unused when b is null)
};

// op codes, mirrored by EW_OPS in fomoepy/runtime/gpu_arrays.py
#define EW_COPY 0
#define EW_ADD 1
#define EW_SUB 2
#define EW_MUL 3
#define EW_DIV 4
#define EW_SILU 5
#define EW_SIGMOID 6
#define EW_SOFTPLUS 7
#define EW_EXP 8
#define EW_NEG 9
#define EW_SIGMOID_MUL 10  // a * sigmoid(b)
#define EW_SILU_MUL 11     // silu(a) * b
#define EW_RSUB 12         // b - a
#define EW_RDIV 13         // b / a

DEVINL float ew_apply(int op, float a, float b) {
    switch (op) {
        case EW_COPY: return a;
        case EW_ADD: return a + b;
        case EW_SUB: return a - b;
        case EW_MUL: return a * b;
        case EW_DIV: return a / b;
        case EW_SILU: return silu_f(a);
        case EW_SIGMOID: return sigmoid_f(a);
        case EW_SOFTPLUS: return fmaxf(a, 0.0f) + log1pf(expf(-fabsf(a)));  // log(1 + e^a), stable
        case EW_EXP: return expf(a);
        case EW_NEG: return -a;
        case EW_SIGMOID_MUL: return a * sigmoid_f(b);
        case EW_SILU_MUL: return silu_f(a) * b;
        case EW_RSUB: return b - a;
        case EW_RDIV: return b / a;
    }
    return 0.0f;
}

// out = op(a, b) with b either an array (b != null) or the scalar s
KERNEL void LAUNCH_BOUNDS(256) ew_f32(int op, const float* a, const float* b, float s, float* out, Dims4 d) {
    const i64 total = d.n[0] * d.n[1] * d.n[2] * d.n[3];
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i;
        const i64 i3 = r % d.n[3];
        r /= d.n[3];
        const i64 i2 = r % d.n[2];
        r /= d.n[2];
        const i64 i1 = r % d.n[1];
        const i64 i0 = r / d.n[1];
        const float av = a[i0 * d.sa[0] + i1 * d.sa[1] + i2 * d.sa[2] + i3 * d.sa[3]];
        const float bv = b ? b[i0 * d.sb[0] + i1 * d.sb[1] + i2 * d.sb[2] + i3 * d.sb[3]] : s;
        out[i0 * d.so[0] + i1 * d.so[1] + i2 * d.so[2] + i3 * d.so[3]] = ew_apply(op, av, bv);
    }
}

// 4-byte strided copy of any dtype (int32 ids, float32): the same index walk, no arithmetic
KERNEL void LAUNCH_BOUNDS(256) copy_b32(const u32* a, u32* out, Dims4 d) {
    const i64 total = d.n[0] * d.n[1] * d.n[2] * d.n[3];
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i;
        const i64 i3 = r % d.n[3];
        r /= d.n[3];
        const i64 i2 = r % d.n[2];
        r /= d.n[2];
        const i64 i1 = r % d.n[1];
        const i64 i0 = r / d.n[1];
        out[i0 * d.so[0] + i1 * d.so[1] + i2 * d.so[2] + i3 * d.so[3]] =
            a[i0 * d.sa[0] + i1 * d.sa[1] + i2 * d.sa[2] + i3 * d.sa[3]];
    }
}

// src viewed as [outer, axis_len, inner] (contiguous) -> out [outer, n_idx, inner]: out[o, j, :] = src[o, idx[j], :]
KERNEL void LAUNCH_BOUNDS(256) gather_f32(const float* src, const i32* idx, float* out, i64 outer, i64 axis_len,
                                          i64 n_idx, i64 inner, i32* err) {
    const i64 total = outer * n_idx * inner;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 in = i % inner, j = (i / inner) % n_idx, o = i / (inner * n_idx);
        const i64 src_j = idx[j];
        if (src_j < 0 || src_j >= axis_len) {
            raise_error(err, ERR_INDEX);
            continue;
        }
        out[i] = src[(o * axis_len + src_j) * inner + in];
    }
}
