/*
 * The decode kernel of kvcore.paged_attention without Python, for profiling
 * (perf record) and for the ceiling of this core:
 *
 *   cc -O3 -pthread -Ikvcore/backends/cpu/csrc bench/attention_profile.c \
 *      kvcore/backends/cpu/csrc/kv_attention.c -o /tmp/attention_profile -lm
 *   /tmp/attention_profile [kind]        (kind 0 float32, 1 float16, 2 bfloat16)
 *
 * 1. Decode, 32 query / 8 KV heads, head_dim 128, pages of 16 positions in
 *    shuffled order, one thread, contexts 256 (in cache) to 4096 (16 MB of
 *    float16 KV): nanoseconds per (position, KV head) and GB/s of KV read.
 * 2. The FMA loop of the K.Q kernel alone on data in L1 (2 K vectors and 4
 *    q vectors per 8 FMAs), with float32 K, float16 K through vcvtph2ps and
 *    float16 K through an integer widening: how much the conversion costs.
 *
 * Times are thread CPU time (CLOCK_THREAD_CPUTIME_ID), best of 7, so other
 * processes on a shared machine do not count (their memory traffic still
 * does).  Storage is 2 MiB aligned and advised for huge pages, as NumPy
 * does for a pool.
 */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include "kv_attention.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double cpu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void decode(int ctx, int kind)
{
    enum { H = 32, KVH = 8, D = 128, BS = 16 };
    const int isz = kind == 0 ? 4 : 2, nblk = ctx / BS;
    const size_t bytes = (size_t)nblk * KVH * BS * D * isz;
    const size_t al = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    char *k = aligned_alloc(2u << 20, al), *v = aligned_alloc(2u << 20, al);
    madvise(k, al, MADV_HUGEPAGE);
    madvise(v, al, MADV_HUGEPAGE);
    srand(1);
    for (size_t i = 0; i < bytes / 4; i++) {
        float a = (rand() % 2001 - 1000) / 1000.0f, b = (rand() % 2001 - 1000) / 700.0f;
        if (kind == 0) {
            ((float *)k)[i] = a;
            ((float *)v)[i] = b;
        } else { /* random finite halves / bfloat16 of modest size */
            ((uint16_t *)k)[2 * i] = (uint16_t)(0x3000 + (rand() & 0x7ff));
            ((uint16_t *)k)[2 * i + 1] = (uint16_t)(0xb000 + (rand() & 0x7ff));
            ((uint16_t *)v)[2 * i] = (uint16_t)(0x3400 + (rand() & 0x3ff));
            ((uint16_t *)v)[2 * i + 1] = (uint16_t)(0xb400 + (rand() & 0x3ff));
        }
    }
    int32_t *table = malloc(sizeof(int32_t) * nblk);
    for (int i = 0; i < nblk; i++)
        table[i] = i;
    for (int i = nblk - 1; i > 0; i--) {
        int j = rand() % (i + 1), t = table[i];
        table[i] = table[j];
        table[j] = t;
    }
    int64_t len = ctx, qsl[2] = {0, 1};
    static float q[H * D], out[H * D];
    for (int i = 0; i < H * D; i++)
        q[i] = (rand() % 2001 - 1000) / 1000.0f;
    kva_args a;
    memset(&a, 0, sizeof a);
    a.q = q;
    a.out = out;
    a.key_cache = k;
    a.value_cache = v;
    a.kind = kind;
    a.block_stride = (ptrdiff_t)KVH * BS * D * isz;
    a.head_stride = (ptrdiff_t)BS * D * isz;
    a.row_stride = (ptrdiff_t)D * isz;
    a.block_size = BS;
    a.num_heads = H;
    a.num_kv_heads = KVH;
    a.head_dim = D;
    a.block_tables = table;
    a.block_table_stride = nblk;
    a.seq_lens = &len;
    a.query_start_loc = qsl;
    a.num_seqs = 1;
    a.scale = 0.088f;
    a.num_threads = 1;
    kva_paged_attention(&a);
    const int reps = 20000 / ctx + 5;
    double best = 1e30;
    for (int r = 0; r < 7; r++) {
        double t0 = cpu_now();
        for (int i = 0; i < reps; i++)
            kva_paged_attention(&a);
        double t = (cpu_now() - t0) / reps;
        if (t < best)
            best = t;
    }
    printf("decode ctx %5d kind %d (%s): %8.1f us  %6.1f ns per (position, kv head)  %5.2f GB/s\n",
           ctx, kind, kva_level_name(kva_current_level()), best * 1e6,
           best * 1e9 / ((double)ctx * KVH), 2.0 * bytes / best / 1e9);
    free(k);
    free(v);
    free(table);
}

