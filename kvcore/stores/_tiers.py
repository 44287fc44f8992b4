"""What a BlockPool does with its prefix stores (``BlockPool(..., stores=[...])``).

* Spill: cached blocks the pool evicts are copied out and encoded
  (``_format``) right when they are evicted, under the pool's lock (before
  the block's new owner can write it).  Into an in-memory first store
  (``HostStore``) they go there and then; everything that has to reach a
  store that does I/O (``DiskStore``, ``RedisStore``, a cluster; what a
  store drops to stay within capacity goes to the next) is queued for the
  pool's store worker, which pushes it down off every pool lock.  Until a
  queued entry is written, lookups find it in the queue.  The queue is
  bounded per store (``max_pending_bytes``): when a slow store lets it
  fill up, the oldest queued spills are dropped (counted as
  ``spills_dropped``; a dropped spill is a later miss, never wrong data),
  so the threads using the pool are never held up by a store.
* Lookup: after the pool's own prefix hit, the following blocks are looked
  up with one batched ``contains`` per store (store 0 first, the rest of
  the run in store 1, ...), fetched with one batched ``get`` per store,
  verified (fingerprint, hash, parent, salt root, identity digest, token
  ids, checksum, HMAC), and the verified run is copied into the sequence's
  fresh blocks, which then enter the pool's prefix cache.  This runs on
  the allocating thread without the pool's lock (the blocks are the
  sequence's own until it adopts them), or on the prefetch worker
  (``BlockPool.prefetch``).
* The pool is reached only through its store interface (``BlockPool``'s
  ``take_evicted_blocks``, ``cached_block_entries``, ``export_blocks``,
  ``import_blocks``, ...) and a sequence through its public members.
* Identity: the chained hashes (SipHash-1-3) only find entries.  Whether an
  entry is the query's block is decided by its identity digest, a BLAKE2b
  chain over the salt and every token id up to the block's end
  (``kvcore.hashing.identity_chain``): the query computes it from its
  tokens; a spill computes it by following the pool's identity chain (the
  parent serial each cached block was registered with) up to the root,
  remembering the digests of recent serials so that it costs about one
  BLAKE2b per block.  A block whose chain can no longer be followed (an
  ancestor evicted and forgotten) is not spilled: it could not be told
  from another prefix whose hashes collide with it.
* Forwarding: what a store drops for the next store is verified first
  (structure, checksum, HMAC): a store's bytes, e.g. a file planted in a
  DiskStore's directory, never reach another store unchecked.
* Faults: any exception of a store, and any entry that fails verification,
  is a miss; a ``StoreWarning`` is issued once per (store, condition) from
  the thread calling the pool.  A store that times out or cannot be
  reached is skipped for its ``retry_interval`` seconds (default 1), so a dead server costs
  one timeout per interval, not one per call.
"""
import collections
import errno
import os
import threading
import time
import warnings
import weakref

import numpy as np

from . import _format
from .. import hashing
from ._worker import Prefetch, Worker, on_worker_thread
from .base import PrefixStore, StoreWarning

#: bytes of spills queued for one store before the oldest are dropped (a
#: store's ``max_pending_bytes`` attribute overrides it)
MAX_PENDING_BYTES = PrefixStore.max_pending_bytes
#: blocks a prefetch loads per step (between steps it may be cancelled, and
#: an allocate of the prompt finds the blocks of the steps done)
PREFETCH_STEP = 16

# conditions that clear once the store works again (warned anew if they recur)
_TRANSIENT = {"timeout", "unreachable", "I/O error", "disk full", "permission denied", "error"}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


def _condition(exc):
    if isinstance(exc, _format.Invalid):
        return exc.condition
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("redis"):
        if "Timeout" in name:
            return "timeout"
        if "Connection" in name or "Busy" in name:
            return "unreachable"
        return "error"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        if exc.errno in _DISK_FULL:
            return "disk full"
        if exc.errno in _PERMISSION or isinstance(exc, PermissionError):
            return "permission denied"
        if isinstance(exc, ConnectionError):
            return "unreachable"
        return "I/O error"
    return "error"


