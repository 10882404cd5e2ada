/* The cpu backend's routed experts of a decode step, each expert's weights decoded once for every row that
   picked it (fomoepy.runtime.batched_experts).

   ggml's mul_mat_id takes a step's picks one row at a time: a K-quant row of weights is decoded (its
   nibbles split, its 6-bit scales and mins unpacked and spread over the lanes) for every (weight row,
   activation row) pair it meets, and that decoding is most of the work. Here each superblock is decoded
   once and every row that picked the expert is taken from it; eight weight rows' sums are reduced together
   (reduce8), and the bodies are compiled for each count of 1 to 8 rows (a decode step's experts mostly have
   1 or 2: 1.2 rows an expert at 4 sequences, 1.6 at 8, on the bench model; a 32-token prompt's about 4)
   and take more rows eight at a time. By hand on this 2-vCPU AMD EPYC (AVX-512), a
   bench-model layer's routed experts at 1 / 8 decode rows: 1 thread 0.39 / 2.42 ms against ggml's repacked
   products' 0.36 / 2.59; 2 threads 0.21 / 1.11 against 0.28 / 2.16. Steps along the way, by hand, one
   thread, one row: the first form 0.60 ms, -O3 0.45, eight rows reduced together 0.38, the one-row body
   0.30 (random experts of the bench shape, bench-style picks).

   The arithmetic is ggml's: each activation row quantized to Q8_K (absmax to 127 per 256, rounded to
   nearest even, as quantize_row_q8_K), the block dot products exact in integers (Q4_K: Σ_j sc_j Σ q·a and
   Σ_j m_j bsum_j; Q6_K: Σ_g sc_g Σ q·a − 32 Σ_g sc_g bsum_g), each superblock's integers scaled by their
   floats and added in float32; only the order of those float additions differs from ggml's (lanes of a
   512-bit register, then reduce8's tree). A row's result depends on its own inputs alone, never on the
   other rows of the step, the thread split or which weight rows share its reduction, so a sequence's bits
   are the same alone or in any batch, on any thread count. The SiLU·up product between the two halves is
   float32 `g / (1 + expf(-g)) * u` per element.

   Three implementations of that one arithmetic: AVX-512 (F, BW, VL, VNNI), AVX2 (with FMA and F16C), each
   chosen at run time and compiled for with a target attribute so the module builds for any x86-64, and
   portable C. They give the same integers; their float sums differ in order only. Tests hold every form
   the CPU runs to numpy's exact arithmetic; the engine uses the AVX-512 form by default (--expert-kernel
   auto: where it was measured) and the AVX2 form on asking (on: by hand, forced on this EPYC, 0.40 ms a
   bench-model layer's decode row on 1 thread against ggml's repacked 0.36; not measured on a CPU without
   AVX-512); elsewhere ggml's products, as before. Threads: OpenMP when called from Python (the
   runtime ggml's CPU backend runs on, so the same pool), ggml's own as nodes of its graphs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_ggml_fields.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define QK 256
enum { TYPE_Q4_K = 12, TYPE_Q6_K = 14 }; /* ggml's type numbers */

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K;   /* 144 bytes */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_K; /* 210 */
typedef struct { float d; int8_t qs[QK]; int16_t bsums[16]; } block_q8_K;                     /* 292 */

static size_t row_bytes(int type, int cols) {
    return (size_t)(cols / QK) * (type == TYPE_Q4_K ? sizeof(block_q4_K) : sizeof(block_q6_K));
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 1024));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 1023) << 13;
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | man << 13;
    else bits = sign | (exp + 127 - 15) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K's 12 bytes of scales and mins → 8 scales then 8 mins, each 6 bits, as bytes (ggml's kmask scheme,
   a word at a time) */
static inline void q4k_scales(const uint8_t *s, uint8_t out[16]) {
    uint32_t u[4];
    memcpy(u, s, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins_low = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_low;
    u[0] &= k1;
    memcpy(out, u, 16);
}

/* x[cols] → Q8_K blocks: per 256, the value of largest magnitude maps to -127 (ggml's quantize_row_q8_K) */
static void quantize_q8_K(const float *x, block_q8_K *y, int cols) {
    for (int b = 0; b < cols / QK; b++, x += QK) {
        float max = 0, amax = 0;
        for (int j = 0; j < QK; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) amax = ax, max = x[j];
        }
        if (amax == 0) {
            memset(&y[b], 0, sizeof y[b]);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(iscale * x[j]); /* (the default rounding: to nearest, ties to even) */
            y[b].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y[b].qs[16 * j + i];
            y[b].bsums[j] = (int16_t)sum;
        }
        y[b].d = 1 / iscale;
    }
}

