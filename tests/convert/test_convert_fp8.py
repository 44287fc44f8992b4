"""float32 <-> fp8 (float8_e4m3fn, float8_e5m2) and the int8 row quantizer.

The contract (API.md, "Low-precision storage"): narrowing is bit-identical to
``x.astype(ml_dtypes.float8_e4m3fn)`` / ``float8_e5m2`` for every non-NaN
float32 (``saturate=True`` clips: finite overflow and +-inf give +-max); NaN
stays a NaN of its sign; widening is exact.  The shapes, strides, ``out=``,
overlap and alignment cases run through tests/convert/test_convert.py's CONVERSIONS
table; here: all 2**32 float32 patterns, all 256 codes, edge values, the
scale argument the pools use, the int8 rows, inputs and errors.

The exhaustive narrowing walks all 2**32 patterns in chunks of 2**24 at the
best SIMD level against ml_dtypes, both saturate modes from one ml_dtypes
pass; a chunk whose every result is one constant (+-0, or overflow) is
checked against that constant, and ml_dtypes against it on a sample.  Every
other fp8 code path (``_convert.fp8_paths()``: levels without fp8
instructions share the scalar path) is checked bit for bit against the best
level over all 2**32 patterns.
"""
import numpy as np
import pytest

import kvcore
from kvcore.backends.base import REFERENCE, f32_bits_from_fp8, fp8_from_f32_bits
from kvcore.backends.cpu import _convert

try:
    from test_convert import CHUNK, all_float32_chunks, at_level, raises
except ImportError:  # pragma: no cover - run as a package
    from .test_convert import CHUNK, all_float32_chunks, at_level, raises

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")

U8, U32 = np.dtype(np.uint8), np.dtype(np.uint32)
BEST = _convert.best_simd_level()
PATHS = _convert.fp8_paths()
# one level per fp8 code path other than the best level's (the lowest that runs it)
_FIRST = {}
for _lvl in _convert.available_simd_levels():
    _FIRST.setdefault(PATHS[_lvl], _lvl)
OTHER_PATH_LEVELS = [lvl for path, lvl in _FIRST.items() if path != PATHS[BEST]]

E4M3, E5M2 = _convert.FP8_E4M3, _convert.FP8_E5M2
FMTS = {
    # name: (fmt, to, from, ml_dtypes type name, largest finite, its code)
    "e4m3fn": (E4M3, kvcore.to_float8_e4m3fn, kvcore.from_float8_e4m3fn, "float8_e4m3fn",
               448.0, 0x7E),
    "e5m2": (E5M2, kvcore.to_float8_e5m2, kvcore.from_float8_e5m2, "float8_e5m2",
             57344.0, 0x7B),
}


def ml_type(name):
    return getattr(ml_dtypes, FMTS[name][3])


def f32_bits(a):
    return np.asarray(a, np.float32).view(U32)


def nan_code(name):
    return 0x7F if name == "e4m3fn" else 0x7E


def expected(name, x, ref_codes, saturate):
    """What narrowing ``x`` must give, from ml_dtypes' codes: NaN inputs give
    the format's NaN of their sign; saturating clips every non-NaN result
    past the largest finite value (ml_dtypes' overflow codes) to it."""
    _, _, _, _, _, max_code = FMTS[name]
    xb = f32_bits(x)
    sign = ((xb >> 24) & 0x80).astype(U8)
    nan = (xb & 0x7FFFFFFF) > 0x7F800000
    codes = np.asarray(ref_codes, U8)
    if saturate:
        over = ((codes & 0x7F) > max_code) & ~nan
        codes = np.where(over, max_code | sign, codes)
    return np.where(nan, nan_code(name) | sign, codes).astype(U8)


def assert_codes(x, got, want, what):
    bad = np.flatnonzero(np.asarray(got) != np.asarray(want))
    if bad.size:
        xb = f32_bits(x).ravel()
        rows = ", ".join(f"{int(xb[i]):#010x} -> {int(got.ravel()[i]):#04x} "
                         f"(want {int(want.ravel()[i]):#04x})" for i in bad[:8])
        pytest.fail(f"{what}: {bad.size} wrong code(s), first: {rows}")


