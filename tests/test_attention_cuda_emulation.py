"""The tiled CUDA attention kernel (kernels/attention.cu, ``kva_attention_split``)
under the host emulation (tests/_cuda_attention_emulation.py: the file
compiled for the host, a launch run block by block with its threads as
fibers), through ``CudaBackend.paged_attention``, against the float64
reference (the contract's 1e-5 relative, as in _cuda_cases.py): every page
kind, head_dim 64 and 128 (and 80, 96, 256), groups 1, 4 and 8, ragged
lengths, block sizes that are not powers of two (the kernel's multiply-high
division), splits (fixed and sized from the multiprocessor count), sliding
window, soft cap; the scalar kernel where the pages are not 16-byte
aligned; every visible key's K and V rows copied exactly once, 16 bytes at
a time, per item.
"""
import numpy as np
import pytest

from kvcore import dtypes
from kvcore.backends.cuda import attention_kernels as ak
from kvcore.dtypes import BF16, F16, F32, F8E4M3, F8E5M2, I8

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_attention_emulation import CXX, AttentionEmulation
    from ._cuda_cases import DeviceUnderTest, _attention_case
    from .test_cuda_host_emulation import EmulatedBackend, _get, _put
except ImportError:
    from _cuda_attention_emulation import CXX, AttentionEmulation
    from _cuda_cases import DeviceUnderTest, _attention_case
    from test_cuda_host_emulation import EmulatedBackend, _get, _put

ALL_KINDS = (F32, F16, BF16, F8E4M3, F8E5M2, I8)
KIND_IDS = ["f32", "f16", "bf16", "e4m3", "e5m2", "i8"]


class _AttentionOnly:
    """The part of the emulation library attention launches need."""

    def __init__(self, emu):
        self._emu = emu

    def attention(self):
        return self._emu


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if CXX is None:
        pytest.skip("needs a C++17 compiler")
    return AttentionEmulation(tmp_path_factory.mktemp("attention_emulation"))


@pytest.fixture
def dev(emu):
    emu.take_copies16()
    return DeviceUnderTest(EmulatedBackend(_AttentionOnly(emu)), _put, _get, 1)


def _expected_copies(kind, head_dim, num_heads, num_kv_heads, contexts, queries, window,
                     split_keys=None, num_sms=None):
    """16-byte copies of one call of the tiled kernel: each item's keys,
    K and V rows, once."""
    qsl = np.concatenate([[0], np.cumsum(queries)])
    items, _, _ = ak.plan(qsl, np.array(contexts), num_heads, num_kv_heads, window or 0,
                          split_keys=split_keys, num_sms=num_sms)
    per_row = head_dim * dtypes.ITEMSIZE[kind] // 16
    return int((items[:, 6] - items[:, 5]).sum()) * per_row * 2


def _split_names(dev):
    return [n for n, _, _ in dev.be.launches if n.startswith("kva_attention_split")]


