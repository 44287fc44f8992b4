/*
 * kv_attention.c on its own (no Python): every kernel level this CPU runs,
 * against a plain double-precision attention, on random varlen batches over
 * float32, float16, bfloat16, fp8 (e4m3fn, e5m2; layer scales) and int8
 * (scales per token and kv head) pages (GQA, sliding window, soft cap, 1
 * and 3 threads), and with the features (chunked attention, ALiBi, sinks,
 * scales up to FLT_MAX / log2(e); decode splits among them), each feature
 * case also run on 1 thread for the same bits.  Built and run by
 * tests/test_attention.py natively and, for AArch64, under qemu.  Prints
 * one line per level and "0 failures" when every case is within 1e-5 (max
 * abs error / max abs value).
 */
#include "kv_attention_cases.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The features of the cases run_case_scaled runs next (zero: none):
 * chunk_size, ALiBi slopes and sinks (per query head, either sign), a scale
 * other than 1/sqrt(D), the length of the first (decode) sequence, and
 * integer-valued q and pages (exact float32 dots: with a huge scale the
 * softmax is one-hot on the largest dot, ties shared, as in double). */
static struct {
    int64_t chunk;
    int alibi, sinks, integers;
    float scale, q_range; /* q_range: q's elements in +-q_range (0: 2) */
    int64_t decode_len;
} feat;

/* Random pages of `kind` (elems elements each of K and V, in *kc / *vc)
 * and the scale of each row of D elements (*ksc / *vsc): int8's own, fp8's
 * layer's (0.5 and 2), 1 for the rest.  The caller frees the four. */
static void fill_pages(int kind, size_t elems, int D, char **kc, char **vc, float **ksc,
                       float **vsc)
{
    const size_t isz = (size_t)kva_isz(kind), rows = elems / D;
    char *k8 = *kc = malloc(elems * isz), *v8 = *vc = malloc(elems * isz);
    float *ks = *ksc = malloc(sizeof(float) * rows), *vs = *vsc = malloc(sizeof(float) * rows);
    for (size_t r = 0; r < rows; r++) {
        ks[r] = kind == KVA_I8 ? (1.5f + urand()) / 127.0f : kind >= KVA_F8E4M3 ? 0.5f : 1.0f;
        vs[r] = kind == KVA_I8 ? (1.5f + urand()) / 127.0f : kind >= KVA_F8E4M3 ? 2.0f : 1.0f;
    }
    for (size_t i = 0; i < elems; i++) {
        float k = urand(), v = urand();
        if (feat.integers) { /* -3..3 (exact in every float kind) */
            k = (float)((int)(rnd() % 7) - 3);
            v = (float)((int)(rnd() % 7) - 3);
        }
        if (kind == KVA_F8E4M3 || kind == KVA_F8E5M2) {
            ((uint8_t *)k8)[i] = fp8_code(kind);
            ((uint8_t *)v8)[i] = fp8_code(kind);
        } else if (kind == KVA_I8) {
            ((uint8_t *)k8)[i] = (uint8_t)rnd();
            ((uint8_t *)v8)[i] = (uint8_t)rnd();
        } else if (kind == KVA_F32) {
            ((float *)k8)[i] = k;
            ((float *)v8)[i] = v;
        } else if (kind == KVA_F16) {
            ((uint16_t *)k8)[i] = to_f16(k);
            ((uint16_t *)v8)[i] = to_f16(v);
        } else {
            ((uint16_t *)k8)[i] = to_bf16(k);
            ((uint16_t *)v8)[i] = to_bf16(v);
        }
    }
}

/* A row of D random elements of `kind` at p (fp8: finite codes; nan: now
 * and then an e4m3fn NaN code), for the drivers that include this file. */
static inline void fill_row(char *p, int kind, int D, int nan)
{
    for (int d = 0; d < D; d++) {
        if (kind == KVA_F32)
            ((float *)p)[d] = urand();
        else if (kind == KVA_F16)
            ((uint16_t *)p)[d] = to_f16(urand());
        else if (kind == KVA_BF16)
            ((uint16_t *)p)[d] = to_bf16(urand());
        else if (kind == KVA_I8)
            ((uint8_t *)p)[d] = (uint8_t)rnd();
        else
            ((uint8_t *)p)[d] = nan && rnd() % 97 == 0 ? (uint8_t)(0x7F | (rnd() & 0x80))
                                                       : fp8_code(kind);
    }
}

