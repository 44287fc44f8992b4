"""Prefix stores under hostile conditions: colliding block hashes never
hand back another prefix's KV (entries carry a BLAKE2b identity chain), and
a DiskStore directory written by others (links, FIFOs, devices,
directories, unreadable files named like entries) never makes the pool
read through a link, hang, read without end, lose its capacity bound or
forward foreign bytes to the next store."""
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

import kvcore
from kvcore import hashing
from kvcore.stores import _format

from _stores_support import (GEOMETRY, TESTS, check_hit, expected_kv, flush_pool, make_pool,
                             run)

PROMPT = np.arange(1, 18, dtype=np.int32)       # 17 tokens: 4 full blocks can hit
FP16 = _format.fingerprint("float16", 4, 2, 2, 8, b"")


def forged_pool(num_blocks, stores):
    """A pool on which every block of every sequence hashes alike (the
    documented test seam): only token ids and identities tell blocks apart."""
    g = GEOMETRY
    return kvcore.BlockPool._with_forged_hashes(num_blocks, g["block_size"], g["num_layers"],
                                                g["num_kv_heads"], g["head_dim"],
                                                dtype="float16", stores=stores)


def tokens(*blocks, tail=(999,)):
    return np.array([t for b in blocks for t in b] + list(tail), np.int32)


