"""Tests of kvcore's float32 <-> float16/bfloat16 conversion.

The contract (API.md, "Conversion"): for every non-NaN float32 the narrowed
bits equal ``x.astype(numpy.float16)`` and ``x.astype(ml_dtypes.bfloat16)``;
every NaN becomes a NaN of the same sign; widening is exact.  Every SIMD path
must give the same bits as every other, NaNs included.

The exhaustive tests walk all 2**32 float32 patterns in chunks of 2**24:
against the references at the best SIMD level, and bit for bit against the
best level for every other level (cheaper than re-running the references).

NumPy's float32 -> float16 cast raises the overflow/underflow flag element by
element, which makes it ~75 ns per element wherever the result overflows or
underflows (about 5 minutes for all 2**32 patterns).  Where every result of a
chunk is the same constant (|x| < 2**-25 -> +-0, 2**16 <= |x| < inf -> +-inf)
the whole chunk is checked against that constant and NumPy against it on a
sample of the chunk; every other chunk against NumPy in full.
KVCORE_TEST_FULL_REFERENCE=1 runs NumPy on every chunk.
"""
import contextlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kvcore
from kvcore.backends.base import f32_bits_from_fp8, fp8_from_f32_bits
from kvcore.backends.cpu import _convert

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")

U8, U16, U32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
BEST = _convert.best_simd_level()
LEVELS = _convert.available_simd_levels()
OTHER_LEVELS = [lvl for lvl in LEVELS if lvl != BEST]


# ---------------------------------------------------------------- helpers


class Fmt:
    """Bit layout of one format: where the sign is, what +inf looks like."""

    def __init__(self, name, uint, inf, sign):
        self.name, self.uint, self.inf, self.sign = name, np.dtype(uint), inf, sign

    def is_nan(self, bits):
        return (bits & (self.sign - 1)) > self.inf

    def negative(self, bits):
        return (bits & self.sign) != 0

    def __repr__(self):
        return self.name


F32 = Fmt("float32", np.uint32, 0x7F800000, 0x80000000)
F16 = Fmt("float16", np.uint16, 0x7C00, 0x8000)
BF16 = Fmt("bfloat16", np.uint16, 0x7F80, 0x8000)


def check_bits(src_bits, src_fmt, got_bits, dst_fmt, want_bits, what=""):
    """``got == want`` wherever the input is not NaN; a NaN input gives a NaN
    of the same sign (``want`` is ignored there).  All arguments are raw bits."""
    src_bits = np.asarray(src_bits, src_fmt.uint).ravel()
    got_bits = np.asarray(got_bits, dst_fmt.uint).ravel()
    want_bits = np.asarray(want_bits, dst_fmt.uint).ravel()
    nan = src_fmt.is_nan(src_bits)
    bad = ~nan & (got_bits != want_bits)
    bad |= nan & ~(dst_fmt.is_nan(got_bits)
                   & (dst_fmt.negative(got_bits) == src_fmt.negative(src_bits)))
    if bad.any():
        idx = np.flatnonzero(bad)
        sw, dw = src_fmt.uint.itemsize * 2, dst_fmt.uint.itemsize * 2
        rows = ", ".join(
            f"{int(src_bits[i]):#0{sw + 2}x} -> {int(got_bits[i]):#0{dw + 2}x}"
            + ("" if nan[i] else f" (want {int(want_bits[i]):#0{dw + 2}x})")
            for i in idx[:8])
        raise AssertionError(
            f"{what} {src_fmt}->{dst_fmt}: {idx.size} wrong result(s), first: {rows}")


def bits(a):
    """Raw bits of a float32/float16/bfloat16/uint16 (or fp8/uint8) array (a view)."""
    a = np.asarray(a)
    return a.view({4: U32, 2: U16, 1: np.dtype(np.uint8)}[a.dtype.itemsize])


def f32(b):
    """float32 array from raw bits."""
    return np.asarray(b, dtype=U32).view(np.float32)


@contextlib.contextmanager
def at_level(level):
    previous = kvcore.set_simd_level(level)
    try:
        yield
    finally:
        kvcore.set_simd_level(previous)


def assert_same_bits_as_best(fn, x, got):
    """``got`` (``fn(x)`` at the current level) has the best level's bits."""
    with at_level(BEST):
        want = fn(x)
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{fn.__name__}: "
                                  f"{_convert.get_simd_level()} != {BEST}")


@pytest.fixture
def best_level():
    with at_level(BEST):
        yield BEST


def ref_f16(x):
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return x.astype(np.float16)


def ref_bf16(x):
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return x.astype(ml_dtypes.bfloat16)


# ------------------------------------------------ exhaustive: widening

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(U16)


def test_from_float16_all_patterns(simd_level):
    got = kvcore.from_float16(ALL16.view(np.float16))
    assert got.dtype == np.float32 and got.shape == (1 << 16,)
    want = ALL16.view(np.float16).astype(np.float32)
    check_bits(ALL16, F16, bits(got), F32, bits(want), simd_level)


