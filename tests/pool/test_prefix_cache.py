"""Prefix caching: one test (or a few) per rule of API.md's "Prefix caching
rules", plus the hash algorithm pinned by a pure-Python SipHash-2-4-128.

KV written in these tests is a deterministic function of (salt, the token ids
up to and including the position, layer), like a real model's, so a prefix hit
can be checked against the values the hit must give back."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcore

try:
    from _helpers import cached_hash_bytes, pool_snapshot
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import cached_hash_bytes, pool_snapshot
from kvcore import hashing
from kvcore._native import _pool

L, H, D = 2, 2, 3


def make_pool(num_blocks=16, block_size=4, caching=True):
    return kvcore.BlockPool(num_blocks, block_size, L, H, D, dtype="float32",
                            enable_prefix_caching=caching)


def kv_at(tokens, p, salt=None):
    """(L, 2, H, D) K and V of position p: a function of salt and tokens[:p+1]."""
    key = repr((salt, [int(t) for t in tokens[:p + 1]])).encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal((L, 2, H, D)).astype(np.float32)


def want_kv(tokens, start, end, salt=None):
    """(L, 2, H, end - start, D) expected gather result."""
    if end == start:
        return np.zeros((L, 2, H, 0, D), np.float32)
    return np.stack([kv_at(tokens, p, salt) for p in range(start, end)], axis=3)


def fill(seq, tokens, end=None, salt=None, batched=False):
    """Compute positions num_computed..end-1 as the model would for ``tokens``
    and commit them (through append, or reserve + slot_mapping + pool.write +
    mark_written)."""
    end = len(tokens) if end is None else end
    start = seq.num_computed
    if end <= start:
        return
    data = want_kv(tokens, start, end, salt)          # (L, 2, H, n, D)
    if batched:
        seq.reserve(end - start)
        slots = seq.slot_mapping(start, end)
    for layer in range(L):
        k = data[layer, 0].transpose(1, 0, 2)
        v = data[layer, 1].transpose(1, 0, 2)
        if batched:
            seq.pool.write(layer, k, v, slots)
            seq.mark_written(layer, end - start)
        else:
            seq.append(layer, k, v)
    seq.commit(end - start)


def check_kv(seq, tokens, end=None, salt=None, start=0):
    end = seq.num_computed if end is None else end
    want = want_kv(tokens, start, end, salt)
    for layer in range(L):
        k, v = seq.gather(layer, start, end)
        np.testing.assert_array_equal(k, want[layer, 0])
        np.testing.assert_array_equal(v, want[layer, 1])


def filled_seq(pool, tokens, end=None, known=None):
    """A sequence of ``pool`` allocated on ``tokens[:known]`` (all by
    default), the model's KV for ``tokens`` at positions ``0..end-1`` (all
    by default) computed and committed."""
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(tokens if known is None else tokens[:known])
    fill(seq, tokens, end)
    return seq


def hit_seq(pool, tokens, hit, kv_tokens):
    """A sequence of ``pool`` allocated on ``tokens``, which must hit
    ``hit`` tokens whose KV is the model's for ``kv_tokens``."""
    seq = kvcore.PagedKVCache(pool)
    assert seq.allocate(tokens) == hit
    check_kv(seq, kv_tokens, hit)
    return seq


def free_and_check(pool, *seqs):
    """Free ``seqs`` in order, then check the whole pool (how a test ends)."""
    for seq in seqs:
        seq.free()
    pool.debug.check()


def snapshot(pool):
    return pool_snapshot(pool, cached_tokens=True)


def prompt(base, n):
    return [base + i for i in range(n)]


