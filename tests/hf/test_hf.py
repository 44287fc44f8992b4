"""kvcore.hf: the transformers Cache, prefix reuse across generate calls and
attn_implementation="kvcore", on tiny models built from configs with seeded
random weights (no downloads).

Skips without torch and transformers, except with KVCORE_REQUIRE_HF=1 (set
by .ci/run, which installs the ``hf`` extra): then a missing or broken
install fails the module instead.
"""
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("KVCORE_REQUIRE_HF", "") not in ("", "0"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

import _hf_zoo  # noqa: E402 (after the import skips: it needs torch and transformers)
import kvcore
import kvcore.hf
from kvcore.hf import PagedCache, pool_for

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96
PAD = 0


def _tiny(family, attn="sdpa", seed=0):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    # the weights come from their own seeded generator state: building a
    # model (model_for builds on first use) never moves the caller's RNG,
    # which a seeded sampling test has just set
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.set_attn_implementation(attn)
    model.eval()
    model.generation_config.eos_token_id = None   # every call runs max_new_tokens
    model.generation_config.pad_token_id = PAD
    return model


_models = {}


def model_for(family, attn="sdpa"):
    key = (family, attn)
    if key not in _models:
        _models[key] = _tiny(family, attn)
    return _models[key]


def _prompts(lengths, seed=1):
    """Left-padded input_ids and attention_mask for prompts of ``lengths``."""
    return _hf_zoo.prompts(lengths, seed, vocab=VOCAB, pad=PAD)


def _kw(model, cache):
    """``cache=cache`` in the keyword this transformers version takes."""
    return {kvcore.hf.cache_keyword(model): cache}


def _dynamic(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, **_kw(model, transformers.DynamicCache()),
                          **kw)


def _paged(model, ids, mask, dtype="float32", **kw):
    pool = pool_for(model.config, 256, dtype=dtype, block_size=16)
    with PagedCache(pool) as cache:
        out = model.generate(ids, attention_mask=mask, **_kw(model, cache), **kw)
    assert pool.num_used_blocks == 0
    pool.debug.check()
    return out


BATCHES = {"b1": [37], "b4": [37, 20, 5, 29]}


# ------------------------------------------------------------------ pool_for
def test_pool_for_shapes_and_bad_configs():
    model = model_for("llama")
    pool = pool_for(model.config, 8, dtype="float32", block_size=4)
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim) == (2, 2, 16)
    assert pool.dtype == "float32" and pool.block_size == 4

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=0)
    with pytest.raises(ValueError, match="num_key_value_heads must be a positive integer"):
        pool_for(cfg, 8)
    cfg = transformers.LlamaConfig(num_hidden_layers=0, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        pool_for(cfg, 8)
    # transformers' own configs validate this; a plain object is read the same way
    cfg = types.SimpleNamespace(num_hidden_layers=2, hidden_size=60, num_attention_heads=8)
    with pytest.raises(ValueError, match="not a multiple of num_attention_heads"):
        pool_for(cfg, 8)
    cfg = types.SimpleNamespace(num_hidden_layers=2, hidden_size=64)
    with pytest.raises(ValueError, match="neither num_key_value_heads nor num_attention_heads"):
        pool_for(cfg, 8)
    cfg = types.SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    assert pool_for(cfg, 2).num_kv_heads == 4 and pool_for(cfg, 2).head_dim == 16


def test_mismatched_pool_raises_clear_errors():
    model = model_for("llama")
    ids, mask = _prompts([10])
    wrong = kvcore.BlockPool(16, 16, 2, 4, 16, dtype="float32")     # 4 KV heads, model has 2
    with pytest.raises(ValueError, match=r"pool does not fit the model.*\(2, 2, 16\).*\(2, 4, 16\)"):
        kvcore.hf.generate(model, ids, wrong, attention_mask=mask, max_new_tokens=2)
    assert wrong.num_used_blocks == 0
    with pytest.raises(ValueError, match="the pool 4 of dimension 16"):
        model.generate(ids, attention_mask=mask, **_kw(model, PagedCache(wrong)), max_new_tokens=2)
    few_layers = kvcore.BlockPool(16, 16, 1, 2, 16, dtype="float32")
    with pytest.raises(IndexError, match="layer_idx must be in 0..0"):
        model.generate(ids, attention_mask=mask, **_kw(model, PagedCache(few_layers)),
                       max_new_tokens=2)
    right = pool_for(model.config, 16)
    cache = PagedCache(right)
    k = torch.zeros(1, 2, 1, 16)
    for bad, exc, msg in ((True, TypeError, "layer_idx must be an integer, got bool"),
                          (2**64, IndexError, "layer_idx must be in 0..1"),
                          (1.0, IndexError, "layer_idx must be in 0..1")):
        with pytest.raises(exc, match=msg):
            cache.update(k, k, bad)
    assert right.num_used_blocks == 0 and not right.storage.any()
    with pytest.raises(TypeError, match="pool must be a kvcore.BlockPool"):
        PagedCache("pool")
    with pytest.raises(ValueError, match=r"pool.dtype must be one of \[.*'int8'\].*'float64'"):
        PagedCache(_FakeDtypePool())


def _two_step_cache(pool):
    """A PagedCache of 2 rows x 3 columns written through update (no model)."""
    cache = PagedCache(pool)
    k = torch.ones(2, 2, 3, 8)
    for layer in range(pool.num_layers):
        cache.update(k, k, layer)
    return cache


def _rows_state(cache):
    return (cache.get_seq_length(), cache.pool.num_free_blocks,
            [(s.num_computed, s.num_tokens) for s in cache.rows])


@pytest.mark.parametrize("call, exc, match", [
    (lambda c: c.crop(1.5), TypeError, r"tokens_to_remove must be an integer, got float 1.5"),
    (lambda c: c.crop("2"), TypeError, r"tokens_to_remove must be an integer, got str"),
    (lambda c: c.crop(True), TypeError, r"tokens_to_remove must be an integer, got bool"),
    (lambda c: c.reorder_cache([0.9, 1.7]), TypeError,
     r"beam_idx must hold integers \(row indices\), got dtype float64"),
    (lambda c: c.reorder_cache(torch.tensor([1.0, 0.0])), TypeError,
     r"beam_idx must hold integers \(row indices\), got dtype float32"),
    (lambda c: c.reorder_cache([]), ValueError,
     r"beam_idx must select at least one of the 2 rows, got none"),
    (lambda c: c.batch_repeat_interleave(1.5), TypeError, r"repeats must be an integer"),
    (lambda c: c.batch_repeat_interleave(0), ValueError,
     r"repeats must be a positive integer, got 0"),
    (lambda c: c.batch_repeat_interleave(-1), ValueError,
     r"repeats must be a positive integer, got -1"),
    (lambda c: c.batch_repeat_interleave(9), ValueError,
     r"repeats must be at most 8 \(the 2 rows times repeats may not exceed the pool's 16 "
     r"blocks\), got 9"),
    (lambda c: c.batch_repeat_interleave(2**62), ValueError, r"repeats must be at most 8"),
    (lambda c: c.batch_repeat_interleave(10**20), ValueError, r"repeats must be at most 8"),
    (lambda c: c.reorder_cache(np.array([1, 2**63], np.uint64)), IndexError,
     r"beam_idx must be row indices in 0..1, got \[1, 9223372036854775808\]"),
    (lambda c: c.batch_select_indices([0, 2]), IndexError,
     r"indices must be row indices in 0..1, got \[0, 2\]"),
    (lambda c: c.batch_select_indices(torch.tensor([0.0])), TypeError,
     r"indices must hold integers \(row indices\), got dtype float32"),
    (lambda c: c.reorder_cache([[0, 1], [1, 0]]), ValueError,
     r"beam_idx must be 1-D \(the old row of each new row\), got shape \(2, 2\)"),
    (lambda c: c.batch_select_indices(torch.tensor(1)), ValueError,
     r"indices must be 1-D \(the old row of each new row\), got shape \(\)"),
    (lambda c: c.update(np.ones((2, 2, 1, 8), np.float32), np.ones((2, 2, 1, 8), np.float32), 0),
     TypeError, r"key_states and value_states must be torch tensors, got ndarray and ndarray"),
    (lambda c: c.update(torch.ones(0, 2, 1, 8), torch.ones(0, 2, 1, 8), 0), ValueError,
     r"key_states must hold at least one row .*got \(0, 2, 1, 8\)"),
    (lambda c: c.update(torch.ones(2, 2, 1, 8, dtype=torch.int64),
                        torch.ones(2, 2, 1, 8, dtype=torch.int64), 0), TypeError,
     r"key_states and value_states must be dense float32, float16 or bfloat16 tensors of one "
     r"dtype, got torch.int64 \(torch.strided\) and torch.int64"),
    (lambda c: c.update(torch.ones(2, 2, 1, 8), torch.ones(2, 2, 1, 8, dtype=torch.float16), 0),
     TypeError, r"tensors of one dtype, got torch.float32 \(torch.strided\) and torch.float16"),
    (lambda c: c.update(torch.ones(2, 2, 1, 8).to_sparse(), torch.ones(2, 2, 1, 8).to_sparse(),
                        0), TypeError, r"must be dense .*got torch.float32 \(torch.sparse_coo\)"),
], ids=["crop-float", "crop-str", "crop-bool", "reorder-float", "reorder-float-tensor",
        "reorder-empty", "repeat-float", "repeat-0", "repeat-negative", "repeat-past-pool",
        "repeat-2**62", "repeat-10**20", "reorder-uint64", "select-past-rows", "select-float",
        "reorder-2-d", "select-0-d", "update-numpy", "update-no-rows", "update-int64",
        "update-mixed-dtypes", "update-sparse"])
def test_cache_methods_refuse_what_is_not_an_integer_by_name(call, exc, match):
    """crop, reorder_cache, batch_repeat_interleave and update refuse floats
    (never truncated to ints), strings, bools, empty selections and arrays
    that are not tensors by name, and the cache is as it was."""
    pool = kvcore.BlockPool(16, 4, 2, 2, 8, dtype="float32")
    cache = _two_step_cache(pool)
    before = _rows_state(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    assert _rows_state(cache) == before
    cache.free()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("query_length, exc, match", [
    (2.5, TypeError, r"query_length must be an integer, got float 2.5"),
    (1.0, TypeError, r"query_length must be an integer, got float 1.0"),
    (True, TypeError, r"query_length must be an integer, got bool True"),
    ("3", TypeError, r"query_length must be an integer, got str '3'"),
    (None, TypeError, r"query_length must be an integer, got NoneType None"),
    (-1, ValueError, r"query_length must be a non-negative integer, got -1"),
    (torch.tensor(3), ValueError,
     r"query_length must be an integer or the query's 1-D cache_position tensor, got a "
     r"tensor of shape \(\)"),
    (torch.zeros(1, 3), ValueError, r"1-D cache_position tensor, got a tensor of shape \(1, 3\)"),
], ids=["float", "float-whole", "bool", "str", "none", "negative", "0-d-tensor", "2-d-tensor"])
def test_get_mask_sizes_refuses_a_query_length_that_is_not_a_count_by_name(query_length, exc,
                                                                           match):
    """get_mask_sizes (the cache's and a layer's) takes a count or a 1-D
    cache_position tensor (older transformers): a float is never truncated,
    a bool, string or negative count never read as a length, and the cache
    is as it was."""
    pool = kvcore.BlockPool(16, 4, 2, 2, 8, dtype="float32")
    cache = _two_step_cache(pool)
    before = _rows_state(cache)
    for call in (lambda: cache.get_mask_sizes(query_length, 0),
                 lambda: cache.layers[1].get_mask_sizes(query_length)):
        with pytest.raises(exc, match=match):
            call()
        assert _rows_state(cache) == before
    assert cache.get_mask_sizes(np.int64(2), 0) == (5, 0)
    assert cache.get_mask_sizes(torch.arange(3, 5), 0) == (5, 0)
    cache.free()
    assert pool.num_used_blocks == 0


def test_an_empty_cache_refuses_row_indices_saying_it_holds_no_rows():
    pool = kvcore.BlockPool(16, 4, 2, 2, 8, dtype="float32")
    cache = PagedCache(pool)
    with pytest.raises(IndexError, match=r"beam_idx must be row indices none: the cache holds "
                                         r"no rows, got \[0\]"):
        cache.reorder_cache([0])
    cache.batch_select_indices([])              # (no rows selected from none)
    assert cache.rows == [] and pool.num_used_blocks == 0


def test_cache_repeats_up_to_the_pools_blocks():
    pool = kvcore.BlockPool(16, 4, 2, 2, 8, dtype="float32")
    cache = _two_step_cache(pool)
    cache.batch_repeat_interleave(np.int64(8))          # 2 rows x 8 = the pool's 16 blocks
    assert len(cache.rows) == 16 and cache.get_seq_length() == 3
    cache.free()
    assert pool.num_used_blocks == 0


def test_cache_takes_numpy_layer_indices_and_forwards_of_no_columns():
    pool = kvcore.BlockPool(16, 4, 2, 2, 8, dtype="float32")
    cache = PagedCache(pool)
    k = torch.ones(2, 2, 3, 8)
    for layer in (np.int64(0), np.int32(1)):
        keys, _ = cache.update(k, k, layer)
    assert cache.get_seq_length() == 3 and tuple(keys.shape) == (2, 2, 3, 8)
    empty = torch.ones(2, 2, 0, 8)
    for layer in range(2):
        keys, _ = cache.update(empty, empty, layer)
    assert cache.get_seq_length() == 3 and tuple(keys.shape) == (2, 2, 3, 8)
    cache.free()
    fresh = PagedCache(pool)
    for layer in range(2):
        keys, _ = fresh.update(empty, empty, layer)
    assert fresh.get_seq_length() == 0 and tuple(keys.shape) == (2, 2, 0, 8)
    fresh.free()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("salt, exc", [(1, TypeError), (["a"], TypeError), ("\ud800", ValueError)])
def test_cache_salt_is_checked_when_the_cache_is_made(salt, exc):
    pool = kvcore.BlockPool(4, 4, 2, 2, 8, dtype="float32")
    with pytest.raises(exc, match="salt must be"):
        PagedCache(pool, salt=salt)


class _FakeDtypePool(kvcore.BlockPool):
    def __init__(self):
        super().__init__(4, 4, 2, 2, 16, dtype="float32")

    @property
    def dtype(self):
        return "float64"


# ------------------------------------------------------------------ tokens identical
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_greedy_matches_dynamic_cache(family, batch):
    model = model_for(family)
    ids, mask = _prompts(BATCHES[batch])
    want = _dynamic(model, ids, mask, max_new_tokens=12, do_sample=False)
    got = _paged(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    assert len(set(want[:, -12:].flatten().tolist())) > 1   # the tokens do vary


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_kvcore_attention_matches_sdpa(batch):
    ids, mask = _prompts(BATCHES[batch])
    want = _dynamic(model_for("llama"), ids, mask, max_new_tokens=12, do_sample=False)
    got = _paged(model_for("llama", "kvcore"), ids, mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_kvcore_attention_without_paged_cache_falls_back_to_sdpa():
    ids, mask = _prompts(BATCHES["b4"])
    want = _dynamic(model_for("qwen2"), ids, mask, max_new_tokens=6, do_sample=False)
    got = _dynamic(model_for("qwen2", "kvcore"), ids, mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["GptOssForCausalLM", "Gemma2ForCausalLM"])
def test_kvcore_attention_without_paged_cache_computes_sinks_and_soft_caps(name):
    """Without a PagedCache the kvcore attention of a layer with sinks
    (gpt-oss) or a soft cap (Gemma 2), which sdpa does not take, computes
    what eager attention does: sdpa dropped the sinks silently (logits 0.57
    off, other tokens) and refused the cap, and calibrate_kv_scales (which
    runs the model on a DynamicCache) raised for Gemma 2."""
    model = _hf_zoo.build(name)
    ids, mask = _prompts([30, 23])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        tokens = _dynamic(model, ids, mask, max_new_tokens=8, do_sample=False)
        model.set_attn_implementation("kvcore")
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    np.testing.assert_allclose(got[real].numpy(), want[real].numpy(), rtol=1e-5, atol=1e-5)
    assert torch.equal(_dynamic(model, ids, mask, max_new_tokens=8, do_sample=False), tokens)
    scales = kvcore.hf.calibrate_kv_scales(model, ids, dtype="float8_e4m3fn")
    assert scales is not None


def test_kvcore_attention_gets_the_cache_and_tables_as_keyword_arguments():
    """Issue 22 item 2: the step reaches the attention as keyword arguments
    (transformers' paged names: cache, block_table, cu_seq_lens_q), not as
    an attribute hung on the key tensor."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((kwargs.get("cache"), kwargs.get("block_table"), kwargs.get("cu_seq_lens_q"),
                     kwargs.get("kvcore_layer"), key.__dict__.copy()))
        return kvcore.hf.kvcore_attention(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("kvcore_spy", spy)
    transformers.AttentionMaskInterface.register("kvcore_spy",
                                                 ALL_MASK_ATTENTION_FUNCTIONS["kvcore"])
    model = _tiny("llama", "kvcore_spy")
    ids, mask = _prompts([20, 7])
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    with PagedCache(pool) as cache:
        got = model.generate(ids, attention_mask=mask, **_kw(model, cache), max_new_tokens=3,
                             do_sample=False)
        assert len(seen) == 3 * 2                      # steps x layers
        for i, (c, table, qsl, layer, attrs) in enumerate(seen):
            assert c is cache and layer == i % 2 and attrs == {}
            assert table.shape[0] == 2 and qsl.tolist()[0] == 0
        # the first step's queries: each row's real columns, padding none
        assert seen[0][2].tolist() == [0, 20, 27]
        assert seen[-1][2].tolist() == [0, 1, 2]
    assert torch.equal(got, _dynamic(model_for("llama"), ids, mask, max_new_tokens=3,
                                     do_sample=False))


# ------------------------------------------------------------------ torch.compile
# (torch's inductor warns of its own use of torch.jit when it is first imported)
_INDUCTOR_IMPORT = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture
def compiled():
    """torch.compile for the test: torch's compile caches are dropped after it."""
    import torch._dynamo
    yield torch.compile
    torch._dynamo.reset()


@_INDUCTOR_IMPORT
@pytest.mark.parametrize("hit", [False, True])
def test_a_compiled_forward_gives_the_eager_tokens(hit, compiled, monkeypatch):
    """torch.compile(model.forward) with attn_implementation="kvcore": the
    cache's update and the attention are traced into the compiled regions,
    the update's write and the attention run as one operator a layer
    (kvcore::attend, every layer of every forward), and the mask function
    runs outside (torch.compiler.disable); the tokens are the eager ones,
    through model.generate and through kvcore.hf.generate (whose second call
    on the pool hits the first's prefix)."""
    ids, mask = _prompts(BATCHES["b4"])
    want = _dynamic(model_for("llama"), ids, mask, max_new_tokens=12, do_sample=False)
    model = _tiny("llama", "kvcore")
    model.forward = compiled(model.forward)
    pool = pool_for(model.config, 256, dtype="float32", block_size=16)
    operators = _hf_zoo.count_operators(monkeypatch)
    for call in range(2 if hit else 1):
        if hit:       # (kvcore.hf.generate looks the prompts up in the prefix cache)
            got = kvcore.hf.generate(model, ids, pool, attention_mask=mask,
                                     max_new_tokens=12, do_sample=False)
        else:
            with PagedCache(pool) as cache:
                got = model.generate(ids, attention_mask=mask, **_kw(model, cache),
                                     max_new_tokens=12, do_sample=False)
        assert torch.equal(got, want), call
        assert pool.num_used_blocks == 0
    if not hit:       # 12 forwards of 2 layers, each layer through the operator
        assert operators == [0, 1] * 12
    else:
        assert operators and operators[:2] == [0, 1]
    assert (pool.stats()["prefix_hits"] > 0) == hit
    pool.debug.check()


@_INDUCTOR_IMPORT
def test_a_compiled_forward_is_not_compiled_again_for_each_cache(compiled):
    """Each PagedCache is named to the operators by a tensor the graph takes
    as an input: generates on new caches (same shapes) compile nothing more."""
    from torch._dynamo.utils import counters

    ids, mask = _prompts([21, 13])
    model = _tiny("llama", "kvcore")
    model.forward = compiled(model.forward)
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    seen = []
    for _ in range(3):
        with PagedCache(pool) as cache:
            model.generate(ids, attention_mask=mask, **_kw(model, cache), max_new_tokens=4,
                           do_sample=False)
        seen.append((counters["frames"]["total"], counters["stats"]["unique_graphs"]))
    assert seen[0][1] > 0 and seen[1:] == [seen[0]] * 2


@_INDUCTOR_IMPORT
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_compiled_forward_over_narrow_pages_gives_the_eager_kvcore_tokens(dtype, compiled,
                                                                           monkeypatch):
    """The compiled route over bfloat16 and int8 pages computes what the
    eager kvcore forward computes over the same pages: the same tokens."""
    ids, mask = _prompts(BATCHES["b4"])
    model = _tiny("llama", "kvcore")
    want = _paged(model, ids, mask, dtype=dtype, max_new_tokens=10, do_sample=False)
    model.forward = compiled(model.forward)
    operators = _hf_zoo.count_operators(monkeypatch)
    assert torch.equal(_paged(model, ids, mask, dtype=dtype, max_new_tokens=10,
                              do_sample=False), want)
    assert operators == [0, 1] * 10


@_INDUCTOR_IMPORT
def test_a_compiled_step_that_fails_leaves_the_cache_as_the_eager_one_does(compiled):
    """A decode step that runs out of blocks inside the compiled route's
    operator raises what the eager step raises, and leaves the cache and
    pool as the eager one does (the columns of the forwards before it)."""
    ids, mask = _prompts([31])

    def run(model):
        pool = pool_for(model.config, 2, dtype="float32", block_size=16)
        with PagedCache(pool) as cache:
            with pytest.raises(kvcore.OutOfBlocksError) as caught:
                model.generate(ids, attention_mask=mask, **_kw(model, cache),
                               max_new_tokens=4, do_sample=False)
            state = (str(caught.value), cache.get_seq_length(), pool.num_used_blocks,
                     [row.num_tokens for row in cache.rows])
        pool.debug.check()
        return state

    model = _tiny("llama", "kvcore")
    want = run(model)
    assert want[1] == 32            # the prompt and one token: the 33rd column needs a block
    model.forward = compiled(model.forward)
    assert run(model) == want


@_INDUCTOR_IMPORT
def test_a_forward_compiled_by_a_backend_that_keeps_unread_results_is_refused(compiled):
    """backend="eager" runs the traced update's operator although no one
    reads its outputs: refused by name as a model computing with them
    would be, and the step undone (never a silent result)."""
    _compiled_refuses(_tiny("llama", "kvcore"), lambda f: compiled(f, backend="eager"),
                      r"llama layer 0: the model computes with the cached K/V itself \(in its "
                      r"compiled forward; or the forward was compiled by a backend .*'eager'")


@_INDUCTOR_IMPORT
def test_a_compiled_attention_asking_for_what_kvcore_does_not_compute_is_refused(compiled):
    """A keyword the kvcore attention does not compute, passed in a
    compiled forward, is refused by name when the operator runs, and the
    step undone, as eagerly."""
    def asking(module, query, key, value, attention_mask, **kwargs):
        return kvcore.hf.kvcore_attention(module, query, key, value, attention_mask,
                                          position_bias=torch.ones(1), **kwargs)

    _register("kvcore_asking", asking)
    _compiled_refuses(_tiny("llama", "kvcore_asking"), compiled,
                      r"llama layer 0: its attention asks for position_bias= \(a tensor of "
                      r"shape \(1,\)\)")


def _compiled_refuses(model, compiled, match):
    """``model`` with its forward compiled refuses a generate with ValueError
    matching ``match``, and the cache and pool are left empty."""
    model.forward = compiled(model.forward)
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    ids, mask = _prompts([21])
    with PagedCache(pool) as cache:
        with pytest.raises(ValueError, match=match):
            model.generate(ids, attention_mask=mask, **_kw(model, cache),
                           max_new_tokens=4, do_sample=False)
        assert cache.get_seq_length() == 0
    assert pool.num_used_blocks == 0
    pool.debug.check()


@_INDUCTOR_IMPORT
def test_a_compiled_model_computing_with_the_new_kv_itself_is_refused(compiled):
    """DiffLlama splits V before its attention: compiled, its forward is
    refused as the eager one is, by name, and the step is undone (the
    attention's operator finds other K/V than the traced update returned,
    or the update's operator runs because the split reads its outputs)."""
    config = transformers.DiffLlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.DiffLlamaForCausalLM(config).eval()
    model.set_attn_implementation("kvcore")
    _compiled_refuses(model, compiled,
                      r"diffllama layer 0: the model computes with the cached K/V itself "
                      r"\(in its compiled forward")


@_INDUCTOR_IMPORT
@pytest.mark.parametrize("read", ["base", "storage"])
def test_a_compiled_attention_reading_the_new_kv_through_its_storage_is_refused(read, compiled):
    """An attention function that computes with the K/V the traced update
    returned (through their ``_base``, their storage) makes the update's
    operator run: refused and the step undone, as eagerly.  (Where the old
    route runs, with the update outside the compiled regions, the marked K/V
    let torch's compiler read these while it builds a region, and refuse the
    model's own use of them: handoff.py.)"""
    from transformers import AttentionInterface, AttentionMaskInterface

    def peeking(module, query, key, value, attention_mask, **kwargs):
        if read == "base":
            seen = key._base.abs().mean()
        else:
            seen = torch.empty(0, dtype=key.dtype).set_(
                key.untyped_storage(), key.storage_offset(), key.shape, key.stride()).sum()
        out, weights = kvcore.hf.kvcore_attention(module, query, key, value, attention_mask,
                                                  **kwargs)
        return out * (1.0 + seen), weights

    AttentionInterface.register("kvcore_peeking", peeking)
    AttentionMaskInterface.register("kvcore_peeking", kvcore.hf.attention._kvcore_mask)
    _compiled_refuses(_tiny("llama", "kvcore_peeking"), compiled,
                      r"llama layer 0: the model computes with the cached K/V itself \(in its "
                      r"compiled forward")


def _register(name, attention):
    """``attention`` as ``attn_implementation=name``, with the kvcore mask function."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, kvcore.hf.attention._kvcore_mask)


@_INDUCTOR_IMPORT
def test_a_compiled_layer_calling_the_attention_twice_gives_the_eager_tokens(compiled,
                                                                            monkeypatch):
    """An attention function calling the kvcore attention twice for one
    layer (two query sets over the same K/V): the layer's first operator
    writes, the second runs after it and only attends; the eager tokens."""
    def twice(module, query, key, value, attention_mask, **kwargs):
        one, _ = kvcore.hf.kvcore_attention(module, query, key, value, attention_mask, **kwargs)
        two, _ = kvcore.hf.kvcore_attention(module, query * 0.5, key, value, attention_mask,
                                            **kwargs)
        return (one + two) / 2, None

    _register("kvcore_twice", twice)
    ids, mask = _prompts([21, 13])
    model = _tiny("llama", "kvcore_twice")
    want = _paged(model, ids, mask, max_new_tokens=5, do_sample=False)
    model.forward = compiled(model.forward)
    operators = _hf_zoo.count_operators(monkeypatch)
    assert torch.equal(_paged(model, ids, mask, max_new_tokens=5, do_sample=False), want)
    assert operators == [0, 0, 1, 1] * 5


@_INDUCTOR_IMPORT
@pytest.mark.filterwarnings(   # (torch's compiler reads .grad of the model's activations)
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_a_compiled_forward_with_autograd_on_gives_the_eager_logits(compiled):
    """A forward outside torch.no_grad() compiles (the operators take
    detached tensors, as the eager attention does) and gives the eager
    forward's logits and cache."""
    ids, mask = _prompts([21, 13])
    model = _tiny("llama", "kvcore")

    def forward():
        pool = pool_for(model.config, 16, dtype="float32", block_size=16)
        cache = PagedCache(pool)
        logits = model(input_ids=ids, attention_mask=mask, **_kw(model, cache)).logits
        return logits.detach(), cache.get_seq_length()

    want = forward()
    model.forward = compiled(model.forward)
    got = forward()
    assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5) and got[1] == want[1]


@_INDUCTOR_IMPORT
def test_a_compiled_layer_changing_its_k_after_the_update_caches_the_k_it_handed(compiled):
    """The pages hold the K/V as the layer handed them to ``update``, as
    eagerly, when the layer then changes its K in place (the traced update
    keeps a copy)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def patch(model):
        for layer in model.model.layers:
            def forward(hidden_states, position_embeddings=None, attention_mask=None,
                        cache=None, attn=layer.self_attn, **kwargs):
                shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
                q = attn.q_proj(hidden_states).view(shape).transpose(1, 2)
                k = attn.k_proj(hidden_states).view(shape).transpose(1, 2)
                v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
                k_cached, v_cached = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
                k.mul_(3.0)
                out, _ = kvcore.hf.kvcore_attention(attn, q, k_cached, v_cached, attention_mask,
                                                    scaling=attn.scaling, **kwargs)
                return attn.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None
            layer.self_attn.forward = forward
        return model

    ids, mask = _prompts([21, 13])
    want = _paged(patch(_tiny("llama", "kvcore")), ids, mask, max_new_tokens=6,
                  do_sample=False)
    model = patch(_tiny("llama", "kvcore"))
    model.forward = compiled(model.forward)
    assert torch.equal(_paged(model, ids, mask, max_new_tokens=6, do_sample=False), want)


@_INDUCTOR_IMPORT
def test_the_compiled_operators_act_on_the_cache_the_forward_updates(compiled):
    """The operators find the cache whose ``update`` was traced (its number,
    a graph input), not the last cache a kvcore mask function saw: a decode
    on cache A after a prefill on B, by an attention registered without the
    kvcore mask function, writes A (as eagerly)."""
    from transformers import AttentionInterface
    AttentionInterface.register(
        "kvcore_no_mask", lambda *args, **kwargs: kvcore.hf.kvcore_attention(*args, **kwargs))
    ids, mask = _prompts([20, 20])
    other, _ = _prompts([20, 20], seed=7)

    def run(model):
        model.set_attn_implementation("kvcore")
        pool = pool_for(model.config, 64, dtype="float32", block_size=16)
        a, b = PagedCache(pool), PagedCache(pool)
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, **_kw(model, a)).logits
            model(input_ids=other, attention_mask=mask, **_kw(model, b))
            model.set_attn_implementation("kvcore_no_mask")
            token = first[:, -1].argmax(-1, keepdim=True)
            step = model(input_ids=token, attention_mask=torch.cat([mask, torch.ones_like(token)],
                                                                   1), **_kw(model, a))
        state = (step.logits[:, -1].argmax(-1).tolist(), a.get_seq_length(), b.get_seq_length())
        pool.debug.check()
        a.free()
        b.free()
        assert pool.num_used_blocks == 0
        return state

    want = run(_tiny("llama", "kvcore"))
    assert want[1:] == (21, 20)
    model = _tiny("llama", "kvcore")
    model.forward = compiled(model.forward)
    assert run(model) == want


_FAIL_AT = {"layer": None}


@torch.library.custom_op("kvcore_tests::fail_at", mutates_args=())
def _fail_at(query: torch.Tensor, layer: int) -> torch.Tensor:
    """``query`` (a copy), or RuntimeError at run time in ``_FAIL_AT``'s layer."""
    if layer == _FAIL_AT["layer"]:
        raise RuntimeError(f"the model failed in layer {layer}")
    return query.clone()


@_fail_at.register_fake
def _(query, layer):
    return torch.empty_like(query)


@_INDUCTOR_IMPORT
def test_a_compiled_forward_failing_before_a_layers_attention_leaves_a_step_to_crop(compiled):
    """The model's own code raising between the last layer's update and its
    attention (at run time): that layer was not written (the write is the
    attention's operator's), the step is partial, the next forward refuses
    it by name, and after crop the cache computes the eager logits."""
    def failing(module, query, key, value, attention_mask, **kwargs):
        return kvcore.hf.kvcore_attention(module, _fail_at(query, module.layer_idx), key,
                                          value, attention_mask, **kwargs)

    _register("kvcore_failing", failing)
    ids, mask = _prompts([21, 13])
    model = _tiny("llama", "kvcore_failing")
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    with torch.no_grad(), PagedCache(pool) as cache:
        want = model(input_ids=ids, attention_mask=mask, **_kw(model, cache)).logits
    model.forward = compiled(model.forward)
    with torch.no_grad(), PagedCache(pool) as cache:
        _FAIL_AT["layer"] = 1
        try:
            with pytest.raises(RuntimeError, match="the model failed in layer 1"):
                model(input_ids=ids, attention_mask=mask, **_kw(model, cache))
        finally:
            _FAIL_AT["layer"] = None
        assert cache._step.partial and cache._step.layers_done == 1
        with pytest.raises(ValueError, match=r"stopped after 1 of the model's 2 layers .*in a "
                                             r"compiled forward, a layer whose kvcore attention"):
            model(input_ids=ids, attention_mask=mask, **_kw(model, cache))
        cache.crop(cache.get_seq_length())
        pool.debug.check()
        got = model(input_ids=ids, attention_mask=mask, **_kw(model, cache)).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_one_attention_plan_per_step_run_by_every_layer(monkeypatch):
    """Issue 22 item 2: the step's first layer plans, every layer runs."""
    made, runs = [], []

    class CountingPlan(kvcore.AttentionPlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def run(self, q, layer, out=None):
            runs.append((len(made), layer))
            return super().run(q, layer, out)

    monkeypatch.setattr(kvcore.hf.attention, "AttentionPlan", CountingPlan)
    model = model_for("llama", "kvcore")
    ids, mask = _prompts(BATCHES["b4"])
    got = _paged(model, ids, mask, max_new_tokens=4, do_sample=False)
    assert len(made) == 4                                      # one per step
    assert runs == [(s, layer) for s in range(1, 5) for layer in (0, 1)]
    assert torch.equal(got, _dynamic(model_for("llama"), ids, mask, max_new_tokens=4,
                                     do_sample=False))


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_beam_search_matches_dynamic_cache(attn):
    ids, mask = _prompts([23, 9])
    kw = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    want = _dynamic(model_for("llama"), ids, mask, **kw)
    got = _paged(model_for("llama", attn), ids, mask, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_seeded_sampling_matches_dynamic_cache(attn):
    ids, mask = _prompts(BATCHES["b4"])
    kw = dict(max_new_tokens=10, do_sample=True, top_k=20, temperature=1.3)
    base, model = model_for("qwen2"), model_for("qwen2", attn)
    torch.manual_seed(5)
    want = _dynamic(base, ids, mask, **kw)
    torch.manual_seed(5)
    got = _paged(model, ids, mask, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_prompt_lookup_matches_dynamic_cache(attn):
    # a repetitive prompt so that lookups propose candidates and crop runs
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(3, VOCAB, (6,), generator=g)
    ids = motif.repeat(5)[None, :]
    mask = torch.ones_like(ids)
    # (transformers 5.0's prompt lookup needs an eos_token_id)
    kw = dict(max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4, eos_token_id=2)
    want = _dynamic(model_for("llama"), ids, mask, **kw)
    plain = _dynamic(model_for("llama"), ids, mask, max_new_tokens=16, do_sample=False,
                     eos_token_id=2)
    assert torch.equal(want, plain)
    got = _paged(model_for("llama", attn), ids, mask, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_assisted_decoding_over_a_cached_prompt(attn, mode):
    """transformers' assisted and prompt-lookup decoding feed the whole
    prompt in their first forward, whatever the cache holds: over a prompt
    whose blocks the pool caches, the rows give up their prefix hits and the
    tokens are DynamicCache's (it used to raise: position 0, the cache
    expects 28)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (6,), generator=g).repeat(5)[None, :]
    mask = torch.ones_like(ids)
    if mode == "prompt_lookup":
        kw = dict(max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4, eos_token_id=2)
    else:
        torch.manual_seed(1)
        helper = transformers.LlamaForCausalLM(model_for("llama").config).eval()
        helper.set_attn_implementation("sdpa")
        kw = dict(max_new_tokens=8, do_sample=False, assistant_model=helper, eos_token_id=2)
    want = _dynamic(model_for("llama"), ids, mask, **kw)
    model = model_for("llama", attn)
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    for call in range(3):      # the first call caches the prompt's blocks
        got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, **kw)
        assert torch.equal(got, want), call
        assert pool.num_used_blocks == 0
        pool.debug.check()
    assert pool.num_cached_blocks >= ids.shape[1] // 4
    # a plain call still takes the prompt's hit
    with PagedCache(pool) as cache:
        cache._begin([ids[0].numpy()], [0])
        assert cache.get_seq_length() > 0


@pytest.mark.parametrize("name", ["MptForCausalLM", "BloomForCausalLM"])
def test_prompt_lookup_over_a_cached_prompt_of_a_model_without_position_ids(name):
    """MPT's and Bloom's forwards take neither position_ids nor
    cache_position: prompt lookup's first forward re-feeds the whole prompt
    over the prefix hit, which the cache now tells by the ids (it stored the
    prompt a second time after the cached columns: logits 0.04 off)."""
    model = _hf_zoo.build(name, use_cache=True)
    model.set_attn_implementation("kvcore")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, _hf_zoo.VOCAB, (1, 17), generator=g).repeat(1, 3)[:, :40]
    kw = dict(prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=12,
              return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **_kw(model, transformers.DynamicCache()), **kw)
    pool = pool_for(model.config, 128, dtype="float32", block_size=4)
    for call in range(2):        # the second call hits the first's prompt blocks
        got = kvcore.hf.generate(model, ids, pool, **kw)
        assert torch.equal(got.sequences, want.sequences), call
        for a, b in zip(got.logits, want.logits):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    assert pool.stats()["prefix_hits"] > 0 and pool.num_used_blocks == 0


def test_the_model_as_its_own_assistant():
    """generate(assistant_model=model): the hook generate puts on the model
    sees the assistant's forwards too, on the assistant's own cache, and
    leaves them alone (it raised: position 20, the cache expects 21)."""
    model = _tiny("llama", "kvcore")
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    kw = dict(do_sample=False, max_new_tokens=8)
    want = model.generate(ids, assistant_model=model, **kw)
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    assert torch.equal(kvcore.hf.generate(model, ids, pool, assistant_model=model, **kw), want)
    assert pool.num_used_blocks == 0


def _chunked(model, cache, ids, mask, chunk):
    """Logits of ``ids`` fed ``chunk`` columns a forward, each with the mask
    of every column so far."""
    out = []
    with torch.no_grad():
        for lo in range(0, ids.shape[1], chunk):
            out.append(model(ids[:, lo:lo + chunk], attention_mask=mask[:, :lo + chunk],
                             **_kw(model, cache)).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_a_chunked_prefill_whose_first_chunks_are_a_rows_padding(attn):
    """A left-padded batch fed 4 columns a forward, row 1 padded for its
    first 6 (the first chunk is all padding for it: kvcore raised 'row 1 has
    no tokens'): the real columns' logits are DynamicCache's."""
    model = _tiny("llama", attn)
    ids, mask = _prompts([12, 6])
    want = _chunked(model, transformers.DynamicCache(), ids, mask, 4)
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    with PagedCache(pool) as cache:
        got = _chunked(model, cache, ids, mask, 4)
        assert cache.get_seq_length() == 12
    real = mask.bool()
    np.testing.assert_allclose(got[real].numpy(), want[real].numpy(), rtol=1e-5, atol=1e-5)
    assert pool.num_used_blocks == 0


def test_crop_into_a_rows_padding_then_the_same_mask_again():
    """crop into row 1's padding, then feed the cropped columns again with
    the whole mask: the padding columns among them stay padding (the kvcore
    attention took them as the row's tokens: logits 0.44 off)."""
    model = _tiny("llama", "kvcore")
    ids, mask = _prompts([12, 6])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits[:, 3:]
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    with PagedCache(pool) as cache, torch.no_grad():
        model(ids, attention_mask=mask, **_kw(model, cache))
        cache.crop(3 - ids.shape[1])          # row 1 keeps 3 columns of padding
        got = model(ids[:, 3:], attention_mask=mask, **_kw(model, cache)).logits
        assert cache.pads.tolist() == [0, 6]
    real = mask[:, 3:].bool()
    np.testing.assert_allclose(got[real].numpy(), want[real].numpy(), rtol=1e-5, atol=1e-5)


def test_a_later_mask_that_pads_a_rows_tokens_is_refused_and_the_cache_kept():
    """kvcore's attention reads no mask: a later forward whose mask hides a
    column of a row that holds tokens (a hole) or shrinks a row's padding is
    refused naming attention_mask and the row, and the cache is as before
    (the mask was ignored)."""
    model = _tiny("llama", "kvcore")
    ids, mask = _prompts([8, 5])
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    with PagedCache(pool) as cache, torch.no_grad():
        model(ids, attention_mask=mask, **_kw(model, cache))
        before = _cache_state(cache)
        new = torch.tensor([[20, 21], [22, 23]])
        for bad in (torch.tensor([[1] * 9 + [0], [0] * 3 + [1] * 7]),     # a hole in row 0
                    torch.tensor([[1] * 10, [0] * 2 + [1] * 8])):         # row 1's padding shrinks
            with pytest.raises(ValueError, match=r"attention_mask .*row [01]"):
                model(new, attention_mask=bad, **_kw(model, cache))
            assert _cache_state(cache) == before and cache.pads.tolist() == [0, 3]
        ok = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
        model(new, attention_mask=ok, **_kw(model, cache))
        assert cache.get_seq_length() == 10
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_crop_into_a_rows_left_padding(attn):
    """crop to fewer columns than a row's left padding: the row holds only
    padding, and the next forward's columns are its real tokens (it kept
    the old pad count, and the forward's K/V were dropped as padding)."""
    model = model_for("llama", attn)
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    ids = torch.tensor([[PAD] * 5 + [5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16]])
    mask = (torch.arange(8)[None, :] >= torch.tensor([[5], [0]])).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    new = torch.tensor([[20, 21], [22, 23]])
    mask2 = torch.cat([mask[:, :3], torch.ones(2, 2, dtype=mask.dtype)], 1)
    pos2 = torch.tensor([[0, 1], [3, 4]])
    out = []
    for cache in (transformers.DynamicCache(), PagedCache(pool)):
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=pos, **_kw(model, cache))
            cache.crop(-5)                    # row 0 keeps 3 columns of padding
            out.append(model(new, attention_mask=mask2, position_ids=pos2,
                             **_kw(model, cache)).logits)
    cache.free()
    assert pool.num_used_blocks == 0
    np.testing.assert_allclose(out[1].numpy(), out[0].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_sliding_window_model_matches_dynamic_cache(attn):
    """Mistral with an 8-token window: the window applies per row, padding
    excluded (the kvcore kernel gets the model's sliding_window)."""
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        sliding_window=8, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    ids, mask = _prompts([30, 23])
    kw = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, attention_mask=mask,
                          **_kw(model, transformers.DynamicCache(config=config)), **kw)
    model.set_attn_implementation(attn)
    assert torch.equal(_paged(model, ids, mask, **kw), want)


def test_forward_loop_crop_and_seq_length():
    """A hand-written forward loop: get_seq_length, get_mask_sizes, crop."""
    model = model_for("llama")
    ids, _ = _prompts([20])
    pool = pool_for(model.config, 32, dtype="float32", block_size=4)
    cache = PagedCache(pool)
    dyn = transformers.DynamicCache()
    with torch.no_grad():
        a = model(ids, **_kw(model, cache)).logits
        b = model(ids, **_kw(model, dyn)).logits
        assert torch.equal(a, b)
        assert cache.get_seq_length() == 20 and cache.get_mask_sizes(3, 0) == (23, 0)
        step = torch.tensor([[7, 8, 9]])
        model(step, **_kw(model, cache))
        model(step, **_kw(model, dyn))
        assert cache.get_seq_length() == 23
        cache.crop(0)                        # transformers 5: nothing to remove
        assert cache.get_seq_length() == 23
        cache.crop(-3)
        dyn.crop(-3)
        assert cache.get_seq_length() == 20
        assert cache.rows[0].num_computed == 20
        again = torch.tensor([[11, 12]])
        assert torch.equal(model(again, **_kw(model, cache)).logits, model(again, **_kw(model, dyn)).logits)
    with pytest.raises(ValueError, match=r"^tokens_to_remove must leave 0\.\.22 columns .*got -30, "
                                         r"which would leave -8$"):
        cache.crop(-30)
    with pytest.raises(ValueError, match=r"^tokens_to_remove must leave .*got 18446744073709551616"):
        cache.crop(2**64)
    assert cache.get_seq_length() == 22
    cache.free()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_deepcopy_forks_a_prompts_cache_for_several_continuations(attn):
    """transformers' prompt-reuse pattern: a prompt's cache filled once,
    then copy.deepcopy(cache) per continuation.  Each continuation gives
    DynamicCache's tokens (deep-copied the same way); the copies share the
    prompt's blocks (copy-on-write) and the original stays as it was."""
    import copy
    import pickle

    model = model_for("llama", attn)
    ref = model_for("llama")
    ids, _ = _prompts([21])
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    cache, dyn = PagedCache(pool), transformers.DynamicCache()
    with torch.no_grad():
        model(ids, **_kw(model, cache))
        ref(ids, **_kw(ref, dyn))
    used = pool.num_used_blocks
    for suffix in ([5, 6, 7], [9, 10]):
        full = torch.cat([ids, torch.tensor([suffix])], 1)
        mine = copy.deepcopy(cache)
        assert pool.num_used_blocks == used and mine.get_seq_length() == 21
        assert [r.block_table.tolist() for r in mine.rows] == \
            [r.block_table.tolist() for r in cache.rows]
        a = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=6,
                           do_sample=False, **_kw(model, mine))
        b = ref.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=6,
                         do_sample=False, **_kw(ref, copy.deepcopy(dyn)))
        assert torch.equal(a, b)
        mine.free()
    assert pool.num_used_blocks == used and cache.get_seq_length() == 21
    step = torch.tensor([[11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(model(step, **_kw(model, cache)).logits,
                                   ref(step, **_kw(ref, dyn)).logits, rtol=0, atol=1e-5)
    both = copy.deepcopy({"cache": cache, "rows": cache.rows})    # (one memo: rows forked once)
    assert both["rows"] == both["cache"].rows and pool.num_used_blocks == used
    both["cache"].free()
    with pytest.raises(TypeError, match=r"copy\.deepcopy\(cache\)"):
        copy.copy(cache)
    with pytest.raises(TypeError, match=r"cannot be pickled"):
        pickle.dumps(cache)
    cache.free()
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_a_deepcopy_inside_a_generate_forward_keeps_the_prefix_cache_true():
    """A copy made inside one of kvcore.hf.generate's forwards (a hook on
    the inner model, after generate's hook recorded the forward's token ids)
    and run at once on other tokens: the copy keeps only the ids of computed
    positions, so its KV never enters the prefix cache under the forward's
    ids; a later generate of the same prompt gives model.generate's tokens.
    (Review, 2026-12-07: the copy's rows kept the recorded ids, and its KV of
    other tokens was then reused for the prompt.)"""
    import copy

    model = model_for("llama")
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    gen = torch.Generator().manual_seed(1)
    p = torch.randint(3, VOCAB, (1, 9), generator=gen)
    other = torch.randint(3, VOCAB, (1, 9), generator=gen)
    key = kvcore.hf.cache_keyword(model)
    done = []

    def copy_and_run(module, args, kwargs):
        cache = kwargs.get(key)
        if isinstance(cache, PagedCache) and not done:
            done.append(1)
            mine = copy.deepcopy(cache)
            model(other, attention_mask=torch.ones_like(other), **_kw(model, mine))
            mine.free()

    hook = model.model.register_forward_pre_hook(copy_and_run, with_kwargs=True)
    try:
        with torch.no_grad():
            kvcore.hf.generate(model, p, pool, max_new_tokens=4, do_sample=False)
    finally:
        hook.remove()
    assert done
    with torch.no_grad():
        want = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=8,
                              do_sample=False)
        got = kvcore.hf.generate(model, p, pool, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert pool.num_used_blocks == 0
    pool.debug.check()


def _cache_state(cache):
    pool = cache.pool
    return (cache.get_seq_length(), pool.num_free_blocks, pool.num_cached_blocks,
            [(s.num_computed, s.num_tokens, s.token_ids.tolist(),
              [s.num_written(i) for i in range(pool.num_layers)]) for s in cache.rows])


def _failing(monkeypatch, module):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(module, "forward", boom)


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_a_forward_that_failed_part_way_is_dropped_by_crop(attn, monkeypatch):
    """An exception in the model after layer 0 updated the cache (layer 1
    never does): the next forward says so without changing anything, crop
    drops what the failed one wrote, and the forward then gives the logits
    of a cache that never failed."""
    model = _tiny("llama", attn)
    ids, _ = _prompts([20])
    step = torch.tensor([[7, 8, 9]])
    pools = [pool_for(model.config, 32, dtype="float32", block_size=4) for _ in range(2)]
    cache, ref = PagedCache(pools[0]), PagedCache(pools[1])
    with torch.no_grad():
        model(ids, **_kw(model, cache))
        model(ids, **_kw(model, ref))
        before = _cache_state(cache)
        with monkeypatch.context() as m:
            _failing(m, model.model.layers[0].mlp)
            with pytest.raises(RuntimeError, match="boom"):
                model(step, **_kw(model, cache))
        failed = _cache_state(cache)
        with pytest.raises(ValueError, match="stopped after 1 of the model's 2 layers"):
            model(step, **_kw(model, cache))
        assert _cache_state(cache) == failed
        cache.crop(cache.get_seq_length())
        assert _cache_state(cache) == before
        assert torch.equal(model(step, **_kw(model, cache)).logits,
                           model(step, **_kw(model, ref)).logits)
    cache.free()
    assert pools[0].num_used_blocks == 0 and pools[0].debug.check()


@pytest.mark.parametrize("layer", [0, 1])
def test_an_attention_the_pool_refuses_leaves_the_cache_as_before(layer, monkeypatch):
    """kvcore's attention failing (as a backend that refuses the plan does:
    a CUDA pool whose head_dim its kernels do not take) at the first or the
    last layer, after the step's K/V were written: the cache is as it was
    before the forward, at once, and the forward can run again."""
    model = _tiny("llama", "kvcore")
    ids, _ = _prompts([21])
    step = torch.tensor([[7, 8, 9, 10]])
    pools = [pool_for(model.config, 32, dtype="float16", block_size=4) for _ in range(2)]
    cache, ref = PagedCache(pools[0]), PagedCache(pools[1])
    real = kvcore.hf.attention._run_plan

    def refuse(cache, step, key, table, cu, heads, rows, at, flat):
        if at == layer:
            raise ValueError("the CUDA attention kernels take head_dim in (64, ...)")
        return real(cache, step, key, table, cu, heads, rows, at, flat)

    with torch.no_grad():
        for first in (True, False):      # the first forward (it makes the rows), a later one
            before = _cache_state(cache)
            with monkeypatch.context() as m:
                m.setattr(kvcore.hf.attention, "_run_plan", refuse)
                with pytest.raises(ValueError, match="head_dim"):
                    model(ids if first else step, **_kw(model, cache))
            assert _cache_state(cache) == before
            if first:
                assert cache.rows == [] and pools[0].num_used_blocks == 0
            pools[0].debug.check()
            got = model(ids if first else step, **_kw(model, cache)).logits
            assert torch.equal(got, model(ids if first else step, **_kw(model, ref)).logits)
    cache.free()
    assert pools[0].num_used_blocks == 0 and pools[0].debug.check()


def test_an_update_failing_after_the_step_committed_is_undone(monkeypatch):
    """sdpa: the last layer's update commits the step, then reads the
    layer's K/V back from the pages; that read failing (out of memory)
    undoes the whole step."""
    model = _tiny("llama")
    ids, _ = _prompts([20])
    step = torch.tensor([[7, 8, 9]])
    pools = [pool_for(model.config, 32, dtype="float32", block_size=4) for _ in range(2)]
    cache, ref = PagedCache(pools[0]), PagedCache(pools[1])
    real = kvcore.hf.step.Step.gather_index

    def out_of_memory(step, cache):
        if step.complete:
            raise MemoryError("no memory for the pages' K/V")
        return real(step, cache)

    with torch.no_grad():
        model(ids, **_kw(model, cache))
        model(ids, **_kw(model, ref))
        before = _cache_state(cache)
        with monkeypatch.context() as m:
            m.setattr(kvcore.hf.step.Step, "gather_index", out_of_memory)
            with pytest.raises(MemoryError):
                model(step, **_kw(model, cache))
        assert _cache_state(cache) == before
        assert torch.equal(model(step, **_kw(model, cache)).logits,
                           model(step, **_kw(model, ref)).logits)
    cache.free()
    assert pools[0].num_used_blocks == 0 and pools[0].debug.check()


def test_kvcore_attention_refusing_training_dropout_undoes_the_step():
    model = _tiny("llama", "kvcore")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids, _ = _prompts([20])
    pool = pool_for(model.config, 32, dtype="float32", block_size=4)
    cache = PagedCache(pool)
    with torch.no_grad():
        model(ids, **_kw(model, cache))
        before = _cache_state(cache)
        model.train()
        try:
            with pytest.raises(NotImplementedError, match="no attention dropout"):
                model(torch.tensor([[7, 8]]), **_kw(model, cache))
        finally:
            model.eval()
        assert _cache_state(cache) == before
        model(torch.tensor([[7, 8]]), **_kw(model, cache))
    assert cache.get_seq_length() == 22
    cache.free()


def test_updates_out_of_order_are_refused_and_the_step_undone():
    pool = kvcore.BlockPool(16, 4, 3, 2, 8, dtype="float32")
    cache = PagedCache(pool)
    kv = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="from layer 0 on, in order; its first update was "
                                         "for layer 1"):
        cache.update(kv, kv, 1)
    assert cache.rows == [] and pool.num_used_blocks == 0
    for layer in range(3):
        cache.update(kv, kv, layer)
    assert cache.get_seq_length() == 5
    before = _cache_state(cache)
    cache.update(kv[:, :, :2], kv[:, :, :2], 0)
    with pytest.raises(ValueError, match="layer 2 came after layer 0"):
        cache.update(kv[:, :, :2], kv[:, :, :2], 2)
    assert _cache_state(cache) == before       # the step begun at layer 0 is undone
    cache.update(kv[:, :, :2], kv[:, :, :2], 0)
    with pytest.raises(ValueError, match="dimension 4, the pool 2 of dimension 8"):
        cache.update(kv[:, :, :2, :4], kv[:, :, :2, :4], 1)
    assert _cache_state(cache) == before
    for layer in range(3):
        cache.update(kv[:, :, :2], kv[:, :, :2], layer)
    assert cache.get_seq_length() == 7
    cache.free()
    assert pool.num_used_blocks == 0 and pool.debug.check()


def test_a_step_short_of_blocks_reserves_nothing():
    """Three rows grow by a block each; the pool has two: the rows that got
    theirs give them back, and the next, smaller step fits."""
    model = model_for("llama")
    pool = pool_for(model.config, 8, dtype="float32", block_size=4)
    cache = PagedCache(pool)
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, **_kw(model, cache))              # 3 rows x 2 blocks: 2 blocks free
        before = _cache_state(cache)
        with pytest.raises(kvcore.OutOfBlocksError):
            model(torch.full((3, 2), 5), **_kw(model, cache))   # 3 rows need a block each
        assert _cache_state(cache) == before and pool.num_free_blocks == 2
        pool.debug.check()
        model(torch.full((3, 1), 5), **_kw(model, cache))      # fits in each row's block
    assert cache.get_seq_length() == 8
    cache.free()
    assert pool.num_used_blocks == 0


def test_a_step_short_of_copy_on_write_blocks_copies_nothing():
    """Three rows share a partial block; the pool has one free block, so
    only the first row could copy it: the step fails before any row copies
    (a truncate would keep a copy), and the pool and rows are as before."""
    pool = kvcore.BlockPool(6, 4, 1, 2, 8, dtype="float32")
    cache = PagedCache(pool)
    kv = torch.randn(1, 2, 7, 8)
    cache.update(kv, kv, 0)                   # one row of 7 columns: 2 blocks
    cache.batch_repeat_interleave(3)          # three rows share them
    other = kvcore.PagedKVCache(pool)
    other.allocate(np.arange(9, dtype=np.int32))   # 3 blocks: 1 left free
    before = pool.debug.snapshot()
    tables = [s.block_table.tolist() for s in cache.rows]
    q = torch.randn(3, 2, 1, 8)
    with pytest.raises(kvcore.OutOfBlocksError, match="needs 2 more blocks for its 3 rows "
                                                      r"\(2 copy-on-write\), 1 of 6"):
        cache.update(q, q, 0)
    assert pool.debug.snapshot() == before
    assert [s.block_table.tolist() for s in cache.rows] == tables
    other.free()                              # room now: the same step runs
    keys, _ = cache.update(q, q, 0)
    assert torch.equal(keys[:, :, 7], q[:, :, 0]) and torch.equal(keys[:, :, :7],
                                                                  kv.expand(3, -1, -1, -1))
    cache.free()
    assert pool.num_used_blocks == 0
    pool.debug.check()


@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_a_dropped_cache_gives_its_blocks_back(attn):
    import gc

    model = model_for("llama", attn)
    pool = pool_for(model.config, 32, dtype="float32")
    ids, mask = _prompts([40, 30])
    cache = PagedCache(pool)
    model.generate(ids, attention_mask=mask, **_kw(model, cache), max_new_tokens=3)
    assert pool.num_used_blocks > 0
    del cache
    gc.collect()
    assert pool.num_used_blocks == 0


# ------------------------------------------------------------------ low precision
@pytest.mark.parametrize("dtype,bound", [("float16", 1e-3), ("bfloat16", 8e-3)])
@pytest.mark.parametrize("attn", ["sdpa", "kvcore"])
def test_low_precision_storage_logit_error_bounded(dtype, bound, attn):
    """Teacher-forced: the same tokens through DynamicCache (float32) and a
    float16/bfloat16 pool; the logits differ by at most ``bound`` relative to
    their range, and greedy generation mostly agrees (reported)."""
    model = model_for("llama", attn)
    ref_model = model_for("llama")
    ids, mask = _prompts(BATCHES["b4"])
    seq = _dynamic(ref_model, ids, mask, max_new_tokens=16, do_sample=False)
    pool = pool_for(model.config, 256, dtype=dtype)
    cache, dyn = PagedCache(pool), transformers.DynamicCache()
    worst = 0.0
    with torch.no_grad():
        width = ids.shape[1]
        full_mask = torch.cat([mask, torch.ones((4, 16), dtype=mask.dtype)], dim=1)
        pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
        for lo, hi in [(0, width)] + [(c, c + 1) for c in range(width, width + 15)]:
            kw = dict(attention_mask=full_mask[:, :hi], position_ids=pos[:, lo:hi])
            a = model(seq[:, lo:hi], **_kw(model, cache), **kw).logits
            b = ref_model(seq[:, lo:hi], **_kw(model, dyn), **kw).logits
            real = mask[:, lo:hi].bool() if hi <= width else torch.ones(4, hi - lo, dtype=bool)
            err = (a - b).abs()[real].max() / (b[real].max() - b[real].min())
            worst = max(worst, float(err))
    cache.free()
    got = _paged(model, ids, mask, dtype=dtype, max_new_tokens=16, do_sample=False)
    agree = float((got[:, -16:] == seq[:, -16:]).float().mean())
    print(f"{dtype} storage ({attn}): max relative logit error {worst:.2e}, "
          f"greedy token agreement {agree:.0%}")
    assert 0 < worst < bound
    assert agree >= 0.5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_16bit_model_with_16bit_pages_matches_dynamic_cache(dtype, batch):
    """Issue 22 item 2: a bfloat16 / float16 model with pages of its dtype
    and the kvcore attention (queries and outputs in the model's dtype)
    gives DynamicCache's tokens with the same model; the KV written is the
    model's own, so only the attention's float32 sums differ from sdpa's."""
    model = _tiny("llama", "kvcore").to(getattr(torch, dtype))
    ids, mask = _prompts(BATCHES[batch])
    model.set_attn_implementation("sdpa")
    want = _dynamic(model, ids, mask, max_new_tokens=12, do_sample=False)
    model.set_attn_implementation("kvcore")
    pool = pool_for(model.config, 256, dtype=dtype, block_size=16)
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                             do_sample=False)
    agree = float((got[:, -12:] == want[:, -12:]).float().mean())
    print(f"{dtype} model, {dtype} pages, {batch}: greedy token agreement {agree:.0%}")
    assert torch.equal(got[:, :-11], want[:, :-11])        # the first new token of every row
    assert agree >= 0.75
    # the same call again, served from the pool's prefix cache
    again = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                               do_sample=False)
    assert torch.equal(again, got)


# ------------------------------------------------------------------ fp8 / int8 pages
def test_calibrate_kv_scales_fits_the_sample():
    model = model_for("llama")
    ids, mask = _prompts(BATCHES["b4"])
    scales = kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask)
    dyn = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, **_kw(model, dyn))
    assert len(scales) == 2
    real = mask.bool()[:, None, :, None]
    for (k, v), layer in zip(scales, dyn.layers):
        # the largest real |K| / |V| maps onto e4m3fn's largest finite value, 448
        assert k == pytest.approx(float(layer.keys.abs().masked_fill(~real, 0).max()) / 448)
        assert v == pytest.approx(float(layer.values.abs().masked_fill(~real, 0).max()) / 448)
    e5m2 = kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask, dtype="float8_e5m2")
    assert e5m2[0][0] == pytest.approx(scales[0][0] * 448 / 57344)
    pool = pool_for(model.config, 8, dtype="float8_e4m3fn", kv_scales=scales)
    assert np.allclose(np.asarray(pool.kv_scales), np.asarray(scales, np.float32))
    with pytest.raises(ValueError, match="dtype must be one of .*int8 pools scale"):
        kvcore.hf.calibrate_kv_scales(model, ids, dtype="int8")
    with pytest.raises(ValueError, match="input_ids must be a 2-D torch tensor"):
        kvcore.hf.calibrate_kv_scales(model, [[5, 6]])
    with pytest.raises(ValueError, match="left padding"):
        kvcore.hf.calibrate_kv_scales(model, ids[:1, :3], attention_mask=torch.tensor([[1, 0, 1]]))


@pytest.mark.parametrize("per_head", [False, True])
def test_calibrate_kv_scales_refuses_activations_that_are_not_finite(per_head):
    """Issue 38 item 9: NaN or inf in one layer's K or V (at a real token)
    is refused naming the layer and the plane, never turned into scale 1.0."""
    ids, mask = _prompts(BATCHES["b4"])
    model = _tiny("llama")
    with torch.no_grad():                  # layer 1's K: NaN (layer 0 stays finite)
        model.model.layers[1].self_attn.k_proj.weight[3, :] = float("nan")
    with pytest.raises(ValueError, match=r"K activations of layer 1 are not finite"):
        kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask, per_head=per_head)
    model = _tiny("llama")
    with torch.no_grad():                  # layer 0's V: inf (every later layer NaN)
        model.model.layers[0].self_attn.v_proj.weight[0, :] = float("inf")
    with pytest.raises(ValueError, match=r"V activations of layer 0 are not finite"):
        kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask, per_head=per_head)


