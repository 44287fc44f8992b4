"""Block-pool benchmarks (see kvcore/benchmarks/pool.py): python bench/bench_pool.py [--quick]"""
import argparse
import json

from kvcore.benchmarks import pool

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    a = p.parse_args()
    r = pool.run(quick=a.quick)
    print(pool.report(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