@needs_ml_dtypes
def test_from_bfloat16_all_patterns(simd_level):
    want = ALL16.view(ml_dtypes.bfloat16).astype(np.float32)
    for b in (ALL16, ALL16.view(ml_dtypes.bfloat16)):
        got = kvcore.from_bfloat16(b)
        assert got.dtype == np.float32
        check_bits(ALL16, BF16, bits(got), F32, bits(want), simd_level)
    # kv_half.h: bf16 widening is the plain 16-bit shift, NaNs included
    np.testing.assert_array_equal(bits(got), ALL16.astype(U32) << 16)


def test_widening_levels_agree_all_patterns(simd_level):
    """Every level widens every pattern, NaNs included, to the best level's bits."""
    got16 = bits(kvcore.from_float16(ALL16.view(np.float16)))
    gotb = bits(kvcore.from_bfloat16(ALL16))
    with at_level(BEST):
        want16 = bits(kvcore.from_float16(ALL16.view(np.float16)))
        wantb = bits(kvcore.from_bfloat16(ALL16))
    np.testing.assert_array_equal(got16, want16)
    np.testing.assert_array_equal(gotb, wantb)


# ------------------------------------------------ exhaustive: narrowing

CHUNK = 1 << 24
NAN_RANGES = ((0x7F800001, 0x7FFFFFFF), (0xFF800001, 0xFFFFFFFF))


def all_float32_chunks():
    """(start, bits) for every float32 pattern, CHUNK at a time (one buffer)."""
    base = np.arange(CHUNK, dtype=U32)
    buf = np.empty_like(base)
    for start in range(0, 1 << 32, CHUNK):
        np.add(base, U32.type(start), out=buf)
        yield start, buf


def has_nan(start):
    return any(lo < start + CHUNK and start <= hi for lo, hi in NAN_RANGES)


assert CHUNK % (1 << 23) == 0  # a chunk spans whole float32 binades


def f16_constant(start):
    """The float16 bits every pattern of the chunk at ``start`` rounds to, or
    None when they differ."""
    sign = (start >> 16) & 0x8000
    lo = (start >> 23) & 0xFF
    hi = lo + (CHUNK >> 23) - 1  # float32 exponent fields the chunk covers
    if hi <= 101:  # |x| < 2**-25, half the smallest subnormal: +-0
        return sign
    if lo >= 143 and hi <= 254:  # 2**16 <= |x| < inf: +-inf
        return sign | 0x7C00
    return None


FULL_REFERENCE = os.environ.get("KVCORE_TEST_FULL_REFERENCE", "") not in ("", "0")

