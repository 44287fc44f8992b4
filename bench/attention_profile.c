/*
 * The decode kernel of kvcore.paged_attention without Python, for profiling
 * (perf record) and for the ceiling of this core:
 *
 *   cc -O3 -pthread -Ikvcore/backends/cpu/csrc bench/attention_profile.c \
 *      kvcore/backends/cpu/csrc/kv_att*.c kvcore/backends/cpu/csrc/kv_simd.c \
 *      -o /tmp/attention_profile -lm
 *   /tmp/attention_profile [kind [heads kv_heads head_dim [context ...]]]
 *       kind 0 float32, 1 float16 (the default), 2 bfloat16, 3 fp8 e4m3fn,
 *       4 fp8 e5m2, 5 int8; the shape 32 8 128 by default (SmolLM2's:
 *       9 3 64); contexts 256 1024 4096 by default; with a shape given, the
 *       K.Q loops of 2. are not run.
 *   /tmp/attention_profile prefill [kind [heads kv_heads head_dim [context ...]]]
 *       the same for a causal prefill of the whole context (one thread):
 *       milliseconds and GFLOP/s (QK and PV over the causal triangle).
 *   /tmp/attention_profile cold [kind [heads kv_heads head_dim [context ...]]]
 *       decode as a model runs it: before each timed call a 256 MiB buffer
 *       (the weights of the layers in between) is read, so the pages come
 *       from DRAM with cold TLBs; median of 31 single calls, wall time.
 *   Q_BF16=1 /tmp/attention_profile ...
 *       q's elements bfloat16 values (a bfloat16 model's), as kvcore.hf
 *       passes them: the amx level's tiles then take q as one bf16 term.
 *   FP8_CODES=low /tmp/attention_profile ...
 *       fp8 pages of codes 0x00-0x3F (either sign): small values, the
 *       subnormal codes among them (e4m3fn 0x01-0x07, e5m2 0x01-0x03),
 *       instead of 0x20-0x5F.
 *   /tmp/attention_profile raw kv_heads head_dim context
 *       3. what the memory gives one core for decode's access pattern: a
 *       plain AVX-512 loop (AVX2 where the CPU has no AVX-512) that reads
 *       the K and V chunks of every KV head (16 float16 positions each) in
 *       the same shuffled block order and does nothing but add them up, in
 *       GB/s (the best of 7 reads).
 *   /tmp/attention_profile kernels [kind [rows head_dim]]
 *       5. the decode kernels alone: the scores (Q.K) and P.V kernels of
 *       each x86 level this CPU has (avx2; avx512 where present), called on
 *       one decode tile (the level's: KVA_DECODE_KEY_TILE keys, or
 *       KVA_KEY_TILE for rows short enough) whose rows lie as in a page
 *       (blocks of 16 contiguous rows; the best of 4 placements) and stay in
 *       L1/L2, for `rows` query rows (a GQA group: 4 by default; a level
 *       whose decode items of that many rows widen the tile first says so)
 *       at head_dim 128 by default: nanoseconds per key and multiply-adds
 *       per ns.  Set beside the decode rows above (ns per position and KV
 *       head = scores + P.V per key), it says how much of a decode's time
 *       its two kernels take and how much goes elsewhere (the memory, the
 *       softmax, the tiles' bookkeeping).
 *   /tmp/attention_profile pace row_bytes fmas [kv_heads]
 *       4. how far a decode's arithmetic slows its reads out of the caches:
 *       a loop that walks kv_heads (8) x 65536 positions as the decode does
 *       (K and V rows of row_bytes in blocks of 16, shuffled; split-major
 *       items of 1024 positions; tiles of 64 rows, the K rows then the V
 *       rows, each line loaded prefetching the same line of the next
 *       tile's row) with `fmas` FMAs on each line loaded and nothing else,
 *       in the caches and out of them: nanoseconds per (position, KV head).
 *
 * 1. Decode, 32 query / 8 KV heads, head_dim 128, pages of 16 positions in
 *    shuffled order, one thread, contexts 256 (in cache) to 4096 (16 MB of
 *    float16 KV): nanoseconds per (position, KV head) and GB/s of KV read
 *    (int8: its float32 scales included).
 * 2. The FMA loop of the K.Q kernel alone on data in L1 (2 K vectors and 4
 *    q vectors per 8 FMAs), with float32 K, float16 K through vcvtph2ps and
 *    through an integer widening, and fp8 / int8 K through each widening
 *    tried for them: how much each conversion costs.
 *
 * Measured on the 2-core AMD EPYC (Zen 1: one 256-bit FMA a cycle) of the
 * README, while other jobs ran:
 *   - K.Q loop, G 8-wide FMA/s: float32 K 2.8-2.9 (the FMA pipe, 1 a cycle);
 *     float16 vcvtph2ps 1.8-2.0; every 8-bit widening tried 1.7-1.9 (e4m3fn
 *     sext+shift+and 1.86-1.93, e5m2 zext+shift 1.94-1.96, its unpack
 *     1.68-1.90, int8 vcvtdq2ps 1.90, int8 or+subtract 1.55-1.69); the old
 *     e4m3fn loader with its NaN blend and x256 0.98; int8 x int16 q by
 *     vpmaddwd 2.35 (but q rounded to 16 bits moves an attention output by
 *     ~1e-4 of its largest value, 10x the tests' 1e-5: not used).
 *   - So on this core any widening of 8 elements costs the FMA pipe about
 *     2 cycles, vcvtph2ps included, against 4 cycles of FMAs for the 4 query
 *     rows of a GQA group of 4: 6 cycles per 8 elements of K (and of V) for
 *     float16, fp8 and int8 alike.  An 8-bit kind reads half the bytes in
 *     the same time: about 0.5x float16's GB/s while decode is compute-bound
 *     (in cache), more only where float16 waits for memory.  Even a free
 *     widening would leave the 4 FMA cycles: 1.5x float16's speed per
 *     position, 0.75x its GB/s, the most float32 FMAs allow here.
 *   - Decode, ns per (position, KV head), ctx 256 / 1024 / 4096: float16
 *     88-90 / 91-99 / 118-138; e4m3fn 148-149 / 148-152 / 156-157 before
 *     the per-tile NaN check, 101-106 / 101-105 / 111-119 after; e5m2
 *     92-94 / 91-97 / 100-107; int8 90-98 / 90-101 / 100-105 (float16, e5m2
 *     and int8: the same before and after).
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
#include "kv_attn_internal.h"

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

enum { BS = 16, MAX_Q = 64 * 512 }; /* MAX_Q: heads x head_dim at most */
static int H = 32, KVH = 8, D = 128;
static int cold; /* the `cold` mode: caches evicted before each timed call */

