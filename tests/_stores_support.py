"""Helpers for the prefix-store tests: sequences that compute their KV from
their token ids (so any process can check a hit bit for bit), a real
redis-server on a free loopback port, and a store that fails on demand."""
import errno
import os
import shutil
import socket
import subprocess
import textwrap
import time

import numpy as np
import pytest

import kvcore
import kvcore.convert
from kvcore.backends import get_backend

# tests/, where the shared helpers are: a script run in a subprocess puts it on sys.path
TESTS = os.path.dirname(os.path.abspath(__file__))
GEOMETRY = dict(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def make_pool(num_blocks=8, stores=None, dtype="float16", **kw):
    geo = dict(GEOMETRY, **kw)
    return kvcore.BlockPool(num_blocks, geo["block_size"], geo["num_layers"],
                            geo["num_kv_heads"], geo["head_dim"], dtype=dtype, stores=stores)


def kv_for(tokens, positions, layer, pool, salt=b""):
    """The K/V every test writes for ``positions`` of a sequence: a function
    of the token ids up to each position, the layer and the salt (what a
    model would compute), so a hit can be checked anywhere."""
    h, d = pool.num_kv_heads, pool.head_dim
    out = np.empty((2, len(positions), h, d), np.float32)
    for j, p in enumerate(positions):
        seed = (int(np.sum(tokens[:p + 1], dtype=np.int64)) * 1000003 + p * 7919 + layer * 31
                + len(salt)) % (2**32)
        out[:, j] = np.random.default_rng(seed).standard_normal((2, h, d))
    return out[0], out[1]


def run(pool, tokens, salt=None, free=True):
    """allocate ``tokens``, compute the positions not hit, commit; returns
    (hit tokens, sequence or None)."""
    tokens = np.asarray(tokens, np.int32)
    seq = kvcore.PagedKVCache(pool, salt=salt)
    hit = seq.allocate(tokens)
    n = len(tokens)
    # a GPU pool takes arrays already on its device
    to_pool = get_backend(pool.device).from_host if pool.device != "cpu" else None
    for layer in range(pool.num_layers):
        k, v = kv_for(tokens, range(hit, n), layer, pool, (salt or "").encode()
                      if isinstance(salt, str) else (salt or b""))
        if to_pool is not None:
            k, v = to_pool(k), to_pool(v)
        seq.append(layer, k, v)
    seq.commit(n - hit)
    if free:
        seq.free()
        return hit, None
    return hit, seq


def expected_kv(pool, tokens, n, salt=b""):
    """What positions 0..n-1 must hold in the pool's dtype, per layer."""
    out = []
    for layer in range(pool.num_layers):
        k, v = kv_for(np.asarray(tokens, np.int32), range(n), layer, pool, salt)
        if pool.dtype == "float8_e4m3fn":     # the codes of x / the layer's (head's) scale
            ks, vs = pool.kv_scales[layer]
            k, v = (kvcore.convert.to_float8_e4m3fn(x / np.reshape(np.float32(sc), (-1, 1)))
                    for x, sc in ((k, ks), (v, vs)))
        else:
            conv = {"float16": np.float16, "float32": np.float32}[pool.dtype]
            k, v = k.astype(conv), v.astype(conv)
        out.append((k.transpose(1, 0, 2), v.transpose(1, 0, 2)))
    return out


def check_hit(pool, tokens, hit_blocks, salt=None):
    """allocate ``tokens`` again: the hit must be ``hit_blocks`` blocks and
    every hit position must hold exactly what was computed."""
    tokens = np.asarray(tokens, np.int32)
    seq = kvcore.PagedKVCache(pool, salt=salt)
    hit = seq.allocate(tokens)
    assert hit == hit_blocks * pool.block_size, (hit, hit_blocks)
    sb = (salt.encode() if isinstance(salt, str) else salt) or b""
    for layer, (k, v) in enumerate(expected_kv(pool, tokens, hit, sb)):
        gk, gv = pool.gather(layer, seq.block_table, 0, hit)
        assert np.array_equal(gk.view(np.uint8), k.view(np.uint8)), layer
        assert np.array_equal(gv.view(np.uint8), v.view(np.uint8)), layer
    seq.free()


def flush_pool(pool, n_tokens=None):
    """Evict every cached block of ``pool`` (into its stores) by filling the
    pool with a sequence of fresh tokens."""
    n = pool.num_blocks * pool.block_size
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(np.arange(10**6, 10**6 + n, dtype=np.int32))
    seq.free()
    pool.reset_prefix_cache()
    pool.flush_to_stores()   # (nothing is cached now: waits for the spills to be written)


class DelayProxy:
    """A TCP proxy on loopback in front of ``port`` that holds every reply
    for ``delay`` seconds (settable while it runs): a slow Redis."""

    def __init__(self, port, delay=0.0):
        import threading
        self.port_to = port
        self.delay = delay
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._conns = []
        self._threading = threading
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port_to))
            self._conns += [client, server]
            for a, b, slow in ((client, server, False), (server, client, True)):
                self._threading.Thread(target=self._pump, args=(a, b, slow),
                                       daemon=True).start()

    def _pump(self, src, dst, slow):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if slow and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._closed = True
        self._sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass


class FailingStore(kvcore.HostStore):
    """A HostStore that raises ``exc`` from the methods named in ``fail``
    (fault injection for conditions a test cannot cause for real, such as
    a full disk, or permission denied when the tests run as root)."""

    def __init__(self, capacity_bytes, exc=None, fail=()):
        super().__init__(capacity_bytes)
        self.exc = exc
        self.fail = set(fail)

    def _maybe(self, name):
        if name in self.fail:
            raise self.exc

    def contains(self, keys):
        self._maybe("contains")
        return super().contains(keys)

    def get(self, keys):
        self._maybe("get")
        return super().get(keys)

    def put(self, items):
        self._maybe("put")
        return super().put(items)


def disk_full():
    return OSError(errno.ENOSPC, "No space left on device")


def permission_denied():
    return PermissionError(errno.EACCES, "Permission denied")


# ------------------------------------------------------------ redis
def require_redis():
    """(redis-server path, redis module); skips without them, except that
    with KVCORE_REQUIRE_REDIS=1 (set by .ci/run, which installs both) a
    missing one fails the test."""
    server = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        redis = None
    if server and redis is not None:
        return server, redis
    what = "redis-server" if not server else "redis-py"
    if os.environ.get("KVCORE_REQUIRE_REDIS", "") not in ("", "0"):
        pytest.fail(f"KVCORE_REQUIRE_REDIS=1 but {what} is missing")
    pytest.skip(f"needs {what} (apt-get install redis-server; pip install 'kvcore[redis]')")


def free_port():
    # (--port 0 means "no TCP" to Redis: pick a free one first)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n):
    """``n`` distinct free ports: all held at once while they are picked
    (free_port() called n times may return a port twice, or one a server
    started since then is about to bind)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RedisServer:
    """A redis-server of its own on 127.0.0.1, data in ``directory``."""

    def __init__(self, directory, port=None):
        self.binary, self.redis = require_redis()
        self.directory = str(directory)
        self.port = port or free_port()
        self.proc = None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.directory, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except self.redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.02)
        client.close()
        return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self):
        return self.redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)


# A script another process runs against a shared store: "compute" fills and
# flushes the prefix, "hit" checks that it finds it.  {store}: the store's
# constructor expression; {tests}: this folder.
PEER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np, kvcore
    from _stores_support import run, check_hit, flush_pool, make_pool
    pool = make_pool(stores=[{store}])
    prompt = np.arange(1, 18, dtype=np.int32)
    if sys.argv[1] == "compute":
        assert run(pool, prompt)[0] == 0
        flush_pool(pool)
    else:
        check_hit(pool, prompt, 4)
        assert pool.stats()["stores"][0]["hits"] == 4
    print("ok", sys.argv[1])
""")


def peer_script(store):
    """PEER_SCRIPT for the store built by the expression ``store``."""
    return PEER_SCRIPT.format(tests=TESTS, store=store)
