"""kvcore's XXH3-64 (kv_xxh3.c: the checksum of prefix-store entries of
format version 3) is the real XXH3-64, bit for bit, at every SIMD level
this CPU has; the copies that compute it copy exactly and refuse sizes that
do not fit; the batch copy gives the same bits on every thread count."""
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvcore.backends.cpu import _checksum

SCALAR, AVX2 = 0, 2
# the levels with kernels of their own that this CPU runs (a level it
# cannot run falls back to the default one, so dedupe by what runs)
LEVELS = sorted({_checksum.xxh3_level(SCALAR), _checksum.xxh3_level(AVX2)})
SEEDS = [0, 1, 0x9E3779B185EBCA87, 2**64 - 1]
RNG = np.random.default_rng(20261201)
DATA = RNG.integers(0, 256, 1 << 21, dtype=np.uint8).tobytes()


def want(data, seed):
    return xxhash.xxh3_64_intdigest(bytes(data), seed=seed)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_xxh3_every_length_to_4096(level, seed):
    # every branch of the short paths (0, 1-3, 4-8, 9-16, 17-128, 129-240),
    # and the long one across stripe (64), buffer (256) and block (1024) ends
    bad = [n for n in range(4097)
           if _checksum.xxh3_64(DATA[:n], seed, level) != want(DATA[:n], seed)]
    assert bad == []


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [8191, 8192, 8193, 65536, 65537, 1 << 20, (1 << 21) - 63])
@pytest.mark.parametrize("start", [0, 1, 7, 33, 63])
def test_xxh3_large_and_unaligned(level, n, start):
    view = memoryview(DATA)[start:start + n]
    for seed in (0, 2**64 - 1):
        assert _checksum.xxh3_64(view, seed, level) == want(view, seed)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [0, 5, 240, 241, 256, 257, 1024, 1025, 5000, 70001])
