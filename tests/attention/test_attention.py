"""kvcore.paged_attention, PagedKVCache.attention, KVCache.attention and the
thread count: the C kernels against the float64 NumPy reference on the
stored values, within 1e-5 relative (max abs error / max abs value).

Sizes are chosen so that the whole file runs in well under a minute on one
core: many small cases and a few large ones (long contexts with few
queries, many queries with short contexts)."""
import glob
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

try:
    from _helpers import aarch64_tools, bad_out_cases, functions_in, run_in_threads, simd_level
    from _simd_levels import simd_level_params
except ImportError:  # pragma: no cover - run as a package
    from ._helpers import aarch64_tools, bad_out_cases, functions_in, run_in_threads, simd_level
    from ._simd_levels import simd_level_params

import kvcore
from kvcore.backends.cpu import _attention
from kvcore.backends.base import paged_attention_reference

TOL = 1e-5
DTYPES = ["float32", "float16", "bfloat16"]
LEVELS = _attention.available_simd_levels()
# every level of this architecture: the ones the CPU lacks skip, naming the feature
LEVEL_PARAMS = simd_level_params(LEVELS, _attention.simd_level_names())


# ------------------------------------------------------------------ helpers
def rel_err(got, want):
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def fill_pool(pool, rng, layer=0, spread=1.0):
    """Random K/V in every block of ``layer`` (rounded to the storage dtype)."""
    shape = pool.key_cache(layer).shape
    for cache in (pool.key_cache(layer), pool.value_cache(layer)):
        x = (rng.standard_normal(shape) * spread).astype(np.float32)
        if pool.dtype == "bfloat16":
            cache[...] = kvcore.to_bfloat16(x)
        else:
            cache[...] = x.astype(cache.dtype)


def make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, rng, layers=1, spread=1.0):
    pool = kvcore.BlockPool(num_blocks, block_size, layers, num_kv_heads, head_dim, dtype=dtype)
    for layer in range(layers):
        fill_pool(pool, rng, layer, spread)
    return pool