/* The Q4_K kernel's view of Q8_K blocks: a Q4_K superblock's 128 bytes of nibbles split into 512-bit
   registers by one AND and one shift give sub-blocks (0, 2), (1, 3), (4, 6), (5, 7), so the view holds the
   quants in that order; and its bsums[0..7] hold each sub-block's sum of 32 (the mins' factor), made once
   per row instead of at every weight row. */
static void q4k_view(const block_q8_K *in, block_q8_K *out, int nb) {
    static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int b = 0; b < nb; b++) {
        out[b].d = in[b].d;
        for (int i = 0; i < 8; i++) memcpy(out[b].qs + 32 * i, in[b].qs + 32 * order[i], 32);
        for (int j = 0; j < 8; j++) out[b].bsums[j] = (int16_t)(in[b].bsums[2 * j] + in[b].bsums[2 * j + 1]), out[b].bsums[8 + j] = 0;
    }
}

/* ---- portable C: one weight row against R activation rows ---- */

static void q4k_rows_c(const block_q4_K *x, int nb, int R, block_q8_K *const *y, float *out, size_t out_stride) {
    for (int r = 0; r < R; r++) {
        float sum = 0;
        for (int i = 0; i < nb; i++) {
            uint8_t sm[16];
            q4k_scales(x[i].scales, sm);
            const block_q8_K *a = &y[r][i];
            int32_t dots = 0, mins = 0;
            for (int j = 0; j < 8; j++) {
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += ((x[i].qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15) * a->qs[32 * j + l];
                dots += sm[j] * dot;
                mins += sm[8 + j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
            }
            sum += a->d * half_to_float(x[i].d) * (float)dots - a->d * half_to_float(x[i].dmin) * (float)mins;
        }
        out[r * out_stride] = sum;
    }
}

static void q6k_rows_c(const block_q6_K *x, int nb, int R, block_q8_K *const *y, float *out, size_t out_stride) {
    for (int r = 0; r < R; r++) {
        float sum = 0;
        for (int i = 0; i < nb; i++) {
            const block_q8_K *a = &y[r][i];
            int32_t dots = 0;
            for (int half = 0; half < 2; half++) {
                const uint8_t *ql = x[i].ql + 64 * half, *qh = x[i].qh + 32 * half;
                const int8_t *q8 = a->qs + 128 * half, *sc = x[i].scales + 8 * half;
                for (int e = 0; e < 128; e++) {
                    int l = e & 31, part = e >> 5; /* elements l, l+32, l+64, l+96 of the half */
                    int low = part & 1 ? ql[l + 32] : ql[l];
                    int q = ((part < 2 ? low & 15 : low >> 4) | ((qh[l] >> (2 * part)) & 3) << 4) - 32;
                    dots += sc[e / 16] * q * q8[e];
                }
            }
            sum += a->d * half_to_float(x[i].d) * (float)dots;
        }
        out[r * out_stride] = sum;
    }
}

/* ---- AVX-512 (F, BW, VNNI) ---- */

#ifdef HAVE_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

/* permutexvar indices spreading 8 16-bit values over a 512-bit register's 32 lanes: Q4_K's sub-blocks of 32
   (16 lanes of maddubs' pair sums each: two a register, in q4k_view's order), Q6_K's groups of 16 (8 lanes
   each: four) */
#define I16(a) a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a
#define I8(a) a, a, a, a, a, a, a, a
static const int16_t SPREAD_Q4K[4][32] = {{I16(0), I16(2)}, {I16(1), I16(3)}, {I16(4), I16(6)}, {I16(5), I16(7)}};
static const int16_t SPREAD_Q6K[2][32] = {{I8(0), I8(1), I8(2), I8(3)}, {I8(4), I8(5), I8(6), I8(7)}};

#define INLINE __attribute__((always_inline)) inline
/* a row body compiled for each count of 1 to 8 rows, its sums then kept in registers (a step's experts are
   mostly picked by few: by hand 0.38 → 0.30 ms a bench-model layer's decode row with 1 to 4; a prompt's by
   more: with 5 to 8 as well, a 32-token prompt's layer of random picks 4.0 → 3.4 ms on 2 threads), more
   rows eight at a time (the weight row's superblocks decoded again for each eight: a few per cent of their
   rows' work); so a body takes R <= 8 rows */
#define BY_ROW_COUNT(body, x, nb, R, y, part)                       \
    for (int r0_ = 0; r0_ < (R); r0_ += 8) {                        \
        switch ((R) - r0_ < 8 ? (R) - r0_ : 8) {                    \
        case 1: body(x, nb, 1, (y) + r0_, (part) + r0_); break;     \
        case 2: body(x, nb, 2, (y) + r0_, (part) + r0_); break;     \
        case 3: body(x, nb, 3, (y) + r0_, (part) + r0_); break;     \
        case 4: body(x, nb, 4, (y) + r0_, (part) + r0_); break;     \
        case 5: body(x, nb, 5, (y) + r0_, (part) + r0_); break;     \
        case 6: body(x, nb, 6, (y) + r0_, (part) + r0_); break;     \
        case 7: body(x, nb, 7, (y) + r0_, (part) + r0_); break;     \
        default: body(x, nb, 8, (y) + r0_, (part) + r0_); break;    \
        }                                                           \
    }
AVX512 static INLINE void q4k_row_body(const block_q4_K *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i spreads[4];
    for (int g = 0; g < 4; g++) spreads[g] = _mm512_loadu_si512(SPREAD_Q4K[g]);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < nb; i++) {
        uint8_t sm[16];
        q4k_scales(x[i].scales, sm);
        const __m128i sc8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm));
        const __m128i m8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sm + 8)));
        __m512i q[4], s[4];
        for (int half = 0; half < 2; half++) { /* 128 weights: sub-blocks 4h, 4h+2 (low nibbles); 4h+1, 4h+3 */
            const __m512i b = _mm512_loadu_si512(x[i].qs + 64 * half);
            q[2 * half] = _mm512_and_si512(b, m4);
            q[2 * half + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
        }
        for (int g = 0; g < 4; g++) s[g] = _mm512_permutexvar_epi16(spreads[g], _mm512_castsi128_si512(sc8));
        const float xd = _cvtsh_ss(x[i].d), xm = _cvtsh_ss(x[i].dmin);
        for (int r = 0; r < R; r++) {
            const block_q8_K *a = &y[r][i];
            __m512i si = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++)
                si = _mm512_dpwssd_epi32(si, _mm512_maddubs_epi16(q[g], _mm512_loadu_si512(a->qs + 64 * g)), s[g]);
            /* the mins take each sub-block's sum of 32 quants (the view's bsums) */
            const __m128i mins = _mm_madd_epi16(m8, _mm_loadu_si128((const __m128i *)a->bsums));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a->d * xd), _mm512_cvtepi32_ps(si), acc[r]);
            /* (the mins' four lanes taken from the first four of the same sum) */
            acc[r] = _mm512_sub_ps(acc[r], _mm512_zextps128_ps512(_mm_mul_ps(_mm_set1_ps(a->d * xm), _mm_cvtepi32_ps(mins))));
        }
    }
    for (int r = 0; r < R; r++)
        part[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
}

