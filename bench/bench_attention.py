"""Attention over the pages against torch SDPA, gather + NumPy and a
streaming read (see kvcore/cli/benchmarks/attention.py):
python bench/bench_attention.py [--quick] [--json FILE]"""
from kvcore.cli.benchmarks import attention
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(attention.run, attention.report, __doc__)
