/*
 * amx_tile_emulation.h: a test-only emulation of the AMX tile instructions
 * kv_attn_amx.c uses, so its tile code runs (and is checked) on a CPU
 * without AMX.  Written from the pseudocode of Intel's published
 * instruction reference (SDM vol. 2 / the ISA extensions reference):
 * LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBF16PS, TILERELEASE.
 *
 *   - 8 tile registers (palette 1: at most 16 rows x 64 bytes each), per
 *     thread, as byte arrays; the 64-byte tile configuration (palette id,
 *     start_row, colsb[16], rows[16]); a configuration the real instruction
 *     would fault on (#GP/#UD) aborts here with a message, as does a tile
 *     instruction before LDTILECFG or on shapes TDPBF16PS refuses.
 *   - TILELOADD/TILESTORED move rows start_row .. rows-1 of colsb bytes;
 *     the bytes past colsb and the rows past rows read as zero.
 *   - TDPBF16PS: per row, even and odd float32 accumulators (FMA, round to
 *     nearest even) over the pairs, then their sum added to the
 *     destination; bf16 inputs below 2^-126 read as zero (DAZ), float32
 *     results below it are flushed (FTZ), MXCSR not consulted.
 *
 * The AVX-512 intrinsics come from SIMDe (its native aliases: the _mm512_*
 * names), so kv_attn_amx.c compiles unchanged against this header with
 * -DKVA_AMX_EMULATION -DKVA_AMX_TARGET= .  The count of TDPBF16PS executed
 * (amx_emu_tdpbf16ps_count) lets a test see that the tiles did run.
 */
#ifndef AMX_TILE_EMULATION_H
#define AMX_TILE_EMULATION_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
/* constants SIMDe's native aliases leave out */
#ifndef _MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#ifndef _CMP_ORD_Q
#define _CMP_ORD_Q SIMDE_CMP_ORD_Q
#endif
#ifndef _CMP_LT_OQ
#define _CMP_LT_OQ SIMDE_CMP_LT_OQ
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { AMX_EMU_TILES = 8, AMX_EMU_ROWS = 16, AMX_EMU_COLSB = 64 };

typedef struct {
    uint16_t colsb;
    uint8_t rows;
    uint8_t data[AMX_EMU_ROWS][AMX_EMU_COLSB];
} amx_emu_tile;

/* Each thread has its own tile state, as on the hardware. */
static __thread struct {
    int configured;
    uint8_t palette_id, start_row;
    amx_emu_tile t[AMX_EMU_TILES];
} amx_emu;

/* TDPBF16PS executed, all threads (read by the test driver). */
long amx_emu_tdpbf16ps_count;

static inline void amx_emu_fault(const char *what)
{
    fprintf(stderr, "amx emulation: fault: %s\n", what);
    abort();
}

static inline amx_emu_tile *amx_emu_reg(int t)
{
    if (!amx_emu.configured)
        amx_emu_fault("#UD: tile instruction before LDTILECFG");
    if (t < 0 || t >= AMX_EMU_TILES)
        amx_emu_fault("no such tile register");
    amx_emu_tile *r = &amx_emu.t[t];
    if (r->rows == 0 || r->colsb == 0)
        amx_emu_fault("#UD: tile not configured");
    return r;
}

/* zero_upper_rows(t, first) */
static inline void amx_emu_zero_upper_rows(amx_emu_tile *r, int first)
{
    for (int i = first; i < AMX_EMU_ROWS; i++)
        memset(r->data[i], 0, AMX_EMU_COLSB);
}

/* TILERELEASE: back to the init state (no configuration, tiles zero). */
static inline void amx_emu_tilerelease(void)
{
    memset(&amx_emu, 0, sizeof amx_emu);
}

