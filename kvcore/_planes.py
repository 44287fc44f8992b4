"""The K and V planes of a storage and how each is encoded (internal).

``BlockPool`` and ``KVCache`` each hold one ``Planes``: the per-layer views
of their storage made once (the data ops are hot paths), the ``Codec`` of
every plane (the storage kind, an fp8 layer's scale, an int8 plane's scale
plane), and the few checks both classes share: staging an input that
overlaps what a call writes, the two ``out`` arrays of a read being apart,
and the ``kv_scales`` argument.
"""
import collections.abc
import math
import numbers

import numpy as np

from . import dtypes
from .backends import Codec, codec_of

__all__ = ["Planes", "allocate_storage", "check_head_scales_backend", "check_layer_scales",
           "kv_scale_pairs", "outs_share_memory"]


def allocate_storage(backend, shape, kind, what, sizes):
    """A zeroed storage ``shape`` of ``kind`` on ``backend``.  One it cannot
    have raises a plain MemoryError (ValueError for a size past what the
    allocator is asked for) naming ``what`` and the arguments that size it:
    ``sizes``, the factors of the element count as text (``"num_blocks=8"``,
    ``"2 (K, V)"``); the backend's own error names only the shape."""
    try:
        return backend.zeros(shape, dtypes.STORAGE[kind])
    except (MemoryError, ValueError) as e:
        nbytes = math.prod(shape) * dtypes.ITEMSIZE[kind]
        # (a plain MemoryError / ValueError: a backend's own subclass, e.g.
        # CuPy's OutOfMemoryError(size, total), need not take a message)
        kind_error = MemoryError if isinstance(e, MemoryError) else ValueError
        raise kind_error(
            f"{what} cannot be allocated: {' x '.join(sizes)} elements of "
            f"{dtypes.KIND_NAME[kind]} are {nbytes} bytes ({nbytes / 2**30:.4g} GiB): "
            f"{e}") from None


class Planes:
    """Layer ``l``'s keys and values of ``storage``, with their codecs.

    Parameters
    ----------
    backend : the device backend of the arrays
    storage : array ``(num_layers, 2, ...)`` (a view of the owner's
        storage; axis 1 is keys, values)
    kind : the storage kind
    scale_planes : array ``(num_layers, 2, ...)`` or None
        int8: every plane's ``Codec.scale_plane``, one float32 per row of
        ``storage``.
    layer_scales : float32 array ``(num_layers, 2)`` or None
        fp8: every plane's ``Codec.layer_scale``.
    head_scales : float32 array ``(num_layers, 2, num_kv_heads)`` or None
        fp8 with per-kv-head scales (see ``check_layer_scales``): a plane
        whose heads' scales differ gets them as its ``Codec.head_scales``.
    owned : arrays
        Everything an input must be apart from (the owner's whole storage
        and scale planes, whatever their shape).
    """

    __slots__ = ("views", "codecs", "owned", "_backend")

    def __init__(self, backend, storage, kind, scale_planes=None, layer_scales=None,
                 head_scales=None, owned=()):
        num_layers = storage.shape[0]
        self._backend = backend
        self.owned = tuple(a for a in owned if a is not None)
        self.views = [(storage[l, 0], storage[l, 1]) for l in range(num_layers)]
        if kind == dtypes.I8:
            self.codecs = [tuple(Codec(kind, 1.0, scale_planes[l, i]) for i in (0, 1))
                           for l in range(num_layers)]
        elif layer_scales is not None:
            self.codecs = [tuple(_fp8_codec(kind, layer_scales, head_scales, l, i)
                                 for i in (0, 1)) for l in range(num_layers)]
        else:
            plain = codec_of(kind)
            self.codecs = [(plain, plain)] * num_layers

    def apart(self, a):
        """``a``, or a copy of it if its memory span meets the storage's (or
        the int8 scale planes'): read as it was when the call began."""
        for owned in self.owned:
            a = self._backend.apart(a, owned)
        return a


def _fp8_codec(kind, layer_scales, head_scales, layer, i):
    """Plane ``i`` of ``layer``'s fp8 codec: its one scale, or its per-head
    scales when they differ."""
    if head_scales is not None:
        hs = head_scales[layer, i]
        if not (hs == hs[0]).all():
            return Codec(kind, 1.0, head_scales=np.ascontiguousarray(hs, np.float32))
    return Codec(kind, float(layer_scales[layer, i]))


