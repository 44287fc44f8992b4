"""Contiguous-cache benchmark (see kvcore/benchmarks/contiguous.py):
python bench/bench_contiguous.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.benchmarks import contiguous
from kvcore.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(contiguous.run, contiguous.report, __doc__)