/* The scales of a kind into a's fields (fill_pages' values). */
static void set_scales(kva_args *a, const float *ksc, const float *vsc)
{
    if (a->kind == KVA_I8) {
        a->key_scales = ksc;
        a->value_scales = vsc;
    } else if (a->kind >= KVA_F8E4M3) {
        a->k_scale = 0.5f;
        a->v_scale = 2.0f;
    }
}

/* The largest |out - attention(a)| of a plain double-precision attention
 * over a's arguments (a NaN sticks), rows scaled by ksc / vsc; the largest
 * |attention(a)| into *maxval. */
static double ref_error(const kva_args *a, const float *out, const float *ksc, const float *vsc,
                        double *maxval)
{
    const int D = a->head_dim, nh = a->num_heads, nkv = a->num_kv_heads, G = nh / nkv;
    const int64_t bs = a->block_size, window = a->sliding_window, chunk = a->chunk_size;
    const int32_t *tables = a->block_tables;
    const ptrdiff_t mb = a->block_table_stride;
    int64_t longest = 1;
    for (int64_t s = 0; s < a->num_seqs; s++)
        longest = a->seq_lens[s] > longest ? a->seq_lens[s] : longest;
    double maxerr = 0;
    double *w = malloc(sizeof(double) * (size_t)longest);
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t q0 = a->query_start_loc[s], nq = a->query_start_loc[s + 1] - q0;
        for (int64_t j = 0; j < nq; j++) {
            int64_t pos = a->seq_lens[s] - nq + j, lo = window && pos + 1 > window ? pos + 1 - window : 0;
            if (chunk && pos / chunk * chunk > lo)
                lo = pos / chunk * chunk;
            for (int h = 0; h < nh; h++) {
                int g = h / G;
                const float *qq = a->q + ((q0 + j) * nh + h) * D;
                double mx = a->sinks ? a->sinks[h] : -INFINITY, sum = 0;
                for (int64_t t = lo; t <= pos; t++) {
                    size_t base = ((size_t)tables[s * mb + t / bs] * nkv + g) * bs * D +
                                  (size_t)(t % bs) * D;
                    double dot = 0;
                    for (int d = 0; d < D; d++)
                        dot += (double)qq[d] * stored(a->key_cache, a->kind, base + d);
                    dot *= a->scale * (double)ksc[base / D];
                    if (a->soft_cap > 0)
                        dot = a->soft_cap * tanh(dot / a->soft_cap);
                    if (a->alibi_slopes)
                        dot += (double)a->alibi_slopes[h] * (double)(t - pos);
                    w[t - lo] = dot;
                    if (dot > mx)
                        mx = dot;
                }
                for (int64_t t = lo; t <= pos; t++)
                    sum += (w[t - lo] = exp(w[t - lo] - mx));
                if (a->sinks)
                    sum += exp(a->sinks[h] - mx);
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int64_t t = lo; t <= pos; t++) {
                        size_t base = ((size_t)tables[s * mb + t / bs] * nkv + g) * bs * D +
                                      (size_t)(t % bs) * D;
                        o += w[t - lo] * stored(a->value_cache, a->kind, base + d) * vsc[base / D];
                    }
                    o /= sum;
                    double got = out[((q0 + j) * nh + h) * D + d];
                    if (!(fabs(got - o) <= maxerr))
                        maxerr = fabs(got - o); /* NaN sticks */
                    if (fabs(o) > *maxval)
                        *maxval = fabs(o);
                }
            }
        }
    }
    free(w);
    return maxerr;
}

/* per_head (fp8 only): one scale per kv head (k_head_scales / v_head_scales,
 * different for every head) instead of the layer's one. */
