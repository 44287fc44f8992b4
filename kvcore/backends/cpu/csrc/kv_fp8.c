/*
 * kv_fp8: bulk float32 <-> fp8 / int8 conversions (see kv_fp8.h).
 *
 * A scalar path over the one definition in kv_fp8.h, and SIMD paths chosen
 * at run time with the level of kv_half.h (kvh_current_level): AVX2 on
 * x86-64, NEON on AArch64.  The F16C level has no fp8 instructions to offer
 * and runs the scalar path.  Every path gives the scalar path's bits for
 * every input, NaNs included (tests/c/kv_fp8_check.c, tests/convert/test_convert_fp8.py).
 *
 * Narrowing in SIMD is integer arithmetic on the float32 bits, the same
 * steps as kv_fp8_magnitude: one round-to-nearest-even right shift whose
 * input and count depend on whether the result is normal (the re-biased
 * bits, shifted by 23 - mbits) or subnormal (the full significand, shifted
 * by 151 - bias - mbits - exponent, capped at 25 where everything rounds to
 * 0); then overflow and NaN are blended in.  No float arithmetic that rounds
 * takes part (beyond the caller's scale; a float compare only chooses
 * whether a block of 32 needs the subnormal and NaN steps), so no MXCSR/FPCR
 * rounding or DAZ mode can change a bit (a scale that is a power of two is
 * applied as the exact product with its reciprocal: see fp8_scale_mode).
 * Widening builds normal results with integer shifts and subnormal ones as
 * m * 2^(1-bias-mbits), a float product that is exact and normal.
 *
 * Build notes: like kv_half.c, compiled without -m flags; the AVX2 bodies
 * carry __attribute__((target("avx2"))) and run only at the AVX2 level.
 */
#include <math.h>

#include "kv_fp8.h"
#include "kv_half.h"

#if defined(__x86_64__) || defined(_M_X64)
#define KV_FP8_X86 1
#include <immintrin.h>
#else
#define KV_FP8_X86 0
#endif

#if defined(__aarch64__)
#define KV_FP8_NEON 1
#include <arm_neon.h>
#else
#define KV_FP8_NEON 0
#endif

/* The constants of one format, as the SIMD paths use them. */
typedef struct {
    int mbits;          /* mantissa bits */
    int bias;           /* exponent bias */
    uint32_t max_code;  /* largest finite magnitude code */
    uint32_t ovf_code;  /* what overflow gives without saturation */
    uint32_t nan_code;  /* the NaN narrowing produces */
    uint32_t inf_mag;   /* magnitude code of infinity (0x100: none) */
    uint32_t max_mag;   /* magnitudes above this are NaN */
    float sub_unit;     /* value of the subnormal code 1: 2^(1-bias-mbits) */
} kv_fp8_fmt;

/* The SIMD bodies take a format by value and are always inlined into one
 * loop per format, so that every constant below folds into the code. */
#define KV_FP8_INLINE static inline __attribute__((always_inline))
#define KV_E4M3 ((kv_fp8_fmt){3, 7, 0x7Eu, 0x7Fu, 0x7Fu, 0x100u, 0x7Eu, 0x1p-9f})
#define KV_E5M2 ((kv_fp8_fmt){2, 15, 0x7Bu, 0x7Cu, 0x7Eu, 0x7Cu, 0x7Cu, 0x1p-16f})

/* ------------------------------------------------------------------ */
/* Scalar                                                              */
/* ------------------------------------------------------------------ */

static void f32_to_fp8_scalar(int fmt, const float *src, uint8_t *dst, ptrdiff_t n,
                              float scale, int saturate)
{
    ptrdiff_t i;
    if (scale == 1.0f) {
        if (fmt == KV_FP8_E4M3)
            for (i = 0; i < n; i++) dst[i] = kv_f32_to_e4m3_one(kv_fp8_bits(src[i]), saturate);
        else
            for (i = 0; i < n; i++) dst[i] = kv_f32_to_e5m2_one(kv_fp8_bits(src[i]), saturate);
        return;
    }
    if (fmt == KV_FP8_E4M3)
        for (i = 0; i < n; i++)
            dst[i] = kv_f32_to_e4m3_one(kv_fp8_bits(src[i] / scale), saturate);
    else
        for (i = 0; i < n; i++)
            dst[i] = kv_f32_to_e5m2_one(kv_fp8_bits(src[i] / scale), saturate);
}

static void fp8_to_f32_scalar(int fmt, const uint8_t *src, float *dst, ptrdiff_t n, float scale)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        float v = kv_fp8_float(fmt == KV_FP8_E4M3 ? kv_e4m3_to_f32_one(src[i])
                                                  : kv_e5m2_to_f32_one(src[i]));
        dst[i] = scale == 1.0f ? v : v * scale;
    }
}

/* Row scale from the largest magnitude's bits (see kv_fp8.h): NaN for a
 * row holding a NaN or an infinity, 1 for an all-zero row, the smallest
 * subnormal 2^-149 where max|x| / 127 underflows to 0 (every element is
 * then a multiple of it below 64: the codes are exact). */
static inline float i8_row_scale(uint32_t amax_bits)
{
    if (amax_bits >= 0x7F800000u)
        return NAN;
    if (amax_bits == 0)
        return 1.0f;
    float s = kv_fp8_float(amax_bits) / 127.0f;
    return s == 0.0f ? kv_fp8_float(1u) : s;
}

static void i8_quantize_scalar(const float *src, int8_t *dst, ptrdiff_t n, float scale)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        float q = nearbyintf(src[i] / scale);   /* ties to even (default mode) */
        if (q > 127.0f) q = 127.0f;
        if (q < -127.0f) q = -127.0f;
        dst[i] = (int8_t)q;
    }
}

static uint32_t amax_bits_scalar(const float *src, ptrdiff_t n)
{
    /* non-negative floats order as their bits do, and NaN/inf are the
     * largest patterns: one integer max finds the row's magnitude and
     * whether it is finite */
    uint32_t m = 0;
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t a = kv_fp8_bits(src[i]) & 0x7FFFFFFFu;
        if (a > m) m = a;
    }
    return m;
}

static void i8_to_f32_scalar(const int8_t *src, float *dst, ptrdiff_t n, float scale)
{
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = (float)src[i] * scale;
}