NARROW = {
    "float16": (kvcore.to_float16, F16, np.float16),
    "bfloat16": (kvcore.to_bfloat16, BF16, U16),
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_narrowing_all_float32_patterns(fmt, best_level):
    if fmt == "bfloat16" and ml_dtypes is None:
        pytest.skip("needs ml_dtypes")
    fn, dst_fmt, out_dtype = NARROW[fmt]
    ref_dtype = np.float16 if fmt == "float16" else ml_dtypes.bfloat16
    out = np.empty(CHUNK, out_dtype)
    # copyto is astype's cast loop without a fresh 32 MB array per chunk
    ref = np.empty(CHUNK, ref_dtype)
    for start, b in all_float32_chunks():
        x = b.view(np.float32)
        assert fn(x, out=out) is out
        const = f16_constant(start) if fmt == "float16" and not FULL_REFERENCE else None
        if const is not None:
            if not (bits(out) == const).all():
                check_bits(b, F32, bits(out), dst_fmt, np.full(CHUNK, const, U16),
                           f"[{best_level}]")
            # NumPy agrees with the constant: on a sample, in every chunk
            sample = slice((start >> 24) % 4093, None, 4093)
            with np.errstate(over="ignore", under="ignore"):
                assert (bits(x[sample].astype(ref_dtype)) == const).all(), hex(start)
            continue
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            np.copyto(ref, x, casting="unsafe")
        # The full check (NaN by NaN) only where it can matter: chunks with
        # NaN inputs, or any mismatch at all.
        if has_nan(start) or not np.array_equal(bits(out), bits(ref)):
            check_bits(b, F32, bits(out), dst_fmt, bits(ref), f"[{best_level}]")


@pytest.mark.slow
@pytest.mark.parametrize("level", OTHER_LEVELS)
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_narrowing_levels_agree_all_float32_patterns(fmt, level):
    """Every level gives the best level's bits for all 2**32 inputs, NaNs included."""
    fn, _, out_dtype = NARROW[fmt]
    want = np.empty(CHUNK, out_dtype)
    got = np.empty(CHUNK, out_dtype)
    for start, b in all_float32_chunks():
        x = b.view(np.float32)
        with at_level(BEST):
            fn(x, out=want)
        with at_level(level):
            fn(x, out=got)
        if not np.array_equal(bits(got), bits(want)):
            idx = np.flatnonzero(bits(got) != bits(want))
            rows = ", ".join(f"{int(b[i]):#010x} -> {int(bits(got)[i]):#06x} "
                             f"({BEST}: {int(bits(want)[i]):#06x})" for i in idx[:8])
            pytest.fail(f"{level} != {BEST} for {fmt}: {idx.size} pattern(s) "
                        f"in chunk {start:#010x}, first: {rows}")


# ---------------------------------------------------------- edge values

# (float32 bits, float16 bits); None: the input is a NaN.
F16_EDGES = [
    (0x00000000, 0x0000), (0x80000000, 0x8000),            # +-0
    (0x7F800000, 0x7C00), (0xFF800000, 0xFC00),            # +-inf
    (0x3F800000, 0x3C00),                                  # 1.0 (ulp 2^-10)
    (0x3F801000, 0x3C00),                                  # 1 + 2^-11: tie -> even
    (0x3F801001, 0x3C01),                                  # just above the tie
    (0x3F800FFF, 0x3C00),                                  # just below it
    (0x3F803000, 0x3C02),                                  # 1 + 3*2^-11: tie -> even
    (0xBF801000, 0xBC00), (0xBF803000, 0xBC02),            # the same, negative
    (0x44801000, 0x6400),                                  # 1024.5 -> 1024
    (0x44803000, 0x6402),                                  # 1025.5 -> 1026
    (0x3FFFF000, 0x4000),                                  # 2 - 2^-11: tie carries to 2.0
    (0x477FE000, 0x7BFF),                                  # 65504, largest finite
    (0x477FEFFF, 0x7BFF),                                  # just below 65520
    (0x477FF000, 0x7C00),                                  # 65520: first to overflow
    (0xC77FF000, 0xFC00),                                  # -65520
    (0x7F7FFFFF, 0x7C00), (0xFF7FFFFF, 0xFC00),            # +-FLT_MAX
    (0x38800000, 0x0400),                                  # 2^-14, smallest normal
    (0x38801000, 0x0400),                                  # + half an ulp: tie -> even
    (0x38803000, 0x0402),                                  # + 1.5 ulp: tie -> even
    (0x387FC000, 0x03FF),                                  # largest subnormal
    (0x387FDFFF, 0x03FF),                                  # just below the next tie
    (0x387FE000, 0x0400),                                  # tie rounds up to a normal
    (0x33800000, 0x0001), (0xB3800000, 0x8001),            # +-2^-24, smallest subnormal
    (0x33C00000, 0x0002),                                  # 1.5 * 2^-24: tie -> 2
    (0x34200000, 0x0002),                                  # 2.5 * 2^-24: tie -> 2
    (0x34300000, 0x0003),                                  # 2.75 * 2^-24
    (0x33000000, 0x0000), (0xB3000000, 0x8000),            # 2^-25: tie -> signed 0
    (0x33000001, 0x0001), (0xB3000001, 0x8001),            # just above 2^-25
    (0x32FFFFFF, 0x0000), (0xB2FFFFFF, 0x8000),            # just below 2^-25
    (0x00000001, 0x0000), (0x807FFFFF, 0x8000),            # float32 subnormals
]
# (float32 bits, bfloat16 bits)
BF16_EDGES = [
    (0x00000000, 0x0000), (0x80000000, 0x8000),
    (0x7F800000, 0x7F80), (0xFF800000, 0xFF80),
    (0x3F800000, 0x3F80),
    (0x3F808000, 0x3F80),                                  # tie -> even
    (0x3F808001, 0x3F81), (0x3F807FFF, 0x3F80),
    (0x3F818000, 0x3F82),                                  # tie -> even
    (0xBF808000, 0xBF80), (0xBF818000, 0xBF82),
    (0x4B008000, 0x4B00), (0x4B018000, 0x4B02),            # ties at 2^23
    (0x3FFF8000, 0x4000),                                  # tie carries into the exponent
    (0x7F7F0000, 0x7F7F),                                  # largest finite bf16
    (0x7F7F7FFF, 0x7F7F),                                  # just below the overflow tie
    (0x7F7F8000, 0x7F80), (0xFF7F8000, 0xFF80),            # first to overflow
    (0x7F7FFFFF, 0x7F80),                                  # FLT_MAX
    (0x00800000, 0x0080),                                  # smallest normal
    (0x007F0000, 0x007F),                                  # largest subnormal
    (0x007F7FFF, 0x007F),
    (0x007F8000, 0x0080),                                  # tie rounds up to a normal
    (0x00010000, 0x0001), (0x80010000, 0x8001),            # smallest subnormal
    (0x00018000, 0x0002), (0x00028000, 0x0002),            # ties 1.5 and 2.5 -> 2
    (0x00008000, 0x0000), (0x80008000, 0x8000),            # half the smallest: -> 0
    (0x00008001, 0x0001), (0x80008001, 0x8001),            # just above
    (0x00007FFF, 0x0000), (0x80007FFF, 0x8000),            # just below
    (0x00000001, 0x0000),
]
# NaNs: quiet and signalling, both signs; payloads only in the high bits,
# only in the low bits (a plain truncation makes those infinities), all ones
# (a plain rounding wraps those to -0 or +0).
NAN32 = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
         0x7FBFFFFF, 0xFFBFFFFF, 0x7F802000, 0x7F801FFF, 0x7F808000, 0xFFC00001]
F16_EDGES += [(n, None) for n in NAN32]
BF16_EDGES += [(n, None) for n in NAN32]

