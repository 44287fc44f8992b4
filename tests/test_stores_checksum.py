"""kvcore's XXH64 (kv_checksum.c: the checksum of entry format 2) is the
real XXH64, bit for bit, and the copies that compute it and XXH3-64
(kv_xxh3.c, format 3; tests/test_checksum_xxh3.py) copy exactly."""
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


# the fused copies of both entry formats' checksums (XXH3-64 at the scalar
# level and at the default one)
COPIES = {
    "xxh64": (_checksum.copy_xxh64, xxhash.xxh64_intdigest),
    "xxh3-scalar": (lambda *a: _checksum.copy_xxh3(*a, level=0),
                    lambda d, seed: xxhash.xxh3_64_intdigest(d, seed=seed)),
    "xxh3": (_checksum.copy_xxh3, lambda d, seed: xxhash.xxh3_64_intdigest(d, seed=seed)),
}


@pytest.mark.parametrize("algo", sorted(COPIES))
@pytest.mark.parametrize("chunks, chunk, stride", [(1, 0, 0), (1, 5, 5), (3, 7, 11),
                                                   (64, 32768, 65536), (4, 20000, 20000),
                                                   (2, 8193, 9000), (64, 4096, 8192),
                                                   (40, 100, 130)])
def test_copy_copies_and_hashes_the_source(algo, chunks, chunk, stride):
    copy, ref = COPIES[algo]
    src = np.frombuffer(os.urandom(chunks * chunk), np.uint8)
    dst = np.full(max(stride * chunks, 1), 0xA5, np.uint8)
    before = dst.copy()
    h = copy(src, dst, chunks, chunk, stride, 99)
    assert h == ref(src.tobytes(), 99)
    for i in range(chunks):
        assert np.array_equal(dst[i * stride:i * stride + chunk], src[i * chunk:(i + 1) * chunk])
        # nothing between the chunks is touched
        assert np.array_equal(dst[i * stride + chunk:(i + 1) * stride],
                              before[i * stride + chunk:(i + 1) * stride])


@pytest.mark.parametrize("algo", sorted(COPIES))
def test_copy_refuses_sizes_that_do_not_fit(algo):
    copy, _ = COPIES[algo]
    with pytest.raises(ValueError, match="src holds"):
        copy(b"abc", bytearray(10), 1, 4, 4, 0)
    with pytest.raises(ValueError, match="dst is too small"):
        copy(b"abcdefgh", bytearray(10), 2, 4, 8, 0)


@pytest.mark.parametrize("chunks, chunk", [(1, 0), (1, 5), (3, 7), (4, 40), (2, 8193)])
def test_copy_xxh64_many_equals_one_copy_per_source(chunks, chunk):
    # sources interleaved like a pool's blocks: source j's chunk i at
    # offsets[j] + i * stride (stride = n sources * chunk)
    n = 5
    stride = n * chunk
    srcs = [os.urandom(chunks * chunk) for _ in range(n)]
    order = [3, 0, 4, 1, 2]
    dst = np.full(max(stride * chunks, 1), 7, np.uint8)
    want = dst.copy()
    digests = _checksum.copy_xxh64_many(
        srcs, [(dst, [k * chunk for k in order], chunks, chunk, stride)],
        list(range(10, 10 + n)))
    for j, k in enumerate(order):
        assert digests[j] == xxhash.xxh64_intdigest(srcs[j], 10 + j)
        _checksum.copy_xxh64(srcs[j], want[k * chunk:], chunks, chunk, stride, 0)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("tail_chunk", [0, 3, 64])
def test_copy_xxh64_many_two_parts(tail_chunk):
    """Sources made of two parts (an int8 pool's codes, then its scales)
    land in two destinations; the digest covers the whole source."""
    n, chunks, chunk, tail_chunks = 4, 3, 24, 3
    srcs = [os.urandom(chunks * chunk + tail_chunks * tail_chunk) for _ in range(n)]
    order = [2, 0, 3, 1]
    a = np.zeros(n * chunks * chunk, np.uint8)
    b = np.zeros(max(n * tail_chunks * tail_chunk, 1), np.uint8)
    digests = _checksum.copy_xxh64_many(
        srcs, [(a, [k * chunk for k in order], chunks, chunk, n * chunk),
               (b, [k * tail_chunk for k in order], tail_chunks, tail_chunk, n * tail_chunk)],
        list(range(n)))
    for j, k in enumerate(order):
        assert digests[j] == xxhash.xxh64_intdigest(srcs[j], j)
        for i in range(chunks):
            assert a[i * n * chunk + k * chunk:][:chunk].tobytes() == \
                srcs[j][i * chunk:(i + 1) * chunk]
        for i in range(tail_chunks):
            start = chunks * chunk + i * tail_chunk
            assert b[i * n * tail_chunk + k * tail_chunk:][:tail_chunk].tobytes() == \
                srcs[j][start:start + tail_chunk]


def test_copy_xxh64_many_refuses_sizes_that_do_not_fit_before_writing():
    dst = bytearray(16)
    with pytest.raises(ValueError, match=r"srcs\[1\] holds 3 bytes, expected 4"):
        _checksum.copy_xxh64_many([b"abcd", b"abc"], [(dst, [0, 4], 1, 4, 4)], [0, 0])
    with pytest.raises(ValueError, match="dst is too small"):
        _checksum.copy_xxh64_many([b"abcd", b"efgh"], [(dst, [0, 13], 1, 4, 4)], [0, 0])
    with pytest.raises(ValueError, match="dst is too small"):   # no wrap-around
        _checksum.copy_xxh64_many([b"abcd"], [(dst, [2**64 - 2], 1, 4, 4)], [0])
    with pytest.raises(ValueError, match="2 sources but 1 offsets"):
        _checksum.copy_xxh64_many([b"abcd", b"efgh"], [(dst, [0], 1, 4, 4)], [0, 0])
    with pytest.raises(ValueError, match=r"srcs\[0\] holds 4 bytes, expected 6"):
        _checksum.copy_xxh64_many([b"abcd"], [(dst, [0], 1, 4, 4),
                                              (bytearray(2), [0], 1, 2, 2)], [0])
    with pytest.raises(ValueError, match="dst is too small"):   # second part checked too
        _checksum.copy_xxh64_many([b"abcdef"], [(dst, [0], 1, 4, 4),
                                                (bytearray(1), [0], 1, 2, 2)], [0])
    assert dst == bytearray(16)
    assert _checksum.copy_xxh64_many([], [(dst, [], 1, 4, 4)], []) == []
