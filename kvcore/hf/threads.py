"""How many CPU threads kvcore.hf's attention runs on: ``attention_threads``.

By default one, the calling thread.  A layer's attention runs right after
torch's projections, on the cores torch's thread pool has just used (all of
them, by default) and whose workers still spin waiting for the next op: a
kvcore worker woken on one of them waits for it, and a split decode waits for
its slowest part.  Measured on SmolLM2-135M through transformers
(``bench/bench_hf_pages.py --threads 1,2``, docs/hf.md "Threads"): beside
torch's 2 threads on 2 busy cores a second kvcore thread made the attention
about 3x slower; with a core free it made it 1.16x faster, about 1% of a
decode step.
``kvcore.set_num_threads(n)`` overrides the default for kvcore.hf as for the
rest of kvcore (for long contexts on cores torch does not use);
``kvcore.set_num_threads(None)`` restores it.
"""
from .._threads import chosen_num_threads

DEFAULT_THREADS = 1


def attention_threads():
    """Threads of the attention plans kvcore.hf makes on the CPU: the count
    set by ``kvcore.set_num_threads``, or else 1 (the calling thread)."""
    chosen = chosen_num_threads()
    return DEFAULT_THREADS if chosen is None else chosen