def bounded(fn, seconds=20):
    """Run ``fn`` on a daemon thread; (finished, result or exception)."""
    out = []

    def body():
        try:
            out.append(("ok", fn()))
        except BaseException as e:   # reported to the test's thread
            out.append(("error", e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return False, None
    kind, value = out[0]
    if kind == "error":
        raise value
    return True, value


# ------------------------------------------------------------ identity (issue 19 item 4)
def test_a_forged_hash_collision_never_loads_another_prefixs_entry():
    """Every block hashes alike, so every entry has the same key: block 1
    of ``y0 x1`` is filed where block 1 of ``x0 x1`` is looked up, with the
    same chained hash, parent hash, salt root and token ids.  Only its
    identity digest (BLAKE2b over the whole prefix) tells it apart: a miss
    with a warning, never B's KV under A's prefix."""
    y0, x0, x1 = range(100, 104), range(300, 304), range(200, 204)
    host = kvcore.HostStore(1 << 20)
    pool = forged_pool(6, [host])
    b = tokens(y0, x1)
    run(pool, b)                                 # y0, x1 cached (B's KV)
    run(pool, tokens(x0, tail=(7,)))             # x0 cached, nothing evicted
    assert len(host) == 0
    # 4 fresh blocks: 3 never used + the LRU head, B's x1, spilled to the store
    e = kvcore.PagedKVCache(pool)
    with warnings.catch_warnings():
        # (allocate looks up its own blocks before it spills what it
        # evicted: the store is still empty then, so no mismatch yet)
        warnings.simplefilter("error")
        e.allocate(np.arange(5000, 5013, dtype=np.int32))
    e.free()                                     # never computed: nothing cached
    assert len(host) == 1
    a = tokens(x0, x1)
    seq = kvcore.PagedKVCache(pool)
    rejected = pool.stats()["stores"][0]["rejected"]
    with pytest.warns(kvcore.StoreWarning, match="mismatch"):
        hit = seq.allocate(a)                    # x0 in the pool; x1 only as B's
    assert hit == 4                              # (today's main: 8, with B's KV)
    assert pool.stats()["stores"][0]["rejected"] == rejected + 1
    for layer, (k, v) in enumerate(expected_kv(pool, a, 4)):
        gk, gv = pool.gather(layer, seq.block_table, 0, 4)
        assert np.array_equal(gk.view(np.uint8), k.view(np.uint8))
        assert np.array_equal(gv.view(np.uint8), v.view(np.uint8))
    seq.free()
    # the entry is B's: B's own prefix (y0 still cached) hits it, bit exact
    check_hit(pool, b, 2)
    pool.debug.check()


def test_forged_collisions_with_salts_and_whole_flushes_stay_apart():
    """A whole prefix flushed in one batch (parents evicted with their
    children) is spilled with the right identities and hits again; another
    salt, or another first block, with the same hashes and later tokens
    never does."""
    host = kvcore.HostStore(1 << 20)
    pool = forged_pool(8, [host])
    run(pool, PROMPT, salt="tenant-a")
    with warnings.catch_warnings():
        # (every lookup on this pool meets the one key's entry: mismatches)
        warnings.simplefilter("ignore", kvcore.StoreWarning)
        flush_pool(pool)
        # every entry shares one key: the store holds the last block spilled
        # (block 0 of the salted prompt, evicted last) ...
        check_hit(pool, PROMPT, 0, salt="tenant-b")
        check_hit(pool, PROMPT, 0)
    # ... which its own salt hits, bit exact
    check_hit(pool, PROMPT, 1, salt="tenant-a")
    pool.debug.check()


def test_identity_chain_is_blake2b_over_salt_and_tokens():
    toks = np.arange(40, dtype=np.int32)
    d = hashing.identity_chain(toks, 8, b"s", 5)
    assert len(d) == 5 and all(len(x) == 32 for x in d)
    assert d == hashing.identity_chain(toks, 8, b"s", 5)
    assert hashing.identity_chain(toks, 8, None, 5) != d
    assert hashing.identity_chain(toks, 8, b"s", 3) == d[:3]
    other = toks.copy()
    other[0] += 1                        # the first token changes every digest
    assert all(x != y for x, y in zip(hashing.identity_chain(other, 8, b"s", 5), d))
    import hashlib
    root = hashlib.blake2b(b"kvcore.salt:s", digest_size=32, person=b"kvcore.iroot.v1").digest()
    h = hashlib.blake2b(root, digest_size=32, person=b"kvcore.ident.v1")
    h.update(toks[:8].astype("<u4").tobytes())
    assert d[0] == h.digest()


def spilled_to_disk(root, capacity_bytes, block):
    """``(disk, pool, key)``: a pool that ran ``PROMPT`` and spilled it into
    a DiskStore at ``root``, and the store key of its block ``block``."""
    disk = kvcore.DiskStore(root, capacity_bytes)
    pool = make_pool(stores=[disk])
    run(pool, PROMPT)
    flush_pool(pool)
    return disk, pool, _format.store_key(FP16, kvcore.block_hashes(PROMPT, 4)[block])


def test_an_old_version_entry_is_a_clean_miss(tmp_path):
    disk, pool, key = spilled_to_disk(tmp_path, 1 << 22, 0)
    (value,) = disk.get([key])
    old = bytearray(value)
    old[4:6] = (1).to_bytes(2, "little")        # a version 1 header
    disk.put([(key, bytes(old))])
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, PROMPT, 0)
    assert _format.entry_size(bytes(old[:_format.HEAD_PROBE])) is None
    assert _format.entry_size(bytes(value[:_format.HEAD_PROBE])) == len(value)


# ------------------------------------------------------------ hostile directories
def entry_path(root, key):
    h = key.hex()
    return root / h[-2:] / (h + ".kve")


def fake_key(i):
    return bytes([i]) * 32


def old(path):
    """Make ``path`` (not what it links to) the least recently used."""
    os.utime(path, ns=(10**9, 10**9), follow_symlinks=False)


class RecordingStore(kvcore.HostStore):
    """A HostStore that records every value put into it."""

    def __init__(self, capacity_bytes):
        super().__init__(capacity_bytes)
        self.values = []

    def put(self, items):
        items = list(items)
        self.values.extend(bytes(v) for _, v in items)
        return super().put(items)


def one_entry_bytes(pool):
    return _format.PREFIX_SIZE + 8 + 4 * pool.block_size + pool.bytes_per_block


@pytest.mark.parametrize("planted", ["link-to-file", "link-to-entry", "garbage-file"])
def test_a_planted_file_never_reaches_the_next_store(tmp_path, planted):
    """Item 5: a link named like an entry is never read through (the link
    is removed, its target untouched); a regular file that is not an
    entry is removed without being forwarded; what does move on is
    verified first."""
    d = tmp_path / "disk"
    probe_pool = make_pool()
    disk = kvcore.DiskStore(d, 3 * one_entry_bytes(probe_pool))
    nxt = RecordingStore(1 << 22)
    pool = make_pool(stores=[disk, nxt])
    secret = tmp_path / "secret"
    if planted == "link-to-entry":
        # a valid entry of another store (same layout, no HMAC): a link to it
        # must not be read either
        other = make_pool(stores=[kvcore.DiskStore(tmp_path / "other", 1 << 22)])
        run(other, PROMPT + 1000)
        flush_pool(other)
        src = sorted((tmp_path / "other").rglob("*.kve"))[0]
        secret.write_bytes(src.read_bytes())
        key = bytes.fromhex(src.name[:-4])
    else:
        secret.write_bytes(b"secret bytes of another user\n" * 40)
        key = fake_key(7)
    p = entry_path(d, key)
    p.parent.mkdir(parents=True, exist_ok=True)
    if planted == "garbage-file":
        p.write_bytes(secret.read_bytes())
    else:
        p.symlink_to(secret)
        old(secret)
    old(p)
    before = secret.read_bytes()
    run(pool, PROMPT)
    flush_pool(pool)                 # 4 entries into a 3-entry disk: trims
    assert not os.path.lexists(p)
    assert secret.read_bytes() == before            # the target is untouched
    assert before not in nxt.values
    for v in nxt.values:                            # only verified entries moved on
        _format.parse(v, FP16)
    assert disk.used_bytes() <= disk.capacity_bytes
    check_hit(pool, PROMPT, 4)
    pool.debug.check()


def test_a_fifo_named_like_an_entry_never_hangs_a_lookup(tmp_path):
    """Item 6: ``get`` of an entry that is a FIFO (nobody writing) returns
    a miss at once instead of blocking in open() for ever."""
    disk, pool, key = spilled_to_disk(tmp_path, 1 << 22, 2)
    p = entry_path(tmp_path, key)
    p.unlink()
    os.mkfifo(p)
    try:
        done, hit = bounded(lambda: check_hit(pool, PROMPT, 2))
        assert done, "allocate blocked on a FIFO named like an entry"
        assert disk.contains([key]) == 0
        done, values = bounded(lambda: disk.get([key]))
        assert done and values == [None]
    finally:
        unblock(p)


def test_a_fifo_named_like_an_entry_never_blocks_a_trim(tmp_path):
    """Item 6: the trim (under the directory lock) skips and removes a FIFO
    named like an entry; capacity holds."""
    pool = make_pool()
    size = one_entry_bytes(pool)
    disk = kvcore.DiskStore(tmp_path, 3 * size)
    p = entry_path(tmp_path, fake_key(3))
    p.parent.mkdir(parents=True)
    os.mkfifo(p)
    old(p)
    try:
        done, _ = bounded(lambda: disk.put([(fake_key(10 + i), bytes(size)) for i in range(5)]))
        assert done, "a trim blocked on a FIFO named like an entry"
        assert not os.path.lexists(p)
        assert disk.used_bytes() <= disk.capacity_bytes
    finally:
        unblock(p)


def unblock(fifo):
    """Release a reader blocked opening ``fifo`` (today's main), if any."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def test_a_link_to_dev_zero_never_makes_a_trim_read_without_end(tmp_path):
    """Item 7: a ``*.kve`` link to /dev/zero (and a device named like an
    entry is never read).  Runs in a child with a 1 GiB address-space limit
    so that a reader without bound fails there, not on this machine.  Under
    AddressSanitizer (.ci/sanitize preloads it), whose shadow memory needs far
    more address space than that, ASan's own RSS limit bounds the child."""
    env = dict(os.environ)
    asan = "libasan" in env.get("LD_PRELOAD", "")
    if asan:
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS", ""),
                                                     "hard_rss_limit_mb=1024"]))
    limit = "" if asan else "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))"
    script = textwrap.dedent(f"""
        import os, resource, sys, warnings
        sys.path.insert(0, {TESTS!r})
        {limit}
        warnings.simplefilter("error")
        import kvcore
        d = {str(tmp_path)!r}
        disk = kvcore.DiskStore(d, 3 * 4096)
        key = bytes([5]) * 32
        p = os.path.join(d, key.hex()[-2:], key.hex() + ".kve")
        os.makedirs(os.path.dirname(p))
        os.symlink("/dev/zero", p)
        os.utime(p, ns=(10**9, 10**9), follow_symlinks=False)
        dropped = disk.put([(bytes([i]) * 32, bytes(4096)) for i in range(10, 15)])
        assert not os.path.lexists(p), "the link stayed"
        assert disk.used_bytes() <= disk.capacity_bytes
        assert all(len(v) == 4096 for _, v in dropped), [len(v) for _, v in dropped]
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_directory_or_an_unreadable_file_named_like_an_entry_never_stops_trims(tmp_path):
    """Item 8: a directory named ``x.kve`` and an unreadable entry file
    (chmod 000; the tests may run as root, who reads it anyway) are passed
    over or removed, never an error of every later put; capacity holds."""
    pool = make_pool()
    size = one_entry_bytes(pool)
    cap = 4 * size
    disk = kvcore.DiskStore(tmp_path, cap)
    bad_dir = entry_path(tmp_path, fake_key(1))
    bad_dir.mkdir(parents=True)
    (bad_dir / "inside").write_bytes(b"x" * 5000)
    old(bad_dir)
    unreadable = entry_path(tmp_path, fake_key(2))
    unreadable.parent.mkdir(parents=True, exist_ok=True)
    unreadable.write_bytes(bytes(size))
    unreadable.chmod(0)
    old(unreadable)
    for i in range(30):
        disk.put([(bytes([50 + i]) * 32, bytes(size))])
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kve") if f.is_file())
        assert on_disk <= cap, (i, on_disk)
    assert disk.used_bytes() <= cap
    assert bad_dir.is_dir() and (bad_dir / "inside").read_bytes() == b"x" * 5000
    assert not unreadable.exists()                 # ours: removed, not handed on
    # and the pool on top keeps working
    pool = make_pool(stores=[disk])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(pool, PROMPT)
        flush_pool(pool)
        check_hit(pool, PROMPT, 4)


def test_a_link_in_place_of_a_subdirectory_is_not_followed(tmp_path):
    """The two-hex-digit subdirectory replaced by a link elsewhere: entries
    there are neither listed, nor read, nor trimmed."""
    disk = kvcore.DiskStore(tmp_path / "d", 1 << 22)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    key = fake_key(9)
    name = key.hex() + ".kve"
    (elsewhere / name).write_bytes(b"not yours")
    (tmp_path / "d" / key.hex()[-2:]).symlink_to(elsewhere)
    assert disk.contains([key]) == 0
    assert disk.get([key]) == [None]
    assert len(disk) == 0 and disk.used_bytes() == 0
    assert (elsewhere / name).read_bytes() == b"not yours"
    # a put of that key writes nothing there: the entry goes to the next tier
    assert disk.put([(key, b"mine")]) == [(key, b"mine")]
    assert sorted(os.listdir(elsewhere)) == [name]
    assert (elsewhere / name).read_bytes() == b"not yours"


def test_a_directory_at_an_entrys_name_passes_the_entry_on(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 1 << 22)
    p = entry_path(tmp_path, fake_key(4))
    p.mkdir(parents=True)
    assert disk.put([(fake_key(4), b"v"), (fake_key(5), b"w")]) == [(fake_key(4), b"v")]
    assert p.is_dir() and disk.get([fake_key(5)])[0].tobytes() == b"w"


def test_an_entry_filed_under_another_key_never_reaches_the_next_store(tmp_path):
    """A valid entry copied (as a regular file) under the key of another
    block: the trim hands it on, the pool's check before forwarding drops it."""
    d = tmp_path / "disk"
    probe_pool = make_pool()
    disk = kvcore.DiskStore(d, 3 * one_entry_bytes(probe_pool))
    nxt = RecordingStore(1 << 22)
    pool = make_pool(stores=[disk, nxt])
    other = make_pool(stores=[kvcore.DiskStore(tmp_path / "other", 1 << 22)])
    run(other, PROMPT + 1000)
    flush_pool(other)
    value = sorted((tmp_path / "other").rglob("*.kve"))[0].read_bytes()
    p = entry_path(d, fake_key(8))
    p.parent.mkdir(parents=True)
    p.write_bytes(value)
    old(p)
    with pytest.warns(kvcore.StoreWarning, match="mismatch"):
        run(pool, PROMPT)
        flush_pool(pool)
    assert not p.exists()
    assert value not in nxt.values
    check_hit(pool, PROMPT, 4)


@pytest.mark.parametrize("capacity_bytes", [1 << 16, 1 << 40])
def test_a_file_larger_than_an_entry_is_never_read_whole(tmp_path, capacity_bytes):
    """A regular file named like an entry, larger than the store's capacity
    (no entry of the store can be), or within a large store's capacity but
    longer than its header says the entry is (a sparse file costs its
    planter no disk): a lookup reads its head only and calls it corrupt,
    never reading (and holding in memory) the whole file; a trim removes
    it without reading it."""
    disk, pool, key = spilled_to_disk(tmp_path, capacity_bytes, 0)
    p = entry_path(tmp_path, key)
    with open(p, "r+b") as f:            # a sparse file of 64 MiB behind a valid head
        f.truncate(1 << 26)
    (value,) = disk.get([key])
    assert len(value) == _format.HEAD_PROBE
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, PROMPT, 0)
    if capacity_bytes < 1 << 26:
        disk.put([(fake_key(1), b"x")])      # a trim: the big file goes, unread
        assert not p.exists()
        assert disk.used_bytes() <= disk.capacity_bytes


