/*
 * kv_attn_avx2.c: the AVX2 + FMA + F16C kernels of the attention (x86-64).
 *
 * This file is compiled without any -m flags, like the rest: every function
 * carries __attribute__((target("avx2,fma,f16c"))) and ends in _avx2, and
 * the tables are used only after the CPU said it has the instructions
 * (kv_simd.h); tests/attention/test_attention.py checks the machine code for it.
 */
#include "kv_attn_internal.h"

#include <math.h>
#include <string.h>

#if KVA_HAVE_AVX2
#include <immintrin.h>

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

/* Internal kinds of the AVX2 kernels: e4m3fn read with its NaN blend;
 * e4m3fn read without it while every 32-byte piece of the rows read is
 * searched for NaN codes (decode calls of head_dim 64 or 128, see
 * const_dims_avx2). */
#define KVA_F8E4M3_NAN 6
#define KVA_F8E4M3_CHK 7

/* The kind a checking kind (KVA_F8E4M3_CHK) loads with; others: itself. */
static inline int chk_load_kind(int kind)
{
    return kind == KVA_F8E4M3_CHK ? KVA_F8E4M3 : kind;
}

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

/* The 16 elements of an 8-bit `kind` at p widened as load8_avx2 does, into
 * o[0] (the first 8) and o[1]: e4m3fn and e5m2 are widened to 16 bits 16 at
 * a time (one extension, one shift, one mask for 16), then two
 * conversions; int8 as two loads of 8. */
