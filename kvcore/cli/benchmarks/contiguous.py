"""kvcore.KVCache writes against NumPy slice assignment (the NumPy seed's way).

Two workloads, float32 input into float16 storage:

* decode step: one new position in each of 32 layers (batch 8, 8 KV heads,
  head_dim 128): 32 ``update`` calls, K and V each;
* prompt write: 2048 positions in each of 32 layers, batch 1, 8 KV heads,
  head_dim 128 (one K and one V input of 8 MiB each are reused for every
  layer, so the inputs fit in memory; the cache is 256 MiB).

The NumPy baselines write preallocated per-layer ``numpy.float16`` arrays of
the same shape, as the NumPy seed does:
``cache[:, :, pos:pos+n] = k.astype(np.float16)`` ("astype") and
``cache[:, :, pos:pos+n] = k`` ("implicit", NumPy casts while assigning).

Each timed repetition is one whole step (all layers); reported figures are
medians.  Run ``python bench/bench_contiguous.py [--quick]``.
"""

import numpy as np

import kvcore
from ._timing import median_time, ratio_text

LAYERS, HEADS, DIM = 32, 8, 128
DECODE_BATCH, DECODE_MAX_SEQ = 8, 128
PROMPT_BATCH, PROMPT_LEN = 1, 2048


def _median_ms(fn, reps, before=None):
    """Median wall time of ``fn()`` over ``reps`` runs after one warm-up run
    (which also faults in the pages of freshly allocated buffers)."""
    return median_time(fn, repeat=reps, warmup=1, before=before) * 1e3


def _decode(reps):
    rng = np.random.default_rng(0)
    shape = (DECODE_BATCH, HEADS, 1, DIM)
    ks = [rng.standard_normal(shape, np.float32) for _ in range(LAYERS)]
    vs = [rng.standard_normal(shape, np.float32) for _ in range(LAYERS)]
    cache = kvcore.KVCache(LAYERS, HEADS, DIM, DECODE_MAX_SEQ, batch_size=DECODE_BATCH,
                           dtype="float16")
    full = (DECODE_BATCH, HEADS, DECODE_MAX_SEQ, DIM)
    np_k = [np.zeros(full, np.float16) for _ in range(LAYERS)]
    np_v = [np.zeros(full, np.float16) for _ in range(LAYERS)]
    pos = [0]

    def wrap_kvcore():
        if cache.seq_len == DECODE_MAX_SEQ:
            cache.reset()

    def step_kvcore():
        for layer in range(LAYERS):
            cache.update(layer, ks[layer], vs[layer])

    def wrap_numpy():
        pos[0] = (pos[0] + 1) % DECODE_MAX_SEQ

    def step_astype():
        p = pos[0]
        for layer in range(LAYERS):
            np_k[layer][:, :, p:p + 1] = ks[layer].astype(np.float16)
            np_v[layer][:, :, p:p + 1] = vs[layer].astype(np.float16)

    def step_implicit():
        p = pos[0]
        for layer in range(LAYERS):
            np_k[layer][:, :, p:p + 1] = ks[layer]
            np_v[layer][:, :, p:p + 1] = vs[layer]

    out = {
        "kvcore_ms": _median_ms(step_kvcore, reps, wrap_kvcore),
        "numpy_astype_ms": _median_ms(step_astype, reps, wrap_numpy),
        "numpy_implicit_ms": _median_ms(step_implicit, reps, wrap_numpy),
    }
    # Same bits as NumPy's cast (the last step wrote position seq_len - 1).
    p = cache.seq_len - 1
    np_k[0][:, :, p:p + 1] = ks[0].astype(np.float16)
    assert np.array_equal(cache.get(0, p, p + 1)[0].view(np.uint16),
                          np_k[0][:, :, p:p + 1].view(np.uint16))
    return out


