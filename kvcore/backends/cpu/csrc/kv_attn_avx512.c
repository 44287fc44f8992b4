/*
 * kv_attn_avx512.c: the AVX-512 (F + BW + VL + DQ) kernels of the attention
 * (x86-64): 16 floats per vector, 32 registers for wider register blocks.
 *
 * Like kv_attn_avx2.c, this file is compiled without any -m flags: every
 * function carries KVA_AVX512_TARGET and ends in _avx512, and the tables
 * are used only after the CPU (and the OS, for the zmm state) said it has
 * the instructions (kv_simd.h).
 *
 * head_dim is a multiple of 8 here (kv_attention.c sends other head_dims to
 * the scalar kernels); a last vector of 8 dims is read with a half-width
 * load, zero-extended, so every loop works on 16-lane vectors and no load
 * reads past a row.  There are no masked loads or stores: nothing would be
 * faster for these shapes, and the emulated build below need not trust an
 * emulation of fault suppression.
 *
 * Test build: tests/test_attention_avx512.py compiles this file a second
 * time with -DKVA_AVX512_SIMDE -DKVA_AVX512_TARGET= against SIMDe's
 * portable AVX-512 (https://github.com/simd-everywhere/simde, the simde-py
 * package), so the kernels run, and are checked, on a CPU without AVX-512;
 * on a CPU with AVX-512 the same checks also run natively (first on an AMD
 * EPYC, Zen 5, in December 2026).
 *
 * Scores: items of fewer than KVA_TILE_ROWS query rows (decode) take blocks
 * of rows x keys dotted along head_dim with horizontal sums; items of more
 * (prefill) transpose the key tile once and broadcast q elements over 16
 * keys per FMA, which needs no horizontal sums (causal prefill 1.7x faster
 * at head_dim 64 on a Zen 5: docs/performance.md).
 */
#include "kv_attn_internal.h"

#include <math.h>
#include <string.h>

#if KVA_HAVE_AVX512
#ifdef KVA_AVX512_SIMDE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#else
#include <immintrin.h>
#endif

#ifndef KVA_AVX512_TARGET
#define KVA_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif
#define KVA_INLINE static inline __attribute__((always_inline)) KVA_AVX512_TARGET

/* An internal kind of these kernels: e4m3fn read with its NaN blend. */
#define KVA_F8E4M3_NAN 6

/* The 16 (half: 8, the upper lanes 0) elements of `kind` at p, widened to
 * float32.  bf16: a 16-bit shift; e4m3fn: each byte, sign-extended to 16
 * bits, shifted left by 7 and bit 14 cleared, is a half of the byte's
 * sign, exponent and mantissa, the value times 2^-8 (the exponent biases
 * are 7 and 15), subnormals included: the 2^8 rides on q and the P.V
 * weights (kva_kernels.unit); KVA_F8E4M3_NAN also gives S.1111.111 the
 * half's all-ones exponent.  e5m2: the high byte of a half.  int8: the
 * code, unscaled. */
KVA_INLINE __m512 load16_avx512(const char *p, int kind, int half)
{
    if (kind == KVA_F32) {
        if (half)
            return _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps((const float *)p), 0);
        return _mm512_loadu_ps((const float *)p);
    }
    if (kind == KVA_F16 || kind == KVA_BF16) {
        __m256i w = half ? _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                   _mm_loadu_si128((const __m128i *)p), 0)
                         : _mm256_loadu_si256((const __m256i *)p);
        if (kind == KVA_F16)
            return _mm512_cvtph_ps(w);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    }
    __m128i b = half ? _mm_loadl_epi64((const __m128i *)p) : _mm_loadu_si128((const __m128i *)p);
    if (kind == KVA_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(b)));
    if (kind == KVA_F8E5M2)
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                 _mm256_set1_epi16((short)0xBF80));
    if (kind == KVA_F8E4M3_NAN) {
        __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(h, _mm256_set1_epi16((short)0x8000)),
                                         _mm256_set1_epi16((short)0xBF80));
        h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
    }
    return _mm512_cvtph_ps(h);
}