def test_a_file_as_long_as_its_header_says_is_read_only_as_far_as_an_entry_reaches(
        tmp_path, monkeypatch):
    """A file of real bytes whose header promises its whole length, within a
    large store's capacity (a store shared by pools of larger blocks): the
    pool's lookup reads at most its own largest entry's bytes of it
    (``get_bounded``), its head, and calls it corrupt."""
    disk, pool, key = spilled_to_disk(tmp_path, 1 << 40, 0)
    p = entry_path(tmp_path, key)
    (value,) = disk.get([key])
    grown = bytearray(value) + bytearray(8 << 20)
    grown[112:120] = (len(grown) - len(value) + int.from_bytes(value[112:120], "little")
                      ).to_bytes(8, "little")          # the header promises every byte
    p.write_bytes(bytes(grown))
    assert _format.entry_size(bytes(grown[:_format.HEAD_PROBE])) == len(grown)
    assert len(disk.get([key])[0]) == len(grown)          # get: the whole file, as promised
    assert len(disk.get_bounded([key], len(value))[0]) == _format.HEAD_PROBE
    with pytest.raises(ValueError, match="max_bytes must be a positive int, got -1"):
        disk.get_bounded([key], -1)

    def whole(self, keys):
        raise AssertionError("the pool read a file whole")

    monkeypatch.setattr(kvcore.DiskStore, "get", whole)
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, PROMPT, 0)
    assert pool.stats()["stores"][0]["rejected"] == 1
    pool.debug.check()


