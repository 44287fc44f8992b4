"""PagedKVCache: one sequence's view of a BlockPool.

The bookkeeping state and the loops over it live in ``_native/_seq.pyx``: a
``PagedKVCache`` holds a ``SeqCore`` (``self._seq``), validates arguments
and raises; the bytes go through the pool's private interface to its
backend.
"""
import numpy as np

from ._errors import CacheFullError, OutOfBlocksError
from ._native import _pool
from ._native import _seq as _native_seq
from ._native._seq import SeqCore
from . import _arrays, _validate, hashing
from ._validate import (index_int, layer_index, nonneg_int, positive_int, salt_bytes,
                        token_array)
from .pool import BlockPool

__all__ = ["PagedKVCache"]


# The SeqCore of a PagedKVCache whose __init__ never ran: every member raises
# RuntimeError through it (see PagedKVCache.__getattr__).
_UNBOUND = SeqCore()


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

    Attributes
    ----------
    pool, max_seq_len, salt
        The constructor's arguments (salt as bytes).
    num_tokens, num_computed, num_blocks, capacity, block_table, token_ids
        See each property.
    closed : bool
        True once :meth:`free` was called.

    Notes
    -----
    The usual step: ``allocate(prompt)`` once; then per step
    ``append(layer, k, v)`` for every layer (or ``reserve`` +
    ``slot_mapping`` + ``pool.write`` + ``mark_written`` for a batch),
    ``gather`` for attention, ``commit(n)``, and ``append_token`` for each
    generated token.  ``commit`` checks that every layer wrote the
    positions, so KV an earlier owner left in a block is never read back nor
    cached.  Blocks that are full, committed and whose token ids are known
    enter the pool's prefix cache.  One sequence is driven by one thread at
    a time.

    Lifecycle:

    * *new* (after ``__init__``): ``allocate`` makes it live; ``free``
      closes it; ``fork`` and ``copy_to`` give new sequences;
      ``num_written`` (0) and ``block_hashes`` (none) answer.  Every other
      method (``append``, ``reserve``, ``commit``, ``mark_written``,
      ``append_token``, ``extend_tokens``, ``slot_mapping``, ``gather``,
      ``truncate``) raises ValueError: allocate first.
    * *live* (after ``allocate``): everything; ``fork`` and ``copy_to``
      give live sequences.
    * *closed* (after ``free``, or leaving a ``with`` block): the blocks
      and the salt went back to the pool.  ``free`` again does nothing; the
      properties still answer (it holds nothing: counts 0, empty arrays,
      ``closed`` True); every other method, ``allocate`` included, raises
      ValueError.  A dropped sequence is freed as well.

    An object whose ``__init__`` never ran (``PagedKVCache.__new__``, or a
    subclass whose ``__init__`` skips ``super().__init__``) raises
    RuntimeError from every method and property.
    """

    # until __init__ binds them (an object made with __new__, or by a
    # subclass whose __init__ skips ours), every member raises RuntimeError
    # through the unbound SeqCore
    _seq = _UNBOUND
    _pool = None

    def __init__(self, pool, max_seq_len=None, salt=None):
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
        if max_seq_len is not None:
            max_seq_len = positive_int(max_seq_len, "max_seq_len")
        if salt is not None:
            salt = salt_bytes(salt)
        old = self._seq
        if old is not _UNBOUND:  # __init__ again: what the old binding held goes back
            old.free()
        self._pool = pool
        self._seq = pool._sequence_core(max_seq_len, salt)

    # ------------------------------------------------------------ state
    @property
    def pool(self):
        """The :class:`BlockPool` this sequence lives in."""
        if self._seq.state == _native_seq.UNINIT:
            raise self._seq.state_error("pool")
        return self._pool

    max_seq_len = _native_seq.CoreField(
        "max_seq_len", "Positions past which writes raise CacheFullError (None: no limit).")

    salt = _native_seq.CoreField("salt", """The salt as bytes (None: unsalted).""")

    closed = _native_seq.CoreField("closed", """True once :meth:`free` was called.""")

    num_tokens = _native_seq.CoreField(
        "num_tokens", "Token ids known: the prompt plus every ``append_token``.")

    num_computed = _native_seq.CoreField(
        "num_computed", "Positions whose KV is written and committed.")

    num_blocks = _native_seq.CoreField("num_blocks", """Blocks this sequence holds.""")

    capacity = _native_seq.CoreField("capacity", """Positions the held blocks can store.""")

    block_table = _native_seq.CoreField(
        "block_table", "numpy.int32 array of this sequence's block ids in position order (a copy).")

    token_ids = _native_seq.CoreField(
        "token_ids", "numpy.int32 array of the known token ids (a copy).")

    def _max_written(self):
        """Positions readable in the layer that has written most (committed
        plus appended this step): what a batch's attention spans by default
        (``kvcore.tables``)."""
        return self._seq.max_written()

    def _table_head(self, n):
        """The first ``n`` entries of the block table (a view, for
        ``kvcore.tables`` to copy from; ``n`` at most ``num_blocks``)."""
        return self._seq.table[:n]

    def _require(self, what, new_ok=False):
        """Raise unless the sequence is live (or new, with ``new_ok``)."""
        state = self._seq.state
        if state != _native_seq.LIVE and not (new_ok and state == _native_seq.NEW):
            raise self._seq.state_error(what)

    def num_written(self, layer):
        """Positions readable in ``layer``: committed plus appended this step."""
        self._require("num_written", new_ok=True)
        layer = layer_index(layer, self._pool.num_layers)
        self._require("num_written", new_ok=True)
        return self._seq.written(layer)

    def block_hashes(self):
        """16-byte chained hashes of this sequence's full, known blocks."""
        self._require("block_hashes", new_ok=True)
        return hashing.words_to_bytes(self._seq.hash_words())

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
        ValueError
            The sequence already holds tokens, or was freed.
        """
        # A valid int32 array is taken as is; anything else (a list, another
        # dtype, a bad id) and every error go through _allocate_failed.
        hit = self._seq.allocate(token_ids)
        if hit < 0:
            hit = self._allocate_failed(token_ids, hit)
        stores = self._pool._stores
        if stores is not None:
            # the pool's prefix stores may hold the blocks after the hit:
            # loaded into the fresh blocks and adopted, then what this call
            # evicted is published (so it cannot push out what it loads).
            # A store warning raised as an error (-W error) undoes the call
            hit = stores.load_prefix(self._seq, hit)
        return hit

    def _allocate_failed(self, token_ids, status):
        self._allocate_state(status)
        tokens = token_array(token_ids)
        if status == _native_seq.UNCHECKED:
            status = self._seq.allocate(tokens)
            if status >= 0:
                return status
            # (converting the ids ran the caller's code, which may have
            # freed or allocated this sequence meanwhile)
            self._allocate_state(status)
        n = tokens.shape[0]
        if status == _native_seq.EMPTY:
            raise ValueError("token_ids must hold at least one token, got an empty sequence")
        if status == _native_seq.TOO_LONG:
            self._check_len(n, "allocate")
        raise OutOfBlocksError(
            f"allocate needs {-(-n // self._seq.block_size)} blocks for {n} tokens, "
            f"{self._seq.failed_free_blocks} "
            f"of {self._pool.num_blocks} are free")

    def _allocate_state(self, status):
        """Raise for an allocate the sequence's state refused."""
        if status == _native_seq.STATE:
            raise self._seq.state_error("allocate")
        if status == _native_seq.BUSY:
            raise ValueError("allocate() takes an empty sequence; this one already holds "
                             f"{self._seq.num_tokens} tokens and {self._seq.num_held} blocks "
                             "(call free() first)")

    # ------------------------------------------------------------ writes
    def reserve(self, n):
        """Make positions ``num_computed .. num_computed + n - 1`` writable.

        Blocks are added as needed, and every block those positions fall in
        becomes this sequence's own (copy-on-write happens here), so
        ``slot_mapping`` + ``pool.write`` is safe afterwards.  Raises
        OutOfBlocksError (nothing changed) or CacheFullError.
        """
        status = self._seq.reserve(n)
        if status:
            self._reserve_failed(n, status)

    def _reserve_failed(self, n, status):
        # (n checked whatever the status: the core takes any int >= 0, and
        # the messages below print it)
        n = nonneg_int(n, "n")
        if status == _native_seq.UNCHECKED:
            status = self._seq.reserve(n)
        if self._settled(status, "reserve"):
            return
        if status == _native_seq.TOO_LONG:
            self._check_len(self._seq.num_computed + n, "reserve")
        self._out_of_blocks(self._seq.num_computed + n)

    def _settled(self, status, what):
        # One status per call (docs/architecture.md, "Statuses"): a core op
        # that answered a status changed nothing and said why.  The callers
        # above validated an argument the core could not take as is
        # (UNCHECKED) and asked once more; this is that answer: True when it
        # succeeded, the state error raised, else False (raise from it).
        if status == _native_seq.STATE:
            raise self._seq.state_error(what)
        return status == 0

    def _out_of_blocks(self, target):
        # after SHORT from SeqCore.reserve/ensure_to (it left
        # failed_copy_on_write, failed_free_blocks)
        num_copied = self._seq.failed_copy_on_write
        need = max(0, -(-target // self._seq.block_size) - self._seq.num_held) + num_copied
        raise OutOfBlocksError(
            f"{need} more blocks needed for positions {self._seq.num_computed}.."
            f"{target - 1} ({num_copied} copy-on-write), {self._seq.failed_free_blocks} of "
            f"{self._pool.num_blocks} are free")

    def append(self, layer, k, v, src_dtype=None):
        """Write ``k``, ``v`` ``(n, num_kv_heads, head_dim)`` at positions
        ``num_computed .. num_computed + n - 1`` of ``layer``.

        Blocks are reserved as needed; writing the same positions of a layer
        again in the same step overwrites them.  Input float32, float16 or
        bfloat16 (ml_dtypes, or uint16 bits with ``src_dtype="bfloat16"``),
        converted to the pool's dtype.
        """
        # the usual call (CPU pool, NumPy float32/float16 arrays) is done in
        # one native call; anything else, errors included, takes the path below
        if src_dtype is None and self._seq.append_direct(layer, k, v):
            return
        # the arguments converted (the caller's __index__ / __array__ run
        # here, and may change this sequence) before its state is checked
        self._require("append")
        pool = self._pool
        (k, v), private, _ = _arrays.private_inputs((k, v), (layer, src_dtype), names=("k", "v"))
        layer = layer_index(layer, pool.num_layers)
        k, v, sk = pool._kv_input(k, v, src_dtype, private)
        self._require("append")
        n = k.shape[0]
        if n == 0:
            raise ValueError("k and v must hold at least one token, got n=0")
        target = self._seq.num_computed + n
        self._check_len(target, "append")
        if self._seq.ensure_to(target):
            self._out_of_blocks(target)
        pool._write_positions(layer, k, v, self._seq.step_slots(self._seq.num_computed,
                                                                   target), sk)
        self._seq.note_append(layer, n)

    def commit(self, n):
        """Finish a step for all layers: ``num_computed += n``.

        Newly full blocks whose token ids are known enter the prefix cache.
        Every layer must have written positions ``num_computed ..
        num_computed + n - 1`` in this step (through :meth:`append`, or
        ``pool.write`` followed by :meth:`mark_written`), within the
        reserved blocks and ``max_seq_len``.

        Raises
        ------
        ValueError
            A layer has not written those positions (the message names the
            first such layer), or they lie past the reserved blocks; nothing
            changed.
        CacheFullError
            They lie past ``max_seq_len``; nothing changed.
        """
        status = self._seq.commit(n)
        if status:
            self._commit_failed(n, status)

    def _commit_failed(self, n, status):
        n = nonneg_int(n, "n")    # (whatever the status: see _reserve_failed)
        if status == _native_seq.UNCHECKED:
            status = self._seq.commit(n)
        if self._settled(status, "commit"):
            return
        nc = self._seq.num_computed
        target = nc + n
        if status == _native_seq.TOO_LONG:
            self._check_len(target, "commit")
        if status == _native_seq.UNWRITTEN:
            layer = self._seq.failed_layer
            raise ValueError(
                f"commit({n}) needs positions {nc}..{target - 1} written in every layer, "
                f"but layer {layer} has written {self._seq.written(layer) - nc} of them; "
                "write them with append, or pool.write + mark_written, first")
        raise ValueError(
            f"commit({n}) would commit positions up to {target - 1}, but only "
            f"{self._seq.num_held * self._seq.block_size} positions are reserved; "
            "append or reserve first")

    def append_token(self, token_id):
        """Add a generated token to the sequence's token ids."""
        status = self._seq.append_token(token_id)
        if status:
            self._append_token_failed(token_id, status)

    def _append_token_failed(self, token_id, status):
        if status == _native_seq.UNCHECKED:
            status = self._seq.append_token(_validate.token_id(token_id))
        if self._settled(status, "append_token"):
            return
        n = self._seq.num_tokens
        raise CacheFullError(
            f"append_token would make {n + 1} tokens, past "
            f"max_seq_len={self._seq.max_seq_len}")

    def extend_tokens(self, token_ids):
        """``append_token`` for each of ``token_ids`` (validated first)."""
        self._require("extend_tokens")
        t = token_array(token_ids)
        self._require("extend_tokens")       # (the ids' conversion ran the caller's code)
        if self._seq.extend_tokens(t):
            raise CacheFullError(
                f"extend_tokens would make {self._seq.num_tokens + len(t)} tokens, "
                f"past max_seq_len={self._seq.max_seq_len}")

    def slot_mapping(self, start, end):
        """numpy.int64 slots of positions ``start..end-1`` (for ``BlockPool.write``)."""
        self._require("slot_mapping")
        start = index_int(start, "start")
        end = index_int(end, "end")
        self._require("slot_mapping")
        cap = self._seq.num_held * self._seq.block_size
        if not 0 <= start <= end <= cap:
            raise ValueError(f"start and end must satisfy 0 <= start <= end <= {cap} "
                             f"(reserved positions), got start={start}, end={end}")
        out = np.empty(end - start, np.int64)
        _pool.slots_for(self._seq.table, self._seq.block_size, start, end, out)
        return out

    def mark_written(self, layer, n):
        """Declare positions ``num_computed .. num_computed + n - 1`` of
        ``layer`` written through ``BlockPool.write`` (with this sequence's
        ``slot_mapping``), so that :meth:`gather` reads them before
        :meth:`commit`, as it does for :meth:`append`.

        The positions must lie in reserved blocks and within max_seq_len.
        Declaring positions that were not written lets :meth:`commit`
        accept them: the caller answers for this declaration.
        """
        status = self._seq.mark_written(layer, n)
        if status:
            self._mark_written_failed(layer, n, status)

    def _mark_written_failed(self, layer, n, status):
        if status == _native_seq.UNCHECKED:
            layer = layer_index(layer, self._pool.num_layers)
        n = nonneg_int(n, "n")    # (whatever the status: see _reserve_failed)
        if status == _native_seq.UNCHECKED:
            status = self._seq.mark_written(layer, n)
        if self._settled(status, "mark_written"):
            return
        target = self._seq.num_computed + n
        if status == _native_seq.TOO_LONG:
            self._check_len(target, "mark_written")
        raise ValueError(
            f"mark_written({layer}, {n}) reaches position {target - 1}, but only "
            f"{self._seq.num_held * self._seq.block_size} positions are reserved; "
            "reserve first")

    # ------------------------------------------------------------ reads
    def gather(self, layer, start=0, end=None, dtype=None, out=None):
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
        out : (k_out, v_out), optional
            Writable arrays ``(num_kv_heads, end - start, head_dim)`` of the
            output dtype (NumPy arrays or torch tensors), filled and returned.

        Returns
        -------
        (k, v) : new arrays ``(num_kv_heads, end - start, head_dim)`` (``out`` when given)

        Raises
        ------
        ValueError
            If any position in the range was never written, or the sequence
            is not live (see the class notes).
        """
        self._require("gather")
        out_check = _arrays.out_guard(out, layer, start, end, dtype)
        layer, start, end = self._range_args(layer, start, end)
        self._require("gather")
        start, end = self._written_range(layer, start, end)
        table = self._seq.table
        got = self._pool._gather(layer, table, start, end, dtype, out, out_check)
        self._unchanged_by("gather", table, layer, end)
        return got

    def _range_args(self, layer, start, end):
        """``layer``, ``start``, ``end`` converted (before any state is read:
        their ``__index__`` is the caller's code)."""
        return (layer_index(layer, self._pool.num_layers), index_int(start, "start"),
                None if end is None else index_int(end, "end"))

    def _unchanged_by(self, what, table, layer, end):
        """After a read of ``table``'s positions up to ``end`` of ``layer``
        whose ``out`` conversion ran the caller's code: RuntimeError when
        that code freed or truncated the sequence (what was read may be
        blocks it gave back)."""
        seq = self._seq
        if seq.table is not table or seq.state != _native_seq.LIVE or seq.written(layer) < end:
            raise RuntimeError(f"{what}: the sequence was freed or truncated while the call "
                               "converted its arguments (by their own code); what it read is "
                               "void")

    def _written_range(self, layer, start, end):
        """Converted ``start``, ``end`` (None: the positions written) checked
        as a range of written positions of (validated) ``layer``."""
        written = self._seq.written(layer)
        end = written if end is None else end
        if not 0 <= start <= end:
            raise ValueError(f"start and end must satisfy 0 <= start <= end, "
                             f"got start={start}, end={end}")
        if end > written:
            raise ValueError(f"positions {written}..{end - 1} of layer {layer} were never "
                             f"written (the layer holds {written} positions)")
        return start, end

    def gather_scales(self, layer, start=0, end=None):
        """int8 pools: the scales of the codes ``gather(layer, start, end)``
        returns: ``(k_scales, v_scales)``, float32 ``(num_kv_heads, end -
        start)`` (value = code * scale).  Checked like :meth:`gather`;
        ValueError on pools of other dtypes."""
        self._require("gather_scales")
        layer, start, end = self._range_args(layer, start, end)
        self._require("gather_scales")
        pool = self._pool
        if pool.scales is None:
            pool._scale_plane(0)   # raises, naming the dtype
        start, end = self._written_range(layer, start, end)
        return pool._gather_scales(layer, self._seq.table, start, end)

    def attention(self, layer, q, *, scale=None, sliding_window=None, logits_soft_cap=None,
                  out=None, chunk_size=None, alibi_slopes=None, sinks=None):
        """Attention of this step's queries over the sequence, read from the pages.

        ``q`` ``(n, num_heads, head_dim)`` are the queries of positions
        ``num_computed .. num_computed + n - 1``, whose K/V this layer has
        already written (``append``, or ``pool.write`` + ``mark_written``);
        causal over the sequence.  Keywords as :func:`kvcore.paged_attention`.
        Returns ``(n, num_heads, head_dim)`` float32 (or ``out``).  Raises
        ValueError if any of those positions was never written.
        """
        self._require("attention")
        from .attention import sequence_attention

        return sequence_attention(self, layer, q, scale=scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, out=out, chunk_size=chunk_size,
                                  alibi_slopes=alibi_slopes, sinks=sinks)

    # ------------------------------------------------------------ lifecycle
    def truncate(self, n):
        """Forget positions and tokens from ``n`` on.

        Blocks no longer needed are released; nothing new is allocated (a
        kept block that is shared or cached is copied at the next write).
        """
        self._require("truncate")
        n = nonneg_int(n, "n")
        self._require("truncate")
        length = self._seq.length()
        if n > length:
            raise ValueError(f"n must be at most the sequence length {length}, got {n}")
        self._seq.truncate(n)

    def fork(self):
        """A new sequence sharing every block, copy-on-write.

        Whichever sequence writes into a shared block first gets its own
        copy; the other keeps seeing the old contents.
        """
        self._require("fork", new_ok=True)
        seq = SeqCore()
        self._seq.fork_into(seq)
        child = PagedKVCache.__new__(PagedKVCache)
        child._pool = self._pool
        child._seq = seq
        return child

    def __copy__(self):
        """``copy.copy(seq)`` and ``copy.deepcopy(seq)``: :meth:`fork` (a
        new sequence sharing every block, copy-on-write; free it too)."""
        return self.fork()

    def __deepcopy__(self, memo):
        child = memo[id(self)] = self.fork()
        return child

    def __reduce__(self):
        raise TypeError("a kvcore.PagedKVCache cannot be pickled: its KV lives in its pool's "
                        "blocks (seq.fork() or copy.deepcopy(seq) copies it within the "
                        "process; seq.copy_to(other_pool) into another pool; prefix stores "
                        "share prefixes across processes)")

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
        self._require("copy_to", new_ok=True)
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
        seq = self._seq
        if pool.block_size != seq.block_size or pool.enable_prefix_caching != seq.caching:
            raise ValueError("pool must have the same block_size and enable_prefix_caching as "
                             f"this sequence's pool ({seq.block_size}, {seq.caching}), got "
                             f"({pool.block_size}, {pool.enable_prefix_caching})")
        twin = PagedKVCache(pool, self._seq.max_seq_len, self._seq.salt)
        try:
            n = self._seq.num_held
            table = np.empty(max(n, 16), np.int32)
            if n:
                if not pool._take_blocks(n, table):
                    raise OutOfBlocksError(
                        f"copy_to needs {n} blocks, {pool.num_free_blocks} of {pool.num_blocks} "
                        "are free in the destination pool")
                try:
                    self._pool.copy_blocks_to(pool, self._seq.table[:n], table[:n])
                except BaseException:
                    pool._release_blocks(table[:n])
                    raise
        except BaseException:
            # the twin holds the salt's root in the destination: give it
            # back now, not when the traceback (which holds the twin) dies
            twin.free()
            raise
        # the twin registers from block 0 in its pool
        twin._seq.adopt(self._seq, table, n)
        return twin

    def free(self):
        """Release every block and close the sequence (idempotent).

        A closed sequence holds nothing; every method but ``free`` raises
        (see the class notes).
        """
        self._seq.free()

    def __enter__(self):
        self._require("with", new_ok=True)
        return self

    def __exit__(self, *exc):
        self.free()

    # The blocks of a dropped sequence go back to the pool: SeqCore.__del__.

    def _check_len(self, target, what):
        if self._seq.max_seq_len is not None and target > self._seq.max_seq_len:
            raise CacheFullError(
                f"{what} would reach position {target - 1}, past "
                f"max_seq_len={self._seq.max_seq_len}")

    def __repr__(self):
        # never raises (debuggers and error messages call it)
        if self._seq.state == _native_seq.UNINIT:
            return "PagedKVCache(<not initialised>)"
        if self._seq.state == _native_seq.CLOSED:
            return f"PagedKVCache(<closed>, max_seq_len={self._seq.max_seq_len})"
        seq = self._seq
        return (f"PagedKVCache(num_tokens={seq.num_tokens}, num_computed={seq.num_computed}, "
                f"blocks={self._seq.num_held}, max_seq_len={self._seq.max_seq_len})")

