"""kvcore.BlockPool: geometry, storage views, batched slot writes, raw
gathers, reference counts, counters, argument errors and exact boundaries."""
import ml_dtypes
import numpy as np
import pytest

import kvcore

try:
    from _helpers import pool_snapshot, storage_bits
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import pool_snapshot, storage_bits

BF16 = np.dtype(ml_dtypes.bfloat16)
STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
           "bfloat16": np.dtype(np.uint16)}
BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def make_pool(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=3, head_dim=5,
              dtype="float32", **kw):
    return kvcore.BlockPool(num_blocks, block_size, num_layers, num_kv_heads, head_dim,
                            dtype=dtype, **kw)


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def awkward(shape, seed, nan=True):
    """float32 data with rounding ties, subnormals, overflow, signed zeros and
    (optionally) NaNs of both signs mixed in."""
    x = rand(shape, seed) * np.float32(3)
    special = [0.0, -0.0, 1e-8, -6e-8, 65520.0, -1e6, 1.0009765625, 1.00048828125,
               1.00390625, 3.0e-41, -1.5e-45, np.inf, -np.inf, 65504.0, 3.4e38]
    if nan:
        special += [np.nan, -np.nan]
    flat = x.reshape(-1)
    m = min(flat.size, len(special))
    flat[np.random.default_rng(seed + 1).choice(flat.size, m, replace=False)] = \
        np.array(special[:m], np.float32)
    return x


def assert_same_pool(pool, snap):
    assert pool_snapshot(pool) == snap
    pool.debug.check()


# ------------------------------------------------------------------ geometry
def test_exported():
    assert "BlockPool" in kvcore.__all__
    assert issubclass(kvcore.OutOfBlocksError, kvcore.KVCacheError)
    assert issubclass(kvcore.OutOfBlocksError, MemoryError)
    assert issubclass(kvcore.CacheFullError, kvcore.KVCacheError)
    assert issubclass(kvcore.CacheFullError, ValueError)


@pytest.mark.parametrize("dtype,name", [
    ("float32", "float32"), ("f32", "float32"), (np.float32, "float32"),
    ("float16", "float16"), ("f16", "float16"), (np.float16, "float16"),
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), (ml_dtypes.bfloat16, "bfloat16"),
])
def test_geometry_and_views(dtype, name):
    pool = kvcore.BlockPool(6, 4, 3, 2, 5, dtype=dtype)
    assert (pool.num_blocks, pool.block_size, pool.num_layers, pool.num_kv_heads,
            pool.head_dim) == (6, 4, 3, 2, 5)
    assert pool.dtype == name
    assert pool.device == "cpu"
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 0
    for layer in range(3):
        for view in (pool.key_cache(layer), pool.value_cache(layer)):
            assert isinstance(view, np.ndarray)
            assert view.shape == (6, 2, 4, 5)
            assert view.dtype == STORAGE[name]
            assert np.shares_memory(view, pool.storage)
            assert not view.any()
    # every layer's K and V are distinct memory
    views = [pool.key_cache(i) for i in range(3)] + [pool.value_cache(i) for i in range(3)]
    for i, a in enumerate(views):
        for b in views[i + 1:]:
            assert not np.shares_memory(a, b)
    pool.debug.check()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("blocks, align", [(1, 64), (3, 64), (256, 2 << 20)])
def test_storage_starts_on_a_line(dtype, blocks, align):
    """Page rows never straddle a cache line at their start (np.zeros puts
    data 16 bytes into one); pools of 8 MiB and up start on a huge page;
    the storage is zero and C-contiguous, its scales on a line too."""
    pool = kvcore.BlockPool(blocks, 16, 2, 8, 128, dtype=dtype)
    st = pool.storage
    assert st.ctypes.data % align == 0, (dtype, blocks, st.ctypes.data % align)
    assert st.flags.c_contiguous and st.flags.writeable and not st.any()
    assert st.shape == (4, blocks, 8, 16, 128)
    if pool.scales is not None:
        assert pool.scales.ctypes.data % 64 == 0