/* 16 (half: 8, the rest 0) floats at p. */
KVA_INLINE __m512 loadf_avx512(const float *p, int half)
{
    return load16_avx512((const char *)p, KVA_F32, half);
}

/* Store v's 16 (half: its first 8) lanes at p. */
KVA_INLINE void storef_avx512(float *p, __m512 v, int half)
{
    if (half)
        _mm256_storeu_ps(p, _mm512_castps512_ps256(v));
    else
        _mm512_storeu_ps(p, v);
}

/* The line of `next` (a row of the next tile, or NULL: none) at byte `off`,
 * when `off` starts a line of the row (every 64 bytes from its start): the
 * callers run it beside their load at `off` of the current row. */
KVA_INLINE void prefetch_at_avx512(const char *next, size_t off)
{
    if (next != NULL && (off & 63) == 0)
        __builtin_prefetch(next + off, 0, 3);
}

/* Whether any of rows[0..n-1] (D bytes each, D % 8 == 0) holds an e4m3fn
 * NaN code (0x7F or 0xFF): the unsigned max of every byte with its sign
 * bit set is 0xFF exactly then (the sign set before the max: 0x7F against
 * 0x80 must give 0xFF, not 0x80). */
KVA_INLINE int rows_have_e4m3_nan_avx512(const char *const *rows, int n, int D)
{
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    __m512i mx = _mm512_setzero_si512();
    __m128i mx8 = _mm_setzero_si128();
    for (int i = 0; i < n; i++) {
        const char *p = rows[i];
        int d = 0;
        for (; d + 64 <= D; d += 64)
            mx = _mm512_max_epu8(mx, _mm512_or_si512(_mm512_loadu_si512((const void *)(p + d)),
                                                     sign));
        for (; d < D; d += 8)
            mx8 = _mm_max_epu8(mx8, _mm_or_si128(_mm_loadl_epi64((const __m128i *)(p + d)),
                                                 _mm_set1_epi8((char)0x80)));
    }
    return _mm512_cmpeq_epi8_mask(mx, _mm512_set1_epi8((char)0xFF)) != 0 ||
           _mm_movemask_epi8(_mm_cmpeq_epi8(mx8, _mm_set1_epi8((char)0xFF))) != 0;
}

/* The 16 lanes of v added into 8: lane a is v[a] + v[a + 8]. */
KVA_INLINE __m256 fold_avx512(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

/* Lane a of the result is the sum of the 16 lanes of v[a] (a fixed order). */
KVA_INLINE __m256 hsum8x16_avx512(const __m512 *v)
{
    __m256 t0 = _mm256_hadd_ps(fold_avx512(v[0]), fold_avx512(v[1]));
    __m256 t1 = _mm256_hadd_ps(fold_avx512(v[2]), fold_avx512(v[3]));
    __m256 t2 = _mm256_hadd_ps(fold_avx512(v[4]), fold_avx512(v[5]));
    __m256 t3 = _mm256_hadd_ps(fold_avx512(v[6]), fold_avx512(v[7]));
    __m256 u0 = _mm256_hadd_ps(t0, t1); /* [0 1 2 3 | 0 1 2 3] halves */
    __m256 u1 = _mm256_hadd_ps(t2, t3); /* [4 5 6 7 | 4 5 6 7] halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

KVA_INLINE float hsum_avx512(__m512 v)
{
    __m256 f = fold_avx512(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KVA_INLINE float hmax_avx512(__m512 v)
{
    __m256 f = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/*
 * 2^x for x <= 0, the AVX2 kernels' method and polynomial on 16 lanes (so
 * the same accuracy: at most 0.95 ulp from the correctly rounded 2^x for
 * every result of 2^-126 and above; +0 below about 2^-126.5 and for -inf;
 * NaN stays NaN).  x = n + f, n = round(x), |f| <= 1/2; 2^f by a degree-6
 * minimax polynomial (FMAs), times 2^n built in the exponent field.
 */
KVA_INLINE __m512 exp2_neg_avx512(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-127.0f), x); /* NaN passes (second operand) */
    x = _mm512_min_ps(_mm512_set1_ps(0.0f), x);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.534581243e-04f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339993090e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618489072e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550328642e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264625e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471825e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                  23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/*
 * tanh(x), as the AVX2 kernels compute it: for |x| < 0.3 its odd Taylor
 * polynomial to x^13 (the next term is below 1e-9 relative there);
 * otherwise sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.55, where
 * no cancellation occurs.
 */
KVA_INLINE __m512 tanh_avx512(__m512 x)
{
    const __m512 sign_mask = _mm512_set1_ps(-0.0f);
    __m512 ax = _mm512_andnot_ps(sign_mask, x);
    __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps((float)(21844.0 / 6081075.0));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps((float)(-1382.0 / 155925.0)));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps((float)(62.0 / 2835.0)));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps((float)(-17.0 / 315.0)));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps((float)(2.0 / 15.0)));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps((float)(-1.0 / 3.0)));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, x2), x, x);
    __m512 e = exp2_neg_avx512(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f * KVA_LOG2E)));
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    big = _mm512_or_ps(big, _mm512_and_ps(x, sign_mask));
    __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.3f), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(is_small, big, small);
}