KVA_INLINE void load16x2_avx2(const char *p, int kind, __m256 *o)
{
    if (kind == KVA_I8 || kind == KVA_F8E4M3_NAN) {
        o[0] = load8_avx2(p, kind);
        o[1] = load8_avx2(p + 8, kind);
        return;
    }
    /* (e5m2: the shift drops the extended sign) */
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = kind == KVA_F8E5M2
                          ? _mm256_slli_epi16(w, 8)
                          : _mm256_and_si256(_mm256_slli_epi16(w, 7),
                                             _mm256_set1_epi16((short)0xBF80));
    o[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    o[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* 32 e4m3fn codes at p folded into a NaN search: the unsigned max of the
 * bytes with their sign bit set is 0xFF exactly when one is a NaN code. */
KVA_INLINE __m256i nan_fold_avx2(__m256i mx, const char *p)
{
    return _mm256_max_epu8(mx, _mm256_or_si256(_mm256_loadu_si256((const __m256i *)p),
                                               _mm256_set1_epi8((char)0x80)));
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
 * 2^-126 and above.  Below 2^-126 the result is +0, never a subnormal
 * (kva_flush_tiny); -inf gives +0, NaN stays NaN.
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
    /* (x < -126: +0; an unordered compare keeps NaN) */
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_LT_OQ),
                            _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* v with every lane of magnitude below 2^-126 made +0 (kva_flush_tiny). */
KVA_INLINE __m256 flush_tiny_avx2(__m256 v)
{
    const __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    return _mm256_andnot_ps(_mm256_cmp_ps(mag, _mm256_set1_ps(0x1p-126f), _CMP_LT_OQ), v);
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

/* The line of `next` (a row of the next tile, or NULL: none) at byte `off`,
 * when `off` starts a line of the row: beside the load at `off` of the
 * current row (kva_kernels: `next`). */
KVA_INLINE void prefetch_at_avx2(const char *next, size_t off)
{
    if (next != NULL && (off & 63) == 0)
        __builtin_prefetch(next + off, 0, 3);
}

/* acc[rb * KB + kb] += q[r + rb][8 v ..] * kv[kb], for the RB rows. */
KVA_INLINE void dot_fma_avx2(__m256 *acc, const __m256 *kv, const float *q0, int D, int RB, int KB,
                             int v)
{
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++) {
        __m256 qv = _mm256_loadu_ps(q0 + (size_t)rb * D + 8 * v);
        /* one load per q vector, reused for the KB keys (GCC would
         * otherwise fold a load into every FMA) */
        __asm__("" : "+x"(qv));
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++)
            acc[rb * KB + kb] = _mm256_fmadd_ps(qv, kv[kb], acc[rb * KB + kb]);
    }
}

/* RB query rows x KB keys of the score tile, RB * KB <= 8 accumulators,
 * over D / 8 vectors of 8 dims; PF (a constant): each line of the next
 * tile's rows nk[i + kb] is prefetched beside the load of the same line;
 * CONST: D is a constant (the loop unrolls whole).  e4m3fn and e5m2 are
 * widened 16 elements at a time where registers allow (KB <= 2).
 * KVA_F8E4M3_CHK (head_dim a multiple of 32): returns 1 when a key holds a
 * NaN code (the block is then computed again with the blend); else 0. */
KVA_INLINE int dot_block_avx2(const float *Qs, int D, const char *const *krow, int kind, int RB,
                              int KB, int r, int i, float *S, const char *const *nk, int PF,
                              int CONST)
{
    const int chk = kind == KVA_F8E4M3_CHK, lk = chk_load_kind(kind);
    const int isz = kva_isz(lk);
    const int pairs = (lk == KVA_F8E4M3 || lk == KVA_F8E5M2) && KB <= 2;
    if (RB < 1 || KB < 1 || RB * KB > 8)
        __builtin_unreachable(); /* (the callers' shapes; for the compiler's bounds) */
    __m256 acc[8];
    __m256i mx = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int a = 0; a < 8; a++)
        acc[a] = _mm256_setzero_ps();
    const float *q0 = Qs + (size_t)r * D;
    const char *kp[8] = {NULL}, *np[8] = {NULL};
#pragma GCC unroll 8
    for (int kb = 0; kb < KB; kb++) {
        kp[kb] = krow[i + kb];
        np[kb] = PF ? nk[i + kb] : NULL;
    }
#define KVA_DOT_STEP(v, two)                                                                 \
    do {                                                                                     \
        const size_t off = (size_t)(v) * 8 * isz;                                            \
        __m256 kv[8], kw[8];                                                                 \
        _Pragma("GCC unroll 8") for (int kb = 0; kb < KB; kb++)                              \
        {                                                                                    \
            if (two) {                                                                       \
                __m256 t[2];                                                                 \
                load16x2_avx2(kp[kb] + off, lk, t);                                          \
                kv[kb] = t[0];                                                               \
                kw[kb] = t[1];                                                               \
            } else {                                                                         \
                kv[kb] = load8_avx2(kp[kb] + off, lk);                                       \
            }                                                                                \
            if (PF && (off & 63) == 0)                                                       \
                __builtin_prefetch(np[kb] + off, 0, 3);                                      \
            if (chk && (off & 31) == 0)                                                      \
                mx = nan_fold_avx2(mx, kp[kb] + off);                                        \
        }                                                                                    \
        dot_fma_avx2(acc, kv, q0, D, RB, KB, (v));                                           \
        if (two)                                                                             \
            dot_fma_avx2(acc, kw, q0, D, RB, KB, (v) + 1);                                   \
    } while (0)
    const int NV = D / 8;
    int v = 0;
    if (CONST) {
        if (pairs) {
#pragma GCC unroll 8
            for (; v + 2 <= NV; v += 2)
                KVA_DOT_STEP(v, 1);
        }
#pragma GCC unroll 16
        for (; v < NV; v++)
            KVA_DOT_STEP(v, 0);
    } else {
        for (; v < NV; v++)
            KVA_DOT_STEP(v, 0);
    }
#undef KVA_DOT_STEP
    float sums[8];
    _mm256_storeu_ps(sums, hsum8x8_avx2(acc));
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++)
            S[(r + rb) * KVA_KEY_TILE + i + kb] = sums[rb * KB + kb];
    return chk && _mm256_movemask_epi8(_mm256_cmpeq_epi8(mx, _mm256_set1_epi8((char)0xFF))) != 0;
}

/* A score block whose keys hold an e4m3fn NaN code (rare), with the blend. */
KVA_TARGET __attribute__((noinline)) static void
dot_block_nan_avx2(const float *Qs, int D, const char *const *krow, int RB, int KB, int r, int i,
                   float *S)
{
    const int k = KVA_F8E4M3_NAN;
    switch (RB * 16 + KB) {
    case 1 * 16 + 8: dot_block_avx2(Qs, D, krow, k, 1, 8, r, i, S, NULL, 0, 0); break;
    case 2 * 16 + 4: dot_block_avx2(Qs, D, krow, k, 2, 4, r, i, S, NULL, 0, 0); break;
    case 3 * 16 + 2: dot_block_avx2(Qs, D, krow, k, 3, 2, r, i, S, NULL, 0, 0); break;
    default: dot_block_avx2(Qs, D, krow, k, 4, 2, r, i, S, NULL, 0, 0); break;
    }
}

