"""Several threads share one BlockPool: each drives its own sequences
(allocate from shared prefixes, prefill, decode, fork, truncate, verify,
free) while the others do the same.  Every read is checked against the KV
the sequence must hold, and the pool must end consistent and empty."""
import random
import sys
import threading
import time

import numpy as np
import pytest

import kvcore

L, H, D = 2, 2, 4
BS = 4
THREADS = 4
SEQS_PER_THREAD = 150
PREFIXES = [[(7 * i + j) % 50 for j in range(16)] for i in range(3)]
_P = 2**61 - 1
_LANES = np.arange(L * 2 * H * D, dtype=np.int64) * 7919


def kv_for(tokens, start, end):
    """(end - start, L, 2, H, D) float32: position p's KV is a function of
    tokens[:p + 1] (a rolling hash of the prefix), like a model's."""
    h, hs = 0, []
    for p in range(end):
        h = (h * 1000003 + int(tokens[p]) + 1) % _P
        if p >= start:
            hs.append(h)
    vals = (np.array(hs, np.int64)[:, None] % 1000003 + _LANES[None, :]) % 100003
    return (vals.astype(np.float32) / np.float32(64)).reshape(end - start, L, 2, H, D)


class Seq:
    def __init__(self, seq, tokens):
        self.seq = seq
        self.tokens = list(tokens)

    def write(self, pool, rng, end):
        """Compute positions num_computed..end-1 and commit them."""
        seq = self.seq
        start = seq.num_computed
        data = kv_for(self.tokens, start, end)
        if rng.random() < 0.3:
            seq.reserve(end - start)
            slots = seq.slot_mapping(start, end)
            for layer in range(L):
                pool.write(layer, data[:, layer, 0], data[:, layer, 1], slots)
                seq.mark_written(layer, end - start)
        else:
            for layer in range(L):
                seq.append(layer, data[:, layer, 0], data[:, layer, 1])
        seq.commit(end - start)

    def verify(self, start=0):
        end = self.seq.num_computed
        want = kv_for(self.tokens, start, end)
        for layer in range(L):
            k, v = self.seq.gather(layer, start, end)
            np.testing.assert_array_equal(k, want[:, layer, 0].transpose(1, 0, 2))
            np.testing.assert_array_equal(v, want[:, layer, 1].transpose(1, 0, 2))


