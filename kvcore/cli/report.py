"""The demo's verdict and report: kvcore's logits checked against a full
recompute, the results gathered into one dict, and the table the CLI prints.

The no-cache loop's logits are the reference, so checking costs no extra
forward passes while the loops agree on their tokens.
"""
import numpy as np

# The tiny model's float32 pages against the full recompute (max abs logits error).
F32_TOLERANCE = 1e-4
# A real model's logits are larger (SmolLM2-135M: |logit| up to ~35) and run
# through 30 layers: float32 pages against the full recompute differ by the
# reordered float32 sums of the batched/chunked steps, not by storage.
MODEL_F32_TOLERANCE = 1e-3
# 8-bit storage (fp8, int8) changes the logits by more than rounding: greedy
# decoding may flip a near-tie.  Its criterion is this share of greedy tokens
# agreeing with the full recompute (float32 math over unrounded K/V).
LOWPREC_AGREEMENT = 0.95
_LOWPREC = ("float8_e4m3fn", "float8_e5m2", "int8")


# ------------------------------------------------------------- verification
def _compare(model, states, ref_states):
    """Compare every logits row of ``states`` with a full recompute.

    ``ref_states`` come from the no-cache loop, whose row i of a request is
    ``forward_last(tokens so far)``: that is the reference as long as both
    loops chose the same tokens before row i.  Past the first disagreement the
    reference is recomputed here on ``states``' own tokens.
    """
    max_err, rows, agree, mismatches = 0.0, 0, 0, []
    worst = None
    for st, ref in zip(states, ref_states):
        plen = len(st.req.prompt)
        same_prefix = True
        for i, row in enumerate(st.logits):
            if same_prefix:
                want = ref.logits[i]
            else:
                want = model.forward_last(st.tokens[:plen + i])
            err = float(np.max(np.abs(row - want)))
            if worst is None or err > max_err:
                max_err, worst = err, (st.req.rid, i)
            rows += 1
            ref_tok = int(np.argmax(want))
            if ref_tok == st.generated[i]:
                agree += 1
            else:
                mismatches.append((st.req.rid, i, st.generated[i], ref_tok))
            if same_prefix and ref.generated[i] != st.generated[i]:
                same_prefix = False
    return {"max_abs_err": max_err, "rows": rows, "tokens_agree": agree,
            "mismatches": mismatches, "worst": worst}


def verify(o, setup, runs):
    """The verdict on kvcore's logits against the full recompute: ok,
    message (why not), criterion, and the comparisons of both cached loops."""
    model = setup.model
    ver = _compare(model, runs["kvcore"]["states"], runs["nocache"]["states"])
    ver_contig = _compare(model, runs["contiguous"]["states"], runs["nocache"]["states"])
    tol = F32_TOLERANCE if setup.tokenizer is None else MODEL_F32_TOLERANCE
    if o["dtype"] == "float32":
        ok = ver["max_abs_err"] <= tol
        criterion = f"max abs error <= {tol:g}"
    elif o["dtype"] in _LOWPREC:
        ok = ver["tokens_agree"] >= LOWPREC_AGREEMENT * ver["rows"]
        criterion = (f"at least {LOWPREC_AGREEMENT:.0%} of greedy tokens agree with the full "
                     "recompute")
    else:
        ok = not ver["mismatches"]
        criterion = "greedy tokens agree with the full recompute"
    if ok:
        message = ""
    elif o["dtype"] == "float32":
        rid, i = ver["worst"]
        message = (f"kvcore's logits differ from a full recompute by up to "
                   f"{ver['max_abs_err']:.3e} (request {rid}, generated token {i}); "
                   f"float32 storage must stay within {tol:g}")
    else:
        rid, i, got, want = ver["mismatches"][0]
        message = (f"{len(ver['mismatches'])} of {ver['rows']} greedy tokens differ from the "
                   f"full recompute (first: request {rid}, generated token {i}: kvcore chose "
                   f"{got}, the recompute's argmax is {want}); max abs logits error "
                   f"{ver['max_abs_err']:.3e}")
    return {"ok": ok, "message": message, "criterion": criterion, "ver": ver,
            "ver_contig": ver_contig}


