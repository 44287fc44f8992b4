"""CPU data-movement kernels: paged slot writes, gathers, block copies and
contiguous-cache writes, converting with the RNE routines while they copy.

Callers (``kvcore/backends/``) have validated every argument: shapes,
kinds, slot ranges, that the innermost axis of every array is contiguous,
that every array is aligned for its element type (the loops load and store
typed elements; a misaligned one is an error here, never undefined
behaviour) and that no input overlaps what the call writes (``apart``).
The loops run without the GIL.
"""
cimport numpy as cnp
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy

from libc.stdint cimport int8_t, uint8_t
from libc.stdlib cimport free, malloc

from kvcore.backends.cpu._convert cimport (KV_FP8_E4M3, KV_FP8_E5M2, KVH_BF16, KVH_F16, KVH_F32,
                                           convert_n, convert_n_stream, f32_to_fp8_rows,
                                           f32_to_i8_rows, fp8_to_f32, i8_to_f32, kind_itemsize,
                                           stream_fence)
from kvcore._native._typedefs cimport RowInput, RowWriter, block_id_t, slot_t
from kvcore.backends.cpu._span cimport byte_span

cdef extern from "kv_kinds.h":
    enum:
        KVH_F8E4M3
        KVH_F8E5M2
        KVH_I8

cnp.import_array()

# the low-precision kinds as compiled (tests/native/test_kinds.py checks the twins)
LOWPREC_KINDS = {"F8E4M3": KVH_F8E4M3, "F8E5M2": KVH_F8E5M2, "I8": KVH_I8}

import sys

import numpy as np

# Paged writes of at least this many bytes per plane use non-temporal stores:
# a prompt of several MiB is written whole and would only evict the cache.
cdef Py_ssize_t STREAM_MIN_BYTES = 4 << 20
# A sequence's rows are written with the GIL released from this many
# elements (of k and of v) on: a decode step's token is done before the
# release and retake would be.
cdef Py_ssize_t POSITIONS_NOGIL_ELEMS = 32768


cdef inline char* _ptr(cnp.ndarray a) noexcept:
    return <char*>cnp.PyArray_DATA(a)


cdef inline int _aligned(const void* p, size_t size, str what) except -1:
    if <uintptr_t>p % size:
        raise ValueError(f"internal: {what} is not aligned to {size} bytes")
    return 0


cdef inline int _aligned_array(cnp.ndarray a, str what) except -1:
    if not cnp.PyArray_ISALIGNED(a):
        raise ValueError(f"internal: {what} is not aligned for its dtype")
    return 0


def overlaps(cnp.ndarray a, cnp.ndarray b):
    """Whether the memory spans of ``a`` and ``b`` meet (one bounds check,
    as ``numpy.may_share_memory`` does by default; empty arrays never do)."""
    cdef const char* alo
    cdef const char* ahi
    cdef const char* blo
    cdef const char* bhi
    if not byte_span(a, &alo, &ahi) or not byte_span(b, &blo, &bhi):
        return False
    return alo < bhi and blo < ahi


# ---------------------------------------------------------- torch tensors in

# torch's tensor types and dtype -> NumPy type number, read from the torch
# module the first time a tensor is seen (torch is never imported here)
cdef object _torch = None
cdef tuple _tensor_types = ()
cdef dict _typenums = {}


cdef int _learn_torch(object torch) except -1:
    global _torch, _tensor_types, _typenums
    _tensor_types = (torch.Tensor, torch.nn.Parameter)
    _typenums = {
        torch.float32: cnp.NPY_FLOAT32, torch.float16: cnp.NPY_FLOAT16,
        torch.bfloat16: cnp.NPY_UINT16,   # its bits; the only tensor read as uint16
        torch.float64: cnp.NPY_FLOAT64, torch.int64: cnp.NPY_INT64,
        torch.int32: cnp.NPY_INT32, torch.int16: cnp.NPY_INT16, torch.int8: cnp.NPY_INT8,
        torch.uint8: cnp.NPY_UINT8, torch.bool: cnp.NPY_BOOL,
    }
    _torch = torch
    return 0


def tensor_meta(t):
    """``(data pointer, NumPy type number, shape)`` of ``t`` when it is a
    C-contiguous CPU torch tensor (``torch.Tensor`` or ``Parameter``,
    requiring grad or not: its data is what is read) of a dtype NumPy has,
    ``torch.bfloat16`` as uint16 (its bits); None for anything else (the
    caller takes the general path).  A handful of attribute reads: the
    direct append path reads a tensor through this without making an array."""
    tp = type(t)
    if tp not in _tensor_types:
        torch = sys.modules.get("torch")
        if torch is None or torch is _torch:
            return None
        _learn_torch(torch)
        if tp not in _tensor_types:
            return None
    try:
        num = _typenums.get(t.dtype)
        if num is None or not t.is_cpu or t.is_neg() or not t.is_contiguous():
            return None
        ptr = t.data_ptr()
        if ptr == 0 and t.numel():      # no memory (a ZeroTensor): the general path refuses it
            return None
        return ptr, num, t.shape
    except RuntimeError:    # sparse, mkldnn, ... tensors: the general path says why
        return None


# NumPy's own scalar types of integers and bools (a subclass may override
# __index__: it is the caller's code)
cdef tuple _np_scalars = tuple(np.dtype(c).type for c in "bBhHiIlLqQ?")


def runs_no_code(*args):
    """Whether converting every one of ``args`` surely runs none of the
    caller's code (``__index__``, ``__array__``, ``__int__``, a ``str``
    subclass's methods): None, exact ints, floats, bools, strs and NumPy
    integer scalars, exact NumPy arrays of numbers, exact torch tensors.  A call
    whose arguments may run code works on private copies of its inputs."""
    cdef object x
    for x in args:
        if type(x) is np.ndarray:
            if not cnp.PyArray_ISNUMBER(<cnp.ndarray>x):   # (bool, ints, floats, complex)
                return False
        elif x is None or type(x) is int or type(x) is bool or type(x) is str \
                or type(x) is float or type(x) in _np_scalars:
            pass
        elif type(x) not in _tensor_types:
            torch = sys.modules.get("torch")
            if torch is None or torch is _torch:
                return False
            _learn_torch(torch)
            if type(x) not in _tensor_types:
                return False
    return True


