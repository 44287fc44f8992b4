"""Data safety and pool resources (issue 9, items 1, 3, 4, 5 and 7):

* commit accepts only positions every layer wrote, so KV an earlier owner
  left in a block is never read back nor cached;
* an uninitialised PagedKVCache raises one clear error from every member;
* the lifecycle new -> live -> closed;
* salt roots are reference-counted and forgotten when unreferenced, never
  letting one salt hit another's blocks;
* copy_blocks_to within one pool copies from the contents before the call.
"""
import hashlib
import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcore

try:
    from _helpers import pool_snapshot
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import pool_snapshot

L, H, D = 3, 2, 4


def make_pool(num_blocks=8, block_size=16, caching=True, layers=L):
    return kvcore.BlockPool(num_blocks, block_size, layers, H, D, dtype="float32",
                            enable_prefix_caching=caching)


def kv(n, fill):
    return np.full((n, H, D), fill, np.float32)


def pool_state(pool):
    return pool_snapshot(pool)


def seq_state(seq):
    return (seq.num_tokens, seq.num_computed, seq.block_table.tolist(),
            seq.token_ids.tolist(), seq.block_hashes(),
            [seq.num_written(layer) for layer in range(seq.pool.num_layers)])


def write_all(seq, n, fill):
    for layer in range(seq.pool.num_layers):
        seq.append(layer, kv(n, fill + layer), kv(n, -fill - layer))


# ------------------------------------------------------------ 1. commit checks writes
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("salts", [(None, None), ("tenant-a", "tenant-b")])
def test_commit_of_unwritten_positions_raises_and_never_exposes_stale_kv(caching, salts):
    pool = make_pool(num_blocks=3, caching=caching)
    a = kvcore.PagedKVCache(pool, salt=salts[0])
    a.allocate(list(range(33)))                 # 3 blocks: the whole pool
    write_all(a, 33, 7.0)
    a.commit(33)
    a.free()
    b = kvcore.PagedKVCache(pool, salt=salts[1])
    assert b.allocate(list(range(1000, 1033))) == 0
    assert sorted(b.block_table.tolist()) == [0, 1, 2]   # a's old blocks
    before = pool_state(pool), seq_state(b)
    with pytest.raises(ValueError, match=r"commit\(33\).* layer 0 has written 0 of them"):
        b.commit(33)
    assert (pool_state(pool), seq_state(b)) == before
    assert b.num_computed == 0
    for layer in range(L):
        k, v = b.gather(layer)                  # nothing readable, a's KV least of all
        assert k.shape == v.shape == (H, 0, D)
        with pytest.raises(ValueError, match="never written"):
            b.gather(layer, 0, 33)
    # written properly, b reads its own KV
    write_all(b, 33, 100.0)
    b.commit(33)
    for layer in range(L):
        k, v = b.gather(layer)
        assert (k == 100.0 + layer).all() and (v == -100.0 - layer).all()
    b.free()
    pool.debug.check()


@pytest.mark.parametrize("salt", [None, "s"])
def test_commit_rejects_some_layers_or_some_positions_written(salt):
    pool = make_pool()
    seq = kvcore.PagedKVCache(pool, salt=salt)
    seq.allocate(list(range(40)))
    seq.append(0, kv(33, 1.0), kv(33, 1.0))
    seq.append(1, kv(33, 1.0), kv(33, 1.0))
    before = pool_state(pool), seq_state(seq)
    with pytest.raises(ValueError, match="layer 2 has written 0 of them"):
        seq.commit(33)
    seq.append(2, kv(20, 1.0), kv(20, 1.0))     # layer 2: only 20 of the 33
    before = pool_state(pool), seq_state(seq)
    with pytest.raises(ValueError, match="layer 2 has written 20 of them"):
        seq.commit(33)
    assert (pool_state(pool), seq_state(seq)) == before
    seq.commit(20)                              # what every layer wrote is fine
    assert seq.num_computed == 20
    with pytest.raises(ValueError, match="layer 2 has written 0 of them"):
        seq.commit(13)
    seq.append(2, kv(13, 1.0), kv(13, 1.0))
    seq.commit(13)
    assert seq.num_computed == 33
    seq.commit(0)                               # nothing to write, nothing to check
    seq.free()
    # the batched path: pool.write without mark_written does not count
    seq = kvcore.PagedKVCache(pool, salt=salt)
    assert seq.allocate(list(range(100, 140))) == 0
    seq.reserve(13)
    slots = seq.slot_mapping(0, 13)
    for layer in range(L):
        pool.write(layer, kv(13, 2.0), kv(13, 2.0), slots)
    with pytest.raises(ValueError, match="layer 0 has written 0 of them"):
        seq.commit(13)
    for layer in range(L - 1):
        seq.mark_written(layer, 13)
    with pytest.raises(ValueError, match="layer 2 has written 0 of them"):
        seq.commit(13)
    seq.mark_written(L - 1, 13)
    seq.commit(13)
    assert seq.num_computed == 13
    seq.free()
    pool.debug.check()


