"""Attention over the pages against torch SDPA, gather + NumPy and a
streaming read (see kvcore/cli/benchmarks/attention.py), plus the per-layer
overhead of ``AttentionPlan.run`` for a batch-1 decode (context 4096):
python bench/bench_attention.py [--quick] [--full] [--json FILE]
                                [--only-plan | --only-prefill | --only-pages |
                                 --only-ceilings | --only-alignment]

--full: the out-of-cache decode rows per page dtype and thread count at
their big sizes (hundreds of MB of pages: 8 x 16384 positions at 32/8
heads d128, 8 x 32768 at 9/3 heads d64; and one sequence of 65536 positions
at each, split over the threads); without it, a few times the L3.
--only-pages: those rows only.

--only-ceilings: per page dtype (float16, float8_e4m3fn, float8_e5m2, int8),
the --full (or quick) decode shapes out of the caches and the same shapes over
a context whose pages stay in the caches (6-8 MB of float16 pages), one
thread, timed by the thread's CPU time (what the kernel reaches while it
runs, even on a machine shared with other work), calls alternated over the
dtypes in rounds: the in-cache row is the ceiling a decode of that dtype
reaches when its pages cost nothing to read, against float16 out of cache.

--only-alignment: the same decode shapes (float16, float8_e4m3fn and int8
pages, one thread) over a pool as kvcore places it (on a cache line; a 2 MiB
boundary from 8 MiB up), and over one starting 16 bytes past that, as
``numpy.zeros`` placed it before (every 64-byte load of a page row then
straddles two lines); calls alternated in rounds, thread CPU time.

--only-prefill: causal prefill of 1024 and 4096 tokens only, for the default
shape and SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64).

The overhead is measured against the backend plan's own run (the C plan
over arrays already checked: ``Backend.attention_run``), in interleaved
pairs on the same kernel, so the kernel's time cancels: ``plan.run`` minus
that is what the public per-layer call adds.  ``paged_attention`` (plan +
run in one call) is timed the same way.  Each is printed as median
[min-max] over the pairs, in microseconds."""
import statistics
import sys
import time

import numpy as np

import kvcore
from kvcore import dtypes
from kvcore.backends import CPU
from kvcore.cli.benchmarks import attention
from kvcore.cli.benchmarks._timing import script_main

CONTEXT = 4096