def collect_results(o, setup, runs, verdict, threads):
    """The dict ``run_demo`` returns, without its table."""
    cfg, pool, reqs = setup.model.config, setup.pool, setup.reqs
    kv = runs["kvcore"]
    ver = verdict["ver"]
    gen_total = sum(len(s.generated) for s in kv["states"])
    stats = pool.stats()
    eng = kv["engine"]
    res = {
        "ok": verdict["ok"], "message": verdict["message"], "criterion": verdict["criterion"],
        "options": dict(o, num_blocks=setup.num_blocks),
        "blas_threads": threads,
        "model": {"name": getattr(setup.model, "name", "TinyTransformer"),
                  "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                  "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size},
        "requests": [{"id": s.req.rid, "arrival": s.req.arrival,
                      "prompt_tokens": len(s.req.prompt), "new_tokens": len(s.generated),
                      "prefix_hit": s.hit, "admitted": s.admitted, "finished": s.finished,
                      "waited": s.req.rid in kv["waited"]} for s in kv["states"]],
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "generated_tokens": gen_total,
        "pool_stats": stats,
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "peak_blocks": eng.peak_blocks,
        "bytes_per_block": pool.bytes_per_block,
        "peak_paged_bytes": eng.peak_blocks * pool.bytes_per_block,
        "contiguous_own_len_bytes": eng.peak_contig_bytes,
        "contiguous_seed_bytes": runs["contiguous"]["engine"].peak_bytes,
        "contiguous_label": runs["contiguous"]["engine"].label,
        "shared_prompt_tokens": (o["prompt_len"] if setup.tokenizer is None
                                 else _common_prefix([r.prompt for r in reqs])),
        "max_seq_len": setup.max_seq_len,
        "steps": kv["steps"], "max_batch": kv["max_batch"],
        "timings": {k: {"seconds": r["seconds"], "tokens_per_s": gen_total / r["seconds"],
                        "steps": r["steps"]} for k, r in runs.items()},
        "verification": {"passed": verdict["ok"], "criterion": verdict["criterion"],
                         "max_abs_err": ver["max_abs_err"], "rows": ver["rows"],
                         "tokens_agree": ver["tokens_agree"],
                         "mismatches": ver["mismatches"][:20],
                         "contiguous_max_abs_err": verdict["ver_contig"]["max_abs_err"]},
    }
    if setup.tokenizer is not None:
        model = res["model"]
        model.update(quant_types=setup.model.quant_types,
                     tied_embeddings=setup.model.tied_embeddings)
        res["texts"] = [{"id": s.req.rid, "question": s.req.question,
                         "answer": setup.tokenizer.decode(s.generated)}
                        for s in kv["states"]]
    return res