# (float16 bits, float32 bits)
F16_WIDEN = [
    (0x0000, 0x00000000), (0x8000, 0x80000000), (0x7C00, 0x7F800000), (0xFC00, 0xFF800000),
    (0x3C00, 0x3F800000), (0xBC00, 0xBF800000), (0x3C01, 0x3F802000),
    (0x7BFF, 0x477FE000), (0xFBFF, 0xC77FE000),             # +-65504
    (0x0400, 0x38800000),                                   # smallest normal
    (0x03FF, 0x387FC000), (0x83FF, 0xB87FC000),             # largest subnormal
    (0x0200, 0x38000000), (0x0155, 0x37AA8000),
    (0x0001, 0x33800000), (0x8001, 0xB3800000),             # smallest subnormal
] + [(n, None) for n in (0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7D00, 0x7FFF, 0xFFFF)]
# bfloat16 widening is exact: the 16 bits on top of 16 zero bits.
BF16_WIDEN = [(b, b << 16) for b in (
    0x0000, 0x8000, 0x7F80, 0xFF80, 0x3F80, 0xBF81, 0x7F7F, 0xFF7F,
    0x0080, 0x007F, 0x0001, 0x8001)] + [
    (n, None) for n in (0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF)]

LENGTHS = (1, 7, 8, 15, 16, 17, 24, 33, 47)


def rotations(table, length):
    """Inputs and expectations cycled to ``length``, once per rotation, so
    every value visits every position (SIMD body and scalar tail alike)."""
    src = np.array([s for s, _ in table], dtype=np.uint64)
    want = np.array([0 if w is None else w for _, w in table], dtype=np.uint64)
    idx = (np.arange(length)[None, :] + np.arange(len(table))[:, None]) % len(table)
    return src[idx], want[idx]


def test_edge_tables_match_references():
    """The hand-written tables above agree with NumPy and ml_dtypes."""
    for table, fmt in ((F16_EDGES, F16), (BF16_EDGES, BF16)):
        src = np.array([s for s, _ in table], U32)
        want = np.array([0 if w is None else w for _, w in table], U16)
        if fmt is F16:
            ref = ref_f16(f32(src))
        elif ml_dtypes is not None:
            ref = ref_bf16(f32(src))
        else:  # pragma: no cover
            continue
        check_bits(src, F32, bits(ref), fmt, want, "reference")
    src = np.array([s for s, _ in F16_WIDEN], U16)
    want = np.array([0 if w is None else w for _, w in F16_WIDEN], U32)
    check_bits(src, F16, bits(src.view(np.float16).astype(np.float32)), F32, want, "numpy")


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_narrowing_edge_values(fmt, length, simd_level):
    fn, dst_fmt, _ = NARROW[fmt]
    src, want = rotations(F16_EDGES if fmt == "float16" else BF16_EDGES, length)
    src = src.astype(U32)
    for row, w in zip(src, want):
        got = fn(row.view(np.float32))
        assert got.shape == (length,)
        check_bits(row, F32, bits(got), dst_fmt, w, f"[{simd_level}, n={length}]")
        assert_same_bits_as_best(fn, row.view(np.float32), got)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_widening_edge_values(fmt, length, simd_level):
    src, want = rotations(F16_WIDEN if fmt == "float16" else BF16_WIDEN, length)
    src = src.astype(U16)
    for row, w in zip(src, want):
        if fmt == "float16":
            fn, x, src_fmt = kvcore.from_float16, row.view(np.float16), F16
        else:
            fn, x, src_fmt = kvcore.from_bfloat16, row, BF16
        got = fn(x)
        check_bits(row, src_fmt, bits(got), F32, w, f"[{simd_level}, n={length}]")
        assert_same_bits_as_best(fn, x, got)


@pytest.mark.parametrize("length", [1, 15, 17, 1000, 4099])
def test_random_patterns_every_level(length, simd_level):
    """Random bit patterns (every exponent, NaNs included) at odd lengths."""
    rng = np.random.default_rng(length)
    src = rng.integers(0, 1 << 32, size=length, dtype=np.uint32)
    x = src.view(np.float32)
    check_bits(src, F32, bits(kvcore.to_float16(x)), F16, bits(ref_f16(x)), simd_level)
    if ml_dtypes is not None:
        check_bits(src, F32, bits(kvcore.to_bfloat16(x)), BF16, bits(ref_bf16(x)), simd_level)
    h = src.astype(U16)
    check_bits(h, F16, bits(kvcore.from_float16(h.view(np.float16))), F32,
               bits(h.view(np.float16).astype(np.float32)), simd_level)
    np.testing.assert_array_equal(bits(kvcore.from_bfloat16(h)), h.astype(U32) << 16)
    # NaNs included, every level gives the best level's bits, tails too
    for fn, arg in ((kvcore.to_float16, x), (kvcore.to_bfloat16, x),
                    (kvcore.from_float16, h.view(np.float16)), (kvcore.from_bfloat16, h)):
        assert_same_bits_as_best(fn, arg, fn(arg))


# ------------------------------------------------------------------ out=

def test_out_is_written_and_returned():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    h = np.empty((3, 5), np.float16)
    assert kvcore.to_float16(x, out=h) is h
    np.testing.assert_array_equal(bits(h), bits(x.astype(np.float16)))
    b = np.empty((3, 5), U16)
    assert kvcore.to_bfloat16(x, out=b) is b
    np.testing.assert_array_equal(b, kvcore.to_bfloat16(x))
    y = np.empty((3, 5), np.float32)
    assert kvcore.from_float16(h, out=y) is y
    np.testing.assert_array_equal(y, h.astype(np.float32))
    y2 = np.empty((3, 5), np.float32)
    assert kvcore.from_bfloat16(b, out=y2) is y2
    np.testing.assert_array_equal(bits(y2), b.astype(U32) << 16)


