"""Prefix stores (HostStore, DiskStore) below a BlockPool: spill on
eviction, hits extended from the stores bit for bit, capacity, isolation,
verification, and faults that degrade to misses (Redis: test_stores_redis.py)."""
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kvcore
from kvcore.pool import store_port
from kvcore.stores import _format

from _cuda_env import cuda_backend_or_skip
from _helpers import run_script_phases, snapshot_without_stores
from _stores_support import (GEOMETRY, TESTS, FailingStore, check_hit, disk_full, expected_kv,
                             flush_pool, make_pool, peer_script, permission_denied, run)

PROMPT = np.arange(1, 18, dtype=np.int32)       # 17 tokens: 4 full blocks can hit


def entry_bytes(pool):
    """Bytes of one store entry of ``pool``."""
    return _format.PREFIX_SIZE + 8 + 4 * pool.block_size + pool.bytes_per_block


# ------------------------------------------------------------ host memory
def test_host_store_keeps_evicted_blocks_and_hits_them_bit_exact():
    host = kvcore.HostStore(1 << 20)
    pool = make_pool(stores=[host])
    assert run(pool, PROMPT) == (0, None)
    flush_pool(pool)
    assert pool.num_cached_blocks == 0
    assert len(host) == 4          # the prompt's 4 full blocks (the 5th is partial)
    before = pool.stats()["prefix_hits"]
    check_hit(pool, PROMPT, 4)
    st = pool.stats()
    assert st["prefix_hits"] - before == 16
    assert st["stores"][0]["hits"] == 4 and st["stores"][0]["hit_tokens"] == 16
    assert st["stores"][0]["bytes_out"] == 4 * entry_bytes(pool)
    pool.debug.check()


def test_store_hit_extends_the_pools_own_hit_and_enters_the_prefix_cache():
    host = kvcore.HostStore(1 << 20)
    pool = make_pool(num_blocks=6, stores=[host])
    run(pool, PROMPT)
    # a second sequence takes 4 blocks: the LRU tail (blocks 3, 2) of the
    # prompt is evicted into the store, its head stays cached in the pool
    run(pool, np.arange(500, 516, dtype=np.int32))
    assert len(host) >= 2
    seq = kvcore.PagedKVCache(pool)
    assert seq.allocate(PROMPT) == 16
    # the loaded blocks are registered: a third sequence hits them in the pool
    twin = kvcore.PagedKVCache(pool)
    lookups = pool.stats()["stores"][0]["lookups"]
    assert twin.allocate(PROMPT) == 16
    assert pool.stats()["stores"][0]["lookups"] == lookups   # no store lookup needed
    assert list(twin.block_table[:4]) == list(seq.block_table[:4])
    seq.free()
    twin.free()
    check_hit(pool, PROMPT, 4)


def test_probe_counts_store_blocks_and_changes_nothing():
    pool = make_pool(stores=[kvcore.HostStore(1 << 20)])
    run(pool, PROMPT)
    flush_pool(pool)
    snap = pool.debug.snapshot()
    p = pool.probe(PROMPT)
    assert p["hit_tokens"] == 16 and p["store_hit_tokens"] == 16
    assert p["blocks_needed"] == 5       # store hits are loaded into fresh blocks
    assert pool.debug.snapshot() == snap
    assert pool.probe(PROMPT, salt="other")["hit_tokens"] == 0


def test_host_restore_keeps_the_blocks_before_a_corrupt_payload_bit_exact():
    # the whole run is copied by one native call: the blocks before the
    # corrupt one are adopted bit-exact, it and those after it are not
    host = kvcore.HostStore(1 << 20)
    pool = make_pool(stores=[host])
    run(pool, PROMPT)
    flush_pool(pool)
    fp = next(iter(host._entries))[:16]
    keys = [_format.store_key(fp, h) for h in kvcore.block_hashes(PROMPT, 4)]
    corrupt = bytearray(host._entries[keys[2]])
    corrupt[-3] ^= 0x10                         # third block's payload
    host._entries[keys[2]] = corrupt
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, PROMPT, 2)
    st = pool.stats()["stores"][0]
    assert st["hits"] == 2 and st["rejected"] == 1
    pool.debug.check()


