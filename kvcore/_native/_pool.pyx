"""Block-pool bookkeeping over flat arrays: reference counts, two free lists,
the prefix-cache hash index, token-id verification, block hashing.

No Python object exists per block.  Every method assumes the caller holds the
pool's lock and has validated its arguments (``kvcore/pool.py``); methods that
can fail return a status and change nothing when they do.

Free lists (doubly linked through ``fl_prev``/``fl_next``):
  * uncached: never-cached or released-and-uncached blocks, handed out first;
  * LRU: cached blocks nobody holds, least recently released at the head.
    Eviction takes the head.  A sequence releases its blocks tail first, so
    the tail of a cached prefix sits nearer the head than its start.
Hash index: ``buckets[h0 & mask]`` heads a doubly linked chain of cached
blocks (``hb_prev``/``hb_next``).  Several blocks may share a hash; a lookup
only returns a block whose stored token ids equal the query's.
"""
import numpy as np

from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy

from kvcore._native._typedefs cimport block_id_t, hash_word_t, slot_t, token_t

cdef extern from "kv_hash.h" nogil:
    void kvhash_siphash128(uint64_t k0, uint64_t k1, const void* data, size_t length,
                           uint64_t* out)
    void kvhash_block_key(uint64_t* k0, uint64_t* k1)
    void kvhash_chain(const token_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                      const uint64_t* parent, uint64_t* out)

cdef enum:
    NONE = -1
    HELD = 0
    FREE_UNCACHED = 1
    FREE_CACHED = 2


# ------------------------------------------------------------------ hashing

def siphash128(bytes data, uint64_t k0, uint64_t k1):
    """SipHash-2-4-128 of ``data``; returns the 16 output bytes."""
    cdef uint64_t out[2]
    cdef const unsigned char[::1] view = data
    cdef const void* p = &view[0] if len(data) else NULL
    with nogil:
        kvhash_siphash128(k0, k1, p, view.shape[0], out)
    return (<unsigned long long>out[0]).to_bytes(8, "little") + \
        (<unsigned long long>out[1]).to_bytes(8, "little")


def block_key():
    """The two key words of kvcore's block hash."""
    cdef uint64_t k0, k1
    kvhash_block_key(&k0, &k1)
    return int(k0), int(k1)


def hash_chain(const token_t[::1] tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
               uint64_t parent0, uint64_t parent1, hash_word_t[:, ::1] out):
    """out[i] = h[i] for the first n_blocks full blocks of ``tokens``."""
    cdef uint64_t parent[2]
    parent[0] = parent0
    parent[1] = parent1
    if n_blocks <= 0:
        return
    with nogil:
        kvhash_chain(&tokens[0], n_blocks, block_size, parent, &out[0, 0])


