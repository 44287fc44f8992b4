/*
 * Test-only: what SIMDe 0.8.2 leaves out of its native aliases for the
 * AVX-512 attention kernels (kv_attn_avx512.c) when they are compiled
 * against it (tests/test_attention_avx512.py, -include this file).
 * Written from Intel's intrinsic descriptions; nothing here is in a
 * wheel.
 */
#ifndef KV_SIMDE_SHIM_H
#define KV_SIMDE_SHIM_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* _MM_FROUND_NO_EXC: suppress the exceptions of a rounding (immediate bit 3). */
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

#endif
