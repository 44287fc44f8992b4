/*
 * kv_attention.c: see kv_attention.h for the contract.
 *
 * Build notes: this file is compiled without any -m flags, so the wheel
 * runs on every x86-64 (and aarch64) CPU.  The AVX2 bodies carry
 * __attribute__((target("avx2,fma,f16c"))), their names end in _avx2, and
 * they are only reached after __builtin_cpu_supports() said yes.
 *
 * Shape of the computation (FlashAttention-2 style, on a CPU):
 *   - An item is (sequence, kv head, tile of query tokens, split of keys).
 *     Its rows are every (query token, query head of the kv head's group):
 *     a GQA group shares each K and V row, which is read once per item.
 *   - Keys are walked in tiles of KVA_KEY_TILE positions.  Per tile:
 *     scores = Q K^T (register-blocked dot products, K widened in
 *     registers), soft cap, causal / window mask, online softmax in base 2
 *     (the scale carries log2(e)), then acc = acc * alpha + P V.
 *   - Decode-like items (one query tile) with a long key range are split
 *     into KVA_SPLIT_KEYS-position pieces (flash-decoding); the last piece
 *     to finish merges the partial (max, sum, acc) triples in split order.
 */
/* posix_memalign, pthread_sigmask under a strict -std= */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "kv_attention.h"
#include "kv_fp8.h" /* the scalar fp8 definition (static inline) */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define KVA_X86 1
#include <immintrin.h>
#else
#define KVA_X86 0
#endif

#if !defined(_WIN32)
#include <pthread.h>
#include <signal.h>
#define KVA_THREADS 1
#else
#define KVA_THREADS 0
#endif

/* Query rows per item (query tokens x heads of a group; at least one token). */
#define KVA_ROWS 64
/* Key positions per tile (a multiple of 8). */
#define KVA_KEY_TILE 32
/* Key positions per split of a decode-like item. */
#define KVA_SPLIT_KEYS 1024
/* Least work (query rows x keys x head_dim) worth a thread of its own:
 * about 100 us of one core's time, several times what waking a worker
 * costs on a loaded machine. */
#define KVA_WORK_PER_THREAD ((int64_t)1 << 19)
/* Items of more rows than this widen each K/V tile to float32 once (the
 * micro-kernels work on 4 rows at a time, and would widen it per block). */
#define KVA_WIDEN_ROWS 4

#define KVA_LOG2E 1.4426950408889634f

/* Bytes per stored element of a kind. */
static inline int kva_isz(int kind)
{
    return kind == KVA_F32 ? 4 : kind >= KVA_F8E4M3 ? 1 : 2;
}

/* ------------------------------------------------------------------ */
/* Kernel table                                                        */
/* ------------------------------------------------------------------ */

typedef struct {
    /* S[r * KVA_KEY_TILE + i] = Qs[r] . K[i] for r < M, i < ntp (ntp % 8 == 0).
     * tmp: KVA_KEY_TILE * D floats of scratch. */
    void (*scores)(const float *Qs, int M, int D, const char *const *krow, int ntp, float *S,
                   float *tmp);
    /* acc[r] = acc[r] * alpha[r] + sum_{i < nt} P[r * KVA_KEY_TILE + i] V[i]. */
    void (*pv)(const float *P, int M, int D, const char *const *vrow, int nt, float *acc,
               const float *alpha, float *tmp);
    /* dst[i * D + d] = row i widened to float32, for i < n. */
    void (*widen)(const char *const *rows, int n, int D, float *dst);
    /* The elements these kernels read are the stored values divided by
     * unit (a power of two): the caller multiplies q and the P.V weights
     * by it, so every product is exactly the one over the values. */
    float unit;
} kva_kernels;

typedef struct {
    float (*row_max)(const float *s, int ntp);
    /* s[i] = exp2(s[i] - mx) for i < ntp; returns the sum. */
    float (*row_exp_sum)(float *s, int ntp, float mx);
    /* s[i] = b * tanh(a * s[i]) for i < n. */
    void (*softcap)(float *s, ptrdiff_t n, float a, float b);
    void (*exp2_neg)(const float *x, float *y, ptrdiff_t n);
} kva_math;

/* ------------------------------------------------------------------ */
/* Scalar (portable) level                                             */
/* ------------------------------------------------------------------ */

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
    static void widen_##name##_scalar(const char *const *rows, int n, int D, float *dst)     \
    {                                                                                         \
        for (int i = 0; i < n; i++)                                                           \
            widen_row_scalar(rows[i], kind, dst + (size_t)i * D, D);                          \
    }                                                                                         \
    static void scores_##name##_scalar(const float *Qs, int M, int D,                         \
                                       const char *const *krow, int ntp, float *S, float *t) \
    {                                                                                         \
        scores_scalar(kind, Qs, M, D, krow, ntp, S, t);                                       \
    }                                                                                         \
    static void pv_##name##_scalar(const float *P, int M, int D, const char *const *vrow,     \
                                   int nt, float *acc, const float *alpha, float *t)          \
    {                                                                                         \
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

/* 2^x for x <= 0 with the SIMD levels' range: +0 below -126.5. */
static inline float exp2_neg_scalar_one(float x)
{
    return x < -126.5f ? 0.0f : exp2f(x);
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

static void softcap_scalar(float *s, ptrdiff_t n, float a, float b)
{
    for (ptrdiff_t i = 0; i < n; i++)
        s[i] = b * tanhf(a * s[i]);
}

static void exp2_neg_scalar(const float *x, float *y, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++)
        y[i] = exp2_neg_scalar_one(x[i]);
}

static const kva_kernels kernels_scalar[6] = {
    {scores_f32_scalar, pv_f32_scalar, widen_f32_scalar, 1.0f},
    {scores_f16_scalar, pv_f16_scalar, widen_f16_scalar, 1.0f},
    {scores_bf16_scalar, pv_bf16_scalar, widen_bf16_scalar, 1.0f},
    {scores_e4m3_scalar, pv_e4m3_scalar, widen_e4m3_scalar, 1.0f},
    {scores_e5m2_scalar, pv_e5m2_scalar, widen_e5m2_scalar, 1.0f},
    {scores_i8_scalar, pv_i8_scalar, widen_i8_scalar, 1.0f},
};
static const kva_math math_scalar = {row_max_scalar, row_exp_sum_scalar, softcap_scalar,
                                     exp2_neg_scalar};

/* ------------------------------------------------------------------ */
/* AVX2 + FMA + F16C level                                             */
/* ------------------------------------------------------------------ */
#if KVA_X86 && defined(__GNUC__)
#define KVA_HAVE_AVX2 1
#define KVA_TARGET __attribute__((target("avx2,fma,f16c")))
#define KVA_INLINE static inline __attribute__((always_inline)) KVA_TARGET

/* 8 fp8 e4m3fn elements at p, widened to float32 and divided by 2^8: each
 * byte, sign-extended to 16 bits and shifted left by 7, is a half with the
 * byte's sign, exponent and mantissa (bit 14, the sign's copy, cleared);
 * e4m3's exponent bias 7 is the half's 15 less 8, so the half is the value
 * times 2^-8, subnormals included (F16C widens it exactly).  The 2^8 rides
 * on q and on the P.V weights (kva_kernels.unit: exact products).  No
 * NaN: S.1111.111 would read as +-480; a tile holding one takes
 * load8_e4m3_nan_avx2. */
KVA_INLINE __m256 load8_e4m3_avx2(const char *p)
{
    __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xBF80)));
}