AVX512 static INLINE void q6k_row_body(const block_q6_K *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(48);
    /* the high bits of elements 0-31 are qh's bits 0-1, of 32-63 bits 2-3 (and 4-5, 6-7 for 64-127) */
    const __m512i up_low = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down_high = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i spread_low = _mm512_loadu_si512(SPREAD_Q6K[0]), spread_high = _mm512_loadu_si512(SPREAD_Q6K[1]);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < nb; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        __m512i q[4], s[4];
        for (int half = 0; half < 2; half++) {
            const __m512i ql = _mm512_loadu_si512(x[i].ql + 64 * half);
            const __m256i qh1 = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * half));
            const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh1), qh1, 1);
            q[2 * half] = _mm512_or_si512(_mm512_and_si512(ql, m15), _mm512_and_si512(_mm512_sllv_epi16(qh, up_low), m48));
            q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m15),
                                              _mm512_and_si512(_mm512_srlv_epi16(qh, down_high), m48));
            const __m128i half_scales = half ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16);
            s[2 * half] = _mm512_permutexvar_epi16(spread_low, _mm512_castsi128_si512(half_scales));
            s[2 * half + 1] = _mm512_permutexvar_epi16(spread_high, _mm512_castsi128_si512(half_scales));
        }
        const float xd = _cvtsh_ss(x[i].d);
        for (int r = 0; r < R; r++) {
            const block_q8_K *a = &y[r][i];
            __m512i si = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++)
                si = _mm512_dpwssd_epi32(si, _mm512_maddubs_epi16(q[g], _mm512_loadu_si512(a->qs + 64 * g)), s[g]);
            const __m256i offs = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)a->bsums)), 5);
            si = _mm512_sub_epi32(si, _mm512_zextsi256_si512(offs));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a->d * xd), _mm512_cvtepi32_ps(si), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        part[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
}

AVX512 static void q4k_row_avx512(const void *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    BY_ROW_COUNT(q4k_row_body, x, nb, R, y, part)
}
AVX512 static void q6k_row_avx512(const void *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    BY_ROW_COUNT(q6k_row_body, x, nb, R, y, part)
}