# ------------------------------------------------------ all 256 codes

ALL8 = np.arange(256, dtype=U8)


@needs_ml_dtypes
@pytest.mark.parametrize("name", list(FMTS))
def test_widening_all_codes(name, simd_level):
    _, _, widen, _, _, _ = FMTS[name]
    want = ALL8.view(ml_type(name)).astype(np.float32)
    for b in (ALL8, ALL8.view(ml_type(name))):
        got = widen(b)
        assert got.dtype == np.float32 and got.shape == (256,)
        nan = np.isnan(want)
        np.testing.assert_array_equal(f32_bits(got)[~nan], f32_bits(want)[~nan])
        # every NaN code: the quiet float32 NaN of its sign, exactly
        np.testing.assert_array_equal(f32_bits(got)[nan],
                                      np.where(ALL8[nan] >= 0x80, 0xFFC00000, 0x7FC00000))
    # and back: every non-NaN code narrows to itself (saturating: +-inf to +-max)
    for saturate in (False, True):
        back = FMTS[name][1](got, saturate=saturate)
        want_back = ALL8.copy()
        if saturate:
            inf = np.isinf(want)
            want_back[inf] = FMTS[name][5] | (ALL8[inf] & 0x80)
        np.testing.assert_array_equal(back[~nan], want_back[~nan])


@pytest.mark.parametrize("name", list(FMTS))
def test_reference_backend_tables(name):
    """The backends' NumPy reference (the CUDA emulation's oracle) matches
    the C path on all codes and on a spread of float32 patterns."""
    fmt = FMTS[name][0]
    got = np.empty(256, np.float32)
    REFERENCE.convert_fp8(ALL8, got, fmt, False)
    np.testing.assert_array_equal(f32_bits(got), f32_bits(FMTS[name][2](ALL8)))
    x = np.random.default_rng(1).integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(U32)
    x = np.concatenate([x, EDGES.view(U32)])
    for saturate in (False, True):
        np.testing.assert_array_equal(fp8_from_f32_bits(x, fmt, saturate),
                                      FMTS[name][1](x.view(np.float32), saturate=saturate))


# ------------------------------------------------------ exhaustive narrowing

def constant_code(name, start):
    """The magnitude code every pattern of the chunk at ``start`` rounds to
    (0, or overflow: None for 'overflow'), or False when they differ."""
    lo = (start >> 23) & 0xFF
    hi = lo + (CHUNK >> 23) - 1   # float32 exponent fields the chunk covers
    if name == "e4m3fn":
        zero_below, over_from = 117, 136   # < 2**-10 -> 0; >= 2**9 -> overflow
    else:
        zero_below, over_from = 110, 143   # < 2**-17 -> 0; >= 2**16 -> overflow
    if hi < zero_below:
        return 0
    if lo >= over_from and hi <= 254:
        return None
    return False


@needs_ml_dtypes
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FMTS))
def test_narrowing_all_float32_patterns(name):
    fmt, narrow, _, _, _, max_code = FMTS[name]
    ovf = {"e4m3fn": 0x7F, "e5m2": 0x7C}[name]
    out = np.empty(CHUNK, U8)
    out_sat = np.empty(CHUNK, U8)
    ref = np.empty(CHUNK, ml_type(name))
    with at_level(BEST):
        for start, b in all_float32_chunks():
            x = b.view(np.float32)
            assert narrow(x, out=out) is out
            assert narrow(x, out=out_sat, saturate=True) is out_sat
            const = constant_code(name, start)
            if const is not False:
                sign = (start >> 24) & 0x80
                plain = sign | (ovf if const is None else 0)
                sat = sign | (max_code if const is None else 0)
                if not ((out == plain).all() and (out_sat == sat).all()):
                    want = np.full(CHUNK, plain, U8)
                    assert_codes(x, out, want, f"{name} [{BEST}] chunk {start:#x}")
                    assert_codes(x, out_sat, np.full(CHUNK, sat, U8),
                                 f"{name} saturating [{BEST}] chunk {start:#x}")
                # ml_dtypes agrees with the constant: on a sample, in every chunk
                sample = slice((start >> 24) % 4093, None, 4093)
                with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                    assert (x[sample].astype(ml_type(name)).view(U8) == plain).all(), hex(start)
                continue
            with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                np.copyto(ref, x, casting="unsafe")
            for got, saturate in ((out, False), (out_sat, True)):
                want = expected(name, x, ref.view(U8), saturate)
                if not np.array_equal(got, want):
                    assert_codes(x, got, want, f"{name} saturate={saturate} [{BEST}]")


