"""RedisStore: evicted blocks in a Redis server, shared by processes and machines."""
from .base import PrefixStore

_MAX_TTL = 2**53 / 1000       # seconds: Redis' PX (milliseconds) must fit after "now" is added
_MAX_TIMEOUT = 2**31 - 1      # seconds: what a socket timeout (timeval) takes everywhere


class RedisStore(PrefixStore):
    """Prefix store in Redis (or a Redis-compatible server), through redis-py.

    Parameters
    ----------
    url : str or redis.Redis
        ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` for a
        socket), or a ready client (``redis.Redis`` or
        ``redis.cluster.RedisCluster``).
    namespace : str or bytes, default "kvcore"
        Prefix of every key (``kvcore:{namespace}:{hex}``) and part of the
        layout fingerprint: stores of different namespaces never share
        entries.
    ttl : float, optional
        Seconds an entry lives after it was last written (Redis ``PX``);
        None: until Redis evicts it (configure ``maxmemory`` and an LRU
        ``maxmemory-policy`` on the server).
    hmac_key : bytes, optional
        Sign entries (HMAC-SHA256 over header, token ids and KV) and accept
        only entries signed with the same key: for stores shared across
        trust boundaries.
    timeout : float, default 1.0
        Socket connect and read timeout in seconds (a client made here):
        a slow or dead server costs at most this, then misses.
    retry_interval : float, default 1.0
        Seconds a pool leaves the server alone after a timeout or a failed
        connection, then tries it again.
    capacity_bytes : int, optional
        Not enforced here (Redis bounds itself); reported by ``stats``.

    Notes
    -----
    One key per block (a plain string value), so Redis Cluster spreads the
    blocks over its shards.  ``contains`` is one pipelined round of
    ``EXISTS``, ``get`` one of ``GET``, ``put`` one of ``SET`` (with ``PX``
    when ``ttl`` is given).  ``put`` never returns dropped entries: Redis is
    the last tier.
    """

    kind = "redis"

    def __init__(self, url, namespace="kvcore", ttl=None, hmac_key=None, timeout=1.0,
                 retry_interval=1.0, capacity_bytes=None):
        super().__init__(capacity_bytes, namespace, hmac_key)
        try:
            import redis
        except ImportError as e:  # pragma: no cover - exercised where redis is absent
            raise ImportError("RedisStore needs redis-py: pip install 'kvcore[redis]'") from e
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0 \
                    or not ttl <= _MAX_TTL:
                raise ValueError(f"ttl must be None or a positive, finite number of seconds "
                                 f"(at most {_MAX_TTL:.0f}), got {ttl!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= _MAX_TIMEOUT:
            raise ValueError(f"timeout must be a positive, finite number of seconds (at most "
                             f"{_MAX_TIMEOUT}), got {timeout!r}")
        if isinstance(retry_interval, bool) or not isinstance(retry_interval, (int, float)) \
                or not retry_interval >= 0:
            raise ValueError(f"retry_interval must be a number of seconds >= 0, got "
                             f"{retry_interval!r}")
        self.ttl = ttl
        self.timeout = float(timeout)
        self.retry_interval = float(retry_interval)
        if isinstance(url, str):
            self.url = url
            try:
                self._client = redis.Redis.from_url(
                    url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                    retry_on_timeout=False)
            except ValueError as e:
                raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got "
                                 f"{url!r}: {e}") from None
        elif hasattr(url, "pipeline") and hasattr(url, "get"):
            self.url = repr(url)
            self._client = url
        else:
            raise TypeError(f"url must be a redis:// URL or a redis-py client, got "
                            f"{type(url).__name__}")
        self._prefix = b"kvcore:" + self.namespace + b":"

    @property
    def client(self):
        """The redis-py client."""
        return self._client

    def _key(self, key):
        return self._prefix + key.hex().encode()

    def contains(self, keys):
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._key(k))
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def get(self, keys):
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.get(self._key(k))
        return pipe.execute()

    def put(self, items):
        if not items:
            return []
        pipe = self._client.pipeline(transaction=False)
        px = None if self.ttl is None else max(1, int(self.ttl * 1000))
        for k, v in items:
            pipe.set(self._key(k), bytes(v) if not isinstance(v, bytes) else v, px=px)
        pipe.execute()
        return []

    def delete(self, keys):
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.delete(self._key(k))
        return sum(pipe.execute())

    def used_bytes(self):
        """Bytes the server reports in use (``INFO memory``), all keys."""
        return int(self._client.info("memory")["used_memory"])

    def close(self):
        try:
            self._client.close()
        except Exception:  # pragma: no cover - closing a broken connection
            pass

    def __repr__(self):
        return f"RedisStore({self.url!r}, namespace={self.namespace.decode(errors='replace')!r})"
