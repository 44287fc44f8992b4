/* See kv_xxh3.h.  The algorithm as xxHash's doc/xxhash_spec.md describes
 * it; the streaming keeps up to 256 bytes back so that the last stripe
 * (which the long-input finish treats apart) and inputs of at most 240
 * bytes (hashed by the short paths) are whole at the digest. */
#include "kv_xxh3.h"

#include <string.h>

#include "kv_simd.h"
#include "kv_xxh3_internal.h"

#define PRIME32_1 0x9E3779B1ULL
#define PRIME32_2 0x85EBCA77ULL
#define PRIME32_3 0xC2B2AE3DULL
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL

static const unsigned char default_secret[KV_XXH3_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define STRIPE 64
#define STRIPES_PER_BLOCK ((KV_XXH3_SECRET_SIZE - STRIPE) / 8)   /* 16 */

/* little-endian loads and stores whatever the alignment or host order */
static inline uint64_t rd64(const unsigned char* p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}
static inline uint32_t rd32(const unsigned char* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void wr64(unsigned char* p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint32_t bswap32(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0xff00U) | ((x << 8) & 0xff0000U) | (x << 24);
}
static inline uint64_t bswap64(uint64_t x) {
    return (uint64_t)bswap32((uint32_t)x) << 32 | bswap32((uint32_t)(x >> 32));
}

/* low half xor high half of the 128-bit product */
static inline uint64_t mul128_fold(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t alo = (uint32_t)a, ahi = a >> 32, blo = (uint32_t)b, bhi = b >> 32;
    uint64_t ll = alo * blo, lh = alo * bhi, hl = ahi * blo, hh = ahi * bhi;
    uint64_t cross = (ll >> 32) + (uint32_t)hl + lh;
    uint64_t hi = hh + (hl >> 32) + (cross >> 32);
    uint64_t lo = (cross << 32) | (uint32_t)ll;
    return lo ^ hi;
#endif
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    return h ^ (h >> 32);
}
static inline uint64_t avalanche_xxh64(uint64_t h) {
    h ^= h >> 33;
    h *= PRIME64_2;
    h ^= h >> 29;
    h *= PRIME64_3;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const unsigned char* in, const unsigned char* sec, uint64_t seed) {
    return mul128_fold(rd64(in) ^ (rd64(sec) + seed), rd64(in + 8) ^ (rd64(sec + 8) - seed));
}

/* inputs of 0..240 bytes: the default secret and the seed itself */
static uint64_t hash_short(const unsigned char* in, size_t n, uint64_t seed) {
    const unsigned char* sec = default_secret;
    if (n == 0)
        return avalanche_xxh64(seed ^ rd64(sec + 56) ^ rd64(sec + 64));
    if (n <= 3) {
        uint32_t combined = (uint32_t)in[n - 1] | (uint32_t)n << 8 | (uint32_t)in[0] << 16 |
                            (uint32_t)in[n >> 1] << 24;
        uint64_t v = ((uint64_t)(rd32(sec) ^ rd32(sec + 4)) + seed) ^ combined;
        return avalanche_xxh64(v);
    }
    if (n <= 8) {
        uint64_t mseed = seed ^ (uint64_t)bswap32((uint32_t)seed) << 32;
        uint64_t combined = (uint64_t)rd32(in + n - 4) | (uint64_t)rd32(in) << 32;
        uint64_t v = ((rd64(sec + 8) ^ rd64(sec + 16)) - mseed) ^ combined;
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PRIME_MX2;
        v ^= (v >> 35) + n;
        v *= PRIME_MX2;
        return v ^ (v >> 28);
    }
    if (n <= 16) {
        uint64_t lo = ((rd64(sec + 24) ^ rd64(sec + 32)) + seed) ^ rd64(in);
        uint64_t hi = ((rd64(sec + 40) ^ rd64(sec + 48)) - seed) ^ rd64(in + n - 8);
        return avalanche(n + bswap64(lo) + hi + mul128_fold(lo, hi));
    }
    uint64_t acc = n * PRIME64_1;
    if (n <= 128) {
        size_t rounds = ((n - 1) >> 5) + 1;
        for (size_t i = 0; i < rounds; i++) {
            acc += mix16(in + 16 * i, sec + 32 * i, seed);
            acc += mix16(in + n - 16 * i - 16, sec + 32 * i + 16, seed);
        }
        return avalanche(acc);
    }
    size_t chunks = n >> 4;
    for (size_t i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, sec + 16 * i, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++)
        acc += mix16(in + 16 * i, sec + 16 * (i - 8) + 3, seed);
    acc += mix16(in + n - 16, sec + 119, seed);
    return avalanche(acc);
}

/* ---------------------------------------------------------------- scalar */
void kv_xxh3_stripes_scalar(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                            size_t n_stripes, const unsigned char* secret) {
    for (size_t s = 0; s < n_stripes; s++, src += STRIPE, secret += 8) {
        if (dst) {
            memcpy(dst, src, STRIPE);
            dst += STRIPE;
        }
        for (int i = 0; i < 8; i++) {
            uint64_t v = rd64(src + 8 * i);
            uint64_t k = v ^ rd64(secret + 8 * i);
            acc[i ^ 1] += v;
            acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
        }
    }
}

void kv_xxh3_scramble_scalar(uint64_t* acc, const unsigned char* secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(secret + 8 * i);
        acc[i] = a * PRIME32_1;
    }
}

/* -------------------------------------------------------------- dispatch */
typedef void (*stripes_fn)(uint64_t*, const unsigned char*, unsigned char*, size_t,
                           const unsigned char*);
typedef void (*scramble_fn)(uint64_t*, const unsigned char*);

int kv_xxh3_level(int level) {
    if (level < 0 || level >= KVS_NUM_LEVELS || !kvs_level_supported(level))
        level = kvs_default_level();
#ifdef KV_XXH3_HAVE_AVX2
    if (level >= KVS_AVX2 && level != KVS_NEON)
        return KVS_AVX2;
#endif
#ifdef KV_XXH3_HAVE_NEON
    if (level == KVS_NEON)
        return KVS_NEON;
#endif
    /* no kernels of f16c: the next lower level with kernels */
    return KVS_SCALAR;
}

/* the kernels of a level kv_xxh3_level returned */
typedef struct {
    stripes_fn stripes;
    scramble_fn scramble;
} kernels;

static inline kernels kernels_of(int level) {
    kernels k = {kv_xxh3_stripes_scalar, kv_xxh3_scramble_scalar};
#ifdef KV_XXH3_HAVE_AVX2
    if (level == KVS_AVX2) {
        k.stripes = kv_xxh3_stripes_avx2;
        k.scramble = kv_xxh3_scramble_avx2;
    }
#endif
#ifdef KV_XXH3_HAVE_NEON
    if (level == KVS_NEON) {
        k.stripes = kv_xxh3_stripes_neon;
        k.scramble = kv_xxh3_scramble_neon;
    }
#endif
    (void)level;
    return k;
}

/* ------------------------------------------------------------- streaming */
void kv_xxh3_init(kv_xxh3_state* s, uint64_t seed, int level) {
    static const uint64_t acc0[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                                     PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    memcpy(s->acc, acc0, sizeof acc0);
    s->seed = seed;
    s->total = 0;
    s->buffered = 0;
    s->stripes_in_block = 0;
    s->level = kv_xxh3_level(level);
    s->stream = 0;
    /* long inputs hash with the default secret derived from the seed */
    for (int i = 0; i < KV_XXH3_SECRET_SIZE; i += 16) {
        wr64(s->secret + i, rd64(default_secret + i) + seed);
        wr64(s->secret + i + 8, rd64(default_secret + i + 8) - seed);
    }
}

void kv_xxh3_set_stream(kv_xxh3_state* s, int on) { s->stream = on; }

void kv_xxh3_stream_fence(void) {
#ifdef KV_XXH3_HAVE_AVX2
    kv_xxh3_stream_fence_avx2();
#endif
}

/* accumulate n whole stripes at p (copied to d unless NULL, with
 * non-temporal stores if stream), scrambling at every block's end */
static void consume(uint64_t* acc, size_t* in_block, const unsigned char* secret, int level,
                    const unsigned char* p, unsigned char* d, size_t n, int stream) {
    kernels kern = kernels_of(level);
    stripes_fn stripes = kern.stripes;
#ifdef KV_XXH3_HAVE_AVX2
    if (stream && d && level == KVS_AVX2 && (uintptr_t)d % 16 == 0)
        stripes = kv_xxh3_stripes_stream_avx2;
#else
    (void)stream;
#endif
    while (n) {
        size_t k = STRIPES_PER_BLOCK - *in_block;
        if (k > n)
            k = n;
        stripes(acc, p, d, k, secret + 8 * *in_block);
        p += k * STRIPE;
        if (d)
            d += k * STRIPE;
        n -= k;
        *in_block += k;
        if (*in_block == STRIPES_PER_BLOCK) {
            kern.scramble(acc, secret + KV_XXH3_SECRET_SIZE - STRIPE);
            *in_block = 0;
        }
    }
}

/* memcpy(d, p, n) for the bytes of a copy that skip the stripe kernel */
static inline void put(const kv_xxh3_state* s, unsigned char* d, const unsigned char* p,
                       size_t n) {
#ifdef KV_XXH3_HAVE_AVX2
    if (s->stream && s->level == KVS_AVX2 && (uintptr_t)d % 16 == 0 && n % 16 == 0) {
        kv_xxh3_stream_copy_sse2(d, p, n);
        return;
    }
#endif
    memcpy(d, p, n);
}

/* kv_xxh3_update that also copies the n bytes to d (unless NULL).  A
 * stripe is accumulated only once a byte after it is known: the input's
 * last stripe is finished apart at the digest. */
static void update_copy(kv_xxh3_state* s, const unsigned char* p, unsigned char* d, size_t n) {
    s->total += n;
    if (s->buffered + n <= KV_XXH3_BUFFER) {
        memcpy(s->buf + s->buffered, p, n);
        if (d)
            put(s, d, p, n);
        s->buffered += n;
        return;
    }
    if (s->buffered) {
        /* complete the buffer's last stripe, accumulate the buffer; bytes
         * follow it (buffered + n > KV_XXH3_BUFFER) */
        size_t take = (STRIPE - s->buffered % STRIPE) % STRIPE;
        memcpy(s->buf + s->buffered, p, take);
        if (d) {
            put(s, d, p, take);
            d += take;
        }
        p += take;
        n -= take;
        size_t k = (s->buffered + take) / STRIPE;
        consume(s->acc, &s->stripes_in_block, s->secret, s->level, s->buf, NULL, k, 0);
        memcpy(s->last, s->buf + (k - 1) * STRIPE, STRIPE);
        s->buffered = 0;
    }
    /* n >= 1: every stripe but the one holding the last byte */
    size_t k = (n - 1) / STRIPE;
    if (k) {
        consume(s->acc, &s->stripes_in_block, s->secret, s->level, p, d, k, s->stream);
        memcpy(s->last, p + (k - 1) * STRIPE, STRIPE);
        p += k * STRIPE;
        if (d)
            d += k * STRIPE;
        n -= k * STRIPE;
    }
    memcpy(s->buf, p, n);
    if (d)
        put(s, d, p, n);
    s->buffered = n;
}

void kv_xxh3_update(kv_xxh3_state* s, const void* data, size_t n) {
    if (n)
        update_copy(s, (const unsigned char*)data, NULL, n);
}

uint64_t kv_xxh3_digest(const kv_xxh3_state* s) {
    if (s->total <= 240)
        return hash_short(s->buf, (size_t)s->total, s->seed);   /* all of it is in buf */
    uint64_t acc[8];
    size_t in_block = s->stripes_in_block;
    memcpy(acc, s->acc, sizeof acc);
    size_t n = s->buffered;   /* 1 .. KV_XXH3_BUFFER */
    consume(acc, &in_block, s->secret, s->level, s->buf, NULL, (n - 1) / STRIPE, 0);
    unsigned char last[STRIPE];
    if (n >= STRIPE) {
        memcpy(last, s->buf + n - STRIPE, STRIPE);
    } else {
        memcpy(last, s->last + n, STRIPE - n);
        memcpy(last + STRIPE - n, s->buf, n);
    }
    kv_xxh3_stripes_scalar(acc, last, NULL, 1, s->secret + KV_XXH3_SECRET_SIZE - STRIPE - 7);
    uint64_t h = s->total * PRIME64_1;
    for (int i = 0; i < 4; i++)
        h += mul128_fold(acc[2 * i] ^ rd64(s->secret + 11 + 16 * i),
                         acc[2 * i + 1] ^ rd64(s->secret + 11 + 16 * i + 8));
    return avalanche(h);
}

void kv_copy_xxh3(kv_xxh3_state* s, const unsigned char* src, unsigned char* dst,
                  size_t n_chunks, size_t chunk_bytes, size_t dst_stride) {
    if (!chunk_bytes)
        return;
    for (size_t c = 0; c < n_chunks; c++, src += chunk_bytes)
        update_copy(s, src, dst + c * dst_stride, chunk_bytes);
}
