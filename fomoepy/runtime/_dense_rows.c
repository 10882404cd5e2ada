/* The Q8_0 dense products of a decode batch (one row of each of B sequences), each row's result bit for
   bit the one ggml computes for that row alone, each weight block read once for all B rows
   (fomoepy.runtime.dense_rows).

   A batched step must give each sequence the bits it gets alone, so its products with dense weights were
   B one-row products (ggml_dense.product): ggml's one-row dot product, ggml_vec_dot_q8_0_q8_0, costs
   about 11 instructions a 32-weight block a row (two fp16 scales, a product of them, the sign trick, the
   integer dot product, a conversion, a fused add), and at 8 rows that arithmetic, not the weights' bytes,
   was most of a bench-model step's dense time (its 34.8 MB output head: 4.1 ms at 8 rows on 2 threads,
   0.83 at one, by hand on this 2-vCPU AMD EPYC).

   Here each weight block is loaded once, its absolute value and its scale made once for all the rows,
   and the rows' blocks and scales are laid out once a call, in pairs. The arithmetic per row and lane is
   ggml's AVX2 one (arch/x86/quants.c):

       q_j   = Σ_{k=4j..4j+3} |w_k| · sign(w_k)·a_k      (exact int32: VNNI's dpbusd, or maddubs then madd)
       d     = fp32(w.d) · fp32(a.d)                     (one float32 product)
       acc_j = fma(d, float(q_j), acc_j)                 block after block
       out   = hsum_float_8(acc)                          (ggml's order: halves, then pairs, then the last two)

   so every output element is the same sequence of float32 operations on the same values: the same bits.
   The activations are quantized by ggml itself (a ggml_cpy to Q8_0, the function its mul_mat takes), so
   they are the ones it would use. The engine asks ggml once whether its one-row products agree with this
   on this CPU and build (dense_rows.agrees) and otherwise keeps ggml's one-row products.

   Two forms, chosen at run time and compiled with target attributes so the module builds for any x86-64:
   AVX-512 (F, BW, VL, VNNI: two rows to a register, the weight block broadcast to both halves) and AVX2
   (with FMA and F16C: a row to a register); elsewhere ggml's one-row products serve, as before. Both give
   ggml's bits (tests/test_dense_rows.py runs each form the CPU has). Threads: a custom node of ggml's
   graph runs on each of its threads, each taking a range of weight rows. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_ggml_fields.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define QK8_0 32
typedef struct { uint16_t d; int8_t qs[QK8_0]; } block_q8_0; /* 34 bytes, as ggml's */

/* The node's userdata: where a ggml_tensor keeps its data pointer, sources and sizes (_ggml_fields.h
   reads them), and the form it runs. */
typedef struct {
    int64_t data_offset, src_offset, ne_offset;
    int64_t form; /* FORM_AVX2 or FORM_AVX512 */
} OpInfo;


enum { FORM_NONE = 0, FORM_AVX2 = 1, FORM_AVX512 = 2 }; /* the kernel's forms: the same bits, each ggml's */

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Two rows' activations per block: their 64 quants and their scales spread over the lanes (16 floats). */
typedef struct {
    int8_t qs[2 * QK8_0];
    float d[16];
} PairBlock;

AVX2 static inline float hsum_float_8(__m256 x) { /* ggml's */
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

AVX2 static inline float fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }

/* One weight row (w, `nb` blocks) against NP pairs of rows (block b of pair p at pairs[b * stride + p]: a
   block's pairs side by side) → out[r * ldo] for the 2·NP rows r < n_rows. Inlined with a constant NP:
   the accumulators stay in registers. One weight row at a time: by hand, two or four rows' blocks
   interleaved ran four times slower on this EPYC (its loads' streams).
   AVX-512: a register holds a pair (row 2p in its low eight lanes, 2p + 1 in its high eight), the weight
   block broadcast to both halves, VNNI's dpbusd for the integer dot products (ggml's, where it has VNNI);
   NP ≤ 8. */
