"""HostStore: evicted blocks kept in this process's memory, LRU-bounded."""
import collections
import threading

from .._forksafe import LEAF, fork_guard
from .base import PrefixStore


class HostStore(PrefixStore):
    """Prefix store in host memory (plain, not pinned).

    Parameters
    ----------
    capacity_bytes : int
        Most bytes of entries kept (an entry is a block's KV plus ~200 bytes
        of header and its token ids); the least recently used go to the
        next store when a put would exceed it.
    namespace : str or bytes, optional
    hmac_key : bytes, optional

    Works for CPU and CUDA pools alike (a CUDA pool's blocks are copied to
    host memory when they are evicted, and back when they are hit).
    """

    kind = "host"
    in_memory = True

    def __init__(self, capacity_bytes, namespace="", hmac_key=None):
        if capacity_bytes is None:
            raise TypeError("capacity_bytes must be an int, got None")
        super().__init__(capacity_bytes, namespace, hmac_key)
        self._entries = collections.OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        fork_guard(self, "_lock", LEAF)

    def contains(self, keys):
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._entries:
                    break
                n += 1
            return n

    def get(self, keys):
        out = []
        with self._lock:
            for k in keys:
                v = self._entries.get(k)
                if v is not None:
                    self._entries.move_to_end(k)
                out.append(v)
        return out

    def put(self, items):
        dropped = []
        with self._lock:
            for k, v in items:
                v = bytes(v) if not isinstance(v, (bytes, bytearray)) else v
                if len(v) > self.capacity_bytes:
                    dropped.append((k, v))
                    continue
                old = self._entries.pop(k, None)
                if old is not None:
                    self._used -= len(old)
                self._entries[k] = v
                self._used += len(v)
            while self._used > self.capacity_bytes:
                k, v = self._entries.popitem(last=False)
                self._used -= len(v)
                dropped.append((k, v))
        return dropped

    def delete(self, keys):
        n = 0
        with self._lock:
            for k in keys:
                v = self._entries.pop(k, None)
                if v is not None:
                    self._used -= len(v)
                    n += 1
        return n

    def used_bytes(self):
        return self._used

    def __len__(self):
        return len(self._entries)

    def __repr__(self):
        return (f"HostStore(capacity_bytes={self.capacity_bytes}, entries={len(self)}, "
                f"used_bytes={self._used})")
