"""Attention features for transformers models (issue 39): chunked attention
(``chunk_size``), ALiBi (``alibi_slopes``), attention sinks (``sinks``) and
per-layer kinds of layer (windows and chunks per layer), and every accepted
``scale`` (issue 38.3), through ``paged_attention``, ``AttentionPlan``,
``PagedKVCache.attention`` and ``KVCache.attention``.

Each is checked against the float64 reference (``paged_attention_reference``:
the spec) within 1e-5 (max abs error / max abs value) at every SIMD level
present, over every page dtype, GQA, decode / prefill / chunked prefill in
mixed batches and decodes long enough to be split; the bits are the same for
1, 2 and 3 threads; bad arguments are refused by name before any work."""
import math
import types

import numpy as np
import pytest

import kvcore
from kvcore.backends.cpu import _attention
from kvcore.backends.base import paged_attention_reference

try:
    from _helpers import simd_level
    from _simd_levels import simd_level_params
    from test_attention import make_batch
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import simd_level
    from ._simd_levels import simd_level_params
    from .test_attention import make_batch

TOL = 1e-5
DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"]
LEVEL_PARAMS = simd_level_params(_attention.available_simd_levels(),
                                 _attention.simd_level_names())
FP8_SCALES = (0.5, 2.0)      # (k_scale, v_scale) of every fp8 layer


@pytest.fixture(params=LEVEL_PARAMS)
def level(request):
    with simd_level(request.param):
        yield request.param


# ------------------------------------------------------------------ helpers
def make_pool(dtype, rng, num_blocks, block_size=16, layers=1, kv_heads=2, head_dim=64,
              integers=False):
    """A pool whose every slot of every layer holds random K/V (written
    through the pool: rounded or quantized to its dtype).  ``integers``:
    small whole numbers (exact float32 dots)."""
    scales = [FP8_SCALES] * layers if dtype.startswith("float8") else None
    pool = kvcore.BlockPool(num_blocks, block_size, layers, kv_heads, head_dim, dtype=dtype,
                            kv_scales=scales)
    n = num_blocks * block_size
    for layer in range(layers):
        if integers:
            k, v = (rng.integers(-3, 4, (n, kv_heads, head_dim)).astype(np.float32)
                    for _ in range(2))
        else:
            k, v = (rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
                    for _ in range(2))
        pool.write(layer, k, v, np.arange(n))
    return pool


def reference(pool, layer, q, tables, lens, qsl, alibi_slopes=None, sinks=None, **kw):
    """The float64 reference over ``pool``'s layer (the slopes and sinks as
    the float32 values the plan holds)."""
    low = {}
    if pool.dtype == "int8":
        low = dict(key_scales=pool.key_scales(layer), value_scales=pool.value_scales(layer))
    elif pool.dtype.startswith("float8"):
        low = dict(key_scales=FP8_SCALES[0], value_scales=FP8_SCALES[1])
    f32 = (lambda x: None if x is None else np.asarray(x, np.float32).astype(np.float64))
    return paged_attention_reference(q, pool.key_cache(layer), pool.value_cache(layer),
                                     np.where(tables < 0, 0, tables), lens, qsl,
                                     kind=pool.dtype, alibi_slopes=f32(alibi_slopes),
                                     sinks=f32(sinks), **low, **kw)


def rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def alibi_of(num_heads):
    """ALiBi's geometric slopes (BLOOM's 2^(-8 h / n)), one of them negative."""
    s = 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)
    s[num_heads // 2] *= -0.5
    return s


def sinks_of(rng, num_heads, layers=None):
    """Sinks at a trained model's scale (gpt-oss: a few units, either sign)."""
    shape = (num_heads,) if layers is None else (layers, num_heads)
    return rng.uniform(-2.0, 6.0, shape)


# (name, features); every one over a mixed batch that splits its decodes
COMBOS = [
    ("chunk", dict(chunk_size=48)),
    ("window+chunk", dict(sliding_window=37, chunk_size=48)),
    ("alibi+softcap", dict(alibi=True, logits_soft_cap=20.0)),
    ("sinks", dict(sinks=True)),
    ("all", dict(sliding_window=300, chunk_size=256, alibi=True, sinks=True,
                 logits_soft_cap=30.0)),
]


def features(combo, rng, num_heads):
    kw = dict(combo)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_of(num_heads)
    if kw.pop("sinks", False):
        kw["sinks"] = sinks_of(rng, num_heads)
    return kw


# ------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, combo", COMBOS, ids=[c[0] for c in COMBOS])
def test_features_match_the_reference_with_the_same_bits_for_any_thread_count(
        level, dtype, name, combo):
    rng = np.random.default_rng([DTYPES.index(dtype), COMBOS.index((name, combo))])
    # decodes over 2100 and 1500 positions (split), a prefill, a chunked
    # prefill over cached context, a short decode: one mixed batch
    contexts, queries = [2100, 1500, 90, 300, 7], [1, 1, 90, 30, 1]
    pool = make_pool(dtype, rng, sum(-(-c // 16) for c in contexts) + 4)
    tables, lens, qsl = make_batch(rng, pool, contexts, queries)
    kw = features(combo, rng, 8)
    q = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float32)
    outs = [kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=t, **kw).run(q, 0)
            for t in (1, 2, 3)]
    for other in outs[1:]:
        np.testing.assert_array_equal(other.view(np.uint32), outs[0].view(np.uint32))
    want = reference(pool, 0, q, tables, lens, qsl, **kw)
    assert rel_err(outs[0], want) <= TOL
    # the one call: the same bits
    got = kvcore.paged_attention(q, pool, 0, tables, lens, qsl, **kw)
    np.testing.assert_array_equal(got.view(np.uint32), outs[0].view(np.uint32))


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 128), (8, 1, 40), (12, 3, 96)])
def test_features_over_other_geometries(level, heads, kv_heads, head_dim):
    """MHA, MQA with a head_dim that is no multiple of 8 (the scalar kernels
    at every level) and GQA 4 at 96 dims; every feature at once."""
    rng = np.random.default_rng(heads * 1000 + head_dim)
    contexts, queries = [1300, 64, 40], [1, 64, 3]
    pool = make_pool("bfloat16", rng, 290, block_size=5, kv_heads=kv_heads, head_dim=head_dim)
    tables, lens, qsl = make_batch(rng, pool, contexts, queries)
    kw = dict(sliding_window=1100, chunk_size=20, alibi_slopes=alibi_of(heads),
              sinks=sinks_of(rng, heads), logits_soft_cap=10.0)
    q = rng.standard_normal((int(qsl[-1]), heads, head_dim)).astype(np.float32)
    got = kvcore.paged_attention(q, pool, 0, tables, lens, qsl, **kw)
    assert rel_err(got, reference(pool, 0, q, tables, lens, qsl, **kw)) <= TOL


