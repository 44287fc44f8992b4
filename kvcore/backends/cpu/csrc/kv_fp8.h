/*
 * kv_fp8: the scalar definition of float32 <-> fp8 (e4m3fn, e5m2).
 *
 * Header-only (static inline) so that every C kernel of kvcore -- the bulk
 * conversions, the paged writers and the attention loaders -- uses the one
 * definition, and every SIMD path is checked against it.
 *
 * Narrowing: round to nearest, ties to even, on the exact float32 value;
 * bit-identical to ml_dtypes' astype for every non-NaN float32.
 *   e4m3fn (bias 7, no infinities, S.1111.111 is NaN, max 448):
 *     non-saturating: anything that rounds past 448 (and +-inf) -> NaN of the
 *     input's sign (0x7F / 0xFF), as ml_dtypes does;
 *     saturating: -> +-448 (0x7E / 0xFE), +-inf included.
 *   e5m2 (bias 15, IEEE-like, max 57344):
 *     non-saturating: overflow -> +-inf (0x7C / 0xFC);
 *     saturating: overflow and +-inf -> +-57344 (0x7B / 0xFB).
 *   NaN -> NaN of the same sign: 0x7F|s (e4m3fn), 0x7E|s (e5m2), ml_dtypes'
 *   choice.  Subnormals kept, +-0 kept.
 * Widening is exact; every fp8 NaN widens to the quiet float32 NaN of its
 * sign (0x7FC00000 | s).
 *
 * No function here touches the Python API.
 */
#ifndef KV_FP8_H
#define KV_FP8_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Right-shift `m` by `sh` (>= 1) with round to nearest, ties to even. */
static inline uint32_t kv_fp8_shift_rne(uint32_t m, int sh)
{
    if (sh >= 32)
        return 0;
    uint32_t q = m >> sh;
    uint32_t rem = m & ((1u << sh) - 1u);
    uint32_t half = 1u << (sh - 1);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return q;
}

/* float32 bits -> fp8 with `ebits` exponent bits, `mbits` mantissa bits,
 * bias `bias`; the magnitude code before overflow handling (may exceed the
 * format's finite range; the callers below decide what overflow means).
 * `a` is the float32 magnitude bits, finite. */
static inline uint32_t kv_fp8_magnitude(uint32_t a, int mbits, int bias)
{
    int e = (int)(a >> 23) - 127;              /* unbiased exponent */
    uint32_t mant = a & 0x7FFFFFu;
    if ((a >> 23) == 0)                        /* float32 zero or subnormal: */
        return 0;                              /* < 2^-126, rounds to 0 */
    if (e < 1 - bias) {                        /* target subnormal (or 0) */
        /* value = (2^23 + mant) * 2^(e-23); quantum 2^(1-bias-mbits) */
        int sh = (1 - bias - mbits) - (e - 23);
        return kv_fp8_shift_rne(0x800000u | mant, sh);
    }
    /* normal: exponent field e+bias, mantissa rounded from 23 to mbits bits;
     * a carry out of the mantissa lands in the exponent, as it should. */
    uint32_t code = ((uint32_t)(e + bias) << mbits) | (mant >> (23 - mbits));
    uint32_t rem = mant & ((1u << (23 - mbits)) - 1u);
    uint32_t half = 1u << (22 - mbits);
    if (rem > half || (rem == half && (code & 1u)))
        code++;
    return code;
}