/* The same with NaN: S.1111.111 gets the half's all-ones exponent. */
KVA_INLINE __m256 load8_e4m3_nan_avx2(const char *p)
{
    __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xBF80));
    __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(h, _mm_set1_epi16((short)0x8000)),
                                  _mm_set1_epi16((short)0xBF80));
    h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7C00)));
    return _mm256_cvtph_ps(h);
}

/* Whether any of rows[0..n-1] (D bytes each, D % 8 == 0) holds an e4m3fn
 * NaN code (0x7F or 0xFF): the unsigned max of every byte with its sign
 * bit set is 0xFF exactly then. */
KVA_INLINE int rows_have_e4m3_nan_avx2(const char *const *rows, int n, int D)
{
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    __m256i mx = _mm256_setzero_si256();
    __m128i mx8 = _mm_setzero_si128();
    for (int i = 0; i < n; i++) {
        const char *p = rows[i];
        int d = 0;
        for (; d + 32 <= D; d += 32)
            mx = _mm256_max_epu8(mx, _mm256_or_si256(_mm256_loadu_si256((const __m256i *)(p + d)),
                                                     sign));
        /* the sign bit set before the max, as above (0x7F against 0x80
         * must give 0xFF, not 0x80) */
        for (; d < D; d += 8)
            mx8 = _mm_max_epu8(mx8, _mm_or_si128(_mm_loadl_epi64((const __m128i *)(p + d)),
                                                 _mm256_castsi256_si128(sign)));
    }
    mx8 = _mm_max_epu8(mx8, _mm_max_epu8(_mm256_castsi256_si128(mx),
                                         _mm256_extracti128_si256(mx, 1)));
    return _mm_movemask_epi8(_mm_cmpeq_epi8(mx8, _mm_set1_epi8((char)0xFF))) != 0;
}

/* An internal kind of the AVX2 kernels: e4m3fn read with its NaN blend. */
#define KVA_F8E4M3_NAN 6

/* 8 elements of `kind` at p, widened to float32 (bf16: a 16-bit shift;
 * e4m3fn: divided by 2^8; e5m2: the high byte of a half; int8: the code,
 * unscaled). */
KVA_INLINE __m256 load8_avx2(const char *p, int kind)
{
    if (kind == KVA_F32)
        return _mm256_loadu_ps((const float *)p);
    if (kind == KVA_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (kind == KVA_F8E4M3)
        return load8_e4m3_avx2(p);
    if (kind == KVA_F8E4M3_NAN)
        return load8_e4m3_nan_avx2(p);
    if (kind == KVA_F8E5M2)
        return _mm256_cvtph_ps(
            _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    if (kind == KVA_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Lane a of the result is the sum of the lanes of v[a] (a fixed order). */
KVA_INLINE __m256 hsum8x8_avx2(const __m256 *v)
{
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]);
    __m256 t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]);
    __m256 t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1); /* [0 1 2 3 | 0 1 2 3] halves */
    __m256 u1 = _mm256_hadd_ps(t2, t3); /* [4 5 6 7 | 4 5 6 7] halves */
    __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
    __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    return _mm256_add_ps(lo, hi);
}

KVA_INLINE float hsum_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KVA_INLINE float hmax_avx2(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/*
 * 2^x for x <= 0: x = n + f with n = round(x), |f| <= 1/2; 2^f by a degree-6
 * polynomial (relative-error minimax fit on [-1/2, 1/2], coefficients
 * rounded to float32), evaluated with FMAs, times 2^n built in the exponent
 * field.  Checked over every float32 f in [-1/2, 1/2]: at most 0.95 ulp
 * from the correctly rounded 2^f, so at most 0.95 ulp for every result of
 * 2^-126 and above.  Below about 2^-126.5 the result is +0 (n = -127 makes
 * the exponent field 0); -inf gives +0, NaN stays NaN.
 */
KVA_INLINE __m256 exp2_neg_avx2(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x); /* NaN passes (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(0.0f), x);
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.534581243e-04f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339993090e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618489072e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550328642e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264625e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471825e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/*
 * tanh(x): for |x| < 0.3 its odd Taylor polynomial to x^13 (the next term
 * is below 1e-9 relative there); otherwise sign(x) (1 - e) / (1 + e) with
 * e = exp(-2|x|) <= 0.55, where no cancellation occurs.
 */
KVA_INLINE __m256 tanh_avx2(__m256 x)
{
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    __m256 ax = _mm256_andnot_ps(sign_mask, x);
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps((float)(21844.0 / 6081075.0));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps((float)(-1382.0 / 155925.0)));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps((float)(62.0 / 2835.0)));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps((float)(-17.0 / 315.0)));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps((float)(2.0 / 15.0)));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps((float)(-1.0 / 3.0)));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, x2), x, x);
    __m256 e = exp2_neg_avx2(_mm256_mul_ps(ax, _mm256_set1_ps(-2.0f * KVA_LOG2E)));
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    big = _mm256_or_ps(big, _mm256_and_ps(x, sign_mask));
    __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.3f), _CMP_LT_OQ);
    return _mm256_blendv_ps(big, small, is_small);
}

/* RB query rows x KB keys of the score tile: RB * KB == 8 accumulators. */
KVA_INLINE void dot_block_avx2(const float *Qs, int D, const char *const *krow, int kind, int RB,
                               int KB, int r, int i, float *S)
{
    const int isz = kva_isz(kind);
    __m256 acc[8];
#pragma GCC unroll 8
    for (int a = 0; a < 8; a++)
        acc[a] = _mm256_setzero_ps();
    const float *q0 = Qs + (size_t)r * D;
    for (int d = 0; d < D; d += 8) {
        __m256 kv[8];
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++)
            kv[kb] = load8_avx2(krow[i + kb] + (size_t)d * isz, kind);
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            __m256 qv = _mm256_loadu_ps(q0 + (size_t)rb * D + d);
            /* one load per q vector, reused for the KB keys (GCC would
             * otherwise fold a load into every FMA) */
            __asm__("" : "+x"(qv));
#pragma GCC unroll 8
            for (int kb = 0; kb < KB; kb++)
                acc[rb * KB + kb] = _mm256_fmadd_ps(qv, kv[kb], acc[rb * KB + kb]);
        }
    }
    float sums[8];
    _mm256_storeu_ps(sums, hsum8x8_avx2(acc));
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++)
            S[(r + rb) * KVA_KEY_TILE + i + kb] = sums[rb * KB + kb];
}

