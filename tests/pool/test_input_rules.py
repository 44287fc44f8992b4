"""One statement of each input rule (issue 43.4): a hot call's fast path
(Cython) and its general path (Python) accept the same inputs.

For every input kind (dtypes, shapes, strides, non-contiguous, misaligned,
byte-swapped, read-only, torch tensors, lazily negated views, out-of-range
layers and tables) the fast path either takes the input and gives the
general path's bits, or hands it to the general path: so a call accepts
exactly what the general path accepts, raises the same error type naming
the same argument, and leaves the same result.  Compared here:

* ``AttentionPlan.run`` (``Plan.run_layer`` first) against the plan's
  general run (``AttentionPlan._run``, the path every declined input takes);
* ``PagedKVCache.append`` (``SeqCore.append_direct`` first) against
  ``BlockPool.write`` of the same positions (the general write);
* kvcore.hf's decode write (the pool's writer, ``BlockPool._writer.write_slots``,
  first) against ``BlockPool.write`` of the same slots, on every storage
  kind (fp8 per-layer and per-kv-head scales included), for k / v, slots
  and layers of every kind and for inputs that are the pool's own memory;
* the block-table range rule of ``paged_attention`` / ``AttentionPlan``
  (one native check) and of the pool's reads (one helper).
"""
import re

import numpy as np
import pytest

import kvcore

torch = pytest.importorskip("torch")

BS, LAYERS, KVH, HEADS, DIM, NB = 8, 3, 2, 4, 16, 12


def _pool(dtype="float16", seed=0):
    pool = kvcore.BlockPool(NB, BS, LAYERS, KVH, DIM, dtype=dtype)
    rng = np.random.default_rng(seed)
    n = NB * BS
    for layer in range(LAYERS):
        k = rng.standard_normal((n, KVH, DIM)).astype(np.float32)
        v = rng.standard_normal((n, KVH, DIM)).astype(np.float32)
        pool.write(layer, k, v, np.arange(n))
    return pool


def _outcome(call):
    """``("ok", bits)`` or ``("error", type, argument named first)``."""
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        m = re.match(r"\W*(\w+)", str(e))
        return ("error", type(e), m.group(1) if m else str(e))
    if isinstance(result, torch.Tensor):
        result = result.detach().float().numpy()
    return ("ok", np.asarray(result, np.float32).copy())


def _same(fast, general, what):
    assert fast[0] == general[0], f"{what}: fast path {fast[:2]}, general path {general[:2]}"
    if fast[0] == "ok":
        np.testing.assert_array_equal(fast[1], general[1], err_msg=what)
    else:
        assert fast[1:] == general[1:], what


# ------------------------------------------------------------- attention
TABLES = np.arange(9, dtype=np.int32).reshape(3, 3)
LENS = np.array([20, 5, 17], np.int64)
QSL = np.array([0, 1, 3, 7], np.int64)
NQ = 7


def _q32(seed=3):
    return np.random.default_rng(seed).standard_normal((NQ, HEADS, DIM)).astype(np.float32)


def _misaligned(shape, dtype=np.float32):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    a = np.zeros(n + 1, np.uint8)[1:].view(dtype).reshape(shape)
    assert not a.flags.aligned
    return a


def _neg_view(t):
    return torch._neg_view(t) if hasattr(torch, "_neg_view") else -t


Q_KINDS = {
    "float32": lambda: _q32(),
    "float16": lambda: _q32().astype(np.float16),
    "float64": lambda: _q32().astype(np.float64),
    "int32": lambda: _q32().astype(np.int32),
    "uint16": lambda: _q32().view(np.uint16)[..., :DIM],
    "non-contiguous": lambda: np.repeat(_q32(), 2, axis=2)[:, :, ::2],
    "fortran": lambda: np.asfortranarray(_q32()),
    "read-only": lambda: (lambda a: (a.setflags(write=False), a)[1])(_q32()),
    "byte-swapped": lambda: _q32().astype(">f4"),
    "misaligned": lambda: (lambda m: (m.__setitem__(..., _q32()), m)[1])(
        _misaligned((NQ, HEADS, DIM))),
    "2-D": lambda: _q32().reshape(NQ, HEADS * DIM),
    "4-D": lambda: _q32()[None],
    "tokens+1": lambda: np.zeros((NQ + 1, HEADS, DIM), np.float32),
    "heads=3": lambda: np.zeros((NQ, 3, DIM), np.float32),
    "heads=2": lambda: _q32()[:, :2].copy(),
    "head_dim+1": lambda: np.zeros((NQ, HEADS, DIM + 1), np.float32),
    "list": lambda: _q32().tolist(),
    "None": lambda: None,
    "torch float32": lambda: torch.from_numpy(_q32()),
    "torch float16": lambda: torch.from_numpy(_q32()).half(),
    "torch bfloat16": lambda: torch.from_numpy(_q32()).bfloat16(),
    "torch float64": lambda: torch.from_numpy(_q32()).double(),
    "torch requires_grad": lambda: torch.from_numpy(_q32()).requires_grad_(),
    "torch non-contiguous": lambda: torch.from_numpy(np.repeat(_q32(), 2, axis=2))[:, :, ::2],
    "torch neg view": lambda: _neg_view(torch.from_numpy(_q32())),
    "torch wrong shape": lambda: torch.zeros(NQ, HEADS, DIM + 1),
}

