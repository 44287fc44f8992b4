"""RedisStore on a real Redis Cluster: 3 masters (and a replica for the
failover test) started here on free loopback ports, data in temporary
directories, stopped at the end even when a test fails.  Without
redis-server, redis-cli or redis-py these tests skip, except under
KVCORE_REQUIRE_REDIS=1 (.ci/run), where they fail."""
import os
import shutil
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import kvcore
from kvcore.stores import _format

from _stores_support import (check_hit, flush_pool, free_port, free_ports, make_pool,
                             peer_script, require_redis, run)

NODE_TIMEOUT_MS = 500        # how soon the cluster declares a dead master failed
TIMEOUT = 0.5                # the stores' socket timeout
RETRY = 0.3                  # the stores' retry_interval


def require_cluster():
    """(redis-server, redis-cli, redis module); skips without them, fails
    under KVCORE_REQUIRE_REDIS=1 (as require_redis does)."""
    server, redis = require_redis()
    cli = shutil.which("redis-cli")
    if cli is None:
        if os.environ.get("KVCORE_REQUIRE_REDIS", "") not in ("", "0"):
            pytest.fail("KVCORE_REQUIRE_REDIS=1 but redis-cli is missing")
        pytest.skip("needs redis-cli (apt-get install redis-server)")
    return server, cli, redis


class _PortTaken(RuntimeError):
    """A cluster node exited as it started: its port was taken."""


