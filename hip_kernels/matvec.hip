// matvec.hip: y = W x for GGUF weights (rows = output features, as GGUF stores them), decoded in
// registers and accumulated in float32; and quantised embedding lookup with the same decoders.
//
//   mv_<type>_t1   decode: one input vector per token, grid (ceil(N / MV_WARPS), T)
//   mv_<type>_t8   small-batch matmul (prefill): a tile of 8 tokens shares each decoded weight
//                  group, grid (ceil(N / MV_WARPS), ceil(T / 8))
//   embed_<type>   rows of a quantised table gathered by token id, grid (T, ceil(D / 8 / 128))
#include "compat.h"
#include "dequant.h"

#define MV_WARPS 4  // rows per block: one warp per output row

// X [T, x_stride] float32, W [N, row_bytes], Y [T, y_stride]: Y[t, n] = sum_k W[n, k] X[t, k]
template <class F, int TT>
DEVINL void matvec_body(const u8* __restrict__ W, i64 row_bytes, const float* __restrict__ X, i64 x_stride,
                        float* __restrict__ Y, i64 y_stride, int N, int K, int T) {
    const int n = blockIdx.x * MV_WARPS + threadIdx.x / WARP;
    const int t0 = blockIdx.y * TT;
    if (n >= N || t0 >= T) return;  // whole warps leave together: row_dot's shuffles stay full
    const int n_t = min(TT, T - t0);
    const float* xs[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) xs[t] = X + (i64)(t0 + (t < n_t ? t : 0)) * x_stride;
    float acc[TT];
    row_dot<F, TT>(W + (i64)n * row_bytes, xs, n_t, K, acc);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (t < n_t) Y[(i64)(t0 + t) * y_stride + n] = acc[t];
    }
}

// tokens [T] int32, table [n_vocab, row_bytes] -> out [T, D]; an id outside the table raises ERR_INDEX
template <class F>
DEVINL void embed_body(const u8* __restrict__ table, i64 row_bytes, const i32* __restrict__ tokens, int T,
                       int n_vocab, int D, float* __restrict__ out, i32* err) {
    const int t = blockIdx.x;
    const int g = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int tok = tokens[t];
    if (tok < 0 || tok >= n_vocab) {
        if (g == 0) raise_error(err, ERR_INDEX);
        return;
    }
    const u8* row = table + (i64)tok * row_bytes;
    float* y = out + (i64)t * D;
    if (g < D / 8) {
        float w[8];
        F::load8(row, g, w);
#pragma unroll
        for (int i = 0; i < 8; i++) y[8 * g + i] = w[i];
    }
    if constexpr (F::BLOCK == 1) {
        const int k = (D / 8) * 8 + g;
        if (k < D) y[k] = F::load1(row, k);
    }
}

#define MATVEC_KERNELS(name, F)                                                                          \
    KERNEL void LAUNCH_BOUNDS(MV_WARPS * WARP)                                                           \
        mv_##name##_t1(const u8* W, i64 row_bytes, const float* X, i64 x_stride, float* Y, i64 y_stride, \
                       int N, int K, int T) {                                                            \
        matvec_body<F, 1>(W, row_bytes, X, x_stride, Y, y_stride, N, K, T);                             \
    }                                                                                                    \
    KERNEL void LAUNCH_BOUNDS(MV_WARPS * WARP)                                                           \
        mv_##name##_t8(const u8* W, i64 row_bytes, const float* X, i64 x_stride, float* Y, i64 y_stride, \
                       int N, int K, int T) {                                                            \
        matvec_body<F, 8>(W, row_bytes, X, x_stride, Y, y_stride, N, K, T);                             \
    }                                                                                                    \
    KERNEL void LAUNCH_BOUNDS(128) embed_##name(const u8* table, i64 row_bytes, const i32* tokens, int T, \
                                                 int n_vocab, int D, float* out, i32* err) {             \
        embed_body<F>(table, row_bytes, tokens, T, n_vocab, D, out, err);                                \
    }

FOR_EACH_FORMAT(MATVEC_KERNELS)
