/*
 * kv_simd: the one SIMD registry of kvcore's CPU kernels.
 *
 * Every kernel family (the float16/bfloat16 conversions of kv_half.c, the
 * fp8/int8 conversions of kv_fp8.c, the attention of kv_attention.c) takes
 * from here the level names, the CPU feature detection and the
 * KVCORE_SIMD cap, and maps a level of this registry to the kernels it has
 * (a family without kernels of a level runs the next lower one it has: the
 * attention has no f16c kernels, so a cap of f16c runs its scalar ones).
 *
 * KVCORE_SIMD (read once, at the first call): "scalar", "f16c", "avx2",
 * "amx" (x86-64) or "neon" (AArch64), surrounding spaces and case ignored: the
 * highest level any family uses by default (never more than the CPU has).
 * Unset or empty: no cap.  Another value is an error the Python layer
 * reports (kvs_cap() < 0); C callers then get the scalar kernels.
 *
 * There is no AVX-512 level: no CPU this is developed on can execute it,
 * and on an AVX-512 CPU (AMD EPYC) the 512-bit conversions measured slower
 * than AVX2; AVX-512 CPUs use the AVX2 kernels.  The amx level (AMX tiles
 * for the attention's prefill, which also needs AVX-512) is the one
 * exception; the conversions run avx2 there.
 *
 * Each extension module links its own copy of this file: the detection and
 * the cap are the same in all of them (the same CPU, the same environment).
 */
#ifndef KV_SIMD_H
#define KV_SIMD_H

#ifdef __cplusplus
extern "C" {
#endif

/* Levels, lowest first.  avx2 means AVX2 + FMA + F16C.  amx means AMX-TILE +
 * AMX-BF16 + AVX-512 F/BW/VL/DQ, with the OS saving the tile state (XCR0
 * bits 17-18) and, on Linux, granting this process the tile data
 * (ARCH_REQ_XCOMP_PERM, asked once at detection; a kernel that refuses it
 * leaves the level unsupported).  It sits after neon only until the avx512
 * level lands (then it goes right above avx512; the numbers are not API). */
enum {
    KVS_SCALAR = 0, KVS_F16C = 1, KVS_AVX2 = 2, /* x86-64 */
    KVS_NEON = 3,                               /* aarch64 */
    KVS_AMX = 4,                                /* x86-64 */
    KVS_NUM_LEVELS = 5
};

/* Name of a level ("scalar", "f16c", "avx2", "neon", "amx"), NULL if out of range. */
const char *kvs_level_name(int level);
/* 1 if this CPU (and this build) can run `level`. */
int kvs_level_supported(int level);
/* The best level this CPU supports. */
int kvs_best_level(void);
/* The KVCORE_SIMD cap: a level, KVS_NUM_LEVELS - 1 when unset or empty,
 * -1 when the value names no level. */
int kvs_cap(void);
/* The KVCORE_SIMD value as read (spaces stripped, lower case; at most 63
 * characters), "" when unset: for the error message. */
const char *kvs_cap_text(void);
/* The level families use by default: the best supported one <= the cap
 * (scalar when the cap is invalid). */
int kvs_default_level(void);

#ifdef __cplusplus
}
#endif
#endif
