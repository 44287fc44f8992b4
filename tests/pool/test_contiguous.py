"""kvcore.KVCache, the contiguous cache.

Every test takes the ``device`` fixture, so the same bodies run on each
backend present (CUDA cases skip without one).  Inputs are built on the host
and moved with ``put``; results come back with ``host``.
"""
import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore.backends import get_backend
from kvcore.backends.cpu import _convert

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_env import cuda_backend_or_skip
    from ._helpers import storage_bits
except ImportError:
    from _cuda_env import cuda_backend_or_skip
    from _helpers import storage_bits

BF16 = np.dtype(ml_dtypes.bfloat16)
STORAGE_DTYPES = ["float32", "float16", "bfloat16"]
BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param != "cpu":
        cuda_backend_or_skip(request.param)  # skip only without CuPy or a GPU
    return request.param


def put(device, a):
    return get_backend(device).from_host(np.asarray(a))


def host(a):
    if isinstance(a, np.ndarray):
        return a
    return get_backend("cuda").to_host(a)


def rand(shape, seed, dtype=np.float32):
    """float32 data with the awkward values mixed in: ties, subnormals,
    overflow to inf in float16, signed zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(3)
    flat = x.reshape(-1)
    special = np.array([0.0, -0.0, 1e-8, -6e-8, 65520.0, -1e6, 1.0009765625,
                        1.00048828125, 3.0e-41, np.inf, -np.inf], np.float32)
    m = min(flat.size, special.size)
    idx = rng.choice(flat.size, m, replace=False)
    flat[idx] = special[:m]
    if dtype == np.float16:
        return kvcore.to_float16(x)
    if dtype == "bf16bits":
        return kvcore.to_bfloat16(x)
    if dtype == BF16:
        return kvcore.to_bfloat16(x).view(BF16)
    return x


def assert_bits(got, want, storage):
    got = np.ascontiguousarray(host(got))
    want = np.ascontiguousarray(want)
    assert got.shape == want.shape
    b = BITS[storage]
    np.testing.assert_array_equal(got.view(b), want.view(b))


def snapshot(cache):
    """Everything observable about a cache, including unwritten bytes."""
    return (cache.layer_lengths,
            [host(cache.key_cache(i)).copy() for i in range(cache.num_layers)],
            [host(cache.value_cache(i)).copy() for i in range(cache.num_layers)])


def assert_unchanged(cache, snap):
    lengths, ks, vs = snap
    assert cache.layer_lengths == lengths
    for i in range(cache.num_layers):
        np.testing.assert_array_equal(host(cache.key_cache(i)).view(np.uint8),
                                      ks[i].view(np.uint8))
        np.testing.assert_array_equal(host(cache.value_cache(i)).view(np.uint8),
                                      vs[i].view(np.uint8))


L, B, H, D, S = 3, 2, 3, 5, 16


def make(device, dtype="float16", **kw):
    args = dict(num_layers=L, num_kv_heads=H, head_dim=D, max_seq_len=S, batch_size=B,
                dtype=dtype, device=device)
    args.update(kw)
    return kvcore.KVCache(**args)


def test_exported():
    assert "KVCache" in kvcore.__all__
    assert kvcore.KVCache.__module__ == "kvcore.contiguous"


@pytest.mark.parametrize("storage", ["float32", "float16", "float8_e4m3fn", "int8"])
def test_storage_starts_on_a_line(storage):
    """The cache's rows start on a cache line, as a pool's pages do (np.empty
    would start 16 bytes into one); a new cache reads as zeros; its copy
    (clone, to) is allocated the same way."""
    cache = kvcore.KVCache(2, 3, 64, 40, batch_size=2, dtype=storage)
    for c in (cache, cache.clone(), cache.to("cpu")):
        st = c._storage
        assert st.ctypes.data % 64 == 0, (storage, st.ctypes.data % 64)
        assert st.flags.c_contiguous and not st.view(np.uint8).any()


def test_a_cache_too_large_for_any_machine_names_its_shape():
    # (2**76 bytes: past what NumPy will ask the allocator for, so no calloc
    # runs; one of 2**56 bytes is refused by malloc, or aborts under ASan)
    with pytest.raises(ValueError, match=r"cannot allocate \d+ bytes for an array of shape "
                                         r"\(512, 2, 1048576, 256, 1073741824, 128\)"):
        kvcore.KVCache(512, 256, 128, 2**30, batch_size=2**20)


def test_a_cache_too_large_to_allocate_names_its_sizing_arguments_as_a_pool_does():
    # (the pool's message named its arguments; the cache's only the shape,
    # and a size NumPy refuses (a ValueError) not even that it was the cache)
    with pytest.raises(MemoryError, match=r"^the KV cache's buffer cannot be allocated: "
                                          r"num_layers=32 x 2 \(K, V\) x batch_size=2048 x "
                                          r"num_kv_heads=8 x max_seq_len=1048576 x head_dim=128 "
                                          r"elements of float16 are 281474976710656 bytes"):
        kvcore.KVCache(32, 8, 128, 2**20, batch_size=2**11)
    with pytest.raises(ValueError, match=r"^the KV cache's buffer cannot be allocated: "
                                         r"num_layers=512 x 2 \(K, V\) x batch_size=1048576 x "
                                         r"num_kv_heads=256 x max_seq_len=1073741824 x "
                                         r"head_dim=128 elements of int8 are \d+ bytes"):
        kvcore.KVCache(512, 256, 128, 2**30, batch_size=2**20, dtype="int8")


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("storage", STORAGE_DTYPES)
@pytest.mark.parametrize("src", ["float32", "float16", "bf16ml", "bf16bits"])
def test_prompt_then_decode_bit_exact(device, storage, src):
    src_dtype = {"float32": np.float32, "float16": np.float16, "bf16ml": BF16,
                 "bf16bits": "bf16bits"}[src]
    kw = {"src_dtype": "bfloat16"} if src == "bf16bits" else {}
    cache = make(device, storage)
    prompt, steps = 7, 4
    ks = [rand((B, H, prompt, D), 10 * layer, src_dtype) for layer in range(L)]
    vs = [rand((B, H, prompt, D), 10 * layer + 1, src_dtype) for layer in range(L)]
    for layer in range(L):
        cache.update(layer, put(device, ks[layer]), put(device, vs[layer]), **kw)
    assert cache.seq_len == prompt
    for step in range(steps):
        for layer in range(L):
            k = rand((B, H, 1, D), 1000 + 10 * step + layer, src_dtype)
            v = rand((B, H, 1, D), 2000 + 10 * step + layer, src_dtype)
            cache.update(layer, put(device, k), put(device, v), **kw)
            ks[layer] = np.concatenate([ks[layer], k], axis=2)
            vs[layer] = np.concatenate([vs[layer], v], axis=2)
            # a layer sees its own new position before the later layers are written
            assert cache.get(layer)[0].shape == (B, H, prompt + step + 1, D)
    assert cache.seq_len == prompt + steps
    for layer in range(L):
        k, v = cache.get(layer)
        assert host(k).dtype == np.dtype(
            {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[storage])
        assert_bits(k, storage_bits(ks[layer], storage), storage)
        assert_bits(v, storage_bits(vs[layer], storage), storage)
        # sub-range
        k, v = cache.get(layer, 3, 9)
        assert_bits(k, storage_bits(ks[layer], storage)[:, :, 3:9], storage)
        assert_bits(v, storage_bits(vs[layer], storage)[:, :, 3:9], storage)


@pytest.mark.parametrize("level", _convert.available_simd_levels())
@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_every_cpu_simd_level_gives_the_same_bits(storage, level):
    """Odd head_dim and strided rows exercise the SIMD tails of the CPU kernel."""
    previous = kvcore.set_simd_level(level)
    try:
        cache = make("cpu", storage, num_layers=1, head_dim=37, max_seq_len=40)
        x = rand((B, 9, H, 37), 11).transpose(0, 2, 1, 3)
        y = rand((B, H, 9, 37), 12)
        cache.update(0, x, y)
        cache.update(0, y[:, :, :1], x[:, :, :1])
    finally:
        kvcore.set_simd_level(previous)
    k, v = cache.get(0)
    assert_bits(k, storage_bits(np.concatenate([x, y[:, :, :1]], 2), storage), storage)
    assert_bits(v, storage_bits(np.concatenate([y, x[:, :, :1]], 2), storage), storage)


@pytest.mark.parametrize("storage", STORAGE_DTYPES)
def test_nan_stays_nan_of_same_sign(device, storage):
    cache = make(device, storage, num_layers=1)
    x = np.zeros((B, H, 2, D), np.float32)
    x[0, 0, 0, 0] = np.nan
    x[1, 2, 1, 4] = -np.nan
    cache.update(0, put(device, x), put(device, x))
    k = host(cache.get(0, dtype="float32")[0])
    assert np.isnan(k[0, 0, 0, 0]) and not np.signbit(k[0, 0, 0, 0])
    assert np.isnan(k[1, 2, 1, 4]) and np.signbit(k[1, 2, 1, 4])
    assert np.isnan(k).sum() == 2


def test_k_and_v_may_differ_in_dtype(device):
    cache = make(device, "bfloat16", num_layers=1)
    k = rand((B, H, 3, D), 1)
    v = rand((B, H, 3, D), 2, np.float16)
    cache.update(0, put(device, k), put(device, v))
    kk, vv = cache.get(0)
    assert_bits(kk, storage_bits(k, "bfloat16"), "bfloat16")
    assert_bits(vv, storage_bits(v, "bfloat16"), "bfloat16")


@pytest.mark.parametrize("storage", STORAGE_DTYPES)
def test_strided_inputs(device, storage):
    cache = make(device, storage, num_layers=1, max_seq_len=64)
    n = 6
    # (batch, n, heads, dim) projection output, viewed head-major
    x = rand((B, n, H, D), 3)
    k = x.transpose(0, 2, 1, 3)
    v = rand((B, H, n, 2 * D), 4)[..., ::2]            # inner axis strided
    cache.update(0, put(device, k), put(device, v))
    rev = rand((B, H, n, D), 5)[:, :, ::-1]             # negative stride
    fortran = np.asfortranarray(rand((B, H, n, D), 6))
    cache.update(0, put(device, rev), put(device, fortran))
    one = rand((B, 1, H, D), 7).transpose(0, 2, 1, 3)  # single strided token
    cache.update(0, put(device, one), put(device, one))
    got_k, got_v = cache.get(0)
    assert_bits(got_k, storage_bits(np.concatenate([k, rev, one], 2), storage), storage)
    assert_bits(got_v, storage_bits(np.concatenate([v, fortran, one], 2), storage), storage)


def test_get_widened_copies(device):
    cache = make(device, "float16", num_layers=1)
    x = rand((B, H, 5, D), 8)
    cache.update(0, put(device, x), put(device, x))
    k16, _ = cache.get(0)
    k32, v32 = cache.get(0, 1, 4, dtype="float32")
    assert host(k32).dtype == np.float32 and host(k32).shape == (B, H, 3, D)
    np.testing.assert_array_equal(host(k32), kvcore.from_float16(host(k16)[:, :, 1:4]))
    np.testing.assert_array_equal(host(v32), host(k32))
    assert not np.shares_memory(host(k32), host(cache.key_cache(0)))
    kb, _ = cache.get(0, dtype="bf16")
    assert host(kb).dtype == np.uint16
    np.testing.assert_array_equal(host(kb), kvcore.to_bfloat16(kvcore.from_float16(host(k16))))


def test_get_returns_views(device):
    cache = make(device, num_layers=1)
    cache.update(0, put(device, rand((B, H, 4, D), 1)), put(device, rand((B, H, 4, D), 2)))
    k, v = cache.get(0)
    assert k.base is not None   # a view of the cache's storage (NumPy or CuPy), not a copy
    new = rand((B, H, 1, D), 3)
    cache.update(0, put(device, new), put(device, new), start_pos=2)
    assert_bits(k[:, :, 2:3], storage_bits(new, "float16"), "float16")


# ------------------------------------------------------------------ lengths
def test_seq_len_is_min_over_layers(device):
    cache = make(device)
    x = rand((B, H, 5, D), 1)
    cache.update(0, put(device, x), put(device, x))
    assert cache.seq_len == 0 and cache.layer_lengths == (5, 0, 0)
    cache.update(1, put(device, x[:, :, :3]), put(device, x[:, :, :3]))
    cache.update(2, put(device, x[:, :, :4]), put(device, x[:, :, :4]))
    assert cache.seq_len == 3 and cache.layer_lengths == (5, 3, 4)
    assert cache.layer_len(0) == 5 and cache.layer_len(1) == 3
    assert cache.get(0)[0].shape[2] == 5
    assert cache.get(1)[0].shape[2] == 3
    with pytest.raises(ValueError, match=r"end must be <= 3 .*layer 1.*got 4"):
        cache.get(1, 0, 4)
    # default start_pos is the layer's own length
    cache.update(1, put(device, x[:, :, :2]), put(device, x[:, :, :2]))
    assert cache.layer_lengths == (5, 5, 4) and cache.seq_len == 4
    assert cache.memory_report()["used_bytes"] == 4 * cache.memory_report()["bytes_per_token"]


def test_overwrite_with_start_pos(device):
    cache = make(device, "float32", num_layers=1)
    a = rand((B, H, 6, D), 1)
    cache.update(0, put(device, a), put(device, a))
    b = rand((B, H, 2, D), 2)
    cache.update(0, put(device, b), put(device, -b), start_pos=2)
    assert cache.seq_len == 6                                     # no shrink
    want = a.copy()
    want[:, :, 2:4] = b
    k, v = cache.get(0)
    assert_bits(k, want, "float32")
    want[:, :, 2:4] = -b
    assert_bits(v, want, "float32")
    c = rand((B, H, 4, D), 3)
    cache.update(0, put(device, c), put(device, c), start_pos=4)   # overwrite + extend
    assert cache.seq_len == 8
    assert_bits(cache.get(0, 4)[0], c, "float32")
    cache.update(0, put(device, c[:, :, :1]), put(device, c[:, :, :1]), start_pos=8)  # == length
    assert cache.seq_len == 9
    cache.update(0, put(device, c), put(device, c), start_pos=np.int64(0))
    assert cache.seq_len == 9


def test_update_from_own_views(device):
    """Inputs that alias the cache (views from get) are read before written."""
    cache = make(device, "float16", num_layers=1)
    a = rand((B, H, 6, D), 1, np.float16)
    b = rand((B, H, 6, D), 2, np.float16)
    cache.update(0, put(device, a), put(device, b))
    k, v = cache.get(0, 0, 4)
    cache.update(0, k, v, start_pos=2)           # overlapping shift right
    got_k, got_v = cache.get(0)
    assert_bits(got_k, np.concatenate([a[:, :, :2], a[:, :, :4]], 2), "float16")
    assert_bits(got_v, np.concatenate([b[:, :, :2], b[:, :, :4]], 2), "float16")
    k, v = cache.get(0, 0, 6)
    cache.update(0, v, k, start_pos=0)           # swap K and V in place
    got_k, got_v = cache.get(0)
    assert_bits(got_k, np.concatenate([b[:, :, :2], b[:, :, :4]], 2), "float16")
    assert_bits(got_v, np.concatenate([a[:, :, :2], a[:, :, :4]], 2), "float16")


def test_zero_tokens_is_a_validated_noop(device):
    cache = make(device)
    x = rand((B, H, 0, D), 1)
    cache.update(0, put(device, x), put(device, x))
    assert cache.layer_lengths == (0, 0, 0)
    with pytest.raises(ValueError, match="start_pos must be <= 0"):
        cache.update(0, put(device, x), put(device, x), start_pos=1)


# ------------------------------------------------------ truncate/reset/clone
def test_truncate(device):
    cache = make(device, "bfloat16")
    x = rand((B, H, 8, D), 1)
    for layer in range(L):
        cache.update(layer, put(device, x), put(device, x))
    cache.truncate(5)
    assert cache.seq_len == 5 and cache.layer_lengths == (5, 5, 5)
    assert cache.get(2)[0].shape[2] == 5
    with pytest.raises(ValueError, match="end must be <= 5"):
        cache.get(0, 0, 6)
    y = rand((B, H, 1, D), 2)
    cache.update(0, put(device, y), put(device, y))               # appends at 5
    assert_bits(cache.get(0, 5)[0], storage_bits(y, "bfloat16"), "bfloat16")
    # roll back a step that reached only some layers
    assert cache.layer_lengths == (6, 5, 5)
    cache.truncate(cache.seq_len)
    assert cache.layer_lengths == (5, 5, 5)
    assert_bits(cache.get(0)[0], storage_bits(x[:, :, :5], "bfloat16"), "bfloat16")
    cache.truncate(5)                                             # == seq_len: no-op
    assert cache.seq_len == 5
    cache.truncate(0)
    assert cache.seq_len == 0 and cache.get(1)[0].shape[2] == 0


@pytest.mark.parametrize("n, exc, match", [
    (6, ValueError, r"n must be <= seq_len \(5"),
    (-1, ValueError, "n must be >= 0, got -1"),
    (2.0, TypeError, "n must be an integer, got float"),
    (None, TypeError, "n must be an integer, got NoneType"),
])
def test_truncate_errors(device, n, exc, match):
    cache = make(device)
    x = rand((B, H, 5, D), 1)
    for layer in range(L):
        cache.update(layer, put(device, x), put(device, x))
    cache.update(0, put(device, x[:, :, :2]), put(device, x[:, :, :2]))
    snap = snapshot(cache)
    with pytest.raises(exc, match=match):
        cache.truncate(n)
    assert_unchanged(cache, snap)


def test_reset(device):
    cache = make(device)
    x = rand((B, H, 4, D), 1)
    for layer in range(L):
        cache.update(layer, put(device, x), put(device, x))
    cache.reset()
    assert cache.seq_len == 0 and cache.layer_lengths == (0, 0, 0)
    assert cache.get(0)[0].shape == (B, H, 0, D)
    with pytest.raises(ValueError, match="never written"):
        cache.get(0, 0, 1)
    assert cache.memory_report()["used_bytes"] == 0
    y = rand((B, H, 2, D), 2)
    cache.update(1, put(device, y), put(device, y))
    assert cache.layer_lengths == (0, 2, 0)
    assert_bits(cache.get(1)[0], storage_bits(y, "float16"), "float16")


@pytest.mark.parametrize("storage", STORAGE_DTYPES)
def test_clone_is_independent(device, storage):
    cache = make(device, storage)
    x = rand((B, H, 6, D), 1)
    cache.update(0, put(device, x), put(device, -x))
    cache.update(1, put(device, x[:, :, :3]), put(device, x[:, :, :3]))
    twin = cache.clone()
    assert type(twin) is kvcore.KVCache
    assert twin.layer_lengths == (6, 3, 0) and twin.seq_len == 0
    assert (twin.num_layers, twin.num_kv_heads, twin.head_dim, twin.max_seq_len,
            twin.batch_size, twin.dtype, twin.device) == (
        L, H, D, S, B, storage, cache.device)
    assert repr(twin) == repr(cache)
    for layer in range(L):
        assert not np.shares_memory(host(twin.key_cache(layer)), host(cache.key_cache(layer)))
    assert_bits(twin.get(0)[0], storage_bits(x, storage), storage)
    assert_bits(twin.get(0)[1], storage_bits(-x, storage), storage)
    assert_bits(twin.get(1)[0], storage_bits(x[:, :, :3], storage), storage)
    # writes to the original do not reach the clone, and back
    y = rand((B, H, 2, D), 2)
    cache.update(0, put(device, y), put(device, y), start_pos=1)
    cache.update(2, put(device, y), put(device, y))
    assert twin.layer_lengths == (6, 3, 0)
    assert_bits(twin.get(0)[0], storage_bits(x, storage), storage)
    twin.update(1, put(device, y), put(device, y))
    twin.truncate(0)
    assert cache.layer_lengths == (6, 3, 2)
    assert_bits(cache.get(1)[0], storage_bits(x[:, :, :3], storage), storage)


# -------------------------------------------------------------- overflow
def test_overflow_raises_cache_full_and_changes_nothing(device):
    cache = make(device, max_seq_len=8)
    x = rand((B, H, 7, D), 1)
    for layer in range(L):
        cache.update(layer, put(device, x), put(device, x))
    snap = snapshot(cache)
    two = rand((B, H, 2, D), 2)
    with pytest.raises(kvcore.CacheFullError, match=r"needs 9 positions, max_seq_len is 8"):
        cache.update(1, put(device, two), put(device, two))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError):                # CacheFullError is a ValueError
        cache.update(1, put(device, two), put(device, two), start_pos=7)
    with pytest.raises(kvcore.KVCacheError):
        cache.update(1, put(device, rand((B, H, 9, D), 3)), put(device, rand((B, H, 9, D), 3)),
                     start_pos=0)
    assert_unchanged(cache, snap)
    one = rand((B, H, 1, D), 4)
    cache.update(1, put(device, one), put(device, one))            # exactly full
    assert cache.layer_len(1) == 8
    with pytest.raises(kvcore.CacheFullError):
        cache.update(1, put(device, one), put(device, one))
    cache.update(1, put(device, two), put(device, two), start_pos=6)  # overwrite at the end
    assert cache.layer_len(1) == 8
    assert cache.memory_report()["free_positions"] == 0


# ------------------------------------------------------------- bad inputs
def _good(n=2, seed=0):
    return rand((B, H, n, D), seed)


BAD_UPDATES = [
    # (label, kwargs-maker, exception, match)
    ("layer too big", lambda: dict(layer=L), IndexError, rf"layer must be in 0\.\.{L - 1} .*got {L}"),
    ("layer negative", lambda: dict(layer=-1), IndexError, r"layer must be in 0\.\.2 .*got -1"),
    ("layer float", lambda: dict(layer=1.0), TypeError, "layer must be an integer, got float"),
    ("layer bool", lambda: dict(layer=True), TypeError, "layer must be an integer, got bool"),
    ("k 3-D", lambda: dict(k=_good()[0]), ValueError,
     r"k must be 4-D \(batch_size, num_kv_heads, n, head_dim\) = \(2, 3, n, 5\), got shape \(3, 2, 5\)"),
    ("k batch", lambda: dict(k=rand((B + 1, H, 2, D), 1)), ValueError,
     r"k\.shape\[0\] must be batch_size=2, got 3"),
    ("v heads", lambda: dict(v=rand((B, H - 1, 2, D), 1)), ValueError,
     r"v\.shape\[1\] must be num_kv_heads=3, got 2"),
    ("k dim", lambda: dict(k=rand((B, H, 2, D + 1), 1)), ValueError,
     r"k\.shape\[3\] must be head_dim=5, got 6"),
    ("v n", lambda: dict(v=_good(3)), ValueError,
     r"v must have the same number of positions as k: k\.shape\[2\] is 2, v\.shape\[2\] is 3"),
    ("k float64", lambda: dict(k=_good().astype(np.float64)), TypeError,
     "k must be float32, float16 or bfloat16, got float64"),
    ("v int32", lambda: dict(v=np.ones((B, H, 2, D), np.int32)), TypeError,
     "v must be float32, float16 or bfloat16, got int32"),
    ("uint16 without src_dtype", lambda: dict(k=kvcore.to_bfloat16(_good())), TypeError,
     "src_dtype='bfloat16'"),
    ("src_dtype mismatch", lambda: dict(src_dtype="bfloat16"), TypeError,
     "k must have dtype uint16 for src_dtype='bfloat16', got float32"),
    ("src_dtype unknown", lambda: dict(src_dtype="int8"), ValueError,
     "src_dtype must be one of"),
    ("start_pos gap", lambda: dict(start_pos=5), ValueError,
     r"start_pos must be <= 4 \(the positions written in layer 1\), got 5"),
    ("start_pos negative", lambda: dict(start_pos=-1), ValueError, "start_pos must be >= 0, got -1"),
    ("start_pos float", lambda: dict(start_pos=1.5), TypeError, "start_pos must be an integer, got float"),
    ("k list", lambda: dict(k=[[1.0]]), TypeError,
     {"cpu": "k must be float32, float16 or bfloat16, got float64",
      # a cache on a GPU takes only arrays already there: a list is refused before its dtype
      "cuda": r"k must be a CUDA array \(a CuPy array, .*\) because this operation runs on "
              r"cuda:0; got builtins\.list"}),
]


@pytest.mark.parametrize("label, make_kwargs, exc, match", BAD_UPDATES,
                         ids=[b[0] for b in BAD_UPDATES])
def test_bad_update_raises_and_changes_nothing(device, label, make_kwargs, exc, match):
    cache = make(device)
    x = rand((B, H, 4, D), 1)
    for layer in range(L):
        cache.update(layer, put(device, x), put(device, x))
    snap = snapshot(cache)
    kw = dict(layer=1, k=_good(seed=5), v=_good(seed=6))
    kw.update(make_kwargs())
    for name in ("k", "v"):
        if isinstance(kw[name], np.ndarray):
            kw[name] = put(device, kw[name])
    if isinstance(match, dict):
        match = match[device]
    with pytest.raises(exc, match=match):
        cache.update(**kw)
    assert_unchanged(cache, snap)


def test_bad_v_after_good_k_writes_nothing(device):
    """k is fine and would be written first; v's error must stop both."""
    cache = make(device, num_layers=1)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="v"):
        cache.update(0, put(device, _good()), put(device, rand((B, H, 2, D - 1), 1)))
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("args, exc, match", [
    ((L,), IndexError, r"layer must be in 0\.\.2 \(num_layers=3\), got 3"),
    ((0, -1), ValueError, "start must be >= 0, got -1"),
    ((0, 3, 2), ValueError, r"end must be >= start \(3\), got 2"),
    ((0, 0, 5), ValueError, r"end must be <= 4 \(the positions written in layer 0\), got 5"),
    ((0, 5), ValueError, r"end must be >= start \(5\), got 4"),
    ((0, 0.0), TypeError, "start must be an int"),
    ((0, 0, "4"), TypeError, "end must be an integer, got str"),
])
def test_bad_get(device, args, exc, match):
    cache = make(device)
    x = rand((B, H, 4, D), 1)
    cache.update(0, put(device, x), put(device, x))
    with pytest.raises(exc, match=match):
        cache.get(*args)
    with pytest.raises(ValueError, match="dtype must be one of"):
        cache.get(0, dtype="int4")
    assert cache.get(0, 4)[0].shape == (B, H, 0, D)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_layers=0), ValueError, "num_layers must be a positive integer, got 0"),
    (dict(num_layers=2**16 + 1), ValueError, "num_layers must be at most 65536 .*got 65537"),
    (dict(num_kv_heads=-2), ValueError, "num_kv_heads must be a positive integer, got -2"),
    (dict(head_dim=64.0), TypeError, "head_dim must be an integer, got float"),
    (dict(max_seq_len=True), TypeError, "max_seq_len must be an integer, got bool"),
    (dict(batch_size=None), TypeError, "batch_size must be an integer, got NoneType"),
    (dict(dtype="int4"), ValueError, "dtype must be one of 'float32', 'float16', 'bfloat16'"),
    (dict(dtype=np.int32), ValueError, "dtype must be one of 'float32', .*, got int32"),
    (dict(dtype=None), TypeError, "dtype must be a dtype name or NumPy dtype, got None"),
    (dict(device="tpu"), ValueError, "device must be 'cpu' or 'cuda'"),
])
def test_bad_constructor(device, kwargs, exc, match):
    args = dict(num_layers=L, num_kv_heads=H, head_dim=D, max_seq_len=S, device=device)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        kvcore.KVCache(**args)


