"""kvcore.PagedKVCache: round trips, step semantics, errors that change
nothing, max_seq_len, lifecycle, token-id validation."""
import ml_dtypes
import numpy as np
import pytest

import kvcore

try:
    from _helpers import pool_snapshot
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import pool_snapshot

BF16 = np.dtype(ml_dtypes.bfloat16)
L, H, D = 3, 2, 4


def make_pool(num_blocks=16, block_size=4, dtype="float32", caching=True, layers=L):
    return kvcore.BlockPool(num_blocks, block_size, layers, H, D, dtype=dtype,
                            enable_prefix_caching=caching)


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)



def seq_snapshot(seq):
    return {
        "num_tokens": seq.num_tokens,
        "num_computed": seq.num_computed,
        "block_table": seq.block_table.tolist(),
        "token_ids": seq.token_ids.tolist(),
        "hashes": seq.block_hashes(),
        "written": [seq.num_written(layer) for layer in range(seq.pool.num_layers)],
        "capacity": seq.capacity,
    }


def assert_unchanged(pool, psnap, seqs=(), ssnaps=()):
    assert pool_snapshot(pool) == psnap
    for s, snap in zip(seqs, ssnaps):
        assert seq_snapshot(s) == snap
    pool.debug.check()


class Writer:
    """Drives one sequence and remembers what each layer should read back."""

    def __init__(self, seq, seed):
        self.seq = seq
        self.seed = seed
        self.k = [np.zeros((H, 0, D), np.float32) for _ in range(seq.pool.num_layers)]
        self.v = [np.zeros((H, 0, D), np.float32) for _ in range(seq.pool.num_layers)]

    def step(self, n):
        for layer in range(self.seq.pool.num_layers):
            self.seed += 1
            k, v = rand((n, H, D), self.seed), rand((n, H, D), -self.seed % 2**31)
            self.seq.append(layer, k, v)
            self.k[layer] = np.concatenate([self.k[layer], k.transpose(1, 0, 2)], 1)
            self.v[layer] = np.concatenate([self.v[layer], v.transpose(1, 0, 2)], 1)
        self.seq.commit(n)

    def verify(self):
        for layer in range(self.seq.pool.num_layers):
            k, v = self.seq.gather(layer)
            np.testing.assert_array_equal(k, self.k[layer])
            np.testing.assert_array_equal(v, self.v[layer])


def written_seq(pool, tokens, seed):
    """``(seq, writer)``: a sequence of ``pool`` allocated on ``tokens`` and
    the Writer that wrote and committed KV for all of them."""
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(tokens)
    w = Writer(seq, seed)
    w.step(len(tokens))
    return seq, w


# ------------------------------------------------------------------ round trips
def test_exported():
    assert "PagedKVCache" in kvcore.__all__


@pytest.mark.parametrize("caching", [True, False])
def test_prompt_then_decode_round_trip(caching):
    pool = make_pool(caching=caching)
    seq = kvcore.PagedKVCache(pool)
    prompt = list(range(10, 21))   # 11 tokens, 3 blocks of 4
    assert seq.allocate(prompt) == 0
    assert seq.num_tokens == 11 and seq.num_computed == 0
    assert seq.block_table.dtype == np.int32 and len(seq.block_table) == 3
    w = Writer(seq, 100)
    w.step(11)
    assert seq.num_computed == 11
    w.verify()
    for i in range(7):
        seq.append_token(50 + i)
        w.step(1)
        w.verify()
    assert seq.num_tokens == seq.num_computed == 18
    assert len(seq.block_table) == 5
    assert seq.token_ids.tolist() == prompt + list(range(50, 57))
    # sub-ranges, and the raw pool gather over the same block table agree
    for layer in range(L):
        k, v = seq.gather(layer, 3, 14)
        np.testing.assert_array_equal(k, w.k[layer][:, 3:14])
        np.testing.assert_array_equal(v, w.v[layer][:, 3:14])
        pk, pv = pool.gather(layer, seq.block_table, 3, 14)
        np.testing.assert_array_equal(pk, k)
        np.testing.assert_array_equal(pv, v)
        ek, _ = seq.gather(layer, 5, 5)
        assert ek.shape == (H, 0, D)
    # the data sits in the pool where block_table says
    b = seq.block_table[2]
    np.testing.assert_array_equal(pool.key_cache(1)[b, :, 1, :], w.k[1][:, 9, :])
    seq.free()
    assert pool.num_free_blocks == pool.num_blocks
    pool.debug.check()


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_narrow_storage_and_widening_gather(storage):
    pool = make_pool(dtype=storage)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3, 4, 5])
    k32 = rand((5, H, D), 1)
    if storage == "float16":
        k, kw, narrow, widen = kvcore.to_float16(k32), {}, kvcore.to_float16, \
            kvcore.from_float16
    else:
        k, kw, narrow, widen = kvcore.to_bfloat16(k32), {"src_dtype": "bfloat16"}, \
            kvcore.to_bfloat16, kvcore.from_bfloat16
    for layer in range(L):
        seq.append(layer, k, k, **kw)
        if storage == "bfloat16":
            seq.append(layer, k.view(BF16), k.view(BF16))   # ml_dtypes input overwrites
    seq.commit(5)
    want = narrow(k32).transpose(1, 0, 2)
    bits = np.uint16
    for layer in range(L):
        gk, gv = seq.gather(layer)
        assert gk.dtype == pool.key_cache(0).dtype
        np.testing.assert_array_equal(gk.view(bits), want.view(bits))
        np.testing.assert_array_equal(gv.view(bits), want.view(bits))
        wk, _ = seq.gather(layer, dtype="float32")
        assert wk.dtype == np.float32
        np.testing.assert_array_equal(wk, widen(want))
    seq.free()