class LocalCluster:
    """A Redis Cluster of ``masters`` masters on 127.0.0.1, plus one replica
    for each master index in ``replicas_of``."""

    def __init__(self, directory, masters=3, replicas_of=()):
        self.server, self.cli, self.redis = require_cluster()
        self.directory = str(directory)
        self.masters = masters
        self.replicas_of = tuple(replicas_of)
        self.procs = {}                   # port -> Popen
        self.bus_ports = {}               # port -> its cluster bus port

    def _spawn(self, port, bus_port):
        d = os.path.join(self.directory, str(port))
        os.makedirs(d, exist_ok=True)
        self.bus_ports[port] = bus_port
        self.procs[port] = subprocess.Popen(
            [self.server, "--port", str(port), "--cluster-port", str(self.bus_ports[port]),
             "--bind", "127.0.0.1", "--protected-mode", "no", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
             str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
             "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0",
             "--save", "", "--appendonly", "no", "--dir", d],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _started(self, port):
        if self.procs[port].poll() is not None:
            raise _PortTaken(f"redis-server on {port} exited at start "
                             f"(status {self.procs[port].returncode})")
        return self.node(port).ping()

    def node(self, port):
        return self.redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def _wait(self, what, cond, seconds=20):
        deadline = time.monotonic() + seconds
        while True:
            try:
                if cond():
                    return
            except self.redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"local Redis Cluster: {what} within {seconds} s")
            time.sleep(0.05)

    def start(self):
        """Start the nodes and make the cluster.  A node that exits at once
        (another process took its port between the pick and its bind) makes
        the nodes start again on other ports, up to 3 times."""
        for attempt in range(3):
            try:
                return self._start()
            except _PortTaken:
                if attempt == 2:
                    raise

    def _start(self):
        try:
            n = self.masters + len(self.replicas_of)
            picked = free_ports(2 * n)          # data and bus ports, all distinct
            self.ports = picked[:n]
            for p, bus in zip(self.ports, picked[n:]):
                self._spawn(p, bus)
            for p in self.ports:
                self._wait(f"redis-server on {p} did not start",
                           lambda: self._started(p))
            self.master_ports = self.ports[:self.masters]
            r = subprocess.run([self.cli, "--cluster", "create"]
                               + [f"127.0.0.1:{p}" for p in self.master_ports]
                               + ["--cluster-replicas", "0", "--cluster-yes"],
                               capture_output=True, text=True, timeout=60)
            if r.returncode:
                raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout}{r.stderr}")
            self.ids = {p: self.node(p).execute_command("CLUSTER MYID").decode()
                        for p in self.master_ports}
            self.replica_of = {}              # replica port -> its master's port
            for m, p in zip(self.replicas_of, self.ports[self.masters:]):
                master = self.master_ports[m]
                master_id = self.ids[master]
                self.ids[p] = self.node(p).execute_command("CLUSTER MYID").decode()
                self.replica_of[p] = master
                # introduced to every master, not only its own: gossip alone
                # may not have told the others of it by the time its master
                # dies, and then they never vote for it (nor hear of its
                # promotion): no failover at all
                for q in [master] + [q for q in self.master_ports if q != master]:
                    self.node(p).execute_command("CLUSTER MEET", "127.0.0.1", q,
                                                 self.bus_ports[q])
                self._wait("a replica did not learn its master", lambda: any(
                    n["node_id"] == master_id
                    for n in self.node(p).execute_command("CLUSTER NODES").values()))
                self.node(p).execute_command("CLUSTER REPLICATE", master_id)
                self._wait("a replica did not sync", lambda: self.node(p).info(
                    "replication").get("master_link_status") == "up")
            for p in self.ports:
                self._wait(f"the node on {p} does not know every node as what it is",
                           lambda: self._knows_all(p))
                self._wait("the cluster is not ok", lambda: self.node(p).execute_command(
                    "CLUSTER INFO")["cluster_state"] == "ok")
            self.slots = [(start, end, int(master[1])) for start, end, master, *_ in
                          self.node(self.master_ports[0]).execute_command("CLUSTER SLOTS")]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(10)
        self.procs = {}

    def kill(self, port):
        self.procs[port].kill()
        self.procs[port].wait(10)

    def _knows_all(self, port):
        """Whether the node on ``port`` knows every node of the cluster (none
        in a handshake or suspected of failing), each replica as a replica
        of its master."""
        seen = {n["node_id"]: n for n in
                self.node(port).execute_command("CLUSTER NODES").values()}
        for p, node_id in self.ids.items():
            n = seen.get(node_id)
            if n is None:
                return False
            flags = set(n["flags"].split(","))
            if flags & {"handshake", "noaddr", "fail", "fail?"}:
                return False
            if p in self.replica_of and (
                    "slave" not in flags or n["master_id"] != self.ids[self.replica_of[p]]):
                return False
        return True

    def role(self, port):
        """``ROLE``'s first field for the node on ``port`` ("master",
        "slave"), or None when it does not answer."""
        try:
            return self.node(port).execute_command("ROLE")[0].decode()
        except self.redis.exceptions.RedisError:
            return None

    def views(self, dead=None):
        """What every live node says of the cluster (CLUSTER NODES, or the
        error): for a failure message when a failover did not happen."""
        out = {}
        for p in self.ports:
            if p == dead or self.procs.get(p) is None or self.procs[p].poll() is not None:
                continue
            try:
                out[p] = self.node(p).execute_command("CLUSTER NODES")
            except self.redis.exceptions.RedisError as e:
                out[p] = repr(e)
        return out

    @property
    def startup(self):
        return [f"127.0.0.1:{p}" for p in self.master_ports]

    def store(self, **kw):
        return kvcore.RedisStore.cluster(self.startup, namespace=kw.pop("namespace", "t"),
                                         timeout=kw.pop("timeout", TIMEOUT),
                                         retry_interval=kw.pop("retry_interval", RETRY), **kw)

    def owner(self, key):
        """The port of the master that owned ``key``'s slot when the
        cluster was made (CLUSTER SLOTS then, the slot by the spec's CRC16)."""
        from redis.crc import key_slot
        slot = key_slot(key)
        for start, end, port in self.slots:
            if start <= slot <= end:
                return port
        return None


