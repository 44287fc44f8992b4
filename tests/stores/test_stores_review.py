"""Regressions found in review of the prefix stores: bad arguments caught at
construction with a message naming them, a DiskStore trim that never waits
unboundedly for another process's lock (under the pool's lock), and probe()
that skips a store which timed out like allocate() does."""
import errno
import fcntl
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import kvcore

from _stores_support import make_pool, run

PROMPT = np.arange(1, 18, dtype=np.int32)


# ------------------------------------------------------------ DiskStore(path)
def test_disk_store_on_a_file_names_path(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"path must be a directory.*file"):
        kvcore.DiskStore(f, 1 << 20)
    with pytest.raises(ValueError, match=r"path must be a directory.*sub"):
        kvcore.DiskStore(f / "sub", 1 << 20)
    assert f.read_bytes() == b"x"


@pytest.mark.parametrize("path", ["dir\0name", b"dir\0name"])
def test_disk_store_path_with_a_null_byte_names_path(tmp_path, path):
    full = os.path.join(os.fsencode(tmp_path) if isinstance(path, bytes) else str(tmp_path), path)
    with pytest.raises(ValueError, match=r"path must be a directory path, got .*dir\\x00name.*"
                                         r"null byte"):
        kvcore.DiskStore(full, 1 << 20)