static double wall_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Read `n` bytes of `buf` (a model's weights between two layers' attention). */
static float evict(const float *buf, size_t n)
{
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 16 <= n / sizeof(float); i += 16) {
        s0 += buf[i];
        s1 += buf[i + 4];
        s2 += buf[i + 8];
        s3 += buf[i + 12];
    }
    return s0 + s1 + s2 + s3;
}

static int cmp_double(const void *x, const void *y)
{
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static void time_case(const kva_args *a, int ctx, int kind, int nq, size_t bytes, size_t nsc);

/* One call over a context of ctx positions: a decode step (nq 1) or a
 * causal prefill of the whole context (nq ctx). */
static void run_case(int ctx, int kind, int nq)
{
    const int isz = kind == 0 ? 4 : kind >= 3 ? 1 : 2, nblk = ctx / BS;
    const char *codes = getenv("FP8_CODES");
    const int fp8_lo = codes != NULL && strcmp(codes, "low") == 0 ? 0x00 : 0x20;
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
        } else if (kind >= 3) { /* finite fp8 codes of modest size; int8 codes */
            for (int j = 0; j < 4; j++) {
                int r = rand();
                uint8_t kb = kind == 5 ? (uint8_t)r : (uint8_t)(fp8_lo + (r & 0x3f));
                uint8_t vb = kind == 5 ? (uint8_t)(r >> 8)
                                       : (uint8_t)(fp8_lo + 4 * (fp8_lo != 0) + ((r >> 8) & 0x3f));
                k[4 * i + j] = (char)(kb | ((r >> 16) & 0x80));
                v[4 * i + j] = (char)(vb | ((r >> 17) & 0x80));
            }
        } else { /* random finite halves / bfloat16 of modest size */
            ((uint16_t *)k)[2 * i] = (uint16_t)(0x3000 + (rand() & 0x7ff));
            ((uint16_t *)k)[2 * i + 1] = (uint16_t)(0xb000 + (rand() & 0x7ff));
            ((uint16_t *)v)[2 * i] = (uint16_t)(0x3400 + (rand() & 0x3ff));
            ((uint16_t *)v)[2 * i + 1] = (uint16_t)(0xb400 + (rand() & 0x3ff));
        }
    }
    /* int8: a float32 scale per (block, kv head, position) for K and for V */
    const size_t nsc = (size_t)nblk * KVH * BS;
    float *ksc = malloc(nsc * sizeof(float)), *vsc = malloc(nsc * sizeof(float));
    for (size_t i = 0; i < nsc; i++) {
        ksc[i] = (float)(rand() % 1000 + 1) / 40000.0f;
        vsc[i] = (float)(rand() % 1000 + 1) / 30000.0f;
    }
    int32_t *table = malloc(sizeof(int32_t) * nblk);
    for (int i = 0; i < nblk; i++)
        table[i] = i;
    for (int i = nblk - 1; i > 0; i--) {
        int j = rand() % (i + 1), t = table[i];
        table[i] = table[j];
        table[j] = t;
    }
    int64_t len = ctx, qsl[2] = {0, nq};
    float *q = malloc(sizeof(float) * nq * H * D), *out = malloc(sizeof(float) * nq * H * D);
    for (int i = 0; i < nq * H * D; i++)
        q[i] = (rand() % 2001 - 1000) / 1000.0f;
    if (getenv("Q_BF16") != NULL) /* a bfloat16 model's q: each element a bf16 value */
        for (size_t i = 0; i < (size_t)nq * H * D; i++) {
            uint32_t u;
            memcpy(&u, &q[i], 4);
            u &= 0xFFFF0000u;
            memcpy(&q[i], &u, 4);
        }
    kva_args a = kva_args_dense(q, out, k, v, kind, BS, H, KVH, D);
    a.block_tables = table;
    a.block_table_stride = nblk;
    a.seq_lens = &len;
    a.query_start_loc = qsl;
    a.num_seqs = 1;
    a.scale = 0.088f;
    a.num_threads = 1;
    if (kind == 5) {
        a.key_scales = ksc;
        a.value_scales = vsc;
    } else if (kind >= 3) {
        a.k_scale = 0.5f;
        a.v_scale = 0.25f;
    }
    kva_paged_attention(&a);
    if (cold && nq == 1) {
        enum { N = 31 };
        const size_t wbytes = (size_t)256 << 20;
        float *w = malloc(wbytes);
        for (size_t i = 0; i < wbytes / sizeof(float); i++)
            w[i] = (float)(i & 7);
        double ts[N];
        float sink = 0;
        for (int r = 0; r < N; r++) {
            sink += evict(w, wbytes);
            double t0 = wall_now();
            kva_paged_attention(&a);
            ts[r] = wall_now() - t0;
        }
        qsort(ts, N, sizeof(double), cmp_double);
        printf("cold decode ctx %5d kind %d (%s): %8.1f us [%.1f-%.1f]  %5.2f GB/s (%g)\n", ctx,
               kind, kva_level_name(kva_current_level()), ts[N / 2] * 1e6, ts[0] * 1e6,
               ts[N - 1] * 1e6,
               (2.0 * bytes + (kind == 5 ? 2.0 * nsc * sizeof(float) : 0.0)) / ts[N / 2] / 1e9,
               (double)sink);
        free(w);
    } else
        time_case(&a, ctx, kind, nq, bytes, nsc);
    free(q);
    free(out);
    free(ksc);
    free(vsc);
    free(k);
    free(v);
    free(table);
}