/* ---- AVX2 (with FMA and F16C): the same scheme on 256-bit registers, for CPUs without AVX-512 ----
   A Q4_K group of 32 bytes gives sub-blocks 2g (low nibbles) and 2g+1 (high) against the activations in
   their natural order; each sub-block's scale broadcast once a superblock; pair sums by madd. */

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static INLINE void q4k_row_body_avx2(const block_q4_K *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++) {
        uint8_t sm[16];
        q4k_scales(x[i].scales, sm);
        const __m128i m8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sm + 8)));
        __m256i q[8], s[8];
        for (int g = 0; g < 4; g++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * g));
            q[2 * g] = _mm256_and_si256(b, m4);
            q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
            s[2 * g] = _mm256_set1_epi16(sm[2 * g]);
            s[2 * g + 1] = _mm256_set1_epi16(sm[2 * g + 1]);
        }
        const float xd = _cvtsh_ss(x[i].d), xm = _cvtsh_ss(x[i].dmin);
        for (int r = 0; r < R; r++) {
            const block_q8_K *a = &y[r][i];
            __m256i si = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                si = _mm256_add_epi32(si, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(a->qs + 32 * j))), s[j]));
            const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)a->bsums), _mm_loadu_si128((const __m128i *)(a->bsums + 8)));
            const __m128 mins = _mm_mul_ps(_mm_set1_ps(a->d * xm), _mm_cvtepi32_ps(_mm_madd_epi16(m8, pairs)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a->d * xd), _mm256_cvtepi32_ps(si), acc[r]);
            acc[r] = _mm256_sub_ps(acc[r], _mm256_insertf128_ps(_mm256_setzero_ps(), mins, 0));
        }
    }
    for (int r = 0; r < R; r++) part[r] = acc[r];
}

AVX2 static INLINE void q6k_row_body_avx2(const block_q6_K *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        __m256i q[8], s[8];
        for (int half = 0; half < 2; half++) { /* elements 0-31, 32-63, 64-95, 96-127 of the half */
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * half + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * half));
            q[4 * half] = _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m48));
            q[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m48));
            q[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, m48));
            q[4 * half + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), m48));
            for (int j = 0; j < 4; j++) /* 32 elements: groups of 16 with scales 8·half + 2j, + 1 */
                s[4 * half + j] = _mm256_set_m128i(_mm_set1_epi16(x[i].scales[8 * half + 2 * j + 1]), _mm_set1_epi16(x[i].scales[8 * half + 2 * j]));
        }
        const float xd = _cvtsh_ss(x[i].d);
        for (int r = 0; r < R; r++) {
            const block_q8_K *a = &y[r][i];
            __m256i si = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                si = _mm256_add_epi32(si, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(a->qs + 32 * j))), s[j]));
            const __m256i offs = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)a->bsums)), 5);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a->d * xd), _mm256_cvtepi32_ps(_mm256_sub_epi32(si, offs)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) part[r] = acc[r];
}

AVX2 static void q4k_row_avx2(const void *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    BY_ROW_COUNT(q4k_row_body_avx2, x, nb, R, y, part)
}
AVX2 static void q6k_row_avx2(const void *x, int nb, int R, block_q8_K *const *y, __m256 *part) {
    BY_ROW_COUNT(q6k_row_body_avx2, x, nb, R, y, part)
}

/* eight weight rows' 8-lane sums → their eight totals, each by the same tree (adjacent lanes, then pairs,
   then the two halves), whatever the other rows hold */
AVX2 static __m256 reduce8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define PART_ROWS 64 /* activation rows whose partial sums a call keeps at a time */

/* one weight row against n activation rows, a form's: 8 float lanes each into part[r] */
typedef void (*row_fn)(const void *x, int nb, int n, block_q8_K *const *y, __m256 *part);

/* weight rows [first, last) against R activation rows, eight weight rows at a time, each one's sums by `row`
   against `y` (the activations in the order the form's row function takes them) */
AVX2 static void rows_vector(row_fn row, const uint8_t *w, size_t stride, int nb, int first, int last, int R, block_q8_K *const *y,
                             float *out, size_t out_stride) {
    __m256 part[8][PART_ROWS];
    for (int r0 = 0; r0 < R; r0 += PART_ROWS) {
        const int n = R - r0 < PART_ROWS ? R - r0 : PART_ROWS;
        for (int row0 = first; row0 < last; row0 += 8) {
            const int rows = last - row0 < 8 ? last - row0 : 8;
            for (int j = 0; j < 8; j++) {
                if (j < rows) row(w + stride * (row0 + j), nb, n, y + r0, part[j]);
                else /* (a short chunk: the absent rows' sums zero) */
                    for (int r = 0; r < n; r++) part[j][r] = _mm256_setzero_ps();
            }
            int32_t lanes[8];
            for (int j = 0; j < 8; j++) lanes[j] = j < rows ? -1 : 0;
            const __m256i keep = _mm256_loadu_si256((const __m256i *)lanes);
            for (int r = 0; r < n; r++) {
                const __m256 v[8] = {part[0][r], part[1][r], part[2][r], part[3][r], part[4][r], part[5][r], part[6][r], part[7][r]};
                _mm256_maskstore_ps(out + (size_t)(r0 + r) * out_stride + row0, keep, reduce8(v));
            }
        }
    }
}

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