def worker(pool, seed, counters, errors, start_gate):
    rng = random.Random(seed)
    live = []
    started = 0
    try:
        start_gate.wait()
        while started < SEQS_PER_THREAD or live:
            r = rng.random()
            if started < SEQS_PER_THREAD and (not live or (len(live) < 3 and r < 0.3)):
                started += 1
                base = PREFIXES[rng.randrange(len(PREFIXES))]
                prompt = base[:rng.randrange(len(base) + 1)] + \
                    [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
                s = Seq(kvcore.PagedKVCache(pool), prompt)
                try:
                    hit = s.seq.allocate(prompt)
                except kvcore.OutOfBlocksError:
                    counters["oob"] += 1
                    if live:
                        live.pop(0).seq.free()
                    continue
                counters["hit_tokens"] += hit
                assert hit % BS == 0 and hit < len(prompt)
                s.verify()                       # the hit gives back the prefix's KV
                try:
                    s.write(pool, rng, len(prompt))
                except kvcore.OutOfBlocksError:
                    counters["oob"] += 1
                    s.seq.free()
                    continue
                live.append(s)
            elif live and r < 0.45 and len(live) < 3:
                parent = rng.choice(live)
                live.append(Seq(parent.seq.fork(), parent.tokens))
                counters["forks"] += 1
            elif live and r < 0.55:
                s = rng.choice(live)
                n = rng.randrange(1, s.seq.num_computed + 1)
                s.seq.truncate(n)
                s.tokens = s.tokens[:n]
                s.verify()
            elif live and r < 0.85:
                s = rng.choice(live)
                tok = rng.randrange(4)
                s.tokens.append(tok)
                s.seq.append_token(tok)
                try:
                    s.write(pool, rng, len(s.tokens))
                except kvcore.OutOfBlocksError:
                    counters["oob"] += 1
                    live.remove(s)
                    s.seq.free()
                    continue
                s.verify(max(0, len(s.tokens) - 3))
            elif live:
                s = live.pop(rng.randrange(len(live)))
                s.verify()
                s.seq.free()
                counters["done"] += 1
    except BaseException as e:  # reported by the main thread
        errors.append(e)
    finally:
        for s in live:
            s.seq.free()


@pytest.fixture
def fast_switching():
    """Switch threads often, so pool operations interleave finely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run_threads(threads, errors):
    """Start and join ``threads``; raise the first error one of them put in
    ``errors``."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_threads_share_one_pool(fast_switching):
    pool = kvcore.BlockPool(20, BS, L, H, D, dtype="float32")
    counters = [dict.fromkeys(("oob", "hit_tokens", "forks", "done"), 0)
                for _ in range(THREADS)]
    errors = []
    gate = threading.Barrier(THREADS)
    _run_threads([threading.Thread(target=worker, args=(pool, 1000 + i, counters[i], errors,
                                                        gate)) for i in range(THREADS)], errors)
    total = {k: sum(c[k] for c in counters) for k in counters[0]}
    assert total["done"] > THREADS * SEQS_PER_THREAD // 4
    assert total["hit_tokens"] > 0 and total["forks"] > 0
    pool.debug.check()
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.num_used_blocks == 0
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    s = pool.stats()
    assert s["prefix_hits"] == total["hit_tokens"]
    assert s["num_free_blocks"] == pool.num_blocks


def test_threads_allocate_and_free_the_last_blocks():
    """Many threads race for a pool that is almost always full: every
    allocation either gets all its blocks or changes nothing."""
    pool = kvcore.BlockPool(6, 2, 1, 1, 2, dtype="float32")
    errors = []
    got = [0] * THREADS

    def run(i):
        rng = random.Random(i)
        try:
            for _ in range(400):
                s = kvcore.PagedKVCache(pool)
                try:
                    s.allocate([rng.randrange(3) for _ in range(rng.randrange(1, 7))])
                except kvcore.OutOfBlocksError:
                    continue
                got[i] += 1
                assert s.num_blocks == -(-s.num_tokens // 2)
                if rng.random() < 0.5:
                    s.fork().free()
                s.free()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert sum(got) > 0
    pool.debug.check()
    assert pool.num_free_blocks == 6


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_threads_write_float16_rows_to_one_low_precision_pool(dtype):
    """float16 rows written to an int8/fp8 pool through its slot writer
    (kvcore.hf's decode lane, which takes no pool lock) are widened through
    a scratch row without the GIL: two threads writing at once to one pool
    store exactly what one thread stores (a scratch shared by the pool's
    writer mixed their rows)."""
    heads, dim, bs, rows, rounds = 4, 128, 16, 256, 40
    blocks = 2 * rows // bs
    shared = kvcore.BlockPool(blocks, bs, L, heads, dim, dtype=dtype)
    alone = kvcore.BlockPool(blocks, bs, L, heads, dim, dtype=dtype)
    rng = np.random.default_rng(5)
    data = [rng.standard_normal((rounds, L, 2, rows, heads, dim)).astype(np.float16)
            for _ in range(2)]
    slots = [np.arange(i * rows, (i + 1) * rows, dtype=np.int64) for i in range(2)]
    errors = []
    gate = threading.Barrier(2)

    def fill(pool, i, wait):
        writer = pool._writer
        try:
            if wait:
                gate.wait()
            for r in range(rounds):
                for layer in range(L):
                    d = data[i][r, layer]
                    assert writer.write_slots(layer, d[0], d[1], slots[i])
        except BaseException as e:
            errors.append(e)

    _run_threads([threading.Thread(target=fill, args=(shared, i, True)) for i in range(2)], errors)
    for i in range(2):
        fill(alone, i, False)
    assert not errors
    np.testing.assert_array_equal(shared.storage.view(np.uint8), alone.storage.view(np.uint8))
    if dtype == "int8":
        np.testing.assert_array_equal(shared.scales, alone.scales)


@pytest.mark.parametrize("path", ["write_slots", "pool.write"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_slots_rewritten_by_another_thread_never_write_outside(dtype, path):
    """While one thread writes rows through slots that another thread keeps
    setting one past the end of layer 0 (which would land in the next
    plane), every write goes where its checked slots said, or is refused:
    the slots are copied, then checked, then written through (they were
    checked, then read again without the GIL)."""
    heads, dim, bs, blocks, n = 4, 128, 16, 8, 64
    limit = blocks * bs
    pool = kvcore.BlockPool(blocks, bs, 2, heads, dim, dtype=dtype)
    writer = pool._writer
    k = np.ones((n, heads, dim), np.float32)
    v = np.full((n, heads, dim), 2, np.float32)
    slots = np.arange(n, dtype=np.int64)
    done = threading.Event()
    errors = []

    def flip():
        try:
            while not done.is_set():
                slots[-1] = limit
        except BaseException as e:
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=flip)
    written = refused = 0
    try:
        t.start()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            slots[-1] = n - 1
            if path == "write_slots":
                ok = writer.write_slots(0, k, v, slots)
            else:
                try:
                    pool.write(0, k, v, slots)
                    ok = True
                except IndexError:
                    ok = False
            written += ok
            refused += not ok
    finally:
        done.set()
        t.join(timeout=60)
        sys.setswitchinterval(old)
    assert not errors and not t.is_alive()
    assert written + refused > 0
    assert not pool.storage[2:].view(np.uint8).any()     # layer 1's planes never written
    got = pool.gather(0, np.arange(blocks), 0, limit, dtype="float32")
    for plane, want in zip(got, (1.0, 2.0)):     # layer 0: rows 0..n-1 only
        np.testing.assert_allclose(plane[:, :n], want, rtol=0.02)
        assert not plane[:, n:].any()
