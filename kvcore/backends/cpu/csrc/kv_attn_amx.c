/*
 * kv_attn_amx.c: the AMX level of the attention (x86-64): S = Q K^T and
 * acc += P V on AMX-BF16 tiles for items of many query rows (prefill,
 * chunked prefill over cached pages), and the level's softmax math in
 * AVX-512.  Decode items (fewer than KVA_TILE_ROWS rows), float32 pages and
 * head_dims that are not a multiple of 32 run the AVX2 kernels
 * (kv_attention.c chooses).
 *
 * Accuracy.  TDPBF16PS multiplies bf16 pairs exactly in float32 and
 * accumulates in float32.  A float32 operand (the scaled q, the softmax
 * weights P) is split into three bf16 terms by truncation, x = hi + mid +
 * lo, exactly: hi keeps the top 8 significant bits, the rest x - hi (exact)
 * has at most 16, mid its top 8, and lo = x - hi - mid at most 8.  A float16
 * element is hi + lo exactly (11 bits); bfloat16, fp8 and int8 elements are
 * one exact bf16 term (int8's and fp8's scales are applied outside the dot,
 * as at the other levels).  Every cross product down to 2^-22 relative is
 * accumulated (q_lo * k_lo is dropped for float16), so a score or an output
 * is a float32 sum of exact products, like the FMA kernels' dot products.
 * The tile unit treats bf16 inputs below 2^-126 as zero and flushes float32
 * results below it: only terms under 2^-126 in absolute value are lost.
 *
 * Build notes: compiled without -m flags like the rest; every function
 * carries KVA_AMX_TARGET and ends in _amx, and the tables are used only
 * after kv_simd.c found the instructions and the OS grant of the tile
 * state.  A test build (tests/attention/test_attention_amx_emulated.py) defines
 * KVA_AMX_TARGET away and KVA_AMX_EMULATION, which takes the AVX-512
 * intrinsics from SIMDe and the tile instructions from
 * tests/c/amx_tile_emulation.h, so this file runs on any CPU there.
 *
 * Tiles: palette 1, all eight 16 rows x 64 bytes.  Scores: tiles 0-1 the
 * 16 x 32 scores of 16 rows, 2-4 the q terms of 16 rows x 32 dims, 5-6 the
 * K terms of 32 dims x 16 keys in VNNI pairs (row p: dims 2p, 2p+1 of each
 * key).  P V: tile 0 the 16 x 16 acc block, 2-4 the P terms of 16 rows x 32
 * keys, 5-6 the V terms of 32 keys x 16 dims (row p: keys 2p, 2p+1 of each
 * dim).  A key tile is worked in runs of 32 keys; each run's K and V are
 * repacked once into the caller's tmp (KVA_KEY_TILE * D floats: two terms
 * of 32 keys take half of it).
 */
#include "kv_attn_internal.h"

#include <math.h>
#include <string.h>

#if KVA_HAVE_AMX
#ifdef KVA_AMX_EMULATION
#include "amx_tile_emulation.h" /* tests/c: SIMDe + the tile emulation */
#else
#include <immintrin.h>
#endif

/* The tiles hold 32 keys (P's 32 keys are one A tile's 64 bytes): a key
 * tile (a multiple of 32 keys: kv_attn_internal.h asserts it) is worked in
 * runs of 32, and tmp (KVA_KEY_TILE * D floats) holds two terms of a run's
 * repacked K or V. */

#ifndef KVA_AMX_TARGET
#define KVA_AMX_TARGET \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#endif
#define KVA_INLINE static inline __attribute__((always_inline)) KVA_AMX_TARGET

/* The 64-byte operand of LDTILECFG. */
typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kva_tilecfg;

KVA_INLINE void tiles_config_amx(void)
{
    kva_tilecfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 elements of `kind` at p, as float32 (exact). */
KVA_INLINE __m512 load16_amx(const char *p, int kind)
{
    if (kind == KVA_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (kind == KVA_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    /* bytes through 16-bit lanes (the widenings SIMDe has, for the test build) */
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (kind == KVA_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(bytes)));
    if (kind == KVA_F8E5M2) /* the high byte of a float16 */
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(bytes));
    /* e4m3fn: exponent and mantissa in place under a float32's, the bias
     * 127 instead of 7; a subnormal (exponent 0) is its mantissa times 2^-9
     * (both in integer/normal arithmetic: exact even under DAZ); the sign
     * on top, S.1111.111 NaN */
    const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi32(0x7F));
    __m512 v = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    v = _mm512_mask_mov_ps(v, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(8), mag),
                           _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)));
    v = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(v), _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24)));
    return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                              _mm512_set1_ps(NAN));
}

