"""kvcore's locks across ``fork()``.

A forked child has only the thread that called ``fork``; a lock another
thread held at that moment (a pool's lock taken by the prefetch worker, the
store worker's queue) would stay held for ever in the child.  So every lock
a kvcore thread can hold is registered here, with its rank, and
``os.register_at_fork`` hooks:

* before the fork, take every registered lock, rank by rank (pools, then
  the stores' queues, then the workers, then leaf locks: the order in which
  kvcore's code nests them), so no kvcore thread holds one, and every
  structure a lock guards is consistent, when the process is copied;
* after it, in the parent and in the child, release them; in the child,
  then call each owner's ``_after_fork_child()`` (a worker's thread is
  gone: it starts afresh; a prefetch in flight never finishes there).

A lock still held after :data:`WAIT` seconds (a thread stuck inside a
store call, say) is not waited for longer: the fork goes on, and the child
re-initialises that lock instead (its structure may then be mid-update,
but the child does not hang).  Locks of rank ``RENEW`` are never taken
before a fork (they may be held across slow network calls): the child
re-initialises them, for owners that rebuild what they guard.
"""
import os
import threading
import weakref

#: ranks, in the order locks are taken before a fork (kvcore nests them so)
POOL, QUEUE, WORKER, LEAF, RENEW = range(5)
#: seconds a fork waits for one lock that another thread holds
WAIT = 5.0

# owner -> [(rank, attribute naming its lock)], weakly: a dropped owner leaves
_owners = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()
_taken = []          # (lock, acquired) pairs of the fork in progress


def fork_guard(owner, attr, rank):
    """Make lock ``getattr(owner, attr)`` safe across ``fork``, at ``rank``
    (``attr`` None: no lock, only the hook).  ``owner`` may define
    ``_after_fork_child()``, called in the child once every lock is free
    again."""
    with _registry_lock:
        _owners.setdefault(owner, []).append((rank, attr))


def _locks():
    """[(rank, lock)] of the live owners, in the order a fork takes them."""
    with _registry_lock:
        items = [(rank, owner, attr) for owner, regs in list(_owners.items())
                 for rank, attr in regs]
    items.sort(key=lambda x: x[0])
    return [(rank, None if attr is None else getattr(owner, attr, None))
            for rank, owner, attr in items]


def _before():
    _taken.clear()
    for rank, lock in _locks():
        if lock is None:
            continue
        if rank == RENEW:
            _taken.append((lock, False))
            continue
        try:
            got = lock.acquire(True, WAIT)
        except Exception:   # pragma: no cover - a lock of an unexpected kind
            got = False
        _taken.append((lock, got))


def _release(child):
    taken = list(reversed(_taken))
    _taken.clear()
    for lock, got in taken:
        if got:
            lock.release()
        elif child:
            _reinit(lock)


def _reinit(lock):
    """A lock possibly held by a thread that does not exist in this child:
    free again (``_at_fork_reinit``, which CPython's own locks, conditions
    and kvcore's checked pool lock have)."""
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()


def _after_parent():
    _release(child=False)


def _after_child():
    _release(child=True)
    with _registry_lock:
        owners = list(_owners.keys())
    for owner in owners:
        hook = getattr(owner, "_after_fork_child", None)
        if hook is not None:
            hook()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=_after_parent,
                        after_in_child=_after_child)