/* Best of 5-7 rounds of thread CPU time: a prefill, or a decode step
 * repeated to fill about 20000 positions a round. */
static void time_case(const kva_args *a, int ctx, int kind, int nq, size_t bytes, size_t nsc)
{
    const int reps = nq > 1 ? 1 : 20000 / ctx + 5;
    double best = 1e30;
    for (int r = 0; r < (nq > 1 ? 5 : 7); r++) {
        double t0 = cpu_now();
        for (int i = 0; i < reps; i++)
            kva_paged_attention(a);
        double t = (cpu_now() - t0) / reps;
        if (t < best)
            best = t;
    }
    if (nq > 1) /* QK and PV over the causal triangle, 2 flops a multiply-add */
        printf("prefill ctx %5d kind %d (%s): %8.2f ms  %6.1f GFLOP/s\n", ctx, kind,
               kva_level_name(kva_current_level()), best * 1e3,
               4.0 * H * D * ((double)ctx * (ctx + 1) / 2) / best / 1e9);
    else
    printf("decode ctx %5d kind %d (%s): %8.1f us  %6.1f ns per (position, kv head)  %5.2f GB/s\n",
           ctx, kind, kva_level_name(kva_current_level()), best * 1e6,
           best * 1e9 / ((double)ctx * KVH),
           (2.0 * bytes + (kind == 5 ? 2.0 * nsc * sizeof(float) : 0.0)) / best / 1e9);
}

#if defined(__x86_64__) && defined(__GNUC__)
static float Qm[4][128] __attribute__((aligned(64)));
static uint16_t Kh[2][128] __attribute__((aligned(64)));
static float Kf[2][128] __attribute__((aligned(64)));
static uint8_t Kb[2][128] __attribute__((aligned(64)));