def test_a_pool_too_large_for_any_machine_names_its_shape():
    with pytest.raises(ValueError, match=r"cannot allocate \d+ bytes for an array of shape "
                                         r"\(512, 1073741824, 256, 1024, 128\)"):
        kvcore.BlockPool(2**30, 2**10, 2**8, 2**8, 2**7)
    with pytest.raises(ValueError, match="negative dimensions"):
        kvcore.backends.base.Backend().zeros((-1, 16), "float32")


def test_default_dtype_is_float16_and_caching_on():
    pool = kvcore.BlockPool(2, 2, 1, 1, 1)
    assert pool.dtype == "float16"
    assert pool.enable_prefix_caching is True


def test_write_lands_head_major():
    """Token i goes to key_cache(l)[slot // bs, h, slot % bs, :] for every head."""
    bs, H, D = 4, 3, 5
    pool = make_pool(num_blocks=5, block_size=bs, num_kv_heads=H, head_dim=D)
    slots = np.array([0, 3, 4, 9, 19, 6], np.int64)
    k = rand((len(slots), H, D), 1)
    v = rand((len(slots), H, D), 2)
    pool.write(1, k, v, slots)
    kc, vc = pool.key_cache(1), pool.value_cache(1)
    expect_k = np.zeros_like(kc)
    expect_v = np.zeros_like(vc)
    for i, s in enumerate(slots):
        b, off = divmod(int(s), bs)
        for h in range(H):
            np.testing.assert_array_equal(kc[b, h, off, :], k[i, h, :])
            np.testing.assert_array_equal(vc[b, h, off, :], v[i, h, :])
        expect_k[b, :, off, :] = k[i]
        expect_v[b, :, off, :] = v[i]
    # nothing else moved, and layer 0 is untouched
    np.testing.assert_array_equal(kc, expect_k)
    np.testing.assert_array_equal(vc, expect_v)
    assert not pool.key_cache(0).any() and not pool.value_cache(0).any()
    # the raw storage layout: plane 2*l keys, 2*l+1 values
    assert np.shares_memory(pool.storage[2], kc)
    np.testing.assert_array_equal(pool.storage[3], vc)


def test_write_accepts_lists_and_strided_inputs():
    pool = make_pool(num_blocks=3, block_size=2, num_kv_heads=2, head_dim=4)
    base = rand((2, 3, 2, 4), 3)          # (heads?, n, ...) then transposed
    k = base.transpose(1, 0, 2, 3)[:, 0]  # (3, 2, 4) non-contiguous
    v = rand((3, 4, 2), 4).transpose(0, 2, 1)  # innermost axis strided
    pool.write(0, k, v, [5, 0, 2])
    got_k, got_v = pool.gather(0, [0, 1, 2], 0, 6)
    np.testing.assert_array_equal(got_k[:, 5], k[0])
    np.testing.assert_array_equal(got_k[:, 0], k[1])
    np.testing.assert_array_equal(got_k[:, 2], k[2])
    np.testing.assert_array_equal(got_v[:, 5], v[0])
    np.testing.assert_array_equal(got_v[:, 2], v[2])


