/*
 * kv_half.c: see kv_half.h for the contract.
 *
 * Build notes: this file is compiled without any -m flags, so the wheel runs
 * on every x86-64 (and aarch64) CPU.  The SIMD bodies carry
 * __attribute__((target(...))) and are only called after
 * __builtin_cpu_supports() said yes.
 */
#include "kv_half.h"
#include "kv_simd.h"
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define KVH_X86 1
#include <immintrin.h>
#else
#define KVH_X86 0
#endif

/* AdvSIMD (NEON) is part of every AArch64 CPU: no run-time check needed. */
#if defined(__aarch64__)
#define KVH_NEON_ON 1
#include <arm_neon.h>
#else
#define KVH_NEON_ON 0
#endif

/* ------------------------------------------------------------------ */
/* Scalar reference                                                    */
/* ------------------------------------------------------------------ */

uint16_t kvh_f32_to_f16_one(uint32_t x)
{
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        if (ax == 0x7f800000u)
            return (uint16_t)(sign | 0x7c00u);
        /* Quiet NaN, top 10 payload bits kept: the same bits as VCVTPS2PH. */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) /* >= 65520 rounds up to 2^16: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) { /* result is a normal half (>= 2^-14) */
        /* Re-bias the exponent (127 -> 15) in place, then round the 13
         * dropped mantissa bits to nearest even; a carry into the exponent
         * is the correct result (1.11..1 rounds to the next power of two). */
        uint32_t m = ax - 0x38000000u;
        m += 0x0fffu + ((m >> 13) & 1u);
        return (uint16_t)(sign | (m >> 13));
    }
    /* Result is a half subnormal (unit 2^-24) or zero. */
    {
        uint32_t e = ax >> 23;
        if (e < 102u) /* below 2^-25: rounds to zero */
            return (uint16_t)sign;
        {
            /* value = mant * 2^(e-150); in units of 2^-24 that is mant >> (126-e).
             * e == 0 cannot reach here (e >= 102). */
            uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
            uint32_t shift = 126u - e; /* 14..24 */
            uint32_t r = mant >> shift;
            uint32_t rem = mant & ((1u << shift) - 1u);
            uint32_t half = 1u << (shift - 1u);
            if (rem > half || (rem == half && (r & 1u)))
                r += 1u;
            return (uint16_t)(sign | r);
        }
    }
}

uint16_t kvh_f32_to_bf16_one(uint32_t x)
{
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x0040u); /* quiet NaN, same sign */
    /* RNE on the low 16 bits; the carry into the exponent gives +-inf on
     * overflow, which is what RNE asks for. */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

uint32_t kvh_f16_to_f32_one(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t m = (uint32_t)h & 0x3ffu;
    if (e == 0x1fu) {
        if (m == 0)
            return sign | 0x7f800000u;
        return sign | 0x7fc00000u | (m << 13); /* quieted, as VCVTPH2PS does */
    }
    if (e == 0) {
        if (m == 0)
            return sign;
        /* Subnormal: normalise with integer shifts so that no FTZ/DAZ mode
         * of the calling thread can change the result. */
        e = 113u; /* exponent of 2^-14 in float32 is 113 */
        while ((m & 0x400u) == 0) {
            m <<= 1;
            e -= 1u;
        }
        m &= 0x3ffu;
        return sign | (e << 23) | (m << 13);
    }
    return sign | ((e + 112u) << 23) | (m << 13);
}

uint32_t kvh_bf16_to_f32_one(uint16_t b) { return (uint32_t)b << 16; }

static void f32_to_f16_scalar(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t x;
        memcpy(&x, src + i, 4);
        dst[i] = kvh_f32_to_f16_one(x);
    }
}

static void f32_to_bf16_scalar(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t x;
        memcpy(&x, src + i, 4);
        dst[i] = kvh_f32_to_bf16_one(x);
    }
}

static void f16_to_f32_scalar(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t x = kvh_f16_to_f32_one(src[i]);
        memcpy(dst + i, &x, 4);
    }
}

static void bf16_to_f32_scalar(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t x = (uint32_t)src[i] << 16;
        memcpy(dst + i, &x, 4);
    }
}

