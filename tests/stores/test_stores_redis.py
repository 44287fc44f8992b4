"""RedisStore against a real redis-server (started here on a free loopback
port, data in a temporary directory, stopped at the end).  Without
redis-server or redis-py these tests skip, except under KVCORE_REQUIRE_REDIS=1
(.ci/run), where they fail."""
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import kvcore
from kvcore.stores import _format

from _helpers import run_script_phases, snapshot_without_stores
from _stores_support import (TESTS, RedisServer, check_hit, flush_pool, make_pool, peer_script,
                             run)

PROMPT = np.arange(1, 18, dtype=np.int32)


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


def redis_pool(server, **kw):
    store = kvcore.RedisStore(server.url, namespace=kw.pop("namespace", "t"),
                              timeout=kw.pop("timeout", 1.0), **kw)
    return make_pool(stores=[store]), store


def test_spill_and_hit_bit_exact(server):
    pool, store = redis_pool(server)
    run(pool, PROMPT)
    flush_pool(pool)
    keys = server.client().keys("kvcore:t:*")
    assert len(keys) == 4
    check_hit(pool, PROMPT, 4)
    st = pool.stats()["stores"][0]
    assert st["kind"] == "redis" and st["hits"] == 4 and st["failures"] == 0
    assert st["bytes_in"] == st["bytes_out"] == sum(len(server.client().get(k)) for k in keys)




def test_two_processes_share_a_redis_store(server, tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(peer_script(f"kvcore.RedisStore({server.url!r}, namespace='shared')"))
    run_script_phases(script, ("compute", "hit"))


def test_redis_killed_mid_run_then_restarted(server):
    pool, store = redis_pool(server, timeout=0.5, retry_interval=0.2)
    plain = make_pool()
    run(pool, PROMPT)
    run(plain, PROMPT)
    server.stop()
    # evictions (puts) and lookups while the server is down: misses, one
    # warning, the pool exactly as a pool without stores
    with pytest.warns(kvcore.StoreWarning, match="unreachable") as record:
        for p in (np.arange(300, 329, dtype=np.int32), PROMPT):
            for q in (pool, plain):
                run(q, p)
                flush_pool(q)
            time.sleep(0.25)          # past the retry interval: the store is tried again
    assert len(record) == 1
    assert pool.stats()["stores"][0]["failures"] >= 2
    assert plain.debug.snapshot() == snapshot_without_stores(pool)
    # the server comes back (empty: no persistence): misses, then hits again
    server.start()
    time.sleep(0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(pool, PROMPT)[0] == 0
        flush_pool(pool)
        check_hit(pool, PROMPT, 4)
    pool.debug.check()


def test_slow_redis_times_out_into_misses(server):
    pool, store = redis_pool(server, timeout=0.5, retry_interval=5.0)
    run(pool, PROMPT)
    flush_pool(pool)
    # a server that stops answering (SIGSTOP) is a slow one: every call times out
    server.proc.send_signal(19)
    try:
        t0 = time.monotonic()
        with pytest.warns(kvcore.StoreWarning, match="timeout"):
            seq = kvcore.PagedKVCache(pool)
            assert seq.allocate(PROMPT) == 0
        assert 0.5 <= time.monotonic() - t0 < 3       # one timeout, not one per block
        seq.free()
        # within the retry interval the store is not asked again: no wait
        t0 = time.monotonic()
        seq = kvcore.PagedKVCache(pool)
        assert seq.allocate(PROMPT) == 0
        assert time.monotonic() - t0 < 0.4            # less than one timeout
        seq.free()
    finally:
        server.proc.send_signal(18)
    pool.debug.check()


@pytest.mark.parametrize("where", ["payload", "header", "truncate", "garbage", "wrongtype",
                                   "empty"])
def test_corrupt_entry_in_redis_is_a_miss_with_a_warning(server, where):
    """A damaged entry is a miss from that block on; the blocks before it hit
    (a key of another type too: the batch's other keys still count)."""
    pool, store = redis_pool(server)
    run(pool, PROMPT)
    flush_pool(pool)
    client = server.client()
    fp = _format.fingerprint("float16", 4, 2, 2, 8, b"t")
    key = b"kvcore:t:" + _format.store_key(fp, kvcore.block_hashes(PROMPT, 4)[1]).hex().encode()
    value = bytearray(client.get(key))
    if where == "truncate":
        value = value[:100]
    elif where == "garbage":
        value = bytearray(b"not an entry")
    elif where == "empty":      # (get_bounded took it for a missing key: a silent miss)
        value = bytearray()
    else:
        value[-3 if where == "payload" else 20] ^= 1
    if where == "wrongtype":
        client.delete(key)
        client.rpush(key, b"not an entry")
    else:
        client.set(key, bytes(value))
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, PROMPT, 1)
    assert pool.stats()["stores"][0]["rejected"] == 1


def test_a_value_planted_huge_is_read_only_as_far_as_an_entry_reaches(server, monkeypatch):
    """A value grown far past any entry of the pool (SETRANGE) is a corrupt
    miss read through ``get_bounded``: the pool never asks for it whole."""
    pool, store = redis_pool(server)
    run(pool, PROMPT)
    flush_pool(pool)
    client = server.client()
    fp = _format.fingerprint("float16", 4, 2, 2, 8, b"t")
    skeys = [_format.store_key(fp, h) for h in kvcore.block_hashes(PROMPT, 4)]
    key = b"kvcore:t:" + skeys[1].hex().encode()
    entry = client.get(key)
    client.setrange(key, 8 << 20, b"x")                     # 8 MiB and a byte
    asked = []
    real = kvcore.RedisStore.get_bounded

    def spy(self, keys, max_bytes):
        got = real(self, keys, max_bytes)
        asked.append((max_bytes, [None if v is None else len(v) for v in got]))
        return got

    def whole(self, keys):
        raise AssertionError("the pool read values whole")

    monkeypatch.setattr(kvcore.RedisStore, "get_bounded", spy)
    monkeypatch.setattr(kvcore.RedisStore, "get", whole)
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, PROMPT, 1)
    assert pool.stats()["stores"][0]["rejected"] == 1
    # the bound: the largest entry this pool makes (signed or not), far below the value
    limit = asked[0][0]
    assert len(entry) <= limit < len(entry) + 64 and limit < 1 << 20
    assert all(n is None or n <= limit for _, sizes in asked for n in sizes)
    pool.debug.check()
    # the store on its own: within the bound the value as it is, past it b""
    monkeypatch.undo()
    head = skeys[0]
    whole_value = store.get([head])[0]
    assert store.get_bounded([head, skeys[1], b"\0" * 32], len(whole_value)) == \
        [whole_value, b"", None]
    assert store.get_bounded([head], len(whole_value) - 1) == [b""]
    with pytest.raises(ValueError, match="max_bytes must be a positive int, got 0"):
        store.get_bounded([head], 0)
    client.delete(key)
    client.rpush(key, b"not an entry")                       # another type: corrupt
    assert store.get_bounded([skeys[1]], 1000) == [b""]
    client.delete(key)
    client.set(key, b"")                                     # empty: corrupt, as get finds it
    assert store.get([skeys[1]]) == [b""]
    assert store.get_bounded([skeys[1], b"\1" * 32], 1000) == [b"", None]
    # a bound past what Redis' GETRANGE takes (an int64) reads the value whole
    for bound in (2**63, 2**64, 10**5000):
        assert store.get_bounded([head], bound) == [whole_value]


