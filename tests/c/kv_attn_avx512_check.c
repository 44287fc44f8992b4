/*
 * The AVX-512 attention kernels (kv_attn_avx512.c), built by
 * tests/test_attention_avx512.py twice: on any CPU with kv_attn_avx512.c
 * compiled against SIMDe (-DKVA_AVX512_SIMDE, tests/c/kv_simde_shim.h) and
 * kv_simd.c told the level is there (-DKVS_TEST_EMULATE=KVS_AVX512); and,
 * on a CPU with AVX-512, natively from the sources as they ship.
 *
 *   1. the kernel tables, kind by kind, against the scalar ones: widen
 *      (the same values), scores and P.V (against float64 sums of the
 *      scalar-widened rows), over head_dims with and without a last vector
 *      of 8, 1 to 64 rows (16 and more: the scores over the transposed key
 *      tile), 1 to KVA_KEY_TILE (64) keys, e4m3fn NaN codes;
 *   2. the math table: row max (the same), exp2 sums, soft cap;
 *   3. whole attention calls at the avx512 level against the float64
 *      reference of kv_attention_check.c (its run_case: every kind, GQA,
 *      window, soft cap, decode splits, ragged chunks), on more shapes;
 *   4. the same bits for 1, 2 and 5 threads;
 *   5. the features (kv_attention_check.c's run_feature_cases: chunks,
 *      ALiBi, sinks, extreme scales) for every kind.
 *
 * Prints "avx512 emulated: N checks, 0 failures" ("native" natively).
 */
#define main kv_attention_check_main
#include "kv_attention_check.c"
#undef main

#include "kv_attn_internal.h"

static int checks, fails;

static void check(int ok, const char *what, int kind, int D, int M, int n, double err)
{
    checks++;
    if (!ok) {
        fails++;
        if (fails <= 20)
            printf("  FAIL %s kind %d D %d rows %d keys %d: %.3g\n", what, kind, D, M, n, err);
    }
}

static int same_float(float a, float b)
{
    return a == b || (a != a && b != b);
}

static void check_kernels(int kind, int D, int M, int nt, int nan)
{
    enum { T = KVA_KEY_TILE };
    const int ntp = (nt + 7) & ~7, isz = kva_isz(kind);
    const kva_kernels *v = &kva_kernels_avx512[kind], *s = &kva_kernels_scalar[kind];
    char *rows = malloc((size_t)T * D * isz);
    const char *row[T];
    for (int i = 0; i < T; i++) {
        fill_row(rows + (size_t)i * D * isz, kind, D, nan);
        row[i] = rows + (size_t)i * D * isz;
    }
    float *wv = malloc(sizeof(float) * T * D), *ws = malloc(sizeof(float) * T * D);
    float *Q = malloc(sizeof(float) * M * D), *tmp = malloc(sizeof(float) * T * D);
    float *Sv = malloc(sizeof(float) * M * T);
    float *accv = malloc(sizeof(float) * M * D), *acc0 = malloc(sizeof(float) * M * D);
    float *P = malloc(sizeof(float) * M * T), *alpha = malloc(sizeof(float) * M);

    /* widen: the stored values (divided by unit) */
    v->widen(row, ntp, D, wv, NULL);
    s->widen(row, ntp, D, ws, NULL);
    int ok = 1;
    for (int i = 0; i < ntp * D; i++)
        ok &= same_float(wv[i] * v->unit, ws[i]);
    check(ok, "widen", kind, D, 0, ntp, 0);
    /* the kernels that also prefetch a next tile's rows (here the rows in
     * reverse): the same bits */
    const char *next[T];
    for (int i = 0; i < T; i++)
        next[i] = row[T - 1 - i];
    float *again = malloc(sizeof(float) * (M > T ? M : T) * D);
    v->widen(row, ntp, D, again, next);
    check(memcmp(again, wv, sizeof(float) * ntp * D) == 0, "widen next bits", kind, D, 0, ntp, 0);
    if (nan) /* the NaN blend is what is checked; no sums over NaN */
        goto done;

    /* scores: against float64 sums of the widened rows */
    for (int i = 0; i < M * D; i++)
        Q[i] = urand();
    v->scores(Q, M, D, row, ntp, Sv, tmp, NULL);
    double worst = 0;
    for (int r = 0; r < M; r++)
        for (int i = 0; i < ntp; i++) {
            double want = 0, mag = 0;
            for (int d = 0; d < D; d++) {
                want += (double)Q[r * D + d] * ws[i * D + d];
                mag += fabs((double)Q[r * D + d] * ws[i * D + d]);
            }
            double err = fabs(Sv[r * T + i] * (double)v->unit - want) / (mag + 1e-30);
            if (err > worst)
                worst = err;
        }
    check(worst <= 2e-6, "scores", kind, D, M, ntp, worst);
    float *Sp = malloc(sizeof(float) * M * T);
    v->scores(Q, M, D, row, ntp, Sp, tmp, next);
    ok = 1;
    for (int r = 0; r < M; r++)
        ok &= memcmp(Sp + r * T, Sv + r * T, sizeof(float) * ntp) == 0;
    check(ok, "scores next bits", kind, D, M, ntp, 0);
    free(Sp);

    /* P.V: acc = acc * alpha + P V, against float64 */
    urand_pv(P, alpha, M, T);
    for (int i = 0; i < M * D; i++)
        accv[i] = acc0[i] = urand();
    v->pv(P, M, D, row, nt, accv, alpha, tmp, NULL);
    worst = 0;
    for (int r = 0; r < M; r++)
        for (int d = 0; d < D; d++) {
            /* the kernel reads the values divided by unit (the caller's
             * weights carry it): the same sum over value / unit */
            double want = (double)acc0[r * D + d] * alpha[r], mag = fabs(want);
            for (int i = 0; i < nt; i++) {
                const double pv = (double)P[r * T + i] * ws[i * D + d] / v->unit;
                want += pv;
                mag += fabs(pv);
            }
            const double err = fabs(accv[r * D + d] - want) / (mag + 1e-30);
            if (err > worst)
                worst = err;
        }
    check(worst <= 2e-6, "pv", kind, D, M, nt, worst);
    memcpy(again, acc0, sizeof(float) * M * D);
    v->pv(P, M, D, row, nt, again, alpha, tmp, next);
    check(memcmp(again, accv, sizeof(float) * M * D) == 0, "pv next bits", kind, D, M, nt, 0);

done:
    free(again);
    free(rows);
    free(wv);
    free(ws);
    free(Q);
    free(tmp);
    free(Sv);
    free(accv);
    free(acc0);
    free(P);
    free(alpha);
}

