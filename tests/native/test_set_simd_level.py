"""kvcore.set_simd_level: one public switch, one level vocabulary for every
CPU kernel family (conversions, fp8/int8, attention)."""
import re

import numpy as np
import pytest

import kvcore
from kvcore.backends import cpu
from kvcore.backends.cpu import _attention, _convert

NAMES, SUPPORTED = _convert.registry_levels()


def _best_at_or_under(family_levels, level):
    ok = [lvl for lvl in family_levels if NAMES.index(lvl) <= NAMES.index(level)]
    return max(ok, key=NAMES.index)


@pytest.fixture
def restore():
    previous = kvcore.set_simd_level(SUPPORTED[0])
    kvcore.set_simd_level(previous)
    before = kvcore.simd_levels()
    yield
    kvcore.set_simd_level(previous)
    assert kvcore.simd_levels() == before


def test_the_vocabulary_is_the_registry_s():
    assert NAMES == ("scalar", "f16c", "avx2", "neon", "avx512", "amx")
    assert SUPPORTED[0] == "scalar" and set(SUPPORTED) <= set(NAMES)
    for family in (_convert.available_simd_levels(), _attention.available_simd_levels()):
        assert set(family) <= set(SUPPORTED)


@pytest.mark.parametrize("level", SUPPORTED)
def test_each_family_runs_its_best_level_at_or_under_the_one_named(level, restore):
    kvcore.set_simd_level(level)
    got = kvcore.simd_levels()
    assert got["conversions"] == _best_at_or_under(_convert.available_simd_levels(), level)
    assert got["attention"] == _best_at_or_under(_attention.available_simd_levels(), level)
    assert got["fp8_int8"] == _convert.fp8_paths()[got["conversions"]]
    # the answer is in the same vocabulary, and names the level back
    assert set(got.values()) <= set(NAMES)
    assert max(got.values(), key=NAMES.index) == level


@pytest.mark.parametrize("level", SUPPORTED)
def test_returns_the_level_in_force_before(level, restore):
    first = kvcore.set_simd_level(level)
    assert first in SUPPORTED
    assert kvcore.set_simd_level(SUPPORTED[0]) == level
    assert kvcore.set_simd_level(level) == SUPPORTED[0]


@pytest.mark.parametrize("bad", [*[n for n in NAMES if n not in SUPPORTED], "avx1024", "",
                                 "AVX2", " avx2", None, 2, b"avx2", ["avx2"],
                                 np.array(["avx2"])])
def test_an_unknown_or_unsupported_level_is_refused_and_nothing_changes(bad, restore):
    kvcore.set_simd_level(SUPPORTED[0])
    before = kvcore.simd_levels()
    with pytest.raises(ValueError) as e:
        kvcore.set_simd_level(bad)
    msg = str(e.value)
    assert "level" in msg and re.search(re.escape(repr(bad)) + "$", msg), msg
    assert all(name in msg for name in SUPPORTED)
    assert kvcore.simd_levels() == before


def test_one_set_simd_level():
    """The kernel families' own setters are gone: kvcore.set_simd_level is
    the one way to switch levels."""
    assert kvcore.set_simd_level is cpu.set_simd_level
    assert "set_simd_level" in kvcore.__all__
    for module in (_convert, _attention):
        assert not hasattr(module, "set_simd_level")
