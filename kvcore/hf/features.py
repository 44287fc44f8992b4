"""What a transformers model asks of its KV cache and of its attention, read
from its config: what kvcore holds and computes, and what it refuses by name.

A ``PagedCache`` holds models whose every layer caches, per position, one K
and one V of the same ``(num_kv_heads, head_dim)``.  ``check_holdable``
refuses the others (encoder-decoders, state-space and linear-attention
layers, K and V of different head dims, K/V shared across layers...) at
``pool_for``, ``check_pool`` and ``generate``, before anything is written.

The kvcore attention computes attention that is causal per row, with per
layer a sliding window or a chunk (``lo(p)`` in ``kvcore.AttentionPlan``), a
soft cap, ALiBi slopes and attention sinks.  ``AttentionSpec`` reads what a
model's layers need of these from its config (the windows and chunks its
masks encode even when its attention layers do not pass them: Qwen2-MoE,
PhiMoE, Llama 4); ``check_mask`` verifies, once per step and mask kind, that
the mask transformers asks for restricts no more than that; the attention
function checks every keyword a layer passes (``check_keywords``).
"""
import inspect
import math

import numpy as np
import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

# layer kinds (config.layer_types) kvcore's attention computes
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
_ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)

# layer kinds that keep a state other than one K and one V per position
_STATE_KINDS = ("linear_attention", "mamba", "mamba2", "conv", "recurrent", "rnn", "ssm",
                "hybrid", "hybrid_sliding", "mlstm", "slstm", "rglru", "moe_mamba")

# model types a PagedCache cannot hold, and why: a cache of their own
# (transformers' generate does not give them a DynamicCache either), or what
# the model matrix (tests/hf/test_hf_models.py) found their config does not say
_NOT_HELD = {
    "moshi": "a sliding window that only transformers' DynamicCache applies (it drops keys "
             "past the window at decode while the model's mask is full causal)",
    "mimo_v2_flash": "layers of different K/V shapes (its sliding-window layers have twice "
                     "the KV heads of its full-attention layers)",
    "dory": "recurrent-depth loops (it appends cache layers of its own for each loop)",
    "prophetnet": "a decoder that continues from its cache one token at a time (prefix reuse "
                  "continues with several)",
    "xlm": "no KV cache (its generation feeds the whole sequence again at every step)",
    "reformer": "LSH attention with a bucketed cache of its own",
    "xlnet": "relative attention over memories (mems) of its own",
    "rwkv": "a recurrent (RWKV) state",
    "xlstm": "a recurrent (xLSTM) state",
    "minimax": "lightning (linear) attention layers with a cache of their own",
    "mamba": "a state-space (Mamba) model with no attention layers",
    "mamba2": "a state-space (Mamba-2) model with no attention layers",
    "falcon_mamba": "a state-space (Mamba) model with no attention layers",
}

# model types whose decode reads the K/V of the left padding (their mask
# does not hide it, or is shifted): a PagedCache holds no padding
_READS_PADDING = {
    "git": "it widens the padding mask by image tokens at decode, shifting it onto the "
           "padding columns",
}

# config fields that mean state-space or recurrent layers (in any layer)
_STATE_FIELDS = ("mamba_d_state", "mamba_d_conv", "mamba_expand", "ssm_state_size",
                 "state_size", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "conv_L_cache", "block_types",
                 "hybrid_override_pattern", "attn_layer_indices", "lru_width")


def model_type_of(config):
    text = _text_config(config)
    return getattr(text, "model_type", None) or getattr(config, "model_type", None) \
        or type(config).__name__


def _text_config(config):
    if hasattr(config, "get_text_config"):
        try:
            return config.get_text_config(decoder=True)
        except TypeError:             # (configs whose get_text_config takes no decoder=)
            return config.get_text_config()
    return config


def _field(config, name, default=None):
    """``config.name``, or ``default`` when absent or not readable as one
    value (transformers raises for fields that differ per layer)."""
    try:
        return getattr(config, name, default)
    except Exception:                 # e.g. AmbiguousGlobalPerLayerAttributeError
        return default


