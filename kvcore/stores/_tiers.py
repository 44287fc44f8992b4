"""The stores of one pool, in order (``BlockPool(..., stores=[...])``): the
pool's block records in, verified entries out.

* Spill: the pool publishes a ``BlockRecord`` for every cached block it
  evicts on its store port's record queue; :class:`SpillQueue`
  (``_spill``) reads it, encodes the entries (``_format``) and sends them
  down: into an in-memory first store at once, through the store worker
  for the stores that do I/O.  What a store drops to stay within capacity
  goes to the next, verified first (structure, checksum, HMAC): a store's
  bytes, e.g. a file planted in a DiskStore's directory, never reach
  another store unchecked.
* Lookup: after the pool's own prefix hit, the pool asks :meth:`find` for
  the run of following blocks the stores hold (one batched ``contains`` per
  store: store 0 first, the rest of the run in store 1, ...), then
  :meth:`fetch` for their entries (one batched ``get`` per store), each
  verified against the query (fingerprint, hash, parent, salt root,
  identity digest, token ids, HMAC): the pool copies the payloads into its
  blocks, computing their checksums on the way, and :meth:`check_loaded`
  keeps the blocks up to the first mismatch.
* Identity: the chained hashes (SipHash-1-3) only find entries; whether an
  entry is the query's block is decided by its identity digest, which the
  pool computes once per block (when the block is registered; a query's
  digests are the ones its blocks will register with).
* Faults (``_ledger``): any exception of a store, and any entry that fails
  verification, is a miss and a ``StoreWarning`` (once per store and
  condition); a store that times out is skipped for its ``retry_interval``.

Nothing here calls the pool or a sequence: what the pool needs it asks for,
and what the stores need it is handed (a ``StorePort``'s record queue and
layout, a query's hashes, tokens and digests).
"""
import numpy as np

from . import _format
from ._ledger import Ledger
from ._spill import SpillQueue
from .base import PrefixStore


class Fetched:
    """Verified entries of consecutive blocks from one store, for the pool
    to copy in (:meth:`StoreTiers.fetch`): ``store``, ``blocks`` (block
    indices of the query), ``payloads``, ``seeds`` and ``checksums`` (the
    payload checksum each entry promises, with its seed), ``sizes`` (entry
    bytes), and ``complete`` (False: the run ends here)."""

    __slots__ = ("store", "blocks", "payloads", "seeds", "checksums", "sizes", "complete")

    def __init__(self, store):
        self.store = store
        self.blocks, self.payloads, self.seeds, self.checksums, self.sizes = [], [], [], [], []
        self.complete = True


