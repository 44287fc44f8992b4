"""Attention over the pages: ``kvcore.AttentionPlan``, ``kvcore.paged_attention``
and the thread count.

Every argument is checked here, before any work, and each error names the
argument, what was expected and what was given; then the backend of the
pool's device runs it (``Backend.attention_plan`` / ``attention_run``: on
the CPU the C kernels, which read K/V where they lie in the storage dtype,
without the GIL).  A plan checks the index arguments of a step once and
owns a snapshot of them; each layer's ``run`` checks only ``q``, the layer
and ``out``.  ``paged_attention``, ``PagedKVCache.attention`` and
``KVCache.attention`` are a plan and one run.
"""
import threading

import numpy as np

from . import _arrays
from . import _attention_args as _args
from . import dtypes as _dtypes
# (the thread count lives in kvcore._threads: the prefix stores read it too)
from ._threads import MAX_THREADS, get_num_threads, set_num_threads
from ._validate import MAX_LAYERS, index_int, layer_index
from .backends import CPU as _HOST, backend_of_array, codec_of, owned_index_arrays
from .pool import BlockPool

__all__ = ["AttentionPlan", "paged_attention", "set_num_threads", "get_num_threads"]


# ------------------------------------------------------------------ inputs
def _query_input(be, q, num_kv_heads, head_dim, what="the pool's "):
    """``(bits, kind)`` of ``q`` on ``be``'s device after checking its shape
    ``(num_query_tokens, num_heads, head_dim)`` and dtype (bfloat16 as its
    uint16 bits)."""
    y, bf16 = _arrays.unwrap(q, "q")
    qa = be.asarray(y, "q")
    if qa.ndim != 3:
        raise ValueError(f"q must be 3-D (num_query_tokens, num_heads, head_dim), "
                         f"got shape {tuple(qa.shape)}")
    n, heads, dim = qa.shape
    if dim != head_dim:
        raise ValueError(f"q.shape[2] must be {what}head_dim={head_dim}, got {dim}")
    if heads == 0 or heads % num_kv_heads or heads > _args.MAX_HEADS:
        raise ValueError(f"q.shape[1] (num_heads) must be a positive multiple of {what}"
                         f"num_kv_heads={num_kv_heads} up to {_args.MAX_HEADS}, got {heads}")
    return _float_bits(qa, bf16, "q")


def _float_bits(a, bf16, arg):
    """``(bits, kind)`` of a float array (a torch bfloat16 tensor's bits: ``bf16``)."""
    if bf16:
        return (a if a.dtype == np.uint16 else a.view(np.uint16)), _dtypes.BF16
    kind = _dtypes.float_kind(a.dtype)
    if kind is None:
        hint = " (a uint16 array is never guessed to be bfloat16: pass ml_dtypes.bfloat16)" \
            if a.dtype == np.uint16 else ""
        raise TypeError(f"{arg} must be float32, float16 or bfloat16, got {a.dtype}{hint}")
    return _dtypes.as_bits(a), kind


def _out_input(be, out, shape, owned):
    """``(bits, result, kind)`` for ``out=``: checked writeable, of ``shape``
    and a float dtype, apart from everything in ``owned`` (the storage and
    scales of the pool or cache).  A misaligned one is the backend's to fill
    (through an aligned temporary: a misaligned store faults on a GPU)."""
    y, bf16 = _arrays.writable(be, out, "out")
    okind = _dtypes.BF16 if bf16 else _dtypes.float_kind(y.dtype)
    if okind is None:
        raise TypeError(f"out must be float32, float16 or bfloat16, got {y.dtype}")
    obits, result = _arrays.out_array(be, out, "out", shape, okind)
    for a in owned:
        if be.overlaps(obits, a):
            raise ValueError("out must not overlap the KV cache's storage or scales")
    return obits, result, okind