class Failover:
    """Brings ``replica`` in for its master ``dead`` (just killed), one step
    per :meth:`poll`: Redis's own failover alone for AUTO_S seconds (about
    2 s on an idle machine), then ``CLUSTER FAILOVER FORCE`` on the replica
    (an election without its dead master), then after FORCE_S more seconds
    ``CLUSTER FAILOVER TAKEOVER`` (no election at all), sent again every
    TAKEOVER_EVERY_S seconds until the replica says it is master.  It is
    *done* once the replica says master and every live node, the replica
    included, is ok and maps the dead master's slots to the replica."""

    AUTO_S = 15.0
    FORCE_S = 10.0
    TAKEOVER_EVERY_S = 5.0
    DEADLINE_S = 60.0         # for it to be done at all

    def __init__(self, cluster, replica, dead):
        self.t0 = time.monotonic()
        self.c, self.replica, self.dead = cluster, replica, dead
        self.ranges = [(start, end) for start, end, port in cluster.slots if port == dead]
        self.live = [p for p in cluster.ports if p != dead]
        self.steps = []           # (seconds after the kill, command sent, its answer)
        self.done = None          # seconds after the kill when it was done
        self._takeover = None     # when TAKEOVER was last sent

    def _send(self, how, now):
        try:
            answer = self.c.node(self.replica).execute_command("CLUSTER FAILOVER", how)
        except self.c.redis.exceptions.RedisError as e:
            answer = e
        self.steps.append((round(now, 1), f"CLUSTER FAILOVER {how}", answer))

    def _agreed(self):
        try:
            if self.c.role(self.replica) != "master":
                return False
            for p in self.live:
                node = self.c.node(p)
                if node.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                    return False
                owners = [(int(start), int(end), int(master[1])) for start, end, master, *_
                          in node.execute_command("CLUSTER SLOTS")]
                if not all(any(s <= start and end <= e and port == self.replica
                               for s, e, port in owners) for start, end in self.ranges):
                    return False
            return True
        except self.c.redis.exceptions.RedisError:
            return False

    def poll(self):
        """Seconds after the kill when it was done, or None (and the next
        step taken when its time has come)."""
        if self.done is None:
            now = time.monotonic() - self.t0
            if self._agreed():
                self.done = now
            elif self.c.role(self.replica) != "master":
                if now >= self.AUTO_S and not self.steps:
                    self._send("FORCE", now)
                elif now >= self.AUTO_S + self.FORCE_S and (
                        self._takeover is None or now - self._takeover >= self.TAKEOVER_EVERY_S):
                    self._takeover = now
                    self._send("TAKEOVER", now)
        return self.done


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture
def fresh_cluster(tmp_path):
    clusters = []

    def make(**kw):
        c = LocalCluster(tmp_path / f"c{len(clusters)}", **kw)
        clusters.append(c)
        return c.start()

    yield make
    for c in clusters:
        c.stop()


def store_key(prompt, block, namespace="t"):
    """The store's key of ``prompt``'s block ``block`` in make_pool's layout."""
    fp = _format.fingerprint("float16", 4, 2, 2, 8, namespace.encode())
    return _format.store_key(fp, kvcore.block_hashes(np.asarray(prompt, np.int32), 4)[block])


def redis_key(prompt, block, namespace="t"):
    """The Redis key the store files that block under."""
    return (b"kvcore:" + namespace.encode() + b":"
            + store_key(prompt, block, namespace).hex().encode())


LONG = np.arange(1, 42, dtype=np.int32)           # 10 full blocks (the last token never hits)


# ------------------------------------------------------------ no cluster needed
def test_missing_tools_fail_under_kvcore_require_redis(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))           # no redis-server, no redis-cli
    monkeypatch.setenv("KVCORE_REQUIRE_REDIS", "1")
    with pytest.raises(pytest.fail.Exception, match="KVCORE_REQUIRE_REDIS=1 but redis-server"):
        require_cluster()
    monkeypatch.setenv("KVCORE_REQUIRE_REDIS", "0")
    with pytest.raises(pytest.skip.Exception):
        require_cluster()
    # redis-server present, redis-cli missing
    os.symlink(sys.executable, tmp_path / "redis-server")
    monkeypatch.setenv("KVCORE_REQUIRE_REDIS", "1")
    pytest.importorskip("redis")
    with pytest.raises(pytest.fail.Exception, match="redis-cli is missing"):
        require_cluster()
    # redis-py missing
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(pytest.fail.Exception, match="redis-py is missing"):
        require_cluster()