def test_an_empty_prompt_batch_is_refused_by_name():
    """Issue 38 item 9: a batch of 0 rows is refused naming input_ids before
    the forward (calibrate_kv_scales, generate), not inside transformers."""
    model = model_for("llama")
    empty = torch.zeros((0, 5), dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids must have at least one row .* \(0, 5\)"):
        kvcore.hf.calibrate_kv_scales(model, empty)
    pool = pool_for(model.config, 8, dtype="float32", block_size=4)
    with pytest.raises(ValueError, match=r"input_ids must have at least one row"):
        kvcore.hf.generate(model, empty, pool, max_new_tokens=2)
    assert pool.num_used_blocks == 0 and pool.debug.check()


def test_calibrated_scales_that_would_underflow_float32_become_one():
    """A sample maximum so small that max / 448 is 0 in float32 (the pool's
    scale dtype) gives 1.0, as an all-zero one does, never a scale the pool
    refuses; others are the float32 quotient."""
    tiny = float(np.float32(1e-45)) * 3                # max / 448 underflows float32
    assert kvcore.hf.calibration._fp8_scale(tiny, 448.0) == 1.0
    assert kvcore.hf.calibration._fp8_scale(0.0, 448.0) == 1.0
    assert kvcore.hf.calibration._fp8_scale(float("inf"), 448.0) == 1.0
    assert kvcore.hf.calibration._fp8_scale(3.0, 448.0) == float(np.float32(3.0) / np.float32(448.0))
    model = model_for("llama")
    pool_for(model.config, 4, dtype="float8_e4m3fn",
             kv_scales=[(kvcore.hf.calibration._fp8_scale(tiny, 448.0), 1.0)] * 2)


def test_calibrate_kv_scales_per_head():
    """per_head=True: one scale per KV head (max |K| / |V| of that head over
    the real tokens / 448); the pool takes them, and the kvcore attention
    over it stays close to DynamicCache's logits."""
    model = model_for("llama")
    ids, mask = _prompts(BATCHES["b4"])
    scales = kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask, per_head=True)
    dyn = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, **_kw(model, dyn))
    real = mask.bool()[:, None, :, None]
    heads = model.config.num_key_value_heads
    for pair, layer in zip(scales, dyn.layers):
        for got, t in zip(pair, (layer.keys, layer.values)):
            want = t.abs().masked_fill(~real, 0).amax(dim=(0, 2, 3)) / 448
            assert isinstance(got, tuple) and len(got) == heads
            assert got == pytest.approx([float(w) for w in want])
    per_layer = kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask)
    assert [max(k) for k, _ in scales] == pytest.approx([k for k, _ in per_layer])
    # an all-zero head gets 1.0 (head 0's keys of layer 0 zeroed in the shared
    # tiny model, restored after)
    with torch.no_grad():
        w = model.model.layers[0].self_attn.k_proj
        saved = w.weight.detach().clone(), None if w.bias is None else w.bias.detach().clone()
        head_dim = w.weight.shape[0] // heads
        w.weight[:head_dim] = 0
        if w.bias is not None:
            w.bias[:head_dim] = 0
        try:
            z = kvcore.hf.calibrate_kv_scales(model, ids, attention_mask=mask, per_head=True)
        finally:
            w.weight.copy_(saved[0])
            if saved[1] is not None:
                w.bias.copy_(saved[1])
    assert z[0][0][0] == 1.0 and z[0][0][1] == pytest.approx(scales[0][0][1])
    with pytest.raises(TypeError, match="per_head must be a bool"):
        kvcore.hf.calibrate_kv_scales(model, ids, per_head="yes")
    pool = pool_for(model.config, 256, dtype="float8_e4m3fn", kv_scales=scales)
    assert [tuple(np.float32(x) for x in k) for k, _ in pool.kv_scales] == \
        [tuple(np.float32(x) for x in k) for k, _ in scales]
    paged = model_for("llama", "kvcore")
    with torch.no_grad():
        a = paged(ids, attention_mask=mask, **_kw(paged, PagedCache(pool))).logits
        b = model(ids, attention_mask=mask, **_kw(model, transformers.DynamicCache())).logits
    err = float((a - b).abs()[mask.bool()].max() / (b[mask.bool()].max() - b[mask.bool()].min()))
    assert 0 < err < 0.05


