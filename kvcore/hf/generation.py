"""``generate``: ``model.generate`` with prefix reuse across calls through a pool."""
from .cache import PagedCache
from .config import check_pool
from .inputs import _prompt_batch, _truthy, cache_keyword


def generate(model, input_ids, pool, attention_mask=None, salt=None, **generate_kwargs):
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
    **generate_kwargs
        Passed to ``model.generate`` (``max_new_tokens``, ``do_sample``,
        ``num_beams``, ``prompt_lookup_num_tokens``, ...).

    Returns
    -------
    What ``model.generate`` returns.  Hits show in ``pool.stats()``.
    """
    check_pool(pool, model.config)
    for key in ("past_key_values", "cache"):
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
    attention_mask, pads = _prompt_batch(input_ids, attention_mask)
    ids = input_ids.detach().cpu().numpy()
    cache = PagedCache(pool, salt=salt)
    try:
        cache._begin([ids[i, pads[i]:] for i in range(ids.shape[0])], pads)
        hook = model.register_forward_pre_hook(cache._pre_forward, with_kwargs=True)
        try:
            return model.generate(input_ids, attention_mask=attention_mask,
                                  **{cache_keyword(model): cache}, **generate_kwargs)
        finally:
            hook.remove()
    finally:
        cache.free()
