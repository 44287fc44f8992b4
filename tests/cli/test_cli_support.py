"""What only ``python -m kvcore demo|bench`` use (kvcore/cli): the tiny
model and the pure-Python reference pool the benchmarks compare against.
(These checks lived in the library as ``_self_check`` functions.)"""
import numpy as np
import pytest

from kvcore.cli.benchmarks._pyref_pool import PyBlockPool
from kvcore.cli.model import ModelConfig, NumpyContiguousCache, TinyTransformer


def test_python_reference_pool_shares_evicts_and_caches_like_the_native_one():
    bs = 16
    pool = PyBlockPool(num_blocks=32, block_size=bs)
    prefix = list(range(1000, 1064))                  # 4 full blocks
    a = prefix + list(range(36))                      # 100 tokens: 6 full blocks + 4
    b = prefix + list(range(500, 536))

    assert pool.allocate("a", a) == 0
    assert pool.num_free_blocks == 32 - 7
    pool.commit("a", 100)
    assert pool.num_cached_blocks == 6

    assert pool.allocate("b", b) == 64                # shared 4 blocks
    assert pool.block_table("b")[:4] == pool.block_table("a")[:4]
    assert all(pool.ref_count(i) == 2 for i in pool.block_table("a")[:4])
    assert pool.num_free_blocks == 32 - 7 - 3

    assert pool.allocate("c", a) == 96                # all 6 full blocks of a
    assert pool.allocate("d", prefix) == 48           # 64-token prompt: last block recomputed
    assert pool.allocate("e", prefix, extra="salt") == 0   # different salt shares nothing
    for r in "abcde":
        pool.free(r)
    assert pool.num_free_blocks == 32 and pool.num_used_blocks == 0
    pool.free("a")                                     # idempotent

    # Freed cached blocks still hit, and are taken out of the free queue.
    assert pool.allocate("f", a) == 96
    assert pool.num_free_blocks == 32 - 7
    pool.free("f")

    # The cached blocks were released last (by "f"), so they sit at the queue
    # tail and taking every other free block evicts none of them.
    before = pool.evictions
    cached_before = pool.num_cached_blocks
    filler = list(range(2000, 2000 + 16 * 31))
    n_fresh = pool.num_free_blocks - cached_before
    assert pool.allocate("g", filler[: 16 * n_fresh]) == 0
    assert pool.evictions == before
    pool.free("g")
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0

    # Tail-first release: reuse evicts a's tail before its head.
    pool = PyBlockPool(num_blocks=8, block_size=bs)
    pool.allocate("a", a)                              # 7 blocks
    pool.commit("a", 100)
    pool.free("a")
    assert pool.allocate("x", list(range(3000, 3016))) == 0   # 1 never-used block: no eviction
    assert pool.evictions == 0
    assert pool.allocate("y", list(range(4000, 4017))) == 0   # 2 blocks: evicts a's last two
    assert pool.evictions == 1                               # (the partial 7th block had no hash)
    pool.free("x")
    pool.free("y")
    assert pool.allocate("z", a) == 80                        # blocks 0..4 of a survived
    free_before = pool.num_free_blocks
    with pytest.raises(MemoryError):
        pool.allocate("w", list(range(5000, 5100)))
    assert "w" not in pool.requests and pool.num_free_blocks == free_before
    assert pool.stats()["prefix_hits"] == 80

    # Decode: append tokens and commit them; a full decoded block becomes cacheable.
    pool = PyBlockPool(num_blocks=8, block_size=bs)
    assert pool.allocate("p", list(range(20))) == 0
    pool.commit("p", 20)
    pool.append_tokens("p", list(range(20, 33)))
    pool.commit("p", 13)
    assert pool.num_cached_blocks == 2
    pool.free("p")
    assert pool.allocate("q", list(range(40))) == 32


def test_tiny_model_cached_decode_matches_a_full_recompute():
    """Cached prefill + decode must match a full recompute; greedy must vary."""
    model = TinyTransformer(ModelConfig(), seed=0)
    cfg = model.config
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab_size, size=40).tolist()

    cache = NumpyContiguousCache.from_config(cfg, max_seq_len=64)
    tokens = list(prompt)
    step_logits = [model.forward_with_cache(prompt, cache)]
    for _ in range(8):
        nxt = int(np.argmax(step_logits[-1][-1]))
        tokens.append(nxt)
        step_logits.append(model.forward_with_cache([nxt], cache))
    cached = np.concatenate(step_logits, axis=0)
    full = model.forward_full(tokens)
    err = float(np.max(np.abs(cached - full)))
    generated = tokens[len(prompt):]
    assert err <= 1e-4, err
    assert len(set(generated)) > 1, generated


def test_the_one_timing_loop_counts_warmups_samples_and_the_budget():
    from kvcore.cli.benchmarks import _timing
    calls, befores = [], []
    s = _timing.samples(lambda: calls.append(1), repeat=4, number=3, warmup=2,
                        before=lambda: befores.append(1))
    assert len(s) == 4 and all(x >= 0 for x in s)
    assert len(calls) == 2 + 4 * 3 and len(befores) == 2 + 4
    # a budget far past what the calls take: sampling stops at repeat_max
    calls.clear()
    s = _timing.samples(lambda: calls.append(1), repeat=2, warmup=0, budget=60.0, repeat_max=7)
    assert len(s) == 7 == len(calls)
    # a device-style clock: stop(start()) is the elapsed seconds
    ticks = iter(range(100))
    s = _timing.samples(lambda: None, repeat=3, warmup=0,
                        clock=(lambda: next(ticks), lambda t0: next(ticks) - t0))
    assert s == [1, 1, 1]
    r = {}
    assert _timing.timed(r, "x", lambda: None, repeat=3) == r["x"]
    assert r["x_range"][0] <= r["x"] <= r["x_range"][1]