def test_chunks_are_exact_where_they_start_and_end():
    """A chunk's first query sees itself only; its last sees the whole
    chunk; every query its chunk's keys only (one-hot values tell which)."""
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="float32")
    n = 20
    k = np.zeros((n, 1, 8), np.float32)
    v = np.zeros((n, 1, 8), np.float32)
    v[np.arange(n), 0, np.arange(n) % 8] = 1.0     # value t: one-hot of t % 8
    pool.write(0, k, v, np.arange(n))
    q = np.zeros((n, 1, 8), np.float32)            # every score 0: a uniform softmax
    out = kvcore.paged_attention(q, pool, 0, [[0, 1, 2, 3, 4]], [n], [0, n], chunk_size=6)
    for p in range(n):
        seen = np.arange(p // 6 * 6, p + 1)
        want = np.zeros(8)
        np.add.at(want, seen % 8, 1.0 / len(seen))
        np.testing.assert_allclose(out[p, 0], want, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ per-layer kinds
def test_per_layer_kinds_run_each_layer_as_its_own_plan(level):
    """Gemma-2-like (windowed and global layers) and Llama-4-like (chunked
    and global) layers in one plan, with per-layer slopes and sinks: each
    layer equals a plan of its own kind bit for bit and the reference, on
    the fast path (float32 q) and the general one (float16 q)."""
    rng = np.random.default_rng(5)
    layers = 4
    windows = [64, None, 0, 64]
    chunks = [0, None, 48, 48]
    alibi = np.stack([alibi_of(8) * (1 + layer) for layer in range(layers)])
    sinks = sinks_of(rng, 8, layers)
    contexts, queries = [1400, 120, 33], [1, 40, 33]
    pool = make_pool("float16", rng, 110, layers=layers)
    tables, lens, qsl = make_batch(rng, pool, contexts, queries)
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, sliding_window=windows,
                                chunk_size=np.array(chunks[:2] + [48, 48]),
                                alibi_slopes=alibi, sinks=sinks, num_threads=2)
    for layer in range(layers):
        q = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float32)
        kind = dict(sliding_window=windows[layer] or None, chunk_size=chunks[layer] or None,
                    alibi_slopes=alibi[layer], sinks=sinks[layer])
        fast = plan.run(q, layer)
        general = plan.run(q.astype(np.float16), layer)
        alone = kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=1, **kind).run(
            q.astype(np.float16).astype(np.float32), layer)
        np.testing.assert_array_equal(general.view(np.uint32), alone.view(np.uint32))
        want = reference(pool, layer, q, tables, lens, qsl, **kind)
        assert rel_err(fast, want) <= TOL, layer


def test_per_layer_windows_check_the_blocks_of_the_widest_layer():
    """A block only a global layer reads is checked too (at plan time)."""
    rng = np.random.default_rng(2)
    pool = make_pool("float32", rng, 12, block_size=4, layers=2, head_dim=8)
    tables = np.arange(12, dtype=np.int32)[None, :].copy()
    tables[0, 0] = 99     # position 0: read by the global layer only
    with pytest.raises(IndexError, match=r"block_tables\[0, 0\]"):
        kvcore.AttentionPlan(pool, tables, [40], sliding_window=[8, None])
    plan = kvcore.AttentionPlan(pool, tables, [40], sliding_window=[8, 16])
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    assert np.isfinite(plan.run(q, 1)).all()
    # the chunk of the last position starts at 32: nothing before is read
    plan = kvcore.AttentionPlan(pool, tables, [40], chunk_size=[32, 8])
    assert np.isfinite(plan.run(q, 0)).all()


# ------------------------------------------------------------------ one-call forms
def test_sequence_and_cache_attention_take_the_features(level):
    rng = np.random.default_rng(9)
    kw = dict(chunk_size=5, alibi_slopes=alibi_of(4), sinks=sinks_of(rng, 4),
              sliding_window=7)
    pool = kvcore.BlockPool(8, 4, 1, 2, 16, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(13)))
    k = rng.standard_normal((13, 2, 16)).astype(np.float32)
    v = rng.standard_normal((13, 2, 16)).astype(np.float32)
    seq.append(0, k, v)
    q = rng.standard_normal((13, 4, 16)).astype(np.float32)
    got = seq.attention(0, q, **kw)
    # (the sequence as one block of 13 positions)
    want = paged_attention_reference(q, k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None],
                                     [[0]], [13], [0, 13], **kw)
    assert rel_err(got, want) <= TOL
    cache = kvcore.KVCache(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=16,
                           max_seq_len=16, dtype="float32")
    kb = rng.standard_normal((2, 2, 11, 16)).astype(np.float32)
    vb = rng.standard_normal((2, 2, 11, 16)).astype(np.float32)
    cache.update(0, kb, vb)
    qb = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)
    got = cache.attention(0, qb, **kw)
    for b in range(2):
        want = paged_attention_reference(qb[b].transpose(1, 0, 2), kb[b][None], vb[b][None],
                                         [[0]], [11], [0, 3], **kw)
        assert rel_err(got[b].transpose(1, 0, 2), want) <= TOL