def test_host_store_capacity_spills_lru_into_the_next_store(tmp_path):
    pool0 = make_pool()
    size = entry_bytes(pool0)
    host = kvcore.HostStore(3 * size)
    disk = kvcore.DiskStore(tmp_path / "d", 5 * size)
    pool = make_pool(stores=[host, disk])
    prompts = [np.arange(100 * i, 100 * i + 17, dtype=np.int32) for i in range(1, 4)]
    for p in prompts:
        run(pool, p)
    flush_pool(pool)
    assert host.used_bytes() <= 3 * size and len(host) == 3
    assert disk.used_bytes() <= 5 * size and len(disk) == 5
    st = pool.stats()["stores"]
    assert st[0]["evictions"] >= 9 and st[1]["puts"] == st[0]["evictions"]
    # 12 blocks went in; 8 are kept: the oldest prompt's are gone, the last
    # prompt's are all in the host store
    check_hit(pool, prompts[2], 4)
    # the second prompt: its head blocks went down to the disk store first
    # (a sequence releases tail first, so the tail was evicted first)
    seq = kvcore.PagedKVCache(pool)
    assert seq.allocate(prompts[1]) in (0, 4, 8, 12, 16)
    seq.free()


def test_entry_larger_than_the_host_store_goes_to_the_next(tmp_path):
    disk = kvcore.DiskStore(tmp_path, 1 << 20)
    pool = make_pool(stores=[kvcore.HostStore(64), disk])
    run(pool, PROMPT)
    flush_pool(pool)
    assert len(pool.stores[0]) == 0 and len(disk) == 4
    check_hit(pool, PROMPT, 4)
    assert pool.stats()["stores"][1]["hits"] == 4


# ------------------------------------------------------------ disk