def _refuse(config, feature):
    raise ValueError(f"kvcore.hf cannot hold a {model_type_of(config)!r} model: {feature}; "
                     f"run it with its own cache (model.generate without kvcore.hf)")


def _positive(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0


def layer_types(config):
    """The per-layer kinds of a config: ``layer_types`` (or
    ``layers_block_type``), or None when it has none."""
    for name in ("layer_types", "layers_block_type"):
        kinds = _field(config, name)
        if isinstance(kinds, (list, tuple)) and kinds:
            return [str(k) for k in kinds]
    return None


def check_holdable(config, model=None):
    """Raise ValueError naming the model type and the feature unless a
    ``PagedCache`` can hold every layer's K/V of ``config`` (and ``model``,
    when given: its class must use transformers' default cache).

    Called by ``pool_for``, ``check_pool`` and ``generate`` before anything
    is allocated or written.
    """
    text = _text_config(config)
    model_type = model_type_of(config)
    if _field(config, "is_encoder_decoder") or _field(text, "is_encoder_decoder"):
        _refuse(config, "an encoder-decoder model (its decoder's cross-attention reads the "
                        "encoder's K/V)")
    if model_type in _NOT_HELD:
        _refuse(config, _NOT_HELD[model_type])
    if model is not None:
        supports = getattr(type(model), "_supports_default_dynamic_cache", None)
        if callable(supports) and not supports():
            _refuse(config, "a cache of its own (transformers does not give it a DynamicCache)")
        params = inspect.signature(model.forward).parameters
        if "cache" not in params and "past_key_values" not in params:
            _refuse(config, "no KV cache (its forward takes no cache)")
    kinds = layer_types(text)
    if kinds is not None:
        state = sorted({k for k in kinds if k not in _ATTENTION_KINDS
                        and (k in _STATE_KINDS or "mamba" in k or "linear" in k or "conv" in k
                             or "recurr" in k)})
        if state:
            _refuse(config, f"state-space or linear-attention layers (layer kinds {state}: "
                            "their state is not a K and a V per position)")
        squeezed = sorted({k for k in kinds if "compress" in k or "index" in k})
        if squeezed:
            _refuse(config, f"compressed or indexed sparse attention layers (layer kinds "
                            f"{squeezed}: their cache holds compressed K/V)")
    fields = [f for f in _STATE_FIELDS if _field(text, f) is not None]
    if fields:
        _refuse(config, f"state-space or recurrent layers (config fields {fields})")
    if _field(text, "kv_lora_rank") is not None:
        _refuse(config, "multi-head latent attention (MLA: K of head dim "
                        f"{_qk_dim(text)}, V of {_field(text, 'v_head_dim')}); a pool holds one "
                        "head_dim for both")
    v_dim = _field(text, "v_head_dim")
    if _positive(v_dim) and v_dim != _qk_dim(text):
        _refuse(config, f"K and V of different head dims ({_qk_dim(text)} and {v_dim}); a pool "
                        "holds one head_dim for both")
    shared = _field(text, "num_kv_shared_layers")
    if _positive(shared) or _field(text, "kv_source_layers") is not None:
        _refuse(config, "K/V shared across layers (later layers read an earlier layer's "
                        "cache and write none)")
    for name in ("global_head_dim", "swa_head_dim", "swa_num_key_value_heads",
                 "global_num_key_value_heads"):
        if _field(text, name) is not None:
            _refuse(config, f"layers of different K/V shapes (config.{name}); a pool holds "
                            "one (num_kv_heads, head_dim) for every layer")
    stacks = [n for n in ("encoder_config", "global_config", "decoder_config")
              if _field(text, n) is not None]
    if stacks and not _positive(_field(text, "num_hidden_layers")):
        _refuse(config, f"several transformer stacks ({', '.join(stacks)}) of their own shapes "
                        "and cross-attention between them")
    if _field(text, "cross_attention_layers"):
        _refuse(config, "cross-attention layers (they read an image encoder's K/V)")
    try:
        getattr(text, "head_dim", None)
        getattr(text, "num_key_value_heads", None)
    except Exception as e:            # transformers: a per-layer attribute
        _refuse(config, f"layers of different K/V shapes ({e})")


def check_batch(config, pads):
    """Raise ValueError for a left-padded batch (``pads``: padding columns
    per row) of a model whose decode reads the padding's K/V."""
    model_type = model_type_of(config)
    if model_type in _READS_PADDING and int(np.max(pads)) > 0:
        raise ValueError(f"kvcore.hf cannot hold a left-padded batch of a {model_type!r} model: "
                         f"{_READS_PADDING[model_type]}, and a PagedCache holds no padding; "
                         "generate unpadded batches (rows of one length)")


def _qk_dim(config):
    nope, rope = _field(config, "qk_nope_head_dim"), _field(config, "qk_rope_head_dim")
    if _positive(nope) and _positive(rope):
        return int(nope + rope)
    for name in ("qk_head_dim", "head_dim"):
        v = _field(config, name)
        if _positive(v):
            return int(v)
    heads = _field(config, "num_attention_heads")
    hidden = _field(config, "hidden_size")
    if _positive(heads) and _positive(hidden):
        return hidden // heads
    return None


# ------------------------------------------------------------------ attention
class AttentionSpec:
    """What the kvcore attention computes for each layer of a model, from
    its config.

    Attributes
    ----------
    model_type : str
    windows, chunks : list of int
        Per layer: the sliding window or chunk (0: none), from
        ``layer_types`` (``sliding_attention`` -> ``sliding_window``,
        ``chunked_attention`` -> ``attention_chunk_size``), or for configs
        without it ``sliding_window`` on every layer (unless
        ``use_sliding_window`` is false).
    alibi : numpy float32 (num_heads,) or None
        ALiBi slopes already divided by what the model divides its scores
        by (Falcon: ``sqrt(head_dim)``), for the distance ``t - p``.
    alibi_limit : int or None
        The first position at which the model's own ALiBi bias differs
        from ``slope * position`` (Falcon rounds that product to
        bfloat16): sequences reaching it are refused.
    mask_bias : bool
        The model adds its ALiBi bias to the attention mask it builds
        (Falcon): the mask function must return a tensor, which the
        attention ignores (the slopes are computed here).
    refusal : str or None
        A feature of every layer that kvcore's attention cannot compute.
    """

    def __init__(self, config):
        text = _text_config(config)
        self.model_type = model_type_of(config)
        self.num_layers = int(_field(text, "num_hidden_layers", 0) or 0)
        self.refusal = None
        self.alibi = None
        self.alibi_limit = None
        self.mask_bias = False
        window = _field(text, "sliding_window")
        chunk = _field(text, "attention_chunk_size")
        kinds = layer_types(text)
        n = self.num_layers
        self.windows = [0] * n
        self.chunks = [0] * n
        if _field(text, "is_causal", True) is False:
            self.refusal = "bidirectional (non-causal) attention (config.is_causal=False)"
        if kinds is not None:
            sized = {SLIDING: ("sliding_window", window, self.windows),
                     CHUNKED: ("attention_chunk_size", chunk, self.chunks)}
            for i, kind in enumerate(kinds[:n]):
                if kind in sized:
                    field, size, per_layer = sized[kind]
                    if _positive(size):
                        per_layer[i] = int(size)
                    else:
                        self.refusal = f"layer {i} is a {kind} layer but config.{field} is {size!r}"
                elif kind != FULL:
                    self.refusal = f"attention layers of kind {kind!r} (layer {i})"
        elif _positive(window) and _field(text, "use_sliding_window", True) is not False:
            self.windows = [int(window)] * n
        if self.model_type == "falcon" and _field(text, "alibi"):
            self._falcon_alibi(text)

    def _falcon_alibi(self, config):
        """Falcon's ALiBi: per-head slopes rounded to bfloat16 times the key's
        position, divided by sqrt(head_dim), added to the mask the model
        builds (as transformers' ``build_alibi_tensor``)."""
        heads = int(config.num_attention_heads)
        slopes = _alibi_slopes(heads).to(torch.bfloat16)
        head_dim = config.hidden_size // heads
        self.alibi = (slopes.to(torch.float32) / math.sqrt(head_dim)).numpy()
        self.mask_bias = True
        # transformers multiplies the bfloat16 slope by the integer position
        # in bfloat16: equal to slope * position (what kvcore computes) up to
        # the first position where that product rounds
        pos = torch.arange(1 << 16)
        exact = (slopes[:, None] * pos).to(torch.float32) \
            == slopes.to(torch.float32)[:, None] * pos.to(torch.float32)
        bad = ~exact.all(dim=0)
        self.alibi_limit = int(torch.argmax(bad.to(torch.int8))) if bad.any() else 1 << 16

    def kinds(self):
        """The distinct ``(window, chunk)`` of the layers (``(0, 0)``: full)."""
        return set(zip(self.windows, self.chunks))


def _alibi_slopes(num_heads):
    """The ALiBi slopes of ``num_heads`` heads (Press et al.), float32, in the
    arithmetic of transformers' Falcon and BLOOM: a float32 base raised to
    integer powers."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        rest = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * rest, 2,
                                                                   dtype=torch.int32))])
    return slopes


class ModelAttention:
    """What the kvcore attention of one PagedCache knows about its model: the
    config's :class:`AttentionSpec`, the windows the layers pass, and the
    attention sinks each layer passed (recorded so that a step plans them
    once for every layer)."""

    __slots__ = ("spec", "windows", "sinks", "sinks_version", "_sinks_rows", "masks")

    def __init__(self, config):
        check_holdable(config)
        self.spec = AttentionSpec(config)
        self.windows = list(self.spec.windows)
        self.sinks = {}                 # layer -> (tensor, its _version, float32 row)
        self.sinks_version = 0          # bumped whenever a recorded row changes
        self._sinks_rows = None
        self.masks = None               # (forward's first column, kinds its masks encode)

    @classmethod
    def of(cls, cache, config):
        state = cache._attention_state
        if state is None:
            if config is None:
                raise ValueError("the kvcore attention needs the model's config (transformers "
                                 "passes it to the mask function)")
            state = cache._attention_state = cls(config)
        return state

    def check_forward(self, kwargs, q_length):
        """Refuse, before the forward writes anything, what the spec says
        kvcore's attention cannot compute, and a mask that restricts more."""
        spec = self.spec
        if spec.refusal is not None:
            raise ValueError(f"{spec.model_type}: {spec.refusal}, which kvcore's attention "
                             "does not compute; use attn_implementation='sdpa' or 'eager' with "
                             "the PagedCache")
        kv_length = int(kwargs["kv_length"])
        if spec.alibi_limit is not None:
            pads = mask_pads(kwargs.get("attention_mask"), int(kwargs.get("batch_size", 1)),
                             kv_length)
            longest = kv_length - int(pads.min())
            if longest > spec.alibi_limit:
                raise ValueError(
                    f"{spec.model_type}: its ALiBi bias (bfloat16(slope) x position, rounded "
                    f"to bfloat16 by transformers) equals kvcore's slope x distance only below "
                    f"position {spec.alibi_limit}, and this forward reaches position "
                    f"{longest - 1}; use "
                    "attn_implementation='sdpa' or 'eager' with the PagedCache")
        # the kinds of layer this forward's masks encode (a plain causal
        # mask needs no probe); layers whose config window or chunk no mask
        # of the forward carries are refused in layer_kind
        start = int(kwargs.get("q_offset", kv_length - q_length) or 0)
        if self.masks is None or self.masks[0] != start:
            self.masks = (start, set())
        mask_function = kwargs.get("mask_function")
        if mask_function is None or mask_function is causal_mask_function:
            self.masks[1].add((0, 0))
            return
        local = kwargs.get("local_size")
        self.masks[1].update(check_mask(
            spec, mask_function, int(kwargs.get("batch_size", 1)), int(q_length), kv_length,
            start, int(kwargs.get("kv_offset", 0) or 0), kwargs.get("attention_mask"),
            bool(kwargs.get("use_vmap", False)), local if _positive(local) else None))

    def layer_kind(self, layer, sliding_window, seq_lens):
        """``(window, chunk)`` of ``layer`` (0: none) in a step whose rows
        have ``seq_lens`` positions: the window the layer passes, else
        its config's (refused when the window or chunk matters in this step
        and none of the forward's masks carries it: transformers' own cache
        would apply it, not the attention)."""
        window = self.layer_window(layer, sliding_window)
        chunk = self.spec.chunks[layer] if layer < len(self.spec.chunks) else 0
        if sliding_window is None and (window or chunk) and self.masks is not None \
                and (window, chunk) not in self.masks[1] \
                and int(np.max(seq_lens)) > (window or chunk):
            what = f"sliding window {window}" if window else f"chunk {chunk}"
            raise ValueError(
                f"{self.spec.model_type} layer {layer}: its config gives a {what} that neither "
                "the layer passes nor its attention mask carries (transformers' cache would "
                "apply it); kvcore's attention cannot tell where it applies")
        return window, chunk

    def layer_window(self, layer, sliding_window):
        """The window of ``layer``: the one it passes, else the config's."""
        known = self.windows[layer] if layer < len(self.windows) else 0
        if sliding_window is None:
            return known
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
                or sliding_window < 0:
            raise ValueError(f"{self.spec.model_type} layer {layer}: sliding_window must be a "
                             f"non-negative int or None, got {sliding_window!r}")
        if known and sliding_window and known != sliding_window:
            raise ValueError(f"{self.spec.model_type} layer {layer}: the layer passes "
                             f"sliding_window={sliding_window}, its config and mask say {known}")
        if sliding_window and layer < len(self.windows):
            self.windows[layer] = sliding_window
        return sliding_window or known

    def sinks_key(self, layer, sinks, heads):
        """The plan key of ``layer``'s sinks and the rows that plan takes:
        ``("all", version)`` with every layer's rows once each layer's sinks
        are recorded and unchanged, else ``("layer", layer)`` with its row."""
        if sinks is None:
            return None, None
        name = self.spec.model_type
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,):
            raise ValueError(f"{name} layer {layer}: s_aux (attention sinks) must be one logit "
                             f"per query head ({heads},), got "
                             f"{tuple(getattr(sinks, 'shape', ()))}; kvcore's attention "
                             "computes per-head sinks only")
        known = self.sinks.get(layer)
        if known is None or known[0] is not sinks or known[1] != sinks._version:
            row = sinks.detach().to("cpu", torch.float32).numpy().copy()
            self.sinks[layer] = (sinks, sinks._version, row)
            self.sinks_version += 1
            self._sinks_rows = None
            return ("layer", layer), row
        if len(self.sinks) == self.spec.num_layers:
            if self._sinks_rows is None:
                self._sinks_rows = np.stack([self.sinks[i][2] for i in range(len(self.sinks))])
            return ("all", self.sinks_version), self._sinks_rows
        return ("layer", layer), known[2]