def _pairs(first, second, n):
    """Per-pair time differences ``second - first`` and the times of
    ``first``, each pair run back to back (alternating order)."""
    diffs, base = [], []
    for i in range(n):
        order = (first, second) if i % 2 == 0 else (second, first)
        t = []
        for f in order:
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
        a, b = (t[0], t[1]) if i % 2 == 0 else (t[1], t[0])
        diffs.append(b - a)
        base.append(a)
    return diffs, base


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def plan_overhead(quick=False, seed=0, context=CONTEXT):
    """``plan.run`` and ``paged_attention`` against the backend's run of
    the same plan, batch-1 decode over ``context`` positions (float16
    pages, attention.py's head shape), one thread; and the same over a
    16-position context, where the kernel is short and the overhead shows
    with less noise."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim, bs = (attention.NUM_HEADS, attention.NUM_KV_HEADS,
                                attention.HEAD_DIM, attention.BLOCK_SIZE)
    before = kvcore.set_num_threads(1)   # (the setting before: restored after)
    res = {}
    try:
        for ctx in (context, 16):
            nblk = -(-ctx // bs)
            pool = kvcore.BlockPool(nblk + 1, bs, 2, kv_heads, dim, dtype=attention.DTYPE)
            pool.storage[...] = rng.standard_normal(pool.storage.shape).astype(np.float16)
            tables = rng.permutation(nblk + 1)[:nblk][None].astype(np.int32)
            lens = np.array([ctx], np.int64)
            q = rng.standard_normal((1, heads, dim)).astype(np.float32)
            out = np.empty_like(q)
            plan = kvcore.AttentionPlan(pool, tables, lens, num_heads=heads)
            # the backend plan the public one runs, called as attention_run is
            be = CPU
            inner = be.attention_plan(tables, lens, np.array([0, 1], np.int64), num_heads=heads,
                                      num_kv_heads=kv_heads, head_dim=dim, block_size=bs,
                                      num_blocks=nblk + 1, kind=dtypes.storage_kind(pool.dtype),
                                      scale=1 / np.sqrt(dim), sliding_window=0, soft_cap=0.0,
                                      num_threads=1)
            k, v = pool.key_cache(1), pool.value_cache(1)

            def raw():
                be.attention_run(inner, q, out, k, v)

            def run():
                plan.run(q, 1, out)

            def paged():
                kvcore.paged_attention(q, pool, 1, tables, lens, out=out)

            n = 60 if quick else 400
            for f in (raw, run, paged):
                f()
            d_run, base = _pairs(raw, run, n)
            d_paged, _ = _pairs(raw, paged, n if ctx == 16 else n // 4)
            res[f"ctx{ctx}"] = {"kernel_us": _stats([b * 1e6 for b in base]),
                                "run_overhead_us": _stats([d * 1e6 for d in d_run]),
                                "paged_overhead_us": _stats([d * 1e6 for d in d_paged])}
    finally:
        kvcore.set_num_threads(before)
    return res


def _spread(s):
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def plan_report(res):
    lines = ["AttentionPlan.run per layer, batch-1 decode, one thread: time beyond the backend's "
             "run of the same plan (us, median [min-max] over interleaved pairs)"]
    for name, r in res.items():
        lines.append(f"  {name:9s} kernel {_spread(r['kernel_us'])}  plan.run +"
                     f"{_spread(r['run_overhead_us'])}  paged_attention +"
                     f"{_spread(r['paged_overhead_us'])}")
    return "\n".join(lines)


def run(quick=False, seed=0, full=False):
    res = attention.run(quick=quick, seed=seed, full=full)
    res["plan_overhead"] = plan_overhead(quick, seed)
    return res


def run_pages(quick=False, seed=0, full=False):
    return {"pages": attention.bench_page_rows(np.random.default_rng(seed), big=full,
                                               rounds=5 if quick else 9)}


#: page dtypes of the ceilings rows; in-cache contexts per head_dim (the
#: shape's batch: 6-8 MB of float16 pages, well inside a 32 MiB L3)
CEILING_DTYPES = ("float16", "float8_e4m3fn", "float8_e5m2", "int8")
CEILING_WARM_CONTEXT = {128: 256, 64: 1024}


def page_ceilings(quick=False, seed=0, full=False, shapes=None, warm_context=None):
    """Decode positions/s out of the caches and in them per page dtype (see
    the module docstring, --only-ceilings): medians and [min-max] over the
    rounds, each call timed by ``time.thread_time``.  ``shapes``: (name,
    (heads, kv_heads, head_dim), batch, context) rows instead of the
    benchmark's; ``warm_context``: the in-cache context per head_dim."""
    rng = np.random.default_rng(seed)
    rounds = 5 if quick else 9
    if shapes is None:
        shapes = attention.PAGE_SHAPES["full" if full else "quick"]
    warm = CEILING_WARM_CONTEXT if warm_context is None else warm_context
    before = kvcore.set_num_threads(1)   # (the setting before: restored after)
    out = {}
    try:
        for name, (heads, kv_heads, dim), batch, ctx in shapes:
            cases = {}
            for where, b, c in (("cold", batch, ctx),
                                ("cache", batch, warm.get(dim, 256))):
                nblk = c // attention.BLOCK_SIZE
                tables = rng.permutation(nblk * b).astype(np.int32).reshape(b, nblk)
                lens = np.full(b, c, np.int64)
                q = rng.standard_normal((b, heads, dim)).astype(np.float32)
                for d in CEILING_DTYPES:
                    pool = attention._page_pool(d, nblk * b, kv_heads, dim, rng)
                    cases[(d, where)] = (pool, tables, lens, q, np.empty_like(q), b * c)
            times = {key: [] for key in cases}
            for (pool, tables, lens, q, o, _) in cases.values():   # warm-up
                kvcore.paged_attention(q, pool, 0, tables, lens, out=o)
            for _ in range(rounds):
                for key, (pool, tables, lens, q, o, _) in cases.items():
                    reps = 1 if key[1] == "cold" else 8
                    if reps > 1:   # (the calls between evicted the pages: back in)
                        kvcore.paged_attention(q, pool, 0, tables, lens, out=o)
                    t0 = time.thread_time()
                    for _ in range(reps):
                        kvcore.paged_attention(q, pool, 0, tables, lens, out=o)
                    times[key].append((time.thread_time() - t0) / reps)
            rows = {}
            f16 = statistics.median(times[("float16", "cold")]) / cases[("float16", "cold")][5]
            for (d, where), ts in times.items():
                n = cases[(d, where)][5]
                rate = [n / t for t in ts]
                rows[f"{d}_{where}"] = {
                    "dtype": d, "where": where, "positions": n,
                    "positions_per_s": statistics.median(rate),
                    "range": [min(rate), max(rate)],
                    "vs_float16_cold": statistics.median(rate) * f16}
            out[name] = {"shape": [heads, kv_heads, dim], "batch": batch, "context": ctx,
                         "warm_context": warm.get(dim, 256), "rows": rows}
            del cases
    finally:
        kvcore.set_num_threads(before)
    return {"ceilings": out, "levels": kvcore.simd_levels()}


ALIGN_DTYPES = ("float16", "float8_e4m3fn", "int8")


