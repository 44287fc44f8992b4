"""Block-pool benchmarks: bookkeeping, paged write, gather.

* bookkeeping: 2048-token requests sharing a 1024-token prefix (block size
  16); allocate + mark_written + commit + free per request, kvcore against a
  pure-Python pool in the design of vLLM v1's BlockPool (``_pyref_pool``);
* paged write: 4096 tokens x 8 KV heads x 128 dims, float32 -> float16, to
  random slots, against NumPy (and torch, when installed) index assignment;
* gather: a 4096-token sequence from scattered blocks against NumPy fancy
  indexing.
"""
import numpy as np

import kvcore

from . import sweep
from ._pyref_pool import PyBlockPool
from ._timing import median_time, table, ratio_text

BS = 16
PROMPT = 2048
PREFIX = 1024
HEADS = 8
DIM = 128


def _requests(n, rng):
    prefix = rng.integers(0, 32000, PREFIX)
    return [np.concatenate([prefix, rng.integers(0, 32000, PROMPT - PREFIX)]).astype(np.int32)
            for _ in range(n)]


def bench_bookkeeping(quick=False):
    rng = np.random.default_rng(0)
    n_req = 50 if quick else 200
    reqs = _requests(n_req, rng)
    lists = [r.tolist() for r in reqs]
    num_blocks = 4 * PROMPT // BS + PREFIX // BS + 8

    pool = kvcore.BlockPool(num_blocks, BS, 1, 1, 8, dtype="float16")

    def kv_loop(inputs):
        def run():
            for toks in inputs:
                seq = kvcore.PagedKVCache(pool)
                hit = seq.allocate(toks)
                # the model's batched write would go here (pool.write);
                # commit accepts only positions declared written
                seq.mark_written(0, PROMPT - hit)
                seq.commit(PROMPT - hit)
                seq.free()
        return run

    ref = PyBlockPool(num_blocks, BS)

    def py_loop():
        for i, toks in enumerate(lists):
            hit = ref.allocate(i, toks)
            ref.commit(i, PROMPT - hit)
            ref.free(i)

    rep = 5 if quick else 9
    t_arr = median_time(kv_loop(reqs), repeat=rep) / n_req
    t_list = median_time(kv_loop(lists), repeat=rep) / n_req
    t_py = median_time(py_loop, repeat=rep if quick else 5) / n_req
    # the shared prefix must really hit in both, or the comparison is void
    seq = kvcore.PagedKVCache(pool)
    hit = seq.allocate(reqs[0])
    seq.free()
    assert hit == PREFIX, hit
    return {"kvcore_us": t_arr * 1e6, "kvcore_list_us": t_list * 1e6, "python_us": t_py * 1e6,
            "ratio": t_py / t_arr, "ratio_list": t_py / t_list, "requests": n_req}


def bench_write(quick=False):
    """The 4096-token point of the paged-write sweep, in Gelem/s."""
    p = sweep._point(4096, quick, sweep._torch(), np.random.default_rng(1))
    elems = 2 * 4096 * HEADS * DIM
    res = {"kvcore_gelem_s": elems / p["kvcore_s"] / 1e9,
           "numpy_gelem_s": elems / p["numpy_s"] / 1e9, "ratio_numpy": p["ratio_numpy"]}
    if "torch_s" in p:
        import torch

        res.update(torch_gelem_s=elems / p["torch_s"] / 1e9, ratio_torch=p["ratio_torch"],
                   torch_threads=torch.get_num_threads())
    return res


def bench_gather(quick=False):
    rng = np.random.default_rng(2)
    n = 4096
    nb = n // BS
    num_blocks = 2 * nb
    pool = kvcore.BlockPool(num_blocks, BS, 1, HEADS, DIM, dtype="float16")
    pool.key_cache(0)[...] = rng.standard_normal(pool.key_cache(0).shape).astype(np.float16)
    pool.value_cache(0)[...] = rng.standard_normal(pool.key_cache(0).shape).astype(np.float16)
    table_ = rng.permutation(num_blocks)[:nb].astype(np.int32)
    rep = 7 if quick else 21
    t_kv = median_time(lambda: pool.gather(0, table_, 0, n), repeat=rep)
    kc, vc = pool.key_cache(0), pool.value_cache(0)

    def np_gather():
        k = kc[table_].transpose(1, 0, 2, 3).reshape(HEADS, n, DIM)
        v = vc[table_].transpose(1, 0, 2, 3).reshape(HEADS, n, DIM)
        return k, v

    t_np = median_time(np_gather, repeat=rep)
    k1, v1 = pool.gather(0, table_, 0, n)
    k2, v2 = np_gather()
    assert np.array_equal(k1, k2) and np.array_equal(v1, v2)
    elems = 2 * n * HEADS * DIM
    return {"kvcore_gelem_s": elems / t_kv / 1e9, "numpy_gelem_s": elems / t_np / 1e9,
            "ratio_numpy": t_np / t_kv}


def run(quick=False):
    return {"bookkeeping": bench_bookkeeping(quick), "write": bench_write(quick),
            "gather": bench_gather(quick)}


def report(r):
    bk, w, g = r["bookkeeping"], r["write"], r["gather"]
    rows = [
        ("bookkeeping (us/request)", f"{bk['kvcore_us']:.1f}",
         f"python-vLLM-style {bk['python_us']:.1f}", f"{bk['ratio']:.1f}x",
         f"(list input: {bk['kvcore_list_us']:.1f} us, {bk['ratio_list']:.1f}x)"),
        ("paged write f32->f16 (Gelem/s)", f"{w['kvcore_gelem_s']:.2f}",
         f"numpy {w['numpy_gelem_s']:.2f}", f"{w['ratio_numpy']:.1f}x", ""),
    ]
    if "ratio_torch" in w:
        rows.append(("", "", f"torch {w['torch_gelem_s']:.2f} ({w['torch_threads']} thr)",
                     f"{w['ratio_torch']:.1f}x", ""))
    rows.append(("gather 4096 tok (Gelem/s)", f"{g['kvcore_gelem_s']:.2f}",
                 f"numpy {g['numpy_gelem_s']:.2f}", f"{g['ratio_numpy']:.1f}x", ""))
    return table(rows, ("pool benchmark", "kvcore", "baseline", "speedup", ""))


def rows(r):
    """The lines of ``python -m kvcore bench``'s table for this benchmark:
    ``(benchmark, kvcore, baseline, speedup)`` cells, formatted."""
    bk, w, g = r["bookkeeping"], r["write"], r["gather"]
    rows = [("pool bookkeeping, per request", f"{bk['kvcore_us']:.1f} us",
             f"{bk['python_us']:.1f} us (Python, vLLM-style pool)", ratio_text(bk["ratio"])),
            ("paged write 4096 tok f32->f16", f"{w['kvcore_gelem_s']:.2f} Gelem/s",
             f"{w['numpy_gelem_s']:.2f} Gelem/s (NumPy index assign)", ratio_text(w["ratio_numpy"]))]
    if "ratio_torch" in w:
        rows.append(("", "", f"{w['torch_gelem_s']:.2f} Gelem/s (torch, "
                     f"{w['torch_threads']} thread)", ratio_text(w["ratio_torch"])))
    rows.append(("gather 4096 tok", f"{g['kvcore_gelem_s']:.2f} Gelem/s",
                 f"{g['numpy_gelem_s']:.2f} Gelem/s (NumPy fancy index)", ratio_text(g["ratio_numpy"])))
    return rows
