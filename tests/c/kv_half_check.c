/*
 * Stand-alone check of kv_half.c: every SIMD level this CPU (or emulator)
 * supports must give the scalar path's bits for every input.  Built and run
 * by tests/test_native_levels.py, natively and, when a cross compiler and
 * qemu-aarch64 are installed, for AArch64 (the NEON path).
 *
 * Checked: all 65,536 half patterns widened (f16 and bf16); float32
 * patterns narrowed: for every sign and exponent, all 2^13 low mantissa
 * patterns (f16 ties) under several high parts, plus bf16 tie neighbourhoods
 * and a pseudo-random sample; array lengths 0..67 for the tails.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_half.h"
#include "kv_check_util.h"


static int fails = 0;

static void check_narrow(int level, const uint32_t *x, size_t n)
{
    static uint16_t a[1 << 16], b[1 << 16];
    for (int kind = 0; kind < 2; kind++) {
        kvh_set_level(KVH_SCALAR);
        (kind ? kvh_f32_to_bf16 : kvh_f32_to_f16)((const float *)x, a, (ptrdiff_t)n);
        kvh_set_level(level);
        (kind ? kvh_f32_to_bf16 : kvh_f32_to_f16)((const float *)x, b, (ptrdiff_t)n);
        for (size_t i = 0; i < n && fails < 20; i++)
            if (a[i] != b[i]) {
                printf("MISMATCH %s f32->%s x=%08x scalar=%04x simd=%04x\n",
                       kvh_level_name(level), kind ? "bf16" : "f16", x[i], a[i], b[i]);
                fails++;
            }
    }
}

static void check_widen(int level)
{
    static uint16_t h[65536];
    static uint32_t a[65536], b[65536];
    for (int i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    for (int kind = 0; kind < 2; kind++) {
        kvh_set_level(KVH_SCALAR);
        (kind ? kvh_bf16_to_f32 : kvh_f16_to_f32)(h, (float *)a, 65536);
        kvh_set_level(level);
        (kind ? kvh_bf16_to_f32 : kvh_f16_to_f32)(h, (float *)b, 65536);
        for (int i = 0; i < 65536 && fails < 20; i++)
            if (a[i] != b[i]) {
                printf("MISMATCH %s %s->f32 h=%04x scalar=%08x simd=%08x\n", kvh_level_name(level),
                       kind ? "bf16" : "f16", i, a[i], b[i]);
                fails++;
            }
    }
}

static void check_level(int level)
{
    static kvc_batch b;
    kvc_start(&b, check_narrow, level);
    static const uint32_t highs[] = {0x000000, 0x7fe000, 0x400000, 0x2aa000, 0x554000, 0x7f0000,
                                     0x010000, 0x3fe000};
    check_widen(level);
    /* bf16 ties: low 16 bits around 0x8000 under random high parts */
    for (int r = 0; r < 4096; r++) {
        uint32_t hi = rnd() & 0xffff0000u;
        for (uint32_t lo = 0x7ff0; lo < 0x8010; lo++)
            kvc_push(&b, hi | lo);
    }
    kvc_push_grid(&b, highs, sizeof highs / sizeof highs[0], 8192, 1 << 20);
    /* then every tail length, at every misalignment of the output */
    size_t total = kvc_finish(&b);
    printf("level %s: %zu float32 patterns, 131072 half patterns\n", kvh_level_name(level), total);
}

int main(void)
{
    return kvc_check_levels(KVH_NUM_LEVELS, kvh_level_supported, check_level, &fails);
}
