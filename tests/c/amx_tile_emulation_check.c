/*
 * The tile emulation itself (amx_tile_emulation.h) against the facts of
 * Intel's pseudocode it is written from, on values chosen so that a
 * different reading gives a different answer:
 *   - TDPBF16PS keeps even and odd products in separate float32
 *     accumulators and adds their sum to the destination (an in-order
 *     accumulation gives 1 where the pseudocode gives 2 below);
 *   - bf16 inputs below 2^-126 are zero (DAZ), float32 results below it are
 *     flushed (FTZ), every rounding is to nearest even;
 *   - TILELOADD/TILESTORED move rows x colsb bytes of the configuration:
 *     bytes and rows past it read as zero and are never written.
 * Prints "emulation: 0 failures".  Built by tests/test_attention_amx_emulated.py.
 */
#include "amx_tile_emulation.h"

static int failures;

static void expect(const char *what, float got, float want)
{
    if (!(got == want || (got != got && want != want)) || signbit(got) != signbit(want)) {
        printf("  FAIL %s: got %a, want %a\n", what, got, want);
        failures++;
    }
}

static uint16_t bf(float f) /* exact here: the test values are bf16 */
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)(b >> 16);
}

/* One output element: C (1 x 1) = c + sum_k a[k] * b[k] over npairs pairs. */
static float dot(float c, const float *a, const float *b, int npairs)
{
    unsigned char cfg[64] = {1};
    /* tile 0: C 1 row x 4 bytes; tile 1: A 1 row x 4 npairs bytes; tile 2:
     * B npairs rows x 4 bytes */
    cfg[16] = 4, cfg[48] = 1;
    cfg[18] = (unsigned char)(4 * npairs), cfg[49] = 1;
    cfg[20] = 4, cfg[50] = (unsigned char)npairs;
    _tile_loadconfig(cfg);
    uint16_t A[32] = {0}, B[32] = {0};
    for (int i = 0; i < 2 * npairs; i++) {
        A[i] = bf(a[i]);
        B[i] = bf(b[i]); /* B row k holds pair k of the one column */
    }
    _tile_loadd(0, &c, 4);
    _tile_loadd(1, A, 64);
    _tile_loadd(2, B, 4);
    _tile_dpbf16ps(0, 1, 2);
    float out = -1.0f;
    _tile_stored(0, &out, 4);
    _tile_release();
    return out;
}

int main(void)
{
    /* even/odd accumulators: even 2^24 - 2^24 = 0, odd 1 + 1 = 2 */
    {
        float a[4] = {1, 1, 1, 1}, b[4] = {0x1p24f, 1, -0x1p24f, 1};
        expect("even and odd accumulators", dot(0.0f, a, b, 2), 2.0f);
    }
    /* DAZ: the bf16 0x0001 (2^-133) reads as zero */
    {
        float tiny;
        uint32_t bits = 0x00010000u;
        memcpy(&tiny, &bits, 4);
        float a[2] = {tiny, 0}, b[2] = {0x1p100f, 0};
        expect("DAZ on bf16 inputs", dot(0.0f, a, b, 1), 0.0f);
        float a2[2] = {-0x1p-120f, 0}, b2[2] = {0x1p120f, 0}; /* normal: kept */
        expect("normal bf16 inputs kept", dot(0.0f, a2, b2, 1), -1.0f);
    }
    /* FTZ: 2^-100 * -2^-30 = -2^-130 is flushed to -0 in the even
     * accumulator; -0 + the odd +0 is +0 */
    {
        float a[2] = {0x1p-100f, 0}, b[2] = {-0x1p-30f, 0};
        expect("FTZ on results", dot(0.0f, a, b, 1), 0.0f);
    }
    /* round to nearest even: 1 + 2^-24 -> 1, 1 + 3 * 2^-24 -> 1 + 2^-22 */
    {
        float a[2] = {0x1p-12f, 0}, b[2] = {0x1p-12f, 0};
        expect("ties to even (down)", dot(1.0f, a, b, 1), 1.0f);
        float a2[2] = {0x1.8p-12f, 0}, b2[2] = {0x1p-11f, 0};
        expect("ties to even (up)", dot(1.0f, a2, b2, 1), 1.0f + 0x1p-22f);
    }
    /* exact products, float32 sums: 3 pairs */
    {
        float a[6] = {1.5f, -2.0f, 0.25f, 3.0f, -1.0f, 0.5f};
        float b[6] = {2.0f, 0.75f, 8.0f, -0.5f, 4.0f, 2.0f};
        /* even: 3 + 2 - 4 = 1; odd: -1.5 - 1.5 + 1 = -2; c 10 */
        expect("a dot product", dot(10.0f, a, b, 3), 9.0f);
    }
    /* loads and stores: 3 rows x 8 bytes of a 16 x 64 array */
    {
        unsigned char cfg[64] = {1};
        cfg[16] = 8, cfg[48] = 3;
        _tile_loadconfig(cfg);
        uint8_t src[16 * 64], dst[16 * 64];
        for (int i = 0; i < 16 * 64; i++)
            src[i] = (uint8_t)(i * 7 + 1);
        memset(dst, 0xAB, sizeof dst);
        _tile_loadd(0, src, 64);
        _tile_stored(0, dst, 32);
        int bad = 0;
        for (int r = 0; r < 16; r++)
            for (int j = 0; j < 32; j++) {
                const uint8_t want = r < 3 && j < 8 ? src[r * 64 + j] : 0xAB;
                bad += dst[r * 32 + j] != want;
            }
        if (bad) {
            printf("  FAIL rows x colsb moved: %d bytes wrong\n", bad);
            failures++;
        }
        /* the tile's bytes past colsb and rows past rows are zero */
        for (int r = 0; r < 16; r++)
            for (int j = 0; j < 64; j++)
                if ((r >= 3 || j >= 8) && amx_emu.t[0].data[r][j] != 0) {
                    printf("  FAIL tile byte %d,%d past the configuration not zero\n", r, j);
                    failures++;
                    r = 16;
                    break;
                }
        _tile_release();
        if (amx_emu.configured) {
            printf("  FAIL TILERELEASE left a configuration\n");
            failures++;
        }
    }
    printf("emulation: %d failures\n", failures);
    return failures ? 1 : 0;
}