# keywords transformers passes to an attention function that change nothing
# in what it computes (positions are the cache's own; flags of other paths)
_NEUTRAL = {"position_ids", "cache_position", "use_cache", "output_attentions",
            "output_hidden_states", "return_dict", "past_key_value", "past_key_values",
            "layer_idx", "position_embeddings", "token_type_ids", "logits_to_keep",
            "is_causal", "target_dtype"}


def check_keywords(spec, layer, kwargs):
    """Raise ValueError naming the first keyword of an attention call that
    asks for something the kvcore attention does not compute (any keyword
    it does not know, with a value other than None/False/0)."""
    refusal = keyword_refusal(kwargs)
    if refusal is not None:
        raise ValueError(f"{spec.model_type} layer {layer}: {refusal}")


def keyword_refusal(kwargs):
    """What :func:`check_keywords` says of ``kwargs`` after the layer's
    name, or None where the attention can serve them."""
    for name, value in kwargs.items():
        if name in _NEUTRAL:
            if name == "is_causal" and value is False:
                return "the attention is called with is_causal=False (bidirectional); " \
                       "kvcore's attention is causal"
            if name == "output_attentions" and value:
                return "output_attentions=True asks for the attention weights, which " \
                       "kvcore's attention does not form; use attn_implementation='eager'"
            continue
        if value is None or value is False or (isinstance(value, (int, float)) and value == 0):
            continue
        return (f"its attention asks for {name}= ({describe(value)}), which kvcore's attention "
                "does not compute; use attn_implementation='sdpa' or 'eager' with the PagedCache")
    return None


def describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


# ------------------------------------------------------------------ masks
_PROBE_ROWS = 64


def check_mask(spec, mask_function, batch_size, q_length, kv_length, q_offset, kv_offset,
               attention_mask, use_vmap, local_size=None):
    """The ``(window, chunk)`` kinds (``(0, 0)``: none) that the mask
    transformers asks for is consistent with, among causal, the spec's
    kinds and ``local_size`` (the window or chunk transformers' sliding and
    chunked masks are made for) as a window or a chunk; ValueError when it
    is none of them (it restricts keys otherwise, or is not causal).

    The mask is evaluated as sdpa would, without padding, at the step's
    query rows (at most the first and last 64 of a long prefill) over every
    key column; a row's padding columns are not compared (kvcore has none).
    Several kinds remain while the step's rows are too short to tell them
    apart (they then compute the same).
    """
    pads = mask_pads(attention_mask, batch_size, kv_length + kv_offset)
    rows = []
    if q_length <= 2 * _PROBE_ROWS:
        rows.append((q_offset, q_length))
    else:
        rows.append((q_offset, _PROBE_ROWS))
        rows.append((q_offset + q_length - _PROBE_ROWS, _PROBE_ROWS))
    candidates = {(0, 0)} | spec.kinds()
    if local_size is not None:
        candidates |= {(local_size, 0), (0, local_size)}
    for start, n in rows:
        got = sdpa_mask(batch_size=batch_size, q_length=n, kv_length=kv_length,
                        q_offset=start, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=None, allow_is_causal_skip=False, use_vmap=use_vmap,
                        device="cpu")
        if got is None:
            raise ValueError(f"{spec.model_type}: transformers gave no mask to check")
        got = got.detach().to("cpu", torch.bool).expand(batch_size, -1, -1, -1)[:, 0]
        q_cols = torch.arange(start, start + n)
        kv_cols = torch.arange(kv_offset, kv_offset + kv_length)
        candidates = {k for k in candidates if _matches(got, q_cols, kv_cols, pads, *k)}
        if not candidates:
            raise ValueError(
                f"{spec.model_type}: its attention mask restricts keys beyond what kvcore's "
                "attention computes (causal per row, with "
                f"{_kinds_text(spec)}); use attn_implementation='sdpa' or 'eager' with "
                "the PagedCache")
    return candidates


def _kinds_text(spec):
    parts = sorted(f"window {w}" if w else f"chunk {c}" for w, c in spec.kinds() if w or c)
    return ", ".join(parts) if parts else "no window"


def mask_pads(attention_mask, batch_size, columns):
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
        m = attention_mask.detach().to("cpu", torch.bool)
        real = m.any(dim=1)
        pads = torch.where(real, torch.argmax(m.to(torch.int8), dim=1), columns)
        return pads.to(torch.int64)
    return torch.zeros(batch_size, dtype=torch.int64)


def _matches(got, q_cols, kv_cols, pads, window, chunk):
    """Whether ``got`` (batch, q, kv) is causal per row with ``window`` /
    ``chunk`` at every real query and key column."""
    pad = pads[:, None, None]
    p = q_cols[None, :, None] - pad                    # the query's position
    t = kv_cols[None, None, :] - pad                   # the key's position
    lo = torch.zeros_like(p)
    if window:
        lo = torch.maximum(lo, p + 1 - window)
    if chunk:
        lo = torch.maximum(lo, torch.div(p, chunk, rounding_mode="floor") * chunk)
    want = (t >= lo) & (t <= p)
    real = (p >= 0) & (t >= 0)
    return bool(torch.equal(got & real, want & real))