@needs_ml_dtypes
def test_bfloat16_accepts_ml_dtypes_arrays():
    x = np.array([1.0, -2.5, 3.14159, 1e-40, np.inf, 65504.0], np.float32)
    want = bits(ref_bf16(x))
    out = np.empty(x.shape, ml_dtypes.bfloat16)
    assert kvcore.to_bfloat16(x, out=out) is out
    np.testing.assert_array_equal(bits(out), want)
    out16 = np.empty(x.shape, U16)
    assert kvcore.to_bfloat16(x, out=out16) is out16
    np.testing.assert_array_equal(out16, want)
    plain = kvcore.to_bfloat16(x)
    assert plain.dtype == U16
    np.testing.assert_array_equal(plain, want)
    # both carriers of bf16 widen to the same float32
    want32 = out.astype(np.float32)
    np.testing.assert_array_equal(kvcore.from_bfloat16(out), want32)
    np.testing.assert_array_equal(kvcore.from_bfloat16(out16), want32)


def raises(exc, arg, expected, given):
    """pytest.raises whose message names ``arg``, then what was expected,
    then what was given."""
    return pytest.raises(
        exc, match=rf"(?s)\b{re.escape(arg)}\b.*{expected}.*{given}")


@pytest.mark.parametrize("fn, out_dtype, want", [
    (kvcore.to_float16, np.float32, "float16"),
    (kvcore.to_float16, np.uint16, "float16"),
    (kvcore.to_bfloat16, np.float16, "uint16"),
    (kvcore.to_bfloat16, np.float32, "uint16"),
    (kvcore.from_float16, np.float16, "float32"),
    (kvcore.from_float16, np.float64, "float32"),
    (kvcore.from_bfloat16, np.uint16, "float32"),
])
def test_out_wrong_dtype(fn, out_dtype, want):
    src = np.zeros(4, np.float32 if fn.__name__.startswith("to_") else np.float16)
    if fn is kvcore.from_bfloat16:
        src = np.zeros(4, U16)
    out = np.zeros(4, out_dtype)
    with raises(TypeError, "out", want, np.dtype(out_dtype).name):
        fn(src, out=out)
    assert not out.any()


@pytest.mark.parametrize("shape", [(5,), (2, 2), (4, 1), (1, 4), ()])
def test_out_wrong_shape(shape):
    x = np.ones(4, np.float32)
    out = np.zeros(shape, np.float16)
    with raises(ValueError, "out", re.escape("(4,)"), re.escape(str(shape))):
        kvcore.to_float16(x, out=out)
    assert not out.any()
    with raises(ValueError, "out", re.escape("(4,)"), re.escape(str(shape))):
        kvcore.from_float16(np.ones(4, np.float16), out=np.zeros(shape, np.float32))


def test_out_read_only():
    x = np.ones(4, np.float32)
    out = np.zeros(4, np.float16)
    out.flags.writeable = False
    with raises(ValueError, "out", "writeable", "read-only"):
        kvcore.to_float16(x, out=out)
    assert not out.any()
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with raises(ValueError, "out", "writeable", "read-only"):
        kvcore.from_bfloat16(np.ones(4, U16), out=ro)


def test_out_not_an_array():
    with raises(TypeError, "out", "NumPy array", "list"):
        kvcore.to_float16(np.ones(2, np.float32), out=[0.0, 0.0])


# ---------------------------------------------- strides, shapes, overlap

def _views():
    """(name, function making a view of a fresh C array)."""
    return [
        ("step", (60,), lambda a: a[::3]),
        ("step-2d", (6, 10), lambda a: a[:, ::2]),
        ("step-both", (9, 20), lambda a: a[1::2, 3::4]),
        ("transpose", (7, 19), lambda a: a.T),
        ("transpose-3d", (3, 4, 17), lambda a: a.transpose(2, 0, 1)),
        ("reversed", (37,), lambda a: a[::-1]),
        ("reversed-2d", (5, 34), lambda a: a[::-1, ::-2]),
        ("fortran", (6, 33), lambda a: np.asfortranarray(a)),
        ("rows-contiguous", (8, 40), lambda a: a[::2, :33]),
        ("high-rank", (2, 3, 1, 2, 2, 3, 1, 2, 17), lambda a: a),
        ("high-rank-strided", (2, 3, 1, 2, 2, 3, 1, 4, 17), lambda a: a[..., ::-2, 1:]),
        ("broadcast-zero-stride", (1, 23), lambda a: np.broadcast_to(a, (4, 23))),
    ]


def _source(fmt, shape, seed=0):
    """Random finite input of kind ``fmt`` ('f32', 'f16', 'bf16' bits; 'e4m3',
    'e5m2' fp8 codes)."""
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal(shape) * 1000, np.float32)
    x.ravel()[::7] = 1e-6  # subnormal in f16
    if fmt == "f32":
        return x
    if fmt == "f16":
        return x.astype(np.float16)
    if fmt == "e4m3":
        return kvcore.to_float8_e4m3fn(x / 8)
    if fmt == "e5m2":
        return kvcore.to_float8_e5m2(x)
    return kvcore.to_bfloat16(x)