KVA_INLINE void scores_avx2(int kind, const float *Qs, int M, int D, const char *const *krow,
                            int ntp, float *S)
{
    int r = 0;
    for (; r + 4 <= M; r += 4)
        for (int i = 0; i < ntp; i += 2)
            dot_block_avx2(Qs, D, krow, kind, 4, 2, r, i, S);
    if (r + 2 <= M) {
        for (int i = 0; i < ntp; i += 4)
            dot_block_avx2(Qs, D, krow, kind, 2, 4, r, i, S);
        r += 2;
    }
    if (r < M)
        for (int i = 0; i < ntp; i += 8)
            dot_block_avx2(Qs, D, krow, kind, 1, 8, r, i, S);
}

/* RB rows x DB vectors of 8 dims of the accumulator, over nt keys. */
KVA_INLINE void pv_block_avx2(const float *P, int D, const char *const *vrow, int nt, int kind,
                              int RB, int DB, int r, int d, float *acc, const float *alpha)
{
    const int isz = kva_isz(kind);
    __m256 a[16];
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++) {
        __m256 al = _mm256_set1_ps(alpha[r + rb]);
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            a[rb * DB + db] =
                _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)(r + rb) * D + d + db * 8), al);
    }
    const size_t off = (size_t)d * isz;
    for (int i = 0; i < nt; i++) {
        __m256 v[16];
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            v[db] = load8_avx2(vrow[i] + off + (size_t)db * 8 * isz, kind);
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            __m256 p = _mm256_broadcast_ss(P + (r + rb) * KVA_KEY_TILE + i);
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++)
                a[rb * DB + db] = _mm256_fmadd_ps(p, v[db], a[rb * DB + db]);
        }
    }
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            _mm256_storeu_ps(acc + (size_t)(r + rb) * D + d + db * 8, a[rb * DB + db]);
}

KVA_INLINE void pv_avx2(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                        float *acc, const float *alpha)
{
    int r = 0, d;
    for (; r + 4 <= M; r += 4) {
        for (d = 0; d + 16 <= D; d += 16)
            pv_block_avx2(P, D, vrow, nt, kind, 4, 2, r, d, acc, alpha);
        for (; d < D; d += 8)
            pv_block_avx2(P, D, vrow, nt, kind, 4, 1, r, d, acc, alpha);
    }
    if (r + 2 <= M) {
        for (d = 0; d + 32 <= D; d += 32)
            pv_block_avx2(P, D, vrow, nt, kind, 2, 4, r, d, acc, alpha);
        for (; d < D; d += 8)
            pv_block_avx2(P, D, vrow, nt, kind, 2, 1, r, d, acc, alpha);
        r += 2;
    }
    if (r < M) {
        for (d = 0; d + 64 <= D; d += 64)
            pv_block_avx2(P, D, vrow, nt, kind, 1, 8, r, d, acc, alpha);
        for (; d < D; d += 8)
            pv_block_avx2(P, D, vrow, nt, kind, 1, 1, r, d, acc, alpha);
    }
}

KVA_INLINE void widen_avx2(int kind, const char *const *rows, int n, int D, float *dst)
{
    const int isz = kva_isz(kind);
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(dst + (size_t)i * D + d, load8_avx2(rows[i] + (size_t)d * isz, kind));
}

#define KVA_AVX2_KIND(name, kind)                                                            \
    KVA_TARGET static void widen_##name##_avx2(const char *const *rows, int n, int D,         \
                                               float *dst)                                    \
    {                                                                                         \
        widen_avx2(kind, rows, n, D, dst);                                                    \
    }                                                                                         \
    KVA_TARGET static void scores_##name##_avx2(const float *Qs, int M, int D,                \
                                                const char *const *krow, int ntp, float *S,   \
                                                float *t)                                     \
    {                                                                                         \
        (void)t;                                                                              \
        scores_avx2(kind, Qs, M, D, krow, ntp, S);                                            \
    }                                                                                         \
    KVA_TARGET static void pv_##name##_avx2(const float *P, int M, int D,                     \
                                            const char *const *vrow, int nt, float *acc,      \
                                            const float *alpha, float *t)                     \
    {                                                                                         \
        (void)t;                                                                              \
        pv_avx2(kind, P, M, D, vrow, nt, acc, alpha);                                         \
    }
KVA_AVX2_KIND(f32, KVA_F32)
KVA_AVX2_KIND(f16, KVA_F16)
KVA_AVX2_KIND(bf16, KVA_BF16)
KVA_AVX2_KIND(e5m2, KVA_F8E5M2)
KVA_AVX2_KIND(i8, KVA_I8)

/* e4m3fn: the tile's rows are searched for NaN codes once (a few byte
 * compares per row); only a tile that holds one pays for the NaN blend of
 * every 8 elements. */
KVA_TARGET static void widen_e4m3_avx2(const char *const *rows, int n, int D, float *dst)
{
    if (rows_have_e4m3_nan_avx2(rows, n, D))
        widen_avx2(KVA_F8E4M3_NAN, rows, n, D, dst);
    else
        widen_avx2(KVA_F8E4M3, rows, n, D, dst);
}

KVA_TARGET static void scores_e4m3_avx2(const float *Qs, int M, int D, const char *const *krow,
                                        int ntp, float *S, float *t)
{
    (void)t;
    if (rows_have_e4m3_nan_avx2(krow, ntp, D))
        scores_avx2(KVA_F8E4M3_NAN, Qs, M, D, krow, ntp, S);
    else
        scores_avx2(KVA_F8E4M3, Qs, M, D, krow, ntp, S);
}

KVA_TARGET static void pv_e4m3_avx2(const float *P, int M, int D, const char *const *vrow, int nt,
                                    float *acc, const float *alpha, float *t)
{
    (void)t;
    if (rows_have_e4m3_nan_avx2(vrow, nt, D))
        pv_avx2(KVA_F8E4M3_NAN, P, M, D, vrow, nt, acc, alpha);
    else
        pv_avx2(KVA_F8E4M3, P, M, D, vrow, nt, acc, alpha);
}

KVA_TARGET static float row_max_avx2(const float *s, int ntp)
{
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < ntp; i += 8)
        m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    return hmax_avx2(m);
}

