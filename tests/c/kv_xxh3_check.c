/* kv_xxh3.c on its own (tests/test_checksum_xxh3.py builds and runs it,
 * natively and for AArch64 under qemu): prints "n seed digest" for the
 * one-shot hash, the streamed hash (pieces of 1..97 bytes) and the copy of
 * every batch of one length over 1 and 3 threads, of the bytes
 * (i * 131 + 7) & 255; the test compares them with the xxhash package. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_simd.h"
#include "kv_xxh3.h"

static const uint64_t seeds[] = {0, 1, 0x9E3779B185EBCA87ULL, ~0ULL};

int main(void) {
    const size_t max = 5000;
    unsigned char* data = malloc(max + 4 * 70000);
    for (size_t i = 0; i < max + 4 * 70000; i++)
        data[i] = (unsigned char)((i * 131 + 7) & 255);
    int bad = 0;
    for (size_t n = 0; n <= max; n += (n < 1100 ? 1 : 61)) {
        for (int k = 0; k < 4; k++) {
            kv_xxh3_state s;
            kv_xxh3_init(&s, seeds[k], -1);
            kv_xxh3_update(&s, data, n);
            uint64_t one = kv_xxh3_digest(&s);
            kv_xxh3_init(&s, seeds[k], -1);
            for (size_t at = 0, step = 1; at < n; at += step, step = step % 97 + 13)
                kv_xxh3_update(&s, data + at, at + step > n ? n - at : step);
            if (kv_xxh3_digest(&s) != one)
                bad++;
            printf("%zu %llu %llu\n", n, (unsigned long long)seeds[k], (unsigned long long)one);
        }
    }
    /* 4 sources of 70000 bytes, copied as 7 chunks of 10000 into a strided dst */
    const unsigned char* srcs[4] = {data, data + 70000, data + 140000, data + 210000};
    size_t offsets[4] = {30000, 0, 20000, 10000};
    unsigned char* dst = calloc(7 * 40000, 1);
    kv_copy_part part = {dst, offsets, 7, 10000, 40000};
    uint64_t sd[4] = {5, 6, 7, 8}, d1[4], d3[4];
    kv_copy_xxh3_many(srcs, 4, &part, 1, sd, d1, -1, 1);
    kv_copy_xxh3_many(srcs, 4, &part, 1, sd, d3, -1, 3);
    for (int j = 0; j < 4; j++) {
        if (d1[j] != d3[j])
            bad++;
        for (int c = 0; c < 7; c++)
            if (memcmp(dst + offsets[j] + c * 40000, srcs[j] + c * 10000, 10000))
                bad++;
        printf("copy %d %llu %llu\n", j, (unsigned long long)sd[j], (unsigned long long)d1[j]);
    }
    printf("level %s\n", kvs_level_name(kv_xxh3_level(-1)));
    printf("%d mismatches\n", bad);
    free(dst);
    free(data);
    return bad != 0;
}
