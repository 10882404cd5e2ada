/* A decode row's attention over its own sequence's KV cache, for every row of a step in one node of a
   ggml graph (fomoepy.runtime.row_attention).

   ggml's attention is two products and a softmax, nodes made for one sequence's cache at a time: a batched
   step took five nodes a sequence and layer (the key and value copies into the cache, the two products, the
   softmax) and a concatenation of the sequences' outputs, each node one of the graph's barriers, and their
   shapes fixed the span of positions each cache was read over, so the graph was built again when it
   changed. By hand, bench model, 8 sequences on 2 threads, this 2-vCPU AMD EPYC: those nodes were ~1.9 ms
   of a 17 ms step. Here one node takes every row: each row's key and value into its cache at its position,
   then for each query head

       s_p = (q · K_p) · scale            p = 0 .. position   (the positions the row attends: no mask)
       w_p = exp(s_p - max s)
       out = (Σ_p w_p · V_p) · (1 / Σ_p w_p)

   The arithmetic is this file's, the same on every row whatever the other rows, the thread count or the
   form the CPU runs: a dot product keeps 16 partial sums (element i into sum i mod 16) and adds them by a
   fixed tree; exp is exp_neg below; products and sums are rounded apart (-ffp-contract=off, no fma), so the
   vector forms (target_clones: AVX-512, AVX2, and plain x86-64 or any CPU) give the bits of the scalar loop.
   Every decode row of the cpu backend takes its attention here (a lone row's graphs, a batch's, the
   op-by-op path), so a row gets the same bits alone or in any batch; a prefill's rows keep ggml's nodes.

   The caches are laid out as fomoepy.runtime.ggml_attention.KVMemory lays them out: keys [Hkv, capacity, hd]
   (a position's dims contiguous), values [Hkv, hd, capacity] (a dim's positions contiguous). A row's cache
   and position come in a table given per run (int64 [8, B]: keys' and values' addresses, the position,
   whether to write the row's key and value, the keys' position and head strides and the values' dim and
   head strides, in floats), so one graph serves every position and any caches of that shape. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_ggml_fields.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define TABLE 8 /* int64 a row: k, v, position, write, k position stride, k head stride, v dim stride, v head stride */

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* Σ a_i·b_i, i < n, in LANES partial sums (i into sum i mod LANES; n a multiple of LANES or not) added by a
   fixed tree */
static inline float dot(const float *a, const float *b, int64_t n) {
    float s[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float p = a[i + l] * b[i + l];
            s[l] = s[l] + p;
        }
    for (int l = 0; i + l < n; l++) {
        float p = a[i + l] * b[i + l];
        s[l] = s[l] + p;
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) s[l] = s[l] + s[l + w];
    return s[0];
}

/* e^x for x <= 0 (a score less the row's largest): 2^n · e^r, n = round(x / ln 2), r = x - n·ln 2 (ln 2 in
   two parts), e^r by its degree-7 Taylor polynomial (|r| <= ln2/2: its truncation ~5e-9 relative, the
   rest float32 roundings, a few ulp); below -87 (under float32's smallest normal) 0 */
static inline float exp_neg(float x) {
    const float magic = 12582912.0f; /* 1.5·2^23: adding it rounds to an integer in the low bits */
    const float xc = x > -87.0f ? x : -87.0f; /* (n in range for the conversion below) */
    float t = xc * 1.44269504f;
    float n = (t + magic) - magic;
    float r = xc - n * 0.693145752f;
    r = r - n * 1.42860677e-06f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)(e > 0 ? e : 0) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

