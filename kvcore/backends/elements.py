"""The arithmetic of kvcore's element kinds, in plain NumPy: conversions
between float32, float16 and bfloat16 bits, fp8 and int8 encoding and
decoding, and a row's store and read through a ``Codec``.  What
``backends.base.Backend`` (the reference backend) computes with, and what
the tests hold every kernel's conversions to.
"""
import numpy as np

from .. import dtypes


# ---------------------------------------------------------------- conversion
# Every conversion goes through float32 bits (uint32): widening is exact, so
# one round-to-nearest-even narrowing is the single correct rounding.  NaNs
# follow the hardware convention the C and CUDA kernels use: narrowing keeps
# the sign and the top payload bits and sets the quiet bit; widening a half
# NaN quiets it.

def _to_f32_bits(a, kind):
    """uint32 float32 bits of the elements of ``a`` (storage bits of ``kind``)."""
    if kind == dtypes.F32:
        return a.view(np.uint32).copy()
    h = a.view(np.uint16).astype(np.uint32)
    if kind == dtypes.BF16:
        return h << 16
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    # normal halves: re-bias the exponent (15 -> 127)
    out = sign | ((exp + 112) << 23) | (man << 13)
    out = np.where(exp == 0x1F, sign | 0x7F800000 | (man << 13)
                   | np.where(man != 0, 0x00400000, 0).astype(np.uint32), out)
    # zeros and subnormals: man * 2**-24, exact in float32
    sub = exp == 0
    if sub.any():
        vals = man[sub].astype(np.float32) * np.float32(2.0 ** -24)
        out[sub] = sign[sub] | vals.view(np.uint32)
    return out.astype(np.uint32)


def _round_shift(x, shift):
    """``x >> shift`` rounded to nearest, ties to even (uint32, shift >= 1)."""
    shift = np.asarray(shift, np.uint32)
    r = x >> shift
    rem = x & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    up = (rem > half) | ((rem == half) & ((r & 1) == 1))
    return r + up.astype(np.uint32)


def _from_f32_bits(x, kind):
    """Storage bits of ``kind`` for float32 bits ``x`` (uint32), RNE."""
    x = x.astype(np.uint32)
    if kind == dtypes.F32:
        return x
    ax = x & 0x7FFFFFFF
    nan = ax > 0x7F800000
    if kind == dtypes.BF16:
        # (a carry into the exponent gives +-inf on overflow, as RNE asks;
        # only a NaN could carry out of 16 bits)
        rounded = _round_shift(x, 16) & 0xFFFF
        quiet = (x >> 16) | 0x0040
        return np.where(nan, quiet, rounded).astype(np.uint16)
    sign = (x >> 16) & 0x8000
    exp = ax >> 23
    out = np.zeros(x.shape, np.uint32)
    # normal results: re-bias the exponent, round the 13 dropped bits (a
    # carry into the exponent is the right answer, up to infinity)
    normal = (ax >= 0x38800000) & (ax < 0x477FF000)
    out = np.where(normal, _round_shift(np.where(normal, ax - 0x38000000, 0), 13), out)
    # subnormal results (unit 2**-24): the full mantissa shifted by 126 - exp
    sub = (ax < 0x38800000) & (exp >= 102)
    mant = (ax & 0x7FFFFF) | 0x800000
    out = np.where(sub, _round_shift(mant, np.where(sub, 126 - exp, 1)), out)
    out = np.where(ax >= 0x477FF000, 0x7C00, out)
    out = np.where(nan, 0x7E00 | ((ax >> 13) & 0x3FF), out)
    return (sign | out).astype(np.uint16)