static inline uint32_t kv_fp8_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float kv_fp8_float(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* float32 bits -> the bits of an fp8 format of mbits mantissa bits and
 * exponent bias `bias`: `nan` is its NaN code, `overflow` the code just past
 * its largest finite one (what an overflow gives unless saturated, the
 * largest finite code then: both formats put that code at overflow - 1);
 * magnitudes of float32 bits >= too_big (a power of two far past the
 * largest) are clamped before the shift arithmetic.  Inlined with constant
 * formats, each of the two below compiles to its own straight code. */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline uint8_t kv_f32_to_fp8_one(uint32_t bits, int saturate, int mbits, int bias,
                                        uint32_t too_big, uint32_t nan, uint32_t overflow)
{
    uint32_t s = (bits >> 24) & 0x80u;
    uint32_t a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return (uint8_t)(s | nan);
    if (a == 0x7F800000u)
        return (uint8_t)(s | (saturate ? overflow - 1u : overflow));
    uint32_t code = a >= too_big ? 0x80u : kv_fp8_magnitude(a, mbits, bias);
    if (code >= overflow)
        code = saturate ? overflow - 1u : overflow;
    return (uint8_t)(s | code);
}

/* float32 bits -> e4m3fn bits (no infinity: an overflow is the NaN code
 * 0x7F, or 448 = 0x7E saturated; 2^9 is far past 448). */
static inline uint8_t kv_f32_to_e4m3_one(uint32_t bits, int saturate)
{
    return kv_f32_to_fp8_one(bits, saturate, 3, 7, 0x44000000u, 0x7Fu, 0x7Fu);
}

/* float32 bits -> e5m2 bits (NaN 0x7E; an overflow is infinity 0x7C, or
 * 57344 = 0x7B saturated; 2^17 is far past 57344). */
static inline uint8_t kv_f32_to_e5m2_one(uint32_t bits, int saturate)
{
    return kv_f32_to_fp8_one(bits, saturate, 2, 15, 0x48000000u, 0x7Eu, 0x7Cu);
}

/* e4m3fn bits -> float32 bits (exact). */
static inline uint32_t kv_e4m3_to_f32_one(uint8_t b)
{
    uint32_t s = (uint32_t)(b & 0x80u) << 24;
    uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
    if (e == 0xFu && m == 0x7u)
        return s | 0x7FC00000u;
    if (e == 0) {                               /* subnormal: m * 2^-9 */
        float v = (float)m * (1.0f / 512.0f);
        return s | kv_fp8_bits(v);
    }
    return s | ((e + 120u) << 23) | (m << 20);
}

/* e5m2 bits -> float32 bits (exact). */
static inline uint32_t kv_e5m2_to_f32_one(uint8_t b)
{
    uint32_t s = (uint32_t)(b & 0x80u) << 24;
    uint32_t e = (b >> 2) & 0x1Fu, m = b & 0x3u;
    if (e == 0x1Fu)
        return s | (m ? 0x7FC00000u : 0x7F800000u);
    if (e == 0) {                               /* subnormal: m * 2^-16 */
        float v = (float)m * (1.0f / 65536.0f);
        return s | kv_fp8_bits(v);
    }
    return s | ((e + 112u) << 23) | (m << 21);
}

/* ---- bulk conversions (kv_fp8.c) -------------------------------------------
 * The one C interface for fp8/int8 data movement; every path (scalar or SIMD,
 * chosen at run time with the level of kv_half.h) gives the bits of the
 * scalar definitions above.  n contiguous elements.  fmt: KV_FP8_E4M3 or
 * KV_FP8_E5M2.  `scale` is the pool's per-layer scale: narrowing stores
 * fp8(x / scale) (exactly x when scale == 1.0f), widening returns
 * fp8 * scale (exact when scale == 1.0f).  saturate: see above. */
enum { KV_FP8_E4M3 = 0, KV_FP8_E5M2 = 1 };

#ifdef __cplusplus
extern "C" {
#endif
void kvh_f32_to_fp8(int fmt, const float *src, uint8_t *dst, ptrdiff_t n,
                    float scale, int saturate);
void kvh_fp8_to_f32(int fmt, const uint8_t *src, float *dst, ptrdiff_t n, float scale);
/* The fp8/int8 code path level `level` of kv_half.h runs: "scalar", "avx2"
 * or "neon" (levels without fp8 instructions run the scalar path); NULL
 * when out of range.  For tests, which check each path once. */
const char *kvh_fp8_path(int level);

/* int8, symmetric, one scale per row of n elements (a token's head):
 * scale = max|x| / 127 (1.0f when the row is all zeros; 2^-149, the
 * smallest subnormal, when that quotient underflows to 0), stored
 * round_half_even(x / scale) clamped to [-127, 127].  A row holding a NaN or
 * an infinity stores scale = NaN and zeros, so it reads back as NaN (never as
 * plausible numbers).  Returns the scale. */
float kvh_f32_to_i8_row(const float *src, int8_t *dst, ptrdiff_t n);
void kvh_i8_to_f32(const int8_t *src, float *dst, ptrdiff_t n, float scale);

/* The paged writes' shape: `rows` rows of n float32 elements, row r at
 * src + r * src_stride and its codes at dst + r * dst_stride (strides in
 * bytes), the bits of the one-row calls above, row by row (int8: row r's
 * scale to scales[r * scale_stride]).  `stream` asks for non-temporal
 * stores where a row allows them (large scattered writes); the caller then
 * calls kvh_stream_fence() (kv_half.h) once after the last of a batch. */
void kvh_f32_to_fp8_rows(int fmt, const float *src, ptrdiff_t src_stride, uint8_t *dst,
                         ptrdiff_t dst_stride, ptrdiff_t rows, ptrdiff_t n, float scale,
                         int saturate, int stream);
void kvh_f32_to_i8_rows(const float *src, ptrdiff_t src_stride, int8_t *dst,
                        ptrdiff_t dst_stride, float *scales, ptrdiff_t scale_stride,
                        ptrdiff_t rows, ptrdiff_t n, int stream);
#ifdef __cplusplus
}
#endif

#endif