def test_disk_store_survives_a_restart_bit_exact(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(peer_script(f"kvcore.DiskStore({str(tmp_path / 's')!r}, 1 << 24)"))
    run_script_phases(script, ("compute", "hit"))


def test_disk_store_capacity_is_honoured_across_instances(tmp_path):
    pool0 = make_pool()
    cap = 6 * entry_bytes(pool0)
    a = kvcore.DiskStore(tmp_path, cap)
    b = kvcore.DiskStore(tmp_path, cap)     # a second "process" on one directory
    pa, pb = make_pool(stores=[a]), make_pool(stores=[b])
    for i in range(1, 4):
        run(pa, np.arange(100 * i, 100 * i + 17, dtype=np.int32))
        run(pb, np.arange(1000 * i, 1000 * i + 17, dtype=np.int32))
        flush_pool(pa)
        flush_pool(pb)
        assert a.used_bytes() <= cap
    # a trim frees room down to the low watermark (5.4 entries here), no further
    assert len(a) in (5, 6)


@pytest.mark.parametrize("where", ["payload", "tokens", "header", "truncate"])
def test_corrupt_entry_on_disk_is_a_miss_with_one_warning(tmp_path, where):
    disk = kvcore.DiskStore(tmp_path, 1 << 22)
    pool = make_pool(stores=[disk])
    run(pool, PROMPT)
    flush_pool(pool)
    files = sorted(tmp_path.rglob("*.kve"))
    assert len(files) == 4
    victim = files[0]
    data = bytearray(victim.read_bytes())
    if where == "truncate":
        data = data[:len(data) // 2]
    else:
        at = {"payload": -5, "tokens": _format.PREFIX_SIZE + 8 + 1, "header": 30}[where]
        data[at] ^= 0x40
    victim.write_bytes(bytes(data))
    key = bytes.fromhex(victim.name[:-4])
    order = [_format.store_key(key[:16], h) for h in kvcore.block_hashes(PROMPT, 4)]
    broken = order.index(key)
    with pytest.warns(kvcore.StoreWarning, match="corrupt") as record:
        seq = kvcore.PagedKVCache(pool)
        assert seq.allocate(PROMPT) == 4 * broken
    assert len(record) == 1
    seq.free()
    st = pool.stats()["stores"][0]
    assert st["rejected"] == 1 and st["hits"] == broken
    # the same condition again: a miss, no second warning
    pool.reset_prefix_cache()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seq = kvcore.PagedKVCache(pool)
        assert seq.allocate(PROMPT) == 4 * broken
        seq.free()
    pool.debug.check()


def test_fingerprint_mismatch_is_a_miss_with_a_warning(tmp_path):
    # an entry of a float16 pool filed under the key a float32 pool looks up
    disk16 = kvcore.DiskStore(tmp_path, 1 << 22)
    p16 = make_pool(stores=[disk16], dtype="float16")
    run(p16, PROMPT)
    flush_pool(p16)
    p32 = make_pool(stores=[kvcore.DiskStore(tmp_path, 1 << 22)], dtype="float32")
    assert p32.probe(PROMPT)["hit_tokens"] == 0      # other layout: other keys
    fp32 = _format.fingerprint("float32", 4, 2, 2, 8, b"")
    h0 = kvcore.block_hashes(PROMPT, 4)[0]
    src = next(p for p in tmp_path.rglob("*.kve") if p.name.startswith(
        _format.store_key(_format.fingerprint("float16", 4, 2, 2, 8, b""), h0).hex()))
    disk32 = p32.stores[0]
    disk32.put([(_format.store_key(fp32, h0), src.read_bytes())])
    with pytest.warns(kvcore.StoreWarning, match="fingerprint"):
        seq = kvcore.PagedKVCache(p32)
        assert seq.allocate(PROMPT) == 0
    seq.free()


@pytest.mark.parametrize("store", ["host", "disk"])
def test_fp8_pools_with_other_kv_scales_never_share_entries(tmp_path, store):
    """An fp8 block's codes mean what its pool's per-layer scales make of
    them: a pool with other scales reading them would get another KV
    (scale 0.5 read 3.0 as 1.5), so the scales are part of the layout
    fingerprint. Pools with the same scales still share."""
    shared = kvcore.HostStore(1 << 22) if store == "host" else None

    def fp8_pool(scales):
        s = shared if shared is not None else kvcore.DiskStore(tmp_path, 1 << 22)
        return kvcore.BlockPool(8, GEOMETRY["block_size"], GEOMETRY["num_layers"],
                                GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"],
                                dtype="float8_e4m3fn", kv_scales=scales, stores=[s])

    ones = [(1.0, 1.0)] * GEOMETRY["num_layers"]
    a = fp8_pool(ones)
    run(a, PROMPT)
    flush_pool(a)
    for other in ([(0.5, 1.0), (1.0, 1.0)], [(1.0, 1.0), (1.0, 2.0)]):
        b = fp8_pool(other)
        assert b.probe(PROMPT)["hit_tokens"] == 0, other
        check_hit(b, PROMPT, 0)
    check_hit(fp8_pool(ones), PROMPT, 4)
    assert _format.fingerprint("float8_e4m3fn", 4, 2, 2, 8, b"", kv_scales=ones) != \
        _format.fingerprint("float8_e4m3fn", 4, 2, 2, 8, b"", kv_scales=[(1.0, 1.0), (1.0, 2.0)])
    # pools without per-layer scales keep the fingerprint they had
    assert _format.fingerprint("float16", 4, 2, 2, 8, b"") == \
        _format.fingerprint("float16", 4, 2, 2, 8, b"", kv_scales=None)


def test_namespace_and_salt_isolation(tmp_path):
    a = make_pool(stores=[kvcore.DiskStore(tmp_path, 1 << 22, namespace="model-a")])
    b = make_pool(stores=[kvcore.DiskStore(tmp_path, 1 << 22, namespace="model-b")])
    run(a, PROMPT, salt="tenant-1")
    flush_pool(a)
    assert b.probe(PROMPT, salt="tenant-1")["hit_tokens"] == 0
    check_hit(b, PROMPT, 0, salt="tenant-1")
    check_hit(a, PROMPT, 0, salt="tenant-2")
    check_hit(a, PROMPT, 0)
    check_hit(a, PROMPT, 4, salt="tenant-1")


def test_salt_is_checked_in_the_entry_not_only_through_the_hash(tmp_path):
    """An entry filed under the key of another salt's block (as a hash
    collision would) is refused: its salt root and parent differ."""
    disk = kvcore.DiskStore(tmp_path, 1 << 22)
    pool = make_pool(stores=[disk])
    run(pool, PROMPT, salt="a")
    flush_pool(pool)
    fp = _format.fingerprint("float16", 4, 2, 2, 8, b"")
    ha = kvcore.block_hashes(PROMPT, 4, salt="a")
    hb = kvcore.block_hashes(PROMPT, 4, salt="b")
    for x, y in zip(ha, hb):
        (value,) = disk.get([_format.store_key(fp, x)])
        disk.put([(_format.store_key(fp, y), value)])
    with pytest.warns(kvcore.StoreWarning, match="mismatch"):
        check_hit(pool, PROMPT, 0, salt="b")


def test_concurrent_writers_of_the_same_key(tmp_path):
    pool = make_pool(stores=[kvcore.DiskStore(tmp_path / "src", 1 << 22)])
    run(pool, PROMPT)
    flush_pool(pool)
    src = pool.stores[0]
    items = [(bytes.fromhex(p.name[:-4]), p.read_bytes())
             for p in sorted((tmp_path / "src").rglob("*.kve"))]
    stores = [kvcore.DiskStore(tmp_path / "dst", 1 << 22) for _ in range(4)]
    errors = []

    def write(store):
        try:
            for _ in range(25):
                store.put(items)
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    # readers meanwhile only ever see whole entries
    reader = kvcore.DiskStore(tmp_path / "dst", 1 << 22)
    for _ in range(50):
        for (k, v), got in zip(items, reader.get([k for k, _ in items])):
            assert got is None or bytes(got) == v
    for t in threads:
        t.join()
    assert not errors
    assert len(reader) == 4
    assert not [p for p in (tmp_path / "dst").rglob(".tmp-*")]
    dst = make_pool(stores=[reader])
    check_hit(dst, PROMPT, 4)
    assert src.used_bytes() == reader.used_bytes()


def test_concurrent_writer_processes_of_the_same_key(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import numpy as np, kvcore
        from _stores_support import run, flush_pool, make_pool
        pool = make_pool(stores=[kvcore.DiskStore({str(tmp_path / 's')!r}, 1 << 22)])
        for _ in range(10):
            run(pool, np.arange(1, 18, dtype=np.int32))
            flush_pool(pool)
    """))
    procs = [subprocess.Popen([sys.executable, "-W", "error", str(script)]) for _ in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    pool = make_pool(stores=[kvcore.DiskStore(tmp_path / "s", 1 << 22)])
    check_hit(pool, PROMPT, 4)


# ------------------------------------------------------------ faults
@pytest.mark.parametrize("exc, condition", [(disk_full(), "disk full"),
                                            (permission_denied(), "permission denied"),
                                            (TimeoutError("slow"), "timeout"),
                                            (RuntimeError("bug"), "error")])
@pytest.mark.parametrize("fail", [("put",), ("contains",), ("get",)])
def test_store_faults_degrade_to_misses_with_one_warning(exc, condition, fail):
    plain = make_pool()
    store = FailingStore(1 << 20, exc, fail)
    pool = make_pool(stores=[store])
    prompts = [PROMPT, np.arange(200, 217, dtype=np.int32), PROMPT]
    with pytest.warns(kvcore.StoreWarning, match=condition) as record:
        for p in prompts:
            assert run(pool, p)[0] == run(plain, p)[0]
            flush_pool(plain)
            flush_pool(pool)
    assert len(record) == 1
    assert pool.stats()["stores"][0]["failures"] >= 1
    # the pool's own state is what a pool without stores has
    assert plain.debug.snapshot() == snapshot_without_stores(pool)
    pool.debug.check()


def test_broken_store_does_not_turn_out_of_blocks_into_anything_else():
    pool = make_pool(num_blocks=4, stores=[FailingStore(1 << 20, RuntimeError("x"),
                                                        ("contains", "get", "put"))])
    with pytest.raises(kvcore.OutOfBlocksError):
        kvcore.PagedKVCache(pool).allocate(np.arange(40, dtype=np.int32))
    pool.debug.check()


def test_entry_gone_between_contains_and_get_shortens_the_hit():
    class Vanishing(kvcore.HostStore):
        """Another process's LRU drops the third block between the two calls."""

        def get(self, keys):
            self.delete([keys[2]])
            return super().get(keys)

    host = Vanishing(1 << 20)
    pool = make_pool(stores=[host])
    run(pool, PROMPT)
    flush_pool(pool)
    snap_free = pool.num_free_blocks
    seq = kvcore.PagedKVCache(pool)
    assert seq.allocate(PROMPT) == 8            # blocks 0 and 1, verified, loaded
    assert pool.stats()["stores"][0]["hits"] == 2
    seq.free()
    assert pool.num_free_blocks == snap_free
    pool.debug.check()


# ------------------------------------------------------------ arguments
def test_bad_arguments():
    with pytest.raises(TypeError, match="stores must be a list"):
        make_pool(stores=kvcore.HostStore(10))
    with pytest.raises(TypeError, match=r"stores\[0\] must implement"):
        make_pool(stores=[object()])
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        kvcore.BlockPool(4, 4, 1, 1, 4, enable_prefix_caching=False,
                         stores=[kvcore.HostStore(10)])
    h = kvcore.HostStore(10)
    with pytest.raises(ValueError, match="twice"):
        make_pool(stores=[h, h])
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        kvcore.HostStore(0)
    with pytest.raises(TypeError, match="capacity_bytes must be an int"):
        kvcore.HostStore(1.5)
    with pytest.raises(TypeError, match="namespace"):
        kvcore.HostStore(10, namespace=3)
    with pytest.raises(ValueError, match=r"namespace must be text UTF-8 can encode, got "
                                         r"'a\\ud800' \(surrogates not allowed at index 1\)"):
        kvcore.HostStore(10, namespace="a\ud800")
    with pytest.raises(ValueError, match=r"hmac_key must be text UTF-8 can encode"):
        kvcore.HostStore(10, hmac_key="\udfff")
    with pytest.raises(TypeError, match="hmac_key"):
        kvcore.HostStore(10, hmac_key=b"")
    with pytest.raises(TypeError, match="path"):
        kvcore.DiskStore(3, 10)
    assert make_pool().stores == ()
    assert "stores" not in make_pool().stats()


def test_import_blocks_checks_sizes_before_writing():
    pool = make_pool()
    before = pool.storage.copy()
    good = store_port(pool).export_blocks([0])[0]
    with pytest.raises(ValueError, match=r"payloads\[1\] must hold"):
        store_port(pool).import_blocks([1, 2], [good, good[:-1]])
    # (each count named by its own argument: review, 2026-12-07)
    with pytest.raises(ValueError, match=r"^payloads must hold one entry per block \(2\), got 1$"):
        store_port(pool).import_blocks([1, 2], [good])
    with pytest.raises(ValueError, match=r"^seeds must hold one entry per block \(1\), got 2$"):
        store_port(pool).import_blocks([1], [good], seeds=[1, 2])
    assert np.array_equal(pool.storage, before)


def test_export_import_round_trip_every_dtype():
    for dtype in ("float32", "float16", "bfloat16"):
        pool = make_pool(dtype=dtype)
        rng = np.random.default_rng(1)
        pool.storage[...] = rng.integers(0, 2**15, pool.storage.shape).astype(pool.storage.dtype)
        payloads = store_port(pool).export_blocks([3, 5])
        assert all(p.nbytes == pool.bytes_per_block for p in payloads)
        store_port(pool).import_blocks([0, 1], payloads)
        assert np.array_equal(pool.storage[:, 0], pool.storage[:, 3])
        assert np.array_equal(pool.storage[:, 1], pool.storage[:, 5])


@pytest.mark.cuda
def test_cuda_pool_to_host_store_and_back():
    cuda_backend_or_skip()   # skips only without CuPy or a GPU
    host = kvcore.HostStore(1 << 20)
    pool = kvcore.BlockPool(8, 4, 2, 2, 8, dtype="float16", device="cuda", stores=[host])
    run(pool, PROMPT)
    flush_pool(pool)
    assert len(host) == 4
    seq = kvcore.PagedKVCache(pool)
    assert seq.allocate(PROMPT) == 16
    for layer, (k, v) in enumerate(expected_kv(pool, PROMPT, 16)):
        gk, gv = pool.gather(layer, seq.block_table, 0, 16)
        assert np.array_equal(gk.get(), k) and np.array_equal(gv.get(), v)
    seq.free()


def test_demo_second_run_hits_the_first_runs_prefixes(tmp_path):
    from kvcore.cli.demo import run_demo

    opts = dict(requests=3, prompt_len=64, new_tokens=4, store=f"disk:{tmp_path / 's'}")
    first = run_demo(**opts)
    assert first["ok"] and first["pool_stats"]["stores"][0]["hits"] == 0
    second = run_demo(**opts)
    assert second["ok"], second["message"]
    st = second["pool_stats"]
    assert st["stores"][0]["hit_tokens"] >= 64       # the shared prompt, at least
    assert st["prefix_hits"] > first["pool_stats"]["prefix_hits"]
    assert "prefix-store hits" in second["table"]


def test_flush_to_stores_keeps_the_cache_and_writes_every_cached_block(tmp_path):
    pool = make_pool(stores=[kvcore.DiskStore(tmp_path, 1 << 22)])
    assert pool.flush_to_stores() == 0
    run(pool, PROMPT)
    snap = pool.debug.snapshot()
    assert pool.flush_to_stores() == 4
    after = pool.debug.snapshot()
    after["stats"].pop("stores"), snap["stats"].pop("stores")
    assert after == snap
    other = make_pool(stores=[kvcore.DiskStore(tmp_path, 1 << 22)])
    check_hit(other, PROMPT, 4)
    assert make_pool().flush_to_stores() == 0


def test_wait_spills_waits_for_the_queued_spills_and_changes_nothing(tmp_path):
    gate = threading.Event()

    class SlowDisk(kvcore.DiskStore):
        def put(self, items):
            gate.wait(30)
            return super().put(items)

    disk = SlowDisk(tmp_path, 1 << 22)
    pool = make_pool(stores=[disk])
    assert pool.wait_spills() and pool.wait_spills(0)     # nothing queued yet
    run(pool, PROMPT)
    seq = kvcore.PagedKVCache(pool)       # fresh tokens evict the prompt's 4 blocks
    seq.allocate(np.arange(10**6, 10**6 + pool.num_blocks * pool.block_size, dtype=np.int32))
    seq.free()
    snap = pool.debug.snapshot()
    assert pool.wait_spills(timeout=0.05) is False        # the worker's put is held
    assert len(disk) == 0 and pool.stats()["stores"][0]["puts"] == 0
    gate.set()
    assert pool.wait_spills(float("inf")) is True     # (inf: no limit, as None)
    assert len(disk) == 4 and pool.stats()["stores"][0]["puts"] == 4
    after = pool.debug.snapshot()
    after["stats"].pop("stores"), snap["stats"].pop("stores")
    assert after == snap                  # (only the stores' counters moved)
    check_hit(pool, PROMPT, 4)
    assert make_pool().wait_spills() is True


@pytest.mark.parametrize("method", ["wait_spills", "flush_to_stores", "close"])
@pytest.mark.parametrize("timeout, error, words", [
    ("1", TypeError, "timeout must be None or a number of seconds, got str"),
    (True, TypeError, "got bool"),
    (-1, ValueError, "timeout must be a number of seconds >= 0, got -1"),
    (float("nan"), ValueError, "got nan"),
])
def test_store_waits_refuse_a_bad_timeout_by_name(tmp_path, method, timeout, error, words):
    for pool in (make_pool(stores=[kvcore.DiskStore(tmp_path, 1 << 22)]), make_pool()):
        run(pool, PROMPT)
        snap = pool.debug.snapshot()
        with pytest.raises(error, match=words):
            getattr(pool, method)(timeout)
        assert pool.debug.snapshot() == snap


def test_a_store_returning_garbage_types_is_a_miss_not_an_exception():
    class Odd(kvcore.HostStore):
        def contains(self, keys):
            return "many"                  # not an int

        def get(self, keys):
            return [object() for _ in keys]

        def put(self, items):
            super().put(items)
            return [(b"k", object())]      # a dropped "entry" that is no entry

    nxt = kvcore.HostStore(1 << 20, namespace="other")   # re-encoding path
    pool = make_pool(stores=[Odd(1 << 20), nxt])
    with pytest.warns(kvcore.StoreWarning):
        run(pool, PROMPT)
        flush_pool(pool)
        seq = kvcore.PagedKVCache(pool)
        assert seq.allocate(PROMPT) == 0
        seq.free()
    pool.debug.check()
    assert pool.num_free_blocks == pool.num_blocks