static int run_case_scaled(int kind, int threads, int window, float cap, int nh, int nkv, int D,
                           int bs, int per_head)
{
    enum { S = 3 };
    /* a decode long enough to be split (> 1024 keys), a chunk, a prefill */
    int64_t lens[S] = {feat.decode_len ? feat.decode_len : 1000 + (int64_t)(rnd() % 200),
                       1 + (int64_t)(rnd() % 60), 1 + (int64_t)(rnd() % 100)};
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
    size_t isz = (size_t)kva_isz(kind);
    size_t cache_elems = (size_t)num_blocks * nkv * bs * D;
    char *kc, *vc;
    float *ksc, *vsc;
    fill_pages(kind, cache_elems, D, &kc, &vc, &ksc, &vsc);
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
        q[i] = feat.integers ? (float)((int)(rnd() % 5) - 2)
                             : urand() * (feat.q_range != 0.0f ? feat.q_range : 2.0f);
    float scale = feat.scale != 0.0f ? feat.scale : 1.0f / sqrtf((float)D);
    kva_args a = {q, out, kc, vc, kind,
                  (ptrdiff_t)(nkv * bs * D * isz), (ptrdiff_t)(bs * D * isz), (ptrdiff_t)(D * isz),
                  bs, nh, nkv, D, tables, max_blocks, lens, qsl, S, scale, window, cap, threads};
    set_scales(&a, ksc, vsc);
    float slopes[256], sinks[256];
    for (int h = 0; h < nh && h < 256; h++) {
        /* ALiBi's geometric slopes (one negative), sinks of a trained
         * model's size, both signs */
        slopes[h] = (h % 5 == 3 ? -0.25f : 1.0f) * ldexpf(1.0f, -(8 * (h + 1)) / nh);
        sinks[h] = 4.0f * urand() + (h % 3 == 0 ? 3.0f : 0.0f);
    }
    a.chunk_size = feat.chunk;
    a.alibi_slopes = feat.alibi && nh <= 256 ? slopes : NULL;
    a.sinks = feat.sinks && nh <= 256 ? sinks : NULL;
    float khs[128], vhs[128];
    if (per_head && kind >= KVA_F8E4M3 && kind != KVA_I8 && nkv <= 128) {
        for (int g = 0; g < nkv; g++) {
            khs[g] = 0.25f * (float)(1 + g);
            vhs[g] = 4.0f / (float)(1 + 2 * g);
        }
        /* row r of the pages is (block, head, position): its head's scales */
        for (size_t r = 0; r < cache_elems / (size_t)D; r++) {
            ksc[r] = khs[(r / (size_t)bs) % (size_t)nkv];
            vsc[r] = vhs[(r / (size_t)bs) % (size_t)nkv];
        }
        a.k_head_scales = khs;
        a.v_head_scales = vhs;
    }
    if (kva_paged_attention(&a) != KVA_OK) {
        printf("kernel failed\n");
        return 1;
    }
    int same_bits = 1;
    if (feat.chunk || feat.alibi || feat.sinks || feat.scale != 0.0f) {
        /* the features' cases: one thread's bits too */
        float *out1 = malloc(sizeof(float) * T * nh * D);
        a.out = out1;
        a.num_threads = 1;
        same_bits = kva_paged_attention(&a) == KVA_OK &&
                    memcmp(out, out1, sizeof(float) * T * nh * D) == 0;
        a.out = out;
        a.num_threads = threads;
        free(out1);
    }
    double maxval = 0, maxerr = ref_error(&a, out, ksc, vsc, &maxval);
    free(ksc);
    free(vsc);
    free(kc);
    free(vc);
    free(perm);
    free(tables);
    free(q);
    free(out);
    double rel = maxerr / maxval;
    if (!(rel <= 1e-5) || !same_bits) {
        printf("  FAIL kind %d threads %d window %d cap %g heads %d/%d dim %d block %d chunk %d "
               "alibi %d sinks %d scale %g: %.3g%s\n",
               kind, threads, window, cap, nh, nkv, D, bs, (int)feat.chunk, feat.alibi,
               feat.sinks, feat.scale, rel, same_bits ? "" : " (1 thread: other bits)");
        return 1;
    }
    return 0;
}

/* The features' cases of one kind (kv_attention.h): chunks (beside a
 * window, within decode splits), ALiBi (with a cap), sinks (with splits,
 * a cap, ALiBi), and scales to the accepted extremes (38.3: integer data,
 * the one-hot limit; with sinks, a cap, negative); returns the failures. */
