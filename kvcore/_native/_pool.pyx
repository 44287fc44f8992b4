"""Block-pool bookkeeping over flat arrays: reference counts, two free lists,
the prefix-cache hash index, token-id verification, block hashing.

No Python object exists per block.  Every method assumes the caller holds the
pool's lock and has validated its arguments (``kvcore/pool.py``); methods that
can fail return a status and change nothing when they do.

Free lists (doubly linked through ``prev_free_block``/``next_free_block``):
  * uncached: never-cached or released-and-uncached blocks, handed out first;
  * LRU: cached blocks nobody holds, least recently released at the head.
    Eviction takes the head.  A sequence releases its blocks tail first, so
    the tail of a cached prefix sits nearer the head than its start.
Hash index: ``buckets[h0 & mask]`` heads a doubly linked chain of cached
blocks (``prev_in_bucket``/``next_in_bucket``).  Several blocks may share a hash; a lookup
only returns a block whose stored token ids equal the query's.

Salt roots: the identity chain of a salted sequence starts at its salt's
root, a negative id (-1 is the unsalted chain's, fixed).  A root lives in a
slot of the salt table with a reference count: one per sequence holding the
salt (``new_root``/``c_root_incref``/``c_root_decref``) plus one per cached
block whose parent is the root (counted on entering and leaving the hash
index).  When the count falls to 0 nothing can reach the root again: its
slot is marked free (``salt_root[slot] = 0``), the root waits in
``salt_dead`` until its salt is forgotten (``take_dead_roots``, at the
next ``acquire_salt_root``, ``live_salt_root`` or ``num_salts``), and only then
may the slot be handed out again.  A root id encodes its slot
and the slot's generation, ``-2 - (slot | gen << 32)``, so a slot's next
root differs from its last: ids are not reused (short of 2**30 reuses of
one slot), and even a reused id could not alias two salts, since a root is
dropped only once no cached block and no sequence refers to it (the cached
blocks further down a chain refer to serials, which are never reused).

Identity digests (what a prefix-store entry is verified against): the
chained hash is SipHash-1-3 under a published key, fast but not
collision-resistant, and a store entry crosses processes and machines,
where the serials above mean nothing.  So on a pool with stores each block
registered also keeps its identity digest, BLAKE2b-256 chained over the
salt and every token id up to the block's end::

    d[-1] = 32 zero bytes without a salt, else
            BLAKE2b-256(b"kvcore.salt:" + salt, person=b"kvcore.iroot.v1")
    d[i]  = BLAKE2b-256(d[i-1] + token ids of block i as 4-byte
            little-endian integers, person=b"kvcore.ident.v1")

A sequence computes its blocks' digests once (``identity_chain_c``, the one
implementation; ``kvcore.hashing.identity_chain`` calls it too) and hands
them in with ``register``; an eviction's record carries the digest kept
here, so nothing ever walks a chain backwards.
"""
import hashlib
import operator
import sys

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp, memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

from kvcore._native._typedefs cimport block_id_t, hash_word_t, slot_t, token_t

cdef extern from "kv_hash.h" nogil:
    void kvhash_siphash128(uint64_t k0, uint64_t k1, const void* data, size_t length,
                           int c, int d, uint64_t* out)
    int KV_BLOCK_C
    int KV_BLOCK_D
    void kvhash_block_key(uint64_t* k0, uint64_t* k1)
    void kvhash_chain(const token_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                      const uint64_t* parent, uint64_t* out)

cnp.import_array()

cdef extern from *:
    """
    #ifdef KVCORE_DEBUG
    #define KV_DEBUG_BUILD 1
    #else
    #define KV_DEBUG_BUILD 0
    #endif
    """
    int KV_DEBUG_BUILD

# a salt slot's generation takes bits 32..61 of -2 - root
cdef uint64_t SALT_GEN_MASK = (1 << 30) - 1
cdef uint64_t SALT_SLOT_MASK = 0xFFFFFFFF

# True in a KVCORE_DEBUG=1 build: bounds checks on, and every pool operation
# re-verifies the whole bookkeeping (PoolCore.check) before it returns.
DEBUG_BUILD = bool(KV_DEBUG_BUILD)


cdef enum:
    NONE = -1
    HELD = 0
    FREE_UNCACHED = 1
    FREE_CACHED = 2


cdef inline void* _data(cnp.ndarray a, int typenum, Py_ssize_t need, bint write,
                        str what) except NULL:
    if cnp.PyArray_TYPE(a) != typenum or not cnp.PyArray_IS_C_CONTIGUOUS(a) \
            or cnp.PyArray_SIZE(a) < need or (write and not cnp.PyArray_ISWRITEABLE(a)):
        raise ValueError(f"internal: expected a C-contiguous {what} array of at least {need} "
                         f"elements{' (writeable)' if write else ''}, got {(<object>a).dtype} "
                         f"shape {(<object>a).shape}")
    return cnp.PyArray_DATA(a)


cdef inline block_id_t* _i32(cnp.ndarray a, Py_ssize_t need, bint write) except NULL:
    return <block_id_t*>_data(a, cnp.NPY_INT32, need, write, "int32")


cdef inline token_t* _tok(cnp.ndarray a, Py_ssize_t need) except NULL:
    return <token_t*>_data(a, cnp.NPY_INT32, need, False, "int32")


cdef inline hash_word_t* _u64(cnp.ndarray a, Py_ssize_t need) except NULL:
    return <hash_word_t*>_data(a, cnp.NPY_UINT64, need, False, "uint64")


# ------------------------------------------------------------------ hashing

BLOCK_ROUNDS = (KV_BLOCK_C, KV_BLOCK_D)