def test_cuda_array_on_cpu_cache_is_rejected():
    class FakeCuda:
        __cuda_array_interface__ = {}
    cache = make("cpu", num_layers=1)
    with pytest.raises(TypeError, match="k is a CUDA array"):
        cache.update(0, FakeCuda(), _good())


# ------------------------------------------------------- geometry, report
@pytest.mark.parametrize("alias, name", [
    ("f32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16"), (np.float16, "float16"),
    (np.float32, "float32"), (BF16, "bfloat16"), ("BFloat16", "bfloat16"),
])
def test_dtype_aliases(device, alias, name):
    cache = make(device, alias, num_layers=1)
    assert cache.dtype == name
    assert host(cache.key_cache(0)).dtype == {"float32": np.float32, "float16": np.float16,
                                              "bfloat16": np.uint16}[name]


def test_properties_and_repr(device):
    cache = kvcore.KVCache(4, 2, 8, 32, batch_size=3, dtype="bf16", device=device)
    assert (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.max_seq_len,
            cache.batch_size, cache.dtype) == (4, 2, 8, 32, 3, "bfloat16")
    assert cache.device.startswith(device)
    assert cache.key_cache(3).shape == (3, 2, 32, 8)
    assert cache.value_cache(0).shape == (3, 2, 32, 8)
    r = repr(cache)
    assert r.startswith("KVCache(num_layers=4, num_kv_heads=2, head_dim=8, max_seq_len=32, "
                        "batch_size=3, dtype='bfloat16', device=")
    assert r.endswith("seq_len=0)")
    with pytest.raises(IndexError, match="layer"):
        cache.key_cache(4)
    with pytest.raises(TypeError):
        len(cache)


