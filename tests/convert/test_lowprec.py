"""Low-precision storage: fp8 (e4m3fn, e5m2; per-layer scales) and int8
(one float32 scale per token and kv head) pools and caches.

The NumPy reference (kvcore.backends.base: fp8_encode / int8_encode and the
*_q operations) is checked against ml_dtypes and the definition; the CPU
kernels against the reference, bit for bit; pools through random op
sequences (prefix hits, fork / copy-on-write, truncate, copy_to, offload)
against a model built from the reference; attention against the float64
reference on the stored (dequantized) values.
"""
import itertools

import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore import dtypes
from kvcore.backends import CPU
from kvcore.backends.base import (REFERENCE, fp8_decode, fp8_encode, int8_decode,
                                  int8_encode)
from kvcore.backends.cpu import _attention as _kernel
from kvcore.backends.base import paged_attention_reference
from kvcore.backends.codec import Codec
from kvcore.pool import store_port

try:
    from _helpers import reference_scales as reference_kw
    from _simd_levels import level_fixture
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import reference_scales as reference_kw
    from ._simd_levels import level_fixture

LOWPREC = ("float8_e4m3fn", "float8_e5m2", "int8")
FP8 = ("float8_e4m3fn", "float8_e5m2")
FLOAT_KINDS = (dtypes.F32, dtypes.F16, dtypes.BF16)
Q_KINDS = (dtypes.F8E4M3, dtypes.F8E5M2, dtypes.I8)


def same(a, b):
    """Bit-identical arrays (NaNs included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(u), np.ascontiguousarray(b).view(u))


def values(shape, rng, specials=True):
    """float32 values over many magnitudes, with zeros, an all-zero row,
    fp8 overflow, subnormal-range values and (optionally) inf/NaN rows."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape))).astype(np.float32)
    x[rng.random(shape) < 0.05] = 0
    x[rng.random(shape) < 0.02] *= np.float32(1e5)    # past every fp8 range
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] > 3:
        flat[1] = 0
        if specials:
            flat[2, 0] = np.nan
            flat[3, -1] = -np.inf
    return x


def as_kind(x, kind):
    """float32 ``x`` as input bits of float ``kind`` (an exact widening back
    is what the pools read)."""
    if kind == dtypes.F32:
        return x
    if kind == dtypes.F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


# ------------------------------------------------------------- the reference
@pytest.mark.parametrize("name", FP8)
def test_reference_fp8_is_ml_dtypes_saturated(name):
    kind = dtypes.NAME_KIND[name]
    ml = getattr(ml_dtypes, name)
    mx = float(ml_dtypes.finfo(ml).max)
    rng = np.random.default_rng(0)
    x = values((4096,), rng)
    got = fp8_encode(x, kind)
    finite = np.isfinite(x) & (np.abs(x) <= mx)
    # in range: exactly ml_dtypes' rounding
    same(got[finite], x[finite].astype(ml).view(np.uint8))
    # past the range (and +-inf): the largest finite value of the sign
    big = ~np.isnan(x) & ~finite
    assert big.any()
    same(got[big], np.where(x[big] > 0, mx, -mx).astype(ml).view(np.uint8))
    # NaN stays NaN
    assert np.isnan(fp8_decode(got[np.isnan(x)], kind)).all()
    # past the range (1000 for e4m3fn: ml_dtypes makes it NaN) and +-inf
    same(fp8_encode(np.float32([1000 if mx < 1000 else 1e6, -1e30, np.inf]), kind),
         np.float32([mx, -mx, mx]).astype(ml).view(np.uint8))


@pytest.mark.parametrize("name", FP8)
def test_reference_fp8_scale_divides_and_multiplies(name):
    kind = dtypes.NAME_KIND[name]
    x = np.float32([3.0, -0.75, 96.0])
    got = fp8_encode(x, kind, 0.5)
    same(got, (x / np.float32(0.5)).astype(getattr(ml_dtypes, name)).view(np.uint8))
    np.testing.assert_array_equal(fp8_decode(got, kind, 0.5), x)


def test_int8_round_trip_error_is_at_most_half_a_step():
    rng = np.random.default_rng(1)
    x = values((512, 64), rng, specials=False)
    codes, scales = int8_encode(x)
    amax = np.abs(x).max(axis=1)
    np.testing.assert_array_equal(scales, np.where(amax == 0, 1, amax / np.float32(127))
                                  .astype(np.float32))
    back = int8_decode(codes, scales)
    err = np.abs(back.astype(np.float64) - x)
    # half a step, plus the float32 rounding of code * scale
    bound = scales.astype(np.float64)[:, None] * (0.5 + 1e-6) + np.abs(x) * 2.0 ** -23
    assert (err <= bound).all()
    assert codes.min() >= -127 and codes.max() <= 127
    # exact zeros stay exact zeros; an all-zero row has scale 1 and codes 0
    assert (back[x == 0] == 0).all()
    assert scales[1] == 1 and not codes[1].any()
    # the row's largest magnitude is stored exactly as +-127
    i = np.argmax(np.abs(x[0]))
    assert abs(int(codes[0, i])) == 127


def test_int8_ties_round_to_even():
    x = np.float32([[127, 0.5, 1.5, 2.5, -0.5, -2.5]])
    codes, scales = int8_encode(x)
    assert scales[0] == 1
    np.testing.assert_array_equal(codes[0], [127, 0, 2, 2, 0, -2])


def test_int8_nan_and_inf_rows_store_a_nan_scale_and_read_back_nan():
    x = np.zeros((3, 8), np.float32)
    x[0, 3] = np.nan
    x[1, 0] = np.inf
    x[2] = 1
    codes, scales = int8_encode(x)
    assert np.isnan(scales[:2]).all() and scales[2] == np.float32(1 / 127)
    assert not codes[:2].any()
    back = int8_decode(codes, scales)
    assert np.isnan(back[:2]).all() and (back[2] == np.float32(127) * np.float32(1 / 127)).all()


