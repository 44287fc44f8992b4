"""fp8 pools with one (k_scale, v_scale) per KV head: validation, every
write and read path, attention (decode and prefill, every SIMD level, the
bound fast path and the general one), copies, the contiguous KVCache and
the prefix stores' layout fingerprint."""
import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore import dtypes
from kvcore.backends.base import fp8_decode, fp8_encode
from kvcore.backends.cpu import _attention as _kernel
from kvcore.backends.base import paged_attention_reference
from kvcore.stores import _format

from _stores_support import check_hit, flush_pool, run

try:
    from _simd_levels import level_fixture
except ImportError:  # pragma: no cover - run as a package
    from ._simd_levels import level_fixture

FP8 = ("float8_e4m3fn", "float8_e5m2")
H, D, BS = 3, 16, 4
# layer 0: per-head keys, one value scale; layer 1: per-head both
SCALES = [((0.25, 1.0, 8.0), 0.5), ((2.0, 0.125, 1.0), (0.5, 4.0, 0.0625))]
PROMPT = np.arange(1, 10, dtype=np.int32)       # 9 tokens: 2 full blocks can hit


def same(a, b):
    """Bit-identical arrays."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(u), np.ascontiguousarray(b).view(u))


def heads_of(scale):
    """A plane's scale as H floats."""
    return np.broadcast_to(np.asarray(scale, np.float32), (H,))


def encode(x, dtype, scale, axis):
    """fp8 codes of x, head h (along ``axis``) divided by its scale."""
    kind = dtypes.NAME_KIND[dtype]
    x = np.moveaxis(np.asarray(x, np.float32), axis, 0)
    out = np.stack([fp8_encode(x[h], kind, s) for h, s in enumerate(heads_of(scale))])
    return np.moveaxis(out, 0, axis)


def decode(codes, dtype, scale, axis):
    """float32 values of codes, head h (along ``axis``) times its scale."""
    kind = dtypes.NAME_KIND[dtype]
    c = np.moveaxis(np.asarray(codes), axis, 0)
    out = np.stack([fp8_decode(c[h], kind, s) for h, s in enumerate(heads_of(scale))])
    return np.moveaxis(out, 0, axis)


def pool_of(dtype, scales=SCALES, num_blocks=32, bs=BS, dim=D):
    return kvcore.BlockPool(num_blocks, bs, len(scales), H, dim, dtype=dtype, kv_scales=scales)


def rows(rng, n, dim=D):
    # heads of very different ranges, as real K has
    mag = np.array([0.05, 1.0, 300.0], np.float32)[None, :, None]
    return (rng.standard_normal((n, H, dim)) * mag).astype(np.float32)