# ------------------------------------------------------------------ basics
def test_hit_returns_the_cached_kv_and_counts_tokens():
    pool = make_pool()
    a = kvcore.PagedKVCache(pool)
    ta = prompt(100, 10)
    assert a.allocate(ta) == 0
    fill(a, ta)
    assert pool.num_cached_blocks == 2            # only full blocks
    assert [pool.is_cached(b) for b in a.block_table] == [True, True, False]
    b = kvcore.PagedKVCache(pool)
    tb = ta[:8] + [7, 8, 9]
    assert b.allocate(tb) == 8
    assert b.num_computed == 8 and b.num_tokens == 11
    assert b.block_table[:2].tolist() == a.block_table[:2].tolist()
    assert [pool.ref_count(x) for x in b.block_table[:2]] == [2, 2]
    check_kv(b, tb, 8)
    fill(b, tb)
    check_kv(b, tb)
    check_kv(a, ta)
    s = pool.stats()
    assert s["prefix_queries"] == 10 + 11
    assert s["prefix_hits"] == 8
    assert s["evictions"] == 0
    assert s["prefix_hit_rate"] == pytest.approx(8 / 21)
    # the pool hashes blocks exactly as block_hashes does
    assert b.block_hashes() == kvcore.block_hashes(tb, 4)
    for i, blk in enumerate(a.block_table[:2]):
        assert cached_hash_bytes(pool, blk) == kvcore.block_hashes(ta, 4)[i]
        assert pool.debug.cached_block(blk)[0].tolist() == ta[4 * i:4 * i + 4]
    free_and_check(pool, a, b)


def test_caching_disabled_never_hits_or_caches():
    pool = make_pool(caching=False)
    assert pool.enable_prefix_caching is False
    t = prompt(1, 9)
    a = filled_seq(pool, t)
    assert pool.num_cached_blocks == 0
    b = kvcore.PagedKVCache(pool)
    assert b.allocate(t) == 0
    assert pool.stats()["prefix_hits"] == 0
    a.free()
    b.free()
    assert pool.num_cached_blocks == 0
    pool.debug.check()


def test_only_full_committed_blocks_with_known_tokens_are_cached():
    pool = make_pool()
    a = kvcore.PagedKVCache(pool)
    t = prompt(1, 7)
    a.allocate(t)
    assert pool.num_cached_blocks == 0          # nothing committed yet
    data = want_kv(t, 0, 7)
    for layer in range(L):
        a.append(layer, data[layer, 0].transpose(1, 0, 2), data[layer, 1].transpose(1, 0, 2))
    assert pool.num_cached_blocks == 0          # appended, not committed
    a.commit(3)
    assert pool.num_cached_blocks == 0          # block 0 not full yet
    a.commit(4)
    assert pool.num_cached_blocks == 1          # block 1 (positions 4..6) is partial
    a.free()
    assert pool.num_cached_blocks == 1
    pool.debug.check()


# ------------------------------------------------------------------ allocation order
def test_never_cached_blocks_are_used_before_any_eviction():
    pool = make_pool(num_blocks=8, block_size=4)
    ta = prompt(100, 13)                  # 3 full blocks + 1 partial
    a = filled_seq(pool, ta)
    cached = [int(b) for b in a.block_table[:3]]
    a.free()
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 8
    # 5 never-cached blocks are free: they all go before any cached one
    others = []
    for i in range(5):
        s = kvcore.PagedKVCache(pool)
        assert s.allocate(prompt(1000 * (i + 1), 3)) == 0
        others.append(s)
        assert not set(s.block_table.tolist()) & set(cached)
        assert pool.stats()["evictions"] == 0
        assert pool.num_cached_blocks == 3
    # only now is a cached block reused
    s = kvcore.PagedKVCache(pool)
    s.allocate([5])
    assert s.block_table[0] in cached
    assert pool.stats()["evictions"] == 1
    assert pool.num_cached_blocks == 2
    for x in others + [s]:
        x.free()
    pool.debug.check()


def test_released_uncached_blocks_are_reused_last_in_first_out():
    pool = make_pool(num_blocks=6, block_size=4, caching=False)
    a, b, c = (kvcore.PagedKVCache(pool) for _ in range(3))
    a.allocate([1])
    b.allocate([2])
    blk_a = int(a.block_table[0])
    a.free()
    c.allocate([3])
    assert int(c.block_table[0]) == blk_a
    free_and_check(pool, b, c)