#define PT __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
/* Loaders: 8 elements of K row `row` from dimension d, widened to float32. */
PT __m256 ld_f32(int row, int d) { return _mm256_load_ps(&Kf[row][d]); }
PT __m256 ld_f16(int row, int d)
{
    return _mm256_cvtph_ps(_mm_load_si128((const __m128i *)&Kh[row][d]));
}
PT __m256 ld_f16_int(int row, int d) /* sign-extend, shift, mask: half bits scaled by 2^-112 */
{
    return _mm256_castsi256_ps(_mm256_and_si256(
        _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_load_si128((const __m128i *)&Kh[row][d])), 13),
        _mm256_set1_epi32((int)0x8fffffff)));
}
/* fp8 e4m3fn as kv_attention.c widened it before the per-tile NaN check:
 * a half through a sign-extending shift, a NaN blend per 8, times 2^8 */
PT __m256 ld_e4m3_nan_x256(int row, int d)
{
    __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)&Kb[row][d]));
    __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xBF80));
    __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(h, _mm_set1_epi16((short)0x8000)),
                                  _mm_set1_epi16((short)0xBF80));
    h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7C00)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
/* e4m3fn without the NaN blend and the 2^8 (the scale carries it) */
PT __m256 ld_e4m3(int row, int d)
{
    __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)&Kb[row][d]));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xBF80)));
}
/* e4m3fn, the byte put in the high half by an unpack, then an arithmetic shift */
PT __m256 ld_e4m3_unpack(int row, int d)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)&Kb[row][d]);
    __m128i w = _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBF80)));
}
/* fp8 e5m2: the high byte of a half (zero-extend, shift) */
PT __m256 ld_e5m2(int row, int d)
{
    return _mm256_cvtph_ps(
        _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)&Kb[row][d])), 8));
}
/* e5m2 by one unpack with zero */
PT __m256 ld_e5m2_unpack(int row, int d)
{
    return _mm256_cvtph_ps(
        _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)&Kb[row][d])));
}
/* int8 codes: sign-extend to 32 bits, convert */
PT __m256 ld_i8(int row, int d)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)&Kb[row][d])));
}

/* int8 without vcvtdq2ps: (code ^ 0x80) zero-extended into a float's
 * mantissa under 2^23, less 2^23 + 128 (a subtraction, not a conversion) */
PT __m256 ld_i8_magic(int row, int d)
{
    __m128i b = _mm_xor_si128(_mm_loadl_epi64((const __m128i *)&Kb[row][d]),
                              _mm_set1_epi8((char)0x80));
    __m256i w = _mm256_or_si256(_mm256_cvtepu8_epi32(b), _mm256_set1_epi32(0x4B000000));
    return _mm256_sub_ps(_mm256_castsi256_ps(w), _mm256_set1_ps(8388736.0f));
}

/* The K.Q micro-kernel of kv_attention.c (4 query rows x 2 keys, 8
 * accumulators) with one loader, n times over head_dim 128. */
#define FMA_LOOP(name, LOAD)                                                                 \
    __attribute__((target("avx2,fma,f16c"), noinline)) static float fma_##name(long n)      \
    {                                                                                         \
        __m256 acc[8];                                                                        \
        for (int i = 0; i < 8; i++)                                                           \
            acc[i] = _mm256_setzero_ps();                                                     \
        for (long it = 0; it < n; it++) {                                                     \
            for (int d = 0; d < 128; d += 8) {                                                \
                __m256 k0 = LOAD(0, d), k1 = LOAD(1, d);                                      \
                for (int r = 0; r < 4; r++) {                                                 \
                    __m256 qv = _mm256_load_ps(&Qm[r][d]);                                    \
                    __asm__("" : "+x"(qv));                                                   \
                    acc[2 * r] = _mm256_fmadd_ps(qv, k0, acc[2 * r]);                         \
                    acc[2 * r + 1] = _mm256_fmadd_ps(qv, k1, acc[2 * r + 1]);                 \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        __m256 s = acc[0];                                                                    \
        for (int i = 1; i < 8; i++)                                                           \
            s = _mm256_add_ps(s, acc[i]);                                                     \
        return _mm256_cvtss_f32(s);                                                           \
    }
FMA_LOOP(f32, ld_f32)
FMA_LOOP(f16, ld_f16)
FMA_LOOP(f16_int, ld_f16_int)
FMA_LOOP(e4m3_nan_x256, ld_e4m3_nan_x256)
FMA_LOOP(e4m3, ld_e4m3)
FMA_LOOP(e4m3_unpack, ld_e4m3_unpack)
FMA_LOOP(e5m2, ld_e5m2)
FMA_LOOP(e5m2_unpack, ld_e5m2_unpack)
FMA_LOOP(i8, ld_i8)
FMA_LOOP(i8_magic, ld_i8_magic)

/* int8 K against q quantized to int16 (not exact: q loses bits): K widened
 * to int16, vpmaddwd, int32 sums; as many multiply-adds as the loops above. */
static int16_t Qi[4][128] __attribute__((aligned(64)));
__attribute__((target("avx2,fma,f16c"), noinline)) static float madd_i8(long n)
{
    __m256i acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = _mm256_setzero_si256();
    for (long it = 0; it < n; it++) {
        for (int d = 0; d < 128; d += 16) {
            __m256i k0 = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)&Kb[0][d]));
            __m256i k1 = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)&Kb[1][d]));
            __asm__("" : "+x"(k0), "+x"(k1)); /* not hoisted out of the `it` loop */
            for (int r = 0; r < 4; r++) {
                __m256i qv = _mm256_load_si256((const __m256i *)&Qi[r][d]);
                __asm__("" : "+x"(qv));
                acc[2 * r] = _mm256_add_epi32(acc[2 * r], _mm256_madd_epi16(qv, k0));
                acc[2 * r + 1] = _mm256_add_epi32(acc[2 * r + 1], _mm256_madd_epi16(qv, k1));
            }
        }
    }
    __m256i s = acc[0];
    for (int i = 1; i < 8; i++)
        s = _mm256_add_epi32(s, acc[i]);
    return (float)_mm256_extract_epi32(s, 0);
}

