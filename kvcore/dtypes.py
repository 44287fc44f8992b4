"""Storage dtypes: canonical names, aliases, and how arrays carry them."""
import numpy as np

try:  # optional: a real bfloat16 NumPy dtype
    import ml_dtypes as _ml_dtypes

    BF16_NUMPY = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    _ml_dtypes = None
    BF16_NUMPY = None

# Element kinds: the numbering of kvcore/backends/cpu/csrc/kv_kinds.h, the one
# table every kernel uses (tests/test_kinds.py checks this mirror and the CUDA
# and attention kernels' copies against it).
F32, F16, BF16 = 0, 1, 2
KIND_NAME = {F32: "float32", F16: "float16", BF16: "bfloat16"}
NAME_KIND = {v: k for k, v in KIND_NAME.items()}
# The NumPy dtype that holds each kind's storage (bf16 as raw uint16 bits).
STORAGE = {F32: np.dtype(np.float32), F16: np.dtype(np.float16), BF16: np.dtype(np.uint16)}
ITEMSIZE = {F32: 4, F16: 2, BF16: 2}

_ALIASES = {
    "float32": F32, "f32": F32, "fp32": F32,
    "float16": F16, "f16": F16, "fp16": F16, "half": F16,
    "bfloat16": BF16, "bf16": BF16,
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


def storage_kind(dtype, arg="dtype"):
    """Canonical kind of a storage dtype given by name, NumPy type or ml_dtypes.

    Raises ValueError/TypeError naming ``arg`` for anything else.
    """
    if isinstance(dtype, str):
        kind = _ALIASES.get(dtype.lower())
        if kind is None:
            raise ValueError(
                f"{arg} must be one of 'float32', 'float16', 'bfloat16' "
                f"(or 'f32', 'f16', 'bf16'), got {dtype!r}")
        return kind
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{arg} must be a dtype name or NumPy dtype, got {dtype!r}") from None
    kind = float_kind(dt)
    if kind is not None:
        return kind
    raise ValueError(f"{arg} must be float32, float16 or bfloat16, got {dt}")


def array_kind(a, arg, src_dtype=None):
    """Kind of the elements of an input array ``a``.

    float32 and float16 arrays carry their kind; ml_dtypes.bfloat16 arrays are
    bfloat16; a uint16 array is bfloat16 only when ``src_dtype`` says so.
    """
    dt = a.dtype
    if src_dtype is not None:
        kind = storage_kind(src_dtype, "src_dtype")
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
    """A bf16 array as its raw uint16 bits (a view); other arrays unchanged."""
    if BF16_NUMPY is not None and a.dtype == BF16_NUMPY:
        return a.view(np.uint16)
    return a
