"""A hypothesis state machine over a small pool shared by many sequences.

Sequences are allocated from a few shared prefixes (so prefix hits happen),
written, committed, told their generated tokens, forked, truncated and freed
on a pool small enough that eviction and OutOfBlocksError happen.  KV is a
deterministic function of (salt, token ids up to the position, layer), like a
real model's, so every read, every prefix hit and every cached block can be
checked against the values it must hold.  After every step:

* each block's reference count equals the number of live sequences holding it;
* num_free + num_used == num_blocks, and ``pool.debug.check()`` passes;
* every sequence reads back exactly the KV it wrote or inherited;
* every cached block holds the KV of the prefix its hash names.
"""

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvcore

try:
    from _helpers import PrefixKV, cached_hash_bytes, pool_snapshot, write_kv
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import PrefixKV, cached_hash_bytes, pool_snapshot, write_kv

LAYERS, HEADS, DIM = 2, 1, 2
ALPHABET = st.integers(0, 3)         # small, so different paths meet again
BASES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
         [7, 7, 0, 1, 7, 7, 0, 1, 7, 7, 0, 1, 7, 7])
SALTS = (None, None, None, "s", b"s", "t")   # "s" and b"s" are the same salt
MAX_SEQS = 6


def salt_key(salt):
    return salt.encode() if isinstance(salt, str) else salt


ORACLE = PrefixKV(LAYERS, HEADS, DIM)


def kv_value(salt, prefix):
    """(LAYERS, 2, HEADS, DIM) float32 K/V of the last position of ``prefix``."""
    return ORACLE.value(salt_key(salt), prefix)


def expected(salt, tokens, start, end):
    """(LAYERS, 2, HEADS, end - start, DIM) of positions start..end-1."""
    return ORACLE.expected(salt_key(salt), tokens, start, end)


class Model:
    """What one sequence must hold.  ``tokens`` are the ids the caller has
    decided; the first ``known`` were given to the cache; KV is committed for
    the first ``computed`` positions."""

    def __init__(self, seq, salt, tokens, known, computed):
        self.seq = seq
        self.salt = salt
        self.tokens = list(tokens)
        self.known = known
        self.computed = computed

    def copy(self, seq):
        return Model(seq, self.salt, self.tokens, self.known, self.computed)


def pool_state(pool):
    snap = pool_snapshot(pool)
    return (snap["stats"], snap["ref_counts"], snap["cached"], snap["lru_order"],
            snap["storage"])


