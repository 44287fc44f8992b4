"""kvcore's XXH64 (kv_checksum.c: the prefix-store entries' checksum) is the
real XXH64, bit for bit, and the copy that computes it copies exactly."""
import os

import numpy as np
import pytest
import xxhash

from kvcore.backends.cpu import _checksum


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 31, 32, 33, 63, 64, 65, 100,
                               1000, 8191, 8192, 8193, 65537])
@pytest.mark.parametrize("seed", [0, 1, 2**32 + 5, 2**64 - 1])
def test_xxh64_matches_the_xxhash_package(n, seed):
    data = os.urandom(n)
    assert _checksum.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)


@pytest.mark.parametrize("chunks, chunk, stride", [(1, 0, 0), (1, 5, 5), (3, 7, 11),
                                                   (64, 32768, 65536), (4, 20000, 20000),
                                                   (2, 8193, 9000)])
def test_copy_xxh64_copies_and_hashes_the_source(chunks, chunk, stride):
    src = np.frombuffer(os.urandom(chunks * chunk), np.uint8)
    dst = np.zeros(max(stride * chunks, 1), np.uint8)
    before = dst.copy()
    h = _checksum.copy_xxh64(src, dst, chunks, chunk, stride, 99)
    assert h == xxhash.xxh64_intdigest(src.tobytes(), 99)
    for i in range(chunks):
        assert np.array_equal(dst[i * stride:i * stride + chunk], src[i * chunk:(i + 1) * chunk])
        # nothing between the chunks is touched
        assert np.array_equal(dst[i * stride + chunk:(i + 1) * stride],
                              before[i * stride + chunk:(i + 1) * stride])


def test_copy_xxh64_refuses_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="src holds"):
        _checksum.copy_xxh64(b"abc", bytearray(10), 1, 4, 4)
    with pytest.raises(ValueError, match="dst is too small"):
        _checksum.copy_xxh64(b"abcdefgh", bytearray(10), 2, 4, 8)
