"""The demo's figures, repeated (see kvcore/benchmarks/demo.py):
python bench/bench_demo.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.benchmarks import demo
from kvcore.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(demo.run, demo.report, __doc__)