def make_batch(rng, pool, contexts, queries, pad=-1):
    """Shuffled, non-contiguous block tables for sequences of the given
    lengths; entries past each sequence's blocks hold ``pad``."""
    bs = pool.block_size
    need = [-(-c // bs) for c in contexts]
    ids = rng.permutation(pool.num_blocks)[:sum(need)]
    tables = np.full((len(contexts), max(need) + 1), pad, np.int32)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = ids[start:start + n]
        start += n
    qsl = np.concatenate([[0], np.cumsum(queries)]).astype(np.int64)
    return tables, np.asarray(contexts, np.int64), qsl


def run_case(rng, dtype, contexts, queries, num_heads, num_kv_heads, head_dim, block_size,
             q_dtype=np.float32, spread=1.0, q_bf16=False, **kw):
    bs = block_size
    blocks = sum(-(-c // bs) for c in contexts) + 3
    pool = make_pool(blocks, bs, num_kv_heads, head_dim, dtype, rng, spread=spread)
    tables, lens, qsl = make_batch(rng, pool, contexts, queries)
    q = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(q_dtype)
    if q_bf16:      # each element a bfloat16 value (a bfloat16 model's q)
        q = (q.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    out = kvcore.paged_attention(q, pool, 0, tables, lens, qsl, **kw)
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables, lens,
                                     qsl, kind=dtype, **kw)
    assert out.dtype == np.float32 and out.shape == q.shape
    err = rel_err(out, want)
    assert err <= TOL, (dtype, contexts, queries, num_heads, num_kv_heads, head_dim, bs, kw, err)
    return out, want


@pytest.fixture(params=LEVEL_PARAMS)
def level(request):
    with simd_level(request.param):
        yield request.param


@pytest.fixture
def threads():
    """Restores the thread setting after the test (a chosen count, or the
    default: ``set_num_threads`` returns the setting it replaces)."""
    before = kvcore.set_num_threads(None)
    kvcore.set_num_threads(before)
    yield
    kvcore.set_num_threads(before)


GEOMETRIES = [  # (num_heads, num_kv_heads): GQA 1, 4, 8 and MQA
    (4, 4), (8, 2), (16, 2), (8, 1),
]
HEAD_DIMS = [64, 80, 96, 128, 256]


def random_shapes(rng):
    """A random varlen batch: 1-8 sequences, mostly decode and short
    chunks, sometimes a long context (few queries) or a long prefill."""
    nseq = int(rng.integers(1, 9))
    contexts, queries = [], []
    for _ in range(nseq):
        kind = rng.random()
        if kind < 0.5:       # decode over a context of up to 5000
            c = int(rng.integers(1, 5001)) if rng.random() < 0.3 else int(rng.integers(1, 700))
            m = 1
        elif kind < 0.8:     # a chunk of up to 40 queries over a shorter context
            c = int(rng.integers(1, 1200))
            m = int(rng.integers(1, min(c, 40) + 1))
        else:                # a prefill of up to 300 queries
            c = int(rng.integers(1, 301))
            m = int(rng.integers(max(1, c - 50), c + 1))
        contexts.append(c)
        queries.append(m)
    return contexts, queries


# ------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_random_varlen_batches(dtype, seed):
    rng = np.random.default_rng([seed, DTYPES.index(dtype)])
    for _ in range(2):
        contexts, queries = random_shapes(rng)
        nh, nkv = GEOMETRIES[int(rng.integers(len(GEOMETRIES)))]
        d = HEAD_DIMS[int(rng.integers(len(HEAD_DIMS)))]
        if d == 256 or sum(c * m for c, m in zip(contexts, queries)) > 40000:
            nh, nkv = nh // nkv, 1      # keep the float64 reference cheap
        bs = [1, 16, 32][int(rng.integers(3))]
        run_case(rng, dtype, contexts, queries, nh, nkv, d, bs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_simd_level(dtype, level):
    rng = np.random.default_rng(7)
    run_case(rng, dtype, [1, 33, 1500, 200], [1, 5, 1, 200], 8, 2, 128, 16)
    run_case(rng, dtype, [45, 9], [45, 3], 4, 1, 40, 16)   # head_dim not a multiple of 8
    run_case(rng, dtype, [70], [70], 3, 3, 64, 16, sliding_window=20, logits_soft_cap=1.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_simd_level_bfloat16_query(dtype, level):
    """q's elements bfloat16 values: the amx level's tiles take them as one
    bf16 term, unscaled, and scale the dots (every other level as any q)."""
    rng = np.random.default_rng(8)
    run_case(rng, dtype, [600, 90, 1], [600, 40, 1], 8, 2, 128, 16, q_bf16=True)
    run_case(rng, dtype, [70, 2100], [70, 20], 3, 3, 64, 16, q_bf16=True, sliding_window=20,
             logits_soft_cap=1.5)
    run_case(rng, dtype, [90], [90], 4, 1, 64, 16, q_bf16=True, scale=3.0)   # past 1/log2(e)
    run_case(rng, dtype, [90], [90], 4, 1, 32, 16, q_bf16=True, scale=-0.3)


@pytest.mark.parametrize("head_dim", HEAD_DIMS + [8, 24, 72])
def test_head_dims(head_dim):
    rng = np.random.default_rng(head_dim)
    run_case(rng, "float16", [130, 17, 2100], [40, 1, 1], 8, 2, head_dim, 16)


@pytest.mark.parametrize("nh,nkv", [(4, 4), (16, 4), (32, 4), (8, 1), (64, 1), (6, 3)])
def test_group_sizes(nh, nkv):
    rng = np.random.default_rng(nh * 100 + nkv)
    run_case(rng, "bfloat16", [300, 1, 77], [1, 1, 20], nh, nkv, 64, 16)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_context_multiple_of_block_size_and_one_past(block_size):
    rng = np.random.default_rng(block_size)
    for blocks in (1, 3, 64):
        exact = blocks * block_size
        run_case(rng, "float16", [exact, exact + 1, exact - 1 if exact > 1 else 1],
                 [1, 1, 1], 8, 2, 64, block_size)
        run_case(rng, "float32", [exact, exact + 1], [min(exact, 5), min(exact + 1, 5)],
                 8, 2, 64, block_size)


def test_length_one_sequence():
    rng = np.random.default_rng(1)
    for dtype in DTYPES:
        out, want = run_case(rng, dtype, [1], [1], 8, 2, 64, 16)
        # one visible position: the output is exactly that position's value row
        pool_v = want  # reference on the stored values
        assert np.allclose(out, pool_v, rtol=0, atol=1e-6)


def test_whole_prefill_every_row():
    rng = np.random.default_rng(2)
    out, want = run_case(rng, "float16", [300], [300], 8, 2, 64, 16)
    errs = np.abs(out - want).max(axis=(1, 2)) / np.abs(want).max()
    assert (errs <= TOL).all()


def test_mixed_batch_prefill_chunk_and_decode():
    rng = np.random.default_rng(3)
    run_case(rng, "bfloat16", [260, 900, 4999, 1], [260, 37, 1, 1], 16, 4, 128, 32)
    # long contexts split into 1024-key pieces, for items of 4 rows and of 40
    run_case(rng, "float16", [3000, 2500, 1100], [10, 1, 16], 16, 4, 64, 16)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 100, 10_000])
def test_sliding_window(window):
    """Windows that cut inside a block, on a block boundary, across
    several blocks, and one wider than the context."""
    rng = np.random.default_rng(window)
    run_case(rng, "float16", [100, 37, 2500], [100, 6, 1], 8, 2, 64, 16, sliding_window=window)


@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
def test_logits_soft_cap(cap):
    rng = np.random.default_rng(int(cap * 10))
    # large scores (spread K) so that the cap changes the result
    out, _ = run_case(rng, "float32", [90, 1300], [30, 1], 8, 2, 64, 16, spread=4.0,
                      logits_soft_cap=cap)
    run_case(rng, "bfloat16", [64], [64], 4, 1, 128, 32, spread=4.0, logits_soft_cap=cap,
             sliding_window=9)


def test_soft_cap_changes_the_result():
    rng = np.random.default_rng(11)
    pool = make_pool(8, 16, 1, 64, "float32", rng, spread=4.0)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    tables, lens = np.arange(8).reshape(1, 8), [100]
    a = kvcore.paged_attention(q, pool, 0, tables, lens)
    b = kvcore.paged_attention(q, pool, 0, tables, lens, logits_soft_cap=0.5)
    assert rel_err(a, b.astype(np.float64)) > 1e-2


@pytest.mark.parametrize("scale", [0.01, 0.3, 1.0])
def test_scale(scale):
    rng = np.random.default_rng(int(scale * 100))
    run_case(rng, "float16", [200, 31], [20, 1], 8, 2, 64, 16, scale=scale)


@pytest.mark.parametrize("q_dtype", [np.float16, ml_dtypes.bfloat16])
def test_query_dtypes(q_dtype):
    rng = np.random.default_rng(5)
    run_case(rng, "float16", [50, 7], [10, 1], 8, 2, 64, 16, q_dtype=q_dtype)


def test_large_scores_stay_finite():
    """Scores of several hundred (no overflow in the exponent): a nearly
    one-hot softmax, still within tolerance of the reference."""
    rng = np.random.default_rng(6)
    out, _ = run_case(rng, "float32", [500], [3], 4, 1, 64, 16, spread=3.0, scale=1.0)
    assert np.isfinite(out).all()


def test_uint16_pool_bits_are_bfloat16():
    rng = np.random.default_rng(8)
    pool = make_pool(4, 16, 1, 64, "bfloat16", rng)
    assert pool.key_cache(0).dtype == np.uint16
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    out = kvcore.paged_attention(q, pool, 0, [[0, 1, 2, 3]], [60])
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), [[0, 1, 2, 3]],
                                     [60], kind="bfloat16")
    assert rel_err(out, want) <= TOL


# ------------------------------------------------------------------ out=
def _decode_setup(rng, dtype="float16"):
    pool = make_pool(40, 16, 2, 64, dtype, rng)
    tables, lens, qsl = make_batch(rng, pool, [300, 5, 70], [1, 1, 4])
    q = rng.standard_normal((6, 8, 64)).astype(np.float32)
    want = kvcore.paged_attention(q, pool, 0, tables, lens, qsl)
    return pool, tables, lens, qsl, q, want


def test_out_float32_is_filled_and_returned():
    rng = np.random.default_rng(20)
    pool, tables, lens, qsl, q, want = _decode_setup(rng)
    out = np.full_like(want, np.nan)
    got = kvcore.paged_attention(q, pool, 0, tables, lens, qsl, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)


def test_out_strided_and_narrow_dtypes():
    rng = np.random.default_rng(21)
    pool, tables, lens, qsl, q, want = _decode_setup(rng)
    big = np.zeros((6, 8, 128), np.float32)
    strided = big[:, :, ::2]
    assert kvcore.paged_attention(q, pool, 0, tables, lens, qsl, out=strided) is strided
    np.testing.assert_array_equal(strided, want)
    assert (big[:, :, 1::2] == 0).all()
    h = np.empty(want.shape, np.float16)
    kvcore.paged_attention(q, pool, 0, tables, lens, qsl, out=h)
    np.testing.assert_array_equal(h, want.astype(np.float16))
    b = np.empty(want.shape, ml_dtypes.bfloat16)
    kvcore.paged_attention(q, pool, 0, tables, lens, qsl, out=b)
    np.testing.assert_array_equal(b, want.astype(ml_dtypes.bfloat16))


def test_unaligned_and_strided_queries():
    rng = np.random.default_rng(24)
    pool, tables, lens, qsl, q, want = _decode_setup(rng)
    raw = np.zeros(q.nbytes + 4, np.uint8)
    unaligned = raw[2:2 + q.nbytes].view(np.float32).reshape(q.shape)
    unaligned[...] = q
    assert not unaligned.flags.aligned
    np.testing.assert_array_equal(kvcore.paged_attention(unaligned, pool, 0, tables, lens, qsl),
                                  want)
    wide = np.zeros((6, 16, 64), np.float32)
    wide[:, ::2] = q
    np.testing.assert_array_equal(kvcore.paged_attention(wide[:, ::2], pool, 0, tables, lens,
                                                         qsl), want)


def test_out_may_be_q_itself():
    rng = np.random.default_rng(22)
    pool, tables, lens, qsl, q, want = _decode_setup(rng)
    q2 = q.copy()
    assert kvcore.paged_attention(q2, pool, 0, tables, lens, qsl, out=q2) is q2
    np.testing.assert_array_equal(q2, want)


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    pool, tables, lens, qsl, q, want = _decode_setup(rng)
    tq = torch.from_numpy(q.copy()).requires_grad_(True)
    out = torch.empty(want.shape, dtype=torch.float32)
    got = kvcore.paged_attention(tq, pool, 0, torch.from_numpy(tables), torch.from_numpy(lens),
                                 torch.from_numpy(qsl), out=out)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), want)
    ob = torch.empty(want.shape, dtype=torch.bfloat16)
    kvcore.paged_attention(tq.detach().to(torch.bfloat16), pool, 0, tables, lens, qsl, out=ob)
    want_b = kvcore.paged_attention(q.astype(ml_dtypes.bfloat16), pool, 0, tables, lens, qsl)
    np.testing.assert_array_equal(ob.view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                                  want_b.astype(ml_dtypes.bfloat16))