# ------------------------------------------------------------ DiskStore trim lock
def test_disk_store_trim_waits_boundedly_for_another_process_lock(tmp_path):
    """A process holding PATH/.lock (stopped while trimming, hung on a
    network file system) must not block this pool's evictions, under the
    pool's lock, for ever: the put times out, a StoreWarning says so."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(tmp_path / '.lock')!r}, "a+b")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        disk = kvcore.DiskStore(tmp_path, 1 << 20)
        disk.lock_timeout = 0.2
        pool = make_pool(num_blocks=5, stores=[disk])
        run(pool, PROMPT)                       # 4 cached blocks, unheld
        done = []

        def evict():
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                run(pool, PROMPT + 100)         # evicts the cached blocks
                done.append([str(x.message) for x in w])

        t = threading.Thread(target=evict, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the eviction blocked on PATH/.lock"
        with pytest.warns(kvcore.StoreWarning, match="timeout"):
            pool.flush_to_stores()              # the store worker's put timed out
        assert pool.stats()["stores"][0]["failures"] >= 1
        pool.debug.check()
    finally:
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()


def test_disk_store_trim_still_takes_a_free_lock(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 1 << 20)
    with open(tmp_path / ".lock", "a+b") as f:
        disk._lock_file(f.fileno())
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ------------------------------------------------------------ RedisStore arguments
@pytest.mark.parametrize("kw, name", [
    ({"ttl": float("inf")}, "ttl"), ({"ttl": 1e300}, "ttl"), ({"ttl": float("nan")}, "ttl"),
    ({"timeout": float("inf")}, "timeout"), ({"timeout": 1e300}, "timeout"),
])
def test_redis_store_rejects_unusable_ttl_and_timeout(kw, name):
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        kvcore.RedisStore("redis://127.0.0.1:1/0", **kw)


@pytest.mark.parametrize("url", ["localhost:6379", "http://host", "", "redis://h:notaport"])
def test_redis_store_bad_url_names_url(url):
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match=r"^url must be a redis://"):
        kvcore.RedisStore(url)


# ------------------------------------------------------------ probe on a dead server
def test_probe_skips_a_store_that_timed_out():
    """probe() used to pay the store's full timeout on every call, with no
    warning, while allocate() skipped the store for retry_interval."""
    pytest.importorskip("redis")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)                              # connects, never answers
    try:
        store = kvcore.RedisStore(f"redis://127.0.0.1:{srv.getsockname()[1]}/0",
                                  timeout=0.3, retry_interval=60)
        pool = make_pool(stores=[store])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert pool.probe(PROMPT)["store_hit_tokens"] == 0
            t = time.monotonic()
            for _ in range(3):
                assert pool.probe(PROMPT)["store_hit_tokens"] == 0
            elapsed = time.monotonic() - t
        assert elapsed < 0.3, f"3 probes of a store down for 60 s took {elapsed:.2f} s"
        assert any("timeout" in str(x.message) for x in w
                   if issubclass(x.category, kvcore.StoreWarning))
        assert pool.stats()["stores"][0]["failures"] == 0     # probe counts nothing
        store.close()
    finally:
        srv.close()


def test_a_store_warning_raised_as_an_error_leaves_the_sequence_new(tmp_path):
    """-W error turns the pool's StoreWarning into an exception out of
    allocate: the allocation is undone, so the sequence takes a retry and the
    pool holds no block for it."""
    import glob
    import os
    import warnings

    pool = kvcore.BlockPool(4, 2, 1, 1, 4, dtype="float32",
                            stores=[kvcore.DiskStore(str(tmp_path), 1 << 20)])
    a = kvcore.PagedKVCache(pool)
    a.allocate([1, 2, 3])
    k = np.ones((3, 1, 4), np.float32)
    a.append(0, k, k)
    a.commit(3)
    a.free()
    pool.flush_to_stores()
    f = glob.glob(os.path.join(str(tmp_path), "*", "*.kve"))[0]
    with open(f, "rb") as fh:
        b = bytearray(fh.read())
    b[-1] ^= 1
    with open(f, "wb") as fh:
        fh.write(b)
    pool2 = kvcore.BlockPool(4, 2, 1, 1, 4, dtype="float32",
                             stores=[kvcore.DiskStore(str(tmp_path), 1 << 20)])
    s = kvcore.PagedKVCache(pool2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(kvcore.StoreWarning):
            s.allocate([1, 2, 3])
    assert s.num_tokens == 0 and pool2.num_used_blocks == 0
    assert s.allocate([1, 2, 3]) == 0        # warned once already: a plain miss now
    assert s.num_tokens == 3
    s.free()


class _InterruptedStore(kvcore.HostStore):
    """A HostStore whose lookups raise KeyboardInterrupt once armed (a
    Ctrl-C while a slow Redis or disk store answers)."""
    armed = False

    def get(self, keys):
        if self.armed:
            raise KeyboardInterrupt
        return super().get(keys)

    def get_bounded(self, keys, limit):
        if self.armed:
            raise KeyboardInterrupt
        return super().get_bounded(keys, limit)


def test_a_keyboard_interrupt_in_a_store_lookup_undoes_the_allocate():
    """A KeyboardInterrupt out of a store's lookup reaches allocate's
    caller with the call undone: the sequence empty and new (a retry works),
    the pool's blocks and prefix-cache counts as before.  (Review,
    2026-12-07: the sequence kept the prompt and its blocks.)"""
    store = _InterruptedStore(1 << 20)
    pool = kvcore.BlockPool(6, 4, 1, 1, 8, dtype="float32", stores=[store])
    prompt = list(range(17))
    a = kvcore.PagedKVCache(pool)
    a.allocate(prompt)
    kv = np.ones((17, 1, 8), np.float32)
    a.append(0, kv, kv)
    a.commit(17)
    a.free()
    b = kvcore.PagedKVCache(pool)
    b.allocate(list(range(100, 124)))        # evicts the prompt's blocks into the store
    b.free()
    pool.wait_spills()
    assert pool.probe(prompt)["store_hit_tokens"] > 0
    before = pool.debug.snapshot()
    s = kvcore.PagedKVCache(pool)
    store.armed = True
    with pytest.raises(KeyboardInterrupt):
        s.allocate(prompt)
    after = pool.debug.snapshot()
    assert s.num_tokens == 0 and s.num_blocks == 0
    assert after["num_free_blocks"] == before["num_free_blocks"]
    assert after["stats"]["prefix_queries"] == before["stats"]["prefix_queries"]
    assert after["stats"]["prefix_hits"] == before["stats"]["prefix_hits"]
    store.armed = False
    assert s.allocate(prompt) == 16          # the retry loads the prefix
    s.free()


class _BadRepr(kvcore.HostStore):
    def __repr__(self):
        raise RuntimeError("repr is broken")

    def contains(self, keys):
        raise OSError("store offline")


def test_a_store_whose_repr_fails_still_degrades_to_a_miss():
    pool = kvcore.BlockPool(8, 2, 1, 1, 4, dtype="float32", stores=[_BadRepr(1 << 20)])
    s = kvcore.PagedKVCache(pool)
    with pytest.warns(kvcore.StoreWarning, match="_BadRepr"):
        assert s.allocate([1, 2, 3, 4, 5]) == 0
    assert s.num_tokens == 5
    s.free()


def test_disk_store_loads_a_run_longer_than_the_open_file_limit(tmp_path):
    """DiskStore.get reads entries (no mapping per entry, which kept a file
    descriptor each): a prefix of more blocks than the process may open
    files still loads whole."""
    code = textwrap.dedent(f"""
        import resource, warnings
        import numpy as np
        import kvcore
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        bs, nblk = 2, 300
        def pool():
            return kvcore.BlockPool(nblk + 2, bs, 1, 1, 4, dtype="float32",
                                    stores=[kvcore.DiskStore({str(tmp_path)!r}, 1 << 30)])
        toks = np.arange(bs * nblk + 1, dtype=np.int32)
        p = pool()
        s = kvcore.PagedKVCache(p)
        s.allocate(toks)
        k = np.random.default_rng(0).random((len(toks), 1, 4)).astype(np.float32)
        s.append(0, k, k)
        s.commit(len(toks))
        s.free()
        p.flush_to_stores()
        warnings.simplefilter("error")
        p2 = pool()
        s2 = kvcore.PagedKVCache(p2)
        assert s2.allocate(toks) == bs * nblk
        got = s2.gather(0, 0, bs * nblk)[0]
        assert np.array_equal(got, k[:bs * nblk].transpose(1, 0, 2)), "wrong data"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_two_stores_sharing_a_directory_stay_within_its_capacity(tmp_path):
    """Two DiskStores on one directory (two processes' stores) putting at
    once: a put makes room and writes under PATH/.lock, so the other's
    trim sees what it wrote and the directory never exceeds capacity_bytes.
    (Review, 2026-12-07: a put released the lock between its trim and its
    writes; two puts could both make room, then both write.)"""
    import os
    import threading
    import time

    from kvcore.stores.disk import DiskStore

    src = tmp_path / "src"
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32",
                            stores=[DiskStore(str(src), 1 << 30)])
    s = kvcore.PagedKVCache(pool)
    s.allocate(list(range(25)))
    kv = np.ones((25, 1, 8), np.float32)
    s.append(0, kv, kv)
    s.commit(25)
    s.free()
    pool.flush_to_stores()
    pool.close()
    entries = sorted((bytes.fromhex(f[:-4]), (pathlib.Path(d) / f).read_bytes())
                     for d, _, fs in os.walk(src) for f in fs if f.endswith(".kve"))
    assert len(entries) == 6
    size = len(entries[0][1])
    shared = str(tmp_path / "shared")
    a, b = DiskStore(shared, 4 * size), DiskStore(shared, 4 * size)
    writing = threading.Event()
    write = a._write_all

    def slow_write(items):         # a's writes take long: b's put comes meanwhile
        writing.set()
        time.sleep(0.2)
        return write(items)

    a._write_all = slow_write
    ta = threading.Thread(target=a.put, args=(entries[:3],))
    ta.start()
    assert writing.wait(10)
    b.put(entries[3:])
    ta.join(10)
    used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(shared)
               for f in fs if f.endswith(".kve"))
    assert used <= 4 * size, (used, 4 * size)


