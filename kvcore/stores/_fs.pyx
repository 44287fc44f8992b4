"""A DiskStore's directory listed, and a batch of its entries written,
read or removed, each in one native call without the GIL (csrc/kv_fs.h
says why)."""
import os
import resource

import numpy as np

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.errno cimport EMFILE, ENFILE, ENOENT, ENOMEM
from posix.fcntl cimport O_CLOEXEC, O_DIRECTORY, O_RDONLY, open as c_open
from posix.unistd cimport close as c_close

from .._forksafe import LEAF, fork_guard


cdef extern from "kv_fs.h" nogil:
    enum:
        KV_FS_ENTRY
        KV_FS_BAD
        KV_FS_STALE
    ctypedef struct kv_fs_item:
        size_t name
        int64_t size
        int64_t mtime_ns
        int kind
    ctypedef struct kv_fs_scan:
        kv_fs_item *items
        size_t n
        char *names
    int kv_fs_list(const char *root, const char *suffix, const char *tmp_prefix,
                   int64_t stale_cutoff_ns, int want_stale, int want_bad, kv_fs_scan *out)
    void kv_fs_scan_free(kv_fs_scan *scan)
    int KV_FS_NOT_OURS
    int KV_FS_NO_ROOT
    int kv_fs_write(const char *root, const char *sub, const char *name, const char *tmp,
                    const void *data, size_t len, int64_t *grown, int *failed_tmp)
    int kv_fs_open_head(const char *path, void *head, size_t probe, int *fd, int64_t *size,
                        size_t *head_len)
    int kv_fs_read_close(int fd, void *buf, size_t len, size_t *got, int touch)
    int kv_fs_unlink(const char *path)
    int kv_fs_is_entry(const char *path)
    int kv_fs_delete(const char *path, int *regular, int64_t *size)


cdef bytes _path(p, what):
    """``p`` as bytes for C: refused (ValueError) with a NUL byte, which C
    would cut the path at."""
    b = os.fsencode(p)
    if b"\0" in b:
        raise ValueError(f"{what} must be paths without a NUL byte, got {p!r}")
    return b


cdef bytes _name(p, what):
    """One path component as bytes for C: no NUL byte, no '/', not empty,
    '.' or '..' (ValueError)."""
    b = _path(p, what)
    if not b or b"/" in b or b in (b".", b".."):
        raise ValueError(f"{what} must be one file name (no '/', not '', '.' or '..'), "
                         f"got {p!r}")
    return b


def list_dir(root, suffix, tmp_prefix, int64_t stale_cutoff_ns, stale=None, bad=None):
    """[(path, size, mtime_ns)] of the regular files named ``*suffix`` in
    the subdirectories of ``root`` (never through a link); with a list
    ``stale``, the paths of files named ``tmp_prefix*`` with an mtime
    before ``stale_cutoff_ns`` are appended to it; with a list ``bad``, the
    paths named like an entry that are neither regular files nor
    directories.  Paths are ``root/SUBDIR/NAME``.  A missing ``root``
    lists nothing; one that cannot be opened raises OSError."""
    cdef bytes broot = _path(root, "root")
    cdef bytes bsuffix = _path(suffix, "suffix")
    cdef bytes btmp = _path(tmp_prefix, "tmp_prefix")
    cdef const char *croot = broot
    cdef const char *csuffix = bsuffix
    cdef const char *ctmp = btmp
    cdef int want_stale = stale is not None
    cdef int want_bad = bad is not None
    cdef kv_fs_scan scan
    cdef int rc
    cdef size_t i
    cdef kv_fs_item *it
    with nogil:
        rc = kv_fs_list(croot, csuffix, ctmp, stale_cutoff_ns, want_stale, want_bad, &scan)
    try:
        if rc == ENOMEM:
            raise MemoryError(f"listing {root!r}")
        if rc:
            raise OSError(rc, os.strerror(rc), root)
        out = []
        prefix = root.rstrip(os.sep) + os.sep if root != os.sep else root
        for i in range(scan.n):
            it = &scan.items[i]
            path = prefix + os.fsdecode(<bytes>(scan.names + it.name))
            if it.kind == KV_FS_ENTRY:
                out.append((path, it.size, it.mtime_ns))
            elif it.kind == KV_FS_BAD:
                bad.append(path)
            else:
                stale.append(path)
        return out
    finally:
        kv_fs_scan_free(&scan)


