// attention.hip: causal GQA attention of T new queries over a float32 KV cache (decode: T = 1;
// prefill: T > 1, query t sees positions 0 .. n_past + t); a batched decode step's rows, each into and
// over its own sequence's cache; and the gated-attention output gate.
//
// One block per (head, query), ATT_WARPS warps: warp w takes positions w, w + ATT_WARPS, ... with an
// online softmax (running max m, sum l, weighted values acc), then the warps' states are merged.
// Each lane holds head dims lane, lane + 32, ... (head_dim a multiple of 32, at most ATT_MAX_HD).
#include "compat.h"

#define ATT_WARPS 4
#define ATT_MAX_HD 256
#define ATT_PER_LANE (ATT_MAX_HD / WARP)

// One block's attention, ATT_WARPS warps: query row qr over positions 0 .. n_kv - 1 of k_cache, v_cache
// ([.., Hkv, hd], kv head kvh), into o [hd]; s_m, s_l, s_acc the block's shared merge space. Both kernels
// below run this, so a decode row attends with the same arithmetic in a batch of sequences as alone.
DEVINL void attend_row(const float* qr, const float* k_cache, const float* v_cache, float* o, int Hkv, int kvh, int hd,
                       int n_kv, float scale, float* s_m, float* s_l, float (*s_acc)[ATT_MAX_HD]) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int per_lane = hd / WARP;
    float qv[ATT_PER_LANE], acc[ATT_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; i++) {
        qv[i] = i < per_lane ? qr[lane + WARP * i] : 0.0f;
        acc[i] = 0.0f;
    }
    const i64 pos_stride = (i64)Hkv * hd;
    float m = NEG_INF, l = 0.0f;
    for (int j = warp; j < n_kv; j += ATT_WARPS) {
        const float* kr = k_cache + (i64)j * pos_stride + (i64)kvh * hd;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; i++)
            if (i < per_lane) s += qv[i] * kr[lane + WARP * i];
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);  // 0 on the first position (m = -inf)
        const float p = expf(s - m_new);
        l = l * corr + p;
        const float* vr = v_cache + (i64)j * pos_stride + (i64)kvh * hd;
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; i++)
            if (i < per_lane) acc[i] = acc[i] * corr + p * vr[lane + WARP * i];
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; i++)
        if (i < per_lane) s_acc[warp][lane + WARP * i] = acc[i];
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, s_m[w]);
    float L = 0.0f, f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = s_l[w] > 0.0f ? expf(s_m[w] - M) : 0.0f;  // a warp that saw no position adds nothing
        L += s_l[w] * f[w];
    }
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) v += s_acc[w][e] * f[w];
        o[e] = v / L;
    }
}

DEVINL bool attention_shape_ok(int H, int Hkv, int hd) {
    return hd <= ATT_MAX_HD && hd % WARP == 0 && Hkv > 0 && H % Hkv == 0;
}

// q [T, H, hd] with token stride qt and head stride qh; k_cache, v_cache [n_ctx, Hkv, hd];
// out [T, H, hd] contiguous. scale = 1/sqrt(hd) (applied to q.k, as the reference does).
KERNEL void LAUNCH_BOUNDS(ATT_WARPS * WARP)
    attention_f32(const float* q, i64 qt, i64 qh, const float* k_cache, const float* v_cache, float* out, int T,
                  int H, int Hkv, int hd, int n_past, int n_ctx, float scale, i32* err) {
    SHARED(float, s_m, [ATT_WARPS]);
    SHARED(float, s_l, [ATT_WARPS]);
    SHARED(float, s_acc, [ATT_WARPS][ATT_MAX_HD]);
    const int h = blockIdx.x, t = blockIdx.y;
    if (h >= H || t >= T) return;
    if (n_past < 0 || n_past + T > n_ctx) {
        if (threadIdx.x == 0) raise_error(err, ERR_CONTEXT);
        return;
    }
    if (!attention_shape_ok(H, Hkv, hd)) {
        if (threadIdx.x == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    // causal: query t sits at position n_past + t
    attend_row(q + (i64)t * qt + (i64)h * qh, k_cache, v_cache, out + ((i64)t * H + h) * hd, Hkv, h / (H / Hkv), hd,
               n_past + t + 1, scale, s_m, s_l, s_acc);
}

// One decode row of each of B sequences, over its own cache (a batched decode step): row b's query
// q[b] (token stride qt, head stride qh) sits at position rows[b] of the cache at k_caches[b],
// v_caches[b] ([rows[B + b], Hkv, hd]: its n_ctx), whose key and value are written there already;
// out [B, H, hd] contiguous. rows: int64 [2B], positions then n_ctx; the caches' addresses int64.
KERNEL void LAUNCH_BOUNDS(ATT_WARPS * WARP)
    attention_rows_f32(const float* q, i64 qt, i64 qh, const i64* k_caches, const i64* v_caches, const i64* rows,
                       float* out, int B, int H, int Hkv, int hd, float scale, i32* err) {
    SHARED(float, s_m, [ATT_WARPS]);
    SHARED(float, s_l, [ATT_WARPS]);
    SHARED(float, s_acc, [ATT_WARPS][ATT_MAX_HD]);
    const int h = blockIdx.x, b = blockIdx.y;
    if (h >= H || b >= B) return;
    const i64 n_past = rows[b];
    if (n_past < 0 || n_past + 1 > rows[B + b]) {
        if (threadIdx.x == 0) raise_error(err, ERR_CONTEXT);
        return;
    }
    if (!attention_shape_ok(H, Hkv, hd)) {
        if (threadIdx.x == 0) raise_error(err, ERR_SHAPE);
        return;
    }
    attend_row(q + (i64)b * qt + (i64)h * qh, global_ptr<const float>(k_caches[b]), global_ptr<const float>(v_caches[b]),
               out + ((i64)b * H + h) * hd, Hkv, h / (H / Hkv), hd, (int)n_past + 1, scale, s_m, s_l, s_acc);
}

// Each of B rows' key and value into its own sequence's cache: k, v [B, n] contiguous (n = Hkv * hd) to
// position rows[b] of the caches at k_caches[b], v_caches[b] ([rows[B + b], n]). Grid (ceil(n / 256), B).
KERNEL void LAUNCH_BOUNDS(256) kv_append_rows_f32(const float* k, const float* v, const i64* k_caches, const i64* v_caches,
                                                  const i64* rows, int B, int n, i32* err) {
    const int b = blockIdx.y;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B || i >= n) return;
    const i64 pos = rows[b];
    if (pos < 0 || pos >= rows[B + b]) {
        if (i == 0) raise_error(err, ERR_CONTEXT);
        return;
    }
    global_ptr<float>(k_caches[b])[pos * n + i] = k[(i64)b * n + i];
    global_ptr<float>(v_caches[b])[pos * n + i] = v[(i64)b * n + i];
}

// out = a * sigmoid(gate), elementwise over n (qwen35moe gated attention output)
KERNEL void LAUNCH_BOUNDS(256) sigmoid_gate_f32(const float* a, const float* gate, float* out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fmul_rn(a[i], sigmoid_f(gate[i]));
}
