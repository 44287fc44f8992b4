"""SmolLM2-135M through kvcore.hf with float16, int8 and float8_e4m3fn pages:
perplexity over a real text, then decode steps at that context, per page
dtype and per kvcore thread count, alternated (issue 42).

    python bench/bench_hf_pages.py [--model smollm2|PATH.gguf] [--text FILE]
        [--tokens 4096] [--chunk 512] [--calib 512] [--steps 24]
        [--dtypes float16,int8,float8_e4m3fn] [--threads 1[,2]]
        [--torch-threads N] [--prefill-reps N] [--batch B]
        [--generate B[,B...] [--gen-prompt N] [--gen-new N] [--gen-reps N]]
        [--json FILE]

1. Perplexity of the float32 model over the first ``--tokens`` tokens of
   ``--text`` (default the GPL-3 text of /usr/share/common-licenses, on
   disk on any Debian/Ubuntu: real English prose, no download), teacher
   forced in chunks of ``--chunk`` tokens: once with ``DynamicCache`` +
   sdpa (float32, the reference), then through a ``kvcore.hf.PagedCache``
   and ``attn_implementation="kvcore"`` per page dtype, so every chunk
   reads the earlier ones from the pages.  fp8 pools get the scales of
   ``kvcore.hf.calibrate_kv_scales`` (one per layer, its default) on the
   ``--calib`` tokens that follow the measured ones, as a user would.
2. Each cache then holds ``--tokens`` positions of that text.  Decode
   steps (one token of the text's continuation, the same for every cache)
   are timed one at a time, the caches and thread counts taken in turn
   (rotated each round, so load on the machine hits all alike), and each
   cache is cropped back after its step: every step attends ``--tokens``
   + 1 positions.  Per step the time in ``AttentionPlan.run`` (all layers)
   and in ``PagedCache.update`` is noted: their share of the step says how
   much any page dtype could gain on this model.  With ``--batch B`` (B >
   1) the decode steps run on new caches of B sequences instead: rows of
   ``--tokens`` positions starting 64 tokens apart in the text (distinct
   pages, no shared prefix), each prefilled in chunks of ``--chunk``; each
   step appends the next text token of every row.  Attention then reads B
   times the pages while the weights are read once, so its share of the
   step (and what 8-bit pages can gain) grows with B.
3. With more than one ``--threads``: the last ``--chunk`` tokens prefilled
   again (crop, forward) on the float16 cache, ``--prefill-reps`` times per
   thread count, alternated.
4. With ``--generate``: whole ``kvcore.hf.generate`` calls (float16 pages,
   random-token prompts of ``--gen-prompt`` tokens, ``--gen-new`` new
   tokens, greedy, an empty prefix cache each call) per batch size and
   kvcore thread count, alternated: the call, its prefill and its decode
   steps (from the times a streamer sees each step's tokens).

torch runs at its default thread count (``--torch-threads`` to change it);
kvcore's attention at each of ``--threads`` (``kvcore.set_num_threads``).
Times: median [min-max] over the steps.
"""
import argparse
import json
import math
import statistics
import time

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
DTYPES = ("float16", "int8", "float8_e4m3fn")


class _Parts:
    """Seconds spent in ``AttentionPlan.run`` and ``PagedCache.update``
    while ``on`` (class attributes wrapped for the run, put back after)."""

    def __init__(self, classes):
        self.on = False
        self.seconds = {"run": 0.0, "update": 0.0}
        self._saved = []
        for cls, name, part in classes:
            inner = getattr(cls, name)
            self._saved.append((cls, name, inner))
            setattr(cls, name, self._wrap(part, inner))

    def _wrap(self, part, inner):
        parts = self

        def timed(*args, **kwargs):
            if not parts.on:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts.seconds[part] += time.perf_counter() - t0
        return timed

    def take(self):
        out = dict(self.seconds)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out

    def restore(self):
        for cls, name, inner in self._saved:
            setattr(cls, name, inner)


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _fmt(s, unit=1e3, digits=1):
    return f"{s['median'] * unit:.{digits}f} [{s['min'] * unit:.{digits}f}-" \
           f"{s['max'] * unit:.{digits}f}]"


