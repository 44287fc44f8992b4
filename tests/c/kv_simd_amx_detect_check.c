/*
 * kv_simd.c's amx detection against a made-up CPU and OS: kv_simd.c is
 * compiled with -include tests/c/kv_simd_fake_cpu.h, which stands in for
 * CPUID, XGETBV and the Linux arch_prctl request (the real ones cannot be
 * changed from a test).  Scenario (argv[1]), one process each since the
 * registry detects once:
 *   granted   everything present, the request granted: amx supported
 *   refused   the kernel refuses the tile data (EPERM): not supported
 *   oldkernel the kernel does not know the request (EINVAL): not supported
 *   noxcr0    the OS does not save the tile state: no request made
 *   nobf16    the CPU lacks AMX-BF16: no request made
 * Also: the conversions (kv_half.c) never run a level past their own.
 * Prints "<scenario>: amx <0|1>, requests <n>, conversions <level>".
 */
#include "kv_half.h"
#include "kv_simd.h"

#include <stdio.h>
#include <string.h>

extern int fake_scenario, fake_requests;

int main(int argc, char **argv)
{
    static const char *const names[] = {"granted", "refused", "oldkernel", "noxcr0", "nobf16"};
    fake_scenario = -1;
    for (int i = 0; i < 5; i++)
        if (argc > 1 && strcmp(argv[1], names[i]) == 0)
            fake_scenario = i;
    if (fake_scenario < 0)
        return 2;
    int amx = kvs_level_supported(KVS_AMX);
    /* detection is once: asking again makes no second request */
    amx &= kvs_level_supported(KVS_AMX);
    int conv = kvh_default_level();
    printf("%s: amx %d, requests %d, conversions %s, best %s\n", argv[1], amx, fake_requests,
           kvh_level_name(conv), kvh_level_name(kvh_best_level()));
    return 0;
}
