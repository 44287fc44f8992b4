/*
 * What the stand-alone C checks of tests/c share: a pseudo-random source
 * and a batch of float32 bit patterns checked 65,536 at a time.
 */
#ifndef KV_CHECK_UTIL_H
#define KV_CHECK_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* xorshift64: the same sequence in every check and on every platform */
static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static inline uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}

#define KVC_BATCH (1 << 16)

/* Patterns are collected with kvc_push and handed to check(level, x, n)
 * whenever KVC_BATCH are waiting; kvc_finish checks the rest, then every
 * tail length 0..67 at every misalignment 0..3 of the buffer. */
typedef struct {
    void (*check)(int level, const uint32_t *x, size_t n);
    int level;
    size_t n, total;
    uint32_t x[KVC_BATCH + 72];
} kvc_batch;

static inline void kvc_flush(kvc_batch *b)
{
    b->check(b->level, b->x, b->n);
    b->total += b->n;
    b->n = 0;
}

static inline void kvc_push(kvc_batch *b, uint32_t v)
{
    b->x[b->n++] = v;
    if (b->n == KVC_BATCH)
        kvc_flush(b);
}

/* Check what is waiting, then the tails; returns the patterns checked. */
static inline size_t kvc_finish(kvc_batch *b)
{
    kvc_flush(b);
    for (size_t len = 0; len < 68; len++)
        for (size_t off = 0; off < 4; off++)
            b->check(b->level, b->x + off, len);
    return b->total;
}

#endif
