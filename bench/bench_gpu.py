"""GPU benchmark (see kvcore/cli/benchmarks/gpu.py):
python bench/bench_gpu.py [--quick] [--repeat N] [--json FILE]"""
import argparse
import json
import sys

from kvcore.cli.benchmarks._timing import print_runs, repeat_runs
from kvcore.cli.benchmarks.gpu import CudaUnavailableError, report, run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller ceiling buffer, fewer repeats")
    p.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="run the benchmark N times; print medians and the min-max spread "
                        "over the runs (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat: expected a positive integer, got {a.repeat}")
    try:
        runs = repeat_runs(run, a.repeat, quick=a.quick)
    except CudaUnavailableError as e:
        sys.exit(f"bench_gpu: {e}")
    r = print_runs(runs, report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median": r, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
