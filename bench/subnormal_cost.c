/*
 * What an AVX-512 FMA costs when an operand or its result is a subnormal
 * float32 (below 2^-126), on this CPU: why kvcore's attention makes no
 * subnormal operand of its own (kv_attn_internal.h, kva_flush_tiny) and
 * reads e4m3fn codes as halves (kv_attn_avx512.c).
 *
 *   cc -O2 bench/subnormal_cost.c -o /tmp/subnormal_cost && /tmp/subnormal_cost [mxcsr_bits]
 *
 * Eight independent chains acc = fma(p, v, acc), cycles per FMA at the
 * clock given by a dependent chain (an FMA's latency taken as 4 cycles).
 * mxcsr_bits (optional, decimal) are ORed into MXCSR first: 32768 sets
 * FTZ, 32832 FTZ and DAZ (which kvcore does not set: it would read stored
 * subnormal float32 and bfloat16 elements as 0).
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { N = 2000000 };

/* Seconds per FMA of 8 independent chains acc = fma(p, v, acc). */
__attribute__((target("avx512f"), noinline)) static double chains(float p, float v, float a0)
{
    __m512 a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_set1_ps(a0);
    __m512 vp = _mm512_set1_ps(p), vv = _mm512_set1_ps(v);
    const double t = now();
    for (long i = 0; i < N; i++) {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            a[k] = _mm512_fmadd_ps(vp, vv, a[k]);
        __asm__("" : "+v"(vp));
    }
    const double s = (now() - t) / N / 8;
    float sum = 0;
    for (int i = 0; i < 8; i++)
        sum += _mm512_reduce_add_ps(a[i]);
    if (sum == 1.5f)
        printf("(unlikely)\n");
    return s;
}

/* Seconds per FMA of one dependent chain (the latency). */
__attribute__((target("avx512f"), noinline)) static double latency(void)
{
    __m512 a = _mm512_set1_ps(1.0f), x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
    const double t = now();
    for (long i = 0; i < N; i++)
        a = _mm512_fmadd_ps(a, x, y);
    const double s = (now() - t) / N;
    if (_mm512_reduce_add_ps(a) == 1.5f)
        printf("(unlikely)\n");
    return s;
}

int main(int argc, char **argv)
{
    if (argc > 1) {
        _mm_setcsr(_mm_getcsr() | (unsigned)strtoul(argv[1], NULL, 10));
        printf("MXCSR |= %s\n", argv[1]);
    }
    const double hz = 4.0 / latency();
    printf("clock (4-cycle FMA latency): %.2f GHz\n", hz / 1e9);
    const struct {
        const char *what;
        float p, v, a;
    } cases[] = {
        {"all normal", 0.5f, 0.5f, 0.0f},
        {"product subnormal (2^-130), normal inputs and acc", 0x1p-120f, 0x1p-10f, 1.0f},
        {"product and acc subnormal, normal inputs", 0x1p-120f, 0x1p-10f, 0.0f},
        {"a subnormal multiplicand (1e-40), normal acc", 1e-40f, 1.0f, 1.0f},
        {"a subnormal multiplicand (1e-40), acc 0", 1e-40f, 1.0f, 0.0f},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        printf("%-52s %7.2f cycles per FMA\n", cases[i].what,
               chains(cases[i].p, cases[i].v, cases[i].a) * hz);
    return 0;
}
