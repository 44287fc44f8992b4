"""Arrays in: the cost of a torch tensor against the equivalent NumPy array.

One decode step (one token, 8 KV heads x 128 dims, float32 in, float16
storage): ``PagedKVCache.append`` + ``commit``, ``BlockPool.write`` to one
slot, and ``KVCache.update``; each with NumPy arrays, CPU torch tensors
(plain and requiring grad) and bfloat16 (NumPy through ml_dtypes, and
torch), which take the validated path.  Needs
torch for the tensor rows (they are left out without it).
"""
import sys

import numpy as np

import kvcore
from kvcore import dtypes

from ._timing import median_time, table

HEADS = 8
DIM = 128


def _inputs(torch):
    x = np.random.default_rng(0).standard_normal((1, HEADS, DIM)).astype(np.float32)
    rows = {"numpy float32": (x, -x)}
    if dtypes.BF16_NUMPY is not None:
        rows["numpy bfloat16 (ml_dtypes)"] = (x.astype(dtypes.BF16_NUMPY),
                                              (-x).astype(dtypes.BF16_NUMPY))
    if torch is not None:
        t = torch.from_numpy(x)
        rows["torch float32"] = (t, -t)
        rows["torch float32, requires grad"] = (t.clone().requires_grad_(),
                                               (-t).requires_grad_())
        rows["torch bfloat16"] = (t.to(torch.bfloat16), (-t).to(torch.bfloat16))
    return rows


def run(quick=False):
    try:
        import torch
    except ImportError:
        torch = None
    number = 2000 if quick else 10000
    repeat = 5 if quick else 11
    pool = kvcore.BlockPool(4096, 16, 1, HEADS, DIM, dtype="float16")
    cache = kvcore.KVCache(1, HEADS, DIM, 16, dtype="float16")
    slots = np.array([5], np.int64)
    res = {"torch": None if torch is None else torch.__version__, "rows": []}
    for name, (k, v) in _inputs(torch).items():
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(list(range(16)))

        def append(k=k, v=v, seq=seq):
            seq.append(0, k, v)
            seq.commit(1)
            if seq.num_computed >= 2048:
                seq.truncate(16)

        # (1, heads, 1, dim) views, as a (batch, n, heads, dim) projection gives them
        k4, v4 = (np.swapaxes(a[None], 1, 2) if isinstance(a, np.ndarray)
                  else a[None].transpose(1, 2) for a in (k, v))
        row = {"input": name}
        for key, fn in (("append_commit_us", append),
                        ("pool_write_us", lambda: pool.write(0, k, v, slots)),
                        ("update_us", lambda: cache.update(0, k4, v4, start_pos=0))):
            try:
                row[key] = median_time(fn, repeat=repeat, number=number) * 1e6
            except (TypeError, ValueError) as e:   # an input this version refuses
                row[key] = f"refused ({type(e).__name__})"
        seq.free()
        res["rows"].append(row)
    return res


def report(res):
    def cell(x):
        return f"{x:.2f}" if isinstance(x, float) else x

    rows = [(r["input"], cell(r["append_commit_us"]), cell(r["pool_write_us"]),
             cell(r["update_us"])) for r in res["rows"]]
    head = ("one decode token, 8 KV heads x 128, float32 -> float16 storage; "
            "microseconds per call (median)")
    note = "" if res["torch"] else "\n(torch not installed: NumPy only)"
    return head + "\n" + table(rows, ("input", "append+commit", "pool.write",
                                      "KVCache.update")) + note


if __name__ == "__main__":  # pragma: no cover
    print(report(run(quick="--quick" in sys.argv)))
