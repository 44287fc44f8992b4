"""The K/V that a kvcore forward's ``PagedCache.update`` returns.

With ``attn_implementation="kvcore"`` the attention reads the whole context
from the pages, so ``update`` returns only the step's new K/V, marked for
``kvcore_attention``.  A model whose attention does not go through
transformers' attention function, or that transforms the cached K/V before
calling it (DiffLlama splits V), would compute on those new positions alone:
the marked tensors refuse every torch operation but reading their metadata
(shape, dtype, device, strides...), undo the step and raise ValueError naming
the model type.  Under ``torch.compile`` a CPU pool's forward takes the
route of ``compiled.py`` (no marked tensors: two operators); where it
cannot (a CUDA pool, a transformers that does not hand ``update`` the
attention's keyword arguments), the update and the attention run outside
the compiled regions, and the compiler may also read what it needs to take
the marked tensors into a region (never the model's own compiled code).
"""
import torch

from .step import Step

# what reading a marked tensor may do: its metadata, nothing of its values
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.stride, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_contiguous, torch.Tensor.get_device, torch.Tensor.__len__,
    torch.Tensor.is_nested.__get__, torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__, torch.Tensor.is_mkldnn.__get__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad.__get__, torch.Tensor._is_view,
    torch.Tensor.is_conj, torch.Tensor.is_neg, torch.Tensor.storage_offset,
}
# and what torch.compile (dynamo) reads of a tensor that enters a compiled
# region between the cache's update and the attention (both run outside it),
# while it builds that region; never at run time (__torch_function__ itself
# is never compiled, so is_compiling() is true only in dynamo's builder)
_TRACED = {torch.Tensor._base.__get__, torch.Tensor.untyped_storage}


class PagedKV(torch.Tensor):
    """The new K or V of one layer in a kvcore forward (see the module).

    ``_kvcore`` is ``(cache, step, layer, model_type)``: what the tensor's
    own error needs, and (transformers versions whose attention does not
    pass ``kwargs=`` to ``Cache.update``) how the attention finds its step."""

    __slots__ = ("_kvcore",)

    # (never compiled: in a compiled frame is_compiling() would be true at run
    # time, and the _TRACED reads would pass a model's own use of them)
    @classmethod
    @torch.compiler.disable
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA or (func in _TRACED and torch.compiler.is_compiling()):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        marked = next((a for a in _flat(args, kwargs) if isinstance(a, PagedKV)), None)
        layer, model_type = "?", "the model"
        if marked is not None:        # (None: held deeper in the arguments than a list)
            cache, step, layer, model_type = marked._kvcore
            Step.undo_failed(cache, cache._step, step)
        name = getattr(func, "__name__", repr(func))
        raise ValueError(
            f"{model_type} layer {layer}: the model computes with the cached K/V itself "
            f"({name}) instead of handing them to transformers' attention function as "
            "they are; attn_implementation='kvcore' cannot serve it (use 'sdpa' or 'eager' "
            "with the PagedCache). The forward was undone.")


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def hand_off(key_states, value_states, cache, step, layer, model_type):
    """``(key, value)`` marked for the kvcore attention of ``layer``."""
    ref = (cache, step, layer, model_type)
    k = key_states.detach().as_subclass(PagedKV)
    v = value_states.detach().as_subclass(PagedKV)
    k._kvcore = ref
    v._kvcore = ref
    return k, v
