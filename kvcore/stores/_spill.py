"""The spill path: from the records a pool publishes to the stores' writes.

The pool publishes a ``BlockRecord`` for every cached block it evicts, on
its store port's record queue, its lock held (docs/stores.md, "The pool's
store port").  This module reads that queue right away, on the publishing
thread: each record is encoded as an entry for the first store
(``_format``); an in-memory first store (``HostStore``) takes it there and
then; everything that has to reach a store that does I/O (``DiskStore``,
``RedisStore``, a cluster; what a store drops to stay within capacity goes
to the next) is queued for the pool's store worker, which writes it off
every pool lock.  Until a queued entry is written, lookups find it here
(:meth:`SpillQueue.queued`).  The queue is bounded per store
(``max_pending_bytes``): when a slow store lets it fill up, the oldest
queued spills are dropped (counted as ``spills_dropped``; a dropped spill is
a later miss, never wrong data), so the threads using the pool are never
held up by a store.  What a store drops to stay within capacity goes to the
next, verified first (structure, checksum, HMAC): a store's bytes, e.g. a
file planted in a DiskStore's directory, never reach another store
unchecked.  A store that is down or whose put fails is passed over.
Nothing here calls the pool.
"""
import collections
import threading

import numpy as np

from . import _format
from .._forksafe import QUEUE, fork_guard
from ._worker import Worker, deadline_of, time_left
from .base import PrefixStore

#: bytes of spills queued for one store before the oldest are dropped (a
#: store's ``max_pending_bytes`` attribute overrides it)
MAX_PENDING_BYTES = PrefixStore.max_pending_bytes


