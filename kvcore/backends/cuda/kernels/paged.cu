/*
 * paged.cu: one layer's K or V plane of a block pool.
 *
 * cache is (num_blocks, heads, block_size, dim) with its last axis
 * contiguous; every stride below is in elements.  SK/DK are the element
 * kinds of source and destination (kv_half.cuh), V the elements per chunk:
 * 1 (scalar path) or a 16-byte vector run (8 halves / 4 floats, chosen by the
 * host when dim, the strides and the pointers allow).  Host-side checks:
 * rows < 2^31, positions < 2^31 (so index splitting can use 32-bit
 * division), block ids in range; slots are range-checked here too.
 */
#include "kv_half.cuh"

/* The parameters each kernel passes on to its item, written once. */
#define KV_WRITE_SLOTS_PARAMS                                                             \
    typename KvStorage<DK>::type *cache, const typename KvStorage<SK>::type *src,         \
        const kv_i64 *slots, const kv_i32 *owner, kv_i64 num_slots, kv_i64 heads,         \
        kv_i64 block_size, kv_i64 src_tok, kv_i64 src_head,                               \
        kv_i64 c_block, kv_i64 c_head, kv_i64 c_tok
#define KV_WRITE_SLOTS_ARGS                                                               \
    cache, src, slots, owner, num_slots, heads, block_size, src_tok, src_head,            \
        c_block, c_head, c_tok
#define KV_GATHER_PARAMS                                                                  \
    typename KvStorage<DK>::type *out, const typename KvStorage<SK>::type *cache,         \
        const kv_i32 *table, kv_i64 start, kv_i64 n, kv_i64 block_size,                   \
        kv_i64 c_block, kv_i64 c_head, kv_i64 c_tok, kv_i64 o_head, kv_i64 o_tok
#define KV_GATHER_ARGS                                                                    \
    out, cache, table, start, n, block_size, c_block, c_head, c_tok, o_head, o_tok
#define KV_GATHER_BATCH_PARAMS                                                            \
    typename KvStorage<DK>::type *out, const typename KvStorage<SK>::type *cache,         \
        const kv_i32 *tables, const kv_i32 *lens, kv_i64 heads, kv_i64 max_len,           \
        kv_i64 table_stride, kv_i64 block_size, kv_i64 c_block, kv_i64 c_head,            \
        kv_i64 c_tok, kv_i64 o_seq, kv_i64 o_head, kv_i64 o_tok
#define KV_GATHER_BATCH_ARGS                                                              \
    out, cache, tables, lens, heads, max_len, table_stride, block_size,                   \
        c_block, c_head, c_tok, o_seq, o_head, o_tok

/* cache[b, h, off, :] = convert(src[t, h, :]) for slots[t] = b * block_size
 * + off.  rows = n * heads (row = t * heads + h).  A slot outside
 * 0..num_slots-1 is skipped: -1 by definition, any other value because the
 * host or the claim pass (slots.cu) has refused it, or because the caller
 * asked for an unchecked write: either way nothing outside the cache is
 * ever written.  With an owner table (slots.cu; null when the slots are
 * known to be distinct) a token writes only a slot it owns, so of several
 * tokens naming one slot the last one's values land, as on the CPU. */
template <int SK, int DK, int V>
KV_HD void kv_write_slots_item(kv_i64 row, kv_i64 chunk, KV_WRITE_SLOTS_PARAMS)
{
    kv_u32 t, h;
    kv_i64 slot = kv_slot_of_row(row, heads, slots, owner, num_slots, &t, &h);
    if (slot < 0)
        return;
    kv_i64 b, off;
    if (slot <= 0x7fffffffLL) {
        kv_u32 s = (kv_u32)slot, bs = (kv_u32)block_size, q = s / bs;
        b = q;
        off = s - q * bs;
    } else {
        b = slot / block_size;
        off = slot - b * block_size;
    }
    kv_convert_run<SK, DK, V>(src + t * src_tok + h * src_head + chunk * V,
                              cache + b * c_block + h * c_head + off * c_tok + chunk * V);
}

/* out[h, t, :] = convert(cache[table[p / bs], h, p % bs, :]), p = start + t,
 * t in [0, n).  rows = heads * n (row = h * n + t): neighbouring rows are
 * neighbouring positions, contiguous on both sides within a block. */
template <int SK, int DK, int V>
KV_HD void kv_gather_item(kv_i64 row, kv_i64 chunk, KV_GATHER_PARAMS)
{
    const KvGatherAt a = kv_gather_at(row, n, start, block_size, table);
    kv_convert_run<SK, DK, V>(cache + a.b * c_block + a.h * c_head + a.off * c_tok + chunk * V,
                              out + a.h * o_head + a.t * o_tok + chunk * V);
}

/* A batch of sequences into one padded output:
 * out[s, h, t, :] = convert(cache[tables[s, t / bs], h, t % bs, :]) for
 * t < lens[s], and +0 for lens[s] <= t < max_len (padding is written, so an
 * attention kernel that masks it never meets stale NaNs).
 * tables is [batch, table_stride] int32; rows = batch * heads * max_len
 * (row = (s * heads + h) * max_len + t). */
template <int SK, int DK, int V>
KV_HD void kv_gather_batch_item(kv_i64 row, kv_i64 chunk, KV_GATHER_BATCH_PARAMS)
{
    kv_u32 s, h, t;
    kv_batch_row(row, heads, max_len, &s, &h, &t);
    typename KvStorage<DK>::type *dst = out + s * o_seq + h * o_head + t * o_tok + chunk * V;
    if ((kv_i64)t >= (kv_i64)lens[s]) {
        kv_zero_run<DK, V>(dst);
        return;
    }
    kv_u32 bs = (kv_u32)block_size, q = t / bs, off = t - q * bs;
    kv_i64 b = tables[s * table_stride + q];
    kv_convert_run<SK, DK, V>(cache + b * c_block + h * c_head + off * c_tok + chunk * V, dst);
}

#ifndef KVCORE_HOST_EMULATION
template <int SK, int DK, int V>
__global__ void kv_write_slots(kv_i64 rows, kv_i64 chunks, KV_WRITE_SLOTS_PARAMS)
{
    KV_ROW_LOOP(rows, chunks, kv_write_slots_item<SK, DK, V>(row, chunk, KV_WRITE_SLOTS_ARGS));
}

template <int SK, int DK, int V>
__global__ void kv_gather(kv_i64 rows, kv_i64 chunks, KV_GATHER_PARAMS)
{
    KV_ROW_LOOP(rows, chunks, kv_gather_item<SK, DK, V>(row, chunk, KV_GATHER_ARGS));
}

template <int SK, int DK, int V>
__global__ void kv_gather_batch(kv_i64 rows, kv_i64 chunks, KV_GATHER_BATCH_PARAMS)
{
    KV_ROW_LOOP(rows, chunks, kv_gather_batch_item<SK, DK, V>(row, chunk, KV_GATHER_BATCH_ARGS));
}
#endif /* KVCORE_HOST_EMULATION */
