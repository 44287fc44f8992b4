/*
 * The attention plan on its own (no Python): one kva_plan_create per
 * "step", kva_plan_run for several "layers" (each its own caches and
 * queries), every run bit for bit equal to kva_paged_attention over the
 * same arguments, at every kernel level, for 1 and 3 threads, over
 * float32, float16, bfloat16, fp8 e4m3fn (a layer scale) and int8 (scale
 * planes) pages, with a sliding window and a soft cap in some cases.  The
 * caller's index arrays are overwritten (and freed) after the plan is made:
 * the runs must not see it.  Built and run by tests/test_native_levels.py
 * natively and under qemu-aarch64.  Prints "0 failures" when all agree.
 */
#include "kv_attention_cases.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Random page bytes of a kind that decode to finite values. */
static void fill_pages(char *p, size_t n_elems, int kind)
{
    for (size_t i = 0; i < n_elems; i++) {
        float f = urand();
        if (kind == KVA_F32) {
            memcpy(p + 4 * i, &f, 4);
        } else if (kind == KVA_F16 || kind == KVA_BF16) {
            /* a normal half / bf16 in [-2, 2): sign, small exponent, mantissa */
            uint16_t h = kind == KVA_F16 ? (uint16_t)((rnd() & 0x83ffu) | (0x3000u + (rnd() % 4) * 0x400u))
                                         : (uint16_t)((rnd() & 0x807fu) | (0x3e00u + (rnd() % 4) * 0x80u));
            memcpy(p + 2 * i, &h, 2);
        } else if (kind == KVA_F8E4M3) {
            uint8_t b = (uint8_t)(rnd() & 0xff);
            if ((b & 0x7f) == 0x7f)
                b ^= 1; /* not the NaN code */
            p[i] = (char)b;
        } else {
            p[i] = (char)(int8_t)((int)(rnd() % 255) - 127);
        }
    }
}

enum { MAXB = 24 }; /* block table entries per sequence */

/* What kva_plan_create reads: the index arrays (block tables of MAXB
 * entries a row), the scalars (scale 1/8) and the thread count. */
static void set_index(kva_args *a, const int32_t *tables, const int64_t *seq_lens,
                      const int64_t *qsl, int64_t num_seqs, int window, float cap, int threads)
{
    a->block_tables = tables;
    a->block_table_stride = MAXB;
    a->seq_lens = seq_lens;
    a->query_start_loc = qsl;
    a->num_seqs = num_seqs;
    a->scale = 0.125f;
    a->sliding_window = window;
    a->soft_cap = cap;
    a->num_threads = threads;
}

