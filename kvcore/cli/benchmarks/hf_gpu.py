"""Hugging Face transformers on a GPU: ``kvcore.hf`` against what a GPU user has.

The model: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 KV
heads, head_dim 64, MLP 8192, vocabulary 128256, tied embeddings) with
random weights in bfloat16, built from ``LlamaConfig`` on the device (no
download); ``tiny=True`` swaps in a 2-layer model of the same head shape
(a dry run of this file, on any device).  Greedy generation of ``new``
tokens after ``prompt``-token prompts, batch 1 and 16; every call a new
random prompt (no prefix hits), except where a warm prefix is measured.
Per batch size and method, one call that warms up (not timed) and then
``calls`` timed calls (the methods one after another, not interleaved: a
compiled forward must not see another attention implementation between
its calls):

- ``dynamic``: ``model.generate`` with ``DynamicCache`` and sdpa, eager;
- ``static``: ``model.generate(..., cache_implementation="static")``, which
  compiles the forward with ``torch.compile`` (its first call's seconds are
  reported as the compile time; where it fails, the error is reported and
  the goals compare kvcore's graphs with ``dynamic``);
- ``kvcore``: ``kvcore.hf.generate`` on a bfloat16 pool with
  ``attn_implementation="kvcore"``, eager;
- ``kvcore graphs``: the same with ``cuda_graph=True``.

Numbers: the whole call (median seconds, tokens/s), time to first token
(``max_new_tokens=1`` calls: a new prompt, and for kvcore a prompt whose
every full block is cached, measured after the warm call that cached it
and, for graphs, after the call that captured its step), the peak device
memory a call allocates beyond what was allocated before it, the KV bytes a
cache holds at the end of a call (DynamicCache's tensors against the pool
blocks a PagedCache holds), and the host time per decode layer spent in the
cache's ``update`` and the attention function (wall clock around each call,
no synchronisation: what the host pays per layer).  Small calls (issue 40
item 5): a one-token ``BlockPool.write`` and a batch-1 ``AttentionPlan.run``
of 1024 keys against torch's equivalents (an indexed assignment into a
paged tensor; ``scaled_dot_product_attention`` over a contiguous cache),
seconds per call over back-to-back calls (launch-bound calls: host time).
"""
import statistics
import time

MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
             tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(MODEL, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
METHODS = ("dynamic", "static", "kvcore", "kvcore graphs")
BLOCK = 16


def _model(device, tiny):
    import torch
    import transformers

    config = transformers.LlamaConfig(**(TINY if tiny else MODEL))
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    model.eval()
    model.generation_config.eos_token_id = None     # always `new` tokens
    model.generation_config.pad_token_id = 0
    return model


class _Device:
    """What differs between a CUDA device and a dry run on the CPU."""

    def __init__(self, device):
        import torch
        self.torch = torch
        self.cuda = str(device).startswith("cuda")
        self.device = torch.device(device)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def allocated(self):
        return self.torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self):
        return self.torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def name(self):
        if self.cuda:
            return self.torch.cuda.get_device_name(self.device)
        import platform
        return platform.processor() or "cpu"