# ------------------------------------------------------------ PATH/.lock
def spill_many(pool, n, base=50_000):
    """``n`` distinct prompts through ``pool``, each evicting the last's
    blocks into its stores; then wait for the store worker."""
    for i in range(n):
        run(pool, np.arange(base + 100 * i, base + 100 * i + 17, dtype=np.int32))
    assert pool.wait_spills(60)


def plant_lock(lock, how, target):
    lock.unlink()
    if how == "directory":
        lock.mkdir()
    elif how == "dangling symlink":
        lock.symlink_to(target)
    elif how == "fifo":
        os.mkfifo(lock)
    else:                                     # pragma: no cover
        raise ValueError(how)


@pytest.mark.parametrize("how, condition", [("directory", "I/O error"),
                                            ("dangling symlink", "I/O error"),
                                            ("fifo", "I/O error")])
def test_a_lock_file_that_cannot_be_locked_stops_the_writes(tmp_path, how, condition):
    """PATH/.lock a directory, a dangling link, a FIFO: every put writes
    nothing (the directory never outgrows capacity_bytes; a link's target
    is never created; a FIFO never blocks), warns once, counts failures,
    and lookups still hit what the store held."""
    root = tmp_path / "d"
    disk = kvcore.DiskStore(root, 20_000)
    pool = make_pool(num_blocks=5, stores=[disk])
    run(pool, PROMPT)
    flush_pool(pool)                          # PROMPT's 4 blocks on disk
    held = len(disk)
    assert held == 4
    plant_lock(root / ".lock", how, tmp_path / "target")
    with pytest.warns(kvcore.StoreWarning, match=condition):
        ok, _ = bounded(lambda: spill_many(pool, 60), 120)
        assert ok, "a put blocked on PATH/.lock"
    assert not (tmp_path / "target").exists()
    st = pool.stats()["stores"][0]
    assert st["failures"] > 0 and st["puts"] == 4
    assert len(disk) == held and disk.used_bytes() <= disk.capacity_bytes
    check_hit(pool, PROMPT, 4)                # reads go on
    pool.debug.check()


