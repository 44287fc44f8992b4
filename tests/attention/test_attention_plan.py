"""kvcore.AttentionPlan (plan once per step, run per layer) and attention as
a Backend op: one test body over the float64 reference, the CPU backend at
every SIMD level this CPU has, and the CUDA backend under host emulation."""
import threading
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore import dtypes
from kvcore.backends import CPU, Backend, Codec
from kvcore.backends.cpu import _attention
from kvcore.backends.base import paged_attention_reference

try:
    from _helpers import bad_out_cases
    from test_cuda_host_emulation import DevArray, _get, _put, emu_lib, emulated_cuda  # noqa: F401
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import bad_out_cases
    from .test_cuda_host_emulation import DevArray, _get, _put, emu_lib, emulated_cuda  # noqa: F401

TOL = 1e-5
LEVELS = _attention.available_simd_levels()


def rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _alias(array, shape):
    """A float32 view of the first bytes of ``array`` (C-contiguous)."""
    n = int(np.prod(shape)) * 4
    return array.reshape(-1).view(np.uint8)[:n].view(np.float32).reshape(shape)


def _pool(dtype="float16", layers=3, num_blocks=20, block_size=8, kv_heads=2, head_dim=64,
          seed=0, device="cpu"):
    pool = kvcore.BlockPool(num_blocks, block_size, layers, kv_heads, head_dim, dtype=dtype,
                            device=device)
    rng = np.random.default_rng(seed)
    n = num_blocks * block_size
    put = _put if device != "cpu" else (lambda a: a)
    for layer in range(layers):
        k = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        pool.write(layer, put(k), put(v), np.arange(n))
    return pool


