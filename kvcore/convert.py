"""Round-to-nearest-even conversion between float32 and float16/bfloat16,
float8_e4m3fn and float8_e5m2.

For every non-NaN float32 the result is bit-identical to
``x.astype(numpy.float16)`` and to ``x.astype(ml_dtypes.bfloat16)``
(``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2``); every NaN stays a
NaN of the same sign; widening is exact.  Inputs and ``out=`` may be NumPy
arrays or torch tensors (``torch.bfloat16`` is bfloat16, ``torch.float8_*``
their fp8 format).  The loops run in C with the GIL released
(``kvcore/backends/cpu/csrc/kv_half.c``, ``kv_fp8.c``).
"""
import numpy as np

from . import _arrays, dtypes
from ._ints import shown
from .backends import backend_of_array
from .dtypes import BF16, F16, F32

__all__ = ["to_float16", "to_bfloat16", "from_float16", "from_bfloat16",
           "to_float8_e4m3fn", "to_float8_e5m2", "from_float8_e4m3fn", "from_float8_e5m2"]


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


def _converted(x, out, read, out_for, empty, write):
    """Every conversion's steps: ``x`` read (``read(x)``: ``(be, bits,
    kind)``), the result made (an array of dtype ``empty``) or ``out``
    checked (``out_for(be, out, shape)``: ``(array, result)``), then
    ``write(be, bits, kind, array)``; returns the result.  Where converting
    ``x`` or ``out`` may run the caller's code (which may free the other's
    memory: ``_arrays.private_inputs``), ``x`` is copied before and after
    it is read, and ``out`` is checked to be as it was before the write."""
    private, out_check = False, None
    if out is not None:
        (x,), private, out_check = _arrays.private_inputs((x,), (), out, names=("x",))
    be, x, kind = read(x)
    if private:
        x = x.copy()
    if out is None:
        out = res = be.empty(x.shape, empty)
    else:
        out, res = out_for(be, out, x.shape)
        if out_check is not None:
            out_check()
    write(be, x, kind, out)
    return res


def _run(x, out, arg, src_kinds, dst_kind):
    return _converted(x, out, lambda v: _input(v, arg, src_kinds),
                      lambda be, o, shape: _arrays.out_array(be, o, "out", shape, dst_kind),
                      dtypes.STORAGE[dst_kind],
                      lambda be, v, kind, o: be.convert(v, kind, o, dst_kind))


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


# ------------------------------------------------------------------- fp8
# fp8 data crosses the API as uint8 codes (ml_dtypes' and torch's float8
# types accepted).  Formats are kv_fp8.h's numbering.
E4M3, E5M2 = 0, 1
FP8_NAME = {E4M3: "float8_e4m3fn", E5M2: "float8_e5m2"}
try:  # optional: ml_dtypes' float8 NumPy dtypes
    import ml_dtypes as _ml_dtypes

    _FP8_NUMPY = {fmt: np.dtype(getattr(_ml_dtypes, name)) for fmt, name in FP8_NAME.items()}
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    _FP8_NUMPY = {}
_U8 = np.dtype(np.uint8)


def _fp8_codes(x, fmt):
    """``x`` with a float8 dtype of format ``fmt`` (ml_dtypes or torch) seen
    as its uint8 codes; anything else unchanged."""
    torch = _arrays._torch_of(x)
    if torch is not None:
        if x.dtype != getattr(torch, FP8_NAME[fmt], None):
            return x
        return (x.detach() if x.requires_grad else x).view(torch.uint8)
    if fmt in _FP8_NUMPY and getattr(x, "dtype", None) == _FP8_NUMPY[fmt]:
        return x.view(_U8)
    return x


def _fp8_want(fmt):
    return f"uint8 ({FP8_NAME[fmt]} bits), ml_dtypes.{FP8_NAME[fmt]} or torch.{FP8_NAME[fmt]}"


def _what(x):
    """How a wrong argument is described: its type, or its dtype."""
    if isinstance(x, _PY_SEQ_OR_SCALAR):
        return type(x).__name__
    if _arrays._torch_of(x) is not None:
        return f"torch tensor of dtype {x.dtype}"
    dt = getattr(x, "dtype", None)
    return f"{dt} array" if dt is not None else type(x).__name__


def _fp8_hint(b, arg, fmt):
    """What to pass instead of ``b`` to get fp8 codes of format ``fmt``."""
    name = FP8_NAME[fmt]
    if isinstance(b, _PY_SEQ_OR_SCALAR):
        return f"pass numpy.asarray({arg}, dtype=numpy.uint8) if it holds {name} codes"
    torch = _arrays._torch_of(b)
    dt = str(getattr(b, "dtype", "")).replace("torch.", "")
    other = [f for f, n in FP8_NAME.items() if n == dt and f != fmt]
    if other:
        return f"it holds {dt} data: use kvcore.from_{dt}"
    if dt in ("int8", "uint8"):   # int8, or a uint8 device the backend refused
        return f"pass {arg}.view({'torch' if torch is not None else 'numpy'}.uint8)"
    if dt in ("float32", "float16", "float64", "bfloat16"):
        return f"to round floats to {name} use kvcore.to_{name}"
    return None