def test_get_bounded_a_key_written_between_its_rounds_is_a_miss_not_corrupt(server):
    """A key missing at the STRLEN round, then written by another client
    (a peer spilling it) before the round that tells a missing key from an
    empty value, is a miss: not a corrupt entry (a rejection and a warning
    for a good entry).  A key still empty, or emptied, is corrupt (so is one
    planted with another type meanwhile: not an error for the whole batch);
    one deleted in between a miss."""
    store = kvcore.RedisStore(server.url, namespace="race", timeout=1.0)
    client = server.client()
    keys = [bytes([i]) * 32 for i in range(5)]
    redis_keys = [store._key(k) for k in keys]
    client.set(redis_keys[1], b"")
    client.set(redis_keys[2], b"")
    real = store._run
    rounds = []

    def racing(commands):
        got = real(commands)
        if not rounds:          # after the STRLEN / GETRANGE round: peers act
            client.set(redis_keys[0], b"a good entry")       # missing -> written
            client.delete(redis_keys[2])                      # empty -> deleted
            client.set(redis_keys[3], b"")                    # missing -> empty
            client.rpush(redis_keys[4], b"x")                 # missing -> another type
        rounds.append([c[0] for c in commands])
        return got

    store._run = racing
    assert store.get_bounded(keys, 1000) == [None, b"", None, b"", b""]
    assert len(rounds) == 2
    store.close()


