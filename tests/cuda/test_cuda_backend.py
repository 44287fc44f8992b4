"""The CUDA backend on a real GPU (skipped without CuPy and a visible GPU).

The shared cases of ``_cuda_cases.py`` (bit-exact against the CPU backend:
conversions over millions of patterns and every half pattern, paged writes
and gathers over head dims 64/128/256 (and odd ones for the scalar path),
block sizes 8/16/32, every kind pair, slot mappings with -1s, batched
gathers, block copies, contiguous writes) run here with ``CudaBackend``;
the cases below need the GPU itself: zero-copy interop, host arrays refused,
streams and CUDA graphs, host <-> device block copies, the public conversion
functions on CuPy arrays, and NVRTC compiling every module on the device.
"""
import numpy as np
import pytest

from kvcore.backends.cuda import get_cuda_backend

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_env import cuda_backend_or_skip
except ImportError:
    from _cuda_env import cuda_backend_or_skip

# Skips the module only without CuPy or without a GPU; fails it when both
# are there but the backend does not work.
cuda_backend_or_skip(allow_module_level=True)

import cupy  # noqa: E402

import kvcore  # noqa: E402
from kvcore.backends import CPU, get_backend  # noqa: E402
from kvcore.backends.cuda import _sources, attention_kernels  # noqa: E402
from kvcore.dtypes import BF16, F16, F32  # noqa: E402
from kvcore.backends.codec import Codec  # noqa: E402

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_cases import *  # noqa: F401,F403,E402
    from ._cuda_cases import assert_bits_equal, cupy_device_under_test, rand_bits  # noqa
    from ._cuda_cases import cupy_put as _put  # noqa: E402
except ImportError:
    from _cuda_cases import *  # noqa: F401,F403,E402
    from _cuda_cases import assert_bits_equal, cupy_device_under_test, rand_bits  # noqa
    from _cuda_cases import cupy_put as _put  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def be():
    return get_cuda_backend("cuda")


@pytest.fixture
def dev(be):
    return cupy_device_under_test(
        be, 1 << 22, foreign=[lambda a: _CAIOnly(_put(a)), lambda a: _DLPackOnly(_put(a))])


# ------------------------------------------------------------ the backend

def test_get_backend_gives_one_cuda_backend_per_device(be):
    dev_id = cupy.cuda.runtime.getDevice()
    assert get_backend("cuda") is be
    assert get_backend(f"cuda:{dev_id}") is be
    assert be.name == "cuda" and be.xp is cupy
    assert be.normalize_device("cuda") == f"cuda:{dev_id}"


def test_every_module_compiles_on_this_device(be):
    with cupy.cuda.Device(be.device_id):
        for file, sk, dk, names in _sources.modules():
            for name in names:
                assert be.launcher.function(file, sk, dk, name) is not None
        # attention.cu: one module per page kind, one of merge kernels
        for _key, names in attention_kernels.modules():
            for name in names:
                assert be.launcher.function(attention_kernels.ATTENTION_FILE.name, None, None,
                                    name) is not None


def test_empty_zeros_from_host_to_host(be):
    a = be.empty((3, 4), np.float16)
    z = be.zeros((2, 5), np.uint16)
    assert isinstance(a, cupy.ndarray) and a.dtype == np.float16 and a.shape == (3, 4)
    assert isinstance(z, cupy.ndarray) and not z.any()
    host = rand_bits(np.random.default_rng(0), (7, 9), F32)
    d = be.from_host(host)
    assert isinstance(d, cupy.ndarray)
    back = be.to_host(d)
    assert isinstance(back, np.ndarray)
    assert_bits_equal(back, host)
    assert be.from_host(d) is d and be.to_host(back) is back


# --------------------------------------------------------------- asarray

class _CAIOnly:
    """Exposes a CuPy array through __cuda_array_interface__ only."""

    def __init__(self, a):
        self._a = a

    @property
    def __cuda_array_interface__(self):
        return self._a.__cuda_array_interface__


