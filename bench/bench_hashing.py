"""Block-hash benchmark (see kvcore/cli/benchmarks/hashing.py):
python bench/bench_hashing.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import hashing
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(hashing.run, hashing.report, __doc__)