ctypedef struct _job:
    const char *sub
    const char *name
    const char *tmp
    const unsigned char *data
    size_t len
    int64_t grown
    int rc
    int failed_tmp


def write_entries(root, entries):
    """Write ``entries``, ``[(subdirectory, name, temporary name, bytes-like)]``,
    into directory ``root`` (``kv_fs_write`` each, in order, all in one call
    without the GIL; a missing ``root`` is created, once).  Returns
    ``(results, error)``: ``results[i]`` is the bytes the directory grew by
    for entry ``i``, or None where the entry's place is not one to write
    to; it stops at the first entry that fails, and ``error`` is then the
    OSError for that entry (None when every entry was done)."""
    cdef Py_ssize_t n = len(entries), i, start = 0
    cdef bytes broot = _path(root, "root")
    cdef const char *croot = broot
    cdef const unsigned char[::1] view
    cdef _job *jobs
    cdef Py_ssize_t stop
    cdef bint made_root = False
    keep = []   # the encoded names and the views, alive while the jobs point at them
    if n == 0:
        return [], None
    jobs = <_job *>malloc(n * sizeof(_job))
    if jobs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            sub, name, tmp, value = entries[i]
            bsub, bname, btmp = _name(sub, "sub"), _name(name, "name"), _name(tmp, "tmp")
            view = memoryview(value).cast("B")
            keep.append((bsub, bname, btmp, view))
            jobs[i].sub = bsub
            jobs[i].name = bname
            jobs[i].tmp = btmp
            jobs[i].data = &view[0] if view.shape[0] else NULL
            jobs[i].len = view.shape[0]
        results, error = [], None
        while start < n:
            with nogil:
                stop = _run(croot, jobs, start, n)
            for i in range(start, stop):
                results.append(None if jobs[i].rc == KV_FS_NOT_OURS else jobs[i].grown)
            if stop == n:
                break
            rc = jobs[stop].rc
            if rc == KV_FS_NO_ROOT and not made_root:
                made_root = True           # (removed under us: made again, once)
                os.makedirs(root, exist_ok=True)
                start = stop
                continue
            if rc == KV_FS_NO_ROOT:
                rc = ENOENT
            sub, name, tmp, _ = entries[stop]
            where = os.path.join(root, sub, tmp if jobs[stop].failed_tmp else name)
            error = OSError(rc, os.strerror(rc), where)
            break
        return results, error
    finally:
        free(jobs)


cdef Py_ssize_t _run(const char *root, _job *jobs, Py_ssize_t start, Py_ssize_t n) noexcept nogil:
    """Write jobs[start:n] until one fails: the index of the one that
    failed (n when none did)."""
    cdef Py_ssize_t i
    for i in range(start, n):
        jobs[i].rc = kv_fs_write(root, jobs[i].sub, jobs[i].name, jobs[i].tmp, jobs[i].data,
                                 jobs[i].len, &jobs[i].grown, &jobs[i].failed_tmp)
        if jobs[i].rc != 0 and jobs[i].rc != KV_FS_NOT_OURS:
            return i
    return n


ctypedef struct _take:
    const char *path
    int fd
    int rc
    int64_t size
    size_t head_len
    unsigned char *buf
    size_t want
    size_t got


