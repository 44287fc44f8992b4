"""The public classes on every backend present: one test body per scenario,
parametrized over devices.  CUDA cases skip cleanly without CuPy or a GPU;
on a GPU every result must equal the CPU backend's bit for bit."""
import numpy as np
import pytest

import kvcore
from kvcore.backends import get_backend

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_env import cuda_backend_or_skip
except ImportError:
    from _cuda_env import cuda_backend_or_skip

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "cpu":
        cuda_backend_or_skip(request.param)  # skip only without CuPy or a GPU
    return request.param


def host(x, device):
    return get_backend(device).to_host(x)


def dev(x, device):
    return get_backend(device).from_host(np.ascontiguousarray(x))


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (128, 16), (256, 32)])
def test_pool_write_and_gather_match_cpu(device, dtype, head_dim, block_size):
    rng = np.random.default_rng(head_dim + block_size)
    args = (12, block_size, 2, 2, head_dim)
    ref = kvcore.BlockPool(*args, dtype=dtype)
    pool = kvcore.BlockPool(*args, dtype=dtype, device=device)
    n = 20
    slots = rng.choice(12 * block_size, n, replace=False).astype(np.int64)
    slots[::7] = -1
    k, v = rand(rng, n, 2, head_dim), rand(rng, n, 2, head_dim)
    ref.write(1, k, v, slots)
    pool.write(1, dev(k, device), dev(v, device), slots)
    assert np.array_equal(host(pool.key_cache(1), device), ref.key_cache(1))
    assert np.array_equal(host(pool.value_cache(1), device), ref.value_cache(1))
    table = rng.permutation(12).astype(np.int32)
    for out in (None, "float32"):
        for a, b in zip(pool.gather(1, table, 3, 5 * block_size - 1, dtype=out),
                        ref.gather(1, table, 3, 5 * block_size - 1, dtype=out)):
            assert np.array_equal(host(a, device), b)


