/*
 * The attention's default level on a CPU whose amx level is supported
 * (built with -DKVS_TEST_ASSUME_AMX, tests/test_attention_amx_emulated.py):
 * the default is amx unless KVCORE_SIMD caps it below.  Prints "default
 * <level>, best below amx <level>, amx <0|1>".
 */
#include "kv_attention.h"

#include <stdio.h>

int main(void)
{
    int below = KVA_SCALAR;
    for (int l = 0; l < KVA_NUM_LEVELS; l++)
        if (l != KVA_AMX && kva_level_supported(l))
            below = l;
    printf("default %s, best below amx %s, amx %d\n", kva_level_name(kva_default_level()),
           kva_level_name(below), kva_level_supported(KVA_AMX));
    return 0;
}
