"""How many CPU threads kvcore.hf's attention runs on: ``attention_threads``.

The attention runs between torch's operations, never beside them: while a
layer's attention runs, torch's thread pool waits for the next matmul.  So
kvcore.hf's default is torch's own thread count (``torch.get_num_threads()``,
capped by the CPUs this process may run on): the same cores, taken in turn,
and a user who gives torch fewer threads (to share the machine) gives kvcore
fewer too.  ``kvcore.set_num_threads(n)`` overrides it for kvcore.hf as for
everything else; ``kvcore.set_num_threads(None)`` restores the default.
"""
import torch

from .._threads import _default_num_threads, chosen_num_threads


def attention_threads():
    """Threads of the attention plans kvcore.hf makes on the CPU: the count
    set by ``kvcore.set_num_threads``, or else torch's thread count, at most
    the CPUs this process may run on (and ``OMP_NUM_THREADS``)."""
    chosen = chosen_num_threads()
    if chosen is not None:
        return chosen
    return max(1, min(torch.get_num_threads(), _default_num_threads()))
