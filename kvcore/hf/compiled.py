"""A kvcore forward inside ``torch.compile``: the cache's update and the
attention as two custom operators, traced into the model's graph.

Eagerly (and in frames torch's compiler leaves eager) ``PagedCache.update``
writes the step's K/V and hands the attention the new K/V marked
(``handoff.py``).  When torch's compiler traces a layer of a CPU pool's
kvcore forward, ``update`` does no host work while tracing: it records the
layer's K/V in the attention's keyword arguments and returns the outputs of
``kvcore::handoff`` instead; the attention, traced in the same region, finds
the very tensors ``update`` returned (or refuses) and calls
``kvcore::attend`` (``attention.py``) with the K/V as the model made them.
At run time ``attend`` does the eager update and attention (every check,
the write, the plan), so the compiled forward computes what the eager one
does, without a graph break per layer.

Nothing ever reads ``kvcore::handoff``'s outputs in a model that hands them
to the attention as they are, so torch's compiler drops the operator (its
inductor and aot backends remove what no one reads).  When it runs, the
model computed with them (or the forward was compiled by a backend that
keeps what no one reads, or broke its graph between the update and the
attention): it undoes the forward's step and raises ValueError, as a model
computing with the marked K/V does eagerly.
"""
import threading
import weakref

import torch

from .step import Step

# the cache whose kvcore forward this thread is running (weakly: never
# keeps a dropped cache's blocks): set by the kvcore mask function (once a
# forward, outside the compiled regions), read by the operators at run time
_forward = threading.local()


def begin_forward(cache):
    """Called by the kvcore mask function when a forward's attention reads
    ``cache``'s pages (``Step.begin`` sets the flag when it begins one)."""
    cache._forward_began_step = False
    _forward.cache = weakref.ref(cache)


def current(layer):
    ref = getattr(_forward, "cache", None)
    cache = ref() if ref is not None else None
    if cache is None or not cache._kvcore_forward:
        raise RuntimeError(f"layer {layer}: kvcore's compiled attention ran outside a kvcore "
                           "forward (its mask function was not called in this thread)")
    return cache


def refuse(layer, message):
    """Undo the step the current forward began (if it began one: the
    operators may run in another order than the layers) and raise ValueError."""
    cache = current(layer)
    if cache._forward_began_step:
        Step.undo_failed(cache, None, cache._step)
    state = cache._attention_state
    model_type = state.spec.model_type if state is not None else "the model"
    raise ValueError(f"{model_type} layer {layer}: {message}")


COMPUTES = ("the model computes with the cached K/V itself ({}) instead of handing them to "
            "transformers' attention function as they are; attn_implementation='kvcore' "
            "cannot serve it (use 'sdpa' or 'eager' with the PagedCache). The forward was "
            "undone.")


@torch.library.custom_op("kvcore::handoff", mutates_args=())
def handoff(key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """What a traced ``update`` returns; running it is a refusal (see the module)."""
    refuse(layer, COMPUTES.format(
        "in its compiled forward; or the forward was compiled by a backend that runs what no "
        "one reads, such as backend='eager', or with a graph break between the cache's update "
        "and the attention"))


@handoff.register_fake
def _(key, value, layer):
    return torch.empty_like(key), torch.empty_like(value)


def traceable(cache, layer_idx, kwargs):
    """Whether this ``update`` call, being traced, takes the compiled route:
    a CPU pool's kvcore forward, by a transformers that hands ``update``
    the attention's keyword arguments."""
    return (cache._kvcore_forward and not cache._torch.cuda and not cache._captured
            and type(layer_idx) is int and isinstance(kwargs.get("kwargs"), dict))


def traced_update(key_states, value_states, layer_idx, kwargs):
    """``update`` while torch's compiler traces it (see :func:`traceable`)."""
    key, value = handoff(key_states, value_states, layer_idx)
    kwargs["kwargs"]["kvcore_traced"] = (key_states, value_states, key, value, layer_idx)
    return key, value
