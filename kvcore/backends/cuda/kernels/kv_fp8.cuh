/*
 * kv_fp8.cuh: the float32 <-> fp8 rules of every kvcore CUDA kernel
 * (FMT 0 = e4m3fn, 1 = e5m2), shared by convert_fp8.cu (bulk conversions)
 * and lowprec.cu (fp8 pools).  The rules of
 * kvcore/backends/cpu/csrc/kv_fp8.h, in integer arithmetic on the bits (so
 * no FTZ or fast-math flag can change a result): narrowing rounds to
 * nearest even; overflow (and +-inf) gives NaN (e4m3fn) or +-inf (e5m2),
 * or the largest finite value with SAT; NaN gives 0x7F|s (e4m3fn) or
 * 0x7E|s (e5m2).  Widening is exact; every NaN code gives 0x7FC00000|s.
 *
 * Pasted by the loader (_sources.py) like kv_half.cuh, which it needs.
 */
#ifndef KVCORE_KV_FP8_CUH
#define KVCORE_KV_FP8_CUH

#include "kv_half.cuh"

typedef unsigned char kv_u8;

/* The constants of a format: mantissa bits, bias, largest finite code,
 * overflow code without saturation, NaN code. */
template <int FMT> struct KvFp8;
template <> struct KvFp8<0> {
    enum { MBITS = 3, BIAS = 7, MAX_CODE = 0x7E, OVF_CODE = 0x7F, NAN_CODE = 0x7F };
};
template <> struct KvFp8<1> {
    enum { MBITS = 2, BIAS = 15, MAX_CODE = 0x7B, OVF_CODE = 0x7C, NAN_CODE = 0x7E };
};

/* float32 bits -> fp8 code: one round-to-nearest-even right shift of the
 * re-biased bits (normal result) or of the whole significand (subnormal
 * result; a shift of 25 leaves 0 of anything, float32 subnormals included). */
template <int FMT, int SAT>
KV_HD kv_u8 kv_f32_to_fp8_one(kv_u32 x)
{
    typedef KvFp8<FMT> F;
    kv_u32 a = x & 0x7FFFFFFFu, sign = (x >> 24) & 0x80u;
    if (a > 0x7F800000u)
        return (kv_u8)(sign | F::NAN_CODE);
    kv_u32 v;
    int sh;
    if (a < ((kv_u32)(128 - F::BIAS) << 23)) {
        v = (a & 0x7FFFFFu) | 0x800000u;
        sh = 151 - F::BIAS - F::MBITS - (int)(a >> 23);
        sh = sh > 25 ? 25 : sh;
    } else {
        v = a - ((kv_u32)(127 - F::BIAS) << 23);
        sh = 23 - F::MBITS;
    }
    kv_u32 code = (v + ((1u << (sh - 1)) - 1u) + ((v >> sh) & 1u)) >> sh;
    if (code > (kv_u32)F::MAX_CODE)
        code = SAT ? F::MAX_CODE : F::OVF_CODE;
    return (kv_u8)(sign | code);
}

/* fp8 code -> float32 bits (exact). */
template <int FMT>
KV_HD kv_u32 kv_fp8_to_f32_one(kv_u8 b)
{
    typedef KvFp8<FMT> F;
    kv_u32 sign = (kv_u32)(b & 0x80u) << 24, mag = b & 0x7Fu;
    if (FMT == 0 ? mag == 0x7Fu : mag > 0x7Cu)
        return sign | 0x7FC00000u;
    if (FMT == 1 && mag == 0x7Cu)
        return sign | 0x7F800000u;
    if (mag >= (1u << F::MBITS))   /* normal: re-bias the exponent */
        return sign | ((mag << (23 - F::MBITS)) + ((kv_u32)(127 - F::BIAS) << 23));
    if (mag == 0)
        return sign;
    /* subnormal m * 2^(1-bias-mbits): normalise with integer shifts */
    kv_u32 e = 128 - F::BIAS;
    while ((mag & (1u << F::MBITS)) == 0) {
        mag <<= 1;
        --e;
    }
    return sign | (e << 23) | ((mag & ((1u << F::MBITS) - 1u)) << (23 - F::MBITS));
}

#endif /* KVCORE_KV_FP8_CUH */