# ------------------------------------------------------------------ threads
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_thread_count_gives_the_same_bits(dtype, threads):
    """Work is split by the arguments alone (sequences x heads x query
    tiles x 1024-key splits) and merged in a fixed order: the same bits
    for any thread count."""
    rng = np.random.default_rng(30)
    pool = make_pool(500, 16, 2, 64, dtype, rng)
    tables, lens, qsl = make_batch(rng, pool, [4000, 1, 900, 300, 2000],
                                   [1, 1, 33, 300, 1])
    q = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float32)
    results = []
    for n in (1, 2, 3, 8):
        kvcore.set_num_threads(n)
        results.append(kvcore.paged_attention(q, pool, 0, tables, lens, qsl,
                                              sliding_window=1500))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0), tables, lens,
                                     qsl, sliding_window=1500)
    assert rel_err(results[0], want) <= TOL


def test_set_and_get_num_threads(threads):
    kvcore.set_num_threads(3)
    assert kvcore.get_num_threads() == 3
    with pytest.raises(ValueError, match="n must be in 1..1024, got 0"):
        kvcore.set_num_threads(0)
    with pytest.raises(TypeError, match="n must be an integer"):
        kvcore.set_num_threads(2.0)
    with pytest.raises(ValueError, match="got 5000"):
        kvcore.set_num_threads(5000)
    assert kvcore.get_num_threads() == 3


def test_set_num_threads_returns_the_setting_it_replaces(threads):
    """None while the default holds, else the count set; a refused count
    changes nothing, so restoring the returned value restores exactly."""
    kvcore.set_num_threads(None)
    assert kvcore.set_num_threads(3) is None
    assert kvcore.set_num_threads(5) == 3
    with pytest.raises(ValueError, match="got 0"):
        kvcore.set_num_threads(0)
    assert kvcore.set_num_threads(None) == 5
    assert kvcore.set_num_threads(None) is None
    default = kvcore.get_num_threads()
    assert kvcore.set_num_threads(None) is None           # reading it chose nothing
    assert kvcore.set_num_threads(default) is None
    assert kvcore.set_num_threads(None) == default