/* The bf16 term of x by truncation: x's bits with the low 16 cleared. */
KVA_INLINE __m512i hi_amx(__m512 x)
{
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0xFFFF0000u));
}

/* x - h (exact), or 0 where x is infinite or NaN (h carries it whole). */
KVA_INLINE __m512 rest_amx(__m512 x, __m512i h)
{
    __m512 r = _mm512_sub_ps(x, _mm512_castsi512_ps(h));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);
}

/* The terms of x (nterms: 1, 2 or 3) as float32 bit patterns. */
KVA_INLINE void split_amx(__m512 x, int nterms, __m512i *t)
{
    t[0] = hi_amx(x);
    if (nterms > 1) {
        __m512 r = rest_amx(x, t[0]);
        t[1] = hi_amx(r);
        if (nterms > 2)
            t[2] = hi_amx(rest_amx(r, t[1]));
    }
}

/* 16 bf16 of the terms' high halves (shifted down with the sign copied,
 * so the signed saturating narrowing keeps every bit pattern). */
KVA_INLINE __m256i bf16_amx(__m512i t)
{
    return _mm512_cvtsepi32_epi16(_mm512_srai_epi32(t, 16));
}

/* dst[i] = pair (a[i], b[i]) of bf16 terms, as 16 dwords. */
KVA_INLINE void store_pairs_amx(uint32_t *dst, __m512i a, __m512i b)
{
    _mm512_storeu_si512((void *)dst, _mm512_or_si512(_mm512_srli_epi32(a, 16), b));
}

/* Rows [mb, mb + rows) of a float32 matrix (row stride ld, 32 columns from
 * col, cols of them real) as bf16 terms: A tiles of 16 rows x 32 elements. */
KVA_INLINE void a_terms_amx(const float *x, int ld, int mb, int rows, int cols, uint16_t *a)
{
    for (int m = 0; m < 16; m++) {
        float row[32];
        if (m < rows) {
            memcpy(row, x + (size_t)(mb + m) * ld, (size_t)cols * sizeof(float));
            for (int i = cols; i < 32; i++)
                row[i] = 0.0f;
        } else {
            memset(row, 0, sizeof row);
        }
        __m512i t0[3], t1[3];
        split_amx(_mm512_loadu_ps(row), 3, t0);
        split_amx(_mm512_loadu_ps(row + 16), 3, t1);
        for (int t = 0; t < 3; t++) {
            _mm256_storeu_si256((__m256i *)(a + (size_t)t * 512 + m * 32), bf16_amx(t0[t]));
            _mm256_storeu_si256((__m256i *)(a + (size_t)t * 512 + m * 32 + 16), bf16_amx(t1[t]));
        }
    }
}

/* Tile C += the A terms in tiles 2-4 (hi, mid, lo) times the B tile at
 * bhi (loaded into tile 5; float16's: also its low term, at blo into tile
 * 6, when two_terms), in this order, which fixes the bits: hi x lo_b and
 * mid x lo_b first, then lo, mid and hi x hi_b.  A macro: the tile
 * instructions take their tile numbers as immediates. */
#define KVA_AMX_PRODUCTS(C, bhi, blo, two_terms)                                               \
    do {                                                                                      \
        _tile_loadd(5, (bhi), 64);                                                            \
        if (two_terms) {                                                                      \
            _tile_loadd(6, (blo), 64);                                                        \
            _tile_dpbf16ps(C, 3, 6);                                                          \
            _tile_dpbf16ps(C, 2, 6);                                                          \
        }                                                                                     \
        _tile_dpbf16ps(C, 4, 5);                                                              \
        _tile_dpbf16ps(C, 3, 5);                                                              \
        _tile_dpbf16ps(C, 2, 5);                                                              \
    } while (0)

/* A tiles 2-4: the hi, mid and lo bf16 terms of rows mb.. of x
 * (a_terms_amx, into a). */
