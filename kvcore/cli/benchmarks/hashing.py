"""Chained block hashes of one prompt: ``kvcore.block_hashes`` against the
pure-Python chain in the design of vLLM v1 (``sha256`` of pickled
``(parent_hash, token_ids, extra)`` tuples, ``_pyref_pool.hash_block_tokens``).

A 2048-token prompt, block size 16 (128 full blocks), no salt; kvcore with
the token ids as an int32 array (taken without a copy) and as a Python list
(converted first), the baseline with a list.  Figures are medians, in
microseconds per prompt; ratios are baseline time / kvcore time.
"""
import numpy as np

import kvcore

from ._pyref_pool import hash_block_tokens
from ._timing import median_time, table, ratio_text

TOKENS = 2048
BS = 16


def run(quick=False):
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 32000, TOKENS).astype(np.int32)
    lst = arr.tolist()

    def py_chain():
        parent = None
        out = []
        for i in range(0, TOKENS - BS + 1, BS):
            parent = hash_block_tokens(parent, lst[i:i + BS])
            out.append(parent)
        return out

    # both chains hash the same blocks
    assert len(kvcore.block_hashes(arr, BS)) == len(py_chain()) == TOKENS // BS
    number = 20 if quick else 100
    repeat = 5 if quick else 15
    t_arr = median_time(lambda: kvcore.block_hashes(arr, BS), repeat=repeat, number=number)
    t_list = median_time(lambda: kvcore.block_hashes(lst, BS), repeat=repeat, number=number)
    t_py = median_time(py_chain, repeat=repeat, number=max(1, number // 10))
    return {"tokens": TOKENS, "block_size": BS,
            "kvcore_array_us": t_arr * 1e6, "kvcore_list_us": t_list * 1e6,
            "python_us": t_py * 1e6, "ratio_array": t_py / t_arr, "ratio_list": t_py / t_list}


def report(r):
    rows = [
        ("int32 array", f"{r['kvcore_array_us']:.1f}", f"{r['python_us']:.1f}",
         f"{r['ratio_array']:.1f}x"),
        ("list", f"{r['kvcore_list_us']:.1f}", f"{r['python_us']:.1f}",
         f"{r['ratio_list']:.1f}x"),
    ]
    return table(rows, (f"block_hashes, {r['tokens']} tokens (us)", "kvcore",
                        "python sha256/pickle", "speedup"))


def rows(r):
    """The lines of ``python -m kvcore bench``'s table for this benchmark:
    ``(benchmark, kvcore, baseline, speedup)`` cells, formatted."""
    n = r["tokens"]
    return [(f"block_hashes, {n}-token prompt (int32 array)", f"{r['kvcore_array_us']:.1f} us",
             f"{r['python_us']:.1f} us (sha256 of pickled tuples, vLLM-style)",
             ratio_text(r["ratio_array"])),
            (f"block_hashes, {n}-token prompt (list)", f"{r['kvcore_list_us']:.1f} us",
             "", ratio_text(r["ratio_list"]))]
