/*
 * Stand-alone check of kv_fp8.c: every SIMD level this CPU (or emulator)
 * supports must give the scalar path's bits for every input.  Built and run
 * by tests/test_native_levels.py, natively and, when a cross compiler and
 * qemu-aarch64 are installed, for AArch64 (the NEON path).  (The Python
 * tests walk all 2**32 float32 patterns at every level of the host.)
 *
 * Checked, for both formats, both saturate modes and scales 1 and 0.37:
 * float32 narrowed for every sign and exponent under all 2^12 low mantissa
 * patterns with several high parts (every rounding boundary of both
 * formats), plus a pseudo-random sample; all 256 codes widened; int8 rows
 * (random, all zero, with NaN/inf, huge and tiny); lengths 0..67 for tails.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kv_fp8.h"
#include "kv_half.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}

static int fails = 0;
static const float scales[] = {1.0f, 0.37f};

static void check_narrow(int level, const uint32_t *x, size_t n)
{
    static uint8_t a[1 << 16], b[1 << 16];
    for (int fmt = 0; fmt < 2; fmt++)
        for (int sat = 0; sat < 2; sat++)
            for (int s = 0; s < 2; s++) {
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

static void check_level(int level)
{
    static uint32_t x[1 << 16];
    size_t n = 0, total = 0;
    static const uint32_t highs[] = {0x000000, 0x7ff000, 0x400000, 0x200000, 0x100000, 0x080000,
                                     0x2aa000, 0x555000, 0x7ef000, 0x0ff000};
    check_widen(level);
    check_i8(level);
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint32_t e = 0; e < 256; e++)
            for (size_t hsel = 0; hsel < sizeof highs / sizeof highs[0]; hsel++)
                for (uint32_t lo = 0; lo < 4096; lo++) {
                    x[n++] = (sign << 31) | (e << 23) | highs[hsel] | lo;
                    if (n == (1 << 16)) {
                        check_narrow(level, x, n);
                        total += n;
                        n = 0;
                    }
                }
    for (int r = 0; r < (1 << 20); r++) {
        x[n++] = rnd();
        if (n == (1 << 16)) {
            check_narrow(level, x, n);
            total += n;
            n = 0;
        }
    }
    check_narrow(level, x, n);
    total += n;
    for (size_t len = 0; len < 68; len++)
        for (size_t off = 0; off < 4; off++)
            check_narrow(level, x + off, len);
    printf("level %s: %zu float32 patterns, 256 codes, 2000 int8 rows\n", kvh_level_name(level),
           total);
}

int main(void)
{
    int checked = 0;
    for (int level = 1; level < KVH_NUM_LEVELS; level++) {
        if (!kvh_level_supported(level))
            continue;
        check_level(level);
        checked++;
    }
    printf("%d SIMD level(s) checked, %d mismatches\n", checked, fails);
    return fails ? 1 : (checked ? 0 : 3);
}
