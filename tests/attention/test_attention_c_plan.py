"""The C attention plan through the CPU backend's interface
(``attention_plan`` / ``attention_run``, ``check_attention_tables``, the
one-call ``paged_attention``): planned once, run per layer, every run bit
for bit equal to the one-call paged_attention, at every SIMD level and
thread count; the plan keeps its own copy of the index arrays; inconsistent
calls raise instead of reading out of bounds."""

import numpy as np
import pytest

from kvcore.backends import CPU
from kvcore.backends.cpu import _attention

try:
    from _helpers import run_in_threads, simd_level
    from _simd_levels import simd_level_params
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import run_in_threads, simd_level
    from ._simd_levels import simd_level_params

LEVELS = _attention.available_simd_levels()
KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}


@pytest.fixture(params=simd_level_params(LEVELS, _attention.simd_level_names()))
def level(request):
    with simd_level(request.param):
        yield request.param


def _batch(rng, contexts, queries, max_blocks, num_blocks, block_size):
    # shuffled pages (sequences may share some, as prefix caching does)
    tables = rng.integers(0, num_blocks, (len(contexts), max_blocks)).astype(np.int32)
    seq_lens = np.array(contexts, np.int64)
    qsl = np.concatenate([[0], np.cumsum(queries)]).astype(np.int64)
    return np.ascontiguousarray(tables), seq_lens, qsl


def _caches(rng, dtype, layers, num_blocks, nkv, block_size, head_dim):
    shape = (layers, num_blocks, nkv, block_size, head_dim)
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "float32":
        return x, x.copy()
    if dtype == "float16":
        return x.astype(np.float16), (x * 0.5).astype(np.float16)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 by truncation
    return bits, bits[:, ::-1].copy()


def _one_layer(seed, contexts, queries, max_blocks, num_blocks, dtype):
    """``(tables, seq_lens, qsl, kc, vc, q)``: a batch over one layer of
    caches (block size 16, 2 KV heads of 64) and its queries (8 heads)."""
    rng = np.random.default_rng(seed)
    tables, seq_lens, qsl = _batch(rng, contexts, queries, max_blocks, num_blocks, 16)
    kc, vc = _caches(rng, dtype, 1, num_blocks, 2, 16, 64)
    q = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float32)
    return tables, seq_lens, qsl, kc, vc, q


def _make(tables, seq_lens, qsl, num_blocks, kind, threads, window=0, cap=0.0):
    assert CPU.check_attention_tables(tables, seq_lens, qsl, int(qsl[-1]), num_blocks, 16,
                                      window) == (None, 0, 0)
    return CPU.attention_plan(
        tables, seq_lens, qsl, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        num_blocks=num_blocks, kind=kind, scale=0.125, sliding_window=window, soft_cap=cap,
        num_threads=threads)


def _one_call(q, out, kc, vc, kind, tables, seq_lens, qsl, window=0, cap=0.0):
    CPU.paged_attention(q, out, kc, vc, kind, tables, seq_lens, qsl, 0.125, window, cap,
                        num_threads=1)


@pytest.mark.parametrize("dtype", sorted(KINDS))
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window, cap", [(0, 0.0), (70, 20.0)])
def test_plan_runs_are_paged_attention_bit_for_bit(level, dtype, threads, window, cap):
    rng = np.random.default_rng(7)
    layers, num_blocks = 4, 96
    contexts, queries = [1, 1500, 40, 130], [1, 1, 40, 3]   # decode (split), prefill, chunk
    tables, seq_lens, qsl = _batch(rng, contexts, queries, 100, num_blocks, 16)
    kc, vc = _caches(rng, dtype, layers, num_blocks, 2, 16, 64)
    plan = _make(tables, seq_lens, qsl, num_blocks, KINDS[dtype], threads, window, cap)
    assert plan.num_items > 0 and 1 <= plan.num_threads <= threads
    T = int(qsl[-1])
    for layer in range(layers):
        q = rng.standard_normal((T, 8, 64)).astype(np.float32)
        got = np.full_like(q, np.nan)
        plan.run(q, got, kc[layer], vc[layer])
        want = np.empty_like(q)
        _one_call(q, want, kc[layer], vc[layer], KINDS[dtype], tables, seq_lens, qsl, window,
                  cap)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_plan_keeps_its_own_copy_of_the_index_arrays():
    tables, seq_lens, qsl, kc, vc, q = _one_layer(3, [300, 17], [1, 17], 20, 64, "float16")
    want = np.empty_like(q)
    _one_call(q, want, kc[0], vc[0], 1, tables, seq_lens, qsl)
    plan = _make(tables, seq_lens, qsl, 64, 1, 2)
    tables[:] = 10**6        # would read far past the pool
    seq_lens[:] = 0
    qsl[:] = 0
    del tables, seq_lens, qsl
    got = np.empty_like(q)
    plan.run(q, got, kc[0], vc[0])
    np.testing.assert_array_equal(got, want)



