"""paged_attention refuses what it must not read or write (issue 19 items 1,
3 and 9; issue 23 item 5): every block-table entry a kernel can read is
checked, on the CPU and on a CUDA pool (host emulation); ``out=`` may not
overlap anything the pool or cache owns; ``scale`` and ``logits_soft_cap``
must fit the kernels' float32."""
import numpy as np
import pytest

import kvcore
from kvcore.backends.base import paged_attention_reference

try:
    from test_cuda_host_emulation import DevArray, _get, _put, emu_lib, emulated_cuda  # noqa: F401
except ImportError:  # pragma: no cover - run as a package
    from .test_cuda_host_emulation import DevArray, _get, _put, emu_lib, emulated_cuda  # noqa: F401

BS = 4            # block size
NUM_BLOCKS = 24
BAD_IDS = [NUM_BLOCKS + 5, 10**6, -1]

# (contexts, queries, sliding_window): decode, prefill, chunked prefill,
# mixed, and windows that start inside, at and before a block boundary
CASES = {
    "decode": ([9, 20], [1, 1], None),
    "prefill": ([7, 13], [7, 13], None),
    "chunked": ([19, 11], [5, 3], None),
    "mixed": ([17, 6, 10], [1, 6, 0], None),
    "window-decode": ([21, 16], [1, 1], 6),
    "window-chunked": ([22, 15], [4, 2], 5),
    "window-wide": ([10, 9], [2, 1], 100),
}


def _read_positions(length, n, window):
    """Block positions the kernel reads for a sequence (the rule of issue 19:
    from the first position any query can see to the last)."""
    if n == 0:
        return set()
    first = 0 if window is None else max(0, length - n + 1 - window)
    return set(range(first // BS, -(-length // BS)))


def _batch(contexts, queries, width):
    rng = np.random.default_rng(len(contexts))
    ids = rng.permutation(NUM_BLOCKS)
    tables = np.full((len(contexts), width), 7, np.int32)   # padding: a valid id
    start = 0
    for s, c in enumerate(contexts):
        need = -(-c // BS)
        tables[s, :need] = ids[start:start + need]
        start += need
    qsl = np.concatenate([[0], np.cumsum(queries)]).astype(np.int64)
    return tables, np.asarray(contexts, np.int64), qsl


def _pool(device="cpu", dtype="float16", head_dim=16):
    pool = kvcore.BlockPool(NUM_BLOCKS, BS, 1, 2, head_dim, dtype=dtype, device=device)
    rng = np.random.default_rng(5)
    vals = rng.standard_normal((NUM_BLOCKS * BS, 2, head_dim)).astype(np.float32)
    put = _put if device != "cpu" else (lambda a: a)
    pool.write(0, put(vals), put(vals[::-1].copy()), np.arange(NUM_BLOCKS * BS))
    return pool


def _every_block_position(pool, put, name):
    contexts, queries, window = CASES[name]
    width = -(-max(contexts) // BS) + 2
    tables, lens, qsl = _batch(contexts, queries, width)
    q = np.random.default_rng(1).standard_normal((int(qsl[-1]), 4, 16)).astype(np.float32)
    args = dict(query_start_loc=qsl, sliding_window=window)
    checked = 0
    for s in range(len(contexts)):
        read = _read_positions(contexts[s], queries[s], window)
        for b in range(width):
            for bad in BAD_IDS:
                t = tables.copy()
                t[s, b] = bad
                if b in read:
                    with pytest.raises(IndexError, match=rf"block_tables\[{s}, {b}\] must be a "
                                       rf"block id in 0\.\.{NUM_BLOCKS - 1}.*got {bad}"):
                        kvcore.paged_attention(put(q), pool, 0, put(t), lens, **args)
                    checked += 1
    return checked, tables, lens, q, args


@pytest.mark.parametrize("name", list(CASES))
def test_every_read_block_position_is_checked_cpu(name):
    pool = _pool()
    checked, tables, lens, q, args = _every_block_position(pool, lambda a: a, name)
    assert checked > 0
    # entries the kernel does not read may hold anything: same result as the
    # reference (which never looks at them)
    contexts, queries, window = CASES[name]
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables, lens,
                                     args["query_start_loc"], sliding_window=window)
    for s in range(len(contexts)):
        unread = sorted(set(range(tables.shape[1]))
                        - _read_positions(contexts[s], queries[s], window))
        t = tables.copy()
        t[s, unread] = -1
        got = kvcore.paged_attention(q, pool, 0, t, lens, **args)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["decode", "chunked", "mixed", "window-chunked"])
def test_every_read_block_position_is_checked_cuda(emulated_cuda, name):
    pool = _pool("cuda")
    emulated_cuda.launches.clear()
    checked, *_ = _every_block_position(pool, _put, name)
    assert checked > 0 and emulated_cuda.launches == []


def test_the_issue_19_table():
    """The table of issue 19: a decode call read bad[1, 0] unchecked."""
    pool = kvcore.BlockPool(8, 16, 1, 2, 16)
    q = np.ones((2, 4, 16), np.float32)
    for bad in (8 + 5, 10**6):
        with pytest.raises(IndexError, match=r"block_tables\[1, 0\]"):
            kvcore.paged_attention(q, pool, 0, [[0, 1, 0], [bad, 3, 4]], [20, 40])


# ------------------------------------------------------------------ out=
def _int8_pool(device="cpu", head_dim=16):
    pool = kvcore.BlockPool(8, 4, 2, 2, head_dim, dtype="int8", device=device)
    put = _put if device != "cpu" else (lambda a: a)
    rng = np.random.default_rng(3)
    for layer in (0, 1):
        vals = rng.standard_normal((32, 2, head_dim)).astype(np.float32)
        pool.write(layer, put(vals), put(vals), np.arange(32))
    return pool


def test_out_viewing_the_scale_planes_is_refused():
    pool = _int8_pool()
    before = pool.scales.copy()
    q = np.ones((1, 2, 16), np.float32)
    flat = pool.scales.reshape(-1)
    # layer 0's key scales, the last layer's value scales
    for out in (flat[:32].reshape(1, 2, 16), flat[-32:].reshape(1, 2, 16)):
        with pytest.raises(ValueError, match="out must not overlap the KV cache's storage or "
                                             "scales"):
            kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], out=out)
    np.testing.assert_array_equal(pool.scales, before)


