/* kv_hash.c: see kv_hash.h for the algorithm and the byte order. */
#include "kv_hash.h"
#include <string.h>

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

#define SIPROUND                                                               \
    do {                                                                       \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);              \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                 \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                 \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);              \
    } while (0)

static inline uint64_t load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* The SipHash state, so the block hash can feed words without building a
 * byte buffer. */
typedef struct {
    uint64_t v0, v1, v2, v3;
} sipstate;

static inline void sip_init(sipstate *s, uint64_t k0, uint64_t k1)
{
    s->v0 = k0 ^ 0x736f6d6570736575ULL;
    s->v1 = k1 ^ 0x646f72616e646f6dULL ^ 0xee; /* 0xee: 128-bit output */
    s->v2 = k0 ^ 0x6c7967656e657261ULL;
    s->v3 = k1 ^ 0x7465646279746573ULL;
}

/* c compression rounds per word; always inlined with a constant c, so the
 * loop unrolls. */
static inline void sip_word(sipstate *s, uint64_t m, int c)
{
    uint64_t v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3;
    v3 ^= m;
    for (int r = 0; r < c; r++)
        SIPROUND;
    v0 ^= m;
    s->v0 = v0; s->v1 = v1; s->v2 = v2; s->v3 = v3;
}

/* `last` holds the 0..7 trailing bytes (little endian); len is the total;
 * d finalization rounds per output word. */
static inline void sip_final(sipstate *s, uint64_t last, size_t len, uint64_t out[2], int c,
                             int d)
{
    uint64_t b = ((uint64_t)len << 56) | last;
    uint64_t v0, v1, v2, v3;
    sip_word(s, b, c);
    v0 = s->v0; v1 = s->v1; v2 = s->v2; v3 = s->v3;
    v2 ^= 0xee;
    for (int r = 0; r < d; r++)
        SIPROUND;
    out[0] = v0 ^ v1 ^ v2 ^ v3;
    v1 ^= 0xdd;
    for (int r = 0; r < d; r++)
        SIPROUND;
    out[1] = v0 ^ v1 ^ v2 ^ v3;
}

void kvhash_siphash128(uint64_t k0, uint64_t k1, const void *data, size_t len, int c, int d,
                       uint64_t out[2])
{
    const unsigned char *p = (const unsigned char *)data;
    size_t nwords = len / 8, rest = len % 8;
    sipstate s;
    uint64_t last = 0;
    sip_init(&s, k0, k1);
    for (size_t i = 0; i < nwords; i++)
        sip_word(&s, load_le64(p + 8 * i), c);
    for (size_t i = 0; i < rest; i++)
        last |= (uint64_t)p[8 * nwords + i] << (8 * i);
    sip_final(&s, last, len, out, c, d);
}

void kvhash_block_key(uint64_t *k0, uint64_t *k1)
{
    static const unsigned char key[16] = "kvcore.block.v1"; /* 15 chars + NUL */
    *k0 = load_le64(key);
    *k1 = load_le64(key + 8);
}

void kvhash_chain(const int32_t *tokens, ptrdiff_t n_blocks, ptrdiff_t block_size,
                  const uint64_t parent[2], uint64_t *out)
{
    uint64_t k0, k1, h0 = parent[0], h1 = parent[1];
    size_t len = 16 + 4 * (size_t)block_size;
    kvhash_block_key(&k0, &k1);
    for (ptrdiff_t b = 0; b < n_blocks; b++) {
        /* token ids are 0..2^31-1, so (uint32_t) is their 4 LE bytes */
        const int32_t *t = tokens + b * block_size;
        sipstate s;
        ptrdiff_t j = 0;
        uint64_t r[2];
        sip_init(&s, k0, k1);
        sip_word(&s, h0, KV_BLOCK_C);
        sip_word(&s, h1, KV_BLOCK_C);
        for (; j + 2 <= block_size; j += 2)
            sip_word(&s, (uint64_t)(uint32_t)t[j] | ((uint64_t)(uint32_t)t[j + 1] << 32),
                     KV_BLOCK_C);
        sip_final(&s, j < block_size ? (uint64_t)(uint32_t)t[j] : 0, len, r, KV_BLOCK_C,
                  KV_BLOCK_D);
        h0 = r[0];
        h1 = r[1];
        out[2 * b] = h0;
        out[2 * b + 1] = h1;
    }
}
