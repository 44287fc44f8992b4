/*
 * How many multiply-adds a second this core's dot-product instructions give,
 * and what rounding q to bfloat16 does to a score: the arithmetic behind
 * docs/performance.md's "why 8-bit pages stop short of 2x" (issue 42).
 *
 *   cc -O2 bench/dot_throughput.c -o /tmp/dot_throughput -lm && /tmp/dot_throughput
 *
 * 1. Throughput, one thread, 8 independent chains of each instruction on
 *    registers (no memory): instructions per nanosecond and the products
 *    (multiply-adds) per nanosecond they carry: vfmadd231ps (16 float32),
 *    vdpbf16ps (32 bfloat16 pairs into float32), vpdpbusd (64 u8 x s8 into
 *    int32), vpmaddwd (32 int16 pairs), and the widening steps of an 8-bit
 *    page row (vpmovsxbd, vpslld, vpandd, vcvtph2ps, vpermi2b).
 * 2. Accuracy: the scores q . k of e4m3fn keys with q rounded to bfloat16
 *    (what vdpbf16ps needs), or split into two bfloat16 (twice the
 *    instructions), against float64, beside float32 FMAs, as a fraction of
 *    the largest score (the attention's documented bound is 1e-5 of the
 *    largest output).
 *
 * Section 1 needs AVX-512 F/BW/VBMI/VNNI/BF16 (it says so and skips
 * otherwise).  Times are thread CPU time, best of 5.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
static double cpu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define REPS 25000000L
/* 16 independent instructions writing zmm0-15 from zmm28-30 per iteration
 * (16 chains: the accumulating ones are bound by their pipes, not their
 * latency) */
#define SIXTEEN(op)                                                                          \
    op("%%zmm0") op("%%zmm1") op("%%zmm2") op("%%zmm3") op("%%zmm4") op("%%zmm5") op("%%zmm6") \
        op("%%zmm7") op("%%zmm8") op("%%zmm9") op("%%zmm10") op("%%zmm11") op("%%zmm12")      \
            op("%%zmm13") op("%%zmm14") op("%%zmm15")