@pytest.mark.slow
@pytest.mark.parametrize("level", OTHER_PATH_LEVELS)
@pytest.mark.parametrize("name", list(FMTS))
def test_narrowing_paths_agree_all_float32_patterns(name, level):
    """Every other fp8 code path gives the best level's bits for all 2**32
    inputs, NaNs included, in both modes."""
    narrow = FMTS[name][1]
    want = np.empty(CHUNK, U8)
    got = np.empty(CHUNK, U8)
    for start, b in all_float32_chunks():
        x = b.view(np.float32)
        for saturate in (False, True):
            with at_level(BEST):
                narrow(x, out=want, saturate=saturate)
            with at_level(level):
                narrow(x, out=got, saturate=saturate)
            if not np.array_equal(got, want):
                assert_codes(x, got, want, f"{name} saturate={saturate}: {level} != {BEST}")


# ------------------------------------------------------ edge values

def _edges():
    v = [0.0, -0.0, 1.0, -1.0, 448.0, 464.0, 464.00003, 463.99997, 480.0, 512.0, -448.0,
         -464.0, 57344.0, 61440.0, 61439.996, 65536.0, -61440.0, 1e38, -3.4028235e38,
         np.inf, -np.inf, np.nan, -np.nan, 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10,
         1.5 * 2.0 ** -10, 2.0 ** -10 + 2.0 ** -30, 3 * 2.0 ** -11, 2.0 ** -14, 2.0 ** -16,
         2.0 ** -17, 1.5 * 2.0 ** -17, 2.0 ** -17 + 2.0 ** -40, 1e-40, -1e-45, 2.0 ** -126,
         0.1, 0.3, 1.0625, 1.0625000001, 1.1875, 1.25, 1.375, 1.125, 240.0, 248.0, 256.0,
         2.0 ** -6 - 2.0 ** -10, 2.0 ** -6 - 2.0 ** -11, 7.5 * 2.0 ** -9, 7.5 * 2.0 ** -16]
    x = np.array(v, np.float32)
    # signalling and payload NaNs, both signs
    nans = np.array([0x7F800001, 0x7FBFFFFF, 0x7FC00001, 0xFF800001, 0xFFFFFFFF], U32)
    return np.concatenate([x, -x, nans.view(np.float32)])


EDGES = _edges()


