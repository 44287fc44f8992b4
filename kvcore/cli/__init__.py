"""``python -m kvcore``: the demo and the benchmarks.

    python -m kvcore                 the demo, on its defaults
    python -m kvcore demo [options]  serve a tiny model through kvcore and verify it
    python -m kvcore bench [options] kvcore against its baselines (quick by default)

``python -m kvcore <command> --help`` lists a command's options.
"""
import argparse
import importlib
import json
import sys
import time

import numpy as np

import kvcore

# (module under kvcore.cli.benchmarks, what it measures); optional ones may be
# missing from a build: they are skipped with a note.
BENCHMARKS = (
    ("pool", "block pool: bookkeeping, paged write, gather"),
    ("hashing", "chained block hashes of a prompt"),
    ("contiguous", "contiguous KVCache writes"),
    ("convert", "float16/bfloat16 conversion"),
    ("sweep", "paged write bandwidth against tokens"),
    ("gpu", "GPU (CuPy) kernels"),
    ("attention", "paged_attention against torch SDPA and gather + NumPy"),
    ("lowprec", "fp8/int8 pools against float16: paged write, bytes/token, decode"),
    ("hf", "kvcore.hf against transformers' DynamicCache + sdpa (minutes; only with --only)"),
)
OPTIONAL = {"convert", "gpu", "hf"}
# run only when --only names them (they take minutes, or need extras)
ON_REQUEST = {"hf"}


def _parser():
    from . import demo

    p = argparse.ArgumentParser(
        prog="python -m kvcore",
        description="kvcore: a KV-cache engine for transformer inference. "
                    "With no command, runs the demo on its defaults.")
    p.add_argument("--version", action="version", version=f"kvcore {kvcore.__version__}")
    sub = p.add_subparsers(dest="command", metavar="{demo,bench}")
    d = sub.add_parser(
        "demo", help="serve a tiny transformer through kvcore and verify it",
        description="Serve a tiny random-weight transformer through kvcore (continuous "
                    "batching over one BlockPool, prefix caching) and verify every logits "
                    "row against a full recompute.  Table on stdout, progress on stderr; "
                    "exit status 1 if the verification fails.")
    demo.add_arguments(d)
    b = sub.add_parser(
        "bench", help="benchmark kvcore against its baselines",
        description="Run kvcore's benchmarks (quick mode unless --full) and print one "
                    "table of kvcore against its baselines.")
    b.add_argument("--full", action="store_true",
                   help="full mode: more repetitions and sizes (about 1 minute a run on a "
                        "2-core x86-64; quick mode about 10 s a run)")
    b.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="run every benchmark N times (interleaved) and print each number as "
                        "median [min-max] over the runs (default %(default)s)")
    b.add_argument("--json", metavar="FILE", help="write every number as JSON")
    b.add_argument("--plot", metavar="FILE.png",
                   help="draw paged-write bandwidth against tokens (needs matplotlib)")
    b.add_argument("--only", metavar="NAMES",
                   help="comma-separated subset of: " + ", ".join(n for n, _ in BENCHMARKS))
    b.add_argument("--details", action="store_true",
                   help="also print each benchmark's own report")
    return p, d, b


# ------------------------------------------------------------------ bench
def _gpu_available():
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU"
    except Exception as e:  # CUDA driver missing, etc.
        return f"no usable CUDA GPU ({type(e).__name__}: {e})"
    return None


def _load(name):
    """(module, None) or (None, why it is skipped)."""
    if name == "gpu":
        why = _gpu_available()
        if why:
            return None, f"skipped: {why}"
    try:
        return importlib.import_module(f"kvcore.cli.benchmarks.{name}"), None
    except ImportError as e:
        if name not in OPTIONAL:
            raise
        if getattr(e, "name", None) == f"kvcore.cli.benchmarks.{name}":
            return None, "skipped: not in this build of kvcore"
        return None, f"skipped: cannot import it ({type(e).__name__}: {e})"


def _x(r):
    return f"{r:.1f}x"


