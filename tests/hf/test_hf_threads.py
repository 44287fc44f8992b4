"""kvcore.hf's attention thread count: by default one (beside torch's own
pool, whatever its size), and ``kvcore.set_num_threads`` wins over it;
checked on the plans a tiny model's forward actually makes."""
import os

import pytest

if os.environ.get("KVCORE_REQUIRE_HF", "") not in ("", "0"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

import kvcore
import kvcore.hf
from kvcore.attention import AttentionPlan


@pytest.fixture
def default_threads():
    """kvcore's and torch's thread settings as they were, afterwards; kvcore's
    back to its default (no count chosen) before the test."""
    torch_before = torch.get_num_threads()
    kvcore.set_num_threads(None)
    yield
    torch.set_num_threads(torch_before)
    kvcore.set_num_threads(None)


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(config)
    m.set_attn_implementation(kvcore.hf.ATTN_IMPLEMENTATION)
    return m.eval()


def _plan_threads(model, monkeypatch):
    """The ``num_threads`` of every plan a prefill and a decode step through
    a PagedCache run."""
    seen = []
    run = AttentionPlan.run

    def spy(plan, *args, **kwargs):
        seen.append(plan.num_threads)
        return run(plan, *args, **kwargs)

    monkeypatch.setattr(AttentionPlan, "run", spy)
    pool = kvcore.hf.pool_for(model.config, 16, dtype="float16")
    ids = torch.arange(3, 43).reshape(1, 40)
    with torch.no_grad(), kvcore.hf.PagedCache(pool) as cache:
        kw = {kvcore.hf.cache_keyword(model): cache}
        model(ids, **kw)
        model(ids[:, :1], **kw)
    monkeypatch.undo()
    assert len(seen) == 4                 # 2 layers x (prefill, decode)
    return set(seen)


def test_default_is_one_thread_whatever_torch_has(model, monkeypatch, default_threads):
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        assert kvcore.hf.attention_threads() == 1
        assert _plan_threads(model, monkeypatch) == {1}
    # kvcore's own default (plans made outside kvcore.hf) is untouched: the CPUs
    # this process may use, capped by OMP_NUM_THREADS
    cpus = len(os.sched_getaffinity(0))
    limit = os.environ.get("OMP_NUM_THREADS", "")
    want = min(cpus, int(limit)) if limit.isdigit() and int(limit) > 0 else cpus
    assert kvcore.get_num_threads() == want


def test_set_num_threads_wins_and_none_restores_the_default(model, monkeypatch,
                                                            default_threads):
    torch.set_num_threads(1)
    kvcore.set_num_threads(3)
    assert kvcore.hf.attention_threads() == 3
    assert _plan_threads(model, monkeypatch) == {3}
    torch.set_num_threads(2)
    kvcore.set_num_threads(1)
    assert kvcore.hf.attention_threads() == 1
    assert _plan_threads(model, monkeypatch) == {1}
    kvcore.set_num_threads(2)
    assert _plan_threads(model, monkeypatch) == {2}
    kvcore.set_num_threads(None)
    assert kvcore.hf.attention_threads() == 1
    assert _plan_threads(model, monkeypatch) == {1}
