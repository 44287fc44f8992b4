/*
 * kv_half: float32 <-> float16 / bfloat16 conversion, round to nearest even.
 *
 * One portable scalar path plus SIMD paths chosen at run time.  Every path
 * gives the same bits for every input, NaNs included:
 *   narrowing  - RNE; overflow to +-inf; subnormals kept; +-0 kept;
 *                a NaN becomes a quiet NaN of the same sign whose payload is
 *                the top payload bits of the input (what F16C's VCVTPS2PH does).
 *   widening   - exact; f16 signalling NaNs come back quiet (as VCVTPH2PS
 *                does), bf16 is a plain 16-bit shift.
 *
 * No function here touches the Python API, so all of them run without the GIL.
 */
#ifndef KV_HALF_H
#define KV_HALF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element kinds shared by every kernel in kvcore (KVH_F32, KVH_F16, KVH_BF16). */
#include "kv_kinds.h"

/* SIMD levels, lowest first: the levels of the registry (kv_simd.h, the
 * same numbers).  A level is usable only if the CPU has it.  The
 * registry's avx512 level has no conversion kernels: on an AVX-512 CPU (AMD
 * EPYC) the 512-bit versions measured slower than AVX2 (f32->f16 at 64 MB:
 * 4.3 vs 5.9 Gelem/s), so AVX-512 CPUs use the AVX2 path. */
enum {
    KVH_SCALAR = 0, KVH_F16C = 1, KVH_AVX2 = 2, /* x86-64 */
    KVH_NEON = 3,                               /* aarch64 */
    KVH_NUM_LEVELS = 4
};

/* Best level this CPU supports (detected once). */
int kvh_best_level(void);
/* 1 if `level` can run on this CPU. */
int kvh_level_supported(int level);
/* The best level at or under registry level `l` (kv_simd.h) this CPU runs:
 * the one rule by which this family follows a level named for all
 * (the KVCORE_SIMD cap, kvcore.set_simd_level). */
int kvh_level_at_most(int l);
/* The level to start at: the best one under the KVCORE_SIMD cap. */
int kvh_default_level(void);
/* The level in use now. */
int kvh_current_level(void);
/* Switch to `level`; returns 0, or -1 (nothing changed) if unsupported. */
int kvh_set_level(int level);
/* Name of a level ("scalar", "f16c", "avx2", "neon"), NULL if out of range. */
const char *kvh_level_name(int level);

void kvh_f32_to_f16(const float *src, uint16_t *dst, ptrdiff_t n);
void kvh_f32_to_bf16(const float *src, uint16_t *dst, ptrdiff_t n);
void kvh_f16_to_f32(const uint16_t *src, float *dst, ptrdiff_t n);
void kvh_bf16_to_f32(const uint16_t *src, float *dst, ptrdiff_t n);

/* Convert n contiguous elements of kind src_kind to dst_kind (any pair;
 * the same kind is a copy, f16 <-> bf16 goes through an exact float32 step).
 * Returns 0, or -1 for an unknown kind. */
int kvh_convert(int src_kind, const void *src, int dst_kind, void *dst, ptrdiff_t n);

/* kvh_convert with non-temporal stores where the SIMD path has them (for
 * large scattered writes, e.g. a prompt's rows into a paged pool, whose
 * destination lines are written whole and not read back soon).  The bits
 * are the same as kvh_convert's.  Call kvh_stream_fence() once after the
 * last of a batch of these, before the data is read. */
int kvh_convert_stream(int src_kind, const void *src, int dst_kind, void *dst, ptrdiff_t n);
void kvh_stream_fence(void);

/* Single-element scalar conversions (the reference every SIMD path matches). */
uint16_t kvh_f32_to_f16_one(uint32_t bits);
uint16_t kvh_f32_to_bf16_one(uint32_t bits);
uint32_t kvh_f16_to_f32_one(uint16_t h);
uint32_t kvh_bf16_to_f32_one(uint16_t b);

#ifdef __cplusplus
}
#endif
#endif
