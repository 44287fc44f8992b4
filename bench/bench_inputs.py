"""Torch tensors against NumPy arrays in one decode step (see
kvcore/cli/benchmarks/inputs.py): python bench/bench_inputs.py [--quick] [--json FILE]"""
from kvcore.cli.benchmarks import inputs
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(inputs.run, inputs.report, __doc__)