static void fma_ceiling(void)
{
    static const struct {
        const char *name;
        float (*fn)(long);
    } loops[] = {
        {"float32 K", fma_f32},
        {"float16 K, vcvtph2ps", fma_f16},
        {"float16 K, integer", fma_f16_int},
        {"e4m3fn, NaN blend, x256", fma_e4m3_nan_x256},
        {"e4m3fn, sext+shift+and", fma_e4m3},
        {"e4m3fn, unpack+sra+and", fma_e4m3_unpack},
        {"e5m2, zext+shift", fma_e5m2},
        {"e5m2, unpack", fma_e5m2_unpack},
        {"int8, sext+vcvtdq2ps", fma_i8},
        {"int8, or+subtract", fma_i8_magic},
        {"int8 x int16 q, vpmaddwd", madd_i8},
    };
    for (int i = 0; i < 128; i++) {
        for (int r = 0; r < 4; r++) {
            Qm[r][i] = 0.001f * i;
            Qi[r][i] = (int16_t)(97 * i);
        }
        Kh[0][i] = Kh[1][i] = 0x3c00;
        Kf[0][i] = Kf[1][i] = 1.0f;
        Kb[0][i] = Kb[1][i] = 0x38;
    }
    const long n = 1000000;
    for (size_t m = 0; m < sizeof loops / sizeof loops[0]; m++) {
        double best = 1e30;
        float sink = 0;
        for (int r = 0; r < 7; r++) {
            double t0 = cpu_now();
            sink += loops[m].fn(n);
            double t = cpu_now() - t0;
            if (t < best)
                best = t;
        }
        printf("K.Q FMA loop, %-26s %.2f G 8-wide FMA/s (%g)\n", loops[m].name,
               n * 16.0 * 8 / best / 1e9, (double)sink);
    }
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
/* 3. and 4.: two buffers of `bytes` on 2 MiB pages, filled with `fill`;
 * returns their rounded size. */
static size_t page_pair(size_t bytes, int fill, char **k, char **v)
{
    const size_t al = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    *k = aligned_alloc(2u << 20, al);
    *v = aligned_alloc(2u << 20, al);
    madvise(*k, al, MADV_HUGEPAGE);
    madvise(*v, al, MADV_HUGEPAGE);
    memset(*k, fill, al);
    memset(*v, fill, al);
    return al;
}

/* 3. and 4.: the block ids 0 .. nblk - 1 in one fixed shuffled order. */
static int32_t *shuffled_blocks(int nblk)
{
    int32_t *table = malloc(sizeof(int32_t) * nblk);
    for (int i = 0; i < nblk; i++)
        table[i] = i;
    srand(1);
    for (int i = nblk - 1; i > 0; i--) {
        int j = rand() % (i + 1), t = table[i];
        table[i] = table[j];
        table[j] = t;
    }
    return table;
}

__attribute__((target("avx512f"), noinline)) static float raw_sum(const char *k, const char *v,
                                                                  const int32_t *table, int nblk,
                                                                  int kvh, size_t chunk)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (int g = 0; g < kvh; g++)
        for (int b = 0; b < nblk; b++) {
            const size_t at = (size_t)table[b] * kvh * chunk + (size_t)g * chunk;
            for (size_t o = 0; o < chunk; o += 64) {
                a0 = _mm512_add_ps(a0, _mm512_loadu_ps((const float *)(k + at + o)));
                a1 = _mm512_add_ps(a1, _mm512_loadu_ps((const float *)(v + at + o)));
            }
        }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* (3. on a CPU without AVX-512: the same read, 32 bytes a load) */
__attribute__((target("avx2"), noinline)) static float raw_sum_avx2(const char *k, const char *v,
                                                                    const int32_t *table,
                                                                    int nblk, int kvh,
                                                                    size_t chunk)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int g = 0; g < kvh; g++)
        for (int b = 0; b < nblk; b++) {
            const size_t at = (size_t)table[b] * kvh * chunk + (size_t)g * chunk;
            for (size_t o = 0; o < chunk; o += 64) {
                a0 = _mm256_add_ps(a0, _mm256_loadu_ps((const float *)(k + at + o)));
                a1 = _mm256_add_ps(a1, _mm256_loadu_ps((const float *)(k + at + o + 32)));
                a2 = _mm256_add_ps(a2, _mm256_loadu_ps((const float *)(v + at + o)));
                a3 = _mm256_add_ps(a3, _mm256_loadu_ps((const float *)(v + at + o + 32)));
            }
        }
    float f[8];
    _mm256_storeu_ps(f, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}

