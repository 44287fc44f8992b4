"""Shared fixtures for kvcore's tests.

The tests live in subject folders (pool/, attention/, stores/, hf/, cuda/,
cli/, convert/, native/, project/) without ``__init__.py``: pytest puts this
file's folder, tests/, on sys.path, where the shared helpers are
(``_helpers.py``, ``_cuda_env.py``, ...).  A test module that reuses another
folder's test module (the CUDA host emulation's fixtures, the native build
helpers) imports it by its basename, so every subject folder goes on sys.path
here too; basenames are unique across the folders (pytest requires it)."""
import os
import pathlib
import sys

import pytest

from kvcore.backends.cpu import _convert

try:  # tests/ as a package or as a plain directory on sys.path
    from ._cuda_env import _machine as _cuda_machine
except ImportError:
    from _cuda_env import _machine as _cuda_machine

_TESTS = pathlib.Path(__file__).resolve().parent
for _folder in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture(autouse=True)
def _cuda_context_left_usable(request):
    """After a GPU test on a machine with a GPU: the CUDA context still works.

    A fault in a kernel (a misaligned or out-of-bounds access) is sticky: the
    process's context is lost and every later GPU test in it fails for no
    fault of its own.  So the test that left it so fails, naming the fault;
    under pytest-xdist (.ci/gpu) its worker then exits, and xdist reports
    the test as crashed and starts a fresh worker for the rest."""
    yield
    if request.node.get_closest_marker("cuda") is None or "cupy" not in sys.modules:
        return
    installed, (visible, _) = _cuda_machine()
    if not (installed and visible):
        return
    cupy = sys.modules["cupy"]
    try:
        cupy.cuda.runtime.deviceSynchronize()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        msg = (f"{request.node.nodeid} left this process's CUDA context unusable ({e}); "
               f"the GPU tests after it in this process cannot run")
        if os.environ.get("PYTEST_XDIST_WORKER"):
            sys.stderr.write(f"\n{msg}\n")
            sys.stderr.flush()
            os._exit(3)
        pytest.fail(msg, pytrace=False)


@pytest.fixture(params=_convert.available_simd_levels())
def simd_level(request):
    """Run the test once per conversion path this CPU supports.

    The level is process-wide, so it is restored after the test whatever
    happens in it.  Yields the level's name.
    """
    import kvcore
    previous = kvcore.set_simd_level(request.param)
    try:
        yield request.param
    finally:
        kvcore.set_simd_level(previous)


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
    consistency (``pool.debug.check()``) when the test ends."""
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
        pool.debug.check()


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