class _DLPackOnly:
    """Exposes an array through the DLPack protocol only."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_asarray_takes_cuda_arrays_without_copying(be):
    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    assert be.asarray(a, "k") is a
    for wrapped in (_CAIOnly(a), _DLPackOnly(a)):
        got = be.asarray(wrapped, "k")
        assert isinstance(got, cupy.ndarray)
        assert got.data.ptr == a.data.ptr and got.shape == a.shape and got.dtype == a.dtype


def test_asarray_takes_torch_cuda_tensors_without_copying(be):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.arange(24, dtype=torch.float16, device="cuda").reshape(2, 3, 4)
    got = be.asarray(t, "k")
    assert got.data.ptr == t.data_ptr() and got.shape == (2, 3, 4) and got.dtype == np.float16
    got[0, 0, 0] = 7
    torch.cuda.synchronize()
    assert float(t[0, 0, 0]) == 7.0


@pytest.mark.parametrize("host", [np.zeros(3, np.float32), [1.0, 2.0], 3.0,
                                  _DLPackOnly(np.zeros(3, np.float32))],
                         ids=["numpy", "list", "scalar", "dlpack-cpu"])
def test_host_data_is_a_type_error_naming_the_argument(be, host):
    with pytest.raises(TypeError, match="my_arg"):
        be.asarray(host, "my_arg")
    with pytest.raises(TypeError, match="out"):
        be.check_out(host, "out")


# ------------------------------------------------------ streams and graphs

def test_kernels_run_on_the_current_stream_and_capture_into_a_graph(be):
    """A paged write and a gather captured into a CUDA graph, replayed on new
    data: proves every launch went to the capturing (current) stream and
    that nothing synchronized (both are errors during capture)."""
    rng = np.random.default_rng(11)
    heads, bs, dim = 2, 16, 128
    slots_h = np.array([5, -1, 17, 40, 33], np.int64)
    table_h = np.array([0, 1, 2], np.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cache = cupy.zeros((4, heads, bs, dim), cupy.float16)
        src = cupy.asarray(rand_bits(rng, (5, heads, dim), F32))
        slots, table = cupy.asarray(slots_h), cupy.asarray(table_h)
        out = cupy.zeros((heads, 48, dim), cupy.float32)
        # warm-up outside the capture: compiles and loads the modules
        be.write_slots(cache, src, slots, F32, Codec(F16))
        be.gather(cache, table, 0, 48, out, Codec(F16), F32)
        stream.synchronize()
        stream.begin_capture()
        be.write_slots(cache, src, slots, F32, Codec(F16))
        be.gather(cache, table, 0, 48, out, Codec(F16), F32)
        graph = stream.end_capture()
        new_src = rand_bits(rng, (5, heads, dim), F32)
        src.set(new_src, stream=stream)
        cache.fill(0)
        graph.launch(stream=stream)
    stream.synchronize()
    want_cache = np.zeros((4, heads, bs, dim), np.float16)
    CPU.write_slots(want_cache, new_src, slots_h, F32, Codec(F16))
    want_out = np.zeros((heads, 48, dim), np.float32)
    CPU.gather(want_cache, table_h, 0, 48, want_out, Codec(F16), F32)
    assert_bits_equal(cupy.asnumpy(cache), want_cache)
    assert_bits_equal(cupy.asnumpy(out), want_out)


# ------------------------------------------------- host <-> device blocks

@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("planes", [1, 6])
def test_copy_blocks_between_host_and_device(be, pinned, planes):
    import cupyx

    rng = np.random.default_rng([12, planes])
    geometry = (2, 16, 64)
    dev_storage = rand_bits(rng, (planes, 10, *geometry), BF16)
    host_storage = rand_bits(rng, (planes, 7, *geometry), BF16)
    if pinned:
        h = cupyx.empty_pinned(host_storage.shape, host_storage.dtype)
        h[...] = host_storage
    else:
        h = host_storage.copy()
    d = cupy.asarray(dev_storage)
    # offload: runs of consecutive ids are merged into one copy
    src, dst = np.array([2, 3, 4, 9, 0]), np.array([0, 1, 2, 6, 4])
    want_h = host_storage.copy()
    want_h[:, dst] = dev_storage[:, src]
    be.copy_blocks_between(d, src, h, dst)
    be.synchronize()
    assert_bits_equal(np.asarray(h), want_h)
    # and back into other blocks of the pool (ids given on the device)
    back_src, back_dst = np.array([6, 0, 1]), np.array([5, 7, 8])
    want_d = dev_storage.copy()
    want_d[:, back_dst] = want_h[:, back_src]
    be.copy_blocks_between(h, cupy.asarray(back_src), d, cupy.asarray(back_dst))
    be.synchronize()
    assert_bits_equal(cupy.asnumpy(d), want_d)


def test_copy_blocks_between_checks_host_ids_and_geometry(be):
    d = cupy.zeros((2, 4, 2, 8, 64), cupy.float16)
    h = np.zeros((2, 3, 2, 8, 64), np.float16)
    with pytest.raises(IndexError, match="dst_ids"):
        be.copy_blocks_between(d, [0], h, [3])
    with pytest.raises(IndexError, match="src_ids"):
        be.copy_blocks_between(d, [4], h, [0])
    with pytest.raises(ValueError, match="geometry"):
        be.copy_blocks_between(d, [0], np.zeros((2, 3, 2, 8, 32), np.float16), [0])
    with pytest.raises(TypeError, match="dtype"):
        be.copy_blocks_between(d, [0], np.zeros((2, 3, 2, 8, 64), np.float32), [0])


# ------------------------------------------------ public API on CuPy arrays

def test_public_conversions_accept_cupy_arrays():
    rng = np.random.default_rng(13)
    x = rand_bits(rng, (257, 3), F32)
    h = kvcore.to_float16(cupy.asarray(x))
    b = kvcore.to_bfloat16(cupy.asarray(x))
    assert isinstance(h, cupy.ndarray) and isinstance(b, cupy.ndarray)
    assert_bits_equal(cupy.asnumpy(h), kvcore.to_float16(x))
    assert_bits_equal(cupy.asnumpy(b), kvcore.to_bfloat16(x))
    assert_bits_equal(cupy.asnumpy(kvcore.from_float16(h)), kvcore.from_float16(cupy.asnumpy(h)))
    assert_bits_equal(cupy.asnumpy(kvcore.from_bfloat16(b)),
                      kvcore.from_bfloat16(cupy.asnumpy(b)))
    out = cupy.empty((257, 3), cupy.float16)
    assert kvcore.to_float16(cupy.asarray(x), out=out) is out
    with pytest.raises(TypeError, match="out"):
        kvcore.to_float16(cupy.asarray(x), out=np.empty((257, 3), np.float16))


# ----------------------------------------------------- BlockPool.write

def test_pool_write_with_device_slots_captures_into_a_graph(be):
    """pool.write(..., check=False) with device slots syncs with nothing and
    copies nothing between host and device: it captures into a CUDA graph,
    and a replay reads the slots' new values (a repeated slot included)."""
    rng = np.random.default_rng(25)
    heads, bs, dim = 2, 16, 128
    pool = kvcore.BlockPool(6, bs, 1, heads, dim, dtype="bfloat16", device=be.device)
    ref = kvcore.BlockPool(6, bs, 1, heads, dim, dtype="bfloat16")
    # no deviceSynchronize() here: the pool's fill is complete when it is
    # handed out, so a write on a non-blocking stream cannot race it (issue 23)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        k = cupy.asarray(rand_bits(rng, (4, heads, dim), F32))
        v = cupy.asarray(rand_bits(rng, (4, heads, dim), F32))
        slots = cupy.asarray(np.array([5, -1, 17, 40], np.int64))
        pool.write(0, k, v, slots, check=False)  # warm-up: compiles and loads the modules
        stream.synchronize()
        stream.begin_capture()
        pool.write(0, k, v, slots, check=False)
        graph = stream.end_capture()
        new_k, new_v = rand_bits(rng, (4, heads, dim), F32), rand_bits(rng, (4, heads, dim), F32)
        new_slots = np.array([90, 3, 90, 64], np.int64)
        k.set(new_k, stream=stream)
        v.set(new_v, stream=stream)
        slots.set(new_slots, stream=stream)
        pool.storage.fill(0)
        graph.launch(stream=stream)
    stream.synchronize()
    ref.write(0, new_k, new_v, new_slots)
    assert_bits_equal(cupy.asnumpy(pool.storage), ref.storage)