LAYER_KINDS = {"0": 0, "last": LAYERS - 1, "numpy int": np.int64(1), "bool": True,
               "-1": -1, "num_layers": LAYERS, "float": 1.0, "str": "0", "huge": 2 ** 70}


def _out_kinds():
    return {
        "None": lambda q: None,
        "float32": lambda q: np.zeros((NQ, HEADS, DIM), np.float32),
        "float16": lambda q: np.zeros((NQ, HEADS, DIM), np.float16),
        "float64": lambda q: np.zeros((NQ, HEADS, DIM), np.float64),
        "read-only": lambda q: (lambda a: (a.setflags(write=False), a)[1])(
            np.zeros((NQ, HEADS, DIM), np.float32)),
        "wrong shape": lambda q: np.zeros((NQ, HEADS, DIM + 1), np.float32),
        "non-contiguous": lambda q: np.zeros((NQ, HEADS, 2 * DIM), np.float32)[:, :, ::2],
        "byte-swapped": lambda q: np.zeros((NQ, HEADS, DIM), ">f4"),
        "misaligned": lambda q: _misaligned((NQ, HEADS, DIM)),
        "is q": lambda q: q,
        "torch float32": lambda q: torch.zeros(NQ, HEADS, DIM),
        "torch bfloat16": lambda q: torch.zeros(NQ, HEADS, DIM, dtype=torch.bfloat16),
        "torch requires_grad": lambda q: torch.zeros(NQ, HEADS, DIM, requires_grad=True),
        "torch neg view": lambda q: _neg_view(torch.zeros(NQ, HEADS, DIM)),
        "list": lambda q: np.zeros((NQ, HEADS, DIM), np.float32).tolist(),
    }


def _compare_run(pool, q_make, layer, out_make, what):
    fast_plan = kvcore.AttentionPlan(pool, TABLES, LENS, QSL)
    fast_plan.run(_q32(), 0)        # binds the fast path (the plan's first run)
    general_plan = kvcore.AttentionPlan(pool, TABLES, LENS, QSL)

    def call(plan, general):
        q = q_make()
        out = out_make(q)
        run = (lambda: plan._run(q, layer, out)) if general else (lambda: plan.run(q, layer, out))
        result = _outcome(run)
        if result[0] == "ok" and out is not None and not isinstance(out, list):
            # the out= given is the result, and holds it
            written = out.detach().float().numpy() if isinstance(out, torch.Tensor) else out
            np.testing.assert_array_equal(np.asarray(written, np.float32), result[1],
                                          err_msg=what)
        return result

    _same(call(fast_plan, False), call(general_plan, True), what)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8"])
@pytest.mark.parametrize("q_kind", sorted(Q_KINDS))
def test_attention_run_accepts_what_the_general_run_accepts_q(dtype, q_kind):
    _compare_run(_pool(dtype), Q_KINDS[q_kind], 1, lambda q: None, f"q {q_kind}")


@pytest.mark.parametrize("layer_kind", sorted(LAYER_KINDS))
def test_attention_run_accepts_what_the_general_run_accepts_layer(layer_kind):
    _compare_run(_pool(), Q_KINDS["float32"], LAYER_KINDS[layer_kind], lambda q: None,
                 f"layer {layer_kind}")


@pytest.mark.parametrize("q_kind", ["float32", "torch float32", "torch bfloat16", "float16"])
@pytest.mark.parametrize("out_kind", sorted(_out_kinds()))
def test_attention_run_accepts_what_the_general_run_accepts_out(q_kind, out_kind):
    pool = _pool()
    _compare_run(pool, Q_KINDS[q_kind], 2, _out_kinds()[out_kind],
                 f"q {q_kind}, out {out_kind}")