/* Rows r .. r + RB - 1 over every key of the tile, KB keys a block. */
KVA_INLINE void dot_rows_avx2(const float *Qs, int D, const char *const *krow, int ntp, int kind,
                              int RB, int KB, int r, float *S, const char *const *nk, int PF,
                              int CONST)
{
    for (int i = 0; i < ntp; i += KB)
        if (dot_block_avx2(Qs, D, krow, kind, RB, KB, r, i, S, nk, PF, CONST))
            dot_block_nan_avx2(Qs, D, krow, RB, KB, r, i, S);
}

/* Whether a decode call of `kind`, M rows and head_dim D runs bodies with
 * D a constant: head_dims 64 and 128, M <= 4 (the rows of one GQA group of
 * up to 4; the kinds but float32 widen their tiles for more rows), not
 * float32 nor the NaN blend.  Such a call always prefetches (the last
 * tile: its own rows, already in the cache): each body exists once. */
static inline int const_dims_avx2(int kind, int M, int D)
{
    return kind != KVA_F32 && kind != KVA_F8E4M3_NAN && M <= 4 &&
           (D == 64 || D == 128);
}

/* One GQA group's rows (M <= 4) at head_dim D (a constant), prefetching:
 * one block of rows, so each key is widened once (3 rows: SmolLM2's). */
KVA_INLINE void dot_group_avx2(int kind, int D, const float *Qs, int M, const char *const *krow,
                               int ntp, float *S, const char *const *nk)
{
    switch (M) {
    case 1: dot_rows_avx2(Qs, D, krow, ntp, kind, 1, 8, 0, S, nk, 1, 1); break;
    case 2: dot_rows_avx2(Qs, D, krow, ntp, kind, 2, 4, 0, S, nk, 1, 1); break;
    case 3: dot_rows_avx2(Qs, D, krow, ntp, kind, 3, 2, 0, S, nk, 1, 1); break;
    default: dot_rows_avx2(Qs, D, krow, ntp, kind, 4, 2, 0, S, nk, 1, 1); break;
    }
}

/* The first block of rows prefetches the next tile's keys (nk; the last
 * tile: its own rows). */
KVA_INLINE void scores_avx2(int kind, const float *Qs, int M, int D, const char *const *krow,
                            int ntp, float *S, const char *const *nk)
{
    const char *const *pk = nk != NULL ? nk : krow;
    if (const_dims_avx2(kind, M, D)) {
        if (D == 64)
            dot_group_avx2(kind, 64, Qs, M, krow, ntp, S, pk);
        else
            dot_group_avx2(kind, 128, Qs, M, krow, ntp, S, pk);
        return;
    }
    int r = 0;
    for (; r + 4 <= M; r += 4) {
        if (r == 0)
            dot_rows_avx2(Qs, D, krow, ntp, kind, 4, 2, r, S, pk, 1, 0);
        else
            dot_rows_avx2(Qs, D, krow, ntp, kind, 4, 2, r, S, NULL, 0, 0);
    }
    if (r + 2 <= M) {
        if (r == 0)
            dot_rows_avx2(Qs, D, krow, ntp, kind, 2, 4, r, S, pk, 1, 0);
        else
            dot_rows_avx2(Qs, D, krow, ntp, kind, 2, 4, r, S, NULL, 0, 0);
        r += 2;
    }
    if (r < M) {
        if (r == 0)
            dot_rows_avx2(Qs, D, krow, ntp, kind, 1, 8, r, S, pk, 1, 0);
        else
            dot_rows_avx2(Qs, D, krow, ntp, kind, 1, 8, r, S, NULL, 0, 0);
    }
}