/* ------------------------------------------------------------------ */
/* AVX2                                                                */
/* ------------------------------------------------------------------ */
#if KV_FP8_X86

/* Outputs of at least this many elements are written with non-temporal
 * stores (as kv_half.c does): they would not stay in the cache anyway, and
 * streaming skips the read-for-ownership of every destination line. */
#define KV_FP8_STREAM_MIN ((ptrdiff_t)1 << 20)

/* 8 float32 -> 8 fp8 codes in the low byte of each lane.  `limit` is the
 * code overflow gives (saturate ? max_code : ovf_code).  Without
 * `with_sign` the codes are magnitudes (the caller adds the signs). */
__attribute__((target("avx2"))) KV_FP8_INLINE __m256i
fp8x8_avx2(__m256 xf, const kv_fp8_fmt f, __m256i limit, const int with_nan, const int with_sign,
           const int with_sub)
{
    const int sh = 23 - f.mbits;
    __m256i x = _mm256_castps_si256(xf);
    __m256i a = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(x, 24), _mm256_set1_epi32(0x80));
    /* normal result: re-bias and round the dropped bits to nearest even (a
     * carry into the exponent is right, up to overflow) */
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, sh), _mm256_set1_epi32(1));
    __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((int)(((uint32_t)(f.bias - 127) << 23)
                                                                     + (1u << (sh - 1)) - 1u))),
                         lsb), sh);
    /* subnormal result (|x| < 2^(1-bias)): |x| / unit is exact (a power of
     * two, no overflow), rounded with an explicit to-nearest-even mode, so
     * no MXCSR setting matters; a tie at 2^mbits - 1/2 rounds up to the
     * first normal code, as it should.  Only where the caller says a lane
     * may need it (with_sub). */
    __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(1.0f / f.sub_unit)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - f.bias) << 23), a);
    __m256i code = with_sub ? _mm256_blendv_epi8(normal, _mm256_cvttps_epi32(q), sub) : normal;
    /* overflow (inf included) -> limit; NaN -> nan_code, which is >= limit
     * (a NaN's code is past limit already: without saturation, e4m3fn's
     * NaN code is its limit) */
    code = _mm256_min_epi32(code, limit);
    if (with_nan) {
        __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
        code = _mm256_max_epi32(code, _mm256_and_si256(nan, _mm256_set1_epi32((int)f.nan_code)));
    }
    return with_sign ? _mm256_or_si256(code, sign) : code;
}

/* 32 float32 (x0..x3, already divided by the scale) -> 32 fp8 codes in
 * order.  `nan_apart`: whether NaN needs its own code (the overflow limit
 * is not it).  The NaN steps run only for a block holding a NaN; for e5m2
 * the subnormal steps too run only for a block holding a magnitude below
 * the smallest normal e5m2 (float compares that only pick the path: both
 * paths give the same bits for a block they let through). */
__attribute__((target("avx2"))) KV_FP8_INLINE __m256i
fp8x32_avx2(__m256 x0, __m256 x1, __m256 x2, __m256 x3, const kv_fp8_fmt f, __m256i limit,
            const int nan_apart)
{
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i a, b, c, d;
    if (f.mbits == 3) {
        /* e4m3fn: values below 2^-6 are common enough (one in 80 of a
         * standard normal) that telling blocks apart costs more than the
         * subnormal steps; only NaN gets a test (unordered: a NaN in either
         * operand's lane) */
        __m256 unord = _mm256_or_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q),
                                    _mm256_cmp_ps(x2, x3, _CMP_UNORD_Q));
        if (nan_apart && !_mm256_testz_ps(unord, unord)) {
            a = fp8x8_avx2(x0, f, limit, 1, 0, 1);
            b = fp8x8_avx2(x1, f, limit, 1, 0, 1);
            c = fp8x8_avx2(x2, f, limit, 1, 0, 1);
            d = fp8x8_avx2(x3, f, limit, 1, 0, 1);
        } else {
            a = fp8x8_avx2(x0, f, limit, 0, 0, 1);
            b = fp8x8_avx2(x1, f, limit, 0, 0, 1);
            c = fp8x8_avx2(x2, f, limit, 0, 0, 1);
            d = fp8x8_avx2(x3, f, limit, 0, 0, 1);
        }
    } else {
        /* e5m2: a block with a magnitude below 2^-14 (or a NaN) is rare */
        const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const __m256 tiny = _mm256_set1_ps(kv_fp8_float((uint32_t)(128 - f.bias) << 23));
        /* not >= the smallest normal fp8 (unordered: NaN too) */
#define KV_FP8_ODD(x) _mm256_cmp_ps(_mm256_and_ps((x), absm), tiny, _CMP_NGE_UQ)
        __m256 odd = _mm256_or_ps(_mm256_or_ps(KV_FP8_ODD(x0), KV_FP8_ODD(x1)),
                                  _mm256_or_ps(KV_FP8_ODD(x2), KV_FP8_ODD(x3)));
#undef KV_FP8_ODD
        if (!_mm256_testz_ps(odd, odd)) {
            a = fp8x8_avx2(x0, f, limit, nan_apart, 0, 1);
            b = fp8x8_avx2(x1, f, limit, nan_apart, 0, 1);
            c = fp8x8_avx2(x2, f, limit, nan_apart, 0, 1);
            d = fp8x8_avx2(x3, f, limit, nan_apart, 0, 1);
        } else {
            a = fp8x8_avx2(x0, f, limit, 0, 0, 0);
            b = fp8x8_avx2(x1, f, limit, 0, 0, 0);
            c = fp8x8_avx2(x2, f, limit, 0, 0, 0);
            d = fp8x8_avx2(x3, f, limit, 0, 0, 0);
        }
    }
    /* magnitude codes are in [0, 0x7F]: the saturating packs never clip.
     * The signs: the same signed packs of the inputs saturate every
     * negative pattern to a byte with the top bit set, every other to
     * one without.  Packs work within 128-bit lanes, so the dwords go
     * back in order at the end. */
    __m256i ab = _mm256_packus_epi32(a, b), cd = _mm256_packus_epi32(c, d);
    __m256i sab = _mm256_packs_epi32(_mm256_castps_si256(x0), _mm256_castps_si256(x1));
    __m256i scd = _mm256_packs_epi32(_mm256_castps_si256(x2), _mm256_castps_si256(x3));
    __m256i sign = _mm256_and_si256(_mm256_packs_epi16(sab, scd), _mm256_set1_epi8((char)0x80));
    return _mm256_permutevar8x32_epi32(_mm256_or_si256(_mm256_packus_epi16(ab, cd), sign), order);
}