def _fp8_input(b, arg, fmt):
    """(backend, uint8 codes) for the fp8 input ``b`` of format ``fmt``."""
    if not isinstance(b, _PY_SEQ_OR_SCALAR):
        be = backend_of_array(b)
        y, bf16 = _arrays.unwrap(_fp8_codes(b, fmt), arg)
        a = be.asarray(y, arg)
        if not bf16 and a.dtype == _U8:
            return be, a
    hint = _fp8_hint(b, arg, fmt)
    raise TypeError(f"{arg} must be a {_fp8_want(fmt)} array; got {_what(b)}"
                    + (f": {hint}" if hint else ""))


def _fp8_out(be, out, shape, fmt):
    """``(codes, result)`` for an ``out=`` that must hold fp8 codes of format
    ``fmt`` in ``shape`` (uint8, ml_dtypes' or torch's float8 type of that
    format): the writable uint8 array to fill and what the call returns."""
    a, bf16 = _arrays.writable(be, out, "out", lambda o: _fp8_codes(o, fmt))
    if bf16 or a.dtype != _U8:
        raise TypeError(f"out must have dtype {_fp8_want(fmt)}, got {_what(out)}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(a.shape)}")
    return a, out


def _check_saturate(saturate):
    if not isinstance(saturate, (bool, np.bool_)):
        raise TypeError(f"saturate must be True or False, got {shown(saturate)}")
    return bool(saturate)


def _to_fp8(x, out, saturate, fmt):
    saturate = _check_saturate(saturate)
    return _converted(x, out, lambda v: _input(v, "x", (F32,)),
                      lambda be, o, shape: _fp8_out(be, o, shape, fmt), _U8,
                      lambda be, v, kind, o: be.convert_fp8(v, o, fmt, True, saturate))


def _from_fp8(b, out, fmt):
    return _converted(b, out, lambda v: (*_fp8_input(v, "b", fmt), None),
                      lambda be, o, shape: _arrays.out_array(be, o, "out", shape, F32),
                      np.float32, lambda be, v, kind, o: be.convert_fp8(v, o, fmt, False))


_TO_FP8_DOC = """Round float32 ``x`` to {name} (nearest, ties to even).

    Bit-identical to ``x.astype(ml_dtypes.{name})`` for every non-NaN
    float32; a NaN becomes the {name} NaN of its sign.

    Parameters
    ----------
    x : array of float32
        Any shape and strides (NumPy or a torch tensor on the CPU, CuPy on a GPU).
    out : array of uint8, ml_dtypes.{name} or torch.{name}, optional
        Same shape as ``x``; the result is written there and returned.
    saturate : bool, default False
        False: a value that rounds past the largest finite {name}
        ({max}) becomes {ovf}, as ``ml_dtypes`` does.  True: it becomes
        ±{max}, and so does ±inf (what fp8 KV storage wants).

    Returns
    -------
    array of uint8
        The raw {name} bits (``out`` itself when given).
    """

_FROM_FP8_DOC = """Widen {name} ``b`` to float32 (exact).

    Parameters
    ----------
    b : array of uint8 ({name} bits), ml_dtypes.{name} or torch.{name}
        Any shape and strides.
    out : array of float32, optional

    Returns
    -------
    array of float32
        Every NaN code gives the quiet float32 NaN of its sign.
    """


def to_float8_e4m3fn(x, out=None, saturate=False):
    return _to_fp8(x, out, saturate, E4M3)


def to_float8_e5m2(x, out=None, saturate=False):
    return _to_fp8(x, out, saturate, E5M2)


def from_float8_e4m3fn(b, out=None):
    return _from_fp8(b, out, E4M3)


def from_float8_e5m2(b, out=None):
    return _from_fp8(b, out, E5M2)


to_float8_e4m3fn.__doc__ = _TO_FP8_DOC.format(
    name="float8_e4m3fn", max=448, ovf="NaN of its sign (float8_e4m3fn has no infinity)")
to_float8_e5m2.__doc__ = _TO_FP8_DOC.format(name="float8_e5m2", max=57344, ovf="±inf")
from_float8_e4m3fn.__doc__ = _FROM_FP8_DOC.format(name="float8_e4m3fn")
from_float8_e5m2.__doc__ = _FROM_FP8_DOC.format(name="float8_e5m2")