def bits_view(a):
    """``a`` viewed as unsigned integers of its itemsize (same memory)."""
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def convert_bits(src, src_kind, dst_kind):
    """A new array: ``src`` (storage bits of ``src_kind``) as ``dst_kind``
    storage bits (uint32 for float32, uint16 otherwise).  The same kind is
    a copy of the bits (signalling NaNs stay as they are); the same
    low-precision kind too (uint8 bits)."""
    if src_kind == dst_kind and src_kind in dtypes.LOWPREC_KINDS:
        return np.array(src, dtype=np.uint8)
    if src_kind == dst_kind:
        return np.array(src, dtype=np.uint32 if src_kind == dtypes.F32 else np.uint16)
    return _from_f32_bits(_to_f32_bits(np.asarray(src), src_kind), dst_kind)


# ---------------------------------------------------------------- fp8
# float32 <-> fp8 (kv_fp8.h's definition, fmt 0 = e4m3fn, 1 = e5m2):
# narrowing is one RNE right shift of the float32 bits (re-biased for a
# normal result, the whole significand for a subnormal one), then overflow
# (NaN for e4m3fn, inf for e5m2, or the largest finite value when
# saturating) and NaN (0x7F / 0x7E, the input's sign); widening is exact,
# every NaN the quiet float32 NaN of its sign.
# fmt: (mantissa bits, bias, largest finite code, overflow code, NaN code)
FP8_FORMATS = {0: (3, 7, 0x7E, 0x7F, 0x7F), 1: (2, 15, 0x7B, 0x7C, 0x7E)}


def fp8_from_f32_bits(x, fmt, saturate=False):
    """fp8 codes (uint8) of float32 bits ``x`` (uint32), round to nearest even."""
    mbits, bias, max_code, ovf_code, nan_code = FP8_FORMATS[fmt]
    x = np.asarray(x, np.uint32)
    a = x & np.uint32(0x7FFFFFFF)
    sign = (x >> np.uint32(24)) & np.uint32(0x80)
    exp = (a >> np.uint32(23)).astype(np.int64)
    sub = a < np.uint32((128 - bias) << 23)       # the result is subnormal or zero
    v = np.where(sub, (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000),
                 a - np.minimum(a, np.uint32((127 - bias) << 23)))
    # (a shift of 25 leaves 0 of any significand: f32 zeros and subnormals)
    shift = np.where(sub, np.minimum(151 - bias - mbits - exp, 25), 23 - mbits)
    code = _round_shift(v, shift.astype(np.uint32))
    code = np.where(code > max_code, max_code if saturate else ovf_code, code)
    code = np.where(a > np.uint32(0x7F800000), nan_code, code)
    return (code | sign).astype(np.uint8)


def f32_bits_from_fp8(codes, fmt):
    """float32 bits (uint32) of fp8 ``codes`` (uint8): exact."""
    mbits, bias, _, _, _ = FP8_FORMATS[fmt]
    c = np.arange(256, dtype=np.int64)
    mag, neg = c & 0x7F, c >= 0x80
    exp, man = mag >> mbits, mag & ((1 << mbits) - 1)
    # subnormal (exp 0): man * 2**(1 - bias - mbits); normal: (2**mbits + man) * 2**(exp - ...)
    value = np.where(exp == 0, np.ldexp(man.astype(np.float64), 1 - bias - mbits),
                     np.ldexp((man + (1 << mbits)).astype(np.float64), exp - bias - mbits))
    if fmt == 0:
        value = np.where(mag == 0x7F, np.nan, value)
    else:
        value = np.where(exp == 0x1F, np.where(man == 0, np.inf, np.nan), value)
    bits = np.where(neg, -value, value).astype(np.float32).view(np.uint32)
    bits = np.where(np.isnan(value), np.uint32(0x7FC00000) | (neg.astype(np.uint32) << 31), bits)
    return bits.astype(np.uint32)[np.asarray(codes, np.uint8)]
# ------------------------------------------------------- low-precision storage
# fp8 (e4m3fn, e5m2) and int8 storage, defined on float32 values: a float16 or
# bfloat16 input is widened (exactly) first, and a widened output is the
# float32 value converted once more.  The fp8 rounding is the one above (the
# definition of kv_fp8.h, checked against ml_dtypes by the tests).