# ------------------------------------------------------------------ sources
class _Source:
    """What a plan reads: ``views[layer]`` = the layer's ``(key_cache,
    value_cache)`` (``(num_blocks, num_kv_heads, block_size, head_dim)``
    views, rows contiguous) and ``codecs[layer]`` their ``(key_codec,
    value_codec)``, the backend of their device and everything an ``out=``
    must not overlap."""

    __slots__ = ("backend", "kind", "num_layers", "num_blocks", "num_kv_heads", "block_size",
                 "head_dim", "views", "codecs", "owned", "what", "guard")

    def __init__(self, backend, kind, shape, views, codecs, owned, what, guard=None):
        self.backend, self.kind, self.num_layers = backend, kind, len(views)
        self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim = shape
        self.views, self.codecs, self.owned, self.what = views, codecs, owned, what
        self.guard = guard                    # None, or raises once the planes' memory is gone


def _planes_of(backend, kind, planes, what):
    """A pool's or a KVCache's ``Planes`` as a plan source (a KVCache: one
    "block" per batch row, block_size = max_seq_len)."""
    return _Source(backend, kind, tuple(planes.views[0][0].shape), planes.views, planes.codecs,
                   planes.owned, what)


def _pool_source(pool):
    return _planes_of(pool._backend, pool._kind, pool._data.planes, "the pool's ")


def _cache_source(cache):
    return _planes_of(cache._backend, cache._kind, cache._planes, "")


def _planes_source(planes_in):
    """An engine's own ``(key_cache, value_cache)`` planes of the pool layout."""
    if not isinstance(planes_in, (tuple, list)) or len(planes_in) != 2:
        raise TypeError("pool_or_planes must be a kvcore.BlockPool or a pair (key_cache, "
                        f"value_cache), got {type(planes_in).__name__}")
    arrays = []
    for arg, x in zip(("key_cache", "value_cache"), planes_in):
        y, bf16 = _arrays.unwrap(x, arg)
        be = backend_of_array(y)
        a = be.asarray(y, arg)
        if not bf16 and a.dtype.kind in "iub" or _dtypes.lowprec_kind(a.dtype) is not None:
            raise TypeError(
                f"{arg} has dtype {a.dtype}: planes are read as float32, float16 or bfloat16 "
                "(ml_dtypes); low-precision (fp8 / int8) pages need their scales: keep them in "
                "a kvcore.BlockPool and plan over the pool")
        bits, kind = _float_bits(a, bf16, arg)
        arrays.append((be, bits, kind))
    (be, k, kind), (be_v, v, kind_v) = arrays
    if be_v is not be:
        raise ValueError("key_cache and value_cache must live on the same device")
    if kind != kind_v or k.shape != v.shape or k.strides != v.strides:
        raise ValueError(f"key_cache and value_cache must have the same dtype, shape and "
                         f"strides, got {k.dtype} {tuple(k.shape)} {k.strides} and {v.dtype} "
                         f"{tuple(v.shape)} {v.strides}")
    if k.ndim not in (4, 5) or 0 in k.shape:
        raise ValueError(f"key_cache must be ([num_layers,] num_blocks, num_kv_heads, "
                         f"block_size, head_dim) with no empty axis, got {tuple(k.shape)}")
    if k.ndim == 5 and k.shape[0] > MAX_LAYERS:
        raise ValueError(f"key_cache must have at most {MAX_LAYERS} layers (its first axis), "
                         f"got {k.shape[0]}")
    if k.strides[-1] != k.itemsize:
        raise ValueError(f"key_cache rows must be contiguous (last stride {k.itemsize}), got "
                         f"strides {k.strides}")
    if any(st % k.itemsize for st in k.strides) or be._ptr(k) % k.itemsize \
            or be._ptr(v) % k.itemsize:
        raise ValueError(f"key_cache and value_cache must be aligned to their elements "
                         f"({k.itemsize} bytes), got addresses {be._ptr(k):#x} and "
                         f"{be._ptr(v):#x}, strides {k.strides}")
    views = [(k[l], v[l]) for l in range(k.shape[0])] if k.ndim == 5 else [(k, v)]
    plain = codec_of(kind)
    return _Source(be, kind, tuple(k.shape[-4:]), views, [(plain, plain)] * len(views), (k, v),
                   "the planes' ",
                   guard=_arrays.memory_guard(zip(("key_cache", "value_cache"), planes_in)))