KVA_TARGET static float row_exp_sum_avx2(float *s, int ntp, float mx)
{
    __m256 m = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    for (int i = 0; i < ntp; i += 8) {
        __m256 e = exp2_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum_avx2(sum);
}

KVA_TARGET static void softcap_avx2(float *s, ptrdiff_t n, float a, float b)
{
    __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(s + i, _mm256_mul_ps(vb, tanh_avx2(_mm256_mul_ps(va, _mm256_loadu_ps(s + i)))));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, s + i, (size_t)(n - i) * 4);
        _mm256_storeu_ps(t, _mm256_mul_ps(vb, tanh_avx2(_mm256_mul_ps(va, _mm256_loadu_ps(t)))));
        memcpy(s + i, t, (size_t)(n - i) * 4);
    }
}

KVA_TARGET static void exp2_neg_n_avx2(const float *x, float *y, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, exp2_neg_avx2(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, (size_t)(n - i) * 4);
        _mm256_storeu_ps(t, exp2_neg_avx2(_mm256_loadu_ps(t)));
        memcpy(y + i, t, (size_t)(n - i) * 4);
    }
}

static const kva_kernels kernels_avx2[6] = {
    {scores_f32_avx2, pv_f32_avx2, widen_f32_avx2, 1.0f},
    {scores_f16_avx2, pv_f16_avx2, widen_f16_avx2, 1.0f},
    {scores_bf16_avx2, pv_bf16_avx2, widen_bf16_avx2, 1.0f},
    {scores_e4m3_avx2, pv_e4m3_avx2, widen_e4m3_avx2, 256.0f}, /* its loaders: value / 2^8 */
    {scores_e5m2_avx2, pv_e5m2_avx2, widen_e5m2_avx2, 1.0f},
    {scores_i8_avx2, pv_i8_avx2, widen_i8_avx2, 1.0f},
};
static const kva_math math_avx2 = {row_max_avx2, row_exp_sum_avx2, softcap_avx2,
                                   exp2_neg_n_avx2};
#else
#define KVA_HAVE_AVX2 0
#endif

/* ------------------------------------------------------------------ */
/* NEON level (AArch64: Advanced SIMD is part of the base architecture) */
/* ------------------------------------------------------------------ */
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define KVA_HAVE_NEON 1

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
    static void widen_##name##_neon(const char *const *rows, int n, int D, float *dst)       \
    {                                                                                         \
        const int isz = kind == KVA_F32 ? 4 : 2;                                              \
        for (int i = 0; i < n; i++)                                                           \
            for (int d = 0; d < D; d += 4)                                                    \
                vst1q_f32(dst + (size_t)i * D + d, load4_neon(rows[i] + (size_t)d * isz, kind)); \
    }                                                                                         \
    static void scores_##name##_neon(const float *Qs, int M, int D, const char *const *krow,  \
                                     int ntp, float *S, float *t)                            \
    {                                                                                         \
        (void)t;                                                                              \
        scores_neon(kind, Qs, M, D, krow, ntp, S);                                            \
    }                                                                                         \
    static void pv_##name##_neon(const float *P, int M, int D, const char *const *vrow,       \
                                 int nt, float *acc, const float *alpha, float *t)            \
    {                                                                                         \
        (void)t;                                                                              \
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
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
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

static const kva_kernels kernels_neon[3] = {
    {scores_f32_neon, pv_f32_neon, widen_f32_neon, 1.0f},
    {scores_f16_neon, pv_f16_neon, widen_f16_neon, 1.0f},
    {scores_bf16_neon, pv_bf16_neon, widen_bf16_neon, 1.0f},
};
/* soft cap: the scalar tanhf (rare, and exact to libm) */
static const kva_math math_neon = {row_max_neon, row_exp_sum_neon, softcap_scalar,
                                   exp2_neg_n_neon};
#else
#define KVA_HAVE_NEON 0
#endif

/* ------------------------------------------------------------------ */
/* Levels                                                              */
/* ------------------------------------------------------------------ */

static const char *const level_names[KVA_NUM_LEVELS] = {"scalar", "avx2", "neon"};
static int current_level = -1; /* -1: not chosen yet (the best is taken) */

int kva_level_supported(int level)
{
    if (level == KVA_SCALAR)
        return 1;
#if KVA_HAVE_AVX2
    if (level == KVA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#endif
#if KVA_HAVE_NEON
    if (level == KVA_NEON)
        return 1;
#endif
    return 0;
}

int kva_best_level(void)
{
    static int best = -1;
    if (best < 0) {
        int b = KVA_SCALAR;
        for (int l = 1; l < KVA_NUM_LEVELS; l++)
            if (kva_level_supported(l))
                b = l;
        best = b;
    }
    return best;
}

int kva_current_level(void)
{
    int l = __atomic_load_n(&current_level, __ATOMIC_RELAXED);
    return l < 0 ? kva_best_level() : l;
}

int kva_set_level(int level)
{
    if (level < 0 || level >= KVA_NUM_LEVELS || !kva_level_supported(level))
        return -1;
    __atomic_store_n(&current_level, level, __ATOMIC_RELAXED);
    return 0;
}

const char *kva_level_name(int level)
{
    return level >= 0 && level < KVA_NUM_LEVELS ? level_names[level] : NULL;
}

static const kva_math *math_for(int level)
{
#if KVA_HAVE_AVX2
    if (level == KVA_AVX2)
        return &math_avx2;
#endif
#if KVA_HAVE_NEON
    if (level == KVA_NEON)
        return &math_neon;
#endif
    return &math_scalar;
}

static const kva_kernels *kernels_for(int level, int kind)
{
#if KVA_HAVE_AVX2
    if (level == KVA_AVX2)
        return &kernels_avx2[kind];
#endif
#if KVA_HAVE_NEON
    /* kinds without NEON kernels run the scalar ones */
    if (level == KVA_NEON && kind < (int)(sizeof kernels_neon / sizeof kernels_neon[0]))
        return &kernels_neon[kind];
#endif
    return &kernels_scalar[kind];
}

int kva_exp2_neg(int level, const float *x, float *y, ptrdiff_t n)
{
    if (level < 0 || level >= KVA_NUM_LEVELS || !kva_level_supported(level))
        return -1;
    math_for(level)->exp2_neg(x, y, n);
    return 0;
}

int kva_softcap(int level, const float *x, float *y, ptrdiff_t n, float a, float b)
{
    if (level < 0 || level >= KVA_NUM_LEVELS || !kva_level_supported(level))
        return -1;
    if (y != x)
        memcpy(y, x, (size_t)n * sizeof(float));
    math_for(level)->softcap(y, n, a, b);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Thread pool: workers sleep on a condition variable between calls    */
/* ------------------------------------------------------------------ */

typedef void (*kva_job_fn)(void *ctx, int thread_index);

#if KVA_THREADS
#define KVA_MAX_WORKERS 1023

static pthread_mutex_t pool_call_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done_cv = PTHREAD_COND_INITIALIZER;
static int pool_workers;          /* started */
static unsigned long pool_generation;
static int pool_job_threads;      /* threads in the current job, caller included */
static int pool_pending;          /* workers of the current job still running */
static kva_job_fn pool_fn;
static void *pool_ctx;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_before_fork(void) { pthread_mutex_lock(&pool_call_lock); }
static void pool_after_fork_parent(void) { pthread_mutex_unlock(&pool_call_lock); }
static void pool_after_fork_child(void)
{
    /* The workers do not exist in the child: start again from nothing. */
    pthread_mutex_init(&pool_call_lock, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_work_cv, NULL);
    pthread_cond_init(&pool_done_cv, NULL);
    pool_workers = 0;
    pool_pending = 0;
    pool_job_threads = 0;
}
static void pool_init(void)
{
    pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_after_fork_child);
}

/* The generation each worker has seen when it starts (set before it is created). */
static unsigned long pool_start_generation[KVA_MAX_WORKERS + 1];

static void *pool_worker(void *arg)
{
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    unsigned long seen = pool_start_generation[index];
    for (;;) {
        while (pool_generation == seen)
            pthread_cond_wait(&pool_work_cv, &pool_mu);
        seen = pool_generation;
        if (index >= pool_job_threads)
            continue; /* not part of this job */
        kva_job_fn fn = pool_fn;
        void *ctx = pool_ctx;
        pthread_mutex_unlock(&pool_mu);
        fn(ctx, index);
        pthread_mutex_lock(&pool_mu);
        if (--pool_pending == 0)
            pthread_cond_signal(&pool_done_cv);
    }
    return NULL;
}

/* Start workers up to `want` (caller holds pool_call_lock); returns how many exist. */
static int pool_grow(int want)
{
    if (want > KVA_MAX_WORKERS)
        want = KVA_MAX_WORKERS;
    while (pool_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        int index = pool_workers + 1, rc;
        if (pthread_attr_init(&attr) != 0)
            break;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* Workers block every signal: signals go to the application's threads. */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        /* The worker waits for the first generation after this one, so the
         * job published right after it starts cannot be missed. */
        pthread_mutex_lock(&pool_mu);
        pool_start_generation[index] = pool_generation;
        pthread_mutex_unlock(&pool_mu);
        rc = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)index);
        if (rc == 0)
            pool_workers++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
    }
    return pool_workers;
}