def run(model="smollm2", text=DEFAULT_TEXT, tokens=4096, chunk=512, calib=512, steps=24,
        dtypes=DTYPES, threads=(1,), torch_threads=None, prefill_reps=3, generate=(),
        gen_prompt=1024, gen_new=32, gen_reps=2, batch=1):
    import torch
    import transformers

    import kvcore
    import kvcore.hf
    from kvcore.attention import AttentionPlan
    from kvcore.cli.benchmarks.hf import _model, chunked_nll, gguf_path

    path = gguf_path(model)
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    before = kvcore.set_num_threads(max(threads))   # (the setting before: restored after)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with open(text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt")["input_ids"]
    need = tokens + max(calib, steps + (batch - 1) * ROW_STRIDE + 1)
    if ids.shape[1] < need:
        raise ValueError(f"{text} has {ids.shape[1]} tokens; the run needs {need}")
    m = _model(model, "float32")
    key = kvcore.hf.cache_keyword(m)
    sample = ids[:, :tokens]
    after = ids[:, tokens:tokens + max(calib, steps)]
    result = {"model": model, "text": text, "tokens": tokens, "chunk": chunk, "calib": calib,
              "torch_threads": torch.get_num_threads(), "threads": list(threads),
              "simd": kvcore.simd_levels(), "perplexity": {}, "decode": {}, "prefill": {},
              "batch": batch}

    def nll_pass(cache):
        nll, count = chunked_nll(m, cache, sample, chunk)
        return math.exp(nll / count)

    caches = {}
    scales_of = {}
    blocks = (tokens + 2 * chunk) // 16 + 4
    with torch.no_grad():
        m.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        dyn = transformers.DynamicCache(config=m.config)
        result["perplexity"]["DynamicCache float32"] = {
            "perplexity": nll_pass(dyn), "seconds": time.perf_counter() - t0}
        caches["DynamicCache float32"] = ("sdpa", dyn)
        m.set_attn_implementation(kvcore.hf.ATTN_IMPLEMENTATION)
        for dtype in dtypes:
            scales = kvcore.hf.calibrate_kv_scales(m, after[:, :calib], dtype=dtype) \
                if dtype.startswith("float8") else None
            scales_of[dtype] = scales
            pool = kvcore.hf.pool_for(m.config, blocks, dtype=dtype, kv_scales=scales)
            cache = kvcore.hf.PagedCache(pool)
            t0 = time.perf_counter()
            ppl = nll_pass(cache)
            result["perplexity"][dtype] = {"perplexity": ppl, "seconds": time.perf_counter() - t0,
                                           "bytes_per_token": pool.bytes_per_token}
            caches[dtype] = (kvcore.hf.ATTN_IMPLEMENTATION, cache)
        ref = result["perplexity"]["DynamicCache float32"]["perplexity"]
        for row in result["perplexity"].values():
            row["vs_dynamic"] = row["perplexity"] / ref - 1

        if batch > 1:
            caches = _batch_caches(m, kvcore, transformers, ids, caches, scales_of, tokens,
                                   chunk, batch)
            result["batch_prefill_seconds"] = caches.pop("seconds")
        # ---- decode steps at `tokens` positions, alternated
        parts = _Parts([(AttentionPlan, "run", "run"), (kvcore.hf.PagedCache, "update", "update")])
        try:
            arms = [(name, t) for name in caches for t in threads
                    if name in dtypes or t == threads[0]]     # DynamicCache: one arm
            samples = {arm: {"step": [], "run": [], "update": []} for arm in arms}
            for i in range(steps + 1):                   # step 0 warms up
                step_ids = _step_ids(ids, tokens, i, batch)
                order = arms[i % len(arms):] + arms[:i % len(arms)]
                for arm in order:
                    name, t = arm
                    attn, cache = caches[name]
                    kvcore.set_num_threads(t)
                    m.set_attn_implementation(attn)
                    parts.take()
                    parts.on = True
                    t0 = time.perf_counter()
                    m(step_ids, **{key: cache})
                    dt = time.perf_counter() - t0
                    parts.on = False
                    cache.crop(-1)
                    if i:
                        got = parts.take()
                        samples[arm]["step"].append(dt)
                        samples[arm]["run"].append(got["run"])
                        samples[arm]["update"].append(got["update"])
        finally:
            parts.restore()
        for (name, t), s in samples.items():
            row = {k: _stats(v) for k, v in s.items()}
            row["run_share"] = statistics.median(r / d for r, d in zip(s["run"], s["step"]))
            f16 = samples.get(("float16", t))
            if f16 is not None:
                # each step against the float16 step of the same round (> 1:
                # faster than float16 pages): median [min-max]
                ratios = [f / d for f, d in zip(f16["step"], s["step"])]
                row["vs_float16"] = statistics.median(ratios)
                row["vs_float16_range"] = [min(ratios), max(ratios)]
                if name != "DynamicCache float32":
                    row["run_vs_float16"] = statistics.median(
                        f / d for f, d in zip(f16["run"], s["run"]))
            first = samples.get((name, threads[0]))
            if t != threads[0] and first is not None:
                # against the same pages at the first thread count, same round
                row["vs_threads0"] = statistics.median(
                    o / d for o, d in zip(first["step"], s["step"]))
                row["run_vs_threads0"] = statistics.median(
                    o / d for o, d in zip(first["run"], s["run"]))
            result["decode"][f"{name} | {t}"] = row

        # ---- prefill of the last chunk again, per thread count
        if len(threads) > 1 and "float16" in dtypes and batch == 1:
            _, cache = caches["float16"]
            m.set_attn_implementation(kvcore.hf.ATTN_IMPLEMENTATION)
            times = {t: [] for t in threads}
            last = sample[:, tokens - chunk:]
            for r in range(prefill_reps):
                for t in (threads if r % 2 == 0 else threads[::-1]):
                    kvcore.set_num_threads(t)
                    cache.crop(-chunk)
                    t0 = time.perf_counter()
                    m(last, **{key: cache})
                    times[t].append(time.perf_counter() - t0)
            result["prefill"] = {str(t): _stats(v) for t, v in times.items()}
        result["generate"] = _generate_rows(m, kvcore, torch, threads, generate, gen_prompt,
                                            gen_new, gen_reps)
    kvcore.set_num_threads(before)
    for _, cache in caches.values():
        if hasattr(cache, "free"):
            cache.free()
    return result


