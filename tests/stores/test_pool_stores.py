"""The pool's side of its prefix stores: every sequence however made (fork,
copy_to) spills what it evicts before overwriting it; allocate keeps the
promise probe made, and a failed allocate (a StoreWarning raised as an
error) changes nothing; a failed copy_to leaves nothing in the destination;
kv_scales takes real numbers only; every store warning names its exception."""
import threading
import time
import warnings

import numpy as np
import pytest

import kvcore

try:
    from _stores_support import (FailingStore, check_hit, expected_kv, flush_pool, make_pool,
                                 run)
except ImportError:  # pragma: no cover - run as a package
    from ._stores_support import (FailingStore, check_hit, expected_kv, flush_pool, make_pool,
                                  run)


def _entry_size():
    """Bytes one store entry of make_pool's geometry takes."""
    scratch = make_pool(4, stores=[kvcore.HostStore(1 << 20)])
    run(scratch, np.arange(500, 505, dtype=np.int32))
    assert scratch.flush_to_stores() == 1
    st = scratch.stats()["stores"][0]
    return st["bytes_in"] // st["puts"]


def _random_kv(pool, n, seed):
    rng = np.random.default_rng(seed)
    shape = (n, pool.num_kv_heads, pool.head_dim)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def _compute(seq, n, seed):
    """Append ``n`` positions of random KV to every layer and commit them."""
    for layer in range(seq.pool.num_layers):
        seq.append(layer, *_random_kv(seq.pool, n, seed + layer))
    seq.commit(n)


# ------------------------------------------------------------ item 2: forks spill
@pytest.mark.parametrize("how", ["append", "reserve"])
def test_a_fork_that_evicts_spills_the_original_kv_first(how):
    pool = make_pool(6, stores=[kvcore.HostStore(1 << 20)])
    prompt = np.arange(100, 109, dtype=np.int32)        # 2 full blocks + 1 token
    run(pool, prompt)                                     # its 2 full blocks cached
    assert pool.num_cached_blocks == 2
    parent = kvcore.PagedKVCache(pool)
    parent.allocate(np.arange(900, 905, dtype=np.int32))
    _compute(parent, 5, seed=1)
    child = parent.fork()
    # the child's copy-on-write and new blocks (4) take the 2 uncached free
    # blocks and evict the prompt's 2 cached ones, then overwrite them
    if how == "append":
        _compute(child, 12, seed=2)
    else:
        child.reserve(12)
        slots = child.slot_mapping(5, 17)
        for layer in range(pool.num_layers):
            pool.write(layer, *_random_kv(pool, 12, 7 + layer), slots)
            child.mark_written(layer, 12)
        child.commit(12)
    assert pool.num_cached_blocks == 1                 # the parent's full block 0
    child.free()
    parent.free()
    # the next spill (every cached block evicted) must not export the
    # fork's KV under the prompt's hashes
    run(pool, np.arange(2000, 2000 + 6 * 4, dtype=np.int32))
    pool.reset_prefix_cache()
    check_hit(pool, np.concatenate([prompt, [1]]), 2)
    pool.debug.check()


def test_a_fork_of_a_fork_spills_too():
    pool = make_pool(6, stores=[kvcore.HostStore(1 << 20)])
    prompt = np.arange(100, 109, dtype=np.int32)
    run(pool, prompt)
    parent = kvcore.PagedKVCache(pool)
    parent.allocate(np.arange(900, 905, dtype=np.int32))
    _compute(parent, 5, seed=1)
    grandchild = parent.fork().fork()
    _compute(grandchild, 12, seed=3)
    grandchild.free()
    parent.free()
    run(pool, np.arange(2000, 2024, dtype=np.int32))
    pool.reset_prefix_cache()
    check_hit(pool, np.concatenate([prompt, [1]]), 2)


def test_copy_to_a_pool_with_stores_spills_what_it_evicts():
    dst = make_pool(3, stores=[kvcore.HostStore(1 << 20)])
    prompt = np.arange(100, 109, dtype=np.int32)
    run(dst, prompt)                                   # 2 cached, 1 uncached free
    src = make_pool(8)
    seq = kvcore.PagedKVCache(src)
    seq.allocate(np.arange(700, 709, dtype=np.int32))
    _compute(seq, 9, seed=4)
    twin = seq.copy_to(dst)                            # takes all 3 blocks
    assert dst.num_cached_blocks == 2                  # the twin's own 2 full blocks
    twin.free()
    seq.free()
    dst.reset_prefix_cache()
    check_hit(dst, np.concatenate([prompt, [1]]), 2)


