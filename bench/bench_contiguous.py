"""Contiguous-cache benchmark (see kvcore/benchmarks/contiguous.py):
python bench/bench_contiguous.py [--quick] [--json FILE]"""
import argparse
import json

from kvcore.benchmarks import contiguous

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args()
    r = contiguous.run(quick=a.quick)
    print(contiguous.report(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