AVX512 static inline __attribute__((always_inline)) void tile512(int NP, const block_q8_0 *w, int nb, const PairBlock *pairs, int stride,
                                                                 int n_rows, float *out, int64_t ldo) {
    __m512 acc[8];
    for (int p = 0; p < NP; ++p) acc[p] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int b = 0; b < nb; ++b) {
        const __m512i wv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w[b].qs));
        const __m512i ax = _mm512_abs_epi8(wv);
        const __mmask64 negative = _mm512_movepi8_mask(wv);
        const __m512 dw = _mm512_set1_ps(fp16_to_fp32(w[b].d));
        for (int p = 0; p < NP; ++p) {
            const PairBlock *a = pairs + (int64_t)b * stride + p;
            const __m512i av = _mm512_loadu_si512(a->qs);
            /* ggml's sign(a, w): -a where w < 0 (where w = 0, |w| = 0 makes the product 0 either way) */
            const __m512i sy = _mm512_mask_sub_epi8(av, negative, zero, av);
            const __m512 q = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, ax, sy));
            const __m512 d = _mm512_mul_ps(dw, _mm512_loadu_ps(a->d));
            acc[p] = _mm512_fmadd_ps(d, q, acc[p]);
        }
    }
    for (int p = 0; p < NP; ++p) {
        const int r = 2 * p;
        out[(int64_t)r * ldo] = hsum_float_8(_mm512_castps512_ps256(acc[p]));
        if (r + 1 < n_rows) out[(int64_t)(r + 1) * ldo] = hsum_float_8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p]), 1)));
    }
}

/* AVX2: a register a row, the integer dot products as ggml's without VNNI (maddubs, then madd with ones:
   the same integers, no pair of products reaching int16's bound since no activation is -128); NP ≤ 4
   (sixteen registers). */
AVX2 static inline __attribute__((always_inline)) void tile256(int NP, const block_q8_0 *w, int nb, const PairBlock *pairs, int stride,
                                                               int n_rows, float *out, int64_t ldo) {
    __m256 acc[8];
    for (int r = 0; r < 2 * NP; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; ++b) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)w[b].qs);
        const __m256i ax = _mm256_sign_epi8(wv, wv);
        const __m256 dw = _mm256_set1_ps(fp16_to_fp32(w[b].d));
        for (int p = 0; p < NP; ++p) {
            const PairBlock *a = pairs + (int64_t)b * stride + p;
            for (int h = 0; h < 2; ++h) {
                const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a->qs + h * QK8_0)), wv);
                const __m256 q = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, _mm256_maddubs_epi16(ax, sy)));
                const __m256 d = _mm256_mul_ps(dw, _mm256_loadu_ps(a->d + 8 * h));
                acc[2 * p + h] = _mm256_fmadd_ps(d, q, acc[2 * p + h]);
            }
        }
    }
    for (int r = 0; r < 2 * NP && r < n_rows; ++r) out[(int64_t)r * ldo] = hsum_float_8(acc[r]);
}

/* Weight rows [i0, i1) of the product for every row: each weight row against the pairs MAX_NP at a time (a
   batch past 2·MAX_NP rows takes the row again from the cache). */
#define PRODUCT_ROWS(NAME, TILE, MAX_NP, TARGET, ...)                                                                       \
    TARGET static void NAME(const block_q8_0 *w, int nb, const PairBlock *pairs, int B, float *out, int64_t ldo, int64_t i0, \
                            int64_t i1) {                                                                                    \
        const int n_pairs = (B + 1) / 2;                                                                                     \
        for (int64_t i = i0; i < i1; ++i)                                                                                    \
            for (int p0 = 0; p0 < n_pairs; p0 += MAX_NP) {                                                                   \
                const block_q8_0 *row = w + i * nb;                                                                          \
                const PairBlock *pp = pairs + p0;                                                                            \
                float *o = out + (int64_t)(2 * p0) * ldo + i;                                                                \
                const int rows = B - 2 * p0;                                                                                 \
                switch (n_pairs - p0) { __VA_ARGS__ default: TILE(MAX_NP, row, nb, pp, n_pairs, rows, o, ldo); break; }       \
            }                                                                                                                \
    }