def test_tail_of_a_released_prefix_is_evicted_before_its_head():
    pool = make_pool(num_blocks=5, block_size=4)
    ta = prompt(100, 12)                  # 3 full blocks, all cached after commit
    a = filled_seq(pool, ta + [1])        # 4 blocks: the last is partial
    b0, b1, b2 = (int(x) for x in a.block_table[:3])
    a.free()
    # released tail first: the tail is next to evict, the head last
    assert pool.debug.snapshot()["lru_order"] == [b2, b1, b0]
    # use the two never-cached blocks (a's partial tail and block 4), then
    # force two evictions
    x = kvcore.PagedKVCache(pool)
    x.allocate(prompt(300, 5))
    assert pool.stats()["evictions"] == 0
    assert pool.debug.snapshot()["lru_order"] == [b2, b1, b0]
    y = kvcore.PagedKVCache(pool)
    y.allocate(prompt(500, 5))            # 2 blocks: evicts b2 then b1
    assert sorted(y.block_table.tolist()) == sorted([b2, b1])
    assert pool.stats()["evictions"] == 2
    assert pool.debug.snapshot()["lru_order"] == [b0]
    assert pool.is_cached(b0) and not pool.is_cached(b1) and not pool.is_cached(b2)
    x.free()
    y.free()
    # the head of the prefix survived: a new request still hits block 0
    c = kvcore.PagedKVCache(pool)
    assert c.allocate(ta + [2]) == 4
    assert int(c.block_table[0]) == b0
    check_kv(c, ta, 4)
    free_and_check(pool, c)


def test_least_recently_released_is_evicted_first():
    pool = make_pool(num_blocks=4, block_size=2)
    a, b = kvcore.PagedKVCache(pool), kvcore.PagedKVCache(pool)
    ta, tb = [1, 2, 3], [4, 5, 6]
    for s, t in ((a, ta), (b, tb)):
        s.allocate(t)
        fill(s, t)
    blk_a, blk_b = int(a.block_table[0]), int(b.block_table[0])
    b.free()
    a.free()                                # a released last: evicted last
    assert pool.debug.snapshot()["lru_order"] == [blk_b, blk_a]
    # a hit takes a block off the LRU; releasing it puts it at the end again
    c = kvcore.PagedKVCache(pool)
    assert c.allocate(tb + [7]) == 2
    assert pool.debug.snapshot()["lru_order"] == [blk_a]
    c.free()
    assert pool.debug.snapshot()["lru_order"] == [blk_a, blk_b]
    pool.debug.check()


def test_a_held_cached_block_is_never_evicted():
    pool = make_pool(num_blocks=4, block_size=4)
    ta = prompt(1, 9)
    a = filled_seq(pool, ta)              # blocks 0, 1 cached and held
    b = kvcore.PagedKVCache(pool)
    with pytest.raises(kvcore.OutOfBlocksError):
        b.allocate(prompt(50, 8))         # needs 2, only 1 free
    assert pool.stats()["evictions"] == 0
    assert pool.num_cached_blocks == 2
    b.allocate(prompt(50, 4))
    assert pool.num_free_blocks == 0
    with pytest.raises(kvcore.OutOfBlocksError):
        kvcore.PagedKVCache(pool).allocate([1])
    check_kv(a, ta)
    assert pool.stats()["evictions"] == 0
    free_and_check(pool, a, b)


def test_failed_allocation_changes_nothing():
    """Hits on free cached blocks must not be taken when the rest is missing."""
    pool = make_pool(num_blocks=6, block_size=4)
    ta = prompt(100, 12)
    a = filled_seq(pool, ta + [1])
    a.free()                                  # 3 cached free blocks, 3 never-cached
    h = kvcore.PagedKVCache(pool)
    h.allocate(prompt(900, 8))                # holds 2 never-cached blocks
    assert pool.num_free_blocks == 4
    snap = snapshot(pool)
    b = kvcore.PagedKVCache(pool)
    with pytest.raises(kvcore.OutOfBlocksError):
        b.allocate(ta + prompt(5000, 9))      # hits 3, needs 3 more; only 1 other free
    assert snapshot(pool) == snap
    pool.debug.check()
    assert b.num_tokens == 0 and b.num_blocks == 0 and b.num_computed == 0
    with pytest.raises(kvcore.OutOfBlocksError):
        b.allocate(prompt(7000, 17))          # no hits, 5 blocks, 4 free
    assert snapshot(pool) == snap
    # exactly enough: hits 3 + 1 fresh
    assert b.allocate(ta + [1, 2]) == 12
    assert pool.num_free_blocks == 0
    assert pool.stats()["evictions"] == 0
    check_kv(b, ta, 12)
    free_and_check(pool, b, h)