/* the best form this CPU runs */
static int cpu_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return ISA_AVX2;
    return ISA_PORTABLE;
}
#else
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int cpu_isa(void) { return ISA_PORTABLE; }
#endif

/* ---- a step's picks ---- */

#define MAX_PICKS 1024 /* a step's picks (rows x experts each): more are refused */
#define DOWN_ROWS 32   /* a down work item: this many output rows of one expert */

/* A step's picks grouped by expert: used[u] the u-th expert picked (ascending), its picks (in pick order)
   order[start[u] .. start[u + 1]). Computed alike by every thread that needs it. */
typedef struct {
    int n_used, used[MAX_PICKS], start[MAX_PICKS + 1], order[MAX_PICKS];
} Groups;

static void group_picks(const int32_t *expert, int P, Groups *g) {
    for (int p = 0; p < P; p++) { /* insertion sort of the picks by (expert, pick): a step has a few dozen */
        int i = p;
        while (i > 0 && expert[g->order[i - 1]] > expert[p]) g->order[i] = g->order[i - 1], i--;
        g->order[i] = p;
    }
    g->n_used = 0;
    for (int i = 0; i < P; i++)
        if (i == 0 || expert[g->order[i]] != expert[g->order[i - 1]]) g->start[g->n_used] = i, g->used[g->n_used++] = expert[g->order[i]];
    g->start[g->n_used] = P;
}

typedef struct {
    int types[3], K, F, isa; /* isa: the form that runs (ISA_*) */
    const uint64_t *addrs;   /* [E, 3]: each expert's gate, up and down */
} Shape;

/* one matrix's weight rows [first, last) against the rows `acts` (one per pick of the expert; `views`: their
   q4k_view blocks) */
static void rows_of(const Shape *sh, int m, const uint8_t *w, int cols, int first, int last, int R, block_q8_K *const *acts,
                    block_q8_K *const *views, float *out, size_t out_stride) {
    const size_t stride = row_bytes(sh->types[m], cols);
#ifdef HAVE_X86
    if (sh->isa != ISA_PORTABLE) { /* (AVX-512's Q4_K rows take the activations' q4k_view, AVX2's their order) */
        const int q4k = sh->types[m] == TYPE_Q4_K, avx512 = sh->isa == ISA_AVX512;
        const row_fn row = avx512 ? (q4k ? q4k_row_avx512 : q6k_row_avx512) : (q4k ? q4k_row_avx2 : q6k_row_avx2);
        rows_vector(row, w, stride, cols / QK, first, last, R, q4k && avx512 ? views : acts, out, out_stride);
        return;
    }
#endif
    for (int row = first; row < last; row++) {
        const void *x = w + stride * row;
        if (sh->types[m] == TYPE_Q4_K) q4k_rows_c(x, cols / QK, R, acts, out + row, out_stride);
        else q6k_rows_c(x, cols / QK, R, acts, out + row, out_stride);
    }
}

/* Gate, up, SiLU·up and its Q8_K form for items [lo, hi) of (expert, 256 rows of F): a Q8_K block of each
   of the expert's picks' activations is whole within an item. h_of[i], act_of[i]: the i-th grouped pick's
   row of h (Q8_K) and its activation (h_view, act_view: their q4k_view); gate, up: [P, F] scratch, by
   grouped pick. */
static void gate_up_items(const Shape *sh, const Groups *g, int lo, int hi, block_q8_K *const *h_of, block_q8_K *const *h_view,
                          block_q8_K *const *act_of, block_q8_K *const *act_view, float *gate, float *up) {
    const int K = sh->K, F = sh->F, nbF = F / QK;
    for (int item = lo; item < hi; item++) {
        const int u = item / nbF, b = item % nbF, e = g->used[u], at = g->start[u], R = g->start[u + 1] - at, first = b * QK;
        float *g0 = gate + (size_t)at * F, *u0 = up + (size_t)at * F;
        rows_of(sh, 0, (const uint8_t *)(uintptr_t)sh->addrs[3 * e], K, first, first + QK, R, h_of + at, h_view + at, g0, F);
        rows_of(sh, 1, (const uint8_t *)(uintptr_t)sh->addrs[3 * e + 1], K, first, first + QK, R, h_of + at, h_view + at, u0, F);
        for (int r = 0; r < R; r++) {
            float *gr = g0 + (size_t)r * F + first;
            const float *ur = u0 + (size_t)r * F + first;
            for (int j = 0; j < QK; j++) gr[j] = gr[j] / (1.0f + expf(-gr[j])) * ur[j];
            quantize_q8_K(gr, act_of[at + r] + b, QK);
            q4k_view(act_of[at + r] + b, act_view[at + r] + b, 1);
        }
    }
}