/* One step: S sequences (some decode, some prefill chunks), L layers. */
static int run_step(int kind, int threads, int window, float cap, int *cases)
{
    enum { S = 4, L = 3, BS = 16, NKV = 2, NH = 8, D = 64, NB = 80 };
    const int lens[S] = {1, 300, 37, 129}, queries[S] = {1, 1, 37, 5};
    int64_t *seq_lens = malloc(S * sizeof(int64_t));
    int64_t *qsl = malloc((S + 1) * sizeof(int64_t));
    int32_t *tables = malloc(S * MAXB * sizeof(int32_t));
    int64_t keep_lens[S], keep_qsl[S + 1];
    int32_t keep_tables[S * MAXB];
    qsl[0] = 0;
    for (int s = 0; s < S; s++) {
        seq_lens[s] = lens[s];
        qsl[s + 1] = qsl[s] + queries[s];
    }
    for (int i = 0; i < S * MAXB; i++)
        tables[i] = (int32_t)(rnd() % NB); /* shuffled pages */
    memcpy(keep_lens, seq_lens, sizeof keep_lens);
    memcpy(keep_qsl, qsl, sizeof keep_qsl);
    memcpy(keep_tables, tables, sizeof keep_tables);
    const int T = (int)qsl[S];
    const size_t page_elems = (size_t)NB * NKV * BS * D;
    const int isz = kva_isz(kind);
    kva_args shape = kva_args_dense(NULL, NULL, NULL, NULL, kind, BS, NH, NKV, D);
    set_index(&shape, tables, seq_lens, qsl, S, window, cap, threads);
    int status = -99;
    kva_plan *plan = kva_plan_create(&shape, &status);
    if (plan == NULL || status != KVA_OK) {
        printf("kva_plan_create failed: %d\n", status);
        return 1;
    }
    /* the caller reuses its arrays: the plan has its own copies */
    for (int i = 0; i < S * MAXB; i++)
        tables[i] = -1;
    for (int s = 0; s < S; s++)
        seq_lens[s] = 1 << 30;
    free(tables);
    free(seq_lens);
    free(qsl);

    int failures = 0;
    for (int layer = 0; layer < L; layer++) {
        char *kc = malloc(page_elems * isz), *vc = malloc(page_elems * isz);
        float *q = malloc((size_t)T * NH * D * sizeof(float));
        float *out_plan = malloc((size_t)T * NH * D * sizeof(float));
        float *out_ref = malloc((size_t)T * NH * D * sizeof(float));
        float *ks = NULL, *vs = NULL;
        fill_pages(kc, page_elems, kind);
        fill_pages(vc, page_elems, kind);
        for (size_t i = 0; i < (size_t)T * NH * D; i++)
            q[i] = urand();
        if (kind == KVA_I8) {
            ks = malloc((size_t)NB * NKV * BS * sizeof(float));
            vs = malloc((size_t)NB * NKV * BS * sizeof(float));
            for (int i = 0; i < NB * NKV * BS; i++) {
                ks[i] = (1.0f + urand()) / 127.0f;
                vs[i] = (1.0f + urand()) / 127.0f;
            }
        }
        kva_args data = kva_args_dense(q, out_plan, kc, vc, kind, BS, NH, NKV, D);
        data.key_scales = ks;
        data.value_scales = vs;
        data.k_scale = kind == KVA_F8E4M3 ? 0.5f : 1.0f;
        data.v_scale = kind == KVA_F8E4M3 ? 0.25f : 1.0f;
        /* index fields that must NOT be read by a run */
        data.block_tables = NULL;
        data.seq_lens = NULL;
        data.query_start_loc = NULL;
        data.num_seqs = -7;
        memset(out_plan, 0xff, (size_t)T * NH * D * sizeof(float));
        int rc = kva_plan_run(plan, &data);
        /* the reference: the one-call API over the arguments as planned */
        kva_args full = data;
        set_index(&full, keep_tables, keep_lens, keep_qsl, S, window, cap, 1);
        full.out = out_ref;
        int rc2 = kva_paged_attention(&full);
        (*cases)++;
        if (rc != KVA_OK || rc2 != KVA_OK) {
            printf("kind %d threads %d layer %d: status %d / %d\n", kind, threads, layer, rc, rc2);
            failures++;
        } else if (memcmp(out_plan, out_ref, (size_t)T * NH * D * sizeof(float)) != 0) {
            printf("kind %d threads %d window %d cap %g layer %d: plan run != paged_attention\n",
                   kind, threads, window, (double)cap, layer);
            failures++;
        }
        free(kc), free(vc), free(q), free(out_plan), free(out_ref), free(ks), free(vs);
    }
    /* a run whose shape differs from the plan's is refused */
    kva_args wrong = kva_args_dense(NULL, NULL, NULL, NULL, kind, BS, NH, NKV, D + 8);
    if (kva_plan_run(plan, &wrong) != KVA_EINVAL) {
        printf("a run of another head_dim was not refused\n");
        failures++;
    }
    kva_plan_free(plan);
    return failures;
}

int main(void)
{
    static const int kinds[] = {KVA_F32, KVA_F16, KVA_BF16, KVA_F8E4M3, KVA_I8};
    int failures = 0, levels = 0;
    for (int level = 0; level < KVA_NUM_LEVELS; level++) {
        if (!kvc_use_level(level))
            continue;
        levels++;
        int cases = 0, f = 0;
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
            for (int threads = 1; threads <= 3; threads += 2) {
                f += run_step(kinds[k], threads, 0, 0.0f, &cases);
                f += run_step(kinds[k], threads, 100, 30.0f, &cases);
            }
        printf("plan level %s: %d runs, %d failures\n", kva_level_name(level), cases, f);
        failures += f;
    }
    kva_plan_free(NULL); /* a no-op */
    printf("%d levels, %d failures\n", levels, failures);
    return failures != 0;
}