def tensor_view(t):
    """A NumPy array over the memory of ``t`` when :func:`tensor_meta` takes
    it (keeping the tensor alive), else None.  Cheaper than
    ``tensor.numpy()``, and the same for tensors that require grad."""
    cdef cnp.npy_intp dims[32]
    cdef int nd, i
    cdef cnp.ndarray arr
    meta = tensor_meta(t)
    if meta is None:
        return None
    ptr, typenum, shape = meta
    nd = len(shape)
    if nd > 32:
        return None
    for i in range(nd):
        dims[i] = shape[i]
    arr = cnp.PyArray_SimpleNewFromData(nd, dims, typenum, <void*><uintptr_t>ptr)
    cnp.set_array_base(arr, t)
    return arr


def apart(cnp.ndarray a, cnp.ndarray storage):
    """``a`` itself, or a C-contiguous copy of it when its memory span meets
    ``storage``'s: an input read while ``storage`` is written is then read
    as it was when the call began."""
    if overlaps(a, storage):
        return cnp.PyArray_NewCopy(a, cnp.NPY_CORDER)
    return a


# ------------------------------------------------------------ paged writes
# One token's rows are written by _write_token, whichever way its
# destination was found (a slot, or a position in a block table).

cdef inline bint _streamed(Py_ssize_t elems, int dst_kind) noexcept nogil:
    return elems * kind_itemsize(dst_kind) >= STREAM_MIN_BYTES


cdef inline void _write_token(int src_kind, const char* src, Py_ssize_t src_head,
                              int dst_kind, char* dst, Py_ssize_t dst_head,
                              Py_ssize_t heads, Py_ssize_t dim, bint stream) noexcept nogil:
    """The ``heads`` rows of ``dim`` elements of one token: src rows
    ``src_head`` bytes apart, destination rows ``dst_head`` bytes apart."""
    cdef Py_ssize_t h
    for h in range(heads):
        if stream:
            convert_n_stream(src_kind, src + h * src_head, dst_kind, dst + h * dst_head, dim)
        else:
            convert_n(src_kind, src + h * src_head, dst_kind, dst + h * dst_head, dim)


cdef struct _Plane:
    # where a layer's keys live in a pool's storage (values: one plane on)
    char* keys
    Py_ssize_t plane, block, head, token