KVA_INLINE void a_tiles_amx(const float *x, int ld, int mb, int rows, int cols, uint16_t *a)
{
    a_terms_amx(x, ld, mb, rows, cols, a);
    _tile_loadd(2, a, 64);
    _tile_loadd(3, a + 512, 64);
    _tile_loadd(4, a + 1024, 64);
}

/* S[r * KVA_KEY_TILE + i] = Qs[r] . K[i], for ntp <= 32 keys. */
KVA_INLINE void scores32_amx(int kind, const float *Qs, int M, int D, const char *const *krow,
                             int ntp, float *S, float *tmp)
{
    const int nk = kind == KVA_F16 ? 2 : 1, nc = D / 32, nnb = ntp > 16 ? 2 : 1;
    const size_t isz = (size_t)kva_isz(kind);
    /* B tiles [term][chunk][key block]: row p, column n = the pair of dims
     * (32c + 2p, 32c + 2p + 1) of key 16 nb + n; keys past ntp are zero */
    uint32_t *kb = (uint32_t *)tmp;
    memset(kb, 0, (size_t)nk * nc * nnb * 1024);
    for (int n = 0; n < ntp; n++) {
        uint32_t *col = kb + (size_t)(n >> 4) * 256 + (n & 15);
        for (int c = 0; c < nc; c++) {
            __m512i t0[2], t1[2];
            split_amx(load16_amx(krow[n] + (size_t)(32 * c) * isz, kind), nk, t0);
            split_amx(load16_amx(krow[n] + (size_t)(32 * c + 16) * isz, kind), nk, t1);
            for (int t = 0; t < nk; t++) {
                uint32_t pairs[16];
                _mm512_storeu_si512((void *)pairs,
                                    _mm512_inserti64x4(_mm512_castsi256_si512(bf16_amx(t0[t])),
                                                       bf16_amx(t1[t]), 1));
                uint32_t *dst = col + ((size_t)t * nc + c) * nnb * 256;
                for (int p = 0; p < 16; p++)
                    dst[p * 16] = pairs[p];
            }
        }
    }
    tiles_config_amx();
    uint16_t a[3 * 512];
    float cbuf[16 * 32];
    for (int mb = 0; mb < M; mb += 16) {
        const int rows = M - mb < 16 ? M - mb : 16;
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < nc; c++) {
            a_tiles_amx(Qs + 32 * c, D, mb, rows, 32, a); /* q */
            const uint32_t *b = kb + (size_t)c * nnb * 256;
            const size_t term = (size_t)nc * nnb * 256;
            KVA_AMX_PRODUCTS(0, b, b + term, nk == 2); /* keys 0-15 */
            if (nnb == 2)
                KVA_AMX_PRODUCTS(1, b + 256, b + term + 256, nk == 2); /* keys 16-31 */
        }
        _tile_stored(0, cbuf, 128);
        if (nnb == 2)
            _tile_stored(1, cbuf + 16, 128);
        for (int m = 0; m < rows; m++)
            memcpy(S + (size_t)(mb + m) * KVA_KEY_TILE, cbuf + m * 32, (size_t)ntp * sizeof(float));
    }
    _tile_release();
}

/* acc[r] = acc[r] * alpha[r] (alpha NULL: 1) + sum_{i < nt}
 * P[r * KVA_KEY_TILE + i] V[i], for nt <= 32 keys. */
