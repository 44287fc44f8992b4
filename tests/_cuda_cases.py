"""Test bodies for the CUDA backend, shared by two runners.

``test_cuda_backend.py`` runs them on a real GPU (CuPy); without one,
``test_cuda_host_emulation.py`` runs them on the host, with the kernels'
C++ bodies compiled by the host compiler behind the same ``CudaBackend``
methods.  Every case compares the device backend with the CPU backend bit for
bit.  A runner provides a ``dev`` fixture (a ``DeviceUnderTest``) and does
``from _cuda_cases import *``.
"""
import array

import ml_dtypes
import numpy as np
import pytest

from kvcore import dtypes
from kvcore.backends import CPU
from kvcore.backends.base import REFERENCE
from kvcore.dtypes import BF16, F16, F32, F8E4M3, F8E5M2, I8, STORAGE
from kvcore.backends.codec import Codec

KINDS = (F32, F16, BF16)
PAIRS = [(s, d) for s in KINDS for d in KINDS]
PAIR_IDS = [f"{'f32 f16 bf16'.split()[s]}-{'f32 f16 bf16'.split()[d]}" for s, d in PAIRS]
HEAD_DIMS = (64, 128, 256, 60, 33)  # 60 and 33: the scalar (non-vector) path
BLOCK_SIZES = (8, 16, 32)


class DeviceUnderTest:
    """What a case needs of a device.

    be : the backend under test (CudaBackend or its host emulation)
    put(a) : a device copy of NumPy array ``a`` (C-contiguous, same bits)
    get(d) : a NumPy copy of device array ``d``
    n_random : how many random bit patterns the conversion cases try
    foreign : functions making a device copy of ``a`` that is not a CuPy
        array (only ``__cuda_array_interface__``, only DLPack, ...), as
        torch CUDA tensors present themselves
    """

    def __init__(self, be, put, get, n_random, foreign=()):
        self.be, self.put, self.get, self.n_random = be, put, get, n_random
        self.foreign = tuple(foreign)


def cupy_put(a):
    """A CuPy copy of NumPy array ``a`` on the current GPU (the GPU runners'
    ``put``)."""
    import cupy   # only the GPU runners call it, after their CuPy check

    a = np.asarray(a)
    return cupy.asarray(np.ascontiguousarray(a).reshape(a.shape))  # keeps a 0-d array 0-d


def cupy_device_under_test(be, n_random, foreign=()):
    """The ``DeviceUnderTest`` of a GPU runner: CuPy copies in and out."""
    import cupy

    return DeviceUnderTest(be, cupy_put, cupy.asnumpy, n_random, foreign)


# ------------------------------------------------------------------ data

def _bits_view(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.itemsize])


def assert_bits_equal(got, want):
    """Same shape, dtype and bits (NaN payloads included)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    g, w = _bits_view(got).ravel(), _bits_view(want).ravel()
    bad = np.flatnonzero(g != w)
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"{bad.size} of {g.size} elements differ; first at flat index {i} "
            f"(index {np.unravel_index(i, got.shape) if got.ndim else ()}): "
            f"got {int(g[i]):#x}, want {int(w[i]):#x}")


def rand_bits(rng, shape, kind):
    """Uniformly random bit patterns in the storage dtype of ``kind``
    (NaNs, infinities and subnormals included)."""
    if kind == F32:
        return rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.float32)
    bits = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    return bits.view(np.float16) if kind == F16 else bits


# float32 bit patterns at the edges of float16/bfloat16 rounding.
F32_EDGES = np.array([
    0x00000000, 0x80000000,                          # +-0
    0x7f800000, 0xff800000,                          # +-inf
    0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,  # quiet / signalling NaNs
    0x7fbfffff, 0x7fffffff, 0xffffffff, 0x7fa00000, 0x7f802000, 0x7f801fff,
    0x00000001, 0x80000001, 0x007fffff, 0x00800000,  # float32 subnormals, min normal
    0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7f7fff,  # max finite (bf16 overflow ties)
    0x477fe000, 0x477fefff, 0x477ff000, 0x477fffff, 0x47800000,  # f16 max / overflow
    0x38800000, 0x387fffff, 0x387fe000, 0x387ff000,  # f16 min normal
    0x33000000, 0x33000001, 0x32ffffff, 0x33800000, 0x337fffff, 0x33400000,  # 2^-25 ..
    0x3f800000, 0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001,  # f16 ties at 1.0
    0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001,  # bf16 ties at 1.0
    0x3f7fffff, 0x3fffffff, 0x40000000,
], dtype=np.uint32)


def f32_patterns(rng, n):
    """Edge values, ties and subnormal-range ties for both narrowings, NaN
    payloads of both signs, then uniformly random patterns."""
    parts = [F32_EDGES]
    r = rng.integers(0, 2**32, size=4096, dtype=np.uint32)
    for low in (0x0fff, 0x1000, 0x1001):  # f16 ties / near-ties (13 dropped bits)
        parts.append((r & ~np.uint32(0x1fff)) | np.uint32(low))
    for low in (0x7fff, 0x8000, 0x8001):  # bf16 ties / near-ties (16 dropped bits)
        parts.append((r & ~np.uint32(0xffff)) | np.uint32(low))
    # half-subnormal range (exponents 102..112) with exact ties at every shift
    e = rng.integers(102, 113, size=4096).astype(np.uint32)
    mant = rng.integers(0, 2**23, size=4096, dtype=np.uint32)
    shift = np.uint32(126) - e
    one = np.uint32(1)
    tie = (mant & ~((one << shift) - one)) | (one << (shift - one))
    tie &= np.uint32(0x7fffff)
    sign = (rng.integers(0, 2, size=4096, dtype=np.uint32) << np.uint32(31))
    parts += [sign | (e << np.uint32(23)) | mant, sign | (e << np.uint32(23)) | tie]
    # NaNs with random payloads
    parts.append(sign | np.uint32(0x7f800000) | (mant | np.uint32(1)))
    parts.append(rng.integers(0, 2**32, size=n, dtype=np.uint32))
    return np.concatenate(parts).view(np.float32)


def half_patterns(rng, n, kind):
    """All 65,536 patterns, then random ones."""
    bits = np.concatenate([np.arange(2**16, dtype=np.uint16),
                           rng.integers(0, 2**16, size=n, dtype=np.uint16)])
    return bits.view(np.float16) if kind == F16 else bits


def cpu_convert(x, sk, dk):
    out = np.empty(x.shape, STORAGE[dk])
    CPU.convert(x, sk, out, dk)
    return out


def _filled(shape, dtype, byte=0xFF):
    """An array whose every byte is ``byte`` (a canary for unwritten places)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(n, byte, np.uint8).view(dtype).reshape(shape)


# ------------------------------------------------------------ conversion

@pytest.mark.parametrize("sk,dk", PAIRS, ids=PAIR_IDS)
def test_convert_matches_cpu(dev, sk, dk):
    rng = np.random.default_rng([1, sk, dk])
    x = f32_patterns(rng, dev.n_random) if sk == F32 else half_patterns(rng, dev.n_random, sk)
    want = cpu_convert(x, sk, dk)
    dx = dev.put(x)
    got = dev.put(np.zeros_like(want))
    dev.be.convert(dx, sk, got, dk)
    assert_bits_equal(dev.get(got), want)
    # a length that is not a multiple of the vector width, starting one
    # element in (not 16-byte aligned): the scalar path and the tail
    got2 = dev.put(np.zeros_like(want))
    dev.be.convert(dx[1:-2], sk, got2[1:-2], dk)
    want2 = np.zeros_like(want)
    want2[1:-2] = want[1:-2]
    assert_bits_equal(dev.get(got2), want2)


