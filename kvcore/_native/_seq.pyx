"""Per-sequence bookkeeping of ``PagedKVCache``: the sequence's token ids,
block hashes, block table and counters, and the operations on them
(allocate, reserve/copy-on-write, commit, append_token, register, free) as
C code calling ``PoolCore``'s C-level methods.

``kvcore/paged.py`` validates every argument and raises every error; the
methods here take validated values and report failures as status codes
(details for the message in the ``failed_*`` fields).  A failing method
changes nothing.  Every PoolCore call happens with the pool's lock held.

State (a sequence is driven by one thread at a time):
  * ``token_buf`` [token_cap]: token ids, the first ``num_tokens`` known;
  * ``hash_buf`` [hash_cap, 2]: the first ``num_hashed`` full blocks' chained hashes;
  * ``block_serials`` [serial_cap]: the serial the pool knows each of the first
    ``num_registered`` blocks by (the next block's parent);
  * ``ident_buf`` [ident_cap, 32]: on a pool with stores, the identity digests
    of the first ``num_identified`` full blocks (see "Identity digests" in
    _pool.pyx), computed once each and handed to the pool at registration;
  * ``table``: int32 NumPy array [capacity], the first ``num_held`` the
    block table (kvcore.tables and PagedKVCache read it);
  * ``pending[layer]``: positions past ``num_computed`` appended to that
    layer in the current step;
  * ``[exclusive_lo, exclusive_hi)``: blocks known to be this sequence's alone
    (writable in place) since the last reserve; ``[slot_lo, slot_hi)``: the
    positions whose slots ``slot_val`` caches for the layers of a step.
  * ``state``: UNINIT (``__init__`` never ran), NEW (bound to a pool,
    before ``allocate``), LIVE, CLOSED (after ``free``); see PagedKVCache.
Token ids, hashes, serials and digests are plain C buffers, private to the sequence
(handed out only as copies): a NumPy array costs more to create and free
than these operations take otherwise.  ``table`` is replaced, never
resized in place: a bigger one is a copy, so the shared empty array below
is never written.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

from kvcore._native._pool cimport IDENTITY_SIZE, NOGIL_BLOCKS, PoolCore, identity_chain_c
from kvcore._native._pool import identity_root
from kvcore._native._typedefs cimport RowInput, RowWriter, block_id_t, hash_word_t, slot_t, token_t

cnp.import_array()

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX

cdef enum:
    # hash with the GIL released from this many blocks on (~30 ns a block);
    # the block a decode step completes is hashed without the round trip
    HASH_NOGIL_BLOCKS = 16

# Statuses of the operations (0 or more: done), for kvcore/paged.py to
# turn into errors.  UNCHECKED: an argument is not of the kind the native
# path takes as is (or is out of range); nothing changed, and the caller
# validates it (raising the precise error) and calls again.
cdef enum:
    ST_SHORT = -1          # the pool is short of blocks (failed_free_blocks and
                           # failed_copy_on_write set)
    ST_EMPTY = -2          # allocate: no tokens
    ST_TOO_LONG = -3       # past max_seq_len
    ST_UNCHECKED = -4
    ST_BUSY = -5           # allocate: the sequence is not empty
    ST_PAST_RESERVED = -6  # commit: past the reserved positions
    ST_STATE = -7          # the sequence is not in a state for this call (state_error)
    ST_UNWRITTEN = -8      # commit: a layer has not written the positions (failed_layer)

# The lifecycle of a sequence (SeqCore.state)
cdef enum:
    S_UNINIT = 0
    S_NEW = 1
    S_LIVE = 2
    S_CLOSED = 3

SHORT = ST_SHORT
EMPTY = ST_EMPTY
TOO_LONG = ST_TOO_LONG
UNCHECKED = ST_UNCHECKED
BUSY = ST_BUSY
PAST_RESERVED = ST_PAST_RESERVED
STATE = ST_STATE
UNWRITTEN = ST_UNWRITTEN
UNINIT = S_UNINIT
NEW = S_NEW
LIVE = S_LIVE
CLOSED = S_CLOSED

cdef cnp.ndarray _frozen_empty(cnp.ndarray a):
    a.flags.writeable = False
    return a


_EMPTY_I32 = _frozen_empty(np.empty(0, np.int32))


cdef inline cnp.ndarray _empty(Py_ssize_t n, int typenum):
    cdef cnp.npy_intp dim = n
    return cnp.PyArray_EMPTY(1, &dim, typenum, 0)


cdef inline cnp.ndarray _empty_hashes(Py_ssize_t n):
    cdef cnp.npy_intp dims[2]
    dims[0] = n
    dims[1] = 2
    return cnp.PyArray_EMPTY(2, dims, cnp.NPY_UINT64, 0)


cdef inline void* _ptr(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


cdef cnp.ndarray _copy(cnp.ndarray a):
    """A copy of a C-contiguous 1-D array of ours (PyArray_NewCopy costs
    several times a plain copy for small arrays)."""
    cdef cnp.ndarray new = _empty(cnp.PyArray_DIM(a, 0), cnp.PyArray_TYPE(a))
    memcpy(_ptr(new), _ptr(a), cnp.PyArray_NBYTES(a))
    return new


cdef cnp.ndarray _grown(cnp.ndarray a, Py_ssize_t need):
    """``a`` if it holds ``need`` entries, else a copy with room for >= need."""
    cdef Py_ssize_t rows = cnp.PyArray_DIM(a, 0)
    cdef cnp.ndarray new
    if rows >= need:
        return a
    new = _empty(max(need, 2 * rows, 16), cnp.PyArray_TYPE(a))
    memcpy(_ptr(new), _ptr(a), cnp.PyArray_NBYTES(a))
    return new


cdef int _fit(void** buf, Py_ssize_t* cap, Py_ssize_t need, size_t item,
              Py_ssize_t keep) except -1:
    """Make ``*buf`` hold ``need`` items (capacity at least doubling), keeping
    its first ``keep``."""
    cdef Py_ssize_t new_cap
    cdef void* p
    if need <= cap[0]:
        return 0
    new_cap = max(need, 2 * cap[0], 16)
    if keep:
        p = realloc(buf[0], new_cap * item)
        if p == NULL:
            raise MemoryError()
    else:
        p = malloc(new_cap * item)
        if p == NULL:
            raise MemoryError()
        free(buf[0])
    buf[0] = p
    cap[0] = new_cap
    return 0


cdef void* _dup(const void* src, Py_ssize_t n, size_t item, Py_ssize_t* cap) except NULL:
    """A new buffer holding the n items at src (room for at least one)."""
    cdef Py_ssize_t c = max(n, 1)
    cdef void* p = malloc(c * item)
    if p == NULL:
        raise MemoryError()
    if n:  # src may be NULL when there is nothing
        memcpy(p, src, n * item)
    cap[0] = c
    return p


cdef inline Py_ssize_t _count(object n) except -1:
    """A non-negative int as Py_ssize_t; one too big saturates, so every
    limit check on it fails."""
    try:
        return n
    except OverflowError:
        return PY_SSIZE_T_MAX


cdef class PoolBinding:
    """What a sequence needs of its pool, made once per pool by
    ``BlockPool`` (its ``_binding``; a new sequence reads it in one go): the
    bookkeeping core, the pool's lock, its geometry, the pool's writer
    (``BlockPool._writer``; None: appends take the validated path), the
    pool's block copy (for copy-on-write) and, on a pool with stores, its
    store port's two eviction calls."""
    cdef PoolCore _core
    cdef object lock_acquire, lock_release
    cdef Py_ssize_t block_size, num_layers
    cdef bint caching
    cdef RowWriter writer
    cdef object copy_blocks
    cdef object publish_evicted, copy_out_evicted

    def __init__(self, PoolCore core, lock, Py_ssize_t block_size, Py_ssize_t num_layers,
                 bint caching, RowWriter writer, copy_blocks, port=None):
        self._core = core
        self.lock_acquire = lock.acquire
        self.lock_release = lock.release
        self.block_size = block_size
        self.num_layers = num_layers
        self.caching = caching
        self.writer = writer
        self.copy_blocks = copy_blocks
        # a pool with prefix stores: right after blocks were taken, whenever
        # that evicted cached blocks (the lock still held, so before anything
        # overwrites them), a sequence has the port copy their records out
        # and publish them to the stores (publish_evicted()); allocate only
        # copies them out (copy_out_evicted(), SeqCore.take_held_records) and
        # publishes them after its store lookup, which they must not push
        # out.  Every sequence reads them from the binding it holds.
        self.publish_evicted = None if port is None else port.publish_evicted
        self.copy_out_evicted = None if port is None else port.copy_out_evicted