def test_attention_out_over_the_pool_storage_is_refused_on_both_paths():
    pool = _pool("float32")
    view = pool.key_cache(0).reshape(-1)[:NQ * HEADS * DIM].reshape(NQ, HEADS, DIM)
    _compare_run(pool, Q_KINDS["float32"], 0, lambda q: view, "out over the storage")


@pytest.mark.parametrize("bad", ["negative", "too large", "unread", "window-unread"])
def test_one_block_table_rule_for_every_attention_entry(bad):
    """paged_attention and AttentionPlan refuse (or take) the same tables,
    with the same error: one native check states the rule."""
    pool = _pool()
    tables = TABLES.copy()
    kw = {}
    if bad == "negative":
        tables[1, 0] = -1
    elif bad == "too large":
        tables[2, 2] = NB
    elif bad == "unread":
        tables[1, 2] = NB + 5          # sequence 1 holds 5 positions: block 2 is never read
    else:
        tables[0, 0] = -7              # a window of 3 over 20 positions reads blocks 2.. only
        kw = dict(sliding_window=3)
    q = _q32()
    plan = _outcome(lambda: kvcore.AttentionPlan(pool, tables, LENS, QSL, **kw).run(q, 0))
    call = _outcome(lambda: kvcore.paged_attention(q, pool, 0, tables, LENS, QSL, **kw))
    _same(plan, call, bad)
    assert plan[0] == ("ok" if bad in ("unread", "window-unread") else "error")
    if plan[0] == "error":
        assert plan[1:] == (IndexError, "block_tables")


# ------------------------------------------------------------- writes
def _kv32(n=3, seed=5):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, KVH, DIM)).astype(np.float32),
            rng.standard_normal((n, KVH, DIM)).astype(np.float32))


def _both(f):
    return lambda: tuple(f(a) for a in _kv32())


KV_KINDS = {
    "float32": _both(lambda a: a),
    "float16": _both(lambda a: a.astype(np.float16)),
    "float64": _both(lambda a: a.astype(np.float64)),
    "int32": _both(lambda a: a.astype(np.int32)),
    "non-contiguous": _both(lambda a: np.repeat(a, 2, axis=2)[:, :, ::2]),
    "read-only": _both(lambda a: (a.setflags(write=False), a)[1]),
    "byte-swapped": _both(lambda a: a.astype(">f4")),
    "misaligned": _both(lambda a: (lambda m: (m.__setitem__(..., a), m)[1])(
        _misaligned(a.shape))),
    "2-D": _both(lambda a: a.reshape(a.shape[0], -1)),
    "heads+1": _both(lambda a: np.zeros((a.shape[0], KVH + 1, DIM), np.float32)),
    "head_dim+1": _both(lambda a: np.zeros((a.shape[0], KVH, DIM + 1), np.float32)),
    "k and v differ in n": lambda: (_kv32(3)[0], _kv32(2)[1]),
    "k float32, v float16": lambda: (_kv32()[0], _kv32()[1].astype(np.float16)),
    "list": _both(lambda a: a.tolist()),
    "None": lambda: (None, None),
    "torch float32": _both(torch.from_numpy),
    "torch float16": _both(lambda a: torch.from_numpy(a).half()),
    "torch bfloat16": _both(lambda a: torch.from_numpy(a).bfloat16()),
    "torch requires_grad": _both(lambda a: torch.from_numpy(a).requires_grad_()),
    "torch non-contiguous": _both(lambda a: torch.from_numpy(np.repeat(a, 2, axis=2))[:, :, ::2]),
    "torch neg view": _both(lambda a: _neg_view(torch.from_numpy(a))),
}


def _write_outcome(dtype, layer, kv_make, fast):
    """Write one step's K/V through ``PagedKVCache.append`` (fast) or
    ``BlockPool.write`` of the same slots (general); the written rows."""
    pool = kvcore.BlockPool(NB, BS, LAYERS, KVH, DIM, dtype=dtype)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(11)))           # 2 blocks: room for the step's 3 positions
    start = seq.num_computed
    assert len(seq.block_table) * BS >= start + 3

    def run():
        k, v = kv_make()
        if fast:
            seq.append(layer, k, v)
        else:
            pool.write(layer, k, v, seq.slot_mapping(start, start + 3))
        return np.concatenate([np.asarray(a, np.float32) for a in
                               pool.gather(layer, seq.block_table, start, start + 3)])

    return _outcome(run)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("kv_kind", sorted(KV_KINDS))