def test_torch_and_float16_parameters_are_taken_as_float32():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    pool = make_pool("float32", rng, 6, block_size=4, head_dim=8)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    slopes = alibi_of(4)
    sinks = sinks_of(rng, 4)
    want = kvcore.paged_attention(q, pool, 0, [[0, 1, 2]], [10],
                                  alibi_slopes=slopes.astype(np.float32),
                                  sinks=sinks.astype(np.float32))
    for a, s in ((torch.tensor(slopes), torch.tensor(sinks, dtype=torch.float32)),
                 (list(slopes.astype(np.float32)), tuple(sinks.astype(np.float32)))):
        got = kvcore.paged_attention(q, pool, 0, [[0, 1, 2]], [10], alibi_slopes=a, sinks=s)
        np.testing.assert_array_equal(got, want)
    got = kvcore.paged_attention(q, pool, 0, [[0, 1, 2]], [10],
                                 alibi_slopes=torch.tensor(slopes, dtype=torch.bfloat16))
    want = reference(pool, 0, q, np.array([[0, 1, 2]]), np.array([10]), np.array([0, 1]),
                     alibi_slopes=torch.tensor(slopes, dtype=torch.bfloat16).float().numpy())
    assert rel_err(got, want) <= TOL


# ------------------------------------------------------------------ 38.3: every scale
F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scale, kw", [
    (1e38, {}),                                   # the issue's case: NaN before
    (F32_MAX / math.log2(math.e) * 0.999999, {}),  # the largest accepted
    (-1e38, {}),
    (1e38, dict(logits_soft_cap=5.0)),            # overflow to inf, then the cap
    (3e37, dict(sinks=True, alibi=True, chunk_size=24)),
    (2.0, dict(sinks=True)),                      # scaled after the max
], ids=["1e38", "largest", "negative", "softcap", "features", "two"])
def test_every_accepted_scale_matches_the_reference(level, dtype, scale, kw):
    """Integer-valued q and pages: the float32 dots are exact, so with a
    huge scale the softmax is the reference's one-hot limit (ties shared);
    no NaN where the float64 result is finite (before: all-NaN rows as soon
    as |q.k| > 2.36 at scale 1e38).  Decodes that split, a prefill."""
    rng = np.random.default_rng(int(abs(scale)) % 1000)
    pool = make_pool(dtype, rng, 170, integers=True)
    contexts, queries = [2100, 200, 40], [1, 1, 40]
    tables, lens, qsl = make_batch(rng, pool, contexts, queries)
    kw = features(kw, rng, 8)
    q = rng.integers(-2, 3, (int(qsl[-1]), 8, 64)).astype(np.float32)
    if scale == 2.0:
        q *= 0.25
    want = reference(pool, 0, q, tables, lens, qsl, scale=scale, **kw)
    assert np.isfinite(want).all()
    outs = [kvcore.AttentionPlan(pool, tables, lens, qsl, scale=scale, num_threads=t,
                                 **kw).run(q, 0) for t in (1, 3)]
    np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32))
    assert np.isfinite(outs[0]).all()
    assert rel_err(outs[0], want) <= TOL