@needs_ml_dtypes
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", list(FMTS))
@pytest.mark.parametrize("length", [1, 7, 8, 31, 32, 33, 67])
def test_narrowing_edge_values(name, saturate, length, simd_level):
    """Ties, the overflow boundary, subnormals and NaNs, at every tail length."""
    narrow = FMTS[name][1]
    x = np.resize(EDGES, max(length, EDGES.size))
    for off in range(0, x.size - length + 1, max(1, length // 2)):
        part = x[off:off + length]
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            ref = part.astype(ml_type(name)).view(U8)
        assert_codes(part, narrow(part, saturate=saturate), expected(name, part, ref, saturate),
                     f"{name} saturate={saturate} [{simd_level}]")


def test_e4m3fn_overflow_is_nan_without_saturation():
    """ml_dtypes 0.6's rule: 1000.0 (past 464) narrows to NaN, not to 448."""
    codes = kvcore.to_float8_e4m3fn(np.array([1000.0, -1000.0, np.inf], np.float32))
    np.testing.assert_array_equal(codes, [0x7F, 0xFF, 0x7F])
    sat = kvcore.to_float8_e4m3fn(np.array([1000.0, -1000.0, np.inf, -np.inf], np.float32),
                                  saturate=True)
    np.testing.assert_array_equal(sat, [0x7E, 0xFE, 0x7E, 0xFE])
    e5 = kvcore.to_float8_e5m2(np.array([1e6, -np.inf], np.float32))
    np.testing.assert_array_equal(e5, [0x7C, 0xFC])
    e5s = kvcore.to_float8_e5m2(np.array([1e6, -np.inf, np.nan], np.float32), saturate=True)
    np.testing.assert_array_equal(e5s, [0x7B, 0xFB, 0x7E])


# ------------------------------------------------------ scaled (the pools' path)

@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0, 1e-3])
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", list(FMTS))
def test_scaled_conversions_divide_then_round(name, saturate, scale, simd_level):
    """kvh_f32_to_fp8 stores fp8(x / scale); kvh_fp8_to_f32 reads fp8 * scale."""
    fmt, narrow, widen = FMTS[name][:3]
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(997).astype(np.float32) * 100, EDGES])
    got = np.empty(x.size, U8)
    _convert.f32_to_fp8_scaled(x, got, fmt, scale, saturate)
    with np.errstate(over="ignore", invalid="ignore"):
        want = narrow(x / np.float32(scale), saturate=saturate)
    np.testing.assert_array_equal(got, want)
    back = np.empty(x.size, np.float32)
    _convert.fp8_to_f32_scaled(got, back, fmt, scale)
    np.testing.assert_array_equal(f32_bits(back), f32_bits(widen(got) * np.float32(scale)))


# ------------------------------------------------------ int8 rows

def i8_row(x):
    q = np.empty(x.size, np.int8)
    scale = _convert.f32_to_i8_row_hook(np.ascontiguousarray(x, np.float32), q)
    back = np.empty(x.size, np.float32)
    _convert.i8_to_f32_hook(q, back, scale)
    return q, np.float32(scale), back


@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 64, 128, 131])
def test_int8_row_round_trip(n, simd_level):
    rng = np.random.default_rng(n)
    for spread in (1.0, 1e-30, 1e30, 1e-42):
        x = (rng.standard_normal(n) * spread).astype(np.float32)
        x[::5] = 0.0                       # exact zeros stay exact
        q, scale, back = i8_row(x)
        amax = np.abs(x).max()
        if amax == 0:
            assert scale == 1.0 and not q.any()
            continue
        assert scale == amax / np.float32(127)
        # round(x / scale), ties to even, clamped to +-127
        want = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
        np.testing.assert_array_equal(q, want)
        assert np.abs(q).max() <= 127
        assert (back[x == 0] == 0).all() and (q[x == 0] == 0).all()
        np.testing.assert_array_equal(f32_bits(back), f32_bits(q.astype(np.float32) * scale))
        if scale < np.finfo(np.float32).tiny:
            # a subnormal scale is itself rounded coarsely (rows below
            # 127 * 2**-126): the half-step bound holds only for normal ones
            continue
        # error at most half a step (and the float rounding of the step itself)
        err = np.abs(back.astype(np.float64) - x.astype(np.float64))
        assert (err <= scale.astype(np.float64) / 2 * (1 + 2.0 ** -20)).all(), err.max() / scale


@pytest.mark.parametrize("n", [0, 1, 9, 64])
def test_int8_all_zero_row(n, simd_level):
    for z in (0.0, -0.0):
        q, scale, back = i8_row(np.full(n, z, np.float32))
        assert scale == 1.0 and not q.any() and not back.any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 5, 63])
def test_int8_row_with_nan_or_inf(bad, where, simd_level):
    """A row holding a NaN or an infinity stores scale NaN and zeros: it
    reads back as NaN, never as plausible numbers."""
    x = np.random.default_rng(where).standard_normal(64).astype(np.float32)
    x[where] = bad
    q, scale, back = i8_row(x)
    assert np.isnan(scale) and not q.any() and np.isnan(back).all()


def test_int8_ties_round_to_even(simd_level):
    # max 127 -> scale 1: x / scale is x itself, so the halves are ties
    x = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 5, np.float32)
    q, scale, _ = i8_row(x)
    assert scale == 1.0
    np.testing.assert_array_equal(q[:8], [127, 0, 2, 2, 0, -2, -2, 126])


