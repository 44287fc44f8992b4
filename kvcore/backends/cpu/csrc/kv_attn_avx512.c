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
 * Test build: tests/attention/test_attention_avx512.py compiles this file a second
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
#ifdef KVA_AVX512_SIMDE
/* the SIMDe test build: the compiler's own inlining (forcing it, the
 * emulated intrinsics of every kernel shape take many minutes to compile) */
#define KVA_INLINE static inline KVA_AVX512_TARGET
#else
#define KVA_INLINE static inline __attribute__((always_inline)) KVA_AVX512_TARGET
#endif

/* Internal kinds of these kernels: e4m3fn read with its NaN blend; e4m3fn
 * read without it while every 64-byte line read is searched for the NaN
 * codes (decode blocks of head_dim 64 or 128: a block that finds one is
 * computed again with the blend, its results not stored before).
 * (e4m3fn is read as halves, never as float32 bits: that reading, value /
 * 2^120, makes each subnormal code a float32 subnormal, and an FMA taking
 * one costs ~128 cycles on an Intel Xeon with AMX against half a cycle: a
 * decode over fp8 pages holding subnormal codes (near-zero values) ran
 * 53-73x slower there.  docs/performance.md, "Subnormal floats".) */
#define KVA_F8E4M3_NAN 6
#define KVA_F8E4M3_CHK 7

/* The kind a checking kind (KVA_F8E4M3_CHK) loads with; others: itself. */
static inline int chk_load_kind(int kind)
{
    return kind == KVA_F8E4M3_CHK ? KVA_F8E4M3 : kind;
}

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

/* The 32 elements of `kind` at p, widened to float32 as load16_avx512
 * does, into o[0] (the first 16) and o[1]: the 8-bit kinds are widened to
 * 16 bits 32 at a time (one sign or zero extension, one shift, one mask
 * for 32 elements, then two conversions), 3 instructions per 16 elements
 * for e4m3fn where load16_avx512 takes 4. */
KVA_INLINE void load32_avx512(const char *p, int kind, __m512 *o)
{
    if (kind == KVA_F32 || kind == KVA_F16 || kind == KVA_BF16 || kind == KVA_I8) {
        o[0] = load16_avx512(p, kind, 0);
        o[1] = load16_avx512(p + 16 * kva_isz(kind), kind, 0);
        return;
    }
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    __m512i h;
    if (kind == KVA_F8E5M2) { /* (the shift drops the extended sign) */
        h = _mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 8);
    } else {
        h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                             _mm512_set1_epi16((short)0xBF80));
        if (kind == KVA_F8E4M3_NAN) {
            const __mmask32 nan = _mm512_cmpeq_epu16_mask(
                _mm512_or_si512(h, _mm512_set1_epi16((short)0x8000)),
                _mm512_set1_epi16((short)0xBF80));
            h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7C00)));
        }
    }
    o[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    o[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
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

/* A line of the next tile's rows, prefetched beside the load of the same
 * line of this tile's (kva_kernels: `next`): into L2 (prefetcht1) where
 * to_l2, else into L1.  Rows of 128 bytes or less (KVA_NEXT_TO_L2: every
 * 8-bit page up to head_dim 128, 16-bit ones up to 64) and the rows widened
 * into a float32 tile take L2: out of the caches 4-11% faster on an AMX
 * Xeon, in them no slower.  Longer rows read as they are keep L1, whose
 * hits they need where the pages sit in L2 (float16 at head_dim 128: 3-6%
 * slower there with L2); so do the avx2 kernels (up to 5% slower in the
 * caches with L2).  docs/performance.md, "Prefetching into L2". */
#define KVA_NEXT_TO_L2(isz, D) ((size_t)(D) * (size_t)(isz) <= 128)
KVA_INLINE void prefetch_next_avx512(const void *p, int to_l2)
{
    if (to_l2)
        __builtin_prefetch(p, 0, 2);
    else
        __builtin_prefetch(p, 0, 3);
}

/* The line of `next` (a row of the next tile, or NULL: none) at byte `off`,
 * when `off` starts a line of the row (every 64 bytes from its start), into
 * L2: the callers (a tile widened or transposed into float32) run it
 * beside their load at `off` of the current row. */
KVA_INLINE void prefetch_at_avx512(const char *next, size_t off)
{
    if (next != NULL && (off & 63) == 0)
        prefetch_next_avx512(next + off, 1);
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
 * every result of 2^-126 and above; +0 below 2^-126, never a subnormal
 * (kva_flush_tiny), and for -inf; NaN stays NaN).  x = n + f, n = round(x),
 * |f| <= 1/2; 2^f by a degree-6 minimax polynomial (FMAs), times 2^n
 * (vscalefps).
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
    /* p times 2^n (n in [-126, 0]: the one rounding of p * 2^n, as a
     * multiplication by 2^n's bits gives; one instruction where the
     * exponent's bits took four: the same bits for every float x, checked
     * over all 2^32); x < -126: +0 (the not-less-than compare is true for
     * NaN, kept) */
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ), p,
                                  n);
}