@pytest.mark.parametrize("slope", [2.0**32, -(2.0**32)])
def test_alibi_slopes_at_their_limit_give_the_softmax_limit(slope, level):
    """|slope| = 2**32 (the largest taken): every bias stays finite, so rows
    whose values are all one give one (a slope of 3e38 gave NaN: its bias
    overflowed), and a steep positive slope weights the row's own key, a
    negative one its first."""
    pool = kvcore.BlockPool(4, 16, 1, 1, 8, dtype="float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    k = np.ones((3, 1, 8), np.float32)
    v = np.arange(3, dtype=np.float32)[:, None, None] + np.ones((3, 1, 8), np.float32)
    seq.append(0, k, v)
    out = seq.attention(0, np.ones((3, 1, 8), np.float32), alibi_slopes=[slope])
    assert np.isfinite(out).all(), (level, slope)
    want = np.arange(3) + 1.0 if slope > 0 else np.ones(3)
    np.testing.assert_array_equal(out[:, 0, 0], want)


@pytest.mark.parametrize("scale", [0.125, 3.0])      # 3.0: past 1/log2(e), the scores are dots
@pytest.mark.parametrize("rows", [1, 20])             # a decode item, a prefill item
def test_keys_whose_scores_are_all_minus_inf_weigh_nothing(level, scale, rows):
    """float16 keys stored as -inf (an overflow): every such key's score is
    -inf and its weight 0, as in the reference.  A tile whose visible
    scores are all -inf added NaN (exp2(-inf - -inf)) to its rows, which no
    later tile's finite keys could undo, and a sink over nothing but such
    keys gave NaN where the softmax gives the sink all of the weight (found
    by a fuzzing review)."""
    D, nkv, heads = 16, 1, 2
    n = 150                                          # past two 64-key tiles
    pool = kvcore.BlockPool(12, 16, 1, nkv, D, dtype="float16")
    rng = np.random.default_rng(rows)
    k = rng.standard_normal((n, nkv, D)).astype(np.float32)
    k[:70] = -1e6                                     # keys 0..69: -inf once stored
    v = rng.standard_normal((n, nkv, D)).astype(np.float32)
    pool.write(0, k, v, np.arange(n))
    assert np.isneginf(pool.key_cache(0)[0, 0, 0]).all()
    q = np.abs(rng.standard_normal((rows, heads, D))).astype(np.float32) + 0.1
    tables = np.arange(10, dtype=np.int32)[None]
    for length in (n, 60):                            # finite keys after them; none at all
        qsl = [0, rows]
        sinks = np.float32([0.5, -1.0])
        for kw in ({}, dict(sinks=sinks)):
            got = kvcore.paged_attention(q, pool, 0, tables, [length], qsl, scale=scale, **kw)
            with np.errstate(invalid="ignore"):      # (the reference's -inf - -inf)
                want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0),
                                                 tables, [length], qsl, scale=scale, **kw)
            if length == 60 and not kw:               # nothing but -inf keys: 0 / 0
                assert np.isnan(got).all() and np.isnan(want).all()
                continue
            assert np.isfinite(got).all(), (length, kw)
            if length == 60:                          # the sink takes all of the weight
                np.testing.assert_array_equal(got, np.zeros_like(got))
            assert np.abs(got - want).max() <= TOL * max(np.abs(want).max(), 1e-30), (length, kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_nan_key_alone_in_the_last_piece_of_a_long_decode_makes_its_rows_nan(level, dtype):
    """A long decode is split into pieces of 1024 positions merged after.  A
    NaN score's key alone in its piece (a length of 1024 k + 1, the NaN in
    the last key; or, with 2 queries, the first query's only key there) left
    the piece's maximum at -inf and its sum NaN, and the merge skipped it:
    a finite output where the reference's is NaN (found by a review).  Only
    the rows that see the key are NaN."""
    D, n = 64, 1025
    pool = kvcore.BlockPool(66, 16, 1, 1, D, dtype=dtype)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((n + 1, 1, D)).astype(np.float32)
    v = rng.standard_normal((n + 1, 1, D)).astype(np.float32)
    k[n - 1, 0, 5] = np.nan                  # (int8: a NaN row, its scale NaN)
    pool.write(0, k, v, np.arange(n + 1))
    tables = np.arange(66, dtype=np.int32)[None]
    q = rng.standard_normal((1, 8, D)).astype(np.float32)
    assert np.isnan(kvcore.paged_attention(q, pool, 0, tables, [n])).all()
    assert np.isfinite(kvcore.paged_attention(q, pool, 0, tables, [n - 1])).all()
    # two queries over n + 1 keys: both see key n - 1
    q2 = rng.standard_normal((2, 8, D)).astype(np.float32)
    assert np.isnan(kvcore.paged_attention(q2, pool, 0, tables, [n + 1], [0, 2])).all()


def test_the_issue_case_at_scale_1e38_is_the_one_hot_limit():
    """issue 38.3's repro: |q.k| > 2.36 at scale=1e38 gave NaN everywhere."""
    pool = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="float32")
    k = np.zeros((6, 1, 8), np.float32)
    k[np.arange(6), 0, np.arange(6)] = np.array([1, 3, 2, 3, 0, 1], np.float32)
    v = np.arange(6 * 8, dtype=np.float32).reshape(6, 1, 8)
    pool.write(0, k, v, np.arange(6))
    q = np.ones((1, 1, 8), np.float32)           # dots 1 3 2 3 0 1: a tie at 1 and 3
    out = kvcore.paged_attention(q, pool, 0, [[0, 1]], [6], scale=1e38)
    np.testing.assert_array_equal(out[0, 0], (v[1, 0] + v[3, 0]) / 2)