@pytest.mark.parametrize("kind", ALL_KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("group", (1, 4, 8))
def test_tiled_kernel_matches_reference(dev, emu, kind, head_dim, group, monkeypatch):
    """Decode rows and a prefill chunk of ragged sequences over pages of 5
    tokens (tiles cross pages mid-way), split in 48-key pieces (merged)."""
    rng = np.random.default_rng(1000 * kind + head_dim + group)
    contexts, queries = [1, 37, 130, 9], [1, 1, 3, 2]
    _attention_case(dev, rng, kind, head_dim, 2 * group, 2, contexts=contexts,
                    queries=queries, block_size=5, split_keys=48, monkeypatch=monkeypatch)
    assert _split_names(dev) == [ak.split_name(kind, head_dim)]
    assert any(n.startswith("kva_attention_merge") for n, _, _ in dev.be.launches)
    assert emu.take_copies16() == _expected_copies(kind, head_dim, 2 * group, 2, contexts,
                                                   queries, None, split_keys=48)


@pytest.mark.parametrize("kind", (F16, BF16, F8E4M3, I8), ids=["f16", "bf16", "e4m3", "i8"])
def test_tiled_kernel_window_and_soft_cap(dev, kind, monkeypatch):
    rng = np.random.default_rng(70 + kind)
    for window, cap in ((20, None), (None, 5.0), (33, 2.0)):
        _attention_case(dev, rng, kind, 96, 8, 2, contexts=[150, 40], queries=[4, 1],
                        block_size=16, window=window, cap=cap, split_keys=64,
                        monkeypatch=monkeypatch)
    assert set(_split_names(dev)) == {ak.split_name(kind, 96)}


@pytest.mark.parametrize("block_size", (1, 3, 7, 64, 100))
def test_tiled_kernel_block_sizes(dev, emu, block_size):
    """Pages smaller than a tile (many pages per tile), larger, not a power
    of two: the per-tile page walk and the multiply-high division."""
    rng = np.random.default_rng(block_size)
    contexts, queries = [150, 2, 65], [2, 1, 1]
    _attention_case(dev, rng, F16, 64, 4, 1, contexts=contexts, queries=queries,
                    block_size=block_size)
    assert _split_names(dev) == [ak.split_name(F16, 64)]
    assert emu.take_copies16() == _expected_copies(F16, 64, 4, 1, contexts, queries, None)


@pytest.mark.parametrize("head_dim,kind", [(80, F16), (256, F32), (256, F8E5M2)])
def test_tiled_kernel_other_head_dims(dev, head_dim, kind):
    rng = np.random.default_rng(head_dim)
    _attention_case(dev, rng, kind, head_dim, 12, 4, contexts=[70, 13], queries=[2, 3],
                    block_size=8)
    assert _split_names(dev) == [ak.split_name(kind, head_dim)]


def test_splits_sized_from_the_multiprocessor_count(dev, emu):
    """A one-sequence decode on a device of 4 multiprocessors is split so
    its items fill them (the plan's split_keys_for), merged, and matches."""
    dev.be._sms = 4
    rng = np.random.default_rng(5)
    a = _attention_case(dev, rng, F16, 64, 4, 2, contexts=[600], queries=[1])
    names = [n for n, _, _ in dev.be.launches]
    assert names == [ak.split_name(F16, 64), ak.merge_name(64)], names
    grid = dev.be.launches[0][1]
    assert grid == 2 * -(-600 // ak.split_keys_for([0, 1], [600], 4, 2, 0, 4))
    assert 2 < grid <= ak.BLOCKS_PER_SM * 4 + 2   # split, about the target
    assert emu.take_copies16() == _expected_copies(F16, 64, 4, 2, [600], [1], None, num_sms=4)
    # the same call again: the same bits (a fixed merge order, no atomics)
    b = _attention_case(dev, np.random.default_rng(5), F16, 64, 4, 2, contexts=[600],
                        queries=[1])
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def _shifted_put(shift):
    """``put`` that places 4-d arrays (the pages) ``shift`` bytes past a
    16-byte boundary (element-aligned, not 16-byte aligned)."""
    def put(a):
        a = np.ascontiguousarray(a)
        if a.ndim != 4:
            return _put(a)
        buf = _put(np.zeros(a.nbytes + 32, np.uint8))
        start = (-buf.ctypes.data) % 16 + shift
        d = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        d[...] = a
        return d
    return put


@pytest.mark.parametrize("kind", (F32, F16, F8E4M3), ids=["f32", "f16", "e4m3"])
def test_pages_off_16_bytes_take_the_scalar_kernel(emu, kind):
    """Pages that are element-aligned but not 16-byte aligned run the
    scalar kernel (the tiled one's 16-byte copies would fault)."""
    emu.take_copies16()
    be = EmulatedBackend(_AttentionOnly(emu))
    dev = DeviceUnderTest(be, _shifted_put(dtypes.ITEMSIZE[kind]), _get, 1)
    rng = np.random.default_rng(3)
    _attention_case(dev, rng, kind, 64, 8, 2, contexts=[40, 7], queries=[1, 2],
                    block_size=8)
    assert _split_names(dev) == [ak.scalar_name(kind, 64)]
    assert emu.take_copies16() == 0


def test_tiled_ok():
    assert ak.tiled_ok((0x1000, 0x2000), (4096, 1024, 128), 16)
    assert not ak.tiled_ok((0x1002, 0x2000), (4096, 1024, 128), 16)
    assert not ak.tiled_ok((0x1000, 0x2008), (4096, 1024, 128), 16)
    assert not ak.tiled_ok((0x1000, 0x2000), (4096, 1024, 136), 16)
    assert not ak.tiled_ok((0x1000, 0x2000), (4096, 1024, 128), 2 ** 31)


def test_tile_keys_match_the_kernel():
    for kind in ALL_KINDS:
        for d in ak.HEAD_DIMS:
            row = d * dtypes.ITEMSIZE[kind]
            assert row % 16 == 0 and d % 16 == 0
            assert ak.tile_keys(kind, d) == min(64, ak.TILE_BYTES // row)