# ------------------------------------------------------------ validation
@pytest.mark.parametrize("bad, err, match", [
    ([((1.0, 1.0), 1.0)], ValueError, r"kv_scales\[0\]\[0\] \(k_scale\) must be a float or "
                                      r"num_kv_heads=3 floats .*got 2"),
    ([(1.0, (1.0, 2.0, 3.0, 4.0))], ValueError, r"kv_scales\[0\]\[1\] \(v_scale\).*got 4"),
    ([((1.0, 0.0, 1.0), 1.0)], ValueError, r"finite positive.*0.0 for layer 0's k_scale "
                                           r"\(kv head 1\)"),
    ([(1.0, (1.0, 1.0, np.nan))], ValueError, r"nan for layer 0's v_scale \(kv head 2\)"),
    ([((1.0, 1e39, 1.0), 1.0)], ValueError, r"1e\+39 for layer 0's k_scale \(kv head 1\)"),
    ([((1.0, True, 1.0), 1.0)], TypeError, r"kv_scales\[0\]\[0\] \(k_scale\)\[1\] \(kv head 1\) "
                                           r"must be a real number, got bool"),
    ([((1.0, "2", 1.0), 1.0)], TypeError, r"kv head 1\) must be a real number, got str"),
    ([(np.array([1.0, 2.0]), 1.0)], ValueError, r"kv_scales\[0\]\[0\].*got shape \(2,\)"),
    ([(np.array([True] * 3), 1.0)], TypeError, r"kv_scales\[0\]\[0\].*must hold real numbers"),
    ([(1.0, 1.0, 1.0)], ValueError, r"kv_scales\[0\] must be a \(k_scale, v_scale\) pair"),
    (np.ones((1, 2, 2)), ValueError, r"shape \(1, 2\) or \(1, 2, num_kv_heads=3\).*\(1, 2, 2\)"),
    (5, TypeError, r"kv_scales must be a sequence of num_layers"),
    # unordered: a set would hand heads or layers each other's scales, a dict its keys
    ([({3.0, 1.0, 2.0}, 1.0)], TypeError, r"kv_scales\[0\]\[0\] \(k_scale\) must be .* in "
                                           r"order .*got set"),
    ({(0.5, 0.5)}, TypeError, r"kv_scales must be .* in order .*got set"),
    ([frozenset({0.5, 2.0})], TypeError, r"kv_scales\[0\] must be .* in order .*got frozenset"),
    ([({2.0: "a", 4.0: "b", 8.0: "c"}, 1.0)], TypeError, r"kv_scales\[0\]\[0\].* in order "
                                                          r".*got dict"),
    # no float holds it, or it is no number: still named
    ([(10**400, 1.0)], ValueError, r"kv_scales\[0\]\[0\] \(k_scale\) must be a finite "
                                   r"positive float32 value, got 1000"),
    ([((1.0, 10**400, 1.0), 1.0)], ValueError, r"kv_scales\[0\]\[0\] \(k_scale\)\[1\] \(kv "
                                               r"head 1\) must be a finite positive"),
    ([(np.void(b"ab"), 1.0)], TypeError, r"kv_scales\[0\]\[0\] \(k_scale\) must be a real "
                                         r"number .*got void"),
    ([(1.0, np.datetime64(1, "s"))], TypeError, r"kv_scales\[0\]\[1\] \(v_scale\) must be a "
                                                r"real number .*got datetime64"),
])
def test_per_head_kv_scales_are_validated(bad, err, match):
    with pytest.raises(err, match=match):
        kvcore.BlockPool(4, BS, 1, H, D, dtype="float8_e4m3fn", kv_scales=bad)
    with pytest.raises(err, match=match):
        kvcore.KVCache(1, H, D, 8, dtype="float8_e5m2", kv_scales=bad)


def test_per_head_kv_scales_only_for_fp8():
    with pytest.raises(ValueError, match="kv_scales applies to fp8 pools"):
        kvcore.BlockPool(4, BS, 1, H, D, dtype="int8", kv_scales=[((1, 2, 3), 1)])


def test_kv_scales_reads_back_as_set():
    pool = pool_of("float8_e4m3fn")
    assert pool.kv_scales == [((0.25, 1.0, 8.0), 0.5), ((2.0, 0.125, 1.0), (0.5, 4.0, 0.0625))]
    assert all(type(s) is float for pair in pool.kv_scales for p in pair
               for s in (p if isinstance(p, tuple) else (p,)))
    # a per-head sequence of one repeated value is that float; arrays are taken
    a = np.array([[[0.5] * H, [1.0, 2.0, 4.0]]], np.float32)
    p = kvcore.BlockPool(4, BS, 1, H, D, dtype="float8_e5m2", kv_scales=a)
    assert p.kv_scales == [(0.5, (1.0, 2.0, 4.0))]
    p = kvcore.BlockPool(4, BS, 1, H, D, dtype="float8_e5m2", kv_scales=[((3.0,) * H, 1)])
    assert p.kv_scales == [(3.0, 1.0)]
    c = kvcore.KVCache(2, H, D, 8, dtype="float8_e4m3fn", kv_scales=SCALES)
    assert c.kv_scales == pool.kv_scales


class _OneScaleBackend:
    """A backend whose kernels take one fp8 scale per layer (as CUDA's)."""


