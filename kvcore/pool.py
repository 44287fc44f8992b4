"""BlockPool: one pool of KV blocks shared by many sequences."""
import threading

import numpy as np

from . import _arrays, dtypes, hashing
from .backends import get_backend
from ._forksafe import POOL, fork_guard
from ._native import _pool, _seq
from ._planes import check_layer_scales, check_head_scales_backend, kv_scale_pairs
from ._pool_data import PoolData
from ._pool_debug import CheckedLock, PoolDebug
from ._pool_stores import PoolStores
from ._store_port import StorePort
from ._validate import (index_int, kernel_count, layer_index, num_layers_int, positive_int,
                        salt_bytes, token_array)
from .stores._worker import Prefetch, check_timeout

__all__ = ["BlockPool", "store_port"]

#: most seconds leaving a ``with pool:`` block waits for the prefix stores
#: (``close(timeout=EXIT_TIMEOUT)``: spills still queued then are dropped)
EXIT_TIMEOUT = 10.0


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
        store worker, never under the pool's lock (:meth:`flush_to_stores`,
        :meth:`wait_spills` and :meth:`close` drain it); :meth:`prefetch`
        loads a prompt's stored blocks ahead of its ``allocate``.  Needs
        ``enable_prefix_caching``.
    kv_scales : sequence of num_layers (k_scale, v_scale) pairs, optional
        fp8 pools only: float32 scales (default 1.0), each a float (the
        layer's) or ``num_kv_heads`` floats (one per KV head, CPU pools), or
        an array of shape ``(num_layers, 2)`` or ``(num_layers, 2,
        num_kv_heads)``: a value x of head h is stored as ``fp8(x /
        scale_h)``, saturated to the largest finite fp8 value (+-inf
        included; NaN stays NaN), and read as ``fp8 * scale_h``.

    Notes
    -----
    Storage is one allocation of shape
    ``(num_layers * 2, num_blocks, num_kv_heads, block_size, head_dim)``:
    plane ``2*l`` is layer ``l``'s keys, ``2*l + 1`` its values, and each
    block is head-major (``[kv_head][token][dim]``).  int8 pools keep one
    float32 scale per (token, kv head), ``max|x| / 127``, in :attr:`scales`
    (same block ids; every block copy moves them with the codes); a raw
    :meth:`gather` returns codes, :meth:`gather_scales` their scales
    (docs/api.md, "Low precision").

    Every pool operation is atomic (one lock per pool), so a pool and its
    sequences may be used from several threads; one ``PagedKVCache`` is
    driven by one thread at a time.  A pool may be used on both sides of a
    ``fork()``, whatever its threads were doing: the child gets the pool as
    it was between two operations (its store worker's queued spills
    included, its prefetches in flight cancelled).  :attr:`debug` holds the
    introspection for tests and debugging.
    """

    _forge_hashes = False    # (see _with_forged_hashes)

    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim,
                 dtype="float16", device="cpu", enable_prefix_caching=True, kv_scales=None,
                 stores=None):
        num_blocks = positive_int(num_blocks, "num_blocks")
        if num_blocks > 2**31 - 2:
            raise ValueError(f"num_blocks must be at most {2**31 - 2}, got {num_blocks}")
        self._block_size = positive_int(block_size, "block_size")
        self._num_layers = num_layers_int(num_layers)
        self._num_kv_heads = kernel_count(num_kv_heads, "num_kv_heads")
        self._head_dim = kernel_count(head_dim, "head_dim")
        self._kind = dtypes.storage_kind(dtype)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}")
        layer_scales, head_scales = check_layer_scales(
            kv_scales, self._kind, self._num_layers, self._num_kv_heads)
        self._backend = get_backend(device)
        check_head_scales_backend(head_scales, self._backend)
        self._device = self._backend.normalize_device(device)
        self._num_blocks = num_blocks
        self._caching = bool(enable_prefix_caching)
        # the storage and the data ops over it; the names below are what the
        # other public classes read (attention, kvcore.tables)
        self._data = PoolData(self._backend, num_blocks, self._block_size, self._num_layers,
                              self._num_kv_heads, self._head_dim, self._kind,
                              layer_scales, head_scales)
        self._storage, self._scale_planes = self._data.storage, self._data.scale_planes
        # the pool's one native writer, or None (see PoolData.writer): what a
        # sequence appends through (via the binding) and kvcore.hf writes a
        # decode step's K/V through (write_slots; it declines what it does
        # not take, which then goes to write())
        self._writer = self._data.writer
        self._core = _pool.PoolCore(num_blocks, self._block_size, self._forge_hashes)
        self._lock = CheckedLock(self._core) if _pool.DEBUG_BUILD else threading.RLock()
        # (a fork waits for the operation in progress: see kvcore._forksafe)
        fork_guard(self, "_lock", POOL)
        # what passes between this pool and prefix stores (StorePort)
        self._port = StorePort(self._core, self._lock, self._backend, self._storage,
                               self._scale_planes, self._layout(), self.bytes_per_block)
        self._stores = None
        if stores is not None:
            if not self._caching:
                raise ValueError("stores need enable_prefix_caching=True (they keep the "
                                 "prefix cache's evicted blocks)")
            self._stores = PoolStores(self, self._port, stores)
            # registered blocks keep their identity digests, and evicted
            # ones are logged: each operation that evicted some publishes
            # their records on the port right after (through the binding,
            # for sequences), before anything writes them
            self._core.publish_evictions = True
        # what every sequence on this pool binds to (PagedKVCache)
        self._binding = _seq.PoolBinding(
            self._core, self._lock, self._block_size, self._num_layers, self._caching,
            self._writer, self._data.block_copy(),
            None if self._stores is None else self._port)

    @classmethod
    def _with_forged_hashes(cls, *args, **kwargs):
        """Test seam (never used by the library): a pool on which every block
        of every sequence hashes alike, so that only the stored token ids and
        the identity chain keep another prefix's KV out.  Fixed when the
        pool is made; the hot paths carry no hook for it."""
        self = cls.__new__(cls)
        self._forge_hashes = True
        self.__init__(*args, **kwargs)
        return self

    def _layout(self):
        """What makes two pools' blocks interchangeable (StorePort.layout)."""
        return {"dtype": self.dtype, "block_size": self._block_size,
                "num_layers": self._num_layers, "num_kv_heads": self._num_kv_heads,
                "head_dim": self._head_dim, "kv_scales": self.kv_scales}

    def _sequence_core(self, max_seq_len, salt):
        """A new sequence's bookkeeping (``SeqCore``) bound to this pool, for
        ``salt`` (bytes or None).  The pool's identity chain roots a
        salted sequence at its salt's root (a negative id, referenced for
        the sequence; "Salt roots" in _native/_pool.pyx), an unsalted one
        at -1."""
        if salt is None:
            return _seq.bind(self._binding, max_seq_len, None, 0, 0, -1)
        r0, r1 = hashing.root_words(salt)
        with self._lock:
            root = self._core.acquire_salt_root(salt)
        return _seq.bind(self._binding, max_seq_len, salt, r0, r1, root)

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
        return self._scale_planes

    def _step_lane(self):
        """A new step lane of this pool's backend (CUDA: a step's writes as
        packed launches and the fixed buffers of short steps, what
        kvcore.hf issues per layer through; see backends/cuda/lane.py), or
        None where the backend has none.  One per caller (a lane packs its
        launches for itself)."""
        make = getattr(self._backend, "step_lane", None)
        if make is None:
            return None
        data = self._data
        return make(data.planes.views, data.planes.codecs, (data.storage, data.scale_planes))

    @property
    def kv_scales(self):
        """fp8 pools: the ``(k_scale, v_scale)`` pair of every layer, as set:
        each a float, or a tuple of ``num_kv_heads`` floats where that layer's
        keys (values) have per-kv-head scales that are not all equal (a
        per-head sequence of one repeated value reads back as that float);
        None for other dtypes."""
        return kv_scale_pairs(self._data.layer_scales, self._data.head_scales)

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
        if self._scale_planes is None:
            raise ValueError(f"only int8 pools keep per-token scales; this pool's dtype is "
                             f"{self.dtype!r} (fp8 pools: see kv_scales)")
        return self._scale_planes[plane]

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
                "num_salts": self._core.num_salts,
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
            find fewer if an entry goes or fails verification meanwhile,
            for instance pushed out of a full store by spills queued before
            the probe: :meth:`wait_spills` first settles them).
        """
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
                root = -1 if sb is None else self._core.live_salt_root(sb)
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
            return self._core.reset_prefix_cache()

    def flush_to_stores(self, timeout=None):
        """Wait for the queued spills (:meth:`wait_spills`), then write
        every block of the prefix cache to the first store, keeping it
        cached (on this thread; the pool's lock is held only while their
        bytes are copied out): before a process exits, so that the next one
        on the same ``DiskStore`` or ``RedisStore`` finds its prefixes.

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
        return self._wait_for_stores("flush", timeout, 0)

    def wait_spills(self, timeout=None):
        """Wait until the spills queued so far (for the stores that do I/O,
        written by the pool's store worker) have reached their stores;
        writes nothing else.  Then ``stats()["stores"]`` and the stores'
        contents show every spill so far.

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
        return self._wait_for_stores("wait_spills", timeout, True)

    def close(self, timeout=None):
        """Finish the background work of the prefix stores: cancel the
        prefetches in flight (:meth:`prefetch`), push the queued spills to
        their stores and stop the worker threads.

        Idempotent; the pool stays usable (a later spill or prefetch starts
        a worker again).  Without stores, does nothing.  Leaving a ``with
        pool:`` block calls ``close(timeout=kvcore.pool.EXIT_TIMEOUT)``
        (10 seconds).

        Parameters
        ----------
        timeout : float, optional
            Most seconds to take, as for :meth:`wait_spills` (None: as long
            as the stores take).  Spills still queued when it passes are
            dropped (a later miss, never wrong data) and counted in
            ``stats()["stores"][i]["spills_dropped"]``; a store call already
            under way on the worker then finishes in the background.

        Returns
        -------
        bool
            True when every queued spill was written (always True without
            stores), False when some were dropped at the deadline.
        """
        return self._wait_for_stores("close", timeout, True)

    def _wait_for_stores(self, what, timeout, without):
        """``self._stores.<what>(timeout)`` (``without`` when the pool has no
        stores), the timeout checked first, the warnings issued after."""
        timeout = check_timeout(timeout)
        if self._stores is None:
            return without
        result = getattr(self._stores, what)(timeout)
        self._stores.emit_warnings()
        return result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(EXIT_TIMEOUT)

    def __reduce__(self):
        # (copy.copy, copy.deepcopy and pickle all come here)
        raise TypeError("a kvcore.BlockPool is not copied or pickled: it owns the KV memory "
                        "and the blocks its sequences hold; share the one pool (it is "
                        "thread-safe), fork a sequence (seq.fork()), copy one into another "
                        "pool (seq.copy_to(pool)), or share prefixes across processes "
                        "through a DiskStore or RedisStore")

    def prefetch(self, token_ids, salt=None):
        """Start loading the prefix-store blocks of prompt ``token_ids`` into
        the pool in the background, for a later ``allocate`` of it.

        The run of the prompt's blocks after the pool's own hit that the
        stores hold is loaded and verified by the prefetch worker and left
        in the prefix cache (cached, evictable); an ``allocate`` of the
        prompt afterwards hits what has arrived and loads or computes the
        rest (docs/stores.md).

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
        tokens = token_array(token_ids)
        if tokens.shape[0] == 0:
            raise ValueError("token_ids must hold at least one token, got an empty sequence")
        sb = salt_bytes(salt)
        if self._stores is None:
            return Prefetch.finished(self.probe(tokens, salt)["hit_tokens"] // self._block_size)
        return self._stores.prefetch(tokens, sb)

    @property
    def debug(self):
        """Introspection for tests and debugging (:class:`kvcore.pool.PoolDebug`):
        ``check()``, ``snapshot()``, ``cached_block(block_id)``,
        ``cached_block_ids()``."""
        return PoolDebug(self)

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
        # (k and v are read where they lie; where converting an argument
        # may run the caller's code, which may free or resize their memory
        # (a slots object's __array__), the call writes copies of them)
        (k, v, slots), private, _ = _arrays.private_inputs((k, v, slots),
                                                            (layer, src_dtype, check),
                                                            names=("k", "v", "slots"))
        layer = layer_index(layer, self._num_layers)
        if not isinstance(check, (bool, np.bool_)):
            raise TypeError(f"check must be a bool, got {type(check).__name__}")
        k, v, src_kind = self._data.kv_input(k, v, src_dtype, private)
        self._data.write(layer, k, v, slots, src_kind, check)

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
        out_check = _arrays.out_guard(out, layer, block_table, start, end, dtype)
        layer = layer_index(layer, self._num_layers)
        table, start, end = self._data.table_range(block_table, start, end)
        return self._data.gather(layer, table, start, end, dtype, out, out_check)

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
        out_check = _arrays.out_guard(out, layer, block_tables, lengths, dtype)
        layer = layer_index(layer, self._num_layers)
        tables, lengths = self._data.batch_tables(block_tables, lengths)
        return self._data.gather_batch(layer, tables, lengths, dtype, out, out_check)

    def gather_scales(self, layer, block_table, start, end):
        """int8 pools: the scales of the codes :meth:`gather` returns for the
        same arguments: ``(k_scales, v_scales)``, new float32 arrays
        ``(num_kv_heads, end - start)``; ``code * scale`` is the value.
        ValueError for other dtypes (fp8 pools: :attr:`kv_scales`)."""
        layer = layer_index(layer, self._num_layers)
        self._scale_plane(0)   # (raises, naming the dtype, unless int8)
        table, start, end = self._data.table_range(block_table, start, end)
        return self._data.gather_scales(layer, table, start, end)

    def copy_blocks_to(self, dst_pool, src_block_ids, dst_block_ids):
        """Copy whole blocks (every layer, K and V) into another pool.

        For offloading: ``dst_pool`` may live on another device (a CPU pool
        as host memory for a GPU pool, and back).  Both pools must have the
        same block geometry and dtype.  Reference counts do not change: the
        caller owns the ids on both sides (e.g. a sequence's ``block_table``
        here and blocks it took there).  A destination block in
        ``dst_pool``'s prefix cache leaves it (counted as an eviction, its
        old KV published to the prefix stores first): the cache never hands
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
        if not isinstance(dst_pool, BlockPool):
            raise TypeError(f"dst_pool must be a kvcore.BlockPool, got {type(dst_pool).__name__}")
        self._data.copy_blocks_to(dst_pool._data, src_block_ids, dst_block_ids,
                                  dst_pool._before_overwrite)

    # ------------------------------------------------------------ private interface
    # What the other public classes of kvcore (PagedKVCache, the block-table
    # helpers, kvcore.hf) may ask of a pool; nobody else reads its storage,
    # core, lock or backend.  (_binding: the ``PoolBinding`` a new
    # sequence's core is made with, read once per PagedKVCache.)

    def _block_id(self, block_id):
        b = index_int(block_id, "block_id")
        if not 0 <= b < self._num_blocks:
            raise IndexError(f"block_id must be in 0..{self._num_blocks - 1}, got {b}")
        return b

    def _kv_input(self, k, v, src_dtype, private=False):
        """Validated (k, v, kind) for a write (see PoolData.kv_input)."""
        return self._data.kv_input(k, v, src_dtype, private)

    def _write_positions(self, layer, k, v, slots, src_kind):
        """K and V (validated by :meth:`_kv_input`) to the slots of a
        sequence's own positions in (validated) ``layer``."""
        self._data.write_positions(layer, k, v, slots, src_kind)

    def _gather(self, layer, table, start, end, dtype, out=None, out_check=None):
        """(k, v) of positions start..end-1 of (validated) ``layer`` and
        ``table`` (int32, aligned), into ``out`` when given."""
        return self._data.gather(layer, table, start, end, dtype, out, out_check)

    def _gather_scales(self, layer, table, start, end):
        return self._data.gather_scales(layer, table, start, end)

    def _before_overwrite(self, block_ids):
        """Blocks ``block_ids`` (checked int32) are about to be overwritten
        in place (``copy_blocks_to``): those in the prefix cache leave it,
        as evictions, their records published to the prefix stores first,
        so that neither the cache nor a store hands the new contents back
        under the old prefix."""
        if not self._caching:
            return
        with self._lock:
            if self._core.uncache(block_ids) and self._core.num_evict_log \
                    and self._stores is not None:
                self._port.publish_evicted()   # copied out now; any I/O on the worker

    def _take_blocks(self, n, out):
        """Take ``n`` free blocks into int32 ``out`` (reference count 1):
        True, or False when fewer are free (nothing taken)."""
        with self._lock:
            ok = self._core.take(n, out)
            if self._core.num_evict_log and self._stores is not None:
                self._port.publish_evicted()
            return ok

    def _release_blocks(self, block_ids):
        """Give back blocks taken with :meth:`_take_blocks`."""
        with self._lock:
            self._core.release(block_ids)

    def _device_array(self, a):
        """Host array ``a`` on this pool's device."""
        return self._backend.from_host(a)

    def __repr__(self):
        return (f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"num_layers={self._num_layers}, num_kv_heads={self._num_kv_heads}, "
                f"head_dim={self._head_dim}, dtype={self.dtype!r}, device={self._device!r}, "
                f"free={self.num_free_blocks}, cached={self.num_cached_blocks})")


def store_port(pool):
    """The :class:`~kvcore._store_port.StorePort` of ``pool``: what a prefix
    tier below its cache sees of it (docs/stores.md, "The pool's store
    port"): its layout, the records of the blocks it evicts, and the bytes
    of its blocks in and out."""
    if not isinstance(pool, BlockPool):
        raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
    return pool._port