#define TIME(name, products, op)                                                             \
    do {                                                                                     \
        double best = 1e30;                                                                  \
        for (int rep = 0; rep < 5; rep++) {                                                  \
            double t0 = cpu_now();                                                           \
            for (long i = 0; i < REPS; i++)                                                  \
                __asm__ volatile(SIXTEEN(op)::                                               \
                                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5",      \
                                       "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",    \
                                       "xmm12", "xmm13", "xmm14", "xmm15");                  \
            double t = cpu_now() - t0;                                                       \
            best = t < best ? t : best;                                                      \
        }                                                                                    \
        double per_ns = 16.0 * REPS / best / 1e9;                                             \
        if (products)                                                                        \
            printf("  %-34s %5.2f per ns  %6.1f products per ns\n", name, per_ns,           \
                   per_ns * (products));                                                     \
        else                                                                                 \
            printf("  %-34s %5.2f per ns\n", name, per_ns);                                  \
    } while (0)
#define FMA(r) "vfmadd231ps %%zmm28, %%zmm29, " r "\n\t"
#define DPBF16(r) "vdpbf16ps %%zmm28, %%zmm29, " r "\n\t"
#define DPBUSD(r) "vpdpbusd %%zmm28, %%zmm29, " r "\n\t"
#define MADDWD(r) "vpmaddwd %%zmm28, %%zmm29, " r "\n\t"
#define SXBD(r) "vpmovsxbd %%xmm28, " r "\n\t"
#define SLLD(r) "vpslld $20, %%zmm28, " r "\n\t"
#define ANDD(r) "vpandd %%zmm28, %%zmm29, " r "\n\t"
#define CVTPH(r) "vcvtph2ps %%ymm28, " r "\n\t"
#define PERMI2B(r) "vmovdqa64 %%zmm30, " r "\n\tvpermi2b %%zmm28, %%zmm29, " r "\n\t"

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni,avx512bf16"))) static void
throughput(void)
{
    __asm__ volatile("vpxord %%zmm28, %%zmm28, %%zmm28\n\tvpxord %%zmm29, %%zmm29, %%zmm29\n\t"
                     "vpxord %%zmm30, %%zmm30, %%zmm30" ::: "xmm28", "xmm29", "xmm30");
    TIME("vfmadd231ps zmm (float32)", 16, FMA);
    TIME("vdpbf16ps zmm (bfloat16 pairs)", 32, DPBF16);
    TIME("vpdpbusd zmm (u8 x s8 quads)", 64, DPBUSD);
    TIME("vpmaddwd zmm (int16 pairs)", 32, MADDWD);
    TIME("vpmovsxbd zmm, xmm (16 codes)", 0, SXBD);
    TIME("vpslld zmm", 0, SLLD);
    TIME("vpandd zmm", 0, ANDD);
    TIME("vcvtph2ps zmm, ymm (16 halves)", 0, CVTPH);
    TIME("vpermi2b zmm (+ a register move)", 0, PERMI2B);
}
#endif

/* The value of an e4m3fn code (finite codes only here). */
static double e4m3(int c)
{
    const int e = (c >> 3) & 15, m = c & 7;
    const double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1 + m / 8.0, e - 7);
    return c & 0x80 ? -v : v;
}

/* x rounded to bfloat16 (to nearest, ties to even; x finite). */
static float to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

static void accuracy(int D)
{
    enum { KEYS = 4096 };
    float *q = malloc(sizeof(float) * D);
    unsigned char *k = malloc((size_t)KEYS * D);
    srand(7);
    for (int d = 0; d < D; d++)
        q[d] = (float)((rand() % 20001 - 10000) / 4000.0);
    for (size_t i = 0; i < (size_t)KEYS * D; i++) {
        int c = rand() & 0xFF;
        if ((c & 0x7F) == 0x7F) /* (no NaN codes) */
            c &= 0xFE;
        k[i] = (unsigned char)c;
    }
    double top = 0, e32 = 0, ebf = 0, ebf2 = 0;
    for (int j = 0; j < KEYS; j++) {
        double exact = 0;
        float f32 = 0, bf = 0, bf2 = 0;
        for (int d = 0; d < D; d++) {
            const double v = e4m3(k[(size_t)j * D + d]);
            const float hi = to_bf16(q[d]), lo = to_bf16(q[d] - hi);
            exact += (double)q[d] * v;
            f32 = fmaf(q[d], (float)v, f32);
            bf = fmaf(hi, (float)v, bf); /* exact products, float32 sums */
            bf2 = fmaf(lo, (float)v, fmaf(hi, (float)v, bf2));
        }
        top = fabs(exact) > top ? fabs(exact) : top;
        e32 = fabs(f32 - exact) > e32 ? fabs(f32 - exact) : e32;
        ebf = fabs(bf - exact) > ebf ? fabs(bf - exact) : ebf;
        ebf2 = fabs(bf2 - exact) > ebf2 ? fabs(bf2 - exact) : ebf2;
    }
    printf("  head_dim %3d, %d e4m3fn keys, largest |q.k| error / largest |q.k|:\n"
           "    float32 q %.1e, bfloat16 q %.1e, q as two bfloat16 (hi + lo) %.1e\n",
           D, KEYS, e32 / top, ebf / top, ebf2 / top);
    free(q);
    free(k);
}

int main(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512bf16")) {
        printf("1. throughput, one thread (instructions and products per nanosecond):\n");
        throughput();
    } else {
        printf("1. skipped: this CPU lacks AVX-512 F/BW/VBMI/VNNI/BF16\n");
    }
#else
    printf("1. skipped: not x86-64\n");
#endif
    printf("2. scores of e4m3fn keys against float64:\n");
    accuracy(64);
    accuracy(128);
    return 0;
}
