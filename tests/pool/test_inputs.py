"""Array arguments: inputs that are views of the cache's own storage,
misaligned arrays, ``out=`` arrays, torch tensors, and the errors for
inputs of the wrong kind (issue 9, items 2, 6, 18 and 19).

The torch tests skip without torch, and fail instead when
KVCORE_REQUIRE_TORCH=1 (``.ci/run`` installs torch and sets it).
"""
import re

import numpy as np
import pytest

import kvcore
from kvcore.backends.cpu import _kernels

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")



def _filled_pool(dtype="float32", num_blocks=6, block_size=4, num_layers=2, heads=2, dim=8,
                 seed=0):
    """A pool whose every plane holds distinct random values."""
    pool = kvcore.BlockPool(num_blocks, block_size, num_layers, heads, dim, dtype=dtype)
    rng = np.random.default_rng(seed)
    st = pool.storage
    if dtype == "bfloat16":
        st[...] = kvcore.to_bfloat16(rng.standard_normal(st.shape).astype(np.float32))
    else:
        st[...] = rng.standard_normal(st.shape).astype(st.dtype)
    return pool


def _misaligned(a):
    """A copy of ``a`` at an odd address: not aligned for its dtype."""
    a = np.asarray(a)
    buf = bytearray(a.nbytes + 1)
    m = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    m[...] = a
    assert not m.flags.aligned or a.itemsize == 1
    return m