@pytest.mark.parametrize("fmt", [0, 1], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("saturate", [False, True])
def test_convert_fp8_matches_cpu(dev, fmt, saturate):
    """convert_fp8.cu against the CPU's kv_fp8.c, both ways, with a strided
    and an overlapping layout."""
    rng = np.random.default_rng([2, fmt, saturate])
    x = f32_patterns(rng, dev.n_random)
    want = np.empty(x.shape, np.uint8)
    CPU.convert_fp8(x, want, fmt, True, saturate)
    got = dev.put(np.zeros_like(want))
    dev.be.convert_fp8(dev.put(x), got, fmt, True, saturate)
    assert_bits_equal(dev.get(got), want)
    codes = np.concatenate([np.arange(256, dtype=np.uint8), want])
    wide = np.empty(codes.shape, np.float32)
    CPU.convert_fp8(codes, wide, fmt, False)
    got_wide = dev.put(np.zeros_like(wide))
    dev.be.convert_fp8(dev.put(codes), got_wide, fmt, False)
    assert_bits_equal(dev.get(got_wide), wide)
    # strided input and output, lengths not a multiple of 4
    m = (x.size - 2) // 3
    out = dev.put(np.zeros(x.size, np.uint8))
    dev.be.convert_fp8(dev.put(x)[1::3][:m], out[2::3][:m], fmt, True, saturate)
    np.testing.assert_array_equal(dev.get(out)[2::3][:m], want[1::3][:m])
    assert not dev.get(out)[0::3].any()
    # fp8 codes widened into the float32 array that holds them
    buf = dev.put(np.zeros(257, np.float32))
    src = buf.view(np.uint8)[-257:]
    src[...] = dev.put(codes[:257])
    dev.be.convert_fp8(src, buf, fmt, False)
    assert_bits_equal(dev.get(buf), wide[:257])


# (kind, input bits, output kind, output bits): the NaN and rounding rules of
# kv_half.c, spelled out independently of the CPU backend.
KNOWN = [
    (F32, 0x7f800001, F16, 0x7e00), (F32, 0xff800001, F16, 0xfe00),
    (F32, 0x7fffffff, F16, 0x7fff), (F32, 0x7f802000, F16, 0x7e01),
    (F32, 0x7f800001, BF16, 0x7fc0), (F32, 0xffc00001, BF16, 0xffc0),
    (F32, 0x7f810000, BF16, 0x7fc1),
    (F32, 0x3f801000, F16, 0x3c00), (F32, 0x3f803000, F16, 0x3c02),
    (F32, 0x3f808000, BF16, 0x3f80), (F32, 0x3f818000, BF16, 0x3f82),
    (F32, 0x477ff000, F16, 0x7c00), (F32, 0x477fefff, F16, 0x7bff),
    (F32, 0x7f7fffff, BF16, 0x7f80), (F32, 0x33000000, F16, 0x0000),
    (F32, 0x33000001, F16, 0x0001), (F32, 0xb3800000, F16, 0x8001),
    (F16, 0x7c01, F32, 0x7fc02000), (F16, 0xfc01, F32, 0xffc02000),
    (F16, 0x0001, F32, 0x33800000), (F16, 0x83ff, F32, 0xb87fc000),
    (F16, 0x7c01, BF16, 0x7fc0), (BF16, 0x7f81, F32, 0x7f810000),
    (BF16, 0xff81, F16, 0xfe08), (BF16, 0x3f81, F16, 0x3c08),
]


def test_convert_known_bits(dev):
    for sk, x, dk, want in KNOWN:
        src = np.array([x] * 3, dtype=np.uint32 if sk == F32 else np.uint16)
        src = src.view(STORAGE[sk])
        out = dev.put(np.zeros(3, STORAGE[dk]))
        dev.be.convert(dev.put(src), sk, out, dk)
        got = _bits_view(dev.get(out))
        assert all(int(g) == want for g in got), (
            sk, hex(x), dk, [hex(int(g)) for g in got], hex(want))


@pytest.mark.parametrize("layout", ["transposed", "strided_dst", "negative", "zero_d", "empty",
                                    "in_place", "shifted_overlap", "broadcast"])
def test_convert_layouts(dev, layout):
    rng = np.random.default_rng(7)
    xp = dev.be.xp
    if layout == "in_place":
        # f16 -> bf16 into the very same memory
        buf = rand_bits(rng, (37, 5), F16)
        want = cpu_convert(buf, F16, BF16)
        d = dev.put(buf.view(np.uint16))
        dev.be.convert(d.view(np.float16), F16, d, BF16)
        assert_bits_equal(dev.get(d), want)
        return
    if layout == "shifted_overlap":
        buf = rand_bits(rng, 301, F16)
        for shift in (1, -1, 8, -8):
            want = buf.copy()
            s_, d_ = (slice(None, -shift), slice(shift, None)) if shift > 0 else (
                slice(-shift, None), slice(None, shift))
            want[d_] = buf[s_]
            d = dev.put(buf)
            dev.be.convert(d[s_], F16, d[d_], F16)
            assert_bits_equal(dev.get(d), want)
        return
    x = rand_bits(rng, (23, 17), F32)
    if layout == "transposed":
        src_h, src_d = x.T, dev.put(x).T
    elif layout == "negative":
        src_h, src_d = x[::-1, ::-2], dev.put(x)[::-1, ::-2]
    elif layout == "zero_d":
        src_h, src_d = x[3:4, 4:5].reshape(()), dev.put(x)[3:4, 4:5].reshape(())
    elif layout == "empty":
        src_h, src_d = x[:0], dev.put(x)[:0]
    elif layout == "broadcast":
        src_h = np.broadcast_to(x[:1], (5, 17))
        src_d = xp.broadcast_to(dev.put(x)[:1], (5, 17))
    else:  # strided_dst
        src_h, src_d = x, dev.put(x)
    want = cpu_convert(src_h, F32, F16)
    if layout == "strided_dst":
        big = dev.put(_filled((23, 34), np.float16))
        out = big[:, ::2]
        dev.be.convert(src_d, F32, out, F16)
        host_big = dev.get(big)
        assert_bits_equal(host_big[:, ::2], want)
        assert (host_big[:, 1::2].view(np.uint16) == 0xFFFF).all()  # untouched
        return
    out = dev.put(np.zeros(src_h.shape, np.float16))
    dev.be.convert(src_d, F32, out, F16)
    assert_bits_equal(dev.get(out), want)


# ------------------------------------------------------------ paged write

def _slots(rng, num_blocks, block_size, n, skip=0.15):
    slots = rng.permutation(num_blocks * block_size)[:n].astype(np.int64)
    slots[rng.random(n) < skip] = -1
    return slots


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("sk,dk", PAIRS, ids=PAIR_IDS)
def test_write_slots_matches_cpu(dev, sk, dk, head_dim, block_size):
    rng = np.random.default_rng([2, sk, dk, head_dim, block_size])
    heads, num_blocks = 2, 6
    n = num_blocks * block_size // 2 + 3
    # a pool's storage, (planes, blocks, heads, block_size, dim); write plane 1
    storage = rand_bits(rng, (2, num_blocks, heads, block_size, head_dim), dk)
    src = rand_bits(rng, (n, heads, head_dim), sk)
    slots = _slots(rng, num_blocks, block_size, n)
    want = storage.copy()
    CPU.write_slots(want[1], src, slots, sk, Codec(dk))
    for slots_arg in (slots, dev.put(slots)):  # host slots, device slots
        d = dev.put(storage)
        dev.be.write_slots(d[1], dev.put(src), slots_arg, sk, Codec(dk))
        assert_bits_equal(dev.get(d), want)


@pytest.mark.parametrize("layout", ["padded_rows", "padded_rows_odd", "heads_major",
                                    "inner_strided", "misaligned"])
@pytest.mark.parametrize("sk,dk", [(F32, F16), (F16, F16), (F32, F32), (BF16, F32), (F32, BF16)],
                         ids=["f32-f16", "f16-f16", "f32-f32", "bf16-f32", "f32-bf16"])
def test_write_slots_source_layouts(dev, sk, dk, layout):
    rng = np.random.default_rng([3, sk, dk])
    heads, head_dim, block_size, num_blocks, n = 4, 64, 16, 4, 37
    src = rand_bits(rng, (n, heads, head_dim), sk)
    if layout.startswith("padded_rows"):
        pad = 1 if layout.endswith("odd") else 8
        big = np.zeros((n, heads, head_dim + pad), src.dtype)
        big[..., :head_dim] = src
        src_d = dev.put(big)[..., :head_dim]
    elif layout == "heads_major":  # (heads, n, dim) seen as (n, heads, dim)
        src_d = dev.put(np.ascontiguousarray(src.transpose(1, 0, 2))).transpose(1, 0, 2)
    elif layout == "inner_strided":  # last axis not contiguous: copied first
        big = np.zeros((n, heads, 2 * head_dim), src.dtype)
        big[..., ::2] = src
        src_d = dev.put(big)[..., ::2]
    else:  # one element in: no 16-byte alignment, the scalar path
        flat = np.zeros(src.size + 1, src.dtype)
        flat[1:] = src.ravel()
        src_d = dev.put(flat)[1:].reshape(src.shape)
    cache = rand_bits(rng, (num_blocks, heads, block_size, head_dim), dk)
    slots = _slots(rng, num_blocks, block_size, n)
    want = cache.copy()
    CPU.write_slots(want, src, slots, sk, Codec(dk))
    d = dev.put(cache)
    dev.be.write_slots(d, src_d, slots, sk, Codec(dk))
    assert_bits_equal(dev.get(d), want)


def test_write_slots_from_a_view_of_the_cache_itself(dev):
    rng = np.random.default_rng(14)
    num_blocks, heads, block_size, head_dim = 6, 2, 8, 64
    cache = rand_bits(rng, (num_blocks, heads, block_size, head_dim), F16)
    # token t (read from block t, offset 0) is written to block t + 1 (or
    # t - 1), offset 0: the next (or previous) token's source
    slots = (np.arange(num_blocks, dtype=np.int64) + 1) % num_blocks * block_size
    slots[::2] = (np.arange(0, num_blocks, 2) - 1) % num_blocks * block_size
    want = cache.copy()
    CPU.write_slots(want, want[:, :, 0, :], slots, F16, Codec(F16))
    d = dev.put(cache)
    dev.be.write_slots(d, d[:, :, 0, :], slots, F16, Codec(F16))
    assert_bits_equal(dev.get(d), want)
    # a C-contiguous source that is the pool's own memory, read as tokens
    flat_want = cache.copy()
    src = flat_want.reshape(-1, heads, head_dim)[:num_blocks]
    CPU.write_slots(flat_want, src, slots, F16, Codec(F16))
    d = dev.put(cache)
    dev.be.write_slots(d, d.reshape(-1, heads, head_dim)[:num_blocks], slots, F16, Codec(F16))
    assert_bits_equal(dev.get(d), flat_want)


def test_write_slots_all_skipped_and_empty(dev):
    rng = np.random.default_rng(4)
    cache = rand_bits(rng, (3, 2, 8, 64), F16)
    d = dev.put(cache)
    dev.be.write_slots(d, dev.put(rand_bits(rng, (5, 2, 64), F32)), np.full(5, -1, np.int64), F32,
                       Codec(F16))
    dev.be.write_slots(d, dev.put(np.zeros((0, 2, 64), np.float32)), np.zeros(0, np.int64), F32,
                       Codec(F16))
    assert_bits_equal(dev.get(d), cache)


# ------------------------------------------- BlockPool.write: K and V

def _owner(dev, num_slots):
    return dev.be.slot_owner_table(num_slots)


def _released(dev, owner):
    """Every owner table of ``owner`` is back to -1 (ready for the next
    write), and there is at least one."""
    tables = owner.tables()
    return bool(tables) and all((dev.get(t) == -1).all() for t in tables)


def _pool_planes(rng, num_blocks, heads, block_size, head_dim, dk):
    """A two-plane (K, V) storage on the host, random bits."""
    return rand_bits(rng, (2, num_blocks, heads, block_size, head_dim), dk)


@pytest.mark.parametrize("sk,dk", [(F32, F16), (F16, F16), (F32, F32), (BF16, BF16), (F16, BF16)],
                         ids=["f32-f16", "f16-f16", "f32-f32", "bf16-bf16", "f16-bf16"])
def test_write_slots_kv_repeated_slots_keep_the_last_token(dev, sk, dk):
    """One rule on every device: of several tokens naming one slot, the
    last one's K and V land (the CPU kernel walks tokens in order)."""
    rng = np.random.default_rng([16, sk, dk])
    num_blocks, heads, block_size, head_dim = 4, 2, 8, 64
    storage = _pool_planes(rng, num_blocks, heads, block_size, head_dim, dk)
    slots = np.array([5, 9, 5, 31, -1, 9, 5, 0, 31, 9], np.int64)
    k = rand_bits(rng, (len(slots), heads, head_dim), sk)
    v = rand_bits(rng, (len(slots), heads, head_dim), sk)
    want = storage.copy()
    CPU.write_slots_kv(want[0], want[1], k, v, slots, sk, Codec(dk), Codec(dk), None, False)
    # the CPU result is the last writer's, spelled out independently
    for slot in (5, 9, 31):
        last = np.flatnonzero(slots == slot)[-1]
        b, off = divmod(slot, block_size)
        assert_bits_equal(want[0][b, :, off], cpu_convert(k[last], sk, dk))
        assert_bits_equal(want[1][b, :, off], cpu_convert(v[last], sk, dk))
    owner = _owner(dev, num_blocks * block_size)
    for slots_arg in (slots, dev.put(slots)):  # host slots, device slots
        d = dev.put(storage)
        dev.be.write_slots_kv(d[0], d[1], dev.put(k), dev.put(v), slots_arg, sk, Codec(dk),
                              Codec(dk), owner, True)
        assert_bits_equal(dev.get(d), want)
        assert _released(dev, owner)  # released for the next write


def test_write_slots_kv_reads_v_before_writing_k(dev):
    """v a view of the keys' plane (issue 9, item 2 on the GPU): it is read
    as it was at call time, not after the keys were written."""
    rng = np.random.default_rng(17)
    storage = _pool_planes(rng, 3, 2, 8, 64, F16)
    slots = np.array([1, 9, 17], np.int64)       # offset 1 of blocks 0, 1, 2
    k = rand_bits(rng, (3, 2, 64), F16)
    want = storage.copy()
    old_rows = storage[0][:, :, 1, :].copy()     # what v reads: K's offset-1 rows, before
    CPU.write_slots(want[0], k, slots, F16, Codec(F16))
    CPU.write_slots(want[1], old_rows, slots, F16, Codec(F16))
    d = dev.put(storage)
    dev.be.write_slots_kv(d[0], d[1], dev.put(k), d[0][:, :, 1, :], slots, F16, Codec(F16),
                          Codec(F16), _owner(dev, 24), True)
    assert_bits_equal(dev.get(d), want)


def test_write_slots_kv_checks_device_slots_on_the_device(dev):
    rng = np.random.default_rng(18)
    num_blocks, heads, block_size, head_dim = 3, 2, 8, 64
    num_slots = num_blocks * block_size
    storage = _pool_planes(rng, num_blocks, heads, block_size, head_dim, F16)
    good = np.array([3, -1, 20, 7], np.int64)
    k = rand_bits(rng, (4, heads, head_dim), F32)
    v = rand_bits(rng, (4, heads, head_dim), F32)
    owner = _owner(dev, num_slots)
    for bad_value, at in ((num_slots, 2), (-2, 0), (2**40, 3)):
        slots = good.copy()
        slots[at] = bad_value
        d = dev.put(storage)
        with pytest.raises(IndexError, match=rf"got {bad_value} at index {at}"):
            dev.be.write_slots_kv(d[0], d[1], dev.put(k), dev.put(v), dev.put(slots), F32,
                                  Codec(F16), Codec(F16), owner, True)
        assert_bits_equal(dev.get(d), storage)        # nothing written
        assert _released(dev, owner)
        # unchecked (the CUDA-graph call): no error, the bad token is skipped,
        # the others land, nothing outside the pool is touched
        want = storage.copy()
        skip = slots.copy()
        skip[at] = -1
        CPU.write_slots_kv(want[0], want[1], k, v, skip, F32, Codec(F16), Codec(F16), None, False)
        d = dev.put(storage)
        dev.be.write_slots_kv(d[0], d[1], dev.put(k), dev.put(v), dev.put(slots), F32, Codec(F16),
                              Codec(F16), owner, False)
        assert_bits_equal(dev.get(d), want)
        assert _released(dev, owner)


def test_device_slots_reads_metadata_only(dev):
    be = dev.be
    assert be.device_slots(np.arange(3), 3) is None      # host data: checked on the host
    assert be.device_slots([0, 1, 2], 3) is None
    got = be.device_slots(dev.put(np.array([4, -1, 2], np.int32)), 3)
    assert be._is_device(got) and got.dtype == np.int64 and got.flags.c_contiguous
    assert dev.get(got).tolist() == [4, -1, 2]
    for wrap in dev.foreign:
        got = be.device_slots(wrap(np.array([1, 0], np.int64)), 2)
        assert dev.get(got).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"slots must be 1-D of length 4"):
        be.device_slots(dev.put(np.arange(3)), 4)
    with pytest.raises(ValueError, match=r"slots must be 1-D of length 3"):
        be.device_slots(dev.put(np.zeros((3, 1), np.int64)), 3)
    with pytest.raises(TypeError, match="slots must hold integers, got dtype float32"):
        be.device_slots(dev.put(np.zeros(3, np.float32)), 3)
    with pytest.raises(TypeError, match="uint64"):
        be.device_slots(dev.put(np.zeros(3, np.uint64)), 3)