/* RB query rows x KB keys of the score tile: RB * KB == 8 or 16
 * accumulators of 16 lanes (of 32 registers, with KB key vectors). */
KVA_INLINE void dot_block_avx512(const float *Qs, int D, const char *const *krow, int kind,
                                 int RB, int KB, int r, int i, float *S, const char *const *nk)
{
    const int isz = kva_isz(kind);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < 16; a++)
        acc[a] = _mm512_setzero_ps();
    const float *q0 = Qs + (size_t)r * D;
    for (int d = 0; d < D; d += 16) {
        const int half = D - d < 16; /* the last 8 dims of a head_dim of 16 k + 8 */
        __m512 kv[8];
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++) {
            kv[kb] = load16_avx512(krow[i + kb] + (size_t)d * isz, kind, half);
            prefetch_at_avx512(nk != NULL ? nk[i + kb] : NULL, (size_t)d * isz);
        }
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            __m512 qv = loadf_avx512(q0 + (size_t)rb * D + d, half);
#ifndef KVA_AVX512_SIMDE
            /* one load per q vector, reused for the KB keys (GCC would
             * otherwise fold a load into every FMA) */
            __asm__("" : "+v"(qv));
#endif
#pragma GCC unroll 8
            for (int kb = 0; kb < KB; kb++)
                acc[rb * KB + kb] = _mm512_fmadd_ps(qv, kv[kb], acc[rb * KB + kb]);
        }
    }
    float sums[16];
    _mm256_storeu_ps(sums, hsum8x16_avx512(acc));
    if (RB * KB > 8)
        _mm256_storeu_ps(sums + 8, hsum8x16_avx512(acc + 8));
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++)
            S[(r + rb) * KVA_KEY_TILE + i + kb] = sums[rb * KB + kb];
}

/* Transpose the 16 x 16 floats of r in place (lane j of r[i] becomes lane i
 * of r[j]): pairs of rows interleaved, then quads of rows, then their
 * 128-bit lanes moved twice. */
