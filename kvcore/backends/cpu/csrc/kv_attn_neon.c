/*
 * kv_attn_neon.c: the AArch64 Advanced SIMD kernels of the attention
 * (f32, f16 and bf16 pages; the other kinds run the scalar kernels).
 * Advanced SIMD is part of the base architecture: no flags, no detection.
 */
#include "kv_attn_internal.h"

#include <math.h>
#include <string.h>

#if KVA_HAVE_NEON
#include <arm_neon.h>

/* 4 elements of `kind` at p, widened to float32 (f16: FCVTL; bf16: a shift). */
static inline float32x4_t load4_neon(const char *p, int kind)
{
    if (kind == KVA_F32)
        return vld1q_f32((const float *)p);
    if (kind == KVA_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
}

/* RB query rows x KB keys of the score tile (RB, KB <= 4), d in steps of 4. */
static inline __attribute__((always_inline)) void
dot_block_neon(const float *Qs, int D, const char *const *krow, int kind, int RB, int KB, int r,
               int i, float *S)
{
    const int isz = kind == KVA_F32 ? 4 : 2;
    float32x4_t acc[16];
    for (int a = 0; a < 16; a++)
        acc[a] = vdupq_n_f32(0.0f);
    const float *q0 = Qs + (size_t)r * D;
    for (int d = 0; d < D; d += 4) {
        float32x4_t kv[4];
        for (int kb = 0; kb < KB; kb++)
            kv[kb] = load4_neon(krow[i + kb] + (size_t)d * isz, kind);
        for (int rb = 0; rb < RB; rb++) {
            float32x4_t qv = vld1q_f32(q0 + (size_t)rb * D + d);
            for (int kb = 0; kb < KB; kb++)
                acc[rb * 4 + kb] = vfmaq_f32(acc[rb * 4 + kb], qv, kv[kb]);
        }
    }
    for (int rb = 0; rb < RB; rb++)
        for (int kb = 0; kb < KB; kb++)
            S[(r + rb) * KVA_KEY_TILE + i + kb] = vaddvq_f32(acc[rb * 4 + kb]);
}

static inline __attribute__((always_inline)) void
scores_neon(int kind, const float *Qs, int M, int D, const char *const *krow, int ntp, float *S)
{
    for (int r = 0; r < M; r += 4) {
        const int RB = M - r < 4 ? M - r : 4;
        for (int i = 0; i < ntp; i += 4) {
            if (RB == 4)
                dot_block_neon(Qs, D, krow, kind, 4, 4, r, i, S);
            else if (RB == 3)
                dot_block_neon(Qs, D, krow, kind, 3, 4, r, i, S);
            else if (RB == 2)
                dot_block_neon(Qs, D, krow, kind, 2, 4, r, i, S);
            else
                dot_block_neon(Qs, D, krow, kind, 1, 4, r, i, S);
        }
    }
}

/* RB rows (<= 4) x DB vectors of 4 dims (<= 4) of the accumulator, over nt keys. */
static inline __attribute__((always_inline)) void
pv_block_neon(const float *P, int D, const char *const *vrow, int nt, int kind, int RB, int DB,
              int r, int d, float *acc, const float *alpha)
{
    const int isz = kind == KVA_F32 ? 4 : 2;
    float32x4_t a[16];
    for (int rb = 0; rb < RB; rb++)
        for (int db = 0; db < DB; db++)
            a[rb * 4 + db] = vmulq_n_f32(vld1q_f32(acc + (size_t)(r + rb) * D + d + db * 4),
                                         alpha[r + rb]);
    const size_t off = (size_t)d * isz;
    for (int i = 0; i < nt; i++) {
        float32x4_t v[4];
        for (int db = 0; db < DB; db++)
            v[db] = load4_neon(vrow[i] + off + (size_t)db * 4 * isz, kind);
        for (int rb = 0; rb < RB; rb++) {
            const float32x4_t p = vdupq_n_f32(P[(r + rb) * KVA_KEY_TILE + i]);
            for (int db = 0; db < DB; db++)
                a[rb * 4 + db] = vfmaq_f32(a[rb * 4 + db], p, v[db]);
        }
    }
    for (int rb = 0; rb < RB; rb++)
        for (int db = 0; db < DB; db++)
            vst1q_f32(acc + (size_t)(r + rb) * D + d + db * 4, a[rb * 4 + db]);
}

static inline __attribute__((always_inline)) void
pv_neon(int kind, const float *P, int M, int D, const char *const *vrow, int nt, float *acc,
        const float *alpha)
{
    for (int r = 0; r < M; r += 4) {
        const int RB = M - r < 4 ? M - r : 4;
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            if (RB == 4)
                pv_block_neon(P, D, vrow, nt, kind, 4, 4, r, d, acc, alpha);
            else if (RB == 3)
                pv_block_neon(P, D, vrow, nt, kind, 3, 4, r, d, acc, alpha);
            else if (RB == 2)
                pv_block_neon(P, D, vrow, nt, kind, 2, 4, r, d, acc, alpha);
            else
                pv_block_neon(P, D, vrow, nt, kind, 1, 4, r, d, acc, alpha);
        }
        for (; d < D; d += 4)
            pv_block_neon(P, D, vrow, nt, kind, RB, 1, r, d, acc, alpha);
    }
}