@pytest.mark.parametrize("salts", [(None, None), ("x", "y"), ("x", "x")])
def test_unwritten_blocks_never_enter_the_prefix_cache(salts):
    pool = make_pool(num_blocks=3)
    a = kvcore.PagedKVCache(pool, salt=salts[0])
    a.allocate(list(range(33)))
    write_all(a, 33, 5.0)
    a.commit(33)
    a.free()
    assert pool.num_cached_blocks == 2
    prompt = list(range(500, 533))
    b = kvcore.PagedKVCache(pool, salt=salts[1])
    b.allocate(prompt)                          # evicts a's cached blocks
    assert pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="layer 0"):
        b.commit(33)
    for t in range(7):
        b.append_token(t)                       # tokens known: would register if committed
    assert pool.num_cached_blocks == 0
    b.free()
    assert pool.num_cached_blocks == 0
    c = kvcore.PagedKVCache(pool, salt=salts[1])
    assert c.allocate(prompt) == 0              # no hit on junk
    assert pool.stats()["prefix_hits"] == 0
    c.free()
    pool.debug.check()


def test_bookkeeping_benchmark_declares_what_it_commits():
    """The benchmark's requests pass commit's check (the demo's are run by
    tests/cli/test_demo.py)."""
    from kvcore.cli.benchmarks import pool as bench_pool

    assert bench_pool.bench_bookkeeping(quick=True)["requests"] == 50


# ------------------------------------------------------------ 3. uninitialised objects
_UNINIT_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import kvcore

    pool = kvcore.BlockPool(4, 4, 1, 1, 4)
    k = np.zeros((1, 1, 4), np.float32)
    CALLS = {
        "allocate": lambda s: s.allocate([1, 2]),
        "reserve": lambda s: s.reserve(1),
        "append": lambda s: s.append(0, k, k),
        "commit": lambda s: s.commit(1),
        "mark_written": lambda s: s.mark_written(0, 1),
        "append_token": lambda s: s.append_token(1),
        "extend_tokens": lambda s: s.extend_tokens([1]),
        "slot_mapping": lambda s: s.slot_mapping(0, 1),
        "num_written": lambda s: s.num_written(0),
        "block_hashes": lambda s: s.block_hashes(),
        "gather": lambda s: s.gather(0),
        "gather_scales": lambda s: s.gather_scales(0),
        "attention": lambda s: s.attention(0, np.zeros((1, 1, 4), np.float32)),
        "truncate": lambda s: s.truncate(0),
        "fork": lambda s: s.fork(),
        "copy_to": lambda s: s.copy_to(pool),
        "free": lambda s: s.free(),
        "__enter__": lambda s: s.__enter__(),
    }

    class Sub(kvcore.PagedKVCache):
        def __init__(self, pool):       # skips super().__init__
            self.p = pool

    public = sorted(n for n in dir(kvcore.PagedKVCache) if not n.startswith("_"))
    out = {"public": public, "results": []}
    for make in (lambda: kvcore.PagedKVCache.__new__(kvcore.PagedKVCache), lambda: Sub(pool)):
        for name in public + ["__enter__"]:
            s = make()
            attr = getattr(type(s), name)
            print(name, file=sys.stderr, flush=True)   # the last name names a crash
            try:
                if not callable(attr):      # a property or other descriptor: read it
                    getattr(s, name)
                elif name in CALLS:
                    CALLS[name](s)
                else:
                    raise SystemExit(f"no call for public member {name!r}: add it to the test")
            except Exception as e:
                out["results"].append([name, type(e).__name__, str(e)])
            else:
                out["results"].append([name, None, ""])
        out["repr"] = repr(make())
    print(json.dumps(out))