def slots_for(const block_id_t[::1] table, Py_ssize_t block_size,
              Py_ssize_t start, Py_ssize_t end, slot_t[::1] out):
    """out[i] = slot of position start + i (block table lookup)."""
    cdef Py_ssize_t p
    for p in range(start, end):
        out[p - start] = <slot_t>table[p // block_size] * block_size + p % block_size


def first_bad_token(const token_t[::1] tokens):
    """Index of the first negative id in ``tokens``, or -1."""
    cdef Py_ssize_t i, bad = -1
    with nogil:
        for i in range(tokens.shape[0]):
            if tokens[i] < 0:
                bad = i
                break
    return bad


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
            item = item.__index__()
        try:
            v = item
        except OverflowError:
            return i
        if v < 0 or v > 2147483647:
            return i
        out[i] = <token_t>v
    return -1


# ---------------------------------------------------------------- the core

cdef class PoolCore:
    """Ownership state of ``num_blocks`` blocks of ``block_size`` tokens."""
    cdef readonly Py_ssize_t num_blocks, block_size
    cdef block_id_t[::1] ref
    cdef block_id_t[::1] fl_prev, fl_next      # free-list links
    cdef signed char[::1] where                # 0 held, 1 uncached free, 2 cached free (LRU)
    cdef signed char[::1] cached               # 1 if in the hash index
    cdef hash_word_t[:, ::1] hashes            # (num_blocks, 2)
    cdef block_id_t[::1] hb_prev, hb_next      # hash-bucket chain links
    cdef block_id_t[::1] buckets
    cdef token_t[:, ::1] tokens                # (num_blocks, block_size)
    cdef Py_ssize_t bucket_mask
    cdef block_id_t uc_head, uc_tail, lru_head, lru_tail
    cdef readonly Py_ssize_t num_uncached_free, num_lru_free, num_cached
    cdef readonly long long evictions

    def __init__(self, Py_ssize_t num_blocks, Py_ssize_t block_size):
        cdef Py_ssize_t i, cap = 16
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, np.int32)
        self.fl_prev = np.empty(num_blocks, np.int32)
        self.fl_next = np.empty(num_blocks, np.int32)
        self.where = np.full(num_blocks, FREE_UNCACHED, np.int8)
        self.cached = np.zeros(num_blocks, np.int8)
        self.hashes = np.zeros((num_blocks, 2), np.uint64)
        self.hb_prev = np.full(num_blocks, NONE, np.int32)
        self.hb_next = np.full(num_blocks, NONE, np.int32)
        while cap < 2 * num_blocks:
            cap *= 2
        self.buckets = np.full(cap, NONE, np.int32)
        self.bucket_mask = cap - 1
        self.tokens = np.zeros((num_blocks, block_size), np.int32)
        # every block starts on the uncached list, in id order
        for i in range(num_blocks):
            self.fl_prev[i] = i - 1
            self.fl_next[i] = i + 1 if i + 1 < num_blocks else NONE
        self.uc_head = 0 if num_blocks else NONE
        self.uc_tail = num_blocks - 1 if num_blocks else NONE
        self.lru_head = NONE
        self.lru_tail = NONE
        self.num_uncached_free = num_blocks
        self.num_lru_free = 0
        self.num_cached = 0
        self.evictions = 0

    # ------------------------------------------------------ free lists
    cdef inline void _unlink(self, block_id_t b) noexcept nogil:
        cdef block_id_t p = self.fl_prev[b], n = self.fl_next[b]
        if self.where[b] == FREE_UNCACHED:
            if p == NONE:
                self.uc_head = n
            else:
                self.fl_next[p] = n
            if n == NONE:
                self.uc_tail = p
            else:
                self.fl_prev[n] = p
            self.num_uncached_free -= 1
        else:
            if p == NONE:
                self.lru_head = n
            else:
                self.fl_next[p] = n
            if n == NONE:
                self.lru_tail = p
            else:
                self.fl_prev[n] = p
            self.num_lru_free -= 1
        self.where[b] = HELD
        self.fl_prev[b] = NONE
        self.fl_next[b] = NONE

    cdef inline void _push_uncached(self, block_id_t b) noexcept nogil:
        # LIFO: the most recently released block is reused first (warm in cache)
        self.fl_prev[b] = NONE
        self.fl_next[b] = self.uc_head
        if self.uc_head != NONE:
            self.fl_prev[self.uc_head] = b
        else:
            self.uc_tail = b
        self.uc_head = b
        self.where[b] = FREE_UNCACHED
        self.num_uncached_free += 1

    cdef inline void _append_lru(self, block_id_t b) noexcept nogil:
        self.fl_next[b] = NONE
        self.fl_prev[b] = self.lru_tail
        if self.lru_tail != NONE:
            self.fl_next[self.lru_tail] = b
        else:
            self.lru_head = b
        self.lru_tail = b
        self.where[b] = FREE_CACHED
        self.num_lru_free += 1

    # ------------------------------------------------------ hash index
    cdef inline Py_ssize_t _bucket(self, uint64_t h0) noexcept nogil:
        return <Py_ssize_t>(h0 & <uint64_t>self.bucket_mask)

    cdef void _index_remove(self, block_id_t b) noexcept nogil:
        cdef block_id_t p = self.hb_prev[b], n = self.hb_next[b]
        if p == NONE:
            self.buckets[self._bucket(self.hashes[b, 0])] = n
        else:
            self.hb_next[p] = n
        if n != NONE:
            self.hb_prev[n] = p
        self.hb_prev[b] = NONE
        self.hb_next[b] = NONE
        self.cached[b] = 0
        self.num_cached -= 1

    cdef void _index_insert(self, block_id_t b) noexcept nogil:
        cdef Py_ssize_t k = self._bucket(self.hashes[b, 0])
        cdef block_id_t head = self.buckets[k]
        self.hb_prev[b] = NONE
        self.hb_next[b] = head
        if head != NONE:
            self.hb_prev[head] = b
        self.buckets[k] = b
        self.cached[b] = 1
        self.num_cached += 1

    cdef block_id_t _lookup(self, uint64_t h0, uint64_t h1, const token_t* toks) noexcept nogil:
        """A cached block with this hash whose stored token ids equal toks."""
        cdef block_id_t b = self.buckets[self._bucket(h0)]
        while b != NONE:
            if self.hashes[b, 0] == h0 and self.hashes[b, 1] == h1 and \
                    memcmp(&self.tokens[b, 0], toks, self.block_size * sizeof(token_t)) == 0:
                return b
            b = self.hb_next[b]
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
        if self.uc_head != NONE:
            b = self.uc_head
        else:
            b = self.lru_head
        self._unlink(b)
        if self.cached[b]:
            self._index_remove(b)
            self.evictions += 1
        self.ref[b] = 1
        return b

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

    cdef Py_ssize_t _lookup_prefix(self, const token_t[::1] tokens,
                                   const hash_word_t[:, ::1] hashes,
                                   Py_ssize_t max_blocks, block_id_t[::1] out) noexcept nogil:
        cdef Py_ssize_t i, bs = self.block_size
        cdef block_id_t b
        for i in range(max_blocks):
            b = self._lookup(hashes[i, 0], hashes[i, 1], &tokens[i * bs])
            if b == NONE:
                return i
            out[i] = b
        return max_blocks

    def lookup_prefix(self, const token_t[::1] tokens, const hash_word_t[:, ::1] hashes,
                      Py_ssize_t max_blocks, block_id_t[::1] out):
        """Longest run of leading blocks found in the cache (at most
        max_blocks); their ids go to out[0:n].  Changes nothing."""
        cdef Py_ssize_t n
        with nogil:
            n = self._lookup_prefix(tokens, hashes, max_blocks, out)
        return n

    def allocate(self, const token_t[::1] tokens, const hash_word_t[:, ::1] hashes,
                 Py_ssize_t max_hit_blocks, Py_ssize_t total_blocks, block_id_t[::1] out):
        """Blocks for a new prompt: out[0:total_blocks] = cached hits, then
        fresh blocks.  Returns the number of hit blocks, or -1 (nothing
        changed) when the free blocks do not suffice."""
        cdef Py_ssize_t hits, i, hits_free = 0
        with nogil:
            hits = self._lookup_prefix(tokens, hashes, max_hit_blocks, out)
        for i in range(hits):
            if self.ref[out[i]] == 0:
                hits_free += 1
        if total_blocks - hits > self.num_uncached_free + self.num_lru_free - hits_free:
            return -1
        with nogil:
            for i in range(hits):
                self._acquire(out[i])
            for i in range(hits, total_blocks):
                out[i] = self._pop()
        return hits

    def take(self, Py_ssize_t n, block_id_t[::1] out):
        """n fresh blocks into out[0:n]; False (nothing changed) if short."""
        cdef Py_ssize_t i
        if n > self.num_uncached_free + self.num_lru_free:
            return False
        with nogil:
            for i in range(n):
                out[i] = self._pop()
        return True

    def release(self, const block_id_t[::1] blocks):
        """Drop one reference to each block, last block first (so the tail
        of a prefix becomes evictable before its head)."""
        cdef Py_ssize_t i
        with nogil:
            for i in range(blocks.shape[0] - 1, -1, -1):
                self._release(blocks[i])

    def incref(self, const block_id_t[::1] blocks):
        cdef Py_ssize_t i
        with nogil:
            for i in range(blocks.shape[0]):
                self._acquire(blocks[i])

    def exclusive(self, block_id_t b):
        """True if b may be written in place: one holder and not cached."""
        return self.ref[b] == 1 and not self.cached[b]

    def shared_blocks(self, const block_id_t[::1] blocks, Py_ssize_t first,
                      Py_ssize_t last, block_id_t[::1] out):
        """Indices i in first..last-1 whose block may not be written in place
        (held by others, or cached) go to out; returns how many."""
        cdef Py_ssize_t i, k = 0
        cdef block_id_t b
        for i in range(first, last):
            b = blocks[i]
            if self.ref[b] != 1 or self.cached[b]:
                out[k] = i
                k += 1
        return k

    def register(self, const block_id_t[::1] blocks, const hash_word_t[:, ::1] hashes,
                 const token_t[::1] tokens, Py_ssize_t first, Py_ssize_t last):
        """Enter blocks[first:last] (full, committed, tokens known) into the
        prefix cache.  A block whose hash and tokens are already cached under
        another block is skipped.  Returns how many were entered."""
        cdef Py_ssize_t i, bs = self.block_size, entered = 0
        cdef block_id_t b
        with nogil:
            for i in range(first, last):
                b = blocks[i]
                if self.cached[b]:
                    continue
                if self._lookup(hashes[i, 0], hashes[i, 1], &tokens[i * bs]) != NONE:
                    continue
                self.hashes[b, 0] = hashes[i, 0]
                self.hashes[b, 1] = hashes[i, 1]
                memcpy(&self.tokens[b, 0], &tokens[i * bs], bs * sizeof(token_t))
                self._index_insert(b)
                entered += 1
        return entered

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

    def cached_tokens(self, block_id_t b):
        """The token ids stored with cached block b (a copy)."""
        return np.asarray(self.tokens[b]).copy()

    def cached_hash(self, block_id_t b):
        return (int(self.hashes[b, 0]), int(self.hashes[b, 1]))

    def lru_order(self):
        """Cached free blocks, next to be evicted first (for tests)."""
        out = []
        cdef block_id_t b = self.lru_head
        while b != NONE:
            out.append(b)
            b = self.fl_next[b]
        return out

    def check(self):
        """Verify every invariant of the structure; raises AssertionError
        naming the first broken one.  O(num_blocks); for tests and debug."""
        cdef Py_ssize_t n = self.num_blocks, i, count
        cdef block_id_t b, prev
        seen = np.zeros(n, np.int8)
        for which, head, tail, expect in (
                (FREE_UNCACHED, self.uc_head, self.uc_tail, self.num_uncached_free),
                (FREE_CACHED, self.lru_head, self.lru_tail, self.num_lru_free)):
            count = 0
            prev = NONE
            b = head
            while b != NONE:
                assert 0 <= b < n, f"free list {which} holds out-of-range block {b}"
                assert not seen[b], f"block {b} is on a free list twice"
                seen[b] = 1
                assert self.where[b] == which, f"block {b} on list {which} marked {self.where[b]}"
                assert self.fl_prev[b] == prev, f"block {b}: broken prev link"
                assert self.ref[b] == 0, f"free block {b} has ref {self.ref[b]}"
                assert bool(self.cached[b]) == (which == FREE_CACHED), \
                    f"block {b} on list {which} has cached={self.cached[b]}"
                prev = b
                b = self.fl_next[b]
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
                assert self.hb_prev[b] == prev, f"block {b}: broken bucket link"
                prev = b
                b = self.hb_next[b]
                count += 1
                assert count <= n, "hash chain has a cycle"
        assert count == self.num_cached, f"index holds {count}, num_cached {self.num_cached}"
        assert int(np.count_nonzero(np.asarray(self.cached))) == count, "cached flags disagree"
        return True
