"""DiskStore: evicted blocks as files, surviving restarts, shared by the processes of a machine."""
import contextlib
import errno
import fcntl
import os
import stat
import threading
import time


from . import _format, _fs
from .._forksafe import LEAF, fork_guard
from .base import PrefixStore, bound_bytes

_SUFFIX = ".kve"
_LOCK_POLL = 0.001   # seconds between tries of PATH/.lock
# a take that ran out of descriptors or memory did not look at its file:
# a trim keeps that file (it keeps its room) rather than lose its entry
_SCARCE = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM))
_TMP = ".tmp-"
_INT64_MAX = 2**63 - 1     # (what the native calls take as a size; capacity_bytes may be more)
# Every file in the directory is untrusted (other processes write there):
# entries are opened without following a link (a planted link would make
# this process copy any file it can read into the next tier) and without
# blocking (a FIFO named like an entry would hang the open for ever), and
# only regular files are read, at most the size fstat gave (a device such
# as /dev/zero never ends): kvcore/stores/csrc/kv_fs.c does all of it.
# PATH/.lock is untrusted too: never through a link (a dangling one planted
# there would make this process create its target), never blocking (a FIFO),
# and only a regular file is locked (read-only is enough for flock)
_OPEN_LOCK = (os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
              | getattr(os, "O_CLOEXEC", 0))


def _entry_key(path):
    """The key an entry file's name says (``HEX.kve``, as :meth:`DiskStore._file`
    names them), or None for a name that is no key (planted)."""
    h = os.path.basename(path)[:-len(_SUFFIX)]
    if not h or len(h) % 2 or h.strip("0123456789abcdef"):
        return None
    return bytes.fromhex(h)


class DiskStoreLocked(OSError):
    """A DiskStore could not lock or trim its directory, so it wrote nothing
    (its directory must not outgrow ``capacity_bytes``); reads go on."""