STEP_POOLS = {"float32": None, "float16": None, "bfloat16": None, "int8": None,
              "float8_e4m3fn": [((0.02, 0.05), (0.01, 0.03)), ((0.04, 0.02), (0.02, 0.02))],
              "float8_e5m2": [(0.5, 0.25), (0.125, 1.0)]}


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", sorted(STEP_POOLS))
def test_decode_steps_store_the_bits_pool_write_stores(dtype, model_dtype, monkeypatch):
    """A decode step's K/V (transformers' (batch, heads, 1, dim) tensors, V a
    transposed view) go through the pool's own writer, not pool.write, and
    the pages then hold exactly what pool.write stores from the same K/V at
    the same slots (every pool dtype, fp8 with per-layer and per-head scales,
    float32 and bfloat16 models; two rows)."""
    model = _tiny("llama", attn="kvcore", seed=3).to(getattr(torch, model_dtype))
    pools = [pool_for(model.config, 24, dtype=dtype, block_size=4, kv_scales=STEP_POOLS[dtype])
             for _ in range(2)]
    cache = PagedCache(pools[0])
    seen = []
    inner = cache.update

    def spy(k, v, layer, *args, **kwargs):
        seen.append((layer, k.detach().clone(), v.detach().clone()))
        return inner(k, v, layer, *args, **kwargs)

    monkeypatch.setattr(cache, "update", spy)
    ids, _ = _prompts([9, 9], seed=4)
    with torch.no_grad():
        logits = model(ids, **_kw(model, cache)).logits
        monkeypatch.setattr(pools[0], "write", lambda *a, **k: pytest.fail(
            "a decode step's K/V went through pool.write"))
        for _ in range(3):
            ids = logits[:, -1:].argmax(-1)
            logits = model(ids, **_kw(model, cache)).logits
    monkeypatch.undo()
    assert len(seen) == 4 * 2 and all(k.shape[2] == 1 for _, k, _ in seen[2:])
    start = {0: 0, 1: 0}
    for layer, k, v in seen:
        n = k.shape[2]
        slots = np.concatenate([row.slot_mapping(start[layer], start[layer] + n)
                                for row in cache.rows])
        start[layer] += n
        pools[1].write(layer, k.transpose(1, 2).reshape(-1, *k.shape[1::2]),
                       v.transpose(1, 2).reshape(-1, *v.shape[1::2]), slots)
    assert start == {0: 12, 1: 12}
    np.testing.assert_array_equal(pools[0].storage.view(np.uint8), pools[1].storage.view(np.uint8))
    if dtype == "int8":
        np.testing.assert_array_equal(pools[0].scales, pools[1].scales)
    cache.free()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_low_precision_pools_generate_through_the_kvcore_attention(dtype):
    """Issue 22 item 2: fp8 (calibrated per-layer scales) and int8 pools in
    kvcore.hf.  Teacher-forced logits stay close to DynamicCache's (bounded
    relative to their range; greedy agreement printed), prefix reuse works,
    and sdpa, which cannot read the codes, is refused before anything is
    written."""
    model = model_for("llama", "kvcore")
    ref = model_for("llama")
    ids, mask = _prompts(BATCHES["b4"])
    scales = kvcore.hf.calibrate_kv_scales(ref, ids, attention_mask=mask, dtype=dtype) \
        if dtype != "int8" else None
    pool = pool_for(model.config, 256, dtype=dtype, kv_scales=scales)
    with torch.no_grad():
        a = model(ids, attention_mask=mask, **_kw(model, PagedCache(pool))).logits
        b = ref(ids, attention_mask=mask, **_kw(ref, transformers.DynamicCache())).logits
    real = mask.bool()
    err = float((a - b).abs()[real].max() / (b[real].max() - b[real].min()))
    want = _dynamic(ref, ids, mask, max_new_tokens=12, do_sample=False)
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                             do_sample=False)
    agree = float((got[:, -12:] == want[:, -12:]).float().mean())
    print(f"{dtype} pages: max relative logit error {err:.2e}, greedy agreement {agree:.0%}")
    assert 0 < err < {"int8": 0.02, "float8_e4m3fn": 0.05, "float8_e5m2": 0.1}[dtype]
    h = pool.stats()["prefix_hits"]
    again = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=12,
                               do_sample=False)
    assert pool.stats()["prefix_hits"] > h and again.shape == got.shape
    # sdpa reads whole K/V tensors: refused, the pool untouched
    used = pool.num_used_blocks
    with pytest.raises(ValueError, match=f"a {dtype} pool is read by attn_implementation="
                                         "'kvcore' only"):
        ref.generate(ids, attention_mask=mask, **_kw(ref, PagedCache(pool)), max_new_tokens=2)
    assert pool.num_used_blocks == used
    pool.debug.check()