def _prompt(reps):
    rng = np.random.default_rng(1)
    shape = (PROMPT_BATCH, HEADS, PROMPT_LEN, DIM)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    cache = kvcore.KVCache(LAYERS, HEADS, DIM, PROMPT_LEN, batch_size=PROMPT_BATCH,
                           dtype="float16")
    np_k = [np.zeros(shape, np.float16) for _ in range(LAYERS)]
    np_v = [np.zeros(shape, np.float16) for _ in range(LAYERS)]
    n = PROMPT_LEN

    def write_kvcore():
        for layer in range(LAYERS):
            cache.update(layer, k, v)

    def write_astype():
        for layer in range(LAYERS):
            np_k[layer][:, :, 0:n] = k.astype(np.float16)
            np_v[layer][:, :, 0:n] = v.astype(np.float16)

    def write_implicit():
        for layer in range(LAYERS):
            np_k[layer][:, :, 0:n] = k
            np_v[layer][:, :, 0:n] = v

    out = {
        "kvcore_ms": _median_ms(write_kvcore, reps, cache.reset),
        "numpy_astype_ms": _median_ms(write_astype, reps),
        "numpy_implicit_ms": _median_ms(write_implicit, reps),
    }
    assert np.array_equal(cache.get(LAYERS - 1)[1].view(np.uint16), np_v[-1].view(np.uint16))
    return out


def run(quick=False):
    """Time both workloads; return the medians (ms) and kvcore's speedups.

    Parameters
    ----------
    quick : bool
        Fewer repetitions (a smoke run, e.g. in CI).

    Returns
    -------
    dict
        ``{"decode": {...}, "prompt": {...}, "config": {...}}``; each
        workload has ``kvcore_ms``, ``numpy_astype_ms``,
        ``numpy_implicit_ms``, ``speedup_vs_astype`` and
        ``speedup_vs_implicit`` (NumPy time / kvcore time).
    """
    results = {
        "decode": _decode(30 if quick else 300),
        "prompt": _prompt(2 if quick else 7),
    }
    for r in results.values():
        r["speedup_vs_astype"] = r["numpy_astype_ms"] / r["kvcore_ms"]
        r["speedup_vs_implicit"] = r["numpy_implicit_ms"] / r["kvcore_ms"]
    from kvcore.backends.cpu import _convert

    results["config"] = {
        "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM,
        "decode_batch": DECODE_BATCH, "prompt_batch": PROMPT_BATCH,
        "prompt_len": PROMPT_LEN, "input": "float32", "storage": "float16",
        "simd": _convert.get_simd_level(), "numpy": np.__version__, "quick": quick,
    }
    return results


def report(res):
    """The results of :func:`run` as a short table."""
    cfg = res["config"]
    lines = [f"float32 -> float16, {cfg['layers']} layers, {cfg['kv_heads']} KV heads, "
             f"head_dim {cfg['head_dim']}, SIMD {cfg['simd']}, NumPy {cfg['numpy']}",
             f"{'workload':<34}{'kvcore':>10}{'np astype':>11}{'np implicit':>13}"
             f"{'x astype':>10}{'x implicit':>12}"]
    labels = {"decode": f"decode step (batch {cfg['decode_batch']}, 1 token)",
              "prompt": f"prompt write (batch {cfg['prompt_batch']}, {cfg['prompt_len']} tok)"}
    for key, label in labels.items():
        r = res[key]
        lines.append(f"{label:<34}{r['kvcore_ms']:>8.3f}ms{r['numpy_astype_ms']:>9.3f}ms"
                     f"{r['numpy_implicit_ms']:>11.3f}ms{r['speedup_vs_astype']:>9.1f}x"
                     f"{r['speedup_vs_implicit']:>11.1f}x")
    return "\n".join(lines)


def rows(r):
    """The lines of ``python -m kvcore bench``'s table for this benchmark:
    ``(benchmark, kvcore, baseline, speedup)`` cells, formatted."""
    rows = []
    labels = {"decode": "KVCache decode step, 32 layers", "prompt": "KVCache prompt write 2048 tok"}
    for key, label in labels.items():
        w = r[key]
        rows.append((label, f"{w['kvcore_ms']:.3f} ms",
                     f"{w['numpy_astype_ms']:.3f} ms (NumPy slice = astype)",
                     ratio_text(w["speedup_vs_astype"])))
        rows.append(("", "", f"{w['numpy_implicit_ms']:.3f} ms (NumPy slice, implicit cast)",
                     ratio_text(w["speedup_vs_implicit"])))
    return rows