cdef inline bint _row_slot(Py_ssize_t i, const block_id_t* table, Py_ssize_t block_size,
                           Py_ssize_t start, const slot_t* slots, Py_ssize_t* b,
                           Py_ssize_t* off) noexcept nogil:
    """Where row i goes: position start + i of the sequence whose blocks are
    ``table``, or (``slots`` not NULL) slot ``slots[i]``; False for a slot of
    -1 (the row is skipped)."""
    cdef Py_ssize_t p
    if slots != NULL:
        if slots[i] < 0:
            return False
        b[0] = slots[i] // block_size
        off[0] = slots[i] % block_size
        return True
    p = start + i
    b[0] = table[p // block_size]
    off[0] = p % block_size
    return True


cdef void _write_positions(const char* kp, const char* vp, Py_ssize_t n, Py_ssize_t heads,
                           Py_ssize_t dim, int src_kind, int dst_kind,
                           const block_id_t* table, Py_ssize_t block_size, Py_ssize_t start,
                           _Plane* dst, const slot_t* slots=NULL) noexcept nogil:
    """Rows i < n of C-contiguous k, v (n, heads, dim) to positions start + i
    of the sequence whose blocks are ``table`` (or to ``slots[i]``, see
    _row_slot)."""
    cdef Py_ssize_t i, b, off, row = heads * dim * kind_itemsize(src_kind)
    cdef char* d
    cdef bint stream = _streamed(n * heads * dim, dst_kind)
    for i in range(n):
        if not _row_slot(i, table, block_size, start, slots, &b, &off):
            continue
        d = dst.keys + b * dst.block + off * dst.token
        _write_token(src_kind, kp + i * row, dim * kind_itemsize(src_kind), dst_kind, d,
                     dst.head, heads, dim, stream)
        _write_token(src_kind, vp + i * row, dim * kind_itemsize(src_kind), dst_kind,
                     d + dst.plane, dst.head, heads, dim, stream)
    if stream:
        stream_fence()


cdef inline void _plane_of(cnp.ndarray storage, Py_ssize_t layer, _Plane* out) noexcept:
    # storage: (2 * num_layers, num_blocks, heads, block_size, dim), C-contiguous;
    # layer l's keys are plane 2 * l, its values the plane after
    out.plane = cnp.PyArray_STRIDE(storage, 0)
    out.block = cnp.PyArray_STRIDE(storage, 1)
    out.head = cnp.PyArray_STRIDE(storage, 2)
    out.token = cnp.PyArray_STRIDE(storage, 3)
    out.keys = _ptr(storage) + 2 * layer * out.plane


cdef object _write_positions_float(cnp.ndarray storage, Py_ssize_t layer, cnp.ndarray k,
                                  cnp.ndarray v, const block_id_t[::1] block_table,
                                  Py_ssize_t start, int src_kind, int dst_kind):
    """Rows i of k and v (n, heads, dim) to positions start + i of the
    sequence whose blocks are ``block_table``, in layer ``layer``'s planes of
    ``storage`` (see Backend.write_positions).  k, v: C-contiguous, aligned,
    apart from storage; storage C-contiguous."""
    cdef _Plane plane
    cdef Py_ssize_t n = k.shape[0], heads = k.shape[1], dim = k.shape[2]
    cdef const char* kp = _ptr(k)
    cdef const char* vp = _ptr(v)
    _aligned_array(k, "k")
    _aligned_array(v, "v")
    _aligned_array(storage, "storage")
    if n == 0:
        return
    _aligned(&block_table[0], sizeof(block_id_t), "block_table")
    _plane_of(storage, layer, &plane)
    if n * heads * dim >= POSITIONS_NOGIL_ELEMS:
        with nogil:
            _write_positions(kp, vp, n, heads, dim, src_kind, dst_kind, &block_table[0],
                             storage.shape[3], start, &plane)
    else:
        _write_positions(kp, vp, n, heads, dim, src_kind, dst_kind, &block_table[0],
                         storage.shape[3], start, &plane)


cdef struct _Rows:
    # a k or v input a PositionWriter takes as it is: (n, heads, dim)
    # C-contiguous rows at p, of element kind ``kind`` (-1: not such an input)
    const char* p
    Py_ssize_t n, h, d, nbytes
    int kind


cdef int _rows_of(object x, _Rows* r, bint one_column=False) except -1:
    """Fill ``r`` from a NumPy array or a CPU torch tensor (read in place,
    through its pointer): 3-D, native float32 or float16 (a tensor also
    bfloat16), C-contiguous and aligned; else r.kind = -1.  ``one_column``:
    a 4-D (n, heads, 1, dim) one too (transformers' K/V of one position,
    the same memory as (n, heads, dim))."""
    cdef cnp.ndarray a
    cdef int typenum
    r.kind = -1
    if type(x) is np.ndarray:
        a = <cnp.ndarray>x
        if cnp.PyArray_NDIM(a) != 3 or not cnp.PyArray_ISCARRAY_RO(a) \
                or not cnp.PyArray_ISNOTSWAPPED(a):
            return 0
        typenum = cnp.PyArray_TYPE(a)
        if typenum == cnp.NPY_UINT16:     # bits of what? only a tensor says bfloat16
            return 0
        r.p = <const char*>cnp.PyArray_DATA(a)
        r.n = cnp.PyArray_DIM(a, 0)
        r.h = cnp.PyArray_DIM(a, 1)
        r.d = cnp.PyArray_DIM(a, 2)
    else:
        meta = tensor_meta(x)      # a C-contiguous CPU torch tensor
        if meta is None:
            return 0
        ptr, typenum, shape = meta
        if len(shape) == 4 and one_column and shape[2] == 1:
            r.n, r.h, _, r.d = shape
        elif len(shape) == 3:
            r.n, r.h, r.d = shape
        else:
            return 0
        r.p = <const char*><uintptr_t>ptr
    if typenum == cnp.NPY_FLOAT32:
        r.kind = KVH_F32
    elif typenum == cnp.NPY_FLOAT16:
        r.kind = KVH_F16
    elif typenum == cnp.NPY_UINT16:       # tensor_meta: a torch.bfloat16 tensor's bits
        r.kind = KVH_BF16
    else:
        return 0
    r.nbytes = r.n * r.h * r.d * kind_itemsize(r.kind)
    if <uintptr_t>r.p % kind_itemsize(r.kind):
        r.kind = -1
    return 0


cdef class PositionWriter(RowWriter):
    """A CPU pool's one native writer (``Backend.position_writer``): a
    sequence's bookkeeping hands it the k and v of an append and, once the
    blocks are reserved, the block table and first position (``take`` /
    ``write``); kvcore.hf hands it a decode step's k and v with their slots
    (``write_slots``).  Both write with ``_write_positions``, as
    ``write_positions`` does, and take, as they are, NumPy arrays and CPU
    torch tensors (n >= 1, heads, dim) of one native-order float32 or
    float16 dtype (torch: bfloat16 too), C-contiguous, aligned and apart
    from the storage and the scale planes; anything else is left to the
    caller's validated path (``BlockPool.write``).  The scales are the
    fields of the pool's codecs, every plane at once."""
    cdef cnp.ndarray storage
    cdef int kind
    cdef Py_ssize_t heads, dim, block_size
    cdef const char* lo
    cdef const char* hi
    # low-precision pools: int8 scale planes (or None), fp8 per-layer scales
    cdef bint lowprec
    cdef object scale_planes
    cdef float* sc
    cdef object layer_scales
    cdef float* ls
    cdef object head_scales  # fp8, one scale per kv head: (num_layers, 2, heads), or None
    cdef const float* hs
    cdef const char* slo     # the scale planes' bytes (an input may not meet them either)
    cdef const char* shi

    def __init__(self, cnp.ndarray storage, int kind, scale_planes=None, layer_scales=None,
                 head_scales=None):
        if cnp.PyArray_NDIM(storage) != 5 or not cnp.PyArray_IS_C_CONTIGUOUS(storage) \
                or not cnp.PyArray_ISALIGNED(storage):
            raise ValueError("internal: a PositionWriter needs a C-contiguous, aligned "
                             "(planes, blocks, heads, block_size, dim) storage")
        self.storage = storage
        self.kind = kind
        self.heads = storage.shape[2]
        self.block_size = storage.shape[3]
        self.dim = storage.shape[4]
        self.lo = _ptr(storage)
        self.hi = self.lo + cnp.PyArray_NBYTES(storage)
        self.lowprec = kind == KVH_F8E4M3 or kind == KVH_F8E5M2 or kind == KVH_I8
        self.scale_planes = scale_planes
        self.sc = _scale_ptr(scale_planes)
        self.slo = self.shi = NULL
        if self.sc != NULL:
            self.slo = <const char*>self.sc
            self.shi = self.slo + cnp.PyArray_NBYTES(<cnp.ndarray>scale_planes)
        if kind == KVH_I8 and self.sc == NULL:
            raise ValueError("internal: an int8 pool's writer needs its scale planes")
        self.layer_scales = None
        self.ls = NULL
        if layer_scales is not None:
            self.layer_scales = np.ascontiguousarray(layer_scales, np.float32)
            self.ls = <float*>cnp.PyArray_DATA(<cnp.ndarray>self.layer_scales)
        self.head_scales = None
        self.hs = NULL
        if head_scales is not None:
            self.head_scales = np.ascontiguousarray(head_scales, np.float32)
            self.hs = _head_ptr(self.head_scales, storage.shape[0] * self.heads)

    cdef Py_ssize_t take(self, object k, object v, RowInput* rows) except -2:
        return self._take(k, v, rows, False)

    cdef Py_ssize_t _take(self, object k, object v, RowInput* rows, bint one_column) except -2:
        cdef _Rows kr_, vr_
        cdef _Rows* kr = &kr_
        cdef _Rows* vr = &vr_
        _rows_of(k, kr, one_column)
        _rows_of(v, vr, one_column)
        if kr.kind < 0 or vr.kind != kr.kind or kr.n < 1 or vr.n != kr.n \
                or kr.h != self.heads or vr.h != self.heads or kr.d != self.dim \
                or vr.d != self.dim:
            return -1
        if self._overlaps(kr.p, kr.nbytes) or self._overlaps(vr.p, vr.nbytes):
            return -1      # a view of the storage or scale planes: the validated path stages it
        rows.k = kr.p
        rows.v = vr.p
        rows.n = kr.n
        rows.kind = kr.kind
        return kr.n

    cdef bint _overlaps(self, const char* p, Py_ssize_t nbytes) noexcept:
        """Whether bytes [p, p + nbytes) meet the storage or the scale planes
        (which a write rewrites)."""
        if p < self.hi and self.lo < p + nbytes:
            return True
        return self.slo != NULL and p < self.shi and self.slo < p + nbytes

    cdef int write(self, Py_ssize_t layer, const RowInput* rows, const block_id_t* table,
                   Py_ssize_t start) except -1:
        return self._write(layer, rows, table, start, NULL)

    def write_slots(self, layer, k, v, slots):
        """Row i of ``k`` and ``v`` to slot ``slots[i]`` (-1: skipped) of layer
        ``layer``: a step's K/V through a CPU pool's own writer, with no
        array made.  ``k``, ``v``: what ``take`` accepts, or CPU torch
        tensors ``(n, heads, 1, dim)`` (one position per row: transformers'
        layout of a decode step); ``slots``: int64, 1-D, C-contiguous, n
        entries.  True when written; False (nothing written) for anything
        else, a layer or slot out of range included: the caller then takes
        the validated path (``BlockPool.write``), which says what is wrong."""
        cdef RowInput rows
        cdef cnp.ndarray s
        cdef const slot_t* sp
        cdef slot_t* own
        cdef Py_ssize_t i, l, limit = self.storage.shape[1] * self.block_size
        if type(layer) is not int or type(slots) is not np.ndarray:
            return False
        s = <cnp.ndarray>slots
        if cnp.PyArray_TYPE(s) != cnp.NPY_INT64 or cnp.PyArray_NDIM(s) != 1 \
                or not cnp.PyArray_ISCARRAY_RO(s) or not cnp.PyArray_ISNOTSWAPPED(s):
            return False
        if not 0 <= layer < self.storage.shape[0] // 2:
            return False
        l = layer
        if self._take(k, v, &rows, True) < 0 or rows.n != cnp.PyArray_DIM(s, 0):
            return False
        sp = <const slot_t*>cnp.PyArray_DATA(s)
        if self._overlaps(<const char*>sp, rows.n * <Py_ssize_t>sizeof(slot_t)):
            return False   # slots in the storage or the scales: rewritten while read
        # A private copy, checked and then used: the caller's array may be
        # rewritten by another thread while the write runs without the GIL.
        own = <slot_t*>malloc(max(rows.n, 1) * sizeof(slot_t))
        if own == NULL:
            raise MemoryError()
        try:
            memcpy(own, sp, rows.n * sizeof(slot_t))
            for i in range(rows.n):
                if own[i] < -1 or own[i] >= limit:
                    return False
            self._write(l, &rows, NULL, 0, own)
        finally:
            free(own)
        return True

    cdef int _write(self, Py_ssize_t layer, const RowInput* rows, const block_id_t* table,
                    Py_ssize_t start, const slot_t* slots) except -1:
        cdef _Plane plane
        cdef Py_ssize_t n = rows.n
        cdef Py_ssize_t per_plane = self.storage.shape[1] * self.heads * self.block_size
        cdef float* k_sc = NULL
        cdef float ks = 1.0, vs = 1.0
        cdef const float* k_hs = NULL
        cdef const float* v_hs = NULL
        cdef float* buf
        _plane_of(self.storage, layer, &plane)
        if self.lowprec:
            # a scratch row per call: writes of one pool may run at once in
            # several threads (each without the GIL)
            buf = _scratch(self.dim)
            if self.sc != NULL:
                k_sc = self.sc + 2 * layer * per_plane
            if self.ls != NULL:
                ks = self.ls[2 * layer]
                vs = self.ls[2 * layer + 1]
            if self.hs != NULL:
                k_hs = self.hs + 2 * layer * self.heads
                v_hs = k_hs + self.heads
            try:
                with nogil:
                    _write_positions_q(rows.k, rows.v, n, self.heads, self.dim, rows.kind,
                                       self.kind, table, self.block_size, start, &plane, ks, vs,
                                       k_sc, (k_sc + per_plane) if k_sc != NULL else NULL, buf,
                                       k_hs, v_hs, slots)
            finally:
                free(buf)
            return 0
        if n * self.heads * self.dim >= POSITIONS_NOGIL_ELEMS:
            with nogil:
                _write_positions(rows.k, rows.v, n, self.heads, self.dim, rows.kind,
                                 self.kind, table, self.block_size, start, &plane, slots)
        else:
            _write_positions(rows.k, rows.v, n, self.heads, self.dim, rows.kind, self.kind,
                             table, self.block_size, start, &plane, slots)
        return 0


cdef int _copy_blocks(cnp.ndarray src_storage, const block_id_t[::1] src,
                     cnp.ndarray dst_storage, const block_id_t[::1] dst) except -1:
    """dst_storage[:, dst[i]] = src_storage[:, src[i]] for each i in order,
    every plane: storages of one geometry and dtype, (planes, num_blocks,
    ...) C-contiguous (the same storage for a copy within a pool)."""
    cdef Py_ssize_t planes = src_storage.shape[0]
    cdef Py_ssize_t sp_stride = src_storage.strides[0], sb_stride = src_storage.strides[1]
    cdef Py_ssize_t dp_stride = dst_storage.strides[0], db_stride = dst_storage.strides[1]
    cdef char* sbase = _ptr(src_storage)
    cdef char* dbase = _ptr(dst_storage)
    cdef Py_ssize_t i, p, n = src.shape[0]
    if n:
        _aligned(&src[0], sizeof(block_id_t), "src")
        _aligned(&dst[0], sizeof(block_id_t), "dst")
    with nogil:
        for p in range(planes):
            for i in range(n):
                memcpy(dbase + p * dp_stride + dst[i] * db_stride,
                       sbase + p * sp_stride + src[i] * sb_stride, sb_stride)
    return 0


def copy_blocks(cnp.ndarray storage, const block_id_t[::1] src, const block_id_t[::1] dst):
    """storage[:, dst[i]] = storage[:, src[i]] for every layer and K/V plane;
    storage: (planes, num_blocks, heads, block_size, dim), C-contiguous."""
    _copy_blocks(storage, src, storage, dst)


def copy_blocks_between(cnp.ndarray src_storage, const block_id_t[::1] src,
                        cnp.ndarray dst_storage, const block_id_t[::1] dst):
    """dst_storage[:, dst[i]] = src_storage[:, src[i]]: two pools' storage of
    the same geometry and dtype, (planes, num_blocks, ...) C-contiguous."""
    _copy_blocks(src_storage, src, dst_storage, dst)


cdef object _write_contiguous_float(cnp.ndarray dst, cnp.ndarray src, Py_ssize_t start,
                                    int src_kind, int dst_kind):
    """dst[b, h, start + t, :] = src[b, h, t, :].

    dst: (batch, heads, max_seq_len, dim), C-contiguous.
    src: (batch, heads, n, dim), last axis contiguous, any other strides.
    When src rows are back to back the n*dim run is one kernel call.
    """
    cdef Py_ssize_t B = src.shape[0], H = src.shape[1], n = src.shape[2], D = src.shape[3]
    cdef Py_ssize_t s0 = src.strides[0], s1 = src.strides[1], s2 = src.strides[2]
    cdef Py_ssize_t d0 = dst.strides[0], d1 = dst.strides[1], d2 = dst.strides[2]
    cdef Py_ssize_t si = kind_itemsize(src_kind)
    cdef bint rows_packed = s2 == D * si or n == 1
    cdef char* sp = _ptr(src)
    cdef char* dp = _ptr(dst) + start * d2
    cdef Py_ssize_t b, h, t
    _aligned_array(src, "src")
    _aligned_array(dst, "dst")
    with nogil:
        for b in range(B):
            for h in range(H):
                if rows_packed:
                    convert_n(src_kind, sp + b * s0 + h * s1, dst_kind,
                              dp + b * d0 + h * d1, n * D)
                else:
                    for t in range(n):
                        convert_n(src_kind, sp + b * s0 + h * s1 + t * s2, dst_kind,
                                  dp + b * d0 + h * d1 + t * d2, D)


# ------------------------------------------------------- low-precision storage
# fp8 (e4m3fn, e5m2; a per-layer float32 scale) and int8 (one float32 scale
# per token and kv head, in a scale plane (num_blocks, heads, block_size)
# beside the codes).  Every element goes through float32: a float16/bf16
# input row is widened (exactly) into a scratch row first, and a widened
# output is the float32 value converted once more.  The conversions are
# _convert's (kv_fp8.h): the bits of the NumPy reference (backends/base.py).

cdef inline int _fp8_fmt(int kind) noexcept nogil:
    return KV_FP8_E4M3 if kind == KVH_F8E4M3 else KV_FP8_E5M2


cdef inline void _store_rows_q(int src_kind, const char* src, Py_ssize_t src_row, int dst_kind,
                               char* dst, Py_ssize_t dst_row, Py_ssize_t rows, Py_ssize_t dim,
                               float scale, const float* rs, float* sc_out, Py_ssize_t sc_row,
                               float* buf, bint stream) noexcept nogil:
    """``rows`` rows of ``dim`` elements (``src_row`` / ``dst_row`` bytes
    apart) into low-precision ``dst_kind``; int8 writes row r's scale to
    ``sc_out[r * sc_row]`` (sc_out: NULL for fp8).  fp8: row r is divided by
    ``rs[r]`` (per-kv-head scales; NULL: by ``scale``).  A float16/bf16 row
    is widened into ``buf`` (dim floats) first.  ``stream``: non-temporal
    stores where a row allows them (the caller fences)."""
    cdef Py_ssize_t r
    if src_kind == KVH_F32 and rs != NULL and dst_kind != KVH_I8:
        for r in range(rows):
            f32_to_fp8_rows(_fp8_fmt(dst_kind), <const float*>(src + r * src_row), 0,
                            <uint8_t*>(dst + r * dst_row), 0, 1, dim, rs[r], 1, stream)
        return
    if src_kind == KVH_F32:
        if dst_kind == KVH_I8:
            f32_to_i8_rows(<const float*>src, src_row, <int8_t*>dst, dst_row, sc_out, sc_row,
                           rows, dim, stream)
        else:
            f32_to_fp8_rows(_fp8_fmt(dst_kind), <const float*>src, src_row, <uint8_t*>dst,
                            dst_row, rows, dim, scale, 1, stream)
        return
    for r in range(rows):
        convert_n(src_kind, src + r * src_row, KVH_F32, buf, dim)
        if dst_kind == KVH_I8:
            f32_to_i8_rows(buf, 0, <int8_t*>(dst + r * dst_row), 0, sc_out + r * sc_row, 0, 1,
                           dim, stream)
        else:
            f32_to_fp8_rows(_fp8_fmt(dst_kind), buf, 0, <uint8_t*>(dst + r * dst_row), 0, 1, dim,
                            rs[r] if rs != NULL else scale, 1, stream)


cdef inline void _load_run_q(int src_kind, const char* src, Py_ssize_t run, Py_ssize_t dim,
                             const float* sc, int dst_kind, char* dst, float scale,
                             float* buf) noexcept nogil:
    """``run`` consecutive rows of ``dim`` low-precision elements widened to
    float ``dst_kind`` (int8: row r's scale is ``sc[r]``); ``buf`` holds
    ``run * dim`` floats when dst_kind is not float32."""
    cdef float* f = <float*>dst if dst_kind == KVH_F32 else buf
    cdef Py_ssize_t r
    if src_kind == KVH_I8:
        for r in range(run):
            i8_to_f32(<const int8_t*>src + r * dim, f + r * dim, dim, sc[r])
    else:
        fp8_to_f32(_fp8_fmt(src_kind), <const uint8_t*>src, f, run * dim, scale)
    if dst_kind != KVH_F32:
        convert_n(KVH_F32, f, dst_kind, dst, run * dim)


cdef float* _scratch(Py_ssize_t n) except NULL:
    cdef float* p = <float*>malloc((n if n > 0 else 1) * sizeof(float))
    if p == NULL:
        raise MemoryError("cannot allocate a conversion scratch row")
    return p


cdef inline float* _scale_ptr(object scales) except? NULL:
    """float32 data of a C-contiguous int8 scale plane, or NULL (fp8)."""
    cdef cnp.ndarray a
    if scales is None:
        return NULL
    a = <cnp.ndarray>scales
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(a) \
            or not cnp.PyArray_ISALIGNED(a):
        raise ValueError("internal: a scale plane must be C-contiguous aligned float32")
    return <float*>cnp.PyArray_DATA(a)


cdef inline const float* _head_ptr(object head_scales, Py_ssize_t n) except? NULL:
    """float32 data of an fp8 plane's per-kv-head scales ((n,) C-contiguous),
    or NULL (None: the plane's one scale)."""
    cdef cnp.ndarray a
    if head_scales is None:
        return NULL
    a = <cnp.ndarray?>head_scales
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(a) \
            or not cnp.PyArray_ISALIGNED(a) or cnp.PyArray_SIZE(a) != n:
        raise ValueError(f"internal: head scales must be C-contiguous aligned float32 ({n},)")
    return <const float*>cnp.PyArray_DATA(a)


cdef object _write_slots(cnp.ndarray cache, object scales, cnp.ndarray src,
                         const slot_t[::1] slots, int src_kind, int dst_kind, float scale,
                         object head_scales=None):
    """cache[b, h, off, :] = src[i, h, :] stored as ``dst_kind`` for slot
    s = slots[i] >= 0, b = s // block_size, off = s % block_size: float kinds
    converted, low-precision ones encoded (fp8(x / scale); int8 with each
    row's scale to ``scales``, the plane's (num_blocks, heads, block_size)
    float32, C-contiguous, else None).

    cache: (num_blocks, heads, block_size, dim), C-contiguous.
    src: (n, heads, dim), last axis contiguous, any other strides.
    """
    cdef Py_ssize_t n = src.shape[0], H = src.shape[1], D = src.shape[2]
    cdef Py_ssize_t bs = cache.shape[2]
    cdef Py_ssize_t s0 = src.strides[0], s1 = src.strides[1]
    cdef Py_ssize_t c_block = cache.strides[0], c_head = cache.strides[1], c_tok = cache.strides[2]
    cdef char* sp = _ptr(src)
    cdef char* cp = _ptr(cache)
    cdef float* sc = _scale_ptr(scales)
    cdef const float* hs = _head_ptr(head_scales, H)
    cdef Py_ssize_t i, b, off
    cdef slot_t s
    cdef float* buf = NULL
    cdef bint encode = _lowprec(dst_kind)
    # (low-precision codes are one byte each)
    cdef bint stream = (n * H * D >= STREAM_MIN_BYTES) if encode else _streamed(n * H * D, dst_kind)
    _aligned_array(src, "src")
    _aligned_array(cache, "cache")
    if n:
        _aligned(&slots[0], sizeof(slot_t), "slots")
    if dst_kind == KVH_I8 and sc == NULL:
        raise ValueError("internal: an int8 plane needs its scales")
    if encode:
        buf = _scratch(D)
    try:
        with nogil:
            for i in range(n):
                s = slots[i]
                if s < 0:
                    continue
                b = s // bs
                off = s - b * bs
                if encode:
                    _store_rows_q(src_kind, sp + i * s0, s1, dst_kind,
                                  cp + b * c_block + off * c_tok, c_head, H, D, scale, hs,
                                  (sc + b * H * bs + off) if sc != NULL else NULL, bs, buf,
                                  stream)
                else:
                    _write_token(src_kind, sp + i * s0, s1, dst_kind,
                                 cp + b * c_block + off * c_tok, c_head, H, D, stream)
            if stream:
                stream_fence()
    finally:
        free(buf)


cdef void _write_positions_q(const char* kp, const char* vp, Py_ssize_t n, Py_ssize_t heads,
                             Py_ssize_t dim, int src_kind, int dst_kind,
                             const block_id_t* table, Py_ssize_t block_size, Py_ssize_t start,
                             _Plane* dst, float k_scale, float v_scale, float* k_sc,
                             float* v_sc, float* buf, const float* k_hs=NULL,
                             const float* v_hs=NULL, const slot_t* slots=NULL) noexcept nogil:
    """_write_positions into low-precision planes: fp8 with the layer's
    scales (or its per-kv-head ones, k_hs / v_hs, when not NULL), int8 writing each row's scale to the scale planes k_sc / v_sc
    ((num_blocks, heads, block_size) float32; NULL for fp8).  ``slots``: as
    for _write_positions."""
    cdef Py_ssize_t i, b, off, row = heads * dim * kind_itemsize(src_kind)
    cdef Py_ssize_t src_head = dim * kind_itemsize(src_kind)
    cdef char* d
    cdef Py_ssize_t si
    cdef bint stream = n * heads * dim >= STREAM_MIN_BYTES      # 1-byte codes
    for i in range(n):
        if not _row_slot(i, table, block_size, start, slots, &b, &off):
            continue
        d = dst.keys + b * dst.block + off * dst.token
        si = b * heads * block_size + off
        _store_rows_q(src_kind, kp + i * row, src_head, dst_kind, d, dst.head, heads, dim,
                      k_scale, k_hs, (k_sc + si) if k_sc != NULL else NULL, block_size, buf,
                      stream)
        _store_rows_q(src_kind, vp + i * row, src_head, dst_kind, d + dst.plane, dst.head, heads,
                      dim, v_scale, v_hs, (v_sc + si) if v_sc != NULL else NULL, block_size, buf,
                      stream)
    if stream:
        stream_fence()


cdef object _write_positions_lowprec(cnp.ndarray storage, Py_ssize_t layer, cnp.ndarray k,
                               cnp.ndarray v, const block_id_t[::1] block_table,
                               Py_ssize_t start, int src_kind, int dst_kind, float k_scale,
                               float v_scale, object k_scale_plane, object v_scale_plane,
                               object k_head_scales=None, object v_head_scales=None):
    """write_positions into a low-precision pool's storage; the scale
    planes: int8 only, the layer's key and value scales (num_blocks, heads,
    block_size), else None."""
    cdef _Plane plane
    cdef Py_ssize_t n = k.shape[0], heads = k.shape[1], dim = k.shape[2]
    cdef float* k_sc = _scale_ptr(k_scale_plane)
    cdef float* v_sc = _scale_ptr(v_scale_plane)
    cdef const float* k_hs = _head_ptr(k_head_scales, heads)
    cdef const float* v_hs = _head_ptr(v_head_scales, heads)
    cdef float* buf
    _aligned_array(k, "k")
    _aligned_array(v, "v")
    if n == 0:
        return
    _aligned(&block_table[0], sizeof(block_id_t), "block_table")
    if dst_kind == KVH_I8 and (k_sc == NULL or v_sc == NULL):
        raise ValueError("internal: an int8 plane needs its scales")
    _plane_of(storage, layer, &plane)
    cdef const char* kp = _ptr(k)
    cdef const char* vp = _ptr(v)
    buf = _scratch(dim)
    try:
        with nogil:
            _write_positions_q(kp, vp, n, heads, dim, src_kind, dst_kind,
                               &block_table[0], storage.shape[3], start, &plane, k_scale,
                               v_scale, k_sc, v_sc, buf, k_hs, v_hs)
    finally:
        free(buf)


cdef object _gather(cnp.ndarray cache, object scales, const block_id_t[::1] block_table,
                    Py_ssize_t start, Py_ssize_t end, cnp.ndarray out, int src_kind,
                    int dst_kind, float scale, object head_scales=None):
    """out[h, t - start, :] = cache[block_table[t // bs], h, t % bs, :]
    for t in start..end-1, read as ``dst_kind``: float planes converted, a
    low-precision plane widened (fp8 * scale, int8 code * its row's scale in
    ``scales``, else None) or its codes copied raw.

    cache: (num_blocks, heads, block_size, dim), C-contiguous.
    out: (heads, end - start, dim), C-contiguous, aligned.
    Moves one run of up to block_size tokens per (block, head).
    """
    cdef Py_ssize_t H = cache.shape[1], bs = cache.shape[2], D = cache.shape[3]
    cdef Py_ssize_t c_block = cache.strides[0], c_head = cache.strides[1], c_tok = cache.strides[2]
    cdef Py_ssize_t o_head = out.strides[0], o_tok = out.strides[1]
    cdef char* cp = _ptr(cache)
    cdef char* op = _ptr(out)
    cdef float* sc = _scale_ptr(scales)
    cdef const float* hs = _head_ptr(head_scales, H)
    cdef Py_ssize_t t = start, stop, off, run, h
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(cache)
    cdef block_id_t b
    cdef const char* src
    cdef char* dst
    cdef float* buf = NULL
    cdef bint widen = _lowprec(src_kind) and dst_kind != src_kind
    # a low-precision plane read as its own kind: its codes, copied
    cdef bint raw = src_kind == dst_kind and _lowprec(src_kind)
    _aligned_array(out, "out")
    _aligned_array(cache, "cache")
    if widen and src_kind == KVH_I8 and sc == NULL:
        raise ValueError("internal: an int8 plane needs its scales")
    if block_table.shape[0]:
        _aligned(&block_table[0], sizeof(block_id_t), "block_table")
    if widen:
        buf = _scratch(bs * D if dst_kind != KVH_F32 else 1)
    try:
        with nogil:
            while t < end:
                b = block_table[t // bs]
                off = t % bs
                stop = t - off + bs
                if stop > end:
                    stop = end
                run = stop - t
                for h in range(H):
                    src = cp + b * c_block + h * c_head + off * c_tok
                    dst = op + h * o_head + (t - start) * o_tok
                    if widen:
                        _load_run_q(src_kind, src, run, D,
                                    (sc + (b * H + h) * bs + off) if sc != NULL else NULL,
                                    dst_kind, dst, hs[h] if hs != NULL else scale, buf)
                    elif raw:
                        memcpy(dst, src, run * D * item)
                    else:
                        convert_n(src_kind, src, dst_kind, dst, run * D)
                t = stop
    finally:
        free(buf)


cdef object _write_contiguous_lowprec(cnp.ndarray dst, object scales, cnp.ndarray src,
                                Py_ssize_t start, int src_kind, int dst_kind, float scale,
                                object head_scales=None):
    """dst[b, h, start + t, :] = src[b, h, t, :] into a low-precision
    contiguous cache (dst C-contiguous; int8 scales (batch, heads,
    max_seq_len) float32 C-contiguous, else None)."""
    cdef Py_ssize_t B = src.shape[0], H = src.shape[1], n = src.shape[2], D = src.shape[3]
    cdef Py_ssize_t s0 = src.strides[0], s1 = src.strides[1], s2 = src.strides[2]
    cdef Py_ssize_t d0 = dst.strides[0], d1 = dst.strides[1], d2 = dst.strides[2]
    cdef Py_ssize_t L = dst.shape[2]
    cdef char* sp = _ptr(src)
    cdef char* dp = _ptr(dst)
    cdef float* sc = _scale_ptr(scales)
    cdef const float* hs = _head_ptr(head_scales, H)
    cdef Py_ssize_t b, h
    cdef float* buf
    cdef bint stream = B * H * n * D >= STREAM_MIN_BYTES        # 1-byte codes
    _aligned_array(src, "src")
    buf = _scratch(D)
    try:
        with nogil:
            for b in range(B):
                for h in range(H):
                    _store_rows_q(src_kind, sp + b * s0 + h * s1, s2, dst_kind,
                                  dp + b * d0 + h * d1 + start * d2, d2, n, D,
                                  hs[h] if hs != NULL else scale, NULL, (sc + (b * H + h) * L + start) if sc != NULL else NULL, 1,
                                  buf, stream)
            if stream:
                stream_fence()
    finally:
        free(buf)


def dequantize(cnp.ndarray src, object scale_plane, int src_kind, cnp.ndarray dst,
               int dst_kind, float layer_scale, object row_scales=None):
    """dst = src widened: C-contiguous (rows, dim) views of the same shape
    (int8: ``scale_plane`` flat, (rows,) float32 C-contiguous; fp8 with
    per-kv-head scales: ``row_scales``, each row's head's, (rows,) float32
    C-contiguous, else ``layer_scale``)."""
    cdef Py_ssize_t rows = src.shape[0], D = src.shape[1], r
    cdef float* sc = _scale_ptr(scale_plane)
    cdef const float* rs = _head_ptr(row_scales, rows)
    cdef float* buf
    cdef char* sp = _ptr(src)
    cdef char* dp = _ptr(dst)
    cdef Py_ssize_t drow = D * kind_itemsize(dst_kind)
    _aligned_array(dst, "dst")
    buf = _scratch(D if dst_kind != KVH_F32 else 1)
    try:
        with nogil:
            for r in range(rows):
                _load_run_q(src_kind, sp + r * D, 1, D, (sc + r) if sc != NULL else NULL,
                            dst_kind, dp + r * drow, rs[r] if rs != NULL else layer_scale, buf)
    finally:
        free(buf)


# ------------------------------------------------------------ one entry per op
# Each op dispatches on the storage kind to its float loop (convert_n while
# copying) or its low-precision loop (through float32, fp8 scale, int8 scale
# plane): the Python side (backend.py) calls one name whatever the format.

cdef inline bint _lowprec(int kind) noexcept:
    return kind == KVH_F8E4M3 or kind == KVH_F8E5M2 or kind == KVH_I8


def write_slots(cnp.ndarray cache, cnp.ndarray src, const slot_t[::1] slots, int src_kind,
                int dst_kind, float layer_scale=1.0, object scale_plane=None,
                object head_scales=None):
    """cache[b, h, off, :] = src[i, h, :] stored as ``dst_kind`` for slot
    s = slots[i] >= 0, b = s // block_size, off = s % block_size
    (Backend.write_slots).

    cache: (num_blocks, heads, block_size, dim), C-contiguous.
    src: (n, heads, dim), last axis contiguous, any other strides.
    fp8: stored fp8(x / layer_scale) (or per kv head: ``head_scales``);
    int8: ``scale_plane`` the plane's (num_blocks, heads, block_size)
    float32 scales, C-contiguous (the fields of the plane's Codec).
    """
    _write_slots(cache, scale_plane, src, slots, src_kind, dst_kind, layer_scale, head_scales)


def write_positions(cnp.ndarray storage, Py_ssize_t layer, cnp.ndarray k, cnp.ndarray v,
                    const block_id_t[::1] block_table, Py_ssize_t start, int src_kind,
                    int dst_kind, float k_layer_scale=1.0, float v_layer_scale=1.0,
                    object k_scale_plane=None, object v_scale_plane=None,
                    object k_head_scales=None, object v_head_scales=None):
    """Rows i of k and v (n, heads, dim) to positions start + i of the
    sequence whose blocks are ``block_table``, in layer ``layer``'s planes of
    ``storage`` (see Backend.write_positions).  k, v: C-contiguous, aligned,
    apart from storage; storage C-contiguous.  The fields of the k and v
    planes' codecs: fp8 their layer scales (or head scales), int8 their
    scale planes."""
    if _lowprec(dst_kind):
        _write_positions_lowprec(storage, layer, k, v, block_table, start, src_kind, dst_kind,
                                 k_layer_scale, v_layer_scale, k_scale_plane, v_scale_plane,
                                 k_head_scales, v_head_scales)
    else:
        _write_positions_float(storage, layer, k, v, block_table, start, src_kind, dst_kind)


def gather(cnp.ndarray cache, const block_id_t[::1] block_table, Py_ssize_t start,
           Py_ssize_t end, cnp.ndarray out, int src_kind, int dst_kind, float layer_scale=1.0,
           object scale_plane=None, object head_scales=None):
    """out[h, t - start, :] = cache[block_table[t // bs], h, t % bs, :]
    for t in start..end-1, read as ``dst_kind`` (Backend.gather): a
    low-precision plane widened to a float kind (fp8 * layer_scale, or its
    head's scale; code * scale_plane[block, head, offset]), or its codes
    copied raw.

    cache: (num_blocks, heads, block_size, dim), C-contiguous.
    out: (heads, end - start, dim), C-contiguous, aligned.
    """
    _gather(cache, scale_plane, block_table, start, end, out, src_kind, dst_kind, layer_scale,
            head_scales)


def write_contiguous(cnp.ndarray dst, cnp.ndarray src, Py_ssize_t start, int src_kind,
                     int dst_kind, float layer_scale=1.0, object scale_plane=None,
                     object head_scales=None):
    """dst[b, h, start + t, :] = src[b, h, t, :] stored as ``dst_kind``.

    dst: (batch, heads, max_seq_len, dim), C-contiguous.
    src: (batch, heads, n, dim), last axis contiguous, any other strides.
    fp8: stored fp8(x / layer_scale) (or per kv head: ``head_scales``);
    int8: ``scale_plane`` (batch, heads, max_seq_len) float32, C-contiguous.
    """
    if _lowprec(dst_kind):
        _write_contiguous_lowprec(dst, scale_plane, src, start, src_kind, dst_kind, layer_scale,
                                  head_scales)
    else:
        _write_contiguous_float(dst, src, start, src_kind, dst_kind)