/* How the SIMD loops apply the scale: not at all (scale 1), as a product
 * with 1/scale when that is exactly the quotient, else as the quotient. */
enum { KV_FP8_UNSCALED = 0, KV_FP8_RECIP = 1, KV_FP8_DIVIDE = 2 };

/* KV_FP8_RECIP when scale is +-2^e with 2^e and 2^-e both normal floats:
 * then x * 2^-e and x / 2^e are the same real number for every x, so the
 * one rounding of each gives the same float (NaN, inf, zero and results
 * in the subnormal range included, and DAZ/FTZ treat both alike); *recip
 * is set to 2^-e.  Any other scale: KV_FP8_DIVIDE (1.0f: UNSCALED). */
static inline int fp8_scale_mode(float scale, float *recip)
{
    uint32_t u = kv_fp8_bits(scale), e = (u >> 23) & 0xFFu;
    if (scale == 1.0f)
        return KV_FP8_UNSCALED;
    if ((u & 0x7FFFFFu) == 0 && e >= 1 && e <= 253) {
        *recip = kv_fp8_float((u & 0x80000000u) | ((254u - e) << 23));
        return KV_FP8_RECIP;
    }
    return KV_FP8_DIVIDE;
}

/* n float32 -> fp8, scaled (x / scale) or not, streamed or not: one loop
 * per case. */
__attribute__((target("avx2"))) KV_FP8_INLINE void
f32_to_fp8_avx2_loop(const kv_fp8_fmt f, int fmt, const float *src, uint8_t *dst, ptrdiff_t n,
                     float scale, float recip, int saturate, const int mode, const int stream)
{
    const __m256 vscale = _mm256_set1_ps(mode == KV_FP8_RECIP ? recip : scale);
    const __m256i limit = _mm256_set1_epi32((int)(saturate ? f.max_code : f.ovf_code));
    ptrdiff_t i = 0;
    if (stream) {   /* narrow up to dst's 32-byte alignment first */
        i = (ptrdiff_t)((32 - ((uintptr_t)dst & 31)) & 31);
        f32_to_fp8_scalar(fmt, src, dst, i, scale, saturate);
    }
#define KV_FP8_LOAD(p)                                                             \
    (mode == KV_FP8_DIVIDE ? _mm256_div_ps(_mm256_loadu_ps(p), vscale)             \
     : mode == KV_FP8_RECIP ? _mm256_mul_ps(_mm256_loadu_ps(p), vscale) : _mm256_loadu_ps(p))
    /* NaN needs its own code only where the overflow limit is not it */
    const int nan_apart = saturate || f.nan_code != f.ovf_code;
    for (; i + 32 <= n; i += 32) {
        __m256i r = fp8x32_avx2(KV_FP8_LOAD(src + i), KV_FP8_LOAD(src + i + 8),
                                KV_FP8_LOAD(src + i + 16), KV_FP8_LOAD(src + i + 24), f, limit,
                                nan_apart);
        if (stream)
            _mm256_stream_si256((__m256i *)(dst + i), r);
        else
            _mm256_storeu_si256((__m256i *)(dst + i), r);
    }
    if (stream)
        _mm_sfence();
    for (; i + 8 <= n; i += 8) {
        __m256i a = fp8x8_avx2(KV_FP8_LOAD(src + i), f, limit, 1, 1, 1);
        __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packus_epi16(w, w));
    }
    f32_to_fp8_scalar(fmt, src + i, dst + i, n - i, scale, saturate);
}

__attribute__((target("avx2"))) KV_FP8_INLINE void
f32_to_fp8_avx2_fmt(const kv_fp8_fmt f, int fmt, const float *src, uint8_t *dst, ptrdiff_t n,
                    float scale, int saturate)
{
    /* large outputs: non-temporal stores skip reading dst into the cache */
    int stream = n >= KV_FP8_STREAM_MIN;
    float recip = 1.0f;
    int mode = fp8_scale_mode(scale, &recip);
    if (mode == KV_FP8_UNSCALED) {
        if (stream) f32_to_fp8_avx2_loop(f, fmt, src, dst, n, scale, recip, saturate, 0, 1);
        else f32_to_fp8_avx2_loop(f, fmt, src, dst, n, scale, recip, saturate, 0, 0);
    } else if (mode == KV_FP8_RECIP) {
        if (stream) f32_to_fp8_avx2_loop(f, fmt, src, dst, n, scale, recip, saturate, 1, 1);
        else f32_to_fp8_avx2_loop(f, fmt, src, dst, n, scale, recip, saturate, 1, 0);
    } else {
        if (stream) f32_to_fp8_avx2_loop(f, fmt, src, dst, n, scale, recip, saturate, 2, 1);
        else f32_to_fp8_avx2_loop(f, fmt, src, dst, n, scale, recip, saturate, 2, 0);
    }
}

/* `rows` rows of n float32 (src_stride bytes apart) -> fp8 rows (dst_stride
 * bytes apart), the paged writes' shape: one call per token, the constants
 * set up once.  With `stream`, the 32-element blocks of a row whose dst is
 * 16-byte aligned go out with non-temporal stores (the caller fences). */