def test_cluster_store_arguments():
    pytest.importorskip("redis")
    import redis
    for bad, exc, what in [
            (dict(url="unix:///tmp/x.sock", cluster=True), ValueError, "unix socket"),
            (dict(url="redis://127.0.0.1:7000/3", cluster=True), ValueError, "database 0"),
            (dict(url="http://x", cluster=True), ValueError, "redis://"),
            (dict(url="redis://127.0.0.1:7000", cluster=1), TypeError, "cluster must be"),
            (dict(url=["127.0.0.1:7000"]), TypeError, "list of cluster nodes"),
            (dict(url=redis.Redis(), cluster=True), ValueError, "RedisCluster"),
            (dict(url=[], cluster=True), ValueError, "at least one node"),
            (dict(url=["127.0.0.1"], cluster=True), ValueError, r"startup_nodes\[0\]"),
            (dict(url=[("127.0.0.1", 0)], cluster=True), ValueError, "1..65535"),
            (dict(url=[("127.0.0.1", "7000")], cluster=True), ValueError, "an int"),
            (dict(url=[7000], cluster=True), TypeError, r"startup_nodes\[0\]"),
            (dict(url=["127.0.0.1:7000"], cluster=True, timeout=0), ValueError, "timeout")]:
        with pytest.raises(exc, match=what):
            kvcore.RedisStore(**bad)
    with pytest.raises(TypeError, match="startup_nodes"):
        kvcore.RedisStore.cluster("127.0.0.1:7000")
    with pytest.raises(TypeError, match="cluster"):
        kvcore.RedisStore.cluster(["127.0.0.1:7000"], cluster=False)
    # nothing is contacted before the first call
    s = kvcore.RedisStore.cluster(["127.0.0.1:7000", ("::1", 7001)], namespace="n")
    assert s.kind == "redis-cluster" and s.url == "127.0.0.1:7000,::1:7001"
    assert repr(s) == "RedisStore.cluster('127.0.0.1:7000,::1:7001', namespace='n')"
    s.close()


def test_cluster_unreachable_is_misses_with_one_warning():
    require_redis()
    store = kvcore.RedisStore.cluster([f"127.0.0.1:{free_port()}"], timeout=TIMEOUT,
                                      retry_interval=RETRY)
    pool = make_pool(stores=[store])
    t0 = time.monotonic()
    with pytest.warns(kvcore.StoreWarning, match="unreachable") as record:
        for _ in range(3):
            assert run(pool, LONG[:17])[0] == 0
            flush_pool(pool)
    assert len(record) == 1
    assert time.monotonic() - t0 < 3
    pool.debug.check()


# ------------------------------------------------------------ a healthy cluster
def test_keys_spread_over_all_masters_and_hit_bit_exact(cluster):
    store = cluster.store(namespace="spread")
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, LONG)
    flush_pool(pool)
    keys = [redis_key(LONG, b, "spread") for b in range(10)]
    owners = [cluster.owner(k) for k in keys]
    assert set(owners) == set(cluster.master_ports)          # every master holds some
    for k, port in zip(keys, owners):
        assert cluster.node(port).exists(k) == 1             # on the master of its slot
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_hit(pool, LONG, 10)
    st = pool.stats()["stores"][0]
    assert st["kind"] == "redis-cluster" and st["hits"] == 10 and st["failures"] == 0
    assert st["bytes_out"] == sum(len(cluster.node(p).get(k)) for k, p in zip(keys, owners))
    skeys = [store_key(LONG, b, "spread") for b in range(10)]
    assert store.contains(skeys) == 10
    assert store.delete(skeys[:3] + [b"\0" * 32]) == 3
    assert store.contains(skeys) == 0 and store.contains(skeys[3:]) == 7
    assert store.used_bytes() > 0
    store.close()


def test_a_value_planted_huge_on_a_shard_is_a_bounded_corrupt_miss(cluster):
    store = cluster.store(namespace="huge")
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, LONG)
    flush_pool(pool)
    key = redis_key(LONG, 3, "huge")
    node = cluster.node(cluster.owner(key))
    entry = node.get(key)
    node.setrange(key, 4 << 20, b"x")
    skeys = [store_key(LONG, b, "huge") for b in range(10)]
    got = store.get_bounded(skeys[2:5], len(entry))
    assert got[0] == store.get([skeys[2]])[0] and got[1] == b"" and len(got[2]) == len(entry)
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        check_hit(pool, LONG, 3)
    assert pool.stats()["stores"][0]["rejected"] == 1
    pool.debug.check()
    store.close()


def test_two_processes_share_prefixes_through_the_cluster(cluster, tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(peer_script(f"kvcore.RedisStore.cluster({cluster.startup!r}, "
                                  f"namespace='shared', timeout={TIMEOUT})"))
    # the peer imports the kvcore under test, wherever that is
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvcore.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, "-W", "error", str(script), "compute"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "ok compute" in r.stdout, r.stderr
    # this process hits what the other wrote, bit for bit, through each way
    # of naming the cluster
    import redis.cluster
    prompt = np.arange(1, 18, dtype=np.int32)
    rc = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.master_ports[1])
    for store in (kvcore.RedisStore.cluster(cluster.startup, namespace="shared"),
                  kvcore.RedisStore(f"redis://127.0.0.1:{cluster.master_ports[2]}",
                                    cluster=True, namespace="shared"),
                  kvcore.RedisStore(rc, namespace="shared")):
        pool = make_pool(stores=[store])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_hit(pool, prompt, 4)
        assert pool.stats()["stores"][0]["hits"] == 4
        store.close()


