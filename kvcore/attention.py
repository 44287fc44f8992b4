"""Attention over the pages: ``kvcore.paged_attention`` and its thread count.

Every argument is checked here, before any work, and each error names the
argument, what was expected and what was given; the C kernels
(``kvcore/backends/cpu``) then read K/V where they lie in the pool, in the
storage dtype, without the GIL.  ``PagedKVCache.attention`` and
``KVCache.attention`` are checked conveniences over the same kernel.
"""
import math
import os
import threading

import numpy as np

from . import _arrays
from . import dtypes as _dtypes
from ._validate import index_int, layer_index
from .backends.cpu import _attention as _kernel
from .pool import BlockPool

__all__ = ["paged_attention", "set_num_threads", "get_num_threads"]

MAX_THREADS = 1024

_threads_lock = threading.Lock()
_num_threads = None


# ------------------------------------------------------------------ threads
def _default_num_threads():
    """The CPUs this process may run on, capped by OMP_NUM_THREADS when set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    limit = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if limit.isdigit() and int(limit) > 0:
        n = min(n, int(limit))
    return max(1, min(n, MAX_THREADS))


def set_num_threads(n):
    """Threads ``paged_attention`` may use on the CPU (process-wide).

    Parameters
    ----------
    n : int
        1 .. 1024.  The default is the number of CPUs this process may run
        on (``os.sched_getaffinity``), capped by ``OMP_NUM_THREADS`` if set.

    Notes
    -----
    The result has the same bits for every thread count: how a call is split
    into work depends only on its arguments.  A call uses fewer threads
    than this when it has too little work to repay waking them (a short
    decode runs on the calling thread).
    """
    global _num_threads
    v = index_int(n, "n")
    if not 1 <= v <= MAX_THREADS:
        raise ValueError(f"n must be in 1..{MAX_THREADS}, got {v}")
    with _threads_lock:
        _num_threads = v


def get_num_threads():
    """Threads ``paged_attention`` uses on the CPU (see :func:`set_num_threads`)."""
    global _num_threads
    with _threads_lock:
        if _num_threads is None:
            _num_threads = _default_num_threads()
        return _num_threads


# ------------------------------------------------------------------ inputs
def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _host_view(x, arg):
    """A NumPy view of ``x`` (no copy where the memory allows): NumPy
    arrays, torch CPU tensors (bfloat16 as ml_dtypes.bfloat16, tensors that
    require grad read as their data), anything np.asarray takes."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"{arg} is a torch tensor on {x.device}, but this pool is on the "
                            "CPU; pass a CPU tensor or use a CUDA pool")
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":
            if _dtypes.BF16_NUMPY is None:  # pragma: no cover - ml_dtypes is a dependency of tests
                raise TypeError(f"{arg} is a torch.bfloat16 tensor; install ml_dtypes to pass it")
            import torch

            return t.view(torch.int16).numpy().view(_dtypes.BF16_NUMPY)
        return t.numpy()
    if hasattr(x, "__cuda_array_interface__") or \
            type(x).__module__.split(".")[0] in ("cupy", "cupyx"):
        raise TypeError(f"{arg} is a CUDA array ({type(x).__module__}.{type(x).__name__}) but "
                        "this pool is on the CPU; pass a NumPy array or use a CUDA pool")
    if hasattr(x, "__dlpack_device__") and x.__dlpack_device__()[0] != 1:  # kDLCPU
        raise TypeError(f"{arg} lives on DLPack device type {x.__dlpack_device__()[0]}, "
                        "not the CPU")
    try:
        return np.asarray(x)
    except Exception as e:
        raise TypeError(f"{arg} must be an array, got {type(x).__name__}: {e}") from None


def _int_array(x, arg, ndim):
    if isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x)
        except ValueError as e:   # ragged nested lists
            raise ValueError(f"{arg} must be a {ndim}-D integer array, got {e}") from None
    else:
        a = _host_view(x, arg)
    if a.ndim != ndim:
        raise ValueError(f"{arg} must be {ndim}-D, got shape {tuple(a.shape)}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{arg} must hold integers, got dtype {a.dtype}")
    return a