def test_reset_prefix_cache():
    pool = make_pool(num_blocks=6, block_size=2)
    t = prompt(10, 7)
    a = filled_seq(pool, t)
    keep = filled_seq(pool, prompt(50, 3))
    a.free()
    assert pool.num_cached_blocks == 4
    snap = snapshot(pool)
    assert pool.reset_prefix_cache() is False      # keep holds blocks
    assert snapshot(pool) == snap
    keep.free()
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.debug.snapshot()["lru_order"] == []
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0
    assert not any(pool.is_cached(b) for b in range(6))
    assert pool.stats()["evictions"] == 0
    pool.debug.check()
    b = kvcore.PagedKVCache(pool)
    assert b.allocate(t) == 0
    b.free()
    assert pool.reset_prefix_cache() is True        # nothing cached: still True
    pool.debug.check()


# ------------------------------------------------------------------ salts
def test_salt_isolation():
    pool = make_pool(num_blocks=32, block_size=4)
    t = prompt(100, 9)
    seqs = {}
    for salt in (None, "tenant-a", "tenant-b", b"tenant-c", "", "é"):
        s = kvcore.PagedKVCache(pool, salt=salt)
        assert s.allocate(t) == 0, salt
        fill(s, t, salt=salt)
        seqs[salt] = s
    held = [set(s.block_table.tolist()) for s in seqs.values()]
    for i in range(len(held)):
        for j in range(i + 1, len(held)):
            assert not held[i] & held[j]
    assert pool.num_cached_blocks == 2 * len(seqs)
    # a str salt is its UTF-8 bytes: the same salt given either way shares
    for salt, same in (("tenant-a", b"tenant-a"), (b"tenant-c", "tenant-c"),
                       ("é", "é".encode()), (None, None), ("", b"")):
        s = kvcore.PagedKVCache(pool, salt=same)
        assert s.salt == (None if same is None else
                          same.encode() if isinstance(same, str) else same)
        assert s.allocate(t + [1]) == 8
        assert s.block_table[:2].tolist() == seqs[salt].block_table[:2].tolist()
        check_kv(s, t, 8, salt=salt)
        s.free()
    assert kvcore.block_hashes(t, 4, salt="x") == kvcore.block_hashes(t, 4, salt=b"x")
    hs = [kvcore.block_hashes(t, 4, salt=s) for s in (None, "x", "y", "", b"\0")]
    for i in range(len(hs)):
        for j in range(i + 1, len(hs)):
            assert not set(hs[i]) & set(hs[j])
    with pytest.raises(TypeError, match="salt"):
        kvcore.block_hashes(t, 4, salt=3)
    for s in seqs.values():
        s.free()
    pool.debug.check()


# ------------------------------------------------------------------ hashes
_SIP_C = (0x736f6d6570736575, 0x646f72616e646f6d, 0x6c7967656e657261, 0x7465646279746573)
_M64 = 2**64 - 1

# The block hash's SipHash variant (compression, finalization rounds), as
# kv_hash.h documents it.  Changing it changes every block hash: a decision.
BLOCK_ROUNDS = (1, 3)
BLOCK_KEY = b"kvcore.block.v1\0"


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & _M64


def siphash128(key, data, c=2, d=4):
    """Reference SipHash-c-d with 128-bit output (Aumasson & Bernstein)."""
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:16], "little")
    v = [k0 ^ _SIP_C[0], k1 ^ _SIP_C[1] ^ 0xEE, k0 ^ _SIP_C[2], k1 ^ _SIP_C[3]]

    def rounds(n):
        for _ in range(n):
            v[0] = (v[0] + v[1]) & _M64
            v[1] = _rotl(v[1], 13) ^ v[0]
            v[0] = _rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & _M64
            v[3] = _rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & _M64
            v[3] = _rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & _M64
            v[1] = _rotl(v[1], 17) ^ v[2]
            v[2] = _rotl(v[2], 32)

    full = len(data) // 8 * 8
    for i in range(0, full, 8):
        m = int.from_bytes(data[i:i + 8], "little")
        v[3] ^= m
        rounds(c)
        v[0] ^= m
    b = ((len(data) & 0xFF) << 56) | int.from_bytes(data[full:], "little")
    v[3] ^= b
    rounds(c)
    v[0] ^= b
    v[2] ^= 0xEE
    rounds(d)
    out0 = v[0] ^ v[1] ^ v[2] ^ v[3]
    v[1] ^= 0xDD
    rounds(d)
    out1 = v[0] ^ v[1] ^ v[2] ^ v[3]
    return out0.to_bytes(8, "little") + out1.to_bytes(8, "little")


