"""Hugging Face transformers: ``kvcore.hf`` against ``DynamicCache`` + sdpa.

A tiny Llama with random weights (hidden 256, 4 layers, 8 heads, 2 KV
heads, head_dim 32, float32 model), one thread (torch and kvcore).  Every
number is measured in the same run; ratios compare numbers of the same run.

- ``model.generate``, prompt ``prompt`` tokens + ``new`` new tokens, batch 1
  and 4 (greedy): tokens/s of the whole call (prefill included), the
  prefill alone and the decode steps alone (from the times a streamer
  sees each step's tokens),
  for ``DynamicCache`` + sdpa (the baseline) and for a float16
  ``PagedCache`` with ``attn_implementation="kvcore"``; the KV bytes each
  holds at the end (DynamicCache's tensors against the pool blocks the
  cache holds).
- Time to first token (``max_new_tokens=1``) of a request whose first
  ``prompt`` tokens another request already computed
  (``kvcore.hf.generate``, pool warm) against the same request cold
  (empty pool) and against ``DynamicCache``.
- Cache operations per decode step: seconds spent in ``cache.update`` per
  decode step (all layers) in the batch-4 calls, DynamicCache against
  PagedCache (attention excluded).

Times are medians of ``repeat`` calls (DynamicCache and kvcore calls
interleaved, after one warm-up round).  torch and transformers are needed
(``pip install kvcore[hf]``).
"""
import statistics
import time

HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 4, 8, 2
VOCAB = 1000


def _model(attn):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                      intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=8192)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _median_time(fn, repeat):
    fn()                                   # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


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


def run(quick=False, prompt=None, new=None, repeat=None):
    """Numbers as a dict (see the module docstring)."""
    import torch
    import transformers

    import kvcore
    import kvcore.hf

    prompt = prompt or (256 if quick else 2048)
    new = new or (16 if quick else 128)
    repeat = repeat or (1 if quick else 3)
    threads = (torch.get_num_threads(), kvcore.get_num_threads())
    torch.set_num_threads(1)
    kvcore.set_num_threads(1)
    try:
        return _run(torch, transformers, kvcore, prompt, new, repeat)
    finally:
        torch.set_num_threads(threads[0])
        kvcore.set_num_threads(threads[1])


def _run(torch, transformers, kvcore, prompt, new, repeat):
    base_model, kv_model = _model("sdpa"), _model("kvcore")
    key = kvcore.hf.cache_keyword(base_model)     # "cache" or "past_key_values"
    g = torch.Generator().manual_seed(1)
    result = {"prompt": prompt, "new": new, "repeat": repeat, "dtype": "float16",
              "block_size": 16}
    blocks_per_row = (prompt + new) // 16 + 2

    def timed(model, ids, cache):
        """(output, seconds of the call, of the prefill, of the decode steps,
        in cache.update per decode step)."""
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
        for batch in (1, 4):
            ids = torch.randint(3, VOCAB, (batch, prompt), generator=g)
            pool = kvcore.hf.pool_for(kv_model.config, batch * blocks_per_row, dtype="float16")
            samples = {"dynamic": [], "kvcore": []}
            for rep in range(repeat + 1):         # the first round warms up
                # interleaved, so that a change of load on the machine hits both
                dyn = transformers.DynamicCache()
                want, *t = timed(base_model, ids, dyn)
                dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn.layers)
                if rep:
                    samples["dynamic"].append(t)
                cache = kvcore.hf.PagedCache(pool)
                got, *t = timed(kv_model, ids, cache)
                kv_bytes = pool.bytes_per_block * pool.num_used_blocks
                cache.free()
                pool.reset_prefix_cache()
                if rep:
                    samples["kvcore"].append(t)
            (d_all, d_pre, d_dec, d_upd), (k_all, k_pre, k_dec, k_upd) = (
                [statistics.median(x) for x in zip(*samples[name])]
                for name in ("dynamic", "kvcore"))
            tokens, steps = batch * new, batch * (new - 1)
            result[f"batch{batch}"] = {
                "dynamic_tok_s": tokens / d_all, "kvcore_tok_s": tokens / k_all,
                "ratio_tok_s": d_all / k_all,
                "dynamic_decode_tok_s": steps / d_dec, "kvcore_decode_tok_s": steps / k_dec,
                "ratio_decode_tok_s": d_dec / k_dec,
                "dynamic_prefill_s": d_pre, "kvcore_prefill_s": k_pre,
                "dynamic_update_s": d_upd, "kvcore_update_s": k_upd,
                "ratio_prefill": d_pre / k_pre,
                "dynamic_kv_bytes": dyn_bytes, "kvcore_kv_bytes": kv_bytes,
                "kv_bytes_fraction": kv_bytes / dyn_bytes,
                # float16 pages: the tokens may differ; reported, not required
                "token_agreement": float((got[:, prompt:] == want[:, prompt:]).float().mean()),
            }

        # ---- time to first token, shared prefix
        shared = torch.randint(3, VOCAB, (1, prompt), generator=g)

        def request():
            return torch.cat([shared, torch.randint(3, VOCAB, (1, 16), generator=g)], dim=1)

        pool = kvcore.hf.pool_for(kv_model.config, 4 * blocks_per_row, dtype="float16")

        def cold():
            pool.reset_prefix_cache()
            kvcore.hf.generate(kv_model, request(), pool, max_new_tokens=1, do_sample=False)

        def warm():
            kvcore.hf.generate(kv_model, request(), pool, max_new_tokens=1, do_sample=False)

        t_cold = _median_time(cold, repeat)
        kvcore.hf.generate(kv_model, request(), pool, max_new_tokens=1, do_sample=False)
        hits0 = pool.stats()["prefix_hits"]
        t_warm = _median_time(warm, max(repeat, 3))
        hits = (pool.stats()["prefix_hits"] - hits0) // (max(repeat, 3) + 1)
        t_dyn = _median_time(lambda: base_model.generate(
            request(), **{key: transformers.DynamicCache()}, max_new_tokens=1, do_sample=False),
            repeat)
        result["ttft"] = {"cold_s": t_cold, "warm_s": t_warm, "dynamic_s": t_dyn,
                          "hit_tokens": hits, "ratio_cold_warm": t_cold / t_warm,
                          "ratio_dynamic_warm": t_dyn / t_warm}

        b4 = result["batch4"]
        result["update_per_step"] = {"dynamic_us": b4["dynamic_update_s"] * 1e6,
                                     "paged_us": b4["kvcore_update_s"] * 1e6,
                                     "ratio": b4["kvcore_update_s"] / b4["dynamic_update_s"]}
    return result