def _positive_or_off(value, arg, convert, what):
    """``value`` converted and checked > 0, or 0 (off) for None."""
    if value is None:
        return 0
    v = convert(value, arg)
    if v <= 0:
        raise ValueError(f"{arg} must be {what} or None, got {v}")
    return v


def _real(value, arg):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
        raise TypeError(f"{arg} must be a real number or None, got {type(value).__name__} "
                        f"{value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{arg} must be finite, got {v}")
    return v


# The kernels compute in float32: ``scale`` and the soft cap ``c`` become
# C floats, the scores are scaled by ``scale * log2(e)`` (or capped as
# ``c * log2(e) * tanh(s * (1 / c))``).  A value is accepted only when all of
# these are finite, normal float32 numbers, so nothing overflows to inf or
# flushes to 0 (a cap of 0 would read as "no cap").
_LOG2E = np.float32(1.4426950408889634)
_F32_TINY = float(np.finfo(np.float32).tiny)          # 2**-126, the smallest normal
_F32_SCALED_MAX = float(np.float32(np.finfo(np.float32).max) / _LOG2E)


def _float32_real(value, arg, allow_zero):
    """``value`` (already a finite Python float) as the float32 the kernels
    use, checked to be usable there: finite, and 0 or of a magnitude in
    ``[2**-126, FLT_MAX / log2(e)]`` (``allow_zero``: whether 0 is valid)."""
    with np.errstate(over="ignore", under="ignore"):
        f = np.float32(value)
        scaled = f * _LOG2E
        inverse = np.float32(1.0) / f if f != 0 else np.float32(0)
    if value == 0 and allow_zero:
        return 0.0
    if not (np.isfinite(f) and np.isfinite(scaled) and np.isfinite(inverse)
            and abs(float(f)) >= _F32_TINY and abs(float(scaled)) >= _F32_TINY):
        zero = "0 or " if allow_zero else ""
        raise ValueError(f"{arg} must be {zero}a value whose magnitude lies in "
                         f"[{_F32_TINY:.8g}, {_F32_SCALED_MAX:.8g}] (the kernels compute in "
                         f"float32), got {value!r}")
    return float(f)


def _query_array(q, num_kv_heads, head_dim):
    """(float32 C-contiguous q, shape) after checking dtype and shape."""
    qa = _host_view(q, "q")
    if qa.ndim != 3:
        raise ValueError(f"q must be 3-D (num_query_tokens, num_heads, head_dim), "
                         f"got shape {tuple(qa.shape)}")
    n, heads, dim = qa.shape
    if dim != head_dim:
        raise ValueError(f"q.shape[2] must be the pool's head_dim={head_dim}, got {dim}")
    if heads == 0 or heads % num_kv_heads:
        raise ValueError(f"q.shape[1] (num_heads) must be a positive multiple of the pool's "
                         f"num_kv_heads={num_kv_heads}, got {heads}")
    kind = _dtypes.float_kind(qa.dtype)
    if kind is None:
        hint = " (a uint16 array is never guessed to be bfloat16: pass ml_dtypes.bfloat16)" \
            if qa.dtype == np.uint16 else ""
        raise TypeError(f"q must be float32, float16 or bfloat16, got {qa.dtype}{hint}")
    return qa


def _owned(store):
    """Every array a pool or a KVCache owns (its storage, and its scales when
    it has them): what an ``out=`` must not overlap."""
    arrays = (store._storage, store._scales, store._layer_scales)
    return tuple(a for a in arrays if a is not None and not isinstance(a, (list, tuple)))