def _fresh_num_threads(env):
    code = "import kvcore; print(kvcore.get_num_threads())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


def test_default_thread_count_respects_affinity_and_omp_num_threads():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))
    r = subprocess.run([sys.executable, "-c", "import kvcore; print(kvcore.get_num_threads())"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert int(r.stdout) == cores
    assert _fresh_num_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert _fresh_num_threads({"OMP_NUM_THREADS": "1000"}) == cores
    assert _fresh_num_threads({"OMP_NUM_THREADS": "garbage"}) == cores


def test_concurrent_callers(threads):
    """Several Python threads call at once (GIL released, one shared
    worker pool): every result is right."""
    kvcore.set_num_threads(2)
    rng = np.random.default_rng(31)
    pool = make_pool(200, 16, 2, 64, "float16", rng)
    tables, lens, qsl = make_batch(rng, pool, [2500, 300], [1, 20])
    q = rng.standard_normal((21, 8, 64)).astype(np.float32)
    want = kvcore.paged_attention(q, pool, 0, tables, lens, qsl)

    def work():
        for _ in range(20):
            np.testing.assert_array_equal(
                kvcore.paged_attention(q, pool, 0, tables, lens, qsl), want)

    run_in_threads(work, 4)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_small_calls_do_not_wake_worker_threads():
    """A call with too little work to repay waking a worker (a short
    decode) runs on the calling thread: no worker thread is started for
    it; a large call starts them."""
    code = textwrap.dedent("""
        import os
        import numpy as np, kvcore
        kvcore.set_num_threads(4)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        pool = kvcore.BlockPool(300, 16, 1, 2, 64)
        before = tasks()
        q = np.ones((1, 8, 64), np.float32)
        kvcore.paged_attention(q, pool, 0, np.arange(4).reshape(1, 4), [40])
        small = tasks()
        q = np.ones((4, 8, 64), np.float32)
        kvcore.paged_attention(q, pool, 0, np.arange(256).reshape(4, 64), [1024] * 4)
        print(before, small, tasks())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    before, small, large = map(int, r.stdout.split())
    assert small == before
    assert large == before + 3


@pytest.mark.forks
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_after_the_worker_pool_started():
    """A child forked after the workers exist gets a fresh pool."""
    code = textwrap.dedent("""
        import os, sys, warnings
        import numpy as np, kvcore
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12 warns on fork with threads
        kvcore.set_num_threads(3)
        pool = kvcore.BlockPool(64, 16, 1, 2, 64)
        q = np.ones((2, 32, 64), np.float32)    # enough work for three threads
        t = np.arange(64).reshape(2, 32)
        a = kvcore.paged_attention(q, pool, 0, t, [500, 400])
        pid = os.fork()
        if pid == 0:
            b = kvcore.paged_attention(q, pool, 0, t, [500, 400])
            os._exit(0 if np.array_equal(a, b) else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------ errors, before any work
@pytest.fixture
def setup():
    rng = np.random.default_rng(40)
    pool = make_pool(16, 16, 2, 64, "float16", rng, layers=2)
    tables = np.array([[3, 5, -1], [7, -1, -1]], np.int32)
    lens = np.array([20, 9])
    qsl = np.array([0, 4, 5])
    q = rng.standard_normal((5, 8, 64)).astype(np.float32)
    return pool, tables, lens, qsl, q


BAD = [
    # (change, exception, message pattern)
    (dict(q=np.zeros((5, 7, 64), np.float32)), ValueError,
     r"q.shape\[1\] \(num_heads\) must be a positive multiple of the pool's num_kv_heads=2 "
     r"up to 65536, got 7"),
    # (a stride-0 q: 65538 heads cost no memory; AttentionPlan's num_heads has the same limit)
    (dict(q=np.lib.stride_tricks.as_strided(np.zeros(64, np.float32), (5, 65538, 64),
                                            (0, 0, 4))), ValueError,
     r"q.shape\[1\] \(num_heads\) must be a positive multiple .* up to 65536, got 65538"),
    (dict(q=np.zeros((5, 8, 32), np.float32)), ValueError, r"head_dim=64, got 32"),
    (dict(q=np.zeros((5, 8), np.float32)), ValueError, r"q must be 3-D"),
    (dict(q=np.zeros((5, 8, 64), np.int32)), TypeError, r"q must be float32.*got int32"),
    (dict(q=np.zeros((5, 8, 64), np.uint16)), TypeError, r"never guessed to be bfloat16"),
    (dict(q=np.zeros((5, 8, 64), np.float64)), TypeError, r"got float64"),
    (dict(seq_lens=[49, 9]), ValueError,
     r"seq_lens must lie in 0..48 \(block_tables.shape\[1\] \* block_size = 3 \* 16\), got 49"),
    (dict(seq_lens=[33, 9]), IndexError, r"block_tables\[0, 2\] .*position 32 .*got -1"),
    (dict(seq_lens=[3, 9]), ValueError,
     r"seq_lens\[0\] = 3 is less than the 4 query tokens of sequence 0"),
    (dict(seq_lens=[20]), ValueError, r"seq_lens must have one entry per row"),
    (dict(seq_lens=[20.0, 9.0]), TypeError, r"seq_lens must hold integers"),
    # stride-0 views of 2**40 entries: their rows are checked before a copy,
    # and a copy too large to make names its argument
    (dict(seq_lens=np.broadcast_to(np.int32(9), (2**40,))), ValueError,
     r"seq_lens must have one entry per row of block_tables \(2\), got shape \(1099511627776,\)"),
    (dict(query_start_loc=np.broadcast_to(np.int64(0), (2**40,))), ValueError,
     r"query_start_loc must have num_seqs \+ 1 = 3 entries, got shape \(1099511627776,\)"),
    (dict(block_tables=np.broadcast_to(np.int32(3), (2**40, 3))), MemoryError,
     r"block_tables is too large to copy \(shape \(1099511627776, 3\) of int32"),
    (dict(block_tables=None), TypeError, r"block_tables must be an integer array, got NoneType"),
    (dict(block_tables="3, 7"), TypeError, r"block_tables must be an integer array, got str"),
    (dict(seq_lens=object()), TypeError, r"seq_lens must be an integer array, got object"),
    (dict(block_tables=np.array([[3, 99, -1], [7, -1, -1]])), IndexError,
     r"block_tables\[0, 1\] must be a block id in 0..15 .*got 99"),
    (dict(block_tables=np.array([[3, -1, -1], [7, -1, -1]])), IndexError,
     r"block_tables\[0, 1\] .*got -1"),
    (dict(block_tables=np.array([[3, 2**40, -1], [7, -1, -1]])), IndexError,
     r"block_tables\[0, 1\] .*got 1099511627776"),
    (dict(block_tables=np.array([3, 5])), ValueError, r"block_tables must be 2-D"),
    (dict(block_tables=[[3, 5, 1], [7]]), ValueError, r"block_tables must be a 2-D integer"),
    (dict(query_start_loc=[1, 4, 5]), ValueError, r"query_start_loc\[0\] must be 0, got 1"),
    (dict(query_start_loc=[0, 4, 3]), ValueError, r"non-decreasing, got 4 then 3 at index 1"),
    (dict(query_start_loc=[0, 4, 6]), ValueError, r"query_start_loc\[-1\] must be q.shape\[0\]=5"),
    (dict(query_start_loc=[0, 5]), ValueError, r"num_seqs \+ 1 = 3 entries"),
    (dict(query_start_loc=None), ValueError, r"one query per sequence: q.shape\[0\] must be "
                                             r"num_seqs=2, got 5"),
    (dict(layer=2), IndexError, r"layer must be in 0..1, got 2"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(scale="1"), TypeError, r"scale must be a real number"),
    (dict(scale=10**400), ValueError, r"scale must be finite, got 1000.*\(an int of 401 digits\)"),
    (dict(logits_soft_cap=-10**400), ValueError, r"logits_soft_cap must be finite"),
    # past Python's int-to-str limit (4300 digits): still named, in bits
    (dict(scale=10**5000), ValueError, r"scale must be finite, got an int of 16610 bits"),
    (dict(sliding_window=0), ValueError, r"sliding_window must be a positive integer"),
    (dict(sliding_window=2.5), TypeError, r"sliding_window must be an integer"),
    (dict(logits_soft_cap=0.0), ValueError, r"logits_soft_cap must be positive"),
    (dict(pool="not a pool"), TypeError, r"pool must be a kvcore.BlockPool, got str"),
] + bad_out_cases(5)


@pytest.mark.parametrize("change,exc,pattern", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_raises_before_any_work(setup, change, exc, pattern):
    pool, tables, lens, qsl, q, = setup
    out = np.full((5, 8, 64), 7.0, np.float32)
    args = dict(q=q, pool=pool, layer=0, block_tables=tables, seq_lens=lens,
                query_start_loc=qsl, out=out)
    args.update(change)
    if isinstance(args["out"], str):
        args["out"] = np.zeros((5, 8, 64), np.float32)
        args["out"].flags.writeable = False
    before = pool.storage.copy()
    with pytest.raises(exc, match=pattern):
        kvcore.paged_attention(**args)
    assert (out == 7.0).all()
    np.testing.assert_array_equal(pool.storage, before)


def test_out_overlapping_the_pool_is_refused(setup):
    pool, tables, lens, qsl, q = setup
    alias = pool.storage.reshape(-1).view(np.uint8)[:5 * 8 * 64 * 4].view(np.float32)
    before = pool.storage.copy()
    with pytest.raises(ValueError, match="out must not overlap the KV cache"):
        kvcore.paged_attention(q, pool, 0, tables, lens, qsl, out=alias.reshape(5, 8, 64))
    np.testing.assert_array_equal(pool.storage, before)


def test_unused_block_table_entries_are_not_read(setup):
    """Padding past a sequence's length, and blocks before a sliding window,
    may hold anything (here -1 and 10**6): they are not read, not checked."""
    pool, tables, lens, qsl, q = setup
    t = tables.astype(np.int64)
    t[1, 1:] = 10**6
    a = kvcore.paged_attention(q, pool, 0, t, lens, qsl)
    np.testing.assert_array_equal(a, kvcore.paged_attention(q, pool, 0, tables, lens, qsl))
    t2 = tables.copy()
    t2[0, 0] = -1          # positions 0..15 of sequence 0 lie before the window
    b = kvcore.paged_attention(q, pool, 0, t2, lens, qsl, sliding_window=1)
    want = paged_attention_reference(q, pool.key_cache(0), pool.value_cache(0),
                                     np.where(t2 < 0, 0, t2), lens, qsl, sliding_window=1)
    assert rel_err(b, want) <= TOL


def test_empty_batches():
    pool = kvcore.BlockPool(4, 16, 1, 2, 64)
    q = np.zeros((0, 4, 64), np.float32)
    out = kvcore.paged_attention(q, pool, 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int64))
    assert out.shape == (0, 4, 64)
    # a sequence with no queries is skipped (its table is not read)
    out = kvcore.paged_attention(np.ones((1, 4, 64), np.float32), pool, 0, [[0], [-5]], [3, 7],
                                 query_start_loc=[0, 1, 1])
    assert out.shape == (1, 4, 64) and np.isfinite(out).all()


# ------------------------------------------------------------------ conveniences
def _sdpa(q, k, v, scale=None, causal_offset=0):
    """float64 causal attention: q (n, H, D), k/v (KVH, L, D); query j at
    position causal_offset + j."""
    n, H, D = q.shape
    kvh, L, _ = k.shape
    g = H // kvh
    scale = 1 / np.sqrt(D) if scale is None else scale
    out = np.zeros((n, H, D))
    for j in range(n):
        pos = causal_offset + j
        for h in range(H):
            s = k[h // g, :pos + 1].astype(np.float64) @ q[j, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[j, h] = w @ v[h // g, :pos + 1].astype(np.float64) / w.sum()
    return out


def test_paged_kv_cache_attention_prefill_then_decode():
    rng = np.random.default_rng(50)
    pool = kvcore.BlockPool(32, 16, 2, 2, 64, dtype="float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(37)))
    n = 37
    for step in range(4):
        for layer in range(2):
            k = rng.standard_normal((n, 2, 64)).astype(np.float32)
            v = rng.standard_normal((n, 2, 64)).astype(np.float32)
            seq.append(layer, k, v)
            q = rng.standard_normal((n, 8, 64)).astype(np.float32)
            got = seq.attention(layer, q)
            kk, vv = seq.gather(layer, dtype="float32")
            want = _sdpa(q, kk, vv, causal_offset=seq.num_computed)
            assert rel_err(got, want) <= TOL
            out = np.empty((n, 8, 64), np.float32)
            assert seq.attention(layer, q, out=out, sliding_window=5) is out
        seq.commit(n)
        seq.append_token(1)
        n = 1


def test_paged_kv_cache_attention_unwritten_positions_raise():
    rng = np.random.default_rng(51)
    pool = kvcore.BlockPool(8, 16, 2, 2, 64, dtype="float16")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(10)))
    q = rng.standard_normal((10, 8, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=r"positions 0..9, but layer 0 holds 0 written"):
        seq.attention(0, q)
    seq.append(0, np.zeros((10, 2, 64), np.float32), np.zeros((10, 2, 64), np.float32))
    seq.attention(0, q)                       # layer 0 is written now
    with pytest.raises(ValueError, match="layer 1 holds 0 written"):
        seq.attention(1, q)
    with pytest.raises(ValueError, match=r"positions 0..10, but layer 0 holds 10"):
        seq.attention(0, np.zeros((11, 8, 64), np.float32))
    # the batched path: pool.write + mark_written
    seq.reserve(10)
    pool.write(1, np.ones((10, 2, 64), np.float32), np.ones((10, 2, 64), np.float32),
               seq.slot_mapping(0, 10))
    with pytest.raises(ValueError, match="layer 1 holds 0 written"):
        seq.attention(1, q)
    seq.mark_written(1, 10)
    np.testing.assert_allclose(seq.attention(1, q), 1.0, rtol=0, atol=0)


def test_kv_cache_attention():
    rng = np.random.default_rng(52)
    cache = kvcore.KVCache(2, 2, 64, max_seq_len=100, batch_size=3, dtype="bfloat16")
    n = 20
    for step in range(3):
        for layer in range(2):
            k = rng.standard_normal((3, 2, n, 64)).astype(np.float32)
            v = rng.standard_normal((3, 2, n, 64)).astype(np.float32)
            cache.update(layer, k, v)
            q = rng.standard_normal((3, 8, n, 64)).astype(np.float32)
            got = cache.attention(layer, q)
            assert got.shape == (3, 8, n, 64) and got.dtype == np.float32
            kk, vv = cache.get(layer)
            length = cache.layer_len(layer)
            for b in range(3):
                want = _sdpa(q[b].transpose(1, 0, 2), kvcore.from_bfloat16(kk[b]),
                             kvcore.from_bfloat16(vv[b]), causal_offset=length - n)
                assert rel_err(got[b].transpose(1, 0, 2), want) <= TOL
            out = np.empty((3, 8, n, 64), np.float16)
            assert cache.attention(layer, q, out=out) is out
            np.testing.assert_array_equal(out, got.astype(np.float16))
        n = 1


def test_kv_cache_attention_errors():
    cache = kvcore.KVCache(1, 2, 64, max_seq_len=10, batch_size=2)
    q = np.zeros((2, 4, 1, 64), np.float32)
    with pytest.raises(ValueError, match="holds only 0 written positions"):
        cache.attention(0, q)
    cache.update(0, np.zeros((2, 2, 3, 64), np.float32), np.zeros((2, 2, 3, 64), np.float32))
    with pytest.raises(ValueError, match="holds only 3 written positions"):
        cache.attention(0, np.zeros((2, 4, 4, 64), np.float32))
    with pytest.raises(ValueError, match=r"q.shape\[0\] must be batch_size=2"):
        cache.attention(0, np.zeros((1, 4, 1, 64), np.float32))
    with pytest.raises(ValueError, match="positive multiple of num_kv_heads=2"):
        cache.attention(0, np.zeros((2, 3, 1, 64), np.float32))
    with pytest.raises(IndexError):
        cache.attention(1, q)
    with pytest.raises(ValueError, match="out must have shape"):
        cache.attention(0, q, out=np.zeros((2, 4, 64), np.float32))
    assert cache.attention(0, q).shape == (2, 4, 1, 64)


# ------------------------------------------------------------------ the math kernels
@pytest.mark.parametrize("lvl", LEVEL_PARAMS)
def test_exp2_accuracy(lvl):
    """2**x for x <= 0: within 1 ulp of the float64 value down to 2**-126,
    +0 below it (never a subnormal: a multiply taking one costs ~128 cycles
    on an Intel Xeon), 0 for -inf, NaN for NaN."""
    rng = np.random.default_rng(60)
    x = np.concatenate([
        -rng.random(1_000_000, dtype=np.float32) * 126,
        -rng.random(200_000, dtype=np.float32),
        np.float32([0, -0.0, -0.5, -1, -125, -126]),
    ]).astype(np.float32)
    y = np.empty_like(x)
    _attention.exp2_neg(x, y, lvl)
    exact = np.exp2(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(y - exact) / ulp).max() <= 1.0
    special = np.float32([-np.inf, np.nan, -127, -200, -1e30, -126.0001, -126.4, -126.9])
    out = np.empty_like(special)
    _attention.exp2_neg(special, out, lvl)
    assert out[0] == 0 and np.isnan(out[1]) and (out[2:] == 0).all()


@pytest.mark.parametrize("rows", [1, 20])                    # decode, and a prefill item
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_weight_below_2_to_the_minus_126_is_zero(dtype, rows, level):
    """A softmax weight (times its value's scale) below FLT_MIN counts as 0
    at every level: every key's score sits a gap g (in base 2) under key
    0's, and only key 1's value is not 0, so the output is about 2^-g:
    nonzero for g = 125, exactly 0 for g = 127 (2^-127 is subnormal; a
    multiply taking one costs ~128 cycles on an Intel Xeon, so no kernel
    makes one).  int8: the weight times the value's scale (1/127 here)
    counts, so 2^-121 is 0 there and 2^-118 is not."""
    D, bs = 32, 8
    n = rows + 8                                         # every query row sees keys 0 and 1
    nb = -(-n // bs)
    gaps = ((118.0, False), (121.0, True)) if dtype == "int8" else ((125.0, False), (127.0, True))
    for gap, zero in gaps:
        pool = kvcore.BlockPool(nb, bs, 1, 1, D, dtype=dtype)
        k = np.zeros((n, 1, D), np.float32)
        v = np.zeros((n, 1, D), np.float32)
        k[0, 0, 0] = 1.0                                 # key 0: score q0; the others 0
        v[1, 0, :] = 1.0
        pool.write(0, k, v, np.arange(n))
        q = np.zeros((rows, 1, D), np.float32)
        q[:, 0, 0] = np.float32(gap / np.log2(np.e))     # scale 1: base-2 gap `gap`
        out = kvcore.paged_attention(q, pool, 0, np.arange(nb, dtype=np.int32)[None], [n],
                                     np.array([0, rows]), scale=1.0)
        if zero:
            assert (out == 0).all(), (level, dtype, rows, out[:, 0, :4])
        else:
            ratio = out[:, 0].astype(np.float64) / 2.0**-gap
            assert (np.abs(ratio - 1) < 0.01).all(), (level, dtype, rows, ratio[:, :4])


@pytest.mark.parametrize("dtype, bad", [          # (fp8 pages store inf saturated: finite)
    ("float16", np.nan), ("float16", np.inf), ("bfloat16", np.nan), ("bfloat16", -np.inf),
    ("float8_e4m3fn", np.nan), ("float8_e5m2", np.nan)])
def test_a_later_keys_nan_or_inf_stays_out_of_the_rows_before_it(dtype, bad, level):
    """Causal prefill with the key and value of position p NaN or inf: the
    rows of the tokens before it give the attention over their own keys, at
    every level, with p in the first key tile and in a later one.  (The amx
    level's tile kernels take the rows of a causal diagonal tile in one call
    over the union of their keys; an item whose tiles meet an inf or NaN,
    which would turn a hidden key's 0 weight into NaN, runs again without
    them, also after its first tiles.)"""
    rng = np.random.default_rng(62)
    H, KVH, D = 8, 2, 64
    for n, p in [(48, 30), (200, 150)]:
        pool = kvcore.BlockPool((n + 15) // 16, 16, 1, KVH, D, dtype=dtype)
        seq = kvcore.PagedKVCache(pool)
        seq.allocate(list(range(n)))
        k = rng.standard_normal((n, KVH, D)).astype(np.float32)
        v = rng.standard_normal((n, KVH, D)).astype(np.float32)
        k[p], v[p] = bad, bad
        seq.append(0, k, v)
        q = rng.standard_normal((n, H, D)).astype(np.float32)
        got = seq.attention(0, q)
        kk, vv = seq.gather(0, dtype="float32")
        assert not np.isfinite(vv[:, p]).any(), vv[:, p, :4]
        want = _sdpa(q[:p], kk[:, :p], vv[:, :p])
        assert np.isfinite(got[:p]).all(), (level, dtype, p)
        assert rel_err(got[:p], want) <= TOL, (level, dtype, p)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_infinite_key_or_value_element_is_not_nan(dtype, level):
    """A key element of -inf against a q element that is exactly 1 gives
    that key weight 0 (every row stays finite), and a value element of +inf
    gives +inf, not NaN, at every level.  (At the amx level a term of q or of
    a weight can be 0, and 0 x inf is NaN in a tile product: an item whose
    tiles meet an inf or NaN runs again with the other kernels.)"""
    rng = np.random.default_rng(63)
    D, H, n = 32, 16, 16
    table, lens, qsl = np.array([[0]], np.int32), np.array([n]), np.array([0, n])
    pool = kvcore.BlockPool(1, 16, 1, 1, D, dtype=dtype)
    k = rng.standard_normal((n, 1, D)).astype(np.float32)
    v = rng.standard_normal((n, 1, D)).astype(np.float32)
    k[2, 0, 5] = -np.inf
    pool.write(0, k, v, np.arange(n))
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    q[:, :, 5] = 1.0
    scale = float(np.log(2.0))                       # scale x log2(e) is exactly 1
    got = kvcore.paged_attention(q, pool, 0, table, lens, qsl, scale=scale)
    assert np.isfinite(got).all(), (level, int((~np.isfinite(got)).sum()))
    v[3, 0, 7] = np.inf
    k[2, 0, 5] = 0.5
    pool.write(0, k, v, np.arange(n))
    got = kvcore.paged_attention(q, pool, 0, table, lens, qsl)
    assert np.isposinf(got[3:, :, 7]).all() and not np.isnan(got).any(), level


@pytest.mark.parametrize("lvl", LEVEL_PARAMS)
def test_softcap_accuracy(lvl):
    rng = np.random.default_rng(61)
    x = np.concatenate([rng.standard_normal(300_000) * 3, rng.standard_normal(100_000) * 0.2,
                        np.linspace(-40, 40, 10001), [0.0, -0.0, 0.29999, 0.3, 1e-30]])
    x = x.astype(np.float32)
    for a, b in [(1.0, 1.0), (0.02, 50 * np.log2(np.e)), (2.0, 0.5)]:
        y = np.empty_like(x)
        _attention.softcap(x, y, a, b, lvl)
        exact = b * np.tanh(np.float64(np.float32(a)) * x.astype(np.float64))
        # a few float32 roundings (of a*x, tanh and the product): relative 4e-7
        assert np.all(np.abs(y - exact) <= 4e-7 * np.abs(exact) + 1e-37), (a, b)


# ------------------------------------------------------------------ portability
NATIVE = os.path.dirname(_attention.__file__)




@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump")
                    is None, reason="needs x86-64 and objdump")
def test_only_avx2_functions_use_avx():
    """A wheel must run on any x86-64: only the *_avx2, *_avx512 and *_amx functions
    (reached after the CPU said it has the instructions) may use AVX; and
    they do."""
    so = glob.glob(os.path.join(NATIVE, "_attention*.so"))
    assert so, "the _attention extension is not built"
    fns = functions_in(so[0])
    bad, simd = {}, set()
    for fn, insns in fns.items():
        name = fn.split("@")[0].split(".")[0]
        uses = next((i for i in insns if i.split()[0].startswith("v") or "ymm" in i), None)
        if name.endswith(("_avx2", "_avx512", "_amx")):
            if uses:
                simd.add(name)
        elif uses:
            bad[fn] = uses
    assert not bad, f"baseline functions use AVX: {bad}"
    assert {"scores_f16_avx2", "pv_f16_avx2", "scores_bf16_avx2", "row_exp_sum_avx2"} <= simd
    assert {"scores_f16_avx512", "pv_i8_avx512", "row_exp_sum_avx512"} <= simd
    assert {"scores_f16_amx", "pv_bf16_amx", "scores_i8_amx"} <= simd
    # the AVX-512 and AMX kernels use 512-bit registers, the AVX2 ones never do
    zmm = {fn.split("@")[0].split(".")[0] for fn, insns in fns.items()
           if any("zmm" in i for i in insns)}
    assert {"scores_f16_avx512", "pv_bf16_avx512", "exp2_neg_n_avx512"} <= zmm
    assert all(name.endswith(("_avx512", "_amx")) for name in zmm), zmm


# ------------------------------------------------------------------ the C file on its own
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "kvcore", "backends", "cpu", "csrc")
CHECK = os.path.join(ROOT, "tests", "c", "kv_attention_check.c")
needs_source = pytest.mark.skipif(not os.path.exists(os.path.join(CSRC, "kv_attention.c")),
                                  reason="needs the source tree")


def _build_and_run_check(cc, out, extra=(), runner=()):
    subprocess.run([cc, "-O2", "-pthread", *extra, f"-I{CSRC}", CHECK,
                    *sorted(glob.glob(os.path.join(CSRC, "kv_att*.c"))),
                    os.path.join(CSRC, "kv_simd.c"), "-o", str(out), "-lm"],
                   check=True, capture_output=True, text=True)
    return subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.toolchain
@needs_source
def test_c_kernels_alone_every_level(tmp_path):
    """kv_attention.c without Python: every level against a double-precision
    attention in C (threads, GQA, window, soft cap, every page dtype; chunks,
    ALiBi, sinks, extreme scales)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    run = _build_and_run_check(cc, tmp_path / "check")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(LEVELS)} levels, 0 failures" in run.stdout


@pytest.mark.slow
@pytest.mark.toolchain
@needs_source
def test_c_kernels_on_aarch64_under_qemu(tmp_path):
    """The scalar and NEON paths on AArch64 (cross-compiled, run under
    qemu-aarch64): every page dtype, threads, GQA, window, soft cap, exp2,
    chunks, ALiBi, sinks and extreme scales (one thread's bits too)."""
    cc, qemu = aarch64_tools()
    run = _build_and_run_check(cc, tmp_path / "check_a64", extra=("-static",), runner=(qemu,))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "level scalar: 90 cases, 0 failures" in run.stdout
    assert "level neon: 90 cases, 0 failures" in run.stdout      # the NEON kernels
    assert "2 levels, 0 failures" in run.stdout


def test_a_long_decode_keeps_float32_accuracy():
    """One sequence of 2**21 positions is decoded in 2048 pieces whose
    partial sums are merged in double: in float32 the merge lost one
    rounding per piece (3.5e-6 relative here, 8e-5 at 2**24).  Every key and
    value is 0 but the last (keys 2, values 5): the output has a closed form."""
    n = 2**21
    pool = kvcore.BlockPool(1, n, 1, 1, 8, dtype="float16", enable_prefix_caching=False)
    pool.write(0, np.full((1, 1, 8), 2, np.float32), np.full((1, 1, 8), 5, np.float32), [n - 1])
    out = kvcore.paged_attention(np.ones((1, 1, 8), np.float32), pool, 0, [[0]], [n], scale=1.0)
    w = np.exp(np.float64(16.0))
    ref = 5 * w / (w + (n - 1))
    assert abs(float(out[0, 0, 0]) - ref) / ref < 1e-6
