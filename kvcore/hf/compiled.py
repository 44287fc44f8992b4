"""A kvcore forward inside ``torch.compile``: the cache's update and the
attention as two custom operators, traced into the model's graph.

Eagerly (and in frames torch's compiler leaves eager) ``PagedCache.update``
writes the step's K/V and hands the attention the new K/V marked
(``handoff.py``).  When torch's compiler traces a layer of a CPU pool's
kvcore forward, ``update`` does no host work while tracing: it records a
copy of the layer's K/V in the attention's keyword arguments and returns
the outputs of ``kvcore::handoff`` instead; the attention, traced in the
same region, finds the very tensors ``update`` returned (or refuses) and
calls ``kvcore::attend`` (``attention.py``) with the recorded K/V.  At run
time ``attend`` does the eager update and attention (every check, the
write, the plan) on the cache whose number it is given, so the compiled
forward computes what the eager one does, without a graph break per layer.

Nothing ever reads ``kvcore::handoff``'s outputs in a model that hands them
to the attention as they are, so torch's compiler drops the operator (its
inductor and aot backends remove what no one reads).  When it runs, the
model computed with them (or the forward was compiled by a backend that
keeps what no one reads, or broke its graph while it held them): it undoes
the forward's step and raises ValueError, as a model computing with the
marked K/V does eagerly.  What this route does not see: a change made in
place to the K/V ``update`` returned (eagerly refused; with transformers'
DynamicCache such a change would alter the cache itself), and a layer that
calls ``update`` but not the attention (its K/V are never written: the
next forward's first ``update`` refuses the step left partial).
"""
import itertools
import weakref

import torch

from .step import Step

# each PagedCache is named to the operators by a number held in a tensor: a
# graph input read at run time (a number in the graph would recompile the
# forward for every cache), looked up here (weakly: never keeps a dropped
# cache's blocks)
_caches = weakref.WeakValueDictionary()
_numbers = itertools.count(1)


def identity(cache):
    """The tensor that names ``cache`` to the operators (``PagedCache.__init__``)."""
    number = next(_numbers)
    _caches[number] = cache
    return torch.tensor(number, dtype=torch.int64)


def begin_forward(cache):
    """Called by the kvcore mask function when a forward's attention reads
    ``cache``'s pages (``Step.begin`` sets the flag when it begins one)."""
    cache._forward_began_step = False


def current(cache_id, layer):
    """The cache an operator of ``layer`` acts on, at run time."""
    cache = _caches.get(int(cache_id))
    if cache is None or not cache._kvcore_forward:
        raise RuntimeError(f"layer {layer}: kvcore's compiled attention ran for a PagedCache "
                           "that was dropped or whose forward is not a kvcore forward")
    return cache


def refuse(cache, layer, message):
    """Undo the step the current forward began (if it began one: the
    operators may run in another order than the layers) and raise ValueError."""
    if cache._forward_began_step:
        Step.undo_failed(cache, None, cache._step)
    raise ValueError(f"{cache._model_type} layer {layer}: {message}")


COMPUTES = ("the model computes with the cached K/V itself ({}) instead of handing them to "
            "transformers' attention function as they are; attn_implementation='kvcore' "
            "cannot serve it (use 'sdpa' or 'eager' with the PagedCache). The forward was "
            "undone.")


@torch.library.custom_op("kvcore::handoff", mutates_args=())
def handoff(key: torch.Tensor, value: torch.Tensor, cache_id: torch.Tensor,
            layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a traced ``update`` returns; running it is a refusal (see the module)."""
    refuse(current(cache_id, layer), layer, COMPUTES.format(
        "in its compiled forward; or the forward was compiled by a backend that runs what no "
        "one reads, such as backend='eager', or broke its graph while it held them: between "
        "the cache's update and the attention, or inside the attention function"))


@handoff.register_fake
def _(key, value, cache_id, layer):
    return torch.empty_like(key), torch.empty_like(value)


def traceable(cache, layer_idx, kwargs):
    """Whether this ``update`` call, being traced, takes the compiled route:
    a CPU pool's kvcore forward, by a transformers that hands ``update``
    the attention's keyword arguments."""
    return (cache._kvcore_forward and not cache._torch.cuda and not cache._captured
            and type(layer_idx) is int and isinstance(kwargs.get("kwargs"), dict))


def traced_update(cache, key_states, value_states, layer_idx, kwargs):
    """``update`` while torch's compiler traces it (see :func:`traceable`):
    the K/V as they are now (a copy: the model may change its tensors in
    place later, the pages hold what ``update`` was given), the handoff's
    outputs, and (once the layer's attention has run: a layer may call it
    more than once) its first result, for the attention."""
    key = key_states.detach().clone()
    value = value_states.detach().clone()
    handed_key, handed_value = handoff(key, value, cache._compiled_id, layer_idx)
    kwargs["kwargs"]["kvcore_traced"] = [cache._compiled_id, key, value, handed_key,
                                         handed_value, layer_idx, None]
    return handed_key, handed_value