def seq_state(seq):
    return (seq.num_tokens, seq.num_computed, seq.block_table.tolist(),
            seq.token_ids.tolist(), seq.capacity,
            [seq.num_written(i) for i in range(LAYERS)])


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.models = []
        self.prefixes = {}      # block hash -> (salt, token ids through that block)
        self.history = []       # (salt, token ids) of sequences seen, newest last

    @initialize(num_blocks=st.integers(5, 16), block_size=st.sampled_from([1, 2, 2, 3, 4]),
                 caching=st.sampled_from([True, True, True, False]))
    def make_pool(self, num_blocks, block_size, caching):
        self.bs = block_size
        self.caching = caching
        self.pool = kvcore.BlockPool(num_blocks, block_size, LAYERS, HEADS, DIM,
                                     dtype="float32", enable_prefix_caching=caching)

    # -------------------------------------------------------------- helpers
    def pick(self, i):
        return self.models[i % len(self.models)]

    def record(self, m):
        toks = m.seq.token_ids.tolist()
        if len(toks) > self.bs:
            self.history = (self.history + [(m.salt, tuple(m.tokens))])[-12:]
        for j, h in enumerate(kvcore.block_hashes(toks, self.bs, salt=m.salt)):
            self.prefixes[h] = (salt_key(m.salt), tuple(toks[:(j + 1) * self.bs]))

    def cached_hashes(self):
        return {cached_hash_bytes(self.pool, b) for b in range(self.pool.num_blocks)
                if self.pool.is_cached(b)}

    def assert_unchanged(self, before, models=()):
        assert pool_state(self.pool) == before[0]
        for m, s in zip(models, before[1]):
            assert seq_state(m.seq) == s

    def snapshot(self, models=()):
        return pool_state(self.pool), [seq_state(m.seq) for m in models]

    # -------------------------------------------------------------- rules
    @rule(base=st.integers(0, len(BASES) - 1), base_len=st.integers(5, 12) | st.integers(0, 4),
          suffix=st.lists(ALPHABET, max_size=3), salt=st.sampled_from(SALTS),
          max_len=st.sampled_from([None, None, 12]),
          prefill=st.sampled_from([True, True, False]))
    def allocate(self, base, base_len, suffix, salt, max_len, prefill):
        if len(self.models) >= MAX_SEQS:
            return
        prompt = BASES[base][:base_len] + suffix
        self._allocate(prompt or [0], salt, max_len, prefill)

    @rule(j=st.integers(0, 99), cut=st.integers(0, 99), extra=st.lists(ALPHABET, max_size=2),
          prefill=st.booleans())
    def allocate_seen(self, j, cut, extra, prefill):
        """A new request repeating (part of) a sequence seen before."""
        if not self.history or len(self.models) >= MAX_SEQS:
            return
        salt, toks = self.history[j % len(self.history)]
        prompt = list(toks[:cut % (len(toks) + 1)]) + extra
        self._allocate(prompt or [0], salt, None, prefill)

    def _allocate(self, prompt, salt, max_len, prefill):
        seq = kvcore.PagedKVCache(self.pool, max_seq_len=max_len, salt=salt)
        n = len(prompt)
        bs = self.bs
        # what the cache must find: the leading full blocks (short of the last
        # token) whose hashes are cached now
        max_hit = (n - 1) // bs if self.caching else 0
        cached = self.cached_hashes()
        want_hit = 0
        for h in kvcore.block_hashes(prompt, bs, salt=salt)[:max_hit]:
            if h not in cached:
                break
            want_hit += 1
        uncached_free = self.pool.debug.snapshot()["num_uncached_free"]
        before = self.snapshot()
        try:
            hit = seq.allocate(prompt)
        except kvcore.CacheFullError:
            assert max_len is not None and n > max_len
            self.assert_unchanged(before)
            return
        except kvcore.OutOfBlocksError:
            event("allocate: out of blocks")
            self.assert_unchanged(before)
            assert seq.num_tokens == 0 and seq.num_blocks == 0
            return
        assert max_len is None or n <= max_len
        assert hit == want_hit * bs
        assert hit % bs == 0 and hit < n
        s0, s1 = before[0][0], self.pool.stats()
        if self.caching:
            assert s1["prefix_queries"] == s0["prefix_queries"] + n
            assert s1["prefix_hits"] == s0["prefix_hits"] + hit
        # never-cached blocks go first; only the rest evicts
        fresh = -(-n // bs) - want_hit
        assert s1["evictions"] - s0["evictions"] == max(0, fresh - uncached_free)
        if hit:
            event("allocate: prefix hit")
        if fresh > uncached_free:
            event("allocate: evicted")
        m = Model(seq, salt, prompt, n, hit)
        self.models.append(m)
        self.record(m)
        if prefill:       # compute the prompt at once, as an engine would
            self._compute(m, n - hit, batched=False)

    def _compute(self, m, n, batched):
        """Write and commit KV for positions computed..computed+n-1 (their
        tokens are decided); errors must change nothing."""
        seq = m.seq
        start, end = m.computed, m.computed + n
        data = expected(m.salt, m.tokens, start, end)
        before = self.snapshot(self.models)

        def readable_before_commit(layer):
            # this step's positions are readable before the commit
            k, v = seq.gather(layer)
            assert k.shape == (HEADS, end, DIM)
            np.testing.assert_array_equal(k[:, start:], data[layer, 0])
            np.testing.assert_array_equal(v[:, start:], data[layer, 1])

        try:
            write_kv(seq, data, start, batched, readable_before_commit)
            # (writes into reserved slots leave the capacity as reserve made it)
            assert not batched or seq.capacity >= end
        except kvcore.CacheFullError:
            assert seq.max_seq_len is not None and end > seq.max_seq_len
            self.assert_unchanged(before, self.models)
            return
        except kvcore.OutOfBlocksError:
            event("write: out of blocks")
            self.assert_unchanged(before, self.models)
            return
        table = before[1][self.models.index(m)][2]
        if seq.block_table.tolist()[:len(table)] != table:
            event("write: copy-on-write")
        seq.commit(n)
        m.computed = end
        self.record(m)

    @rule(i=st.integers(0, 99), new=st.lists(ALPHABET, max_size=4),
          n=st.integers(1, 6) | st.just(99), batched=st.booleans(), tell_first=st.booleans())
    def step(self, i, new, n, batched, tell_first):
        """Decide ``new`` tokens, then compute and commit n positions (99:
        every decided position, as a prefill does)."""
        if not self.models:
            return
        m = self.pick(i)
        seq = m.seq
        m.tokens.extend(new)
        n = min(n, len(m.tokens) - m.computed)
        if n <= 0:
            return
        end = m.computed + n
        if tell_first and self.caching:
            # tokens known before their KV is committed
            while m.known < end:
                if seq.max_seq_len is not None and m.known >= seq.max_seq_len:
                    break
                seq.append_token(m.tokens[m.known])
                m.known += 1
            self.record(m)
        self._compute(m, n, batched)

    @rule(i=st.integers(0, 99), tok=ALPHABET)
    def append_token(self, i, tok):
        if not self.models:
            return
        m = self.pick(i)
        if m.known == len(m.tokens):
            m.tokens.append(tok)           # a newly generated token
        before = self.snapshot([m])
        try:
            m.seq.append_token(m.tokens[m.known])
        except kvcore.CacheFullError:
            assert m.seq.max_seq_len == m.known
            self.assert_unchanged(before, [m])
            return
        m.known += 1
        self.record(m)

    @rule(i=st.integers(0, 99), write=st.sampled_from([None, "parent", "child"]),
          new=st.lists(ALPHABET, min_size=1, max_size=3), batched=st.booleans())
    def fork(self, i, write, new, batched):
        """Fork, then (maybe) write past the fork point in one of the two."""
        if not self.models or len(self.models) >= MAX_SEQS:
            return
        m = self.pick(i)
        child = m.seq.fork()
        assert child.block_table.tolist() == m.seq.block_table.tolist()
        c = m.copy(child)
        self.models.append(c)
        if write is not None:
            w = m if write == "parent" else c
            w.tokens = w.tokens[:max(w.known, w.computed)] + new
            self._compute(w, len(w.tokens) - w.computed, batched)

    @rule(i=st.integers(0, 99), cut=st.integers(0, 99), too_far=st.booleans(),
          new=st.lists(ALPHABET, max_size=3), batched=st.booleans())
    def truncate(self, i, cut, too_far, new, batched):
        if not self.models:
            return
        m = self.pick(i)
        length = max(m.known, m.computed)
        if too_far:
            before = self.snapshot(self.models)
            try:
                m.seq.truncate(length + 1)
            except ValueError:
                self.assert_unchanged(before, self.models)
            else:
                raise AssertionError("truncate past the length did not raise")
            return
        n = cut % (length + 1)
        used = self.pool.num_used_blocks
        m.seq.truncate(n)
        assert self.pool.num_used_blocks <= used      # never takes blocks
        m.tokens = m.tokens[:n]
        m.known = min(m.known, n)
        m.computed = min(m.computed, n)
        if new:
            # write new KV where the old was: nobody else may see it
            m.tokens = m.tokens[:max(m.known, m.computed)] + new
            self._compute(m, len(m.tokens) - m.computed, batched)

    @rule(i=st.integers(0, 99), twice=st.booleans())
    def free(self, i, twice):
        if not self.models:
            return
        m = self.pick(i)
        m.seq.free()
        if twice:
            m.seq.free()
        assert m.seq.num_blocks == 0
        self.models.remove(m)

    @rule()
    def reset_prefix_cache(self):
        before = self.snapshot()
        busy = self.pool.num_used_blocks > 0
        ok = self.pool.reset_prefix_cache()
        assert ok is (not busy)
        if busy:
            self.assert_unchanged(before)
        else:
            assert self.pool.num_cached_blocks == 0
            assert self.pool.debug.snapshot()["lru_order"] == []

    # -------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping(self):
        pool = self.pool
        n = pool.num_blocks
        holders = np.zeros(n, np.int64)
        for m in self.models:
            np.add.at(holders, m.seq.block_table, 1)
        refs = np.array([pool.ref_count(b) for b in range(n)])
        np.testing.assert_array_equal(refs, holders)
        assert pool.num_free_blocks + pool.num_used_blocks == n
        assert pool.num_free_blocks == int((refs == 0).sum())
        cached = [b for b in range(n) if pool.is_cached(b)]
        assert pool.num_cached_blocks == len(cached)
        if not self.caching:
            assert not cached
        lru = pool.debug.snapshot()["lru_order"]
        assert all(pool.is_cached(b) and refs[b] == 0 for b in lru)
        assert sorted(lru) == [b for b in cached if refs[b] == 0]
        s = pool.stats()
        assert (s["num_free_blocks"], s["num_used_blocks"], s["num_cached_blocks"]) == \
            (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks)
        assert pool.debug.check()

    @invariant()
    def every_sequence_reads_back_its_kv(self):
        for m in self.models:
            seq = m.seq
            assert seq.num_computed == m.computed
            assert seq.num_tokens == m.known
            assert seq.token_ids.tolist() == m.tokens[:m.known]
            assert seq.capacity >= m.computed
            assert len(set(seq.block_table.tolist())) == seq.num_blocks
            want = expected(m.salt, m.tokens, 0, m.computed)
            for layer in range(LAYERS):
                assert seq.num_written(layer) == m.computed
                k, v = seq.gather(layer)
                np.testing.assert_array_equal(k, want[layer, 0])
                np.testing.assert_array_equal(v, want[layer, 1])
            if self.caching:
                assert seq.block_hashes() == kvcore.block_hashes(
                    m.tokens[:m.known], self.bs, salt=m.salt)

    @invariant()
    def every_cached_block_holds_its_prefix(self):
        pool = self.pool
        bs = self.bs
        cached = [b for b in range(pool.num_blocks) if pool.is_cached(b)]
        assert pool.debug.cached_block_ids().tolist() == cached
        for b in cached:
            lo, hi = pool.debug.cached_block(b)[1]
            salt, prefix = self.prefixes[lo.to_bytes(8, "little") + hi.to_bytes(8, "little")]
            assert pool.debug.cached_block(b)[0].tolist() == list(prefix[-bs:])
            start = len(prefix) - bs
            for off in range(bs):
                kv = kv_value(salt, prefix[:start + off + 1])
                for layer in range(LAYERS):
                    np.testing.assert_array_equal(pool.key_cache(layer)[b, :, off, :],
                                                  kv[layer, 0])
                    np.testing.assert_array_equal(pool.value_cache(layer)[b, :, off, :],
                                                  kv[layer, 1])

    def teardown(self):
        for m in self.models:
            m.seq.free()
        if hasattr(self, "pool"):
            assert self.pool.num_free_blocks == self.pool.num_blocks
            self.pool.debug.check()


PoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=35, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPoolMachine = PoolMachine.TestCase
