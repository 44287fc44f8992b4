"""One status per call: a failed ``reserve``, ``commit``, ``mark_written``
or ``append_token`` asks the native sequence core once and raises from the
status it returned (once more only when the core could not take an argument
as given, after the Python layer validated it), and the core changed
nothing when it said no.  (The statuses are documented in
kvcore/_native/_seq.pyx.)"""
import numpy as np
import pytest

import kvcore

try:
    from _helpers import pool_snapshot
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import pool_snapshot

L, H, D, BS = 2, 2, 4, 4


class CountingCore:
    """Stands in for a PagedKVCache's SeqCore and counts the calls of the
    status-returning ops (everything else is passed through)."""

    OPS = ("reserve", "commit", "mark_written", "append_token")

    def __init__(self, real):
        object.__setattr__(self, "real", real)
        object.__setattr__(self, "calls", {op: 0 for op in self.OPS})

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if name not in self.OPS:
            return attr

        def counted(*args):
            self.calls[name] += 1
            return attr(*args)
        return counted

    def __setattr__(self, name, value):
        setattr(self.real, name, value)


def state(seq):
    # read through the real core (some readers take it typed)
    counting, seq._seq = seq._seq, seq._seq.real
    try:
        return _state(seq)
    finally:
        seq._seq = counting


def _state(seq):
    return (seq.num_tokens, seq.num_computed, seq.block_table.tolist(), seq.token_ids.tolist(),
            [seq.num_written(layer) for layer in range(L)], pool_snapshot(seq.pool))


@pytest.fixture
def seq():
    pool = kvcore.BlockPool(4, BS, L, H, D)
    s = kvcore.PagedKVCache(pool, max_seq_len=12)
    s.allocate([1, 2, 3, 4, 5])
    s._seq = CountingCore(s._seq)
    yield s
    s._seq = s._seq.real
    s.free()


def kv(n):
    return np.ones((n, H, D), np.float32), np.ones((n, H, D), np.float32)


# (call, expected exception, op, native calls): each fails once in the core
FAILURES = [
    (lambda s: s.reserve(100), kvcore.CacheFullError, "reserve", 1),
    (lambda s: s.reserve(np.int64(100)), kvcore.CacheFullError, "reserve", 2),
    (lambda s: s.reserve(-1), ValueError, "reserve", 1),
    (lambda s: s.commit(3), ValueError, "commit", 1),              # unwritten
    (lambda s: s.commit(np.int32(3)), ValueError, "commit", 2),
    (lambda s: s.commit(40), kvcore.CacheFullError, "commit", 1),
    (lambda s: s.mark_written(0, 20), kvcore.CacheFullError, "mark_written", 1),
    (lambda s: s.mark_written(0, 9), ValueError, "mark_written", 1),  # past reserved
    (lambda s: s.mark_written(np.int8(1), np.int16(9)), ValueError, "mark_written", 2),
    (lambda s: s.mark_written(L, 1), IndexError, "mark_written", 1),  # bad layer: validated
    (lambda s: s.append_token(-3), ValueError, "append_token", 1),
]


@pytest.mark.parametrize("call,exc,op,calls", FAILURES)
def test_a_failed_op_asks_the_core_once_and_changes_nothing(seq, call, exc, op, calls):
    before = state(seq)
    with pytest.raises(exc):
        call(seq)
    assert seq._seq.calls[op] == calls
    assert state(seq) == before
    seq.pool.debug.check()


def test_append_token_past_max_seq_len_asks_once(seq):
    for t in range(7):
        seq.append_token(t)
    seq._seq.calls["append_token"] = 0
    before = state(seq)
    with pytest.raises(kvcore.CacheFullError):
        seq.append_token(99)
    assert seq._seq.calls["append_token"] == 1
    assert state(seq) == before


@pytest.mark.parametrize("name,args", [("reserve", (1,)), ("commit", (1,)),
                                       ("mark_written", (0, 1)), ("append_token", (7,))])
def test_a_freed_sequence_raises_its_state_error_from_the_first_status(seq, name, args):
    core = seq._seq
    seq._seq = core.real
    seq.free()
    seq._seq = core
    with pytest.raises(ValueError, match="freed|closed"):
        getattr(seq, name)(*args)
    assert sum(core.calls.values()) == 1


def test_a_successful_op_asks_the_core_once(seq):
    seq.reserve(2)
    k, v = kv(2)
    counting, seq._seq = seq._seq, seq._seq.real
    slots = seq.slot_mapping(seq.num_computed, seq.num_computed + 2)
    seq._seq = counting
    for layer in range(L):
        seq.pool.write(layer, k, v, slots)
        seq.mark_written(layer, 2)
    seq.commit(2)
    seq.append_token(9)
    assert seq._seq.calls == {"reserve": 1, "commit": 1, "mark_written": L,
                               "append_token": 1}