__attribute__((target("avx2"))) KV_FP8_INLINE void
f32_to_fp8_rows_avx2_loop(const kv_fp8_fmt f, int fmt, const char *src, ptrdiff_t src_stride,
                          uint8_t *dst, ptrdiff_t dst_stride, ptrdiff_t rows, ptrdiff_t n,
                          float scale, float recip, int saturate, const int mode,
                          const int stream)
{
    const __m256 vscale = _mm256_set1_ps(mode == KV_FP8_RECIP ? recip : scale);
    const __m256i limit = _mm256_set1_epi32((int)(saturate ? f.max_code : f.ovf_code));
    const int nan_apart = saturate || f.nan_code != f.ovf_code;
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *s = (const float *)(src + r * src_stride);
        uint8_t *d = dst + r * dst_stride;
        ptrdiff_t i = 0;
        if (stream && ((uintptr_t)d & 15) == 0) {
            for (; i + 32 <= n; i += 32) {
                __m256i v = fp8x32_avx2(KV_FP8_LOAD(s + i), KV_FP8_LOAD(s + i + 8),
                                        KV_FP8_LOAD(s + i + 16), KV_FP8_LOAD(s + i + 24), f,
                                        limit, nan_apart);
                _mm_stream_si128((__m128i *)(d + i), _mm256_castsi256_si128(v));
                _mm_stream_si128((__m128i *)(d + i + 16), _mm256_extracti128_si256(v, 1));
            }
        } else {
            for (; i + 32 <= n; i += 32)
                _mm256_storeu_si256((__m256i *)(d + i),
                                    fp8x32_avx2(KV_FP8_LOAD(s + i), KV_FP8_LOAD(s + i + 8),
                                                KV_FP8_LOAD(s + i + 16), KV_FP8_LOAD(s + i + 24),
                                                f, limit, nan_apart));
        }
        for (; i + 8 <= n; i += 8) {
            __m256i a = fp8x8_avx2(KV_FP8_LOAD(s + i), f, limit, 1, 1, 1);
            __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(a),
                                         _mm256_extracti128_si256(a, 1));
            _mm_storel_epi64((__m128i *)(d + i), _mm_packus_epi16(w, w));
        }
        if (i < n)
            f32_to_fp8_scalar(fmt, s + i, d + i, n - i, scale, saturate);
    }
}
#undef KV_FP8_LOAD

__attribute__((target("avx2"))) KV_FP8_INLINE void
f32_to_fp8_rows_avx2_fmt(const kv_fp8_fmt f, int fmt, const char *src, ptrdiff_t src_stride,
                         uint8_t *dst, ptrdiff_t dst_stride, ptrdiff_t rows, ptrdiff_t n,
                         float scale, int saturate, int stream)
{
    float recip = 1.0f;
    int mode = fp8_scale_mode(scale, &recip);
#define KV_FP8_ROWS(m, st) f32_to_fp8_rows_avx2_loop(f, fmt, src, src_stride, dst, dst_stride, \
                                                      rows, n, scale, recip, saturate, m, st)
    if (mode == KV_FP8_UNSCALED) {
        if (stream) KV_FP8_ROWS(0, 1); else KV_FP8_ROWS(0, 0);
    } else if (mode == KV_FP8_RECIP) {
        if (stream) KV_FP8_ROWS(1, 1); else KV_FP8_ROWS(1, 0);
    } else {
        if (stream) KV_FP8_ROWS(2, 1); else KV_FP8_ROWS(2, 0);
    }
#undef KV_FP8_ROWS
}

/* Widening goes through float16, which holds every fp8 value exactly: the
 * codes become the high and low bytes of their float16 bits with byte
 * operations, 32 at a time, and F16C's VCVTPH2PS widens those exactly (it
 * ignores MXCSR.DAZ).  NaN codes become the float16 quiet NaN 0x7E00 of
 * their sign, which widens to 0x7FC00000 | sign, the scalar result. */
__attribute__((target("avx2,f16c"))) KV_FP8_INLINE void
f16_bytes_avx2(__m256i b, const kv_fp8_fmt f, __m256i *hi, __m256i *lo)
{
    const __m256i sign = _mm256_and_si256(b, _mm256_set1_epi8((char)0x80));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi8(0x7F));
    if (f.mbits == 2) {
        /* e5m2 is the high byte of a float16 */
        __m256i nan = _mm256_cmpgt_epi8(mag, _mm256_set1_epi8(0x7C));
        *hi = _mm256_blendv_epi8(b, _mm256_or_si256(sign, _mm256_set1_epi8(0x7E)), nan);
        *lo = _mm256_setzero_si256();
        return;
    }
    /* e4m3fn: a normal code's float16 is (mag << 7) + (8 << 10); a
     * subnormal m * 2^-9 is a normal float16 whose high byte a table gives
     * (its low byte is 0) */
    const __m256i table = _mm256_setr_epi8(0x00, 0x18, 0x1C, 0x1E, 0x20, 0x21, 0x22, 0x23, 0, 0, 0,
                                           0, 0, 0, 0, 0, 0x00, 0x18, 0x1C, 0x1E, 0x20, 0x21, 0x22,
                                           0x23, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256i h = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(mag, 1), _mm256_set1_epi8(0x7F)),
                                _mm256_set1_epi8(0x20));
    __m256i l = _mm256_and_si256(_mm256_slli_epi16(mag, 7), _mm256_set1_epi8((char)0x80));
    __m256i sub = _mm256_cmpgt_epi8(_mm256_set1_epi8(8), mag);
    h = _mm256_blendv_epi8(h, _mm256_shuffle_epi8(table, mag), sub);
    __m256i nan = _mm256_cmpeq_epi8(mag, _mm256_set1_epi8(0x7F));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi8(0x7E), nan);
    *hi = _mm256_or_si256(h, sign);
    *lo = _mm256_andnot_si256(_mm256_or_si256(sub, nan), l);
}

__attribute__((target("avx2,f16c"))) KV_FP8_INLINE void
fp8_to_f32_avx2_loop(const kv_fp8_fmt f, int fmt, const uint8_t *src, float *dst, ptrdiff_t n,
                     float scale, const int scaled, const int stream)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    ptrdiff_t i = 0;
    if (stream) {   /* dst 4-byte aligned: widen up to 32-byte alignment first */
        i = (ptrdiff_t)(((32 - ((uintptr_t)dst & 31)) & 31) / 4);
        fp8_to_f32_scalar(fmt, src, dst, i, scale);
    }
#define KV_FP8_STORE(p, v)                                                  \
    do {                                                                    \
        __m256 v_ = scaled ? _mm256_mul_ps((v), vscale) : (v);              \
        if (stream) _mm256_stream_ps((p), v_); else _mm256_storeu_ps((p), v_); \
    } while (0)
    for (; i + 32 <= n; i += 32) {
        __m256i hi, lo;
        f16_bytes_avx2(_mm256_loadu_si256((const __m256i *)(src + i)), f, &hi, &lo);
        __m256i h0 = _mm256_unpacklo_epi8(lo, hi);   /* codes 0-7 | 16-23 */
        __m256i h1 = _mm256_unpackhi_epi8(lo, hi);   /* codes 8-15 | 24-31 */
        KV_FP8_STORE(dst + i, _mm256_cvtph_ps(_mm256_castsi256_si128(h0)));
        KV_FP8_STORE(dst + i + 8, _mm256_cvtph_ps(_mm256_castsi256_si128(h1)));
        KV_FP8_STORE(dst + i + 16, _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1)));
        KV_FP8_STORE(dst + i + 24, _mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1)));
    }
    for (; i + 8 <= n; i += 8) {
        __m256i hi, lo;
        f16_bytes_avx2(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(src + i))), f,
                       &hi, &lo);
        KV_FP8_STORE(dst + i, _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_unpacklo_epi8(lo, hi))));
    }
