"""RedisStore: evicted blocks in a Redis server or a Redis Cluster, shared by
processes and machines."""
from ._redis_cluster import FAILED as _FAILED
from .._ints import shown
from .base import PrefixStore, bound_bytes

_MAX_TTL = 2**53 / 1000       # seconds: Redis' PX (milliseconds) must fit after "now" is added
_MAX_TIMEOUT = 2**31 - 1      # seconds: what a socket timeout (timeval) takes everywhere
# bytes a connection asks of its socket per read (redis-py's default: 64 KiB).
# Every read gives the GIL up; beside a thread busy in Python each costs a
# switch interval (5 ms) to get it back, so a lookup of 32 MiB of entries of
# 512 KiB took 0.9-1.7 s there with 64 KiB reads and 0.22 s with 1 MiB ones
# (docs/stores.md).  Larger reads make hiredis' parser slow on small replies.
# Over TLS a read returns one record (16 KiB) at most: no fewer reads, only
# a larger buffer per connection, so rediss:// keeps redis-py's default.
_READ_SIZE = 1 << 20
_MAX_STRING = 2**62          # bytes: past any Redis string (GETRANGE's end is an int64)


def _read_size(url):
    """``{"socket_read_size": ...}`` for a client made from ``url``."""
    return {} if url.lower().startswith("rediss:") else {"socket_read_size": _READ_SIZE}