# ------------------------------------------------- CPU kernels vs reference
@pytest.mark.parametrize("src_kind", FLOAT_KINDS, ids=lambda k: dtypes.KIND_NAME[k])
@pytest.mark.parametrize("dst_kind", Q_KINDS, ids=lambda k: dtypes.KIND_NAME[k])
@pytest.mark.parametrize("scale", [1.0, 0.37, 0.25])    # 0.25: applied as x * 4, exactly
def test_write_slots_q_and_gather_q_match_the_reference(src_kind, dst_kind, scale):
    rng = np.random.default_rng(2)
    nb, h, bs, d = 6, 3, 4, 24
    x = as_kind(values((9, h, d), rng), src_kind)
    slots = np.array([0, 5, 7, -1, 12, 23, 5, 13, 2], np.int64)   # 5 twice: the last wins
    caches, scales = [], []
    for be in (REFERENCE, CPU):
        cache = np.zeros((nb, h, bs, d), dtypes.STORAGE[dst_kind])
        sc = np.zeros((nb, h, bs), np.float32) if dst_kind == dtypes.I8 else None
        be.write_slots(cache, x, slots, src_kind, Codec(dst_kind, scale, sc))
        caches.append(cache)
        scales.append(sc)
    same(caches[1], caches[0])
    if dst_kind == dtypes.I8:
        same(scales[1], scales[0])
    table = np.array([3, 0, 1, 5, 2, 4], np.int32)
    for out_kind in FLOAT_KINDS:
        outs = []
        for be in (REFERENCE, CPU):
            out = np.empty((h, 19, d), dtypes.STORAGE[out_kind])
            be.gather(caches[0], table, 3, 22, out, Codec(dst_kind, scale, scales[0]), out_kind)
            outs.append(out)
        same(outs[1], outs[0])
        lens = np.array([5, 0, 23], np.int32)
        tables = np.stack([table, table[::-1], table]).astype(np.int32)
        outs = []
        for be in (REFERENCE, CPU):
            out = np.full((3, h, 23, d), 7, dtypes.STORAGE[out_kind])
            be.gather_batch(caches[0], tables, lens, out, Codec(dst_kind, scale, scales[0]),
                            out_kind)
            outs.append(out)
        same(outs[1], outs[0])


