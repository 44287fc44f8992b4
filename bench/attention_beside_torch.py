"""kvcore's decode attention at 1 and 2 threads, alone and right after torch
matmuls on torch's own thread pool: what kvcore.hf's default thread count
(one) is chosen against (docs/hf.md, "Threads").

    python bench/attention_beside_torch.py [--positions 4096] [--layers 8]
        [--rounds 60]

SmolLM2-135M's shape (9 query / 3 KV heads, head_dim 64, float16 pages), one
sequence of ``--positions`` positions in shuffled 16-position blocks; per
layer either nothing or three ``(1, 576) x (576, 1536)`` float32 matmuls
(an MLP's size) before the timed ``AttentionPlan.run``.  Thread counts and
modes alternate each round; microseconds per layer, median [min-max].
"""
import argparse
import statistics
import time

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=int, default=4096, metavar="N")
    p.add_argument("--layers", type=int, default=8, metavar="N")
    p.add_argument("--rounds", type=int, default=60, metavar="N")
    a = p.parse_args(argv)
    if a.positions < 16 or a.layers < 1 or a.rounds < 1:
        p.error("--positions must be >= 16, --layers and --rounds >= 1")

    import torch

    import kvcore

    rng = np.random.default_rng(0)
    blocks = a.positions // 16
    n = blocks * 16
    pool = kvcore.BlockPool(blocks + 4, 16, a.layers, 3, 64, dtype="float16")
    table = rng.permutation(blocks + 4)[:blocks].astype(np.int32)[None, :]
    slots = (table[0][:, None].astype(np.int64) * 16 + np.arange(16)).reshape(-1)
    for layer in range(a.layers):
        k, v = (rng.standard_normal((n, 3, 64)).astype(np.float32) for _ in range(2))
        pool.write(layer, k, v, slots)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    out = np.empty_like(q)
    plans = {t: kvcore.AttentionPlan(pool, table, np.array([n]), np.array([0, 1]),
                                     num_threads=t) for t in (1, 2)}
    x, w = torch.randn(1, 576), torch.randn(576, 1536)
    times = {(t, mm): [] for t in (1, 2) for mm in (False, True)}
    for i in range(a.rounds):
        for t in ((1, 2) if i % 2 else (2, 1)):
            for mm in ((False, True) if i % 4 < 2 else (True, False)):
                total = 0.0
                for layer in range(a.layers):
                    if mm:
                        for _ in range(3):
                            x @ w
                    t0 = time.perf_counter()
                    plans[t].run(q, layer, out=out)
                    total += time.perf_counter() - t0
                times[(t, mm)].append(total / a.layers)
    print(f"{a.positions} positions, 9/3 heads d64 float16, torch threads "
          f"{torch.get_num_threads()}, kvcore SIMD {kvcore.simd_levels()['attention']}; "
          f"us per layer, median [min-max] of {a.rounds} rounds")
    for (t, mm), v in times.items():
        print(f"  kvcore threads {t}, {'after torch matmuls' if mm else 'alone':<19}: "
              f"{statistics.median(v) * 1e6:7.0f} [{min(v) * 1e6:.0f}-{max(v) * 1e6:.0f}]")


if __name__ == "__main__":
    main()
