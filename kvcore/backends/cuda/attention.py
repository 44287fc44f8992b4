"""The attention ops of the CUDA backend: plans and runs of
``kernels/attention.cu`` (through ``attention_kernels``).

``CudaBackend`` (``backend.py``, the data ops) holds a ``CudaAttention``: it
has no state of its own beside its backend and the kernel version, and
calls the backend's device hooks (``_ctx``, ``_upload``, ``_record_event``,
...) and launches through the backend's ``launcher``, so the host emulation
of the tests, which overrides those, runs it as it runs the data ops.
"""
import os
import threading

import numpy as np

from ... import dtypes
from ..codec import Codec
from . import attention_kernels


# What attention_run takes as q and out, per kernel version (Backend.attention_io_kinds).
_F32_ONLY = frozenset({dtypes.F32})
_FLOATS = frozenset({dtypes.F32, dtypes.F16, dtypes.BF16})
# KVCORE_CUDA_ATTENTION: the attention kernels of new plans ("v3", the
# default; "v2": the kernels before the tensor-core decode, float32 q and
# out only, kept for a before/after in one process).
VERSIONS = {"v2": 2, "2": 2, "v3": 3, "3": 3}


def default_attention_version(environ=os.environ):
    """The kernel version KVCORE_CUDA_ATTENTION names (3 when unset)."""
    text = environ.get("KVCORE_CUDA_ATTENTION", "").strip().lower()
    if not text:
        return 3
    if text not in VERSIONS:
        raise ValueError(f"KVCORE_CUDA_ATTENTION must be v2 or v3 (or unset), got {text!r}")
    return VERSIONS[text]