/* v with every lane of magnitude below 2^-126 made +0 (kva_flush_tiny):
 * the lanes whose exponent field is 0 (zeros and subnormals), two
 * instructions. */
KVA_INLINE __m512 flush_tiny_avx512(__m512 v)
{
    return _mm512_maskz_mov_ps(
        _mm512_test_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x7F800000)), v);
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

/* ------------------------------------------------------------------ */
/* Decode-like items (fewer than KVA_TILE_ROWS rows): memory-bound when  */
/* the pages come from DRAM, so every instruction that is not a load or  */
/* an FMA is taken out of the loop over the keys: head_dim 64 and 128    */
/* are compile-time constants (every load, prefetch and half-vector test */
/* resolved), the kind is a constant (e4m3fn's NaN search picks one of   */
/* two bodies, not a test per load), the prefetch of the next tile is    */
/* its own body, and the RB x KB dot products of a block are summed      */
/* across their lanes by one transpose-and-add tree (2.8 instructions a  */
/* sum for 16, against 4 for the pairwise hadd of hsum8x16).             */
/* ------------------------------------------------------------------ */

/* Lane j of the result: the sum of the 16 lanes of v[j] for j < n (n a
 * constant, at most 16; the other lanes 0).  Pairs of vectors are
 * interleaved and added within their 128-bit lanes twice (4 sums per
 * 128-bit lane), then the 128-bit lanes are added pairwise twice; a fixed
 * order, so the same bits every call. */
KVA_INLINE __m512 reduce16_avx512(const __m512 *v, int n)
{
    const __m512 z = _mm512_setzero_ps();
    __m512 t[8], u[4], w[2];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        if (2 * k >= n) {
            t[k] = z;
            continue;
        }
        const __m512 a = v[2 * k], b = 2 * k + 1 < n ? v[2 * k + 1] : z;
        /* 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] */
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) /* 128-bit lane: the lane's sums of v[4k .. 4k + 3] */
        u[k] = 4 * k >= n ? z
                          : _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                                          _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) /* [u0 lanes 0+1, u0 lanes 2+3, u1 lanes 0+1, u1 lanes 2+3] */
        w[k] = 8 * k >= n ? z
                          : _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                                          _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* S[(r + rb) * KVA_KEY_TILE + i + kb] = lane rb * KB + kb of res. */
KVA_INLINE void store_block_avx512(float *S, int r, int i, __m512 res, int RB, int KB)
{
    float *s = S + (size_t)r * KVA_KEY_TILE + i;
    if (KB == 8) {
        _mm256_storeu_ps(s, _mm512_castps512_ps256(res));
        if (RB > 1)
            _mm256_storeu_ps(s + KVA_KEY_TILE, _mm512_extractf32x8_ps(res, 1));
    } else if (KB == 4) {
        _mm_storeu_ps(s, _mm512_castps512_ps128(res));
        if (RB > 1)
            _mm_storeu_ps(s + KVA_KEY_TILE, _mm512_extractf32x4_ps(res, 1));
        if (RB > 2)
            _mm_storeu_ps(s + 2 * KVA_KEY_TILE, _mm512_extractf32x4_ps(res, 2));
        if (RB > 3)
            _mm_storeu_ps(s + 3 * KVA_KEY_TILE, _mm512_extractf32x4_ps(res, 3));
    } else { /* KB 2, RB <= 8 */
        float l[16];
        _mm512_storeu_ps(l, res);
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            s[rb * KVA_KEY_TILE] = l[2 * rb];
            s[rb * KVA_KEY_TILE + 1] = l[2 * rb + 1];
        }
    }
}

/* An e4m3fn line (64 codes at p) folded into the NaN search of a block:
 * the unsigned max of its bytes with the sign bit set is 0xFF exactly
 * when one is a NaN code (0x7F or 0xFF). */
KVA_INLINE __m512i nan_fold_avx512(__m512i mx, const char *p)
{
    return _mm512_max_epu8(mx, _mm512_or_si512(_mm512_loadu_si512((const void *)p),
                                               _mm512_set1_epi8((char)0x80)));
}

KVA_INLINE int nan_found_avx512(__m512i mx)
{
    return _mm512_cmpeq_epi8_mask(mx, _mm512_set1_epi8((char)0xFF)) != 0;
}

/* acc[rb * KB + kb] += q[r + rb][16 v ..] * kv[kb], for the RB rows. */
KVA_INLINE void dot_fma_avx512(__m512 *acc, const __m512 *kv, const float *q0, int D, int RB,
                               int KB, int v, int half)
{
    if (RB < 1 || KB < 1 || KB > 8 || RB * KB > 16)
        __builtin_unreachable(); /* (the callers' shapes; for the compiler's bounds) */
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++) {
        __m512 qv = loadf_avx512(q0 + (size_t)rb * D + 16 * v, half);
#ifndef KVA_AVX512_SIMDE
        __asm__("" : "+v"(qv)); /* one load per q vector, reused for the KB keys */
#endif
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++)
            acc[rb * KB + kb] = _mm512_fmadd_ps(qv, kv[kb], acc[rb * KB + kb]);
    }
}

