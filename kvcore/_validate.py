"""Argument checks shared by the public classes.  Each error names the
argument, what was expected and what was given."""
import array
import operator

import numpy as np

from . import _arrays
from ._ints import MAX_INT_BITS, index_int, shown  # noqa: F401 (shared)
from ._native import _pool
from .stores.base import utf8_text

MAX_TOKEN_ID = 2**31 - 1
# Layers a pool, a KVCache or an attention plan holds: each costs Python
# objects (views, bookkeeping), so a count no model has (e.g. 2**31, which
# would take hundreds of GiB of them for a storage of a few) is refused.
MAX_LAYERS = 2**16


def positive_int(value, arg):
    """``value`` as an int > 0 (bools and floats rejected)."""
    v = index_int(value, arg)
    if v <= 0:
        raise ValueError(f"{arg} must be a positive integer, got {v}")
    return v


# Head counts and head_dim: the attention kernels take them as C ints.
MAX_C_INT = 2**31 - 1


def kernel_count(value, arg):
    """``value`` as a head count or head_dim: 1..MAX_C_INT (a storage whose
    heads no attention could read is refused when it is made)."""
    v = positive_int(value, arg)
    if v > MAX_C_INT:
        raise ValueError(f"{arg} must be at most {MAX_C_INT} (the attention kernels take it "
                         f"as a C int), got {v}")
    return v


def num_layers_int(value, arg="num_layers"):
    """``value`` as a layer count: 1..MAX_LAYERS."""
    v = positive_int(value, arg)
    if v > MAX_LAYERS:
        raise ValueError(f"{arg} must be at most {MAX_LAYERS} (kvcore keeps views and "
                         f"bookkeeping per layer), got {v}")
    return v


def nonneg_int(value, arg):
    v = index_int(value, arg)
    if v < 0:
        raise ValueError(f"{arg} must be a non-negative integer, got {v}")
    return v


def layer_index(layer, num_layers):
    v = index_int(layer, "layer")
    if not 0 <= v < num_layers:
        raise IndexError(f"layer must be in 0..{num_layers - 1}, got {v}")
    return v


def token_array(token_ids, arg="token_ids"):
    """``token_ids`` (list/tuple/range/1-D integer array or torch tensor) as
    a C-contiguous, aligned int32 array (the input itself when it already is
    one); every id must lie in 0..2**31-1."""
    fast = _pool.checked_token_array(token_ids)
    if fast is not None:
        return fast
    if isinstance(token_ids, (list, tuple)):
        out = np.empty(len(token_ids), np.int32)
        bad = _pool.tokens_from_sequence(token_ids, out)
        if bad >= 0:
            t = token_ids[bad]
            try:        # (an __index__ may return something else than an int)
                v = None if isinstance(t, (bool, np.bool_)) else operator.index(t)
            except TypeError:
                v = None
            if v is None:
                raise TypeError(f"{arg} must hold integers, got {shown(t)} at index {bad}")
            raise ValueError(f"{arg} must lie in 0..{MAX_TOKEN_ID}, got {shown(v)} at index "
                             f"{bad}")
        return out
    if isinstance(token_ids, range):
        token_ids = np.arange(token_ids.start, token_ids.stop, token_ids.step)
    if not isinstance(token_ids, np.ndarray):
        if not _array_like(token_ids):
            raise TypeError(
                f"{arg} must be a list, tuple or 1-D integer array, got "
                f"{type(token_ids).__name__}")
        # a torch tensor, array.array, anything with __array_interface__: a host view
        from .backends import CPU
        token_ids = _arrays.index_array(CPU, token_ids, arg)
    a = token_ids
    if a.ndim != 1:
        raise ValueError(f"{arg} must be 1-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{arg} must hold integers, got dtype {a.dtype}")
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            i = int(np.argmax((a < 0) | (a > MAX_TOKEN_ID)))
            raise ValueError(f"{arg} must lie in 0..{MAX_TOKEN_ID}, got {a[i]} at index {i}")
    # (misaligned ids, e.g. a view at an odd byte offset, are copied: the
    # native code loads them as int32)
    return _arrays.aligned(np.ascontiguousarray(a, dtype=np.int32))


def _array_like(x):
    """Whether ``x`` can be read as an array (torch tensors, DLPack,
    ``__array_interface__``, ``__array__``, ``array.array``, memoryview)."""
    return (_arrays._torch_of(x) is not None or isinstance(x, (array.array, memoryview))
            or hasattr(x, "__array_interface__") or hasattr(x, "__array__")
            or hasattr(x, "__dlpack__"))


def token_id(value, arg="token_id"):
    v = index_int(value, arg)
    if not 0 <= v <= MAX_TOKEN_ID:
        raise ValueError(f"{arg} must lie in 0..{MAX_TOKEN_ID}, got {v}")
    return v


def salt_bytes(salt):
    """None, or the salt's bytes (str as UTF-8)."""
    if salt is None:
        return None
    if isinstance(salt, str):
        return utf8_text(salt, "salt")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")