KVA_INLINE void transpose16_avx512(__m512 *r)
{
    __m512 t[16], u[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4m + c], 128-bit lane q: rows 4m .. 4m + 3 of column 4q + c */
#pragma GCC unroll 4
    for (int m = 0; m < 16; m += 4) {
        u[m] = _mm512_shuffle_ps(t[m], t[m + 2], 0x44);
        u[m + 1] = _mm512_shuffle_ps(t[m], t[m + 2], 0xEE);
        u[m + 2] = _mm512_shuffle_ps(t[m + 1], t[m + 3], 0x44);
        u[m + 3] = _mm512_shuffle_ps(t[m + 1], t[m + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512 v = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
        __m512 w = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        __m512 x = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        __m512 y = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(v, x, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(w, y, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(v, x, 0xDD);
        r[12 + c] = _mm512_shuffle_f32x4(w, y, 0xDD);
    }
}

/* Kt[d * KVA_KEY_TILE + i] = element d of key row i (i < ntp, ntp % 8 == 0;
 * the lanes past ntp of a last 8 keys are 0): the tile transposed, 16 x 16
 * floats at a time. */
KVA_INLINE void transpose_keys_avx512(int kind, const char *const *krow, int ntp, int D,
                                      float *Kt, const char *const *nk)
{
    const int isz = kva_isz(kind);
    for (int i0 = 0; i0 < ntp; i0 += 16) {
        const int nb = ntp - i0 < 16 ? ntp - i0 : 16;
        for (int d = 0; d < D; d += 16) {
            const int half = D - d < 16;
            __m512 r[16];
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                r[k] = k < nb ? load16_avx512(krow[i0 + k] + (size_t)d * isz, kind, half)
                              : _mm512_setzero_ps();
                if (k < nb)
                    prefetch_at_avx512(nk != NULL ? nk[i0 + k] : NULL, (size_t)d * isz);
            }
            transpose16_avx512(r);
            for (int k = 0; k < (half ? 8 : 16); k++)
                _mm512_storeu_ps(Kt + (size_t)(d + k) * KVA_KEY_TILE + i0, r[k]);
        }
    }
}

/* S[(r + rb) * KVA_KEY_TILE + 16 v + j] for rb < RB, v < NV, j < 16: query
 * row r + rb times the transposed keys, one dim at a time (each q element
 * broadcast, an FMA per 16 keys: no horizontal sums). */
KVA_INLINE void qk_rows_avx512(const float *Qs, int D, const float *Kt, int RB, int NV, int r,
                               float *S)
{
    __m512 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < RB * NV; a++)
        acc[a] = _mm512_setzero_ps();
    const float *q = Qs + (size_t)r * D;
    for (int d = 0; d < D; d++) {
        const float *k = Kt + (size_t)d * KVA_KEY_TILE;
        const __m512 k0 = _mm512_loadu_ps(k);
        const __m512 k1 = NV > 1 ? _mm512_loadu_ps(k + 16) : k0;
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            const __m512 qb = _mm512_set1_ps(q[(size_t)rb * D + d]);
            acc[rb * NV] = _mm512_fmadd_ps(qb, k0, acc[rb * NV]);
            if (NV > 1)
                acc[rb * NV + 1] = _mm512_fmadd_ps(qb, k1, acc[rb * NV + 1]);
        }
    }
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            _mm512_storeu_ps(S + (size_t)(r + rb) * KVA_KEY_TILE + 16 * v, acc[rb * NV + v]);
}

/* Every row of S over NV vectors of 16 transposed keys: 8 rows at a time,
 * then the last 1-7 in one block (a row on its own is two FMA chains
 * waiting on their latency: 4x the time per row of a block of 8; a GQA
 * group of 3 leaves 7 of its 63 rows). */
KVA_INLINE void qk_all_rows_avx512(const float *Qs, int M, int D, const float *Kt, int NV,
                                   float *S)
{
    int r = 0;
    for (; r + 8 <= M; r += 8)
        qk_rows_avx512(Qs, D, Kt, 8, NV, r, S);
    switch (M - r) { /* (constant block sizes: each one unrolled) */
    case 7: qk_rows_avx512(Qs, D, Kt, 7, NV, r, S); break;
    case 6: qk_rows_avx512(Qs, D, Kt, 6, NV, r, S); break;
    case 5: qk_rows_avx512(Qs, D, Kt, 5, NV, r, S); break;
    case 4: qk_rows_avx512(Qs, D, Kt, 4, NV, r, S); break;
    case 3: qk_rows_avx512(Qs, D, Kt, 3, NV, r, S); break;
    case 2: qk_rows_avx512(Qs, D, Kt, 2, NV, r, S); break;
    case 1: qk_rows_avx512(Qs, D, Kt, 1, NV, r, S); break;
    default: break;
    }
}

KVA_INLINE void scores_avx512(int kind, const float *Qs, int M, int D, const char *const *krow,
                              int ntp, float *S, float *tmp, const char *const *nk)
{
    /* KVA_TILE_ROWS rows or more (a prefill's): the key tile transposed into
     * tmp once (KVA_KEY_TILE * D floats), then 8 rows x 32 keys of FMAs at a
     * time; each score is the float32 FMA chain over d in order */
    if (M >= KVA_TILE_ROWS) {
        transpose_keys_avx512(kind, krow, ntp, D, tmp, nk);
        for (int c = 0; c < ntp; c += 32) {
            if (ntp - c > 16) /* (a constant NV: the blocks unroll) */
                qk_all_rows_avx512(Qs, M, D, tmp + c, 2, S + c);
            else
                qk_all_rows_avx512(Qs, M, D, tmp + c, 1, S + c);
        }
        return;
    }
    /* the first block of rows prefetches the next tile's keys (nk) */
    int r = 0;
    for (; r + 4 <= M; r += 4)
        for (int i = 0; i < ntp; i += 4)
            dot_block_avx512(Qs, D, krow, kind, 4, 4, r, i, S, r == 0 ? nk : NULL);
    if (M - r == 3) { /* a GQA group of 3 (SmolLM2's): one pass over the keys */
        for (int i = 0; i < ntp; i += 4)
            dot_block_avx512(Qs, D, krow, kind, 3, 4, r, i, S, r == 0 ? nk : NULL);
        return;
    }
    if (r + 2 <= M) {
        for (int i = 0; i < ntp; i += 8)
            dot_block_avx512(Qs, D, krow, kind, 2, 8, r, i, S, r == 0 ? nk : NULL);
        r += 2;
    }
    if (r < M)
        for (int i = 0; i < ntp; i += 8)
            dot_block_avx512(Qs, D, krow, kind, 1, 8, r, i, S, r == 0 ? nk : NULL);
}

/* RB rows x DB vectors of 16 dims of the accumulator (half: one vector of
 * 8), over nt keys. */
KVA_INLINE void pv_block_avx512(const float *P, int D, const char *const *vrow, int nt, int kind,
                                int RB, int DB, int half, int r, int d, float *acc,
                                const float *alpha, const char *const *nv)
{
    const int isz = kva_isz(kind);
    __m512 a[16];
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++) {
        __m512 al = _mm512_set1_ps(alpha[r + rb]);
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            a[rb * DB + db] =
                _mm512_mul_ps(loadf_avx512(acc + (size_t)(r + rb) * D + d + db * 16, half), al);
    }
    const size_t off = (size_t)d * isz;
    for (int i = 0; i < nt; i++) {
        __m512 v[8];
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++) {
            v[db] = load16_avx512(vrow[i] + off + (size_t)db * 16 * isz, kind, half);
            prefetch_at_avx512(nv != NULL ? nv[i] : NULL, off + (size_t)db * 16 * isz);
        }
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            __m512 p = _mm512_set1_ps(P[(r + rb) * KVA_KEY_TILE + i]);
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++)
                a[rb * DB + db] = _mm512_fmadd_ps(p, v[db], a[rb * DB + db]);
        }
    }
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            storef_avx512(acc + (size_t)(r + rb) * D + d + db * 16, a[rb * DB + db], half);
}