static int raw_read(int kvh, int d, int ctx)
{
    const int wide = __builtin_cpu_supports("avx512f");
    if (!wide && !__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "raw needs AVX-512F or AVX2\n");
        return 2;
    }
    const int nblk = ctx / BS;
    const size_t chunk = (size_t)BS * d * 2, bytes = (size_t)nblk * kvh * chunk;
    if (nblk < 1 || chunk % 64 != 0) {
        fprintf(stderr, "raw: context >= %d, head_dim a multiple of 2\n", BS);
        return 2;
    }
    char *k, *v;
    page_pair(bytes, 0, &k, &v);
    int32_t *table = shuffled_blocks(nblk);
    double best = 1e30;
    float sink = 0;
    for (int r = 0; r < 7; r++) {
        double t0 = cpu_now();
        sink += wide ? raw_sum(k, v, table, nblk, kvh, chunk)
                     : raw_sum_avx2(k, v, table, nblk, kvh, chunk);
        double t = cpu_now() - t0;
        if (t < best)
            best = t;
    }
    printf("raw read ctx %5d, %d kv heads x %zu-byte chunks (%s): %6.2f GB/s (%g)\n", ctx, kvh,
           chunk, wide ? "avx512" : "avx2", 2.0 * bytes / best / 1e9, (double)sink);
    free(k);
    free(v);
    free(table);
    return 0;
}

/* 4.: one walk of the rows kr/vr (npos of them), tiles of 64, `fmas` FMAs
 * a line, each line's load prefetching the same line of the next tile. */
__attribute__((target("avx512f,fma"), noinline)) static float pace_walk(char *const *kr,
                                                                     char *const *vr,
                                                                     long npos, int rb,
                                                                     int fmas)
{
    __m512 a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(1.0000001f);
    for (long t = 0; t < npos; t += 64) {
        const long nt = t + 64 < npos ? t + 64 : t;
        for (int half = 0; half < 2; half++) {
            char *const *rows = half ? vr : kr;
            for (int i = 0; i < 64; i++)
                for (int o = 0; o < rb; o += 64) {
                    _mm_prefetch(rows[nt + i] + o, _MM_HINT_T0);
                    const __m512 x = _mm512_loadu_ps((const float *)(rows[t + i] + o));
                    a[half] = _mm512_add_ps(a[half], x);
                    for (int w = 0; w < fmas; w++)
                        a[2 + w % 6] = _mm512_fmadd_ps(a[2 + w % 6], m, x);
                }
        }
    }
    for (int i = 1; i < 8; i++)
        a[0] = _mm512_add_ps(a[0], a[i]);
    return _mm512_reduce_add_ps(a[0]);
}

