/*
 * Stand-alone check of kv_fp8.c: every SIMD level this CPU (or emulator)
 * supports must give the scalar path's bits for every input.  Built and run
 * by tests/test_native_levels.py, natively and, when a cross compiler and
 * qemu-aarch64 are installed, for AArch64 (the NEON path).  (The Python
 * tests walk all 2**32 float32 patterns at every level of the host.)
 *
 * Checked, for both formats, both saturate modes and scales 1, 0.37 and
 * powers of two (applied as the product with the exact reciprocal):
 * float32 narrowed for every sign and exponent under all 2^12 low mantissa
 * patterns with several high parts (every rounding boundary of both
 * formats), plus a pseudo-random sample; all 256 codes widened; int8 rows
 * (random, all zero, with NaN/inf, huge and tiny); lengths 0..67 for tails;
 * the row-batch calls of the paged writes (kvh_f32_to_fp8_rows,
 * kvh_f32_to_i8_rows: strides, unaligned rows, non-temporal stores) against
 * the scalar one-row calls.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kv_fp8.h"
#include "kv_half.h"
#include "kv_check_util.h"


static int fails = 0;
static const float scales[] = {1.0f, 0.37f, 0.25f, 64.0f, 0x1p-126f, 0x1p126f, -2.0f};
#define NSCALES ((int)(sizeof scales / sizeof scales[0]))

static void check_narrow(int level, const uint32_t *x, size_t n)
{
    static uint8_t a[1 << 16], b[1 << 16];
    for (int fmt = 0; fmt < 2; fmt++)
        for (int sat = 0; sat < 2; sat++)
            for (int s = 0; s < NSCALES; s++) {
                kvh_set_level(KVH_SCALAR);
                kvh_f32_to_fp8(fmt, (const float *)x, a, (ptrdiff_t)n, scales[s], sat);
                kvh_set_level(level);
                kvh_f32_to_fp8(fmt, (const float *)x, b, (ptrdiff_t)n, scales[s], sat);
                for (size_t i = 0; i < n && fails < 20; i++)
                    if (a[i] != b[i]) {
                        printf("MISMATCH %s f32->fp8 fmt=%d sat=%d scale=%g x=%08x scalar=%02x "
                               "simd=%02x\n", kvh_level_name(level), fmt, sat, scales[s], x[i],
                               a[i], b[i]);
                        fails++;
                    }
            }
}

static void check_widen(int level)
{
    static uint8_t c[256 + 67];
    static uint32_t a[256 + 67], b[256 + 67];
    for (int i = 0; i < 256 + 67; i++)
        c[i] = (uint8_t)i;
    for (int fmt = 0; fmt < 2; fmt++)
        for (int s = 0; s < 2; s++)
            for (int len = 0; len < 256 + 67; len += len < 68 ? 1 : 256 + 67 - 68) {
                kvh_set_level(KVH_SCALAR);
                kvh_fp8_to_f32(fmt, c, (float *)a, len, scales[s]);
                kvh_set_level(level);
                kvh_fp8_to_f32(fmt, c, (float *)b, len, scales[s]);
                for (int i = 0; i < len && fails < 20; i++)
                    if (a[i] != b[i]) {
                        printf("MISMATCH %s fp8->f32 fmt=%d code=%02x scalar=%08x simd=%08x\n",
                               kvh_level_name(level), fmt, c[i], a[i], b[i]);
                        fails++;
                    }
            }
}

static void check_i8_row(int level, const float *x, ptrdiff_t n)
{
    static int8_t a[512], b[512];
    static float fa[512], fb[512];
    kvh_set_level(KVH_SCALAR);
    float sa = kvh_f32_to_i8_row(x, a, n);
    kvh_i8_to_f32(a, fa, n, sa);
    kvh_set_level(level);
    float sb = kvh_f32_to_i8_row(x, b, n);
    kvh_i8_to_f32(b, fb, n, sb);
    if (memcmp(&sa, &sb, 4) != 0 || memcmp(a, b, (size_t)n) != 0 ||
        memcmp(fa, fb, (size_t)n * 4) != 0) {
        if (fails < 20)
            printf("MISMATCH %s i8 row n=%td scale scalar=%g simd=%g\n", kvh_level_name(level), n,
                   sa, sb);
        fails++;
    }
}

static void check_i8(int level)
{
    static float x[512];
    for (int r = 0; r < 2000; r++) {
        ptrdiff_t n = (ptrdiff_t)(rnd() % 300);
        int kind = (int)(rnd() % 6);
        for (ptrdiff_t i = 0; i < n; i++) {
            uint32_t u = rnd();
            float v = (float)(int32_t)u / 2147483648.0f;    /* [-1, 1) */
            switch (kind) {
            case 0: x[i] = v; break;
            case 1: x[i] = v * 1e30f; break;
            case 2: x[i] = v * 1e-40f; break;                /* subnormal */
            case 3: x[i] = 0.0f; break;
            case 4: x[i] = (u & 15) == 0 ? NAN : v; break;
            default: x[i] = (u & 15) == 0 ? -INFINITY : (float)((int)(u % 255) - 127); break;
            }
        }
        check_i8_row(level, x, n);
    }
}

/* The row-batch calls: `rows` rows of n elements (strides in elements /
 * bytes, pad so that rows start unaligned), every level against the scalar
 * one-row calls, streamed or not. */
