"""Every backend against the NumPy reference (``kvcore.backends.base.Backend``),
operation by operation, bit for bit: one test body per operation, run on each
backend present (the reference itself, the CPU backend, the CUDA backend when
CuPy and a GPU are there).  The reference is checked on its own against
NumPy's and ml_dtypes' conversions at the end.
"""
import itertools

import numpy as np
import pytest
import xxhash

from kvcore import dtypes
from kvcore.backends import CPU, xxh3_64
from kvcore.backends.base import REFERENCE, convert_bits
from kvcore.backends.codec import Codec

try:
    from _cuda_env import cuda_backend_or_skip
except ImportError:  # pragma: no cover - run as a package
    from ._cuda_env import cuda_backend_or_skip

KINDS = (dtypes.F32, dtypes.F16, dtypes.BF16)
PAIRS = list(itertools.product(KINDS, KINDS))
PAIR_IDS = [f"{dtypes.KIND_NAME[a]}->{dtypes.KIND_NAME[b]}" for a, b in PAIRS]


@pytest.fixture(params=["reference", "cpu", "cuda"])
def backend(request):
    if request.param == "reference":
        return REFERENCE
    if request.param == "cpu":
        return CPU
    return cuda_backend_or_skip("cuda")


def bits(shape, kind, rng):
    """Random storage bits of ``kind``, with zeros, infinities, NaNs,
    subnormals and rounding ties mixed in."""
    dt = dtypes.STORAGE[kind]
    if kind == dtypes.F32:
        x = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFA00000,
                            0x00000001, 0x33000000, 0x3F808000, 0x3F818000, 0x477FF000,
                            0x387FE000], np.uint32)
    else:
        x = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
        special = np.array([0, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7D00, 0x0001, 0x7F80,
                            0x7FC1], np.uint16)
    flat = x.reshape(-1)
    pick = rng.integers(0, flat.size, size=min(flat.size, 3 * special.size))
    flat[pick] = special[np.arange(pick.size) % special.size]
    return x.view(dt)


def same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    u = np.uint32 if got.dtype.itemsize == 4 else np.uint16
    g, w = got.view(u), want.view(u)
    bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
    assert bad.size == 0, (f"{bad.size} elements differ, first at flat index {bad[0]}: "
                           f"got {g.reshape(-1)[bad[0]]:#x}, want {w.reshape(-1)[bad[0]]:#x}")


