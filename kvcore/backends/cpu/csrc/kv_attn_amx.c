/*
 * kv_attn_amx.c: the AMX level of the attention (x86-64): S = Q K^T and
 * acc += P V on AMX-BF16 tiles for items of many query rows (prefill,
 * chunked prefill over cached pages, a decode of 16+ query heads a KV
 * head), and the level's softmax math in AVX-512.  Items of fewer than
 * KVA_TILE_ROWS rows, float16 one-token items of fewer than 32 (kv_attn_tile.c
 * chooses), float32 pages and head_dims that are not a multiple of 32 up to
 * KVA_AMX_MAX_D (kv_attention.c) run the AVX-512 kernels, and so does an
 * item whose tiles meet an inf or NaN in its pages (found as the tiles are
 * packed: kva_nonfinite_amx; the item runs again from its start).
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
 * A q whose elements are all bf16 values (a bfloat16 model's; finite,
 * under 2^64: the caller checks, kva_run_item) is one exact term, not
 * scaled: its scores are the float32 sums of exact products times the
 * scale (one rounding, where a scaled q had its own), with a third of the
 * tile products.
 * The tile unit treats bf16 inputs below 2^-126 as zero and flushes float32
 * results below it: only terms under 2^-126 in absolute value are lost
 * (and a weight under 2^-103 is its high term alone: split_weight_amx).
 *
 * Build notes: compiled without -m flags like the rest; every function
 * carries KVA_AMX_TARGET and ends in _amx, and the tables are used only
 * after kv_simd.c found the instructions and the OS grant of the tile
 * state.  A test build (tests/attention/test_attention_amx_emulated.py) defines
 * KVA_AMX_TARGET away and KVA_AMX_EMULATION, which takes the AVX-512
 * intrinsics from SIMDe and the tile instructions from
 * tests/c/amx_tile_emulation.h, so this file runs on any CPU there.
 *
 * Tiles: palette 1, all eight 16 rows x 64 bytes, configured once and
 * left so between calls (kva_release_amx at a job's end).  q is split into
 * its three terms once per item (kva_kernels.prepare: A tiles of 16 rows x
 * 32 dims).  Scores: a key tile's rows are widened to bf16 (1-byte codes
 * by two 128-entry byte lookups, exact), transposed 16 keys at a time into
 * VNNI pairs (B: row p the dims 2p, 2p + 1 of 16 keys), and each block of
 * 16 rows takes its 16 x 64 scores in tiles 0-3 (float16: 0-1, the low
 * terms in tile 3), the q terms in 4-6 and a key block in 7, stored
 * straight into S.  P V: the values of each 32 keys paired (B: row p the
 * keys 2p, 2p + 1 of 16 dims), the weights' terms of 16 rows and 32 keys
 * in tiles 1-3 (and 4-6 for the next 32 keys), and each 16 x 16 block of
 * the accumulator loaded into tile 0 from acc, given its products and
 * stored back (through a copy when fewer than 16 rows are the call's).
 * The caller's tmp (KVA_KEY_TILE * D floats) holds a tile's repacked K or
 * V; S and acc have rows to a multiple of 16 (kva_workspace_layout).
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

#ifndef KVA_AMX_TARGET
#define KVA_AMX_TARGET \
    __attribute__((target("amx-tile,amx-bf16,avx2,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
#endif
#define KVA_INLINE static inline __attribute__((always_inline)) KVA_AMX_TARGET

/* The 64-byte operand of LDTILECFG. */
typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kva_tilecfg;

/* 16 float16 elements at p, as float32 (exact). */
KVA_INLINE __m512 half16_amx(const char *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The bf16 term of x by truncation: x's bits with the low 16 cleared. */
KVA_INLINE __m512i hi_amx(__m512 x)
{
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0xFFFF0000u));
}

/* x - h (exact), or 0 where x is infinite or NaN (h carries it whole):
 * told by h's exponent field in integer lanes (a float compare of a
 * subnormal rest, as a tiny softmax weight leaves, costs a microcode assist
 * of ~120 cycles on the Xeon of docs/performance.md; the subtraction does
 * not). */
KVA_INLINE __m512 rest_amx(__m512 x, __m512i h)
{
    const __m512i e = _mm512_set1_epi32(0x7F800000);
    const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, e), e);
    return _mm512_maskz_sub_ps((__mmask16)~special, x, _mm512_castsi512_ps(h));
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

/* The pairs (a[i], b[i]) of bf16 terms, as 16 dwords. */
KVA_INLINE __m512i pairs_amx(__m512i a, __m512i b)
{
    return _mm512_or_si512(_mm512_srli_epi32(a, 16), b);
}