/* Run fn(ctx, 0 .. nthreads-1) on nthreads threads (the caller is thread 0). */
static void pool_run(kva_job_fn fn, void *ctx, int nthreads)
{
    if (nthreads <= 1) {
        fn(ctx, 0);
        return;
    }
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool_call_lock);
    int workers = pool_grow(nthreads - 1);
    if (nthreads - 1 > workers)
        nthreads = workers + 1;
    pthread_mutex_lock(&pool_mu);
    pool_fn = fn;
    pool_ctx = ctx;
    pool_job_threads = nthreads;
    pool_pending = nthreads - 1;
    pool_generation++;
    pthread_cond_broadcast(&pool_work_cv);
    pthread_mutex_unlock(&pool_mu);
    fn(ctx, 0);
    pthread_mutex_lock(&pool_mu);
    while (pool_pending > 0)
        pthread_cond_wait(&pool_done_cv, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_call_lock);
}
#else
static void pool_run(kva_job_fn fn, void *ctx, int nthreads)
{
    (void)nthreads;
    fn(ctx, 0);
}
#endif

/* ------------------------------------------------------------------ */
/* Work items                                                          */
/* ------------------------------------------------------------------ */

typedef struct {
    int64_t seq;
    int64_t q0, q1;      /* query tokens of the sequence, [q0, q1) */
    int64_t k0, k1;      /* key positions, [k0, k1) */
    int64_t cost;        /* rows x keys, for the schedule */
    int64_t group;       /* merge group (nsplit > 1), else -1 */
    int64_t slot;        /* partial slot (nsplit > 1; a group's slots are consecutive), else -1 */
    int64_t order;       /* position in the natural order (ties of the schedule) */
    int32_t kv_head;
    int32_t split, nsplit;
} kva_item;

typedef struct {
    const kva_args *a;
    const kva_kernels *kern;
    const kva_kernels *kern_f32; /* for tiles widened once (items of many rows) */
    const kva_math *math;
    kva_item *items;
    int64_t num_items;
    int64_t next;        /* atomic: next item to take */
    int *group_done;     /* atomic counters, one per merge group */
    float *partials;     /* per split item: m[Mmax], l[Mmax], acc[Mmax * D] */
    size_t partial_floats;
    char *workspace;     /* per thread */
    size_t workspace_bytes;
    int tokens_per_tile, max_rows;
    int split_rows;      /* rows of a partial slot: the most rows of a split item */
} kva_job;

static int64_t group_size(const kva_args *a) { return a->num_heads / a->num_kv_heads; }

static int64_t tokens_per_tile(const kva_args *a)
{
    int64_t g = group_size(a);
    return g >= KVA_ROWS ? 1 : KVA_ROWS / g;
}

static int64_t seq_queries(const kva_args *a, int64_t s)
{
    return a->query_start_loc[s + 1] - a->query_start_loc[s];
}

/* Key range of query tokens [q0, q1) of sequence s: [*lo, *hi). */
static void key_range(const kva_args *a, int64_t s, int64_t q0, int64_t q1, int64_t *lo,
                      int64_t *hi)
{
    int64_t nq = seq_queries(a, s), len = a->seq_lens[s];
    int64_t first = len - nq + q0, last = len - nq + q1 - 1;
    *hi = last + 1;
    *lo = a->sliding_window > 0 && first + 1 > a->sliding_window
              ? first + 1 - a->sliding_window : 0;
}

