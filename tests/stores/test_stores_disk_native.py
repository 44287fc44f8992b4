"""DiskStore's native directory calls (kvcore/stores/_fs.pyx): the listing,
the batch writes, reads and removals under PATH/.lock are one call each
without the GIL, and they keep every rule the Python code kept (never
through a link, never blocking, never reading a file past its head when
its header promises another size, every descriptor closed)."""
import errno
import os
import pathlib
import stat
import subprocess
import sys
import threading

import pytest

import kvcore
from kvcore.stores import _format, _fs

from test_stores_review import entry

TESTS_DIR = pathlib.Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX")


def python_listing(root, cutoff, stale, bad):
    """The listing as the Python DiskStore did it (os.scandir, lstat)."""
    out = []
    for d in os.scandir(root):
        if not d.is_dir(follow_symlinks=False):
            continue
        for f in os.scandir(d.path):
            st = f.stat(follow_symlinks=False)
            if f.name.endswith(".kve"):
                if stat.S_ISREG(st.st_mode):
                    out.append((f.path, st.st_size, st.st_mtime_ns))
                elif not stat.S_ISDIR(st.st_mode):
                    bad.append(f.path)
            elif f.name.startswith(".tmp-") and st.st_mtime_ns < cutoff:
                stale.append(f.path)
    return out


def open_fds():
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None


def test_the_native_listing_is_the_python_one(tmp_path):
    root = tmp_path / "store"
    for sub in ("aa", "bb", "cc"):
        (root / sub).mkdir(parents=True)
    (root / "aa" / "01.kve").write_bytes(b"x" * 10)
    (root / "aa" / "02.kve").write_bytes(b"y" * 3)
    (root / "bb" / "03.kve").mkdir()                              # a directory: left alone
    os.mkfifo(root / "bb" / "04.kve")                             # a FIFO: bad
    os.symlink("/etc/passwd", root / "bb" / "05.kve")             # a link: bad, never followed
    (root / "cc" / ".tmp-1-2-old").write_bytes(b"t")
    os.utime(root / "cc" / ".tmp-1-2-old", ns=(10**9, 10**9))       # stale
    (root / "cc" / ".tmp-1-2-new").write_bytes(b"t")                # fresh: kept
    (root / "cc" / "other.txt").write_bytes(b"o")                   # not ours
    os.symlink(root / "aa", root / "dd")                          # a link to a subdirectory
    (root / "ee.kve").write_bytes(b"top")                         # a file at the top
    (root / ".lock").write_bytes(b"")
    cutoff = 2 * 10**9
    want_stale, want_bad, got_stale, got_bad = [], [], [], []
    want = python_listing(str(root), cutoff, want_stale, want_bad)
    got = _fs.list_dir(str(root), ".kve", ".tmp-", cutoff, got_stale, got_bad)
    assert sorted(got) == sorted(want) and len(got) == 2
    assert sorted(got_stale) == sorted(want_stale) == [str(root / "cc" / ".tmp-1-2-old")]
    assert sorted(got_bad) == sorted(want_bad) and len(got_bad) == 2
    assert _fs.list_dir(str(tmp_path / "missing"), ".kve", ".tmp-", 0) == []
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        _fs.list_dir(str(tmp_path / "file"), ".kve", ".tmp-", 0)