/* One step of dec_dot_avx512: the KB keys' vector v (pair: vectors v and
 * v + 1, an 8-bit kind widened 32 elements at a time) into the RB x KB
 * accumulators, with the prefetch and the NaN search of the lines it
 * starts. */
KVA_INLINE void dec_step_avx512(__m512 *acc, __m512i *mx, const char *const *kp,
                                const char *const *np, const float *q0, int D, int lk, int chk,
                                int RB, int KB, int v, int pair, int half, int PF)
{
    const size_t off = (size_t)v * 16 * kva_isz(lk);
    __m512 kv[8], kw[8];
#pragma GCC unroll 8
    for (int kb = 0; kb < KB; kb++) {
        if (pair) {
            __m512 two[2];
            load32_avx512(kp[kb] + off, lk, two);
            kv[kb] = two[0];
            kw[kb] = two[1];
        } else {
            kv[kb] = load16_avx512(kp[kb] + off, lk, half);
        }
        if (PF && (off & 63) == 0)
            prefetch_next_avx512(np[kb] + off, KVA_NEXT_TO_L2(kva_isz(lk), D));
        if (chk && (off & 63) == 0)
            *mx = nan_fold_avx512(*mx, kp[kb] + off);
    }
    dot_fma_avx512(acc, kv, q0, D, RB, KB, v, half);
    if (pair)
        dot_fma_avx512(acc, kw, q0, D, RB, KB, v + 1, 0);
}

/* RB query rows x KB keys (RB * KB <= 16) of a decode score tile, over NV
 * vectors of 16 dims and (tail) a last one of 8; PF: each line of the next
 * tile's rows nk[i + kb] is prefetched beside the load of the same line.
 * CONST: NV is a constant (the loops unroll whole), else a run-time count
 * (the loops stay loops: one body per call shape).  The 8-bit kinds are
 * widened 32 elements at a time where the registers allow (KB <= 4 or a
 * single row: 2 KB widened vectors beside RB * KB accumulators).
 * KVA_F8E4M3_CHK (rows of whole lines): returns 1 when a key holds a NaN
 * code (its scores are then to be computed again with the blend); else 0. */
KVA_INLINE int dec_dot_avx512(const float *Qs, int D, const char *const *krow, int kind, int NV,
                              int tail, int RB, int KB, int r, int i, float *S,
                              const char *const *nk, int PF, int CONST)
{
    const int chk = kind == KVA_F8E4M3_CHK, lk = chk_load_kind(kind);
    const int pairs = kva_isz(lk) == 1 && (KB <= 4 || RB == 1);
    if (RB < 1 || KB < 1 || KB > 8 || RB * KB > 16)
        __builtin_unreachable(); /* (the callers' shapes; for the compiler's bounds) */
    __m512 acc[16];
    __m512i mx = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int a = 0; a < RB * KB; a++)
        acc[a] = _mm512_setzero_ps();
    const char *kp[8] = {NULL}, *np[8] = {NULL};
#pragma GCC unroll 8
    for (int kb = 0; kb < KB; kb++) {
        kp[kb] = krow[i + kb];
        np[kb] = PF ? nk[i + kb] : NULL;
    }
    const float *q0 = Qs + (size_t)r * D;
    int v = 0;
    if (CONST) {
        if (pairs) {
#pragma GCC unroll 4
            for (; v + 2 <= NV; v += 2)
                dec_step_avx512(acc, &mx, kp, np, q0, D, lk, chk, RB, KB, v, 1, 0, PF);
        }
#pragma GCC unroll 8
        for (; v < NV; v++)
            dec_step_avx512(acc, &mx, kp, np, q0, D, lk, chk, RB, KB, v, 0, 0, PF);
    } else {
        if (pairs)
            for (; v + 2 <= NV; v += 2)
                dec_step_avx512(acc, &mx, kp, np, q0, D, lk, chk, RB, KB, v, 1, 0, PF);
        for (; v < NV; v++)
            dec_step_avx512(acc, &mx, kp, np, q0, D, lk, chk, RB, KB, v, 0, 0, PF);
    }
    if (tail)
        dec_step_avx512(acc, &mx, kp, np, q0, D, lk, chk, RB, KB, NV, 0, 1, PF);
    /* (stored either way: an early return lets the compiler hoist the
     * search before the FMAs, and with it every q load, which spills) */
    store_block_avx512(S, r, i, reduce16_avx512(acc, RB * KB), RB, KB);
    return chk && nan_found_avx512(mx);
}

/* A decode score block whose keys hold an e4m3fn NaN code (rare: out of
 * the loop), computed with the NaN blend. */