def native_siphash128(key, data, c, d):
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:16], "little")
    return _pool.siphash128(data, k0, k1, c, d)


def reference_block_hashes(tokens, block_size, salt=None):
    """The documented algorithm, written from the description alone."""
    if salt is None:
        h = bytes(16)
    else:
        raw = salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)
        h = siphash128(BLOCK_KEY, b"kvcore.salt:" + raw, *BLOCK_ROUNDS)
    out = []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size:(i + 1) * block_size]
        h = siphash128(BLOCK_KEY, h + b"".join(int(t).to_bytes(4, "little") for t in blk),
                       *BLOCK_ROUNDS)
        out.append(h)
    return out


KEY_00_0F = bytes(range(16))


@pytest.mark.parametrize("n,hexdigest", [
    (0, "a3817f04ba25a8e66df67214c7550293"),
    (1, "da87c1d86b99af44347659119b22fc45"),
    (2, "8177228da4a45dc7fca38bdef60affe4"),
])
def test_siphash_2_4_128_reference_vectors(n, hexdigest):
    """The published SipHash-2-4-128 vectors (key 00..0f, message 00..n-1)
    pin the reference and the native function."""
    data = bytes(range(n))
    assert siphash128(KEY_00_0F, data, 2, 4).hex() == hexdigest
    assert native_siphash128(KEY_00_0F, data, 2, 4).hex() == hexdigest


def test_native_siphash_matches_reference_on_every_tail_length():
    rng = np.random.default_rng(3)
    for n in range(0, 40):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for key in (KEY_00_0F, BLOCK_KEY):
            for c, d in {(2, 4), BLOCK_ROUNDS}:
                assert native_siphash128(key, data, c, d) == siphash128(key, data, c, d), n
    assert _pool.block_key() == (int.from_bytes(BLOCK_KEY[:8], "little"),
                                 int.from_bytes(BLOCK_KEY[8:], "little"))


HASH_CASES = [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "tenant"),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"\x00\xffbytes"),
    ([0, 2**31 - 1, 65536, 255, 256, 7, 2**24 + 3], 3, "é-salt"),
    ([5] * 17, 1, None),
    ([5] * 17, 2, ""),
    (list(range(40)), 16, None),
    ([9, 9, 9], 4, None),
]