def _batch(seed=1, heads=8, head_dim=64):
    """A mixed batch: a decode, a chunk of 5 over cached pages, a prefill of 9."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(20)
    tables = np.array([ids[0:6], ids[6:12], ids[12:18]], np.int32)
    lens = np.array([41, 30, 9], np.int64)
    qsl = np.array([0, 1, 6, 15], np.int64)
    q = rng.standard_normal((15, heads, head_dim)).astype(np.float32)
    return tables, lens, qsl, q


# ------------------------------------------------------------------ plan / run
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("kw", [{}, dict(sliding_window=7), dict(logits_soft_cap=4.0)])
def test_plan_runs_every_layer_as_paged_attention(dtype, kw):
    pool = _pool(dtype)
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, **kw)
    assert plan.num_query_tokens == 15 and plan.num_layers == 3
    out = np.empty(q.shape, np.float32)
    for layer in range(3):
        want = kvcore.paged_attention(q, pool, layer, tables, lens, qsl, **kw)
        np.testing.assert_array_equal(plan.run(q, layer), want)
        assert plan.run(q, layer, out=out) is out
        np.testing.assert_array_equal(out, want)
        # the general path (a strided q, a float16 out) gives the same values
        strided = np.repeat(q, 2, axis=2)[:, :, ::2]
        out16 = np.zeros(q.shape, np.float16)
        assert plan.run(strided, layer, out=out16) is out16
        np.testing.assert_array_equal(out16, want.astype(np.float16))


def test_plan_snapshots_its_index_arguments():
    pool = _pool()
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_heads=8)
    want = kvcore.paged_attention(q, pool, 1, tables, lens, qsl)
    tables[:] = 10**6          # would be refused (and read out of bounds) if used
    lens[:] = 0
    qsl[:] = 0
    np.testing.assert_array_equal(plan.run(q, 1), want)
    del tables, lens, qsl
    np.testing.assert_array_equal(plan.run(q, 1), want)


def test_plan_checks_every_read_block_once():
    pool = _pool()
    tables, lens, qsl, q = _batch()
    for s in range(3):
        for b in range(-(-int(lens[s]) // 8)):
            t = tables.copy()
            t[s, b] = 10**6
            with pytest.raises(IndexError, match=rf"block_tables\[{s}, {b}\] must be a block id "
                                                 r"in 0\.\.19"):
                kvcore.AttentionPlan(pool, t, lens, qsl)
    with pytest.raises(ValueError, match=r"query_start_loc must be non-decreasing"):
        kvcore.AttentionPlan(pool, tables, lens, [0, 6, 1, 15])
    with pytest.raises(ValueError, match=r"scale must be 0 or"):
        kvcore.AttentionPlan(pool, tables, lens, qsl, scale=1e39)
    with pytest.raises(ValueError, match=r"num_threads must be in 1..1024"):
        kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=0)
    with pytest.raises(ValueError, match=r"num_heads must be a positive multiple of the pool's "
                                         r"num_kv_heads=2 up to 65536, got 3"):
        kvcore.AttentionPlan(pool, tables, lens, qsl, num_heads=3)
    with pytest.raises(TypeError, match=r"pool_or_planes must be a kvcore.BlockPool or a pair"):
        kvcore.AttentionPlan("pool", tables, lens, qsl)


RUN_BAD = [
    (dict(q=np.zeros((14, 8, 64), np.float32)), ValueError,
     r"q.shape\[0\] must be the plan's num_query_tokens=15, got 14"),
    (dict(q=np.zeros((15, 8, 32), np.float32)), ValueError, r"head_dim=64, got 32"),
    (dict(q=np.zeros((15, 7, 64), np.float32)), ValueError, r"multiple of the pool's "
                                                           r"num_kv_heads=2 up to 65536, got 7"),
    (dict(q=np.zeros((15, 8, 64), np.float64)), TypeError, r"q must be float32.*got float64"),
    (dict(layer=3), IndexError, r"layer must be in 0..2, got 3"),
    (dict(layer=-1), IndexError, r"layer must be in 0..2, got -1"),
    (dict(layer=1.0), TypeError, r"layer must be an integer"),
    (dict(out="storage"), ValueError, r"out must not overlap the KV cache's storage"),
] + bad_out_cases(15)


@pytest.mark.parametrize("change,exc,pattern", RUN_BAD, ids=[str(i) for i in range(len(RUN_BAD))])
def test_run_checks_q_layer_and_out(change, exc, pattern):
    pool = _pool()
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_heads=8)
    args = dict(q=q, layer=0, out=None)
    args.update(change)
    if isinstance(args["out"], str) and args["out"] == "read-only":
        args["out"] = np.zeros(q.shape, np.float32)
        args["out"].flags.writeable = False
    elif isinstance(args["out"], str):
        args["out"] = _alias(pool.storage, q.shape)
    before = pool.storage.copy()
    with pytest.raises(exc, match=pattern):
        plan.run(**args)
    np.testing.assert_array_equal(pool.storage, before)
    # the plan still runs after a refused call
    np.testing.assert_array_equal(plan.run(q, 0), kvcore.paged_attention(q, pool, 0, tables,
                                                                         lens, qsl))


def test_run_out_may_not_overlap_the_scales_or_q():
    pool = _pool("int8")
    tables, lens, qsl, q = _batch()
    q = np.ascontiguousarray(q[:, :2])              # as many floats as the scale planes
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_heads=2)
    before = pool.scales.copy()
    for scales, why in ((pool.scales.reshape(q.shape), "not overlap the KV cache's storage "
                                                        "or scales"),   # the fast path's check
                        (pool.scales.reshape(q.shape)[:, ::-1],    # the general path's
                         "not overlap the KV cache's storage or scales"),
                        (np.lib.stride_tricks.as_strided(pool.key_scales(1), q.shape, (0, 0, 4)),
                         "have its own memory for every element")):    # (and its rows overlap)
        with pytest.raises(ValueError, match=f"out must {why}"):
            plan.run(q, 2, out=scales)
    np.testing.assert_array_equal(pool.scales, before)
    # out = q itself: computed into a temporary, then copied
    want = plan.run(q, 2).copy()
    qq = q.copy()
    assert plan.run(qq, 2, out=qq) is qq
    np.testing.assert_array_equal(qq, want)


def test_run_with_out_allocates_nothing():
    pool = _pool("float16")
    tables, lens, qsl, _ = _batch(heads=32)
    q = np.random.default_rng(2).standard_normal((15, 32, 64)).astype(np.float32)
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_heads=32)
    out = np.empty(q.shape, np.float32)
    plan.run(q, 0, out=out)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for layer in range(3):
            plan.run(q, layer, out=out)
        peak = tracemalloc.get_traced_memory()[1] - base
        plan.run(q, 0)                                    # allocates its result
        peak_alloc = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 1024, peak
    assert peak_alloc >= q.nbytes                          # (the measure can fail)


def test_num_heads_is_planned_at_the_first_run_and_per_head_count():
    pool = _pool()
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl)
    q16 = np.concatenate([q, q[:, ::-1]], axis=1)
    for qq in (q, q16, q):
        np.testing.assert_array_equal(plan.run(qq, 2),
                                      kvcore.paged_attention(qq, pool, 2, tables, lens, qsl))


def test_query_dtypes_and_torch_tensors():
    torch = pytest.importorskip("torch")
    pool = _pool("bfloat16")
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, torch.from_numpy(tables), torch.from_numpy(lens),
                                torch.from_numpy(qsl))
    qb = q.astype(ml_dtypes.bfloat16)
    want = kvcore.paged_attention(qb, pool, 1, tables, lens, qsl)
    np.testing.assert_array_equal(plan.run(qb, 1), want)
    tq = torch.from_numpy(q).to(torch.bfloat16)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    assert plan.run(tq, 1, out=out) is out
    np.testing.assert_array_equal(out.float().numpy(),
                                  want.astype(ml_dtypes.bfloat16).astype(np.float32))


def _peak_bytes(run):
    """The most bytes Python's allocators held during ``run()`` beyond
    what they held before it."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _strided(torch, t):
    """The values of ``t`` in a tensor that is not C-contiguous (the fast
    path takes C-contiguous ones only: this one goes the general path)."""
    wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)[..., ::2]
    wide.copy_(t)
    return wide


