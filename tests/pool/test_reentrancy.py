"""Arguments whose conversion runs the caller's code (``__index__``,
``__array__``) and changes the very object the call works on: the call sees
the change and refuses by name, never reading freed memory (a crash before),
handing back another sequence's data, or leaving blocks nobody can free.
Found by an adversarial review (2026-12-06)."""
import gc

import numpy as np
import pytest

import kvcore
from kvcore.pool import store_port


class Hook:
    """An int (``__index__``) or array (``__array__``) argument that runs
    ``action`` when it is converted."""

    def __init__(self, value, action):
        self.value, self.action = value, action

    def __index__(self):
        self.action()
        return self.value

    def __array__(self, dtype=None, copy=None):
        self.action()
        return np.asarray(self.value, dtype=dtype)


def _seq(pool, n=10, value=1.0):
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(n)))
    kv = np.full((n, pool.num_kv_heads, pool.head_dim), value, np.float32)
    for layer in range(pool.num_layers):
        seq.append(layer, kv, kv)
    return seq


@pytest.mark.parametrize("arg", ["start", "end"])
@pytest.mark.parametrize("call", ["gather", "gather_scales"])
def test_gather_refuses_a_sequence_its_arguments_free(arg, call):
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="int8" if call == "gather_scales" else "float16")
    seq = _seq(pool)
    kw = {"start": 0, "end": 10}
    kw[arg] = Hook(kw[arg], seq.free)
    with pytest.raises(ValueError, match=f"{call} on a freed PagedKVCache"):
        getattr(seq, call)(0, **kw)
    assert pool.num_used_blocks == 0


def test_gather_never_reads_blocks_a_truncate_in_its_arguments_gave_away():
    pool = kvcore.BlockPool(4, 4, 1, 1, 4, dtype="float32", enable_prefix_caching=False)
    a = _seq(pool, 8, 1.0)
    others = []

    def truncate_and_reuse():
        a.truncate(0)
        others.append(_seq(pool, 8, 42.0))        # takes the blocks a gave back

    with pytest.raises(ValueError, match=r"positions 0..7 of layer 0 were never written"):
        a.gather(0, Hook(0, truncate_and_reuse), 8)
    assert others[0].gather(0)[0].max() == 42.0 and a.num_written(0) == 0