def _hash_script_output(seed):
    """block_hashes (and a sequence's own hashes) computed in a fresh process."""
    script = (
        "import json, sys, kvcore\n"
        "cases = json.loads(sys.argv[1])\n"
        "out = []\n"
        "pool = kvcore.BlockPool(64, 1, 1, 1, 1)\n"
        "for toks, bs, salt in cases:\n"
        "    if isinstance(salt, list): salt = bytes(salt)\n"
        "    hs = kvcore.block_hashes(toks, bs, salt=salt)\n"
        "    p = kvcore.BlockPool(16, bs, 1, 1, 1)\n"
        "    s = kvcore.PagedKVCache(p, salt=salt)\n"
        "    s.allocate(toks[:1])\n"
        "    for t in toks[1:]: s.append_token(t)\n"
        "    out.append([[h.hex() for h in hs], [h.hex() for h in s.block_hashes()]])\n"
        "    s.free()\n"
        "print(json.dumps(out))\n")
    cases = [[t, bs, list(s) if isinstance(s, bytes) else s] for t, bs, s in HASH_CASES]
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvcore.__file__)))
    env = dict(os.environ, PYTHONHASHSEED=str(seed),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(res.stdout)


def test_block_hashes_follow_the_documented_algorithm():
    for toks, bs, salt in HASH_CASES:
        got = kvcore.block_hashes(toks, bs, salt=salt)
        assert all(isinstance(h, bytes) and len(h) == 16 for h in got)
        assert len(got) == len(toks) // bs
        assert got == reference_block_hashes(toks, bs, salt)
        assert kvcore.block_hashes(np.array(toks, np.int64), bs, salt=salt) == got


def test_block_hashes_equal_across_processes_and_hash_seeds():
    expected = [[[h.hex() for h in reference_block_hashes(t, bs, s)]] * 2
                for t, bs, s in HASH_CASES]
    outputs = [_hash_script_output(seed) for seed in (0, 1, 987654321)]
    for out in outputs:
        assert out == expected


@pytest.mark.parametrize("block_size", [41, 2**40, 2**63, 2**100])
def test_block_hashes_of_a_block_size_past_the_tokens_is_empty(block_size):
    assert kvcore.block_hashes(list(range(40)), block_size) == []


@pytest.mark.parametrize("call", [
    lambda pool: kvcore.block_hashes([1, 2, 3, 4], 4, salt="a\ud800"),
    lambda pool: kvcore.PagedKVCache(pool, salt="a\ud800"),
    lambda pool: pool.probe([1, 2, 3, 4, 5], salt="a\ud800"),
    lambda pool: pool.prefetch([1, 2, 3, 4, 5], salt="a\ud800"),
], ids=["block_hashes", "PagedKVCache", "probe", "prefetch"])
def test_a_salt_utf8_cannot_encode_is_refused_by_name(call):
    pool = kvcore.BlockPool(4, 4, 1, 1, 4)
    before = pool.debug.snapshot()
    with pytest.raises(ValueError, match=r"salt must be text UTF-8 can encode, got 'a\\ud800' "
                                         r"\(surrogates not allowed at index 1\)"):
        call(pool)
    assert pool.debug.snapshot() == before


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=40),
       block_size=st.integers(1, 9), salt=st.one_of(st.none(), st.text(max_size=5),
                                                    st.binary(max_size=5)))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens, block_size, salt):
    full = kvcore.block_hashes(tokens, block_size, salt=salt)
    assert len(full) == len(tokens) // block_size
    for n in range(len(tokens) + 1):
        assert kvcore.block_hashes(tokens[:n], block_size, salt=salt) == \
            full[:n // block_size]
    assert len(set(full)) == len(full)    # chained: equal blocks hash differently


def test_block_hashes_errors():
    with pytest.raises(ValueError, match="block_size"):
        kvcore.block_hashes([1, 2], 0)
    with pytest.raises(TypeError, match="block_size"):
        kvcore.block_hashes([1, 2], 2.0)
    assert kvcore.block_hashes([], 4) == []
    assert kvcore.block_hashes([1, 2, 3], 4) == []


# ------------------------------------------------------------------ last block
def test_a_fully_cached_prompt_still_recomputes_its_last_block():
    bs = 4
    pool = make_pool(num_blocks=32, block_size=bs)
    ta = prompt(100, 12)
    a = filled_seq(pool, ta)
    assert pool.num_cached_blocks == 3
    for n in range(1, 13):
        s = kvcore.PagedKVCache(pool)
        hit = s.allocate(ta[:n])
        assert hit % bs == 0 and hit < n
        assert hit == (n - 1) // bs * bs
        assert s.num_computed == hit
        check_kv(s, ta, hit)
        s.free()
    b = kvcore.PagedKVCache(pool)
    assert b.allocate(ta) == 8           # the whole prompt is cached; 4 tokens recomputed
    assert b.block_table[:2].tolist() == a.block_table[:2].tolist()
    assert b.block_table[2] != a.block_table[2]
    fill(b, ta)
    check_kv(b, ta)
    # the recomputed block duplicates a cached one: it is not registered again
    assert pool.num_cached_blocks == 3
    assert not pool.is_cached(int(b.block_table[2]))
    free_and_check(pool, b, a)


# ------------------------------------------------------------------ generated tokens
def test_generated_tokens_appended_after_commit_make_blocks_cacheable():
    bs = 4
    pool = make_pool(block_size=bs)
    full = prompt(100, 3) + [7, 8, 9, 10, 11]   # 3 prompt tokens, 5 generated
    a = filled_seq(pool, full, 3, known=3)
    # KV for positions 3..7 is committed before the cache is told their tokens
    for p in range(3, 8):
        fill(a, full, p + 1)
    assert a.num_computed == 8 and a.num_tokens == 3
    assert pool.num_cached_blocks == 0
    a.append_token(full[3])
    assert pool.num_cached_blocks == 1 and pool.is_cached(int(a.block_table[0]))
    for t in full[4:7]:
        a.append_token(t)
    assert pool.num_cached_blocks == 1
    a.append_token(full[7])
    assert pool.num_cached_blocks == 2
    assert a.block_hashes() == kvcore.block_hashes(full, bs)
    b = hit_seq(pool, full + [1], 8, full)
    free_and_check(pool, a, b)


def test_tokens_known_before_commit_make_blocks_cacheable():
    bs = 4
    pool = make_pool(block_size=bs)
    full = prompt(100, 3) + [20, 21, 22, 23, 24, 25]
    a = filled_seq(pool, full, 3, known=3)
    for p in range(3, 9):                  # the usual decode loop
        a.append_token(full[p])
        if p == 3:
            assert pool.num_cached_blocks == 0    # token known, KV not committed
        fill(a, full, p + 1)
        assert pool.num_cached_blocks == (p + 1) // bs
    b = hit_seq(pool, full[:8] + [0], 8, full)
    # extend_tokens is append_token for many
    c = filled_seq(pool, full, 8, known=1)
    c.extend_tokens(full[1:8])
    assert c.block_hashes() == kvcore.block_hashes(full[:8], bs)
    free_and_check(pool, a, b, c)


# ------------------------------------------------------------------ no leaks
@pytest.mark.parametrize("batched", [False, True])
def test_truncate_never_leaks_new_kv_into_cached_or_shared_blocks(batched):
    bs = 4
    pool = make_pool(num_blocks=32, block_size=bs)
    old = prompt(100, 10)
    a = filled_seq(pool, old)
    assert pool.num_cached_blocks == 2
    f = a.fork()                           # a sibling holding every block
    cached1 = int(a.block_table[1])
    a.truncate(6)                          # inside cached (and shared) block 1
    assert a.num_computed == 6 and a.num_tokens == 6
    new = old[:6] + [7, 7, 7, 7]
    for t in new[6:]:
        a.append_token(t)
    fill(a, new, batched=batched)
    assert int(a.block_table[1]) != cached1       # copied before the write
    check_kv(a, new)
    check_kv(f, old)                        # the sibling sees the old KV
    assert pool.is_cached(cached1)
    # a later prefix hit on the old tokens sees the old KV ...
    b = kvcore.PagedKVCache(pool)
    assert b.allocate(old[:8] + [1]) == 8
    assert int(b.block_table[1]) == cached1
    check_kv(b, old, 8)
    # ... and one on the new tokens sees the new KV
    c = hit_seq(pool, new[:8] + [1], 8, new)
    free_and_check(pool, a, b, c, f)


def test_truncate_of_an_unshared_cached_block_copies_before_writing():
    bs = 2
    pool = make_pool(num_blocks=16, block_size=bs)
    old = prompt(10, 6)
    a = filled_seq(pool, old)
    blk = int(a.block_table[1])
    assert pool.ref_count(blk) == 1 and pool.is_cached(blk)
    a.truncate(3)
    new = old[:3] + [99]
    a.append_token(99)
    fill(a, new)
    assert int(a.block_table[1]) != blk
    check_kv(a, new)
    b = hit_seq(pool, old[:4] + [0], 4, old)
    # truncating on a block boundary and regrowing needs no copy
    a.truncate(2)
    assert a.num_blocks == 1
    free_and_check(pool, a, b)


def test_truncate_then_rewrite_uncached_block_before_its_tokens_are_known():
    """KV committed past the known tokens, then truncated and rewritten: the
    block is registered with the KV that matches its tokens."""
    bs = 4
    pool = make_pool(num_blocks=16, block_size=bs)
    old = prompt(10, 3) + [40, 41, 42, 43, 44]
    a = filled_seq(pool, old, 8, known=3)    # tokens 3..7 not told to the cache
    a.truncate(5)
    new = old[:5] + [50, 51, 52]
    fill(a, new, 8)
    for t in new[3:]:
        a.append_token(t)
    assert pool.num_cached_blocks == 2
    b = hit_seq(pool, new + [1], 8, new)
    c = kvcore.PagedKVCache(pool)
    assert c.allocate(old + [1]) == 4
    free_and_check(pool, a, b, c)


def test_fork_never_leaks_new_kv():
    bs = 4
    pool = make_pool(num_blocks=32, block_size=bs)
    base = prompt(100, 6)
    a = filled_seq(pool, base)
    b = a.fork()
    ta = base + [1, 2]
    tb = base + [3, 4]
    for s, t in ((a, ta), (b, tb)):
        for tok in t[6:]:
            s.append_token(tok)
    fill(a, ta, 7)                        # a copies the shared partial block
    check_kv(b, base)
    with pytest.raises(ValueError, match="never"):
        b.gather(0, 0, 7)
    fill(b, tb, 7)                        # b now writes its block in place
    fill(a, ta)
    fill(b, tb)
    check_kv(a, ta)
    check_kv(b, tb)
    assert a.block_table[0] == b.block_table[0]
    assert a.block_table[1] != b.block_table[1]
    assert pool.num_cached_blocks == 3
    for t in (ta, tb):
        c = hit_seq(pool, t + [0], 8, t)
        c.free()
    # a fork of a sequence whose blocks are all cached: writes never touch them
    d = a.fork()
    d.truncate(7)
    td = ta[:7] + [5]
    d.append_token(5)
    fill(d, td)
    check_kv(a, ta)
    check_kv(d, td)
    free_and_check(pool, a, b, d)


# ------------------------------------------------------------------ collisions
def test_lookup_verifies_token_ids():
    bs = 4
    pool = make_pool(block_size=bs)
    t = prompt(100, 9)
    a = filled_seq(pool, t)
    core = pool._core
    hashes = hashing.hash_words(np.array(t, np.int32), bs, (0, 0))
    out = np.full(2, -1, np.int32)
    assert core.lookup_prefix(np.array(t, np.int32), hashes, 2, out) == 2
    assert out.tolist() == a.block_table[:2].tolist()
    # same hashes, other tokens in block 0 / in block 1
    for i in (0, 5):
        other = np.array(t, np.int32)
        other[i] += 1
        out[:] = -1
        n = core.lookup_prefix(other, hashes, 2, out)
        assert n == i // bs
        assert out[:n].tolist() == a.block_table[:n].tolist()
    free_and_check(pool, a)


def forged_pool(block_size):
    """A pool on which every block hashes alike (the documented test seam)."""
    return kvcore.BlockPool._with_forged_hashes(16, block_size, L, H, D, dtype="float32")


def test_a_forged_hash_collision_never_hands_back_other_kv():
    """Every block hashes alike; only the stored token ids tell them apart."""
    bs = 4
    pool = forged_pool(bs)
    a = kvcore.PagedKVCache(pool)
    ta = prompt(100, 9)
    a.allocate(ta)
    assert len({bytes(h) for h in a.block_hashes()}) == 1   # the forgery is in force
    fill(a, ta)
    assert pool.num_cached_blocks == 2        # same hash, different tokens: both kept
    b = kvcore.PagedKVCache(pool)
    tb = prompt(500, 9)
    assert b.allocate(tb) == 0
    fill(b, tb)
    check_kv(b, tb)
    c = kvcore.PagedKVCache(pool)
    tc = ta[:4] + prompt(700, 5)
    assert c.allocate(tc) == 4
    check_kv(c, tc, 4)
    free_and_check(pool, a, b, c)


def test_a_full_chain_collision_never_hands_back_other_kv():
    """Every block hashes alike AND a later block's tokens equal a cached
    block's: only the identity chain (a hit's parent must be the block that
    hit before it) keeps another prefix's KV out."""
    bs = 4
    pool = forged_pool(bs)
    a = kvcore.PagedKVCache(pool)
    x = prompt(100, 8)
    ta = x + [1]
    a.allocate(ta)
    assert len({bytes(h) for h in a.block_hashes()}) == 1   # the forgery is in force
    fill(a, ta)
    assert pool.num_cached_blocks == 2
    # blocks swapped: block 0 of d equals block 1 of a, and the other way round
    d = kvcore.PagedKVCache(pool)
    td = x[4:8] + x[0:4] + [0]
    assert d.allocate(td) == 0
    fill(d, td)
    check_kv(d, td)
    # a salted sequence never reaches an unsalted chain, even with equal hashes
    e = kvcore.PagedKVCache(pool, salt="tenant")
    assert e.allocate(ta) == 0
    free_and_check(pool, a, d, e)