/* Rows r .. r + RB - 1: DB vectors at a time, then 4, 2 and single vectors
 * (each a pass over the keys: as few as head_dim allows), then the last 8
 * dims. */
KVA_INLINE void pv_rows_avx512(const float *P, int D, const char *const *vrow, int nt, int kind,
                               int RB, int DB, int r, float *acc, const float *alpha,
                               const char *const *nv)
{
    int d = 0;
    for (; d + 16 * DB <= D; d += 16 * DB)
        pv_block_avx512(P, D, vrow, nt, kind, RB, DB, 0, r, d, acc, alpha, nv);
    if (DB > 4)
        for (; d + 64 <= D; d += 64)
            pv_block_avx512(P, D, vrow, nt, kind, RB, 4, 0, r, d, acc, alpha, nv);
    if (DB > 2)
        for (; d + 32 <= D; d += 32)
            pv_block_avx512(P, D, vrow, nt, kind, RB, 2, 0, r, d, acc, alpha, nv);
    for (; d + 16 <= D; d += 16)
        pv_block_avx512(P, D, vrow, nt, kind, RB, 1, 0, r, d, acc, alpha, nv);
    if (d < D)
        pv_block_avx512(P, D, vrow, nt, kind, RB, 1, 1, r, d, acc, alpha, nv);
}