def test_a_subclass_that_overrides_get_is_read_through_its_get(server):
    """A RedisStore subclass overriding only ``get`` (here: values kept
    compressed) is read through that ``get``: the pool's bounded read
    (``get_bounded``, inherited) would bypass it and find every entry
    corrupt."""
    import zlib

    class Zipped(kvcore.RedisStore):
        def put(self, items):
            return super().put([(k, zlib.compress(bytes(v))) for k, v in items])

        def get(self, keys):
            return [None if v is None else zlib.decompress(bytes(v)) for v in super().get(keys)]

    pool = make_pool(stores=[Zipped(server.url, namespace="zip")])
    run(pool, PROMPT)
    flush_pool(pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvcore.StoreWarning)
        check_hit(pool, PROMPT, 4)
    assert pool.stats()["stores"][0]["hits"] == 4
    pool.debug.check()


def test_a_value_changed_between_strlen_and_getrange_is_a_miss_not_corrupt(server):
    """get_bounded reads a value's length, then its bytes (two commands that
    another client's may come between): a value deleted or rewritten
    between them is a miss, as ``get`` would find it, not a corrupt entry
    (a StoreWarning for a plain eviction)."""
    pool, store = redis_pool(server)
    run(pool, PROMPT)
    flush_pool(pool)
    fp = _format.fingerprint("float16", 4, 2, 2, 8, b"t")
    skeys = [_format.store_key(fp, h) for h in kvcore.block_hashes(PROMPT, 4)]
    client = server.client()
    real = store._client
    head, entry = store.get(skeys[:2])

    class Between:
        """The store's client, with another client's commands run between
        the STRLENs and the GETRANGEs of a pipeline: ``then(client)``."""
        def __init__(self, then):
            self.then = then

        def pipeline(self, transaction=True):
            outer = self
            queued = []

            class Pipe:
                def execute_command(self, *command):
                    queued.append(command)

                def execute(self, raise_on_error=True):
                    out = [None] * len(queued)
                    for name in ("STRLEN", "GETRANGE"):
                        p = real.pipeline(transaction=False)
                        idx = [j for j, c in enumerate(queued) if c[0] == name]
                        for j in idx:
                            p.execute_command(*queued[j])
                        for j, v in zip(idx, p.execute(raise_on_error=raise_on_error)):
                            out[j] = v
                        if name == "STRLEN":
                            outer.then(client)
                    return out
            return Pipe()

    key = b"kvcore:t:" + skeys[1].hex().encode()
    store._client = Between(lambda c: c.delete(key))          # evicted in between
    assert store.get_bounded([skeys[0], skeys[1]], 1 << 20) == [head, None]
    client.set(key, entry)
    store._client = Between(lambda c: c.set(key, entry[:100]))   # rewritten shorter
    assert store.get_bounded([skeys[1]], 1 << 20) == [None]
    client.set(key, entry)
    store._client = Between(lambda c: c.set(key, entry + b"x" * 10))   # rewritten longer
    assert store.get_bounded([skeys[1]], 1 << 20) == [None]
    store._client = real


def test_hmac(server):
    signed, _ = redis_pool(server, hmac_key=b"secret-1")
    run(signed, PROMPT)
    flush_pool(signed)
    check_hit(signed, PROMPT, 4)
    flush_pool(signed)
    # another key: refused
    other, _ = redis_pool(server, hmac_key=b"secret-2")
    with pytest.warns(kvcore.StoreWarning, match="hmac"):
        check_hit(other, PROMPT, 0)
    # an unsigned entry where a key is required: refused
    unsigned, _ = redis_pool(server, namespace="u")
    run(unsigned, PROMPT)
    flush_pool(unsigned)
    wants_sig, _ = redis_pool(server, namespace="u", hmac_key=b"secret-1")
    with pytest.warns(kvcore.StoreWarning, match="hmac"):
        check_hit(wants_sig, PROMPT, 0)
    # a forged entry: KV changed and the checksum fixed up, the HMAC cannot be
    client = server.client()
    fp = _format.fingerprint("float16", 4, 2, 2, 8, b"t")
    h0 = kvcore.block_hashes(PROMPT, 4)[0]
    key = b"kvcore:t:" + _format.store_key(fp, h0).hex().encode()
    value = bytearray(client.get(key))
    value[-1] ^= 1
    head = _format.PREFIX_SIZE + 8 + _format.MAC_SIZE
    seed = _format.header_seed(bytes(value[:_format.PREFIX_SIZE]), bytes(value[head:head + 16]))
    value[_format.PREFIX_SIZE:_format.PREFIX_SIZE + 8] = _format.payload_checksum(
        bytes(value[head + 16:]), seed).to_bytes(8, "little")
    client.set(key, bytes(value))
    fresh, _ = redis_pool(server, hmac_key=b"secret-1")
    with pytest.warns(kvcore.StoreWarning, match="HMAC mismatch"):
        check_hit(fresh, PROMPT, 0)


