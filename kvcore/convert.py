"""Round-to-nearest-even conversion between float32 and float16/bfloat16.

For every non-NaN float32 the result is bit-identical to
``x.astype(numpy.float16)`` and to ``x.astype(ml_dtypes.bfloat16)``; every
NaN stays a NaN of the same sign; widening is exact.  Inputs and ``out=``
may be NumPy arrays or torch tensors (``torch.bfloat16`` is bfloat16).  The loops run in C with
the GIL released (``kvcore/backends/cpu/csrc/kv_half.c``).
"""
import numpy as np

from . import _arrays, dtypes
from .backends import backend_of_array
from .dtypes import BF16, F16, F32

__all__ = ["to_float16", "to_bfloat16", "from_float16", "from_bfloat16"]


_WANT = {F32: "float32", F16: "float16",
         BF16: "uint16 (bfloat16 bits) or ml_dtypes.bfloat16"}
_NP_NAME = {F32: "numpy.float32", F16: "numpy.float16", BF16: "numpy.uint16"}
# Python containers and numbers: never arrays of the right dtype (NumPy
# scalars, which carry a dtype, are taken as 0-d arrays)
_PY_SEQ_OR_SCALAR = (list, tuple, int, float, complex)


def _hint(x, arg, kind, given):
    """What to pass instead of ``x`` (given as ``given``) to get ``kind``."""
    if isinstance(x, _PY_SEQ_OR_SCALAR):
        if kind == BF16:
            return (f"pass kvcore.to_bfloat16(numpy.asarray({arg}, dtype=numpy.float32)) "
                    "to get bfloat16 bits")
        return f"pass numpy.asarray({arg}, dtype={_NP_NAME[kind]})"
    if given is None or given.kind not in "biuf":
        return None  # complex, strings, objects: no conversion to suggest
    torch = _arrays._torch_of(x)
    if kind == BF16:
        if torch is not None:
            return f"pass {arg}.to(torch.bfloat16)"
        if given == np.int16:
            return f"pass {arg}.view(numpy.uint16) if it holds bfloat16 bits"
        return f"pass kvcore.to_bfloat16({arg}.astype(numpy.float32)) to get bfloat16 bits"
    if torch is not None:
        return f"pass {arg}.to(torch.{dtypes.KIND_NAME[kind]})"
    return f"pass {arg}.astype({_NP_NAME[kind]})"


def _bad_input(x, arg, kinds, given):
    """The TypeError for an input of the wrong kind: what was given, what is
    wanted, and what to pass instead."""
    want = " or ".join(_WANT[k] for k in kinds)
    if isinstance(x, _PY_SEQ_OR_SCALAR):
        what = type(x).__name__
    elif _arrays._torch_of(x) is not None:
        what = f"torch tensor of dtype {x.dtype}"
    elif given is not None:
        what = f"{given} array"
    else:
        what = type(x).__name__
    hint = _hint(x, arg, kinds[0], given)
    return TypeError(f"{arg} must be a {want} array; got {what}" + (f": {hint}" if hint else ""))


def _input(x, arg, kinds):
    """(backend, bits, kind) for input ``x`` whose kind must be in ``kinds``."""
    if isinstance(x, _PY_SEQ_OR_SCALAR):
        # a list of floats would be float64: say what to pass instead
        raise _bad_input(x, arg, kinds, None)
    be = backend_of_array(x)
    y, bf16 = _arrays.unwrap(x, arg)
    a = be.asarray(y, arg)
    dt = a.dtype
    if bf16:
        kind = BF16
        a = a.view(np.uint16)
    else:
        if not dt.isnative and dt.kind in "fu":
            # byte-swapped input (e.g. '>f4' read from a file): a native copy
            a = a.astype(dt.newbyteorder("="))
            dt = a.dtype
        # uint16 is taken as bfloat16 bits here: from_bfloat16 is the caller saying so
        kind = BF16 if dt == np.uint16 else dtypes.float_kind(dt)
    if kind not in kinds:
        raise _bad_input(x, arg, kinds, None if bf16 else dt)
    return be, dtypes.as_bits(a), kind


def _run(x, out, arg, src_kinds, dst_kind):
    be, x, sk = _input(x, arg, src_kinds)
    if out is None:
        out = res = be.empty(x.shape, dtypes.STORAGE[dst_kind])
    else:
        out, res = _arrays.out_array(be, out, "out", x.shape, dst_kind)
    be.convert(x, sk, out, dst_kind)
    return res


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
