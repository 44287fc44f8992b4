"""The stores of one pool, in order (``BlockPool(..., stores=[...])``): the
pool's block records in, verified entries out.

* Spill (``_spill``): the pool publishes a ``BlockRecord`` for every
  cached block it evicts on its store port's record queue; the spill queue
  reads it, encodes the entries and writes them down the stores (an
  in-memory first store at once, the others through the store worker).
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


def _bounded_get(store):
    """``store.get_bounded``, or None where the pool must call ``get``: the
    store has none, or overrides ``get`` below the class (or instance) that
    defines its ``get_bounded`` (a subclass of RedisStore whose ``get``
    decompresses, say: the inherited bounded read would bypass it)."""
    bounded = getattr(store, "get_bounded", None)
    if bounded is None:
        return None
    own = getattr(store, "__dict__", {})
    if "get_bounded" in own:
        return bounded
    if "get" in own:
        return None
    mro = type(store).__mro__
    where = {name: next((i for i, c in enumerate(mro) if name in vars(c)), len(mro))
             for name in ("get", "get_bounded")}
    return None if where["get"] < where["get_bounded"] else bounded


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
        # the largest valid entry of this pool (signed: a store without a
        # key reads signed entries too): what a store's read may be bounded by
        self._max_entry = _format.header_size(lay["block_size"], True) + port.bytes_per_block
        self._fp = [_format.fingerprint(lay["dtype"], lay["block_size"], lay["num_layers"],
                                        lay["num_kv_heads"], lay["head_dim"],
                                        getattr(s, "namespace", b"") or b"",
                                        kv_scales=lay["kv_scales"])
                    for s in stores]
        self._hmac = [getattr(s, "hmac_key", None) for s in stores]
        self.ledger = Ledger(self.stores)
        # the way down (the port's records in, the stores' writes out)
        self.spills = SpillQueue(self.stores, self._fp, self._hmac, self.ledger)
        self.spills.consume(port)

    def stats(self):
        return self.ledger.stats()

    def write_now(self, records):
        """Write ``records`` down the stores on this thread (``flush_to_stores``)."""
        return self.spills.write_now(records)

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
            store = self.stores[i]
            want = [keys[j] for j in missing]
            bounded = _bounded_get(store)
            got = list(store.get(want) if bounded is None else bounded(want, self._max_entry))
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