static void check_math(void)
{
    const kva_math *v = &kva_math_avx512, *s = &kva_math_scalar;
    float a[KVA_KEY_TILE], b[KVA_KEY_TILE];
    for (int ntp = 8; ntp <= KVA_KEY_TILE; ntp += 8)
        for (int rep = 0; rep < 50; rep++) {
            /* scores of a tile, now and then a masked (-inf) one and a
             * spread past exp2's range */
            for (int i = 0; i < ntp; i++)
                a[i] = urand() * (rep % 3 == 0 ? 200.0f : 30.0f);
            if (rep % 5 == 0)
                a[rnd() % ntp] = -INFINITY;
            memcpy(b, a, sizeof a);
            float mv = v->row_max(a, ntp), ms = s->row_max(b, ntp);
            check(mv == ms, "row_max", -1, 0, 0, ntp, mv - ms);
            float sv = v->row_exp_sum(a, ntp, mv), ss = s->row_exp_sum(b, ntp, ms);
            /* every element within 2 float ulps where normal; the sum
             * within a few roundings of float32 additions */
            double worst = fabs(sv - ss) / ss / 4.0;
            for (int i = 0; i < ntp; i++) {
                const double want = b[i];
                const double err = want >= 0x1p-126 ? fabs(a[i] - want) / want
                                                    : fabs(a[i] - want) / 0x1p-126;
                if (err > worst)
                    worst = err;
            }
            check(worst <= 2.4e-7, "row_exp_sum", -1, 0, 0, ntp, worst);
        }
    /* the soft cap over a range of a tile's sizes (the tail of each) */
    for (int n = 1; n <= 40; n++) {
        float x[40], y[40];
        for (int i = 0; i < n; i++)
            x[i] = y[i] = urand() * 20.0f;
        v->softcap(y, n, 0.5f, 3.0f);
        double worst = 0;
        for (int i = 0; i < n; i++) {
            double want = 3.0 * tanh(0.5 * (double)x[i]);
            double err = fabs(y[i] - want) / (fabs(want) + 1e-30);
            if (err > worst)
                worst = err;
        }
        check(worst <= 4e-7, "softcap", -1, 0, 0, n, worst);
    }
    /* the scales' products: the scalar loop's bits, every length (the
     * tails), each form (weights and a constant, weights, a constant) on
     * scores and on weights (flushed), subnormal and huge factors among them */
    for (int n = 0; n <= 40; n++)
        for (int form = 0; form < 6; form++) {
            const int weights = form >= 3;
            float x[40], y[40], w[40];
            for (int i = 0; i < n; i++) {
                x[i] = y[i] = urand() * (i % 7 == 0 ? 0x1p-120f : 30.0f);
                w[i] = urand() * (i % 5 == 0 ? 0x1p100f : 2.0f);
            }
            const float c = form % 3 == 1 ? 1.0f : (n % 2 ? 256.0f : 0x1p-20f);
            v->scale(y, form % 3 == 2 ? NULL : w, c, n, weights);
            s->scale(x, form % 3 == 2 ? NULL : w, c, n, weights);
            check(memcmp(x, y, (size_t)n * sizeof(float)) == 0, "scale", -1, 0, 0, n, form);
        }
}

/* One f16 (or `kind`) batch at the avx512 level with `threads` threads;
 * returns the output (malloc'd). */
