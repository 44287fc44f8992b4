"""The float64 reference of paged attention (``paged_attention_reference``),
which ``Backend.paged_attention`` runs and every attention kernel is held
to; re-exported by ``kvcore.backends.base``.
"""
import numpy as np

from .. import dtypes
from .elements import fp8_decode, int8_decode


# ---------------------------------------------------------------- attention
# The float64 reference of paged attention: one sequence and one KV head at
# a time, the context gathered through the block table, the causal window
# spelled out position by position.  Written to be obviously correct, not
# fast; ``Backend.paged_attention`` runs it and every kernel is held to it.

def stored_values(cache, kind=None, scales=None):
    """The stored elements of a cache as float64.

    ``cache`` is float32, float16, ml_dtypes.bfloat16, or uint16 holding
    bfloat16 bits (then ``kind`` must be "bfloat16"); or low precision:
    uint8 fp8 bits with ``kind`` "float8_e4m3fn" / "float8_e5m2" (``scales``
    the layer's float scale, default 1, or float32 ``(num_kv_heads,)``: one
    per kv head, axis -3), int8 codes with ``kind="int8"``
    (``scales`` one float32 per row: ``cache.shape[:-1]``).  A low-precision
    value is the float32 ``element * scale`` the pool reads back.
    """
    a = np.asarray(cache)
    if kind in ("float8_e4m3fn", "float8_e5m2"):
        if scales is not None and np.ndim(scales):      # per kv head
            heads = np.asarray(scales, np.float32)[:, None, None]
            return (fp8_decode(a, dtypes.NAME_KIND[kind]) * heads).astype(np.float64)
        return fp8_decode(a, dtypes.NAME_KIND[kind],
                          1.0 if scales is None else scales).astype(np.float64)
    if kind == "int8":
        return int8_decode(a, scales).astype(np.float64)
    if a.dtype == np.uint16:
        if kind != "bfloat16":
            raise TypeError("a uint16 cache holds bfloat16 bits only when kind='bfloat16'")
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def paged_attention_reference(q, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc=None, scale=None, sliding_window=None,
                              logits_soft_cap=None, kind=None, key_scales=None,
                              value_scales=None, chunk_size=None, alibi_slopes=None,
                              sinks=None):
    """Attention over a paged cache, in float64.

    Parameters
    ----------
    q : array ``(num_query_tokens, num_heads, head_dim)``
    key_cache, value_cache : arrays ``(num_blocks, num_kv_heads, block_size, head_dim)``
        The stored values (float32, float16, bfloat16; uint16 bits with
        ``kind="bfloat16"``; fp8 bits or int8 codes with their ``kind``).
    key_scales, value_scales : optional
        Low precision (see :func:`stored_values`): an fp8 layer's float
        scales (or per-kv-head ones), or an int8 layer's scale planes ``(num_blocks, num_kv_heads,
        block_size)``.
    block_tables : integer array ``(num_seqs, max_blocks)``
    seq_lens : integer array ``(num_seqs,)``
        KV length of each sequence, its query tokens included.
    query_start_loc : integer array ``(num_seqs + 1,)``, optional
        Sequence s owns query rows ``query_start_loc[s] .. query_start_loc[s+1]-1``;
        default one query per sequence.
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Each query sees only the last ``sliding_window`` positions up to its own.
    logits_soft_cap : float, optional
        Scores become ``c * tanh(score / c)`` before the softmax.
    chunk_size : int, optional
        A query at position ``p`` sees no position before ``(p // chunk_size)
        * chunk_size`` (its chunk's start; with a window too, the later start).
    alibi_slopes : array ``(num_heads,)``, optional
        ``alibi_slopes[h] * (t - p)`` is added to query head ``h``'s score of
        key ``t`` (after the soft cap).
    sinks : array ``(num_heads,)``, optional
        A logit per query head joining each row's softmax denominator:
        ``w_t = exp(x_t) / (sum exp(x_t') + exp(sinks[h]))``.

    Returns
    -------
    float64 array ``(num_query_tokens, num_heads, head_dim)``
    """
    q = stored_values(q, kind if np.asarray(q).dtype == np.uint16 else None)
    k_all = stored_values(key_cache, kind, key_scales)
    v_all = stored_values(value_cache, kind, value_scales)
    block_tables = np.asarray(block_tables)
    seq_lens = np.asarray(seq_lens)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_all.shape
    group = num_heads // num_kv_heads
    if query_start_loc is None:
        query_start_loc = np.arange(len(seq_lens) + 1)
    query_start_loc = np.asarray(query_start_loc)
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float64)
    sink = None if sinks is None else np.asarray(sinks, np.float64)
    out = np.zeros((num_tokens, num_heads, head_dim), np.float64)
    for s in range(len(seq_lens)):
        length = int(seq_lens[s])
        first, stop = int(query_start_loc[s]), int(query_start_loc[s + 1])
        m = stop - first
        if m == 0:
            continue
        positions = np.arange(length)
        blocks = block_tables[s, positions // block_size]
        offsets = positions % block_size
        for g in range(num_kv_heads):
            k = k_all[blocks, g, offsets]          # (length, head_dim)
            v = v_all[blocks, g, offsets]
            for j in range(m):
                pos = length - m + j               # this query's position
                visible = positions <= pos
                if sliding_window is not None:
                    visible &= positions > pos - sliding_window
                if chunk_size is not None:
                    visible &= positions >= pos // chunk_size * chunk_size
                heads = slice(g * group, (g + 1) * group)
                scores = q[first + j, heads] @ k[visible].T * scale   # (group, n_visible)
                if logits_soft_cap is not None:
                    scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
                if slopes is not None:
                    scores += slopes[heads, None] * (positions[visible] - pos)[None, :]
                top = scores.max(axis=1, keepdims=True)
                if sink is not None:
                    top = np.maximum(top, sink[heads, None])
                weights = np.exp(scores - top)
                total = weights.sum(axis=1, keepdims=True)
                if sink is not None:
                    total += np.exp(sink[heads, None] - top)
                out[first + j, heads] = weights / total @ v[visible]
    return out
