"""Attention over the pages against torch SDPA, gather + NumPy and a
streaming read (see kvcore/cli/benchmarks/attention.py):
python bench/bench_attention.py [--quick] [--json FILE]"""
import os

# The baselines run on one thread: keep NumPy's BLAS to one as well.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

from kvcore.cli.benchmarks import attention  # noqa: E402
from kvcore.cli.benchmarks._timing import script_main  # noqa: E402

if __name__ == "__main__":
    script_main(attention.run, attention.report, __doc__)