/* LDTILECFG m512 */
static inline void amx_emu_ldtilecfg(const void *mem)
{
    const uint8_t *b = (const uint8_t *)mem;
    if (b[0] == 0) { /* palette 0: the init state */
        amx_emu_tilerelease();
        return;
    }
    if (b[0] != 1)
        amx_emu_fault("#GP: unsupported palette");
    for (int i = 2; i < 16; i++)
        if (b[i] != 0)
            amx_emu_fault("#GP: reserved bytes of the configuration not zero");
    uint16_t colsb[16];
    uint8_t rows[16];
    for (int i = 0; i < 16; i++) {
        colsb[i] = (uint16_t)(b[16 + 2 * i] | b[17 + 2 * i] << 8);
        rows[i] = b[48 + i];
        if (i >= AMX_EMU_TILES && (colsb[i] || rows[i]))
            amx_emu_fault("#GP: a tile past palette 1's 8 configured");
        if (rows[i] > AMX_EMU_ROWS || colsb[i] > AMX_EMU_COLSB)
            amx_emu_fault("#GP: tile larger than palette 1 allows");
        if ((rows[i] == 0) != (colsb[i] == 0))
            amx_emu_fault("#GP: tile with rows or colsb but not both");
    }
    memset(&amx_emu, 0, sizeof amx_emu); /* the tiles are zeroed */
    for (int i = 0; i < AMX_EMU_TILES; i++) {
        amx_emu.t[i].colsb = colsb[i];
        amx_emu.t[i].rows = rows[i];
    }
    amx_emu.palette_id = 1;
    amx_emu.start_row = b[1];
    amx_emu.configured = 1;
}

/* STTILECFG m512: the configuration (64 zero bytes in the init state). */
static inline void amx_emu_sttilecfg(void *mem)
{
    uint8_t *b = (uint8_t *)mem;
    memset(b, 0, 64);
    if (!amx_emu.configured)
        return;
    b[0] = amx_emu.palette_id;
    b[1] = amx_emu.start_row;
    for (int i = 0; i < AMX_EMU_TILES; i++) {
        b[16 + 2 * i] = (uint8_t)(amx_emu.t[i].colsb & 0xFF);
        b[17 + 2 * i] = (uint8_t)(amx_emu.t[i].colsb >> 8);
        b[48 + i] = amx_emu.t[i].rows;
    }
}

/* TILELOADD tdest, [base + stride * row] */
static inline void amx_emu_tileloadd(int t, const void *base, long stride)
{
    amx_emu_tile *r = amx_emu_reg(t);
    const uint8_t *p = (const uint8_t *)base;
    for (int i = amx_emu.start_row; i < r->rows; i++) {
        memcpy(r->data[i], p + (ptrdiff_t)i * stride, r->colsb);
        memset(r->data[i] + r->colsb, 0, AMX_EMU_COLSB - r->colsb);
    }
    amx_emu_zero_upper_rows(r, r->rows);
    amx_emu.start_row = 0;
}

/* TILESTORED [base + stride * row], tsrc */
static inline void amx_emu_tilestored(int t, void *base, long stride)
{
    amx_emu_tile *r = amx_emu_reg(t);
    uint8_t *p = (uint8_t *)base;
    for (int i = amx_emu.start_row; i < r->rows; i++)
        memcpy(p + (ptrdiff_t)i * stride, r->data[i], r->colsb);
    amx_emu.start_row = 0;
}

/* TILEZERO tdest */
static inline void amx_emu_tilezero(int t)
{
    amx_emu_tile *r = amx_emu_reg(t);
    memset(r->data, 0, sizeof r->data);
}

static inline float amx_emu_f32(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* make_fp32(bf16) with DAZ: the bf16 in the high half of a dword. */
static inline float amx_emu_bf16(const uint8_t *p)
{
    uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    if ((bits & 0x7F800000u) == 0)
        bits &= 0x80000000u;
    return amx_emu_f32(bits);
}

/* DAZ on a float32 input, FTZ on a result: below 2^-126 is a signed zero. */
static inline float amx_emu_flush(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7F800000u) == 0)
        bits &= 0x80000000u;
    return amx_emu_f32(bits);
}