def test_perplexity_benchmark_emulates_fp8_scales_faithfully():
    """The perplexity benchmark's emulated e4m3fn rows (K/V rounded in a
    float32 pool): with per-layer scales they give the real e4m3fn pool's
    logits; finer scales have the shapes they claim and really round."""
    from kvcore.cli.benchmarks import hf as bench

    model = model_for("llama", "kvcore")
    g = torch.Generator().manual_seed(5)
    calib, ids = (torch.randint(3, VOCAB, (1, n), generator=g) for n in (40, 24))
    layer = bench._granular_scales(model, calib, "float8_e4m3fn", "layer")
    real = kvcore.hf.calibrate_kv_scales(model, calib, dtype="float8_e4m3fn")
    assert [float(x) for pair in layer for x in pair] == pytest.approx(
        [x for pair in real for x in pair], rel=1e-6)
    pools = [pool_for(model.config, 16, dtype="float8_e4m3fn", kv_scales=real),
             pool_for(model.config, 16, dtype="float32"), pool_for(model.config, 16)]
    with torch.no_grad():
        fp8, emulated = (model(ids, **_kw(model, cache)).logits for cache in (
            PagedCache(pools[0]),
            bench._emulate_fp8(PagedCache(pools[1]), layer, "float8_e4m3fn")))
        exact = model(ids, **_kw(model, PagedCache(pools[2]))).logits
    assert torch.allclose(emulated, fp8, rtol=0, atol=1e-4)
    assert not torch.allclose(emulated, exact, rtol=0, atol=1e-4)
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // 4
    for granularity, shape in (("head", (1, heads, 1, 1)), ("channel", (1, heads, 1, dim))):
        k, v = bench._granular_scales(model, calib, "float8_e4m3fn", granularity)[0]
        assert k.shape == v.shape == shape and bool((k > 0).all())
        assert float(k.max()) == pytest.approx(float(layer[0][0]), rel=1e-6)


