/*
 * kv_hash: SipHash-c-d with 128-bit output (Aumasson & Bernstein), and the
 * chained block hash kvcore's prefix cache uses.
 *
 * Block hash (documented in docs/api.md, "Block hashes"), with SipHash-1-3-128
 * (one compression and three finalization rounds, the variant CPython 3.11+
 * and Rust's standard library hash with; about twice as fast as 2-4, and
 * kvcore verifies token ids on every hit, so the hash only has to spread):
 *   key    = the 16 ASCII bytes "kvcore.block.v1\0"
 *   root   = 16 zero bytes                                  (salt None)
 *          = SipHash13_128(key, "kvcore.salt:" || salt bytes) (salt given)
 *   h[i]   = SipHash13_128(key, h[i-1] || t[i*B] || ... || t[i*B+B-1])
 *            with h[-1] = root and each token id as 4 little-endian bytes.
 * A hash is 16 bytes: the first output word then the second, each little
 * endian; in memory kvcore keeps it as two uint64 words (lo, hi).
 */
#ifndef KV_HASH_H
#define KV_HASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif


/* The rounds of the block hash: SipHash-1-3. */
#define KV_BLOCK_C 1
#define KV_BLOCK_D 3

/* SipHash-c-d-128 of `len` bytes with key (k0, k1); out[0], out[1] are the
 * two output words (bytes 0..7 and 8..15, little endian). */
void kvhash_siphash128(uint64_t k0, uint64_t k1, const void *data, size_t len, int c, int d,
                       uint64_t out[2]);

/* The key words of kvcore's block hash. */
void kvhash_block_key(uint64_t *k0, uint64_t *k1);

/* Chained hashes of n_blocks full blocks of block_size token ids:
 * out[2*i], out[2*i+1] = h[i], starting from parent (2 words). */
void kvhash_chain(const int32_t *tokens, ptrdiff_t n_blocks, ptrdiff_t block_size,
                  const uint64_t parent[2], uint64_t *out);

#ifdef __cplusplus
}
#endif
#endif