/* ------------------------------------------------------------------ */
/* x86 SIMD paths                                                      */
/* ------------------------------------------------------------------ */
#if KVH_X86

#define KVH_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Outputs of at least this many elements are written with non-temporal
 * stores: they would not stay in the cache anyway, and streaming them skips
 * the read-for-ownership of every destination line (a third less traffic
 * for narrowing).  The bits written are the same either way. */
#define KVH_STREAM_MIN ((ptrdiff_t)1 << 20)

static inline int kvh_streaming(const uint16_t *dst, ptrdiff_t n, int stream)
{
    return (stream || n >= KVH_STREAM_MIN) && ((uintptr_t)dst & 1) == 0;
}

static inline int kvh_streaming32(const float *dst, ptrdiff_t n, int stream)
{
    return (stream || n >= KVH_STREAM_MIN) && ((uintptr_t)dst & 3) == 0;
}

/* Elements before a float32 dst reaches 32-byte alignment. */
static inline ptrdiff_t kvh_stream_head32(const float *dst, ptrdiff_t n)
{
    ptrdiff_t h = (ptrdiff_t)(((32 - ((uintptr_t)dst & 31)) & 31) / 4);
    return h < n ? h : n;
}

/* Elements before dst reaches `align` bytes (a power of two), at most n. */
static inline ptrdiff_t kvh_stream_head(const uint16_t *dst, size_t align, ptrdiff_t n)
{
    ptrdiff_t h = (ptrdiff_t)(((align - ((uintptr_t)dst & (align - 1))) & (align - 1)) / 2);
    return h < n ? h : n;
}

/* F16C with 256-bit AVX registers (Ivy Bridge and later). */
__attribute__((target("avx,f16c")))
static void f32_to_f16_f16c(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    if (kvh_streaming(dst, n, stream)) {
        /* large output: non-temporal stores skip reading dst into the cache */
        i = kvh_stream_head(dst, 16, n);
        f32_to_f16_scalar(src, dst, i, 0);
        for (; i + 8 <= n; i += 8)
            _mm_stream_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), KVH_RNE));
        if (!stream)
            _mm_sfence(); /* else the caller fences once */
    } else {
        for (; i + 16 <= n; i += 16) {
            __m256 a = _mm256_loadu_ps(src + i);
            __m256 b = _mm256_loadu_ps(src + i + 8);
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(a, KVH_RNE));
            _mm_storeu_si128((__m128i *)(dst + i + 8), _mm256_cvtps_ph(b, KVH_RNE));
        }
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), KVH_RNE));
    }
    f32_to_f16_scalar(src + i, dst + i, n - i, 0);
}

__attribute__((target("avx,f16c")))
static void f16_to_f32_f16c(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    if (kvh_streaming32(dst, n, stream)) {
        i = kvh_stream_head32(dst, n);
        f16_to_f32_scalar(src, dst, i, 0);
        for (; i + 8 <= n; i += 8)
            _mm256_stream_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
        if (!stream)
            _mm_sfence(); /* else the caller fences once */
    } else {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 8));
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(a));
            _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(b));
        }
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    }
    f16_to_f32_scalar(src + i, dst + i, n - i, 0);
}

/* bf16 at the F16C level: 128-bit integer ops (SSE4.1 for packus_epi32;
 * every F16C CPU has it). */
__attribute__((target("sse4.1")))
static void f32_to_bf16_sse41(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    const __m128i bias = _mm_set1_epi32(0x7fff);
    const __m128i one = _mm_set1_epi32(1);
    const __m128i absmask = _mm_set1_epi32(0x7fffffff);
    const __m128i inf = _mm_set1_epi32(0x7f800000);
    const __m128i quiet = _mm_set1_epi32(0x0040);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i r[2];
        for (int j = 0; j < 2; j++) {
            __m128i x = _mm_loadu_si128((const __m128i *)(src + i + 4 * j));
            __m128i hi = _mm_srli_epi32(x, 16);
            __m128i rounded = _mm_srli_epi32(
                _mm_add_epi32(_mm_add_epi32(x, bias), _mm_and_si128(hi, one)), 16);
            __m128i isnan = _mm_cmpgt_epi32(_mm_and_si128(x, absmask), inf);
            __m128i nanv = _mm_or_si128(hi, quiet);
            r[j] = _mm_blendv_epi8(rounded, nanv, isnan);
        }
        /* values are in [0, 0xffff], so the signed->unsigned saturation of
         * packus never triggers */
        _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi32(r[0], r[1]));
    }
    f32_to_bf16_scalar(src + i, dst + i, n - i, 0);
}