#undef KV_FP8_STORE
    if (stream)
        _mm_sfence();
    fp8_to_f32_scalar(fmt, src + i, dst + i, n - i, scale);
}

__attribute__((target("avx2,f16c"))) KV_FP8_INLINE void
fp8_to_f32_avx2_fmt(const kv_fp8_fmt f, int fmt, const uint8_t *src, float *dst, ptrdiff_t n,
                    float scale)
{
    int stream = n >= KV_FP8_STREAM_MIN && ((uintptr_t)dst & 3) == 0;
    if (scale == 1.0f) {
        if (stream) fp8_to_f32_avx2_loop(f, fmt, src, dst, n, scale, 0, 1);
        else fp8_to_f32_avx2_loop(f, fmt, src, dst, n, scale, 0, 0);
    } else {
        if (stream) fp8_to_f32_avx2_loop(f, fmt, src, dst, n, scale, 1, 1);
        else fp8_to_f32_avx2_loop(f, fmt, src, dst, n, scale, 1, 0);
    }
}

__attribute__((target("avx2"))) static void
f32_to_fp8_avx2(int fmt, const float *src, uint8_t *dst, ptrdiff_t n, float scale, int saturate)
{
    if (fmt == KV_FP8_E4M3)
        f32_to_fp8_avx2_fmt(KV_E4M3, fmt, src, dst, n, scale, saturate);
    else
        f32_to_fp8_avx2_fmt(KV_E5M2, fmt, src, dst, n, scale, saturate);
}

__attribute__((target("avx2"))) static void
f32_to_fp8_rows_avx2(int fmt, const char *src, ptrdiff_t src_stride, uint8_t *dst,
                     ptrdiff_t dst_stride, ptrdiff_t rows, ptrdiff_t n, float scale, int saturate,
                     int stream)
{
    if (fmt == KV_FP8_E4M3)
        f32_to_fp8_rows_avx2_fmt(KV_E4M3, fmt, src, src_stride, dst, dst_stride, rows, n, scale,
                                 saturate, stream);
    else
        f32_to_fp8_rows_avx2_fmt(KV_E5M2, fmt, src, src_stride, dst, dst_stride, rows, n, scale,
                                 saturate, stream);
}

__attribute__((target("avx2,f16c"))) static void
fp8_to_f32_avx2(int fmt, const uint8_t *src, float *dst, ptrdiff_t n, float scale)
{
    if (fmt == KV_FP8_E4M3)
        fp8_to_f32_avx2_fmt(KV_E4M3, fmt, src, dst, n, scale);
    else
        fp8_to_f32_avx2_fmt(KV_E5M2, fmt, src, dst, n, scale);
}

__attribute__((target("avx2"))) KV_FP8_INLINE uint32_t amax_bits_avx2_inl(const float *src,
                                                                           ptrdiff_t n)
{
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_epi32(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(src + i)),
                                                   absmask));
        m1 = _mm256_max_epi32(m1, _mm256_and_si256(
                                      _mm256_loadu_si256((const __m256i *)(src + i + 8)), absmask));
    }
    m0 = _mm256_max_epi32(m0, m1);
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    uint32_t best = (uint32_t)_mm_cvtsi128_si32(m);
    if (i == n)
        return best;
    uint32_t rest = amax_bits_scalar(src + i, n - i);
    return rest > best ? rest : best;
}

/* 8 float32 -> 8 int32 in [-127, 127]: round(x / scale), ties to even. */
__attribute__((target("avx2"))) static inline __m256 i8q8_avx2(__m256 q)
{
    return _mm256_max_ps(_mm256_min_ps(q, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-127.0f));
}

__attribute__((target("avx2"))) static inline __m256i i8x8_avx2(const float *p, __m256 scale)
{
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(p), scale),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(i8q8_avx2(q));   /* integral already: exact */
}

/* The int8 codes of a row come from products instead of quotients where
 * that cannot change them.  For a finite row with 2^-100 <= A = max|x| <=
 * 2^100, scale s = fl(A / 127), r = fl(127 / A), the quotient q = fl(x / s)
 * and the product y = fl(x * r) are normal or tiny (no overflow), |x / s|
 * <= 127 (1 + 2^-24), and y / (x / s) = (1 + e2)(1 + e3)(1 + e4) with the
 * relative errors of r, s and the product; so |y - q| <= 4 * 2^-24 * 127.01
 * < 2^-15 in the default rounding mode (< 2^-14 in any other).  t = fl(y +
 * 1536) lies in [1024, 2048), where floats are 2^-13 apart: its bits hold
 * t - 1536 = I + F * 2^-13 (integer I, F in 0..8191) within 2^-14 (2^-13)
 * of y, so q is within 1.5 * 2^-13 of it.  Where |F - 4096| >= 3, q is then
 * on the same side of the half-integer I + 1/2 as t - 1536 and not on it, so
 * q rounds (to nearest, ties to even) to the integer floor(t - 1536 + 1/2),
 * an integer shift of t's bits.  A block of 32 holding an F that close to
 * one half (about one element in 1600) is quantized by division instead. */
#define KV_I8_FAST_LO 0x0D800000u   /* 2^-100 */
#define KV_I8_FAST_HI 0x71800000u   /* 2^100 */

/* 32 float32 -> 32 int8 codes in order, by division (out of line: the
 * rare blocks of the product path, and rows outside its range). */
__attribute__((target("avx2"), noinline)) static __m256i i8x32_div_avx2(const float *src,
                                                                        float scale)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256i ab = _mm256_packs_epi32(i8x8_avx2(src, vscale), i8x8_avx2(src + 8, vscale));
    __m256i cd = _mm256_packs_epi32(i8x8_avx2(src + 16, vscale), i8x8_avx2(src + 24, vscale));
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* n float32 -> int8 codes at `scale` (recip = 1 / scale, `fast`: the row
 * qualifies for products, see above); with `stream` (dst 16-byte aligned)
 * the 32-element blocks go out with non-temporal stores. */