def siphash128(bytes data, uint64_t k0, uint64_t k1, int c=KV_BLOCK_C, int d=KV_BLOCK_D):
    """SipHash-c-d-128 of ``data`` (default: the block hash's 1-3); returns
    the 16 output bytes."""
    cdef uint64_t out[2]
    cdef const unsigned char[::1] view = data
    cdef const void* p = &view[0] if len(data) else NULL
    if not (1 <= c <= 8 and 1 <= d <= 8):
        raise ValueError(f"c and d must be in 1..8, got c={c}, d={d}")
    with nogil:
        kvhash_siphash128(k0, k1, p, view.shape[0], c, d, out)
    return (<unsigned long long>out[0]).to_bytes(8, "little") + \
        (<unsigned long long>out[1]).to_bytes(8, "little")


def block_key():
    """The two key words of kvcore's block hash."""
    cdef uint64_t k0, k1
    kvhash_block_key(&k0, &k1)
    return int(k0), int(k1)


cdef void hash_chain_c(const token_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                       uint64_t parent0, uint64_t parent1, hash_word_t* out) noexcept nogil:
    cdef uint64_t parent[2]
    if n_blocks <= 0:
        return
    parent[0] = parent0
    parent[1] = parent1
    kvhash_chain(tokens, n_blocks, block_size, parent, out)


cdef void forged_hash_chain_c(const token_t* tokens, Py_ssize_t n_blocks,
                              Py_ssize_t block_size, uint64_t parent0, uint64_t parent1,
                              hash_word_t* out) noexcept nogil:
    """Every block hashes to (0x1234, 0x1234): a pool made with
    ``forge_hashes`` shows that only the stored token ids and the identity
    chain keep another prefix's KV out (tests only)."""
    cdef Py_ssize_t i
    for i in range(2 * n_blocks):
        out[i] = 0x1234


def hash_chain(cnp.ndarray tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
               uint64_t parent0, uint64_t parent1, cnp.ndarray out):
    """out[i] = h[i] for the first n_blocks full blocks of int32 ``tokens``."""
    cdef const token_t* t
    cdef uint64_t* o
    if n_blocks <= 0:
        return
    t = _tok(tokens, n_blocks * block_size)
    o = <uint64_t*>_data(out, cnp.NPY_UINT64, 2 * n_blocks, True, "uint64")
    with nogil:
        hash_chain_c(t, n_blocks, block_size, parent0, parent1, o)