__attribute__((target("sse2")))
static void bf16_to_f32_sse2(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    const __m128i zero = _mm_setzero_si128();
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i x = _mm_loadu_si128((const __m128i *)(src + i));
        _mm_storeu_si128((__m128i *)(dst + i), _mm_unpacklo_epi16(zero, x));
        _mm_storeu_si128((__m128i *)(dst + i + 4), _mm_unpackhi_epi16(zero, x));
    }
    bf16_to_f32_scalar(src + i, dst + i, n - i, 0);
}

/* 16 float32 -> 16 bf16 (RNE, NaN -> quiet NaN of the same sign). */
__attribute__((target("avx2")))
static inline __m256i bf16x16_avx2(const float *src)
{
    const __m256i bias = _mm256_set1_epi32(0x7fff);
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i quiet = _mm256_set1_epi32(0x0040);
    __m256i r[2];
    for (int j = 0; j < 2; j++) {
        __m256 f = _mm256_loadu_ps(src + 8 * j);
        __m256i x = _mm256_castps_si256(f);
        __m256i hi = _mm256_srli_epi32(x, 16);
        __m256i rounded = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_and_si256(hi, one)), 16);
        /* unordered with itself <=> NaN; a quiet compare raises nothing */
        __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        __m256i nanv = _mm256_or_si256(hi, quiet);
        r[j] = _mm256_blendv_epi8(rounded, nanv, isnan);
    }
    /* packus works within 128-bit lanes: fix the order with a permute */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
}

__attribute__((target("avx2")))
static void f32_to_bf16_avx2(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    if (kvh_streaming(dst, n, stream)) {
        /* large output: non-temporal stores skip reading dst into the cache */
        i = kvh_stream_head(dst, 32, n);
        f32_to_bf16_scalar(src, dst, i, 0);
        for (; i + 16 <= n; i += 16)
            _mm256_stream_si256((__m256i *)(dst + i), bf16x16_avx2(src + i));
        if (!stream)
            _mm_sfence(); /* else the caller fences once */
    } else {
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(dst + i), bf16x16_avx2(src + i));
    }
    f32_to_bf16_sse41(src + i, dst + i, n - i, 0);
}

__attribute__((target("avx2")))
static void bf16_to_f32_avx2(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    if (kvh_streaming32(dst, n, stream)) {
        i = kvh_stream_head32(dst, n);
        bf16_to_f32_scalar(src, dst, i, 0);
        for (; i + 8 <= n; i += 8) {
            __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_stream_si256((__m256i *)(dst + i), _mm256_slli_epi32(a, 16));
        }
        if (!stream)
            _mm_sfence(); /* else the caller fences once */
    } else {
        for (; i + 16 <= n; i += 16) {
            __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i + 8)));
            _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(a, 16));
            _mm256_storeu_si256((__m256i *)(dst + i + 8), _mm256_slli_epi32(b, 16));
        }
    }
    bf16_to_f32_sse2(src + i, dst + i, n - i, 0);
}

#endif /* KVH_X86 */


/* ------------------------------------------------------------------ */
/* AArch64 NEON paths                                                  */
/* ------------------------------------------------------------------ */
#if KVH_NEON_ON

/* FCVTN/FCVTL round to nearest even under the default FPCR (as Linux starts
 * every thread), keep subnormals, and turn a NaN into a quiet NaN with the
 * top payload bits: the same bits as the scalar path. */
