"""The store worker of a pool: a background thread for prefix-store I/O, and
the handle of a prefetch.

A pool with stores below an in-memory first tier pushes spills down on one
worker thread and runs prefetches on a second (so that a prefetch does not
queue behind a slow Redis put).  A worker runs its jobs in order; its thread
starts with the first job and ends after ``_IDLE_EXIT`` idle seconds (or at
once when stopped), so a pool that is dropped leaves no thread behind.  A
job never raises: what it cannot do becomes a miss and a ``StoreWarning``
recorded for the pool's caller (the warnings are issued from the caller's
thread, never from a worker).  Across ``fork`` (kvcore._forksafe) a child
starts with no worker thread; the jobs still queued run on its own.
"""
import collections
import threading
import time

from .._forksafe import WORKER, fork_guard
from .._ints import shown

_IDLE_EXIT = 2.0


def check_timeout(timeout):
    """``timeout`` (None, or seconds >= 0) for a wait: None past what
    ``threading`` can wait for (``inf`` too); TypeError/ValueError naming it
    otherwise."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be None or a number of seconds, got "
                            f"{type(timeout).__name__}")
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {shown(timeout)}")
        if timeout >= threading.TIMEOUT_MAX:
            return None
    return timeout


def deadline_of(timeout):
    """The ``time.monotonic()`` by which a wait of ``timeout`` (checked;
    None: no limit) ends, or None."""
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline):
    """Seconds left until ``deadline`` (None: no limit), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def on_worker_thread():
    """True on a store worker's thread (whose warnings wait for a caller)."""
    return getattr(threading.current_thread(), "kvcore_store_worker", False)


class Worker:
    """One daemon thread running submitted callables in order."""

    def __init__(self, name):
        self._name = name
        self._cond = threading.Condition()
        self._jobs = collections.deque()
        self._running = False
        self._stopping = False
        self._thread = None
        fork_guard(self, "_cond", WORKER)

    def _after_fork_child(self):
        """The parent's thread is not in this child (the job it was running
        is not either): the jobs still queued wait for the next submit or
        wait, which start a thread of the child's own."""
        self._thread = None
        self._running = False
        self._stopping = False

    def submit(self, job):
        with self._cond:
            self._jobs.append(job)
            self._stopping = False
            if self._thread is None:
                t = threading.Thread(target=self._loop, name=self._name, daemon=True)
                t.kvcore_store_worker = True
                self._thread = t
                t.start()
            self._cond.notify_all()

    def wait_idle(self, timeout=None):
        """Wait until every job submitted so far has run (True), or
        ``timeout`` seconds passed (False).  On the worker itself: True."""
        if threading.current_thread() is self._thread:
            return True
        if self._jobs and self._thread is None:   # (queued before a fork)
            self.submit(lambda: None)
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._running, timeout)

    def stop(self, timeout=None):
        """Run what is queued, then end the thread (a later submit starts a
        new one); waits at most ``timeout`` seconds in all.  Returns False
        when the jobs had not all run by then (they go on in the
        background)."""
        deadline = deadline_of(timeout)
        done = self.wait_idle(timeout)
        with self._cond:
            t = self._thread
            if done:
                self._stopping = True
            self._cond.notify_all()
        if done and t is not None and t is not threading.current_thread():
            t.join(time_left(deadline))
        return done

    def _loop(self):
        while True:
            with self._cond:
                self._running = False
                self._cond.notify_all()
                if not self._jobs and not self._stopping:
                    self._cond.wait_for(lambda: self._jobs or self._stopping, _IDLE_EXIT)
                if not self._jobs:
                    self._thread = None
                    self._stopping = False
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                self._running = True
            try:
                job()
            except Exception:  # pragma: no cover - jobs catch their own errors
                pass


class Prefetch:
    """The handle ``BlockPool.prefetch`` returns.

    ``blocks_ready`` counts the leading blocks of the prompt that are in
    the pool's prefix cache so far (the pool's own hit, then what the
    prefetch loaded), i.e. what an ``allocate`` of the prompt now would
    hit, unless the pool evicts some of them meanwhile.
    """

    def __init__(self):
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._started = False
        self._lock = threading.Lock()
        self._key = None     # (first block's hash, salt): which prompt it loads
        self.blocks_ready = 0

    @classmethod
    def finished(cls, blocks_ready):
        h = cls()
        h.blocks_ready = int(blocks_ready)
        h._done.set()
        return h

    def done(self):
        """True once the prefetch finished (loaded its run, or stopped:
        cancelled, pool full, a store failed)."""
        return self._done.is_set()

    def wait(self, timeout=None):
        """Wait until the prefetch is done, at most ``timeout`` seconds (None:
        no limit).  Returns :meth:`done`."""
        return self._done.wait(check_timeout(timeout))

    def cancel(self):
        """Stop the prefetch: not started, it never runs; running, it stops
        after the batch of blocks it is copying (those stay in the prefix
        cache, verified).  Safe at any point and idempotent.  Returns True
        unless it had already finished."""
        with self._lock:
            was_done = self._done.is_set()
            self._cancelled.set()
            if not self._started:
                self._done.set()
        return not was_done

    def cancelled(self):
        """True after :meth:`cancel`."""
        return self._cancelled.is_set()

    def _begin(self):
        """The worker starts it: False when it was cancelled first."""
        with self._lock:
            if self._cancelled.is_set():
                return False
            self._started = True
            return True

    def _finish(self):
        self._done.set()

    def _after_fork_child(self):
        """In a forked child: the prefetch ran (or was queued) for the
        parent, whose worker thread is not here; it is cancelled and done
        (its locks fresh: a thread of the parent may have held them)."""
        self._lock = threading.Lock()
        self._done._at_fork_reinit()
        self._cancelled._at_fork_reinit()
        if not self._done.is_set():
            self._cancelled.set()
            self._done.set()

    def __repr__(self):
        state = "done" if self.done() else "running"
        if self.cancelled():
            state += ", cancelled"
        return f"<kvcore Prefetch {state}, blocks_ready={self.blocks_ready}>"
