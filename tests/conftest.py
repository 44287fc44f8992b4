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


# ------------------------------------------------------------ pools and sequences
@pytest.fixture
def make_pool():
    """``make_pool(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1,
    head_dim=4, dtype="float32", **kwargs)``: a CPU BlockPool, checked for
    consistency (``pool.check()``) when the test ends."""
    import kvcore

    made = []

    def make(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
             dtype="float32", **kwargs):
        pool = kvcore.BlockPool(num_blocks, block_size, num_layers, num_kv_heads, head_dim,
                                dtype=dtype, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.check()


@pytest.fixture
def pool(make_pool):
    """A small float32 pool: 8 blocks of 4 positions, 2 layers, 1 KV head of 4."""
    return make_pool(num_layers=2)


@pytest.fixture
def seq(pool):
    """A new (not yet allocated) sequence on ``pool``, freed when the test ends."""
    import kvcore

    s = kvcore.PagedKVCache(pool)
    yield s
    s.free()
