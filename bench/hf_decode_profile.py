"""Where a decode step of a transformers model goes with kvcore.hf, one thread:
the step against DynamicCache + sdpa's, and within it the time in
``AttentionPlan.run`` (per layer), in the attention function around it, and
in ``PagedCache.update``.

    python bench/hf_decode_profile.py [--model smollm2|PATH.gguf]
        [--model-dtype float32|bfloat16] [--prompt N] [--steps N] [--repeat N]

The prompt (random tokens) is prefilled once per cache; then ``--steps``
greedy decode steps are timed, ``--repeat`` times (median [min-max]).  The
pages are float16 for a float32 model, else the model's dtype.  The
wrappers that time the parts cost about a microsecond a call."""
import argparse
import statistics
import time


def _wrap(acc, name, fn):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0
            acc[name + "_calls"] += 1
    return timed


def _steps(model, cache, prompt, steps, torch, prefilled=lambda: None):
    """Seconds per decode step after prefilling ``prompt`` into ``cache``
    (``prefilled()`` runs between the two)."""
    from kvcore.hf.inputs import cache_keyword
    key = cache_keyword(model)      # (transformers 5.25 deprecates past_key_values)
    with torch.no_grad():
        out = model(prompt, use_cache=True, **{key: cache})
        tok = out.logits[:, -1:].argmax(-1)
        prefilled()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, use_cache=True, **{key: cache})
            tok = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", metavar="smollm2|PATH")
    p.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompt", type=int, default=1024, metavar="N")
    p.add_argument("--steps", type=int, default=32, metavar="N")
    p.add_argument("--repeat", type=int, default=3, metavar="N")
    a = p.parse_args(argv)
    if a.prompt < 1 or a.steps < 1 or a.repeat < 1:
        p.error("--prompt, --steps and --repeat must be >= 1")

    import torch
    import transformers

    import kvcore.hf as hf
    from kvcore.attention import AttentionPlan
    from kvcore.cli.benchmarks.hf import _model

    torch.set_num_threads(1)
    model = _model(a.model, a.model_dtype)
    pages = "float16" if a.model_dtype == "float32" else a.model_dtype
    acc = dict.fromkeys(("run", "run_calls", "attention", "attention_calls", "update",
                         "update_calls"), 0.0)
    AttentionPlan.run = _wrap(acc, "run", AttentionPlan.run)
    hf.PagedCache.update = _wrap(acc, "update", hf.PagedCache.update)
    transformers.AttentionInterface.register(
        hf.ATTN_IMPLEMENTATION, _wrap(acc, "attention", hf.kvcore_attention))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.config.vocab_size - 100, (1, a.prompt), generator=gen)
    rows = {k: [] for k in ("kvcore", "dynamic", "run", "run_layer", "attention", "update")}
    for _ in range(a.repeat):
        model.set_attn_implementation("sdpa")
        rows["dynamic"].append(_steps(model, transformers.DynamicCache(config=model.config),
                                      prompt, a.steps, torch))
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
        pool = hf.pool_for(model.config, num_blocks=(a.prompt + a.steps) // 16 + 2,
                           dtype=pages)
        # the parts are timed over the decode steps only, not the prefill
        rows["kvcore"].append(_steps(model, hf.PagedCache(pool), prompt, a.steps, torch,
                                     prefilled=lambda: acc.update(dict.fromkeys(acc, 0))))
        rows["run"].append(acc["run"] / a.steps)
        rows["run_layer"].append(acc["run"] / max(acc["run_calls"], 1))
        rows["attention"].append(acc["attention"] / a.steps)
        rows["update"].append(acc["update"] / a.steps)

    def fmt(xs, unit=1e3):
        return f"{statistics.median(xs) * unit:8.2f} [{min(xs) * unit:.2f}-{max(xs) * unit:.2f}]"

    kv_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * a.prompt * 2
    print(f"{a.model} ({a.model_dtype} model, {pages} pages), prompt {a.prompt}, "
          f"{a.steps} decode steps x {a.repeat}, one thread: median [min-max]")
    print(f"  decode step, DynamicCache + sdpa, ms        {fmt(rows['dynamic'])}")
    print(f"  decode step, kvcore, ms                     {fmt(rows['kvcore'])}")
    print(f"    AttentionPlan.run, ms per step            {fmt(rows['run'])}")
    print(f"    AttentionPlan.run, us per layer           {fmt(rows['run_layer'], 1e6)}")
    print(f"    attention function (run included), ms     {fmt(rows['attention'])}")
    print(f"    PagedCache.update, ms per step            {fmt(rows['update'])}")
    rate = kv_bytes / statistics.median(rows["run"]) / 1e9
    print(f"    KV read by the attention: {kv_bytes / 2**20:.1f} MiB per step, {rate:.1f} GB/s")


if __name__ == "__main__":
    main()
