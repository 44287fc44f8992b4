"""BlockPool.prefetch: a prompt's stored blocks loaded into the pool in the
background (the store worker), for the allocate that follows."""
import threading
import time

import numpy as np
import pytest

import kvcore

from _stores_support import (FailingStore, RedisServer, check_hit, flush_pool, make_pool,
                             run)

PROMPT = np.arange(1, 42, dtype=np.int32)      # 41 tokens: 10 full blocks + 1


class CountingStore(kvcore.HostStore):
    """A HostStore that records which thread asks it what, and can hold its
    ``get`` until released (a slow tier)."""

    in_memory = False       # (as a disk or a Redis: spills go via the worker)

    def __init__(self, capacity_bytes):
        super().__init__(capacity_bytes)
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def contains(self, keys):
        self.calls.append(("contains", threading.get_ident()))
        return super().contains(keys)

    def get(self, keys):
        self.calls.append(("get", threading.get_ident()))
        self.entered.set()
        assert self.gate.wait(30)
        return super().get(keys)


def stored_pool(num_blocks=16, store=None):
    store = store or CountingStore(1 << 22)
    pool = make_pool(num_blocks=num_blocks, stores=[store])
    run(pool, PROMPT)
    flush_pool(pool)            # the prompt's blocks now live only in the store
    assert pool.probe(PROMPT)["store_hit_tokens"] == 40
    store.calls.clear()
    return pool, store


def test_prefetch_then_allocate_hits_without_store_io_on_the_allocating_thread():
    pool, store = stored_pool()
    h = pool.prefetch(PROMPT)
    assert h.wait(30) and h.done() and not h.cancelled()
    assert h.blocks_ready == 10
    assert store.calls and all(t != threading.get_ident() for _, t in store.calls)
    store.calls.clear()
    check_hit(pool, PROMPT, 10)                 # bit exact, from the pool's cache
    assert store.calls == []                    # no store I/O by this thread
    assert pool.stats()["stores"][0]["hits"] == 10
    pool.debug.check()


def test_a_never_used_prefetch_leaves_its_blocks_cached_and_evictable():
    pool, _ = stored_pool()
    h = pool.prefetch(PROMPT)
    assert h.wait(30)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 10
    assert pool.num_free_blocks == pool.num_blocks      # evictable: all free
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(np.arange(500, 500 + 16 * 4, dtype=np.int32))   # takes them all
    seq.free()
    pool.debug.check()


def test_allocate_during_a_prefetch_takes_what_arrived_and_loads_the_rest():
    pool, store = stored_pool(num_blocks=24)
    store.gate.clear()
    h = pool.prefetch(PROMPT)
    assert store.entered.wait(30)               # the prefetch is inside get
    assert not h.done()
    got = []
    t = threading.Thread(target=lambda: got.append(check_hit(pool, PROMPT, 10)))
    t.start()
    # (the allocate cancels the prefetch before its own gated get: wait for
    # that, not for a fixed time a busy machine may not keep)
    deadline = time.monotonic() + 30
    while not h.cancelled() and time.monotonic() < deadline:
        time.sleep(0.005)
    store.gate.set()
    t.join(30)
    assert got == [None]
    assert h.wait(30)
    assert h.cancelled()        # the allocate overtook it: no second load of the same blocks
    pool.debug.check()
    assert pool.num_used_blocks == 0


def test_an_allocate_of_another_prompt_leaves_a_running_prefetch_alone():
    pool, store = stored_pool(num_blocks=24)
    store.gate.clear()
    h = pool.prefetch(PROMPT)
    assert store.entered.wait(30)
    run(pool, np.arange(300, 341, dtype=np.int32))   # (its lookup finds nothing)
    store.gate.set()
    assert h.wait(30) and not h.cancelled() and h.blocks_ready == 10
    pool.debug.check()


def test_cancel_mid_load_is_safe_and_leaves_a_consistent_pool():
    pool, store = stored_pool()
    store.gate.clear()
    h = pool.prefetch(PROMPT)
    assert store.entered.wait(30)
    assert h.cancel() is True and h.cancelled()
    store.gate.set()
    assert h.wait(30)
    assert h.cancel() is False                  # idempotent, already done
    assert h.blocks_ready <= 10
    pool.debug.check()
    assert pool.num_used_blocks == 0
    check_hit(pool, PROMPT, 10)                 # the rest still loads, bit exact


def test_cancel_before_it_starts_never_runs():
    pool, store = stored_pool()
    store.gate.clear()
    first = pool.prefetch(PROMPT)
    assert store.entered.wait(30)
    second = pool.prefetch(PROMPT)              # queued behind the first
    assert second.cancel() is True and second.done() and second.blocks_ready == 0
    store.gate.set()
    assert first.wait(30)
    pool.debug.check()


def test_prefetch_of_an_unknown_prompt_loads_nothing():
    pool, store = stored_pool()
    h = pool.prefetch(np.arange(900, 941, dtype=np.int32))
    assert h.wait(30) and h.blocks_ready == 0
    assert pool.num_cached_blocks == 0 and pool.num_used_blocks == 0
    assert all(name == "contains" for name, _ in store.calls)