/* RB rows x DB vectors of 8 dims of the accumulator, over nt keys; PF (a
 * constant): the lines of the next tile's rows nv[i] are prefetched beside
 * the loads of the same lines.  e4m3fn and e5m2 are widened 16 elements at
 * a time (DB even).  KVA_F8E4M3_CHK (DB even): the values are read without
 * the NaN blend while each 16-byte piece is searched, per dim, for NaN
 * codes; a dim where one of the keys holds one becomes NaN, as the blend
 * would make it (p times NaN is NaN, and stays NaN). */
KVA_INLINE void pv_block_avx2(const float *P, int D, const char *const *vrow, int nt, int kind,
                              int RB, int DB, int r, int d, float *acc, const float *alpha,
                              const char *const *nv, int PF)
{
    const int chk = kind == KVA_F8E4M3_CHK, lk = chk_load_kind(kind);
    const int isz = kva_isz(lk);
    const int pairs = (lk == KVA_F8E4M3 || lk == KVA_F8E5M2) && DB % 2 == 0;
    if (RB < 1 || DB < 1 || DB > 8 || RB * DB > 8)
        __builtin_unreachable(); /* (the callers' shapes; for the compiler's bounds) */
    __m256 a[8];
    __m128i mx[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(),
                     _mm_setzero_si128()};
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
        const char *row = vrow[i] + off, *next = PF ? nv[i] + off : NULL;
        __m256 v[8];
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++) {
            if (pairs) {
                if (db % 2 == 0)
                    load16x2_avx2(row + (size_t)db * 8, lk, v + db);
            } else {
                v[db] = load8_avx2(row + (size_t)db * 8 * isz, lk);
            }
            if (PF && ((off + (size_t)db * 8 * isz) & 63) == 0)
                __builtin_prefetch(next + (size_t)db * 8 * isz, 0, 3);
            if (chk && db % 2 == 0)
                mx[db / 2] = _mm_max_epu8(mx[db / 2],
                                          _mm_or_si128(_mm_loadu_si128((const __m128i *)(row + db * 8)),
                                                       _mm_set1_epi8((char)0x80)));
        }
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            __m256 p = _mm256_broadcast_ss(P + (r + rb) * KVA_KEY_TILE + i);
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++)
                a[rb * DB + db] = _mm256_fmadd_ps(p, v[db], a[rb * DB + db]);
        }
    }
    if (chk) {
        __m128i any = _mm_setzero_si128();
#pragma GCC unroll 4
        for (int l = 0; l < DB / 2; l++) {
            mx[l] = _mm_cmpeq_epi8(mx[l], _mm_set1_epi8((char)0xFF));
            any = _mm_or_si128(any, mx[l]);
        }
        if (_mm_movemask_epi8(any) != 0) { /* (rare) */
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++) {
                const __m128i bytes = db % 2 ? _mm_srli_si128(mx[db / 2], 8) : mx[db / 2];
                const __m256 m = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(bytes));
#pragma GCC unroll 8
                for (int rb = 0; rb < RB; rb++)
                    a[rb * DB + db] = _mm256_blendv_ps(a[rb * DB + db], _mm256_set1_ps(NAN), m);
            }
        }
    }
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            _mm256_storeu_ps(acc + (size_t)(r + rb) * D + d + db * 8, a[rb * DB + db]);
}

/* Rows r .. r + RB - 1: DB vectors at a time, then single vectors. */
KVA_INLINE void pv_rows_avx2(const float *P, int D, const char *const *vrow, int nt, int kind,
                             int RB, int DB, int r, float *acc, const float *alpha,
                             const char *const *nv, int PF)
{
    int d = 0;
    for (; d + 8 * DB <= D; d += 8 * DB)
        pv_block_avx2(P, D, vrow, nt, kind, RB, DB, r, d, acc, alpha, nv, PF);
    for (; d < D; d += 8)
        pv_block_avx2(P, D, vrow, nt, kind, RB, 1, r, d, acc, alpha, nv, PF);
}