/* Down for items [lo, hi) of (expert, DOWN_ROWS rows of K): each pick's output row at out + pick·K */
static void down_items(const Shape *sh, const Groups *g, int lo, int hi, block_q8_K *const *act_of, block_q8_K *const *act_view,
                       float *out) {
    const int K = sh->K, F = sh->F, per = (K + DOWN_ROWS - 1) / DOWN_ROWS;
    for (int item = lo; item < hi; item++) {
        const int u = item / per, e = g->used[u], at = g->start[u], R = g->start[u + 1] - at, first = item % per * DOWN_ROWS;
        const int last = first + DOWN_ROWS < K ? first + DOWN_ROWS : K;
        const uint8_t *w = (const uint8_t *)(uintptr_t)sh->addrs[3 * e + 2];
        if (R == 1) {
            rows_of(sh, 2, w, F, first, last, 1, act_of + at, act_view + at, out + (size_t)g->order[at] * K, K);
            continue;
        }
        /* (the picks' outputs lie apart: rows computed into a block, then set at their places) */
        float block[DOWN_ROWS * 64];
        for (int r0 = 0; r0 < R; r0 += 64) {
            const int n = R - r0 < 64 ? R - r0 : 64;
            rows_of(sh, 2, w, F, first, last, n, act_of + at + r0, act_view + at + r0, block - first, DOWN_ROWS);
            for (int r = 0; r < n; r++)
                memcpy(out + (size_t)g->order[at + r0 + r] * K + first, block + (size_t)r * DOWN_ROWS, sizeof(float) * (size_t)(last - first));
        }
    }
}

static int n_gate_up_items(const Shape *sh, const Groups *g) { return g->n_used * (sh->F / QK); }
static int n_down_items(const Shape *sh, const Groups *g) { return g->n_used * ((sh->K + DOWN_ROWS - 1) / DOWN_ROWS); }

/* The Python call's step: its threads OpenMP's, one barrier (between gate/up and down). */
static int run_step(const Shape *sh, const float *h, int T, const int32_t *rows, const int32_t *expert, int P, float *out, int threads) {
    const int K = sh->K, F = sh->F, nbK = K / QK, nbF = F / QK;
    Groups *g = malloc(sizeof *g);
    /* the rows' and activations' Q8_K blocks, then their views */
    block_q8_K *hq = malloc(sizeof(block_q8_K) * 2 * (size_t)T * nbK), *aq = malloc(sizeof(block_q8_K) * 2 * (size_t)(P + 1) * nbF);
    block_q8_K **h_of = malloc(sizeof(void *) * 4 * (size_t)(P + 1)), **h_view = h_of + (P + 1), **act_of = h_view + (P + 1),
               **act_view = act_of + (P + 1);
    float *gate = malloc(sizeof(float) * (size_t)(P + 1) * F), *up = malloc(sizeof(float) * (size_t)(P + 1) * F);
    const int failed = !g || !hq || !aq || !h_of || !gate || !up;
    if (!failed) {
        group_picks(expert, P, g);
        for (int t = 0; t < T; t++) { /* (a few rows: this thread) */
            quantize_q8_K(h + (size_t)t * K, hq + (size_t)t * nbK, K);
            q4k_view(hq + (size_t)t * nbK, hq + (size_t)(T + t) * nbK, nbK);
        }
        for (int i = 0; i < P; i++) {
            const size_t row = (size_t)rows[g->order[i]];
            h_of[i] = hq + row * nbK, h_view[i] = hq + (T + row) * nbK;
            act_of[i] = aq + (size_t)i * nbF, act_view[i] = aq + (size_t)(P + 1 + i) * nbF;
        }
        const int n_gu = n_gate_up_items(sh, g), n_d = n_down_items(sh, g);
        (void)threads;
#pragma omp parallel num_threads(threads)
        {
            int ith = 0, nth = 1;
#ifdef _OPENMP
            ith = omp_get_thread_num(), nth = omp_get_num_threads();
#endif
            /* (contiguous shares: interleaved ones wrote neighbouring rows from both threads, slower) */
            gate_up_items(sh, g, n_gu * ith / nth, n_gu * (ith + 1) / nth, h_of, h_view, act_of, act_view, gate, up);
#pragma omp barrier
            down_items(sh, g, n_d * ith / nth, n_d * (ith + 1) / nth, act_of, act_view, out);
        }
    }
    free(g), free(hq), free(aq), free(h_of), free(gate), free(up);
    return failed ? -1 : 0;
}