def _rows_pool(r):
    bk, w, g = r["bookkeeping"], r["write"], r["gather"]
    rows = [("pool bookkeeping, per request", f"{bk['kvcore_us']:.1f} us",
             f"{bk['python_us']:.1f} us (Python, vLLM-style pool)", _x(bk["ratio"])),
            ("paged write 4096 tok f32->f16", f"{w['kvcore_gelem_s']:.2f} Gelem/s",
             f"{w['numpy_gelem_s']:.2f} Gelem/s (NumPy index assign)", _x(w["ratio_numpy"]))]
    if "ratio_torch" in w:
        rows.append(("", "", f"{w['torch_gelem_s']:.2f} Gelem/s (torch, "
                     f"{w['torch_threads']} thread)", _x(w["ratio_torch"])))
    rows.append(("gather 4096 tok", f"{g['kvcore_gelem_s']:.2f} Gelem/s",
                 f"{g['numpy_gelem_s']:.2f} Gelem/s (NumPy fancy index)", _x(g["ratio_numpy"])))
    return rows


def _rows_hashing(r):
    n = r["tokens"]
    return [(f"block_hashes, {n}-token prompt (int32 array)", f"{r['kvcore_array_us']:.1f} us",
             f"{r['python_us']:.1f} us (sha256 of pickled tuples, vLLM-style)",
             _x(r["ratio_array"])),
            (f"block_hashes, {n}-token prompt (list)", f"{r['kvcore_list_us']:.1f} us",
             "", _x(r["ratio_list"]))]


def _rows_contiguous(r):
    rows = []
    labels = {"decode": "KVCache decode step, 32 layers", "prompt": "KVCache prompt write 2048 tok"}
    for key, label in labels.items():
        w = r[key]
        rows.append((label, f"{w['kvcore_ms']:.3f} ms",
                     f"{w['numpy_astype_ms']:.3f} ms (NumPy slice = astype)",
                     _x(w["speedup_vs_astype"])))
        rows.append(("", "", f"{w['numpy_implicit_ms']:.3f} ms (NumPy slice, implicit cast)",
                     _x(w["speedup_vs_implicit"])))
    return rows


def _rows_sweep(r):
    rows = []
    for p in r["points"]:
        label = f"paged write {p['tokens']} tok, bandwidth"
        rows.append((label, f"{p['kvcore_gb_s']:.2f} GB/s",
                     f"{p['numpy_gb_s']:.2f} GB/s (NumPy)", _x(p["ratio_numpy"])))
        if "ratio_torch" in p:
            rows.append(("", "", f"{p['torch_gb_s']:.2f} GB/s (torch)", _x(p["ratio_torch"])))
    return rows


def _rows_convert(r):
    names = {"numpy": "NumPy astype", "ml_dtypes": "ml_dtypes astype",
             "torch": "torch copy_, 1 thread", "copy": "float32 memcpy"}
    rows = []
    ops = [k for k, v in r.items() if "->" in k and isinstance(v, dict)]
    if not ops:
        raise KeyError("no conversion in the result")   # not this layout: generic rows
    for op in ops:
        w = r[op]
        first = True
        for base, label in names.items():
            if f"ratio_{base}" not in w:
                continue
            rows.append((f"convert {op}, {r['n'] * 4 >> 20} MiB f32" if first else "",
                         f"{w['kvcore_gelem_s']:.2f} Gelem/s" if first else "",
                         f"{w[base + '_gelem_s']:.2f} Gelem/s ({label})",
                         _x(w[f"ratio_{base}"])))
            first = False
    return rows


def _rows_generic(name, r, path=""):
    """Rows for a benchmark whose result layout this CLI does not know:
    every ratio/speedup number found in the (nested) result dict."""
    rows = []
    if isinstance(r, dict):
        for k, v in r.items():
            where = f"{path}.{k}" if path else k
            if isinstance(v, dict):
                rows += _rows_generic(name, v, where)
            elif (k.startswith(("ratio", "speedup")) and isinstance(v, (int, float, np.number))
                  and not isinstance(v, bool)):
                rows.append((f"{name}: {path or k}", "", k, _x(float(v))))
    return rows