class DiskStore(PrefixStore):
    """Prefix store in a directory: one file per entry.

    Parameters
    ----------
    path : str or os.PathLike
        Directory (created if missing).  Several processes, and later runs,
        may use the same directory: the files are the index.
    capacity_bytes : int
        Most bytes of entry files kept; past it the least recently used
        (by file modification time, refreshed on every hit) are removed,
        handed to the next store first.
    namespace : str or bytes, optional
    hmac_key : bytes, optional

    Notes
    -----
    An entry is written to a temporary file in its final directory and
    renamed into place (``os.replace``), so a reader sees a whole old entry,
    a whole new one, or none; concurrent writers of one key both succeed
    and one of their (identical) entries stays.  Each ``put`` first makes
    room for its batch: once, under an exclusive ``flock`` on
    ``PATH/.lock``, over a fresh listing of the directory, it removes the
    least recently used files until the batch fits below
    ``low_watermark * capacity_bytes`` (so the next puts find room), and
    only then writes, still under the lock; entries beyond what fits in
    ``capacity_bytes`` at all go to the next tier unwritten.  Processes
    sharing the directory keep it within capacity between them (the
    listing costs a ``stat`` per entry file: size ``capacity_bytes`` for
    entries of megabytes, not bytes).  A put that cannot lock ``PATH/.lock`` (held by another process
    past ``lock_timeout``, or not a regular file this process can open: a
    directory, a link, a FIFO, another user's file) or cannot trim writes
    nothing and raises :class:`DiskStoreLocked` (the pool: a miss, a
    ``StoreWarning``, ``failures`` counted, the entries handed to the next
    store); lookups go on.  A torn or corrupted file is caught by the
    entry's checksum when read, and is then a miss.

    Every file in the directory is untrusted: entries are opened without
    following links and without blocking, and only regular files are read,
    at most the size ``fstat`` gives and the header promises (a file of
    another size is read no further than its head).  A link, FIFO, device
    or socket named like an entry is a miss and is removed by the next trim
    (a link itself, never its target); a directory named like one is
    passed over; an entry file that cannot be read is removed without being
    handed on, and one that cannot be removed either keeps its room while
    the trim goes on with the others.
    """

    kind = "disk"
    #: most seconds a trim waits for ``PATH/.lock`` (another process trimming,
    #: or one stopped while it held the lock); then the put fails with
    #: TimeoutError (the pool: a 'timeout' warning, the store skipped for
    #: ``retry_interval``), never blocking the pool for longer
    lock_timeout = 1.0
    #: a temporary file (``.tmp-*``, an entry being written) not modified
    #: for this many seconds was left by a writer that died or hung; the
    #: next trim (before a put, and when a store opens the directory)
    #: removes it
    stale_tmp_seconds = 600.0
    #: a put that has to trim frees room down to this fraction of
    #: ``capacity_bytes`` (below its own batch), so that the puts after it
    #: need not remove anything
    low_watermark = 0.9

    def __init__(self, path, capacity_bytes, namespace="", hmac_key=None):
        if capacity_bytes is None:
            raise TypeError("capacity_bytes must be an int, got None")
        super().__init__(capacity_bytes, namespace, hmac_key)
        try:
            path = os.fspath(path)
        except TypeError:
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}") \
                from None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if "\0" in path:
            raise ValueError(f"path must be a directory path, got {path!r}: it holds a null byte")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"path must be a directory (or not exist yet), got {path!r}: "
                             "it exists and is not a directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"path must be a directory that can be created, got {path!r}: "
                             f"{e.strerror or e}") from e
        self.path = os.path.abspath(path)
        self._lock = threading.Lock()
        fork_guard(self, "_lock", LEAF)
        stale = []
        self._used = sum(size for _, size, _ in self._listing(stale))
        self._unlink_all(stale)

    def _file(self, key):
        h = key.hex()
        return os.path.join(self.path, h[-2:], h + _SUFFIX)

    def _listing(self, stale=None, bad=None):
        """(path, size, mtime) of every entry file now in the directory
        (regular files only, never through a link); with a list ``stale``,
        the paths of temporary files older than ``stale_tmp_seconds`` are
        appended to it; with a list ``bad``, the paths named like an entry
        that are not regular files (links, FIFOs, devices; directories are
        left alone and not counted)."""
        # one native call without the GIL (stores/csrc/kv_fs.h): from
        # Python every stat gave the GIL up, and beside a busy thread took
        # it back only every switch interval, all under PATH/.lock
        secs = self.stale_tmp_seconds
        # (past 300 years, inf or NaN: none is stale; C takes 64 bits)
        cutoff = time.time_ns() - int(secs * 1e9) if secs < 1e10 else -_INT64_MAX - 1
        cutoff = max(cutoff, -_INT64_MAX - 1)
        return _fs.list_dir(self.path, _SUFFIX, _TMP, cutoff, stale, bad)

    def contains(self, keys):
        # one native call without the GIL (a lookup beside a busy thread)
        return _fs.count_present([self._file(k) for k in keys])

    def get(self, keys):
        return self._read(keys, self.capacity_bytes)

    def get_bounded(self, keys, max_bytes):
        """:meth:`get`, reading only the head of a file longer than
        ``max_bytes`` (a corrupt entry: ``b""``-like, it fails its checks)."""
        bound_bytes(max_bytes)
        return self._read(keys, min(self.capacity_bytes, max_bytes))

    def _read(self, keys, limit):
        # Entries are read, not mapped: a mapping keeps a file descriptor
        # per entry (a long prefix would run out of them) and a file
        # truncated under it would kill the process (SIGBUS).  They are
        # read into one allocation per batch of files (_fs.open_at_once:
        # a quarter of the free descriptors, 64 to 256; one large buffer: NumPy
        # asks the kernel for huge pages, not paced by page faults the way
        # many small ones are), in native calls without the GIL (_fs: a
        # prefetch beside a thread busy in Python is not paced by the
        # GIL's switch interval either).  A short read is a truncated
        # entry, which fails its checks like any corrupt one.  What is not
        # a regular file (a link, a FIFO, a directory, a device) is not an
        # entry: None.  No entry of this store is larger than ``limit``
        # (its put would have handed it on; nor of the asking pool, past a
        # get_bounded's limit), nor longer than its header says (e.g. a
        # sparse file): of such a file only the head is read, a corrupt
        # entry.
        def promised(head, size):
            return _format.entry_size(head) == size
        return _fs.read_entries([self._file(k) for k in keys], min(limit, _INT64_MAX),
                                _format.HEAD_PROBE, promised)

    def put(self, items):
        items = list(items)
        # what cannot fit at all goes on unwritten (the newest entries stay)
        cap, fit, keep = self.capacity_bytes, 0, len(items)
        while keep and fit + len(items[keep - 1][1]) <= cap:
            keep -= 1
            fit += len(items[keep][1])
        dropped = items[:keep]
        trimmed = []
        grown = 0
        try:
            # room for the batch first (one listing), then the writes, all
            # under PATH/.lock: nothing is written unless it fits, and no
            # other process's put trims or writes in between (two puts
            # that each made room and then both wrote would leave the
            # directory past capacity_bytes)
            with self._locked():
                trimmed = self._trim(fit)
                batch = items[keep:]
                results, error = self._write_all(batch)
                for (k, v), g in zip(batch, results):
                    if g is None:        # no place of ours for it: the next tier's
                        dropped.append((k, v))
                        continue
                    grown += g
                if error is not None:
                    raise error
        except BaseException as e:
            # what the trim removed from the disk goes on to the next tier
            # with the exception (the pool hands on the batch itself)
            removed = trimmed or list(getattr(e, "dropped", None) or ())
            if removed:
                e.dropped = removed
            raise
        finally:
            with self._lock:
                self._used += grown
        return trimmed + dropped

    def _write_all(self, items):
        """Write entries ``items`` ([(key, bytes-like)]), each to a temporary
        file in its subdirectory and then renamed into place, never through
        a link (``_fs.write_entries``: one call without the GIL); returns
        ``(results, error)``: per entry written, the bytes the directory
        grew by, or None when its place is not one to write to (its
        subdirectory a link or not a directory, a directory at its name:
        the caller hands it on); ``error``, the OSError of the entry it
        stopped at, or None."""
        tid, pid = threading.get_ident(), os.getpid()
        jobs = []
        for k, v in items:
            h = k.hex()
            jobs.append((h[-2:], h + _SUFFIX, f"{_TMP}{pid}-{tid}-{h[-16:]}", v))
        return _fs.write_entries(self.path, jobs)

    def _trim(self, room=0):
        """Make room for ``room`` more bytes (the caller holds ``PATH/.lock``):
        remove least recently used files until the directory holds at most
        ``capacity_bytes - room`` (``low_watermark * capacity_bytes - room``
        when it has to remove any); their entries are returned (for the
        next tier).  What is named like an entry but is not a regular file
        is removed (a link: the link, not what it points to) and never
        read; an entry file that cannot be read (or whose size is not the
        one its header promises) is removed without being handed on; one
        that cannot be removed either is passed over: the trim goes on with
        the others.  Raises :class:`DiskStoreLocked` when it cannot make
        the room (nothing may be written then)."""
        dropped = []
        stale, bad = [], []
        files = self._listing(stale, bad)
        self._unlink_all(stale)
        self._unlink_all(bad)
        used = sum(size for _, size, _ in files)
        cap = self.capacity_bytes
        if used + room > cap:
            low = int(cap * self.low_watermark)
            target = low - room if room <= low else cap - room
            oldest = sorted(files, key=lambda e: e[2])
            i = 0
            while used > target and i < len(oldest):
                # the least recently used files that make the room, in one
                # batch (read, then removed: _fs, without the GIL); more
                # where some could not be removed
                batch, need = [], used - target
                while need > 0 and i < len(oldest):
                    batch.append(oldest[i][:2])
                    need -= oldest[i][1]
                    i += 1
                keys = [_entry_key(p) for p, _ in batch]
                # (a name that is no key of ours: removed, never read or handed on)
                values, errs = self._take_all([p if k is not None else None
                                               for (p, _), k in zip(batch, keys)])
                gone = [(p, size, k, v) for (p, size), k, v, err in zip(batch, keys, values, errs)
                        if err not in _SCARCE]   # (not looked at: kept, it keeps its room)
                for (p, size, k, value), err in zip(gone, _fs.unlink_all([g[0] for g in gone])):
                    if err == errno.ENOENT:
                        value = None
                    elif err:
                        continue       # not ours to remove: it keeps its room
                    used -= size
                    if value is not None:
                        dropped.append((k, value))
        with self._lock:
            self._used = used
        if used + room > self.capacity_bytes:
            e = DiskStoreLocked(errno.ENOSPC, f"DiskStore {self.path}: {used} bytes it "
                                f"cannot remove leave no room for {room} more within "
                                f"capacity_bytes={self.capacity_bytes}; nothing written")
            e.dropped = dropped
            raise e
        return dropped

    @contextlib.contextmanager
    def _locked(self):
        """Hold ``PATH/.lock`` exclusively (waiting at most
        ``lock_timeout``; :class:`DiskStoreLocked` or TimeoutError when it
        cannot)."""
        fd = self._open_lock()
        try:
            self._lock_file(fd)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _open_lock(self):
        """A descriptor of ``PATH/.lock`` (created if missing), a regular
        file opened without following a link or blocking; raises
        :class:`DiskStoreLocked` otherwise."""
        path = os.path.join(self.path, ".lock")
        why = None
        try:
            fd = os.open(path, _OPEN_LOCK, 0o644)
        except OSError as e:
            why, code = e.strerror or str(e), e.errno
            if e.errno == errno.ELOOP:
                why = "it is a symbolic link"
        else:
            try:
                st = os.fstat(fd)
            except OSError as e:
                os.close(fd)
                raise DiskStoreLocked(e.errno, f"DiskStore cannot lock {path}: "
                                      f"{e.strerror}; nothing written") from None
            if stat.S_ISREG(st.st_mode):
                return fd
            os.close(fd)
            why, code = "it is not a regular file", errno.EINVAL
        raise DiskStoreLocked(code, f"DiskStore cannot lock {path}: {why}; nothing written "
                                    "until it can (the directory must stay within "
                                    "capacity_bytes)")

    def _take_all(self, paths):
        """The bytes of the entry files at ``paths`` (None: skipped) for the
        next tier: ``(values, errors)``, a ``bytearray`` or None each (gone,
        not a regular file, unreadable, larger than ``capacity_bytes``, or
        not of the size its header promises), and the errno of an open or
        read that failed (0 otherwise): never more than the promised size
        is read, and only the head of a file whose header promises
        another."""
        def promised(head, size):
            return _format.entry_size(head) == size
        return _fs.take_entries(paths, min(self.capacity_bytes, _INT64_MAX), _format.HEAD_PROBE,
                                promised)

    @staticmethod
    def _unlink_all(paths):
        """Remove stale temporary files and what is named like an entry but
        is not one (one that cannot be removed is left: it only takes
        room)."""
        _fs.unlink_all(paths)

    def _lock_file(self, fd):
        """Exclusive flock on descriptor ``fd`` (``PATH/.lock``), waiting at
        most ``lock_timeout``."""
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process held {os.path.join(self.path, '.lock')} for more "
                        f"than {self.lock_timeout} s (DiskStore.lock_timeout)") from None
                time.sleep(_LOCK_POLL)

    def delete(self, keys):
        # one native call without the GIL; what is not a regular file is
        # removed uncounted, a directory left, a subdirectory that is a
        # link never followed
        sizes, error = _fs.delete_files([self._file(k) for k in keys])
        removed = [size for size in sizes if size is not None]
        with self._lock:
            self._used -= sum(removed)
        if error is not None:
            raise error
        return len(removed)

    def used_bytes(self):
        """Bytes of entry files in the directory now (a fresh listing)."""
        used = sum(size for _, size, _ in self._listing())
        with self._lock:
            self._used = used
        return used

    def __len__(self):
        return len(self._listing())

    def __repr__(self):
        return f"DiskStore({self.path!r}, capacity_bytes={self.capacity_bytes})"