def test_perplexity_benchmark_chunks_read_the_earlier_ones_from_the_cache():
    """The benchmarks' chunked teacher forcing through a float32 PagedCache
    scores what one forward of the whole sample scores."""
    from kvcore.cli.benchmarks import hf as bench

    model = model_for("llama", "kvcore")
    ids = torch.randint(3, VOCAB, (1, 50), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        nll, count = bench.chunked_nll(model, PagedCache(pool_for(model.config, 16,
                                                                  dtype="float32")), ids, 16)
        logp = torch.log_softmax(model_for("llama")(ids).logits[0, :-1].float(), dim=-1)
    assert count == 49
    assert nll == pytest.approx(-float(logp.gather(1, ids[0, 1:, None]).sum()), rel=1e-5)


# ------------------------------------------------------------------ prefix reuse
def _hits(pool):
    return pool.stats()["prefix_hits"]


def test_generate_reuses_a_shared_prefix_and_generated_tokens():
    model = model_for("llama", "kvcore")
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (256,), generator=g)
    p1 = torch.cat([shared, torch.randint(3, VOCAB, (21,), generator=g)])[None, :]
    p2 = torch.cat([shared, torch.randint(3, VOCAB, (9,), generator=g)])[None, :]
    pool = pool_for(model.config, 128, dtype="float32", block_size=16)
    kw = dict(max_new_tokens=40, do_sample=False)

    out1 = kvcore.hf.generate(model, p1, pool, **kw)
    assert torch.equal(out1, _dynamic(model_for("llama"), p1, torch.ones_like(p1), **kw))
    h = _hits(pool)
    out2 = kvcore.hf.generate(model, p2, pool, **kw)
    assert _hits(pool) - h >= 256
    assert torch.equal(out2, _dynamic(model_for("llama"), p2, torch.ones_like(p2), **kw))

    # a third request continues the first one's text: its generated tokens
    # (fed back while generating) are cached too
    p3 = torch.cat([out1, torch.tensor([[5, 6, 7]])], dim=1)
    h = _hits(pool)
    out3 = kvcore.hf.generate(model, p3, pool, max_new_tokens=5, do_sample=False)
    fed = p1.shape[1] + 40 - 1            # the last generated token is never fed
    assert _hits(pool) - h == fed // 16 * 16 > p1.shape[1]
    assert torch.equal(out3, _dynamic(model_for("llama"), p3, torch.ones_like(p3),
                                      max_new_tokens=5, do_sample=False))
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_generate_batch_with_padding_never_caches_padding():
    model = model_for("qwen2")
    ids, mask = _prompts([40, 18, 33, 35], seed=4)
    pool = pool_for(model.config, 128, dtype="float32", block_size=8)
    kw = dict(max_new_tokens=6, do_sample=False)
    first = kvcore.hf.generate(model, ids, pool, attention_mask=mask, **kw)
    assert torch.equal(first, _dynamic(model, ids, mask, **kw))
    for i in range(4):
        n = int(mask[i].sum())
        real = ids[i, -n:].tolist()
        # the real tokens are cached from position 0 (not shifted by padding)
        assert pool.probe(real + [3])["hit_tokens"] == n // 8 * 8
        # and no block holds padding
        if n < ids.shape[1]:
            assert pool.probe(ids[i].tolist())["hit_tokens"] == 0
    # the same batch again hits every row's prompt and gives the same tokens
    h = _hits(pool)
    again = kvcore.hf.generate(model, ids, pool, attention_mask=mask, **kw)
    assert torch.equal(again, first)
    # (allocate always leaves one token to compute: a 40-token prompt hits 32)
    assert _hits(pool) - h == sum((int(mask[i].sum()) - 1) // 8 * 8 for i in range(4))


def test_generate_beam_search_with_prefix_hits():
    model = model_for("llama", "kvcore")
    ids, mask = _prompts([50, 34])
    pool = pool_for(model.config, 256, dtype="float32", block_size=16)
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    want = _dynamic(model_for("llama"), ids, mask, **kw)
    assert torch.equal(kvcore.hf.generate(model, ids, pool, attention_mask=mask, **kw), want)
    h = _hits(pool)
    assert torch.equal(kvcore.hf.generate(model, ids, pool, attention_mask=mask, **kw), want)
    assert _hits(pool) - h >= 48 + 32
    assert pool.num_used_blocks == 0


def test_generate_rejects_bad_arguments():
    model = model_for("llama")
    pool = pool_for(model.config, 16, dtype="float32")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="left padding"):
        kvcore.hf.generate(model, ids, pool, attention_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="no tokens"):
        kvcore.hf.generate(model, ids, pool, attention_mask=torch.tensor([[0, 0, 0]]))
    with pytest.raises(ValueError, match="makes its own cache"):
        kvcore.hf.generate(model, ids, pool, **_kw(model, transformers.DynamicCache()))
    with pytest.raises(ValueError, match="input_ids must be a 2-D torch tensor"):
        kvcore.hf.generate(model, [[5, 6]], pool)
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("kw, exc, match", [
    (dict(input_ids=torch.tensor([[5.0, 6.0]])), TypeError,
     r"input_ids must hold integer token ids, got dtype torch.float32"),
    (dict(input_ids=torch.tensor([[5, -6]])), ValueError,
     r"input_ids must lie in 0..2147483647 \(token ids\) where attention_mask is 1, got -6 "
     r"at row 0, column 1"),
    (dict(input_ids=torch.tensor([[5, VOCAB]])), ValueError,
     rf"input_ids must lie in 0..{VOCAB - 1} \(the rows of the model's input embedding; "
     rf"padding included, the model embeds it\), got {VOCAB} at row 0, column 1"),
    (dict(input_ids=torch.tensor([[VOCAB + 5, 6]]), attention_mask=torch.tensor([[0, 1]])),
     ValueError, rf"input_ids must lie in 0..{VOCAB - 1} .*, got {VOCAB + 5} at row 0, "
     r"column 0"),
    (dict(input_ids=np.array([[5, 6]])), ValueError,
     r"input_ids must be a 2-D torch tensor .*, got ndarray"),
    (dict(attention_mask=torch.tensor([[0.5, 1.0]])), ValueError,
     r"attention_mask must hold 0 \(padding\) and 1 \(tokens\), got 0.5 at row 0, column 0"),
    (dict(attention_mask=torch.tensor([[1, 2]])), ValueError,
     r"attention_mask must hold 0 \(padding\) and 1 \(tokens\), got 2 at row 0, column 1"),
    (dict(attention_mask=[[1, 1]]), TypeError,
     r"attention_mask must be a torch tensor \(batch, length\) or None, got list"),
    (dict(attention_mask=np.ones((1, 2))), TypeError,
     r"attention_mask must be a torch tensor \(batch, length\) or None, got ndarray"),
    (dict(model=None), TypeError,
     r"model must be a transformers model \(with .config and .generate\), got NoneType"),
    (dict(num_beams=12, max_new_tokens=2), ValueError,
     r"the forward has 12 rows \(the 1 prompts times 12, for num_beams or "
     r"num_return_sequences\), more than the pool's 8 blocks"),
], ids=["float-ids", "negative-id", "id-past-the-vocabulary", "padding-past-the-vocabulary",
        "numpy-ids", "mask-half", "mask-2", "mask-list",
        "mask-numpy", "no-model", "beams-past-the-pool"])