/* The three terms of a softmax weight x (split_amx's), but a weight under
 * 2^-103 in magnitude is its high term alone: the low terms of the others
 * are then never subnormal (each is at least x's unit in the last place,
 * 2^-126 or more), so no float operation here takes a subnormal input (a
 * microcode assist of ~120 cycles on the Xeon of docs/performance.md: a
 * wide score spread's tiny weights made prefill 2-3x slower).  A weight is
 * at most 1: a dropped term changed an output by less than 2^-111 times a
 * value. */
KVA_INLINE void split_weight_amx(__m512 x, __m512i *t)
{
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 keep = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32((24 << 23) - 1)) &
                           _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7F800000), mag);
    t[0] = hi_amx(x);
    const __m512 r = _mm512_maskz_sub_ps(keep, x, _mm512_castsi512_ps(t[0]));
    t[1] = hi_amx(r);
    t[2] = hi_amx(_mm512_sub_ps(r, _mm512_castsi512_ps(t[1])));
}

#define KVA_R8(F, b) F(b), F(b + 1), F(b + 2), F(b + 3), F(b + 4), F(b + 5), F(b + 6), F(b + 7)
/* 32 bf16 (16 dwords, dword p the pair 2p, 2p + 1) of the terms t0
 * (elements 0-15) and t1 (16-31). */
#define KVA_ODD(i) (2 * (i) + 1)
static const uint16_t odd_words_amx[32] __attribute__((aligned(64))) = {
    KVA_R8(KVA_ODD, 0), KVA_R8(KVA_ODD, 8), KVA_R8(KVA_ODD, 16), KVA_R8(KVA_ODD, 24)};

KVA_INLINE __m512i bf16x32_amx(__m512i t0, __m512i t1)
{
    return _mm512_permutex2var_epi16(t0, _mm512_load_si512((const void *)odd_words_amx), t1);
}

/* 16 rows of 16 dwords, transposed in place: the off-diagonal blocks of 8,
 * 4, 2 and 1 swapped (64 two-source permutes). */
KVA_INLINE void transpose16_amx(__m512i *r)
{
    const __m512i j = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int b = 8; b >= 1; b >>= 1) {
        const __mmask16 up = _mm512_test_epi32_mask(j, _mm512_set1_epi32(b));
        /* row i (bit b clear) takes its upper columns from row i + b's lower
         * ones, and row i + b its lower from row i's upper */
        const __m512i lo = _mm512_mask_add_epi32(j, up, j, _mm512_set1_epi32(16 - b));
        const __m512i hi = _mm512_mask_add_epi32(_mm512_add_epi32(j, _mm512_set1_epi32(b)), up, j,
                                                 _mm512_set1_epi32(16));
        for (int i = 0; i < 16; i++) {
            if (i & b)
                continue;
            const __m512i x = r[i], y = r[i + b];
            r[i] = _mm512_permutex2var_epi32(x, lo, y);
            r[i + b] = _mm512_permutex2var_epi32(x, hi, y);
        }
    }
}

/* The bf16 bits of each 7-bit magnitude of a code, from the formats'
 * definitions: e4m3fn 1.e.mmm, bias 7, subnormals m x 2^-9, S.1111.111
 * NaN; e5m2 1.e.mm, bias 15, subnormals m x 2^-16, infinities and NaNs at
 * exponent 31; int8 by its low 7 bits u, non-negative (u) and negative
 * (u - 128).  NaNs are quiet. */
#define KVA_E4M3_BF16(m)                                                                    \
    ((m) == 127   ? 0x7FC0                                                                  \
     : ((m) >> 3) ? (((((m) >> 3) + 120) << 7) | (((m)&7) << 4))                            \
     : (m) == 0   ? 0                                                                       \
     : (m) == 1   ? 0x3B00                                                                  \
     : (m) < 4    ? (0x3B80 | (((m)-2) << 6))                                               \
                  : (0x3C00 | (((m)-4) << 5)))
#define KVA_E5M2_BF16(m)                                                                    \
    (((m) >> 2) == 31 ? ((m)&3 ? 0x7FC0 : 0x7F80)                                           \
     : ((m) >> 2)     ? (((((m) >> 2) + 112) << 7) | (((m)&3) << 5))                        \
     : (m) == 0       ? 0                                                                   \
     : (m) == 1       ? 0x3780                                                              \
                      : (0x3800 | (((m)-2) << 6)))
#define KVA_LOG2U(u)                                                                        \
    ((u) >= 128  ? 7                                                                        \
     : (u) >= 64 ? 6                                                                        \
     : (u) >= 32 ? 5                                                                        \
     : (u) >= 16 ? 4                                                                        \
     : (u) >= 8  ? 3                                                                        \
     : (u) >= 4  ? 2                                                                        \
     : (u) >= 2  ? 1                                                                        \
                 : 0)
#define KVA_UINT_BF16(u)                                                                    \
    ((u) == 0 ? 0 : (((127 + KVA_LOG2U(u)) << 7) | (((u) << (7 - KVA_LOG2U(u))) & 0x7F)))