@pytest.mark.forks
def test_a_lock_file_owned_by_another_user_stops_the_writes(tmp_path):
    """PATH/.lock a file this process cannot open (another user's, mode
    0600): the store writes nothing.  As root, a forked child that became
    ``nobody`` meets root's file; otherwise our own file with mode 000."""
    import stat
    import tempfile

    root = tempfile.mkdtemp(prefix="kvcore-lock-")     # (world-traversable, unlike tmp_path)
    try:
        os.chmod(root, 0o777)
        lock = os.path.join(root, ".lock")
        with open(lock, "wb"):
            pass
        os.chmod(lock, 0o600 if os.geteuid() == 0 else 0o000)

        def attempt():
            disk = kvcore.DiskStore(root, 20_000)
            pool = make_pool(num_blocks=5, stores=[disk])
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                spill_many(pool, 30)
                pool.close(30)
            conditions = {str(x.message).split(": ")[1] for x in w
                          if issubclass(x.category, kvcore.StoreWarning)}
            return (len(disk), pool.stats()["stores"][0]["failures"], conditions)

        if os.geteuid() != 0:
            entries, failures, conditions = attempt()
        else:
            r, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    import signal
                    signal.alarm(120)
                    os.setgid(65534)
                    os.setuid(65534)                   # nobody: root's 0600 file is closed to it
                    entries, failures, conditions = attempt()
                    os.write(wfd, repr((entries, failures, sorted(conditions))).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(wfd)
            _, status = os.waitpid(pid, 0)
            with os.fdopen(r, "rb") as f:
                out = f.read().decode()
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, out)
            entries, failures, conditions = eval(out)   # (a tuple of ints and strs we wrote)
        assert entries == 0 and failures > 0
        assert "permission denied" in conditions
        assert stat.S_ISREG(os.lstat(lock).st_mode)
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
