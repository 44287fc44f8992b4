/*
 * contiguous.cu: writes into a contiguous (batch, heads, max_seq_len, dim)
 * cache.  Strides in elements, last axes contiguous; SK/DK/V as in paged.cu.
 * Host-side checks: rows < 2^31.
 */
#include "kv_half.cuh"

/* The parameters kv_write_contiguous passes on to its item, written once. */
#define KV_WRITE_CONTIGUOUS_PARAMS                                                        \
    typename KvStorage<DK>::type *dst, const typename KvStorage<SK>::type *src,           \
        kv_i64 heads, kv_i64 n, kv_i64 start, kv_i64 s_batch, kv_i64 s_head,              \
        kv_i64 s_tok, kv_i64 d_batch, kv_i64 d_head, kv_i64 d_tok
#define KV_WRITE_CONTIGUOUS_ARGS                                                          \
    dst, src, heads, n, start, s_batch, s_head, s_tok, d_batch, d_head, d_tok

/* dst[b, h, start + t, :] = convert(src[b, h, t, :]), t in [0, n).
 * rows = batch * heads * n (row = (b * heads + h) * n + t). */
template <int SK, int DK, int V>
KV_HD void kv_write_contiguous_item(kv_i64 row, kv_i64 chunk, KV_WRITE_CONTIGUOUS_PARAMS)
{
    kv_u32 r = (kv_u32)row, nn = (kv_u32)n, nh = (kv_u32)heads;
    kv_u32 bh = r / nn, t = r - bh * nn;
    kv_u32 b = bh / nh, h = bh - b * nh;
    kv_convert_run<SK, DK, V>(src + b * s_batch + h * s_head + t * s_tok + chunk * V,
                              dst + b * d_batch + h * d_head + (start + t) * d_tok + chunk * V);
}

#ifndef KVCORE_HOST_EMULATION
template <int SK, int DK, int V>
__global__ void kv_write_contiguous(kv_i64 rows, kv_i64 chunks, KV_WRITE_CONTIGUOUS_PARAMS)
{
    KV_ROW_LOOP(rows, chunks,
                kv_write_contiguous_item<SK, DK, V>(row, chunk, KV_WRITE_CONTIGUOUS_ARGS));
}
#endif /* KVCORE_HOST_EMULATION */
