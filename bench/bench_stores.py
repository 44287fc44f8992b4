"""Prefix-store restore benchmark (see kvcore/cli/benchmarks/stores.py):
python bench/bench_stores.py [--quick] [--tokens N] [--layers N] [--kv-heads N]
[--head-dim N] [--samples N] [--redis-server PATH] [--decode-step-ms MS] [--only ROWS]
[--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import stores
from kvcore.cli.benchmarks._timing import script_main


def options(p):
    p.add_argument("--tokens", type=int, help="prefix tokens (default 2048; --quick 512)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--samples", type=int, help="timed samples a row (default 5; --quick 3)")
    p.add_argument("--redis-server", metavar="PATH")
    p.add_argument("--decode-step-ms", type=float, default=20.0,
                   help="the decode step the prefetch rows sleep per step (default 20)")
    p.add_argument("--only", metavar="ROWS",
                   help="comma-separated subset of: " + ", ".join(stores.ROWS))


def run_kwargs(a, p):
    for name in ("tokens", "layers", "kv_heads", "head_dim", "samples"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if a.tokens is not None and a.tokens % stores.BLOCK:
        p.error(f"--tokens must be a multiple of {stores.BLOCK}, got {a.tokens}")
    if not a.decode_step_ms > 0:
        p.error(f"--decode-step-ms must be positive, got {a.decode_step_ms}")
    only = None
    if a.only:
        only = [s.strip() for s in a.only.split(",") if s.strip()]
        bad = [s for s in only if s not in stores.ROWS]
        if bad:
            p.error(f"--only: unknown rows {bad}; choose from {', '.join(stores.ROWS)}")
    return {"tokens": a.tokens, "layers": a.layers, "heads": a.kv_heads, "dim": a.head_dim,
            "n_samples": a.samples, "redis_server": a.redis_server, "only": only,
            "decode_step_ms": a.decode_step_ms}


if __name__ == "__main__":
    import sys

    # one whole run unless --repeat says otherwise: every row already prints
    # median [min-max] of its samples
    argv = sys.argv[1:]
    if not any(x == "--repeat" or x.startswith("--repeat=") for x in argv):
        argv = [*argv, "--repeat", "1"]
    script_main(stores.run, stores.report, __doc__, argv=argv,
                quick_help="512 tokens, 3 samples a row (under a minute)", options=options,
                run_kwargs=run_kwargs)