class SpillQueue:
    """The spills of one pool's stores on their way down (see the module
    docstring): ``stores`` in order, each one's layout fingerprint and
    ``hmac_key`` (``fps``, ``hmacs``), the ``ledger`` that counts."""

    def __init__(self, stores, fps, hmacs, ledger):
        self._stores, self._fp, self._hmac, self._ledger = stores, fps, hmacs, ledger
        self._in_memory = [bool(getattr(s, "in_memory", False)) for s in stores]
        self._records = None             # the port's record queue (batches)
        self._room = None                # the entry header's room before each payload
        self._lock = threading.Lock()
        n = len(stores)
        # (store, items, bytes) batches in order; each queued or in-flight
        # entry is also in _overlay[store] (key -> value) for lookups
        self._queue = collections.deque()
        self._queued_bytes = [0] * n
        self._overlay = [{} for _ in range(n)]
        self._in_flight = None           # the batch the worker is writing
        self._draining = False
        self._worker = Worker("kvcore-store-spill")
        fork_guard(self, "_lock", QUEUE)

    # ------------------------------------------------------------ consuming
    def consume(self, port):
        """Read the records ``port`` publishes (:meth:`take_records`, woken
        by each publish)."""
        self._records = port.listen(self.take_records)
        # the port leaves room for the entry header before each payload: an
        # entry is header + payload in place, the payload copied once (out
        # of the pool), not twice
        self._room = port.headroom = _format.header_size(port.block_size, self._hmac[0])

    def take_records(self):
        """Read the port's record queue (its publisher's thread, the pool's
        lock maybe held): encode each batch for the first store and send it
        down.  Never raises, never waits on a store that does I/O."""
        while True:
            try:
                batch = self._records.popleft()
            except IndexError:
                return
            try:
                items = self.encode(batch)
            except Exception as e:  # a bug must not break the pool operation that evicted
                self._ledger.fail(0, e, op="export")
                continue
            self.deliver(0, items)

    def deliver(self, i, items):
        """Send ``items`` (entries for store ``i``) down the stores: put into
        each in-memory store in turn here and now; from the first store
        that does I/O on, queued for the worker.  Never raises."""
        n = len(self._stores)
        try:
            while items and i < n and self._in_memory[i]:
                items = self.put_one(i, items)[0]
                i += 1
            if items and i < n:
                self._enqueue(i, items)
        except Exception as e:  # pragma: no cover - put_one catches store errors
            self._ledger.fail(i if i < n else 0, e, op="put")

    def _enqueue(self, i, items):
        """Queue ``items`` for store ``i`` (and the worker to write them);
        when the queue of store ``i`` passes its bound, the oldest batches
        queued for it go (counted: ``spills_dropped``)."""
        size = sum(len(v) for _, v in items)
        cap = getattr(self._stores[i], "max_pending_bytes", MAX_PENDING_BYTES)
        dropped = 0
        with self._lock:
            self._overlay[i].update(items)
            self._queue.append((i, items, size))
            self._queued_bytes[i] += size
            while self._queued_bytes[i] > cap:
                old = next((b for b in self._queue if b[0] == i), None)
                if old is None or old[1] is items:
                    break   # (the newest batch always stays, whatever its size)
                self._queue.remove(old)
                dropped += self._forget(old)
            start = self._start()
        if dropped:
            self._ledger.count(i, spills_dropped=dropped)
        if start:
            self._worker.submit(self._drain)

    def _forget(self, batch):
        """Lock held: a batch taken off the queue unwritten; returns its
        entries' count."""
        i, items, size = batch
        self._queued_bytes[i] -= size
        overlay = self._overlay[i]
        for k, v in items:
            if overlay.get(k) is v:
                del overlay[k]
        return len(items)

    def _start(self):
        """Lock held: whether a drain must be started (and it is marked started)."""
        if self._draining or not self._queue:
            return False
        self._draining = True
        return True

    def _drain(self):
        """The worker's job: write the queued batches, consecutive ones for
        the same store in one put, until the queue is empty."""
        while True:
            with self._lock:
                self._in_flight = None
                if not self._queue:
                    self._draining = False
                    return
                i, items, size = self._queue.popleft()
                items = list(items)
                while self._queue and self._queue[0][0] == i:
                    _, more, more_size = self._queue.popleft()
                    items += more
                    size += more_size
                self._queued_bytes[i] -= size
                self._in_flight = (i, items, 0)
            try:
                self.put_chain(i, items)
            except Exception as e:  # pragma: no cover - put_chain catches store errors
                self._ledger.fail(i, e, op="put")

    # ------------------------------------------------------------ writing
    def encode(self, records):
        """``BlockRecord``\\ s as entries for store 0: [(key, value)]."""
        fp, key = self._fp[0], self._hmac[0]
        return [(_format.store_key(fp, r.hash),
                 _format.encode(fp, r.hash, r.parent_hash, r.chain_root, r.identity, r.tokens,
                                r.payload, key, out=self._in_place(r, key)))
                for r in records]

    def _in_place(self, r, key):
        """The writable buffer of record ``r``'s entry around its payload
        when the port exported it with room for the header (a memoryview
        of the export's allocation: the header's bytes, then the payload),
        else None (encode copies)."""
        pay, base = r.payload, getattr(r.payload, "base", None)
        room = self._room
        if (room != _format.header_size(len(r.tokens), key)
                or not isinstance(pay, np.ndarray) or not isinstance(base, np.ndarray)
                or pay.dtype != np.uint8 or base.dtype != np.uint8 or base.ndim != 1
                or not pay.flags.c_contiguous or not base.flags.writeable):
            return None
        # (the export's layout: [room bytes, payload] per block, back to back)
        start = pay.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        step = room + pay.nbytes
        if start < room or (start - room) % step or base.nbytes % step:
            return None
        return memoryview(base)[start - room:start + pay.nbytes]

    def write_now(self, records):
        """Write ``records`` to store 0 (and what it drops to the next ...)
        on this thread (``flush_to_stores``): how many some store took."""
        try:
            items = self.encode(records)
        except Exception as e:
            self._ledger.fail(0, e, op="export")
            return 0
        if not items:
            return 0
        try:
            return self.put_chain(0, items)
        except Exception as e:  # pragma: no cover - put_chain catches store errors
            self._ledger.fail(0, e, op="put")
            return 0

    def put_one(self, i, items):
        """Put ``items`` into store ``i``: ``(the entries for store i + 1,
        whether store i took them)``.  A store that is down or whose put
        fails is passed over: its items go to the next store (a full disk
        or a dead Redis in front must not lose what the stores behind it
        could keep)."""
        ledger = self._ledger
        passed_over, taken = items, False   # what goes on if store i does not take it
        if ledger.up(i):
            try:
                dropped = list(self._stores[i].put(items) or ())
            except Exception as e:
                ledger.fail(i, e, op="put")
                # what it dropped before failing goes on with the batch
                passed_over = list(getattr(e, "dropped", None) or ()) + list(items)
            else:
                taken = True
                ledger.done(i, "put")
                ledger.count(i, puts=len(items), bytes_in=sum(len(v) for _, v in items),
                             evictions=len(dropped))
                passed_over = dropped
        return self._retarget(i, i + 1, passed_over), taken

    def put_chain(self, i, items):
        """Put ``items`` into store ``i`` and what it drops into the next,
        and so on, here (the worker, or a flush; no pool lock held), keeping
        the in-flight entries visible to lookups until the store holding
        them has them.  Returns how many of ``items`` some store took."""
        first, taken = len(items), False
        while items and i < len(self._stores):
            passed, took = self.put_one(i, items)
            taken = taken or took
            self.landed(i, items, passed)
            items = passed
            i += 1
        return first if taken else 0

    def _retarget(self, i, j, items):
        """Entries store ``i`` dropped, verified (structure, checksum, HMAC,
        filed under their own key) and re-encoded for store ``j`` where
        their namespace or hmac_key differ; entries that fail are dropped
        (a store's bytes are untrusted: a file planted in a DiskStore's
        directory must not travel on)."""
        if j >= len(self._stores) or not items:
            return items
        same = self._fp[i] == self._fp[j] and self._hmac[i] == self._hmac[j]
        out = []
        for k, v in items:
            try:
                h, parent, salt, ident, tok, pay, _, _ = _format.parse(v, self._fp[i],
                                                                       self._hmac[i])
                if bytes(k) != _format.store_key(self._fp[i], h):
                    raise _format.Invalid("mismatch", "an entry filed under another key")
            except _format.Invalid as e:
                self._ledger.reject(i, e)
                continue
            if same:
                out.append((k, v))
                continue
            out.append((_format.store_key(self._fp[j], h),
                        _format.encode(self._fp[j], h, parent, salt, ident,
                                       np.frombuffer(tok, "<i4"), pay, self._hmac[j])))
        return out

    # ------------------------------------------------------------ what lookups see
    def queued(self, i):
        """``{key: value}`` of the entries on their way to store ``i`` now (a
        copy; empty when none)."""
        with self._lock:
            overlay = self._overlay[i]
            return dict(overlay) if overlay else {}

    def landed(self, i, items, passed):
        """``put_chain`` moved ``items`` through store ``i``: they are no
        longer on their way there; ``passed``, what store ``i`` dropped, are
        on their way to store ``i + 1``."""
        with self._lock:
            if i + 1 < len(self._overlay):
                self._overlay[i + 1].update(passed)
            overlay = self._overlay[i]
            for k, v in items:
                if overlay.get(k) is v:
                    del overlay[k]

    # ------------------------------------------------------------ waiting
    def wait(self, timeout=None):
        """True once everything queued so far is written, False if
        ``timeout`` seconds passed first."""
        with self._lock:
            start = self._start()    # (a forked child's queue: its own drain)
        if start:
            self._worker.submit(self._drain)
        return self._worker.wait_idle(timeout)

    def close(self, timeout=None):
        """Write what is queued within ``timeout`` seconds (None: however
        long it takes), drop what is left then (counted as
        ``spills_dropped``), and stop the worker thread.  True when nothing
        had to be dropped; a put in progress at the deadline finishes in the
        background."""
        deadline = deadline_of(timeout)
        done = self.wait(timeout)
        if not done:
            dropped = collections.Counter()
            with self._lock:
                while self._queue:
                    batch = self._queue.popleft()
                    dropped[batch[0]] += self._forget(batch)
            for i, n in dropped.items():
                self._ledger.count(i, spills_dropped=n)
        self._worker.stop(time_left(deadline))
        return done

    def _after_fork_child(self):
        """The parent's drain (and the batch it was writing) is not in this
        child: that batch goes back to the front of the queue, which the
        child's own worker drains when the next spill or wait comes."""
        self._draining = False
        if self._in_flight is not None:
            i, items, _ = self._in_flight
            self._in_flight = None
            size = sum(len(v) for _, v in items)
            self._queue.appendleft((i, items, size))
            self._queued_bytes[i] += size
