"""Round-to-nearest-even conversion between float32 and float16/bfloat16.

For every non-NaN float32 the result is bit-identical to
``x.astype(numpy.float16)`` and to ``x.astype(ml_dtypes.bfloat16)``; every
NaN stays a NaN of the same sign; widening is exact.  The loops run in C with
the GIL released (``kvcore/_native/csrc/kv_half.c``).
"""
import numpy as np

from . import _dtypes
from ._backend import backend_of_array
from ._dtypes import BF16, F16, F32

__all__ = ["to_float16", "to_bfloat16", "from_float16", "from_bfloat16"]


def _input(x, arg, kinds):
    """(backend, array, kind) for input ``x`` whose kind must be in ``kinds``."""
    be = backend_of_array(x)
    x = be.asarray(x, arg)
    dt = x.dtype
    if not dt.isnative and dt.kind in "fu":
        # byte-swapped input (e.g. '>f4' read from a file): a native copy
        x = x.astype(dt.newbyteorder("="))
        dt = x.dtype
    # uint16 is taken as bfloat16 bits here: from_bfloat16 is the caller saying so
    kind = BF16 if dt == np.uint16 else _dtypes.float_kind(dt)
    if kind not in kinds:
        want = " or ".join(
            {F32: "float32", F16: "float16",
             BF16: "uint16 (bfloat16 bits) or ml_dtypes.bfloat16"}[k] for k in kinds)
        raise TypeError(f"{arg} must be a {want} array, got dtype {dt}")
    return be, x, kind


def _output(be, x, out, kind):
    """A fresh output of ``kind`` shaped like ``x``, or ``out`` checked."""
    want = _dtypes.STORAGE[kind]
    if out is None:
        return be.empty(x.shape, want)
    out = be.check_out(out, "out")
    ok = out.dtype == want or (
        kind == BF16 and _dtypes.BF16_NUMPY is not None and out.dtype == _dtypes.BF16_NUMPY)
    if not ok:
        raise TypeError(f"out must have dtype {want}, got {out.dtype}")
    if out.shape != x.shape:
        raise ValueError(f"out must have shape {x.shape} (the input's), got {out.shape}")
    return out


def _run(x, out, arg, src_kinds, dst_kind):
    be, x, sk = _input(x, arg, src_kinds)
    out = _output(be, x, out, dst_kind)
    be.convert(_dtypes.as_bits(x), sk, _dtypes.as_bits(out), dst_kind)
    return out


def to_float16(x, out=None):
    """Round float32 ``x`` to float16 (nearest, ties to even).

    Parameters
    ----------
    x : array of float32
        Any shape and strides (NumPy on the CPU, CuPy on a GPU).
    out : array of float16, optional
        Same shape as ``x``; the result is written there and returned.

    Returns
    -------
    array of float16
    """
    return _run(x, out, "x", (F32,), F16)


def to_bfloat16(x, out=None):
    """Round float32 ``x`` to bfloat16 (nearest, ties to even).

    Parameters
    ----------
    x : array of float32
    out : array of uint16 or ml_dtypes.bfloat16, optional

    Returns
    -------
    array of uint16
        The raw bfloat16 bits (``out`` itself when given).
    """
    return _run(x, out, "x", (F32,), BF16)


def from_float16(h, out=None):
    """Widen float16 ``h`` to float32 (exact).

    Parameters
    ----------
    h : array of float16
    out : array of float32, optional

    Returns
    -------
    array of float32
    """
    return _run(h, out, "h", (F16,), F32)


def from_bfloat16(b, out=None):
    """Widen bfloat16 ``b`` to float32 (exact).

    Parameters
    ----------
    b : array of uint16 (bfloat16 bits) or ml_dtypes.bfloat16
    out : array of float32, optional

    Returns
    -------
    array of float32
    """
    return _run(b, out, "b", (BF16,), F32)