def count_os_calls(monkeypatch):
    """Count the calls of os's file functions (each gives the GIL up and
    takes it back)."""
    calls = []
    for name in ("open", "stat", "lstat", "fstat", "unlink", "replace", "scandir", "makedirs",
                 "pread", "readv", "close", "utime"):
        real = getattr(os, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(os, name, spy)
    return calls


def test_a_put_makes_as_many_python_system_calls_for_60_entries_as_for_2(tmp_path,
                                                                      monkeypatch):
    """Under PATH/.lock a put lists, trims and writes with a fixed number
    of calls into os, whatever the batch and the directory hold: beside a
    thread busy in Python each such call waited up to a switch interval
    for the GIL, and a put of a hundred small entries held the machine-wide
    lock for a second."""
    disk = kvcore.DiskStore(tmp_path, 60_000)
    disk.put([entry(i, 1000) for i in range(55)])
    calls = count_os_calls(monkeypatch)
    disk.put([entry(200, 1000), entry(201, 1000)])
    small = list(calls)
    calls.clear()
    dropped = disk.put([entry(100 + i, 1000) for i in range(60)])    # trims the 57 others
    big = list(calls)
    monkeypatch.undo()
    assert len(dropped) == 57 and len(disk) == 60
    assert len(big) == len(small) <= 4, (small, big)    # the lock file: open, fstat, close


def test_a_failing_write_stops_the_batch_and_names_its_file(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    data = b"v" * 100
    (root / "bb").mkdir()
    (root / "bb" / ".tmp-x").mkdir()                    # the tmp name cannot be made
    os.symlink(tmp_path, root / "cc")                   # a link in place of a subdirectory
    (root / "dd").mkdir()
    (root / "dd" / "e.kve").mkdir()                     # a directory at the entry's name
    (root / "ee").mkdir()
    (root / "ee" / ".tmp-y").write_bytes(b"left by a writer that died")
    (root / "ee" / "f.kve").write_bytes(b"o" * 40)      # replaced: the directory grew by 60
    results, error = _fs.write_entries(str(root), [
        ("aa", "a.kve", ".tmp-a", data), ("cc", "c.kve", ".tmp-c", data),
        ("dd", "e.kve", ".tmp-d", data), ("ee", "f.kve", ".tmp-y", memoryview(data)),
        ("bb", "b.kve", ".tmp-x", data), ("aa", "z.kve", ".tmp-z", data)])
    assert results == [100, None, None, 60]
    assert error.errno == errno.EISDIR and error.filename == str(root / "bb" / ".tmp-x")
    assert (root / "aa" / "a.kve").read_bytes() == data
    assert (root / "ee" / "f.kve").read_bytes() == data
    assert not (root / "ee" / ".tmp-y").exists()
    assert not (root / "aa" / "z.kve").exists()         # after the failure: not written
    assert not list(tmp_path.glob("c.kve"))             # the link was not followed
    assert sorted(os.listdir(root / "aa")) == ["a.kve"]


def test_a_directory_removed_under_a_write_is_made_again(tmp_path):
    root = tmp_path / "gone" / "deeper"
    assert _fs.write_entries(str(root), []) == ([], None)
    assert _fs.write_entries(str(root), [("aa", "a.kve", ".tmp-a", b"abc")]) == ([3], None)
    assert (root / "aa" / "a.kve").read_bytes() == b"abc"
    (tmp_path / "file").write_bytes(b"")
    results, error = _fs.write_entries(str(tmp_path / "file" / "x"), [("aa", "a", ".t", b"")])
    assert results == [] and error.errno == errno.ENOTDIR


def test_take_reads_only_what_a_header_promises_and_closes_every_file(tmp_path):
    good_key, good = entry(1, 1000)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "good.kve").write_bytes(good)
    with open(tmp_path / "a" / "sparse.kve", "wb") as f:      # 1 GiB of holes, its head an
        f.write(good[:_format.HEAD_PROBE])                    # entry's of 1000 bytes
        f.truncate(1 << 30)
    os.mkfifo(tmp_path / "a" / "fifo.kve")
    os.symlink(tmp_path / "a" / "good.kve", tmp_path / "a" / "link.kve")
    (tmp_path / "a" / "short.kve").write_bytes(good[:50])
    paths = [str(tmp_path / "a" / n) for n in ("good.kve", "sparse.kve", "fifo.kve",
                                               "link.kve", "short.kve", "missing.kve")]
    heads = []

    def promised(head, size):
        heads.append(len(head))
        return _format.entry_size(head) == size
    fds = open_fds()
    got = _fs.take_entries(paths + [None], 1 << 31, _format.HEAD_PROBE, promised)
    assert got == ([bytearray(good), None, None, None, None, None, None], [0] * 7)
    assert heads == [_format.HEAD_PROBE, _format.HEAD_PROBE, 50]
    assert _fs.take_entries(paths[:1], 999, _format.HEAD_PROBE, promised) == ([None], [0])

    def fails(head, size):
        raise RuntimeError("a check that fails")
    with pytest.raises(RuntimeError):
        _fs.take_entries(paths, 1 << 31, _format.HEAD_PROBE, fails)
    assert open_fds() == fds
    assert _fs.unlink_all(paths[3:] + [str(tmp_path / "a")]) == [0, 0, errno.ENOENT,
                                                                errno.EISDIR]
    assert os.path.exists(paths[0])                     # the link's target stays


def test_puts_of_two_stores_on_one_directory_from_threads_stay_within_capacity(tmp_path):
    """Two DiskStores on one directory, each put from its own thread (their
    native calls run at once, without the GIL): the directory stays within
    capacity and every entry left is whole."""
    a, b = kvcore.DiskStore(tmp_path, 20_000), kvcore.DiskStore(tmp_path, 20_000)
    errors = []

    def writer(store, base):
        try:
            for r in range(20):
                store.put([entry((base + r * 7 + j) % 250, 1000) for j in range(7)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(s, base))
               for s, base in ((a, 0), (b, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert a.used_bytes() <= 20_000
    files = _fs.list_dir(str(tmp_path), ".kve", ".tmp-", 0)
    assert files and all(size == 1000 for _, size, _ in files)
    written = dict(entry(i, 1000) for i in range(250))
    for path, _, _ in files:
        key = bytes.fromhex(os.path.basename(path)[:-4])
        assert bytes(a.get([key])[0]) == written[key]


def test_a_trim_out_of_descriptors_never_loses_an_entry(tmp_path):
    """A trim that runs out of file descriptors (a process near its limit)
    keeps what it could not read: every file it removed was handed on."""
    script = f"""
import os, resource, sys
sys.path[:0] = {[str(TESTS_DIR), str(TESTS_DIR.parent)]!r}
import kvcore
from test_stores_review import entry
disk = kvcore.DiskStore({str(tmp_path)!r}, 200 * 600)
disk.put([entry(i, 600) for i in range(200)])
before = {{k for k, _ in (entry(i, 600) for i in range(200))}}
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    handed = disk.put([entry(200 + i, 600) for i in range(40)])
except OSError as e:
    handed = getattr(e, "dropped", [])
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
handed = {{k for k, _ in handed}}
left = {{bytes.fromhex(os.path.basename(p)[:-4]) for p, _, _ in disk._listing()}}
removed = before - left
assert removed, "nothing was trimmed"
assert removed <= handed, (len(removed), len(handed & removed))
print("removed", len(removed), "handed", len(handed))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_files_held_open_at_once_follow_the_free_descriptors(tmp_path):
    """A batch holds a quarter of the descriptors the process has free
    (its soft limit less those open), 64 to 256, read at each call; a
    lookup of more files than that holds exactly that many open between
    its two native calls and reads them all, every one closed after."""
    script = f"""
import os, resource, sys
sys.path[:0] = {[str(TESTS_DIR), str(TESTS_DIR.parent)]!r}
import kvcore
from kvcore.stores import _format, _fs
from test_stores_review import entry
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
if hard != resource.RLIM_INFINITY and hard < 4096:
    print("SKIP hard limit", hard)
    sys.exit(0)
opened = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
assert _fs.open_at_once() == 64
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
assert _fs.open_at_once() == 256
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
assert 64 + 128 <= _fs.open_at_once() <= 256 - opened // 4 + 1, _fs.open_at_once()
held = [os.open("/", os.O_RDONLY) for _ in range(1024 - 400 - opened)]
assert _fs.open_at_once() == 100, _fs.open_at_once()     # 400 free
held += [os.open("/", os.O_RDONLY) for _ in range(300)]
assert _fs.open_at_once() == 64                           # 100 free: the floor
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
disk = kvcore.DiskStore({str(tmp_path)!r}, 1 << 24)
ents = [entry(i, 700 + i) for i in range(600)]
disk.put(ents)
before = len(os.listdir("/proc/self/fd"))
peaks = []
def promised(head, size):
    peaks.append(len(os.listdir("/proc/self/fd")) - before)
    return _format.entry_size(head) == size
got = _fs.read_entries([disk._file(k) for k, _ in ents], 1 << 31, _format.HEAD_PROBE, promised)
assert [bytes(g) for g in got] == [v for _, v in ents]
assert max(peaks) == 256, max(peaks)
assert len(os.listdir("/proc/self/fd")) == before
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(f"needs a hard descriptor limit of 4096 or more: {out.stdout.strip()}")
    assert out.stdout.strip().endswith("OK"), out.stdout


@pytest.mark.forks
def test_a_child_forked_while_a_batch_is_open_closes_its_files(tmp_path):
    """Another thread forks while a read holds a batch of files open: the
    child closes them (the batch's thread is gone there), so it never
    keeps files a trim removes alive on disk; the parent reads on."""
    disk = kvcore.DiskStore(tmp_path, 1 << 24)
    ents = [entry(i, 900) for i in range(80)]
    disk.put(ents)
    paths = [disk._file(k) for k, _ in ents]
    pid = []

    def fork_now():
        p = os.fork()
        if p == 0:      # the child: none of the store's files open
            links = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            os._exit(1 if any(str(tmp_path) in t for t in links) else 0)
        pid.append(p)

    def promised(head, size):
        if not pid:
            t = threading.Thread(target=fork_now)
            t.start()
            t.join()
        return _format.entry_size(head) == size
    got = _fs.read_entries(paths, 1 << 31, _format.HEAD_PROBE, promised)
    assert [bytes(g) for g in got] == [v for _, v in ents]
    _, status = os.waitpid(pid[0], 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_planted_entry_under_a_name_that_is_no_key_is_removed_not_handed_on(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 3000)
    disk.put([entry(1, 1000), entry(2, 1000)])
    (tmp_path / "zz").mkdir()
    planted = tmp_path / "zz" / "zz.kve"
    planted.write_bytes(entry(3, 1000)[1])              # a whole entry, under no key
    os.utime(planted, ns=(1, 1))                        # the oldest: trimmed first
    dropped = disk.put([entry(4, 1000)])
    assert not planted.exists()
    assert [k for k, _ in dropped] == [entry(1, 1000)[0]] or \
        [k for k, _ in dropped] == [entry(2, 1000)[0]]
    assert disk.used_bytes() <= 3000


def test_any_stale_tmp_seconds_is_taken(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 3000)
    for secs in (1e11, float("inf"), float("nan"), -5.0):
        disk.stale_tmp_seconds = secs
        assert disk.put([entry(1, 1000)]) == []
        assert len(disk) == 1


def test_native_calls_refuse_what_c_would_cut_or_escape(tmp_path):
    for bad in ("a\0b", "", "..", "a/b"):
        with pytest.raises(ValueError, match="sub must be one file name|sub must be paths"):
            _fs.write_entries(str(tmp_path), [(bad, "x.kve", ".tmp-x", b"")])
    with pytest.raises(ValueError, match="paths must be paths without a NUL byte"):
        _fs.unlink_all([str(tmp_path / "a\0b")])
    with pytest.raises(ValueError, match="root must be paths without a NUL byte"):
        _fs.list_dir(str(tmp_path) + "\0", ".kve", ".tmp-", 0)
    assert os.listdir(tmp_path) == []


def test_a_removal_never_goes_through_a_subdirectory_swapped_for_a_link(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "ab.kve").write_bytes(b"keep")
    (tmp_path / "s").mkdir()
    os.symlink(target, tmp_path / "s" / "ab")           # SUB is now a link
    assert _fs.unlink_all([str(tmp_path / "s" / "ab" / "ab.kve")]) == [errno.ENOTDIR]
    assert (target / "ab.kve").read_bytes() == b"keep"


def test_a_read_of_many_files_reads_each_whole_touches_it_and_closes_it(tmp_path):
    """read_entries over more files than it holds open at once: every
    entry whole, the recency of each file read refreshed, a file whose
    header promises another size read no further than its head, and an
    error other than 'gone' raised with every file closed."""
    disk = kvcore.DiskStore(tmp_path, 1 << 24)
    ents = [entry(i, 1000 + i) for i in range(_fs.open_at_once() * 2 + 5)]
    disk.put(ents)
    paths = [disk._file(k) for k, _ in ents]
    for p in paths:
        os.utime(p, ns=(10**9, 10**9))
    (tmp_path / "zz").mkdir()
    sparse = tmp_path / "zz" / "sparse.kve"
    with open(sparse, "wb") as f:
        f.write(ents[0][1][:_format.HEAD_PROBE])
        f.truncate(1 << 30)

    def promised(head, size):
        return _format.entry_size(head) == size
    fds = open_fds()
    got = _fs.read_entries(paths + [str(sparse), str(tmp_path / "zz" / "missing.kve")],
                           1 << 31, _format.HEAD_PROBE, promised)
    assert [bytes(g) for g in got[:-2]] == [v for _, v in ents]
    assert len(got[-2]) == _format.HEAD_PROBE and got[-1] is None
    assert all(os.stat(p).st_mtime_ns > 10**9 for p in paths)
    too_long = str(tmp_path / "zz" / ("x" * 300))
    with pytest.raises(OSError) as info:
        _fs.read_entries(paths[:3] + [too_long], 1 << 31, _format.HEAD_PROBE, promised)
    assert info.value.errno == errno.ENAMETOOLONG and info.value.filename == too_long
    assert open_fds() == fds
    assert [bytes(v) for v in disk.get([k for k, _ in ents])] == [v for _, v in ents]


def test_contains_and_delete_never_go_through_a_link(tmp_path):
    root = tmp_path / "s"
    (root / "aa").mkdir(parents=True)
    target = tmp_path / "target"
    target.mkdir()
    (target / "t.kve").write_bytes(b"keep")
    (root / "aa" / "1.kve").write_bytes(b"x" * 7)
    (root / "aa" / "2.kve").write_bytes(b"y" * 5)
    os.symlink(target / "t.kve", root / "aa" / "3.kve")     # a link named like an entry
    os.mkfifo(root / "aa" / "4.kve")
    (root / "aa" / "5.kve").mkdir()
    os.symlink(target, root / "bb")                          # a subdirectory that is a link
    p = {n: str(root / "aa" / f"{n}.kve") for n in range(1, 6)}
    through_link = str(root / "bb" / "t.kve")
    assert _fs.count_present([p[1], p[2], p[3], p[1]]) == 2
    assert _fs.count_present([p[4]]) == 0 and _fs.count_present([p[5]]) == 0
    assert _fs.count_present([through_link]) == 0 and _fs.count_present([]) == 0
    sizes, error = _fs.delete_files([p[1], p[3], p[4], p[5], through_link,
                                     str(root / "aa" / "gone.kve"), p[2]])
    assert sizes == [7, None, None, None, None, None, 5] and error is None
    assert sorted(os.listdir(root / "aa")) == ["5.kve"]
    assert (target / "t.kve").read_bytes() == b"keep"
    too_long = str(root / "aa" / ("x" * 300))
    (root / "aa" / "6.kve").write_bytes(b"z")
    sizes, error = _fs.delete_files([str(root / "aa" / "6.kve"), too_long, p[5]])
    assert sizes == [1] and error.errno == errno.ENAMETOOLONG and error.filename == too_long


def test_a_store_delete_counts_what_it_removed(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 1 << 20)
    ents = [entry(i, 1000) for i in range(4)]
    disk.put(ents)
    keys = [k for k, _ in ents]
    assert disk.contains(keys) == 4
    assert disk.delete(keys[1:3] + [entry(9, 1000)[0]]) == 2
    assert disk.contains(keys) == 1 and disk.contains(keys[3:]) == 1
    assert disk._used == disk.used_bytes() == 2000


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm")
def test_planted_sparse_files_whose_sizes_wrap_a_sum_are_read_to_their_heads():
    """Files named like looked-up keys, sparse, of 2**63 bytes less a little,
    their headers promising those sizes, in a store of unbounded capacity:
    their sizes sum past 2**64; a lookup reads their heads (or fails
    cleanly), never past its buffer."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        disk = kvcore.DiskStore(d, 2**70)                  # capacity_bytes past 64 bits
        key, value = entry(1, 1000)
        keys = [key, entry(2, 1000)[0], entry(3, 1000)[0]]
        head = bytearray(value[:_format.HEAD_PROBE])
        for k, size in zip(keys, (2**63 - 2048, 2**63 - 2048, 8192)):
            # a header that promises `size`: its payload length field forged
            forged = bytearray(head)           # (the payload's length: its last 8 bytes)
            base = _format.entry_size(head) - int.from_bytes(head[112:120], "little")
            forged[112:120] = (size - base).to_bytes(8, "little")
            assert _format.entry_size(forged) == size
            path = disk._file(k)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(forged)
                f.truncate(size)
        fds = open_fds()
        try:
            got = disk.get(keys)
        except MemoryError:
            got = None
        assert open_fds() == fds
        if got is not None:
            assert len(got[0]) == len(got[1]) == _format.HEAD_PROBE
            assert len(got[2]) in (_format.HEAD_PROBE, 8192)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_lookup_near_the_descriptor_limit_still_reads(tmp_path):
    script = f"""
import os, resource, sys
sys.path[:0] = {[str(TESTS_DIR), str(TESTS_DIR.parent)]!r}
import kvcore
from test_stores_review import entry
disk = kvcore.DiskStore({str(tmp_path)!r}, 1 << 24)
ents = [entry(i, 1000) for i in range(100)]
disk.put(ents)
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
got = disk.get([k for k, _ in ents])
assert [bytes(g) for g in got] == [v for _, v in ents]
assert disk.contains([k for k, _ in ents]) == 100
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_a_capacity_past_64_bits_still_looks_up_and_trims(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 2**64)
    ents = [entry(i, 1000) for i in range(3)]
    assert disk.put(ents) == []
    assert [bytes(v) for v in disk.get([k for k, _ in ents])] == [v for _, v in ents]


def test_an_empty_file_read_has_its_recency_refreshed(tmp_path):
    (tmp_path / "aa").mkdir()
    p = tmp_path / "aa" / "00.kve"
    p.write_bytes(b"")
    os.utime(p, ns=(10**9, 10**9))
    got = _fs.read_entries([str(p)], 1 << 20, _format.HEAD_PROBE, lambda h, s: True)
    assert len(got[0]) == 0 and os.stat(p).st_mtime_ns > 10**9