@pytest.mark.parametrize("dst_kind", Q_KINDS, ids=lambda k: dtypes.KIND_NAME[k])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -3, 0.37])
def test_large_paged_writes_match_the_reference(dst_kind, scale):
    """Writes of at least 4 MiB of codes go out with non-temporal stores, a
    token's rows in one call: the same codes and scales as the reference,
    rows in random blocks of a pool whose planes start 16 bytes into a
    cache line (NumPy's alignment)."""
    rng = np.random.default_rng(5)
    n, h, bs, d = 4096, 8, 16, 128
    nb = 2 * n // bs
    x = values((n, h, d), rng)
    x[7, 3] = (rng.integers(-127, 128, d) + 0.5).astype(np.float32)    # int8 ties
    x[7, 3, 0] = 127
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[::97] = -1
    caches, scales = [], []
    for be in (REFERENCE, CPU):
        raw = np.zeros(nb * h * bs * d + 16, np.uint8)
        cache = raw[16:].view(dtypes.STORAGE[dst_kind]).reshape(nb, h, bs, d)
        sc = np.zeros((nb, h, bs), np.float32) if dst_kind == dtypes.I8 else None
        be.write_slots(cache, x, slots, dtypes.F32, Codec(dst_kind, scale, sc))
        caches.append(cache)
        scales.append(sc)
    same(caches[1], caches[0])
    if dst_kind == dtypes.I8:
        same(scales[1], scales[0])


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_large_append_matches_the_reference_encoders(dtype):
    """An append of at least 4 MiB of codes (non-temporal stores, a token's
    rows in one call) stores the reference encoders' codes and scales."""
    n, h, d = 4096, 8, 128
    kw = {"kv_scales": [(0.5, 0.3)]} if dtype != "int8" else {}
    pool = kvcore.BlockPool(2 * n // 16, 16, 1, h, d, dtype=dtype, **kw)
    seq = kvcore.PagedKVCache(pool)
    rng = np.random.default_rng(9)
    k, v = values((n, h, d), rng), values((n, h, d), rng)
    seq.allocate(list(range(n)))
    seq.append(0, k, v)
    seq.commit(n)
    for which, x in ((0, k), (1, v)):
        if dtype == "int8":
            codes, sc = int8_encode(x)
            same(seq.gather_scales(0, 0, n)[which], sc.T)
        else:
            codes = fp8_encode(x, dtypes.NAME_KIND[dtype], pool.kv_scales[0][which])
        same(seq.gather(0)[which], codes.transpose(1, 0, 2))


@pytest.mark.parametrize("src_kind", FLOAT_KINDS, ids=lambda k: dtypes.KIND_NAME[k])
@pytest.mark.parametrize("dst_kind", Q_KINDS, ids=lambda k: dtypes.KIND_NAME[k])
def test_write_contiguous_q_and_dequantize_match_the_reference(src_kind, dst_kind):
    rng = np.random.default_rng(3)
    x = as_kind(values((2, 3, 5, 16), rng), src_kind)
    got = []
    for be in (REFERENCE, CPU):
        dst = np.zeros((2, 3, 9, 16), dtypes.STORAGE[dst_kind])
        sc = np.zeros((2, 3, 9), np.float32) if dst_kind == dtypes.I8 else None
        be.write_contiguous(dst, x.transpose(0, 1, 2, 3), 2, src_kind, Codec(dst_kind, 2.5, sc))
        got.append((dst, sc))
    same(got[1][0], got[0][0])
    if dst_kind == dtypes.I8:
        same(got[1][1], got[0][1])
    for out_kind in FLOAT_KINDS:
        outs = []
        for be in (REFERENCE, CPU):
            out = np.empty((2, 3, 9, 16), dtypes.STORAGE[out_kind])
            be.dequantize(got[0][0], Codec(dst_kind, 2.5, got[0][1]), out, out_kind)
            outs.append(out)
        same(outs[1], outs[0])


# ------------------------------------------------------------------ pools
def pool_of(dtype, num_blocks=24, layers=2, heads=2, dim=16, bs=4, **kw):
    scales = [(0.5, 2.0), (1.0, 0.25)][:layers] if dtype in FP8 else None
    return kvcore.BlockPool(num_blocks, bs, layers, heads, dim, dtype=dtype, kv_scales=scales,
                            **kw)


def kv_row(token, pos, layer, which, heads, dim):
    """The K (which=0) or V row a 'model' computes for ``token`` at ``pos``:
    deterministic, so a prefix hit hands back the same rows."""
    rng = np.random.default_rng([token, pos, layer, which])
    r = (rng.standard_normal((heads, dim)) * np.exp2(rng.integers(-8, 10))).astype(np.float32)
    if token % 7 == 0:
        r[0] = 0                     # an all-zero row
    if token % 11 == 0:
        r[-1, 1] = 5e5               # past every fp8 range (saturates)
    return r


def kv_rows(tokens, start, end, layer, which, heads, dim):
    return np.stack([kv_row(tokens[p], p, layer, which, heads, dim) for p in range(start, end)])


class Model:
    """What a pool must hold for a sequence, from the reference encoders."""

    def __init__(self, pool):
        self.pool = pool
        self.kind = dtypes.NAME_KIND[pool.dtype]

    def expected(self, tokens, layer, which, n):
        rows = kv_rows(tokens, 0, n, layer, which, self.pool.num_kv_heads, self.pool.head_dim)
        if self.kind == dtypes.I8:
            codes, sc = int8_encode(rows)
            return codes.transpose(1, 0, 2), sc.T, int8_decode(codes, sc).transpose(1, 0, 2)
        scale = self.pool.kv_scales[layer][which]
        codes = fp8_encode(rows, self.kind, scale)
        return codes.transpose(1, 0, 2), None, fp8_decode(codes, self.kind, scale).transpose(1, 0, 2)

    def check_seq(self, seq, tokens, pool=None):
        pool = pool or self.pool
        n = seq.num_computed
        for layer in range(pool.num_layers):
            got = seq.gather(layer, 0, n)
            got32 = seq.gather(layer, 0, n, dtype="float32")
            for which in (0, 1):
                codes, sc, vals = self.expected(tokens, layer, which, n)
                same(got[which], codes)
                same(got32[which], vals)
            if self.kind == dtypes.I8:
                ks, vs = seq.gather_scales(layer, 0, n)
                same(ks, self.expected(tokens, layer, 0, n)[1])
                same(vs, self.expected(tokens, layer, 1, n)[1])

    def check_blocks(self, pool, block_ids, tokens, n):
        """Raw reads of ``block_ids`` (e.g. an offload target) hold the rows."""
        for layer in range(pool.num_layers):
            got = pool.gather(layer, block_ids, 0, n)
            for which in (0, 1):
                codes, sc, vals = self.expected(tokens, layer, which, n)
                same(got[which], codes)
                if sc is not None:
                    same(pool.gather_scales(layer, block_ids, 0, n)[which], sc)


def fill(seq, tokens, start, end):
    pool = seq.pool
    for layer in range(pool.num_layers):
        seq.append(layer, kv_rows(tokens, start, end, layer, 0, pool.num_kv_heads, pool.head_dim),
                   kv_rows(tokens, start, end, layer, 1, pool.num_kv_heads, pool.head_dim))
    seq.commit(end - start)


def filled_pool(dtype, tokens):
    """``(pool, model, seq)``: a ``pool_of(dtype)``, its Model, and a
    sequence on ``tokens`` with the KV of every position written and committed."""
    pool = pool_of(dtype)
    model = Model(pool)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(tokens)
    fill(seq, tokens, 0, len(tokens))
    return pool, model, seq


@pytest.mark.parametrize("dtype", LOWPREC)
@pytest.mark.parametrize("seed", range(4))
def test_random_pool_runs_match_the_reference(dtype, seed):
    rng = np.random.default_rng(seed)
    pool = pool_of(dtype, num_blocks=40)
    other = pool_of(dtype, num_blocks=40)
    model = Model(pool)
    prompts = [list(rng.integers(1, 50, 9)) for _ in range(3)]
    live = []                        # (seq, tokens)
    hits = 0
    for step in range(40):
        op = rng.choice(["new", "step", "fork", "truncate", "copy_to", "offload", "free"])
        try:
            if op == "new" or not live:
                p = prompts[rng.integers(len(prompts))]
                tokens = p[:rng.integers(5, len(p) + 1)] + list(rng.integers(1, 50, rng.integers(1, 4)))
                seq = kvcore.PagedKVCache(pool)
                hit = seq.allocate(tokens)
                hits += hit
                fill(seq, tokens, hit, len(tokens))
                live.append((seq, tokens))
            elif op == "step":
                seq, tokens = live[rng.integers(len(live))]
                t = int(rng.integers(1, 50))
                seq.append_token(t)
                tokens.append(t)
                fill(seq, tokens, len(tokens) - 1, len(tokens))
            elif op == "fork":
                seq, tokens = live[rng.integers(len(live))]
                child = seq.fork()
                live.append((child, list(tokens)))
                # the child writes into the shared last block: copy-on-write
                t = int(rng.integers(1, 50))
                child.append_token(t)
                live[-1][1].append(t)
                fill(child, live[-1][1], len(live[-1][1]) - 1, len(live[-1][1]))
            elif op == "truncate":
                i = rng.integers(len(live))
                seq, tokens = live[i]
                n = int(rng.integers(1, seq.num_computed + 1))
                seq.truncate(n)
                del tokens[n:]
                t = int(rng.integers(1, 50))       # and rewrite the tail differently
                seq.append_token(t)
                tokens.append(t)
                fill(seq, tokens, n, n + 1)
            elif op == "copy_to":
                seq, tokens = live[rng.integers(len(live))]
                twin = seq.copy_to(other)
                model.check_seq(twin, tokens, other)
                twin.free()
            elif op == "offload":
                seq, tokens = live[rng.integers(len(live))]
                table = seq.block_table
                dst = np.arange(len(table), dtype=np.int32)[::-1].copy()
                pool.copy_blocks_to(other, table, dst)
                model.check_blocks(other, dst, tokens, seq.num_computed)
            elif op == "free":
                seq, _ = live.pop(rng.integers(len(live)))
                seq.free()
        except kvcore.OutOfBlocksError:
            continue
        for seq, tokens in live:
            model.check_seq(seq, tokens)
        pool.debug.check()
    assert hits > 0 or seed, "no prefix hit in the run"


@pytest.mark.parametrize("dtype", LOWPREC)
def test_scales_follow_blocks_within_a_pool_copy(dtype):
    tokens = list(range(1, 12))
    pool, model, seq = filled_pool(dtype, tokens)
    table = seq.block_table
    # swap two blocks in place (staged), then swap back: the rows follow
    pool.copy_blocks_to(pool, table[:2], table[1::-1].copy())
    pool.copy_blocks_to(pool, table[:2], table[1::-1].copy())
    model.check_seq(seq, tokens)
    # into free blocks of the same pool
    free = np.setdiff1d(np.arange(pool.num_blocks), table)[:len(table)].astype(np.int32)
    pool.copy_blocks_to(pool, table, free)
    model.check_blocks(pool, free, tokens, len(tokens))


@pytest.mark.parametrize("dtype", LOWPREC)
def test_export_import_blocks_round_trip(dtype):
    tokens = list(range(3, 13))
    pool, model, seq = filled_pool(dtype, tokens)
    payloads = store_port(pool).export_blocks(seq.block_table)
    assert all(p.nbytes == pool.bytes_per_block for p in payloads)
    other = pool_of(dtype)
    ids = np.array([7, 2, 9], np.int32)
    seeds = [11, 12, 13]
    digests = store_port(other).import_blocks(ids, payloads, seeds=seeds)
    from kvcore.backends.cpu import _checksum
    assert digests == [_checksum.xxh3_64(p, s) for p, s in zip(payloads, seeds)]
    model.check_blocks(other, ids, tokens, len(tokens))
    with pytest.raises(ValueError, match="payloads"):
        store_port(other).import_blocks(ids[:2], payloads)
    with pytest.raises(ValueError, match="payloads"):
        store_port(other).import_blocks(ids[:1], [payloads[0][:-4]])


@pytest.mark.parametrize("dtype", LOWPREC)
def test_pool_write_matches_append(dtype):
    pool = pool_of(dtype)
    model = Model(pool)
    seq = kvcore.PagedKVCache(pool)
    tokens = list(range(20, 29))
    seq.allocate(tokens)
    slots = seq.slot_mapping(0, len(tokens))
    for layer in range(pool.num_layers):
        k = kv_rows(tokens, 0, len(tokens), layer, 0, 2, 16)
        v = kv_rows(tokens, 0, len(tokens), layer, 1, 2, 16)
        # float16 and bfloat16 inputs widen exactly first
        pool.write(layer, k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16), slots)
        seq.mark_written(layer, len(tokens))
    seq.commit(len(tokens))
    for layer in range(pool.num_layers):
        k = kv_rows(tokens, 0, len(tokens), layer, 0, 2, 16)
        k16 = k.astype(ml_dtypes.bfloat16).astype(np.float32)
        if dtype == "int8":
            codes, _ = int8_encode(k16)
        else:
            codes = fp8_encode(k16, dtypes.NAME_KIND[dtype], pool.kv_scales[layer][0])
        same(seq.gather(layer)[0], codes.transpose(1, 0, 2))
    # gather_batch dequantizes and pads with +0
    tables, lens = kvcore.padded_block_tables([seq])
    k, v = pool.gather_batch(0, tables, lens, dtype="float32")
    same(k[0], seq.gather(0, dtype="float32")[0])
    same(pool.gather_batch(0, tables, lens)[1][0], seq.gather(0)[1])
    del model