""")


def test_every_member_of_an_uninitialised_sequence_raises_one_clear_error():
    # in a subprocess: a crash (SIGFPE in slot_mapping before) must fail the
    # test, not kill pytest
    r = subprocess.run([sys.executable, "-c", _UNINIT_SCRIPT], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    out = json.loads(r.stdout)
    assert {"allocate", "append", "commit", "gather", "slot_mapping", "num_written",
            "pool", "num_tokens", "block_table", "closed"} <= set(out["public"])
    assert len(out["results"]) == 2 * (len(out["public"]) + 1)
    for name, exc, msg in out["results"]:
        assert exc == "RuntimeError", (name, exc, msg)
        shown = "with" if name == "__enter__" else name
        assert msg.startswith(f"{shown}: PagedKVCache is not initialised; call "
                              "PagedKVCache.__init__(pool, ...) first"), (name, msg)
    assert out["repr"] == "PagedKVCache(<not initialised>)"


def test_uninitialised_sequence_takes_nothing_from_a_pool():
    pool = make_pool(num_blocks=4)
    s = kvcore.PagedKVCache.__new__(kvcore.PagedKVCache)
    before = pool_state(pool)
    with pytest.raises(RuntimeError, match="not initialised"):
        s.copy_to(pool)
    with pytest.raises(RuntimeError, match="not initialised"):
        with s:
            pass
    assert pool_state(pool) == before
    # initialising it afterwards makes a normal sequence
    s.__init__(pool)
    assert s.allocate([1, 2, 3]) == 0
    s.free()


# ------------------------------------------------------------ 4. lifecycle
_LIVE_ONLY = {
    "append": lambda s: s.append(0, kv(1, 1.0), kv(1, 1.0)),
    "append (validated path)": lambda s: s.append(0, kv(1, 1.0).tolist(), kv(1, 1.0).tolist()),
    "reserve": lambda s: s.reserve(1),
    "commit": lambda s: s.commit(1),
    "commit(0)": lambda s: s.commit(0),
    "mark_written": lambda s: s.mark_written(0, 1),
    "append_token": lambda s: s.append_token(1),
    "extend_tokens": lambda s: s.extend_tokens([1]),
    "slot_mapping": lambda s: s.slot_mapping(0, 0),
    "gather": lambda s: s.gather(0),
    "attention": lambda s: s.attention(0, np.zeros((1, s.pool.num_kv_heads, s.pool.head_dim),
                                                    np.float32)),
    "truncate": lambda s: s.truncate(0),
}


@pytest.mark.parametrize("call", sorted(_LIVE_ONLY))
def test_calls_before_allocate_raise_and_take_nothing(call):
    pool = make_pool(num_blocks=4)
    seq = kvcore.PagedKVCache(pool, salt="s")
    before = pool_state(pool), seq_state(seq)
    with pytest.raises(ValueError, match=r"allocate\(token_ids\) first"):
        _LIVE_ONLY[call](seq)
    assert (pool_state(pool), seq_state(seq)) == before
    assert pool.num_used_blocks == 0
    assert seq.allocate(list(range(5))) == 0    # still usable
    seq.free()
    pool.debug.check()


@pytest.mark.parametrize("call", sorted(_LIVE_ONLY) + ["allocate", "fork", "copy_to",
                                                       "num_written", "block_hashes", "with"])
def test_calls_after_free_raise_and_take_nothing(call):
    pool = make_pool(num_blocks=4)
    other = make_pool(num_blocks=4)
    seq = kvcore.PagedKVCache(pool, salt="s")
    seq.allocate(list(range(20)))
    write_all(seq, 20, 3.0)
    seq.commit(20)
    seq.free()
    calls = dict(_LIVE_ONLY, allocate=lambda s: s.allocate([1, 2]), fork=lambda s: s.fork(),
                 copy_to=lambda s: s.copy_to(other), num_written=lambda s: s.num_written(0),
                 block_hashes=lambda s: s.block_hashes(), **{"with": lambda s: s.__enter__()})
    before = pool_state(pool), pool_state(other)
    with pytest.raises(ValueError, match=r"on a freed PagedKVCache: free\(\) closed it"):
        calls[call](seq)
    assert (pool_state(pool), pool_state(other)) == before
    assert pool.num_used_blocks == 0 and other.num_used_blocks == 0


def test_a_closed_sequence_answers_its_properties_and_free_again():
    pool = make_pool(num_blocks=4)
    seq = kvcore.PagedKVCache(pool, max_seq_len=64, salt="s")
    assert not seq.closed
    seq.allocate(list(range(20)))
    write_all(seq, 20, 3.0)
    seq.commit(20)
    seq.free()
    assert seq.closed
    assert seq.pool is pool and seq.max_seq_len == 64 and seq.salt == b"s"
    assert seq.num_tokens == seq.num_computed == seq.num_blocks == seq.capacity == 0
    assert seq.block_table.tolist() == [] and seq.token_ids.tolist() == []
    before = pool_state(pool)
    seq.free()
    seq.free()
    assert pool_state(pool) == before
    assert "closed" in repr(seq)
    # re-running __init__ makes it a new sequence
    seq.__init__(pool)
    assert not seq.closed and seq.allocate([1, 2]) == 0
    seq.free()
    pool.debug.check()


def test_fork_copy_to_and_with_keep_the_lifecycle():
    pool = make_pool(num_blocks=8)
    host = make_pool(num_blocks=8)
    new = kvcore.PagedKVCache(pool)
    for twin in (new.fork(), new.copy_to(host)):        # new -> new
        assert not twin.closed
        with pytest.raises(ValueError, match="allocate"):
            twin.commit(0)
        assert twin.allocate([1, 2, 3]) == 0
        twin.free()
    with kvcore.PagedKVCache(pool) as seq:
        seq.allocate(list(range(10)))
        write_all(seq, 10, 1.0)
        seq.commit(10)
        for twin in (seq.fork(), seq.copy_to(host)):    # live -> live
            assert not twin.closed
            write_all(twin, 1, 9.0)
            twin.commit(1)
            assert twin.num_computed == 11
            twin.free()
            assert twin.closed
    assert seq.closed                                    # leaving the block closed it
    with pytest.raises(ValueError, match="freed"):
        seq.append(0, kv(1, 1.0), kv(1, 1.0))
    assert pool.num_used_blocks == 0 and host.num_used_blocks == 0
    pool.debug.check()
    host.debug.check()


def test_append_after_free_takes_no_block():
    """The report's case: append after free took blocks again."""
    pool = make_pool(num_blocks=4)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    seq.free()
    for _ in range(3):
        with pytest.raises(ValueError, match="freed"):
            seq.append(0, kv(16, 1.0), kv(16, 1.0))
    assert pool.num_free_blocks == 4


