"""Shared fixtures for kvcore's tests."""
import os

import pytest

from kvcore.backends.cpu import _convert


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


def require_torch():
    """The torch module; the test skips without it, except that with
    KVCORE_REQUIRE_TORCH=1 (set by .ci/run, which installs torch) a missing
    or broken torch fails the test instead of skipping it."""
    if os.environ.get("KVCORE_REQUIRE_TORCH", "") not in ("", "0"):
        try:
            import torch
        except Exception as e:  # pragma: no cover - a broken CI environment
            pytest.fail(f"KVCORE_REQUIRE_TORCH=1 but torch cannot be imported: {e!r}")
        return torch
    return pytest.importorskip("torch")


@pytest.fixture
def torch():
    """torch (see ``require_torch``)."""
    return require_torch()
