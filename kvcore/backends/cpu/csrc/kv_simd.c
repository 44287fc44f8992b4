/*
 * kv_simd.c: see kv_simd.h.  Detection and the cap are computed at the
 * first call and cached; both are idempotent, so a race between two first
 * callers only repeats the same work.
 */
/* syscall() (the AMX permission request) is declared by glibc's unistd.h
 * only outside strict ISO C; some C checks build this file with -std=c99 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include "kv_simd.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define KVS_X86 1
#else
#define KVS_X86 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define KVS_NEON_ON 1
#else
#define KVS_NEON_ON 0
#endif

#define KVS_NAME_ENTRY(id, name) name,
static const char *const kvs_names[KVS_NUM_LEVELS] = {KVS_LEVELS(KVS_NAME_ENTRY)};
#undef KVS_NAME_ENTRY

const char *kvs_level_name(int level)
{
    return level >= 0 && level < KVS_NUM_LEVELS ? kvs_names[level] : NULL;
}

#if KVS_X86 && defined(__GNUC__)
/* XCR0 bits: 1 SSE, 2 AVX (ymm upper halves), 5 opmask, 6 ZMM_Hi256 (zmm0-15
 * upper halves), 7 Hi16_ZMM (zmm16-31). */
#define KVS_XCR0_ZMM 0xE6u

/* Whether the OS saves and restores every state component of `mask` on a
 * context switch (XCR0 holds them all).  __builtin_cpu_supports reports the
 * CPU's instructions; whether the OS enabled their registers is XCR0's. */
static int os_saves(unsigned mask)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE))
        return 0; /* no XGETBV: the OS enabled no extended state */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0)); /* XCR0 */
    (void)hi;
    return (lo & mask) == mask;
}

#ifndef KVS_TEST_ASSUME_AMX
/* XCR0: the register state the OS saves (only after CPUID said OSXSAVE) */
__attribute__((target("xsave"))) static unsigned long long xcr0(void)
{
    return _xgetbv(0);
}
#endif

/* AMX-TILE + AMX-BF16 + AVX-512 F/BW/VL/DQ/VBMI in the CPU, their register state
 * enabled by the OS, and (Linux) this process granted the tile data. */
static int detect_amx(void)
{
#ifdef KVS_TEST_ASSUME_AMX
    /* test builds only (tests/c): the tile instructions are emulated */
    return 1;
#else
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) /* OSXSAVE */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    const unsigned avx512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F DQ BW VL */
    const unsigned amx = (1u << 22) | (1u << 24);                             /* BF16 TILE */
    if ((b & avx512) != avx512 || (d & amx) != amx || !(c & (1u << 1))) /* VBMI */
        return 0;
    /* SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM; XTILECFG, XTILEDATA */
    const unsigned long long state = (1u << 1) | (1u << 2) | (7u << 5) | (3u << 17);
    if ((xcr0() & state) != state)
        return 0;
#ifdef __linux__
    /* Linux 5.16+ hands out the 8 KB tile state on request only; an older
     * kernel (EINVAL) or a refusal (EPERM) leaves the level unsupported.
     * The grant is per process and idempotent: a repeated detection (two
     * first callers, or another extension module's copy of this file)
     * only asks again. */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                18 /* XFEATURE_XTILEDATA */) != 0)
        return 0;
    return 1;
#else
    return 0; /* no way here to know the OS grants the tile data */
#endif
#endif
}
#endif

static int detect(int level)
{
    if (level == KVS_SCALAR)
        return 1;
#ifdef KVS_TEST_EMULATE
    /* test builds only (tests/attention/test_attention_avx512.py): the level whose
     * kernels were compiled against SIMDe, runnable on any CPU */
    if (level == KVS_TEST_EMULATE)
        return 1;
#endif
#if KVS_X86 && defined(__GNUC__)
    __builtin_cpu_init();
    switch (level) {
    case KVS_F16C:
        return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") &&
               __builtin_cpu_supports("sse4.1");
    case KVS_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case KVS_AVX512:
        return detect(KVS_AVX2) && os_saves(KVS_XCR0_ZMM) &&
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case KVS_AMX:
        return detect_amx();
    default:
        return 0;
    }
#else
    return level == KVS_NEON && KVS_NEON_ON;
#endif
}

/* bit l: level l is supported; -1 until detected */
static int kvs_supported_mask = -1;

int kvs_level_supported(int level)
{
    if (level < 0 || level >= KVS_NUM_LEVELS)
        return 0;
    int mask = __atomic_load_n(&kvs_supported_mask, __ATOMIC_RELAXED);
    if (mask < 0) {
        mask = 0;
        for (int l = 0; l < KVS_NUM_LEVELS; l++)
            if (detect(l))
                mask |= 1 << l;
        __atomic_store_n(&kvs_supported_mask, mask, __ATOMIC_RELAXED);
    }
    return (mask >> level) & 1;
}

int kvs_best_level(void)
{
    int best = KVS_SCALAR;
    for (int l = 1; l < KVS_NUM_LEVELS; l++)
        if (kvs_level_supported(l))
            best = l;
    return best;
}

static char kvs_text[64];
static int kvs_cap_value = -2; /* -2: not read yet */

int kvs_cap(void)
{
    int cap = __atomic_load_n(&kvs_cap_value, __ATOMIC_ACQUIRE);
    if (cap != -2)
        return cap;
    const char *env = getenv("KVCORE_SIMD");
    char text[64];
    size_t n = 0;
    if (env != NULL) {
        while (*env && isspace((unsigned char)*env))
            env++;
        size_t len = strlen(env);
        while (len > 0 && isspace((unsigned char)env[len - 1]))
            len--;
        for (; n < len && n < sizeof text - 1; n++)
            text[n] = (char)tolower((unsigned char)env[n]);
        /* a value longer than the buffer names no level */
        cap = len >= sizeof text ? -1 : KVS_NUM_LEVELS - 1;
    } else {
        cap = KVS_NUM_LEVELS - 1;
    }
    text[n] = '\0';
    if (n > 0 && cap >= 0) {
        cap = -1;
        for (int l = 0; l < KVS_NUM_LEVELS; l++)
            if (strcmp(text, kvs_names[l]) == 0)
                cap = l;
    }
    memcpy(kvs_text, text, n + 1);
    __atomic_store_n(&kvs_cap_value, cap, __ATOMIC_RELEASE);
    return cap;
}

const char *kvs_cap_text(void)
{
    kvs_cap();
    return kvs_text;
}

int kvs_default_level(void)
{
    int cap = kvs_cap();
    if (cap < 0)
        return KVS_SCALAR;
    while (cap > 0 && !kvs_level_supported(cap))
        cap--;
    return cap;
}