static int run_feature_cases(int kind, int *cases)
{
    static const struct {
        int64_t chunk, decode_len;
        int alibi, sinks, integers;
        float scale, q_range;
        int threads, window, cap2, nh, nkv, D, bs;
    } fc[] = {
        /* chunk, decode length, alibi, sinks, integers, scale, q range, threads, window,
         * cap * 2, heads, kv heads, head_dim, block (a scale past 1 with q kept small:
         * float32's error grows with the logits) */
        {48, 0, 0, 0, 0, 0.0f, 0, 3, 37, 0, 8, 2, 64, 16},    /* window beside chunks */
        {2000, 3050, 0, 1, 0, 0.0f, 0, 2, 0, 0, 4, 1, 40, 16}, /* a chunk split twice, sinks */
        {0, 0, 1, 0, 0, 0.0f, 0, 3, 0, 3, 8, 1, 96, 16},       /* ALiBi after a cap */
        {64, 0, 1, 1, 0, 0.0f, 0, 2, 50, 0, 4, 4, 128, 32},    /* everything at once */
        {0, 0, 0, 1, 0, 0.0f, 0, 3, 0, 0, 8, 2, 64, 5},        /* sinks over splits */
        {0, 0, 0, 0, 1, 1e38f, 0, 3, 0, 0, 8, 2, 64, 16},      /* 38.3: a huge scale */
        {0, 0, 1, 1, 1, 2.3e38f, 0, 2, 0, 0, 4, 2, 32, 16},    /* the largest, sinks, ALiBi */
        {0, 0, 0, 0, 1, -2e38f, 0, 3, 0, 5, 8, 2, 64, 16},     /* capped past FLT_MAX */
        {0, 0, 0, 1, 1, -1e38f, 0, 2, 19, 0, 8, 1, 64, 16},    /* negative, sinks */
        {0, 0, 1, 1, 0, 1.5f, 0.5f, 2, 0, 0, 8, 4, 64, 16},    /* scaled after the max */
    };
    int failures = 0;
    for (size_t i = 0; i < sizeof fc / sizeof *fc; i++) {
        feat.chunk = fc[i].chunk;
        feat.decode_len = fc[i].decode_len;
        feat.alibi = fc[i].alibi;
        feat.sinks = fc[i].sinks;
        feat.integers = fc[i].integers;
        feat.scale = fc[i].scale;
        feat.q_range = fc[i].q_range;
        failures += run_case_scaled(kind, fc[i].threads, fc[i].window, (float)fc[i].cap2 / 2.0f,
                                    fc[i].nh, fc[i].nkv, fc[i].D, fc[i].bs, 0);
        (*cases)++;
    }
    memset(&feat, 0, sizeof feat);
    return failures;
}

static int run_case(int kind, int threads, int window, float cap, int nh, int nkv, int D, int bs)
{
    return run_case_scaled(kind, threads, window, cap, nh, nkv, D, bs, 0);
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
        if (!kvc_use_level(level))
            continue;
        levels++;
        int cases = 0, before = failures;
        for (int kind = 0; kind <= KVA_I8; kind++) {
            failures += run_case(kind, 1, 0, 0.0f, 8, 2, 64, 16);
            failures += run_case(kind, 3, 0, 0.0f, 4, 1, 40, 1);
            failures += run_case(kind, 2, 37, 0.0f, 4, 4, 128, 32);
            failures += run_case(kind, 3, 0, 1.5f, 8, 1, 96, 16);
            cases += 4;
            failures += run_feature_cases(kind, &cases);
        }
        for (int kind = KVA_F8E4M3; kind <= KVA_F8E5M2; kind++) {   /* per-kv-head scales */
            failures += run_case_scaled(kind, 1, 0, 0.0f, 8, 4, 64, 16, 1);
            failures += run_case_scaled(kind, 3, 0, 1.5f, 6, 3, 96, 16, 1);
            failures += run_case_scaled(kind, 2, 37, 0.0f, 4, 4, 128, 32, 1);
            cases += 3;
        }
        failures += check_exp2(level);
        printf("level %s: %d cases, %d failures\n", kva_level_name(level), cases,
               failures - before);
    }
    printf("%d levels, %d failures\n", levels, failures);
    return failures ? 1 : 0;
}
