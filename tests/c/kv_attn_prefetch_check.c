/*
 * The kernels that prefetch the next tile's rows among their own loads
 * (kva_kernels.prefetch: given `next` rows) give the bits they give without
 * them, at every native level of this CPU that has them (avx2, avx512):
 * every kind, head_dims with and without a last partial vector, 1 to 64
 * rows, ragged key counts, next rows that are other rows of the tile.
 * (kv_attn_avx512_check.c also checks the avx512 ones under SIMDe.)
 * Exit status 0: all equal; 1: a mismatch; 3: no level here has them.
 */
#define main kv_attention_check_main     /* for its fill_row */
#include "kv_attention_check.c"
#undef main

#include "kv_attn_internal.h"
#include "kv_simd.h"

#include <stdlib.h>
#include <string.h>

static int fails, checks;

static const kva_kernels *table_for(int level)
{
#if KVA_HAVE_AVX2
    if (level == KVS_AVX2)
        return kva_kernels_avx2;
#endif
#if KVA_HAVE_AVX512
    if (level == KVS_AVX512)
        return kva_kernels_avx512;
#endif
    (void)level;
    return NULL;
}

static void check(int ok, const char *what, const char *level, int kind, int D, int M, int n)
{
    checks++;
    if (!ok) {
        fails++;
        printf("MISMATCH %s level %s kind %d D %d M %d n %d\n", what, level, kind, D, M, n);
    }
}

static void check_level(int level)
{
    enum { T = KVA_KEY_TILE };
    const kva_kernels *tab = table_for(level);
    const char *name = kvs_level_name(level);
    static const int dims[] = {8, 24, 64, 72, 128, 136};
    static const int rows_[] = {1, 2, 3, 4, 5, 8, 16, 64};
    for (int kind = 0; kind <= KVA_I8; kind++)
        for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
            for (size_t ri = 0; ri < sizeof rows_ / sizeof *rows_; ri++) {
                const kva_kernels *k = &tab[kind];
                const int D = dims[di], M = rows_[ri], isz = kva_isz(kind);
                const int nt = 1 + (int)(rnd() % T), ntp = (nt + 7) & ~7;
                char *rows = malloc((size_t)T * D * isz);
                const char *row[T], *next[T];
                for (int i = 0; i < T; i++) {
                    fill_row(rows + (size_t)i * D * isz, kind, D, 0);
                    row[i] = rows + (size_t)i * D * isz;
                }
                for (int i = 0; i < T; i++)
                    next[i] = row[(i * 7 + 3) % T];
                const size_t big = (size_t)(M > T ? M : T) * D;
                float *a = malloc(sizeof(float) * big), *b = malloc(sizeof(float) * big);
                float *Q = malloc(sizeof(float) * M * D), *tmp = malloc(sizeof(float) * T * D);
                float *P = malloc(sizeof(float) * M * T), *alpha = malloc(sizeof(float) * M);
                float *Sa = malloc(sizeof(float) * M * T), *Sb = malloc(sizeof(float) * M * T);
                k->widen(row, ntp, D, a, NULL);
                k->widen(row, ntp, D, b, next);
                check(memcmp(a, b, sizeof(float) * ntp * D) == 0, "widen", name, kind, D, M, ntp);
                for (int i = 0; i < M * D; i++)
                    Q[i] = urand();
                memset(Sa, 0, sizeof(float) * M * T);
                memset(Sb, 0, sizeof(float) * M * T);
                k->scores(Q, M, D, row, ntp, Sa, tmp, NULL);
                k->scores(Q, M, D, row, ntp, Sb, tmp, next);
                check(memcmp(Sa, Sb, sizeof(float) * M * T) == 0, "scores", name, kind, D, M, ntp);
                urand_pv(P, alpha, M, T);
                for (int i = 0; i < M * D; i++)
                    a[i] = b[i] = urand();
                k->pv(P, M, D, row, nt, a, alpha, tmp, NULL);
                k->pv(P, M, D, row, nt, b, alpha, tmp, next);
                check(memcmp(a, b, sizeof(float) * M * D) == 0, "pv", name, kind, D, M, nt);
                free(rows);
                free(a);
                free(b);
                free(Q);
                free(tmp);
                free(P);
                free(alpha);
                free(Sa);
                free(Sb);
            }
}

int main(void)
{
    int checked = 0;
    for (int level = 1; level < KVS_NUM_LEVELS; level++) {
        const kva_kernels *tab = table_for(level);
        if (tab == NULL || !kvs_level_supported(level))
            continue;
        if (!tab[KVA_F16].prefetch) {
            printf("level %s has no prefetching kernels\n", kvs_level_name(level));
            return 1;
        }
        check_level(level);
        printf("level %s checked\n", kvs_level_name(level));
        checked++;
    }
    printf("%d level(s), %d checks, %d mismatches\n", checked, checks, fails);
    return fails ? 1 : (checked ? 0 : 3);
}