def test_namespace_and_salt_isolation(server):
    a, _ = redis_pool(server, namespace="a")
    b, _ = redis_pool(server, namespace="b")
    run(a, PROMPT, salt="s1")
    flush_pool(a)
    check_hit(b, PROMPT, 0, salt="s1")
    check_hit(a, PROMPT, 0, salt="s2")
    check_hit(a, PROMPT, 0)
    check_hit(a, PROMPT, 4, salt="s1")


def test_concurrent_writers_of_the_same_key(server, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import numpy as np, kvcore
        from _stores_support import run, flush_pool, make_pool
        pool = make_pool(stores=[kvcore.RedisStore({server.url!r}, namespace="c")])
        for _ in range(10):
            run(pool, np.arange(1, 18, dtype=np.int32))
            flush_pool(pool)
    """))
    procs = [subprocess.Popen([sys.executable, "-W", "error", str(script)]) for _ in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    pool, _ = redis_pool(server, namespace="c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_hit(pool, PROMPT, 4)


def test_ttl_expires_entries(server):
    # (a TTL a busy machine's stall between the flush and the first probe
    # does not outlast)
    pool, store = redis_pool(server, ttl=1.5)
    run(pool, PROMPT)
    flush_pool(pool)
    assert pool.probe(PROMPT)["store_hit_tokens"] == 16
    time.sleep(1.8)
    assert pool.probe(PROMPT)["store_hit_tokens"] == 0


def test_host_disk_redis_tiers(server, tmp_path):
    size = _format.PREFIX_SIZE + 8 + 16 + make_pool().bytes_per_block
    host = kvcore.HostStore(2 * size)
    disk = kvcore.DiskStore(tmp_path / "d", 2 * size)
    redis_store = kvcore.RedisStore(server.url, namespace="tiers")
    pool = make_pool(stores=[host, disk, redis_store])
    run(pool, PROMPT)
    flush_pool(pool)
    assert (len(host), len(disk)) == (2, 2)
    assert len(server.client().keys("kvcore:tiers:*")) == 0   # nothing dropped yet past disk
    run(pool, np.arange(700, 717, dtype=np.int32))
    flush_pool(pool)
    assert len(server.client().keys("kvcore:tiers:*")) == 4
    check_hit(pool, PROMPT, 4)
    st = pool.stats()["stores"]
    assert sum(s["hits"] for s in st) == 4 and st[2]["hits"] >= 2


def test_redis_store_arguments(server):
    with pytest.raises(ValueError, match="ttl"):
        kvcore.RedisStore(server.url, ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        kvcore.RedisStore(server.url, timeout=-1)
    with pytest.raises(ValueError, match="retry_interval"):
        kvcore.RedisStore(server.url, retry_interval=-1)
    # an int too long to print (or to make a float) is named: no nameless
    # "Exceeds the limit (4300 digits)" ValueError, nor OverflowError
    for arg, value in (("ttl", 10**5000), ("ttl", -10**5000), ("timeout", 10**5000),
                       ("retry_interval", 10**5000), ("retry_interval", -10**5000)):
        with pytest.raises(ValueError, match=rf"^{arg} must be .*, got an? (negative )?"
                                             r"integer of 16610 bits$"):
            kvcore.RedisStore(server.url, **{arg: value})
    for node, shown in ((("localhost", 10**5000), "an integer of 16610 bits"),
                        ("localhost:" + "9" * 5000, "99999999999999999999...")):
        with pytest.raises(ValueError, match=rf"^startup_nodes\[0\] has port {shown}"):
            kvcore.RedisStore.cluster([node])
    # a port of digits int() does not read ('\u00b2' is one to str.isdigit) is named;
    # zeros before a port in range do not put it out of range
    from kvcore.stores.redis_store import _startup_nodes
    for node in ("localhost:\u00b2", "localhost:\u0663\u0663"):
        with pytest.raises(ValueError, match=r"^startup_nodes\[0\] must be 'host:port', got"):
            kvcore.RedisStore.cluster([node])
    assert _startup_nodes(["localhost:0000007000"]) == [("localhost", 7000)]
    with pytest.raises(ValueError, match=r"^startup_nodes\[0\] has port 0, not in"):
        _startup_nodes(["localhost:0000000"])
    with pytest.raises(TypeError, match="url"):
        kvcore.RedisStore(42)
    client = server.client()
    store = kvcore.RedisStore(client, namespace="c")
    assert store.client is client


def test_a_slow_redis_does_not_slow_another_threads_allocate_and_append(server):
    """A Redis that answers after 2 s: the spills to it run on the pool's
    store worker, so a second thread's allocate/reserve/append on the same
    pool (whose own evictions spill too) takes milliseconds, not seconds
    (before: every spill put ran under the pool's lock)."""
    import threading

    from _stores_support import DelayProxy

    proxy = DelayProxy(server.port)
    try:
        store = kvcore.RedisStore(proxy.url, namespace="slow", timeout=8.0)
        pool = make_pool(num_blocks=16, stores=[store])
        prompts = [np.arange(100 * j + 1, 100 * j + 17, dtype=np.int32) for j in range(4)]
        for p in prompts:
            run(pool, p)            # 16 cached blocks, nothing else free
        assert pool.num_cached_blocks == 16
        a = kvcore.PagedKVCache(pool)
        a.allocate(np.array([7, 7, 7], np.int32))     # (no full block: no lookup)
        proxy.delay = 2.0
        started = threading.Event()

        def grow():
            started.set()
            a.reserve(12)           # evicts cached blocks: a spill to the slow Redis

        t = threading.Thread(target=grow)
        t.start()
        started.wait()
        time.sleep(0.3)
        t0 = time.perf_counter()
        for j in range(4):
            b = kvcore.PagedKVCache(pool)
            b.allocate(np.array([9, 9, 1000 + j], np.int32))   # evicts: spills
            b.reserve(8)
            k, v = (np.ones((8, pool.num_kv_heads, pool.head_dim), np.float32),) * 2
            for layer in range(pool.num_layers):
                b.append(layer, k, v)
            b.commit(8)
            b.free()
        took = time.perf_counter() - t0
        t.join(30)
        assert took < 1.0, f"the second thread took {took:.2f} s behind a 2 s Redis"
        proxy.delay = 0.0
        a.free()
        pool.close()                # the queued spills reach Redis
        st = pool.stats()["stores"][0]
        assert st["failures"] == 0 and st["spills_dropped"] == 0 and st["puts"] > 0
        pool.debug.check()
        check_hit(pool, prompts[0], 3)   # evicted first, found in Redis, bit exact
    finally:
        proxy.close()


@pytest.mark.parametrize("parser", ["hiredis", "python"])
def test_entries_larger_than_a_socket_read_come_back_whole(server, parser):
    """A store made from a URL reads its socket 1 MiB at a time (fewer GIL
    round trips beside busy threads); entries of several reads, and many
    small ones in one read, come back byte for byte through either of
    redis-py's parsers (hiredis, which kvcore[redis] installs, or its own)."""
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE
    if parser == "hiredis" and not HIREDIS_AVAILABLE:
        why = "hiredis is not installed, or too old for this redis-py (3.2 or later)"
        if os.environ.get("KVCORE_REQUIRE_REDIS", "") not in ("", "0"):
            pytest.fail(f"{why}: pip install 'kvcore[redis]' brings it")
        pytest.skip(why)
    store = kvcore.RedisStore(server.url, namespace="big")
    kwargs = store.client.connection_pool.connection_kwargs
    assert kwargs["socket_read_size"] == 1 << 20
    kwargs["parser_class"] = _HiredisParser if parser == "hiredis" else _RESP2Parser
    rng = np.random.default_rng(5)
    entries = [(rng.bytes(16), rng.bytes(n)) for n in (3 << 20 | 5, 1 << 20, 17, 0)]
    entries += [(rng.bytes(16), rng.bytes(int(n))) for n in rng.integers(1, 40000, 300)]
    store.put(entries)
    keys = [k for k, _ in entries]
    assert store.contains(keys) == len(keys)
    assert store.get(keys) == [v for _, v in entries]
    # a connection of the store's pool, as the store's commands got theirs
    # (redis-py's own parser is its RESP3 one where the server speaks RESP3)
    pool = store.client.connection_pool
    conn = pool.connection_class(**kwargs)
    assert isinstance(conn._parser, _HiredisParser) == (parser == "hiredis")
    assert conn._parser.socket_read_size == 1 << 20
    # over TLS a read returns a 16 KiB record at most: redis-py's default
    # reads, no larger buffer per connection
    tls = kvcore.RedisStore(server.url.replace("redis://", "rediss://"), namespace="big")
    assert "socket_read_size" not in tls.client.connection_pool.connection_kwargs