def test_gather_default_end_includes_this_steps_appends():
    pool = make_pool()
    seq, w = written_seq(pool, list(range(6)), 7)
    seq.append_token(99)
    k0 = rand((1, H, D), 1)
    seq.append(0, k0, -k0)
    # layer 0 sees its new position before the other layers are written
    assert seq.num_written(0) == 7 and seq.num_written(1) == 6
    k, v = seq.gather(0)
    assert k.shape == (H, 7, D)
    np.testing.assert_array_equal(k[:, 6], k0[0])
    np.testing.assert_array_equal(v[:, 6], -k0[0])
    assert seq.gather(1)[0].shape == (H, 6, D)
    with pytest.raises(ValueError, match="never"):
        seq.gather(1, 0, 7)
    # rewriting a layer in the same step overwrites
    k1 = rand((1, H, D), 2)
    seq.append(0, k1, k1)
    np.testing.assert_array_equal(seq.gather(0, 6, 7)[0][:, 0], k1[0])
    assert seq.num_computed == 6
    for layer in (1, 2):
        seq.append(layer, k1, k1)
    seq.commit(1)
    assert [seq.num_written(i) for i in range(L)] == [7, 7, 7]
    np.testing.assert_array_equal(seq.gather(2)[0][:, 6], k1[0])
    seq.free()


def test_reading_never_written_positions_raises():
    pool = make_pool()
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(9)))
    assert seq.gather(0)[0].shape == (H, 0, D)
    with pytest.raises(ValueError, match="never"):
        seq.gather(0, 0, 1)
    Writer(seq, 1).step(5)
    seq.gather(0, 0, 5)
    with pytest.raises(ValueError, match="never"):
        seq.gather(0, 0, 6)
    with pytest.raises(ValueError, match="never"):
        seq.gather(2, 4, 9)
    with pytest.raises(ValueError, match="start and end"):
        seq.gather(0, 3, 2)
    with pytest.raises(ValueError, match="start and end"):
        seq.gather(0, -1, 2)
    with pytest.raises(IndexError, match="layer"):
        seq.gather(L)
    # reserved-but-uncommitted positions are not readable either
    seq.reserve(3)
    with pytest.raises(ValueError, match="never"):
        seq.gather(0, 0, 6)
    seq.free()
    with pytest.raises(ValueError, match="freed"):
        seq.gather(0, 0, 1)


