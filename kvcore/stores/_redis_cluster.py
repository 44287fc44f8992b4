"""Per-node batches over a Redis Cluster, for :class:`kvcore.RedisStore`.

A batch of single-key commands (``GET``, ``EXISTS``, ``SET``, ``DEL``, one
key each, so no command ever crosses slots) is split by the primary that
owns each key's slot and sent as one pipeline per node, the nodes in
parallel on a few threads.  A node that cannot be reached or times out
costs only its keys: their results are misses, the node is left alone for
``retry_interval`` seconds (its keys are misses meanwhile, without waiting),
and the slot map is refreshed then, so that a replica promoted in its place
serves its keys again.  What went wrong is not raised but kept as *faults*
(one exception per node), which the pool collects after each call with
:meth:`ClusterBatches.take_faults` and warns of once per condition.

The topology is redis-py's (``redis.cluster.RedisCluster``: its slot map, its
per-node clients with their socket timeouts); this module only decides
which node gets which keys and what a failure of one node means.
"""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .._forksafe import RENEW, fork_guard

#: result of a command whose node failed, was skipped or refused it
FAILED = object()

# at most this many nodes are talked to at once (one thread each)
_MAX_WORKERS = 8


class NodeUnreachable(ConnectionError):
    """A cluster node (or the whole cluster) could not be reached: its keys
    are misses until it answers again or a replica takes its slots."""


class NodeTimeout(TimeoutError):
    """A cluster node did not answer within the store's timeout: its keys
    are misses until it answers again or a replica takes its slots."""


class NodeError(RuntimeError):
    """A cluster node answered a command with an error (out of memory,
    cluster down, ...): those keys are misses."""