/* ---- the same step as three nodes of a ggml graph (GGML_OP_CUSTOM) ----

   ggml calls a custom node's function on each of its threads (ith of nth) and puts a barrier between
   nodes. The nodes read their inputs' data through ggml_tensor fields whose offsets the caller gives
   (OpInfo: from the Python bindings' struct, which tests/test_ggml_abi.py holds to the library's; read
   by _ggml_fields.h), so this file needs no ggml header.
   - quantize:  src0 h [K, B] float32 → dst: B rows of Q8_K blocks, then their q4k_view;
   - gate_up:   src0 the rows' Q8_K, src1 each pick's expert [k, B] int32 → dst: the picks' activations
                (Q8_K, by grouped pick), their q4k_view, then gate and up scratch [P, F] float32 each;
   - down:      src0 gate_up's dst, src1 the picks' experts → dst y [K, k, B] float32 (pick p = b·k + j). */

typedef struct {
    const uint64_t *addrs;    /* [E, 3]: each slot's gate, up and down */
    int32_t types[3], K, F, k, n_slots; /* n_slots: the rows of addrs */
    int64_t data_offset, src_offset, ne_offset;
} OpInfo;

static int best_isa = ISA_PORTABLE; /* (the graph nodes' form: the best this CPU runs) */

static Shape shape_of(const OpInfo *o) {
    Shape sh = {{o->types[0], o->types[1], o->types[2]}, o->K, o->F, best_isa, o->addrs};
    return sh;
}

static void op_quantize(void *dst, int ith, int nth, void *userdata) {
    const OpInfo *o = userdata;
    const void *h = src_of(o, dst, 0);
    const int B = (int)ne_of(o, h, 1), nbK = o->K / QK;
    const float *x = data_of(o, h);
    block_q8_K *y = data_of(o, dst);
    for (int t = B * ith / nth; t < B * (ith + 1) / nth; t++) {
        quantize_q8_K(x + (size_t)t * o->K, y + (size_t)t * nbK, o->K);
        q4k_view(y + (size_t)t * nbK, y + (size_t)(B + t) * nbK, nbK);
    }
}

/* the picks' grouping and their rows' and activations' places, for a gate_up or down node */
typedef struct {
    Groups g;
    block_q8_K *h_of[MAX_PICKS], *h_view[MAX_PICKS], *act_of[MAX_PICKS], *act_view[MAX_PICKS];
} Placed;

static int place(const OpInfo *o, const void *slots_t, block_q8_K *hq, block_q8_K *act, Placed *pl) {
    const int P = (int)(ne_of(o, slots_t, 0) * ne_of(o, slots_t, 1)), B = P / o->k, nbK = o->K / QK, nbF = o->F / QK;
    const int32_t *slot = data_of(o, slots_t);
    for (int p = 0; p < P; p++)
        if (slot[p] < 0 || slot[p] >= o->n_slots) { /* (as ggml's mul_mat_id asserts its ids: not a read of addrs[-3]) */
            fprintf(stderr, "cpu expert kernel: pick %d's slot %d outside [0, %d)\n", p, slot[p], o->n_slots);
            abort();
        }
    group_picks(slot, P, &pl->g);
    for (int i = 0; i < P; i++) {
        const size_t row = (size_t)(pl->g.order[i] / o->k);
        if (hq) pl->h_of[i] = hq + row * nbK, pl->h_view[i] = hq + (B + row) * nbK;
        pl->act_of[i] = act + (size_t)i * nbF, pl->act_view[i] = act + (size_t)(P + i) * nbF;
    }
    return P;
}

static void op_gate_up(void *dst, int ith, int nth, void *userdata) {
    const OpInfo *o = userdata;
    Placed *pl = malloc(sizeof *pl);
    if (!pl) abort(); /* (a graph's node cannot fail otherwise: ggml aborts on its own failures alike) */
    block_q8_K *act = data_of(o, dst);
    const int P = place(o, src_of(o, dst, 1), data_of(o, src_of(o, dst, 0)), act, pl);
    float *gate = (float *)(act + 2 * (size_t)P * (o->F / QK)), *up = gate + (size_t)P * o->F;
    const Shape sh = shape_of(o);
    const int n = n_gate_up_items(&sh, &pl->g);
    gate_up_items(&sh, &pl->g, n * ith / nth, n * (ith + 1) / nth, pl->h_of, pl->h_view, pl->act_of, pl->act_view, gate, up);
    free(pl);
}

static void op_down(void *dst, int ith, int nth, void *userdata) {
    const OpInfo *o = userdata;
    Placed *pl = malloc(sizeof *pl);
    if (!pl) abort();
    place(o, src_of(o, dst, 1), NULL, data_of(o, src_of(o, dst, 0)), pl);
    const Shape sh = shape_of(o);
    const int n = n_down_items(&sh, &pl->g);
    down_items(&sh, &pl->g, n * ith / nth, n * (ith + 1) / nth, pl->act_of, pl->act_view, data_of(o, dst));
    free(pl);
}