class RedisStore(PrefixStore):
    """Prefix store in Redis (or a Redis-compatible server), through redis-py.

    Parameters
    ----------
    url : str, list or redis.Redis
        ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` for a
        socket; with ``cluster=True``, any node of the cluster, or a list
        of nodes as :meth:`RedisStore.cluster` takes them), or a ready
        client (``redis.Redis``, or ``redis.cluster.RedisCluster``: then
        the store works as with ``cluster=True``, with that client's
        timeouts and retries).
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
        Not enforced here (Redis bounds itself: ``maxmemory`` or ``ttl``);
        kept as the store's ``capacity_bytes`` attribute.
    cluster : bool, default False
        ``url`` names a node of a Redis Cluster (see also
        :meth:`RedisStore.cluster`): the store learns the slot map from it
        and sends each batch as one pipeline per primary, the nodes in
        parallel.  A node that is down, times out or is failing over costs
        only its keys (misses, one ``StoreWarning``); the others keep
        hitting.  Configure the servers with ``cluster-require-full-coverage
        no``, or the whole cluster refuses every key while one shard is down.

    Notes
    -----
    One key per block (a plain string value), so Redis Cluster spreads the
    blocks over its shards.  ``contains`` is one pipelined round of
    ``EXISTS``, ``get`` one of ``GET``, ``put`` one of ``SET`` (with ``PX``
    when ``ttl`` is given).  ``put`` never returns dropped entries on one
    server: Redis is the last tier.  On a cluster every command names one key, so no batch
    crosses slots; a ``put`` hands what a failed node could not take to the
    next tier, like dropped entries.
    """

    kind = "redis"

    def __init__(self, url, namespace="kvcore", ttl=None, hmac_key=None, timeout=1.0,
                 retry_interval=1.0, capacity_bytes=None, cluster=False):
        super().__init__(capacity_bytes, namespace, hmac_key)
        try:
            import redis
        except ImportError as e:  # pragma: no cover - exercised where redis is absent
            raise ImportError("RedisStore needs redis-py: pip install 'kvcore[redis]'") from e
        self._response_error = redis.exceptions.ResponseError
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0 \
                    or not ttl <= _MAX_TTL:
                raise ValueError(f"ttl must be None or a positive, finite number of seconds "
                                 f"(at most {_MAX_TTL:.0f}), got {shown(ttl)}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= _MAX_TIMEOUT:
            raise ValueError(f"timeout must be a positive, finite number of seconds (at most "
                             f"{_MAX_TIMEOUT}), got {shown(timeout)}")
        if isinstance(retry_interval, bool) or not isinstance(retry_interval, (int, float)) \
                or not _as_float(retry_interval) >= 0:
            raise ValueError(f"retry_interval must be a number of seconds >= 0, got "
                             f"{shown(retry_interval)}")
        if not isinstance(cluster, bool):
            raise TypeError(f"cluster must be True or False, got {cluster!r}")
        self.ttl = ttl
        self.timeout = float(timeout)
        self.retry_interval = float(retry_interval)
        self._nodes = None           # ClusterBatches on a cluster
        if isinstance(url, str) and cluster:
            self.url = url
            self._client = None
            self._nodes = self._cluster_batches(url=_cluster_url(redis, url))
        elif isinstance(url, (list, tuple)) and cluster:
            import redis.cluster
            nodes = _startup_nodes(url)
            self.url = ",".join(f"{h}:{p}" for h, p in nodes)
            self._client = None
            self._nodes = self._cluster_batches(
                startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in nodes])
        elif isinstance(url, str):
            self.url = url
            try:
                self._client = redis.Redis.from_url(
                    url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                    retry_on_timeout=False, **_read_size(url))
            except ValueError as e:
                raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got "
                                 f"{url!r}: {e}") from None
        elif hasattr(url, "pipeline") and hasattr(url, "get"):
            self.url = repr(url)
            self._client = url
            if _is_cluster_client(url):
                from ._redis_cluster import ClusterBatches
                self._nodes = ClusterBatches(lambda: url, self.retry_interval)
            elif cluster:
                raise ValueError(f"cluster=True needs a URL or a redis.cluster.RedisCluster "
                                 f"client, got a {type(url).__name__}")
        else:
            raise TypeError(f"url must be a redis:// URL, a redis-py client or (with "
                            f"cluster=True) a list of cluster nodes, got {type(url).__name__}")
        self._prefix = b"kvcore:" + self.namespace + b":"
        if self._nodes is not None:
            self.kind = "redis-cluster"

    @classmethod
    def cluster(cls, startup_nodes, **kwargs):
        """A store on the Redis Cluster that ``startup_nodes`` belong to.

        Parameters
        ----------
        startup_nodes : list of str or (str, int)
            Some nodes of the cluster (``"host:port"`` or ``(host, port)``);
            the store learns the others, and the slot map, from the first
            that answers.  For credentials or TLS use a URL instead
            (``RedisStore("rediss://user:password@host:port",
            cluster=True)``) or pass a ready ``RedisCluster`` client.
        **kwargs
            The other arguments of :class:`RedisStore` (``namespace``,
            ``ttl``, ``hmac_key``, ``timeout``, ``retry_interval``,
            ``capacity_bytes``).

        Returns
        -------
        RedisStore
            ``RedisStore(startup_nodes, cluster=True, **kwargs)``.
        """
        if "cluster" in kwargs:
            raise TypeError("RedisStore.cluster() got an unexpected keyword argument "
                            "'cluster' (it is always a cluster)")
        return cls(_startup_nodes(startup_nodes), cluster=True, **kwargs)

    def _cluster_batches(self, **where):
        """ClusterBatches over a RedisCluster made (on first use) from
        ``where`` with this store's timeouts.  The batches never go through
        the client's own retries (a dead node costs one timeout, then its
        keys are misses for retry_interval); only making the client does:
        it asks the first primary for COMMAND and, when that one is down,
        needs a retry to ask another."""
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from ._redis_cluster import ClusterBatches

        # (redis-py passes socket_read_size on to the nodes from 8.0 on;
        # earlier versions drop it: their default reads)
        read = _read_size(where.get("url", ""))

        def make():
            return redis.cluster.RedisCluster(
                socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                retry=Retry(NoBackoff(), 3), require_full_coverage=False, **read, **where)

        return ClusterBatches(make, self.retry_interval)

    @property
    def client(self):
        """The redis-py client (on a cluster, its ``RedisCluster``, made on
        first use)."""
        if self._nodes is not None:
            return self._nodes.client
        return self._client

    def take_faults(self):
        """What failed in this thread's last calls although they returned
        (on a cluster: the nodes whose keys were misses), as a list of
        exceptions, emptied; the pool warns of them.  Always empty on one
        server, whose failures are raised."""
        return [] if self._nodes is None else self._nodes.take_faults()

    def _key(self, key):
        return self._prefix + key.hex().encode()

    def contains(self, keys):
        if not keys:
            return 0
        if self._nodes is not None:
            found = self._nodes.run([("EXISTS", self._key(k)) for k in keys])
        else:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            found = pipe.execute()
        n = 0
        for f in found:
            if f is _FAILED or not f:
                break
            n += 1
        return n

    def get(self, keys):
        if not keys:
            return []
        if self._nodes is not None:
            return [None if v is _FAILED else v
                    for v in self._nodes.run([("GET", self._key(k)) for k in keys])]
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.get(self._key(k))
        values = pipe.execute(raise_on_error=False)
        for i, v in enumerate(values):
            if isinstance(v, BaseException):
                # a key planted with another type (a list, a hash) holds no
                # entry: an empty value, refused as corrupt like any other
                # (the other keys of the batch still count, as on a cluster)
                if isinstance(v, self._response_error) and str(v).startswith("WRONGTYPE"):
                    values[i] = b""
                else:
                    raise v
        return values

    def get_bounded(self, keys, max_bytes):
        """:meth:`get` reading at most ``max_bytes`` of each value: one
        pipelined round of ``STRLEN`` and ``GETRANGE`` per key.  A longer
        value (planted: a pool never writes one) comes back as ``b""``, a
        corrupt entry, after ``max_bytes`` of it crossed the network
        instead of all of it (up to Redis' 512 MiB a string); an empty
        value (planted too) is ``b""`` as through :meth:`get`, not a miss."""
        if not keys:
            return []
        bound_bytes(max_bytes)
        commands = []
        for k in keys:
            key = self._key(k)
            commands += [("STRLEN", key), ("GETRANGE", key, 0, min(max_bytes, _MAX_STRING) - 1)]
        replies = self._run(commands)
        values = []
        empty = []      # the keys of size 0: none, or an empty value
        for size, value in zip(replies[0::2], replies[1::2]):
            if isinstance(size, BaseException) or isinstance(value, BaseException):
                e = size if isinstance(size, BaseException) else value
                # a key planted with another type holds no entry (see get)
                if isinstance(e, self._response_error) and str(e).startswith("WRONGTYPE"):
                    values.append(b"")
                    continue
                raise e
            if size is None or value is None:       # its cluster node failed: a miss
                values.append(None)
            elif size == 0:
                empty.append(len(values))          # no such key, or an empty value
                values.append(None)
            elif len(value) != min(size, max_bytes):
                # deleted or rewritten between the STRLEN and the GETRANGE
                # (another client's commands may run between them): a miss,
                # as get would have found it, not a corrupt entry
                values.append(None)
            elif size > max_bytes:
                values.append(b"")                 # too long for an entry: corrupt
            else:
                values.append(value)
        if empty:
            # an empty value is an entry no pool wrote (get reads it as b""):
            # corrupt, as in every store, not a miss.  EXISTS then STRLEN
            # again: a key missing at the first round and written since by
            # a peer (a spill) exists now, with its length: a miss, not a
            # good entry reported corrupt
            commands = []
            for j in empty:
                key = self._key(keys[j])
                commands += [("EXISTS", key), ("STRLEN", key)]
            replies = self._run(commands)
            for j, n, size in zip(empty, replies[0::2], replies[1::2]):
                for r in (n, size):
                    if isinstance(r, BaseException):
                        if not (isinstance(r, self._response_error)
                                and str(r).startswith("WRONGTYPE")):
                            raise r
                        size = 0        # (planted with another type since: corrupt)
                if n and size == 0:
                    values[j] = b""
        return values

    def _run(self, commands):
        """The replies of ``commands``, pipelined (on a cluster: None for
        a command whose node failed; an error reply: its exception)."""
        if self._nodes is not None:
            return [None if v is _FAILED else v for v in self._nodes.run(commands)]
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)

    def put(self, items):
        if not items:
            return []
        px = None if self.ttl is None else max(1, int(self.ttl * 1000))
        if self._nodes is not None:
            expiry = () if px is None else ("PX", px)
            # (a memoryview: the entry is sent without a copy)
            done = self._nodes.run([("SET", self._key(k), v if isinstance(v, bytes) else
                                     memoryview(v).cast("B")) + expiry for k, v in items])
            # what a failed node did not take goes on, like dropped entries
            return [item for item, ok in zip(items, done) if ok is _FAILED]
        pipe = self._client.pipeline(transaction=False)
        for k, v in items:
            pipe.set(self._key(k), bytes(v) if not isinstance(v, bytes) else v, px=px)
        pipe.execute()
        return []

    def delete(self, keys):
        if not keys:
            return 0
        if self._nodes is not None:
            return sum(int(n) for n in self._nodes.run([("DEL", self._key(k)) for k in keys])
                       if n is not _FAILED)
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.delete(self._key(k))
        return sum(pipe.execute())

    def used_bytes(self):
        """Bytes the server reports in use (``INFO memory``), all keys (on a
        cluster: summed over the primaries that answer)."""
        if self._nodes is None:
            return int(self._client.info("memory")["used_memory"])
        total = 0
        for _name, node in self._nodes.primaries():
            try:
                total += int(node.info("memory")["used_memory"])
            except Exception:  # a node down: its bytes are not counted
                pass
        return total

    def close(self):
        if self._nodes is not None:
            self._nodes.close()
            return
        try:
            self._client.close()
        except Exception:  # pragma: no cover - closing a broken connection
            pass

    def __repr__(self):
        kind = "RedisStore.cluster" if self._nodes is not None else "RedisStore"
        return f"{kind}({self.url!r}, namespace={self.namespace.decode(errors='replace')!r})"


