"""Low-precision storage benchmark (see kvcore/cli/benchmarks/lowprec.py):
python bench/bench_lowprec.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import lowprec
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(lowprec.run, lowprec.report, __doc__)