def outs_share_memory(backend, k_out, v_out):
    """Whether a read's two ``out`` arrays share memory (exactly, on the
    host; a bounds check on a device)."""
    xp = backend.xp
    return bool(xp.may_share_memory(k_out, v_out)
                and (xp is not np or np.shares_memory(k_out, v_out)))


def check_layer_scales(kv_scales, kind, num_layers, num_kv_heads=1):
    """fp8: ``kv_scales`` checked, as ``(layer_scales, head_scales)``:
    float32 ``(num_layers, 2)`` (default all 1.0) and, when some layer's k or
    v holds one scale per kv head that are not all equal, float32
    ``(num_layers, 2, num_kv_heads)`` (every plane's scales, a single one
    repeated), else None.  ``(None, None)`` for other dtypes (where
    kv_scales must be None).  A plane with per-head scales has layer scale
    1.0 (unused: its head scales win)."""
    if kind not in dtypes.FP8_KINDS:
        if kv_scales is not None:
            raise ValueError(f"kv_scales applies to fp8 pools (float8_e4m3fn, float8_e5m2) "
                             f"only, got kv_scales for dtype {dtypes.KIND_NAME[kind]!r}")
        return None, None
    if kv_scales is None:
        return np.ones((num_layers, 2), np.float32), None
    a = _scale_values(kv_scales, num_layers, num_kv_heads)   # float64 (L, 2, H)
    with np.errstate(over="ignore"):
        f = a.astype(np.float32)
    bad = ~(np.isfinite(f) & (f > 0))
    if bad.any():
        l, i, h = np.argwhere(bad)[0]
        head = f" (kv head {h})" if num_kv_heads > 1 else ""
        raise ValueError(f"kv_scales must be finite positive float32 values, got "
                         f"{float(a[l, i, h])!r} for layer {l}'s {'kv'[i]}_scale{head}")
    uniform = (f == f[:, :, :1]).all(axis=2)
    layer = np.where(uniform, f[:, :, 0], np.float32(1.0)).astype(np.float32)
    return layer, (None if uniform.all() else np.ascontiguousarray(f))


def check_head_scales_backend(head_scales, backend):
    """ValueError for per-kv-head fp8 scales on a backend whose kernels
    take one scale per layer (the CUDA one, for now)."""
    if head_scales is not None and not getattr(backend, "per_head_fp8_scales", False):
        raise ValueError(f"kv_scales with per-kv-head scales need device='cpu' for now "
                         f"(the {type(backend).__name__} kernels take one scale per layer); "
                         f"pass one float per layer's k and v instead")


def kv_scale_pairs(layer_scales, head_scales=None):
    """The ``kv_scales`` property: ``(k_scale, v_scale)`` per layer, each a
    float, or a tuple of per-kv-head floats where that plane's heads differ;
    None for other dtypes."""
    if layer_scales is None:
        return None
    if head_scales is None:
        return [(float(k), float(v)) for k, v in layer_scales]
    return [tuple(float(s[0]) if (s == s[0]).all() else tuple(float(x) for x in s)
                  for s in pair) for pair in head_scales]


_PAIR = "a sequence of num_layers (k_scale, v_scale) pairs, each a float or a sequence of " \
        "num_kv_heads floats"