def test_reserve_slot_mapping_and_pool_write_for_a_batch():
    """The batched path: reserve every sequence, one pool.write per layer."""
    bs = 4
    pool = make_pool(num_blocks=24, block_size=bs)
    prompts = [list(range(100 * i, 100 * i + n)) for i, n in enumerate([5, 8, 1, 13])]
    seqs = [kvcore.PagedKVCache(pool) for _ in prompts]
    want_k = [[np.zeros((H, 0, D), np.float32) for _ in range(L)] for _ in seqs]
    for s, p in zip(seqs, prompts):
        assert s.allocate(p) == 0
    lens = [len(p) for p in prompts]
    for step in range(4):
        news = lens if step == 0 else [1] * len(seqs)
        for s, n in zip(seqs, news):
            s.reserve(n)
        slots = np.concatenate([s.slot_mapping(s.num_computed, s.num_computed + n)
                                for s, n in zip(seqs, news)])
        assert slots.dtype == np.int64
        assert len(set(slots.tolist())) == len(slots)
        for layer in range(L):
            k = rand((len(slots), H, D), 1000 * step + layer)
            pool.write(layer, k, 2 * k, slots)
            for s, n in zip(seqs, news):
                s.mark_written(layer, n)
            o = 0
            for i, n in enumerate(news):
                want_k[i][layer] = np.concatenate(
                    [want_k[i][layer], k[o:o + n].transpose(1, 0, 2)], 1)
                o += n
        for s, n in zip(seqs, news):
            s.commit(n)
            if step < 3:
                s.append_token(7)
    for i, s in enumerate(seqs):
        for layer in range(L):
            k, v = s.gather(layer)
            np.testing.assert_array_equal(k, want_k[i][layer])
            np.testing.assert_array_equal(v, 2 * want_k[i][layer])
    # slot_mapping matches the block table
    s = seqs[3]
    table = s.block_table
    np.testing.assert_array_equal(
        s.slot_mapping(0, s.num_computed),
        [table[p // bs] * bs + p % bs for p in range(s.num_computed)])
    with pytest.raises(ValueError, match="start and end"):
        s.slot_mapping(0, s.capacity + 1)
    with pytest.raises(ValueError, match="start and end"):
        s.slot_mapping(3, 2)
    assert s.slot_mapping(s.capacity, s.capacity).shape == (0,)
    for s in seqs:
        s.free()
    pool.debug.check()
    assert pool.num_free_blocks == 24


def test_reserve_zero_and_reserve_within_held_blocks_take_nothing():
    pool = make_pool(num_blocks=4)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2])
    snap = pool_snapshot(pool)
    seq.reserve(0)
    seq.reserve(2)      # positions 0..1, inside block 0
    seq.reserve(4)      # still block 0
    assert pool_snapshot(pool) == snap
    seq.reserve(5)
    assert pool.num_used_blocks == 2 and seq.capacity == 8
    with pytest.raises(ValueError, match="n must be"):
        seq.reserve(-1)
    with pytest.raises(TypeError, match="^n "):
        seq.reserve(1.0)
    seq.free()


# ------------------------------------------------------------------ errors change nothing
def test_out_of_blocks_in_allocate_changes_nothing():
    pool = make_pool(num_blocks=3, block_size=4)
    a = kvcore.PagedKVCache(pool)
    a.allocate(list(range(8)))
    Writer(a, 3).step(8)
    psnap = pool_snapshot(pool)
    b = kvcore.PagedKVCache(pool)
    bsnap = seq_snapshot(b)
    with pytest.raises(kvcore.OutOfBlocksError, match="allocate"):
        b.allocate(list(range(100, 109)))   # 3 blocks, 1 free
    assert_unchanged(pool, psnap, [a, b], [seq_snapshot(a), bsnap])
    # the failed sequence is still usable
    assert b.allocate([5]) == 0
    b.free()
    a.free()


def test_out_of_blocks_in_append_and_reserve_changes_nothing():
    pool = make_pool(num_blocks=3, block_size=4)
    a, wa = written_seq(pool, list(range(6)), 1)
    b, wb = written_seq(pool, [9], 2)
    # a needs 1 more block for positions 8..11: 0 free after b -> full pool
    assert pool.num_free_blocks == 0
    psnap, asnap, bsnap = pool_snapshot(pool), seq_snapshot(a), seq_snapshot(b)
    k = rand((6, H, D), 9)
    with pytest.raises(kvcore.OutOfBlocksError):
        a.append(0, k, k)
    assert_unchanged(pool, psnap, [a, b], [asnap, bsnap])
    with pytest.raises(kvcore.OutOfBlocksError):
        a.reserve(3)
    assert_unchanged(pool, psnap, [a, b], [asnap, bsnap])
    # a fits 2 more positions without a new block
    a.reserve(2)
    assert_unchanged(pool, psnap, [a, b], [asnap, bsnap])
    wa.verify()
    wb.verify()
    a.free()
    b.free()


def test_out_of_blocks_for_copy_on_write_changes_nothing():
    """A shared partial block needs a copy before a write; no block, no change."""
    pool = make_pool(num_blocks=2, block_size=4)
    a, wa = written_seq(pool, [1, 2, 3], 5)
    c = a.fork()
    b = kvcore.PagedKVCache(pool)
    b.allocate([4])
    assert pool.num_free_blocks == 0
    snaps = pool_snapshot(pool), [seq_snapshot(s) for s in (a, b, c)]
    k = rand((1, H, D), 3)
    with pytest.raises(kvcore.OutOfBlocksError, match="copy-on-write"):
        a.append(0, k, k)
    with pytest.raises(kvcore.OutOfBlocksError):
        c.reserve(1)
    assert_unchanged(pool, snaps[0], [a, b, c], snaps[1])
    b.free()
    a.append(0, k, k)        # now the copy happens
    assert a.block_table[0] != c.block_table[0]
    wc = Writer(c, 0)
    wc.k, wc.v = [x.copy() for x in wa.k], [x.copy() for x in wa.v]
    wc.verify()
    a.free()
    c.free()
    pool.debug.check()


def test_max_seq_len():
    pool = make_pool(num_blocks=8, block_size=4)
    with pytest.raises(kvcore.CacheFullError, match="max_seq_len"):
        kvcore.PagedKVCache(pool, max_seq_len=4).allocate([1, 2, 3, 4, 5])
    assert pool.num_free_blocks == 8
    seq = kvcore.PagedKVCache(pool, max_seq_len=6)
    assert seq.max_seq_len == 6
    seq.allocate([1, 2, 3, 4, 5])
    w = Writer(seq, 1)
    w.step(5)
    snap = pool_snapshot(pool), seq_snapshot(seq)
    k2 = rand((2, H, D), 4)
    with pytest.raises(kvcore.CacheFullError, match="max_seq_len"):
        seq.append(0, k2, k2)
    with pytest.raises(kvcore.CacheFullError, match="max_seq_len"):
        seq.reserve(2)
    with pytest.raises(kvcore.CacheFullError, match="max_seq_len"):
        seq.commit(2)
    seq.append_token(6)
    snap = pool_snapshot(pool), seq_snapshot(seq)
    with pytest.raises(kvcore.CacheFullError, match="max_seq_len"):
        seq.append_token(7)
    assert_unchanged(pool, snap[0], [seq], [snap[1]])
    # exactly max_seq_len positions fit
    seq.reserve(1)
    w.step(1)
    assert seq.num_computed == seq.num_tokens == 6
    with pytest.raises(kvcore.CacheFullError):
        seq.reserve(1)
    with pytest.raises(kvcore.CacheFullError):
        seq.commit(1)
    w.verify()
    seq.free()
    # allocate of exactly max_seq_len tokens is fine
    seq2 = kvcore.PagedKVCache(pool, max_seq_len=6)
    seq2.allocate(list(range(6)))
    seq2.free()
    with pytest.raises(ValueError, match="max_seq_len"):
        kvcore.PagedKVCache(pool, max_seq_len=0)
    with pytest.raises(TypeError, match="max_seq_len"):
        kvcore.PagedKVCache(pool, max_seq_len=4.0)


def test_commit_past_reserved_blocks_is_value_error():
    pool = make_pool(num_blocks=8, block_size=4)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    with pytest.raises(ValueError, match="reserved") as e:
        seq.commit(5)
    assert not isinstance(e.value, kvcore.CacheFullError)
    assert seq.num_computed == 0
    k = rand((4, H, D), 1)
    for layer in range(L):        # block 0 is held: 4 positions are reserved
        seq.append(layer, k, k)
    seq.commit(4)
    assert seq.num_computed == 4
    with pytest.raises(ValueError, match="n must be"):
        seq.commit(-1)
    seq.commit(0)
    seq.free()


# ------------------------------------------------------------------ lifecycle
def test_free_is_idempotent_and_returns_blocks():
    pool = make_pool(num_blocks=6)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(10)))
    Writer(seq, 2).step(10)
    table = seq.block_table.tolist()
    assert [pool.ref_count(b) for b in table] == [1, 1, 1]
    seq.free()
    assert [pool.ref_count(b) for b in table] == [0, 0, 0]
    assert pool.num_free_blocks == 6
    assert seq.num_blocks == seq.num_tokens == seq.num_computed == 0
    assert seq.block_table.shape == (0,)
    snap = pool_snapshot(pool)
    seq.free()
    seq.free()
    assert pool_snapshot(pool) == snap
    pool.debug.check()
    # a freed sequence is closed: it cannot take blocks again
    assert seq.closed
    with pytest.raises(ValueError, match="freed"):
        seq.allocate([1])
    assert pool_snapshot(pool) == snap