def _out_view(out, shape, what, owned):
    """A NumPy view of ``out`` after checking shape, dtype, writeability and
    that it does not overlap anything in ``owned`` (the storage and scales
    of the pool or cache)."""
    view = _host_view(out, "out")
    if tuple(view.shape) != shape:
        raise ValueError(f"out must have shape {shape} {what}, got {tuple(view.shape)}")
    if _dtypes.float_kind(view.dtype) is None:
        raise TypeError(f"out must be float32, float16 or bfloat16, got {view.dtype}")
    if not view.flags.writeable:
        raise ValueError("out must be writeable, got a read-only array")
    if any(np.may_share_memory(view, a) for a in owned):
        raise ValueError("out must not overlap the KV cache's storage or scales")
    return view


def _fill_out(view, result):
    """view[...] = result (float32), narrowing with round to nearest even."""
    if view.dtype == np.float32:
        view[...] = result
    else:
        from .convert import to_bfloat16, to_float16

        result = np.ascontiguousarray(result)
        if view.dtype == np.float16:
            to_float16(result, out=view)
        else:
            to_bfloat16(result, out=view)


# ------------------------------------------------------------------ the call
def paged_attention(q, pool, layer, block_tables, seq_lens, query_start_loc=None, scale=None,
                    sliding_window=None, logits_soft_cap=None, out=None):
    """Attention of ``q`` over the K/V of ``pool``'s ``layer``, read where it lies.

    Varlen queries with block tables (the FlashAttention / vLLM convention):
    prefill, chunked prefill, decode and mixed batches in one call.

    Parameters
    ----------
    q : array ``(num_query_tokens, num_heads, head_dim)``
        float32, float16 or bfloat16 (ml_dtypes, or a torch tensor).
        ``num_heads`` is a multiple of ``pool.num_kv_heads``: query head
        ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    pool : BlockPool
    layer : int
    block_tables : integer array ``(num_seqs, max_blocks)``
        Row ``s``: the blocks of sequence ``s`` in position order
        (:func:`kvcore.padded_block_tables`).  Entries past a sequence's
        length (or before its sliding window) are not read.
    seq_lens : integer array ``(num_seqs,)``
        KV length of each sequence, its query tokens included.
    query_start_loc : integer array ``(num_seqs + 1,)``, optional
        Cumulative query counts: sequence ``s`` owns query rows
        ``query_start_loc[s] .. query_start_loc[s+1]-1``.  Default: one
        query per sequence (decode).
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Each query sees only the last ``sliding_window`` positions up to and
        including its own.
    logits_soft_cap : float, optional
        ``c``: scores become ``c * tanh(score / c)`` before the softmax (Gemma 2).
    out : array ``(num_query_tokens, num_heads, head_dim)``, optional
        Writable float32 (or float16 / bfloat16) array or torch tensor;
        filled and returned.

    Returns
    -------
    numpy.ndarray (float32) or ``out``
        Query ``j`` of a sequence with ``m`` queries sits at position
        ``seq_lens[s] - m + j`` and attends to positions ``0..`` that
        position (causal).  Accumulated in float32 with an online softmax.

    Notes
    -----
    Raw like ``BlockPool.gather``: the caller vouches that the positions
    were written.  Runs on :func:`get_num_threads` threads without the GIL;
    the bits do not depend on the thread count.
    """
    if not isinstance(pool, BlockPool):
        raise TypeError(f"pool must be a kvcore.BlockPool, got {type(pool).__name__}")
    layer = layer_index(layer, pool.num_layers)
    if pool.device != "cpu":
        return _device_attention(q, pool._backend, pool.key_cache(layer), pool.value_cache(layer),
                                 _dtypes.storage_kind(pool.dtype), block_tables, seq_lens,
                                 query_start_loc, scale, sliding_window, logits_soft_cap, out,
                                 _lowprec_args(pool, layer), _owned(pool))
    return _attention(q, pool.key_cache(layer), pool.value_cache(layer),
                      _dtypes.storage_kind(pool.dtype), _owned(pool), block_tables, seq_lens,
                      query_start_loc, scale, sliding_window, logits_soft_cap, out,
                      _lowprec_args(pool, layer))