#if defined(__x86_64__) && defined(__GNUC__)
static float Qm[4][128] __attribute__((aligned(64)));
static uint16_t Kh[2][128] __attribute__((aligned(64)));
static float Kf[2][128] __attribute__((aligned(64)));

__attribute__((target("avx2,fma,f16c"), noinline)) static float fma_loop(long n, int mode)
{
    __m256 acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i keep = _mm256_set1_epi32((int)0x8fffffff);
    for (long it = 0; it < n; it++) {
        for (int d = 0; d < 128; d += 8) {
            __m256 k0, k1;
            if (mode == 0) {
                k0 = _mm256_load_ps(&Kf[0][d]);
                k1 = _mm256_load_ps(&Kf[1][d]);
            } else if (mode == 1) {
                k0 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)&Kh[0][d]));
                k1 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)&Kh[1][d]));
            } else { /* sign-extend, shift, mask: half bits scaled by 2^-112 */
                k0 = _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_slli_epi32(_mm256_cvtepi16_epi32(
                                          _mm_load_si128((const __m128i *)&Kh[0][d])), 13), keep));
                k1 = _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_slli_epi32(_mm256_cvtepi16_epi32(
                                          _mm_load_si128((const __m128i *)&Kh[1][d])), 13), keep));
            }
            for (int r = 0; r < 4; r++) {
                __m256 qv = _mm256_load_ps(&Qm[r][d]);
                __asm__("" : "+x"(qv));
                acc[2 * r] = _mm256_fmadd_ps(qv, k0, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(qv, k1, acc[2 * r + 1]);
            }
        }
    }
    __m256 s = acc[0];
    for (int i = 1; i < 8; i++)
        s = _mm256_add_ps(s, acc[i]);
    return _mm256_cvtss_f32(s);
}

static void fma_ceiling(void)
{
    static const char *names[3] = {"float32 K", "float16 K, vcvtph2ps", "float16 K, integer"};
    for (int i = 0; i < 128; i++) {
        for (int r = 0; r < 4; r++)
            Qm[r][i] = 0.001f * i;
        Kh[0][i] = Kh[1][i] = 0x3c00;
        Kf[0][i] = Kf[1][i] = 1.0f;
    }
    const long n = 1000000;
    for (int mode = 0; mode < 3; mode++) {
        double best = 1e30;
        float sink = 0;
        for (int r = 0; r < 7; r++) {
            double t0 = cpu_now();
            sink += fma_loop(n, mode);
            double t = cpu_now() - t0;
            if (t < best)
                best = t;
        }
        printf("K.Q FMA loop, %-22s %.2f G 8-wide FMA/s (%g)\n", names[mode],
               n * 16.0 * 8 / best / 1e9, (double)sink);
    }
}
#endif

int main(int argc, char **argv)
{
    const int kind = argc > 1 ? atoi(argv[1]) : 1;
    if (kind < 0 || kind > 2) {
        fprintf(stderr, "kind must be 0 (float32), 1 (float16) or 2 (bfloat16)\n");
        return 2;
    }
    for (int ctx = 256; ctx <= 4096; ctx *= 4)
        decode(ctx, kind);
#if defined(__x86_64__) && defined(__GNUC__)
    fma_ceiling();
#endif
    return 0;
}