_FP8_FMT = {dtypes.F8E4M3: 0, dtypes.F8E5M2: 1}   # kind -> kv_fp8.h's fmt


def _f32(bits, kind):
    """float32 values of float storage bits ``bits`` of float ``kind``."""
    return _to_f32_bits(np.asarray(bits), kind).view(np.float32)


def fp8_encode(x, kind, scale=1.0):
    """uint8 fp8 bits of float32 ``x / scale``, saturated: a value past the
    largest finite one (and +-inf) stores +-max; NaN stays NaN."""
    x = np.asarray(x, np.float32)
    scale = np.float32(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        y = x if scale == 1 else x / scale
    return fp8_from_f32_bits(np.ascontiguousarray(y, np.float32).view(np.uint32),
                             _FP8_FMT[kind], saturate=True)


def fp8_decode(b, kind, scale=1.0):
    """float32 ``fp8 * scale`` of uint8 fp8 bits ``b``."""
    v = f32_bits_from_fp8(b, _FP8_FMT[kind]).view(np.float32)
    scale = np.float32(scale)
    return v if scale == 1 else v * scale


def int8_encode(x):
    """``(codes, scales)`` of float32 rows ``x`` (..., dim): per row
    ``scale = max|x| / 127`` (1 for an all-zero row, 2**-149 where that
    quotient underflows to 0), codes
    ``round_half_even(x / scale)`` in -127..127.  A row holding a NaN or an
    infinity stores scale NaN and zeros (it reads back as NaN)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x)
    finite = np.isfinite(x).all(axis=-1)
    amax = np.where(np.isfinite(a), a, np.float32(0)).max(axis=-1, initial=np.float32(0))
    scale = np.where(amax == 0, np.float32(1), amax / np.float32(127)).astype(np.float32)
    # max|x| / 127 underflowing to 0 (max|x| below 63.5 * 2**-149): the
    # smallest subnormal, of which every element is an exact multiple
    scale = np.where(scale == 0, np.float32(2.0**-149), scale).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.clip(np.rint(x / scale[..., None]), -127, 127)
    q = np.where(finite[..., None], q, 0).astype(np.int8)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    return q, scale


def int8_decode(codes, scales):
    """float32 ``codes * scale`` (scales: one per row of ``codes``)."""
    return np.asarray(codes, np.int8).astype(np.float32) * np.asarray(scales, np.float32)[..., None]


def encode(src, src_kind, codec):
    """``(elements, row_scales)`` of float input ``src`` (storage bits of
    ``src_kind``, rows along the last axis) stored by ``codec``: storage bits
    of a float kind, fp8 bits, or int8 codes and their per-row scales (None
    but for int8)."""
    bits = bits_view(src)
    if codec.kind == dtypes.I8:
        return int8_encode(_f32(bits, src_kind))
    if codec.kind in dtypes.FP8_KINDS:
        return fp8_encode(_f32(bits, src_kind), codec.kind, codec.layer_scale), None
    return convert_bits(bits, src_kind, codec.kind), None


def decode(elements, codec, row_scales, dst_kind):
    """Storage bits of ``dst_kind`` of stored ``elements`` (``codec``'s kind;
    int8: one scale per row in ``row_scales``): widened when ``codec`` is
    low precision and ``dst_kind`` a float kind, else converted (the same
    low-precision kind: the codes, copied)."""
    if codec.lowprec and dst_kind != codec.kind:
        if codec.kind == dtypes.I8:
            vals = int8_decode(elements, row_scales)
        else:
            vals = fp8_decode(elements, codec.kind, codec.layer_scale)
        return convert_bits(vals.view(np.uint32), dtypes.F32, dst_kind)
    return convert_bits(bits_view(elements), codec.kind, dst_kind)
