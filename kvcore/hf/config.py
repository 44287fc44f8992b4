"""A model's KV shape from its transformers config, and a pool that fits it."""
import numpy as np

from .._ints import shown
from ..pool import BlockPool
from .features import check_holdable
from .torch_bridge import _on_cuda, use_torch_allocator


def model_kv_shape(config):
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config.

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (or
    ``num_attention_heads``) and ``head_dim`` (or ``hidden_size //
    num_attention_heads``) of ``config.get_text_config(decoder=True)``.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    name = type(config).__name__

    def positive(attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"config.{attr} must be a positive integer for a KV cache, "
                             f"got {shown(value)} ({name})")
        return int(value)

    layers = positive("num_hidden_layers", getattr(config, "num_hidden_layers", None))
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is None:
        kv_heads = heads
        if kv_heads is None:
            raise ValueError(f"config has neither num_key_value_heads nor num_attention_heads "
                             f"({name}): no KV heads to cache")
        kv_heads = positive("num_attention_heads", kv_heads)
    else:
        kv_heads = positive("num_key_value_heads", kv_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden = getattr(config, "hidden_size", None)
        if heads is None or hidden is None:
            raise ValueError(f"config has no head_dim and no hidden_size/num_attention_heads "
                             f"to derive it from ({name})")
        heads = positive("num_attention_heads", heads)
        hidden = positive("hidden_size", hidden)
        if hidden % heads:
            raise ValueError(f"config.hidden_size={hidden} is not a multiple of "
                             f"num_attention_heads={heads} and head_dim is not set ({name})")
        head_dim = hidden // heads
    head_dim = positive("head_dim", head_dim)
    return layers, kv_heads, head_dim


def pool_for(config, num_blocks, dtype="float16", block_size=16, device="cpu",
             enable_prefix_caching=True, kv_scales=None):
    """A :class:`kvcore.BlockPool` shaped for the model of ``config``.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        A decoder-only model's config (``model.config``).
    num_blocks, block_size, dtype, device, enable_prefix_caching
        As for :class:`kvcore.BlockPool`.  Each block holds ``block_size``
        positions of every layer, K and V.  ``"float8_e4m3fn"``,
        ``"float8_e5m2"`` and ``"int8"`` pools need
        ``attn_implementation="kvcore"`` (the kernel reads them).
    kv_scales : list of (k_scale, v_scale), optional
        fp8 pools: one pair per layer, e.g. from
        :func:`calibrate_kv_scales` (default 1.0, which real activations
        rarely fit); each of k_scale and v_scale a float or a sequence of
        one float per KV head (``calibrate_kv_scales(..., per_head=True)``).

    A CUDA pool (``device="cuda"`` or ``"cuda:N"``) is allocated, like every
    later CuPy allocation of the process, from torch's caching allocator
    (:func:`use_torch_allocator`), so kvcore and the model share one pool of
    device memory.  Never run on a GPU yet: see docs/hf.md.

    Raises ValueError naming the model type and the feature for a model a
    pool cannot hold (encoder-decoder, state-space or linear-attention
    layers, K and V of different head dims, K/V shared across layers...).
    """
    check_holdable(config)
    layers, kv_heads, head_dim = model_kv_shape(config)
    if _on_cuda(device):
        use_torch_allocator()
    return BlockPool(num_blocks, block_size, layers, kv_heads, head_dim, dtype=dtype,
                     device=device, enable_prefix_caching=enable_prefix_caching,
                     kv_scales=kv_scales)


def check_pool(pool, config):
    """Raise ValueError unless ``pool`` has ``config``'s layers, KV heads and head_dim."""
    if not isinstance(pool, BlockPool):
        raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
    check_holdable(config)
    want = model_kv_shape(config)
    got = (pool.num_layers, pool.num_kv_heads, pool.head_dim)
    if want != got:
        raise ValueError(
            "pool does not fit the model: (num_layers, num_kv_heads, head_dim) must be "
            f"{want} (from the config), got {got}; build it with kvcore.hf.pool_for(config, ...)")