def run_both(be, op, args, outputs):
    """Run ``op`` on the reference with host copies of ``args`` and on ``be``
    with device copies; compare the arrays named by ``outputs`` (indices into
    ``args``) bit for bit."""
    ref_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    dev_args = [be.from_host(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
                for a in args]
    getattr(REFERENCE, op)(*ref_args)
    getattr(be, op)(*dev_args)
    be.synchronize()
    for i in outputs:
        same_bits(be.to_host(dev_args[i]), ref_args[i])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
def test_convert(backend, src_kind, dst_kind):
    rng = np.random.default_rng(1)
    src = bits((3, 5, 24), src_kind, rng)
    dst = bits((3, 5, 24), dst_kind, rng)
    run_both(backend, "convert", [src, src_kind, dst, dst_kind], [2])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
def test_write_slots(backend, src_kind, dst_kind):
    rng = np.random.default_rng(2)
    cache = bits((6, 3, 4, 16), dst_kind, rng)
    src = bits((9, 3, 16), src_kind, rng)
    slots = rng.permutation(24)[:9].astype(np.int64)
    slots[[2, 5]] = -1                                   # skipped tokens
    run_both(backend, "write_slots", [cache, src, slots, src_kind, Codec(dst_kind)], [0])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
def test_write_slots_kv_repeated_slot_keeps_the_last_token(backend, src_kind, dst_kind):
    rng = np.random.default_rng(3)
    k_cache, v_cache = bits((4, 2, 4, 8), dst_kind, rng), bits((4, 2, 4, 8), dst_kind, rng)
    k, v = bits((5, 2, 8), src_kind, rng), bits((5, 2, 8), src_kind, rng)
    slots = np.array([3, 9, 3, -1, 15], np.int64)
    owner = backend.slot_owner_table(16)
    run_both(backend, "write_slots_kv",
             [k_cache, v_cache, k, v, slots, src_kind, Codec(dst_kind), Codec(dst_kind), owner,
              False], [0, 1])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("start, n", [(0, 1), (5, 1), (3, 11), (0, 16)])
def test_write_positions(backend, src_kind, dst_kind, start, n):
    rng = np.random.default_rng(4)
    storage = bits((6, 8, 2, 4, 16), dst_kind, rng)      # 3 layers, 8 blocks of 4
    k, v = bits((n, 2, 16), src_kind, rng), bits((n, 2, 16), src_kind, rng)
    table = np.array([7, 2, 5, 0, 6], np.int32)
    run_both(backend, "write_positions",
             [storage, 1, k, v, table, start, src_kind, Codec(dst_kind), Codec(dst_kind)], [0])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("start, end", [(0, 0), (0, 1), (3, 13), (4, 20)])
def test_gather(backend, src_kind, dst_kind, start, end):
    rng = np.random.default_rng(5)
    cache = bits((8, 3, 4, 16), src_kind, rng)
    table = np.array([6, 1, 4, 0, 7], np.int32)
    out = bits((3, end - start, 16), dst_kind, rng)
    run_both(backend, "gather", [cache, table, start, end, out, Codec(src_kind), dst_kind], [4])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
def test_gather_batch(backend, src_kind, dst_kind):
    rng = np.random.default_rng(6)
    cache = bits((8, 2, 4, 16), src_kind, rng)
    tables = np.array([[3, 1, 0], [7, 0, 0], [2, 5, 6]], np.int32)
    lengths = np.array([9, 0, 12], np.int32)
    out = bits((3, 2, 12, 16), dst_kind, rng)
    run_both(backend, "gather_batch", [cache, tables, lengths, out, Codec(src_kind), dst_kind],
             [3])


@pytest.mark.parametrize("kind", KINDS, ids=[dtypes.KIND_NAME[k] for k in KINDS])
def test_copy_blocks(backend, kind):
    rng = np.random.default_rng(7)
    storage = bits((4, 8, 2, 4, 8), kind, rng)
    run_both(backend, "copy_blocks",
             [storage, np.array([0, 3, 3], np.int32), np.array([5, 1, 7], np.int32)], [0])


@pytest.mark.parametrize("kind", KINDS, ids=[dtypes.KIND_NAME[k] for k in KINDS])
def test_copy_blocks_between(backend, kind):
    rng = np.random.default_rng(8)
    src, dst = bits((4, 6, 2, 4, 8), kind, rng), bits((4, 5, 2, 4, 8), kind, rng)
    run_both(backend, "copy_blocks_between",
             [src, np.array([5, 0, 2], np.int32), dst, np.array([0, 4, 1], np.int32)], [2])


@pytest.mark.parametrize("src_kind, dst_kind", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("start, n", [(0, 1), (7, 1), (2, 9)])
def test_write_contiguous(backend, src_kind, dst_kind, start, n):
    rng = np.random.default_rng(9)
    dst = bits((2, 3, 16, 8), dst_kind, rng)
    src = bits((2, 3, n, 8), src_kind, rng)
    run_both(backend, "write_contiguous", [dst, src, start, src_kind, Codec(dst_kind)], [0])


# ------------------------------------------------------------ the oracle itself

# ------------------------------------------------- whole blocks (BlockPool routes
# import_blocks through write_block_bytes and copy_blocks_to through copier_for)
def _block_planes(rng, with_scales):
    """A pool's storage (planes, num_blocks, heads, block_size, dim) of
    float16 and, for int8-like pools, its float32 scales."""
    storage = rng.standard_normal((4, 6, 2, 3, 5)).astype(np.float16)
    if not with_scales:
        return [storage]
    return [rng.integers(-127, 128, storage.shape, dtype=np.int8),
            rng.standard_normal(storage.shape[:4]).astype(np.float32)]


def _block_payload(arrays, b):
    return np.concatenate([np.ascontiguousarray(a[:, b]).reshape(-1).view(np.uint8)
                           for a in arrays])


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_write_block_bytes(backend, with_scales, seeded):
    rng = np.random.default_rng(7)
    src = _block_planes(rng, with_scales)
    want = [a.copy() for a in src]
    dst_host = [np.zeros_like(a) for a in src]
    ids = [4, 0, 2]
    pays = [_block_payload(src, b) for b in (1, 3, 5)]
    for b, s in zip(ids, (1, 3, 5)):
        for w, a in zip(want, src):
            w[:, b] = a[:, s]
    for w, a in zip(want, dst_host):      # untouched blocks keep their zeros
        w[:, [1, 3, 5]] = 0
    seeds = [11, 2**64 - 1, 0] if seeded else None
    dst = [backend.from_host(a) for a in dst_host]
    digests = backend.write_block_bytes(dst, ids, pays, seeds, num_threads=2)
    for got, w in zip(dst, want):
        np.testing.assert_array_equal(backend.to_host(got), w)
    if seeded:
        assert digests == [xxhash.xxh3_64_intdigest(p.tobytes(), seed=s)
                           for p, s in zip(pays, seeds)]
    else:
        assert digests is None


def test_xxh3_64_is_exported_for_the_public_layer():
    data = np.arange(1000, dtype=np.uint8)
    assert xxh3_64(data, 5) == xxhash.xxh3_64_intdigest(data.tobytes(), seed=5)


def test_copier_for_leaves_host_copies_to_a_device_backend(backend):
    # a host backend cannot reach device memory: the other side drives
    assert CPU.copier_for(backend) is backend
    # a backend that drives its own copies keeps them whatever the peer
    if backend is not CPU:
        assert backend.copier_for(CPU) is backend


def test_reference_widening_of_every_half_pattern():
    h = np.arange(2**16, dtype=np.uint16)
    f16 = convert_bits(h, dtypes.F16, dtypes.F32)
    want = h.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(h.view(np.float16))
    same_bits(f16[~nan], want[~nan])
    assert (f16[nan] & 0x00400000).all()                  # NaNs come back quiet
    same_bits(convert_bits(h, dtypes.BF16, dtypes.F32), h.astype(np.uint32) << 16)


def test_reference_narrowing_rounds_to_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(10)
    x = np.concatenate([rng.integers(0, 2**32, size=1 << 18, dtype=np.uint32),
                        np.arange(0x38000000, 0x38800000, 997, dtype=np.uint32),  # subnormal
                        np.arange(0x477F0000, 0x47800000, 3, dtype=np.uint32)])   # overflow
    f = x.view(np.float32)
    ok = ~np.isnan(f)
    with np.errstate(over="ignore", invalid="ignore"):
        want16 = f.astype(np.float16).view(np.uint16)
        wantbf = f.astype(ml_dtypes.bfloat16).view(np.uint16)
    same_bits(convert_bits(x, dtypes.F32, dtypes.F16)[ok], want16[ok])
    same_bits(convert_bits(x, dtypes.F32, dtypes.BF16)[ok], wantbf[ok])
    # NaNs: quiet, same sign, top payload bits kept
    nan = np.array([0x7F800001, 0xFFC00000, 0x7FBFFFFF], np.uint32)
    same_bits(convert_bits(nan, dtypes.F32, dtypes.BF16),
              np.array([0x7FC0, 0xFFC0, 0x7FFF], np.uint16))
    same_bits(convert_bits(nan, dtypes.F32, dtypes.F16),
              np.array([0x7E00, 0xFE00, 0x7FFF], np.uint16))
