/* The NEON kernels of kv_xxh3.c (AArch64, where NEON is part of the base
 * ISA): the eight 64-bit accumulators in four 128-bit registers. */
#include "kv_xxh3_internal.h"

#ifdef KV_XXH3_HAVE_NEON
#include <arm_neon.h>

void kv_xxh3_stripes_neon(uint64_t* acc, const unsigned char* src, unsigned char* dst,
                          size_t n_stripes, const unsigned char* secret) {
    uint64x2_t a[4];
    for (int k = 0; k < 4; k++)
        a[k] = vld1q_u64(acc + 2 * k);
    for (size_t s = 0; s < n_stripes; s++, src += 64, secret += 8) {
        for (int k = 0; k < 4; k++) {
            uint8x16_t bytes = vld1q_u8(src + 16 * k);
            if (dst)
                vst1q_u8(dst + 16 * k, bytes);   /* the copy rides on the hash's loads */
            uint64x2_t d = vreinterpretq_u64_u8(bytes);
            uint64x2_t dk = veorq_u64(d, vreinterpretq_u64_u8(vld1q_u8(secret + 16 * k)));
            /* acc += lo32(dk) * hi32(dk); lane i ^ 1 takes lane i of the data */
            a[k] = vmlal_u32(a[k], vmovn_u64(dk), vshrn_n_u64(dk, 32));
            a[k] = vaddq_u64(a[k], vextq_u64(d, d, 1));
        }
        if (dst)
            dst += 64;
    }
    for (int k = 0; k < 4; k++)
        vst1q_u64(acc + 2 * k, a[k]);
}

void kv_xxh3_scramble_neon(uint64_t* acc, const unsigned char* secret) {
    const uint32x2_t prime = vdup_n_u32(KV_XXH_PRIME32_1);
    for (int k = 0; k < 4; k++) {
        uint64x2_t a = vld1q_u64(acc + 2 * k);
        a = veorq_u64(a, vshrq_n_u64(a, 47));
        a = veorq_u64(a, vreinterpretq_u64_u8(vld1q_u8(secret + 16 * k)));
        /* the 64x32-bit product from two 32x32 ones */
        uint64x2_t lo = vmull_u32(vmovn_u64(a), prime);
        uint64x2_t hi = vmull_u32(vshrn_n_u64(a, 32), prime);
        vst1q_u64(acc + 2 * k, vaddq_u64(lo, vshlq_n_u64(hi, 32)));
    }
}
#endif