# ------------------------------------------------------------ 5. salt roots
def test_salts_are_forgotten_once_nothing_refers_to_them():
    pool = make_pool(num_blocks=4, block_size=4, layers=1)
    base = pool.stats()["num_salts"]
    assert base == 0
    for i in range(20000):                      # no block ever cached
        with kvcore.PagedKVCache(pool, salt=f"tenant-{i}") as seq:
            seq.allocate([1, 2])
            seq.append(0, kv(2, 1.0), kv(2, 1.0))
            seq.commit(2)
        if i % 5000 == 0:
            assert pool.stats()["num_salts"] == base
    for i in range(20000):                      # dropped without free
        kvcore.PagedKVCache(pool, salt=i.to_bytes(4, "little"))
    assert pool.stats()["num_salts"] == base
    # a held salt counts once, however many sequences hold it
    held = [kvcore.PagedKVCache(pool, salt="h") for _ in range(3)]
    held.append(held[0].fork())
    assert pool.stats()["num_salts"] == base + 1
    for s in held[:-1]:
        s.free()
    assert pool.stats()["num_salts"] == base + 1      # the fork still holds it
    held[-1].free()
    assert pool.stats()["num_salts"] == base
    pool.debug.check()


def test_salt_table_memory_returns_to_its_baseline():
    import tracemalloc

    pool = make_pool(num_blocks=4, block_size=4, layers=1)

    def churn(first, n):
        for i in range(first, first + n):
            kvcore.PagedKVCache(pool, salt=b"%032d" % i).free()

    churn(0, 2000)                              # warm up every cache
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        churn(2000, 100000)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    # before: ~130 bytes a salt kept forever (13 MB here)
    assert grown < 200_000, grown
    assert pool.stats()["num_salts"] == 0