@pytest.mark.parametrize("where", ["layer", "k"])
def test_append_to_a_sequence_its_arguments_free_refuses_and_leaks_nothing(where):
    pool = kvcore.BlockPool(8, 4, 2, 2, 8, dtype="float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(10)))
    k = np.ones((5, 2, 8), np.float32)
    args = [0, k, k]
    args[0 if where == "layer" else 1] = Hook(args[0] if where == "layer" else k, seq.free)
    with pytest.raises(ValueError, match="append on a freed PagedKVCache"):
        seq.append(*args)
    assert seq.closed and seq.num_blocks == 0
    del seq
    gc.collect()
    assert pool.num_used_blocks == 0
    pool.debug.check()


def test_extend_tokens_of_a_sequence_its_ids_free_refuses():
    pool = kvcore.BlockPool(8, 4, 1, 1, 4)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate([1, 2, 3])
    with pytest.raises(ValueError, match="extend_tokens on a freed PagedKVCache"):
        seq.extend_tokens([7, Hook(5, seq.free), 9])
    assert seq.closed and seq.num_tokens == 0


def test_allocate_freed_by_its_token_ids_says_so():
    pool = kvcore.BlockPool(8, 4, 1, 1, 4)
    seq = kvcore.PagedKVCache(pool)
    with pytest.raises(ValueError, match="allocate on a freed PagedKVCache"):
        seq.allocate([0, Hook(1, seq.free), 2])
    assert pool.num_used_blocks == 0


def test_attention_of_a_sequence_its_query_frees_refuses():
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float32")
    seq = _seq(pool, 10)
    q = Hook(np.ones((1, 2, 8), np.float32), seq.free)
    with pytest.raises(ValueError, match="on a freed PagedKVCache"):
        seq.attention(0, q)


def test_a_plan_over_torch_planes_freed_by_its_layer_argument_refuses(torch):
    kc, vc = torch.ones(64, 2, 16, 64), torch.ones(64, 2, 16, 64)
    plan = kvcore.AttentionPlan((kc, vc), np.arange(64)[None, :], [1024], num_heads=2)
    q = np.ones((1, 2, 64), np.float32)
    plan.run(q, 0)

    def free():
        kc.untyped_storage().resize_(0)
        vc.untyped_storage().resize_(0)

    with pytest.raises(RuntimeError, match="key_cache's memory moved or was freed"):
        plan.run(q, Hook(0, free))


def test_a_plan_over_numpy_planes_resized_by_its_query_refuses():
    kc, vc = np.ones((64, 2, 16, 64), np.float32), np.ones((64, 2, 16, 64), np.float32)
    plan = kvcore.AttentionPlan((kc, vc), np.arange(64)[None, :], [1024], num_heads=2)
    q = np.ones((1, 2, 64), np.float32)
    plan.run(q, 0)
    hook = Hook(q, lambda: vc.resize((128, 2, 16, 64), refcheck=False))
    with pytest.raises(RuntimeError, match="value_cache's memory moved"):
        plan.run(hook, 0)


@pytest.mark.parametrize("which", ["write", "update", "append"])
def test_writes_whose_other_arguments_free_the_input_write_it_as_it_was(torch, which):
    """A write whose other argument's conversion frees k's storage writes
    k as it was when the call began: it works on copies, made before any
    of the caller's code runs (the write read freed memory before)."""
    n = 1 << 12
    k = torch.arange(n * 2 * 64, dtype=torch.float32).reshape(n, 2, 64) / n
    want = k.clone().numpy().astype(np.float16)

    def free():
        k.untyped_storage().resize_(0)

    if which == "write":
        pool = kvcore.BlockPool(n // 16, 16, 1, 2, 64, dtype="float16")
        pool.write(0, k, k, Hook(np.arange(n), free))
        got = pool.key_cache(0).transpose(0, 2, 1, 3).reshape(n, 2, 64)
    elif which == "update":
        cache = kvcore.KVCache(1, 2, 64, n + 10, dtype="float16")
        kk = k.view(1, n, 2, 64).transpose(1, 2)
        cache.update(0, kk, kk, start_pos=Hook(0, free))
        got = cache.get(0)[0][0].transpose(1, 0, 2)
    else:
        pool = kvcore.BlockPool(n // 16 + 1, 16, 1, 2, 64, dtype="float16")
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(list(range(n)))
        seq.append(Hook(0, free), k, k)
        got = seq.gather(0)[0].transpose(1, 0, 2)
    np.testing.assert_array_equal(got, want)


class _Int64(np.int64):
    """A NumPy integer whose conversion runs code (not one of NumPy's own)."""

    def __index__(self):
        _Int64.action()
        return 0


class _Name(str):
    def lower(self):
        _Name.action()
        return str.lower(self)


@pytest.mark.parametrize("arg", ["layer", "src_dtype"])
def test_subclasses_of_plain_types_count_as_the_callers_code(arg):
    """An np.int64 or str subclass may override its methods: the write then
    works on copies too (it read a freed array before)."""
    n = 1 << 14
    a = np.ones((n, 2, 64), np.float32)

    def shrink():
        a.resize((1, 2, 64), refcheck=False)

    _Int64.action = _Name.action = shrink
    pool = kvcore.BlockPool(n // 16, 16, 1, 2, 64, dtype="float16")
    k = a[:]
    if arg == "layer":
        pool.write(_Int64(0), k, k, np.arange(n))
    else:
        pool.write(0, k, k, np.arange(n), src_dtype=_Name("float32"))
    assert (pool.key_cache(0) == 1).all()


def test_a_plan_run_whose_out_frees_q_reads_q_as_it_was(torch):
    pool = kvcore.BlockPool(8, 16, 1, 2, 64, dtype="float32")
    seq = _seq(pool, 16)
    plan = kvcore.AttentionPlan(pool, seq.block_table[None, :], [16], [0, 16], num_heads=2)
    qt = torch.ones(1 << 15, 2, 64)
    want = plan.run(qt[:16].clone(), 0)

    class Out(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if qt.untyped_storage().nbytes():
                qt.untyped_storage().resize_(0)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    out = torch.empty(16, 2, 64).as_subclass(Out)
    plan.run(qt[:16], 0, out=out)
    with torch._C.DisableTorchFunctionSubclass():
        np.testing.assert_array_equal(out.numpy(), want)


def test_calls_of_plain_arguments_copy_nothing(monkeypatch):
    """(NumPy arrays, ints, strs, exact tensors run no caller code: no copy.)"""
    from kvcore import _arrays

    made = []
    real = _arrays.snapshot
    monkeypatch.setattr(_arrays, "snapshot", lambda *a, **kw: made.append(a) or real(*a, **kw))
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float16")
    kv = np.ones((4, 2, 8), np.float32)
    pool.write(0, kv, kv, np.arange(4), src_dtype="float32")
    assert made == []
    pool.write(0, kv, kv, [0, 1, 2, 3])                      # (a list's items might)
    assert len(made) == 1


@pytest.mark.parametrize("ids, exc, match", [
    ([-2], IndexError, r"block_ids\[0\] must be a block id in 0..3, got -2"),
    ([0, 9], IndexError, r"block_ids\[1\] must be a block id in 0..3, got 9"),
    ([2**63 - 1], IndexError, r"block_ids\[0\] .* got 9223372036854775807"),
    ([1.5], TypeError, r"block_ids must hold integers, got dtype float64"),
    ([[1]], ValueError, r"block_ids must be 1-D"),
])
def test_store_port_block_ids_are_checked_before_anything(ids, exc, match):
    pool = kvcore.BlockPool(4, 4, 1, 1, 4, dtype="float32")
    _seq(pool, 13).free()
    port = store_port(pool)
    before = pool.storage.copy()
    pay = np.full(port.bytes_per_block, 7, np.uint8)
    with pytest.raises(exc, match=match):
        port.import_blocks(ids, [pay] * len(ids))
    with pytest.raises(exc, match=match):
        port.export_blocks(ids)
    np.testing.assert_array_equal(pool.storage, before)


def test_gather_whose_out_frees_the_sequence_refuses():
    """``out`` is converted after the sequence's table is read (its shape
    needs the range): a conversion that frees the sequence (here a list
    whose iteration does) voids the read."""
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float16")
    seq = _seq(pool)
    outs = [np.empty((2, 10, 8), np.float16) for _ in range(2)]

    class FreeingPair(list):
        def __iter__(self):
            seq.free()
            return super().__iter__()

    with pytest.raises(RuntimeError, match="gather: the sequence was freed or truncated"):
        seq.gather(0, 0, 10, out=FreeingPair(outs))
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("call", ["seq.gather", "pool.gather", "plan.run", "paged_attention",
                                  "pool.gather_batch", "cache.get"])
def test_an_out_freed_by_another_argument_is_refused_before_any_write(call):
    """``out`` resized in place (``ndarray.resize(refcheck=False)``) by the
    conversion of another argument: refused by name before the call writes
    (it wrote into freed memory before)."""
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float16")
    seq = _seq(pool)
    big = np.empty((2, 1 << 20, 8), np.float16) if "gather" in call or call == "cache.get" \
        else np.empty((1 << 20, 2, 8), np.float32)
    hook = Hook(0, lambda: big.resize((1,), refcheck=False))
    q = np.ones((1, 2, 8), np.float32)
    with pytest.raises(RuntimeError, match=r"out(\[0\])?'s memory moved since the call began"):
        if call == "seq.gather":
            seq.gather(0, hook, 10, out=(big[:, :10], np.empty((2, 10, 8), np.float16)))
        elif call == "pool.gather":
            pool.gather(0, seq.block_table, hook, 10,
                        out=(big[:, :10], np.empty((2, 10, 8), np.float16)))
        elif call == "plan.run":
            kvcore.AttentionPlan(pool, [seq.block_table], [10]).run(q, hook, out=big[:1])
        elif call == "paged_attention":
            kvcore.paged_attention(q, pool, hook, [seq.block_table], [10], out=big[:1])
        elif call == "pool.gather_batch":
            pool.gather_batch(hook, [seq.block_table], [10],
                              out=(big[None, :, :10], np.empty((1, 2, 10, 8), np.float16)))
        else:
            cache = kvcore.KVCache(1, 2, 8, 16, dtype="float16")
            cache.update(0, np.ones((1, 2, 10, 8), np.float32), np.ones((1, 2, 10, 8), np.float32))
            cache.get(hook, 0, 10, out=(big[None, :, :10], np.empty((1, 2, 10, 8), np.float16)))


def test_a_conversion_whose_input_frees_its_out_is_refused():
    """``kvcore.convert``: ``x``'s own conversion resizes the array ``out``
    views: refused by name before anything is written."""
    big = np.empty(1 << 20, np.float16)
    x = Hook(np.ones(16, np.float32), lambda: big.resize((1,), refcheck=False))
    with pytest.raises(RuntimeError, match="out's memory moved since the call began"):
        kvcore.convert.to_float16(x, out=big[:16])


def test_sequence_attention_whose_layer_frees_q_or_out():
    """``PagedKVCache.attention``: a layer whose ``__index__`` resizes the
    array q views reads q as it was; one that resizes out's is refused."""
    pool = kvcore.BlockPool(8, 4, 1, 2, 8, dtype="float32")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(12)))
    kv = np.ones((10, 2, 8), np.float32)
    seq.append(0, kv, kv)
    seq.commit(10)
    seq.append(0, kv[:2], kv[:2])
    qa = np.ones((1 << 20, 2, 8), np.float32)
    want = seq.attention(0, np.ones((2, 2, 8), np.float32))
    got = seq.attention(Hook(0, lambda: qa.resize((1,), refcheck=False)), qa[:2])
    np.testing.assert_array_equal(got, want)
    oa = np.empty((1 << 20, 2, 8), np.float32)
    with pytest.raises(RuntimeError, match="out's memory moved since the call began"):
        seq.attention(Hook(0, lambda: oa.resize((1,), refcheck=False)),
                      np.ones((2, 2, 8), np.float32), out=oa[:2])