_ROWS = {"pool": _rows_pool, "hashing": _rows_hashing, "contiguous": _rows_contiguous,
         "sweep": _rows_sweep, "convert": _rows_convert}


def _summary_rows(name, res):
    try:
        return _ROWS[name](res) if name in _ROWS else _rows_generic(name, res)
    except (KeyError, TypeError):   # a module whose layout changed: fall back
        return _rows_generic(name, res)


def _table(rows):
    head = ("benchmark", "kvcore", "baseline", "speedup")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(  # noqa: E731
        (c.rjust(w) if i == 3 else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths)))
    line = fmt(head)
    return "\n".join([line, "-" * len(line)] + [fmt(r).rstrip() for r in rows])


def _json_default(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def bench_main(args, parser):
    quick = not args.full
    names = [n for n, _ in BENCHMARKS]
    if args.only:
        chosen = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [s for s in chosen if s not in names]
        if bad or not chosen:
            parser.error(f"--only: expected names among {', '.join(names)}, got {args.only!r}")
        names = [n for n in names if n in chosen]
    else:
        names = [n for n in names if n not in ON_REQUEST]
    if args.plot:
        if "sweep" not in names:
            parser.error("--plot draws the sweep benchmark; add sweep to --only")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed "
                         "(pip install matplotlib, or kvcore[bench]); run without --plot")

    if args.repeat < 1:
        parser.error(f"--repeat: expected a positive integer, got {args.repeat}")

    from .benchmarks._timing import aggregate, with_spread

    results, notes, rows, reports, runs = {}, [], [], [], {}
    mods = {}
    t_all = time.perf_counter()
    for name in names:
        mod, why = _load(name)
        if mod is None:
            notes.append(f"{name}: {why}")
            results[name] = {"skipped": why}
            print(f"  {name}: {why}", file=sys.stderr, flush=True)
        else:
            mods[name] = mod
            runs[name] = []
    # Runs are interleaved (every benchmark once, then again), so that a
    # change of load on a shared machine spreads over all of them.
    for rep in range(args.repeat):
        for name, mod in mods.items():
            print(f"  run {rep + 1}/{args.repeat}: {name} ({'quick' if quick else 'full'}) ...",
                  file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            runs[name].append(mod.run(quick=quick))
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    for name, mod in mods.items():
        med, lo, hi = (aggregate(runs[name], how) for how in ("median", "min", "max"))
        results[name] = med
        for rm, rl, rh in zip(*(_summary_rows(name, x) for x in (med, lo, hi))):
            rows.append(tuple(with_spread(a, b, c) for a, b, c in zip(rm, rl, rh)))
        if args.details and hasattr(mod, "report"):
            reports.append(mod.report(med))
    elapsed = time.perf_counter() - t_all

    try:
        from ..backends.cpu import _convert

        simd = _convert.get_simd_level()
    except Exception:  # an older native build: only the header loses it
        simd = "?"
    spread = (f"each number the median of {args.repeat} runs, [min-max] over the runs"
              if args.repeat > 1 else "one run, no spread (use --repeat N)")
    print(f"kvcore {kvcore.__version__} benchmarks ({'quick' if quick else 'full'} mode, "
          f"{args.repeat} run(s) in {elapsed:.0f} s; NumPy {np.__version__}, SIMD {simd}); "
          f"speedup = baseline time / kvcore time; {spread}")
    if rows:
        print(_table(rows))
    for n in notes:
        print(f"note: {n}")
    for rep in reports:
        print()
        print(rep)

    if args.json:
        out = {"kvcore": kvcore.__version__, "quick": quick, "numpy": np.__version__,
               "simd": simd, "seconds": elapsed, "repeat": args.repeat,
               "results": results, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=_json_default)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from .benchmarks import sweep

        sweep.plot(results["sweep"], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------- main
def main(argv=None):
    """Entry point of ``python -m kvcore``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, demo_parser, bench_parser = _parser()
    if not argv:
        argv = ["demo"]
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.run_from_args(args, demo_parser)
    if args.command == "bench":
        return bench_main(args, bench_parser)
    parser.print_help()
    return 0

