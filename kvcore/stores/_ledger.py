"""What a pool's stores did: per-store counters (``stats()["stores"]``), the
faults they had, the warnings owed to the pool's caller, and which store is
being left alone after a timeout.

Faults: any exception of a store, and any entry that fails verification, is
a miss; a ``StoreWarning`` is issued once per (store, condition) from the
thread calling the pool (a store worker's warnings wait for the next
caller).  A store that times out or cannot be reached is skipped for its
``retry_interval`` seconds (default 1), so a dead server costs one timeout
per interval, not one per call.
"""
import errno
import threading
import time
import warnings

from . import _format
from .._forksafe import LEAF, fork_guard
from ._worker import on_worker_thread
from .base import StoreWarning

# conditions that clear once the store works again (warned anew if they recur)
_TRANSIENT = {"timeout", "unreachable", "I/O error", "disk full", "permission denied", "error"}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


def condition(exc):
    """The warning condition an exception of a store (or a failed
    verification) is reported as."""
    if isinstance(exc, _format.Invalid):
        return exc.condition
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("redis"):
        if "Timeout" in name:
            return "timeout"
        if "Connection" in name or "Busy" in name:
            return "unreachable"
        return "error"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        if exc.errno in _DISK_FULL:
            return "disk full"
        if exc.errno in _PERMISSION or isinstance(exc, PermissionError):
            return "permission denied"
        if isinstance(exc, ConnectionError):
            return "unreachable"
        return "I/O error"
    return "error"


def _describe(store):
    """repr(store), or its type's name when a third-party repr fails."""
    try:
        return repr(store)
    except Exception:
        return f"<{type(store).__name__}>"


def _explain(exc):
    """The exception's type and message (its repr when the message is
    empty, as a bare MemoryError's is); a failed verification
    (``_format.Invalid``) is named by its condition already."""
    try:
        msg = str(exc)
        if isinstance(exc, _format.Invalid):
            return msg
        return f"{type(exc).__name__}: {msg}" if msg else repr(exc)
    except Exception:  # a third-party exception whose __str__ or __repr__ fails
        return f"<{type(exc).__name__}>"


def _stat_dict(kind):
    return {"kind": kind, "lookups": 0, "hits": 0, "hit_tokens": 0, "puts": 0,
            "bytes_in": 0, "bytes_out": 0, "evictions": 0, "failures": 0, "rejected": 0,
            "spills_dropped": 0}


class Ledger:
    """The counters, faults and owed warnings of a pool's stores, in order."""

    def __init__(self, stores):
        self.stores = stores
        self._stats = [_stat_dict(getattr(s, "kind", type(s).__name__)) for s in stores]
        self._warned = [{} for _ in stores]   # condition -> the operation that failed
        self._pending = []
        self._down_until = [0.0] * len(stores)
        self.lock = threading.Lock()
        fork_guard(self, "lock", LEAF)

    def count(self, i, **deltas):
        """Add ``deltas`` to store ``i``'s counters."""
        with self.lock:
            st = self._stats[i]
            for k, d in deltas.items():
                st[k] += d

    def stats(self):
        with self.lock:
            return [dict(s) for s in self._stats]

    def fail(self, i, exc, count=True, op=None, skip=True):
        """Store ``i`` raised ``exc`` in operation ``op``: a failure (if
        ``count``), a warning owed (once per condition), and a store that
        timed out or cannot be reached left alone for its ``retry_interval``
        (if ``skip``)."""
        cond = condition(exc)
        with self.lock:
            if count:
                self._stats[i]["failures"] += 1
            if skip and cond in ("timeout", "unreachable"):
                self._down_until[i] = time.monotonic() + float(
                    getattr(self.stores[i], "retry_interval", 1.0))
            if cond not in self._warned[i]:
                self._warned[i][cond] = op
                self._pending.append(
                    f"prefix store {i} ({_describe(self.stores[i])}): {cond}: "
                    f"{_explain(exc)}; treated as a miss (warned once per condition)")

    def reject(self, i, exc):
        """An entry of store ``i`` failed verification (``exc``)."""
        self.count(i, rejected=1)
        self.fail(i, exc, count=False)

    def ok(self, i, op):
        """Operation ``op`` of store ``i`` worked: the transient conditions
        it had warned of are warned of again if they recur."""
        warned = self._warned[i]
        if warned:
            with self.lock:
                for cond in [c for c, o in warned.items() if o == op and c in _TRANSIENT]:
                    del warned[cond]

    def done(self, i, op, count=True):
        """Operation ``op`` of store ``i`` returned: the faults it reports
        although it returned (``take_faults()``, e.g. a cluster node down
        whose keys were misses) are warned of, without skipping the store
        (its other keys work); with none, as :meth:`ok`."""
        take = getattr(self.stores[i], "take_faults", None)
        try:
            faults = take() if callable(take) else ()
        except Exception as e:
            faults = [e]
        for e in faults:
            self.fail(i, e, count=count, op=op, skip=False)
        if not faults and count:
            self.ok(i, op)

    def up(self, i):
        """Whether store ``i`` may be asked now (not left alone after a timeout)."""
        return time.monotonic() >= self._down_until[i]

    def emit_warnings(self):
        """Issue the warnings recorded since the last call (caller's thread;
        on a store worker they wait for the next caller)."""
        if not self._pending or on_worker_thread():
            return
        with self.lock:
            pending, self._pending = self._pending, []
        for msg in pending:
            warnings.warn(msg, StoreWarning, stacklevel=5)