def _heads(src, num_heads, arg):
    """``num_heads`` checked as a plan's query head count (``arg`` names it)."""
    if not 0 < num_heads <= _args.MAX_HEADS or num_heads % src.num_kv_heads:
        raise ValueError(f"{arg} must be a positive multiple of {src.what}num_kv_heads="
                         f"{src.num_kv_heads} up to {_args.MAX_HEADS}, got {num_heads}")
    return num_heads


def _source(pool_or_planes):
    if isinstance(pool_or_planes, BlockPool):
        return _pool_source(pool_or_planes)
    if isinstance(pool_or_planes, (tuple, list)):
        return _planes_source(pool_or_planes)
    raise TypeError("pool_or_planes must be a kvcore.BlockPool or a pair (key_cache, "
                    f"value_cache) of arrays, got {type(pool_or_planes).__name__}")


# ------------------------------------------------------------------ the plan
class AttentionPlan:
    """Attention of one step, planned once and run per layer.

    Parameters
    ----------
    pool_or_planes : BlockPool or (key_cache, value_cache)
        The KV to attend over: a pool (any dtype, any device), or an
        engine's own planes of the pool layout, ``(num_layers, num_blocks,
        num_kv_heads, block_size, head_dim)`` or ``(num_blocks,
        num_kv_heads, block_size, head_dim)`` float32 / float16 / bfloat16
        arrays (NumPy, torch, CuPy) with contiguous rows.  fp8 and int8
        pages need their scales: plan over a ``BlockPool`` for those.
    block_tables, seq_lens, query_start_loc
        As :func:`paged_attention`; checked here, once (every block id a run
        can read must lie in ``0..num_blocks - 1``), and copied: changing
        the arrays afterwards changes nothing.
    scale, logits_soft_cap
        As :func:`paged_attention`.
    sliding_window, chunk_size : int or sequence, optional
        As :func:`paged_attention` (every layer), or one entry per layer
        (``num_layers`` of them, each None or 0 for off, or a positive int):
        models whose layers differ (Gemma 2/3 alternate windowed and global
        layers, Llama 4 chunked and global ones).
    alibi_slopes, sinks : float array, optional
        As :func:`paged_attention`, ``(num_heads,)`` for every layer or
        ``(num_layers, num_heads)`` per layer; copied (float32) here.
        Their ``num_heads`` is the plan's: every run's ``q.shape[1]``.
    num_threads : int, optional
        CPU threads of each run (default :func:`get_num_threads` now).
    num_heads : int, optional
        Query heads; the plan is then built now, else at the first run
        (for that run's ``q.shape[1]``).

    Notes
    -----
    ``run`` checks only ``q``, ``layer`` and ``out`` and allocates nothing
    when ``out`` is a float32 C-contiguous array.  One run at a time per
    plan: a run that finds another in progress on the same plan raises
    RuntimeError (use one plan per thread; the results have the same bits
    for every thread count).  The plan holds the pool's arrays, never reads
    past them, and does not see later changes to the block tables of the
    sequences: plan again when a step's tables change.  A step whose layers
    differ in window or chunk makes one backend plan per kind of layer.
    """

    def __init__(self, pool_or_planes, block_tables, seq_lens, query_start_loc=None, *,
                 scale=None, sliding_window=None, logits_soft_cap=None, chunk_size=None,
                 alibi_slopes=None, sinks=None, num_threads=None, num_heads=None):
        src = _source(pool_or_planes)
        if num_threads is None:
            threads = get_num_threads()
        else:
            threads = index_int(num_threads, "num_threads")
            if not 1 <= threads <= MAX_THREADS:
                raise ValueError(f"num_threads must be in 1..{MAX_THREADS} or None, got "
                                 f"{threads}")
        if num_heads is not None:
            num_heads = _heads(src, index_int(num_heads, "num_heads"), "num_heads")
        self._setup(src, block_tables, seq_lens, query_start_loc, threads, None, num_heads,
                    scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    chunk_size=chunk_size, alibi_slopes=alibi_slopes, sinks=sinks)
        self._bindable = True
        heads = self._heads if self._heads is not None else num_heads
        if heads is not None:
            self._plan_for(heads, 0)

    @classmethod
    def _make(cls, src, block_tables, seq_lens, query_start_loc, num_tokens, layer, **features):
        """A plan over a checked source for ``num_tokens`` queries and the
        one layer ``layer`` (the one-call paths, whose errors name
        ``q.shape[0]``); ``features``: the keywords of ``__init__``."""
        self = cls.__new__(cls)
        self._setup(src, block_tables, seq_lens, query_start_loc, get_num_threads(),
                    num_tokens, None, only_layer=layer, **features)
        self._bindable = False      # (run once: no fast path to set up)
        return self

    def _setup(self, src, block_tables, seq_lens, query_start_loc, threads, num_tokens,
               num_heads, *, scale=None, sliding_window=None, logits_soft_cap=None,
               chunk_size=None, alibi_slopes=None, sinks=None, only_layer=None):
        be = src.backend
        tables, lens, qsl, num_tokens, scale_v, cap_v = _args.step_args(
            be, num_tokens, src.head_dim, block_tables, seq_lens, query_start_loc, scale,
            logits_soft_cap)
        layers = src.num_layers
        windows = _args.layer_lengths(sliding_window, "sliding_window", layers)
        chunks = _args.layer_lengths(chunk_size, "chunk_size", layers)
        if only_layer is not None:     # (one call: its layer's kind only)
            windows, chunks = (windows[only_layer],) * layers, (chunks[only_layer],) * layers
        alibi = _args.head_rows(alibi_slopes, "alibi_slopes", layers,
                                limit=_args.ALIBI_SLOPE_LIMIT)
        sink_rows = _args.head_rows(sinks, "sinks", layers)
        fixed = None      # the query heads the slopes and sinks fix
        for arg, rows in (("alibi_slopes", alibi), ("sinks", sink_rows)):
            if rows is None:
                continue
            heads = _heads(src, rows.shape[1], f"{arg}'s num_heads (its last axis)")
            if num_heads is not None and heads != num_heads:
                raise ValueError(f"{arg} must have num_heads={num_heads} entries per layer (the "
                                 f"plan's query heads), got {heads}")
            num_heads = fixed = heads
        be.check_attention_features(max(chunks), alibi is not None, sink_rows is not None)
        kinds = tuple(zip(windows, chunks))
        # the plan's own copies, made before the check: every later backend
        # plan is built from (and holds) what was checked
        tables32, lens, qsl = owned_index_arrays(_args.int32_table(tables), lens, qsl)
        distinct = sorted(set(kinds))
        status, a, b = _args.check_tables(_HOST, tables32, lens, qsl, num_tokens, src.num_blocks,
                                          src.block_size, distinct)
        if status is not None:
            _args.raise_table_error(status, a, b, tables, lens, qsl, src.block_size,
                                    src.num_blocks, num_tokens)
        self._src = src
        self._tables, self._lens, self._qsl = tables32, lens, qsl
        self._num_tokens = num_tokens
        self._scale, self._cap, self._threads = scale_v, cap_v, threads
        self._kinds = kinds                  # (window, chunk) of each layer, 0: off
        self._mixed = len(distinct) > 1      # layers of several kinds
        self._heads = fixed                  # query heads fixed at plan time, or None
        # host rows (the CPU fast path binds them) and the device's (runs)
        self._alibi_host, self._sinks_host = alibi, sink_rows
        self._alibi = None if alibi is None else be.from_host(alibi)
        self._sinks = None if sink_rows is None else be.from_host(sink_rows)
        self._plans = {}
        self._bound = False
        self._fast = None
        self._lock = threading.Lock()

    @property
    def num_query_tokens(self):
        """The ``q.shape[0]`` every run takes."""
        return self._num_tokens

    @property
    def num_layers(self):
        """Layers a run may name (``0..num_layers - 1``)."""
        return self._src.num_layers

    @property
    def num_threads(self):
        """CPU threads a run may use (fixed when the plan is made; a run
        with little work uses fewer)."""
        return self._threads

    def _kind_plan(self, num_heads, kind):
        """The backend plan for ``num_heads`` query heads and layer kind
        ``(window, chunk)`` (made once; the plans of a step take turns)."""
        key = (num_heads,) + kind
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        src = self._src
        plan = src.backend.attention_plan(
            self._tables, self._lens, self._qsl, num_heads=num_heads,
            num_kv_heads=src.num_kv_heads, head_dim=src.head_dim, block_size=src.block_size,
            num_blocks=src.num_blocks, kind=src.kind, scale=self._scale,
            sliding_window=kind[0], soft_cap=self._cap, chunk_size=kind[1],
            num_threads=self._threads)
        if self._plans:     # (the plans of a step take turns: a host plan's guard)
            share = getattr(plan, "share_guard", None)
            if share is not None:
                share(next(iter(self._plans.values())))
        self._plans[key] = plan
        return plan

    def _plan_for(self, num_heads, layer):
        """The backend plan of ``layer`` for ``num_heads`` query heads; the
        first call also sets up the backend's fast path, when it has one."""
        plan = self._kind_plan(num_heads, self._kinds[layer])
        if self._bindable and not self._bound:
            self._bound = True
            self._fast = self._bind(num_heads)
        return plan

    def _bind(self, num_heads):
        """``plan.bind(...)``'s fast run (host backends with one), or None.

        Layer ``l``'s planes lie ``l`` layer strides past layer 0's (the
        pool's storage, 5-D planes and a KVCache's storage all stack their
        layers): the backend measures the stride from layer 0 and the last
        layer.  Layers of several kinds: every kind's plan is made now, and
        each layer runs on its kind's."""
        plans = [self._kind_plan(num_heads, kind) for kind in self._kinds] if self._mixed \
            else [self._kind_plan(num_heads, self._kinds[0])]
        bind = getattr(plans[0], "bind", None)
        if bind is None:
            return None
        src = self._src
        k0, v0 = src.views[0]
        kl, vl = src.views[-1]
        extra = {}
        if src.kind in _dtypes.LOWPREC_KINDS:
            extra["codecs"] = src.codecs
        if self._mixed:
            extra["layer_plans"] = plans
        if self._alibi_host is not None:
            extra["alibi"] = self._alibi_host
        if self._sinks_host is not None:
            extra["sinks"] = self._sinks_host
        owned = tuple(a for a in src.owned if isinstance(a, np.ndarray))
        return bind(k0, v0, kl, vl, src.num_layers, owned=owned, **extra)

    def __reduce__(self):
        # (copy.copy, copy.deepcopy and pickle all come here)
        raise TypeError("a kvcore.AttentionPlan is not copied or pickled: it refers to its "
                        "pool's memory; make another AttentionPlan(...) (planning is cheap), "
                        "or run this one from any thread")

    def run(self, q, layer, out=None):
        """Attention of ``q`` over layer ``layer``, as planned.

        Parameters
        ----------
        q : array ``(num_query_tokens, num_heads, head_dim)``
            float32, float16 or bfloat16, on the pool's device.
        layer : int
        out : array, optional
            As :func:`paged_attention`'s ``out``; a float32 C-contiguous
            one is written in place with no allocation.

        Returns
        -------
        float32 array (or ``out``)
        """
        if self._src.guard is not None:
            self._src.guard()
        fast = self._fast
        if fast is not None:
            result = fast(q, layer, out)
            if result is not NotImplemented:
                return result
        return self._run(q, layer, out)

    def _run(self, q, layer, out, checked_q=None):
        """The general run: any input the public API takes, every error named."""
        src = self._src
        be = src.backend
        if checked_q is None:   # (q copied first: reading out's storage may run the caller's code)
            (q,), private, out_check = _arrays.private_inputs((q,), (layer,), out, names=("q",))
        else:
            private, out_check = False, _arrays.out_guard(out, layer, q)
        layer = layer_index(layer, src.num_layers)
        if checked_q is None:
            qbits, qkind = _query_input(be, q, src.num_kv_heads, src.head_dim, src.what)
            if private:     # (converting out may run the caller's code, which may free q)
                qbits = qbits.copy()
        else:
            qbits, qkind = checked_q
        num_tokens, num_heads, _ = qbits.shape
        if num_tokens != self._num_tokens:
            raise ValueError(f"q.shape[0] must be the plan's num_query_tokens="
                             f"{self._num_tokens}, got {num_tokens}")
        if self._heads is not None and num_heads != self._heads:
            raise ValueError(f"q.shape[1] must be the plan's num_heads={self._heads} (the "
                             f"heads of its alibi_slopes / sinks), got {num_heads}")
        plan = self._plan_for(num_heads, layer)
        shape = tuple(qbits.shape)
        if out is not None:
            obits, result, okind = _out_input(be, out, shape, src.owned)
        # q and out as the backend takes them, C-contiguous: float32, or
        # float16 / bfloat16 where its kernels read / write them themselves
        # (else q is widened to float32, exactly, and the result narrowed)
        q_kinds, out_kinds = be.attention_io_kinds(plan)
        if qkind in q_kinds and qbits.flags.c_contiguous \
                and be._ptr(qbits) % qbits.itemsize == 0:
            qin = qbits
        else:
            qin = be.empty(shape, "float32")
            be.convert(qbits, qkind, qin, _dtypes.F32)
        direct = out is not None and okind in out_kinds and obits.flags.c_contiguous \
            and be._ptr(obits) % obits.itemsize == 0 and not be.overlaps(obits, qin)
        target = obits if direct else be.empty(shape, "float32")
        if src.guard is not None:    # (again: converting layer, q and out ran the caller's code)
            src.guard()
        if out_check is not None:
            out_check()
        key_cache, value_cache = src.views[layer]
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this AttentionPlan is already running (one run at a time per "
                               "plan: use one plan per thread)")
        try:
            be.attention_run(plan, qin, target, key_cache, value_cache, src.codecs[layer],
                             alibi_slopes=None if self._alibi is None else self._alibi[layer],
                             sinks=None if self._sinks is None else self._sinks[layer])
        finally:
            self._lock.release()
        if out is None:
            return target
        if not direct:
            be.convert(target, _dtypes.F32, obits, okind)
        return result