KVA_AVX512_TARGET __attribute__((noinline)) static void
dec_dot_nan_avx512(const float *Qs, int D, const char *const *krow, int RB, int KB, int r, int i,
                   float *S)
{
    const int NV = D / 16, tail = (D % 16) != 0, k = KVA_F8E4M3_NAN;
    switch (RB * 16 + KB) {
    case 1 * 16 + 8: dec_dot_avx512(Qs, D, krow, k, NV, tail, 1, 8, r, i, S, NULL, 0, 0); break;
    case 2 * 16 + 8: dec_dot_avx512(Qs, D, krow, k, NV, tail, 2, 8, r, i, S, NULL, 0, 0); break;
    case 3 * 16 + 4: dec_dot_avx512(Qs, D, krow, k, NV, tail, 3, 4, r, i, S, NULL, 0, 0); break;
    case 5 * 16 + 2: dec_dot_avx512(Qs, D, krow, k, NV, tail, 5, 2, r, i, S, NULL, 0, 0); break;
    case 6 * 16 + 2: dec_dot_avx512(Qs, D, krow, k, NV, tail, 6, 2, r, i, S, NULL, 0, 0); break;
    case 7 * 16 + 2: dec_dot_avx512(Qs, D, krow, k, NV, tail, 7, 2, r, i, S, NULL, 0, 0); break;
    case 8 * 16 + 2: dec_dot_avx512(Qs, D, krow, k, NV, tail, 8, 2, r, i, S, NULL, 0, 0); break;
    default: dec_dot_avx512(Qs, D, krow, k, NV, tail, 4, 4, r, i, S, NULL, 0, 0); break;
    }
}

/* Rows r .. r + RB - 1 over every key of the tile, KB keys a block. */
KVA_INLINE void dec_rows_avx512(const float *Qs, int D, const char *const *krow, int ntp,
                                int kind, int NV, int tail, int RB, int KB, int r, float *S,
                                const char *const *nk, int PF, int CONST)
{
    for (int i = 0; i < ntp; i += KB)
        if (dec_dot_avx512(Qs, D, krow, kind, NV, tail, RB, KB, r, i, S, nk, PF, CONST))
            dec_dot_nan_avx512(Qs, D, krow, RB, KB, r, i, S);
}

/* A decode score tile, M < KVA_TILE_ROWS rows: one block of rows for M <= 4
 * (each key widened once), else blocks of 4. */
KVA_INLINE void dec_scores_pf_avx512(int kind, int NV, int tail, const float *Qs, int M, int D,
                                     const char *const *krow, int ntp, float *S,
                                     const char *const *nk)
{
    /* the first block of rows prefetches the next tile (the last tile: its
     * own rows, in the cache) */
    const char *const *pk = nk != NULL ? nk : krow;
    int r = 0;
    for (; M - r > 4; r += 4) {
        if (r == 0)
            dec_rows_avx512(Qs, D, krow, ntp, kind, NV, tail, 4, 4, r, S, pk, 1, 0);
        else
            dec_rows_avx512(Qs, D, krow, ntp, kind, NV, tail, 4, 4, r, S, NULL, 0, 0);
    }
    switch (M - r) {
    case 1: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, tail, 1, 8, r, S, pk, 1, 0); break;
    case 2: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, tail, 2, 8, r, S, pk, 1, 0); break;
    case 3: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, tail, 3, 4, r, S, pk, 1, 0); break;
    case 4: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, tail, 4, 4, r, S, pk, 1, 0); break;
    default: break;
    }
}

/* Whether a decode call of `kind`, M rows and head_dim D runs bodies with
 * D a constant: head_dims 64 and 128, M <= 4 (the rows of one GQA group of
 * up to 4; the kinds but float32 widen their tiles for more rows), not
 * float32 (widened tiles only) nor the NaN blend (rare).  Such a call
 * always prefetches (the last tile: its own rows, already in the cache), so
 * each body exists once.  The SIMDe test build has none: the same bodies
 * with a run-time head_dim, compiled in a fraction of the time. */
#ifdef KVA_AVX512_SIMDE
#define KVA_CONST_DIMS 0
#else
#define KVA_CONST_DIMS 1
#endif
static inline int const_dims_avx512(int kind, int M, int D)
{
    return KVA_CONST_DIMS && kind != KVA_F32 && kind != KVA_F8E4M3_NAN && M <= 8 &&
           (D == 64 || D == 128);
}

/* One GQA group's rows (M <= 8) over NV (a constant) vectors, prefetching:
 * every row in one block (each key widened once), 2 keys a block from 5
 * rows (16 accumulators). */
KVA_INLINE void dec_group_avx512(int kind, int NV, const float *Qs, int M,
                                 const char *const *krow, int ntp, float *S,
                                 const char *const *nk)
{
    const int D = 16 * NV;
    switch (M) {
    case 1: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 1, 8, 0, S, nk, 1, 1); break;
    case 2: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 2, 8, 0, S, nk, 1, 1); break;
    case 3: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 3, 4, 0, S, nk, 1, 1); break;
    case 4: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 4, 4, 0, S, nk, 1, 1); break;
    case 5: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 5, 2, 0, S, nk, 1, 1); break;
    case 6: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 6, 2, 0, S, nk, 1, 1); break;
    case 7: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 7, 2, 0, S, nk, 1, 1); break;
    default: dec_rows_avx512(Qs, D, krow, ntp, kind, NV, 0, 8, 2, 0, S, nk, 1, 1); break;
    }
}