def run(quick=False, batches=(1, 16), prompt=1024, new=128, calls=None, compile=True,
        device="cuda", tiny=False):
    """Every number above, as a dict (see :func:`report`)."""
    import torch
    import transformers

    import kvcore
    import kvcore.hf

    dev = _Device(device)
    model = _model(dev.device, tiny)
    calls = calls or (2 if quick else 3)
    blocks = max(batches) * (-(-(prompt + new) // BLOCK) + 2) * 2 + 64
    pool = kvcore.hf.pool_for(model.config, blocks, dtype="bfloat16", block_size=BLOCK,
                              device=str(dev.device))
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    def fresh(batch):
        return torch.randint(3, vocab, (batch, prompt), generator=gen).to(dev.device)

    def timed(fn):
        dev.sync()
        t0 = time.perf_counter()
        out = fn()
        dev.sync()
        return time.perf_counter() - t0, out

    def call(method, ids, tokens):
        if method in ("dynamic", "static"):
            _attention(model, "sdpa")
            extra = {"cache_implementation": "static"} if method == "static" else {}
            return model.generate(ids, max_new_tokens=tokens, do_sample=False, **extra)
        _attention(model, "kvcore")
        return kvcore.hf.generate(model, ids, pool, max_new_tokens=tokens, do_sample=False,
                                  cuda_graph=method == "kvcore graphs")

    methods = [m for m in METHODS if (m != "static" or compile)
               and (m != "kvcore graphs" or dev.cuda)]
    out = {"device": dev.name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "kvcore": kvcore.__version__,
           "model": "tiny" if tiny else "Llama-3.2-1B shape", "prompt": prompt, "new": new,
           "calls": calls, "pool_blocks": blocks, "pool_bytes": blocks * pool.bytes_per_block,
           "batches": {}}
    for batch in batches:
        r = out["batches"][str(batch)] = {m: {} for m in methods}
        whole = {m: [] for m in methods}
        failed = {}
        for m in methods:
            for rnd in range(calls + 1):
                if m in failed:
                    continue
                ids = fresh(batch)
                base = dev.allocated()
                dev.reset_peak()
                try:
                    t, _ = timed(lambda: call(m, ids, new))
                except Exception as e:  # noqa: BLE001 - reported (torch.compile may fail)
                    failed[m] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    continue
                if rnd == 0:
                    r[m]["first_call_s"] = t
                    continue
                whole[m].append(t)
                r[m]["peak_extra_bytes"] = max(r[m].get("peak_extra_bytes", 0),
                                               dev.peak() - base)
        if "kvcore graphs" in methods:
            r["kvcore graphs"]["captures"], r["kvcore graphs"]["replays"] = \
                kvcore.hf.graphs.counts(pool, model)
        for m in methods:
            if m in failed:
                r[m]["error"] = failed[m]
            if whole[m]:
                r[m]["call_s"] = statistics.median(whole[m])
                r[m]["call_range"] = [min(whole[m]), max(whole[m])]
                r[m]["tokens_per_s"] = batch * new / r[m]["call_s"]
        _ttft(r, methods, failed, batch, fresh, timed, call, calls)
        _kv_bytes(r, model, pool, fresh(batch), new, kvcore, transformers)
        _host_per_layer(r, model, pool, fresh(batch), kvcore, transformers)
    if dev.cuda:
        out["small_calls"] = _small_calls(dev, pool)
    return out


def _attention(model, name):
    if getattr(model.config, "_attn_implementation", None) != name:
        model.set_attn_implementation(name)


def _ttft(r, methods, failed, batch, fresh, timed, call, calls):
    """Time to first token: a new prompt (every method but static, whose
    compiled step would recompile for another length), and for kvcore a
    prompt cached by the call before (graphs: after the call that captured
    the step of its uncached tail)."""
    for m in methods:
        if m in failed or m == "static":
            continue
        cold = [timed(lambda: call(m, fresh(batch), 1))[0] for _ in range(calls + 1)][1:]
        r[m]["ttft_s"] = statistics.median(cold)
        if m.startswith("kvcore"):
            ids = fresh(batch)
            for _ in range(3 if m == "kvcore graphs" else 2):     # cache it; warm up, capture
                call(m, ids, 1)
            warm = [timed(lambda: call(m, ids, 1))[0] for _ in range(calls)]
            r[m]["ttft_warm_s"] = statistics.median(warm)


def _kv_bytes(r, model, pool, ids, new, kvcore, transformers):
    """KV bytes a cache holds after a call: DynamicCache's tensors; the pool
    blocks of a PagedCache's rows."""
    _attention(model, "sdpa")
    dyn = transformers.DynamicCache()
    keyword = kvcore.hf.cache_keyword(model)
    model.generate(ids, max_new_tokens=new, do_sample=False, **{keyword: dyn})
    held = 0
    for layer in dyn.layers:
        held += layer.keys.nbytes + layer.values.nbytes
    r["dynamic"]["kv_bytes"] = held
    _attention(model, "kvcore")
    with kvcore.hf.PagedCache(pool) as cache:
        model.generate(ids, max_new_tokens=new, do_sample=False, **{keyword: cache})
        blocks = sum(len(row.block_table) for row in cache.rows)
    r["kvcore"]["kv_bytes"] = blocks * pool.bytes_per_block


def _host_per_layer(r, model, pool, ids, kvcore, transformers, new=24):
    """Host microseconds per decode layer in the cache's update and the
    attention function (kvcore eager; DynamicCache + sdpa), from the wall
    clock around each call (no synchronisation)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import kvcore.hf.cache as hf_cache

    def timing(fn, spent):
        def timed_fn(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)
        return timed_fn

    keyword = kvcore.hf.cache_keyword(model)
    layers = model.config.num_hidden_layers
    for m, attn, cache_cls in (("dynamic", "sdpa", transformers.DynamicCache),
                               ("kvcore", "kvcore", hf_cache.PagedCache)):
        spent_update, spent_attn = [], []
        update = cache_cls.update
        attention = ALL_ATTENTION_FUNCTIONS[attn]
        cache_cls.update = timing(update, spent_update)
        ALL_ATTENTION_FUNCTIONS[attn] = timing(attention, spent_attn)   # (a local override)
        _attention(model, attn)
        try:
            cache = cache_cls() if m == "dynamic" else cache_cls(pool)
            model.generate(ids, max_new_tokens=new, do_sample=False, **{keyword: cache})
            if m == "kvcore":
                cache.free()
        finally:
            cache_cls.update = update
            del ALL_ATTENTION_FUNCTIONS[attn]
        # the decode steps: every call after the prefill's (one per layer)
        u, a = spent_update[layers:], spent_attn[layers:]
        per_layer = [(x + y) * 1e6 for x, y in zip(u, a)]
        r[m]["host_us_per_layer"] = statistics.median(per_layer)
        r[m]["host_us_update"] = statistics.median(u) * 1e6
        r[m]["host_us_attention"] = statistics.median(a) * 1e6


def _small_calls(dev, pool, number=2000):
    """Seconds per call, back to back (launch-bound: the host's time)."""
    import numpy as np
    import torch

    import kvcore

    heads, dim = pool.num_kv_heads, pool.head_dim
    k = torch.randn(1, heads, dim, dtype=torch.bfloat16, device=dev.device)
    v = torch.randn(1, heads, dim, dtype=torch.bfloat16, device=dev.device)
    slots = np.array([5], np.int64)
    d_slots = torch.tensor([5], dtype=torch.int64, device=dev.device)
    paged = torch.zeros((64, heads, BLOCK, dim), dtype=torch.bfloat16, device=dev.device)
    blocks, offsets = torch.tensor([0], device=dev.device), torch.tensor([5], device=dev.device)

    def per_call(fn):
        fn()
        dev.sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        dev.sync()
        return (time.perf_counter() - t0) / number

    def torch_write():
        paged[blocks, :, offsets, :] = k[:, :, :]

    out = {"pool_write_host_slots_s": per_call(lambda: pool.write(0, k, v, slots)),
           "pool_write_device_slots_s": per_call(
               lambda: pool.write(0, k, v, d_slots, check=False)),
           "torch_index_write_s": per_call(torch_write)}
    # batch 1, 1024 keys, 32 query heads over 8 KV heads
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(3, 3 + 1024)))
    try:
        table = np.asarray(seq.block_table, np.int32)[None, :]
        lens = np.array([1024], np.int64)
        plan = kvcore.AttentionPlan(pool, table, lens, num_heads=32)
        q = torch.randn(1, 32, dim, dtype=torch.bfloat16, device=dev.device)
        o = torch.empty_like(q)
        kc = torch.randn(1, heads, 1024, dim, dtype=torch.bfloat16, device=dev.device)
        q4 = q[:, :, None, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out["plan_run_s"] = per_call(lambda: plan.run(q, 0, out=o))
        out["torch_sdpa_s"] = per_call(lambda: sdpa(q4, kc, kc, enable_gqa=True))
    finally:
        seq.free()
    return out


# ------------------------------------------------------------------ report
def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _gb(x):
    return "-" if x is None else f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def goals(r):
    """Issue 40's goals measured in this run: ``[(goal, value, met)]``."""
    out = []
    for b, row in r["batches"].items():
        dyn, kv, gr = row.get("dynamic", {}), row.get("kvcore", {}), row.get("kvcore graphs", {})
        st = row.get("static", {})
        if dyn.get("call_s") and kv.get("call_s"):
            x = dyn["call_s"] / kv["call_s"]
            out.append((f"batch {b}: kvcore eager whole call >= 1.2x DynamicCache",
                        f"{x:.2f}x", x >= 1.2))
        if gr.get("call_s"):
            if st.get("call_s"):
                x = st["call_s"] / gr["call_s"]
                out.append((f"batch {b}: kvcore graphs >= 1.0x static cache + compile",
                            f"{x:.2f}x", x >= 1.0))
            elif dyn.get("call_s"):
                x = dyn["call_s"] / gr["call_s"]
                out.append((f"batch {b}: kvcore graphs >= 2x DynamicCache (static did not run)",
                            f"{x:.2f}x", x >= 2.0))
        for name, m in (("kvcore", kv), ("kvcore graphs", gr)):
            if dyn.get("ttft_s") and m.get("ttft_s"):
                x = dyn["ttft_s"] / m["ttft_s"]
                out.append((f"batch {b}: {name} cold TTFT >= 1.0x DynamicCache", f"{x:.2f}x",
                            x >= 1.0))
            if dyn.get("ttft_s") and m.get("ttft_warm_s"):
                x = dyn["ttft_s"] / m["ttft_warm_s"]
                out.append((f"batch {b}: {name} warm TTFT >= 3x DynamicCache's cold",
                            f"{x:.2f}x", x >= 3.0))
        if dyn.get("host_us_per_layer") and kv.get("host_us_per_layer"):
            out.append((f"batch {b}: kvcore host us/decode layer <= DynamicCache's",
                        f"{kv['host_us_per_layer']:.0f} vs {dyn['host_us_per_layer']:.0f}",
                        kv["host_us_per_layer"] <= dyn["host_us_per_layer"]))
        if dyn.get("kv_bytes") and kv.get("kv_bytes"):
            x = kv["kv_bytes"] / dyn["kv_bytes"]
            out.append((f"batch {b}: pool KV bytes <= 1.05x DynamicCache's", f"{x:.3f}x",
                        x <= 1.05))
    s = r.get("small_calls")
    if s:
        for name, ours, theirs in (("one-token pool.write (host slots)", "pool_write_host_slots_s",
                                    "torch_index_write_s"),
                                   ("batch-1 plan.run", "plan_run_s", "torch_sdpa_s")):
            x = s[ours] / s[theirs]
            out.append((f"{name} within 1.5x of torch's call", f"{x:.2f}x", x <= 1.5))
    return out


def report(r):
    lines = [f"{r['device']}: torch {r['torch']}, transformers {r['transformers']}, kvcore "
             f"{r['kvcore']}; {r['model']}, bfloat16, prompt {r['prompt']}, {r['new']} new "
             f"tokens, median of {r['calls']} calls after one",
             "",
             "| batch | method | whole call | tokens/s | TTFT cold | TTFT warm | peak extra "
             "| KV bytes | host us/layer (update + attn) | note |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b, row in r["batches"].items():
        for m, x in row.items():
            note = x.get("error", "")
            if "first_call_s" in x and m == "static":
                note = note or f"first call (compiles) {x['first_call_s']:.1f} s"
            if "captures" in x:
                note = note or f"{x['captures']} captures, {x['replays']} replays so far"
            host = (f"{x['host_us_per_layer']:.0f} ({x['host_us_update']:.0f} + "
                    f"{x['host_us_attention']:.0f})" if "host_us_per_layer" in x else "-")
            tps = f"{x['tokens_per_s']:.0f}" if "tokens_per_s" in x else "-"
            lines.append(f"| {b} | {m} | {_ms(x.get('call_s'))} | {tps} | "
                         f"{_ms(x.get('ttft_s'))} | {_ms(x.get('ttft_warm_s'))} | "
                         f"{_gb(x.get('peak_extra_bytes'))} | {_gb(x.get('kv_bytes'))} | "
                         f"{host} | {note} |")
    s = r.get("small_calls")
    if s:
        lines += ["", "| small call | kvcore us/call | torch us/call |", "|---|---:|---:|",
                  f"| one-token write (host slots / device slots) | "
                  f"{s['pool_write_host_slots_s'] * 1e6:.1f} / "
                  f"{s['pool_write_device_slots_s'] * 1e6:.1f} | "
                  f"{s['torch_index_write_s'] * 1e6:.1f} |",
                  f"| batch-1 attention, 1024 keys | {s['plan_run_s'] * 1e6:.1f} | "
                  f"{s['torch_sdpa_s'] * 1e6:.1f} |"]
    g = goals(r)
    if g:
        lines += ["", "| goal (issue 40) | measured | met |", "|---|---:|---|"]
        lines += [f"| {name} | {value} | {'yes' if met else 'no'} |" for name, value, met in g]
    lines.append(f"\npool: {r['pool_blocks']} blocks of {BLOCK} ({_gb(r['pool_bytes'])}), "
                 "allocated before the calls (not in their peak)")
    return "\n".join(lines)

