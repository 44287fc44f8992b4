"""What a BlockPool does with its prefix stores (``BlockPool(..., stores=[...])``).

* Spill: cached blocks the pool evicts are encoded (``_format``) and put in
  the first store, synchronously, right when they are evicted (their KV is
  copied out before the block's new owner can write it); what a store
  drops to stay within capacity goes to the next store, and so on.
* Lookup: after the pool's own prefix hit, the following blocks are looked
  up with one batched ``contains`` per store (store 0 first, the rest of
  the run in store 1, ...), fetched with one batched ``get`` per store,
  verified (fingerprint, hash, parent, salt root, identity digest, token
  ids, checksum, HMAC), and the verified run is copied into the sequence's
  fresh blocks, which then enter the pool's prefix cache.
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
import threading
import time
import warnings
import weakref

import numpy as np

from . import _format
from .. import hashing
from .base import PrefixStore, StoreWarning

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
            "bytes_in": 0, "bytes_out": 0, "evictions": 0, "failures": 0, "rejected": 0}



def _describe(store):
    """repr(store), or its type's name when a third-party repr fails."""
    try:
        return repr(store)
    except Exception:
        return f"<{type(store).__name__}>"

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
                                        getattr(s, "namespace", b"") or b"")
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
                    f"prefix store {i} ({_describe(self.stores[i])}): {cond}: {exc}; "
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
        """Issue the warnings recorded since the last call (caller's thread)."""
        if not self._pending:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for msg in pending:
            warnings.warn(msg, StoreWarning, stacklevel=4)

    # ------------------------------------------------------------ spill
    def spill(self, cached=None):
        """Put the blocks the pool just evicted (or, with ``cached``, these
        cached blocks) into the first store (the pool's lock is held; the
        blocks are not written yet).  Returns how many entries were put;
        never raises."""
        try:
            return self._spill(cached)
        except Exception as e:  # a bug must not break the pool operation that evicted
            self._fail(0, e, op="spill")
            return 0

    def _spill(self, cached):
        pool = self._pool()
        if pool is None:
            return 0
        if cached is None:
            blocks, hashes, parents, roots, tokens = pool._core.take_evicted()
        else:
            blocks, hashes, parents, roots, tokens = pool._core.cached_entries(cached)
        if not blocks.size or not self.stores:
            return 0
        try:
            idents = self._spill_identities(pool, blocks, parents, tokens)
            keep = [j for j in range(blocks.size) if idents[j] is not None]
            if not keep:
                return 0
            payloads = pool._export_blocks(blocks[keep])
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
            return 0
        return self._put(0, items)

    def _spill_identities(self, pool, blocks, parents, tokens):
        """The identity digest of each of ``blocks`` (cached, or evicted just
        now: their registration is still recorded), or None where it cannot
        be told any more: an ancestor neither cached, nor in this batch, nor
        remembered, or a salt the pool forgot."""
        core = pool._core
        serials, parent_serials = core.identity_links(blocks)
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
                up, up_serials, end, end_words = core.cached_ancestry(pw[0], pw[1], ps)
                if not up.size:
                    break
                up_tokens = core.cached_entries(up)[4].astype("<i4")
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
        salt = pool._root_salts.get(root)
        return None if salt is None else hashing.identity_root(salt)

    def _put(self, i, items):
        """Put ``items`` into store ``i``; what it drops goes to the next
        store.  A store that is down or whose put fails is passed over: its
        items go to the next store (a full disk or a dead Redis in front
        must not lose what the stores behind it could keep).  Returns how
        many of ``items`` some store took."""
        first, taken = len(items), False
        while items and i < len(self.stores):
            passed_over = items      # what goes on if store i does not take it
            if self._up(i):
                try:
                    dropped = list(self.stores[i].put(items) or ())
                except Exception as e:
                    self._fail(i, e, op="put")
                    # what it dropped before failing goes on with the batch
                    passed_over = list(getattr(e, "dropped", None) or ()) + items
                else:
                    taken = True
                    self._done(i, "put")
                    with self._lock:
                        st = self._stats[i]
                        st["puts"] += len(items)
                        st["bytes_in"] += sum(len(v) for _, v in items)
                        st["evictions"] += len(dropped)
                    passed_over = dropped
            items = self._retarget(i, i + 1, passed_over)
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
                n = int(s.contains(keys))
            except Exception as e:
                # (probe too: a store that timed out is skipped for its
                # retry_interval, and warned of, without counting a failure)
                self._fail(i, e, count=count, op="contains")
                continue
            self._done(i, "contains", count)
            if count:
                with self._lock:
                    self._stats[i]["lookups"] += 1
            n = max(0, min(n, stop - at))
            if n:
                segments.append((i, at, at + n))
                at += n
        return segments

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

    def extend(self, seq, hit):
        """After ``seq.allocate`` hit ``hit`` tokens in the pool: load the
        following blocks found in the stores; returns the new hit.  Never
        raises (except from the warnings it issues)."""
        try:
            return self._extend(seq, hit)
        except Exception as e:  # a bug must not reach allocate's caller
            self._fail(0, e, op="load")
            return seq._core._num_computed
        finally:
            self.emit_warnings()

    def _extend(self, seq, hit):
        pool = self._pool()
        core = seq._core
        bs = self._block_size
        n = core._num_tokens
        first, stop = hit // bs, (n - 1) // bs
        if pool is None or first >= stop or not self.stores:
            return hit
        from ..hashing import root_words
        hw = core._hash_words()
        hb = np.ascontiguousarray(hw, "<u8").tobytes()
        r0, r1 = root_words(core._salt)
        root = np.array([r0, r1], "<u8").tobytes()
        tokens = core._token_ids()
        segments = self._run(hb, first, stop, count=True)
        if not segments:
            return hit
        # what a hit entry must carry: the identity digest of the query's
        # own prefix (one BLAKE2b per block, up to the last block found)
        idents = hashing.identity_chain(tokens, bs, core._salt, segments[-1][2])
        table = core._table
        owners = []           # (store, entry bytes) of each block loaded, in order
        for i, start, end in segments:
            keys = [_format.store_key(self._fp[i], hb[16 * b:16 * b + 16])
                    for b in range(start, end)]
            try:
                values = self.stores[i].get(keys)
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
                    digests = pool._import_blocks(table[blocks[0]:blocks[-1] + 1], pays,
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
        if not owners:
            return hit
        new_hit = core._adopt_loaded(len(owners))
        with self._lock:
            for i, size in owners:
                st = self._stats[i]
                st["hits"] += 1
                st["hit_tokens"] += bs
                st["bytes_out"] += size
        return new_hit

    def stats(self):
        with self._lock:
            return [dict(s) for s in self._stats]
