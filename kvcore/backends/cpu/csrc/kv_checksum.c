/* See kv_checksum.h. */
#include "kv_checksum.h"

#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* little-endian loads whatever the alignment or host order */
static inline uint64_t read64(const unsigned char* p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

static inline uint32_t read32(const unsigned char* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t round64(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t merge64(uint64_t acc, uint64_t val) {
    acc ^= round64(0, val);
    return acc * P1 + P4;
}

void kv_xxh64_init(kv_xxh64_state* s, uint64_t seed) {
    s->seed = seed;
    s->lane[0] = seed + P1 + P2;
    s->lane[1] = seed + P2;
    s->lane[2] = seed;
    s->lane[3] = seed - P1;
    s->total = 0;
    s->buffered = 0;
}

static inline void stripes(uint64_t* lane, const unsigned char* p, size_t n_stripes) {
    uint64_t v0 = lane[0], v1 = lane[1], v2 = lane[2], v3 = lane[3];
    for (size_t i = 0; i < n_stripes; i++, p += 32) {
        v0 = round64(v0, read64(p));
        v1 = round64(v1, read64(p + 8));
        v2 = round64(v2, read64(p + 16));
        v3 = round64(v3, read64(p + 24));
    }
    lane[0] = v0; lane[1] = v1; lane[2] = v2; lane[3] = v3;
}

void kv_xxh64_update(kv_xxh64_state* s, const void* data, size_t n) {
    const unsigned char* p = (const unsigned char*)data;
    s->total += n;
    if (s->buffered) {
        size_t take = 32 - s->buffered;
        if (take > n)
            take = n;
        memcpy(s->buf + s->buffered, p, take);
        s->buffered += take;
        p += take;
        n -= take;
        if (s->buffered < 32)
            return;
        stripes(s->lane, s->buf, 1);
        s->buffered = 0;
    }
    stripes(s->lane, p, n / 32);
    p += n / 32 * 32;
    n %= 32;
    if (n) {
        memcpy(s->buf, p, n);
        s->buffered = n;
    }
}

uint64_t kv_xxh64_digest(const kv_xxh64_state* s) {
    uint64_t h;
    const unsigned char* p = s->buf;
    size_t n = s->buffered;
    if (s->total >= 32) {
        const uint64_t* v = s->lane;
        h = rotl64(v[0], 1) + rotl64(v[1], 7) + rotl64(v[2], 12) + rotl64(v[3], 18);
        h = merge64(h, v[0]);
        h = merge64(h, v[1]);
        h = merge64(h, v[2]);
        h = merge64(h, v[3]);
    } else {
        h = s->seed + P5;
    }
    h += s->total;
    for (; n >= 8; n -= 8, p += 8) {
        h ^= round64(0, read64(p));
        h = rotl64(h, 27) * P1 + P4;
    }
    if (n >= 4) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
        n -= 4;
    }
    for (; n; n--, p++) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* One pass: each 32-byte stripe is loaded once, stored to dst and folded
 * into the four lanes, so the hash arithmetic overlaps the memory traffic
 * of the copy.  (Non-temporal stores, tried here, were slower on the
 * 2-core AMD EPYC the benchmark ran on.) */
static void copy_stripes(uint64_t* lane, const unsigned char* src, unsigned char* dst,
                         size_t n_stripes) {
    uint64_t v0 = lane[0], v1 = lane[1], v2 = lane[2], v3 = lane[3];
    for (size_t i = 0; i < n_stripes; i++, src += 32, dst += 32) {
        uint64_t w[4];
        memcpy(w, src, 32);
        memcpy(dst, w, 32);
        v0 = round64(v0, read64(src));
        v1 = round64(v1, read64(src + 8));
        v2 = round64(v2, read64(src + 16));
        v3 = round64(v3, read64(src + 24));
    }
    lane[0] = v0; lane[1] = v1; lane[2] = v2; lane[3] = v3;
}

void kv_copy_xxh64(kv_xxh64_state* s, const unsigned char* src, unsigned char* dst,
                   size_t n_chunks, size_t chunk_bytes, size_t dst_stride) {
    for (size_t c = 0; c < n_chunks; c++) {
        unsigned char* d = dst + c * dst_stride;
        size_t n = chunk_bytes, head = 0;
        if (s->buffered) {
            /* finish the partial stripe of the previous chunk first */
            head = 32 - s->buffered < n ? 32 - s->buffered : n;
            memcpy(d, src, head);
            kv_xxh64_update(s, src, head);
            n -= head;
        }
        size_t whole = n / 32;
        copy_stripes(s->lane, src + head, d + head, whole);
        s->total += whole * 32;
        size_t tail = n - whole * 32;
        if (tail) {
            memcpy(d + head + whole * 32, src + head + whole * 32, tail);
            kv_xxh64_update(s, src + head + whole * 32, tail);
        }
        src += chunk_bytes;
    }
}

void kv_copy_xxh64_many(const unsigned char* const* srcs, size_t n_srcs,
                        const kv_copy_part* parts, size_t n_parts, const uint64_t* seeds,
                        uint64_t* digests) {
    for (size_t j = 0; j < n_srcs; j++) {
        kv_xxh64_state st;
        const unsigned char* src = srcs[j];
        kv_xxh64_init(&st, seeds[j]);
        for (size_t k = 0; k < n_parts; k++) {
            const kv_copy_part* p = &parts[k];
            if (p->n_chunks && p->chunk_bytes) {
                kv_copy_xxh64(&st, src, p->dst + p->dst_offsets[j], p->n_chunks, p->chunk_bytes,
                              p->dst_stride);
                src += p->n_chunks * p->chunk_bytes;
            }
        }
        digests[j] = kv_xxh64_digest(&st);
    }
}