def _lowprec_args(store, layer):
    """``(key_scales, value_scales, k_scale, v_scale)`` of a low-precision
    pool or cache's layer (int8: its scale planes; fp8: its layer's
    scales), None for float storage."""
    kind = _dtypes.storage_kind(store.dtype)
    if kind == _dtypes.I8:
        return store.key_scales(layer), store.value_scales(layer), 1.0, 1.0
    if kind in _dtypes.FP8_KINDS:
        k_scale, v_scale = store.kv_scales[layer]
        return None, None, k_scale, v_scale
    return None


def _int64(a, arg):
    """1-D integer ``a`` as C-contiguous int64 (uint64 values past the int64
    range are an error here, before they could wrap)."""
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(a > np.iinfo(np.int64).max))
        raise ValueError(f"{arg}[{i}] = {int(a[i])} is out of range")
    return np.ascontiguousarray(a, dtype=np.int64)


def _int32_table(t):
    """2-D integer ``t`` as C-contiguous int32; entries outside the int32
    range become -1 (never a block id, so reading one is an error)."""
    if t.dtype == np.int32:
        return np.ascontiguousarray(t)
    if t.size and t.dtype.itemsize >= 4 and (t.min() < -2**31 or t.max() > 2**31 - 1):
        t = np.where((t >= -2**31) & (t <= 2**31 - 1), t, -1)
    return np.ascontiguousarray(t, dtype=np.int32)


def _index_args(num_tokens, head_dim, block_tables, seq_lens, query_start_loc, scale,
                sliding_window, logits_soft_cap, to_host=None):
    """The checked host forms of the integer and scalar arguments:
    ``(tables, lens, qsl, scale, window, cap)`` (window and cap 0 when off).
    ``to_host`` reads device index arrays (CUDA pools)."""
    if to_host is not None:
        block_tables = to_host(block_tables, "block_tables")
        seq_lens = to_host(seq_lens, "seq_lens")
        if query_start_loc is not None:
            query_start_loc = to_host(query_start_loc, "query_start_loc")
    tables = _int_array(block_tables, "block_tables", 2)
    num_seqs, max_blocks = tables.shape
    lens_in = _int_array(seq_lens, "seq_lens", 1)
    if lens_in.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must have one entry per row of block_tables ({num_seqs}), "
                         f"got shape {tuple(lens_in.shape)}")
    lens = _int64(lens_in, "seq_lens")
    if query_start_loc is None:
        if num_tokens != num_seqs:
            raise ValueError(
                f"without query_start_loc there is one query per sequence: q.shape[0] must be "
                f"num_seqs={num_seqs}, got {num_tokens}")
        qsl = np.arange(num_seqs + 1, dtype=np.int64)
    else:
        qsl_in = _int_array(query_start_loc, "query_start_loc", 1)
        if qsl_in.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                             f"got shape {tuple(qsl_in.shape)}")
        qsl = _int64(qsl_in, "query_start_loc")

    if scale is None:
        scale_v = 1.0 / math.sqrt(head_dim)
    else:
        scale_v = _float32_real(_real(scale, "scale"), "scale", allow_zero=True)
    # 0 tells the kernel "off"
    window = _positive_or_off(sliding_window, "sliding_window", index_int, "a positive integer")
    cap_v = _positive_or_off(logits_soft_cap, "logits_soft_cap", _real, "positive")
    if cap_v:
        cap_v = _float32_real(cap_v, "logits_soft_cap", allow_zero=False)
    return tables, lens, qsl, scale_v, window, cap_v