def test_an_input_that_is_a_view_of_the_int8_scales_is_read_as_it_was():
    pool = kvcore.BlockPool(8, 4, 1, 1, 8, dtype="int8")
    flat = pool.scales.reshape(-1)           # (2 planes, 8 blocks, 1 head, 4 tokens)
    flat[...] = np.arange(1, flat.size + 1, dtype=np.float32)
    with kvcore.PagedKVCache(pool) as seq:
        seq.allocate([1, 2, 3, 4, 5])
        b0 = int(seq.block_table[0])
        # v: float32 views of the scales whose row 2 holds the value scales
        # the first tokens' writes land on (block b0 of plane 1)
        start = 32 + 4 * b0
        k = flat[start - 24:start + 8].reshape(4, 1, 8)
        v = flat[start - 16:start + 16].reshape(4, 1, 8)
        want_k, want_v = int8_encode(k.copy()), int8_encode(v.copy())
        seq.append(0, k, v)     # the direct path must not read them while writing
        codes = seq.gather(0, 0, 4)
        scales = seq.gather_scales(0, 0, 4)
    same(codes[0][0], want_k[0][:, 0])
    same(codes[1][0], want_v[0][:, 0])
    same(scales[0][0], want_k[1][:, 0])
    same(scales[1][0], want_v[1][:, 0])


def test_bytes_per_token():
    f16 = pool_of("float16", heads=8, dim=128)
    e4 = pool_of("float8_e4m3fn", heads=8, dim=128)
    i8 = pool_of("int8", heads=8, dim=128)
    assert e4.bytes_per_token * 2 == f16.bytes_per_token
    assert i8.bytes_per_token == 2 * 2 * 8 * (128 + 4)
    assert i8.bytes_per_token / f16.bytes_per_token <= 0.53
    assert i8.stats()["bytes_per_token"] == i8.bytes_per_token
    assert i8.bytes_per_block == i8.bytes_per_token * i8.block_size
    c16 = kvcore.KVCache(2, 8, 128, 32, dtype="float16").memory_report()
    c8 = kvcore.KVCache(2, 8, 128, 32, dtype="int8").memory_report()
    ce = kvcore.KVCache(2, 8, 128, 32, dtype="float8_e5m2").memory_report()
    assert ce["bytes_per_token"] * 2 == c16["bytes_per_token"]
    assert c8["bytes_per_token"] == 2 * 2 * 8 * 132
    assert c8["allocated_bytes"] == c8["bytes_per_token"] * 32


def test_dtypes_accepted_as_names_and_types():
    assert kvcore.BlockPool(2, 4, 1, 1, 8, dtype=ml_dtypes.float8_e4m3fn).dtype == "float8_e4m3fn"
    assert kvcore.BlockPool(2, 4, 1, 1, 8, dtype=ml_dtypes.float8_e5m2).dtype == "float8_e5m2"
    assert kvcore.BlockPool(2, 4, 1, 1, 8, dtype=np.int8).dtype == "int8"
    p = kvcore.BlockPool(2, 4, 1, 1, 8, dtype="float8_e4m3fn")
    assert p.key_cache(0).dtype == np.uint8 and p.kv_scales == [(1.0, 1.0)]
    # raw gather into an ml_dtypes fp8 out=
    out = (np.empty((1, 4, 8), ml_dtypes.float8_e4m3fn), np.empty((1, 4, 8), np.uint8))
    k, v = p.gather(0, [1], 0, 4, out=out)
    assert k is out[0]


def test_bad_input_names_the_argument_and_changes_nothing():
    with pytest.raises(ValueError, match="kv_scales applies to fp8 pools"):
        kvcore.BlockPool(2, 4, 1, 1, 8, dtype="float16", kv_scales=[(1, 1)])
    with pytest.raises(ValueError, match="kv_scales must hold num_layers=2"):
        kvcore.BlockPool(2, 4, 2, 1, 8, dtype="float8_e4m3fn", kv_scales=[(1, 1)])
    with pytest.raises(ValueError, match="finite positive"):
        kvcore.BlockPool(2, 4, 1, 1, 8, dtype="float8_e5m2", kv_scales=[(1, 0)])
    with pytest.raises(ValueError, match="finite positive"):
        kvcore.BlockPool(2, 4, 1, 1, 8, dtype="float8_e5m2", kv_scales=[(np.nan, 1)])
    with pytest.raises(ValueError, match="finite positive"):
        kvcore.BlockPool(2, 4, 1, 1, 8, dtype="float8_e5m2", kv_scales=[(1e39, 1)])
    with pytest.raises(TypeError, match="kv_scales"):
        kvcore.BlockPool(2, 4, 1, 1, 8, dtype="float8_e5m2", kv_scales="big")
    with pytest.raises(ValueError, match="uint8"):
        kvcore.BlockPool(2, 4, 1, 1, 8, dtype=np.uint8)
    i8 = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="int8")
    e4 = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="float8_e4m3fn")
    before = i8.storage.copy(), i8.scales.copy()
    x = np.ones((1, 1, 8), np.float32)
    with pytest.raises(TypeError, match="k must be float32"):
        i8.write(0, x.astype(np.int8), x, [0])
    with pytest.raises(ValueError, match="src_dtype must be one of"):
        i8.write(0, x, x, [0], src_dtype="int8")
    with pytest.raises(IndexError, match="slots"):
        i8.write(0, x, x, [16])
    same(i8.storage, before[0])
    same(i8.scales, before[1])
    with pytest.raises(ValueError, match="dtype must be the storage dtype"):
        i8.gather(0, [0], 0, 1, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="only int8 pools keep per-token scales"):
        e4.gather_scales(0, [0], 0, 1)
    with pytest.raises(ValueError, match="only int8 pools"):
        e4.key_scales(0)
    with pytest.raises(ValueError, match="start and end"):
        i8.gather_scales(0, [0], 0, 5)
    with pytest.raises(ValueError, match="dtype"):
        i8.copy_blocks_to(e4, [0], [0])
    e4b = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="float8_e4m3fn", kv_scales=[(2, 1)])
    with pytest.raises(ValueError, match="same kv_scales"):
        e4.copy_blocks_to(e4b, [0], [0])
    with pytest.raises(ValueError, match="kv_scales applies to fp8"):
        kvcore.KVCache(1, 1, 8, 4, dtype="int8", kv_scales=[(1, 1)])


