"""Hugging Face transformers: ``kvcore.hf`` against ``DynamicCache`` + sdpa.

A tiny Llama with random weights (hidden 256, 4 layers, 8 heads, 2 KV
heads, head_dim 32, float32 model), one thread (torch and kvcore).  Every
number is measured in the same run; ratios compare numbers of the same run.

- ``model.generate``, prompt ``prompt`` tokens + ``new`` new tokens, batch 1
  and 4 (greedy): tokens/s of the whole call (prefill included) and of
  the decode steps alone (whole call minus a ``max_new_tokens=1`` call),
  for ``DynamicCache`` + sdpa (the baseline) and for a float16
  ``PagedCache`` with ``attn_implementation="kvcore"``; the KV bytes each
  holds at the end (DynamicCache's tensors against the pool blocks the
  cache holds).
- Time to first token (``max_new_tokens=1``) of a request whose first
  ``prompt`` tokens another request already computed
  (``kvcore.hf.generate``, pool warm) against the same request cold
  (empty pool) and against ``DynamicCache``.
- Cache operations per decode step: seconds spent in ``cache.update`` per
  step (all layers), DynamicCache against PagedCache (attention excluded).

Times are medians of ``repeat`` calls.  torch and transformers are needed
(``pip install kvcore[hf]``).
"""
import statistics
import time

import numpy as np

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


class _UpdateTimer:
    """Wraps a cache instance's ``update``: seconds spent in it, and calls."""

    def __init__(self, cache):
        self.seconds = 0.0
        self.calls = 0
        inner = cache.update

        def update(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

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
    g = torch.Generator().manual_seed(1)
    result = {"prompt": prompt, "new": new, "repeat": repeat, "dtype": "float16",
              "block_size": 16}
    blocks_per_row = (prompt + new) // 16 + 2

    def dynamic(ids, n):
        cache = transformers.DynamicCache()
        base_model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False)
        return cache

    def paged(ids, n, pool):
        cache = kvcore.hf.PagedCache(pool)
        kv_model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False)
        return cache

    with torch.no_grad():
        for batch in (1, 4):
            ids = torch.randint(3, VOCAB, (batch, prompt), generator=g)
            pool = kvcore.hf.pool_for(kv_model.config, batch * blocks_per_row, dtype="float16")

            def run_paged(n):
                paged(ids, n, pool).free()
                pool.reset_prefix_cache()

            t_dyn = _median_time(lambda: dynamic(ids, new), repeat)
            t_kv = _median_time(lambda: run_paged(new), repeat)
            t_dyn1 = _median_time(lambda: dynamic(ids, 1), repeat)
            t_kv1 = _median_time(lambda: run_paged(1), repeat)
            # same tokens (float16 pages: reported, not required)
            want = base_model.generate(ids, cache=transformers.DynamicCache(), max_new_tokens=new,
                                       do_sample=False)
            cache = kvcore.hf.PagedCache(pool)
            got = kv_model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
            kv_bytes = cache.pool.bytes_per_block * pool.num_used_blocks
            cache.free()
            pool.reset_prefix_cache()
            dyn_cache = dynamic(ids, new)
            dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn_cache.layers)
            tokens = batch * new
            decode_tokens = batch * (new - 1)
            result[f"batch{batch}"] = {
                "dynamic_tok_s": tokens / t_dyn, "kvcore_tok_s": tokens / t_kv,
                "ratio_tok_s": t_dyn / t_kv,
                "dynamic_decode_tok_s": decode_tokens / max(t_dyn - t_dyn1, 1e-9),
                "kvcore_decode_tok_s": decode_tokens / max(t_kv - t_kv1, 1e-9),
                "ratio_decode_tok_s": max(t_dyn - t_dyn1, 1e-9) / max(t_kv - t_kv1, 1e-9),
                "dynamic_prefill_s": t_dyn1, "kvcore_prefill_s": t_kv1,
                "dynamic_kv_bytes": dyn_bytes, "kvcore_kv_bytes": kv_bytes,
                "kv_bytes_fraction": kv_bytes / dyn_bytes,
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
            request(), cache=transformers.DynamicCache(), max_new_tokens=1, do_sample=False),
            repeat)
        result["ttft"] = {"cold_s": t_cold, "warm_s": t_warm, "dynamic_s": t_dyn,
                          "hit_tokens": hits, "ratio_cold_warm": t_cold / t_warm,
                          "ratio_dynamic_warm": t_dyn / t_warm}

        # ---- cache operations per decode step (update() only)
        ids = torch.randint(3, VOCAB, (4, prompt), generator=g)
        steps = {}
        for name in ("dynamic", "paged"):
            per_step = []
            for _ in range(repeat):
                if name == "dynamic":
                    cache = transformers.DynamicCache()
                    model = base_model
                else:
                    pool = kvcore.hf.pool_for(kv_model.config, 4 * blocks_per_row,
                                              dtype="float16")
                    cache = kvcore.hf.PagedCache(pool)
                    model = kv_model
                timer = _UpdateTimer(cache)
                model(ids, cache=cache)                       # prefill, not counted
                timer.seconds, timer.calls = 0.0, 0
                pos = torch.full((4, 1), prompt, dtype=torch.long)
                step_ids = torch.randint(3, VOCAB, (4, 1), generator=g)
                n_steps = 16
                for s in range(n_steps):
                    model(step_ids, cache=cache, position_ids=pos + s)
                per_step.append(timer.seconds / n_steps)
                if name == "paged":
                    cache.free()
            steps[name] = statistics.median(per_step)
        result["update_per_step"] = {"dynamic_us": steps["dynamic"] * 1e6,
                                     "paged_us": steps["paged"] * 1e6,
                                     "ratio": steps["paged"] / steps["dynamic"]}
    return result


GOALS = (("batch1", "ratio_tok_s", ">=", 1.3), ("batch4", "ratio_tok_s", ">=", 1.3),
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
        rows.append(("  decode steps only, tokens/s", f"{x['kvcore_decode_tok_s']:.1f}",
                     f"{x['dynamic_decode_tok_s']:.1f}", f"{x['ratio_decode_tok_s']:.2f}x"))
        rows.append(("  KV bytes held (kvcore / DynamicCache)",
                     f"{x['kvcore_kv_bytes'] / 2**20:.2f} MiB",
                     f"{x['dynamic_kv_bytes'] / 2**20:.2f} MiB",
                     f"{x['kv_bytes_fraction']:.2f}"))
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
        lines.append(f"  {'met    ' if met else 'NOT met'} {what}: {v:.2f}")
    return "\n".join(lines)