GOALS = (("batch1", "ratio_tok_s", ">=", 1.3), ("batch4", "ratio_tok_s", ">=", 1.3),
         ("batch1", "ratio_decode_tok_s", ">=", 1.3), ("batch4", "ratio_decode_tok_s", ">=", 1.3),
         ("batch1", "kv_bytes_fraction", "<=", 0.5), ("batch4", "kv_bytes_fraction", "<=", 0.5),
         ("ttft", "ratio_cold_warm", ">=", 10.0), ("update_per_step", "ratio", "<=", 1.0))


def goals(r):
    """``[(description, value, met)]`` for the issue's goals."""
    out = []
    for key, field, op, bound in GOALS:
        v = r[key][field]
        met = v >= bound if op == ">=" else v <= bound
        out.append((f"{key}.{field} {op} {bound}", v, met))
    return out


def report(r):
    from ._timing import table

    rows = []
    for b in ("batch1", "batch4"):
        x = r[b]
        rows.append((f"generate {r['prompt']}+{r['new']}, {b}, tokens/s (whole call)",
                     f"{x['kvcore_tok_s']:.1f}", f"{x['dynamic_tok_s']:.1f}",
                     f"{x['ratio_tok_s']:.2f}x"))
        rows.append(("  prefill (first token), s", f"{x['kvcore_prefill_s']:.2f}",
                     f"{x['dynamic_prefill_s']:.2f}", f"{x['ratio_prefill']:.2f}x"))
        rows.append(("  decode steps only, tokens/s", f"{x['kvcore_decode_tok_s']:.1f}",
                     f"{x['dynamic_decode_tok_s']:.1f}", f"{x['ratio_decode_tok_s']:.2f}x"))
        rows.append(("  KV bytes held (kvcore / DynamicCache)",
                     f"{x['kvcore_kv_bytes'] / 2**20:.2f} MiB",
                     f"{x['dynamic_kv_bytes'] / 2**20:.2f} MiB",
                     f"{x['kv_bytes_fraction']:.3f}"))
        rows.append(("  greedy token agreement (float16 pages)",
                     f"{x['token_agreement']:.0%}", "", ""))
    t = r["ttft"]
    rows.append((f"time to first token, {r['prompt']}-token prefix cached "
                 f"({t['hit_tokens']} hit)", f"{t['warm_s'] * 1e3:.1f} ms",
                 f"{t['cold_s'] * 1e3:.1f} ms cold", f"{t['ratio_cold_warm']:.1f}x"))
    rows.append(("", "", f"{t['dynamic_s'] * 1e3:.1f} ms DynamicCache",
                 f"{t['ratio_dynamic_warm']:.1f}x"))
    u = r["update_per_step"]
    rows.append(("cache.update per decode step, batch 4 (all layers)",
                 f"{u['paged_us']:.0f} us", f"{u['dynamic_us']:.0f} us",
                 f"{u['ratio']:.2f} of"))
    text = table(rows, ("hf (float16 pages, attn='kvcore')", "kvcore", "DynamicCache+sdpa",
                        "ratio"))
    lines = [text, "goals:"]
    for what, v, met in goals(r):
        lines.append(f"  {'met    ' if met else 'NOT met'} {what}: {v:.3f}")
    return "\n".join(lines)


def rows(r):
    """The lines of ``python -m kvcore bench``'s table: ``generate`` with a
    float16 ``PagedCache`` against ``DynamicCache`` + sdpa, and the cached
    prefix's time to first token."""
    out = []
    for b in ("batch1", "batch4"):
        x = r[b]
        out += [(f"hf generate {r['prompt']}+{r['new']}, {b}, whole call",
                 f"{x['kvcore_tok_s']:.1f} tok/s", f"{x['dynamic_tok_s']:.1f} tok/s "
                 "(DynamicCache)", f"{x['ratio_tok_s']:.2f}x"),
                ("  time to first token (cold)", f"{x['kvcore_prefill_s']:.2f} s",
                 f"{x['dynamic_prefill_s']:.2f} s", f"{x['ratio_prefill']:.2f}x"),
                ("  decode steps", f"{x['kvcore_decode_tok_s']:.1f} tok/s",
                 f"{x['dynamic_decode_tok_s']:.1f} tok/s", f"{x['ratio_decode_tok_s']:.2f}x"),
                ("  KV bytes held", f"{x['kvcore_kv_bytes'] / 2**20:.2f} MiB",
                 f"{x['dynamic_kv_bytes'] / 2**20:.2f} MiB", f"{x['kv_bytes_fraction']:.3f} of")]
    t = r["ttft"]
    out.append((f"hf time to first token, {t['hit_tokens']} tokens cached",
                f"{t['warm_s'] * 1e3:.1f} ms", f"{t['cold_s'] * 1e3:.1f} ms (cold)",
                f"{t['ratio_cold_warm']:.1f}x"))
    return out