def test_pool_write_checks_device_slots_with_one_small_read(be):
    pool = kvcore.BlockPool(4, 8, 1, 1, 64, device=be.device)
    k = cupy.zeros((3, 1, 64), cupy.float32)
    with pytest.raises(IndexError, match=r"got 32 at index 1"):
        pool.write(0, k, k, cupy.asarray(np.array([0, 32, 5], np.int64)))
    with pytest.raises(IndexError, match=r"got -7 at index 2"):
        pool.write(0, k, k, cupy.asarray(np.array([0, 1, -7], np.int32)))


def test_pool_takes_torch_index_tensors(be):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(26)
    pool = kvcore.BlockPool(8, 4, 1, 2, 64, device=be.device)
    ref = kvcore.BlockPool(8, 4, 1, 2, 64)
    k, v = rand_bits(rng, (3, 2, 64), F32), rand_bits(rng, (3, 2, 64), F32)
    ref.write(0, k, v, [4, 9, 30])
    for slots in (torch.tensor([4, 9, 30], device="cuda"), torch.tensor([4, 9, 30])):
        pool.write(0, cupy.asarray(k), cupy.asarray(v), slots)
        assert_bits_equal(cupy.asnumpy(pool.storage), ref.storage)
    for table in (torch.tensor([2, 1, 7], dtype=torch.int32, device="cuda"),
                  torch.tensor([2, 1, 7], dtype=torch.int32)):
        for a, b in zip(pool.gather(0, table, 0, 11), ref.gather(0, [2, 1, 7], 0, 11)):
            assert_bits_equal(cupy.asnumpy(a), b)