#define KVA_I8P_BF16(m) KVA_UINT_BF16(m)
#define KVA_I8N_BF16(m) (0x8000 | KVA_UINT_BF16(128 - (m)))
#define KVA_E4M3_LO(m) (KVA_E4M3_BF16(m) & 0xFF)
#define KVA_E4M3_HI(m) (KVA_E4M3_BF16(m) >> 8)
#define KVA_E5M2_LO(m) (KVA_E5M2_BF16(m) & 0xFF)
#define KVA_E5M2_HI(m) (KVA_E5M2_BF16(m) >> 8)
#define KVA_I8P_LO(m) (KVA_I8P_BF16(m) & 0xFF)
#define KVA_I8P_HI(m) (KVA_I8P_BF16(m) >> 8)
#define KVA_I8N_LO(m) (KVA_I8N_BF16(m) & 0xFF)
#define KVA_I8N_HI(m) (KVA_I8N_BF16(m) >> 8)
#define KVA_R64(F, b)                                                                       \
    KVA_R8(F, b), KVA_R8(F, b + 8), KVA_R8(F, b + 16), KVA_R8(F, b + 24), KVA_R8(F, b + 32), \
        KVA_R8(F, b + 40), KVA_R8(F, b + 48), KVA_R8(F, b + 56)
#define KVA_R128(F) KVA_R64(F, 0), KVA_R64(F, 64)
/* [table][low byte, high byte][magnitude]: e4m3fn, e5m2, int8 >= 0, int8 < 0 */
static const uint8_t bf16_bytes_amx[4][2][128] __attribute__((aligned(64))) = {
    {{KVA_R128(KVA_E4M3_LO)}, {KVA_R128(KVA_E4M3_HI)}},
    {{KVA_R128(KVA_E5M2_LO)}, {KVA_R128(KVA_E5M2_HI)}},
    {{KVA_R128(KVA_I8P_LO)}, {KVA_R128(KVA_I8P_HI)}},
    {{KVA_R128(KVA_I8N_LO)}, {KVA_R128(KVA_I8N_HI)}},
};
/* vpermt2b indices interleaving bytes 0-31 (32-63) of a and b: a0 b0 a1 b1 ... */
#define KVA_ILV(i) ((i)&1 ? 64 + ((i) >> 1) : (i) >> 1)
#define KVA_ILV2(i) ((i)&1 ? 96 + ((i) >> 1) : 32 + ((i) >> 1))
static const uint8_t ilv_amx[2][64] __attribute__((aligned(64))) = {{KVA_R64(KVA_ILV, 0)},
                                                                    {KVA_R64(KVA_ILV2, 0)}};

/* vpermt2w indices pairing words n of a and b: dims 0-15 (16-31) */
#define KVA_PAIR(i) ((i)&1 ? 32 + ((i) >> 1) : (i) >> 1)
#define KVA_PAIR2(i) ((i)&1 ? 48 + ((i) >> 1) : 16 + ((i) >> 1))
static const uint16_t pair_amx[2][32] __attribute__((aligned(64))) = {
    {KVA_R8(KVA_PAIR, 0), KVA_R8(KVA_PAIR, 8), KVA_R8(KVA_PAIR, 16), KVA_R8(KVA_PAIR, 24)},
    {KVA_R8(KVA_PAIR2, 0), KVA_R8(KVA_PAIR2, 8), KVA_R8(KVA_PAIR2, 16), KVA_R8(KVA_PAIR2, 24)}};

KVA_INLINE __m512i lookup_amx(const uint8_t *t, __m512i x)
{
    return _mm512_permutex2var_epi8(_mm512_load_si512((const void *)t), x,
                                    _mm512_load_si512((const void *)(t + 64)));
}

/* The bf16 of 64 codes x of a 1-byte kind, exact, as the 64 low and the
 * 64 high bytes: two 128-entry byte lookups each. */
KVA_INLINE void bf16_planes_amx(int kind, __m512i x, __m512i *lo, __m512i *hi)
{
    const int k = kind == KVA_F8E4M3 ? 0 : kind == KVA_F8E5M2 ? 1 : 2;
    *lo = lookup_amx(bf16_bytes_amx[k][0], x);
    *hi = lookup_amx(bf16_bytes_amx[k][1], x);
    if (kind == KVA_I8) {
        const __mmask64 neg = _mm512_movepi8_mask(x);
        *lo = _mm512_mask_blend_epi8(neg, *lo, lookup_amx(bf16_bytes_amx[3][0], x));
        *hi = _mm512_mask_blend_epi8(neg, *hi, lookup_amx(bf16_bytes_amx[3][1], x));
    } else { /* the sign bit on top */
        *hi = _mm512_ternarylogic_epi32(*hi, x, _mm512_set1_epi8((char)0x80), 0xF8);
    }
}