/* The first block of rows prefetches the next tile's values (nv). */
KVA_INLINE void pv_avx512(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                          float *acc, const float *alpha, const char *const *nv)
{
    int r = 0;
    for (; r + 4 <= M; r += 4)
        pv_rows_avx512(P, D, vrow, nt, kind, 4, 4, r, acc, alpha, r == 0 ? nv : NULL);
    if (M - r == 3) { /* a GQA group of 3: one pass over the keys */
        pv_rows_avx512(P, D, vrow, nt, kind, 3, 4, r, acc, alpha, r == 0 ? nv : NULL);
        return;
    }
    if (r + 2 <= M) {
        pv_rows_avx512(P, D, vrow, nt, kind, 2, 8, r, acc, alpha, r == 0 ? nv : NULL);
        r += 2;
    }
    if (r < M)
        pv_rows_avx512(P, D, vrow, nt, kind, 1, 8, r, acc, alpha, r == 0 ? nv : NULL);
}

KVA_INLINE void widen_avx512(int kind, const char *const *rows, int n, int D, float *dst,
                             const char *const *next)
{
    const int isz = kva_isz(kind);
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d += 16) {
            const int half = D - d < 16;
            prefetch_at_avx512(next != NULL ? next[i] : NULL, (size_t)d * isz);
            storef_avx512(dst + (size_t)i * D + d,
                          load16_avx512(rows[i] + (size_t)d * isz, kind, half), half);
        }
}

#define KVA_AVX512_KIND(name, kind)                                                          \
    KVA_AVX512_TARGET static void widen_##name##_avx512(const char *const *rows, int n,       \
                                                        int D, float *dst,                    \
                                                        const char *const *next)              \
    {                                                                                         \
        widen_avx512(kind, rows, n, D, dst, next);                                            \
    }                                                                                         \
    KVA_AVX512_TARGET static void scores_##name##_avx512(                                     \
        const float *Qs, int M, int D, const char *const *krow, int ntp, float *S, float *t,  \
        const char *const *next)                                                              \
    {                                                                                         \
        scores_avx512(kind, Qs, M, D, krow, ntp, S, t, next);                                 \
    }                                                                                         \
    KVA_AVX512_TARGET static void pv_##name##_avx512(                                         \
        const float *P, int M, int D, const char *const *vrow, int nt, float *acc,            \
        const float *alpha, float *t, const char *const *next)                                \
    {                                                                                         \
        (void)t;                                                                              \
        pv_avx512(kind, P, M, D, vrow, nt, acc, alpha, next);                                 \
    }
KVA_AVX512_KIND(f32, KVA_F32)
KVA_AVX512_KIND(f16, KVA_F16)
KVA_AVX512_KIND(bf16, KVA_BF16)
KVA_AVX512_KIND(e5m2, KVA_F8E5M2)
KVA_AVX512_KIND(i8, KVA_I8)

/* e4m3fn: the tile's rows are searched for NaN codes once; only a tile
 * that holds one pays for the NaN blend of every 16 elements. */
KVA_AVX512_TARGET static void widen_e4m3_avx512(const char *const *rows, int n, int D,
                                                float *dst, const char *const *next)
{
    const int kind = rows_have_e4m3_nan_avx512(rows, n, D) ? KVA_F8E4M3_NAN : KVA_F8E4M3;
    widen_avx512(kind, rows, n, D, dst, next);
}

