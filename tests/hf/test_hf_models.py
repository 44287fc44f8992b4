"""The model matrix (issue 39): every causal LM of the installed transformers,
built tiny from its config class (tests/_hf_zoo.py: seeded random weights,
float32, windows and chunks of 16 under prompts of 41 and 56 tokens, sinks
of a trained model's size), through ``kvcore.hf.generate`` with float32
pages and ``attn_implementation="kvcore"``.

Each architecture ends in one outcome, and docs/hf.md's support table says
which (``python tests/hf/test_hf_models.py --table`` prints it, ``--table
--write`` writes it there):

* ``kvcore``: the kvcore attention computes it; greedy tokens identical to
  eager attention over transformers' own cache, and again in a second call
  on the same pool that hits the prefix cache;
* ``cache only``: the kvcore attention is never reached (the model's
  attention is its own, or its mask and cache calls do not go through the
  PagedCache's); the PagedCache hands the model the whole K/V and the tokens
  are identical (both calls);
* ``sdpa fallback``: the kvcore attention refuses a feature by name before
  the forward leaves anything in the pool; sdpa (or eager) attention over the
  PagedCache gives the identical tokens (both calls);
* ``refused``: ``pool_for`` refuses the model (type and feature named);
* ``not built``: the architecture cannot be built tiny from its config alone.

Never a token that differs: any other result fails.
"""
import os
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("KVCORE_REQUIRE_HF", "") not in ("", "0"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

if __name__ == "__main__":   # run as a script: the shared helpers are in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _hf_zoo as zoo  # noqa: E402 (after the import skips: it needs torch and transformers)
import kvcore.hf  # noqa: E402
from kvcore.hf import features as hf_features  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "hf.md"
NEW_TOKENS = 12
BEGIN = "<!-- model table: python tests/hf/test_hf_models.py --table -->"
END = "<!-- end of model table -->"

OUTCOMES = ("kvcore", "cache only", "sdpa fallback", "refused", "not built")


class Result:
    def __init__(self, outcome, detail="", features=""):
        self.outcome, self.detail, self.features = outcome, detail, features

    def cell(self):
        return self.outcome + (f": {self.detail}" if self.detail else "")


def _features(config, model):
    """The attention features of a tiny model, as the table names them."""
    spec = hf_features.AttentionSpec(config)
    out = []
    windows = sorted({w for w in spec.windows if w})
    if windows:
        every = all(spec.windows)
        out.append("sliding window" + ("" if every else " (some layers)"))
    if any(spec.chunks):
        out.append("chunked" + ("" if all(spec.chunks) else " (some layers)"))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None):
        out.append("soft cap")
    if spec.alibi is not None or getattr(text, "alibi", False) or \
            getattr(text, "model_type", "") == "bloom" or \
            getattr(getattr(text, "attn_config", None), "alibi", False):
        out.append("ALiBi")
    if model is not None and any(n.endswith("sinks") for n, _ in model.named_parameters()):
        out.append("sinks")
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv < heads:
        out.append("MQA" if kv == 1 else "GQA")
    return ", ".join(out)


def _generate(model, attn, ids, mask, pool):
    model.set_attn_implementation(attn)
    return kvcore.hf.generate(model, ids, pool, attention_mask=mask,
                              max_new_tokens=NEW_TOKENS, do_sample=False)


class _Count:
    """Counts the kvcore attention's plan runs (its one entry to the kernels)."""

    def __init__(self, monkeypatch):
        self.runs = 0
        real = kvcore.hf.attention._run_plan

        def counted(*args):
            self.runs += 1
            return real(*args)
        monkeypatch.setattr(kvcore.hf.attention, "_run_plan", counted)


def _two_passes(model, attn, ids, mask, want, what):
    """Generate twice on one float32 pool; both must give ``want``; the
    second must hit the prefix cache."""
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    first = _generate(model, attn, ids, mask, pool)
    assert torch.equal(first, want), f"{what}: tokens differ from eager\n{first}\n{want}"
    hits = pool.stats()["prefix_hits"]
    second = _generate(model, attn, ids, mask, pool)
    assert torch.equal(second, want), f"{what}: second pass (prefix hits) differs"
    assert pool.stats()["prefix_hits"] > hits, f"{what}: the second pass hit nothing"
    assert pool.num_used_blocks == 0
    pool.debug.check()