def test_generate_names_the_argument_it_refuses(kw, exc, match):
    """A float or out-of-range input_ids (an id or a padding id past the
    model's vocabulary: torch's IndexError names no argument, and on a GPU
    it is a device-side assertion), an attention_mask that is not a
    tensor of 0s and 1s (transformers counts its values into the positions),
    a model that is none, or more beams than the pool has blocks, are
    refused by the name the caller used (were token_ids, a position_ids
    mismatch, AttributeError, repeats); nothing stays in the pool."""
    model = model_for("llama")
    pool = pool_for(model.config, 8, dtype="float32")
    args = dict(model=model, input_ids=torch.tensor([[5, 6]]), pool=pool, max_new_tokens=2)
    args.update(kw)
    with pytest.raises(exc, match=match):
        kvcore.hf.generate(**args)
    assert pool.num_used_blocks == 0


def test_a_model_whose_embedding_cannot_be_read_still_generates():
    """The vocabulary check reads model.get_input_embeddings(); a model whose
    method raises (or has another kind of input layer) is not checked, and
    generates as before."""
    model = model_for("llama")
    ids = torch.tensor([[5, 6, 7]])
    pool = pool_for(model.config, 16, dtype="float32")
    want = kvcore.hf.generate(model, ids, pool, max_new_tokens=3, do_sample=False)

    def broken():
        raise RuntimeError("no embedding here")

    model.get_input_embeddings = broken
    got = kvcore.hf.generate(model, ids, pool, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert pool.num_used_blocks == 0


def test_a_forward_of_another_batch_size_is_refused():
    """Issue 19 item 15: a forward whose batch is a multiple of the cache's
    rows was silently repeat-interleaved into them."""
    model = model_for("llama")
    pool = pool_for(model.config, 32, dtype="float32", block_size=4)
    ids, _ = _prompts([10, 10])
    cache = PagedCache(pool)
    with torch.no_grad():
        model(ids, **_kw(model, cache))
        used = pool.num_used_blocks
        for batch in (4, 1, 3):
            step = torch.full((batch, 1), 7)
            with pytest.raises(ValueError,
                               match=f"batch size {batch}, but this cache holds 2 rows"):
                model(step, **_kw(model, cache))
            assert len(cache.rows) == 2 and cache.get_seq_length() == 10
            assert pool.num_used_blocks == used
        # the cache still works for its own batch
        dyn = transformers.DynamicCache()
        model(ids, **_kw(model, dyn))
        step = torch.tensor([[7], [8]])
        assert torch.equal(model(step, **_kw(model, cache)).logits,
                           model(step, **_kw(model, dyn)).logits)
    cache.free()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("how", ["keyword", "generation_config"])
def test_generate_refuses_use_cache_false_and_caches_nothing(how):
    """Issue 19 item 16: with use_cache=False transformers re-feeds the whole
    sequence each step, and the pool cached it as new positions; a later
    request hit those blocks and generated other tokens."""
    model = model_for("llama")
    ids = _prompts([37])[0]
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    if how == "keyword":
        kw = dict(use_cache=False)
    else:
        kw = dict(generation_config=transformers.GenerationConfig(
            use_cache=False, max_new_tokens=6, do_sample=False, pad_token_id=PAD))
    with pytest.raises(ValueError, match="use_cache=True.*use_cache=False"):
        kvcore.hf.generate(model, ids, pool, max_new_tokens=6, do_sample=False, **kw)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 0
    # a correct request afterwards is DynamicCache's
    out = kvcore.hf.generate(model, ids, pool, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, _dynamic(model, ids, torch.ones_like(ids), max_new_tokens=6,
                                     do_sample=False))


@pytest.mark.parametrize("value", [0, None, "np.False_", "torch.False"])
def test_generate_names_every_false_use_cache(value):
    """use_cache values that turn the cache off as False does get the same
    named refusal (they used to be caught only by the position guard)."""
    value = {"np.False_": np.False_, "torch.False": torch.tensor(False)}.get(value, value)
    model = model_for("llama")
    ids = _prompts([9])[0]
    pool = pool_for(model.config, 16, dtype="float32", block_size=4)
    with pytest.raises(ValueError, match="needs use_cache=True"):
        kvcore.hf.generate(model, ids, pool, max_new_tokens=2, do_sample=False,
                           use_cache=value)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 0


def test_generate_refuses_positions_that_do_not_continue_the_cache():
    """Issue 19 item 16, the second guard: a forward whose position_ids do
    not follow the cache's columns (here shifted by another pre-hook of the
    model) is refused before its K/V or token ids are recorded."""
    model = _tiny("llama")
    calls = []

    def shift(module, args, kwargs):
        calls.append(1)
        if len(calls) == 2 and kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"] + 3
        return args, kwargs

    hook = model.register_forward_pre_hook(shift, with_kwargs=True)
    pool = pool_for(model.config, 64, dtype="float32", block_size=4)
    ids = _prompts([21])[0]
    try:
        with pytest.raises(ValueError, match="position_ids do not continue the cache: row 0 "
                                             "column 0 has position 24, the cache expects 21"):
            kvcore.hf.generate(model, ids, pool, max_new_tokens=4, do_sample=False)
    finally:
        hook.remove()
    assert pool.num_used_blocks == 0
    # only the prompt's blocks were cached (the shifted step recorded nothing)
    assert pool.num_cached_blocks == 21 // 4
    out = kvcore.hf.generate(model, ids, pool, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, _dynamic(model, ids, torch.ones_like(ids), max_new_tokens=4,
                                     do_sample=False))


def test_out_of_blocks_leaves_the_pool_whole():
    model = model_for("llama")
    pool = pool_for(model.config, 2, dtype="float32", block_size=4)
    ids, _ = _prompts([20])
    with pytest.raises(kvcore.OutOfBlocksError):
        kvcore.hf.generate(model, ids, pool, max_new_tokens=2)
    assert pool.num_used_blocks == 0
    pool.debug.check()


# ------------------------------------------------------------------ example
def test_example_runs_and_reports_prefix_hits():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_generate.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "prefix_hits" in run.stdout
    hits = [int(line.split()[-1]) for line in run.stdout.splitlines()
            if line.startswith("request 2") and "prefix_hits" in line]
    assert hits and hits[0] > 0, run.stdout


def test_benchmark_floor_cache_stores_nothing_and_keeps_positions():
    """The benchmark's floor (attention and cache taken out) runs the
    model's other work only: as many steps as a real cache, positions that
    advance, and no K/V kept."""
    from kvcore.cli.benchmarks import hf as bench

    torch.manual_seed(0)
    cache = bench._floor_cache()            # (also registers the floor's attention)
    model = _tiny("llama", attn=bench.FLOOR)
    ids = torch.randint(3, VOCAB, (2, 9))
    seen = []          # the positions the rotary embedding is asked for, per step
    hook = model.model.rotary_emb.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(
            (args[1] if len(args) > 1 else kwargs["position_ids"])[0].tolist()),
        with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(ids, **{kvcore.hf.cache_keyword(model): cache}, max_new_tokens=4,
                                 do_sample=False)
    finally:
        hook.remove()
        model.set_attn_implementation("sdpa")
    assert out.shape == (2, 13)
    assert cache.get_seq_length() == 12
    assert seen == [list(range(9)), [9], [10], [11]]
    assert all(getattr(layer, "keys", None) is None for layer in cache.layers)


def test_benchmark_runs_and_reports_goals():
    """bench/bench_hf.py's code on tiny sizes (speed is never asserted)."""
    from kvcore.cli import BENCHMARKS, ON_REQUEST
    from kvcore.cli.benchmarks import hf as bench

    assert "hf" in dict(BENCHMARKS) and "hf" in ON_REQUEST
    r = bench.run(prompt=48, new=4, repeat=1)
    for b in ("batch1", "batch4"):
        assert r[b]["ratio_tok_s"] > 0
        # float16 pages hold half of DynamicCache's float32 bytes, rounded up to blocks
        assert 0.5 <= r[b]["kv_bytes_fraction"] < 0.75
        assert r[b]["floor_tok_s"] > 0 and r[b]["ceiling_tok_s"] > 0
    assert r["ttft"]["hit_tokens"] == 48
    text = bench.report(r)
    assert "goals:" in text and "time to first token" in text
    assert "tiny (float32 model), float16 pages" in text
    assert "floor: no attention, no cache" in text and "x ceiling" in text
    r = bench.run(prompt=32, new=3, repeat=1, batches=(2,))
    assert r["batches"] == [2] and "batch1" not in r and r["update_per_step"]["batch"] == 2
    assert "batch2" in bench.report(r) and "batch4" not in bench.report(r)
    with pytest.raises(ValueError, match="batches must be positive integers, got \\(0,\\)"):
        bench.run(prompt=48, new=4, repeat=1, batches=(0,))
    with pytest.raises(FileNotFoundError, match="--model must be smollm2 or the path of a "
                                                 "\\.gguf file, got 'nope.gguf'"):
        bench.run(prompt=48, new=4, repeat=1, model="nope.gguf")
    with pytest.raises(ValueError, match="model_dtype must be one of"):
        bench.run(prompt=48, new=4, repeat=1, model_dtype="float16")


# ------------------------------------------------------------ prefill_attention
def _sdpa_calls(monkeypatch):
    """Shapes of the queries torch's sdpa gets (kvcore's first-forward route
    calls it by its module attribute, as transformers' sdpa attention does)."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def _equal_prompts(batch, length, seed=5):
    ids = torch.from_numpy(np.random.default_rng(seed).integers(3, VOCAB, (batch, length)))
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_attention_sdpa_computes_a_first_forward_with_torch(monkeypatch, batch):
    """``prefill_attention="sdpa"``: the first forward of prompts with no
    padding and no cached position runs torch's sdpa at every layer (the
    K/V still go to the pages), the decode steps kvcore's kernels over
    them: the tokens are DynamicCache's."""
    model = model_for("llama", "kvcore")
    ids, mask = _equal_prompts(batch, 37)
    want = _dynamic(model_for("llama"), ids, mask, max_new_tokens=8, do_sample=False)
    calls = _sdpa_calls(monkeypatch)
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    with PagedCache(pool, prefill_attention="sdpa") as cache:
        got = model.generate(ids, attention_mask=mask, **_kw(model, cache), max_new_tokens=8,
                             do_sample=False)
        assert cache.get_seq_length() == 37 + 7
    assert calls == [(batch, 4, 37, 16)] * 2              # the first forward's 2 layers only
    assert torch.equal(got, want)
    assert pool.num_used_blocks == 0


