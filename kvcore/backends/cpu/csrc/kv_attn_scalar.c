/*
 * kv_attn_scalar.c: the portable kernels of the attention (every kind),
 * the reference the SIMD levels are checked against.  See
 * kv_attn_internal.h for the tables' contract.
 */
#include "kv_attn_internal.h"
#include "kv_fp8.h" /* the scalar fp8 definition (static inline) */

#include <math.h>
#include <string.h>

static inline float f16_to_f32_scalar(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t m = (uint32_t)h & 0x3ffu;
    uint32_t bits;
    float f;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        /* subnormal or zero: m * 2^-24 is exact (a normal float32) */
        f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline void widen_row_scalar(const char *src, int kind, float *dst, int D)
{
    if (kind == KVA_F32) {
        memcpy(dst, src, (size_t)D * 4);
    } else if (kind == KVA_F16) {
        const uint16_t *h = (const uint16_t *)src;
        for (int d = 0; d < D; d++)
            dst[d] = f16_to_f32_scalar(h[d]);
    } else if (kind == KVA_F8E4M3) {
        const uint8_t *b = (const uint8_t *)src;
        for (int d = 0; d < D; d++)
            dst[d] = kv_fp8_float(kv_e4m3_to_f32_one(b[d]));
    } else if (kind == KVA_F8E5M2) {
        const uint8_t *b = (const uint8_t *)src;
        for (int d = 0; d < D; d++)
            dst[d] = kv_fp8_float(kv_e5m2_to_f32_one(b[d]));
    } else if (kind == KVA_I8) {
        const int8_t *c = (const int8_t *)src;
        for (int d = 0; d < D; d++)
            dst[d] = (float)c[d];
    } else {
        const uint16_t *b = (const uint16_t *)src;
        for (int d = 0; d < D; d++) {
            uint32_t bits = (uint32_t)b[d] << 16;
            memcpy(dst + d, &bits, 4);
        }
    }
}

static void scores_scalar(int kind, const float *Qs, int M, int D, const char *const *krow,
                          int ntp, float *S, float *Kf)
{
    for (int i = 0; i < ntp; i++)
        widen_row_scalar(krow[i], kind, Kf + (size_t)i * D, D);
    for (int r = 0; r < M; r++) {
        const float *q = Qs + (size_t)r * D;
        for (int i = 0; i < ntp; i++) {
            const float *k = Kf + (size_t)i * D;
            float s = 0.0f;
            for (int d = 0; d < D; d++)
                s += q[d] * k[d];
            S[r * KVA_KEY_TILE + i] = s;
        }
    }
}

static void pv_scalar(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                      float *acc, const float *alpha, float *Vf)
{
    for (int i = 0; i < nt; i++)
        widen_row_scalar(vrow[i], kind, Vf + (size_t)i * D, D);
    for (int r = 0; r < M; r++) {
        float *a = acc + (size_t)r * D;
        float al = alpha[r];
        for (int d = 0; d < D; d++)
            a[d] *= al;
        for (int i = 0; i < nt; i++) {
            float p = P[r * KVA_KEY_TILE + i];
            const float *v = Vf + (size_t)i * D;
            for (int d = 0; d < D; d++)
                a[d] += p * v[d];
        }
    }
}

#define KVA_SCALAR_KIND(name, kind)                                                          \
    static void widen_##name##_scalar(const char *const *rows, int n, int D, float *dst,    \
                                      const char *const *next)                               \
    {                                                                                         \
        (void)next;                                                                           \
        for (int i = 0; i < n; i++)                                                           \
            widen_row_scalar(rows[i], kind, dst + (size_t)i * D, D);                          \
    }                                                                                         \
    static void scores_##name##_scalar(const float *Qs, int M, int D,                         \
                                       const char *const *krow, int ntp, float *S, float *t, \
                                       const char *const *next)                              \
    {                                                                                         \
        (void)next;                                                                           \
        scores_scalar(kind, Qs, M, D, krow, ntp, S, t);                                       \
    }                                                                                         \
    static void pv_##name##_scalar(const float *P, int M, int D, const char *const *vrow,     \
                                   int nt, float *acc, const float *alpha, float *t,          \
                                   const char *const *next)                                   \
    {                                                                                         \
        (void)next;                                                                           \
        pv_scalar(kind, P, M, D, vrow, nt, acc, alpha, t);                                    \
    }
KVA_SCALAR_KIND(f32, KVA_F32)
KVA_SCALAR_KIND(f16, KVA_F16)
KVA_SCALAR_KIND(bf16, KVA_BF16)
KVA_SCALAR_KIND(e4m3, KVA_F8E4M3)
KVA_SCALAR_KIND(e5m2, KVA_F8E5M2)
KVA_SCALAR_KIND(i8, KVA_I8)

static float row_max_scalar(const float *s, int ntp)
{
    float m = -INFINITY;
    for (int i = 0; i < ntp; i++)
        m = s[i] > m ? s[i] : m;
    return m;
}

/* 2^x for x <= 0 with the SIMD levels' range: +0 below 2^-126 (never a
 * subnormal: kva_flush_tiny). */
static inline float exp2_neg_scalar_one(float x)
{
    return x < -126.0f ? 0.0f : exp2f(x);
}

static float row_exp_sum_scalar(float *s, int ntp, float mx)
{
    float sum = 0.0f;
    for (int i = 0; i < ntp; i++) {
        s[i] = exp2_neg_scalar_one(s[i] - mx);
        sum += s[i];
    }
    return sum;
}

void kva_softcap_scalar(float *s, ptrdiff_t n, float a, float b)
{
    for (ptrdiff_t i = 0; i < n; i++)
        s[i] = b * tanhf(a * s[i]);
}

void kva_scale_scalar(float *s, const float *w, float c, ptrdiff_t n, int weights)
{
    if (w == NULL)
        for (ptrdiff_t i = 0; i < n; i++)
            s[i] *= c;
    else if (!weights)
        for (ptrdiff_t i = 0; i < n; i++)
            s[i] = c == 1.0f ? s[i] * w[i] : (s[i] * w[i]) * c;
    else if (c == 1.0f)
        for (ptrdiff_t i = 0; i < n; i++)
            s[i] = kva_flush_tiny(s[i] * w[i]);
    else
        for (ptrdiff_t i = 0; i < n; i++)
            s[i] = kva_flush_tiny(s[i] * w[i]) * c;
}

static void exp2_neg_scalar(const float *x, float *y, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++)
        y[i] = exp2_neg_scalar_one(x[i]);
}

const kva_kernels kva_kernels_scalar[KVA_NUM_KINDS] = {
    KVA_KERNELS(f32, scalar, 1.0f, 0, 0),  KVA_KERNELS(f16, scalar, 1.0f, 0, 0),
    KVA_KERNELS(bf16, scalar, 1.0f, 0, 0), KVA_KERNELS(e4m3, scalar, 1.0f, 0, 0),
    KVA_KERNELS(e5m2, scalar, 1.0f, 0, 0), KVA_KERNELS(i8, scalar, 1.0f, 0, 0),
};
const kva_math kva_math_scalar = {row_max_scalar, row_exp_sum_scalar, kva_softcap_scalar,
                                  exp2_neg_scalar, kva_scale_scalar, NULL, 0};
