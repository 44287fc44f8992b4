"""Arrays the caller owns (issue 38, items 1 and 2).

* A plan over torch planes holds what keeps their memory valid (the
  storage, its size and address), not the address alone: a storage freed
  and regrown smaller, even at the same address, is refused by the next
  run, which never reads the freed bytes (the suite also runs under ASan).
  Likewise NumPy planes whose owning array was resized in place
  (``ndarray.resize(..., refcheck=False)``).
* Every ``out=`` kvcore cannot write in place (a torch tensor with the
  negative or conjugate bit, one that requires grad or has autograd
  history, a read-only NumPy array, elements that share memory) is refused
  by name, leaving it as it was; the ones it can (an inference tensor, a
  strided view) are written through, equal to ``out=None``'s result.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcore

try:
    from _cuda_env import cuda_backend_or_skip
except ImportError:  # pragma: no cover - run as a package
    from ._cuda_env import cuda_backend_or_skip


# ------------------------------------------------------------ 38.1: planes
# 128 KiB planes: a freed block of that size comes back at the same address
# most of the time (glibc), the case an address-only check lets through
LAYERS, BLOCKS, HEADS, BLOCK, DIM = 4, 16, 2, 16, 16


def _torch_plan(torch, device="cpu", dim=DIM):
    k = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, dim, device=device)
    v = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, dim, device=device)
    tables = np.arange(BLOCKS, dtype=np.int32).reshape(1, BLOCKS)
    plan = kvcore.AttentionPlan((k, v), tables, [BLOCKS * BLOCK])
    q = torch.randn(1, HEADS, dim, device=device)
    return k, v, plan, q


@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
@pytest.mark.parametrize("regrow", ["smaller", "larger"])
def test_a_plan_refuses_planes_whose_storage_was_freed_and_regrown(torch, which, regrow):
    reused = 0
    for _ in range(12):
        k, v, plan, q = _torch_plan(torch)
        want = plan.run(q, LAYERS - 1)
        t = k if which == "key_cache" else v
        before, storage = t.data_ptr(), t.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes // 4 if regrow == "smaller" else 2 * nbytes)
        reused += t.data_ptr() == before
        with pytest.raises(RuntimeError, match=f"{which}'s memory"):
            plan.run(q, LAYERS - 1)
        with pytest.raises(RuntimeError, match=f"{which}'s memory"):
            plan.run(q, 0, out=np.empty(want.shape, np.float32))
    # (how often the address came back: the case the old check missed)
    assert 0 <= reused <= 12


def test_a_plan_refuses_planes_given_other_storage_or_emptied(torch):
    k, v, plan, q = _torch_plan(torch)
    plan.run(q, 1)
    k.set_(torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, DIM))    # same size, other memory
    with pytest.raises(RuntimeError, match="key_cache's memory"):
        plan.run(q, 1)
    k, v, plan, q = _torch_plan(torch)
    v.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="value_cache's memory"):
        plan.run(q, 1)


def test_a_plan_over_planes_regrown_to_their_size_never_reads_freed_memory(torch):
    """Freed and regrown to the same size: either the memory moved (refused)
    or the storage owns the same bytes at the same address again (read,
    whatever they now hold)."""
    for _ in range(6):
        k, v, plan, q = _torch_plan(torch)
        before, storage = k.data_ptr(), k.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        if k.data_ptr() == before:
            assert plan.run(q, LAYERS - 1).shape == (1, HEADS, DIM)
        else:
            with pytest.raises(RuntimeError, match="key_cache's memory"):
                plan.run(q, LAYERS - 1)


def test_a_plan_over_untouched_planes_still_runs_after_another_tensor_is_freed(torch):
    k, v, plan, q = _torch_plan(torch)
    want = plan.run(q, 2)
    view = k[1:]                         # another tensor over the same storage
    del view
    np.testing.assert_array_equal(plan.run(q, 2), want)


def _numpy_plan(make_view=False):
    rng = np.random.default_rng(7)
    k = rng.standard_normal((LAYERS, BLOCKS, HEADS, BLOCK, DIM), dtype=np.float32)
    v = rng.standard_normal((LAYERS, BLOCKS, HEADS, BLOCK, DIM), dtype=np.float32)
    planes = (k[1:], v[1:]) if make_view else (k, v)
    tables = np.arange(BLOCKS, dtype=np.int32).reshape(1, BLOCKS)
    plan = kvcore.AttentionPlan(planes, tables, [BLOCKS * BLOCK])
    q = rng.standard_normal((1, HEADS, DIM), dtype=np.float32)
    return k, v, plan, q


@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
@pytest.mark.parametrize("make_view", [False, True], ids=["array", "view"])
@pytest.mark.parametrize("factor", [8, 0])
def test_a_plan_refuses_numpy_planes_resized_under_it(which, make_view, factor):
    """``ndarray.resize(..., refcheck=False)`` moves (or frees) an array's
    memory whoever views it: a plan over the array, or over a view of it,
    refuses its next run by name instead of reading the old memory (which
    crashed the process before: a large array's memory is unmapped)."""
    k, v, plan, q = _numpy_plan(make_view)
    layer = LAYERS - 2
    plan.run(q, layer)
    a = k if which == "key_cache" else v
    a.resize((factor * a.shape[0],) + a.shape[1:], refcheck=False)
    for out in (None, np.empty((1, HEADS, DIM), np.float32)):
        with pytest.raises(RuntimeError, match=f"{which}'s memory moved.*resize"):
            plan.run(q, layer, out=out)


def test_a_plan_over_numpy_planes_resized_to_their_size_reads_its_own_memory():
    """Resized to the same shape: the memory stays (same address, read as
    before) or moves (refused); a run never reads freed bytes."""
    k, v, plan, q = _numpy_plan()
    want = plan.run(q, 2)
    before = k.ctypes.data
    k.resize(k.shape, refcheck=False)
    if k.ctypes.data == before:
        np.testing.assert_array_equal(plan.run(q, 2), want)
    else:
        with pytest.raises(RuntimeError, match="key_cache's memory moved"):
            plan.run(q, 2)


def test_numpy_planes_that_cannot_move_need_no_guard():
    """Arrays over another object's buffer (here a bytearray, which cannot
    be resized while NumPy views it) carry no check, and the plan runs."""
    n = LAYERS * BLOCKS * HEADS * BLOCK * DIM
    buf = bytearray(4 * n)
    k = np.frombuffer(buf, np.float32).reshape(LAYERS, BLOCKS, HEADS, BLOCK, DIM)
    v = np.ones_like(k)
    tables = np.arange(BLOCKS, dtype=np.int32).reshape(1, BLOCKS)
    plan = kvcore.AttentionPlan((k, v), tables, [BLOCKS * BLOCK])
    with pytest.raises(BufferError):
        buf.extend(b"0" * 64)
    out = plan.run(np.ones((1, HEADS, DIM), np.float32), 1)
    np.testing.assert_array_equal(out, np.ones((1, HEADS, DIM), np.float32))


@pytest.mark.cuda
def test_a_plan_over_cuda_planes_refuses_a_freed_storage(torch):
    cuda_backend_or_skip()
    if not torch.cuda.is_available():
        pytest.fail("CuPy sees an NVIDIA GPU but torch does not: install a CUDA build of torch",
                    pytrace=False)
    k, v, plan, q = _torch_plan(torch, "cuda", dim=64)    # a head_dim the CUDA kernels take
    plan.run(q, 1)
    nbytes = k.untyped_storage().nbytes()
    k.untyped_storage().resize_(0)
    k.untyped_storage().resize_(nbytes // 4)
    with pytest.raises(RuntimeError, match="key_cache's memory"):
        plan.run(q, 1)


# ------------------------------------------------------------ 38.2: out=
RNG = np.random.default_rng(38)
X = (RNG.standard_normal((4, 8)) + 1).astype(np.float32)
NUM_BLOCKS, BS, NUM_LAYERS, KV_HEADS, HEAD_DIM, N = 8, 4, 2, 2, 8, 8


def _kv(n):
    return (RNG.standard_normal((n, KV_HEADS, HEAD_DIM)) + 1).astype(np.float32)


def _calls():
    """name -> (call(out) -> result, the out's element type): every public
    function that takes an ``out=`` (a pair's one member for the reads)."""
    pool = kvcore.BlockPool(NUM_BLOCKS, BS, NUM_LAYERS, KV_HEADS, HEAD_DIM, dtype="float32",
                            enable_prefix_caching=False)
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(N)))
    for layer in range(NUM_LAYERS):
        seq.append(layer, _kv(N), _kv(N))
    table = np.asarray(seq.block_table)
    cache = kvcore.KVCache(NUM_LAYERS, KV_HEADS, HEAD_DIM, 16, dtype="float32")
    for layer in range(NUM_LAYERS):
        cache.update(layer, _kv(N).transpose(1, 0, 2)[None], _kv(N).transpose(1, 0, 2)[None])
    q1 = RNG.standard_normal((1, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    qn = RNG.standard_normal((N, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    qc = RNG.standard_normal((1, 2 * KV_HEADS, 2, HEAD_DIM)).astype(np.float32)
    plan = kvcore.AttentionPlan(pool, table[None], [N])
    h, b = kvcore.to_float16(X), kvcore.to_bfloat16(X)
    e4, e5 = kvcore.to_float8_e4m3fn(X), kvcore.to_float8_e5m2(X)
    kv_shape = (KV_HEADS, N, HEAD_DIM)

    def k_of(pair_call, shape):     # out=(o, a NumPy array): the k result
        return lambda o: pair_call(None if o is None else (o, np.empty(shape, np.float32)))[0]

    def v_of(pair_call, shape):
        return lambda o: pair_call(None if o is None else (np.empty(shape, np.float32), o))[1]

    gather = lambda out: pool.gather(1, table, 0, N, out=out)      # noqa: E731
    return {
        "to_float16": (lambda o: kvcore.to_float16(X, out=o), "float16"),
        "to_bfloat16": (lambda o: kvcore.to_bfloat16(X, out=o), "bfloat16"),
        "from_float16": (lambda o: kvcore.from_float16(h, out=o), "float32"),
        "from_bfloat16": (lambda o: kvcore.from_bfloat16(b, out=o), "float32"),
        "to_float8_e4m3fn": (lambda o: kvcore.to_float8_e4m3fn(X, out=o), "uint8"),
        "to_float8_e5m2": (lambda o: kvcore.to_float8_e5m2(X, out=o), "uint8"),
        "from_float8_e4m3fn": (lambda o: kvcore.from_float8_e4m3fn(e4, out=o), "float32"),
        "from_float8_e5m2": (lambda o: kvcore.from_float8_e5m2(e5, out=o), "float32"),
        "paged_attention": (
            lambda o: kvcore.paged_attention(q1, pool, 1, table[None], [N], out=o), "float32"),
        "AttentionPlan.run": (lambda o: plan.run(q1, 1, out=o), "float32"),
        "AttentionPlan.run, float16 out": (lambda o: plan.run(q1, 1, out=o), "float16"),
        "PagedKVCache.attention": (lambda o: seq.attention(1, qn, out=o), "float32"),
        "KVCache.attention": (lambda o: cache.attention(1, qc, out=o), "float32"),
        "BlockPool.gather k": (k_of(gather, kv_shape), "float32"),
        "BlockPool.gather v": (v_of(gather, kv_shape), "float32"),
        "BlockPool.gather_batch": (
            k_of(lambda out: pool.gather_batch(1, table[None], [N], out=out), (1,) + kv_shape),
            "float32"),
        "PagedKVCache.gather": (k_of(lambda out: seq.gather(1, out=out), kv_shape), "float32"),
        "KVCache.get": (k_of(lambda out: cache.get(1, 0, N, out=out), (1,) + kv_shape),
                        "float32"),
    }


CALLS = sorted(_calls())
_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
          "uint8": np.uint8}


def _refused_outs(torch, shape, elem):
    """kind -> an out of ``shape`` kvcore cannot write in place."""
    tdt = getattr(torch, elem)
    ndt = _NUMPY[elem]
    read_only = np.zeros(shape, ndt)
    read_only.setflags(write=False)
    row = np.zeros(shape[-1], ndt)
    outs = {
        "a tensor with the negative bit": torch.zeros(shape, dtype=tdt)._neg_view(),
        "a tensor with the conjugate bit": torch.zeros(shape, dtype=torch.complex64).conj(),
        "a read-only NumPy array": read_only,
        "NumPy rows that share memory": np.lib.stride_tricks.as_strided(
            row, shape, (0,) * (len(shape) - 1) + (row.itemsize,), writeable=True),
        "an expanded tensor": torch.zeros(shape[-1], dtype=tdt).expand(*shape),
    }
    if tdt.is_floating_point:
        outs["a tensor that requires grad"] = torch.zeros(shape, dtype=tdt, requires_grad=True)
        outs["a tensor with autograd history"] = \
            torch.zeros(shape, dtype=tdt, requires_grad=True) * 1
    return outs


def _as_numpy(torch, x):
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        return x.numpy().view(np.uint16) if x.dtype == torch.int16 else x.numpy()
    return np.asarray(x)


@pytest.mark.parametrize("name", CALLS)
def test_every_out_kvcore_cannot_write_in_place_is_refused_by_name(torch, name):
    call, elem = _calls()[name]
    want = _as_numpy(torch, call(None))
    arg = r"out(\[[01]\])?"
    for kind, out in _refused_outs(torch, want.shape, elem).items():
        before = _as_numpy(torch, out.resolve_conj().resolve_neg()
                           if isinstance(out, torch.Tensor) else out).copy()
        with pytest.raises((TypeError, ValueError), match=rf"^{arg} must ") as info:
            call(out)
        assert "got" in str(info.value), (kind, str(info.value))
        after = _as_numpy(torch, out.resolve_conj().resolve_neg()
                          if isinstance(out, torch.Tensor) else out)
        np.testing.assert_array_equal(after, before, err_msg=kind)


def _written_outs(torch, shape, elem):
    """kind -> an out kvcore writes through (not the plain C-contiguous one)."""
    tdt = getattr(torch, elem)
    with torch.inference_mode():
        inference = torch.zeros(shape, dtype=tdt)
    wide = torch.zeros(tuple(shape[:-1]) + (2 * shape[-1],), dtype=tdt)
    return {"an inference tensor": inference,
            "a strided view": wide[..., ::2],
            "a parameter that does not require grad": torch.nn.Parameter(
                torch.zeros(shape, dtype=tdt), requires_grad=False)}


@pytest.mark.parametrize("name", CALLS)
def test_outs_kvcore_can_write_are_written_through(torch, name):
    call, elem = _calls()[name]
    want = _as_numpy(torch, call(None))
    if elem == "float16" and want.dtype == np.float32:    # a float32 result rounded into out
        want = kvcore.to_float16(want)
    for kind, out in _written_outs(torch, want.shape, elem).items():
        got = call(out)
        assert got is out, kind
        np.testing.assert_array_equal(_as_numpy(torch, out), want, err_msg=kind)


@pytest.mark.cuda
def test_cuda_outs_kvcore_cannot_write_in_place_are_refused_by_name(torch):
    be = cuda_backend_or_skip()
    if not torch.cuda.is_available():
        pytest.fail("CuPy sees an NVIDIA GPU but torch does not: install a CUDA build of torch",
                    pytrace=False)
    cp = be.xp
    pool = kvcore.BlockPool(4, 4, 1, 2, 64, dtype="float32", device="cuda")
    seq = kvcore.PagedKVCache(pool)
    seq.allocate(list(range(6)))
    seq.append(0, cp.ones((6, 2, 64), cp.float32), cp.ones((6, 2, 64), cp.float32))
    q = cp.ones((1, 4, 64), cp.float32)

    def outs(shape):
        return {"negative bit": torch.zeros(shape, device="cuda")._neg_view(),
                "requires grad": torch.zeros(shape, device="cuda", requires_grad=True),
                "expanded": torch.zeros(shape[-1], device="cuda").expand(*shape),
                "CuPy broadcast": cp.broadcast_to(cp.zeros(shape[-1], cp.float32), shape)}

    for kind, out in outs((1, 4, 64)).items():
        with pytest.raises((TypeError, ValueError), match=r"^out must .* got ") as info:
            kvcore.paged_attention(q, pool, 0, [seq.block_table], [6], out=out)
        assert "shape" not in str(info.value).split("got")[0], kind
    for kind, out in outs((2, 4, 64)).items():
        with pytest.raises((TypeError, ValueError), match=r"^out\[0\] must .* got "):
            pool.gather(0, seq.block_table, 0, 4, out=(out, cp.empty((2, 4, 64), cp.float32)))


def test_torch_fp8_outs_and_negated_bfloat16_inputs_are_taken(torch):
    """torch's float8 tensors are fp8 bits as ml_dtypes' are: taken as
    out= of an fp8 pool's gather and of the fp8 conversions, a tensor of
    the other format refused by name; a bfloat16 input with the negative
    bit set is read by its values, as float32 and float16 ones are (review,
    2026-12-07: both were refused as unreadable without a copy)."""
    pool = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="float8_e4m3fn")
    kv = np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 1, 8)
    pool.write(0, kv, kv, np.arange(4))
    want = pool.gather(0, [0], 0, 4)
    out = (torch.empty(1, 4, 8, dtype=torch.float8_e4m3fn),
           torch.empty(1, 4, 8, dtype=torch.float8_e4m3fn))
    pool.gather(0, [0], 0, 4, out=out)
    for got, ref in zip(out, want):
        np.testing.assert_array_equal(got.view(torch.uint8).numpy(), ref.view(np.uint8))
    x = torch.linspace(-2, 2, 16)
    y = torch.empty(16, dtype=torch.float8_e5m2)
    kvcore.to_float8_e5m2(x, out=y)
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e5m2).view(torch.uint8))
    with pytest.raises(TypeError, match=r"^out must have dtype .*torch\.float8_e5m2, got torch "
                                        r"tensor of dtype torch\.float8_e4m3fn"):
        kvcore.to_float8_e5m2(x, out=torch.empty(16, dtype=torch.float8_e4m3fn))
    bf = kvcore.BlockPool(4, 4, 1, 1, 8, dtype="bfloat16")
    k = torch.linspace(-1, 1, 32).reshape(4, 1, 8).to(torch.bfloat16)
    bf.write(0, k._neg_view(), k._neg_view(), np.arange(4))
    got = bf.gather(0, [0], 0, 4)[0]
    np.testing.assert_array_equal(got.view(np.uint16),
                                  (-k).transpose(0, 1).contiguous().view(torch.int16).numpy()
                                  .view(np.uint16))


def test_torch_fp8_tensors_without_ml_dtypes_are_refused_by_name(torch):
    """Without ml_dtypes (optional) kvcore cannot tell torch's two fp8
    formats apart by their bits: such tensors are refused, naming the
    argument and the way out, never read as the other format (review,
    2026-12-07)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ml_dtypes"] = None          # as if it were not installed
        import numpy as np, torch, kvcore
        x = torch.linspace(-2, 2, 8)
        for call in (lambda: kvcore.from_float8_e4m3fn(x.to(torch.float8_e5m2)),
                     lambda: kvcore.to_float8_e4m3fn(x, out=torch.empty(8, dtype=torch.float8_e5m2))):
            try:
                call()
            except TypeError as e:
                assert "pip install ml_dtypes" in str(e) and "uint8 view" in str(e), e
            else:
                raise AssertionError("an fp8 tensor was read without ml_dtypes")
        bits = x.to(torch.float8_e4m3fn).view(torch.uint8)
        assert np.array_equal(kvcore.from_float8_e4m3fn(bits), x.to(torch.float8_e4m3fn).float().numpy())
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