/* Bytes 0-31 (h 0) or 32-63 (h 1) of a and b interleaved: a0 b0 a1 b1 ... */
KVA_INLINE __m512i interleave_amx(__m512i a, __m512i b, int h)
{
    return _mm512_permutex2var_epi8(a, _mm512_load_si512((const void *)ilv_amx[h]), b);
}

/* 32 codes of a 1-byte kind at p as 32 exact bf16 (16 dwords). */
KVA_INLINE __m512i bytes_bf16_amx(int kind, const char *p)
{
    __m512i lo, hi;
    bf16_planes_amx(kind, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)), &lo, &hi);
    return interleave_amx(lo, hi, 0);
}

/* 32 elements of a row at p as bf16 terms: t[0] (and t[1], float16's low
 * terms), each element exactly their sum. */
KVA_INLINE void row_terms_amx(int kind, const char *p, __m512i *t)
{
    if (kind == KVA_BF16) {
        t[0] = _mm512_loadu_si512((const void *)p);
    } else if (kind == KVA_F16) {
        __m512i a[2], b[2];
        split_amx(half16_amx(p), 2, a);
        split_amx(half16_amx(p + 32), 2, b);
        t[0] = bf16x32_amx(a[0], b[0]);
        t[1] = bf16x32_amx(a[1], b[1]);
    } else {
        t[0] = bytes_bf16_amx(kind, p);
    }
}

/* The tiles' configuration: palette 1, all eight 16 rows x 64 bytes.
 * Loaded only when the tiles are not so configured already (LDTILECFG
 * costs about 50 ns on the Xeon of docs/performance.md, STTILECFG 6): the
 * kernels leave it in place between calls, and kva_release_amx ends a
 * job's use of the tiles on each thread. */
KVA_INLINE void tiles_config_amx(void)
{
    kva_tilecfg cfg __attribute__((aligned(64))), now __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_storeconfig(&now);
    if (memcmp(&now, &cfg, sizeof cfg) != 0)
        _tile_loadconfig(&cfg);
}

/* Set when a tile kernel of this thread packs a bf16 term whose exponent
 * field is all ones (an inf or a NaN element: the high term carries it
 * whole, and the byte lookups give 0x7F80 / 0x7FC0): kva_nonfinite_amx. */
static __thread int nonfinite_seen_amx;

/* top = the largest exponent field of each bf16 word of top and w. */
KVA_INLINE __m512i exponents_amx(__m512i top, __m512i w)
{
    return _mm512_max_epu16(top, _mm512_and_si512(w, _mm512_set1_epi16(0x7F80)));
}

/* Whether a word of exponents_amx's top is all ones (0x7F80 + 0x80 is the
 * only one that reaches bit 15), remembered for kva_nonfinite_amx. */
KVA_INLINE void note_exponents_amx(__m512i top)
{
    const __m512i x = _mm512_add_epi16(top, _mm512_set1_epi16(0x80));
    if (_mm512_test_epi32_mask(x, _mm512_set1_epi32((int)0x80008000u)) != 0)
        nonfinite_seen_amx = 1;
}

KVA_AMX_TARGET int kva_nonfinite_amx(void)
{
    const int seen = nonfinite_seen_amx;
    nonfinite_seen_amx = 0;
    return seen;
}

KVA_AMX_TARGET void kva_release_amx(void)
{
    _tile_release();
}

/* How this thread's last prepare_amx made the item's q: its bf16 terms a
 * row (3, or 1 for a q whose elements are bf16 themselves), and the factor
 * of the scores (0: none; the q of one term is unscaled). */
static __thread int q_nterms_amx = 3;
static __thread float q_post_amx;

/* Once per item: the rows of Qs (M x D, float32) as nterms bf16 terms (hi,
 * mid, lo: 3; hi alone, exact for bf16 elements: 1), A tiles of 16 rows x
 * 32 dims at qt[((mb / 16 * (D / 32) + c) * 3 + t) * 512], rows past M
 * zero. */
KVA_INLINE void q_terms_amx(const float *Qs, int M, int D, uint16_t *qt, int nterms)
{
    const int nc = D / 32;
    for (int mb = 0; mb < M; mb += 16)
        for (int c = 0; c < nc; c++)
            for (int r = 0; r < 16; r++) {
                __m512i a[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(),
                                _mm512_setzero_si512()};
                __m512i b[3] = {a[0], a[0], a[0]};
                if (mb + r < M) {
                    split_amx(_mm512_loadu_ps(Qs + (size_t)(mb + r) * D + 32 * c), nterms, a);
                    split_amx(_mm512_loadu_ps(Qs + (size_t)(mb + r) * D + 32 * c + 16), nterms,
                              b);
                }
                for (int t = 0; t < nterms; t++)
                    _mm512_storeu_si512((void *)(qt + (((size_t)mb / 16 * nc + c) * 3 + t) * 512 +
                                                 r * 32),
                                        bf16x32_amx(a[t], b[t]));
            }
}

