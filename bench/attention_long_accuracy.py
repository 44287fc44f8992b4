"""How the CPU attention's float32 sums hold up over very long sequences.

    python bench/attention_long_accuracy.py [--max-log2 27]

One sequence of 2**e positions in one block (float16 pages, one KV head,
head_dim 8): every key and value 0 but the last position's (keys 2, values
5), q all ones, scale 1: the output is 5 w / (w + 2**e - 1) with w = e**16,
in closed form.  Prints the relative error of kvcore's decode for e =
--min-log2 .. --max-log2 against the 1e-5 bound of docs/api.md (2**28
positions take 8 GiB of pages).
"""
import argparse
import time

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-log2", type=int, default=20)
    p.add_argument("--max-log2", type=int, default=27)
    a = p.parse_args(argv)
    if not 4 <= a.min_log2 <= a.max_log2 <= 32:
        p.error("need 4 <= --min-log2 <= --max-log2 <= 32")

    import kvcore

    print(f"kvcore attention level {kvcore.simd_levels()['attention']}")
    for e in range(a.min_log2, a.max_log2 + 1):
        n = 2 ** e
        pool = kvcore.BlockPool(1, n, 1, 1, 8, dtype="float16", enable_prefix_caching=False)
        pool.write(0, np.full((1, 1, 8), 2, np.float32), np.full((1, 1, 8), 5, np.float32),
                   [n - 1])
        q = np.ones((1, 1, 8), np.float32)
        t0 = time.perf_counter()
        out = kvcore.paged_attention(q, pool, 0, [[0]], [n], scale=1.0)
        t = time.perf_counter() - t0
        w = np.exp(np.float64(16.0))
        ref = 5 * w / (w + (n - 1))
        print(f"2**{e:2d} positions: relative error {abs(float(out[0, 0, 0]) - ref) / ref:.1e}"
              f"  ({t * 1e3:.0f} ms)", flush=True)
        del pool


if __name__ == "__main__":
    main()