static int supported(int type) { return type == TYPE_Q4_K || type == TYPE_Q6_K; }

/* picks(h, T, K, F, rows, experts, P, addrs, E, types, out, threads, isa) — addresses of C-contiguous
   arrays the caller keeps alive: h float32 [T, K], rows and experts int32 [P], addrs uint64 [E, 3] (each
   expert's gate, up and down in their store form), out float32 [P, K]; isa the form (0 portable, 1 AVX2,
   2 AVX-512, -1 the best this CPU runs). The GIL is let go while it runs. */
static PyObject *picks(PyObject *self, PyObject *args) {
    unsigned long long h, rows, experts, addrs, out;
    int T, K, F, P, E, tg, tu, td, threads, isa;
    if (!PyArg_ParseTuple(args, "KiiiKKiKi(iii)Kii", &h, &T, &K, &F, &rows, &experts, &P, &addrs, &E, &tg, &tu, &td, &out,
                          &threads, &isa))
        return NULL;
    if (!supported(tg) || !supported(tu) || !supported(td)) {
        PyErr_Format(PyExc_ValueError, "cpu expert kernel: types %d, %d, %d (it has Q4_K and Q6_K)", tg, tu, td);
        return NULL;
    }
    if (T < 1 || P < 0 || P > MAX_PICKS || E < 0 || K % QK || F % QK || K < QK || F < QK || threads < 1 || !h || !out ||
        (P && (!rows || !experts || !addrs))) {
        PyErr_SetString(PyExc_ValueError, "cpu expert kernel: rows of K and F columns, multiples of 256, at most 1024 picks, and their arrays");
        return NULL;
    }
    if (isa < 0) isa = best_isa;
    if (isa > best_isa) {
        PyErr_Format(PyExc_ValueError, "cpu expert kernel: this CPU runs forms up to %d (0 portable, 1 AVX2, 2 AVX-512), not %d", best_isa, isa);
        return NULL;
    }
    const int32_t *r = (const int32_t *)(uintptr_t)rows, *x = (const int32_t *)(uintptr_t)experts;
    for (int p = 0; p < P; p++)
        if (r[p] < 0 || r[p] >= T || x[p] < 0 || x[p] >= E) {
            PyErr_Format(PyExc_ValueError, "cpu expert kernel: pick %d's row %d or expert %d out of range", p, r[p], x[p]);
            return NULL;
        }
    const Shape sh = {{tg, tu, td}, K, F, isa, (const uint64_t *)(uintptr_t)addrs};
    int failed;
    Py_BEGIN_ALLOW_THREADS failed = run_step(&sh, (const float *)(uintptr_t)h, T, r, x, P, (float *)(uintptr_t)out, threads);
    Py_END_ALLOW_THREADS if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* the graph nodes' functions (ggml_custom_op_t), as addresses: (quantize, gate_up, down); and the bytes of
   their outputs: quantize's for B rows of K, gate_up's for P picks of F */
static PyObject *graph_ops(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)op_quantize, (unsigned long long)(uintptr_t)op_gate_up,
                         (unsigned long long)(uintptr_t)op_down);
}

static PyObject *op_bytes(PyObject *self, PyObject *args) {
    int B, K, P, F;
    if (!PyArg_ParseTuple(args, "iiii", &B, &K, &P, &F)) return NULL;
    return Py_BuildValue("(nn)", (Py_ssize_t)(2 * sizeof(block_q8_K) * (size_t)B * (K / QK)),
                         (Py_ssize_t)(2 * sizeof(block_q8_K) * (size_t)P * (F / QK) + 2 * sizeof(float) * (size_t)P * F));
}

static PyObject *isa(PyObject *self, PyObject *unused) { return PyLong_FromLong(best_isa); }

static PyMethodDef methods[] = {
    {"picks", picks, METH_VARARGS, "a step's expert picks' outputs (see the module's C source)"},
    {"isa", isa, METH_NOARGS, "the best form this CPU runs: 0 portable, 1 AVX2, 2 AVX-512"},
    {"graph_ops", graph_ops, METH_NOARGS, "the graph nodes' functions' addresses: quantize, gate_up, down"},
    {"op_bytes", op_bytes, METH_VARARGS, "op_bytes(B, K, P, F): the quantize and gate_up nodes' output bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batched_experts", NULL, -1, methods};

PyMODINIT_FUNC PyInit__batched_experts(void) {
    best_isa = cpu_isa();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_PICKS", MAX_PICKS)) Py_CLEAR(m);
    return m;
}
