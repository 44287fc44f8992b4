"""Block-pool benchmarks (see kvcore/cli/benchmarks/pool.py):
python bench/bench_pool.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import pool
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(pool.run, pool.report, __doc__)
