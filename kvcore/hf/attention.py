"""``attn_implementation="kvcore"``: the attention function and mask function
transformers calls, reading a PagedCache's pages through one AttentionPlan per step
(and, in a compiled forward, the attention's operator: ``compiled.py``)."""
import contextlib
import types
from typing import Optional

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..attention import AttentionPlan
from .cache import PagedCache, _mask_call
from . import compiled
from .features import ModelAttention, check_keywords, describe, keyword_refusal
from .inputs import _query_length
from .step import Step
from .threads import attention_threads

#: the name registered with transformers' attention and mask registries
ATTN_IMPLEMENTATION = "kvcore"


@torch.compiler.disable
def _kvcore_mask(*args, **kwargs):
    """Mask function of ``attn_implementation="kvcore"``: a PagedCache needs
    no mask (the kernel is causal over each row's own positions, with the
    windows and chunks of the model's layers); it gets the forward's padding
    mask instead, and the mask transformers asks for is checked to
    restrict no more than the model's attention spec computes (before any
    layer writes).  Otherwise sdpa's mask."""
    ref = getattr(_mask_call, "cache", None)
    cache = ref() if ref is not None else None
    _mask_call.cache = None
    if isinstance(cache, PagedCache) and not args:
        if "q_length" in kwargs:
            q_length = kwargs["q_length"]
        else:                                  # transformers 5.0-5.x
            q_length = _query_length(kwargs.get("cache_position", 0), "cache_position")
        if cache._length + q_length == kwargs.get("kv_length"):
            state = ModelAttention.of(cache, kwargs.get("config"))
            state.check_forward(kwargs, q_length)
            cache._kvcore_forward = True
            compiled.begin_forward(cache)
            # (the padding of the rows: PagedCache._start_rows, _later_pads)
            cache._pending_mask = kwargs.get("attention_mask")
            if state.spec.mask_bias:
                # (Falcon adds its ALiBi bias to this mask; the attention
                # computes the bias from the slopes and ignores the mask)
                return sdpa_mask(*args, **kwargs)
            return None
    return sdpa_mask(*args, **kwargs)


def kvcore_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, softcap=None, **kwargs):
    """``attn_implementation="kvcore"``: attention over the pages of a
    :class:`PagedCache` with one :class:`kvcore.AttentionPlan` per step.

    ``query`` ``(batch, num_heads, q, head_dim)``; returns ``(batch, q,
    num_heads, head_dim)`` in ``query.dtype`` (and no weights).
    ``PagedCache.update`` fills ``cache``, ``block_table`` and
    ``cu_seq_lens_q`` (transformers' names for a paged attention's
    arguments), ``kvcore_step`` and ``kvcore_layer`` in the keyword arguments
    transformers passes to both; without them (another cache, or none) the
    call goes to sdpa (or, for a layer with a soft cap or sinks, which sdpa
    does not take, to the eager attention of :func:`_eager_fallback`).
    ``s_aux`` (per-head attention sinks) is computed;
    any other keyword that asks for something (a position bias, per-token
    sinks, sparse indices...) raises ValueError naming it, and the step is
    undone.
    """
    traced = kwargs.pop("kvcore_traced", None)
    if traced is not None:
        if not torch.compiler.is_compiling():     # (kvcore::handoff ran: it raises)
            raise RuntimeError("the K/V of a traced PagedCache.update reached the kvcore "
                               "attention outside the compiled region")
        return traced_attention(module, query, key, value, attention_mask, dropout, scaling,
                                sliding_window, softcap, traced, kwargs)
    return kvcore_eager_attention(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, sliding_window=sliding_window,
                                  softcap=softcap, **kwargs)


@torch.compiler.disable
def kvcore_eager_attention(module, query, key, value, attention_mask, dropout=0.0,
                           scaling=None, sliding_window=None, softcap=None, cache=None,
                           block_table=None, cu_seq_lens_q=None, kvcore_step=None,
                           kvcore_layer=None, **kwargs):
    """:func:`kvcore_attention` as it runs eagerly (and in the compiled
    route's attention operator, at run time)."""
    ref = None
    if kvcore_step is None or not isinstance(cache, PagedCache):
        ref = getattr(key, "_kvcore", None)      # (see PagedCache.update)
        if ref is None:
            if softcap is not None or kwargs.get("s_aux") is not None:
                return _eager_fallback(module, query, key, value, attention_mask, dropout,
                                       scaling, softcap, kwargs)
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling,
                                          sliding_window=sliding_window, softcap=softcap,
                                          **kwargs)
        cache, kvcore_step, kvcore_layer = ref[:3]
    try:
        return _kvcore_attention(module, query, (key, value), cache, kvcore_step, kvcore_layer,
                                 ref, block_table, cu_seq_lens_q, dropout, scaling,
                                 sliding_window, softcap, attention_mask, kwargs)
    except BaseException:
        # (a plan the backend refuses, e.g. a head_dim its kernels do not
        # take, a feature the model asks for that kvcore does not compute,
        # or anything else here): the step's K/V are undone, the cache is as
        # before the forward
        Step.undo_failed(cache, cache._step, kvcore_step)
        raise