def _attention(q, key_cache, value_cache, kind, storage, block_tables, seq_lens,
               query_start_loc, scale, sliding_window, logits_soft_cap, out, lowprec=None):
    """Check everything, then run the kernel.  key_cache/value_cache:
    ``(num_blocks, num_kv_heads, block_size, head_dim)`` with contiguous
    rows, views of ``storage`` (a tuple of what ``out`` must not overlap)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    qa = _query_array(q, num_kv_heads, head_dim)
    num_tokens, num_heads, _ = qa.shape
    tables, lens, qsl, scale_v, window, cap_v = _index_args(
        num_tokens, head_dim, block_tables, seq_lens, query_start_loc, scale, sliding_window,
        logits_soft_cap)

    tables32 = _int32_table(tables)
    shape = (num_tokens, num_heads, head_dim)
    if out is not None:
        view = _out_view(out, shape, "(num_query_tokens, num_heads, head_dim)", storage)
        direct = (view.dtype == np.float32 and view.flags.c_contiguous and view.flags.aligned
                  and not np.may_share_memory(view, qa))
    # q as float32, C-contiguous (float16 and bfloat16 widen exactly)
    q32 = qa if qa.dtype == np.float32 and qa.flags.c_contiguous and qa.flags.aligned else \
        np.array(qa, dtype=np.float32, order="C")
    if out is None:
        result = target = np.empty(shape, np.float32)
    else:
        result = out
        target = view if direct else np.empty(shape, np.float32)
    # the integer arguments are checked in the same native call, before any work
    status, a, b = _kernel.paged_attention(q32, target, key_cache, value_cache, kind, tables32,
                                           lens, qsl, scale_v, window, cap_v, get_num_threads(),
                                           *(lowprec or ()))
    if status:
        _raise_table_error(status, a, b, tables, lens, qsl, block_size, num_blocks, num_tokens)
    if out is not None and not direct:
        _fill_out(view, target)
    return result


def _device_attention(q, be, key_cache, value_cache, kind, block_tables, seq_lens,
                      query_start_loc, scale, sliding_window, logits_soft_cap, out,
                      lowprec=None, owned=()):
    """``paged_attention`` on a device pool: the same checks, on the host
    (device index arrays are copied down, a synchronisation), before any
    work; then the backend's kernels.  ``q`` and ``out`` are device arrays
    (``q`` may be a pair ``(bits, kind)`` already read); ``lowprec`` the
    scales of fp8 / int8 pages (:func:`_lowprec_args`)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    qd, qkind = q if isinstance(q, tuple) else _arrays.float_input(be, q, "q")
    if qd.ndim != 3:
        raise ValueError(f"q must be 3-D (num_query_tokens, num_heads, head_dim), "
                         f"got shape {tuple(qd.shape)}")
    num_tokens, num_heads, dim = qd.shape
    if dim != head_dim:
        raise ValueError(f"q.shape[2] must be the pool's head_dim={head_dim}, got {dim}")
    if num_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q.shape[1] (num_heads) must be a positive multiple of the pool's "
                         f"num_kv_heads={num_kv_heads}, got {num_heads}")
    tables, lens, qsl, scale_v, window, cap_v = _index_args(
        num_tokens, head_dim, block_tables, seq_lens, query_start_loc, scale, sliding_window,
        logits_soft_cap, to_host=lambda x, arg: _arrays.index_array(be, x, arg))
    tables32 = _int32_table(tables)
    status, a, b = _kernel.check_tables(tables32, lens, qsl, num_tokens, num_blocks, block_size,
                                        window)
    if status:
        _raise_table_error(status, a, b, tables, lens, qsl, block_size, num_blocks, num_tokens)
    shape = (num_tokens, num_heads, head_dim)
    if out is not None:
        y, bf16 = _arrays.unwrap(out, "out")
        okind = _dtypes.BF16 if bf16 else _dtypes.array_kind(be.check_out(y, "out"), "out")
        obits, result = _arrays.out_array(be, out, "out", shape, okind)
        _check_device_out(be, obits, owned + (key_cache, value_cache))
    # q as float32, C-contiguous, on the device (a conversion kernel when needed)
    if qkind == _dtypes.F32 and qd.flags.c_contiguous and be._ptr(qd) % 4 == 0:
        q32 = qd
    else:
        q32 = be.empty(shape, "float32")
        be.convert(qd, qkind, q32, _dtypes.F32)
    direct = out is not None and okind == _dtypes.F32 and obits.flags.c_contiguous \
        and be._ptr(obits) % 4 == 0 and be.direct_out(obits, q32)
    target = obits if direct else be.empty(shape, "float32")
    be.paged_attention(q32, target, key_cache, value_cache, kind, tables32, lens, qsl, scale_v,
                       window, cap_v, lowprec)
    if out is None:
        return target
    if not direct:
        be.convert(target, _dtypes.F32, obits, okind)
    return result


