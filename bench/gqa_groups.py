"""Decode attention by GQA group size: kvcore against torch's SDPA.

    python bench/gqa_groups.py [--positions 4096] [--batch 4] [--rounds 9]
        [--groups 1,2,4,5,7,8] [--dtypes float16,bfloat16]

One decode step (one query token per sequence) of ``--batch`` sequences of
``--positions`` positions, 8 KV heads of head_dim 128 and 8 x group query
heads, one thread: ``kvcore.paged_attention`` over pages of the dtype in
shuffled 16-position blocks, against ``torch.nn.functional.
scaled_dot_product_attention(..., enable_gqa=True)`` over contiguous
``(batch, kv_heads, positions, 128)`` caches in float32 and in the page
dtype (torch's bfloat16 or float16), the same values.  The calls alternate
in each round; microseconds per call (median [min-max] of the rounds, each
round the best of 3 calls), the ratios torch / kvcore, and the largest
difference to torch float32 (relative to its largest output).
"""
import argparse
import statistics
import time

import numpy as np

KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def _best(fn, n=3):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=int, default=4096, metavar="N")
    p.add_argument("--batch", type=int, default=4, metavar="N")
    p.add_argument("--rounds", type=int, default=9, metavar="N")
    p.add_argument("--groups", default="1,2,4,5,7,8", metavar="G,G,...")
    p.add_argument("--dtypes", default="float16,bfloat16", metavar="D,D")
    a = p.parse_args(argv)
    groups = [int(g) for g in a.groups.split(",")]
    dtypes = a.dtypes.split(",")
    if a.positions < BLOCK or a.batch < 1 or a.rounds < 1 or min(groups) < 1:
        p.error("--positions >= 16, --batch, --rounds and every group >= 1")
    if not set(dtypes) <= {"float16", "bfloat16"}:
        p.error("--dtypes: float16 and/or bfloat16")

    import torch
    import torch.nn.functional as F

    import kvcore

    torch.set_num_threads(1)
    kvcore.set_num_threads(1)
    print(f"kvcore {kvcore.__version__}, level {kvcore.simd_levels()['attention']}, "
          f"torch {torch.__version__}, 1 thread; batch {a.batch} x {a.positions} positions, "
          f"{KV_HEADS} KV heads, head_dim {HEAD_DIM}")
    print("| pages | group (heads) | kvcore us | torch f32 us | torch 16-bit us "
          "| x torch f32 | x torch 16-bit | max diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    nblk = a.positions // BLOCK
    n = nblk * BLOCK
    for dtype in dtypes:
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        pool = kvcore.BlockPool(a.batch * nblk + 1, BLOCK, 1, KV_HEADS, HEAD_DIM, dtype=dtype)
        ids = rng.permutation(a.batch * nblk).astype(np.int32).reshape(a.batch, nblk)
        k = rng.standard_normal((a.batch, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((a.batch, n, KV_HEADS, HEAD_DIM)).astype(np.float32)
        for b in range(a.batch):
            slots = (ids[b][:, None].astype(np.int64) * BLOCK + np.arange(BLOCK)).reshape(-1)
            pool.write(0, k[b], v[b], slots)
        # torch's caches hold the pages' values (rounded to the dtype)
        tk = torch.from_numpy(k).to(tdt).permute(0, 2, 1, 3).contiguous()
        tv = torch.from_numpy(v).to(tdt).permute(0, 2, 1, 3).contiguous()
        tk32, tv32 = tk.float(), tv.float()
        lens = np.full(a.batch, n, np.int64)
        for g in groups:
            heads = KV_HEADS * g
            q = rng.standard_normal((a.batch, heads, HEAD_DIM)).astype(np.float32)
            tq32 = torch.from_numpy(q)[:, :, None, :]
            tq = tq32.to(tdt)
            out = np.empty_like(q)
            kv = lambda: kvcore.paged_attention(q, pool, 0, ids, lens, out=out)
            with torch.inference_mode():
                t32 = lambda: F.scaled_dot_product_attention(tq32, tk32, tv32, enable_gqa=True)
                t16 = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
                times = {"kv": [], "t32": [], "t16": []}
                for _ in range(a.rounds):
                    for name, fn in (("kv", kv), ("t32", t32), ("t16", t16)):
                        times[name].append(_best(fn))
                ref = t32()[:, :, 0, :].numpy()
            kv()
            diff = float(np.abs(out - ref).max() / np.abs(ref).max())
            med = {key: statistics.median(x) for key, x in times.items()}

            def us(key):
                x = times[key]
                return f"{med[key] * 1e6:.0f} [{min(x) * 1e6:.0f}-{max(x) * 1e6:.0f}]"

            def ratio(key):
                r = [t / s for t, s in zip(times[key], times["kv"])]
                return f"{statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]"

            print(f"| {dtype} | {g} ({heads}/{KV_HEADS}) | {us('kv')} | {us('t32')} | "
                  f"{us('t16')} | {ratio('t32')} | {ratio('t16')} | {diff:.1e} |")


if __name__ == "__main__":
    main()
