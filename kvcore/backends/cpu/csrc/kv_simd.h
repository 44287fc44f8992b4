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
 * "avx512", "amx" (x86-64) or "neon" (AArch64), surrounding spaces and
 * case ignored: the highest level any family uses by default (never more
 * than the CPU has).  Unset or empty: no cap (amx where the CPU has it: on
 * the Intel Xeon with AMX measured, its prefill ran at 1.04-1.8x the avx512
 * level's; a decode of a usual GQA group runs the avx512 kernels there, one
 * of 48 query heads a KV head 1.2-1.9x faster: docs/performance.md).
 * Another value is an error the Python layer reports (kvs_cap() < 0); C
 * callers then get the scalar kernels.
 *
 * avx512 (AVX-512 F + BW + VL + DQ, with the OS saving the zmm state) has
 * attention kernels only: the conversions run their avx2 ones there (on an
 * AVX-512 CPU, AMD EPYC, the 512-bit conversions measured slower than
 * AVX2).  amx (AMX-TILE + AMX-BF16 + AVX-512 VBMI on top of avx512) adds
 * tiles for the attention's items of 16 rows or more.  The kernels of both
 * levels are checked under
 * emulation (SIMDe; a tile emulation written from Intel's pseudocode:
 * tests/attention/test_attention_avx512.py, tests/attention/test_attention_amx_emulated.py);
 * both also natively (avx512: AMD EPYC Zen 5, Intel Ice Lake; amx and
 * avx512: an Intel Xeon with AMX).
 *
 * Each extension module links its own copy of this file: the detection and
 * the cap are the same in all of them (the same CPU, the same environment).
 */
#ifndef KV_SIMD_H
#define KV_SIMD_H

#ifdef __cplusplus
extern "C" {
#endif

/* Levels, lowest first: X(enum suffix, name).  avx2 means AVX2 + FMA +
 * F16C.  The cap falls back by number (a level the CPU lacks runs the next
 * lower one it has), so the x86 levels above avx2 come after neon: a cap of
 * "neon" on x86-64 keeps avx2, as before avx512 existed, and a cap of
 * "avx512" on AArch64 keeps neon.  amx means AMX-TILE + AMX-BF16 + the
 * avx512 set, with the OS saving the tile state (XCR0 bits 17-18) and, on
 * Linux, granting this process the tile data (ARCH_REQ_XCOMP_PERM, asked
 * once at detection; a kernel that refuses it leaves the level
 * unsupported).  A new level is one X entry here plus its case in
 * kv_simd.c's detect(). */
#define KVS_LEVELS(X)                                                      \
    X(SCALAR, "scalar")                                                    \
    X(F16C, "f16c")     /* x86-64 */                                       \
    X(AVX2, "avx2")     /* x86-64 */                                       \
    X(NEON, "neon")     /* aarch64 */                                      \
    X(AVX512, "avx512") /* x86-64: AVX-512 F + BW + VL + DQ */             \
    X(AMX, "amx")       /* x86-64: AMX-TILE + AMX-BF16 + avx512 */

#define KVS_ENUM_ENTRY(id, name) KVS_##id,
enum { KVS_LEVELS(KVS_ENUM_ENTRY) KVS_NUM_LEVELS };
#undef KVS_ENUM_ENTRY

/* Name of a level ("scalar", "f16c", "avx2", "neon", "avx512", "amx"), NULL
 * if out of range. */
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
 * (scalar when the cap is invalid), amx only when the cap names it. */
int kvs_default_level(void);

#ifdef __cplusplus
}
#endif
#endif