def test_owned_index_arrays_copy_once_and_forget_the_dead():
    from kvcore.backends import base
    tables = np.zeros((2, 3), np.int64)
    lens, qsl = np.array([5, 7]), [0, 1, 2]
    owned = base.owned_index_arrays(tables, lens, qsl)
    assert [a.dtype for a in owned] == [np.int32, np.int64, np.int64]
    assert not any(a.flags.writeable for a in owned)
    assert all(x is y for x, y in zip(base.owned_index_arrays(*owned), owned))   # taken as is
    # a caller's array, even read-only and of the right dtype, is copied
    mine = np.array([5, 7], np.int64)
    mine.flags.writeable = False
    assert base.owned_index_arrays(owned[0], mine, owned[2])[1] is not mine
    # the registry of dead copies stays bounded, and a dead copy's id taken
    # by a new array does not make that array "owned"
    for _ in range(3000):
        base.owned_index_arrays(tables, lens, qsl)
    assert len(base._OWNED_INDEX) < 2 * 1024 + 10
    for _ in range(200):
        fresh = np.zeros(3, np.int64)
        ref = base._OWNED_INDEX.get(id(fresh))
        assert ref is None or ref() is not fresh
        assert base.owned_index_arrays(owned[0], fresh, owned[2])[1] is not fresh


def test_plan_checks_block_ids_once():
    rng = np.random.default_rng(4)
    tables, seq_lens, qsl = _batch(rng, [40], [1], 4, 8, 16)
    tables[0, 2] = 8  # one past the pool, and read
    assert CPU.check_attention_tables(tables, seq_lens, qsl, 1, 8, 16, 0) == ("BAD_BLOCK_ID",
                                                                              0, 2)


def test_run_refuses_arrays_that_do_not_match_the_plan():
    rng = np.random.default_rng(5)
    tables, seq_lens, qsl = _batch(rng, [40, 9], [1, 2], 4, 16, 16)
    kc, vc = _caches(rng, "float16", 1, 16, 2, 16, 64)
    plan = _make(tables, seq_lens, qsl, 16, 1, 1)
    q = np.zeros((3, 8, 64), np.float32)
    with pytest.raises(ValueError, match="q and out"):
        plan.run(q[:2], np.empty_like(q[:2]), kc[0], vc[0])
    with pytest.raises(ValueError, match="caches"):
        plan.run(q, np.empty_like(q), kc[0, :15], vc[0, :15])   # fewer blocks than planned
    with pytest.raises(ValueError, match="caches"):
        plan.run(q, np.empty_like(q), kc[0].astype(np.float32), vc[0].astype(np.float32))
    out = np.full_like(q, np.nan)
    plan.run(q, out, kc[0], vc[0])  # still usable
    assert np.isfinite(out).all()


def test_plan_runs_from_several_threads_at_once():
    # one plan per thread (a plan's buffers are its own): same results
    tables, seq_lens, qsl, kc, vc, q = _one_layer(6, [1200, 33], [1, 4], 80, 200, "bfloat16")
    want = np.empty_like(q)
    _make(tables, seq_lens, qsl, 200, 2, 1).run(q, want, kc[0], vc[0])
    results = []

    def work():
        p = _make(tables, seq_lens, qsl, 200, 2, 2)
        for _ in range(5):
            out = np.empty_like(q)
            p.run(q, out, kc[0], vc[0])
            results.append(out)

    run_in_threads(work, 3)
    assert len(results) == 15
    for r in results:
        np.testing.assert_array_equal(r, want)