# ------------------------------------------------------------ faults
@pytest.mark.parametrize("made_from", ["startup_nodes", "RedisCluster client"])
def test_master_killed_mid_run_costs_only_its_keys(fresh_cluster, made_from):
    c = fresh_cluster()
    if made_from == "startup_nodes":
        store = c.store()
    else:
        # a client of the caller's own, with bounded timeouts and no retries
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        store = kvcore.RedisStore(
            redis.cluster.RedisCluster(
                host="127.0.0.1", port=c.master_ports[0], socket_timeout=TIMEOUT,
                socket_connect_timeout=TIMEOUT, retry=Retry(NoBackoff(), 0),
                require_full_coverage=False),
            namespace="t", retry_interval=RETRY)
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, LONG)
    flush_pool(pool)
    keys = [redis_key(LONG, b) for b in range(10)]
    owners = [c.owner(k) for k in keys]
    # the master of slot 0: redis-py asks it first while making a client,
    # so the store made after it died (below) covers that path too
    dead = c.slots[0][2]
    assert dead in owners
    first_dead = owners.index(dead)
    store_keys = [store_key(LONG, b) for b in range(10)]
    c.kill(dead)
    plain = make_pool(num_blocks=16)
    t0 = time.monotonic()
    with pytest.warns(kvcore.StoreWarning, match="unreachable") as record:
        # the blocks before the first one on the dead master still hit, bit exact
        check_hit(pool, LONG, first_dead)
        # the store itself: every key of a living master is served, only the
        # dead master's keys are misses
        got = store.get(store_keys)
        for v, port, k in zip(got, owners, keys):
            assert (v is None) == (port == dead)
            if v is not None:
                assert v == c.node(port).get(k)
        # evictions and lookups while it stays down: misses, no exception,
        # no wait, and the pool as a pool without stores
        for p in (np.arange(300, 329, dtype=np.int32), LONG[:17]):
            for q in (pool, plain):
                run(q, p)
                flush_pool(q)
        time.sleep(RETRY + 0.05)      # past the retry interval: the node is tried again
        check_hit(pool, LONG, first_dead)
        # what the dead master cannot take goes to the next store (a store
        # made after the master died)
        host = kvcore.HostStore(1 << 20)
        two = make_pool(num_blocks=16, stores=[c.store(), host])
        for start in range(500, 5000, 41):       # a prompt with blocks on the dead master
            other = np.arange(start, start + 41, dtype=np.int32)
            on_dead = [c.owner(redis_key(other, b)) == dead for b in range(10)]
            if any(on_dead) and not all(on_dead):
                break
        run(two, other)
        flush_pool(two)
        assert len(host) == sum(on_dead)
        # (re-keyed for the HostStore's namespace, "")
        assert [host.contains([store_key(other, b, "")]) == 1 for b in range(10)] == on_dead
    elapsed = time.monotonic() - t0
    assert len(record) == 2, [str(w.message) for w in record]     # one per pool
    assert str(dead) in str(record[1].message)
    assert str(dead) in str(record[0].message)
    assert elapsed < 4 * TIMEOUT + RETRY + 2, elapsed
    st = pool.stats()["stores"][0]
    assert st["failures"] >= 1 and st["rejected"] == 0
    pool.debug.check()
    store.close()


def test_stopped_master_times_out_into_misses_for_its_keys_only(fresh_cluster):
    c = fresh_cluster()
    store = c.store(retry_interval=5.0)
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, LONG)
    flush_pool(pool)
    owners = [c.owner(redis_key(LONG, b)) for b in range(10)]
    slow = owners[3]
    first_slow = owners.index(slow)
    c.procs[slow].send_signal(19)     # SIGSTOP: it accepts connections, never answers
    try:
        t0 = time.monotonic()
        with pytest.warns(kvcore.StoreWarning, match="timed out") as record:
            check_hit(pool, LONG, first_slow)
        took = time.monotonic() - t0
        assert TIMEOUT * 0.9 <= took < 2 * TIMEOUT + 1, took    # one timeout, not one per key
        assert len(record) == 1
        # within the retry interval the slow node is left alone: no wait,
        # still one warning, the other masters still hit
        t0 = time.monotonic()
        with pytest.warns(kvcore.StoreWarning) as again:
            check_hit(pool, LONG, first_slow)
            warnings.warn("marker", kvcore.StoreWarning)
        assert [str(w.message) for w in again] == ["marker"]
        assert time.monotonic() - t0 < TIMEOUT
    finally:
        c.procs[slow].send_signal(18)
    pool.debug.check()
    store.close()