def test_cached_blocks_keep_their_salt_until_evicted():
    pool = make_pool(num_blocks=3, block_size=4, layers=1)
    t = list(range(9))
    a = kvcore.PagedKVCache(pool, salt="x")
    a.allocate(t)
    a.append(0, kv(9, 1.0), kv(9, 1.0))
    a.commit(9)
    a.free()
    assert pool.stats()["num_salts"] == 1       # 2 cached blocks refer to "x"
    again = kvcore.PagedKVCache(pool, salt="x")
    assert again.allocate(t) == 8               # the salt's cache survived its sequences
    again.free()
    # another request takes every block: "x"'s blocks are evicted, "x" forgotten
    b = kvcore.PagedKVCache(pool)
    b.allocate(list(range(100, 112)))
    assert pool.stats()["num_salts"] == 0
    b.free()
    # "x" comes back with a new root: nothing to hit, and no other salt's blocks
    y = kvcore.PagedKVCache(pool, salt="y")
    y.allocate(t)
    y.append(0, kv(9, 2.0), kv(9, 2.0))
    y.commit(9)
    y.free()
    x = kvcore.PagedKVCache(pool, salt="x")
    assert x.allocate(t) == 0
    x.free()
    assert pool.reset_prefix_cache()
    assert pool.stats()["num_salts"] == 0
    pool.debug.check()


def _kv_of(salt, tokens, p):
    """K of position p for ``salt`` and ``tokens[:p + 1]`` (1 head, D dims)."""
    key = repr((salt, [int(t) for t in tokens[:p + 1]])).encode()
    x = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
    return np.full((1, H, D), x % 100003, np.float32)


def test_a_salt_never_hits_another_salts_blocks_while_roots_come_and_go():
    """Random requests over few prompts and salts in a pool small enough that
    salts are dropped and re-created all the time; every prefix hit must
    hold exactly the KV its own salt would have computed."""
    rng = np.random.default_rng(0)
    bs = 4
    pool = make_pool(num_blocks=10, block_size=bs, layers=1)
    prompts = [[int(t) for t in rng.integers(0, 3, 12)] for _ in range(4)]
    prompts.append(prompts[0][:8] + [7, 7, 7])
    salts = [None, "a", "b", "c", b"a"]   # "a" and b"a" are the same salt
    live = []
    hits = 0
    for step in range(3000):
        if live and (len(live) > 2 or rng.random() < 0.4):
            live.pop(int(rng.integers(len(live)))).free()
            continue
        salt = salts[int(rng.integers(len(salts)))]
        tokens = prompts[int(rng.integers(len(prompts)))]
        seq = kvcore.PagedKVCache(pool, salt=salt)
        try:
            hit = seq.allocate(tokens)
        except kvcore.OutOfBlocksError:
            seq.free()
            continue
        name = salt.decode() if isinstance(salt, bytes) else salt
        if hit:
            hits += 1
            k, _ = seq.gather(0, 0, hit)
            want = np.concatenate([_kv_of(name, tokens, p) for p in range(hit)])
            np.testing.assert_array_equal(k, want.transpose(1, 0, 2))
        for p in range(hit, len(tokens)):
            x = _kv_of(name, tokens, p)
            seq.append(0, x, x)
            seq.commit(1)
        live.append(seq)
        held = {s.salt for s in live if s.salt is not None}
        n = pool.stats()["num_salts"]
        assert len(held) <= n <= len(held) + pool.num_cached_blocks
    for s in live:
        s.free()
    assert hits > 100
    assert pool.reset_prefix_cache()
    assert pool.stats()["num_salts"] == 0
    pool.debug.check()


