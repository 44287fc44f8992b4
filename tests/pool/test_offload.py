"""Moving KV between pools and devices, and block tables for attention kernels."""
import numpy as np
import pytest

import kvcore


def _filled_seq(pool, n_tokens, rng, tokens=None):
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(n_tokens)) if tokens is None else tokens)
    n = n_tokens - seq.num_computed
    kv = {}
    for layer in range(pool.num_layers):
        k = rng.standard_normal((n, pool.num_kv_heads, pool.head_dim)).astype(np.float32)
        v = rng.standard_normal((n, pool.num_kv_heads, pool.head_dim)).astype(np.float32)
        seq.append(layer, k, v)
        kv[layer] = (k, v)
    seq.commit(n)
    return seq, kv


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_copy_to_another_pool_keeps_kv_tokens_and_state(dtype):
    rng = np.random.default_rng(0)
    src = kvcore.BlockPool(16, 4, 2, 2, 8, dtype=dtype)
    host = kvcore.BlockPool(8, 4, 2, 2, 8, dtype=dtype)
    seq, _ = _filled_seq(src, 10, rng)
    seq.append_token(77)
    twin = seq.copy_to(host)
    assert twin.pool is host
    assert twin.num_computed == seq.num_computed == 10
    assert np.array_equal(twin.token_ids, seq.token_ids)
    for layer in range(2):
        for a, b in zip(seq.gather(layer), twin.gather(layer)):
            assert np.array_equal(a, b)
    # the full blocks entered the destination's prefix cache
    assert host.num_cached_blocks == 2
    again = kvcore.PagedKVCache(host)
    assert again.allocate(list(range(10)) + [5]) == 8
    # the source is untouched; both pools stay consistent
    assert src.num_used_blocks == 3
    seq.free()
    twin.free()
    again.free()
    src.debug.check()
    host.debug.check()
    assert host.num_used_blocks == 0 and src.num_used_blocks == 0


def test_copy_to_short_pool_raises_and_changes_nothing():
    rng = np.random.default_rng(1)
    src = kvcore.BlockPool(16, 4, 1, 1, 4, dtype="float32")
    small = kvcore.BlockPool(2, 4, 1, 1, 4, dtype="float32")
    seq, _ = _filled_seq(src, 10, rng)
    before = small.stats()
    with pytest.raises(kvcore.OutOfBlocksError, match="3 blocks"):
        seq.copy_to(small)
    assert small.stats() == before
    small.debug.check()


def test_copy_to_rejects_other_geometry():
    src = kvcore.BlockPool(4, 4, 1, 1, 4)
    seq = kvcore.PagedKVCache(src)
    with pytest.raises(ValueError, match="block_size"):
        seq.copy_to(kvcore.BlockPool(4, 8, 1, 1, 4))
    with pytest.raises(TypeError, match="pool must be"):
        seq.copy_to("cpu")


def test_copy_blocks_to_checks_ids_and_geometry():
    a = kvcore.BlockPool(4, 2, 1, 1, 4, dtype="float32")
    b = kvcore.BlockPool(4, 2, 1, 1, 4, dtype="float32")
    a.key_cache(0)[1] = 3.0
    a.value_cache(0)[1] = 4.0
    a.copy_blocks_to(b, [1], [2])
    assert (b.key_cache(0)[2] == 3.0).all() and (b.value_cache(0)[2] == 4.0).all()
    assert (b.key_cache(0)[[0, 1, 3]] == 0).all()
    with pytest.raises(IndexError, match="dst_block_ids"):
        a.copy_blocks_to(b, [1], [4])
    with pytest.raises(IndexError, match="src_block_ids"):
        a.copy_blocks_to(b, [-1], [0])
    with pytest.raises(ValueError, match="same length"):
        a.copy_blocks_to(b, [1, 2], [0])
    with pytest.raises(ValueError, match="repeat"):
        a.copy_blocks_to(b, [1, 2], [0, 0])
    with pytest.raises(ValueError, match="dtype"):
        a.copy_blocks_to(kvcore.BlockPool(4, 2, 1, 1, 4, dtype="float16"), [1], [0])
    # nothing was written by the failed calls
    assert (b.key_cache(0)[[0, 1, 3]] == 0).all()


def test_copy_blocks_to_same_pool():
    a = kvcore.BlockPool(4, 2, 2, 1, 4, dtype="float32")
    a.key_cache(1)[0] = 5.0
    a.copy_blocks_to(a, [0], [3])
    assert (a.key_cache(1)[3] == 5.0).all()