@pytest.mark.parametrize("pool_dtype", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("q_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", [None, "float32", "float16", "bfloat16"])
def test_torch_tensors_run_fast_with_the_general_paths_bits(torch, pool_dtype, q_dtype,
                                                           out_dtype):
    """C-contiguous CPU torch q and out (float32, float16, bfloat16) run on
    the plan's fast path (16-bit ones read and written by the kernels) and
    give the bits the general path gives for the same values."""
    pool = _pool(pool_dtype)
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl)
    tq = torch.from_numpy(q).to(getattr(torch, q_dtype))
    if out_dtype is None:
        got = plan.run(tq, 1)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, plan.run(_strided(torch, tq), 1))
        return
    odt = getattr(torch, out_dtype)
    out = torch.full(q.shape, float("nan"), dtype=odt)
    assert plan.run(tq, 1, out=out) is out
    general = _strided(torch, torch.zeros(q.shape, dtype=odt))
    plan.run(_strided(torch, tq), 1, out=general)
    assert torch.equal(out, general)
    want = kvcore.paged_attention(q, pool, 1, tables, lens, qsl) if q_dtype == "float32" else None
    if want is not None:
        np.testing.assert_array_equal(out.float().numpy(), torch.from_numpy(want).to(odt).float())
    # the kernels read and write the tensors in place: nothing allocated
    peak = _peak_bytes(lambda: plan.run(tq, 2, out=out))
    assert peak < 1024, peak
    plan.run(_strided(torch, tq), 2, out=general)
    assert torch.equal(out, general)



