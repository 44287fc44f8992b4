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
from kvcore.backends import Codec
from kvcore.backends.cuda import attention_kernels as ak
from kvcore.dtypes import BF16, F16, F32, F8E4M3, F8E5M2, I8

# builds and runs the C/CUDA sources outside the extension (see pyproject's markers)
pytestmark = pytest.mark.toolchain

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_attention_emulation import CXX, AttentionEmulation
    from ._cuda_cases import (FP8_SCALES, DeviceUnderTest, _attention_case, _io_bits,
                              _io_values, attention_io)
    from .test_cuda_host_emulation import EmulatedBackend, _get, _put
except ImportError:
    from _cuda_attention_emulation import CXX, AttentionEmulation
    from _cuda_cases import (FP8_SCALES, DeviceUnderTest, _attention_case, _io_bits,
                             _io_values, attention_io)
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


# ------------------------------------------------ tensor-core prefill
# kva_attention_prefill feeds q * scale and the softmax weights P to the
# mma as float16 / bfloat16 (rounded to nearest even), products summed in
# float32: against the float64 reference its error (max abs error / max
# abs value, as above) is held to PREFILL_TOL (docs/gpu.md), where the
# float32 kernels are held to 1e-5.
PREFILL_TOL = {F16: 1e-3, BF16: 8e-3}


