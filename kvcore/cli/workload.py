"""What a demo run serves: the model (the tiny random one or a GGUF file), its
requests and the pool, built from checked options.

Everything here happens before the first step, so a bad option or model file
fails as a :class:`DemoError` (a usage error for the CLI) before any loop runs.
"""
import functools
from collections import namedtuple

import numpy as np

import kvcore
from .model import ModelConfig, TinyTransformer
from .serving import Request


class DemoError(ValueError):
    """Options the demo cannot run with (a usage error for the CLI)."""


Setup = namedtuple("Setup", "model tokenizer reqs pool num_blocks max_seq_len")


def prepare(o):
    """The model, requests and pool of the checked options ``o`` (a :data:`Setup`)."""
    model, tokenizer = load_model(o)
    cfg = model.config
    rng = np.random.default_rng([o["seed"], 1])
    reqs = (random_workload(model, o, rng) if tokenizer is None
            else chat_workload(tokenizer, o, rng))
    max_seq_len = max(r.max_len for r in reqs)
    if max_seq_len > cfg.max_position:
        raise DemoError(f"prompt-len + suffix + new-tokens reach {max_seq_len} positions; the "
                        f"model takes at most {cfg.max_position}")
    bs = o["block_size"]
    need_one = max(-(-r.max_len // bs) for r in reqs)
    num_blocks = o["num_blocks"] or sum(-(-r.max_len // bs) for r in reqs)
    if num_blocks < need_one:
        raise DemoError(f"num-blocks={num_blocks} cannot hold the longest request "
                        f"({max_seq_len} tokens = {need_one} blocks of {bs})")
    pool = _make_pool(o, model, num_blocks)
    return Setup(model, tokenizer, reqs, pool, num_blocks, max_seq_len)


# ------------------------------------------------------------------- model
def load_model(o):
    """(model, tokenizer or None) of the options ``o``: the tiny random model,
    or a GGUF file (``--model``) with its tokenizer."""
    if o["model"] is None:
        return TinyTransformer(ModelConfig(), seed=o["seed"]), None
    from .llama import ModelFileError, find_model

    try:
        path = find_model(o["model"]).resolve()
        st = path.stat()
        return _load_gguf(str(path), (st.st_size, st.st_mtime_ns))
    except ModelFileError as e:
        raise DemoError(str(e)) from None


@functools.lru_cache(maxsize=1)
def _load_gguf(path, stamp=None):
    """(model, tokenizer) of a GGUF file, kept for the next run of the same
    file (the load and dequantization are most of a short run's time);
    ``stamp`` (size, mtime) makes a rewritten file load again."""
    from .llama import load_gguf

    return load_gguf(path)


# ---------------------------------------------------------------- requests
def random_workload(model, opts, rng):
    """Requests of the tiny model: a shared random system prompt, a random
    suffix and a random number of new tokens each, staggered arrivals."""
    cfg = model.config
    plen = opts["prompt_len"]
    system = rng.integers(0, cfg.vocab_size, plen)
    lo_sfx, hi_sfx = max(1, plen // 16), max(2, plen // 4)
    lo_new = max(1, opts["new_tokens"] // 2)
    reqs, arrival = [], 0
    for rid in range(opts["requests"]):
        if rid:
            arrival += int(rng.integers(1, 5))
        suffix = rng.integers(0, cfg.vocab_size, int(rng.integers(lo_sfx, hi_sfx + 1)))
        max_new = int(rng.integers(lo_new, opts["new_tokens"] + 1))
        reqs.append(Request(rid, arrival, np.concatenate([system, suffix]).astype(np.int64),
                            max_new))
    return reqs


# The real model's workload: chat requests sharing this system prompt (long
# enough to fill several blocks, so later arrivals reuse its pages).
SYSTEM_PROMPT = (
    "You are a helpful assistant for a small public library. You answer questions from "
    "visitors about books, science, history and everyday life. Keep every answer short: one "
    "or two plain sentences, no lists, no headings. If you do not know something, say so "
    "instead of guessing. Be friendly and precise, and never invent titles or dates.")
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Who wrote the novel Pride and Prejudice?",
    "How many legs does a spider have?",
    "What does a library card let me do?",
    "What is photosynthesis?",
    "Which planet is the largest in our solar system?",
    "How do I keep a book from getting damaged by water?",
)


def chat_workload(tokenizer, opts, rng):
    """Requests of the real model: the shared system prompt and one of
    :data:`QUESTIONS` each in the file's chat format, staggered arrivals,
    ``new_tokens`` at most each (an answer ends early at the end-of-turn
    token)."""
    reqs, arrival = [], 0
    for rid in range(opts["requests"]):
        if rid:
            arrival += int(rng.integers(1, 5))
        question = QUESTIONS[rid % len(QUESTIONS)]
        prompt = tokenizer.encode(tokenizer.chat_prompt(SYSTEM_PROMPT, question))
        reqs.append(Request(rid, arrival, prompt, opts["new_tokens"], eos=tokenizer.eos_id,
                            question=question))
    return reqs


# -------------------------------------------------------------------- pool
def prefix_stores(o, model):
    """The pool's prefix stores for ``--store`` (None: no store).  The
    namespace names the weights (the tiny model's seed, the model file):
    the store's fingerprint tells layouts apart, not two models of one
    layout, whose K/V for the same tokens differ."""
    if o["store"] is None:
        return None
    weights = getattr(model, "weights_id", None) or f"tiny-seed{o['seed']}"
    namespace = f"kvcore-demo:{weights}"
    kind, _, where = o["store"].partition(":")
    if kind == "disk":
        return [kvcore.DiskStore(where, 4 << 30, namespace=namespace)]
    return [kvcore.RedisStore(where, namespace=namespace)]


def _make_pool(o, model, num_blocks):
    """The one BlockPool every request shares; an unusable ``--device cuda``
    is a usage error, not a traceback."""
    if o["device"] == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise DemoError("--device cuda needs CuPy (pip install cupy-cuda12x, or "
                            "kvcore[cuda]) and an NVIDIA GPU") from None
    cfg = model.config
    try:
        return kvcore.BlockPool(num_blocks, o["block_size"], cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, dtype=o["dtype"], device=o["device"],
                                stores=prefix_stores(o, model))
    except (ImportError, RuntimeError) as e:
        if o["device"] == "cuda":
            raise DemoError(f"--device cuda is not usable here: {e}") from None
        raise
