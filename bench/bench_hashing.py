"""Block-hash benchmark (see kvcore/benchmarks/hashing.py):
python bench/bench_hashing.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.benchmarks import hashing
from kvcore.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(hashing.run, hashing.report, __doc__)