/* x * y + t rounded once.  The product of two bf16 is exact in float32
 * (16 significant bits) unless it is tiny, so a float32 add is the fused
 * result; fmaf (slow without FMA hardware) only for the tiny ones. */
static inline float amx_emu_fma(float x, float y, float t)
{
    const float p = x * y;
    if (p != 0.0f && fabsf(p) < 0x1p-100f)
        return fmaf(x, y, t);
    return p + t;
}

/* TDPBF16PS tsrcdest, tsrc1, tsrc2: C (m x n) += A (m x k) B (k x n), the
 * elements of A and B pairs of bf16. */
static inline void amx_emu_tdpbf16ps(int d, int a, int b)
{
    amx_emu_tile *C = amx_emu_reg(d), *A = amx_emu_reg(a), *B = amx_emu_reg(b);
    if (d == a || d == b || a == b)
        amx_emu_fault("#UD: TDPBF16PS operands must be distinct tiles");
    if (C->rows != A->rows || A->colsb / 4 != B->rows || C->colsb != B->colsb ||
        C->colsb % 4 || A->colsb % 4)
        amx_emu_fault("#UD: TDPBF16PS tile shapes do not match");
    const int elements_src1 = A->colsb / 4, elements_dest = C->colsb / 4;
    /* the bf16 of B as float32 (DAZ), once per instruction */
    float b32[AMX_EMU_ROWS][AMX_EMU_COLSB / 2];
    for (int k = 0; k < elements_src1; k++)
        for (int i = 0; i < 2 * elements_dest; i++)
            b32[k][i] = amx_emu_bf16(&B->data[k][2 * i]);
    for (int m = 0; m < C->rows; m++) {
        float temp1[2 * AMX_EMU_COLSB / 4] = {0};
        for (int k = 0; k < elements_src1; k++) {
            const float x[2] = {amx_emu_bf16(&A->data[m][4 * k]),
                                amx_emu_bf16(&A->data[m][4 * k + 2])};
            for (int n = 0; n < elements_dest; n++)
                for (int e = 0; e < 2; e++)
                    /* FP32 FMA with DAZ = FTZ = 1, round to nearest even
                     * (temp1 is never subnormal: flushed when written) */
                    temp1[2 * n + e] = amx_emu_flush(amx_emu_fma(x[e], b32[k][2 * n + e],
                                                                 temp1[2 * n + e]));
        }
        for (int n = 0; n < elements_dest; n++) {
            float c;
            memcpy(&c, &C->data[m][4 * n], 4);
            float tmp = amx_emu_flush(amx_emu_flush(temp1[2 * n]) + amx_emu_flush(temp1[2 * n + 1]));
            c = amx_emu_flush(amx_emu_flush(c) + tmp);
            memcpy(&C->data[m][4 * n], &c, 4);
        }
        memset(C->data[m] + C->colsb, 0, AMX_EMU_COLSB - C->colsb); /* write_row_and_zero */
    }
    amx_emu_zero_upper_rows(C, C->rows);
    amx_emu.start_row = 0;
    __atomic_fetch_add(&amx_emu_tdpbf16ps_count, 1, __ATOMIC_RELAXED);
}

/* The intrinsics (immintrin.h's names) kv_attn_amx.c uses. */
#define _tile_loadconfig(config) amx_emu_ldtilecfg(config)
#define _tile_storeconfig(config) amx_emu_sttilecfg(config)
#define _tile_release() amx_emu_tilerelease()
#define _tile_loadd(dst, base, stride) amx_emu_tileloadd((dst), (base), (long)(stride))
#define _tile_stored(src, base, stride) amx_emu_tilestored((src), (base), (long)(stride))
#define _tile_zero(dst) amx_emu_tilezero(dst)
#define _tile_dpbf16ps(dst, src1, src2) amx_emu_tdpbf16ps((dst), (src1), (src2))

#endif
