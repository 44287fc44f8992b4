"""How many CPU threads kvcore's parallel kernels may use (process-wide):
attention (``kvcore.set_num_threads``) and the prefix stores' checksummed
copy into a pool.  A module of its own so that every layer can read it."""
import os
import threading

from ._validate import index_int

MAX_THREADS = 1024

_threads_lock = threading.Lock()
_num_threads = None
_chosen = False       # set by set_num_threads (kvcore.hf follows it only then)


def _default_num_threads():
    """The CPUs this process may run on, capped by OMP_NUM_THREADS when set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    limit = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if limit.isdigit() and int(limit) > 0:
        n = min(n, int(limit))
    return max(1, min(n, MAX_THREADS))


def set_num_threads(n):
    """Threads attention may use on the CPU (process-wide; a plan takes the
    count when it is made).

    Parameters
    ----------
    n : int or None
        1 .. 1024.  The default is the number of CPUs this process may run
        on (``os.sched_getaffinity``), capped by ``OMP_NUM_THREADS`` if set;
        None goes back to it (and to ``kvcore.hf``'s own default, one
        thread, which holds until a count is set here).

    Returns
    -------
    int or None
        The setting before the call: the count set here, or None while the
        default held, so ``kvcore.set_num_threads(previous)`` restores it
        exactly (restoring ``get_num_threads()`` instead would turn the
        default into a chosen count, which ``kvcore.hf`` then follows).

    Notes
    -----
    The result has the same bits for every thread count: how a call is split
    into work depends only on its arguments.  A call uses fewer threads
    than this when it has too little work to repay waking them (a short
    decode runs on the calling thread).
    """
    global _num_threads, _chosen
    v = None if n is None else index_int(n, "n")
    if v is not None and not 1 <= v <= MAX_THREADS:
        raise ValueError(f"n must be in 1..{MAX_THREADS}, got {v}")
    with _threads_lock:
        previous = _num_threads if _chosen else None
        _num_threads, _chosen = v, v is not None
    return previous


def get_num_threads():
    """Threads ``paged_attention`` uses on the CPU (see :func:`set_num_threads`)."""
    global _num_threads
    with _threads_lock:
        if _num_threads is None:
            _num_threads = _default_num_threads()
        return _num_threads


def chosen_num_threads():
    """The count set by :func:`set_num_threads`, or None while the default
    holds (for ``kvcore.hf``, whose default differs)."""
    with _threads_lock:
        return _num_threads if _chosen else None