def test_context_manager_frees_on_exit_even_on_error():
    pool = make_pool(num_blocks=6)
    with kvcore.PagedKVCache(pool) as seq:
        seq.allocate(list(range(9)))
        assert pool.num_used_blocks == 3
    assert pool.num_used_blocks == 0
    with pytest.raises(RuntimeError):
        with kvcore.PagedKVCache(pool) as seq:
            seq.allocate([1])
            raise RuntimeError
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_dropped_sequence_returns_its_blocks():
    pool = make_pool(num_blocks=6)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(9)))
    del seq
    assert pool.num_free_blocks == 6


def test_allocate_twice_is_value_error():
    pool = make_pool()
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2])
    snap = pool_snapshot(pool), seq_snapshot(seq)
    with pytest.raises(ValueError, match="allocate"):
        seq.allocate([3])
    assert_unchanged(pool, snap[0], [seq], [snap[1]])
    with pytest.raises(ValueError, match="token_ids"):
        kvcore.PagedKVCache(pool).allocate([])
    seq.free()


def test_fork_shares_blocks_and_copies_on_write():
    pool = make_pool(num_blocks=8, block_size=4, caching=False)
    a, wa = written_seq(pool, list(range(6)), 10)
    b = a.fork()
    assert b.block_table.tolist() == a.block_table.tolist()
    assert [pool.ref_count(x) for x in a.block_table] == [2, 2]
    assert b.num_computed == 6 and b.num_tokens == 6
    wb = Writer(b, 20)
    wb.k, wb.v = [x.copy() for x in wa.k], [x.copy() for x in wa.v]
    wa.step(1)             # copies the shared partial block
    assert a.block_table[0] == b.block_table[0]
    assert a.block_table[1] != b.block_table[1]
    wb.verify()
    with pytest.raises(ValueError, match="never"):
        b.gather(0, 0, 7)
    wb.step(2)             # b now holds its block alone: writes in place
    wa.verify()
    wb.verify()
    a.free()
    wb.verify()
    b.free()
    assert pool.num_free_blocks == 8
    pool.debug.check()


