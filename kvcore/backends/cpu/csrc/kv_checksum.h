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

/* Where one part of every source goes: part k of source j (n_chunks *
 * chunk_bytes bytes) goes to dst + dst_offsets[j] + i * dst_stride. */
typedef struct {
    unsigned char* dst;
    const size_t* dst_offsets;
    size_t n_chunks, chunk_bytes, dst_stride;
} kv_copy_part;

/* kv_copy_xxh64 of n_srcs sources at once: source j (at srcs[j]) is its
 * n_parts parts one after the other, each copied as parts[k] says, and
 * digests[j] receives the XXH64 of the whole source with seeds[j].  One
 * call for every block of a restore (no per-block interpreter work, the GIL
 * released once); two parts for pools that keep scales beside the blocks. */
void kv_copy_xxh64_many(const unsigned char* const* srcs, size_t n_srcs,
                        const kv_copy_part* parts, size_t n_parts, const uint64_t* seeds,
                        uint64_t* digests);

#endif
