"""``generate``: ``model.generate`` with prefix reuse across calls through a pool."""
import contextlib
import inspect

import numpy as np

from . import graphs
from .cache import PagedCache
from .config import check_pool
from .features import AttentionSpec, check_batch, check_holdable
from .inputs import CACHE_KEYWORDS, _prompt_batch, _truthy, cache_keyword
from .torch_bridge import _on_cuda


def generate(model, input_ids, pool, attention_mask=None, salt=None, cuda_graph=False,
             prefill_attention="auto", **generate_kwargs):
    """``model.generate`` with prefix reuse across calls through ``pool``.

    Each row's longest cached prefix (prompt, and tokens that earlier calls
    generated and fed back) is read from ``pool``; only the rest is
    computed.  Every full block of prompt and generated tokens enters the
    prefix cache (padding never does).  Same output as ``model.generate``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only model; its config must match ``pool``
        (:func:`pool_for`).
    input_ids : torch.LongTensor ``(batch, length)``
        Left-padded when rows differ in length.
    pool : BlockPool
    attention_mask : torch.Tensor ``(batch, length)``, optional
        1 for tokens, 0 for (left) padding; default all ones.
    salt : str or bytes, optional
        Requests with different salts never share blocks.
    cuda_graph : bool, default False
        CUDA pools with ``attn_implementation="kvcore"``: replay each
        decode step (one new token per row) from a CUDA graph, captured at
        the second decode step of each batch size and kept with the pool
        for later calls (see docs/hf.md); the host then does a step's
        bookkeeping and one copy, the GPU the whole forward.  Prefill
        forwards and any forward a graph cannot take run as without it.
    prefill_attention : {"auto", "kvcore", "sdpa"}, default "auto"
        Who computes the attention of a first forward that needs no cached
        position (as :class:`PagedCache`'s: torch's sdpa where it is faster).
    **generate_kwargs
        Passed to ``model.generate`` (``max_new_tokens``, ``do_sample``,
        ``num_beams``, ``prompt_lookup_num_tokens``, ...).

    Returns
    -------
    What ``model.generate`` returns.  Hits show in ``pool.stats()``.
    """
    if not callable(getattr(model, "generate", None)) or getattr(model, "config", None) is None:
        raise TypeError(f"model must be a transformers model (with .config and .generate), "
                        f"got {type(model).__name__}")
    check_holdable(model.config, model)
    check_pool(pool, model.config)
    if not isinstance(cuda_graph, (bool, np.bool_)):
        raise TypeError(f"cuda_graph must be a bool, got {type(cuda_graph).__name__}")
    if cuda_graph:
        if not _on_cuda(pool.device):
            raise ValueError(f"cuda_graph=True needs a CUDA pool (device='cuda'), got a pool "
                             f"on {pool.device!r}")
        attn = getattr(model.config, "_attn_implementation", None)
        if attn != "kvcore":
            raise ValueError(f"cuda_graph=True needs attn_implementation='kvcore' (kvcore's "
                             f"attention reads the graph's buffers), got {attn!r}: "
                             "model.set_attn_implementation('kvcore')")
    for key in CACHE_KEYWORDS:
        if generate_kwargs.get(key) is not None:
            raise ValueError(f"kvcore.hf.generate makes its own cache; do not pass {key}=")
    config = generate_kwargs.get("generation_config") or model.generation_config
    use_cache = generate_kwargs.get("use_cache", getattr(config, "use_cache", True))
    if not _truthy(use_cache):
        # without a cache transformers re-feeds the whole sequence each step,
        # and the pool would store it again as new positions (None, 0, a
        # false numpy or torch scalar turn the cache off as False does)
        source = "use_cache=" if "use_cache" in generate_kwargs else "the generation config"
        raise ValueError(f"kvcore.hf.generate needs use_cache=True (got use_cache="
                         f"{use_cache!r}, from {source}); for generation without a KV cache "
                         "call model.generate directly")
    attention_mask, pads = _prompt_batch(input_ids, attention_mask, model)
    check_batch(model.config, pads)
    _check_alibi_reach(model, input_ids.shape[1], int(np.min(pads)), config, generate_kwargs)
    ids = input_ids.detach().cpu().numpy()
    keyword = cache_keyword(model)
    cache = PagedCache(pool, salt=salt, prefill_attention=prefill_attention)
    graph_set = None
    try:
        cache._begin([ids[i, pads[i]:] for i in range(ids.shape[0])], pads)
        if cuda_graph:
            own = cache._lane
            graph_set = graphs.checkout(pool, model, lambda: own)
            graph_set.check_model(model)
            cache._lane = graph_set.lane
            longest = _longest(ids.shape[1], config, generate_kwargs)
            if longest:
                need = -(-longest // pool.block_size)
                cache._lane.capacity = max(cache._lane.capacity, need)
        hook = model.register_forward_pre_hook(cache._pre_forward, with_kwargs=True)
        try:
            with _forward_of(model, graph_set, cache):
                return model.generate(input_ids, attention_mask=attention_mask,
                                      **{keyword: cache}, **generate_kwargs)
        finally:
            hook.remove()
    finally:
        cache.free()
        if graph_set is not None:
            graphs.checkin(graph_set)


def _check_alibi_reach(model, width, pad, config, generate_kwargs):
    """Refuse up front a call whose rows would pass the position up to
    which the kvcore attention computes the model's ALiBi (Falcon's:
    ``AttentionSpec.alibi_limit``), instead of at the forward that reaches
    it, its tokens so far lost (``width``: the prompt's columns, ``pad``
    the least padding of a row)."""
    if getattr(model.config, "_attn_implementation", None) != "kvcore":
        return
    limit = AttentionSpec(model.config).alibi_limit
    columns = _longest(width, config, generate_kwargs)
    if limit is None or columns is None:
        return
    # (the last new token is never fed back: the last forward's row ends
    # one column short of the call's)
    longest = columns - 1 - pad
    if longest > limit:
        raise ValueError(
            f"{model.config.model_type}: its ALiBi bias equals kvcore's only below position "
            f"{limit}, and this call's forwards reach position {longest - 1} (its longest "
            f"prompt's {width - pad} tokens and the new ones but the last); generate fewer "
            "tokens, or use attn_implementation='sdpa' or 'eager'")


def _longest(width, config, generate_kwargs):
    """The most columns a row of the call can reach (prompt and new
    tokens), or None when the call does not say."""
    new = generate_kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if isinstance(new, int) and new > 0:
        return width + new
    length = generate_kwargs.get("max_length", getattr(config, "max_length", None))
    return length if isinstance(length, int) and length > 0 else None


@contextlib.contextmanager
def _forward_of(model, graph_set, cache):
    """With ``graph_set``: ``model.forward`` is a :class:`GraphRunner` for
    the enclosed call (presenting the forward's signature, which generate
    reads), put back as it was afterwards."""
    if graph_set is None:
        yield
        return
    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    forward = model.forward
    runner = graphs.GraphRunner(model, forward, cache, graph_set)
    runner.__signature__ = inspect.signature(forward)
    model.forward = runner
    try:
        yield
    finally:
        if had:
            model.forward = before
        else:
            del model.forward
