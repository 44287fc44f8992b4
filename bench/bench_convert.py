"""Conversion benchmark (see kvcore/cli/benchmarks/convert.py):
python bench/bench_convert.py [--quick] [--level NAME] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks._timing import script_main
from kvcore.cli.benchmarks.convert import report, run


def _options(p):
    p.add_argument("--level", metavar="NAME",
                   help="force a SIMD level (kvcore.set_simd_level: scalar, f16c, avx2, "
                        "avx512, amx, neon; the conversions run their best at or under it)")


def _run_kwargs(a, p):
    if a.level is not None:
        from kvcore.backends.cpu import _convert  # noqa: PLC0415

        supported = _convert.registry_levels()[1]
        if a.level not in supported:
            p.error(f"--level: expected one of {', '.join(supported)} "
                    f"(what this CPU supports), got {a.level!r}")
    return {"level": a.level}


def main(argv=None):
    """Command line: measure, print the table, optionally write JSON; returns
    the results dict."""
    return script_main(run, report,
                       "kvcore's float16/bfloat16/fp8 conversion against NumPy, ml_dtypes, "
                       "torch and a float32 memcpy", argv,
                       quick_help="4 Mi elements and 5 repetitions instead of 16 Mi and 15",
                       options=_options, run_kwargs=_run_kwargs)


if __name__ == "__main__":
    main()
