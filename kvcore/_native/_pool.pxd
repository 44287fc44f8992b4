# PoolCore's layout and its C-level entry points, so that the per-sequence
# bookkeeping (_seq.pyx) calls the pool without going through Python.
# Cython wants every attribute and cdef method of the class declared here;
# the bodies (and the reasoning) are in _pool.pyx.
cimport cython
from libc.stdint cimport int64_t, uint64_t

from kvcore._native._typedefs cimport block_id_t, hash_word_t, token_t

cdef enum:
    # Pool operations on fewer blocks than this keep the GIL: releasing and
    # retaking it costs more (~0.15 us) than such a loop, and a thread that
    # got it could do no pool work anyway (the pool's lock is held).
    NOGIL_BLOCKS = 512

# kvcore's chained block hash of n_blocks full blocks (see _pool.hash_chain).
ctypedef void (*hash_chain_fn)(const token_t* tokens, Py_ssize_t n_blocks,
                               Py_ssize_t block_size, uint64_t parent0, uint64_t parent1,
                               hash_word_t* out) noexcept nogil
cdef void hash_chain_c(const token_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                       uint64_t parent0, uint64_t parent1, hash_word_t* out) noexcept nogil


# final: nothing subclasses it, so every cdef method call is a direct C call
@cython.final
cdef class PoolCore:
    cdef readonly Py_ssize_t num_blocks, block_size
    cdef block_id_t[::1] ref
    cdef block_id_t[::1] prev_free_block, next_free_block      # free-list links
    cdef signed char[::1] where                # 0 held, 1 uncached free, 2 cached free (LRU)
    cdef signed char[::1] cached               # 1 if in the hash index
    cdef hash_word_t[:, ::1] hashes            # (num_blocks, 2)
    cdef block_id_t[::1] prev_in_bucket, next_in_bucket      # hash-bucket chain links
    cdef block_id_t[::1] buckets
    cdef token_t[:, ::1] tokens                # (num_blocks, block_size)
    cdef int64_t[::1] serial, parent_serial    # the identity chain (see _pool.pyx)
    cdef int64_t next_serial
    cdef Py_ssize_t bucket_mask
    cdef block_id_t uncached_head, uncached_tail, lru_head, lru_tail
    cdef readonly Py_ssize_t num_uncached_free, num_lru_free, num_cached
    cdef readonly long long evictions
    # Salt roots (see "Salt roots" in _pool.pyx): per slot, the root it
    # holds now (0: free) and how many references (sequences holding the
    # salt, cached blocks whose parent is the root) it has; roots whose
    # count fell to 0 wait in salt_dead until BlockPool forgets their salt.
    cdef int64_t[::1] salt_root, salt_refs, salt_dead
    cdef Py_ssize_t[::1] salt_free
    cdef uint64_t[::1] salt_gen
    cdef Py_ssize_t num_salt_slots, num_salt_dead, num_salt_free
    cdef readonly Py_ssize_t num_roots
    cdef dict salt_of_root, root_of_salt    # the salts (bytes) of the live roots
    # the block hash the sequences on this pool use: hash_chain_c, or (a
    # pool made for the collision tests) one that hashes every block alike
    cdef hash_chain_fn hash_chain
    cdef readonly bint forged_hashes
    # prefix-cache statistics (BlockPool.stats), counted by allocate
    cdef public long long prefix_queries, prefix_hits
    # Prefix stores (kvcore/stores): per cached block, what a store entry
    # records beside its hash: its parent's chained hash, its chain's salt
    # root words and its identity digest (32 bytes, given at registration);
    # and the log of cached blocks evicted since the pool's store port last
    # took it.  Kept only while publish_evictions is set (a pool with stores).
    cdef hash_word_t[:, ::1] parent_hashes, chain_roots
    cdef unsigned char[:, ::1] identity
    cdef block_id_t[::1] evict_log
    cdef readonly Py_ssize_t num_evict_log
    cdef public bint publish_evictions

    cdef inline void _unlink(self, block_id_t b) noexcept nogil
    cdef inline void _push_uncached(self, block_id_t b) noexcept nogil
    cdef inline void _append_lru(self, block_id_t b) noexcept nogil
    cdef inline Py_ssize_t _bucket(self, uint64_t h0) noexcept nogil
    cdef Py_ssize_t _root_slot(self, int64_t root) noexcept nogil
    cdef void _root_ref(self, int64_t root, int delta) noexcept nogil
    cdef void _index_remove(self, block_id_t b) noexcept nogil
    cdef void _index_insert(self, block_id_t b) noexcept nogil
    cdef block_id_t _lookup(self, uint64_t h0, uint64_t h1, const token_t* toks,
                            int64_t parent) noexcept nogil
    cdef inline void _acquire(self, block_id_t b) noexcept nogil
    cdef block_id_t _pop(self) noexcept nogil
    cdef inline void _release(self, block_id_t b) noexcept nogil
    cdef Py_ssize_t _lookup_prefix(self, const token_t* tokens, const hash_word_t* hashes,
                                   Py_ssize_t max_blocks, int64_t root, block_id_t* out,
                                   int64_t* serials) noexcept nogil
    cdef int _check_ids(self, const block_id_t* ids, Py_ssize_t n) except -1
    cdef void _release_n(self, const block_id_t* blocks, Py_ssize_t n) noexcept nogil
    cdef void _acquire_n(self, const block_id_t* blocks, Py_ssize_t n) noexcept nogil
    cdef Py_ssize_t _register_n(self, const block_id_t* blocks, const hash_word_t* hashes,
                                const token_t* tokens, Py_ssize_t first, Py_ssize_t last,
                                int64_t parent, int64_t* serials, uint64_t root0,
                                uint64_t root1, const unsigned char* idents) noexcept nogil
    cdef void _log_eviction(self, block_id_t b) noexcept nogil

    # C-level twins of the public methods of the same name (without the c_):
    # same contract (caller holds the pool's lock, arguments are sized
    # right), raw pointers instead of arrays.
    cdef Py_ssize_t c_allocate(self, const token_t* tokens, const hash_word_t* hashes,
                               Py_ssize_t max_hit_blocks, Py_ssize_t total_blocks,
                               int64_t root, block_id_t* out,
                               int64_t* serials) noexcept nogil
    cdef bint c_take(self, Py_ssize_t n, block_id_t* out) noexcept nogil
    cdef int c_release(self, const block_id_t* blocks, Py_ssize_t n) except -1
    cdef int c_incref(self, const block_id_t* blocks, Py_ssize_t n) except -1
    cdef Py_ssize_t c_shared_blocks(self, const block_id_t* blocks, Py_ssize_t first,
                                    Py_ssize_t last, block_id_t* out) except -1
    cdef void c_root_incref(self, int64_t root) noexcept nogil
    cdef void c_root_decref(self, int64_t root) noexcept nogil
    cdef Py_ssize_t c_register(self, const block_id_t* blocks, const hash_word_t* hashes,
                               const token_t* tokens, Py_ssize_t first, Py_ssize_t last,
                               int64_t parent, int64_t* serials, uint64_t root0,
                               uint64_t root1, const unsigned char* idents) except -1


# The identity chain (see "Identity digests" in _pool.pyx): out[i] = the
# 32-byte digest of block i of ``tokens``, chained from ``parent`` (32 bytes).
cdef enum:
    IDENTITY_SIZE = 32
cdef int identity_chain_c(const unsigned char* parent, const token_t* tokens,
                          Py_ssize_t n_blocks, Py_ssize_t block_size,
                          unsigned char* out) except -1
