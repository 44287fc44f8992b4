"""Bounded shutdown of a pool's stores: ``close(timeout)``, ``with pool:``,
and a DiskStore that trims once per batch (so a backlog drains in time
proportional to the entries, not to entries x directory size)."""
import threading
import time

import numpy as np
import pytest

import kvcore
import kvcore.pool

from _stores_support import make_pool, run


class SlowDisk(kvcore.DiskStore):
    """A DiskStore on a slow medium: every put costs ``delay`` seconds more."""

    delay = 0.2

    def put(self, items):
        time.sleep(self.delay)
        return super().put(items)


class GatedDisk(kvcore.DiskStore):
    """A DiskStore whose puts wait until the test opens ``gate`` (at most
    30 s): once ``entered`` is set, the store worker is held inside its
    first put, so whatever is spilled afterwards waits in the queue."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put(self, items):
        self.entered.set()
        self.gate.wait(30)
        return super().put(items)


def spill_for(pool, seconds, first=0):
    """A request thread's work: spill into ``pool``'s stores for ``seconds``
    (distinct prompts, each evicting the last one's cached blocks)."""
    stop = time.monotonic() + seconds
    i = first
    while time.monotonic() < stop:
        run(pool, np.arange(10000 * i, 10000 * i + 4 * 7 + 1, dtype=np.int32))
        i += 1
    return i - first


def spilling_thread(pool, seconds):
    t = threading.Thread(target=spill_for, args=(pool, seconds), daemon=True)
    t.start()
    time.sleep(min(1.0, seconds / 3))         # a backlog builds up
    return t


def spilling_pool(tmp_path, disk_cls=kvcore.DiskStore):
    disk = disk_cls(tmp_path, 1 << 20)                  # a 1 MiB DiskStore
    return make_pool(num_blocks=16, stores=[disk]), disk


def held_backlog(pool, disk):
    """A request thread spilling into ``disk`` while its worker is held in
    the first put, and a few more spills from this thread: a backlog that
    is certainly queued (on a busy machine the thread alone may not build
    one in time)."""
    t = spilling_thread(pool, 3.0)
    assert disk.entered.wait(30), "the store worker never started a put"
    assert spill_for(pool, 0.2, first=10**5) >= 1
    return t


def test_close_with_a_timeout_returns_within_it_and_counts_what_it_dropped(tmp_path):
    """A request thread spilling into a 1 MiB DiskStore whose put is held:
    close(0.5) returns within its bound, saying not everything was written,
    and counts what it dropped."""
    pool, disk = spilling_pool(tmp_path, GatedDisk)
    try:
        t = held_backlog(pool, disk)
        start = time.monotonic()
        done = pool.close(timeout=0.5)
        took = time.monotonic() - start
    finally:
        disk.gate.set()
    t.join()
    assert took < 0.5 + 1.0, took                       # (one busy machine's slack)
    assert done is False
    st = pool.stats()["stores"][0]
    assert st["spills_dropped"] > 0
    # what was dropped is gone from the queue: nothing waits for it
    assert pool.wait_spills(30)
    assert 0 < len(disk) <= pool.stats()["stores"][0]["puts"]
    # the pool stays usable, and its stores too
    fresh = np.arange(2 * 10**9, 2 * 10**9 + 29, dtype=np.int32)
    assert run(pool, fresh)[0] == 0
    assert pool.close(30) is True
    pool.debug.check()


def test_a_request_thread_spilling_into_a_1_mib_disk_store_then_close_is_bounded(tmp_path):
    pool, disk = spilling_pool(tmp_path)
    t = spilling_thread(pool, 4.0)
    start = time.monotonic()
    pool.close(timeout=2.0)
    assert time.monotonic() - start < 2.0 + 1.0
    t.join()
    assert pool.close(30) is True
    assert disk.used_bytes() <= disk.capacity_bytes
    pool.debug.check()


def test_leaving_a_with_block_waits_at_most_exit_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(kvcore.pool, "EXIT_TIMEOUT", 0.5)
    pool, disk = spilling_pool(tmp_path, GatedDisk)
    try:
        with pool:
            t = held_backlog(pool, disk)
            start = time.monotonic()
        took = time.monotonic() - start
    finally:
        disk.gate.set()
    assert took < 0.5 + 1.0, took
    t.join()
    assert pool.stats()["stores"][0]["spills_dropped"] > 0
    assert pool.wait_spills(30)
    pool.close(30)


def test_close_without_a_timeout_writes_everything(tmp_path):
    pool, disk = spilling_pool(tmp_path, SlowDisk)
    disk.delay = 0.01
    spill_for(pool, 0.5)
    assert pool.close() is True
    assert pool.stats()["stores"][0]["spills_dropped"] == 0
    assert pool.wait_spills(0)


def test_a_disk_store_at_capacity_lists_its_directory_once_per_batch(tmp_path, monkeypatch):
    """A batch of 40 entries into a full DiskStore: one listing (one trim
    to the low watermark), not one per entry."""
    from test_stores_review import entry

    disk = kvcore.DiskStore(tmp_path, 40_000)
    disk.put([entry(i, 1000) for i in range(40)])       # full
    listings = []
    real = kvcore.DiskStore._listing

    def count(self, *a, **kw):
        listings.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(kvcore.DiskStore, "_listing", count)
    dropped = disk.put([entry(100 + i, 1000) for i in range(40)])
    assert len(listings) == 1
    assert len(dropped) == 40                                # the older ones, handed on
    monkeypatch.setattr(kvcore.DiskStore, "_listing", real)
    assert disk.used_bytes() <= disk.capacity_bytes
    assert len(disk) == 40


def test_a_trim_frees_room_to_the_low_watermark(tmp_path):
    from test_stores_review import entry

    disk = kvcore.DiskStore(tmp_path, 10_000)
    disk.put([entry(i, 1000) for i in range(10)])       # exactly full
    assert disk.used_bytes() == 10_000
    disk.put([entry(50, 1000)])                         # must trim: to 9000 - 1000, then write
    assert disk.used_bytes() == int(10_000 * disk.low_watermark)
    before = disk.used_bytes()
    disk.put([entry(51, 1000)])                         # room left: nothing removed
    assert disk.used_bytes() == before + 1000


@pytest.mark.parametrize("timeout", [None, 0, 0.1])
def test_close_without_stores_returns_true(timeout):
    assert make_pool().close(timeout) is True
