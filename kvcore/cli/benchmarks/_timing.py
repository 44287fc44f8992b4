"""Timing helpers shared by the benchmarks: medians of repeated runs, and
the spread of every number across repeated runs of a whole benchmark."""
import re
import statistics
import sys
import time


def samples(fn, repeat=15, number=1, warmup=2, budget=None, repeat_max=None, before=None,
            clock=None):
    """Seconds per call of ``fn()``: a list of at least ``repeat`` samples,
    each the mean of ``number`` back-to-back calls, after ``warmup`` calls.

    With ``budget`` (seconds), sampling goes on past ``repeat`` while the
    samples taken so far sum to less than it, up to ``repeat_max`` samples.
    ``before()``, when given, runs untimed before each sample (and each
    warm-up call).  ``clock`` is a pair ``(start, stop)`` of functions where
    ``stop(start())`` is the elapsed seconds (a device's events); the
    default is ``time.perf_counter``.  The one timing loop of the
    benchmarks: every median they print is taken over these samples."""
    if clock is None:
        start, stop = time.perf_counter, lambda t0: time.perf_counter() - t0
    else:
        start, stop = clock
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    out, spent = [], 0.0
    cap = max(repeat, repeat_max or repeat)
    while len(out) < repeat or (budget is not None and spent < budget and len(out) < cap):
        if before is not None:
            before()
        t0 = start()
        for _ in range(number):
            fn()
        dt = stop(t0) / number
        out.append(dt)
        spent += dt * number
    return out


def median_time(fn, repeat=15, number=1, warmup=2, **kw):
    """Median seconds per call of ``fn()`` (see :func:`samples`)."""
    return statistics.median(samples(fn, repeat, number, warmup, **kw))


def timed(r, key, fn, **kw):
    """:func:`samples` of ``fn`` into a result dict: ``r[key]`` gets the
    median, ``r[key + "_range"]`` the ``[min, max]``.  Returns the median."""
    s = samples(fn, **kw)
    r[key] = statistics.median(s)
    r[key + "_range"] = [min(s), max(s)]
    return r[key]


def ratio_text(r):
    """A speedup as the table prints it: ``"10.5x"``."""
    return f"{r:.1f}x"


def table(rows, headers):
    """A plain-text table: ``rows`` are tuples of already formatted cells."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


# ------------------------------------------------------ spread across runs
def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) or (
        hasattr(x, "dtype") and getattr(x, "shape", None) == () and x.dtype.kind in "iuf")


def aggregate(runs, how):
    """One result of the same layout as each of ``runs`` (dicts of one
    benchmark's ``run()``), every number replaced by ``how`` of that number
    over the runs (``"median"``, ``"min"`` or ``"max"``).  Anything that is
    not a number (names, flags) is taken from the first run."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: aggregate([r[k] for r in runs], how)
                if all(isinstance(r, dict) and k in r for r in runs) else first[k]
                for k in first}
    if isinstance(first, (list, tuple)) and all(
            isinstance(r, (list, tuple)) and len(r) == len(first) for r in runs):
        return type(first)(aggregate([r[i] for r in runs], how) for i in range(len(first)))
    if all(_is_number(r) for r in runs):
        vals = [r.item() if hasattr(r, "item") else r for r in runs]
        if how == "min":
            return min(vals)
        if how == "max":
            return max(vals)
        if all(isinstance(v, int) for v in vals):
            return statistics.median_low(vals)
        return statistics.median(vals)
    return first


def spread(runs):
    """``(median, min, max)`` results of ``runs`` (see :func:`aggregate`)."""
    return tuple(aggregate(runs, how) for how in ("median", "min", "max"))


_NUM = re.compile(r"\d+(?:\.\d+)?")


def with_spread(med, lo, hi):
    """The text ``med`` with each number that differs across the runs
    followed by its range: ``"2.43 Gelem/s"`` -> ``"2.43 [2.31-2.50] Gelem/s"``.

    ``med``, ``lo`` and ``hi`` are the same formatting applied to the
    median, min and max results; numbers equal in all three (sizes, counts)
    are left alone.
    """
    nm, nl, nh = (list(_NUM.finditer(t)) for t in (med, lo, hi))
    if not (len(nm) == len(nl) == len(nh)) or not nm:
        return med
    out, pos = [], 0
    for m, a, b in zip(nm, nl, nh):
        end = m.end()
        if not (m.group() == a.group() == b.group()):
            if med[end:end + 1] == "x":      # a ratio: "10.5x [9.8-11.0]"
                end += 1
            out.append(med[pos:end] + f" [{a.group()}-{b.group()}]")
        else:
            out.append(med[pos:end])
        pos = end
    out.append(med[pos:])
    return "".join(out)


def spread_lines(runs, path=""):
    """``path: median [min-max]`` for every number that varies across ``runs``."""
    first = runs[0]
    lines = []
    if isinstance(first, dict):
        for k in first:
            if all(isinstance(r, dict) and k in r for r in runs):
                lines += spread_lines([r[k] for r in runs], f"{path}.{k}" if path else str(k))
    elif isinstance(first, (list, tuple)) and all(
            isinstance(r, (list, tuple)) and len(r) == len(first) for r in runs):
        for i in range(len(first)):
            lines += spread_lines([r[i] for r in runs], f"{path}[{i}]")
    elif all(_is_number(r) for r in runs):
        med, lo, hi = (aggregate(runs, h) for h in ("median", "min", "max"))
        if lo != hi:
            lines.append(f"{path}: {med:.4g} [{lo:.4g}-{hi:.4g}]")
    return lines


def repeat_runs(run, repeat, **kw):
    """``run(**kw)`` ``repeat`` times: the list of results."""
    return [run(**kw) for _ in range(repeat)]


def script_main(run, report, doc, argv=None, quick_help="fewer repetitions", options=None,
                run_kwargs=None, fail=()):
    """The command line of a ``bench/*.py`` script: ``--quick``,
    ``--repeat N``, ``--json FILE`` (and what ``options(parser)`` adds;
    ``run_kwargs(args, parser)`` turns those into keywords of ``run``).
    Prints the table of the medians over the runs, then every number that
    varied as ``median [min-max]``.  An exception of a type in ``fail`` ends
    the script with its message."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--quick", action="store_true", help=quick_help)
    if options is not None:
        options(p)
    p.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="run the whole benchmark N times; print medians and the "
                        "min-max spread over the runs (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat: expected a positive integer, got {a.repeat}")
    kw = run_kwargs(a, p) if run_kwargs is not None else {}
    try:
        runs = repeat_runs(run, a.repeat, quick=a.quick, **kw)
    except tuple(fail) as e:
        sys.exit(f"{p.prog}: {e}")
    r = print_runs(runs, report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median": r, "runs": runs}, f, indent=2, default=_json_default)
        print(f"wrote {a.json}", file=sys.stderr)
    return r


def print_runs(runs, report):
    """Print the table of the medians of ``runs`` and the spread; returns the
    median result."""
    med = aggregate(runs, "median")
    print(f"medians of {len(runs)} run(s)")
    print(report(med))
    lines = spread_lines(runs)
    if len(runs) > 1:
        print(f"spread over the {len(runs)} runs, median [min-max] of every number that varied:")
        for line in lines:
            print("  " + line)
    return med


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
