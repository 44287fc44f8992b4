"""The demo's speed and memory figures (``python -m kvcore demo``), as
numbers to repeat: one run serves the demo's default workload (6 requests
sharing a 192-token prompt, a tiny float32 transformer) three ways: through
kvcore's paged pool, through a contiguous NumPy cache per request, and with
no cache, and checks the outputs against a full recompute.

    python bench/bench_demo.py [--repeat N] [--json FILE]

Ratios are tokens/s of one loop over tokens/s of another in the same run.
Each run takes about 40 s on a 2-core x86-64, most of it the no-cache loop.
``--quick`` halves the new tokens per request.
"""
from .. import demo
from ._timing import table


def run(quick=False):
    opts = dict(demo.DEFAULTS)
    if quick:
        opts["new_tokens"] = max(2, opts["new_tokens"] // 2)
    r = demo.run_demo(**opts)
    if not r["ok"]:
        raise RuntimeError(f"the demo's verification failed: {r['message']}")
    t = r["timings"]
    paged = r["peak_paged_bytes"]
    return {
        "options": opts,
        "tokens_per_s": {k: t[k]["tokens_per_s"] for k in ("kvcore", "contiguous", "nocache")},
        "paged_vs_contiguous": t["kvcore"]["tokens_per_s"] / t["contiguous"]["tokens_per_s"],
        "paged_vs_nocache": t["kvcore"]["tokens_per_s"] / t["nocache"]["tokens_per_s"],
        "contiguous_vs_nocache": t["contiguous"]["tokens_per_s"] / t["nocache"]["tokens_per_s"],
        "prefix_hit_rate": r["prefix_hit_rate"],
        "memory_contiguous_vs_paged": r["contiguous_own_len_bytes"] / paged,
        "memory_common_max_vs_paged": r["contiguous_seed_bytes"] / paged,
    }


def report(r):
    tp = r["tokens_per_s"]
    rows = [
        ("tokens/s, kvcore paged", f"{tp['kvcore']:.1f}",
         f"{r['paged_vs_nocache']:.1f}x no cache, {r['paged_vs_contiguous']:.2f}x contiguous"),
        ("tokens/s, contiguous NumPy", f"{tp['contiguous']:.1f}",
         f"{r['contiguous_vs_nocache']:.1f}x no cache"),
        ("tokens/s, no cache", f"{tp['nocache']:.1f}", "the baseline"),
        ("prefix-cache hit rate", f"{100 * r['prefix_hit_rate']:.1f}%", ""),
        ("KV memory, contiguous / paged", f"{r['memory_contiguous_vs_paged']:.2f}x",
         "each request preallocated to its own max length"),
        ("KV memory, common max_seq_len / paged", f"{r['memory_common_max_vs_paged']:.2f}x",
         "each request preallocated to one max_seq_len"),
    ]
    return table(rows, ("demo workload", "value", ""))
