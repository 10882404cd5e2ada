// dequant.h: GGUF block formats decoded in registers, eight consecutive elements at a time.
//
// Format F describes one row layout: F::BLOCK elements stored in F::BYTES bytes per block, and
// F::load8(row, g, w) writes elements 8g .. 8g+7 of the row to w[0..7] as float32. Eight elements
// never straddle a sub-block of any format here, so a group needs one scale. The arithmetic follows
// fomoepy/quants.py (and so gguf) operation by operation, with rounded products (__fmul_rn) so that
// no fused multiply-add changes a decoded value: a dequantised element equals numpy's bit for bit.
// Byte layouts are drawn in fomoepy/quants.py.
#pragma once
#include "compat.h"

struct FmtF32 {
    static constexpr int BLOCK = 1, BYTES = 4;
    static DEVINL void load8(const u8* row, int g, float* w) {
        ld_f32x8((const float*)row + 8 * g, w);
    }
    static DEVINL float load1(const u8* row, int k) { return ((const float*)row)[k]; }
};

struct FmtF16 {
    static constexpr int BLOCK = 1, BYTES = 2;
    static DEVINL void load8(const u8* row, int g, float* w) {
        u16 h[8];
        ld_u16x8((const u16*)row + 8 * g, h);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = f16_to_f32(h[i]);
    }
    static DEVINL float load1(const u8* row, int k) { return f16_to_f32(((const u16*)row)[k]); }
};

struct FmtBF16 {
    static constexpr int BLOCK = 1, BYTES = 2;
    static DEVINL void load8(const u8* row, int g, float* w) {
        u16 h[8];
        ld_u16x8((const u16*)row + 8 * g, h);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = bf16_to_f32(h[i]);
    }
    static DEVINL float load1(const u8* row, int k) { return bf16_to_f32(((const u16*)row)[k]); }
};

// Q8_0 (34 B / 32): d fp16 | 32 x int8           x = q * d
struct FmtQ8_0 {
    static constexpr int BLOCK = 32, BYTES = 34;
    static DEVINL void load8(const u8* row, int g, float* w) {
        const u8* b = row + (g >> 2) * BYTES;
        const float d = f16_to_f32(ld_u16(b));
        const u64 q = ld_bytes8(b + 2 + 8 * (g & 3));
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = __fmul_rn((float)(i8)byte_of(q, i), d);
    }
};

// Q4_0 (18 B / 32): d fp16 | 16 bytes; element i in the low nibble of byte i, 16+i in the high one
//   x = d * (q - 8)
struct FmtQ4_0 {
    static constexpr int BLOCK = 32, BYTES = 18;
    static DEVINL void load8(const u8* row, int g, float* w) {
        const u8* b = row + (g >> 2) * BYTES;
        const float d = f16_to_f32(ld_u16(b));
        const int j = g & 3;
        const u64 q = ld_bytes8(b + 2 + 8 * (j & 1));
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = __fmul_rn(d, (float)((int)((byte_of(q, i) >> shift) & 0xF) - 8));
    }
};

// MXFP4 (17 B / 32): e8m0 exponent | 16 bytes of e2m1 codes laid out like Q4_0. A code's value is
// doubled and the scale halved to match (ggml_e8m0_to_fp32_half): codes 0-7 are 0, 1, 2, 3, 4, 6, 8, 12,
// codes 8-15 the same negated (8 is +0, as ggml's table has it). The magnitudes are the nibbles of one
// 32-bit constant, so each lane decodes in registers: a table in __constant__ memory indexed by each
// lane's own code is served one address at a time on NVIDIA, and held MXFP4's kernels to 0.03-0.04 of
// an H200's copy bandwidth where Q4_0's, of the same layout, reached 0.15-0.18 (bench/gpu_kernels.py).
DEVINL float mxfp4_value(u32 code) {
    const int magnitude = (int)((0xC8643210u >> (4 * (code & 7))) & 0xF);
    return (float)((code & 8) ? -magnitude : magnitude);
}

struct FmtMXFP4 {
    static constexpr int BLOCK = 32, BYTES = 17;
    static DEVINL void load8(const u8* row, int g, float* w) {
        const u8* b = row + (g >> 2) * BYTES;
        const u32 e = b[0];
        const float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23));
        const int j = g & 3;
        const u64 q = ld_bytes8(b + 1 + 8 * (j & 1));
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = __fmul_rn(d, mxfp4_value((byte_of(q, i) >> shift) & 0xF));
    }
};