/* Items of the call, in a fixed order (fills `items` when given). */
static int64_t make_items(const kva_args *a, kva_item *items, int64_t *num_groups,
                          int64_t *num_slots, int64_t *split_rows)
{
    int64_t n = 0, groups = 0, slots = 0, rows = 0, tq = tokens_per_tile(a), G = group_size(a);
    for (int64_t s = 0; s < a->num_seqs; s++) {
        int64_t nq = seq_queries(a, s);
        if (nq <= 0)
            continue;
        int64_t ntiles = (nq + tq - 1) / tq;
        for (int64_t t = 0; t < ntiles; t++) {
            int64_t q0 = t * tq, q1 = q0 + tq < nq ? q0 + tq : nq, lo, hi;
            key_range(a, s, q0, q1, &lo, &hi);
            int64_t nsplit = 1;
            if (ntiles == 1 && hi - lo > KVA_SPLIT_KEYS)
                nsplit = (hi - lo + KVA_SPLIT_KEYS - 1) / KVA_SPLIT_KEYS;
            for (int g = 0; g < a->num_kv_heads; g++) {
                for (int64_t sp = 0; sp < nsplit; sp++) {
                    if (items) {
                        kva_item *it = &items[n];
                        it->seq = s;
                        it->q0 = q0;
                        it->q1 = q1;
                        it->k0 = lo + sp * KVA_SPLIT_KEYS;
                        it->k1 = nsplit == 1 || sp == nsplit - 1 ? hi : it->k0 + KVA_SPLIT_KEYS;
                        it->cost = (q1 - q0) * G * (it->k1 - it->k0);
                        it->group = nsplit > 1 ? groups : -1;
                        it->slot = nsplit > 1 ? slots + sp : -1;
                        it->order = n;
                        it->kv_head = g;
                        it->split = (int32_t)sp;
                        it->nsplit = (int32_t)nsplit;
                    }
                    n++;
                }
                if (nsplit > 1) {
                    groups++;
                    slots += nsplit;
                    if ((q1 - q0) * G > rows)
                        rows = (q1 - q0) * G;
                }
            }
        }
    }
    if (num_groups)
        *num_groups = groups;
    if (num_slots)
        *num_slots = slots;
    if (split_rows)
        *split_rows = rows;
    return n;
}

int64_t kva_num_items(const kva_args *a) { return make_items(a, NULL, NULL, NULL, NULL); }