KVA_INLINE void dec_scores_avx512(int kind, const float *Qs, int M, int D,
                                  const char *const *krow, int ntp, float *S,
                                  const char *const *nk)
{
    if (const_dims_avx512(kind, M, D)) {
        const char *const *pk = nk != NULL ? nk : krow;
        if (D == 64)
            dec_group_avx512(kind, 4, Qs, M, krow, ntp, S, pk);
        else
            dec_group_avx512(kind, 8, Qs, M, krow, ntp, S, pk);
        return;
    }
    dec_scores_pf_avx512(kind, D / 16, (D % 16) != 0, Qs, M, D, krow, ntp, S, nk);
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
    dec_scores_avx512(kind, Qs, M, D, krow, ntp, S, nk);
}

/* RB rows x DB vectors of 16 dims of the accumulator (half: one vector of
 * 8), over nt keys; PF (a constant): the lines of the next tile's rows
 * nv[i] are prefetched beside the loads of the same lines.
 * KVA_F8E4M3_CHK (DB a multiple of 4: whole lines): the values are read
 * without the NaN blend while each line's bytes are searched, per dim, for
 * NaN codes; a dim where one of the keys holds one becomes NaN, as the
 * blend would make it (p times NaN is NaN, and stays NaN). */
KVA_INLINE void pv_block_avx512(const float *P, int D, const char *const *vrow, int nt, int kind,
                                int RB, int DB, int half, int r, int d, float *acc,
                                const float *alpha, const char *const *nv, int PF)
{
    const int chk = kind == KVA_F8E4M3_CHK, lk = chk_load_kind(kind);
    const int isz = kva_isz(lk);
    if (RB < 1 || DB < 1 || DB > 8 || RB * DB > 16)
        __builtin_unreachable(); /* (the callers' shapes; for the compiler's bounds) */
    __m512 a[16];
    __m512i mx[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
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
        const char *row = vrow[i] + off, *next = PF ? nv[i] + off : NULL;
        __m512 v[8];
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++) {
            /* the 8-bit kinds: two vectors a load (load32_avx512) */
            if (isz == 1 && !half && DB % 2 == 0) {
                if (db % 2 == 0)
                    load32_avx512(row + (size_t)db * 16, lk, v + db);
            } else {
                v[db] = load16_avx512(row + (size_t)db * 16 * isz, lk, half);
            }
            if (PF && ((off + (size_t)db * 16 * isz) & 63) == 0)
                prefetch_next_avx512(next + (size_t)db * 16 * isz, KVA_NEXT_TO_L2(isz, D));
            if (chk && db % 4 == 0)
                mx[db / 4] = nan_fold_avx512(mx[db / 4], row + (size_t)db * 16);
        }
#pragma GCC unroll 8
        for (int rb = 0; rb < RB; rb++) {
            __m512 p = _mm512_set1_ps(P[(r + rb) * KVA_KEY_TILE + i]);
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++)
                a[rb * DB + db] = _mm512_fmadd_ps(p, v[db], a[rb * DB + db]);
        }
    }
    if (chk) {
        const __mmask64 k[2] = {
            _mm512_cmpeq_epi8_mask(mx[0], _mm512_set1_epi8((char)0xFF)),
            DB > 4 ? _mm512_cmpeq_epi8_mask(mx[1], _mm512_set1_epi8((char)0xFF)) : 0};
        if ((k[0] | k[1]) != 0) { /* (rare) */
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++)
#pragma GCC unroll 8
                for (int rb = 0; rb < RB; rb++)
                    a[rb * DB + db] = _mm512_mask_mov_ps(
                        a[rb * DB + db], (__mmask16)(k[db / 4] >> (16 * (db % 4))),
                        _mm512_set1_ps(NAN));
        }
    }
#pragma GCC unroll 8
    for (int rb = 0; rb < RB; rb++)
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
            storef_avx512(acc + (size_t)(r + rb) * D + d + db * 16, a[rb * DB + db], half);
}

/* Rows r .. r + RB - 1 over NV vectors of 16 dims (a constant where the
 * head_dim is) and (tail) a last one of 8: DB vectors at a time, then 4, 2
 * and single vectors (each a pass over the keys: as few as head_dim
 * allows), then the last 8 dims. */
KVA_INLINE void pv_rows_avx512(const float *P, int D, int NV, int tail, const char *const *vrow,
                               int nt, int kind, int RB, int DB, int r, float *acc,
                               const float *alpha, const char *const *nv, int PF)
{
    int v = 0;
    for (; v + DB <= NV; v += DB)
        pv_block_avx512(P, D, vrow, nt, kind, RB, DB, 0, r, 16 * v, acc, alpha, nv, PF);
    if (DB > 4)
        for (; v + 4 <= NV; v += 4)
            pv_block_avx512(P, D, vrow, nt, kind, RB, 4, 0, r, 16 * v, acc, alpha, nv, PF);
    if (DB > 2)
        for (; v + 2 <= NV; v += 2)
            pv_block_avx512(P, D, vrow, nt, kind, RB, 2, 0, r, 16 * v, acc, alpha, nv, PF);
    for (; v < NV; v++)
        pv_block_avx512(P, D, vrow, nt, kind, RB, 1, 0, r, 16 * v, acc, alpha, nv, PF);
    if (tail)
        pv_block_avx512(P, D, vrow, nt, kind, RB, 1, 1, r, 16 * NV, acc, alpha, nv, PF);
}

