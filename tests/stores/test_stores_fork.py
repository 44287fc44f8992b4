"""A pool with stores across ``fork()``, whatever its threads are doing.

The fork happens while a kvcore thread (the prefetch worker) or a request
thread holds the pool's lock (copying out what its allocate evicted); the
child's probe, allocate, wait_spills, flush_to_stores and close must
complete promptly.  Each child runs under an alarm, so a regression (a
child waiting for ever on a lock its parent's thread held) fails instead of
hanging the suite.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

import kvcore

from kvcore._store_port import StorePort

from _stores_support import make_pool, run

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
              pytest.mark.forks]

BS = 4
CHILD_ALARM = 60          # seconds a child may take before it is killed
SLOW = 10.0               # seconds one call of the child may take (a loaded machine)


class Gate:
    """Once ``holder`` (a thread name) is set, the pool's copy-out of what an
    operation evicted (``StorePort.copy_out_evicted``, called with the
    pool's lock held) waits at a gate on that thread: it then holds the
    pool's lock until the gate opens."""

    def __init__(self):
        self.holder = None
        self.entered = threading.Event()
        self.gate = threading.Event()


@pytest.fixture
def gate(monkeypatch):
    g = Gate()
    real = StorePort.copy_out_evicted

    def copy_out_evicted(port):
        if g.holder is not None and threading.current_thread().name == g.holder:
            g.entered.set()
            g.gate.wait(20)
        return real(port)

    # (before any pool exists: a pool's sequences take the method when bound)
    monkeypatch.setattr(StorePort, "copy_out_evicted", copy_out_evicted)
    return g


def prompt(base, n_blocks):
    return np.arange(base, base + n_blocks * BS + 1, dtype=np.int32)


def fork_and_check(pool, probe_tokens, handle=None):
    """Fork; in the child, time probe, allocate, wait_spills, flush_to_stores
    and close (each must return promptly and right) and exit 0 or a code
    naming what failed; returns (exit status, the child's report)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: no pytest here, only os._exit
        os.close(r)
        code, report = 9, "?"
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_ALARM)
            times = {}
            t = time.monotonic()
            assert pool.probe(probe_tokens)["blocks_total"] > 0
            times["probe"] = time.monotonic() - t
            t = time.monotonic()
            seq = kvcore.PagedKVCache(pool)
            seq.allocate(np.arange(90000, 90000 + 3 * BS, dtype=np.int32))
            seq.free()
            times["allocate"] = time.monotonic() - t
            t = time.monotonic()
            assert pool.wait_spills(15), "wait_spills timed out"
            times["wait_spills"] = time.monotonic() - t
            t = time.monotonic()
            pool.flush_to_stores(15)
            times["flush"] = time.monotonic() - t
            t = time.monotonic()
            assert pool.close(15), "close dropped spills"
            times["close"] = time.monotonic() - t
            if handle is not None:
                assert handle.done(), "the parent's prefetch is not done in the child"
            pool.debug.check()
            slow = {k: v for k, v in times.items() if v > SLOW}
            code, report = (3, f"slow: {slow}") if slow else (0, repr(times))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            code, report = 1, f"{type(e).__name__}: {e}"
        finally:
            os.write(w, report.encode()[:4000])
            os.close(w)
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        report = f.read().decode()
    return status, report


def stored_pool(tmp_path):
    """A pool with a HostStore and a DiskStore (written by the store
    worker), a prefix in the stores and the cache full of other blocks (an
    allocate of it evicts)."""
    pool = make_pool(num_blocks=24, stores=[kvcore.HostStore(1 << 20),
                                           kvcore.DiskStore(tmp_path, 1 << 20)])
    run(pool, prompt(0, 8))           # 8 blocks, cached
    run(pool, prompt(1000, 23))       # evicts them into the stores, fills the cache
    assert pool.probe(prompt(0, 8))["store_hit_tokens"] > 0
    return pool


@pytest.mark.parametrize("holder", ["prefetch", "request"])
def test_fork_while_a_thread_holds_the_pool_lock(tmp_path, holder, gate):
    pool = stored_pool(tmp_path)
    handle, thread = None, None
    if holder == "prefetch":
        gate.holder = "kvcore-store-prefetch"
        handle = pool.prefetch(prompt(0, 8))      # its allocate evicts: a put, lock held
    else:
        gate.holder = "request"

        def request():
            run(pool, prompt(5000, 10))           # its allocate evicts
        thread = threading.Thread(target=request, name="request", daemon=True)
        thread.start()
    assert gate.entered.wait(20), "the thread never reached the store"
    # the gate opens a moment later, while the fork is under way
    threading.Timer(0.5, gate.gate.set).start()
    status, report = fork_and_check(pool, prompt(0, 8), handle)
    gate.holder = None
    gate.gate.set()
    if thread is not None:
        thread.join(20)
    if handle is not None:
        assert handle.wait(20)
    assert pool.close(20)
    pool.debug.check()
    assert os.WIFEXITED(status), f"the child was killed (signal {os.WTERMSIG(status)}): " \
                                 "it hung on a lock held at the fork"
    assert os.WEXITSTATUS(status) == 0, report


def test_forks_of_a_program_with_a_request_thread_and_a_prefetch(tmp_path):
    """Forks at arbitrary moments of a request thread (allocate, append,
    commit, free, evicting into a DiskStore) and prefetches: every child
    works."""
    disk = kvcore.DiskStore(tmp_path, 1 << 20)
    disk.max_pending_bytes = 64 << 10     # (a child drains at most this backlog)
    disk.lock_timeout = 10.0              # (the parent's worker trims there too)
    pool = make_pool(num_blocks=16, stores=[kvcore.HostStore(1 << 16), disk])
    stop = threading.Event()

    def request():
        i = 0
        while not stop.is_set():
            run(pool, prompt(10000 + 100 * (i % 50), 5))
            i += 1

    t = threading.Thread(target=request, daemon=True)
    t.start()
    try:
        for k in range(8):
            h = pool.prefetch(prompt(10000 + 100 * (k % 50), 5))
            time.sleep(0.05)
            status, report = fork_and_check(pool, prompt(10000, 5))
            assert os.WIFEXITED(status), f"child {k} was killed: it hung on a lock"
            assert os.WEXITSTATUS(status) == 0, report
            h.wait(20)
    finally:
        stop.set()
        t.join(20)
    assert pool.close(20)
    pool.debug.check()


class SlowHost(kvcore.HostStore):
    """A HostStore whose get waits at a gate on the prefetch worker (no
    pool lock held there): a prefetch stays in flight."""

    def __init__(self, capacity_bytes):
        super().__init__(capacity_bytes)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def get(self, keys):
        if threading.current_thread().name == "kvcore-store-prefetch":
            self.entered.set()
            self.gate.wait(20)
        return super().get(keys)


def test_a_forked_child_cancels_the_parents_prefetches():
    host = SlowHost(1 << 20)
    pool = make_pool(num_blocks=24, stores=[host])
    run(pool, prompt(0, 8))
    run(pool, prompt(1000, 23))        # prompt 0's blocks: in the store only
    h = pool.prefetch(prompt(0, 8))
    assert host.entered.wait(20)       # in flight, loading
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(CHILD_ALARM)
        ok = h.wait(2) and h.done() and h.cancelled() and pool.close(5)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"1"
    host.gate.set()
    assert h.wait(20) and not h.cancelled()     # the parent's own goes on
    assert h.blocks_ready == 8
    assert pool.close(20)