/* C tile Cn (keys 16 b ..) += the q terms in A tiles 4-6 (hi, mid, lo;
 * hi alone when q1) times the key block's B tile(s): float16's low terms
 * (tile 3, kl) first (mid and hi), then lo, mid and hi times the high terms
 * (tile 7, kh); in this order, which fixes the bits.  A macro: tile numbers
 * are immediates. */
#define KVA_AMX_QK(Cn, kh, kl, q1)                                                              \
    do {                                                                                        \
        if ((kl) != NULL) {                                                                     \
            _tile_loadd(3, (kl), 64);                                                           \
            if (!(q1))                                                                          \
                _tile_dpbf16ps(Cn, 5, 3);                                                       \
            _tile_dpbf16ps(Cn, 4, 3);                                                           \
        }                                                                                       \
        _tile_loadd(7, (kh), 64);                                                               \
        if (!(q1)) {                                                                            \
            _tile_dpbf16ps(Cn, 6, 7);                                                           \
            _tile_dpbf16ps(Cn, 5, 7);                                                           \
        }                                                                                       \
        _tile_dpbf16ps(Cn, 4, 7);                                                               \
    } while (0)

/* S[r * KVA_KEY_TILE + i] = q[r] . K[i] for r < M (rows to M rounded up to
 * 16 are written too: the workspace has them), i < ntp <= KVA_KEY_TILE,
 * from the item's q terms qt (q_terms_amx). */
/* The line at `off` of row i of the next tile (`next`: kva_kernels'), if
 * any, prefetched beside the load of the same line of this tile's row i:
 * the decode-like items of 16-31 rows (a short chunk times a GQA group)
 * read their pages out of the caches as the decode kernels do. */
KVA_INLINE void prefetch_next_amx(const char *const *next, int i, size_t off)
{
    if (next != NULL)
        _mm_prefetch(next[i] + off, _MM_HINT_T0);
}