/* Every row: blocks of 4 rows x 4 vectors; the last 1-3 rows in one block
 * (a GQA group of 3 walks the keys once).  The first block prefetches the
 * next tile's values (nv), if any. */
KVA_INLINE void pv_nv_avx512(int kind, int NV, int tail, const float *P, int M, int D,
                             const char *const *vrow, int nt, float *acc, const float *alpha,
                             const char *const *nv)
{
    const int PF = nv != NULL;
#define KVA_PV_ROWS(RB, DB)                                                                  \
    do {                                                                                     \
        if (PF && r == 0)                                                                    \
            pv_rows_avx512(P, D, NV, tail, vrow, nt, kind, RB, DB, r, acc, alpha, nv, 1);    \
        else                                                                                 \
            pv_rows_avx512(P, D, NV, tail, vrow, nt, kind, RB, DB, r, acc, alpha, NULL, 0);  \
    } while (0)
    int r = 0;
    for (; r + 4 <= M; r += 4)
        KVA_PV_ROWS(4, 4);
    switch (M - r) {
    case 3: KVA_PV_ROWS(3, 4); break;
    case 2: KVA_PV_ROWS(2, 8); break;
    case 1: KVA_PV_ROWS(1, 8); break;
    default: break;
    }
#undef KVA_PV_ROWS
}

/* P.V of a decode call: head_dim 64 and 128 as constants where
 * const_dims_avx512 says (prefetching; the last tile its own rows); any
 * other call with a run-time head_dim. */
/* One GQA group's rows (M <= 8) over NV (a constant) vectors, in one block
 * of rows (each value widened once; from 5 rows 2 vectors a pass over the
 * keys: 16 accumulators), prefetching. */
KVA_INLINE void pv_group_avx512(int kind, int NV, const float *P, int M,
                                const char *const *vrow, int nt, float *acc, const float *alpha,
                                const char *const *nv)
{
    const int D = 16 * NV;
    switch (M) {
    case 1: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 1, 8, 0, acc, alpha, nv, 1); break;
    case 2: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 2, 8, 0, acc, alpha, nv, 1); break;
    case 3: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 3, 4, 0, acc, alpha, nv, 1); break;
    case 4: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 4, 4, 0, acc, alpha, nv, 1); break;
    case 5: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 5, 2, 0, acc, alpha, nv, 1); break;
    case 6: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 6, 2, 0, acc, alpha, nv, 1); break;
    case 7: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 7, 2, 0, acc, alpha, nv, 1); break;
    default: pv_rows_avx512(P, D, NV, 0, vrow, nt, kind, 8, 2, 0, acc, alpha, nv, 1); break;
    }
}

KVA_INLINE void pv_avx512(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                          float *acc, const float *alpha, const char *const *nv)
{
    if (const_dims_avx512(kind, M, D)) {
        const char *const *pn = nv != NULL ? nv : vrow;
        if (D == 64)
            pv_group_avx512(kind, 4, P, M, vrow, nt, acc, alpha, pn);
        else
            pv_group_avx512(kind, 8, P, M, vrow, nt, acc, alpha, pn);
        return;
    }
    pv_nv_avx512(kind, D / 16, (D % 16) != 0, P, M, D, vrow, nt, acc, alpha, nv);
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

/* The three bodies of a page kind (name): widen, scores and P.V, each picking its
 * kind at the call: KCHK when CHECKS(KCHK, M, D) (a decode body that searches the
 * lines it reads for NaN codes as it goes), KNAN when HAS_NAN finds a NaN code in
 * the rows (the NaN blend), else K.  A plain kind passes KVA_NEVER for both.
 * (Each body with its kind a constant: a kind chosen at run time would be a test
 * in every load of the inner loops.) */
#define KVA_NEVER(...) 0
#define KVA_AVX512_BODIES(name, K, KNAN, KCHK, CHECKS, PV_CHECKS, HAS_NAN)                    \
    KVA_AVX512_TARGET static void widen_##name##_avx512(const char *const *rows, int n,       \
                                                        int D, float *dst,                    \
                                                        const char *const *next)              \
    {                                                                                         \
        if (HAS_NAN(rows, n, D))                                                              \
            widen_avx512(KNAN, rows, n, D, dst, next);                                        \
        else                                                                                  \
            widen_avx512(K, rows, n, D, dst, next);                                           \
    }                                                                                         \
    KVA_AVX512_TARGET static void scores_##name##_avx512(                                     \
        const float *Qs, int M, int D, const char *const *krow, int ntp, float *S, float *t,  \
        const char *const *next)                                                              \
    {                                                                                         \
        if (CHECKS(KCHK, M, D))                                                               \
            dec_scores_avx512(KCHK, Qs, M, D, krow, ntp, S, next);                            \
        else if (HAS_NAN(krow, ntp, D))                                                       \
            scores_avx512(KNAN, Qs, M, D, krow, ntp, S, t, next);                             \
        else                                                                                  \
            scores_avx512(K, Qs, M, D, krow, ntp, S, t, next);                                \
    }                                                                                         \
    KVA_AVX512_TARGET static void pv_##name##_avx512(                                         \
        const float *P, int M, int D, const char *const *vrow, int nt, float *acc,            \
        const float *alpha, float *t, const char *const *next)                                \
    {                                                                                         \
        (void)t;                                                                              \
        if (PV_CHECKS(KCHK, M, D))                                                            \
            pv_avx512(KCHK, P, M, D, vrow, nt, acc, alpha, next);                             \
        else if (HAS_NAN(vrow, nt, D))                                                        \
            pv_avx512(KNAN, P, M, D, vrow, nt, acc, alpha, next);                             \
        else                                                                                  \
            pv_avx512(K, P, M, D, vrow, nt, acc, alpha, next);                                \
    }
