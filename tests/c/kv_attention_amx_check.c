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
 * and 5; 3 threads give the bits of 1.  Each case also checks the tiles ran
 * exactly where they should: TDPBF16PS executed for every kind but float32
 * when head_dim is a multiple of 32, none otherwise.
 *
 * The helpers (random pages, the element decoders, the first check's cases
 * and its 2^x check) come from kv_attention_check.c, run here at the amx
 * level.  Prints "amx: N cases, 0 failures, T TDPBF16PS".
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
} amx_case;

static double ref_out(const amx_case *c, const float *q, const char *kc, const char *vc,
                      const float *ksc, const float *vsc, const int32_t *tables, int max_blocks,
                      const int64_t *qsl, const float *out, double *maxval)
{
    const int D = c->D, nh = c->nh, nkv = c->nkv, G = nh / nkv, bs = c->bs;
    const double scale = 1.0 / sqrt((double)D);
    double maxerr = 0;
    double *w = malloc(sizeof(double) * (size_t)c->lens[0] * 4 + 4096);
    for (int s = 0; s < c->nseq; s++) {
        for (int64_t j = 0; j < c->nq[s]; j++) {
            int64_t pos = c->lens[s] - c->nq[s] + j;
            int64_t lo = c->window && pos + 1 > c->window ? pos + 1 - c->window : 0;
            for (int h = 0; h < nh; h++) {
                const int g = h / G;
                const float *qq = q + ((qsl[s] + j) * nh + h) * D;
                double mx = -INFINITY, sum = 0;
                for (int64_t t = lo; t <= pos; t++) {
                    size_t base = ((size_t)tables[s * max_blocks + t / bs] * nkv + g) * bs * D +
                                  (size_t)(t % bs) * D;
                    double dot = 0;
                    for (int d = 0; d < D; d++)
                        dot += (double)qq[d] * stored(kc, c->kind, base + d);
                    dot *= scale * (double)ksc[base / D];
                    if (c->cap > 0)
                        dot = c->cap * tanh(dot / c->cap);
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
                        o += w[t - lo] * stored(vc, c->kind, base + d) * vsc[base / D];
                    }
                    o /= sum;
                    double got = out[((qsl[s] + j) * nh + h) * D + d];
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
    const size_t isz = kind == KVA_F32 ? 4 : kind >= KVA_F8E4M3 ? 1 : 2;
    const size_t elems = (size_t)num_blocks * nkv * bs * D, rows = elems / D;
    char *kc = malloc(elems * isz), *vc = malloc(elems * isz);
    float *ksc = malloc(sizeof(float) * rows), *vsc = malloc(sizeof(float) * rows);
    for (size_t r = 0; r < rows; r++) {
        ksc[r] = kind == KVA_I8 ? (1.5f + urand()) / 127.0f : kind >= KVA_F8E4M3 ? 0.5f : 1.0f;
        vsc[r] = kind == KVA_I8 ? (1.5f + urand()) / 127.0f : kind >= KVA_F8E4M3 ? 2.0f : 1.0f;
    }
    for (size_t i = 0; i < elems; i++) {
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
    int32_t *tables = malloc(sizeof(int32_t) * c->nseq * max_blocks);
    for (int s = 0, next = 0; s < c->nseq; s++)
        for (int b = 0; b < max_blocks; b++) /* scattered pages */
            tables[s * max_blocks + b] =
                b < (c->lens[s] + bs - 1) / bs ? (int32_t)((next++ * 7 + 2) % num_blocks) : -1;
    const int64_t T = qsl[c->nseq];
    const size_t qn = (size_t)T * nh * D;
    float *q = malloc(sizeof(float) * qn), *out = malloc(sizeof(float) * qn),
          *out1 = malloc(sizeof(float) * qn);
    for (size_t i = 0; i < qn; i++)
        q[i] = urand() * 2.0f;
    kva_args a = {q, out, kc, vc, kind,
                  (ptrdiff_t)(nkv * bs * D * isz), (ptrdiff_t)(bs * D * isz), (ptrdiff_t)(D * isz),
                  bs, nh, nkv, D, tables, max_blocks, c->lens, qsl, c->nseq,
                  1.0f / sqrtf((float)D), c->window, c->cap, 3};
    if (kind == KVA_I8) {
        a.key_scales = ksc;
        a.value_scales = vsc;
    } else if (kind >= KVA_F8E4M3) {
        a.k_scale = 0.5f;
        a.v_scale = 2.0f;
    }
    int fail = 0;
    const long before = __atomic_load_n(&amx_emu_tdpbf16ps_count, __ATOMIC_RELAXED);
    if (kva_paged_attention(&a) != KVA_OK)
        fail = 1;
    const long ran = __atomic_load_n(&amx_emu_tdpbf16ps_count, __ATOMIC_RELAXED) - before;
    a.out = out1;
    a.num_threads = 1;
    if (kva_paged_attention(&a) != KVA_OK)
        fail = 1;
    double maxval = 0;
    const double err = ref_out(c, q, kc, vc, ksc, vsc, tables, max_blocks, qsl, out, &maxval);
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
        printf("  FAIL %s: kind %d heads %d/%d dim %d block %d window %d cap %g: rel %.3g, "
               "%ld TDPBF16PS\n", why, kind, nh, nkv, D, bs, c->window, c->cap, rel, ran);
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
    if (!kva_level_supported(KVA_AMX) || kva_set_level(KVA_AMX) != 0) {
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
                              {35 + v % 7, 17 + v % 5, 1}};
                failures += amx_run_case(&c);
                cases++;
            }
        }
    }
    /* the first check's cases at this level (a decode long enough to be
     * split among them) and the level's 2^x */
    for (int kind = 0; kind <= KVA_I8; kind++, cases++)
        failures += run_case(kind, 3, kind % 2 ? 37 : 0, kind == 2 ? 1.5f : 0.0f, 8, 2, 64, 16);
    failures += check_exp2(KVA_AMX);
    printf("amx: %d cases, %d failures, %ld TDPBF16PS\n", cases, failures,
           __atomic_load_n(&amx_emu_tdpbf16ps_count, __ATOMIC_RELAXED));
    return failures ? 1 : 0;
}