def _as_input(x32, src):
    """(array, src_dtype keyword) of float32 data ``x32`` in input kind ``src``."""
    if src == "float32":
        return x32, None
    if src == "float16":
        return kvcore.to_float16(x32), None
    if src == "bf16ml":
        return kvcore.to_bfloat16(x32).view(BF16), None
    return kvcore.to_bfloat16(x32), "bfloat16"   # uint16 bits


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("src", ["float32", "float16", "bf16ml", "bf16bits"])
def test_write_every_dtype_bit_exact(storage, src):
    bs, H, D = 4, 2, 7
    pool = make_pool(num_blocks=4, block_size=bs, num_kv_heads=H, head_dim=D, dtype=storage)
    n = 11
    # NaN payloads are only pinned for float32 input (against to_float16/to_bfloat16)
    k32 = awkward((n, H, D), 10, nan=src == "float32")
    v32 = awkward((n, H, D), 20, nan=src == "float32")
    k, kw = _as_input(k32, src)
    v, _ = _as_input(v32, src)
    slots = np.array([15, 0, 1, 2, 3, 4, 9, 10, 11, 12, 7], np.int64)
    kwargs = {"src_dtype": kw} if kw else {}
    pool.write(1, k, v, slots, **kwargs)
    want_k, want_v = storage_bits(k, storage), storage_bits(v, storage)
    bits = BITS[storage]
    kc, vc = pool.key_cache(1), pool.value_cache(1)
    assert kc.dtype == STORAGE[storage]
    for i, s in enumerate(slots):
        b, off = divmod(int(s), bs)
        np.testing.assert_array_equal(kc[b, :, off, :].view(bits), want_k[i].view(bits))
        np.testing.assert_array_equal(vc[b, :, off, :].view(bits), want_v[i].view(bits))
    # the raw gather returns the same storage bits, and widens exactly on request
    table = [0, 1, 2, 3]
    gk, gv = pool.gather(1, table, 0, 16)
    assert gk.dtype == STORAGE[storage] and gk.flags.c_contiguous
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(gk[:, s].view(bits), want_k[i].view(bits))
    wk, _ = pool.gather(1, table, 0, 16, dtype="float32")
    assert wk.dtype == np.float32
    widened = {"float32": lambda a: a, "float16": kvcore.from_float16,
               "bfloat16": kvcore.from_bfloat16}[storage](gk)
    np.testing.assert_array_equal(wk.view(np.uint32), widened.view(np.uint32))


def test_write_float32_nan_keeps_sign():
    pool = make_pool(num_blocks=1, block_size=2, num_kv_heads=1, head_dim=2, dtype="bfloat16",
                     num_layers=1)
    k = np.array([[[np.nan, -np.nan]], [[1.0, -1.0]]], np.float32)
    pool.write(0, k, k, [0, 1])
    back = kvcore.from_bfloat16(pool.key_cache(0)[0, 0])
    assert np.isnan(back[0, 0]) and not np.signbit(back[0, 0])
    assert np.isnan(back[0, 1]) and np.signbit(back[0, 1])


def test_uint16_needs_src_dtype():
    pool = make_pool(dtype="bfloat16")
    bits = np.zeros((1, 3, 5), np.uint16)
    with pytest.raises(TypeError, match="src_dtype"):
        pool.write(0, bits, bits, [0])
    with pytest.raises(TypeError, match="src_dtype"):
        pool.write(0, np.zeros((1, 3, 5), np.float32), np.zeros((1, 3, 5), np.float32), [0],
                   src_dtype="bfloat16")
    with pytest.raises(TypeError, match="^k "):
        pool.write(0, np.zeros((1, 3, 5), np.int32), np.zeros((1, 3, 5), np.int32), [0])
    assert not pool.storage.any()


def test_slot_minus_one_is_skipped():
    pool = make_pool(num_blocks=2, block_size=2, num_kv_heads=1, head_dim=2)
    k = rand((3, 1, 2), 5)
    pool.write(0, k, -k, np.array([-1, 3, -1]))
    kc = pool.key_cache(0)
    np.testing.assert_array_equal(kc[1, 0, 1], k[1, 0])
    np.testing.assert_array_equal(pool.value_cache(0)[1, 0, 1], -k[1, 0])
    kc[1, 0, 1] = 0
    pool.value_cache(0)[1, 0, 1] = 0
    assert not pool.storage.any()
    pool.write(0, k, k, [-1, -1, -1])
    pool.write(0, k[:0], k[:0], np.empty(0, np.int64))
    assert not pool.storage.any()


