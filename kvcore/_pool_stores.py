"""A pool's side of its prefix stores: the lookups after an allocate, the
prefetches, flushing, waiting and closing (``BlockPool(..., stores=[...])``,
docs/stores.md).

The spill path needs nothing from here: the pool's bookkeeping publishes
eviction records on the store port and the stores consume them.  A lookup
goes the other way, and here the pool asks and the stores answer: which
following blocks they hold (``StoreTiers.find``), their verified entries
(``StoreTiers.fetch``), then the pool copies the payloads into the
sequence's fresh blocks itself (``StorePort.import_blocks``, computing the
checksums on the way) and keeps the blocks up to the first mismatch.
"""
import weakref

import numpy as np

from . import hashing
from ._forksafe import LEAF, fork_guard
from .stores._tiers import StoreTiers
from .stores._worker import Prefetch, Worker, deadline_of, on_worker_thread, time_left

#: blocks a prefetch loads per step (between steps it may be cancelled, and
#: an allocate of the prompt finds the blocks of the steps done)
PREFETCH_STEP = 16


class PoolStores:
    """What a pool does with its prefix stores (``pool._stores``)."""

    def __init__(self, pool, port, stores):
        self._pool = weakref.ref(pool)
        self.port = port
        self.tiers = StoreTiers(port, stores)
        self._bs = port.block_size
        self._fetcher = Worker("kvcore-store-prefetch")
        self._prefetches = weakref.WeakSet()
        fork_guard(self, None, LEAF)

    @property
    def stores(self):
        return self.tiers.stores

    def stats(self):
        return self.tiers.stats()

    def emit_warnings(self):
        """Issue the StoreWarnings owed to the caller (see ``_ledger``)."""
        self.tiers.ledger.emit_warnings()

    def probe_blocks(self, hash_words, first, stop):
        return self.tiers.probe_blocks(hash_words, first, stop)

    # ------------------------------------------------------------ lookup
    def load_prefix(self, seq, hit):
        """After ``seq`` (a ``SeqCore`` just allocated) hit ``hit`` tokens in
        the pool: copy the following blocks the stores hold into its fresh
        blocks and have it adopt them (they enter the prefix cache, counted
        as hits), then publish what the allocate evicted (after the lookup,
        which it must not push out).  Returns the new hit.  Store failures
        are misses; a warning raised as an error (``-W error``) undoes the
        allocate (nothing registered, nothing counted) and propagates."""
        held = seq.take_held_records()
        try:
            loaded = self._load(seq, hit)
        except BaseException:
            # (_load turns every Exception into a miss: this is a
            # KeyboardInterrupt or SystemExit in a store's lookup, e.g. a
            # Ctrl-C while Redis is slow) the allocate is undone, as below
            try:
                self.port.publish(held)
            finally:
                seq.unallocate()
            raise
        self.port.publish(held)
        try:
            self.emit_warnings()
        except BaseException:
            seq.unallocate()
            raise
        if loaded:
            hit = seq.adopt_loaded(len(loaded))
            self.tiers.count_loaded(loaded, self._bs)
        return hit

    def _load(self, seq, hit):
        """[(store, entry bytes)] of the blocks after the hit loaded into
        ``seq``'s fresh blocks, in order (nothing adopted yet).  Never raises."""
        tiers = self.tiers
        try:
            bs = self._bs
            first, stop = hit // bs, (seq.num_tokens - 1) // bs
            if first >= stop:
                return []
            hb = seq.hash_words().astype("<u8").tobytes()
            salt = seq.salt
            if self._prefetches:
                self._overtake(hb[:16], salt)
            segments = tiers.find(hb, first, stop)
            if not segments:
                return []
            root = np.array(hashing.root_words(salt), "<u8").tobytes()
            # what a hit entry must carry: the identity digests the blocks
            # will register with (computed once, by the sequence's bookkeeping)
            idents = seq.identities(first, segments[-1][2])
            table = seq.table
            owners = []
            for got in tiers.fetch(segments, hb, root, seq.token_ids(), idents, bs):
                if got.blocks:
                    # the checksums are computed while the payloads are
                    # copied into the (fresh, not yet adopted) blocks
                    try:
                        digests = self.port.import_blocks(
                            table[got.blocks[0]:got.blocks[-1] + 1], got.payloads,
                            seeds=got.seeds)
                    except Exception as e:  # the blocks stay fresh, not adopted
                        tiers.ledger.fail(got.store, e, op="import")
                        break
                    ok = tiers.check_loaded(got, digests)
                    owners.extend((got.store, size) for size in got.sizes[:ok])
                if not got.complete:
                    break
            return owners
        except Exception as e:  # a bug must not reach allocate's caller
            tiers.ledger.fail(0, e, op="load")
            return []

    # ------------------------------------------------------------ prefetch
    def prefetch(self, tokens, salt):
        """``BlockPool.prefetch`` (arguments checked): a handle, the loading
        queued for the prefetch worker."""
        handle = Prefetch()
        if tokens.shape[0] > self._bs:
            handle._key = (hashing.block_hashes(tokens[:self._bs], self._bs, salt)[0], salt)
        self._prefetches.add(handle)
        self._fetcher.submit(lambda: self._prefetch(handle, tokens, salt))
        return handle

    def _overtake(self, first_hash, salt):
        """An allocate is loading a prompt itself: a prefetch of the same
        prompt (same first block, same salt) still running stops after its
        current step, so that the two do not fetch the same blocks twice
        (what the prefetch loaded stays cached).  A false match costs only
        a cancelled prefetch."""
        for h in list(self._prefetches):
            if h._key == (first_hash, salt) and not h.done() and not on_worker_thread():
                h.cancel()

    def _prefetch(self, handle, tokens, salt):
        """The prefetch worker's job: find the run of the prompt's blocks the
        stores hold, then load it ``PREFETCH_STEP`` blocks at a time, each
        step an allocate (hitting the steps before it in the prefix cache,
        loading the next blocks from the stores) and a free, which leaves
        the loaded blocks cached and evictable."""
        try:
            if not handle._begin():
                return
            pool = self._pool()
            if pool is None:
                return
            bs = self._bs
            probe = pool.probe(tokens, salt)
            ready = (probe["hit_tokens"] - probe.get("store_hit_tokens", 0)) // bs
            target = probe["hit_tokens"] // bs
            handle.blocks_ready = ready
            while ready < target and not handle.cancelled():
                upto = min(target, ready + PREFETCH_STEP)
                seq = pool._sequence_core(None, salt)
                try:
                    hit = seq.allocate(tokens[:upto * bs + 1])
                    if hit < 0:
                        break   # the pool is full: what is ready stays ready
                    hit = self.load_prefix(seq, hit) // bs
                finally:
                    seq.free()
                handle.blocks_ready = max(ready, hit)
                if hit < upto:
                    break   # an entry went or failed verification: the rest is computed
                ready = hit
        except Exception as e:  # never reaches the worker's loop
            self.tiers.ledger.fail(0, e, op="prefetch")
        finally:
            handle._finish()

    def _after_fork_child(self):
        """The prefetches in flight or queued belong to the parent, whose
        worker thread is not in this child: each is cancelled and done."""
        for h in list(self._prefetches):
            h._after_fork_child()

    # ------------------------------------------------------------ draining
    def wait_spills(self, timeout):
        return self.tiers.wait_spills(timeout)

    def flush(self, timeout):
        """``BlockPool.flush_to_stores``: wait for the queued spills, then
        write every cached block to the stores from this thread (the pool's
        lock held only while they are copied out).  Returns how many blocks
        some store took."""
        self.tiers.wait_spills(timeout)
        return self.tiers.write_now(self.port.cached_records())

    def close(self, timeout):
        """``BlockPool.close``: cancel the prefetches, write the queued
        spills, stop the workers, all within ``timeout`` seconds (None: no
        limit); True unless spills had to be dropped (or a prefetch was still
        copying) at the deadline."""
        deadline = deadline_of(timeout)
        for h in list(self._prefetches):
            h.cancel()
        fetched = self._fetcher.stop(time_left(deadline))
        return self.tiers.close(time_left(deadline)) and fetched
