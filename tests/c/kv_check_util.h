/*
 * What the stand-alone C checks of tests/c share: a pseudo-random source
 * and (the bit-pattern checks) a batch of float32 bit patterns checked
 * 65,536 at a time.
 */
#ifndef KV_CHECK_UTIL_H
#define KV_CHECK_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* xorshift64: the same sequence in every check and on every platform.  A
 * check may start it elsewhere (KVC_SEED) and take 32 bits from higher up
 * (KVC_RND_SHIFT) before it includes this header. */
#ifndef KVC_SEED
#define KVC_SEED 0x9e3779b97f4a7c15ULL
#endif
#ifndef KVC_RND_SHIFT
#define KVC_RND_SHIFT 0
#endif
static uint64_t rng_state = KVC_SEED;
static inline uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> KVC_RND_SHIFT);
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

/* Start b for check(level, ...) with nothing waiting. */
static inline void kvc_start(kvc_batch *b, void (*check)(int, const uint32_t *, size_t), int level)
{
    b->check = check;
    b->level = level;
    b->n = b->total = 0;
}

/* Push every sign and exponent with each of the nhighs upper mantissa
 * parts highs[] and every lower part 0..nlo-1 (the rounding boundaries),
 * then `nrandom` random patterns. */
static inline void kvc_push_grid(kvc_batch *b, const uint32_t *highs, size_t nhighs, uint32_t nlo,
                                 int nrandom)
{
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint32_t e = 0; e < 256; e++)
            for (size_t hsel = 0; hsel < nhighs; hsel++)
                for (uint32_t lo = 0; lo < nlo; lo++)
                    kvc_push(b, (sign << 31) | (e << 23) | highs[hsel] | lo);
    for (int r = 0; r < nrandom; r++)
        kvc_push(b, rnd());
}

/* check_level(level) for each SIMD level 1..num_levels-1 this CPU has; the
 * exit status: 1 for any of *fails, 3 when no level was checked. */
static inline int kvc_check_levels(int num_levels, int (*supported)(int),
                                   void (*check_level)(int), const int *fails)
{
    int checked = 0;
    for (int level = 1; level < num_levels; level++) {
        if (!supported(level))
            continue;
        check_level(level);
        checked++;
    }
    printf("%d SIMD level(s) checked, %d mismatches\n", checked, *fails);
    return *fails ? 1 : (checked ? 0 : 3);
}

#endif