/* one query head over positions 0..n-1: keys [n, hd] (position stride ks), values [hd, n] (dim stride vd) */
CLONES static void head_attention(const float *q, const float *keys, int64_t ks, const float *values, int64_t vd, int64_t n,
                                  int64_t hd, float scale, float *scores, float *out) {
    float max = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        float s = dot(q, keys + p * ks, hd) * scale;
        scores[p] = s;
        max = s > max ? s : max;
    }
    float sum[LANES] = {0};
    int64_t p = 0;
    for (; p + LANES <= n; p += LANES)
        for (int l = 0; l < LANES; l++) {
            float w = exp_neg(scores[p + l] - max);
            scores[p + l] = w;
            sum[l] = sum[l] + w;
        }
    for (int l = 0; p + l < n; l++) {
        float w = exp_neg(scores[p + l] - max);
        scores[p + l] = w;
        sum[l] = sum[l] + w;
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) sum[l] = sum[l] + sum[l + w];
    const float inv = 1.0f / sum[0];
    for (int64_t d = 0; d < hd; d++) out[d] = dot(scores, values + d * vd, n) * inv;
}

/* The node's userdata: where a ggml_tensor keeps its data pointer, sources and sizes (_ggml_fields.h
   reads them), the kv heads and the scores' scale. */
typedef struct {
    int64_t data_offset, src_offset, ne_offset;
    int64_t n_head_kv;
    float scale;
} OpInfo;


/* The node: src[0] q [hd, H, B], src[1] the rows' keys [hd, Hkv, B], src[2] their values [hd·Hkv, B] (each
   contiguous float32), src[3] the table int64 [8, B]; dst [hd, H, B]. Work items are (row, kv head), each
   one thread's: it writes the head's key and value of the row (where the table says to) and attends the
   group of query heads that share them. */
static void op_attention(void *dst, int ith, int nth, void *userdata) {
    const OpInfo *o = userdata;
    const void *qt = src_of(o, dst, 0), *kt = src_of(o, dst, 1), *vt = src_of(o, dst, 2), *tt = src_of(o, dst, 3);
    const int64_t hd = ne_of(o, qt, 0), H = ne_of(o, qt, 1), B = ne_of(o, qt, 2), Hkv = o->n_head_kv, group = H / Hkv;
    const float *q = (const float *)data_of(o, qt), *knew = (const float *)data_of(o, kt), *vnew = (const float *)data_of(o, vt);
    const int64_t *table = (const int64_t *)data_of(o, tt);
    float *out = (float *)data_of(o, dst);
    float *scores = NULL;
    int64_t room = 0;
    for (int64_t item = ith; item < B * Hkv; item += nth) {
        const int64_t b = item / Hkv, g = item % Hkv;
        const int64_t *row = table + b * TABLE;
        float *K = (float *)(intptr_t)row[0], *V = (float *)(intptr_t)row[1];
        const int64_t pos = row[2], ks = row[4], kh = row[5], vd = row[6], vh = row[7];
        float *keys = K + g * kh, *values = V + g * vh;
        if (row[3]) {
            memcpy(keys + pos * ks, knew + (b * Hkv + g) * hd, sizeof(float) * (size_t)hd);
            for (int64_t d = 0; d < hd; d++) values[d * vd + pos] = vnew[(b * Hkv + g) * hd + d];
        }
        if (pos + 1 > room) {
            free(scores);
            room = pos + 1;
            scores = malloc(sizeof(float) * (size_t)room);
            if (!scores) abort(); /* (ggml's own nodes abort on a failed allocation as well) */
        }
        for (int64_t j = 0; j < group; j++) {
            const int64_t h = g * group + j;
            head_attention(q + (b * H + h) * hd, keys, ks, values, vd, pos + 1, hd, o->scale, scores, out + (b * H + h) * hd);
        }
    }
    free(scores);
}

/* graph_op() → the node's function (a ggml_custom_op_t), as an address */
static PyObject *graph_op(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromVoidPtr((void *)op_attention);
}

static PyMethodDef methods[] = {
    {"graph_op", graph_op, METH_NOARGS, "the graph node's function, as an address"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_attention(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "TABLE", TABLE) < 0) Py_CLEAR(m);
    return m;
}