# ====================================================== item 2: inputs that alias storage

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("plane", [0, 1, 2, 3], ids=["k0", "v0", "k1", "v1"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_pool_write_input_that_is_a_view_of_any_plane(which, plane, dtype):
    """k or v a view of any plane of the storage is read as it was when
    write began (the issue's case: v a view of the key plane being written)."""
    pool = _filled_pool(dtype)
    view = pool.storage[plane][:, :, 0, :]          # offset 0 of every block: (6, 2, 8)
    before = view.copy()
    other = np.random.default_rng(1).standard_normal(view.shape).astype(view.dtype)
    k, v = (view, other) if which == "k" else (other, view)
    slots = np.arange(pool.num_blocks, dtype=np.int64) * pool.block_size
    pool.write(0, k, v, slots)                      # writes offset 0 of layer 0, K then V
    want_k, want_v = (before, other) if which == "k" else (other, before)
    np.testing.assert_array_equal(pool.key_cache(0)[:, :, 0, :], want_k)
    np.testing.assert_array_equal(pool.value_cache(0)[:, :, 0, :], want_v)


@pytest.mark.parametrize("heads", [1, 2], ids=["contiguous-view", "strided-view"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_paged_append_input_that_is_a_view_of_the_key_plane(which, heads):
    """append (its direct path and the validated one) reads an input that is
    a view of exactly the key positions it writes first as it was.  With one
    KV head the view is C-contiguous (the direct path's kind of input)."""
    pool = _filled_pool("float32", heads=heads)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3, 4])
    seq.reserve(4)
    b = int(seq.block_table[0])
    view = pool.key_cache(0)[b].transpose(1, 0, 2)   # (4 tokens, heads, dim): the K slots
    assert view.flags.c_contiguous == (heads == 1)
    before = view.copy()
    other = np.random.default_rng(2).standard_normal(view.shape).astype(np.float32)
    k, v = (view, other) if which == "k" else (other, view)
    seq.append(0, k, v)
    gk, gv = seq.gather(0)
    want_k, want_v = (before, other) if which == "k" else (other, before)
    np.testing.assert_array_equal(gk.transpose(1, 0, 2), want_k)
    np.testing.assert_array_equal(gv.transpose(1, 0, 2), want_v)


@pytest.mark.parametrize("which", ["k", "v"])
def test_kvcache_update_input_that_is_a_view_of_the_other_plane(which):
    cache = kvcore.KVCache(2, 2, 8, 16, dtype="float32")
    rng = np.random.default_rng(3)
    first = [rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(2)]
    cache.update(0, *first)
    # rewrite positions 0..3: one input is the other plane's positions 0..3
    plane = cache.value_cache(0) if which == "k" else cache.key_cache(0)
    view = plane[:, :, 0:4]
    before = view.copy()
    other = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    k, v = (view, other) if which == "k" else (other, view)
    cache.update(0, k, v, start_pos=0)
    gk, gv = cache.get(0)
    np.testing.assert_array_equal(gk, before if which == "k" else other)
    np.testing.assert_array_equal(gv, other if which == "k" else before)


@pytest.mark.parametrize("into", ["value-plane", "key-plane"])
def test_gather_out_that_is_a_view_of_the_storage(into):
    """out= arrays that overlap what the gather reads: both K and V are
    read as they were before either out is written."""
    pool = _filled_pool("float32", block_size=4)
    table = np.array([3], np.int32)
    want_k = pool.key_cache(0)[3].copy()     # (heads, 4, dim)
    want_v = pool.value_cache(0)[3].copy()
    if into == "value-plane":    # k_out is where V is read from
        k_out, v_out = pool.value_cache(0)[3], np.empty_like(want_v)
    else:                        # v_out is where K is read from (K is read first)
        k_out, v_out = np.empty_like(want_k), pool.key_cache(0)[3]
    k, v = pool.gather(0, table, 0, 4, out=(k_out, v_out))
    assert k is k_out and v is v_out
    np.testing.assert_array_equal(k_out, want_k)
    np.testing.assert_array_equal(v_out, want_v)


def test_gather_out_pair_sharing_memory_is_refused():
    pool = _filled_pool("float32")
    same = np.empty((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] must not share memory"):
        pool.gather(0, [0], 0, 4, out=(same, same))
    # interleaved views of one buffer do not share memory: accepted
    buf = np.empty((2, 4, 8, 2), np.float32)
    k, v = pool.gather(0, [0], 0, 4, out=(buf[..., 0], buf[..., 1]))
    np.testing.assert_array_equal(k, pool.key_cache(0)[0])
    np.testing.assert_array_equal(v, pool.value_cache(0)[0])


def test_kvcache_get_out_that_is_a_view_of_the_cache():
    cache = kvcore.KVCache(1, 2, 8, 16, dtype="float32")
    rng = np.random.default_rng(4)
    k0 = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    v0 = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    cache.update(0, k0, v0)
    # k_out is V's positions 0..3: V must be read before K lands there
    k_out = cache.value_cache(0)[:, :, 0:4]
    v_out = np.empty((1, 2, 4, 8), np.float32)
    k, v = cache.get(0, 0, 4, out=(k_out, v_out))
    assert k is k_out and v is v_out
    np.testing.assert_array_equal(k_out, k0[:, :, :4])
    np.testing.assert_array_equal(v_out, v0[:, :, :4])


def test_overlaps_and_apart():
    st = np.zeros((4, 8), np.float32)
    assert _kernels.overlaps(st[1:2], st)
    assert not _kernels.overlaps(np.zeros(3, np.float32), st)
    assert not _kernels.overlaps(st[:0], st)
    assert _kernels.overlaps(st[::-1], st[3:])          # negative strides
    a = st[2]
    staged = _kernels.apart(a, st)
    assert staged is not a and staged.flags.c_contiguous and not np.shares_memory(staged, st)
    b = np.ones(3, np.float32)
    assert _kernels.apart(b, st) is b


# ================================================ item 6: misaligned arrays, empty buffers

def test_misaligned_slots_write_the_right_positions():
    want = _filled_pool("float16")
    got = _filled_pool("float16")
    rng = np.random.default_rng(5)
    k = rng.standard_normal((5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((5, 2, 8)).astype(np.float32)
    slots = np.array([0, 5, -1, 22, 9], np.int64)
    want.write(1, k, v, slots)
    bad = _misaligned(slots)
    got.write(1, k, v, bad)
    np.testing.assert_array_equal(got.storage, want.storage)
    # a view one element in (frombuffer(...)[1:] of a misaligned buffer) too
    buf = bytearray(8 * 6 + 1)
    view = np.frombuffer(buf, np.int64, 6, offset=1)[1:]
    view[...] = slots
    got.write(1, k, v, view)
    np.testing.assert_array_equal(got.storage, want.storage)


def test_misaligned_block_tables_read_the_right_blocks():
    pool = _filled_pool("float16")
    table = np.array([4, 1, 3], np.int32)
    want_k, want_v = pool.gather(1, table, 2, 11)
    k, v = pool.gather(1, _misaligned(table), 2, 11)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    tables = np.array([[4, 1, 3], [0, 2, 5]], np.int32)
    lengths = np.array([11, 6], np.int32)
    want = pool.gather_batch(0, tables, lengths)
    got = pool.gather_batch(0, _misaligned(tables), _misaligned(lengths))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_misaligned_block_ids_copy_the_right_blocks():
    src = _filled_pool("float16", seed=1)
    want = _filled_pool("float16", seed=2)
    got = _filled_pool("float16", seed=2)
    ids_from, ids_to = np.array([0, 3, 5], np.int32), np.array([2, 1, 4], np.int32)
    src.copy_blocks_to(want, ids_from, ids_to)
    src.copy_blocks_to(got, _misaligned(ids_from), _misaligned(ids_to))
    np.testing.assert_array_equal(got.storage, want.storage)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_misaligned_out_gets_the_right_values(dtype):
    pool = _filled_pool("float16")
    want_k, want_v = pool.gather(0, [2, 0], 1, 7, dtype=dtype)
    k_out = _misaligned(np.zeros_like(want_k))
    v_out = _misaligned(np.zeros_like(want_v))
    k, v = pool.gather(0, [2, 0], 1, 7, dtype=dtype, out=(k_out, v_out))
    assert k is k_out and v is v_out
    np.testing.assert_array_equal(k_out, want_k)
    np.testing.assert_array_equal(v_out, want_v)
    # KVCache.get and the conversions too
    cache = kvcore.KVCache(1, 2, 8, 8, dtype="float16")
    x = np.random.default_rng(6).standard_normal((1, 2, 3, 8)).astype(np.float32)
    cache.update(0, x, -x)
    out = (_misaligned(np.zeros((1, 2, 3, 8), dtype)), _misaligned(np.zeros((1, 2, 3, 8), dtype)))
    cache.get(0, dtype=dtype, out=out)
    np.testing.assert_array_equal(out[0], x.astype(np.float16).astype(dtype))
    np.testing.assert_array_equal(out[1], (-x).astype(np.float16).astype(dtype))
    h = _misaligned(np.zeros(x.shape, np.float16))
    assert kvcore.to_float16(x, out=h) is h
    np.testing.assert_array_equal(h, x.astype(np.float16))


def test_misaligned_token_ids_are_read_right():
    pool = kvcore.BlockPool(16, 4, 1, 1, 8)
    ids = np.arange(100, 113, dtype=np.int32)
    bad = _misaligned(ids)
    assert kvcore.block_hashes(bad, 4) == kvcore.block_hashes(ids, 4)
    assert pool.probe(bad) == pool.probe(ids)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(bad)
    np.testing.assert_array_equal(seq.token_ids, ids)
    seq.extend_tokens(_misaligned(np.array([7, 8, 9], np.int32)))
    np.testing.assert_array_equal(seq.token_ids, np.r_[ids, 7, 8, 9])


def test_empty_sequence_buffers():
    """A fresh sequence has no token buffer yet (NULL in C): reading and
    copying it must not hand NULL to memcpy (UBSan), and gives empty arrays."""
    pool = kvcore.BlockPool(8, 4, 1, 1, 8)
    other = kvcore.BlockPool(8, 4, 1, 1, 8)
    seq = kvcore.PagedKVCache(pool)
    assert seq.token_ids.shape == (0,) and seq.token_ids.dtype == np.int32
    assert seq.block_hashes() == []
    child = seq.fork()
    assert child.token_ids.shape == (0,)
    twin = seq.copy_to(other)
    assert twin.token_ids.shape == (0,) and twin.num_blocks == 0
    twin.allocate([1, 2, 3, 4, 5])
    np.testing.assert_array_equal(twin.token_ids, [1, 2, 3, 4, 5])


def test_kernels_refuse_misaligned_arrays_instead_of_undefined_behaviour():
    """The kernels are the last line: a misaligned index array that got past
    the validation is an error, never a misaligned load."""
    pool = _filled_pool("float16")
    out = np.empty((2, 4, 8), np.float16)
    with pytest.raises(ValueError, match="not aligned"):
        _kernels.gather(pool.key_cache(0), _misaligned(np.array([1], np.int32)), 0, 4, out, 1, 1)
    with pytest.raises(ValueError, match="aligned"):
        from kvcore.backends.cpu import _convert
        _convert.convert_array(np.zeros(4, np.float32), 0, _misaligned(np.zeros(4, np.float16)), 1)


# ================================================================ out= everywhere

def test_out_shape_and_dtype_errors():
    pool = _filled_pool("float16")
    good = np.empty((2, 4, 8), np.float16)
    with pytest.raises(ValueError, match=r"out\[1\] must have shape \(2, 4, 8\), got \(2, 3, 8\)"):
        pool.gather(0, [0], 0, 4, out=(good, np.empty((2, 3, 8), np.float16)))
    with pytest.raises(TypeError, match=r"out\[0\] must have dtype float16.*float32"):
        pool.gather(0, [0], 0, 4, out=(np.empty((2, 4, 8), np.float32), good))
    with pytest.raises(TypeError, match=r"out must be a pair \(k_out, v_out\)"):
        pool.gather(0, [0], 0, 4, out=good)
    ro = np.empty((2, 4, 8), np.float16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\[1\] must be writeable"):
        pool.gather(0, [0], 0, 4, out=(good, ro))


def test_out_for_every_kv_read():
    pool = _filled_pool("float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(6)))
    x = np.random.default_rng(7).standard_normal((6, 2, 8)).astype(np.float32)
    seq.append(0, x, -x)
    want = seq.gather(0, dtype="float32")
    out = (np.empty((2, 6, 8), np.float32), np.empty((2, 6, 8), np.float32))
    got = seq.gather(0, dtype="float32", out=out)
    assert got[0] is out[0] and got[1] is out[1]
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(out[1], want[1])
    # a non-contiguous out (a transposed buffer) is filled as well
    buf = (np.empty((6, 2, 8), np.float16), np.empty((6, 2, 8), np.float16))
    pool.gather(0, seq.block_table, 0, 6, out=(buf[0].transpose(1, 0, 2),
                                                buf[1].transpose(1, 0, 2)))
    np.testing.assert_array_equal(buf[0].transpose(1, 0, 2), seq.gather(0)[0])
    # gather_batch
    wk, wv = pool.gather_batch(0, [seq.block_table], [6])
    ok, ov = np.full_like(wk, 7), np.full_like(wv, 7)
    rk, rv = pool.gather_batch(0, [seq.block_table], [6], out=(ok, ov))
    assert rk is ok and rv is ov
    np.testing.assert_array_equal(ok, wk)
    np.testing.assert_array_equal(ov, wv)
    # KVCache.get: views without out, a snapshot in out
    cache = kvcore.KVCache(1, 2, 8, 8, dtype="float16")
    y = x.transpose(1, 0, 2)[None]
    cache.update(0, y, -y)
    out = (np.empty((1, 2, 6, 8), np.float16), np.empty((1, 2, 6, 8), np.float16))
    k, v = cache.get(0, out=out)
    assert k is out[0] and v is out[1]
    np.testing.assert_array_equal(out[0], y.astype(np.float16))
    np.testing.assert_array_equal(out[1], (-y).astype(np.float16))
    with pytest.raises(TypeError, match=r"out\[0\] must have dtype float16"):
        cache.get(0, out=(np.empty((1, 2, 6, 8), np.float32), out[1]))


# ================================================================ item 18: torch tensors

def _t(torch, a, dtype=None, grad=False):
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None:
        t = t.to(dtype)
    if grad:
        t.requires_grad_(True)
    return t


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "requires-grad"])
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16"])
def test_torch_kv_into_every_writer(torch, storage, src, grad):
    """torch tensors (bf16 read as bfloat16; tensors that require grad read
    as their data) write exactly what the equivalent NumPy input writes."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[src]
    tk, tv = _t(torch, x, tdt, grad), _t(torch, -x, tdt, grad)
    # the NumPy twin: the same values, bfloat16 as uint16 bits
    if src == "bfloat16":
        nk, nv, kw = (kvcore.to_bfloat16(tk.detach().float().numpy()),
                      kvcore.to_bfloat16(tv.detach().float().numpy()), {"src_dtype": "bf16"})
    else:
        nk, nv, kw = tk.detach().numpy().copy(), tv.detach().numpy().copy(), {}
    a, b = _filled_pool(storage), _filled_pool(storage)
    slots = np.array([3, 9, 14], np.int64)
    a.write(1, nk, nv, slots, **kw)
    b.write(1, tk, tv, _t(torch, slots))
    np.testing.assert_array_equal(b.storage, a.storage)
    # PagedKVCache.append
    sa, sb = kvcore.PagedKVCache(a), kvcore.PagedKVCache(b)
    sa.allocate([5, 6, 7])
    sb.allocate(_t(torch, np.array([5, 6, 7])))
    sa.append(0, nk, nv, **kw)
    sb.append(0, tk, tv)
    np.testing.assert_array_equal(b.storage, a.storage)
    # KVCache.update
    ca = kvcore.KVCache(1, 2, 8, 4, dtype=storage)
    cb = kvcore.KVCache(1, 2, 8, 4, dtype=storage)
    ca.update(0, nk.transpose(1, 0, 2)[None], nv.transpose(1, 0, 2)[None], **kw)
    cb.update(0, tk.transpose(1, 0)[None], tv.transpose(1, 0)[None])
    for p, q in zip(ca.get(0), cb.get(0)):
        np.testing.assert_array_equal(p, q)


def test_torch_fast_append_path(torch):
    """A CPU float32/float16/bfloat16 torch tensor takes the direct append
    path (as the NumPy array would), also when it requires grad."""
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    x = np.random.default_rng(9).standard_normal((3, 2, 8)).astype(np.float32)
    assert seq._seq.append_direct(0, _t(torch, x), _t(torch, -x, grad=True)) is True
    k, v = seq.gather(0)
    np.testing.assert_array_equal(k, x.astype(np.float16).transpose(1, 0, 2))
    np.testing.assert_array_equal(v, (-x).astype(np.float16).transpose(1, 0, 2))
    # a non-contiguous tensor, or k and v of two dtypes, take the validated
    # path: same result
    strided = _t(torch, x.transpose(1, 0, 2)).transpose(0, 1)     # (3, 2, 8), not contiguous
    assert not strided.is_contiguous()
    assert seq._seq.append_direct(0, strided, _t(torch, -x)) is False
    assert seq._seq.append_direct(0, _t(torch, x), _t(torch, -x, torch.bfloat16)) is False
    seq.append(0, strided, _t(torch, -x))
    k, v = seq.gather(0)
    np.testing.assert_array_equal(k, x.astype(np.float16).transpose(1, 0, 2))
    assert seq._seq.append_direct(0, _t(torch, x, torch.bfloat16),
                                  _t(torch, -x, torch.bfloat16)) is True
    k, v = seq.gather(0)
    want_v = kvcore.from_bfloat16(kvcore.to_bfloat16(-x)).astype(np.float16)
    np.testing.assert_array_equal(v, want_v.transpose(1, 0, 2))


def test_torch_token_ids_slots_and_tables(torch):
    pool = _filled_pool("float16", num_blocks=8)
    ids = np.arange(10, 19)
    tids = torch.tensor(ids)
    assert kvcore.block_hashes(tids, 4) == kvcore.block_hashes(ids, 4)
    assert pool.probe(tids) == pool.probe(ids)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(torch.tensor(ids, dtype=torch.int32))
    seq.extend_tokens(torch.tensor([3, 4]))
    np.testing.assert_array_equal(seq.token_ids, np.r_[ids, 3, 4])
    seq.append_token(torch.tensor(5))
    assert seq.token_ids[-1] == 5
    table = np.array([5, 2], np.int32)
    want = pool.gather(0, table, 1, 7)
    got = pool.gather(0, torch.tensor(table), 1, 7)
    np.testing.assert_array_equal(got[0], want[0])
    got = pool.gather_batch(0, torch.tensor(table[None]), torch.tensor([6]))
    np.testing.assert_array_equal(got[1][0, :, :6], pool.gather(0, table, 0, 6)[1])
    for bad in (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.bfloat16)):
        with pytest.raises(TypeError, match="slots must hold integers"):
            pool.write(0, np.zeros((1, 2, 8), np.float32), np.zeros((1, 2, 8), np.float32),
                       bad)


def test_torch_out_tensors(torch):
    pool = _filled_pool("bfloat16")
    want_k, want_v = pool.gather(0, [1, 4], 0, 8)
    k_out = torch.empty((2, 8, 8), dtype=torch.bfloat16)
    v_out = torch.empty((2, 8, 8), dtype=torch.bfloat16)
    k, v = pool.gather(0, [1, 4], 0, 8, out=(k_out, v_out))
    assert k is k_out and v is v_out
    np.testing.assert_array_equal(k_out.view(torch.int16).numpy().view(np.uint16), want_k)
    np.testing.assert_array_equal(v_out.view(torch.int16).numpy().view(np.uint16), want_v)
    f = (torch.empty((2, 8, 8)), torch.empty((2, 8, 8)))
    pool.gather(0, [1, 4], 0, 8, dtype="float32", out=f)
    np.testing.assert_array_equal(f[0].numpy(), kvcore.from_bfloat16(want_k))
    with pytest.raises(TypeError, match=r"out\[0\] must have dtype uint16.*torch\.float32"):
        pool.gather(0, [1, 4], 0, 8, out=f)
    with pytest.raises(TypeError, match="requires grad"):
        pool.gather(0, [1, 4], 0, 8, dtype="float32",
                    out=(torch.empty((2, 8, 8), requires_grad=True), f[1]))
    # conversions: torch in, torch out (bf16 both ways)
    x = torch.randn(5, 3)
    b = kvcore.to_bfloat16(x)
    np.testing.assert_array_equal(b, kvcore.to_bfloat16(x.numpy()))
    tb = torch.empty(5, 3, dtype=torch.bfloat16)
    assert kvcore.to_bfloat16(x, out=tb) is tb
    assert torch.equal(tb, x.to(torch.bfloat16))
    back = kvcore.from_bfloat16(tb.requires_grad_(False))
    np.testing.assert_array_equal(back, tb.float().numpy())
    h = torch.empty(5, 3, dtype=torch.float16)
    kvcore.to_float16(x.requires_grad_(True), out=h)
    assert torch.equal(h, x.detach().half())
    np.testing.assert_array_equal(kvcore.from_float16(h), h.float().numpy())
    # KVCache.get into torch tensors
    cache = kvcore.KVCache(1, 2, 8, 4, dtype="bfloat16")
    y = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    cache.update(0, y, y)
    o = (torch.empty(1, 2, 3, 8, dtype=torch.bfloat16), torch.empty(1, 2, 3, 8,
                                                                      dtype=torch.bfloat16))
    cache.get(0, out=o)
    assert torch.equal(o[0], y) and torch.equal(o[1], y)


def test_torch_bf16_with_a_contradicting_src_dtype(torch):
    pool = _filled_pool("float16")
    t = torch.zeros((1, 2, 8), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"k must have dtype float16 for src_dtype='float16', "
                                        r"got torch.bfloat16"):
        pool.write(0, t, t, [0], src_dtype="float16")
    # and with src_dtype="bfloat16" it is what it says
    pool.write(0, t, t, [0], src_dtype="bfloat16")
    assert not pool.key_cache(0)[0, :, 0].any()


def test_torch_tensor_that_cannot_be_read_in_place_is_a_clear_error(torch):
    pool = _filled_pool("float16")
    t = torch.empty((1, 2, 8), device="meta")
    with pytest.raises(TypeError, match=r"\bk\b.*meta"):
        pool.write(0, t, t, [0])
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2])
    s = torch.zeros((2, 2, 8)).to_sparse()
    with pytest.raises(TypeError, match=r"\bk\b.*Sparse"):
        seq.append(0, s, s)
    with pytest.raises(TypeError, match=r"\bx\b.*Sparse"):
        kvcore.to_float16(s)


# ============================================================ item 19: conversion errors

@pytest.mark.parametrize("call, message", [
    (lambda: kvcore.to_float16([1.0]),
     "x must be a float32 array; got list: pass numpy.asarray(x, dtype=numpy.float32)"),
    (lambda: kvcore.to_float16(np.zeros(3)),
     "x must be a float32 array; got float64 array: pass x.astype(numpy.float32)"),
    (lambda: kvcore.to_bfloat16((1.0, 2.0)),
     "x must be a float32 array; got tuple: pass numpy.asarray(x, dtype=numpy.float32)"),
    (lambda: kvcore.to_float16(np.arange(3)),
     "x must be a float32 array; got int64 array: pass x.astype(numpy.float32)"),
    (lambda: kvcore.to_float16(1.5),
     "x must be a float32 array; got float: pass numpy.asarray(x, dtype=numpy.float32)"),
    (lambda: kvcore.from_float16(np.zeros(3, np.float32)),
     "h must be a float16 array; got float32 array: pass h.astype(numpy.float16)"),
    (lambda: kvcore.from_float16([0.5]),
     "h must be a float16 array; got list: pass numpy.asarray(h, dtype=numpy.float16)"),
    (lambda: kvcore.from_bfloat16(np.zeros(3, np.float32)),
     "b must be a uint16 (bfloat16 bits) or ml_dtypes.bfloat16 array; got float32 array: "
     "pass kvcore.to_bfloat16(b.astype(numpy.float32)) to get bfloat16 bits"),
    (lambda: kvcore.from_bfloat16(np.zeros(3, np.int16)),
     "b must be a uint16 (bfloat16 bits) or ml_dtypes.bfloat16 array; got int16 array: "
     "pass b.view(numpy.uint16) if it holds bfloat16 bits"),
    (lambda: kvcore.from_bfloat16([1, 2]),
     "b must be a uint16 (bfloat16 bits) or ml_dtypes.bfloat16 array; got list: "
     "pass kvcore.to_bfloat16(numpy.asarray(b, dtype=numpy.float32)) to get bfloat16 bits"),
    (lambda: kvcore.to_float16(np.zeros(3, np.complex64)),
     "x must be a float32 array; got complex64 array"),
], ids=["list", "float64", "tuple", "int64", "float-scalar", "f16-given-f32", "f16-list",
        "bf16-given-f32", "bf16-given-int16", "bf16-list", "complex"])
def test_conversion_errors_say_what_was_given_and_what_to_pass(call, message):
    with pytest.raises(TypeError) as e:
        call()
    assert str(e.value) == message


def test_conversion_error_for_a_torch_tensor(torch):
    with pytest.raises(TypeError, match=re.escape(
            "x must be a float32 array; got torch tensor of dtype torch.float64: "
            "pass x.to(torch.float32)")):
        kvcore.to_float16(torch.zeros(3, dtype=torch.float64))


def test_numpy_scalars_still_convert():
    assert kvcore.to_float16(np.float32(1.5)) == np.float16(1.5)


def test_torch_zero_tensors_are_refused_not_read(torch):
    """A torch ZeroTensor (``torch._efficientzerotensor``: no memory, data
    pointer 0) as k/v, q or out= is refused with a TypeError naming the
    argument: the direct paths read or wrote address 0 (a segfault) and the
    general path read memory that was never written."""
    from kvcore.attention import AttentionPlan
    pool = kvcore.BlockPool(4, 4, 1, 2, 16, dtype="float16")
    z = torch._efficientzerotensor((2, 2, 16))
    assert z._is_zerotensor()
    writer = pool._writer
    slots = np.array([1, 6], np.int64)
    assert writer.write_slots(0, z, z, slots) is False
    with pytest.raises(TypeError, match="^k "):
        pool.write(0, z, z, slots)
    assert not pool.storage.any()
    plan = AttentionPlan(pool, np.array([[0, 1]], np.int32), np.array([2]), np.array([0, 2]),
                         num_heads=2)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        zq = torch._efficientzerotensor((2, 2, 16), dtype=dt)
        with pytest.raises(TypeError, match="^q "):
            plan.run(zq, 0)
        with pytest.raises(TypeError, match="^out "):
            plan.run(torch.zeros((2, 2, 16), dtype=dt), 0, out=zq)
