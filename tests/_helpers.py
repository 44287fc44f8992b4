"""Helpers shared by the tests (not fixtures: plain functions)."""


def pool_snapshot(pool, cached_tokens=False):
    """Everything observable about a pool: its bookkeeping (the documented
    ``BlockPool.debug_snapshot``), its storage bytes and, with
    ``cached_tokens``, the token ids every cached block is registered with.
    Two snapshots are equal iff nothing observable changed."""
    snap = pool.debug_snapshot()
    snap["num_used_blocks"] = pool.num_used_blocks
    snap["num_cached_blocks"] = pool.num_cached_blocks
    snap["storage"] = pool.storage.tobytes()
    if cached_tokens:
        snap["cached_tokens"] = [pool.debug_cached_block(b)[0].tolist() if cached else None
                                 for b, cached in enumerate(snap["cached"])]
    return snap


def cached_hash_bytes(pool, block_id):
    """The 16-byte hash a cached block is registered with (as block_hashes gives it)."""
    lo, hi = pool.debug_cached_block(block_id)[1]
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