__attribute__((target("avx2"))) KV_FP8_INLINE void
i8_quantize_avx2_inl(const float *src, int8_t *dst, ptrdiff_t n, float scale, float recip,
                     const int fast, const int stream)
{
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 vscale = _mm256_set1_ps(scale);
    ptrdiff_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i ab, cd;
        if (fast) {
            const __m256 vrecip = _mm256_set1_ps(recip), off = _mm256_set1_ps(1536.0f);
            /* bits of t - (bits of 1536 - 2^12): t - 1536 + 1/2 in fixed point */
            const __m256i base = _mm256_set1_epi32(0x44C00000 - 0x1000);
            const __m256i window = _mm256_set1_epi32(5), mask13 = _mm256_set1_epi32(0x1FFF);
            __m256i t0 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(
                                              _mm256_mul_ps(_mm256_loadu_ps(src + i), vrecip), off)), base);
            __m256i t1 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(
                                              _mm256_mul_ps(_mm256_loadu_ps(src + i + 8), vrecip), off)), base);
            __m256i t2 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(
                                              _mm256_mul_ps(_mm256_loadu_ps(src + i + 16), vrecip), off)), base);
            __m256i t3 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(
                                              _mm256_mul_ps(_mm256_loadu_ps(src + i + 24), vrecip), off)), base);
            /* F within 2 of 4096: (F + 4096 + 2) mod 8192 < 5, where t's low
             * 13 bits are already F + 4096 (mod 8192) */
#define KV_I8_NEAR(t) _mm256_cmpgt_epi32(window, _mm256_and_si256(                 \
                          _mm256_add_epi32((t), _mm256_set1_epi32(2)), mask13))
            __m256i close = _mm256_or_si256(_mm256_or_si256(KV_I8_NEAR(t0), KV_I8_NEAR(t1)),
                                            _mm256_or_si256(KV_I8_NEAR(t2), KV_I8_NEAR(t3)));
#undef KV_I8_NEAR
            if (_mm256_testz_si256(close, close)) {
                ab = _mm256_packs_epi32(_mm256_srai_epi32(t0, 13), _mm256_srai_epi32(t1, 13));
                cd = _mm256_packs_epi32(_mm256_srai_epi32(t2, 13), _mm256_srai_epi32(t3, 13));
                goto store;
            }
        }
        {
            __m256i v = i8x32_div_avx2(src + i, scale);
            if (stream) {
                _mm_stream_si128((__m128i *)(dst + i), _mm256_castsi256_si128(v));
                _mm_stream_si128((__m128i *)(dst + i + 16), _mm256_extracti128_si256(v, 1));
            } else {
                _mm256_storeu_si256((__m256i *)(dst + i), v);
            }
            continue;
        }
    store:;
        __m256i v = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
        if (stream) {
            _mm_stream_si128((__m128i *)(dst + i), _mm256_castsi256_si128(v));
            _mm_stream_si128((__m128i *)(dst + i + 16), _mm256_extracti128_si256(v, 1));
        } else {
            _mm256_storeu_si256((__m256i *)(dst + i), v);
        }
    }
    for (; i + 8 <= n; i += 8) {
        __m256i a = i8x8_avx2(src + i, vscale);
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packs_epi16(w, w));
    }
    if (i < n)
        i8_quantize_scalar(src + i, dst + i, n - i, scale);
}

__attribute__((target("avx2"))) static uint32_t amax_bits_avx2(const float *src, ptrdiff_t n)
{
    return amax_bits_avx2_inl(src, n);
}

__attribute__((target("avx2"))) static void
i8_quantize_avx2(const float *src, int8_t *dst, ptrdiff_t n, float scale)
{
    i8_quantize_avx2_inl(src, dst, n, scale, 1.0f, 0, 0);
}

/* `rows` int8 rows (see kvh_f32_to_i8_rows): the largest magnitude of a row
 * (read once), then its codes from the same, L1-resident, row. */
__attribute__((target("avx2"))) static void
f32_to_i8_rows_avx2(const char *src, ptrdiff_t src_stride, int8_t *dst, ptrdiff_t dst_stride,
                    float *scales, ptrdiff_t scale_stride, ptrdiff_t rows, ptrdiff_t n, int stream)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *s = (const float *)(src + r * src_stride);
        int8_t *d = dst + r * dst_stride;
        uint32_t amax = amax_bits_avx2_inl(s, n);
        float scale = i8_row_scale(amax);
        scales[r * scale_stride] = scale;
        if (amax == 0 || amax >= 0x7F800000u) {     /* all zeros, or not finite */
            if (n > 0)
                memset(d, 0, (size_t)n);
            continue;
        }
        int st = stream && ((uintptr_t)d & 15) == 0;
        if (amax >= KV_I8_FAST_LO && amax <= KV_I8_FAST_HI) {
            /* r of the bound above (it need not wait for scale) */
            float recip = 127.0f / kv_fp8_float(amax);
            if (st) i8_quantize_avx2_inl(s, d, n, scale, recip, 1, 1);
            else i8_quantize_avx2_inl(s, d, n, scale, recip, 1, 0);
        } else {
            if (st) i8_quantize_avx2_inl(s, d, n, scale, 1.0f, 0, 1);
            else i8_quantize_avx2_inl(s, d, n, scale, 1.0f, 0, 0);
        }
    }
}

__attribute__((target("avx2"))) static void
i8_to_f32_avx2(const int8_t *src, float *dst, ptrdiff_t n, float scale)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i));
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(lo, vscale));
        _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(hi, vscale));
    }
    i8_to_f32_scalar(src + i, dst + i, n - i, scale);
}

#endif /* KV_FP8_X86 */

/* ------------------------------------------------------------------ */
/* NEON (every AArch64 CPU)                                            */
/* ------------------------------------------------------------------ */
#if KV_FP8_NEON

/* 4 float32 bit patterns -> 4 fp8 codes (one per 32-bit lane).  vshlq by a
 * negative count shifts right; counts past the width give 0. */
