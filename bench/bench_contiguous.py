"""Contiguous-cache benchmark (see kvcore/cli/benchmarks/contiguous.py):
python bench/bench_contiguous.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import contiguous
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(contiguous.run, contiguous.report, __doc__)
