"""kvcore.hf (float16 PagedCache, attn_implementation="kvcore") against
DynamicCache + sdpa on a tiny Llama, one thread: tokens/s, KV bytes, time to
first token with a cached prefix, cache.update per decode step (see
kvcore/cli/benchmarks/hf.py): python bench/bench_hf.py [--quick] [--repeat N] [--json FILE]"""
from kvcore.cli.benchmarks import hf
from kvcore.cli.benchmarks._timing import script_main

if __name__ == "__main__":
    script_main(hf.run, hf.report, __doc__)