def run_case(name, monkeypatch):
    """Run one architecture through the matrix; return its Result (or fail)."""
    # refusals that do not depend on the ...ForCausalLM class (which may turn
    # an encoder-decoder config into a decoder's) first: no build needed
    config = zoo.config_or_default(name)
    if config is not None:
        try:
            kvcore.hf.pool_for(config, 8, dtype="float32", block_size=16)
        except ValueError as e:
            if "encoder-decoder" not in str(e):
                assert "cannot hold" in str(e), str(e)
                _check_named(str(e), config)
                return Result("refused", _reason(str(e)))
    model = config = None
    build_error = None
    if name not in zoo.NOT_BUILT:
        try:
            model = zoo.build(name)
            config = model.config   # (the ...ForCausalLM classes may adjust it)
        except Exception as e:     # refused below by its config, or the test fails
            build_error = e
    if config is None:
        config = zoo.config_or_default(name)
    if config is not None:
        try:
            kvcore.hf.pool_for(config, 8, dtype="float32", block_size=16)
        except ValueError as e:
            msg = str(e)
            assert "cannot hold" in msg, msg
            _check_named(msg, config)
            return Result("refused", _reason(msg))
    if model is None:
        if build_error is not None:
            raise build_error
        return Result("not built", zoo.NOT_BUILT[name])
    feats = _features(config, model)
    ids, mask = zoo.prompts()
    count = _Count(monkeypatch)
    try:
        outcome = _kvcore_or_fallback(name, model, config, ids, mask, count)
    except _Refused as e:
        if "left-padded batch" not in e.msg:
            return Result("refused", _reason(e.msg), feats)
        # (models whose decode reads the padding: unpadded batches only)
        ids, mask = zoo.prompts((56, 56))
        outcome = _kvcore_or_fallback(name, model, config, ids, mask, count)
        outcome.detail = "unpadded batches only" + (f"; {outcome.detail}" if outcome.detail
                                                    else "")
    outcome.features = feats
    return outcome


class _Refused(Exception):
    def __init__(self, msg):
        self.msg = msg


def _kvcore_or_fallback(name, model, config, ids, mask, count):
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False)
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    try:
        got = _generate(model, "kvcore", ids, mask, pool)
    except ValueError as e:
        msg = str(e)
        # refused by name, and nothing of the forward left in the pool
        _check_named(msg, config)
        assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 0, msg
        pool.debug.check()
        if "cannot hold" in msg:
            raise _Refused(msg)
        fallback = "sdpa" if model._supports_sdpa else "eager"
        _two_passes(model, fallback, ids, mask, want, f"{name} with {fallback}")
        return Result("sdpa fallback", _reason(msg))
    assert torch.equal(got, want), f"{name}: kvcore tokens differ from eager\n{got}\n{want}"
    ran = count.runs > 0
    count.runs = 0
    _two_passes(model, "kvcore", ids, mask, want, name)
    if ran:
        assert count.runs > 0, f"{name}: the second pass did not use the kvcore attention"
    return Result("kvcore" if ran else "cache only")


def _check_named(msg, config):
    model_type = hf_features.model_type_of(config)
    assert model_type in msg, f"the refusal does not name the model type {model_type!r}: {msg}"


def _reason(msg):
    """The feature a refusal names, short (the table's words)."""
    m = re.search(r"asks for (\w+)=", msg)
    if m:
        return f"{m.group(1)}="
    m = re.search(r"model: (.*?)(;|$)", msg) or re.search(r": (.*?)(, which|; use|$)", msg)
    return re.sub(r" \([^()]*\)$", "", m.group(1) if m else msg)[:90]


# ------------------------------------------------------------------ the table
def doc_table():
    """``{architecture: outcome cell}`` from docs/hf.md's model table."""
    text = DOC.read_text()
    if BEGIN not in text:
        return {}
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[2], cells[3])
    return rows


def render(results):
    lines = [BEGIN, "",
             "| Architecture | Model types | Features (tiny model) | kvcore.hf |",
             "|---|---|---|---|"]
    for name, types in zoo.architectures().items():
        r = results[name]
        lines.append(f"| `{name}` | {', '.join(types)} | {r.features or '-'} | {r.cell()} |")
    lines += ["", END]
    return "\n".join(lines)