def test_append_accepts_what_pool_write_accepts_kv(dtype, kv_kind):
    _same(_write_outcome(dtype, 1, KV_KINDS[kv_kind], True),
          _write_outcome(dtype, 1, KV_KINDS[kv_kind], False), f"k/v {kv_kind}")


@pytest.mark.parametrize("layer_kind", sorted(LAYER_KINDS))
def test_append_accepts_what_pool_write_accepts_layer(layer_kind):
    layer = LAYER_KINDS[layer_kind]
    _same(_write_outcome("float16", layer, KV_KINDS["float32"], True),
          _write_outcome("float16", layer, KV_KINDS["float32"], False), f"layer {layer_kind}")


# ------------------------------------------------------------- plan arrays
def test_one_owned_copy_of_the_plan_arrays():
    """A plan holds read-only copies of a step's index arrays, made once:
    owned_index_arrays is the one rule, and a backend plan built from what
    it returned holds those very arrays (no second copy)."""
    from kvcore.backends import CPU, owned_index_arrays
    tables, lens, qsl = TABLES.copy(), LENS.copy(), QSL.copy()
    owned = owned_index_arrays(tables, lens, qsl)
    for mine, theirs in zip(owned, (tables, lens, qsl)):
        assert not mine.flags.writeable and mine.flags.c_contiguous
        assert not np.shares_memory(mine, theirs)
        np.testing.assert_array_equal(mine, theirs)
    assert [a.dtype for a in owned] == [np.int32, np.int64, np.int64]
    assert all(a is b for a, b in zip(owned_index_arrays(*owned), owned))
    plan = CPU.attention_plan(*owned, num_heads=HEADS, num_kv_heads=KVH, head_dim=DIM,
                              block_size=BS, num_blocks=NB, kind=kvcore.dtypes.F16,
                              scale=0.25, sliding_window=0, soft_cap=0.0, num_threads=1)
    assert plan.block_tables is owned[0] and plan.seq_lens is owned[1] \
        and plan.query_start_loc is owned[2]
    # a caller's arrays are copied: changing them afterwards changes nothing
    plan = CPU.attention_plan(tables, lens, qsl, num_heads=HEADS, num_kv_heads=KVH,
                              head_dim=DIM, block_size=BS, num_blocks=NB,
                              kind=kvcore.dtypes.F16, scale=0.25, sliding_window=0,
                              soft_cap=0.0, num_threads=1)
    tables[:] = -1
    np.testing.assert_array_equal(plan.block_tables, TABLES)
    pool = _pool()
    want = kvcore.AttentionPlan(pool, TABLES, LENS, QSL).run(_q32(), 0)
    step = kvcore.AttentionPlan(pool, tables_again := TABLES.copy(), LENS, QSL)
    tables_again[:] = NB + 100
    np.testing.assert_array_equal(step.run(_q32(), 0), want)


# ------------------------------------------------------------- decode writes
def _rows(x):
    """transformers' decode layout ``(n, heads, 1, dim)`` as rows, the way
    kvcore.hf hands a step the writer declined to ``BlockPool.write``."""
    if isinstance(x, torch.Tensor) and x.ndim == 4 and x.shape[2] == 1:
        return x.detach().reshape(x.shape[0], x.shape[1], x.shape[3])
    return x


SLOT_KINDS = {
    "int64": lambda: np.array([3, 17, 40], np.int64),
    "skip": lambda: np.array([3, -1, 40], np.int64),
    "repeated": lambda: np.array([3, 40, 3], np.int64),
    "int32": lambda: np.array([3, 17, 40], np.int32),
    "uint64": lambda: np.array([3, 17, 40], np.uint64),
    "uint64 2**64-1": lambda: np.array([3, 2**64 - 1, 40], np.uint64),
    "float64": lambda: np.array([3.0, 17.0, 40.0]),
    "bool": lambda: np.array([True, False, True]),
    "read-only": lambda: (lambda a: (a.setflags(write=False), a)[1])(
        np.array([3, 17, 40], np.int64)),
    "non-contiguous": lambda: np.array([3, 0, 17, 0, 40, 0], np.int64)[::2],
    "byte-swapped": lambda: np.array([3, 17, 40], ">i8"),
    "misaligned": lambda: (lambda m: (m.__setitem__(..., [3, 17, 40]), m)[1])(
        _misaligned((3,), np.int64)),
    "out of range": lambda: np.array([3, 17, NB * BS], np.int64),
    "below -1": lambda: np.array([3, -2, 40], np.int64),
    "too few": lambda: np.array([3, 17], np.int64),
    "too many": lambda: np.array([3, 17, 40, 41], np.int64),
    "list": lambda: [3, 17, 40],
    "tuple": lambda: (3, 17, 40),
    "None": lambda: None,
    "2-D": lambda: np.array([[3, 17, 40]], np.int64),
    "0-D": lambda: np.array(3, np.int64),
    "torch int64": lambda: torch.tensor([3, 17, 40]),
    "torch int32": lambda: torch.tensor([3, 17, 40], dtype=torch.int32),
    "torch non-contiguous": lambda: torch.tensor([3, 0, 17, 0, 40, 0])[::2],
    "torch float32": lambda: torch.tensor([3.0, 17.0, 40.0]),
}