def _ref_fp8(fmt, saturate=False):
    """float32 -> fp8 codes, ml_dtypes' bits (clipped to the largest finite
    value when saturating); the backends' reference without ml_dtypes."""
    def ref(x):
        x = np.ascontiguousarray(x, np.float32)
        if ml_dtypes is None:
            return fp8_from_f32_bits(bits(x), fmt, saturate)
        codes = bits(x.astype(ml_dtypes.float8_e4m3fn if fmt == 0 else ml_dtypes.float8_e5m2))
        if saturate:
            big = (np.abs(x) > (448.0 if fmt == 0 else 57344.0)) & ~np.isnan(x)
            codes = np.where(big, (0x7E if fmt == 0 else 0x7B) | (codes & 0x80), codes)
        return codes.astype(np.uint8)
    return ref


def _widen_fp8(fmt):
    return lambda b: f32_bits_from_fp8(bits(b), fmt)


def to_float8_e4m3fn_saturate(x, out=None):
    return kvcore.to_float8_e4m3fn(x, out=out, saturate=True)


def to_float8_e5m2_saturate(x, out=None):
    return kvcore.to_float8_e5m2(x, out=out, saturate=True)


CONVERSIONS = {
    # name: (fn, input kind, output dtype, reference on a contiguous copy)
    "to_float16": (kvcore.to_float16, "f32", np.float16, lambda x: bits(x.astype(np.float16))),
    "to_bfloat16": (kvcore.to_bfloat16, "f32", U16, None),
    "from_float16": (kvcore.from_float16, "f16", np.float32, lambda h: bits(h.astype(np.float32))),
    "from_bfloat16": (kvcore.from_bfloat16, "bf16", np.float32,
                      lambda b: b.astype(U32) << 16),
    "to_float8_e4m3fn": (kvcore.to_float8_e4m3fn, "f32", U8, _ref_fp8(0)),
    "to_float8_e4m3fn_saturate": (to_float8_e4m3fn_saturate, "f32", U8, _ref_fp8(0, True)),
    "to_float8_e5m2": (kvcore.to_float8_e5m2, "f32", U8, _ref_fp8(1)),
    "to_float8_e5m2_saturate": (to_float8_e5m2_saturate, "f32", U8, _ref_fp8(1, True)),
    "from_float8_e4m3fn": (kvcore.from_float8_e4m3fn, "e4m3", np.float32, _widen_fp8(0)),
    "from_float8_e5m2": (kvcore.from_float8_e5m2, "e5m2", np.float32, _widen_fp8(1)),
}


def _reference(name, x):
    fn, _, _, ref = CONVERSIONS[name]
    if ref is None:
        if ml_dtypes is not None:
            return bits(ref_bf16(np.ascontiguousarray(x)))
        # without ml_dtypes: the contiguous path is tested exhaustively
        return bits(fn(np.ascontiguousarray(x)))
    return ref(np.ascontiguousarray(x))


@pytest.mark.parametrize("view", _views(), ids=lambda v: v[0])
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_strided_input(name, view, simd_level):
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    _, shape, make = view
    x = make(_source(kind, shape))
    got = fn(x)
    assert got.shape == x.shape and got.dtype == out_dtype
    np.testing.assert_array_equal(bits(got), _reference(name, x))


@pytest.mark.parametrize("view", [v for v in _views() if v[0] != "broadcast-zero-stride"],
                         ids=lambda v: v[0])
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_strided_out(name, view, simd_level):
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    _, shape, make = view
    x = _source(kind, make(np.empty(shape, np.uint8)).shape, seed=1)
    base = np.zeros(shape, out_dtype)
    out = make(base)
    assert fn(x, out=out) is out
    np.testing.assert_array_equal(bits(out), _reference(name, x))
    # nothing outside the view was touched
    mask = np.ones(shape, bool)
    make(mask)[...] = False
    assert not bits(base)[mask].any()


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_strided_in_and_out(name, simd_level):
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    x = _source(kind, (12, 30))[::-3, 1::2]
    out = np.zeros((30, 12), out_dtype).T[::2, ::-2][:4, :]
    assert out.shape == x.shape
    assert fn(x, out=out) is out
    np.testing.assert_array_equal(bits(out), _reference(name, x))


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_zero_d(name):
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    x = _source(kind, ())
    assert x.shape == ()
    got = fn(x)
    assert got.shape == () and got.dtype == out_dtype
    np.testing.assert_array_equal(bits(got), _reference(name, x))
    out = np.zeros((), out_dtype)
    assert fn(x, out=out) is out
    np.testing.assert_array_equal(bits(out), _reference(name, x))