#define CASE512(NP) case NP: tile512(NP, row, nb, pp, n_pairs, rows, o, ldo); break;
#define CASE256(NP) case NP: tile256(NP, row, nb, pp, n_pairs, rows, o, ldo); break;
PRODUCT_ROWS(product_rows512, tile512, 8, AVX512, CASE512(1) CASE512(2) CASE512(3) CASE512(4) CASE512(5) CASE512(6) CASE512(7))
PRODUCT_ROWS(product_rows256, tile256, 4, AVX2, CASE256(1) CASE256(2) CASE256(3))

/* The B rows' Q8_0 blocks (x: B rows of nb blocks) laid out in pairs, a block's pairs side by side (an odd
   B's last pair padded with zeros: computed, never written). */
AVX2 static void pack_pairs(const block_q8_0 *x, int B, int nb, PairBlock *pairs) {
    const int n_pairs = (B + 1) / 2;
    for (int p = 0; p < n_pairs; ++p)
        for (int b = 0; b < nb; ++b) {
            PairBlock *pb = pairs + (int64_t)b * n_pairs + p;
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * p + h;
                float d = 0.0f;
                if (r < B) {
                    memcpy(pb->qs + h * QK8_0, x[(int64_t)r * nb + b].qs, QK8_0);
                    d = fp16_to_fp32(x[(int64_t)r * nb + b].d);
                } else {
                    memset(pb->qs + h * QK8_0, 0, QK8_0);
                }
                for (int j = 0; j < 8; ++j) pb->d[h * 8 + j] = d;
            }
        }
}

static int cpu_form(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return FORM_NONE;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
        return FORM_AVX512;
    return FORM_AVX2;
}

/* The graph node: src[0] the weights, Q8_0 [K, N] (rows contiguous), src[1] the rows' activations
   quantized by ggml, Q8_0 [K, B]; dst float32 [N, B]; the form the userdata names (one the CPU runs:
   dense_rows checks it). Each thread its share of the weight rows, each packing the rows' pairs for
   itself (about 2·B·K bytes, 16 KB at 8 rows of 1024: less than a barrier between two nodes would cost). */
static void op_product(void *dst, int ith, int nth, void *userdata) {
    const OpInfo *o = userdata;
    const void *wt = src_of(o, dst, 0), *xt = src_of(o, dst, 1);
    const int64_t K = ne_of(o, wt, 0), N = ne_of(o, wt, 1), B = ne_of(o, xt, 1);
    const int nb = (int)(K / QK8_0);
    const int64_t i0 = N * ith / nth, i1 = N * (ith + 1) / nth;
    if (i0 >= i1) return;
    PairBlock *pairs = aligned_alloc(64, sizeof(PairBlock) * (size_t)((B + 1) / 2) * (size_t)nb);
    if (!pairs) abort(); /* (ggml's own nodes abort on a failed allocation as well) */
    pack_pairs(data_of(o, xt), (int)B, nb, pairs);
    if (o->form == FORM_AVX512)
        product_rows512(data_of(o, wt), nb, pairs, (int)B, data_of(o, dst), N, i0, i1);
    else
        product_rows256(data_of(o, wt), nb, pairs, (int)B, data_of(o, dst), N, i0, i1);
    free(pairs);
}
#else
static int cpu_form(void) { return FORM_NONE; }
static void op_product(void *dst, int ith, int nth, void *userdata) { (void)dst, (void)ith, (void)nth, (void)userdata; abort(); }
#endif

/* form() → the fastest form this CPU runs: 0 none, 1 AVX2 (with FMA, F16C), 2 AVX-512 (F, BW, VL, VNNI) */
static PyObject *form(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromLong(cpu_form());
}

/* graph_op() → the node's function (a ggml_custom_op_t) as an address */
static PyObject *graph_op(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromVoidPtr((void *)op_product);
}

static PyMethodDef methods[] = {
    {"form", form, METH_NOARGS, "the fastest form this CPU runs: 0 none, 1 AVX2, 2 AVX-512"},
    {"graph_op", graph_op, METH_NOARGS, "the graph node's function, as an address"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dense_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__dense_rows(void) { return PyModule_Create(&module); }
