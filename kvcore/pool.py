"""BlockPool: one pool of KV blocks shared by many sequences."""
import functools
import threading

import numpy as np

from . import _arrays, dtypes
from .backends import get_backend
from ._native import _pool, _seq
from ._planes import Planes, check_layer_scales, check_head_scales_backend, kv_scale_pairs
from ._validate import index_int, layer_index, positive_int

__all__ = ["BlockPool"]


class _CheckedLock:
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

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class BlockPool:
    """A pool of fixed-size KV blocks with refcounted ownership and prefix caching.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool.
    block_size : int
        Token positions per block.
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    dtype : str or dtype, default "float16"
        Storage: "float32", "float16" or "bfloat16" (bf16 kept as uint16
        bits), or low precision: "float8_e4m3fn", "float8_e5m2" (fp8 bits as
        uint8; ml_dtypes' types accepted) or "int8".
    device : {"cpu", "cuda"}, default "cpu"
    enable_prefix_caching : bool, default True
        Share full blocks of identical prefixes between sequences.
    stores : list of prefix stores, optional
        Tiers below the prefix cache (``kvcore.HostStore``, ``DiskStore``,
        ``RedisStore``, or anything following the protocol of
        ``kvcore.stores.PrefixStore``): cached blocks the pool evicts go to
        the first store, each store drops its least recently used entries
        into the next, and ``allocate``/``probe`` extend the pool's own hit
        with the run of following blocks found there (docs/stores.md).
        Writes to a store that does I/O (disk, network) run on a background
        store worker, never under the pool's lock (:meth:`flush_to_stores`
        and :meth:`close` drain it); :meth:`prefetch` loads a prompt's
        stored blocks ahead of its ``allocate``.  Needs
        ``enable_prefix_caching``.
    kv_scales : sequence of num_layers (k_scale, v_scale) pairs, optional
        fp8 pools only: float32 scales (default 1.0), each a float (the
        layer's) or ``num_kv_heads`` floats (one per KV head, CPU pools), or
        an array of shape ``(num_layers, 2)`` or ``(num_layers, 2,
        num_kv_heads)``: a value x of head h is stored as ``fp8(x /
        scale_h)``, saturated to the largest finite fp8 value (+-inf
        included; NaN stays NaN), and read as ``fp8 * scale_h``.

    Notes on int8 pools
    -------------------
    Symmetric, one float32 scale per (token, kv head): ``scale = max|x| /
    127`` over ``head_dim`` (1.0 for an all-zero row), stored
    ``round_half_even(x / scale)``; read ``code * scale``.  A row holding a
    NaN or an infinity stores scale NaN and zero codes, so it reads back as
    NaN (never as plausible numbers).  The scales live in a second array,
    :attr:`scales` ``(num_layers * 2, num_blocks, num_kv_heads, block_size)``,
    addressed by the same block ids: every block copy (copy-on-write,
    :meth:`copy_blocks_to`, offload) moves them with the codes.  A raw
    :meth:`gather` returns the codes; :meth:`gather_scales` their scales;
    ``gather(..., dtype="float32")`` dequantizes.

    Notes
    -----
    Storage is one allocation of shape
    ``(num_layers * 2, num_blocks, num_kv_heads, block_size, head_dim)``:
    plane ``2*l`` is layer ``l``'s keys, ``2*l + 1`` its values, and each
    block is head-major (``[kv_head][token][dim]``).

    Every pool operation is atomic (one lock per pool), so a pool and its
    sequences may be used from several threads; one ``PagedKVCache`` is
    driven by one thread at a time.
    """

    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim,
                 dtype="float16", device="cpu", enable_prefix_caching=True, kv_scales=None,
                 stores=None):
        self._init(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device,
                   enable_prefix_caching, stores, forge_hashes=False, kv_scales=kv_scales)

    @classmethod
    def _with_forged_hashes(cls, *args, **kwargs):
        """Test seam (never used by the library): a pool on which every block
        of every sequence hashes alike, so that only the stored token ids and
        the identity chain keep another prefix's KV out.  Fixed when the
        pool is made; the hot paths carry no hook for it."""
        self = cls.__new__(cls)
        a = _constructor_args(*args, **kwargs)
        self._init(*a[:9], forge_hashes=True, kv_scales=a[9])
        return self

    def _init(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device,
              enable_prefix_caching, stores, forge_hashes, kv_scales=None):
        num_blocks = positive_int(num_blocks, "num_blocks")
        if num_blocks > 2**31 - 2:
            raise ValueError(f"num_blocks must be at most {2**31 - 2}, got {num_blocks}")
        self._block_size = positive_int(block_size, "block_size")
        self._num_layers = positive_int(num_layers, "num_layers")
        self._num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        self._head_dim = positive_int(head_dim, "head_dim")
        self._kind = dtypes.storage_kind(dtype)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}")
        self._layer_scales, self._head_scales = check_layer_scales(
            kv_scales, self._kind, self._num_layers, self._num_kv_heads)
        self._backend = get_backend(device)
        check_head_scales_backend(self._head_scales, self._backend)
        self._device = self._backend.normalize_device(device)
        self._num_blocks = num_blocks
        self._caching = bool(enable_prefix_caching)
        self._storage = self._backend.zeros(
            (2 * self._num_layers, num_blocks, self._num_kv_heads, self._block_size,
             self._head_dim), dtypes.STORAGE[self._kind])
        # int8: one float32 scale per (plane, block, kv head, token), addressed
        # by the same block ids as the storage (None for other dtypes)
        self._scales = (self._backend.zeros(self._storage.shape[:4], np.float32)
                        if self._kind == dtypes.I8 else None)
        self._planes = _pool_planes(self._backend, self._storage, self._kind, self._scales,
                                    self._layer_scales, self._head_scales)
        # write()'s scratch on a GPU (one int32 per slot), None on the CPU
        self._slot_owner = self._backend.slot_owner_table(num_blocks * self._block_size)
        self._core = _pool.PoolCore(num_blocks, self._block_size, forge_hashes)
        self._stores = None
        if stores is not None:
            if not self._caching:
                raise ValueError("stores need enable_prefix_caching=True (they keep the "
                                 "prefix cache's evicted blocks)")
            from .stores._tiers import StoreTiers
            self._stores = StoreTiers(self, stores)
            # evicted cached blocks are logged, and spilled (self._stores.on_evict,
            # the binding's hook every sequence calls) right after each
            # operation that evicted some, before anything writes them
            self._core.log_evictions = True
        self._lock = _CheckedLock(self._core) if _pool.DEBUG_BUILD else threading.RLock()
        # what every sequence on this pool binds to (PagedKVCache): the
        # backend's row writer makes an append one native call
        self._writer = self._row_writer()
        self._binding = _seq.PoolBinding(
            self._core, self._lock, self._block_size, self._num_layers, self._caching,
            self._writer,
            # (the storage, not the pool: no reference cycle keeps a dropped
            # pool's memory alive)
            functools.partial(_copy_blocks, self._backend, self._storage, self._scales),
            None if self._stores is None else self._stores.on_evict)
        # salt -> root of its chain in the prefix cache (negative, so it can
        # never equal a block's serial): block 0 of a salted sequence only
        # ever matches block 0 of the same salt, exactly, not via a hash.
        # The unsalted chain's root is -1.  A root is reference-counted by
        # the core (sequences holding the salt, cached blocks whose parent
        # it is) and forgotten here once its count fell to 0
        # (_forget_dead_salts); see "Salt roots" in _native/_pool.pyx.
        self._salt_roots = {}
        self._root_salts = {}

    def _acquire_salt_root(self, salt):
        """The root of ``salt`` (bytes) with one more reference, for a new
        sequence; the sequence drops it (core.c_root_decref) when freed."""
        with self._lock:
            self._forget_dead_salts()
            root = self._salt_roots.get(salt)
            if root is None:
                root = self._core.new_root()
                self._salt_roots[salt] = root
                self._root_salts[root] = salt
            else:
                self._core.root_incref(root)
            return root

    def _forget_dead_salts(self):
        # caller holds the lock
        if self._core.num_dead_roots:
            for root in self._core.take_dead_roots():
                del self._salt_roots[self._root_salts.pop(root)]

    # ------------------------------------------------------------ geometry
    num_blocks = property(lambda self: self._num_blocks, doc="Blocks in the pool.")
    block_size = property(lambda self: self._block_size, doc="Token positions per block.")
    num_layers = property(lambda self: self._num_layers)
    num_kv_heads = property(lambda self: self._num_kv_heads)
    head_dim = property(lambda self: self._head_dim)
    device = property(lambda self: self._device)
    enable_prefix_caching = property(lambda self: self._caching)

    @property
    def stores(self):
        """The prefix stores below this pool's prefix cache (a tuple; empty: none)."""
        return () if self._stores is None else self._stores.stores

    @property
    def dtype(self):
        """Canonical storage dtype name: 'float32', 'float16', 'bfloat16',
        'float8_e4m3fn', 'float8_e5m2' or 'int8'."""
        return dtypes.KIND_NAME[self._kind]

    @property
    def storage(self):
        """The whole storage array (see the class notes for its layout)."""
        return self._storage

    @property
    def scales(self):
        """int8 pools: the per-(token, kv head) float32 scales, shape
        ``(num_layers * 2, num_blocks, num_kv_heads, block_size)`` (plane
        ``2*l`` layer l's keys, ``2*l + 1`` its values); None otherwise."""
        return self._scales

    def _slot_writer(self):
        """The backend's writer of this pool's rows (``write_slots(layer, k,
        v, slots)``: True when it took the inputs as they are, else nothing
        written), or None: what kvcore.hf writes a decode step through,
        its slots checked once per step; anything it does not take goes to
        :meth:`write`."""
        return self._writer if hasattr(self._writer, "write_slots") else None

    def _step_lane(self):
        """A new step lane of this pool's backend (CUDA: a step's writes as
        packed launches and the fixed buffers of decode steps, what
        kvcore.hf issues per layer through; see backends/cuda/lane.py), or
        None where the backend has none.  One per caller (a lane packs its
        launches for itself)."""
        make = getattr(self._backend, "step_lane", None)
        if make is None:
            return None
        return make(self._planes.views, self._planes.codecs, (self._storage, self._scales),
                    self._num_blocks * self._block_size)

    def _row_writer(self):
        if self._head_scales is None:     # (the one-scale-per-layer writer as before)
            return self._backend.row_writer(self._storage, self._kind, self._scales,
                                            self._layer_scales)
        return self._backend.row_writer(self._storage, self._kind, self._scales,
                                        self._layer_scales, head_scales=self._head_scales)

    @property
    def kv_scales(self):
        """fp8 pools: the ``(k_scale, v_scale)`` pair of every layer, as set:
        each a float, or a tuple of ``num_kv_heads`` floats where that layer's
        keys (values) have per-kv-head scales that are not all equal (a
        per-head sequence of one repeated value reads back as that float);
        None for other dtypes."""
        return kv_scale_pairs(self._layer_scales, self._head_scales)

    @property
    def bytes_per_token(self):
        """Bytes one token position takes across all layers, K and V, its
        int8 scales included."""
        per = self._num_kv_heads * self._head_dim * dtypes.ITEMSIZE[self._kind]
        if self._kind == dtypes.I8:
            per += self._num_kv_heads * 4
        return 2 * self._num_layers * per

    @property
    def bytes_per_block(self):
        """Bytes one block takes across all layers, K and V (int8 scales included)."""
        return self.bytes_per_token * self._block_size

    def key_cache(self, layer):
        """Layer ``layer``'s keys: a view ``(num_blocks, num_kv_heads, block_size, head_dim)``."""
        return self._storage[2 * layer_index(layer, self._num_layers)]

    def value_cache(self, layer):
        """Layer ``layer``'s values: a view like :meth:`key_cache`."""
        return self._storage[2 * layer_index(layer, self._num_layers) + 1]

    def key_scales(self, layer):
        """int8 pools: layer ``layer``'s key scales, a float32 view
        ``(num_blocks, num_kv_heads, block_size)``; ValueError otherwise."""
        return self._scale_plane(2 * layer_index(layer, self._num_layers))

    def value_scales(self, layer):
        """int8 pools: layer ``layer``'s value scales (like :meth:`key_scales`)."""
        return self._scale_plane(2 * layer_index(layer, self._num_layers) + 1)

    def _scale_plane(self, plane):
        if self._scales is None:
            raise ValueError(f"only int8 pools keep per-token scales; this pool's dtype is "
                             f"{self.dtype!r} (fp8 pools: see kv_scales)")
        return self._scales[plane]

    # ------------------------------------------------------------ counts
    @property
    def num_free_blocks(self):
        """Blocks that can be handed out now (never used, released, or cached and unheld)."""
        return self._core.num_free

    @property
    def num_used_blocks(self):
        """Blocks with a reference count above zero."""
        return self._num_blocks - self._core.num_free

    @property
    def num_cached_blocks(self):
        """Blocks registered in the prefix cache, held or not."""
        return self._core.num_cached

    def ref_count(self, block_id):
        """Reference count of ``block_id``."""
        b = self._block_id(block_id)
        return int(self._core.ref_count(b))

    def is_cached(self, block_id):
        """True if ``block_id`` is registered in the prefix cache."""
        return self._core.is_cached(self._block_id(block_id))

    def stats(self):
        """Counters: blocks, prefix-cache queries and hits (in tokens), evictions.

        ``num_salts`` is the number of distinct salts the pool tracks now:
        those held by a sequence (not yet freed) or by a cached block of
        their chain.  A salt nothing refers to any more is forgotten, so it
        goes back to 0 once every salted sequence is freed and their cached
        blocks are evicted (or ``reset_prefix_cache`` is called).
        """
        with self._lock:
            self._forget_dead_salts()
            free = self._core.num_free
            q, h = self._core.prefix_queries, self._core.prefix_hits
            return {
                "num_blocks": self._num_blocks,
                "num_free_blocks": free,
                "num_used_blocks": self._num_blocks - free,
                "num_cached_blocks": self._core.num_cached,
                "prefix_queries": q,
                "prefix_hits": h,
                "prefix_hit_rate": h / q if q else 0.0,
                "evictions": int(self._core.evictions),
                "num_salts": len(self._salt_roots),
                "dtype": self.dtype,
                "bytes_per_token": self.bytes_per_token,
                "bytes_per_block": self.bytes_per_block,
                **({} if self._stores is None else {"stores": self._stores.stats()}),
            }

    def probe(self, token_ids, salt=None):
        """What ``PagedKVCache(pool, salt=salt).allocate(token_ids)`` would do now.

        Changes nothing (no blocks, no LRU order, no stats), so a scheduler
        can decide whether a request fits before admitting it.

        Returns
        -------
        dict
            ``hit_tokens`` (the prefix hit allocate would report),
            ``blocks_total`` (blocks the prompt occupies) and
            ``blocks_needed`` (free blocks allocate would consume: new
            blocks plus cached hits nobody holds); allocate succeeds iff
            ``blocks_needed <= num_free_blocks``.  With prefix stores,
            ``hit_tokens`` includes ``store_hit_tokens``: the following
            blocks the stores hold now (one lookup per store; allocate may
            find fewer if an entry goes or fails verification meanwhile).
        """
        from . import hashing
        from ._validate import salt_bytes, token_array

        tokens = token_array(token_ids)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("token_ids must hold at least one token, got an empty sequence")
        bs = self._block_size
        total = -(-n // bs)
        hits = hits_free = 0
        if self._caching:
            sb = salt_bytes(salt)
            max_hit = (n - 1) // bs
            r0, r1 = hashing.root_words(sb)
            hashes = self._core.chain_hashes(tokens, max_hit, r0, r1)
            with self._lock:
                self._forget_dead_salts()
                root = -1 if sb is None else self._salt_roots.get(sb)
                if root is not None:
                    hits, hits_free = self._core.probe(tokens, hashes, max_hit, root)
        if self._stores is None:
            return {"hit_tokens": hits * bs, "blocks_total": total,
                    "blocks_needed": total - hits + hits_free}
        extra = self._stores.probe_blocks(hashes, hits, max_hit) if self._caching else 0
        self._stores.emit_warnings()
        return {"hit_tokens": (hits + extra) * bs, "blocks_total": total,
                "blocks_needed": total - hits + hits_free, "store_hit_tokens": extra * bs}

    def reset_prefix_cache(self):
        """Forget every cached block nobody holds.

        Returns False, changing nothing, while any block is in use.
        """
        with self._lock:
            if not self._core.reset_prefix_cache():
                return False
            # no cached block refers to a salt root now: the salts no
            # sequence holds are forgotten
            self._forget_dead_salts()
            return True

    def flush_to_stores(self, timeout=None):
        """Push everything on its way to the prefix stores and write every
        block of the prefix cache to the first store, keeping it cached.

        Spills below an in-memory first store (``DiskStore``,
        ``RedisStore``, a cluster) are written by a background worker; this
        waits until it has written what was queued, then writes the cached
        blocks on the calling thread (the pool's lock is held only while
        their bytes are copied out).  For a graceful shutdown, so that the
        next process on the same ``DiskStore`` or ``RedisStore`` finds this
        one's prefixes, and before reading a store's contents.

        Parameters
        ----------
        timeout : float, optional
            Most seconds to wait for the worker (None: as long as it takes).

        Returns
        -------
        int
            How many cached blocks were written (0 without stores, or when
            the stores failed: a ``StoreWarning`` says why).
        """
        from .stores._worker import check_timeout

        timeout = check_timeout(timeout)
        if self._stores is None:
            return 0
        n = self._stores.flush(timeout)
        self._stores.emit_warnings()
        return n

    def wait_spills(self, timeout=None):
        """Wait until the spills queued so far have reached their stores.

        Blocks evicted into a store that does I/O (below an in-memory first
        store, or a ``DiskStore``/``RedisStore`` first) are written by the
        pool's store worker in the background; this waits for what is
        queued now, and changes nothing (unlike :meth:`flush_to_stores`,
        it writes no cached block).  Then ``stats()["stores"]`` and the
        stores' contents show every spill so far.

        Parameters
        ----------
        timeout : float, optional
            Most seconds to wait (None: as long as it takes).

        Returns
        -------
        bool
            True once the queued spills are written (always True without
            stores), False if ``timeout`` passed first.
        """
        from .stores._worker import check_timeout

        timeout = check_timeout(timeout)
        if self._stores is None:
            return True
        done = self._stores.wait_spills(timeout)
        self._stores.emit_warnings()
        return done

    def close(self):
        """Finish the background work of the prefix stores: cancel the
        prefetches in flight (:meth:`prefetch`), push every queued spill to
        its store and stop the worker threads.  Idempotent; the pool stays
        usable (a later spill or prefetch starts a worker again).  Without
        stores, does nothing."""
        if self._stores is not None:
            self._stores.close()
            self._stores.emit_warnings()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def prefetch(self, token_ids, salt=None):
        """Start loading the prefix-store blocks of prompt ``token_ids`` into
        the pool in the background, for a later ``allocate`` of it.

        The longest run of the prompt's blocks after the pool's own prefix
        hit that the stores hold is fetched, verified and copied into free
        blocks by the store worker, which then leaves them in the prefix
        cache (cached, evictable: a prefetch that is never used costs
        nothing but the blocks' LRU place).  ``PagedKVCache(pool,
        salt=salt).allocate(token_ids)`` afterwards hits what has arrived
        and loads or computes the rest.  See docs/stores.md.

        Parameters
        ----------
        token_ids : array_like of int
            The prompt, as ``allocate`` takes it (at least one token).
        salt : str or bytes, optional
            The salt the sequence will have.

        Returns
        -------
        kvcore.stores.Prefetch
            ``done()``, ``wait(timeout=None)``, ``blocks_ready`` (leading
            blocks of the prompt in the pool so far) and ``cancel()``.
            Without stores it is done at once.
        """
        from ._validate import salt_bytes, token_array
        from .stores._worker import Prefetch

        tokens = token_array(token_ids)
        if tokens.shape[0] == 0:
            raise ValueError("token_ids must hold at least one token, got an empty sequence")
        sb = salt_bytes(salt)
        if self._stores is None:
            return Prefetch.finished(self.probe(tokens, salt)["hit_tokens"] // self._block_size)
        return self._stores.prefetch(tokens, sb)

    # ------------------------------------------------------------ store interface
    # What a tier below the prefix cache needs of the pool; kvcore.stores
    # uses nothing else (docs/stores.md, "The pool's store interface").

    @property
    def lock(self):
        """The pool's re-entrant lock: every pool operation holds it.  A prefix
        tier holds it while it copies cached blocks out (so that none is
        evicted and rewritten meanwhile), and never while it does I/O."""
        return self._lock

    def take_evicted_blocks(self):
        """The cached blocks evicted since the last call, for the prefix
        stores (logged only on a pool with stores; the log is then empty).

        Returns
        -------
        tuple
            ``(block_ids int32 (n,), hashes uint64 (n, 2), parent_hashes,
            chain_roots, token_ids int32 (n, block_size))``: what each was
            registered with.  Its KV is still in the block until the caller
            releases the pool's lock (the stores copy it out at once, under
            the lock, with :meth:`export_blocks`).
        """
        with self._lock:
            return self._core.take_evicted()

    def cached_block_ids(self):
        """The ids of the blocks in the prefix cache now (int32, ascending)."""
        with self._lock:
            return np.flatnonzero([self._core.is_cached(b)
                                   for b in range(self._num_blocks)]).astype(np.int32)

    def cached_block_entries(self, block_ids):
        """:meth:`take_evicted_blocks`' tuple for cached blocks ``block_ids``
        (each must be cached: ValueError otherwise), evicting nothing."""
        ids = np.asarray(block_ids, np.int32).reshape(-1)
        with self._lock:
            return self._core.cached_entries(ids)

    def block_identity_links(self, block_ids):
        """``(serial, parent_serial)`` int64 arrays: the identity-chain link
        each block was last registered with (kept after an eviction until
        the block is registered again), so a store can tell which prefix an
        evicted block's KV belongs to.  A parent serial < 0 is a salt root
        (:meth:`salt_of_root`)."""
        ids = np.asarray(block_ids, np.int32).reshape(-1)
        with self._lock:
            return self._core.identity_links(ids)

    def cached_ancestry(self, hash_words, serial):
        """The cached blocks up the identity chain from the one with chained
        hash ``hash_words`` (lo, hi) registered as ``serial``, nearest
        first: ``(block_ids int32, serials int64, end, end_words)``, where
        ``end`` is the parent serial the walk stopped at and ``end_words``
        its chained hash."""
        lo, hi = (int(w) for w in hash_words)
        with self._lock:
            return self._core.cached_ancestry(lo, hi, int(serial))

    def salt_of_root(self, root):
        """The salt (bytes) of salt root ``root`` (a parent serial < 0; -1,
        the unsalted root, gives None), or None when the pool has forgotten
        it (no sequence or cached block holds it any more)."""
        with self._lock:
            return self._root_salts.get(int(root))

    def check(self):
        """Verify the bookkeeping's internal invariants (raises AssertionError)."""
        with self._lock:
            return self._core.check()

    def debug_snapshot(self):
        """The whole bookkeeping state, as plain Python values, mainly for
        tests (like vLLM's ``get_all_free_blocks``): comparing two snapshots
        shows whether an operation changed anything.

        Returns
        -------
        dict
            ``ref_counts`` (list, per block), ``cached`` (list of bools, per
            block), ``lru_order`` (the cached blocks nobody holds, least
            recently used first: evicted in this order), ``num_free_blocks``,
            ``num_uncached_free`` (free blocks outside the prefix cache) and
            ``stats`` (:meth:`stats`).
        """
        with self._lock:
            core = self._core
            n = self._num_blocks
            return {
                "ref_counts": [int(core.ref_count(b)) for b in range(n)],
                "cached": [bool(core.is_cached(b)) for b in range(n)],
                "lru_order": list(core.lru_order()),
                "num_free_blocks": int(core.num_free),
                "num_uncached_free": int(core.num_uncached_free),
                "stats": self.stats(),
            }

    def debug_cached_block(self, block_id):
        """``(token_ids, hash)`` a cached block is registered with (token ids
        an int32 array, hash two ints), mainly for tests; raises ValueError
        for a block that is not cached."""
        b = self._block_id(block_id)
        with self._lock:
            if not self._core.is_cached(b):
                raise ValueError(f"block {b} is not in the prefix cache")
            lo, hi = self._core.cached_hash(b)
            return self._core.cached_tokens(b).copy(), (int(lo), int(hi))

    # ------------------------------------------------------------ data
    def write(self, layer, k, v, slots, src_dtype=None, check=True):
        """Write ``n`` tokens' K and V into their slots (vLLM's reshape_and_cache).

        Parameters
        ----------
        layer : int
        k, v : arrays ``(n, num_kv_heads, head_dim)``
            float32, float16 or bfloat16 (ml_dtypes, torch.bfloat16, or
            uint16 bits with ``src_dtype="bfloat16"``); NumPy arrays or torch
            tensors; converted to the storage dtype.  They are read as they
            were when the call began, even when they are views of this
            pool's storage.
        slots : 1-D integer array of length n
            Token i goes to block ``slots[i] // block_size``, offset
            ``slots[i] % block_size``; -1 skips the token.  Every slot is
            checked before anything is written (IndexError).  A slot named
            by several tokens gets the last one's K and V (on every device).
        check : bool, default True
            Only for slots in GPU memory on a CUDA pool (elsewhere every slot
            is checked on the host, which costs no synchronisation).  True:
            the slots are checked on the device and the call waits for the
            verdict (an 8-byte read; nothing else is copied) before writing.
            False: the raw call for CUDA graphs: nothing is read back or
            waited for; the kernels still never write outside the pool (a
            slot out of range is skipped, like -1) but such a slot is not
            reported: the caller vouches for the slots.
        """
        layer = layer_index(layer, self._num_layers)
        if not isinstance(check, (bool, np.bool_)):
            raise TypeError(f"check must be a bool, got {type(check).__name__}")
        k, v, src_kind = self._kv_input(k, v, src_dtype)
        n = k.shape[0]
        backend = self._backend
        on_device = backend.device_slots(slots, n)  # GPU slots stay on the GPU
        if on_device is None:
            slots, check = self._slots(slots, n), False  # checked here, on the host
        else:
            slots = on_device
        k_plane, v_plane = self._planes.views[layer]
        k_codec, v_codec = self._planes.codecs[layer]
        backend.write_slots_kv(k_plane, v_plane, k, v, slots, src_kind, k_codec, v_codec,
                               self._slot_owner, bool(check))

    def gather(self, layer, block_table, start, end, dtype=None, out=None):
        """Raw read of positions ``start..end-1`` of the sequence whose blocks are ``block_table``.

        Parameters
        ----------
        layer : int
        block_table : 1-D integer array (or list, or torch tensor)
        start, end : int
        dtype : str, optional
            Result dtype, e.g. "float32"; default the storage dtype.  For
            fp8 and int8 pools, a float dtype dequantizes (``fp8 * scale``,
            ``code * scale``); the default returns the stored codes (fp8 bits
            as uint8, int8 codes: see :meth:`gather_scales` for their scales).
        out : (k_out, v_out), optional
            Writable arrays ``(num_kv_heads, end - start, head_dim)`` of the
            result dtype (NumPy arrays or torch tensors, ``torch.bfloat16``
            for bfloat16), filled and returned.

        Returns
        -------
        (k, v) : new contiguous arrays ``(num_kv_heads, end - start, head_dim)``
            In the storage dtype, or ``dtype`` if given (e.g. "float32");
            ``out`` when given.
        """
        layer = layer_index(layer, self._num_layers)
        table, start, end = self._table_range(block_table, start, end)
        return self._gather(layer, table, start, end, dtype, out)

    def gather_batch(self, layer, block_tables, lengths, dtype=None, out=None):
        """Positions ``0..lengths[s]-1`` of a batch of sequences, padded.

        Parameters
        ----------
        layer : int
        block_tables : integer array ``[batch, max_blocks]``
            Row s lists sequence s's blocks in position order (e.g. from
            :func:`kvcore.padded_block_tables`); entries past a sequence's
            length are not read.
        lengths : integer array ``[batch]``
        dtype : str, optional
            Output dtype (default the storage dtype).
        out : (k_out, v_out), optional
            Writable arrays of the result's shape and dtype, filled and returned.

        Returns
        -------
        (k, v) : new arrays ``(batch, num_kv_heads, max(lengths), head_dim)``
            Positions past a sequence's length are +0 (padding).
        """
        layer = layer_index(layer, self._num_layers)
        t = _arrays.index_array(self._backend, block_tables, "block_tables")
        n = _arrays.index_array(self._backend, lengths, "lengths")
        if t.ndim != 2:
            raise ValueError(f"block_tables must be 2-D [batch, max_blocks], got shape {t.shape}")
        if n.ndim != 1 or n.shape[0] != t.shape[0]:
            raise ValueError(f"lengths must be 1-D with one entry per row of block_tables "
                             f"({t.shape[0]}), got shape {n.shape}")
        if t.size and t.dtype.kind not in "iu":
            raise TypeError(f"block_tables must hold integers, got dtype {t.dtype}")
        if n.size and n.dtype.kind not in "iu":
            raise TypeError(f"lengths must hold integers, got dtype {n.dtype}")
        cap = t.shape[1] * self._block_size
        if n.size and (n.min() < 0 or n.max() > cap):
            i = int(np.argmax((n < 0) | (n > cap)))
            raise ValueError(f"lengths must lie in 0..{cap} (max_blocks * block_size), "
                             f"got {int(n[i])} at index {i}")
        need = -(-n.astype(np.int64) // self._block_size) if n.size else n
        for s in range(t.shape[0]):
            row = t[s, :need[s]]
            if row.size and (row.min() < 0 or row.max() >= self._num_blocks):
                j = int(np.argmax((row < 0) | (row >= self._num_blocks)))
                raise IndexError(f"block_tables[{s}, {j}] must be in 0..{self._num_blocks - 1}, "
                                 f"got {int(row[j])}")
        dst_kind = _arrays.read_kind(dtype, self._kind)
        backend = self._backend
        width = int(n.max()) if n.size else 0
        shape = (t.shape[0], self._num_kv_heads, width, self._head_dim)
        # on a GPU: one upload each, shared by the K and the V gather
        t32 = backend.from_host(np.ascontiguousarray(t, np.int32))
        n32 = backend.from_host(np.ascontiguousarray(n, np.int32))
        outs = _arrays.out_pair(self._backend, out, shape, dst_kind)
        tmps = self._targets(outs, out, shape, dst_kind)
        for plane, codec, tmp in zip(self._planes.views[layer], self._planes.codecs[layer],
                                     tmps):
            backend.gather_batch(plane, t32, n32, tmp, codec, dst_kind)
        return self._deliver(outs, tmps)

    def gather_scales(self, layer, block_table, start, end):
        """int8 pools: the scales of the codes :meth:`gather` returns for the
        same arguments: ``(k_scales, v_scales)``, new float32 arrays
        ``(num_kv_heads, end - start)``; ``code * scale`` is the value.
        ValueError for other dtypes (fp8 pools: :attr:`kv_scales`)."""
        layer = layer_index(layer, self._num_layers)
        if self._scales is None:
            self._scale_plane(0)   # raises, naming the dtype
        table, start, end = self._table_range(block_table, start, end)
        return self._gather_scales(layer, table, start, end)

    def _gather_scales(self, layer, table, start, end):
        pos = np.arange(start, end, dtype=np.int64)
        blocks = table.astype(np.int64)[pos // self._block_size]
        offs = pos % self._block_size
        xp = self._backend.xp
        if xp is not np:
            blocks, offs = self._backend.from_host(blocks), self._backend.from_host(offs)
        return tuple(xp.ascontiguousarray(self._scales[2 * layer + i][blocks, :, offs].T)
                     for i in (0, 1))

    def copy_blocks_to(self, dst_pool, src_block_ids, dst_block_ids):
        """Copy whole blocks (every layer, K and V) into another pool.

        For offloading: ``dst_pool`` may live on another device (a CPU pool
        as host memory for a GPU pool, and back).  Both pools must have the
        same block geometry and dtype.  Reference counts do not change: the
        caller owns the ids on both sides (e.g. a sequence's ``block_table``
        here and blocks it took there).  A destination block in
        ``dst_pool``'s prefix cache leaves it (counted as an eviction, its
        old KV spilled to the prefix stores first): the cache never hands
        back the new contents under the old prefix.

        ``dst_pool`` may be this pool.  Every destination receives its
        source's contents as they were before the call, even where a source
        id is also a destination id (``copy_blocks_to(pool, [0, 1], [1, 2])``
        puts the old block 0 in block 1 and the old block 1 in block 2, and
        ``[0, 1] -> [1, 0]`` swaps them): such sources are staged in a
        temporary buffer first.

        Parameters
        ----------
        dst_pool : BlockPool
        src_block_ids, dst_block_ids : 1-D integer arrays of equal length
            A source id may repeat (one block copied to several places); a
            destination id may not (ValueError: which copy would win is
            undefined).
        """
        src, dst = self._copy_ids(dst_pool, src_block_ids, dst_block_ids)
        if not src.size:
            return
        if self._layer_scales is not None and not (
                np.array_equal(self._layer_scales, dst_pool._layer_scales)
                and _same_heads(self._head_scales, dst_pool._head_scales)):
            raise ValueError(f"dst_pool must have the same kv_scales as this pool, "
                             f"{self.kv_scales}; got {dst_pool.kv_scales}")
        dst_pool._before_overwrite(dst)
        # a GPU on either side drives the copy (it can read and write host memory)
        backend = self._backend.copier_for(dst_pool._backend)
        # the blocks' data, and their int8 scales (same block ids) with them
        arrays = [(self._storage, dst_pool._storage)]
        if self._scales is not None:
            arrays.append((self._scales, dst_pool._scales))
        if dst_pool is not self:
            for mine, theirs in arrays:
                backend.copy_blocks_between(mine, src, theirs, dst)
        else:
            self._copy_within(backend, [a for a, _ in arrays], src, dst)

    def _copy_ids(self, dst_pool, src_block_ids, dst_block_ids):
        """Checked int32 ``(src, dst)`` of :meth:`copy_blocks_to`: a pool of
        this geometry and dtype, ids in range, as many on both sides, no
        destination twice."""
        if not isinstance(dst_pool, BlockPool):
            raise TypeError(f"dst_pool must be a kvcore.BlockPool, got {type(dst_pool).__name__}")
        mine = (self._num_layers, self._num_kv_heads, self._block_size, self._head_dim, self._kind)
        theirs = (dst_pool.num_layers, dst_pool.num_kv_heads, dst_pool.block_size,
                  dst_pool.head_dim, dtypes.storage_kind(dst_pool.dtype))
        if mine != theirs:
            raise ValueError(
                "dst_pool must have the same (num_layers, num_kv_heads, block_size, head_dim, "
                f"dtype) as this pool, {mine[:4] + (self.dtype,)}; got "
                f"{theirs[:4] + (dst_pool.dtype,)}")
        src = self._table(src_block_ids, "src_block_ids")
        dst = dst_pool._table(dst_block_ids, "dst_block_ids")
        if src.shape != dst.shape:
            raise ValueError(f"src_block_ids and dst_block_ids must have the same length, got "
                             f"{src.shape[0]} and {dst.shape[0]}")
        uniq, counts = np.unique(dst, return_counts=True)
        if uniq.size != dst.size:
            i = int(np.flatnonzero(counts > 1)[0])
            raise ValueError(
                f"dst_block_ids must not repeat a block id, got {int(uniq[i])} at indices "
                f"{np.flatnonzero(dst == uniq[i]).tolist()}")
        return src, dst

    def _copy_within(self, backend, arrays, src, dst):
        """``copy_blocks_to`` this pool: every destination gets its source as
        it was before the call.  Sources that are also destinations are read
        before anything is written: copied out to a buffer, then in from it
        last."""
        staged = np.isin(src, dst)
        if not staged.any():
            self._copy_blocks(src, dst)
            return
        stage_ids, where = np.unique(src[staged], return_inverse=True)
        stage_ids = stage_ids.astype(np.int32)
        bufs = []
        for a in arrays:
            buf = backend.empty((a.shape[0], stage_ids.size) + a.shape[2:], a.dtype)
            backend.copy_blocks_between(a, stage_ids, buf,
                                        np.arange(stage_ids.size, dtype=np.int32))
            bufs.append(buf)
        direct = ~staged
        if direct.any():
            self._copy_blocks(src[direct], dst[direct])
        for a, buf in zip(arrays, bufs):
            backend.copy_blocks_between(buf, where.astype(np.int32).ravel(), a,
                                        np.ascontiguousarray(dst[staged]))

    # ------------------------------------------------------------ helpers
    def _block_id(self, block_id):
        b = index_int(block_id, "block_id")
        if not 0 <= b < self._num_blocks:
            raise IndexError(f"block_id must be in 0..{self._num_blocks - 1}, got {b}")
        return b

    def _kv_input(self, k, v, src_dtype):
        """Validated (k, v, kind): same shape (n, heads, dim), same dtype
        (bfloat16 as uint16 bits), each apart from this pool's storage (an
        input that is a view of any plane of it is copied once, so every
        plane written later reads it as it was)."""
        backend = self._backend
        k, src_kind = _arrays.float_input(backend, k, "k", src_dtype)
        v, sv = _arrays.float_input(backend, v, "v", src_dtype)
        want = (self._num_kv_heads, self._head_dim)
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 3 or a.shape[1:] != want:
                raise ValueError(
                    f"{name} must have shape (n, {want[0]}, {want[1]}) "
                    f"(n, num_kv_heads, head_dim), got {tuple(a.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if sv != src_kind:
            raise TypeError(f"k and v must have the same dtype, got "
                            f"{dtypes.KIND_NAME[src_kind]} and {dtypes.KIND_NAME[sv]}")
        return self._planes.apart(k), self._planes.apart(v), src_kind

    def _direct(self, out):
        """Whether a gather may write into ``out`` (bits) in place."""
        return self._backend.direct_out(out, self._storage)

    def _slots(self, slots, n):
        fast = _pool.checked_slots(slots, n, self._num_blocks * self._block_size)
        if fast is not None:
            return fast
        s = _arrays.index_array(self._backend, slots, "slots")
        if s.ndim != 1 or s.shape[0] != n:
            raise ValueError(f"slots must be 1-D of length {n} (one per token), got shape {s.shape}")
        if n and s.dtype.kind not in "iu":
            raise TypeError(f"slots must hold integers, got dtype {s.dtype}")
        if n:
            # Check the caller's values before the int64 cast: a uint64 slot
            # of 2**64 - 1 would otherwise wrap to -1 and be skipped.
            limit = self._num_blocks * self._block_size
            bad = (s >= limit) if s.dtype.kind == "u" else (s < -1) | (s >= limit)
            if bad.any():
                i = int(np.argmax(bad))
                raise IndexError(
                    f"slots must be -1 (skip) or in 0..{limit - 1} "
                    f"(num_blocks * block_size - 1), got {int(s[i])} at index {i}")
        return np.ascontiguousarray(s, dtype=np.int64)

    def _table_range(self, block_table, start, end):
        """Checked ``(table, start, end)`` of a raw read of positions
        ``start .. end - 1`` through ``block_table``."""
        table = self._table(block_table)
        start = index_int(start, "start")
        end = index_int(end, "end")
        cap = len(table) * self._block_size
        if not 0 <= start <= end <= cap:
            raise ValueError(
                f"start and end must satisfy 0 <= start <= end <= {cap} "
                f"(len(block_table) * block_size), got start={start}, end={end}")
        return table, start, end

    def _table(self, block_table, arg="block_table"):
        t = _arrays.index_array(self._backend, block_table, arg)
        if t.ndim != 1:
            raise ValueError(f"{arg} must be 1-D, got shape {t.shape}")
        if t.size and t.dtype.kind not in "iu":
            raise TypeError(f"{arg} must hold integers, got dtype {t.dtype}")
        if t.size and (t.min() < 0 or t.max() >= self._num_blocks):
            bad = (t < 0) | (t >= self._num_blocks)
            i = int(np.argmax(bad))
            raise IndexError(
                f"{arg} entries must be in 0..{self._num_blocks - 1}, "
                f"got {int(t[i])} at index {i}")
        return np.ascontiguousarray(t, dtype=np.int32)

    def _gather(self, layer, table, start, end, dtype, out=None):
        """(k, v) of positions start..end-1 of (validated) ``layer`` and
        ``table`` (int32, aligned), into ``out`` when given."""
        dst_kind = _arrays.read_kind(dtype, self._kind)
        backend = self._backend
        shape = (self._num_kv_heads, end - start, self._head_dim)
        outs = _arrays.out_pair(self._backend, out, shape, dst_kind)
        if end == start:
            return outs[0][1], outs[1][1]
        tmps = self._targets(outs, out, shape, dst_kind)
        # on a GPU: one upload of the blocks the range needs, for K and V
        table = backend.from_host(table[:-(-end // self._block_size)])
        for plane, codec, tmp in zip(self._planes.views[layer], self._planes.codecs[layer],
                                     tmps):
            backend.gather(plane, table, start, end, tmp, codec, dst_kind)
        return self._deliver(outs, tmps)

    def _targets(self, outs, out, shape, kind):
        """What the kernels write for each of ``outs``: the array itself, or
        (a caller's ``out`` that is not C-contiguous, not aligned, or meets
        the storage) a temporary copied in by :meth:`_deliver` once both
        K and V have been read."""
        if out is None:
            return [o[0] for o in outs]
        backend = self._backend
        return [dst if self._direct(dst) else backend.empty(shape, dtypes.STORAGE[kind])
                for dst, _ in outs]

    @staticmethod
    def _deliver(outs, tmps):
        for (dst, _), tmp in zip(outs, tmps):
            if tmp is not dst:
                dst[...] = tmp
        return outs[0][1], outs[1][1]

    # ------------------------------------------------------------ private interface
    # What the other public classes of kvcore (PagedKVCache, the block-table
    # helpers) may ask of a pool; nobody else reads its storage, core, lock
    # or backend.

    # _binding: the ``PoolBinding`` a new sequence's core is made with
    # (an attribute, read once per PagedKVCache).

    def _copy_blocks(self, src, dst):
        """Copy blocks ``src[i]`` to ``dst[i]`` (every layer, K and V, int8
        scales included)."""
        _copy_blocks(self._backend, self._storage, self._scales, np.asarray(src, np.int32),
                     np.asarray(dst, np.int32))

    def _before_overwrite(self, block_ids):
        """Blocks ``block_ids`` (checked int32) are about to be overwritten
        in place (``copy_blocks_to``): those in the prefix cache leave it,
        as evictions, their KV spilled to the prefix stores first, so that
        neither the cache nor a store hands the new contents back under
        the old prefix."""
        if not self._caching:
            return
        with self._lock:
            if self._core.uncache(block_ids) and self._core.num_evict_log \
                    and self._stores is not None:
                self._stores.spill()   # copies out now; disk/network I/O on the worker

    def _take_blocks(self, n, out):
        """Take ``n`` free blocks into int32 ``out`` (reference count 1):
        True, or False when fewer are free (nothing taken)."""
        with self._lock:
            ok = self._core.take(n, out)
            if self._core.num_evict_log and self._stores is not None:
                self._stores.spill()
            return ok

    def _release_blocks(self, block_ids):
        """Give back blocks taken with :meth:`_take_blocks`."""
        with self._lock:
            self._core.release(block_ids)

    def _write_positions(self, layer, k, v, slots, src_kind):
        """K and V (validated by :meth:`_kv_input`) to the slots of a
        sequence's own positions in (validated) ``layer``."""
        backend = self._backend
        k_plane, v_plane = self._planes.views[layer]
        k_codec, v_codec = self._planes.codecs[layer]
        backend.write_slots(k_plane, k, slots, src_kind, k_codec)
        backend.write_slots(v_plane, v, slots, src_kind, v_codec)

    def export_blocks(self, block_ids):
        """The contents of blocks ``block_ids`` as host bytes: one
        C-contiguous ``numpy.uint8`` array of :attr:`bytes_per_block` bytes
        per block: the block's planes in storage order
        (``[2 * layer + (0: K, 1: V)][kv_head][token][dim]`` in the storage
        dtype), then, for int8 pools, its float32 scales in the same order
        (``[2 * layer + (0: K, 1: V)][kv_head][token]``).  The one place block
        contents leave the pool (prefix stores); :meth:`import_blocks` is its
        inverse.  The caller makes sure nobody writes the blocks meanwhile
        (the stores hold the pool's lock, or own the blocks)."""
        out = []
        host = self._backend.to_host
        for b in np.asarray(block_ids, np.int64).tolist():
            a = np.ascontiguousarray(host(self._storage[:, b])).reshape(-1).view(np.uint8)
            if self._scales is not None:
                sc = np.ascontiguousarray(host(self._scales[:, b]), np.float32)
                a = np.concatenate([a, sc.reshape(-1).view(np.uint8)])
            out.append(a)
        return out

    def import_blocks(self, block_ids, payloads, seeds=None):
        """Write ``payloads`` (bytes-like, as :meth:`export_blocks` gives
        them) into blocks ``block_ids``.  Checks every payload's size before
        writing anything (ValueError).  With ``seeds`` (one int per block),
        returns the XXH3-64 of each payload with its seed (the entries'
        checksum, kvcore/stores/_format.py), computed while copying (prefix
        stores verify entries so); else None."""
        ids = np.asarray(block_ids, np.int64).tolist()
        if len(ids) != len(payloads) or (seeds is not None and len(seeds) != len(ids)):
            raise ValueError(f"payloads (and seeds) must hold one entry per block ({len(ids)}), "
                             f"got {len(payloads)}")
        pays = []
        per_block = self.bytes_per_block      # (a computed property: once, not per block)
        for i, p in enumerate(payloads):
            a = np.frombuffer(p, dtype=np.uint8)
            if a.nbytes != per_block:
                raise ValueError(f"payloads[{i}] must hold {per_block} bytes (one "
                                 f"block), got {a.nbytes}")
            pays.append(a)
        from .attention import get_num_threads
        # (int8: the codes, then the scales that follow them in a payload)
        planes = [a for a in (self._storage, self._scales) if a is not None]
        return self._backend.write_block_bytes(planes, ids, pays, seeds, get_num_threads())

    def _device_array(self, a):
        """Host array ``a`` on this pool's device."""
        return self._backend.from_host(a)

    def __repr__(self):
        return (f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"num_layers={self._num_layers}, num_kv_heads={self._num_kv_heads}, "
                f"head_dim={self._head_dim}, dtype={self.dtype!r}, device={self._device!r}, "
                f"free={self.num_free_blocks}, cached={self.num_cached_blocks})")


def _constructor_args(num_blocks, block_size, num_layers, num_kv_heads, head_dim,
                      dtype="float16", device="cpu", enable_prefix_caching=True, kv_scales=None,
                      stores=None):
    return (num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device,
            enable_prefix_caching, stores, kv_scales)


def _copy_blocks(backend, storage, scales, src, dst):
    """The one block copy within a pool (copy-on-write, ``copy_blocks_to``
    within the pool): ``storage[:, dst[i]] = storage[:, src[i]]``, and the
    int8 ``scales`` (same block ids) with it."""
    backend.copy_blocks(storage, src, dst)
    if scales is not None:
        backend.copy_blocks(scales, src, dst)


def _same_heads(a, b):
    """Whether two pools' per-kv-head fp8 scales (or both None) are equal."""
    return (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def _pool_planes(backend, storage, kind, scales, layer_scales, head_scales=None):
    """The ``Planes`` of a pool's storage (plane ``2 * l + i``: layer l's
    keys, i = 0, or values, i = 1) and int8 scales (the same planes)."""
    split = lambda a: None if a is None else a.reshape((a.shape[0] // 2, 2) + a.shape[1:])
    return Planes(backend, split(storage), kind, split(scales), layer_scales,
                  owned=(storage, scales), head_scales=head_scales)