# the PagedKVCache properties a CoreField answers, by number
_FIELDS = ("num_computed", "num_tokens", "num_blocks", "capacity", "closed", "max_seq_len",
           "salt", "block_table", "token_ids")


cdef class CoreField:
    """A read-only property of ``PagedKVCache`` answered in C from the
    SeqCore it holds (``obj._seq``): no Python frame on the counters a
    decode loop reads.  An unbound core raises RuntimeError, as every member
    of an uninitialised sequence does."""
    cdef str name
    cdef int field
    cdef readonly str __doc__

    def __init__(self, str name, str doc):
        self.name = name
        self.__doc__ = doc
        self.field = _FIELDS.index(name)

    def __get__(self, obj, objtype):
        if obj is None:
            return self
        cdef SeqCore core = <SeqCore?>getattr(obj, "_seq")
        if core.state == S_UNINIT:
            raise core.state_error(self.name)
        if self.field == 0:
            return core.num_computed
        if self.field == 1:
            return core.num_tokens
        if self.field == 2:
            return core.num_held
        if self.field == 3:
            return core.num_held * core.block_size
        if self.field == 4:
            return core.state == S_CLOSED
        if self.field == 5:
            return core.max_seq_len
        if self.field == 6:
            return core.salt
        if self.field == 7:
            return _copy(core.table[:core.num_held])
        return core.token_ids()

    def __set__(self, obj, value):
        raise AttributeError(f"property {self.name!r} of 'PagedKVCache' object has no setter")


def bind(PoolBinding binding, max_seq_len, salt, uint64_t root0, uint64_t root1,
         int64_t root_serial):
    """A new SeqCore bound to a pool (see ``SeqCore._bind``): a function,
    so that making a sequence costs one fast call."""
    cdef SeqCore core = SeqCore.__new__(SeqCore)
    core._bind(binding, max_seq_len, salt, root0, root1, root_serial)
    return core