def _scale_values(kv_scales, num_layers, num_kv_heads):
    """float64 ``(num_layers, 2, num_kv_heads)`` from ``kv_scales``: every
    scale a real number (numpy would read "0.5" and True as 0.5 and 1.0,
    hiding a caller's mistake), per layer a pair, each a number or
    ``num_kv_heads`` of them."""
    H = num_kv_heads
    if _text_or_array(kv_scales, "kv_scales", _PAIR):
        a = kv_scales.astype(np.float64)
        if a.ndim == 2 and a.shape == (num_layers, 2):
            return np.repeat(a[:, :, None], H, axis=2)
        if a.shape == (num_layers, 2, H):
            return a
        raise ValueError(f"kv_scales must hold num_layers={num_layers} (k_scale, v_scale) pairs "
                         f"(shape ({num_layers}, 2) or ({num_layers}, 2, num_kv_heads={H})), "
                         f"got shape {a.shape}")
    pairs = _counted(_listed(kv_scales, "kv_scales", _PAIR), kv_scales, "kv_scales", _PAIR,
                     num_layers, f"must hold num_layers={num_layers} (k_scale, v_scale) pairs "
                     f"(shape ({num_layers}, 2))")
    out = np.empty((num_layers, 2, H), np.float64)
    for layer, pair in enumerate(pairs):
        name = f"kv_scales[{layer}]"
        if _text_or_array(pair, name, "a (k_scale, v_scale) pair"):
            items = list(pair) if pair.ndim else None
        else:
            items = _listed(pair, name, "a (k_scale, v_scale) pair")
        if items is None or len(items) != 2:
            raise ValueError(f"{name} must be a (k_scale, v_scale) pair, got {pair!r:.80}")
        for i, x in enumerate(items):
            out[layer, i] = _kv_scale_entry(x, f"{name}[{i}] ({'kv'[i]}_scale)", H)
    return out


def _kv_scale_entry(x, name, num_kv_heads):
    """One plane's scale: a real number, or ``num_kv_heads`` real numbers."""
    if _text_or_array(x, name, "a float or a sequence of num_kv_heads floats"):
        if x.ndim == 0:
            return float(x)
        if x.shape != (num_kv_heads,):
            raise ValueError(f"{name} must be a float or num_kv_heads={num_kv_heads} floats "
                             f"(one per kv head), got shape {x.shape}")
        return x.astype(np.float64)
    if _real(x):
        return _float(x, name)
    heads = None if isinstance(x, (bool, np.bool_, np.complexfloating)) or \
        not hasattr(x, "__iter__") else \
        _listed(x, name, f"a float or num_kv_heads={num_kv_heads} floats")
    heads = _counted(heads, x, name, f"a real number or num_kv_heads={num_kv_heads} of them",
                     num_kv_heads, f"must be a float or num_kv_heads={num_kv_heads} floats "
                     "(one per kv head)")
    for h, y in enumerate(heads):
        if not _real(y):
            raise TypeError(f"{name}[{h}] (kv head {h}) must be a real number, got "
                            f"{type(y).__name__} {y!r}")
    return np.array([_float(y, f"{name}[{h}] (kv head {h})") for h, y in enumerate(heads)],
                    np.float64)


def _float(x, name):
    """``float(x)`` of a real number; ValueError naming ``name`` for one no
    float holds (an int of 400 digits)."""
    try:
        return float(x)
    except (OverflowError, ValueError) as e:
        raise ValueError(f"{name} must be a finite positive float32 value, got {x!r:.80} "
                         f"({e})") from None


def _counted(items, value, name, expected, count, counted):
    """``items`` (``_listed(value, ...)``) when it holds ``count`` entries:
    TypeError when ``value`` is no sequence, ValueError (``name``, then
    ``counted``: what it must hold) when the count differs."""
    if items is None:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r:.80}")
    if len(items) != count:
        raise ValueError(f"{name} {counted}, got {len(items)} entries")
    return items


def _listed(value, name, expected):
    """``list(value)`` for an ordered sequence; TypeError naming ``name`` for
    a set or a mapping (their order is not the caller's: a set of scales
    would give heads or layers the wrong ones, a dict its keys), None for a
    value that is not iterable."""
    if isinstance(value, (set, frozenset, collections.abc.Mapping)):
        raise TypeError(f"{name} must be {expected} in order (a list, tuple or array), got "
                        f"{type(value).__name__} {value!r:.80}")
    try:
        return list(value)
    except TypeError:
        return None


def _real(x):
    """A real number (a 0-d tensor or array has __float__ too; str, bytes,
    bool and complex are refused, also as a tensor's dtype)."""
    if isinstance(x, (bool, np.bool_, str, bytes, np.complexfloating, complex, np.flexible)):
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is not None and ("bool" in str(dtype) or "complex" in str(dtype)
                              or getattr(dtype, "kind", "f") not in "iuf"):
        return False
    if isinstance(x, numbers.Real):
        return True
    if hasattr(type(x), "__float__") and not hasattr(x, "__len__"):
        return True
    # a 0-d tensor / array: __float__ and a len() that raises
    if hasattr(type(x), "__float__") and getattr(x, "ndim", None) == 0:
        return True
    return False


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
