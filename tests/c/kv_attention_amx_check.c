/*
 * The amx level of the attention (kv_attn_amx.c) under the tile emulation
 * (amx_tile_emulation.h: SIMDe for AVX-512, the tile instructions from
 * Intel's pseudocode), on any CPU.  Built by
 * tests/test_attention_amx_emulated.py with
 *     -DKVA_AMX_EMULATION -DKVA_AMX_TARGET= -DKVS_TEST_ASSUME_AMX
 * and run there.  Against a double-precision attention (within 1e-5: max
 * abs error / max abs value): every page kind, head_dims 32 to 256, GQA
 * groups 1, 4 and 8, causal prefill with ragged tails (lengths no multiple
 * of the block, the key tile or the tile rows), chunked prefill over cached
 * context, a decode beside them, sliding windows, soft caps, block sizes 16
 * and 5; 3 threads give the bits of 1; and the features (chunks, ALiBi,
 * sinks, extreme scales: kv_attention_check.c's cases).  Each case also
 * checks the tiles ran
 * exactly where they should: TDPBF16PS executed for every kind but float32
 * when head_dim is a multiple of 32, none otherwise.
 *
 * The helpers (random pages, the element decoders, the double-precision
 * reference, the first check's cases and its 2^x check) come from
 * kv_attention_check.c, run here at the amx level.  Prints "amx: N cases, 0 failures, T TDPBF16PS".
 */
#define main kv_attention_check_main
#include "kv_attention_check.c"
#undef main

extern long amx_emu_tdpbf16ps_count;

typedef struct {
    int kind, nh, nkv, D, bs, window;
    float cap;
    int nseq;
    int64_t lens[3], nq[3];
    int qbf16; /* q's elements bfloat16 values (a bfloat16 model's): one bf16 term */
} amx_case;

/* The TDPBF16PS the last amx_run_case executed. */
static long amx_case_tdp;

static int amx_run_case(const amx_case *c)
{
    const int kind = c->kind, D = c->D, nh = c->nh, nkv = c->nkv, bs = c->bs;
    int64_t qsl[4] = {0};
    int max_blocks = 0, total_blocks = 0;
    for (int s = 0; s < c->nseq; s++) {
        qsl[s + 1] = qsl[s] + c->nq[s];
        int nb = (int)((c->lens[s] + bs - 1) / bs);
        if (nb > max_blocks)
            max_blocks = nb;
        total_blocks += nb;
    }
    const int num_blocks = total_blocks + 3;
    const size_t isz = (size_t)kva_isz(kind), elems = (size_t)num_blocks * nkv * bs * D;
    char *kc, *vc;
    float *ksc, *vsc;
    fill_pages(kind, elems, D, &kc, &vc, &ksc, &vsc);
    int32_t *tables = malloc(sizeof(int32_t) * c->nseq * max_blocks);
    for (int s = 0, next = 0; s < c->nseq; s++)
        for (int b = 0; b < max_blocks; b++) /* scattered pages */
            tables[s * max_blocks + b] =
                b < (c->lens[s] + bs - 1) / bs ? (int32_t)((next++ * 7 + 2) % num_blocks) : -1;
    const int64_t T = qsl[c->nseq];
    const size_t qn = (size_t)T * nh * D;
    float *q = malloc(sizeof(float) * qn), *out = malloc(sizeof(float) * qn),
          *out1 = malloc(sizeof(float) * qn);
    for (size_t i = 0; i < qn; i++) {
        q[i] = urand() * 2.0f;
        if (c->qbf16) { /* rounded to a bfloat16 by truncation */
            uint32_t u;
            memcpy(&u, &q[i], 4);
            u &= 0xFFFF0000u;
            memcpy(&q[i], &u, 4);
        }
    }
    kva_args a = {q, out, kc, vc, kind,
                  (ptrdiff_t)(nkv * bs * D * isz), (ptrdiff_t)(bs * D * isz), (ptrdiff_t)(D * isz),
                  bs, nh, nkv, D, tables, max_blocks, c->lens, qsl, c->nseq,
                  1.0f / sqrtf((float)D), c->window, c->cap, 3};
    set_scales(&a, ksc, vsc);
    int fail = 0;
    const long before = __atomic_load_n(&amx_emu_tdpbf16ps_count, __ATOMIC_RELAXED);
    if (kva_paged_attention(&a) != KVA_OK)
        fail = 1;
    const long ran = __atomic_load_n(&amx_emu_tdpbf16ps_count, __ATOMIC_RELAXED) - before;
    amx_case_tdp = ran;
    a.out = out1;
    a.num_threads = 1;
    if (kva_paged_attention(&a) != KVA_OK)
        fail = 1;
    double maxval = 0;
    const double err = ref_error(&a, out, ksc, vsc, &maxval);
    const double rel = err / maxval;
    const int want_tiles = kind != KVA_F32 && D % 32 == 0;
    const char *why = NULL;
    if (fail)
        why = "kernel failed";
    else if (!(rel <= 1e-5))
        why = "too far from the reference";
    else if (memcmp(out, out1, sizeof(float) * qn) != 0)
        why = "3 threads gave other bits than 1";
    else if ((ran > 0) != want_tiles)
        why = want_tiles ? "the tiles did not run" : "the tiles ran where they should not";
    if (why)
        printf("  FAIL %s: kind %d heads %d/%d dim %d block %d window %d cap %g q bf16 %d: "
               "rel %.3g, %ld TDPBF16PS\n", why, kind, nh, nkv, D, bs, c->window, c->cap,
               c->qbf16, rel, ran);
    free(kc);
    free(vc);
    free(ksc);
    free(vsc);
    free(tables);
    free(q);
    free(out);
    free(out1);
    return why != NULL;
}