def _kvcore_attention(module, query, new_kv, cache, step, layer, ref, block_table,
                      cu_seq_lens_q, dropout, scaling, sliding_window, softcap, attention_mask,
                      kwargs):
    if ref is not None:
        step.attention_tables(cache)
        block_table, cu_seq_lens_q = step.tables, step.query_start
    if dropout and module.training:
        raise NotImplementedError("attn_implementation='kvcore' has no attention dropout; "
                                  "use model.eval() or another attention for training")
    state = ModelAttention.of(cache, getattr(module, "config", None))
    spec = state.spec
    sinks = kwargs.pop("s_aux", None)
    check_keywords(spec, layer, kwargs)
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{spec.model_type} layer {layer}: the attention layer is not causal "
                         "(module.is_causal=False); kvcore's attention is causal")
    if attention_mask is not None and not spec.mask_bias:
        raise ValueError(f"{spec.model_type} layer {layer}: the model hands its attention a mask "
                         f"of its own ({describe(attention_mask)}), which kvcore's attention "
                         "does not read; use attn_implementation='sdpa' or 'eager' with the "
                         "PagedCache")
    batch, heads, q, dim = query.shape
    window, chunk = state.layer_kind(layer, sliding_window, step.seq_lens)
    sinks_key, sinks_rows = state.sinks_key(layer, sinks, heads)
    if q > 1 and cache._prefill_sdpa(query.dtype) and _fresh_causal(
            step, q, window, chunk, softcap, sinks_rows, spec):
        return _sdpa_prefill(query, new_kv, scaling), None
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
    # one plan per step and kind of layer (scale, window, chunk, cap,
    # sinks), made at the first layer of that kind: the tables are checked
    # and the work split once, and each layer only runs it
    key = (scaling, window, chunk, softcap, sinks_key)
    features = dict(scale=scaling, sliding_window=window or None, logits_soft_cap=softcap)
    if chunk:
        features["chunk_size"] = chunk
    if spec.alibi is not None:
        features["alibi_slopes"] = spec.alibi
    if sinks_rows is not None:
        features["sinks"] = sinks_rows
    lane = cache._lane
    if lane is not None and len(features) > 3:
        lane = None      # the step lane's plans take (scale, window, cap) only
    if lane is None:
        # (a CUDA pool's plan runs on torch's current stream)
        with cache._torch.stream() if cache._torch.cuda else contextlib.nullcontext():
            _run_plan(cache, step, (key, features), block_table, cu_seq_lens_q, heads, rows,
                      layer, flat)
    else:
        # a CUDA pool: the step's plan over its device buffers, run by
        # address on torch's current stream
        lane_key = (scaling, window or None, softcap)
        with cache._torch.stream():
            if step.query_rows is None:
                lane.attend(step, lane_key, layer, rows, flat)
            else:
                part = flat.new_empty((rows.shape[0],) + tuple(flat.shape[1:]))
                lane.attend(step, lane_key, layer, rows, part)
                flat[step.query_rows] = part
    return out, None