def test_numpy_scalar_input():
    got = kvcore.to_float16(np.float32(1.5))
    assert got.shape == () and got.dtype == np.float16 and got == 1.5
    got = kvcore.from_float16(np.float16(-0.25))
    assert got.shape == () and got.dtype == np.float32 and got == -0.25


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2), (2, 0, 0)])
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_empty(name, shape):
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    x = _source(kind, shape)
    got = fn(x)
    assert got.shape == shape and got.dtype == out_dtype
    out = np.empty(shape, out_dtype)
    assert fn(x, out=out) is out
    assert fn(x[::-1], out=out[::-1]).shape == shape


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_many_dimensions(name):
    shape = [1] * 32
    shape[3], shape[17], shape[30], shape[31] = 2, 3, 2, 5
    fn, kind, _, _ = CONVERSIONS[name]
    x = _source(kind, tuple(shape))
    for v in (x, x[..., ::-1], x.transpose(list(range(31, -1, -1)))):
        got = fn(v)
        assert got.shape == v.shape
        np.testing.assert_array_equal(bits(got), _reference(name, v))


def _overlapping(name, n):
    """(input, out) pairs sharing one buffer, in several arrangements."""
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    if kind == "f32":  # narrowing: 2-byte (1-byte) results inside the 4-byte inputs
        def make(layout):
            x = _source("f32", n, seed=3)
            half = bits(np.empty(0, out_dtype)).dtype
            half = x.view(half)  # 2n (4n) items over the same bytes
            out = {"front": half[:n], "back": half[-n:], "odd": half[1::2][:n],
                   "reversed": half[::-1][:n], "front-reversed": half[:n][::-1]}[layout]
            return x, out.view(out_dtype)
    else:  # widening: 4-byte results over 2-byte (1-byte) inputs
        def make(layout):
            buf = np.zeros(n, np.float32)
            u = buf.view(U8 if kind in ("e4m3", "e5m2") else U16)
            sl = {"front": u[:n], "back": u[-n:], "odd": u[1::2][:n],
                  "reversed": u[::-1][:n], "front-reversed": u[:n][::-1]}[layout]
            sl[...] = bits(_source(kind, n, seed=3))
            src = sl.view(np.float16) if kind == "f16" else sl
            return src, buf
    return make


@pytest.mark.parametrize("layout", ["front", "back", "odd", "reversed", "front-reversed"])
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_out_overlapping_input(name, layout):
    fn = CONVERSIONS[name][0]
    n = 101
    x, out = _overlapping(name, n)(layout)
    want = _reference(name, x.copy())
    assert np.shares_memory(x, out)
    assert fn(x, out=out) is out
    np.testing.assert_array_equal(bits(out), want)


