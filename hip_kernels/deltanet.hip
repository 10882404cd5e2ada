// deltanet.hip: the Gated DeltaNet pieces — depthwise causal conv1d with its state, and the gated
// delta rule run token by token (the same steps for prefill and decode, as in the reference).
#include "compat.h"

#define CONV_MAX_K 8

// Channel c of T inputs x [T, C] through the convolution whose previous inputs are conv_state [K-1, C]
// (updated in place), w [C, K], into out [T, C]: out[t, c] = sum_j w[c, j] * xp[t + j, c] with
// xp = conv_state ++ x. Both kernels below run this, so a decode row of a batch of sequences gets the
// bits it gets alone.
DEVINL void conv_channel(const float* x, float* conv_state, const float* w, float* out, int T, int C, int K, int c) {
    float win[CONV_MAX_K], wc[CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; j++) {
        win[j] = j < K - 1 ? conv_state[(i64)j * C + c] : 0.0f;
        wc[j] = j < K ? w[(i64)c * K + j] : 0.0f;
    }
    for (int t = 0; t < T; t++) {
        const float cur = x[(i64)t * C + c];
#pragma unroll
        for (int j = 0; j < CONV_MAX_K; j++)
            if (j == K - 1) win[j] = cur;  // unrolled: the window stays in registers
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_K; j++)
            if (j < K) acc = __fadd_rn(acc, __fmul_rn(win[j], wc[j]));
        out[(i64)t * C + c] = acc;
#pragma unroll
        for (int j = 0; j + 1 < CONV_MAX_K; j++)
            if (j < K - 1) win[j] = win[j + 1];
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; j++)
        if (j < K - 1) conv_state[(i64)j * C + c] = win[j];
}

// x [T, C], conv_state [K-1, C] (previous inputs; updated in place), w [C, K] -> out [T, C]. One thread per channel.
KERNEL void LAUNCH_BOUNDS(256)
    causal_conv1d_f32(const float* x, float* conv_state, const float* w, float* out, int T, int C, int K, i32* err) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    if (K < 1 || K > CONV_MAX_K) {
        if (c == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    conv_channel(x, conv_state, w, out, T, C, K, c);
}

// One decode row of each of B sequences (a batched decode step): row b of x [B, C] through the
// convolution whose state is at states[b] ([K-1, C], updated in place; the addresses int64) -> out [B, C].
// Grid (ceil(C / 256), B).
KERNEL void LAUNCH_BOUNDS(256) causal_conv1d_rows_f32(const float* x, const i64* states, const float* w, float* out,
                                                      int B, int C, int K, i32* err) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
    if (c >= C || b >= B) return;
    if (K < 1 || K > CONV_MAX_K) {
        if (c == 0 && b == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    conv_channel(x + (i64)b * C, global_ptr<float>(states[b]), w, out + (i64)b * C, 1, C, K, c);
}

// The gated delta rule. q, k [T, Hv, dk], v [T, Hv, dv], g (log-decay) and beta [T, Hv], all
// contiguous; state S [Hv, dk, dv] updated in place; o [T, Hv, dv]. Per token:
//   S <- e^g S;  S <- S + k (x) beta (v - S^T k);  o = S^T q
// Columns of S are independent: DN_PARTS lanes share column j (rows i = part, part + DN_PARTS, ...)
// and hold it in registers for all T tokens. grid (ceil(dv / (DN_THREADS / DN_PARTS)), Hv).
#define DN_PARTS 4
#define DN_THREADS 128
#define DN_MAX_DK 128
#define DN_ROWS (DN_MAX_DK / DN_PARTS)

// Column col of head h's state at S ([Hv, dk, dv], updated in place) through T tokens: the lanes of one
// part group (DN_PARTS of them) hold the column's rows. Both kernels below run this.
DEVINL void delta_column(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                         float* o, int T, int Hv, int dk, int dv, int h, int col, int part) {
    const bool live = col < dv;  // dead lanes still join the shuffles
    const int rows = dk / DN_PARTS;
    float* Sh = S + (i64)h * dk * dv;
    float s[DN_ROWS];
#pragma unroll
    for (int r = 0; r < DN_ROWS; r++) s[r] = (live && r < rows) ? Sh[(i64)(part + DN_PARTS * r) * dv + col] : 0.0f;
    for (int t = 0; t < T; t++) {
        const i64 th = (i64)t * Hv + h;
        const float decay = expf(g[th]);
        const float b = beta[th];
        const float* kt = k + th * dk;
        const float* qt = q + th * dk;
        float rec = 0.0f;
#pragma unroll
        for (int r = 0; r < DN_ROWS; r++) {
            if (r < rows) {
                s[r] *= decay;
                rec += s[r] * kt[part + DN_PARTS * r];
            }
        }
        rec += SHFL_XOR(rec, 1);
        rec += SHFL_XOR(rec, 2);
        const float vt = live ? v[th * dv + col] : 0.0f;
        const float delta = (vt - rec) * b;
        float out = 0.0f;
#pragma unroll
        for (int r = 0; r < DN_ROWS; r++) {
            if (r < rows) {
                s[r] += kt[part + DN_PARTS * r] * delta;
                out += s[r] * qt[part + DN_PARTS * r];
            }
        }
        out += SHFL_XOR(out, 1);
        out += SHFL_XOR(out, 2);
        if (live && part == 0) o[th * dv + col] = out;
    }
#pragma unroll
    for (int r = 0; r < DN_ROWS; r++)
        if (live && r < rows) Sh[(i64)(part + DN_PARTS * r) * dv + col] = s[r];
}

KERNEL void LAUNCH_BOUNDS(DN_THREADS)
    delta_rule_f32(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                   float* o, int T, int Hv, int dk, int dv, i32* err) {
    const int part = threadIdx.x % DN_PARTS;
    const int col = blockIdx.x * (DN_THREADS / DN_PARTS) + threadIdx.x / DN_PARTS;
    const int h = blockIdx.y;
    if (h >= Hv) return;
    if (dk > DN_MAX_DK || dk % DN_PARTS != 0) {
        if (threadIdx.x == 0 && blockIdx.x == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    delta_column(q, k, v, g, beta, S, o, T, Hv, dk, dv, h, col, part);
}

// One decode row of each of B sequences: row b's q, k [B, Hv, dk], v [B, Hv, dv], g, beta [B, Hv] through
// the state at states[b] ([Hv, dk, dv], updated in place; the addresses int64) -> o [B, Hv, dv].
// Grid (ceil(dv / (DN_THREADS / DN_PARTS)), Hv, B).
KERNEL void LAUNCH_BOUNDS(DN_THREADS)
    delta_rule_rows_f32(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        const i64* states, float* o, int B, int Hv, int dk, int dv, i32* err) {
    const int part = threadIdx.x % DN_PARTS;
    const int col = blockIdx.x * (DN_THREADS / DN_PARTS) + threadIdx.x / DN_PARTS;
    const int h = blockIdx.y, b = blockIdx.z;
    if (h >= Hv || b >= B) return;
    if (dk > DN_MAX_DK || dk % DN_PARTS != 0) {
        if (threadIdx.x == 0 && blockIdx.x == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    const i64 hk = (i64)b * Hv * dk, hv = (i64)b * Hv * dv;
    delta_column(q + hk, k + hk, v + hv, g + (i64)b * Hv, beta + (i64)b * Hv, global_ptr<float>(states[b]), o + hv, 1, Hv, dk, dv,
                 h, col, part);
}