def test_prefetch_counts_the_pools_own_hit():
    pool = make_pool(num_blocks=16, stores=[kvcore.HostStore(1 << 20)])
    run(pool, PROMPT)                           # cached in the pool, not in the store
    h = pool.prefetch(PROMPT)
    assert h.wait(30) and h.blocks_ready == 10
    pool.debug.check()


def test_prefetch_on_a_full_pool_gives_up_cleanly():
    pool, store = stored_pool()
    holders = []
    for j in range(4):
        s = kvcore.PagedKVCache(pool)
        s.allocate(np.arange(700 + 16 * j, 716 + 16 * j, dtype=np.int32))
        holders.append(s)
    assert pool.num_free_blocks == 0
    h = pool.prefetch(PROMPT)
    assert h.wait(30) and h.blocks_ready == 0
    pool.debug.check()
    for s in holders:
        s.free()
    assert pool.num_used_blocks == 0


def test_close_with_a_prefetch_in_flight():
    pool, store = stored_pool()
    store.gate.clear()
    h = pool.prefetch(PROMPT)
    assert store.entered.wait(30)
    threading.Timer(0.2, store.gate.set).start()
    pool.close()                                # cancels it, waits for the worker
    assert h.done() and h.cancelled()
    pool.debug.check()
    assert pool.num_used_blocks == 0
    pool.close()                                # idempotent
    h2 = pool.prefetch(PROMPT)                  # the pool stays usable
    assert h2.wait(30)
    pool.debug.check()


def test_prefetch_with_allocate_and_free_from_other_threads():
    pool, store = stored_pool(num_blocks=24)
    errors = []

    def churn(base):
        try:
            for j in range(20):
                run(pool, np.arange(base + 20 * j, base + 20 * j + 9, dtype=np.int32))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(10000 * (k + 1),)) for k in range(2)]
    for t in threads:
        t.start()
    handles = [pool.prefetch(PROMPT) for _ in range(3)]
    for t in threads:
        t.join(60)
    assert all(h.wait(30) for h in handles)
    assert not errors
    pool.debug.check()
    check_hit(pool, PROMPT, 10)
    assert pool.num_used_blocks == 0


def test_prefetch_with_a_salt_loads_only_that_salts_blocks():
    pool = make_pool(num_blocks=16, stores=[CountingStore(1 << 22)])
    run(pool, PROMPT, salt="a")
    flush_pool(pool)
    assert pool.prefetch(PROMPT, salt="b").wait(30)
    assert pool.num_cached_blocks == 0
    h = pool.prefetch(PROMPT, salt="a")
    assert h.wait(30) and h.blocks_ready == 10
    check_hit(pool, PROMPT, 10, salt="a")


def test_prefetch_without_stores_is_done_at_once():
    pool = make_pool(num_blocks=16)
    run(pool, PROMPT)
    h = pool.prefetch(PROMPT)
    assert h.done() and h.wait(0) and h.blocks_ready == 10 and h.cancel() is False


@pytest.mark.parametrize("tokens, salt, exc, words", [
    ([], None, ValueError, "at least one token"),
    ([1, -2], None, ValueError, "token"),
    ("abc", None, TypeError, "token"),
    ([1, 2], 3.5, TypeError, "salt"),
])
def test_bad_arguments_are_refused(tokens, salt, exc, words):
    pool, store = stored_pool()
    with pytest.raises(exc, match=words):
        pool.prefetch(tokens, salt=salt)
    assert store.calls == []


@pytest.mark.parametrize("timeout, exc", [(-1, ValueError), ("1", TypeError),
                                          (True, TypeError), (float("nan"), ValueError)])
def test_wait_refuses_a_bad_timeout(timeout, exc):
    h = make_pool().prefetch([1, 2, 3])
    with pytest.raises(exc, match="timeout"):
        h.wait(timeout)


def test_a_failing_store_during_prefetch_is_a_warned_miss():
    store = FailingStore(1 << 22, exc=TimeoutError("slow"), fail=())
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, PROMPT)
    flush_pool(pool)
    store.fail = {"get"}
    h = pool.prefetch(PROMPT)
    assert h.wait(30) and h.blocks_ready == 0
    with pytest.warns(kvcore.StoreWarning, match="timeout"):
        pool.probe(PROMPT)          # the worker's warning reaches the next caller
    pool.debug.check()


def test_prefetch_from_redis(tmp_path):
    srv = RedisServer(tmp_path).start()
    try:
        pool = make_pool(num_blocks=16, stores=[kvcore.RedisStore(srv.url, namespace="pf")])
        run(pool, PROMPT)
        flush_pool(pool)
        h = pool.prefetch(PROMPT)
        assert h.wait(30) and h.blocks_ready == 10
        check_hit(pool, PROMPT, 10)
        pool.close()
    finally:
        srv.stop()