# -------------------------------------------------------------- attention
simd_level = level_fixture(_kernel)


def rel_err(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("dtype", LOWPREC)
@pytest.mark.parametrize("dim", [64, 20])   # 20: the scalar path on every level
@pytest.mark.parametrize("kw", [{}, dict(sliding_window=7), dict(logits_soft_cap=5.0)],
                         ids=["plain", "window", "softcap"])
def test_attention_over_lowprec_pages_matches_float64(dtype, dim, kw, simd_level):
    rng = np.random.default_rng(5)
    pool = pool_of(dtype, num_blocks=64, dim=dim, bs=8)
    seqs, lens = [], [37, 70, 3]
    for n in lens:
        s = kvcore.PagedKVCache(pool)
        tokens = list(rng.integers(1, 1000, n))
        s.allocate(tokens)
        for layer in range(2):
            k = rng.standard_normal((n, 2, dim)).astype(np.float32) * 3
            v = rng.standard_normal((n, 2, dim)).astype(np.float32)
            s.append(layer, k, v)
        seqs.append(s)
    tables, seq_lens = kvcore.padded_block_tables(seqs)
    for layer in range(2):
        q = rng.standard_normal((3, 8, dim)).astype(np.float32)        # decode, GQA 4
        got = kvcore.paged_attention(q, pool, layer, tables, seq_lens, **kw)
        want = paged_attention_reference(q, pool.key_cache(layer), pool.value_cache(layer),
                                         tables, seq_lens, kind=dtype, **kw,
                                         **reference_kw(pool, layer))
        assert rel_err(got, want) <= 1e-5
        # prefill of the 70-token sequence (many rows: the widening path)
        qp = rng.standard_normal((70, 8, dim)).astype(np.float32)
        got = kvcore.paged_attention(qp, pool, layer, tables[1:2], seq_lens[1:2],
                                     query_start_loc=[0, 70], **kw)
        want = paged_attention_reference(qp, pool.key_cache(layer), pool.value_cache(layer),
                                         tables[1:2], seq_lens[1:2], query_start_loc=[0, 70],
                                         kind=dtype, **kw, **reference_kw(pool, layer))
        assert rel_err(got, want) <= 1e-5
    # seq.attention: the same kernel through the convenience
    s = seqs[0]
    q = rng.standard_normal((1, 8, dim)).astype(np.float32)
    same(s.attention(0, q), kvcore.paged_attention(q, pool, 0, s.block_table[None],
                                                   [s.num_computed + 1],
                                                   query_start_loc=[0, 1]))


@pytest.mark.parametrize("dtype", LOWPREC)
def test_attention_loaders_widen_every_code_exactly(dtype, simd_level):
    """Each of the 256 stored bytes through the attention kernel's loader:
    one visible key with score 0, so the output is that value row."""
    pool = kvcore.BlockPool(32, 1, 1, 1, 8, dtype=dtype)
    pool.value_cache(0).reshape(-1)[:] = np.arange(256, dtype=np.uint8).view(
        pool.storage.dtype)
    if dtype == "int8":
        pool.scales[...] = 1
        want = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
    else:
        want = fp8_decode(np.arange(256, dtype=np.uint8), dtypes.NAME_KIND[dtype])
    q = np.zeros((32, 1, 8), np.float32)         # keys are code 0: every score is 0
    got = kvcore.paged_attention(q, pool, 0, np.arange(32).reshape(32, 1), np.ones(32, int))
    got = got.reshape(-1)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all() and (np.signbit(got[nan]) == np.signbit(want[nan])).all()
    same(got[~nan], want[~nan] + np.float32(0))   # (the sum 0 + 1 * -0 is +0)


def test_int8_nan_row_is_nan_only_for_the_queries_that_see_it(simd_level):
    pool = pool_of("int8", num_blocks=8, dim=16, bs=4)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(1, 11)))
    k = np.ones((10, 2, 16), np.float32)
    k[6, 0, 3] = np.nan           # position 6, kv head 0: scale NaN
    for layer in range(2):
        seq.append(layer, k, k)
    assert np.isnan(seq.gather_scales(0)[0][0, 6])
    q = np.ones((10, 8, 16), np.float32)
    out = kvcore.paged_attention(q, pool, 0, seq.block_table[None], [10],
                                 query_start_loc=[0, 10])
    # queries 0..5 never see position 6; heads 4..7 read kv head 1
    assert np.isfinite(out[:6]).all() and np.isfinite(out[:, 4:]).all()
    assert np.isnan(out[6:, :4]).all()


def _codes(dtype, shape, rng):
    """Random finite stored bytes of ``dtype`` (fp8 bits of every exponent
    with subnormals and zeros; int8 codes), as the pool's storage dtype."""
    if dtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    b = rng.integers(0, 256, shape).astype(np.uint8)
    finite = np.isfinite(fp8_decode(b, dtypes.NAME_KIND[dtype]))
    return np.where(finite, b, b & np.uint8(0xF0)).astype(np.uint8)