def _prefill_case(dev, rng, kind, head_dim, num_heads, num_kv_heads, contexts, queries,
                  block_size=16, window=None, cap=None, q_dtype="float32", out_dtype="float32",
                  chunk=None, alibi=None, sinks=None, scale=None):
    """One call with the tensor-core path on: (got, want, error); q and out
    handed over in ``q_dtype`` / ``out_dtype`` (out poisoned with NaN);
    chunk / alibi / sinks / scale as in _attention_case."""
    import ml_dtypes

    from kvcore.backends.base import paged_attention_reference

    dev.be._tensor_cores = True
    need = [-(-c // block_size) for c in contexts]
    num_blocks = sum(need) + 2
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    vals = rng.standard_normal((2, *shape)).astype(np.float32)
    if kind == F16:
        k, v = vals.astype(np.float16)
    else:
        k, v = vals.astype(ml_dtypes.bfloat16).view(np.uint16)
    perm = rng.permutation(num_blocks)
    tables = np.full((len(contexts), max(need)), 0, np.int32)
    a = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[a:a + n]
        a += n
    lens, qsl, q_in, q, scale, out = attention_io(dev, rng, contexts, queries, num_heads,
                                                  head_dim, scale, q_dtype, out_dtype)
    feats = {name: dev.put(np.asarray(a, np.float32)) for name, a in
             (("alibi_slopes", alibi), ("sinks", sinks)) if a is not None}
    dev.be.paged_attention(dev.put(q_in), out, dev.put(k), dev.put(v), kind, tables, lens, qsl,
                           scale, window or 0, cap or 0.0, chunk_size=chunk or 0, **feats)
    got = _io_values(dev.get(out), out_dtype)
    assert not np.isnan(got).any()
    want = paged_attention_reference(
        q, k, v, tables, lens, qsl, scale=scale, sliding_window=window, logits_soft_cap=cap,
        kind="bfloat16" if kind == BF16 else None, chunk_size=chunk, alibi_slopes=alibi,
        sinks=sinks)
    return got, want, np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("kind", (F16, BF16), ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("group", (1, 4, 8))
def test_prefill_kernel_matches_reference(dev, emu, kind, head_dim, group):
    """A chunked prefill (70 queries over 25 past keys, pages of 7 tokens),
    a whole prefill of 64, and a decode row in one call: the prefill rows
    on tensor cores, the decode row on the tiled kernel."""
    rng = np.random.default_rng(500 + 10 * kind + head_dim + group)
    got, want, err = _prefill_case(dev, rng, kind, head_dim, 2 * group, 2,
                                   contexts=[95, 64, 40], queries=[70, 64, 1], block_size=7)
    names = [n for n, _, _ in dev.be.launches]
    assert names == [ak.split_name(kind, head_dim), ak.prefill_tc_name(kind, head_dim)], names
    assert err <= PREFILL_TOL[kind], err
    # the decode row went through the float32 path: the contract's 1e-5
    row = np.abs(got[-1] - want[-1]).max() / np.abs(want[-1]).max()
    assert row <= 1e-5, row


@pytest.mark.parametrize("kind", (F16, BF16), ids=["f16", "bf16"])
def test_prefill_kernel_window_soft_cap_and_odd_groups(dev, kind):
    rng = np.random.default_rng(kind)
    for window, cap, nh, nkv in ((20, None, 12, 1), (None, 5.0, 6, 2), (33, 2.0, 3, 3)):
        _, _, err = _prefill_case(dev, rng, kind, 96, nh, nkv, contexts=[150], queries=[100],
                                  block_size=16, window=window, cap=cap)
        assert err <= PREFILL_TOL[kind], (window, cap, nh, nkv, err)
        assert [n for n, _, _ in dev.be.launches][-1] == ak.prefill_tc_name(kind, 96)


def test_prefill_kernel_off_16_bytes(emu):
    """Pages off 16 bytes: the prefill kernel copies element by element."""
    emu.take_copies16()
    be = EmulatedBackend(_AttentionOnly(emu))
    dev = DeviceUnderTest(be, _shifted_put(2), _get, 1)
    _, _, err = _prefill_case(dev, np.random.default_rng(4), F16, 64, 4, 2, contexts=[80],
                              queries=[66], block_size=5)
    assert [n for n, _, _ in be.launches] == [ak.prefill_tc_name(F16, 64)]
    assert err <= PREFILL_TOL[F16] and emu.take_copies16() == 0


def test_short_query_runs_stay_off_tensor_cores(dev):
    """Under PREFILL_MIN_QUERIES queries a sequence keeps the float32 path
    (the contract's 1e-5): decode and short chunks are not rounded."""
    got, want, err = _prefill_case(dev, np.random.default_rng(6), BF16, 64, 8, 2,
                                   contexts=[90, 30], queries=[ak.PREFILL_MIN_QUERIES - 1, 3])
    assert [n for n, _, _ in dev.be.launches] == [ak.split_name(BF16, 64)]
    assert err <= 1e-5


@pytest.mark.parametrize("kind", (F16, BF16), ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", (80, 256))
def test_prefill_tc_other_head_dims(dev, kind, head_dim):
    """head_dim 80 (an odd number of k-steps) and 256 (one m16 tile per
    warp, 32-key tiles); a chunk over earlier pages and a whole prefill."""
    got, want, err = _prefill_case(dev, np.random.default_rng(head_dim + kind), kind, head_dim,
                                   8, 2, contexts=[170, 70], queries=[100, 70], block_size=16)
    assert [n for n, _, _ in dev.be.launches] == [ak.prefill_tc_name(kind, head_dim)]
    assert err <= PREFILL_TOL[kind], err


@pytest.mark.parametrize("kind,q_dtype,out_dtype", [(F16, "float16", "float16"),
                                                    (BF16, "bfloat16", "float32"),
                                                    (F16, "bfloat16", "bfloat16")])
def test_prefill_tc_reads_q_and_writes_out_in_their_dtype(dev, kind, q_dtype, out_dtype):
    _, _, err = _prefill_case(dev, np.random.default_rng(kind), kind, 64, 8, 2, contexts=[80],
                              queries=[80], q_dtype=q_dtype, out_dtype=out_dtype)
    assert [n for n, _, _ in dev.be.launches] == [ak.prefill_tc_name(kind, 64)]
    assert err <= PREFILL_TOL[kind] + (2.0 ** -8 if out_dtype == "bfloat16" else 2.0 ** -11)


def test_prefill_version_2_runs_the_older_kernel(dev):
    dev.be.attention_version = 2
    _, _, err = _prefill_case(dev, np.random.default_rng(12), F16, 64, 8, 2, contexts=[95],
                              queries=[70], block_size=7)
    assert [n for n, _, _ in dev.be.launches] == [ak.prefill_name(F16, 64)]
    assert err <= PREFILL_TOL[F16]


def test_prefill_tc_plan_covers_each_pair_once_longest_first():
    qsl = np.array([0, 70, 71, 71 + 300])
    lens = np.array([90, 5, 300])
    for nh, nkv, d, window in ((8, 8, 64, 0), (32, 8, 128, 0), (24, 2, 256, 50)):
        items, mask = ak.prefill_tc_plan(qsl, lens, nh, nkv, window, d)
        G, rows = nh // nkv, ak.prefill_tc_rows(d)
        assert mask.tolist() == [True] * 70 + [False] + [True] * 300
        seen, work = [], []
        for s, g, p0, n in items.tolist():
            assert 0 < n <= rows and p0 % rows == 0 and p0 + n <= (qsl[s + 1] - qsl[s]) * G
            seen += [(qsl[s] + p // G, g * G + p % G) for p in range(p0, p0 + n)]
            pos0 = lens[s] - (qsl[s + 1] - qsl[s])
            hi = pos0 + (p0 + n - 1) // G + 1
            work.append(hi - (max(0, pos0 + p0 // G + 1 - window) if window else 0))
        assert sorted(seen) == sorted((r, h) for r in np.flatnonzero(mask) for h in range(nh))
        assert work == sorted(work, reverse=True)


def test_prefill_plan_covers_each_prefill_row_and_head_once():
    qsl = np.array([0, 70, 71, 71 + 130])
    for nh, nkv in ((8, 8), (32, 8), (24, 2)):
        items, mask = ak.prefill_plan(qsl, nh, nkv)
        G = nh // nkv
        assert mask.tolist() == [True] * 70 + [False] + [True] * 130
        seen = set()
        for s, r0, rows, g in items.tolist():
            assert 0 < rows <= ak.PREFILL_PAIRS // G and qsl[s] <= r0 and r0 + rows <= qsl[s + 1]
            seen |= {(r, h) for r in range(r0, r0 + rows) for h in range(g * G, (g + 1) * G)}
        assert seen == {(r, h) for r in np.flatnonzero(mask) for h in range(nh)}
        # the rest goes to the split kernel
        split_items, _, _ = ak.plan(qsl, [70, 1, 130], nh, nkv, 0, rows=~mask)
        assert set(split_items[:, 1].tolist()) == {70}


# ------------------------------------------------ tensor-core decode (v3)
# kva_decode_tc: float16 / bfloat16 / fp8 pages, q in the mma's type (the
# pages' for float16 / bfloat16, either for fp8), P split into 2-3 terms:
# held to the float32 paths' 1e-5 (the emulation's mma rounds toward zero,
# a pessimistic model of the tensor cores; it measures under 1e-6).
TC_IO = {F16: ("float16",), BF16: ("bfloat16",), F8E4M3: ("float16", "bfloat16"),
         F8E5M2: ("bfloat16", "float16")}
TC_IDS = ["f16", "bf16", "e4m3", "e5m2"]


def _tc_names(dev):
    return [n for n, _, _ in dev.be.launches]


def _tc_copies(items, kind, head_dim):
    """16-byte copies of a tensor-core decode launch: K and V rows of each
    item's keys, once."""
    return int((items[:, 5] - items[:, 4]).sum()) * head_dim * dtypes.ITEMSIZE[kind] // 16 * 2


@pytest.fixture
def tc_dev(emu):
    emu.take_copies16()
    be = EmulatedBackend(_AttentionOnly(emu))
    be._tensor_cores = True
    return DeviceUnderTest(be, _put, _get, 1)


@pytest.mark.parametrize("kind", ak.TC_KINDS, ids=TC_IDS)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("group", (1, 4, 8))
def test_tensor_core_decode_matches_reference(tc_dev, emu, kind, head_dim, group, monkeypatch):
    """Decode rows and short chunks of ragged sequences over pages of 5
    tokens, split in 48-key pieces: one launch (its splits merged by their
    last block), float32 out and out in q's dtype, every K/V row copied
    once per item."""
    rng = np.random.default_rng(2000 + 100 * kind + head_dim + group)
    q_dtype = TC_IO[kind][group % len(TC_IO[kind])]
    for out_dtype in ("float32", q_dtype):
        items = []
        _attention_case(tc_dev, rng, kind, head_dim, 2 * group, 2, contexts=[1, 37, 130, 9],
                        queries=[1, 1, 3, 2], block_size=5, split_keys=48,
                        monkeypatch=monkeypatch, layer_scales=FP8_SCALES, q_dtype=q_dtype,
                        out_dtype=out_dtype,
                        plan_hook=lambda p: items.append(tc_dev.be._download(p.tc_items)))
        assert _tc_names(tc_dev)[-1:] == [ak.tc_name(kind, head_dim, dtypes.NAME_KIND[q_dtype])]
        assert emu.take_copies16() == _tc_copies(items[0], kind, head_dim)
        assert (items[0][:, 6] > 0).any()   # split: merged in the kernel
    assert not any(n.startswith("kva_attention_merge") for n in _tc_names(tc_dev))


@pytest.mark.parametrize("kind", ak.TC_KINDS, ids=TC_IDS)
@pytest.mark.parametrize("head_dim,nh,nkv,queries", [
    (80, 12, 1, [2, 1]),     # 24 pairs: two items of one sequence's rows
    (96, 6, 2, [5, 3]),      # queries of one item at 3 positions (causal mask inside)
    (64, 16, 1, [1, 1]),     # a whole m16 tile of heads
    (128, 3, 3, [4, 2]),     # MHA, 4 queries per item
])
def test_tensor_core_decode_shapes(tc_dev, kind, head_dim, nh, nkv, queries):
    rng = np.random.default_rng([kind, head_dim, nh])
    _attention_case(tc_dev, rng, kind, head_dim, nh, nkv, contexts=[90, 40], queries=queries,
                    block_size=16, layer_scales=FP8_SCALES, q_dtype=TC_IO[kind][0],
                    out_dtype=TC_IO[kind][-1])
    assert _tc_names(tc_dev) == [ak.tc_name(kind, head_dim, dtypes.NAME_KIND[TC_IO[kind][0]])]


@pytest.mark.parametrize("kind", (F16, BF16, F8E4M3), ids=["f16", "bf16", "e4m3"])
def test_tensor_core_decode_window_and_soft_cap(tc_dev, kind, monkeypatch):
    rng = np.random.default_rng(80 + kind)
    for window, cap in ((20, None), (None, 5.0), (33, 2.0), (1, None)):
        _attention_case(tc_dev, rng, kind, 64, 8, 2, contexts=[150, 40], queries=[4, 1],
                        block_size=16, window=window, cap=cap, split_keys=64,
                        monkeypatch=monkeypatch, layer_scales=FP8_SCALES,
                        q_dtype=TC_IO[kind][0])
        assert _tc_names(tc_dev)[-1].startswith("kva_decode_tc<")


@pytest.mark.parametrize("block_size", (1, 3, 16, 100))
def test_tensor_core_decode_block_sizes(tc_dev, emu, block_size):
    rng = np.random.default_rng(block_size)
    items = []
    _attention_case(tc_dev, rng, F16, 64, 4, 1, contexts=[150, 2, 65], queries=[2, 1, 1],
                    block_size=block_size, q_dtype="float16",
                    plan_hook=lambda p: items.append(tc_dev.be._download(p.tc_items)))
    assert emu.take_copies16() == _tc_copies(items[0], F16, 64)


def test_tensor_core_splits_give_the_same_bits_in_any_block_order(tc_dev, emu):
    """One long sequence on a device of 4 multiprocessors: split to fill
    them, merged by whichever split finishes last (its ticket), in split
    order: the blocks run first to last and last to first give the same
    bits, and the tickets are back to 0 after each run (a replay)."""
    be = tc_dev.be
    be._sms = 4
    runs = []
    try:
        for reverse in (False, True, False):
            emu.reverse_blocks(reverse)
            plans = []
            runs.append(_attention_case(tc_dev, np.random.default_rng(5), F16, 128, 8, 2,
                                        contexts=[700], queries=[1], q_dtype="float16",
                                        plan_hook=plans.append))
            counters = be._download(plans[0].counters)
            nsplit = be._download(plans[0].tc_nsplit)
            assert nsplit.max() > 1 and not counters.any()
    finally:
        emu.reverse_blocks(False)
    for r in runs[1:]:
        np.testing.assert_array_equal(runs[0].view(np.uint32), r.view(np.uint32))
    assert ak.TC_BLOCKS_PER_SM * 4 <= len(nsplit) <= ak.TC_BLOCKS_PER_SM * 4 + 2


def test_tensor_core_decode_only_for_its_q_kinds(tc_dev):
    """float32 q (or q of another kind than the mma's) runs the float32
    kernels of the same plan, which also read float16 / bfloat16 q and
    write float16 / bfloat16 out themselves."""
    rng = np.random.default_rng(9)
    for kind, q_dtype, out_dtype in ((F16, "float32", "float16"), (F16, "bfloat16", "float32"),
                                     (BF16, "float16", "bfloat16"), (F32, "float16", "float16"),
                                     (I8, "bfloat16", "bfloat16")):
        tc_dev.be.launches.clear()
        _attention_case(tc_dev, rng, kind, 64, 8, 2, contexts=[70, 9], queries=[1, 2],
                        q_dtype=q_dtype, out_dtype=out_dtype, layer_scales=(1.0, 1.0))
        assert _tc_names(tc_dev) == [ak.split_name(kind, 64)], (kind, q_dtype)


def test_version_2_plans_run_the_old_kernels(tc_dev):
    """attention_version = 2: the kernels before the tensor-core decode,
    float32 q and out only (AttentionPlan converts the others)."""
    be = tc_dev.be
    be.attention_version = 2
    rng = np.random.default_rng(10)
    plans = []
    _attention_case(tc_dev, rng, F16, 64, 8, 2, contexts=[70, 9], queries=[1, 2],
                    plan_hook=plans.append)
    assert _tc_names(tc_dev) == [ak.split_name(F16, 64)]
    assert plans[0].tc_items is None
    assert be.attention_io_kinds(plans[0]) == ({F32}, {F32})
    with pytest.raises(TypeError, match="q must be float32 for this plan"):
        _attention_case(tc_dev, rng, F16, 64, 8, 2, contexts=[70, 9], queries=[1, 2],
                        q_dtype="float16")
    be.attention_version = 3
    _attention_case(tc_dev, rng, F16, 64, 8, 2, contexts=[70, 9], queries=[1, 2],
                    q_dtype="float16", plan_hook=plans.append)
    assert be.attention_io_kinds(plans[-1]) == ({F32, F16, BF16},) * 2
    assert _tc_names(tc_dev)[-1] == ak.tc_name(F16, 64, F16)


def test_attention_version_from_the_environment():
    from kvcore.backends.cuda.attention import default_attention_version

    assert default_attention_version({}) == 3
    assert default_attention_version({"KVCORE_CUDA_ATTENTION": "v2"}) == 2
    assert default_attention_version({"KVCORE_CUDA_ATTENTION": " V3 "}) == 3
    with pytest.raises(ValueError, match="KVCORE_CUDA_ATTENTION must be v2 or v3"):
        default_attention_version({"KVCORE_CUDA_ATTENTION": "fast"})


def test_tensor_core_decode_pages_off_16_bytes_take_the_scalar_kernel(emu):
    be = EmulatedBackend(_AttentionOnly(emu))
    be._tensor_cores = True
    dev = DeviceUnderTest(be, _shifted_put(2), _get, 1)
    _attention_case(dev, np.random.default_rng(3), F16, 64, 8, 2, contexts=[40, 7],
                    queries=[1, 2], block_size=8, q_dtype="float16", out_dtype="float16")
    assert [n for n, _, _ in be.launches] == [ak.scalar_name(F16, 64)]


@pytest.mark.parametrize("qk", (F8E4M3, F8E5M2), ids=["e4m3", "e5m2"])
def test_tensor_core_decode_nan_codes(tc_dev, qk):
    """An fp8 NaN code in a key row: NaN in exactly the outputs of the
    queries that see it, as on the CPU.  In a value row: NaN in that dim of
    every query that sees it, and possibly of others of the same item
    whose 16-key tile holds it (0 x NaN), never another dim or kv head."""
    got, cpu = _attention_case(tc_dev, np.random.default_rng([57, qk]), qk, 64, 4, 2,
                               contexts=[30, 12, 16], queries=[20, 1, 1], block_size=4,
                               layer_scales=FP8_SCALES, nan_rows=[(0, 0, 13, 0)],
                               q_dtype="float16")
    want = np.zeros(got.shape, bool)
    want[3:20, :2] = True
    assert (np.isnan(got) == want).all() and (np.isnan(cpu) == want).all()
    assert _tc_names(tc_dev)[-1].startswith("kva_decode_tc<")
    got, cpu = _attention_case(tc_dev, np.random.default_rng([58, qk]), qk, 64, 4, 2,
                               contexts=[30, 12, 16], queries=[20, 1, 1], block_size=4,
                               layer_scales=FP8_SCALES, nan_rows=[(1, 0, 22, 1)],
                               q_dtype="bfloat16")
    want = np.zeros(got.shape, bool)
    want[12:20, 2:, 3] = True
    nan = np.isnan(got)
    assert (nan >= want).all() and not nan[:, :2].any() and not np.delete(nan, 3, 2).any()


# ------------------------------------------------ the fast lane (bind)
def _layer_reference(storage, layer, q, tables, lens, qsl, scale, kind, scales=None):
    from kvcore.backends.base import paged_attention_reference

    kw = dict(kind=dtypes.KIND_NAME[kind])
    if scales is not None:
        kw.update(key_scales=scales[0], value_scales=scales[1])
    return paged_attention_reference(q, storage[2 * layer], storage[2 * layer + 1], tables,
                                     lens, qsl, scale=scale, **kw)


@pytest.mark.parametrize("kind", (F16, F8E4M3, I8, F32), ids=["f16", "e4m3", "i8", "f32"])
def test_fast_lane_runs_each_layer_as_the_general_path(tc_dev, kind):
    """``CudaAttentionPlan.bind`` (AttentionPlan.run's fast lane): each
    layer's planes found from layer 0's and the layer stride, fp8 layer
    scales and int8 scale planes per layer, q / out float16 or float32 as
    they are (the tensor-core decode for float16 q over f16 / fp8 pages),
    out=None a new float32 array; anything it does not take is
    NotImplemented (the general path decides)."""
    be = tc_dev.be
    rng = np.random.default_rng([11, kind])
    L, nb, H, KVH, bs, D = 3, 20, 8, 2, 16, 64
    vals = rng.standard_normal((2 * L, nb, KVH, bs, D)).astype(np.float32)
    scales = layer_scales = None
    if kind == F16:
        storage = vals.astype(np.float16)
    elif kind == F32:
        storage = vals
    elif kind == F8E4M3:
        from kvcore.backends.base import fp8_encode
        layer_scales = np.array([(0.5 + l, 2.0 - 0.25 * l) for l in range(L)], np.float32)
        storage = np.stack([fp8_encode(vals[i], kind, float(layer_scales[i // 2][i % 2]))
                            for i in range(2 * L)])
    else:
        from kvcore.backends.base import int8_encode
        storage, sc = int8_encode(vals)
        scales = _put(np.ascontiguousarray(sc))          # (2L, nb, KVH, bs)
    d_storage = _put(storage)
    tables = rng.permutation(nb)[:12].astype(np.int32).reshape(2, 6)
    lens, qsl = np.array([90, 17]), np.array([0, 1, 3])
    plan = be.attention_plan(tables, lens, qsl, num_heads=H, num_kv_heads=KVH, head_dim=D,
                             block_size=bs, num_blocks=nb, kind=kind, scale=0.125,
                             sliding_window=0, soft_cap=0.0)
    codecs = None
    if scales is not None:
        codecs = [(Codec(kind, 1.0, scales[2 * l]), Codec(kind, 1.0, scales[2 * l + 1]))
                  for l in range(L)]
    elif layer_scales is not None:
        codecs = [(Codec(kind, float(k)), Codec(kind, float(v))) for k, v in layer_scales]
    fast = plan.bind(d_storage[0], d_storage[1], d_storage[2 * L - 2], d_storage[2 * L - 1], L,
                     codecs=codecs)
    assert fast is not None
    for layer in range(L):
        for q_dtype in ("float16", "float32"):
            q32 = rng.standard_normal((3, H, D)).astype(np.float32)
            q = _put(q32.astype(q_dtype))
            be.launches.clear()
            if layer == 1:
                out = fast(q, layer)
                assert out.dtype == np.float32
            else:
                out = _put(np.full((3, H, D), np.nan, q_dtype))
                assert fast(q, layer, out) is out
            if kind == F8E4M3:
                ref_sc = tuple(float(s) for s in layer_scales[layer])
            elif kind == I8:
                ref_sc = (np.asarray(scales[2 * layer]), np.asarray(scales[2 * layer + 1]))
            else:
                ref_sc = None
            want = _layer_reference(storage, layer, q.astype(np.float32), tables, lens, qsl,
                                    0.125, kind, ref_sc)
            got = np.asarray(out).astype(np.float32)
            ulp = 2.0 ** (np.floor(np.log2(np.abs(want) + 1e-30)) - 10) if q_dtype == "float16" \
                else 0
            assert (np.abs(got - want) - ulp).max() <= 1e-5 * np.abs(want).max()
            tc = kind in ak.TC_KINDS and q_dtype == "float16"
            assert [n for n, _, _ in be.launches][0].startswith(
                "kva_decode_tc<" if tc else "kva_attention_split<")
    q = _put(np.zeros((3, H, D), np.float16))
    for args in ((q, L), (q, -1), (q, 1.0), (_put(np.zeros((3, H, D + 1), np.float16)), 0),
                 (np.zeros((3, H, D), np.float16), 0), (q[:, ::-1], 0)):
        assert fast(*args) is NotImplemented
    over_pool = d_storage.reshape(-1).view(np.uint8)[-3 * H * D * 2:].view(np.float16)
    assert fast(q, 0, over_pool.reshape(3, H, D)) is NotImplemented   # out over the planes
    assert fast(q, 0, q) is NotImplemented                            # out over q
    with plan.lock:   # a run in progress: the general path raises
        assert fast(q, 0) is NotImplemented


def test_fast_lane_is_not_bound_where_it_cannot_be(tc_dev):
    be = tc_dev.be
    st = _put(np.zeros((4, 10, 2, 16, 64), np.float16))
    plan = be.attention_plan(np.zeros((1, 2), np.int32), np.array([20]), np.array([0, 1]),
                             num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                             num_blocks=10, kind=F16, scale=0.1, sliding_window=0, soft_cap=0.0)
    assert plan.bind(st[0], st[1], st[2], st[3], 2) is not None
    # 4 layers whose last K plane lies 1 plane (not a multiple of 3 layer strides) away
    assert plan.bind(st[0], st[1], st[1], st[2], 4) is None
    per_head = Codec(F8E4M3, head_scales=np.ones(2, np.float32))
    assert plan.bind(st[0], st[1], st[2], st[3], 2, codecs=[(per_head, per_head)] * 2) is None
    assert plan.bind(np.zeros((10, 2, 16, 64), np.float16), st[1], st[2], st[3], 2) is None


# ------------------------------------------------ issue 39 features, 38.3 scales
# chunked attention, ALiBi, sinks and every accepted scale in every CUDA
# kernel, against the float64 reference: the float32 kernels and the
# tensor-core decode within 1e-5, the prefill kernels within PREFILL_TOL.
def _features(rng, num_heads, which):
    """Keyword arguments of one feature case (num_heads query heads)."""
    slopes = (2.0 ** (-8.0 * (np.arange(num_heads) + 1) / num_heads)).astype(np.float32)
    sinks = (rng.standard_normal(num_heads) * 2).astype(np.float32)
    sinks[0] = 25.0   # a sink above every key's score: its branch of the norm
    return {
        "chunk": dict(chunk=7),
        "chunk+window": dict(chunk=16, window=9),
        "alibi": dict(alibi=slopes),
        "sinks": dict(sinks=sinks),
        "all": dict(chunk=32, window=40, alibi=slopes, sinks=sinks, cap=30.0),
        "scale 1e38": dict(scale=1e38),
        "scale -1e38, sinks, alibi": dict(scale=-1e38, sinks=sinks, alibi=slopes),
        "scale 1e38, cap": dict(scale=1e38, cap=5.0),
        "scale 3e3": dict(scale=3e3, chunk=11),
    }[which]


FEATURE_CASES = ["chunk", "chunk+window", "alibi", "sinks", "all", "scale 1e38",
                 "scale -1e38, sinks, alibi", "scale 1e38, cap", "scale 3e3"]


@pytest.mark.parametrize("which", FEATURE_CASES)
@pytest.mark.parametrize("kind", (F32, F16, F8E4M3, I8), ids=["f32", "f16", "e4m3", "i8"])
def test_features_in_the_float32_kernels(dev, kind, which, monkeypatch):
    """The tiled split kernel and the merge (splits of 16 keys) with q in
    float32: decode rows and short chunks of ragged sequences."""
    rng = np.random.default_rng([39, kind, FEATURE_CASES.index(which)])
    feats = _features(rng, 8, which)
    _attention_case(dev, rng, kind, 64, 8, 2, contexts=[1, 37, 130, 9], queries=[1, 1, 3, 2],
                    block_size=5, split_keys=16, monkeypatch=monkeypatch,
                    layer_scales=FP8_SCALES, **feats)
    names = _split_names(dev)
    assert names == [ak.split_name(kind, 64)]
    # (chunks shorter than a split: no row has two)
    assert any(n.startswith("kva_attention_merge") for n, _, _ in dev.be.launches) \
        == (feats.get("chunk", 99) > 16)


@pytest.mark.parametrize("which", ("all", "scale -1e38, sinks, alibi"))
def test_features_in_the_scalar_kernel(emu, which):
    be = EmulatedBackend(_AttentionOnly(emu))
    dev = DeviceUnderTest(be, _shifted_put(2), _get, 1)
    rng = np.random.default_rng(4)
    _attention_case(dev, rng, F16, 64, 8, 2, contexts=[70, 7], queries=[1, 2], block_size=8,
                    **_features(rng, 8, which))
    assert [n for n, _, _ in be.launches] == [ak.scalar_name(F16, 64)]


@pytest.mark.parametrize("which", FEATURE_CASES)
@pytest.mark.parametrize("kind", (F16, BF16, F8E5M2), ids=["f16", "bf16", "e5m2"])
def test_features_in_the_tensor_core_decode(tc_dev, kind, which, monkeypatch):
    """q in the mma's type, splits of 48 keys merged by the last block."""
    rng = np.random.default_rng([40, kind, FEATURE_CASES.index(which)])
    _attention_case(tc_dev, rng, kind, 64, 8, 2, contexts=[1, 37, 130, 9],
                    queries=[1, 1, 3, 2], block_size=5, split_keys=48, monkeypatch=monkeypatch,
                    layer_scales=FP8_SCALES, q_dtype=TC_IO[kind][-1],
                    **_features(rng, 8, which))
    assert _tc_names(tc_dev) == [ak.tc_name(kind, 64, dtypes.NAME_KIND[TC_IO[kind][-1]])]


@pytest.mark.parametrize("which", FEATURE_CASES)
@pytest.mark.parametrize("version", (3, 2))
def test_features_in_the_prefill_kernels(dev, which, version):
    """kva_prefill_tc (version 3) and the older prefill kernel (version 2)
    over a chunk of 100 queries after 60 earlier keys; q in float16 (the
    prefill kernels round q to the pages' type: with a cap at scale 1e38
    the scores are the dots' signs, which a rounding of q may flip)."""
    dev.be.attention_version = version
    rng = np.random.default_rng([41, version, FEATURE_CASES.index(which)])
    _, _, err = _prefill_case(dev, rng, F16, 64, 8, 2, contexts=[160], queries=[100],
                              block_size=16, **_features(rng, 8, which),
                              q_dtype="float16" if version == 3 else "float16-values")
    want = ak.prefill_tc_name(F16, 64) if version == 3 else ak.prefill_name(F16, 64)
    assert [n for n, _, _ in dev.be.launches] == [want]
    assert err <= PREFILL_TOL[F16], err


def test_fast_lane_takes_the_layers_rows_and_kinds(tc_dev):
    """bind with ALiBi / sink rows per layer and layers of two kinds
    (chunked and full): each layer runs its kind's plan with its rows."""
    from kvcore.backends.base import paged_attention_reference

    be = tc_dev.be
    rng = np.random.default_rng(42)
    L, nb, H, KVH, bs, D = 2, 20, 8, 2, 16, 64
    storage = rng.standard_normal((2 * L, nb, KVH, bs, D)).astype(np.float16)
    st = _put(storage)
    tables = rng.permutation(nb)[:12].astype(np.int32).reshape(2, 6)
    lens, qsl = np.array([90, 17]), np.array([0, 1, 3])
    alibi = rng.uniform(0.01, 0.5, (L, H)).astype(np.float32)
    sinks = rng.standard_normal((L, H)).astype(np.float32)
    kinds = [(0, 0), (0, 16)]   # (window, chunk) per layer
    plans = [be.attention_plan(tables, lens, qsl, num_heads=H, num_kv_heads=KVH, head_dim=D,
                               block_size=bs, num_blocks=nb, kind=F16, scale=0.125,
                               sliding_window=w, soft_cap=0.0, chunk_size=c) for w, c in kinds]
    plans[1].share_guard(plans[0])
    fast = plans[0].bind(st[0], st[1], st[2], st[3], L, alibi=alibi, sinks=sinks,
                         layer_plans=plans)
    for layer in range(L):
        q = rng.standard_normal((3, H, D)).astype(np.float16)
        out = fast(_put(q), layer)
        want = paged_attention_reference(q.astype(np.float32), storage[2 * layer],
                                         storage[2 * layer + 1], tables, lens, qsl, scale=0.125,
                                         chunk_size=kinds[layer][1] or None,
                                         alibi_slopes=alibi[layer], sinks=sinks[layer])
        assert np.abs(np.asarray(out) - want).max() <= 1e-5 * np.abs(want).max()
    with plans[0].lock:   # one guard for the kinds' plans
        assert fast(_put(q), 1) is NotImplemented