def open_at_once():
    """Most files a take or a read holds open at once: a quarter of the
    descriptors the process has free (its soft ``RLIMIT_NOFILE`` less its
    lowest free descriptor, read at each call), at least 64 and at most
    256.  A trim of thousands of files must not run the process (its
    other threads) out of descriptors; each batch costs a call without the
    GIL, whose return waits up to a switch interval beside a thread busy in
    Python.  (A child forked meanwhile closes the batch's files:
    ``_Batch._after_fork_child``.)"""
    cdef int lowest = c_open(b"/", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    if lowest < 0:
        return 64
    c_close(lowest)
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 64
    free = (1 << 20) if soft == resource.RLIM_INFINITY else soft - lowest
    return max(64, min(256, free // 4))


cdef class _Batch:
    """Files ``encoded[first:stop]`` (None: skipped) opened and their
    heads read in one call without the GIL; ``finish`` reads what each
    ``jobs[i].buf`` (of ``jobs[i].want`` bytes) asks for and closes every
    file, in one more.  Whatever happens between, ``finish`` (or, failing
    that, the deallocation) closes every file it opened."""
    cdef _take *jobs
    cdef unsigned char *heads
    cdef Py_ssize_t n
    cdef size_t probe
    cdef bint closed
    cdef object keep            # the encoded paths, alive while the jobs point at them
    cdef object __weakref__     # (kvcore._forksafe holds its batches weakly)

    def __cinit__(self, list encoded, Py_ssize_t first, Py_ssize_t stop, size_t probe):
        cdef Py_ssize_t i
        self.n = stop - first
        self.probe = probe
        self.closed = True
        self.jobs = <_take *>malloc(self.n * sizeof(_take))
        self.heads = <unsigned char *>malloc(self.n * probe + 1)
        if self.jobs == NULL or self.heads == NULL:
            raise MemoryError()
        self.keep = encoded[first:stop]
        for i in range(self.n):
            p = self.keep[i]
            self.jobs[i].path = NULL
            if p is not None:
                self.jobs[i].path = <bytes>p
            self.jobs[i].fd = -1
            self.jobs[i].rc = KV_FS_NOT_OURS
            self.jobs[i].buf = NULL
            self.jobs[i].want = 0
            self.jobs[i].got = 0
        self.closed = False
        fork_guard(self, None, LEAF)
        with nogil:
            for i in range(self.n):
                if self.jobs[i].path != NULL:
                    self.jobs[i].rc = kv_fs_open_head(self.jobs[i].path, self.heads + i * probe,
                                                      probe, &self.jobs[i].fd, &self.jobs[i].size,
                                                      &self.jobs[i].head_len)

    cdef bytes head(self, Py_ssize_t i):
        return (self.heads + i * self.probe)[:self.jobs[i].head_len]

    cdef void finish(self, bint touch) noexcept:
        cdef Py_ssize_t i
        cdef int fd
        if self.closed:
            return
        self.closed = True
        with nogil:
            for i in range(self.n):
                if self.jobs[i].rc == 0:
                    # (the descriptor forgotten before it is closed: a child
                    # forked in between never closes a number reused since)
                    fd = self.jobs[i].fd
                    self.jobs[i].fd = -1
                    self.jobs[i].rc = kv_fs_read_close(fd, self.jobs[i].buf, self.jobs[i].want,
                                                       &self.jobs[i].got, touch)

    def _after_fork_child(self):
        """In a child forked while the batch is open (by another thread:
        the batch's own is gone there): its files closed, none read, so
        the child never keeps entries the trim removed alive on disk."""
        cdef Py_ssize_t i
        cdef int fd
        if self.closed:
            return
        self.closed = True
        for i in range(self.n):
            fd = self.jobs[i].fd
            if fd >= 0:
                self.jobs[i].fd = -1
                c_close(fd)

    def __dealloc__(self):
        self.finish(False)
        free(self.jobs)
        free(self.heads)


cdef _Batch _open(list encoded, Py_ssize_t first, Py_ssize_t n, list room, size_t probe):
    """The next batch, from ``encoded[first]``, of at most ``room[0]``
    files opened: where the process ran out of descriptors (EMFILE,
    ENFILE) it is closed again and ``room[0]`` halved, down to one file
    (whose error then stands): a process near its limit still reads."""
    cdef _Batch b
    cdef Py_ssize_t i
    while True:
        b = _Batch(encoded, first, min(n, first + room[0]), probe)
        if room[0] == 1 or not any(b.jobs[i].rc == EMFILE or b.jobs[i].rc == ENFILE
                                   for i in range(b.n)):
            return b
        b.finish(False)
        room[0] = max(1, room[0] // 2)


#: most bytes a read's buffer for one batch may take (file sizes are
#: untrusted: planted sparse files must not make their sum wrap)
READ_BUDGET = 1 << 62


cdef inline bint _failed(int rc) noexcept nogil:
    """An open or read that failed for a reason other than the file being
    gone or not a regular file."""
    return rc != 0 and rc != KV_FS_NOT_OURS and rc != ENOENT


def take_entries(paths, int64_t max_size, size_t probe, promised):
    """The bytes of the regular files at ``paths`` (None: skipped) for the
    next tier: returns ``(values, errors)``.  ``values[i]`` is a
    ``bytearray``, or None for a file that is gone, not a regular file
    (never followed, never opened blocking), unreadable, larger than
    ``max_size``, or whose first ``probe`` bytes ``head`` fail
    ``promised(head, size)`` (then never read further); ``errors[i]`` is
    the errno of an open or read that failed (0 otherwise; EMFILE, ENFILE
    or ENOMEM: the file was not looked at).  Two calls without the GIL for
    each :func:`open_at_once` files, ``promised`` between them."""
    cdef Py_ssize_t n = len(paths), i, first = 0
    cdef _Batch b
    cdef _take *job
    encoded = [None if p is None else _path(p, "paths") for p in paths]
    values, errors = [None] * n, [0] * n
    room = [open_at_once()]
    while first < n:
        b = _open(encoded, first, n, room, probe)
        try:
            for i in range(b.n):
                job = &b.jobs[i]
                if job.rc != 0 or job.size > max_size or not promised(b.head(i), job.size):
                    continue
                values[first + i] = value = bytearray(job.size)
                job.want = job.size
                job.buf = <unsigned char *>(<bytearray>value) if job.size else NULL
        finally:
            b.finish(False)
        for i in range(b.n):
            job = &b.jobs[i]
            if job.rc == 0 and job.got != job.want:
                job.rc = KV_FS_NOT_OURS           # changed under us: not whole
            if job.rc != 0:
                values[first + i] = None
            if _failed(job.rc):
                errors[first + i] = job.rc
        first += b.n
    return values, errors


def read_entries(paths, int64_t limit, size_t probe, promised):
    """The bytes of the regular files at ``paths`` for a lookup: a NumPy
    ``uint8`` array each (views of one buffer for each
    :func:`open_at_once` files), or None for one that is gone or not a
    regular file (never followed, never opened blocking).  A file longer
    than ``probe`` bytes that is longer than ``limit`` or whose head fails
    ``promised(head, size)`` is read no further than its head (a corrupt
    entry: it fails its checks); a file read has its modification time set
    to now (the LRU's recency).  Raises OSError for a file that cannot be
    opened or read for another reason (every file closed first).  Two
    calls without the GIL for each :func:`open_at_once` files, ``promised``
    between them."""
    cdef Py_ssize_t n = len(paths), i, first = 0
    cdef size_t total, off
    cdef _Batch b
    cdef _take *job
    cdef unsigned char[::1] arena
    encoded = [_path(p, "paths") for p in paths]
    out = [None] * n
    room = [open_at_once()]
    while first < n:
        b = _open(encoded, first, n, room, probe)
        try:
            total = 0
            for i in range(b.n):
                job = &b.jobs[i]
                if _failed(job.rc):
                    raise OSError(job.rc, os.strerror(job.rc), paths[first + i])
                if job.rc != 0:
                    continue
                job.want = job.size
                if job.size > <int64_t>probe and (job.size > limit
                                                  or not promised(b.head(i), job.size)):
                    job.want = probe
                if job.want > READ_BUDGET - total:
                    job.want = min(job.want, probe)     # (past the budget: the head only)
                total += job.want
            arena_array = np.empty(total, np.uint8)
            arena = arena_array
            off = 0
            for i in range(b.n):
                job = &b.jobs[i]
                if job.rc == 0:
                    job.buf = &arena[off] if job.want else NULL
                    off += job.want
        finally:
            b.finish(True)
        off = 0
        for i in range(b.n):
            job = &b.jobs[i]
            if _failed(job.rc):
                raise OSError(job.rc, os.strerror(job.rc), paths[first + i])
            if job.buf != NULL or (job.rc == 0 and job.want == 0):
                out[first + i] = arena_array[off:off + job.got]
                off += job.want
        first += b.n
    return out


def unlink_all(paths):
    """Remove the files (or links: never what they point to) at ``paths``
    (``DIR/NAME`` each, DIR opened without following a link: ENOTDIR where
    it is one), in one call without the GIL: the errno of each (0 where it
    went)."""
    cdef Py_ssize_t n = len(paths), i
    cdef const char **cpaths
    cdef int *codes
    if n == 0:
        return []
    encoded = [_path(p, "paths") for p in paths]
    cpaths = <const char **>malloc(n * sizeof(char *))
    codes = <int *>malloc(n * sizeof(int))
    if cpaths == NULL or codes == NULL:
        free(cpaths)
        free(codes)
        raise MemoryError()
    try:
        for i in range(n):
            cpaths[i] = <bytes>encoded[i]
        with nogil:
            for i in range(n):
                codes[i] = kv_fs_unlink(cpaths[i])
        return [codes[i] for i in range(n)]
    finally:
        free(cpaths)
        free(codes)


def count_present(paths):
    """How many of ``paths``, from the first, are regular files in
    subdirectories that are not links (never followed): one call without
    the GIL."""
    cdef Py_ssize_t n = len(paths), i, found = 0
    encoded = [_path(p, "paths") for p in paths]
    cdef const char **cpaths = <const char **>malloc(n * sizeof(char *) + 1)
    if cpaths == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            cpaths[i] = <bytes>encoded[i]
        with nogil:
            while found < n and kv_fs_is_entry(cpaths[found]):
                found += 1
        return found
    finally:
        free(cpaths)


def delete_files(paths):
    """Remove the files at ``paths`` that are not directories (their
    subdirectories never followed as links), in one call without the GIL,
    stopping at the first that fails for a reason other than being gone:
    ``(sizes, error)``, ``sizes[i]`` the bytes of the regular file removed
    (None: nothing removed, or not a regular file) for each path done, and
    ``error`` the OSError of the path it stopped at (or None)."""
    cdef Py_ssize_t n = len(paths), i, done = 0
    encoded = [_path(p, "paths") for p in paths]
    cdef const char **cpaths = <const char **>malloc(n * sizeof(char *) + 1)
    cdef int *codes = <int *>malloc(n * sizeof(int) + 1)
    cdef int *regular = <int *>malloc(n * sizeof(int) + 1)
    cdef int64_t *sizes = <int64_t *>malloc(n * sizeof(int64_t) + 1)
    try:
        if cpaths == NULL or codes == NULL or regular == NULL or sizes == NULL:
            raise MemoryError()
        for i in range(n):
            cpaths[i] = <bytes>encoded[i]
        with nogil:
            while done < n:
                codes[done] = kv_fs_delete(cpaths[done], &regular[done], &sizes[done])
                done += 1
                if _failed(codes[done - 1]):
                    break
        out, error = [], None
        for i in range(done):
            if _failed(codes[i]):
                error = OSError(codes[i], os.strerror(codes[i]), paths[i])
                break
            out.append(sizes[i] if codes[i] == 0 and regular[i] else None)
        return out, error
    finally:
        free(cpaths)
        free(codes)
        free(regular)
        free(sizes)
