"""Timing helpers shared by the benchmarks: medians of repeated runs."""
import statistics
import time


def median_time(fn, repeat=15, number=1, warmup=2):
    """Median seconds per call of ``fn()`` over ``repeat`` samples of ``number`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def table(rows, headers):
    """A plain-text table: ``rows`` are tuples of already formatted cells."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def script_main(run, report, doc, argv=None):
    """The command line of a ``bench/*.py`` script: ``--quick``, ``--json FILE``."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args(argv)
    r = run(quick=a.quick)
    print(report(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return r