def _tv(make):
    """``make``'s rows in transformers' decode layout ``(n, heads, 1, dim)``."""
    return _both(lambda a: make(a[:, :, None]))


DECODE_KINDS = dict(KV_KINDS, **{
    "fortran": _both(np.asfortranarray),
    "k is v": lambda: (lambda k: (k, k))(_kv32()[0]),
    "n=0": _both(lambda a: a[:0]),
    "torch (n, heads, 1, dim)": _tv(torch.from_numpy),
    "torch (n, heads, 1, dim) float16": _tv(lambda a: torch.from_numpy(a).half()),
    "torch (n, heads, 1, dim) bfloat16": _tv(lambda a: torch.from_numpy(a).bfloat16()),
    "torch (n, heads, 1, dim) float64": _tv(lambda a: torch.from_numpy(a).double()),
    "torch (n, heads, 1, dim) requires_grad": _tv(
        lambda a: torch.from_numpy(a).requires_grad_()),
    "torch (n, heads, 1, dim) neg view": _tv(lambda a: _neg_view(torch.from_numpy(a))),
    "torch (n, heads, 1, dim) non-contiguous": _both(
        lambda a: torch.from_numpy(np.repeat(a[:, :, None], 2, axis=3))[:, :, :, ::2]),
    "torch (n, heads, 1, dim) transposed": _both(
        lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(1, 0, 2)))
        .transpose(0, 1)[:, :, None]),
    "torch (n, heads, 2, dim)": _both(lambda a: torch.from_numpy(np.repeat(a[:, :, None], 2, 2))),
    "torch (n, 1, heads, dim)": _both(lambda a: torch.from_numpy(a)[:, None]),
    "torch k (n, heads, 1, dim), v (n, heads, dim)": lambda: (
        torch.from_numpy(_kv32()[0])[:, :, None], torch.from_numpy(_kv32()[1])),
})

# every storage kind a pool has, fp8 with per-layer and per-kv-head scales
DECODE_POOLS = {
    "float32": {}, "float16": {}, "bfloat16": {}, "int8": {},
    "float8_e4m3fn": dict(kv_scales=[(0.5, 2.0), (1.5, 0.25), (1.0, 3.0)]),
    "float8_e5m2 per head": dict(kv_scales=[((0.5, 2.0), 1.0), (1.5, (0.25, 4.0)),
                                            (1.0, 3.0)]),
}


def _decode_pool(dtype):
    return kvcore.BlockPool(NB, BS, LAYERS, KVH, DIM, dtype=dtype.split()[0],
                            **DECODE_POOLS[dtype])


def _decode_outcome(dtype, layer, kv_make, slots_make, fast, pool_view=None):
    """One decode step's K/V written by the pool's writer (``fast``; what it
    declines then goes to ``BlockPool.write``, as kvcore.hf does) or by
    ``BlockPool.write`` alone; the whole layer read back as float32 (int8
    and fp8 scales applied: a scale written wrong shows).  ``pool_view``:
    the slots / k / v are views of the pool's own memory, made from it."""
    pool = _decode_pool(dtype)
    writer = pool._writer     # what kvcore.hf writes a decode step through
    assert writer is not None

    def run():
        if pool_view is not None:
            k, v, slots = pool_view(pool)
        else:
            (k, v), slots = kv_make(), slots_make()
        if not (fast and writer.write_slots(layer, k, v, slots)):
            pool.write(layer, _rows(k), _rows(v), slots)
        table = np.arange(NB, dtype=np.int32)
        return np.concatenate([np.asarray(a) for a in pool.gather(
            layer if type(layer) is int else 0, table, 0, NB * BS, dtype="float32")])

    return _outcome(run)