def test_disk_store_stays_near_its_bound_during_a_big_flush(tmp_path, monkeypatch):
    """A batch put makes room for the batch first, with one listing of the
    directory (not one per entry), and writes only what fits: the directory
    never holds more than the capacity."""
    from kvcore.stores.disk import DiskStore

    peak, listings = [], []
    orig, orig_listing = DiskStore._trim, DiskStore._listing

    def spy(self, room=0):
        peak.append(sum(size for _, size, _ in orig_listing(self)) + room)
        return orig(self, room)

    def count(self, *a, **kw):
        listings.append(1)
        return orig_listing(self, *a, **kw)

    monkeypatch.setattr(DiskStore, "_trim", spy)
    monkeypatch.setattr(DiskStore, "_listing", count)
    st = DiskStore(str(tmp_path), 64 * 1024)
    pool = kvcore.BlockPool(64, 16, 2, 2, 64, dtype="float16", stores=[st])
    s = kvcore.PagedKVCache(pool)
    toks = np.arange(64 * 16, dtype=np.int32)
    s.allocate(toks)
    k = np.ones((len(toks), 2, 64), np.float16)
    for layer in range(2):
        s.append(layer, k, k)
    s.commit(len(toks))
    listings.clear()
    assert pool.flush_to_stores() > 0
    assert len(listings) == 1                     # one put, one listing
    entry = pool.bytes_per_block + 4096           # payload + header, generously
    assert peak and max(peak) <= st.capacity_bytes + entry, (max(peak), st.capacity_bytes)
    assert st.used_bytes() <= st.capacity_bytes
    s.free()


