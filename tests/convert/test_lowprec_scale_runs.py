"""int8 decode over many tiles and blocks: each position's scales reach its
scores and weights (kv_attn_tile.c reads them per tile and prefetches the
scale lines of the tiles ahead, apart from the pages), at every level, with
the same bits for every thread count."""
import numpy as np
import pytest

import kvcore
from kvcore.backends.base import paged_attention_reference
from kvcore.backends.cpu import _attention as _kernel

try:
    from _simd_levels import level_fixture
except ImportError:  # pragma: no cover - run as a package
    from ._simd_levels import level_fixture

simd_level = level_fixture(_kernel)


@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (128, 8, 2), (40, 4, 4)])
def test_int8_decode_over_scattered_blocks_uses_each_positions_scales(dim, heads, kv_heads,
                                                                       simd_level):
    rng = np.random.default_rng(42)
    bs = 16
    # lengths that end mid-tile, mid-block, on a tile edge, and past a split
    lens = [1, 33, 64, 95, 1100, 2500]
    blocks = sum(-(-n // bs) for n in lens)
    pool = kvcore.BlockPool(blocks + 3, bs, 1, kv_heads, dim, dtype="int8")
    order = rng.permutation(blocks + 3)[:blocks]   # scattered blocks, a few never used
    tables = np.zeros((len(lens), max(-(-n // bs) for n in lens)), np.int32)
    at = 0
    for s, n in enumerate(lens):
        nb = -(-n // bs)
        tables[s, :nb] = order[at:at + nb]
        at += nb
        # rows of very different magnitudes: a scale read for the wrong
        # position (or kv head) would show in the output
        mag = np.exp(rng.uniform(-4, 4, (n, kv_heads, 1))).astype(np.float32)
        k = rng.standard_normal((n, kv_heads, dim)).astype(np.float32) * mag
        v = rng.standard_normal((n, kv_heads, dim)).astype(np.float32) * mag[::-1]
        slots = (tables[s, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs)
        pool.write(0, k, v, slots)
    seq_lens = np.array(lens, np.int64)
    q = (rng.standard_normal((len(lens), heads, dim)) * 0.3).astype(np.float32)
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables,
                                     seq_lens, kind="int8", key_scales=pool.key_scales(0),
                                     value_scales=pool.value_scales(0))
    before = kvcore.set_num_threads(None)
    try:
        outs = []
        for threads in (1, 2, 3):
            kvcore.set_num_threads(threads)
            outs.append(kvcore.paged_attention(q, pool, 0, tables, seq_lens))
    finally:
        kvcore.set_num_threads(before)
    got = outs[0]
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert err.max() <= 5e-5, err.max()   # (float32 sums over 2500 keys; a wrong scale: ~1)
    for other in outs[1:]:
        np.testing.assert_array_equal(got.view(np.uint32), other.view(np.uint32))