KVA_INLINE void scores_amx(int kind, const uint16_t *qt, int M, int D, const char *const *krow,
                           int ntp, float *S, float *tmp, const char *const *next)
{
    const int nk = kind == KVA_F16 ? 2 : 1, nc = D / 32, nkb = (ntp + 15) / 16;
    const size_t isz = (size_t)kva_isz(kind);
    /* B tiles [term][chunk c][key block b]: row p the pair of dims (32 c +
     * 2p, 32 c + 2p + 1) of each key (column) of the block: each block's
     * rows widened to bf16 pairs and transposed; keys past ntp zero */
    uint32_t *kb = (uint32_t *)tmp;
    __m512i top = _mm512_setzero_si512();
#define KVA_KB(t, c, b) (kb + (((size_t)(t) * nc + (c)) * 4 + (b)) * 256)
    for (int b = 0; b < nkb; b++)
        for (int c = 0; c < nc; c++) {
            __m512i r[2][16];
            for (int n = 0; n < 16; n++) {
                __m512i t[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                if (16 * b + n < ntp) {
                    const size_t off = (size_t)(32 * c) * isz;
                    if (off % 64 == 0)
                        prefetch_next_amx(next, 16 * b + n, off);
                    row_terms_amx(kind, krow[16 * b + n] + off, t);
                }
                r[0][n] = t[0];
                r[1][n] = t[1];
                if (kind != KVA_I8) /* (int8 has neither) */
                    top = exponents_amx(top, t[0]);
            }
            for (int t = 0; t < nk; t++) {
                transpose16_amx(r[t]);
                for (int p = 0; p < 16; p++)
                    _mm512_storeu_si512((void *)(KVA_KB(t, c, b) + 16 * p), r[t][p]);
            }
        }
    note_exponents_amx(top);
    tiles_config_amx();
    const size_t ld = KVA_KEY_TILE * sizeof(float);
    const int q1 = q_nterms_amx == 1;
    for (int mb = 0; mb < M; mb += 16) {
        const uint16_t *q = qt + (size_t)mb / 16 * nc * 3 * 512;
        float *s = S + (size_t)mb * KVA_KEY_TILE;
        /* float16: two key blocks a pass (tile 3 holds the low terms) */
        for (int b0 = 0; b0 < nkb; b0 += nk == 2 ? 2 : 4) {
            const int nb = nkb - b0 < (nk == 2 ? 2 : 4) ? nkb - b0 : (nk == 2 ? 2 : 4);
            _tile_zero(0);
            if (nb > 1)
                _tile_zero(1);
            if (nb > 2)
                _tile_zero(2);
            for (int c = 0; c < nc; c++) {
                _tile_loadd(4, q + ((size_t)c * 3 + 0) * 512, 64);
                if (!q1) {
                    _tile_loadd(5, q + ((size_t)c * 3 + 1) * 512, 64);
                    _tile_loadd(6, q + ((size_t)c * 3 + 2) * 512, 64);
                }
                KVA_AMX_QK(0, KVA_KB(0, c, b0), nk == 2 ? KVA_KB(1, c, b0) : NULL, q1);
                if (nb > 1)
                    KVA_AMX_QK(1, KVA_KB(0, c, b0 + 1), nk == 2 ? KVA_KB(1, c, b0 + 1) : NULL,
                               q1);
                if (nb > 2)
                    KVA_AMX_QK(2, KVA_KB(0, c, b0 + 2), NULL, q1);
                if (nb > 3) { /* (tile 3 is free when no low terms are) */
                    if (c == 0)
                        _tile_zero(3);
                    _tile_loadd(7, KVA_KB(0, c, b0 + 3), 64);
                    if (!q1) {
                        _tile_dpbf16ps(3, 6, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
            _tile_stored(0, s + 16 * b0, ld);
            if (nb > 1)
                _tile_stored(1, s + 16 * (b0 + 1), ld);
            if (nb > 2)
                _tile_stored(2, s + 16 * (b0 + 2), ld);
            if (nb > 3)
                _tile_stored(3, s + 16 * (b0 + 3), ld);
        }
        if (q1 && q_post_amx != 1.0f) /* the dots of an unscaled q, times the scale */
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 16 * nkb; i += 16)
                    _mm512_storeu_ps(s + (size_t)r * KVA_KEY_TILE + i,
                                     _mm512_mul_ps(_mm512_loadu_ps(s + (size_t)r * KVA_KEY_TILE + i),
                                                   _mm512_set1_ps(q_post_amx)));
    }
#undef KVA_KB
}

/* Row p of the B tiles of a pair of value rows a, b (NULL: zeros) at vb:
 * the dword of dim 16 j + n is the pair (a[16 j + n], b[16 j + n]) of bf16,
 * at vb[j * 256 + 16 p + n]; float16's low terms likewise at vb + lo.  The
 * high terms' exponent fields go into *top (exponents_amx). */
KVA_INLINE void value_pair_amx(int kind, const char *a, const char *b, int D, uint32_t *vb,
                               int lo, int p, __m512i *top)
{
    const __m512i zero = _mm512_setzero_si512();
    for (int g = 0; g < D / 32; g++) { /* dims 32 g .. 32 g + 31: two B rows */
        uint32_t *dst = vb + (size_t)(2 * g) * 256 + 16 * p;
        __m512i w[2];
        if (kind == KVA_F16) {
            for (int h = 0; h < 2; h++) {
                __m512i ta[2] = {zero, zero}, tb[2] = {zero, zero};
                if (a != NULL)
                    split_amx(half16_amx(a + 64 * g + 32 * h), 2, ta);
                if (b != NULL)
                    split_amx(half16_amx(b + 64 * g + 32 * h), 2, tb);
                w[h] = pairs_amx(ta[0], tb[0]);
                _mm512_storeu_si512((void *)(dst + lo + 256 * h), pairs_amx(ta[1], tb[1]));
            }
        } else if (kind == KVA_BF16) {
            const __m512i x = a != NULL ? _mm512_loadu_si512((const void *)(a + 64 * g)) : zero;
            const __m512i y = b != NULL ? _mm512_loadu_si512((const void *)(b + 64 * g)) : zero;
            for (int h = 0; h < 2; h++)
                w[h] = _mm512_permutex2var_epi16(x, _mm512_load_si512((const void *)pair_amx[h]),
                                                 y);
        } else { /* the codes of a and b interleaved, then widened */
            const __m512i x =
                a != NULL ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + 32 * g)))
                          : zero;
            const __m512i y =
                b != NULL ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 32 * g)))
                          : zero;
            __m512i l, h;
            bf16_planes_amx(kind, interleave_amx(x, y, 0), &l, &h);
            w[0] = interleave_amx(l, h, 0);
            w[1] = interleave_amx(l, h, 1);
        }
        for (int h = 0; h < 2; h++) {
            _mm512_storeu_si512((void *)(dst + 256 * h), w[h]);
            if (kind != KVA_I8) /* (int8 has neither) */
                *top = exponents_amx(*top, w[h]);
        }
    }
}

/* Rows r0 .. r1 - 1 of the block of 16 rows from mb of the A tiles of
 * the weights P (nt <= KVA_KEY_TILE keys, runs of 32): pa[run][term], the
 * terms of split_weight_amx; rows past M and keys past nt zero. */
