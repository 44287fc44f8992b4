/* The per-ISA kernels of kv_xxh3.c: the accumulation of whole 64-byte
 * stripes (copied to dst on the way when dst is not NULL; secret advances
 * 8 bytes a stripe) and the scramble.  Every kernel gives the bits of the
 * scalar one. */
#ifndef KV_XXH3_INTERNAL_H
#define KV_XXH3_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#define KV_XXH_PRIME32_1 0x9E3779B1U

void kv_xxh3_stripes_scalar(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                            size_t n_stripes, const unsigned char* secret);
void kv_xxh3_scramble_scalar(uint64_t* acc, const unsigned char* secret);

/* GCC/Clang only: the AVX2 kernels are compiled by target attributes */
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define KV_XXH3_HAVE_AVX2 1
void kv_xxh3_stripes_avx2(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                          size_t n_stripes, const unsigned char* secret);
void kv_xxh3_scramble_avx2(uint64_t* acc, const unsigned char* secret);
void kv_xxh3_stripes_stream_avx2(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                                 size_t n_stripes, const unsigned char* secret);
void kv_xxh3_stream_copy_sse2(unsigned char* d, const unsigned char* p, size_t n);
/* orders the non-temporal stores before what follows (another thread's reads) */
void kv_xxh3_stream_fence_avx2(void);
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#define KV_XXH3_HAVE_NEON 1
void kv_xxh3_stripes_neon(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                          size_t n_stripes, const unsigned char* secret);
void kv_xxh3_scramble_neon(uint64_t* acc, const unsigned char* secret);
#endif

#endif