static void check_rows(int level)
{
    static float x[8 * 300];
    static uint8_t a[8 * 320], b[8 * 320];
    static float sa[8 * 3], sb[8 * 3];
    for (int r = 0; r < 600; r++) {
        ptrdiff_t n = (ptrdiff_t)(rnd() % 290), rows = 1 + (ptrdiff_t)(rnd() % 8);
        ptrdiff_t ss = n + (ptrdiff_t)(rnd() % 3), ds = n + (ptrdiff_t)(rnd() % 32);
        ptrdiff_t off = (ptrdiff_t)(rnd() % 17);
        int kind = (int)(rnd() % 5), stream = (int)(rnd() & 1);
        int fmt = (int)(rnd() & 1), sat = (int)(rnd() & 1);
        float scale = scales[rnd() % NSCALES];
        for (ptrdiff_t i = 0; i < rows * ss; i++) {
            uint32_t u = rnd();
            float v = (float)(int32_t)u / 2147483648.0f;    /* [-1, 1) */
            switch (kind) {
            case 0: x[i] = v * 4.0f; break;
            case 1: x[i] = v * 0.02f; break;                 /* fp8 subnormals among normals */
            case 2: x[i] = (u & 63) == 0 ? NAN : v * 600.0f; break;
            case 3: memcpy(&x[i], &u, 4); break;             /* any pattern */
            default: x[i] = (u & 7) == 0 ? -INFINITY : v * 60000.0f; break;
            }
        }
        memset(a, 0xA5, sizeof a);
        memset(b, 0xA5, sizeof b);
        kvh_set_level(KVH_SCALAR);
        for (ptrdiff_t k = 0; k < rows; k++)
            kvh_f32_to_fp8(fmt, x + k * ss, a + off + k * ds, n, scale, sat);
        kvh_set_level(level);
        kvh_f32_to_fp8_rows(fmt, x, ss * 4, b + off, ds, rows, n, scale, sat, stream);
        kvh_stream_fence();
        if (memcmp(a, b, sizeof a) != 0) {
            if (fails < 20)
                printf("MISMATCH %s fp8 rows fmt=%d sat=%d scale=%g rows=%td n=%td off=%td "
                       "stream=%d\n", kvh_level_name(level), fmt, sat, scale, rows, n, off,
                       stream);
            fails++;
        }
        memset(a, 0xA5, sizeof a);
        memset(b, 0xA5, sizeof b);
        kvh_set_level(KVH_SCALAR);
        for (ptrdiff_t k = 0; k < rows; k++)
            sa[3 * k] = kvh_f32_to_i8_row(x + k * ss, (int8_t *)a + off + k * ds, n);
        kvh_set_level(level);
        for (ptrdiff_t k = 0; k < rows; k++)
            sb[3 * k] = 0.0f;
        kvh_f32_to_i8_rows(x, ss * 4, (int8_t *)b + off, ds, sb, 3, rows, n, stream);
        kvh_stream_fence();
        int bad = memcmp(a, b, sizeof a) != 0;
        for (ptrdiff_t k = 0; k < rows; k++)
            bad |= memcmp(&sa[3 * k], &sb[3 * k], 4) != 0;
        if (bad) {
            if (fails < 20)
                printf("MISMATCH %s i8 rows rows=%td n=%td off=%td stream=%d\n",
                       kvh_level_name(level), rows, n, off, stream);
            fails++;
        }
    }
}

/* int8 rows near every rounding boundary: x within a few ulps of
 * (k + 1/2) * scale, so that x / scale falls on, just below and just above
 * half-integers (the AVX2 rows take products only where that cannot change
 * a code), at magnitudes across the range. */
static void check_i8_ties(int level)
{
    static float x[8 * 128];
    static int8_t a[8 * 128], b[8 * 128];
    static float sa[8], sb[8];
    for (int r = 0; r < 4000; r++) {
        float amax = ldexpf(1.0f + (float)(rnd() % 1000) / 1000.0f, (int)(rnd() % 240) - 120);
        float scale = amax / 127.0f;
        for (int i = 0; i < 8 * 128; i++) {
            int k = (int)(rnd() % 255) - 127;
            float v = ((float)k + 0.5f) * scale;
            uint32_t u;
            memcpy(&u, &v, 4);
            u += (uint32_t)((int)(rnd() % 9) - 4);
            memcpy(&v, &u, 4);
            x[i] = fabsf(v) < amax ? v : 0.0f;
        }
        for (int k = 0; k < 8; k++)
            x[k * 128 + (int)(rnd() % 128)] = (rnd() & 1) ? amax : -amax;
        kvh_set_level(KVH_SCALAR);
        for (int k = 0; k < 8; k++)
            sa[k] = kvh_f32_to_i8_row(x + k * 128, a + k * 128, 128);
        kvh_set_level(level);
        kvh_f32_to_i8_rows(x, 128 * 4, b, 128, sb, 1, 8, 128, (int)(r & 1));
        kvh_stream_fence();
        if (memcmp(a, b, sizeof a) != 0 || memcmp(sa, sb, sizeof sa) != 0) {
            if (fails < 20)
                printf("MISMATCH %s i8 rows near ties amax=%a\n", kvh_level_name(level), amax);
            fails++;
        }
    }
}

static void check_level(int level)
{
    static kvc_batch b;
    kvc_start(&b, check_narrow, level);
    static const uint32_t highs[] = {0x000000, 0x7ff000, 0x400000, 0x200000, 0x100000, 0x080000,
                                     0x2aa000, 0x555000, 0x7ef000, 0x0ff000};
    check_widen(level);
    check_i8(level);
    check_rows(level);
    check_i8_ties(level);
    kvc_push_grid(&b, highs, sizeof highs / sizeof highs[0], 4096, 1 << 20);
    /* then every tail length, at every misalignment of the output */
    size_t total = kvc_finish(&b);
    printf("level %s: %zu float32 patterns, 256 codes, 2000 int8 rows, 600 row batches\n",
           kvh_level_name(level),
           total);
}

int main(void)
{
    return kvc_check_levels(KVH_NUM_LEVELS, kvh_level_supported, check_level, &fails);
}
