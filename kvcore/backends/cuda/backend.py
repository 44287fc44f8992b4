"""The CUDA data-movement backend: CuPy arrays, RawKernels from ``kernels/*.cu``.

``CudaBackend`` implements ``kvcore.backends.base.Backend`` (as the CPU backend does, plus
``gather_batch`` and ``copy_blocks_between``) and gives the same bits.  Get
one through ``kvcore.backends.cuda.get_cuda_backend``: this module never imports
CuPy itself; the guard in ``kvcore/backends/cuda/__init__.py`` hands the module in.

Streams and graphs: every kernel and copy is issued on CuPy's current stream
of the backend's device (``cupy.cuda.get_current_stream()``) and nothing
here waits for the device, except ``to_host``, ``synchronize``, ``zeros``
(a pool's fill is complete before any stream uses the pool) and
``copy_blocks_between`` to or from pageable host memory (the host array
may be reused on return).  A step can therefore be captured into a CUDA
graph, provided the index arrays (slots, block tables, ids, lengths) are
passed as device arrays: a NumPy index array is copied up from host memory
(through a pinned staging buffer), which a graph capture does not allow.
Attention is planned once per step (``attention_plan``: the metadata goes
up once) and run per layer (``attention_run``: launches only).
``write_slots_kv`` with ``check=True`` waits for its range check's verdict
(one 8-byte read); with ``check=False`` it does not.

Arguments reaching these methods have been validated by the caller, except
where a method says it checks.  Kernels are compiled with NVRTC on first
use (one module per .cu file and kind pair) and cached per device.
"""
import threading

import numpy as np

from ... import dtypes
from ..base import Backend
from . import _sources
from .arrays import device_array, device_dtype, host_array, import_foreign, is_bf16, \
    on_cuda_device
from .attention import CudaAttention, CudaAttentionPlan, Hole  # noqa: F401 (re-exported)
from .copies import CudaBlockCopies
from .lane import StepLane
from .launch import CudaLaunches, launch_shape
from .writes import CudaSlotWrites

# Index arithmetic inside the kernels splits rows with 32-bit division.
_ROW_LIMIT = 2**31 - 1


