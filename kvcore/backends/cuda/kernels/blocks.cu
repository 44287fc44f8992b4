/*
 * blocks.cu: whole-block copies for copy-on-write and for moving blocks
 * between two pools of the same geometry and dtype.
 *
 * A storage is (planes, num_blocks, heads, block_size, dim) with every block
 * one contiguous run of bytes; the host picks the widest word WB (16, 4, 2 or 1
 * bytes) that the block size, strides and base pointers allow.  No
 * conversion: blocks are copied bit for bit.
 */
#include "kv_half.cuh"

template <int WB> struct KvWord;
template <> struct KvWord<16> { typedef kv_vec16 type; };
template <> struct KvWord<4> { typedef kv_u32 type; };
template <> struct KvWord<2> { typedef kv_u16 type; };
template <> struct KvWord<1> { typedef unsigned char type; };

/* The parameters kv_copy_blocks passes on to its item, written once. */
#define KV_COPY_BLOCKS_PARAMS                                                             \
    typename KvWord<WB>::type *dst, const typename KvWord<WB>::type *src,                 \
        const kv_i32 *src_ids, const kv_i32 *dst_ids, kv_i64 n,                           \
        kv_i64 s_plane, kv_i64 s_block, kv_i64 d_plane, kv_i64 d_block
#define KV_COPY_BLOCKS_ARGS dst, src, src_ids, dst_ids, n, s_plane, s_block, d_plane, d_block

/* dst[p, dst_ids[i]] = src[p, src_ids[i]] for every plane p, word by word.
 * rows = planes * n (row = p * n + i), chunks = words per block; strides in
 * words.  The pairs run in parallel: no dst id may repeat or be a src id. */
template <int WB>
KV_HD void kv_copy_blocks_item(kv_i64 row, kv_i64 chunk, KV_COPY_BLOCKS_PARAMS)
{
    kv_u32 r = (kv_u32)row, nn = (kv_u32)n;
    kv_u32 p = r / nn, i = r - p * nn;
    typename KvWord<WB>::type *d = dst + p * d_plane + (kv_i64)dst_ids[i] * d_block + chunk;
    const typename KvWord<WB>::type *s = src + p * s_plane + (kv_i64)src_ids[i] * s_block + chunk;
    if constexpr (WB == 16)
        kv_store16(d, kv_load16(s));
    else
        *d = *s;
}

#ifndef KVCORE_HOST_EMULATION
template <int WB>
__global__ void kv_copy_blocks(kv_i64 rows, kv_i64 chunks, KV_COPY_BLOCKS_PARAMS)
{
    KV_ROW_LOOP(rows, chunks, kv_copy_blocks_item<WB>(row, chunk, KV_COPY_BLOCKS_ARGS));
}
#endif /* KVCORE_HOST_EMULATION */