KV_FP8_INLINE uint32x4_t fp8x4_neon(uint32x4_t x, const kv_fp8_fmt f, int saturate)
{
    const uint32x4_t one = vdupq_n_u32(1);
    uint32x4_t a = vandq_u32(x, vdupq_n_u32(0x7FFFFFFF));
    uint32x4_t sign = vandq_u32(vshrq_n_u32(x, 24), vdupq_n_u32(0x80));
    uint32x4_t sub = vcltq_u32(a, vdupq_n_u32((uint32_t)(128 - f.bias) << 23));
    uint32x4_t v_norm = vsubq_u32(a, vdupq_n_u32((uint32_t)(127 - f.bias) << 23));
    uint32x4_t v_sub = vorrq_u32(vandq_u32(a, vdupq_n_u32(0x7FFFFF)), vdupq_n_u32(0x800000));
    int32x4_t sh_sub = vminq_s32(
        vsubq_s32(vdupq_n_s32(151 - f.bias - f.mbits), vreinterpretq_s32_u32(vshrq_n_u32(a, 23))),
        vdupq_n_s32(25));
    uint32x4_t v = vbslq_u32(sub, v_sub, v_norm);
    int32x4_t sh = vbslq_s32(sub, sh_sub, vdupq_n_s32(23 - f.mbits));
    int32x4_t neg_sh = vnegq_s32(sh);
    uint32x4_t lsb = vandq_u32(vshlq_u32(v, neg_sh), one);
    uint32x4_t half_m1 = vsubq_u32(vshlq_u32(one, vsubq_s32(sh, vdupq_n_s32(1))), one);
    uint32x4_t code = vshlq_u32(vaddq_u32(vaddq_u32(v, half_m1), lsb), neg_sh);
    uint32x4_t ovf = vcgtq_u32(code, vdupq_n_u32(f.max_code));
    code = vbslq_u32(ovf, vdupq_n_u32(saturate ? f.max_code : f.ovf_code), code);
    uint32x4_t nan = vcgtq_u32(a, vdupq_n_u32(0x7F800000));
    code = vbslq_u32(nan, vdupq_n_u32(f.nan_code), code);
    return vorrq_u32(code, sign);
}

static inline uint32x4_t load_scaled_neon(const float *p, int scaled, float32x4_t scale)
{
    float32x4_t x = vld1q_f32(p);
    return vreinterpretq_u32_f32(scaled ? vdivq_f32(x, scale) : x);
}

KV_FP8_INLINE void f32_to_fp8_neon_fmt(const kv_fp8_fmt f, int fmt, const float *src,
                                       uint8_t *dst, ptrdiff_t n, float scale, int saturate)
{
    const float32x4_t vscale = vdupq_n_f32(scale);
    const int scaled = scale != 1.0f;
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint32x4_t a = fp8x4_neon(load_scaled_neon(src + i, scaled, vscale), f, saturate);
        uint32x4_t b = fp8x4_neon(load_scaled_neon(src + i + 4, scaled, vscale), f, saturate);
        vst1_u8(dst + i, vmovn_u16(vcombine_u16(vmovn_u32(a), vmovn_u32(b))));
    }
    f32_to_fp8_scalar(fmt, src + i, dst + i, n - i, scale, saturate);
}

KV_FP8_INLINE float32x4_t f32x4_from_fp8_neon(uint32x4_t b, const kv_fp8_fmt f)
{
    uint32x4_t mag = vandq_u32(b, vdupq_n_u32(0x7F));
    uint32x4_t sign = vshlq_n_u32(vandq_u32(b, vdupq_n_u32(0x80)), 24);
    uint32x4_t normal = vaddq_u32(vshlq_u32(mag, vdupq_n_s32(23 - f.mbits)),
                                  vdupq_n_u32((uint32_t)(127 - f.bias) << 23));
    float32x4_t subf = vmulq_f32(vcvtq_f32_u32(mag),
                                 vdupq_n_f32(f.sub_unit));
    uint32x4_t sub = vcltq_u32(mag, vdupq_n_u32(1u << f.mbits));
    uint32x4_t r = vbslq_u32(sub, vreinterpretq_u32_f32(subf), normal);
    r = vbslq_u32(vceqq_u32(mag, vdupq_n_u32(f.inf_mag)), vdupq_n_u32(0x7F800000), r);
    r = vbslq_u32(vcgtq_u32(mag, vdupq_n_u32(f.max_mag)), vdupq_n_u32(0x7FC00000), r);
    return vreinterpretq_f32_u32(vorrq_u32(r, sign));
}

KV_FP8_INLINE void fp8_to_f32_neon_fmt(const kv_fp8_fmt f, int fmt, const uint8_t *src,
                                       float *dst, ptrdiff_t n, float scale)
{
    const float32x4_t vscale = vdupq_n_f32(scale);
    const int scaled = scale != 1.0f;
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16x8_t h = vmovl_u8(vld1_u8(src + i));
        float32x4_t lo = f32x4_from_fp8_neon(vmovl_u16(vget_low_u16(h)), f);
        float32x4_t hi = f32x4_from_fp8_neon(vmovl_high_u16(h), f);
        vst1q_f32(dst + i, scaled ? vmulq_f32(lo, vscale) : lo);
        vst1q_f32(dst + i + 4, scaled ? vmulq_f32(hi, vscale) : hi);
    }
    fp8_to_f32_scalar(fmt, src + i, dst + i, n - i, scale);
}

static void f32_to_fp8_neon(int fmt, const float *src, uint8_t *dst, ptrdiff_t n, float scale,
                            int saturate)
{
    if (fmt == KV_FP8_E4M3)
        f32_to_fp8_neon_fmt(KV_E4M3, fmt, src, dst, n, scale, saturate);
    else
        f32_to_fp8_neon_fmt(KV_E5M2, fmt, src, dst, n, scale, saturate);
}

static void fp8_to_f32_neon(int fmt, const uint8_t *src, float *dst, ptrdiff_t n, float scale)
{
    if (fmt == KV_FP8_E4M3)
        fp8_to_f32_neon_fmt(KV_E4M3, fmt, src, dst, n, scale);
    else
        fp8_to_f32_neon_fmt(KV_E5M2, fmt, src, dst, n, scale);
}