def test_salt_root_ids_are_not_reused():
    from kvcore._native import _pool

    core = _pool.PoolCore(4, 4)
    r1 = core.new_root()
    assert core.root_refs(r1) == 1
    core.root_decref(r1)
    assert core.root_refs(r1) == 0
    with pytest.raises(ValueError, match="not a live salt root"):
        core.root_incref(r1)                    # a dead root cannot come back
    assert core.take_dead_roots() == [r1]
    r2 = core.new_root()                        # the same slot, a new generation
    assert r2 != r1 and r2 < -1
    assert core.root_refs(r2) == 1 and core.root_refs(r1) == 0
    core.check()


# ------------------------------------------------------------ 7. copy_blocks_to in one pool
def _numbered_pool(n=6):
    pool = kvcore.BlockPool(n, 2, 2, 1, 3, dtype="float32")
    for b in range(n):
        pool.storage[:, b] = np.arange(pool.storage[:, b].size, dtype=np.float32).reshape(
            pool.storage[:, b].shape) + 1000 * b
    return pool


@pytest.mark.parametrize("src,dst", [([0, 1], [1, 2]), ([0, 1], [1, 0]), ([2, 1, 0], [0, 2, 1]),
                                     ([3, 3, 4], [4, 5, 3]), ([1], [1]), ([0, 4], [5, 1])])
def test_copy_blocks_to_the_same_pool_copies_the_old_contents(src, dst):
    pool = _numbered_pool()
    old = pool.storage.copy()
    want = old.copy()
    want[:, dst] = old[:, src]
    pool.copy_blocks_to(pool, src, dst)
    np.testing.assert_array_equal(pool.storage, want)


def test_copy_blocks_to_rejects_a_repeated_destination():
    pool = _numbered_pool()
    before = pool.storage.copy()
    with pytest.raises(ValueError, match=r"dst_block_ids must not repeat a block id, got 2 "
                                         r"at indices \[0, 2\]"):
        pool.copy_blocks_to(pool, [0, 1, 3], [2, 4, 2])
    other = _numbered_pool()
    with pytest.raises(ValueError, match="must not repeat"):
        pool.copy_blocks_to(other, [0, 1], [5, 5])
    np.testing.assert_array_equal(pool.storage, before)


@pytest.mark.parametrize("sign", [1, -1])
def test_an_integer_too_long_to_print_is_refused_by_name(sign):
    # Python refuses to turn an int of more than 4300 digits into text: a
    # range error that printed it raised a nameless ValueError instead
    huge = sign * 10**5000
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32")
    calls = {
        "num_blocks": lambda: kvcore.BlockPool(huge, 4, 1, 1, 8),
        "block_size": lambda: kvcore.BlockPool(8, huge, 1, 1, 8),
        "n": lambda: kvcore.set_num_threads(huge),
        "layer": lambda: pool.key_cache(huge),
    }
    for arg, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{arg} must be an integer of at most 256 bits, "
                                             rf"got {'a negative' if sign < 0 else 'an'} "
                                             r"integer of 16610 bits$"):
            call()
    assert pool.num_used_blocks == 0
    # 2**64 still gets the argument's own range error, which names it
    with pytest.raises(ValueError, match=r"num_blocks must be at most \d+, got 18446744073709551616"):
        kvcore.BlockPool(2**64, 4, 1, 1, 8)


