"""The demo's figures, repeated (see kvcore/cli/benchmarks/demo.py):
python bench/bench_demo.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import demo
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(demo.run, demo.report, __doc__)