KVA_INLINE void pv32_amx(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                         float *acc, const float *alpha, float *tmp)
{
    const int nk = kind == KVA_F16 ? 2 : 1, nd = D / 16;
    const size_t isz = (size_t)kva_isz(kind);
    /* B tiles [term][dim block]: row p, column n = the pair of keys (2p,
     * 2p + 1) of dim 16 j + n; keys past nt are zero */
    uint32_t *vb = (uint32_t *)tmp;
    memset(vb, 0, (size_t)nk * nd * 1024);
    for (int p = 0; 2 * p < nt; p++) {
        const int odd = 2 * p + 1 < nt;
        for (int j = 0; j < nd; j++) {
            __m512i ta[2], tb[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            split_amx(load16_amx(vrow[2 * p] + (size_t)(16 * j) * isz, kind), nk, ta);
            if (odd)
                split_amx(load16_amx(vrow[2 * p + 1] + (size_t)(16 * j) * isz, kind), nk, tb);
            for (int t = 0; t < nk; t++)
                store_pairs_amx(vb + (((size_t)t * nd + j) * 16 + p) * 16, ta[t], tb[t]);
        }
    }
    tiles_config_amx();
    uint16_t a[3 * 512];
    float cbuf[16 * 16];
    for (int mb = 0; mb < M; mb += 16) {
        const int rows = M - mb < 16 ? M - mb : 16;
        a_tiles_amx(P, KVA_KEY_TILE, mb, rows, nt, a); /* p */
        for (int j = 0; j < nd; j++) {
            for (int m = 0; m < 16; m++) {
                __m512 c = _mm512_setzero_ps();
                if (m < rows) {
                    c = _mm512_loadu_ps(acc + (size_t)(mb + m) * D + 16 * j);
                    if (alpha != NULL)
                        c = _mm512_mul_ps(c, _mm512_set1_ps(alpha[mb + m]));
                }
                _mm512_storeu_ps(cbuf + m * 16, c);
            }
            _tile_loadd(0, cbuf, 64);
            KVA_AMX_PRODUCTS(0, vb + (size_t)j * 256, vb + ((size_t)nd + j) * 256, nk == 2);
            _tile_stored(0, cbuf, 64);
            for (int m = 0; m < rows; m++)
                _mm512_storeu_ps(acc + (size_t)(mb + m) * D + 16 * j,
                                 _mm512_loadu_ps(cbuf + m * 16));
        }
    }
    _tile_release();
}

/* A key tile of ntp (nt) keys, 32 at a time: the scores of each run, and
 * acc scaled once by alpha, then each run's P V added in key order. */
KVA_INLINE void scores_amx(int kind, const float *Qs, int M, int D, const char *const *krow,
                           int ntp, float *S, float *tmp)
{
    for (int c = 0; c < ntp; c += 32)
        scores32_amx(kind, Qs, M, D, krow + c, ntp - c < 32 ? ntp - c : 32, S + c, tmp);
}

KVA_INLINE void pv_amx(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                       float *acc, const float *alpha, float *tmp)
{
    for (int c = 0; c < nt; c += 32)
        pv32_amx(kind, P + c, M, D, vrow + c, nt - c < 32 ? nt - c : 32, acc,
                 c == 0 ? alpha : NULL, tmp);
}

#define KVA_AMX_KIND(name, KIND)                                                              \
    KVA_AMX_TARGET static void scores_##name##_amx(const float *Qs, int M, int D,               \
                                                   const char *const *krow, int ntp, float *S,  \
                                                   float *tmp, const char *const *next)         \
    {                                                                                           \
        (void)next;                                                                             \
        scores_amx(KIND, Qs, M, D, krow, ntp, S, tmp);                                          \
    }                                                                                           \
    KVA_AMX_TARGET static void pv_##name##_amx(const float *P, int M, int D,                    \
                                               const char *const *vrow, int nt, float *acc,     \
                                               const float *alpha, float *tmp,                  \
                                               const char *const *next)                         \
    {                                                                                           \
        (void)next;                                                                             \
        pv_amx(KIND, P, M, D, vrow, nt, acc, alpha, tmp);                                       \
    }

KVA_AMX_KIND(f16, KVA_F16)
KVA_AMX_KIND(bf16, KVA_BF16)
KVA_AMX_KIND(e4m3, KVA_F8E4M3)
KVA_AMX_KIND(e5m2, KVA_F8E5M2)
KVA_AMX_KIND(i8, KVA_I8)

/* The level's math (row max, exp2, soft cap) is the avx512 level's:
 * kv_attention.c's math_for. */

const kva_kernels kva_kernels_amx[KVA_NUM_KINDS] = {
    {NULL, NULL, NULL, 1.0f, 0, 0}, /* float32: the avx512 kernels */
    {scores_f16_amx, pv_f16_amx, NULL, 1.0f, 0, 0},
    {scores_bf16_amx, pv_bf16_amx, NULL, 1.0f, 0, 0},
    {scores_e4m3_amx, pv_e4m3_amx, NULL, 1.0f, 0, 0},
    {scores_e5m2_amx, pv_e5m2_amx, NULL, 1.0f, 0, 0},
    {scores_i8_amx, pv_i8_amx, NULL, 1.0f, 0, 0},
};
#endif /* KVA_HAVE_AMX */