def test_kvcache_out_viewing_the_scales_is_refused():
    cache = kvcore.KVCache(2, 2, 16, 16, batch_size=1, dtype="int8")
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    cache.update(0, k, k)
    before = cache.key_scales(0).copy()
    out = cache.key_scales(0).reshape(-1)[:32].reshape(1, 2, 1, 16)
    with pytest.raises(ValueError, match="out must not overlap the KV cache's storage or scales"):
        cache.attention(0, np.ones((1, 2, 1, 16), np.float32), out=out)
    np.testing.assert_array_equal(cache.key_scales(0), before)


def test_cuda_out_viewing_the_scale_planes_is_refused(emulated_cuda):
    pool = _int8_pool("cuda", head_dim=64)     # (a head_dim the CUDA kernels take)
    before = _get(pool.scales).copy()
    emulated_cuda.launches.clear()
    out = pool.scales.reshape(-1)[:128].reshape(1, 2, 64)     # every scale of the pool
    with pytest.raises(ValueError, match="out must not overlap the KV cache's storage or scales"):
        kvcore.paged_attention(_put(np.ones((1, 2, 64), np.float32)), pool, 1, [[0, 1]], [6],
                               out=out)
    assert emulated_cuda.launches == []
    np.testing.assert_array_equal(_get(pool.scales), before)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cuda_misaligned_out_is_filled(emulated_cuda, dtype):
    """Issue 23 item 5: a view of device memory off its element alignment
    is filled through an aligned temporary (a misaligned store faults on a
    GPU), on the direct path (float32) and through the conversion alike."""
    pool = _pool("cuda", head_dim=64)
    item = np.dtype(dtype).itemsize
    raw = _put(np.zeros(4 * 64 * item + 1, np.uint8))
    out = raw[1:].view(dtype).reshape(1, 4, 64)
    q = _put(np.random.default_rng(6).standard_normal((1, 4, 64)).astype(np.float32))
    want = kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], out=_put(np.zeros((1, 4, 64), dtype)))
    assert kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], out=out) is out
    np.testing.assert_array_equal(_get(out), _get(want))


# ------------------------------------------------------------------ scalars
@pytest.mark.parametrize("kw,pattern", [
    (dict(scale=1e39), r"scale must be 0 or a value whose magnitude lies in .*got 1e\+39"),
    (dict(scale=-1e39), r"scale must be 0 or .*got -1e\+39"),
    (dict(scale=3e38), r"scale must be 0 or .*got 3e\+38"),     # finite, but scale*log2(e) is not
    (dict(scale=1e-50), r"scale must be 0 or .*got 1e-50"),      # rounds to 0
    (dict(scale=1e-40), r"scale must be 0 or .*got 1e-40"),      # subnormal
    (dict(logits_soft_cap=1e-50), r"logits_soft_cap must be a value whose magnitude lies in "
                                  r"\[1.1754944e-38, .*got 1e-50"),
    (dict(logits_soft_cap=1e-40), r"logits_soft_cap must be .*got 1e-40"),
    (dict(logits_soft_cap=1e39), r"logits_soft_cap must be .*got 1e\+39"),
    (dict(logits_soft_cap=3e38), r"logits_soft_cap must be .*got 3e\+38"),
])
def test_scalars_must_fit_float32(kw, pattern):
    pool = _pool()
    q = np.ones((1, 4, 16), np.float32)
    with pytest.raises(ValueError, match=pattern):
        kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], **kw)


def test_scalars_at_the_float32_limits_are_accepted():
    pool = _pool()
    q = np.ones((1, 4, 16), np.float32)
    tiny = float(np.finfo(np.float32).tiny)
    for kw in (dict(scale=0.0), dict(scale=tiny * 2), dict(scale=-0.5),
               dict(logits_soft_cap=tiny * 2), dict(logits_soft_cap=1e38)):
        out = kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], **kw)
        assert np.isfinite(out).all(), kw


def test_huge_window_and_head_counts_are_refused_by_name():
    pool = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="float32")
    q = np.ones((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="sliding_window must be in 1..2\\*\\*62"):
        kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], sliding_window=2**63)
    for heads in (2**31, 2**33 + 2):
        with pytest.raises(ValueError, match="num_heads must be a positive multiple"):
            kvcore.AttentionPlan(pool, [[0, 1]], [6], num_heads=heads)


@pytest.mark.parametrize("head_dim", [2**31 + 8, 2**32 + 8])
def test_a_head_dim_past_a_c_int_is_refused_not_wrapped(head_dim):
    # the C plan takes head_dim as an int: 2**32 + 8 planned as 8 (a run
    # would read 8 of each row), 2**31 + 8 as "rejected the plan (status -2)".
    # Planes of that shape without the memory: zero strides but the last
    # (the plan reads no data; a run would never come)
    buf = np.zeros(8, np.float16)
    k = np.lib.stride_tricks.as_strided(buf, (1, 1, 1, head_dim), (0, 0, 0, 2))
    with pytest.raises(ValueError, match=rf"^head_dim must be in 1\.\.2147483647 .*, got "
                                         rf"{head_dim}$"):
        kvcore.AttentionPlan((k, k), [[0]], [1], num_heads=1)
