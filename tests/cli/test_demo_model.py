"""The demo's real model: SmolLM2-135M-Instruct's GGUF read by kvcore.cli.llama
(gguf's own dequantization, the file's tokenizer through ``tokenizers``) and
run by the NumPy forward of kvcore.cli.model.LlamaDecoder.

What is checked: the NumPy forward's logits match transformers' (the same
file through ``from_pretrained(gguf_file=...)``, torch float32) within
``LOGITS_TOL`` on a chat prompt; the tokenizer gives transformers' ids; and
``run_demo(model="smollm2")`` serves chat requests through one pool, prefix
reuse included, with real text and a passing verification.

The GGUF load is the slow part: each model is loaded once for the module
(the demo's own cache keeps the NumPy one).  Skips without gguf, tokenizers,
torch/transformers or the model file, except with ``KVCORE_REQUIRE_HF=1``
(set by .ci/run, which installs them): then anything missing fails.
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.e2e   # the real model end to end: left out by default, .ci/run runs it
REQUIRE = os.environ.get("KVCORE_REQUIRE_HF", "") not in ("", "0")
if REQUIRE:
    import gguf  # noqa: F401
    import tokenizers  # noqa: F401
else:
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")

from kvcore.cli import demo, llama, workload  # noqa: E402

try:
    from _helpers import gguf_causal_lm  # noqa: E402
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import gguf_causal_lm  # noqa: E402

try:
    GGUF = llama.find_model("smollm2")
except llama.ModelFileError as e:
    if REQUIRE:
        raise RuntimeError(f"KVCORE_REQUIRE_HF=1 but {e}") from None
    pytest.skip(str(e), allow_module_level=True)

# Max abs difference of the NumPy logits from transformers' float32 ones
# (|logits| reach ~35 here; measured 8.4e-5 to 9.1e-5 on the test prompt, which
# `pytest -s -m e2e -k logits` prints: what differs is the order of float32 sums).
LOGITS_TOL = 5e-4
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def numpy_model():
    """(LlamaDecoder, GGUFTokenizer), loaded once through the demo's cache."""
    return workload.load_model(demo._options({"model": "smollm2"}))


@pytest.fixture(scope="module")
def hf_model():
    """(transformers model in float32, its tokenizer), one torch thread."""
    if REQUIRE:
        import torch
        import transformers
    else:
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = gguf_causal_lm(torch, transformers, GGUF)
        yield torch, model, tok
    finally:
        torch.set_num_threads(threads)


def test_the_file_is_what_the_loader_expects(numpy_model):
    model, tok = numpy_model
    cfg = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling == 1.0
    assert model.tied_embeddings and model.lm_head.base is not None   # a view of the embedding
    assert {"Q4_1", "Q8_0"} <= set(model.quant_types)
    assert tok.chatml and tok.vocab_size == cfg.vocab_size


def test_numpy_logits_match_transformers(numpy_model, hf_model):
    """Every position of a chat prompt: the NumPy forward (GGUF weights,
    rotate-half RoPE after undoing the converter's permutation, tied head)
    against transformers' float32 forward of the same file."""
    model, tok = numpy_model
    torch, hf, _ = hf_model
    ids = tok.encode(tok.chat_prompt(SYSTEM, QUESTION))
    ours = model.forward_full(ids)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
    assert ours.shape == theirs.shape == (len(ids), model.config.vocab_size)
    err = float(np.max(np.abs(ours - theirs)))
    print(f"\n{len(ids)}-token chat prompt: max abs logits error {err:.2e} (max |logit| "
          f"{float(np.abs(theirs).max()):.1f})")     # (docs/demo.md quotes it: pytest -s)
    assert err <= LOGITS_TOL, err
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert np.allclose(model.forward_last(ids), theirs[-1], atol=LOGITS_TOL)


def test_tokenizer_matches_transformers(numpy_model, hf_model):
    _, tok = numpy_model
    _, _, hf_tok = hf_model
    text = tok.chat_prompt(SYSTEM, "Summarize: the mitochondrion's genome, inherited "
                                   "from the mother, is small.")
    ids = tok.encode(text)
    assert ids.tolist() == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special=False) == text
    # the chat markers are single (special) tokens
    start = hf_tok.convert_tokens_to_ids("<|im_start|>")
    assert int(ids[0]) == start and tok.decode(ids) == tok.decode(ids, skip_special=False) \
        .replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_tokenizer_splits_digits_one_by_one(numpy_model):
    """tokenizer.ggml.pre = "smollm": digits are pre-split one by one."""
    _, tok = numpy_model
    ids = tok.encode("2026")
    assert len(ids) == 4 and tok.decode(ids) == "2026"


def test_demo_serves_the_real_model():
    res = demo.run_demo(model="smollm2", requests=2, new_tokens=6, threads=1)
    assert res["ok"], res["message"]
    ver = res["verification"]
    assert ver["max_abs_err"] <= demo.MODEL_F32_TOLERANCE
    assert ver["rows"] == res["generated_tokens"] > 0
    # the second request reuses the shared chat prefix's full blocks
    assert res["requests"][1]["prefix_hit"] >= 16 and res["prefix_hit_rate"] > 0
    assert res["pool_stats"]["num_used_blocks"] == 0
    assert res["contiguous_label"] == "kvcore.KVCache"
    assert ver["contiguous_max_abs_err"] <= demo.MODEL_F32_TOLERANCE
    texts = res["texts"]
    assert [t["question"] for t in texts] == list(workload.QUESTIONS[:2])
    assert "Paris" in texts[0]["answer"]
    table = res["table"]
    assert "tokens/s, kvcore.KVCache" in table and "KV bytes, kvcore.KVCache" in table
    assert "-> " in table and "PASS" in table and "Q4_1" in table.splitlines()[0]


def test_demo_model_options_keep_their_defaults():
    o = demo._options({"model": "smollm2"})
    assert (o["requests"], o["new_tokens"]) == (demo.MODEL_DEFAULTS["requests"],
                                                demo.MODEL_DEFAULTS["new_tokens"])
    assert demo._options({"model": "smollm2", "requests": 2})["requests"] == 2