def _as_float(seconds):
    """``seconds`` as a float; NaN (refused) for an int past float's range."""
    try:
        return float(seconds)
    except OverflowError:
        return float("nan")


def _is_cluster_client(client):
    try:
        import redis.cluster
    except ImportError:  # pragma: no cover
        return False
    return isinstance(client, redis.cluster.RedisCluster)


def _cluster_url(redis, url):
    """``url`` checked as the address of a cluster node (TCP, db 0)."""
    try:
        options = redis.connection.parse_url(url)
    except ValueError as e:
        raise ValueError(f"url must be a redis:// or rediss:// URL of a cluster node, got "
                         f"{url!r}: {e}") from None
    if "path" in options:
        raise ValueError(f"url must be a redis:// or rediss:// URL of a cluster node (a "
                         f"cluster is not reached through a unix socket), got {url!r}")
    if options.get("db", 0) != 0:
        raise ValueError(f"url must name database 0 on a cluster (Redis Cluster has only "
                         f"one), got {url!r}")
    if not options.get("host"):
        raise ValueError(f"url must name a host, got {url!r}")
    return url


def _startup_nodes(startup_nodes):
    """[(host, port)] from "host:port" strings or (host, port) pairs."""
    if isinstance(startup_nodes, (str, bytes)) or not hasattr(startup_nodes, "__iter__"):
        raise TypeError(f"startup_nodes must be a list of 'host:port' or (host, port), got "
                        f"{type(startup_nodes).__name__}")
    out = []
    for i, node in enumerate(startup_nodes):
        if isinstance(node, str):
            host, sep, digits = node.rpartition(":")
            # (ASCII digits: '\u00b2' is a digit to isdigit, not to int())
            if not sep or not host or not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"startup_nodes[{i}] must be 'host:port', got {node!r:.60}")
            if len(digits.lstrip("0")) > 5:     # (and int() refuses more than 4300 digits)
                raise ValueError(f"startup_nodes[{i}] has port {digits:.20}..., not in "
                                 "1..65535")
            port = int(digits)
        elif isinstance(node, tuple) and len(node) == 2:
            host, port = node
            if not isinstance(host, str) or not host or isinstance(port, bool) \
                    or not isinstance(port, int):
                raise ValueError(f"startup_nodes[{i}] must be (host, port) with a str and "
                                 f"an int, got {shown(node, 60)}")
        else:
            raise TypeError(f"startup_nodes[{i}] must be 'host:port' or (host, port), got "
                            f"{node!r:.60}")
        if not 0 < port < 65536:
            raise ValueError(f"startup_nodes[{i}] has port {shown(port)}, not in 1..65535")
        out.append((host.strip("[]"), port))
    if not out:
        raise ValueError("startup_nodes must name at least one node of the cluster")
    return out