@pytest.mark.parametrize("bad", ["limit", "minus2", "huge", "uint_huge"])
def test_out_of_range_slot_raises_before_writing(bad):
    pool = make_pool(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=3)
    limit = 3 * 4
    value = {"limit": limit, "minus2": -2, "huge": 2**62, "uint_huge": 2**64 - 1}[bad]
    dtype = np.uint64 if bad == "uint_huge" else np.int64
    slots = np.array([0, 5, value, 1], dtype=dtype)
    k = rand((4, 2, 3), 6)
    with pytest.raises(IndexError, match="slots") as e:
        pool.write(1, k, k, slots)
    assert "index 2" in str(e.value)
    assert not pool.storage.any()  # token 0 and 1 were not written either
    # the last slot in range works
    pool.write(1, k[:1], k[:1], [limit - 1])
    np.testing.assert_array_equal(pool.key_cache(1)[2, :, 3], k[0])


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_slot_writer_declines_what_it_cannot_write_safely(dtype):
    """The pool's slot writer (kvcore.hf's decode lane) returns False and
    writes nothing for a layer out of range (however large), slots out of
    range, and slots that live in the storage or the int8 scales it would
    rewrite while reading them; what it takes lands where pool.write puts it."""
    pool = make_pool(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    writer = pool._writer
    assert writer is not None
    k = rand((2, 2, 8), 7)
    good = np.array([1, 6], np.int64)
    for layer in (-1, pool.num_layers, 2**62, 2**63 - 1, 2**64, -2**64, True, 1.0):
        assert writer.write_slots(layer, k, k, good) is False, layer
    for slots in (np.array([1, 12], np.int64), np.array([1, -2], np.int64),
                  np.array([1, 2**62], np.int64), np.array([1], np.int64),
                  np.array([1, 6], np.int32), [1, 6]):
        assert writer.write_slots(0, k, k, slots) is False, slots
    planes = [pool.storage.view(np.uint8)]
    if dtype == "int8":
        planes.append(pool.scales.view(np.uint8))
    for plane in planes:
        plane.reshape(-1)[:16] = 0
        inside = plane.reshape(-1)[:16].view(np.int64)     # slots 0 and 0, in range
        assert writer.write_slots(0, k, k, inside) is False
    assert not pool.storage.any()
    ref = make_pool(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    assert writer.write_slots(1, k, -k, good) is True
    ref.write(1, k, -k, good)
    np.testing.assert_array_equal(pool.storage.view(np.uint8), ref.storage.view(np.uint8))


def test_write_argument_errors_name_the_argument():
    pool = make_pool(num_blocks=2, block_size=2, num_kv_heads=3, head_dim=5)
    k = rand((2, 3, 5), 1)
    with pytest.raises(IndexError, match="layer"):
        pool.write(2, k, k, [0, 1])
    with pytest.raises(IndexError, match="layer"):
        pool.write(-1, k, k, [0, 1])
    with pytest.raises(TypeError, match="layer"):
        pool.write(0.0, k, k, [0, 1])
    with pytest.raises(ValueError, match="^k must have shape"):
        pool.write(0, k[:, :2], k, [0, 1])
    with pytest.raises(ValueError, match="^v must have shape"):
        pool.write(0, k, k[:, :, :4], [0, 1])
    with pytest.raises(ValueError, match="^k must have shape"):
        pool.write(0, k[0], k[0], [0])
    with pytest.raises(ValueError, match="same shape"):
        pool.write(0, k, k[:1], [0, 1])
    with pytest.raises(TypeError, match="same dtype"):
        pool.write(0, k, kvcore.to_float16(k), [0, 1])
    with pytest.raises(ValueError, match="slots"):
        pool.write(0, k, k, [0])
    with pytest.raises(ValueError, match="slots"):
        pool.write(0, k, k, [[0, 1]])
    with pytest.raises(TypeError, match="slots"):
        pool.write(0, k, k, [0.0, 1.0])
    assert not pool.storage.any()


# ------------------------------------------------------------------ gather
def test_gather_bounds_and_order():
    bs, H, D = 4, 2, 3
    pool = make_pool(num_blocks=6, block_size=bs, num_kv_heads=H, head_dim=D)
    table = np.array([4, 0, 5], np.int32)
    n = len(table) * bs
    k = rand((n, H, D), 7)
    v = rand((n, H, D), 8)
    slots = np.array([table[p // bs] * bs + p % bs for p in range(n)], np.int64)
    pool.write(0, k, v, slots)
    want_k = k.transpose(1, 0, 2)
    want_v = v.transpose(1, 0, 2)
    for start, end in [(0, n), (0, 0), (3, 3), (n, n), (1, 5), (4, 8), (3, 9), (5, 12),
                       (11, 12), (0, 1)]:
        gk, gv = pool.gather(0, table, start, end)
        assert gk.shape == (H, end - start, D) == gv.shape
        assert gk.flags.c_contiguous and gv.flags.c_contiguous
        assert not np.shares_memory(gk, pool.storage)
        np.testing.assert_array_equal(gk, want_k[:, start:end])
        np.testing.assert_array_equal(gv, want_v[:, start:end])
    # list and int64 tables work as well
    gk, _ = pool.gather(0, [4, 0], 2, 6)
    np.testing.assert_array_equal(gk, want_k[:, 2:6])
    gk, _ = pool.gather(0, table.astype(np.int64), 0, n)
    np.testing.assert_array_equal(gk, want_k)
    # empty table
    gk, gv = pool.gather(0, np.empty(0, np.int32), 0, 0)
    assert gk.shape == (H, 0, D)


def test_gather_argument_errors():
    pool = make_pool(num_blocks=4, block_size=4)
    table = [1, 2]
    with pytest.raises(ValueError, match="start and end"):
        pool.gather(0, table, 0, 9)       # == len(table) * bs + 1
    with pytest.raises(ValueError, match="start and end"):
        pool.gather(0, table, 5, 4)
    with pytest.raises(ValueError, match="start and end"):
        pool.gather(0, table, -1, 4)
    with pytest.raises(TypeError, match="start"):
        pool.gather(0, table, 0.5, 4)
    with pytest.raises(TypeError, match="end"):
        pool.gather(0, table, 0, None)
    with pytest.raises(IndexError, match="block_table"):
        pool.gather(0, [1, 4], 0, 4)      # == num_blocks
    with pytest.raises(IndexError, match="block_table"):
        pool.gather(0, [-1], 0, 1)
    with pytest.raises(ValueError, match="block_table"):
        pool.gather(0, [[1, 2]], 0, 1)
    with pytest.raises(TypeError, match="block_table"):
        pool.gather(0, [1.0], 0, 1)
    with pytest.raises(IndexError, match="layer"):
        pool.gather(2, table, 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        pool.gather(0, table, 0, 1, dtype="int8")
    # the top edge itself is fine
    k, _ = pool.gather(0, table, 0, 8)
    assert k.shape == (3, 8, 5)


# ------------------------------------------------------------------ counts
def test_ref_count_and_block_id_errors():
    pool = make_pool(num_blocks=4)
    assert [pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    assert pool.ref_count(np.int64(3)) == 0
    for bad in (4, -1, 2**40):
        with pytest.raises(IndexError, match="block_id"):
            pool.ref_count(bad)
    for bad in (1.0, True, "1", None):
        with pytest.raises(TypeError, match="block_id"):
            pool.ref_count(bad)
    with pytest.raises(IndexError, match="block_id"):
        pool.is_cached(4)


def test_stats_keys():
    pool = make_pool(num_blocks=5)
    s = pool.stats()
    for key in ("num_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks",
                "prefix_queries", "prefix_hits", "evictions"):
        assert key in s, key
    assert s["num_blocks"] == 5
    assert s["num_free_blocks"] == 5
    assert s["num_used_blocks"] == 0
    assert s["num_cached_blocks"] == 0
    assert s["prefix_queries"] == s["prefix_hits"] == s["evictions"] == 0


@pytest.mark.parametrize("arg,value,exc", [
    ("num_blocks", 0, ValueError), ("num_blocks", -3, ValueError),
    ("num_blocks", 2.0, TypeError), ("num_blocks", True, TypeError),
    ("block_size", 0, ValueError), ("num_layers", 0, ValueError),
    ("num_layers", 2**16 + 1, ValueError),
    ("num_kv_heads", None, TypeError), ("head_dim", -1, ValueError),
    ("dtype", "int4", ValueError), ("dtype", np.int32, ValueError),
    ("dtype", 3.5, TypeError), ("device", "tpu", ValueError), ("device", 0, TypeError),
    ("enable_prefix_caching", 1, TypeError),
])
def test_constructor_errors_name_the_argument(arg, value, exc):
    kw = dict(num_blocks=4, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4)
    kw[arg] = value
    with pytest.raises(exc, match=arg if arg != "device" else "device"):
        kvcore.BlockPool(**kw)


def test_layer_errors_for_views():
    pool = make_pool(num_layers=2)
    with pytest.raises(IndexError, match="layer"):
        pool.key_cache(2)
    with pytest.raises(IndexError, match="layer"):
        pool.value_cache(-1)
    with pytest.raises(TypeError, match="layer"):
        pool.key_cache("0")


# ------------------------------------------------------------------ exact boundaries
def test_ref_count_zero_one_zero_and_double_free():
    pool = make_pool(num_blocks=3, block_size=4)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    (b,) = seq.block_table
    assert pool.ref_count(b) == 1
    assert pool.num_used_blocks == 1 and pool.num_free_blocks == 2
    pool.debug.check()
    seq.free()
    assert pool.ref_count(b) == 0
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 3
    pool.debug.check()
    snap = pool_snapshot(pool)
    seq.free()                      # double free: nothing more is released
    assert_same_pool(pool, snap)
    assert seq.num_blocks == 0 and seq.num_tokens == 0 and seq.num_computed == 0


def test_pool_exactly_full():
    bs = 4
    pool = make_pool(num_blocks=5, block_size=bs)
    a = kvcore.PagedKVCache(pool)
    a.allocate(list(range(2 * bs)))            # 2 blocks
    b = kvcore.PagedKVCache(pool)
    assert b.allocate(list(range(100, 100 + 3 * bs))) == 0   # exactly the 3 left
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 5
    pool.debug.check()
    c = kvcore.PagedKVCache(pool)
    snap = pool_snapshot(pool)
    with pytest.raises(kvcore.OutOfBlocksError):
        c.allocate([7])
    assert_same_pool(pool, snap)
    assert c.num_blocks == 0 and c.num_tokens == 0
    # one block back makes exactly one allocation possible
    a.truncate(bs)
    assert pool.num_free_blocks == 1
    c.allocate([7])
    assert pool.num_free_blocks == 0
    d = kvcore.PagedKVCache(pool)
    with pytest.raises(kvcore.OutOfBlocksError):
        d.allocate([8])
    for s in (a, b, c):
        s.free()
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0
    pool.debug.check()


def test_allocation_needing_all_free_blocks_plus_one_fails():
    bs = 2
    pool = make_pool(num_blocks=4, block_size=bs)
    seq = kvcore.PagedKVCache(pool)
    with pytest.raises(kvcore.OutOfBlocksError, match="4 of 4|free"):
        seq.allocate(list(range(4 * bs + 1)))
    assert pool.num_free_blocks == 4
    assert seq.allocate(list(range(4 * bs))) == 0
    assert pool.num_free_blocks == 0
    seq.free()


def test_repr_mentions_geometry():
    r = repr(make_pool(num_blocks=3))
    assert "BlockPool" in r and "num_blocks=3" in r


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_write_reads_slots_once_when_they_live_in_the_storage(make_pool, dtype):
    """pool.write's slots may be a view of the storage (or the int8 scales)
    that the write itself rewrites: the slots used are the values the call
    was given (a private copy, checked, then written through), not bytes the
    write just stored there (which wrote out of the pool, or crashed)."""
    pool = make_pool(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    ref = make_pool(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    k = rand((2, 2, 8), 7) * 1000
    planes = [pool.storage.view(np.uint8).reshape(-1)]
    if dtype == "int8":
        planes.append(pool.scales.view(np.uint8).reshape(-1))
    for plane in planes:
        plane[:] = 0
        inside = plane[:16].view(np.int64)
        inside[:] = (0, 1)                       # slots 0 and 1: the bytes row 0 rewrites
        want = inside.copy()
        ref.storage[...] = pool.storage
        if dtype == "int8":
            ref.scales[...] = pool.scales
        pool.write(0, k, -k, inside)
        ref.write(0, k, -k, want)
        np.testing.assert_array_equal(pool.storage.view(np.uint8), ref.storage.view(np.uint8))
        if dtype == "int8":
            np.testing.assert_array_equal(pool.scales.view(np.uint8),
                                          ref.scales.view(np.uint8))