# ------------------------------------------------------------------ bad arguments
BAD = [
    (dict(chunk_size=0), ValueError, r"chunk_size must be a positive integer or None, got 0"),
    (dict(chunk_size=-4), ValueError, r"chunk_size must be a positive integer"),
    (dict(chunk_size=2.5), TypeError, r"chunk_size must be an integer"),
    (dict(chunk_size=2**63), ValueError, r"chunk_size must be in 1..2\*\*62"),
    (dict(chunk_size=[8]), ValueError, r"chunk_size must be None, a positive integer or a "
                                       r"sequence of num_layers=2 entries .*got 1 entries"),
    (dict(sliding_window=[8, -1]), ValueError, r"sliding_window\[1\] must be None, 0 \(off\)"),
    (dict(sliding_window=[8, 1.5]), TypeError, r"sliding_window\[1\] must be an integer"),
    (dict(alibi_slopes=[0.5, float("nan"), 0.1, 0.2]), ValueError,
     r"alibi_slopes must hold finite values \(as float32\), got nan at index 1"),
    (dict(alibi_slopes=np.array([1e39, 1, 1, 1])), ValueError,
     r"alibi_slopes must hold finite values \(as float32\), got 1e\+39 at index 0"),
    # a slope whose bias could overflow float32 (its inf - inf in the softmax was NaN)
    (dict(alibi_slopes=np.array([0.5, 3e38, 0.1, 0.2])), ValueError,
     r"alibi_slopes must lie in -2\*\*32..2\*\*32 .*got 3e\+38 at index 1"),
    (dict(alibi_slopes=[[0.5, 0.1, 0.1, 0.1], [0.5, 0.1, 0.1, -1.5e38]]), ValueError,
     r"alibi_slopes must lie in -2\*\*32..2\*\*32 .*got -1.5e\+38 at index \(1, 3\)"),
    (dict(sinks=np.full((2, 4), np.inf)), ValueError,
     r"sinks must hold finite values .* at index \(0, 0\)"),
    (dict(sinks=np.zeros((3, 4))), ValueError,
     r"sinks must have shape \(num_heads,\) or \(num_layers=2, num_heads\), got \(3, 4\)"),
    (dict(sinks=np.zeros((1, 2, 4))), ValueError, r"sinks must have shape"),
    (dict(sinks=np.zeros(0)), ValueError, r"sinks must have shape"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, r"sinks must hold floats"),
    (dict(sinks=["a", "b"]), TypeError, r"sinks must be a float array"),
    (dict(sinks=[True, False, True, True]), TypeError,
     r"sinks must be a float array .*got a list of bool"),
    (dict(sinks=[[0.5, 1, 0, 0], [0.5, None, 0, 0]]), TypeError,
     r"sinks\[1, 1\] must be a real number, got NoneType None"),
    # a bool among numbers (NumPy reads it as 0 or 1) is refused as a list of bools is
    (dict(sinks=[0.5, True, 0.0, 0.0]), TypeError,
     r"sinks\[1\] must be a real number, got bool True"),
    (dict(alibi_slopes=[[0.5, 0.1, 0.1, 0.1], (0.5, 0.1, np.False_, 0.1)]), TypeError,
     r"alibi_slopes\[1, 2\] must be a real number, got bool"),
    (dict(alibi_slopes=[0.5, 10**400, 0.1, 0.2]), ValueError,
     r"alibi_slopes\[1\] must be finite, got 1000.*\(an int of 401 digits\)"),
    (dict(sinks=[0.5, 0.0, -10**5000, 0.0]), ValueError,
     r"sinks\[2\] must be finite, got an int of 16610 bits"),
    (dict(alibi_slopes=np.zeros(3)), ValueError,
     r"alibi_slopes's num_heads \(its last axis\) must be a positive multiple of the pool's "
     r"num_kv_heads=2 .*got 3"),
    (dict(alibi_slopes=np.zeros(4), sinks=np.zeros(6)), ValueError,
     r"sinks must have num_heads=4 entries per layer .*got 6"),
    (dict(alibi_slopes=np.zeros(4), num_heads=6), ValueError,
     r"alibi_slopes must have num_heads=6 entries per layer .*got 4"),
]


