/* XXH3-64 (xxHash's 64-bit XXH3, seeded, default secret), streaming, and the
 * block copy that computes it on the way: the checksum of prefix-store
 * entries of format version 3 (kvcore/stores/_format.py).  Written from
 * xxHash's published specification (doc/xxhash_spec.md);
 * tests/stores/test_checksum_xxh3.py checks it bit for bit against the xxhash
 * package at every SIMD level this CPU has.
 *
 * XXH3-64 rather than -128: the checksum only guards against damaged bytes
 * (the identity of an entry is its BLAKE2b-256 identity digest, and a store
 * with an hmac_key signs entries), 64 bits make a random corruption that
 * passes a 2**-64 event, and the 64-bit variant's long-input loop is the
 * same as the 128-bit one's with a cheaper finish. */
#ifndef KV_XXH3_H
#define KV_XXH3_H

#include <stddef.h>
#include <stdint.h>


#define KV_XXH3_SECRET_SIZE 192
#define KV_XXH3_BUFFER 256

typedef struct {
    uint64_t acc[8];
    uint64_t seed;
    uint64_t total;                    /* bytes seen */
    size_t buffered;                   /* bytes in buf, not yet accumulated */
    size_t stripes_in_block;           /* stripes accumulated since the last scramble */
    int level;                         /* kv_simd.h level of the kernels */
    int stream;                        /* copies: non-temporal stores where the kernel has them */
    unsigned char secret[KV_XXH3_SECRET_SIZE];   /* the default one derived from seed */
    unsigned char buf[KV_XXH3_BUFFER];
    unsigned char last[64];            /* the last 64 accumulated bytes */
} kv_xxh3_state;

/* level: a kv_simd.h level (KVS_*); one this build or CPU cannot run, or a
 * negative one, means kvs_default_level(). */
void kv_xxh3_init(kv_xxh3_state* s, uint64_t seed, int level);
/* Copies into s (kv_copy_xxh3) bypass the caches (non-temporal stores,
 * AVX2 level only; the same bytes and digest either way): for copies far
 * larger than the caches, whose destination is not read soon.  The caller
 * runs kv_xxh3_stream_fence() before another thread reads the copy. */
void kv_xxh3_set_stream(kv_xxh3_state* s, int on);
void kv_xxh3_stream_fence(void);
void kv_xxh3_update(kv_xxh3_state* s, const void* data, size_t n);
uint64_t kv_xxh3_digest(const kv_xxh3_state* s);
/* the level kv_xxh3_init(.., level) runs */
int kv_xxh3_level(int level);

/* Copy n_chunks chunks of chunk_bytes from consecutive src into
 * dst + i * dst_stride, feeding every byte to s (each 64-byte stripe is
 * loaded once, stored and accumulated). */
void kv_copy_xxh3(kv_xxh3_state* s, const unsigned char* src, unsigned char* dst,
                  size_t n_chunks, size_t chunk_bytes, size_t dst_stride);

/* Where one part of every source goes: part k of source j (n_chunks *
 * chunk_bytes bytes) goes to dst + dst_offsets[j] + i * dst_stride. */
typedef struct {
    unsigned char* dst;
    const size_t* dst_offsets;
    size_t n_chunks, chunk_bytes, dst_stride;
} kv_copy_part;

/* kv_copy_xxh3 of n_srcs sources at once: source j (at srcs[j]) is its
 * n_parts parts one after the other, each copied as parts[k] says, and
 * digests[j] receives the XXH3-64 of the whole source with seeds[j].  One
 * call for every block of a restore (no per-block interpreter work, the GIL
 * released once); two parts for pools that keep scales beside the blocks.
 * On up to n_threads threads (the calling one included): the sources are
 * split in contiguous runs, each source is hashed by one thread, so the
 * digests do not depend on n_threads (nor on whether a thread could be
 * started: its run then goes to the calling thread).  Batches under 1 MiB
 * a thread use fewer. */
void kv_copy_xxh3_many(const unsigned char* const* srcs, size_t n_srcs,
                      const kv_copy_part* parts, size_t n_parts, const uint64_t* seeds,
                      uint64_t* digests, int level, int n_threads);

#endif