def _zeros_16_past(zeros):
    """``zeros`` (kvcore's ``Backend.zeros``) with its arrays moved 16
    bytes past where it starts them, as ``numpy.zeros`` placed them."""
    def zeros_16_past(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return zeros(self, (nbytes + 16,), np.uint8)[16:].view(dtype).reshape(shape)
    return zeros_16_past


def alignment(quick=False, seed=0, full=False, shapes=None):
    """Decode positions/s over pages on a cache line against 16 bytes past
    one (see the module docstring, --only-alignment); ``shapes`` as
    :func:`page_ceilings` takes them."""
    from kvcore.backends import base
    rng = np.random.default_rng(seed)
    rounds = 5 if quick else 9
    before, kept = kvcore.set_num_threads(1), base.Backend.zeros
    out = {}
    try:
        if shapes is None:
            shapes = attention.PAGE_SHAPES["full" if full else "quick"]
        for name, (heads, kv_heads, dim), batch, ctx in shapes:
            nblk = ctx // attention.BLOCK_SIZE
            tables = rng.permutation(nblk * batch).astype(np.int32).reshape(batch, nblk)
            lens = np.full(batch, ctx, np.int64)
            q = rng.standard_normal((batch, heads, dim)).astype(np.float32)
            o = np.empty_like(q)
            pools = {}
            for d in ALIGN_DTYPES:
                for offset in (0, 16):
                    base.Backend.zeros = kept if offset == 0 else _zeros_16_past(kept)
                    try:
                        pools[(d, offset)] = attention._page_pool(d, nblk * batch, kv_heads,
                                                                  dim, rng)
                    finally:
                        base.Backend.zeros = kept
            times = {key: [] for key in pools}
            for pool in pools.values():   # warm-up
                kvcore.paged_attention(q, pool, 0, tables, lens, out=o)
            for _ in range(rounds):
                for key, pool in pools.items():
                    t0 = time.thread_time()
                    kvcore.paged_attention(q, pool, 0, tables, lens, out=o)
                    times[key].append(time.thread_time() - t0)
            rows = {}
            for d in ALIGN_DTYPES:
                line, off = (statistics.median(times[(d, k)]) for k in (0, 16))
                rows[d] = {"line_s": line, "offset16_s": off, "speedup": off / line,
                           "line_positions_per_s": batch * ctx / line}
            out[name] = {"shape": [heads, kv_heads, dim], "batch": batch, "context": ctx,
                         "rows": rows}
            del pools
    finally:
        base.Backend.zeros = kept
        kvcore.set_num_threads(before)
    return {"alignment": out, "levels": kvcore.simd_levels()}


def alignment_report(res):
    lines = [f"decode over pages on a cache line vs 16 bytes past one, one thread, thread CPU "
             f"time (attention level {res['levels']['attention']})"]
    for name, r in res["alignment"].items():
        lines.append(f"  {name}, {r['batch']} x {r['context']}")
        for d, row in r["rows"].items():
            lines.append(f"    {d:14s} on a line {row['line_s'] * 1e3:8.2f} ms   16 past "
                         f"{row['offset16_s'] * 1e3:8.2f} ms   {row['speedup']:5.3f}x")
    return "\n".join(lines)


def ceilings_report(res):
    lines = [f"decode positions/s by page dtype, out of the caches and in them, one thread, "
             f"thread CPU time (attention level {res['levels']['attention']}); "
             f"x float16 out of the caches"]
    for name, r in res["ceilings"].items():
        lines.append(f"  {name} ({r['shape'][0]}/{r['shape'][1]} heads, d{r['shape'][2]}), "
                     f"{r['batch']} x {r['context']} out of the caches, {r['batch']} x "
                     f"{r['warm_context']} in them")
        for d in CEILING_DTYPES:
            cells = []
            for where in ("cold", "cache"):
                row = r["rows"][f"{d}_{where}"]
                lo, hi = row["range"]
                cells.append(f"{where:5s} {row['positions_per_s'] / 1e6:6.2f} M pos/s "
                             f"[{lo / 1e6:.2f}-{hi / 1e6:.2f}] {row['vs_float16_cold']:5.2f}x")
            lines.append(f"    {d:14s} " + "   ".join(cells))
    return "\n".join(lines)


def _full_option(parser):
    parser.add_argument("--full", action="store_true",
                        help="the out-of-cache page rows at hundreds of MB of pages")


def report(res):
    return attention.report(res) + "\n\n" + plan_report(res["plan_overhead"])


if __name__ == "__main__":
    full = {"options": _full_option, "run_kwargs": lambda a, p: {"full": a.full}}
    if "--only-prefill" in sys.argv:
        sys.argv.remove("--only-prefill")
        script_main(attention.run_prefill_shapes, attention.report, __doc__)
    elif "--only-plan" in sys.argv:
        sys.argv.remove("--only-plan")
        script_main(plan_overhead, plan_report, __doc__)
    elif "--only-ceilings" in sys.argv:
        sys.argv.remove("--only-ceilings")
        script_main(page_ceilings, ceilings_report, __doc__, **full)
    elif "--only-alignment" in sys.argv:
        sys.argv.remove("--only-alignment")
        script_main(alignment, alignment_report, __doc__, **full)
    elif "--only-pages" in sys.argv:
        sys.argv.remove("--only-pages")
        script_main(run_pages, lambda r: attention.page_report(r["pages"]), __doc__, **full)
    else:
        script_main(run, report, __doc__, **full)
