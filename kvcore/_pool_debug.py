"""A pool's introspection (``pool.debug``) and the checked lock of a debug
build: what tests and debugging read, apart from the user's ``BlockPool``."""
import threading

__all__ = ["PoolDebug", "CheckedLock"]


class CheckedLock:
    """The pool lock of a debug build (KVCORE_DEBUG=1): leaving the outermost
    hold re-verifies every invariant of the bookkeeping, so a broken
    operation is caught at the call that broke it."""

    def __init__(self, core):
        self._lock = threading.RLock()
        self._core = core
        self._depth = 0

    def acquire(self, blocking=True, timeout=-1):
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._depth += 1
        return got

    def release(self):
        self._depth -= 1
        try:
            if self._depth == 0:
                self._core.check()
        finally:
            self._lock.release()

    def _at_fork_reinit(self):
        # (kvcore._forksafe: a forked child whose parent's thread held it)
        self._lock._at_fork_reinit()
        self._depth = 0

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class PoolDebug:
    """Introspection of a :class:`kvcore.BlockPool` (``pool.debug``), mainly
    for tests, like vLLM's ``get_all_free_blocks``."""

    def __init__(self, pool):
        self._pool = pool

    def check(self):
        """Verify the bookkeeping's internal invariants (raises AssertionError)."""
        with self._pool._lock:
            return self._pool._core.check()

    def snapshot(self):
        """The whole bookkeeping state, as plain Python values: comparing
        two snapshots shows whether an operation changed anything.

        Returns
        -------
        dict
            ``ref_counts`` (list, per block), ``cached`` (list of bools, per
            block), ``lru_order`` (the cached blocks nobody holds, least
            recently used first: evicted in this order), ``num_free_blocks``,
            ``num_uncached_free`` (free blocks outside the prefix cache) and
            ``stats`` (``pool.stats()``).
        """
        pool = self._pool
        with pool._lock:
            core = pool._core
            n = pool.num_blocks
            return {
                "ref_counts": [int(core.ref_count(b)) for b in range(n)],
                "cached": [bool(core.is_cached(b)) for b in range(n)],
                "lru_order": list(core.lru_order()),
                "num_free_blocks": int(core.num_free),
                "num_uncached_free": int(core.num_uncached_free),
                "stats": pool.stats(),
            }

    def cached_block(self, block_id):
        """``(token_ids, hash)`` a cached block is registered with (token ids
        an int32 array, hash two ints); raises ValueError for a block that
        is not cached."""
        pool = self._pool
        b = pool._block_id(block_id)
        with pool._lock:
            if not pool._core.is_cached(b):
                raise ValueError(f"block {b} is not in the prefix cache")
            lo, hi = pool._core.cached_hash(b)
            return pool._core.cached_tokens(b).copy(), (int(lo), int(hi))

    def cached_block_ids(self):
        """The ids of the blocks in the prefix cache now (int32, ascending)."""
        with self._pool._lock:
            return self._pool._core.cached_blocks()