@pytest.mark.parametrize("dtype", LOWPREC)
@pytest.mark.parametrize("dim", [64, 40, 160])   # 40: not a multiple of 32 bytes
def test_attention_over_lowprec_pages_is_that_over_float16_pages_of_the_values(dtype, dim,
                                                                             simd_level):
    """fp8 (scales 1) and int8 (scales 1) codes are float16 values: the
    kernels must give the bits the float16 kernels give on those values, so
    reading e4m3fn as value / 2^8 (its unit riding on q and the P.V weights)
    is exact.  (Where both walk the keys in the same tiles: at avx512 a
    decode over rows of at most 128 bytes takes the wide tile, so head_dims
    65-128 split float16's decode tiles but not the 1-byte kinds'; 40, 64
    and 160 do not.)"""
    rng = np.random.default_rng(11)
    nb, bs, heads = 12, 8, 2
    lp = kvcore.BlockPool(nb, bs, 1, heads, dim, dtype=dtype)
    f16 = kvcore.BlockPool(nb, bs, 1, heads, dim, dtype="float16")
    for cache, ref in ((lp.key_cache(0), f16.key_cache(0)), (lp.value_cache(0), f16.value_cache(0))):
        cache[...] = _codes(dtype, cache.shape, rng)
        if dtype == "int8":
            ref[...] = cache.astype(np.float16)
        else:
            ref[...] = fp8_decode(cache, dtypes.NAME_KIND[dtype]).astype(np.float16)
    if dtype == "int8":
        lp.scales[...] = 1
    tables = rng.permutation(nb).astype(np.int32).reshape(2, 6)
    lens = np.array([45, 48])
    q = (rng.standard_normal((2, 8, dim)) * 0.2).astype(np.float32)        # decode, GQA 4
    same(kvcore.paged_attention(q, lp, 0, tables, lens),
         kvcore.paged_attention(q, f16, 0, tables, lens))
    qp = (rng.standard_normal((20, 8, dim)) * 0.2).astype(np.float32)      # prefill rows
    kw = dict(query_start_loc=[0, 20])
    same(kvcore.paged_attention(qp, lp, 0, tables[1:], lens[1:], **kw),
         kvcore.paged_attention(qp, f16, 0, tables[1:], lens[1:], **kw))



@pytest.mark.parametrize("q_scale", [1.0, 3000.0, 1e30])
def test_e4m3fn_attention_gives_float16_bits_whatever_q(q_scale, simd_level):
    """e4m3fn decode at avx512 reads its codes as float32 bits, their unit
    2^120 riding on q and the weights, when q times the scale stays under
    2^7 (kv_attn_tile.c), and as halves (unit 2^8) otherwise: either way
    the bits float16 pages of the values give, in one call where one
    sequence's q fits and the other's does not (inf scores included)."""
    rng = np.random.default_rng(12)
    dim, nb, bs, heads = 64, 12, 8, 2
    lp = kvcore.BlockPool(nb, bs, 1, heads, dim, dtype="float8_e4m3fn")
    f16 = kvcore.BlockPool(nb, bs, 1, heads, dim, dtype="float16")
    for cache, ref in ((lp.key_cache(0), f16.key_cache(0)), (lp.value_cache(0), f16.value_cache(0))):
        cache[...] = _codes("float8_e4m3fn", cache.shape, rng)
        ref[...] = fp8_decode(cache, dtypes.NAME_KIND["float8_e4m3fn"]).astype(np.float16)
    tables = rng.permutation(nb).astype(np.int32).reshape(2, 6)
    lens = np.array([45, 48])
    q = (rng.standard_normal((2, 8, dim)) * 0.2).astype(np.float32)   # decode, GQA 4
    q[1] *= np.float32(q_scale)
    same(kvcore.paged_attention(q, lp, 0, tables, lens),
         kvcore.paged_attention(q, f16, 0, tables, lens))


def test_e4m3fn_attention_scales_by_a_large_value_scale_exactly(simd_level):
    """A value scale of 2^9 (too large for the float32-bits reading's unit,
    kv_attn_tile.c) against 2 on the same codes: outputs exactly 2^8 apart,
    the two readings giving the same products."""
    rng = np.random.default_rng(13)
    dim, nb, bs, heads = 128, 12, 8, 2
    out = []
    for vs in (2.0, 512.0):
        pool = kvcore.BlockPool(nb, bs, 1, heads, dim, dtype="float8_e4m3fn",
                                kv_scales=[(1.0, vs)])
        for cache in (pool.key_cache(0), pool.value_cache(0)):
            cache[...] = _codes("float8_e4m3fn", cache.shape, np.random.default_rng(14))
        tables = np.random.default_rng(15).permutation(nb).astype(np.int32).reshape(2, 6)
        q = (np.random.default_rng(16).standard_normal((2, 8, dim)) * 0.2).astype(np.float32)
        out.append(kvcore.paged_attention(q, pool, 0, tables, np.array([45, 48])))
    assert np.isfinite(out[0]).all()
    same(out[1], out[0] * np.float32(256.0))


@pytest.mark.parametrize("dtype", FP8)
def test_lowprec_attention_keeps_subnormal_products_exact(dtype, simd_level):
    """An output that rests on weights so small that weight * value is
    subnormal: e4m3fn's values read as value / 2^8 must still give the
    products the float16 kernels give (the 2^8 rides on the weights, not on
    the output), bit for bit."""
    D = 64
    for c in np.linspace(0.185, 0.1935, 12).astype(np.float32):
        lp = kvcore.BlockPool(2, 8, 1, 1, D, dtype=dtype)
        f16 = kvcore.BlockPool(2, 8, 1, 1, D, dtype="float16")
        K, V = lp.key_cache(0), lp.value_cache(0)
        K[...] = 0
        V[...] = 0
        K[0, 0, 0, 0] = 0x7E if dtype == "float8_e4m3fn" else 0x7B   # key 0: its largest finite
        V[0, 0, 1, :] = 0x3B           # key 1 (score 0, weight ~2^-127): a value near 1
        for a, b in ((K, f16.key_cache(0)), (V, f16.value_cache(0))):
            b[...] = fp8_decode(a, dtypes.NAME_KIND[dtype]).astype(np.float16)
        q = np.zeros((1, 1, D), np.float32)
        q[0, 0, 0] = c * (1.0 if dtype == "float8_e4m3fn" else 448 / 57344)
        t = np.array([[0, 1]], np.int32)
        same(kvcore.paged_attention(q, lp, 0, t, [2], scale=1.0),
             kvcore.paged_attention(q, f16, 0, t, [2], scale=1.0))

def _nan_code(dtype, negative):
    return {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}[dtype] | (0x80 if negative else 0)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("which", ["key", "value"])
def test_fp8_nan_code_reaches_only_the_rows_that_see_it(dtype, dim, which, simd_level):
    """One NaN code (either sign) at one position; the decode rows of the
    sequence that holds it are NaN (their dim 7 for a value), everything else
    is the float64 reference's (tiles without a NaN read through the fast
    loaders)."""
    rng = np.random.default_rng(3)
    nb, bs = 16, 8
    pool = kvcore.BlockPool(nb, bs, 1, 2, dim, dtype=dtype, kv_scales=[(0.5, 2.0)])
    for cache in (pool.key_cache(0), pool.value_cache(0)):
        cache[...] = _codes(dtype, cache.shape, rng)
    tables = np.arange(nb, dtype=np.int32).reshape(4, 4)
    lens = np.array([32, 30, 9, 17])
    # sequence 1, kv head 1, position 13 (block 5, offset 5): a NaN code
    getattr(pool, which + "_cache")(0)[5, 1, 5, 7] = _nan_code(dtype, negative=dim == 40)
    q = (rng.standard_normal((4, 8, dim)) * 0.2).astype(np.float32)
    got = kvcore.paged_attention(q, pool, 0, tables, lens)
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables, lens,
                                     kind=dtype, key_scales=0.5, value_scales=2.0)
    nan = np.zeros(got.shape, bool)
    # sequence 1, the heads of kv head 1: every dim (a NaN score), or dim 7
    nan[1, 4:, slice(None) if which == "key" else 7] = True
    assert (np.isnan(got) == nan).all() and (np.isnan(want) == nan).all()
    assert rel_err(got[~nan], want[~nan]) <= 1e-5


