"""XXH64 of prefix-store entries, and the block copy that computes it on the
way into a pool's storage (kvcore/stores, BlockPool._import_blocks).
Callers validate sizes; these functions only check what would be unsafe."""
from libc.stdint cimport uint64_t

cdef extern from "kv_checksum.h" nogil:
    ctypedef struct kv_xxh64_state:
        pass
    void kv_xxh64_init(kv_xxh64_state* s, uint64_t seed)
    void kv_xxh64_update(kv_xxh64_state* s, const void* data, size_t n)
    uint64_t kv_xxh64_digest(const kv_xxh64_state* s)
    void kv_copy_xxh64(kv_xxh64_state* s, const unsigned char* src, unsigned char* dst,
                       size_t n_chunks, size_t chunk_bytes, size_t dst_stride)


def xxh64(data, uint64_t seed=0):
    """XXH64 of the bytes-like ``data`` (any contiguous buffer)."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef kv_xxh64_state s
    cdef uint64_t h
    cdef size_t n = view.shape[0]
    with nogil:
        kv_xxh64_init(&s, seed)
        if n:
            kv_xxh64_update(&s, &view[0], n)
        h = kv_xxh64_digest(&s)
    return h


def copy_xxh64(src, dst, size_t n_chunks, size_t chunk_bytes, size_t dst_stride,
               uint64_t seed=0):
    """Copy ``n_chunks`` chunks of ``chunk_bytes`` from bytes-like ``src``
    (``n_chunks * chunk_bytes`` bytes) to ``dst`` (a writable buffer whose
    chunk ``i`` starts at byte ``i * dst_stride``) and return XXH64 of
    ``src`` with ``seed``, computed while copying."""
    cdef const unsigned char[::1] s = memoryview(src).cast("B")
    cdef unsigned char[::1] d = memoryview(dst).cast("B")
    cdef kv_xxh64_state st
    cdef uint64_t h
    if <size_t>s.shape[0] != n_chunks * chunk_bytes:
        raise ValueError(f"internal: src holds {s.shape[0]} bytes, expected "
                         f"{n_chunks * chunk_bytes}")
    if n_chunks and (chunk_bytes > dst_stride and n_chunks > 1
                     or <size_t>d.shape[0] < (n_chunks - 1) * dst_stride + chunk_bytes):
        raise ValueError("internal: dst is too small for the chunks")
    with nogil:
        kv_xxh64_init(&st, seed)
        if n_chunks and chunk_bytes:
            kv_copy_xxh64(&st, &s[0], &d[0], n_chunks, chunk_bytes, dst_stride)
        h = kv_xxh64_digest(&st)
    return h