# ------------------------------------------------------------ a failing first store
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), TimeoutError("slow"),
                                 RuntimeError("bug")])
def test_failing_first_store_passes_its_entries_to_the_next(exc):
    """A first store whose put fails (full disk, Redis gone) is passed over:
    the evicted blocks reach the store behind it, which serves the next hit;
    one StoreWarning says what happened to the first."""
    from _stores_support import FailingStore, check_hit, flush_pool
    broken = FailingStore(1 << 20, exc, ("put",))
    behind = kvcore.HostStore(1 << 20)
    pool = make_pool(stores=[broken, behind])
    with pytest.warns(kvcore.StoreWarning, match="prefix store 0") as record:
        run(pool, PROMPT)
        flush_pool(pool)
    assert len(record) == 1
    assert len(broken) == 0 and len(behind) == 4
    st = pool.stats()["stores"]
    assert st[0]["failures"] == 1 and st[0]["puts"] == 0
    assert st[1]["puts"] == 4
    check_hit(pool, PROMPT, 4)
    assert pool.stats()["stores"][1]["hits"] == 4
    pool.debug.check()


def test_failing_store_in_the_middle_passes_its_drops_on():
    """Entries the first store drops skip a failing second store and land in the third."""
    from _stores_support import FailingStore, flush_pool
    first = kvcore.HostStore(1)           # keeps nothing: drops every entry
    broken = FailingStore(1 << 20, RuntimeError("bug"), ("put",))
    last = kvcore.HostStore(1 << 20)
    pool = make_pool(stores=[first, broken, last])
    with pytest.warns(kvcore.StoreWarning, match="prefix store 1"):
        run(pool, PROMPT)
        flush_pool(pool)
    assert len(first) == 0 and len(broken) == 0 and len(last) == 4


