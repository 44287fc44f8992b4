"""Attention over the pages: ``kvcore.paged_attention`` against its baselines.

Shape: 32 query heads, 8 KV heads, head_dim 128, float16 pages of 16
positions, shuffled block tables.  Every number is measured in the same run:

- decode (one query per sequence), contexts 512 / 4096 / 16384, batch 1
  and 8: GB/s of KV read (K and V bytes of the context / time), against
  a streaming read of the same number of bytes (``numpy.sum`` of a
  float32 array), torch ``scaled_dot_product_attention(enable_gqa=True)``
  in float32 and bfloat16 on contiguous tensors, and a gather of the pages
  to float32 followed by ``numpy.einsum``;
- causal prefill of 512 / 2048 tokens: GFLOP/s (4 * n^2 / 2 * head_dim *
  heads flops) against torch float32 and bfloat16 SDPA;
- one thread against two, for decode batch 8 and prefill 2048;
- decode out of the caches per page dtype (float16, float8_e4m3fn, int8)
  and thread count (1, 2), for 32/8 heads d128 and SmolLM2's 9/3 heads d64:
  positions/s, GB/s of pages and the fraction of a ``numpy.sum`` stream
  read of 256 MiB, alternated with the calls in one process (quick: a few
  times the L3; full: hundreds of MB of pages), and of a ``numpy.max`` of
  the same array (its SIMD reduction reads near what the memory gives one
  core; ``numpy.sum``'s pairwise float32 sum is itself the limit on some
  AVX-512 cores);
- the demo's kvcore loop (``python -m kvcore demo``'s default workload)
  with attention over the pages (``--attention paged``) against the gather
  path (``--attention gather``): tokens/s of the whole loop and of its pure
  decode steps, the two loops alternated, median [min-max] of the repeats.

Each time is the median over repeats of the wall time, printed with the
fastest and slowest repeat as ``median [min-max]``; GB/s, GFLOP/s and
ratios use the medians of the same run.
torch is optional (``pip install torch``, CPU build); without it the torch
columns are left out with a note.
"""
import contextlib
import math
import os
import statistics
import time

import numpy as np

import kvcore

from ._timing import ratio_text, timed

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = "float16"


def _time(r, key, fn, budget=1.0, repeat_min=3):
    """Seconds per call of ``fn()`` (one warm-up call, at least
    ``repeat_min`` repeats, then until ``budget`` seconds are spent, at most
    50): ``r[key]`` gets the median, ``r[key + "_range"]`` the ``[min, max]``.
    Returns the median."""
    return timed(r, key, fn, repeat=repeat_min, warmup=1, budget=budget, repeat_max=50)


def _torch():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    return torch, F


