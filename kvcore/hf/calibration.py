"""fp8 K/V scales measured on a sample: ``calibrate_kv_scales``."""
import numpy as np
import torch

from .config import model_kv_shape
from .inputs import _prompt_batch, cache_keyword

# the largest finite value of each fp8 format (OCP FP8 spec)
_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def calibrate_kv_scales(model, input_ids, attention_mask=None, dtype="float8_e4m3fn",
                        per_head=False):
    """Per-layer (or per-layer and KV head) K/V scales for an fp8 pool,
    measured on a sample.

    One forward of ``input_ids`` (with a ``DynamicCache``); for each layer
    ``k_scale = max|K| / fp8_max`` and ``v_scale = max|V| / fp8_max`` over
    the sample's real tokens (padding excluded), so that the sample's largest
    value is stored as the format's largest finite one and nothing it holds
    saturates.  Pass the result to ``pool_for(..., kv_scales=...)``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    input_ids : torch.LongTensor ``(batch, length)``
        A sample of the text the pool will serve (a few hundred tokens or more).
    attention_mask : torch.Tensor ``(batch, length)``, optional
        1 for tokens, 0 for (left) padding.
    dtype : {"float8_e4m3fn", "float8_e5m2"}
        The pool's storage dtype (its largest finite value sets the scale).
    per_head : bool, default False
        One scale per KV head: ``max|K|`` / ``max|V|`` of each head over
        the sample's real tokens, divided by the format's largest value.

    Raises ValueError, before the forward, for an input batch of no rows,
    and after it when a layer's K or V is not finite (NaN or inf) at a real
    token, naming the layer: no scale fits such a sample.

    Returns
    -------
    list of (float, float), or with ``per_head`` list of (tuple, tuple)
        ``(k_scale, v_scale)`` per layer (1.0 for a layer whose sample is all
        zero); with ``per_head``, each of them a tuple of ``num_kv_heads``
        floats (1.0 for an all-zero head).

    Notes
    -----
    One scale per layer: real K activations have outlier channels, which a
    per-layer scale stretches over the whole format (the perplexity
    benchmark, ``bench/bench_hf.py --perplexity``, measures what that costs).
    Per-head scales fit each head's own range (heads differ widely) at no
    cost per token: the pool holds ``2 * num_layers * num_kv_heads`` floats.
    int8 pools need no calibration (a scale per token and head, computed
    on write).
    """
    if dtype not in _FP8_MAX:
        raise ValueError(f"dtype must be one of {sorted(_FP8_MAX)} (int8 pools scale each "
                         f"token themselves), got {dtype!r}")
    if not isinstance(per_head, (bool, np.bool_)):
        raise TypeError(f"per_head must be a bool, got {type(per_head).__name__} {per_head!r}")
    attention_mask, _ = _prompt_batch(input_ids, attention_mask, model)
    layers = model_kv_shape(model.config)[0]
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, use_cache=True,
              **{cache_keyword(model): cache})
    real = attention_mask.bool()[:, None, :, None]         # (batch, 1, length, 1)
    top = _FP8_MAX[dtype]
    scales = []
    for i in range(layers):
        layer = cache.layers[i]
        pair = []
        for name, t in (("K", layer.keys), ("V", layer.values)):  # (batch, kv_heads, length, dim)
            a = t.detach().float().abs().masked_fill(~real, 0)
            if not bool(torch.isfinite(a).all()):
                raise ValueError(
                    f"the sample's {name} activations of layer {i} are not finite (NaN or inf "
                    "at a real token): no scale can be measured from them; calibrate on a "
                    "sample the model computes in range")
            if per_head:
                pair.append(tuple(_fp8_scale(float(m), top) for m in a.amax(dim=(0, 2, 3))))
            else:
                pair.append(_fp8_scale(float(a.max()), top))
        scales.append(tuple(pair))
    return scales


def _fp8_scale(m, top):
    """``m / top`` as the pool keeps it (float32), or 1.0 where that is not
    a positive finite number (an all-zero sample, or one so small that the
    quotient underflows float32: a pool refuses a scale of 0)."""
    with np.errstate(under="ignore", over="ignore"):
        s = np.float32(m) / np.float32(top)
    return float(s) if np.isfinite(s) and s > 0 else 1.0