@pytest.mark.parametrize("dim", [40, 80, 64])     # 40, 80: dims past the last 32
@pytest.mark.parametrize("which", ["key", "value"])
def test_e4m3_positive_nan_code_in_the_last_dims_is_seen(dim, which, simd_level):
    """Regression: the e4m3fn tile scan for NaN codes took the unsigned max
    of the bytes past the last multiple of 32 before setting their sign
    bits, so a +NaN code (0x7F) there was lost to any byte >= 0x80 in the
    same lane of another row (a negative code), and read as 480."""
    pool = kvcore.BlockPool(4, 8, 1, 1, dim, dtype="float8_e4m3fn")
    keys, vals = pool.key_cache(0), pool.value_cache(0)
    keys[...] = 0x38                    # 1.0
    vals[...] = 0x38
    keys[0, 0, 1, :] = 0xB8             # a row of -1.0 in the same tile
    vals[0, 0, 1, :] = 0xB8
    getattr(pool, which + "_cache")(0)[0, 0, 2, dim - 4] = 0x7F
    tables = np.arange(4, dtype=np.int32).reshape(1, 4)
    q = np.full((1, 1, dim), 0.1, np.float32)
    got = kvcore.paged_attention(q, pool, 0, tables, np.array([8]))
    nan = np.zeros(got.shape, bool)
    nan[..., slice(None) if which == "key" else dim - 4] = True
    assert (np.isnan(got) == nan).all()


@pytest.mark.parametrize("dtype", FP8 + ("float16",))
def test_a_nan_or_inf_value_reaches_only_the_queries_that_see_it(dtype, simd_level):
    """Regression: a stored NaN (or inf) value at a position a query cannot
    see (after it, causally; before its window) made that query NaN too,
    through its weight 0 times the value."""
    dim, bs = 16, 8
    pool = kvcore.BlockPool(4, bs, 1, 1, dim, dtype=dtype)
    rng = np.random.default_rng(4)
    vc = pool.value_cache(0)
    if dtype == "float16":
        pool.key_cache(0)[...] = rng.standard_normal(vc.shape).astype(np.float16)
        vc[...] = rng.standard_normal(vc.shape).astype(np.float16)
        vc[0, 0, 6, 3], vc[0, 0, 2, 1] = np.nan, np.inf
    else:
        pool.key_cache(0)[...] = _codes(dtype, vc.shape, rng)
        vc[...] = _codes(dtype, vc.shape, rng)
        vc[0, 0, 6, 3] = _nan_code(dtype, negative=False)
        vc[0, 0, 2, 1] = 0x7C if dtype == "float8_e5m2" else _nan_code(dtype, negative=True)
    tables = np.arange(2, dtype=np.int32)[None]
    q = rng.standard_normal((12, 4, dim)).astype(np.float32)     # prefill: positions 0..11
    for kw, bad in (({}, slice(2, 12)),                          # causal: from position 2
                    (dict(sliding_window=3), [2, 3, 4, 6, 7, 8])):  # window 3
        got = kvcore.paged_attention(q, pool, 0, tables, [12], query_start_loc=[0, 12], **kw)
        with np.errstate(invalid="ignore"):     # the reference's inf * 0
            want = paged_attention_reference(q, pool.key_cache(0), vc, tables, [12],
                                             query_start_loc=[0, 12], kind=dtype, **kw)
        sees = np.zeros(12, bool)
        sees[bad] = True
        assert (~np.isfinite(want).all(axis=(1, 2)) == sees).all()
        assert (~np.isfinite(got).all(axis=(1, 2)) == sees).all()
        assert rel_err(got[~sees], want[~sees]) <= 1e-5


# -------------------------------------------------------------- KVCache
@pytest.mark.parametrize("dtype", LOWPREC)
def test_kvcache_lowprec(dtype, simd_level):
    rng = np.random.default_rng(6)
    scales = [(0.5, 4.0), (2.0, 1.0)] if dtype in FP8 else None
    cache = kvcore.KVCache(2, 2, 16, 20, batch_size=2, dtype=dtype, kv_scales=scales)
    kind = dtypes.NAME_KIND[dtype]
    xs = []
    for step in (7, 1, 2):
        k = values((2, 2, step, 16), rng, specials=False)
        v = np.clip(values((2, 2, step, 16), rng, specials=False), -6e4, 6e4)
        for layer in range(2):
            cache.update(layer, k, as_kind(v, dtypes.F16))
        xs.append((k, as_kind(v, dtypes.F16).astype(np.float32)))
    k_all = np.concatenate([x[0] for x in xs], axis=2)
    v_all = np.concatenate([x[1] for x in xs], axis=2)
    for layer in range(2):
        for which, x in ((0, k_all), (1, v_all)):
            if kind == dtypes.I8:
                codes, sc = int8_encode(x)
                vals = int8_decode(codes, sc)
                same(cache.get_scales(layer)[which], sc)
            else:
                codes = fp8_encode(x, kind, scales[layer][which])
                vals = fp8_decode(codes, kind, scales[layer][which])
            same(cache.get(layer)[which], codes)
            same(cache.get(layer, dtype="float32")[which], vals)
            same(cache.get(layer, 2, 5, dtype="float32")[which], vals[:, :, 2:5])
    twin = cache.clone()
    same(twin.get(1, dtype="float32")[0], cache.get(1, dtype="float32")[0])
    assert twin.kv_scales == cache.kv_scales
    # attention over the cache against float64 on the stored values
    q = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)
    got = cache.attention(1, q)
    k32, v32 = cache.get(1, dtype="float32")
    for b in range(2):
        want = paged_attention_reference(
            q[b].transpose(1, 0, 2), k32[b][:, None].transpose(1, 0, 2, 3),
            v32[b][:, None].transpose(1, 0, 2, 3), [[0]], [10], query_start_loc=[0, 3])
        assert rel_err(got[b].transpose(1, 0, 2), want) <= 1e-5
    cache.truncate(4)
    assert cache.get(0, dtype="float32")[0].shape == (2, 2, 4, 16)
    if kind == dtypes.I8:
        with pytest.raises(ValueError, match="end must be <= 4"):
            cache.get_scales(0, 0, 5)
    else:
        with pytest.raises(ValueError, match="only int8 caches"):
            cache.get_scales(0)


