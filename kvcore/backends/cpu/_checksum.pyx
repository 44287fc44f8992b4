"""The checksum of prefix-store entries, and the block copy that computes
it on the way into a pool's storage (kvcore/stores, BlockPool.import_blocks):
XXH3-64 (entry format version 3, kv_xxh3.c, SIMD by run-time dispatch).
Callers validate sizes; these functions only check what would be unsafe.

``level`` arguments (tests, benchmarks): a kv_simd.h level number; -1 (the
default) or one this CPU cannot run means the default level
(``KVCORE_SIMD`` respected)."""
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc

cdef extern from "kv_xxh3.h" nogil:
    ctypedef struct kv_xxh3_state:
        pass
    ctypedef struct kv_copy_part:
        unsigned char* dst
        const size_t* dst_offsets
        size_t n_chunks, chunk_bytes, dst_stride
    void kv_xxh3_init(kv_xxh3_state* s, uint64_t seed, int level)
    void kv_xxh3_update(kv_xxh3_state* s, const void* data, size_t n)
    uint64_t kv_xxh3_digest(const kv_xxh3_state* s)
    int kv_xxh3_level(int level)
    void kv_copy_xxh3(kv_xxh3_state* s, const unsigned char* src, unsigned char* dst,
                      size_t n_chunks, size_t chunk_bytes, size_t dst_stride)
    void kv_copy_xxh3_many(const unsigned char* const* srcs, size_t n_srcs,
                           const kv_copy_part* parts, size_t n_parts, const uint64_t* seeds,
                           uint64_t* digests, int level, int n_threads)


cdef _check_chunks(size_t src_bytes, size_t dst_bytes, size_t n_chunks, size_t chunk_bytes,
                   size_t dst_stride):
    if src_bytes != n_chunks * chunk_bytes:
        raise ValueError(f"internal: src holds {src_bytes} bytes, expected "
                         f"{n_chunks * chunk_bytes}")
    if n_chunks and (chunk_bytes > dst_stride and n_chunks > 1
                     or dst_bytes < (n_chunks - 1) * dst_stride + chunk_bytes):
        raise ValueError("internal: dst is too small for the chunks")