def _stat_dict(kind):
    return {"kind": kind, "lookups": 0, "hits": 0, "hit_tokens": 0, "puts": 0,
            "bytes_in": 0, "bytes_out": 0, "evictions": 0, "failures": 0, "rejected": 0,
            "spills_dropped": 0}



def _describe(store):
    """repr(store), or its type's name when a third-party repr fails."""
    try:
        return repr(store)
    except Exception:
        return f"<{type(store).__name__}>"

def _explain(exc):
    """The exception's type and message (its repr when the message is
    empty, as a bare MemoryError's is); a failed verification
    (``_format.Invalid``) is named by its condition already."""
    try:
        msg = str(exc)
        if isinstance(exc, _format.Invalid):
            return msg
        return f"{type(exc).__name__}: {msg}" if msg else repr(exc)
    except Exception:  # a third-party exception whose __str__ or __repr__ fails
        return f"<{type(exc).__name__}>"


class StoreTiers:
    """The stores of one pool, in order, and the pool's traffic with them."""

    def __init__(self, pool, stores):
        if isinstance(stores, (PrefixStore, str, bytes)) or not hasattr(stores, "__iter__"):
            raise TypeError("stores must be a list of prefix stores (kvcore.HostStore, "
                            f"DiskStore, RedisStore, ...), got {type(stores).__name__}")
        stores = list(stores)
        for i, s in enumerate(stores):
            missing = [m for m in ("contains", "get", "put", "delete") if not callable(
                getattr(s, m, None))]
            if missing:
                raise TypeError(f"stores[{i}] must implement the prefix-store protocol "
                                f"(contains, get, put, delete); {type(s).__name__} lacks "
                                f"{', '.join(missing)}")
        if len({id(s) for s in stores}) != len(stores):
            raise ValueError("stores must not list one store twice")
        self._pool = weakref.ref(pool)
        self.stores = tuple(stores)
        self._block_size = pool.block_size
        self._payload_size = pool.bytes_per_block
        self._fp = [_format.fingerprint(pool.dtype, pool.block_size, pool.num_layers,
                                        pool.num_kv_heads, pool.head_dim,
                                        getattr(s, "namespace", b"") or b"",
                                        kv_scales=pool.kv_scales)
                    for s in stores]
        self._hmac = [getattr(s, "hmac_key", None) for s in stores]
        self._stats = [_stat_dict(getattr(s, "kind", type(s).__name__)) for s in stores]
        self._warned = [{} for _ in stores]   # condition -> the operation that failed
        self._pending = []
        self._down_until = [0.0] * len(stores)
        self._lock = threading.Lock()
        # registration serial -> identity digest, most recently used last:
        # serials are never reused, so an entry stays true; bounded (what
        # matters are the ancestors of blocks still cached)
        self._identities = collections.OrderedDict()
        self._identity_cap = pool.num_blocks + 1024
        # spills for the stores that do I/O, pushed down by the worker:
        # (store, items, bytes) batches in order; each queued or in-flight
        # entry is also in _overlay[store] (key -> value) for lookups
        self._in_memory = [bool(getattr(s, "in_memory", False)) for s in stores]
        self._queue = collections.deque()
        self._queued_bytes = [0] * len(stores)
        self._overlay = [{} for _ in stores]
        self._draining = False
        self._pid = os.getpid()
        self._spiller = Worker("kvcore-store-spill")
        self._fetcher = Worker("kvcore-store-prefetch")
        self._prefetches = weakref.WeakSet()

    # ------------------------------------------------------------ faults
    def _fail(self, i, exc, count=True, op=None, skip=True):
        cond = _condition(exc)
        with self._lock:
            if count:
                self._stats[i]["failures"] += 1
            if skip and cond in ("timeout", "unreachable"):
                self._down_until[i] = time.monotonic() + float(
                    getattr(self.stores[i], "retry_interval", 1.0))
            if cond not in self._warned[i]:
                self._warned[i][cond] = op
                self._pending.append(
                    f"prefix store {i} ({_describe(self.stores[i])}): {cond}: "
                    f"{_explain(exc)}; "
                    f"treated as a miss "
                    f"(warned once per condition)")

    def _reject(self, i, exc):
        with self._lock:
            self._stats[i]["rejected"] += 1
        self._fail(i, exc, count=False)

    def _ok(self, i, op):
        """Operation ``op`` of store ``i`` worked: the transient conditions
        it had warned of are warned of again if they recur."""
        warned = self._warned[i]
        if warned:
            with self._lock:
                for cond in [c for c, o in warned.items() if o == op and c in _TRANSIENT]:
                    del warned[cond]

    def _done(self, i, op, count=True):
        """Operation ``op`` of store ``i`` returned: the faults it reports
        although it returned (``take_faults()``, e.g. a cluster node down
        whose keys were misses) are warned of, without skipping the store
        (its other keys work); with none, as ``_ok``."""
        take = getattr(self.stores[i], "take_faults", None)
        try:
            faults = take() if callable(take) else ()
        except Exception as e:
            faults = [e]
        for e in faults:
            self._fail(i, e, count=count, op=op, skip=False)
        if not faults and count:
            self._ok(i, op)

    def _up(self, i):
        return time.monotonic() >= self._down_until[i]

    def emit_warnings(self):
        """Issue the warnings recorded since the last call (caller's thread;
        on a store worker they wait for the next caller)."""
        if not self._pending or on_worker_thread():
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for msg in pending:
            warnings.warn(msg, StoreWarning, stacklevel=4)

    # ------------------------------------------------------------ spill
    def spill(self):
        """Copy the blocks the pool just evicted out (the pool's lock is held;
        the blocks are not written yet) and send them on their way to the
        stores (:meth:`deliver`).  Never raises."""
        items = self.on_evict(hold=True)
        if items:
            self.deliver(0, items)

    def on_evict(self, hold=False):
        """The pool's eviction hook (``PoolBinding.on_evict``; the pool's
        lock is held, the evicted blocks are not written yet): spill them
        now, or with ``hold`` copy them out and return the entries for
        :meth:`put_held` (allocate's store lookup goes first, so that its
        own spill cannot push out the entries it is about to load)."""
        if not hold:
            return self.spill()
        try:
            return self._entries(None)
        except Exception as e:  # a bug must not break the pool operation that evicted
            self._fail(0, e, op="spill")
            return None

    def put_held(self, items):
        """Send entries :meth:`on_evict` held to the stores; never raises."""
        if items:
            self.deliver(0, items)

    def _entries(self, cached):
        """The evicted blocks (or these cached ones) as encoded entries for
        store 0: [(key, value)]."""
        pool = self._pool()
        if pool is None or not self.stores:
            return []
        if cached is None:
            blocks, hashes, parents, roots, tokens = pool.take_evicted_blocks()
        else:
            blocks, hashes, parents, roots, tokens = pool.cached_block_entries(cached)
        if not blocks.size:
            return []
        try:
            idents = self._spill_identities(pool, blocks, parents, tokens)
            keep = [j for j in range(blocks.size) if idents[j] is not None]
            if not keep:
                return []
            payloads = pool.export_blocks(blocks[keep])
            hb = hashes.astype("<u8").tobytes()
            pb = parents.astype("<u8").tobytes()
            rb = roots.astype("<u8").tobytes()
            fp, key = self._fp[0], self._hmac[0]
            items = []
            for payload, j in zip(payloads, keep):
                h = hb[16 * j:16 * j + 16]
                items.append((_format.store_key(fp, h),
                              _format.encode(fp, h, pb[16 * j:16 * j + 16],
                                             rb[16 * j:16 * j + 16], idents[j], tokens[j],
                                             payload, key)))
        except Exception as e:
            self._fail(0, e, op="export")
            return []
        return items

    def _spill_identities(self, pool, blocks, parents, tokens):
        """The identity digest of each of ``blocks`` (cached, or evicted just
        now: their registration is still recorded), or None where it cannot
        be told any more: an ancestor neither cached, nor in this batch, nor
        remembered, or a salt the pool forgot."""
        serials, parent_serials = pool.block_identity_links(blocks)
        serials, parent_serials = serials.tolist(), parent_serials.tolist()
        parent_words = parents.tolist()
        raw = np.ascontiguousarray(tokens, "<i4").tobytes()
        step = 4 * self._block_size
        token_bytes = [raw[j * step:(j + 1) * step] for j in range(len(serials))]
        batch = {s: j for j, s in enumerate(serials)}
        memo = self._identities
        out = []
        for j in range(len(serials)):
            digest = memo.get(serials[j])
            if digest is not None:
                memo.move_to_end(serials[j])
                out.append(digest)
                continue
            chain = [(serials[j], token_bytes[j])]   # (serial, token bytes), nearest first
            below, ps, pw = serials[j], parent_serials[j], parent_words[j]
            while digest is None:
                if ps < 0:
                    digest = self._root_identity(pool, ps)
                    break
                if ps >= below:     # serials grow along a chain: never loop
                    break
                digest = memo.get(ps)
                if digest is not None:
                    memo.move_to_end(ps)
                    break
                k = batch.get(ps)
                if k is not None:   # evicted in this batch
                    chain.append((ps, token_bytes[k]))
                    below, ps, pw = ps, parent_serials[k], parent_words[k]
                    continue
                # still cached: the pool walks up its cache in one call
                up, up_serials, end, end_words = pool.cached_ancestry(pw, ps)
                if not up.size:
                    break
                up_tokens = pool.cached_block_entries(up)[4].astype("<i4")
                for us, ut in zip(up_serials.tolist(), up_tokens):
                    digest = memo.get(us)
                    if digest is not None:
                        memo.move_to_end(us)
                        break
                    chain.append((us, ut.tobytes()))
                if digest is None:
                    below, ps, pw = int(up_serials[-1]), end, list(end_words)
            if digest is not None:
                for cs, ctok in reversed(chain):
                    digest = hashing.identity_next(digest, ctok)
                    memo[cs] = digest
                while len(memo) > self._identity_cap:
                    memo.popitem(last=False)
            out.append(digest)
        return out

    @staticmethod
    def _root_identity(pool, root):
        """The identity root of salt root id ``root`` (-1: no salt), or None
        when the pool no longer knows its salt."""
        if root == -1:
            return hashing.identity_root(None)
        salt = pool.salt_of_root(root)
        return None if salt is None else hashing.identity_root(salt)

    def deliver(self, i, items):
        """Send ``items`` (entries for store ``i``) down the stores: put into
        each in-memory store in turn here and now; from the first store
        that does I/O on, queued for the worker.  Never raises, never waits
        on a store that does I/O (the caller may hold the pool's lock)."""
        try:
            while items and i < len(self.stores) and self._in_memory[i]:
                items = self._put_one(i, items)[0]
                i += 1
            if items and i < len(self.stores):
                self._enqueue(i, items)
        except Exception as e:  # pragma: no cover - _put_one catches store errors
            self._fail(i if i < len(self.stores) else 0, e, op="put")

    def _put_one(self, i, items):
        """Put ``items`` into store ``i``: ``(the entries for store i + 1,
        whether store i took them)``.  A store that is down or whose put
        fails is passed over: its items go to the next store (a full disk
        or a dead Redis in front must not lose what the stores behind it
        could keep)."""
        passed_over, taken = items, False   # what goes on if store i does not take it
        if self._up(i):
            try:
                dropped = list(self.stores[i].put(items) or ())
            except Exception as e:
                self._fail(i, e, op="put")
                # what it dropped before failing goes on with the batch
                passed_over = list(getattr(e, "dropped", None) or ()) + list(items)
            else:
                taken = True
                self._done(i, "put")
                with self._lock:
                    st = self._stats[i]
                    st["puts"] += len(items)
                    st["bytes_in"] += sum(len(v) for _, v in items)
                    st["evictions"] += len(dropped)
                passed_over = dropped
        return self._retarget(i, i + 1, passed_over), taken

    def _put_chain(self, i, items):
        """Put ``items`` into store ``i`` and what it drops into the next,
        and so on, here (the worker, or a flush; no pool lock held), keeping
        the in-flight entries visible to lookups until the store holding
        them has them.  Returns how many of ``items`` some store took."""
        first, taken = len(items), False
        while items and i < len(self.stores):
            passed, took = self._put_one(i, items)
            taken = taken or took
            with self._lock:
                if i + 1 < len(self.stores):
                    self._overlay[i + 1].update(passed)
                overlay = self._overlay[i]
                for k, v in items:
                    if overlay.get(k) is v:
                        del overlay[k]
            items = passed
            i += 1
        return first if taken else 0

    def _enqueue(self, i, items):
        """Queue ``items`` for store ``i`` (and the worker to write them);
        when the queue of store ``i`` passes its bound, the oldest batches
        queued for it go (counted: ``spills_dropped``)."""
        size = sum(len(v) for _, v in items)
        cap = getattr(self.stores[i], "max_pending_bytes", MAX_PENDING_BYTES)
        self._after_fork()
        with self._lock:
            self._overlay[i].update(items)
            self._queue.append((i, items, size))
            self._queued_bytes[i] += size
            while self._queued_bytes[i] > cap:
                old = next((b for b in self._queue if b[0] == i), None)
                if old is None or old[1] is items:
                    break   # (the newest batch always stays, whatever its size)
                self._queue.remove(old)
                self._queued_bytes[i] -= old[2]
                self._stats[i]["spills_dropped"] += len(old[1])
                overlay = self._overlay[i]
                for k, v in old[1]:
                    if overlay.get(k) is v:
                        del overlay[k]
            start = not self._draining
            self._draining = True
        if start:
            self._spiller.submit(self._drain)

    def _after_fork(self):
        """In a child made by ``fork``: the parent's worker (and a drain it
        ran) is not here, and its lock may have been held at the fork; what
        is queued is drained by the child's own worker."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._draining = bool(self._queue)
            if self._draining:
                self._spiller.submit(self._drain)

    def _drain(self):
        """The worker's job: write the queued batches, consecutive ones for
        the same store in one put, until the queue is empty."""
        while True:
            with self._lock:
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
            try:
                self._put_chain(i, items)
            except Exception as e:  # pragma: no cover - _put_chain catches store errors
                self._fail(i, e, op="put")

    def wait_spills(self, timeout=None):
        """``BlockPool.wait_spills``: True once the queued spills are written."""
        self._after_fork()
        return self._spiller.wait_idle(timeout)

    def flush(self, timeout=None):
        """``BlockPool.flush_to_stores``: wait for the queued spills, then
        write every cached block to the stores from this thread (the pool's
        lock held only while they are copied out).  Returns how many blocks
        some store took."""
        self.wait_spills(timeout)
        pool = self._pool()
        if pool is None:
            return 0
        with pool.lock:   # (nobody evicts and rewrites them while they are copied)
            cached = pool.cached_block_ids()
            try:
                items = self._entries(cached) if cached.size else []
            except Exception as e:
                self._fail(0, e, op="export")
                items = []
        if not items:
            return 0
        try:
            return self._put_chain(0, items)
        except Exception as e:  # pragma: no cover - _put_chain catches store errors
            self._fail(0, e, op="put")
            return 0

    def close(self, timeout=None):
        """``BlockPool.close``: cancel the prefetches, let the workers finish."""
        for h in list(self._prefetches):
            h.cancel()
        self._fetcher.stop(timeout)
        self._spiller.stop(timeout)

    def _retarget(self, i, j, items):
        """Entries store ``i`` dropped, verified (structure, checksum, HMAC,
        filed under their own key) and re-encoded for store ``j`` where
        their namespace or hmac_key differ; entries that fail are dropped
        (a store's bytes are untrusted: a file planted in a DiskStore's
        directory must not travel on)."""
        if j >= len(self.stores) or not items:
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
                self._reject(i, e)
                continue
            if same:
                out.append((k, v))
                continue
            out.append((_format.store_key(self._fp[j], h),
                        _format.encode(self._fp[j], h, parent, salt, ident,
                                       np.frombuffer(tok, "<i4"), pay, self._hmac[j])))
        return out

    # ------------------------------------------------------------ lookup
    def _run(self, hash_bytes, first, stop, count):
        """[(store, start, end)]: the longest run of blocks first..stop-1
        found store after store (one ``contains`` per store)."""
        segments = []
        at = first
        for i, s in enumerate(self.stores):
            if at >= stop:
                break
            if not self._up(i):
                continue
            keys = [_format.store_key(self._fp[i], hash_bytes[16 * b:16 * b + 16])
                    for b in range(at, stop)]
            try:
                n = self._contains(i, keys)
            except Exception as e:
                # (probe too: a store that timed out is skipped for its
                # retry_interval, and warned of, without counting a failure)
                self._fail(i, e, count=count, op="contains")
                continue
            self._done(i, "contains", count)
            if count:
                with self._lock:
                    self._stats[i]["lookups"] += 1
            if n:
                segments.append((i, at, at + n))
                at += n
        return segments

    def _contains(self, i, keys):
        """How many of ``keys``, from the first on, store ``i`` holds or has
        on its way (queued spills): one ``contains`` per stretch the queue
        does not cover (one in all when nothing is queued)."""
        with self._lock:
            overlay = self._overlay[i]
            queued = [k in overlay for k in keys] if overlay else None
        if queued is None:
            return max(0, min(int(self.stores[i].contains(keys)), len(keys)))
        n = 0
        while n < len(keys):
            while n < len(keys) and queued[n]:
                n += 1
            if n == len(keys):
                break
            m = max(0, min(int(self.stores[i].contains(keys[n:])), len(keys) - n))
            if not m:
                break
            n += m
        return n

    def _get(self, i, keys):
        """Store ``i``'s values of ``keys``: the queued ones from the queue,
        the others with one ``get``."""
        with self._lock:
            overlay = self._overlay[i]
            values = [overlay.get(k) for k in keys] if overlay else [None] * len(keys)
        missing = [j for j, v in enumerate(values) if v is None]
        if missing:
            got = list(self.stores[i].get([keys[j] for j in missing]))
            for j, v in zip(missing, got):
                values[j] = v
            if len(got) < len(missing):
                del values[missing[len(got)]:]
        return values

    def probe_blocks(self, hash_words, first, stop):
        """Blocks first.. that the stores would add to a hit (no loading, no stats)."""
        if first >= stop:
            return 0
        hb = np.ascontiguousarray(hash_words, "<u8").tobytes()
        try:
            segs = self._run(hb, first, stop, count=False)
        except Exception:  # pragma: no cover - _run catches store errors
            return 0
        return sum(e - s for _, s, e in segs)

    def load(self, seq, hit, held=None):
        """After ``seq.allocate`` hit ``hit`` tokens in the pool: copy the
        following blocks found in the stores into the sequence's fresh
        blocks, then put ``held`` (what that allocate evicted, see
        :meth:`on_evict`).  Returns [(store, entry size)] of the blocks
        loaded, in order, for the caller to adopt
        (``PagedKVCache.allocate``) and count (:meth:`count_loaded`) once
        the call is sure to succeed: nothing is registered or counted as a
        hit here.  Never raises; the warnings are left for the caller."""
        try:
            return self._load(seq, hit)
        except Exception as e:  # a bug must not reach allocate's caller
            self._fail(0, e, op="load")
            return []
        finally:
            self.put_held(held)

    def _load(self, seq, hit):
        pool = self._pool()
        bs = self._block_size
        n = seq.num_tokens
        first, stop = hit // bs, (n - 1) // bs
        if pool is None or first >= stop or not self.stores:
            return []
        hb = b"".join(seq.block_hashes())
        salt = seq.salt
        r0, r1 = hashing.root_words(salt)
        root = np.array([r0, r1], "<u8").tobytes()
        tokens = seq.token_ids
        if self._prefetches:
            self._overtake(hb[:16], salt)
        segments = self._run(hb, first, stop, count=True)
        if not segments:
            return []
        # what a hit entry must carry: the identity digest of the query's
        # own prefix (one BLAKE2b per block, up to the last block found)
        idents = hashing.identity_chain(tokens, bs, salt, segments[-1][2])
        table = seq.block_table
        owners = []           # (store, entry bytes) of each block loaded, in order
        for i, start, end in segments:
            keys = [_format.store_key(self._fp[i], hb[16 * b:16 * b + 16])
                    for b in range(start, end)]
            try:
                values = self._get(i, keys)
            except Exception as e:
                self._fail(i, e, op="get")
                break
            self._done(i, "get")
            complete = len(values) == end - start
            blocks, pays, seeds, checks, sizes = [], [], [], [], []
            for b, v in zip(range(start, end), values):
                if v is None:   # gone since contains (another process, LRU)
                    complete = False
                    break
                parent = hb[16 * b - 16:16 * b] if b else root
                try:
                    pay, checksum, seed = _format.decode(
                        v, self._fp[i], hb[16 * b:16 * b + 16], parent, root, idents[b],
                        tokens[b * bs:(b + 1) * bs], self._payload_size, self._hmac[i],
                        verify_payload=False)
                except _format.Invalid as e:
                    self._reject(i, e)
                    complete = False
                    break
                blocks.append(b)
                pays.append(pay)
                seeds.append(seed)
                checks.append(checksum)
                sizes.append(len(v))
            if blocks:
                # the payloads' checksums are computed while they are copied
                # into the (fresh, not yet adopted) blocks, all in one call;
                # the blocks up to the first mismatch are kept
                try:
                    digests = pool.import_blocks(table[blocks[0]:blocks[-1] + 1], pays,
                                                  seeds=seeds)
                except Exception as e:  # the blocks stay fresh, not adopted
                    self._fail(i, e, op="import")
                    break
                for digest, checksum, size in zip(digests, checks, sizes):
                    if digest != checksum:
                        self._reject(i, _format.Invalid("corrupt", "checksum mismatch"))
                        complete = False
                        break
                    owners.append((i, size))
            if not complete:
                break
        return owners

    def count_loaded(self, owners):
        """The blocks :meth:`load` loaded were adopted: count them as hits."""
        bs = self._block_size
        with self._lock:
            for i, size in owners:
                st = self._stats[i]
                st["hits"] += 1
                st["hit_tokens"] += bs
                st["bytes_out"] += size

    def stats(self):
        with self._lock:
            return [dict(s) for s in self._stats]

    # ------------------------------------------------------------ prefetch
    def prefetch(self, tokens, salt):
        """``BlockPool.prefetch`` (arguments checked): a handle, the loading
        queued for the prefetch worker."""
        handle = Prefetch()
        if tokens.shape[0] > self._block_size:
            handle._key = (hashing.block_hashes(tokens[:self._block_size], self._block_size,
                                                salt)[0], salt)
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
            if h._key == (first_hash, salt) and not h.done() \
                    and not on_worker_thread():
                h.cancel()

    def _prefetch(self, handle, tokens, salt):
        """The prefetch worker's job: find the run of the prompt's blocks the
        stores hold, then load it ``PREFETCH_STEP`` blocks at a time, each
        step an allocate (hitting the steps before it in the prefix cache,
        loading the next blocks from the stores) and a free, which leaves
        the loaded blocks cached and evictable."""
        from .._errors import OutOfBlocksError
        from ..paged import PagedKVCache

        try:
            if not handle._begin():
                return
            pool = self._pool()
            if pool is None:
                return
            bs = self._block_size
            probe = pool.probe(tokens, salt)
            ready = (probe["hit_tokens"] - probe.get("store_hit_tokens", 0)) // bs
            target = probe["hit_tokens"] // bs
            handle.blocks_ready = ready
            while ready < target and not handle.cancelled():
                upto = min(target, ready + PREFETCH_STEP)
                seq = PagedKVCache(pool, salt=salt)
                try:
                    hit = seq.allocate(tokens[:upto * bs + 1]) // bs
                except OutOfBlocksError:
                    break   # the pool is full: what is ready stays ready
                finally:
                    seq.free()
                handle.blocks_ready = max(ready, hit)
                if hit < upto:
                    break   # an entry went or failed verification: the rest is computed
                ready = hit
        except Exception as e:  # never reaches the worker's loop
            self._fail(0, e, op="prefetch")
        finally:
            handle._finish()