def test_backends_without_per_head_kernels_refuse_them():
    from kvcore._planes import check_head_scales_backend
    with pytest.raises(ValueError, match="per-kv-head scales need device='cpu'.*_OneScale"):
        check_head_scales_backend(np.ones((1, 2, H), np.float32), _OneScaleBackend())
    check_head_scales_backend(None, _OneScaleBackend())      # per-layer: fine


# ------------------------------------------------------------ writes and reads
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
def test_every_write_and_read_honours_the_head_scales(dtype, src):
    rng = np.random.default_rng(1)
    cast = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[src]
    n = 10
    x = {(l, i): rows(rng, n).astype(cast) for l in range(2) for i in range(2)}
    # write (slots) into a, append (the native row writer) into b
    a, b = pool_of(dtype), pool_of(dtype)
    seq = kvcore.PagedKVCache(b)
    seq.allocate(list(range(1, n + 1)))
    table = seq.block_table
    slots = (table[np.arange(n) // BS] * BS + np.arange(n) % BS).astype(np.int64)
    for l in range(2):
        a.write(l, x[l, 0], x[l, 1], slots)
        seq.append(l, x[l, 0], x[l, 1])
    for l in range(2):
        for i, plane in enumerate((a.key_cache(l), a.value_cache(l))):
            s = SCALES[l][i]
            want_codes = encode(x[l, i].astype(np.float32), dtype, s, axis=1)   # (n, H, D)
            got = plane[table[np.arange(n) // BS], :, np.arange(n) % BS]        # (n, H, D)
            same(got, want_codes)
            # every read: gather (codes, float32, float16), gather_batch
            want = decode(want_codes, dtype, s, axis=1).transpose(1, 0, 2)     # (H, n, D)
            codes = a.gather(l, table, 0, n)[i]
            same(codes, want_codes.transpose(1, 0, 2))
            same(a.gather(l, table, 0, n, dtype="float32")[i], want)
            same(a.gather(l, table, 0, n, dtype="float16")[i], want.astype(np.float16))
            batch = a.gather_batch(l, table[None], [n], dtype="float32")[i]
            same(batch[0], want)
            # the appended sequence holds the same codes
            same(b.gather(l, table, 0, n)[i], want_codes.transpose(1, 0, 2))


@pytest.mark.parametrize("dtype", FP8)
def test_contiguous_cache_update_and_get_per_head(dtype):
    rng = np.random.default_rng(2)
    c = kvcore.KVCache(2, H, D, 16, batch_size=2, dtype=dtype, kv_scales=SCALES)
    for l in range(2):
        k = np.moveaxis(rows(rng, 2 * 5).reshape(2, 5, H, D), 2, 1)   # (batch, H, n, D)
        v = np.moveaxis(rows(rng, 2 * 5).reshape(2, 5, H, D), 2, 1)
        c.update(l, k, v)
        c.update(l, k[:, :, :2].astype(np.float16), v[:, :, :2].astype(np.float16))
        for i, x in enumerate((k, v)):
            s = SCALES[l][i]
            codes = encode(x, dtype, s, axis=1)
            got_codes = c.get(l)[i]
            same(got_codes[:, :, :5], codes)
            same(c.get(l, dtype="float32")[i][:, :, :5], decode(codes, dtype, s, axis=1))
            c16 = encode(x[:, :, :2].astype(np.float16).astype(np.float32), dtype, s, axis=1)
            same(c.get(l, 5, 7, dtype="float32")[i], decode(c16, dtype, s, axis=1))


def test_uniform_head_scales_are_bit_identical_to_per_layer():
    rng = np.random.default_rng(3)
    layer = [(0.5, 2.0), (4.0, 0.25)]
    heads = [((0.5,) * H, (2.0,) * H), (np.full(H, 4.0), [0.25] * H)]
    pools = [pool_of("float8_e4m3fn", scales=s, bs=8) for s in (layer, heads)]
    seqs = []
    for pool in pools:
        s = kvcore.PagedKVCache(pool)
        s.allocate(list(range(1, 40)))
        for l in range(2):
            s.append(l, rows(np.random.default_rng(l), 39), rows(np.random.default_rng(9), 39))
        seqs.append(s)
    same(pools[0].storage, pools[1].storage)
    q = rng.standard_normal((1, 6, D)).astype(np.float32)
    for l in range(2):
        same(*(kvcore.paged_attention(q, p, l, s.block_table[None], [39])
               for p, s in zip(pools, seqs)))
    assert pools[1].kv_scales == layer


# ------------------------------------------------------------ attention
simd_level = level_fixture(_kernel)


def reference(q, pool, layer, tables, lens, **kw):
    """float64 attention over the pool's dequantized K/V (head h times its scale)."""
    dt = pool.dtype
    k = decode(pool.key_cache(layer), dt, SCALES[layer][0], axis=1)
    v = decode(pool.value_cache(layer), dt, SCALES[layer][1], axis=1)
    return paged_attention_reference(q, k, v, tables, lens, kind="float32", **kw)


def rel_err(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("dim", [64, 20])       # 20: the scalar path on every level
def test_attention_over_per_head_pages_matches_float64(dtype, dim, simd_level):
    rng = np.random.default_rng(5)
    pool = pool_of(dtype, num_blocks=64, bs=8, dim=dim)
    seqs, lens = [], [37, 70, 3]
    for n in lens:
        s = kvcore.PagedKVCache(pool)
        s.allocate(list(rng.integers(1, 1000, n)))
        for layer in range(2):
            s.append(layer, rows(rng, n, dim), rows(rng, n, dim) / 10)
        seqs.append(s)
    tables, seq_lens = kvcore.padded_block_tables(seqs)
    for layer in range(2):
        q = rng.standard_normal((3, 2 * H, dim)).astype(np.float32) / 8   # decode, GQA 2
        want = reference(q, pool, layer, tables, seq_lens)
        got = kvcore.paged_attention(q, pool, layer, tables, seq_lens)
        assert rel_err(got, want) <= 1e-5
        plan = kvcore.AttentionPlan(pool, tables, seq_lens, num_heads=2 * H)
        same(plan.run(q, layer), got)                               # the bound fast path
        same(plan.run(np.asfortranarray(q), layer), got)            # the general path
        # prefill of the 70-token sequence (many rows: the tile / widening paths)
        qp = rng.standard_normal((70, 2 * H, dim)).astype(np.float32) / 8
        want = reference(qp, pool, layer, tables[1:2], seq_lens[1:2], query_start_loc=[0, 70])
        got = kvcore.paged_attention(qp, pool, layer, tables[1:2], seq_lens[1:2],
                                     query_start_loc=[0, 70])
        assert rel_err(got, want) <= 1e-5
        plan = kvcore.AttentionPlan(pool, tables[1:2], seq_lens[1:2], [0, 70])
        same(plan.run(qp, layer), got)


def test_attention_uses_each_heads_own_scale():
    """One key and value per head, all codes equal: each head's output is its
    own value scale (a kernel reading one scale for all gets them wrong)."""
    pool = kvcore.BlockPool(4, 1, 1, H, 8, dtype="float8_e4m3fn",
                            kv_scales=[((1.0, 2.0, 4.0), (0.5, 3.0, 7.0))])
    pool.key_cache(0)[...] = 0
    pool.value_cache(0)[...] = fp8_encode(np.ones(1, np.float32), dtypes.F8E4M3)[0]
    q = np.ones((1, H, 8), np.float32)
    got = kvcore.paged_attention(q, pool, 0, [[1]], [1])
    np.testing.assert_array_equal(got[0], np.array([[0.5], [3.0], [7.0]], np.float32)
                                  * np.ones((1, 8), np.float32))


# ------------------------------------------------------------ copies and stores
def test_copy_blocks_to_compares_the_head_scales():
    a = pool_of("float8_e4m3fn")
    other = [((0.25, 1.0, 4.0), 0.5), SCALES[1]]
    with pytest.raises(ValueError, match="same kv_scales"):
        a.copy_blocks_to(pool_of("float8_e4m3fn", scales=other), [0], [0])
    with pytest.raises(ValueError, match="same kv_scales"):
        a.copy_blocks_to(pool_of("float8_e4m3fn", scales=[(0.25, 0.5), SCALES[1]]), [0], [0])
    b = pool_of("float8_e4m3fn")
    a.write(0, rows(np.random.default_rng(0), 1), rows(np.random.default_rng(1), 1), [0])
    a.copy_blocks_to(b, [0], [0])
    same(b.storage[:, 0], a.storage[:, 0])


@pytest.mark.parametrize("store", ["host", "disk"])
def test_fp8_pools_with_other_head_scales_never_share_entries(tmp_path, store):
    """Codes stored with head 0's keys at 0.25 mean other values in a pool
    whose head 0 keys have scale 1: per-head scales are part of the layout
    fingerprint; pools with the same ones still share."""
    shared = kvcore.HostStore(1 << 22) if store == "host" else None

    def fp8_pool(scales):
        s = shared if shared is not None else kvcore.DiskStore(tmp_path, 1 << 22)
        return kvcore.BlockPool(8, BS, 2, H, D, dtype="float8_e4m3fn", kv_scales=scales,
                                stores=[s])

    a = fp8_pool(SCALES)
    run(a, PROMPT)
    flush_pool(a)
    other = [((0.25, 1.0, 4.0), 0.5), SCALES[1]]
    for scales in (other, [(0.25, 0.5), SCALES[1]], [SCALES[0], (2.0, (0.5, 4.0, 1.0))]):
        b = fp8_pool(scales)
        assert b.probe(PROMPT)["hit_tokens"] == 0, scales
        check_hit(b, PROMPT, 0)
    check_hit(fp8_pool(SCALES), PROMPT, 2)
    fp = lambda s: _format.fingerprint("float8_e4m3fn", BS, 2, H, D, b"", kv_scales=s)
    assert fp(SCALES) != fp(other)
    # uniform per-head scales are the per-layer ones: the same entries
    uniform = kvcore.BlockPool(4, BS, 2, H, D, dtype="float8_e4m3fn",
                               kv_scales=[((0.5,) * H, 1.0)] * 2)
    assert fp(uniform.kv_scales) == fp([(0.5, 1.0)] * 2)


@pytest.mark.parametrize("dtype", FP8)
def test_contiguous_cache_attention_per_head(dtype):
    """KVCache.attention over per-head fp8 K/V equals attention over a float32
    cache holding the dequantized values (decode and a 9-token prefill)."""
    rng = np.random.default_rng(6)
    c = kvcore.KVCache(2, H, 64, 32, batch_size=2, dtype=dtype, kv_scales=SCALES)
    f = kvcore.KVCache(2, H, 64, 32, batch_size=2, dtype="float32")
    for l in range(2):
        k = np.moveaxis(rows(rng, 2 * 20, 64).reshape(2, 20, H, 64), 2, 1)
        v = np.moveaxis(rows(rng, 2 * 20, 64).reshape(2, 20, H, 64), 2, 1) / 10
        c.update(l, k, v)
        f.update(l, *c.get(l, dtype="float32"))
        for n in (1, 9):
            q = rng.standard_normal((2, 2 * H, n, 64)).astype(np.float32) / 8
            want = f.attention(l, q)
            assert rel_err(c.attention(l, q), want) <= 1e-5


def test_torch_bool_and_complex_scales_are_refused():
    torch = pytest.importorskip("torch")
    for bad, match in (([(torch.tensor([True] * H), 1.0)], r"kv head 0\) must be a real number"),
                       ([(torch.tensor(True), 1.0)], r"k_scale\) must be a real number"),
                       ([(torch.tensor([1 + 0j] * H), 1.0)], r"kv head 0\) must be a real number"),
                       ([(torch.tensor(1 + 1j), 1.0)], r"k_scale\) must be a real number")):
        with pytest.raises(TypeError, match=match):
            pool_of("float8_e4m3fn", bad)
    good = pool_of("float8_e4m3fn", [(torch.tensor([0.5, 1.0, 2.0]), torch.tensor(2.0))])
    assert good.kv_scales == [((0.5, 1.0, 2.0), 2.0)]
