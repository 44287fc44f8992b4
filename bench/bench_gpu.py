"""GPU benchmark (see kvcore/cli/benchmarks/gpu.py):
python bench/bench_gpu.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks._timing import script_main
from kvcore.cli.benchmarks.gpu import CudaUnavailableError, report, run


def main(argv=None):
    return script_main(run, report, __doc__.split("\n\n")[0], argv,
                       quick_help="smaller ceiling buffer, fewer repeats",
                       fail=(CudaUnavailableError,))


if __name__ == "__main__":
    main()
