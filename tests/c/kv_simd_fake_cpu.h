/*
 * Force-included (-include) before kv_simd.c by tests/c/kv_simd_amx_detect_check.c's
 * build: CPUID leaf 7, XGETBV and syscall() answer as the scenario says.
 * The system headers come first, so kv_simd.c's own includes are no-ops
 * and its calls reach the fakes below.
 */
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

int fake_scenario, fake_requests;

static int fake_get_cpuid_count(unsigned leaf, unsigned sub, unsigned *a, unsigned *b,
                                unsigned *c, unsigned *d)
{
    *a = *b = *c = *d = 0;
    __get_cpuid_count(leaf, sub, a, b, c, d);
    if (leaf == 1)
        *c |= 1u << 27; /* OSXSAVE */
    if (leaf == 7 && sub == 0) {
        *b |= (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
        *c |= 1u << 1; /* AVX-512 VBMI */
        *d |= 1u << 24;
        if (fake_scenario != 4)
            *d |= 1u << 22;
        else
            *d &= ~(1u << 22);
    }
    return 1;
}

static int fake_get_cpuid(unsigned leaf, unsigned *a, unsigned *b, unsigned *c, unsigned *d)
{
    return fake_get_cpuid_count(leaf, 0, a, b, c, d);
}

static unsigned long long fake_xgetbv(unsigned index)
{
    (void)index;
    unsigned long long v = (1u << 0) | (1u << 1) | (1u << 2) | (7u << 5);
    return fake_scenario == 3 ? v : v | (3u << 17);
}

static long fake_syscall(long number, ...)
{
    if (number != SYS_arch_prctl)
        return -1;
    fake_requests++;
    if (fake_scenario == 1 || fake_scenario == 2) {
        errno = fake_scenario == 1 ? EPERM : EINVAL;
        return -1;
    }
    return 0;
}

#define __get_cpuid fake_get_cpuid
#define __get_cpuid_count fake_get_cpuid_count
#define _xgetbv fake_xgetbv
#define syscall fake_syscall
