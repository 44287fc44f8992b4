/*
 * kv_fp8: bulk float32 <-> fp8 / int8 conversions (see kv_fp8.h).
 *
 * Scalar loops over the one definition in kv_fp8.h.  SIMD paths, when added,
 * dispatch on the level of kv_half.h and must give the same bits.
 */
#include <math.h>

#include "kv_fp8.h"

void kvh_f32_to_fp8(int fmt, const float *src, uint8_t *dst, ptrdiff_t n,
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

void kvh_fp8_to_f32(int fmt, const uint8_t *src, float *dst, ptrdiff_t n, float scale)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        float v = kv_fp8_float(fmt == KV_FP8_E4M3 ? kv_e4m3_to_f32_one(src[i])
                                                  : kv_e5m2_to_f32_one(src[i]));
        dst[i] = scale == 1.0f ? v : v * scale;
    }
}

float kvh_f32_to_i8_row(const float *src, int8_t *dst, ptrdiff_t n)
{
    ptrdiff_t i;
    float amax = 0.0f;
    int finite = 1;
    for (i = 0; i < n; i++) {
        float a = fabsf(src[i]);
        if (!(a <= 3.40282347e+38f))    /* NaN or inf */
            finite = 0;
        else if (a > amax)
            amax = a;
    }
    if (!finite) {
        for (i = 0; i < n; i++) dst[i] = 0;
        return NAN;
    }
    if (amax == 0.0f) {
        for (i = 0; i < n; i++) dst[i] = 0;
        return 1.0f;
    }
    float scale = amax / 127.0f;
    for (i = 0; i < n; i++) {
        float q = nearbyintf(src[i] / scale);   /* ties to even (default mode) */
        if (q > 127.0f) q = 127.0f;
        if (q < -127.0f) q = -127.0f;
        dst[i] = (int8_t)q;
    }
    return scale;
}

void kvh_i8_to_f32(const int8_t *src, float *dst, ptrdiff_t n, float scale)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++) dst[i] = (float)src[i] * scale;
}