def test_truncate():
    pool = make_pool(num_blocks=8, block_size=4)
    seq, w = written_seq(pool, list(range(10)), 5)
    with pytest.raises(ValueError, match="n must be at most"):
        seq.truncate(11)
    seq.truncate(10)
    assert seq.num_blocks == 3
    seq.truncate(5)
    assert seq.num_tokens == seq.num_computed == 5 and seq.num_blocks == 2
    assert pool.num_used_blocks == 2
    w.k = [x[:, :5] for x in w.k]
    w.v = [x[:, :5] for x in w.v]
    w.verify()
    seq.append_token(42)
    w.step(1)
    w.verify()
    seq.truncate(0)
    assert seq.num_blocks == 0 and pool.num_used_blocks == 0
    with pytest.raises(TypeError, match="^n "):
        seq.truncate(1.0)
    seq.free()
    pool.debug.check()


def test_truncate_limit_counts_written_positions():
    """n may reach past the known tokens up to the written positions."""
    pool = make_pool(num_blocks=8, block_size=4)
    seq, w = written_seq(pool, [1, 2, 3], 1)
    w.step(2)                       # KV for positions 3, 4 before their tokens
    assert seq.num_tokens == 3 and seq.num_computed == 5
    k = rand((1, H, D), 8)
    seq.append(0, k, k)             # position 5 in layer 0 only
    with pytest.raises(ValueError, match="at most .*6"):
        seq.truncate(7)
    seq.truncate(6)
    assert seq.num_computed == 5 and seq.num_written(0) == 6
    seq.truncate(4)
    assert seq.num_computed == 4 and seq.num_tokens == 3 and seq.num_written(0) == 4
    seq.free()


# ------------------------------------------------------------------ token ids
@pytest.mark.parametrize("bad,exc", [
    ([1, -1], ValueError), ([2**31], ValueError), ([1, 2**31 - 1 + 1], ValueError),
    ([2**70], (TypeError, ValueError)), ([1.0, 2.0], TypeError), ([True, False], TypeError),
    (np.array([True]), TypeError), (np.array([1.5]), TypeError),
    (np.array([[1, 2]]), ValueError), ([[1, 2], [3, 4]], (TypeError, ValueError)),
    (np.array([-1], np.int64), ValueError), (np.array([2**31], np.uint32), ValueError),
    ("abc", TypeError), (5, TypeError), (["1"], TypeError),
])
def test_bad_token_ids_name_the_argument(bad, exc):
    pool = make_pool()
    seq = kvcore.PagedKVCache(pool)
    snap = pool_snapshot(pool)
    with pytest.raises(exc, match="token_ids"):
        seq.allocate(bad)
    assert pool_snapshot(pool) == snap
    assert seq.num_tokens == 0 and seq.num_blocks == 0
    with pytest.raises(exc, match="token_ids"):
        kvcore.block_hashes(bad, 4)