# --------------------------------------------------- host <-> device data

def test_from_host_keeps_the_dtype_bfloat16_included(dev):
    """ml_dtypes.bfloat16 stays bfloat16 on the device, so it is read as
    bfloat16 (not as uint16 bits, which need src_dtype)."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(19)
    host = rand_bits(rng, (3, 5), BF16).view(bf16)
    d = dev.be.from_host(host)
    assert dev.be._is_device(d) and d.dtype == bf16 and d.shape == (3, 5)
    assert dtypes.array_kind(d, "k") == BF16
    assert_bits_equal(dev.get(dtypes.as_bits(d)), host.view(np.uint16))
    back = dev.be.to_host(d)
    assert back.dtype == bf16
    assert_bits_equal(back.view(np.uint16), host.view(np.uint16))
    for a in (rand_bits(rng, (4,), F32), rand_bits(rng, (2, 3), F16), np.arange(5, dtype=np.int32),
              host[:, ::2]):
        d = dev.be.from_host(a)
        assert d.dtype == a.dtype and d.flags.c_contiguous
        assert_bits_equal(dev.be.to_host(d), np.ascontiguousarray(a))


class _ArrayOnly:
    """Host data exposing only ``__array__`` (as a torch CPU tensor does)."""

    def __init__(self, a):
        self._a = np.asarray(a)

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


class _CPUDLPackOnly:
    """Host data exposing only DLPack on the CPU."""

    def __init__(self, a):
        self._a = np.asarray(a)

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_to_host_takes_what_the_cpu_pool_takes(dev):
    """Index arguments (slots, tables, lengths) read on the host."""
    want = [3, 1, 4, 1, 5]
    host_forms = [want, tuple(want), range(3, 8), array.array("q", want), array.array("i", want),
                  np.array(want, np.int32), _ArrayOnly(want), _CPUDLPackOnly(want),
                  np.array(want)[::-1][::-1]]
    for x in host_forms:
        got = dev.be.to_host(x)
        assert isinstance(got, np.ndarray) and not dev.be._is_device(got), type(x)
        assert got.tolist() == (list(range(3, 8)) if isinstance(x, range) else want), type(x)
    device_forms = [dev.put(np.array(want, np.int64))] + [f(np.array(want)) for f in dev.foreign]
    for x in device_forms:
        got = dev.be.to_host(x)
        assert type(got) is np.ndarray and got.tolist() == want, type(x)
    assert dev.be.to_host([]).size == 0
    with pytest.raises(TypeError, match="could not be taken as a CUDA array"):
        dev.be.to_host(_Unreadable())


class _Unreadable:
    """Says it is a CUDA array but cannot be read as one."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *args, **kwargs):
        raise BufferError("cannot export")