ROW_STRIDE = 64      # --batch: row b starts at token b * ROW_STRIDE of the text


def _step_ids(ids, tokens, i, batch):
    """The decode step's input ``(batch, 1)``: row b's next text token
    (row b holds tokens ``[b * ROW_STRIDE, b * ROW_STRIDE + tokens)``)."""
    import torch

    return torch.stack([ids[0, b * ROW_STRIDE + tokens + i] for b in range(batch)])[:, None]


def _batch_caches(m, kvcore, transformers, ids, caches, scales_of, tokens, chunk, batch):
    """New caches (same names and attentions as ``caches``, whose caches
    are freed) holding ``batch`` rows of ``tokens`` text positions, row b
    starting at token ``b * ROW_STRIDE``; ``"seconds"``: prefill time per
    cache."""
    rows = ids[0, :(batch - 1) * ROW_STRIDE + tokens].unfold(0, tokens, ROW_STRIDE)[:batch]
    key = kvcore.hf.cache_keyword(m)
    out, seconds = {}, {}
    for name, (attn, old) in caches.items():
        if hasattr(old, "free"):
            old.free()
        if attn == "sdpa":
            cache = transformers.DynamicCache(config=m.config)
        else:
            pool = kvcore.hf.pool_for(m.config, batch * ((tokens + chunk) // 16 + 4),
                                      dtype=name, kv_scales=scales_of[name])
            cache = kvcore.hf.PagedCache(pool)
        m.set_attn_implementation(attn)
        t0 = time.perf_counter()
        for lo in range(0, tokens, chunk):
            m(rows[:, lo:lo + chunk].contiguous(), logits_to_keep=1, **{key: cache})
        seconds[name] = time.perf_counter() - t0
        out[name] = (attn, cache)
    out["seconds"] = seconds
    return out


def _generate_rows(m, kvcore, torch, threads, batches, prompt, new, reps):
    """{"B | T": {"call", "prefill", "decode_step"}} of kvcore.hf.generate
    calls, float16 pages, thread counts alternated per round."""
    from kvcore.cli.benchmarks.hf import _Clock     # notes when each step's tokens come

    if not batches:
        return {}
    m.set_attn_implementation(kvcore.hf.ATTN_IMPLEMENTATION)
    g = torch.Generator().manual_seed(0)
    vocab = m.config.vocab_size
    out = {}
    for batch in batches:
        ids = torch.randint(1000, vocab - 1000, (batch, prompt), generator=g)
        pool = kvcore.hf.pool_for(m.config, batch * ((prompt + new) // 16 + 2), dtype="float16")
        got = {t: {"call": [], "prefill": [], "decode_step": []} for t in threads}
        for r in range(reps + 1):                # round 0 warms up
            for t in (threads if r % 2 == 0 else threads[::-1]):
                kvcore.set_num_threads(t)
                pool.reset_prefix_cache()
                clock = _Clock()
                t0 = time.perf_counter()
                kvcore.hf.generate(m, ids, pool, max_new_tokens=new, do_sample=False,
                                   streamer=clock)
                end = time.perf_counter()
                if r:
                    got[t]["call"].append(end - t0)
                    got[t]["prefill"].append(clock.times[1] - t0)
                    got[t]["decode_step"].append((clock.times[-1] - clock.times[1]) / (new - 1))
        for t, s in got.items():
            out[f"{batch} | {t}"] = {k: _stats(v) for k, v in s.items()}
    return out


def report(r):
    lines = [f"{r['model']}, {r['tokens']} tokens of {r['text']} (chunks of {r['chunk']}); "
             f"torch threads {r['torch_threads']}; kvcore SIMD {r['simd']}",
             "", "perplexity (float32 model)          perplexity   vs DynamicCache   "
             "KV bytes/token   seconds"]
    for name, row in r["perplexity"].items():
        lines.append(f"  {name:<32} {row['perplexity']:10.4f}   {row['vs_dynamic']:+15.2%}   "
                     f"{row.get('bytes_per_token', ''):>14}   {row['seconds']:7.1f}")
    rows = f"batch {r['batch']} x " if r.get("batch", 1) > 1 else ""
    lines += ["", f"decode step at {rows}{r['tokens']} positions, ms, median [min-max] over "
              f"{next(iter(r['decode'].values()))['step']['n']} steps (alternated)",
              "  pages | kvcore threads              step                 "
              "AttentionPlan.run    share   update     step x float16  run x float16"]
    for name, row in r["decode"].items():
        vs = f"{row['vs_float16']:.3f}x [{row['vs_float16_range'][0]:.2f}-" \
             f"{row['vs_float16_range'][1]:.2f}]" if "vs_float16" in row else ""
        run_vs = f"{row['run_vs_float16']:.3f}x" if "run_vs_float16" in row else "-"
        lines.append(f"  {name:<32} {_fmt(row['step']):<20} {_fmt(row['run'], digits=2):<20} "
                     f"{row['run_share']:5.1%}   {_fmt(row['update'], digits=2):<10} {vs:<20} "
                     f"{run_vs}")
        if "vs_threads0" in row:
            lines.append(f"    against {r['threads'][0]} kvcore thread(s), same pages: step "
                         f"{row['vs_threads0']:.3f}x, AttentionPlan.run "
                         f"{row['run_vs_threads0']:.3f}x")
    if r["prefill"]:
        lines += ["", f"prefill of {r['chunk']} tokens after {r['tokens'] - r['chunk']}, float16 "
                  "pages, s"]
        for t, s in r["prefill"].items():
            lines.append(f"  kvcore threads {t}: {_fmt(s, 1, 3)}")
    if r.get("generate"):
        lines += ["", "kvcore.hf.generate, float16 pages, random prompts: batch | kvcore threads"
                  "      call s               prefill s            decode step ms"]
        for name, s in r["generate"].items():
            lines.append(f"  {name:<10} {_fmt(s['call'], 1, 2):<20} {_fmt(s['prefill'], 1, 2):<20} "
                         f"{_fmt(s['decode_step'])}")
    goals = [(d, b) for d, b in (("int8", 0.01), ("float8_e4m3fn", 0.03))
             if d in r["perplexity"]]
    if goals:
        lines += ["", "goals (perplexity vs DynamicCache float32; decode step vs float16 pages):"]
    for d, bound in goals:
        v = r["perplexity"][d]["vs_dynamic"]
        lines.append(f"  {'met    ' if v <= bound else 'NOT met'} {d} perplexity within "
                     f"+{bound:.0%}: {v:+.2%}")
        for t in r["threads"]:
            row = r["decode"].get(f"{d} | {t}")
            if row and "vs_float16" in row:
                lines.append(f"  {'met    ' if row['vs_float16'] > 1 else 'NOT met'} {d} decode "
                             f"step faster than float16 ({t} kvcore threads): "
                             f"{row['vs_float16']:.3f}x")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", metavar="smollm2|PATH")
    p.add_argument("--text", default=DEFAULT_TEXT, metavar="FILE")
    p.add_argument("--tokens", type=int, default=4096, metavar="N")
    p.add_argument("--chunk", type=int, default=512, metavar="N")
    p.add_argument("--calib", type=int, default=512, metavar="N")
    p.add_argument("--steps", type=int, default=24, metavar="N")
    p.add_argument("--dtypes", default=",".join(DTYPES), metavar="D[,D...]")
    p.add_argument("--threads", default="1", metavar="T[,T...]",
                   help="kvcore attention threads, alternated (default %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="torch threads (default: torch's own default)")
    p.add_argument("--prefill-reps", type=int, default=3, metavar="N")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="sequences in the decode steps' caches (default %(default)s)")
    p.add_argument("--generate", default="", metavar="B[,B...]",
                   help="batch sizes of timed generate calls (default: none)")
    p.add_argument("--gen-prompt", type=int, default=1024, metavar="N")
    p.add_argument("--gen-new", type=int, default=32, metavar="N")
    p.add_argument("--gen-reps", type=int, default=2, metavar="N")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    for name in ("tokens", "chunk", "calib", "steps", "prefill_reps", "gen_prompt", "gen_reps",
                 "batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.torch_threads is not None and a.torch_threads < 1:
        p.error(f"--torch-threads must be >= 1, got {a.torch_threads}")
    dtypes = tuple(d for d in a.dtypes.split(",") if d)
    bad = [d for d in dtypes if d not in ("float32", "float16", "bfloat16", "int8",
                                          "float8_e4m3fn", "float8_e5m2")]
    if not dtypes or bad:
        p.error(f"--dtypes: expected page dtypes separated by commas, got {a.dtypes!r}")
    try:
        threads = tuple(int(t) for t in a.threads.split(","))
    except ValueError:
        threads = ()
    if not threads or min(threads) < 1:
        p.error(f"--threads: expected positive integers separated by commas, got {a.threads!r}")
    if a.gen_new < 2:
        p.error(f"--gen-new must be >= 2, got {a.gen_new}")
    try:
        generate = tuple(int(b) for b in a.generate.split(",") if b)
    except ValueError:
        generate = (0,)
    if generate and min(generate) < 1:
        p.error(f"--generate: expected positive integers separated by commas, got "
                f"{a.generate!r}")
    r = run(a.model, a.text, a.tokens, a.chunk, a.calib, a.steps, dtypes, threads,
            a.torch_threads, a.prefill_reps, generate, a.gen_prompt, a.gen_new, a.gen_reps,
            a.batch)
    print(report(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
