/*
 * What the stand-alone attention checks of tests/c share: their
 * pseudo-random sequence (kv_check_util.h's generator) and level loop.
 */
#ifndef KV_ATTENTION_CASES_H
#define KV_ATTENTION_CASES_H

#include "kv_attention.h"

/* the attention checks' sequence: another start, 32 bits from bit 16 */
#define KVC_SEED 88172645463325252ull
#define KVC_RND_SHIFT 16
#include "kv_check_util.h"

static inline float urand(void) { return (float)(rnd() & 0xffffff) / 16777216.0f * 2.0f - 1.0f; }

/* Random P (M rows of T weights) and alpha (M) in [0, 1) for a P.V check. */
static inline void urand_pv(float *P, float *alpha, int M, int T)
{
    for (int r = 0; r < M; r++) {
        alpha[r] = 0.5f + 0.5f * urand();
        for (int i = 0; i < T; i++)
            P[r * T + i] = 0.5f + 0.5f * urand();
    }
}

/* The level, if this CPU runs it, made current: whether it was. */
static inline int kvc_use_level(int level)
{
    return kva_level_supported(level) && kva_set_level(level) == 0;
}

#endif