def test_prefill_attention_kvcore_never_calls_torch(monkeypatch):
    model = model_for("llama", "kvcore")
    ids, mask = _equal_prompts(2, 37)
    calls = _sdpa_calls(monkeypatch)
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    with PagedCache(pool, prefill_attention="kvcore") as cache:
        got = model.generate(ids, attention_mask=mask, **_kw(model, cache), max_new_tokens=4,
                             do_sample=False)
    assert calls == []
    assert torch.equal(got, _dynamic(model_for("llama"), ids, mask, max_new_tokens=4,
                                     do_sample=False))


def test_prefill_attention_sdpa_leaves_padded_and_cached_forwards_to_kvcore(monkeypatch):
    """Padding columns, or positions already in the pages (a prefix hit),
    need kvcore's attention: such a first forward never goes to torch."""
    model = model_for("llama", "kvcore")
    padded, padded_mask = _prompts([37, 20])                 # left-padded
    want_padded = _dynamic(model_for("llama"), padded, padded_mask, max_new_tokens=4,
                           do_sample=False)
    ids, mask = _equal_prompts(1, 37)
    want = _dynamic(model_for("llama"), ids, mask, max_new_tokens=4, do_sample=False)
    calls = _sdpa_calls(monkeypatch)
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    with PagedCache(pool, prefill_attention="sdpa") as cache:
        got = model.generate(padded, attention_mask=padded_mask, **_kw(model, cache),
                             max_new_tokens=4, do_sample=False)
    assert calls == []
    assert torch.equal(got, want_padded)
    # kvcore.hf.generate twice over one prompt: the second call finds its
    # first 32 positions in the pool and computes the rest with kvcore
    for call in range(2):
        got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=4,
                                 do_sample=False, prefill_attention="sdpa")
        assert torch.equal(got, want)
        assert calls == [(1, 4, 37, 16)] * 2          # the first call's first forward only
        assert pool.stats()["prefix_hits"] == 32 * call     # (tokens found cached)


