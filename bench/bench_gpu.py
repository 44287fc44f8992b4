"""GPU benchmark (see kvcore/cli/benchmarks/gpu.py):
python bench/bench_gpu.py [--quick] [--anchor] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks._timing import script_main
from kvcore.cli.benchmarks.gpu import CudaUnavailableError, report, run


def _options(p):
    p.add_argument("--anchor", action="store_true",
                   help="only the copy ceiling and attention against torch SDPA "
                        "(decode and prefill of the sizes of issue 41)")


def main(argv=None):
    return script_main(run, report, __doc__.split("\n\n")[0], argv,
                       quick_help="smaller ceiling buffer, fewer repeats",
                       options=_options, run_kwargs=lambda a, p: {"anchor": a.anchor},
                       fail=(CudaUnavailableError,))


if __name__ == "__main__":
    main()