static int pace(int rb, int fmas, int kvh)
{
    if (!__builtin_cpu_supports("avx512f")) {
        fprintf(stderr, "pace needs AVX-512F\n");
        return 2;
    }
    if (rb < 64 || rb % 64 != 0 || rb > 4096 || fmas < 0 || fmas > 64 || kvh < 1 || kvh > 64) {
        fprintf(stderr, "pace: row_bytes a multiple of 64 up to 4096, fmas 0..64, "
                        "kv_heads 1..64\n");
        return 2;
    }
    const long ctx = 65536, nblk = ctx / BS, n = ctx * kvh;
    const size_t chunk = (size_t)BS * rb, bytes = (size_t)nblk * kvh * chunk;
    char *k, *v;
    page_pair(bytes, 1, &k, &v);
    int32_t *table = shuffled_blocks((int)nblk);
    char **kr = malloc(sizeof(char *) * (n + 64)), **vr = malloc(sizeof(char *) * (n + 64));
    long r = 0;
    for (long s0 = 0; s0 < ctx; s0 += 1024)
        for (int g = 0; g < kvh; g++)
            for (long p = s0; p < s0 + 1024; p++, r++) {
                const size_t at = (size_t)table[p / BS] * kvh * chunk + (size_t)g * chunk +
                                  (size_t)(p % BS) * rb;
                kr[r] = k + at;
                vr[r] = v + at;
            }
    for (int i = 0; i < 64; i++) {
        kr[n + i] = kr[n - 1];
        vr[n + i] = vr[n - 1];
    }
    double warm = 1e30, out = 1e30;
    float sink = 0;
    for (int i = 0; i < 30; i++) { /* the first 2048 rows: in the caches */
        const double t0 = cpu_now();
        sink += pace_walk(kr, vr, 2048, rb, fmas);
        const double t = cpu_now() - t0;
        warm = t < warm ? t : warm;
    }
    for (int i = 0; i < 3; i++) {
        const double t0 = cpu_now();
        sink += pace_walk(kr, vr, n, rb, fmas);
        const double t = cpu_now() - t0;
        out = t < out ? t : out;
    }
    printf("pace %d KV heads, rows of %d bytes, %2d FMAs a line: in the caches %6.2f ns, out of them "
           "%6.2f ns per (position, KV head) (%.2f GB/s) (%g)\n",
           kvh, rb, fmas, warm * 1e9 / 2048, out * 1e9 / n, 2.0 * bytes / out / 1e9, (double)sink);
    free(kr);
    free(vr);
    free(table);
    free(k);
    free(v);
    return 0;
}

/* 5. The decode kernels alone, per x86 level this CPU has (see the top). */
static int kernels_alone(int kind, int M, int Dk)
{
    const int isz = kind == 0 ? 4 : kind >= 3 ? 1 : 2;
    const size_t row = (size_t)Dk * isz, span = (size_t)KVA_KEY_TILE * row * 2 + 64 * row;
    enum { SHIFTS = 4, SHIFT = 1088 }; /* rows moved by 17 lines: other 4 KB offsets */
    char *buf = aligned_alloc(64, 2 * span + SHIFTS * SHIFT);
    float *q = aligned_alloc(64, sizeof(float) * 64 * 512), *S = aligned_alloc(64, sizeof(float) * 64 * KVA_KEY_TILE);
    float *acc = aligned_alloc(64, sizeof(float) * 64 * 512), *tmp = aligned_alloc(64, sizeof(float) * KVA_KEY_TILE * 512);
    if (buf == NULL || q == NULL || S == NULL || acc == NULL || tmp == NULL) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < 2 * span + SHIFTS * SHIFT; i++)
        buf[i] = (char)(0x20 + rand() % 0x40); /* 8-bit codes 0x20-0x5F: no NaN code */
    if (kind == 1 || kind == 2)
        for (size_t i = 0; i < span + SHIFTS * SHIFT / 2; i++)
            ((uint16_t *)buf)[i] = (uint16_t)((kind == 1 ? 0x2000 : 0x3C00) + rand() % 0x1000);
    if (kind == 0)
        for (size_t i = 0; i < (2 * span + SHIFTS * SHIFT) / 4; i++)
            ((float *)buf)[i] = (rand() % 2001 - 1000) / 1000.0f;
    const char *krow[SHIFTS][KVA_KEY_TILE], *vrow[SHIFTS][KVA_KEY_TILE];
    for (int c = 0; c < SHIFTS; c++)
        for (int i = 0; i < KVA_KEY_TILE; i++) { /* a block of 16 rows, then a gap of 16 */
            const size_t off = (size_t)c * SHIFT + (size_t)(i / BS * 2 * BS + i % BS) * row;
            krow[c][i] = buf + off;
            vrow[c][i] = buf + span + off;
        }
    float alpha[64];
    for (int i = 0; i < M * Dk; i++) {
        q[i] = (rand() % 2001 - 1000) / 8000.0f;
        acc[i] = 0;
    }
    for (int i = 0; i < M * KVA_KEY_TILE; i++)
        S[i] = (rand() % 1000) / 1000.0f;
    for (int i = 0; i < M; i++)
        alpha[i] = 1.0f;
    struct { const char *name; const kva_kernels *table; const kva_math *math; int level; } lv[] = {
#if KVA_HAVE_AVX2
        {"avx2", kva_kernels_avx2, &kva_math_avx2, KVA_AVX2},
#endif
#if KVA_HAVE_AVX512
        {"avx512", kva_kernels_avx512, &kva_math_avx512, KVA_AVX512},
#endif
    };
    const int reps = 4000000 / (M * Dk) + 1;
    for (size_t l = 0; l < sizeof(lv) / sizeof(lv[0]); l++) {
        if (!kva_level_supported(lv[l].level))
            continue;
        const kva_kernels *kern = &lv[l].table[kind];
        if (kind != 0 && M > kern->direct_rows) {
            printf("kernels kind %d (%s), %d rows: skipped (decode items of more than %d rows "
                   "widen the tile to float32 first)\n", kind, lv[l].name, M, kern->direct_rows);
            continue;
        }
        /* the level's decode tile (kv_attn_tile.c: wide_tile_row_bytes) */
        const int nt = row <= (size_t)lv[l].math->wide_tile_row_bytes ? KVA_KEY_TILE
                                                                       : KVA_DECODE_KEY_TILE;
        double best_s = 1e9, best_p = 1e9;
        /* best of 7 at each of SHIFTS placements of the rows (a row whose
         * address shares its low 12 bits with a store to S or acc can wait
         * on that store: the best placement is the kernels' own rate) */
        for (int t = 0; t < 7 * SHIFTS; t++) {
            const int c = t % SHIFTS;
            double t0 = cpu_now();
            for (int r = 0; r < reps; r++)
                kern->scores(q, M, Dk, krow[c], nt, S, tmp, NULL);
            double t1 = cpu_now();
            for (int r = 0; r < reps; r++)
                kern->pv(S, M, Dk, vrow[c], nt, acc, alpha, tmp, NULL);
            double t2 = cpu_now();
            best_s = t1 - t0 < best_s ? t1 - t0 : best_s;
            best_p = t2 - t1 < best_p ? t2 - t1 : best_p;
        }
        const double keys = (double)reps * nt, macs = keys * M * Dk;
        printf("kernels kind %d (%s), %d rows x head_dim %d, tile of %d keys: scores %.1f ns/key "
               "(%.1f multiply-adds/ns), P.V %.1f ns/key (%.1f/ns); together %.1f ns per key (%.0f)\n",
               kind, lv[l].name, M, Dk, nt, best_s / keys * 1e9, macs / best_s / 1e9,
               best_p / keys * 1e9, macs / best_p / 1e9, (best_s + best_p) / keys * 1e9,
               (double)acc[0] + S[0]);
    }
    free(buf);
    free(q);
    free(S);
    free(acc);
    free(tmp);
    return 0;
}
#endif