# ----------------------------------------------------------------- gather

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("sk,dk", PAIRS, ids=PAIR_IDS)
def test_gather_matches_cpu(dev, sk, dk, head_dim, block_size):
    rng = np.random.default_rng([5, sk, dk, head_dim, block_size])
    heads, num_blocks, used = 2, 7, 5
    storage = rand_bits(rng, (2, num_blocks, heads, block_size, head_dim), sk)
    table = rng.permutation(num_blocks)[:used].astype(np.int32)
    total = used * block_size
    d_storage = dev.put(storage)
    d_table = dev.put(table)
    ranges = [(0, total), (1, total - 1), (block_size - 1, block_size + 1), (3, 4),
              (total - 1, total), (2 * block_size, 2 * block_size)]
    for k, (start, end) in enumerate(ranges):
        want = np.zeros((heads, end - start, head_dim), STORAGE[dk])
        if end > start:
            CPU.gather(storage[1], table, start, end, want, Codec(sk), dk)
        got = dev.put(_filled(want.shape, want.dtype, 0))
        dev.be.gather(d_storage[1], table if k % 2 else d_table, start, end, got, Codec(sk), dk)
        assert_bits_equal(dev.get(got), want)


def test_gather_into_strided_out(dev):
    rng = np.random.default_rng(6)
    heads, block_size, head_dim = 3, 16, 128
    cache = rand_bits(rng, (4, heads, block_size, head_dim), F16)
    table = np.array([2, 0, 3], np.int32)
    want = np.zeros((heads, 40, head_dim), np.float32)
    CPU.gather(cache, table, 5, 45, want, Codec(F16), F32)
    big = dev.put(_filled((heads, 40, head_dim + 4), np.float32))
    dev.be.gather(dev.put(cache), table, 5, 45, big[..., :head_dim], Codec(F16), F32)
    host = dev.get(big)
    assert_bits_equal(host[..., :head_dim], want)
    assert (host[..., head_dim:].view(np.uint32) == 0xFFFFFFFF).all()


@pytest.mark.parametrize("head_dim", (64, 128, 33))
@pytest.mark.parametrize("sk,dk", [(F16, F16), (F16, F32), (BF16, BF16), (BF16, F32),
                                   (F32, F32), (F32, F16)],
                         ids=["f16-f16", "f16-f32", "bf16-bf16", "bf16-f32", "f32-f32", "f32-f16"])
def test_gather_batch_matches_cpu(dev, sk, dk, head_dim):
    rng = np.random.default_rng([7, sk, dk, head_dim])
    heads, block_size, num_blocks, max_blocks, max_len = 2, 8, 16, 5, 44
    storage = rand_bits(rng, (2, num_blocks, heads, block_size, head_dim), sk)
    lens = np.array([13, 0, 40, 8, 1], np.int32)
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    perm = rng.permutation(num_blocks).astype(np.int32)
    for s, n in enumerate(lens):
        need = -(-int(n) // block_size)
        tables[s, :need] = np.roll(perm, 3 * s)[:need]
    want = np.zeros((len(lens), heads, max_len, head_dim), STORAGE[dk])
    for s, n in enumerate(lens):
        if n:
            tmp = np.empty((heads, int(n), head_dim), STORAGE[dk])
            CPU.gather(storage[1], np.ascontiguousarray(tables[s]), 0, int(n), tmp, Codec(sk), dk)
            want[s, :, :n] = tmp
    d_storage = dev.put(storage)
    for tables_arg, lens_arg in ((tables, lens), (dev.put(tables), dev.put(lens)),
                                 (tables, lens.astype(np.int64))):
        got = dev.put(_filled(want.shape, want.dtype))  # padding must be overwritten with +0
        dev.be.gather_batch(d_storage[1], tables_arg, lens_arg, got, Codec(sk), dk)
        assert_bits_equal(dev.get(got), want)


# ------------------------------------------------------------ block copies

@pytest.mark.parametrize("geometry", [(2, 16, 64), (1, 3, 5), (8, 16, 128)],
                         ids=["h2-bs16-d64", "h1-bs3-d5", "h8-bs16-d128"])
@pytest.mark.parametrize("kind", KINDS, ids=["f32", "f16", "bf16"])
def test_copy_blocks_matches_reference(dev, kind, geometry):
    rng = np.random.default_rng([8, kind, *geometry])
    storage = rand_bits(rng, (4, 10, *geometry), kind)
    src = np.array([0, 3, 7, 2], np.int32)
    dst = np.array([5, 1, 9, 8], np.int32)
    want = storage.copy()
    want[:, dst] = storage[:, src]
    for ids in ((src, dst), (dev.put(src), dev.put(dst)), (src.tolist(), dst.tolist())):
        d = dev.put(storage)
        dev.be.copy_blocks(d, *ids)
        assert_bits_equal(dev.get(d), want)
    d = dev.put(storage)
    dev.be.copy_blocks(d, np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert_bits_equal(dev.get(d), storage)


@pytest.mark.parametrize("src,dst", [([1, 2, 5], [2, 3, 5]), ([0, 1], [4, 4]),
                                     ([3, 0, 3], [0, 3, 7])],
                         ids=["chain", "repeated-dst", "swap-like"])
def test_copy_blocks_with_chained_host_ids_matches_cpu(dev, src, dst):
    """Ids where a block is copied on after being written: in order, as the
    CPU backend does."""
    rng = np.random.default_rng(len(src))
    storage = rand_bits(rng, (4, 8, 2, 16, 64), F16)
    want = storage.copy()
    CPU.copy_blocks(want, np.array(src, np.int32), np.array(dst, np.int32))
    d = dev.put(storage)
    dev.be.copy_blocks(d, np.array(src, np.int32), np.array(dst, np.int32))
    assert_bits_equal(dev.get(d), want)


@pytest.mark.parametrize("geometry", [(2, 16, 64), (1, 3, 5)], ids=["h2-bs16-d64", "h1-bs3-d5"])
def test_copy_blocks_between_devices_arrays(dev, geometry):
    rng = np.random.default_rng([9, *geometry])
    a = rand_bits(rng, (6, 6, *geometry), F16)
    b = rand_bits(rng, (6, 9, *geometry), F16)
    src = np.array([5, 0, 1, 2], np.int32)
    dst = np.array([8, 3, 4, 5], np.int32)
    want = b.copy()
    want[:, dst] = a[:, src]
    da, db = dev.put(a), dev.put(b)
    dev.be.copy_blocks_between(da, src, db, dst)
    assert_bits_equal(dev.get(db), want)
    assert_bits_equal(dev.get(da), a)


# ------------------------------------------------------ contiguous cache

@pytest.mark.parametrize("head_dim", (64, 128, 256, 33))
@pytest.mark.parametrize("sk,dk", PAIRS, ids=PAIR_IDS)
def test_write_contiguous_matches_cpu(dev, sk, dk, head_dim):
    rng = np.random.default_rng([10, sk, dk, head_dim])
    batch, heads, max_len = 2, 3, 40
    cache = rand_bits(rng, (batch, heads, max_len, head_dim), dk)
    want = cache.copy()
    d = dev.put(cache)
    for start, n, layout in ((0, 17, "bhnd"), (17, 1, "bhnd"), (18, 9, "bnhd"), (39, 1, "bnhd")):
        if layout == "bhnd":
            src = rand_bits(rng, (batch, heads, n, head_dim), sk)
            src_d = dev.put(src)
        else:  # Hugging Face's (batch, n, heads, dim), transposed: strided rows
            raw = rand_bits(rng, (batch, n, heads, head_dim), sk)
            src = raw.transpose(0, 2, 1, 3)
            src_d = dev.put(raw).transpose(0, 2, 1, 3)
        CPU.write_contiguous(want, src, start, sk, Codec(dk))
        dev.be.write_contiguous(d, src_d, start, sk, Codec(dk))
        assert_bits_equal(dev.get(d), want)


def test_write_contiguous_from_a_view_of_itself(dev):
    rng = np.random.default_rng(15)
    cache = rand_bits(rng, (2, 3, 20, 64), F32)
    want = cache.copy()
    d = dev.put(cache)
    for lo, start in ((2, 5), (5, 2)):  # shifted later, shifted earlier
        CPU.write_contiguous(want, want[:, :, lo:lo + 7, :], start, F32, Codec(F32))
        dev.be.write_contiguous(d, d[:, :, lo:lo + 7, :], start, F32, Codec(F32))
        assert_bits_equal(dev.get(d), want)


# ------------------------------------------------------------ attention
# kernels/attention.cu against the float64 reference (the contract's 1e-5
# relative: max abs error / max abs value), through the backend method.

def _lowprec_pages(vals, kind, layer_scales):
    """fp8 / int8 pages of float32 ``vals`` ``(2, blocks, heads, bs, dim)``,
    encoded by the NumPy reference: ``(codes, scales)``; int8 scales are
    one ``(blocks, heads, bs, 2)`` array (K at [..., 0], V at [..., 1]), so
    their strides are not the cache's."""
    from kvcore.backends.base import fp8_encode, int8_encode

    if kind == I8:
        codes, sc = int8_encode(vals)
        return codes, np.ascontiguousarray(np.moveaxis(sc, 0, -1))
    return np.stack([fp8_encode(vals[i], kind, layer_scales[i]) for i in (0, 1)]), None


def _io_bits(a, dtype):
    """float32 ``a`` in ``dtype`` as the backend takes it (bfloat16 as its
    uint16 bits) and the float32 values it then holds."""
    if dtype == "float32":
        return a, a
    if dtype == "float16-values":   # float32 holding float16 values (exact in float16)
        h = a.astype(np.float16).astype(np.float32)
        return h, h
    if dtype == "float16":
        h = a.astype(np.float16)
        return h, h.astype(np.float32)
    b = a.astype(ml_dtypes.bfloat16)
    return b.view(np.uint16), b.astype(np.float32)


def _io_values(bits, dtype):
    """The float32 values of q / out ``bits`` in ``dtype`` (see _io_bits)."""
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.astype(np.float32)


def _io_ulp(x, dtype):
    """A unit in the last place of ``dtype`` at each |x| (0 for float32)."""
    if dtype == "float32":
        return np.zeros_like(x)
    mant, tiny = (10, -24) if dtype == "float16" else (7, -133)
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** (tiny + mant))))
    return 2.0 ** (e - mant)


