/*
 * convert_fp8.cu: float32 <-> fp8 (FMT 0 = e4m3fn, 1 = e5m2) of contiguous
 * arrays (the host makes contiguous temporaries for any other layout).
 *
 * The rules (kv_f32_to_fp8_one, kv_fp8_to_f32_one) live in kv_fp8.cuh,
 * shared with lowprec.cu: those of kvcore/backends/cpu/csrc/kv_fp8.h, in
 * integer arithmetic on the bits.
 *
 * KV_FP8_PER_ROW elements per row (one thread): rows = ceil(n / 4).
 */
#include "kv_fp8.cuh"

enum { KV_FP8_PER_ROW = 4 };

template <int FMT, int SAT>
KV_HD void kv_f32_to_fp8_item(kv_i64 row, kv_i64 /* chunk */, kv_u8 *dst, const kv_u32 *src,
                              kv_i64 n)
{
    kv_i64 end = row * KV_FP8_PER_ROW + KV_FP8_PER_ROW;
    for (kv_i64 i = row * KV_FP8_PER_ROW; i < end && i < n; ++i)
        dst[i] = kv_f32_to_fp8_one<FMT, SAT>(src[i]);
}

template <int FMT>
KV_HD void kv_fp8_to_f32_item(kv_i64 row, kv_i64 /* chunk */, kv_u32 *dst, const kv_u8 *src,
                              kv_i64 n)
{
    kv_i64 end = row * KV_FP8_PER_ROW + KV_FP8_PER_ROW;
    for (kv_i64 i = row * KV_FP8_PER_ROW; i < end && i < n; ++i)
        dst[i] = kv_fp8_to_f32_one<FMT>(src[i]);
}

#ifndef KVCORE_HOST_EMULATION
template <int FMT, int SAT>
__global__ void kv_f32_to_fp8(kv_i64 rows, kv_i64 chunks, kv_u8 *dst, const kv_u32 *src, kv_i64 n)
{
    KV_ROW_LOOP(rows, chunks, (kv_f32_to_fp8_item<FMT, SAT>(row, chunk, dst, src, n)));
}

template <int FMT>
__global__ void kv_fp8_to_f32(kv_i64 rows, kv_i64 chunks, kv_u32 *dst, const kv_u8 *src, kv_i64 n)
{
    KV_ROW_LOOP(rows, chunks, kv_fp8_to_f32_item<FMT>(row, chunk, dst, src, n));
}
#endif /* KVCORE_HOST_EMULATION */