CASES = [n for n in zoo.architectures() if not n.endswith("ForConditionalGeneration")]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread (tiny matrices; many threads only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CASES)
def test_model_matrix(name, monkeypatch):
    """Identical tokens (both passes), or a refusal by name; and the outcome
    docs/hf.md's table gives."""
    result = run_case(name, monkeypatch)
    row = doc_table().get(name)
    assert row is not None, f"docs/hf.md's model table has no row for {name}"
    assert row == (result.features or "-", result.cell()), \
        f"docs/hf.md says {row}, the matrix finds {(result.features, result.cell())}"


@pytest.mark.filterwarnings(          # (torch's inductor, on its first import)
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", ["Gemma2ForCausalLM", "GptOssForCausalLM"])
def test_compiled_soft_caps_windows_and_sinks_give_the_eager_tokens(name, monkeypatch):
    """A compiled forward through the compiled route (``kvcore::attend`` at
    every layer of every forward): Gemma 2's soft cap and sliding layers,
    gpt-oss's sinks and sliding layers give eager attention's tokens."""
    import torch._dynamo

    model = zoo.build(name)
    ids, mask = zoo.prompts()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False)
    layers = zoo.count_operators(monkeypatch)
    model.forward = torch.compile(model.forward)
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    try:
        got = _generate(model, "kvcore", ids, mask, pool)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want), f"{name}: compiled kvcore tokens differ from eager"
    n = model.config.get_text_config().num_hidden_layers
    assert layers == list(range(n)) * (len(layers) // n) and layers
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_doc_table_lists_every_architecture():
    """The table's rows are the installed transformers' causal LMs (and the
    multimodal ones are listed as not built)."""
    rows = doc_table()
    assert set(rows) == set(zoo.architectures()), \
        sorted(set(rows) ^ set(zoo.architectures()))
    for name in zoo.architectures():
        if name.endswith("ForConditionalGeneration"):
            assert rows[name][1] == f"not built: {zoo.MULTIMODAL}"


# ------------------------------------------------------------------ features
def _strip(monkeypatch, keyword):
    """The kvcore attention's plans lose ``keyword`` (what a kvcore that
    ignored the feature would compute)."""
    real = kvcore.hf.attention._run_plan

    def run(cache, step, kind, *rest):
        key, features = kind
        features = {k: v for k, v in features.items() if k != keyword}
        return real(cache, step, (key + ("without", keyword), features), *rest)
    monkeypatch.setattr(kvcore.hf.attention, "_run_plan", run)


@pytest.mark.parametrize("name, keyword", [
    ("GptOssForCausalLM", "sinks"),
    ("Llama4ForCausalLM", "chunk_size"),
    ("Qwen2MoeForCausalLM", "sliding_window"),        # a window only its mask says
    ("PhimoeForCausalLM", "sliding_window"),          # idem
    ("FalconForCausalLM (alibi=True)", "alibi_slopes"),
    ("Gemma2ForCausalLM", "logits_soft_cap"),
])
def test_a_kvcore_that_ignored_the_feature_would_fail_the_matrix(name, keyword, monkeypatch):
    """The matrix's features are switched on at sizes that matter: the same
    run with the feature left out of the kvcore plans gives other tokens
    (and with it, eager's: test_model_matrix)."""
    model = zoo.build(name)
    ids, mask = zoo.prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    _strip(monkeypatch, keyword)
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    got = _generate(model, "kvcore", ids, mask, pool)
    assert not torch.equal(got, want)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("config_class, model_type, feature", [
    ("T5Config", "t5", "an encoder-decoder model"),
    ("JambaConfig", "jamba", "state-space"),
    ("DeepseekV3Config", "deepseek_v3", "multi-head latent attention"),
    ("Gemma3nTextConfig", "gemma3n_text", "K/V shared across layers"),
])
def test_pool_for_refuses_what_a_paged_cache_cannot_hold(config_class, model_type, feature):
    """Full-size configs (nothing is allocated): the model type and the
    feature named; check_pool (generate's check) says the same."""
    config = getattr(transformers, config_class)()
    with pytest.raises(ValueError, match=f"cannot hold a '{model_type}' model: {feature}"):
        kvcore.hf.pool_for(config, 8)
    pool = kvcore.BlockPool(8, 16, 2, 2, 16, dtype="float32")
    with pytest.raises(ValueError, match=f"'{model_type}' model: {feature}"):
        kvcore.hf.config.check_pool(pool, config)


def _with_attention(monkeypatch, name, attention=None, mask=None):
    """``model`` (the tiny ``name``) running attention function ``attention``
    and mask function ``mask`` (kvcore's by default) under a name of their own."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    impl = "kvcore_test"
    transformers.AttentionInterface.register(impl, attention or kvcore.hf.kvcore_attention)
    transformers.AttentionMaskInterface.register(impl, mask or ALL_MASK_ATTENTION_FUNCTIONS["kvcore"])
    model = zoo.build(name)
    model.set_attn_implementation(impl)
    return model


def _refused(model, match, untouched=False):
    """generate raises ValueError matching ``match``; nothing of the forward
    stays in the pool (``untouched``: nothing was ever written to it)."""
    ids, mask = zoo.prompts()
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    with pytest.raises(ValueError, match=match):
        kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=4,
                           do_sample=False)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 0
    pool.debug.check()
    if untouched:
        for layer in range(pool.num_layers):
            assert not np.asarray(pool.key_cache(layer)).any()
            assert not np.asarray(pool.value_cache(layer)).any()


def test_an_attention_keyword_kvcore_does_not_compute_is_refused(monkeypatch):
    """Never ignored: a position bias (any keyword the kvcore attention does
    not know, with a value) is refused by name and the step undone."""
    def with_bias(module, query, key, value, attention_mask, **kwargs):
        return kvcore.hf.kvcore_attention(module, query, key, value, attention_mask,
                                          position_bias=torch.zeros(1, 4, 1, 1), **kwargs)
    model = _with_attention(monkeypatch, "LlamaForCausalLM", with_bias)
    _refused(model, r"llama layer 0: its attention asks for position_bias= \(a tensor")


def test_sinks_of_another_shape_are_refused(monkeypatch):
    def token_sinks(module, query, key, value, attention_mask, **kwargs):
        return kvcore.hf.kvcore_attention(module, query, key, value, attention_mask,
                                          s_aux=torch.zeros(4, 3), **kwargs)
    model = _with_attention(monkeypatch, "LlamaForCausalLM", token_sinks)
    _refused(model, r"llama layer 0: s_aux \(attention sinks\) must be one logit per query head")


def test_a_mask_of_the_models_own_is_refused(monkeypatch):
    def own_mask(module, query, key, value, attention_mask, **kwargs):
        bias = torch.zeros(query.shape[0], 1, query.shape[2], 1)
        return kvcore.hf.kvcore_attention(module, query, key, value, bias, **kwargs)
    model = _with_attention(monkeypatch, "LlamaForCausalLM", own_mask)
    _refused(model, r"llama layer 0: the model hands its attention a mask of its own")


def test_a_model_computing_with_the_new_kv_itself_is_refused(monkeypatch):
    """K/V the model transforms before the attention (DiffLlama splits V):
    the marked K/V refuse the operation, name it, and undo the step."""
    def transforms(module, query, key, value, attention_mask, **kwargs):
        return kvcore.hf.kvcore_attention(module, query, key * 1.0, value, attention_mask,
                                          **kwargs)
    model = _with_attention(monkeypatch, "LlamaForCausalLM", transforms)
    _refused(model, r"llama layer 0: the model computes with the cached K/V itself \(mul\)")


def test_a_mask_that_restricts_more_is_refused_before_anything_is_written(monkeypatch):
    from transformers.masking_utils import and_masks, causal_mask_function

    def every_other(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx % 2 == 0

    def strided(*args, **kwargs):
        kwargs["mask_function"] = and_masks(causal_mask_function, every_other)
        return kvcore.hf.attention._kvcore_mask(*args, **kwargs)
    model = _with_attention(monkeypatch, "LlamaForCausalLM", mask=strided)
    _refused(model, r"llama: its attention mask restricts keys beyond what kvcore's attention "
                    r"computes \(causal per row, with no window\)", untouched=True)


def test_a_config_window_that_no_mask_carries_is_refused(monkeypatch):
    """Qwen2-MoE's windows come from its config and its masks; a window its
    layers neither pass nor get a mask for (transformers' cache would apply
    it) is refused, not guessed."""
    from transformers.masking_utils import causal_mask_function

    def causal_only(*args, **kwargs):
        kwargs["mask_function"] = causal_mask_function
        kwargs.pop("local_size", None)
        return kvcore.hf.attention._kvcore_mask(*args, **kwargs)
    model = _with_attention(monkeypatch, "Qwen2MoeForCausalLM", mask=causal_only)
    _refused(model, r"qwen2_moe layer 0: its config gives a sliding window 16 that neither the "
                    r"layer passes nor its attention mask carries")


def test_falcon_alibi_is_computed_where_it_is_exact_and_refused_beyond():
    """transformers rounds Falcon's slope x position to bfloat16: with 4
    heads (slopes 2**-2 .. 2**-8) that is exact below position 257; with 32
    heads (slopes 2**(-k/4)) almost nowhere: refused by name before anything
    is written."""
    spec = kvcore.hf.features.AttentionSpec(zoo.tiny_config("FalconForCausalLM (alibi=True)"))
    assert spec.alibi_limit == 257
    assert spec.alibi.tolist() == [2.0 ** -(2 * h + 2) / 4 for h in range(4)]
    model = zoo.build("FalconForCausalLM (alibi=True)", num_attention_heads=32,
                      hidden_size=128)
    model.set_attn_implementation("kvcore")
    # kvcore.hf.generate refuses the call up front; a forward over a
    # PagedCache of another loop is refused at the forward
    _refused(model, r"falcon: its ALiBi bias equals kvcore's only below position \d+, and "
                    r"this call's forwards reach position 58", untouched=True)
    ids, mask = zoo.prompts()
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    with kvcore.hf.PagedCache(pool) as cache, pytest.raises(
            ValueError, match=r"falcon: its ALiBi bias .* equals kvcore's slope x distance only "
                              r"below position \d+, and this forward reaches position 55"):
        model(ids, attention_mask=mask, **{kvcore.hf.cache_keyword(model): cache})
    assert pool.num_used_blocks == 0 and not np.asarray(pool.key_cache(0)).any()


def test_falcon_alibi_past_its_limit_is_refused_before_the_first_token():
    """A prompt below the limit whose new tokens would pass it: generate
    refuses the call before any forward (it raised at the forward that
    reached position 257, its tokens so far lost); a call whose forwards
    stay below it (250 + 8 tokens: the last is never fed back, the last
    forward's position is 256) gives eager's tokens."""
    model = zoo.build("FalconForCausalLM (alibi=True)")
    model.set_attn_implementation("kvcore")
    ids, mask = zoo.prompts((250, 200))
    pool = kvcore.hf.pool_for(model.config, 64, dtype="float32", block_size=16)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"falcon: its ALiBi bias equals kvcore's only below "
                                             r"position 257, and this call's forwards reach "
                                             r"position 257 \(its longest prompt's 250 tokens"):
            kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=9,
                               do_sample=False)
        assert not calls and pool.num_used_blocks == 0
    finally:
        hook.remove()
    got = kvcore.hf.generate(model, ids, pool, attention_mask=mask, max_new_tokens=8,
                             do_sample=False)
    model.set_attn_implementation("eager")
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


if __name__ == "__main__":
    if "--table" not in sys.argv:
        sys.exit("usage: python tests/hf/test_hf_models.py --table [--write] [ARCH ...]\n"
                 "(--write: into docs/hf.md's model table)")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    mp = pytest.MonkeyPatch()
    results = {}
    t0 = time.time()
    for name in zoo.architectures():
        if name.endswith("ForConditionalGeneration"):
            results[name] = Result("not built", zoo.MULTIMODAL)
            continue
        if only and name not in only:
            continue
        t = time.time()
        try:
            results[name] = run_case(name, mp)
        except Exception as e:
            results[name] = Result("FAILED", f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            mp.undo()
        print(f"{name:40s} {time.time() - t:5.2f}s {results[name].cell()}", file=sys.stderr,
              flush=True)
    if not only:
        table = render(results)
        if "--write" in sys.argv:     # into docs/hf.md, between the markers
            text = DOC.read_text()
            head, rest = text.split(BEGIN, 1)
            DOC.write_text(head + table + rest.split(END, 1)[1])
        else:
            print(table)
    print(f"{time.time() - t0:.1f}s", file=sys.stderr)