# ------------------------------------------------------------------ the call
def paged_attention(q, pool, layer, block_tables, seq_lens, query_start_loc=None, scale=None,
                    sliding_window=None, logits_soft_cap=None, out=None, *, chunk_size=None,
                    alibi_slopes=None, sinks=None):
    """Attention of ``q`` over the K/V of ``pool``'s ``layer``, read where it lies.

    Varlen queries with block tables (the FlashAttention / vLLM convention):
    prefill, chunked prefill, decode and mixed batches in one call.  The
    same as ``AttentionPlan(pool, block_tables, seq_lens, query_start_loc,
    ...).run(q, layer, out)``: a step over many layers plans once
    (:class:`AttentionPlan`).

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
        Sequence ``s`` owns query rows ``query_start_loc[s] ..
        query_start_loc[s + 1] - 1`` (0 first, ``num_query_tokens`` last);
        default one query per sequence (decode).
    scale : float, optional
        Default ``1 / sqrt(head_dim)``; 0 or a magnitude in ``[2**-126,
        FLT_MAX / log2(e)]`` (the kernels compute in float32; every such
        scale gives a finite result where the float32 dots are finite: a
        huge one the one-hot limit, see docs/api.md).
    sliding_window : int, optional
        Each query sees only the last ``sliding_window`` positions up to and
        including its own.
    logits_soft_cap : float, optional
        ``c``: scores become ``c * tanh(score / c)`` before the softmax
        (Gemma 2); ``c`` in ``[2**-126, FLT_MAX / log2(e)]``.
    out : array ``(num_query_tokens, num_heads, head_dim)``, optional
        Writable float32 (or float16 / bfloat16) array or torch tensor,
        apart from the pool's storage and scales; filled and returned.
    chunk_size : int, optional
        Chunked attention (Llama 4): a query at position ``p`` sees no
        position before ``(p // chunk_size) * chunk_size``, the start of its
        chunk (with a window too: the later of the two starts).
    alibi_slopes : float array ``(num_heads,)``, optional
        ALiBi (BLOOM, MPT, Falcon): ``alibi_slopes[h] * (t - p)`` is added to
        query head ``h``'s score of key position ``t`` (after the soft
        cap).  Finite values, any float dtype, NumPy / torch / CuPy.
    sinks : float array ``(num_heads,)``, optional
        Attention sinks (gpt-oss): a logit per query head, in the scores'
        natural-log units, joining each row's softmax denominator:
        ``w_t = exp(x_t) / (sum_t' exp(x_t') + exp(sinks[h]))``.

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
    # where converting an argument may run the caller's code: q copied
    # before it runs, out checked after it ran (it may free or resize them)
    others = (layer, block_tables, seq_lens, query_start_loc, scale, sliding_window,
              logits_soft_cap, chunk_size, alibi_slopes, sinks)
    (q,), _, out_check = _arrays.private_inputs((q,), others, out, names=("q",))
    layer = layer_index(layer, pool.num_layers)
    src = _pool_source(pool)
    checked = _query_input(src.backend, q, src.num_kv_heads, src.head_dim)
    plan = AttentionPlan._make(src, block_tables, seq_lens, query_start_loc,
                               checked[0].shape[0], layer, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               chunk_size=chunk_size, alibi_slopes=alibi_slopes, sinks=sinks)
    # the run's own fast path when the backend has one (fewer Python-level
    # checks than the general run, the same results)
    plan._bindable = True
    if plan._heads in (None, checked[0].shape[1]):
        plan._plan_for(checked[0].shape[1], layer)
    if out_check is not None:
        out_check()
    return plan.run(q, layer, out)


def _attention(q, key_cache, value_cache, kind, storage, block_tables, seq_lens,
               query_start_loc, scale, sliding_window, logits_soft_cap, out, codecs=None):
    """``paged_attention`` over raw planes ``(num_blocks, num_kv_heads,
    block_size, head_dim)`` of storage ``kind`` (``codecs`` their
    ``(key_codec, value_codec)``, default unscaled; ``out`` may not overlap
    ``storage``).  Checked like ``paged_attention``; tests compare the CUDA
    emulation with it (tests/_cuda_cases.py)."""
    if codecs is None:
        codecs = (codec_of(kind),) * 2
    src = _Source(backend_of_array(key_cache), kind, tuple(key_cache.shape),
                  [(key_cache, value_cache)], [codecs], (storage,), "the pool's ")
    checked = _query_input(src.backend, q, src.num_kv_heads, src.head_dim)
    plan = AttentionPlan._make(src, block_tables, seq_lens, query_start_loc,
                               checked[0].shape[0], 0, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return plan._run(q, 0, out, checked)


# ------------------------------------------------------------------ conveniences
def sequence_attention(seq, layer, q, scale=None, sliding_window=None, logits_soft_cap=None,
                       out=None, **features):
    """``PagedKVCache.attention``: queries of positions ``num_computed ..
    num_computed + n - 1`` of ``seq``, causal over the sequence
    (``features``: ``chunk_size``, ``alibi_slopes``, ``sinks``)."""
    pool = seq.pool
    # q converted once (its conversion may run the caller's code): the
    # sequence is read after it, and the run takes the converted q; where
    # an argument's conversion may run the caller's code, q is copied before
    # it runs and out checked after
    others = (layer, scale, sliding_window, logits_soft_cap, *features.values())
    (q,), private, out_check = _arrays.private_inputs((q,), others, out, names=("q",))
    layer = layer_index(layer, pool.num_layers)
    src = _pool_source(pool)
    checked = _query_input(src.backend, q, src.num_kv_heads, src.head_dim)   # the q rule
    if private:
        checked = (checked[0].copy(), checked[1])
    n = checked[0].shape[0]
    if n == 0:
        raise ValueError("q must hold at least one query token, got n=0")
    start = seq.num_computed
    written = seq.num_written(layer)
    if start + n > written:
        raise ValueError(
            f"the {n} queries sit at positions {start}..{start + n - 1}, but layer {layer} "
            f"holds {written} written positions: append (or mark_written) the step's K/V "
            f"for positions {written}..{start + n - 1} first")
    held = seq._seq.table
    table = seq.block_table
    plan = AttentionPlan._make(src, table[None, :], np.array([start + n], np.int64),
                               np.array([0, n], np.int64), n, layer, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               **features)
    if out_check is not None:
        out_check()
    result = plan._run(q, layer, out, checked)
    seq._unchanged_by("attention", held, layer, start + n)   # (out's conversion: the caller's code)
    return result


def cache_attention(cache, layer, q, scale=None, sliding_window=None, logits_soft_cap=None,
                    out=None, **features):
    """``KVCache.attention``: ``q`` ``(batch, num_heads, n, head_dim)`` are the
    queries of the layer's last ``n`` written positions; returns
    ``(batch, num_heads, n, head_dim)`` float32 (or ``out``).  A plan over
    the cache (one "block" per batch row, block_size = max_seq_len) and one
    run (``features``: ``chunk_size``, ``alibi_slopes``, ``sinks``)."""
    k = cache.key_cache(layer)    # checks layer
    layer = layer_index(layer, cache.num_layers)
    length = cache.layer_len(layer)
    batch, num_kv_heads, max_len, head_dim = k.shape
    be = cache._backend
    y, bf16 = _arrays.unwrap(q, "q")
    qa = be.asarray(y, "q")
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
    qbits, qkind = _float_bits(qa, bf16, "q")
    shape = (batch, num_heads, n, head_dim)
    src = _cache_source(cache)
    if out is not None:
        obits, result, okind = _out_input(be, out, shape, src.owned)
    tables = np.arange(batch).reshape(batch, 1)   # one "block" per batch row
    lens = np.full(batch, length, np.int64)
    qsl = np.arange(0, batch * n + 1, n)
    q_rows = be.xp.ascontiguousarray(qbits.transpose(0, 2, 1, 3)).reshape(
        batch * n, num_heads, head_dim)
    plan = AttentionPlan._make(src, tables, lens, qsl, batch * n, layer, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               **features)
    rows = plan._run(None, layer, None, (q_rows, qkind))
    res = rows.reshape(batch, n, num_heads, head_dim).transpose(0, 2, 1, 3)
    if out is None:
        return be.xp.ascontiguousarray(res)
    be.convert(res, _dtypes.F32, obits, okind)
    return result
