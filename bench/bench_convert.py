"""Conversion benchmark (see kvcore/cli/benchmarks/convert.py):
python bench/bench_convert.py [--quick] [--level NAME] [--repeat N] [--json FILE]"""
import argparse
import json
import sys

from kvcore.cli.benchmarks._timing import print_runs, repeat_runs
from kvcore.cli.benchmarks.convert import report, run


def main(argv=None):
    """Command line: measure, print the table, optionally write JSON; returns
    the results dict."""
    p = argparse.ArgumentParser(
        description="kvcore's float16/bfloat16 conversion against NumPy, ml_dtypes, "
                    "torch and a float32 memcpy")
    p.add_argument("--quick", action="store_true",
                   help="4 Mi elements and 5 repetitions instead of 16 Mi and 15")
    p.add_argument("--level", metavar="NAME",
                   help="force a SIMD level (scalar, f16c, avx2, neon)")
    p.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="run the benchmark N times; print medians and the min-max spread "
                        "over the runs (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat: expected a positive integer, got {a.repeat}")
    if a.level is not None:
        from kvcore.backends.cpu import _convert  # noqa: PLC0415

        if a.level not in _convert.available_simd_levels():
            p.error(f"--level: expected one of {', '.join(_convert.available_simd_levels())} "
                    f"(what this CPU supports), got {a.level!r}")
    runs = repeat_runs(run, a.repeat, quick=a.quick, level=a.level)
    res = print_runs(runs, report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median": res, "runs": runs}, f, indent=2)
        print(f"wrote {a.json}", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