def _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, softcap,
                    kwargs):
    """The attention of a layer with a soft cap (Gemma 2) or per-head sinks
    (``s_aux``: gpt-oss) on another cache than a PagedCache, or none, as
    transformers' eager attention computes it (sdpa takes neither):
    ``(batch, q, num_heads, head_dim)``.  ``attention_mask`` is the one
    :func:`_kvcore_mask` made (sdpa's: boolean, float, or None where the
    forward's own columns are plainly causal)."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q, k = scores.shape[-2:]
    low = torch.finfo(scores.dtype).min
    bias = kwargs.get("position_bias")
    if bias is not None:
        scores = scores + bias
    if attention_mask is None:
        if q > 1 and getattr(module, "is_causal", True):
            # (sdpa's mask left out: the forward's columns are the only
            # ones, causal among themselves; sdpa's rule, key column i
            # seen from query row i on)
            seen = torch.ones(q, k, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~seen, low)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :k], low)
    else:
        scores = scores + attention_mask[..., :k]
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, q, 1)
        scores = torch.cat([scores, column.to(scores.dtype)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nn.functional.dropout(probs.to(value.dtype), p=dropout,
                                        training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _fresh_causal(step, q, window, chunk, softcap, sinks_rows, spec):
    """Whether this layer's attention is plain causal attention among the
    step's own ``q`` new positions: every row's first forward (no cached
    position before it, no padding column), no soft cap, sinks or ALiBi,
    and a window or chunk (if any) that hides none of them."""
    return step.query_rows is None and bool((step.seq_lens == q).all()) \
        and (not window or window >= q) and (not chunk or chunk >= q) \
        and not softcap and sinks_rows is None and spec.alibi is None


def _sdpa_prefill(query, new_kv, scaling):
    """torch's ``scaled_dot_product_attention`` over the step's new K/V, as
    transformers' sdpa attention calls it (``PagedCache(prefill_attention=)``):
    ``(batch, q, num_heads, head_dim)``."""
    with torch._C.DisableTorchFunctionSubclass():     # (the marked K/V: handoff.py)
        key, value = (t.as_subclass(torch.Tensor) for t in new_kv)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def _run_plan(cache, step, kind, block_table, cu_seq_lens_q, heads, rows, layer, flat):
    key, features = kind           # (the plan's key in the step, its keywords)
    plan = step.plans.get(key)
    if plan is None:
        plan = step.plans[key] = AttentionPlan(
            cache.pool, block_table, step.seq_lens, cu_seq_lens_q, num_heads=heads,
            num_threads=attention_threads(), **features)
    # queries and outputs stay in the model's dtype: the plan widens a
    # 16-bit model's rows and narrows the result with kvcore's conversions
    if step.query_rows is None:
        plan.run(rows, layer, out=flat)
    else:
        part = flat.new_empty((rows.shape[0],) + tuple(flat.shape[1:]))
        plan.run(rows, layer, out=part)
        flat[step.query_rows] = part


# ------------------------------------------------------------------ compiled
@torch.library.custom_op("kvcore::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           sinks: Optional[torch.Tensor], mask: Optional[torch.Tensor], cache_id: torch.Tensor,
           layer: int, scaling: Optional[float], window: Optional[int],
           softcap: Optional[float], dropout: float, training: bool, causal: bool,
           first: Optional[torch.Tensor], refusal: str) -> torch.Tensor:
    """The layer's update and attention at run time: ``(batch, q, heads,
    head_dim)``.  ``first``: for a layer's later attention calls, the first
    call's result (only so that they run after it: the first one writes)."""
    cache = compiled.current(cache_id, layer)
    if refusal:
        compiled.refuse(cache, layer, refusal)
    if first is None:
        tables = {}
        key, value = cache.eager_update(key, value, layer, kwargs=tables)
    else:
        tables = cache.attention_arguments(cache._step, layer)
    if sinks is not None:
        tables["s_aux"] = sinks
    module = types.SimpleNamespace(training=training, is_causal=causal, config=None)
    out, _ = kvcore_eager_attention(module, query, key, value, mask, dropout=dropout,
                                    scaling=scaling, sliding_window=window, softcap=softcap,
                                    **tables)
    return out


@attend.register_fake
def _(query, key, value, sinks, mask, cache_id, layer, scaling, window, softcap, dropout,
      training, causal, first, refusal):
    batch, heads, q, dim = query.shape
    return query.new_empty((batch, q, heads, dim))


def traced_attention(module, query, key, value, attention_mask, dropout, scaling,
                     sliding_window, softcap, traced, kwargs):
    """``kvcore_attention`` while torch's compiler traces it after a
    traced ``update`` of the same region (``compiled.traced_update``)."""
    cache_id, key_states, value_states, handed_key, handed_value, layer, first = traced
    sinks = kwargs.pop("s_aux", None)
    if key is not handed_key or value is not handed_value:
        refusal = compiled.COMPUTES.format(
            "in its compiled forward: it hands the attention other K/V than the cache's update "
            "returned")
    else:
        refusal = keyword_refusal(kwargs) or ""
    out = attend(query.detach(), key_states, value_states,
                 None if sinks is None else sinks.detach(), attention_mask, cache_id, layer,
                 scaling, sliding_window, softcap, float(dropout), bool(module.training),
                 getattr(module, "is_causal", True) is not False, first, refusal)
    if first is None:
        traced[-1] = out
    return out, None
