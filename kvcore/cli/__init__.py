"""``python -m kvcore``: the demo and the benchmarks.

    python -m kvcore                 the demo, on its defaults
    python -m kvcore demo [options]  serve a tiny model (or --model a GGUF) through kvcore
                                     and verify it
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
    ("stores", "prefix-store restores and the checksum against memcpy, fromfile, raw Redis "
               "GETs (a minute; only with --only)"),
)
OPTIONAL = {"convert", "gpu", "hf"}
# run only when --only names them (they take minutes, or need extras)
ON_REQUEST = {"hf", "stores"}


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
        description="Serve a tiny random-weight transformer (or, with --model, a real "
                    "GGUF model) through kvcore (continuous "
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
                   help="draw paged-write bandwidth against tokens with its [min-max] spread "
                        "(needs matplotlib and the sweep benchmark)")
    b.add_argument("--plot-attention", metavar="FILE.png",
                   help="draw the attention table as a figure (needs matplotlib and the "
                        "attention benchmark)")
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


def _hf_available():
    try:
        import kvcore.hf  # noqa: F401
    except ImportError as e:   # kvcore.hf says what it needs (torch, transformers)
        return str(e)
    return None


def _load(name):
    """(module, None) or (None, why it is skipped)."""
    available = {"gpu": _gpu_available, "hf": _hf_available}.get(name)
    if available is not None:
        why = available()
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


def _summary_rows(name, mod, res):
    """The table lines of benchmark ``name``: its module's own ``rows(res)``.

    Every benchmark module owns its rows, so nothing it measured can be
    dropped here; a module without ``rows`` is a programming error."""
    rows = getattr(mod, "rows", None)
    if rows is None:
        raise TypeError(f"kvcore.cli.benchmarks.{name} has no rows(result) function")
    return rows(res)


def _cpu_model():
    """The CPU's model name (``/proc/cpuinfo``), or the platform's answer."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _simd_levels():
    """``{kernel family: level in use}`` (``kvcore.simd_levels()`` where this
    build has it, else the conversion and attention levels)."""
    if hasattr(kvcore, "simd_levels"):
        return dict(kvcore.simd_levels())
    levels = {}
    try:
        from ..backends.cpu import _attention, _convert

        levels["conversions"] = _convert.get_simd_level()
        levels["attention"] = _attention.simd_level()
    except Exception as e:  # an older native build: only the header loses it
        levels["?"] = f"{type(e).__name__}"
    return levels


def _versions():
    """``{package: version}`` of what the baselines run on."""
    out = {"numpy": np.__version__}
    for name in ("torch", "ml_dtypes", "transformers"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except Exception:
                continue
        out[name] = getattr(mod, "__version__", "?")
    return out


def _eta(done_s, runs_done, runs_total):
    """``"ETA 1 min 20 s"`` from the time the finished runs took."""
    if not runs_done or runs_done >= runs_total:
        return ""
    left = done_s / runs_done * (runs_total - runs_done)
    return f", ETA {int(left // 60)} min {int(left % 60)} s" if left >= 60 else \
        f", ETA {left:.0f} s"


def _run_one(mod, quick, name):
    """One run of a benchmark module, telling it how to report progress when
    it takes a ``progress`` callable (long benchmarks print their steps)."""
    import inspect

    def progress(done, total, what=""):
        print(f"    {name}: {done}/{total}{' ' + what if what else ''}", file=sys.stderr,
              flush=True)

    if "progress" in inspect.signature(mod.run).parameters:
        return mod.run(quick=quick, progress=progress)
    return mod.run(quick=quick)


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
    for opt, bench in ((args.plot, "sweep"), (args.plot_attention, "attention")):
        if not opt:
            continue
        flag = "--plot" if bench == "sweep" else "--plot-attention"
        if bench not in names:
            parser.error(f"{flag} draws the {bench} benchmark; add {bench} to --only")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"{flag} needs matplotlib, which is not installed "
                         f"(pip install matplotlib, or kvcore[bench]); run without {flag}")

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
    total, done, t_runs = args.repeat * len(mods), 0, 0.0
    for rep in range(args.repeat):
        for name, mod in mods.items():
            print(f"  run {rep + 1}/{args.repeat}: {name} ({'quick' if quick else 'full'})"
                  f"{_eta(t_runs, done, total)} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            runs[name].append(_run_one(mod, quick, name))
            t_runs += time.perf_counter() - t0
            done += 1
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    spreads = {}
    for name, mod in mods.items():
        med, lo, hi = (aggregate(runs[name], how) for how in ("median", "min", "max"))
        results[name] = med
        spreads[name] = (lo, hi)
        for rm, rl, rh in zip(*(_summary_rows(name, mod, x) for x in (med, lo, hi))):
            rows.append(tuple(with_spread(a, b, c) for a, b, c in zip(rm, rl, rh)))
        if args.details and hasattr(mod, "report"):
            reports.append(mod.report(med))
    elapsed = time.perf_counter() - t_all

    simd = _simd_levels()
    cpu = _cpu_model()
    versions = _versions()
    spread = (f"each number the median of {args.repeat} runs, [min-max] over the runs"
              if args.repeat > 1 else "one run, no spread (use --repeat N)")
    print(f"kvcore {kvcore.__version__} benchmarks ({'quick' if quick else 'full'} mode, "
          f"{args.repeat} run(s) in {elapsed:.0f} s); speedup = baseline time / kvcore time; "
          f"{spread}")
    print(f"CPU: {cpu}; SIMD: " + ", ".join(f"{k} {v}" for k, v in simd.items()))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if rows:
        print(_table(rows))
    for n in notes:
        print(f"note: {n}")
    for rep in reports:
        print()
        print(rep)

    if args.json:
        out = {"kvcore": kvcore.__version__, "quick": quick, "numpy": np.__version__,
               "simd": simd, "cpu": cpu, "versions": versions, "seconds": elapsed,
               "repeat": args.repeat,
               "results": results, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=_json_default)
        print(f"wrote {args.json}", file=sys.stderr)
    stamp = (f"kvcore {kvcore.__version__}, {'quick' if quick else 'full'} mode, "
             f"{args.repeat} run(s); {cpu}; SIMD " + ", ".join(f"{k} {v}" for k, v in simd.items()))
    if args.plot:
        from .benchmarks import sweep

        sweep.plot(results["sweep"], args.plot, spread=spreads["sweep"], stamp=stamp)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.plot_attention:
        from .benchmarks import attention

        attention.plot(results["attention"], args.plot_attention, spread=spreads["attention"],
                       stamp=stamp)
        print(f"wrote {args.plot_attention}", file=sys.stderr)
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