class CudaBackend(Backend):
    """CuPy arrays on one CUDA device; NVRTC-compiled RawKernels.

    Parameters
    ----------
    cupy : module
        The imported CuPy module (the only way this module sees CuPy).
    device_id : int
        The CUDA device this backend allocates on and launches on.
    """

    name = "cuda"
    launch_shape = staticmethod(launch_shape)

    def __init__(self, cupy, device_id):
        self._cp = cupy
        self.xp = cupy
        self.device_id = int(device_id)
        self.device = f"cuda:{self.device_id}"
        self._device = cupy.cuda.Device(self.device_id)
        self._lock = threading.Lock()
        self._staged = []   # (event, pinned buffer) of uploads in flight
        self._sms = self._tensor_cores = None    # asked of the device on first use
        self._hold_parts(CudaLaunches(self))

    def _hold_parts(self, launcher):
        """Hold ``launcher`` (compiles and launches kernels) and make the
        collaborators that use it: block copies, attention and slot writes
        (each calls the device hooks here too)."""
        self.launcher = launcher
        self._copies = CudaBlockCopies(self, launcher)
        self._attention = CudaAttention(self)
        self._writes = CudaSlotWrites(self, launcher)

    def __repr__(self):
        return f"<kvcore CudaBackend {self.device}>"

    def normalize_device(self, device):
        return self.device

    # ------------------------------------------ block copies and attention
    def copy_blocks(self, storage, src, dst):
        return self._copies.copy_blocks(storage, src, dst)

    def copy_blocks_between(self, src_storage, src_ids, dst_storage, dst_ids):
        return self._copies.copy_blocks_between(src_storage, src_ids, dst_storage, dst_ids)

    @property
    def attention_version(self):
        """The kernel version of new plans: 3 or 2 (None:
        KVCORE_CUDA_ATTENTION's).  Set it to compare both in one process; a
        plan keeps its own."""
        return self._attention.attention_version

    @attention_version.setter
    def attention_version(self, version):
        self._attention.attention_version = version

    def attention_io_kinds(self, plan):
        return self._attention.attention_io_kinds(plan)

    def attention_plan(self, block_tables, seq_lens, query_start_loc, **shape):
        return self._attention.attention_plan(block_tables, seq_lens, query_start_loc,
                                              **shape)

    def attention_run(self, plan, q, out, key_cache, value_cache, codecs=None, *,
                      alibi_slopes=None, sinks=None):
        return self._attention.attention_run(plan, q, out, key_cache, value_cache, codecs,
                                             alibi_slopes=alibi_slopes, sinks=sinks)

    def paged_attention(self, *args, **kwargs):
        return self._attention.paged_attention(*args, **kwargs)

    # ----------------------------------------------------- device hooks
    # The few places that touch CuPy's device machinery (the launches are
    # the launcher's, launch.py).  The tests' host emulation overrides
    # exactly these to run the kernels' C++ bodies on NumPy arrays.
    def _ctx(self):
        """Make this backend's device current for the enclosed calls."""
        return self._device

    def _ptr(self, a):
        return a.data.ptr

    # multiprocessors of the device, asked once (attention's splits are
    # sized from it); 0: unknown (the tests' emulation), fixed-size splits
    _sms = 0

    def _sm_count(self):
        if self._sms is None:
            self._sms = int(self._device.attributes["MultiProcessorCount"])
        return self._sms or None

    # mma.sync (sm_80+): attention's prefill rows run on tensor cores;
    # False where unknown (the tests' emulation turns it on to test it)
    _tensor_cores = False

    def _has_mma(self):
        if self._tensor_cores is None:
            self._tensor_cores = int(self._device.compute_capability) >= 80
        return self._tensor_cores

    def _is_device(self, a):
        return isinstance(a, self._cp.ndarray)

    def _device_id_of(self, a):
        return a.device.id

    def _stream_ptr(self):
        return self._cp.cuda.get_current_stream().ptr

    def _fence(self):
        """Wait for everything issued on the current stream: where work must
        be complete before another stream may use its result (a pool's
        fill) or before host memory it reads or writes may be touched (a
        copy to or from pageable memory)."""
        self._cp.cuda.get_current_stream().synchronize()

    def _record_event(self):
        """An event recorded on the current stream (what was issued so far)."""
        return self._cp.cuda.get_current_stream().record()

    def _event_done(self, event):
        """Whether ``event`` has completed (a query: no wait)."""
        return event is None or event.done

    def _wait_event(self, event):
        """Order the current stream's next work after ``event``: nothing to
        do once it has completed (a query, not a wait: no host sync, and a
        CUDA graph capture sees no cross-stream dependency), else a
        device-side wait."""
        if event is not None and not event.done:
            self._cp.cuda.get_current_stream().wait_event(event)

    def _is_pinned(self, h):
        """Whether host array ``h`` lies in page-locked (pinned) memory."""
        try:
            attrs = self._cp.cuda.runtime.pointerGetAttributes(h.ctypes.data)
        except Exception:  # not known to CUDA: pageable
            return False
        return getattr(attrs, "type", 0) == 1  # cudaMemoryTypeHost

    def wrap_pointer(self, ptr, shape, strides, dtype, owner):
        """A device array over memory this backend does not own: ``shape``
        elements of ``dtype`` ``strides`` bytes apart from address ``ptr``
        on this device, kept valid by ``owner`` (held by the array).  No
        copy, no driver call: what a torch CUDA tensor's raw fields become
        for a kernel argument (``lane.py``, ``_import_torch``)."""
        cp = self._cp
        dtype = np.dtype(dtype)
        nbytes = 0 if any(n == 0 for n in shape) else \
            sum((n - 1) * abs(st) for n, st in zip(shape, strides)) + dtype.itemsize
        mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, self.device_id)
        return cp.ndarray(tuple(shape), dtype, cp.cuda.MemoryPointer(mem, 0), tuple(strides))

    def _upload(self, h):
        """A device copy of C-contiguous host array ``h``, issued on the
        current stream.

        Staged through pinned memory: an asynchronous copy from pageable
        memory (``ndarray.set`` of a temporary, CuPy issue #6785) may read
        the host buffer after it was freed or reused.  The pinned buffer is
        kept until the copy's event has completed."""
        cp = self._cp
        d = cp.empty(h.shape, h.dtype)
        if h.size:
            stream = cp.cuda.get_current_stream()
            mem = cp.cuda.alloc_pinned_memory(h.nbytes)
            staged = np.ndarray(h.shape, h.dtype, buffer=mem)
            staged[...] = h
            d.set(staged, stream=stream)
            self._keep_until_done(stream.record(), mem)
        return d

    def _keep_until_done(self, event, buffer):
        """Hold ``buffer`` until ``event`` has completed (uploads' pinned
        staging); the buffers of completed events are let go here."""
        with self._lock:
            pending = [(e, b) for e, b in self._staged if not e.done]
            pending.append((event, buffer))
            self._staged = pending

    def _download(self, d):
        """A NumPy copy of device array ``d``; waits for the current stream."""
        return d.get(stream=self._cp.cuda.get_current_stream())

    def _index_array(self, x, dtype):
        """Ids, slots, tables or lengths as a C-contiguous device array of
        ``dtype``: device arrays as they are (cast or compacted on the
        device if needed), host arrays and sequences copied up on the current
        stream (they are small)."""
        dtype = np.dtype(dtype)
        if self._is_device(x):
            if x.dtype == dtype and x.flags.c_contiguous:
                return x
            return self.xp.ascontiguousarray(x.astype(dtype, copy=False))
        return self._upload(np.ascontiguousarray(x, dtype=dtype))

    def step_lane(self, planes, codecs, owned):
        """A ``lane.StepLane`` over a pool's per-layer ``planes`` (K, V)
        and their ``codecs``: a step's writes and attention issued per
        layer with packed launches and fixed device buffers.  ``owned``:
        the arrays an input must be apart from (storage, scales)."""
        return StepLane(self, planes, codecs, owned)

    # -------------------------------------------------------------- arrays
    def asarray(self, x, arg):
        """``x`` as a CuPy array on this device, zero-copy (``arrays.device_array``)."""
        return device_array(self, x, arg)

    def check_out(self, out, arg):
        return self.asarray(out, arg)

    def empty(self, shape, dtype):
        with self._ctx():
            return self.xp.empty(shape, device_dtype(dtype))

    def zeros(self, shape, dtype):
        """Zero-filled device memory (a pool's storage and scales), the fill
        complete on return: the pool may be used from any stream, and a
        fill left in flight on this stream would race a write issued on
        another."""
        with self._ctx():
            a = self.xp.zeros(shape, device_dtype(dtype))
            self._fence()
            return a

    def to_host(self, a):
        """``a`` as a NumPy array, for index arguments read on the host.

        Takes what the CPU backend takes: device arrays (CuPy, anything with
        ``__cuda_array_interface__`` or DLPack on a CUDA device, e.g. torch
        CUDA tensors) are copied down, which waits for the current stream (a
        sync point); host data (NumPy arrays, lists, tuples, ``range``,
        ``array.array``, torch CPU tensors, DLPack on the CPU) is read as
        ``numpy.asarray`` reads it (no copy where the memory allows).
        """
        if self._is_device(a):
            with self._ctx():
                return self._download(a)
        if isinstance(a, np.ndarray):
            return a
        if on_cuda_device(a):
            d = import_foreign(self, a, "array")
            with self._ctx():
                return self._download(d)
        return host_array(a)

    def from_host(self, a):
        """A device copy of host array ``a``, issued on the current stream.

        Same dtype on the device, ``ml_dtypes.bfloat16`` included (moved as
        its uint16 bits and viewed back, which every CuPy version allows).
        """
        if self._is_device(a):
            return a
        a = np.ascontiguousarray(a)
        with self._ctx():
            if is_bf16(a.dtype):
                return self._upload(a.view(np.uint16)).view(a.dtype)
            return self._upload(a)

    def inner_contiguous(self, a):
        """``a`` aligned to its itemsize and with its last axis contiguous (a
        copy only when it is not)."""
        if a.ndim and ((a.strides[-1] != a.itemsize and a.shape[-1] > 1)
                       or any(s % a.itemsize for s in a.strides)
                       or self._ptr(a) % a.itemsize):
            with self._ctx():
                return self._contiguous_copy(a)
        return a

    def _contiguous_copy(self, a):
        """A C-contiguous copy of ``a`` (always a copy), moved as integers;
        a misaligned ``a`` as bytes (an element copy would make the
        misaligned loads that fault on a GPU), which needs its last axis
        contiguous (else ValueError)."""
        if self._misaligned(a) and a.ndim:
            self._deliverable(a, "an input")
            b = self.xp.array(a.view(np.uint8), order="C", copy=True)
            return b.view(a.dtype)
        b = a.view(_sources.bits_dtype(a.dtype))
        return self.xp.array(b, order="C", copy=True).view(a.dtype)

    # ------------------------------------------------------------- helpers
    def _estrides(self, a, axes):
        """Strides of ``axes`` in elements (0 for axes of length 1)."""
        out = []
        for ax in axes:
            if a.shape[ax] <= 1:
                out.append(0)
                continue
            st = a.strides[ax]
            if st % a.itemsize:
                raise ValueError(
                    f"array stride {st} is not a multiple of its itemsize {a.itemsize}")
            out.append(st // a.itemsize)
        return out

    def _vector(self, sk, dk, dim, arrays):
        """The vector width V if every access of a row/chunk kernel can be a
        16-byte one (``dim`` a multiple of V, each array's base pointer and
        the byte strides of the listed axes multiples of 16), else 1."""
        v = _sources.vector_width(sk, dk)
        if dim % v:
            return 1
        for a, axes in arrays:
            if self._ptr(a) % 16:
                return 1
            if any(a.strides[ax] % 16 for ax in axes if a.shape[ax] > 1):
                return 1
        return v

    @staticmethod
    def _check_rows(count, what):
        """The kernels split row and position indices with 32-bit division."""
        if count > _ROW_LIMIT:
            raise ValueError(
                f"{what}: {count} exceeds the {_ROW_LIMIT} one kernel launch indexes; "
                "split the call")

    def _overlaps(self, a, b):
        """Whether the memory spans of ``a`` and ``b`` intersect (a cheap,
        conservative stand-in for numpy.may_share_memory)."""
        if a.size == 0 or b.size == 0:
            return False
        a_lo, a_hi = self._extent(a)
        b_lo, b_hi = self._extent(b)
        return a_lo < b_hi and b_lo < a_hi

    def _extent(self, a):
        lo = hi = self._ptr(a)
        for n, st in zip(a.shape, a.strides):
            if st > 0:
                hi += (n - 1) * st
            else:
                lo += (n - 1) * st
        return lo, hi + a.itemsize

    # ------------------------------------------------------------- kernels
    def _flat(self, s, d, launch):
        """``launch(src, dst)`` over contiguous views of the bit arrays ``s``
        and ``d`` (same shape): ``s`` read from a copy when it overlaps ``d``
        or is strided, a strided ``d`` filled through a temporary."""
        xp = self.xp
        self._deliverable(d, "dst")
        if self._overlaps(s, d) or self._misaligned(s):  # read from a copy
            s = self._contiguous_copy(s)
        elif not s.flags.c_contiguous:
            s = xp.ascontiguousarray(s)
        tmp = d if d.flags.c_contiguous and not self._misaligned(d) \
            else xp.empty(d.shape, d.dtype)
        launch(s, tmp)
        if tmp is not d:
            if self._misaligned(d):
                d.view(np.uint8)[...] = tmp.view(np.uint8)
            else:
                d[...] = tmp

    def convert(self, src, src_kind, dst, dst_kind):
        """dst[...] = src converted; same shape, any strides (overlap allowed)."""
        if src.size == 0:
            return

        def launch(s, tmp):
            n = s.size
            v = _sources.vector_width(src_kind, dst_kind)
            if self._ptr(s) % 16 or self._ptr(tmp) % 16:
                v = 1
            self.launcher.launch("convert.cu", src_kind, dst_kind,
                                 _sources.kernel_name("kv_convert_flat", src_kind, dst_kind, v),
                                 -(-n // v), 1, [tmp, s, n])

        with self._ctx():
            self._flat(src.view(_sources.bits_dtype(src.dtype)), dst.view(_sources.bits_dtype(dst.dtype)), launch)

    def convert_fp8(self, src, dst, fmt, narrow, saturate=False):
        """float32 -> fp8 codes (``narrow``) or back; same shape, any strides
        (overlap allowed).  Four elements per thread (convert_fp8.cu)."""
        if src.size == 0:
            return
        name = _sources.fp8_kernel_name(fmt, narrow, saturate)

        def launch(s, tmp):
            self.launcher.launch(_sources.FP8_FILE, None, None, name, -(-s.size // 4), 1,
                                 [tmp, s, s.size])

        with self._ctx():
            self._flat(src.view(np.uint32) if narrow else src,
                       dst if narrow else dst.view(np.uint32), launch)

    # ----------------------------------------------- slot writes (writes.py)
    def write_slots(self, cache, src, slots, src_kind, codec):
        self._writes.write_slots(cache, src, slots, src_kind, codec)

    def write_call(self, cache, src, src_strides, slots, owner, n, src_kind, codec, v):
        """The launch that writes rows into a plane (``writes.CudaSlotWrites``)."""
        return self._writes.write_call(cache, src, src_strides, slots, owner, n, src_kind,
                                       codec, v)

    def slot_owner_table(self, num_slots):
        return self._writes.slot_owner_table(num_slots)

    def device_slots(self, slots, n):
        return self._writes.device_slots(slots, n)

    def write_slots_kv(self, k_cache, v_cache, k, v, slots, src_kind, k_codec, v_codec,
                       owner, check):
        self._writes.write_slots_kv(k_cache, v_cache, k, v, slots, src_kind, k_codec,
                                    v_codec, owner, check)

    # ------------------------------------------- fp8 / int8 storage (lowprec.cu)
    @staticmethod
    def _scale_bits(scale):
        """A float32 scale as the integer of its bits (kernels take it so)."""
        return int(np.float32(scale).view(np.uint32))

    def _scale_strides(self, scales, axes):
        """Element strides of an int8 scale array's ``axes`` (0s for fp8's None)."""
        return [0] * len(axes) if scales is None else self._estrides(scales, axes)

    def _q_launch(self, float_kind, q_kind, kernel, rows, chunks, args):
        self.launcher.launch(_sources.LOWPREC_FILE, float_kind, q_kind,
                             _sources.lowprec_name(kernel, float_kind, q_kind), rows, chunks, args)

    def _row_target(self, out):
        """``out``, or a C-contiguous temporary when its last axis is not
        contiguous (the read kernels write one element per thread along it)
        or it is not aligned to its itemsize (a misaligned store faults on
        the GPU, leaving the CUDA context unusable)."""
        inner = self._deliverable(out)
        if self._misaligned(out):
            return self.xp.empty(out.shape, out.dtype)
        return out if inner else self.xp.empty(out.shape, out.dtype)

    def _deliverable(self, out, arg="out"):
        """Whether ``out``'s last axis is contiguous; a misaligned ``out``
        must have it (``_deliver_bits`` then copies it as bytes), else
        ValueError."""
        inner = not out.ndim or out.shape[-1] <= 1 or out.strides[-1] == out.itemsize
        if not inner and self._misaligned(out):
            raise ValueError(
                f"{arg} must be aligned to its itemsize ({out.itemsize} bytes) or have its "
                f"last axis contiguous, got address {self._ptr(out):#x} and strides "
                f"{out.strides}")
        return inner

    def _misaligned(self, a):
        """Whether an element of ``a`` can lie off its itemsize's alignment
        (the base pointer or a stride not a multiple of the itemsize)."""
        return a.size > 0 and (self._ptr(a) % a.itemsize != 0
                               or any(st % a.itemsize for n, st in zip(a.shape, a.strides)
                                      if n > 1))

    def _aligned_input(self, a):
        """``a``, or an aligned C-contiguous copy of it when it is misaligned
        (see ``_contiguous_copy``)."""
        return self._contiguous_copy(a) if self._misaligned(a) else a

    def _deliver_bits(self, tmp, out):
        """out[...] = tmp (a ``_row_target``), as bits; a misaligned ``out``
        as bytes (an element copy would make the misaligned stores)."""
        if tmp is out:
            return
        if self._misaligned(out):
            out.view(np.uint8)[...] = tmp.view(np.uint8)
        else:
            out.view(_sources.bits_dtype(out.dtype))[...] = tmp.view(_sources.bits_dtype(tmp.dtype))

    def gather(self, cache, block_table, start, end, out, codec, dst_kind):
        """out[h, t - start, :] = cache[block_table[t // bs], h, t % bs, :]
        read through ``codec`` as ``dst_kind``, for t in start..end-1 (fp8 /
        int8 widened: ``fp8 * layer_scale``, ``code * scale_plane[block,
        head, offset]``; their own kind: the codes, raw).  out: (heads, end -
        start, dim) with its last axis contiguous; block_table int32, host
        or device."""
        n = end - start
        heads, dim = cache.shape[1], cache.shape[3]
        if n <= 0 or heads == 0 or dim == 0:
            return
        with self._ctx():
            table = self._index_array(block_table, np.int32)
            tmp = self._row_target(out)
            rows = heads * n
            self._check_rows(rows, "gather (heads x positions)")
            self._check_rows(end, "gather (end position)")
            self._gather_rows("kv_gather", cache, codec, dst_kind, tmp, rows, (0, 1),
                              [table, start, n])
            self._deliver_bits(tmp, out)

    def gather_batch(self, cache, block_tables, lengths, out, codec, dst_kind):
        """A batch of sequences into one padded output.

        out[s, h, t, :] = cache[block_tables[s, t // bs], h, t % bs, :] read
        as ``gather`` reads it, for t < lengths[s]; positions lengths[s] <= t
        < max_len are set to +0.

        Parameters
        ----------
        cache : (num_blocks, heads, block_size, dim) device array
        block_tables : int32 [batch, max_blocks], host or device
            Row s lists sequence s's blocks in position order (padding
            entries past its length are never read).
        lengths : int32 [batch], host or device
            Positions of each sequence to read, checked by the caller
            (0 <= lengths[s] <= min(max_len, max_blocks * block_size)).
        out : (batch, heads, max_len, dim) device array, last axis contiguous
        """
        batch, heads, max_len, dim = out.shape
        if batch == 0 or heads == 0 or max_len == 0 or dim == 0:
            return
        with self._ctx():
            tables = self._index_array(block_tables, np.int32)
            lens = self._index_array(lengths, np.int32)
            tmp = self._row_target(out)
            rows = batch * heads * max_len
            self._check_rows(rows, "gather_batch")
            self._gather_rows("kv_gather_batch", cache, codec, dst_kind, tmp, rows, (0, 1, 2),
                              [tables, lens, heads, max_len, tables.shape[1]])
            self._deliver_bits(tmp, out)

    def _gather_rows(self, kernel, cache, codec, dst_kind, tmp, rows, out_axes, index_args):
        """Launch ``kernel`` (paged.cu's kv_gather / kv_gather_batch, or
        lowprec.cu's ``_q`` twin for fp8 / int8 pages) over ``rows`` rows of
        ``tmp`` (strides of ``out_axes``): its arguments are tmp, the cache
        (and its scale plane), ``index_args``, the block size, the cache's
        strides (and the plane's), tmp's (and the layer scale)."""
        src_kind, bs, dim = codec.kind, cache.shape[2], cache.shape[3]
        os_ = self._estrides(tmp, out_axes)
        if codec.lowprec:
            plane, scale = self._read_scales(codec, dst_kind)
            cs = self._estrides(cache, (0, 1, 2))
            scs = self._scale_strides(plane, (0, 1, 2))
            self._q_launch(dst_kind, src_kind, kernel + "_q", rows, dim,
                           [tmp, cache, plane, *index_args, bs, *cs, *scs, *os_,
                            self._scale_bits(scale)])
            return
        cache = self._aligned_input(cache)
        cs = self._estrides(cache, (0, 1, 2))
        v = self._vector(src_kind, dst_kind, dim, [(cache, (0, 1, 2)), (tmp, out_axes)])
        self.launcher.launch("paged.cu", src_kind, dst_kind,
                             _sources.kernel_name(kernel, src_kind, dst_kind, v), rows, dim // v,
                             [tmp, cache, *index_args, bs, *cs, *os_])

    @staticmethod
    def _read_scales(codec, dst_kind):
        """``(scale_plane, layer_scale)`` a low-precision read passes its
        kernel: none for a raw read of the codes (FK == QK copies bytes)."""
        if dst_kind == codec.kind:
            return None, 1.0
        return codec.scale_plane, codec.layer_scale

    def dequantize(self, src, codec, dst, dst_kind):
        """``dst[...] = src`` read through ``codec`` as ``dst_kind``, any
        shape ``(..., dim)`` (an int8 scale plane of shape
        ``src.shape[:-1]``); through contiguous copies of the codes and
        scales when they are views.  A float codec converts; a raw read of
        codes copies them."""
        if not codec.lowprec:
            self.convert(src, codec.kind, dst, dst_kind)
            return
        if dst_kind == codec.kind:
            dst[...] = src
            return
        if src.size == 0:
            return
        xp = self.xp
        with self._ctx():
            dim = src.shape[-1]
            s = xp.ascontiguousarray(src)
            plane = codec.scale_plane
            sc = None if plane is None else xp.ascontiguousarray(self._aligned_input(plane))
            self._deliverable(dst, "dst")
            tmp = dst if dst.flags.c_contiguous and not self._misaligned(dst) \
                else xp.empty(dst.shape, dst.dtype)
            rows = src.size // dim
            self._check_rows(rows, "dequantize")
            self._q_launch(dst_kind, codec.kind, "kv_dequantize", rows, dim,
                           [tmp.view(_sources.bits_dtype(tmp.dtype)), s, sc, dim,
                            self._scale_bits(codec.layer_scale)])
            self._deliver_bits(tmp, dst)

    def write_contiguous(self, dst, src, start, src_kind, codec):
        """dst[b, h, start + t, :] = src[b, h, t, :] stored by ``codec`` (int8
        scales to the ``(batch, heads, max_seq_len)`` scale plane).
        dst: (batch, heads, max_seq_len, dim); src: (batch, heads, n, dim)."""
        batch, heads, n, dim = src.shape
        if batch == 0 or heads == 0 or n == 0 or dim == 0:
            return
        dst_kind, plane = codec.kind, codec.scale_plane
        with self._ctx():
            if self._overlaps(src, dst) or (plane is not None and self._overlaps(src, plane)):
                src = self._contiguous_copy(src)   # e.g. a view of the cache itself
            src = self.inner_contiguous(src)
            ss = self._estrides(src, (0, 1, 2))
            ds = self._estrides(dst, (0, 1, 2))
            rows = batch * heads * n
            self._check_rows(rows, "write_contiguous")
            if codec.lowprec:
                scs = self._scale_strides(plane, (0, 1, 2))
                self._q_launch(src_kind, dst_kind, "kv_write_contiguous_q", rows,
                               1 if dst_kind == dtypes.I8 else dim,
                               [dst, plane, src, heads, n, start, dim, ss[0], ss[1], ss[2],
                                ds[0], ds[1], ds[2], scs[0], scs[1], scs[2],
                                self._scale_bits(codec.layer_scale)])
                return
            v = self._vector(src_kind, dst_kind, dim, [(src, (0, 1, 2)), (dst, (0, 1, 2))])
            name = _sources.kernel_name("kv_write_contiguous", src_kind, dst_kind, v)
            self.launcher.launch("contiguous.cu", src_kind, dst_kind, name, rows, dim // v,
                                 [dst, src, heads, n, start, *ss, *ds])

    def synchronize(self):
        """Wait for everything issued on this device's current stream."""
        with self._ctx():
            self._cp.cuda.get_current_stream().synchronize()