@pytest.mark.parametrize("window, routed", [(8, False), (64, True)])
def test_prefill_attention_sdpa_only_where_the_window_hides_nothing(monkeypatch, window, routed):
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    ids, mask = _equal_prompts(2, 30)
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, attention_mask=mask,
                          **_kw(model, transformers.DynamicCache(config=config)), **kw)
    model.set_attn_implementation("kvcore")
    calls = _sdpa_calls(monkeypatch)
    pool = pool_for(config, 64, dtype="float32", block_size=16)
    with PagedCache(pool, prefill_attention="sdpa") as cache:
        got = model.generate(ids, attention_mask=mask, **_kw(model, cache), **kw)
    assert calls == ([(2, 4, 30, 16)] * 2 if routed else [])
    assert torch.equal(got, want)


@pytest.mark.parametrize("value", ["torch", "", None, 1, "SDPA"])
def test_prefill_attention_is_checked_by_name(value):
    model = model_for("llama", "kvcore")
    pool = pool_for(model.config, 64, dtype="float32", block_size=16)
    with pytest.raises(ValueError, match=r"prefill_attention must be one of \['auto', 'kvcore', "
                                         r"'sdpa'\], got"):
        PagedCache(pool, prefill_attention=value)
    ids, mask = _equal_prompts(1, 20)
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=2,
                           prefill_attention=value)
    assert pool.num_used_blocks == 0 and pool.stats()["prefix_queries"] == 0


def test_prefill_attention_auto_picks_torch_for_bfloat16_at_the_amx_level_only():
    """On a CPU pool "auto" hands a first forward to torch for bfloat16
    queries where kvcore's attention runs its amx level (torch's AMX
    kernels were faster there: docs/hf.md), never for float32 / float16."""
    pool = pool_for(model_for("llama").config, 8, dtype="bfloat16", block_size=16)
    cache = PagedCache(pool)
    assert cache.prefill_attention == "auto"
    amx = kvcore.simd_levels()["attention"] == "amx"
    assert cache._prefill_sdpa(torch.bfloat16) is amx
    assert cache._prefill_sdpa(torch.float16) is False
    assert cache._prefill_sdpa(torch.float32) is False
    if amx:
        previous = kvcore.set_simd_level("avx512")
        try:
            assert cache._prefill_sdpa(torch.bfloat16) is False
        finally:
            kvcore.set_simd_level(previous)
    assert PagedCache(pool, prefill_attention="sdpa")._prefill_sdpa(torch.bfloat16) is True
    assert PagedCache(pool, prefill_attention="kvcore")._prefill_sdpa(torch.bfloat16) is False


def test_prefill_routes_benchmark_runs_on_tiny_sizes(capsys):
    """bench/prefill_routes.py's attention rows (what docs/hf.md quotes for
    prefill_attention="auto") on tiny sizes; speed is never asserted."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefill_routes",
                                                  ROOT / "bench" / "prefill_routes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    previous = kvcore.set_num_threads(None)
    try:
        bench.main(["--tokens", "40", "--shapes", "4/2/64", "--dtypes", "bfloat16,float32",
                    "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
        kvcore.set_num_threads(previous)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("kvcore attention level ")
    assert len(lines) == 3
    for line, dtype in zip(lines[1:], ("bfloat16", "float32")):
        assert line.startswith(f"4/2 d64 {dtype}") and "torch sdpa" in line
        diff = float(line.rsplit("max |diff| ", 1)[1].rstrip(")"))
        assert diff < (0.05 if dtype == "bfloat16" else 1e-2)
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "4/2"])


@pytest.mark.parametrize("dtype", ["float16", "int8", "float8_e4m3fn"])
def test_prefill_attention_never_skips_the_pages_rounding(monkeypatch, dtype):
    """Pages that round the model's K/V (float16 pages of a float32 model,
    int8, fp8) keep kvcore's attention in a first forward too, even with
    "sdpa": a prompt then attends to the same K/V cold and warm."""
    model = model_for("llama", "kvcore")
    ids, mask = _equal_prompts(1, 37)
    calls = _sdpa_calls(monkeypatch)
    pool = pool_for(model.config, 64, dtype=dtype, block_size=16)
    cache = PagedCache(pool, prefill_attention="sdpa")
    assert cache._prefill_sdpa(torch.float32) is False
    assert cache._prefill_sdpa(torch.bfloat16) is False
    with cache:
        model.generate(ids, attention_mask=mask, **_kw(model, cache), max_new_tokens=2,
                       do_sample=False)
    assert calls == []