def test_padded_and_csr_block_tables():
    rng = np.random.default_rng(2)
    pool = kvcore.BlockPool(32, 4, 1, 1, 4, dtype="float32")
    s1, _ = _filled_seq(pool, 10, rng)
    s2, _ = _filled_seq(pool, 3, rng, tokens=[9, 9, 9])
    table, lens = kvcore.padded_block_tables([s1, s2], pad_value=-1)
    assert table.dtype == np.int32 and lens.dtype == np.int32
    assert lens.tolist() == [10, 3]
    assert table.tolist() == [s1.block_table.tolist(), [s2.block_table[0], -1, -1]]
    wide, _ = kvcore.padded_block_tables([s1, s2], max_blocks=5)
    assert wide.shape == (2, 5)
    with pytest.raises(ValueError, match="max_blocks must be at least 3"):
        kvcore.padded_block_tables([s1, s2], max_blocks=2)
    for pad in (2**31, -2**31 - 1, 2**40):
        with pytest.raises(ValueError, match=rf"pad_value must fit the int32 table .*got {pad}"):
            kvcore.padded_block_tables([s1, s2], pad_value=pad)
    indptr, indices, last = kvcore.csr_block_tables([s1, s2])
    assert indptr.tolist() == [0, 3, 4]
    assert indices.tolist() == s1.block_table.tolist() + s2.block_table.tolist()
    assert last.tolist() == [2, 3]
    # explicit lengths (e.g. including a step's reserved positions)
    s1.reserve(2)
    indptr, indices, last = kvcore.csr_block_tables([s1], lengths=[12])
    assert indptr.tolist() == [0, 3] and last.tolist() == [4]
    with pytest.raises(ValueError, match="exceeds"):
        kvcore.csr_block_tables([s1], lengths=[13])
    with pytest.raises(ValueError, match="one entry per sequence"):
        kvcore.csr_block_tables([s1, s2], lengths=[1])
    other = kvcore.PagedKVCache(kvcore.BlockPool(4, 4, 1, 1, 4))
    with pytest.raises(ValueError, match="share one BlockPool"):
        kvcore.padded_block_tables([s1, other])
    with pytest.raises(ValueError, match="at least one"):
        kvcore.csr_block_tables([])
    with pytest.raises(TypeError, match="seqs\\[0\\]"):
        kvcore.csr_block_tables([object()])


def test_empty_sequence_in_tables():
    pool = kvcore.BlockPool(4, 4, 1, 1, 4)
    s = kvcore.PagedKVCache(pool)
    indptr, indices, last = kvcore.csr_block_tables([s])
    assert indptr.tolist() == [0, 0] and indices.size == 0 and last.tolist() == [0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_kvcache_to_same_contents_independent(dtype):
    rng = np.random.default_rng(3)
    c = kvcore.KVCache(2, 2, 8, 16, batch_size=2, dtype=dtype)
    c.update(0, rng.standard_normal((2, 2, 5, 8)).astype(np.float32),
             rng.standard_normal((2, 2, 5, 8)).astype(np.float32))
    c.update(1, rng.standard_normal((2, 2, 3, 8)).astype(np.float32),
             rng.standard_normal((2, 2, 3, 8)).astype(np.float32))
    d = c.to("cpu")
    assert d.layer_lengths == (5, 3) and d.dtype == c.dtype and d.device == "cpu"
    for layer in range(2):
        for a, b in zip(c.get(layer), d.get(layer)):
            assert np.array_equal(a, b)
    d.update(0, np.zeros((2, 2, 1, 8), np.float32), np.zeros((2, 2, 1, 8), np.float32),
             start_pos=0)
    assert not np.array_equal(c.get(0)[0], d.get(0)[0])
    with pytest.raises(ValueError, match="device"):
        c.to("tpu")


def test_probe_predicts_allocate_and_changes_nothing():
    pool = kvcore.BlockPool(6, 4, 1, 1, 4, dtype="float32")
    a = kvcore.PagedKVCache(pool)
    t = list(range(9))
    assert pool.probe(t) == {"hit_tokens": 0, "blocks_total": 3, "blocks_needed": 3}
    a.allocate(t)
    for layer in range(1):
        a.append(layer, np.ones((9, 1, 4), np.float32), np.ones((9, 1, 4), np.float32))
    a.commit(9)
    a.free()  # blocks 0 and 1 stay cached, nobody holds them
    before = (pool.stats(), pool.debug.snapshot()["lru_order"])
    p = pool.probe(t + [3])
    assert p == {"hit_tokens": 8, "blocks_total": 3, "blocks_needed": 3}
    assert pool.probe(t, salt="x")["hit_tokens"] == 0
    assert (pool.stats(), pool.debug.snapshot()["lru_order"]) == before
    b = kvcore.PagedKVCache(pool)
    assert b.allocate(t + [3]) == p["hit_tokens"]
    assert pool.num_free_blocks == 6 - p["blocks_needed"]
    with pytest.raises(ValueError, match="at least one token"):
        pool.probe([])


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_gather_batch_matches_single_gathers(dtype):
    rng = np.random.default_rng(5)
    pool = kvcore.BlockPool(32, 4, 2, 2, 8, dtype="float16")
    s1, _ = _filled_seq(pool, 10, rng)
    s2, _ = _filled_seq(pool, 3, rng, tokens=[7, 7, 7])
    tables, lens = kvcore.padded_block_tables([s1, s2])
    k, v = pool.gather_batch(1, tables, lens, dtype=dtype)
    assert k.shape == (2, 2, 10, 8)
    for i, s in enumerate((s1, s2)):
        ks, vs = s.gather(1, dtype=dtype)
        n = lens[i]
        assert np.array_equal(k[i, :, :n], ks) and np.array_equal(v[i, :, :n], vs)
        assert not k[i, :, n:].any() and not v[i, :, n:].any()
    with pytest.raises(ValueError, match="lengths must lie in 0..12"):
        pool.gather_batch(0, tables, [13, 1])
    with pytest.raises(IndexError, match="block_tables\\[1, 0\\]"):
        pool.gather_batch(0, [[0, 1, 2], [99, 0, 0]], [10, 3])
    with pytest.raises(ValueError, match="one entry per row"):
        pool.gather_batch(0, tables, [1])