def _tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return torch, transformers, model


@pytest.mark.slow
def test_beam_search_with_a_host_store_matches_dynamic_cache():
    """End to end: beam search forks; with a HostStore behind a small pool
    the forks' evictions must spill the original KV (on 0.2 later calls
    read other beams' KV back from the store)."""
    torch, transformers, model = _tiny_llama()
    import kvcore.hf

    layers, heads, dim = kvcore.hf.model_kv_shape(model.config)
    # small enough that each call's beams evict the blocks earlier calls cached
    pool = kvcore.BlockPool(16, 4, layers, heads, dim, dtype="float32",
                            stores=[kvcore.HostStore(1 << 22)])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (1, n), generator=g) for n in (13, 18, 11)]
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False)
    wants = [model.generate(ids, **{kvcore.hf.cache_keyword(model): transformers.DynamicCache()},
                            **kw) for ids in prompts]
    for ids, want in list(zip(prompts, wants)) * 2:
        assert torch.equal(kvcore.hf.generate(model, ids, pool, **kw), want)
    assert pool.stats()["stores"][0]["hits"] > 0
    assert pool.num_used_blocks == 0
    pool.debug.check()


# ------------------------------------------------------------ item 12: probe's promise
def test_allocate_finds_the_store_hit_probe_promised():
    size = _entry_size()
    store = kvcore.HostStore(2 * size + size // 2)     # room for 2 entries
    pool = make_pool(4, stores=[store])
    prompt = np.arange(100, 109, dtype=np.int32)       # 2 full blocks + 1 token
    run(pool, prompt)
    assert pool.flush_to_stores() == 2                 # the store: both blocks
    pool.reset_prefix_cache()
    run(pool, np.arange(300, 309, dtype=np.int32))     # 2 other blocks cached
    assert pool.num_cached_blocks == 2
    promised = pool.probe(prompt)
    assert promised["store_hit_tokens"] == 8
    # allocate takes the 2 uncached free blocks and evicts one cached block:
    # its spill must not push out what probe promised
    seq = kvcore.PagedKVCache(pool)
    assert seq.allocate(prompt) == promised["hit_tokens"] == 8
    for layer, (k, v) in enumerate(expected_kv(pool, prompt, 8)):
        gk, gv = seq.gather(layer, 0, 8)
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
    seq.free()
    # the evicted block was spilled after the lookup, not lost
    assert pool.stats()["stores"][0]["puts"] == 3
    pool.debug.check()


# ------------------------------------------------------------ item 10: a failed allocate
class _CorruptingStore(kvcore.HostStore):
    """A HostStore whose ``get`` hands back the entries from the second on
    with a flipped payload byte while ``corrupt`` is set."""

    corrupt = False

    def get(self, keys):
        values = super().get(keys)
        if self.corrupt:
            values = [v if j == 0 or v is None else v[:-3] + bytes([v[-3] ^ 0x40]) + v[-2:]
                      for j, v in enumerate(values)]
        return values


def _without_store_stats(stats):
    return {k: v for k, v in stats.items() if k != "stores"}


def test_allocate_failing_on_a_store_warning_changes_nothing():
    store = _CorruptingStore(1 << 20)
    pool = make_pool(8, stores=[store])
    prompt = np.arange(100, 113, dtype=np.int32)       # 3 full blocks + 1 token
    run(pool, prompt)
    assert pool.flush_to_stores() == 3
    pool.reset_prefix_cache()
    store.corrupt = True
    before = pool.stats()
    snap = pool.debug.snapshot()
    seq = kvcore.PagedKVCache(pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvcore.StoreWarning)
        with pytest.raises(kvcore.StoreWarning, match="corrupt"):
            seq.allocate(prompt)
    after = pool.stats()
    assert _without_store_stats(after) == _without_store_stats(before)
    assert after["stores"][0]["hits"] == before["stores"][0]["hits"] == 0
    assert pool.num_cached_blocks == 0
    assert pool.debug.snapshot()["lru_order"] == snap["lru_order"]
    assert (seq.num_blocks, seq.num_tokens, seq.num_computed) == (0, 0, 0)
    # the sequence is new again: the same call now works (warned once already)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvcore.StoreWarning)
        assert seq.allocate(prompt) == 4
    assert pool.stats()["prefix_queries"] == before["prefix_queries"] + 13
    assert pool.stats()["prefix_hits"] == before["prefix_hits"] + 4
    seq.free()
    pool.debug.check()


# ------------------------------------------------------------ item 11: copy_to
@pytest.mark.parametrize("why", ["short", "dtype"])
def test_failed_copy_to_leaves_no_salt_in_the_destination(why):
    src = make_pool(8, dtype="float32")
    dst = make_pool(2 if why == "short" else 8, dtype="float32" if why == "short" else "float16")
    seq = kvcore.PagedKVCache(src, salt="tenant-a")
    seq.allocate(np.arange(100, 110, dtype=np.int32))
    _compute(seq, 10, seed=5)
    before = dst.stats()
    try:
        seq.copy_to(dst)
    except (kvcore.OutOfBlocksError, ValueError) as e:
        # while the exception (and its traceback's frames) is alive
        assert dst.stats() == before, e
        assert dst.stats()["num_salts"] == 0
    else:
        raise AssertionError("copy_to did not fail")
    dst.debug.check()
    seq.free()


# ------------------------------------------------------------ item 13
@pytest.mark.parametrize("bad", [[("0.5", 1.0)], [(True, 1.0)], [(1.0, np.bool_(True))],
                                 "11", [b"ab"], [np.array([True, True])],
                                 np.array([["1", "2"]]), [(1.0, 1j)]])
def test_kv_scales_refuses_strings_and_bools(bad):
    with pytest.raises(TypeError, match="kv_scales"):
        kvcore.BlockPool(4, 4, 1, 1, 4, dtype="float8_e4m3fn", kv_scales=bad)


def test_kv_scales_still_takes_numbers():
    pool = kvcore.BlockPool(4, 4, 2, 1, 4, dtype="float8_e4m3fn",
                            kv_scales=[(np.float32(0.5), 2), np.array([1.5, 3.0])])
    assert pool.kv_scales == [(0.5, 2.0), (1.5, 3.0)]


@pytest.mark.parametrize("exc, shows", [(MemoryError(), "MemoryError()"),
                                        (RuntimeError("boom"), "RuntimeError: boom"),
                                        (KeyError(""), "KeyError: ''")])
def test_store_warnings_name_the_exception(exc, shows):
    pool = make_pool(4, stores=[FailingStore(1 << 20, exc=exc, fail={"put"})])
    run(pool, np.arange(100, 109, dtype=np.int32))
    with pytest.warns(kvcore.StoreWarning) as record:
        pool.flush_to_stores()
    msg = str(record[0].message)
    assert shows in msg and "error: ;" not in msg, msg


# ------------------------------------------------------------ copy_blocks_to over cached blocks
@pytest.mark.parametrize("with_store", [False, True])
def test_copy_blocks_to_over_a_cached_block_never_hands_back_the_new_kv(with_store):
    pool = make_pool(6, stores=[kvcore.HostStore(1 << 20)] if with_store else None)
    prompt = np.arange(100, 109, dtype=np.int32)
    run(pool, prompt)                                   # blocks of 2 full blocks cached
    cached = [b for b in range(pool.num_blocks) if pool.is_cached(b)]
    assert len(cached) == 2
    other = make_pool(6)
    other.key_cache(0)[:] = 7.0
    other.copy_blocks_to(pool, [0, 1], cached)          # overwrite both in place
    assert pool.num_cached_blocks == 0
    assert pool.stats()["evictions"] == 2
    pool.debug.check()
    # a miss without a store; with one, the original KV comes back from it
    check_hit(pool, np.concatenate([prompt, [1]]), 2 if with_store else 0)


class _GatedStore(FailingStore):
    """A store that does I/O (as far as the pool knows) whose ``put`` or
    ``get`` (``gated``) waits for ``gate``: a slow disk or Redis.
    ``entered`` is set once a gated call has begun."""

    in_memory = False

    def __init__(self, capacity_bytes, gated):
        super().__init__(capacity_bytes)
        self.gated = gated
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _maybe(self, name):
        # FailingStore's hook, called first by each of its methods
        if name == self.gated:
            self.entered.set()
            assert self.gate.wait(30)


def test_a_full_spill_queue_drops_the_oldest_spills_counts_them_and_stays_correct():
    """Back-pressure: a store slower than the evictions fills its queue; the
    oldest queued spills are dropped (spills_dropped), the threads using the
    pool never wait, and what is found later is exact."""
    store = _GatedStore(1 << 22, "put")
    store.max_pending_bytes = 1500          # about two entries
    pool = make_pool(num_blocks=8, stores=[store])
    prompts = [np.arange(100 * j, 100 * j + 9, dtype=np.int32) for j in range(10)]
    t0 = time.perf_counter()
    for p in prompts:
        run(pool, p)
    assert time.perf_counter() - t0 < 10    # (the put is stuck: nobody waited on it)
    # the spill thread has begun its (stuck) put: waited for, since on a
    # loaded machine it may not have been scheduled yet when the loop ends
    assert store.entered.wait(10)
    dropped = pool.stats()["stores"][0]["spills_dropped"]
    assert dropped > 0
    store.gate.set()
    pool.flush_to_stores()
    st = pool.stats()["stores"][0]
    assert st["spills_dropped"] == dropped and st["failures"] == 0
    flush_pool(pool)
    found = 0
    for p in prompts:
        hit = pool.probe(p)["hit_tokens"] // pool.block_size
        check_hit(pool, p, hit)             # whatever is found is bit exact
        found += hit
    assert 0 < found < 2 * len(prompts)     # some spills were dropped, others kept
    pool.debug.check()


def test_a_lookup_waiting_on_a_store_holds_no_pool_lock():
    """One thread's allocate stuck in a store's get: other threads allocate,
    append, commit and free on the same pool meanwhile, and the stuck
    allocate then completes bit exact."""
    store = _GatedStore(1 << 22, "get")
    store.gate.set()                        # the setup's lookups pass
    pool = make_pool(num_blocks=24, stores=[store])
    prompt = np.arange(1, 18, dtype=np.int32)
    run(pool, prompt)
    flush_pool(pool)
    store.gate.clear()
    store.entered.clear()
    done = []
    t = threading.Thread(target=lambda: done.append(check_hit(pool, prompt, 4)))
    t.start()
    assert store.entered.wait(30)
    t0 = time.perf_counter()
    for j in range(5):
        run(pool, np.arange(1000 + 10 * j, 1003 + 10 * j, dtype=np.int32))   # no lookup
    took = time.perf_counter() - t0
    assert t.is_alive()                     # still inside get
    store.gate.set()
    t.join(30)
    assert done == [None]
    assert took < 5, took                   # (it would wait for the gate: 30 s)
    pool.debug.check()


@pytest.mark.forks
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_writes_the_spills_queued_at_the_fork(tmp_path):
    """Forked while the parent's worker is inside one put with another
    batch queued: the child's wait_spills writes the queued batch (the
    parent's drain is not in the child) instead of saying True over it."""
    import os

    parent = os.getpid()
    gate, entered = threading.Event(), threading.Event()

    class SlowDisk(kvcore.DiskStore):
        def put(self, items):
            if os.getpid() == parent:
                entered.set()
                gate.wait(30)
            return super().put(items)

    pool = make_pool(stores=[SlowDisk(tmp_path, 1 << 22)])
    blocks = 7 * pool.block_size + 1
    run(pool, np.arange(1, 18, dtype=np.int32))
    run(pool, np.arange(10**6, 10**6 + blocks, dtype=np.int32))   # spills the prompt
    assert entered.wait(10)                                  # the worker holds batch 1
    run(pool, np.arange(2 * 10**6, 2 * 10**6 + blocks, dtype=np.int32))   # batch 2, queued
    pid = os.fork()
    if pid == 0:                            # the child: report through the exit status
        code = 1
        try:
            code = 0 if pool.wait_spills(20) and len(pool.stores[0]) > 0 else 2
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        gate.set()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert pool.wait_spills(20)
    pool.debug.check()


@pytest.mark.forks
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_drains_its_own_spills(tmp_path):
    """A pool whose store worker ran in the parent keeps spilling in a child
    made by fork (the parent's thread is not there): the child's spills
    reach the store, and flush_to_stores returns instead of hanging."""
    import os

    store = kvcore.DiskStore(tmp_path, 1 << 22)
    pool = make_pool(num_blocks=8, stores=[store])
    for j in range(4):
        run(pool, np.arange(100 * j, 100 * j + 9, dtype=np.int32))   # spills via the worker
    pid = os.fork()
    if pid == 0:                            # the child: report through the exit status
        code = 1
        try:
            prompt = np.arange(5000, 5009, dtype=np.int32)
            run(pool, prompt)
            flush_pool(pool)                # evicts it into the store, waits for the worker
            code = 0 if pool.probe(prompt)["store_hit_tokens"] == 8 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    pool.debug.check()