def test_good_token_id_containers():
    pool = make_pool()
    top = 2**31 - 1
    for ids in ([0, top], (0, top), np.array([0, top], np.int64),
                np.array([0, top], np.uint32), np.array([0, 5, top, 7], np.int32)[::2],
                range(3)):
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(ids)
        assert seq.token_ids.tolist() == list(ids)
        assert seq.token_ids.dtype == np.int32
        seq.free()


def test_allocate_copies_caller_tokens():
    pool = make_pool()
    ids = np.array([1, 2, 3], np.int32)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(ids)
    ids[0] = 77
    assert seq.token_ids.tolist() == [1, 2, 3]
    seq.free()


@pytest.mark.parametrize("bad,exc", [
    (-1, ValueError), (2**31, ValueError), (1.0, TypeError), (True, TypeError),
    ("1", TypeError), (None, TypeError), (np.bool_(True), TypeError),
])
def test_bad_append_token(bad, exc):
    pool = make_pool()
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1])
    with pytest.raises(exc, match="token_id"):
        seq.append_token(bad)
    assert seq.num_tokens == 1
    seq.append_token(np.int64(2**31 - 1))
    assert seq.token_ids.tolist() == [1, 2**31 - 1]
    seq.free()


def test_constructor_errors():
    pool = make_pool()
    with pytest.raises(TypeError, match="pool"):
        kvcore.PagedKVCache(object())
    with pytest.raises(TypeError, match="salt"):
        kvcore.PagedKVCache(pool, salt=5)


def test_append_argument_errors_change_nothing():
    pool = make_pool()
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    snap = pool_snapshot(pool), seq_snapshot(seq)
    k = rand((2, H, D), 1)
    with pytest.raises(IndexError, match="layer"):
        seq.append(L, k, k)
    with pytest.raises(ValueError, match="^k must have shape"):
        seq.append(0, k[:, :1], k)
    with pytest.raises(ValueError, match="at least one"):
        seq.append(0, k[:0], k[:0])
    with pytest.raises(TypeError, match="src_dtype"):
        seq.append(0, k.view(np.uint16)[..., :D], k.view(np.uint16)[..., :D])
    assert_unchanged(pool, snap[0], [seq], [snap[1]])
    seq.free()


def test_copy_and_deepcopy_of_a_sequence_fork_it_and_the_rest_refuse_by_name():
    """copy.copy / copy.deepcopy of a PagedKVCache is its fork (its own
    refcounts: freeing the copy leaves the original whole); a pool, a plan
    or a store is not copied or pickled, with an error that names it and
    says what to do (review, 2026-12-07: deepcopy and pickle raised a Cython
    internal message, and copy.copy returned an alias whose free() closed
    the original)."""
    import copy
    import pickle

    pool = kvcore.BlockPool(8, 4, 1, 1, 4, dtype="float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(6)))
    kv = np.arange(24, dtype=np.float32).reshape(6, 1, 4)
    seq.append(0, kv, kv)
    seq.commit(6)
    for make in (copy.copy, copy.deepcopy):
        child = make(seq)
        assert child is not seq and child.num_tokens == 6 and pool.num_used_blocks == 2
        assert child.block_table.tolist() == seq.block_table.tolist()
        child.reserve(1)                     # copy-on-write: the shared last block
        child.free()
        assert not seq.closed and seq.num_tokens == 6 and pool.num_used_blocks == 2
        np.testing.assert_array_equal(seq.gather(0)[0], kv.transpose(1, 0, 2))  # (heads, tokens, dim)
    with pytest.raises(TypeError, match=r"^a kvcore\.PagedKVCache cannot be pickled"):
        pickle.dumps(seq)
    plan = kvcore.AttentionPlan(pool, np.zeros((1, 2), np.int32), np.array([6]))
    store = kvcore.HostStore(1 << 20)
    for obj, name in ((pool, r"a kvcore\.BlockPool"), (plan, r"a kvcore\.AttentionPlan"),
                      (store, r"a HostStore")):
        for make in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=rf"^{name} is not copied or pickled"):
                make(obj)
    seq.free()
    assert pool.num_used_blocks == 0
    pool.debug.check()
