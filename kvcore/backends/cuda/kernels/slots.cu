/*
 * slots.cu: the passes around BlockPool.write's paged writes (paged.cu).
 *
 * One write's rule, the CPU's (whose kernel walks the tokens in order): of
 * several tokens naming one slot, the last one's K and V land.  The GPU
 * writes every token and 16-byte chunk in parallel, so the pool keeps an
 * owner table, one int32 per slot, -1 when unclaimed:
 *
 *   kv_claim_slots     owner[slot] = the largest token index naming it
 *   kv_write_slots     (paged.cu, K and V) a token writes only a slot it owns
 *   kv_release_slots   owner[slot] = -1 again
 *
 * all on one stream, so each pass sees the previous one's stores.  Between
 * writes the table is all -1; a write touches only its own slots' entries,
 * so writes of disjoint slots may run on different streams.  Each layer has
 * a table of its own (writes.py's SlotOwners), made by kv_reset_owner on
 * the stream of the layer's first write: writes of different layers on
 * different streams never share one.
 *
 * The claim pass is also the range check of slots that live on the device:
 * the smallest token index whose slot is outside -1..num_slots-1 lands in
 * *bad (when bad is not null; the host sets *bad to KV_NO_BAD first).  Such
 * a slot is never claimed, and the write kernel skips it.
 *
 * One thread per token: rows = tokens, chunks = 1.
 */
#include "kv_half.cuh"

KV_HD void kv_claim_slots_item(kv_i64 row, kv_i64 chunk, kv_i32 *owner, kv_i64 *bad,
                               const kv_i64 *slots, kv_i64 num_slots)
{
    (void)chunk;
    kv_i64 slot = slots[row];
    if (slot < -1 || slot >= num_slots) {
        if (bad != 0)
            kv_atomic_min_nonneg_i64(bad, row);
        return;
    }
    if (slot >= 0)
        kv_atomic_max_i32(owner + slot, (kv_i32)row);
}

KV_HD void kv_release_slots_item(kv_i64 row, kv_i64 chunk, kv_i32 *owner,
                                 const kv_i64 *slots, kv_i64 num_slots)
{
    (void)chunk;
    kv_i64 slot = slots[row];
    if (slot >= 0 && slot < num_slots)
        owner[slot] = -1;
}

/* owner[row] = -1: a new table (rows = its slots). */
KV_HD void kv_reset_owner_item(kv_i64 row, kv_i64 chunk, kv_i32 *owner)
{
    (void)chunk;
    owner[row] = -1;
}

#ifndef KVCORE_HOST_EMULATION
__global__ void kv_reset_owner(kv_i64 rows, kv_i64 chunks, kv_i32 *owner)
{
    KV_ROW_LOOP(rows, chunks, kv_reset_owner_item(row, chunk, owner));
}

__global__ void kv_claim_slots(kv_i64 rows, kv_i64 chunks, kv_i32 *owner, kv_i64 *bad,
                               const kv_i64 *slots, kv_i64 num_slots)
{
    KV_ROW_LOOP(rows, chunks, kv_claim_slots_item(row, chunk, owner, bad, slots, num_slots));
}

__global__ void kv_release_slots(kv_i64 rows, kv_i64 chunks, kv_i32 *owner,
                                 const kv_i64 *slots, kv_i64 num_slots)
{
    KV_ROW_LOOP(rows, chunks, kv_release_slots_item(row, chunk, owner, slots, num_slots));
}
#endif /* KVCORE_HOST_EMULATION */