def _common_prefix(prompts):
    """Tokens every prompt starts with."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        diff = np.flatnonzero(p[:n] != first[:n])
        n = int(diff[0]) if diff.size else n
    return n


# ------------------------------------------------------------------- table
def _mib(n):
    return f"{n / 2**20:.2f} MiB"


def format_table(r):
    """The text the CLI prints for the result dict ``r``: a header naming the
    model and storage, one row per figure, then a real model's answers."""
    o, m, v, t = r["options"], r["model"], r["verification"], r["timings"]
    reqs = r["requests"]
    st = r["pool_stats"]
    arrivals = ",".join(str(q["arrival"]) for q in reqs)
    shared = r["shared_prompt_tokens"]
    sfx = [q["prompt_tokens"] - shared for q in reqs]
    chat = "texts" in r
    news = [q["new_tokens"] for q in reqs]
    nwait = sum(q["waited"] for q in reqs)
    paged = r["peak_paged_bytes"]
    base = t["nocache"]["seconds"]

    def speed(key):
        s = t[key]["seconds"]
        vs = "the baseline" if key == "nocache" else f"{base / s:.1f}x no cache"
        return f"{t[key]['tokens_per_s']:.1f}", f"{s:.2f} s for the whole loop, {vs}"

    rows = [
        ("requests", str(len(reqs)),
         f"arrive at steps {arrivals}; up to {r['max_batch']} at once; "
         f"{r['steps']} steps" + (f"; {nwait} waited for blocks" if nwait else "")),
        ("prompt tokens", str(r["prompt_tokens"]),
         f"{shared}-token shared " + ("chat prefix" if chat else "system prompt")
         + f" + {min(sfx)}..{max(sfx)}-token " + ("questions" if chat else "suffixes")
         + f"; prefill chunk {o['prefill_chunk']}"),
        ("generated tokens", str(r["generated_tokens"]),
         f"{min(news)}..{max(news)} per request, greedy"
         + (f" (at most {o['new_tokens']}; an answer ends at its end-of-turn token)"
            if chat else "")),
        ("prefix-cache hit rate", f"{100 * r['prefix_hit_rate']:.1f}%",
         f"{st['prefix_hits']} of {st['prefix_queries']} prompt tokens found in the pool "
         "(pool.stats())"),
        *([("prefix-store hits", str(sum(x["hit_tokens"] for x in st["stores"])),
             f"of those tokens, loaded from --store {o['store']} (an earlier run's prefixes)")]
          if "stores" in st else []),
        ("peak KV blocks used", f"{r['peak_blocks']} of {o['num_blocks']}",
         f"blocks of {o['block_size']} tokens, {r['bytes_per_block'] // 1024} KiB each"),
        ("KV bytes, kvcore paged", _mib(paged),
         f"peak blocks used x block bytes, {o['dtype']}"),
        ("KV bytes, contiguous", _mib(r["contiguous_own_len_bytes"]),
         f"{r['contiguous_own_len_bytes'] / paged:.2f}x paged: {o['dtype']}, each live request "
         "preallocated to its own max length (prompt + new tokens)"),
        ("KV bytes, " + ("kvcore.KVCache" if chat else "NumPy seed"),
         _mib(r["contiguous_seed_bytes"]),
         f"{r['contiguous_seed_bytes'] / paged:.2f}x paged: "
         f"{o['dtype'] if chat else 'float32'}, each live request "
         f"preallocated to a common max_seq_len={r['max_seq_len']}"),
        (f"tokens/s, kvcore paged ({o['attention']})", speed("kvcore")[0],
         speed("kvcore")[1] + f"; prefills {r['prompt_tokens'] - st['prefix_hits']} of "
         f"{r['prompt_tokens']} prompt tokens (the rest are prefix hits)"),
        (f"tokens/s, {r['contiguous_label']}", *speed("contiguous")),
        ("tokens/s, no cache", *speed("nocache")),
        ("verification", "PASS" if r["ok"] else "FAIL",
         f"{v['rows']} logits rows vs full recompute: max abs error {v['max_abs_err']:.2e}; "
         f"greedy tokens agree {v['tokens_agree']}/{v['rows']}; criterion: {v['criterion']}"),
    ]
    dev = o["device"]
    shape = (f"{m['num_layers']} layers, {m['num_heads']} query / {m['num_kv_heads']} KV "
             f"heads, head_dim {m['head_dim']}")
    if chat:
        what = (f"{m['name']} ({shape}, vocabulary {m['vocab_size']}; GGUF "
                f"{'/'.join(m['quant_types'])} dequantized to float32 NumPy"
                + (", tied embeddings" if m["tied_embeddings"] else "") + ")")
    else:
        what = f"TinyTransformer ({shape}, RoPE, float32 math, seed {o['seed']})"
    head = (f"kvcore demo: {what}; KV cache {o['dtype']} on {dev}"
            + (f"; BLAS threads {r['blas_threads']}" if r["blas_threads"] else ""))
    widths = [max(len(x[i]) for x in rows) for i in range(2)]
    lines = [head, "-" * min(len(head), 100)]
    lines += [f"{a.ljust(widths[0])}  {b.rjust(widths[1])}  {c}" for a, b, c in rows]
    lines.append(f"tokens/s = generated tokens / wall time of each loop (prefill included); "
                 f"{r['contiguous_label']} max abs error {v['contiguous_max_abs_err']:.2e}")
    for q, text in zip(reqs, r.get("texts", ())):
        lines.append(f"request {q['id']} (prefix hit {q['prefix_hit']} tokens): "
                     f"{text['question']}\n    -> {text['answer'].strip()}")
    return "\n".join(lines)