def _check_device_out(be, obits, owned):
    """``out=`` on a device: apart from everything in ``owned`` (the pool's or
    cache's storage and scales), and every element naturally aligned (the
    kernels that fill it, direct or by conversion, store whole elements;
    a misaligned store faults on a GPU)."""
    for a in owned:
        if not be.direct_out(obits, a):
            raise ValueError("out must not overlap the KV cache's storage or scales")
    item = obits.itemsize
    if obits.size and (be._ptr(obits) % item or any(st % item for st in obits.strides)):
        raise ValueError(f"out must be aligned to its {item}-byte elements on {be.device} "
                         f"(address and strides multiples of {item}), got address "
                         f"{be._ptr(obits):#x} and strides {tuple(obits.strides)}")


def _raise_table_error(status, a, b, tables, lens, qsl, block_size, num_blocks, num_tokens):
    name = _kernel.STATUS_NAMES.get(status)
    if name == "BAD_SEQ_LEN":
        cap = tables.shape[1] * block_size
        raise ValueError(f"seq_lens must lie in 0..{cap} (block_tables.shape[1] * block_size "
                         f"= {tables.shape[1]} * {block_size}), got {int(lens[a])} at index {a}")
    if name == "BAD_FIRST_START":
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    if name == "DECREASING_START":
        raise ValueError(f"query_start_loc must be non-decreasing, got {int(qsl[a])} then "
                         f"{int(qsl[a + 1])} at index {a}")
    if name == "BAD_LAST_START":
        raise ValueError(f"query_start_loc[-1] must be q.shape[0]={num_tokens} (the number of "
                         f"query tokens), got {int(qsl[-1])}")
    if name == "SHORT_SEQ":
        raise ValueError(f"seq_lens[{a}] = {int(lens[a])} is less than the "
                         f"{int(qsl[a + 1] - qsl[a])} query tokens of sequence {a}: seq_lens "
                         "counts the queries too")
    if name == "BAD_BLOCK_ID":
        raise IndexError(f"block_tables[{a}, {b}] must be a block id in 0..{num_blocks - 1} "
                         f"(position {b * block_size} of sequence {a} is read), got "
                         f"{int(tables[a, b])}")
    raise AssertionError(f"unknown check status {status}")  # pragma: no cover


# ------------------------------------------------------------------ conveniences
def sequence_attention(seq, layer, q, scale=None, sliding_window=None, logits_soft_cap=None,
                       out=None):
    """``PagedKVCache.attention``: queries of positions ``num_computed ..
    num_computed + n - 1`` of ``seq``, causal over the sequence."""
    pool = seq.pool
    layer = layer_index(layer, pool.num_layers)
    qa = _host_view(q, "q")
    if qa.ndim != 3:
        raise ValueError(f"q must be 3-D (n, num_heads, head_dim), got shape {tuple(qa.shape)}")
    n = qa.shape[0]
    if n == 0:
        raise ValueError("q must hold at least one query token, got n=0")
    start = seq.num_computed
    written = seq.num_written(layer)
    if start + n > written:
        raise ValueError(
            f"the {n} queries sit at positions {start}..{start + n - 1}, but layer {layer} "
            f"holds {written} written positions: append (or mark_written) the step's K/V "
            f"for positions {written}..{start + n - 1} first")
    table = seq.block_table
    return paged_attention(q, pool, layer, table[None, :], np.array([start + n], np.int64),
                           query_start_loc=np.array([0, n], np.int64), scale=scale,
                           sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                           out=out)