KVA_INLINE void pv_avx2(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                        float *acc, const float *alpha, const char *const *nv)
{
    if (const_dims_avx2(kind, M, D)) {
        /* one block of rows (each value widened once), prefetching (the
         * last tile: its own rows); D a constant */
        const char *const *pn = nv != NULL ? nv : vrow;
#define KVA_PV_GROUP(DC)                                                                     \
    do {                                                                                     \
        switch (M) {                                                                         \
        case 1: pv_rows_avx2(P, DC, vrow, nt, kind, 1, 8, 0, acc, alpha, pn, 1); break;      \
        case 2: pv_rows_avx2(P, DC, vrow, nt, kind, 2, 4, 0, acc, alpha, pn, 1); break;      \
        case 3: pv_rows_avx2(P, DC, vrow, nt, kind, 3, 2, 0, acc, alpha, pn, 1); break;      \
        default: pv_rows_avx2(P, DC, vrow, nt, kind, 4, 2, 0, acc, alpha, pn, 1); break;     \
        }                                                                                    \
    } while (0)
        if (D == 64)
            KVA_PV_GROUP(64);
        else
            KVA_PV_GROUP(128);
#undef KVA_PV_GROUP
        return;
    }
    /* the first block of rows prefetches the next tile's values (nv) */
    const int PF = nv != NULL;
    int r = 0;
    for (; r + 4 <= M; r += 4) {
        if (PF && r == 0)
            pv_rows_avx2(P, D, vrow, nt, kind, 4, 2, r, acc, alpha, nv, 1);
        else
            pv_rows_avx2(P, D, vrow, nt, kind, 4, 2, r, acc, alpha, NULL, 0);
    }
    if (r + 2 <= M) {
        if (PF && r == 0)
            pv_rows_avx2(P, D, vrow, nt, kind, 2, 4, r, acc, alpha, nv, 1);
        else
            pv_rows_avx2(P, D, vrow, nt, kind, 2, 4, r, acc, alpha, NULL, 0);
        r += 2;
    }
    if (r < M) {
        if (PF && r == 0)
            pv_rows_avx2(P, D, vrow, nt, kind, 1, 8, r, acc, alpha, nv, 1);
        else
            pv_rows_avx2(P, D, vrow, nt, kind, 1, 8, r, acc, alpha, NULL, 0);
    }
}

KVA_INLINE void widen_avx2(int kind, const char *const *rows, int n, int D, float *dst,
                           const char *const *next)
{
    const int isz = kva_isz(kind);
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d += 8) {
            prefetch_at_avx2(next != NULL ? next[i] : NULL, (size_t)d * isz);
            _mm256_storeu_ps(dst + (size_t)i * D + d, load8_avx2(rows[i] + (size_t)d * isz, kind));
        }
}

/* The three bodies of a page kind (name): widen, scores and P.V, each picking its
 * kind at the call: KCHK when CHECKS(KCHK, M, D) (the body searches the lines it
 * reads for NaN codes as it goes), KNAN when HAS_NAN finds a NaN code in the rows
 * (the NaN blend), else K.  A plain kind passes KVA_NEVER for both: its one kind.
 * (Each body with its kind a constant: a kind chosen at run time would be a test
 * in every load of the inner loops.) */
#define KVA_NEVER(...) 0
#define KVA_AVX2_BODIES(name, K, KNAN, KCHK, CHECKS, HAS_NAN)                                 \
    KVA_TARGET static void widen_##name##_avx2(const char *const *rows, int n, int D,         \
                                               float *dst, const char *const *next)           \
    {                                                                                         \
        if (HAS_NAN(rows, n, D))                                                              \
            widen_avx2(KNAN, rows, n, D, dst, next);                                          \
        else                                                                                  \
            widen_avx2(K, rows, n, D, dst, next);                                             \
    }                                                                                         \
    KVA_TARGET static void scores_##name##_avx2(const float *Qs, int M, int D,                \
                                                const char *const *krow, int ntp, float *S,   \
                                                float *t, const char *const *next)            \
    {                                                                                         \
        (void)t;                                                                              \
        if (CHECKS(KCHK, M, D))                                                               \
            scores_avx2(KCHK, Qs, M, D, krow, ntp, S, next);                                  \
        else if (HAS_NAN(krow, ntp, D))                                                       \
            scores_avx2(KNAN, Qs, M, D, krow, ntp, S, next);                                  \
        else                                                                                  \
            scores_avx2(K, Qs, M, D, krow, ntp, S, next);                                     \
    }                                                                                         \
    KVA_TARGET static void pv_##name##_avx2(const float *P, int M, int D,                     \
                                            const char *const *vrow, int nt, float *acc,      \
                                            const float *alpha, float *t,                     \
                                            const char *const *next)                          \
    {                                                                                         \
        (void)t;                                                                              \
        if (CHECKS(KCHK, M, D))                                                               \
            pv_avx2(KCHK, P, M, D, vrow, nt, acc, alpha, next);                               \
        else if (HAS_NAN(vrow, nt, D))                                                        \
            pv_avx2(KNAN, P, M, D, vrow, nt, acc, alpha, next);                               \
        else                                                                                  \
            pv_avx2(K, P, M, D, vrow, nt, acc, alpha, next);                                  \
    }