int main(int argc, char **argv)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (argc >= 2 && strcmp(argv[1], "kernels") == 0) {
        const int kind = argc > 2 ? atoi(argv[2]) : 1, M = argc > 3 ? atoi(argv[3]) : 4,
                  Dk = argc > 4 ? atoi(argv[4]) : 128;
        if (kind < 0 || kind > 5 || M < 1 || M > 64 || Dk < 8 || Dk > 512 || Dk % 8) {
            fprintf(stderr, "kernels [kind 0-5 [rows 1-64 [head_dim 8-512, a multiple of 8]]]\n");
            return 2;
        }
        return kernels_alone(kind, M, Dk);
    }
    if (argc == 5 && strcmp(argv[1], "raw") == 0)
        return raw_read(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "pace") == 0)
        return pace(atoi(argv[2]), atoi(argv[3]), argc == 5 ? atoi(argv[4]) : 8);
#endif
    const int prefill = argc > 1 && strcmp(argv[1], "prefill") == 0;
    cold = argc > 1 && strcmp(argv[1], "cold") == 0;
    if (prefill || cold) { /* the same arguments after the word */
        argv++;
        argc--;
    }
    const int kind = argc > 1 ? atoi(argv[1]) : 1;
    if (kind < 0 || kind > 5) {
        fprintf(stderr, "kind must be 0 (float32), 1 (float16), 2 (bfloat16), 3 (fp8 e4m3fn), "
                        "4 (fp8 e5m2) or 5 (int8)\n");
        return 2;
    }
    if (argc > 4) {
        H = atoi(argv[2]);
        KVH = atoi(argv[3]);
        D = atoi(argv[4]);
        if (H < 1 || KVH < 1 || H % KVH != 0 || D < 1 || (size_t)H * D > MAX_Q) {
            fprintf(stderr, "heads, kv_heads, head_dim: heads a multiple of kv_heads, "
                            "heads x head_dim <= %d\n", MAX_Q);
            return 2;
        }
    }
    if (argc > 5) {
        for (int i = 5; i < argc; i++) {
            const int ctx = atoi(argv[i]);
            if (ctx < BS || ctx % BS != 0) {
                fprintf(stderr, "a context is a positive multiple of %d, not %s\n", BS, argv[i]);
                return 2;
            }
            run_case(ctx, kind, prefill ? ctx : 1);
        }
        return 0;
    }
    for (int ctx = 256; ctx <= 4096; ctx *= 4)
        run_case(ctx, kind, prefill ? ctx : 1);
#if defined(__x86_64__) && defined(__GNUC__)
    if (argc <= 2)
        fma_ceiling();
#endif
    return 0;
}