class CudaAttention:
    """``attention_plan``, ``attention_run`` and ``paged_attention`` of
    ``CudaBackend`` ``backend`` (see ``kvcore.backends.base.Backend`` for the
    contract)."""

    def __init__(self, backend):
        self._be = backend
        # The kernel version of new plans: 3 or 2 (None: KVCORE_CUDA_ATTENTION's);
        # the backend's ``attention_version``.  A plan keeps its own.
        self.attention_version = None

    def _attention_version(self):
        v = self.attention_version
        if v is None:
            return default_attention_version()
        if v not in (2, 3):
            raise ValueError(f"attention_version must be 2 or 3 (or None), got {v!r}")
        return v

    def attention_io_kinds(self, plan):
        """``(q_kinds, out_kinds)``: the element kinds ``attention_run``
        reads ``q`` and writes ``out`` in for ``plan``; version 3 plans take
        float16 and bfloat16 (bits as uint16) besides float32."""
        return (_FLOATS, _FLOATS) if plan.version >= 3 else (_F32_ONLY, _F32_ONLY)

    def attention_plan(self, block_tables, seq_lens, query_start_loc, *, num_heads,
                       num_kv_heads, head_dim, block_size, num_blocks, kind, scale,
                       sliding_window, soft_cap, chunk_size=0, num_threads=None):
        """Plan attention calls of one step (``kernels/attention.cu``): the
        work split and every index array, uploaded once, living on the
        device.

        block_tables, seq_lens, query_start_loc : host int32 / int64 /
            int64 arrays, already checked by the public layer (every block
            id a run can read in ``0..num_blocks-1``)
        scale, sliding_window, soft_cap : float, int (0: off), float (0: off)
        chunk_size : int, 0: off (a query sees no key before its chunk's start)
        num_threads : ignored (the GPU's split is sized by the plan)

        Returns a ``CudaAttentionPlan`` for ``attention_run``.  The uploads
        are issued on the current stream and an event records their end: a
        run on another stream waits for it (on the device), so the plan may
        be made on one stream and run on others.  Version 3 plans hold the
        items of the float32 kernels and, where the pages allow, of the
        tensor-core decode: a run picks by its q's kind.
        """
        ak = attention_kernels
        dim = int(head_dim)
        if dim not in ak.HEAD_DIMS:
            raise ValueError(f"the CUDA attention kernels take head_dim in {ak.HEAD_DIMS}, "
                             f"got {dim}")
        qsl_h = np.ascontiguousarray(query_start_loc, np.int64)
        num_tokens = int(qsl_h[-1]) if qsl_h.size else 0
        plan = CudaAttentionPlan(
            num_tokens=num_tokens, num_heads=int(num_heads), num_kv_heads=int(num_kv_heads),
            head_dim=dim, block_size=int(block_size), num_blocks=int(num_blocks), kind=kind,
            scale=float(scale), sliding_window=int(sliding_window), soft_cap=float(soft_cap),
            chunk_size=int(chunk_size), version=self._attention_version(),
            backend=self._be)
        if num_tokens == 0:
            return plan
        rows = prefill = prefill_tc = None   # prefill rows go to a tensor-core kernel
        seqs = None                          # the sequences of the other rows
        if plan.version >= 3 and kind in ak.PREFILL_KINDS and self._be._has_mma() \
                and ak.prefill_tc_smem(dim) <= self._be.launcher.smem_optin():
            prefill_tc, mask = ak.prefill_tc_plan(qsl_h, seq_lens, plan.num_heads,
                                                  plan.num_kv_heads, plan.sliding_window, dim,
                                                  chunk_size=plan.chunk_size)
            if len(prefill_tc):
                rows = ~mask
                seqs = np.diff(qsl_h) < ak.PREFILL_MIN_QUERIES
        if prefill_tc is None and ak.prefill_ok(kind, dim, plan.num_heads, plan.num_kv_heads) \
                and self._be._has_mma():   # the older kernel (version 2)
            prefill, mask = ak.prefill_plan(qsl_h, plan.num_heads, plan.num_kv_heads)
            if len(prefill):
                rows = ~mask
                seqs = np.diff(qsl_h) < ak.PREFILL_MIN_QUERIES
        items, nsplit, merge_rows = ak.plan(qsl_h, seq_lens, plan.num_heads, plan.num_kv_heads,
                                            plan.sliding_window, num_sms=self._be._sm_count(),
                                            rows=rows, chunk_size=plan.chunk_size)
        self._be._check_rows(len(items), "paged_attention (work items)")
        tc = None
        if (plan.version >= 3 and kind in ak.TC_KINDS and dim in ak.TC_HEAD_DIMS
                and self._be._has_mma()
                and ak.tc_smem(kind, dim) <= self._be.launcher.smem_optin()):
            tc, tc_nsplit = ak.tc_plan(qsl_h, seq_lens, plan.num_heads, plan.num_kv_heads,
                                       plan.sliding_window, num_sms=self._be._sm_count(),
                                       seqs=seqs, chunk_size=plan.chunk_size)
            if not len(tc) or int((tc[:, 5] - tc[:, 4]).max()) + plan.block_size \
                    >= ak.TC_MAX_KEYS:
                tc = None
            else:
                self._be._check_rows(len(tc), "paged_attention (tensor-core items)")
        partials = 0
        with self._be._ctx():
            if len(items):
                plan.items = self._be._upload(items)
                plan.nsplit = self._be._upload(nsplit)
            if prefill is not None and len(prefill):
                self._be._check_rows(len(prefill), "paged_attention (prefill items)")
                plan.prefill = self._be._upload(prefill)
            if prefill_tc is not None and len(prefill_tc):
                self._be._check_rows(len(prefill_tc), "paged_attention (prefill items)")
                plan.prefill_tc = self._be._upload(prefill_tc)
            plan.tables = self._be._upload(np.ascontiguousarray(block_tables, np.int32))
            plan.lens = self._be._upload(np.ascontiguousarray(seq_lens, np.int64))
            plan.qsl = self._be._upload(qsl_h)
            if len(merge_rows):
                plan.merge_rows = self._be._upload(merge_rows)
                partials = len(items) * ak.CHUNK_HEADS * (dim + 2)
            if tc is not None:
                plan.tc_items = self._be._upload(tc)
                plan.tc_nsplit = self._be._upload(tc_nsplit)
                plan.counters = self._be._upload(np.zeros(len(tc), np.int32))
                if int(tc_nsplit.max()) > 1:
                    partials = max(partials, len(tc) * ak.TC_ROWS * (dim + 2))
            if partials:   # one buffer: a run uses one kernel family's partials
                plan.partials = self._be.xp.empty(partials, np.float32)
            plan.ready = self._be._record_event()
        plan.launches = self.launches(plan)
        return plan

    def launches(self, plan):
        """The plan's launches, packed: ``{path: [PackedLaunch]}``, path
        ``("tc", q kind)``, ``("core", tiled)`` or ``"prefill"``; a run
        fills the holes (q, out, the layer's planes, scales and strides)."""
        ak = attention_kernels
        file = ak.ATTENTION_FILE.name
        H = Hole
        out, q, k, v = H("out", "p"), H("q", "p"), H("k", "p"), H("v", "p")
        strides = [H("cb", "i"), H("ch", "i"), H("ct", "i")]
        qk, ok = H("qk", "i"), H("ok", "i")
        ks, vs = H("ks", "f"), H("vs", "f")
        geometry = [plan.tables, plan.lens, plan.qsl]
        G = plan.num_heads // plan.num_kv_heads
        dim, kind = plan.head_dim, plan.kind
        shape = [plan.tables.shape[1] if plan.tables is not None else 0, plan.block_size]
        feats = [plan.scale, plan.sliding_window, plan.soft_cap, plan.chunk_size,
                 H("alibi", "p"), H("sinks", "p")]
        launches = {}
        if plan.tc_items is not None:
            for mt in ak.tc_mma_kinds(kind):
                launches[("tc", mt)] = [PackedLaunch(
                    self._be, file, ak.tc_name(kind, dim, mt), plan.tc_items.shape[0],
                    ak.TC_THREADS,
                    [out, plan.partials, plan.counters, q, k, v, *geometry, plan.tc_items,
                     plan.tc_nsplit, plan.num_heads, G, *shape, *strides, *feats, ks, vs, ok],
                    smem=ak.tc_smem(kind, dim))]
        if plan.items is not None:
            for tiled in (True, False):
                split = ak.split_name if tiled else ak.scalar_name
                run = [PackedLaunch(
                    self._be, file, split(kind, dim), plan.items.shape[0], ak.THREADS,
                    [out, plan.partials, q, k, v, *geometry, plan.items, plan.nsplit,
                     plan.num_heads, *shape, *strides, *feats, H("key_scales", "p"),
                     H("value_scales", "p"), H("sb", "i"), H("sh", "i"), H("st", "i"), ks, vs,
                     qk, ok])]
                if plan.merge_rows is not None:
                    run.append(PackedLaunch(
                        self._be, file, ak.merge_name(dim), plan.merge_rows.shape[0],
                        ak.MERGE_THREADS,
                        [out, plan.partials, plan.merge_rows, plan.nsplit, plan.num_heads,
                         plan.scale, plan.soft_cap, H("sinks", "p"), ok]))
                launches[("core", tiled)] = run
        if plan.prefill is not None:
            launches["prefill"] = [PackedLaunch(
                self._be, file, ak.prefill_name(kind, dim), plan.prefill.shape[0], ak.THREADS,
                [out, q, k, v, *geometry, plan.prefill, plan.num_heads, G, *shape, *strides,
                 *feats, H("tiled", "i"), qk, ok])]
        if plan.prefill_tc is not None:
            launches["prefill"] = [PackedLaunch(
                self._be, file, ak.prefill_tc_name(kind, dim), plan.prefill_tc.shape[0],
                ak.PREFILL_TC_THREADS,
                [out, q, k, v, *geometry, plan.prefill_tc, plan.num_heads, G, *shape, *strides,
                 *feats, H("tiled", "i"), qk, ok], smem=ak.prefill_tc_smem(dim))]
        return launches

    def attention_run(self, plan, q, out, key_cache, value_cache, codecs=None, *,
                      alibi_slopes=None, sinks=None):
        """Run a ``CudaAttentionPlan`` on one layer: launches only (no
        upload, no allocation, no host sync), so a step of runs can be
        captured in a CUDA graph.

        q, out : ``(tokens, heads, head_dim)`` device arrays, float32 (and,
            for version 3 plans, float16 or bfloat16: ml_dtypes.bfloat16 or
            its uint16 bits), C-contiguous (a misaligned one goes through an
            aligned temporary)
        key_cache, value_cache : ``(num_blocks, kv_heads, block_size,
            head_dim)`` device views of the pool's storage (bits of the
            plan's kind), rows contiguous
        codecs : as for ``paged_attention``
        alibi_slopes, sinks : None, or float32 C-contiguous ``(num_heads,)``
            device arrays (the layer's rows): ALiBi slopes, attention sinks

        A version 3 plan runs the tensor-core decode for q of the mma's
        type (float16 pages: float16 q; bfloat16: bfloat16; fp8: either)
        over 16-byte aligned pages, else the float32 kernels.  The plan's
        partials buffer belongs to it: runs of one plan are issued on one
        stream at a time (as the layers of a step are).
        """
        if not isinstance(plan, CudaAttentionPlan):
            raise TypeError(f"plan must come from this backend's attention_plan, got "
                            f"{type(plan).__name__}")
        for arg, a in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
            if a is not None and (not self._be._is_device(a) or a.dtype != np.float32
                                  or tuple(a.shape) != (plan.num_heads,)
                                  or not a.flags.c_contiguous or self._be._ptr(a) % 4):
                raise ValueError(f"{arg} must be a float32 C-contiguous ({plan.num_heads},) "
                                 f"array on {self._be.device}, got {type(a).__name__} "
                                 f"{getattr(a, 'dtype', '')} {tuple(getattr(a, 'shape', ()))}")
        want_q = (plan.num_tokens, plan.num_heads, plan.head_dim)
        want_kv = (plan.num_blocks, plan.num_kv_heads, plan.block_size, plan.head_dim)
        for arg, a, want in (("q", q, want_q), ("out", out, want_q),
                             ("key_cache", key_cache, want_kv),
                             ("value_cache", value_cache, want_kv)):
            if tuple(a.shape) != want:
                raise ValueError(f"{arg} must have the planned shape {want}, got "
                                 f"{tuple(a.shape)}")
        q_kinds, out_kinds = self.attention_io_kinds(plan)
        qk = _io_kind(q, "q", q_kinds)
        ok = _io_kind(out, "out", out_kinds)
        scales = self.scales(plan.kind, key_cache, codecs)
        if plan.num_tokens == 0:
            return
        for arg, a in (("key_cache", key_cache), ("value_cache", value_cache)):
            if self._be._misaligned(a):  # a misaligned load faults on the GPU
                raise ValueError(
                    f"{arg} must be aligned to its itemsize ({a.itemsize} bytes), got address "
                    f"{self._be._ptr(a):#x} and strides {a.strides}")
        if not q.flags.c_contiguous:
            raise ValueError("q must be C-contiguous")
        self._be._deliverable(out)
        ak = attention_kernels
        with self._be._ctx():
            if plan.ready is not None:
                if self._be._event_done(plan.ready):
                    plan.ready = None        # (one query per plan, not per run)
                else:
                    self._be._wait_event(plan.ready)
            q = self._be._aligned_input(q)
            target = out if out.flags.c_contiguous and not self._be._misaligned(out) \
                else self._be.xp.empty(out.shape, out.dtype)
            cs = self._be._estrides(key_cache, (0, 1, 2))
            tiled = ak.tiled_ok((self._be._ptr(key_cache), self._be._ptr(value_cache)),
                                [c * key_cache.itemsize for c in cs], plan.block_size)
            values = {"out": target, "q": q, "k": key_cache, "v": value_cache, "cb": cs[0],
                      "ch": cs[1], "ct": cs[2], "key_scales": scales[0],
                      "value_scales": scales[1], "sb": scales[2], "sh": scales[3],
                      "st": scales[4], "ks": scales[5], "vs": scales[6], "qk": qk, "ok": ok,
                      "tiled": int(tiled), "alibi": alibi_slopes, "sinks": sinks}
            if not plan.lock.acquire(blocking=False):
                raise RuntimeError("this attention plan is already running (one run at a "
                                   "time per plan)")
            try:
                _issue(plan, values, tiled)
            finally:
                plan.lock.release()
            self._be._deliver_bits(target, out)

    def paged_attention(self, q, out, key_cache, value_cache, kind, block_tables, seq_lens,
                        query_start_loc, scale, sliding_window, soft_cap, codecs=None, *,
                        chunk_size=0, alibi_slopes=None, sinks=None):
        """``kvcore.paged_attention`` on this device: ``attention_run`` of a
        fresh ``attention_plan`` (arguments as there; ``codecs`` the pages'
        ``(key_codec, value_codec)``, ``kvcore.backends.Codec`` of ``kind``,
        or None for unscaled pages: int8 codecs hold float32 device scale
        planes ``(num_blocks, kv_heads, block_size)`` (the pool's, of the
        layer), fp8 ones a finite positive layer scale each).  A stored
        value reads as ``element * scale``.
        """
        # the scales are checked before anything is planned or uploaded
        self.scales(kind, key_cache, codecs)
        plan = self.attention_plan(
            block_tables, seq_lens, query_start_loc, num_heads=q.shape[1],
            num_kv_heads=key_cache.shape[1], head_dim=q.shape[2], block_size=key_cache.shape[2],
            num_blocks=key_cache.shape[0], kind=kind, scale=scale,
            sliding_window=sliding_window, soft_cap=soft_cap, chunk_size=chunk_size)
        self.attention_run(plan, q, out, key_cache, value_cache, codecs,
                           alibi_slopes=alibi_slopes, sinks=sinks)

    def scales(self, kind, key_cache, codecs):
        """The scale arguments of kva_attention_split for pages of ``kind``
        (``key_scales, value_scales, s_block, s_head, s_tok, k_scale,
        v_scale``) from the pages' codecs, every one checked here, before
        any launch."""
        name = dtypes.KIND_NAME.get(kind, kind)
        if codecs is None:
            if kind == dtypes.I8:
                raise TypeError("int8 pages need codecs (their scale planes), got None")
            return [None, None, 0, 0, 0, 1.0, 1.0]
        if not isinstance(codecs, (tuple, list)) or len(codecs) != 2 \
                or not all(isinstance(c, Codec) for c in codecs):
            raise TypeError(f"codecs must be a (key_codec, value_codec) pair of "
                            f"kvcore.backends.Codec, got {codecs!r:.80}")
        for arg, c in zip(("key_codec", "value_codec"), codecs):
            if c.kind != kind:
                raise ValueError(f"{arg} must be of the pages' kind {name}, got "
                                 f"{dtypes.KIND_NAME.get(c.kind, c.kind)}")
            if c.head_scales is not None:
                raise ValueError(f"{arg} has per-kv-head scales: these kernels take one "
                                 f"scale per layer's k and v")
        if kind not in dtypes.LOWPREC_KINDS:
            return [None, None, 0, 0, 0, 1.0, 1.0]
        layer = []
        for arg, c in zip(("key_codec", "value_codec"), codecs):
            v = c.layer_scale
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"{arg}.layer_scale must be a real number, got "
                                f"{type(v).__name__}")
            with np.errstate(over="ignore"):
                f = np.float32(v)   # the kernel's float (as the CPU kernel's)
            if not (np.isfinite(f) and f > 0):
                raise ValueError(f"{arg}.layer_scale must be finite and positive (as a "
                                 f"float32), got {v!r}")
            layer.append(float(f))
        key_scales, value_scales = codecs[0].scale_plane, codecs[1].scale_plane
        if kind != dtypes.I8:
            if key_scales is not None or value_scales is not None:
                raise ValueError(f"{name} pages have per-layer scales: the codecs' "
                                 "scale_plane must be None")
            return [None, None, 0, 0, 0, *layer]
        if layer != [1.0, 1.0]:
            raise ValueError(f"int8 pages carry their scales per row: the codecs' layer_scale "
                             f"must be 1.0, got {layer[0]!r}, {layer[1]!r}")
        want = tuple(key_cache.shape[:3])
        strides = []
        for arg, a in (("key_codec.scale_plane", key_scales),
                       ("value_codec.scale_plane", value_scales)):
            if not self._be._is_device(a):
                raise TypeError(f"{arg} must be a float32 array on {self._be.device} (the pool's "
                                f"scale plane), got {type(a).__name__}")
            if self._be._device_id_of(a) != self._be.device_id:
                raise ValueError(f"{arg} is on cuda:{self._be._device_id_of(a)} but this "
                                 f"operation runs on {self._be.device}")
            if a.dtype != np.float32 or tuple(a.shape) != want:
                raise ValueError(f"{arg} must be float32 of shape {want} (num_blocks, "
                                 f"num_kv_heads, block_size), got {a.dtype} {tuple(a.shape)}")
            if a.size and self._be._ptr(a) % 4:
                raise ValueError(f"{arg} must be 4-byte aligned")
            strides.append(self._be._estrides(a, (0, 1, 2)))
        if strides[0] != strides[1]:
            raise ValueError(f"the codecs' scale planes must have the same layout, got "
                             f"element strides {strides[0]} and {strides[1]}")
        return [key_scales, value_scales, *strides[0], 1.0, 1.0]