def test_a_one_element_tensor_is_not_an_integer():
    # torch's __index__ reads tensor([3]) and tensor([[3]]) as 3, and
    # tensor(True) as 1: a count, a layer or a thread number given as one
    # was taken silently
    torch = pytest.importorskip("torch")
    pool = kvcore.BlockPool(8, 4, 2, 1, 8, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    before = pool_snapshot(pool)
    for value in (torch.tensor([1]), torch.tensor([[1]]), np.ones((1, 1), np.int64)):
        for arg, call in (("layer", lambda: pool.key_cache(value)),
                          ("n", lambda: seq.reserve(value)),
                          ("n", lambda: kvcore.set_num_threads(value))):
            with pytest.raises(TypeError, match=rf"^{arg} must be an integer \(a 0-d array or "
                                                rf"tensor at most\), got a \w+ with ndim "
                                                rf"{value.ndim}: "):
                call()
        with pytest.raises(TypeError, match=r"^n must be an integer, got a bool Tensor "
                                            r"tensor\(True\)"):
            seq.reserve(torch.tensor(True))
    assert pool_snapshot(pool) == before
    assert seq.num_tokens == 3
    # a 0-d tensor or array is still an integer
    assert pool.key_cache(torch.tensor(1)).shape == pool.key_cache(1).shape
    assert pool.key_cache(np.int64(1)).shape == pool.key_cache(np.array(1)).shape


@pytest.mark.parametrize("sign", [1, -1])
def test_an_integer_too_long_to_print_is_named_on_every_path(sign):
    # paths that did not go through index_int: ids inside a token list, the
    # failure paths of reserve / commit / mark_written (the core takes any
    # int >= 0), timeouts, stores' sizes, the SIMD level, saturate
    huge = sign * 10**5000
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    seq.append(0, np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))
    before = pool_snapshot(pool)
    what = "a negative" if sign < 0 else "an"
    named = {
        "token_ids must lie in 0..2147483647, got": [
            lambda: pool.probe([1, huge]), lambda: kvcore.PagedKVCache(pool).allocate([1, huge]),
            lambda: seq.extend_tokens([4, huge]), lambda: kvcore.block_hashes([1, huge], 4)],
        "set_simd_level: level must be one of": [lambda: kvcore.set_simd_level(huge)],
        "saturate must be True or False, got": [
            lambda: kvcore.to_float8_e4m3fn(np.ones(2, np.float32), saturate=huge)],
        "capacity_bytes must be an integer of at most 256 bits, got": [
            lambda: kvcore.HostStore(huge), lambda: kvcore.PrefixStore(huge)],
    }
    if sign > 0:
        named["n must be an integer of at most 256 bits, got"] = [
            lambda: seq.reserve(huge), lambda: seq.commit(huge), lambda: seq.mark_written(0, huge)]
    else:       # (a huge positive timeout waits without a limit)
        named["timeout must be a number of seconds >= 0, got"] = [lambda: pool.wait_spills(huge)]
    for start, calls in named.items():
        for call in calls:
            with pytest.raises((ValueError, TypeError),
                               match=rf"^{start}.*{what} integer of 16610 bits"):
                call()
    assert pool_snapshot(pool) == before
    assert (seq.num_tokens, seq.num_computed, seq.num_written(0)) == (3, 0, 3)


def test_a_table_too_wide_to_allocate_names_max_blocks():
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    for width in (2**63 - 1, 2**64):
        # (NumPy's own error named nothing: "Maximum allowed dimension exceeded")
        with pytest.raises((ValueError, MemoryError), match=rf"^max_blocks must leave a table "
                                                            rf".*, got {width}: "):
            kvcore.padded_block_tables([seq], max_blocks=width)


def test_a_reserve_near_the_int64_limit_is_short_of_blocks():
    # the core's block count of n positions, (n + block_size - 1) //
    # block_size, wrapped past 2**63 - 1: such a reserve on a sequence at
    # position 0 returned as done, with nothing reserved
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    before = pool_snapshot(pool)
    for n in (2**63 - 1, 2**63 - 3, 2**64):
        with pytest.raises(kvcore.OutOfBlocksError, match="more blocks needed"):
            seq.reserve(n)
    assert pool_snapshot(pool) == before and seq.block_table.tolist() == [0]