def _unaligned(a):
    """A copy of ``a`` at an odd byte address (not aligned for its dtype,
    unless that is one byte)."""
    raw = np.zeros(a.nbytes + 1, np.uint8)
    u = raw[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert a.itemsize == 1 or not u.flags.aligned
    return u


@pytest.mark.parametrize("n", [7, 40])
@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_unaligned_input_and_out(name, n, simd_level):
    fn, kind, out_dtype, _ = CONVERSIONS[name]
    x = _source(kind, n, seed=5)
    want = _reference(name, x)
    np.testing.assert_array_equal(bits(fn(_unaligned(x))), want)
    out = _unaligned(np.zeros(n, out_dtype))
    assert fn(x, out=out) is out
    np.testing.assert_array_equal(bits(out), want)
    out = _unaligned(np.zeros(n, out_dtype))
    assert fn(_unaligned(x)[::-1], out=out[::-1]) is not None
    np.testing.assert_array_equal(bits(out), want)


# --------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("fn, arg, given, expected", [
    (kvcore.to_float16, "x", np.arange(4, dtype=np.int32), "float32"),
    (kvcore.to_float16, "x", np.arange(4, dtype=np.int64), "float32"),
    (kvcore.to_float16, "x", np.ones(4, np.float64), "float32"),
    (kvcore.to_float16, "x", np.ones(4, np.float16), "float32"),
    (kvcore.to_float16, "x", [1.0, 2.0, 3.5], "float32"),        # a list is float64
    (kvcore.to_float16, "x", np.ones(4, np.complex64), "float32"),
    (kvcore.to_bfloat16, "x", np.ones(4, np.float64), "float32"),
    (kvcore.to_bfloat16, "x", np.ones(4, np.uint16), "float32"),
    (kvcore.to_bfloat16, "x", [[0.5], [1.5]], "float32"),
    (kvcore.from_float16, "h", np.ones(4, np.uint16), "float16"),
    (kvcore.from_float16, "h", np.ones(4, np.float32), "float16"),
    (kvcore.from_float16, "h", [1.0], "float16"),
    (kvcore.from_bfloat16, "b", np.ones(4, np.float32), "uint16"),
    (kvcore.from_bfloat16, "b", np.ones(4, np.float16), "uint16"),
    (kvcore.from_bfloat16, "b", np.ones(4, np.int16), "uint16"),
    (kvcore.from_bfloat16, "b", [1, 2], "uint16"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_bad_input_dtype(fn, arg, given, expected):
    # a list is named as a list (what NumPy would make of it is no help)
    what = "list" if isinstance(given, list) else re.escape(str(np.asarray(given).dtype))
    with raises(TypeError, arg, expected, what):
        fn(given)


@needs_ml_dtypes
def test_bfloat16_input_refused_where_not_expected():
    b = np.ones(3, ml_dtypes.bfloat16)
    with raises(TypeError, "x", "float32", "bfloat16"):
        kvcore.to_float16(b)
    with raises(TypeError, "h", "float16", "bfloat16"):
        kvcore.from_float16(b)


@pytest.mark.parametrize("dt", [">f4", ">f2", ">u2"])
def test_non_native_byte_order_never_gives_wrong_bits(dt):
    """A byte-swapped array is either refused or converted correctly."""
    src = np.array([1.0, -2.5, 65504.0, 1e-7], np.float32)
    if dt == ">f4":
        fn, x, want = kvcore.to_float16, src.astype(dt), bits(src.astype(np.float16))
    elif dt == ">f2":
        h = src.astype(np.float16)
        fn, x, want = kvcore.from_float16, h.astype(dt), bits(h.astype(np.float32))
    else:
        b = kvcore.to_bfloat16(src)
        fn, x, want = kvcore.from_bfloat16, b.astype(dt), b.astype(U32) << 16
    try:
        got = fn(x)
    except TypeError as e:
        assert str(e).startswith(("x ", "h ", "b ")), e
    else:
        np.testing.assert_array_equal(bits(got.astype(got.dtype.newbyteorder("="))), want)


# ---------------------------------------------------------------- the GIL

def test_gil_released_during_conversion():
    """The main thread runs Python while another thread is inside one
    conversion call.

    Proof, not timing: ``out`` starts filled with a sentinel that the
    conversion never produces and is written front to back by exactly one
    call.  If the main thread reads the converted value at ``out[0]`` and
    *afterwards* still reads the sentinel at ``out[-1]``, that call was in
    progress across two Python-level reads of the main thread, which is only
    possible with the GIL released.  Attempts repeat until that is seen, so a
    busy machine only makes the test slower; with the GIL held it can never
    pass (it fails after the attempts run out).
    """
    n = 1 << 24
    x = np.ones(n, np.float32)
    sentinel = 0xFFFF  # a NaN; 1.0 narrows to 0x3F80
    for attempt in range(200):
        out = np.full(n, sentinel, U16)
        t = threading.Thread(target=kvcore.to_bfloat16, args=(x,), kwargs={"out": out})
        t.start()
        seen = False
        while t.is_alive():
            if out[0] != sentinel and out[-1] == sentinel:
                seen = True
                break
        t.join()
        assert out[0] == out[-1] == 0x3F80
        if seen:
            return
    pytest.fail("the main thread never ran during a conversion: is the GIL held?")


# ---------------------------------------------------------- SIMD levels

@pytest.mark.parametrize("bad", ["avx1024", "", "AVX2 ", 2, None])
def test_set_simd_level_unknown(bad):
    before = kvcore.simd_levels()
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        kvcore.set_simd_level(bad)
    assert kvcore.simd_levels() == before


@pytest.mark.parametrize("level", [lvl for lvl in _convert.LEVELS if lvl not in LEVELS])
def test_set_simd_level_unsupported(level):
    before = kvcore.simd_levels()
    with pytest.raises(ValueError, match=re.escape(repr(level))):
        kvcore.set_simd_level(level)
    assert kvcore.simd_levels() == before


def test_set_simd_level_returns_previous(simd_level):
    assert _convert.get_simd_level() == simd_level
    assert kvcore.set_simd_level(BEST) == simd_level
    assert _convert.get_simd_level() == BEST
    assert BEST in LEVELS and LEVELS[0] == "scalar"


def _level_in_subprocess(value):
    env = dict(os.environ, KVCORE_SIMD=value)
    root = str(Path(kvcore.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    code = ("import numpy as np, kvcore\n"
            "from kvcore.backends.cpu import _convert\n"
            "h = kvcore.to_float16(np.array([1.0, 65520.0, 2**-25], np.float32))\n"
            "assert h.view(np.uint16).tolist() == [0x3C00, 0x7C00, 0], h\n"
            "print(_convert.get_simd_level())\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("value, want", [
    (" Scalar ", "scalar"),
    *[(lvl, lvl) for lvl in LEVELS],
    (_convert.LEVELS[-1], BEST),  # a cap, never more than the CPU has
])
def test_kvcore_simd_env_caps_level(value, want):
    r = _level_in_subprocess(value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == want


def test_levels_are_scalar_f16c_avx2_neon():
    # The AVX-512 path was slower than AVX2 where it was measured and was
    # removed: an AVX-512 CPU runs the AVX2 path.
    assert _convert.LEVELS == ("scalar", "f16c", "avx2", "neon")
    assert "avx512" not in _convert.available_simd_levels()
    if "avx512" in _convert.registry_levels()[1]:
        # naming avx512 for all runs the conversions at their best under it
        with at_level("avx512"):
            assert _convert.get_simd_level() == "avx2"
    else:
        with pytest.raises(ValueError, match="avx512"):
            kvcore.set_simd_level("avx512")


def test_kvcore_simd_env_avx512_runs_the_best_conversion_level():
    # avx512 is a registry level (the attention has kernels for it); the
    # conversions have none and run their best level under it
    r = _level_in_subprocess("avx512")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == BEST


def test_kvcore_simd_env_unknown_fails_import():
    r = _level_in_subprocess("sse9")
    assert r.returncode != 0
    assert "KVCORE_SIMD" in r.stderr and "sse9" in r.stderr
