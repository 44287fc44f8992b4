/*
 * kv_attention.c on its own (no Python): every kernel level this CPU runs,
 * against a plain double-precision attention, on random varlen batches over
 * float32, float16, bfloat16, fp8 (e4m3fn, e5m2; layer scales) and int8
 * (scales per token and kv head) pages (GQA, sliding window, soft cap, 1
 * and 3 threads).  Built and run by tests/test_attention.py natively and, for
 * AArch64, under qemu.  Prints one line per level and "0 failures" when
 * every case is within 1e-5 (max abs error / max abs value).
 */
#include "kv_attention.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float urand(void) { return (float)(rnd() & 0xffffff) / 16777216.0f * 2.0f - 1.0f; }

static uint16_t to_f16(float f) /* round to nearest even, normal range only here */
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax < 0x38800000u)
        return (uint16_t)sign; /* tiny: zero (the test values are larger) */
    uint32_t m = ax - 0x38000000u;
    m += 0x0fffu + ((m >> 13) & 1u);
    return (uint16_t)(sign | (m >> 13));
}
static double from_f16(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e ? ldexp(1.0 + m / 1024.0, e - 15) : ldexp(m / 1024.0, -14);
    return (h & 0x8000) ? -v : v;
}
static uint16_t to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
static double from_bf16(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* fp8 by their definition (finite codes only here). */
static double from_e4m3(uint8_t b)
{
    int e = (b >> 3) & 0xf, m = b & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return (b & 0x80) ? -v : v;
}
static double from_e5m2(uint8_t b)
{
    int e = (b >> 2) & 0x1f, m = b & 3;
    double v = e ? ldexp(1.0 + m / 4.0, e - 15) : ldexp(m / 4.0, -14);
    return (b & 0x80) ? -v : v;
}
/* A random finite fp8 code of modest size (exponents around the bias, a
 * subnormal or a zero now and then), either sign. */
static uint8_t fp8_code(int kind)
{
    uint32_t r = rnd();
    int sub = (r & 15) == 0;
    if (kind == KVA_F8E4M3)
        return (uint8_t)(((r >> 4) & 0x80) | (sub ? 0 : (int)(4 + (r >> 8) % 7) << 3) | (r & 7));
    return (uint8_t)(((r >> 4) & 0x80) | (sub ? 0 : (int)(12 + (r >> 8) % 7) << 2) | (r & 3));
}

/* Element i of a cache, unscaled. */
static double stored(const void *cache, int kind, size_t i)
{
    if (kind == KVA_F32)
        return ((const float *)cache)[i];
    if (kind == KVA_F16)
        return from_f16(((const uint16_t *)cache)[i]);
    if (kind == KVA_F8E4M3)
        return from_e4m3(((const uint8_t *)cache)[i]);
    if (kind == KVA_F8E5M2)
        return from_e5m2(((const uint8_t *)cache)[i]);
    if (kind == KVA_I8)
        return ((const int8_t *)cache)[i];
    return from_bf16(((const uint16_t *)cache)[i]);
}

static int run_case(int kind, int threads, int window, float cap, int nh, int nkv, int D, int bs)
{
    enum { S = 3 };
    /* a decode long enough to be split (> 1024 keys), a chunk, a prefill */
    int64_t lens[S] = {1000 + (int64_t)(rnd() % 200), 1 + (int64_t)(rnd() % 60),
                       1 + (int64_t)(rnd() % 100)};
    int64_t nq[S] = {1, 1 + (int64_t)(rnd() % (uint32_t)lens[1]), lens[2]};
    int64_t qsl[S + 1] = {0};
    int max_blocks = 0, total_blocks = 0;
    for (int s = 0; s < S; s++) {
        qsl[s + 1] = qsl[s] + nq[s];
        int nb = (int)((lens[s] + bs - 1) / bs);
        if (nb > max_blocks)
            max_blocks = nb;
        total_blocks += nb;
    }
    int num_blocks = total_blocks + 2;
    size_t isz = kind == KVA_F32 ? 4 : kind >= KVA_F8E4M3 ? 1 : 2;
    size_t cache_elems = (size_t)num_blocks * nkv * bs * D;
    char *kc = malloc(cache_elems * isz), *vc = malloc(cache_elems * isz);
    /* the scale of each row (element i's: row i / D): int8's own, fp8's layer's */
    size_t rows = cache_elems / D;
    float *ksc = malloc(sizeof(float) * rows), *vsc = malloc(sizeof(float) * rows);
    for (size_t r = 0; r < rows; r++) {
        ksc[r] = kind == KVA_I8 ? (1.5f + urand()) / 127.0f : kind >= KVA_F8E4M3 ? 0.5f : 1.0f;
        vsc[r] = kind == KVA_I8 ? (1.5f + urand()) / 127.0f : kind >= KVA_F8E4M3 ? 2.0f : 1.0f;
    }
    for (size_t i = 0; i < cache_elems; i++) {
        float k = urand(), v = urand();
        if (kind == KVA_F8E4M3 || kind == KVA_F8E5M2) {
            ((uint8_t *)kc)[i] = fp8_code(kind);
            ((uint8_t *)vc)[i] = fp8_code(kind);
        } else if (kind == KVA_I8) {
            ((uint8_t *)kc)[i] = (uint8_t)rnd();
            ((uint8_t *)vc)[i] = (uint8_t)rnd();
        } else if (kind == KVA_F32) {
            ((float *)kc)[i] = k;
            ((float *)vc)[i] = v;
        } else if (kind == KVA_F16) {
            ((uint16_t *)kc)[i] = to_f16(k);
            ((uint16_t *)vc)[i] = to_f16(v);
        } else {
            ((uint16_t *)kc)[i] = to_bf16(k);
            ((uint16_t *)vc)[i] = to_bf16(v);
        }
    }
    /* a shuffled permutation of the block ids */
    int *perm = malloc(sizeof(int) * num_blocks);
    for (int i = 0; i < num_blocks; i++)
        perm[i] = i;
    for (int i = num_blocks - 1; i > 0; i--) {
        int j = (int)(rnd() % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t *tables = malloc(sizeof(int32_t) * S * max_blocks);
    for (int s = 0, next = 0; s < S; s++)
        for (int b = 0; b < max_blocks; b++)
            tables[s * max_blocks + b] = b < (lens[s] + bs - 1) / bs ? perm[next++] : -1;
    int64_t T = qsl[S];
    float *q = malloc(sizeof(float) * T * nh * D), *out = malloc(sizeof(float) * T * nh * D);
    for (int64_t i = 0; i < T * nh * D; i++)
        q[i] = urand() * 2.0f;
    float scale = 1.0f / sqrtf((float)D);
    kva_args a = {q, out, kc, vc, kind,
                  (ptrdiff_t)(nkv * bs * D * isz), (ptrdiff_t)(bs * D * isz), (ptrdiff_t)(D * isz),
                  bs, nh, nkv, D, tables, max_blocks, lens, qsl, S, scale, window, cap, threads};
    if (kind == KVA_I8) {
        a.key_scales = ksc;
        a.value_scales = vsc;
    } else if (kind >= KVA_F8E4M3) {
        a.k_scale = 0.5f;
        a.v_scale = 2.0f;
    }
    if (kva_paged_attention(&a) != KVA_OK) {
        printf("kernel failed\n");
        return 1;
    }
    /* reference */
    double maxerr = 0, maxval = 0;
    int G = nh / nkv;
    double *w = malloc(sizeof(double) * 2000);
    for (int s = 0; s < S; s++) {
        for (int64_t j = 0; j < nq[s]; j++) {
            int64_t pos = lens[s] - nq[s] + j, lo = window && pos + 1 > window ? pos + 1 - window : 0;
            for (int h = 0; h < nh; h++) {
                int g = h / G;
                const float *qq = q + ((qsl[s] + j) * nh + h) * D;
                double mx = -INFINITY, sum = 0;
                for (int64_t t = lo; t <= pos; t++) {
                    size_t base = ((size_t)tables[s * max_blocks + t / bs] * nkv + g) * bs * D +
                                  (size_t)(t % bs) * D;
                    double dot = 0;
                    for (int d = 0; d < D; d++)
                        dot += (double)qq[d] * stored(kc, kind, base + d);
                    dot *= scale * (double)ksc[base / D];
                    if (cap > 0)
                        dot = cap * tanh(dot / cap);
                    w[t - lo] = dot;
                    if (dot > mx)
                        mx = dot;
                }
                for (int64_t t = lo; t <= pos; t++)
                    sum += (w[t - lo] = exp(w[t - lo] - mx));
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int64_t t = lo; t <= pos; t++) {
                        size_t base = ((size_t)tables[s * max_blocks + t / bs] * nkv + g) * bs * D +
                                      (size_t)(t % bs) * D;
                        o += w[t - lo] * stored(vc, kind, base + d) * vsc[base / D];
                    }
                    o /= sum;
                    double got = out[((qsl[s] + j) * nh + h) * D + d];
                    if (fabs(got - o) > maxerr)
                        maxerr = fabs(got - o);
                    if (fabs(o) > maxval)
                        maxval = fabs(o);
                }
            }
        }
    }
    free(w);
    free(ksc);
    free(vsc);
    free(kc);
    free(vc);
    free(perm);
    free(tables);
    free(q);
    free(out);
    double rel = maxerr / maxval;
    if (!(rel <= 1e-5)) {
        printf("  FAIL kind %d threads %d window %d cap %g heads %d/%d dim %d block %d: %.3g\n",
               kind, threads, window, cap, nh, nkv, D, bs, rel);
        return 1;
    }
    return 0;
}

/* The level's 2^x (x <= 0, the softmax's exp) against double precision:
 * within 2 float ulps (relative 2.4e-7) wherever the result is normal. */
static int check_exp2(int level)
{
    enum { N = 100001 };
    static float x[N], y[N];
    for (int i = 0; i < N; i++)
        x[i] = -126.0f * (float)i / (float)(N - 1);
    if (kva_exp2_neg(level, x, y, N) != 0)
        return 1;
    double worst = 0;
    for (int i = 0; i < N; i++) {
        double want = exp2((double)x[i]);
        double rel = fabs(y[i] - want) / want;
        if (rel > worst)
            worst = rel;
    }
    if (!(worst <= 2.4e-7)) {
        printf("  FAIL exp2: max relative error %.3g\n", worst);
        return 1;
    }
    return 0;
}

int main(void)
{
    int failures = 0, levels = 0;
    for (int level = 0; level < KVA_NUM_LEVELS; level++) {
        if (!kva_level_supported(level))
            continue;
        kva_set_level(level);
        levels++;
        int cases = 0, before = failures;
        for (int kind = 0; kind <= KVA_I8; kind++) {
            failures += run_case(kind, 1, 0, 0.0f, 8, 2, 64, 16);
            failures += run_case(kind, 3, 0, 0.0f, 4, 1, 40, 1);
            failures += run_case(kind, 2, 37, 0.0f, 4, 4, 128, 32);
            failures += run_case(kind, 3, 0, 1.5f, 8, 1, 96, 16);
            cases += 4;
        }
        failures += check_exp2(level);
        printf("level %s: %d cases, %d failures\n", kva_level_name(level), cases,
               failures - before);
    }
    printf("%d levels, %d failures\n", levels, failures);
    return failures ? 1 : 0;
}