def test_kvcache_update_takes_ml_dtypes_bfloat16(be):
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(27)
    x = rand_bits(rng, (1, 2, 5, 64), BF16).view(bf16)
    cpu = kvcore.KVCache(1, 2, 64, 16, dtype="float32")
    gpu = kvcore.KVCache(1, 2, 64, 16, dtype="float32", device=be.device)
    cpu.update(0, x, x)
    gpu.update(0, be.from_host(x), cupy.asarray(x.view(np.uint16)).view(bf16))
    for a, b in zip(cpu.get(0), gpu.get(0)):
        assert_bits_equal(cupy.asnumpy(b), a)


# ------------------------------------- issue 23: streams, host memory, ftz

def test_layers_written_on_two_streams_at_once_keep_their_k_and_v(be):
    """Two layers written with the same slots on two non-blocking streams:
    each write claims and releases in its own layer's owner table, so
    neither release can reset the other's claims (which dropped K/V)."""
    rng = np.random.default_rng(230)
    heads, bs, dim, n = 8, 16, 128, 4096
    pool = kvcore.BlockPool(n // bs + 4, bs, 2, heads, dim, dtype="float16", device=be.device)
    ref = kvcore.BlockPool(n // bs + 4, bs, 2, heads, dim, dtype="float16")
    slots = rng.permutation(pool.num_blocks * bs)[:n].astype(np.int64)
    kv = [(rand_bits(rng, (n, heads, dim), F16), rand_bits(rng, (n, heads, dim), F16))
          for _ in range(2)]
    d_kv = [(cupy.asarray(k), cupy.asarray(v)) for k, v in kv]
    d_slots = cupy.asarray(slots)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    cupy.cuda.runtime.deviceSynchronize()   # inputs in place before either stream starts
    for _ in range(20):
        for layer, stream in enumerate(streams):
            with stream:
                pool.write(layer, *d_kv[layer], d_slots, check=False)
    for stream in streams:
        stream.synchronize()
    for layer in range(2):
        ref.write(layer, *kv[layer], slots)
    assert_bits_equal(cupy.asnumpy(pool.storage), ref.storage)


def test_an_upload_from_a_temporary_is_not_disturbed_by_its_reuse(be):
    """Host arrays copied up are staged through pinned memory (CuPy issue
    #6785): overwriting (or freeing) the host array right after the call
    does not change what arrives."""
    rng = np.random.default_rng(231)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        busy = cupy.zeros(1 << 26, cupy.float32)
        outs, wants = [], []
        for _ in range(8):
            busy *= 1.0001          # keep the stream busy so the copies queue up
            h = rand_bits(rng, (1 << 16,), F32)
            wants.append(h.copy())
            outs.append(be.from_host(h))
            h[...] = 0
    stream.synchronize()
    for got, want in zip(outs, wants):
        assert_bits_equal(cupy.asnumpy(got), want)


def test_copy_blocks_to_pageable_host_memory_is_complete_on_return(be):
    rng = np.random.default_rng(232)
    dev_storage = rand_bits(rng, (4, 64, 8, 16, 128), F16)
    d = cupy.asarray(dev_storage)
    h = np.zeros((4, 64, 8, 16, 128), np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        busy = cupy.zeros(1 << 26, cupy.float32)
        busy *= 1.0001
        be.copy_blocks_between(d, np.arange(64)[::-1].copy(), h, np.arange(64))
        got = h.copy()   # read at once, no synchronize()
    assert_bits_equal(got, dev_storage[:, ::-1])


@pytest.mark.parametrize("kind", [F32, BF16])
def test_attention_keeps_subnormal_values_as_the_cpu_does(be, kind):
    """CuPy compiles with -ftz=true; attention.cu uses the PTX without .ftz,
    so subnormal V (and K) elements are not read as 0 (issue 23, item 4)."""
    heads, bs, dim, nb = 2, 16, 64, 4
    tiny = np.float32(2.0 ** -130)                     # subnormal in float32 and bf16
    rng = np.random.default_rng(233)
    vals = (rng.integers(1, 8, size=(2, nb, heads, bs, dim)) * tiny).astype(np.float32)
    pages = vals if kind == F32 else (vals.view(np.uint32) >> 16).astype(np.uint16)
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    tables = np.array([[2, 0, 3]], np.int32)
    lens, qsl = np.array([40], np.int64), np.array([0, 1], np.int64)
    from kvcore.backends.base import paged_attention_reference

    want = np.asarray(paged_attention_reference(
        q, pages[0], pages[1], tables, lens, qsl, scale=0.125,
        kind="float32" if kind == F32 else "bfloat16"), np.float64)
    assert (want != 0).all()
    out = cupy.zeros(q.shape, cupy.float32)
    be.paged_attention(cupy.asarray(q), out, cupy.asarray(pages[0]), cupy.asarray(pages[1]),
                       kind, tables, lens, qsl, 0.125, 0, 0.0)
    got = cupy.asnumpy(out)
    assert (got != 0).all()
    # the contract's 1e-5 relative (max abs error / max abs value); a value
    # flushed to zero is off by all of it
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("q_dtype", ["float32", "float16"])
def test_a_32_layer_decode_step_captures_into_a_graph_and_replays_the_same_bits(be, q_dtype):
    """Issue 23, item 6: with the attention plan made once (its metadata on
    the device), a decode step of 32 layers of ``pool.write(check=False)``
    and ``attention_run`` copies nothing and syncs nothing: it captures into
    a CUDA graph, and a replay gives the bits of the step run directly.
    float16 q and out run the tensor-core decode (issue 41), whose splits
    are merged by the last block's ticket: the tickets are reset for the
    replay."""
    rng = np.random.default_rng(234)
    layers, heads, kv_heads, bs, dim, batch, ctx = 32, 8, 2, 16, 128, 4, 100
    per_seq = -(-ctx // bs)
    nblk = batch * per_seq + 1
    pool = kvcore.BlockPool(nblk, bs, layers, kv_heads, dim, dtype="float16", device=be.device)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, ctx, np.int64)
    qsl = np.arange(batch + 1, dtype=np.int64)
    hist = rng.standard_normal((batch * per_seq * bs, kv_heads, dim)).astype(np.float32)
    for layer in range(layers):   # the context before this step
        pool.write(layer, cupy.asarray(hist), cupy.asarray(hist[::-1].copy()),
                   np.arange(len(hist)))
    plan = be.attention_plan(tables, lens, qsl, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=dim, block_size=bs, num_blocks=nblk, kind=F16,
                             scale=dim ** -0.5, sliding_window=0, soft_cap=0.0)
    cupy.cuda.runtime.deviceSynchronize()   # the setup above ran on the legacy stream
    slots_h = tables[:, (ctx - 1) // bs].astype(np.int64) * bs + (ctx - 1) % bs
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q = cupy.asarray(rng.standard_normal((layers, batch, heads, dim)).astype(q_dtype))
        k = cupy.asarray(rng.standard_normal((layers, batch, kv_heads, dim)).astype(np.float32))
        v = cupy.asarray(rng.standard_normal((layers, batch, kv_heads, dim)).astype(np.float32))
        slots = cupy.asarray(slots_h)
        outs = cupy.zeros((layers, batch, heads, dim), q_dtype)

        def step():
            for layer in range(layers):
                pool.write(layer, k[layer], v[layer], slots, check=False)
                be.attention_run(plan, q[layer], outs[layer], pool.storage[2 * layer],
                                 pool.storage[2 * layer + 1])

        step()   # warm-up: compiles the kernels, makes each layer's owner table
        stream.synchronize()
        want, want_storage = cupy.asnumpy(outs), cupy.asnumpy(pool.storage)
        outs.fill(0)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        graph.launch(stream=stream)
    stream.synchronize()
    assert (want != 0).any()
    assert_bits_equal(cupy.asnumpy(outs), want)
    assert_bits_equal(cupy.asnumpy(pool.storage), want_storage)
    if q_dtype == "float16":
        assert plan.tc_items is not None and int(plan.tc_nsplit.max()) > 1
        assert not cupy.asnumpy(plan.counters).any()
