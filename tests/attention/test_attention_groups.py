"""GQA groups of 5 to 8 query heads per KV head (Qwen2.5-7B's 7, Llama-3's
70B 8): a decode item of that many rows reads the stored K and V rows
itself at the avx2 and avx512 levels (kva_kernels.direct_rows; the avx512
bodies of head_dim 64 and 128 take every row in one block, 2 keys or 2
vectors at a time) instead of widening each tile to float32 first; items
of 9-15 rows do so in two calls (kva_kernels.multi_call_rows).  Every
page dtype, every level this CPU has, against the float64 reference on the
stored values, with the same bits for any thread count, and an e4m3fn NaN
code reaching only the rows that see it."""
import numpy as np
import pytest

import kvcore
from kvcore import dtypes
from kvcore.backends.base import fp8_decode, paged_attention_reference
from kvcore.backends.cpu import _attention as _kernel

try:
    from _helpers import reference_scales
    from _simd_levels import level_fixture
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import reference_scales
    from ._simd_levels import level_fixture

simd_level = level_fixture(_kernel)

PAGE_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")


def _filled(dtype, nkv, dim, lens, rng, bs=16):
    """A pool of `dtype` with one sequence per length appended (float32
    values quantized by the pool), and their block tables."""
    pool = kvcore.BlockPool(sum(-(-n // bs) for n in lens) + 4, bs, 1, nkv, dim, dtype=dtype)
    seqs = []
    for n in lens:
        s = kvcore.PagedKVCache(pool)
        s.allocate(list(rng.integers(1, 1000, n)))
        s.append(0, rng.standard_normal((n, nkv, dim)).astype(np.float32) * 2,
                 rng.standard_normal((n, nkv, dim)).astype(np.float32))
        seqs.append(s)
    tables, lens = kvcore.padded_block_tables(seqs)
    return pool, seqs, tables, lens


def _err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def _check_groups(dtype, group, dim, chunk, seed):
    """A decode (one query each) of 3 sequences, then a chunk of `chunk`
    queries over the first, against the reference, each with the same bits
    for 1, 2 and 3 threads."""
    rng = np.random.default_rng(seed)
    nkv = 2
    pool, _, tables, lens = _filled(dtype, nkv, dim, [300, 45, 1], rng)
    kw = reference_scales(pool, 0)
    cases = [
        (rng.standard_normal((3, group * nkv, dim)).astype(np.float32), tables, lens, None),
        (rng.standard_normal((chunk, group * nkv, dim)).astype(np.float32), tables[:1],
         lens[:1], [0, chunk]),
    ]
    before = kvcore.set_num_threads(1)
    try:
        for q, t, n, qsl in cases:
            extra = {} if qsl is None else dict(query_start_loc=qsl)
            outs = []
            for threads in (1, 2, 3):
                kvcore.set_num_threads(threads)
                outs.append(kvcore.paged_attention(q, pool, 0, t, n, **extra))
            want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), t, n,
                                             kind=dtype, **extra, **kw)
            assert _err(outs[0], want) <= 1e-5, (dtype, group, dim, qsl)
            for o in outs[1:]:
                np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    finally:
        kvcore.set_num_threads(before)


@pytest.mark.parametrize("dtype", PAGE_DTYPES)
@pytest.mark.parametrize("group", [5, 6, 7, 8])
@pytest.mark.parametrize("dim", [64, 128, 80])    # 80: a run-time head_dim
def test_groups_of_5_to_8_match_the_reference_with_the_same_bits_for_any_thread_count(
        dtype, group, dim, simd_level):
    _check_groups(dtype, group, dim, 2, [group, dim, PAGE_DTYPES.index(dtype)])


@pytest.mark.parametrize("dtype", PAGE_DTYPES)
@pytest.mark.parametrize("group, chunk", [(12, 1), (9, 1), (15, 1), (4, 3), (3, 5), (7, 2),
                                          (16, 1), (4, 4), (8, 2), (6, 4), (7, 4), (24, 1)])
@pytest.mark.parametrize("dim", [64, 128, 80])
def test_items_of_9_to_31_rows_match_the_reference_with_the_same_bits_for_any_thread_count(
        dtype, group, chunk, dim, simd_level):
    """Items of 9-15 rows (a decode of a group of 9-15, a chunk of 2-5
    queries times a group of 3-7) run the kernels in two calls of rows over
    the stored rows at avx2 and avx512 (kva_kernels.multi_call_rows) for the
    kinds that take that, and widen their tiles for the others; items of
    16-31 rows run the prefill kernels (the amx level's tiles), which now
    prefetch the next tile as a decode's do (KVA_SPREAD_ROWS); every one
    within 1e-5 of the reference and thread-count independent."""
    _check_groups(dtype, group, dim, chunk, [group, chunk, dim, PAGE_DTYPES.index(dtype)])


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("dim", [64, 128])
def test_e4m3fn_nan_code_in_a_group_of_8_reaches_only_the_rows_that_see_it(which, dim,
                                                                           simd_level):
    """One NaN code (0x7F) at position 20 of KV head 0: a decode of a
    sequence that holds it is NaN in that head's 8 query heads (a key's:
    every dim; a value's: its dim 5) and finite elsewhere; the other
    sequence, and KV head 1's query heads, match the reference."""
    rng = np.random.default_rng(dim)
    pool, seqs, tables, lens = _filled("float8_e4m3fn", 2, dim, [100, 60], rng)
    cache = pool.key_cache(0) if which == "key" else pool.value_cache(0)
    blk, off = seqs[0].block_table[20 // pool.block_size], 20 % pool.block_size
    cache[blk, 0, off, 5] = 0x7F
    q = rng.standard_normal((2, 16, dim)).astype(np.float32)
    out = kvcore.paged_attention(q, pool, 0, tables, lens)
    bad = np.isnan(out)
    if which == "key":
        assert bad[0, :8].all()
    else:
        assert bad[0, :8, 5].all() and not bad[0, :8, :5].any() and not bad[0, :8, 6:].any()
    assert not bad[0, 8:].any() and not bad[1].any()
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables, lens,
                                     kind="float8_e4m3fn", **reference_scales(pool, 0))
    assert _err(out[1], want[1]) <= 1e-5 and _err(out[0, 8:], want[0, 8:]) <= 1e-5
    assert np.isnan(fp8_decode(np.uint8(0x7F), dtypes.NAME_KIND["float8_e4m3fn"]))