def test_failover_to_a_replica_brings_the_hits_back(fresh_cluster):
    c = fresh_cluster(replicas_of=[1])
    store = c.store()
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, LONG)
    flush_pool(pool)
    keys = [redis_key(LONG, b) for b in range(10)]
    owners = [c.owner(k) for k in keys]
    dead = c.master_ports[1]          # the master with a replica
    assert dead in owners
    # every write has reached the replica before its master dies
    assert c.node(dead).execute_command("WAIT", 1, 5000) == 1
    replica = c.ports[c.masters]
    c.kill(dead)
    failover = Failover(c, replica, dead)
    hits = []
    with pytest.warns(kvcore.StoreWarning, match="unreachable") as record:
        while True:
            # the store gets 10 s once every node says the replica took over
            done = failover.poll()
            since = time.monotonic() - failover.t0
            if since > (Failover.DEADLINE_S if done is None else done + 10):
                break
            seq = kvcore.PagedKVCache(pool)
            t1 = time.monotonic()
            hit = seq.allocate(LONG)
            assert time.monotonic() - t1 < 2 * TIMEOUT + 1
            seq.free()
            hits.append(hit // 4)
            if hit == 40:
                break
            pool.reset_prefix_cache()
            time.sleep(0.1)
    # misses (clean: only from the first block on the dead master) until the
    # replica is promoted and the slot map refreshed, then every block again
    # (which side failed: the replica never taking over, not even when told
    # to, or the store not following the promotion)
    assert failover.done is not None or hits[-1] == 10, (
        f"the replica did not take over within {Failover.DEADLINE_S:.0f} s (Redis's own "
        "failover, then CLUSTER FAILOVER FORCE, then TAKEOVER)", failover.steps, hits,
        c.views(dead))
    assert hits[-1] == 10, (
        f"the store missed for {time.monotonic() - failover.t0 - failover.done:.1f} s after "
        "every node said the replica took over", failover.steps, hits, c.views(dead))
    assert set(hits) <= {owners.index(dead), 10}, hits
    assert len(record) == 1
    pool.reset_prefix_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_hit(pool, LONG, 10)
    pool.debug.check()
    store.close()


def test_a_moved_slot_is_a_miss_then_hits_where_it_went(fresh_cluster):
    c = fresh_cluster()
    store = c.store()
    pool = make_pool(num_blocks=16, stores=[store])
    run(pool, LONG)
    flush_pool(pool)
    # move the slot of block 2 to another master, keys and all (what
    # resharding does), behind the store's back
    from redis.crc import key_slot
    key = redis_key(LONG, 2)
    slot, source = key_slot(key), c.owner(key)
    target = next(p for p in c.master_ports if p != source)
    src, dst = c.node(source), c.node(target)
    sid, tid = (n.execute_command("CLUSTER MYID").decode() for n in (src, dst))
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", sid)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", tid)
    keys = [k if isinstance(k, bytes) else k.encode()
            for k in src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)]
    assert key in keys
    src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
    for p in c.master_ports:
        c.node(p).execute_command("CLUSTER SETSLOT", slot, "NODE", tid)
    time.sleep(RETRY)                 # the store may refresh its slot map now
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # a moved key is no failure: no warning
        # the store still sends block 2 to its old master, which answers
        # MOVED: a miss from there on, and a refresh of the slot map
        check_hit(pool, LONG, 2)
        deadline = time.monotonic() + 10
        while True:
            seq = kvcore.PagedKVCache(pool)
            hit = seq.allocate(LONG)
            seq.free()
            pool.reset_prefix_cache()
            if hit == 40 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert hit == 40
        check_hit(pool, LONG, 10)
    assert pool.stats()["stores"][0]["failures"] == 0
    store.close()
