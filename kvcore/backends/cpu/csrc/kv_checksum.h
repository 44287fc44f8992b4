/* XXH64 (Yann Collet's xxHash, 64-bit variant), streaming, and a block copy
 * that computes it on the way: the checksum of prefix-store entries
 * (kvcore/stores/_format.py).  Written from the published algorithm
 * description; tests/test_stores_checksum.py checks it against the xxhash
 * package. */
#ifndef KV_CHECKSUM_H
#define KV_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t lane[4];
    uint64_t seed;
    uint64_t total;          /* bytes seen */
    unsigned char buf[32];   /* a partial stripe */
    size_t buffered;
} kv_xxh64_state;

void kv_xxh64_init(kv_xxh64_state* s, uint64_t seed);
void kv_xxh64_update(kv_xxh64_state* s, const void* data, size_t n);
uint64_t kv_xxh64_digest(const kv_xxh64_state* s);

/* Copy n_chunks chunks of chunk_bytes from consecutive src into
 * dst + i * dst_stride, feeding every byte to s: each piece is hashed right
 * after it is copied, while it is in the L1 cache. */
void kv_copy_xxh64(kv_xxh64_state* s, const unsigned char* src, unsigned char* dst,
                   size_t n_chunks, size_t chunk_bytes, size_t dst_stride);

/* kv_copy_xxh64 of n_srcs sources at once: source j (n_chunks * chunk_bytes
 * bytes at srcs[j]) goes to dst + dst_offsets[j] + i * dst_stride, and
 * digests[j] receives its XXH64 with seeds[j].  One call for every block of
 * a restore (no per-block interpreter work, the GIL released once). */
void kv_copy_xxh64_many(const unsigned char* const* srcs, unsigned char* dst,
                        const size_t* dst_offsets, size_t n_srcs, size_t n_chunks,
                        size_t chunk_bytes, size_t dst_stride, const uint64_t* seeds,
                        uint64_t* digests);

#endif