def test_cpu_input_to_a_cuda_pool_is_a_type_error(device):
    if device == "cpu":
        pytest.skip("only a GPU pool refuses host arrays")
    pool = kvcore.BlockPool(4, 4, 1, 1, 8, device=device)
    k = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(TypeError, match="k"):
        pool.write(0, k, k, np.array([0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_round_trip_fork_cow_and_truncate(device, dtype):
    rng = np.random.default_rng(1)
    pools = {d: kvcore.BlockPool(16, 4, 2, 2, 16, dtype=dtype, device=d)
             for d in {"cpu", device}}
    prompt = list(range(10))
    ks = [rand(rng, 10, 2, 16) for _ in range(2)]
    vs = [rand(rng, 10, 2, 16) for _ in range(2)]
    step = [rand(rng, 1, 2, 16) for _ in range(2)]
    results = {}
    for d, pool in pools.items():
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(prompt)
        for layer in range(2):
            seq.append(layer, dev(ks[layer], d), dev(vs[layer], d))
        seq.commit(10)
        child = seq.fork()
        for layer in range(2):          # child writes into the shared last block
            child.append(layer, dev(step[layer], d), dev(step[layer], d))
        child.commit(1)
        seq.truncate(6)                 # parent forgets into a shared block ...
        for layer in range(2):          # ... and writes there: a copy first
            seq.append(layer, dev(step[1 - layer], d), dev(step[1 - layer], d))
        seq.commit(1)
        results[d] = [[host(x, d) for layer in range(2) for x in s.gather(layer)]
                      for s in (seq, child)]
        assert child.num_computed == 11 and seq.num_computed == 7
        seq.free()
        child.free()
        pool.debug.check()
        assert pool.num_used_blocks == 0
    for a, b in zip(results["cpu"], results[device]):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)


def test_tables_live_on_the_pool_device(device):
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, device=device)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3, 4, 5])
    table, lens = kvcore.padded_block_tables([seq], lengths=[5])
    indptr, indices, last = kvcore.csr_block_tables([seq], lengths=[5])
    xp = get_backend(device).xp
    for a in (table, lens, indptr, indices, last):
        assert isinstance(a, xp.ndarray) and a.dtype == np.int32
    assert host(table, device).tolist() == [seq.block_table.tolist()]
    assert host(last, device).tolist() == [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_to_and_back(device, dtype):
    rng = np.random.default_rng(2)
    c = kvcore.KVCache(2, 2, 8, 16, batch_size=2, dtype=dtype)
    c.update(0, rand(rng, 2, 2, 5, 8), rand(rng, 2, 2, 5, 8))
    c.update(1, rand(rng, 2, 2, 4, 8), rand(rng, 2, 2, 4, 8))
    there = c.to(device)
    back = there.to("cpu")
    assert there.device.startswith(device) and back.layer_lengths == (5, 4)
    for layer in range(2):
        for a, b, m in zip(c.get(layer), back.get(layer), there.get(layer)):
            assert np.array_equal(a, b) and np.array_equal(a, host(m, device))


def test_sequence_offload_to_host_pool_and_back(device):
    rng = np.random.default_rng(3)
    gpu = kvcore.BlockPool(8, 4, 2, 2, 8, dtype="bfloat16", device=device)
    cpu = kvcore.BlockPool(8, 4, 2, 2, 8, dtype="bfloat16")
    seq = kvcore.PagedKVCache(gpu)
    seq.allocate(list(range(9)))
    for layer in range(2):
        seq.append(layer, dev(rand(rng, 9, 2, 8), device), dev(rand(rng, 9, 2, 8), device))
    seq.commit(9)
    want = [host(x, device) for layer in range(2) for x in seq.gather(layer)]
    off = seq.copy_to(cpu)
    seq.free()
    back = off.copy_to(gpu)
    off.free()
    got = [host(x, device) for layer in range(2) for x in back.gather(layer)]
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    back.free()
    gpu.debug.check()
    cpu.debug.check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_write_repeated_slots_keep_the_last_token(device, dtype):
    """One rule on every device (issue 9, item 12): of several tokens naming
    one slot in a write, the last one's K and V land."""
    rng = np.random.default_rng(4)
    pool = kvcore.BlockPool(4, 8, 1, 2, 64, dtype=dtype, device=device)
    slots = np.array([3, 3, 12, 3, 12, -1, 30], np.int64)
    k, v = rand(rng, 7, 2, 64), rand(rng, 7, 2, 64)
    for s in (slots, dev(slots, device)):
        pool.write(0, dev(k, device), dev(v, device), s)
        for slot, last in ((3, 3), (12, 4), (30, 6)):
            b, off = divmod(slot, 8)
            want_k = kvcore.BlockPool(4, 8, 1, 2, 64, dtype=dtype)
            want_k.write(0, k[last:last + 1], v[last:last + 1], [slot])
            assert np.array_equal(host(pool.key_cache(0), device)[b, :, off],
                                  want_k.key_cache(0)[b, :, off])
            assert np.array_equal(host(pool.value_cache(0), device)[b, :, off],
                                  want_k.value_cache(0)[b, :, off])


def test_index_arguments_take_range_array_array_and_lists(device):
    """Slots, block tables and lengths in the forms a CPU pool takes, on
    every device (issue 9, item 9)."""
    import array

    rng = np.random.default_rng(5)
    ref = kvcore.BlockPool(8, 4, 1, 1, 8)
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, device=device)
    k, v = rand(rng, 4, 1, 8), rand(rng, 4, 1, 8)
    for slots in (range(2, 6), array.array("q", [9, 1, -1, 31]), [0, 5, 6, 7]):
        ref.write(0, k, v, slots)
        pool.write(0, dev(k, device), dev(v, device), slots)
    assert np.array_equal(host(pool.key_cache(0), device), ref.key_cache(0))
    for table in (range(0, 3), array.array("i", [2, 0, 7]), [7, 1]):
        for a, b in zip(pool.gather(0, table, 1, 7), ref.gather(0, table, 1, 7)):
            assert np.array_equal(host(a, device), b)
    tables, lengths = [[0, 1], [7, 2]], array.array("i", [6, 3])
    for a, b in zip(pool.gather_batch(0, tables, lengths), ref.gather_batch(0, tables, lengths)):
        assert np.array_equal(host(a, device), b)


def test_pool_write_repeated_slots_in_a_prompt_sized_write(device):
    """The same rule when the write is large enough for the CPU kernel's
    streaming (non-temporal) stores and for many GPU blocks."""
    rng = np.random.default_rng(6)
    n, heads, dim, bs = 4096, 8, 128, 16
    pool = kvcore.BlockPool(32, bs, 1, heads, dim, device=device)
    slots = rng.integers(-1, 256, n).astype(np.int64)  # ~16 tokens per slot
    k = rand(rng, n, heads, dim)
    pool.write(0, dev(k, device), dev(k[::-1].copy(), device), slots)
    keys, values = host(pool.key_cache(0), device), host(pool.value_cache(0), device)
    for s in np.unique(slots[slots >= 0]):
        last = np.flatnonzero(slots == s)[-1]
        b, off = divmod(int(s), bs)
        assert np.array_equal(keys[b, :, off], kvcore.to_float16(k[last]))
        assert np.array_equal(values[b, :, off], kvcore.to_float16(k[n - 1 - last]))