@pytest.mark.parametrize("kw, exc, match", BAD)
def test_bad_features_are_refused_by_name_before_any_work(kw, exc, match):
    rng = np.random.default_rng(0)
    pool = make_pool("float32", rng, 8, block_size=4, layers=2, head_dim=8)
    tables, lens = np.array([[0, 1, 2]], np.int32), np.array([10])
    before = pool.storage.copy()
    with pytest.raises(exc, match=match):
        kvcore.AttentionPlan(pool, tables, lens, **kw)
    out = np.full((1, 4, 8), 7.0, np.float32)
    q = np.ones((1, 4, 8), np.float32)
    if "num_heads" not in kw:   # (an AttentionPlan argument only)
        with pytest.raises(exc, match=match):
            kvcore.paged_attention(q, pool, 0, tables, lens, out=out, **kw)
    assert (out == 7.0).all()
    np.testing.assert_array_equal(pool.storage, before)


def test_a_run_with_other_heads_than_the_plans_is_refused_and_the_plan_still_runs():
    rng = np.random.default_rng(1)
    pool = make_pool("float32", rng, 8, block_size=4, layers=2, head_dim=8)
    plan = kvcore.AttentionPlan(pool, [[0, 1, 2]], [10], alibi_slopes=alibi_of(4),
                                sinks=sinks_of(rng, 4))
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    first = plan.run(q, 1)
    out = np.full((1, 2, 8), 3.0, np.float32)
    with pytest.raises(ValueError, match=r"q.shape\[1\] must be the plan's num_heads=4 "
                                         r"\(the heads of its alibi_slopes / sinks\), got 2"):
        plan.run(q[:, :2], 1, out=out)
    assert (out == 3.0).all()
    np.testing.assert_array_equal(plan.run(q, 1), first)
    with pytest.raises(ValueError, match=r"q.shape\[1\] must be the plan's num_heads=4"):
        kvcore.paged_attention(q[:, :2], pool, 0, [[0, 1, 2]], [10], sinks=np.zeros(4))


def test_without_slopes_or_sinks_a_run_may_take_another_head_count():
    rng = np.random.default_rng(6)
    pool = make_pool("float32", rng, 8, block_size=4, head_dim=8)
    plan = kvcore.AttentionPlan(pool, [[0, 1, 2]], [10], num_heads=4, chunk_size=4)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    np.testing.assert_array_equal(plan.run(q, 0), kvcore.paged_attention(
        q, pool, 0, [[0, 1, 2]], [10], chunk_size=4))


