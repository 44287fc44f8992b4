"""Paged-write bandwidth against the number of tokens written.

For n = 1, 16, 256, 4096 (and 65536 unless quick) tokens x 8 KV heads x 128
dims, float32 K and V are written into a float16 block pool (block size 16)
at random distinct slots, by

* kvcore: ``BlockPool.write(layer, k, v, slots)``;
* NumPy: fancy-index assignment ``kc[slots // 16, :, slots % 16] = k`` (and
  the same for v) into float16 arrays of the pool's layout;
* torch (when importable, 1 thread): the same index assignment with
  ``k.to(torch.float16)``.

Bandwidth counts the bytes of K and V read (float32) and written (float16):
``2 * n * 8 * 128 * (4 + 2)``; the slot array is not counted.  Figures are
medians.  Small n measure the per-call overhead, large n the copy itself;
every sample rewrites the same inputs, so sizes whose inputs and cache fit in
the CPU caches (256 tokens: 3 MiB in, 1 MiB out) run faster than the large
ones, which stream from memory.
"""
import numpy as np

import kvcore

from ._timing import median_time, table, ratio_text

HEADS = 8
DIM = 128
BS = 16
TOKENS_QUICK = (1, 16, 256, 4096)
TOKENS_FULL = TOKENS_QUICK + (65536,)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


def _plan(n, quick):
    """(repeat, number): about the same work per sample at every size."""
    number = max(1, min(1000, 4096 // n))
    if n >= 65536:
        return (3 if quick else 5), 1
    return (5 if quick else 15), (max(1, number // 4) if quick else number)


def _point(n, quick, torch, rng):
    num_blocks = max(4, 2 * -(-n // BS))
    pool = kvcore.BlockPool(num_blocks, BS, 1, HEADS, DIM, dtype="float16")
    slots = rng.choice(num_blocks * BS, n, replace=False).astype(np.int64)
    k = rng.standard_normal((n, HEADS, DIM), dtype=np.float32)
    v = rng.standard_normal((n, HEADS, DIM), dtype=np.float32)
    nbytes = 2 * k.size * (4 + 2)
    repeat, number = _plan(n, quick)

    t_kv = median_time(lambda: pool.write(0, k, v, slots), repeat=repeat, number=number)

    kc = np.zeros((num_blocks, HEADS, BS, DIM), np.float16)
    vc = np.zeros_like(kc)
    b, off = slots // BS, slots % BS

    def np_write():
        kc[b, :, off] = k
        vc[b, :, off] = v

    t_np = median_time(np_write, repeat=repeat, number=number)
    np_write()
    if not (np.array_equal(kc, pool.key_cache(0)) and np.array_equal(vc, pool.value_cache(0))):
        raise AssertionError(f"kvcore and NumPy wrote different caches for n={n}")
    point = {"tokens": n, "bytes": nbytes, "kvcore_s": t_kv, "numpy_s": t_np,
             "kvcore_gb_s": nbytes / t_kv / 1e9, "numpy_gb_s": nbytes / t_np / 1e9,
             "ratio_numpy": t_np / t_kv}
    if torch is not None:
        tkc = torch.zeros((num_blocks, HEADS, BS, DIM), dtype=torch.float16)
        tvc = torch.zeros_like(tkc)
        tk, tv = torch.from_numpy(k), torch.from_numpy(v)
        tb, toff = torch.from_numpy(b), torch.from_numpy(off)

        def torch_write():
            tkc[tb, :, toff] = tk.to(torch.float16)
            tvc[tb, :, toff] = tv.to(torch.float16)

        t_t = median_time(torch_write, repeat=repeat, number=number)
        point.update(torch_s=t_t, torch_gb_s=nbytes / t_t / 1e9, ratio_torch=t_t / t_kv)
    return point


def run(quick=False):
    """Measure every token count; returns ``{"points": [...], "config": {...}}``.

    Each point has ``tokens``, ``bytes``, ``kvcore_gb_s``, ``numpy_gb_s``,
    ``ratio_numpy`` (NumPy time / kvcore time) and, with torch,
    ``torch_gb_s`` and ``ratio_torch``.
    """
    rng = np.random.default_rng(3)
    torch = _torch()
    tokens = TOKENS_QUICK if quick else TOKENS_FULL
    points = [_point(n, quick, torch, rng) for n in tokens]
    return {"points": points,
            "config": {"kv_heads": HEADS, "head_dim": DIM, "block_size": BS,
                       "input": "float32", "storage": "float16", "quick": quick,
                       "torch": None if torch is None else torch.__version__,
                       "bytes": "K and V: float32 read + float16 written"}}


def report(res):
    """The results of :func:`run` as a table."""
    pts = res["points"]
    has_torch = "torch_gb_s" in pts[0]
    rows = []
    for p in pts:
        row = [str(p["tokens"]), f"{p['kvcore_gb_s']:.2f}", f"{p['numpy_gb_s']:.2f}",
               f"{p['ratio_numpy']:.1f}x"]
        if has_torch:
            row += [f"{p['torch_gb_s']:.2f}", f"{p['ratio_torch']:.1f}x"]
        rows.append(tuple(row))
    head = ["tokens", "kvcore GB/s", "numpy GB/s", "vs numpy"]
    if has_torch:
        head += ["torch GB/s", "vs torch"]
    return ("paged write f32 -> f16, 8 KV heads x 128 dims (bytes read + written)\n"
            + table(rows, head))


def plot(res, path, spread=None, stamp=None):
    """Draw bandwidth against tokens (log x) into ``path``.

    ``spread``: ``(min_result, max_result)`` of repeated runs, drawn as error
    bars around the medians in ``res``; ``stamp``: a line naming the mode,
    CPU and SIMD level, printed under the title.  Raises ImportError when
    matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["points"]
    xs = [p["tokens"] for p in pts]
    lo = spread[0]["points"] if spread else pts
    hi = spread[1]["points"] if spread else pts
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    series = [("kvcore_gb_s", "o-", "kvcore pool.write"),
              ("numpy_gb_s", "s--", "NumPy fancy-index assignment")]
    if "torch_gb_s" in pts[0]:
        series.append(("torch_gb_s", "^:", "torch index_put (1 thread)"))
    for key, style, label in series:
        med = [p[key] for p in pts]
        err = [[m - a[key] for m, a in zip(med, lo)], [b[key] - m for m, b in zip(med, hi)]]
        ax.errorbar(xs, med, yerr=err, fmt=style, capsize=3, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("tokens written per call")
    ax.set_ylabel("GB/s (K+V float32 read + float16 written)")
    ax.set_title("Paged KV write, 8 KV heads x 128 dims, block size 16"
                 + (f"\n{stamp}" if stamp else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def rows(r):
    """The lines of ``python -m kvcore bench``'s table for this benchmark:
    ``(benchmark, kvcore, baseline, speedup)`` cells, formatted."""
    out = []
    for p in r["points"]:
        label = f"paged write {p['tokens']} tok, bandwidth"
        out.append((label, f"{p['kvcore_gb_s']:.2f} GB/s",
                    f"{p['numpy_gb_s']:.2f} GB/s (NumPy)", ratio_text(p["ratio_numpy"])))
        if "ratio_torch" in p:
            out.append(("", "", f"{p['torch_gb_s']:.2f} GB/s (torch)",
                        ratio_text(p["ratio_torch"])))
    return out