class Hole:
    """An argument of a ``PackedLaunch`` written per call: ``name`` (the key
    of the call's values) and its type: ``"p"`` a device array (a pointer;
    None: null), ``"i"`` an int (long long), ``"f"`` a float."""

    __slots__ = ("name", "type")

    def __init__(self, name, type):
        self.name, self.type = name, type


class PackedLaunch:
    """One kernel launch of a plan, its arguments packed at plan time (one
    8-byte slot each: the kernel's parameter block), the ``Hole`` ones
    written per call.  ``launch(values)`` (a dict of the holes' values)
    issues it through the backend launcher's ``run_packed``: on a GPU a single
    driver call, no argument marshalling."""

    __slots__ = ("backend", "file", "name", "grid", "block", "smem", "args", "holes",
                 "native")

    def __init__(self, backend, file, name, grid, block, args, smem=0):
        self.backend, self.file, self.name = backend, file, name
        self.grid, self.block, self.smem = int(grid), int(block), int(smem)
        self.args = list(args)
        self.holes = [(i, a) for i, a in enumerate(self.args) if isinstance(a, Hole)]
        self.native = None   # the backend's packed form, made at the first launch

    def __call__(self, values):
        self.backend.launcher.run_packed(self, values)


def _issue(plan, values, tiled):
    """The launches of one run: the tensor-core decode for q of its type
    over 16-byte aligned pages, else the float32 kernels; the prefill."""
    runs = plan.launches.get(("tc", values["qk"])) if tiled else None
    for launch in runs or plan.launches.get(("core", tiled), ()):
        launch(values)
    for launch in plan.launches.get("prefill", ()):   # (16-byte copies where tiled)
        launch(values)


