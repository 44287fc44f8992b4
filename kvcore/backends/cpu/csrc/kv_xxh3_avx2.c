/* The AVX2 kernels of kv_xxh3.c: the eight 64-bit accumulators in two
 * 256-bit registers.  Compiled for AVX2 by target attributes only (wheels
 * run on any x86-64; kv_xxh3.c calls these after kv_simd.h says the CPU
 * has AVX2). */
#include "kv_xxh3_internal.h"

#ifdef KV_XXH3_HAVE_AVX2
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

/* one stripe half: acc += swap64(data) + lo32(data ^ key) * hi32(data ^ key) */
AVX2 static inline __m256i accumulate(__m256i acc, __m256i data, __m256i key) {
    __m256i dk = _mm256_xor_si256(data, key);
    __m256i product = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
    /* lane i ^ 1 of the accumulators takes lane i of the data */
    __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
}

AVX2 void kv_xxh3_stripes_avx2(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                               size_t n_stripes, const unsigned char* secret) {
    __m256i a0 = _mm256_loadu_si256((const __m256i*)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i*)(acc + 4));
    for (size_t s = 0; s < n_stripes; s++, src += 64, secret += 8) {
        __m256i d0 = _mm256_loadu_si256((const __m256i*)src);
        __m256i d1 = _mm256_loadu_si256((const __m256i*)(src + 32));
        if (dst) {
            /* the copy rides on the loads the hash needs: each byte read once */
            _mm256_storeu_si256((__m256i*)dst, d0);
            _mm256_storeu_si256((__m256i*)(dst + 32), d1);
            dst += 64;
        }
        a0 = accumulate(a0, d0, _mm256_loadu_si256((const __m256i*)secret));
        a1 = accumulate(a1, d1, _mm256_loadu_si256((const __m256i*)(secret + 32)));
    }
    _mm256_storeu_si256((__m256i*)acc, a0);
    _mm256_storeu_si256((__m256i*)(acc + 4), a1);
}

/* kv_xxh3_stripes_avx2 with non-temporal stores to a 16-byte aligned dst
 * (what NumPy guarantees of an array's data):
 * a copy far larger than the caches then writes each destination line
 * without reading it first (a third of the memory traffic of a plain store) */
AVX2 void kv_xxh3_stripes_stream_avx2(uint64_t* acc, const unsigned char* src,
                                      unsigned char* dst, size_t n_stripes,
                                      const unsigned char* secret) {
    __m256i a0 = _mm256_loadu_si256((const __m256i*)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i*)(acc + 4));
    for (size_t s = 0; s < n_stripes; s++, src += 64, dst += 64, secret += 8) {
        __m256i d0 = _mm256_loadu_si256((const __m256i*)src);
        __m256i d1 = _mm256_loadu_si256((const __m256i*)(src + 32));
        _mm_stream_si128((__m128i*)dst, _mm256_castsi256_si128(d0));
        _mm_stream_si128((__m128i*)(dst + 16), _mm256_extracti128_si256(d0, 1));
        _mm_stream_si128((__m128i*)(dst + 32), _mm256_castsi256_si128(d1));
        _mm_stream_si128((__m128i*)(dst + 48), _mm256_extracti128_si256(d1, 1));
        a0 = accumulate(a0, d0, _mm256_loadu_si256((const __m256i*)secret));
        a1 = accumulate(a1, d1, _mm256_loadu_si256((const __m256i*)(secret + 32)));
    }
    _mm256_storeu_si256((__m256i*)acc, a0);
    _mm256_storeu_si256((__m256i*)(acc + 4), a1);
}

/* A copy of n bytes (a multiple of 16) to a 16-byte aligned d with
 * non-temporal stores: the bytes of a streamed copy that do not go through
 * the stripe kernel (a chunk's tail) bypass the cache too, as a plain store
 * among non-temporal ones measured 2x slower over 4 KiB chunks.  (SSE2:
 * any x86-64 runs it, no target attribute needed.) */
void kv_xxh3_stream_copy_sse2(unsigned char* d, const unsigned char* p, size_t n) {
    for (size_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i*)(d + i), _mm_loadu_si128((const __m128i*)(p + i)));
}

/* (sfence is SSE: any x86-64 runs it, no target attribute needed) */
void kv_xxh3_stream_fence_avx2(void) { _mm_sfence(); }

/* acc = (acc ^ acc >> 47 ^ key) * PRIME32_1, the 64x32-bit product from two
 * 32x32 ones */
AVX2 static inline __m256i scramble(__m256i acc, __m256i key) {
    const __m256i prime = _mm256_set1_epi32((int)KV_XXH_PRIME32_1);
    __m256i a = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)), key);
    __m256i lo = _mm256_mul_epu32(a, prime);
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

AVX2 void kv_xxh3_scramble_avx2(uint64_t* acc, const unsigned char* secret) {
    __m256i a0 = _mm256_loadu_si256((const __m256i*)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i*)(acc + 4));
    a0 = scramble(a0, _mm256_loadu_si256((const __m256i*)secret));
    a1 = scramble(a1, _mm256_loadu_si256((const __m256i*)(secret + 32)));
    _mm256_storeu_si256((__m256i*)acc, a0);
    _mm256_storeu_si256((__m256i*)(acc + 4), a1);
}
#endif
