/*
 * convert.cu: elementwise conversion of contiguous arrays (the host makes
 * contiguous temporaries for any other layout).  SK/DK/V as in paged.cu.
 */
#include "kv_half.cuh"

/* dst[i] = convert(src[i]) for i in [row * V, row * V + V) that are < n: whole
 * runs take the vector path, the last partial one goes element by element.
 * rows = ceil(n / V), one chunk per row. */
template <int SK, int DK, int V>
KV_HD void kv_convert_flat_item(kv_i64 row, kv_i64 /* chunk */,
                                typename KvStorage<DK>::type *dst,
                                const typename KvStorage<SK>::type *src, kv_i64 n)
{
    kv_i64 i = row * V;
    if (i + V <= n) {
        kv_convert_run<SK, DK, V>(src + i, dst + i);
    } else {
        for (; i < n; ++i)
            dst[i] = kv_convert<SK, DK>(src[i]);
    }
}

#ifndef KVCORE_HOST_EMULATION
template <int SK, int DK, int V>
__global__ void kv_convert_flat(kv_i64 rows, kv_i64 chunks,
                                typename KvStorage<DK>::type *dst,
                                const typename KvStorage<SK>::type *src, kv_i64 n)
{
    KV_ROW_LOOP(rows, chunks, kv_convert_flat_item<SK, DK, V>(row, chunk, dst, src, n));
}
#endif /* KVCORE_HOST_EMULATION */