static float *run_bits(int kind, int threads, int D, int nh, int nkv, uint64_t seed)
{
    rng_state = seed;
    enum { S = 3, BS = 16 };
    int64_t lens[S] = {2100, 70, 33}, nq[S] = {1, 9, 33}, qsl[S + 1] = {0, 1, 10, 43};
    (void)nq;
    const int max_blocks = (2100 + BS - 1) / BS, num_blocks = max_blocks * S;
    const size_t isz = kva_isz(kind), elems = (size_t)num_blocks * nkv * BS * D;
    char *kc = malloc(elems * isz), *vc = malloc(elems * isz);
    for (size_t r = 0; r < elems / D; r++) {
        fill_row(kc + r * D * isz, kind, D, 0);
        fill_row(vc + r * D * isz, kind, D, 0);
    }
    int32_t *tables = malloc(sizeof(int32_t) * S * max_blocks);
    for (int i = 0; i < S * max_blocks; i++)
        tables[i] = (int32_t)((i * 37) % num_blocks);
    float *q = malloc(sizeof(float) * 43 * nh * D), *out = malloc(sizeof(float) * 43 * nh * D);
    for (int i = 0; i < 43 * nh * D; i++)
        q[i] = urand();
    kva_args a = {q, out, kc, vc, kind,
                  (ptrdiff_t)(nkv * BS * D * isz), (ptrdiff_t)(BS * D * isz), (ptrdiff_t)(D * isz),
                  BS, nh, nkv, D, tables, max_blocks, lens, qsl, S, 0.125f, 0, 0.0f, threads};
    float *ksc = NULL, *vsc = NULL;
    if (kind == KVA_I8) {
        ksc = malloc(sizeof(float) * elems / D);
        vsc = malloc(sizeof(float) * elems / D);
        for (size_t r = 0; r < elems / D; r++)
            ksc[r] = vsc[r] = 1.0f / 64.0f;
        a.key_scales = ksc;
        a.value_scales = vsc;
    }
    if (kva_paged_attention(&a) != KVA_OK) {
        free(out);
        out = NULL;
    }
    free(kc);
    free(vc);
    free(tables);
    free(q);
    free(ksc);
    free(vsc);
    return out;
}

int main(void)
{
    if (!kvc_use_level(KVA_AVX512)) {
        printf("the avx512 level is not there\n");
        return 2;
    }
    static const int dims[] = {8, 16, 24, 40, 64, 72, 128, 136, 256};
    /* 16 rows and more: the scores over the transposed key tile */
    static const int rows_[] = {1, 2, 3, 4, 5, 8, 11, 16, 19, 24, 64};
    for (int kind = 0; kind <= KVA_I8; kind++)
        for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
            for (size_t ri = 0; ri < sizeof rows_ / sizeof *rows_; ri++) {
                const int nt = 1 + (int)(rnd() % KVA_KEY_TILE);
                check_kernels(kind, dims[di], rows_[ri], nt, 0);
                if (kind == KVA_F8E4M3)
                    check_kernels(kind, dims[di], rows_[ri], nt, 1);
            }
    check_math();
    checks++;
    fails += check_exp2(KVA_AVX512);

    /* whole calls against float64 (kv_attention_check.c's run_case):
     * head_dims with a last vector of 8, GQA groups of 1, 4 and 8 */
    for (int kind = 0; kind <= KVA_I8; kind++) {
        const int cases[][7] = {
            /* threads, window, cap*2, heads, kv heads, head_dim, block */
            {1, 0, 0, 8, 1, 24, 16}, {2, 19, 0, 8, 2, 72, 32}, {3, 0, 3, 4, 4, 136, 16},
            {1, 0, 0, 16, 2, 8, 1},  {2, 50, 4, 2, 1, 256, 16}, {3, 0, 0, 12, 3, 16, 32},
        };
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            const int *k = cases[c];
            checks++;
            fails += run_case(kind, k[0], k[1], (float)k[2] / 2.0f, k[3], k[4], k[5], k[6]);
        }
    }

    /* the features' cases (each also compared with one thread's bits) */
    for (int kind = 0; kind <= KVA_I8; kind++) {
        int n = 0;
        fails += run_feature_cases(kind, &n);
        checks += n;
    }

    /* the same bits for every thread count */
    for (int kind = 0; kind <= KVA_I8; kind++) {
        float *one = run_bits(kind, 1, 72, 8, 2, 1234 + kind);
        const size_t n = (size_t)43 * 8 * 72;
        for (int t = 2; t <= 5; t += 3) {
            float *other = run_bits(kind, t, 72, 8, 2, 1234 + kind);
            check(one && other && memcmp(one, other, n * sizeof(float)) == 0, "thread bits",
                  kind, 72, 8, t, 0);
            free(other);
        }
        free(one);
    }
#ifdef KVA_AVX512_SIMDE
    printf("avx512 emulated: %d checks, %d failures\n", checks, fails);
#else
    printf("avx512 native: %d checks, %d failures\n", checks, fails);
#endif
    return fails ? 1 : 0;
}