KVA_AVX512_TARGET static void scores_e4m3_avx512(const float *Qs, int M, int D,
                                                 const char *const *krow, int ntp, float *S,
                                                 float *t, const char *const *next)
{
    const int kind = rows_have_e4m3_nan_avx512(krow, ntp, D) ? KVA_F8E4M3_NAN : KVA_F8E4M3;
    scores_avx512(kind, Qs, M, D, krow, ntp, S, t, next);
}

KVA_AVX512_TARGET static void pv_e4m3_avx512(const float *P, int M, int D,
                                             const char *const *vrow, int nt, float *acc,
                                             const float *alpha, float *t,
                                             const char *const *next)
{
    (void)t;
    const int kind = rows_have_e4m3_nan_avx512(vrow, nt, D) ? KVA_F8E4M3_NAN : KVA_F8E4M3;
    pv_avx512(kind, P, M, D, vrow, nt, acc, alpha, next);
}

/* ntp % 8 == 0: the last 8 of a count of 16 k + 8 read with -inf above. */
KVA_INLINE __m512 load_scores_avx512(const float *s, int i, int ntp)
{
    if (ntp - i < 16)
        return _mm512_insertf32x8(_mm512_set1_ps(-INFINITY), _mm256_loadu_ps(s + i), 0);
    return _mm512_loadu_ps(s + i);
}

KVA_AVX512_TARGET static float row_max_avx512(const float *s, int ntp)
{
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < ntp; i += 16)
        m = _mm512_max_ps(m, load_scores_avx512(s, i, ntp));
    return hmax_avx512(m);
}

KVA_AVX512_TARGET static float row_exp_sum_avx512(float *s, int ntp, float mx)
{
    __m512 m = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
    for (int i = 0; i < ntp; i += 16) {
        /* a padding lane is exp2(-inf) = 0: the sum is that of the ntp */
        __m512 e = exp2_neg_avx512(_mm512_sub_ps(load_scores_avx512(s, i, ntp), m));
        storef_avx512(s + i, e, ntp - i < 16);
        sum = _mm512_add_ps(sum, e);
    }
    return hsum_avx512(sum);
}

KVA_AVX512_TARGET static void softcap_avx512(float *s, ptrdiff_t n, float a, float b)
{
    __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(s + i,
                         _mm512_mul_ps(vb, tanh_avx512(_mm512_mul_ps(va, _mm512_loadu_ps(s + i)))));
    if (i < n) {
        float t[16] = {0};
        memcpy(t, s + i, (size_t)(n - i) * 4);
        _mm512_storeu_ps(t, _mm512_mul_ps(vb, tanh_avx512(_mm512_mul_ps(va, _mm512_loadu_ps(t)))));
        memcpy(s + i, t, (size_t)(n - i) * 4);
    }
}

KVA_AVX512_TARGET static void exp2_neg_n_avx512(const float *x, float *y, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, exp2_neg_avx512(_mm512_loadu_ps(x + i)));
    if (i < n) {
        float t[16] = {0};
        memcpy(t, x + i, (size_t)(n - i) * 4);
        _mm512_storeu_ps(t, exp2_neg_avx512(_mm512_loadu_ps(t)));
        memcpy(y + i, t, (size_t)(n - i) * 4);
    }
}

const kva_kernels kva_kernels_avx512[KVA_NUM_KINDS] = {
    KVA_KERNELS(f32, avx512, 1.0f, 1, 1),
    KVA_KERNELS(f16, avx512, 1.0f, 1, 1),
    KVA_KERNELS(bf16, avx512, 1.0f, 1, 1),
    KVA_KERNELS(e4m3, avx512, 256.0f, 1, 1), /* value / 2^8 */
    KVA_KERNELS(e5m2, avx512, 1.0f, 1, 1),
    KVA_KERNELS(i8, avx512, 1.0f, 1, 1),
};
const kva_math kva_math_avx512 = {row_max_avx512, row_exp_sum_avx512, softcap_avx512,
                                  exp2_neg_n_avx512};
#endif /* KVA_HAVE_AVX512 */