class _FastRun:
    """``CudaAttentionPlan.bind``'s result: ``AttentionPlan.run``'s fast lane
    for device q / out it can take as they are (CuPy arrays, torch CUDA
    tensors: C-contiguous, aligned, on the plan's device, of a kind the
    plan reads / writes, an ``out`` apart from q and from the pool's
    memory); NotImplemented for anything else (the general path decides
    and names the error).  The layers' planes are found from layer 0's and
    the layer stride, once, at bind time."""

    def __init__(self, plan, key0, value0, key_last, value_last, num_layers, layer_scales,
                 scale_planes, alibi, sinks, layer_plans):
        be = plan.backend
        self.plan, self.be, self.num_layers = plan, be, num_layers
        # each layer's plan (layers of several kinds: window / chunk) and rows
        self.layer_plans = list(layer_plans) if layer_plans is not None else [plan] * num_layers
        self.rows = {}
        for name, host in (("alibi", alibi), ("sinks", sinks)):
            if host is not None:   # (num_layers, num_heads) float32, uploaded once
                dev = be.from_host(np.ascontiguousarray(host, np.float32))
                self.rows[name] = (dev, be._ptr(dev), dev.shape[1] * 4)
        steps = max(1, num_layers - 1)
        self.kv0 = (be._ptr(key0), be._ptr(value0))
        self.kv_step = tuple((be._ptr(last) - base) // steps
                             for last, base in zip((key_last, value_last), self.kv0))
        self.shape = (plan.num_tokens, plan.num_heads, plan.head_dim)
        self.q_kinds, self.out_kinds = be.attention_io_kinds(plan)
        # what an out must not overlap: every layer's K planes, V planes (and scales)
        self.owned = [(lo, hi) for first, last in ((key0, key_last), (value0, value_last))
                      for lo, hi in [(be._extent(first)[0], be._extent(last)[1])]]
        cs = be._estrides(key0, (0, 1, 2))
        self.tiled = attention_kernels.tiled_ok(self.kv0, [c * key0.itemsize for c in cs],
                                                plan.block_size) \
            and all(s % 16 == 0 for s in self.kv_step)
        self.scale_planes = None
        base = {"cb": cs[0], "ch": cs[1], "ct": cs[2], "key_scales": None,
                "value_scales": None, "sb": 0, "sh": 0, "st": 0, "ks": 1.0, "vs": 1.0,
                "tiled": int(self.tiled), "alibi": None, "sinks": None}
        if scale_planes is not None:   # int8: each layer's scale planes, by their stride
            ks0, vs0, ks_last, vs_last = scale_planes
            sc = be._attention.scales(plan.kind, key0,
                                      (Codec(plan.kind, 1.0, ks0), Codec(plan.kind, 1.0, vs0)))
            base.update(sb=sc[2], sh=sc[3], st=sc[4])
            first = (be._ptr(ks0), be._ptr(vs0))
            self.scale_planes = (first, tuple((be._ptr(last) - f) // steps
                                              for last, f in zip((ks_last, vs_last), first)))
            self.owned += [(be._extent(a)[0], be._extent(b)[1])
                           for a, b in ((ks0, ks_last), (vs0, vs_last))]
        self.layer_scales = None if layer_scales is None else \
            [(float(k), float(v)) for k, v in layer_scales]
        self.base = base
        self._torch_kinds = None

    def _operand(self, x):
        """``(address, kind, nbytes)`` of q / out ``x`` as the kernels take
        it, or None."""
        be = self.be
        if type(x) is be.xp.ndarray:
            kind = _FAST_CUPY_KINDS.get(x.dtype.char)
            if kind is None or x.shape != self.shape or not x.flags.c_contiguous \
                    or be._device_id_of(x) != be.device_id:
                return None
            ptr = be._ptr(x)
            return (ptr, kind, x.nbytes) if ptr % x.itemsize == 0 else None
        if type(x).__module__.split(".")[0] != "torch":
            return None
        kinds = self._torch_kinds
        if kinds is None:
            import torch
            kinds = self._torch_kinds = {torch.float32: (dtypes.F32, 4),
                                         torch.float16: (dtypes.F16, 2),
                                         torch.bfloat16: (dtypes.BF16, 2)}
        kind = kinds.get(x.dtype)
        if kind is None or not x.is_cuda or x.device.index != be.device_id \
                or tuple(x.shape) != self.shape or not x.is_contiguous() or x.is_neg() \
                or x.is_conj():
            return None
        ptr = x.data_ptr()
        return (ptr, kind[0], x.numel() * kind[1]) if ptr % kind[1] == 0 else None

    def __call__(self, q, layer, out=None):
        be = self.be
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            return NotImplemented
        plan = self.layer_plans[layer]
        qo = self._operand(q)
        if qo is None or qo[1] not in self.q_kinds:
            return NotImplemented
        if out is None:
            with be._ctx():
                result = be.xp.empty(self.shape, np.float32)
            oo = (be._ptr(result), dtypes.F32, result.nbytes)
        else:
            oo = self._operand(out)
            if oo is None or oo[1] not in self.out_kinds \
                    or getattr(out, "requires_grad", False):
                return NotImplemented
            lo, hi = oo[0], oo[0] + oo[2]
            if lo < qo[0] + qo[2] and qo[0] < hi or any(lo < b and a < hi
                                                        for a, b in self.owned):
                return NotImplemented
            result = out
        values = dict(self.base)
        values.update(out=oo[0], q=qo[0], qk=qo[1], ok=oo[1],
                      k=self.kv0[0] + layer * self.kv_step[0],
                      v=self.kv0[1] + layer * self.kv_step[1])
        if self.layer_scales is not None:
            values["ks"], values["vs"] = self.layer_scales[layer]
        if self.scale_planes is not None:
            (k0, v0), (ks, vs) = self.scale_planes
            values["key_scales"], values["value_scales"] = k0 + layer * ks, v0 + layer * vs
        for name, (_, base, step) in self.rows.items():
            values[name] = base + layer * step
        if not plan.lock.acquire(blocking=False):
            return NotImplemented   # (the general path raises)
        try:
            with be._ctx():
                if plan.ready is not None:
                    if be._event_done(plan.ready):
                        plan.ready = None
                    else:
                        be._wait_event(plan.ready)
                _issue(plan, values, self.tiled)
        finally:
            plan.lock.release()
        return result