cdef class SeqCore:
    """Bookkeeping state of one sequence in a ``BlockPool``; ``PagedKVCache``
    holds one and is its public face.  It knows block ids, counts, token
    ids and hashes; the bytes are written by the pool's writer and
    block copy, handed in through a ``PoolBinding``."""
    # What the pool lends (core, lock, writer, block copy, spill hook):
    # read from the binding, never copied field by field, so that every
    # sequence however made (bind, fork) spills its evictions the same way
    cdef PoolBinding binding
    cdef PoolCore _core
    cdef RowWriter writer                       # None: no direct appends
    cdef object copy_blocks                     # the pool's block copy (copy-on-write)
    cdef object lock_acquire, lock_release      # the pool's lock
    cdef readonly Py_ssize_t block_size
    cdef Py_ssize_t num_layers
    cdef readonly object max_seq_len            # None or int
    cdef Py_ssize_t max_len                     # -1: no limit
    cdef readonly object salt
    cdef readonly bint caching
    cdef uint64_t root0, root1                  # the salt's hash-chain root
    cdef int64_t root_serial                    # the salt's identity-chain root
                                                # (< -1: a reference held on it)
    cdef readonly int state                     # S_UNINIT .. S_CLOSED
    cdef token_t* token_buf
    cdef hash_word_t* hash_buf
    cdef int64_t* block_serials
    cdef unsigned char* ident_buf               # IDENTITY_SIZE bytes per block
    cdef Py_ssize_t token_cap, hash_cap, serial_cap, ident_cap, num_identified
    cdef readonly cnp.ndarray table
    cdef readonly Py_ssize_t num_tokens, num_computed, num_held, num_hashed, num_registered
    cdef Py_ssize_t* pending
    cdef Py_ssize_t exclusive_lo, exclusive_hi
    cdef Py_ssize_t slot_lo, slot_hi
    cdef cnp.ndarray slot_val
    cdef object held_records                    # see allocate, take_held_records
    # what the last failed call saw, for the caller's error message
    cdef readonly Py_ssize_t failed_free_blocks, failed_copy_on_write, failed_layer

    def __cinit__(self):
        self.table = _EMPTY_I32
        self.max_len = -1
        self.slot_lo = -1
        self.root_serial = -1

    def __dealloc__(self):
        free(self.pending)
        free(self.token_buf)
        free(self.hash_buf)
        free(self.block_serials)
        free(self.ident_buf)

    def __del__(self):
        # Blocks (and the salt root) of a dropped sequence go back to the pool.
        try:
            if self.state == S_NEW or self.state == S_LIVE:
                self._release_all()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    cdef inline int _check_setup(self) except -1:
        # A subclass that skipped PagedKVCache.__init__ (or an object made
        # with __new__) has no pool: refuse instead of dividing by zero.
        if self.state == S_UNINIT:
            raise self.state_error("this call")
        return 0

    cdef inline int _check_live(self, str what) except -1:
        # The mutators' own check (PagedKVCache checks the state after its
        # arguments are converted, but a conversion runs the caller's code,
        # which may free the sequence): a closed or new sequence refuses.
        if self.state != S_LIVE:
            raise self.state_error(what)
        return 0

    def state_error(self, str what):
        """The exception for calling ``what`` in the current state (None
        while the sequence is live)."""
        if self.state == S_UNINIT:
            return RuntimeError(
                f"{what}: PagedKVCache is not initialised; call PagedKVCache.__init__(pool, "
                "...) first (a subclass's __init__ must call super().__init__(pool, ...))")
        if self.state == S_NEW:
            return ValueError(f"{what} needs an allocated sequence: call "
                              "allocate(token_ids) first")
        if self.state == S_CLOSED:
            return ValueError(f"{what} on a freed PagedKVCache: free() closed it; "
                              "use a new PagedKVCache")
        return None

    cdef int _bind(self, PoolBinding binding, object max_seq_len, object salt,
                   uint64_t root0, uint64_t root1, int64_t root_serial) except -1:
        """Bind to a pool (``binding``) with ``salt`` (bytes or None, whose
        hash-chain root is root0, root1, and whose identity-chain root is
        ``root_serial``, with a reference taken on it for this sequence).
        The sequence starts NEW.  (A SeqCore never bound stays UNINIT: the
        core of a PagedKVCache whose ``__init__`` never ran.)"""
        cdef Py_ssize_t* pending
        self._use_binding(binding)
        self.max_seq_len = max_seq_len
        self.max_len = -1 if max_seq_len is None else _count(max_seq_len)
        self.salt = salt
        self.root0 = root0
        self.root1 = root1
        pending = <Py_ssize_t*>calloc(self.num_layers, sizeof(Py_ssize_t))
        if pending == NULL:
            raise MemoryError()
        self.pending = pending
        self._reset_state()
        # from here on the sequence owns the reference (its free or __del__
        # gives it back); the unsalted chain's root, -1, is not counted
        self.root_serial = root_serial
        self.state = S_NEW
        return 0

    cdef int _use_binding(self, PoolBinding binding) except -1:
        """Take everything the pool lends from ``binding`` (the one place
        these fields are set: ``_bind`` and ``fork_into`` both come here)."""
        self.binding = binding
        self._core = binding._core
        self.lock_acquire = binding.lock_acquire
        self.lock_release = binding.lock_release
        self.writer = binding.writer
        self.copy_blocks = binding.copy_blocks
        self.block_size = binding.block_size
        self.num_layers = binding.num_layers
        self.caching = binding.caching
        return 0

    cdef void _reset_state(self) noexcept:
        cdef Py_ssize_t i
        self.num_tokens = 0
        self.num_computed = 0
        self.num_held = 0
        self.num_hashed = 0
        self.num_registered = 0
        self.num_identified = 0
        for i in range(self.num_layers):
            self.pending[i] = 0
        self._invalidate()

    cdef inline void _invalidate(self) noexcept:
        self.exclusive_lo = 0
        self.exclusive_hi = 0
        self.slot_lo = -1

    # ------------------------------------------------------------ state
    cdef inline Py_ssize_t _most_pending(self) noexcept:
        """The most positions any layer appended in the current step (0 for
        an unbound sequence: it has no layers)."""
        cdef Py_ssize_t i, most = 0
        for i in range(self.num_layers):
            if self.pending[i] > most:
                most = self.pending[i]
        return most

    def max_written(self):
        """Positions readable in the layer that has written most (committed
        plus appended this step)."""
        return self.num_computed + self._most_pending()

    def written(self, Py_ssize_t layer):
        """Positions readable in (validated) ``layer``."""
        self._check_setup()
        return self.num_computed + self.pending[layer]

    def token_ids(self):
        """int32 array of the known token ids (a copy)."""
        cdef cnp.ndarray out = _empty(self.num_tokens, cnp.NPY_INT32)
        if self.num_tokens:  # (token_buf is NULL until the first token)
            memcpy(_ptr(out), self.token_buf, self.num_tokens * sizeof(token_t))
        return out

    def hash_words(self):
        """(n_hashed, 2) uint64 array of the known blocks' hashes (a copy)."""
        cdef cnp.ndarray out = _empty_hashes(self.num_hashed)
        if self.num_hashed:
            memcpy(_ptr(out), self.hash_buf, self.num_hashed * 2 * sizeof(hash_word_t))
        return out

    def length(self):
        """Known tokens or written positions, whichever reach further."""
        return max(self.num_tokens, self.num_computed + self._most_pending())

    # ------------------------------------------------------------ hashing
    cdef int _hash(self, const token_t* t, Py_ssize_t n_blocks, uint64_t parent0,
                   uint64_t parent1, hash_word_t* out) except -1:
        """out[i] = h[i] for the n_blocks full blocks at t, chained from parent."""
        if n_blocks >= HASH_NOGIL_BLOCKS:
            with nogil:
                self._core.hash_chain(t, n_blocks, self.block_size, parent0, parent1, out)
        else:
            self._core.hash_chain(t, n_blocks, self.block_size, parent0, parent1, out)
        return 0

    cdef int _hash_known_blocks(self) except -1:
        cdef Py_ssize_t full = self.num_tokens // self.block_size, h = self.num_hashed
        if full <= h:
            return 0
        _fit(<void**>&self.hash_buf, &self.hash_cap, full, 2 * sizeof(hash_word_t), h)
        if h == 0:
            self._hash(self.token_buf, full, self.root0, self.root1, self.hash_buf)
        else:
            self._hash(self.token_buf + h * self.block_size, full - h, self.hash_buf[2 * h - 2],
                       self.hash_buf[2 * h - 1], self.hash_buf + 2 * h)
        self.num_hashed = full
        return 0

    cdef int _identify(self, Py_ssize_t upto) except -1:
        """The identity digests of the first ``upto`` full blocks (their
        tokens known) in ``ident_buf``, each computed once."""
        cdef Py_ssize_t have = self.num_identified
        cdef bytes root
        if upto <= have:
            return 0
        _fit(<void**>&self.ident_buf, &self.ident_cap, upto, IDENTITY_SIZE, have)
        if have == 0:
            root = identity_root(self.salt)
            identity_chain_c(<const unsigned char*><const char*>root, self.token_buf, upto,
                             self.block_size, self.ident_buf)
        else:
            identity_chain_c(self.ident_buf + (have - 1) * IDENTITY_SIZE,
                             self.token_buf + have * self.block_size, upto - have,
                             self.block_size, self.ident_buf + have * IDENTITY_SIZE)
        self.num_identified = upto
        return 0

    def identities(self, Py_ssize_t first, Py_ssize_t stop):
        """The identity digests of full blocks ``first..stop-1`` (tokens
        known), ``32 * (stop - first)`` bytes: what a prefix-store lookup
        checks entries against, and what these blocks register with."""
        self._check_setup()
        if not 0 <= first <= stop or stop * self.block_size > self.num_tokens:
            raise ValueError(f"internal: no full blocks {first}..{stop - 1}")
        self._identify(stop)
        return (<char*>self.ident_buf)[first * IDENTITY_SIZE:stop * IDENTITY_SIZE] \
            if stop > first else b""

    cdef int _register_ready(self) except -1:
        """Offer the full, committed blocks with known tokens to the cache
        (with their identity digests, on a pool with stores)."""
        cdef Py_ssize_t upto, first
        cdef int64_t parent
        cdef const unsigned char* idents = NULL
        if not self.caching:
            return 0
        upto = min(self.num_computed, self.num_tokens) // self.block_size
        if upto > self.num_hashed:
            upto = self.num_hashed
        if upto <= self.num_registered:
            return 0
        first = self.num_registered
        _fit(<void**>&self.block_serials, &self.serial_cap, upto, sizeof(int64_t), first)
        if self._core.publish_evictions:
            self._identify(upto)      # (off the pool's lock)
            idents = self.ident_buf
        parent = self.block_serials[first - 1] if first else self.root_serial
        self.lock_acquire()
        try:
            self._core.c_register(<block_id_t*>_ptr(self.table), self.hash_buf, self.token_buf,
                                  first, upto, parent, self.block_serials, self.root0, self.root1,
                                  idents)
        finally:
            self.lock_release()
        self.num_registered = upto
        return 0

    # ------------------------------------------------------------ operations
    def allocate(self, token_ids):
        """Blocks for the prompt ``token_ids`` on an empty sequence.  Returns
        the hit tokens, or a status (nothing changed the caller can see):
        STATE (not initialised, or closed), BUSY, UNCHECKED (not a 1-D
        C-contiguous aligned int32 array of ids >= 0), EMPTY, TOO_LONG or SHORT,
        checked in that order."""
        cdef Py_ssize_t n, max_hit, hits
        cdef cnp.ndarray table
        if self.state != S_NEW and self.state != S_LIVE:
            return ST_STATE
        if self.num_held or self.num_tokens or self.num_computed:
            return ST_BUSY
        n = self._copy_prompt(token_ids)
        if n < 0:
            return n
        if n == 0:
            return ST_EMPTY
        if self.max_len >= 0 and n > self.max_len:
            return ST_TOO_LONG
        max_hit = self._hash_prompt(n)
        table = _empty(max(self._blocks_for(n), 16), cnp.NPY_INT32)
        hits = self._take_prompt_blocks(n, max_hit, table)
        if hits < 0:
            return hits
        self._start_live(n, table, hits)
        return hits * self.block_size

    cdef inline Py_ssize_t _blocks_for(self, Py_ssize_t n) noexcept:
        """Blocks that hold ``n`` (>= 0) positions (no overflow near
        PY_SSIZE_T_MAX: a reserve of 2**63 - 1 positions is short of blocks,
        not of none)."""
        return n // self.block_size + (n % self.block_size != 0)

    cdef Py_ssize_t _copy_prompt(self, object token_ids) except -100:
        """Copy the prompt into the token buffer: its length, or UNCHECKED
        when ``token_ids`` is not a 1-D C-contiguous aligned native int32
        array of ids >= 0.  The buffer's contents count only up to
        num_tokens (0 here), so a rejected prompt leaves nothing behind."""
        cdef cnp.ndarray tokens
        cdef Py_ssize_t n, i
        cdef const token_t* src
        cdef token_t* dst
        cdef token_t any_bits = 0
        if type(token_ids) is not np.ndarray:
            return ST_UNCHECKED
        tokens = <cnp.ndarray>token_ids
        if cnp.PyArray_NDIM(tokens) != 1 or cnp.PyArray_TYPE(tokens) != cnp.NPY_INT32 \
                or not cnp.PyArray_IS_C_CONTIGUOUS(tokens) \
                or not cnp.PyArray_ISNOTSWAPPED(tokens) or not cnp.PyArray_ISALIGNED(tokens):
            return ST_UNCHECKED
        n = cnp.PyArray_SIZE(tokens)
        # the ids are checked on the way in (as checked_token_array does:
        # the OR of all has the sign bit set iff one is negative)
        _fit(<void**>&self.token_buf, &self.token_cap, n, sizeof(token_t), 0)
        src = <const token_t*>_ptr(tokens)
        dst = self.token_buf
        for i in range(n):
            dst[i] = src[i]
            any_bits = any_bits | src[i]
        if any_bits < 0:
            return ST_UNCHECKED
        return n

    cdef Py_ssize_t _hash_prompt(self, Py_ssize_t n) except -1:
        """Room for the serials (and hashes) of the prompt's ``n // block_size``
        full blocks, the hashes computed when caching; returns the most
        blocks a prefix hit may cover."""
        cdef Py_ssize_t n_full = n // self.block_size
        _fit(<void**>&self.block_serials, &self.serial_cap, n_full, sizeof(int64_t), 0)
        if not self.caching:
            return 0
        _fit(<void**>&self.hash_buf, &self.hash_cap, n_full, 2 * sizeof(hash_word_t), 0)
        if n_full:
            self._hash(self.token_buf, n_full, self.root0, self.root1, self.hash_buf)
        return (n - 1) // self.block_size  # the last prompt token is always computed

    cdef Py_ssize_t _take_prompt_blocks(self, Py_ssize_t n, Py_ssize_t max_hit,
                                        cnp.ndarray table) except -100:
        """Under the pool lock: the prompt's blocks into ``table`` (the
        cached prefix first, up to ``max_hit`` blocks), its evictions copied
        out and the prefix-cache counts.  The hit blocks, or SHORT
        (``failed_free_blocks`` set; nothing taken)."""
        cdef PoolCore core = self._core
        cdef Py_ssize_t total = self._blocks_for(n), hits, i
        cdef int64_t root = self.root_serial
        cdef block_id_t* ids = <block_id_t*>_ptr(table)
        if core.publish_evictions:     # room for the hits' identity digests
            _fit(<void**>&self.ident_buf, &self.ident_cap, max_hit, IDENTITY_SIZE, 0)
        self.lock_acquire()
        try:
            if total >= NOGIL_BLOCKS:
                with nogil:
                    hits = core.c_allocate(self.token_buf, self.hash_buf, max_hit, total, root,
                                           ids, self.block_serials)
            else:
                hits = core.c_allocate(self.token_buf, self.hash_buf, max_hit, total, root, ids,
                                       self.block_serials)
            if hits < 0:
                self.failed_free_blocks = core.num_uncached_free + core.num_lru_free
                return ST_SHORT
            if core.publish_evictions:
                # the hits' digests, as the pool keeps them (held now: they
                # stay cached), so that none is computed twice
                for i in range(hits):
                    memcpy(self.ident_buf + i * IDENTITY_SIZE, &core.identity[ids[i], 0],
                           IDENTITY_SIZE)
                self.num_identified = hits
            if core.num_evict_log and self.binding.copy_out_evicted is not None:
                # copied out now (before anything writes the blocks),
                # published by the caller after its store lookup: published
                # first, they could push out the very entries the lookup
                # (and probe) counts on
                self.held_records = self.binding.copy_out_evicted()
            if self.caching:
                core.prefix_queries += n
                core.prefix_hits += hits * self.block_size
        finally:
            self.lock_release()
        return hits

    cdef void _start_live(self, Py_ssize_t n, cnp.ndarray table, Py_ssize_t hits) noexcept:
        """The counters of a sequence just given its ``n``-token prompt's
        blocks ``table``, of which the first ``hits`` were cached."""
        self.table = table
        self.num_held = self._blocks_for(n)
        self.num_tokens = n
        self.num_hashed = n // self.block_size if self.caching else 0
        self.num_computed = hits * self.block_size
        self.num_registered = hits
        self._invalidate()
        self.state = S_LIVE

    def take_held_records(self):
        """The records of what the last ``allocate`` evicted, copied out for
        the pool's prefix stores and not yet published (None: nothing); the
        caller publishes them (once: this clears them)."""
        held, self.held_records = self.held_records, None
        return held

    def adopt_loaded(self, Py_ssize_t m):
        """Right after ``allocate``: the ``m`` blocks following the prefix
        hit (fresh blocks of this sequence, filled by the pool from its
        prefix stores) hold the prompt's KV.  num_computed grows by ``m``
        blocks, they enter the prefix cache and count as prefix hits.
        Returns the new hit in tokens; ValueError (nothing changed) when
        the sequence is not just allocated or ``m`` reaches past the
        blocks a hit may cover."""
        cdef Py_ssize_t bs = self.block_size, first, i
        if self.state != S_LIVE:
            raise ValueError("internal: adopt_loaded on a sequence that is not live")
        first = self.num_computed // bs
        for i in range(self.num_layers):
            if self.pending[i]:
                raise ValueError("internal: adopt_loaded after appends")
        if m < 0 or self.num_computed % bs or first != self.num_registered \
                or first + m > (self.num_tokens - 1) // bs:
            raise ValueError(f"internal: cannot adopt {m} loaded blocks after {first}")
        if m == 0:
            return self.num_computed
        self.num_computed += m * bs
        self._invalidate()
        self._register_ready()
        self.lock_acquire()
        try:
            self._core.prefix_hits += m * bs
        finally:
            self.lock_release()
        return self.num_computed

    cdef int _ensure(self, Py_ssize_t target) except -2:
        """Blocks for positions up to ``target`` - 1, those from num_computed
        on this sequence's own (copy-on-write).  0, or SHORT (-1; nothing
        changed; ``failed_copy_on_write``, ``failed_free_blocks`` set)."""
        cdef Py_ssize_t first, end, grow, last, ncow = 0, need
        cdef PoolCore core = self._core
        cdef cnp.ndarray shared, fresh
        if target <= self.num_computed:
            return 0
        first = self.num_computed // self.block_size
        end = self._blocks_for(target)  # blocks [first, end) must be ours
        if self.exclusive_lo <= first and end <= self.exclusive_hi:
            return 0
        grow = end - self.num_held if end > self.num_held else 0
        last = min(end, self.num_held)
        self.lock_acquire()
        try:
            if last > first:
                # positions in the table of the blocks [first, last) shares
                shared = _empty(last - first, cnp.NPY_INT32)
                ncow = core.c_shared_blocks(<block_id_t*>_ptr(self.table), first, last,
                                            <block_id_t*>_ptr(shared))
            need = grow + ncow
            if need:
                if need > core.num_uncached_free + core.num_lru_free:
                    self.failed_copy_on_write = ncow
                    self.failed_free_blocks = core.num_uncached_free + core.num_lru_free
                    return ST_SHORT
                fresh = self._take_fresh(need)
                if ncow:
                    self._copy_on_write(shared, ncow, fresh)
                if grow:
                    self._append_blocks(<block_id_t*>_ptr(fresh) + ncow, grow)
                self.slot_lo = -1
        finally:
            self.lock_release()
        self.exclusive_lo = first
        self.exclusive_hi = end
        return 0

    cdef cnp.ndarray _take_fresh(self, Py_ssize_t need):
        """``need`` blocks off the pool (lock held; the caller checked that
        it has them); the cached blocks that evicted are published to the
        pool's stores."""
        cdef cnp.ndarray fresh = _empty(need, cnp.NPY_INT32)
        self._core.c_take(need, <block_id_t*>_ptr(fresh))
        if self._core.num_evict_log and self.binding.publish_evicted is not None:
            self.binding.publish_evicted()
        return fresh

    cdef int _copy_on_write(self, cnp.ndarray shared, Py_ssize_t ncow,
                            cnp.ndarray fresh) except -1:
        """Lock held: replace the ``ncow`` shared blocks at table positions
        ``shared`` by copies in the first ``ncow`` of ``fresh`` and release
        the originals.  If the copy raises, every block of ``fresh`` goes
        back and the table is unchanged."""
        cdef block_id_t* ids = <block_id_t*>_ptr(self.table)
        cdef const block_id_t* where = <const block_id_t*>_ptr(shared)
        cdef block_id_t* copies = <block_id_t*>_ptr(fresh)
        cdef cnp.ndarray old = _empty(ncow, cnp.NPY_INT32)
        cdef block_id_t* originals = <block_id_t*>_ptr(old)
        cdef Py_ssize_t i
        for i in range(ncow):
            originals[i] = ids[where[i]]
        try:
            self.copy_blocks(old, fresh[:ncow])
        except BaseException:
            self._core.c_release(copies, cnp.PyArray_DIM(fresh, 0))
            raise
        for i in range(ncow):
            ids[where[i]] = copies[i]
        self._core.c_release(originals, ncow)
        return 0

    cdef int _append_blocks(self, const block_id_t* blocks, Py_ssize_t n) except -1:
        """Add ``n`` blocks to the end of the table (a bigger copy when it is
        full: the table is never resized in place)."""
        self.table = _grown(self.table, self.num_held + n)
        memcpy(<block_id_t*>_ptr(self.table) + self.num_held, blocks, n * sizeof(block_id_t))
        self.num_held += n
        return 0

    def reserve(self, n):
        """Make positions num_computed .. num_computed + n - 1 writable.  0,
        or a status (nothing changed): STATE (not live), UNCHECKED (n not an
        int >= 0), TOO_LONG or SHORT."""
        if self.state != S_LIVE:
            return ST_STATE
        cdef Py_ssize_t m, target
        if type(n) is not int or n < 0:
            return ST_UNCHECKED
        m = _count(n)
        if m > PY_SSIZE_T_MAX - self.num_computed:
            if self.max_len >= 0:
                return ST_TOO_LONG
            self.failed_copy_on_write = 0
            self.failed_free_blocks = self._core.num_uncached_free + self._core.num_lru_free
            return ST_SHORT
        target = self.num_computed + m
        if self.max_len >= 0 and target > self.max_len:
            return ST_TOO_LONG
        return self._ensure(target)

    def ensure_to(self, Py_ssize_t target):
        """``_ensure`` for a validated target position: 0 or SHORT."""
        self._check_live("append")
        return self._ensure(target)

    def step_slots(self, Py_ssize_t start, Py_ssize_t end):
        """int64 slots of positions start..end-1 (within the table); the same
        array serves every layer of a step."""
        self._check_live("append")
        cdef Py_ssize_t p, bs = self.block_size
        cdef const block_id_t* t
        cdef slot_t* o
        if self.slot_lo != start or self.slot_hi != end:
            self.slot_val = _empty(end - start, cnp.NPY_INT64)
            t = <const block_id_t*>_ptr(self.table)
            o = <slot_t*>_ptr(self.slot_val)
            for p in range(start, end):
                o[p - start] = <slot_t>t[p // bs] * bs + p % bs
            self.slot_lo = start
            self.slot_hi = end
        return self.slot_val

    def note_append(self, Py_ssize_t layer, Py_ssize_t n):
        """``n`` positions of (validated) ``layer`` were written this step."""
        self._check_live("append")
        if n > self.pending[layer]:
            self.pending[layer] = n

    def append_direct(self, layer, k, v):
        """``append(layer, k, v)`` in one native call for the inputs the
        pool's writer takes as they are (see PositionWriter), with
        ``layer`` an int in range, within max_seq_len and the free blocks:
        reserves the positions, has the writer write them, and returns True.
        Returns False having changed nothing for any other input (or state,
        or a pool without a writer), which then takes the validated path."""
        cdef Py_ssize_t n, target, lay
        cdef RowInput rows
        cdef RowWriter writer = self.writer
        if self.state != S_LIVE or writer is None or type(layer) is not int \
                or not 0 <= layer < self.num_layers:
            return False
        lay = layer
        n = writer.take(k, v, &rows)
        if n < 1:
            return False
        target = self.num_computed + n
        if self.max_len >= 0 and target > self.max_len:
            return False
        if self._ensure(target) != 0:
            return False
        writer.write(lay, &rows, <const block_id_t*>_ptr(self.table), self.num_computed)
        if n > self.pending[lay]:
            self.pending[lay] = n
        return True

    cdef inline Py_ssize_t _reserved_through(self, Py_ssize_t m) noexcept:
        """0 when positions num_computed .. num_computed + m - 1 lie within
        max_seq_len and the reserved blocks, else TOO_LONG or PAST_RESERVED."""
        cdef Py_ssize_t target
        if m > PY_SSIZE_T_MAX - self.num_computed:
            return ST_TOO_LONG if self.max_len >= 0 else ST_PAST_RESERVED
        target = self.num_computed + m
        if self.max_len >= 0 and target > self.max_len:
            return ST_TOO_LONG
        if target > self.num_held * self.block_size:
            return ST_PAST_RESERVED
        return 0

    def commit(self, n):
        """num_computed += n for all layers, registering what became ready.
        0, or a status (nothing changed): STATE (not live), UNCHECKED (n not
        an int >= 0), TOO_LONG, PAST_RESERVED or UNWRITTEN (a layer has not
        written the positions: ``failed_layer`` is the first)."""
        cdef Py_ssize_t m, i, status
        if self.state != S_LIVE:
            return ST_STATE
        if type(n) is not int or n < 0:
            return ST_UNCHECKED
        m = _count(n)
        status = self._reserved_through(m)
        if status:
            return status
        # every layer must have written the positions (append, or pool.write
        # + mark_written): else a block's earlier owner's KV would become
        # readable, and enter the prefix cache
        for i in range(self.num_layers):
            if self.pending[i] < m:
                self.failed_layer = i
                return ST_UNWRITTEN
        self.num_computed += m
        for i in range(self.num_layers):
            self.pending[i] -= m
        self._register_ready()
        return 0

    def mark_written(self, layer, n):
        """``mark_written(layer, n)``: 0, or a status (nothing changed):
        STATE (not live), UNCHECKED (layer or n not an int in range),
        TOO_LONG or PAST_RESERVED."""
        cdef Py_ssize_t m, lay, status
        if self.state != S_LIVE:
            return ST_STATE
        if type(layer) is not int or type(n) is not int or n < 0 \
                or not 0 <= layer < self.num_layers:
            return ST_UNCHECKED
        lay = layer
        m = _count(n)
        status = self._reserved_through(m)
        if status:
            return status
        if m > self.pending[lay]:
            self.pending[lay] = m
        return 0

    def append_token(self, token_id):
        """Add a token id.  0, or a status (nothing changed): STATE (not
        live), UNCHECKED (not an int in 0..2**31-1) or TOO_LONG."""
        if self.state != S_LIVE:
            return ST_STATE
        cdef Py_ssize_t n = self.num_tokens
        cdef token_t tid
        if type(token_id) is not int or not 0 <= token_id <= 2147483647:
            return ST_UNCHECKED
        tid = token_id
        if self.max_len >= 0 and n + 1 > self.max_len:
            return ST_TOO_LONG
        if n >= self.token_cap:
            _fit(<void**>&self.token_buf, &self.token_cap, n + 1, sizeof(token_t), n)
        self.token_buf[n] = tid
        self.num_tokens = n + 1
        if self.caching and (n + 1) % self.block_size == 0:
            self._hash_known_blocks()
            self._register_ready()
        return 0

    def extend_tokens(self, cnp.ndarray t):
        """Add the validated token ids ``t`` (1-D C-contiguous int32).  0, or
        TOO_LONG (nothing changed)."""
        self._check_live("extend_tokens")
        cdef Py_ssize_t n = self.num_tokens, m = cnp.PyArray_SIZE(t)
        if self.max_len >= 0 and n + m > self.max_len:
            return ST_TOO_LONG
        if m:
            _fit(<void**>&self.token_buf, &self.token_cap, n + m, sizeof(token_t), n)
            memcpy(self.token_buf + n, _ptr(t), m * sizeof(token_t))
        self.num_tokens = n + m
        if self.caching:
            self._hash_known_blocks()
            self._register_ready()
        return 0

    def truncate(self, Py_ssize_t n):
        """Forget positions and tokens from ``n`` (validated: at most the
        sequence length) on, releasing the blocks no longer needed."""
        self._check_live("truncate")
        cdef Py_ssize_t bs = self.block_size, keep = min((n + bs - 1) // bs, self.num_held)
        cdef Py_ssize_t old_nc = self.num_computed, i
        if keep < self.num_held:
            self._release_tail(keep)
            self.num_held = keep
        self.num_tokens = min(self.num_tokens, n)
        self.num_computed = min(old_nc, n)
        for i in range(self.num_layers):
            self.pending[i] = max(0, min(old_nc + self.pending[i], n) - self.num_computed)
        self.num_hashed = min(self.num_hashed, self.num_tokens // bs)
        self.num_identified = min(self.num_identified, self.num_tokens // bs)
        self.num_registered = min(self.num_registered, n // bs)
        self._invalidate()

    def fork_into(self, SeqCore child):
        """Make ``child`` (fresh) a copy of this sequence sharing its blocks."""
        self._check_setup()
        cdef Py_ssize_t* pending = <Py_ssize_t*>calloc(self.num_layers, sizeof(Py_ssize_t))
        if pending == NULL:
            raise MemoryError()
        memcpy(pending, self.pending, self.num_layers * sizeof(Py_ssize_t))
        free(child.pending)
        child.pending = pending
        child._use_binding(self.binding)
        child.max_seq_len = self.max_seq_len
        child.max_len = self.max_len
        child.salt = self.salt
        child.root0 = self.root0
        child.root1 = self.root1
        child._take_buffers(self)
        child.table = _copy(self.table)
        child.num_tokens, child.num_computed, child.num_held = \
            self.num_tokens, self.num_computed, self.num_held
        child.num_hashed, child.num_identified, child.num_registered = \
            self.num_hashed, self.num_identified, self.num_registered
        if self.num_held or self.root_serial < -1:
            self.lock_acquire()
            try:
                if self.num_held:
                    self._core.c_incref(<block_id_t*>_ptr(self.table), self.num_held)
                # the child holds the salt too
                self._core.c_root_incref(self.root_serial)
            finally:
                self.lock_release()
        # only now the child owns references its __del__ or free gives back
        child.root_serial = self.root_serial
        child.state = self.state
        # the blocks are shared now: the next write to either copies
        self._invalidate()
        child._invalidate()

    def adopt(self, SeqCore src, cnp.ndarray table, Py_ssize_t nblocks):
        """Take ``src``'s tokens, hashes and positions with blocks ``table``
        (this sequence's pool's, holding src's KV; this sequence is fresh)
        and register what is ready, from block 0."""
        self._check_setup()
        self.table = table
        self.num_held = nblocks
        self._take_buffers(src)
        self.num_tokens = src.num_tokens
        self.num_hashed = src.num_hashed
        self.num_identified = src.num_identified
        self.num_computed = src.num_computed
        # (the pools' geometries match whenever src holds blocks; without
        # blocks nothing is pending)
        memcpy(self.pending, src.pending,
               min(self.num_layers, src.num_layers) * sizeof(Py_ssize_t))
        self.state = src.state
        self._register_ready()

    cdef int _take_buffers(self, SeqCore src) except -1:
        """Copies of src's known token ids, hashes, serials and identity
        digests (this sequence is fresh)."""
        free(self.token_buf)
        self.token_buf = NULL
        self.token_buf = <token_t*>_dup(src.token_buf, src.num_tokens, sizeof(token_t), &self.token_cap)
        free(self.hash_buf)
        self.hash_buf = NULL
        self.hash_buf = <hash_word_t*>_dup(src.hash_buf, src.num_hashed, 2 * sizeof(hash_word_t),
                                     &self.hash_cap)
        free(self.block_serials)
        self.block_serials = NULL
        self.block_serials = <int64_t*>_dup(src.block_serials, src.num_registered, sizeof(int64_t), &self.serial_cap)
        free(self.ident_buf)
        self.ident_buf = NULL
        self.ident_buf = <unsigned char*>_dup(src.ident_buf, src.num_identified, IDENTITY_SIZE,
                                              &self.ident_cap)
        return 0

    cdef int _release_tail(self, Py_ssize_t keep) except -1:
        """Release blocks keep..nblocks-1 (last first) under the pool lock."""
        self.lock_acquire()
        try:
            self._core.c_release(<block_id_t*>_ptr(self.table) + keep, self.num_held - keep)
        finally:
            self.lock_release()
        return 0

    cdef int _release_all(self) except -1:
        """Release every block and the salt root; the sequence is empty."""
        cdef int64_t root = self.root_serial
        if self.num_held:
            self._release_tail(0)
        self._reset_state()
        if root < -1:
            self.root_serial = -1
            self.lock_acquire()
            try:
                self._core.c_root_decref(root)
            finally:
                self.lock_release()
        return 0

    def unallocate(self):
        """Undo an ``allocate`` whose caller failed right after it (before
        ``adopt_loaded``; e.g. a store warning raised as an error): every
        block back, the call's prefix-cache counts taken back, the sequence
        empty and new again, its salt kept."""
        cdef PoolCore core = self._core
        if self.state != S_LIVE:
            return
        self.lock_acquire()
        try:
            if self.num_held:
                core.c_release(<block_id_t*>_ptr(self.table), self.num_held)
            if self.caching:
                core.prefix_queries -= self.num_tokens
                core.prefix_hits -= self.num_computed
        finally:
            self.lock_release()
        self._reset_state()
        self.held_records = None
        self.state = S_NEW

    def free(self):
        """Close the sequence: release every block and the salt, drop the
        buffers (idempotent; raises on an uninitialised object)."""
        if self.state == S_UNINIT:
            raise self.state_error("free")
        if self.state == S_CLOSED:
            return
        self._release_all()
        self.state = S_CLOSED
        self.table = _EMPTY_I32
        self.slot_val = None
        free(self.token_buf)
        free(self.hash_buf)
        free(self.block_serials)
        free(self.ident_buf)
        self.token_buf = NULL
        self.hash_buf = NULL
        self.block_serials = NULL
        self.ident_buf = NULL
        self.token_cap = self.hash_cap = self.serial_cap = self.ident_cap = 0