def cache_attention(cache, layer, q, scale=None, sliding_window=None, logits_soft_cap=None,
                    out=None):
    """``KVCache.attention``: ``q`` ``(batch, num_heads, n, head_dim)`` are the
    queries of the layer's last ``n`` written positions; returns
    ``(batch, num_heads, n, head_dim)`` float32 (or ``out``)."""
    k = cache.key_cache(layer)    # checks layer
    v = cache.value_cache(layer)
    length = cache.layer_len(layer)
    batch, num_kv_heads, max_len, head_dim = k.shape
    device = cache.device != "cpu"
    if device:
        be = cache._backend
        qa, qkind = _arrays.float_input(be, q, "q")
    else:
        qa = _host_view(q, "q")
    if qa.ndim != 4:
        raise ValueError(f"q must be 4-D (batch_size, num_heads, n, head_dim) = ({batch}, "
                         f"num_heads, n, {head_dim}), got shape {tuple(qa.shape)}")
    if qa.shape[0] != batch:
        raise ValueError(f"q.shape[0] must be batch_size={batch}, got {qa.shape[0]}")
    num_heads, n = qa.shape[1], qa.shape[2]
    if qa.shape[3] != head_dim:
        raise ValueError(f"q.shape[3] must be head_dim={head_dim}, got {qa.shape[3]}")
    if n == 0:
        raise ValueError("q must hold at least one query position, got n=0")
    if n > length:
        raise ValueError(f"q holds {n} query positions but layer {layer} holds only {length} "
                         "written positions: update the layer with this step's K/V first")
    if num_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q.shape[1] (num_heads) must be a positive multiple of "
                         f"num_kv_heads={num_kv_heads}, got {num_heads}")
    shape = (batch, num_heads, n, head_dim)
    kind = _dtypes.storage_kind(cache.dtype)
    tables = np.arange(batch).reshape(batch, 1)   # one "block" per batch row
    lens = np.full(batch, length, np.int64)
    qsl = np.arange(0, batch * n + 1, n)
    if device:
        q_rows = be.xp.ascontiguousarray(qa.transpose(0, 2, 1, 3)).reshape(
            batch * n, num_heads, head_dim)
        if out is not None:
            y, bf16 = _arrays.unwrap(out, "out")
            okind = _dtypes.BF16 if bf16 else _dtypes.array_kind(be.check_out(y, "out"), "out")
            obits, result = _arrays.out_array(be, out, "out", shape, okind)
            _check_device_out(be, obits, _owned(cache))
        rows = _device_attention((q_rows, qkind), be, k, v, kind, tables, lens, qsl, scale,
                                 sliding_window, logits_soft_cap, None,
                                 _lowprec_args(cache, layer))
        res = rows.reshape(batch, n, num_heads, head_dim).transpose(0, 2, 1, 3)
        if out is None:
            return be.xp.ascontiguousarray(res)
        be.convert(res, _dtypes.F32, obits, okind)
        return result
    storage = _owned(cache)   # every layer's K and V, and the scales
    if out is not None:
        view = _out_view(out, shape, "(batch_size, num_heads, n, head_dim)", storage)
    # one "block" per batch row, block_size = max_seq_len
    q_rows = np.ascontiguousarray(qa.transpose(0, 2, 1, 3)).reshape(batch * n, num_heads,
                                                                    head_dim)
    rows = _attention(q_rows, k, v, kind, storage, tables, lens, qsl, scale, sliding_window,
                      logits_soft_cap, None, _lowprec_args(cache, layer))
    result = rows.reshape(batch, n, num_heads, head_dim).transpose(0, 2, 1, 3)
    if out is None:
        return np.ascontiguousarray(result)
    _fill_out(view, result)
    return out