class ClusterBatches:
    """Single-key commands in one pipeline per primary node of a cluster.

    Parameters
    ----------
    make_client : callable
        Returns the ``redis.cluster.RedisCluster`` (called on first use, and
        again after a failure to reach any node, so that a cluster that is
        down when the store is made is found once it is up).
    retry_interval : float
        Seconds a node that failed is left alone, and the minimum time
        between two refreshes of the slot map.
    """

    def __init__(self, make_client, retry_interval):
        import redis
        import redis.cluster
        self._redis = redis
        self._make_client = make_client
        self._client = None
        self.retry_interval = retry_interval
        self._lock = threading.Lock()
        self._client_lock = threading.Lock()   # making the client (may take timeouts)
        self._down = {}              # node name -> (retry after, exception)
        self._stale = False          # the slot map may be out of date
        self._refreshed = 0.0        # when the slot map was last asked for
        self._refreshing = False     # a refresh is under way on a worker
        self._local = threading.local()
        self._executor = None
        self._executor_pid = None
        # a forked child re-initialises both locks (a parent's thread may
        # have held one across a slow call) and makes its own executor
        fork_guard(self, "_lock", RENEW)
        fork_guard(self, "_client_lock", RENEW)

    def _after_fork_child(self):
        self._refreshing = False     # (the parent's refresh thread is not here)

    # ------------------------------------------------------------ client
    @property
    def client(self):
        """The RedisCluster client (made on first use); raises
        :class:`NodeUnreachable` when no node of the cluster answers."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = self._make_client()
                except self._redis.exceptions.RedisClusterException as e:
                    raise NodeUnreachable(f"Redis Cluster: {e}") from None
                except self._redis.exceptions.TimeoutError as e:
                    raise NodeTimeout(f"Redis Cluster: {e}") from None
                except self._redis.exceptions.ConnectionError as e:
                    raise NodeUnreachable(f"Redis Cluster: {e}") from None
                self._refreshed = time.monotonic()
            return self._client

    def take_faults(self):
        """The node failures of this thread's calls since the last take
        (a list of exceptions, emptied)."""
        faults = getattr(self._local, "faults", None)
        self._local.faults = []
        return faults or []

    def _fault(self, exc):
        faults = getattr(self._local, "faults", None)
        if faults is None:
            faults = self._local.faults = []
        if not any(type(f) is type(exc) and str(f) == str(exc) for f in faults):
            faults.append(exc)

    # ------------------------------------------------------------ topology
    def _refresh(self, client):
        """After a node failed or a key moved: ask the cluster for its slot
        map again, at most once per retry_interval, on a worker thread (a
        node that hangs must not hold up the call that noticed it); later
        calls use the new map."""
        now = time.monotonic()
        with self._lock:
            if not self._stale or self._refreshing or now - self._refreshed < self.retry_interval:
                return
            self._refreshed = now
            self._refreshing = True
        try:
            self._workers().submit(self._refresh_now, client)
        except RuntimeError:        # the store is closing
            with self._lock:
                self._refreshing = False

    def _refresh_now(self, client):
        try:
            client.nodes_manager.initialize()
            primaries = {n.name for n in client.get_primaries()}
        except Exception:
            # every node down or disagreeing: keep the map we have; the
            # nodes that fail are told apart call by call
            primaries = None
        with self._lock:
            self._refreshing = False
            self._refreshed = time.monotonic()
            if primaries is not None:
                # a node that owns no slots any more (a replica took over)
                # costs nothing: forget it
                for name in [n for n in self._down if n not in primaries]:
                    del self._down[name]
                self._stale = bool(self._down)

    def _workers(self):
        with self._lock:
            if self._executor is None or self._executor_pid != os.getpid():
                # a forked child has none of its parent's threads: make new ones
                self._executor = ThreadPoolExecutor(max_workers=_MAX_WORKERS,
                                                    thread_name_prefix="kvcore-redis-cluster")
                self._executor_pid = os.getpid()
            return self._executor

    def _send(self, client, node, commands):
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return pipe.execute(raise_on_error=False)

    def _node_failed(self, name, exc):
        """The fault for node ``name`` whose pipeline raised ``exc``; a node
        that timed out or could not be reached is left alone for
        retry_interval and the slot map refreshed (a replica may take over)."""
        exceptions = self._redis.exceptions
        if isinstance(exc, (exceptions.TimeoutError, TimeoutError)):
            fault = NodeTimeout(f"cluster node {name} timed out ({exc}); its keys are misses")
        elif isinstance(exc, (exceptions.ConnectionError, OSError)):
            fault = NodeUnreachable(f"cluster node {name} is unreachable ({exc}); its keys "
                                    f"are misses")
        else:
            return NodeError(f"cluster node {name} failed: {type(exc).__name__}: {exc}; its "
                             f"keys are misses")
        with self._lock:
            self._down[name] = (time.monotonic() + self.retry_interval, fault)
            self._stale = True
        return fault

    # ------------------------------------------------------------ batches
    def run(self, commands):
        """Results of ``commands`` (tuples ``(name, key, *args)``, one key
        each), in order; :data:`FAILED` where the key's node failed, was
        left alone or refused the command.  Raises only when no node of the
        cluster can be reached at all."""
        client = self.client
        exceptions = self._redis.exceptions
        results = [FAILED] * len(commands)
        groups = {}                          # node name -> (node, [command index])
        for j, command in enumerate(commands):
            try:
                node = client.get_node_from_key(command[1])
            except exceptions.RedisClusterException as e:     # a slot no node serves
                self._fault(NodeUnreachable(f"{e}; its keys are misses"))
                continue
            entry = groups.get(node.name)
            if entry is None:
                entry = groups[node.name] = (node, [])
            entry[1].append(j)
        now = time.monotonic()
        with self._lock:
            for name, (until, _) in self._down.items():
                if now < until:
                    groups.pop(name, None)   # left alone until its retry time
        for name, (node, idx), out in self._execute(client, groups, commands):
            if isinstance(out, BaseException):
                self._fault(self._node_failed(name, out))
                continue
            with self._lock:
                self._down.pop(name, None)
            for j, res in zip(idx, out):
                if isinstance(res, (exceptions.MovedError, exceptions.TryAgainError)):
                    with self._lock:         # the slot map is out of date: a miss now
                        self._stale = True
                elif isinstance(res, exceptions.AskError):
                    pass                     # a slot being migrated: a miss
                elif isinstance(res, BaseException):
                    self._fault(NodeError(f"cluster node {name} refused {commands[j][0]}: "
                                          f"{res}"))
                else:
                    results[j] = res
        with self._lock:
            faults = [d[1] for d in self._down.values()]
        # a node still believed down is reported on every call, so that an
        # outage is warned of once, not again whenever a call misses it
        for f in faults:
            self._fault(f)
        self._refresh(client)
        return results

    def _execute(self, client, groups, commands):
        """(name, node, [index]), then the node's results or the exception
        it raised, for each group; the nodes in parallel."""
        items = list(groups.items())
        if len(items) <= 1:
            out = []
            for name, (node, idx) in items:
                try:
                    res = self._send(client, node, [commands[j] for j in idx])
                except Exception as e:
                    res = e
                out.append((name, (node, idx), res))
            return out
        workers = self._workers()
        futures = [workers.submit(self._send, client, node, [commands[j] for j in idx])
                   for _, (node, idx) in items]
        out = []
        for (name, group), fut in zip(items, futures):
            try:
                res = fut.result()
            except Exception as e:
                res = e
            out.append((name, group, res))
        return out

    def primaries(self):
        """The clients of the primary nodes (for INFO)."""
        client = self.client
        return [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]

    def close(self):
        if self._executor is not None and self._executor_pid == os.getpid():
            self._executor.shutdown(wait=False)
        self._executor = None
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover - closing a broken connection
                pass