def xxh3_64(data, uint64_t seed=0, int level=-1):
    """XXH3-64 of the bytes-like ``data`` (any contiguous buffer) with ``seed``."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef kv_xxh3_state s
    cdef uint64_t h
    cdef size_t n = view.shape[0]
    with nogil:
        kv_xxh3_init(&s, seed, level)
        if n:
            kv_xxh3_update(&s, &view[0], n)
        h = kv_xxh3_digest(&s)
    return h


def xxh3_64_pieces(pieces, uint64_t seed=0, int level=-1):
    """XXH3-64 of the bytes-likes ``pieces`` one after the other, fed to
    the streaming state one piece at a time (tests: every split gives the
    one-shot digest)."""
    cdef kv_xxh3_state s
    cdef const unsigned char[::1] view
    kv_xxh3_init(&s, seed, level)
    for p in pieces:
        view = memoryview(p).cast("B")
        if view.shape[0]:
            kv_xxh3_update(&s, &view[0], view.shape[0])
    return kv_xxh3_digest(&s)


def xxh3_level(int level=-1):
    """The kv_simd.h level whose kernels :func:`xxh3_64` runs for ``level``."""
    return kv_xxh3_level(level)


def copy_xxh3(src, dst, size_t n_chunks, size_t chunk_bytes, size_t dst_stride,
              uint64_t seed=0, int level=-1):
    """Copy ``n_chunks`` chunks of ``chunk_bytes`` from bytes-like ``src``
    (``n_chunks * chunk_bytes`` bytes) to ``dst`` (a writable buffer whose
    chunk ``i`` starts at byte ``i * dst_stride``) and return XXH3-64 of
    ``src`` with ``seed``, computed while copying."""
    cdef const unsigned char[::1] s = memoryview(src).cast("B")
    cdef unsigned char[::1] d = memoryview(dst).cast("B")
    cdef kv_xxh3_state st
    cdef uint64_t h
    cdef bint copy = n_chunks != 0 and chunk_bytes != 0
    _check_chunks(s.shape[0], d.shape[0], n_chunks, chunk_bytes, dst_stride)
    with nogil:
        kv_xxh3_init(&st, seed, level)
        if copy:
            kv_copy_xxh3(&st, &s[0], &d[0], n_chunks, chunk_bytes, dst_stride)
        h = kv_xxh3_digest(&st)
    return h


def copy_xxh3_many(srcs, parts, seeds, int num_threads=1, int level=-1):
    """:func:`copy_xxh3` of every source in ``srcs`` (bytes-likes) into one
    or more destinations: ``parts`` is a list of ``(dst, dst_offsets,
    n_chunks, chunk_bytes, dst_stride)``, and every source is those parts
    one after the other: part ``k``'s chunk ``i`` of source ``j`` goes to
    byte ``dst_offsets[j] + i * dst_stride`` of that part's ``dst``.
    Returns the list of the sources' XXH3-64 digests with ``seeds[j]``.  All
    of it in one call with the GIL released, on up to ``num_threads``
    threads (the digests and the copied bytes do not depend on it)."""
    cdef size_t n = len(srcs), k, j, need = 0, span, size
    cdef size_t n_parts = len(parts)
    cdef unsigned char[::1] d
    cdef const unsigned char[::1] s
    if len(seeds) != <Py_ssize_t>n:
        raise ValueError(f"internal: {n} sources but {len(seeds)} seeds")
    if n == 0:
        return []
    views = []
    cdef const unsigned char** ptrs = <const unsigned char**>malloc(n * sizeof(void*))
    cdef kv_copy_part* cparts = <kv_copy_part*>malloc((n_parts or 1) * sizeof(kv_copy_part))
    cdef size_t* offs = <size_t*>malloc((n_parts or 1) * n * sizeof(size_t))
    cdef uint64_t* sd = <uint64_t*>malloc(n * sizeof(uint64_t))
    cdef uint64_t* out = <uint64_t*>malloc(n * sizeof(uint64_t))
    try:
        if not ptrs or not cparts or not offs or not sd or not out:
            raise MemoryError()
        for k in range(n_parts):
            dst, dst_offsets, cparts[k].n_chunks, cparts[k].chunk_bytes, cparts[k].dst_stride = \
                parts[k]
            d = memoryview(dst).cast("B")
            views.append(d)
            cparts[k].dst = &d[0] if d.shape[0] else NULL
            cparts[k].dst_offsets = offs + k * n
            if len(dst_offsets) != <Py_ssize_t>n:
                raise ValueError(f"internal: {n} sources but {len(dst_offsets)} offsets in "
                                 f"part {k}")
            size = cparts[k].n_chunks * cparts[k].chunk_bytes
            need += size
            if not size:
                continue
            if cparts[k].chunk_bytes > cparts[k].dst_stride and cparts[k].n_chunks > 1:
                raise ValueError("internal: chunks overlap in dst")
            span = (cparts[k].n_chunks - 1) * cparts[k].dst_stride + cparts[k].chunk_bytes
            for j in range(n):
                offs[k * n + j] = dst_offsets[j]
                if span > <size_t>d.shape[0] or offs[k * n + j] > <size_t>d.shape[0] - span:
                    raise ValueError("internal: dst is too small for the chunks")
        for j in range(n):
            s = memoryview(srcs[j]).cast("B")
            if <size_t>s.shape[0] != need:
                raise ValueError(f"internal: srcs[{j}] holds {s.shape[0]} bytes, expected {need}")
            views.append(s)           # keeps the buffer exported until the copy is done
            ptrs[j] = &s[0] if need else NULL
            sd[j] = seeds[j]
        with nogil:
            kv_copy_xxh3_many(ptrs, n, cparts, n_parts, sd, out, level, num_threads)
        return [out[j] for j in range(n)]
    finally:
        free(ptrs); free(cparts); free(offs); free(sd); free(out)
