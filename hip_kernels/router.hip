// router.hip: expert selection on the device, so one small read-back (ids + weights) decides the
// fetches; and argmax (greedy sampling without reading the logits back).
#include "compat.h"

#define ROUTE_THREADS 256
#define ROUTE_MAX_K 64

// (value, index) maximum with ties to the lower index, and NaN above every number as in np.argmax.
// Without the NaN rule a row of NaN (a wrong upstream kernel, an uninitialised slot) would leave the
// starting index 0x7fffffff as the answer, and the router writes p[i]: an out-of-bounds store.
DEVINL void argmax_pair(float& v, int& i, float v2, int i2) {
    const bool nan = v != v, nan2 = v2 != v2;
    const bool above = nan2 != nan ? nan2 : (nan2 ? i2 < i : (v2 > v || (v2 == v && i2 < i)));
    if (above) {
        v = v2;
        i = i2;
    }
}

DEVINL void block_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
#pragma unroll
    for (int m = WARP / 2; m > 0; m >>= 1) argmax_pair(v, i, SHFL_XOR(v, m), SHFL_XOR(i, m));
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < n_warps ? sv[lane] : NEG_INF;
    i = lane < n_warps ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int m = WARP / 2; m > 0; m >>= 1) argmax_pair(v, i, SHFL_XOR(v, m), SHFL_XOR(i, m));
}

// Qwen3 / Qwen3.5: probs = softmax(logits) over E experts, the k largest, weights renormalised to
// sum 1. logits [T, E] -> probs [T, E], ids [T, k] int32 by descending prob, weights [T, k].
// One block per token; dynamic shared memory holds E floats.
KERNEL void LAUNCH_BOUNDS(ROUTE_THREADS) route_softmax_topk(const float* logits, int T, int E, int k, float* probs,
                                                            i32* ids, float* weights, i32* err) {
    DYN_SHARED(float, p);
    SHARED(float, sv, [WARP]);
    SHARED(int, si, [WARP]);
    SHARED(float, top, [ROUTE_MAX_K]);
    const int t = blockIdx.x;
    if (t >= T) return;
    if (k < 1 || k > ROUTE_MAX_K || k > E) {
        if (threadIdx.x == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    const float* x = logits + (i64)t * E;
    float m = NEG_INF;
    for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, x[e]);
    m = block_max(m, sv);
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        p[e] = expf(x[e] - m);
        s += p[e];
    }
    s = block_sum(s, sv);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        p[e] = p[e] / s;
        probs[(i64)t * E + e] = p[e];
    }
    for (int j = 0; j < k; j++) {
        float v = NEG_INF;
        int i = 0x7fffffff;
        // a NaN probability ranks below every untaken expert (numpy's argsort on -p sorts NaN last) and
        // above the taken ones, so each of the k rounds finds an index in [0, E)
        for (int e = threadIdx.x; e < E; e += blockDim.x) argmax_pair(v, i, p[e] != p[e] ? -0.5f : p[e], e);
        block_argmax(v, i, sv, si);
        if (threadIdx.x == 0) {
            ids[(i64)t * k + j] = i;
            top[j] = p[i];
            p[i] = -1.0f;  // taken (probabilities are >= 0)
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += top[j];
        for (int j = 0; j < k; j++) weights[(i64)t * k + j] = top[j] / sum;
    }
}

// ids[r] = first index of the maximum of row r of x [n_rows, n]
KERNEL void LAUNCH_BOUNDS(ROUTE_THREADS) argmax_f32(const float* x, int n_rows, int n, i32* ids) {
    SHARED(float, sv, [WARP]);
    SHARED(int, si, [WARP]);
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int e = threadIdx.x; e < n; e += blockDim.x) argmax_pair(v, i, x[(i64)r * n + e], e);
    block_argmax(v, i, sv, si);
    if (threadIdx.x == 0) ids[r] = i;
}
