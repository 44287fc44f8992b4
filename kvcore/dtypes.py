"""Storage dtypes: canonical names, aliases, and how arrays carry them."""
import numpy as np

try:  # optional: real bfloat16 / float8 NumPy dtypes
    import ml_dtypes as _ml_dtypes

    BF16_NUMPY = np.dtype(_ml_dtypes.bfloat16)
    E4M3_NUMPY = np.dtype(_ml_dtypes.float8_e4m3fn)
    E5M2_NUMPY = np.dtype(_ml_dtypes.float8_e5m2)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    _ml_dtypes = None
    BF16_NUMPY = E4M3_NUMPY = E5M2_NUMPY = None

# Element kinds: the numbering of kvcore/backends/cpu/csrc/kv_kinds.h, the one
# table every kernel uses (tests/native/test_kinds.py checks this mirror and the CUDA
# and attention kernels' copies against it).
F32, F16, BF16, F8E4M3, F8E5M2, I8 = 0, 1, 2, 3, 4, 5
KIND_NAME = {F32: "float32", F16: "float16", BF16: "bfloat16",
             F8E4M3: "float8_e4m3fn", F8E5M2: "float8_e5m2", I8: "int8"}
NAME_KIND = {v: k for k, v in KIND_NAME.items()}
# The NumPy dtype that holds each kind's storage (bf16 as raw uint16 bits,
# fp8 as raw uint8 bits, int8 as the int8 codes).
STORAGE = {F32: np.dtype(np.float32), F16: np.dtype(np.float16), BF16: np.dtype(np.uint16),
           F8E4M3: np.dtype(np.uint8), F8E5M2: np.dtype(np.uint8), I8: np.dtype(np.int8)}
ITEMSIZE = {F32: 4, F16: 2, BF16: 2, F8E4M3: 1, F8E5M2: 1, I8: 1}
# The kinds an array of values crosses the API in (inputs, widened outputs)
FLOAT_KINDS = (F32, F16, BF16)
# Low-precision storage kinds: fp8 (a per-layer float32 scale pair) and int8
# (a float32 scale per token and kv head, stored beside the blocks)
FP8_KINDS = (F8E4M3, F8E5M2)
LOWPREC_KINDS = (F8E4M3, F8E5M2, I8)

_ALIASES = {
    "float32": F32, "f32": F32, "fp32": F32,
    "float16": F16, "f16": F16, "fp16": F16, "half": F16,
    "bfloat16": BF16, "bf16": BF16,
    "float8_e4m3fn": F8E4M3, "fp8_e4m3": F8E4M3, "fp8_e4m3fn": F8E4M3, "e4m3fn": F8E4M3,
    "float8_e5m2": F8E5M2, "fp8_e5m2": F8E5M2, "e5m2": F8E5M2,
    "int8": I8, "i8": I8,
}


def float_kind(dt):
    """Kind of NumPy dtype ``dt`` if it is float32, float16 or
    ml_dtypes.bfloat16; None otherwise (uint16 included: never guessed)."""
    if dt == np.float32:
        return F32
    if dt == np.float16:
        return F16
    if BF16_NUMPY is not None and dt == BF16_NUMPY:
        return BF16
    return None


def storage_kind(dtype, arg="dtype", lowprec=True):
    """Canonical kind of a storage dtype given by name, NumPy type or ml_dtypes.

    ``lowprec``: whether the low-precision storage kinds (float8_e4m3fn,
    float8_e5m2, int8) are accepted; False where only a float dtype makes
    sense (an input's ``src_dtype``).
    Raises ValueError/TypeError naming ``arg`` for anything else.
    """
    names = ("'float32', 'float16', 'bfloat16' (or 'f32', 'f16', 'bf16')" if not lowprec else
             "'float32', 'float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2', 'int8' "
             "(or 'f32', 'f16', 'bf16')")
    if isinstance(dtype, str):
        kind = _ALIASES.get(dtype.lower())
        if kind is None or (not lowprec and kind in LOWPREC_KINDS):
            raise ValueError(f"{arg} must be one of {names}, got {dtype!r}")
        return kind
    if dtype is None:      # (np.dtype(None) is float64: "got float64" would mislead)
        raise TypeError(f"{arg} must be a dtype name or NumPy dtype, got None")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{arg} must be a dtype name or NumPy dtype, got {dtype!r}") from None
    kind = float_kind(dt)
    if kind is None and lowprec:
        kind = lowprec_kind(dt)
    if kind is not None:
        return kind
    raise ValueError(f"{arg} must be one of {names}, got {dt}")


def lowprec_kind(dt):
    """Kind of NumPy dtype ``dt`` if it is ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2 or int8; None otherwise (uint8: never guessed)."""
    if dt == np.int8:
        return I8
    if E4M3_NUMPY is not None and dt == E4M3_NUMPY:
        return F8E4M3
    if E5M2_NUMPY is not None and dt == E5M2_NUMPY:
        return F8E5M2
    return None


def array_kind(a, arg, src_dtype=None):
    """Kind of the elements of an input array ``a``.

    float32 and float16 arrays carry their kind; ml_dtypes.bfloat16 arrays are
    bfloat16; a uint16 array is bfloat16 only when ``src_dtype`` says so.
    """
    dt = a.dtype
    if src_dtype is not None:
        kind = storage_kind(src_dtype, "src_dtype", lowprec=False)
        want = STORAGE[kind]
        ok = dt == want or (kind == BF16 and BF16_NUMPY is not None and dt == BF16_NUMPY)
        if not ok:
            raise TypeError(
                f"{arg} must have dtype {want} for src_dtype={KIND_NAME[kind]!r}, got {dt}")
        return kind
    kind = float_kind(dt)
    if kind is not None:
        return kind
    if dt == np.uint16:
        raise TypeError(
            f"{arg} is a uint16 array; pass src_dtype='bfloat16' if it holds bfloat16 bits")
    raise TypeError(f"{arg} must be float32, float16 or bfloat16, got {dt}")


def as_bits(a):
    """A bf16 array as its raw uint16 bits, an fp8 array as its uint8 bits
    (views); other arrays unchanged."""
    if BF16_NUMPY is not None and a.dtype == BF16_NUMPY:
        return a.view(np.uint16)
    if E4M3_NUMPY is not None and a.dtype in (E4M3_NUMPY, E5M2_NUMPY):
        return a.view(np.uint8)
    return a