def attention_io(dev, rng, contexts, queries, num_heads, head_dim, scale, q_dtype, out_dtype):
    """A call's lengths and query_start_loc, q (as handed over in
    ``q_dtype``, and its float32 values), the scale (None: 1 / sqrt(head_dim))
    and out in ``out_dtype`` on the device, poisoned with NaN."""
    lens = np.array(contexts, np.int64)
    qsl = np.concatenate([[0], np.cumsum(queries)]).astype(np.int64)
    q_in, q = _io_bits(rng.standard_normal((int(qsl[-1]), num_heads, head_dim))
                       .astype(np.float32), q_dtype)
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = dev.put(_io_bits(np.full(q.shape, np.nan, np.float32), out_dtype)[0])
    return lens, qsl, q_in, q, scale, out


def _attention_case(dev, rng, kind, head_dim, num_heads, num_kv_heads, contexts, queries,
                    block_size=16, window=None, cap=None, split_keys=None, monkeypatch=None,
                    layer_scales=(1.0, 1.0), nan_rows=(), q_dtype="float32",
                    out_dtype="float32", tol=1e-5, plan_hook=None, chunk=None, alibi=None,
                    sinks=None, scale=None):
    """One call of the backend against the float64 reference over the
    stored values (dequantized for fp8 / int8 pages); returns the result.
    With ``nan_rows`` (fp8 / int8) the NaN pattern and the finite values
    are checked against the CPU kernel instead.  ``q_dtype`` / ``out_dtype``:
    q and out handed to the backend in that dtype (out poisoned with NaN
    first); the reference takes q's values; a float16 / bfloat16 out may
    differ from it by its rounding (one unit in its last place) beyond
    ``tol`` (relative to the largest output).  ``plan_hook(plan)`` sees the
    backend's plan before the run.  ``chunk`` / ``alibi`` / ``sinks`` /
    ``scale`` (issue 39, 38.3): chunked attention, ALiBi slopes and sinks
    (float32 ``(num_heads,)``), another scale than ``1 / sqrt(head_dim)``."""
    from kvcore.backends.cuda import attention_kernels
    from kvcore.backends.base import paged_attention_reference

    if split_keys is not None:
        monkeypatch.setattr(attention_kernels, "SPLIT_KEYS", split_keys)
    need = [-(-c // block_size) for c in contexts]
    num_blocks = sum(need) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    vals = rng.standard_normal((2, *shape)).astype(np.float32)
    codecs = ref_kw = cpu_codecs = None
    if kind == F16:
        k, v = vals.astype(np.float16)
    elif kind == BF16:
        k, v = (vals.astype(ml_dtypes.bfloat16)).view(np.uint16)
    elif kind in QKINDS:
        codes, both = _lowprec_pages(vals * 3, kind, layer_scales)
    else:
        k, v = vals
    perm = rng.permutation(num_blocks)
    tables = np.full((len(contexts), max(need) + 1), -1, np.int32)
    a = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[a:a + n]
        a += n
    if kind in QKINDS:
        # NaN rows: (plane, sequence, position, kv head): int8 scale NaN and
        # zero codes (what a write of a NaN row stores); fp8 a NaN code at
        # element 3
        for plane, sq, pos, g in nan_rows:
            b, t = tables[sq, pos // block_size], pos % block_size
            if kind == I8:
                codes[plane, b, g, t] = 0
                both[b, g, t, plane] = np.nan
            else:
                codes[plane, b, g, t, 3] = 0xFF if kind == F8E4M3 else 0x7F
        k, v = codes
        ref_kw = dict(kind=dtypes.KIND_NAME[kind])
        if kind == I8:
            d_both = dev.put(both)
            codecs = (Codec(I8, 1.0, d_both[..., 0]), Codec(I8, 1.0, d_both[..., 1]))
            ks, vs = np.ascontiguousarray(both[..., 0]), np.ascontiguousarray(both[..., 1])
            cpu_codecs = (Codec(I8, 1.0, ks), Codec(I8, 1.0, vs))
        else:
            ks, vs = layer_scales
            codecs = cpu_codecs = (Codec(kind, float(ks)), Codec(kind, float(vs)))
        ref_kw.update(key_scales=ks, value_scales=vs)
    lens, qsl, q_in, q, scale, out = attention_io(dev, rng, contexts, queries, num_heads,
                                                  head_dim, scale, q_dtype, out_dtype)
    be = dev.be
    plan = be.attention_plan(
        tables, lens, qsl, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, num_blocks=num_blocks, kind=kind, scale=scale,
        sliding_window=window or 0, soft_cap=cap or 0.0, chunk_size=chunk or 0)
    if plan_hook is not None:
        plan_hook(plan)
    feats = {name: dev.put(np.asarray(a, np.float32)) for name, a in
             (("alibi_slopes", alibi), ("sinks", sinks)) if a is not None}
    be.attention_run(plan, dev.put(q_in), out, dev.put(k), dev.put(v),
                     **({} if codecs is None else {"codecs": codecs}), **feats)
    got = _io_values(dev.get(out), out_dtype)
    if nan_rows:   # the CPU kernel's result; the caller checks the NaN pattern
        from kvcore.attention import _attention
        want = _attention(q, k, v, kind, k, tables, lens, qsl, scale, window, cap, None,
                          cpu_codecs)
        nan = np.isnan(want) | np.isnan(got)
        assert nan.any() and not nan.all()
    else:
        nan = np.zeros(got.shape, bool)
        want = paged_attention_reference(
            q, k, v, np.where(tables < 0, 0, tables), lens, qsl, scale=scale,
            sliding_window=window, logits_soft_cap=cap, chunk_size=chunk,
            alibi_slopes=alibi, sinks=sinks,
            **(ref_kw or dict(kind="bfloat16" if kind == BF16 else None)))
        assert np.isfinite(want).all()
    assert not np.isnan(got[~nan]).any()   # every element written
    over = np.abs(got - want) - _io_ulp(want, out_dtype)
    err = max(0.0, over[~nan].max()) / np.abs(want)[~nan].max()
    assert err <= tol, err
    return (got, want) if nan_rows else got


@pytest.mark.parametrize("kind", KINDS, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim", (64, 80, 128))
def test_paged_attention_decode_and_prefill_match_reference(dev, kind, head_dim, monkeypatch):
    """Decode of several sequences (one split and several, merged), a
    prefill chunk and a whole short prefill in one call; GQA 4."""
    rng = np.random.default_rng(head_dim + 10 * kind)
    _attention_case(dev, rng, kind, head_dim, 8, 2, contexts=[1, 37, 200, 9],
                    queries=[1, 1, 3, 9], split_keys=64, monkeypatch=monkeypatch)


@pytest.mark.parametrize("nh,nkv", [(4, 4), (16, 1), (24, 2)], ids=["mha", "mqa-16", "gqa-12"])
def test_paged_attention_head_groups_match_reference(dev, nh, nkv, monkeypatch):
    """Group sizes 1, 16 (two chunks of 8 heads) and 12 (a partial chunk)."""
    rng = np.random.default_rng(nh * 100 + nkv)
    _attention_case(dev, rng, F16, 64, nh, nkv, contexts=[70, 5], queries=[2, 1],
                    block_size=8, split_keys=32, monkeypatch=monkeypatch)


def test_paged_attention_window_and_soft_cap_match_reference(dev, monkeypatch):
    rng = np.random.default_rng(7)
    for window, cap in ((20, None), (None, 5.0), (33, 2.0)):
        _attention_case(dev, rng, BF16, 96, 8, 2, contexts=[150, 40], queries=[4, 1],
                        block_size=16, window=window, cap=cap, split_keys=64,
                        monkeypatch=monkeypatch)


def test_paged_attention_head_dim_256_and_block_size_1(dev):
    rng = np.random.default_rng(8)
    _attention_case(dev, rng, F32, 256, 4, 1, contexts=[13, 2], queries=[2, 2], block_size=1)


def test_paged_attention_splits_do_not_change_the_result_beyond_rounding(dev, monkeypatch):
    rng = np.random.default_rng(9)
    a = _attention_case(dev, rng, F16, 64, 4, 2, contexts=[300], queries=[1])
    rng = np.random.default_rng(9)
    b = _attention_case(dev, rng, F16, 64, 4, 2, contexts=[300], queries=[1], split_keys=16,
                        monkeypatch=monkeypatch)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


# ------------------------------------------ attention over fp8 / int8 pages
# the same kernels reading fp8 codes (layer scales) and int8 codes (row
# scales) against the float64 reference over the dequantized K/V.

QKINDS = (F8E4M3, F8E5M2, I8)
QIDS = ["e4m3", "e5m2", "int8"]
# fp8 layer scales: neither 1 (so a dropped or swapped scale shows)
FP8_SCALES = (0.37, 3.0)


@pytest.mark.parametrize("head_dim", (64, 80))
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_paged_attention_over_lowprec_pages_matches_reference(dev, qk, head_dim, monkeypatch):
    """Decode of several sequences (one split and several, merged), a
    prefill chunk and a short whole prefill in one call; GQA 4."""
    rng = np.random.default_rng([50, qk, head_dim])
    _attention_case(dev, rng, qk, head_dim, 8, 2, contexts=[1, 37, 200, 9],
                    queries=[1, 1, 3, 9], split_keys=64, monkeypatch=monkeypatch,
                    layer_scales=FP8_SCALES)


@pytest.mark.parametrize("qk", (F8E5M2, I8), ids=["e5m2", "int8"])
@pytest.mark.parametrize("nh,nkv", [(4, 4), (16, 1), (24, 2)], ids=["mha", "mqa-16", "gqa-12"])
def test_paged_attention_over_lowprec_pages_head_groups(dev, qk, nh, nkv, monkeypatch):
    rng = np.random.default_rng([51, qk, nh, nkv])
    _attention_case(dev, rng, qk, 64, nh, nkv, contexts=[70, 5], queries=[2, 1],
                    block_size=8, split_keys=32, monkeypatch=monkeypatch,
                    layer_scales=(2.0, 0.25))


@pytest.mark.parametrize("qk", (F8E4M3, I8), ids=["e4m3", "int8"])
def test_paged_attention_over_lowprec_pages_window_and_soft_cap(dev, qk, monkeypatch):
    rng = np.random.default_rng([52, qk])
    for window, cap in ((20, None), (None, 5.0), (33, 2.0)):
        _attention_case(dev, rng, qk, 96, 8, 2, contexts=[150, 40], queries=[4, 1],
                        block_size=16, window=window, cap=cap, split_keys=64,
                        monkeypatch=monkeypatch, layer_scales=FP8_SCALES)


@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_paged_attention_over_lowprec_pages_block_size_1_head_dim_256(dev, qk):
    rng = np.random.default_rng([53, qk])
    _attention_case(dev, rng, qk, 256, 4, 1, contexts=[13, 2], queries=[2, 2], block_size=1,
                    layer_scales=FP8_SCALES)


@pytest.mark.parametrize("qk", (F8E5M2, I8), ids=["e5m2", "int8"])
def test_paged_attention_over_lowprec_pages_splits_agree(dev, qk, monkeypatch):
    rng = np.random.default_rng([54, qk])
    a = _attention_case(dev, rng, qk, 64, 4, 2, contexts=[300], queries=[1],
                        layer_scales=FP8_SCALES)
    rng = np.random.default_rng([54, qk])
    b = _attention_case(dev, rng, qk, 64, 4, 2, contexts=[300], queries=[1], split_keys=16,
                        monkeypatch=monkeypatch, layer_scales=FP8_SCALES)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


@pytest.mark.parametrize("split_keys", (256, 4, 1), ids=["one-split", "splits-of-4",
                                                        "splits-of-1"])
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_paged_attention_over_lowprec_nan_key_rows_as_on_the_cpu(dev, qk, split_keys,
                                                                   monkeypatch):
    """An int8 NaN row (scale NaN, zero codes: what a write of a row holding
    a NaN stores) or an fp8 NaN code in a key row makes the outputs of
    exactly the queries that see it NaN (their kv head's query heads, every
    dim), the CPU kernel's NaN pattern, and no other output.  The kernel's
    warp and split merges must keep a NaN partial: with splits of 4 keys the
    query at position 13 has a split (12, 13) whose warp 1 sees only the NaN
    key (its max stays -inf, its sum is NaN); with splits of 1 a whole split
    does (its merged max is -inf, its sum NaN)."""
    rng = np.random.default_rng([55, qk])
    got, cpu = _attention_case(dev, rng, qk, 64, 4, 2, contexts=[30, 12, 16],
                               queries=[20, 1, 1], block_size=4, split_keys=split_keys,
                               monkeypatch=monkeypatch, layer_scales=FP8_SCALES,
                               nan_rows=[(0, 0, 13, 0)])   # K, sequence 0, position 13, head 0
    nan = np.isnan(got)
    assert (nan == np.isnan(cpu)).all(), np.argwhere(nan != np.isnan(cpu))[:5]
    # sequence 0's queries sit at positions 10..29: 10..12 do not see position 13
    want = np.zeros_like(nan)
    want[3:20, :2] = True
    assert (nan == want).all(), np.argwhere(nan != want)[:5]


@pytest.mark.parametrize("split_keys", (256, 4), ids=["one-split", "splits-of-4"])
@pytest.mark.parametrize("qk", (F8E4M3, F8E5M2), ids=["e4m3", "e5m2"])
def test_paged_attention_over_fp8_nan_value_code(dev, qk, split_keys, monkeypatch):
    """An fp8 NaN code in a value row: NaN in that dim of exactly the queries
    that see the position (their kv head's query heads), finite elsewhere.
    (The CPU kernel also gives NaN there for queries whose key tile holds
    the position without seeing it, 0 * NaN in its P V product; this
    kernel never reads a key a query does not see.)"""
    rng = np.random.default_rng([56, qk])
    got, cpu = _attention_case(dev, rng, qk, 64, 4, 2, contexts=[30, 12, 16],
                               queries=[20, 1, 1], block_size=4, split_keys=split_keys,
                               monkeypatch=monkeypatch, layer_scales=FP8_SCALES,
                               nan_rows=[(1, 0, 22, 1)])   # V, sequence 0, position 22, head 1
    want = np.zeros(got.shape, bool)
    want[12:20, 2:, 3] = True                              # positions 22..29, query heads 2, 3
    assert (np.isnan(got) == want).all(), np.argwhere(np.isnan(got) != want)[:5]
    assert np.isnan(cpu[want]).all()


# ------------------------------------------------- fp8 / int8 storage
# lowprec.cu against the CPU backend (kv_fp8.h / kv_fp8.c) and the NumPy
# reference, bit for bit: codes, int8 scales (NaN rows included) and the
# widened reads.

KIDS = ["f32", "f16", "bf16"]


def lp_values(rng, shape, kind=F32):
    """Input rows of float ``kind`` (storage bits): many magnitudes, zeros,
    an all-zero row, fp8 overflow, float32 subnormals, values on int8 and
    fp8 rounding ties, and rows holding +-NaN or +-inf."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 14, shape))).astype(np.float32)
    x[rng.random(shape) < 0.05] = 0
    x[rng.random(shape) < 0.02] *= np.float32(1e5)
    flat = x.reshape(-1, shape[-1])
    rows = flat.shape[0]
    if rows > 6:
        flat[1] = 0
        flat[2, 0] = np.nan
        flat[3, -1] = -np.inf
        flat[4, 1 % shape[-1]] = np.float32(-np.nan)       # a negative NaN
        flat[4, 0] = 1
        # int8 ties: max 127 -> scale 1, halves round to even
        flat[5] = np.float32(0.5) + rng.integers(-60, 60, shape[-1]).astype(np.float32)
        flat[5, 0] = 127
        flat[6] = np.float32(1e-41)                         # subnormal rows
    if kind == F32:
        return x
    with np.errstate(over="ignore"):
        return cpu_convert(x, F32, kind)


def _q_storage(rng, shape, qk):
    return rng.integers(0, 256, size=shape, dtype=np.uint8).view(STORAGE[qk])


def _q_scales(rng, shape):
    """Random positive float32 scales, with a NaN (an int8 NaN row's)."""
    s = (rng.random(shape) * 0.1 + 1e-3).astype(np.float32)
    s.reshape(-1)[::7] = np.float32(np.nan)
    return s


def _q_pages(rng, shape, qk):
    """Random codes of kind ``qk`` and, for int8, their row scales (None
    otherwise)."""
    codes = _q_storage(rng, shape, qk)
    return codes, _q_scales(rng, shape[:-1]) if qk == I8 else None


@pytest.mark.parametrize("head_dim", (64, 33))
@pytest.mark.parametrize("sk", KINDS, ids=KIDS)
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_write_slots_q_matches_cpu(dev, qk, sk, head_dim):
    rng = np.random.default_rng([30, qk, sk, head_dim])
    num_blocks, heads, block_size, n = 5, 3, 8, 19
    cache, scales = _q_pages(rng, (num_blocks, heads, block_size, head_dim), qk)
    slots = rng.permutation(num_blocks * block_size)[:n].astype(np.int64)
    slots[[3, 11]] = -1
    src = lp_values(rng, (n, heads, head_dim), sk)
    for scale in ((1.0,) if qk == I8 else (1.0, 0.37, 3.0)):
        want_c, want_s = cache.copy(), None if scales is None else scales.copy()
        CPU.write_slots(want_c, src, slots, sk, Codec(qk, scale, want_s))
        ref_c, ref_s = cache.copy(), None if scales is None else scales.copy()
        REFERENCE.write_slots(ref_c, src, slots, sk, Codec(qk, scale, ref_s))
        assert_bits_equal(want_c, ref_c)
        for slots_arg in (slots, dev.put(slots)):
            d_c = dev.put(cache)
            d_s = None if scales is None else dev.put(scales)
            dev.be.write_slots(d_c, dev.put(src), slots_arg, sk, Codec(qk, scale, d_s))
            assert_bits_equal(dev.get(d_c), want_c)
            if scales is not None:
                assert_bits_equal(dev.get(d_s), want_s)
                assert_bits_equal(want_s, ref_s)


@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_write_slots_q_from_strided_rows(dev, qk):
    """Hugging Face's (n, heads, dim) as a transposed view: strided rows."""
    rng = np.random.default_rng([31, qk])
    cache, scales = _q_pages(rng, (4, 2, 8, 64), qk)
    raw = lp_values(rng, (2, 9, 64), F16)
    src = raw.transpose(1, 0, 2)
    slots = np.arange(9, dtype=np.int64) + 7
    want_c, want_s = cache.copy(), None if scales is None else scales.copy()
    CPU.write_slots(want_c, np.ascontiguousarray(src), slots, F16, Codec(qk, 0.5, want_s))
    d_c, d_s = dev.put(cache), None if scales is None else dev.put(scales)
    dev.be.write_slots(d_c, dev.put(raw).transpose(1, 0, 2), slots, F16, Codec(qk, 0.5, d_s))
    assert_bits_equal(dev.get(d_c), want_c)
    if scales is not None:
        assert_bits_equal(dev.get(d_s), want_s)


@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_write_slots_kv_q_repeated_and_checked_slots(dev, qk):
    """BlockPool.write's rules on fp8 / int8 planes: the last token naming a
    slot lands (codes and scales), device slots are range-checked on the
    device (nothing written on error) or skipped unchecked."""
    rng = np.random.default_rng([32, qk])
    num_blocks, heads, block_size, head_dim = 4, 2, 8, 64
    num_slots = num_blocks * block_size
    storage, scales = _q_pages(rng, (2, num_blocks, heads, block_size, head_dim), qk)
    slots = np.array([5, 9, 5, 31, -1, 9, 5, 0, 31, 9], np.int64)
    k = lp_values(rng, (len(slots), heads, head_dim), F32)
    v = lp_values(rng, (len(slots), heads, head_dim), BF16)
    want = storage.copy()
    want_s = None if scales is None else scales.copy()
    ws = (None, None) if want_s is None else (want_s[0], want_s[1])
    vb = cpu_convert(v, BF16, F32)
    CPU.write_slots_kv(want[0], want[1], k, vb, slots, F32, Codec(qk, 0.5, ws[0]),
                       Codec(qk, 2.0, ws[1]), None, False)
    # the last writer's rows, spelled out with the reference
    for slot in (5, 9, 31):
        last = np.flatnonzero(slots == slot)[-1]
        b, off = divmod(slot, block_size)
        one = np.zeros((num_blocks, heads, block_size, head_dim), STORAGE[qk])
        one_s = None if scales is None else np.zeros((num_blocks, heads, block_size), np.float32)
        REFERENCE.write_slots(one, k[last:last + 1], np.array([slot]), F32, Codec(qk, 0.5, one_s))
        assert_bits_equal(want[0][b, :, off], one[b, :, off])
        if scales is not None:
            assert_bits_equal(want_s[0][b, :, off], one_s[b, :, off])
    owner = _owner(dev, num_slots)
    for slots_arg in (slots, dev.put(slots)):
        d = dev.put(storage)
        d_s = None if scales is None else dev.put(scales)
        dsc = (None, None) if d_s is None else (d_s[0], d_s[1])
        dev.be.write_slots_kv(d[0], d[1], dev.put(k), dev.put(vb), slots_arg, F32,
                              Codec(qk, 0.5, dsc[0]), Codec(qk, 2.0, dsc[1]), owner, True)
        assert_bits_equal(dev.get(d), want)
        if scales is not None:
            assert_bits_equal(dev.get(d_s), want_s)
        assert _released(dev, owner)
    bad = slots.copy()
    bad[2] = num_slots
    d = dev.put(storage)
    d_s = None if scales is None else dev.put(scales)
    dsc = (None, None) if d_s is None else (d_s[0], d_s[1])
    with pytest.raises(IndexError, match=rf"got {num_slots} at index 2"):
        dev.be.write_slots_kv(d[0], d[1], dev.put(k), dev.put(vb), dev.put(bad), F32,
                              Codec(qk, 0.5, dsc[0]), Codec(qk, 2.0, dsc[1]), owner, True)
    assert_bits_equal(dev.get(d), storage)
    if scales is not None:
        assert_bits_equal(dev.get(d_s), scales)
    assert _released(dev, owner)


@pytest.mark.parametrize("block_size", (8, 16))
@pytest.mark.parametrize("dk", KINDS, ids=KIDS)
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_gather_q_matches_cpu(dev, qk, dk, block_size):
    """Every code pattern (NaN codes, subnormals) widened, with NaN scales."""
    rng = np.random.default_rng([33, qk, dk, block_size])
    heads, num_blocks, used, head_dim = 2, 7, 5, 64
    storage, scales = _q_pages(rng, (2, num_blocks, heads, block_size, head_dim), qk)
    storage.reshape(-1)[:256] = np.arange(256, dtype=np.uint8).view(STORAGE[qk])
    table = rng.permutation(num_blocks)[:used].astype(np.int32)
    table[0] = 0   # the block holding every pattern
    total = used * block_size
    d_storage, d_table = dev.put(storage), dev.put(table)
    d_scales = None if scales is None else dev.put(scales)
    for scale in ((1.0,) if qk == I8 else (1.0, 0.3)):
        for k, (start, end) in enumerate([(0, total), (1, total - 1), (3, 4),
                                          (block_size - 1, block_size + 1)]):
            want = np.zeros((heads, end - start, head_dim), STORAGE[dk])
            CPU.gather(storage[1 - k % 2], table, start, end, want,
                       Codec(qk, scale, None if scales is None else scales[1 - k % 2]), dk)
            ref = np.zeros_like(want)
            REFERENCE.gather(storage[1 - k % 2], table, start, end, ref,
                             Codec(qk, scale, None if scales is None else scales[1 - k % 2]), dk)
            assert_bits_equal(want, ref)
            got = dev.put(_filled(want.shape, want.dtype, 0))
            dev.be.gather(d_storage[1 - k % 2], table if k % 2 else d_table, start, end, got,
                          Codec(qk, scale, None if scales is None else d_scales[1 - k % 2]), dk)
            assert_bits_equal(dev.get(got), want)


@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_gather_q_into_strided_out(dev, qk):
    rng = np.random.default_rng([34, qk])
    heads, block_size, head_dim = 3, 16, 64
    cache, scales = _q_pages(rng, (4, heads, block_size, head_dim), qk)
    table = np.array([2, 0, 3], np.int32)
    want = np.zeros((heads, 40, head_dim), np.float32)
    CPU.gather(cache, table, 5, 45, want, Codec(qk, 0.5, scales), F32)
    for big_shape, view in (((heads, 40, head_dim + 4), lambda b: b[..., :head_dim]),
                            ((heads, 40, head_dim, 2), lambda b: b[..., 0])):
        big = dev.put(_filled(big_shape, np.float32))
        dev.be.gather(dev.put(cache), table, 5, 45, view(big),
                      Codec(qk, 0.5, None if scales is None else dev.put(scales)), F32)
        host = dev.get(big)
        assert_bits_equal(np.ascontiguousarray(view(host)), want)


@pytest.mark.parametrize("dk", KINDS, ids=KIDS)
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_gather_batch_q_matches_cpu(dev, qk, dk):
    rng = np.random.default_rng([35, qk, dk])
    heads, block_size, num_blocks, max_blocks, max_len, head_dim = 2, 8, 16, 5, 44, 33
    storage, scales = _q_pages(rng, (2, num_blocks, heads, block_size, head_dim), qk)
    lens = np.array([13, 0, 40, 8, 1], np.int32)
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    perm = rng.permutation(num_blocks).astype(np.int32)
    for s, n in enumerate(lens):
        tables[s, :-(-int(n) // block_size)] = np.roll(perm, 3 * s)[:-(-int(n) // block_size)]
    want = np.zeros((len(lens), heads, max_len, head_dim), STORAGE[dk])
    sc1 = None if scales is None else scales[1]
    CPU.gather_batch(storage[1], tables, lens, want, Codec(qk, 0.75, sc1), dk)
    ref = np.zeros_like(want)
    REFERENCE.gather_batch(storage[1], tables, lens, ref, Codec(qk, 0.75, sc1), dk)
    assert_bits_equal(want, ref)
    d_storage = dev.put(storage)
    d_sc1 = None if scales is None else dev.put(scales)[1]
    for tables_arg, lens_arg in ((tables, lens), (dev.put(tables), dev.put(lens))):
        got = dev.put(_filled(want.shape, want.dtype))  # padding overwritten with +0
        dev.be.gather_batch(d_storage[1], tables_arg, lens_arg, got, Codec(qk, 0.75, d_sc1), dk)
        assert_bits_equal(dev.get(got), want)


@pytest.mark.parametrize("sk", KINDS, ids=KIDS)
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_write_contiguous_q_matches_cpu(dev, qk, sk):
    rng = np.random.default_rng([36, qk, sk])
    batch, heads, max_len, head_dim = 2, 3, 40, 64
    cache, scales = _q_pages(rng, (batch, heads, max_len, head_dim), qk)
    want, want_s = cache.copy(), None if scales is None else scales.copy()
    d, d_s = dev.put(cache), None if scales is None else dev.put(scales)
    for start, n, layout in ((0, 17, "bhnd"), (17, 1, "bhnd"), (18, 9, "bnhd"), (39, 1, "bnhd")):
        if layout == "bhnd":
            src = lp_values(rng, (batch, heads, n, head_dim), sk)
            src_d = dev.put(src)
        else:
            raw = lp_values(rng, (batch, n, heads, head_dim), sk)
            src = raw.transpose(0, 2, 1, 3)
            src_d = dev.put(raw).transpose(0, 2, 1, 3)
        ref, ref_s = want.copy(), None if want_s is None else want_s.copy()
        CPU.write_contiguous(want, np.ascontiguousarray(src), start, sk, Codec(qk, 0.25, want_s))
        REFERENCE.write_contiguous(ref, np.ascontiguousarray(src), start, sk,
                                   Codec(qk, 0.25, ref_s))
        assert_bits_equal(want, ref)
        dev.be.write_contiguous(d, src_d, start, sk, Codec(qk, 0.25, d_s))
        assert_bits_equal(dev.get(d), want)
        if scales is not None:
            assert_bits_equal(want_s, ref_s)
            assert_bits_equal(dev.get(d_s), want_s)


@pytest.mark.parametrize("dk", KINDS, ids=KIDS)
@pytest.mark.parametrize("qk", QKINDS, ids=QIDS)
def test_dequantize_matches_cpu(dev, qk, dk):
    """KVCache.get(dtype=...): a range of the cache (views), widened."""
    rng = np.random.default_rng([37, qk, dk])
    cache, scales = _q_pages(rng, (2, 3, 40, 64), qk)
    cache.reshape(-1)[:256] = np.arange(256, dtype=np.uint8).view(STORAGE[qk])
    d_c, d_s = dev.put(cache), None if scales is None else dev.put(scales)
    for start, end in ((0, 40), (5, 17)):
        src = cache[:, :, start:end]
        sc = None if scales is None else scales[:, :, start:end]
        want = np.zeros(src.shape, STORAGE[dk])
        CPU.dequantize(src, Codec(qk, 1.5, sc), want, dk)
        ref = np.zeros_like(want)
        REFERENCE.dequantize(src, Codec(qk, 1.5, sc), ref, dk)
        assert_bits_equal(want, ref)
        got = dev.put(_filled(want.shape, want.dtype))
        dev.be.dequantize(d_c[:, :, start:end],
                          Codec(qk, 1.5, None if d_s is None else d_s[:, :, start:end]), got, dk)
        assert_bits_equal(dev.get(got), want)
        # into a strided out
        big = dev.put(_filled(want.shape[:-1] + (70,), want.dtype))
        dev.be.dequantize(d_c[:, :, start:end],
                          Codec(qk, 1.5, None if d_s is None else d_s[:, :, start:end]), big[...,
                          3:67], dk)
        host = dev.get(big)
        assert_bits_equal(np.ascontiguousarray(host[..., 3:67]), want)
        assert (_bits_view(host[..., :3]) == _bits_view(_filled((1,), want.dtype))[0]).all()


@pytest.mark.parametrize("geometry", [(1, 3, 5), (2, 16, 64)], ids=["h1-bs3-d5", "h2-bs16-d64"])
@pytest.mark.parametrize("qk", (F8E4M3, I8), ids=["uint8", "int8"])
def test_copy_blocks_of_one_byte_storage(dev, qk, geometry):
    """fp8 / int8 blocks of an odd number of bytes (15: 1-byte words) and
    their float32 scales (copy-on-write; copy_blocks_between)."""
    rng = np.random.default_rng([38, qk, *geometry])
    storage = _q_storage(rng, (4, 10, *geometry), qk)
    scales = _q_scales(rng, storage.shape[:4])
    src = np.array([0, 3, 7, 2], np.int32)
    dst = np.array([5, 1, 9, 8], np.int32)
    for a in (storage, scales):
        want = a.copy()
        want[:, dst] = a[:, src]
        for ids in ((src, dst), (dev.put(src), dev.put(dst))):
            d = dev.put(a)
            dev.be.copy_blocks(d, *ids)
            assert_bits_equal(dev.get(d), want)
        other = dev.put(_filled(a.shape, a.dtype))
        dev.be.copy_blocks_between(dev.put(a), src, other, dst)
        assert_bits_equal(dev.get(other)[:, dst], a[:, src])


# ------------------------------- issue 23, item 5: misaligned out= views

def _misaligned_zeros(dev, shape, dtype):
    """A C-contiguous device array of zeros whose data starts one byte past
    an aligned address (as a DLPack import or a byte-offset view can be)."""
    dtype = np.dtype(dtype)
    buf = dev.put(np.zeros(int(np.prod(shape)) * dtype.itemsize + 1, np.uint8))
    a = buf[1:].view(dtype).reshape(shape)
    assert dev.be._ptr(a) % dtype.itemsize, "not misaligned"
    return a


def test_misaligned_outputs_are_written_through_an_aligned_temporary(dev):
    """A misaligned store faults on the GPU and leaves the CUDA context
    unusable: every read kernel that writes an ``out=`` gets an aligned
    temporary instead (its bytes then copied), with the CPU's bits."""
    rng = np.random.default_rng(230)
    heads, block_size, head_dim, nb = 2, 8, 64, 5
    storage = rand_bits(rng, (nb, heads, block_size, head_dim), F16)
    table = np.array([3, 0, 4], np.int32)
    d_cache = dev.put(storage)
    for dk in (F32, F16):
        want = np.zeros((heads, 19, head_dim), STORAGE[dk])
        CPU.gather(storage, table, 2, 21, want, Codec(F16), dk)
        out = _misaligned_zeros(dev, want.shape, want.dtype)
        dev.be.gather(d_cache, table, 2, 21, out, Codec(F16), dk)
        assert_bits_equal(dev.get(out), want)
    # gather_batch (padding +0)
    lens = np.array([13, 24], np.int32)
    tables = np.array([[3, 0, 4], [1, 2, 0]], np.int32)
    want = np.zeros((2, heads, 24, head_dim), np.float32)
    for s, n in enumerate(lens):
        CPU.gather(storage, tables[s], 0, int(n), want[s, :, :n], Codec(F16), F32)
    out = _misaligned_zeros(dev, want.shape, np.float32)
    dev.be.gather_batch(d_cache, tables, lens, out, Codec(F16), F32)
    assert_bits_equal(dev.get(out), want)
    # fp8 pages widened
    codes = _q_storage(rng, storage.shape, F8E4M3)
    want = np.zeros((heads, 19, head_dim), np.float32)
    CPU.gather(codes, table, 2, 21, want, Codec(F8E4M3, 0.5), F32)
    out = _misaligned_zeros(dev, want.shape, np.float32)
    dev.be.gather(dev.put(codes), table, 2, 21, out, Codec(F8E4M3, 0.5), F32)
    assert_bits_equal(dev.get(out), want)
    # convert: misaligned destination, misaligned source
    x = rand_bits(rng, (37, 8), F32)
    want = cpu_convert(x, F32, F16)
    out = _misaligned_zeros(dev, want.shape, np.float16)
    dev.be.convert(dev.put(x), F32, out, F16)
    assert_bits_equal(dev.get(out), want)
    src = _misaligned_zeros(dev, x.shape, np.float32)
    src.view(np.uint8)[...] = dev.put(x).view(np.uint8)
    out = dev.put(np.zeros_like(want))
    dev.be.convert(src, F32, out, F16)
    assert_bits_equal(dev.get(out), want)
    # a paged write from misaligned K rows (copied as bytes first)
    cache = rand_bits(rng, (nb, heads, block_size, head_dim), F16)
    k = rand_bits(rng, (6, heads, head_dim), F32)
    slots = np.array([3, 17, -1, 30, 8, 0], np.int64)
    want = cache.copy()
    CPU.write_slots(want, k, slots, F32, Codec(F16))
    src = _misaligned_zeros(dev, k.shape, np.float32)
    src.view(np.uint8)[...] = dev.put(k).view(np.uint8)
    d = dev.put(cache)
    dev.be.write_slots(d, src, slots, F32, Codec(F16))
    assert_bits_equal(dev.get(d), want)


def test_a_misaligned_out_with_a_strided_last_axis_is_a_value_error(dev):
    rng = np.random.default_rng(231)
    storage = rand_bits(rng, (3, 2, 8, 16), F16)
    full = _misaligned_zeros(dev, (2, 5, 32), np.float32)
    out = full[..., ::2]
    # read back through the contiguous array (a plain byte copy): CuPy reads a strided
    # view with a kernel, whose misaligned loads would fault on a real GPU
    before = dev.get(full)[..., ::2].copy()
    with pytest.raises(ValueError, match=r"out must be aligned to its itemsize \(4 bytes\)"):
        dev.be.gather(dev.put(storage), np.array([1, 0], np.int32), 0, 5, out, Codec(F16), F32)
    assert_bits_equal(dev.get(full)[..., ::2], before)


def test_paged_attention_into_a_misaligned_out(dev):
    """attention.cu's stores and q loads: a misaligned ``out`` (and ``q``)
    gives the bits of aligned ones; misaligned pages are a ValueError."""
    rng = np.random.default_rng(232)
    heads, kv_heads, bs, dim, nb = 4, 2, 8, 64, 6
    kc, vc = (dev.put(rng.standard_normal((nb, kv_heads, bs, dim)).astype(np.float16))
              for _ in range(2))
    q_host = rng.standard_normal((3, heads, dim)).astype(np.float32)
    tables = np.array([[4, 1, 5], [0, 2, 3]], np.int32)
    lens = np.array([20, 9], np.int64)
    qsl = np.array([0, 2, 3], np.int64)
    args = (F16, tables, lens, qsl, dim ** -0.5, 0, 0.0)
    want = dev.put(np.zeros((3, heads, dim), np.float32))
    dev.be.paged_attention(dev.put(q_host), want, kc, vc, *args)
    out = _misaligned_zeros(dev, (3, heads, dim), np.float32)
    q = _misaligned_zeros(dev, (3, heads, dim), np.float32)
    q.view(np.uint8)[...] = dev.put(q_host).view(np.uint8)
    dev.be.paged_attention(q, out, kc, vc, *args)
    assert_bits_equal(dev.get(out), dev.get(want))
    bad = _misaligned_zeros(dev, (nb, kv_heads, bs, dim), np.float16)
    with pytest.raises(ValueError, match="key_cache must be aligned to its itemsize"):
        dev.be.paged_attention(dev.put(q_host), out, bad, vc, *args)


__all__ = [name for name in dir() if name.startswith("test_")] + [
    "DeviceUnderTest", "assert_bits_equal", "rand_bits", "PAIRS", "PAIR_IDS", "KINDS"]
