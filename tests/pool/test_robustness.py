"""Misuse that must give a Python exception (never a crash) or leave the
pool whole, and the batch-write path reading its own step."""
import subprocess
import sys

import numpy as np
import pytest

import kvcore


def test_uninitialised_sequence_raises_instead_of_crashing():
    # run in a subprocess: a regression here kills the interpreter (SIGFPE)
    code = """
import kvcore
class S(kvcore.PagedKVCache):
    def __init__(self, pool):
        self.p = pool
for make in (lambda: kvcore.PagedKVCache.__new__(kvcore.PagedKVCache),
             lambda: S(kvcore.BlockPool(4, 4, 1, 1, 4))):
    for call in (lambda s: s.allocate([1, 2]), lambda s: s.reserve(1), lambda s: s.commit(0),
                 lambda s: s.append_token(1), lambda s: s.truncate(0)):
        try:
            call(make())
        except (RuntimeError, AttributeError) as e:
            pass
        else:
            raise SystemExit("no error raised")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_reinitialising_a_live_sequence_releases_its_blocks():
    pool = kvcore.BlockPool(8, 4, 1, 1, 4)
    s = kvcore.PagedKVCache(pool)
    s.allocate(list(range(14)))
    assert pool.num_used_blocks == 4
    s.__init__(pool)
    assert pool.num_used_blocks == 0 and s.num_blocks == 0
    pool.debug.check()


@pytest.mark.parametrize("dt", [">i8", "<i8", ">i4", "<u2"])
def test_slots_of_any_byte_order_and_width(dt, make_pool):
    pool = make_pool()
    k = np.arange(8, dtype=np.float32).reshape(2, 1, 4)
    pool.write(0, k, -k, np.array([1, 30], dt))
    assert np.array_equal(pool.key_cache(0)[0, 0, 1], k[0, 0])
    assert np.array_equal(pool.value_cache(0)[7, 0, 2], -k[1, 0])
    with pytest.raises(IndexError, match="slots must be -1 .* got 32 at index 1"):
        pool.write(0, k, k, np.array([1, 32], dt))


def test_mark_written_lets_gather_read_a_batch_written_step(pool, seq):
    rng = np.random.default_rng(0)
    seq.allocate([1, 2, 3])
    seq.reserve(3)
    slots = seq.slot_mapping(0, 3)
    k = rng.standard_normal((3, 1, 4)).astype(np.float32)
    pool.write(0, k, k, slots)
    with pytest.raises(ValueError, match="never written"):
        seq.gather(0, 0, 3)
    seq.mark_written(0, 3)
    got, _ = seq.gather(0)
    assert np.array_equal(got, k.transpose(1, 0, 2))
    assert seq.num_written(1) == 0          # only the layer that was declared
    with pytest.raises(ValueError, match="reserve first"):
        seq.mark_written(1, 5)
    with pytest.raises(IndexError, match="layer"):
        seq.mark_written(2, 1)
    with pytest.raises(ValueError, match="layer 1 has written 0 of them"):
        seq.commit(3)                       # layer 1 was not declared
    assert seq.num_computed == 0
    pool.write(1, k, k, slots)
    seq.mark_written(1, 3)
    seq.commit(3)
    assert seq.num_written(0) == seq.num_written(1) == 3


def test_reset_prefix_cache_forgets_salts_but_never_reuses_a_root(make_pool):
    pool = make_pool()
    live = kvcore.PagedKVCache(pool, salt="a")      # made before the reset, no blocks
    for i in range(5):
        kvcore.PagedKVCache(pool, salt=f"s{i}")    # dropped at once: forgotten
    assert pool.stats()["num_salts"] == 1
    assert pool.reset_prefix_cache()
    assert pool.stats()["num_salts"] == 1           # live still holds "a"
    # a salt first seen after the reset must not land on live's old root
    other = kvcore.PagedKVCache(pool, salt="b")
    t = list(range(9))
    live.allocate(t)
    live.append(0, np.ones((9, 1, 4), np.float32), np.ones((9, 1, 4), np.float32))
    live.commit(9)
    assert pool.num_cached_blocks == 2
    assert other.allocate(t) == 0
    assert pool.stats()["num_salts"] == 2
    live.free()
    other.free()
    pool.debug.check()


def test_a_broadcast_q_too_large_to_copy_is_named():
    """A zero-stride q of a wrong, huge shape, copied because another
    argument (a list) is converted after it: the MemoryError names q and its
    shape (review, 2026-12-07: NumPy's own message, no argument named)."""
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float32")
    q = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(2**33, 2, 8),
                                        strides=(0, 0, 0))
    with pytest.raises(MemoryError, match=r"^q of shape \(8589934592, 2, 8\) "):
        kvcore.paged_attention(q, pool, 0, np.zeros((1, 2), np.int32), [5])