# ------------------------------------------------------------ DiskStore temporary files
def test_disk_store_removes_temporary_files_of_dead_writers(tmp_path):
    """A writer killed between writing its temporary file and renaming it
    leaves ``.tmp-*``: a trim (after a put) or a new store on the directory
    removes those not modified for ``stale_tmp_seconds``, and leaves young
    ones (a writer may be working on them)."""
    store = kvcore.DiskStore(tmp_path, 1 << 20)
    sub = tmp_path / "ab"
    sub.mkdir()
    old, young = sub / ".tmp-1-2-0123456789abcdef", sub / ".tmp-3-4-fedcba9876543210"
    for f in (old, young):
        f.write_bytes(b"x" * 1000)
    past = time.time() - store.stale_tmp_seconds - 5
    os.utime(old, (past, past))
    kvcore.DiskStore(tmp_path, 1 << 20)          # opening the directory cleans up
    assert not old.exists() and young.exists()
    os.utime(young, (past, past))
    pool = make_pool(stores=[store])
    run(pool, PROMPT)
    from _stores_support import flush_pool
    flush_pool(pool)                             # puts, then trims
    assert not young.exists()
    assert len(store) == 4
    assert store.used_bytes() == sum(p.stat().st_size for p in tmp_path.rglob("*.kve"))


def test_disk_put_failing_mid_batch_hands_on_what_it_trimmed(tmp_path, monkeypatch):
    """A put that trims (the batch passed capacity) and then fails on a
    later entry (disk full) must not lose the entries the trim removed:
    they ride on the exception (``dropped``), and the pool passes them, with
    the batch, to the next store."""
    disk = kvcore.DiskStore(tmp_path, 2500)
    key = lambda i: entry(i, 1000)[0]               # noqa: E731
    disk.put([entry(1, 1000), entry(2, 1000)])
    # the second entry's temporary file cannot be made: a directory holds
    # its name (this thread's), which a writer cannot remove (a real error
    # of the write, as a full disk would be)
    h = key(4).hex()
    blocker = tmp_path / h[-2:] / f".tmp-{os.getpid()}-{threading.get_ident()}-{h[-16:]}"
    blocker.mkdir(parents=True)
    with pytest.raises(OSError) as info:
        disk.put([entry(3, 1000), entry(4, 1000)])
    assert info.value.errno == errno.EISDIR and info.value.filename == str(blocker)
    # the put made room for its 2000 bytes below the low watermark (2250)
    # first, removing both older entries, then failed on its second write
    # (in either order: the two were written within one tick of the file clock)
    assert sorted((k, bytes(v)) for k, v in info.value.dropped) == sorted([entry(1, 1000),
                                                                          entry(2, 1000)])
    assert disk.get([key(1)]) == [None] and disk.get([key(2)]) == [None]
    assert disk.used_bytes() == 1000 and len(disk) == 1


def entry(i, size, fp=None):
    """(key, value) of a well-formed store entry of ``size`` bytes (an
    entry a trim hands on: what is not one never leaves the store)."""
    from kvcore import hashing
    from kvcore.stores import _format
    fp = fp or _format.fingerprint("float16", 4, 2, 2, 8, b"")
    h = bytes([i]) * 16 if i < 256 else i.to_bytes(16, "little")
    tok = np.arange(4, dtype=np.int32) + i
    pay = bytes([i & 0xFF]) * (size - _format.PREFIX_SIZE - 8 - 16)
    value = _format.encode(fp, h, bytes(16), bytes(16),
                           hashing.identity_chain(tok, 4, None, 1)[0], tok, pay)
    return _format.store_key(fp, h), bytes(value)


def test_tiers_pass_on_what_a_failing_put_dropped():
    """The pool side: a first store whose put fails after dropping entries;
    the dropped entries and the batch land in the next store."""
    from _stores_support import check_hit, flush_pool

    class DropsThenFails(kvcore.HostStore):
        def put(self, items):
            items = list(items)
            e = OSError(28, "No space left on device")
            # as if a trim had removed two older entries before the failure
            e.dropped = [entry(90 + i, 1000) for i in range(2)]
            raise e

    behind = kvcore.HostStore(1 << 20)
    pool = make_pool(stores=[DropsThenFails(1 << 20), behind])
    with pytest.warns(kvcore.StoreWarning, match="disk full"):
        run(pool, PROMPT)
        flush_pool(pool)
    assert len(behind) == 6
    assert behind.get([entry(91, 1000)[0]]) == [entry(91, 1000)[1]]
    check_hit(pool, PROMPT, 4)