def test_the_plan_copies_its_parameters():
    rng = np.random.default_rng(3)
    pool = make_pool("float32", rng, 8, block_size=4, head_dim=8)
    slopes, sinks = alibi_of(4), sinks_of(rng, 4)
    plan = kvcore.AttentionPlan(pool, [[0, 1, 2]], [10], alibi_slopes=slopes, sinks=sinks)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    first = plan.run(q, 0)
    slopes[:] = 100.0
    sinks[:] = -50.0
    np.testing.assert_array_equal(plan.run(q, 0), first)


def test_cuda_backend_computes_every_feature():
    """No GPU needed: the CUDA attention refuses none of the features (its
    kernels compute them: tests/cuda/test_attention_cuda_emulation.py checks
    each against the float64 reference in the host emulation), and a
    malformed row is refused by name before any device work."""
    from kvcore.backends.cuda.attention import CudaAttention, CudaAttentionPlan
    from kvcore.backends.cuda.backend import CudaBackend
    for args in ((48, False, False), (0, True, False), (0, False, True), (16, True, True)):
        CudaBackend.check_attention_features(None, *args)
    be = CudaAttention(types.SimpleNamespace(_is_device=lambda a: True, device="cuda:0"))
    plan = CudaAttentionPlan(num_tokens=1, num_heads=2, num_kv_heads=1, head_dim=64,
                             block_size=16, num_blocks=1, kind=0, version=3)
    be.attention_io_kinds = lambda plan: (frozenset({0}), frozenset({0}))
    be.scales = lambda kind, key_cache, codecs: [None] * 5 + [1.0, 1.0]
    q = np.zeros((1, 2, 64), np.float32)
    kv = np.zeros((1, 1, 16, 64), np.float32)
    with pytest.raises(ValueError, match=r"sinks must be a float32 C-contiguous \(2,\) array"):
        be.attention_run(plan, q, q.copy(), kv, kv, sinks=np.zeros(3, np.float32))


@pytest.mark.cuda
def test_a_cuda_pool_computes_the_features_as_the_cpu_does():
    """On a GPU: a CUDA pool's plan computes chunked attention (per-layer
    kinds too), ALiBi and sinks, giving a CPU pool's results for the same
    K/V within the contract's 1e-5."""
    try:
        from _cuda_env import cuda_backend_or_skip
    except ImportError:  # pragma: no cover - run as a package
        from ._cuda_env import cuda_backend_or_skip
    cuda_backend_or_skip()
    import cupy

    rng = np.random.default_rng(39)
    cpu = kvcore.BlockPool(4, 16, 2, 2, 64, dtype="float16")
    gpu = kvcore.BlockPool(4, 16, 2, 2, 64, dtype="float16", device="cuda")
    for layer in range(2):
        k, v = rng.standard_normal((2, 20, 2, 64)).astype(np.float32)
        cpu.write(layer, k, v, np.arange(20))
        gpu.write(layer, cupy.asarray(k), cupy.asarray(v), np.arange(20))
    for kw in (dict(chunk_size=8), dict(sliding_window=[None, 8], chunk_size=[0, 8]),
               dict(alibi_slopes=rng.uniform(0.01, 1, 4)), dict(sinks=rng.standard_normal((2, 4))),
               dict(scale=1e38, sinks=[30.0, 0.0, -1.0, 2.0])):
        q = rng.standard_normal((1, 4, 64)).astype(np.float32)
        for layer in range(2):
            want = kvcore.AttentionPlan(cpu, [[0, 1]], [20], **kw).run(q, layer)
            got = kvcore.AttentionPlan(gpu, [[0, 1]], [20], **kw).run(cupy.asarray(q), layer)
            np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=0,
                                       atol=1e-5 * np.abs(want).max())