#define KVA_AVX512_KIND(name, kind)                                                           \
    KVA_AVX512_BODIES(name, kind, kind, kind, KVA_NEVER, KVA_NEVER, KVA_NEVER)
KVA_AVX512_KIND(f32, KVA_F32)
KVA_AVX512_KIND(f16, KVA_F16)
KVA_AVX512_KIND(bf16, KVA_BF16)
KVA_AVX512_KIND(e5m2, KVA_F8E5M2)
KVA_AVX512_KIND(i8, KVA_I8)

/* e4m3fn (read as halves): decode items of head_dim 64 and 128 (scores up to
 * 8 rows, P.V up to 4: its search takes whole lines, 4 vectors a block) search
 * the lines they read for NaN codes as they go (KVA_F8E4M3_CHK, in the bodies
 * of const_dims_avx512; the SIMDe build runs them at a run-time head_dim); the
 * others search the tile's rows once, and only a tile that holds one pays for
 * the NaN blend of every 16 elements. */
#define KVA_E4M3_CHECKS_AVX512(kind, M, D) ((M) <= 8 && ((D) == 64 || (D) == 128))
#define KVA_E4M3_PV_CHECKS_AVX512(kind, M, D) ((M) <= 4 && ((D) == 64 || (D) == 128))
#define KVA_AVX512_E4M3(name, K, KNAN, KCHK)                                                  \
    KVA_AVX512_BODIES(name, K, KNAN, KCHK, KVA_E4M3_CHECKS_AVX512, KVA_E4M3_PV_CHECKS_AVX512, \
                      rows_have_e4m3_nan_avx512)
KVA_AVX512_E4M3(e4m3, KVA_F8E4M3, KVA_F8E4M3_NAN, KVA_F8E4M3_CHK)

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

KVA_AVX512_TARGET static void scale_avx512(float *s, const float *w, float c, ptrdiff_t n,
                                           int weights)
{
    const __m512 vc = _mm512_set1_ps(c);
    ptrdiff_t i = 0;
    /* (the scalar loop's products, in its order: the same bits) */
    if (w == NULL)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), vc));
    else if (!weights)
        for (; i + 16 <= n; i += 16) {
            const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(s + i), _mm512_loadu_ps(w + i));
            _mm512_storeu_ps(s + i, c == 1.0f ? p : _mm512_mul_ps(p, vc));
        }
    else if (c == 1.0f)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(s + i, flush_tiny_avx512(_mm512_mul_ps(_mm512_loadu_ps(s + i),
                                                                    _mm512_loadu_ps(w + i))));
    else
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(s + i, _mm512_mul_ps(flush_tiny_avx512(_mm512_mul_ps(
                                                      _mm512_loadu_ps(s + i),
                                                      _mm512_loadu_ps(w + i))),
                                                  vc));
    if (i < n)
        kva_scale_scalar(s + i, w == NULL ? NULL : w + i, c, n - i, weights);
}

/* The softmax step of a tile in registers (kva_math.softmax_rows): each
 * row's scores (up to four vectors) are loaded once, and every step of
 * kva_run_item's per-row loop runs on them with the operations of
 * tile_scales, row_max, row_exp_sum and scale, in their order (the same
 * bits): times the keys' scales (i < nt), -inf outside the row's visible
 * keys ([first, last), or [rf[r], rl[r]) when rf is given), the maximum,
 * alpha, the exponentials (stored) and their sum, the visible weights times
 * the values' scales and unit.  A row that sees no key (rl[r] <= rf[r])
 * is left as the per-row loop leaves it: scores 0, alpha 1, sum 0, m as
 * it was. */