@pytest.mark.parametrize("dtype", sorted(DECODE_POOLS))
@pytest.mark.parametrize("kv_kind", sorted(DECODE_KINDS))
def test_decode_writer_accepts_what_pool_write_accepts_kv(dtype, kv_kind):
    _same(_decode_outcome(dtype, 1, DECODE_KINDS[kv_kind], SLOT_KINDS["int64"], True),
          _decode_outcome(dtype, 1, DECODE_KINDS[kv_kind], SLOT_KINDS["int64"], False),
          f"k/v {kv_kind}")


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("slot_kind", sorted(SLOT_KINDS))
def test_decode_writer_accepts_what_pool_write_accepts_slots(dtype, slot_kind):
    _same(_decode_outcome(dtype, 1, KV_KINDS["float32"], SLOT_KINDS[slot_kind], True),
          _decode_outcome(dtype, 1, KV_KINDS["float32"], SLOT_KINDS[slot_kind], False),
          f"slots {slot_kind}")


@pytest.mark.parametrize("layer_kind", sorted(LAYER_KINDS))
def test_decode_writer_accepts_what_pool_write_accepts_layer(layer_kind):
    layer = LAYER_KINDS[layer_kind]
    _same(_decode_outcome("float16", layer, KV_KINDS["float32"], SLOT_KINDS["int64"], True),
          _decode_outcome("float16", layer, KV_KINDS["float32"], SLOT_KINDS["int64"], False),
          f"layer {layer_kind}")


def _storage_rows(pool, layer, plane):
    """Three ``(heads, dim)`` rows of ``pool``'s ``layer`` K (0) or V (1)
    plane, as stored (a view: block 5, the first three positions)."""
    return (pool.key_cache if plane == 0 else pool.value_cache)(layer)[5, :, :3].transpose(1, 0, 2)


POOL_VIEWS = {
    # k / v rows that are the pool's own storage: of the layer written
    # (elsewhere in it, or the very slots written) and of another layer
    "k of the layer written, v of another": lambda pool: (
        _storage_rows(pool, 0, 0), _storage_rows(pool, 2, 1), np.array([3, 17, 40], np.int64)),
    "k and v read from the slots written": lambda pool: (
        _storage_rows(pool, 0, 0), _storage_rows(pool, 0, 1),
        np.array([40, 41, 42], np.int64)),
    # slots whose memory is the storage (or the int8 scale planes) written
    "slots in the storage": lambda pool: (
        *_kv32(), _zeroed(pool.storage.view(np.uint8))),
    "slots in the scale planes": lambda pool: (
        *_kv32(), _zeroed((pool.scales if pool.scales is not None
                           else pool.storage).view(np.uint8))),
}


def _zeroed(plane_bytes):
    """Three int64 slots (0, 0, 0) living in the first bytes of ``plane_bytes``."""
    head = plane_bytes.reshape(-1)[:24]
    head[:] = 0
    return head.view(np.int64)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8"])
@pytest.mark.parametrize("view", sorted(POOL_VIEWS))
def test_decode_writer_accepts_views_of_the_pool_as_pool_write_does(dtype, view):
    """Inputs that are the pool's own memory: k / v rows of its storage and
    slots living in the storage or the scale planes the write rewrites.  The
    writer declines what it cannot read safely; the result is the general
    path's (the inputs read as they were when the call began)."""
    # (layer 0: the first bytes of the storage and of the scale planes,
    # where the slots of the last two views live, are its own)
    fast = _decode_outcome(dtype, 0, None, None, True, _filled(POOL_VIEWS[view]))
    _same(fast, _decode_outcome(dtype, 0, None, None, False, _filled(POOL_VIEWS[view])), view)
    if view.startswith("slots"):
        # the slots as they were, (0, 0, 0): slot 0 holds the last row
        assert fast[0] == "ok"
        k_last = _kv32()[0][2]
        tol = 0.02 * np.abs(k_last).max() if dtype == "int8" else 1e-3
        np.testing.assert_allclose(fast[1][:KVH, 0], k_last, atol=tol, rtol=0)


def _filled(view):
    """``view`` on a pool whose layers hold data first (written through
    ``BlockPool.write``, the same for both paths)."""
    def make(pool):
        rng = np.random.default_rng(21)
        for layer in range(LAYERS):
            k = rng.standard_normal((NB * BS, KVH, DIM)).astype(np.float32)
            pool.write(layer, k, -k, np.arange(NB * BS))
        return view(pool)
    return make
