"""GPU benchmark (see kvcore/benchmarks/gpu.py):
python bench/bench_gpu.py [--quick] [--json FILE]"""
import argparse
import json
import sys

from kvcore.benchmarks.gpu import CudaUnavailableError, report, run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller ceiling buffer, fewer repeats")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args(argv)
    try:
        r = run(quick=a.quick)
    except CudaUnavailableError as e:
        sys.exit(f"bench_gpu: {e}")
    print(report(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