KVA_INLINE void weights_amx(const float *P, int M, int nt, int runs, int mb, int r0, int r1,
                            uint16_t (*pa)[3][512])
{
    for (int u = 0; u < runs; u++) {
        const int n = nt - 32 * u < 32 ? nt - 32 * u : 32;
        const __mmask16 m0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
        for (int r = r0; r < r1; r++) {
            __m512i a[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(),
                            _mm512_setzero_si512()};
            __m512i b[3] = {a[0], a[0], a[0]};
            if (mb + r < M) {
                const float *x = P + (size_t)(mb + r) * KVA_KEY_TILE + 32 * u;
                split_weight_amx(_mm512_maskz_loadu_ps(m0, x), a);
                split_weight_amx(_mm512_maskz_loadu_ps(m1, x + 16), b);
            }
            for (int t = 0; t < 3; t++)
                _mm512_store_si512((void *)(pa[u][t] + r * 32), bf16x32_amx(a[t], b[t]));
        }
    }
}

/* acc[r] = acc[r] * alpha[r] (alpha NULL: 1) + sum_{i < nt}
 * P[r * KVA_KEY_TILE + i] V[i], for nt <= KVA_KEY_TILE keys (acc's rows to M
 * rounded up to 16 are read and written: the workspace has them).  Each
 * accumulator block (16 rows x 16 dims) is a C tile loaded from acc, given
 * the products of the first 32 keys then the next 32 (in each, float16's
 * low value terms times mid and hi first, then lo, mid and hi times the
 * high terms), and stored back. */
KVA_INLINE void pv_amx(int kind, const float *P, int M, int D, const char *const *vrow, int nt,
                       float *acc, const float *alpha, float *tmp, const char *const *next)
{
    const int nk = kind == KVA_F16 ? 2 : 1, nd = D / 16, runs = (nt + 31) / 32;
    if (alpha != NULL)
        for (int r = 0; r < M; r++)
            if (alpha[r] != 1.0f)
                for (int d = 0; d < D; d += 16)
                    _mm512_storeu_ps(acc + (size_t)r * D + d,
                                     _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * D + d),
                                                   _mm512_set1_ps(alpha[r])));
    /* B tiles [run][term][dim block j]: row p, column n = the pair of keys
     * (32 run + 2p, + 1) of dim 16 j + n; keys past nt zero */
    uint32_t *vb = (uint32_t *)tmp;
    __m512i top = _mm512_setzero_si512();
#define KVA_VB(u, t, j) (vb + (((size_t)(u) * nk + (t)) * nd + (j)) * 256)
    for (int u = 0; u < runs; u++)
        for (int p = 0; p < 16; p++) {
            const int i = 32 * u + 2 * p;
            for (int k = i; k < i + 2 && k < nt && next != NULL; k++)
                for (size_t off = 0; off < (size_t)D * kva_isz(kind); off += 64)
                    prefetch_next_amx(next, k, off);
            value_pair_amx(kind, i < nt ? vrow[i] : NULL, i + 1 < nt ? vrow[i + 1] : NULL, D,
                           KVA_VB(u, 0, 0), nd * 256, p, &top);
        }
    note_exponents_amx(top);
    tiles_config_amx();
    /* A tiles, two sets: [set][run][term], the weights' terms of a block
     * of 16 rows; the next block's are packed (a few rows at a time)
     * between this block's tile products, so the vector work of one runs
     * beside the tile unit's work of the other */
    uint16_t pa[2][2][3][512] __attribute__((aligned(64)));
    float part[16 * KVA_AMX_MAX_D] __attribute__((aligned(64)));
    /* (a tile load of what vector stores have just written waits for them
     * to drain, ~50 cycles on the Xeon of docs/performance.md: the last
     * packed rows are a tile step ahead of their loads) */
    const int all = nk == 1 ? nd : runs * nd, steps = all > 1 ? all - 1 : 1; /* that pack */
    weights_amx(P, M, nt, runs, 0, 0, 16, pa[0]);
    for (int mb = 0, set = 0; mb < M; mb += 16, set ^= 1) {
        uint16_t(*a)[3][512] = pa[set], (*an)[3][512] = pa[set ^ 1];
        /* the next block's rows packed after tile step k < steps: rows
         * 16 k / steps .. 16 (k + 1) / steps (none after the last block) */
        const int next = mb + 16 < M;
#define KVA_PACK_NEXT(k)                                                                         \
    do {                                                                                        \
        if (next && (k) < steps)                                                                \
            weights_amx(P, M, nt, runs, mb + 16, 16 * (k) / steps, 16 * ((k) + 1) / steps, an); \
    } while (0)
        /* C from acc's rows, or (fewer than 16 rows left: the caller's
         * next rows are not this call's) from a copy of them */
        const int rows = M - mb < 16 ? M - mb : 16;
        float *c = acc + (size_t)mb * D;
        const size_t ld = (size_t)D * sizeof(float);
        if (rows < 16) {
            for (int r = 0; r < 16; r++)
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(part + (size_t)r * D + d,
                                    r < rows ? _mm512_loadu_ps(c + (size_t)r * D + d)
                                             : _mm512_setzero_ps());
            c = part;
        }
        if (nk == 1) {
            _tile_loadd(1, a[0][0], 64);
            _tile_loadd(2, a[0][1], 64);
            _tile_loadd(3, a[0][2], 64);
            if (runs == 2) {
                _tile_loadd(4, a[1][0], 64);
                _tile_loadd(5, a[1][1], 64);
                _tile_loadd(6, a[1][2], 64);
            }
            for (int j = 0; j < nd; j++) {
                _tile_loadd(0, c + 16 * j, ld);
                _tile_loadd(7, KVA_VB(0, 0, j), 64);
                _tile_dpbf16ps(0, 3, 7);
                _tile_dpbf16ps(0, 2, 7);
                _tile_dpbf16ps(0, 1, 7);
                if (runs == 2) {
                    _tile_loadd(7, KVA_VB(1, 0, j), 64);
                    _tile_dpbf16ps(0, 6, 7);
                    _tile_dpbf16ps(0, 5, 7);
                    _tile_dpbf16ps(0, 4, 7);
                }
                _tile_stored(0, c + 16 * j, ld);
                KVA_PACK_NEXT(j);
            }
        } else { /* float16: a run at a time (tile 4 holds the low terms) */
            for (int u = 0; u < runs; u++) {
                _tile_loadd(1, a[u][0], 64);
                _tile_loadd(2, a[u][1], 64);
                _tile_loadd(3, a[u][2], 64);
                for (int j = 0; j < nd; j++) {
                    _tile_loadd(0, c + 16 * j, ld);
                    _tile_loadd(4, KVA_VB(u, 1, j), 64);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_dpbf16ps(0, 1, 4);
                    _tile_loadd(7, KVA_VB(u, 0, j), 64);
                    _tile_dpbf16ps(0, 3, 7);
                    _tile_dpbf16ps(0, 2, 7);
                    _tile_dpbf16ps(0, 1, 7);
                    _tile_stored(0, c + 16 * j, ld);
                    KVA_PACK_NEXT(u * nd + j);
                }
            }
        }
#undef KVA_PACK_NEXT
        if (rows < 16)
            memcpy(acc + (size_t)mb * D, part, (size_t)rows * D * sizeof(float));
    }
