"""The backends' whole-block ops that ``BlockPool`` routes through the
backend (``write_block_bytes``: ``import_blocks``; ``copier_for``:
``copy_blocks_to`` across devices), one test body per backend present,
against plain NumPy and the ``xxhash`` package."""
import numpy as np
import pytest
import xxhash

from kvcore.backends import CPU, xxh3_64
from kvcore.backends.base import REFERENCE

try:
    from _cuda_env import cuda_backend_or_skip
except ImportError:  # pragma: no cover - run as a package
    from ._cuda_env import cuda_backend_or_skip


@pytest.fixture(params=["reference", "cpu", "cuda"])
def backend(request):
    if request.param == "reference":
        return REFERENCE
    if request.param == "cpu":
        return CPU
    return cuda_backend_or_skip("cuda")


def _planes(rng, with_scales):
    """A pool's storage (planes, num_blocks, heads, block_size, dim) of
    float16 and, for int8-like pools, its float32 scales."""
    storage = rng.standard_normal((4, 6, 2, 3, 5)).astype(np.float16)
    if not with_scales:
        return [storage]
    return [rng.integers(-127, 128, storage.shape, dtype=np.int8),
            rng.standard_normal(storage.shape[:4]).astype(np.float32)]


def _payload(arrays, b):
    return np.concatenate([np.ascontiguousarray(a[:, b]).reshape(-1).view(np.uint8)
                           for a in arrays])


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_write_block_bytes(backend, with_scales, seeded):
    rng = np.random.default_rng(7)
    src = _planes(rng, with_scales)
    want = [a.copy() for a in src]
    dst_host = [np.zeros_like(a) for a in src]
    ids = [4, 0, 2]
    pays = [_payload(src, b) for b in (1, 3, 5)]
    for b, s in zip(ids, (1, 3, 5)):
        for w, a in zip(want, src):
            w[:, b] = a[:, s]
    for w, a in zip(want, dst_host):      # untouched blocks keep their zeros
        w[:, [1, 3, 5]] = 0
    seeds = [11, 2**64 - 1, 0] if seeded else None
    dst = [backend.from_host(a) for a in dst_host]
    digests = backend.write_block_bytes(dst, ids, pays, seeds, num_threads=2)
    for got, w in zip(dst, want):
        np.testing.assert_array_equal(backend.to_host(got), w)
    if seeded:
        assert digests == [xxhash.xxh3_64_intdigest(p.tobytes(), seed=s)
                           for p, s in zip(pays, seeds)]
    else:
        assert digests is None


def test_xxh3_64_is_exported_for_the_public_layer():
    data = np.arange(1000, dtype=np.uint8)
    assert xxh3_64(data, 5) == xxhash.xxh3_64_intdigest(data.tobytes(), seed=5)


def test_copier_for_leaves_host_copies_to_a_device_backend(backend):
    # a host backend cannot reach device memory: the other side drives
    assert CPU.copier_for(backend) is backend
    # a backend that drives its own copies keeps them whatever the peer
    if backend is not CPU:
        assert backend.copier_for(CPU) is backend