#define KVA_NEON_KIND(name, kind)                                                            \
    static void widen_##name##_neon(const char *const *rows, int n, int D, float *dst,      \
                                    const char *const *next)                                 \
    {                                                                                         \
        (void)next;                                                                           \
        const int isz = kind == KVA_F32 ? 4 : 2;                                              \
        for (int i = 0; i < n; i++)                                                           \
            for (int d = 0; d < D; d += 4)                                                    \
                vst1q_f32(dst + (size_t)i * D + d, load4_neon(rows[i] + (size_t)d * isz, kind)); \
    }                                                                                         \
    static void scores_##name##_neon(const float *Qs, int M, int D, const char *const *krow,  \
                                     int ntp, float *S, float *t, const char *const *next)   \
    {                                                                                         \
        (void)t;                                                                              \
        (void)next;                                                                           \
        scores_neon(kind, Qs, M, D, krow, ntp, S);                                            \
    }                                                                                         \
    static void pv_##name##_neon(const float *P, int M, int D, const char *const *vrow,       \
                                 int nt, float *acc, const float *alpha, float *t,            \
                                 const char *const *next)                                     \
    {                                                                                         \
        (void)t;                                                                              \
        (void)next;                                                                           \
        pv_neon(kind, P, M, D, vrow, nt, acc, alpha);                                         \
    }
KVA_NEON_KIND(f32, KVA_F32)
KVA_NEON_KIND(f16, KVA_F16)
KVA_NEON_KIND(bf16, KVA_BF16)

/* 2^x for x <= 0: the AVX2 level's polynomial (see exp2_neg_avx2), same range. */
static inline float32x4_t exp2_neg_neon(float32x4_t x)
{
    x = vmaxq_f32(x, vdupq_n_f32(-127.0f));
    x = vminq_f32(x, vdupq_n_f32(0.0f));
    float32x4_t n = vrndnq_f32(x);
    float32x4_t f = vsubq_f32(x, n);
    float32x4_t p = vdupq_n_f32(1.534581243e-04f);
    p = vfmaq_f32(vdupq_n_f32(1.339993090e-03f), p, f);
    p = vfmaq_f32(vdupq_n_f32(9.618489072e-03f), p, f);
    p = vfmaq_f32(vdupq_n_f32(5.550328642e-02f), p, f);
    p = vfmaq_f32(vdupq_n_f32(2.402264625e-01f), p, f);
    p = vfmaq_f32(vdupq_n_f32(6.931471825e-01f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    /* (x < -126: +0, never a subnormal; an ordered compare keeps NaN) */
    const float32x4_t r = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(
        vbicq_u32(vreinterpretq_u32_f32(r), vcltq_f32(x, vdupq_n_f32(-126.0f))));
}

static float row_max_neon(const float *s, int ntp)
{
    float32x4_t m = vdupq_n_f32(-INFINITY);
    for (int i = 0; i < ntp; i += 4)
        m = vmaxq_f32(m, vld1q_f32(s + i));
    return vmaxvq_f32(m);
}

static float row_exp_sum_neon(float *s, int ntp, float mx)
{
    float32x4_t m = vdupq_n_f32(mx), sum = vdupq_n_f32(0.0f);
    for (int i = 0; i < ntp; i += 4) {
        float32x4_t e = exp2_neg_neon(vsubq_f32(vld1q_f32(s + i), m));
        vst1q_f32(s + i, e);
        sum = vaddq_f32(sum, e);
    }
    return vaddvq_f32(sum);
}

static void exp2_neg_n_neon(const float *x, float *y, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(y + i, exp2_neg_neon(vld1q_f32(x + i)));
    if (i < n) {
        float t[4] = {0};
        memcpy(t, x + i, (size_t)(n - i) * 4);
        vst1q_f32(t, exp2_neg_neon(vld1q_f32(t)));
        memcpy(y + i, t, (size_t)(n - i) * 4);
    }
}

const kva_kernels kva_kernels_neon[KVA_NUM_NEON_KINDS] = {
    KVA_KERNELS(f32, neon, 1.0f, 0, 0),
    KVA_KERNELS(f16, neon, 1.0f, 0, 0),
    KVA_KERNELS(bf16, neon, 1.0f, 0, 0),
};
/* soft cap: the scalar tanhf (rare, and exact to libm) */
const kva_math kva_math_neon = {row_max_neon, row_exp_sum_neon, kva_softcap_scalar,
                                exp2_neg_n_neon, kva_scale_scalar, NULL, 0};
#endif /* KVA_HAVE_NEON */
