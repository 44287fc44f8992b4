"""PagedKVCache: one sequence's view of a BlockPool."""
import numpy as np

from ._errors import CacheFullError, OutOfBlocksError
from ._native import _pool
from . import hashing
from ._validate import (index_int, layer_index, nonneg_int, positive_int, salt_bytes,
                        token_array, token_id)
from .pool import BlockPool

__all__ = ["PagedKVCache"]

# Shared empty arrays: a new sequence allocates nothing until it is used
# (_grown always copies into a new array before writing).
_EMPTY_I32 = np.empty(0, np.int32)
_EMPTY_I32.flags.writeable = False
_EMPTY_HASHES = np.empty((0, 2), np.uint64)
_EMPTY_HASHES.flags.writeable = False
_EMPTY_I64 = np.empty(0, np.int64)
_EMPTY_I64.flags.writeable = False


def _grown(a, need):
    """``a`` if it holds ``need`` rows, else a copy with room for >= need."""
    if a.shape[0] >= need:
        return a
    new = np.empty((max(need, 2 * a.shape[0], 16),) + a.shape[1:], a.dtype)
    new[:a.shape[0]] = a
    return new


class PagedKVCache:
    """One sequence's KV in a shared :class:`BlockPool`.

    Parameters
    ----------
    pool : BlockPool
    max_seq_len : int, optional
        Writes past it raise :class:`CacheFullError`.
    salt : str or bytes, optional
        Enters the first block's hash: sequences with different salts never
        share blocks (e.g. per-tenant isolation, LoRA adapters).

    Notes
    -----
    The usual step: ``allocate(prompt)`` once; then per step
    ``append(layer, k, v)`` for every layer (or ``reserve`` +
    ``slot_mapping`` + ``pool.write`` for a batch), ``gather`` for
    attention, ``commit(n)``, and ``append_token`` for each generated token.
    Blocks that are full, committed and whose token ids are known enter the
    pool's prefix cache.  One sequence is driven by one thread at a time.
    """

    def __init__(self, pool, max_seq_len=None, salt=None):
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
        self._pool = pool
        self._core = pool._core
        self._bs = pool.block_size
        self._max = None if max_seq_len is None else positive_int(max_seq_len, "max_seq_len")
        self._salt = salt_bytes(salt)
        self._root = (0, 0) if salt is None else hashing.root_words(self._salt)
        self._root_serial = pool._salt_root(self._salt)
        self._caching = pool.enable_prefix_caching
        self._tokens = _EMPTY_I32
        self._hashes = _EMPTY_HASHES
        self._table = _EMPTY_I32
        self._serials = _EMPTY_I64   # serial each registered block is known by
        self._reset_state()

    def _reset_state(self):
        self._num_tokens = 0
        self._num_computed = 0
        self._nblocks = 0
        self._n_hashed = 0       # leading full blocks whose hash is known
        self._n_registered = 0   # leading blocks already offered to the cache
        # positions appended per layer in the current step, past num_computed
        self._pending = [0] * self._pool.num_layers
        self._excl = (0, 0)      # block range [lo, hi) known to be ours alone
        self._slot_key = None

    def _invalidate(self):
        self._excl = (0, 0)
        self._slot_key = None

    # ------------------------------------------------------------ state
    pool = property(lambda self: self._pool)
    max_seq_len = property(lambda self: self._max)
    salt = property(lambda self: self._salt)

    @property
    def num_tokens(self):
        """Token ids known: the prompt plus every ``append_token``."""
        return self._num_tokens

    @property
    def num_computed(self):
        """Positions whose KV is written and committed."""
        return self._num_computed

    @property
    def num_blocks(self):
        return self._nblocks

    @property
    def block_table(self):
        """numpy.int32 array of this sequence's block ids in position order (a copy)."""
        return self._table[:self._nblocks].copy()

    @property
    def token_ids(self):
        """numpy.int32 array of the known token ids (a copy)."""
        return self._tokens[:self._num_tokens].copy()

    @property
    def capacity(self):
        """Positions the held blocks can store."""
        return self._nblocks * self._bs

    def num_written(self, layer):
        """Positions readable in ``layer``: committed plus appended this step."""
        return self._num_computed + self._pending[layer_index(layer, self._pool.num_layers)]

    def block_hashes(self):
        """16-byte chained hashes of this sequence's full, known blocks."""
        return hashing.words_to_bytes(self._hashes[:self._n_hashed])

    # ------------------------------------------------------------ setup
    def allocate(self, token_ids):
        """Take blocks for the prompt ``token_ids``.

        Returns
        -------
        int
            Leading tokens whose KV is already in the pool (prefix hit): a
            multiple of ``block_size`` and always less than ``len(token_ids)``.
            ``num_computed`` is set to it.

        Raises
        ------
        OutOfBlocksError
            The pool cannot supply the blocks; nothing changed.
        """
        if self._nblocks or self._num_tokens or self._num_computed:
            raise ValueError("allocate() takes an empty sequence; this one already holds "
                             f"{self._num_tokens} tokens and {self._nblocks} blocks "
                             "(call free() first)")
        tokens = token_array(token_ids)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("token_ids must hold at least one token, got an empty sequence")
        self._check_len(n, "allocate")
        bs = self._bs
        total = -(-n // bs)
        n_full = n // bs
        if self._caching:
            hashes = np.empty((n_full, 2), np.uint64)
            _pool.hash_chain(tokens, n_full, bs, self._root[0], self._root[1], hashes)
            max_hit = (n - 1) // bs  # the last prompt token is always computed
        else:
            hashes = _EMPTY_HASHES
            max_hit = 0
        table = np.empty(max(total, 16), np.int32)
        serials = np.empty(max(n_full, 16), np.int64)
        pool = self._pool
        with pool._lock:
            hits = self._core.allocate(tokens, hashes, max_hit, total, self._root_serial, table,
                                       serials)
            if hits < 0:
                raise OutOfBlocksError(
                    f"allocate needs {total} blocks for {n} tokens, {pool.num_free_blocks} "
                    f"of {pool.num_blocks} are free")
            if self._caching:
                pool._prefix_queries += n
                pool._prefix_hits += hits * bs
        self._table = table
        self._nblocks = total
        self._tokens = tokens.copy() if tokens is token_ids else tokens
        self._num_tokens = n
        self._hashes = hashes
        self._serials = serials
        self._n_hashed = n_full if self._caching else 0
        self._num_computed = hits * bs
        self._n_registered = hits
        self._invalidate()
        return hits * bs

    # ------------------------------------------------------------ writes
    def reserve(self, n):
        """Make positions ``num_computed .. num_computed + n - 1`` writable.

        Blocks are added as needed, and every block those positions fall in
        becomes this sequence's own (copy-on-write happens here), so
        ``slot_mapping`` + ``pool.write`` is safe afterwards.  Raises
        OutOfBlocksError (nothing changed) or CacheFullError.
        """
        n = nonneg_int(n, "n")
        target = self._num_computed + n
        self._check_len(target, "reserve")
        self._ensure(target)

    def _ensure(self, target):
        bs = self._bs
        if target <= self._num_computed:
            return
        first = self._num_computed // bs
        end = -(-target // bs)  # blocks [first, end) must be ours
        lo, hi = self._excl
        if lo <= first and end <= hi:
            return
        pool = self._pool
        core = self._core
        grow = max(0, end - self._nblocks)
        with pool._lock:
            idx = np.empty(max(0, min(end, self._nblocks) - first), np.int32)
            ncow = core.shared_blocks(self._table, first, min(end, self._nblocks), idx) \
                if idx.shape[0] else 0
            need = grow + ncow
            if need:
                new = np.empty(need, np.int32)
                if not core.take(need, new):
                    raise OutOfBlocksError(
                        f"{need} more blocks needed for positions {self._num_computed}.."
                        f"{target - 1} ({ncow} copy-on-write), {pool.num_free_blocks} of "
                        f"{pool.num_blocks} are free")
                if ncow:
                    cow = idx[:ncow]
                    old = self._table[cow]
                    pool._copy_blocks(old, new[:ncow])
                    self._table[cow] = new[:ncow]
                    core.release(old)
                if grow:
                    self._table = _grown(self._table, end)
                    self._table[self._nblocks:end] = new[ncow:]
                    self._nblocks = end
                self._slot_key = None
        self._excl = (first, end)

    def append(self, layer, k, v, src_dtype=None):
        """Write ``k``, ``v`` ``(n, num_kv_heads, head_dim)`` at positions
        ``num_computed .. num_computed + n - 1`` of ``layer``.

        Blocks are reserved as needed; writing the same positions of a layer
        again in the same step overwrites them.  Input float32, float16 or
        bfloat16 (ml_dtypes, or uint16 bits with ``src_dtype="bfloat16"``),
        converted to the pool's dtype.
        """
        pool = self._pool
        layer = layer_index(layer, pool.num_layers)
        k, v, sk = pool._kv_input(k, v, src_dtype)
        n = k.shape[0]
        if n == 0:
            raise ValueError("k and v must hold at least one token, got n=0")
        target = self._num_computed + n
        self._check_len(target, "append")
        self._ensure(target)
        slots = self._step_slots(self._num_computed, target)
        be = pool._backend
        be.write_slots(pool._storage[2 * layer], k, slots, sk, pool._kind)
        be.write_slots(pool._storage[2 * layer + 1], v, slots, sk, pool._kind)
        if n > self._pending[layer]:
            self._pending[layer] = n

    def commit(self, n):
        """Finish a step for all layers: ``num_computed += n``.

        Newly full blocks whose token ids are known enter the prefix cache.
        The caller vouches that every layer was written; the positions must
        lie within reserved blocks and ``max_seq_len``.
        """
        n = nonneg_int(n, "n")
        target = self._num_computed + n
        self._check_len(target, "commit")
        if target > self._nblocks * self._bs:
            raise ValueError(
                f"commit({n}) would commit positions up to {target - 1}, but only "
                f"{self._nblocks * self._bs} positions are reserved; append or reserve first")
        self._num_computed = target
        p = self._pending
        if max(p):
            for i in range(len(p)):
                p[i] = p[i] - n if p[i] > n else 0
        self._register_ready()

    def append_token(self, token_id):
        """Add a generated token to the sequence's token ids."""
        tid = _check_token(token_id)
        n = self._num_tokens
        if self._max is not None and n + 1 > self._max:
            raise CacheFullError(
                f"append_token would make {n + 1} tokens, past max_seq_len={self._max}")
        self._tokens = _grown(self._tokens, n + 1)
        self._tokens[n] = tid
        self._num_tokens = n + 1
        if self._caching and (n + 1) % self._bs == 0:
            self._hash_known_blocks()
            self._register_ready()

    def extend_tokens(self, token_ids):
        """``append_token`` for each of ``token_ids`` (validated first)."""
        t = token_array(token_ids)
        n = self._num_tokens
        if self._max is not None and n + len(t) > self._max:
            raise CacheFullError(
                f"extend_tokens would make {n + len(t)} tokens, past max_seq_len={self._max}")
        self._tokens = _grown(self._tokens, n + len(t))
        self._tokens[n:n + len(t)] = t
        self._num_tokens = n + len(t)
        if self._caching:
            self._hash_known_blocks()
            self._register_ready()

    def _hash_known_blocks(self):
        full = self._num_tokens // self._bs
        h = self._n_hashed
        if full <= h:
            return
        self._hashes = _grown(self._hashes, full)
        parent = self._root if h == 0 else (int(self._hashes[h - 1, 0]),
                                             int(self._hashes[h - 1, 1]))
        out = self._hashes[h:full]
        hashing.hash_words(self._tokens[h * self._bs:full * self._bs], self._bs, parent,
                           full - h, out)
        self._n_hashed = full

    def _register_ready(self):
        if not self._caching:
            return
        upto = min(self._num_computed, self._num_tokens) // self._bs
        if upto > self._n_hashed:
            upto = self._n_hashed
        if upto <= self._n_registered:
            return
        first = self._n_registered
        self._serials = _grown(self._serials, upto)
        parent = self._serials[first - 1] if first else self._root_serial
        with self._pool._lock:
            self._core.register(self._table, self._hashes, self._tokens, first, upto,
                                parent, self._serials)
        self._n_registered = upto

    def slot_mapping(self, start, end):
        """numpy.int64 slots of positions ``start..end-1`` (for ``BlockPool.write``)."""
        start = index_int(start, "start")
        end = index_int(end, "end")
        cap = self._nblocks * self._bs
        if not 0 <= start <= end <= cap:
            raise ValueError(f"start and end must satisfy 0 <= start <= end <= {cap} "
                             f"(reserved positions), got start={start}, end={end}")
        out = np.empty(end - start, np.int64)
        _pool.slots_for(self._table, self._bs, start, end, out)
        return out

    def _step_slots(self, start, end):
        # the same slots serve every layer of a step
        key = (start, end)
        if self._slot_key != key:
            out = np.empty(end - start, np.int64)
            _pool.slots_for(self._table, self._bs, start, end, out)
            self._slot_val = out
            self._slot_key = key
        return self._slot_val

    # ------------------------------------------------------------ reads
    def gather(self, layer, start=0, end=None, dtype=None):
        """K and V of positions ``start..end-1`` of ``layer``.

        Parameters
        ----------
        layer : int
        start : int, default 0
        end : int, optional
            Defaults to the positions written in that layer (committed plus
            any appended in the current step).
        dtype : str, optional
            Output dtype, e.g. "float32" to widen; default the storage dtype.

        Returns
        -------
        (k, v) : new arrays ``(num_kv_heads, end - start, head_dim)``

        Raises
        ------
        ValueError
            If any position in the range was never written.
        """
        pool = self._pool
        layer = layer_index(layer, pool.num_layers)
        written = self._num_computed + self._pending[layer]
        start = index_int(start, "start")
        end = written if end is None else index_int(end, "end")
        if not 0 <= start <= end:
            raise ValueError(f"start and end must satisfy 0 <= start <= end, "
                             f"got start={start}, end={end}")
        if end > written:
            raise ValueError(f"positions {written}..{end - 1} of layer {layer} were never "
                             f"written (the layer holds {written} positions)")
        return pool._gather(layer, self._table, start, end, dtype)

    # ------------------------------------------------------------ lifecycle
    def truncate(self, n):
        """Forget positions and tokens from ``n`` on.

        Blocks no longer needed are released; nothing new is allocated (a
        kept block that is shared or cached is copied at the next write).
        """
        n = nonneg_int(n, "n")
        written = self._num_computed + max(self._pending, default=0)
        length = max(self._num_tokens, written)
        if n > length:
            raise ValueError(f"n must be at most the sequence length {length}, got {n}")
        keep = min(-(-n // self._bs), self._nblocks)
        if keep < self._nblocks:
            with self._pool._lock:
                self._core.release(self._table[keep:self._nblocks])
            self._nblocks = keep
        old_nc = self._num_computed
        self._num_tokens = min(self._num_tokens, n)
        self._num_computed = min(old_nc, n)
        for i, p in enumerate(self._pending):
            self._pending[i] = max(0, min(old_nc + p, n) - self._num_computed)
        self._n_hashed = min(self._n_hashed, self._num_tokens // self._bs)
        self._n_registered = min(self._n_registered, n // self._bs)
        self._invalidate()

    def fork(self):
        """A new sequence sharing every block, copy-on-write.

        Whichever sequence writes into a shared block first gets its own
        copy; the other keeps seeing the old contents.
        """
        child = PagedKVCache.__new__(PagedKVCache)
        child.__dict__.update(self.__dict__)
        child._tokens = self._tokens.copy()
        child._hashes = self._hashes.copy()
        child._table = self._table.copy()
        child._serials = self._serials.copy()
        child._pending = list(self._pending)
        if self._nblocks:
            with self._pool._lock:
                self._core.incref(self._table[:self._nblocks])
        self._invalidate()
        child._invalidate()
        return child

    def copy_to(self, pool):
        """This sequence's tokens and KV in another pool (e.g. offloaded to a
        CPU pool, or brought back to a GPU one).

        The new sequence takes fresh blocks there (no prefix sharing), the
        written blocks are copied with ``BlockPool.copy_blocks_to``, and its
        token ids, committed positions and cache registrations follow.  This
        sequence is unchanged (``free`` it to release its blocks).

        Raises
        ------
        OutOfBlocksError
            ``pool`` is short of blocks; nothing changed.
        """
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
        if pool.block_size != self._bs or pool.enable_prefix_caching != self._caching:
            raise ValueError("pool must have the same block_size and enable_prefix_caching as "
                             f"this sequence's pool ({self._bs}, {self._caching}), got "
                             f"({pool.block_size}, {pool.enable_prefix_caching})")
        twin = PagedKVCache(pool, self._max, self._salt)
        n = self._nblocks
        table = np.empty(max(n, 16), np.int32)
        if n:
            with pool._lock:
                if not pool._core.take(n, table):
                    raise OutOfBlocksError(
                        f"copy_to needs {n} blocks, {pool.num_free_blocks} of {pool.num_blocks} "
                        "are free in the destination pool")
            try:
                self._pool.copy_blocks_to(pool, self._table[:n], table[:n])
            except BaseException:
                with pool._lock:
                    pool._core.release(table[:n])
                raise
        twin._table = table
        twin._nblocks = n
        twin._tokens = self._tokens.copy()
        twin._num_tokens = self._num_tokens
        twin._hashes = self._hashes.copy()
        # twin._serials stays empty: the twin registers from block 0 in its pool
        twin._n_hashed = self._n_hashed
        twin._num_computed = self._num_computed
        twin._pending = list(self._pending)
        twin._register_ready()
        return twin

    def free(self):
        """Release every block (idempotent); the sequence is empty afterwards."""
        if self._nblocks:
            with self._pool._lock:
                self._core.release(self._table[:self._nblocks])
        self._reset_state()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __del__(self):
        # Blocks of a dropped sequence go back to the pool.
        try:
            if self._nblocks:
                self.free()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def _check_len(self, target, what):
        if self._max is not None and target > self._max:
            raise CacheFullError(
                f"{what} would reach position {target - 1}, past max_seq_len={self._max}")

    def __repr__(self):
        return (f"PagedKVCache(num_tokens={self._num_tokens}, num_computed={self._num_computed}, "
                f"blocks={self._nblocks}, max_seq_len={self._max})")


def _check_token(value):
    return token_id(value)