def test_xxh3_streaming_any_split_gives_the_one_shot_digest(level, n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        cuts = np.sort(rng.integers(0, n + 1, rng.integers(0, 12)))
        pieces = [DATA[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        assert _checksum.xxh3_64_pieces(pieces, 99, level) == want(DATA[:n], 99)


def test_xxh3_kvcore_simd_caps_the_level():
    code = "from kvcore.backends.cpu import _checksum as c; print(c.xxh3_level())"
    env = dict(os.environ, KVCORE_SIMD="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(SCALAR)


# the fused copy at the scalar level and at the default one
COPIES = {
    "scalar": lambda *a: _checksum.copy_xxh3(*a, level=SCALAR),
    "default": _checksum.copy_xxh3,
}


@pytest.mark.parametrize("copy", sorted(COPIES))
@pytest.mark.parametrize("chunks, chunk, stride", [(1, 0, 0), (1, 5, 5), (3, 7, 11),
                                                   (64, 32768, 65536), (4, 20000, 20000),
                                                   (2, 8193, 9000), (64, 4096, 8192),
                                                   (40, 100, 130)])
def test_copy_copies_and_hashes_the_source(copy, chunks, chunk, stride):
    src = np.frombuffer(os.urandom(chunks * chunk), np.uint8)
    dst = np.full(max(stride * chunks, 1), 0xA5, np.uint8)
    before = dst.copy()
    h = COPIES[copy](src, dst, chunks, chunk, stride, 99)
    assert h == want(src, 99)
    for i in range(chunks):
        assert np.array_equal(dst[i * stride:i * stride + chunk], src[i * chunk:(i + 1) * chunk])
        # nothing between the chunks is touched
        assert np.array_equal(dst[i * stride + chunk:(i + 1) * stride],
                              before[i * stride + chunk:(i + 1) * stride])


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_copy_refuses_sizes_that_do_not_fit(copy):
    with pytest.raises(ValueError, match="src holds"):
        COPIES[copy](b"abc", bytearray(10), 1, 4, 4, 0)
    with pytest.raises(ValueError, match="dst is too small"):
        COPIES[copy](b"abcdefgh", bytearray(10), 2, 4, 8, 0)


def _interleaved(n, chunks, chunk, fill=7):
    # sources laid out like a pool's blocks: source j's chunk i at
    # offsets[j] + i * stride (stride = n sources * chunk)
    stride = n * chunk
    order = list(RNG.permutation(n))
    dst = np.full(max(stride * chunks, 1), fill, np.uint8)
    return dst, [k * chunk for k in order], stride


@pytest.mark.parametrize("chunks, chunk", [(1, 0), (1, 5), (3, 7), (4, 40), (2, 8193),
                                           (64, 4096)])
def test_copy_xxh3_many_equals_one_copy_per_source(chunks, chunk):
    n = 5
    srcs = [DATA[j * 1000:j * 1000 + chunks * chunk] for j in range(n)]
    dst, offsets, stride = _interleaved(n, chunks, chunk)
    want_dst = dst.copy()
    digests = _checksum.copy_xxh3_many(srcs, [(dst, offsets, chunks, chunk, stride)],
                                       list(range(10, 10 + n)))
    for j in range(n):
        assert digests[j] == want(srcs[j], 10 + j)
        _checksum.copy_xxh3(srcs[j], want_dst[offsets[j]:], chunks, chunk, stride, 0)
    assert np.array_equal(dst, want_dst)


@pytest.mark.parametrize("tail_chunk", [0, 3, 64])
def test_copy_xxh3_many_two_parts(tail_chunk):
    """Sources made of two parts (an int8 pool's codes, then its scales)
    land in two destinations; the digest covers the whole source."""
    n, chunks, chunk, tail_chunks = 4, 3, 24, 3
    srcs = [os.urandom(chunks * chunk + tail_chunks * tail_chunk) for _ in range(n)]
    order = [2, 0, 3, 1]
    a = np.zeros(n * chunks * chunk, np.uint8)
    b = np.zeros(max(n * tail_chunks * tail_chunk, 1), np.uint8)
    digests = _checksum.copy_xxh3_many(
        srcs, [(a, [k * chunk for k in order], chunks, chunk, n * chunk),
               (b, [k * tail_chunk for k in order], tail_chunks, tail_chunk, n * tail_chunk)],
        list(range(n)))
    for j, k in enumerate(order):
        assert digests[j] == want(srcs[j], j)
        for i in range(chunks):
            assert a[i * n * chunk + k * chunk:][:chunk].tobytes() == \
                srcs[j][i * chunk:(i + 1) * chunk]
        for i in range(tail_chunks):
            start = chunks * chunk + i * tail_chunk
            assert b[i * n * tail_chunk + k * tail_chunk:][:tail_chunk].tobytes() == \
                srcs[j][start:start + tail_chunk]


def test_copy_xxh3_many_refuses_sizes_that_do_not_fit_before_writing():
    dst = bytearray(16)
    many = _checksum.copy_xxh3_many
    with pytest.raises(ValueError, match=r"srcs\[1\] holds 3 bytes, expected 4"):
        many([b"abcd", b"abc"], [(dst, [0, 4], 1, 4, 4)], [0, 0])
    with pytest.raises(ValueError, match="dst is too small"):
        many([b"abcd", b"efgh"], [(dst, [0, 13], 1, 4, 4)], [0, 0])
    with pytest.raises(ValueError, match="dst is too small"):   # no wrap-around
        many([b"abcd"], [(dst, [2**64 - 2], 1, 4, 4)], [0])
    with pytest.raises(ValueError, match="2 sources but 1 offsets"):
        many([b"abcd", b"efgh"], [(dst, [0], 1, 4, 4)], [0, 0])
    with pytest.raises(ValueError, match="2 sources but 1 seeds"):
        many([b"abcd", b"efgh"], [(dst, [0, 4], 1, 4, 4)], [0])
    with pytest.raises(ValueError, match=r"srcs\[0\] holds 4 bytes, expected 6"):
        many([b"abcd"], [(dst, [0], 1, 4, 4), (bytearray(2), [0], 1, 2, 2)], [0])
    with pytest.raises(ValueError, match="dst is too small"):   # second part checked too
        many([b"abcdef"], [(dst, [0], 1, 4, 4), (bytearray(1), [0], 1, 2, 2)], [0])
    assert dst == bytearray(16)
    assert many([], [(dst, [], 1, 4, 4)], []) == []


@pytest.mark.parametrize("level", LEVELS)
def test_copy_xxh3_many_same_bits_on_every_thread_count(level):
    # 24 sources of 256 KiB + a scales part: 6 MiB, enough to use 5 threads
    n, chunks, chunk, extra = 24, 64, 4096, 96
    srcs = [RNG.integers(0, 256, chunks * chunk + extra, dtype=np.uint8) for _ in range(n)]
    seeds = [int(s) for s in RNG.integers(0, 2**63, n)]
    results = []
    _, offsets, stride = _interleaved(n, chunks, chunk)
    for threads in (1, 2, 3, 5, 8, 64):
        dst = np.full(stride * chunks, 7, np.uint8)
        scales = np.zeros(n * extra, np.uint8)
        digests = _checksum.copy_xxh3_many(
            srcs, [(dst, offsets, chunks, chunk, stride),
                   (scales, [j * extra for j in range(n)], 1, extra, extra)],
            seeds, threads, level)
        results.append((digests, dst, scales))
    for digests, dst, scales in results:
        assert digests == [want(s, seed) for s, seed in zip(srcs, seeds)]
        assert np.array_equal(dst, results[0][1]) and np.array_equal(scales, results[0][2])
    for j in range(n):
        assert np.array_equal(results[0][2][j * extra:(j + 1) * extra], srcs[j][-extra:])


@pytest.mark.parametrize("misalign", [0, 8, 3])
def test_copy_xxh3_many_large_batch_same_bits(misalign):
    # 34 MiB: past the size from which the copy uses non-temporal stores
    # (16-byte aligned destinations); a misaligned one takes plain stores
    n, chunks, chunk = 17, 64, 32768
    srcs = [RNG.integers(0, 256, chunks * chunk, dtype=np.uint8) for _ in range(n)]
    seeds = list(range(n))
    base = np.zeros(n * chunks * chunk + 64, np.uint8)
    dst = base[misalign:misalign + n * chunks * chunk]
    _, offsets, stride = _interleaved(n, chunks, chunk)
    for threads in (1, 3):
        dst[:] = 0
        digests = _checksum.copy_xxh3_many(srcs, [(dst, offsets, chunks, chunk, stride)],
                                           seeds, threads)
        assert digests == [want(s, seed) for s, seed in zip(srcs, seeds)]
        got = dst.reshape(chunks, n, chunk)
        for j, off in enumerate(offsets):
            src = srcs[j].reshape(chunks, chunk)
            assert np.array_equal(got[:, off // chunk], src)


# ------------------------------------------------------ the C on its own
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvcore" / "backends" / "cpu" / "csrc"
C_SOURCES = ("kv_xxh3.c", "kv_xxh3_avx2.c", "kv_xxh3_neon.c", "kv_xxh3_many.c", "kv_simd.c")


def _check_c_output(out, level):
    data = bytes((i * 131 + 7) & 255 for i in range(5000 + 4 * 70000))
    lines = out.splitlines()
    assert lines[-2:] == [f"level {level}", "0 mismatches"]
    checked = 0
    for line in lines[:-2]:
        if line.startswith("copy "):
            _, j, seed, digest = line.split()
            j = int(j)
            assert int(digest) == want(data[j * 70000:(j + 1) * 70000], int(seed))
        else:
            n, seed, digest = map(int, line.split())
            assert int(digest) == want(data[:n], seed), (n, seed)
        checked += 1
    assert checked > 4 * 1100


def _build(cc, out, extra=()):
    if not (CSRC / "kv_xxh3.c").exists():
        pytest.skip("needs the source tree")
    subprocess.run([cc, "-O2", "-pthread", "-std=c99", "-Wall", "-Werror", *extra, f"-I{CSRC}",
                    str(ROOT / "tests" / "c" / "kv_xxh3_check.c"),
                    *[str(CSRC / c) for c in C_SOURCES], "-o", str(out)],
                   check=True, capture_output=True, text=True)


@pytest.mark.toolchain
def test_c_xxh3_natively(tmp_path):
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    _build(cc, tmp_path / "check")
    names = {0: "scalar", 2: "avx2"}
    for simd, level in (("", names.get(_checksum.xxh3_level(), "?")), ("scalar", "scalar")):
        run = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, KVCORE_SIMD=simd))
        assert run.returncode == 0, run.stderr
        _check_c_output(run.stdout, level)


@pytest.mark.toolchain
def test_c_xxh3_on_aarch64_under_qemu(tmp_path):
    try:
        from _helpers import aarch64_tools
    except ImportError:  # pragma: no cover - run as a package
        from ._helpers import aarch64_tools
    cc, qemu = aarch64_tools()
    _build(cc, tmp_path / "check", ["-static"])
    # the NEON kernels (the default on AArch64), then the scalar ones
    for simd, level in (("", "neon"), ("scalar", "scalar")):
        run = subprocess.run([qemu, str(tmp_path / "check")], capture_output=True, text=True,
                             timeout=600, env=dict(os.environ, KVCORE_SIMD=simd))
        assert run.returncode == 0, run.stderr
        _check_c_output(run.stdout, level)


def test_only_the_avx2_kernels_use_avx():
    import glob
    import platform
    import re
    import shutil

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("needs x86-64 and objdump")
    try:
        from _helpers import functions_in
    except ImportError:  # pragma: no cover - run as a package
        from ._helpers import functions_in
    so = glob.glob(str(ROOT / "kvcore" / "backends" / "cpu" / "_checksum*.so"))
    if not so:
        pytest.skip("the _checksum extension is not built in place")
    fns = functions_in(so[0])
    avx = {fn for fn, insns in fns.items()
           if any(i.split()[0].startswith("v") or "ymm" in i for i in insns)}
    assert {"kv_xxh3_stripes_avx2", "kv_xxh3_stripes_stream_avx2"} <= avx
    assert all(re.search(r"_avx2(\.\w+)?$", fn.split("@")[0]) for fn in avx), sorted(avx)