#define KVA_AVX2_KIND(name, kind) KVA_AVX2_BODIES(name, kind, kind, kind, KVA_NEVER, KVA_NEVER)
KVA_AVX2_KIND(f32, KVA_F32)
KVA_AVX2_KIND(f16, KVA_F16)
KVA_AVX2_KIND(bf16, KVA_BF16)
KVA_AVX2_KIND(e5m2, KVA_F8E5M2)
KVA_AVX2_KIND(i8, KVA_I8)

/* e4m3fn (read as halves, as at avx512): decode calls of head_dim 64 and 128 (up
 * to 4 rows) search the bytes they read for NaN codes as they go; the others
 * search the tile's rows once (a few byte compares per row) and only a tile that
 * holds one pays for the NaN blend of every 8 elements. */
#define KVA_AVX2_E4M3(name, K, KNAN, KCHK)                                                    \
    KVA_AVX2_BODIES(name, K, KNAN, KCHK, const_dims_avx2, rows_have_e4m3_nan_avx2)
KVA_AVX2_E4M3(e4m3, KVA_F8E4M3, KVA_F8E4M3_NAN, KVA_F8E4M3_CHK)

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

/* Items of up to 8 rows read the stored rows; float16, bfloat16 and int8
 * items of 9-15 too, in two calls (the fp8 kinds widen those: in the
 * caches 0.85-1.04x split, docs/performance.md "Items of 9 to 15 rows"). */
const kva_kernels kva_kernels_avx2[KVA_NUM_KINDS] = {
    KVA_KERNELS_ROWS(f32, avx2, 1.0f, 1, 0, 8, 8),
    KVA_KERNELS_ROWS(f16, avx2, 1.0f, 1, 0, 8, KVA_TILE_ROWS - 1),
    KVA_KERNELS_ROWS(bf16, avx2, 1.0f, 1, 0, 8, KVA_TILE_ROWS - 1),
    KVA_KERNELS_ROWS(e4m3, avx2, 256.0f, 1, 0, 8, 8), /* its loaders: value / 2^8 */
    KVA_KERNELS_ROWS(e5m2, avx2, 1.0f, 1, 0, 8, 8),
    KVA_KERNELS_ROWS(i8, avx2, 1.0f, 1, 0, 8, KVA_TILE_ROWS - 1),
};
KVA_TARGET static void scale_avx2(float *s, const float *w, float c, ptrdiff_t n,
                                  int weights)
{
    const __m256 vc = _mm256_set1_ps(c);
    ptrdiff_t i = 0;
    /* (the scalar loop's products, in its order: the same bits) */
    if (w == NULL)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), vc));
    else if (!weights)
        for (; i + 8 <= n; i += 8) {
            const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_loadu_ps(w + i));
            _mm256_storeu_ps(s + i, c == 1.0f ? p : _mm256_mul_ps(p, vc));
        }
    else if (c == 1.0f)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(s + i, flush_tiny_avx2(_mm256_mul_ps(_mm256_loadu_ps(s + i),
                                                                  _mm256_loadu_ps(w + i))));
    else
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(s + i, _mm256_mul_ps(flush_tiny_avx2(_mm256_mul_ps(
                                                      _mm256_loadu_ps(s + i),
                                                      _mm256_loadu_ps(w + i))),
                                                  vc));
    if (i < n)
        kva_scale_scalar(s + i, w == NULL ? NULL : w + i, c, n - i, weights);
}

const kva_math kva_math_avx2 = {row_max_avx2, row_exp_sum_avx2, softcap_avx2, exp2_neg_n_avx2,
                                scale_avx2, NULL, 0};
#endif /* KVA_HAVE_AVX2 */