def test_the_kinds_are_listed_once():
    assert set(itertools.chain(dtypes.FLOAT_KINDS, dtypes.LOWPREC_KINDS)) == set(dtypes.KIND_NAME)


# ------------------------------------------------------------------ demo
@pytest.mark.parametrize("dtype", LOWPREC)
def test_demo_runs_on_lowprec_storage_and_reports_its_error(dtype):
    from kvcore.cli import demo, report

    res = demo.run_demo(dtype=dtype, requests=3, prompt_len=32, new_tokens=4)
    ver = res["verification"]
    assert res["ok"] == (ver["tokens_agree"] >= report.LOWPREC_AGREEMENT * ver["rows"])
    assert res["ok"], res["message"]
    assert ver["rows"] == res["generated_tokens"]
    # 8-bit K/V moves the logits by more than float32 rounding, and says so
    assert demo.F32_TOLERANCE < ver["max_abs_err"] < 1.0
    assert "of greedy tokens agree" in ver["criterion"]
    assert res["bytes_per_block"] == kvcore.BlockPool(
        1, 16, res["model"]["num_layers"], res["model"]["num_kv_heads"],
        res["model"]["head_dim"], dtype=dtype).bytes_per_block
    assert dtype in res["table"]


@pytest.mark.parametrize("dtype", LOWPREC)
def test_prefix_stores_carry_codes_and_scales(dtype, tmp_path):
    """A low-precision block evicted to a prefix store and loaded into
    another pool comes back bit-exact: codes and (int8) scales."""
    rng = np.random.default_rng(5)
    tokens = list(range(100, 133))                    # 4 full blocks of 8 and one more
    k = rng.standard_normal((len(tokens), 2, 16)).astype(np.float32) * 3
    v = rng.standard_normal((len(tokens), 2, 16)).astype(np.float32)

    def pool():
        return kvcore.BlockPool(16, 8, 2, 2, 16, dtype=dtype,
                                stores=[kvcore.DiskStore(str(tmp_path), 1 << 24)])

    a_pool = pool()
    a = kvcore.PagedKVCache(a_pool)
    a.allocate(tokens)
    for layer in range(2):
        a.append(layer, k, v)
    a.commit(len(tokens))
    want = [a.gather(layer, dtype="float32") for layer in range(2)]
    want_raw = [a.gather(layer) for layer in range(2)]
    want_sc = [a.gather_scales(layer) for layer in range(2)] if dtype == "int8" else None
    a.free()
    a_pool.flush_to_stores()

    b_pool = pool()
    b = kvcore.PagedKVCache(b_pool)
    assert b.allocate(tokens) == 32
    assert b_pool.stats()["prefix_hits"] >= 32
    for layer in range(2):
        kh, vh = b.gather(layer, 0, 32, dtype="float32")
        np.testing.assert_array_equal(kh, want[layer][0][:, :32])
        np.testing.assert_array_equal(vh, want[layer][1][:, :32])
        kr, vr = b.gather(layer, 0, 32)
        np.testing.assert_array_equal(kr, want_raw[layer][0][:, :32])
        np.testing.assert_array_equal(vr, want_raw[layer][1][:, :32])
        if dtype == "int8":
            ks, vs = b.gather_scales(layer, 0, 32)
            np.testing.assert_array_equal(ks, want_sc[layer][0][:, :32])
            np.testing.assert_array_equal(vs, want_sc[layer][1][:, :32])
    b.free()


def test_prefix_store_entry_with_a_corrupt_int8_scale_is_a_miss(tmp_path):
    """The checksum of an int8 entry covers its scales as well as its codes
    (both are copied and hashed in one native pass): one flipped scale byte
    makes that block, and the blocks after it, a miss."""
    rng = np.random.default_rng(6)
    tokens = list(range(200, 225))                    # 3 full blocks of 8 and one more
    k = rng.standard_normal((len(tokens), 2, 16)).astype(np.float32)
    store = kvcore.DiskStore(str(tmp_path), 1 << 24)
    a_pool = kvcore.BlockPool(16, 8, 2, 2, 16, dtype="int8", stores=[store])
    a = kvcore.PagedKVCache(a_pool)
    a.allocate(tokens)
    for layer in range(2):
        a.append(layer, k, k * 2)
    a.commit(len(tokens))
    second = a.block_table[1]
    want = a.gather(0, 0, 8, dtype="float32")
    payload = store_port(a_pool).export_blocks([second])[0].tobytes()
    a.free()
    a_pool.flush_to_stores()
    files = [p for p in tmp_path.rglob("*.kve") if payload in p.read_bytes()]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[data.find(payload) + len(payload) - 3] ^= 0x01   # inside the last float32 scale
    files[0].write_bytes(bytes(data))

    b_pool = kvcore.BlockPool(16, 8, 2, 2, 16, dtype="int8", stores=[store])
    b = kvcore.PagedKVCache(b_pool)
    with pytest.warns(kvcore.StoreWarning, match="corrupt"):
        assert b.allocate(tokens) == 8                # block 0 only
    assert b_pool.stats()["stores"][0]["rejected"] == 1
    for got, exp in zip(b.gather(0, 0, 8, dtype="float32"), want):
        np.testing.assert_array_equal(got, exp)
    b.free()
    b_pool.debug.check()


def test_int8_row_whose_scale_underflows_is_stored_exactly(simd_level):
    """max|x| / 127 underflows to 0 for rows below 63.5 * 2**-149: the scale
    is then the smallest subnormal, every element an exact multiple of it:
    the same codes at every SIMD level and in the reference, and the row
    reads back exactly (it once read 0/0 = NaN into 127, 0 or -127 by path)."""
    tiny = np.float32(2.0**-149)
    x = np.zeros((3, 16), np.float32)
    x[0, :3] = [tiny, 0, -tiny]                       # max|x| = 2**-149
    x[1, :4] = [63 * tiny, -5 * tiny, 0, 17 * tiny]    # just below the underflow bound
    x[2, :2] = [64 * tiny, -tiny]                      # the quotient no longer underflows
    codes, scales = int8_encode(x)
    assert scales[0] == tiny and scales[1] == tiny and scales[2] > 0
    np.testing.assert_array_equal(int8_decode(codes[:2], scales[:2]), x[:2])
    pool = kvcore.BlockPool(2, 4, 1, 1, 16, dtype="int8")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(3)))
    seq.append(0, x[:, None, :], x[:, None, :])
    seq.commit(3)
    k, _ = seq.gather(0)
    ks, _ = seq.gather_scales(0)
    np.testing.assert_array_equal(k[0], codes)
    np.testing.assert_array_equal(ks[0].view(np.uint32), scales.view(np.uint32))
    kd, _ = seq.gather(0, dtype="float32")
    np.testing.assert_array_equal(kd[0, :2], x[:2])