/* Per-thread workspace layout (floats unless noted). */
typedef struct {
    float *Qs, *S, *acc, *m, *l, *alpha, *tmp;
    int64_t *lo, *hi;
    int *first, *last;           /* visible keys of each row in this tile */
    const char **krow, **vrow;   /* this tile's rows */
    const char **nkrow, **nvrow; /* the next tile's */
    float *kf, *vf;              /* a tile widened to float32 */
    const char **kfrow, **vfrow; /* its rows */
} kva_ws;

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t workspace_layout(int max_rows, int D, char *base, kva_ws *ws)
{
    size_t off = 0;
#define KVA_TAKE(field, type, count)                                  \
    do {                                                              \
        if (ws)                                                       \
            ws->field = (type *)(base + off);                         \
        off += align64((size_t)(count) * sizeof(type));               \
    } while (0)
    KVA_TAKE(Qs, float, (size_t)max_rows * D);
    KVA_TAKE(S, float, (size_t)max_rows * KVA_KEY_TILE);
    KVA_TAKE(acc, float, (size_t)max_rows * D);
    KVA_TAKE(m, float, max_rows);
    KVA_TAKE(l, float, max_rows);
    KVA_TAKE(alpha, float, max_rows);
    KVA_TAKE(tmp, float, (size_t)KVA_KEY_TILE * D);
    KVA_TAKE(lo, int64_t, max_rows);
    KVA_TAKE(hi, int64_t, max_rows);
    KVA_TAKE(first, int, max_rows);
    KVA_TAKE(last, int, max_rows);
    KVA_TAKE(krow, const char *, KVA_KEY_TILE);
    KVA_TAKE(vrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(nkrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(nvrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(kf, float, (size_t)KVA_KEY_TILE * D);
    KVA_TAKE(vf, float, (size_t)KVA_KEY_TILE * D);
    KVA_TAKE(kfrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(vfrow, const char *, KVA_KEY_TILE);
#undef KVA_TAKE
    return off;
}

/* Merge the partial (max, sum, acc) of every split of `it`'s group, in split order. */
static void merge_group(kva_job *job, const kva_item *it, int M)
{
    const kva_args *a = job->a;
    const int D = a->head_dim, G = (int)group_size(a);
    const int64_t nsplit = it->nsplit;
    const int64_t base = it->slot - it->split;
    const int64_t row0 = a->query_start_loc[it->seq] + it->q0;
    for (int r = 0; r < M; r++) {
        float mx = -INFINITY, total = 0.0f;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float *p = job->partials + (size_t)(base + sp) * job->partial_floats;
            if (p[r] > mx)
                mx = p[r];
        }
        int64_t j = r / G, h = r % G;
        float *o = a->out + ((size_t)(row0 + j) * a->num_heads + (size_t)it->kv_head * G + h) * D;
        for (int d = 0; d < D; d++)
            o[d] = 0.0f;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float *p = job->partials + (size_t)(base + sp) * job->partial_floats;
            const float m = p[r], l = p[job->split_rows + r];
            if (m == -INFINITY)
                continue; /* no key of this split was visible to this row */
            const float w = exp2f(m - mx);
            const float *acc = p + 2 * (size_t)job->split_rows + (size_t)r * D;
            total += w * l;
            for (int d = 0; d < D; d++)
                o[d] += w * acc[d];
        }
        for (int d = 0; d < D; d++)
            o[d] = o[d] / total;
    }
}

/* Row addresses of positions t0 .. min(t0 + KVA_KEY_TILE, k1) - 1, padded to
 * a multiple of 8 with the last row (its scores are masked); returns the
 * number of real rows. */
static int tile_rows(const kva_args *a, const int32_t *table, const char *kbase,
                     const char *vbase, int64_t t0, int64_t k1, const char **krow,
                     const char **vrow)
{
    const int nt = (int)(k1 - t0 < KVA_KEY_TILE ? k1 - t0 : KVA_KEY_TILE);
    const int ntp = (nt + 7) & ~7;
    int64_t blk = t0 / a->block_size, off = t0 - blk * a->block_size;
    for (int i = 0; i < nt; i++) {
        if (off == a->block_size) {
            blk++;
            off = 0;
        }
        ptrdiff_t o = (ptrdiff_t)table[blk] * a->block_stride + (ptrdiff_t)off * a->row_stride;
        krow[i] = kbase + o;
        vrow[i] = vbase + o;
        off++;
    }
    for (int i = nt; i < ntp; i++) {
        krow[i] = krow[nt - 1];
        vrow[i] = vrow[nt - 1];
    }
    return nt;
}

/* Touch the first two rows of every contiguous run of rows (a block's
 * positions): the hardware prefetcher follows a run once it has started,
 * but not the jump from one block to the next. */
static inline void prefetch_rows(const char *const *rows, int n, size_t row_bytes)
{
    for (int i = 0; i < n; i++) {
        if (i == 0 || rows[i] != rows[i - 1] + row_bytes) {
            const char *end = rows[i] + 2 * row_bytes;
            for (const char *p = rows[i]; p < end; p += 64)
                __builtin_prefetch(p, 0, 3);
        }
    }
}

/* An fp8 layer scale; 0 (a zero-initialised kva_args) means none. */
static inline float layer_scale(float s)
{
    return s == 0.0f ? 1.0f : s;
}

/* Low precision: the scales of keys t0..t0+nt-1 of kv head g (ks, vs),
 * and the scores of the tile's M rows times the keys' scales. */
static void tile_scales(const kva_args *a, const int32_t *table, int g, int64_t t0, int nt,
                        float *ks, float *vs, float *S, int M)
{
    if (a->key_scales != NULL) {
        /* position t0 + i: block blk, offset off (one division per tile) */
        int64_t blk = t0 / a->block_size, off = t0 - blk * a->block_size;
        size_t at = ((size_t)table[blk] * a->num_kv_heads + g) * a->block_size + (size_t)off;
        for (int i = 0; i < nt; i++, off++, at++) {
            if (off == a->block_size) {
                blk++;
                off = 0;
                at = ((size_t)table[blk] * a->num_kv_heads + g) * a->block_size;
            }
            ks[i] = a->key_scales[at];
            vs[i] = a->value_scales[at];
        }
    } else {
        for (int i = 0; i < nt; i++) {
            ks[i] = layer_scale(a->k_scale);
            vs[i] = layer_scale(a->v_scale);
        }
    }
    for (int r = 0; r < M; r++)
        for (int i = 0; i < nt; i++)
            S[r * KVA_KEY_TILE + i] *= ks[i];
}

static void run_item(kva_job *job, const kva_item *it, const kva_ws *ws)
{
    const kva_args *a = job->a;
    const int D = a->head_dim, G = (int)group_size(a), g = it->kv_head;
    const int64_t s = it->seq, nq = seq_queries(a, s), len = a->seq_lens[s];
    const int64_t row0 = a->query_start_loc[s] + it->q0;
    const int M = (int)((it->q1 - it->q0) * G);
    const int capped = a->soft_cap > 0.0f;
    /* base-2 softmax: log2(e) rides on q unless the cap needs the natural score */
    const float qscale = capped ? a->scale : a->scale * KVA_LOG2E;
    const int32_t *table = a->block_tables + (size_t)s * a->block_table_stride;
    const char *kbase = a->key_cache + (ptrdiff_t)g * a->head_stride;
    const char *vbase = a->value_cache + (ptrdiff_t)g * a->head_stride;
    const kva_kernels *kern = job->kern, *kern_f32 = job->kern_f32;
    const kva_math *math = job->math;
    /* the kernels read the elements divided by unit: q carries it */
    const float unit = kern->unit;
    const int widen = M > KVA_WIDEN_ROWS && a->kind != KVA_F32;
    if (widen) {
        for (int i = 0; i < KVA_KEY_TILE; i++) {
            ws->kfrow[i] = (const char *)(ws->kf + (size_t)i * D);
            ws->vfrow[i] = (const char *)(ws->vf + (size_t)i * D);
        }
    }

    for (int r = 0; r < M; r++) {
        int64_t j = it->q0 + r / G, h = r % G;
        const float *src = a->q + ((size_t)(row0 - it->q0 + j) * a->num_heads + (size_t)g * G + h) * D;
        float *dst = ws->Qs + (size_t)r * D;
        for (int d = 0; d < D; d++)
            dst[d] = src[d] * qscale * unit; /* (times a power of two: exact) */
        int64_t pos = len - nq + j;
        ws->hi[r] = pos + 1;
        ws->lo[r] = a->sliding_window > 0 && pos + 1 > a->sliding_window
                        ? pos + 1 - a->sliding_window : 0;
        ws->m[r] = -INFINITY;
        ws->l[r] = 0.0f;
    }
    memset(ws->acc, 0, (size_t)M * D * sizeof(float));

    const size_t row_bytes = (size_t)D * kva_isz(a->kind);
    /* low precision: row i of a tile reads as its elements times ks[i]
     * (keys) / vs[i] (values), applied to its scores and its weights */
    const int scaled = a->key_scales != NULL || layer_scale(a->k_scale) != 1.0f ||
                       layer_scale(a->v_scale) != 1.0f;
    float ks[KVA_KEY_TILE], vs[KVA_KEY_TILE];
    const char **krow = ws->krow, **vrow = ws->vrow, **nkrow = ws->nkrow, **nvrow = ws->nvrow;
    if (it->k0 < it->k1)
        tile_rows(a, table, kbase, vbase, it->k0, it->k1, krow, vrow);
    for (int64_t t0 = it->k0; t0 < it->k1; t0 += KVA_KEY_TILE) {
        const int nt = (int)(it->k1 - t0 < KVA_KEY_TILE ? it->k1 - t0 : KVA_KEY_TILE);
        const int ntp = (nt + 7) & ~7;
        const int64_t t1 = t0 + KVA_KEY_TILE;
        const int nnext = t1 < it->k1 ? tile_rows(a, table, kbase, vbase, t1, it->k1, nkrow, nvrow)
                                      : 0;
        /* The rows of a tile are scattered over blocks: start this tile's V
         * and the next tile's K and V while this tile's scores are computed. */
        prefetch_rows(vrow, nt, row_bytes);
        prefetch_rows(nkrow, nnext, row_bytes);
        prefetch_rows(nvrow, nnext, row_bytes);
        if (widen) {
            kern->widen(krow, ntp, D, ws->kf); /* padding rows included */
            kern_f32->scores(ws->Qs, M, D, ws->kfrow, ntp, ws->S, ws->tmp);
        } else {
            kern->scores(ws->Qs, M, D, krow, ntp, ws->S, ws->tmp);
        }
        if (scaled)
            tile_scales(a, table, g, t0, nt, ks, vs, ws->S, M);
        for (int r = 0; r < M; r++) {
            float *srow = ws->S + r * KVA_KEY_TILE;
            if (capped)
                math->softcap(srow, ntp, 1.0f / a->soft_cap, a->soft_cap * KVA_LOG2E);
            /* visible keys of row r in this tile: [first, last) */
            int64_t first = ws->lo[r] - t0, last = ws->hi[r] - t0;
            if (first < 0)
                first = 0;
            if (last > nt)
                last = nt;
            if (last <= first) { /* nothing visible: no change to this row */
                ws->first[r] = ws->last[r] = 0;
                ws->alpha[r] = 1.0f;
                memset(srow, 0, (size_t)ntp * sizeof(float));
                continue;
            }
            ws->first[r] = (int)first;
            ws->last[r] = (int)last;
            for (int64_t i = 0; i < first; i++)
                srow[i] = -INFINITY;
            for (int64_t i = last; i < ntp; i++)
                srow[i] = -INFINITY;
            float mx = math->row_max(srow, ntp);
            float mnew = ws->m[r] > mx ? ws->m[r] : mx;
            ws->alpha[r] = ws->m[r] == -INFINITY ? 0.0f : exp2f(ws->m[r] - mnew);
            float sum = math->row_exp_sum(srow, ntp, mnew);
            ws->l[r] = ws->l[r] * ws->alpha[r] + sum;
            ws->m[r] = mnew;
            if (scaled) /* the visible keys' weights times their values' scales */
                for (int64_t i = first; i < last; i++)
                    srow[i] *= vs[i];
            if (unit != 1.0f) /* the values are read divided by unit: the weights
                                 carry it, so each product is the exact p * v
                                 (subnormal ones included) */
                for (int64_t i = first; i < last; i++)
                    srow[i] *= unit;
        }
        /* P V over each row's visible keys only (a masked key's weight is
         * 0, but 0 * a stored NaN or inf is NaN): runs of rows with the same
         * visible keys (every row of a decode item) in one call. */
        const kva_kernels *pk = kern;
        const char *const *prow = vrow;
        if (widen) {
            kern->widen(vrow, nt, D, ws->vf);
            pk = kern_f32;
            prow = ws->vfrow;
        }
        for (int r = 0, r1; r < M; r = r1) {
            const int first = ws->first[r], last = ws->last[r];
            for (r1 = r + 1; r1 < M && ws->first[r1] == first && ws->last[r1] == last; r1++)
                ;
            if (last > first)
                pk->pv(ws->S + (size_t)r * KVA_KEY_TILE + first, r1 - r, D, prow + first,
                       last - first, ws->acc + (size_t)r * D, ws->alpha + r, ws->tmp);
        }
        const char **swap = krow;
        krow = nkrow;
        nkrow = swap;
        swap = vrow;
        vrow = nvrow;
        nvrow = swap;
    }

    if (it->nsplit == 1) {
        for (int r = 0; r < M; r++) {
            int64_t j = r / G, h = r % G;
            float *o = a->out + ((size_t)(row0 + j) * a->num_heads + (size_t)g * G + h) * D;
            const float *acc = ws->acc + (size_t)r * D;
            const float l = ws->l[r];
            for (int d = 0; d < D; d++)
                o[d] = acc[d] / l;
        }
        return;
    }
    float *p = job->partials + (size_t)it->slot * job->partial_floats;
    memcpy(p, ws->m, (size_t)M * sizeof(float));
    memcpy(p + job->split_rows, ws->l, (size_t)M * sizeof(float));
    memcpy(p + 2 * (size_t)job->split_rows, ws->acc, (size_t)M * D * sizeof(float));
    /* The split that finishes last merges, in split order (acq_rel: every
     * other split's partial is visible to it). */
    if (__atomic_add_fetch(&job->group_done[it->group], 1, __ATOMIC_ACQ_REL) == it->nsplit)
        merge_group(job, it, M);
}

static void job_thread(void *ctx, int thread_index)
{
    kva_job *job = (kva_job *)ctx;
    kva_ws ws;
    workspace_layout(job->max_rows, job->a->head_dim,
                     job->workspace + (size_t)thread_index * job->workspace_bytes, &ws);
    for (;;) {
        int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->num_items)
            break;
        run_item(job, &job->items[i], &ws);
    }
}

/* Costliest first (this is only the schedule: each item's result, and
 * every merge, is the same in any order); ties in the natural order. */
static int by_cost(const void *x, const void *y)
{
    const kva_item *a = (const kva_item *)x, *b = (const kva_item *)y;
    if (a->cost != b->cost)
        return a->cost < b->cost ? 1 : -1;
    return a->order < b->order ? -1 : a->order > b->order;
}

int kva_paged_attention(const kva_args *a)
{
    if (a->num_heads <= 0 || a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads ||
        a->head_dim <= 0 || a->block_size <= 0 || a->kind < 0 || a->kind > KVA_I8 ||
        (a->kind == KVA_I8) != (a->key_scales != NULL && a->value_scales != NULL))
        return KVA_EINVAL;
    int level = kva_current_level();
    /* the AVX2 (NEON) kernels work on whole vectors of 8 (4) dims */
    if (a->head_dim % 8)
        level = KVA_SCALAR;
    int64_t ngroups = 0, nslots = 0, split_rows = 0;
    int64_t n = make_items(a, NULL, &ngroups, &nslots, &split_rows);
    if (n == 0)
        return KVA_OK;
    kva_job job;
    memset(&job, 0, sizeof job);
    job.a = a;
    job.kern = kernels_for(level, a->kind);
    job.kern_f32 = kernels_for(level, KVA_F32);
    job.math = math_for(level);
    job.num_items = n;
    job.tokens_per_tile = (int)tokens_per_tile(a);
    job.max_rows = (int)(job.tokens_per_tile * group_size(a));
    job.split_rows = (int)split_rows;
    int nthreads = a->num_threads < 1 ? 1 : a->num_threads;
    if (nthreads > n)
        nthreads = (int)n;

    /* One allocation: items, merge counters, partial slots, workspaces. */
    const int D = a->head_dim;
    job.workspace_bytes = workspace_layout(job.max_rows, D, NULL, NULL);
    job.partial_floats =
        align64(((size_t)2 * job.split_rows + (size_t)job.split_rows * D) * 4) / 4;
    size_t items_bytes = align64((size_t)n * sizeof(kva_item));
    size_t counters_bytes = align64((size_t)ngroups * sizeof(int));
    size_t partial_bytes = (size_t)nslots * job.partial_floats * sizeof(float);
    size_t total = items_bytes + counters_bytes + partial_bytes +
                   (size_t)nthreads * job.workspace_bytes;
    char *mem = NULL;
    if (posix_memalign((void **)&mem, 64, total) != 0)
        return KVA_ENOMEM;
    job.items = (kva_item *)mem;
    job.group_done = (int *)(mem + items_bytes);
    job.partials = (float *)(mem + items_bytes + counters_bytes);
    job.workspace = mem + items_bytes + counters_bytes + partial_bytes;
    make_items(a, job.items, NULL, NULL, NULL);
    memset(job.group_done, 0, counters_bytes);
    if (nthreads > 1) {
        /* Waking a worker costs microseconds: a call too small to repay it
         * (a short decode) runs on fewer threads.  The bits do not depend
         * on the thread count. */
        int64_t work = 0;
        for (int64_t i = 0; i < n; i++)
            work += job.items[i].cost;
        work *= D;
        if (work / KVA_WORK_PER_THREAD < nthreads)
            nthreads = work / KVA_WORK_PER_THREAD > 1 ? (int)(work / KVA_WORK_PER_THREAD) : 1;
    }
    if (nthreads > 1)
        qsort(job.items, (size_t)n, sizeof(kva_item), by_cost);
    pool_run(job_thread, &job, nthreads);
    free(mem);
    return KVA_OK;
}