// K-quant sub-block scale and min (6 bits each) of sub-block j from the 12 packed bytes s.
DEVINL void kq_scale_min(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K (144 B / 256): d, dmin fp16 | 12 B scales | 128 B qs (chunk c: sub-block 2c low, 2c+1 high)
//   x = (d * sc) * q - (dmin * m)
struct FmtQ4_K {
    static constexpr int BLOCK = 256, BYTES = 144;
    static DEVINL void load8(const u8* row, int g, float* w) {
        const u8* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, j = gi >> 2, o = (gi & 3) * 8;
        int sc, m;
        kq_scale_min(b + 4, j, sc, m);
        const float ds = __fmul_rn(f16_to_f32(ld_u16(b)), (float)sc);
        const float dm = __fmul_rn(f16_to_f32(ld_u16(b + 2)), (float)m);
        const u64 q = ld_bytes8(b + 16 + (j >> 1) * 32 + o);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = __fsub_rn(__fmul_rn(ds, (float)((byte_of(q, i) >> shift) & 0xF)), dm);
    }
};

// Q5_K (176 B / 256): as Q4_K, plus 32 B qh after the scales (bit j of byte i = bit 4 of element i of
// sub-block j), then the 128 B of low nibbles
struct FmtQ5_K {
    static constexpr int BLOCK = 256, BYTES = 176;
    static DEVINL void load8(const u8* row, int g, float* w) {
        const u8* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, j = gi >> 2, o = (gi & 3) * 8;
        int sc, m;
        kq_scale_min(b + 4, j, sc, m);
        const float ds = __fmul_rn(f16_to_f32(ld_u16(b)), (float)sc);
        const float dm = __fmul_rn(f16_to_f32(ld_u16(b + 2)), (float)m);
        const u64 qh = ld_bytes8(b + 16 + o);
        const u64 q = ld_bytes8(b + 48 + (j >> 1) * 32 + o);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int v = (int)(((byte_of(q, i) >> shift) & 0xF) | (((byte_of(qh, i) >> j) & 1) << 4));
            w[i] = __fsub_rn(__fmul_rn(ds, (float)v), dm);
        }
    }
};

// Q6_K (210 B / 256): ql[128] | qh[64] | sc int8[16] | d fp16        x = (d * sc) * (q - 32)
//   element e = h*128 + r: low 4 bits in nibble r/64 of ql[h*64 + r%64],
//                         bits 4-5 in bits 2(r/32).. of qh[h*32 + r%32]; scale sc[e/16]
struct FmtQ6_K {
    static constexpr int BLOCK = 256, BYTES = 210;
    static DEVINL void load8(const u8* row, int g, float* w) {
        const u8* b = row + (g >> 5) * BYTES;
        const int e = (g & 31) * 8, h = e >> 7, r = e & 127;
        const float d = __fmul_rn(f16_to_f32(ld_u16(b + 208)), (float)((const i8*)b)[192 + (e >> 4)]);
        const u64 ql = ld_bytes8(b + h * 64 + (r & 63));
        const u64 qh = ld_bytes8(b + 128 + h * 32 + (r & 31));
        const int ls = 4 * (r >> 6), hs = 2 * (r >> 5);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int v = (int)(((byte_of(ql, i) >> ls) & 0xF) | (((byte_of(qh, i) >> hs) & 3) << 4)) - 32;
            w[i] = __fmul_rn(d, (float)v);
        }
    }
};

// The formats every kernel family is instantiated for: X(name, Fmt). The Python side names kernels
// `<family>_<name>` from one table (fomoepy/runtime/kernels.py: KERNEL_TYPE_NAMES).
#define FOR_EACH_FORMAT(X) \
    X(f32, FmtF32)         \
    X(f16, FmtF16)         \
    X(bf16, FmtBF16)       \
    X(q8_0, FmtQ8_0)       \
    X(q4_0, FmtQ4_0)       \
    X(mxfp4, FmtMXFP4)     \
    X(q4_k, FmtQ4_K)       \
    X(q5_k, FmtQ5_K)       \
    X(q6_k, FmtQ6_K)

// Dot products of one weight row (K elements) with n_t <= TT input vectors, by one warp. Lane l takes
// groups l, l+32, ...; every lane returns the full sums. The order of additions depends only on K,
// so a token gets the same sum whether it is computed alone (TT = 1) or in a tile (TT = 8).
template <class F, int TT>
DEVINL void row_dot(const u8* row, const float* const* xs, int n_t, int K, float* acc) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
    const int G = K / 8;
    for (int g = lane; g < G; g += WARP) {
        float w[8];
        F::load8(row, g, w);
#pragma unroll
        for (int t = 0; t < TT; t++) {
            if (t < n_t) {
                float x[8];
                ld_f32x8(xs[t] + 8 * g, x);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[t] += w[i] * x[i];
            }
        }
    }
    if constexpr (F::BLOCK == 1) {  // plain floats: a row need not be a multiple of 8
        for (int k = G * 8 + lane; k < K; k += WARP) {
            const float w = F::load1(row, k);
#pragma unroll
            for (int t = 0; t < TT; t++)
                if (t < n_t) acc[t] += w * xs[t][k];
        }
    }
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = warp_sum(acc[t]);
}
