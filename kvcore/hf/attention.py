"""``attn_implementation="kvcore"``: the attention function and mask function
transformers calls, reading a PagedCache's pages through one AttentionPlan per step."""
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..attention import AttentionPlan
from .cache import PagedCache, _mask_call
from .inputs import _query_length
from .step import Step

#: the name registered with transformers' attention and mask registries
ATTN_IMPLEMENTATION = "kvcore"


def _kvcore_mask(*args, **kwargs):
    """Mask function of ``attn_implementation="kvcore"``: a PagedCache needs
    no mask (the kernel is causal over each row's own positions); it gets the
    padding of a first forward instead.  Otherwise sdpa's mask."""
    ref = getattr(_mask_call, "cache", None)
    cache = ref() if ref is not None else None
    _mask_call.cache = None
    if isinstance(cache, PagedCache) and not args:
        if "q_length" in kwargs:
            q_length = kwargs["q_length"]
        else:                                  # transformers 5.0-5.x
            q_length = _query_length(kwargs.get("cache_position", 0))
        if cache._length + q_length == kwargs.get("kv_length"):
            cache._kvcore_forward = True
            mask = kwargs.get("attention_mask")
            if not cache._seqs and mask is not None:
                cache._pending_mask = mask
            return None
    return sdpa_mask(*args, **kwargs)


def kvcore_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, softcap=None, cache=None, block_table=None,
                     cu_seq_lens_q=None, kvcore_step=None, kvcore_layer=None, **kwargs):
    """``attn_implementation="kvcore"``: attention over the pages of a
    :class:`PagedCache` with one :class:`kvcore.AttentionPlan` per step.

    ``query`` ``(batch, num_heads, q, head_dim)``; returns ``(batch, q,
    num_heads, head_dim)`` in ``query.dtype`` (and no weights).
    ``PagedCache.update`` fills ``cache``, ``block_table`` and
    ``cu_seq_lens_q`` (transformers' names for a paged attention's
    arguments), ``kvcore_step`` and ``kvcore_layer`` in the keyword arguments
    transformers passes to both; without them (another cache, or none) the
    call goes to sdpa.
    """
    ref = None
    if kvcore_step is None or not isinstance(cache, PagedCache):
        ref = getattr(key, "_kvcore", None)      # (see PagedCache.update)
        if ref is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling,
                                          sliding_window=sliding_window, softcap=softcap,
                                          **kwargs)
        cache, kvcore_step, kvcore_layer = ref
    try:
        return _kvcore_attention(module, query, cache, kvcore_step, kvcore_layer, ref,
                                 block_table, cu_seq_lens_q, dropout, scaling, sliding_window,
                                 softcap)
    except BaseException:
        # (a plan the backend refuses, e.g. a head_dim its kernels do not
        # take, or anything else here): the step's K/V are undone, the
        # cache is as before the forward
        Step.undo_failed(cache, cache._step, kvcore_step)
        raise


def _kvcore_attention(module, query, cache, step, layer, ref, block_table, cu_seq_lens_q,
                      dropout, scaling, sliding_window, softcap):
    if ref is not None:
        step.attention_tables(cache)
        block_table, cu_seq_lens_q = step.tables, step.query_start
    if dropout and module.training:
        raise NotImplementedError("attn_implementation='kvcore' has no attention dropout; "
                                  "use model.eval() or another attention for training")
    batch, heads, q, dim = query.shape
    if q == 1:
        rows = query.detach().reshape(batch, heads, dim)
    else:
        rows = query.detach().transpose(1, 2).reshape(batch * q, heads, dim)
    if step.query_rows is None:
        out = torch.empty((batch, q, heads, dim), dtype=query.dtype, device=query.device)
    else:   # padding columns of a first forward: zeros
        out = torch.zeros((batch, q, heads, dim), dtype=query.dtype, device=query.device)
    flat = out.view(batch * q, heads, dim)
    if step.query_rows is not None:
        rows = rows[step.query_rows]
    # one plan per step (per scale/window/cap: layers may differ in window),
    # made at the step's first layer: the tables are checked and the work
    # split once, and each layer only runs it
    key = (scaling, sliding_window, softcap)
    if not cache._torch.cuda:
        _run_plan(cache, step, key, block_table, cu_seq_lens_q, heads, rows, layer, flat)
    else:
        with cache._torch.stream():
            _run_plan(cache, step, key, block_table, cu_seq_lens_q, heads, rows, layer, flat)
    return out, None


def _run_plan(cache, step, key, block_table, cu_seq_lens_q, heads, rows, layer, flat):
    plan = step.plans.get(key)
    if plan is None:
        scaling, sliding_window, softcap = key
        plan = step.plans[key] = AttentionPlan(
            cache.pool, block_table, step.seq_lens, cu_seq_lens_q, scale=scaling,
            sliding_window=sliding_window, logits_soft_cap=softcap, num_heads=heads)
    # queries and outputs stay in the model's dtype: the plan widens a
    # 16-bit model's rows and narrows the result with kvcore's conversions
    if step.query_rows is None:
        plan.run(rows, layer, out=flat)
    else:
        part = flat.new_empty((rows.shape[0],) + tuple(flat.shape[1:]))
        plan.run(rows, layer, out=part)
        flat[step.query_rows] = part