static uint32_t amax_bits_neon(const float *src, ptrdiff_t n)
{
    uint32x4_t m = vdupq_n_u32(0);
    ptrdiff_t i = 0;
    for (; i + 4 <= n; i += 4)
        m = vmaxq_u32(m, vandq_u32(vld1q_u32((const uint32_t *)(src + i)), vdupq_n_u32(0x7FFFFFFF)));
    uint32_t best = vmaxvq_u32(m);
    uint32_t rest = amax_bits_scalar(src + i, n - i);
    return rest > best ? rest : best;
}

static inline int32x4_t i8x4_neon(const float *p, float32x4_t scale)
{
    /* FRINTN: to nearest, ties to even, whatever the FPCR says */
    float32x4_t q = vrndnq_f32(vdivq_f32(vld1q_f32(p), scale));
    q = vmaxq_f32(vminq_f32(q, vdupq_n_f32(127.0f)), vdupq_n_f32(-127.0f));
    return vcvtq_s32_f32(q);
}

static void i8_quantize_neon(const float *src, int8_t *dst, ptrdiff_t n, float scale)
{
    const float32x4_t vscale = vdupq_n_f32(scale);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        int16x8_t w = vcombine_s16(vmovn_s32(i8x4_neon(src + i, vscale)),
                                   vmovn_s32(i8x4_neon(src + i + 4, vscale)));
        vst1_s8(dst + i, vmovn_s16(w));
    }
    i8_quantize_scalar(src + i, dst + i, n - i, scale);
}

static void i8_to_f32_neon(const int8_t *src, float *dst, ptrdiff_t n, float scale)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        int16x8_t h = vmovl_s8(vld1_s8(src + i));
        vst1q_f32(dst + i, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), scale));
        vst1q_f32(dst + i + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(h)), scale));
    }
    i8_to_f32_scalar(src + i, dst + i, n - i, scale);
}

#endif /* KV_FP8_NEON */

/* ------------------------------------------------------------------ */
/* Dispatch on kv_half's level                                         */
/* ------------------------------------------------------------------ */

const char *kvh_fp8_path(int level)
{
    switch (level) {
    case KVH_SCALAR: case KVH_F16C: return "scalar";
    case KVH_AVX2: return "avx2";
    case KVH_NEON: return "neon";
    default: return NULL;
    }
}

void kvh_f32_to_fp8(int fmt, const float *src, uint8_t *dst, ptrdiff_t n,
                    float scale, int saturate)
{
    switch (kvh_current_level()) {
#if KV_FP8_X86
    case KVH_AVX2: f32_to_fp8_avx2(fmt, src, dst, n, scale, saturate); return;
#endif
#if KV_FP8_NEON
    case KVH_NEON: f32_to_fp8_neon(fmt, src, dst, n, scale, saturate); return;
#endif
    default: f32_to_fp8_scalar(fmt, src, dst, n, scale, saturate);
    }
}

void kvh_fp8_to_f32(int fmt, const uint8_t *src, float *dst, ptrdiff_t n, float scale)
{
    switch (kvh_current_level()) {
#if KV_FP8_X86
    case KVH_AVX2: fp8_to_f32_avx2(fmt, src, dst, n, scale); return;
#endif
#if KV_FP8_NEON
    case KVH_NEON: fp8_to_f32_neon(fmt, src, dst, n, scale); return;
#endif
    default: fp8_to_f32_scalar(fmt, src, dst, n, scale);
    }
}

void kvh_f32_to_fp8_rows(int fmt, const float *src, ptrdiff_t src_stride, uint8_t *dst,
                         ptrdiff_t dst_stride, ptrdiff_t rows, ptrdiff_t n, float scale,
                         int saturate, int stream)
{
#if KV_FP8_X86
    if (kvh_current_level() == KVH_AVX2) {
        f32_to_fp8_rows_avx2(fmt, (const char *)src, src_stride, dst, dst_stride, rows, n, scale,
                             saturate, stream);
        return;
    }
#endif
    (void)stream;
    for (ptrdiff_t r = 0; r < rows; r++)
        kvh_f32_to_fp8(fmt, (const float *)((const char *)src + r * src_stride),
                       dst + r * dst_stride, n, scale, saturate);
}

void kvh_f32_to_i8_rows(const float *src, ptrdiff_t src_stride, int8_t *dst,
                        ptrdiff_t dst_stride, float *scales, ptrdiff_t scale_stride,
                        ptrdiff_t rows, ptrdiff_t n, int stream)
{
#if KV_FP8_X86
    if (kvh_current_level() == KVH_AVX2) {
        f32_to_i8_rows_avx2((const char *)src, src_stride, dst, dst_stride, scales, scale_stride,
                            rows, n, stream);
        return;
    }
#endif
    (void)stream;
    for (ptrdiff_t r = 0; r < rows; r++)
        scales[r * scale_stride] = kvh_f32_to_i8_row(
            (const float *)((const char *)src + r * src_stride), dst + r * dst_stride, n);
}

float kvh_f32_to_i8_row(const float *src, int8_t *dst, ptrdiff_t n)
{
    int level = kvh_current_level();
    uint32_t amax;
#if KV_FP8_X86
    if (level == KVH_AVX2)
        amax = amax_bits_avx2(src, n);
    else
#endif
#if KV_FP8_NEON
    if (level == KVH_NEON)
        amax = amax_bits_neon(src, n);
    else
#endif
        amax = amax_bits_scalar(src, n);
    float scale = i8_row_scale(amax);
    if (amax == 0 || amax >= 0x7F800000u) {     /* all zeros, or not finite */
        if (n > 0)   /* (dst may be NULL when n is 0) */
            memset(dst, 0, (size_t)n);
        return scale;
    }
#if KV_FP8_X86
    if (level == KVH_AVX2) {
        i8_quantize_avx2(src, dst, n, scale);
        return scale;
    }
#endif
#if KV_FP8_NEON
    if (level == KVH_NEON) {
        i8_quantize_neon(src, dst, n, scale);
        return scale;
    }
#endif
    (void)level;
    i8_quantize_scalar(src, dst, n, scale);
    return scale;
}

void kvh_i8_to_f32(const int8_t *src, float *dst, ptrdiff_t n, float scale)
{
    switch (kvh_current_level()) {
#if KV_FP8_X86
    case KVH_AVX2: i8_to_f32_avx2(src, dst, n, scale); return;
#endif
#if KV_FP8_NEON
    case KVH_NEON: i8_to_f32_neon(src, dst, n, scale); return;
#endif
    default: i8_to_f32_scalar(src, dst, n, scale);
    }
}