class StoreTiers:
    """The stores of one pool, in order, and the pool's traffic with them.

    ``port``: the pool's ``StorePort`` (its ``layout``, ``bytes_per_block``
    and record queue are all this reads of it)."""

    def __init__(self, port, stores):
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
        self.stores = tuple(stores)
        lay = port.layout
        self._payload_size = port.bytes_per_block
        self._fp = [_format.fingerprint(lay["dtype"], lay["block_size"], lay["num_layers"],
                                        lay["num_kv_heads"], lay["head_dim"],
                                        getattr(s, "namespace", b"") or b"",
                                        kv_scales=lay["kv_scales"])
                    for s in stores]
        self._hmac = [getattr(s, "hmac_key", None) for s in stores]
        self.in_memory = [bool(getattr(s, "in_memory", False)) for s in stores]
        self.ledger = Ledger(self.stores)
        self.spills = SpillQueue(self, port.listen(self._wake))

    def _wake(self):
        """The port published records: consume them now (see SpillQueue)."""
        self.spills.take_records()

    def stats(self):
        return self.ledger.stats()

    # ------------------------------------------------------------ writing
    def encode(self, records):
        """``BlockRecord``\\ s as entries for store 0: [(key, value)]."""
        fp, key = self._fp[0], self._hmac[0]
        return [(_format.store_key(fp, r.hash),
                 _format.encode(fp, r.hash, r.parent_hash, r.chain_root, r.identity, r.tokens,
                                r.payload, key))
                for r in records]

    def write_now(self, records):
        """Write ``records`` to store 0 (and what it drops to the next ...)
        on this thread (``flush_to_stores``); how many some store took."""
        try:
            items = self.encode(records)
        except Exception as e:
            self.ledger.fail(0, e, op="export")
            return 0
        if not items:
            return 0
        try:
            return self.put_chain(0, items)
        except Exception as e:  # pragma: no cover - put_chain catches store errors
            self.ledger.fail(0, e, op="put")
            return 0

    def put_one(self, i, items):
        """Put ``items`` into store ``i``: ``(the entries for store i + 1,
        whether store i took them)``.  A store that is down or whose put
        fails is passed over: its items go to the next store (a full disk
        or a dead Redis in front must not lose what the stores behind it
        could keep)."""
        ledger = self.ledger
        passed_over, taken = items, False   # what goes on if store i does not take it
        if ledger.up(i):
            try:
                dropped = list(self.stores[i].put(items) or ())
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
        while items and i < len(self.stores):
            passed, took = self.put_one(i, items)
            taken = taken or took
            self.spills.landed(i, items, passed)
            items = passed
            i += 1
        return first if taken else 0

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
                self.ledger.reject(i, e)
                continue
            if same:
                out.append((k, v))
                continue
            out.append((_format.store_key(self._fp[j], h),
                        _format.encode(self._fp[j], h, parent, salt, ident,
                                       np.frombuffer(tok, "<i4"), pay, self._hmac[j])))
        return out

    # ------------------------------------------------------------ lookup
    def find(self, hash_bytes, first, stop, count=True):
        """[(store, start, end)]: the longest run of blocks first..stop-1
        (``hash_bytes``: 16 per block, from block 0) found store after store
        (one ``contains`` per store); ``count``: a lookup in the stats (a
        probe is not).  Never raises."""
        segments = []
        at = first
        ledger = self.ledger
        for i in range(len(self.stores)):
            if at >= stop:
                break
            if not ledger.up(i):
                continue
            keys = [_format.store_key(self._fp[i], hash_bytes[16 * b:16 * b + 16])
                    for b in range(at, stop)]
            try:
                n = self._contains(i, keys)
            except Exception as e:
                # (probe too: a store that timed out is skipped for its
                # retry_interval, and warned of, without counting a failure)
                ledger.fail(i, e, count=count, op="contains")
                continue
            ledger.done(i, "contains", count)
            if count:
                ledger.count(i, lookups=1)
            if n:
                segments.append((i, at, at + n))
                at += n
        return segments

    def _contains(self, i, keys):
        """How many of ``keys``, from the first on, store ``i`` holds or has
        on its way (queued spills): one ``contains`` per stretch the queue
        does not cover (one in all when nothing is queued)."""
        queued = self.spills.queued(i)
        if not queued:
            return max(0, min(int(self.stores[i].contains(keys)), len(keys)))
        on_way = [k in queued for k in keys]
        n = 0
        while n < len(keys):
            while n < len(keys) and on_way[n]:
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
        queued = self.spills.queued(i)
        values = [queued.get(k) for k in keys] if queued else [None] * len(keys)
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
        return sum(e - s for _, s, e in self.find(hb, first, stop, count=False))

    def fetch(self, segments, hash_bytes, root, tokens, identities, block_size):
        """The verified entries of ``segments`` (from :meth:`find`), one
        :class:`Fetched` per store, in order, stopping after one that is not
        complete (an entry gone since ``contains``, or failing
        verification).  ``root``: the salt's chain root (16 bytes);
        ``tokens``: the query's token ids; ``identities``: its blocks'
        identity digests, 32 bytes each from block ``segments[0][1]`` on.
        A generator; never raises."""
        first = segments[0][1] if segments else 0
        ledger = self.ledger
        bs = block_size
        for i, start, end in segments:
            got = Fetched(i)
            keys = [_format.store_key(self._fp[i], hash_bytes[16 * b:16 * b + 16])
                    for b in range(start, end)]
            try:
                values = self._get(i, keys)
            except Exception as e:
                ledger.fail(i, e, op="get")
                return
            ledger.done(i, "get")
            got.complete = len(values) == end - start
            for b, v in zip(range(start, end), values):
                if v is None:   # gone since contains (another process, LRU)
                    got.complete = False
                    break
                parent = hash_bytes[16 * b - 16:16 * b] if b else root
                d = 32 * (b - first)
                try:
                    pay, checksum, seed = _format.decode(
                        v, self._fp[i], hash_bytes[16 * b:16 * b + 16], parent, root,
                        identities[d:d + 32], tokens[b * bs:(b + 1) * bs], self._payload_size,
                        self._hmac[i], verify_payload=False)
                except _format.Invalid as e:
                    ledger.reject(i, e)
                    got.complete = False
                    break
                got.blocks.append(b)
                got.payloads.append(pay)
                got.seeds.append(seed)
                got.checksums.append(checksum)
                got.sizes.append(len(v))
            yield got
            if not got.complete:
                return

    def check_loaded(self, got, digests):
        """The pool copied ``got``'s payloads into its blocks, computing
        ``digests`` (their checksums with the entries' seeds): how many
        leading blocks hold (a mismatch is a rejected, corrupt entry)."""
        for n, (digest, checksum) in enumerate(zip(digests, got.checksums)):
            if digest != checksum:
                self.ledger.reject(got.store, _format.Invalid("corrupt", "checksum mismatch"))
                got.complete = False
                return n
        return len(got.blocks)

    def count_loaded(self, owners, block_size):
        """The blocks loaded (``owners``: (store, entry bytes) each) were
        adopted by a sequence: count them as hits."""
        per_store = {}
        for i, size in owners:
            n, nbytes = per_store.get(i, (0, 0))
            per_store[i] = (n + 1, nbytes + size)
        for i, (n, nbytes) in per_store.items():
            self.ledger.count(i, hits=n, hit_tokens=n * block_size, bytes_out=nbytes)

    # ------------------------------------------------------------ lifecycle
    def wait_spills(self, timeout=None):
        """``BlockPool.wait_spills``: True once the queued spills are written."""
        return self.spills.wait(timeout)

    def close(self, timeout=None):
        """Write the queued spills within ``timeout`` (what is left then is
        dropped and counted), stop the worker; True when nothing was dropped."""
        return self.spills.close(timeout)
