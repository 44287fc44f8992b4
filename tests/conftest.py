"""Shared fixtures for kvcore's tests."""
import pytest

from kvcore._native import _convert


@pytest.fixture(params=_convert.available_simd_levels())
def simd_level(request):
    """Run the test once per conversion path this CPU supports.

    The level is process-wide, so it is restored after the test whatever
    happens in it.  Yields the level's name.
    """
    previous = _convert.set_simd_level(request.param)
    try:
        yield request.param
    finally:
        _convert.set_simd_level(previous)