def _fill(a, rng):
    """Random finite values in ``a`` (a tiled random chunk: cheap for GBs)."""
    flat = a.reshape(-1)
    chunk = rng.standard_normal(min(flat.size, 1 << 20)).astype(np.float32)
    if a.dtype == np.float16:
        chunk = chunk.astype(np.float16)
    elif a.dtype == np.uint16:   # bfloat16 bits
        chunk = kvcore.to_bfloat16(chunk)
    reps = -(-flat.size // chunk.size)
    flat[...] = np.tile(chunk, reps)[:flat.size]


def _decode_setup(ctx, batch, rng, dtype=DTYPE):
    nblk = ctx // BLOCK_SIZE
    pool = kvcore.BlockPool(nblk * batch, BLOCK_SIZE, 1, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    _fill(pool.storage, rng)
    tables = rng.permutation(nblk * batch).astype(np.int32).reshape(batch, nblk)
    lens = np.full(batch, ctx, np.int64)
    q = rng.standard_normal((batch, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    return pool, tables, lens, q


def _numpy_attention(pool, tables, lens, q):
    """The gather path: each sequence's pages to a contiguous float32
    copy, then scores, softmax and output with ``numpy.einsum`` (no BLAS,
    so one thread whatever NumPy's BLAS is set to)."""
    g = NUM_HEADS // NUM_KV_HEADS
    out = np.empty_like(q)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    for s in range(len(lens)):
        k, v = pool.gather(0, tables[s], 0, int(lens[s]), dtype="float32")  # (kvh, L, D)
        qs = q[s].reshape(NUM_KV_HEADS, g, HEAD_DIM)
        scores = np.einsum("hgd,hld->hgl", qs, k) * scale
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[s] = np.einsum("hgl,hld->hgd", scores, v).reshape(NUM_HEADS, HEAD_DIM)
    return out


def _with_threads(n, torch):
    kvcore.set_num_threads(n)
    if torch is not None:
        torch.set_num_threads(n)


def bench_decode(ctx, batch, rng, budget, torch=None, F=None, threads=(1,)):
    pool, tables, lens, q = _decode_setup(ctx, batch, rng)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * pool.key_cache(0).itemsize
    out = np.empty_like(q)
    r = {"context": ctx, "batch": batch, "kv_bytes": kv_bytes}
    _with_threads(1, torch)
    stream = np.ones(kv_bytes // 4, np.float32)
    _time(r, "stream_s", lambda: stream.sum(), budget / 4)
    del stream
    for n in threads:
        _with_threads(n, torch)
        _time(r, f"kvcore_{n}t_s",
              lambda: kvcore.paged_attention(q, pool, 0, tables, lens, out=out), budget)
    _with_threads(1, torch)
    _time(r, "numpy_s", lambda: _numpy_attention(pool, tables, lens, q), budget / 2)
    want = _numpy_attention(pool, tables, lens, q)
    got = kvcore.paged_attention(q, pool, 0, tables, lens)
    r["max_rel_diff_vs_numpy"] = float(np.abs(got - want).max() / np.abs(want).max())
    if torch is not None:
        k, v = pool.gather_batch(0, tables, lens, dtype="float32")   # (B, kvh, L, D)
        tk, tv = torch.from_numpy(k), torch.from_numpy(v)
        tq = torch.from_numpy(q).reshape(batch, NUM_HEADS, 1, HEAD_DIM)
        del k, v
        with torch.inference_mode():
            _time(r, "torch_f32_s",
                  lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True), budget / 2)
            bk, bv, bq = tk.bfloat16(), tv.bfloat16(), tq.bfloat16()
            del tk, tv
            _time(r, "torch_bf16_s",
                  lambda: F.scaled_dot_product_attention(bq, bk, bv, enable_gqa=True), budget / 2)
    t1 = r["kvcore_1t_s"]
    r["kvcore_GBps"] = kv_bytes / t1 / 1e9
    r["stream_GBps"] = kv_bytes / r["stream_s"] / 1e9
    r["fraction_of_stream"] = r["stream_s"] / t1
    r["speedup_vs_numpy"] = r["numpy_s"] / t1
    if torch is not None:
        r["speedup_vs_torch_f32"] = r["torch_f32_s"] / t1
        r["speedup_vs_torch_bf16"] = r["torch_bf16_s"] / t1
    if 2 in threads:
        r["speedup_2t_vs_1t"] = t1 / r["kvcore_2t_s"]
    return r


def bench_page_dtypes(ctx, rng, budget):
    """Decode of one sequence over float32, float16 and bfloat16 pages:
    nanoseconds per (position, KV head), i.e. per K row and V row read."""
    r = {}
    for dtype in ("float32", "float16", "bfloat16"):
        pool, tables, lens, q = _decode_setup(ctx, 1, rng, dtype)
        out = np.empty_like(q)
        kvcore.set_num_threads(1)
        tr = {}
        t = _time(tr, "s", lambda: kvcore.paged_attention(q, pool, 0, tables, lens, out=out),
                  budget)
        r[dtype] = {"seconds": t, "seconds_range": tr["s_range"],
                    "ns_per_row": t * 1e9 / (ctx * NUM_KV_HEADS),
                    "GBps": 2 * ctx * NUM_KV_HEADS * HEAD_DIM * pool.key_cache(0).itemsize
                    / t / 1e9}
    return r


#: a small real model's attention (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64)
SMOLLM2_SHAPE = (9, 3, 64)

#: out-of-cache decode rows: page dtypes, thread counts, and (name, shape,
#: batch, context) per size; "full" are the sizes of hundreds of MB the
#: goals are stated at (float16: 537 and 201 MB of pages), "quick" ones
#: still several times a 32 MiB L3
PAGE_DTYPES = ("float16", "float8_e4m3fn", "int8")
PAGE_THREADS = (1, 2)
PAGE_SHAPES = {
    "quick": (("32/8 d128", (32, 8, 128), 4, 4096), ("9/3 d64", SMOLLM2_SHAPE, 4, 8192)),
    "full": (("32/8 d128", (32, 8, 128), 8, 16384), ("9/3 d64", SMOLLM2_SHAPE, 8, 32768)),
}
#: one long sequence (batch 1), split over the threads: the page rows only
#: (the thread goal is stated at 65536 positions)
LONG_SHAPES = {
    "quick": (("32/8 d128, one sequence", (32, 8, 128), 1, 16384),),
    "full": (("32/8 d128, one sequence", (32, 8, 128), 1, 65536),
             ("9/3 d64, one sequence", SMOLLM2_SHAPE, 1, 65536)),
}
STREAM_BYTES = 256 << 20


def _page_pool(dtype, blocks, kv_heads, dim, rng, chunk=64):
    """A pool of ``blocks`` blocks of ``dtype`` whose pages hold real
    conversions of random K/V: ``chunk`` blocks written through
    ``BlockPool.write`` (scales included), then copied over the rest."""
    pool = kvcore.BlockPool(blocks, BLOCK_SIZE, 1, kv_heads, dim, dtype=dtype)
    n = min(chunk, blocks)
    tokens = n * BLOCK_SIZE
    k = rng.standard_normal((tokens, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((tokens, kv_heads, dim)).astype(np.float32)
    pool.write(0, k, v, np.arange(tokens, dtype=np.int64))
    for plane in (pool.storage, pool.scales):
        if plane is None:
            continue
        for start in range(n, blocks, n):
            m = min(n, blocks - start)
            plane[:, start:start + m] = plane[:, :m]
    return pool


def bench_page_rows(rng, big=False, rounds=7):
    """Decode out of the caches per page dtype and thread count, for the
    shapes of :data:`PAGE_SHAPES` and :data:`LONG_SHAPES`: every call of every (dtype, threads) row
    and a ``numpy.sum`` of :data:`STREAM_BYTES` (float32) alternated in
    ``rounds`` rounds, in one process.  Per row: seconds (median and
    [min-max]), positions/s, GB/s of pages read (K and V, int8 scales
    included), that GB/s as a fraction of the stream read's and of a
    ``numpy.max`` read's (timed beside it), and the positions/s against
    float16's at the same thread count."""
    out = {}
    stream = np.ones(STREAM_BYTES // 4, np.float32)
    before = kvcore.set_num_threads(1)   # (the setting before: restored after)
    try:
        size = "full" if big else "quick"
        for name, (heads, kv_heads, dim), batch, ctx in PAGE_SHAPES[size] + LONG_SHAPES[size]:
            nblk = ctx // BLOCK_SIZE
            pools = {d: _page_pool(d, nblk * batch, kv_heads, dim, rng) for d in PAGE_DTYPES}
            tables = rng.permutation(nblk * batch).astype(np.int32).reshape(batch, nblk)
            lens = np.full(batch, ctx, np.int64)
            q = rng.standard_normal((batch, heads, dim)).astype(np.float32)
            outq = np.empty_like(q)
            times = {(d, t): [] for d in PAGE_DTYPES for t in PAGE_THREADS}
            streams, maxes = [], []
            for d, t in times:   # warm-up (and the plans' first use)
                kvcore.set_num_threads(t)
                kvcore.paged_attention(q, pools[d], 0, tables, lens, out=outq)
            stream.sum()
            for _ in range(rounds):
                for (d, t), ts in times.items():
                    kvcore.set_num_threads(t)
                    t0 = time.perf_counter()
                    kvcore.paged_attention(q, pools[d], 0, tables, lens, out=outq)
                    ts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                stream.sum()
                streams.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                stream.max()
                maxes.append(time.perf_counter() - t0)
            stream_gbps = STREAM_BYTES / statistics.median(streams) / 1e9
            max_gbps = STREAM_BYTES / statistics.median(maxes) / 1e9
            rows = {}
            for (d, t), ts in times.items():
                med = statistics.median(ts)
                nbytes = batch * ctx * pools[d].bytes_per_token
                rows[f"{d}_{t}t"] = {
                    "dtype": d, "threads": t, "s": med, "s_range": [min(ts), max(ts)],
                    "positions_per_s": batch * ctx / med, "GBps": nbytes / med / 1e9,
                    "fraction_of_stream": nbytes / med / 1e9 / stream_gbps,
                    "fraction_of_max_read": nbytes / med / 1e9 / max_gbps,
                    "page_bytes": nbytes}
            for r in rows.values():
                f16 = rows[f"float16_{r['threads']}t"]
                r["positions_vs_float16"] = f16["s"] / r["s"]
                one = rows[f"{r['dtype']}_1t"]
                r["vs_1_thread"] = one["s"] / r["s"]
            out[name] = {"shape": [heads, kv_heads, dim], "batch": batch, "context": ctx,
                         "stream_GBps": stream_gbps,
                         "stream_s_range": [min(streams), max(streams)],
                         "max_read_GBps": max_gbps, "rows": rows}
            del pools
    finally:
        kvcore.set_num_threads(before)
    return out


def page_report(res):
    """The lines of :func:`bench_page_rows`' table."""
    lines = ["decode out of the caches, by page dtype and threads (positions/s, GB/s of pages, "
             "fraction of a numpy.sum stream read and of a numpy.max read in the same run, "
             "positions/s vs float16)"]
    for name, r in res.items():
        lines.append(f"  {name} ({r['shape'][0]}/{r['shape'][1]} heads, d{r['shape'][2]}), "
                     f"{r['batch']} x {r['context']}, stream read {r['stream_GBps']:.1f} GB/s, "
                     f"max read {r['max_read_GBps']:.1f} GB/s")
        for row in r["rows"].values():
            lo, hi = row["s_range"]
            lines.append(
                f"    {row['dtype']:14s} {row['threads']} thr  {row['s'] * 1e3:8.2f} ms "
                f"[{lo * 1e3:.2f}-{hi * 1e3:.2f}]  {row['positions_per_s'] / 1e6:6.2f} M pos/s "
                f"{row['GBps']:6.1f} GB/s  {row['fraction_of_stream']:5.2f} of stream  "
                f"{row['fraction_of_max_read']:5.2f} of max read  "
                f"{row['positions_vs_float16']:5.2f}x float16  {row['vs_1_thread']:5.2f}x 1 thr")
    return "\n".join(lines)


def bench_prefill(n, rng, budget, torch=None, F=None, threads=(1,),
                  shape=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    """Causal prefill of ``n`` tokens, ``shape`` = (query heads, KV heads,
    head_dim), against torch SDPA in float32 and bfloat16."""
    heads, kv_heads, dim = shape
    blocks = -(-n // BLOCK_SIZE)
    pool = kvcore.BlockPool(blocks, BLOCK_SIZE, 1, kv_heads, dim, dtype=DTYPE)
    _fill(pool.storage, rng)
    tables = rng.permutation(blocks).astype(np.int32).reshape(1, blocks)
    lens = np.array([n], np.int64)
    qsl = np.array([0, n], np.int64)
    q = rng.standard_normal((n, heads, dim)).astype(np.float32)
    out = np.empty_like(q)
    flops = 4.0 * n * n / 2 * dim * heads
    r = {"tokens": n, "flops": flops, "shape": list(shape)}
    for t in threads:
        _with_threads(t, torch)
        _time(r, f"kvcore_{t}t_s",
              lambda: kvcore.paged_attention(q, pool, 0, tables, lens, qsl, out=out), budget,
              repeat_min=2)
    _with_threads(1, torch)
    if torch is not None:
        k, v = pool.gather(0, tables[0], 0, n, dtype="float32")
        tk = torch.from_numpy(k)[None]
        tv = torch.from_numpy(v)[None]
        tq = torch.from_numpy(q).permute(1, 0, 2)[None].contiguous()
        with torch.inference_mode():
            _time(r, "torch_f32_s", lambda: F.scaled_dot_product_attention(
                tq, tk, tv, is_causal=True, enable_gqa=True), budget, repeat_min=2)
            bq, bk, bv = tq.bfloat16(), tk.bfloat16(), tv.bfloat16()
            _time(r, "torch_bf16_s", lambda: F.scaled_dot_product_attention(
                bq, bk, bv, is_causal=True, enable_gqa=True), budget, repeat_min=2)
            ref = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
        got = kvcore.paged_attention(q, pool, 0, tables, lens, qsl)
        want = ref[0].permute(1, 0, 2).numpy()
        r["max_rel_diff_vs_torch_f32"] = float(np.abs(got - want).max() / np.abs(want).max())
    t1 = r["kvcore_1t_s"]
    r["kvcore_GFLOPps"] = flops / t1 / 1e9
    if torch is not None:
        r["torch_f32_GFLOPps"] = flops / r["torch_f32_s"] / 1e9
        r["speedup_vs_torch_f32"] = r["torch_f32_s"] / t1
        r["speedup_vs_torch_bf16"] = r["torch_bf16_s"] / t1
    if 2 in threads:
        r["speedup_2t_vs_1t"] = t1 / r["kvcore_2t_s"]
    return r


def run_prefill_shapes(quick=False, seed=0):
    """Causal prefill only, for the default shape and SmolLM2's
    (``python bench/bench_attention.py --only-prefill``): 1024 and 4096
    tokens, where a KV head's K and V leave the L2 cache."""
    with _session(quick, seed) as (torch, F, rng, budget, res):
        for name, shape in (("", (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)),
                            ("smollm2_", SMOLLM2_SHAPE)):
            for n in ([256] if quick else [1024, 4096]):
                res["prefill"][f"{name}n{n}"] = bench_prefill(n, rng, budget, torch, F,
                                                              shape=shape)
    return res


def bench_demo(repeat):
    """The demo's kvcore loop, paged attention against the gather path,
    alternated ``repeat`` times; both must pick the same tokens."""
    from .. import demo

    samples = {"paged": [], "gather": []}
    tokens = {}
    for _ in range(repeat):
        for mode in samples:
            r = demo.time_kvcore_loop(attention=mode)
            samples[mode].append(r)
            tokens[mode] = r["tokens"]
    if tokens["paged"] != tokens["gather"]:
        raise RuntimeError("the demo's paged and gather loops generated different tokens")
    res = {}
    for key in ("tokens_per_s", "decode_tokens_per_s"):
        for mode, runs in samples.items():
            vals = [r[key] for r in runs]
            res[f"{mode}_{key}"] = statistics.median(vals)
            res[f"{mode}_{key}_range"] = [min(vals), max(vals)]
        res[f"{key}_paged_vs_gather"] = res[f"paged_{key}"] / res[f"gather_{key}"]
    return res


@contextlib.contextmanager
def _session(quick, seed):
    """``(torch, F, rng, budget, res)`` for one benchmark run: the result
    dict started, and kvcore's and torch's thread counts put back after."""
    torch, F = _torch()
    rng = np.random.default_rng(seed)
    threads_before = kvcore.set_num_threads(1)   # (restored after)
    torch_threads = torch.get_num_threads() if torch is not None else None
    res = {"shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
                     "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": DTYPE},
           "torch": torch.__version__ if torch is not None else None,
           "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count(),
           "decode": {}, "prefill": {}}
    try:
        yield torch, F, rng, 0.2 if quick else 1.5, res
    finally:
        kvcore.set_num_threads(threads_before)
        if torch is not None:
            torch.set_num_threads(torch_threads)


def run(quick=False, seed=0, full=None):
    """All measurements, as a dict (see the module docstring).  ``full``:
    the out-of-cache page rows at their big sizes (default: when not
    ``quick``, as ``python -m kvcore bench --full`` runs it)."""
    with _session(quick, seed) as (torch, F, rng, budget, res):
        decode = [(512, 1), (4096, 8)] if quick else \
            [(512, 1), (512, 8), (4096, 1), (4096, 8), (16384, 1), (16384, 8)]
        for ctx, batch in decode:
            threads = (1, 2) if batch == 8 else (1,)
            res["decode"][f"ctx{ctx}_b{batch}"] = bench_decode(ctx, batch, rng, budget, torch, F,
                                                               threads)
        if not quick:
            res["page_dtypes"] = bench_page_dtypes(4096, rng, budget)
        for n in ([512] if quick else [512, 2048]):
            threads = (1, 2) if n == 2048 or quick else (1,)
            res["prefill"][f"n{n}"] = bench_prefill(n, rng, budget, torch, F, threads)
        _with_threads(1, torch)
        res["demo"] = bench_demo(1 if quick else 3)
        # last: the gigabytes these rows allocate and free change where the
        # allocator puts later arrays, so the rows above run first
        res["pages"] = bench_page_rows(rng, big=(not quick) if full is None else full,
                                       rounds=5 if quick else 9)
    return res


def _f(x, spec):
    """``x`` formatted, or a dash as wide as the spec's width for None."""
    width = spec.split(".")[0]
    return ("-".rjust(int(width)) if width.isdigit() else "-") if x is None else format(x, spec)


def _spread(r, key, unit_scale, spec):
    """``median [min-max]`` of the time ``r[key]`` (seconds times ``unit_scale``)."""
    lo, hi = r[key + "_range"]
    return (f"{format(r[key] * unit_scale, spec)} "
            f"[{format(lo * unit_scale, spec)}-{format(hi * unit_scale, spec)}]")


def report(res):
    lines = [f"paged_attention: {res['shape']['num_heads']} q heads, "
             f"{res['shape']['num_kv_heads']} kv heads, head_dim {res['shape']['head_dim']}, "
             f"{res['shape']['dtype']} pages of {res['shape']['block_size']}; one thread unless "
             f"noted; torch {res['torch'] or 'not installed'}; times are median [min-max] of "
             "repeats, GB/s and ratios from the medians"]
    if res["decode"]:
        lines.append("")
        lines.append(f"{'decode':12s} {'kvcore ms':>23s}  GB/s  stream GB/s  of stream  "
                     "x torch f32  x torch bf16  x gather+numpy  2 threads")
    for name, r in res["decode"].items():
        lines.append(
            f"{name:12s} {_spread(r, 'kvcore_1t_s', 1e3, '.3f'):>23s} {r['kvcore_GBps']:5.1f} "
            f"{r['stream_GBps']:12.1f} {r['fraction_of_stream']:10.0%} "
            f"{_f(r.get('speedup_vs_torch_f32'), '12.1f')} "
            f"{_f(r.get('speedup_vs_torch_bf16'), '13.1f')} {r['speedup_vs_numpy']:15.1f} "
            f"{_f(r.get('speedup_2t_vs_1t'), '10.2f')}")
    if "page_dtypes" in res:
        lines.append("")
        lines.append("decode, context 4096, batch 1, by page dtype: ns per (position, kv head)")
        lines.append("  " + "  ".join(f"{k} {v['ns_per_row']:.0f} ns ({v['GBps']:.1f} GB/s)"
                                       for k, v in res["page_dtypes"].items()))
    lines.append("")
    lines.append(f"{'prefill':15s} {'kvcore ms':>23s}  GFLOP/s  torch f32 GFLOP/s  x torch f32  "
                 "x torch bf16  2 threads")
    for name, r in res["prefill"].items():
        if "shape" in r and tuple(r["shape"]) != (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM):
            name += " ({}/{} heads, d={})".format(*r["shape"])
        lines.append(
            f"{name:15s} {_spread(r, 'kvcore_1t_s', 1e3, '.1f'):>23s} {r['kvcore_GFLOPps']:8.1f} "
            f"{_f(r.get('torch_f32_GFLOPps'), '18.1f')} "
            f"{_f(r.get('speedup_vs_torch_f32'), '12.2f')} "
            f"{_f(r.get('speedup_vs_torch_bf16'), '13.2f')} "
            f"{_f(r.get('speedup_2t_vs_1t'), '10.2f')}")
    if res.get("pages"):
        lines.append("")
        lines.append(page_report(res["pages"]))
    if "demo" in res:
        d = res["demo"]
        lines.append("")
        lines.append("demo (python -m kvcore demo, kvcore loop): tokens/s, attention over the "
                     "pages vs gather + NumPy")
        for key, what in (("tokens_per_s", "whole loop"), ("decode_tokens_per_s",
                                                           "decode steps")):
            lines.append(f"  {what:12s} paged {_spread(d, 'paged_' + key, 1, '.1f')}  gather "
                         f"{_spread(d, 'gather_' + key, 1, '.1f')}  "
                         f"{d[key + '_paged_vs_gather']:.2f}x")
    return "\n".join(lines)


def rows(res):
    """The lines of ``python -m kvcore bench``'s table: decode against a
    stream read, torch SDPA (float32 and bfloat16) and gather + NumPy; prefill
    against torch SDPA; the demo's attention over the pages against gather."""
    out = []
    for name, r in res["decode"].items():
        label = f"attention decode ctx {r['context']} x batch {r['batch']}"
        t = f"{r['kvcore_1t_s'] * 1e3:.3f} ms"
        out.append((label, t, f"{r['stream_GBps']:.1f} GB/s stream read, kvcore "
                    f"{r['kvcore_GBps']:.1f} GB/s", f"{r['fraction_of_stream']:.2f} of"))
        for key, what in (("torch_f32", "torch SDPA float32"), ("torch_bf16", "torch SDPA "
                                                                 "bfloat16")):
            if f"speedup_vs_{key}" in r:
                out.append(("", "", f"{r[key + '_s'] * 1e3:.3f} ms ({what})",
                            ratio_text(r[f"speedup_vs_{key}"])))
        out.append(("", "", f"{r['numpy_s'] * 1e3:.3f} ms (gather + NumPy)",
                    ratio_text(r["speedup_vs_numpy"])))
        if "speedup_2t_vs_1t" in r:
            out.append(("", "", "kvcore on 2 threads", ratio_text(r["speedup_2t_vs_1t"])))
    for name, r in (res.get("pages") or {}).items():
        for row in r["rows"].values():
            label = (f"attention decode {name} {r['batch']}x{r['context']} "
                     f"{row['dtype']} {row['threads']}t")
            out.append((label, f"{row['positions_per_s'] / 1e6:.2f} M pos/s",
                        f"{row['GBps']:.1f} GB/s, {row['fraction_of_stream']:.2f} of the "
                        f"{r['stream_GBps']:.1f} GB/s stream read",
                        f"{row['positions_vs_float16']:.2f}x f16"))
    for name, r in res["prefill"].items():
        label = f"attention causal prefill {r['tokens']} tok"
        t = f"{r['kvcore_1t_s'] * 1e3:.1f} ms, {r['kvcore_GFLOPps']:.1f} GFLOP/s"
        first = True
        for key, what in (("torch_f32", "torch SDPA float32"), ("torch_bf16", "torch SDPA "
                                                                 "bfloat16")):
            if f"speedup_vs_{key}" in r:
                out.append((label if first else "", t if first else "",
                            f"{r[key + '_s'] * 1e3:.1f} ms ({what})",
                            ratio_text(r[f"speedup_vs_{key}"])))
                first = False
        if first:
            out.append((label, t, "(torch not installed)", ""))
        if "speedup_2t_vs_1t" in r:
            out.append(("", "", "kvcore on 2 threads", ratio_text(r["speedup_2t_vs_1t"])))
    if "demo" in res:
        d = res["demo"]
        out.append(("demo loop, attention over the pages", f"{d['paged_tokens_per_s']:.1f} tok/s",
                     f"{d['gather_tokens_per_s']:.1f} tok/s (gather + NumPy)",
                     f"{d['tokens_per_s_paged_vs_gather']:.2f}x"))
    return out


def plot(res, path, spread=None, stamp=None):
    """Draw the decode and prefill times of kvcore and its baselines as
    grouped bars (log scale) into ``path``, with the [min-max] ``spread``
    (``(min_result, max_result)``) as error bars; ``stamp`` names the mode,
    CPU and SIMD level.  Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [("decode", k) for k in res["decode"]] + [("prefill", k) for k in res["prefill"]]
    series = (("kvcore_1t_s", "kvcore"), ("torch_f32_s", "torch SDPA f32"),
              ("torch_bf16_s", "torch SDPA bf16"), ("numpy_s", "gather + NumPy"))
    lo = spread[0] if spread else res
    hi = spread[1] if spread else res
    fig, ax = plt.subplots(figsize=(9.0, 4.8))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        xs, med, err_lo, err_hi = [], [], [], []
        for j, (part, name) in enumerate(cases):
            r = res[part][name]
            if key not in r:
                continue
            xs.append(j + (i - (len(series) - 1) / 2) * width)
            med.append(r[key] * 1e3)
            err_lo.append((r[key] - lo[part][name][key]) * 1e3)
            err_hi.append((hi[part][name][key] - r[key]) * 1e3)
        if xs:
            ax.bar(xs, med, width, yerr=[err_lo, err_hi], capsize=2, label=label)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{part}\n{name}" for part, name in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (median, [min-max])")
    ax.set_title("paged_attention, 32 q / 8 KV heads, head_dim 128, float16 pages, one thread"
                 + (f"\n{stamp}" if stamp else ""), fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