# ------------------------------------------------------ inputs and errors

@needs_ml_dtypes
@pytest.mark.parametrize("name", list(FMTS))
def test_ml_dtypes_arrays_in_and_out(name):
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 300.0], np.float32)
    narrow, widen = FMTS[name][1:3]
    want = x.astype(ml_type(name))
    out = np.zeros(x.shape, ml_type(name))
    assert narrow(x, out=out) is out
    np.testing.assert_array_equal(out.view(U8), want.view(U8))
    plain = narrow(x)
    assert plain.dtype == U8
    back = np.zeros(x.shape, np.float32)
    assert widen(out, out=back) is back
    np.testing.assert_array_equal(back, want.astype(np.float32))
    np.testing.assert_array_equal(widen(plain), back)


@pytest.mark.parametrize("name", list(FMTS))
def test_bad_inputs_name_argument_expectation_and_given(name):
    narrow, widen = FMTS[name][1:3]
    with raises(TypeError, "x", "float32", "float64"):
        narrow(np.ones(3))
    with raises(TypeError, "x", "float32", "list"):
        narrow([1.0, 2.0])
    with raises(TypeError, "b", "uint8", "float32"):
        widen(np.ones(3, np.float32))
    with raises(TypeError, "b", "uint8", "int8"):
        widen(np.ones(3, np.int8))
    with raises(TypeError, "b", "uint8", "list"):
        widen([1, 2])
    with raises(TypeError, "saturate", "True or False", "1"):
        narrow(np.ones(3, np.float32), saturate=1)
    with raises(TypeError, "saturate", "True or False", "None"):
        narrow(np.ones(3, np.float32), saturate=None)
    out = np.zeros(3, np.int8)
    with raises(TypeError, "out", "uint8", "int8"):
        narrow(np.ones(3, np.float32), out=out)
    assert not out.any()
    with raises(TypeError, "out", "float32", "uint8"):
        widen(np.ones(3, U8), out=np.zeros(3, U8))
    with raises(ValueError, "out", r"\(3,\)", r"\(4,\)"):
        narrow(np.ones(3, np.float32), out=np.zeros(4, U8))
    ro = np.zeros(3, U8)
    ro.flags.writeable = False
    with raises(ValueError, "out", "writeable", "read-only"):
        narrow(np.ones(3, np.float32), out=ro)


@needs_ml_dtypes
def test_other_fp8_format_refused():
    with raises(TypeError, "b", "float8_e4m3fn", "float8_e5m2"):
        kvcore.from_float8_e4m3fn(np.zeros(3, ml_dtypes.float8_e5m2))
    with raises(TypeError, "out", "float8_e5m2", "float8_e4m3fn"):
        kvcore.to_float8_e5m2(np.ones(3, np.float32), out=np.zeros(3, ml_dtypes.float8_e4m3fn))


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 6) * 50
    for name, (_, narrow, widen, tname, _, _) in FMTS.items():
        tdt = getattr(torch, tname)
        want = x.to(tdt).view(torch.uint8).numpy()
        np.testing.assert_array_equal(narrow(x), want)
        np.testing.assert_array_equal(narrow(x.t().contiguous().t()), want)
        out = torch.zeros(4, 6, dtype=tdt)
        assert narrow(x, out=out) is out
        np.testing.assert_array_equal(out.view(torch.uint8).numpy(), want)
        out8 = torch.zeros(4, 6, dtype=torch.uint8)
        assert narrow(x, out=out8) is out8
        back = widen(out)
        np.testing.assert_array_equal(back, out.to(torch.float32).numpy())
        np.testing.assert_array_equal(widen(out8), back)
        np.testing.assert_array_equal(widen(out[:, ::2]), back[:, ::2])
        res = torch.zeros(4, 6)
        assert widen(out, out=res) is res
        np.testing.assert_array_equal(res.numpy(), back)
        grad = torch.zeros(4, 6, requires_grad=True)
        with raises(TypeError, "out", "requires grad", ""):
            widen(out, out=grad)
        xg = x.clone().requires_grad_(True)
        np.testing.assert_array_equal(narrow(xg), want)