def slots_for(cnp.ndarray table, Py_ssize_t block_size, Py_ssize_t start, Py_ssize_t end,
              cnp.ndarray out):
    """out[i] = slot of position start + i (block table lookup)."""
    cdef const block_id_t* t = _i32(table, (end + block_size - 1) // block_size, False)
    cdef slot_t* o = <slot_t*>_data(out, cnp.NPY_INT64, end - start, True, "int64")
    cdef Py_ssize_t p
    if start < 0 or end < start:
        raise ValueError(f"internal: bad range {start}..{end}")
    for p in range(start, end):
        o[p - start] = <slot_t>t[p // block_size] * block_size + p % block_size


def checked_token_array(obj):
    """``obj`` itself if it is a 1-D C-contiguous aligned int32 array of
    valid ids (0..2**31-1); None if it is some other kind of input (the caller takes
    the general path).  Raises ValueError naming the first negative id."""
    cdef cnp.ndarray a
    cdef const token_t* t
    cdef Py_ssize_t i, n, bad = -1
    cdef token_t any_bits = 0
    if type(obj) is not np.ndarray:
        return None
    a = <cnp.ndarray>obj
    # (a byte-swapped int32 array has the same type number: it must take the
    # general path, which converts it)
    if cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_TYPE(a) != cnp.NPY_INT32 \
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISNOTSWAPPED(a) \
            or not cnp.PyArray_ISALIGNED(a):
        return None
    n = cnp.PyArray_SIZE(a)
    t = <const token_t*>cnp.PyArray_DATA(a)
    with nogil:
        # OR of all ids: its sign bit says whether any is negative, in a
        # loop the compiler vectorizes; the search runs only on bad input
        for i in range(n):
            any_bits = any_bits | t[i]
        if any_bits < 0:
            for i in range(n):
                if t[i] < 0:
                    bad = i
                    break
    if bad >= 0:
        raise ValueError(f"token_ids must lie in 0..2147483647, got {t[bad]} at index {bad}")
    return obj


def checked_slots(obj, Py_ssize_t n, slot_t limit):
    """A private copy of ``obj`` if it is a 1-D C-contiguous int64 array of
    ``n`` slots, each -1 or in 0..limit-1; None if it is another kind of
    input (the caller takes the general path).  Raises IndexError naming the
    first bad slot.  The copy is what is checked and then written through:
    the caller's array may be rewritten meanwhile (by another thread, or by
    the write itself when it is a view of the storage)."""
    cdef cnp.ndarray a
    cdef const slot_t* s
    cdef Py_ssize_t i, bad = -1
    if type(obj) is not np.ndarray:
        return None
    a = <cnp.ndarray>obj
    if cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_TYPE(a) != cnp.NPY_INT64 \
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_SIZE(a) != n \
            or not cnp.PyArray_ISNOTSWAPPED(a) or not cnp.PyArray_ISALIGNED(a):
        return None
    a = <cnp.ndarray>cnp.PyArray_NewCopy(a, cnp.NPY_CORDER)
    s = <const slot_t*>cnp.PyArray_DATA(a)
    with nogil:
        for i in range(n):
            if s[i] < -1 or s[i] >= limit:
                bad = i
                break
    if bad >= 0:
        raise IndexError(f"slots must be -1 (skip) or in 0..{limit - 1} "
                         f"(num_blocks * block_size - 1), got {s[bad]} at index {bad}")
    return a


def tokens_from_sequence(seq, token_t[::1] out):
    """Copy a list/tuple of Python ints into ``out`` checking 0 <= id < 2**31.

    Returns -1 when all are valid, else the index of the first bad item
    (not an int, or out of range); ``out`` is then partly written.
    """
    cdef Py_ssize_t i, n = len(seq)
    cdef long long v
    for i in range(n):
        item = seq[i]
        if type(item) is not int:
            if isinstance(item, bool) or not hasattr(item, "__index__"):
                return i
            try:        # (operator.index: an __index__ that gives no int is refused)
                item = operator.index(item)
            except TypeError:
                return i
        try:
            v = item
        except OverflowError:
            return i
        if v < 0 or v > 2147483647:
            return i
        out[i] = <token_t>v
    return -1


# ------------------------------------------------------------ identity digests

IDENTITY_PERSON = b"kvcore.ident.v1"
IDENTITY_ROOT_PERSON = b"kvcore.iroot.v1"
SALT_PREFIX = b"kvcore.salt:"
NO_SALT_IDENTITY = bytes(IDENTITY_SIZE)
_IDENTITY_BASE = hashlib.blake2b(digest_size=IDENTITY_SIZE, person=IDENTITY_PERSON)
# token ids enter a digest as little-endian int32 (the bytes of token_t on
# the CPUs kvcore builds for; a big-endian host swaps a copy)
cdef bint _LITTLE_ENDIAN = sys.byteorder == "little"


def identity_root(salt):
    """The identity chain's root for ``salt`` (bytes or None): 32 zero bytes
    without a salt, else BLAKE2b-256 of ``b"kvcore.salt:" + salt``."""
    if salt is None:
        return NO_SALT_IDENTITY
    return hashlib.blake2b(SALT_PREFIX + salt, digest_size=IDENTITY_SIZE,
                           person=IDENTITY_ROOT_PERSON).digest()


cdef int identity_chain_c(const unsigned char* parent, const token_t* tokens,
                          Py_ssize_t n_blocks, Py_ssize_t block_size,
                          unsigned char* out) except -1:
    cdef Py_ssize_t i, step = block_size * sizeof(token_t)
    cdef bytes prev = PyBytes_FromStringAndSize(<const char*>parent, IDENTITY_SIZE)
    cdef bytes block
    for i in range(n_blocks):
        block = PyBytes_FromStringAndSize(<const char*>(tokens + i * block_size), step)
        if not _LITTLE_ENDIAN:
            block = np.frombuffer(block, np.int32).astype("<i4").tobytes()
        h = _IDENTITY_BASE.copy()    # (a copy costs a third of a keyed constructor)
        h.update(prev)
        h.update(block)
        prev = h.digest()
        memcpy(out + i * IDENTITY_SIZE, PyBytes_AS_STRING(prev), IDENTITY_SIZE)
    return 0


def identity_chain(cnp.ndarray tokens, Py_ssize_t block_size, bytes parent,
                   Py_ssize_t n_blocks):
    """The identity digests of the first ``n_blocks`` full blocks of int32
    ``tokens``, chained from ``parent`` (a 32-byte digest: the root for
    block 0), as ``n_blocks * 32`` bytes."""
    cdef const token_t* t
    cdef bytes out
    if len(parent) != IDENTITY_SIZE:
        raise ValueError(f"internal: parent must be {IDENTITY_SIZE} bytes")
    if n_blocks <= 0:
        return b""
    t = _tok(tokens, n_blocks * block_size)
    out = PyBytes_FromStringAndSize(NULL, n_blocks * IDENTITY_SIZE)
    identity_chain_c(<const unsigned char*>PyBytes_AS_STRING(parent), t, n_blocks,
                     block_size, <unsigned char*>PyBytes_AS_STRING(out))
    return out


# ---------------------------------------------------------------- the core

cdef class PoolCore:
    """Ownership state of ``num_blocks`` blocks of ``block_size`` tokens.

    Attributes are declared in ``_pool.pxd``.  Identity chain (``serial``,
    ``parent_serial``): each registration gets a serial number never used
    before; a cached block remembers its parent's serial (or, for a first
    block, the negative id of its salt).  A hit must match hash, tokens AND
    parent, so a hit's whole prefix and salt equal the query's, hash
    collisions or not.
    """

    def __init__(self, Py_ssize_t num_blocks, Py_ssize_t block_size, bint forge_hashes=False):
        """``forge_hashes``: a test seam, fixed at construction (never a hook
        on the hot path): every block of every sequence on this pool hashes
        alike (see forged_hash_chain_c)."""
        cdef Py_ssize_t i, cap = 16
        self.hash_chain = forged_hash_chain_c if forge_hashes else hash_chain_c
        self.forged_hashes = forge_hashes
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, np.int32)
        self.prev_free_block = np.empty(num_blocks, np.int32)
        self.next_free_block = np.empty(num_blocks, np.int32)
        self.where = np.full(num_blocks, FREE_UNCACHED, np.int8)
        self.cached = np.zeros(num_blocks, np.int8)
        self.hashes = np.zeros((num_blocks, 2), np.uint64)
        self.prev_in_bucket = np.full(num_blocks, NONE, np.int32)
        self.next_in_bucket = np.full(num_blocks, NONE, np.int32)
        while cap < 2 * num_blocks:
            cap *= 2
        self.buckets = np.full(cap, NONE, np.int32)
        self.bucket_mask = cap - 1
        self.tokens = np.zeros((num_blocks, block_size), np.int32)
        self.serial = np.zeros(num_blocks, np.int64)
        self.parent_serial = np.zeros(num_blocks, np.int64)
        self.next_serial = 1
        self.salt_root = np.zeros(0, np.int64)
        self.salt_refs = np.zeros(0, np.int64)
        self.salt_dead = np.zeros(0, np.int64)
        self.salt_free = np.zeros(0, np.intp)
        self.salt_gen = np.zeros(0, np.uint64)
        self.salt_of_root = {}
        self.root_of_salt = {}
        self.parent_hashes = np.zeros((num_blocks, 2), np.uint64)
        self.chain_roots = np.zeros((num_blocks, 2), np.uint64)
        self.identity = np.zeros((num_blocks, IDENTITY_SIZE), np.uint8)
        self.evict_log = np.zeros(num_blocks, np.int32)
        self.num_evict_log = 0
        self.publish_evictions = False
        # every block starts on the uncached list, in id order
        for i in range(num_blocks):
            self.prev_free_block[i] = i - 1
            self.next_free_block[i] = i + 1 if i + 1 < num_blocks else NONE
        self.uncached_head = 0 if num_blocks else NONE
        self.uncached_tail = num_blocks - 1 if num_blocks else NONE
        self.lru_head = NONE
        self.lru_tail = NONE
        self.num_uncached_free = num_blocks
        self.num_lru_free = 0
        self.num_cached = 0
        self.evictions = 0

    # ------------------------------------------------------ free lists
    cdef inline void _unlink(self, block_id_t b) noexcept nogil:
        cdef block_id_t p = self.prev_free_block[b], n = self.next_free_block[b]
        if self.where[b] == FREE_UNCACHED:
            if p == NONE:
                self.uncached_head = n
            else:
                self.next_free_block[p] = n
            if n == NONE:
                self.uncached_tail = p
            else:
                self.prev_free_block[n] = p
            self.num_uncached_free -= 1
        else:
            if p == NONE:
                self.lru_head = n
            else:
                self.next_free_block[p] = n
            if n == NONE:
                self.lru_tail = p
            else:
                self.prev_free_block[n] = p
            self.num_lru_free -= 1
        self.where[b] = HELD
        self.prev_free_block[b] = NONE
        self.next_free_block[b] = NONE

    cdef inline void _push_uncached(self, block_id_t b) noexcept nogil:
        # LIFO: the most recently released block is reused first (warm in cache)
        self.prev_free_block[b] = NONE
        self.next_free_block[b] = self.uncached_head
        if self.uncached_head != NONE:
            self.prev_free_block[self.uncached_head] = b
        else:
            self.uncached_tail = b
        self.uncached_head = b
        self.where[b] = FREE_UNCACHED
        self.num_uncached_free += 1

    cdef inline void _append_lru(self, block_id_t b) noexcept nogil:
        self.next_free_block[b] = NONE
        self.prev_free_block[b] = self.lru_tail
        if self.lru_tail != NONE:
            self.next_free_block[self.lru_tail] = b
        else:
            self.lru_head = b
        self.lru_tail = b
        self.where[b] = FREE_CACHED
        self.num_lru_free += 1

    # ------------------------------------------------------ hash index
    cdef inline Py_ssize_t _bucket(self, uint64_t h0) noexcept nogil:
        return <Py_ssize_t>(h0 & <uint64_t>self.bucket_mask)

    cdef void _index_remove(self, block_id_t b) noexcept nogil:
        cdef block_id_t p = self.prev_in_bucket[b], n = self.next_in_bucket[b]
        if p == NONE:
            self.buckets[self._bucket(self.hashes[b, 0])] = n
        else:
            self.next_in_bucket[p] = n
        if n != NONE:
            self.prev_in_bucket[n] = p
        self.prev_in_bucket[b] = NONE
        self.next_in_bucket[b] = NONE
        self.cached[b] = 0
        self.num_cached -= 1
        if self.parent_serial[b] < -1:
            self._root_ref(self.parent_serial[b], -1)

    cdef void _index_insert(self, block_id_t b) noexcept nogil:
        cdef Py_ssize_t k = self._bucket(self.hashes[b, 0])
        cdef block_id_t head = self.buckets[k]
        self.prev_in_bucket[b] = NONE
        self.next_in_bucket[b] = head
        if head != NONE:
            self.prev_in_bucket[head] = b
        self.buckets[k] = b
        self.cached[b] = 1
        self.num_cached += 1
        if self.parent_serial[b] < -1:
            self._root_ref(self.parent_serial[b], 1)

    # ------------------------------------------------------ salt roots
    cdef Py_ssize_t _root_slot(self, int64_t root) noexcept nogil:
        """The slot holding ``root`` now, or -1 (unsalted, or not live)."""
        cdef uint64_t x
        cdef Py_ssize_t slot
        if root > -2:
            return -1
        x = <uint64_t>(-2 - root)
        slot = <Py_ssize_t>(x & SALT_SLOT_MASK)
        if slot >= self.num_salt_slots or self.salt_root[slot] != root:
            return -1
        return slot

    cdef void _root_ref(self, int64_t root, int delta) noexcept nogil:
        cdef Py_ssize_t slot = self._root_slot(root)
        if slot < 0:
            return
        self.salt_refs[slot] += delta
        if self.salt_refs[slot] <= 0:
            self.salt_refs[slot] = 0
            self.salt_root[slot] = 0
            self.salt_dead[self.num_salt_dead] = root
            self.num_salt_dead += 1
            self.num_roots -= 1

    cdef void c_root_incref(self, int64_t root) noexcept nogil:
        self._root_ref(root, 1)

    cdef void c_root_decref(self, int64_t root) noexcept nogil:
        self._root_ref(root, -1)

    def new_root(self):
        """A new salt root, holding one reference (the caller's)."""
        cdef Py_ssize_t slot, cap = self.salt_root.shape[0], new_cap
        cdef uint64_t gen
        cdef int64_t root
        if self.num_salt_free:
            self.num_salt_free -= 1
            slot = self.salt_free[self.num_salt_free]
        else:
            if self.num_salt_slots == cap:
                if cap >= <Py_ssize_t>SALT_SLOT_MASK:
                    raise MemoryError("the salt table is full (2**32 - 1 salts in use)")
                new_cap = max(16, 2 * cap)
                self.salt_root = np.concatenate([self.salt_root, np.zeros(new_cap - cap, np.int64)])
                self.salt_refs = np.concatenate([self.salt_refs, np.zeros(new_cap - cap, np.int64)])
                self.salt_dead = np.concatenate([self.salt_dead, np.zeros(new_cap - cap, np.int64)])
                self.salt_free = np.concatenate([self.salt_free, np.zeros(new_cap - cap, np.intp)])
                self.salt_gen = np.concatenate([self.salt_gen, np.zeros(new_cap - cap, np.uint64)])
            slot = self.num_salt_slots
            self.num_salt_slots += 1
        gen = (self.salt_gen[slot] + 1) & SALT_GEN_MASK
        self.salt_gen[slot] = gen
        root = -2 - <int64_t>(<uint64_t>slot | (gen << 32))
        self.salt_root[slot] = root
        self.salt_refs[slot] = 1
        self.num_roots += 1
        return root

    def root_incref(self, int64_t root):
        """One more reference to live root ``root``."""
        if self._root_slot(root) < 0:
            raise ValueError(f"root {root} is not a live salt root")
        self._root_ref(root, 1)

    def root_decref(self, int64_t root):
        """Drop one reference to live root ``root``."""
        if self._root_slot(root) < 0:
            raise ValueError(f"root {root} is not a live salt root")
        self._root_ref(root, -1)

    def root_refs(self, int64_t root):
        """References to ``root`` (0 if it is not live)."""
        cdef Py_ssize_t slot = self._root_slot(root)
        return 0 if slot < 0 else int(self.salt_refs[slot])

    def take_dead_roots(self):
        """The roots that lost their last reference since the last call (a
        list); their slots may be handed out again from now on."""
        cdef Py_ssize_t i
        cdef int64_t root
        out = []
        for i in range(self.num_salt_dead):
            root = self.salt_dead[i]
            out.append(root)
            self.salt_free[self.num_salt_free] = <Py_ssize_t>(<uint64_t>(-2 - root)
                                                              & SALT_SLOT_MASK)
            self.num_salt_free += 1
        self.num_salt_dead = 0
        return out

    @property
    def num_dead_roots(self):
        return self.num_salt_dead

    def _forget_dead_salts(self):
        if self.num_salt_dead:
            for root in self.take_dead_roots():
                del self.root_of_salt[self.salt_of_root.pop(root)]

    def acquire_salt_root(self, bytes salt):
        """The root of ``salt`` with one more reference (a new root for a
        salt nothing refers to), for a new sequence, which drops it
        (``c_root_decref``) when freed."""
        self._forget_dead_salts()
        root = self.root_of_salt.get(salt)
        if root is None:
            root = self.new_root()
            self.root_of_salt[salt] = root
            self.salt_of_root[root] = salt
        else:
            self.root_incref(root)
        return root

    def live_salt_root(self, bytes salt):
        """The live root of ``salt``, or None (nothing refers to it)."""
        self._forget_dead_salts()
        return self.root_of_salt.get(salt)

    @property
    def num_salts(self):
        """Salts a sequence or a cached block refers to now."""
        self._forget_dead_salts()
        return len(self.root_of_salt)

    cdef block_id_t _lookup(self, uint64_t h0, uint64_t h1, const token_t* toks,
                            int64_t parent) noexcept nogil:
        """A cached block with this hash and parent whose stored token ids
        equal toks."""
        cdef block_id_t b = self.buckets[self._bucket(h0)]
        while b != NONE:
            if self.hashes[b, 0] == h0 and self.hashes[b, 1] == h1 and \
                    self.parent_serial[b] == parent and \
                    memcmp(&self.tokens[b, 0], toks, self.block_size * sizeof(token_t)) == 0:
                return b
            b = self.next_in_bucket[b]
        return NONE

    # ------------------------------------------------------ block ops
    cdef inline void _acquire(self, block_id_t b) noexcept nogil:
        if self.ref[b] == 0:
            self._unlink(b)
        self.ref[b] += 1

    cdef block_id_t _pop(self) noexcept nogil:
        """A free block with ref 1; uncached first, else evict the LRU head.
        The caller has checked that one is free."""
        cdef block_id_t b
        if self.uncached_head != NONE:
            b = self.uncached_head
        else:
            b = self.lru_head
        self._unlink(b)
        if self.cached[b]:
            self._index_remove(b)
            self._log_eviction(b)
        self.ref[b] = 1
        return b

    cdef void _log_eviction(self, block_id_t b) noexcept nogil:
        """Count cached block ``b``'s eviction, and log it for the pool's
        store port (a pool with stores)."""
        self.evictions += 1
        # (a block leaves the cache once per registration and the log is
        # taken before the block can be registered again: it never holds
        # more than num_blocks entries)
        if self.publish_evictions and self.num_evict_log < self.num_blocks:
            self.evict_log[self.num_evict_log] = b
            self.num_evict_log += 1

    cdef inline void _release(self, block_id_t b) noexcept nogil:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.cached[b]:
                self._append_lru(b)
            else:
                self._push_uncached(b)

    # ------------------------------------------------------ public (locked)
    @property
    def num_free(self):
        return self.num_uncached_free + self.num_lru_free

    def ref_count(self, block_id_t b):
        return self.ref[b]

    def is_cached(self, block_id_t b):
        return bool(self.cached[b])

    cdef Py_ssize_t _lookup_prefix(self, const token_t* tokens, const hash_word_t* hashes,
                                   Py_ssize_t max_blocks, int64_t root, block_id_t* out,
                                   int64_t* serials) noexcept nogil:
        cdef Py_ssize_t i, bs = self.block_size
        cdef block_id_t b
        cdef int64_t parent = root
        for i in range(max_blocks):
            b = self._lookup(hashes[2 * i], hashes[2 * i + 1], tokens + i * bs, parent)
            if b == NONE:
                return i
            out[i] = b
            parent = self.serial[b]
            if serials != NULL:
                serials[i] = parent
        return max_blocks

    cdef int _check_ids(self, const block_id_t* ids, Py_ssize_t n) except -1:
        cdef Py_ssize_t i
        for i in range(n):
            if ids[i] < 0 or ids[i] >= self.num_blocks:
                raise ValueError(f"block id {ids[i]} out of range 0..{self.num_blocks - 1}")
        return 0

    # The methods below take NumPy arrays, not typed memoryviews: acquiring
    # a memoryview costs far more than these loops on a decode step.  Each
    # array is checked (dtype, contiguity, size) by _i32/_u64/_tok.

    def lookup_prefix(self, cnp.ndarray tokens, cnp.ndarray hashes, Py_ssize_t max_blocks,
                      cnp.ndarray out, int64_t root=-1):
        """Longest run of leading blocks found in the cache (at most
        max_blocks) for a chain starting at ``root`` (-1: no salt); their ids
        go to out[0:n].  Changes nothing."""
        cdef const token_t* t = _tok(tokens, max_blocks * self.block_size)
        cdef const hash_word_t* h = _u64(hashes, 2 * max_blocks)
        cdef block_id_t* o = _i32(out, max_blocks, True)
        cdef Py_ssize_t n
        if root >= 0:
            raise ValueError(f"root must be negative (a salt id), got {root}")
        with nogil:
            n = self._lookup_prefix(t, h, max_blocks, root, o, NULL)
        return n

    def probe(self, cnp.ndarray tokens, cnp.ndarray hashes, Py_ssize_t max_hit_blocks,
              int64_t root):
        """(hit blocks, hit blocks nobody holds) that allocate would find now.
        Changes nothing."""
        cdef const token_t* t = _tok(tokens, max_hit_blocks * self.block_size)
        cdef const hash_word_t* h = _u64(hashes, 2 * max_hit_blocks)
        out = np.empty(max(max_hit_blocks, 1), np.int32)
        cdef block_id_t* o = _i32(out, max_hit_blocks, True)
        cdef Py_ssize_t hits, i, hits_free = 0
        if root >= 0:
            raise ValueError(f"root must be negative (a salt id), got {root}")
        with nogil:
            hits = self._lookup_prefix(t, h, max_hit_blocks, root, o, NULL)
            for i in range(hits):
                if self.ref[o[i]] == 0:
                    hits_free += 1
        return hits, hits_free

    # C-level operations (declared in _pool.pxd; _seq.pyx calls them
    # directly).  Same contracts as the public methods below.

    cdef Py_ssize_t c_allocate(self, const token_t* t, const hash_word_t* h,
                               Py_ssize_t max_hit_blocks, Py_ssize_t total_blocks,
                               int64_t root, block_id_t* o, int64_t* sr) noexcept nogil:
        cdef Py_ssize_t hits, i, hits_free = 0
        hits = self._lookup_prefix(t, h, max_hit_blocks, root, o, sr)
        for i in range(hits):
            if self.ref[o[i]] == 0:
                hits_free += 1
        if total_blocks - hits > self.num_uncached_free + self.num_lru_free - hits_free:
            return -1
        for i in range(hits):
            self._acquire(o[i])
        for i in range(hits, total_blocks):
            o[i] = self._pop()
        return hits

    cdef bint c_take(self, Py_ssize_t n, block_id_t* o) noexcept nogil:
        cdef Py_ssize_t i
        if n > self.num_uncached_free + self.num_lru_free:
            return False
        for i in range(n):
            o[i] = self._pop()
        return True

    cdef int c_release(self, const block_id_t* b, Py_ssize_t n) except -1:
        cdef Py_ssize_t i
        self._check_ids(b, n)
        for i in range(n):
            if self.ref[b[i]] <= 0:
                raise ValueError(f"block {b[i]} is not held (ref count {self.ref[b[i]]})")
        if n >= NOGIL_BLOCKS:
            with nogil:
                self._release_n(b, n)
        else:
            self._release_n(b, n)
        return 0

    cdef void _release_n(self, const block_id_t* b, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(n - 1, -1, -1):
            self._release(b[i])

    cdef void _acquire_n(self, const block_id_t* b, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(n):
            self._acquire(b[i])

    cdef int c_incref(self, const block_id_t* b, Py_ssize_t n) except -1:
        self._check_ids(b, n)
        if n >= NOGIL_BLOCKS:
            with nogil:
                self._acquire_n(b, n)
        else:
            self._acquire_n(b, n)
        return 0

    cdef Py_ssize_t c_shared_blocks(self, const block_id_t* b, Py_ssize_t first,
                                    Py_ssize_t last, block_id_t* o) except -1:
        cdef Py_ssize_t i, k = 0
        self._check_ids(b + first, last - first)
        for i in range(first, last):
            if self.ref[b[i]] != 1 or self.cached[b[i]]:
                o[k] = i
                k += 1
        return k

    cdef Py_ssize_t c_register(self, const block_id_t* bl, const hash_word_t* h,
                               const token_t* t, Py_ssize_t first, Py_ssize_t last,
                               int64_t parent, int64_t* sr, uint64_t root0,
                               uint64_t root1, const unsigned char* idents) except -1:
        cdef Py_ssize_t entered
        self._check_ids(bl + first, last - first)
        if last - first >= NOGIL_BLOCKS:
            with nogil:
                entered = self._register_n(bl, h, t, first, last, parent, sr, root0, root1,
                                           idents)
        else:
            entered = self._register_n(bl, h, t, first, last, parent, sr, root0, root1, idents)
        return entered

    cdef Py_ssize_t _register_n(self, const block_id_t* bl, const hash_word_t* h,
                                const token_t* t, Py_ssize_t first, Py_ssize_t last,
                                int64_t parent, int64_t* sr, uint64_t root0,
                                uint64_t root1, const unsigned char* idents) noexcept nogil:
        cdef Py_ssize_t i, bs = self.block_size, entered = 0
        cdef block_id_t b, twin
        for i in range(first, last):
            b = bl[i]
            if self.cached[b]:
                # a hit block, or one registered before: its serial stands
                parent = self.serial[b]
                sr[i] = parent
                continue
            twin = self._lookup(h[2 * i], h[2 * i + 1], t + i * bs, parent)
            if twin != NONE:
                parent = self.serial[twin]
                sr[i] = parent
                continue
            self.hashes[b, 0] = h[2 * i]
            self.hashes[b, 1] = h[2 * i + 1]
            memcpy(&self.tokens[b, 0], t + i * bs, bs * sizeof(token_t))
            self.parent_serial[b] = parent
            # what a prefix store's entry records: the parent's chained hash
            # (the salt root words for block 0) and the chain's salt root
            if i == 0:
                self.parent_hashes[b, 0] = root0
                self.parent_hashes[b, 1] = root1
            else:
                self.parent_hashes[b, 0] = h[2 * i - 2]
                self.parent_hashes[b, 1] = h[2 * i - 1]
            self.chain_roots[b, 0] = root0
            self.chain_roots[b, 1] = root1
            if idents != NULL:   # (its identity digest: a pool with stores)
                memcpy(&self.identity[b, 0], idents + i * IDENTITY_SIZE, IDENTITY_SIZE)
            self.serial[b] = self.next_serial
            self.next_serial += 1
            self._index_insert(b)
            parent = self.serial[b]
            sr[i] = parent
            entered += 1
        return entered

    def allocate(self, cnp.ndarray tokens, cnp.ndarray hashes, Py_ssize_t max_hit_blocks,
                 Py_ssize_t total_blocks, int64_t root, cnp.ndarray out, cnp.ndarray serials):
        """Blocks for a new prompt: out[0:total_blocks] = cached hits, then
        fresh blocks; serials[0:hits] = the hits' serials.  Returns the
        number of hit blocks, or -1 (nothing changed) when the free blocks
        do not suffice."""
        cdef const token_t* t = _tok(tokens, max_hit_blocks * self.block_size)
        cdef const hash_word_t* h = _u64(hashes, 2 * max_hit_blocks)
        cdef block_id_t* o = _i32(out, total_blocks, True)
        cdef int64_t* sr = <int64_t*>_data(serials, cnp.NPY_INT64, max_hit_blocks, True, "int64")
        cdef Py_ssize_t hits
        if max_hit_blocks > total_blocks:
            raise ValueError("max_hit_blocks > total_blocks")
        if root >= 0:
            raise ValueError(f"root must be negative (a salt id), got {root}")
        if total_blocks >= NOGIL_BLOCKS:
            with nogil:
                hits = self.c_allocate(t, h, max_hit_blocks, total_blocks, root, o, sr)
        else:
            hits = self.c_allocate(t, h, max_hit_blocks, total_blocks, root, o, sr)
        return hits

    def take(self, Py_ssize_t n, cnp.ndarray out):
        """n fresh blocks into out[0:n]; False (nothing changed) if short."""
        cdef block_id_t* o = _i32(out, n, True)
        cdef bint ok
        if n >= NOGIL_BLOCKS:
            with nogil:
                ok = self.c_take(n, o)
        else:
            ok = self.c_take(n, o)
        return ok

    def release(self, cnp.ndarray blocks):
        """Drop one reference to each block, last block first (so the tail
        of a prefix becomes evictable before its head)."""
        cdef Py_ssize_t n = cnp.PyArray_SIZE(blocks)
        self.c_release(_i32(blocks, n, False), n)

    def incref(self, cnp.ndarray blocks):
        """Take one more reference to each block."""
        cdef Py_ssize_t n = cnp.PyArray_SIZE(blocks)
        self.c_incref(_i32(blocks, n, False), n)

    def exclusive(self, block_id_t b):
        """True if b may be written in place: one holder and not cached."""
        return self.ref[b] == 1 and not self.cached[b]

    def shared_blocks(self, cnp.ndarray blocks, Py_ssize_t first, Py_ssize_t last,
                      cnp.ndarray out):
        """Indices i in first..last-1 whose block may not be written in place
        (held by others, or cached) go to out; returns how many."""
        cdef const block_id_t* b = _i32(blocks, last, False)
        cdef block_id_t* o = _i32(out, last - first, True)
        return self.c_shared_blocks(b, first, last, o)

    def register(self, cnp.ndarray blocks, cnp.ndarray hashes, cnp.ndarray tokens,
                 Py_ssize_t first, Py_ssize_t last, int64_t parent, cnp.ndarray serials,
                 uint64_t root0=0, uint64_t root1=0, bytes idents=None):
        """Enter blocks[first:last] (full, committed, tokens known) into the
        prefix cache, block ``first``'s parent being ``parent`` (a serial, or
        the negative salt id for block 0).  A block whose content (hash,
        tokens, parent) is already cached under another block is skipped.
        serials[i] receives the serial the sequence's block i is known by
        (its own, or the cached twin's): the parent of block i + 1.
        ``root0, root1``: the salt's hash-chain root words, ``idents``: the
        blocks' identity digests (``last * 32`` bytes), recorded for prefix
        stores.  Returns how many blocks were entered."""
        cdef const block_id_t* bl = _i32(blocks, last, False)
        cdef const hash_word_t* h = _u64(hashes, 2 * last)
        cdef const token_t* t = _tok(tokens, last * self.block_size)
        cdef int64_t* sr = <int64_t*>_data(serials, cnp.NPY_INT64, last, True, "int64")
        cdef const unsigned char* d = NULL
        if idents is not None:
            if len(idents) < last * IDENTITY_SIZE:
                raise ValueError(f"internal: idents must hold {last * IDENTITY_SIZE} bytes")
            d = <const unsigned char*>PyBytes_AS_STRING(idents)
        return self.c_register(bl, h, t, first, last, parent, sr, root0, root1, d)

    def reset_prefix_cache(self):
        """Forget every cached block; False (nothing changed) if any block
        is held."""
        cdef block_id_t b
        if self.num_uncached_free + self.num_lru_free != self.num_blocks:
            return False
        while self.lru_head != NONE:
            b = self.lru_head
            self._unlink(b)
            self._index_remove(b)
            self._push_uncached(b)
        return True

    def uncache(self, cnp.ndarray blocks):
        """Take blocks ``blocks`` (int32, checked ids) out of the prefix
        cache, as evictions (logged while ``publish_evictions`` is set, so
        that the caller publishes their KV first): for a copy that is about to
        overwrite them in place.  A free one moves to the uncached free
        list.  Returns how many were cached."""
        cdef Py_ssize_t i, n = cnp.PyArray_SIZE(blocks), k = 0
        cdef const block_id_t* b = _i32(blocks, n, False)
        cdef block_id_t x
        self._check_ids(b, n)
        for i in range(n):
            x = b[i]
            if not self.cached[x]:
                continue
            if self.ref[x] == 0:
                self._unlink(x)
            self._index_remove(x)
            self._log_eviction(x)
            if self.ref[x] == 0:
                self._push_uncached(x)
            k += 1
        return k

    def take_evicted(self):
        """The cached blocks evicted since the last call (kept only while
        ``publish_evictions`` is set) with what they were registered with
        (see :meth:`entries`); the log is then empty.  The caller takes it
        before the blocks' new owner can write them or have them registered
        again."""
        cdef Py_ssize_t n = self.num_evict_log
        blocks = np.asarray(self.evict_log[:n]).copy()
        self.num_evict_log = 0
        return self.entries(blocks)

    def cached_blocks(self):
        """The ids of the blocks in the prefix cache now (int32, ascending)."""
        return np.flatnonzero(np.asarray(self.cached)).astype(np.int32)

    def entries(self, cnp.ndarray blocks):
        """What blocks ``blocks`` (int32, checked ids) were last registered
        with, as copies: ``(blocks, hashes uint64 (n, 2), parent_hashes (n,
        2), chain_roots (n, 2), identities uint8 (n, 32), tokens int32 (n,
        block_size))``."""
        cdef Py_ssize_t n = cnp.PyArray_SIZE(blocks)
        self._check_ids(_i32(blocks, n, False), n)
        return (blocks, np.asarray(self.hashes)[blocks], np.asarray(self.parent_hashes)[blocks],
                np.asarray(self.chain_roots)[blocks], np.asarray(self.identity)[blocks],
                np.asarray(self.tokens)[blocks])

    def cached_tokens(self, block_id_t b):
        """The token ids stored with cached block b (a copy)."""
        return np.asarray(self.tokens[b]).copy()

    def cached_hash(self, block_id_t b):
        return (int(self.hashes[b, 0]), int(self.hashes[b, 1]))

    def chain_hashes(self, cnp.ndarray tokens, Py_ssize_t n_blocks, uint64_t parent0,
                     uint64_t parent1):
        """(n_blocks, 2) uint64 chained hashes of the first n_blocks full
        blocks of int32 ``tokens``, with this pool's block hash."""
        cdef cnp.ndarray out = np.empty((max(n_blocks, 0), 2), np.uint64)
        cdef const token_t* t
        if n_blocks > 0:
            t = _tok(tokens, n_blocks * self.block_size)
            self.hash_chain(t, n_blocks, self.block_size, parent0, parent1,
                            <hash_word_t*>cnp.PyArray_DATA(out))
        return out

    def lru_order(self):
        """Cached free blocks, next to be evicted first (for tests)."""
        out = []
        cdef block_id_t b = self.lru_head
        while b != NONE:
            out.append(b)
            b = self.next_free_block[b]
        return out

    def check(self):
        """Verify every invariant of the structure; raises AssertionError
        naming the first broken one.  O(num_blocks); for tests and debug."""
        cdef Py_ssize_t n = self.num_blocks, i, count
        cdef block_id_t b, prev
        seen = np.zeros(n, np.int8)
        for which, head, tail, expect in (
                (FREE_UNCACHED, self.uncached_head, self.uncached_tail, self.num_uncached_free),
                (FREE_CACHED, self.lru_head, self.lru_tail, self.num_lru_free)):
            count = 0
            prev = NONE
            b = head
            while b != NONE:
                assert 0 <= b < n, f"free list {which} holds out-of-range block {b}"
                assert not seen[b], f"block {b} is on a free list twice"
                seen[b] = 1
                assert self.where[b] == which, f"block {b} on list {which} marked {self.where[b]}"
                assert self.prev_free_block[b] == prev, f"block {b}: broken prev link"
                assert self.ref[b] == 0, f"free block {b} has ref {self.ref[b]}"
                assert bool(self.cached[b]) == (which == FREE_CACHED), \
                    f"block {b} on list {which} has cached={self.cached[b]}"
                prev = b
                b = self.next_free_block[b]
                count += 1
                assert count <= n, "free list has a cycle"
            assert prev == tail, f"free list {which}: tail {tail} but last {prev}"
            assert count == expect, f"free list {which}: count {expect} but {count} linked"
        for i in range(n):
            assert self.ref[i] >= 0, f"block {i} has negative ref {self.ref[i]}"
            if not seen[i]:
                assert self.ref[i] > 0, f"block {i} is on no free list but has ref 0"
                assert self.where[i] == HELD, f"held block {i} marked {self.where[i]}"
        count = 0
        for k in range(self.bucket_mask + 1):
            prev = NONE
            b = self.buckets[k]
            while b != NONE:
                assert self.cached[b], f"block {b} in the index but not marked cached"
                assert self._bucket(self.hashes[b, 0]) == k, f"block {b} in the wrong bucket"
                assert self.prev_in_bucket[b] == prev, f"block {b}: broken bucket link"
                prev = b
                b = self.next_in_bucket[b]
                count += 1
                assert count <= n, "hash chain has a cycle"
        assert count == self.num_cached, f"index holds {count}, num_cached {self.num_cached}"
        assert int(np.count_nonzero(np.asarray(self.cached))) == count, "cached flags disagree"
        # salt roots: every cached first block of a live root is counted in it
        live = 0
        for k in range(self.num_salt_slots):
            if self.salt_root[k] != 0:
                live += 1
                assert self.salt_refs[k] > 0, f"live salt slot {k} has no reference"
        assert live == self.num_roots, f"{live} live salt roots, num_roots {self.num_roots}"
        assert self.num_roots + self.num_salt_dead + self.num_salt_free == self.num_salt_slots, \
            "salt slots lost"
        per_slot = {}
        for i in range(n):
            if self.cached[i] and self.parent_serial[i] < -1:
                k = self._root_slot(self.parent_serial[i])
                if k >= 0:
                    per_slot[k] = per_slot.get(k, 0) + 1
        for k, c in per_slot.items():
            assert self.salt_refs[k] >= c, \
                f"salt slot {k}: {c} cached blocks but {self.salt_refs[k]} references"
        return True