int main(void)
{
    if (!kvc_use_level(KVA_AMX)) {
        printf("the amx level is not built in (KVS_TEST_ASSUME_AMX?)\n");
        return 2;
    }
    static const int dims[] = {64, 128, 32, 256, 96, 40};
    static const int heads[][2] = {{8, 2}, {4, 4}, {8, 1}};
    int cases = 0, failures = 0;
    for (int kind = 0; kind <= KVA_I8; kind++) {
        for (int di = 0; di < 6; di++) {
            for (int hi = 0; hi < 3; hi++) {
                if (dims[di] >= 256 && hi != 0)
                    continue; /* the widest dims once per kind */
                const int v = cases; /* the other parameters rotate */
                amx_case c = {kind, heads[hi][0], heads[hi][1], dims[di], v % 3 == 2 ? 5 : 16,
                              v % 4 == 1 ? 45 : 0, v % 5 == 3 ? 2.5f : 0.0f, 3,
                              /* causal prefill (ragged), chunk over cached context, decode */
                              {35 + v % 7, 90 + v % 11, 60 + v % 13},
                              {35 + v % 7, 17 + v % 5, 1}, v % 2};
                failures += amx_run_case(&c);
                cases++;
            }
        }
    }
    /* a bfloat16 q takes one bf16 term where a float32 one takes three: the
     * same case's scores run fewer tile products (and both are within 1e-5) */
    for (int kind = KVA_F16; kind <= KVA_I8; kind++) {
        amx_case c = {kind, 8, 2, 64, 16, 0, 0.0f, 1, {80}, {80}, 0};
        long tdp[2];
        for (int b = 0; b < 2; b++, cases++) {
            c.qbf16 = b;
            failures += amx_run_case(&c);
            tdp[b] = amx_case_tdp;
        }
        if (!(tdp[1] < tdp[0])) {
            printf("  FAIL kind %d: a bfloat16 q ran %ld TDPBF16PS, a float32 one %ld\n", kind,
                   tdp[1], tdp[0]);
            failures++;
        }
    }
    /* the first check's cases at this level (a decode long enough to be
     * split among them) and the level's 2^x */
    for (int kind = 0; kind <= KVA_I8; kind++, cases++)
        failures += run_case(kind, 3, kind % 2 ? 37 : 0, kind == 2 ? 1.5f : 0.0f, 8, 2, 64, 16);
    /* the features (chunks, ALiBi, sinks, extreme scales: applied per row
     * around the tiles' scores), one thread's bits too */
    for (int kind = 0; kind <= KVA_I8; kind++)
        failures += run_feature_cases(kind, &cases);
    /* fp8 with one scale per kv head (the tiles' scores and weights scaled by
     * each item's head's pair) */
    for (int kind = KVA_F8E4M3; kind <= KVA_F8E5M2; kind++, cases++)
        failures += run_case_scaled(kind, 3, 0, 0.0f, 8, 4, 64, 16, 1);
    failures += check_exp2(KVA_AMX);
    printf("amx: %d cases, %d failures, %ld TDPBF16PS\n", cases, failures,
           __atomic_load_n(&amx_emu_tdpbf16ps_count, __ATOMIC_RELAXED));
    return failures ? 1 : 0;
}