static void f32_to_f16_neon(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    (void)stream;
    for (; i + 8 <= n; i += 8) {
        float16x4_t a = vcvt_f16_f32(vld1q_f32(src + i));
        float16x4_t b = vcvt_f16_f32(vld1q_f32(src + i + 4));
        vst1q_u16(dst + i, vreinterpretq_u16_f16(vcombine_f16(a, b)));
    }
    f32_to_f16_scalar(src + i, dst + i, n - i, 0);
}

static void f16_to_f32_neon(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    (void)stream;
    for (; i + 8 <= n; i += 8) {
        float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(src + i));
        vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(h)));
        vst1q_f32(dst + i + 4, vcvt_high_f32_f16(h));
    }
    f16_to_f32_scalar(src + i, dst + i, n - i, 0);
}

static inline uint16x4_t bf16x4_neon(uint32x4_t x)
{
    const uint32x4_t bias = vdupq_n_u32(0x7fff);
    const uint32x4_t one = vdupq_n_u32(1);
    const uint32x4_t absmask = vdupq_n_u32(0x7fffffff);
    const uint32x4_t inf = vdupq_n_u32(0x7f800000);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(x, 16), one);
    uint16x4_t rounded = vshrn_n_u32(vaddq_u32(vaddq_u32(x, bias), lsb), 16);
    uint16x4_t nanv = vorr_u16(vshrn_n_u32(x, 16), vdup_n_u16(0x0040));
    uint16x4_t isnan = vmovn_u32(vcgtq_u32(vandq_u32(x, absmask), inf));
    return vbsl_u16(isnan, nanv, rounded);
}

static void f32_to_bf16_neon(const float *src, uint16_t *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    (void)stream;
    for (; i + 8 <= n; i += 8) {
        uint16x4_t a = bf16x4_neon(vld1q_u32((const uint32_t *)(src + i)));
        uint16x4_t b = bf16x4_neon(vld1q_u32((const uint32_t *)(src + i + 4)));
        vst1q_u16(dst + i, vcombine_u16(a, b));
    }
    f32_to_bf16_scalar(src + i, dst + i, n - i, 0);
}

static void bf16_to_f32_neon(const uint16_t *src, float *dst, ptrdiff_t n, int stream)
{
    ptrdiff_t i = 0;
    (void)stream;
    for (; i + 8 <= n; i += 8) {
        uint16x8_t h = vld1q_u16(src + i);
        vst1q_u32((uint32_t *)(dst + i), vshll_n_u16(vget_low_u16(h), 16));
        vst1q_u32((uint32_t *)(dst + i + 4), vshll_high_n_u16(h, 16));
    }
    bf16_to_f32_scalar(src + i, dst + i, n - i, 0);
}

#endif /* KVH_NEON_ON */

/* ------------------------------------------------------------------ */
/* Dispatch                                                            */
/* ------------------------------------------------------------------ */

typedef void (*narrow_fn)(const float *, uint16_t *, ptrdiff_t, int);
typedef void (*widen_fn)(const uint16_t *, float *, ptrdiff_t, int);

typedef struct {
    narrow_fn to_f16, to_bf16;
    widen_fn from_f16, from_bf16;
} kvh_table;

static const kvh_table kvh_tables[KVH_NUM_LEVELS] = {
    {f32_to_f16_scalar, f32_to_bf16_scalar, f16_to_f32_scalar, bf16_to_f32_scalar},
#if KVH_X86
    {f32_to_f16_f16c, f32_to_bf16_sse41, f16_to_f32_f16c, bf16_to_f32_sse2},
    {f32_to_f16_f16c, f32_to_bf16_avx2, f16_to_f32_f16c, bf16_to_f32_avx2},
#else
    {0, 0, 0, 0},
    {0, 0, 0, 0},
#endif
#if KVH_NEON_ON
    {f32_to_f16_neon, f32_to_bf16_neon, f16_to_f32_neon, bf16_to_f32_neon},
#else
    {0, 0, 0, 0},
#endif
};

/* Levels, names, detection and the KVCORE_SIMD cap: the registry (kv_simd.h),
 * whose numbering kv_half.h's levels share. */
static const kvh_table *kvh_active = &kvh_tables[KVH_SCALAR];
static int kvh_level = KVH_SCALAR;