@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("io", ["float16", "bfloat16"])
def test_16_bit_q_and_out_read_and_written_by_every_route(torch, level, io):
    """The kernels read a 16-bit torch q and write a 16-bit out themselves,
    a row at a time: the bits of the general path (q widened, the float32
    result narrowed) on every route a row can take: a long decode split over
    threads and merged, a prefill of tile-kernel items, sinks, a stored
    inf (the amx level's tiles give the item back to the vector kernels)."""
    from _helpers import simd_level
    dt = getattr(torch, io)
    bs, kvh, d, heads = 16, 2, 64, 8
    lens = np.array([3000, 80, 1], np.int64)
    nblk = [int(-(-n // bs)) for n in lens]
    pool = kvcore.BlockPool(sum(nblk) + 2, bs, 1, kvh, d, dtype="bfloat16",
                            enable_prefix_caching=False)
    rng = np.random.default_rng(7)
    n = (sum(nblk) + 2) * bs
    k = rng.standard_normal((n, kvh, d)).astype(np.float32)
    v = rng.standard_normal((n, kvh, d)).astype(np.float32)
    ids = rng.permutation(sum(nblk) + 2)[:sum(nblk)].astype(np.int32)
    tables = np.full((3, max(nblk)), 0, np.int32)
    at = 0
    for s, m in enumerate(nblk):
        tables[s, :m] = ids[at:at + m]
        at += m
    v[int(tables[1, 2]) * bs + 5, 1, 3] = np.inf      # a value the prefill's rows see
    pool.write(0, k, v, np.arange(n))
    qsl = np.array([0, 1, 65, 66], np.int64)           # a decode, a prefill of 64, a decode
    q = torch.from_numpy(rng.standard_normal((66, heads, d)).astype(np.float32)).to(dt)
    sinks = rng.standard_normal(heads).astype(np.float32)
    with simd_level(level):
        for threads in (1, 2):
            for kw in ({}, {"sinks": sinks}):
                plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=threads, **kw)
                out = torch.full(q.shape, float("nan"), dtype=dt)
                assert plan.run(q, 0, out=out) is out
                general = _strided(torch, torch.zeros(q.shape, dtype=dt))
                plan.run(_strided(torch, q), 0, out=general)
                assert torch.equal(out, general), (threads, kw)
                wide = plan.run(q, 0)                       # 16-bit q, float32 out
                np.testing.assert_array_equal(wide, plan.run(_strided(torch, q), 0))
                assert torch.equal(torch.from_numpy(wide).to(dt), out)
                assert torch.isinf(out[1:65]).any() or torch.isnan(out[1:65]).any()
                assert torch.isfinite(out[0]).all() and torch.isfinite(out[65]).all()


@pytest.mark.parametrize("io", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_numpy_q_and_out_go_to_the_kernels_as_they_are(io):
    """NumPy float16 / bfloat16 q and out on the general path: the CPU
    kernels read and write them themselves (no float32 copy of q or of the
    result is made), with the bits of widening q and narrowing a float32
    result; a strided q and out still give them."""
    assert CPU.attention_io_kinds(None) == ({dtypes.F32, dtypes.F16, dtypes.BF16},) * 2
    pool = _pool("bfloat16", num_blocks=40)
    tables, lens, qsl, q = _batch()
    q = np.repeat(q, 20, axis=0)[:15]
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl)
    q16 = q.astype(io)
    want = plan.run(q16.astype(np.float32), 1).astype(io)
    out = np.full(q.shape, np.nan, io)
    plan.run(q16, 1, out=out)
    assert out.tobytes() == want.tobytes()
    wide = plan.run(q16, 1)
    assert wide.dtype == np.float32 and wide.astype(io).tobytes() == want.tobytes()
    strided_q = np.zeros(q.shape[:-1] + (2 * q.shape[-1],), io)[..., ::2]
    strided_q[...] = q16
    strided_out = np.zeros(q.shape[:-1] + (2 * q.shape[-1],), io)[..., ::2]
    plan.run(strided_q, 1, out=strided_out)
    assert np.ascontiguousarray(strided_out).tobytes() == want.tobytes()
    peak = _peak_bytes(lambda: plan.run(q16, 2, out=out))
    # float16: nothing allocated.  (An ml_dtypes bfloat16 q and out are
    # copied, as they are, before anything else reads them, as every
    # argument whose conversion may run code is: _arrays.private_inputs; a
    # float32 copy of either would add q.nbytes more.)
    limit = 1024 if io is np.float16 else 2 * q16.nbytes + 1024
    assert peak < limit, peak

def test_torch_out_refusals_hold_on_the_fast_path(torch):
    """What the general path refuses of a torch ``out`` it still refuses
    when the tensor is one the fast path could take: one that requires grad,
    one over the pool's storage; an ``out`` that is ``q`` itself is computed
    aside first."""
    pool = _pool("float32")
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl)
    want = plan.run(q, 0)
    tq = torch.from_numpy(q.copy())
    with pytest.raises(TypeError, match="requires grad"):
        plan.run(tq, 0, out=torch.zeros(q.shape, requires_grad=True))
    before = pool.storage.copy()
    over = torch.from_numpy(pool.storage.reshape(-1)[:q.size].reshape(q.shape))
    with pytest.raises(ValueError, match="out must not overlap"):
        plan.run(tq, 0, out=over)
    np.testing.assert_array_equal(pool.storage, before)
    assert plan.run(tq, 0, out=tq) is tq
    np.testing.assert_array_equal(tq.numpy(), want)
    bq = torch.from_numpy(q).to(torch.bfloat16)
    aside = bq.clone()
    plan.run(bq, 0, out=bq)                       # 16-bit, in place
    assert torch.equal(bq, plan.run(aside, 0, out=torch.empty_like(aside)))


def test_thread_counts_give_the_same_bits():
    pool = _pool("float16", num_blocks=80, block_size=16)
    rng = np.random.default_rng(7)
    tables = rng.permutation(80)[:78].reshape(2, 39).astype(np.int32)
    lens = np.array([620, 333], np.int64)
    qsl = np.array([0, 1, 41], np.int64)
    q = rng.standard_normal((41, 8, 64)).astype(np.float32)
    runs = [kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=n).run(q, 1)
            for n in (1, 2, 3, 8)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


@pytest.mark.parametrize("dtype, kw", [("int8", {}), ("float16", dict(sliding_window=40))])
def test_many_decode_items_per_thread_give_the_same_bits_at_any_thread_count(dtype, kw):
    """More than two items per thread (a thread then claims its next item
    early and prefetches its first tile, int8 scales included), a prefill
    item and a sequence of no queries among them, long rows split: every
    SIMD level gives the 1-thread bits at 2, 3 and 8 threads, and the
    reference's values."""
    bs, kvh, d = 16, 2, 64
    rng = np.random.default_rng(21)
    lens = np.array([int(n) for n in rng.integers(1, 700, 30)] + [0, 25, 9], np.int64)
    nq = [1] * 30 + [0, 20, 1]                # a prefill of 20 queries near the end
    need = [-(-int(n) // bs) for n in lens]
    pool = _pool(dtype, layers=1, num_blocks=sum(need), block_size=bs, kv_heads=kvh,
                 head_dim=d, seed=5)
    ids, tables = rng.permutation(sum(need)), np.full((len(lens), max(need)), -1, np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
    qsl = np.concatenate([[0], np.cumsum(nq)]).astype(np.int64)
    q = rng.standard_normal((int(qsl[-1]), 4 * kvh, d)).astype(np.float32)
    want = paged_attention_reference(
        q, pool.key_cache(0), pool.value_cache(0), tables, lens, qsl, scale=0.125, kind=dtype,
        sliding_window=kw.get("sliding_window"),
        key_scales=pool.key_scales(0) if dtype == "int8" else None,
        value_scales=pool.value_scales(0) if dtype == "int8" else None)
    for level in LEVELS:
        previous = kvcore.set_simd_level(level)
        try:
            runs = [kvcore.AttentionPlan(pool, tables, lens, qsl, scale=0.125, num_threads=n,
                                         **kw).run(q, 0) for n in (1, 2, 3, 8)]
        finally:
            kvcore.set_simd_level(previous)
        for r in runs[1:]:
            np.testing.assert_array_equal(r, runs[0], err_msg=level)
        assert rel_err(runs[0], want) <= TOL, level


def test_a_second_concurrent_run_of_one_plan_raises():
    """One run at a time per plan: a run that finds another in progress
    raises RuntimeError (the plan's work buffers are its own); other plans
    run concurrently."""
    pool = _pool("float32", layers=1, num_blocks=256, block_size=16, kv_heads=1)
    tables = np.arange(256, dtype=np.int32)[None]
    lens = np.array([4096], np.int64)
    qsl = np.array([0, 1024], np.int64)
    q = np.random.default_rng(8).standard_normal((1024, 8, 64)).astype(np.float32)
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=1)
    other = kvcore.AttentionPlan(pool, tables, lens, qsl, num_threads=1)
    want = other.run(q, 0).copy()
    started, results, errors = threading.Event(), [], []

    def long_run():
        started.set()
        results.append(plan.run(q, 0))

    for attempt in range(5):      # the first run must be under way when the second starts
        results.clear()
        started.clear()
        t = threading.Thread(target=long_run)
        t0 = time.perf_counter()
        t.start()
        started.wait()
        time.sleep(0.005)
        try:
            plan.run(q, 0)
        except RuntimeError as e:
            errors.append(e)
        np.testing.assert_array_equal(other.run(q, 0), want)   # another plan runs meanwhile
        t.join()
        if errors:
            break
        assert time.perf_counter() - t0 < 60
    assert errors and "already running" in str(errors[0])
    np.testing.assert_array_equal(results[0], want)
    np.testing.assert_array_equal(plan.run(q, 0), want)        # and the plan runs again


# ------------------------------------------------------------------ planes
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_plan_over_an_engines_own_planes(dtype):
    rng = np.random.default_rng(9)
    k = rng.standard_normal((4, 20, 2, 8, 64)).astype(dtype)
    v = rng.standard_normal((4, 20, 2, 8, 64)).astype(dtype)
    tables, lens, qsl, q = _batch()
    kind = {np.float32: "float32", np.float16: "float16"}.get(dtype, "bfloat16")
    plan = kvcore.AttentionPlan((k, v), tables, lens, qsl, sliding_window=20)
    assert plan.num_layers == 4
    for layer in range(4):
        want = paged_attention_reference(q, k[layer], v[layer], tables, lens, qsl,
                                         sliding_window=20, kind=kind)
        assert rel_err(plan.run(q, layer), want) <= TOL
    # 4-D planes: one layer
    plan4 = kvcore.AttentionPlan((k[2], v[2]), tables, lens, qsl, sliding_window=20)
    np.testing.assert_array_equal(plan4.run(q, 0), plan.run(q, 2))
    with pytest.raises(IndexError, match=r"layer must be in 0..0, got 1"):
        plan4.run(q, 1)
    with pytest.raises(ValueError, match="out must not overlap the KV cache's storage"):
        plan.run(q, 0, out=_alias(k, q.shape))


def test_planes_are_checked():
    k = np.zeros((20, 2, 8, 64), np.float16)
    tables, lens, qsl, q = _batch()
    with pytest.raises(TypeError, match=r"key_cache has dtype int8: planes are read as float32, "
                                        r"float16 or bfloat16.*kvcore.BlockPool"):
        kvcore.AttentionPlan((k.view(np.int8)[..., :64], k.view(np.int8)[..., :64]), tables,
                             lens, qsl)
    with pytest.raises(TypeError, match="key_cache has dtype uint8"):
        kvcore.AttentionPlan((k.view(np.uint8), k.view(np.uint8)), tables, lens, qsl)
    with pytest.raises(ValueError, match="must have the same dtype, shape and strides"):
        kvcore.AttentionPlan((k, k.astype(np.float32)), tables, lens, qsl)
    with pytest.raises(ValueError, match=r"key_cache must be \(\[num_layers,\] num_blocks"):
        kvcore.AttentionPlan((k[0], k[0]), tables, lens, qsl)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        kvcore.AttentionPlan((k[..., ::2], k[..., ::2]), tables, lens, qsl)
    with pytest.raises(IndexError, match=r"block_tables\[0, \d\] must be a block id in 0\.\.9"):
        kvcore.AttentionPlan((k[:10], k[:10]), tables, lens, qsl)
    with pytest.raises(TypeError, match="pool_or_planes must be"):
        kvcore.AttentionPlan((k, k, k), tables, lens, qsl)


# ------------------------------------------------------------------ backends
def _backends_under_test(emulated=None):
    yield "reference", Backend(), None
    for level in LEVELS:
        yield f"cpu-{level}", CPU, level
    if emulated is not None:
        yield "cuda-emulated", emulated, None


def _backend_case(be, level, put, get, kind_name, kw):
    rng = np.random.default_rng(11)
    kind = dtypes.NAME_KIND[kind_name]
    nb, kvh, bs, d, heads = 12, 2, 8, 64, 8
    k32 = rng.standard_normal((nb, kvh, bs, d)).astype(np.float32)
    v32 = rng.standard_normal((nb, kvh, bs, d)).astype(np.float32)
    kbits = CPU.empty(k32.shape, dtypes.STORAGE[kind])
    vbits = CPU.empty(k32.shape, dtypes.STORAGE[kind])
    CPU.convert(k32, dtypes.F32, kbits, kind)
    CPU.convert(v32, dtypes.F32, vbits, kind)
    tables = np.array([[3, 0, 7, 4, 9], [1, 2, 5, 6, 8]], np.int32)
    lens = np.array([37, 11], np.int64)
    qsl = np.array([0, 3, 4], np.int64)
    q = rng.standard_normal((4, heads, d)).astype(np.float32)
    want = paged_attention_reference(q, kbits, vbits, tables, lens, qsl, kind=kind_name,
                                     sliding_window=kw.get("sliding_window"),
                                     logits_soft_cap=kw.get("soft_cap"))
    previous = kvcore.set_simd_level(level) if level else None
    try:
        plan = be.attention_plan(tables, lens, qsl, num_heads=heads, num_kv_heads=kvh,
                                 head_dim=d, block_size=bs, num_blocks=nb, kind=kind,
                                 scale=1 / 8, sliding_window=kw.get("sliding_window", 0),
                                 soft_cap=kw.get("soft_cap", 0.0), num_threads=2)
        tables[:] = -1          # the plan owns its copies
        out = put(np.zeros(q.shape, np.float32))
        be.attention_run(plan, put(q), out, put(kbits), put(vbits))
    finally:
        if level:
            kvcore.set_simd_level(previous)
    assert rel_err(get(out), want) <= TOL


CASES = [("float32", {}), ("float16", dict(sliding_window=9)), ("bfloat16", dict(soft_cap=3.0))]


@pytest.mark.parametrize("kind_name,kw", CASES)
def test_every_backend_against_the_reference(kind_name, kw):
    for name, be, level in _backends_under_test():
        _backend_case(be, level, lambda a: a, lambda a: a, kind_name, kw)


@pytest.mark.parametrize("kind_name,kw", CASES)
def test_the_cuda_backend_against_the_reference(emulated_cuda, kind_name, kw):
    _backend_case(emulated_cuda, None, _put, _get, kind_name, kw)


def test_the_reference_backend_is_the_oracle():
    """Backend.paged_attention (the reference) = paged_attention_reference
    rounded once to float32, fp8 and int8 scales included."""
    rng = np.random.default_rng(12)
    pool = _pool("int8", layers=1, num_blocks=12)
    tables, lens, qsl = np.array([[3, 0, 7, 4, 9]], np.int32), np.array([37]), np.array([0, 2])
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    out = np.zeros(q.shape, np.float32)
    Backend().paged_attention(q, out, pool.key_cache(0), pool.value_cache(0), dtypes.I8,
                              tables, lens, qsl, 0.125, 0, 0.0,
                              (Codec(dtypes.I8, 1.0, pool.key_scales(0)),
                               Codec(dtypes.I8, 1.0, pool.value_scales(0))))
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables, lens,
                                     qsl, scale=0.125, kind="int8",
                                     key_scales=pool.key_scales(0),
                                     value_scales=pool.value_scales(0))
    np.testing.assert_array_equal(out, want.astype(np.float32))
    got = kvcore.paged_attention(q, pool, 0, tables, lens, qsl, scale=0.125)
    assert rel_err(got, want) <= TOL


# ------------------------------------------------------------------ CUDA pools
def test_plan_on_a_cuda_pool(emulated_cuda):
    """The same plan API on a CUDA pool (host emulation): device index
    arrays are read once, at the plan; runs equal paged_attention."""
    pool = _pool("float16", layers=2, device="cuda")
    tables, lens, qsl, q = _batch()
    plan = kvcore.AttentionPlan(pool, _put(tables), _put(lens), _put(qsl), sliding_window=12)
    for layer in (0, 1):
        want = kvcore.paged_attention(_put(q), pool, layer, tables, lens, qsl,
                                      sliding_window=12)
        got = plan.run(_put(q), layer)
        assert isinstance(got, DevArray)
        np.testing.assert_array_equal(_get(got), _get(want))
    with pytest.raises(TypeError, match="q is a NumPy array in host memory"):
        plan.run(q, 0)
    with pytest.raises(ValueError, match="out must not overlap the KV cache's storage"):
        plan.run(_put(q), 0, out=pool.key_cache(0)[:15, 0, :8, :])


def test_the_fast_path_binds_only_layers_of_one_buffer():
    """_attention.Plan.bind measures the layer stride from layer 0 and the
    last layer: planes that are not views of one array are not bound (the
    layers between could lie anywhere), and run_layer then declines."""
    tables, lens, qsl, q = _batch()
    plan = CPU.attention_plan(tables, lens, qsl, num_heads=8, num_kv_heads=2, head_dim=64,
                              block_size=8, num_blocks=20, kind=dtypes.F16, scale=0.125,
                              sliding_window=0, soft_cap=0.0, num_threads=1)
    storage = np.zeros((3, 20, 2, 8, 64), np.float16)
    other = np.zeros((20, 2, 8, 64), np.float16)
    assert plan.bind(storage[0], storage[0], other, other, 3) is None
    assert plan.run_layer(q, 0) is NotImplemented
    run = plan.bind(storage[0], storage[0], storage[2], storage[2], 3)
    assert run is not None and run(q, 2).shape == q.shape
    assert run(q, 3) is NotImplemented and run(q.astype(np.float16), 0) is NotImplemented


# ------------------------------------------------------------ review regressions
def _small_pool():
    pool = kvcore.BlockPool(num_blocks=4, block_size=16, num_layers=2, num_kv_heads=1,
                            head_dim=8, dtype="float32")
    pool.storage[...] = np.random.default_rng(5).standard_normal(pool.storage.shape)
    return pool


@pytest.mark.parametrize("change", ["table_past_the_pool", "table_to_another_block",
                                    "seq_len_past_the_table"])
def test_changing_the_callers_arrays_after_planning_changes_nothing(change):
    # The C plan used to be built at the first run (or per new head count)
    # from the caller's own arrays, unchecked: an out-of-bounds read.
    pool = _small_pool()
    bt = np.array([[0, 1]], np.int32)
    sl = np.array([20], np.int64)
    q = np.random.default_rng(6).standard_normal((1, 2, 8)).astype(np.float32)
    want = kvcore.paged_attention(q, pool, 1, bt.copy(), sl.copy())
    plan = kvcore.AttentionPlan(pool, bt, sl)          # no num_heads: planned at the run
    if change == "table_past_the_pool":
        bt[0, 0] = 10**8
    elif change == "table_to_another_block":
        bt[0, 0] = 2
    else:
        sl[0] = 10**9
    np.testing.assert_array_equal(plan.run(q, 1), want)
    np.testing.assert_array_equal(plan.run(q[:, :1].copy(), 1),
                                  kvcore.paged_attention(q[:, :1].copy(), pool, 1,
                                                         [[0, 1]], [20]))


@pytest.mark.parametrize("which", ["q", "out"])
def test_byte_swapped_q_or_out_is_refused(which):
    pool = _small_pool()
    plan = kvcore.AttentionPlan(pool, [[0, 1]], [20], num_heads=2)
    q = np.ones((1, 2, 8), np.float32)
    out = np.zeros((1, 2, 8), np.float32)
    if which == "q":
        q = q.astype(">f4")
    else:
        out = out.astype(">f4")
    with pytest.raises(TypeError, match=which):
        plan.run(q, 0, out=out)
    with pytest.raises(TypeError, match=which):
        kvcore.paged_attention(q, pool, 0, [[0, 1]], [20], out=out)


def test_planes_with_no_layer_are_refused():
    k = np.zeros((0, 4, 1, 16, 8), np.float32)
    with pytest.raises(ValueError, match="key_cache"):
        kvcore.AttentionPlan((k, k.copy()), [[0]], [5])


def test_planes_with_more_layers_than_a_pool_may_hold_are_refused():
    k = np.zeros((2**16 + 1, 1, 1, 1, 1), np.float16)
    with pytest.raises(ValueError, match=r"key_cache must have at most 65536 layers \(its first "
                                         r"axis\), got 65537"):
        kvcore.AttentionPlan((k, k.copy()), [[0]], [1], num_heads=1)


def test_torch_planes_resized_after_planning_are_refused(torch):
    k = torch.randn(2, 4, 1, 16, 8)
    v = torch.randn(2, 4, 1, 16, 8)
    q = np.ones((1, 2, 8), np.float32)
    plan = kvcore.AttentionPlan((k, v), [[0, 1]], [20], num_heads=2)
    before = plan.run(q, 1)
    k.resize_(200, 4, 1, 16, 8)
    with pytest.raises(RuntimeError, match="key_cache's memory moved"):
        plan.run(q, 1)
    np.testing.assert_array_equal(
        kvcore.AttentionPlan((k[:2], v), [[0, 1]], [20]).run(q, 1).shape, before.shape)


CODEC_POOLS = {
    "float16": {}, "int8": {},
    "float8_e4m3fn": dict(kv_scales=[(0.5, 2.0), (1.5, 0.25)]),
    "float8_e5m2 per head": dict(kv_scales=[((0.5, 2.0), 1.0), (1.5, (0.25, 4.0))]),
}


@pytest.mark.parametrize("name", sorted(CODEC_POOLS))
def test_every_backend_reads_the_pages_through_the_layer_codecs(name):
    """Attention takes the layer's (key_codec, value_codec) like every data
    op: the CPU plan (its fast lane and its general run) and the reference
    backend, handed the same codecs, agree (fp8 per-kv-head scales
    included); codecs of another kind are refused."""
    rng = np.random.default_rng(40)
    pool = kvcore.BlockPool(16, 8, 2, 2, 64, dtype=name.split()[0], **CODEC_POOLS[name])
    n = 16 * 8
    for layer in range(2):
        pool.write(layer, rng.standard_normal((n, 2, 64)).astype(np.float32),
                   rng.standard_normal((n, 2, 64)).astype(np.float32), np.arange(n))
    tables = np.array([[3, 0, 7, 4], [9, 12, 1, 2]], np.int32)
    lens, qsl = np.array([30, 19]), np.array([0, 2, 3])
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    plan = kvcore.AttentionPlan(pool, tables, lens, qsl)
    codecs = pool._data.planes.codecs
    inner = CPU.attention_plan(tables, lens.astype(np.int64), qsl.astype(np.int64), num_heads=4,
                               num_kv_heads=2, head_dim=64, block_size=8, num_blocks=16,
                               kind=codecs[0][0].kind, scale=0.125, sliding_window=0,
                               soft_cap=0.0)
    for layer in range(2):
        fast = plan.run(q, layer)
        general = plan._run(q.astype(np.float16), layer, None)
        want = np.empty_like(q)
        Backend().attention_run(inner, q.astype(np.float16).astype(np.float32), want,
                                pool.key_cache(layer), pool.value_cache(layer), codecs[layer])
        np.testing.assert_allclose(general, want, rtol=0, atol=2e-5)
        np.testing.assert_allclose(fast, plan._run(q, layer, None), rtol=0, atol=0)
    wrong = (Codec(dtypes.F32), Codec(dtypes.F32))
    with pytest.raises(ValueError, match="codecs of kinds"):
        CPU.attention_run(inner, q, np.empty_like(q), pool.key_cache(0), pool.value_cache(0),
                          wrong)
    with pytest.raises(ValueError, match="codecs must be of the pages' kind"):
        Backend().attention_run(inner, q, np.empty_like(q), pool.key_cache(0),
                                pool.value_cache(0), wrong)