@pytest.mark.parametrize("geom, dtype, itemsize", [
    # (num_layers, num_kv_heads, head_dim, max_seq_len, batch_size)
    ((2, 4, 64, 128, 1), "float16", 2),
    ((3, 2, 16, 50, 3), "float32", 4),
    ((1, 1, 1, 1, 1), "bfloat16", 2),
    ((5, 8, 128, 20, 2), "bf16", 2),
])
def test_memory_report_by_hand(device, geom, dtype, itemsize):
    nl, nh, hd, msl, bs = geom
    cache = kvcore.KVCache(nl, nh, hd, msl, batch_size=bs, dtype=dtype, device=device)
    per_token_layer = 2 * bs * nh * hd * itemsize          # K and V, whole batch
    per_token = nl * per_token_layer
    rep = cache.memory_report()
    assert rep["bytes_per_token"] == per_token
    assert rep["bytes_per_token_per_layer"] == per_token_layer
    assert rep["bytes_per_layer"] == per_token_layer * msl
    assert rep["allocated_bytes"] == per_token * msl
    assert rep["allocated_bytes"] == sum(
        host(cache.key_cache(i)).nbytes + host(cache.value_cache(i)).nbytes for i in range(nl))
    assert rep["used_bytes"] == 0 and rep["unused_bytes"] == rep["allocated_bytes"]
    assert (rep["num_layers"], rep["num_kv_heads"], rep["head_dim"], rep["max_seq_len"],
            rep["batch_size"], rep["itemsize"]) == (nl, nh, hd, msl, bs, itemsize)
    assert rep["dtype"] == cache.dtype and rep["device"] == cache.device
    n = msl // 2 + 1
    x = rand((bs, nh, n, hd), 1)
    for layer in range(nl):
        cache.update(layer, put(device, x), put(device, x))
    if n < msl:   # one layer a step ahead: seq_len stays n, free_positions drops
        cache.update(0, put(device, x[:, :, :1]), put(device, x[:, :, :1]))
    rep = cache.memory_report()
    assert rep["seq_len"] == (n if nl > 1 or n == msl else n + 1)
    seq_len = rep["seq_len"]
    assert rep["used_bytes"] == seq_len * per_token
    assert rep["unused_bytes"] == (msl - seq_len) * per_token
    assert rep["utilization"] == pytest.approx(seq_len / msl)
    assert rep["free_positions"] == msl - max(cache.layer_lengths)


def test_memory_report_known_model(device):
    """Llama-3-8B-like geometry, float16: 128 KiB per position."""
    cache = kvcore.KVCache(32, 8, 128, 16, dtype="float16", device=device)
    rep = cache.memory_report()
    assert rep["bytes_per_token"] == 131072
    assert rep["allocated_bytes"] == 16 * 131072