#undef KVA_VB
}

#define KVA_AMX_KIND(name, KIND)                                                              \
    KVA_AMX_TARGET static void scores_##name##_amx(const float *Qs, int M, int D,               \
                                                   const char *const *krow, int ntp, float *S,  \
                                                   float *tmp, const char *const *next)         \
    {                                                                                           \
        scores_amx(KIND, (const uint16_t *)(const void *)Qs, M, D, krow, ntp, S, tmp, next);    \
    }                                                                                           \
    KVA_AMX_TARGET static void pv_##name##_amx(const float *P, int M, int D,                    \
                                               const char *const *vrow, int nt, float *acc,     \
                                               const float *alpha, float *tmp,                  \
                                               const char *const *next)                         \
    {                                                                                           \
        pv_amx(KIND, P, M, D, vrow, nt, acc, alpha, tmp, next);                                 \
    }

KVA_AMX_KIND(f16, KVA_F16)
KVA_AMX_KIND(bf16, KVA_BF16)
KVA_AMX_KIND(e4m3, KVA_F8E4M3)
KVA_AMX_KIND(e5m2, KVA_F8E5M2)
KVA_AMX_KIND(i8, KVA_I8)

KVA_AMX_TARGET static void prepare_amx(const float *Qs, int M, int D, uint16_t *qt, float post)
{
    q_nterms_amx = post != 0.0f ? 1 : 3;
    q_post_amx = post;
    q_terms_amx(Qs, M, D, qt, q_nterms_amx);
}

/* The level's math (row max, exp2, soft cap) is the avx512 level's:
 * kv_attention.c's math_for. */

const kva_kernels kva_kernels_amx[KVA_NUM_KINDS] = {
    {NULL, NULL, NULL, 1.0f, 0, 0, NULL}, /* float32: the avx512 kernels */
    {scores_f16_amx, pv_f16_amx, NULL, 1.0f, 1, 0, prepare_amx},
    {scores_bf16_amx, pv_bf16_amx, NULL, 1.0f, 1, 0, prepare_amx},
    {scores_e4m3_amx, pv_e4m3_amx, NULL, 1.0f, 1, 0, prepare_amx},
    {scores_e5m2_amx, pv_e5m2_amx, NULL, 1.0f, 1, 0, prepare_amx},
    {scores_i8_amx, pv_i8_amx, NULL, 1.0f, 1, 0, prepare_amx},
};
#endif /* KVA_HAVE_AMX */