def test_a_pool_too_large_to_allocate_names_its_sizing_arguments():
    with pytest.raises(MemoryError, match=r"the pool's storage cannot be allocated: "
                                          r"num_blocks=2147483646 x num_layers=32 x 2 \(K, V\) x "
                                          r"num_kv_heads=8 x block_size=16 x head_dim=128 "
                                          r"elements of float16 are 4503599623176192 bytes"):
        kvcore.BlockPool(2**31 - 2, 16, 32, 8, 128)
    with pytest.raises(ValueError, match=r"block_size=4611686018427387904 .* of int8 are"):
        kvcore.BlockPool(8, 2**62, 1, 2, 8, dtype="int8")


@pytest.mark.parametrize("arg", ["num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [2**31, 2**32 + 8, 2**62])
def test_head_counts_and_head_dims_past_a_c_int_are_refused_when_the_storage_is_made(arg,
                                                                                     value):
    # the attention kernels take them as C ints: a pool or cache of 2**31
    # heads of one element (4 GiB of fp8, allocated lazily) was made, and
    # only its first attention refused it
    pool_kw = dict(num_blocks=1, block_size=1, num_layers=1, num_kv_heads=1, head_dim=1,
                   dtype="float8_e4m3fn")
    cache_kw = dict(num_layers=1, num_kv_heads=1, head_dim=1, max_seq_len=1,
                    dtype="float8_e4m3fn")
    msg = rf"^{arg} must be at most 2147483647 \(the attention kernels take it as a C int\), " \
          rf"got {value}$"
    with pytest.raises(ValueError, match=msg):
        kvcore.BlockPool(**dict(pool_kw, **{arg: value}))
    with pytest.raises(ValueError, match=msg):
        kvcore.KVCache(**dict(cache_kw, **{arg: value}))
    assert getattr(kvcore.BlockPool(**dict(pool_kw, **{arg: 4})), arg) == 4


def test_a_backends_own_out_of_memory_error_still_names_the_sizing_arguments():
    # CuPy's OutOfMemoryError is a MemoryError whose __init__ takes (size,
    # total, limit): remade from a message as type(e)(...), it raised a
    # TypeError about its own arguments instead of naming the pool's
    from kvcore import _pool_data, dtypes

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: "
                             f"{total:,} bytes).")

    class Backend:
        def zeros(self, shape, dtype):
            raise OutOfMemoryError(2**40, 2**30)

    with pytest.raises(MemoryError, match=r"^the pool's storage cannot be allocated: "
                                          r"num_blocks=8 x num_layers=1 .* Out of memory"):
        _pool_data._storage(Backend(), 8, 16, 1, 2, 8, dtypes.F16)


def test_a_token_whose_index_gives_no_int_is_refused_by_name():
    # tokens_from_sequence called __index__ itself: 1.5 came back and was
    # truncated to the id 1; 1e300 gave the nameless "__index__ returned
    # non-int (type float)", "7" and None "an integer is required"
    class Index:
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

        def __repr__(self):
            return f"Index({self.v!r})"

    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    for v in (1.5, 1e300, "7", None):
        calls = (lambda: pool.probe([1, Index(v)]), lambda: kvcore.block_hashes([1, Index(v)], 4),
                 lambda: seq.allocate([1, Index(v)]))
        for call in calls:
            with pytest.raises(TypeError, match=rf"^token_ids must hold integers, got "
                                                rf"{re.escape(repr(Index(v)))} at index 1$"):
                call()
    assert seq.num_tokens == 0 and pool.num_used_blocks == 0
    assert pool.probe([1, Index(2)]) == pool.probe([1, 2])      # an int from __index__ is one


def test_shown_never_raises_on_an_int_subclass():
    # an error message shows what was given: an int subclass's own
    # bit_length, comparisons or repr must not replace the error with theirs
    from kvcore._ints import shown

    class Odd(int):
        def bit_length(self):
            raise RuntimeError("bit_length")

        def __lt__(self, other):
            raise RuntimeError("lt")

        def __repr__(self):
            raise RuntimeError("repr")

    assert shown(Odd(5)) == "<Odd>"
    assert shown(Odd(2**300)) == "an integer of 301 bits"
    assert shown(Odd(-2**300)) == "a negative integer of 301 bits"