KVA_AVX512_TARGET static void softmax_rows_avx512(float *S, int M, int nt, int ntp, int first,
                                                 int last, const int *rf, const int *rl,
                                                 const float *ks, const float *vs, float unit,
                                                 float *m, float *sum, float *alpha)
{
    /* (ntp <= KVA_KEY_TILE = 64 and last <= nt <= ntp: the callers') */
    const int nv = (ntp + 15) / 16;
    if (nv < 1 || nv > 4)
        __builtin_unreachable();
    const uint64_t real = nt >= 64 ? ~0ull : (1ull << nt) - 1;
    uint64_t seen = (last >= 64 ? ~0ull : (1ull << last) - 1) & ~((1ull << first) - 1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vu = _mm512_set1_ps(unit);
    __m512 k[4], w[4];
#pragma GCC unroll 4
    for (int c = 0; c < nv; c++) {
        k[c] = ks != NULL ? _mm512_maskz_loadu_ps((__mmask16)(real >> 16 * c), ks + 16 * c)
                          : ninf;
        /* (per-row keys: every real lane's scale; the row's mask picks) */
        w[c] = vs != NULL ? _mm512_maskz_loadu_ps((__mmask16)((rf != NULL ? real : seen) >> 16 * c),
                                                  vs + 16 * c)
                          : ninf;
    }
    for (int r = 0; r < M; r++) {
        float *s = S + (size_t)r * KVA_KEY_TILE;
        if (rf != NULL) {
            const int f = rf[r], l = rl[r];
            if (l <= f) { /* nothing visible: no change to this row */
                for (int c = 0; c < nv; c++)
                    storef_avx512(s + 16 * c, _mm512_setzero_ps(), ntp - 16 * c < 16);
                alpha[r] = 1.0f;
                sum[r] = 0.0f;
                continue;
            }
            seen = (l >= 64 ? ~0ull : (1ull << l) - 1) & ~((1ull << f) - 1);
        }
        __m512 x[4], mv = ninf;
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) {
            const __mmask16 rc = (__mmask16)(real >> 16 * c);
            x[c] = _mm512_maskz_loadu_ps(rc, s + 16 * c);
            if (ks != NULL)
                x[c] = _mm512_mask_mul_ps(x[c], rc, x[c], k[c]);
            x[c] = _mm512_mask_mov_ps(ninf, (__mmask16)(seen >> 16 * c), x[c]);
            mv = _mm512_max_ps(mv, x[c]);
        }
        const float mx = hmax_avx512(mv), mo = m[r];
        const float mnew = mo > mx ? mo : mx;
        alpha[r] = mo == -INFINITY                 ? 0.0f
                   : mo == mnew && mnew != INFINITY ? 1.0f
                                                    : kva_flush_tiny(exp2f(mo - mnew));
        m[r] = mnew;
        const __m512 mm = _mm512_set1_ps(kva_weight_origin(mnew));
        __m512 sm = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) {
            const __mmask16 sc = (__mmask16)(seen >> 16 * c);
            __m512 e = exp2_neg_avx512(_mm512_sub_ps(x[c], mm));
            sm = _mm512_add_ps(sm, e);
            if (vs != NULL)
                e = flush_tiny_avx512(_mm512_mask_mul_ps(e, sc, e, w[c]));
            if (unit != 1.0f)
                e = _mm512_mask_mul_ps(e, sc, e, vu);
            storef_avx512(s + 16 * c, e, ntp - 16 * c < 16);
        }
        sum[r] = hsum_avx512(sm);
    }
}

/* Items of up to 8 rows (a GQA group of up to 8) read the stored rows:
 * const_dims_avx512's bodies take them in one block of rows; items of 9-15
 * (a chunk of 2-5 tokens times a group of 3-7, say) in two such calls,
 * but e4m3fn's (whose 5-8-row P.V searches the tile for NaN codes a call)
 * widen: in the caches 0.95-1.11x, against 1.09-1.44x for the others
 * (docs/performance.md, "Items of 9 to 15 rows"). */
const kva_kernels kva_kernels_avx512[KVA_NUM_KINDS] = {
    KVA_KERNELS_ROWS(f32, avx512, 1.0f, 1, 1, 8, 8),
    KVA_KERNELS_ROWS(f16, avx512, 1.0f, 1, 1, 8, KVA_TILE_ROWS - 1),
    KVA_KERNELS_ROWS(bf16, avx512, 1.0f, 1, 1, 8, KVA_TILE_ROWS - 1),
    KVA_KERNELS_ROWS(e4m3, avx512, 256.0f, 1, 1, 8, 8), /* value / 2^8 */
    KVA_KERNELS_ROWS(e5m2, avx512, 1.0f, 1, 1, 8, KVA_TILE_ROWS - 1),
    KVA_KERNELS_ROWS(i8, avx512, 1.0f, 1, 1, 8, KVA_TILE_ROWS - 1),
};
const kva_math kva_math_avx512 = {row_max_avx512, row_exp_sum_avx512, softcap_avx512,
                                  exp2_neg_n_avx512, scale_avx512, softmax_rows_avx512,
                                  128};
#endif /* KVA_HAVE_AVX512 */