# CuPy dtypes the fast lane takes as they are (bfloat16 CuPy arrays go the general way)
_FAST_CUPY_KINDS = {"f": dtypes.F32, "e": dtypes.F16}


def _io_kind(a, arg, kinds):
    """The element kind of q / out ``a`` (bfloat16 as ml_dtypes' or its
    uint16 bits), checked against ``kinds``."""
    dt = a.dtype
    kind = {np.dtype(np.float32): dtypes.F32, np.dtype(np.float16): dtypes.F16,
            np.dtype(np.uint16): dtypes.BF16}.get(np.dtype(dt))
    if kind is None and dtypes.BF16_NUMPY is not None and dt == dtypes.BF16_NUMPY:
        kind = dtypes.BF16
    if kind not in kinds:
        names = ", ".join(dtypes.KIND_NAME[k] for k in sorted(kinds))
        raise TypeError(f"{arg} must be {names} for this plan, got {dt}")
    return kind


class CudaAttentionPlan:
    """``CudaBackend.attention_plan``'s result: the shape of a step's
    attention, its kernel version and its device metadata (item tables and
    split counts of the float32 and tensor-core kernels, block tables,
    lengths, query starts, merge rows, the partials buffer, the
    tensor-core merge tickets)."""

    __slots__ = ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "block_size",
                 "num_blocks", "kind", "scale", "sliding_window", "soft_cap", "items",
                 "nsplit", "tables", "lens", "qsl", "merge_rows", "partials", "ready",
                 "prefill", "version", "tc_items", "tc_nsplit", "counters", "launches",
                 "backend", "lock", "prefill_tc", "chunk_size")

    def __init__(self, **shape):
        for name in self.__slots__:
            setattr(self, name, shape.get(name))
        self.lock = threading.Lock()   # one run at a time (the launches' host buffers)

    def share_guard(self, other):
        """Take ``other``'s run guard (the plans of one AttentionPlan's
        layer kinds: one run at a time among them)."""
        self.lock = other.lock

    def bind(self, key0, value0, key_last, value_last, num_layers, codecs=None, owned=(),
             alibi=None, sinks=None, layer_plans=None):
        """``AttentionPlan.run``'s fast lane (see ``_FastRun``) over the
        layers whose planes lie ``l`` layer strides past ``key0`` /
        ``value0`` (measured from the last layer's); ``codecs``: None
        (unscaled planes) or every layer's ``(key_codec, value_codec)``
        (int8: the scale planes of layers 0 and last a stride apart too;
        fp8: the layer scales); ``alibi`` / ``sinks``:
        host ``(num_layers, num_heads)`` rows (uploaded now), ``layer_plans``:
        each layer's plan where the layers have several kinds.  None when it
        cannot be bound (fp8 per-head scales, planes off the backend's
        device or not one stride apart, an empty plan).  ``owned`` is not
        used: the fast lane keeps ``out`` off every layer's planes and
        scales itself."""
        be = self.backend
        planes = (key0, value0, key_last, value_last)
        codecs = codecs or ()
        if be is None or any(c.head_scales is not None for pair in codecs for c in pair) \
                or self.num_tokens == 0 \
                or not all(be._is_device(a) and be._device_id_of(a) == be.device_id
                           for a in planes):
            return None
        steps = max(1, num_layers - 1)
        if any((be._ptr(last) - be._ptr(first)) % steps or last.strides != first.strides
               for first, last in ((key0, key_last), (value0, value_last))):
            return None
        scale_planes = layer_scales = None
        if codecs and codecs[0][0].kind in dtypes.FP8_KINDS:
            layer_scales = [(kc.layer_scale, vc.layer_scale) for kc, vc in codecs]
        if codecs and codecs[0][0].scale_plane is not None:
            scale_planes = tuple(c.scale_plane for c in codecs[0] + codecs[-1])
            if any((be._ptr(last) - be._ptr(first)) % steps
                   for first, last in zip(scale_planes[:2], scale_planes[2:])):
                return None
        return _FastRun(self, key0, value0, key_last, value_last, num_layers, layer_scales,
                        scale_planes, alibi, sinks, layer_plans)

    def __repr__(self):
        return (f"<CudaAttentionPlan {self.num_tokens} query tokens, {self.num_heads} heads "
                f"over {self.num_kv_heads} KV heads x {self.head_dim}, kind {self.kind}>")