int kvh_level_supported(int level)
{
    return level >= 0 && level < KVH_NUM_LEVELS && kvs_level_supported(level);
}

/* The best level of this family at or under registry level `l`: the
 * registry's levels above KVH_NUM_LEVELS - 1 (avx512) have no conversion
 * kernels, and run the next lower level this CPU has (avx2). */
int kvh_level_at_most(int l)
{
    while (l > 0 && !kvh_level_supported(l))
        l--;
    return l;
}

int kvh_best_level(void) { return kvh_level_at_most(kvs_best_level()); }

int kvh_default_level(void) { return kvh_level_at_most(kvs_default_level()); }

int kvh_current_level(void) { return kvh_level; }

int kvh_set_level(int level)
{
    if (level < 0 || level >= KVH_NUM_LEVELS || !kvh_level_supported(level))
        return -1;
    kvh_active = &kvh_tables[level];
    kvh_level = level;
    return 0;
}

const char *kvh_level_name(int level) { return kvs_level_name(level); }

void kvh_f32_to_f16(const float *src, uint16_t *dst, ptrdiff_t n) { kvh_active->to_f16(src, dst, n, 0); }
void kvh_f32_to_bf16(const float *src, uint16_t *dst, ptrdiff_t n) { kvh_active->to_bf16(src, dst, n, 0); }
void kvh_f16_to_f32(const uint16_t *src, float *dst, ptrdiff_t n) { kvh_active->from_f16(src, dst, n, 0); }
void kvh_bf16_to_f32(const uint16_t *src, float *dst, ptrdiff_t n) { kvh_active->from_bf16(src, dst, n, 0); }

static size_t kind_size(int k) { return k == KVH_F32 ? 4 : 2; }

static int convert_impl(int sk, const void *src, int dk, void *dst, ptrdiff_t n, int stream)
{
    if (sk < KVH_F32 || sk > KVH_BF16 || dk < KVH_F32 || dk > KVH_BF16)
        return -1;
    if (n <= 0)
        return 0;
    if (sk == dk) {
        memcpy(dst, src, (size_t)n * kind_size(sk));
        return 0;
    }
    if (sk == KVH_F32) {
        if (dk == KVH_F16)
            kvh_active->to_f16((const float *)src, (uint16_t *)dst, n, stream);
        else
            kvh_active->to_bf16((const float *)src, (uint16_t *)dst, n, stream);
        return 0;
    }
    if (dk == KVH_F32) {
        if (sk == KVH_F16)
            kvh_active->from_f16((const uint16_t *)src, (float *)dst, n, stream);
        else
            kvh_active->from_bf16((const uint16_t *)src, (float *)dst, n, stream);
        return 0;
    }
    /* f16 <-> bf16: widening is exact, so one RNE narrowing is the single
     * correct rounding.  Chunked through the stack to stay in L1. */
    {
        float buf[512];
        const uint16_t *s = (const uint16_t *)src;
        uint16_t *d = (uint16_t *)dst;
        for (ptrdiff_t i = 0; i < n; i += 512) {
            ptrdiff_t m = n - i < 512 ? n - i : 512;
            if (sk == KVH_F16) {
                kvh_active->from_f16(s + i, buf, m, 0);
                kvh_active->to_bf16(buf, d + i, m, stream);
            } else {
                kvh_active->from_bf16(s + i, buf, m, 0);
                kvh_active->to_f16(buf, d + i, m, stream);
            }
        }
    }
    return 0;
}

int kvh_convert(int sk, const void *src, int dk, void *dst, ptrdiff_t n)
{
    return convert_impl(sk, src, dk, dst, n, 0);
}

int kvh_convert_stream(int sk, const void *src, int dk, void *dst, ptrdiff_t n)
{
    if (sk == dk) /* a copy: memcpy already picks its own store kind */
        return convert_impl(sk, src, dk, dst, n, 0);
    return convert_impl(sk, src, dk, dst, n, 1);
}

void kvh_stream_fence(void)
{
#if KVH_X86
    _mm_sfence();
#endif
}
