"""The K and V planes of a storage and how each is encoded (internal).

``BlockPool`` and ``KVCache`` each hold one ``Planes``: the per-layer views
of their storage made once (the data ops are hot paths), the ``Codec`` of
every plane (the storage kind, an fp8 layer's scale, an int8 plane's scale
plane), and the few checks both classes share: staging an input that
overlaps what a call writes, the two ``out`` arrays of a read being apart,
and the ``kv_scales`` argument.
"""
import numbers

import numpy as np

from . import dtypes
from .backends import Codec, codec_of

__all__ = ["Planes", "check_layer_scales", "kv_scale_pairs", "outs_share_memory"]


class Planes:
    """Layer ``l``'s keys and values of ``storage``, with their codecs.

    Parameters
    ----------
    backend : the device backend of the arrays
    storage : array ``(num_layers, 2, ...)`` (a view of the owner's
        storage; axis 1 is keys, values)
    kind : the storage kind
    scales : array ``(num_layers, 2, ...)`` or None
        int8: the scale planes, one float32 per row of ``storage``.
    layer_scales : float32 array ``(num_layers, 2)`` or None
        fp8: the per-layer scales.
    owned : arrays
        Everything an input must be apart from (the owner's whole storage
        and scales, whatever their shape).
    """

    __slots__ = ("views", "codecs", "_backend", "_owned")

    def __init__(self, backend, storage, kind, scales=None, layer_scales=None, owned=()):
        num_layers = storage.shape[0]
        self._backend = backend
        self._owned = tuple(a for a in owned if a is not None)
        self.views = [(storage[l, 0], storage[l, 1]) for l in range(num_layers)]
        if kind == dtypes.I8:
            self.codecs = [tuple(Codec(kind, 1.0, scales[l, i]) for i in (0, 1))
                           for l in range(num_layers)]
        elif layer_scales is not None:
            self.codecs = [tuple(Codec(kind, float(layer_scales[l, i])) for i in (0, 1))
                           for l in range(num_layers)]
        else:
            plain = codec_of(kind)
            self.codecs = [(plain, plain)] * num_layers

    def apart(self, a):
        """``a``, or a copy of it if its memory span meets the storage's (or
        the int8 scales'): read as it was when the call began."""
        for owned in self._owned:
            a = self._backend.apart(a, owned)
        return a


def outs_share_memory(backend, k_out, v_out):
    """Whether a read's two ``out`` arrays share memory (exactly, on the
    host; a bounds check on a device)."""
    xp = backend.xp
    return bool(xp.may_share_memory(k_out, v_out)
                and (xp is not np or np.shares_memory(k_out, v_out)))


def check_layer_scales(kv_scales, kind, num_layers):
    """fp8: ``kv_scales`` checked, as a float32 ``(num_layers, 2)`` array
    (default all 1.0); None for other dtypes (where kv_scales must be None)."""
    if kind not in dtypes.FP8_KINDS:
        if kv_scales is not None:
            raise ValueError(f"kv_scales applies to fp8 pools (float8_e4m3fn, float8_e5m2) "
                             f"only, got kv_scales for dtype {dtypes.KIND_NAME[kind]!r}")
        return None
    if kv_scales is None:
        return np.ones((num_layers, 2), np.float32)
    _check_scale_types(kv_scales)
    try:
        a = np.array(kv_scales, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"kv_scales must be a sequence of num_layers (k_scale, v_scale) "
                        f"float pairs, got {kv_scales!r}") from None
    if a.shape != (num_layers, 2):
        raise ValueError(f"kv_scales must hold num_layers={num_layers} (k_scale, v_scale) pairs "
                         f"(shape ({num_layers}, 2)), got shape {a.shape}")
    with np.errstate(over="ignore"):
        f = a.astype(np.float32)
    bad = ~(np.isfinite(f) & (f > 0))
    if bad.any():
        l, i = np.argwhere(bad)[0]
        raise ValueError(f"kv_scales must be finite positive float32 values, got "
                         f"{a[l, i]!r} for layer {l}'s {'kv'[i]}_scale")
    return f


def kv_scale_pairs(layer_scales):
    """The ``kv_scales`` property: ``(k_scale, v_scale)`` float pairs, or None."""
    if layer_scales is None:
        return None
    return [(float(k), float(v)) for k, v in layer_scales]


def _text_or_array(value, name, expected):
    """TypeError for text where ``expected`` is wanted; True for a NumPy array
    of real numbers (checked whole), False for anything else."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iuf":
            raise TypeError(f"{name} must hold real numbers, got an array of dtype "
                            f"{value.dtype}")
        return True
    return False


def _check_scale_types(kv_scales):
    """TypeError unless every scale in ``kv_scales`` is a real number: numpy
    would read "0.5" and True as 0.5 and 1.0, hiding a caller's mistake."""
    if _text_or_array(kv_scales, "kv_scales", "a sequence of (k_scale, v_scale) float pairs"):
        return
    try:
        pairs = list(kv_scales)
    except TypeError:
        return  # not a sequence: the conversion reports it
    for layer, pair in enumerate(pairs):
        if _text_or_array(pair, f"kv_scales[{layer}]", "a (k_scale, v_scale) pair of floats"):
            continue
        try:
            items = list(pair)
        except TypeError:
            continue  # the shape check reports it
        for i, x in enumerate(items):
            # (a 0-d tensor or array has __float__ too; str, bytes and complex do not)
            if isinstance(x, (bool, np.bool_, str, bytes, np.complexfloating)) \
                    or not isinstance(x, numbers.Real) and not hasattr(type(x), "__float__"):
                raise TypeError(f"kv_scales[{layer}][{i}] ({'kv'[i] if i < 2 else '?'}_scale) "
                                f"must be a real number, got {type(x).__name__} {x!r}")
